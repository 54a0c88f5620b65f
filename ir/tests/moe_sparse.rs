//! Sparse MoE dispatch (docs/math.md §1.6) against its oracle, the dense-masked
//! formulation: equal loss and equal gradient of every parameter in the f64 reference,
//! for softmax and sigmoid gates, with and without shared experts, with tied scores, with
//! an expert no token chooses, and with a capacity that drops assignments (against a
//! dense oracle whose gates drop the same ones). Then central differences of the whole
//! loss through the router, and the cost model counting the routed work only.

mod common;

use common::exec::{Case, Rng};
use common::moe::{param_name, sources};
use ir::autodiff::grad;
use ir::cost::op_cost;
use ir::exec::{run, Value};
use ir::graph::{MoeRouteOut, NodeId, Op, ReduceOp, Region, UnaryOp};
use ir::lower::lower;
use ir::spec::{FfnSpec, ModelSpec, MoeBalance, MoeDispatch, MoeGate, MoeSpec, TrainSpec};
use ir::{DType, Shape};
use std::collections::HashMap;

// ---------------------------------------------------------------------------------------
// The routing op alone.

#[test]
fn route_orders_assignments_by_expert_then_token_and_drops_past_capacity() {
    // Four tokens, k = 2, three experts; expert 1 is chosen by every token.
    let idx = vec![0, 1, 1, 2, 0, 1, 1, 2];
    let route = |capacity: Option<usize>, out: MoeRouteOut| {
        let mut c = Case::new();
        let i = c.ints(&[4, 2], idx.clone());
        let r = c.add(Op::MoeRoute { experts: 3, capacity, out }, &[i]);
        c.eval_int::<f64>(r)
    };
    // Dropless: expert 0 gets tokens 0, 2; expert 1 tokens 0, 1, 2, 3; expert 2 tokens 1, 3.
    assert_eq!(route(None, MoeRouteOut::Counts), [2, 4, 2]);
    assert_eq!(route(None, MoeRouteOut::Tokens), [0, 2, 0, 1, 2, 3, 1, 3]);
    assert_eq!(route(None, MoeRouteOut::Rows), [0, 2, 3, 6, 1, 4, 5, 7]);
    // Capacity 2: expert 1 keeps tokens 0 and 1 (first come, first served); the
    // assignments of tokens 2 and 3 to it go after every kept row, in token order.
    assert_eq!(route(Some(2), MoeRouteOut::Counts), [2, 2, 2]);
    assert_eq!(route(Some(2), MoeRouteOut::Rows), [0, 2, 3, 4, 1, 6, 7, 5]);
    assert_eq!(route(Some(2), MoeRouteOut::Tokens), [0, 2, 0, 1, 1, 3, 2, 3]);
}

#[test]
fn grouped_matmul_multiplies_each_group_by_its_weight_and_zeroes_the_rest() {
    let mut rng = Rng::new(3);
    let (m, k, n) = (5, 3, 2);
    let xd = rng.normals(m * k);
    let wd = rng.normals(2 * k * n);
    let mut c = Case::new();
    let x = c.param(&[m, k], xd.clone());
    let w = c.param(&[2, k, n], wd.clone());
    let counts = c.ints(&[2], vec![1, 3]);
    let y = c.add(Op::GroupedMatMul { trans_b: false }, &[x, w, counts]);
    let got = c.eval::<f64>(y);
    for r in 0..m {
        let e = match r {
            0 => Some(0),
            1..=3 => Some(1),
            _ => None,
        };
        for o in 0..n {
            let want = e.map_or(0.0, |e| (0..k).map(|i| xd[r * k + i] * wd[e * k * n + i * n + o]).sum());
            assert!((got[r * n + o] - want).abs() < 1e-12, "row {r} col {o}: {} vs {want}", got[r * n + o]);
        }
    }
    // Counts past the operand's rows are an error, not a read out of bounds.
    let mut c = Case::new();
    let x = c.param(&[2, k], vec![0.0; 2 * k]);
    let w = c.param(&[2, k, n], vec![0.0; 2 * k * n]);
    let counts = c.ints(&[2], vec![2, 1]);
    let y = c.add(Op::GroupedMatMul { trans_b: false }, &[x, w, counts]);
    assert!(c.try_run::<f64>(&[y]).is_err());
}

// ---------------------------------------------------------------------------------------
// One MoE block built by hand: scores are a parameter, so ties and unused experts are
// set exactly, and the capacity oracle gets its mask from the test.

