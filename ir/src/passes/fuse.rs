//! Fusion partitioning (docs/architecture.md §5): the graph's nodes are split into
//! [`FusionGroup`]s, each of which a later stage lowers to one kernel.
//!
//! # Classes of nodes
//! Every node is classified once, from its op and the token axes of its operands
//! ([`TokenAxes`]):
//! - **Sources** (`Input`, `Param`, `Constant`): bound by the runtime or filled once;
//!   they all go into the single [`GroupKind::Source`] group.
//! - **Views** (`Reshape`, `Permute`, `Broadcast`, `Slice`, `Concat`): index math, no
//!   kernel. A view is listed in the group of its first consumer (in topological order)
//!   but *every* consumer folds the whole view chain into its own index math: group
//!   inputs are always the materialized values behind the views. A view that is itself
//!   a requested root (a graph output or a caller's root, e.g. a parameter gradient
//!   assembled by `Concat`) is materialized instead: it is a token-local copy.
//! - **Heavy** ops, one kernel each ([`GroupKind::Heavy`]): `CausalAttention` and its
//!   gradient, `SoftmaxCrossEntropy`, and every `MatMul` that is not small (below).
//! - **Token reductions** ([`GroupKind::TokenReduction`]): ops whose output sums over
//!   tokens: a `Reduce` over a token axis (the gradient of a broadcast parameter), a
//!   `MatMul` contracting over tokens (a weight gradient), a `ScatterAdd` of token rows
//!   into a shared table (the embedding gradient), the kernel gradient of
//!   `TemporalAugment`. They are implemented two-phase: per-block partials over the
//!   tokens, then a final reduction of the partials (docs/architecture.md §5 rule 3). A chain of
//!   token reductions that feed only each other (`Σ_B` then `Σ_T`) is one group, and
//!   token-free ops that read the reduced value (a gradient's scaling or sign) join it
//!   as an epilogue of the final phase.
//! - **Token-local** ops: everything else (elementwise ops, norms, reductions over
//!   non-token axes, `Softmax`, `Sinkhorn(+Grad)`, `TopK`, `Gather`/`Scatter*` along
//!   stream axes, `NormProject`, small `MatMul`s, `TemporalAugment(+Grad)` with the
//!   stencil rule below).
//!
//! # Small MatMuls
//! A `MatMul` is token-local (an unrolled loop inside the connection kernel, docs/architecture.md
//! §5.2) when it does not contract over a token axis, its rows and columns are not
//! token axes (so the token axes are batch axes: one small product per token, the
//! per-token stream contractions `[B, T, 1, s] @ [B, T, s, d]` of Read / Carry / Write,
//! docs/math.md §0.3), and either
//! - both operands are per-token (they carry the token axes): no operand is reused
//!   across tokens, so a GEMM has nothing to gain, whatever the contraction length; or
//! - the operand shared by all tokens holds at most [`SMALL_SHARED_OPERAND`] (64 × 64)
//!   elements once its broadcast is undone, and the contraction length is at most
//!   [`SMALL_CONTRACTION`] (64): it fits in registers / shared memory of the kernel.
//!
//! A `MatMul` whose rows are tokens (`[B, T, D] @ [D, F]`, whatever its size) is a
//! GEMM: heavy. A `MatMul` without token axes is token-local when both operands are
//! within [`SMALL_SHARED_OPERAND`] elements, heavy otherwise.
//!
//! # Token-local regions
//! Token-local nodes are merged greedily in topological order: each is fused with the
//! groups of the token-local values it reads when all of the following hold, and kept
//! apart otherwise (the reason is recorded):
//! - same phase: forward nodes fuse only with forward nodes, backward
//!   ([`Region::Backward`]) with backward, so no kernel spans the loss;
//! - same token count (the kernel's grid is one token per work item; MTP modules
//!   run on T − k tokens);
//! - no stencil edge inside a group: a value read at *other* tokens (slot 0 of
//!   `TemporalAugment`, slots `out` and `dY` of `TemporalAugmentGrad` w.r.t. `out`, a
//!   `Gather` along a token axis, a view that slices or concatenates along a token
//!   axis) must be produced by an earlier group or be a graph input, since a parallel
//!   token grid cannot see values other work items compute in the same launch;
//! - the group graph stays acyclic: no group may both feed and consume another
//!   (checked on the group level before every merge).
//!
//! # The contract for code generation
//! For each group: `nodes` in topological order (views among them are index math;
//! a view listed in `outputs` is written as a copy), `inputs` = the materialized
//! values (non-views, or materialized root views) produced outside the group and read
//! inside, each read once; `outputs` = the materialized values produced inside and
//! needed by another group or as a root, each written once. Values produced and
//! consumed inside a token-local group never touch memory. `order` is a valid
//! execution order of the groups.

use super::tokens::TokenAxes;
use crate::cost::{op_cost, stored_elements, Holding};
use crate::graph::{Graph, NodeId, Op, OpFamily, Region, View};
use std::collections::{BTreeSet, HashMap, HashSet};

/// Largest contraction length of a `MatMul` with an operand shared by all tokens that
/// is still unrolled inside a token-local kernel.
pub const SMALL_CONTRACTION: usize = 64;

/// Largest operand shared by all tokens (elements, after undoing its broadcast) of a
/// token-local `MatMul`: 64 × 64, small enough for registers or shared memory.
pub const SMALL_SHARED_OPERAND: usize = 64 * 64;

/// A group's index into [`FusedGraph::groups`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub usize);

impl std::fmt::Display for GroupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// What kind of kernel a group becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Every `Input`, `Param` and `Constant` node: no kernel; buffers bound by the
    /// runtime or filled once.
    Source,
    /// One heavy op (the node), a kernel of its own (GEMM, attention, loss).
    Heavy(NodeId),
    /// A maximal region of token-local ops: one kernel over `tokens` work items that
    /// reads each input once and writes each output once.
    TokenLocal,
    /// A reduction over tokens (and any token reductions that only feed it), two-phase:
    /// per-block partials, then a final reduction.
    TokenReduction,
}

