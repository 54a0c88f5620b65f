//! Ops lowered on grids of their own (docs/architecture.md §5 "heavy ops are kernels of
//! their own"): the cross-entropy loss, the norm projection of the connection
//! coefficients, and xHC's temporal augmentation and its gradient (causal attention
//! and its gradient are in [`super::attention`]; [`super::lower_own_grid`] sends each
//! op to its lowering). Operands are read through [`Reader`], so views fold into their
//! index math like everywhere else.

use ir::graph::{Graph, NodeId, Op};

use super::buffers::{memory, Kb, Reader};
use super::folds::{self, shift_maximum};
use super::views::Val;
use super::{grid, ix, lit, EmitError, GemmCall, Launch, Lowering, Names, Target, Temps, Work};
use crate::kernel::{
    i64, item, lane, select, Access, Block, Buf, Combine, Expr, Grid, KernelBuilder, Ty, Unroll,
};

/// ε_abs of the Gram–Schmidt guard (docs/math.md §6.5 DECISION; `ir::exec` uses the same).
const GS_EPS_ABS: f64 = 1e-20;

/// Lanes of the block-per-item loss kernel.
const LOSS_THREADS: u32 = 256;

fn finish(k: KernelBuilder, r: Reader) -> Result<Launch, EmitError> {
    let kernel = k.finish();
    kernel.validate()?;
    Ok(Launch { kernel, args: r.args })
}

/// A `Var` accumulating `f(j)` for `j in start..end` from `init`.
fn sum(
    names: &Names,
    b: &mut Block,
    init: Expr,
    start: Expr,
    end: Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    let acc = b.var(&names.fresh("acc"), init);
    let a = acc.clone();
    b.for_(&names.fresh("j"), start, end, |b, j| {
        let v = f(b, j);
        b.assign(&a, a.clone() + v);
    });
    acc
}

/// `Σ_{j < n} f(j)` for a static `n`, long sums as interleaved partial sums
/// ([`folds::fold`], as the fused row ops fold them).
fn total(names: &Names, b: &mut Block, ty: Ty, n: usize, f: impl Fn(&mut Block, Expr) -> Expr) -> Expr {
    folds::fold(names, b, lit(ty, 0.0), n, |x, y| x + y, f)
}

/// One row of `c` contiguous elements of a value, with the row's start
/// computed once: element loads inside the hot loops are then `start + e`
/// instead of a view's per-element div/mod chain.
struct Row {
    src: RowSrc,
    start: Expr,
}

enum RowSrc {
    /// The row lies contiguously in this buffer from `start`.
    Buffer(Buf),
    /// Any other value: `start` is the row's global flat index.
    Val(Val),
}

impl Row {
    /// Row `row` of `v` viewed as `[rows, c]`.
    fn of(names: &Names, b: &mut Block, v: &Val, row: Expr, c: usize) -> Row {
        let flat = |b: &mut Block, v: &Val| {
            let start = b.let_(&names.fresh("rs"), row.clone() * ix(c));
            Row { src: RowSrc::Val(v.clone()), start }
        };
        match v {
            Val::Buffer(buf) => {
                let start = b.let_(&names.fresh("rs"), row.clone() * ix(c));
                Row { src: RowSrc::Buffer(buf.clone()), start }
            }
            Val::Strided { src, dims, strides, base }
                if matches!(**src, Val::Buffer(_))
                    && dims.last() == Some(&c)
                    && (c == 1 || strides.last() == Some(&1)) =>
            {
                let Val::Buffer(buf) = &**src else { return flat(b, v) };
                // Element (row, e) of the view is at base + e + Σ_d ((row / inner_d) % dims_d)·strides_d
                // over the outer axes, inner_d counting rows (the innermost axis is the row itself).
                let mut start = ix(*base);
                let mut inner = 1;
                for d in (0..dims.len() - 1).rev() {
                    if dims[d] > 1 && strides[d] != 0 {
                        let q = if inner == 1 { row.clone() } else { row.clone() / ix(inner) };
                        let i = if d == 0 { q } else { q % ix(dims[d]) };
                        start = start + i * ix(strides[d]);
                    }
                    inner *= dims[d];
                }
                let start = b.let_(&names.fresh("rs"), start);
                Row { src: RowSrc::Buffer(buf.clone()), start }
            }
            _ => flat(b, v),
        }
    }

    /// Element `e` of the row.
    fn at(&self, e: Expr) -> Expr {
        match &self.src {
            RowSrc::Buffer(buf) => buf.at(self.start.clone() + e),
            RowSrc::Val(v) => v.load(self.start.clone() + e),
        }
    }
}

