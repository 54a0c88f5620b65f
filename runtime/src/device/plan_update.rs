//! Training steps whose optimizer update runs in the Plan
//! (`codegen::optimizer`), shared by the Cpu and Cuda executors so the
//! protocol the GPU follows is the one the Cpu tests exercise.
//!
//! Per step the host writes the schedule's values (a few numbers per
//! parameter) and the tokens, runs the whole Plan, and reads back the loss,
//! the gradient norm and the new parameters. Parameters and moments stay on
//! the device: parameters are uploaded only when the set handed in is not
//! the one the device holds ([`crate::params::ParamVersion`]), moments only
//! when the optimizer is not the one whose moments the device holds
//! ([`Held`]); [`sync_moments`] returns them for checkpoints.

use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::step::{StepError, StepStats, UpdateSettings};
use codegen::optimizer::{moment_names, rates_input, GRAD_NORM_OUTPUT, SETTINGS_INPUT};
use codegen::plan::{BufferId, BufferRole, Plan};
use std::collections::HashMap;

/// Host access to a loaded Plan's buffers, as the update needs it.
pub(super) trait PlanBuffers {
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<(), StepError>;
    fn write_f64(&mut self, id: BufferId, data: &[f64]) -> Result<(), StepError>;
    /// Copies an f32 buffer into `out` (of the buffer's length).
    fn read_f32_into(&mut self, id: BufferId, out: &mut [f32]) -> Result<(), StepError>;
    fn read_f64(&mut self, id: BufferId) -> Result<Vec<f64>, StepError>;
}

/// The buffers of a Plan's update, by parameter name.
#[derive(Debug)]
pub(super) struct PlanUpdate {
    settings: BufferId,
    grad_norm: BufferId,
    /// Parameter name → (parameter, [first moment, second moment], rates).
    params: HashMap<String, (BufferId, [BufferId; 2], BufferId)>,
}

/// Which optimizer's moments the device holds, and after how many steps:
/// `(Optimizer::identity, Optimizer::steps_taken)`.
pub(super) type Held = Option<(u64, u64)>;

impl PlanUpdate {
    /// The update of `plan`, if it has one.
    pub(super) fn of(plan: &Plan) -> Option<PlanUpdate> {
        plan.update_start?;
        let input = |name: String| plan.find(&BufferRole::Input { name });
        let settings = input(SETTINGS_INPUT.into())?;
        let grad_norm = plan.find(&BufferRole::Output { name: GRAD_NORM_OUTPUT.into() })?;
        let mut params = HashMap::new();
        for b in &plan.buffers {
            let BufferRole::Param { name } = &b.role else { continue };
            let [m, v] = moment_names(name).map(|n| plan.find(&BufferRole::OptState { name: n }));
            params.insert(name.clone(), (b.id, [m?, v?], input(rates_input(name))?));
        }
        Some(PlanUpdate { settings, grad_norm, params })
    }

    /// Whether the Plan can take `optimizer`'s step of `params`: every
    /// parameter is in the Plan and follows AdamW.
    pub(super) fn takes(&self, params: &ParamSet, optimizer: &Optimizer) -> bool {
        params.len() == self.params.len()
            && params.iter().all(|p| self.params.contains_key(&p.name))
            && optimizer.names() == params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>()
            && optimizer.adamw_only()
    }

    /// Writes the moments of `optimizer` unless the device holds them already.
    pub(super) fn hold_moments(
        &self,
        dev: &mut dyn PlanBuffers,
        optimizer: &Optimizer,
        held: &mut Held,
    ) -> Result<(), StepError> {
        let current = (optimizer.identity(), optimizer.steps_taken());
        if *held == Some(current) {
            return Ok(());
        }
        if optimizer.moments_on_device() {
            return Err(StepError::MomentsOnDevice);
        }
        *held = None;
        let moments = self.moment_buffers();
        for (name, _, values) in optimizer.state_tensors() {
            if let Some(&id) = moments.get(name.as_str()) {
                dev.write_f32(id, values)?;
            }
        }
        *held = Some(current);
        Ok(())
    }

    /// Writes the values of this step's update (`optimizer`'s next step at
    /// `settings`), for an optimizer [`PlanUpdate::takes`] accepted.
    pub(super) fn write_values(
        &self,
        dev: &mut dyn PlanBuffers,
        optimizer: &Optimizer,
        settings: UpdateSettings,
    ) -> Result<(), StepError> {
        let values =
            optimizer.plan_update_values(settings.lr_mult, settings.clip).ok_or(StepError::NotAdamW)?;
        dev.write_f64(self.settings, &values.settings)?;
        for (name, rates) in optimizer.names().iter().zip(&values.rates) {
            if let Some(&(_, _, id)) = self.params.get(*name) {
                dev.write_f64(id, rates)?;
            }
        }
        Ok(())
    }

    /// After a run of the whole Plan with the loss `loss`: the step's stats,
    /// and for a finite loss (the Plan applied the update) the new parameters
    /// read into `params` and the step counted in `optimizer`.
    pub(super) fn finish(
        &self,
        dev: &mut dyn PlanBuffers,
        loss: f32,
        params: &mut ParamSet,
        optimizer: &mut Optimizer,
        held: &mut Held,
    ) -> Result<StepStats, StepError> {
        let grad_norm = dev.read_f64(self.grad_norm)?.first().copied().unwrap_or(f64::NAN);
        if loss.is_finite() {
            optimizer.stepped_on_device();
            *held = Some((optimizer.identity(), optimizer.steps_taken()));
            for p in params.iter_mut() {
                let &(id, _, _) = self
                    .params
                    .get(&p.name)
                    .ok_or_else(|| StepError::UnknownParam { name: p.name.clone() })?;
                dev.read_f32_into(id, &mut p.value)?;
            }
        }
        Ok(StepStats { loss, grad_norm })
    }

    /// Reads the moments the device holds into `optimizer`, when they are
    /// its current ones.
    pub(super) fn sync_moments(
        &self,
        dev: &mut dyn PlanBuffers,
        optimizer: &mut Optimizer,
        held: &Held,
    ) -> Result<(), StepError> {
        if !optimizer.moments_on_device() {
            return Ok(());
        }
        if *held != Some((optimizer.identity(), optimizer.steps_taken())) {
            return Err(StepError::MomentsOnDevice);
        }
        let moments = self.moment_buffers();
        for (name, _, values) in optimizer.state_tensors_mut() {
            if let Some(&id) = moments.get(name.as_str()) {
                dev.read_f32_into(id, values)?;
            }
        }
        optimizer.moments_returned();
        Ok(())
    }

    /// Moment buffers by checkpoint name.
    fn moment_buffers(&self) -> HashMap<String, BufferId> {
        self.params.iter().flat_map(|(name, (_, ids, _))| moment_names(name).into_iter().zip(*ids)).collect()
    }
}
