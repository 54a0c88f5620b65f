//! `passes::memplan` over every spec's fused training graph: no two simultaneously
//! live buffers overlap, liveness matches the execution order, and reuse makes the
//! arena smaller than keeping every intermediate.

mod common;

use common::passes::{load, name, spec_files, training_graph};
use ir::graph::NodeId;
use ir::passes::{fuse, memplan, simplify, MemPlanError};
use std::collections::HashMap;

#[test]
fn every_spec_gets_a_valid_arena_smaller_than_all_intermediates() {
    for path in spec_files() {
        let spec = name(&path);
        let (mut lowered, pairs) = training_graph(&load(&path), 2, 8);
        let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
        simplify(&mut lowered.graph, &grads);
        let g = &lowered.graph;
        let fused = fuse(g, &grads).unwrap();
        let plan = memplan(g, &fused, &grads).unwrap_or_else(|e| panic!("{spec}: {e}"));
        plan.check().unwrap_or_else(|e| panic!("{spec}: {e}"));

        // Parameters, gradients and the data input are persistent, nothing else in the arena.
        for &(p, gr) in &pairs {
            assert!(plan.slot(p).is_some_and(|(persistent, _)| persistent), "{spec}: param n{}", p.index());
            assert!(plan.slot(gr).is_some_and(|(persistent, _)| persistent), "{spec}: grad n{}", gr.index());
            assert!(!plan.slots.contains_key(&gr));
        }
        assert!(plan.slot(lowered.tokens).is_some_and(|(persistent, _)| persistent));

        // Every group output has a buffer; live ranges cover producer and every reader.
        let step: HashMap<_, usize> = fused.order.iter().enumerate().map(|(i, &gid)| (gid, i)).collect();
        for group in &fused.groups {
            for &o in &group.outputs {
                let (persistent, slot) =
                    plan.slot(o).unwrap_or_else(|| panic!("{spec}: n{} has no buffer", o.index()));
                if !persistent {
                    assert_eq!(slot.first, step[&group.id], "{spec}: n{}", o.index());
                }
            }
            for &i in &group.inputs {
                let (_, slot) = plan.slot(i).expect("input has a buffer");
                assert!(
                    slot.first <= step[&group.id] && step[&group.id] <= slot.last,
                    "{spec}: n{} freed early",
                    i.index()
                );
            }
        }
        assert!(plan.peak <= plan.arena_bytes);
        assert!(
            plan.arena_bytes < plan.unshared_bytes(),
            "{spec}: arena {} is not smaller than all intermediates {}",
            plan.arena_bytes,
            plan.unshared_bytes()
        );
    }
}

#[test]
fn check_rejects_overlapping_live_buffers() {
    let path = spec_files().into_iter().find(|p| name(p) == "tiny").expect("specs/tiny.ron");
    let (lowered, pairs) = training_graph(&load(&path), 1, 4);
    let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
    let fused = fuse(&lowered.graph, &grads).unwrap();
    let mut plan = memplan(&lowered.graph, &fused, &grads).unwrap();
    plan.check().unwrap();
    // Two values live at the same step, moved onto each other.
    let mut slots: Vec<(NodeId, ir::passes::Slot)> = plan.slots.iter().map(|(&n, &s)| (n, s)).collect();
    slots.sort_by_key(|&(n, _)| n);
    let (a, sa) = slots[0];
    let (b, _) = slots
        .iter()
        .copied()
        .find(|&(n, s)| n != a && s.first <= sa.last && sa.first <= s.last)
        .expect("two simultaneously live values");
    plan.slots.get_mut(&b).expect("slot").offset = sa.offset;
    assert!(matches!(plan.check(), Err(MemPlanError::Overlap { .. })));
}
