//! MoE load balancing in the lowering (docs/math.md §1.6, "Load balancing"): the expert
//! loads every MoE sublayer reports, the auxiliary balance loss against the test's own
//! computation from the router's gates and choices, its gradient by central differences
//! through the router (f64, Dense and Sparse dispatch, both gates), gradient descent on it
//! spreading a router that sends every token to one expert, and the loss-free bias, which
//! moves the top-k choice but not the gates and gets no gradient.

mod common;

use common::exec::Rng;
use common::moe::{param_name, sources};
use ir::autodiff::grad;
use ir::exec::{run, Tensor, Value};
use ir::graph::{NodeId, Op};
use ir::lower::{expert_load_output, lower, router_bias_param, Lowered, MOE_AUX_LOSS_OUTPUT};
use ir::spec::{
    AuxLossScope, AuxLossSpec, BiasUpdateSpec, FfnSpec, ModelSpec, MoeBalance, MoeDispatch, MoeGate, MoeSpec,
    TrainSpec,
};
use std::collections::HashMap;

const B: usize = 2;
const T: usize = 5;
const E: usize = 4;
const K: usize = 2;

fn model(gate: MoeGate, dispatch: MoeDispatch, balance: MoeBalance) -> ModelSpec {
    ModelSpec {
        vocab: 11,
        d_model: 8,
        layers: 2,
        heads: 2,
        ffn: FfnSpec::Moe(MoeSpec {
            experts: E,
            top_k: K,
            shared: 1,
            hidden: 3,
            gate,
            dispatch,
            capacity_factor: None,
            balance,
            renormalize: false,
        }),
        train: TrainSpec { seq_len: T, ..TrainSpec::default() },
        ..ModelSpec::default()
    }
}

fn aux(coef: f64) -> MoeBalance {
    MoeBalance::AuxLoss(AuxLossSpec { coef, ..Default::default() })
}

fn seq_aux(coef: f64) -> MoeBalance {
    MoeBalance::AuxLoss(AuxLossSpec { coef, per: AuxLossScope::Sequence })
}

fn output(l: &Lowered, name: &str) -> NodeId {
    l.graph.output(name).unwrap_or_else(|| panic!("no graph output {name}"))
}

fn floats(v: &HashMap<NodeId, Value<f64>>, node: NodeId) -> Vec<f64> {
    v[&node].as_float().expect("float").data.clone()
}

/// The routing nodes of each MoE sublayer, in order: (TopK input, TopK output).
fn routing_nodes(l: &Lowered) -> Vec<(NodeId, NodeId)> {
    let mut found: Vec<(NodeId, NodeId)> = l
        .graph
        .node_ids()
        .into_iter()
        .filter(|&id| matches!(l.graph.node(id).op, Op::TopK { k: K, fixed: 0 }))
        .map(|id| (l.graph.inputs(id)[0], id))
        .collect();
    found.sort();
    found
}

