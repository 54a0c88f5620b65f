//! Lowering of graph nodes into kernel IR (docs/architecture.md §5, §6).
//!
//! A *fused kernel* runs a list of nodes over a 1-D grid of `n` items. Every
//! value the kernel produces is split the same way: item `i` owns the flat
//! elements `[i·per, (i+1)·per)` of it, where `per = numel / n` and `n` is a
//! product of leading dimensions (for token-shaped values `[B, T, ..]`, one item
//! is one token). Each op computes its item's part with loops; values used only
//! inside the kernel live in per-item local arrays, the others are written to
//! plan buffers. An operand produced by the same kernel may therefore only be
//! read inside the reading item's part: [`itemize`] checks that rule op by op
//! (and picks the largest `n` that satisfies it), so a partition that groups
//! ops which cannot share items is split into several kernels instead of being
//! miscompiled.
//!
//! Views (`Reshape`, `Permute`, `Broadcast`, `Slice`, `Concat`) are index math
//! (`Val`): a consumer folds the whole view chain into its loads and a view
//! is only copied when its value must exist in memory. `Constant`s are literals.
//!
//! Ops that need their own grid (attention and its gradient, the loss, the
//! norm projection of the connection coefficients,
//! temporal augmentation and its gradient) are lowered by the `own_grid` module;
//! the sparse MoE ops become Plan steps of their own (routing, grouped GEMMs) in
//! the `moe` module.

mod attention;
mod item;
mod lanes;
mod moe;
mod own_grid;

pub use attention::attention_grads;
pub use lanes::{has_lanes_form, lower_sinkhorn_lanes};
pub use moe::{moe_route, route_slot};
pub use own_grid::{lower_own_grid, temporal_grads};

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use ir::graph::{Graph, Node, NodeId, Op};
use ir::DType;
use thiserror::Error;

use crate::kernel::{
    f32, f64, i32, i64, item, lane, select, Access, Block, Buf, Expr, Grid, Kernel, KernelBuilder,
    KernelError, Ty, Unroll,
};

/// Where a Plan's kernels run: it bounds the per-item scratch of fused kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Target {
    /// C on CPU threads: one item's local arrays live on the worker's stack and stay
    /// in its L2 cache.
    #[default]
    Cpu,
    /// CUDA, one thread per item: local arrays live in per-thread local memory.
    Cuda,
}

impl Target {
    /// Largest total length (elements) of the per-item local arrays of one fused
    /// kernel; larger groups are split into several kernels. On the CPU 32768
    /// floats (128 KiB, within a core's L2) hold a token's whole xHC state
    /// (N·C = 16·256 at the bench width) several times over, so the state
    /// gradient of a sublayer (a LayerNorm's gradient plus the routed pieces,
    /// docs/math.md §6.8) is assembled in one pass instead of one kernel per op,
    /// each re-reading the state from memory; with half that, the backward
    /// moved 7.6 GB a step instead of 6.7. On the GPU 512 keeps a thread's
    /// scratch small enough for registers and L1.
    pub fn local_limit(self) -> usize {
        match self {
            Target::Cpu => 32768,
            Target::Cuda => 512,
        }
    }
}

/// CUDA threads per block of emitted thread-per-item kernels. Fused and
/// own-grid bodies are long; with 256-thread launch bounds ptxas caps them at
/// 64 registers and spills, with 128 it gives them the registers they need.
pub const BLOCK: u32 = 128;

/// The thread-per-item grid of `n` items used by every emitted kernel.
pub fn grid(n: usize) -> Grid {
    Grid::ThreadPerItem { n, block: BLOCK }
}

/// A buffer argument of a launch: a graph value, or a temporary owned by the
/// lowering of one node (indexes [`Lowering::temps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arg {
    Node(NodeId),
    Temp(usize),
}

/// One kernel launch with its buffers, in parameter order.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub kernel: Kernel,
    pub args: Vec<Arg>,
}

/// A library matrix product over launch buffers: [`crate::plan::Gemm`] with
/// [`Arg`]s for buffers.
pub type GemmCall = crate::plan::Gemm<Arg>;

/// One step of a lowering.
#[derive(Debug, Clone, PartialEq)]
pub enum Work {
    Launch(Launch),
    Gemm(GemmCall),
    /// Sparse MoE routing ([`crate::plan::MoeRoute`]).
    Route(crate::plan::MoeRoute<Arg>),
    /// A grouped product over expert row groups ([`crate::plan::GroupedGemm`]).
    Grouped(crate::plan::GroupedGemm<Arg>),
}

/// The steps that compute some nodes, in order, and the temporaries
/// (length, dtype) they share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lowering {
    pub steps: Vec<Work>,
    pub temps: Vec<(usize, DType)>,
    /// Steps that may run entry by entry ([`crate::plan::Chain`]).
    pub chain: Option<ChainWorks>,
}

/// The steps `works` of a [`Lowering`] that form a [`crate::plan::Chain`]
/// of `entries` entries.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainWorks {
    pub works: std::ops::Range<usize>,
    pub entries: usize,
}

/// The temporaries of one lowering.
#[derive(Default)]
pub(crate) struct Temps(pub(crate) Vec<(usize, DType)>);

