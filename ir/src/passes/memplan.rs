//! Memory planning (docs/architecture.md §7): where every value that crosses a group boundary
//! lives while a Plan runs.
//!
//! - **Persistent** values keep their buffer across steps: every `Param`, `Input` and
//!   `Constant` node (constants are filled once) and the nodes the caller names (the
//!   parameter gradients returned by [`crate::autodiff::grad`], optimizer state). They
//!   are laid out one after another in a persistent region.
//! - Every other **group output** gets a slot in one arena. Its live range runs from
//!   the step (position in [`FusedGraph::order`]) of the group that writes it to the
//!   last step of a group that reads it; a root (graph output) lives to the end.
//!   Steps are visited in order: slots whose live range ended are freed, then the
//!   group's outputs are placed, largest first, at the lowest offset where they fit
//!   (first fit), every offset and size rounded up to [`ALIGN`] bytes.
//!
//! Values produced and consumed inside one group need no buffer. Inputs of a step are
//! still live while it runs, so a kernel never writes over a buffer it reads.
//! Scratch space of two-phase reductions (per-block partials) is the kernel's own
//! workspace and is not planned here.

use super::fuse::FusedGraph;
use crate::graph::{Graph, NodeId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Alignment of every slot, in bytes (a cache line; enough for vector loads).
pub const ALIGN: usize = 64;

/// A buffer: `bytes` at `offset` of its region, live from step `first` to step
/// `last` (inclusive positions in the execution order; persistent slots span all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub offset: usize,
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
}

/// Buffer layout for one Plan.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    /// Persistent buffers in node order, offsets into the persistent region.
    pub persistent: Vec<(NodeId, Slot)>,
    pub persistent_bytes: usize,
    /// Size of the arena that holds every other group output.
    pub arena_bytes: usize,
    /// Arena slots of the non-persistent group outputs.
    pub slots: HashMap<NodeId, Slot>,
    /// Largest sum of simultaneously live arena bytes (<= `arena_bytes`; the gap is
    /// fragmentation).
    pub peak: usize,
}

/// Errors of the memory planner.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemPlanError {
    #[error("persistent node %{node} is not a value any group materializes")]
    NotMaterialized { node: usize },
    #[error("%{a} and %{b} are live at the same time and overlap in memory")]
    Overlap { a: usize, b: usize },
    #[error("slot of %{node} is misaligned or outside its region")]
    OutOfRange { node: usize },
}

fn round_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN).max(1) * ALIGN
}

