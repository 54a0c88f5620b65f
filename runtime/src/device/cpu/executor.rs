//! The [`StepExecutor`] over a [`CpuDevice`] (docs/architecture.md §7): the training
//! loop hands it host parameters and a token batch; it uploads them into the
//! Plan's persistent buffers, runs the Plan, and reads back the loss, the
//! gradients or the logits. Parameters are uploaded only when the set handed
//! in is not the one the device last held ([`crate::params::ParamVersion`]);
//! a training step updates them where they are: the optimizer reads the
//! gradients in the Plan's buffers and writes each new value to the host set
//! and the device's buffer in one pass.
//!
//! The training Plan computes the logits in row chunks and keeps none of them
//! (docs/math.md §1.7); [`StepExecutor::logits`] runs a second Plan, the forward
//! pass alone with the logits whole ([`forward_plan_for`]), compiled on its first use.

use super::{CpuDevice, CpuError, CpuOptions};
use crate::device::plan_io::{first_loss, Interface};
use crate::device::plan_update::{Held, PlanBuffers, PlanUpdate};
use crate::dist::Group;
use crate::optim::{Optimizer, UpdateTarget};
use crate::params::{ParamSet, ParamVersion};
use crate::step::host::{train_step_on_host_averaged, update_on_host};
use crate::step::statistics::ReadsOutputs;
use crate::step::{check_tokens, token_shape_of, StepError, StepExecutor, StepStats, UpdateSettings};
use codegen::compile::Target;
use codegen::plan::{BufferId, BufferRole};
use codegen::training::{forward_plan_for, TrainingGraph};
use ir::lower::Lowered;
use std::collections::HashMap;

/// A loaded Plan, its interface buffers and its optimizer update's.
#[derive(Debug)]
struct Loaded {
    device: CpuDevice,
    io: Interface,
    update: Option<PlanUpdate>,
}

#[derive(Debug)]
enum State {
    /// Compiled on first use, as the reference executor differentiates on
    /// first use: building an executor never fails, a missing C compiler is
    /// reported by the first step.
    Pending(Box<Lowered>, CpuOptions),
    Ready(Box<Loaded>),
}

/// Runs a compiled training Plan on the Cpu device.
#[derive(Debug)]
pub struct CpuExecutor {
    state: State,
    token_shape: [usize; 2],
    /// Token ids must lie in `0..vocab` ([`check_tokens`], before every upload).
    vocab: usize,
    /// The version of the parameter set the device's parameter buffers hold.
    resident: Option<ParamVersion>,
    /// Whose moments the Plan's optimizer state buffers hold.
    held: Held,
    /// The forward Plan that reads the logits, when this executor was built from
    /// a lowered graph.
    forward: Forward,
}

/// The logits' forward Plan of a [`CpuExecutor`].
#[derive(Debug)]
enum Forward {
    /// Built over a loaded Plan: its own `logits` output, if any, is all there is.
    Unavailable,
    Pending(Box<Lowered>, CpuOptions),
    /// Loaded, with the parameter version its buffers hold.
    Ready(Box<Loaded>, Option<ParamVersion>),
}

impl CpuExecutor {
    /// An executor for the output of `ir::lower::lower`; the Plan is compiled
    /// and loaded on the first call.
    pub fn from_lowered(lowered: Lowered, opts: CpuOptions) -> CpuExecutor {
        let token_shape = token_shape_of(&lowered.graph, lowered.tokens);
        let vocab = lowered.graph.node(lowered.logits).shape.dims().last().copied().unwrap_or(0);
        CpuExecutor {
            forward: Forward::Pending(Box::new(lowered.clone()), opts),
            state: State::Pending(Box::new(lowered), opts),
            token_shape,
            vocab,
            resident: None,
            held: None,
        }
    }

    /// An executor over a loaded Plan with a `tokens` input of `token_shape`
    /// (`[batch, seq_len + 1]`) holding ids in `0..vocab`, a `loss` output and,
    /// for training, one gradient buffer per parameter.
    pub fn new(device: CpuDevice, token_shape: [usize; 2], vocab: usize) -> Result<CpuExecutor, StepError> {
        let io = Interface::of(device.plan())?;
        let update = PlanUpdate::of(device.plan());
        let loaded = Loaded { device, io, update };
        Ok(CpuExecutor {
            state: State::Ready(Box::new(loaded)),
            token_shape,
            vocab,
            resident: None,
            held: None,
            forward: Forward::Unavailable,
        })
    }

