//! Recomputation of cheap values where they are read (docs/architecture.md §5).
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
//! gradient, `(x − μ) · s` over the xHC state (docs/math.md §6.8,
//! [`crate::autodiff`]'s NormProject rule): `x − μ` also feeds the variance,
//! so the group before the weight-gradient product wrote the state-sized term
//! and the group after it, which reads `x` anyway, read it back.
//! docs/architecture.md §5 rule 4 is kept for what it protects, work done twice:
//! reductions and products are not copied, except a per-token product of at
//! most [`SHORT_CONTRACTION`] terms an element ([`short_product`]), which
//! costs what an elementwise chain does. That one is mHC's read `H_pre · x`
//! (n = 4 terms), which docs/math.md §4.5's recompute schedule recomputes in the
//! backward pass as the paper does: the kernel of its gradient reads the
//! state and the coefficients anyway, so the forward need not write `x_pre`.
//!
//! A forward value that only a backward group reads is recomputed there too
//! (the copy becomes a backward node, since fusion keeps the passes apart):
//! SwiGLU's `silu(gate)` (docs/math.md §1.3) was written by the forward for the
//! up projection's gradient `dh ⊙ silu(gate)` alone, and the backward kernel
//! of both gate gradients reads `gate` anyway.

use std::collections::{HashMap, HashSet};

use super::fuse::{fuse, FuseError, FusedGraph, GroupId, GroupKind};
use crate::graph::{Graph, NodeId, Op, OpFamily, Region, Role};

/// Deepest chain copied for one value: the value and the elementwise nodes
/// it is computed from, up to operands the reader has.
const MAX_CHAIN: usize = 4;

/// An operand at most this fraction of the copied value's bytes is cheap for
/// the reader to read in addition (a per-token statistic read by a
/// state-sized term is 1/4096 of it).
const SMALL_OPERAND_DIVISOR: usize = 16;

/// Longest contraction of a product [`short_product`] lets a chain copy.
const SHORT_CONTRACTION: usize = 8;

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