const N: usize = 6;
const D: usize = 3;
const F: usize = 2;
const E: usize = 4;
const K: usize = 2;

struct BlockData {
    x: Vec<f64>,
    scores: Vec<f64>,
    w1: Vec<f64>,
    w3: Vec<f64>,
    w2: Vec<f64>,
    r: Vec<f64>,
}

impl BlockData {
    fn random(seed: u64) -> BlockData {
        let mut rng = Rng::new(seed);
        BlockData {
            x: rng.normals(N * D),
            scores: rng.normals(N * E),
            w1: rng.normals(E * D * F),
            w3: rng.normals(E * D * F),
            w2: rng.normals(E * F * D),
            r: rng.normals(N * D),
        }
    }
}

fn gate_of(gate: MoeGate, scores: &[f64]) -> Vec<f64> {
    match gate {
        MoeGate::Softmax => {
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            exps.iter().map(|e| e / sum).collect()
        }
        MoeGate::Sigmoid => scores.iter().map(|s| 1.0 / (1.0 + (-s).exp())).collect(),
    }
}

/// The test's own routing: top-k by (value descending, index ascending), then the
/// first `capacity` assignments per expert in token order kept. Returns the chosen
/// experts (ascending per token) and the kept mask, both [N, K].
fn expected_routing(gate: MoeGate, scores: &[f64], capacity: Option<usize>) -> (Vec<usize>, Vec<f64>) {
    let mut chosen = Vec::new();
    for n in 0..N {
        let p = gate_of(gate, &scores[n * E..(n + 1) * E]);
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
        let mut top = order[..K].to_vec();
        top.sort();
        chosen.extend(top);
    }
    let mut load = [0usize; E];
    let mask = chosen
        .iter()
        .map(|&e| {
            load[e] += 1;
            if capacity.is_none_or(|c| load[e] <= c) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    (chosen, mask)
}

/// The block's loss Σ out ⊙ r and its parameters [x, scores, w1, w3, w2, r]. Dense:
/// every expert on every token, masked by the gates (times `mask`, the oracle's drops);
/// sparse: `MoeRoute` + `GroupedMatMul` with `capacity`.
fn block(
    c: &mut Case,
    d: &BlockData,
    gate: MoeGate,
    sparse: bool,
    capacity: Option<usize>,
    mask: Option<&[f64]>,
) -> (NodeId, Vec<NodeId>) {
    let x = c.param(&[N, D], d.x.clone());
    let scores = c.param(&[N, E], d.scores.clone());
    let w1 = c.param(&[E, D, F], d.w1.clone());
    let w3 = c.param(&[E, D, F], d.w3.clone());
    let w2 = c.param(&[E, F, D], d.w2.clone());
    let r = c.param(&[N, D], d.r.clone());
    let probs = match gate {
        MoeGate::Softmax => c.add(Op::Softmax, &[scores]),
        MoeGate::Sigmoid => c.add(Op::Unary(UnaryOp::Sigmoid), &[scores]),
    };
    let chosen = c.add(Op::TopK { k: K, fixed: 0 }, &[probs]);
    let mut kept = c.add(Op::Gather { axis: 1 }, &[probs, chosen]);
    if let Some(mask) = mask {
        let m = c.param(&[N, K], mask.to_vec());
        kept = c.add(Op::Binary(ir::graph::BinaryOp::Mul), &[kept, m]);
    }
    let mul = Op::Binary(ir::graph::BinaryOp::Mul);
    let out = if sparse {
        let route = |c: &mut Case, out| c.add(Op::MoeRoute { experts: E, capacity, out }, &[chosen]);
        let rows = route(c, MoeRouteOut::Rows);
        let tokens = route(c, MoeRouteOut::Tokens);
        let counts = route(c, MoeRouteOut::Counts);
        let xs = c.add(Op::Gather { axis: 0 }, &[x, tokens]);
        let gm = Op::GroupedMatMul { trans_b: false };
        let h = c.add(gm.clone(), &[xs, w1, counts]);
        let h = c.add(Op::Unary(UnaryOp::Silu), &[h]);
        let u = c.add(gm.clone(), &[xs, w3, counts]);
        let inner = c.add(mul.clone(), &[h, u]);
        let ys = c.add(gm, &[inner, w2, counts]);
        let per_slot = c.add(Op::Gather { axis: 0 }, &[ys, rows]);
        let g = c.add(Op::Reshape { shape: vec![N, K, 1] }, &[kept]);
        let weighted = c.add(mul, &[per_slot, g]);
        c.add(Op::Reduce { op: ReduceOp::Sum, axis: 1, keepdim: false }, &[weighted])
    } else {
        let zeros = c.g.add_source(Op::Constant { value: 0.0 }, Shape::new([N, E]), DType::F32, None);
        let gates = c.add(Op::ScatterRows { axis: 1 }, &[zeros, chosen, kept]);
        let xb = c.add(Op::Reshape { shape: vec![1, N, D] }, &[x]);
        let mm = Op::MatMul { trans_a: false, trans_b: false };
        let h = c.add(mm.clone(), &[xb, w1]);
        let h = c.add(Op::Unary(UnaryOp::Silu), &[h]);
        let u = c.add(mm.clone(), &[xb, w3]);
        let inner = c.add(mul.clone(), &[h, u]);
        let y = c.add(mm, &[inner, w2]); // [E, N, D]
        let g = c.add(Op::Permute { perm: vec![1, 0] }, &[gates]);
        let g = c.add(Op::Reshape { shape: vec![E, N, 1] }, &[g]);
        let weighted = c.add(mul, &[y, g]);
        c.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[weighted])
    };
    let prod = c.add(Op::Binary(ir::graph::BinaryOp::Mul), &[out, r]);
    let s = c.add(Op::Reduce { op: ReduceOp::Sum, axis: 1, keepdim: false }, &[prod]);
    let loss = c.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[s]);
    (loss, vec![x, scores, w1, w3, w2, r])
}

