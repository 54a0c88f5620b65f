//! The vocabulary loss fused with its output projection (docs/math.md §1.7).
//!
//! A head computes `logits = scale · x·w` (`[B, T, V]`) and then the mean
//! `SoftmaxCrossEntropy` of the logits. Kept as two ops, the logits exist whole
//! and so does their gradient: at GPT-2's vocabulary (V = 50304) and B·T = 8192
//! rows that is 1.6 GB each in f32, the largest buffers of a training step.
//! [`fuse_vocab_losses`] rewrites the pair as one `LinearCrossEntropy`, which
//! compiled devices evaluate `chunk` rows at a time, forward and backward
//! (`LinearCrossEntropyGrad` recomputes a chunk's logits), so at most one chunk
//! of logits exists at any time.
//!
//! The pass runs before autodiff (the fused op has its own gradient rule) and only
//! where nothing else reads the logits: a graph that names them as an output
//! (evaluation, sampling) keeps the unfused form. The reference executor never
//! runs it: the plain form is the oracle of the fused kernels.

use crate::graph::{Graph, NodeId, Op};

/// Logit elements of one chunk the default chunking aims at: 2^24 (64 MiB in
/// f32, 1/25 of GPT-2-small's B = 8, T = 1024 logits).
pub const CHUNK_ELEMENTS: usize = 1 << 24;

/// The most chunks the default chunking makes: each chunk is a GEMM and a
/// row kernel of its own in the Plan, and its own kernel text.
pub const MAX_CHUNKS: usize = 32;

/// Rows per chunk for `rows` rows of `vocab` logits: as few chunks as keep one
/// chunk's logits within [`CHUNK_ELEMENTS`], at most [`MAX_CHUNKS`], equal but
/// for the last.
pub fn default_chunk(rows: usize, vocab: usize) -> usize {
    let chunks = rows.saturating_mul(vocab).div_ceil(CHUNK_ELEMENTS).clamp(1, MAX_CHUNKS);
    rows.div_ceil(chunks).max(1)
}

/// Rewrites every `SoftmaxCrossEntropy(scale · MatMul(x, w), targets)` whose
/// product (and scaling) nothing else reads and no output names as
/// `LinearCrossEntropy(x, w, targets)` with [`default_chunk`] rows per chunk.
/// Returns each rewritten loss with the fused node that replaces it.
pub fn fuse_vocab_losses(graph: &mut Graph) -> Vec<(NodeId, NodeId)> {
    let role = graph.role();
    let mut rewritten = Vec::new();
    for id in graph.topo_order() {
        let Some((x, w, targets, trans_b, scale, dead)) = match_head(graph, id) else { continue };
        let rows = graph.node(targets).shape.numel();
        let vocab = if trans_b { graph.node(w).shape.dims()[0] } else { graph.node(w).shape.dims()[1] };
        let op = Op::LinearCrossEntropy { trans_b, scale, chunk: default_chunk(rows, vocab) };
        graph.set_role(graph.node(id).role);
        // The fused op takes the operands the pair had (shape rules checked on them
        // already); a failure leaves the pair as it was.
        let Ok(fused) = graph.add(op, &[x, w, targets]) else { continue };
        debug_assert_eq!(graph.node(fused).dtype, graph.node(id).dtype);
        graph.replace_uses(id, fused);
        graph.g.remove_node(id);
        for node in dead {
            graph.g.remove_node(node);
        }
        rewritten.push((id, fused));
    }
    graph.set_role(role);
    rewritten
}

/// The operands of a fusable head ending in loss `id`: (x, w, targets, trans_b,
/// scale, the product and scaling nodes the rewrite leaves unread).
#[allow(clippy::type_complexity)]
fn match_head(graph: &Graph, id: NodeId) -> Option<(NodeId, NodeId, NodeId, bool, f64, Vec<NodeId>)> {
    if !matches!(graph.node(id).op, Op::SoftmaxCrossEntropy) {
        return None;
    }
    let inputs = graph.inputs(id);
    let (mut logits, targets) = (inputs[0], inputs[1]);
    let private =
        |node: NodeId| graph.users(node).len() == 1 && !graph.outputs().iter().any(|&(_, o)| o == node);
    let mut dead = Vec::new();
    let mut scale = 1.0;
    if let Op::Affine { mul, add } = graph.node(logits).op {
        if add != 0.0 || !private(logits) {
            return None;
        }
        scale = mul;
        dead.push(logits);
        logits = graph.inputs(logits)[0];
    }
    let Op::MatMul { trans_a: false, trans_b } = graph.node(logits).op else { return None };
    if !private(logits) {
        return None;
    }
    dead.push(logits);
    let mm = graph.inputs(logits);
    let (x, w) = (mm[0], mm[1]);
    if graph.node(w).shape.rank() != 2 || graph.node(x).shape.rank() < 2 {
        return None;
    }
    // f32 only: in bf16 mode (docs/math.md §6.12) the head's operands are bf16 casts,
    // which the chunked products do not read at an offset; that head stays unfused.
    if [x, w, logits].iter().any(|&n| graph.node(n).dtype != crate::DType::F32) {
        return None;
    }
    Some((x, w, targets, trans_b, scale, dead))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_bound_the_logits_and_cover_every_row() {
        // GPT-2-small: 8192 rows of 50304 logits in 25 chunks of 328 rows.
        assert_eq!(default_chunk(8192, 50304), 328);
        let rows = default_chunk(8192, 50304);
        assert!(rows * 50304 <= CHUNK_ELEMENTS && (rows + 8) * 50304 > CHUNK_ELEMENTS);
        // A byte vocabulary is one chunk.
        assert_eq!(default_chunk(2048, 256), 2048);
        // Never more than MAX_CHUNKS chunks, never an empty one.
        let huge = default_chunk(1 << 20, 1 << 20);
        assert_eq!((1usize << 20).div_ceil(huge), MAX_CHUNKS);
        assert_eq!(default_chunk(0, 10), 1);
        for (rows, vocab) in [(7, 3), (1000, 50304), (65536, 1 << 17)] {
            let c = default_chunk(rows, vocab);
            assert!(c >= 1 && rows.div_ceil(c) <= MAX_CHUNKS, "{rows} x {vocab}: {c}");
        }
    }
}