/// Copies, for each token-local group, the cheap chains (elementwise ops and
/// short per-token products) it reads from an earlier token-local group over
/// the same tokens, directly or through views, when every operand of the
/// chain is one the group reads already or is small
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
        // (activation recomputation, e.g. SwiGLU's `silu(gate)`, docs/math.md §1.3).
        let backward = graph.node(group.nodes[0]).role.region == Region::Backward;
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
            // Where the group reads the value: itself, or the end of a chain
            // of views of it that the home group lists (a view is listed with
            // its first consumer); the copy takes the views along.
            let Some(path) = read_path(graph, value, &members) else { continue };
            let read_at = path.last().copied().unwrap_or(value);
            // Only where the home group then no longer writes the value: a
            // value other groups read stays written, and the copy would save
            // one read at the price of the chain's operands.
            let only_here = std::iter::once(value).chain(path.iter().copied()).all(|v| {
                graph.users(v).iter().all(|&(u, _)| {
                    members.contains(&u) || path.contains(&u) || fused.group_of(u) == Some(home)
                })
            });
            // Not read by a product: a per-token product in the group may run
            // as a batched GEMM step of its own, which reads the value from
            // memory, so the group would write the copy back (VWN's
            // `[64 x 64] @ [64 x 8]` stream products in DGHC, docs/math.md §5.5).
            let in_kernel = graph
                .users(read_at)
                .iter()
                .all(|&(u, _)| !members.contains(&u) || !matches!(graph.node(u).op, Op::MatMul { .. }));
            let kept = roots.contains(&value) || graph.outputs().iter().any(|&(_, o)| o == value);
            if !only_here || !in_kernel || kept {
                continue;
            }
            let mut chain = Vec::new();
            if !chain_of(graph, &fused, value, home, &reads, value, 0, &mut chain) {
                continue;
            }
            chain.extend(&path);
            let copies = copy_chain(graph, &chain, backward);
            let copy = copies[&read_at];
            for (user, slot) in graph.users(read_at) {
                if members.contains(&user) {
                    let edge = graph.g.find_edge(read_at, user).expect("a user's edge");
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

/// How `members` read `value`: directly (an empty path), or through one
/// chain of single-operand views none of which is a member (the views, in
/// order). `None` when they read it both ways or through two chains.
fn read_path(graph: &Graph, value: NodeId, members: &HashSet<NodeId>) -> Option<Vec<NodeId>> {
    let mut path = Vec::new();
    let mut at = value;
    loop {
        let users = graph.users(at);
        let direct = users.iter().any(|&(u, _)| members.contains(&u));
        let views: Vec<NodeId> = users
            .iter()
            .map(|&(u, _)| u)
            .filter(|&u| !members.contains(&u) && view_read_by(graph, u, members))
            .collect();
        match (direct, views.as_slice()) {
            (true, []) => return Some(path),
            (false, &[view]) if graph.inputs(view).len() == 1 => {
                path.push(view);
                at = view;
            }
            _ => return None,
        }
    }
}

/// Whether `id` is a view that a node of `members` reads, directly or
/// through further views.
fn view_read_by(graph: &Graph, id: NodeId, members: &HashSet<NodeId>) -> bool {
    graph.node(id).op.is_view()
        && graph.users(id).iter().any(|&(u, _)| members.contains(&u) || view_read_by(graph, u, members))
}

/// The elementwise family ([`OpFamily::Elementwise`]), whose copy costs a few FLOPs
/// per element (a `Cast` none: it only rounds).
fn recomputable(op: &Op) -> bool {
    match op.family() {
        OpFamily::Elementwise => true,
        OpFamily::Source(_)
        | OpFamily::View(_)
        | OpFamily::Reduction
        | OpFamily::RowWise
        | OpFamily::MatrixWise
        | OpFamily::Contraction
        | OpFamily::Indexed
        | OpFamily::OwnGrid
        | OpFamily::PlanStep => false,
    }
}

/// A per-token product over at most [`SHORT_CONTRACTION`] terms: both
/// operands carry the output's batch axes (nothing is shared across tokens),
/// so each output element costs a few multiply-adds, as an elementwise chain
/// does. mHC's read `H_pre · x` (docs/math.md §4.1) contracts the n = 4 streams.
fn short_product(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    let Op::MatMul { trans_a, .. } = node.op else { return false };
    let rank = node.shape.rank();
    let inputs = graph.inputs(id);
    let batch = &node.shape.dims()[..rank.saturating_sub(2)];
    let batched = rank >= 3
        && inputs.iter().all(|&i| {
            let dims = graph.node(i).shape.dims();
            dims.len() == rank && &dims[..rank - 2] == batch
        });
    let a = graph.node(inputs[0]).shape.dims();
    batched && (if trans_a { a[rank - 2] } else { a[rank - 1] }) <= SHORT_CONTRACTION
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
    if depth >= MAX_CHAIN || !(recomputable(&graph.node(id).op) || short_product(graph, id)) {
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
/// copy keeps its original's role, as a backward node when `backward`.
fn copy_chain(graph: &mut Graph, chain: &[NodeId], backward: bool) -> HashMap<NodeId, NodeId> {
    let role = graph.role();
    let mut copies: HashMap<NodeId, NodeId> = HashMap::new();
    for &id in chain {
        let node = graph.node(id).clone();
        let inputs: Vec<NodeId> =
            graph.inputs(id).iter().map(|i| copies.get(i).copied().unwrap_or(*i)).collect();
        let region = if backward { Region::Backward } else { node.role.region };
        graph.set_role(Role { region, ..node.role });
        let copy = graph.add_labeled(node.op, &inputs, node.label).expect("a copy of a valid node is valid");
        copies.insert(id, copy);
    }
    graph.set_role(role);
    copies
}
