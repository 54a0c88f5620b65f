//! Reverse-mode autodiff as a graph-to-graph pass (docs/architecture.md §4): one derivative
//! rule per op in one table (`rules`). TopK indices carry no gradient; an op with no rule
//! is an error, never a silent zero.
//!
//! The sweep visits, in reverse topological order, only the float nodes that lie on a
//! path from a `wrt` node to the loss; adjoints reaching a node along several uses are
//! summed with `Add`. Integer values (token ids, routing indices) stop the path: the
//! function is piecewise constant in them (docs/math.md §6.8, hard TopK).

mod builder;
mod rules;

use crate::graph::Build;
use crate::graph::{Graph, GraphError, NodeId, Op, ParamClass, Region, Role};
use std::collections::{HashMap, HashSet};

/// Errors while differentiating.
#[derive(Debug, thiserror::Error)]
pub enum AutodiffError {
    #[error("no derivative rule for op {op} at %{node}")]
    NoRule { op: &'static str, node: usize },
    #[error("loss node %{node} must be a float scalar, got shape {shape}")]
    NotScalar { node: usize, shape: crate::Shape },
    #[error(
        "derivative rule of {op} at %{node} gave input {slot} an adjoint of shape {got}, expected {expected}"
    )]
    RuleShape { op: &'static str, node: usize, slot: usize, got: crate::Shape, expected: crate::Shape },
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Appends the backward pass of `loss` to `graph` and returns, for each node in
/// `wrt`, the node holding d loss / d wrt (same shape as `wrt`; a zero constant if
/// the loss does not depend on it, or depends on it only through integer values).
/// New nodes get `Region::Backward` with the sublayer and MTP module of the forward
/// node they differentiate; the graph's current role is restored afterwards.
pub fn grad(graph: &mut Graph, loss: NodeId, wrt: &[NodeId]) -> Result<Vec<NodeId>, AutodiffError> {
    let node = graph.node(loss);
    if node.shape.rank() != 0 || !node.dtype.is_float() {
        return Err(AutodiffError::NotScalar { node: loss.index(), shape: node.shape.clone() });
    }
    let saved = graph.role();
    let result = sweep(graph, loss, wrt);
    graph.set_role(saved);
    result
}

/// The role of nodes that differentiate `id`.
fn backward_role(graph: &Graph, id: NodeId) -> Role {
    Role { region: Region::Backward, ..graph.node(id).role }
}

/// Float nodes on a path from a `wrt` node to `loss` that does not pass through an
/// integer value. A constant table (`ParamClass::Table`, e.g. the permutation matrices of
/// docs/math.md §12.2) starts no path: it is never optimized, so its gradient is zero and
/// costs nothing.
fn relevant_nodes(graph: &Graph, order: &[NodeId], loss: NodeId, wrt: &[NodeId]) -> HashSet<NodeId> {
    let mut to_loss = HashSet::new();
    let mut stack = vec![loss];
    while let Some(id) = stack.pop() {
        if to_loss.insert(id) {
            stack.extend(graph.inputs(id));
        }
    }
    let mut active: HashSet<NodeId> = HashSet::new();
    for &id in order {
        let float = graph.node(id).dtype.is_float();
        let table = matches!(&graph.node(id).op, Op::Param(info) if info.class == ParamClass::Table);
        let source = wrt.contains(&id) && !table;
        if float && (source || graph.inputs(id).iter().any(|i| active.contains(i))) {
            active.insert(id);
        }
    }
    active.retain(|id| to_loss.contains(id));
    active
}

fn sweep(graph: &mut Graph, loss: NodeId, wrt: &[NodeId]) -> Result<Vec<NodeId>, AutodiffError> {
    let order = graph.topo_order();
    let relevant = relevant_nodes(graph, &order, loss, wrt);
    let mut pending: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let mut adjoint: HashMap<NodeId, NodeId> = HashMap::new();
    if relevant.contains(&loss) {
        graph.set_role(backward_role(graph, loss));
        let dtype = graph.node(loss).dtype;
        let one = builder::Builder { g: graph }.constant(1.0, crate::Shape::scalar(), dtype);
        pending.insert(loss, vec![one]);
    }
    for &id in order.iter().rev() {
        let Some(parts) = pending.remove(&id) else { continue };
        graph.set_role(backward_role(graph, id));
        let mut b = builder::Builder { g: graph };
        let mut dy = parts[0];
        for &part in &parts[1..] {
            dy = b.add(dy, part)?;
        }
        adjoint.insert(id, dy);
        let inputs = b.g.inputs(id);
        let needs: Vec<bool> = inputs.iter().map(|i| relevant.contains(i)).collect();
        if !needs.contains(&true) {
            continue;
        }
        let adjoints = rules::vjp(&mut b, id, dy, &needs)?;
        let op = b.g.node(id).op.name();
        for (slot, (&input, &adj)) in inputs.iter().zip(&adjoints).enumerate().filter(|&(s, _)| needs[s]) {
            let adj = adj.ok_or(AutodiffError::NoRule { op, node: id.index() })?;
            let (got, expected) = (b.shape(adj), b.shape(input));
            if got != expected {
                return Err(AutodiffError::RuleShape { op, node: id.index(), slot, got, expected });
            }
            pending.entry(input).or_default().push(adj);
        }
    }
    let mut grads = Vec::with_capacity(wrt.len());
    for &w in wrt {
        let g = match adjoint.get(&w) {
            Some(&g) => g,
            None => {
                graph.set_role(backward_role(graph, w));
                let node = graph.node(w);
                let dtype = if node.dtype.is_float() { node.dtype } else { graph.node(loss).dtype };
                let shape = node.shape.clone();
                builder::Builder { g: graph }.constant(0.0, shape, dtype)
            }
        };
        grads.push(g);
    }
    Ok(grads)
}
