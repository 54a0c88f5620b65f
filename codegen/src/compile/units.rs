//! Units: each group cut into the pieces that run as one step (a fused
//! thread-per-item kernel, an own-grid op, a library GEMM), so a group whose ops
//! cannot run as one kernel is split rather than miscompiled
//! (docs/architecture.md §5). A fused unit is a greedy maximal run of nodes that
//! share one item split whose scratch fits the target.

use std::collections::{HashMap, HashSet};

use ir::graph::{Graph, NodeId, Op};

use super::builder::optimized;
use super::gemm::Gemms;
use super::residency::{real_users, residency, Buffered};
use super::{CompileError, Target};
use crate::emit::{self, Residency};

/// How a unit of a group runs.
#[derive(Debug, Clone)]
pub(super) enum Unit {
    /// One thread-per-item kernel of `n` items over the nodes.
    Fused { nodes: Vec<NodeId>, n: usize },
    /// A node lowered on its own grid(s).
    Standalone(NodeId),
    /// A MatMul as a library GEMM.
    Gemm(NodeId),
}

impl Unit {
    pub(super) fn nodes(&self) -> &[NodeId] {
        match self {
            Unit::Fused { nodes, .. } => nodes,
            Unit::Standalone(id) | Unit::Gemm(id) => std::slice::from_ref(id),
        }
    }
}

/// Units: greedy maximal runs of each group that share one item split, and the
/// residency of values once the units are known.
pub(super) fn units_and_residency(
    graph: &Graph,
    groups: &[Vec<NodeId>],
    group_of: &HashMap<NodeId, usize>,
    gemms: &Gemms,
    target: Target,
) -> Result<(Vec<Unit>, Buffered), CompileError> {
    let Gemms { forms, views, forced, absorbed, own_grid } = gemms;
    let all: Vec<NodeId> = groups.iter().flatten().copied().collect();
    let all: Vec<NodeId> = all.into_iter().filter(|id| !absorbed.contains(id)).collect();
    let trial_res = residency(graph, &all, group_of, own_grid, forced);
    let mut units: Vec<Unit> = Vec::new();
    for g in groups {
        // Runs of ordinary nodes between the nodes that take a kernel of their own.
        let mut run: Vec<NodeId> = Vec::new();
        for &id in g.iter().filter(|id| !views.contains(id) && !absorbed.contains(id)) {
            let own = if own_grid.contains(&id) {
                Some(if forms.contains_key(&id) { Unit::Gemm(id) } else { Unit::Standalone(id) })
            } else if graph.node(id).op.is_view() && trial_res.has_buffer(id) {
                // A view copied for its role: a copy kernel of its own, parallel over
                // its elements rather than tied to the items of the ops around it.
                let n = emit::itemize(graph, &[id], &trial_res, target).unwrap_or(1);
                Some(Unit::Fused { nodes: vec![id], n })
            } else if target == Target::Cpu && emit::has_lanes_form(graph, id) {
                // A Sinkhorn projection runs on blocks of matrices, vectorized
                // across tokens (`emit::lower_sinkhorn_lanes`); its operands and
                // result are a few values per token.
                Some(Unit::Fused { nodes: vec![id], n: 1 })
            } else if target == Target::Cuda && emit::is_token_reduction(graph, id) {
                // On the GPU a reduction over tokens is a kernel of its own, so it
                // can run block-parallel (`emit::lower_column_reduce`) instead of
                // taking the few items of its consumers (a scalar gain gradient
                // would otherwise be one thread summing every token).
                let n = emit::itemize(graph, &[id], &trial_res, target).unwrap_or(1);
                Some(Unit::Fused { nodes: vec![id], n })
            } else {
                None
            };
            if let Some(unit) = own {
                split_run(graph, &std::mem::take(&mut run), &trial_res, target, &mut units)?;
                units.push(unit);
            } else {
                run.push(id);
            }
        }
        split_run(graph, &run, &trial_res, target, &mut units)?;
    }
    let unit_of: HashMap<NodeId, usize> =
        units.iter().enumerate().flat_map(|(u, unit)| unit.nodes().iter().map(move |&id| (id, u))).collect();
    let res = residency(graph, &all, &unit_of, own_grid, forced);

    Ok((units, res))
}

