//! Reverse-mode autodiff as a graph-to-graph pass (DESIGN.md §4): one derivative
//! rule per op in one table. TopK indices carry no gradient; an op with no rule
//! is an error, never a silent zero.

use crate::graph::{Graph, GraphError, NodeId};

/// Errors while differentiating.
#[derive(Debug, thiserror::Error)]
pub enum AutodiffError {
    #[error("no derivative rule for op {op} at %{node}")]
    NoRule { op: &'static str, node: usize },
    #[error("loss node %{node} must be a float scalar, got shape {shape}")]
    NotScalar { node: usize, shape: crate::Shape },
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Appends the backward pass of `loss` to `graph` and returns, for each node in
/// `wrt`, the node holding d loss / d wrt (same shape as `wrt`; a zero constant if
/// the loss does not depend on it). New nodes get `Region::Backward`.
pub fn grad(graph: &mut Graph, loss: NodeId, wrt: &[NodeId]) -> Result<Vec<NodeId>, AutodiffError> {
    let _ = (graph, loss, wrt);
    unimplemented!("autodiff")
}
