//! Gradient checks (docs/architecture.md §9.2): every op's derivative rule against central
//! differences of the f64 reference executor. The loss is Σ y ⊙ w with fixed random
//! weights w, so a rule that, say, transposes or mirrors an adjoint cannot pass.

use ir::autodiff::{grad, AutodiffError};
use ir::exec::{run, Tensor, Value};
use ir::graph::{BinaryOp, Graph, Init, NodeId, Op, ParamClass, ParamInfo, ReduceOp, Region, Role, UnaryOp};
use ir::{DType, Shape};
use std::collections::HashMap;

/// SplitMix64: a small deterministic generator, so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

/// A graph under test with the values bound to its sources.
struct Case {
    g: Graph,
    rng: Rng,
    values: HashMap<NodeId, Value<f64>>,
}

impl Case {
    fn new(seed: u64) -> Self {
        Case { g: Graph::new(), rng: Rng(seed), values: HashMap::new() }
    }

    /// A float parameter holding the given values.
    fn param_values(&mut self, dims: &[usize], data: Vec<f64>) -> NodeId {
        let info = ParamInfo {
            name: format!("p{}", self.values.len()),
            init: Init::Zeros,
            class: ParamClass::Hidden,
        };
        let id = self.g.add_source(Op::Param(info), Shape::new(dims), DType::F64, None);
        self.values.insert(id, Value::Float(Tensor::new(Shape::new(dims), data)));
        id
    }

    /// A float parameter with values uniform in [lo, hi).
    fn param(&mut self, dims: &[usize], lo: f64, hi: f64) -> NodeId {
        let data = self.rng.vec(Shape::new(dims).numel(), lo, hi);
        self.param_values(dims, data)
    }

    /// An i32 input holding the given values.
    fn ints(&mut self, dims: &[usize], data: Vec<i32>) -> NodeId {
        let name = format!("i{}", self.values.len());
        let id = self.g.add_source(Op::Input { name }, Shape::new(dims), DType::I32, None);
        self.values.insert(id, Value::Int(Tensor::new(Shape::new(dims), data)));
        id
    }

    fn add(&mut self, op: Op, inputs: &[NodeId]) -> NodeId {
        self.g.add(op, inputs).expect("valid test graph")
    }

    /// loss = Σ y ⊙ w, w fixed random weights in [-1, 1).
    fn weighted_sum(&mut self, y: NodeId) -> NodeId {
        let dims = self.g.node(y).shape.dims().to_vec();
        let w = self.param(&dims, -1.0, 1.0);
        let prod = self.add(Op::Binary(BinaryOp::Mul), &[y, w]);
        let flat = self.add(Op::Reshape { shape: vec![dims.iter().product()] }, &[prod]);
        self.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[flat])
    }

    fn eval(&self, outputs: &[NodeId]) -> HashMap<NodeId, Value<f64>> {
        run::<f64>(&self.g, &self.values, outputs).expect("reference executor runs")
    }

    fn loss_at(&mut self, loss: NodeId, x: NodeId, index: usize, value: f64) -> f64 {
        let Some(Value::Float(t)) = self.values.get_mut(&x) else { panic!("float source") };
        let saved = std::mem::replace(&mut t.data[index], value);
        let out = scalar(&self.eval(&[loss])[&loss]);
        let Some(Value::Float(t)) = self.values.get_mut(&x) else { panic!("float source") };
        t.data[index] = saved;
        out
    }
}

fn floats(v: &Value<f64>) -> &[f64] {
    &v.as_float().expect("float value").data
}

fn scalar(v: &Value<f64>) -> f64 {
    floats(v)[0]
}

const STEP: f64 = 1e-5;
const TOL: f64 = 1e-6;

/// Checks d(Σ y ⊙ w)/d x for every element of every `wrt` source against central
/// differences, with relative tolerance `TOL` (plus a 1e-9 floor for zero entries).
fn check_grads(case: &mut Case, y: NodeId, wrt: &[NodeId]) {
    let loss = case.weighted_sum(y);
    check_loss_grads(case, loss, wrt);
}

