//! Where a partition comes from ([`fused_partition`], [`one_op_per_group`]) and
//! the first phase of [`super::compile`]: the partition checked. Any partition
//! that respects dependencies compiles (docs/architecture.md §5), so what is
//! checked is exactly that: each node in one group, every node the request needs
//! in some group, and no group reading a value a later group computes.

use std::collections::{HashMap, HashSet};

use ir::graph::{Graph, NodeId};

use super::residency::producers;
use super::{CompileError, Partition, Request};

/// Every non-source node, one group each, in the graph's topological order.
pub fn one_op_per_group(graph: &Graph) -> Partition {
    graph.topo_order().into_iter().filter(|&id| !graph.node(id).op.is_source()).map(|id| vec![id]).collect()
}

/// The partition of [`ir::passes::fuse()`] (sources dropped), in its execution order.
pub fn fused_partition(graph: &Graph, request: &Request) -> Result<Partition, CompileError> {
    let fused = ir::passes::fuse(graph, &request.roots())?;
    Ok(fused
        .order
        .iter()
        .map(|&g| fused.group(g).nodes.iter().copied().filter(|&id| !graph.node(id).op.is_source()).collect())
        .filter(|g: &Vec<NodeId>| !g.is_empty())
        .collect())
}

/// The groups of a partition, checked, and the group of each node.
pub(super) type CheckedGroups = (Vec<Vec<NodeId>>, HashMap<NodeId, usize>);

/// The partition's groups with sources dropped and members in topological order
/// (each node once), with each node's group; an error where a node is unknown or
/// listed twice, where a node the request needs is in no group, or where a group
/// reads a value a later group computes.
pub(super) fn checked_groups(
    graph: &Graph,
    partition: &[Vec<NodeId>],
    request: &Request,
    pos: &HashMap<NodeId, usize>,
) -> Result<CheckedGroups, CompileError> {
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    let mut group_of: HashMap<NodeId, usize> = HashMap::new();
    for g in partition {
        let mut nodes = Vec::new();
        for &id in g {
            if !pos.contains_key(&id) {
                return Err(CompileError::Unknown { node: id.index() });
            }
            if graph.node(id).op.is_source() {
                continue;
            }
            if group_of.insert(id, groups.len()).is_some() {
                return Err(CompileError::Duplicate { node: id.index() });
            }
            nodes.push(id);
        }
        nodes.sort_by_key(|id| pos[id]);
        if !nodes.is_empty() {
            groups.push(nodes);
        }
    }
    let roots = request.roots();
    let mut stack = roots.clone();
    let mut seen = HashSet::new();
    while let Some(id) = stack.pop() {
        if !pos.contains_key(&id) {
            return Err(CompileError::Unknown { node: id.index() });
        }
        if !seen.insert(id) {
            continue;
        }
        let node = graph.node(id);
        if !node.op.is_source() && !group_of.contains_key(&id) {
            return Err(CompileError::Missing { node: id.index(), op: node.op.name() });
        }
        stack.extend(graph.inputs(id));
    }
    for (gi, g) in groups.iter().enumerate() {
        for &id in g {
            let mut reads = Vec::new();
            for input in graph.inputs(id) {
                producers(graph, input, &mut reads);
            }
            if let Some(late) = reads.into_iter().find(|p| group_of.get(p).is_some_and(|&gj| gj > gi)) {
                return Err(CompileError::Order { node: id.index(), input: late.index() });
            }
        }
    }

    Ok((groups, group_of))
}