/// Estimated cost of one group's kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupCost {
    /// FLOPs of its nodes ([`crate::cost::op_cost`], all-ops convention).
    pub flops: f64,
    /// Bytes of its inputs, each read once.
    pub bytes_read: usize,
    /// Bytes of its outputs, each written once.
    pub bytes_written: usize,
}

/// One future kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct FusionGroup {
    pub id: GroupId,
    pub kind: GroupKind,
    /// Member nodes in topological order (views included).
    pub nodes: Vec<NodeId>,
    /// Materialized values produced outside and read inside, in topological order.
    pub inputs: Vec<NodeId>,
    /// Materialized values produced inside and needed outside or as roots, in
    /// topological order.
    pub outputs: Vec<NodeId>,
    /// Work items: the common token count of a token-local group (1 when token-free),
    /// the tokens summed by a reduction, the output's tokens for a heavy op; 0 for
    /// the source group.
    pub tokens: usize,
    pub cost: GroupCost,
    /// Why the group is what it is (see [`FusedGraph::explain`]).
    pub reason: String,
}

/// A partition of a graph into fusion groups.
#[derive(Debug, Clone)]
pub struct FusedGraph {
    pub groups: Vec<FusionGroup>,
    /// A valid execution order (every group after the groups it reads from).
    pub order: Vec<GroupId>,
    group_of: HashMap<NodeId, GroupId>,
    tokens: TokenAxes,
}

/// Errors of the fusion pass.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FuseError {
    #[error("root %{node} is not in the graph")]
    UnknownRoot { node: usize },
    #[error("fusion groups form a cycle: {groups} cannot be ordered")]
    Cycle { groups: String },
    #[error("invalid partition: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Source,
    View,
    Heavy,
    Reduction,
    Local,
}

/// Per-node facts, indexed by topological position.
struct Analysis<'g> {
    graph: &'g Graph,
    tokens: TokenAxes,
    order: Vec<NodeId>,
    pos: HashMap<NodeId, usize>,
    class: Vec<Class>,
    why: Vec<String>,
    /// Non-view nodes and root views: the values that live in memory.
    materialized: Vec<bool>,
    /// Materialized producers read by each materialized compute node (through views),
    /// with whether the read is a stencil (other tokens).
    reads: Vec<Vec<(usize, bool)>>,
    /// Materialized compute nodes reading each materialized node.
    users: Vec<Vec<usize>>,
    /// First consumer of each non-materialized view.
    view_consumer: Vec<Option<usize>>,
    backward: Vec<bool>,
    grid: Vec<usize>,
    roots: HashSet<usize>,
}

fn dims(graph: &Graph, id: NodeId) -> String {
    let d: Vec<String> = graph.node(id).shape.dims().iter().map(|d| d.to_string()).collect();
    format!("[{}]", d.join(","))
}

/// Elements an operand's memory holds once views are undone: a shared operand this
/// small is unrolled into every item ([`Holding::Memory`]).
fn stored(graph: &Graph, id: NodeId) -> usize {
    stored_elements(graph, id, Holding::Memory)
}