/// The loss and the gradient of every block parameter, f64 reference.
fn loss_and_grads(
    d: &BlockData,
    gate: MoeGate,
    sparse: bool,
    capacity: Option<usize>,
    mask: Option<&[f64]>,
) -> Vec<Vec<f64>> {
    let mut c = Case::new();
    let (loss, params) = block(&mut c, d, gate, sparse, capacity, mask);
    let grads = grad(&mut c.g, loss, &params).unwrap_or_else(|e| panic!("autodiff: {e}"));
    c.g.check().unwrap_or_else(|e| panic!("backward graph: {e}"));
    let mut outs = vec![loss];
    outs.extend(&grads);
    let values = c.try_run::<f64>(&outs).unwrap_or_else(|e| panic!("run: {e}"));
    outs.iter().map(|o| values[o].as_float().expect("float").data.clone()).collect()
}

fn assert_all_close(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    let names = ["loss", "d x", "d scores", "d w1", "d w3", "d w2", "d r"];
    for ((g, w), name) in got.iter().zip(want).zip(names) {
        assert_eq!(g.len(), w.len());
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= 1e-12 * b.abs().max(1.0),
                "{what}: {name}[{i}]: sparse {a} vs dense {b}"
            );
        }
    }
}

fn check_block(d: &BlockData, gate: MoeGate, capacity: Option<usize>, what: &str) {
    let (_, mask) = expected_routing(gate, &d.scores, capacity);
    let dense_mask = capacity.map(|_| mask.as_slice());
    let want = loss_and_grads(d, gate, false, None, dense_mask);
    let got = loss_and_grads(d, gate, true, capacity, None);
    assert_all_close(&got, &want, what);
    assert!(want[0][0].abs() > 1e-6, "{what}: the loss should not vanish");
}

#[test]
fn sparse_block_equals_dense_masked_block_for_both_gates() {
    for (seed, gate) in [(1, MoeGate::Softmax), (2, MoeGate::Sigmoid)] {
        check_block(&BlockData::random(seed), gate, None, &format!("{gate:?}"));
    }
}

#[test]
fn sparse_block_breaks_ties_to_the_lowest_expert_like_the_dense_one() {
    for gate in [MoeGate::Softmax, MoeGate::Sigmoid] {
        let mut d = BlockData::random(5);
        // Token 0: experts 1, 2, 3 tie for the top; token 1: all four tie; token 2:
        // experts 0 and 3 tie for the second place.
        d.scores[..E].copy_from_slice(&[0.1, 0.7, 0.7, 0.7]);
        d.scores[E..2 * E].copy_from_slice(&[0.3; E]);
        d.scores[2 * E..3 * E].copy_from_slice(&[0.2, 0.9, -0.4, 0.2]);
        let (chosen, _) = expected_routing(gate, &d.scores, None);
        assert_eq!(&chosen[..3 * K], &[1, 2, 0, 1, 0, 1]);
        check_block(&d, gate, None, &format!("ties {gate:?}"));
    }
}

