//! `passes::fuse` on every spec's training graph and on small hand-built graphs:
//! a valid partition, heavy ops alone, token-local regions fused, and the fused
//! connection traffic against docs/math.md §4.7 and the unfused count.

mod common;

use common::passes::{load, name, spec_files, training_graph};
use ir::cost::count_spec;
use ir::exec::{self, Tensor, Value};
use ir::graph::{BinaryOp, Graph, Init, NodeId, Op, ParamClass, ParamInfo, Region, UnaryOp};
use ir::passes::{fuse, fused_connection_traffic, rematerialize, simplify, FusedGraph, GroupKind};
use ir::spec::ResidualSpec;
use ir::{DType, Shape};
use std::collections::HashMap;

fn fused_training_graph(path: &std::path::Path) -> (Graph, Vec<NodeId>, FusedGraph) {
    let spec = load(path);
    let (mut lowered, pairs) = training_graph(&spec, 2, 8);
    let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
    simplify(&mut lowered.graph, &grads);
    let fused = fuse(&lowered.graph, &grads).unwrap_or_else(|e| panic!("{}: {e}", name(path)));
    (lowered.graph, grads, fused)
}

#[test]
fn every_spec_partitions_into_valid_fused_groups() {
    for path in spec_files() {
        let (g, grads, fused) = fused_training_graph(&path);
        let spec = name(&path);
        fused.check(&g).unwrap_or_else(|e| panic!("{spec}: {e}"));

        // Every node in exactly one group; MatMuls and reductions never duplicated.
        let mut seen: HashMap<NodeId, usize> = HashMap::new();
        for group in &fused.groups {
            for &id in &group.nodes {
                *seen.entry(id).or_default() += 1;
            }
        }
        for id in g.node_ids() {
            assert_eq!(seen.get(&id), Some(&1), "{spec}: n{} ({})", id.index(), g.node(id).op.name());
        }

        // Groups in `order` come after every group they read from.
        let at: HashMap<_, usize> = fused.order.iter().enumerate().map(|(i, &gid)| (gid, i)).collect();
        assert_eq!(at.len(), fused.groups.len());
        for group in &fused.groups {
            for &input in &group.inputs {
                let producer = fused.group_of(input).expect("input has a group");
                assert!(at[&producer] < at[&group.id], "{spec}: {} runs before {producer}", group.id);
            }
        }

        for group in &fused.groups {
            let compute: Vec<NodeId> = group
                .nodes
                .iter()
                .copied()
                .filter(|&id| !g.node(id).op.is_view() && !g.node(id).op.is_source())
                .collect();
            match group.kind {
                GroupKind::Heavy(h) => {
                    assert_eq!(compute, [h], "{spec}: {} must hold only its heavy op", group.id);
                    assert!(g.node(h).op.is_heavy());
                }
                GroupKind::TokenLocal => {
                    // One phase and one token count per kernel.
                    let backward: Vec<bool> =
                        compute.iter().map(|&id| g.node(id).role.region == Region::Backward).collect();
                    assert!(
                        backward.iter().all(|&b| b == backward[0]),
                        "{spec}: {} mixes forward and backward",
                        group.id
                    );
                    let axes = fused.token_axes();
                    for &id in &compute {
                        assert_eq!(axes.extent(&g, id), group.tokens, "{spec}: {} n{}", group.id, id.index());
                    }
                }
                GroupKind::TokenReduction => assert!(!compute.is_empty()),
                GroupKind::Source => assert!(compute.is_empty()),
            }
        }
        // Attention, its gradient and the loss are heavy wherever they occur.
        for id in g.node_ids() {
            if matches!(
                g.node(id).op,
                Op::CausalAttention { .. } | Op::CausalAttentionGrad { .. } | Op::SoftmaxCrossEntropy
            ) {
                let gid = fused.group_of(id).expect("grouped");
                assert_eq!(fused.group(gid).kind, GroupKind::Heavy(id), "{spec}: n{}", id.index());
            }
        }
        // Gradients are outputs of the groups that compute them.
        for gr in &grads {
            let gid = fused.group_of(*gr).expect("grouped");
            assert!(
                fused.group(gid).outputs.contains(gr),
                "{spec}: gradient n{} is not an output",
                gr.index()
            );
        }
        // The partition is much coarser than the graph (the plain residual, mostly
        // GEMMs, is the least fusible spec).
        assert!(
            3 * fused.groups.len() < g.node_count(),
            "{spec}: {} groups for {} nodes",
            fused.groups.len(),
            g.node_count()
        );
        // explain() has one line per group, each with its reason.
        let text = fused.explain();
        assert_eq!(text.lines().count(), fused.groups.len());
        for group in &fused.groups {
            assert!(!group.reason.is_empty());
            assert!(text.contains(&format!("{} ", group.id)), "{spec}: explain() misses {}", group.id);
        }
    }
}

