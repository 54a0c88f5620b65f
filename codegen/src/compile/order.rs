//! Each group ordered around its one node that takes a step of its own (a GEMM,
//! an own-grid kernel, or on the CPU a Sinkhorn projection's lanes form): that
//! node cuts the group's fused kernel in two, and the order decides which of the
//! two cuts, and so how much traffic crosses it (docs/math.md §4.5).

use std::collections::HashSet;

use ir::graph::{Graph, NodeId};

use super::gemm::Gemms;
use super::residency::producers;
use super::Target;
use crate::emit;

/// A group is ordered around its Sinkhorn lanes form where it has one (the
/// other steps of its own there, temporal convolutions, are cheap to
/// place), around its GEMM or own-grid kernel otherwise.
pub(super) fn order_groups(graph: &Graph, groups: &mut [Vec<NodeId>], gemms: &Gemms, target: Target) {
    let lanes = |id: NodeId| target == Target::Cpu && emit::has_lanes_form(graph, id);
    let own_kernel = |id: NodeId| gemms.own_grid.contains(&id);
    for g in groups {
        let pivot: &dyn Fn(NodeId) -> bool = if g.iter().any(|&id| lanes(id)) { &lanes } else { &own_kernel };
        around_own_step(graph, g, &gemms.forced, pivot);
    }
}

/// Orders a group around its one node that takes a step of its own (a GEMM,
/// an own-grid kernel, or on the CPU a Sinkhorn projection's lanes form,
/// [`emit::lower_sinkhorn_lanes`]), which cuts the group's fused kernel in
/// two: either its ancestors run before it and every other node after, or
/// every node that does not depend on it runs before it and its dependants
/// after. Each cut costs the values that cross it (written by the first
/// kernel, read by the second) and the inputs both kernels read; the cheaper
/// one is taken, so the cut does not follow from the order in which the
/// graph happens to list the group's independent nodes. In mHC's forward the
/// ancestors are the few coefficient logits, where the other cut would read
/// the N·C stream state twice; in its backward the stream gradients feed both
/// the Sinkhorn gradient and the other outputs, so everything but the logit
/// gradient's assembly runs first (docs/math.md §4.5). A group with two or more
/// such nodes keeps its order.
fn around_own_step(
    graph: &Graph,
    group: &mut Vec<NodeId>,
    buffered: &HashSet<NodeId>,
    own_step: &dyn Fn(NodeId) -> bool,
) {
    let mut pivots = group.iter().copied().filter(|&id| own_step(id));
    let (Some(pivot), None) = (pivots.next(), pivots.next()) else { return };
    let members: HashSet<NodeId> = group.iter().copied().collect();
    let closure = |start: NodeId, forward: bool| {
        let mut seen: HashSet<NodeId> = HashSet::new();
        let mut stack = vec![start];
        while let Some(id) = stack.pop() {
            let next: Vec<NodeId> =
                if forward { graph.users(id).iter().map(|&(u, _)| u).collect() } else { graph.inputs(id) };
            // Through views listed in other groups too: a member may read
            // another member through one (a view is listed with its first
            // consumer).
            for v in next {
                if (members.contains(&v) || graph.node(v).op.is_view()) && seen.insert(v) {
                    stack.push(v);
                }
            }
        }
        seen.retain(|v| members.contains(v));
        seen
    };
    let ancestors = closure(pivot, false);
    let dependants = closure(pivot, true);
    // The elements of values crossing the cut (twice: a write and a read) and of
    // outside inputs read on both sides.
    let cost = |before: &dyn Fn(NodeId) -> bool| -> usize {
        let reads = |side_before: bool| {
            let mut out = HashSet::new();
            for &id in group.iter().filter(|&&id| id != pivot && before(id) == side_before) {
                if graph.node(id).op.is_view() && !buffered.contains(&id) {
                    continue;
                }
                let mut ps = Vec::new();
                for i in graph.inputs(id) {
                    producers(graph, i, &mut ps);
                }
                out.extend(ps);
            }
            out
        };
        let (first, second) = (reads(true), reads(false));
        let mut pivot_reads = Vec::new();
        for i in graph.inputs(pivot) {
            producers(graph, i, &mut pivot_reads);
        }
        let numel = |id: &NodeId| graph.node(*id).shape.numel();
        let crossing: usize = second
            .iter()
            .chain(&pivot_reads)
            .collect::<HashSet<_>>()
            .into_iter()
            .filter(|p| members.contains(p) && before(**p) && !buffered.contains(p))
            .map(numel)
            .sum();
        let shared: usize = first.intersection(&second).filter(|p| !members.contains(p)).map(numel).sum();
        2 * crossing + shared
    };
    let ancestors_first = |id: NodeId| ancestors.contains(&id);
    let independents_first = |id: NodeId| !dependants.contains(&id) && id != pivot;
    let before: &dyn Fn(NodeId) -> bool = if cost(&ancestors_first) <= cost(&independents_first) {
        &ancestors_first
    } else {
        &independents_first
    };
    let (mut first, rest): (Vec<NodeId>, Vec<NodeId>) = group.iter().partition(|&&id| before(id));
    first.push(pivot);
    first.extend(rest.into_iter().filter(|&id| id != pivot));
    *group = first;
}
