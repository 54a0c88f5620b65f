//! How a kernel reaches memory: graph values become buffer parameters declared
//! on first use ([`Reader`], which folds views over them, see [`super::views`]),
//! an op writes its item's part to a local array or a buffer ([`Sink`]), a
//! kernel is built with its launch arguments ([`Kb`]), and a value that has no
//! buffer of its own (a view, a constant) is copied into one where a library
//! product or a Plan step needs its operand in memory ([`memory`]).

use std::collections::HashMap;

use ir::graph::{Graph, Node, NodeId, Op, OpFamily, Source};

use super::views::{view_of, Val};
use super::{grid, ix, Arg, EmitError, Launch, Target, Temps, Work};
use crate::kernel::{item, Access, Block, Buf, Expr, Grid, KernelBuilder, Ty};

/// The kernel parameter name of a graph value.
pub(crate) fn param_name(id: NodeId) -> String {
    format!("n{}", id.index())
}

/// Reads the values a kernel does not produce: materialized nodes become buffer
/// parameters (declared on first use), views always fold over them (even a view
/// copied into a buffer for its role, so no read depends on where a partition
/// lists the view), constants inline.
pub(crate) struct Reader<'g> {
    pub graph: &'g Graph,
    pub vals: HashMap<NodeId, Val>,
    pub args: Vec<Arg>,
    declared: HashMap<NodeId, Buf>,
}

impl<'g> Reader<'g> {
    pub(crate) fn new(graph: &'g Graph) -> Self {
        Reader { graph, vals: HashMap::new(), args: Vec::new(), declared: HashMap::new() }
    }

    /// Declares (once) the buffer parameter holding node `id`.
    pub(crate) fn buffer(&mut self, k: &mut KernelBuilder, id: NodeId, access: Access) -> Buf {
        if let Some(b) = self.declared.get(&id) {
            return b.clone();
        }
        let node = self.graph.node(id);
        let b = k.param(&param_name(id), node.dtype, access, node.shape.numel());
        self.args.push(Arg::Node(id));
        self.declared.insert(id, b.clone());
        b
    }

    /// How the kernel reads node `id`.
    pub(crate) fn read(&mut self, k: &mut KernelBuilder, id: NodeId) -> Val {
        if let Some(v) = self.vals.get(&id) {
            return v.clone();
        }
        let node: &Node = self.graph.node(id);
        let v = match node.op.family() {
            // A constant is folded into the load; a view reads what it views.
            OpFamily::Source(Source::Constant { value }) => {
                Val::Const { value, ty: Ty::of_storage(node.dtype) }
            }
            OpFamily::View(view) => {
                let inputs = self.graph.inputs(id);
                let ins: Vec<Val> = inputs.iter().map(|&i| self.read(k, i)).collect();
                let dims: Vec<&[usize]> = inputs.iter().map(|&i| self.graph.node(i).shape.dims()).collect();
                view_of(view, &dims, node.shape.dims(), ins)
            }
            OpFamily::Source(Source::Input { .. } | Source::Param(_))
            | OpFamily::Elementwise
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => Val::Buffer(self.buffer(k, id, Access::Read)),
        };
        self.vals.insert(id, v.clone());
        v
    }
}

/// A kernel under construction with its launch arguments.
pub(crate) struct Kb<'g> {
    pub(crate) k: KernelBuilder,
    pub(crate) r: Reader<'g>,
}

impl<'g> Kb<'g> {
    pub(crate) fn new(graph: &'g Graph, name: &str, items: usize) -> Kb<'g> {
        Kb::with_grid(graph, name, grid(items))
    }

    pub(crate) fn with_grid(graph: &'g Graph, name: &str, grid: Grid) -> Kb<'g> {
        Kb { k: KernelBuilder::new(name, grid), r: Reader::new(graph) }
    }

    /// Declares a temporary as the next parameter.
    pub(crate) fn temp(&mut self, name: &str, arg: Arg, temps: &Temps, access: Access) -> Buf {
        let Arg::Temp(i) = arg else { unreachable!("temporaries are Arg::Temp") };
        let (len, dtype) = temps.0[i];
        let b = self.k.param(name, dtype, access, len);
        self.r.args.push(arg);
        b
    }

    pub(crate) fn finish(self) -> Result<Work, EmitError> {
        let kernel = self.k.finish();
        kernel.validate()?;
        Ok(Work::Launch(Launch { kernel, args: self.r.args }))
    }
}

/// Where an op writes its item's part.
#[derive(Debug, Clone)]
pub(crate) enum Sink {
    Local { arr: Buf, per: usize },
    Buffer(Buf),
}

impl Sink {
    pub(crate) fn store(&self, b: &mut Block, g: Expr, v: Expr) {
        match self {
            Sink::Local { arr, per } => b.store(arr, g - item() * ix(*per), v),
            Sink::Buffer(buf) => b.store(buf, g, v),
        }
    }

    pub(crate) fn accum(&self, b: &mut Block, g: Expr, v: Expr) {
        match self {
            Sink::Local { arr, per } => b.accum(arr, g - item() * ix(*per), v),
            Sink::Buffer(buf) => b.accum(buf, g, v),
        }
    }

    pub(crate) fn val(&self) -> Val {
        match self {
            Sink::Local { arr, per } => Val::Local { arr: arr.clone(), per: *per },
            Sink::Buffer(buf) => Val::Buffer(buf.clone()),
        }
    }
}

/// Shortest row [`memory`] copies as one item in C: shorter rows (a weight's
/// 20 coefficients) gain nothing over one element per item.
const COPY_ROW_MIN: usize = 64;

/// A buffer holding node `id`'s value in its own layout: the node's buffer
/// (through reshapes, its source's), or a copy into a temporary for other views
/// and constants, which have none. The copy runs one element per item on the
/// GPU (adjacent threads, adjacent addresses) and one row per item in C (the
/// view's index math then divides once per row, not once per element: xHC's
/// first state, the embedding broadcast to N streams, is 8 M elements).
pub(super) fn memory(
    graph: &Graph,
    id: NodeId,
    name: &str,
    temps: &mut Temps,
    steps: &mut Vec<Work>,
    target: Target,
) -> Result<Arg, EmitError> {
    let mut v = id;
    while matches!(graph.node(v).op, Op::Reshape { .. }) {
        v = graph.inputs(v)[0];
    }
    let node = graph.node(v);
    if !node.op.is_view() && !matches!(node.op, Op::Constant { .. }) {
        return Ok(Arg::Node(v));
    }
    let len = node.shape.numel();
    let arg = temps.add(len, node.dtype);
    let last = node.shape.last();
    let row = if target == Target::Cpu && last >= COPY_ROW_MIN { last } else { 1 };
    let mut kb = Kb::new(graph, &format!("{name}_copy{}", steps.len()), len / row);
    let src = kb.r.read(&mut kb.k, id);
    let dst = kb.temp("dst", arg, temps, Access::Write);
    kb.k.for_("e", ix(0), ix(row), |b, e| {
        let at = b.let_("at", item() * ix(row) + e);
        b.store(&dst, at.clone(), src.load(at));
    });
    steps.push(kb.finish()?);
    Ok(arg)
}
