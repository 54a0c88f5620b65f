//! The per-op cost table: FLOPs in two conventions and elements moved, for one node.
//!
//! Everything here is a total over the node's whole tensor (not per token); the
//! report divides by the trunk's B·T. Every op is in the one `match` of
//! [`op_cost`], so a new op cannot be added without deciding its cost.

use crate::graph::{Graph, NodeId, Op, OpFamily, Source, View};

/// The cost of one node over its whole output tensor.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpCost {
    /// FLOPs counting every op ("all ops"): contractions at 2 per multiply-accumulate,
    /// elementwise ops at 1 per output element (transcendentals included), norms at
    /// 3–7 per element, attention at 4·H·d_h per query and key (docs/math.md §1.5).
    pub flops: f64,
    /// FLOPs in the papers' convention (docs/math.md §5.9, §6.9): only contractions
    /// (MatMul, the matmul part of NormProject) at 2 per multiply-accumulate and norms
    /// at 4 per normalized element; everything else is memory-bound and counts 0.
    pub flops_papers: f64,
    /// Elements read from non-parameter inputs.
    pub read: f64,
    /// Elements written.
    pub written: f64,
}

impl OpCost {
    fn scaled(self, factor: f64) -> OpCost {
        OpCost {
            flops: self.flops * factor,
            flops_papers: self.flops_papers * factor,
            read: self.read * factor,
            written: self.written * factor,
        }
    }
}

/// Which count [`stored_elements`] gives: the two differ only in what they say of a
/// parameter and of a broadcast over inner axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// What the operand's memory holds once views are undone: a parameter its own
    /// elements, a broadcast its source's. The fusion analysis sizes a shared operand
    /// with it (is it small enough to unroll into every item, `passes::fuse`).
    Memory,
    /// What the papers' traffic model counts a reader loading (docs/math.md §2.6, §4.7,
    /// §6.9): activations only, so a parameter holds nothing; a broadcast over inner
    /// axes only (the replicated embedding that creates the streams, docs/math.md §0.3)
    /// every element, since that model reads a materialized state in every sublayer,
    /// the first one included; a broadcast over the token axes (axes 0 and 1 of the
    /// output, `[B, T, ..]`) of a source that lacks them (a static matrix, a scalar)
    /// its source's elements, read once. The cost model counts reads with it.
    PaperTraffic,
}

/// Elements node `id` really holds when another op reads it, counted as `holding`
/// says. A view holds what it views: a reshape or permutation what its source holds,
/// a slice at most its own elements and at most what its source holds, a concat the
/// sum of its parts, a broadcast as [`Holding`] says. Every other op holds its output.
pub fn stored_elements(graph: &Graph, id: NodeId, holding: Holding) -> usize {
    let node = graph.node(id);
    let source = || stored_elements(graph, graph.inputs(id)[0], holding);
    match node.op.family() {
        OpFamily::Source(Source::Param(_)) if holding == Holding::PaperTraffic => 0,
        OpFamily::View(View::Reshape { .. } | View::Permute { .. }) => source(),
        OpFamily::View(View::Broadcast { .. }) => {
            let from = graph.node(graph.inputs(id)[0]).shape.dims();
            let real = source();
            let materialized =
                holding == Holding::PaperTraffic && real != 0 && !expands_token_axes(from, node.shape.dims());
            if materialized {
                real * (node.shape.numel() / numel(from).max(1))
            } else {
                real
            }
        }
        OpFamily::View(View::Slice { .. }) => node.shape.numel().min(source()),
        OpFamily::View(View::Concat { .. }) => {
            graph.inputs(id).into_iter().map(|i| stored_elements(graph, i, holding)).sum()
        }
        OpFamily::Source(_)
        | OpFamily::Elementwise
        | OpFamily::Reduction
        | OpFamily::RowWise
        | OpFamily::MatrixWise
        | OpFamily::Contraction
        | OpFamily::Indexed
        | OpFamily::OwnGrid
        | OpFamily::PlanStep => node.shape.numel(),
    }
}

fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// The rows a grouped product really multiplies (docs/math.md §1.6, cost): every row of
/// its operand when routing is dropless, at most `experts · capacity` when the group sizes
/// come from a capacity-limited `MoeRoute` (the bound: which rows overflow depends on data).
pub fn grouped_rows(graph: &Graph, counts: NodeId, m: usize) -> usize {
    if let Op::MoeRoute { experts, capacity: Some(c), .. } = graph.node(counts).op {
        m.min(experts.saturating_mul(c))
    } else {
        m
    }
}

/// Whether broadcasting `source` to `out` (NumPy rules, right-aligned) expands axis 0
/// or 1 of `out`, the batch and token axes.
fn expands_token_axes(source: &[usize], out: &[usize]) -> bool {
    let offset = out.len() - source.len();
    (0..out.len().min(2)).any(|axis| out[axis] > 1 && (axis < offset || source[axis - offset] == 1))
}

