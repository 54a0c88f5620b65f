//! Lowering of graph nodes into kernel IR (docs/architecture.md §5, §6).
//!
//! A *fused kernel* runs a list of nodes over a 1-D grid of `n` items. Every
//! value the kernel produces is split the same way: item `i` owns the flat
//! elements `[i·per, (i+1)·per)` of it, where `per = numel / n` and `n` is a
//! product of leading dimensions (for token-shaped values `[B, T, ..]`, one item
//! is one token). Each op computes its item's part with loops; values used only
//! inside the kernel live in per-item local arrays, the others are written to
//! plan buffers. An operand produced by the same kernel may therefore only be
//! read inside the reading item's part: [`itemize`] checks that rule op by op
//! (and picks the largest `n` that satisfies it), so a partition that groups
//! ops which cannot share items is split into several kernels instead of being
//! miscompiled.
//!
//! Views (`Reshape`, `Permute`, `Broadcast`, `Slice`, `Concat`) are index math
//! (`Val`): a consumer folds the whole view chain into its loads and a view
//! is only copied when its value must exist in memory. `Constant`s are literals.
//!
//! Ops that need their own grid (attention and its gradient, the loss, the
//! norm projection of the connection coefficients,
//! temporal augmentation and its gradient) are lowered by the `attention` and
//! `own_grid` modules;
//! the sparse MoE ops become Plan steps of their own (routing, grouped GEMMs) in
//! the `moe` module. [`lower_own_grid`], in this file, is the one dispatch that
//! sends each of these ops to its module.
//!
//! This file holds the types every phase shares (targets, launches, lowerings,
//! errors, literals, fresh names). The phases, each file using only this one and
//! the files listed before it:
//!
//! - `folds`: reductions inside one item, as interleaved partial folds;
//! - `views`: the view algebra, how a kernel reaches a value's elements;
//! - `buffers`: plan buffers as kernel parameters, the sinks ops write their
//!   items into, and the copy that gives a view a buffer of its own;
//! - `op_rules`: what the lowering must know of each op (own grid or not,
//!   per-item scratch, how it splits into items), each by the op's family;
//! - `item_split`: the item count of a fused kernel ([`itemize`]);
//! - `item`: the per-op emitters of one item's part;
//! - `fused`: a fused kernel from its nodes;
//! - `reduce` and `lanes`: kernels of their own for nodes that run better
//!   than one item per token (sums over tokens, Sinkhorn in lanes);
//! - `attention`, `vocab_loss`, `own_grid`, `moe`: ops on grids, or Plan steps, of their own.

mod attention;
mod buffers;
mod folds;
mod fused;
mod item;
mod item_split;
mod lanes;
mod moe;
mod op_rules;
mod own_grid;
mod reduce;
mod views;
mod vocab_loss;

pub use attention::{attention_grads, query_block_rows};
pub use fused::lower_fused;
pub use item_split::{item_splits, itemize, ItemSplit};
pub use lanes::{has_lanes_form, lower_sinkhorn_lanes};
pub use moe::{moe_route, route_slot};
pub use op_rules::has_own_grid;
pub use own_grid::temporal_grads;
pub use reduce::{is_token_reduction, lower_column_reduce, lower_scatter_columns};
pub use vocab_loss::linear_cross_entropy_grads;

use std::cell::Cell;

use ir::graph::{Graph, NodeId, Op};
use ir::DType;
use thiserror::Error;

use crate::kernel::{f32, f64, i32, i64, Expr, Grid, Kernel, KernelError, Ty};

/// Where a Plan's kernels run: it bounds the per-item scratch of fused kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Target {
    /// C on CPU threads: one item's local arrays live on the worker's stack and stay
    /// in its L2 cache.
    #[default]
    Cpu,
    /// CUDA, one thread per item: local arrays live in per-thread local memory.
    Cuda,
}

