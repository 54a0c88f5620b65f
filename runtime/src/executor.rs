//! The device boundary of the training loop (docs/architecture.md §7): a [`StepExecutor`]
//! turns parameters and a token batch into a loss, gradients or logits. The
//! loop, optimizers, data and checkpoints never look past this trait, so a
//! compiled CPU or CUDA plan plugs in beside the [`ReferenceExecutor`], and a
//! data-parallel executor can all-reduce gradients before returning them
//! (docs/architecture.md §11).

use crate::dist::Group;
use crate::optim::clip::{clip_scale, global_norm};
use crate::optim::{Optimizer, UpdateTarget};
use crate::params::ParamSet;
use ir::autodiff::AutodiffError;
use ir::exec::{ExecError, Tensor, Value};
use ir::graph::{Graph, NodeId};
use ir::lower::Lowered;
use ir::Shape;
use std::collections::HashMap;

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
    #[error(
        "the compiled plan's logits ({len} values) are not [batch, seq_len, vocab] for tokens {shape:?}"
    )]
    NoVocabulary { len: usize, shape: [usize; 2] },
    #[error("the graph produced no {what}")]
    MissingOutput { what: &'static str },
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    #[error("the compiled plan has parameter `{name}`, which the parameter set lacks")]
    UnknownParam { name: String },
    #[error(transparent)]
    Cpu(Box<crate::device::cpu::CpuError>),
    #[error(transparent)]
    Cuda(Box<crate::device::cuda::CudaError>),
    #[error(transparent)]
    Compile(Box<codegen::compile::CompileError>),
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

/// The vocabulary of a compiled training Plan: the last axis of its `logits`
/// output `[batch, seq_len, vocab]` for tokens of `token_shape`. Lowering
/// gives the embedding table, every head and every cross-entropy the same
/// `vocab` (`ir::lower`), so this is the bound of every token index.
pub(crate) fn plan_vocab(logits_len: usize, token_shape: [usize; 2]) -> Result<usize, StepError> {
    let positions = token_shape[0] * token_shape[1].saturating_sub(1);
    if positions == 0 || logits_len == 0 || !logits_len.is_multiple_of(positions) {
        return Err(StepError::NoVocabulary { len: logits_len, shape: token_shape });
    }
    Ok(logits_len / positions)
}

/// What the training loop and the sampler need from a device.
pub trait StepExecutor {
    /// Device name for messages and metrics: [`Device::name`] of the device it runs on.
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

    /// One training step: the loss and gradients of `tokens`, global-norm
    /// clipping, and `optimizer`'s update of `params` (docs/architecture.md §7). A loss
    /// that is not finite leaves `params` and the optimizer untouched; the
    /// caller decides what to do about it.
    ///
    /// This default runs the update on the host from [`Self::loss_and_grads`].
    /// A compiled device overrides it to read the gradients where its Plan
    /// left them and to keep its copy of the parameters current.
    fn train_step(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
    ) -> Result<StepStats, StepError> {
        train_step_on_host(self, params, tokens, optimizer, settings)
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
        train_step_on_host_averaged(self, params, tokens, optimizer, settings, group)
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

/// The devices a model can run on (docs/architecture.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The unfused graph on the reference interpreter (`ir::exec`), in f32.
    Reference,
    /// The fused Plan on the host: C kernels on all cores, GEMMs through `gemm`
    /// ([`crate::device::cpu_executor::CpuExecutor`]).
    Cpu,
    /// The fused Plan on GPU 0: CUDA kernels compiled by NVRTC, GEMMs through
    /// cuBLAS ([`crate::device::cuda::CudaExecutor`]).
    Cuda,
}

impl Device {
    /// The name used on the command line and in metrics (`reference`, `cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            Device::Reference => "reference",
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// The executor for a lowered model graph on this device.
    ///
    /// The reference and Cpu executors are built without touching anything
    /// outside the process (the Cpu Plan is compiled on its first step). The
    /// Cuda executor compiles and loads its Plan here, so a machine without
    /// the CUDA driver gets [`crate::device::cuda::CudaError::NoCudaDriver`]
    /// now, before any work (and never the panic `cudarc` raises when it
    /// cannot find `libcuda`). Executors are `Send`, so several can be
    /// built at once (Plan compilation dominates).
    pub fn executor(self, lowered: Lowered) -> Result<Box<dyn StepExecutor + Send>, StepError> {
        let statistics = lowered.statistics.clone();
        Ok(match self {
            Device::Reference => Box::new(ReferenceExecutor::from_lowered(lowered)),
            Device::Cpu => crate::step_outputs::with_statistics(
                crate::device::cpu_executor::CpuExecutor::from_lowered(
                    lowered,
                    crate::device::cpu::CpuOptions::default(),
                ),
                statistics,
            ),
            Device::Cuda => crate::step_outputs::with_statistics(cuda_executor(lowered)?, statistics),
        })
    }
}

/// Differentiates, fuses and compiles `lowered` into a training Plan and
/// loads it on GPU 0. The driver is checked first, so a machine without one
/// fails fast instead of compiling a Plan it cannot run.
pub fn cuda_executor(lowered: Lowered) -> Result<crate::device::cuda::CudaExecutor, StepError> {
    cuda_executor_on(lowered, 0)
}

/// [`cuda_executor`] on GPU `ordinal` (a data-parallel rank's own GPU).
pub fn cuda_executor_on(
    lowered: Lowered,
    ordinal: usize,
) -> Result<crate::device::cuda::CudaExecutor, StepError> {
    use crate::device::cuda::{driver_available, CudaDevice, CudaError, CudaExecutor};
    if !driver_available() {
        return Err(CudaError::NoCudaDriver.into());
    }
    let token_shape = token_shape_of(&lowered.graph, lowered.tokens);
    let plan =
        crate::device::cpu_executor::TrainingGraph::new(lowered)?.plan_for(codegen::compile::Target::Cuda)?;
    CudaExecutor::new(CudaDevice::on(plan, ordinal)?, token_shape)
}

/// The `[batch, seq_len + 1]` shape of a graph's token input.
fn token_shape_of(graph: &Graph, tokens: NodeId) -> [usize; 2] {
    let dims = graph.node(tokens).shape.dims();
    [dims.first().copied().unwrap_or(1), dims.get(1).copied().unwrap_or(1)]
}

/// Runs the unfused graph on the reference interpreter (`ir::exec`) in f32.
#[derive(Debug)]
pub struct ReferenceExecutor {
    graph: Graph,
    tokens: NodeId,
    /// The reported loss (the graph output `loss`).
    loss: NodeId,
    /// The differentiated objective: `loss`, plus the MoE auxiliary balance loss where the
    /// model has one ([`ir::lower::Lowered::loss`]).
    objective: NodeId,
    logits: NodeId,
    /// The per-step statistics read back with every gradient run, and their nodes.
    statistics: Vec<String>,
    statistic_nodes: Vec<NodeId>,
    /// Their values at the last gradient run.
    last_statistics: Vec<Vec<f32>>,
    /// Gradient nodes, appended by autodiff on the first training step (a
    /// sampling-only executor never differentiates).
    grads: Option<Vec<NodeId>>,
    token_shape: [usize; 2],
    /// The last axis of the logits: token ids must lie in `0..vocab`.
    vocab: usize,
}

impl ReferenceExecutor {
    /// An executor for a model graph: `tokens` is its i32 `[batch, seq_len + 1]`
    /// input, `loss` the scalar training loss, `logits` the main head's output.
    pub fn new(graph: Graph, tokens: NodeId, loss: NodeId, logits: NodeId) -> Self {
        let token_shape = token_shape_of(&graph, tokens);
        let vocab = graph.node(logits).shape.dims().last().copied().unwrap_or(0);
        ReferenceExecutor {
            graph,
            tokens,
            loss,
            objective: loss,
            logits,
            statistics: Vec::new(),
            statistic_nodes: Vec::new(),
            last_statistics: Vec::new(),
            grads: None,
            token_shape,
            vocab,
        }
    }

    /// An executor for the output of `ir::lower::lower`: it reports the graph output
    /// `loss`, differentiates [`Lowered::loss`] and reads back [`Lowered::statistics`]
    /// with every gradient.
    pub fn from_lowered(lowered: Lowered) -> Self {
        let reported = lowered.graph.output("loss").unwrap_or(lowered.loss);
        let (statistics, statistic_nodes) = lowered
            .statistics
            .iter()
            .filter_map(|name| lowered.graph.output(name).map(|node| (name.clone(), node)))
            .unzip();
        ReferenceExecutor {
            objective: lowered.loss,
            statistics,
            statistic_nodes,
            ..ReferenceExecutor::new(lowered.graph, lowered.tokens, reported, lowered.logits)
        }
    }

    fn sources(&self, params: &ParamSet, tokens: &[i32]) -> Result<HashMap<NodeId, Value<f32>>, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        let mut sources = HashMap::with_capacity(params.len() + 1);
        for p in params.iter() {
            sources.insert(p.node, Value::Float(Tensor::new(p.shape.clone(), p.value.clone())));
        }
        sources.insert(self.tokens, Value::Int(Tensor::new(Shape::new(self.token_shape), tokens.to_vec())));
        Ok(sources)
    }

    fn run(
        &self,
        params: &ParamSet,
        tokens: &[i32],
        outputs: &[NodeId],
    ) -> Result<HashMap<NodeId, Value<f32>>, StepError> {
        let sources = self.sources(params, tokens)?;
        Ok(ir::exec::run::<f32>(&self.graph, &sources, outputs)?)
    }
}

fn float_output(
    values: &mut HashMap<NodeId, Value<f32>>,
    node: NodeId,
    what: &'static str,
) -> Result<Vec<f32>, StepError> {
    match values.remove(&node) {
        Some(Value::Float(t)) => Ok(t.data),
        _ => Err(StepError::MissingOutput { what }),
    }
}

impl StepExecutor for ReferenceExecutor {
    fn device(&self) -> &'static str {
        "reference"
    }

    fn token_shape(&self) -> [usize; 2] {
        self.token_shape
    }

    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError> {
        let grads = match &self.grads {
            Some(g) => g.clone(),
            None => {
                let wrt: Vec<NodeId> = params.iter().map(|p| p.node).collect();
                let g = ir::autodiff::grad(&mut self.graph, self.objective, &wrt)?;
                self.grads = Some(g.clone());
                g
            }
        };
        let mut outputs = vec![self.loss];
        outputs.extend(&grads);
        outputs.extend(&self.statistic_nodes);
        let mut values = self.run(params, tokens, &outputs)?;
        let loss = float_output(&mut values, self.loss, "loss")?;
        let loss = *loss.first().ok_or(StepError::MissingOutput { what: "loss" })?;
        self.last_statistics = self
            .statistic_nodes
            .iter()
            .map(|node| match values.get(node) {
                Some(Value::Float(t)) => Ok(t.data.clone()),
                _ => Err(StepError::MissingOutput { what: "step statistic" }),
            })
            .collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(grads.len());
        for &g in &grads {
            // Several parameters may share one zero-gradient node: clone rather than remove.
            match values.get(&g) {
                Some(Value::Float(t)) => out.push(t.data.clone()),
                _ => return Err(StepError::MissingOutput { what: "gradient" }),
            }
        }
        Ok((loss, out))
    }

    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError> {
        let mut values = self.run(params, tokens, &[self.loss])?;
        let loss = float_output(&mut values, self.loss, "loss")?;
        loss.first().copied().ok_or(StepError::MissingOutput { what: "loss" })
    }

    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError> {
        let mut values = self.run(params, tokens, &[self.logits])?;
        float_output(&mut values, self.logits, "logits")
    }

    fn statistics(&self) -> &[String] {
        &self.statistics
    }

    fn step_statistics(&self) -> &[Vec<f32>] {
        &self.last_statistics
    }
}
