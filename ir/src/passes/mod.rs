//! Graph passes between autodiff and code generation (DESIGN.md §2, §5, §7):
//! [`simplify()`] (CSE and DCE), [`sum_within_tokens_first()`] (token reductions
//! over merged rows summed within each token first), [`rematerialize()`] (cheap elementwise values
//! copied for the groups that read them), [`fuse()`] (partition into fusion groups, one kernel
//! each) and [`memplan()`] (a liveness-based buffer arena over the groups' execution
//! order). Every pass is deterministic: ties are broken by topological position or
//! node id, never by hash order.
//!
//! Typical use, after [`crate::autodiff::grad`] returned `grads`:
//! ```text
//! simplify(&mut graph, &grads);
//! sum_within_tokens_first(&mut graph, &grads);
//! rematerialize(&mut graph, &grads)?;
//! let fused = fuse(&graph, &grads)?;
//! let plan = memplan(&graph, &fused, &grads)?;
//! ```

pub mod fuse;
pub mod memplan;
pub mod remat;
pub mod simplify;
pub mod token_sums;
pub mod tokens;

pub use fuse::{
    connection_traffic, fuse, fused_connection_traffic, FuseError, FusedGraph, FusionGroup, GroupCost,
    GroupId, GroupKind, TrafficError,
};
pub use memplan::{memplan, MemPlanError, MemoryPlan, Slot};
pub use remat::{rematerialize, RematStats};
pub use simplify::{simplify, SimplifyStats};
pub use token_sums::sum_within_tokens_first;
pub use tokens::TokenAxes;