/// The projection of the normalized rows computed from the rows themselves
/// (docs/math.md §4.3, §6.2), as the reference computes it: one GEMM `x·W` over
/// all rows, the column sums of `W` (for the centred columns), then one
/// kernel per row with the row's statistics: `ρ_c·(dot − Σw·μ)` for the first
/// `centered` columns (LayerNorm statistics), `ρ_r·dot` for the rest (RMS).
pub(super) fn norm_project(
    graph: &Graph,
    id: NodeId,
    name: &str,
    eps: f64,
    centered: usize,
    target: Target,
) -> Result<Lowering, EmitError> {
    let inputs = graph.inputs(id);
    let node = graph.node(id);
    let (kk, m) = (graph.node(inputs[1]).shape.dims()[0], graph.node(inputs[1]).shape.dims()[1]);
    let rows = node.shape.numel() / m.max(1);
    let ty = Ty::of_storage(node.dtype);
    let mut temps = Temps::default();
    let mut steps = Vec::new();
    let x = memory(graph, inputs[0], name, &mut temps, &mut steps, target)?;
    let w = memory(graph, inputs[1], name, &mut temps, &mut steps, target)?;
    let dot = temps.add(rows * m, node.dtype);
    steps.push(Work::Gemm(GemmCall {
        a: x,
        b: w,
        c: dot,
        batch: 1,
        m: rows,
        n: m,
        k: kk,
        trans_a: false,
        trans_b: false,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        offsets: [0; 3],
        accumulate: false,
    }));
    let colsum = (centered > 0).then(|| temps.add(m, node.dtype));
    if let Some(cs) = colsum {
        // Σ_i w_ij in row order, one item per column.
        let mut kb = Kb::new(graph, &format!("{name}_colsum"), m);
        let wv = kb.r.read(&mut kb.k, inputs[1]);
        let out = kb.temp("cs", cs, &temps, Access::Write);
        let names = Names::default();
        let s = sum(&names, &mut kb.k, lit(ty, 0.0), ix(0), ix(kk), |_, i| wv.load(i * ix(m) + item()));
        kb.k.store(&out, item(), s);
        steps.push(kb.finish()?);
    }
    let mut kb = Kb::new(graph, &format!("{name}_rows"), rows);
    let xv = kb.r.read(&mut kb.k, inputs[0]);
    let d = kb.temp("dot", dot, &temps, Access::Read);
    let cs = colsum.map(|a| kb.temp("cs", a, &temps, Access::Read));
    let out = kb.r.buffer(&mut kb.k, id, Access::Write);
    let names = Names::default();
    let k = &mut kb.k;
    let xr = Row::of(&names, k, &xv, item(), kk);
    let ob = k.let_("ob", item() * ix(m));
    let head = cs.as_ref().map(|_| {
        let s = total(&names, k, ty, kk, |_, j| xr.at(j));
        let mu = k.let_("mu", s / lit(ty, kk as f64));
        let sq = total(&names, k, ty, kk, |b, j| {
            let dv = b.let_(&names.fresh("d"), xr.at(j) - mu.clone());
            dv.clone() * dv
        });
        let rho = k.let_("rhoc", lit(ty, 1.0) / (sq / lit(ty, kk as f64) + lit(ty, eps)).sqrt());
        (mu, rho)
    });
    if let (Some((mu, rho)), Some(cs)) = (&head, &cs) {
        k.for_("col", ix(0), ix(centered.min(m)), |b, col| {
            let v = rho.clone() * (d.at(ob.clone() + col.clone()) - cs.at(col.clone()) * mu.clone());
            b.store(&out, ob.clone() + col, v);
        });
    }
    if centered < m {
        let ss = total(&names, k, ty, kk, |b, j| {
            let v = b.let_(&names.fresh("v"), xr.at(j));
            v.clone() * v
        });
        let rho = k.let_("rhor", lit(ty, 1.0) / (ss / lit(ty, kk as f64) + lit(ty, eps)).sqrt());
        k.for_("col", ix(centered), ix(m), |b, col| {
            b.store(&out, ob.clone() + col.clone(), d.at(ob.clone() + col) * rho.clone());
        });
    }
    steps.push(kb.finish()?);
    Ok(Lowering { steps, temps: temps.0, chain: None })
}

/// Row blocks of the loss's first phase (see [`cross_entropy`]): a fixed
/// count, so the order of the sum does not depend on the thread split.
const LOSS_BLOCKS: usize = 16;

