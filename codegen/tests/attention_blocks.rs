//! Causal attention in query blocks (`codegen::emit::attention`, docs/math.md §1.4):
//! the compiled forward and its three gradients against the reference executor in
//! f32 and f64 at the sequence lengths where the blocks change shape (one token, a
//! single block, equal blocks, a last block of one row), with one to four heads and
//! one to four query heads per key/value head, for the kernels of both targets (the
//! Cuda target's C dialect runs here; `cuda_emulation.rs` runs its CUDA dialect);
//! the gradients against central differences of the f64 reference; and the Plan
//! holds no buffer of the whole `B·H·T²` score matrix.

mod common;

use std::collections::HashMap;

use codegen::compile::{compile, one_op_per_group, HostData, Request, Target};
use codegen::emit::query_block_rows;
use codegen::plan::{BufferRole, Plan, Step};
use common::emit::{check, param, rel_err, run_plan, Rng, Sources};
use ir::exec::{Tensor, Value};
use ir::graph::{Graph, NodeId, Op};

const B: usize = 2;
const DH: usize = 8;

/// Sequence lengths: one token, a single block (T ≤ 16), four equal blocks,
/// and on the CPU four blocks of 64 rows and a fifth of one.
const LENGTHS: [usize; 4] = [1, 7, 64, 257];

/// Query heads and key/value heads: one head, four, and four in groups of 2 and 4.
const HEADS: [(usize, usize); 4] = [(1, 1), (4, 4), (4, 2), (4, 1)];

/// The attention of q [B, T, h, dh] over k, v [B, T, hkv, dh] and its gradients
/// for the output gradient `d`, as the outputs `y`, `dq`, `dk`, `dv`.
struct Case {
    graph: Graph,
    q: NodeId,
    k: NodeId,
    v: NodeId,
    d: NodeId,
    y: NodeId,
    grads: [NodeId; 3],
    what: String,
}

fn case(t: usize, (h, hkv): (usize, usize), rope: Option<f64>) -> Case {
    let mut g = Graph::new();
    let q = param(&mut g, "q", &[B, t, h, DH]);
    let k = param(&mut g, "k", &[B, t, hkv, DH]);
    let v = param(&mut g, "v", &[B, t, hkv, DH]);
    let d = param(&mut g, "d", &[B, t, h, DH]);
    let scale = 1.0 / (DH as f64).sqrt();
    let y = g.add(Op::CausalAttention { scale, rope_base: rope }, &[q, k, v]).expect("attention");
    g.set_output("y", y);
    let grads = [0, 1, 2].map(|wrt| {
        let op = Op::CausalAttentionGrad { scale, rope_base: rope, wrt };
        let grad = g.add(op, &[q, k, v, d]).expect("attention gradient");
        g.set_output(["dq", "dk", "dv"][wrt], grad);
        grad
    });
    let what = format!("T {t}, heads {h}/{hkv}, rope {rope:?}");
    Case { graph: g, q, k, v, d, y, grads, what }
}

fn cases() -> impl Iterator<Item = Case> {
    LENGTHS.into_iter().flat_map(|t| {
        HEADS.into_iter().enumerate().map(move |(i, heads)| {
            let rope = ((i + t) % 2 == 1).then_some(10000.0);
            case(t, heads, rope)
        })
    })
}

fn floats(plan: &Plan, outs: &[HostData], name: &str) -> Vec<f32> {
    let id = plan.find(&BufferRole::Output { name: name.into() }).expect("an output buffer");
    let HostData::F32(v) = &outs[id.0] else { panic!("{name}: f32 output") };
    v.clone()
}

fn to_f64(values: &HashMap<NodeId, Value<f32>>) -> HashMap<NodeId, Value<f64>> {
    values
        .iter()
        .map(|(&id, v)| {
            let Value::Float(t) = v else { panic!("float sources") };
            let data: Vec<f64> = t.data.iter().map(|&x| f64::from(x)).collect();
            (id, Value::Float(Tensor::new(t.shape.clone(), data)))
        })
        .collect()
}

/// The compiled attention (both targets' kernels, run here in C) equals the f32
/// reference within 1e-5 forward and 1e-4 backward (the reference sums each row
/// in another order) and the f64 reference within the same bounds.
#[test]
fn blocked_attention_matches_the_reference_in_f32_and_f64() {
    for c in cases() {
        let mut rng = Rng::new(c.what.len() as u64 + 7);
        let sources = Sources::random(&c.graph, &mut rng, 1.0, &|_, n| vec![0; n]);
        let roots = [c.y, c.grads[0], c.grads[1], c.grads[2]];
        let want = ir::exec::run::<f64>(&c.graph, &to_f64(&sources.values), &roots).expect("f64 reference");
        for target in [Target::Cpu, Target::Cuda] {
            let what = format!("{}, {target:?}", c.what);
            let request = Request::new(&c.graph, Vec::new()).for_target(target);
            let plan = check(&c.graph, &sources, &request, &one_op_per_group(&c.graph), 1e-4, &what);
            let outs = run_plan(&c.graph, &plan, &sources);
            for (name, id, tol) in
                [("y", c.y, 1e-5), ("dq", roots[1], 1e-4), ("dk", roots[2], 1e-4), ("dv", roots[3], 1e-4)]
            {
                let Value::Float(w) = &want[&id] else { panic!("float") };
                let w: Vec<f32> = w.data.iter().map(|&x| x as f32).collect();
                let e = rel_err(&floats(&plan, &outs, name), &w);
                assert!(e <= tol, "{what}: {name} differs from the f64 reference by {e} > {tol}");
            }
            let blocks = c.graph.node(c.q).shape.dims()[1]
                .div_ceil(query_block_rows(c.graph.node(c.q).shape.dims()[1], target));
            let softmaxes = plan.kernels.iter().filter(|k| k.name.ends_with("_softmax")).count();
            assert_eq!(softmaxes, 2 * blocks, "{what}: one softmax per query block, forward and backward");
        }
    }
}