    /// The loaded device, compiling the Plan first if needed. The caller may
    /// write any buffer, so the next run uploads the parameters again.
    pub fn load(&mut self) -> Result<&mut CpuDevice, StepError> {
        self.resident = None;
        self.held = None;
        Ok(&mut self.loaded()?.device)
    }

    /// The loaded device, to read buffers (a run's outputs): reading changes nothing
    /// the executor vouches for. `None` before the first run compiles the Plan.
    pub fn device(&self) -> Option<&CpuDevice> {
        match &self.state {
            State::Ready(loaded) => Some(&loaded.device),
            State::Pending(..) => None,
        }
    }

    fn loaded(&mut self) -> Result<&mut Loaded, StepError> {
        if let State::Pending(lowered, opts) = &self.state {
            let plan = TrainingGraph::new((**lowered).clone())?.plan()?;
            let compiler =
                codegen::cc::Compiler::from_env().map_err(|e| StepError::from(CpuError::from(e)))?;
            let device = CpuDevice::with_options(plan, &compiler, *opts)?;
            let io = Interface::of(device.plan())?;
            let update = PlanUpdate::of(device.plan());
            self.state = State::Ready(Box::new(Loaded { device, io, update }));
        }
        match &mut self.state {
            State::Ready(loaded) => Ok(loaded),
            State::Pending(..) => unreachable!("the pending state was replaced above"),
        }
    }

    /// Uploads the parameters (unless the device holds this version of
    /// them already) and the tokens, then runs the Plan's gradient steps.
    fn run(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<&mut Loaded, StepError> {
        self.run_steps(params, tokens, false)
    }

    /// [`CpuExecutor::run`], with the optimizer update too when `update`.
    fn run_steps(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
        update: bool,
    ) -> Result<&mut Loaded, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        let upload = self.resident != Some(params.version());
        self.resident = None;
        let l = self.loaded()?;
        if upload {
            for (name, buffer, _) in &l.io.params {
                let p = params.get(name).ok_or_else(|| StepError::UnknownParam { name: name.clone() })?;
                l.device.write_f32(*buffer, &p.value)?;
            }
        }
        l.device.write_i32(l.io.tokens, tokens)?;
        let steps = if update { 0..l.device.plan().steps.len() } else { l.device.plan().gradient_steps() };
        l.device.run_range(steps)?;
        self.resident = Some(params.version());
        match &mut self.state {
            State::Ready(loaded) => Ok(loaded),
            State::Pending(..) => unreachable!("`loaded` left the executor ready"),
        }
    }
}

impl Loaded {
    fn loss(&self) -> Result<f32, StepError> {
        first_loss(self.device.read_f32(self.io.loss)?)
    }

    /// Replaces the loss and every gradient buffer by its mean across `group`:
    /// one all-reduce over the gradients laid end to end in the Plan's
    /// parameter order (the same on every rank: one spec, one Plan).
    fn average_in_buffers(&mut self, group: &Group) -> Result<(), StepError> {
        let buffers: Vec<BufferId> = self.io.params.iter().filter_map(|(_, _, g)| *g).collect();
        let mut flat = Vec::new();
        for &g in &buffers {
            flat.extend_from_slice(self.device.read_f32(g)?);
        }
        let loss = group.average(self.loss()?, &mut flat);
        let mut rest = flat.as_slice();
        for &g in &buffers {
            let (mine, after) = rest.split_at(self.device.read_f32(g)?.len());
            self.device.write_f32(g, mine)?;
            rest = after;
        }
        self.device.write_f32(self.io.loss, &[loss])?;
        Ok(())
    }
}

impl CpuExecutor {
    /// A training step with the Plan's own update (`crate::device::plan_update`). With a
    /// `group` (a data-parallel step, docs/distributed.md) the Plan runs in two
    /// parts: its gradient steps; then, once the loss and the gradients in the
    /// Plan's buffers are replaced by their means across the ranks, its update
    /// steps. The update reads the `loss` buffer to skip a non-finite step, so
    /// it gets the mean too, and every rank decides alike.
    fn train_step_in_plan(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
        group: Option<&Group>,
    ) -> Result<StepStats, StepError> {
        let mut held = self.held.take();
        {
            let Loaded { device, update, .. } = self.loaded()?;
            let update = update.as_ref().ok_or(StepError::MissingOutput { what: "optimizer update" })?;
            update.hold_moments(device, optimizer, &mut held)?;
            update.write_values(device, optimizer, settings)?;
        }
        let l = match group {
            None => self.run_steps(params, tokens, true)?,
            Some(group) => {
                let l = self.run_steps(params, tokens, false)?;
                l.average_in_buffers(group)?;
                let plan = l.device.plan();
                let steps = plan.gradient_steps().end..plan.steps.len();
                l.device.run_range(steps)?;
                l
            }
        };
        let loss = l.loss()?;
        let Loaded { device, update, .. } = l;
        let update = update.as_ref().ok_or(StepError::MissingOutput { what: "optimizer update" })?;
        let stats = update.finish(device, loss, params, optimizer, &mut held)?;
        self.held = held;
        self.resident = Some(params.version());
        Ok(stats)
    }
}