impl<'g> Analysis<'g> {
    fn new(graph: &'g Graph, roots: &[NodeId]) -> Result<Analysis<'g>, FuseError> {
        let tokens = TokenAxes::of(graph);
        let order = graph.topo_order();
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let n = order.len();
        let mut root_pos = HashSet::new();
        for &r in roots.iter().chain(graph.outputs().iter().map(|(_, id)| id)) {
            root_pos.insert(*pos.get(&r).ok_or(FuseError::UnknownRoot { node: r.index() })?);
        }
        let mut a = Analysis {
            graph,
            tokens,
            order,
            pos,
            class: Vec::with_capacity(n),
            why: Vec::with_capacity(n),
            materialized: vec![false; n],
            reads: vec![Vec::new(); n],
            users: vec![Vec::new(); n],
            view_consumer: vec![None; n],
            backward: vec![false; n],
            grid: vec![0; n],
            roots: root_pos,
        };
        for p in 0..n {
            let id = a.order[p];
            let (class, why) = a.classify(id, a.roots.contains(&p));
            a.class.push(class);
            a.why.push(why);
            a.materialized[p] = class != Class::View;
            a.backward[p] = graph.node(id).role.region == Region::Backward;
            a.grid[p] = a.tokens.extent(graph, id);
        }
        for p in 0..n {
            if !a.materialized[p] || a.class[p] == Class::Source {
                continue;
            }
            let id = a.order[p];
            let stencil = a.stencil_slots(id);
            let mut found = Vec::new();
            for (slot, input) in graph.inputs(id).into_iter().enumerate() {
                a.resolve(input, stencil.contains(&slot), p, &mut found);
            }
            let mut merged: Vec<(usize, bool)> = Vec::new();
            found.sort();
            for (q, st) in found {
                match merged.last_mut() {
                    Some(last) if last.0 == q => last.1 |= st,
                    _ => merged.push((q, st)),
                }
            }
            for &(q, _) in &merged {
                a.users[q].push(p);
            }
            a.reads[p] = merged;
        }
        Ok(a)
    }

    /// Collects the materialized values behind `x` as read by consumer `p`.
    fn resolve(&mut self, x: NodeId, shifted: bool, p: usize, out: &mut Vec<(usize, bool)>) {
        let q = self.pos[&x];
        if self.materialized[q] {
            out.push((q, shifted));
            return;
        }
        if self.view_consumer[q].is_none_or(|c| p < c) {
            self.view_consumer[q] = Some(p);
        }
        let shifted = shifted || self.shifts_tokens(x);
        for input in self.graph.inputs(x) {
            self.resolve(input, shifted, p, out);
        }
    }

    /// Whether a view moves data along a token axis (its consumers read other tokens).
    fn shifts_tokens(&self, x: NodeId) -> bool {
        let (g, t) = (self.graph, &self.tokens);
        match g.node(x).op.family() {
            OpFamily::View(View::Slice { axis, start, end }) => {
                let input = g.inputs(x)[0];
                t.is_token_axis(g, input, axis) && (start != 0 || end != g.node(input).shape.dims()[axis])
            }
            OpFamily::View(View::Concat { axis }) => g.inputs(x).len() > 1 && t.is_token_axis(g, x, axis),
            // A reshape and a permutation keep every element at its token; a broadcast
            // repeats a token's elements at that token (docs/architecture.md §5).
            OpFamily::View(View::Reshape { .. } | View::Permute { .. } | View::Broadcast { .. }) => false,
            // Not views: what they read is their own business (`stencil_slots`).
            OpFamily::Source(_)
            | OpFamily::Elementwise
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => false,
        }
    }

    /// Operand slots a node reads at other tokens than its own.
    fn stencil_slots(&self, id: NodeId) -> Vec<usize> {
        let (g, t) = (self.graph, &self.tokens);
        match &g.node(id).op {
            // A causal convolution over tokens reads earlier tokens of `out`; its
            // gradient w.r.t. `out` reads later tokens of dY too (docs/math.md §6.5, §6.8).
            Op::TemporalAugment { .. } => vec![0],
            Op::TemporalAugmentGrad { wrt: 0, .. } => vec![0, g.inputs(id).len() - 1],
            // A gather along a token axis reads the rows its indices name.
            Op::Gather { axis } if t.is_token_axis(g, g.inputs(id)[0], *axis) => vec![0],
            // Every family computes a token from the same token of its operands (a
            // token reduction or a heavy op is a group of its own, `classify`).
            op => match op.family() {
                OpFamily::Source(_)
                | OpFamily::Elementwise
                | OpFamily::View(_)
                | OpFamily::Reduction
                | OpFamily::RowWise
                | OpFamily::MatrixWise
                | OpFamily::Contraction
                | OpFamily::Indexed
                | OpFamily::OwnGrid
                | OpFamily::PlanStep => Vec::new(),
            },
        }
    }

    fn classify(&self, id: NodeId, root: bool) -> (Class, String) {
        let (g, t) = (self.graph, &self.tokens);
        let op = &g.node(id).op;
        let inputs = g.inputs(id);
        let reduces_last = |axis_from_end: usize| {
            let x = inputs[0];
            let r = g.node(x).shape.rank();
            r >= axis_from_end && t.is_token_axis(g, x, r - axis_from_end)
        };
        let local = || (Class::Local, "token-local".to_string());
        match op {
            // Own-grid and plan-step ops: each has a token structure of its own.
            Op::CausalAttention { .. } => (Class::Heavy, "attention over all earlier tokens".into()),
            Op::CausalAttentionGrad { .. } => (Class::Heavy, "attention backward over all tokens".into()),
            Op::SoftmaxCrossEntropy => {
                (Class::Heavy, "cross-entropy over the vocabulary, reduced to a scalar".into())
            }
            Op::LinearCrossEntropy { .. } => {
                (Class::Heavy, "output projection and cross-entropy, the logits in row chunks".into())
            }
            Op::LinearCrossEntropyGrad { .. } => {
                (Class::Heavy, "vocabulary-loss gradient, the logits recomputed in row chunks".into())
            }
            Op::GroupedMatMul { .. } => {
                (Class::Heavy, "grouped matrix product over expert row groups".into())
            }
            Op::GroupedMatMulGrad { .. } => {
                (Class::Heavy, "grouped weight gradient, summed over each expert's rows".into())
            }
            Op::MoeRoute { .. } => (Class::Reduction, "orders every token's expert assignments".into()),
            Op::TemporalAugmentGrad { wrt, .. } if *wrt > 0 => {
                (Class::Reduction, "convolution-kernel gradient sums over tokens".into())
            }
            // The norm projection normalizes rows as the row-wise family does.
            Op::NormProject { .. } if reduces_last(1) => {
                (Class::Reduction, "normalizes over a token axis".into())
            }
            Op::TemporalAugment { .. } | Op::TemporalAugmentGrad { .. } | Op::NormProject { .. } => local(),
            // Attribute-dependent members of their families.
            Op::MatMul { trans_a, trans_b } => self.classify_matmul(id, *trans_a, *trans_b),
            Op::Reduce { axis, .. } if t.is_token_axis(g, inputs[0], *axis) => {
                (Class::Reduction, format!("sums axis {axis} of {}, a token axis", dims(g, inputs[0])))
            }
            Op::ScatterAdd { axis } | Op::ScatterRows { axis } => {
                let idx = inputs[1];
                let rank = g.node(idx).shape.rank();
                if (*axis..rank).any(|k| t.is_token_axis(g, idx, k)) || t.is_token_axis(g, inputs[0], *axis) {
                    (Class::Reduction, "scatters token rows into a shared table".into())
                } else {
                    local()
                }
            }
            op => match op.family() {
                OpFamily::Source(_) => (Class::Source, "source".into()),
                OpFamily::View(_) if root => {
                    (Class::Local, "view requested as a root: materialized by a copy".into())
                }
                OpFamily::View(_) => (Class::View, "view: index math".into()),
                OpFamily::RowWise if reduces_last(1) => {
                    (Class::Reduction, "normalizes over a token axis".into())
                }
                OpFamily::MatrixWise if reduces_last(1) || reduces_last(2) => {
                    (Class::Reduction, "normalizes over a token axis".into())
                }
                // A reduction over a non-token axis and a gather (its rows by index, at
                // its own token) are token-local; so is every remaining family member.
                OpFamily::Elementwise
                | OpFamily::Reduction
                | OpFamily::RowWise
                | OpFamily::MatrixWise
                | OpFamily::Contraction
                | OpFamily::Indexed
                | OpFamily::OwnGrid
                | OpFamily::PlanStep => local(),
            },
        }
    }

    fn classify_matmul(&self, id: NodeId, trans_a: bool, trans_b: bool) -> (Class, String) {
        let (g, t) = (self.graph, &self.tokens);
        let inputs = g.inputs(id);
        let (a, b) = (inputs[0], inputs[1]);
        let (ra, rb) = (g.node(a).shape.rank(), g.node(b).shape.rank());
        let ka = if trans_a { ra - 2 } else { ra - 1 };
        let kb = if trans_b { rb - 1 } else { rb - 2 };
        let k = g.node(a).shape.dims()[ka];
        let shapes = format!("{}x{}", dims(g, a), dims(g, b));
        if t.is_token_axis(g, a, ka) || t.is_token_axis(g, b, kb) {
            return (Class::Reduction, format!("{shapes} contracts over tokens (weight gradient): split-K"));
        }
        let r = g.node(id).shape.rank();
        if t.is_token_axis(g, id, r - 2) || t.is_token_axis(g, id, r - 1) {
            return (Class::Heavy, format!("{shapes}: token rows against a shared matrix (GEMM)"));
        }
        let per_token = (0..r - 2).any(|axis| t.is_token_axis(g, id, axis));
        let (ta, tb) = (t.is_token_shaped(g, a), t.is_token_shaped(g, b));
        if per_token && ta && tb {
            return (Class::Local, format!("{shapes}: per-token product of per-token operands, unrolled"));
        }
        if per_token {
            let shared = stored(g, if ta { b } else { a });
            return if k <= SMALL_CONTRACTION && shared <= SMALL_SHARED_OPERAND {
                (Class::Local, format!("{shapes}: per-token contraction of {k} with a {shared}-element shared operand, unrolled"))
            } else {
                (Class::Heavy, format!("{shapes}: per-token contraction of {k} with a {shared}-element shared operand, too large to unroll"))
            };
        }
        if stored(g, a) <= SMALL_SHARED_OPERAND && stored(g, b) <= SMALL_SHARED_OPERAND {
            (Class::Local, format!("{shapes}: small token-free product"))
        } else {
            (Class::Heavy, format!("{shapes}: token-free product of large operands"))
        }
    }
}

/// The union-find-free cluster state of the greedy merge: clusters are named by their
/// smallest member position, so a cluster can only reach another if its name is below
/// the other's largest member position.
struct Clusters {
    of: Vec<usize>,
    members: Vec<Vec<usize>>,
    max_pos: Vec<usize>,
    /// Whether the cluster is a token reduction (possibly with its epilogue).
    reduction: Vec<bool>,
    notes: Vec<Vec<String>>,
    stamp: Vec<usize>,
    epoch: usize,
}

impl Clusters {
    fn new(n: usize) -> Clusters {
        Clusters {
            of: (0..n).collect(),
            members: (0..n).map(|p| vec![p]).collect(),
            max_pos: (0..n).collect(),
            reduction: vec![false; n],
            notes: vec![Vec::new(); n],
            stamp: vec![0; n],
            epoch: 0,
        }
    }