#[test]
fn sparse_block_handles_an_expert_that_receives_no_token() {
    let mut d = BlockData::random(7);
    for n in 0..N {
        d.scores[n * E + 2] = -8.0;
    }
    let (chosen, _) = expected_routing(MoeGate::Softmax, &d.scores, None);
    assert!(!chosen.contains(&2));
    check_block(&d, MoeGate::Softmax, None, "idle expert");
    // The idle expert's weights get exactly zero gradient.
    let got = loss_and_grads(&d, MoeGate::Softmax, true, None, None);
    let w1 = &got[3][2 * D * F..3 * D * F];
    assert!(w1.iter().all(|&v| v == 0.0), "{w1:?}");
}

#[test]
fn sparse_block_with_capacity_drops_the_same_assignments_as_the_oracle() {
    for (seed, gate) in [(11, MoeGate::Softmax), (12, MoeGate::Sigmoid)] {
        let mut d = BlockData::random(seed);
        // Expert 0 is every token's favourite, so capacity 2 must drop four of its six.
        for n in 0..N {
            d.scores[n * E] = 5.0;
        }
        let (_, mask) = expected_routing(gate, &d.scores, Some(2));
        assert!(mask.iter().filter(|&&m| m == 0.0).count() >= 4, "{mask:?}");
        check_block(&d, gate, Some(2), &format!("capacity {gate:?}"));
    }
}

// ---------------------------------------------------------------------------------------
// Whole models: the lowering's Sparse dispatch against its Dense dispatch.

const B: usize = 2;
const T: usize = 3;

fn model(gate: MoeGate, shared: usize, dispatch: MoeDispatch) -> ModelSpec {
    ModelSpec {
        vocab: 11,
        d_model: 8,
        layers: 2,
        heads: 2,
        ffn: FfnSpec::Moe(MoeSpec {
            experts: 4,
            top_k: 2,
            shared,
            hidden: 3,
            gate,
            dispatch,
            capacity_factor: None,
            balance: MoeBalance::None,
            renormalize: false,
        }),
        train: TrainSpec { seq_len: T, ..TrainSpec::default() },
        ..ModelSpec::default()
    }
}

/// The loss and every gradient by parameter name.
fn model_values(spec: &ModelSpec, seed: u64) -> (f64, HashMap<String, Vec<f64>>) {
    let mut l = lower(spec, B, T).unwrap_or_else(|e| panic!("lower: {e}"));
    let params = l.graph.params();
    let grads = grad(&mut l.graph, l.loss, &params).unwrap_or_else(|e| panic!("autodiff: {e}"));
    let src = sources(&l, seed);
    let mut outs = vec![l.loss];
    outs.extend(&grads);
    let v = run(&l.graph, &src, &outs).unwrap_or_else(|e| panic!("run: {e}"));
    let loss = v[&l.loss].as_float().expect("float").data[0];
    let by_name = params
        .iter()
        .zip(&grads)
        .map(|(&p, g)| (param_name(&l, p), v[g].as_float().expect("float").data.clone()))
        .collect();
    (loss, by_name)
}

/// `spec` with the kept gates renormalized to sum 1 per token.
fn renormalized(mut spec: ModelSpec) -> ModelSpec {
    if let FfnSpec::Moe(m) = &mut spec.ffn {
        m.renormalize = true;
    }
    spec
}

/// The sparse and the dense lowering of `spec` agree in loss and every gradient.
fn assert_sparse_equals_dense(dense: &ModelSpec, what: &str) {
    let sparse = match &dense.ffn {
        FfnSpec::Moe(m) => ModelSpec {
            ffn: FfnSpec::Moe(MoeSpec { dispatch: MoeDispatch::Sparse, ..m.clone() }),
            ..dense.clone()
        },
        FfnSpec::SwiGlu(_) => unreachable!("an MoE spec"),
    };
    let (dl, dg) = model_values(dense, 21);
    let (sl, sg) = model_values(&sparse, 21);
    assert!((dl - sl).abs() <= 1e-12 * dl.abs(), "{what}: loss {sl} vs {dl}");
    assert_eq!(dg.len(), sg.len(), "{what}: the same parameters");
    for (name, want) in &dg {
        let got = &sg[name];
        let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!((a - b).abs() <= 1e-10 * scale, "{what}: d {name}[{i}]: sparse {a} vs dense {b}");
        }
        if name.contains("router") || name.contains("experts") {
            assert!(want.iter().any(|v| v.abs() > 1e-9), "{what}: d {name} vanishes");
        }
    }
}

