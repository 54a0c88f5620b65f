//! The roles of the buffers the runtime sees (docs/architecture.md §7):
//! parameters, inputs, named outputs and gradients keep their names; every other
//! buffer is scratch, so a new op needs no decision here.

use std::collections::BTreeMap;

use ir::graph::{Graph, NodeId, Op};

use super::{CompileError, Request};
use crate::plan::BufferRole;

/// The roles of the buffers the runtime sees: parameters, inputs, named outputs and
/// gradients (named after their parameter).
pub(super) fn buffer_roles(
    graph: &Graph,
    request: &Request,
) -> Result<BTreeMap<NodeId, Vec<BufferRole>>, CompileError> {
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
