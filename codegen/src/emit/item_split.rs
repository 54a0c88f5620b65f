//! The item count of a fused kernel: every split of the kernel's values into
//! `n` items under which each op reads its in-kernel operands inside its own
//! item ([`super::op_rules::item_ok`]), larger counts first, within the
//! target's per-item scratch (docs/architecture.md §5.2: one kernel per
//! token-local region). A group with no such split is cut into several kernels
//! by the compiler instead of being miscompiled.

use std::collections::{HashMap, HashSet};

use ir::graph::{Graph, NodeId, Op};

use super::op_rules::{has_own_grid, item_ok, op_scratch};
use super::{Residency, Target};

/// Whether `id`, read by a kernel of `n` items computing `inside`, holds values
/// of that kernel (so only the reading item's part may be read): true for the
/// kernel's own non-view nodes and for views (folded, wherever a partition lists
/// them) of such values. `None` when a view of kernel values breaks the item split.
fn restricted(
    graph: &Graph,
    id: NodeId,
    n: usize,
    inside: &HashSet<NodeId>,
    memo: &mut HashMap<NodeId, Option<bool>>,
) -> Option<bool> {
    if let Some(&r) = memo.get(&id) {
        return r;
    }
    let node = graph.node(id);
    let r = if node.op.is_view() {
        let mut slots = Vec::new();
        for i in graph.inputs(id) {
            slots.push(restricted(graph, i, n, inside, memo)?);
        }
        let any = slots.iter().any(|&r| r);
        if any && !item_ok(graph, id, n, &slots, false) {
            None
        } else {
            Some(any)
        }
    } else {
        Some(inside.contains(&id) && !matches!(node.op, Op::Constant { .. }))
    };
    memo.insert(id, r);
    r
}

/// Fewest elements of its widest value one item of a C kernel should own:
/// four AVX-512 vectors, or a whole row when rows are shorter. Finer splits
/// (one item per element) leave the item loop with per-element index
/// arithmetic (divisions by the row widths) that the C compiler does not
/// vectorize: mHC's stream write (`H_res·x + H_post·y`, docs/math.md §4.1) ran
/// far below the memory's rate as one item per element. Two threads need only a few items each;
/// the GPU wants every thread it can get.
const CPU_MIN_ITEM_ELEMENTS: usize = 64;

/// One way to split a kernel into items: `n` items, each declaring `scratch`
/// elements of local arrays before loop fusion (an upper bound on what it
/// keeps: fusion turns elementwise chains into scalars).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemSplit {
    pub n: usize,
    pub scratch: usize,
}

/// The item count of a kernel computing `nodes` (in topological order), or
/// `None` when no split into items lets every op read its in-kernel operands
/// inside its own item (or the per-item scratch would exceed the target's
/// [`Target::local_limit`]).
/// Larger counts are preferred (more parallelism); on the C target, counts that
/// give items at least `CPU_MIN_ITEM_ELEMENTS` of the widest value (or a whole
/// row of it) come first.
pub fn itemize(graph: &Graph, nodes: &[NodeId], res: &dyn Residency, target: Target) -> Option<usize> {
    item_splits(graph, nodes, res, target)
        .into_iter()
        .find(|s| s.scratch <= target.local_limit())
        .map(|s| s.n)
}

/// Every split into items that lets each op of `nodes` read its in-kernel
/// operands inside its own item, in [`itemize`]'s order of preference, with
/// the scratch each declares before loop fusion. A single op cannot be split
/// further: its scratch is what it needs, so it reports none.
pub fn item_splits(graph: &Graph, nodes: &[NodeId], res: &dyn Residency, target: Target) -> Vec<ItemSplit> {
    if nodes.iter().any(|&id| has_own_grid(&graph.node(id).op) || graph.node(id).op.is_source()) {
        return Vec::new();
    }
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    // Nodes the kernel writes: every non-view, and views copied into their buffer.
    let computed: Vec<NodeId> =
        nodes.iter().copied().filter(|&id| !graph.node(id).op.is_view() || res.has_buffer(id)).collect();
    let mut candidates: Vec<usize> = Vec::new();
    for &id in &computed {
        let mut p = 1;
        candidates.push(1);
        for &d in graph.node(id).shape.dims() {
            p *= d;
            candidates.push(p);
        }
    }
    if candidates.is_empty() {
        // Only views, folded by their consumers: nothing to launch.
        return vec![ItemSplit { n: 1, scratch: 0 }];
    }
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    candidates.dedup();
    if target == Target::Cpu {
        // Whole rows first (stable: larger counts still first within each kind).
        let widest = computed.iter().map(|&id| &graph.node(id).shape).max_by_key(|s| s.numel());
        let (numel, row) = widest.map_or((1, 1), |s| (s.numel(), s.last()));
        let least = CPU_MIN_ITEM_ELEMENTS.min(row);
        candidates.sort_by_key(|&n| n > 0 && numel / n.max(1) < least);
    }
    let mut splits = Vec::new();
    'candidate: for n in candidates.into_iter().filter(|&n| n > 0) {
        let mut local = 0;
        let mut memo: HashMap<NodeId, Option<bool>> = HashMap::new();
        for &id in &computed {
            let node = graph.node(id);
            let mut slots = Vec::new();
            for i in graph.inputs(id) {
                match restricted(graph, i, n, &inside, &mut memo) {
                    Some(r) => slots.push(r),
                    None => continue 'candidate,
                }
            }
            if !item_ok(graph, id, n, &slots, node.op.is_view()) {
                continue 'candidate;
            }
            if !res.has_buffer(id) {
                local += node.shape.numel() / n;
            }
            local += op_scratch(&node.op, node.shape.dims());
        }
        let scratch = if computed.len() == 1 { 0 } else { local };
        splits.push(ItemSplit { n, scratch });
    }
    splits
}
