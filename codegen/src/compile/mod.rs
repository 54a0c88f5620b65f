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
//!
//! [`compile`] runs the phases in order, each in a file of its own:
//! 1. `partition.rs`: the partition checked (each node once, every needed node
//!    in a group, no group reading what a later one computes);
//! 2. `roles.rs`: the roles of the buffers the runtime sees;
//! 3. `gemm.rs`: which MatMuls (and weight gradients) run as library GEMMs;
//! 4. `order.rs`: each group ordered around the one node that takes a step of
//!    its own, at the cheaper of the two cuts;
//! 5. `units.rs`: groups cut into units, and the residency of values
//!    (`residency.rs`) once the units are known;
//! 6. `buffers.rs`: a Plan buffer for every resident node, and the first
//!    steps (constants filled, sources with two roles copied);
//! 7. `lower.rs`: the units' steps, gradients of one op lowered together
//!    (`siblings.rs`);
//! 8. `arena.rs`: scratch buffers placed by liveness.
//!
//! The phases from 6 on push into a `PlanBuilder` (`builder.rs`), which shares
//! kernels of one structure and tables across the Plan. With the `testing`
//! feature, `run_on_cpu_for_tests` (`testing.rs`) runs a Plan as the codegen
//! tests' oracle.

mod arena;
mod buffers;
mod builder;
mod gemm;
mod lower;
mod order;
mod partition;
mod residency;
mod roles;
mod siblings;
#[cfg(feature = "testing")]
mod testing;
mod units;

use std::collections::HashMap;

use ir::graph::{Graph, NodeId};
use thiserror::Error;

use crate::cc::CcError;
use crate::emit::EmitError;
pub use crate::emit::Target;
use crate::plan::Plan;

use buffers::{allocate_buffers, fill_and_copy_sources};
use builder::PlanBuilder;
use gemm::find_gemms;
use lower::lower_units;
use order::order_groups;
use partition::checked_groups;
pub use partition::{fused_partition, one_op_per_group};
use roles::buffer_roles;
#[cfg(feature = "testing")]
pub use testing::{run_on_cpu_for_tests, HostData};
use units::units_and_residency;

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
    let mut b = PlanBuilder::new(request.target);
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
