//! `passes::simplify` (CSE + DCE) on every spec's training graph: the loss and every
//! parameter gradient are unchanged (f64 reference executor), and nodes are removed.

mod passes_util;

use ir::exec::{run, Tensor, Value};
use ir::graph::{NodeId, Op, UnaryOp};
use ir::passes::simplify;
use passes_util::{load, name, shrink, spec_files, training_graph, Rng};
use std::collections::HashMap;

const B: usize = 2;
const T: usize = 8;

#[test]
fn simplify_keeps_loss_and_gradients_of_every_spec() {
    let mut shrunk_somewhere = false;
    for (seed, path) in spec_files().into_iter().enumerate() {
        let spec = shrink(load(&path));
        let (lowered, pairs) = training_graph(&spec, B, T);
        let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
        let mut wanted = vec![lowered.loss];
        wanted.extend(&grads);

        let mut rng = Rng::new(seed as u64 + 1);
        let g = &lowered.graph;
        let mut values: HashMap<NodeId, Value<f64>> = HashMap::new();
        for &(p, _) in &pairs {
            let shape = g.node(p).shape.clone();
            let data = (0..shape.numel()).map(|_| 0.5 * rng.signed()).collect();
            values.insert(p, Value::Float(Tensor::new(shape, data)));
        }
        let tokens = (0..B * (T + 1)).map(|_| rng.below(spec.vocab) as i32).collect();
        values.insert(lowered.tokens, Value::Int(Tensor::new(g.node(lowered.tokens).shape.clone(), tokens)));
        let before = run::<f64>(g, &values, &wanted).unwrap_or_else(|e| panic!("{}: {e}", name(&path)));

        let mut simplified = lowered.graph.clone();
        let stats = simplify(&mut simplified, &grads);
        simplified.check().unwrap_or_else(|e| panic!("{}: simplified graph: {e}", name(&path)));
        assert_eq!(stats.nodes_after, simplified.node_count());
        assert_eq!(stats.nodes_before - stats.cse_merged - stats.dce_removed, stats.nodes_after);
        assert_eq!(simplified.params(), lowered.graph.params(), "{}: parameters must survive", name(&path));
        shrunk_somewhere |= stats.cse_merged > 0 && stats.nodes_after < stats.nodes_before;

        let after =
            run::<f64>(&simplified, &values, &wanted).unwrap_or_else(|e| panic!("{}: {e}", name(&path)));
        for id in &wanted {
            let (x, y) =
                (&before[id].as_float().expect("float").data, &after[id].as_float().expect("float").data);
            assert_eq!(x.len(), y.len());
            for (a, b) in x.iter().zip(y) {
                assert!(
                    (a - b).abs() <= 1e-12 * a.abs().max(1.0),
                    "{}: n{} changed: {a} vs {b}",
                    name(&path),
                    id.index()
                );
            }
        }
    }
    assert!(shrunk_somewhere, "CSE found nothing to merge in any spec");
}

#[test]
fn dce_removes_what_no_root_needs_and_cse_redirects_outputs() {
    let spec = shrink(load(&spec_files()[0]));
    let (mut lowered, pairs) = training_graph(&spec, 1, 4);
    let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
    let g = &mut lowered.graph;
    let dead = g.add(Op::Unary(UnaryOp::Exp), &[lowered.logits]).unwrap();
    let dead2 = g.add(Op::Unary(UnaryOp::Tanh), &[dead]).unwrap();
    // A duplicate of the loss, named as an output: CSE merges it and keeps the name.
    let loss_inputs = g.inputs(lowered.loss);
    let twin = g.add(g.node(lowered.loss).op.clone(), &loss_inputs).unwrap();
    g.set_output("twin", twin);
    let stats = simplify(g, &grads);
    assert!(stats.dce_removed >= 2);
    assert!(!g.node_ids().contains(&dead) && !g.node_ids().contains(&dead2));
    assert_eq!(g.output("twin"), g.output("loss"));
    assert!(!g.node_ids().contains(&twin));
    for gr in grads {
        assert!(g.node_ids().contains(&gr), "gradient n{} was removed", gr.index());
    }
}
