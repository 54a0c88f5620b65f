//! A training Plan's interface buffers, shared by the Cpu and the Cuda
//! executor (docs/architecture.md §7): the `tokens` input, the `loss` and
//! `logits` outputs, and every parameter's buffer and gradient buffer, each
//! resolved by its role once when the Plan loads.

use crate::params::ParamSet;
use crate::step::StepError;
use codegen::plan::{BufferId, BufferRole, Plan};
use std::collections::HashMap;

/// The interface buffers of a training Plan, resolved by role once; shared
/// by the Cpu and Cuda executors.
#[derive(Debug)]
pub(super) struct Interface {
    pub(super) tokens: BufferId,
    pub(super) loss: BufferId,
    pub(super) logits: Option<BufferId>,
    /// `(name, parameter buffer, gradient buffer)` of every parameter of the Plan.
    pub(super) params: Vec<(String, BufferId, Option<BufferId>)>,
    /// Gradient buffer by parameter name.
    pub(super) grads: HashMap<String, BufferId>,
}

impl Interface {
    pub(super) fn of(plan: &Plan) -> Result<Interface, StepError> {
        let output = |name: &str| plan.find(&BufferRole::Output { name: name.into() });
        let tokens = plan
            .find(&BufferRole::Input { name: "tokens".into() })
            .ok_or(StepError::MissingOutput { what: "`tokens` input buffer" })?;
        let loss = output("loss").ok_or(StepError::MissingOutput { what: "loss" })?;
        let params = plan
            .buffers
            .iter()
            .filter_map(|b| match &b.role {
                BufferRole::Param { name } => {
                    Some((name.clone(), b.id, plan.find(&BufferRole::Grad { name: name.clone() })))
                }
                _ => None,
            })
            .collect::<Vec<_>>();
        let grads = params.iter().filter_map(|(n, _, g)| g.map(|g| (n.clone(), g))).collect();
        Ok(Interface { tokens, loss, logits: output("logits"), params, grads })
    }

    /// The gradient of every parameter of `params`, in its order, read by
    /// `read`. A parameter the loss does not reach has no gradient buffer:
    /// its gradient is zero.
    pub(super) fn grads(
        &self,
        params: &ParamSet,
        mut read: impl FnMut(BufferId) -> Result<Vec<f32>, StepError>,
    ) -> Result<Vec<Vec<f32>>, StepError> {
        params
            .iter()
            .map(|p| match self.grads.get(&p.name) {
                Some(&g) => read(g),
                None => Ok(vec![0.0; p.value.len()]),
            })
            .collect()
    }
}

/// The loss value of a run: the single element of the `loss` buffer.
pub(super) fn first_loss(loss: &[f32]) -> Result<f32, StepError> {
    loss.first().copied().ok_or(StepError::MissingOutput { what: "loss" })
}
