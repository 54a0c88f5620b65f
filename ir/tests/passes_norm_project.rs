//! `passes::split_norm_projections` on every spec's training graph: RMS norm
//! projections (mHC's coefficients, xHC's active maps) become statistic,
//! product and scaling, LayerNorm projections (xHC's router) stay, and the
//! loss and every parameter gradient keep their values (f64 reference executor).

mod passes_util;

use ir::graph::{Graph, NodeId, Op};
use ir::passes::{fuse, split_norm_projections, GroupKind};
use passes_util::{load, name, shrink, spec_files, training_graph, Reference};

const B: usize = 2;
const T: usize = 8;

fn projections(g: &Graph, centered: bool) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&id| matches!(g.node(id).op, Op::NormProject { centered: c, .. } if (c > 0) == centered))
        .count()
}

#[test]
fn split_projections_keep_loss_and_gradients_of_every_spec() {
    let mut split_somewhere = false;
    for (seed, path) in spec_files().into_iter().enumerate() {
        let reference = Reference::of(&path, seed as u64 + 7);
        let name = &reference.name;
        let mut split = reference.lowered.graph.clone();
        let (rms, centered) = (projections(&split, false), projections(&split, true));
        let rewritten = split_norm_projections(&mut split, &reference.grads);
        assert_eq!(rewritten, rms, "{name}: every RMS projection is split");
        assert_eq!(projections(&split, false), 0, "{name}");
        assert_eq!(projections(&split, true), centered, "{name}: LayerNorm projections stay");
        split_somewhere |= rewritten > 0;
        reference.assert_kept_by(&split, 1e-10);
    }
    assert!(split_somewhere, "no spec has an RMS norm projection to split");
}

/// In mHC the statistic joins a token-local group (the one that reads the
/// state for the pre-mix), the product is a GEMM of its own, and no group
/// is left holding a norm projection.
#[test]
fn the_parts_fuse_into_token_local_groups_around_one_gemm() {
    let path = spec_files().into_iter().find(|p| name(p) == "mhc").expect("specs/mhc.ron");
    let spec = shrink(load(&path));
    let (mut lowered, pairs) = training_graph(&spec, B, T);
    let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
    let g = &mut lowered.graph;
    let rewritten = split_norm_projections(g, &grads);
    assert_eq!(rewritten, spec.sublayers(), "one coefficient projection per sublayer");
    let fused = fuse(g, &grads).expect("fuses");
    let kind_of = |pred: &dyn Fn(&Op) -> bool| -> Vec<GroupKind> {
        fused
            .groups
            .iter()
            .filter(|grp| grp.nodes.iter().any(|&id| g.node(id).role.mtp.is_none() && pred(&g.node(id).op)))
            .map(|grp| grp.kind)
            .collect()
    };
    assert!(kind_of(&|op| matches!(op, Op::NormProject { .. })).is_empty());
    let means = kind_of(&|op| matches!(op, Op::Reduce { op: ir::graph::ReduceOp::Mean, .. }));
    assert!(!means.is_empty() && means.iter().all(|k| *k == GroupKind::TokenLocal), "{means:?}");
    // The forward products with φ: each a heavy group (a GEMM) of its own.
    let forward_products: Vec<NodeId> = g
        .node_ids()
        .into_iter()
        .filter(|&id| matches!(g.node(id).op, Op::MatMul { trans_a: false, trans_b: false }))
        .filter(|&id| {
            let w = g.inputs(id)[1];
            matches!(&g.node(w).op, Op::Param(info) if info.name.ends_with(".conn.phi"))
        })
        .collect();
    assert_eq!(forward_products.len(), spec.sublayers());
    for id in forward_products {
        let group = fused.groups.iter().find(|grp| grp.nodes.contains(&id)).expect("grouped");
        assert_eq!(group.kind, GroupKind::Heavy(id));
    }
}
