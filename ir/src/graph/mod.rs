//! The graph IR: a petgraph `StableGraph` whose nodes are ops and whose edges
//! carry the operand slot (docs/architecture.md §4). Every node's shape and dtype are
//! inferred when it is added, so a malformed graph is rejected at the op that
//! makes it malformed, with both shapes in the error.

mod dump;
mod infer;
pub mod op;
mod shorthands;

pub use op::{
    BinaryOp, Init, MoeRouteOut, Op, OpFamily, ParamClass, ParamInfo, ReduceOp, Source, UnaryOp, View,
};
pub use shorthands::Build;

use crate::{DType, Shape};
use petgraph::stable_graph::{NodeIndex, StableGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::{Deserialize, Serialize};

/// A node handle.
pub type NodeId = NodeIndex<u32>;

/// Which part of the model a node belongs to: the cost model aggregates by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Region {
    /// Token embedding and stream creation.
    Embedding,
    /// Residual-stream machinery: coefficient generation, Read, Carry, Write (docs/math.md §0.3).
    Connection,
    /// The unchanged backbone sublayer F_l, including its own pre-norm.
    Backbone,
    /// Collapse / reduce of the streams before the final norm.
    Collapse,
    /// Final norm and unembedding.
    Head,
    /// Loss terms.
    Loss,
    /// Gradient computation (added by autodiff).
    Backward,
}

/// The role of a node: region, sublayer (0..2L, attention = even, FFN = odd) and
/// MTP module (None = main trunk, Some(k) = module k >= 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Role {
    pub region: Region,
    pub sublayer: Option<usize>,
    pub mtp: Option<usize>,
    /// Fraction of this op's work done per token: 1 except for MoE routed experts,
    /// which the reference computes densely and masks (top_k / experts).
    pub active_fraction: f64,
}

impl Role {
    pub fn new(region: Region) -> Self {
        Role { region, sublayer: None, mtp: None, active_fraction: 1.0 }
    }

    pub fn sublayer(mut self, sublayer: usize) -> Self {
        self.sublayer = Some(sublayer);
        self
    }

    pub fn mtp(mut self, module: Option<usize>) -> Self {
        self.mtp = module;
        self
    }

    pub fn active_fraction(mut self, fraction: f64) -> Self {
        self.active_fraction = fraction;
        self
    }
}

/// One node: an op with its inferred output type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub shape: Shape,
    pub dtype: DType,
    pub role: Role,
    /// Optional human-readable label (e.g. `blocks.0.attn.q`), shown in dumps.
    pub label: Option<String>,
}

/// Errors raised while building or checking a graph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    #[error("{op}: shape mismatch: {detail} (got {lhs} and {rhs})")]
    ShapeMismatch { op: String, detail: String, lhs: Shape, rhs: Shape },
    #[error("{op}: {message}")]
    Invalid { op: String, message: String },
    #[error("{op}: expected {expected} input(s), got {got}")]
    Arity { op: String, expected: String, got: usize },
    #[error("{op}: input {slot} has dtype {got}, expected {expected}")]
    DType { op: String, slot: usize, got: DType, expected: String },
}

/// A computation graph over concrete shapes.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    pub(crate) g: StableGraph<Node, usize>,
    role: Option<Role>,
    /// Named outputs (e.g. `loss`, `logits`), in insertion order.
    outputs: Vec<(String, NodeId)>,
}

impl Graph {
    pub fn new() -> Self {
        Graph::default()
    }

    /// Sets the role given to nodes added from now on.
    pub fn set_role(&mut self, role: Role) {
        self.role = Some(role);
    }

    /// The role new nodes currently get.
    pub fn role(&self) -> Role {
        self.role.unwrap_or(Role::new(Region::Backbone))
    }

