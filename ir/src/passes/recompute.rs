//! Recompute schedules (docs/math.md §4.5, "Recompute schedule"; HC App. B in
//! §2.5; VWN §5.8): the backward pass recomputes the residual-stream
//! machinery's forward values from the stream state entering each block instead
//! of reading them stored, so the forward's copies die inside the forward.
//!
//! The unit is a *block* of `L_r` consecutive sublayers (`train.recompute`:
//! `Stream` is `L_r = 1`, `Block(L_r)` mHC §4.3.2's schedule). Of a block's
//! connection values ([`Region::Connection`]) the forward keeps, for the
//! backward, only
//! - its *boundary*: a value a forward node outside the block reads (the stream
//!   state the block hands on, which is the next block's input), and
//! - what is not cheap to recompute: a product with a parameter (the
//!   coefficient projection `x⃗ φ` of mHC, a few numbers per token).
//!
//! Everything else of the block that the backward reads is cloned, with the
//! block's other values it is computed from, up to stored values (the block
//! input, F's outputs, parameters, the coefficients' projections); the
//! backward reads the clones. Of F ([`Region::Backbone`]) only its pre-norm
//! on the read is cloned (docs/math.md §4.5 recomputes RMSNorm(H_pre x_l));
//! the rest keeps its activations: §4.5 stores "each layer's F output", and
//! F's own backward reads what it always did. A clone reads only values the
//! backward reads anyway, so no stored value's life grows. A block's stored
//! states then number one per block, and its intermediates exist only while
//! its backward runs: docs/math.md's nC⌈L/L_r⌉ + (n+2)C·L_r.
//!
//! The clones are backward nodes ([`Region::Backward`]), so fusion keeps them
//! out of the forward kernels; they compute the originals' ops on the
//! originals' operands, so on the Cpu device their bits are the originals'
//! (`runtime/tests/recompute.rs` checks every gradient bit for bit).
//!
//! Where they run: the step order is the graph's topological order, smallest
//! node id first ([`Graph::topo_order`]), and fusion's group order follows it.
//! The clones get ids above every existing node, and the last block's first:
//! a clone is then taken only when nothing older is ready, that is when the
//! backward cannot go on without it, and of the ready clones the latest
//! block's. So each block's clones run as its backward starts, not after the
//! forward, and live only through it.

use std::collections::{HashMap, HashSet};

use petgraph::stable_graph::EdgeIndex;
use petgraph::visit::{EdgeRef, NodeIndexable};
use petgraph::Direction;

use crate::graph::{Graph, Node, NodeId, Op, OpFamily, Region, Role};
use crate::shape::Shape;
use crate::DType;

/// What [`recompute_blocks`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecomputeStats {
    /// Forward values the backward now recomputes instead of reading.
    pub values: usize,
    /// Nodes added (the clones).
    pub nodes_added: usize,
    /// Bytes of the forward values the backward no longer reads.
    pub bytes: usize,
}

/// A node's block: (MTP module, sublayer / `l_r`) for a forward node of a
/// sublayer's connection or backbone.
type Block = (Option<usize>, usize);

fn block_of(node: &Node, l_r: usize) -> Option<Block> {
    let sublayer = node.role.sublayer?;
    matches!(node.role.region, Region::Connection | Region::Backbone)
        .then_some((node.role.mtp, sublayer / l_r))
}