/// Mean softmax cross-entropy (docs/math.md §1.3 "Loss") in two phases. First
/// [`LOSS_BLOCKS`] blocks each take a contiguous slice of the rows, whose
/// lanes take rows `first + lane`, `first + lane + 256`, ..., each adding
/// logsumexp − logit[target], and a block reduction sums the lanes into the
/// block's partial; then one item adds the partials in order and divides by
/// the row count. As a single block the loss ran on one CPU thread and one
/// GPU multiprocessor.
///
/// Index safety: the targets (token ids) pick the logit each row subtracts
/// unchecked; `runtime::step::check_tokens` holds them to `0..vocab`, the
/// logits' last axis, before any batch is uploaded.
pub(super) fn cross_entropy(graph: &Graph, id: NodeId, name: &str) -> Result<Lowering, EmitError> {
    let inputs = graph.inputs(id);
    let v = graph.node(inputs[0]).shape.last();
    let rows = graph.node(inputs[1]).shape.numel();
    let dtype = graph.node(id).dtype;
    let ty = Ty::of_storage(dtype);
    let blocks = LOSS_BLOCKS.min(rows.max(1));
    let mut temps = Temps::default();
    let partial_arg = temps.add(blocks, dtype);

    let mut kb = Kb::with_grid(graph, &format!("{name}_rows"), Grid::block_per_item(blocks, LOSS_THREADS));
    let names = Names::default();
    let x = kb.r.read(&mut kb.k, inputs[0]);
    let targets = kb.r.read(&mut kb.k, inputs[1]);
    let partial = kb.temp("partial", partial_arg, &temps, Access::Write);
    let k = &mut kb.k;
    let first = k.let_("first", item() * ix(rows) / ix(blocks));
    let last = k.let_("last", (item() + i64(1)) * ix(rows) / ix(blocks));
    let part = k.var("part", lit(ty, 0.0));
    k.for_step("row", first + lane(), last, i64::from(LOSS_THREADS), Unroll::Auto, |b, row| {
        let base = b.let_("base", row.clone() * ix(v));
        // Both folds in interleaved lanes (a serial sum kept every exponential
        // scalar); the maximum only shifts them (see `shift_maximum`).
        let m = folds::fold(&names, b, lit(ty, f64::NEG_INFINITY), v, shift_maximum, |b, j| {
            b.let_(&names.fresh("xv"), x.load(base.clone() + j))
        });
        let s = total(&names, b, ty, v, |_, j| (x.load(base.clone() + j) - m.clone()).exp());
        let lse = b.let_("lse", m.clone() + s.log());
        let target = b.let_("target", targets.load(row).cast(Ty::I64));
        b.assign(&part, part.clone() + (lse - x.load(base + target)));
    });
    let block_total = k.block_reduce("block_total", Combine::Sum, part);
    k.if_(lane().eq_(i64(0)), |b| b.store(&partial, item(), block_total));
    let per_block = kb.finish()?;

    let mut kb = Kb::with_grid(graph, &format!("{name}_mean"), Grid::thread_per_item(1));
    let partial = kb.temp("partial", partial_arg, &temps, Access::Read);
    let out = kb.r.buffer(&mut kb.k, id, Access::Write);
    let k = &mut kb.k;
    let sum = k.var("sum", lit(ty, 0.0));
    k.for_("b", ix(0), ix(blocks), |b, i| b.assign(&sum, sum.clone() + partial.at(i)));
    k.store(&out, ix(0), sum / lit(ty, rows as f64));
    Ok(Lowering { steps: vec![per_block, kb.finish()?], temps: temps.0, chain: None })
}

/// Channels per strip of [`channel_strips`] on the CPU where they divide the
/// row: eight AVX2 vectors (four AVX-512 ones) of f32, eight independent
/// chains of additions. A strip of one vector per register set kept two
/// chains on AVX2, and each tap waited on the last tap's addition; with eight
/// the taps' loads set the pace.
const CHANNEL_STRIP_WIDE: usize = 64;

/// Channels per strip where [`CHANNEL_STRIP_WIDE`] does not divide the row:
/// one AVX-512 register of f32. On the GPU a strip is one channel: the loop
/// over channels is then one a warp's lanes share
/// ([`crate::kernel::spread_over_lanes`]), each lane summing its channels'
/// taps, its loads consecutive with the other lanes'.
const CHANNEL_STRIP: usize = 16;

/// The CPU's strip for rows of `c` channels.
fn cpu_channel_strip(c: usize) -> usize {
    if c.is_multiple_of(CHANNEL_STRIP_WIDE) {
        CHANNEL_STRIP_WIDE
    } else {
        CHANNEL_STRIP
    }
}

/// The strip for rows of `c` channels on `target`.
fn channel_strip(target: Target, c: usize) -> usize {
    match target {
        Target::Cpu => cpu_channel_strip(c),
        Target::Cuda => 1,
    }
}