impl Temps {
    pub(crate) fn add(&mut self, len: usize, dtype: DType) -> Arg {
        self.0.push((len.max(1), dtype));
        Arg::Temp(self.0.len() - 1)
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

/// Why nodes could not be lowered.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EmitError {
    #[error("%{node} ({op}): {message}")]
    Unsupported { node: usize, op: &'static str, message: String },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl EmitError {
    pub(crate) fn at(node: NodeId, op: &Op, message: impl Into<String>) -> EmitError {
        EmitError::Unsupported { node: node.index(), op: op.name(), message: message.into() }
    }
}

/// An `i64` index literal.
/// The first output a sibling lowering is asked for (`outs` holds one slot per output
/// kind, `None` where the graph reads none): the node whose inputs every sibling shares.
pub(crate) fn first_requested(
    outs: &[Option<NodeId>],
    op: &'static str,
    what: &str,
) -> Result<NodeId, EmitError> {
    outs.iter().flatten().copied().next().ok_or_else(|| EmitError::Unsupported {
        node: usize::MAX,
        op,
        message: format!("no {what} requested"),
    })
}

pub(crate) fn ix(v: usize) -> Expr {
    i64(v as i64)
}

/// A float literal of type `ty`.
pub(crate) fn lit(ty: Ty, v: f64) -> Expr {
    match ty {
        Ty::F64 => f64(v),
        Ty::I32 => i32(v as i32),
        Ty::I64 => i64(v as i64),
        _ => f32(v as f32),
    }
}

/// IEEE `maximum` as the reference executor computes it: `a` when `a` is NaN or
/// `a >= b`, else `b` (NaN in either operand propagates). `a` and `b` must be
/// cheap (variables or loads): they are evaluated twice.
pub(crate) fn maximum(a: Expr, b: Expr) -> Expr {
    select(a.clone().ne_(a.clone()).or(a.clone().ge(b.clone())), a, b)
}

/// The larger of `a` and `b` as vector max instructions compute it (`b` when
/// `b > a`, else `a`): a NaN in `b` is skipped. Only for a softmax's shift,
/// where that cannot change the result: a NaN element makes its own
/// exponential, the sum, and so the whole row NaN whichever maximum is
/// subtracted, and for NaN-free rows both forms are the exact maximum. The
/// NaN-propagating [`maximum`] keeps the fold scalar. `a` and `b` must be
/// cheap (variables or loads): they are evaluated twice.
pub(crate) fn shift_maximum(a: Expr, b: Expr) -> Expr {
    select(b.clone().gt(a.clone()), b, a)
}

/// `op` over `terms` as a balanced tree (pairs first), so the combined values
/// do not form one serial chain.
pub(crate) fn pairwise(mut terms: Vec<Expr>, op: impl Fn(Expr, Expr) -> Expr) -> Expr {
    assert!(!terms.is_empty(), "pairwise over no terms");
    while terms.len() > 1 {
        let mut next = Vec::with_capacity(terms.len().div_ceil(2));
        let mut it = terms.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => op(a, b),
                None => a,
            });
        }
        terms = next;
    }
    terms.pop().expect("one term left")
}

/// Partial folds of a long reduction (see [`fold`]): 8 f32 lanes fill one AVX
/// register and hide the add latency.
pub(crate) const FOLD_LANES: usize = 8;

/// Partial folds of a reduction that fills them at least four times: 16 f32
/// lanes, one AVX-512 register. With 8 lanes GCC vectorizes the loop over lane
/// groups two groups per register and shuffles every load into even and odd
/// groups (mHC's 4×4 Gram products over C took 3.5x longer that way).
const WIDE_FOLD_LANES: usize = 16;

/// A `Var` accumulating `f(j)` over `j in 0..n` from `init` with `op`.
///
/// Long folds run as [`WIDE_FOLD_LANES`] or [`FOLD_LANES`] interleaved
/// partial folds (lane `w` of `W` takes `j ≡ w mod W`), combined pairwise and
/// then into `init`: a serial chain of dependent float adds over a 4096-wide row costs one add latency per
/// element (xHC's LayerNorm over N·C, docs/math.md §6.2; `-ffp-contract=off` and no
/// fast-math, so the C compiler keeps the order), while independent lanes
/// pipeline and vectorize. The order is fixed, so results stay deterministic and
/// thread-count independent; they differ from the reference executor's in-order
/// fold by rounding only.
pub(crate) fn fold(
    names: &Names,
    b: &mut Block,
    init: Expr,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    let acc = b.var(&names.fresh("acc"), init);
    if let Some(width) = fold_width(n) {
        // One variable per lane, not an array: GCC keeps a local array in
        // memory across the loop (a store-to-load chain per step) but packs
        // the lane variables into one vector register.
        let lanes: Vec<Expr> = (0..width)
            .map(|w| {
                let v = f(b, ix(w));
                b.var(&names.fresh("lane"), v)
            })
            .collect();
        b.for_(&names.fresh("jb"), ix(1), ix(n / width), |b, jb| {
            for (w, lane) in lanes.iter().enumerate() {
                let v = f(b, jb.clone() * ix(width) + ix(w));
                b.assign(lane, op(lane.clone(), v));
            }
        });
        let combined = pairwise(lanes, &op);
        b.assign(&acc, op(acc.clone(), combined));
        return acc;
    }
    serial_fold_into(names, b, &acc, n, op, f);
    acc
}

/// [`fold`] as one serial loop, `acc = op(acc, f(j))` for `j in 0..n` in
/// order: the form the GPU's lane spreading ([`crate::kernel::spread_over_lanes`])
/// splits across a block, each lane folding every `LANES`-th element, where
/// [`fold`]'s unrolled lanes would each be a serial chain in every thread.
pub(crate) fn serial_fold(
    names: &Names,
    b: &mut Block,
    init: Expr,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    let acc = b.var(&names.fresh("acc"), init);
    serial_fold_into(names, b, &acc, n, op, f);
    acc
}

fn serial_fold_into(
    names: &Names,
    b: &mut Block,
    acc: &Expr,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) {
    b.for_(&names.fresh("j"), ix(0), ix(n), |b, j| {
        let v = f(b, j);
        b.assign(acc, op(acc.clone(), v));
    });
}

/// The lanes [`fold`] splits a fold of `n` elements into, `None` for a serial fold.
fn fold_width(n: usize) -> Option<usize> {
    [WIDE_FOLD_LANES, FOLD_LANES].into_iter().find(|&w| n >= 4 * w && n.is_multiple_of(w))
}

/// Most lane partials [`fold_rows`] keeps (16 KiB of f32 with its pair levels).
const FOLD_ROWS_PARTIALS: usize = 2048;

