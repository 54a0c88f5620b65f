//! A training step's update on the host (docs/architecture.md §7): the global
//! gradient norm, clipping and the optimizer's update of the host's parameter
//! set. It is the default of [`StepExecutor::train_step`], what the reference
//! executor always runs, and what a compiled device falls back to for Muon.

use super::{StepError, StepExecutor, StepStats, UpdateSettings};
use crate::dist::Group;
use crate::optim::clip::{clip_scale, global_norm};
use crate::optim::{Optimizer, UpdateTarget};
use crate::params::ParamSet;

/// A training step with the update on the host: `exec`'s loss and
/// gradients, then [`update_on_host`] (the default of
/// [`StepExecutor::train_step`], and what a compiled device falls back to
/// for Muon).
pub fn train_step_on_host<E: StepExecutor + ?Sized>(
    exec: &mut E,
    params: &mut ParamSet,
    tokens: &[i32],
    optimizer: &mut Optimizer,
    settings: UpdateSettings,
) -> Result<StepStats, StepError> {
    if optimizer.moments_on_device() {
        return Err(StepError::MomentsOnDevice);
    }
    let (loss, grads) = exec.loss_and_grads(params, tokens)?;
    Ok(update_on_host(loss, &grads, optimizer, settings, |grads| {
        params
            .iter_mut()
            .zip(grads)
            .map(|(p, g)| UpdateTarget { value: &mut p.value, grad: g.as_ref(), mirror: None })
            .collect()
    }))
}

/// [`train_step_on_host`] with the loss and the gradients averaged across
/// `group` first: one all-reduce over the gradients laid end to end in
/// [`ParamSet`] order.
pub fn train_step_on_host_averaged<E: StepExecutor + ?Sized>(
    exec: &mut E,
    params: &mut ParamSet,
    tokens: &[i32],
    optimizer: &mut Optimizer,
    settings: UpdateSettings,
    group: &Group,
) -> Result<StepStats, StepError> {
    if optimizer.moments_on_device() {
        return Err(StepError::MomentsOnDevice);
    }
    let (loss, grads) = exec.loss_and_grads(params, tokens)?;
    let mut flat: Vec<f32> = grads.concat();
    let loss = group.average(loss, &mut flat);
    let mut rest = flat.as_slice();
    let grads: Vec<&[f32]> = grads
        .iter()
        .map(|g| {
            let (mine, after) = rest.split_at(g.len());
            rest = after;
            mine
        })
        .collect();
    Ok(update_on_host(loss, &grads, optimizer, settings, |grads| {
        params
            .iter_mut()
            .zip(grads)
            .map(|(p, g)| UpdateTarget { value: &mut p.value, grad: g, mirror: None })
            .collect()
    }))
}

/// The host half of a training step: the global norm of `grads`, then (for a
/// finite loss) the clipped update of the slices `targets` builds over them.
pub fn update_on_host<'a, G: AsRef<[f32]> + Sync>(
    loss: f32,
    grads: &'a [G],
    optimizer: &mut Optimizer,
    settings: UpdateSettings,
    targets: impl FnOnce(&'a [G]) -> Vec<UpdateTarget<'a>>,
) -> StepStats {
    let grad_norm = global_norm(grads);
    if loss.is_finite() {
        optimizer.apply(targets(grads), settings.lr_mult, clip_scale(grad_norm, settings.clip));
    }
    StepStats { loss, grad_norm }
}
