//! Tiny models on the f64 reference executor, shared by the whole-model gradient checks
//! and the MTP alignment tests: a spec at gradient-check size, its parameters drawn from
//! their `Init` rules and then perturbed, and random token windows.

use ir::exec::{Tensor, Value};
use ir::graph::{Graph, NodeId};
use ir::spec::{FfnSpec, ModelSpec, ResidualSpec, SwiGluSpec};
use runtime::init::init_params;
use runtime::rng::Rng;
use std::collections::HashMap;

/// A one-block model at gradient-check size: V = 11, D = 8, H = 2, SwiGLU width 8.
pub fn tiny_spec(name: &str, residual: ResidualSpec) -> ModelSpec {
    ModelSpec {
        name: name.into(),
        vocab: 11,
        d_model: 8,
        layers: 1,
        heads: 2,
        ffn: FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(8) }),
        residual,
        ..ModelSpec::default()
    }
}

/// Every parameter of `graph` at its `Init` value under `seed` (drawn in f32 by
/// `runtime::init`, widened to f64), plus `noise`·N(0, 1) on every element. The noise
/// moves zero-initialized generators and identity-initialized mixings off their special
/// points, where whole terms of the gradient vanish and would go unchecked.
pub fn perturbed_params(graph: &Graph, seed: u64, noise: f64) -> HashMap<NodeId, Value<f64>> {
    let params = init_params(graph, seed).unwrap_or_else(|e| panic!("init: {e}"));
    let mut rng = Rng::stream(seed, "test.perturbation");
    params
        .iter()
        .map(|p| {
            let data = p.value.iter().map(|&v| f64::from(v) + noise * rng.normal()).collect();
            (p.node, Value::Float(Tensor::new(p.shape.clone(), data)))
        })
        .collect()
}

/// A uniformly random token window of `graph`'s token shape.
pub fn random_window(graph: &Graph, tokens: NodeId, vocab: usize, rng: &mut Rng) -> Value<f64> {
    let shape = graph.node(tokens).shape.clone();
    let ids = (0..shape.numel()).map(|_| rng.below(vocab as u64) as i32).collect();
    Value::Int(Tensor::new(shape, ids))
}