#[test]
fn every_moe_sublayer_reports_its_loads_and_the_aux_loss_is_its_definition() {
    for gate in [MoeGate::Softmax, MoeGate::Sigmoid] {
        let coef = 0.3;
        let l = lower(&model(gate, MoeDispatch::Dense, aux(coef)), B, T).unwrap();
        assert_eq!(l.moe_layers, ["blocks.0.ffn", "blocks.1.ffn"]);
        let mut want_stats: Vec<String> = l.moe_layers.iter().map(|p| expert_load_output(p)).collect();
        want_stats.push(MOE_AUX_LOSS_OUTPUT.into());
        assert_eq!(l.statistics, want_stats);

        let routing = routing_nodes(&l);
        assert_eq!(routing.len(), 2);
        let loss = output(&l, "loss");
        let aux_out = output(&l, MOE_AUX_LOSS_OUTPUT);
        let loads: Vec<NodeId> = l.moe_layers.iter().map(|p| output(&l, &expert_load_output(p))).collect();
        let mut outs = vec![l.loss, loss, aux_out];
        outs.extend(&loads);
        outs.extend(routing.iter().flat_map(|&(p, c)| [p, c]));
        let v = run(&l.graph, &sources(&l, 3), &outs).unwrap();

        let n = B * T;
        let mut want_aux = 0.0;
        for (layer, &(probs, chosen)) in routing.iter().enumerate() {
            let probs = floats(&v, probs);
            let chosen = v[&chosen].as_int().expect("int").data.clone();
            let mut load = [0.0; E];
            for &c in &chosen {
                load[c as usize] += 1.0;
            }
            assert_eq!(floats(&v, loads[layer]), load, "{gate:?} layer {layer}");
            assert_eq!(load.iter().sum::<f64>(), (n * K) as f64);
            let mut mean_share = [0.0; E];
            for row in probs.chunks(E) {
                let total: f64 = row.iter().sum();
                for (e, p) in row.iter().enumerate() {
                    mean_share[e] += p / total / n as f64;
                }
            }
            let sum: f64 = (0..E).map(|e| load[e] / (n * K) as f64 * mean_share[e]).sum();
            want_aux += coef * E as f64 * sum;
        }
        let got_aux = floats(&v, aux_out)[0];
        assert!((got_aux - want_aux).abs() < 1e-12, "{gate:?}: aux {got_aux} vs {want_aux}");
        // The objective adds it; the reported loss does not hold it.
        let (objective, reported) = (floats(&v, l.loss)[0], floats(&v, loss)[0]);
        assert!((objective - (reported + got_aux)).abs() < 1e-12, "{objective} vs {reported} + {got_aux}");
        assert!(got_aux > 0.1 * coef, "{gate:?}: the aux loss {got_aux} is near coef = {coef} at init");
    }
}

/// DeepSeek-V3's sequence-wise form (`per: Sequence`) against the test's own computation:
/// each sequence's loads and mean gate shares over its own T tokens, the B losses averaged;
/// the same number whether asked for as an `AuxLoss` or beside the bias update
/// (`seq_aux_coef`, at a zero bias the same choice). It differs from the batch form, which
/// pools the sequences, unless there is one sequence.
#[test]
fn sequence_wise_aux_loss_is_its_definition() {
    for gate in [MoeGate::Softmax, MoeGate::Sigmoid] {
        let coef = 0.3;
        let l = lower(&model(gate, MoeDispatch::Dense, seq_aux(coef)), B, T).unwrap();
        let routing = routing_nodes(&l);
        let aux_out = output(&l, MOE_AUX_LOSS_OUTPUT);
        let loss = output(&l, "loss");
        let outs: Vec<NodeId> =
            [l.loss, loss, aux_out].into_iter().chain(routing.iter().flat_map(|&(p, c)| [p, c])).collect();
        let v = run(&l.graph, &sources(&l, 3), &outs).unwrap();
        let mut want = 0.0;
        for &(probs, chosen) in &routing {
            let probs = floats(&v, probs);
            let chosen = v[&chosen].as_int().expect("int").data.clone();
            for seq in 0..B {
                let mut load = [0.0; E];
                for &c in &chosen[seq * T * K..(seq + 1) * T * K] {
                    load[c as usize] += 1.0;
                }
                let mut mean_share = [0.0; E];
                for row in probs[seq * T * E..(seq + 1) * T * E].chunks(E) {
                    let total: f64 = row.iter().sum();
                    for (e, p) in row.iter().enumerate() {
                        mean_share[e] += p / total / T as f64;
                    }
                }
                let sum: f64 = (0..E).map(|e| load[e] / (T * K) as f64 * mean_share[e]).sum();
                want += coef * E as f64 * sum / B as f64;
            }
        }
        let got = floats(&v, aux_out)[0];
        assert!((got - want).abs() < 1e-12, "{gate:?}: sequence-wise aux {got} vs {want}");
        let (objective, reported) = (floats(&v, l.loss)[0], floats(&v, loss)[0]);
        assert!((objective - (reported + got)).abs() < 1e-12, "{objective} vs {reported} + {got}");

        // Beside the bias update: the same loss in the objective.
        let biased = BiasUpdateSpec { rate: 0.01, seq_aux_coef: coef };
        let lb = lower(&model(gate, MoeDispatch::Dense, MoeBalance::BiasUpdate(biased)), B, T).unwrap();
        let vb = run(&lb.graph, &sources(&lb, 3), &[output(&lb, MOE_AUX_LOSS_OUTPUT)]).unwrap();
        let beside = floats(&vb, output(&lb, MOE_AUX_LOSS_OUTPUT))[0];
        assert!((beside - got).abs() < 1e-12, "{gate:?}: beside the bias {beside} vs {got}");

        // Pooled over the batch it is another number.
        let lp = lower(&model(gate, MoeDispatch::Dense, aux(coef)), B, T).unwrap();
        let vp = run(&lp.graph, &sources(&lp, 3), &[output(&lp, MOE_AUX_LOSS_OUTPUT)]).unwrap();
        let pooled = floats(&vp, output(&lp, MOE_AUX_LOSS_OUTPUT))[0];
        assert!((pooled - got).abs() > 1e-6, "{gate:?}: batch {pooled} vs sequence {got}");
        // With one sequence the two forms are the same loss.
        let one = |balance| {
            let l = lower(&model(gate, MoeDispatch::Dense, balance), 1, T).unwrap();
            let v = run(&l.graph, &sources(&l, 3), &[output(&l, MOE_AUX_LOSS_OUTPUT)]).unwrap();
            floats(&v, output(&l, MOE_AUX_LOSS_OUTPUT))[0]
        };
        let (batch, sequence) = (one(aux(coef)), one(seq_aux(coef)));
        assert!(
            (batch - sequence).abs() <= 1e-12 * batch.abs(),
            "{gate:?}: one sequence {batch} vs {sequence}"
        );
    }
}

