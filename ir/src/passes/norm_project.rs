//! Norm projections split into their statistics, their product and their
//! scaling, so that each part fuses where its operands already are
//! (DESIGN.md §5; mHC's fused coefficient generation, MATH.md §4.3).
//!
//! `NormProject{centered: 0}(x, w) = (x·w) · rsqrt(mean(x²) + eps)`: one
//! product with a matrix shared by all tokens and one RMS statistic of the
//! row. As a single op it is a kernel of its own around the GEMM, and that
//! kernel reads the row `x` (mHC's whole `n·C` state) again for the
//! statistic after the GEMM has read it: in mHC's forward pass the state
//! would be read four times per sublayer, against the paper's three (MATH.md
//! §4.7, `(3n+1)C` read per sublayer).
//!
//! [`split_norm_projections`] rewrites the op as `mean(square(x))` (token
//! local: it joins the group that writes `x`, which has the row in hand),
//! `matmul(x, w)` (the GEMM) and `mul(dot, rsqrt(ms + eps))` (token local: it
//! joins the group that reads the coefficients). Values are the same up to
//! rounding. Only RMS projections are split: a LayerNorm projection
//! (`centered > 0`, xHC's router) also corrects each column by the row mean
//! times the column sum of `w`, which the standalone kernel does in one pass.
//!
//! The pass runs after autodiff: the backward pass keeps the op's own gradient
//! rule, and its readers of the op's value read the rewritten value instead.

use crate::graph::{BinaryOp, Graph, NodeId, Op, ReduceOp, UnaryOp};

/// Rewrites every `NormProject{centered: 0}` not in `roots` or the graph's
/// outputs as its statistic, product and scaling (see the module doc); its
/// readers read the scaled product. Returns how many were rewritten.
pub fn split_norm_projections(graph: &mut Graph, roots: &[NodeId]) -> usize {
    let role = graph.role();
    let mut rewritten = 0;
    for id in graph.topo_order() {
        let Op::NormProject { eps, centered: 0 } = graph.node(id).op else { continue };
        let kept = roots.contains(&id) || graph.outputs().iter().any(|&(_, o)| o == id);
        if kept {
            continue;
        }
        let inputs = graph.inputs(id);
        let (x, w) = (inputs[0], inputs[1]);
        let last = graph.node(x).shape.rank() - 1;
        graph.set_role(graph.node(id).role);
        let split = (|| -> Result<NodeId, crate::graph::GraphError> {
            let squares = graph.add(Op::Unary(UnaryOp::Square), &[x])?;
            let mean_square =
                graph.add(Op::Reduce { op: ReduceOp::Mean, axis: last, keepdim: true }, &[squares])?;
            let shifted = graph.add(Op::Affine { mul: 1.0, add: eps }, &[mean_square])?;
            let inverse_rms = graph.add(Op::Unary(UnaryOp::Rsqrt), &[shifted])?;
            let dot = graph.add(Op::MatMul { trans_a: false, trans_b: false }, &[x, w])?;
            graph.add(Op::Binary(BinaryOp::Mul), &[dot, inverse_rms])
        })();
        // The parts are valid wherever the op is (same operands, the op's own
        // shape rules); a failure would leave unread nodes, which the dead-code
        // pass after this one removes.
        let Ok(scaled) = split else { continue };
        debug_assert_eq!(graph.node(scaled).shape, graph.node(id).shape);
        for (user, port) in graph.users(id) {
            let edge = graph.g.find_edge(id, user).expect("a user reads the value");
            graph.g.remove_edge(edge);
            graph.g.add_edge(scaled, user, port);
        }
        graph.g.remove_node(id);
        rewritten += 1;
    }
    graph.set_role(role);
    rewritten
}
