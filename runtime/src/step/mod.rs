//! The step contract (docs/architecture.md §7): a [`StepExecutor`] turns
//! parameters and a token batch into a loss, gradients or logits. The loop,
//! optimizers, data and checkpoints never look past this trait, so a compiled
//! CPU or CUDA plan plugs in beside the reference executor, and a data-parallel
//! executor can all-reduce gradients before returning them (docs/architecture.md §11).
//!
//! This is the bottom of the runtime's device stack: it names no device
//! (a device's error reaches the loop as [`StepError::Device`]), and every
//! device implements it.
//!
//! - [`host`]: a training step's update on the host, the default of
//!   [`StepExecutor::train_step`] and what a compiled device falls back to.
//! - [`statistics`]: the per-step statistics a compiled device reads back
//!   after every step ([`statistics::WithStatistics`]).

pub mod host;
pub mod statistics;

use crate::dist::Group;
use crate::optim::Optimizer;
use crate::params::ParamSet;
use codegen::compile::CompileError;
use codegen::training::TrainingError;
use ir::autodiff::AutodiffError;
use ir::exec::ExecError;
use ir::graph::{Graph, NodeId};

/// Errors from a step executor.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("token batch has {got} ids, the model graph takes {expected} ([batch, seq_len + 1])")]
    TokenCount { got: usize, expected: usize },
    #[error(
        "token id {id} at row {row}, position {col} of the batch is outside the model's vocabulary \
         0..{vocab}; the data holds ids the spec's `vocab` does not cover (byte-level text needs \
         vocab >= 256)"
    )]
    TokenOutOfRange { id: i32, row: usize, col: usize, vocab: usize },
    #[error("the graph produced no {what}")]
    MissingOutput { what: &'static str },
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    #[error("the compiled plan has parameter `{name}`, which the parameter set lacks")]
    UnknownParam { name: String },
    /// A device's own failure (`CpuError`, `CudaError`): each device converts its
    /// error into this variant, so this layer names no device (docs/architecture.md §7).
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Compile(Box<CompileError>),
    #[error(
        "the optimizer's moments are held by the device that last stepped it; \
         call `sync_optimizer` on that executor first"
    )]
    MomentsOnDevice,
    #[error("the Plan's update runs AdamW only, and a parameter follows Muon")]
    NotAdamW,
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
}

/// Checks a token batch before any device sees it: `[batch, seq_len + 1]`
/// ids (`shape`), each in `0..vocab`.
///
/// This is where every index a kernel reads from data is checked. The token
/// ids are the only data-dependent indices of a Plan: the embedding gather
/// (`Gather` axis 0 over the `[vocab, d]` table, forward), its gradient's
/// scatter-add into the table's gradient (backward, a write), and the
/// cross-entropy targets of the main head and of every MTP module (read in
/// the forward pass, written at in its gradient; the logits' last axis is
/// `vocab` wide) all index with slices of this one batch, so one pass over it
/// here bounds them all. Every other index a kernel reads from a buffer is
/// computed by a kernel and in range by construction: `TopK` (xHC's stream
/// routing, MoE's expert choice; `codegen::emit::item::topk`) writes exactly
/// `k - fixed` ids from `fixed..n` after the `fixed` ones, ranking under a
/// total order that places NaN scores too, and graph shape inference
/// (`ir::graph`) requires `fixed <= k <= n`; the `Gather`, `ScatterAdd` and
/// `ScatterRows` over the stream or expert axis read only those ids.
///
/// The compiled kernels do not bound-check their indices (a check per load
/// in the hot loops), so a batch that fails here must never reach them: an id
/// outside `0..vocab` would read, and in the backward pass write, outside the
/// embedding's and the logits' buffers. Reliability rule (README, "What widen guarantees"): no
/// compiled kernel is handed an index it can write out of bounds with.
pub fn check_tokens(tokens: &[i32], shape: [usize; 2], vocab: usize) -> Result<(), StepError> {
    let expected = shape[0] * shape[1];
    if tokens.len() != expected {
        return Err(StepError::TokenCount { got: tokens.len(), expected });
    }
    // One comparison per id: a negative id is a huge unsigned one.
    match tokens.iter().position(|&t| t as u32 as usize >= vocab) {
        None => Ok(()),
        Some(i) => {
            let width = shape[1].max(1);
            Err(StepError::TokenOutOfRange { id: tokens[i], row: i / width, col: i % width, vocab })
        }
    }
}

/// What the training loop and the sampler need from a device.
pub trait StepExecutor {
    /// Device name for messages and metrics: `Device::name` of the device it runs on
    /// ([`crate::device::Device`]).
    fn device(&self) -> &'static str;

    /// The token batch shape `[batch, seq_len + 1]` this executor was built for.
    fn token_shape(&self) -> [usize; 2];

    /// Training loss and its gradient for every parameter, in [`ParamSet`] order.
    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError>;

    /// Loss only (validation).
    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError>;

    /// The main head's logits `[batch, seq_len, vocab]`, row-major.
    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError>;

