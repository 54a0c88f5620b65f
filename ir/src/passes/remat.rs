//! Recomputation of cheap elementwise values where they are read (DESIGN.md §5).
//!
//! A fusion group writes each value a later group reads, and the later group
//! reads it back: a round trip through memory of the value's size. When the
//! value is a short elementwise chain over operands the reader has at hand
//! (operands it reads anyway, or per-token statistics a few elements wide),
//! computing the chain again in the reader costs a few FLOPs per element and
//! saves that round trip. Common-subexpression elimination merges such
//! chains (one copy feeding a norm's statistics and the other a gradient
//! term), so this pass runs after it: it copies the chain for the reader,
//! and [`super::fuse()`] then computes the copy in the reader's group.
//!
//! The case it was written for is the centred term of a LayerNorm-projection
//! gradient, `(x − μ) · s` over the xHC state (MATH.md §6.8,
//! [`crate::autodiff`]'s NormProject rule): `x − μ` also feeds the variance,
//! so the group before the weight-gradient product wrote the state-sized term
//! and the group after it, which reads `x` anyway, read it back.
//! DESIGN.md §5 rule 4 is kept: reductions and products are never copied.
//!
//! A forward value that only a backward group reads is recomputed there too
//! (the copy becomes a backward node, since fusion keeps the passes apart):
//! SwiGLU's `silu(gate)` (MATH.md §1.3) was written by the forward for the
//! up projection's gradient `dh ⊙ silu(gate)` alone, and the backward kernel
//! of both gate gradients reads `gate` anyway.

use std::collections::{HashMap, HashSet};

use super::fuse::{fuse, FuseError, FusedGraph, GroupId, GroupKind};
use crate::graph::{Graph, NodeId, Op, Region, Role};

/// Deepest chain copied for one value: the value and the elementwise nodes
/// it is computed from, up to operands the reader has.
const MAX_CHAIN: usize = 4;

/// An operand at most this fraction of the copied value's bytes is cheap for
/// the reader to read in addition (a per-token statistic read by a
/// state-sized term is 1/4096 of it).
const SMALL_OPERAND_DIVISOR: usize = 16;

/// What [`rematerialize`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RematStats {
    /// Values now recomputed by a later group instead of read from memory.
    pub values: usize,
    /// Nodes added (the values and the chains they are computed from).
    pub nodes_added: usize,
    /// Bytes no longer written by the groups of the values and read back.
    pub bytes_saved: usize,
}

/// Copies, for each token-local group, the cheap elementwise chains it reads
/// from an earlier token-local group over the same tokens when every operand
/// of the chain is one the group reads already or is small
/// (`SMALL_OPERAND_DIVISOR`); the group's reads of the value move to the
/// copy. `roots` as for [`fuse()`].
pub fn rematerialize(graph: &mut Graph, roots: &[NodeId]) -> Result<RematStats, FuseError> {
    let fused = fuse(graph, roots)?;
    let mut stats = RematStats::default();
    // Chains whose originals may have lost their last reader, removed once no
    // node id of `fused` is looked up any more (removal frees ids for reuse).
    let mut copied: Vec<Vec<NodeId>> = Vec::new();
    for &t in &fused.order {
        let group = fused.group(t);
        if group.kind != GroupKind::TokenLocal {
            continue;
        }
        let members: HashSet<NodeId> = group.nodes.iter().copied().collect();
        // Fusion keeps the passes apart, so a copy runs in its reader's pass:
        // a forward value recomputed by a backward group is a backward node
        // (activation recomputation, e.g. SwiGLU's `silu(gate)`, MATH.md §1.3).
        let pass = (graph.node(group.nodes[0]).role.region == Region::Backward).then_some(Region::Backward);
        let mut reads: HashSet<NodeId> = members.clone();
        for &m in &group.nodes {
            reads.extend(graph.inputs(m));
        }
        for &value in &group.inputs {
            let Some(home) = fused.group_of(value) else { continue };
            let from = fused.group(home);
            if from.kind != GroupKind::TokenLocal || home == t || from.tokens != group.tokens {
                continue;
            }
            // Only where the home group then no longer writes the value: a
            // value other groups read stays written, and the copy would save
            // one read at the price of the chain's operands.
            let only_here = graph
                .users(value)
                .iter()
                .all(|&(u, _)| members.contains(&u) || fused.group_of(u) == Some(home));
            // The group reads the value itself, not through a view another
            // group holds (which the copy could not take over).
            let direct = graph.users(value).iter().any(|&(u, _)| members.contains(&u));
            let through_views = graph
                .users(value)
                .iter()
                .any(|&(u, _)| !members.contains(&u) && view_read_by(graph, u, &members));
            // Read by elementwise ops only: a per-token product in the group may
            // run as a batched GEMM step of its own, which reads the value from
            // memory, so the group would write the copy back (VWN's
            // `[64 x 64] @ [64 x 8]` stream products in DGHC, MATH.md §5.5).
            let in_kernel = graph
                .users(value)
                .iter()
                .all(|&(u, _)| !members.contains(&u) || recomputable(&graph.node(u).op));
            let kept = roots.contains(&value) || graph.outputs().iter().any(|&(_, o)| o == value);
            if !only_here || !direct || through_views || !in_kernel || kept {
                continue;
            }
            let mut chain = Vec::new();
            if !chain_of(graph, &fused, value, home, &reads, value, 0, &mut chain) {
                continue;
            }
            let copies = copy_chain(graph, &chain, pass);
            let copy = copies[&value];
            for (user, slot) in graph.users(value) {
                if members.contains(&user) {
                    let edge = graph.g.find_edge(value, user).expect("a user's edge");
                    graph.g.remove_edge(edge);
                    graph.g.add_edge(copy, user, slot);
                }
            }
            stats.values += 1;
            stats.nodes_added += chain.len();
            stats.bytes_saved += 2 * bytes(graph, value);
            copied.push(chain);
        }
    }
    remove_unused(graph, &copied.concat(), roots);
    Ok(stats)
}

