//! `passes::split_norm_projections` on every spec's training graph: RMS norm
//! projections (mHC's coefficients, xHC's active maps) and LayerNorm ones
//! (xHC's router) become statistics, product and scaling, and the loss and
//! every parameter gradient keep their values (f64 reference executor).

mod common;

use common::passes::{load, name, shrink, spec_files, training_graph, Reference};
use ir::graph::{Graph, NodeId, Op, ReduceOp, Region};
use ir::passes::{fuse, prepare_for_fusion, split_norm_projections, GroupKind};

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
    let (mut split_rms, mut split_centered) = (false, false);
    for (seed, path) in spec_files().into_iter().enumerate() {
        let reference = Reference::of(&path, seed as u64 + 7);
        let name = &reference.name;
        let mut split = reference.lowered.graph.clone();
        let (rms, centered) = (projections(&split, false), projections(&split, true));
        let rewritten = split_norm_projections(&mut split, &reference.grads);
        assert_eq!(rewritten, rms + centered, "{name}: every projection is split");
        assert_eq!(projections(&split, false) + projections(&split, true), 0, "{name}");
        split_rms |= rms > 0;
        split_centered |= centered > 0;
        reference.assert_kept_by(&split, 1e-10);
    }
    assert!(split_rms && split_centered, "no spec has an RMS and a LayerNorm projection to split");
}

/// In xHC the router's LayerNorm statistics join the forward group that
/// routes (TopK) and gathers the active streams from the same state (docs/math.md
/// §6.2–§6.4), which has every row in hand: no kernel after the router's
/// GEMM reads the state for the statistics alone, as the projection's own
/// kernel did.
#[test]
fn the_routers_statistics_join_the_group_that_gathers_from_the_state() {
    let path = spec_files().into_iter().find(|p| name(p) == "xhc").expect("specs/xhc.ron");
    let spec = shrink(load(&path));
    let (mut lowered, pairs) = training_graph(&spec, B, T);
    let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
    let g = &mut lowered.graph;
    let routers = projections(g, true);
    assert!(routers > 0, "xHC routes");
    prepare_for_fusion(g, &grads).expect("prepares");
    assert_eq!(projections(g, true), 0, "every router's projection is split");
    let fused = fuse(g, &grads).expect("fuses");
    // The value a node's first operand views (through reshapes and
    // broadcasts: the first state is the embedding broadcast to N streams).
    let viewed = |id: NodeId| {
        let mut v = g.inputs(id)[0];
        while matches!(g.node(v).op, Op::Reshape { .. } | Op::Broadcast { .. }) {
            v = g.inputs(v)[0];
        }
        v
    };
    let nodes_of = |grp: &ir::passes::FusionGroup, op: &dyn Fn(&Op) -> bool| -> Vec<NodeId> {
        grp.nodes.iter().copied().filter(|&id| op(&g.node(id).op)).collect()
    };
    let mut routing = 0;
    for grp in &fused.groups {
        let forward = grp.nodes.iter().all(|&id| g.node(id).role.region != Region::Backward);
        if !forward || nodes_of(grp, &|op| matches!(op, Op::TopK { .. })).is_empty() {
            continue;
        }
        routing += 1;
        // μ = mean(x) over the flattened state, and the gathers of its rows.
        let means = nodes_of(grp, &|op| matches!(op, Op::Reduce { op: ReduceOp::Mean, .. }));
        let means: Vec<NodeId> =
            means.into_iter().filter(|&m| matches!(g.node(g.inputs(m)[0]).op, Op::Reshape { .. })).collect();
        let gathers = nodes_of(grp, &|op| matches!(op, Op::Gather { .. }));
        let shared = means.iter().any(|&m| gathers.iter().any(|&x| viewed(m) == viewed(x)));
        assert!(shared, "{}: no statistic of the state it gathers from: {}", grp.id, grp.reason);
    }
    assert_eq!(routing, routers, "one forward routing group per router");
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