/// Per-channel sums over a row of `c` channels, `sum[e] = init(e) + term_1(e) +
/// term_2(e) + …` in that order, then `store(e, sum[e])`: `terms` emits the
/// loops over the terms and calls `add` with each term's channel expression.
///
/// Why strips: summed term by term over the whole row, each term loads, adds
/// to and stores back a local row (three loads and a store per multiply-add
/// of a convolution tap, against two loads), so the temporal convolutions ran
/// at the rate of the local row's loads and stores. Here each strip of
/// `strip` channels keeps its sums in that many variables, which the
/// C compiler packs into one vector, through all the terms, and stores them
/// once. Each channel
/// adds the same terms in the same order from the same start, so the sums are
/// bit for bit the row form's. A row that is not a whole number of strips
/// keeps the row form, in a local array of `c` elements of `ty`.
#[allow(clippy::type_complexity)]
fn channel_strips(
    b: &mut Block,
    names: &Names,
    strip: usize,
    (ty, c): (Ty, usize),
    init: &dyn Fn(Expr) -> Expr,
    terms: &dyn Fn(&mut Block, &dyn Fn(&mut Block, &dyn Fn(Expr) -> Expr)),
    store: &dyn Fn(&mut Block, Expr, Expr),
) {
    if c % strip != 0 {
        let sums = b.local_array(&names.fresh("sums"), ty, c);
        b.for_(&names.fresh("e"), ix(0), ix(c), |b, e| b.store(&sums, e.clone(), init(e)));
        terms(b, &|b, term| {
            b.for_(&names.fresh("e"), ix(0), ix(c), |b, e| {
                b.store(&sums, e.clone(), sums.at(e.clone()) + term(e));
            });
        });
        b.for_(&names.fresh("e"), ix(0), ix(c), |b, e| store(b, e.clone(), sums.at(e)));
        return;
    }
    b.for_(&names.fresh("eb"), ix(0), ix(c / strip), |b, eb| {
        let first = b.let_(&names.fresh("e0"), eb * ix(strip));
        let channel = |l: usize| first.clone() + i64(l as i64);
        let sums: Vec<Expr> = (0..strip).map(|l| b.var(&names.fresh("g"), init(channel(l)))).collect();
        terms(b, &|b, term| {
            for (l, sum) in sums.iter().enumerate() {
                b.assign(sum, sum.clone() + term(channel(l)));
            }
        });
        for (l, sum) in sums.iter().enumerate() {
            store(b, channel(l), sum.clone());
        }
    });
}

/// Tokens per partial sum of the kernel gradients (see [`temporal_grads`]).
const DW_BLOCK: usize = 64;

/// Temporal augmentation state shared by the forward and gradient kernels.
struct Ta<'a> {
    names: &'a Names,
    target: Target,
    ty: Ty,
    x: Val,
    ws: Vec<(Val, usize)>,
    t: usize,
    c: usize,
    eps_rel: f64,
}

impl Ta<'_> {
    fn lit(&self, v: f64) -> Expr {
        lit(self.ty, v)
    }

    /// ⟨u, v⟩ over a row of C; on the GPU as one serial loop, which the
    /// lanes of a warp share ([`folds::serial_fold`]).
    fn dot(&self, b: &mut Block, u: impl Fn(Expr) -> Expr, v: impl Fn(Expr) -> Expr) -> Expr {
        let term = |_: &mut Block, e: Expr| u(e.clone()) * v(e);
        match self.target {
            Target::Cpu => total(self.names, b, self.ty, self.c, term),
            Target::Cuda => folds::serial_fold(self.names, b, lit(self.ty, 0.0), self.c, |x, y| x + y, term),
        }
    }

    /// Row `row` (`[rows, C]`) of a value.
    fn row(&self, b: &mut Block, v: &Val, row: Expr) -> Row {
        Row::of(self.names, b, v, row, self.c)
    }

    /// The causal depthwise convolutions g_j at token `tok` into the local
    /// `dst`, g_j at `at[j]` (docs/math.md §6.5): Σ_{i < κ_j, i ≤ t} w_j[i] ⊙ x[tok − i],
    /// in [`channel_strips`]; every channel adds its taps in order from 0.
    fn convs(&self, b: &mut Block, tok: &Expr, dst: &Buf, at: &[usize]) {
        let n = self.names;
        let t = b.let_(&n.fresh("tt"), tok.clone() % ix(self.t));
        for (j, (w, kappa)) in self.ws.iter().enumerate() {
            let end = b.let_(
                &n.fresh("taps"),
                select((t.clone() + i64(1)).lt(ix(*kappa)), t.clone() + i64(1), ix(*kappa)),
            );
            channel_strips(
                b,
                n,
                channel_strip(self.target, self.c),
                (self.ty, self.c),
                &|_| self.lit(0.0),
                &|b, add| {
                    b.for_(&n.fresh("i"), ix(0), end.clone(), |b, i| {
                        let wr = self.row(b, w, i.clone());
                        let xr = self.row(b, &self.x, tok.clone() - i);
                        add(b, &|e| wr.at(e.clone()) * xr.at(e));
                    });
                },
                &|b, e, sum| b.store(dst, ix(at[j]) + e, sum),
            );
        }
    }

    /// (⟨out, out⟩, guard = ε_rel·⟨out, out⟩ + ε_abs) for the token's `out` row.
    fn guard(&self, b: &mut Block, o: &Row) -> (Expr, Expr) {
        let sq = self.dot(b, |e| o.at(e), |e| o.at(e));
        let sq = b.let_(&self.names.fresh("oo"), sq);
        let guard =
            b.let_(&self.names.fresh("guard"), self.lit(self.eps_rel) * sq.clone() + self.lit(GS_EPS_ABS));
        (sq, guard)
    }
}

/// Local arrays of one token's Gram–Schmidt record and its reverse sweep.
struct GsArrays {
    /// v_0 = out, v_1..v_r: (r + 1) rows of C.
    v: Buf,
    /// ⟨v_i, v_i⟩, computed once per row.
    norm: Buf,
    /// u[j][i]: row j's residual before projecting on v_i, at (j·(r+1) + i)·C.
    u: Buf,
    /// coef[j][i] and den[j][i] of each projection, at j·(r+1) + i.
    coef: Buf,
    den: Buf,
    dv: Buf,
    du: Buf,
}

