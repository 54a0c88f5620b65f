//! Simplification before fusion (docs/architecture.md §2): common-subexpression elimination and
//! dead-code elimination. Neither changes any value: CSE only merges nodes that
//! compute the same pure function of the same operands, and DCE only removes nodes no
//! requested value depends on.
//!
//! Autodiff produces most of the duplicates: every `zeros_like` is a fresh zero
//! constant, and the derivative rules of composite ops recompute shared statistics
//! (docs/math.md §1.4) once per use.

use crate::graph::{Graph, NodeId, Op};
use std::collections::{HashMap, HashSet};

/// What [`simplify`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimplifyStats {
    pub nodes_before: usize,
    /// Nodes merged into an identical earlier node.
    pub cse_merged: usize,
    /// Nodes removed because no root or output depends on them.
    pub dce_removed: usize,
    pub nodes_after: usize,
}

/// Runs CSE to a fixed point, then DCE.
///
/// `roots` are the values the caller needs besides the graph's named outputs (e.g.
/// the parameter gradients returned by [`crate::autodiff::grad`]). They are never
/// merged into each other, so each keeps its own identity (and, later, its own
/// persistent buffer); an entry of `roots` that duplicates a non-root node absorbs
/// that node. Named outputs that pointed at a merged node are redirected.
///
/// Merging rules: `Param` and `Input` nodes are never merged (each is a distinct
/// binding); `Constant`s merge when value, shape and dtype are equal; every other op
/// merges when op (with all attributes), operands in slot order, shape and dtype are
/// equal. DCE keeps every `Param` and `Input` node: they are the graph's interface,
/// bound by the runtime whether or not the loss reads them.
pub fn simplify(graph: &mut Graph, roots: &[NodeId]) -> SimplifyStats {
    let nodes_before = graph.node_count();
    let protected: HashSet<NodeId> = roots.iter().copied().collect();
    let mut cse_merged = 0;
    loop {
        let merged = cse_round(graph, &protected);
        if merged == 0 {
            break;
        }
        cse_merged += merged;
    }
    let dce_removed = dce(graph, roots);
    SimplifyStats { nodes_before, cse_merged, dce_removed, nodes_after: graph.node_count() }
}

/// The identity of a computation: op with attributes (Debug prints f64 exactly, so
/// constants differing in any bit stay apart), operands in slot order, type.
type Key = (String, Vec<NodeId>, Vec<usize>, crate::DType);

fn key(graph: &Graph, id: NodeId) -> Option<Key> {
    let node = graph.node(id);
    if matches!(node.op, Op::Param(_) | Op::Input { .. }) {
        return None;
    }
    Some((format!("{:?}", node.op), graph.inputs(id), node.shape.dims().to_vec(), node.dtype))
}

/// One pass in topological order; returns how many nodes were merged away.
fn cse_round(graph: &mut Graph, protected: &HashSet<NodeId>) -> usize {
    let mut seen: HashMap<Key, NodeId> = HashMap::new();
    let mut merged = 0;
    for id in graph.topo_order() {
        let Some(k) = key(graph, id) else { continue };
        match seen.get(&k).copied() {
            None => {
                seen.insert(k, id);
            }
            Some(first) => match (protected.contains(&first), protected.contains(&id)) {
                (true, true) => {}
                (false, true) => {
                    // The root survives: the earlier duplicate's users move to it. They
                    // cannot be ancestors of `id`, whose operands are `first`'s.
                    redirect(graph, first, id);
                    seen.insert(k, id);
                    merged += 1;
                }
                _ => {
                    redirect(graph, id, first);
                    merged += 1;
                }
            },
        }
    }
    merged
}

/// Moves every use of `from` (edges and named outputs) to `to`, then removes `from`.
fn redirect(graph: &mut Graph, from: NodeId, to: NodeId) {
    for (user, slot) in graph.users(from) {
        graph.g.add_edge(to, user, slot);
    }
    let outputs = graph.outputs().to_vec();
    if outputs.iter().any(|&(_, id)| id == from) {
        // Re-setting every output in order keeps their order.
        for (name, id) in outputs {
            graph.set_output(&name, if id == from { to } else { id });
        }
    }
    graph.g.remove_node(from);
}

/// Removes nodes that neither the named outputs nor `roots` depend on, keeping the
/// graph's `Param` and `Input` nodes. Returns how many were removed.
fn dce(graph: &mut Graph, roots: &[NodeId]) -> usize {
    let mut live: HashSet<NodeId> = HashSet::new();
    let mut stack: Vec<NodeId> = graph.outputs().iter().map(|&(_, id)| id).collect();
    stack.extend(roots.iter().copied().filter(|&r| graph.g.contains_node(r)));
    while let Some(id) = stack.pop() {
        if live.insert(id) {
            stack.extend(graph.inputs(id));
        }
    }
    let dead: Vec<NodeId> = graph
        .node_ids()
        .into_iter()
        .filter(|id| !live.contains(id) && !matches!(graph.node(*id).op, Op::Param(_) | Op::Input { .. }))
        .collect();
    for &id in &dead {
        graph.g.remove_node(id);
    }
    dead.len()
}

#[cfg(test)]
mod tests {
    use super::simplify;
    use crate::graph::{Graph, Init, Op, ParamClass, ParamInfo, UnaryOp};
    use crate::{DType, Shape};

    #[test]
    fn merges_duplicates_but_never_params_and_keeps_roots_apart() {
        let mut g = Graph::new();
        let info = |name: &str| ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Gain };
        let a = g.add_source(Op::Param(info("a")), Shape::new([4]), DType::F32, None);
        let b = g.add_source(Op::Param(info("a")), Shape::new([4]), DType::F32, None);
        let z1 = g.add_source(Op::Constant { value: 0.0 }, Shape::new([4]), DType::F32, None);
        let z2 = g.add_source(Op::Constant { value: 0.0 }, Shape::new([4]), DType::F32, None);
        let e1 = g.add(Op::Unary(UnaryOp::Exp), &[a]).unwrap();
        let e2 = g.add(Op::Unary(UnaryOp::Exp), &[a]).unwrap();
        let s = g.add(Op::Binary(crate::graph::BinaryOp::Add), &[e1, e2]).unwrap();
        let t = g.add(Op::Binary(crate::graph::BinaryOp::Add), &[s, b]).unwrap();
        let dead = g.add(Op::Unary(UnaryOp::Tanh), &[t]).unwrap();
        g.set_output("t", t);
        let stats = simplify(&mut g, &[z1, z2]);
        // e2 merged into e1; z1 and z2 are both roots and stay apart; `dead` removed.
        assert_eq!(stats.cse_merged, 1);
        assert_eq!(stats.dce_removed, 1);
        assert!(g.g.contains_node(a) && g.g.contains_node(b) && g.g.contains_node(z2));
        assert!(!g.g.contains_node(e2) && !g.g.contains_node(dead));
        assert_eq!(g.inputs(s), vec![e1, e1]);
        assert_eq!(stats.nodes_after, stats.nodes_before - 2);
    }
}