/// Plans the buffers of `fused` (a partition of `graph`). `persistent` names the
/// values besides sources that must keep their own buffer across steps.
pub fn memplan(graph: &Graph, fused: &FusedGraph, persistent: &[NodeId]) -> Result<MemoryPlan, MemPlanError> {
    let steps = fused.order.len();
    let step_of: HashMap<_, usize> = fused.order.iter().enumerate().map(|(i, &g)| (g, i)).collect();
    let produced: HashSet<NodeId> = fused.groups.iter().flat_map(|g| g.outputs.iter().copied()).collect();
    let mut keep: Vec<NodeId> =
        graph.node_ids().into_iter().filter(|&id| graph.node(id).op.is_source()).collect();
    let sources: HashSet<NodeId> = keep.iter().copied().collect();
    for &id in persistent {
        if !produced.contains(&id) && !sources.contains(&id) {
            return Err(MemPlanError::NotMaterialized { node: id.index() });
        }
        keep.push(id);
    }
    keep.sort();
    keep.dedup();
    let keep_set: HashSet<NodeId> = keep.iter().copied().collect();

    let mut offset = 0;
    let mut persistent_slots = Vec::with_capacity(keep.len());
    for &id in &keep {
        let bytes = bytes_of(graph, id);
        persistent_slots.push((id, Slot { offset, bytes, first: 0, last: steps.saturating_sub(1) }));
        offset += round_up(bytes);
    }
    let persistent_bytes = offset;

    // Live ranges of the arena values.
    let roots: HashSet<NodeId> = graph.outputs().iter().map(|&(_, id)| id).collect();
    let mut range: BTreeMap<NodeId, (usize, usize)> = BTreeMap::new();
    for &gid in &fused.order {
        let step = step_of[&gid];
        for &o in &fused.group(gid).outputs {
            if !keep_set.contains(&o) {
                let last = if roots.contains(&o) { steps - 1 } else { step };
                range.insert(o, (step, last));
            }
        }
    }
    for &gid in &fused.order {
        let step = step_of[&gid];
        for i in &fused.group(gid).inputs {
            if let Some(r) = range.get_mut(i) {
                r.1 = r.1.max(step);
            }
        }
    }

    let mut ending: Vec<Vec<NodeId>> = vec![Vec::new(); steps];
    for (&id, &(_, last)) in &range {
        ending[last].push(id);
    }
    // Occupied arena intervals: offset -> (end, node).
    let mut live: BTreeMap<usize, (usize, NodeId)> = BTreeMap::new();
    let mut slots = HashMap::new();
    let (mut arena_bytes, mut peak, mut live_bytes) = (0, 0, 0);
    for (step, &gid) in fused.order.iter().enumerate() {
        if step > 0 {
            for id in &ending[step - 1] {
                let slot: &Slot = &slots[id];
                live.remove(&slot.offset);
                live_bytes -= round_up(slot.bytes);
            }
        }
        let mut outs: Vec<NodeId> =
            fused.group(gid).outputs.iter().copied().filter(|o| range.contains_key(o)).collect();
        outs.sort_by_key(|&o| (std::cmp::Reverse(bytes_of(graph, o)), o));
        for o in outs {
            let bytes = bytes_of(graph, o);
            let size = round_up(bytes);
            let mut at = 0;
            for (&start, &(end, _)) in &live {
                if at + size <= start {
                    break;
                }
                at = at.max(end);
            }
            live.insert(at, (at + size, o));
            live_bytes += size;
            arena_bytes = arena_bytes.max(at + size);
            let (first, last) = range[&o];
            slots.insert(o, Slot { offset: at, bytes, first, last });
        }
        peak = peak.max(live_bytes);
    }
    Ok(MemoryPlan { persistent: persistent_slots, persistent_bytes, arena_bytes, slots, peak })
}

fn bytes_of(graph: &Graph, id: NodeId) -> usize {
    let node = graph.node(id);
    node.shape.numel() * node.dtype.size_bytes()
}

impl MemoryPlan {
    /// The slot of `id`: persistent or arena, with which.
    pub fn slot(&self, id: NodeId) -> Option<(bool, Slot)> {
        if let Some(&(_, s)) = self.persistent.iter().find(|(n, _)| *n == id) {
            return Some((true, s));
        }
        self.slots.get(&id).map(|&s| (false, s))
    }

    /// Sum of the sizes of all arena values, as if none shared memory.
    pub fn unshared_bytes(&self) -> usize {
        self.slots.values().map(|s| round_up(s.bytes)).sum()
    }

    /// Verifies the plan: every slot aligned and inside its region, persistent slots
    /// disjoint, and no two arena slots whose live ranges intersect share a byte.
    pub fn check(&self) -> Result<(), MemPlanError> {
        let mut persistent: Vec<(NodeId, Slot)> = self.persistent.clone();
        persistent.sort_by_key(|&(_, s)| s.offset);
        for w in persistent.windows(2) {
            if w[0].1.offset + w[0].1.bytes > w[1].1.offset {
                return Err(MemPlanError::Overlap { a: w[0].0.index(), b: w[1].0.index() });
            }
        }
        for &(id, s) in &persistent {
            if s.offset % ALIGN != 0 || s.offset + s.bytes > self.persistent_bytes {
                return Err(MemPlanError::OutOfRange { node: id.index() });
            }
        }
        let mut arena: Vec<(NodeId, Slot)> = self.slots.iter().map(|(&id, &s)| (id, s)).collect();
        arena.sort_by_key(|&(id, s)| (s.offset, id));
        for &(id, s) in &arena {
            if s.offset % ALIGN != 0 || s.offset + s.bytes > self.arena_bytes || s.first > s.last {
                return Err(MemPlanError::OutOfRange { node: id.index() });
            }
        }
        // Sorted by offset: a slot can only collide with later slots starting before it ends.
        for (i, &(a, sa)) in arena.iter().enumerate() {
            for &(b, sb) in &arena[i + 1..] {
                if sb.offset >= sa.offset + sa.bytes {
                    break;
                }
                if sa.first <= sb.last && sb.first <= sa.last {
                    return Err(MemPlanError::Overlap { a: a.index(), b: b.index() });
                }
            }
        }
        Ok(())
    }
}