/// The gradients the compiled kernels compute are those of the f64 reference's
/// forward: along a random direction u of (q, k, v), ⟨(dq, dk, dv), u⟩ equals the
/// central difference of ⟨d, y⟩ within 1e-4 of its scale.
#[test]
fn compiled_gradients_agree_with_central_differences() {
    for c in cases().filter(|c| c.graph.node(c.q).shape.dims()[1] > 1) {
        let mut rng = Rng::new(c.what.len() as u64 + 11);
        let sources = Sources::random(&c.graph, &mut rng, 1.0, &|_, n| vec![0; n]);
        let request = Request::new(&c.graph, Vec::new());
        let plan = compile(&c.graph, &one_op_per_group(&c.graph), &request).expect("compiles");
        let outs = run_plan(&c.graph, &plan, &sources);
        let base = to_f64(&sources.values);
        let direction: HashMap<NodeId, Vec<f64>> = [c.q, c.k, c.v]
            .into_iter()
            .map(|id| {
                (
                    id,
                    (0..c.graph.node(id).shape.numel())
                        .map(|_| f64::from(rng.uniform() * 2.0 - 1.0))
                        .collect(),
                )
            })
            .collect();
        let Value::Float(dy) = &base[&c.d] else { panic!("float") };
        let loss = |h: f64| {
            let mut at = base.clone();
            for (id, u) in &direction {
                let Some(Value::Float(x)) = at.get_mut(id) else { panic!("float") };
                x.data.iter_mut().zip(u).for_each(|(x, u)| *x += h * u);
            }
            let y = ir::exec::run::<f64>(&c.graph, &at, &[c.y]).expect("f64 reference");
            let Value::Float(y) = &y[&c.y] else { panic!("float") };
            y.data.iter().zip(&dy.data).map(|(a, b)| a * b).sum::<f64>()
        };
        let step = 1e-4;
        let central = (loss(step) - loss(-step)) / (2.0 * step);
        let compiled: f64 = [(c.q, "dq"), (c.k, "dk"), (c.v, "dv")]
            .iter()
            .map(|(id, name)| {
                let g = floats(&plan, &outs, name);
                g.iter().zip(&direction[id]).map(|(&g, u)| f64::from(g) * u).sum::<f64>()
            })
            .sum();
        let scale: f64 = direction.values().map(|u| u.len() as f64).sum::<f64>().sqrt();
        assert!(
            (compiled - central).abs() <= 1e-4 * scale,
            "{}: directional derivative {compiled} vs central difference {central}",
            c.what
        );
    }
}

/// At T = 1024 and 2048 no buffer of either target's Plan holds a `B·H·T²` score
/// matrix: the largest is one score buffer of `B·H·tq·T` elements (tq query rows
/// per block), which every block reuses; the forward keeps one, the backward two.
#[test]
fn no_buffer_holds_the_whole_score_matrix() {
    let (b, h) = (B, 2);
    for t in [1024, 2048] {
        let c = case(t, (h, 1), Some(10000.0));
        for target in [Target::Cpu, Target::Cuda] {
            let tq = query_block_rows(t, target);
            let request = Request::new(&c.graph, Vec::new()).for_target(target);
            let plan = compile(&c.graph, &one_op_per_group(&c.graph), &request).expect("compiles");
            let largest = plan.buffers.iter().map(|d| d.len).max().expect("buffers");
            assert_eq!(largest, b * h * tq * t, "T {t}, {target:?}: one block of scores per (b, h)");
            assert!(largest * 8 <= b * h * t * t, "T {t}, {target:?}: far below the whole matrix");
            let scores = plan.buffers.iter().filter(|d| d.len == largest).count();
            assert_eq!(scores, 3, "T {t}, {target:?}: the forward's scores, the backward's scores and dP");
            let gemms = plan.steps.iter().filter(|s| matches!(s, Step::Gemm(_))).count();
            assert_eq!(
                gemms,
                t.div_ceil(tq) * (2 + 5),
                "T {t}, {target:?}: per block S, O; S, dP, dQ, dK, dV"
            );
            let chains = if target == Target::Cpu { 2 } else { 0 };
            assert_eq!(
                plan.chains.len(),
                chains,
                "T {t}, {target:?}: the CPU runs each attention head by head"
            );
        }
    }
}