fn check_loss_grads(case: &mut Case, loss: NodeId, wrt: &[NodeId]) {
    let grads = grad(&mut case.g, loss, wrt).expect("differentiable");
    case.g.check().expect("backward graph is well typed");
    let values = case.eval(&grads);
    let mut largest: f64 = 0.0;
    for (&x, &gx) in wrt.iter().zip(&grads) {
        let analytic = floats(&values[&gx]).to_vec();
        assert_eq!(case.g.node(gx).shape, case.g.node(x).shape);
        let base = floats(&case.values[&x]).to_vec();
        for (i, (&a, &x0)) in analytic.iter().zip(&base).enumerate() {
            let numeric =
                (case.loss_at(loss, x, i, x0 + STEP) - case.loss_at(loss, x, i, x0 - STEP)) / (2.0 * STEP);
            let err = (a - numeric).abs();
            assert!(
                err <= TOL * a.abs().max(numeric.abs()) + 1e-9,
                "d loss / d %{}[{i}]: autodiff {a}, central difference {numeric}",
                x.index()
            );
            largest = largest.max(a.abs());
        }
    }
    assert!(largest > 1e-3, "gradients are all (near) zero: the check would be vacuous");
}

#[test]
fn unary_ops() {
    let cases = [
        (UnaryOp::Neg, -2.0, 2.0),
        (UnaryOp::Exp, -2.0, 2.0),
        (UnaryOp::Log, 0.2, 3.0),
        (UnaryOp::Tanh, -2.0, 2.0),
        (UnaryOp::Sigmoid, -3.0, 3.0),
        (UnaryOp::Silu, -3.0, 3.0),
        (UnaryOp::Sqrt, 0.2, 3.0),
        (UnaryOp::Rsqrt, 0.2, 3.0),
        (UnaryOp::Recip, 0.3, 3.0),
        (UnaryOp::Square, -2.0, 2.0),
    ];
    for (seed, (u, lo, hi)) in cases.into_iter().enumerate() {
        let mut c = Case::new(seed as u64);
        let x = c.param(&[2, 3], lo, hi);
        let y = c.add(Op::Unary(u), &[x]);
        check_grads(&mut c, y, &[x]);
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    let ops = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max];
    for (seed, op) in ops.into_iter().enumerate() {
        let mut c = Case::new(10 + seed as u64);
        let a = c.param(&[2, 3, 4], -2.0, 2.0);
        let b = c.param(&[3, 1], 0.5, 2.0);
        let y = c.add(Op::Binary(op), &[a, b]);
        check_grads(&mut c, y, &[a, b]);
        // The broadcast operand on the left as well.
        let mut c = Case::new(20 + seed as u64);
        let a = c.param(&[4], 0.5, 2.0);
        let b = c.param(&[2, 1, 4], 0.5, 2.0);
        let y = c.add(Op::Binary(op), &[a, b]);
        check_grads(&mut c, y, &[a, b]);
    }
}

#[test]
fn max_ties_send_the_gradient_to_the_first_operand() {
    let mut c = Case::new(30);
    let a = c.param_values(&[4], vec![1.0, 2.0, -1.0, 0.5]);
    let b = c.param_values(&[4], vec![1.0, 3.0, -1.0, 0.0]);
    let y = c.add(Op::Binary(BinaryOp::Max), &[a, b]);
    let w = c.param_values(&[4], vec![0.3, -0.7, 1.1, 2.0]);
    let prod = c.add(Op::Binary(BinaryOp::Mul), &[y, w]);
    let loss = c.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[prod]);
    let grads = grad(&mut c.g, loss, &[a, b]).unwrap();
    let values = c.eval(&grads);
    assert_eq!(floats(&values[&grads[0]]), &[0.3, 0.0, 1.1, 2.0]);
    assert_eq!(floats(&values[&grads[1]]), &[0.0, -0.7, 0.0, 0.0]);
}