    /// The main head's mean next-token loss alone (the `loss_main` output, which is
    /// `loss` without MTP; docs/math.md §7.1): what validation compares across designs.
    /// This default computes it from [`Self::logits`]; the compiled devices read their
    /// Plan's `loss_main` output, whose training Plan has no logits (docs/math.md §1.7).
    fn main_loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f64, StepError> {
        let [batch, window] = self.token_shape();
        Ok(next_token_loss(&self.logits(params, tokens)?, tokens, batch, window))
    }

    /// One training step: the loss and gradients of `tokens`, global-norm
    /// clipping, and `optimizer`'s update of `params` (docs/architecture.md §7). A loss
    /// that is not finite leaves `params` and the optimizer untouched; the
    /// caller decides what to do about it.
    ///
    /// This default runs the update on the host from [`Self::loss_and_grads`]
    /// ([`host::train_step_on_host`]).
    /// A compiled device overrides it to read the gradients where its Plan
    /// left them and to keep its copy of the parameters current.
    fn train_step(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
    ) -> Result<StepStats, StepError> {
        host::train_step_on_host(self, params, tokens, optimizer, settings)
    }

    /// One data-parallel training step (docs/distributed.md): [`Self::train_step`]
    /// on this rank's shard `tokens`, except that the loss and the gradients are
    /// averaged across `group` ([`Group::average`]) between the backward pass
    /// and the update, so every rank applies the same update and reports the
    /// loss of the whole global batch. [`Self::train_step`] stays the
    /// single-process path, untouched by this one.
    ///
    /// This default averages [`Self::loss_and_grads`] and updates on the host.
    /// A device whose Plan runs the update overrides it to average the
    /// gradients in the Plan's buffers before running the Plan's update steps.
    fn train_step_averaged(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
        group: &Group,
    ) -> Result<StepStats, StepError> {
        host::train_step_on_host_averaged(self, params, tokens, optimizer, settings, group)
    }

    /// Brings the optimizer state a device holds back into `optimizer` (its
    /// moments, when the device's Plan ran the update); a no-op where the host
    /// holds it. Call before reading the state, as checkpoints do.
    fn sync_optimizer(&mut self, _optimizer: &mut Optimizer) -> Result<(), StepError> {
        Ok(())
    }

    /// The graph outputs this executor reads back after every training step besides
    /// the loss ([`ir::lower::Lowered::statistics`]: the MoE expert loads and auxiliary
    /// loss, docs/math.md §1.6), in the order of [`Self::step_statistics`]. Empty where
    /// the model has none or the executor does not read them.
    fn statistics(&self) -> &[String] {
        &[]
    }

    /// The values of [`Self::statistics`] at the last training step
    /// ([`Self::train_step`], [`Self::train_step_averaged`], or the
    /// [`Self::loss_and_grads`] they call), f32 as the graph computed them; empty
    /// before the first step.
    fn step_statistics(&self) -> &[Vec<f32>] {
        &[]
    }
}

/// What one training step's update depends on besides the gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateSettings {
    /// Learning-rate multiplier from the schedule at this step.
    pub lr_mult: f64,
    /// Global gradient-norm limit (`train.clip`), if any.
    pub clip: Option<f64>,
}

/// What one training step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// The training loss of the batch, before the update.
    pub loss: f32,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
}

/// The `[batch, seq_len + 1]` shape of a graph's token input.
pub(crate) fn token_shape_of(graph: &Graph, tokens: NodeId) -> [usize; 2] {
    let dims = graph.node(tokens).shape.dims();
    [dims.first().copied().unwrap_or(1), dims.get(1).copied().unwrap_or(1)]
}

impl From<CompileError> for StepError {
    fn from(e: CompileError) -> StepError {
        StepError::Compile(Box::new(e))
    }
}

/// A training step that cannot be compiled keeps the error it had when the
/// runtime compiled it itself: an autodiff failure, or the compiler's.
impl From<TrainingError> for StepError {
    fn from(e: TrainingError) -> StepError {
        match e {
            TrainingError::Autodiff(e) => StepError::Autodiff(e),
            TrainingError::Compile(e) => StepError::Compile(e),
        }
    }
}

/// Mean next-token cross-entropy (nats) of the main head's `logits`
/// `[batch, window - 1, vocab]` against `tokens` `[batch, window]`: the validation
/// loss of a model with MTP modules, whose training loss also holds their
/// weighted terms (docs/math.md §7.1), so that validation compares models of any
/// MTP depth on the one quantity they share.
pub fn next_token_loss(logits: &[f32], tokens: &[i32], batch: usize, window: usize) -> f64 {
    let positions = batch * (window - 1);
    let vocab = logits.len() / positions.max(1);
    let mut sum = 0.0f64;
    for b in 0..batch {
        for t in 0..window - 1 {
            let row = &logits[(b * (window - 1) + t) * vocab..][..vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            let target = tokens[b * window + t + 1] as usize;
            sum += lse - row[target] as f64;
        }
    }
    sum / positions as f64
}