/// Longest rows [`fold_rows`] takes, in lane steps. Its lanes live in memory,
/// a load and a store per step; one row at a time they stay in a register,
/// which wins once the steps outweigh the pairwise combination: mHC's 4 x 4
/// Gram products over C = 256 (16 steps) ran slower folded together than
/// one row at a time.
const FOLD_ROWS_STEPS: usize = 4;

/// [`fold`] of `rows` rows of `n` elements at once (C target): `f(row(r), j)`
/// is element `j` of local row `r`, where `row` emits what a row's elements
/// share (its offsets). Returns a local array whose element `row`
/// combines that row's lanes pairwise; `op(init, it)` is then bitwise the row's
/// [`fold`].
///
/// Why: an item holding many short rows (VWN's per-segment means and its
/// `[m, 4] x [4, n]` dot products over C/m = 64, docs/math.md §5.3) folded them one
/// row at a time, and GCC vectorized that loop across rows, reading each lane
/// of each row with a permute: 40 % of the kernel. Here the lanes of all rows
/// sit in one array, row-major, so every lane step is a contiguous vector op
/// (its loop kept a loop, [`Unroll::Never`], or GCC vectorizes across rows
/// again), and each pairwise level (`next[i] = op(part[2i], part[2i+1])`, the pairs
/// [`pairwise`] takes) is one even/odd shuffle per vector over all rows.
/// `None` when [`fold`] would fold serially, for a single row, past
/// [`FOLD_ROWS_PARTIALS`] or for rows longer than [`FOLD_ROWS_STEPS`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn fold_rows<R>(
    names: &Names,
    b: &mut Block,
    ty: Ty,
    rows: usize,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    row: impl Fn(&mut Block, Expr) -> R,
    f: impl Fn(&mut Block, &R, Expr) -> Expr,
) -> Option<Buf> {
    let width = fold_width(n)?;
    if rows < 2 || rows * width > FOLD_ROWS_PARTIALS || n / width > FOLD_ROWS_STEPS {
        return None;
    }
    let part = b.local_array(&names.fresh("part"), ty, rows * width);
    let lane_index = |r: &Expr, w: Expr| r.clone() * ix(width) + w;
    b.for_(&names.fresh("r"), ix(0), ix(rows), |b, r| {
        let at_row = row(b, r.clone());
        b.for_vector(&names.fresh("w"), ix(0), ix(width), |b, w| {
            let v = f(b, &at_row, w.clone());
            b.store(&part, lane_index(&r, w), v);
        });
    });
    b.for_(&names.fresh("jb"), ix(1), ix(n / width), |b, jb| {
        b.for_(&names.fresh("r"), ix(0), ix(rows), |b, r| {
            let at_row = row(b, r.clone());
            b.for_vector(&names.fresh("w"), ix(0), ix(width), |b, w| {
                let v = f(b, &at_row, jb.clone() * ix(width) + w.clone());
                let at = lane_index(&r, w);
                b.store(&part, at.clone(), op(part.at(at), v));
            });
        });
    });
    let (mut level, mut lanes) = (part, width);
    while lanes > 1 {
        lanes /= 2;
        let next = b.local_array(&names.fresh("pairs"), ty, rows * lanes);
        b.for_(&names.fresh("i"), ix(0), ix(rows * lanes), |b, i| {
            let v = op(level.at(i.clone() * ix(2)), level.at(i.clone() * ix(2) + ix(1)));
            b.store(&next, i, v);
        });
        level = next;
    }
    Some(level)
}

/// [`fold`] over a run-time length `n` (causal attention rows, whose length is
/// the query's position): every lane starts at `identity`, whole groups of
/// [`FOLD_LANES`] go lane by lane, the tail into lane 0, then the lanes are
/// combined pairwise. Same determinism as [`fold`].
pub(crate) fn fold_dynamic(
    names: &Names,
    b: &mut Block,
    identity: Expr,
    n: Expr,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    // One variable per lane, as in [`fold`].
    let lanes: Vec<Expr> = (0..FOLD_LANES).map(|_| b.var(&names.fresh("lane"), identity.clone())).collect();
    let groups = b.let_(&names.fresh("groups"), n.clone() / ix(FOLD_LANES));
    b.for_(&names.fresh("jb"), ix(0), groups.clone(), |b, jb| {
        for (w, lane) in lanes.iter().enumerate() {
            let v = f(b, jb.clone() * ix(FOLD_LANES) + ix(w));
            b.assign(lane, op(lane.clone(), v));
        }
    });
    b.for_(&names.fresh("j"), groups * ix(FOLD_LANES), n, |b, j| {
        let v = f(b, j);
        b.assign(&lanes[0], op(lanes[0].clone(), v));
    });
    // Pairwise, as [`pairwise`], with each partial named: `op` may repeat its
    // operands (a NaN-propagating max does), which nesting would multiply.
    let mut terms: Vec<Expr> = lanes;
    while terms.len() > 1 {
        terms = terms
            .chunks(2)
            .map(|pair| match pair {
                [x, y] => b.let_(&names.fresh("pair"), op(x.clone(), y.clone())),
                [x] => x.clone(),
                _ => unreachable!("chunks of two"),
            })
            .collect();
    }
    terms.pop().expect("one lane at least")
}

/// Row-major strides of `dims`.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    ir::Shape::new(dims).strides()
}

/// Fresh variable names for one kernel (the validator forbids shadowing).
#[derive(Debug, Default)]
pub(crate) struct Names(Cell<usize>);

impl Names {
    pub(crate) fn fresh(&self, prefix: &str) -> String {
        let n = self.0.get();
        self.0.set(n + 1);
        format!("{prefix}{n}")
    }
}