impl Target {
    /// Largest total length (elements) of the per-item local arrays of one fused
    /// kernel; larger groups are split into several kernels. On the CPU 32768
    /// floats (128 KiB, within a core's L2) hold a token's whole xHC state
    /// (N·C = 16·256 at the bench width) several times over, so the state
    /// gradient of a sublayer (a LayerNorm's gradient plus the routed pieces,
    /// docs/math.md §6.8) is assembled in one pass instead of one kernel per op,
    /// each re-reading the state from memory; with half that, the backward
    /// moved 7.6 GB a step instead of 6.7. On the GPU 512 keeps a thread's
    /// scratch small enough for registers and L1.
    pub fn local_limit(self) -> usize {
        match self {
            Target::Cpu => 32768,
            Target::Cuda => 512,
        }
    }
}

/// CUDA threads per block of emitted thread-per-item kernels. Fused and
/// own-grid bodies are long; with 256-thread launch bounds ptxas caps them at
/// 64 registers and spills, with 128 it gives them the registers they need.
pub const BLOCK: u32 = 128;

/// The thread-per-item grid of `n` items used by every emitted kernel.
pub fn grid(n: usize) -> Grid {
    Grid::ThreadPerItem { n, block: BLOCK }
}

/// A buffer argument of a launch: a graph value, or a temporary owned by the
/// lowering of one node (indexes [`Lowering::temps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arg {
    Node(NodeId),
    Temp(usize),
}

/// One kernel launch with its buffers, in parameter order.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub kernel: Kernel,
    pub args: Vec<Arg>,
}

/// A library matrix product over launch buffers: [`crate::plan::Gemm`] with
/// [`Arg`]s for buffers.
pub type GemmCall = crate::plan::Gemm<Arg>;

/// One step of a lowering.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    Launch(Launch),
    Gemm(GemmCall),
    /// Sparse MoE routing ([`crate::plan::MoeRoute`]).
    Route(crate::plan::MoeRoute<Arg>),
    /// A grouped product over expert row groups ([`crate::plan::GroupedGemm`]).
    Grouped(crate::plan::GroupedGemm<Arg>),
}

/// The steps that compute some nodes, in order, and the temporaries
/// (length, dtype) they share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lowering {
    pub steps: Vec<Work>,
    pub temps: Vec<(usize, DType)>,
    /// Steps that may run entry by entry ([`crate::plan::Chain`]).
    pub chain: Option<ChainWorks>,
}

/// The steps `works` of a [`Lowering`] that form a [`crate::plan::Chain`]
/// of `entries` entries.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainWorks {
    pub works: std::ops::Range<usize>,
    pub entries: usize,
}

/// A lowering of one launch and no temporaries.
fn single(launch: Launch) -> Lowering {
    Lowering { steps: vec![Work::Launch(launch)], temps: Vec::new(), chain: None }
}

/// The temporaries of one lowering.
#[derive(Default)]
pub(crate) struct Temps(pub(crate) Vec<(usize, DType)>);

impl Temps {
    pub(crate) fn add(&mut self, len: usize, dtype: DType) -> Arg {
        self.0.push((len.max(1), dtype));
        Arg::Temp(self.0.len() - 1)
    }
}

/// Why nodes could not be lowered.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EmitError {
    #[error("%{node} ({op}): {message}")]
    Unsupported { node: usize, op: &'static str, message: String },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl EmitError {
    pub(crate) fn at(node: NodeId, op: &Op, message: impl Into<String>) -> EmitError {
        EmitError::Unsupported { node: node.index(), op: op.name(), message: message.into() }
    }
}

/// The first output a sibling lowering is asked for (`outs` holds one slot per output
/// kind, `None` where the graph reads none): the node whose inputs every sibling shares.
pub(crate) fn first_requested(
    outs: &[Option<NodeId>],
    op: &'static str,
    what: &str,
) -> Result<NodeId, EmitError> {
    outs.iter().flatten().copied().next().ok_or_else(|| EmitError::Unsupported {
        node: usize::MAX,
        op,
        message: format!("no {what} requested"),
    })
}