#[test]
fn without_aux_loss_the_objective_is_the_reported_loss() {
    for balance in [MoeBalance::None, MoeBalance::BiasUpdate(BiasUpdateSpec::default())] {
        let l = lower(&model(MoeGate::Sigmoid, MoeDispatch::Dense, balance), B, T).unwrap();
        assert_eq!(Some(l.loss), l.graph.output("loss"));
        assert!(l.graph.output(MOE_AUX_LOSS_OUTPUT).is_none());
        assert_eq!(l.statistics.len(), 2);
    }
    // A model without MoE has no statistics at all.
    let l = lower(&ModelSpec { d_model: 8, heads: 2, layers: 1, ..ModelSpec::default() }, 1, 4).unwrap();
    assert!(l.moe_layers.is_empty() && l.statistics.is_empty());
}

/// The objective and its gradient with respect to every parameter, by name.
fn objective_and_grads(spec: &ModelSpec, seed: u64) -> (f64, HashMap<String, Vec<f64>>) {
    let mut l = lower(spec, B, T).unwrap();
    let params = l.graph.params();
    let grads = grad(&mut l.graph, l.loss, &params).unwrap();
    let v = run(&l.graph, &sources(&l, seed), &[vec![l.loss], grads.clone()].concat()).unwrap();
    let by_name = params.iter().zip(&grads).map(|(&p, g)| (param_name(&l, p), floats(&v, *g))).collect();
    (floats(&v, l.loss)[0], by_name)
}

