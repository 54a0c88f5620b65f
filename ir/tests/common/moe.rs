//! MoE model fixtures (docs/math.md §1.6): parameters bound by name, so that two
//! lowerings of one model (Dense and Sparse dispatch, with and without balancing) get
//! the same values, and one token window over a vocabulary of 11.
use crate::common::exec::Rng;
use ir::exec::{Tensor, Value};
use ir::graph::{NodeId, Op};
use ir::lower::Lowered;
use std::collections::HashMap;

/// The name of parameter node `p`.
pub fn param_name(l: &Lowered, p: NodeId) -> String {
    match &l.graph.node(p).op {
        Op::Param(info) => info.name.clone(),
        other => panic!("not a parameter: {}", other.name()),
    }
}

/// Values keyed by parameter name (so two lowerings get the same parameters; a router
/// bias starts at zero, as its init says) and one token window.
pub fn sources(l: &Lowered, seed: u64) -> HashMap<NodeId, Value<f64>> {
    let mut values = HashMap::new();
    for p in l.graph.params() {
        let name = param_name(l, p);
        let h = name
            .bytes()
            .fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let mut rng = Rng::new(h);
        let shape = l.graph.node(p).shape.clone();
        let data = if name.ends_with("router_bias") {
            vec![0.0; shape.numel()]
        } else {
            (0..shape.numel()).map(|_| 0.5 * rng.normal()).collect()
        };
        values.insert(p, Value::Float(Tensor::new(shape, data)));
    }
    let mut rng = Rng::new(seed);
    let shape = l.graph.node(l.tokens).shape.clone();
    let tokens = (0..shape.numel()).map(|_| rng.below(11) as i32).collect();
    values.insert(l.tokens, Value::Int(Tensor::new(shape, tokens)));
    values
}
