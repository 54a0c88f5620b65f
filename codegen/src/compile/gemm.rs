//! GEMM recognition: which nodes run as one library GEMM (docs/architecture.md
//! §5.1) rather than as emitted loops, with the (batched) shape the [`Gemm`]
//! step takes, and what a GEMM forces into memory (its operands, views it reads
//! as memory) or computes on the way (a weight gradient's sums).

use std::collections::{BTreeMap, HashMap, HashSet};

use ir::graph::{Graph, NodeId, Op};

use crate::emit;
use crate::plan::BufferRole;
#[cfg(doc)]
use crate::plan::Gemm;

/// Multiply-adds per batch entry from which a MatMul grouped with other ops
/// still runs as a library GEMM rather than as emitted loops (below it the
/// per-item dot products of a fused kernel are cheaper than a separate step).
const GEMM_MIN_MACS: usize = 1 << 15;

/// The dimensions of a (batched) GEMM, as [`Gemm`] takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct GemmShape {
    pub(super) batch: usize,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) trans_a: bool,
    pub(super) trans_b: bool,
    pub(super) stride_a: usize,
    pub(super) stride_b: usize,
    pub(super) stride_c: usize,
}

impl GemmShape {
    /// Multiply-adds of one batch entry.
    fn macs(&self) -> usize {
        self.m * self.n * self.k
    }
}

/// How a node runs as one GEMM: the MatMul whose operands it reads, and the
/// nodes the GEMM computes on the way (a weight gradient's MatMul and partial sums).
#[derive(Debug, Clone)]
pub(super) struct GemmForm {
    pub(super) matmul: NodeId,
    pub(super) absorbed: Vec<NodeId>,
    pub(super) shape: GemmShape,
}

/// A MatMul's GEMM form, when one batch stride per operand expresses it.
fn gemm_shape(graph: &Graph, id: NodeId) -> Option<GemmShape> {
    let Op::MatMul { trans_a, trans_b } = graph.node(id).op else { return None };
    let o = graph.node(id).shape.dims();
    let inputs = graph.inputs(id);
    let (ad, bd) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
    let (m, n) = (o[o.len() - 2], o[o.len() - 1]);
    let k = if trans_a { ad[ad.len() - 2] } else { ad[ad.len() - 1] };
    let ob = &o[..o.len() - 2];
    let batch: usize = ob.iter().product();
    let stride = |x: &[usize]| {
        let xb = &x[..x.len() - 2];
        let mat = x[x.len() - 2] * x[x.len() - 1];
        if xb.iter().product::<usize>() == 1 {
            return Some(0);
        }
        let lead = ob.len() - xb.len();
        let same = (0..ob.len()).all(|i| if i < lead { ob[i] == 1 } else { xb[i - lead] == ob[i] });
        same.then_some(mat)
    };
    let (sa, sb) = (stride(ad)?, stride(bd)?);
    let shape = GemmShape { batch, m, n, k, trans_a, trans_b, stride_a: sa, stride_b: sb, stride_c: m * n };
    if batch > 1 && sb == 0 && sa == m * k && !trans_a {
        // Rows of every batch entry are rows of one matrix.
        return Some(GemmShape { batch: 1, m: m * batch, stride_a: 0, stride_b: 0, stride_c: 0, ..shape });
    }
    Some(shape)
}