/// How a kernel reaches the elements of a value, by global flat index.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    /// The whole value in a kernel parameter.
    Buffer(Buf),
    /// The current item's part (elements `[item·per, (item+1)·per)`) in a local array.
    Local { arr: Buf, per: usize },
    /// Every element is `value`.
    Const { value: f64, ty: Ty },
    /// Element `g` (row-major over `dims`) is element `base + Σ idx_d·strides_d` of `src`.
    Strided { src: Box<Val>, dims: Vec<usize>, strides: Vec<usize>, base: usize },
    /// Concatenation along one axis: `[outer, total, inner]`, part `p` holds `sizes[p]` of `total`.
    Concat { parts: Vec<Val>, sizes: Vec<usize>, inner: usize, total: usize },
}

impl Val {
    /// The element at global flat index `g` (an `i64` expression).
    pub(crate) fn load(&self, g: Expr) -> Expr {
        match self {
            Val::Buffer(b) => b.at(g),
            Val::Local { arr, per } => arr.at(g - item() * ix(*per)),
            Val::Const { value, ty } => lit(*ty, *value),
            Val::Strided { src, dims, strides: st, base } => src.load(strided_index(&g, dims, st, *base)),
            Val::Concat { parts, sizes, inner, total } => {
                let along = if *inner == 1 { g.clone() } else { g.clone() / ix(*inner) };
                let along = along % ix(*total);
                let outer = g.clone() / ix(total * inner);
                let within = g % ix(*inner);
                let mut offsets = Vec::with_capacity(parts.len());
                let mut off = 0;
                for s in sizes {
                    offsets.push(off);
                    off += s;
                }
                let at = |p: usize| {
                    let a = along.clone() - ix(offsets[p]);
                    (outer.clone() * ix(sizes[p]) + a) * ix(*inner) + within.clone()
                };
                let last = parts.len() - 1;
                let mut e = parts[last].load(at(last));
                for p in (0..last).rev() {
                    e = select(along.clone().lt(ix(offsets[p] + sizes[p])), parts[p].load(at(p)), e);
                }
                e
            }
        }
    }

    /// The value viewed with a new shape that broadcasts it (NumPy rules) from `from` to `to`.
    pub(crate) fn broadcast(self, from: &[usize], to: &[usize]) -> Val {
        if from == to {
            return self;
        }
        if from.iter().product::<usize>() == 1 {
            return match self {
                Val::Const { .. } => self,
                other => Val::Strided {
                    src: Box::new(other),
                    dims: to.to_vec(),
                    strides: vec![0; to.len()],
                    base: 0,
                },
            };
        }
        let st = strides(from);
        let lead = to.len() - from.len();
        let bst =
            (0..to.len()).map(|i| if i < lead || from[i - lead] == 1 { 0 } else { st[i - lead] }).collect();
        Val::Strided { src: Box::new(self), dims: to.to_vec(), strides: bst, base: 0 }
    }
}

/// `base + Σ_d ((g / inner_d) % dims_d) · strides_d`, skipping size-1 and
/// zero-stride axes; the identity layout is `g` itself.
fn strided_index(g: &Expr, dims: &[usize], st: &[usize], base: usize) -> Expr {
    if base == 0 && st == strides(dims).as_slice() {
        return g.clone();
    }
    let mut acc: Option<Expr> = (base != 0).then(|| ix(base));
    let mut inner = 1;
    for d in (0..dims.len()).rev() {
        if dims[d] > 1 && st[d] != 0 {
            let q = if inner == 1 { g.clone() } else { g.clone() / ix(inner) };
            let c = if d == 0 { q } else { q % ix(dims[d]) };
            let term = if st[d] == 1 { c } else { c * ix(st[d]) };
            acc = Some(match acc {
                Some(a) => a + term,
                None => term,
            });
        }
        inner *= dims[d];
    }
    acc.unwrap_or_else(|| ix(0))
}