#[test]
fn temporal_augment_never_reads_its_own_group() {
    let path = spec_files().into_iter().find(|p| name(p) == "xhc").expect("specs/xhc.ron");
    let (g, _, fused) = fused_training_graph(&path);
    let mut checked = 0;
    for id in g.node_ids() {
        let stencil: &[usize] = match g.node(id).op {
            Op::TemporalAugment { .. } => &[0],
            Op::TemporalAugmentGrad { wrt: 0, .. } => &[0, usize::MAX],
            _ => continue,
        };
        let inputs = g.inputs(id);
        for &slot in stencil {
            // The values behind the operand's views: what the kernel really reads.
            let mut stack = vec![inputs[slot.min(inputs.len() - 1)]];
            while let Some(x) = stack.pop() {
                if g.node(x).op.is_view() {
                    stack.extend(g.inputs(x));
                    continue;
                }
                assert_ne!(
                    fused.group_of(x),
                    fused.group_of(id),
                    "n{} reads n{} at other tokens",
                    id.index(),
                    x.index()
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "xhc has no temporal augmentation");
}

fn param(g: &mut Graph, name: &str, dims: &[usize]) -> NodeId {
    let info = ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Hidden };
    g.add_source(Op::Param(info), Shape::new(dims), DType::F32, None)
}

fn input(g: &mut Graph, name: &str, dims: &[usize]) -> NodeId {
    g.add_source(Op::Input { name: name.into() }, Shape::new(dims), DType::F32, None)
}

#[test]
fn small_per_token_contractions_fuse_and_projections_stay_heavy() {
    let mut g = Graph::new();
    let state = input(&mut g, "state", &[2, 8, 4, 16]);
    let coef = input(&mut g, "coef", &[2, 8, 1, 4]);
    let w = param(&mut g, "w", &[16, 16]);
    let mm = |g: &mut Graph, a, b, ta| g.add(Op::MatMul { trans_a: ta, trans_b: false }, &[a, b]).unwrap();
    let read = mm(&mut g, coef, state, false); // [2, 8, 1, 16]: per-token read
    let u = g.add(Op::Reshape { shape: vec![2, 8, 16] }, &[read]).unwrap();
    let a = g.add(Op::Unary(UnaryOp::Tanh), &[u]).unwrap();
    let h = mm(&mut g, a, w, false); // token rows @ shared matrix: a GEMM
    let s = g.add(Op::Binary(BinaryOp::Add), &[a, h]).unwrap();
    let dw = mm(&mut g, a, s, true); // contracts over T: a weight gradient
    g.set_output("s", s);
    g.set_output("dw", dw);
    let fused = fuse(&g, &[]).unwrap();
    fused.check(&g).unwrap();
    let kind = |id| fused.group(fused.group_of(id).unwrap()).kind;
    assert_eq!(kind(read), GroupKind::TokenLocal);
    assert_eq!(fused.group_of(read), fused.group_of(a), "the read and the tanh are one kernel");
    assert_eq!(kind(h), GroupKind::Heavy(h));
    assert_eq!(kind(dw), GroupKind::TokenReduction);
    // `s` reads `a` and the GEMM of `a`: fusing it with `a` would make a cycle.
    assert_ne!(fused.group_of(s), fused.group_of(a));
    assert!(fused.group(fused.group_of(s).unwrap()).kind == GroupKind::TokenLocal);
    let reason = &fused.group(fused.group_of(s).unwrap()).reason;
    assert!(reason.contains("both feed and consume"), "{reason}");
    // The region's internal value `u`/`read` never leaves the kernel; `a` does (the GEMM reads it).
    let region = fused.group(fused.group_of(a).unwrap());
    assert_eq!(region.outputs, vec![a]);
    assert_eq!(region.inputs, vec![state, coef]);
}

/// mHC's shape of a sublayer: the read's group also computes a large per-token
/// product (`H·state`) that only the write after the sublayer's GEMM uses. It
/// moves into the write's group (one more read of the state there, instead of
/// writing and reading the product), while a small product of another input
/// the read's group needs anyway (also used only after the GEMM) stays: moving
/// it would add a read of that whole input. The state scaled by a per-token mean of the coefficients moves
/// with the mean, which nothing else reads.
#[test]
fn large_values_read_only_later_are_computed_by_their_readers() {
    let mut g = Graph::new();
    let state = input(&mut g, "state", &[2, 8, 4, 16]);
    let logits = input(&mut g, "logits", &[2, 8, 4, 4]);
    let w = param(&mut g, "w", &[16, 16]);
    let mm = |g: &mut Graph, a, b| g.add(Op::MatMul { trans_a: false, trans_b: false }, &[a, b]).unwrap();
    let h = g.add(Op::Unary(UnaryOp::Tanh), &[logits]).unwrap();
    let carry = mm(&mut g, h, state); // [2, 8, 4, 16], needed only by the write
    let pre = g.add(Op::Slice { axis: 2, start: 0, end: 1 }, &[h]).unwrap();
    let read = mm(&mut g, pre, state); // [2, 8, 1, 16]
                                       // The read also takes a row of another input, which its group so reads anyway.
    let other = input(&mut g, "other", &[2, 8, 4, 16]);
    let row = g.add(Op::Slice { axis: 2, start: 0, end: 1 }, &[other]).unwrap();
    let read = g.add(Op::Binary(BinaryOp::Add), &[read, row]).unwrap();
    let x = g.add(Op::Reshape { shape: vec![2, 8, 16] }, &[read]).unwrap();
    let small = mm(&mut g, pre, other); // [2, 8, 1, 16] from a [2, 8, 4, 16] input
    let x = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
    let y = mm(&mut g, x, w); // the sublayer: a GEMM
    let y = g.add(Op::Reshape { shape: vec![2, 8, 1, 16] }, &[y]).unwrap();
    let y = g.add(Op::Broadcast { shape: vec![2, 8, 4, 16] }, &[y]).unwrap();
    let out = g.add(Op::Binary(BinaryOp::Add), &[carry, y]).unwrap();
    let spread = g.add(Op::Broadcast { shape: vec![2, 8, 4, 16] }, &[small]).unwrap();
    let out = g.add(Op::Binary(BinaryOp::Mul), &[out, spread]).unwrap();
    // `state · mean(h)`: a per-token scalar only the scaled state needs (its cone).
    let scale = g.add(Op::Reduce { op: ir::graph::ReduceOp::Mean, axis: 3, keepdim: true }, &[h]).unwrap();
    let scale =
        g.add(Op::Reduce { op: ir::graph::ReduceOp::Mean, axis: 2, keepdim: true }, &[scale]).unwrap();
    let spread_scale = g.add(Op::Broadcast { shape: vec![2, 8, 4, 16] }, &[scale]).unwrap();
    let scaled = g.add(Op::Binary(BinaryOp::Mul), &[state, spread_scale]).unwrap();
    let out = g.add(Op::Binary(BinaryOp::Add), &[out, scaled]).unwrap();
    g.set_output("out", out);
    g.set_output("h", h);
    let fused = fuse(&g, &[]).unwrap();
    fused.check(&g).unwrap();
    let group = |id| fused.group_of(id).unwrap();
    assert_eq!(group(carry), group(out), "the product is computed by the write");
    assert_eq!(group(scaled), group(out), "so is the scaled state");
    assert_eq!(group(scale), group(out), "with the scalar only it reads");
    assert_eq!(group(h), group(read), "the coefficients and the read are one kernel");
    assert_ne!(group(h), group(out), "which feeds the GEMM the write reads");
    assert_eq!(group(small), group(read), "a value smaller than the input it reads stays");
    let reason = &fused.group(group(out)).reason;
    assert!(reason.contains("computed here, where it is read"), "{reason}");
    assert!(fused.group(group(out)).inputs.contains(&state), "the write reads the state");
}

#[test]
fn stencil_input_comes_from_an_earlier_group() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[2, 8, 16]);
    let k = param(&mut g, "k", &[3, 16]);
    let y = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
    let aug = g.add(Op::TemporalAugment { gram_schmidt: false, eps_rel: 1e-6 }, &[y, k]).unwrap();
    let z = g.add(Op::Unary(UnaryOp::Exp), &[aug]).unwrap();
    g.set_output("z", z);
    let fused = fuse(&g, &[]).unwrap();
    fused.check(&g).unwrap();
    assert_ne!(fused.group_of(y), fused.group_of(aug));
    assert_eq!(fused.group_of(aug), fused.group_of(z));
    assert!(fused.group(fused.group_of(aug).unwrap()).reason.contains("stencil"));
}

