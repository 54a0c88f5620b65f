//! bf16 mixed precision in the graph IR (docs/math.md §6.12): the `Cast` op's type rule, its
//! reference semantics in the f32 and f64 executors, the mixed-operand type rules, and its
//! straight-through derivative rule.

use ir::autodiff::grad;
use ir::dtype::round_bf16;
use ir::exec::{run, Tensor, Value};
use ir::graph::{BinaryOp, Graph, Init, NodeId, Op, ParamClass, ParamInfo, ReduceOp};
use ir::{DType, Shape};
use std::collections::HashMap;

fn param(g: &mut Graph, name: &str, dims: &[usize], dtype: DType) -> NodeId {
    let info = ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Hidden };
    g.add_source(Op::Param(info), Shape::new(dims), dtype, None)
}

fn cast(g: &mut Graph, x: NodeId, to: DType) -> NodeId {
    g.add(Op::Cast { to }, &[x]).unwrap()
}

#[test]
fn cast_types_and_mixed_operands_compute_in_f32() {
    let mut g = Graph::new();
    let a = param(&mut g, "a", &[2, 3], DType::F32);
    let w = param(&mut g, "w", &[3, 4], DType::F32);
    let ab = cast(&mut g, a, DType::Bf16);
    let wb = cast(&mut g, w, DType::Bf16);
    assert_eq!(g.node(ab).dtype, DType::Bf16);
    assert_eq!(g.node(ab).shape, Shape::new([2, 3]));
    // bf16 x bf16 accumulates and returns f32; bf16 mixes with f32 elementwise.
    let mm = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[ab, wb]).unwrap();
    assert_eq!(g.node(mm).dtype, DType::F32);
    let sum = g.add(Op::Binary(BinaryOp::Add), &[ab, a]).unwrap();
    assert_eq!(g.node(sum).dtype, DType::F32);
    let red = g.add(Op::Reduce { op: ReduceOp::Sum, axis: 1, keepdim: false }, &[ab]).unwrap();
    assert_eq!(g.node(red).dtype, DType::F32);
    // Views keep the storage type.
    let r = g.add(Op::Reshape { shape: vec![6] }, &[ab]).unwrap();
    assert_eq!(g.node(r).dtype, DType::Bf16);
    // Truly invalid combinations stay errors.
    let ids = g.add_source(Op::Input { name: "ids".into() }, Shape::new([2, 3]), DType::I32, None);
    assert!(g.add(Op::Cast { to: DType::Bf16 }, &[ids]).unwrap_err().to_string().contains("cast"));
    assert!(g.add(Op::Cast { to: DType::I32 }, &[a]).is_err());
    let d = param(&mut g, "d", &[2, 3], DType::F64);
    assert!(g.add(Op::Binary(BinaryOp::Add), &[ab, d]).is_err());
    assert!(g.add(Op::Binary(BinaryOp::Add), &[ab, ids]).is_err());
    g.check().unwrap();
}

/// f32 values next to bf16 ties, NaN, overflow, and ordinary values.
fn probe_values() -> Vec<f32> {
    vec![
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        -(1.0 + 2f32.powi(-8)),
        f32::MAX,
        0.1,
        -3.7,
        1e-40,
        f32::NAN,
    ]
}

#[test]
fn reference_cast_rounds_to_nearest_even_in_f32_and_f64() {
    let xs = probe_values();
    let n = xs.len();
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[n], DType::F32);
    let xb = cast(&mut g, x, DType::Bf16);
    let back = cast(&mut g, xb, DType::F32);
    let f32_src = HashMap::from([(x, Value::Float(Tensor::new(Shape::new([n]), xs.clone())))]);
    let out = run(&g, &f32_src, &[back]).unwrap();
    let got = out[&back].as_float().unwrap().data.clone();
    let want: Vec<f32> = xs.iter().map(|&v| round_bf16(v)).collect();
    assert_eq!(&got[..n - 1], &want[..n - 1]);
    assert_eq!(got[0], 1.0);
    assert_eq!(got[1], 1.0 + 2f32.powi(-6));
    assert_eq!(got[3], f32::INFINITY);
    assert!(got[n - 1].is_nan());

    let f64_src = HashMap::from([(
        x,
        Value::Float(Tensor::new(Shape::new([n]), xs.iter().map(|&v| v as f64).collect::<Vec<f64>>())),
    )]);
    let out = run(&g, &f64_src, &[back]).unwrap();
    let got64 = out[&back].as_float().unwrap().data.clone();
    for (g64, w) in got64.iter().zip(&want).take(n - 1) {
        assert_eq!(*g64, *w as f64);
    }
    assert!(got64[n - 1].is_nan());
}

