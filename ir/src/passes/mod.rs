//! Graph passes between autodiff and code generation (docs/architecture.md §2, §5, §7),
//! and one before autodiff, [`fuse_vocab_losses()`] (the output projection and the
//! vocabulary loss as one chunked op, docs/math.md §1.7):
//! [`narrow_broadcast_products()`] (products over a broadcast state at the
//! state's own width), [`split_norm_projections()`] (RMS projections as statistic, GEMM and scaling),
//! [`simplify()`] (CSE and DCE), [`sum_within_tokens_first()`] (token reductions
//! over merged rows summed within each token first), [`rematerialize()`] (cheap elementwise values
//! copied for the groups that read them), [`fuse()`] (partition into fusion groups, one kernel
//! each) and [`memplan()`] (a liveness-based buffer arena over the groups' execution
//! order). Every pass is deterministic: ties are broken by topological position or
//! node id, never by hash order.
//!
//! Typical use, after [`crate::autodiff::grad`] returned `grads`
//! ([`prepare_for_fusion()`] runs the first five in order):
//! ```text
//! narrow_broadcast_products(&mut graph);
//! split_norm_projections(&mut graph, &grads);
//! simplify(&mut graph, &grads);
//! sum_within_tokens_first(&mut graph, &grads);
//! rematerialize(&mut graph, &grads)?;
//! let fused = fuse(&graph, &grads)?;
//! let plan = memplan(&graph, &fused, &grads)?;
//! ```

pub mod broadcast_products;
pub mod fuse;
pub mod memplan;
pub mod norm_project;
pub mod recompute;
pub mod remat;
pub mod simplify;
pub mod token_sums;
pub mod tokens;
pub mod vocab_loss;

use crate::graph::{Graph, NodeId};

pub use broadcast_products::{narrow_broadcast_products, NarrowedProducts};
pub use fuse::{
    connection_traffic, fuse, fused_connection_traffic, FuseError, FusedGraph, FusionGroup, GroupCost,
    GroupId, GroupKind, TrafficError,
};
pub use memplan::{memplan, MemPlanError, MemoryPlan, Slot};
pub use norm_project::split_norm_projections;
pub use recompute::{recompute_blocks, RecomputeStats};
pub use remat::{rematerialize, RematStats};
pub use simplify::{simplify, SimplifyStats};
pub use token_sums::sum_within_tokens_first;
pub use tokens::TokenAxes;
pub use vocab_loss::fuse_vocab_losses;

/// What [`prepare_for_fusion`] did, pass by pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrepareStats {
    /// What [`narrow_broadcast_products`] rewrote.
    pub broadcast_products: NarrowedProducts,
    /// Norm projections [`split_norm_projections`] rewrote.
    pub norm_projections: usize,
    pub simplify: SimplifyStats,
    /// Token sums [`sum_within_tokens_first`] rewrote.
    pub token_sums: usize,
    pub remat: RematStats,
    /// Heads whose output projection and loss [`fuse_vocab_losses`] fused (it runs
    /// before autodiff; its caller records the count here).
    pub vocab_losses: usize,
    /// What [`recompute_blocks`] cloned for the backward (it runs after these passes,
    /// where the spec's `train.recompute` asks for it; its caller records it here).
    pub recompute: RecomputeStats,
}

/// The passes between autodiff and fusion, in the order the runtime's
/// training graph and the code generator's tests both rely on:
/// [`narrow_broadcast_products()`], [`split_norm_projections()`], [`simplify()`],
/// [`sum_within_tokens_first()`], [`rematerialize()`]. `roots` (the gradients) are kept.
pub fn prepare_for_fusion(graph: &mut Graph, roots: &[NodeId]) -> Result<PrepareStats, FuseError> {
    let broadcast_products = narrow_broadcast_products(graph);
    let norm_projections = split_norm_projections(graph, roots);
    let simplify = simplify(graph, roots);
    let token_sums = sum_within_tokens_first(graph, roots);
    let remat = rematerialize(graph, roots)?;
    Ok(PrepareStats {
        broadcast_products,
        norm_projections,
        simplify,
        token_sums,
        remat,
        vocab_losses: 0,
        recompute: RecomputeStats::default(),
    })
}
