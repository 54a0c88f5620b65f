//! Residency: which values have a Plan buffer. A value lives inside the unit that
//! computes it unless a later unit, an own-grid op or a role reads it
//! (docs/architecture.md §5.2: a fused kernel reads each input once and writes
//! each output once); views are folded into their readers.

use std::collections::{HashMap, HashSet};

use ir::graph::{Graph, NodeId, Op};

use crate::emit::Residency;

/// The nodes that read `id`'s memory: non-view consumers, looking through
/// views (every consumer folds them), plus views copied into a buffer.
pub(super) fn real_users(
    graph: &Graph,
    id: NodeId,
    buffered: &dyn Fn(NodeId) -> bool,
    out: &mut Vec<NodeId>,
) {
    for (u, _) in graph.users(id) {
        if graph.node(u).op.is_view() {
            if buffered(u) {
                out.push(u);
            }
            real_users(graph, u, buffered, out);
        } else {
            out.push(u);
        }
    }
}

/// The non-view nodes whose values a read of `id` touches (views resolved).
pub(super) fn producers(graph: &Graph, id: NodeId, out: &mut Vec<NodeId>) {
    if graph.node(id).op.is_view() {
        for i in graph.inputs(id) {
            producers(graph, i, out);
        }
    } else {
        out.push(id);
    }
}

/// Residency of values for one compile: which nodes have a plan buffer.
pub(super) struct Buffered {
    pub(super) set: HashSet<NodeId>,
}

impl Residency for Buffered {
    fn has_buffer(&self, id: NodeId) -> bool {
        self.set.contains(&id)
    }
}

/// Which nodes need a buffer when values live within `unit_of` (a node → unit
/// index map) and `forced` / role nodes always have one.
pub(super) fn residency(
    graph: &Graph,
    nodes: &[NodeId],
    unit_of: &HashMap<NodeId, usize>,
    own_grid: &HashSet<NodeId>,
    forced: &HashSet<NodeId>,
) -> Buffered {
    let mut set: HashSet<NodeId> = forced.clone();
    for &id in graph.node_ids().iter() {
        if matches!(graph.node(id).op, Op::Param(_) | Op::Input { .. }) {
            set.insert(id);
        }
    }
    set.extend(own_grid.iter().copied());
    let pre = set.clone();
    let buffered = |u: NodeId| pre.contains(&u);
    for &id in nodes {
        let node = graph.node(id);
        if node.op.is_view() || matches!(node.op, Op::Constant { .. }) {
            continue;
        }
        let mut users = Vec::new();
        real_users(graph, id, &buffered, &mut users);
        let here = unit_of.get(&id);
        if users.iter().any(|u| own_grid.contains(u) || unit_of.get(u) != here) {
            set.insert(id);
        }
    }
    Buffered { set }
}