#[test]
fn cast_gradient_is_straight_through_and_stays_f32() {
    // loss = sum(Cast_bf16(x) * w): d loss / d x = w exactly, in f32, though the forward rounds.
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[4], DType::F32);
    let w = param(&mut g, "w", &[4], DType::F32);
    let xb = cast(&mut g, x, DType::Bf16);
    let prod = g.add(Op::Binary(BinaryOp::Mul), &[xb, w]).unwrap();
    let loss = g.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[prod]).unwrap();
    let grads = grad(&mut g, loss, &[x, w]).unwrap();
    assert_eq!(g.node(grads[0]).dtype, DType::F32);
    assert_eq!(g.node(grads[0]).shape, Shape::new([4]));
    assert_eq!(g.node(grads[1]).dtype, DType::F32);
    g.check().unwrap();

    let xv = vec![1.0 + 2f32.powi(-8), 0.3, -2.5, 7.1];
    let wv = vec![0.1f32, -1.7, 3.3, 0.01];
    let src = HashMap::from([
        (x, Value::Float(Tensor::new(Shape::new([4]), xv.clone()))),
        (w, Value::Float(Tensor::new(Shape::new([4]), wv.clone()))),
    ]);
    let out = run(&g, &src, &[loss, grads[0], grads[1]]).unwrap();
    assert_eq!(out[&grads[0]].as_float().unwrap().data, wv);
    // The weight's gradient sees the rounded activation.
    let rounded: Vec<f32> = xv.iter().map(|&v| round_bf16(v)).collect();
    assert_eq!(out[&grads[1]].as_float().unwrap().data, rounded);
    let want_loss: f32 = rounded.iter().zip(&wv).map(|(a, b)| a * b).sum();
    let got_loss = out[&loss].as_float().unwrap().data[0];
    assert!((got_loss - want_loss).abs() <= 1e-6 * want_loss.abs(), "{got_loss} vs {want_loss}");
}

#[test]
fn gradients_through_a_bf16_matmul_and_gather_are_f32() {
    let mut g = Graph::new();
    let a = param(&mut g, "a", &[2, 3, 4], DType::F32);
    let w = param(&mut g, "w", &[4, 5], DType::F32);
    let ab = cast(&mut g, a, DType::Bf16);
    let wb = cast(&mut g, w, DType::Bf16);
    let y = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[ab, wb]).unwrap();
    let idx = g.add(Op::TopK { k: 2, fixed: 1 }, &[y]).unwrap();
    let yb = cast(&mut g, y, DType::Bf16);
    let picked = g.add(Op::Gather { axis: 2 }, &[yb, idx]).unwrap();
    assert_eq!(g.node(picked).dtype, DType::Bf16);
    let s = g.add(Op::Reduce { op: ReduceOp::Sum, axis: 2, keepdim: false }, &[picked]).unwrap();
    let s = g.add(Op::Reduce { op: ReduceOp::Sum, axis: 1, keepdim: false }, &[s]).unwrap();
    let loss = g.add(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[s]).unwrap();
    let grads = grad(&mut g, loss, &[a, w]).unwrap();
    g.check().unwrap();
    for (&gr, want) in grads.iter().zip([Shape::new([2, 3, 4]), Shape::new([4, 5])]) {
        assert_eq!(g.node(gr).dtype, DType::F32);
        assert_eq!(g.node(gr).shape, want);
    }
    let no_bf16_adjoint = g
        .node_ids()
        .into_iter()
        .filter(|&id| g.node(id).role.region == ir::graph::Region::Backward)
        .all(|id| g.node(id).dtype != DType::Bf16);
    assert!(no_bf16_adjoint, "a backward node holds a bf16 value");
}

/// Op counts of a lowered spec, casts left out.
fn op_counts(spec: &ir::spec::ModelSpec) -> std::collections::BTreeMap<&'static str, usize> {
    let lowered = ir::lower::lower(spec, 2, 8).expect("lowers");
    let mut counts = std::collections::BTreeMap::new();
    for id in lowered.graph.topo_order() {
        let name = lowered.graph.node(id).op.name();
        if name != "cast" {
            *counts.entry(name).or_insert(0) += 1;
        }
    }
    counts
}

/// Under bf16 every scheme lowers to the f32 graph plus casts, the xHC-Flash
/// four-sublayer window included (its mid-window state is stored as bf16 and the
/// window still closes over it).
#[test]
fn bf16_graphs_are_the_f32_graphs_plus_casts() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut specs: Vec<ir::spec::ModelSpec> = ["residual", "mhc", "vwn-r4", "xhc", "xhc-flash", "mtp"]
        .iter()
        .map(|name| ir::spec::load_spec(&dir.join(format!("{name}.ron"))).expect("spec"))
        .collect();
    let mut two_block = specs[4].clone();
    let ir::spec::ResidualSpec::Xhc(x) = &mut two_block.residual else { panic!("xhc-flash is xHC") };
    x.flash = ir::spec::Flash::TwoBlock;
    specs.push(two_block);
    for mut spec in specs {
        (spec.d_model, spec.layers) = (16, 2);
        let f32_counts = op_counts(&spec);
        spec.precision = ir::spec::Precision::Bf16;
        assert_eq!(op_counts(&spec), f32_counts, "{}: {:?}", spec.name, spec.residual);
    }
}