/// Clones, for the backward pass, the connection values of each block of
/// `l_r` sublayers that the backward reads (see the module doc), and moves the
/// backward's reads to the clones. Values in `roots` or named as outputs are
/// left as they are. `l_r` of 0 is taken as 1.
pub fn recompute_blocks(graph: &mut Graph, roots: &[NodeId], l_r: usize) -> RecomputeStats {
    let l_r = l_r.max(1);
    let order = graph.topo_order();
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let kept: HashSet<NodeId> =
        roots.iter().copied().chain(graph.outputs().iter().map(|&(_, o)| o)).collect();
    let backward = |graph: &Graph, id: NodeId| graph.node(id).role.region == Region::Backward;

    // Boundaries, last first: a value read by a forward node of another block
    // (or of no block), directly or through a view that is a boundary.
    let mut boundary: HashSet<NodeId> = HashSet::new();
    for &id in order.iter().rev() {
        let node = graph.node(id);
        if backward(graph, id) {
            continue;
        }
        let Some(b) = block_of(node, l_r) else { continue };
        let leaves = graph.users(id).iter().any(|&(u, _)| {
            let user = graph.node(u);
            user.role.region != Region::Backward
                && (block_of(user, l_r) != Some(b) || (user.op.is_view() && boundary.contains(&u)))
        });
        if leaves {
            boundary.insert(id);
        }
    }
    let cloneable = |graph: &Graph, id: NodeId| -> Option<Block> {
        let node = graph.node(id);
        let region = match node.role.region {
            Region::Connection => true,
            Region::Backbone => pre_norm(graph, id),
            _ => false,
        };
        if !region || boundary.contains(&id) || kept.contains(&id) {
            return None;
        }
        let cheap = match node.op.family() {
            OpFamily::Source(_) | OpFamily::PlanStep => false,
            // A product with a parameter is a GEMM over the tokens, and its
            // output (mixing logits) is small: stored.
            OpFamily::Contraction => !graph.inputs(id).iter().any(|&i| reads_source(graph, i)),
            _ => true,
        };
        cheap.then(|| block_of(node, l_r)).flatten()
    };
    // Whether the backward reads `id` anyway (directly or through views): a
    // clone may read such a value, which stays stored whatever the schedule,
    // but no other, whose life it would stretch into the backward. A plain
    // residual's F output is read only by the add (x + F); recomputing x from
    // it would store F instead of x, no saving.
    fn read_back(graph: &Graph, id: NodeId) -> bool {
        graph.users(id).iter().any(|&(u, _)| {
            let user = graph.node(u);
            user.role.region == Region::Backward || (user.op.is_view() && read_back(graph, u))
        })
    }
    fn stored(graph: &Graph, id: NodeId) -> bool {
        let node = graph.node(id);
        node.op.is_source()
            || read_back(graph, id)
            || (node.op.is_view() && graph.inputs(id).iter().all(|&i| stored(graph, i)))
    }
    // Whether a value can be recomputed: cloneable, and its operands are
    // recomputable or stored.
    let mut feasible: HashMap<NodeId, bool> = HashMap::new();
    for &id in &order {
        let ok = cloneable(graph, id).is_some()
            && graph
                .inputs(id)
                .iter()
                .all(|&i| feasible.get(&i).copied().unwrap_or(false) || stored(graph, i));
        feasible.insert(id, ok);
    }
    let cloneable = |graph: &Graph, id: NodeId| -> Option<Block> {
        if feasible.get(&id).copied().unwrap_or(false) {
            cloneable(graph, id)
        } else {
            None
        }
    };

    // The values to recompute, by block, each block in forward order.
    let mut blocks: HashMap<Block, Vec<NodeId>> = HashMap::new();
    for &id in &order {
        if backward(graph, id) {
            continue;
        }
        let read_back = graph.users(id).iter().any(|&(u, _)| backward(graph, u));
        if let (true, Some(b)) = (read_back, cloneable(graph, id)) {
            blocks.entry(b).or_default().push(id);
        }
    }
    // The block whose backward runs first (latest in the forward) first.
    let mut keys: Vec<Block> = blocks.keys().copied().collect();
    keys.sort_by_key(|b| std::cmp::Reverse(blocks[b].iter().map(|id| pos[id]).max().unwrap_or(0)));

    let placeholders = fill_vacancies(graph);
    let role = graph.role();
    let mut stats = RecomputeStats::default();
    let mut copies: HashMap<NodeId, NodeId> = HashMap::new();
    for b in &keys {
        for &value in &blocks[b] {
            clone_into(graph, value, &cloneable, &mut copies);
        }
    }
    graph.set_role(role);
    stats.nodes_added = copies.len();
    let clones: HashSet<NodeId> = copies.values().copied().collect();
    let mut moved: Vec<NodeId> = Vec::new();
    for b in &keys {
        for &value in &blocks[b] {
            let copy = copies[&value];
            let edges: Vec<(EdgeIndex, NodeId, usize)> = graph
                .g
                .edges_directed(value, Direction::Outgoing)
                .map(|e| (e.id(), e.target(), *e.weight()))
                .filter(|&(_, u, _)| backward(graph, u) && !clones.contains(&u))
                .collect();
            for (edge, user, slot) in edges {
                graph.g.remove_edge(edge);
                graph.g.add_edge(copy, user, slot);
            }
            stats.values += 1;
            stats.bytes += bytes(graph, value);
            moved.push(value);
        }
    }
    for id in placeholders {
        graph.g.remove_node(id);
    }
    remove_unused(graph, moved, &kept);
    stats
}

