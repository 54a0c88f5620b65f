//! The compiler pipeline of one training step (docs/architecture.md §2, §5): a
//! lowered model graph is differentiated, prepared for fusion and compiled into
//! the [`Plan`] of a training step for a [`Target`].
//!
//! It is device-neutral and uses only `ir` and this crate, so everything that
//! needs a training Plan starts here: `widen compile` (which dumps every stage),
//! `widen build` (which embeds the Plans) and the runtime's compiled devices
//! (which load one). They all compile the same Plan from the same spec.

use crate::compile::{compile, fused_partition, CompileError, Request, Target};
use crate::plan::Plan;
use ir::autodiff::AutodiffError;
use ir::graph::Graph;
use ir::lower::Lowered;

/// Why a training step could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum TrainingError {
    /// Differentiating the loss failed.
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    /// A pass before fusion, fusion or compilation failed (boxed: it is large,
    /// and every `Result` of a training step carries it).
    #[error(transparent)]
    Compile(Box<CompileError>),
}

impl From<CompileError> for TrainingError {
    fn from(e: CompileError) -> TrainingError {
        TrainingError::Compile(Box::new(e))
    }
}

/// The differentiated and simplified training graph, and what its Plan must
/// expose: the graph's named outputs and one gradient per parameter.
#[derive(Debug, Clone)]
pub struct TrainingGraph {
    pub graph: Graph,
    pub request: Request,
    /// What the passes before fusion did (`ir::passes::prepare_for_fusion`).
    pub passes: ir::passes::PrepareStats,
}

impl TrainingGraph {
    /// Appends the backward pass of `loss` to the lowered graph
    /// (`ir::autodiff`) and runs the passes before fusion, keeping every
    /// parameter gradient (`ir::passes::prepare_for_fusion`: CSE and DCE, token
    /// sums within each token first, cheap chains copied for their readers), then
    /// the spec's recompute schedule (`train.recompute`, `ir::passes::recompute_blocks`,
    /// docs/math.md §4.5).
    ///
    /// A training step reads the losses and the gradients, never the logits: the
    /// `logits` output is dropped, so every head's output projection and loss fuse
    /// into one op that computes the logits in row chunks (`ir::passes::vocab_loss`,
    /// docs/math.md §1.7) and no `B·T·V` buffer is planned. What reads logits
    /// compiles [`forward_plan_for`] instead.
    pub fn new(lowered: Lowered) -> Result<TrainingGraph, TrainingError> {
        TrainingGraph::build(lowered, false)
    }

    /// [`TrainingGraph::new`] with the `logits` output kept: the main head's logits
    /// then exist whole, as a graph without the fused loss has them (the MTP heads
    /// still fuse). For comparisons that hold the head fixed.
    pub fn keeping_logits(lowered: Lowered) -> Result<TrainingGraph, TrainingError> {
        TrainingGraph::build(lowered, true)
    }

    fn build(lowered: Lowered, keep_logits: bool) -> Result<TrainingGraph, TrainingError> {
        let Lowered { mut graph, mut loss, recompute, .. } = lowered;
        if !keep_logits {
            graph.remove_output("logits");
        }
        let fused = ir::passes::fuse_vocab_losses(&mut graph);
        if let Some(&(_, replacement)) = fused.iter().find(|&&(old, _)| old == loss) {
            loss = replacement;
        }
        let params = graph.params();
        let grads = ir::autodiff::grad(&mut graph, loss, &params)?;
        let mut passes = ir::passes::prepare_for_fusion(&mut graph, &grads).map_err(CompileError::from)?;
        passes.vocab_losses = fused.len();
        // After CSE, which would merge the clones back into their originals.
        if let Some(l_r) = recompute.block() {
            passes.recompute = ir::passes::recompute_blocks(&mut graph, &grads, l_r);
        }
        let request = Request::new(&graph, params.into_iter().zip(grads).collect()).with_update();
        Ok(TrainingGraph { graph, request, passes })
    }

    /// The Plan of one training step for the Cpu device, partitioned by
    /// `ir::passes::fuse` (docs/architecture.md §5).
    pub fn plan(&self) -> Result<Plan, TrainingError> {
        self.plan_for(Target::Cpu)
    }

    /// The Plan of one training step with kernels sized for `target`.
    pub fn plan_for(&self, target: Target) -> Result<Plan, TrainingError> {
        let partition = fused_partition(&self.graph, &self.request)?;
        let request = self.request.clone().for_target(target);
        Ok(compile(&self.graph, &partition, &request)?)
    }
}

/// The Plan of the forward pass alone for `target`, with every output of the lowered
/// graph, the logits whole among them, and no gradients: what evaluation, sampling
/// and the parity check read when the training Plan ([`TrainingGraph::new`]) has no
/// logits.
pub fn forward_plan_for(lowered: Lowered, target: Target) -> Result<Plan, TrainingError> {
    let Lowered { mut graph, .. } = lowered;
    ir::passes::prepare_for_fusion(&mut graph, &[]).map_err(CompileError::from)?;
    let request = Request::new(&graph, Vec::new());
    let partition = fused_partition(&graph, &request)?;
    Ok(compile(&graph, &partition, &request.for_target(target))?)
}