#[test]
fn affine() {
    let mut c = Case::new(40);
    let x = c.param(&[3, 2], -1.0, 1.0);
    let y = c.add(Op::Affine { mul: -1.7, add: 0.4 }, &[x]);
    check_grads(&mut c, y, &[x]);
}

#[test]
fn reductions_on_every_axis() {
    for (seed, op) in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max].into_iter().enumerate() {
        for axis in 0..3 {
            for keepdim in [false, true] {
                let mut c = Case::new(50 + 10 * seed as u64 + axis as u64);
                let x = c.param(&[2, 3, 4], -2.0, 2.0);
                let y = c.add(Op::Reduce { op, axis, keepdim }, &[x]);
                check_grads(&mut c, y, &[x]);
            }
        }
    }
}

#[test]
fn reduce_max_ties_go_to_the_first_maximum() {
    let mut c = Case::new(60);
    let x = c.param_values(&[2, 3], vec![1.0, 5.0, 5.0, 2.0, 2.0, -1.0]);
    let y = c.add(Op::Reduce { op: ReduceOp::Max, axis: 1, keepdim: false }, &[x]);
    let w = c.param_values(&[2], vec![0.5, -2.0]);
    let prod = c.add(Op::Binary(BinaryOp::Mul), &[y, w]);
    let loss = c.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[prod]);
    let gx = grad(&mut c.g, loss, &[x]).unwrap()[0];
    assert_eq!(floats(&c.eval(&[gx])[&gx]), &[0.0, 0.5, 0.0, -2.0, 0.0, 0.0]);
}

#[test]
fn matmul_transposes_and_batch_broadcast() {
    // (a batch dims, b batch dims): rank-2 operand, size-1 batch axis, missing axes.
    let batches: [(&[usize], &[usize]); 4] = [(&[2], &[]), (&[], &[3]), (&[1, 3], &[2, 1]), (&[2, 1], &[3])];
    let (m, k, n) = (2, 3, 4);
    for (bi, (ba, bb)) in batches.into_iter().enumerate() {
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                let mut c = Case::new(70 + bi as u64);
                let mut da = ba.to_vec();
                da.extend(if trans_a { [k, m] } else { [m, k] });
                let mut db = bb.to_vec();
                db.extend(if trans_b { [n, k] } else { [k, n] });
                let a = c.param(&da, -1.0, 1.0);
                let b = c.param(&db, -1.0, 1.0);
                let y = c.add(Op::MatMul { trans_a, trans_b }, &[a, b]);
                check_grads(&mut c, y, &[a, b]);
            }
        }
    }
}

#[test]
fn movement_ops() {
    let mut c = Case::new(80);
    let x = c.param(&[2, 3, 4], -1.0, 1.0);
    let r = c.add(Op::Reshape { shape: vec![4, 6] }, &[x]);
    check_grads(&mut c, r, &[x]);

    let mut c = Case::new(81);
    let x = c.param(&[2, 3, 4], -1.0, 1.0);
    let p = c.add(Op::Permute { perm: vec![2, 0, 1] }, &[x]);
    check_grads(&mut c, p, &[x]);

    let mut c = Case::new(82);
    let x = c.param(&[3, 1], -1.0, 1.0);
    let b = c.add(Op::Broadcast { shape: vec![2, 3, 4] }, &[x]);
    check_grads(&mut c, b, &[x]);

    for (start, end) in [(0, 2), (1, 3), (2, 4), (0, 4)] {
        let mut c = Case::new(83);
        let x = c.param(&[2, 4, 3], -1.0, 1.0);
        let s = c.add(Op::Slice { axis: 1, start, end }, &[x]);
        check_grads(&mut c, s, &[x]);
    }

    let mut c = Case::new(84);
    let x0 = c.param(&[2, 1, 3], -1.0, 1.0);
    let x1 = c.param(&[2, 3, 3], -1.0, 1.0);
    let x2 = c.param(&[2, 2, 3], -1.0, 1.0);
    let y = c.add(Op::Concat { axis: 1 }, &[x0, x1, x0, x2]);
    check_grads(&mut c, y, &[x0, x1, x2]);
}

