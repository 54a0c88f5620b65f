//! Gradient siblings: the nodes of one op that share one lowering, which
//! computes what they share once. The gradients of one attention (or temporal
//! augmentation, or fused vocabulary loss) w.r.t. each of its operands, and the outputs of one MoE
//! routing (docs/math.md §1.6), are each one node per slot in the graph.

use std::collections::{HashMap, HashSet};

use ir::graph::{Graph, NodeId, Op, OpFamily};

use super::Target;
use crate::emit;

/// The ops whose sibling nodes (one per `wrt` of a gradient, or per output of the
/// routing) are lowered together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum SiblingOp {
    Attention,
    /// The gradients of one fused vocabulary loss w.r.t. x and w share each chunk's
    /// recomputed logits (docs/math.md §1.7).
    VocabLoss,
    Temporal,
    /// `MoeRoute`'s Rows, Tokens and Counts over one input: one routing step writes
    /// all three (docs/math.md §1.6), so a layer routes once.
    Route,
}

/// What identifies the op a sibling node belongs to (the attention or temporal
/// augmentation a gradient differentiates, or a routing): its kind, its inputs and
/// its attributes besides the slot.
pub(super) type GradKey = (SiblingOp, Vec<NodeId>, String);

/// The key and the slot of a node whose siblings (the other `wrt` of the same
/// op's gradient, the other outputs of the same routing) share one lowering, and
/// the number of slots.
fn grad_key(graph: &Graph, id: NodeId) -> Option<(GradKey, usize, usize)> {
    let inputs = graph.inputs(id);
    let (kind, attrs, wrt, slots) = match graph.node(id).op {
        Op::CausalAttentionGrad { scale, rope_base, wrt } => {
            (SiblingOp::Attention, format!("{scale:?} {rope_base:?}"), wrt, 3)
        }
        Op::LinearCrossEntropyGrad { trans_b, scale, chunk, wrt } => {
            (SiblingOp::VocabLoss, format!("{trans_b} {scale:?} {chunk}"), wrt, 2)
        }
        Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt } => {
            (SiblingOp::Temporal, format!("{gram_schmidt} {eps_rel:?}"), wrt, inputs.len() - 1)
        }
        Op::MoeRoute { experts, capacity, out } => {
            (SiblingOp::Route, format!("{experts} {capacity:?}"), emit::route_slot(out), 3)
        }
        // Every other op is lowered node by node.
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
            | OpFamily::PlanStep => return None,
        },
    };
    (wrt < slots).then_some(((kind, inputs, attrs), wrt, slots))
}

/// The sibling gradient nodes among `nodes`, by the op they differentiate.
pub(super) fn grad_siblings(graph: &Graph, nodes: &HashSet<NodeId>) -> HashMap<GradKey, Vec<Option<NodeId>>> {
    let mut out: HashMap<GradKey, Vec<Option<NodeId>>> = HashMap::new();
    for &id in nodes {
        if let Some((key, wrt, slots)) = grad_key(graph, id) {
            out.entry(key).or_insert_with(|| vec![None; slots])[wrt] = Some(id);
        }
    }
    out
}

/// The gradient nodes lowered together (by `wrt`) and their lowering.
type SiblingLowering = (Vec<Option<NodeId>>, emit::Lowering);

/// Lowers gradient node `id` together with its siblings; `None` for other nodes.
pub(super) fn lower_siblings(
    graph: &Graph,
    id: NodeId,
    siblings: &HashMap<GradKey, Vec<Option<NodeId>>>,
    name: &str,
    target: Target,
) -> Option<Result<SiblingLowering, emit::EmitError>> {
    let (key, _, _) = grad_key(graph, id)?;
    let outs = siblings.get(&key)?.clone();
    // `grad_key` decided which ops have siblings; only their lowering is chosen here.
    let lowering = match key.0 {
        SiblingOp::Attention => emit::attention_grads(graph, [outs[0], outs[1], outs[2]], name, target),
        SiblingOp::VocabLoss => emit::linear_cross_entropy_grads(graph, [outs[0], outs[1]], name, target),
        SiblingOp::Temporal => emit::temporal_grads(graph, &outs, name, target),
        SiblingOp::Route => emit::moe_route(graph, &outs, name, target),
    };
    Some(lowering.map(|l| (outs, l)))
}
