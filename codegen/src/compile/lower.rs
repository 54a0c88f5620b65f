//! The units' steps, in order: a fused unit as one kernel (or a lowering of its
//! own where its lone node has one that fits better), an own-grid node with its
//! gradient siblings, a GEMM with the views it reads copied first; each followed
//! by the copies into the extra buffers of the nodes it computes.

use std::collections::HashSet;

use ir::graph::{Graph, NodeId, Op, OpFamily};

use super::builder::PlanBuilder;
use super::gemm::{through_reshapes, Gemms};
use super::residency::Buffered;
use super::siblings::{grad_siblings, lower_siblings};
use super::units::Unit;
use super::{CompileError, Target};
use crate::emit::{self, EmitError, Launch, Residency};
use crate::plan::{BufferId, Gemm, Step};

/// The steps of the units, in order, each followed by the copies into the
/// extra buffers of the nodes it computes.
pub(super) fn lower_units(
    graph: &Graph,
    b: &mut PlanBuilder,
    units: &[Unit],
    gemms: &Gemms,
    res: &Buffered,
    extra: &[(NodeId, BufferId)],
    copied: &HashSet<BufferId>,
) -> Result<(), CompileError> {
    let target = b.target;
    let mut copied_views: HashSet<NodeId> = HashSet::new();
    // The gradients of one attention (or temporal augmentation) w.r.t. each of
    // its operands share one lowering, which computes what they share once.
    let siblings = grad_siblings(graph, &gemms.own_grid);
    let mut lowered_with_sibling: HashSet<NodeId> = HashSet::new();
    for unit in units {
        match unit {
            Unit::Fused { nodes, n } => {
                if !nodes.iter().any(|&id| res.has_buffer(id)) {
                    continue; // only views read by other units
                }
                let name = b.kernel_name(&unit_label(graph, nodes, res));
                let special = match lone_node(graph, nodes, res) {
                    Some(id) => special_lowering(graph, id, &name, target)?,
                    None => None,
                };
                let launch = match special {
                    Some(launch) => launch,
                    None => emit::lower_fused(graph, nodes, *n, res, &name, target)?,
                };
                b.push_launch(launch, &[]);
            }
            Unit::Standalone(id) => {
                if lowered_with_sibling.contains(id) {
                    continue;
                }
                let name = b.kernel_name(graph.node(*id).op.name());
                let lowering = match lower_siblings(graph, *id, &siblings, &name, target) {
                    Some(lowered) => {
                        let (outs, lowering) = lowered?;
                        lowered_with_sibling.extend(outs.iter().flatten().copied());
                        lowering
                    }
                    None => emit::lower_own_grid(graph, *id, &name, target)?,
                };
                b.push_lowering(lowering);
            }
            Unit::Gemm(id) => {
                let form = &gemms.forms[id];
                let inputs = graph.inputs(form.matmul);
                for &input in &inputs {
                    let v = through_reshapes(graph, input);
                    if gemms.views.contains(&v) && copied_views.insert(v) {
                        let n = emit::itemize(graph, &[v], res, target).unwrap_or(1);
                        let name = b.kernel_name("copy");
                        b.push_launch(emit::lower_fused(graph, &[v], n, res, &name, target)?, &[]);
                    }
                }
                let sh = form.shape;
                let (ga, gb) = b.gemm_operands(
                    b.node_buf[&through_reshapes(graph, inputs[0])],
                    b.node_buf[&through_reshapes(graph, inputs[1])],
                );
                let gemm = Gemm {
                    a: ga,
                    b: gb,
                    c: b.node_buf[id],
                    batch: sh.batch,
                    m: sh.m,
                    n: sh.n,
                    k: sh.k,
                    trans_a: sh.trans_a,
                    trans_b: sh.trans_b,
                    stride_a: sh.stride_a,
                    stride_b: sh.stride_b,
                    stride_c: sh.stride_c,
                    offsets: [0; 3],
                    accumulate: false,
                };
                b.steps.push(Step::Gemm(gemm));
            }
        }
        for &id in unit.nodes() {
            for &(src, dst) in extra {
                if src == id && !copied.contains(&dst) {
                    b.push_copy(graph, id, dst);
                }
            }
        }
    }
    Ok(())
}

/// A lowering of its own for a node alone in a fused unit where one fits better
/// than the thread-per-item kernel: a column reduction, GPU scatter columns, or
/// Sinkhorn lanes on the CPU.
fn special_lowering(
    graph: &Graph,
    id: NodeId,
    name: &str,
    target: Target,
) -> Result<Option<Launch>, EmitError> {
    match graph.node(id).op {
        Op::Reduce { .. } => emit::lower_column_reduce(graph, id, name, target),
        Op::ScatterAdd { .. } => emit::lower_scatter_columns(graph, id, name, target),
        Op::Sinkhorn { .. } | Op::SinkhornGrad { .. } if target == Target::Cpu => {
            emit::lower_sinkhorn_lanes(graph, id, name)
        }
        // Every other op is lowered by the fused-unit kernel.
        ref op => match op.family() {
            OpFamily::Source(_)
            | OpFamily::Elementwise
            | OpFamily::View(_)
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => Ok(None),
        },
    }
}

/// The only node a fused unit computes (the unit's other nodes are views and
/// constants folded into its reads): a `Reduce` may run as a column-blocked
/// reduction ([`emit::lower_column_reduce`]), a `ScatterAdd` split over its
/// columns ([`emit::lower_scatter_columns`]), a Sinkhorn projection
/// in C in blocks of matrices ([`emit::lower_sinkhorn_lanes`]).
fn lone_node(graph: &Graph, nodes: &[NodeId], res: &dyn Residency) -> Option<NodeId> {
    let mut computed = nodes.iter().copied().filter(|&id| {
        let op = &graph.node(id).op;
        res.has_buffer(id) || !(op.is_view() || matches!(op, Op::Constant { .. }))
    });
    let id = computed.next()?;
    computed.next().is_none().then_some(id)
}

/// `rms_norm_mul_add`: the distinct ops a fused kernel computes, in order (at most four).
fn unit_label(graph: &Graph, nodes: &[NodeId], res: &dyn Residency) -> String {
    let mut names: Vec<&str> = Vec::new();
    for &id in nodes {
        let op = &graph.node(id).op;
        if op.is_view() && !res.has_buffer(id) {
            continue;
        }
        let name = if op.is_view() { "copy" } else { op.name() };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.len() > 4 {
        names.truncate(4);
        names.push("etc");
    }
    names.join("_")
}
