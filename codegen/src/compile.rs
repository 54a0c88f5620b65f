//! From a differentiated graph and a partition of its nodes to a [`Plan`]
//! (docs/architecture.md §2, §5, §7).
//!
//! A partition is a list of node groups in execution order (from
//! [`ir::passes::fuse()`] via [`fused_partition`], or [`one_op_per_group`]).
//! [`compile`] accepts any partition that respects dependencies: each group is
//! cut into *units* (a fused kernel of the ops that can share one item split,
//! see [`crate::emit::itemize`], an own-grid op such as attention, or a
//! library GEMM), so a group whose ops cannot run as one kernel is split
//! rather than miscompiled. Values crossing units get buffers: parameters,
//! inputs, named outputs and gradients keep their roles, every other one is
//! scratch placed in a per-dtype arena by a liveness-based first fit.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::c_void;

use ir::graph::{Graph, NodeId, Op};
use ir::DType;
use thiserror::Error;

use crate::cc::{CcError, Compiler};
pub use crate::emit::Target;
use crate::emit::{self, Arg, EmitError, Launch, Residency};
use crate::kernel::{item, Access, Kernel, KernelBuilder};
use crate::plan::{BufferDecl, BufferId, BufferRole, Chain, Gemm, GroupedGemm, Plan, Step};

/// Node groups in execution order.
pub type Partition = Vec<Vec<NodeId>>;

/// What the Plan must expose besides parameters and the data input.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Request {
    /// Named values read back by the runtime (`loss`, `logits`, ...).
    pub outputs: Vec<(String, NodeId)>,
    /// (parameter node, gradient node) pairs; the gradient buffer carries the
    /// parameter's name.
    pub grads: Vec<(NodeId, NodeId)>,
    /// The device the kernels are sized for (per-item scratch of fused kernels).
    pub target: Target,
    /// Append the optimizer update after the backward pass
    /// ([`crate::optimizer::append_adamw`]).
    pub update: bool,
}

impl Request {
    /// The graph's named outputs and the given gradients.
    pub fn new(graph: &Graph, grads: Vec<(NodeId, NodeId)>) -> Request {
        Request { outputs: graph.outputs().to_vec(), grads, target: Target::Cpu, update: false }
    }

    /// The same request with the optimizer update appended to its Plan.
    pub fn with_update(self) -> Request {
        Request { update: true, ..self }
    }

    /// The same request with kernels sized for `target`.
    pub fn for_target(self, target: Target) -> Request {
        Request { target, ..self }
    }

    fn roots(&self) -> Vec<NodeId> {
        self.outputs.iter().map(|o| o.1).chain(self.grads.iter().map(|g| g.1)).collect()
    }
}