/// Whether `id` is a view that a node of `members` reads, directly or
/// through further views.
fn view_read_by(graph: &Graph, id: NodeId, members: &HashSet<NodeId>) -> bool {
    graph.node(id).op.is_view()
        && graph.users(id).iter().any(|&(u, _)| members.contains(&u) || view_read_by(graph, u, members))
}

/// Elementwise ops, whose copy costs a few FLOPs per element.
fn recomputable(op: &Op) -> bool {
    matches!(op, Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } | Op::Cast { .. })
}

fn bytes(graph: &Graph, id: NodeId) -> usize {
    let node = graph.node(id);
    node.shape.numel() * node.dtype.size_bytes()
}

/// Whether `id` (computed in group `home`) can be computed by a group that
/// reads `reads`: it is elementwise and each operand is read there already,
/// small next to `value`, or itself such a node of `home`. Pushes the nodes
/// to copy onto `chain`, operands first.
#[allow(clippy::too_many_arguments)]
fn chain_of(
    graph: &Graph,
    fused: &FusedGraph,
    id: NodeId,
    home: GroupId,
    reads: &HashSet<NodeId>,
    value: NodeId,
    depth: usize,
    chain: &mut Vec<NodeId>,
) -> bool {
    if depth >= MAX_CHAIN || !recomputable(&graph.node(id).op) {
        return false;
    }
    for input in graph.inputs(id) {
        let cheap =
            reads.contains(&input) || bytes(graph, input) * SMALL_OPERAND_DIVISOR <= bytes(graph, value);
        if cheap {
            continue;
        }
        if fused.group_of(input) != Some(home)
            || !chain_of(graph, fused, input, home, reads, value, depth + 1, chain)
        {
            return false;
        }
    }
    if !chain.contains(&id) {
        chain.push(id);
    }
    true
}

/// Removes the nodes of `nodes` that nothing reads any more (the originals
/// whose readers all moved to copies, and operands only they read), until
/// none is left to remove.
fn remove_unused(graph: &mut Graph, nodes: &[NodeId], roots: &[NodeId]) {
    let mut left: Vec<NodeId> = nodes.to_vec();
    left.sort_unstable();
    left.dedup();
    loop {
        let unused = |graph: &Graph, id: NodeId| {
            graph.users(id).is_empty()
                && !roots.contains(&id)
                && !graph.outputs().iter().any(|&(_, o)| o == id)
        };
        let Some(at) = left.iter().position(|&id| unused(graph, id)) else { return };
        graph.g.remove_node(left.swap_remove(at));
    }
}

/// Adds a copy of each node of `chain` (operands first), reading the copies
/// of its operands where they were copied; returns original → copy. Each
/// copy keeps its original's role, in `pass` where one is given.
fn copy_chain(graph: &mut Graph, chain: &[NodeId], pass: Option<Region>) -> HashMap<NodeId, NodeId> {
    let role = graph.role();
    let mut copies: HashMap<NodeId, NodeId> = HashMap::new();
    for &id in chain {
        let node = graph.node(id).clone();
        let inputs: Vec<NodeId> =
            graph.inputs(id).iter().map(|i| copies.get(i).copied().unwrap_or(*i)).collect();
        graph.set_role(Role { region: pass.unwrap_or(node.role.region), ..node.role });
        let copy = graph.add_labeled(node.op, &inputs, node.label).expect("a copy of a valid node is valid");
        copies.insert(id, copy);
    }
    graph.set_role(role);
    copies
}