/// The view a view op makes of its operands' values.
pub(crate) fn view_of(op: &Op, in_dims: &[&[usize]], out_dims: &[usize], ins: Vec<Val>) -> Val {
    let mut ins = ins;
    match op {
        Op::Reshape { .. } => ins.swap_remove(0),
        Op::Permute { perm } => {
            let st = strides(in_dims[0]);
            let pst = perm.iter().map(|&p| st[p]).collect();
            Val::Strided { src: Box::new(ins.swap_remove(0)), dims: out_dims.to_vec(), strides: pst, base: 0 }
        }
        Op::Broadcast { .. } => ins.swap_remove(0).broadcast(in_dims[0], out_dims),
        Op::Slice { axis, start, .. } => {
            let st = strides(in_dims[0]);
            let base = start * st[*axis];
            Val::Strided { src: Box::new(ins.swap_remove(0)), dims: out_dims.to_vec(), strides: st, base }
        }
        Op::Concat { axis } => {
            let sizes = in_dims.iter().map(|d| d[*axis]).collect();
            let inner = out_dims[axis + 1..].iter().product();
            Val::Concat { parts: ins, sizes, inner, total: out_dims[*axis] }
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
        | Op::CausalAttentionGrad { .. }
        | Op::SinkhornGrad { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. } => unreachable!("view_of is only called for view ops"),
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

/// Ops lowered by the `own_grid` module: each needs a grid of its own.
pub fn has_own_grid(op: &Op) -> bool {
    match op {
        Op::CausalAttention { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::NormProject { .. }
        | Op::SoftmaxCrossEntropy
        | Op::TemporalAugment { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. } => true,
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
        | Op::Sinkhorn { .. }
        | Op::SinkhornGrad { .. } => false,
    }
}

/// The smallest `k` with `dims[..k]` multiplying to `n`.
fn item_rank(dims: &[usize], n: usize) -> Option<usize> {
    let mut p = 1;
    for k in 0..=dims.len() {
        if p == n {
            return Some(k);
        }
        if k < dims.len() {
            p *= dims[k];
        }
    }
    None
}

fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Per-item scratch an op needs besides its output (elements).
fn op_scratch(op: &Op, dims: &[usize]) -> usize {
    let nn = dims.last().copied().unwrap_or(1).pow(2);
    match op {
        Op::Sinkhorn { .. } => nn,
        Op::SinkhornGrad { iters, .. } => nn * (2 * iters + 2),
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
        | Op::TemporalAugment { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. } => 0,
    }
}

/// Whether `node`, computed in a kernel of `n` items, may read its operands
/// that the same kernel produces (`restricted[slot]`) inside its own item, and
/// whether its own output splits into `n` items the way the op computes it.
fn item_ok(graph: &Graph, id: NodeId, n: usize, restricted: &[bool], materialized_view: bool) -> bool {
    let node = graph.node(id);
    let o = node.shape.dims();
    let inputs = graph.inputs(id);
    let in_dims: Vec<&[usize]> = inputs.iter().map(|&i| graph.node(i).shape.dims()).collect();
    if !numel(o).is_multiple_of(n) {
        return false;
    }
    let any_restricted = restricted.iter().any(|&r| r);
    let view = node.op.is_view();
    let own_rank = item_rank(o, n);
    if !view || materialized_view {
        let Some(k) = own_rank else { return false };
        let rank = o.len();
        let own = match &node.op {
            Op::Softmax
            | Op::RmsNorm { .. }
            | Op::LayerNorm { .. }
            | Op::GroupNorm { .. }
            | Op::TopK { .. } => k < rank || rank == 0,
            Op::Sinkhorn { .. } | Op::SinkhornGrad { .. } => k + 2 <= rank,
            Op::ScatterAdd { axis } | Op::ScatterRows { axis } => k <= *axis,
            op @ (Op::Input { .. }
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
            | Op::NormProject { .. }
            | Op::SoftmaxCrossEntropy
            | Op::CausalAttention { .. }
            | Op::TemporalAugment { .. }
            | Op::CausalAttentionGrad { .. }
            | Op::TemporalAugmentGrad { .. }
            | Op::MoeRoute { .. }
            | Op::GroupedMatMul { .. }
            | Op::GroupedMatMulGrad { .. }) => !has_own_grid(op),
        };
        if !own {
            return false;
        }
    }
    if !any_restricted {
        return true;
    }
    let Some(k) = own_rank else {
        // Only a reshape keeps flat indices; other restricted views need item axes.
        return matches!(node.op, Op::Reshape { .. });
    };
    let bcast_ok = |x: &[usize]| {
        let lead = o.len().saturating_sub(x.len());
        (0..k).all(|d| o[d] == 1 || (d >= lead && x[d - lead] == o[d]))
    };
    let per = numel(o) / n;
    match &node.op {
        Op::Unary(_) | Op::Affine { .. } | Op::Binary(_) | Op::Broadcast { .. } => {
            inputs.iter().enumerate().all(|(s, _)| !restricted[s] || bcast_ok(in_dims[s]))
        }
        Op::Reshape { .. } => true,
        Op::Permute { perm } => (0..k).all(|d| o[d] == 1 || perm[d] == d),
        Op::Slice { axis, .. } | Op::Concat { axis } => *axis >= k,
        Op::Reduce { axis, .. } => per.is_multiple_of(numel(&in_dims[0][axis + 1..]).max(1)),
        Op::Softmax | Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::GroupNorm { .. } | Op::TopK { .. } => {
            !restricted[1..].iter().any(|&r| r)
        }
        Op::MatMul { trans_a, .. } => {
            let (m, nn) = (o[o.len() - 2], o[o.len() - 1]);
            let batch = numel(&o[..o.len() - 2]);
            let whole = per.is_multiple_of(m * nn);
            let rows = per.is_multiple_of(nn) && (m * nn).is_multiple_of(per);
            (0..2).all(|s| {
                if !restricted[s] {
                    return true;
                }
                let x = in_dims[s];
                let xb = numel(&x[..x.len() - 2]);
                if xb != batch {
                    return false;
                }
                whole || (rows && s == 0 && !trans_a)
            })
        }
        Op::Gather { .. } | Op::ScatterAdd { .. } | Op::ScatterRows { .. } => true,
        Op::Sinkhorn { .. } | Op::SinkhornGrad { .. } => true,
        Op::Input { .. }
        | Op::Param(_)
        | Op::Constant { .. }
        | Op::Cast { .. }
        | Op::NormProject { .. }
        | Op::SoftmaxCrossEntropy
        | Op::CausalAttention { .. }
        | Op::TemporalAugment { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. } => false,
    }
}

/// Which values a kernel's nodes need in memory, and how nodes outside it are read.
pub trait Residency {
    /// Whether node `id` has a plan buffer (it is read by another step, or it is a
    /// parameter, input, graph output or gradient).
    fn has_buffer(&self, id: NodeId) -> bool;
}

/// Whether `id`, read by a kernel of `n` items computing `inside`, holds values
/// of that kernel (so only the reading item's part may be read): true for the
/// kernel's own non-view nodes and for views (folded, wherever a partition lists
/// them) of such values. `None` when a view of kernel values breaks the item split.
fn restricted(
    graph: &Graph,
    id: NodeId,
    n: usize,
    inside: &HashSet<NodeId>,
    memo: &mut HashMap<NodeId, Option<bool>>,
) -> Option<bool> {
    if let Some(&r) = memo.get(&id) {
        return r;
    }
    let node = graph.node(id);
    let r = if node.op.is_view() {
        let mut slots = Vec::new();
        for i in graph.inputs(id) {
            slots.push(restricted(graph, i, n, inside, memo)?);
        }
        let any = slots.iter().any(|&r| r);
        if any && !item_ok(graph, id, n, &slots, false) {
            None
        } else {
            Some(any)
        }
    } else {
        Some(inside.contains(&id) && !matches!(node.op, Op::Constant { .. }))
    };
    memo.insert(id, r);
    r
}

/// Fewest elements of its widest value one item of a C kernel should own:
/// four AVX-512 vectors, or a whole row when rows are shorter. Finer splits
/// (one item per element) leave the item loop with per-element index
/// arithmetic (divisions by the row widths) that the C compiler does not
/// vectorize: mHC's stream write (`H_res·x + H_post·y`, docs/math.md §4.1) ran
/// far below the memory's rate as one item per element. Two threads need only a few items each;
/// the GPU wants every thread it can get.
const CPU_MIN_ITEM_ELEMENTS: usize = 64;

/// One way to split a kernel into items: `n` items, each declaring `scratch`
/// elements of local arrays before loop fusion (an upper bound on what it
/// keeps: fusion turns elementwise chains into scalars).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemSplit {
    pub n: usize,
    pub scratch: usize,
}

/// The item count of a kernel computing `nodes` (in topological order), or
/// `None` when no split into items lets every op read its in-kernel operands
/// inside its own item (or the per-item scratch would exceed the target's
/// [`Target::local_limit`]).
/// Larger counts are preferred (more parallelism); on the C target, counts that
/// give items at least `CPU_MIN_ITEM_ELEMENTS` of the widest value (or a whole
/// row of it) come first.
pub fn itemize(graph: &Graph, nodes: &[NodeId], res: &dyn Residency, target: Target) -> Option<usize> {
    item_splits(graph, nodes, res, target)
        .into_iter()
        .find(|s| s.scratch <= target.local_limit())
        .map(|s| s.n)
}

/// Every split into items that lets each op of `nodes` read its in-kernel
/// operands inside its own item, in [`itemize`]'s order of preference, with
/// the scratch each declares before loop fusion. A single op cannot be split
/// further: its scratch is what it needs, so it reports none.
pub fn item_splits(graph: &Graph, nodes: &[NodeId], res: &dyn Residency, target: Target) -> Vec<ItemSplit> {
    if nodes.iter().any(|&id| has_own_grid(&graph.node(id).op) || graph.node(id).op.is_source()) {
        return Vec::new();
    }
    let inside: HashSet<NodeId> = nodes.iter().copied().collect();
    // Nodes the kernel writes: every non-view, and views copied into their buffer.
    let computed: Vec<NodeId> =
        nodes.iter().copied().filter(|&id| !graph.node(id).op.is_view() || res.has_buffer(id)).collect();
    let mut candidates: Vec<usize> = Vec::new();
    for &id in &computed {
        let mut p = 1;
        candidates.push(1);
        for &d in graph.node(id).shape.dims() {
            p *= d;
            candidates.push(p);
        }
    }
    if candidates.is_empty() {
        // Only views, folded by their consumers: nothing to launch.
        return vec![ItemSplit { n: 1, scratch: 0 }];
    }
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    candidates.dedup();
    if target == Target::Cpu {
        // Whole rows first (stable: larger counts still first within each kind).
        let widest = computed.iter().map(|&id| &graph.node(id).shape).max_by_key(|s| s.numel());
        let (numel, row) = widest.map_or((1, 1), |s| (s.numel(), s.last()));
        let least = CPU_MIN_ITEM_ELEMENTS.min(row);
        candidates.sort_by_key(|&n| n > 0 && numel / n.max(1) < least);
    }
    let mut splits = Vec::new();
    'candidate: for n in candidates.into_iter().filter(|&n| n > 0) {
        let mut local = 0;
        let mut memo: HashMap<NodeId, Option<bool>> = HashMap::new();
        for &id in &computed {
            let node = graph.node(id);
            let mut slots = Vec::new();
            for i in graph.inputs(id) {
                match restricted(graph, i, n, &inside, &mut memo) {
                    Some(r) => slots.push(r),
                    None => continue 'candidate,
                }
            }
            if !item_ok(graph, id, n, &slots, node.op.is_view()) {
                continue 'candidate;
            }
            if !res.has_buffer(id) {
                local += node.shape.numel() / n;
            }
            local += op_scratch(&node.op, node.shape.dims());
        }
        let scratch = if computed.len() == 1 { 0 } else { local };
        splits.push(ItemSplit { n, scratch });
    }
    splits
}

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
        let v = match &node.op {
            Op::Constant { value } => Val::Const { value: *value, ty: Ty::of_storage(node.dtype) },
            op if op.is_view() => {
                let inputs = self.graph.inputs(id);
                let ins: Vec<Val> = inputs.iter().map(|&i| self.read(k, i)).collect();
                let dims: Vec<&[usize]> = inputs.iter().map(|&i| self.graph.node(i).shape.dims()).collect();
                view_of(op, &dims, node.shape.dims(), ins)
            }
            Op::Input { .. }
            | Op::Param(_)
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
            | Op::CausalAttentionGrad { .. }
            | Op::SinkhornGrad { .. }
            | Op::TemporalAugmentGrad { .. }
            | Op::MoeRoute { .. }
            | Op::GroupedMatMul { .. }
            | Op::GroupedMatMulGrad { .. } => Val::Buffer(self.buffer(k, id, Access::Read)),
        };
        self.vals.insert(id, v.clone());
        v
    }
}

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