/// docs/math.md §4.7: fused mHC reads at most (3n+1)C and writes (n+1)C per sublayer (plus
/// the n² + 2n coefficient elements of the paper's unfused accounting).
#[test]
fn mhc_fused_connection_traffic_meets_the_paper_bound() {
    let path = spec_files().into_iter().find(|p| name(p) == "mhc").expect("specs/mhc.ron");
    let spec = load(&path);
    let ResidualSpec::Mhc(m) = &spec.residual else { panic!("mhc.ron is not mHC") };
    assert_eq!(m.n, 4);
    let n = m.n as f64;
    let coef = (n * n + 2.0 * n) / spec.d_model as f64;
    let (read, write) = fused_connection_traffic(&spec).unwrap();
    assert!(read <= 3.0 * n + 1.0, "fused read {read} C > (3n+1)C");
    assert!(write <= n + 1.0 + coef, "fused write {write} C > (n+1)C + n²+2n");
    let (unfused_read, unfused_write) = count_spec(&spec).unwrap().traffic_per_sublayer();
    assert!(read < unfused_read && write < unfused_write);
    // The state itself must be read and written at least once per sublayer.
    assert!(read >= n && write >= n, "({read}, {write}) is below one pass over the state");
}

#[test]
fn ghc_and_xhc_fused_traffic_is_below_unfused() {
    let mut checked = 0;
    for path in spec_files() {
        let spec = load(&path);
        if !matches!(spec.residual, ResidualSpec::Ghc(_) | ResidualSpec::Xhc(_)) {
            continue;
        }
        let (read, write) = fused_connection_traffic(&spec).unwrap();
        let (unfused_read, unfused_write) = count_spec(&spec).unwrap().traffic_per_sublayer();
        assert!(
            read < unfused_read && write < unfused_write,
            "{}: fused ({read}, {write}) vs unfused ({unfused_read}, {unfused_write})",
            name(&path)
        );
        assert!(read > 0.0 && write > 0.0, "{}: no connection group found", name(&path));
        checked += 1;
    }
    assert!(checked >= 3, "expected GHC and xHC specs in specs/");
}