#[test]
fn gather_and_scatters() {
    // Embedding-style gather with a repeated index: the adjoints must accumulate.
    let mut c = Case::new(90);
    let table = c.param(&[5, 3], -1.0, 1.0);
    let ids = c.ints(&[2, 3], vec![4, 0, 4, 1, 2, 4]);
    let y = c.add(Op::Gather { axis: 0 }, &[table, ids]);
    check_grads(&mut c, y, &[table]);

    // Per-token stream gather and row replacement on axis 2 of [B, T, N, C].
    let mut c = Case::new(91);
    let x = c.param(&[2, 2, 4, 3], -1.0, 1.0);
    let idx = c.ints(&[2, 2, 2], vec![0, 3, 1, 2, 0, 1, 3, 2]);
    let act = c.add(Op::Gather { axis: 2 }, &[x, idx]);
    let src = c.param(&[2, 2, 2, 3], -1.0, 1.0);
    let mixed = c.add(Op::Binary(BinaryOp::Mul), &[act, src]);
    let y = c.add(Op::ScatterRows { axis: 2 }, &[x, idx, mixed]);
    check_grads(&mut c, y, &[x, src]);

    let mut c = Case::new(92);
    let base = c.param(&[2, 4, 3], -1.0, 1.0);
    let idx = c.ints(&[2, 3], vec![1, 1, 3, 0, 2, 0]);
    let src = c.param(&[2, 3, 3], -1.0, 1.0);
    let y = c.add(Op::ScatterAdd { axis: 1 }, &[base, idx, src]);
    check_grads(&mut c, y, &[base, src]);
}

#[test]
fn softmax() {
    let mut c = Case::new(100);
    let x = c.param(&[3, 5], -2.0, 2.0);
    let y = c.add(Op::Softmax, &[x]);
    check_grads(&mut c, y, &[x]);
}

#[test]
fn rms_norm_with_and_without_gain() {
    let mut c = Case::new(110);
    let x = c.param(&[2, 3, 6], -2.0, 2.0);
    let gain = c.param(&[6], 0.5, 1.5);
    let y = c.add(Op::RmsNorm { eps: 1e-5 }, &[x, gain]);
    check_grads(&mut c, y, &[x, gain]);

    let mut c = Case::new(111);
    let x = c.param(&[4, 5], -2.0, 2.0);
    let y = c.add(Op::RmsNorm { eps: 1e-3 }, &[x]);
    check_grads(&mut c, y, &[x]);
}

#[test]
fn layer_norm_with_and_without_affine() {
    let mut c = Case::new(120);
    let x = c.param(&[2, 3, 6], -2.0, 2.0);
    let gain = c.param(&[6], 0.5, 1.5);
    let bias = c.param(&[6], -1.0, 1.0);
    let y = c.add(Op::LayerNorm { eps: 1e-5 }, &[x, gain, bias]);
    check_grads(&mut c, y, &[x, gain, bias]);

    let mut c = Case::new(121);
    let x = c.param(&[4, 5], -2.0, 2.0);
    let y = c.add(Op::LayerNorm { eps: 1e-3 }, &[x]);
    check_grads(&mut c, y, &[x]);
}

#[test]
fn group_norm() {
    let mut c = Case::new(130);
    let x = c.param(&[2, 3, 8], -2.0, 2.0);
    let gain = c.param(&[8], 0.5, 1.5);
    let bias = c.param(&[8], -1.0, 1.0);
    let y = c.add(Op::GroupNorm { groups: 2, eps: 1e-5 }, &[x, gain, bias]);
    check_grads(&mut c, y, &[x, gain, bias]);
}