    /// Whether fusing clusters `x` and `y` would close a cycle through a third cluster.
    fn would_cycle(&mut self, a: &Analysis, x: usize, y: usize) -> bool {
        self.epoch += 1;
        let limit = self.max_pos[x].max(self.max_pos[y]);
        let mut stack = Vec::new();
        for c in [x, y] {
            self.stamp[c] = self.epoch;
        }
        for c in [x, y] {
            for &m in &self.members[c] {
                for &u in &a.users[m] {
                    let cu = self.of[u];
                    if self.stamp[cu] != self.epoch && cu < limit {
                        self.stamp[cu] = self.epoch;
                        stack.push(cu);
                    }
                }
            }
        }
        while let Some(c) = stack.pop() {
            for &m in &self.members[c] {
                for &u in &a.users[m] {
                    let cu = self.of[u];
                    if cu == x || cu == y {
                        return true;
                    }
                    if self.stamp[cu] != self.epoch && cu < limit {
                        self.stamp[cu] = self.epoch;
                        stack.push(cu);
                    }
                }
            }
        }
        false
    }

    /// A stencil read between the two clusters, as (consumer, producer).
    fn stencil_between(&self, a: &Analysis, x: usize, y: usize) -> Option<(usize, usize)> {
        for (c, other) in [(x, y), (y, x)] {
            for &m in &self.members[c] {
                if let Some(&(q, _)) = a.reads[m].iter().find(|&&(q, st)| st && self.of[q] == other) {
                    return Some((m, q));
                }
            }
        }
        None
    }