impl GsArrays {
    fn new(k: &mut KernelBuilder, ty: Ty, r: usize, c: usize) -> GsArrays {
        GsArrays {
            v: k.local_array("gv", ty, (r + 1) * c),
            norm: k.local_array("gnorm", ty, r + 1),
            u: k.local_array("gu", ty, r * (r + 1) * c),
            coef: k.local_array("gcoef", ty, r * (r + 1)),
            den: k.local_array("gden", ty, r * (r + 1)),
            dv: k.local_array("gdv", ty, (r + 1) * c),
            du: k.local_array("gdu", ty, c),
        }
    }
}

/// Modified Gram–Schmidt of one token, forward record and reverse sweep
/// (docs/math.md §6.5, §6.8; `ir::exec::backward_ops::gram_schmidt_back`): writes
/// d g_j into `dg` (rows of C from `dg_at + j·C`) and, when asked, d out's
/// direct part into `direct` (C from its offset). The projections run as
/// loops over (j, i) with the record in local arrays, which keeps the body
/// small enough for registers.
fn gs_back(
    b: &mut Block,
    ta: &Ta,
    arr: &GsArrays,
    tok: &Expr,
    dy: &Val,
    dg: (&Buf, &Expr),
    direct: Option<(&Buf, &Expr)>,
) {
    let (c, r) = (ta.c, ta.ws.len());
    let n = ta.names;
    let o = ta.row(b, &ta.x, tok.clone());
    let (sq, guard) = ta.guard(b, &o);
    let copy = |b: &mut Block, dst: &Buf, at: Expr, src: &dyn Fn(Expr) -> Expr| {
        b.for_(&n.fresh("e"), ix(0), ix(c), |b, e| b.store(dst, at.clone() + e.clone(), src(e)));
    };
    copy(b, &arr.v, ix(0), &|e| o.at(e));
    b.store(&arr.norm, ix(0), sq);
    let at: Vec<usize> = (0..r).map(|j| j * (r + 1) * c).collect();
    ta.convs(b, tok, &arr.u, &at);
    let ur = |j: &Expr, i: &Expr| (j.clone() * ix(r + 1) + i.clone()) * ix(c);
    let ci = |j: &Expr, i: &Expr| j.clone() * ix(r + 1) + i.clone();
    b.for_(&n.fresh("j"), ix(0), ix(r), |b, j| {
        b.for_(&n.fresh("i"), ix(0), j.clone() + i64(1), |b, i| {
            let vi = b.let_(&n.fresh("vi"), i.clone() * ix(c));
            let dn = b.let_(&n.fresh("den"), arr.norm.at(i.clone()) + guard.clone());
            let uji = b.let_(&n.fresh("uji"), ur(&j, &i));
            let du = ta.dot(b, |e| arr.u.at(uji.clone() + e), |e| arr.v.at(vi.clone() + e));
            let cf = b.let_(&n.fresh("coef"), du / dn.clone());
            b.store(&arr.coef, ci(&j, &i), cf.clone());
            b.store(&arr.den, ci(&j, &i), dn);
            let next = |e: Expr| arr.u.at(uji.clone() + e.clone()) - cf.clone() * arr.v.at(vi.clone() + e);
            b.if_else(
                i.clone().eq_(j.clone()),
                |b| {
                    let vn = b.let_(&n.fresh("vn"), (j.clone() + i64(1)) * ix(c));
                    copy(b, &arr.v, vn.clone(), &next);
                    let nn = ta.dot(b, |e| arr.v.at(vn.clone() + e), |e| arr.v.at(vn.clone() + e));
                    b.store(&arr.norm, j.clone() + i64(1), nn);
                },
                |b| copy(b, &arr.u, uji.clone() + ix(c), &next),
            );
        });
    });
    copy(b, &arr.dv, ix(0), &|_| ta.lit(0.0));
    b.for_(&n.fresh("j"), ix(0), ix(r), |b, j| {
        let at = (j.clone() + i64(1)) * ix(c);
        let d = ta.row(b, dy, tok.clone() * ix(r) + j);
        copy(b, &arr.dv, at, &|e| d.at(e));
    });
    let d_guard = b.var(&n.fresh("dguard"), ta.lit(0.0));
    b.for_(&n.fresh("jr"), ix(0), ix(r), |b, jr| {
        let j = b.let_(&n.fresh("jj"), ix(r - 1) - jr);
        copy(b, &arr.du, ix(0), &|e| arr.dv.at((j.clone() + i64(1)) * ix(c) + e));
        b.for_(&n.fresh("ir"), ix(0), j.clone() + i64(1), |b, ir| {
            let i = b.let_(&n.fresh("ii"), j.clone() - ir);
            let vi = b.let_(&n.fresh("vi"), i.clone() * ix(c));
            let uji = b.let_(&n.fresh("uji"), ur(&j, &i));
            let cf = b.let_(&n.fresh("cf"), arr.coef.at(ci(&j, &i)));
            let dn = b.let_(&n.fresh("dn"), arr.den.at(ci(&j, &i)));
            let dot = ta.dot(b, |e| arr.du.at(e), |e| arr.v.at(vi.clone() + e));
            let dcoef = b.let_(&n.fresh("dcoef"), -dot);
            let ddot = b.let_(&n.fresh("ddot"), dcoef.clone() / dn.clone());
            let dden = b.let_(&n.fresh("dden"), (-dcoef) * cf.clone() / dn);
            b.for_(&n.fresh("e"), ix(0), ix(c), |b, e| {
                let v = arr.v.at(vi.clone() + e.clone());
                let upd = ddot.clone() * arr.u.at(uji.clone() + e.clone())
                    + ta.lit(2.0) * dden.clone() * v.clone()
                    - cf.clone() * arr.du.at(e.clone());
                b.store(&arr.dv, vi.clone() + e.clone(), arr.dv.at(vi.clone() + e.clone()) + upd);
                b.store(&arr.du, e.clone(), arr.du.at(e) + ddot.clone() * v);
            });
            b.assign(&d_guard, d_guard.clone() + dden);
        });
        copy(b, dg.0, dg.1.clone() + j * ix(c), &|e| arr.du.at(e));
    });
    if let Some((direct, at)) = direct {
        let scale = b.let_(&n.fresh("gscale"), ta.lit(2.0) * ta.lit(ta.eps_rel) * d_guard);
        copy(b, direct, at.clone(), &|e| arr.dv.at(e.clone()) + scale.clone() * arr.v.at(e));
    }
}