/// An `i64` index literal.
pub(crate) fn ix(v: usize) -> Expr {
    i64(v as i64)
}

/// A float literal of type `ty`.
pub(crate) fn lit(ty: Ty, v: f64) -> Expr {
    match ty {
        Ty::F64 => f64(v),
        Ty::I32 => i32(v as i32),
        Ty::I64 => i64(v as i64),
        _ => f32(v as f32),
    }
}

/// Row-major strides of `dims`.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    ir::Shape::new(dims).strides()
}

/// Elements of a value of shape `dims`.
pub(crate) fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Fresh variable names for one kernel (the validator forbids shadowing).
#[derive(Debug, Default)]
pub(crate) struct Names(Cell<usize>);

impl Names {
    pub(crate) fn fresh(&self, prefix: &str) -> String {
        let n = self.0.get();
        self.0.set(n + 1);
        format!("{prefix}{n}")
    }
}

/// Which values a kernel's nodes need in memory, and how nodes outside it are read.
pub trait Residency {
    /// Whether node `id` has a plan buffer (it is read by another step, or it is a
    /// parameter, input, graph output or gradient).
    fn has_buffer(&self, id: NodeId) -> bool;
}

/// Lowers one op on a grid of its own (see [`has_own_grid`]) into its launches: the
/// attention ops in `attention`, the loss, the norm projection and temporal augmentation
/// in `own_grid`, the MoE ops in `moe` (Plan steps, not kernels).
pub fn lower_own_grid(graph: &Graph, id: NodeId, name: &str, target: Target) -> Result<Lowering, EmitError> {
    let node = graph.node(id);
    match &node.op {
        Op::CausalAttention { .. } => attention::attention(graph, id, name, target),
        Op::CausalAttentionGrad { wrt, .. } if *wrt < 3 => {
            let mut outs = [None; 3];
            outs[*wrt] = Some(id);
            attention_grads(graph, outs, name, target)
        }
        Op::SoftmaxCrossEntropy => own_grid::cross_entropy(graph, id, name),
        Op::LinearCrossEntropy { .. } => vocab_loss::linear_cross_entropy(graph, id, name, target),
        Op::LinearCrossEntropyGrad { wrt, .. } if *wrt < 2 => {
            let mut outs = [None; 2];
            outs[*wrt] = Some(id);
            linear_cross_entropy_grads(graph, outs, name, target)
        }
        Op::NormProject { eps, centered } => own_grid::norm_project(graph, id, name, *eps, *centered, target),
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            Ok(single(own_grid::temporal(graph, id, name, *gram_schmidt, *eps_rel, target)?))
        }
        Op::TemporalAugmentGrad { wrt, .. } => {
            let mut outs = vec![None; graph.inputs(id).len() - 1];
            match outs.get_mut(*wrt) {
                Some(slot) => *slot = Some(id),
                None => return Err(EmitError::at(id, &node.op, format!("no operand {wrt}"))),
            }
            temporal_grads(graph, &outs, name, target)
        }
        op @ (Op::Input { .. }
        | Op::Param(_)
        | Op::Constant { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Affine { .. }
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::MatMul { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::ScatterRows { .. }
        | Op::TopK { .. }
        | Op::Softmax
        | Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Sinkhorn { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::SinkhornGrad { .. }) => Err(EmitError::at(id, op, "is not lowered on a grid of its own")),
        Op::MoeRoute { out, .. } => {
            let mut outs = [None; 3];
            outs[route_slot(*out)] = Some(id);
            moe_route(graph, &outs, name, target)
        }
        Op::GroupedMatMul { trans_b } => {
            moe::grouped(graph, id, name, crate::plan::GroupedForm::Rows, *trans_b, target)
        }
        Op::GroupedMatMulGrad { trans_b } => {
            moe::grouped(graph, id, name, crate::plan::GroupedForm::WeightGrad, *trans_b, target)
        }
    }
}
