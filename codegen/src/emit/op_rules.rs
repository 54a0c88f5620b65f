//! What the lowering must know of each op, each rule a match over the op's family
//! ([`ir::graph::OpFamily`]) that names the ops that are exceptions to their family,
//! so a new family fails to compile until every rule states its case
//! (docs/adding-an-op.md lists them): whether the op is lowered on a grid of its own
//! ([`has_own_grid`]), the per-item scratch it needs besides its output
//! ([`op_scratch`]), whether a kernel of `n` items computes its output in whole
//! items and may read its in-kernel operands inside its own item ([`item_ok`],
//! which [`super::itemize`] applies op by op), and which reductions fold by
//! adding ([`folds_by_adding`]).

use ir::graph::{Graph, NodeId, Op, OpFamily, View};

use super::numel;

/// Ops lowered by [`super::lower_own_grid`]: each needs a grid (or Plan steps) of its
/// own. These are the families [`OpFamily::OwnGrid`] and [`OpFamily::PlanStep`].
pub fn has_own_grid(op: &Op) -> bool {
    match op.family() {
        OpFamily::OwnGrid | OpFamily::PlanStep => true,
        OpFamily::Source(_)
        | OpFamily::Elementwise
        | OpFamily::View(_)
        | OpFamily::Reduction
        | OpFamily::RowWise
        | OpFamily::MatrixWise
        | OpFamily::Contraction
        | OpFamily::Indexed => false,
    }
}

/// Per-item scratch an op needs besides its output (elements).
pub(super) fn op_scratch(op: &Op, dims: &[usize]) -> usize {
    let nn = dims.last().copied().unwrap_or(1).pow(2);
    match op {
        // Sinkhorn iterates on a copy of its matrix; its gradient keeps every
        // half-step's scaling for the reverse sweep (docs/math.md §4.5).
        Op::Sinkhorn { .. } => nn,
        Op::SinkhornGrad { iters, .. } => nn * (2 * iters + 2),
        // Every other op computes in registers and its output.
        op => match op.family() {
            OpFamily::Source(_)
            | OpFamily::Elementwise
            | OpFamily::View(_)
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => 0,
        },
    }
}

/// The smallest `k` with `dims[..k]` multiplying to `n`.
fn item_rank(dims: &[usize], n: usize) -> Option<usize> {
    let mut p = 1;
    for k in 0..=dims.len() {
        if p == n {
            return Some(k);
        }
        if k < dims.len() {
            p *= dims[k];
        }
    }
    None
}

/// Whether `node`, computed in a kernel of `n` items, may read its operands
/// that the same kernel produces (`restricted[slot]`) inside its own item, and
/// whether its own output splits into `n` items the way the op computes it.
pub(super) fn item_ok(
    graph: &Graph,
    id: NodeId,
    n: usize,
    restricted: &[bool],
    materialized_view: bool,
) -> bool {
    let node = graph.node(id);
    let o = node.shape.dims();
    let inputs = graph.inputs(id);
    let in_dims: Vec<&[usize]> = inputs.iter().map(|&i| graph.node(i).shape.dims()).collect();
    if !numel(o).is_multiple_of(n) {
        return false;
    }
    let any_restricted = restricted.iter().any(|&r| r);
    let view = node.op.is_view();
    let own_rank = item_rank(o, n);
    if !view || materialized_view {
        let Some(k) = own_rank else { return false };
        let rank = o.len();
        let own = match &node.op {
            // A scatter writes whole rows along `axis`: its items must not split them.
            Op::ScatterAdd { axis } | Op::ScatterRows { axis } => k <= *axis,
            op => match op.family() {
                // A row (a matrix) is computed whole, inside one item.
                OpFamily::RowWise => k < rank || rank == 0,
                OpFamily::MatrixWise => k + 2 <= rank,
                OpFamily::OwnGrid | OpFamily::PlanStep => false,
                OpFamily::Source(_)
                | OpFamily::Elementwise
                | OpFamily::View(_)
                | OpFamily::Reduction
                | OpFamily::Contraction
                | OpFamily::Indexed => true,
            },
        };
        if !own {
            return false;
        }
    }
    if !any_restricted {
        return true;
    }
    let Some(k) = own_rank else {
        // Only a reshape keeps flat indices; other restricted views need item axes.
        return matches!(node.op, Op::Reshape { .. });
    };
    let bcast_ok = |x: &[usize]| {
        let lead = o.len().saturating_sub(x.len());
        (0..k).all(|d| o[d] == 1 || (d >= lead && x[d - lead] == o[d]))
    };
    let per = numel(o) / n;
    let operands_in_item = || inputs.iter().enumerate().all(|(s, _)| !restricted[s] || bcast_ok(in_dims[s]));
    match &node.op {
        // Attribute-dependent members of their families.
        Op::Reduce { axis, .. } => per.is_multiple_of(numel(&in_dims[0][axis + 1..]).max(1)),
        Op::MatMul { trans_a, .. } => {
            let (m, nn) = (o[o.len() - 2], o[o.len() - 1]);
            let batch = numel(&o[..o.len() - 2]);
            let whole = per.is_multiple_of(m * nn);
            let rows = per.is_multiple_of(nn) && (m * nn).is_multiple_of(per);
            (0..2).all(|s| {
                if !restricted[s] {
                    return true;
                }
                let x = in_dims[s];
                let xb = numel(&x[..x.len() - 2]);
                if xb != batch {
                    return false;
                }
                whole || (rows && s == 0 && !trans_a)
            })
        }
        op => match op.family() {
            // The same element of each operand (broadcast): inside the item if the
            // operand's item axes are the output's. A `Cast` too: a cast to bf16 rounds
            // in registers (`item::cast`, docs/math.md §6.12), so its value is the same
            // whether the operand comes from a local array of this kernel or a bf16
            // buffer, and every bf16 value a kernel holds is already a bf16 value (a
            // cast's result, or data moved unchanged).
            OpFamily::Elementwise | OpFamily::View(View::Broadcast { .. }) => operands_in_item(),
            OpFamily::View(View::Reshape { .. }) => true,
            OpFamily::View(View::Permute { perm }) => (0..k).all(|d| o[d] == 1 || perm[d] == d),
            OpFamily::View(View::Slice { axis, .. } | View::Concat { axis }) => axis >= k,
            // The row comes from the kernel; gains and biases must be whole in memory.
            OpFamily::RowWise => !restricted[1..].iter().any(|&r| r),
            OpFamily::Indexed | OpFamily::MatrixWise => true,
            // Reduce and MatMul, the members of these families, are matched above by
            // their attributes.
            OpFamily::Reduction | OpFamily::Contraction => false,
            OpFamily::Source(_) | OpFamily::OwnGrid | OpFamily::PlanStep => false,
        },
    }
}

/// Whether a reduction folds its axis by adding (a mean divides the sum afterwards),
/// so partial sums of column blocks combine by adding too.
pub(super) fn folds_by_adding(op: ir::graph::ReduceOp) -> bool {
    match op {
        ir::graph::ReduceOp::Sum | ir::graph::ReduceOp::Mean => true,
        ir::graph::ReduceOp::Max => false,
    }
}
