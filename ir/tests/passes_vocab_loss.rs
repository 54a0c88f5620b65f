//! `passes::fuse_vocab_losses` on every spec's graph (docs/math.md §1.7): each head's
//! output projection and loss, the MTP modules' included, become one
//! `LinearCrossEntropy`; differentiated, the fused graph has no logits-shaped value at
//! all, and its loss and every parameter gradient equal the unfused graph's (f64
//! reference executor).

mod common;

use common::passes::{load, random_sources, shrink, spec_files, training_graph, Rng};
use ir::autodiff::grad;
use ir::exec::run;
use ir::graph::{Graph, NodeId, Op};
use ir::lower::lower;
use ir::passes::fuse_vocab_losses;
use ir::spec::Precision;

const B: usize = 2;
const T: usize = 8;

fn fused_losses(g: &Graph) -> usize {
    g.node_ids().into_iter().filter(|&id| matches!(g.node(id).op, Op::LinearCrossEntropy { .. })).count()
}

#[test]
fn fused_heads_keep_the_loss_and_every_gradient_of_every_spec() {
    let mut with_mtp = false;
    for (seed, path) in spec_files().into_iter().enumerate() {
        let spec = shrink(load(&path));
        let name = spec.name.clone();
        let (unfused, pairs) = training_graph(&spec, B, T);
        let values = random_sources(&unfused, &pairs, spec.vocab, &mut Rng::new(seed as u64 + 3));
        let wanted: Vec<NodeId> = std::iter::once(unfused.loss).chain(pairs.iter().map(|p| p.1)).collect();
        let before = run::<f64>(&unfused.graph, &values, &wanted).unwrap_or_else(|e| panic!("{name}: {e}"));

        let lowered = lower(&spec, B, T).expect("lowers");
        let f32_heads = |heads: usize| if spec.precision == Precision::Bf16 { 0 } else { heads };
        // The main head's logits are an output: only the MTP heads fuse.
        let mut kept = lowered.graph.clone();
        let mtp_only = fuse_vocab_losses(&mut kept).len();
        assert_eq!(mtp_only, f32_heads(spec.mtp.depth), "{name}: a graph that outputs the logits keeps them");
        let mut g = lowered.graph.clone();
        g.remove_output("logits");
        let fused = fuse_vocab_losses(&mut g);
        let expected = f32_heads(1 + spec.mtp.depth);
        assert_eq!(fused.len(), expected, "{name}: one fused loss per head");
        assert_eq!(fused_losses(&g), expected, "{name}");
        with_mtp |= spec.mtp.depth > 0 && expected > 0;
        let loss = fused.iter().find(|&&(old, _)| old == lowered.loss).map_or(lowered.loss, |&(_, new)| new);
        let params = g.params();
        assert_eq!(params, pairs.iter().map(|p| p.0).collect::<Vec<_>>(), "{name}: parameters survive");
        let grads = grad(&mut g, loss, &params).expect("differentiable");
        g.check().unwrap_or_else(|e| panic!("{name}: fused graph: {e}"));
        if expected > 0 {
            // No value of the differentiated graph is a [B, T', V] block of logits.
            for id in g.node_ids() {
                let dims = g.node(id).shape.dims();
                let logits_like = dims.len() == 3 && dims[0] == B && dims[2] == spec.model_vocab();
                assert!(!logits_like, "{name}: %{} ({}) is {dims:?}", id.index(), g.node(id).op.name());
            }
        }
        let after_wanted: Vec<NodeId> = std::iter::once(loss).chain(grads.iter().copied()).collect();
        let after = run::<f64>(&g, &values, &after_wanted).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (want, got) in wanted.iter().zip(&after_wanted) {
            let (x, y) =
                (&before[want].as_float().expect("float").data, &after[got].as_float().expect("float").data);
            assert_eq!(x.len(), y.len(), "{name}");
            for (a, b) in x.iter().zip(y) {
                assert!((a - b).abs() <= 1e-12 * a.abs().max(1.0), "{name}: {a} vs {b}");
            }
        }
    }
    assert!(with_mtp, "no spec has MTP heads to fuse");
}