    fn merge(&mut self, x: usize, y: usize) -> usize {
        let (keep, gone) = (x.min(y), x.max(y));
        let moved = std::mem::take(&mut self.members[gone]);
        for &m in &moved {
            self.of[m] = keep;
        }
        self.members[keep].extend(moved);
        self.members[keep].sort_unstable();
        self.max_pos[keep] = self.max_pos[keep].max(self.max_pos[gone]);
        self.reduction[keep] |= self.reduction[gone];
        let notes = std::mem::take(&mut self.notes[gone]);
        self.notes[keep].extend(notes);
        keep
    }
}

fn node_name(a: &Analysis, p: usize) -> String {
    let id = a.order[p];
    format!("n{} {}", id.index(), a.graph.node(id).op.name())
}

/// Puts token-free node `p` into the group of a token reduction it reads, as part of
/// that group's final phase (an epilogue on the reduced value, e.g. the scaling of a
/// gradient). Returns whether it did.
fn join_reduction(a: &Analysis, cl: &mut Clusters, p: usize) -> bool {
    for &(q, _) in &a.reads[p] {
        let c = cl.of[q];
        if cl.reduction[c] && a.backward[q] == a.backward[p] && !cl.would_cycle(a, cl.of[p], c) {
            cl.merge(cl.of[p], c);
            return true;
        }
    }
    false
}

/// Greedy merging in topological order (see the module doc for the rules).
fn cluster(a: &Analysis) -> Clusters {
    let n = a.order.len();
    let mut cl = Clusters::new(n);
    for p in 0..n {
        cl.reduction[p] = a.class[p] == Class::Reduction;
    }
    for p in 0..n {
        match a.class[p] {
            Class::Local if a.grid[p] <= 1 && join_reduction(a, &mut cl, p) => {}
            Class::Local => {
                let mut producers: Vec<(usize, bool)> = a.reads[p]
                    .iter()
                    .copied()
                    .filter(|&(q, _)| {
                        a.class[q] == Class::Local && a.backward[q] == a.backward[p] && a.grid[q] == a.grid[p]
                    })
                    .collect();
                producers.sort_by_key(|&(q, _)| (cl.of[q], q));
                for (q, stencil) in producers {
                    let (me, them) = (cl.of[p], cl.of[q]);
                    if me == them || cl.reduction[them] {
                        continue;
                    }
                    if stencil {
                        cl.notes[me].push(format!(
                            "{} reads {} at other tokens (stencil): the value comes from an earlier group",
                            node_name(a, p),
                            node_name(a, q)
                        ));
                        continue;
                    }
                    if let Some((c, s)) = cl.stencil_between(a, me, them) {
                        cl.notes[me].push(format!(
                            "not fused with the group of {}: {} would read {} at other tokens in the same kernel",
                            node_name(a, q),
                            node_name(a, c),
                            node_name(a, s)
                        ));
                        continue;
                    }
                    if cl.would_cycle(a, me, them) {
                        cl.notes[me].push(format!(
                            "not fused with the group of {}: the two would both feed and consume another group",
                            node_name(a, q)
                        ));
                        continue;
                    }
                    cl.merge(me, them);
                }
            }
            Class::Reduction => {
                for &(q, _) in &a.reads[p] {
                    let chain =
                        a.class[q] == Class::Reduction && a.backward[q] == a.backward[p] && a.users[q] == [p];
                    if chain
                        && cl.of[q] != cl.of[p]
                        && !a.roots.contains(&q)
                        && !cl.would_cycle(a, cl.of[p], cl.of[q])
                    {
                        cl.merge(cl.of[p], cl.of[q]);
                    }
                }
            }
            _ => {}
        }
    }
    cl
}

/// Merges token-local groups that read the same per-token value and neither
/// of which feeds the other (siblings), so that the value is read once
/// (docs/architecture.md §5: each input read once). Only values with token axes count: a
/// parameter or statistic shared by every token costs nothing to read twice.
/// The rules of [`cluster`] hold (same phase and tokens, no stencil edge
/// inside, the group graph acyclic).
///
/// The case it was written for is the SwiGLU backward (docs/math.md §1.3): the
/// gate's gradient `dh ⊙ up ⊙ silu'(gate)` and the up projection's `dh ⊙
/// silu(gate)` are two kernels that both read `dh`; one kernel reads it once
/// and has `gate` in hand, so that [`super::rematerialize`] computes
/// `silu(gate)` there instead of the forward pass writing it.
fn merge_siblings(a: &Analysis, cl: &mut Clusters) {
    for q in 0..a.order.len() {
        if !a.materialized[q] || a.grid[q] <= 1 {
            continue;
        }
        let local = |r: usize| a.class[r] == Class::Local && a.grid[r] == a.grid[q];
        let readers: Vec<usize> = a.users[q]
            .iter()
            .copied()
            .filter(|&r| local(r) && a.reads[r].iter().any(|&(v, st)| v == q && !st))
            .collect();
        for (i, &first) in readers.iter().enumerate() {
            for &other in &readers[i + 1..] {
                let (me, them) = (cl.of[first], cl.of[other]);
                let fits = me != them
                    && a.backward[first] == a.backward[other]
                    && a.grid[first] == a.grid[other]
                    && !cl.reduction[me]
                    && !cl.reduction[them];
                if !fits || cl.stencil_between(a, me, them).is_some() || cl.would_cycle(a, me, them) {
                    continue;
                }
                let kept = cl.merge(me, them);
                cl.notes[kept].push(format!(
                    "{} and {} in one kernel: both read {}",
                    node_name(a, first),
                    node_name(a, other),
                    node_name(a, q)
                ));
            }
        }
    }
}

/// Moves token-local nodes into the group of their consumers where that moves
/// fewer bytes: a value whose every user sits in one later token-local group
/// (same phase, same tokens) is computed there, together with the nodes of its
/// group that only it needs (its exclusive cone), instead of being written by
/// its own group and read back. It pays when what the later group must read
/// in addition (the cone's inputs it does not read already, plus any value of
/// the first group that now has to be written for it) is smaller than the
/// values no longer written and read, less the inputs the first group no
/// longer reads (all of them when the cone was the whole group).
///
/// mHC's `H_res·x` (docs/math.md §4.1, n·C per token), fused into the stream read,
/// was written and then read after the sublayer by the stream write; computed
/// in the write, it costs one more read of x and saves the write and the read
/// of n·C. In the backward, the norm-projection's `x · s` term of dx (§4.5, a
/// per-token scalar s) is computed by the kernel that sums dx's terms, which
/// reads x already. Nodes are visited last first; no FLOP is duplicated.
fn sink(a: &Analysis, cl: &mut Clusters) {
    let g = a.graph;
    let bytes = |q: usize| {
        let node = g.node(a.order[q]);
        node.shape.numel() * node.dtype.size_bytes()
    };
    let movable = |p: usize| a.class[p] == Class::Local && !a.roots.contains(&p) && !a.users[p].is_empty();
    for p in (0..a.order.len()).rev() {
        if !movable(p) {
            continue;
        }
        let home = cl.of[p];
        let target = cl.of[a.users[p][0]];
        let same =
            |u: usize| a.class[u] == Class::Local && a.backward[u] == a.backward[p] && a.grid[u] == a.grid[p];
        if target == home
            || cl.reduction[target]
            || cl.reduction[home]
            || !a.users[p].iter().all(|&u| cl.of[u] == target && same(u))
        {
            continue;
        }
        // The cone: p and the nodes of `home` whose users are all in the cone
        // or in `target`.
        let mut cone: Vec<usize> = vec![p];
        loop {
            let mut grown = false;
            for i in 0..cone.len() {
                for &(q, _) in &a.reads[cone[i]] {
                    let joins = cl.of[q] == home
                        && movable(q)
                        && same(q)
                        && !cone.contains(&q)
                        && a.users[q].iter().all(|u| cone.contains(u) || cl.of[*u] == target);
                    if joins {
                        cone.push(q);
                        grown = true;
                    }
                }
            }
            if !grown {
                break;
            }
        }
        let stencil = cone.iter().any(|&m| {
            a.reads[m].iter().any(|&(q, st)| st && (cl.of[q] == target || cone.contains(&q)))
                || a.users[m].iter().any(|&u| a.reads[u].iter().any(|&(q, st)| q == m && st))
        });
        if stencil {
            continue;
        }
        let target_reads = |q: usize| {
            cl.of[q] == target || cl.members[target].iter().any(|&m| a.reads[m].iter().any(|r| r.0 == q))
        };
        // A value of `home` that nothing outside it reads lives in registers
        // there; the cone reading it makes it a write and a read.
        let kept = |q: usize| {
            cl.of[q] != home || a.roots.contains(&q) || a.users[q].iter().any(|&u| cl.of[u] != home)
        };
        let inputs: BTreeSet<usize> =
            cone.iter().flat_map(|&m| a.reads[m].iter().map(|r| r.0)).filter(|q| !cone.contains(q)).collect();
        // Inputs the rest of `home` no longer reads are reads it saves.
        let home_reads = |q: usize| {
            cl.members[home].iter().any(|&m| !cone.contains(&m) && a.reads[m].iter().any(|r| r.0 == q))
        };
        let extra: usize = inputs
            .iter()
            .map(|&q| match (target_reads(q), kept(q)) {
                (true, _) => 0,
                (false, true) => bytes(q),
                (false, false) => 2 * bytes(q),
            })
            .sum();
        let unread: usize =
            inputs.iter().filter(|&&q| cl.of[q] != home && !home_reads(q)).map(|&q| bytes(q)).sum();
        let extra = extra.saturating_sub(unread);
        let saved: usize = cone
            .iter()
            .filter(|&&m| a.users[m].iter().any(|&u| cl.of[u] == target))
            .map(|&m| 2 * bytes(m))
            .sum();
        if extra >= saved {
            continue;
        }
        for &m in &cone {
            cl.members[home].retain(|&x| x != m);
            cl.members[target].push(m);
            cl.of[m] = target;
        }
        cl.members[target].sort_unstable();
        let names: Vec<String> = cone.iter().rev().map(|&m| node_name(a, m)).collect();
        cl.notes[target].push(format!(
            "{} computed here, where it is read, instead of written by the group of its inputs and read back ({extra} bytes more read or written, {saved} bytes less written and read)",
            names.join(", ")
        ));
    }
}

/// Partitions `graph` into fusion groups. `roots` are the values needed besides the
/// graph's named outputs (e.g. parameter gradients); they are always group outputs.
pub fn fuse(graph: &Graph, roots: &[NodeId]) -> Result<FusedGraph, FuseError> {
    let a = Analysis::new(graph, roots)?;
    let n = a.order.len();
    let mut cl = cluster(&a);
    sink(&a, &mut cl);
    merge_siblings(&a, &mut cl);

    // Group ids: the source group first, then clusters by their first member.
    let mut group_at: Vec<usize> = vec![usize::MAX; n];
    let mut cluster_group: HashMap<usize, usize> = HashMap::new();
    let mut count = 1;
    for (p, slot) in group_at.iter_mut().enumerate() {
        if !a.materialized[p] {
            continue;
        }
        if a.class[p] == Class::Source {
            *slot = 0;
            continue;
        }
        *slot = *cluster_group.entry(cl.of[p]).or_insert_with(|| {
            count += 1;
            count - 1
        });
    }
    // Views join their first consumer; views no consumer reads join their input's group.
    for p in 0..n {
        if a.materialized[p] {
            continue;
        }
        group_at[p] = match a.view_consumer[p] {
            Some(c) => group_at[c],
            None => {
                let input = graph.inputs(a.order[p])[0];
                group_at[a.pos[&input]]
            }
        };
    }

    let mut members: Vec<Vec<usize>> = vec![Vec::new(); count];
    for p in 0..n {
        members[group_at[p]].push(p);
    }
    let mut groups = Vec::with_capacity(count);
    for (gi, ps) in members.iter().enumerate() {
        groups.push(build_group(&a, &group_at, gi, ps));
    }
    let order = execution_order(&groups, &a, &group_at)?;
    let group_of = (0..n).map(|p| (a.order[p], GroupId(group_at[p]))).collect();
    let mut fused = FusedGraph { groups, order, group_of, tokens: a.tokens.clone() };
    describe(&mut fused, &a, &cl, &members);
    Ok(fused)
}

fn build_group(a: &Analysis, group_at: &[usize], gi: usize, ps: &[usize]) -> FusionGroup {
    let g = a.graph;
    let compute: Vec<usize> =
        ps.iter().copied().filter(|&p| a.materialized[p] && a.class[p] != Class::Source).collect();
    let mut inputs: BTreeSet<usize> = BTreeSet::new();
    for &p in &compute {
        inputs.extend(a.reads[p].iter().map(|&(q, _)| q).filter(|&q| group_at[q] != gi));
    }
    let outputs: Vec<usize> = ps
        .iter()
        .copied()
        .filter(|&p| {
            a.materialized[p] && (a.roots.contains(&p) || a.users[p].iter().any(|&u| group_at[u] != gi))
        })
        .collect();
    let kind = match compute.first().map(|&p| a.class[p]) {
        None => GroupKind::Source,
        Some(Class::Heavy) => GroupKind::Heavy(a.order[compute[0]]),
        Some(Class::Reduction) => GroupKind::TokenReduction,
        _ => GroupKind::TokenLocal,
    };
    let tokens = match kind {
        GroupKind::Source => 0,
        GroupKind::TokenReduction => a.reads[compute[0]].iter().map(|&(q, _)| a.grid[q]).max().unwrap_or(1),
        _ => compute.iter().map(|&p| a.grid[p]).max().unwrap_or(1),
    };
    let bytes = |ps: &mut dyn Iterator<Item = usize>| -> usize {
        ps.map(|p| {
            let node = g.node(a.order[p]);
            node.shape.numel() * node.dtype.size_bytes()
        })
        .sum()
    };
    let cost = GroupCost {
        flops: compute.iter().map(|&p| op_cost(g, a.order[p]).flops).sum(),
        bytes_read: bytes(&mut inputs.iter().copied()),
        bytes_written: bytes(&mut outputs.iter().copied()),
    };
    FusionGroup {
        id: GroupId(gi),
        kind,
        nodes: ps.iter().map(|&p| a.order[p]).collect(),
        inputs: inputs.into_iter().map(|p| a.order[p]).collect(),
        outputs: outputs.into_iter().map(|p| a.order[p]).collect(),
        tokens,
        cost,
        reason: String::new(),
    }
}

/// Kahn's algorithm on the group graph, lowest group id first.
fn execution_order(
    groups: &[FusionGroup],
    a: &Analysis,
    group_at: &[usize],
) -> Result<Vec<GroupId>, FuseError> {
    let count = groups.len();
    let mut succ: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); count];
    let mut indegree = vec![0usize; count];
    for group in groups {
        let gi = group.id.0;
        let deps: BTreeSet<usize> = group.inputs.iter().map(|i| group_at[a.pos[i]]).collect();
        for d in deps {
            if succ[d].insert(gi) {
                indegree[gi] += 1;
            }
        }
    }
    let mut ready: BTreeSet<usize> = (0..count).filter(|&g| indegree[g] == 0).collect();
    let mut order = Vec::with_capacity(count);
    while let Some(g) = ready.pop_first() {
        order.push(GroupId(g));
        for &s in &succ[g] {
            indegree[s] -= 1;
            if indegree[s] == 0 {
                ready.insert(s);
            }
        }
    }
    if order.len() != count {
        let stuck: Vec<String> = (0..count).filter(|&g| indegree[g] > 0).map(|g| format!("g{g}")).collect();
        return Err(FuseError::Cycle { groups: stuck.join(", ") });
    }
    Ok(order)
}