/// The cost of node `id`, already multiplied by its `role.active_fraction` (MoE routed
/// experts are computed densely by the reference but only top_k / E of that work
/// happens in a routed implementation).
///
/// Traffic rules: an op reads each non-parameter input once ([`stored_elements`]) and
/// writes its output once. Sources and views move nothing. A `Gather` reads only the
/// rows it gathers (plus the indices). `ScatterRows` moves nothing: its producer writes
/// straight into the destination rows (docs/math.md §6.6), so the rows are counted at the
/// producer.
pub fn op_cost(graph: &Graph, id: NodeId) -> OpCost {
    let node = graph.node(id);
    let inputs = graph.inputs(id);
    let out = node.shape.numel() as f64;
    let in_numel = |slot: usize| graph.node(inputs[slot]).shape.numel() as f64;
    let in_dims = |slot: usize| graph.node(inputs[slot]).shape.dims().to_vec();
    let reads_all =
        || inputs.iter().map(|&i| stored_elements(graph, i, Holding::PaperTraffic) as f64).sum::<f64>();

    // (flops, flops_papers, read, written)
    let (flops, papers, read, written) = match &node.op {
        Op::Input { .. } | Op::Param(_) | Op::Constant { .. } => (0.0, 0.0, 0.0, 0.0),
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. } => (0.0, 0.0, 0.0, 0.0),
        Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } => (out, 0.0, reads_all(), out),
        // A precision conversion moves data but does no arithmetic (docs/math.md §6.12).
        Op::Cast { .. } => (0.0, 0.0, reads_all(), out),
        // One add (or compare) per input element.
        Op::Reduce { .. } => (in_numel(0), 0.0, reads_all(), out),
        Op::MatMul { trans_a, .. } => {
            let a = in_dims(0);
            let k = if *trans_a { a[a.len() - 2] } else { a[a.len() - 1] } as f64;
            let f = 2.0 * out * k;
            (f, f, reads_all(), out)
        }
        Op::Gather { .. } => {
            let table = if stored_elements(graph, inputs[0], Holding::PaperTraffic) == 0 { 0.0 } else { out };
            (0.0, 0.0, table + stored_elements(graph, inputs[1], Holding::PaperTraffic) as f64, out)
        }
        Op::ScatterAdd { .. } => (in_numel(2), 0.0, reads_all(), out),
        Op::ScatterRows { .. } => (0.0, 0.0, 0.0, 0.0),
        // One comparison per candidate and selected slot.
        Op::TopK { k, fixed } => {
            let n = graph.node(inputs[0]).shape.last() as f64;
            let rows = in_numel(0) / n;
            (rows * (n - *fixed as f64) * (k - fixed) as f64, 0.0, reads_all(), out)
        }
        // max, subtract, exp, sum, divide.
        Op::Softmax => (5.0 * out, 0.0, reads_all(), out),
        // square, accumulate, scale (+ gain).
        Op::RmsNorm { .. } => {
            let f = if inputs.len() > 1 { 4.0 } else { 3.0 };
            (f * out, 4.0 * out, reads_all(), out)
        }
        // mean, subtract, square, accumulate, scale (+ gain and bias).
        Op::LayerNorm { .. } => {
            let f = if inputs.len() > 1 { 7.0 } else { 5.0 };
            (f * out, 4.0 * out, reads_all(), out)
        }
        Op::GroupNorm { .. } => (7.0 * out, 4.0 * out, reads_all(), out),
        // Statistics pass over x (4·K per row, +K for the mean when some columns are
        // centred), the projection (2·K·M per row) and the folded normalization of each
        // output (2 per output) (docs/math.md §4.3).
        Op::NormProject { centered, .. } => {
            let k = graph.node(inputs[0]).shape.last() as f64;
            let m = node.shape.last() as f64;
            let rows = out / m;
            let stats = if *centered > 0 { 5.0 * k } else { 4.0 * k };
            let all = rows * (stats + 2.0 * k * m + 2.0 * m);
            let papers = rows * (4.0 * k + 2.0 * k * m);
            (all, papers, reads_all(), out)
        }
        // max, exp, sum over the vocabulary, plus the target pick: ~4V per row.
        Op::SoftmaxCrossEntropy => (4.0 * in_numel(0), 0.0, reads_all(), out),
        // The projection (2·D·V per row, the papers count it) and the loss over the
        // logits it never stores (~4·V per row); only x, w and the targets move
        // (docs/math.md §1.7).
        Op::LinearCrossEntropy { trans_b, .. } => {
            let (rows, d, v) = vocab_loss_sizes(&in_dims(0), &in_dims(1), *trans_b);
            let projection = 2.0 * rows * d * v;
            (projection + 4.0 * rows * v, projection, reads_all(), out)
        }
        Op::CausalAttention { .. } => (attention_flops(&in_dims(0)), 0.0, reads_all(), out),
        // (1 + 4·iters)·n² per matrix (docs/math.md §4.7).
        Op::Sinkhorn { iters, .. } => ((1 + 4 * iters) as f64 * out, 0.0, reads_all(), out),
        Op::TemporalAugment { gram_schmidt, .. } => {
            let kernels: Vec<Vec<usize>> = (1..inputs.len()).map(in_dims).collect();
            (temporal_augment_flops(&in_dims(0), &kernels, *gram_schmidt), 0.0, reads_all(), out)
        }
        // Backward ops (not in the forward graph the report costs) are estimates:
        // attention recomputes the scores (one QK^T product) and does two more
        // contractions of the same size per gradient.
        Op::CausalAttentionGrad { .. } => (1.5 * attention_flops(&in_dims(0)), 0.0, reads_all(), out),
        // Each chunk's logits again, their gradient (~5·V per row), then its product
        // with w (for dx) or x (for dw); siblings share the recomputation in the Plan.
        Op::LinearCrossEntropyGrad { trans_b, .. } => {
            let (rows, d, v) = vocab_loss_sizes(&in_dims(0), &in_dims(1), *trans_b);
            let projection = 2.0 * rows * d * v;
            (2.0 * projection + 5.0 * rows * v, 2.0 * projection, reads_all(), out)
        }
        // The unrolled reverse sweep costs about twice the forward iteration.
        Op::SinkhornGrad { iters, .. } => (2.0 * (1 + 4 * iters) as f64 * in_numel(0), 0.0, reads_all(), out),
        Op::TemporalAugmentGrad { gram_schmidt, .. } => {
            let kernels: Vec<Vec<usize>> = (1..inputs.len() - 1).map(in_dims).collect();
            (2.0 * temporal_augment_flops(&in_dims(0), &kernels, *gram_schmidt), 0.0, reads_all(), out)
        }
        // Integer bookkeeping: a count and a prefix sum over the assignments, no float work.
        Op::MoeRoute { .. } => (0.0, 0.0, reads_all(), out),
        // 2·K·N per routed row (docs/math.md §1.6): the routed rows, not experts × tokens.
        // Rows past the groups are written (zeros) but not computed.
        Op::GroupedMatMul { .. } => {
            let x = in_dims(0);
            let rows = grouped_rows(graph, inputs[2], x[0]) as f64;
            let f = 2.0 * rows * x[1] as f64 * node.shape.dims()[1] as f64;
            (f, f, reads_all(), out)
        }
        // The same contraction with the rows summed instead of kept.
        Op::GroupedMatMulGrad { .. } => {
            let (x, dy) = (in_dims(0), in_dims(1));
            let rows = grouped_rows(graph, inputs[2], x[0]) as f64;
            let f = 2.0 * rows * x[1] as f64 * dy[1] as f64;
            (f, f, reads_all(), out)
        }
    };
    OpCost { flops, flops_papers: papers, read, written }.scaled(node.role.active_fraction)
}