/// Threads a thread-per-item reduction needs to keep a GPU busy: below this a
/// [`lower_column_reduce`] runs one block per output instead (an H200 holds
/// 132 × 2048 resident threads; a few thousand threads leave it mostly idle).
const GPU_THREADS_WANTED: usize = 32768;

/// Fewest reduced rows for which a whole block per output pays off.
const BLOCK_REDUCE_MIN_ROWS: usize = 256;

/// Lanes of each block of `lower_block_reduce`.
const BLOCK_REDUCE_LANES: u32 = 256;

/// Whether a reduction folds its axis by adding (a mean divides the sum afterwards),
/// so partial sums of column blocks combine by adding too.
fn folds_by_adding(op: ir::graph::ReduceOp) -> bool {
    match op {
        ir::graph::ReduceOp::Sum | ir::graph::ReduceOp::Mean => true,
        ir::graph::ReduceOp::Max => false,
    }
}

/// Whether `id` sums (or averages) over a long outer axis, `BLOCK_REDUCE_MIN_ROWS`
/// rows or more with columns inside them: a reduction over tokens, such as a
/// parameter gradient (docs/math.md §1.4), rather than a per-token norm statistic.
pub fn is_token_reduction(graph: &Graph, id: NodeId) -> bool {
    let Op::Reduce { op, axis, .. } = graph.node(id).op else { return false };
    let Some(&input) = graph.inputs(id).first() else { return false };
    let xd = graph.node(input).shape.dims();
    folds_by_adding(op) && axis + 1 < xd.len() && xd[axis] >= BLOCK_REDUCE_MIN_ROWS
}