/// Writes each group's reason.
fn describe(fused: &mut FusedGraph, a: &Analysis, cl: &Clusters, members: &[Vec<usize>]) {
    let g = a.graph;
    let label = |fused: &FusedGraph, gid: GroupId| -> String {
        match fused.groups[gid.0].kind {
            GroupKind::Heavy(id) => format!("{} n{}", g.node(id).op.name(), id.index()),
            GroupKind::TokenReduction => format!("reduction {gid}"),
            GroupKind::Source => "sources".to_string(),
            GroupKind::TokenLocal => format!("region {gid}"),
        }
    };
    let mut reasons = Vec::with_capacity(fused.groups.len());
    for group in &fused.groups {
        let ps = &members[group.id.0];
        let compute: Vec<usize> =
            ps.iter().copied().filter(|&p| a.materialized[p] && a.class[p] != Class::Source).collect();
        let span = match (ps.first(), ps.last()) {
            (Some(&f), Some(&l)) if f != l => format!("n{}..n{}", a.order[f].index(), a.order[l].index()),
            (Some(&f), _) => format!("n{}", a.order[f].index()),
            _ => String::new(),
        };
        let views = ps.len() - compute.len();
        let io = format!(
            "reads {} input(s) once, writes {} output(s) once",
            group.inputs.len(),
            group.outputs.len()
        );
        let mut reason = match group.kind {
            GroupKind::Source => {
                let count = |f: fn(&Op) -> bool| ps.iter().filter(|&&p| f(&g.node(a.order[p]).op)).count();
                format!(
                    "{span}: {} input(s), {} parameter(s), {} constant(s): bound by the runtime or filled once",
                    count(|op| matches!(op, Op::Input { .. })),
                    count(|op| matches!(op, Op::Param(_))),
                    count(|op| matches!(op, Op::Constant { .. }))
                )
            }
            GroupKind::Heavy(id) => {
                // MatMul reasons start with the operand shapes: `n42 matmul [..]x[..]: ...`.
                let why = &a.why[a.pos[&id]];
                let sep = if why.starts_with('[') { " " } else { ": " };
                format!("n{} {}{sep}{why}: heavy op, own kernel ({io})", id.index(), g.node(id).op.name())
            }
            GroupKind::TokenReduction => {
                let first = compute[0];
                let reductions = compute.iter().filter(|&&p| a.class[p] == Class::Reduction).count();
                let epilogue = compute.len() - reductions;
                let mut extra = String::new();
                if reductions > 1 {
                    extra.push_str(&format!(", {reductions} chained reductions"));
                }
                if epilogue > 0 {
                    extra
                        .push_str(&format!(", {epilogue} token-free op(s) on the result in the final phase"));
                }
                format!(
                    "{span} {} over {} tokens: {}; two-phase (per-block partials, then a final reduction){extra} ({io})",
                    g.node(a.order[first]).op.name(),
                    group.tokens,
                    a.why[first],
                )
            }
            GroupKind::TokenLocal => {
                let mut before: BTreeSet<String> = BTreeSet::new();
                for i in &group.inputs {
                    before.insert(label(fused, fused.group_of[i]));
                }
                let mut after: BTreeSet<String> = BTreeSet::new();
                for o in &group.outputs {
                    for &u in &a.users[a.pos[o]] {
                        let gid = fused.group_of[&a.order[u]];
                        if gid != group.id {
                            after.insert(label(fused, gid));
                        }
                    }
                    if a.roots.contains(&a.pos[o]) {
                        after.insert("graph outputs".to_string());
                    }
                }
                let phase =
                    if compute.first().is_some_and(|&p| a.backward[p]) { "backward" } else { "forward" };
                let list = |s: BTreeSet<String>| {
                    if s.is_empty() {
                        "nothing".to_string()
                    } else {
                        s.into_iter().collect::<Vec<_>>().join(", ")
                    }
                };
                format!(
                    "{span} fused: {phase} token-local region of {} op(s) and {views} view(s) over {} tokens between {} and {} ({io})",
                    compute.len(),
                    group.tokens,
                    list(before),
                    list(after)
                )
            }
        };
        if let Some(&first) = compute.first() {
            for note in &cl.notes[cl.of[first]] {
                reason.push_str("; ");
                reason.push_str(note);
            }
        }
        reasons.push(reason);
    }
    for (group, reason) in fused.groups.iter_mut().zip(reasons) {
        group.reason = reason;
    }
}