/// The centred term of a LayerNorm-projection gradient, `(x − μ) · s` (docs/math.md
/// §6.8), shares `x − μ` with the variance, so fusion alone leaves it in the
/// group before the GEMM, written and read back by the group after it; that
/// group reads `x` anyway. `rematerialize` copies the two-node chain for it;
/// the group before then writes only per-token statistics, the value's bytes
/// leave the traffic, and the graph computes the same function.
#[test]
fn cheap_chains_are_recomputed_by_the_group_that_reads_them() {
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[2, 8, 64]);
    let w = param(&mut g, "w", &[64, 64]);
    let mean = |g: &mut Graph, v| {
        g.add(Op::Reduce { op: ir::graph::ReduceOp::Mean, axis: 2, keepdim: true }, &[v]).unwrap()
    };
    let mu = mean(&mut g, x);
    let centred = g.add(Op::Binary(BinaryOp::Sub), &[x, mu]).unwrap();
    let square = g.add(Op::Unary(UnaryOp::Square), &[centred]).unwrap();
    let var = mean(&mut g, square);
    let var = g.add(Op::Affine { mul: 1.0, add: 1e-5 }, &[var]).unwrap();
    let rstd = g.add(Op::Unary(UnaryOp::Rsqrt), &[var]).unwrap();
    let normed = g.add(Op::Binary(BinaryOp::Mul), &[centred, rstd]).unwrap();
    let y = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[normed, w]).unwrap();
    let s = g.add(Op::Binary(BinaryOp::Mul), &[rstd, rstd]).unwrap();
    let term = g.add(Op::Binary(BinaryOp::Mul), &[centred, s]).unwrap();
    let out = g.add(Op::Binary(BinaryOp::Sub), &[y, term]).unwrap();
    let scaled = g.add(Op::Binary(BinaryOp::Mul), &[x, rstd]).unwrap();
    let out = g.add(Op::Binary(BinaryOp::Add), &[out, scaled]).unwrap();
    g.set_output("out", out);

    let before = fuse(&g, &[]).unwrap();
    assert_ne!(before.group_of(term), before.group_of(out), "fusion alone leaves the term before the GEMM");
    let traffic =
        |f: &FusedGraph| f.groups.iter().map(|gr| gr.cost.bytes_read + gr.cost.bytes_written).sum::<usize>();
    let value = |dims: &[usize], seed: usize| {
        let n: usize = dims.iter().product();
        let data = (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f64 / 250.0 - 2.0).collect();
        Value::Float(Tensor::new(Shape::new(dims.to_vec()), data))
    };
    let sources: HashMap<NodeId, Value<f64>> = [(x, value(&[2, 8, 64], 1)), (w, value(&[64, 64], 2))].into();
    let run = |g: &Graph, out: NodeId| match exec::run(g, &sources, &[out]).unwrap().remove(&out) {
        Some(Value::Float(t)) => t.data,
        other => panic!("a float output, got {other:?}"),
    };
    let want = run(&g, out);

    let stats = rematerialize(&mut g, &[]).unwrap();
    assert_eq!((stats.values, stats.nodes_added), (1, 2), "{stats:?}");
    assert!(!g.node_ids().contains(&term), "the original term has no reader left and is removed");
    let after = fuse(&g, &[]).unwrap();
    after.check(&g).unwrap();
    let out = g.output("out").unwrap();
    let copy = g.inputs(g.inputs(out)[0])[1];
    assert_eq!(after.group_of(copy), after.group_of(out), "the copy is computed where it is read");
    assert_eq!(after.group_of(centred), after.group_of(rstd), "the statistics stay before the GEMM");
    assert!(!after
        .group(after.group_of(rstd).unwrap())
        .outputs
        .iter()
        .any(|&o| g.node(o).shape.numel() == 2 * 8 * 64 && o != normed));
    // The term's write and read leave; μ (one float per token) is written and read instead.
    let (term_bytes, mu_bytes) = (2 * 8 * 64 * 4, 2 * 8 * 4);
    assert_eq!(traffic(&after) + 2 * term_bytes - 2 * mu_bytes, traffic(&before));
    let got = run(&g, out);
    assert_eq!(got, want, "the same function, bit for bit");
}