    /// Adds a node, inferring its shape and dtype from its inputs.
    pub fn add(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId, GraphError> {
        self.add_labeled(op, inputs, None)
    }

    /// Adds a node with a label shown in dumps.
    pub fn add_labeled(
        &mut self,
        op: Op,
        inputs: &[NodeId],
        label: Option<String>,
    ) -> Result<NodeId, GraphError> {
        let types: Vec<(&Shape, DType)> =
            inputs.iter().map(|&i| (&self.g[i].shape, self.g[i].dtype)).collect();
        let (shape, dtype) = infer::infer(&op, &types)?;
        Ok(self.push(op, shape, dtype, inputs, label))
    }

    /// Adds a source node (input, parameter, constant) of a given type.
    pub fn add_source(&mut self, op: Op, shape: Shape, dtype: DType, label: Option<String>) -> NodeId {
        assert!(op.is_source(), "add_source takes only source ops, got {}", op.name());
        self.push(op, shape, dtype, &[], label)
    }

    fn push(
        &mut self,
        op: Op,
        shape: Shape,
        dtype: DType,
        inputs: &[NodeId],
        label: Option<String>,
    ) -> NodeId {
        let role = self.role();
        let id = self.g.add_node(Node { op, shape, dtype, role, label });
        for (slot, &input) in inputs.iter().enumerate() {
            self.g.add_edge(input, id, slot);
        }
        id
    }

    /// Records a named output.
    pub fn set_output(&mut self, name: &str, node: NodeId) {
        self.outputs.retain(|(n, _)| n != name);
        self.outputs.push((name.to_string(), node));
    }

    /// The node recorded under `name`.
    pub fn output(&self, name: &str) -> Option<NodeId> {
        self.outputs.iter().find(|(n, _)| n == name).map(|&(_, id)| id)
    }

    /// Removes the named output (the node stays; dead-code elimination removes it
    /// when nothing else needs it). Returns the node it named.
    pub fn remove_output(&mut self, name: &str) -> Option<NodeId> {
        let at = self.outputs.iter().position(|(n, _)| n == name)?;
        Some(self.outputs.remove(at).1)
    }

    /// Makes every reader of `old`, and every output naming it, read `new` instead
    /// (a rewrite's replacement of equal shape and type).
    pub(crate) fn replace_uses(&mut self, old: NodeId, new: NodeId) {
        for (user, port) in self.users(old) {
            if let Some(edge) = self.g.find_edge(old, user) {
                self.g.remove_edge(edge);
            }
            self.g.add_edge(new, user, port);
        }
        for output in self.outputs.iter_mut().filter(|(_, o)| *o == old) {
            output.1 = new;
        }
    }

    pub fn outputs(&self) -> &[(String, NodeId)] {
        &self.outputs
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.g[id]
    }

    pub fn node_count(&self) -> usize {
        self.g.node_count()
    }

    /// All node ids in insertion order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.g.node_indices().collect()
    }

    /// The inputs of a node, ordered by operand slot.
    pub fn inputs(&self, id: NodeId) -> Vec<NodeId> {
        let mut edges: Vec<(usize, NodeId)> =
            self.g.edges_directed(id, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        edges.sort_by_key(|&(slot, _)| slot);
        edges.into_iter().map(|(_, src)| src).collect()
    }

    /// The consumers of a node with the slot they read it in, sorted by consumer id.
    pub fn users(&self, id: NodeId) -> Vec<(NodeId, usize)> {
        let mut users: Vec<(NodeId, usize)> =
            self.g.edges_directed(id, Direction::Outgoing).map(|e| (e.target(), *e.weight())).collect();
        users.sort();
        users
    }

    /// A deterministic topological order: Kahn's algorithm, smallest id first.
    pub fn topo_order(&self) -> Vec<NodeId> {
        use std::collections::{BTreeSet, HashMap};
        let mut indegree: HashMap<NodeId, usize> = HashMap::new();
        for id in self.g.node_indices() {
            indegree.insert(id, self.g.edges_directed(id, Direction::Incoming).count());
        }
        let mut ready: BTreeSet<NodeId> =
            indegree.iter().filter(|(_, &d)| d == 0).map(|(&id, _)| id).collect();
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(id) = ready.pop_first() {
            order.push(id);
            for e in self.g.edges_directed(id, Direction::Outgoing) {
                let d = indegree.get_mut(&e.target()).expect("node in graph");
                *d -= 1;
                if *d == 0 {
                    ready.insert(e.target());
                }
            }
        }
        order
    }

    /// Parameter nodes in insertion order.
    pub fn params(&self) -> Vec<NodeId> {
        self.g.node_indices().filter(|&id| matches!(self.g[id].op, Op::Param(_))).collect()
    }

    /// Input nodes in insertion order.
    pub fn data_inputs(&self) -> Vec<NodeId> {
        self.g.node_indices().filter(|&id| matches!(self.g[id].op, Op::Input { .. })).collect()
    }

    /// The parameter with a given name.
    pub fn param_by_name(&self, name: &str) -> Option<NodeId> {
        self.g.node_indices().find(|&id| matches!(&self.g[id].op, Op::Param(p) if p.name == name))
    }

    /// Re-checks every node's shape and dtype against its inputs.
    pub fn check(&self) -> Result<(), GraphError> {
        for id in self.topo_order() {
            let node = &self.g[id];
            if node.op.is_source() {
                continue;
            }
            let inputs = self.inputs(id);
            let types: Vec<(&Shape, DType)> =
                inputs.iter().map(|&i| (&self.g[i].shape, self.g[i].dtype)).collect();
            let (shape, dtype) = infer::infer(&node.op, &types)?;
            if shape != node.shape || dtype != node.dtype {
                return Err(GraphError::ShapeMismatch {
                    op: node.op.name().to_string(),
                    detail: format!("node %{} records a type its inputs do not produce", id.index()),
                    lhs: node.shape.clone(),
                    rhs: shape,
                });
            }
        }
        Ok(())
    }

    /// Removes nodes that no output depends on (dead-code elimination).
    pub fn prune_unreachable(&mut self) {
        let mut live = std::collections::HashSet::new();
        let mut stack: Vec<NodeId> = self.outputs.iter().map(|&(_, id)| id).collect();
        while let Some(id) = stack.pop() {
            if live.insert(id) {
                stack.extend(self.inputs(id));
            }
        }
        let dead: Vec<NodeId> = self.g.node_indices().filter(|id| !live.contains(id)).collect();
        for id in dead {
            self.g.remove_node(id);
        }
    }
}

pub use dump::{to_dot, to_text};