/// Whether backbone node `id` is F's pre-norm on the read (or a view of
/// it): a row-wise or elementwise op whose operands are connection values
/// or parameters, directly or through views. docs/math.md §4.5 recomputes
/// RMSNorm(H_pre x_l) with the read; F's other activations stay stored.
fn pre_norm(graph: &Graph, id: NodeId) -> bool {
    fn from_connection(graph: &Graph, id: NodeId) -> bool {
        let node = graph.node(id);
        node.op.is_source()
            || node.role.region == Region::Connection
            || (node.op.is_view() && graph.inputs(id).iter().all(|&i| from_connection(graph, i)))
    }
    let node = graph.node(id);
    let cheap = matches!(node.op.family(), OpFamily::RowWise | OpFamily::Elementwise | OpFamily::View(_));
    cheap
        && !matches!(node.op, Op::Softmax | Op::TopK { .. })
        && graph.inputs(id).iter().all(|&i| from_connection(graph, i))
}

/// Whether `id` is a source, or a view of one.
fn reads_source(graph: &Graph, id: NodeId) -> bool {
    let op = &graph.node(id).op;
    op.is_source() || (op.is_view() && graph.inputs(id).iter().any(|&i| reads_source(graph, i)))
}

/// The clone of `id` (made once), reading the clones of its operands that
/// are cloneable and the originals of the others (the stored values).
fn clone_into(
    graph: &mut Graph,
    id: NodeId,
    cloneable: &dyn Fn(&Graph, NodeId) -> Option<Block>,
    copies: &mut HashMap<NodeId, NodeId>,
) -> NodeId {
    if let Some(&copy) = copies.get(&id) {
        return copy;
    }
    let inputs: Vec<NodeId> = graph
        .inputs(id)
        .into_iter()
        .map(|i| if cloneable(graph, i).is_some() { clone_into(graph, i, cloneable, copies) } else { i })
        .collect();
    let node = graph.node(id).clone();
    graph.set_role(Role { region: Region::Backward, ..node.role });
    let copy = graph.add_labeled(node.op, &inputs, node.label).expect("a copy of a valid node is valid");
    copies.insert(id, copy);
    copy
}

/// Fills every vacant node slot with a placeholder, so that the nodes added
/// next get ids above every existing one (a removed node's id is reused
/// first); returns the placeholders, to be removed afterwards.
fn fill_vacancies(graph: &mut Graph) -> Vec<NodeId> {
    let vacant = graph.g.node_bound() - graph.g.node_count();
    (0..vacant)
        .map(|_| {
            graph.g.add_node(Node {
                op: Op::Constant { value: 0.0 },
                shape: Shape::scalar(),
                dtype: DType::F32,
                role: Role::new(Region::Backward),
                label: None,
            })
        })
        .collect()
}

/// Removes the originals nothing reads any more (values only the backward
/// read) and the forward nodes only they read.
fn remove_unused(graph: &mut Graph, mut left: Vec<NodeId>, kept: &HashSet<NodeId>) {
    while let Some(id) = left.pop() {
        if !graph.g.contains_node(id) || !graph.users(id).is_empty() || kept.contains(&id) {
            continue;
        }
        let node = graph.node(id);
        if node.op.is_source() || node.role.region == Region::Backward {
            continue;
        }
        left.extend(graph.inputs(id));
        graph.g.remove_node(id);
    }
}

fn bytes(graph: &Graph, id: NodeId) -> usize {
    let node = graph.node(id);
    node.shape.numel() * node.dtype.size_bytes()
}