/// TemporalAugment (docs/math.md §6.5) with one item per token: the causal
/// convolutions, then Gram–Schmidt against `out` and the earlier rows. The
/// projections run column by column (every later row on v_i, then on
/// v_{i+1}), which computes the same values as row by row and lets each
/// ⟨v_i, v_i⟩ be computed once.
pub(super) fn temporal(
    graph: &Graph,
    id: NodeId,
    name: &str,
    gram_schmidt: bool,
    eps_rel: f64,
    target: Target,
) -> Result<Launch, EmitError> {
    let inputs = graph.inputs(id);
    let xd = graph.node(inputs[0]).shape.dims();
    let (bsz, t, c) = (xd[0], xd[1], xd[2]);
    let rk = inputs.len() - 1;
    let ty = Ty::of_storage(graph.node(id).dtype);
    let mut k = KernelBuilder::new(name, grid(bsz * t));
    let mut r = Reader::new(graph);
    let names = Names::default();
    let x = r.read(&mut k, inputs[0]);
    let ws: Vec<(Val, usize)> =
        (1..=rk).map(|j| (r.read(&mut k, inputs[j]), graph.node(inputs[j]).shape.dims()[0])).collect();
    let out = r.buffer(&mut k, id, Access::Write);
    let ta = Ta { names: &names, target, ty, x, ws, t, c, eps_rel };
    let y = k.local_array("y", ty, rk * c);
    let at: Vec<usize> = (0..rk).map(|j| j * c).collect();
    ta.convs(&mut k, &item(), &y, &at);
    if gram_schmidt {
        let o = ta.row(&mut k, &ta.x, item());
        let (sq, guard) = ta.guard(&mut k, &o);
        for i in 0..rk {
            let v = |e: Expr| if i == 0 { o.at(e) } else { y.at(ix((i - 1) * c) + e) };
            let vv = if i == 0 { sq.clone() } else { ta.dot(&mut k, v, v) };
            let den = k.let_(&names.fresh("den"), vv + guard.clone());
            for j in i..rk {
                let du = ta.dot(&mut k, |e| y.at(ix(j * c) + e), v);
                let cf = k.let_(&names.fresh("coef"), du / den.clone());
                k.for_(&names.fresh("e"), ix(0), ix(c), |b, e| {
                    let at = ix(j * c) + e.clone();
                    b.store(&y, at.clone(), y.at(at) - cf.clone() * v(e));
                });
            }
        }
    }
    let ob = k.let_("ob", item() * ix(rk * c));
    k.for_("e", ix(0), ix(rk * c), |b, e| b.store(&out, ob.clone() + e.clone(), y.at(e)));
    finish(k, r)
}

