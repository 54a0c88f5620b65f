//! A fused kernel from its nodes (docs/architecture.md §5.2): one
//! thread-per-item kernel over the item count [`super::itemize`] chose, each
//! node computing its item's part with the item emitters of [`super::item`].
//! Values with a plan buffer are written to it; the others live in per-item
//! local arrays, and views and constants are folded into their consumers' loads.

use std::collections::HashSet;

use ir::graph::{Graph, NodeId, Op};

use super::buffers::{Reader, Sink};
use super::views::Val;
use super::{grid, item, EmitError, Launch, Names, Residency, Target};
use crate::kernel::{Access, KernelBuilder, Ty};

/// Whether a node of `inside` reads `id`, directly or through views.
fn reads_inside(graph: &Graph, id: NodeId, inside: &HashSet<NodeId>) -> bool {
    graph.users(id).iter().any(|&(u, _)| {
        if graph.node(u).op.is_view() {
            reads_inside(graph, u, inside)
        } else {
            inside.contains(&u)
        }
    })
}

/// Lowers `nodes` (topological order, none on a grid of its own) into one thread-per-item
/// kernel of `n` items named `name`. Nodes with a buffer are written to it; the
/// others live in per-item local arrays.
pub fn lower_fused(
    graph: &Graph,
    nodes: &[NodeId],
    n: usize,
    res: &dyn Residency,
    name: &str,
    target: Target,
) -> Result<Launch, EmitError> {
    let mut k = KernelBuilder::new(name, grid(n));
    let mut r = Reader::new(graph);
    let names = Names::default();
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    for &id in nodes {
        let node = graph.node(id);
        let materialize = res.has_buffer(id);
        if !materialize && (node.op.is_view() || matches!(node.op, Op::Constant { .. })) {
            continue; // read lazily by its consumers
        }
        let inputs = graph.inputs(id);
        let ins: Vec<Val> = inputs.iter().map(|&i| r.read(&mut k, i)).collect();
        let in_dims: Vec<&[usize]> = inputs.iter().map(|&i| graph.node(i).shape.dims()).collect();
        let per = node.shape.numel() / n;
        let sink = if materialize {
            // Accumulated into (a scatter adds into rows other items write
            // too), or read back by a later op of this kernel, which in a
            // thread-per-item kernel reads only what its own item wrote.
            let access = if matches!(node.op, Op::ScatterAdd { .. }) {
                Access::ReadWrite
            } else if reads_inside(graph, id, &inside) {
                Access::WriteThenRead
            } else {
                Access::Write
            };
            Sink::Buffer(r.buffer(&mut k, id, access))
        } else {
            let arr = k.local_array(&format!("loc{}", id.index()), Ty::of_storage(node.dtype), per.max(1));
            Sink::Local { arr, per }
        };
        let cx =
            item::ItemOp { names: &names, id, node, in_dims: &in_dims, ins: &ins, sink: &sink, per, target };
        item::emit(&mut k, &cx)?;
        if !node.op.is_view() && !matches!(node.op, Op::Constant { .. }) {
            r.vals.insert(id, sink.val());
        }
    }
    let kernel = k.finish();
    kernel.validate()?;
    Ok(Launch { kernel, args: r.args })
}
