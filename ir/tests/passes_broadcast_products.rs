//! `passes::narrow_broadcast_products` on every spec's training graph: the
//! first sublayer's coefficient projection over the embedding broadcast to
//! the streams, and its weight gradient, are taken at the embedding's width;
//! the loss and every parameter gradient keep their values (f64 reference
//! executor), and no product reads the broadcast any more.

mod passes_util;

use ir::graph::{Graph, Op};
use ir::passes::narrow_broadcast_products;
use ir::spec::ResidualSpec;
use passes_util::{load, name, shrink, spec_files, training_graph, Reference};

const B: usize = 2;
const T: usize = 8;

/// Products (`MatMul`, `NormProject`) whose first operand is, through
/// reshapes, a broadcast whose copies lie side by side in that operand's last
/// axis (the hyper-connection state `[e, e, …, e]` flattened per token).
fn products_of_broadcasts(g: &Graph) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&id| matches!(g.node(id).op, Op::MatMul { .. } | Op::NormProject { .. }))
        .filter(|&id| {
            let x = g.inputs(id)[0];
            let mut v = x;
            while matches!(g.node(v).op, Op::Reshape { .. }) {
                v = g.inputs(v)[0];
            }
            if !matches!(g.node(v).op, Op::Broadcast { .. }) {
                return false;
            }
            let source = g.inputs(v)[0];
            g.node(x).shape.last() > g.node(source).shape.last()
        })
        .count()
}

#[test]
fn products_over_the_broadcast_state_keep_loss_and_gradients_of_every_spec() {
    let mut rewritten_in = Vec::new();
    for (seed, path) in spec_files().into_iter().enumerate() {
        let reference = Reference::of(&path, seed as u64 + 11);
        let (name, original) = (&reference.name, &reference.lowered.graph);
        let mut narrowed = original.clone();
        let over_broadcast = products_of_broadcasts(&narrowed);
        let rewritten = narrow_broadcast_products(&mut narrowed);
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