/// A gain shared by every token and every slot gets its gradient as a sum over
/// rows that merge tokens and slots (`[B·T·n, d]`, DGHC's per-slot norm gain,
/// docs/math.md §5.5). `sum_within_tokens_first` sums each token's `n` rows first, so the
/// token-local group writes one row per token instead of `n`, and the
/// reduction reads `1/n` of what it read; the value changes only by rounding.
#[test]
fn token_sums_over_merged_rows_sum_within_each_token_first() {
    let (tokens, slots, width) = (2 * 8, 4, 16);
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[2, 8, slots, width]);
    let y = input(&mut g, "y", &[2, 8, slots, width]);
    let product = g.add(Op::Binary(BinaryOp::Mul), &[x, y]).unwrap();
    let rows = g.add(Op::Reshape { shape: vec![tokens * slots, width] }, &[product]).unwrap();
    let sum = g.add(Op::Reduce { op: ir::graph::ReduceOp::Sum, axis: 0, keepdim: false }, &[rows]).unwrap();
    // A sum over token rows alone is left as it is.
    let per_token = g.add(Op::Reshape { shape: vec![tokens, slots * width] }, &[product]).unwrap();
    let plain =
        g.add(Op::Reduce { op: ir::graph::ReduceOp::Sum, axis: 0, keepdim: false }, &[per_token]).unwrap();
    g.set_output("sum", sum);
    g.set_output("plain", plain);

    let value = |seed: usize| {
        let n = tokens * slots * width;
        let data = (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f64 / 250.0 - 2.0).collect();
        Value::Float(Tensor::new(Shape::new(vec![2, 8, slots, width]), data))
    };
    let sources: HashMap<NodeId, Value<f64>> = [(x, value(1)), (y, value(2))].into();
    let run = |g: &Graph, out: NodeId| match exec::run(g, &sources, &[out]).unwrap().remove(&out) {
        Some(Value::Float(t)) => t.data,
        other => panic!("a float output, got {other:?}"),
    };
    let want = run(&g, sum);
    let before = fuse(&g, &[sum, plain]).unwrap();
    let reads_before: usize = before.groups.iter().map(|gr| gr.cost.bytes_read).sum();

    assert_eq!(ir::passes::sum_within_tokens_first(&mut g, &[sum, plain]), 1);
    assert!(!g.node_ids().contains(&rows), "the merged reshape has no reader left and is removed");
    let inner = g.inputs(sum)[0];
    assert_eq!(g.node(inner).shape.dims(), &[tokens, width]);
    assert!(matches!(g.node(inner).op, Op::Reduce { axis: 1, .. }));
    assert_eq!(g.inputs(plain), vec![per_token], "a sum over token rows only is kept");
    let after = fuse(&g, &[sum, plain]).unwrap();
    after.check(&g).unwrap();
    assert_eq!(
        after.group_of(inner),
        after.group_of(product),
        "the within-token sum fuses with its producer"
    );
    let reads_after: usize = after.groups.iter().map(|gr| gr.cost.bytes_read).sum();
    // The reduction reads one row per token instead of `slots`.
    assert_eq!(reads_before - reads_after, (slots - 1) * tokens * width * 4);
    let got = run(&g, sum);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