#[test]
fn aux_loss_gradient_matches_central_differences_through_the_router() {
    for (gate, dispatch, balance) in [
        (MoeGate::Softmax, MoeDispatch::Dense, aux(0.5)),
        (MoeGate::Sigmoid, MoeDispatch::Dense, aux(0.5)),
        (MoeGate::Sigmoid, MoeDispatch::Sparse, aux(0.5)),
        (MoeGate::Softmax, MoeDispatch::Sparse, seq_aux(0.5)),
        (MoeGate::Sigmoid, MoeDispatch::Dense, seq_aux(0.5)),
    ] {
        let what = format!("{gate:?} {dispatch:?} {balance:?}");
        let spec = model(gate, dispatch, balance);
        let mut l = lower(&spec, B, T).unwrap();
        let params = l.graph.params();
        let grads = grad(&mut l.graph, l.loss, &params).unwrap();
        let base = sources(&l, 41);
        let v = run(&l.graph, &base, &[vec![l.loss], grads.clone()].concat()).unwrap();
        let objective_at =
            |src: &HashMap<NodeId, Value<f64>>| floats(&run(&l.graph, src, &[l.loss]).unwrap(), l.loss)[0];
        let eps = 1e-6;
        let mut checked = 0;
        for (&p, g) in params.iter().zip(&grads) {
            let name = param_name(&l, p);
            if !name.ends_with("ffn.router") {
                continue;
            }
            let analytic = floats(&v, *g);
            let n = analytic.len();
            for i in [0, 1, n / 3, n / 2, n - 2, n - 1] {
                let at = |by: f64| {
                    let mut src = base.clone();
                    if let Some(Value::Float(t)) = src.get_mut(&p) {
                        t.data[i] += by;
                    }
                    objective_at(&src)
                };
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
                let tol = 1e-6 * numeric.abs().max(analytic[i].abs()).max(1e-2);
                assert!(
                    (numeric - analytic[i]).abs() <= tol,
                    "{what}: d {name}[{i}]: analytic {} vs numeric {numeric}",
                    analytic[i]
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 2 * 6, "{what}");

        // The aux loss reaches the router: its gradient differs from the unbalanced one.
        // It does not reach what no router reads (the experts, the last block's FFN
        // output onward), where both objectives are the same function.
        let (_, with) = objective_and_grads(&spec, 41);
        let (_, without) = objective_and_grads(&model(gate, dispatch, MoeBalance::None), 41);
        let router = "blocks.0.ffn.router";
        let diff = with[router].iter().zip(&without[router]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(diff > 1e-4, "{what}: the aux loss changes d {router} by only {diff}");
        let last = |n: &str| n.starts_with("blocks.1.ffn.experts.") || n.starts_with("blocks.1.ffn.shared.");
        let names: Vec<&String> =
            without.keys().filter(|n| last(n) || *n == "unembed" || *n == "final_norm").collect();
        assert_eq!(names.len(), 8, "{what}: {names:?}");
        for name in names {
            let same = with[name].iter().zip(&without[name]).all(|(a, b)| (a - b).abs() < 1e-12);
            assert!(same, "{what}: the aux loss reaches {name}, which feeds no gate");
        }
    }
}

#[test]
fn aux_loss_is_the_same_for_dense_and_sparse_dispatch() {
    let (dense, dg) = objective_and_grads(&model(MoeGate::Sigmoid, MoeDispatch::Dense, aux(0.2)), 5);
    let (sparse, sg) = objective_and_grads(&model(MoeGate::Sigmoid, MoeDispatch::Sparse, aux(0.2)), 5);
    assert!((dense - sparse).abs() <= 1e-12 * dense.abs(), "{sparse} vs {dense}");
    for (name, want) in &dg {
        let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (a, b) in sg[name].iter().zip(want) {
            assert!((a - b).abs() <= 1e-10 * scale, "d {name}: sparse {a} vs dense {b}");
        }
    }
}

/// The value of every named output of `spec`'s graph with the given router biases.
fn run_with_bias(spec: &ModelSpec, bias: &[f64], names: &[&str]) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut l = lower(spec, B, T).unwrap();
    let params = l.graph.params();
    let grads = grad(&mut l.graph, l.loss, &params).unwrap();
    let mut src = sources(&l, 9);
    for prefix in &l.moe_layers {
        if let Some(p) = l.graph.param_by_name(&router_bias_param(prefix)) {
            src.insert(p, Value::Float(Tensor::new(l.graph.node(p).shape.clone(), bias.to_vec())));
        }
    }
    let nodes: Vec<NodeId> = names.iter().map(|n| output(&l, n)).collect();
    let v = run(&l.graph, &src, &[nodes.clone(), grads.clone()].concat()).unwrap();
    let bias_grads = params
        .iter()
        .zip(&grads)
        .filter(|&(&p, _)| param_name(&l, p).ends_with("router_bias"))
        .map(|(_, g)| floats(&v, *g))
        .collect();
    (nodes.iter().map(|&n| floats(&v, n)).collect(), bias_grads)
}

#[test]
fn router_bias_moves_the_choice_but_not_the_gates_and_gets_no_gradient() {
    let names = ["loss", "blocks.0.ffn.expert_load", "blocks.1.ffn.expert_load"];
    for gate in [MoeGate::Softmax, MoeGate::Sigmoid] {
        let biased = model(
            gate,
            MoeDispatch::Dense,
            MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 0.01, ..Default::default() }),
        );
        let plain = model(gate, MoeDispatch::Dense, MoeBalance::None);
        let l = lower(&biased, B, T).unwrap();
        for prefix in &l.moe_layers {
            let p = l.graph.param_by_name(&router_bias_param(prefix)).expect("a router bias");
            assert_eq!(l.graph.node(p).shape.dims(), [E]);
        }
        let (reference, _) = run_with_bias(&plain, &[], &names);
        // A zero bias, or one shifting every expert alike, keeps the choice: the same loss
        // bit for bit, so the gates are the unbiased scores.
        for shift in [0.0, 3.0] {
            let (got, bias_grads) = run_with_bias(&biased, &[shift; E], &names);
            assert_eq!(got, reference, "{gate:?}: a bias of {shift} on every expert");
            assert_eq!(bias_grads.len(), 2);
            assert!(bias_grads.iter().flatten().all(|&g| g == 0.0), "{gate:?}: {bias_grads:?}");
        }
        // A bias that makes expert 2 win puts it in every token's top-k; expert 2 ranks
        // first, so the other slot goes to the best of the rest.
        let (got, _) = run_with_bias(&biased, &[0.0, 0.0, 5.0, 0.0], &names);
        for layer in [1, 2] {
            assert_eq!(got[layer][2], (B * T) as f64, "{gate:?}: {:?}", got[layer]);
            assert_eq!(got[layer].iter().sum::<f64>(), (B * T * K) as f64);
        }
        assert_ne!(got[0], reference[0], "{gate:?}: another choice, another loss");
    }
}

