//! Norm projections split into their statistics, their product and their
//! scaling, so that each part fuses where its operands already are
//! (docs/architecture.md §5; mHC's fused coefficient generation, docs/math.md §4.3).
//!
//! `NormProject{centered: 0}(x, w) = (x·w) · rsqrt(mean(x²) + eps)`: one
//! product with a matrix shared by all tokens and one RMS statistic of the
//! row. As a single op it is a kernel of its own around the GEMM, and that
//! kernel reads the row `x` (mHC's whole `n·C` state) again for the
//! statistic after the GEMM has read it: in mHC's forward pass the state
//! would be read four times per sublayer, against the paper's three (docs/math.md
//! §4.7, `(3n+1)C` read per sublayer).
//!
//! [`split_norm_projections`] rewrites the op as `mean(square(x))` (token
//! local: it joins the group that writes `x`, which has the row in hand),
//! `matmul(x, w)` (the GEMM) and `mul(dot, rsqrt(ms + eps))` (token local: it
//! joins the group that reads the coefficients). Values are the same up to
//! rounding.
//!
//! A LayerNorm projection (`centered = c > 0`, xHC's router and pre-map over
//! the whole `N·C` state, docs/math.md §6.2–§6.3) splits the same way, with the
//! centred statistics computed as a LayerNorm computes them: `μ = mean(x)`,
//! `ρ_c = rsqrt(mean((x − μ)²) + eps)` (two passes over the row, token
//! local), the column sums `Σ_i w_ij` (a reduction of the weight), and the
//! first `c` columns `ρ_c · (dot − μ · Σw)`, the rest `ρ_r · dot`,
//! concatenated. In xHC the statistics and the scaling join the routing
//! kernel after the GEMM, which gathers the active streams from the same
//! state; kept whole, the projection's own kernel read the 16-stream state
//! once more for them (33.5 MB a sublayer at the bench config of
//! docs/performance.md: the Plan moves 5.846 → 5.599 GB a step).
//!
//! The pass runs after autodiff: the backward pass keeps the op's own gradient
//! rule, and its readers of the op's value read the rewritten value instead.

use crate::graph::{BinaryOp, Graph, NodeId, Op, ReduceOp, UnaryOp};

/// Rewrites every `NormProject` not in `roots` or the graph's outputs as its
/// statistics, product and scaling (see the module doc); its readers read the
/// scaled product. Returns how many were rewritten.
pub fn split_norm_projections(graph: &mut Graph, roots: &[NodeId]) -> usize {
    let role = graph.role();
    let mut rewritten = 0;
    for id in graph.topo_order() {
        let Op::NormProject { eps, centered } = graph.node(id).op else { continue };
        let kept = roots.contains(&id) || graph.outputs().iter().any(|&(_, o)| o == id);
        if kept {
            continue;
        }
        let inputs = graph.inputs(id);
        let (x, w) = (inputs[0], inputs[1]);
        let last = graph.node(x).shape.rank() - 1;
        graph.set_role(graph.node(id).role);
        let columns = graph.node(w).shape.dims()[1];
        let split = (|| -> Result<NodeId, crate::graph::GraphError> {
            let mean = |graph: &mut Graph, v: NodeId| {
                graph.add(Op::Reduce { op: ReduceOp::Mean, axis: last, keepdim: true }, &[v])
            };
            // rsqrt(mean(v²) + eps) over the row.
            let inverse_rms = |graph: &mut Graph, v: NodeId| -> Result<NodeId, crate::graph::GraphError> {
                let squares = graph.add(Op::Unary(UnaryOp::Square), &[v])?;
                let mean_square = mean(graph, squares)?;
                let shifted = graph.add(Op::Affine { mul: 1.0, add: eps }, &[mean_square])?;
                graph.add(Op::Unary(UnaryOp::Rsqrt), &[shifted])
            };
            let columns_of = |graph: &mut Graph, v: NodeId, start: usize, end: usize| {
                let axis = graph.node(v).shape.rank() - 1;
                if (start, end) == (0, columns) {
                    Ok(v)
                } else {
                    graph.add(Op::Slice { axis, start, end }, &[v])
                }
            };
            let dot = graph.add(Op::MatMul { trans_a: false, trans_b: false }, &[x, w])?;
            let mut parts = Vec::new();
            if centered > 0 {
                let mu = mean(graph, x)?;
                let deviations = graph.add(Op::Binary(BinaryOp::Sub), &[x, mu])?;
                let inverse_std = inverse_rms(graph, deviations)?;
                let column_sums =
                    graph.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: true }, &[w])?;
                let sums = columns_of(graph, column_sums, 0, centered)?;
                let shift = graph.add(Op::Binary(BinaryOp::Mul), &[mu, sums])?;
                let centred_dot = columns_of(graph, dot, 0, centered)?;
                let centred = graph.add(Op::Binary(BinaryOp::Sub), &[centred_dot, shift])?;
                parts.push(graph.add(Op::Binary(BinaryOp::Mul), &[centred, inverse_std])?);
            }
            if centered < columns {
                let inverse = inverse_rms(graph, x)?;
                let rms_dot = columns_of(graph, dot, centered, columns)?;
                parts.push(graph.add(Op::Binary(BinaryOp::Mul), &[rms_dot, inverse])?);
            }
            match parts[..] {
                [one] => Ok(one),
                _ => graph.add(Op::Concat { axis: last }, &parts),
            }
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