#[test]
fn sparse_lowering_equals_dense_lowering_in_loss_and_every_gradient() {
    for gate in [MoeGate::Softmax, MoeGate::Sigmoid] {
        for shared in [0, 1] {
            let dense = model(gate, shared, MoeDispatch::Dense);
            assert_sparse_equals_dense(&dense, &format!("{gate:?} shared={shared}"));
        }
    }
}

/// Renormalized gates (docs/math.md §1.6): sparse still equals dense, and the function
/// differs from the unnormalized one (the kept gates of 4 experts' top 2 never sum to 1).
#[test]
fn renormalized_gates_keep_sparse_equal_to_dense_and_change_the_function() {
    for gate in [MoeGate::Softmax, MoeGate::Sigmoid] {
        let dense = renormalized(model(gate, 1, MoeDispatch::Dense));
        assert_sparse_equals_dense(&dense, &format!("renormalized {gate:?}"));
        let (plain, _) = model_values(&model(gate, 1, MoeDispatch::Sparse), 21);
        let (renorm, _) = model_values(&renormalized(model(gate, 1, MoeDispatch::Sparse)), 21);
        assert!((plain - renorm).abs() > 1e-9, "{gate:?}: renormalizing changes the loss");
    }
}

#[test]
fn sparse_lowering_matches_central_differences_through_the_router() {
    check_central_differences(&model(MoeGate::Sigmoid, 1, MoeDispatch::Sparse));
    check_central_differences(&renormalized(model(MoeGate::Sigmoid, 1, MoeDispatch::Sparse)));
}

/// The analytic gradient of the router, expert and shared weights against central
/// differences of the whole loss.
fn check_central_differences(spec: &ModelSpec) {
    let mut l = lower(spec, B, T).unwrap();
    let params = l.graph.params();
    let grads = grad(&mut l.graph, l.loss, &params).unwrap();
    let base = sources(&l, 33);
    let mut outs = vec![l.loss];
    outs.extend(&grads);
    let v = run(&l.graph, &base, &outs).unwrap();
    let loss_at = |src: &HashMap<NodeId, Value<f64>>| {
        run(&l.graph, src, &[l.loss]).unwrap()[&l.loss].as_float().unwrap().data[0]
    };
    let eps = 1e-6;
    let mut checked = 0;
    for (&p, g) in params.iter().zip(&grads) {
        let name = param_name(&l, p);
        if !(name.contains("ffn.router") || name.contains("ffn.experts") || name.contains("ffn.shared")) {
            continue;
        }
        let analytic = &v[g].as_float().unwrap().data;
        let n = analytic.len();
        for i in [0, n / 3, n / 2, n - 1] {
            let mut plus = base.clone();
            let mut minus = base.clone();
            let bump = |src: &mut HashMap<NodeId, Value<f64>>, by: f64| {
                if let Some(Value::Float(t)) = src.get_mut(&p) {
                    t.data[i] += by;
                }
            };
            bump(&mut plus, eps);
            bump(&mut minus, -eps);
            let numeric = (loss_at(&plus) - loss_at(&minus)) / (2.0 * eps);
            let tol = 1e-6 * numeric.abs().max(analytic[i].abs()).max(1e-2);
            assert!(
                (numeric - analytic[i]).abs() <= tol,
                "d {name}[{i}]: analytic {} vs numeric {numeric}",
                analytic[i]
            );
            checked += 1;
        }
    }
    assert!(checked >= 4 * 2 * 7, "checked {checked} entries");
}

// ---------------------------------------------------------------------------------------
// Cost: the grouped products count routed rows × expert FLOPs.

/// FLOPs of the forward grouped products and of the forward graph.
fn forward_flops(spec: &ModelSpec, b: usize, t: usize) -> (f64, f64) {
    let l = lower(spec, b, t).unwrap();
    let g = &l.graph;
    let mut grouped = 0.0;
    let mut total = 0.0;
    for id in g.node_ids() {
        let c = op_cost(g, id);
        assert!(g.node(id).role.region != Region::Backward);
        total += c.flops;
        if matches!(g.node(id).op, Op::GroupedMatMul { .. }) {
            grouped += c.flops;
        }
    }
    (grouped, total)
}