/// A weight gradient as one GEMM: `id` sums a `MatMul{trans_a}` over all its
/// batch axes (a chain of leading-axis sums), so `Σ_b a_bᵀ·b_b` is `aᵀ·b` with
/// the batch axes folded into the contraction (docs/math.md §1.4). The MatMul and
/// the inner sums must feed nothing else and have no role.
fn summed_gemm(graph: &Graph, id: NodeId, roles: &BTreeMap<NodeId, Vec<BufferRole>>) -> Option<GemmForm> {
    let is_sum0 = |x: NodeId| {
        matches!(graph.node(x).op, Op::Reduce { op: ir::graph::ReduceOp::Sum, axis: 0, keepdim: false })
    };
    if !is_sum0(id) {
        return None;
    }
    let private = |x: NodeId| graph.users(x).len() == 1 && !roles.contains_key(&x);
    let mut absorbed = Vec::new();
    let mut x = graph.inputs(id)[0];
    while is_sum0(x) && private(x) {
        absorbed.push(x);
        x = graph.inputs(x)[0];
    }
    // The sums may reduce a reshape of the MatMul that merges its batch axes
    // (e.g. `[B, T, m, n]` viewed as `[B·T, m·n]`): same flat layout, the
    // summed leading elements are still exactly the batch entries.
    let summed = absorbed.len() + 1;
    let reshaped = matches!(graph.node(x).op, Op::Reshape { .. }) && private(x);
    let view_dims = graph.node(x).shape.dims().to_vec();
    if reshaped {
        absorbed.push(x);
        x = graph.inputs(x)[0];
    }
    if !matches!(graph.node(x).op, Op::MatMul { trans_a: true, trans_b: false }) || !private(x) {
        return None;
    }
    absorbed.push(x);
    let o = graph.node(x).shape.dims();
    let batch_axes = o.len() - 2;
    let batch_ok = if reshaped {
        view_dims.len() > summed
            && view_dims[..summed].iter().product::<usize>() == o[..batch_axes].iter().product::<usize>()
    } else {
        summed == batch_axes
    };
    if !batch_ok {
        return None;
    }
    let inputs = graph.inputs(x);
    let (ad, bd) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
    if ad.len() != o.len()
        || bd.len() != o.len()
        || ad[..batch_axes] != o[..batch_axes]
        || bd[..batch_axes] != o[..batch_axes]
    {
        return None;
    }
    let (m, n) = (o[batch_axes], o[batch_axes + 1]);
    let k = ad[..=batch_axes].iter().product();
    let shape =
        GemmShape { batch: 1, m, n, k, trans_a: true, trans_b: false, stride_a: 0, stride_b: 0, stride_c: 0 };
    Some(GemmForm { matmul: x, absorbed, shape })
}

/// Which nodes run as a library GEMM, and what that forces into memory.
pub(super) struct Gemms {
    pub(super) forms: HashMap<NodeId, GemmForm>,
    /// Views a GEMM reads as memory: copied right before the first GEMM that reads
    /// them, wherever the partition lists them (a partition may list a view in a
    /// group that runs after one of its consumers).
    pub(super) views: HashSet<NodeId>,
    /// Nodes that have a buffer whatever the units: role nodes and GEMM operands.
    pub(super) forced: HashSet<NodeId>,
    /// Nodes computed inside another node's GEMM: never materialized.
    pub(super) absorbed: HashSet<NodeId>,
    /// Nodes on a grid of their own: GEMMs and own-grid ops.
    pub(super) own_grid: HashSet<NodeId>,
}

/// GEMMs: a MatMul alone in its group (besides views) that one stride per
/// operand expresses, a large MatMul anywhere, and a weight gradient (a
/// token-contracting MatMul under the sums over its batch axes) as one GEMM
/// contracting over every token.
pub(super) fn find_gemms(
    graph: &Graph,
    groups: &[Vec<NodeId>],
    roles: &BTreeMap<NodeId, Vec<BufferRole>>,
) -> Gemms {
    let mut gemms: HashMap<NodeId, GemmForm> = HashMap::new();
    let mut gemm_views: HashSet<NodeId> = HashSet::new();
    let mut forced: HashSet<NodeId> = roles.keys().copied().collect();
    for g in groups {
        let compute: Vec<NodeId> = g.iter().copied().filter(|&id| !graph.node(id).op.is_view()).collect();
        let alone = compute.len() == 1;
        for &id in &compute {
            let form = summed_gemm(graph, id, roles).or_else(|| {
                let shape = gemm_shape(graph, id)?;
                (alone || shape.macs() >= GEMM_MIN_MACS).then_some(GemmForm {
                    matmul: id,
                    absorbed: Vec::new(),
                    shape,
                })
            });
            if let Some(form) = form {
                for input in graph.inputs(form.matmul) {
                    let v = through_reshapes(graph, input);
                    forced.insert(v);
                    if graph.node(v).op.is_view() && !roles.contains_key(&v) {
                        gemm_views.insert(v);
                    }
                }
                gemms.insert(id, form);
            }
        }
    }
    let absorbed: HashSet<NodeId> = gemms.values().flat_map(|f| f.absorbed.iter().copied()).collect();
    gemms.retain(|id, _| !absorbed.contains(id));
    let own_grid: HashSet<NodeId> = groups
        .iter()
        .flatten()
        .copied()
        .filter(|&id| gemms.contains_key(&id) || emit::has_own_grid(&graph.node(id).op))
        .collect();

    Gemms { forms: gemms, views: gemm_views, forced, absorbed, own_grid }
}

/// Strips `Reshape`s (which keep the flat layout) off a value.
pub(super) fn through_reshapes(graph: &Graph, mut id: NodeId) -> NodeId {
    while matches!(graph.node(id).op, Op::Reshape { .. }) {
        id = graph.inputs(id)[0];
    }
    id
}
