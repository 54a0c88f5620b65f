//! Whole-model gradients (docs/architecture.md §9.2): every spec in `specs/` lowers to a graph
//! that autodiff differentiates with respect to every parameter, and at tiny sizes the
//! gradients match central differences of the f64 reference executor.

mod common;

use common::passes::{load, shrink, spec_files, Rng};
use ir::autodiff::grad;
use ir::exec::{run, Tensor, Value};
use ir::graph::{Graph, NodeId, Op, Region};
use ir::lower::{lower, Lowered};
use std::collections::HashMap;

const B: usize = 1;
const T: usize = 4;

/// Appends the backward pass for every parameter and checks its types.
fn differentiate(lowered: &mut Lowered) -> Vec<(NodeId, NodeId)> {
    let params = lowered.graph.params();
    let grads = grad(&mut lowered.graph, lowered.loss, &params).unwrap_or_else(|e| panic!("autodiff: {e}"));
    lowered.graph.check().unwrap_or_else(|e| panic!("backward graph: {e}"));
    for (&p, &g) in params.iter().zip(&grads) {
        assert_eq!(lowered.graph.node(g).shape, lowered.graph.node(p).shape);
    }
    params.into_iter().zip(grads).collect()
}

#[test]
fn every_spec_differentiates_with_respect_to_every_parameter() {
    for path in spec_files() {
        let spec = load(&path);
        let mut lowered = lower(&spec, B, T).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let forward = lowered.graph.node_count();
        let pairs = differentiate(&mut lowered);
        let g = &lowered.graph;
        let backward: Vec<NodeId> = g.node_ids().into_iter().skip(forward).collect();
        assert!(!backward.is_empty());
        assert!(backward.iter().all(|&id| g.node(id).role.region == Region::Backward), "{}", path.display());
        // Every parameter the loss reads gets a computed gradient, not a zero constant;
        // except the MoE router bias, which only shifts the top-k choice (docs/math.md
        // §1.6) and must get none.
        for (p, gp) in pairs {
            assert_ne!(gp, p);
            let name = param_name(g, p);
            let trained = match &g.node(p).op {
                Op::Param(info) => info.class.optimized(),
                other => panic!("not a parameter: {}", other.name()),
            };
            assert_eq!(
                !matches!(g.node(gp).op, Op::Constant { .. }),
                trained,
                "{}: {name} should {}have a gradient path",
                path.display(),
                if trained { "" } else { "not " }
            );
        }
    }
}

fn param_name(g: &Graph, p: NodeId) -> String {
    match &g.node(p).op {
        Op::Param(info) => info.name.clone(),
        other => other.name().to_string(),
    }
}

fn loss_value(g: &Graph, values: &HashMap<NodeId, Value<f64>>, loss: NodeId) -> f64 {
    let out = run::<f64>(g, values, &[loss]).unwrap_or_else(|e| panic!("forward: {e}"));
    out[&loss].as_float().expect("float loss").data[0]
}

/// Central differences on a few random elements of every parameter of every spec.
#[test]
fn every_spec_matches_central_differences_at_tiny_size() {
    const STEP: f64 = 1e-5;
    for (seed, path) in spec_files().into_iter().enumerate() {
        let mut spec = shrink(load(&path));
        // bf16 rounding is piecewise constant, so central differences cannot see through it;
        // its straight-through rule is tested on its own (tests/mixed_precision.rs) and the
        // rest of the model's math is checked here in f32 (docs/math.md §6.12).
        spec.precision = ir::spec::Precision::F32;
        let mut lowered = lower(&spec, B, T).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let pairs = differentiate(&mut lowered);
        let (g, loss) = (&lowered.graph, lowered.loss);
        let mut rng = Rng::new(seed as u64);
        let mut values: HashMap<NodeId, Value<f64>> = HashMap::new();
        for &(p, _) in &pairs {
            let shape = g.node(p).shape.clone();
            let data = (0..shape.numel()).map(|_| 0.5 * rng.signed()).collect();
            values.insert(p, Value::Float(Tensor::new(shape, data)));
        }
        let tokens = (0..B * (T + 1)).map(|_| rng.below(spec.vocab) as i32).collect();
        values.insert(lowered.tokens, Value::Int(Tensor::new(g.node(lowered.tokens).shape.clone(), tokens)));
        let grads: Vec<NodeId> = pairs.iter().map(|&(_, gp)| gp).collect();
        let analytic = run::<f64>(g, &values, &grads).unwrap_or_else(|e| panic!("backward: {e}"));
        let mut largest: f64 = 0.0;
        for &(p, gp) in &pairs {
            // A constant table is never trained and gets no gradient (docs/math.md §12.2).
            if matches!(&g.node(p).op, Op::Param(info) if info.class == ir::graph::ParamClass::Table) {
                continue;
            }
            let a_all = analytic[&gp].as_float().expect("float gradient").data.clone();
            for _ in 0..2 {
                let i = rng.below(a_all.len());
                let x0 = values[&p].as_float().expect("float").data[i];
                let mut at = |x: f64| {
                    let Some(Value::Float(t)) = values.get_mut(&p) else { unreachable!("float param") };
                    t.data[i] = x;
                    loss_value(g, &values, loss)
                };
                let numeric = (at(x0 + STEP) - at(x0 - STEP)) / (2.0 * STEP);
                let Some(Value::Float(t)) = values.get_mut(&p) else { unreachable!("float param") };
                t.data[i] = x0;
                let a = a_all[i];
                assert!(
                    (a - numeric).abs() <= 1e-6 * a.abs().max(numeric.abs()) + 1e-8,
                    "{}: d loss / d {}[{i}]: autodiff {a}, central difference {numeric}",
                    path.display(),
                    param_name(g, p)
                );
                largest = largest.max(a.abs());
            }
        }
        assert!(largest > 1e-4, "{}: all sampled gradients are near zero", path.display());
    }
}