/// Failures of [`compile`] and of the test runner.
#[derive(Debug, Error)]
pub enum CompileError {
    #[error("partition: node %{node} appears in more than one group")]
    Duplicate { node: usize },
    #[error("partition: node %{node} ({op}) is needed but in no group")]
    Missing { node: usize, op: &'static str },
    #[error("partition: node %{node} is not in the graph")]
    Unknown { node: usize },
    #[error("partition: %{node} reads %{input} (directly or through views), which a later group computes")]
    Order { node: usize, input: usize },
    #[error("gradient %{grad} is paired with %{param}, which is not a parameter")]
    NotParam { param: usize, grad: usize },
    #[error(transparent)]
    Update(#[from] crate::optimizer::UpdateError),
    #[error("node %{node} ({op}) cannot be lowered alone: {reason}")]
    Lowering { node: usize, op: &'static str, reason: String },
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error(transparent)]
    Fuse(#[from] ir::passes::FuseError),
    #[error(transparent)]
    Cc(#[from] CcError),
    #[error("buffer {id}: {message}")]
    Buffer { id: usize, message: String },
}

/// Every non-source node, one group each, in the graph's topological order.
pub fn one_op_per_group(graph: &Graph) -> Partition {
    graph.topo_order().into_iter().filter(|&id| !graph.node(id).op.is_source()).map(|id| vec![id]).collect()
}

/// The partition of [`ir::passes::fuse()`] (sources dropped), in its execution order.
pub fn fused_partition(graph: &Graph, request: &Request) -> Result<Partition, CompileError> {
    let fused = ir::passes::fuse(graph, &request.roots())?;
    Ok(fused
        .order
        .iter()
        .map(|&g| fused.group(g).nodes.iter().copied().filter(|&id| !graph.node(id).op.is_source()).collect())
        .filter(|g: &Vec<NodeId>| !g.is_empty())
        .collect())
}

/// How a unit of a group runs.
#[derive(Debug, Clone)]
enum Unit {
    /// One thread-per-item kernel of `n` items over the nodes.
    Fused { nodes: Vec<NodeId>, n: usize },
    /// A node lowered on its own grid(s).
    Standalone(NodeId),
    /// A MatMul as a library GEMM.
    Gemm(NodeId),
}

impl Unit {
    fn nodes(&self) -> &[NodeId] {
        match self {
            Unit::Fused { nodes, .. } => nodes,
            Unit::Standalone(id) | Unit::Gemm(id) => std::slice::from_ref(id),
        }
    }
}

/// Multiply-adds per batch entry from which a MatMul grouped with other ops
/// still runs as a library GEMM rather than as emitted loops (below it the
/// per-item dot products of a fused kernel are cheaper than a separate step).
const GEMM_MIN_MACS: usize = 1 << 15;

/// Scratch buffers start at multiples of this many elements, so that on an
/// arena whose base is cache-line aligned every buffer is too (64 bytes of f32;
/// the Cpu device's non-temporal GEMM stores need it).
const ARENA_ALIGN: usize = 16;

/// The dimensions of a (batched) GEMM, as [`Gemm`] takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GemmShape {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    stride_a: usize,
    stride_b: usize,
    stride_c: usize,
}

impl GemmShape {
    /// Multiply-adds of one batch entry.
    fn macs(&self) -> usize {
        self.m * self.n * self.k
    }
}

/// How a node runs as one GEMM: the MatMul whose operands it reads, and the
/// nodes the GEMM computes on the way (a weight gradient's MatMul and partial sums).
#[derive(Debug, Clone)]
struct GemmForm {
    matmul: NodeId,
    absorbed: Vec<NodeId>,
    shape: GemmShape,
}

/// A MatMul's GEMM form, when one batch stride per operand expresses it.
fn gemm_shape(graph: &Graph, id: NodeId) -> Option<GemmShape> {
    let Op::MatMul { trans_a, trans_b } = graph.node(id).op else { return None };
    let o = graph.node(id).shape.dims();
    let inputs = graph.inputs(id);
    let (ad, bd) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
    let (m, n) = (o[o.len() - 2], o[o.len() - 1]);
    let k = if trans_a { ad[ad.len() - 2] } else { ad[ad.len() - 1] };
    let ob = &o[..o.len() - 2];
    let batch: usize = ob.iter().product();
    let stride = |x: &[usize]| {
        let xb = &x[..x.len() - 2];
        let mat = x[x.len() - 2] * x[x.len() - 1];
        if xb.iter().product::<usize>() == 1 {
            return Some(0);
        }
        let lead = ob.len() - xb.len();
        let same = (0..ob.len()).all(|i| if i < lead { ob[i] == 1 } else { xb[i - lead] == ob[i] });
        same.then_some(mat)
    };
    let (sa, sb) = (stride(ad)?, stride(bd)?);
    let shape = GemmShape { batch, m, n, k, trans_a, trans_b, stride_a: sa, stride_b: sb, stride_c: m * n };
    if batch > 1 && sb == 0 && sa == m * k && !trans_a {
        // Rows of every batch entry are rows of one matrix.
        return Some(GemmShape { batch: 1, m: m * batch, stride_a: 0, stride_b: 0, stride_c: 0, ..shape });
    }
    Some(shape)
}

/// A weight gradient as one GEMM: `id` sums a `MatMul{trans_a}` over all its
/// batch axes (a chain of leading-axis sums), so `Σ_b a_bᵀ·b_b` is `aᵀ·b` with
/// the batch axes folded into the contraction (docs/math.md §1.4). The MatMul and
/// the inner sums must feed nothing else and have no role.
fn summed_gemm(graph: &Graph, id: NodeId, roles: &BTreeMap<NodeId, Vec<BufferRole>>) -> Option<GemmForm> {
    let is_sum0 = |x: NodeId| {
        matches!(graph.node(x).op, Op::Reduce { op: ir::graph::ReduceOp::Sum, axis: 0, keepdim: false })
    };
    if !is_sum0(id) {
        return None;
    }
    let private = |x: NodeId| graph.users(x).len() == 1 && !roles.contains_key(&x);
    let mut absorbed = Vec::new();
    let mut x = graph.inputs(id)[0];
    while is_sum0(x) && private(x) {
        absorbed.push(x);
        x = graph.inputs(x)[0];
    }
    // The sums may reduce a reshape of the MatMul that merges its batch axes
    // (e.g. `[B, T, m, n]` viewed as `[B·T, m·n]`): same flat layout, the
    // summed leading elements are still exactly the batch entries.
    let summed = absorbed.len() + 1;
    let reshaped = matches!(graph.node(x).op, Op::Reshape { .. }) && private(x);
    let view_dims = graph.node(x).shape.dims().to_vec();
    if reshaped {
        absorbed.push(x);
        x = graph.inputs(x)[0];
    }
    if !matches!(graph.node(x).op, Op::MatMul { trans_a: true, trans_b: false }) || !private(x) {
        return None;
    }
    absorbed.push(x);
    let o = graph.node(x).shape.dims();
    let batch_axes = o.len() - 2;
    let batch_ok = if reshaped {
        view_dims.len() > summed
            && view_dims[..summed].iter().product::<usize>() == o[..batch_axes].iter().product::<usize>()
    } else {
        summed == batch_axes
    };
    if !batch_ok {
        return None;
    }
    let inputs = graph.inputs(x);
    let (ad, bd) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
    if ad.len() != o.len()
        || bd.len() != o.len()
        || ad[..batch_axes] != o[..batch_axes]
        || bd[..batch_axes] != o[..batch_axes]
    {
        return None;
    }
    let (m, n) = (o[batch_axes], o[batch_axes + 1]);
    let k = ad[..=batch_axes].iter().product();
    let shape =
        GemmShape { batch: 1, m, n, k, trans_a: true, trans_b: false, stride_a: 0, stride_b: 0, stride_c: 0 };
    Some(GemmForm { matmul: x, absorbed, shape })
}

/// The ops whose sibling nodes (one per `wrt` of a gradient, or per output of the
/// routing) are lowered together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SiblingOp {
    Attention,
    Temporal,
    /// `MoeRoute`'s Rows, Tokens and Counts over one input: one routing step writes
    /// all three (docs/math.md §1.6), so a layer routes once.
    Route,
}

/// What identifies the op a sibling node belongs to (the attention or temporal
/// augmentation a gradient differentiates, or a routing): its kind, its inputs and
/// its attributes besides the slot.
type GradKey = (SiblingOp, Vec<NodeId>, String);

/// The key and the slot of a node whose siblings (the other `wrt` of the same
/// op's gradient, the other outputs of the same routing) share one lowering, and
/// the number of slots.
fn grad_key(graph: &Graph, id: NodeId) -> Option<(GradKey, usize, usize)> {
    let inputs = graph.inputs(id);
    let (kind, attrs, wrt, slots) = match graph.node(id).op {
        Op::CausalAttentionGrad { scale, rope_base, wrt } => {
            (SiblingOp::Attention, format!("{scale:?} {rope_base:?}"), wrt, 3)
        }
        Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt } => {
            (SiblingOp::Temporal, format!("{gram_schmidt} {eps_rel:?}"), wrt, inputs.len() - 1)
        }
        Op::MoeRoute { experts, capacity, out } => {
            (SiblingOp::Route, format!("{experts} {capacity:?}"), emit::route_slot(out), 3)
        }
        Op::Input { .. }
        | Op::Param(_)
        | Op::Constant { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Affine { .. }
        | Op::Cast { .. }
        | Op::Reduce { .. }
        | Op::MatMul { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::ScatterRows { .. }
        | Op::TopK { .. }
        | Op::Softmax
        | Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::NormProject { .. }
        | Op::SoftmaxCrossEntropy
        | Op::CausalAttention { .. }
        | Op::Sinkhorn { .. }
        | Op::TemporalAugment { .. }
        | Op::SinkhornGrad { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. } => return None,
    };
    (wrt < slots).then_some(((kind, inputs, attrs), wrt, slots))
}

/// The sibling gradient nodes among `nodes`, by the op they differentiate.
fn grad_siblings(graph: &Graph, nodes: &HashSet<NodeId>) -> HashMap<GradKey, Vec<Option<NodeId>>> {
    let mut out: HashMap<GradKey, Vec<Option<NodeId>>> = HashMap::new();
    for &id in nodes {
        if let Some((key, wrt, slots)) = grad_key(graph, id) {
            out.entry(key).or_insert_with(|| vec![None; slots])[wrt] = Some(id);
        }
    }
    out
}

/// The gradient nodes lowered together (by `wrt`) and their lowering.
type SiblingLowering = (Vec<Option<NodeId>>, emit::Lowering);

/// Lowers gradient node `id` together with its siblings; `None` for other nodes.
fn lower_siblings(
    graph: &Graph,
    id: NodeId,
    siblings: &HashMap<GradKey, Vec<Option<NodeId>>>,
    name: &str,
    target: Target,
) -> Option<Result<SiblingLowering, emit::EmitError>> {
    let (key, _, _) = grad_key(graph, id)?;
    let outs = siblings.get(&key)?.clone();
    // `grad_key` decided which ops have siblings; only their lowering is chosen here.
    let lowering = match key.0 {
        SiblingOp::Attention => emit::attention_grads(graph, [outs[0], outs[1], outs[2]], name, target),
        SiblingOp::Temporal => emit::temporal_grads(graph, &outs, name, target),
        SiblingOp::Route => emit::moe_route(graph, &outs, name, target),
    };
    Some(lowering.map(|l| (outs, l)))
}

/// Strips `Reshape`s (which keep the flat layout) off a value.
fn through_reshapes(graph: &Graph, mut id: NodeId) -> NodeId {
    while matches!(graph.node(id).op, Op::Reshape { .. }) {
        id = graph.inputs(id)[0];
    }
    id
}

/// The nodes that read `id`'s memory: non-view consumers, looking through
/// views (every consumer folds them), plus views copied into a buffer.
fn real_users(graph: &Graph, id: NodeId, buffered: &dyn Fn(NodeId) -> bool, out: &mut Vec<NodeId>) {
    for (u, _) in graph.users(id) {
        if graph.node(u).op.is_view() {
            if buffered(u) {
                out.push(u);
            }
            real_users(graph, u, buffered, out);
        } else {
            out.push(u);
        }
    }
}

/// The non-view nodes whose values a read of `id` touches (views resolved).
fn producers(graph: &Graph, id: NodeId, out: &mut Vec<NodeId>) {
    if graph.node(id).op.is_view() {
        for i in graph.inputs(id) {
            producers(graph, i, out);
        }
    } else {
        out.push(id);
    }
}

/// Residency of values for one compile: which nodes have a plan buffer.
struct Buffered {
    set: HashSet<NodeId>,
}

impl Residency for Buffered {
    fn has_buffer(&self, id: NodeId) -> bool {
        self.set.contains(&id)
    }
}

/// Which nodes need a buffer when values live within `unit_of` (a node → unit
/// index map) and `forced` / role nodes always have one.
fn residency(
    graph: &Graph,
    nodes: &[NodeId],
    unit_of: &HashMap<NodeId, usize>,
    own_grid: &HashSet<NodeId>,
    forced: &HashSet<NodeId>,
) -> Buffered {
    let mut set: HashSet<NodeId> = forced.clone();
    for &id in graph.node_ids().iter() {
        if matches!(graph.node(id).op, Op::Param(_) | Op::Input { .. }) {
            set.insert(id);
        }
    }
    set.extend(own_grid.iter().copied());
    let pre = set.clone();
    let buffered = |u: NodeId| pre.contains(&u);
    for &id in nodes {
        let node = graph.node(id);
        if node.op.is_view() || matches!(node.op, Op::Constant { .. }) {
            continue;
        }
        let mut users = Vec::new();
        real_users(graph, id, &buffered, &mut users);
        let here = unit_of.get(&id);
        if users.iter().any(|u| own_grid.contains(u) || unit_of.get(u) != here) {
            set.insert(id);
        }
    }
    Buffered { set }
}

/// Compiles `graph` for the node groups of `partition` into a Plan, in phases: the
/// partition checked, buffer roles, GEMMs, units, buffers, then the steps.
pub fn compile(graph: &Graph, partition: &[Vec<NodeId>], request: &Request) -> Result<Plan, CompileError> {
    let order = graph.topo_order();
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let (mut groups, group_of) = checked_groups(graph, partition, request, &pos)?;
    let roles = buffer_roles(graph, request)?;
    let gemms = find_gemms(graph, &groups, &roles);
    order_groups(graph, &mut groups, &gemms, request.target);
    let (units, res) = units_and_residency(graph, &groups, &group_of, &gemms, request.target)?;
    let mut b = PlanBuilder { target: request.target, ..PlanBuilder::default() };
    let extra = allocate_buffers(graph, &mut b, &res, &roles, &pos);
    let copied = fill_and_copy_sources(graph, &mut b, &roles, &extra, &pos);
    lower_units(graph, &mut b, &units, &gemms, &res, &extra, &copied)?;
    b.plan_arena();
    let mut plan = Plan {
        kernels: b.kernels,
        steps: b.steps,
        buffers: b.buffers,
        arena_len: b.arena_len,
        update_start: None,
        chains: b.chains,
    };
    if request.update {
        crate::optimizer::append_adamw(&mut plan, request.target)?;
    }
    Ok(plan)
}

/// The groups of a partition, checked, and the group of each node.
type CheckedGroups = (Vec<Vec<NodeId>>, HashMap<NodeId, usize>);

/// The partition's groups with sources dropped and members in topological order
/// (each node once), with each node's group; an error where a node is unknown or
/// listed twice, where a node the request needs is in no group, or where a group
/// reads a value a later group computes.
fn checked_groups(
    graph: &Graph,
    partition: &[Vec<NodeId>],
    request: &Request,
    pos: &HashMap<NodeId, usize>,
) -> Result<CheckedGroups, CompileError> {
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    let mut group_of: HashMap<NodeId, usize> = HashMap::new();
    for g in partition {
        let mut nodes = Vec::new();
        for &id in g {
            if !pos.contains_key(&id) {
                return Err(CompileError::Unknown { node: id.index() });
            }
            if graph.node(id).op.is_source() {
                continue;
            }
            if group_of.insert(id, groups.len()).is_some() {
                return Err(CompileError::Duplicate { node: id.index() });
            }
            nodes.push(id);
        }
        nodes.sort_by_key(|id| pos[id]);
        if !nodes.is_empty() {
            groups.push(nodes);
        }
    }
    let roots = request.roots();
    let mut stack = roots.clone();
    let mut seen = HashSet::new();
    while let Some(id) = stack.pop() {
        if !pos.contains_key(&id) {
            return Err(CompileError::Unknown { node: id.index() });
        }
        if !seen.insert(id) {
            continue;
        }
        let node = graph.node(id);
        if !node.op.is_source() && !group_of.contains_key(&id) {
            return Err(CompileError::Missing { node: id.index(), op: node.op.name() });
        }
        stack.extend(graph.inputs(id));
    }
    for (gi, g) in groups.iter().enumerate() {
        for &id in g {
            let mut reads = Vec::new();
            for input in graph.inputs(id) {
                producers(graph, input, &mut reads);
            }
            if let Some(late) = reads.into_iter().find(|p| group_of.get(p).is_some_and(|&gj| gj > gi)) {
                return Err(CompileError::Order { node: id.index(), input: late.index() });
            }
        }
    }

    Ok((groups, group_of))
}

/// The roles of the buffers the runtime sees: parameters, inputs, named outputs and
/// gradients (named after their parameter).
fn buffer_roles(graph: &Graph, request: &Request) -> Result<BTreeMap<NodeId, Vec<BufferRole>>, CompileError> {
    let mut roles: BTreeMap<NodeId, Vec<BufferRole>> = BTreeMap::new();
    for id in graph.node_ids() {
        // Only the sources named here have roles of their own; every other op's buffer is
        // scratch unless requested below, so a new op needs no decision here.
        if let Op::Param(p) = &graph.node(id).op {
            roles.entry(id).or_default().push(BufferRole::Param { name: p.name.clone() });
        } else if let Op::Input { name } = &graph.node(id).op {
            roles.entry(id).or_default().push(BufferRole::Input { name: name.clone() });
        }
    }
    for (name, id) in &request.outputs {
        roles.entry(*id).or_default().push(BufferRole::Output { name: name.clone() });
    }
    for &(p, g) in &request.grads {
        let Op::Param(info) = &graph.node(p).op else {
            return Err(CompileError::NotParam { param: p.index(), grad: g.index() });
        };
        roles.entry(g).or_default().push(BufferRole::Grad { name: info.name.clone() });
    }

    Ok(roles)
}

/// Which nodes run as a library GEMM, and what that forces into memory.
struct Gemms {
    forms: HashMap<NodeId, GemmForm>,
    /// Views a GEMM reads as memory: copied right before the first GEMM that reads
    /// them, wherever the partition lists them (a partition may list a view in a
    /// group that runs after one of its consumers).
    views: HashSet<NodeId>,
    /// Nodes that have a buffer whatever the units: role nodes and GEMM operands.
    forced: HashSet<NodeId>,
    /// Nodes computed inside another node's GEMM: never materialized.
    absorbed: HashSet<NodeId>,
    /// Nodes on a grid of their own: GEMMs and own-grid ops.
    own_grid: HashSet<NodeId>,
}

/// GEMMs: a MatMul alone in its group (besides views) that one stride per
/// operand expresses, a large MatMul anywhere, and a weight gradient (a
/// token-contracting MatMul under the sums over its batch axes) as one GEMM
/// contracting over every token.
fn find_gemms(graph: &Graph, groups: &[Vec<NodeId>], roles: &BTreeMap<NodeId, Vec<BufferRole>>) -> Gemms {
    let mut gemms: HashMap<NodeId, GemmForm> = HashMap::new();
    let mut gemm_views: HashSet<NodeId> = HashSet::new();
    let mut forced: HashSet<NodeId> = roles.keys().copied().collect();
    for g in groups {
        let compute: Vec<NodeId> = g.iter().copied().filter(|&id| !graph.node(id).op.is_view()).collect();
        let alone = compute.len() == 1;
        for &id in &compute {
            let form = summed_gemm(graph, id, roles).or_else(|| {
                let shape = gemm_shape(graph, id)?;
                (alone || shape.macs() >= GEMM_MIN_MACS).then_some(GemmForm {
                    matmul: id,
                    absorbed: Vec::new(),
                    shape,
                })
            });
            if let Some(form) = form {
                for input in graph.inputs(form.matmul) {
                    let v = through_reshapes(graph, input);
                    forced.insert(v);
                    if graph.node(v).op.is_view() && !roles.contains_key(&v) {
                        gemm_views.insert(v);
                    }
                }
                gemms.insert(id, form);
            }
        }
    }
    let absorbed: HashSet<NodeId> = gemms.values().flat_map(|f| f.absorbed.iter().copied()).collect();
    gemms.retain(|id, _| !absorbed.contains(id));
    let own_grid: HashSet<NodeId> = groups
        .iter()
        .flatten()
        .copied()
        .filter(|&id| gemms.contains_key(&id) || emit::has_own_grid(&graph.node(id).op))
        .collect();

    Gemms { forms: gemms, views: gemm_views, forced, absorbed, own_grid }
}

/// A group is ordered around its Sinkhorn lanes form where it has one (the
/// other steps of its own there, temporal convolutions, are cheap to
/// place), around its GEMM or own-grid kernel otherwise.
fn order_groups(graph: &Graph, groups: &mut [Vec<NodeId>], gemms: &Gemms, target: Target) {
    let lanes = |id: NodeId| target == Target::Cpu && emit::has_lanes_form(graph, id);
    let own_kernel = |id: NodeId| gemms.own_grid.contains(&id);
    for g in groups {
        let pivot: &dyn Fn(NodeId) -> bool = if g.iter().any(|&id| lanes(id)) { &lanes } else { &own_kernel };
        around_own_step(graph, g, &gemms.forced, pivot);
    }
}

/// Units: greedy maximal runs of each group that share one item split, and the
/// residency of values once the units are known.
fn units_and_residency(
    graph: &Graph,
    groups: &[Vec<NodeId>],
    group_of: &HashMap<NodeId, usize>,
    gemms: &Gemms,
    target: Target,
) -> Result<(Vec<Unit>, Buffered), CompileError> {
    let Gemms { forms, views, forced, absorbed, own_grid } = gemms;
    let all: Vec<NodeId> = groups.iter().flatten().copied().collect();
    let all: Vec<NodeId> = all.into_iter().filter(|id| !absorbed.contains(id)).collect();
    let trial_res = residency(graph, &all, group_of, own_grid, forced);
    let mut units: Vec<Unit> = Vec::new();
    for g in groups {
        // Runs of ordinary nodes between the nodes that take a kernel of their own.
        let mut run: Vec<NodeId> = Vec::new();
        for &id in g.iter().filter(|id| !views.contains(id) && !absorbed.contains(id)) {
            let own = if own_grid.contains(&id) {
                Some(if forms.contains_key(&id) { Unit::Gemm(id) } else { Unit::Standalone(id) })
            } else if graph.node(id).op.is_view() && trial_res.has_buffer(id) {
                // A view copied for its role: a copy kernel of its own, parallel over
                // its elements rather than tied to the items of the ops around it.
                let n = emit::itemize(graph, &[id], &trial_res, target).unwrap_or(1);
                Some(Unit::Fused { nodes: vec![id], n })
            } else if target == Target::Cpu && emit::has_lanes_form(graph, id) {
                // A Sinkhorn projection runs on blocks of matrices, vectorized
                // across tokens (`emit::lower_sinkhorn_lanes`); its operands and
                // result are a few values per token.
                Some(Unit::Fused { nodes: vec![id], n: 1 })
            } else if target == Target::Cuda && emit::is_token_reduction(graph, id) {
                // On the GPU a reduction over tokens is a kernel of its own, so it
                // can run block-parallel (`emit::lower_column_reduce`) instead of
                // taking the few items of its consumers (a scalar gain gradient
                // would otherwise be one thread summing every token).
                let n = emit::itemize(graph, &[id], &trial_res, target).unwrap_or(1);
                Some(Unit::Fused { nodes: vec![id], n })
            } else {
                None
            };
            if let Some(unit) = own {
                split_run(graph, &std::mem::take(&mut run), &trial_res, target, &mut units)?;
                units.push(unit);
            } else {
                run.push(id);
            }
        }
        split_run(graph, &run, &trial_res, target, &mut units)?;
    }
    let unit_of: HashMap<NodeId, usize> =
        units.iter().enumerate().flat_map(|(u, unit)| unit.nodes().iter().map(move |&id| (id, u))).collect();
    let res = residency(graph, &all, &unit_of, own_grid, forced);

    Ok((units, res))
}

/// A plan buffer for every resident node: its first role, else a constant's
/// value or scratch. Returns the further buffers of nodes with more than one
/// role (a parameter that is also an output), filled by copies.
fn allocate_buffers(
    graph: &Graph,
    b: &mut PlanBuilder,
    res: &Buffered,
    roles: &BTreeMap<NodeId, Vec<BufferRole>>,
    pos: &HashMap<NodeId, usize>,
) -> Vec<(NodeId, BufferId)> {
    let mut extra: Vec<(NodeId, BufferId)> = Vec::new();
    let mut node_ids: Vec<NodeId> = res.set.iter().copied().collect();
    node_ids.sort_by_key(|id| pos[id]);
    for id in node_ids {
        let node = graph.node(id);
        let mut rs = roles.get(&id).cloned().unwrap_or_default().into_iter();
        // A buffer without a role is scratch, except a constant's (filled once at load).
        let primary = rs.next().unwrap_or(if let Op::Constant { value } = node.op {
            BufferRole::Constant { value }
        } else {
            BufferRole::Scratch { offset: 0 }
        });
        let buf = b.buffer(node.shape.numel(), node.dtype, primary, Some(id.index()));
        b.node_buf.insert(id, buf);
        for role in rs {
            extra.push((id, b.buffer(node.shape.numel(), node.dtype, role, Some(id.index()))));
        }
    }

    extra
}

/// The first steps: constants with a role filled, and sources with extra roles
/// copied. Returns the buffers copied.
fn fill_and_copy_sources(
    graph: &Graph,
    b: &mut PlanBuilder,
    roles: &BTreeMap<NodeId, Vec<BufferRole>>,
    extra: &[(NodeId, BufferId)],
    pos: &HashMap<NodeId, usize>,
) -> HashSet<BufferId> {
    let mut filled: Vec<(NodeId, BufferId)> = b.node_buf.iter().map(|(&id, &buf)| (id, buf)).collect();
    filled.sort_by_key(|(id, _)| pos[id]);
    for (id, buf) in filled {
        let node = graph.node(id);
        if let Op::Constant { value } = node.op {
            if roles.contains_key(&id) {
                let name = b.kernel_name("fill");
                let kernel = fill_kernel(&name, node.shape.numel(), node.dtype, value);
                b.push_kernel(kernel, vec![buf]);
            }
        }
    }
    let mut copied = HashSet::new();
    for &(id, dst) in extra {
        if graph.node(id).op.is_source() {
            b.push_copy(graph, id, dst);
            copied.insert(dst);
        }
    }
    copied
}

/// The steps of the units, in order, each followed by the copies into the
/// extra buffers of the nodes it computes.
fn lower_units(
    graph: &Graph,
    b: &mut PlanBuilder,
    units: &[Unit],
    gemms: &Gemms,
    res: &Buffered,
    extra: &[(NodeId, BufferId)],
    copied: &HashSet<BufferId>,
) -> Result<(), CompileError> {
    let target = b.target;
    let mut copied_views: HashSet<NodeId> = HashSet::new();
    // The gradients of one attention (or temporal augmentation) w.r.t. each of
    // its operands share one lowering, which computes what they share once.
    let siblings = grad_siblings(graph, &gemms.own_grid);
    let mut lowered_with_sibling: HashSet<NodeId> = HashSet::new();
    for unit in units {
        match unit {
            Unit::Fused { nodes, n } => {
                if !nodes.iter().any(|&id| res.has_buffer(id)) {
                    continue; // only views read by other units
                }
                let name = b.kernel_name(&unit_label(graph, nodes, res));
                let special = match lone_node(graph, nodes, res) {
                    Some(id) => special_lowering(graph, id, &name, target)?,
                    None => None,
                };
                let launch = match special {
                    Some(launch) => launch,
                    None => emit::lower_fused(graph, nodes, *n, res, &name, target)?,
                };
                b.push_launch(launch, &[]);
            }
            Unit::Standalone(id) => {
                if lowered_with_sibling.contains(id) {
                    continue;
                }
                let name = b.kernel_name(graph.node(*id).op.name());
                let lowering = match lower_siblings(graph, *id, &siblings, &name, target) {
                    Some(lowered) => {
                        let (outs, lowering) = lowered?;
                        lowered_with_sibling.extend(outs.iter().flatten().copied());
                        lowering
                    }
                    None => emit::lower_own_grid(graph, *id, &name, target)?,
                };
                b.push_lowering(lowering);
            }
            Unit::Gemm(id) => {
                let form = &gemms.forms[id];
                let inputs = graph.inputs(form.matmul);
                for &input in &inputs {
                    let v = through_reshapes(graph, input);
                    if gemms.views.contains(&v) && copied_views.insert(v) {
                        let n = emit::itemize(graph, &[v], res, target).unwrap_or(1);
                        let name = b.kernel_name("copy");
                        b.push_launch(emit::lower_fused(graph, &[v], n, res, &name, target)?, &[]);
                    }
                }
                let sh = form.shape;
                let (ga, gb) = b.gemm_operands(
                    b.node_buf[&through_reshapes(graph, inputs[0])],
                    b.node_buf[&through_reshapes(graph, inputs[1])],
                );
                let gemm = Gemm {
                    a: ga,
                    b: gb,
                    c: b.node_buf[id],
                    batch: sh.batch,
                    m: sh.m,
                    n: sh.n,
                    k: sh.k,
                    trans_a: sh.trans_a,
                    trans_b: sh.trans_b,
                    stride_a: sh.stride_a,
                    stride_b: sh.stride_b,
                    stride_c: sh.stride_c,
                    offsets: [0; 3],
                    accumulate: false,
                };
                b.steps.push(Step::Gemm(gemm));
            }
        }
        for &id in unit.nodes() {
            for &(src, dst) in extra {
                if src == id && !copied.contains(&dst) {
                    b.push_copy(graph, id, dst);
                }
            }
        }
    }
    Ok(())
}

/// A lowering of its own for a node alone in a fused unit where one fits better
/// than the thread-per-item kernel: a column reduction, GPU scatter columns, or
/// Sinkhorn lanes on the CPU.
fn special_lowering(
    graph: &Graph,
    id: NodeId,
    name: &str,
    target: Target,
) -> Result<Option<Launch>, EmitError> {
    match graph.node(id).op {
        Op::Reduce { .. } => emit::lower_column_reduce(graph, id, name, target),
        Op::ScatterAdd { .. } => emit::lower_scatter_columns(graph, id, name, target),
        Op::Sinkhorn { .. } | Op::SinkhornGrad { .. } if target == Target::Cpu => {
            emit::lower_sinkhorn_lanes(graph, id, name)
        }
        Op::Input { .. }
        | Op::Param(_)
        | Op::Constant { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Affine { .. }
        | Op::Cast { .. }
        | Op::MatMul { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Gather { .. }
        | Op::ScatterRows { .. }
        | Op::TopK { .. }
        | Op::Softmax
        | Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::NormProject { .. }
        | Op::SoftmaxCrossEntropy
        | Op::CausalAttention { .. }
        | Op::Sinkhorn { .. }
        | Op::TemporalAugment { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::SinkhornGrad { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. } => Ok(None),
    }
}

/// A kernel as the renderers print it: indices simplified, loops over the
/// same range fused (a value consumed in the loop that produces it becomes a
/// scalar and its local array goes), long loops split.
fn optimized(kernel: Kernel) -> Kernel {
    crate::kernel::split_loops(crate::kernel::fuse_loops(crate::kernel::simplify_indices(kernel)))
}

/// An optimized kernel in the form its target runs best: on the GPU a
/// thread-per-item kernel over long rows gets a warp per item
/// ([`crate::kernel::spread_over_lanes`]), so that a warp's loads are
/// consecutive elements of one row, not one element of each of 32 rows.
fn for_target(kernel: Kernel, target: Target) -> Kernel {
    match target {
        Target::Cpu => kernel,
        // An error would be a defect of the pass (`compile_specs` checks that
        // none occurs); the kernel as it was computes the same values.
        Target::Cuda => match crate::kernel::spread_over_lanes(&kernel) {
            Ok(Some(spread)) => spread,
            Ok(None) | Err(_) => kernel,
        },
    }
}

/// Splits a run of a group's ordinary nodes (in topological order) into fused
/// units, greedily: each unit takes as many of the next nodes as share one
/// item split whose scratch fits [`Target::local_limit`]. [`emit::itemize`]
/// bounds a unit's scratch by the local array every unmaterialized op
/// declares before loop fusion. On the C target, where that bound stops a
/// unit, the longest prefix whose arrays that survive optimization fit is
/// found by bisection ([`measured_items`]): elementwise chains over a token's
/// whole xHC state (the stream gradient's pieces, docs/math.md §6.8) become
/// scalars, so the pieces are summed in one pass rather than each written by
/// a kernel of its own and read back. On the GPU the bound stays: a thread's
/// scratch must fit registers and L1.
fn split_run(
    graph: &Graph,
    run: &[NodeId],
    res: &Buffered,
    target: Target,
    units: &mut Vec<Unit>,
) -> Result<(), CompileError> {
    let mut start = 0;
    while start < run.len() {
        let first = run[start];
        let mut n =
            emit::itemize(graph, &run[start..=start], res, target).ok_or_else(|| CompileError::Lowering {
                node: first.index(),
                op: graph.node(first).op.name(),
                reason: "no item split fits its operands".into(),
            })?;
        let mut end = start + 1;
        while let Some(m) = run.get(end).and_then(|_| emit::itemize(graph, &run[start..=end], res, target)) {
            n = m;
            end += 1;
        }
        if end < run.len() && target == Target::Cpu {
            // Longest fitting prefix; a longer prefix only adds arrays.
            let (mut fits, mut over) = (end, run.len() + 1);
            while over - fits > 1 {
                let mid = (fits + over) / 2;
                match measured_items(graph, &run[start..mid], res, target) {
                    Some(m) => (fits, n) = (mid, m),
                    None => over = mid,
                }
            }
            end = fits;
        }
        units.push(Unit::Fused { nodes: run[start..end].to_vec(), n });
        start = end;
    }
    Ok(())
}

/// Candidate splits of a unit whose scratch [`measured_items`] measures;
/// later ones are smaller items of the same unit, which rarely change what
/// loop fusion keeps.
const MEASURED_SPLITS: usize = 2;

/// The item count of a C kernel computing `nodes` whose optimized body keeps
/// at most [`Target::local_limit`] elements of local arrays, trying the first
/// [`MEASURED_SPLITS`] item splits. Values read outside `nodes` count as
/// materialized, as they will be once `nodes` is a unit.
fn measured_items(graph: &Graph, nodes: &[NodeId], res: &Buffered, target: Target) -> Option<usize> {
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    let mut escaping = HashSet::new();
    for &id in nodes {
        if graph.node(id).op.is_view() || matches!(graph.node(id).op, Op::Constant { .. }) {
            continue; // folded by their readers, as `residency` has it
        }
        let mut users = Vec::new();
        real_users(graph, id, &|u| res.set.contains(&u), &mut users);
        if users.iter().any(|u| !inside.contains(u)) {
            escaping.insert(id);
        }
    }
    let unit_res = UnitResidency { base: res, escaping };
    let limit = target.local_limit();
    emit::item_splits(graph, nodes, &unit_res, target).into_iter().take(MEASURED_SPLITS).map(|s| s.n).find(
        |&n| {
            emit::lower_fused(graph, nodes, n, &unit_res, "measured", target)
                .is_ok_and(|launch| optimized(launch.kernel).local_elements() <= limit)
        },
    )
}

/// A group's residency with the values a trial unit leaves to later units
/// materialized too ([`measured_items`]), without copying the group's set.
struct UnitResidency<'a> {
    base: &'a Buffered,
    escaping: HashSet<NodeId>,
}

impl Residency for UnitResidency<'_> {
    fn has_buffer(&self, id: NodeId) -> bool {
        self.base.has_buffer(id) || self.escaping.contains(&id)
    }
}

/// Orders a group around its one node that takes a step of its own (a GEMM,
/// an own-grid kernel, or on the CPU a Sinkhorn projection's lanes form,
/// [`emit::lower_sinkhorn_lanes`]), which cuts the group's fused kernel in
/// two: either its ancestors run before it and every other node after, or
/// every node that does not depend on it runs before it and its dependants
/// after. Each cut costs the values that cross it (written by the first
/// kernel, read by the second) and the inputs both kernels read; the cheaper
/// one is taken, so the cut does not follow from the order in which the
/// graph happens to list the group's independent nodes. In mHC's forward the
/// ancestors are the few coefficient logits, where the other cut would read
/// the N·C stream state twice; in its backward the stream gradients feed both
/// the Sinkhorn gradient and the other outputs, so everything but the logit
/// gradient's assembly runs first (docs/math.md §4.5). A group with two or more
/// such nodes keeps its order.
fn around_own_step(
    graph: &Graph,
    group: &mut Vec<NodeId>,
    buffered: &HashSet<NodeId>,
    own_step: &dyn Fn(NodeId) -> bool,
) {
    let mut pivots = group.iter().copied().filter(|&id| own_step(id));
    let (Some(pivot), None) = (pivots.next(), pivots.next()) else { return };
    let members: HashSet<NodeId> = group.iter().copied().collect();
    let closure = |start: NodeId, forward: bool| {
        let mut seen: HashSet<NodeId> = HashSet::new();
        let mut stack = vec![start];
        while let Some(id) = stack.pop() {
            let next: Vec<NodeId> =
                if forward { graph.users(id).iter().map(|&(u, _)| u).collect() } else { graph.inputs(id) };
            // Through views listed in other groups too: a member may read
            // another member through one (a view is listed with its first
            // consumer).
            for v in next {
                if (members.contains(&v) || graph.node(v).op.is_view()) && seen.insert(v) {
                    stack.push(v);
                }
            }
        }
        seen.retain(|v| members.contains(v));
        seen
    };
    let ancestors = closure(pivot, false);
    let dependants = closure(pivot, true);
    // The elements of values crossing the cut (twice: a write and a read) and of
    // outside inputs read on both sides.
    let cost = |before: &dyn Fn(NodeId) -> bool| -> usize {
        let reads = |side_before: bool| {
            let mut out = HashSet::new();
            for &id in group.iter().filter(|&&id| id != pivot && before(id) == side_before) {
                if graph.node(id).op.is_view() && !buffered.contains(&id) {
                    continue;
                }
                let mut ps = Vec::new();
                for i in graph.inputs(id) {
                    producers(graph, i, &mut ps);
                }
                out.extend(ps);
            }
            out
        };
        let (first, second) = (reads(true), reads(false));
        let mut pivot_reads = Vec::new();
        for i in graph.inputs(pivot) {
            producers(graph, i, &mut pivot_reads);
        }
        let numel = |id: &NodeId| graph.node(*id).shape.numel();
        let crossing: usize = second
            .iter()
            .chain(&pivot_reads)
            .collect::<HashSet<_>>()
            .into_iter()
            .filter(|p| members.contains(p) && before(**p) && !buffered.contains(p))
            .map(numel)
            .sum();
        let shared: usize = first.intersection(&second).filter(|p| !members.contains(p)).map(numel).sum();
        2 * crossing + shared
    };
    let ancestors_first = |id: NodeId| ancestors.contains(&id);
    let independents_first = |id: NodeId| !dependants.contains(&id) && id != pivot;
    let before: &dyn Fn(NodeId) -> bool = if cost(&ancestors_first) <= cost(&independents_first) {
        &ancestors_first
    } else {
        &independents_first
    };
    let (mut first, rest): (Vec<NodeId>, Vec<NodeId>) = group.iter().partition(|&&id| before(id));
    first.push(pivot);
    first.extend(rest.into_iter().filter(|&id| id != pivot));
    *group = first;
}

/// The only node a fused unit computes (the unit's other nodes are views and
/// constants folded into its reads): a `Reduce` may run as a column-blocked
/// reduction ([`emit::lower_column_reduce`]), a `ScatterAdd` split over its
/// columns ([`emit::lower_scatter_columns`]), a Sinkhorn projection
/// in C in blocks of matrices ([`emit::lower_sinkhorn_lanes`]).
fn lone_node(graph: &Graph, nodes: &[NodeId], res: &dyn Residency) -> Option<NodeId> {
    let mut computed = nodes.iter().copied().filter(|&id| {
        let op = &graph.node(id).op;
        res.has_buffer(id) || !(op.is_view() || matches!(op, Op::Constant { .. }))
    });
    let id = computed.next()?;
    computed.next().is_none().then_some(id)
}

/// `rms_norm_mul_add`: the distinct ops a fused kernel computes, in order (at most four).
fn unit_label(graph: &Graph, nodes: &[NodeId], res: &dyn Residency) -> String {
    let mut names: Vec<&str> = Vec::new();
    for &id in nodes {
        let op = &graph.node(id).op;
        if op.is_view() && !res.has_buffer(id) {
            continue;
        }
        let name = if op.is_view() { "copy" } else { op.name() };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.len() > 4 {
        names.truncate(4);
        names.push("etc");
    }
    names.join("_")
}

fn fill_kernel(name: &str, len: usize, dtype: DType, value: f64) -> Kernel {
    let mut k = KernelBuilder::new(name, emit::grid(len));
    let out = k.param("out", dtype, Access::Write, len);
    k.store(&out, item(), emit::lit(crate::kernel::Ty::of_storage(dtype), value));
    k.finish()
}

/// The temporary a launch computes from nothing (its only parameter, written),
/// if no other step of the lowering writes that temporary.
fn table_output(launch: &Launch, steps: &[emit::Work]) -> Option<usize> {
    let ([param], [Arg::Temp(t)]) = (launch.kernel.params.as_slice(), launch.args.as_slice()) else {
        return None;
    };
    if param.access != Access::Write {
        return None;
    }
    let writes_t = |work: &emit::Work| match work {
        emit::Work::Launch(l) => {
            l.args.iter().zip(&l.kernel.params).any(|(a, p)| *a == Arg::Temp(*t) && p.access.writable())
        }
        emit::Work::Gemm(g) => g.c == Arg::Temp(*t),
        emit::Work::Route(r) => [r.rows, r.tokens, r.counts].contains(&Arg::Temp(*t)),
        emit::Work::Grouped(g) => g.c == Arg::Temp(*t),
    };
    (steps.iter().filter(|w| writes_t(w)).count() == 1).then_some(*t)
}

#[derive(Default)]
struct PlanBuilder {
    /// Where the kernels run: GPU kernels are spread over lanes where they fit.
    target: Target,
    buffers: Vec<BufferDecl>,
    node_buf: HashMap<NodeId, BufferId>,
    kernels: Vec<Kernel>,
    steps: Vec<Step>,
    arena_len: usize,
    /// Tables computed so far (see [`PlanBuilder::push_lowering`]): the
    /// launch's kernel, unnamed, and the buffer holding its output.
    tables: Vec<(Kernel, BufferId)>,
    /// The index in `kernels` of each kernel structure pushed so far.
    kernel_by_structure: HashMap<String, usize>,
    /// The lowerings' chains ([`Chain`]) among the steps pushed so far.
    chains: Vec<Chain>,
}

impl PlanBuilder {
    fn buffer(&mut self, len: usize, dtype: DType, role: BufferRole, node: Option<usize>) -> BufferId {
        let id = BufferId(self.buffers.len());
        self.buffers.push(BufferDecl { id, len: len.max(1), dtype, role, node });
        id
    }

    /// `g<ordinal>_<label>`: unique, and a valid C identifier.
    fn kernel_name(&self, label: &str) -> String {
        format!("g{:03}_{label}", self.kernels.len())
    }

    /// Appends a launch of `kernel`, reusing an earlier kernel of the same
    /// structure ([`Kernel::structure_key`]): a deep model's layers then share
    /// their kernels, which keeps the C and CUDA translation units (and the
    /// compilers' time) the size of one layer's.
    fn push_kernel(&mut self, kernel: Kernel, args: Vec<BufferId>) {
        let key = kernel.structure_key();
        let index = match self.kernel_by_structure.get(&key) {
            Some(&index) => index,
            None => {
                self.kernels.push(for_target(optimized(kernel), self.target));
                self.kernel_by_structure.insert(key, self.kernels.len() - 1);
                self.kernels.len() - 1
            }
        };
        self.steps.push(Step::Kernel { kernel: index, args });
    }

    /// Pushes a lowering's steps with fresh scratch buffers for its
    /// temporaries, except that a table (a launch that reads nothing and
    /// writes only a temporary no other step of the lowering writes, such as
    /// attention's RoPE angles, docs/math.md §1.3) is computed once per Plan: a
    /// later identical launch reuses the first one's buffer, whose life then
    /// spans every user. Each layer's attention forward and backward would
    /// otherwise recompute the same table in f64.
    fn push_lowering(&mut self, lowering: emit::Lowering) {
        let emit::Lowering { steps, temps: temp_decls, chain } = lowering;
        let tables: Vec<Option<(usize, Kernel)>> = steps
            .iter()
            .map(|work| {
                let emit::Work::Launch(launch) = work else { return None };
                let t = table_output(launch, &steps)?;
                Some((t, Kernel { name: String::new(), ..launch.kernel.clone() }))
            })
            .collect();
        let mut reused: Vec<Option<BufferId>> = vec![None; temp_decls.len()];
        for (t, key) in tables.iter().flatten() {
            if let Some((_, buf)) = self.tables.iter().find(|(k, _)| k == key) {
                reused[*t] = Some(*buf);
            }
        }
        let temps: Vec<BufferId> = temp_decls
            .iter()
            .zip(&reused)
            .map(|(&(len, dtype), r)| {
                r.unwrap_or_else(|| self.buffer(len, dtype, BufferRole::Scratch { offset: 0 }, None))
            })
            .collect();
        // The Plan step each work starts at (a reused table adds none).
        let mut starts = Vec::with_capacity(steps.len() + 1);
        for (work, table) in steps.into_iter().zip(tables) {
            starts.push(self.steps.len());
            if let Some((t, key)) = table {
                if reused[t].is_some() {
                    continue;
                }
                self.tables.push((key, temps[t]));
            }
            self.push_work(work, &temps);
        }
        starts.push(self.steps.len());
        if let Some(c) = chain {
            let chain = Chain { start: starts[c.works.start], end: starts[c.works.end], entries: c.entries };
            // One step per work (no widening copy came in between), each
            // addressing whole entries.
            if chain.end - chain.start == c.works.len() && self.splits_into_entries(chain) {
                self.chains.push(chain);
            }
        }
    }

    /// Whether every step of `chain` fits it ([`Chain::misfit`]).
    fn splits_into_entries(&self, chain: Chain) -> bool {
        chain.entries > 0
            && self.steps[chain.steps()]
                .iter()
                .all(|s| chain.misfit(s, &self.kernels, &self.buffers).is_none())
    }

    fn push_work(&mut self, work: emit::Work, temps: &[BufferId]) {
        let buf = |a: Arg| match a {
            Arg::Node(id) => self.node_buf[&id],
            Arg::Temp(i) => temps[i],
        };
        match work {
            emit::Work::Launch(launch) => self.push_launch(launch, temps),
            emit::Work::Gemm(g) => {
                let g = g.map_buffers(buf);
                let (a, b) = self.gemm_operands(g.a, g.b);
                let gemm = Gemm { a, b, ..g };
                self.steps.push(Step::Gemm(gemm));
            }
            emit::Work::Route(r) => self.steps.push(Step::MoeRoute(r.map_buffers(buf))),
            emit::Work::Grouped(g) => {
                let g = g.map_buffers(buf);
                let (a, b) = self.gemm_operands(g.a, g.b);
                self.steps.push(Step::GroupedGemm(GroupedGemm { a, b, ..g }));
            }
        }
    }

    fn push_launch(&mut self, launch: Launch, temps: &[BufferId]) {
        let args = launch
            .args
            .iter()
            .map(|a| match a {
                Arg::Node(id) => self.node_buf[id],
                Arg::Temp(i) => temps[*i],
            })
            .collect();
        self.push_kernel(launch.kernel, args);
    }

    /// GEMM operands of one element type: a GEMM runs on two f32 or two bf16 inputs
    /// (cuBLAS GemmEx takes one input type), so when a bf16 operand meets an f32 one
    /// (the backward of a bf16 projection, docs/math.md §6.12) the bf16 one is widened, exactly,
    /// into an f32 scratch copy first.
    fn gemm_operands(&mut self, a: BufferId, b: BufferId) -> (BufferId, BufferId) {
        let (da, db) = (self.buffers[a.0].dtype, self.buffers[b.0].dtype);
        match (da, db) {
            (DType::Bf16, DType::F32) => (self.push_widen(a), b),
            (DType::F32, DType::Bf16) => (a, self.push_widen(b)),
            _ => (a, b),
        }
    }

    /// An f32 scratch copy of bf16 buffer `src` (the kernel's load widens each value).
    fn push_widen(&mut self, src: BufferId) -> BufferId {
        let len = self.buffers[src.0].len;
        let dst = self.buffer(len, DType::F32, BufferRole::Scratch { offset: 0 }, None);
        let name = self.kernel_name("widen");
        let mut k = KernelBuilder::new(&name, emit::grid(len));
        let from = k.param("src", DType::Bf16, Access::Read, len);
        let out = k.param("dst", DType::F32, Access::Write, len);
        k.store(&out, item(), from.at(item()));
        self.push_kernel(k.finish(), vec![src, dst]);
        dst
    }

    /// A copy of node `id`'s buffer into `dst` (a value with two roles).
    fn push_copy(&mut self, graph: &Graph, id: NodeId, dst: BufferId) {
        let node = graph.node(id);
        let len = node.shape.numel().max(1);
        let name = self.kernel_name("copy");
        let mut k = KernelBuilder::new(&name, emit::grid(len));
        let src = k.param("src", node.dtype, Access::Read, len);
        let out = k.param("dst", node.dtype, Access::Write, len);
        k.store(&out, item(), src.at(item()));
        let src_buf = self.node_buf[&id];
        self.push_kernel(k.finish(), vec![src_buf, dst]);
    }

    /// Places scratch buffers: each lives from the first to the last step that
    /// touches it; per dtype, buffers are placed in order of first use at the
    /// lowest offset not used by a buffer whose life overlaps (first fit).
    fn plan_arena(&mut self) {
        let mut life: HashMap<BufferId, (usize, usize)> = HashMap::new();
        for (s, step) in self.steps.iter().enumerate() {
            let ids = step.buffers();
            // A chain's steps may run entry by entry, interleaved: each buffer
            // it touches lives over all of it.
            let span =
                self.chains.iter().find(|c| c.steps().contains(&s)).map_or((s, s), |c| (c.start, c.end - 1));
            for id in ids {
                let e = life.entry(id).or_insert(span);
                e.0 = e.0.min(span.0);
                e.1 = e.1.max(span.1);
            }
        }
        let mut scratch: Vec<BufferId> = self
            .buffers
            .iter()
            .filter(|d| matches!(d.role, BufferRole::Scratch { .. }))
            .map(|d| d.id)
            .collect();
        scratch.sort_by_key(|id| (life.get(id).map_or(usize::MAX, |l| l.0), id.0));
        let mut placed: Vec<(DType, usize, usize, (usize, usize))> = Vec::new();
        for id in scratch {
            let (len, dtype) = (self.buffers[id.0].len, self.buffers[id.0].dtype);
            let span = life.get(&id).copied().unwrap_or((0, 0));
            let mut busy: Vec<(usize, usize)> = placed
                .iter()
                .filter(|p| p.0 == dtype && p.3 .0 <= span.1 && span.0 <= p.3 .1)
                .map(|p| (p.1, p.1 + p.2))
                .collect();
            busy.sort_unstable();
            let mut offset = 0;
            for (lo, hi) in busy {
                if offset + len <= lo {
                    break;
                }
                offset = offset.max(hi.next_multiple_of(ARENA_ALIGN));
            }
            placed.push((dtype, offset, len, span));
            self.buffers[id.0].role = BufferRole::Scratch { offset };
            if dtype == DType::F32 {
                self.arena_len = self.arena_len.max(offset + len);
            }
        }
    }
}

/// A [`Gemm`] of f32 operands as plain loops (the test runner's library product).
///
/// # Safety
/// Every batch entry of every operand lies inside the buffer `ptrs` gives for it.
unsafe fn naive_gemm(g: &Gemm, ptrs: &[*mut c_void]) {
    // SAFETY: the offsets lie inside the buffers (the caller's contract).
    let (pa, pb, pc) = unsafe {
        (
            (ptrs[g.a.0] as *const f32).add(g.offsets[0]),
            (ptrs[g.b.0] as *const f32).add(g.offsets[1]),
            (ptrs[g.c.0] as *mut f32).add(g.offsets[2]),
        )
    };
    for bt in 0..g.batch {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0.0f32;
                for kk in 0..g.k {
                    let ai = if g.trans_a { kk * g.m + i } else { i * g.k + kk };
                    let bi = if g.trans_b { j * g.k + kk } else { kk * g.n + j };
                    // SAFETY: indices stay within the operands' batch entries.
                    acc += unsafe { *pa.add(bt * g.stride_a + ai) * *pb.add(bt * g.stride_b + bi) };
                }
                // SAFETY: as above, for the output.
                unsafe {
                    let c = pc.add(bt * g.stride_c + i * g.n + j);
                    *c = if g.accumulate { *c + acc } else { acc };
                }
            }
        }
    }
}

/// Host data of one buffer for [`run_on_cpu_for_tests`].
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl HostData {
    fn zeros(dtype: DType, len: usize) -> Result<HostData, String> {
        match dtype {
            DType::F32 => Ok(HostData::F32(vec![0.0; len])),
            DType::I32 => Ok(HostData::I32(vec![0; len])),
            other => Err(format!("the test runner holds f32 and i32 buffers, not {other}")),
        }
    }

    fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }

    fn ptr(&mut self, offset: usize) -> *mut c_void {
        match self {
            HostData::F32(v) => v[offset..].as_mut_ptr().cast(),
            HostData::I32(v) => v[offset..].as_mut_ptr().cast(),
        }
    }

    /// The f32 values (empty for i32 data).
    pub fn as_f32(&self) -> &[f32] {
        match self {
            HostData::F32(v) => v,
            HostData::I32(_) => &[],
        }
    }
}

/// Runs a Plan sequentially on the host: kernels through the system C compiler
/// (each over its whole grid in one call), GEMMs as plain loops, scratch
/// buffers inside per-dtype arenas laid out as the Plan says (so an arena
/// placement error shows up as wrong values). `inputs` fill buffers before the
/// run (parameters, the token window); constants are filled from their role.
/// Returns every buffer's final contents (scratch buffers: their arena range).
///
/// This is the oracle runner of the codegen tests; the runtime's Cpu device
/// executes Plans with threads and an optimized GEMM.
pub fn run_on_cpu_for_tests(
    plan: &Plan,
    compiler: &Compiler,
    inputs: &[(BufferId, HostData)],
) -> Result<Vec<HostData>, CompileError> {
    let err = |id: usize, message: String| CompileError::Buffer { id, message };
    let lib = compiler.compile_kernels(&plan.kernels)?;
    let mut owned: Vec<Option<HostData>> = Vec::with_capacity(plan.buffers.len());
    let mut arena_len: HashMap<DType, usize> = HashMap::new();
    for d in &plan.buffers {
        match d.role {
            BufferRole::Scratch { offset } => {
                let e = arena_len.entry(d.dtype).or_default();
                *e = (*e).max(offset + d.len);
                owned.push(None);
            }
            BufferRole::Constant { value } => owned.push(Some(match d.dtype {
                DType::I32 => HostData::I32(vec![value as i32; d.len]),
                _ => HostData::F32(vec![value as f32; d.len]),
            })),
            _ => owned.push(Some(HostData::zeros(d.dtype, d.len).map_err(|m| err(d.id.0, m))?)),
        }
    }
    let mut arenas: HashMap<DType, HostData> = HashMap::new();
    for (&dtype, &len) in &arena_len {
        arenas.insert(dtype, HostData::zeros(dtype, len).map_err(|m| err(usize::MAX, m))?);
    }
    for (id, data) in inputs {
        let d = plan.buffers.get(id.0).ok_or_else(|| err(id.0, "no such buffer".into()))?;
        if data.len() != d.len
            || HostData::zeros(d.dtype, 0).map(|z| std::mem::discriminant(&z))
                != Ok(std::mem::discriminant(data))
        {
            return Err(err(id.0, format!("expected {} {} values", d.len, d.dtype)));
        }
        match &mut owned[id.0] {
            Some(slot) => *slot = data.clone(),
            None => return Err(err(id.0, "is scratch and cannot be an input".into())),
        }
    }
    let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(plan.buffers.len());
    for (d, o) in plan.buffers.iter().zip(owned.iter_mut()) {
        ptrs.push(match (o, &d.role) {
            (Some(data), _) => data.ptr(0),
            (None, BufferRole::Scratch { offset }) => {
                arenas.get_mut(&d.dtype).expect("arena sized above").ptr(*offset)
            }
            (None, _) => unreachable!("only scratch buffers live in arenas"),
        });
    }
    for step in &plan.steps {
        match step {
            Step::Kernel { kernel, args } => {
                let k = &plan.kernels[*kernel];
                let entry = lib.entry(&k.name)?;
                let a: Vec<*mut c_void> = args.iter().map(|id| ptrs[id.0]).collect();
                // SAFETY: every argument points to a live allocation of at least the
                // parameter's length and element type (sizes come from the same Plan),
                // and the call covers the whole grid on this thread only.
                unsafe { entry.call(&a, 0, k.grid.items() as i64) };
            }
            // SAFETY: the operands lie inside the buffers (checked by the devices' Plan check).
            Step::Gemm(g) => unsafe { naive_gemm(g, &ptrs) },
            Step::Zero { buffer } => {
                let d = &plan.buffers[buffer.0];
                // SAFETY: the buffer holds `len` elements of its dtype; zero bits are zero.
                unsafe {
                    std::ptr::write_bytes(ptrs[buffer.0].cast::<u8>(), 0, d.len * d.dtype.size_bytes())
                };
            }
            Step::MoeRoute(r) => {
                let lens = [r.assignments, r.assignments, r.assignments, r.experts];
                for (id, len) in [r.idx, r.rows, r.tokens, r.counts].into_iter().zip(lens) {
                    let d = &plan.buffers[id.0];
                    if d.dtype != DType::I32 || d.len < len {
                        return Err(err(id.0, format!("routing needs {len} i32 values")));
                    }
                }
                // SAFETY: i32 buffers of at least these lengths (checked above); the input is
                // copied first, and the arena keeps the outputs, alive at once, apart.
                let i32s = |id: BufferId, len| unsafe {
                    std::slice::from_raw_parts_mut(ptrs[id.0].cast::<i32>(), len)
                };
                let idx = i32s(r.idx, r.assignments).to_vec();
                let (rows, tokens, counts) =
                    (i32s(r.rows, r.assignments), i32s(r.tokens, r.assignments), i32s(r.counts, r.experts));
                ir::exec::moe::route_into(&idx, r.k, r.experts, r.capacity, rows, tokens, counts)
                    .map_err(|m| err(r.idx.0, m))?;
            }
            Step::GroupedGemm(g) => {
                let d = &plan.buffers[g.counts.0];
                if d.dtype != DType::I32 || d.len < g.groups {
                    return Err(err(g.counts.0, format!("group sizes need {} i32 values", g.groups)));
                }
                // SAFETY: checked above.
                let counts = unsafe { std::slice::from_raw_parts(ptrs[g.counts.0].cast::<i32>(), g.groups) };
                let (products, zeroed) = g.products(counts).map_err(|m| err(g.counts.0, m))?;
                for r in zeroed {
                    // SAFETY: the ranges lie inside c's extent (`GroupedGemm::products`).
                    unsafe { std::ptr::write_bytes(ptrs[g.c.0].cast::<f32>().add(r.start), 0, r.len()) };
                }
                for p in &products {
                    // SAFETY: each product lies inside the grouped product's extents.
                    unsafe { naive_gemm(p, &ptrs) };
                }
            }
        }
    }
    let mut out = Vec::with_capacity(plan.buffers.len());
    for (d, o) in plan.buffers.iter().zip(owned) {
        out.push(match (o, &d.role) {
            (Some(data), _) => data,
            (None, BufferRole::Scratch { offset }) => match &arenas[&d.dtype] {
                HostData::F32(v) => HostData::F32(v[*offset..offset + d.len].to_vec()),
                HostData::I32(v) => HostData::I32(v[*offset..offset + d.len].to_vec()),
            },
            (None, _) => unreachable!("only scratch buffers live in arenas"),
        });
    }
    Ok(out)
}