/// A sum or mean over an axis of `n` rows as one block per output (GPU):
/// lane `l` adds rows `l, l + lanes, …` and a block reduction (a tree of
/// pairwise sums) combines the lanes, so `outer · inner` blocks of
/// [`BLOCK_REDUCE_LANES`] threads share the work where the column-blocked form
/// would have a few dozen threads each walk thousands of rows (parameter
/// gradients summed over tokens, docs/math.md §1.4). Over the innermost axis
/// (`inner` = 1) the lanes' loads are contiguous. The summation order is the
/// tree's, not the sequential one: results match the reference to f32
/// rounding, not bit for bit.
fn lower_block_reduce(
    graph: &Graph,
    id: NodeId,
    name: &str,
    op: ir::graph::ReduceOp,
    (outer, n, inner): (usize, usize, usize),
) -> Result<Launch, EmitError> {
    let node = graph.node(id);
    let ty = Ty::of_storage(node.dtype);
    let lanes = BLOCK_REDUCE_LANES;
    let mut k = KernelBuilder::new(name, Grid::block_per_item(outer * inner, lanes));
    let mut r = Reader::new(graph);
    let x = r.read(&mut k, graph.inputs(id)[0]);
    let out = r.buffer(&mut k, id, Access::Write);
    let row0 = k.let_("row0", item() / ix(inner) * ix(n * inner) + item() % ix(inner));
    let part = k.var("part", lit(ty, 0.0));
    let sum = part.clone();
    k.for_step("j", lane(), ix(n), i64::from(lanes), Unroll::Auto, |b, j| {
        b.assign(&sum, sum.clone() + x.load(row0 + j * ix(inner)));
    });
    let total = k.block_reduce("total", crate::kernel::ReduceOp::Sum, part);
    let value = if op == ir::graph::ReduceOp::Mean { total / lit(ty, n as f64) } else { total };
    k.if_(lane().eq_(i64(0)), |b| b.store(&out, item(), value));
    let kernel = k.finish();
    kernel.validate()?;
    Ok(Launch { kernel, args: r.args })
}

/// Fewest columns for which [`lower_scatter_columns`] is used: fewer threads
/// than this leave the GPU idle whichever way the scatter is split.
const SCATTER_MIN_COLUMNS: usize = 64;

/// A scatter-add (`out = base; out[p, idx[p, j], c] += src[p, j, c]`: the
/// token embedding's gradient, and a MoE layer's gradient through its dispatch,
/// docs/math.md §1.6) split over its columns: the item model of fused kernels
/// gives each item whole `[S, C]` blocks, so the embedding gradient of a batch
/// would be one item adding every token's row, on one thread. Here an item owns
/// a block of adjacent columns of one `p`: it copies its columns of `base`,
/// then adds the indexed rows' columns in order of `j`, so every output is
/// summed in the reference's order (bitwise the same) and items never share an
/// output.
///
/// On the GPU ([`Target::Cuda`]) a block is one column, a thread each; on the
/// CPU the widest block of up to [`C_COLUMN_BLOCK`] columns that divides `C`
/// and still leaves [`C_COLUMN_ITEMS`] items, so each row's block is a
/// contiguous run the adds vectorize over. `None` for fewer than
/// `SCATTER_MIN_COLUMNS` columns (GPU) or no block of at least 2 leaving
/// 2 items (CPU): the single-item form is as fast there.
pub fn lower_scatter_columns(
    graph: &Graph,
    id: NodeId,
    name: &str,
    target: Target,
) -> Result<Option<Launch>, EmitError> {
    let node = graph.node(id);
    let Op::ScatterAdd { axis } = node.op else { return Ok(None) };
    let o = node.shape.dims();
    let (p, s, c) = (numel(&o[..axis]), o[axis], numel(&o[axis + 1..]));
    let inputs = graph.inputs(id);
    let j = graph.node(inputs[1]).shape.numel() / p.max(1);
    let width = match target {
        Target::Cuda if c >= SCATTER_MIN_COLUMNS => 1,
        Target::Cuda => return Ok(None),
        Target::Cpu => {
            let divides = |w: &usize| c.is_multiple_of(*w);
            let widest = |items: usize| {
                (2..=C_COLUMN_BLOCK.min(c)).rev().filter(divides).find(|w| p * (c / w) >= items)
            };
            match widest(C_COLUMN_ITEMS).or_else(|| widest(2)) {
                Some(w) => w,
                None => return Ok(None),
            }
        }
    };
    let blocks = c / width;
    let mut k = KernelBuilder::new(name, grid(p * blocks));
    let mut r = Reader::new(graph);
    let base = r.read(&mut k, inputs[0]);
    let idx = r.read(&mut k, inputs[1]);
    let src = r.read(&mut k, inputs[2]);
    let out = r.buffer(&mut k, id, Access::ReadWrite);
    let pi = k.let_("pi", item() / ix(blocks));
    let col = k.let_("col", item() % ix(blocks) * ix(width));
    let first = k.let_("first", pi.clone() * ix(s * c) + col.clone());
    // Each column of the block: once per column, or a loop over the block.
    let columns = |b: &mut Block, body: &dyn Fn(&mut Block, Expr)| {
        if width == 1 {
            body(b, ix(0));
        } else {
            b.for_("l", ix(0), ix(width), |b, l| body(b, l));
        }
    };
    k.for_("srow", ix(0), ix(s), |b, row| {
        let at = first.clone() + row * ix(c);
        columns(b, &|b, l| b.store(&out, at.clone() + l.clone(), base.load(at.clone() + l)));
    });
    k.for_("t", ix(0), ix(j), |b, t| {
        let pj = b.let_("pj", pi.clone() * ix(j) + t);
        let row = b.let_("row", idx.load(pj.clone()).cast(Ty::I64));
        let (to, from) = (first.clone() + row * ix(c), pj * ix(c) + col.clone());
        columns(b, &|b, l| b.accum(&out, to.clone() + l.clone(), src.load(from.clone() + l)));
    });
    let kernel = k.finish();
    kernel.validate()?;
    Ok(Some(Launch { kernel, args: r.args }))
}

