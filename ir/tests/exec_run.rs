//! The executor around the kernels: binding checks, constants, evaluating only
//! what the outputs need, and keeping values that are both outputs and operands.

mod common;

use common::exec::{Case, Rng};
use ir::exec::{self, ExecError, Tensor, Value};
use ir::graph::{BinaryOp, NodeId, Op, UnaryOp};
use ir::{DType, Shape};
use std::collections::HashMap;

#[test]
fn unbound_and_misshapen_sources_are_errors_naming_the_node() {
    let mut c = Case::new();
    let x = c.param(&[2, 3], vec![0.0; 6]);
    let tokens = c.g.add_source(Op::Input { name: "tokens".into() }, Shape::new([2]), DType::I32, None);
    let y = c.add(Op::Unary(UnaryOp::Exp), &[x]);
    let table = c.param(&[4, 3], vec![0.0; 12]);
    let emb = c.add(Op::Gather { axis: 0 }, &[table, tokens]);

    let err = c.try_run::<f32>(&[emb]).unwrap_err();
    assert!(matches!(err, ExecError::Unbound { kind: "input", .. }), "{err}");
    assert!(err.to_string().contains("tokens") && err.to_string().contains(&format!("%{}", tokens.index())));

    let mut sources = c.sources::<f64>();
    sources.insert(x, Value::Float(Tensor::zeros(Shape::new([3, 2]))));
    let err = exec::run(&c.g, &sources, &[y]).unwrap_err().to_string();
    assert!(
        err.contains("[3, 2]") && err.contains("[2, 3]") && err.contains(&format!("%{}", x.index())),
        "{err}"
    );

    let mut sources = c.sources::<f64>();
    sources.insert(tokens, Value::Float(Tensor::zeros(Shape::new([2]))));
    let err = exec::run(&c.g, &sources, &[emb]).unwrap_err();
    assert!(matches!(err, ExecError::BoundKind { .. }), "{err}");
    assert!(err.to_string().contains("i32"), "{err}");
}

#[test]
fn only_nodes_the_outputs_need_are_evaluated() {
    let mut c = Case::new();
    let x = c.param(&[2], vec![1.0, 2.0]);
    let y = c.add(Op::Unary(UnaryOp::Square), &[x]);
    // An unbound input on a branch the requested output does not need.
    let other = c.g.add_source(Op::Input { name: "unused".into() }, Shape::new([2]), DType::F32, None);
    let z = c.add(Op::Binary(BinaryOp::Add), &[y, other]);
    assert_eq!(c.eval::<f64>(y), vec![1.0, 4.0]);
    assert!(matches!(c.try_run::<f64>(&[z]), Err(ExecError::Unbound { .. })));
}

#[test]
fn constants_fill_their_shape() {
    let mut c = Case::new();
    let x = c.param(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let k = c.g.add_source(Op::Constant { value: 0.5 }, Shape::new([2, 1]), DType::F32, None);
    let y = c.add(Op::Binary(BinaryOp::Mul), &[x, k]);
    assert_eq!(c.eval::<f32>(y), vec![0.5, 1.0, 1.5, 2.0]);
    let idx = c.g.add_source(Op::Constant { value: 1.0 }, Shape::new([3]), DType::I32, None);
    let rows = c.add(Op::Gather { axis: 0 }, &[x, idx]);
    assert_eq!(c.eval::<f64>(rows), vec![3.0, 4.0, 3.0, 4.0, 3.0, 4.0]);
}

#[test]
fn values_that_are_outputs_and_operands_survive() {
    let mut rng = Rng::new(40);
    let mut c = Case::new();
    let x = c.param(&[5], rng.normals(5));
    let a = c.add(Op::Unary(UnaryOp::Exp), &[x]);
    let b = c.add(Op::Binary(BinaryOp::Add), &[a, a]);
    let d = c.add(Op::Binary(BinaryOp::Mul), &[b, a]);
    let values = c.try_run::<f64>(&[d, a, x, a]).unwrap();
    assert_eq!(values.len(), 3);
    let get = |id: NodeId| values[&id].as_float().unwrap().data.clone();
    let xs = c.get(x).to_vec();
    assert_eq!(get(x), xs);
    let exps: Vec<f64> = xs.iter().map(|v| v.exp()).collect();
    assert_eq!(get(a), exps);
    assert_eq!(get(d), exps.iter().map(|e| (e + e) * e).collect::<Vec<_>>());
}

#[test]
fn unknown_output_node_is_an_error() {
    let c = Case::new();
    let missing = NodeId::new(7);
    let err = exec::run::<f32>(&c.g, &HashMap::new(), &[missing]).unwrap_err();
    assert!(matches!(err, ExecError::UnknownNode { node: 7 }), "{err}");
}