impl PlanBuffers for CpuDevice {
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<(), StepError> {
        Ok(CpuDevice::write_f32(self, id, data)?)
    }

    fn write_f64(&mut self, id: BufferId, data: &[f64]) -> Result<(), StepError> {
        Ok(CpuDevice::write_f64(self, id, data)?)
    }

    fn read_f32_into(&mut self, id: BufferId, out: &mut [f32]) -> Result<(), StepError> {
        let values = CpuDevice::read_f32(self, id)?;
        if values.len() != out.len() {
            return Err(CpuError::WrongLength { id: id.0, len: values.len(), got: out.len() }.into());
        }
        out.copy_from_slice(values);
        Ok(())
    }

    fn read_f64(&mut self, id: BufferId) -> Result<Vec<f64>, StepError> {
        Ok(CpuDevice::read_f64(self, id)?.to_vec())
    }
}

impl StepExecutor for CpuExecutor {
    fn device(&self) -> &'static str {
        "cpu"
    }

    fn token_shape(&self) -> [usize; 2] {
        self.token_shape
    }

    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError> {
        let l = self.run(params, tokens)?;
        let grads = l.io.grads(params, |g| Ok(l.device.read_f32(g)?.to_vec()))?;
        Ok((l.loss()?, grads))
    }

    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError> {
        self.run(params, tokens)?.loss()
    }

    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        if let Forward::Pending(lowered, opts) = &self.forward {
            let plan = forward_plan_for((**lowered).clone(), Target::Cpu)?;
            let compiler =
                codegen::cc::Compiler::from_env().map_err(|e| StepError::from(CpuError::from(e)))?;
            let device = CpuDevice::with_options(plan, &compiler, *opts)?;
            let io = Interface::of(device.plan())?;
            self.forward = Forward::Ready(Box::new(Loaded { device, io, update: None }), None);
        }
        let Forward::Ready(l, resident) = &mut self.forward else {
            let l = self.run(params, tokens)?;
            let logits = l.io.logits.ok_or(StepError::MissingOutput { what: "logits" })?;
            return Ok(l.device.read_f32(logits).map_err(StepError::from)?.to_vec());
        };
        if *resident != Some(params.version()) {
            for (name, buffer, _) in &l.io.params {
                let p = params.get(name).ok_or_else(|| StepError::UnknownParam { name: name.clone() })?;
                l.device.write_f32(*buffer, &p.value)?;
            }
            *resident = Some(params.version());
        }
        l.device.write_i32(l.io.tokens, tokens)?;
        let steps = 0..l.device.plan().steps.len();
        l.device.run_range(steps)?;
        let logits = l.io.logits.ok_or(StepError::MissingOutput { what: "logits" })?;
        Ok(l.device.read_f32(logits).map_err(StepError::from)?.to_vec())
    }

    fn main_loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f64, StepError> {
        let l = self.run(params, tokens)?;
        let id = l.device.plan().find(&BufferRole::Output { name: "loss_main".into() });
        let id = id.ok_or(StepError::MissingOutput { what: "loss_main" })?;
        Ok(f64::from(first_loss(l.device.read_f32(id)?)?))
    }

    /// With AdamW on every parameter the Plan runs the update
    /// (`crate::device::plan_update`); otherwise (Muon) the host does, reading each
    /// gradient in its Plan buffer (no copy) and writing each new parameter
    /// value to `params` and to the device's parameter buffer in the same
    /// pass. Either way the next step uploads no parameters.
    fn train_step(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
    ) -> Result<StepStats, StepError> {
        // Before the update's state is touched: a refused batch changes nothing.
        check_tokens(tokens, self.token_shape, self.vocab)?;
        if self.loaded()?.update.as_ref().is_some_and(|u| u.takes(params, optimizer)) {
            return self.train_step_in_plan(params, tokens, optimizer, settings, None);
        }
        if optimizer.moments_on_device() {
            return Err(StepError::MomentsOnDevice);
        }
        let l = self.run(params, tokens)?;
        let loss = l.loss()?;
        // A parameter the Plan does not hold (the loss does not reach it) has
        // a zero gradient and no device copy.
        let slot: HashMap<&str, usize> =
            l.io.params.iter().enumerate().map(|(i, (name, _, _))| (name.as_str(), i)).collect();
        let mut held = Vec::new();
        let mut grad_buffers = Vec::new();
        for p in params.iter() {
            if let Some(&i) = slot.get(p.name.as_str()) {
                held.push(l.io.params[i].1);
                if let Some(g) = l.io.params[i].2 {
                    grad_buffers.push(g);
                }
            }
        }
        let (mut mirrors, device_grads) = l.device.persistent_views(&held, &grad_buffers)?;
        let zeros: Vec<Vec<f32>> = params
            .iter()
            .filter(|p| slot.get(p.name.as_str()).is_none_or(|&i| l.io.params[i].2.is_none()))
            .map(|p| vec![0.0; p.value.len()])
            .collect();
        let (mut device_grads, mut zeros) = (device_grads.into_iter(), zeros.iter());
        let grads: Vec<&[f32]> = params
            .iter()
            .map(|p| match slot.get(p.name.as_str()).and_then(|&i| l.io.params[i].2) {
                Some(_) => device_grads.next().expect("one view per gradient buffer"),
                None => zeros.next().expect("one zero gradient per parameter without a buffer"),
            })
            .collect();
        let stats = update_on_host(loss, &grads, optimizer, settings, |grads| {
            let mut mirrors = mirrors.iter_mut();
            params
                .iter_mut()
                .zip(grads)
                .map(|(p, g)| {
                    let mirror = slot
                        .contains_key(p.name.as_str())
                        .then(|| &mut **mirrors.next().expect("one view per held parameter"));
                    UpdateTarget { value: &mut p.value, grad: g, mirror }
                })
                .collect()
        });
        // Both copies now hold the set's new version (or, after a non-finite
        // loss, its unchanged values).
        self.resident = Some(params.version());
        Ok(stats)
    }

    /// With AdamW on every parameter, the Plan's update after the gradients
    /// are averaged in its buffers ([`CpuExecutor::train_step_in_plan`]);
    /// otherwise (Muon) the host's, from copies of the gradients.
    fn train_step_averaged(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
        group: &Group,
    ) -> Result<StepStats, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        if self.loaded()?.update.as_ref().is_some_and(|u| u.takes(params, optimizer)) {
            return self.train_step_in_plan(params, tokens, optimizer, settings, Some(group));
        }
        // The host writes the new values into `params`, bumping its version:
        // the next run uploads them.
        train_step_on_host_averaged(self, params, tokens, optimizer, settings, group)
    }

    fn sync_optimizer(&mut self, optimizer: &mut Optimizer) -> Result<(), StepError> {
        if !optimizer.moments_on_device() {
            return Ok(());
        }
        let held = self.held;
        let State::Ready(l) = &mut self.state else { return Err(StepError::MomentsOnDevice) };
        let Loaded { device, update, .. } = &mut **l;
        let update = update.as_ref().ok_or(StepError::MomentsOnDevice)?;
        update.sync_moments(device, optimizer, &held)
    }
}

impl ReadsOutputs for CpuExecutor {
    fn read_output(&self, name: &str) -> Result<Vec<f32>, StepError> {
        let device = self.device().ok_or(StepError::MissingOutput { what: "step statistic before a run" })?;
        let id = device
            .plan()
            .find(&BufferRole::Output { name: name.into() })
            .ok_or(StepError::MissingOutput { what: "step statistic" })?;
        Ok(device.read_f32(id)?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step contract names no device: a Cpu failure reaches the loop as
    /// [`StepError::Device`], printing the Cpu error's own message once.
    #[test]
    fn a_cpu_failure_is_a_device_error_with_its_own_message() {
        let cpu = CpuError::StepRange { start: 3, end: 9, count: 4 };
        let shown = cpu.to_string();
        let err = StepError::from(cpu);
        assert_eq!(err.to_string(), shown);
        assert!(std::error::Error::source(&err).is_none(), "the message is not repeated as a cause");
        let StepError::Device(inner) = err else { panic!("not a device error: {err:?}") };
        assert!(matches!(inner.downcast_ref::<CpuError>(), Some(CpuError::StepRange { start: 3, .. })));
    }
}
