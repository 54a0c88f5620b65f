//! Products over rows that repeat one narrower row, computed at the narrower
//! width (DESIGN.md §5; the first sublayer's connection, MATH.md §4.3, §6.2).
//!
//! The first hyper-connection state is the embedding broadcast to its `n`
//! streams (`x̄ = [e, e, …, e]`, MATH.md §4.1). Its coefficient projection
//! `x̄·W` (mHC's `φ`, xHC's router and maps) and, in the backward pass, that
//! projection's weight gradient `x̄ᵀ·g` are GEMMs, which need their operand in
//! memory: the broadcast, a view, was copied into an `n·C`-wide buffer
//! first (at the bench size 8 MiB for mHC, 32 MiB for xHC, twice a step),
//! and the GEMM then did `n` times the arithmetic the product needs.
//!
//! With `W` split into its `n` row blocks `W_s` (`[C, m]` each):
//! - `x̄·W = Σ_s e·W_s = e·(Σ_s W_s)`: a product of the embedding with the
//!   folded weight. A norm projection of `x̄` (MATH.md §4.3) is the same
//!   projection of `e` with the folded weight: the mean and the mean square of
//!   `n` copies of a row are the row's own, and the folded weight's column
//!   sums are `W`'s.
//! - `x̄ᵀ·g` stacks `n` copies of `eᵀ·g`: one product, broadcast.
//!
//! Values change only by rounding (the fold adds the `n` weights before the
//! product instead of the `n` products after it).

use petgraph::visit::EdgeRef;

use crate::graph::{Graph, GraphError, NodeId, Op, ReduceOp};

/// A value that is another's rows repeated: `x` (through reshapes) is a
/// broadcast of `source` along one axis to `n` copies, and `x`'s last axis
/// holds the `n` copies of a row of `width` elements side by side.
struct RepeatedRows {
    source: NodeId,
    n: usize,
    width: usize,
}

/// [`RepeatedRows`] of `x`, when it is one.
fn repeated_rows(graph: &Graph, x: NodeId) -> Option<RepeatedRows> {
    let mut v = x;
    while matches!(graph.node(v).op, Op::Reshape { .. }) {
        v = graph.inputs(v)[0];
    }
    let Op::Broadcast { shape: out } = &graph.node(v).op else { return None };
    let source = graph.inputs(v)[0];
    let from = graph.node(source).shape.dims();
    if from.len() != out.len() {
        return None;
    }
    let mut spread = (0..out.len()).filter(|&a| from[a] != out[a]);
    let (Some(axis), None) = (spread.next(), spread.next()) else { return None };
    let (n, width) = (out[axis], out[axis + 1..].iter().product::<usize>());
    let rows: usize = out[..axis].iter().product();
    let dims = graph.node(x).shape.dims();
    let (&last, lead) = dims.split_last()?;
    (last == n * width && lead.iter().product::<usize>() == rows && n > 1).then_some(RepeatedRows {
        source,
        n,
        width,
    })
}

/// Rewrites, keeping node ids (a gradient may be among them):
/// - every `MatMul(x, w)` and `NormProject(x, w)` with `w` a `[n·C, m]`
///   matrix and `x` rows repeated `n` times as the product of the rows with
///   `Σ_s w_s`;
/// - every `MatMul{trans_a}(x, g)` of rank 2 with such an `x` as the broadcast
///   of the product of the rows with `g`.
///
/// Returns how many products were rewritten.
pub fn narrow_broadcast_products(graph: &mut Graph) -> usize {
    let role = graph.role();
    let mut rewritten = 0;
    for id in graph.topo_order() {
        let op = graph.node(id).op.clone();
        graph.set_role(graph.node(id).role);
        let done = match op {
            Op::MatMul { trans_a: false, trans_b: false } | Op::NormProject { .. } => {
                fold_weight(graph, id).unwrap_or(false)
            }
            Op::MatMul { trans_a: true, trans_b: false } => {
                broadcast_weight_gradient(graph, id).unwrap_or(false)
            }
            _ => false,
        };
        rewritten += usize::from(done);
    }
    graph.set_role(role);
    rewritten
}

/// `x·w` (or the norm projection) as `rows·Σ_s w_s`; false when the pattern
/// does not apply.
fn fold_weight(graph: &mut Graph, id: NodeId) -> Result<bool, GraphError> {
    let [x, w] = graph.inputs(id)[..] else { return Ok(false) };
    let Some(rep) = repeated_rows(graph, x) else { return Ok(false) };
    let w_dims = graph.node(w).shape.dims().to_vec();
    let [k, m] = w_dims[..] else { return Ok(false) };
    if k != rep.n * rep.width {
        return Ok(false);
    }
    let mut row_dims = graph.node(x).shape.dims().to_vec();
    *row_dims.last_mut().expect("x has an axis") = rep.width;
    let rows = graph.add(Op::Reshape { shape: row_dims }, &[rep.source])?;
    let blocks = graph.add(Op::Reshape { shape: vec![rep.n, rep.width, m] }, &[w])?;
    let folded = graph.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[blocks])?;
    replace_inputs(graph, id, &[rows, folded]);
    Ok(true)
}

/// `xᵀ·g` as the broadcast of `rowsᵀ·g` to the `n` row blocks; false when the
/// pattern does not apply.
fn broadcast_weight_gradient(graph: &mut Graph, id: NodeId) -> Result<bool, GraphError> {
    let [x, g] = graph.inputs(id)[..] else { return Ok(false) };
    let Some(rep) = repeated_rows(graph, x) else { return Ok(false) };
    let (x_dims, g_dims) = (graph.node(x).shape.dims().to_vec(), graph.node(g).shape.dims().to_vec());
    let (&[t, _], &[_, m]) = (&x_dims[..], &g_dims[..]) else { return Ok(false) };
    let rows = graph.add(Op::Reshape { shape: vec![t, rep.width] }, &[rep.source])?;
    let product = graph.add(Op::MatMul { trans_a: true, trans_b: false }, &[rows, g])?;
    let one_block = graph.add(Op::Reshape { shape: vec![1, rep.width, m] }, &[product])?;
    let blocks = graph.add(Op::Broadcast { shape: vec![rep.n, rep.width, m] }, &[one_block])?;
    graph.node_mut(id).op = Op::Reshape { shape: vec![rep.n * rep.width, m] };
    replace_inputs(graph, id, &[blocks]);
    Ok(true)
}

/// Makes `inputs` the operands of `id`, in port order.
fn replace_inputs(graph: &mut Graph, id: NodeId, inputs: &[NodeId]) {
    let old: Vec<_> = graph.g.edges_directed(id, petgraph::Direction::Incoming).map(|e| e.id()).collect();
    for e in old {
        graph.g.remove_edge(e);
    }
    for (port, &input) in inputs.iter().enumerate() {
        graph.g.add_edge(input, id, port);
    }
}