#[test]
fn sparse_cost_counts_routed_tokens_times_expert_flops() {
    let (b, t, d, f, k, e, layers) = (2usize, 16usize, 8usize, 3usize, 2usize, 4usize, 2usize);
    let mut spec = model(MoeGate::Softmax, 1, MoeDispatch::Sparse);
    spec.train.seq_len = t;
    let (grouped, sparse_total) = forward_flops(&spec, b, t);
    let routed = (b * t * k) as f64;
    let per_row = 2.0 * (3 * d * f) as f64; // w1, w3: D×F; w2: F×D
    assert_eq!(grouped, layers as f64 * routed * per_row);
    assert!(grouped < layers as f64 * (b * t * e) as f64 * per_row);
    // The dense dispatch's active-fraction estimate counts the same expert work.
    let mut dense = spec.clone();
    if let FfnSpec::Moe(m) = &mut dense.ffn {
        m.dispatch = MoeDispatch::Dense;
    }
    let (_, dense_total) = forward_flops(&dense, b, t);
    assert!((sparse_total - dense_total).abs() < 0.02 * dense_total, "{sparse_total} vs {dense_total}");

    // With a capacity, at most experts × capacity rows are multiplied.
    let mut capped = spec.clone();
    if let FfnSpec::Moe(m) = &mut capped.ffn {
        m.capacity_factor = Some(0.5);
    }
    let cap = (0.5 * (b * t * k) as f64 / e as f64).ceil();
    let (grouped, _) = forward_flops(&capped, b, t);
    assert_eq!(grouped, layers as f64 * (e as f64 * cap) * per_row);
}

/// `widen check`'s active parameters: each routed expert weight counts top_k / experts,
/// whatever the dispatch; everything else counts whole.
#[test]
fn active_parameters_count_top_k_of_the_routed_experts() {
    for dispatch in [MoeDispatch::Dense, MoeDispatch::Sparse] {
        let spec = model(MoeGate::Softmax, 1, dispatch);
        let p = ir::cost::cost_report(&spec).unwrap().params;
        // Per layer 3 routed matrices of E·D·F; a token uses k of the E experts.
        let (e, k, d, f) = (4u64, 2u64, 8u64, 3u64);
        let idle = spec.layers as u64 * 3 * (e - k) * d * f;
        assert_eq!(p.active, p.total - idle, "{dispatch:?}: {p:?}");
        let dense = ir::cost::cost_report(&ModelSpec { ffn: FfnSpec::default(), ..spec.clone() }).unwrap();
        assert_eq!(dense.params.active, dense.params.total, "no experts, nothing idle");
    }
}

/// The closed-form memory estimate follows the dispatch: sparse stores top_k rows per
/// token where dense stores every expert's, and both stay within a factor of 2 of the
/// graph's count (the bound `spec_limits` holds every spec file to).
#[test]
fn memory_estimate_follows_the_dispatch() {
    let at = |dispatch, experts| {
        let mut spec = model(MoeGate::Softmax, 1, dispatch);
        if let FfnSpec::Moe(m) = &mut spec.ffn {
            m.experts = experts;
            m.hidden = 16;
        }
        spec.d_model = 16;
        let memory = ir::cost::training_memory(&spec);
        let per_token = memory.activation_bytes / (spec.train.batch * spec.train.seq_len) as f64;
        (per_token, ir::cost::cost_report(&spec).unwrap().activation_bytes_per_token as f64)
    };
    let (sparse8, counted) = at(MoeDispatch::Sparse, 8);
    assert!((0.5..=2.0).contains(&(sparse8 / counted)), "sparse {sparse8} vs counted {counted}");
    let (sparse64, _) = at(MoeDispatch::Sparse, 64);
    let (dense8, _) = at(MoeDispatch::Dense, 8);
    let (dense64, _) = at(MoeDispatch::Dense, 64);
    // Only the router's scores and probabilities grow: 2 values per expert, layer and token.
    let router = 4.0 * 2.0 * (64.0 - 8.0) * 2.0;
    assert!(
        (sparse64 - sparse8 - router).abs() < 1e-9,
        "sparse grows with the router only: {sparse8} -> {sparse64}"
    );
    assert!(dense64 > 4.0 * dense8, "dense grows with the experts: {dense8} -> {dense64}");
}
