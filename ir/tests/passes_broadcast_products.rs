//! `passes::narrow_broadcast_products` on every spec's training graph: the
//! first sublayer's coefficient projection over the embedding broadcast to
//! the streams, and its weight gradient, are taken at the embedding's width;
//! the loss and every parameter gradient keep their values (f64 reference
//! executor), and no product reads the broadcast any more.

mod common;

use common::passes::{load, name, shrink, spec_files, training_graph, Reference};
use ir::graph::{Graph, NodeId, Op};
use ir::passes::{narrow_broadcast_products, simplify};
use ir::spec::ResidualSpec;

const B: usize = 2;
const T: usize = 8;

/// Products (`MatMul`, `NormProject`) whose first operand is, through
/// reshapes, a broadcast whose copies lie side by side in that operand's last
/// axis (the hyper-connection state `[e, e, …, e]` flattened per token).
fn products_of_broadcasts(g: &Graph) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&id| matches!(g.node(id).op, Op::MatMul { .. } | Op::NormProject { .. }))
        .filter(|&id| reads_the_broadcast(g, g.inputs(id)[0]))
        .count()
}

/// `x` is, through reshapes, a broadcast whose copies lie side by side in
/// `x`'s last axis.
fn reads_the_broadcast(g: &Graph, x: NodeId) -> bool {
    let mut v = x;
    while matches!(g.node(v).op, Op::Reshape { .. }) {
        v = g.inputs(v)[0];
    }
    matches!(g.node(v).op, Op::Broadcast { .. })
        && g.node(x).shape.last() > g.node(g.inputs(v)[0]).shape.last()
}

#[test]
fn products_over_the_broadcast_state_keep_loss_and_gradients_of_every_spec() {
    let mut rewritten_in = Vec::new();
    for (seed, path) in spec_files().into_iter().enumerate() {
        let reference = Reference::of(&path, seed as u64 + 11);
        let (name, original) = (&reference.name, &reference.lowered.graph);
        let mut narrowed = original.clone();
        let over_broadcast = products_of_broadcasts(&narrowed);
        let rewritten = narrow_broadcast_products(&mut narrowed).products;
        assert_eq!(rewritten, over_broadcast, "{name}: every product over a broadcast state");
        assert_eq!(products_of_broadcasts(&narrowed), 0, "{name}");
        for &g in &reference.grads {
            assert_eq!(narrowed.node(g).shape, original.node(g).shape, "{name}: gradient shapes");
        }
        if rewritten > 0 {
            rewritten_in.push((name.clone(), reference.spec.residual.clone()));
        }
        reference.assert_kept_by(&narrowed, 1e-10);
    }
    // mHC's and xHC's first states are the embedding broadcast to the streams.
    for scheme in ["mhc", "xhc"] {
        let found = rewritten_in.iter().find(|(n, _)| n == scheme);
        assert!(
            matches!(found, Some((_, ResidualSpec::Mhc(_) | ResidualSpec::Xhc(_)))),
            "{scheme}: no product rewritten ({rewritten_in:?})"
        );
    }
}

/// The rewrite keeps node ids: the weight gradient of the first projection
/// is still the node the caller holds, now a view of one narrow product.
#[test]
fn the_weight_gradient_keeps_its_node_and_becomes_a_broadcast_of_one_product() {
    let path = spec_files().into_iter().find(|p| name(p) == "mhc").expect("specs/mhc.ron");
    let spec = shrink(load(&path));
    let (mut lowered, pairs) = training_graph(&spec, B, T);
    let phi = lowered.graph.param_by_name("blocks.0.attn.conn.phi").expect("the first projection");
    let grad = pairs.iter().find(|&&(p, _)| p == phi).map(|&(_, g)| g).expect("its gradient");
    let g = &mut lowered.graph;
    assert!(matches!(g.node(grad).op, Op::MatMul { trans_a: true, .. }), "{:?}", g.node(grad).op);
    narrow_broadcast_products(g);
    assert!(matches!(g.node(grad).op, Op::Reshape { .. }), "{:?}", g.node(grad).op);
    let blocks = g.inputs(grad)[0];
    assert!(matches!(g.node(blocks).op, Op::Broadcast { .. }));
    let product = g.inputs(g.inputs(blocks)[0])[0];
    assert!(matches!(g.node(product).op, Op::MatMul { trans_a: true, .. }));
    assert_eq!(g.node(product).shape.dims(), &[spec.d_model, g.node(grad).shape.dims()[1]]);
}

/// The embedding's gradient sums the first state's gradient over the
/// streams; the projection's input-gradient term of it, `g·φᵀ`, is taken
/// with the folded weight, `d_model` wide instead of `n·d_model`.
#[test]
fn the_stream_sum_of_the_first_state_gradient_folds_the_projection() {
    for scheme in ["mhc", "xhc"] {
        let path = spec_files().into_iter().find(|p| name(p) == scheme).expect("the spec");
        let spec = shrink(load(&path));
        let (mut lowered, pairs) = training_graph(&spec, B, T);
        let grads: Vec<_> = pairs.iter().map(|&(_, g)| g).collect();
        let g = &mut lowered.graph;
        // The first projection's weight: what the products over the broadcast state multiply by.
        let weights: Vec<NodeId> = g
            .node_ids()
            .into_iter()
            .filter(|&id| {
                matches!(
                    g.node(id).op,
                    Op::MatMul { trans_a: false, trans_b: false } | Op::NormProject { .. }
                )
            })
            .filter(|&id| reads_the_broadcast(g, g.inputs(id)[0]))
            .map(|id| g.inputs(id)[1])
            .collect();
        let input_gradients = |g: &Graph| -> Vec<usize> {
            g.node_ids()
                .into_iter()
                .filter(|&id| matches!(g.node(id).op, Op::MatMul { trans_a: false, trans_b: true }))
                .filter(|&id| weights.contains(&g.inputs(id)[1]))
                .map(|id| g.node(id).shape.last())
                .collect()
        };
        let wide = input_gradients(g);
        assert!(!wide.is_empty() && wide.iter().all(|&w| w > spec.d_model), "{scheme}: {wide:?}");
        let rewritten = narrow_broadcast_products(g);
        assert!(rewritten.sums >= 1, "{scheme}: {rewritten:?}");
        // The terms the sum no longer reads go with the dead-code pass that runs next.
        simplify(g, &grads);
        assert!(input_gradients(g).is_empty(), "{scheme}: a product with the unfolded weight is left");
        let folded = g
            .node_ids()
            .into_iter()
            .filter(|&id| matches!(g.node(id).op, Op::MatMul { trans_a: false, trans_b: true }))
            .filter(|&id| matches!(g.node(g.inputs(id)[1]).op, Op::Reduce { .. }))
            .count();
        assert!(folded >= 1, "{scheme}: no product with a folded weight");
    }
}
