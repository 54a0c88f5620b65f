//! Token-axis analysis: which axes of every value index tokens.
//!
//! Fusion (docs/architecture.md §5) rests on one property: an op is *token-local* when the part
//! of its output that belongs to one token depends only on that token's inputs. To
//! decide it, every axis of every value is marked as a token axis or not, by forward
//! propagation from the data input: the lowering's `Input` nodes are `[B, T + 1]`
//! windows whose two axes are token axes (batch and position); parameters and
//! constants carry none. Each op then maps the flags of its inputs to its output
//! (elementwise ops align them from the right like NumPy broadcasting, a `Reshape`
//! marks every output axis that covers part of a token axis, a `MatMul` keeps batch
//! flags and the row/column flags of its operands, and so on).
//!
//! The flags are what the partitioner uses to tell a per-token contraction over the
//! stream axis (`[B, T, 1, s] @ [B, T, s, d]`, docs/math.md §0.3) from a projection whose rows
//! are tokens (`[B, T, D] @ [D, F]`), and a reduction over streams from a reduction over
//! tokens (a parameter gradient).

use crate::graph::{Graph, MoeRouteOut, NodeId, Op};
use std::collections::HashMap;

/// Token-axis flags of every node of a graph.
#[derive(Debug, Clone)]
pub struct TokenAxes {
    flags: HashMap<NodeId, Vec<bool>>,
}

impl TokenAxes {
    /// Analyses every node of `graph` (in its topological order).
    pub fn of(graph: &Graph) -> TokenAxes {
        let mut flags: HashMap<NodeId, Vec<bool>> = HashMap::new();
        for id in graph.topo_order() {
            let inputs: Vec<&[bool]> = graph.inputs(id).iter().map(|i| flags[i].as_slice()).collect();
            let f = propagate(graph, id, &inputs);
            flags.insert(id, f);
        }
        TokenAxes { flags }
    }

