//! Products over rows that repeat one narrower row, computed at the narrower
//! width (docs/architecture.md §5; the first sublayer's connection, docs/math.md §4.3, §6.2).
//!
//! The first hyper-connection state is the embedding broadcast to its `n`
//! streams (`x̄ = [e, e, …, e]`, docs/math.md §4.1). Its coefficient projection
//! `x̄·W` (mHC's `φ`, xHC's router and maps) and, in the backward pass, that
//! projection's weight gradient `x̄ᵀ·g` are GEMMs, which need their operand in
//! memory: the broadcast, a view, was copied into an `n·C`-wide buffer
//! first (at the bench size 8 MiB for mHC, 32 MiB for xHC, twice a step),
//! and the GEMM then did `n` times the arithmetic the product needs.
//!
//! With `W` split into its `n` row blocks `W_s` (`[C, m]` each):
//! - `x̄·W = Σ_s e·W_s = e·(Σ_s W_s)`: a product of the embedding with the
//!   folded weight. A norm projection of `x̄` (docs/math.md §4.3) is the same
//!   projection of `e` with the folded weight: the mean and the mean square of
//!   `n` copies of a row are the row's own, and the folded weight's column
//!   sums are `W`'s.
//! - `x̄ᵀ·g` stacks `n` copies of `eᵀ·g`: one product, broadcast.
//! - The embedding's gradient sums the state's gradient over the streams,
//!   and one of its terms is the projection's input gradient `g·Wᵀ`
//!   (`n·C` wide, a GEMM whose output was written and read back): the sum
//!   goes through the adds and subtractions above it, and the term becomes
//!   `g·(Σ_s W_s)ᵀ`, `C` wide.
//!
//! Values change only by rounding (the fold adds the `n` weights before the
//! product instead of the `n` products after it).

use petgraph::visit::EdgeRef;

use crate::graph::{BinaryOp, Graph, GraphError, NodeId, Op, OpFamily, ReduceOp};

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

/// What [`narrow_broadcast_products`] rewrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NarrowedProducts {
    /// Products over rows repeated `n` times, and their weight gradients.
    pub products: usize,
    /// Sums over `n` copies taken through to a product's folded weight.
    pub sums: usize,
}

/// Rewrites, keeping node ids (a gradient may be among them):
/// - every `MatMul(x, w)` and `NormProject(x, w)` with `w` a `[n·C, m]`
///   matrix and `x` rows repeated `n` times as the product of the rows with
///   `Σ_s w_s`;
/// - every `MatMul{trans_a}(x, g)` of rank 2 with such an `x` as the broadcast
///   of the product of the rows with `g`;
/// - every sum over an axis (`n` copies of a `C`-wide row) whose operand is,
///   through reshapes and single-use adds and subtractions, partly a product
///   `g·wᵀ` with `w` `[n·C, m]`, as the sums of the terms, that product as
///   `g·(Σ_s w_s)ᵀ`.
///
/// Returns what was rewritten.
pub fn narrow_broadcast_products(graph: &mut Graph) -> NarrowedProducts {
    let role = graph.role();
    let mut rewritten = NarrowedProducts::default();
    for id in graph.topo_order() {
        let op = graph.node(id).op.clone();
        graph.set_role(graph.node(id).role);
        match op {
            Op::MatMul { trans_a: false, trans_b: false } | Op::NormProject { .. } => {
                rewritten.products += usize::from(fold_weight(graph, id).unwrap_or(false));
            }
            Op::MatMul { trans_a: true, trans_b: false } => {
                rewritten.products += usize::from(broadcast_weight_gradient(graph, id).unwrap_or(false));
            }
            Op::Reduce { op: ReduceOp::Sum, axis, .. } => {
                rewritten.sums += usize::from(sum_copies(graph, id, axis).unwrap_or(false));
            }
            // The rewrite narrows products and sums of copies only (see the module docs); no family has more.
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
                | OpFamily::PlanStep => {}
            },
        }
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
    let [k, _] = w_dims[..] else { return Ok(false) };
    if k != rep.n * rep.width {
        return Ok(false);
    }
    let mut row_dims = graph.node(x).shape.dims().to_vec();
    *row_dims.last_mut().expect("x has an axis") = rep.width;
    let rows = graph.add(Op::Reshape { shape: row_dims }, &[rep.source])?;
    let folded = folded_weight(graph, w, rep.n, rep.width)?;
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

/// A value's elements seen as `[rows, n, width]`: the `n` copies a sum adds.
#[derive(Debug, Clone, Copy)]
struct Copies {
    rows: usize,
    n: usize,
    width: usize,
}

/// The sum `id` over `axis` of its operand as the sums of the operand's terms
/// (see [`narrow_broadcast_products`]); false when no term is a product to
/// fold.
fn sum_copies(graph: &mut Graph, id: NodeId, axis: usize) -> Result<bool, GraphError> {
    let [x] = graph.inputs(id)[..] else { return Ok(false) };
    let dims = graph.node(x).shape.dims().to_vec();
    let copies = Copies {
        rows: dims[..axis].iter().product(),
        n: dims[axis],
        width: dims[axis + 1..].iter().product(),
    };
    if copies.n < 2 || !has_foldable_product(graph, x, copies) {
        return Ok(false);
    }
    let summed = sum_of_terms(graph, x, copies)?;
    graph.node_mut(id).op = Op::Reshape { shape: graph.node(id).shape.dims().to_vec() };
    replace_inputs(graph, id, &[summed]);
    Ok(true)
}

/// How the sum goes through one operand of an add or a subtraction.
#[derive(Debug, Clone, Copy)]
enum Term {
    /// Of the operation's own shape: summed in turn.
    Full(NodeId),
    /// One value per row, `[.., 1]`, broadcast over the row's copies (the
    /// row statistics' terms of a norm's gradient): the sum is `n` times it.
    PerRow(NodeId),
}

/// The operands of `y` the sum may go through: a reshape's source, or both
/// sides of an add or a subtraction (see [`Term`]); only when `y` has one
/// reader (the sum), so that nothing still needs `y` itself.
fn summable_terms(graph: &Graph, y: NodeId, copies: Copies) -> Option<(Option<BinaryOp>, Vec<Term>)> {
    if graph.users(y).len() != 1 {
        return None;
    }
    let inputs = graph.inputs(y);
    let dims = graph.node(y).shape.dims();
    let term = |i: NodeId| {
        let d = graph.node(i).shape.dims();
        if d == dims {
            return Some(Term::Full(i));
        }
        // `[.., 1]` under `y`'s `[.., n·width]` rows.
        let per_row = d.len() == dims.len()
            && d.last() == Some(&1)
            && dims.last() == Some(&(copies.n * copies.width))
            && d[..d.len() - 1] == dims[..dims.len() - 1];
        per_row.then_some(Term::PerRow(i))
    };
    match &graph.node(y).op {
        Op::Reshape { .. } => Some((None, vec![Term::Full(inputs[0])])),
        Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub)) => {
            let terms = inputs.iter().map(|&i| term(i)).collect::<Option<Vec<_>>>()?;
            terms.iter().any(|t| matches!(t, Term::Full(_))).then_some((Some(*op), terms))
        }
        // Only a reshape and the sums of an add or a subtraction pass the copies on: any other op mixes them with what it computes.
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
            | OpFamily::PlanStep => None,
        },
    }
}