/// Gradient descent on layer 0's router of a one-block model in which every token picks
/// expert 0 (the embedding rows share a large first coordinate that the router reads for
/// expert 0, through a unit norm gain): the loads of layer 0 after each of `steps` steps of `lr`.
fn descend_on_a_skewed_router(balance: MoeBalance, steps: usize, lr: f64) -> Vec<Vec<f64>> {
    let mut spec = model(MoeGate::Softmax, MoeDispatch::Dense, balance);
    spec.layers = 1;
    let mut l = lower(&spec, B, T).unwrap();
    let router = l.graph.param_by_name("blocks.0.ffn.router").unwrap();
    let embed = l.graph.param_by_name("embed").unwrap();
    let d_router = grad(&mut l.graph, l.loss, &[router]).unwrap()[0];
    let load = output(&l, &expert_load_output("blocks.0.ffn"));
    let mut src = sources(&l, 17);
    let mut rng = Rng::new(5);
    let (d, e) = (spec.d_model, E);
    let mut w: Vec<f64> = (0..d * e).map(|i| if i == 0 { 1.0 } else { 0.1 * rng.normal() }).collect();
    if let Some(Value::Float(t)) = src.get_mut(&embed) {
        t.data.iter_mut().step_by(d).for_each(|x| *x = 3.0);
    }
    let gain = l.graph.param_by_name("blocks.0.ffn.norm").unwrap();
    src.insert(gain, Value::Float(Tensor::new(l.graph.node(gain).shape.clone(), vec![1.0; d])));
    let mut loads = Vec::new();
    for _ in 0..=steps {
        src.insert(router, Value::Float(Tensor::new(l.graph.node(router).shape.clone(), w.clone())));
        let v = run(&l.graph, &src, &[load, d_router]).unwrap();
        loads.push(floats(&v, load));
        for (w, g) in w.iter_mut().zip(floats(&v, d_router)) {
            *w -= lr * g;
        }
    }
    loads
}

#[test]
fn aux_loss_descent_spreads_the_load_of_a_skewed_router() {
    let n = (B * T) as f64;
    let balanced = descend_on_a_skewed_router(aux(1.0), 100, 0.1);
    let unbalanced = descend_on_a_skewed_router(MoeBalance::None, 100, 0.1);
    for loads in [&balanced, &unbalanced] {
        assert_eq!(loads[0][0], n, "every token starts on expert 0: {:?}", loads[0]);
    }
    // The max load over the last 20 steps (the choice flips between steps near the even load).
    let late_max = |loads: &[Vec<f64>]| {
        let tail = &loads[loads.len() - 20..];
        tail.iter().map(|l| l.iter().copied().fold(0.0, f64::max)).sum::<f64>() / tail.len() as f64
    };
    let (with, without) = (late_max(&balanced), late_max(&unbalanced));
    assert!(with <= 0.75 * n, "the aux loss leaves a max load of {with} of {n}: {balanced:?}");
    assert!(without >= 0.9 * n, "without balancing expert 0 keeps its {without} of {n}");
}