/// Widest block of adjacent output columns one item of
/// [`lower_column_reduce`] accumulates: one 64-byte cache line of f32.
const COLUMN_BLOCK: usize = 16;

/// Widest block of [`lower_column_reduce`] on the C target: four lines. An
/// item walks the rows once per block, reading its block of each row: one
/// line a row at a 1 KiB stride over VWN's 256-wide gain gradients, against
/// four adjacent lines, 256 contiguous bytes a row, and a quarter of the
/// passes; 128 columns gained nothing over 64. Each column is still summed over the
/// rows in order from zero, bit for bit.
const C_COLUMN_BLOCK: usize = 64;

/// Fewest items the C target's wider column blocks leave, so the threads
/// still share the reduction.
const C_COLUMN_ITEMS: usize = 4;

/// Rows one item of [`lower_column_reduce`] sums together over an innermost axis.
const ROW_BLOCK: usize = 8;

/// A sum or mean over a non-innermost axis (a token reduction such as a bias
/// or gain gradient, docs/math.md §1.4) as its own kernel: each item owns a block
/// of up to `COLUMN_BLOCK` adjacent output columns and walks the reduced
/// axis once, adding each input row's block into per-column accumulators.
/// Every load is then contiguous and the accumulators vectorize across
/// columns (over the innermost axis an item owns up to `ROW_BLOCK` rows
/// and interleaves their independent sums), while each output is still summed over the axis in order from
/// zero (as `ir::exec::reduce`), so the result is bitwise the generic
/// one-output-per-step lowering's. `None` when the node is not such a
/// reduction (other ops, `Max`, no block over 1).
///
/// On the GPU ([`Target::Cuda`]) a reduction whose column blocks would be too
/// few threads to fill the device runs as `lower_block_reduce` instead.
pub fn lower_column_reduce(
    graph: &Graph,
    id: NodeId,
    name: &str,
    target: Target,
) -> Result<Option<Launch>, EmitError> {
    let node = graph.node(id);
    let Op::Reduce { op, axis, .. } = node.op else { return Ok(None) };
    if !folds_by_adding(op) {
        return Ok(None);
    }
    let input = graph.inputs(id)[0];
    let xd = graph.node(input).shape.dims();
    let (outer, n, inner) = (numel(&xd[..axis]), xd[axis], numel(&xd[axis + 1..]));
    // Over the innermost axis the block is one of adjacent rows instead: the
    // loads are strided, but the block's sums are independent chains, so the
    // adds overlap rather than wait on each other.
    let rows = inner == 1;
    let span = if rows { outer } else { inner };
    let limit = if rows { ROW_BLOCK } else { COLUMN_BLOCK };
    let mut width = (1..=limit.min(span)).rev().find(|w| span.is_multiple_of(*w)).unwrap_or(1);
    if target == Target::Cpu && !rows {
        // Wider blocks while they leave enough items for the threads.
        while width * 2 <= C_COLUMN_BLOCK
            && span.is_multiple_of(width * 2)
            && outer * span / (width * 2) >= C_COLUMN_ITEMS
        {
            width *= 2;
        }
    }
    let items = if rows { outer / width } else { outer * (inner / width) };
    if target == Target::Cuda && items < GPU_THREADS_WANTED && n >= BLOCK_REDUCE_MIN_ROWS {
        return lower_block_reduce(graph, id, name, op, (outer, n, inner)).map(Some);
    }
    if width < 2 || n < 2 {
        return Ok(None);
    }
    let ty = Ty::of_storage(node.dtype);
    let mut k = KernelBuilder::new(name, grid(items));
    let mut r = Reader::new(graph);
    let x = r.read(&mut k, input);
    let out = r.buffer(&mut k, id, Access::Write);
    let acc = k.local_array("acc", ty, width);
    // Lane w sums the inputs `row_start(j) + w·lane` into output `first + w`,
    // where row_start(j) = (o·n + j)·inner + c for the block's outer index o
    // and first column c.
    let (first, o, c, lane) = if rows {
        let o0 = k.let_("o0", item() * ix(width));
        (o0.clone(), o0, ix(0), n)
    } else {
        let blocks = inner / width;
        let o = k.let_("o", item() / ix(blocks));
        let c0 = k.let_("c0", item() % ix(blocks) * ix(width));
        (k.let_("first", o.clone() * ix(inner) + c0.clone()), o, c0, 1)
    };
    let zero = acc.clone();
    k.for_("w0", ix(0), ix(width), |b, w| b.store(&zero, w, lit(ty, 0.0)));
    let sum = acc.clone();
    k.for_("j", ix(0), ix(n), |b, j| {
        let base = b.let_("base", (o * ix(n) + j) * ix(inner) + c);
        b.for_("w1", ix(0), ix(width), |b, w| b.accum(&sum, w.clone(), x.load(base + w * ix(lane))));
    });
    let count = lit(ty, n as f64);
    k.for_("w2", ix(0), ix(width), |b, w| {
        let v = acc.at(w.clone());
        let v = if op == ir::graph::ReduceOp::Mean { v / count } else { v };
        b.store(&out, first + w, v);
    });
    let kernel = k.finish();
    kernel.validate()?;
    Ok(Some(Launch { kernel, args: r.args }))
}