/// `g·wᵀ` with `w` `[n·width, m]` and `g` `[rows, m]`, read only by the sum:
/// `(g, w)`.
fn foldable_product(graph: &Graph, y: NodeId, copies: Copies) -> Option<(NodeId, NodeId)> {
    let Op::MatMul { trans_a: false, trans_b: true } = graph.node(y).op else { return None };
    let [g, w] = graph.inputs(y)[..] else { return None };
    let (g_dims, w_dims) = (graph.node(g).shape.dims(), graph.node(w).shape.dims());
    let fits = g_dims.len() == 2
        && g_dims[0] == copies.rows
        && w_dims.len() == 2
        && w_dims[0] == copies.n * copies.width
        && w_dims[1] == g_dims[1];
    (fits && graph.users(y).len() == 1).then_some((g, w))
}

fn has_foldable_product(graph: &Graph, y: NodeId, copies: Copies) -> bool {
    foldable_product(graph, y, copies).is_some()
        || summable_terms(graph, y, copies).is_some_and(|(_, terms)| {
            terms.iter().any(|&t| matches!(t, Term::Full(t) if has_foldable_product(graph, t, copies)))
        })
}

/// `y` (laid out as `copies`) summed over its copies: `[rows, width]`.
fn sum_of_terms(graph: &mut Graph, y: NodeId, copies: Copies) -> Result<NodeId, GraphError> {
    if let Some((g, w)) = foldable_product(graph, y, copies) {
        let folded = folded_weight(graph, w, copies.n, copies.width)?;
        return graph.add(Op::MatMul { trans_a: false, trans_b: true }, &[g, folded]);
    }
    if let Some((op, terms)) = summable_terms(graph, y, copies) {
        let mut sums = Vec::with_capacity(terms.len());
        for term in terms {
            sums.push(match term {
                Term::Full(t) => sum_of_terms(graph, t, copies)?,
                Term::PerRow(t) => {
                    let column = graph.add(Op::Reshape { shape: vec![copies.rows, 1] }, &[t])?;
                    graph.add(Op::Affine { mul: copies.n as f64, add: 0.0 }, &[column])?
                }
            });
        }
        return match op {
            None => Ok(sums[0]),
            Some(op) => graph.add(Op::Binary(op), &sums),
        };
    }
    let view = graph.add(Op::Reshape { shape: vec![copies.rows, copies.n, copies.width] }, &[y])?;
    graph.add(Op::Reduce { op: ReduceOp::Sum, axis: 1, keepdim: false }, &[view])
}

/// `Σ_s w_s` of a `[n·width, m]` weight split into its `n` row blocks.
fn folded_weight(graph: &mut Graph, w: NodeId, n: usize, width: usize) -> Result<NodeId, GraphError> {
    let m = graph.node(w).shape.dims()[1];
    let blocks = graph.add(Op::Reshape { shape: vec![n, width, m] }, &[w])?;
    graph.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[blocks])
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