/// The gradients of one TemporalAugment (docs/math.md §6.8) w.r.t. `out`
/// (`outs[0]`) and the kernels (`outs[j]`), whichever are present: the
/// TemporalAugmentGrad nodes sharing their inputs. With Gram–Schmidt, a first
/// kernel runs each token's reverse sweep once (one item per token) into
/// d g `[tokens, r, C]` and d out's direct part `[tokens, C]`; without it d g
/// is dY itself. Then d out (one item per token) adds the transposed
/// convolutions. The kernel gradients `d w_j[i] = Σ_t d g_j[t] ⊙ out[t − i]` are
/// token reductions in two phases: one item per (`DW_BLOCK` tokens, tap
/// row of every requested kernel) sums its tokens over contiguous channels,
/// then one item per (tap, channel) of each kernel adds the blocks in order.
pub fn temporal_grads(
    graph: &Graph,
    outs: &[Option<NodeId>],
    name: &str,
    target: Target,
) -> Result<Lowering, EmitError> {
    let id = super::first_requested(outs, "temporal_augment_grad", "gradient")?;
    let Op::TemporalAugmentGrad { gram_schmidt, eps_rel, .. } = graph.node(id).op else {
        return Err(EmitError::at(id, &graph.node(id).op, "is not a temporal augmentation gradient"));
    };
    let inputs = graph.inputs(id);
    let xd = graph.node(inputs[0]).shape.dims();
    let (bsz, t, c) = (xd[0], xd[1], xd[2]);
    let tokens = bsz * t;
    let rk = inputs.len() - 2;
    let dtype = graph.node(id).dtype;
    let ty = Ty::of_storage(dtype);
    let kappa: Vec<usize> = (1..=rk).map(|j| graph.node(inputs[j]).shape.dims()[0]).collect();
    let mut temps = Temps::default();
    let mut steps = Vec::new();
    let setup = |kb: &mut Kb| {
        let names = Names::default();
        let x = kb.r.read(&mut kb.k, inputs[0]);
        let ws: Vec<(Val, usize)> =
            (1..=rk).map(|j| (kb.r.read(&mut kb.k, inputs[j]), kappa[j - 1])).collect();
        (names, x, ws)
    };
    // d g_j[tok][e] at (tok·r + j)·C + e and, with Gram–Schmidt, the direct part.
    let stored = if gram_schmidt {
        let dg = temps.add(tokens * rk * c, dtype);
        let direct = temps.add(tokens * c, dtype);
        let mut kb = Kb::new(graph, &format!("{name}_sweep"), tokens);
        let (names, x, ws) = setup(&mut kb);
        let dy = kb.r.read(&mut kb.k, inputs[rk + 1]);
        let dgb = kb.temp("dg", dg, &temps, Access::Write);
        let db = kb.temp("direct", direct, &temps, Access::Write);
        let ta = Ta { names: &names, target, ty, x, ws, t, c, eps_rel };
        let arr = GsArrays::new(&mut kb.k, ty, rk, c);
        let dg_at = kb.k.let_("dgat", item() * ix(rk * c));
        let direct_at = kb.k.let_("dirat", item() * ix(c));
        gs_back(&mut kb.k, &ta, &arr, &item(), &dy, (&dgb, &dg_at), Some((&db, &direct_at)));
        steps.push(kb.finish()?);
        Some((dg, direct))
    } else {
        None
    };
    // Tap rows (j, tap) of the requested kernel gradients, kernel by kernel.
    let wanted: Vec<(usize, NodeId)> =
        outs.iter().enumerate().skip(1).filter_map(|(j, o)| o.map(|o| (j, o))).collect();
    let mut first_row = Vec::with_capacity(wanted.len());
    let mut rows = 0;
    for &(j, _) in &wanted {
        first_row.push(rows);
        rows += kappa[j - 1];
    }
    let blocks = tokens.div_ceil(DW_BLOCK);
    let part = (!wanted.is_empty()).then(|| temps.add(blocks * rows * c, dtype));
    // d g and the direct part as a kernel reads them.
    let reads = |kb: &mut Kb| -> (Val, Option<Buf>) {
        match stored {
            Some((dg, direct)) => {
                let dg = Val::Buffer(kb.temp("dg", dg, &temps, Access::Read));
                (dg, Some(kb.temp("direct", direct, &temps, Access::Read)))
            }
            None => (kb.r.read(&mut kb.k, inputs[rk + 1]), None),
        }
    };
    if let Some(out) = outs.first().copied().flatten() {
        let mut kb = Kb::new(graph, &format!("{name}_dout"), tokens);
        let (names, _, ws) = setup(&mut kb);
        let (dg, direct) = reads(&mut kb);
        let o = kb.r.buffer(&mut kb.k, out, Access::Write);
        let k = &mut kb.k;
        let tt = k.let_("tt", item() % ix(t));
        let kmax = kappa.iter().copied().max().unwrap_or(1);
        // Source tokens t + i of the same sequence.
        let reach = k.let_("reach", select((ix(t) - tt.clone()).lt(ix(kmax)), ix(t) - tt, ix(kmax)));
        // d x = direct + Σ_j Σ_i w_j[i] ⊙ d g_j[tok + i], kernel by kernel, taps in order.
        // The GPU's thread per token keeps strips of 16 (its registers).
        let strip = match target {
            Target::Cpu => cpu_channel_strip(c),
            Target::Cuda => CHANNEL_STRIP,
        };
        channel_strips(
            k,
            &names,
            strip,
            (ty, c),
            &|e| match &direct {
                Some(d) => d.at(item() * ix(c) + e),
                None => lit(ty, 0.0),
            },
            &|b, add| {
                for (j, (w, kj)) in ws.iter().enumerate() {
                    let end = select(reach.clone().lt(ix(*kj)), reach.clone(), ix(*kj));
                    b.for_(&names.fresh("i"), ix(0), end, |b, i| {
                        let src = Row::of(&names, b, &dg, (item() + i.clone()) * ix(rk) + ix(j), c);
                        let wr = Row::of(&names, b, w, i, c);
                        add(b, &|e| wr.at(e.clone()) * src.at(e));
                    });
                }
            },
            &|b, e, sum| b.store(&o, item() * ix(c) + e, sum),
        );
        steps.push(kb.finish()?);
    }
    if let Some(part) = part {
        let mut kb = Kb::new(graph, &format!("{name}_dwpart"), blocks * rows);
        let (names, x, _) = setup(&mut kb);
        let (dg, _) = reads(&mut kb);
        let pb = kb.temp("part", part, &temps, Access::Write);
        let k = &mut kb.k;
        let blk = k.let_("blk", item() / ix(rows));
        let row = k.let_("row", item() % ix(rows));
        // The row's kernel (0-based) and tap: the last kernel whose first row is ≤ row.
        let (mut jsel, mut first) = (ix(wanted[0].0 - 1), ix(0));
        for (&(j, _), &f) in wanted.iter().zip(&first_row).skip(1) {
            jsel = select(row.clone().lt(ix(f)), jsel, ix(j - 1));
            first = select(row.clone().lt(ix(f)), first, ix(f));
        }
        let jk = k.let_("jk", jsel);
        let tap = k.let_("tap", row - first);
        // The block's tokens [t0, t1).
        let token_range = |k: &mut KernelBuilder| {
            let t0 = k.let_("t0", blk.clone() * ix(DW_BLOCK));
            let t1 = k.let_(
                "t1",
                select((t0.clone() + ix(DW_BLOCK)).lt(ix(tokens)), t0.clone() + ix(DW_BLOCK), ix(tokens)),
            );
            (t0, t1)
        };
        // Each channel sums its block's tokens in token order, in both forms.
        match target {
            // Tokens outer, channels inner: the C compiler vectorizes the channels.
            Target::Cpu => {
                let acc = k.local_array("acc", ty, c);
                k.for_("e", ix(0), ix(c), |b, e| b.store(&acc, e, lit(ty, 0.0)));
                let (t0, t1) = token_range(k);
                k.for_("tok", t0, t1, |b, tok| {
                    b.if_((tok.clone() % ix(t)).ge(tap.clone()), |b| {
                        let g = Row::of(&names, b, &dg, tok.clone() * ix(rk) + jk.clone(), c);
                        let v = Row::of(&names, b, &x, tok - tap.clone(), c);
                        b.for_("e", ix(0), ix(c), |b, e| {
                            b.store(&acc, e.clone(), acc.at(e.clone()) + g.at(e.clone()) * v.at(e));
                        });
                    });
                });
                let pat = k.let_("pat", item() * ix(c));
                k.for_("e", ix(0), ix(c), |b, e| b.store(&pb, pat.clone() + e.clone(), acc.at(e)));
            }
            // Channels outer, tokens inner: a warp's lanes share the channels
            // (`spread_over_lanes`), each token's loads consecutive across lanes.
            Target::Cuda => {
                let (t0, t1) = token_range(k);
                let pat = k.let_("pat", item() * ix(c));
                k.for_("e", ix(0), ix(c), |b, e| {
                    let sum = b.var("sum", lit(ty, 0.0));
                    b.for_("tok", t0.clone(), t1.clone(), |b, tok| {
                        b.if_((tok.clone() % ix(t)).ge(tap.clone()), |b| {
                            let g = dg.load((tok.clone() * ix(rk) + jk.clone()) * ix(c) + e.clone());
                            let v = x.load((tok - tap.clone()) * ix(c) + e.clone());
                            b.assign(&sum, sum.clone() + g * v);
                        });
                    });
                    b.store(&pb, pat.clone() + e, sum);
                });
            }
        }
        steps.push(kb.finish()?);
        for (&(j, out), &f) in wanted.iter().zip(&first_row) {
            let kj = kappa[j - 1];
            let mut kb = Kb::new(graph, &format!("{name}_dw{j}"), kj * c);
            let pb = kb.temp("part", part, &temps, Access::Read);
            let o = kb.r.buffer(&mut kb.k, out, Access::Write);
            let k = &mut kb.k;
            // Row f + tap of every block, in block order: item is (tap, e), so the
            // element of block b is at b·rows·C + f·C + item.
            let acc = k.var("acc", lit(ty, 0.0));
            k.for_("blk", ix(0), ix(blocks), |b, blk| {
                b.assign(&acc, acc.clone() + pb.at(blk * ix(rows * c) + ix(f * c) + item()));
            });
            k.store(&o, item(), acc);
            steps.push(kb.finish()?);
        }
    }
    Ok(Lowering { steps, temps: temps.0, chain: None })
}
