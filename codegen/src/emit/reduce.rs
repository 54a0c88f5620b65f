//! Sums as kernels of their own, split another way than the item model of fused
//! kernels would split them: a sum or mean over an axis (a token reduction such
//! as a parameter gradient, docs/math.md §1.4) over blocks of adjacent output
//! columns or rows, so its loads are contiguous and its accumulators vectorize,
//! or as one block per output on the GPU where those blocks would be too few
//! threads; and a scatter-add (docs/math.md §1.6) split over its columns, which
//! the item model would leave to one item. Except the GPU's block reduction,
//! every output is summed in the reference's order, so the results are bitwise
//! those of the generic lowering.

use ir::graph::{Graph, NodeId, Op};

use super::buffers::Reader;
use super::op_rules::folds_by_adding;
use super::{grid, ix, lit, numel, EmitError, Launch, Target};
use crate::kernel::{i64, item, lane, Access, Block, Expr, Grid, KernelBuilder, Ty, Unroll};

/// Threads a thread-per-item reduction needs to keep a GPU busy: below this a
/// [`lower_column_reduce`] runs one block per output instead (an H200 holds
/// 132 × 2048 resident threads; a few thousand threads leave it mostly idle).
const GPU_THREADS_WANTED: usize = 32768;

/// Fewest reduced rows for which a whole block per output pays off.
const BLOCK_REDUCE_MIN_ROWS: usize = 256;

/// Lanes of each block of `lower_block_reduce`.
const BLOCK_REDUCE_LANES: u32 = 256;

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
    let total = k.block_reduce("total", crate::kernel::Combine::Sum, part);
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
