//! Sparse mixture-of-experts ops (docs/math.md §1.6) as Plan steps of their own:
//! `MoeRoute` as one routing step ([`crate::plan::MoeRoute`]) that writes all three
//! of its outputs, and `GroupedMatMul` / `GroupedMatMulGrad` as grouped GEMMs
//! ([`crate::plan::GroupedGemm`]). Neither is a kernel: routing is a sequential
//! count that a device runs on the host, and a grouped product is one library GEMM
//! per expert whose row count is data. Operands that are views are copied into
//! memory first, as for the other library products.

use ir::graph::{Graph, MoeRouteOut, NodeId, Op};
use ir::DType;

use super::buffers::memory;
use super::{Arg, EmitError, Lowering, Target, Temps, Work};
use crate::plan::{GroupedForm, GroupedGemm, MoeRoute};

/// The slot of a routing output among the siblings [`moe_route`] lowers together.
pub fn route_slot(out: MoeRouteOut) -> usize {
    match out {
        MoeRouteOut::Rows => 0,
        MoeRouteOut::Tokens => 1,
        MoeRouteOut::Counts => 2,
    }
}

/// The routing of one `MoeRoute` input as one step writing every output: `outs` are
/// the nodes of the Rows, Tokens and Counts outputs (by [`route_slot`]) over the same
/// expert indices; an output no node asks for goes to a temporary, so the indices are
/// routed once however many of the three the graph reads.
pub fn moe_route(
    graph: &Graph,
    outs: &[Option<NodeId>],
    name: &str,
    target: Target,
) -> Result<Lowering, EmitError> {
    let id = super::first_requested(outs, "moe_route", "routing output")?;
    let op = &graph.node(id).op;
    let Op::MoeRoute { experts, capacity, .. } = *op else {
        return Err(EmitError::at(id, op, "is not a routing op"));
    };
    let input = graph.inputs(id)[0];
    let dims = graph.node(input).shape.dims().to_vec();
    let (assignments, k) = (dims.iter().product::<usize>(), dims.last().copied().unwrap_or(1));
    let mut temps = Temps::default();
    let mut steps = Vec::new();
    let idx = memory(graph, input, name, &mut temps, &mut steps, target)?;
    let mut out = |slot: usize, len: usize| match outs.get(slot).copied().flatten() {
        Some(node) => Arg::Node(node),
        None => temps.add(len, DType::I32),
    };
    let route = MoeRoute {
        idx,
        rows: out(route_slot(MoeRouteOut::Rows), assignments),
        tokens: out(route_slot(MoeRouteOut::Tokens), assignments),
        counts: out(route_slot(MoeRouteOut::Counts), experts),
        assignments,
        k,
        experts,
        capacity,
    };
    steps.push(Work::Route(route));
    Ok(Lowering { steps, temps: temps.0, chain: None })
}

/// A grouped product (`GroupedMatMul`, or its weight gradient `GroupedMatMulGrad`) as
/// one grouped GEMM step over its operands in memory.
pub(super) fn grouped(
    graph: &Graph,
    id: NodeId,
    name: &str,
    form: GroupedForm,
    trans_b: bool,
    target: Target,
) -> Result<Lowering, EmitError> {
    let inputs = graph.inputs(id);
    let x = graph.node(inputs[0]).shape.dims();
    let (m, k) = (x[0], x[1]);
    let groups = graph.node(inputs[2]).shape.numel();
    let n = match form {
        GroupedForm::Rows => graph.node(id).shape.dims()[1],
        GroupedForm::WeightGrad => graph.node(inputs[1]).shape.dims()[1],
    };
    let mut temps = Temps::default();
    let mut steps = Vec::new();
    let [a, b, counts] =
        [0, 1, 2].map(|slot| memory(graph, inputs[slot], name, &mut temps, &mut steps, target));
    let routed = ir::cost::grouped_rows(graph, inputs[2], m);
    let g = GroupedGemm {
        form,
        a: a?,
        b: b?,
        c: Arg::Node(id),
        counts: counts?,
        groups,
        m,
        routed,
        k,
        n,
        trans_b,
    };
    steps.push(Work::Grouped(g));
    Ok(Lowering { steps, temps: temps.0, chain: None })
}