#[test]
fn norm_project_with_no_some_and_all_columns_centred() {
    for (seed, centered) in [0, 2, 5].into_iter().enumerate() {
        let mut c = Case::new(140 + seed as u64);
        let x = c.param(&[2, 3, 6], -2.0, 2.0);
        let w = c.param(&[6, 5], -1.0, 1.0);
        let y = c.add(Op::NormProject { eps: 1e-5, centered }, &[x, w]);
        check_grads(&mut c, y, &[x, w]);
    }
    // A single vector (rank 1): the rule flattens to [1, K].
    let mut c = Case::new(143);
    let x = c.param(&[6], -2.0, 2.0);
    let w = c.param(&[6, 3], -1.0, 1.0);
    let y = c.add(Op::NormProject { eps: 1e-5, centered: 1 }, &[x, w]);
    check_grads(&mut c, y, &[x, w]);
}

#[test]
fn softmax_cross_entropy() {
    let mut c = Case::new(150);
    let logits = c.param(&[2, 3, 5], -2.0, 2.0);
    let targets = c.ints(&[2, 3], vec![0, 4, 2, 2, 1, 3]);
    let loss = c.add(Op::SoftmaxCrossEntropy, &[logits, targets]);
    // The op is already a scalar loss; scale it so the seed adjoint is not 1.
    let scaled = c.add(Op::Affine { mul: 1.7, add: 0.0 }, &[loss]);
    check_loss_grads(&mut c, scaled, &[logits]);
}

/// The fused output projection and loss (docs/math.md §1.7), with w stored [D, V] and
/// [V, D] (read transposed), a readout scale, and chunks that do and do not divide the
/// rows: the chunk is the compiled devices' business, never the value's.
#[test]
fn linear_cross_entropy_both_layouts() {
    for (seed, (trans_b, scale, chunk)) in
        [(false, 1.0, 6), (true, 0.7, 4), (false, 2.5, 1)].into_iter().enumerate()
    {
        let mut c = Case::new(170 + seed as u64);
        let x = c.param(&[2, 3, 4], -1.0, 1.0);
        let w = if trans_b { c.param(&[5, 4], -1.0, 1.0) } else { c.param(&[4, 5], -1.0, 1.0) };
        let targets = c.ints(&[2, 3], vec![0, 4, 2, 2, 1, 3]);
        let loss = c.add(Op::LinearCrossEntropy { trans_b, scale, chunk }, &[x, w, targets]);
        let scaled = c.add(Op::Affine { mul: 1.3, add: 0.0 }, &[loss]);
        check_loss_grads(&mut c, scaled, &[x, w]);
    }
}

#[test]
fn causal_attention_with_gqa_and_rope() {
    for (seed, rope_base) in [None, Some(10_000.0), Some(7.0)].into_iter().enumerate() {
        let mut c = Case::new(160 + seed as u64);
        let q = c.param(&[2, 4, 4, 4], -1.0, 1.0);
        let k = c.param(&[2, 4, 2, 4], -1.0, 1.0);
        let v = c.param(&[2, 4, 2, 4], -1.0, 1.0);
        let y = c.add(Op::CausalAttention { scale: 0.5, rope_base }, &[q, k, v]);
        check_grads(&mut c, y, &[q, k, v]);
    }
}

/// 20 iterations at n = 4 as in mHC (docs/math.md §4.5), plus short iterations with a large
/// eps: there the column-max shift is not cancelled by the first column normalization,
/// so its gradient (to each column's maximum) is exercised.
#[test]
fn sinkhorn_unrolled() {
    for (seed, (iters, eps)) in [(20, 1e-6), (20, 0.05), (1, 0.5), (2, 0.3)].into_iter().enumerate() {
        let mut c = Case::new(170 + seed as u64);
        let x = c.param(&[2, 4, 4], -2.0, 2.0);
        let y = c.add(Op::Sinkhorn { iters, eps }, &[x]);
        check_grads(&mut c, y, &[x]);
    }
}

#[test]
fn temporal_augment_with_and_without_gram_schmidt() {
    for (seed, gram_schmidt) in [false, true].into_iter().enumerate() {
        let mut c = Case::new(180 + seed as u64);
        let out = c.param(&[2, 5, 3], -1.0, 1.0);
        let w1 = c.param(&[2, 3], -1.0, 1.0);
        let w2 = c.param(&[4, 3], -1.0, 1.0);
        let w3 = c.param(&[3, 3], -1.0, 1.0);
        let y = c.add(Op::TemporalAugment { gram_schmidt, eps_rel: 1e-6 }, &[out, w1, w2, w3]);
        check_grads(&mut c, y, &[out, w1, w2, w3]);
    }
}