/// SwiGLU's backward (docs/math.md §1.3): the gate's gradient `dh ⊙ up ⊙
/// silu'(gate)` and the up projection's `dh ⊙ silu(gate)` both read `dh`.
/// Fusion merges the two readers so that `dh` is read once; `rematerialize`
/// then recomputes `silu(gate)` in that backward kernel from `gate`, which it
/// reads anyway, so the forward kernel writes `h` alone. The gradients are
/// the same, bit for bit.
#[test]
fn swiglu_backward_reads_dh_once_and_recomputes_silu() {
    let (b, t, d, f) = (2, 8, 16, 24);
    let mut g = Graph::new();
    let x = input(&mut g, "x", &[b, t, d]);
    let target = input(&mut g, "target", &[b, t, d]);
    let w1 = param(&mut g, "w1", &[d, f]);
    let w3 = param(&mut g, "w3", &[d, f]);
    let w2 = param(&mut g, "w2", &[f, d]);
    let matmul = Op::MatMul { trans_a: false, trans_b: false };
    let gate = g.add(matmul.clone(), &[x, w1]).unwrap();
    let up = g.add(matmul.clone(), &[x, w3]).unwrap();
    let silu = g.add(Op::Unary(UnaryOp::Silu), &[gate]).unwrap();
    let h = g.add(Op::Binary(BinaryOp::Mul), &[silu, up]).unwrap();
    let y = g.add(matmul, &[h, w2]).unwrap();
    let loss = scored_loss(&mut g, y, target);
    let grads = ir::autodiff::grad(&mut g, loss, &[w1, w3, w2]).unwrap();
    let sources = ramp_sources(&g, &[x, target, w1, w3, w2]);
    let run = |g: &Graph| gradient_values(g, &sources, &grads);
    let want = run(&g);

    // `dh`: the one backward product of the hidden width.
    let dh = g
        .node_ids()
        .into_iter()
        .find(|&id| {
            let node = g.node(id);
            matches!(node.op, Op::MatMul { .. })
                && node.role.region == Region::Backward
                && node.shape.dims() == [b, t, f]
        })
        .expect("dh");
    let before = fuse(&g, &grads).unwrap();
    let readers_of_dh = before.groups.iter().filter(|gr| gr.inputs.contains(&dh)).count();
    assert_eq!(readers_of_dh, 1, "both of dh's elementwise readers run in one kernel");
    let forward = before.group_of(silu).unwrap();
    assert!(before.group(forward).outputs.contains(&silu), "without recomputation the forward writes silu");

    let stats = rematerialize(&mut g, &grads).unwrap();
    assert_eq!((stats.values, stats.nodes_added), (1, 1), "{stats:?}");
    let after = fuse(&g, &grads).unwrap();
    after.check(&g).unwrap();
    let forward = after.group(after.group_of(h).unwrap());
    assert_eq!(forward.outputs, vec![h], "the forward kernel writes h alone");
    let backward = after.groups.iter().find(|gr| gr.inputs.contains(&dh)).expect("dh's reader");
    assert!(backward.inputs.contains(&gate) && !backward.inputs.contains(&silu));
    let copy = backward.nodes.iter().copied().find(|&id| matches!(g.node(id).op, Op::Unary(UnaryOp::Silu)));
    let copy = copy.expect("silu(gate) recomputed in the backward kernel");
    assert_eq!(g.node(copy).role.region, Region::Backward, "the copy runs in its reader's pass");
    let traffic =
        |f: &FusedGraph| f.groups.iter().map(|gr| gr.cost.bytes_read + gr.cost.bytes_written).sum::<usize>();
    assert_eq!(traffic(&before) - traffic(&after), 2 * b * t * f * 4, "silu's write and read leave");
    assert_eq!(run(&g), want, "the same gradients, bit for bit");
}

