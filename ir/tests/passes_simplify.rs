//! `passes::simplify` (CSE + DCE) on every spec's training graph: the loss and every
//! parameter gradient are unchanged (f64 reference executor), and nodes are removed.

mod common;

use common::passes::{load, shrink, spec_files, training_graph, Reference};
use ir::graph::{NodeId, Op, UnaryOp};
use ir::passes::simplify;

#[test]
fn simplify_keeps_loss_and_gradients_of_every_spec() {
    let mut shrunk_somewhere = false;
    for (seed, path) in spec_files().into_iter().enumerate() {
        let reference = Reference::of(&path, seed as u64 + 1);
        let mut simplified = reference.lowered.graph.clone();
        let stats = simplify(&mut simplified, &reference.grads);
        assert_eq!(stats.nodes_after, simplified.node_count());
        assert_eq!(stats.nodes_before - stats.cse_merged - stats.dce_removed, stats.nodes_after);
        shrunk_somewhere |= stats.cse_merged > 0 && stats.nodes_after < stats.nodes_before;
        reference.assert_kept_by(&simplified, 1e-12);
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