/// A small SwiGLU-like block feeding a cross-entropy, with a parameter used twice
/// (adjoints from both uses must be summed) and an RMSNorm in front.
#[test]
fn composite_block() {
    let mut c = Case::new(190);
    let h = c.param(&[2, 3, 4], -1.0, 1.0);
    let gain = c.param(&[4], 0.5, 1.5);
    let w1 = c.param(&[4, 6], -1.0, 1.0);
    let w3 = c.param(&[4, 6], -1.0, 1.0);
    let w2 = c.param(&[6, 4], -1.0, 1.0);
    let u = c.param(&[4, 5], -1.0, 1.0);
    let a = c.add(Op::RmsNorm { eps: 1e-5 }, &[h, gain]);
    let gate = c.add(Op::MatMul { trans_a: false, trans_b: false }, &[a, w1]);
    let gate = c.add(Op::Unary(UnaryOp::Silu), &[gate]);
    let up = c.add(Op::MatMul { trans_a: false, trans_b: false }, &[a, w3]);
    let inner = c.add(Op::Binary(BinaryOp::Mul), &[gate, up]);
    let down = c.add(Op::MatMul { trans_a: false, trans_b: false }, &[inner, w2]);
    let h2 = c.add(Op::Binary(BinaryOp::Add), &[h, down]);
    let logits = c.add(Op::MatMul { trans_a: false, trans_b: false }, &[h2, u]);
    let targets = c.ints(&[2, 3], vec![1, 0, 4, 3, 3, 2]);
    let loss = c.add(Op::SoftmaxCrossEntropy, &[logits, targets]);
    check_loss_grads(&mut c, loss, &[h, gain, w1, w3, w2, u]);
}

/// Integer values stop gradients: routing indices from TopK and token ids carry none,
/// so a score tensor that reaches the loss only through TopK gets a zero gradient,
/// as does an i32 input itself.
#[test]
fn integer_values_carry_no_gradient() {
    let mut c = Case::new(200);
    let x = c.param(&[2, 4, 3], -1.0, 1.0);
    let scores = c.param(&[2, 4], -1.0, 1.0);
    let idx = c.add(Op::TopK { k: 2, fixed: 1 }, &[scores]);
    let picked = c.add(Op::Gather { axis: 1 }, &[x, idx]);
    let ids = c.ints(&[2, 2], vec![0, 2, 1, 1]);
    let again = c.add(Op::Gather { axis: 1 }, &[x, ids]);
    let y = c.add(Op::Binary(BinaryOp::Mul), &[picked, again]);
    let loss = c.weighted_sum(y);
    let grads = grad(&mut c.g, loss, &[scores, ids]).unwrap();
    for (&gid, wrt) in grads.iter().zip([scores, ids]) {
        let node = c.g.node(gid);
        assert_eq!(node.op, Op::Constant { value: 0.0 });
        assert_eq!(node.shape, c.g.node(wrt).shape);
        assert!(node.dtype.is_float());
    }
    check_loss_grads(&mut c, loss, &[x]);
}

#[test]
fn unrelated_wrt_gets_a_zero_gradient() {
    let mut c = Case::new(210);
    let x = c.param(&[3], -1.0, 1.0);
    let unused = c.param(&[2, 2], -1.0, 1.0);
    let y = c.add(Op::Unary(UnaryOp::Exp), &[x]);
    let loss = c.weighted_sum(y);
    let grads = grad(&mut c.g, loss, &[unused, x]).unwrap();
    assert_eq!(floats(&c.eval(&[grads[0]])[&grads[0]]), &[0.0; 4]);
    assert_eq!(c.g.node(grads[0]).shape, Shape::new([2, 2]));
}