/// mHC's read `x_pre = H_pre · x` (docs/math.md §4.1) feeds the backbone's
/// RMSNorm through a reshape, and the norm's gradient reads it back in the
/// backward kernel that also forms `dH_pre = dx_pre · xᵀ` from the state and
/// the coefficients. `rematerialize` recomputes the short per-token product
/// (n = 4 terms an element) there, the reshape with it, so the forward kernel
/// no longer writes `x_pre`; the gradients are the same, bit for bit.
#[test]
fn short_per_token_products_read_through_views_are_recomputed_in_the_backward() {
    let (b, t, n, c) = (2, 8, 4, 16);
    let mut g = Graph::new();
    let u = input(&mut g, "u", &[b, t, n, c]);
    let logits = input(&mut g, "logits", &[b, t, 1, n]);
    let target = input(&mut g, "target", &[b, t, c]);
    let scale = param(&mut g, "scale", &[c]);
    let bias = param(&mut g, "bias", &[n]);
    let gain = param(&mut g, "gain", &[c]);
    let x = g.add(Op::Binary(BinaryOp::Mul), &[u, scale]).unwrap();
    let shifted = g.add(Op::Binary(BinaryOp::Add), &[logits, bias]).unwrap();
    let h_pre = g.add(Op::Unary(UnaryOp::Sigmoid), &[shifted]).unwrap();
    let x_pre = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[h_pre, x]).unwrap();
    let flat = g.add(Op::Reshape { shape: vec![b, t, c] }, &[x_pre]).unwrap();
    let normed = g.add(Op::RmsNorm { eps: 1e-5 }, &[flat, gain]).unwrap();
    let loss = scored_loss(&mut g, normed, target);
    let grads = ir::autodiff::grad(&mut g, loss, &[scale, bias, gain]).unwrap();
    let sources = ramp_sources(&g, &[u, logits, target, scale, bias, gain]);
    let run = |g: &Graph| gradient_values(g, &sources, &grads);
    let want = run(&g);

    let before = fuse(&g, &grads).unwrap();
    let forward = before.group(before.group_of(x_pre).unwrap());
    assert!(forward.outputs.contains(&x_pre), "without recomputation the forward writes x_pre");
    let readers = before.groups.iter().filter(|gr| gr.inputs.contains(&x_pre)).count();
    assert_eq!(readers, 1, "one backward kernel reads x_pre, through the reshape");

    let stats = rematerialize(&mut g, &grads).unwrap();
    assert!(stats.values >= 1, "{stats:?}");
    let after = fuse(&g, &grads).unwrap();
    after.check(&g).unwrap();
    assert!(after.groups.iter().all(|gr| !gr.inputs.contains(&x_pre)), "no kernel reads x_pre back");
    let forward = after.group(after.group_of(x_pre).unwrap());
    assert!(!forward.outputs.contains(&x_pre), "the forward kernel keeps x_pre in registers");
    let copies: Vec<NodeId> = g
        .node_ids()
        .into_iter()
        .filter(|&id| {
            id != x_pre && matches!(g.node(id).op, Op::MatMul { .. }) && g.inputs(id) == g.inputs(x_pre)
        })
        .collect();
    assert_eq!(copies.len(), 1, "one copy of the product");
    assert_eq!(g.node(copies[0]).role.region, Region::Backward);
    let traffic =
        |f: &FusedGraph| f.groups.iter().map(|gr| gr.cost.bytes_read + gr.cost.bytes_written).sum::<usize>();
    assert!(
        traffic(&before) - traffic(&after) >= 2 * b * t * c * 4,
        "x_pre's write and read leave: {} -> {}",
        traffic(&before),
        traffic(&after)
    );
    assert_eq!(run(&g), want, "the same gradients, bit for bit");
}