impl FusedGraph {
    /// The group holding `id`.
    pub fn group_of(&self, id: NodeId) -> Option<GroupId> {
        self.group_of.get(&id).copied()
    }

    pub fn group(&self, id: GroupId) -> &FusionGroup {
        &self.groups[id.0]
    }

    /// The token-axis analysis the partition was made with.
    pub fn token_axes(&self) -> &TokenAxes {
        &self.tokens
    }

    /// One line per group in execution order: id, kind, and the reason for it
    /// (`widen compile --explain`).
    pub fn explain(&self) -> String {
        let mut out = String::new();
        for &gid in &self.order {
            let group = self.group(gid);
            let kind = match group.kind {
                GroupKind::Source => "source",
                GroupKind::Heavy(_) => "heavy",
                GroupKind::TokenLocal => "token-local",
                GroupKind::TokenReduction => "token-reduction",
            };
            out.push_str(&format!("{gid} {kind}: {}\n", group.reason));
        }
        out
    }

    /// Checks the partition against `graph`: every node in exactly one group, heavy
    /// groups hold one non-view node, inputs and outputs are consistent, and `order`
    /// is a permutation of the groups in which every group follows its producers.
    pub fn check(&self, graph: &Graph) -> Result<(), FuseError> {
        let invalid = |m: String| Err(FuseError::Invalid(m));
        let mut seen: HashMap<NodeId, GroupId> = HashMap::new();
        for group in &self.groups {
            for &id in &group.nodes {
                if let Some(other) = seen.insert(id, group.id) {
                    return invalid(format!("n{} is in {other} and {}", id.index(), group.id));
                }
            }
            if let GroupKind::Heavy(h) = group.kind {
                let compute: Vec<&NodeId> =
                    group.nodes.iter().filter(|&&id| !graph.node(id).op.is_view()).collect();
                if compute != [&h] {
                    return invalid(format!("heavy {} holds more than n{}", group.id, h.index()));
                }
            }
            for &i in &group.inputs {
                if self.group_of(i) == Some(group.id) {
                    return invalid(format!("{} reads its own n{} as an input", group.id, i.index()));
                }
            }
            for &o in &group.outputs {
                if self.group_of(o) != Some(group.id) {
                    return invalid(format!(
                        "{} lists n{} as an output it does not compute",
                        group.id,
                        o.index()
                    ));
                }
            }
        }
        for id in graph.node_ids() {
            if !seen.contains_key(&id) {
                return invalid(format!("n{} is in no group", id.index()));
            }
        }
        let mut at: HashMap<GroupId, usize> = HashMap::new();
        for (i, &gid) in self.order.iter().enumerate() {
            if at.insert(gid, i).is_some() || gid.0 >= self.groups.len() {
                return invalid(format!("{gid} appears twice in the order or does not exist"));
            }
        }
        if at.len() != self.groups.len() {
            return invalid("the order misses groups".into());
        }
        for group in &self.groups {
            for &i in &group.inputs {
                let producer =
                    self.group_of(i).ok_or(FuseError::Invalid(format!("n{} has no group", i.index())))?;
                if !self.group(producer).outputs.contains(&i) {
                    return invalid(format!(
                        "{} reads n{}, which {producer} does not output",
                        group.id,
                        i.index()
                    ));
                }
                if at[&producer] >= at[&group.id] {
                    return invalid(format!("{} runs before its producer {producer}", group.id));
                }
            }
        }
        Ok(())
    }
}