/// The backward ops have no derivative rule of their own: a second derivative through
/// attention is reported, not silently zeroed.
#[test]
fn second_derivative_through_a_backward_op_is_no_rule() {
    let mut c = Case::new(220);
    let q = c.param(&[1, 3, 2, 4], -1.0, 1.0);
    let k = c.param(&[1, 3, 1, 4], -1.0, 1.0);
    let v = c.param(&[1, 3, 1, 4], -1.0, 1.0);
    let y = c.add(Op::CausalAttention { scale: 0.5, rope_base: None }, &[q, k, v]);
    let loss = c.weighted_sum(y);
    let dq = grad(&mut c.g, loss, &[q]).unwrap()[0];
    let loss2 = c.weighted_sum(dq);
    let err = grad(&mut c.g, loss2, &[q]).unwrap_err();
    assert!(matches!(err, AutodiffError::NoRule { op: "causal_attention_grad", .. }), "{err}");
}

#[test]
fn loss_must_be_a_float_scalar() {
    let mut c = Case::new(230);
    let x = c.param(&[3], -1.0, 1.0);
    let err = grad(&mut c.g, x, &[x]).unwrap_err();
    assert!(matches!(err, AutodiffError::NotScalar { .. }), "{err}");
}

/// Backward nodes are tagged `Region::Backward` with the sublayer and MTP module of
/// the forward node they differentiate, and the builder's role is restored.
#[test]
fn backward_nodes_keep_the_forward_sublayer() {
    let mut c = Case::new(240);
    let x = c.param(&[2, 3], -1.0, 1.0);
    c.g.set_role(Role::new(Region::Backbone).sublayer(3).mtp(Some(1)));
    let y = c.add(Op::Unary(UnaryOp::Tanh), &[x]);
    c.g.set_role(Role::new(Region::Loss));
    let loss = c.weighted_sum(y);
    let before = c.g.node_ids();
    let gx = grad(&mut c.g, loss, &[x]).unwrap()[0];
    assert_eq!(c.g.role(), Role::new(Region::Loss));
    let new: Vec<NodeId> = c.g.node_ids().into_iter().filter(|id| !before.contains(id)).collect();
    assert!(new.iter().all(|&id| c.g.node(id).role.region == Region::Backward));
    let tanh_grad = c.g.node(gx).role;
    assert_eq!((tanh_grad.sublayer, tanh_grad.mtp), (Some(3), Some(1)));
}

/// The backward ops' shape rule: the output gradient must have the forward output's
/// type, `wrt` must name a forward operand, and the result is shaped like that operand.
#[test]
fn backward_op_shape_rules() {
    let mut c = Case::new(250);
    let q = c.param(&[1, 3, 2, 4], -1.0, 1.0);
    let k = c.param(&[1, 3, 1, 4], -1.0, 1.0);
    let dk = c.add(Op::CausalAttentionGrad { scale: 0.5, rope_base: None, wrt: 1 }, &[q, k, k, q]);
    assert_eq!(c.g.node(dk).shape, Shape::new([1, 3, 1, 4]));
    let bad_dout = c.g.add(Op::CausalAttentionGrad { scale: 0.5, rope_base: None, wrt: 0 }, &[q, k, k, k]);
    assert!(bad_dout.unwrap_err().to_string().contains("causal_attention_grad"));
    let bad_wrt = c.g.add(Op::CausalAttentionGrad { scale: 0.5, rope_base: None, wrt: 3 }, &[q, k, k, q]);
    assert!(bad_wrt.unwrap_err().to_string().contains("wrt 3"));

    let out = c.param(&[2, 5, 3], -1.0, 1.0);
    let w = c.param(&[2, 3], -1.0, 1.0);
    let dy = c.param(&[2, 5, 1, 3], -1.0, 1.0);
    let op = |wrt| Op::TemporalAugmentGrad { gram_schmidt: true, eps_rel: 1e-6, wrt };
    let dw = c.add(op(1), &[out, w, dy]);
    assert_eq!(c.g.node(dw).shape, Shape::new([2, 3]));
    assert!(c.g.add(op(1), &[out, w, out]).is_err());
}