/// Causal attention on q `[B, T, H, d_h]`: query t attends to t + 1 keys, so the mean is
/// t̄ = (T + 1)/2 and each key costs 4·H·d_h (QK^T and PV at 2 per MAC, docs/math.md §1.5).
/// (rows, D, V) of a fused vocabulary loss over x `[.., D]` and w `[D, V]` (`trans_b`: `[V, D]`).
fn vocab_loss_sizes(x: &[usize], w: &[usize], trans_b: bool) -> (f64, f64, f64) {
    let d = x.last().copied().unwrap_or(1);
    let rows: usize = x.iter().product::<usize>() / d.max(1);
    let v = if trans_b { w[0] } else { w[w.len() - 1] };
    (rows as f64, d as f64, v as f64)
}

fn attention_flops(q: &[usize]) -> f64 {
    let (b, t, h, dh) = (q[0] as f64, q[1] as f64, q[2] as f64, q[3] as f64);
    4.0 * h * dh * b * t * (t + 1.0) / 2.0
}

/// xHC temporal augmentation on out `[B, T, C]` (docs/math.md §6.9): causal depthwise
/// convolutions 2·C·Σκ per token, plus Gram–Schmidt ≈ 4·C per projection over the
/// K_r(K_r − 1)/2 pairs of the K_r = r + 1 components.
fn temporal_augment_flops(out: &[usize], kernels: &[Vec<usize>], gram_schmidt: bool) -> f64 {
    let tokens = (out[0] * out[1]) as f64;
    let c = out[2] as f64;
    let sum_kappa: usize = kernels.iter().map(|w| w[0]).sum();
    let k_r = (kernels.len() + 1) as f64;
    let gs = if gram_schmidt { 4.0 * c * k_r * (k_r - 1.0) / 2.0 } else { 0.0 };
    tokens * (2.0 * c * sum_kappa as f64 + gs)
}