/// Fused residual-stream traffic per sublayer, in units of `d_model` elements per
/// token, as (read, write).
///
/// Over every group holding a trunk [`Region::Connection`] node, the elements of its
/// token-shaped inputs and outputs whose producer belongs to a trunk sublayer
/// (connection or backbone role with `sublayer < sublayers`, outside MTP modules),
/// divided by `tokens` (B·T of the trunk), `d_model` and `sublayers` (2L). Parameters
/// and other token-free values are not counted, as in the unfused figure of
/// [`crate::cost::GraphCounts::traffic_per_sublayer`]; the token ids read by the
/// embedding and the final norm's output (head) are not sublayer traffic either.
/// Because the branch's pre-norm fuses into the connection kernel, the figure includes
/// the write of the branch input (docs/math.md §4.7 counts it as the "C write" of the pre
/// kernel; the unfused graph counts it as backbone).
pub fn connection_traffic(
    graph: &Graph,
    fused: &FusedGraph,
    tokens: usize,
    sublayers: usize,
    d_model: usize,
) -> (f64, f64) {
    let axes = fused.token_axes();
    let trunk = |id: NodeId| {
        let role = graph.node(id).role;
        role.mtp.is_none() && role.sublayer.is_some_and(|l| l < sublayers)
    };
    let elements = |ids: &[NodeId]| -> f64 {
        ids.iter()
            .filter(|&&id| trunk(id) && axes.is_token_shaped(graph, id))
            .map(|&id| graph.node(id).shape.numel() as f64)
            .sum()
    };
    let (mut read, mut write) = (0.0, 0.0);
    for group in &fused.groups {
        if group.nodes.iter().any(|&id| trunk(id) && graph.node(id).role.region == Region::Connection) {
            read += elements(&group.inputs);
            write += elements(&group.outputs);
        }
    }
    let scale = 1.0 / (tokens as f64 * d_model as f64 * sublayers.max(1) as f64);
    (read * scale, write * scale)
}

/// Errors of [`fused_connection_traffic`].
#[derive(Debug, thiserror::Error)]
pub enum TrafficError {
    #[error(transparent)]
    Lower(#[from] crate::lower::LowerError),
    #[error(transparent)]
    Fuse(#[from] FuseError),
}

/// Fused connection traffic per sublayer of `spec`, (read, write) in units of D, on
/// the same forward graph the unfused figure of [`crate::cost::count_spec`] counts
/// (batch 1, `train.seq_len` tokens), so the two can be shown side by side.
pub fn fused_connection_traffic(spec: &crate::spec::ModelSpec) -> Result<(f64, f64), TrafficError> {
    let t = spec.train.seq_len;
    let lowered = crate::lower::lower(spec, 1, t)?;
    let fused = fuse(&lowered.graph, &[])?;
    Ok(connection_traffic(&lowered.graph, &fused, t, spec.sublayers(), spec.d_model))
}
