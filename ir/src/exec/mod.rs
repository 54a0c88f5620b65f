//! The reference executor: a plain Rust interpreter of the unfused graph,
//! generic over f32 and f64 (DESIGN.md §2). It is the oracle every other
//! backend is tested against, so clarity beats speed here.

mod tensor;

pub use tensor::{Float, Tensor, Value};

use crate::graph::{Graph, GraphError, NodeId};
use std::collections::HashMap;

/// Errors while executing a graph.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("no value bound for {kind} node %{node} ({name})")]
    Unbound { kind: &'static str, node: usize, name: String },
    #[error("value bound to %{node} ({name}) has shape {got}, the graph expects {expected}")]
    BoundShape { node: usize, name: String, got: crate::Shape, expected: crate::Shape },
    #[error("{op} at %{node}: {message}")]
    Op { op: &'static str, node: usize, message: String },
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Evaluates `outputs` given values for every `Input` and `Param` node they depend on.
/// Intermediates are freed as soon as their last consumer has run.
pub fn run<T: Float>(
    graph: &Graph,
    sources: &HashMap<NodeId, Value<T>>,
    outputs: &[NodeId],
) -> Result<HashMap<NodeId, Value<T>>, ExecError> {
    let _ = (graph, sources, outputs);
    unimplemented!("reference executor")
}