/// `Σ y ⊙ target` over every element: a scalar loss whose gradient with
/// respect to `y` is `target`.
fn scored_loss(g: &mut Graph, y: NodeId, target: NodeId) -> NodeId {
    let scored = g.add(Op::Binary(BinaryOp::Mul), &[y, target]).unwrap();
    let flat = g.add(Op::Reshape { shape: vec![g.node(scored).shape.numel()] }, &[scored]).unwrap();
    let sum = ir::graph::ReduceOp::Sum;
    let loss = g.add(Op::Reduce { op: sum, axis: 0, keepdim: false }, &[flat]).unwrap();
    g.set_output("loss", loss);
    loss
}

/// Values in [-1, 1) for each of `sources`, a different ramp for each.
fn ramp_sources(g: &Graph, sources: &[NodeId]) -> HashMap<NodeId, Value<f64>> {
    let ramp = |id: NodeId, seed: usize| {
        let shape = g.node(id).shape.clone();
        let data =
            (0..shape.numel()).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f64 / 500.0 - 1.0).collect();
        (id, Value::Float(Tensor::new(shape, data)))
    };
    sources.iter().enumerate().map(|(seed, &id)| ramp(id, seed + 1)).collect()
}

/// The f64 reference's value of each of `grads`.
fn gradient_values(g: &Graph, sources: &HashMap<NodeId, Value<f64>>, grads: &[NodeId]) -> Vec<Vec<f64>> {
    let out = exec::run(g, sources, grads).unwrap();
    grads.iter().map(|id| out[id].as_float().expect("float").data.clone()).collect()
}