    /// The flags of `id`, one per axis of its shape (empty for a node not analysed).
    pub fn flags(&self, id: NodeId) -> &[bool] {
        self.flags.get(&id).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether axis `axis` of `id` is a token axis of size > 1.
    pub fn is_token_axis(&self, graph: &Graph, id: NodeId, axis: usize) -> bool {
        let dims = graph.node(id).shape.dims();
        self.flags(id).get(axis).copied().unwrap_or(false) && dims.get(axis).is_some_and(|&d| d > 1)
    }

    /// The number of tokens a value holds: the product of its token axes (1 when it has
    /// none). Token-local fusion groups run over this many tokens.
    pub fn extent(&self, graph: &Graph, id: NodeId) -> usize {
        let dims = graph.node(id).shape.dims();
        self.flags(id).iter().zip(dims).filter(|(&f, _)| f).map(|(_, &d)| d).product()
    }

    /// Whether `id` holds more than one token (a token-shaped activation).
    pub fn is_token_shaped(&self, graph: &Graph, id: NodeId) -> bool {
        self.extent(graph, id) > 1
    }
}

/// Right-aligned OR of the flags of several operands into an output of rank `rank`.
fn aligned_or(rank: usize, inputs: &[&[bool]]) -> Vec<bool> {
    let mut out = vec![false; rank];
    for f in inputs {
        for (i, &flag) in f.iter().enumerate() {
            if i + rank >= f.len() {
                out[i + rank - f.len()] |= flag;
            }
        }
    }
    out
}

/// Output flags of a reshape from `from` (flags `flags`) to `to`: axes are matched
/// in runs of equal element count (size-1 axes skipped); every output axis in a run
/// that contains a token axis is a token axis.
fn reshape_flags(from: &[usize], flags: &[bool], to: &[usize]) -> Vec<bool> {
    let mut out = vec![false; to.len()];
    let na: Vec<usize> = (0..from.len()).filter(|&i| from[i] != 1).collect();
    let nb: Vec<usize> = (0..to.len()).filter(|&i| to[i] != 1).collect();
    let (mut i, mut j) = (0, 0);
    while i < na.len() && j < nb.len() {
        let (si, sj) = (i, j);
        let (mut pa, mut pb) = (from[na[i]], to[nb[j]]);
        i += 1;
        j += 1;
        while pa != pb {
            if pa < pb {
                let Some(&k) = na.get(i) else { break };
                pa *= from[k];
                i += 1;
            } else {
                let Some(&k) = nb.get(j) else { break };
                pb *= to[k];
                j += 1;
            }
        }
        let token = na[si..i].iter().any(|&k| flags.get(k).copied().unwrap_or(false));
        for &k in &nb[sj..j] {
            out[k] = token;
        }
    }
    out
}

fn propagate(graph: &Graph, id: NodeId, inputs: &[&[bool]]) -> Vec<bool> {
    let node = graph.node(id);
    let rank = node.shape.rank();
    let first = || inputs.first().map(|f| f.to_vec()).unwrap_or_else(|| vec![false; rank]);
    let in_dims = |slot: usize| graph.node(graph.inputs(id)[slot]).shape.dims().to_vec();
    match &node.op {
        Op::Input { .. } => (0..rank).map(|axis| axis < 2).collect(),
        Op::Param(_) | Op::Constant { .. } => vec![false; rank],
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Affine { .. }
        | Op::Cast { .. }
        | Op::Softmax
        | Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Sinkhorn { .. }
        | Op::SinkhornGrad { .. }
        | Op::CausalAttention { .. }
        | Op::Broadcast { .. }
        | Op::Concat { .. } => aligned_or(rank, inputs),
        Op::Reduce { axis, keepdim, .. } => {
            let mut f = first();
            if *keepdim {
                f[*axis] = false;
            } else {
                f.remove(*axis);
            }
            f
        }
        Op::MatMul { trans_a, trans_b } => {
            let (a, b) = (inputs[0], inputs[1]);
            let (ra, rb) = (a.len(), b.len());
            let mut f = aligned_or(rank - 2, &[&a[..ra - 2], &b[..rb - 2]]);
            f.push(if *trans_a { a[ra - 1] } else { a[ra - 2] });
            f.push(if *trans_b { b[rb - 2] } else { b[rb - 1] });
            f
        }
        Op::Reshape { shape } => reshape_flags(&in_dims(0), inputs[0], shape),
        Op::Permute { perm } => perm.iter().map(|&p| inputs[0][p]).collect(),
        Op::Slice { .. } => first(),
        Op::Gather { axis } => {
            let mut f = inputs[1].to_vec();
            f.extend_from_slice(&inputs[0][axis + 1..]);
            f
        }
        Op::ScatterAdd { axis } | Op::ScatterRows { axis } => {
            let (base, idx, src) = (inputs[0], inputs[1], inputs[2]);
            let mut f = base.to_vec();
            for (i, flag) in f.iter_mut().enumerate().take(*axis) {
                *flag |= idx[i] | src[i];
            }
            for (k, flag) in f.iter_mut().enumerate().skip(axis + 1) {
                *flag |= src[idx.len() + k - axis - 1];
            }
            f
        }
        Op::TopK { .. } | Op::NormProject { .. } => {
            let mut f = first();
            if let Some(last) = f.last_mut() {
                *last = false;
            }
            f
        }
        Op::SoftmaxCrossEntropy | Op::LinearCrossEntropy { .. } => Vec::new(),
        Op::TemporalAugment { .. } => {
            let out = inputs[0];
            vec![out[0], out[1], false, out[2]]
        }
        Op::CausalAttentionGrad { wrt, .. }
        | Op::TemporalAugmentGrad { wrt, .. }
        | Op::LinearCrossEntropyGrad { wrt, .. } => inputs[*wrt].to_vec(),
        // Rows keep the token axis of the assignments; the expert-sorted rows of `Tokens`
        // are token-slot rows; the per-expert counts sum over every token.
        Op::MoeRoute { out, .. } => match out {
            MoeRouteOut::Rows => first(),
            MoeRouteOut::Tokens => vec![inputs[0].first().copied().unwrap_or(false)],
            MoeRouteOut::Counts => vec![false],
        },
        Op::GroupedMatMul { .. } => vec![inputs[0][0], false],
        Op::GroupedMatMulGrad { .. } => vec![false; rank],
    }
}

#[cfg(test)]
mod tests {
    use super::{aligned_or, reshape_flags};

    #[test]
    fn reshape_marks_every_axis_covering_a_token_axis() {
        // [B, T, n*C] -> [B, T, n, C]: only B and T stay token axes.
        assert_eq!(
            reshape_flags(&[2, 8, 64], &[true, true, false], &[2, 8, 4, 16]),
            [true, true, false, false]
        );
        // [B, T, D] -> [B*T, D]: the merged axis is a token axis.
        assert_eq!(reshape_flags(&[2, 8, 16], &[true, true, false], &[16, 16]), [true, false]);
        // [B*T, D] -> [1, B*T, D]: size-1 axes carry nothing.
        assert_eq!(reshape_flags(&[16, 16], &[true, false], &[1, 16, 16]), [false, true, false]);
        // [B, T, D] -> [B, T*D]: tokens mixed with features mark the mixed axis.
        assert_eq!(reshape_flags(&[2, 8, 16], &[true, true, false], &[2, 128]), [true, true]);
    }

    #[test]
    fn broadcasting_aligns_flags_from_the_right() {
        assert_eq!(
            aligned_or(4, &[&[true, true, false, false], &[false, false]]),
            [true, true, false, false]
        );
        assert_eq!(aligned_or(2, &[&[true, true, false]]), [true, false]);
    }
}
