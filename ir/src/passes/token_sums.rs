//! Token reductions that sum within each token first (docs/architecture.md §5, two-phase
//! token reductions).
//!
//! A parameter shared by every token *and* every stream or slot of a token gets
//! its gradient as one sum over rows that merge the two: DGHC's per-slot norm
//! gain (docs/math.md §5.5, one gain of size d_b for all n slots) gets
//! `sum(reshape(g, [B·T·n, d_b]), axis 0)`. The fusion pass runs a token
//! reduction in two phases: the token-local group
//! writes the summed operand, one row per reduced row, and a reduction
//! kernel adds the rows. Over merged rows that operand is `n` rows per token,
//! state-sized (8 MiB a sublayer at the bench size, for a 64-float gradient).
//!
//! [`sum_within_tokens_first`] rewrites such a sum as a sum over the token's
//! own rows, `[B·T, n, d_b] → [B·T, d_b]`, which is token-local and so fuses
//! into the group that produces the operand, followed by the sum over tokens:
//! the group writes one row per token, and the reduction kernel reads `1/n` of
//! what it read. The sum's order changes (within a token, then across tokens),
//! its value only by rounding.

use super::tokens::TokenAxes;
use crate::graph::{Graph, NodeId, Op, ReduceOp};

/// Rewrites every `sum(reshape(x, [tokens·k, rest…]), axis 0)` whose `x` has
/// its token axes first and merges them with `k > 1` within-token rows, as
/// `sum(sum(reshape(x, [tokens, k, rest…]), axis 1), axis 0)`. Node ids of the
/// sums are kept (they may be gradients a caller holds); reshapes left without
/// users are removed unless they are in `roots` or outputs. Returns how many
/// sums were rewritten.
pub fn sum_within_tokens_first(graph: &mut Graph, roots: &[NodeId]) -> usize {
    let axes = TokenAxes::of(graph);
    let role = graph.role();
    let mut rewritten = 0;
    for sum in graph.topo_order() {
        if !matches!(graph.node(sum).op, Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }) {
            continue;
        }
        let Some(&merged) = graph.inputs(sum).first() else { continue };
        let Op::Reshape { shape } = &graph.node(merged).op else { continue };
        let Some(&source) = graph.inputs(merged).first() else { continue };
        let Some((tokens, within)) = merged_rows(graph, &axes, source, shape) else { continue };
        let rest = shape[1..].to_vec();
        graph.set_role(graph.node(sum).role);
        let split = [vec![tokens, within], rest].concat();
        let Ok(rows) = graph.add(Op::Reshape { shape: split }, &[source]) else { continue };
        let per_token = graph
            .add(Op::Reduce { op: ReduceOp::Sum, axis: 1, keepdim: false }, &[rows])
            .expect("a sum over an axis of a valid reshape is valid");
        let edge = graph.g.find_edge(merged, sum).expect("the sum reads the reshape");
        graph.g.remove_edge(edge);
        graph.g.add_edge(per_token, sum, 0);
        let kept = roots.contains(&merged) || graph.outputs().iter().any(|&(_, o)| o == merged);
        if graph.users(merged).is_empty() && !kept {
            graph.g.remove_node(merged);
        }
        rewritten += 1;
    }
    graph.set_role(role);
    rewritten
}

/// `(tokens, k)` when the reshape of `source` to `shape` merges all of
/// `source`'s token axes, which lead its shape, with `k > 1` rows of
/// within-token axes into axis 0 and keeps the other axes as they are.
fn merged_rows(graph: &Graph, axes: &TokenAxes, source: NodeId, shape: &[usize]) -> Option<(usize, usize)> {
    let dims = graph.node(source).shape.dims();
    let flags = axes.flags(source);
    if shape.is_empty() || flags.len() != dims.len() {
        return None;
    }
    let lead = flags.iter().take_while(|&&f| f).count();
    if lead == 0 || flags[lead..].iter().any(|&f| f) {
        return None;
    }
    let tokens: usize = dims[..lead].iter().product();
    // The merged prefix: leading axes whose product is shape[0].
    let mut rows = 1;
    let mut merged = 0;
    while merged < dims.len() && rows < shape[0] {
        rows *= dims[merged];
        merged += 1;
    }
    let exact = rows == shape[0] && shape[1..] == dims[merged..];
    (exact && merged > lead && tokens > 1 && rows / tokens > 1).then(|| (tokens, rows / tokens))
}
