//! A Plan buffer for every resident node (its first role, else a constant's value
//! or scratch), further buffers for nodes with more than one role, and the first
//! steps: constants with a role filled, sources with extra roles copied
//! (docs/architecture.md §7).

use std::collections::{BTreeMap, HashMap, HashSet};

use ir::graph::{Graph, NodeId, Op};
use ir::DType;

use super::builder::PlanBuilder;
use super::residency::Buffered;
use crate::emit;
use crate::kernel::{item, Access, Kernel, KernelBuilder};
use crate::plan::{BufferId, BufferRole};

/// A plan buffer for every resident node: its first role, else a constant's
/// value or scratch. Returns the further buffers of nodes with more than one
/// role (a parameter that is also an output), filled by copies.
pub(super) fn allocate_buffers(
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
pub(super) fn fill_and_copy_sources(
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

fn fill_kernel(name: &str, len: usize, dtype: DType, value: f64) -> Kernel {
    let mut k = KernelBuilder::new(name, emit::grid(len));
    let out = k.param("out", dtype, Access::Write, len);
    k.store(&out, item(), emit::lit(crate::kernel::Ty::of_storage(dtype), value));
    k.finish()
}