/// Splits a run of a group's ordinary nodes (in topological order) into fused
/// units, greedily: each unit takes as many of the next nodes as share one
/// item split whose scratch fits [`Target::local_limit`]. [`emit::itemize`]
/// bounds a unit's scratch by the local array every unmaterialized op
/// declares before loop fusion. On the C target, where that bound stops a
/// unit, the longest prefix whose arrays that survive optimization fit is
/// found by bisection ([`measured_items`]): elementwise chains over a token's
/// whole xHC state (the stream gradient's pieces, docs/math.md §6.8) become
/// scalars, so the pieces are summed in one pass rather than each written by
/// a kernel of its own and read back. On the GPU the bound stays: a thread's
/// scratch must fit registers and L1.
fn split_run(
    graph: &Graph,
    run: &[NodeId],
    res: &Buffered,
    target: Target,
    units: &mut Vec<Unit>,
) -> Result<(), CompileError> {
    let mut start = 0;
    while start < run.len() {
        let first = run[start];
        let mut n =
            emit::itemize(graph, &run[start..=start], res, target).ok_or_else(|| CompileError::Lowering {
                node: first.index(),
                op: graph.node(first).op.name(),
                reason: "no item split fits its operands".into(),
            })?;
        let mut end = start + 1;
        while let Some(m) = run.get(end).and_then(|_| emit::itemize(graph, &run[start..=end], res, target)) {
            n = m;
            end += 1;
        }
        if end < run.len() && target == Target::Cpu {
            // Longest fitting prefix; a longer prefix only adds arrays.
            let (mut fits, mut over) = (end, run.len() + 1);
            while over - fits > 1 {
                let mid = (fits + over) / 2;
                match measured_items(graph, &run[start..mid], res, target) {
                    Some(m) => (fits, n) = (mid, m),
                    None => over = mid,
                }
            }
            end = fits;
        }
        units.push(Unit::Fused { nodes: run[start..end].to_vec(), n });
        start = end;
    }
    Ok(())
}

/// Candidate splits of a unit whose scratch [`measured_items`] measures;
/// later ones are smaller items of the same unit, which rarely change what
/// loop fusion keeps.
const MEASURED_SPLITS: usize = 2;

/// The item count of a C kernel computing `nodes` whose optimized body keeps
/// at most [`Target::local_limit`] elements of local arrays, trying the first
/// [`MEASURED_SPLITS`] item splits. Values read outside `nodes` count as
/// materialized, as they will be once `nodes` is a unit.
fn measured_items(graph: &Graph, nodes: &[NodeId], res: &Buffered, target: Target) -> Option<usize> {
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    let mut escaping = HashSet::new();
    for &id in nodes {
        if graph.node(id).op.is_view() || matches!(graph.node(id).op, Op::Constant { .. }) {
            continue; // folded by their readers, as `residency` has it
        }
        let mut users = Vec::new();
        real_users(graph, id, &|u| res.set.contains(&u), &mut users);
        if users.iter().any(|u| !inside.contains(u)) {
            escaping.insert(id);
        }
    }
    let unit_res = UnitResidency { base: res, escaping };
    let limit = target.local_limit();
    emit::item_splits(graph, nodes, &unit_res, target).into_iter().take(MEASURED_SPLITS).map(|s| s.n).find(
        |&n| {
            emit::lower_fused(graph, nodes, n, &unit_res, "measured", target)
                .is_ok_and(|launch| optimized(launch.kernel).local_elements() <= limit)
        },
    )
}

/// A group's residency with the values a trial unit leaves to later units
/// materialized too ([`measured_items`]), without copying the group's set.
struct UnitResidency<'a> {
    base: &'a Buffered,
    escaping: HashSet<NodeId>,
}

impl Residency for UnitResidency<'_> {
    fn has_buffer(&self, id: NodeId) -> bool {
        self.base.has_buffer(id) || self.escaping.contains(&id)
    }
}
