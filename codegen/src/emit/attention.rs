//! Causal attention and its gradients as library GEMMs around small row
//! kernels, one block of query rows at a time (docs/math.md §1.3, §1.4;
//! docs/architecture.md §5 "heavy ops are kernels of their own").
//!
//! The operands are first copied to head-major rows `[B, H, T, dh]` (RoPE
//! applied, key/value heads repeated per query head), so that every (b, h) is
//! one contiguous matrix. The queries then split into blocks of at most
//! `tq` rows ([`query_block_rows`]); block `i`, rows `[i·tq, i·tq + r)`, only
//! meets the key prefix `[0, i·tq + r)` (every later key is masked). Per
//! block, for every (b, h) at once:
//!
//! - forward: `S = Q_i·K_{<e}ᵀ` (GEMM), a row kernel turns `S` into the
//!   causal softmax `P` (scale, max, Σ exp, masked entries 0), `O_i = P·V_{<e}`
//!   (GEMM); after the last block a kernel copies `O` back to `[B, T, H, dh]`;
//! - backward, last block first: `S` and `dP = dO_i·V_{<e}ᵀ` (GEMMs), one row
//!   kernel computes the softmax statistics and writes both `P` and
//!   `dS = P ⊙ (dP − rowsum(P ⊙ dP)) · scale` (FlashAttention's form, the
//!   row sum being `rowsum(dO ⊙ O)`), then `dQ_i = dS·K_{<e}` (GEMM) and
//!   `dK_{<e} += dSᵀ·Q_i`, `dV_{<e} += Pᵀ·dO_i` (GEMMs; the last block, whose
//!   prefix is every key, overwrites) for whichever of the three gradients are
//!   wanted; the copies back sum the query heads of each key/value head and
//!   undo RoPE (its VJP is the inverse rotation).
//!
//! Every block reuses one score buffer (and, backward, one dP buffer) of
//! `B·H·tq·T` elements: memory linear in the sequence, where the whole
//! score matrix is `B·H·T²` (docs/math.md §1.4: at GPT-2 small, 25 MB per
//! buffer instead of 400 MB). Each row's softmax is exact over its whole key
//! prefix, so no running maximum is needed; the backward pass recomputes the
//! probabilities block by block from q and k, and the forward keeps only its
//! output. The products do `(nb+1)/(2·nb)` of the full matrices' work for `nb`
//! equal blocks; entries above the diagonal inside a block are written as
//! zeros so they contribute nothing.
//!
//! On the CPU the steps from the copies in to the last head-major product
//! form a [`crate::plan::Chain`] of one entry per (b, h), which the Cpu device
//! runs a head at a time: a head's block of scores (256 KB at T = 1024,
//! 64 rows) and the operand rows its products read then stay in its core's
//! cache from one step to the next, where step by step each GEMM and row
//! kernel streamed every head through memory. Each (b, h) owns its slab of the score
//! buffers, so the heads that different threads run never share one. The
//! backward pass computes all its products before its copies back (item
//! (b, t, head), not head-major), which stay outside.

use ir::graph::{Graph, NodeId, Op};
use ir::DType;

use super::buffers::Kb;
use super::folds::{fold_dynamic, maximum, shift_maximum};
use super::{ix, lit, Arg, ChainWorks, EmitError, GemmCall, Lowering, Names, Target, Temps, Work};
use crate::kernel::{f64, i64, item, lane, select, Access, Block, Buf, Combine, Expr, Grid, Ty, Unroll};

/// Most query rows per block on the CPU: a (b, h)'s block of scores at
/// T = 1024 is 256 KB, within a core's L2 with the head's operands.
const CPU_BLOCK_ROWS: usize = 64;

/// Most query rows per block on the GPU: fewer, larger batched GEMMs (one
/// launch per block and product), the score buffer still linear in T.
const CUDA_BLOCK_ROWS: usize = 128;

/// Query rows per causal block at sequence length `t`: a quarter of the
/// sequence, at most the target's block rows, and the whole sequence when it
/// is at most 16 tokens (its full score matrix is smaller than the GEMM calls
/// the blocks would add).
pub fn query_block_rows(t: usize, target: Target) -> usize {
    let most = match target {
        Target::Cpu => CPU_BLOCK_ROWS,
        Target::Cuda => CUDA_BLOCK_ROWS,
    };
    if t <= 16 {
        t.max(1)
    } else {
        t.div_ceil(4).min(most)
    }
}

/// Sizes and options of one attention node: q [B, T, H, dh], k and v [B, T, Hkv, dh].
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    hkv: usize,
    dh: usize,
    scale: f64,
    rope: Option<f64>,
    dtype: DType,
    /// Query rows per block ([`query_block_rows`]).
    tq: usize,
}

/// Query rows `[start, start + rows)` of every (b, h), against the keys `[0, keys())`.
#[derive(Debug, Clone, Copy)]
struct QueryBlock {
    index: usize,
    start: usize,
    rows: usize,
}

impl QueryBlock {
    /// The key prefix the block's rows see: up to its last row.
    fn keys(&self) -> usize {
        self.start + self.rows
    }
}

impl Dims {
    fn of(graph: &Graph, id: NodeId, target: Target) -> Result<Dims, EmitError> {
        let node = graph.node(id);
        let (Op::CausalAttention { scale, rope_base: rope }
        | Op::CausalAttentionGrad { scale, rope_base: rope, .. }) = node.op
        else {
            return Err(EmitError::at(id, &node.op, "is not attention"));
        };
        let inputs = graph.inputs(id);
        let (qd, kd) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
        let t = qd[1];
        let d = Dims {
            b: qd[0],
            t,
            h: qd[2],
            hkv: kd[2],
            dh: qd[3],
            scale,
            rope,
            dtype: node.dtype,
            tq: query_block_rows(t, target),
        };
        if d.rope.is_some() && d.dh % 2 == 1 {
            return Err(EmitError::at(id, &node.op, format!("RoPE needs an even head dim, got {}", d.dh)));
        }
        Ok(d)
    }

    fn ty(&self) -> Ty {
        Ty::of_storage(self.dtype)
    }

    /// Head-major rows (b, h, t).
    fn rows(&self) -> usize {
        self.b * self.h * self.t
    }

    /// Elements of one head-major operand.
    fn mat(&self) -> usize {
        self.rows() * self.dh
    }

    /// The causal query blocks, first rows first.
    fn blocks(&self) -> Vec<QueryBlock> {
        (0..self.t.div_ceil(self.tq))
            .map(|index| {
                let start = index * self.tq;
                QueryBlock { index, start, rows: self.tq.min(self.t - start) }
            })
            .collect()
    }

    /// Score elements of one (b, h) entry: the largest block's `[rows, keys]`.
    fn slab(&self) -> usize {
        self.blocks().iter().map(|q| q.rows * q.keys()).max().unwrap_or(1)
    }

    /// Elements of a score buffer, one slab per (b, h).
    fn scores(&self) -> usize {
        self.b * self.h * self.slab()
    }

    fn half(&self) -> usize {
        self.dh / 2
    }

    /// The head-major steps `works` as a chain of one entry per (b, h) on the
    /// CPU: the copies in, the row kernels and the GEMMs all address one
    /// (b, h) per run of items or per batch entry. The copies back (item
    /// = (b, t, head)) are not part of it. The GPU runs steps whole.
    fn chain(&self, works: std::ops::Range<usize>, target: Target) -> Option<ChainWorks> {
        (target == Target::Cpu && self.dtype == DType::F32)
            .then(|| ChainWorks { works, entries: self.b * self.h })
    }

    /// `S = x_i·y_{<e}ᵀ` per (b, h) (scores or dP) for query block `q`.
    fn scores_gemm(&self, q: QueryBlock, x: Arg, y: Arg, out: Arg) -> Work {
        let (t, dh) = (self.t, self.dh);
        Work::Gemm(GemmCall {
            a: x,
            b: y,
            c: out,
            batch: self.b * self.h,
            m: q.rows,
            n: q.keys(),
            k: dh,
            trans_a: false,
            trans_b: true,
            stride_a: t * dh,
            stride_b: t * dh,
            stride_c: self.slab(),
            offsets: [q.start * dh, 0, 0],
            accumulate: false,
        })
    }

    /// Per (b, h), `out_i = s·y_{<e}` (the block's output rows), or when
    /// `trans`, `out_{<e} (+)= sᵀ·y_i` (the key prefix's rows, accumulated
    /// unless `q` is the first block computed, the last one, whose prefix
    /// covers every row).
    fn rows_gemm(&self, q: QueryBlock, s: Arg, y: Arg, out: Arg, trans: bool) -> Work {
        let (t, dh) = (self.t, self.dh);
        let (m, k, offsets) = if trans {
            (q.keys(), q.rows, [0, q.start * dh, 0])
        } else {
            (q.rows, q.keys(), [0, 0, q.start * dh])
        };
        Work::Gemm(GemmCall {
            a: s,
            b: y,
            c: out,
            batch: self.b * self.h,
            m,
            n: dh,
            k,
            trans_a: trans,
            trans_b: false,
            stride_a: self.slab(),
            stride_b: t * dh,
            stride_c: t * dh,
            offsets,
            accumulate: trans && q.keys() < t,
        })
    }
}

/// The RoPE table `[T, dh/2]` of (cos φ, sin φ), φ = t·base^(-2i/dh), computed
/// in f64 and rounded once as the reference does (docs/math.md §1.3).
fn rope_table(
    graph: &Graph,
    d: &Dims,
    base: f64,
    name: &str,
    out: Arg,
    temps: &Temps,
) -> Result<Work, EmitError> {
    let half = d.half();
    let mut kb = Kb::new(graph, &format!("{name}_rope"), d.t * half);
    let cs = kb.temp("cs", out, temps, Access::Write);
    let k = &mut kb.k;
    let t = k.let_("t", item() / ix(half));
    let i = k.let_("i", item() % ix(half));
    let theta = k.let_("theta", f64(base).pow((f64(-2.0) * i.cast(Ty::F64)) / f64(d.dh as f64)));
    let phi = k.let_("phi", t.cast(Ty::F64) * theta);
    k.store(&cs, item() * i64(2), phi.clone().cos().cast(d.ty()));
    k.store(&cs, item() * i64(2) + i64(1), phi.sin().cast(d.ty()));
    kb.finish()
}

/// Copies one row of `dh` elements from `src` (at `from`) to `dst` (at `to`),
/// rotated by the angles of position `pos` (`inverse`: by −φ) when `cs` is set.
#[allow(clippy::too_many_arguments)]
fn copy_row(
    b: &mut Block,
    names: &Names,
    d: &Dims,
    cs: Option<&Buf>,
    load: &dyn Fn(Expr) -> Expr,
    store: &dyn Fn(&mut Block, Expr, Expr),
    pos: &Expr,
    inverse: bool,
) {
    let Some(cs) = cs else {
        b.for_(&names.fresh("e"), ix(0), ix(d.dh), |b, e| store(b, e.clone(), load(e)));
        return;
    };
    let half = d.half();
    b.for_(&names.fresh("j"), ix(0), ix(half), |b, j| {
        let at = b.let_(&names.fresh("at"), (pos.clone() * ix(half) + j.clone()) * i64(2));
        let c = b.let_(&names.fresh("c"), cs.at(at.clone()));
        let s = b.let_(&names.fresh("s"), cs.at(at + i64(1)));
        let x0 = b.let_(&names.fresh("x0"), load(j.clone()));
        let x1 = b.let_(&names.fresh("x1"), load(j.clone() + ix(half)));
        let (lo, hi) = if inverse {
            (x0.clone() * c.clone() + x1.clone() * s.clone(), x1 * c - x0 * s)
        } else {
            (x0.clone() * c.clone() - x1.clone() * s.clone(), x0 * s + x1 * c)
        };
        store(b, j.clone(), lo);
        store(b, j + ix(half), hi);
    });
}

/// The head-major copies: `qp`, `kp` (rotated) and `vp` (key/value heads
/// repeated per query head), and `dop` when the gradient's dO is given
/// (input 3). Item = head-major row (b, h, t).
#[allow(clippy::too_many_arguments)]
fn prepare(
    graph: &Graph,
    id: NodeId,
    d: &Dims,
    name: &str,
    temps: &Temps,
    cs: Option<Arg>,
    outs: [Arg; 3],
    dop: Option<Arg>,
) -> Result<Work, EmitError> {
    let mut kb = Kb::new(graph, &format!("{name}_prep"), d.rows());
    let inputs = graph.inputs(id);
    let names = Names::default();
    let (q, kk, v) =
        (kb.r.read(&mut kb.k, inputs[0]), kb.r.read(&mut kb.k, inputs[1]), kb.r.read(&mut kb.k, inputs[2]));
    let dout = dop.map(|_| kb.r.read(&mut kb.k, inputs[3]));
    let cs = cs.map(|a| kb.temp("cs", a, temps, Access::Read));
    let [qa, ka, va] = outs;
    let qp = kb.temp("qp", qa, temps, Access::Write);
    let kp = kb.temp("kp", ka, temps, Access::Write);
    let vp = kb.temp("vp", va, temps, Access::Write);
    let dp = dop.map(|a| kb.temp("dop", a, temps, Access::Write));
    let k = &mut kb.k;
    let bh = k.let_("bh", item() / ix(d.t));
    let t = k.let_("t", item() % ix(d.t));
    let bi = k.let_("bi", bh.clone() / ix(d.h));
    let h = k.let_("h", bh % ix(d.h));
    let g = k.let_("g", (h.clone() * ix(d.hkv)) / ix(d.h));
    let qrow = k.let_("qrow", ((bi.clone() * ix(d.t) + t.clone()) * ix(d.h) + h) * ix(d.dh));
    let krow = k.let_("krow", ((bi * ix(d.t) + t.clone()) * ix(d.hkv) + g) * ix(d.dh));
    let dst = k.let_("dst", item() * ix(d.dh));
    let to = |buf: &Buf| {
        let (buf, dst) = (buf.clone(), dst.clone());
        move |b: &mut Block, e: Expr, v: Expr| b.store(&buf, dst.clone() + e, v)
    };
    copy_row(k, &names, d, cs.as_ref(), &|e| q.load(qrow.clone() + e), &to(&qp), &t, false);
    copy_row(k, &names, d, cs.as_ref(), &|e| kk.load(krow.clone() + e), &to(&kp), &t, false);
    copy_row(k, &names, d, None, &|e| v.load(krow.clone() + e), &to(&vp), &t, false);
    if let (Some(dout), Some(dp)) = (dout, dp) {
        copy_row(k, &names, d, None, &|e| dout.load(qrow.clone() + e), &to(&dp), &t, false);
    }
    kb.finish()
}

/// Where score row `item` (block `q`'s row r of (b, h), item = (b, h, r))
/// lies in a score buffer: its stored length (the block's key prefix), its
/// first element and its count of unmasked keys (t + 1 for t = start + r).
fn score_row(k: &mut Block, d: &Dims, q: QueryBlock) -> (Expr, Expr, Expr) {
    let r = k.let_("r", item() % ix(q.rows));
    let len = ix(q.keys());
    let base = k.let_("base", (item() / ix(q.rows)) * ix(d.slab()) + r.clone() * len.clone());
    let end = k.let_("stop", r + ix(q.start + 1));
    (len, base, end)
}

/// The causal softmax of one score row in place (and, with `dp`, dS into `dp`
/// in place) over query block `q`: item = (b, h, row of the block), keys
/// t' ≤ t, the rest of the block's prefix zeroed. On the GPU each row is a
/// block of lanes ([`softmax_rows_blocks`]).
#[allow(clippy::too_many_arguments)]
fn softmax_rows(
    graph: &Graph,
    d: &Dims,
    q: QueryBlock,
    name: &str,
    temps: &Temps,
    s_arg: Arg,
    dp_arg: Option<Arg>,
    target: Target,
) -> Result<Work, EmitError> {
    if target == Target::Cuda {
        return softmax_rows_blocks(graph, d, q, name, temps, s_arg, dp_arg);
    }
    let mut kb = Kb::new(graph, name, d.b * d.h * q.rows);
    let s = kb.temp("s", s_arg, temps, Access::ReadWrite);
    let dp = dp_arg.map(|a| kb.temp("dp", a, temps, Access::ReadWrite));
    let ty = d.ty();
    let k = &mut kb.k;
    let (len, base, end) = score_row(k, d, q);
    let scale = lit(ty, d.scale);
    // Lane-split folds (see `fold_dynamic`): the max, the sum of exponentials and
    // the centring dot product vectorize instead of chaining one add per key.
    let names = Names::default();
    let m = fold_dynamic(&names, k, lit(ty, f64::NEG_INFINITY), end.clone(), shift_maximum, |_, j| {
        s.at(base.clone() + j) * scale.clone()
    });
    // The exponentials in a loop of their own, then summed: inside the fold,
    // the keys past its last whole group of lanes took the exponential one
    // at a time (a third of the row's time); alone, the loop vectorizes to
    // its end. The sum adds the same values in the same lanes.
    k.for_("je", ix(0), end.clone(), |b, j| {
        let at = b.let_("at", base.clone() + j);
        b.store(&s, at.clone(), (s.at(at) * scale.clone() - m.clone()).exp());
    });
    let total =
        fold_dynamic(&names, k, lit(ty, 0.0), end.clone(), |a, b| a + b, |_, j| s.at(base.clone() + j));
    let inv = k.let_("inv", lit(ty, 1.0) / total);
    // One pass over the block row: normalized up to t, zeros after (the masked keys
    // inside the block, which the next GEMM reads).
    k.for_("j", ix(0), len.clone(), |b, j| {
        let at = b.let_("at", base.clone() + j.clone());
        let p = select(j.lt(end.clone()), s.at(at.clone()) * inv.clone(), lit(ty, 0.0));
        b.store(&s, at, p);
    });
    if let Some(dp) = dp {
        let centre = fold_dynamic(
            &names,
            k,
            lit(ty, 0.0),
            end.clone(),
            |a, b| a + b,
            |_, j| {
                let at = base.clone() + j;
                s.at(at.clone()) * dp.at(at)
            },
        );
        k.for_("j", ix(0), len, |b, j| {
            let at = b.let_("at", base.clone() + j);
            // Masked entries have p = 0, so their dS is 0 as well.
            let ds = s.at(at.clone()) * (dp.at(at.clone()) - centre.clone()) * scale.clone();
            b.store(&dp, at, ds);
        });
    }
    kb.finish()
}

/// Lanes per score row of [`softmax_rows_blocks`].
const SOFTMAX_LANES: u32 = 128;

/// [`softmax_rows`] on the GPU: one block of [`SOFTMAX_LANES`] lanes per
/// score row. Lane `l` handles keys `l, l + lanes, …`, so a warp's loads are
/// contiguous, and the row maximum, the sum of exponentials and the centring
/// dot product are block reductions. One thread per row (the C form) would
/// walk up to T keys alone with its warp's loads T floats apart. Each lane
/// only rereads the keys it wrote, so the passes need no barrier beyond the
/// reductions'.
fn softmax_rows_blocks(
    graph: &Graph,
    d: &Dims,
    q: QueryBlock,
    name: &str,
    temps: &Temps,
    s_arg: Arg,
    dp_arg: Option<Arg>,
) -> Result<Work, EmitError> {
    let lanes = SOFTMAX_LANES;
    let mut kb = Kb::with_grid(graph, name, Grid::block_per_item(d.b * d.h * q.rows, lanes));
    let s = kb.temp("s", s_arg, temps, Access::ReadWrite);
    let dp = dp_arg.map(|a| kb.temp("dp", a, temps, Access::ReadWrite));
    let ty = d.ty();
    let k = &mut kb.k;
    let (len, base, end) = score_row(k, d, q);
    let scale = lit(ty, d.scale);
    let step = i64::from(lanes);
    let keys =
        |k: &mut crate::kernel::KernelBuilder, var: &str, stop: &Expr, f: &dyn Fn(&mut Block, Expr)| {
            k.for_step(var, lane(), stop.clone(), step, Unroll::Auto, |b, j| f(b, j));
        };
    let lane_max = k.var("lane_max", lit(ty, f64::NEG_INFINITY));
    keys(k, "j0", &end, &|b, j| {
        let v = b.let_("v", s.at(base.clone() + j) * scale.clone());
        b.assign(&lane_max, maximum(lane_max.clone(), v));
    });
    let m = k.block_reduce("row_max", Combine::Max, lane_max);
    let lane_sum = k.var("lane_sum", lit(ty, 0.0));
    keys(k, "j1", &end, &|b, j| {
        let at = b.let_("at", base.clone() + j);
        let e = b.let_("e", (s.at(at.clone()) * scale.clone() - m.clone()).exp());
        b.store(&s, at, e.clone());
        b.assign(&lane_sum, lane_sum.clone() + e);
    });
    let total = k.block_reduce("row_sum", Combine::Sum, lane_sum);
    let inv = k.let_("inv", lit(ty, 1.0) / total);
    keys(k, "j2", &len, &|b, j| {
        let at = b.let_("at", base.clone() + j.clone());
        let p = select(j.lt(end.clone()), s.at(at.clone()) * inv.clone(), lit(ty, 0.0));
        b.store(&s, at, p);
    });
    if let Some(dp) = dp {
        let lane_dot = k.var("lane_dot", lit(ty, 0.0));
        keys(k, "j3", &end, &|b, j| {
            let at = b.let_("at", base.clone() + j);
            b.assign(&lane_dot, lane_dot.clone() + s.at(at.clone()) * dp.at(at));
        });
        let centre = k.block_reduce("centre", Combine::Sum, lane_dot);
        keys(k, "j4", &len, &|b, j| {
            let at = b.let_("at", base.clone() + j);
            // Masked entries have p = 0, so their dS is 0 as well.
            let ds = s.at(at.clone()) * (dp.at(at.clone()) - centre.clone()) * scale.clone();
            b.store(&dp, at, ds);
        });
    }
    kb.finish()
}

/// Writes node `out` ([B, T, heads, dh]) from the head-major `src`: item =
/// (b, t, head); `heads = Hkv` sums the query heads of each key/value head.
/// Rotated back by the angles of t when `cs` is set.
fn gather_back(
    graph: &Graph,
    out: NodeId,
    d: &Dims,
    name: &str,
    temps: &Temps,
    src_arg: Arg,
    cs: Option<Arg>,
) -> Result<Work, EmitError> {
    let heads = graph.node(out).shape.dims()[2];
    let mut kb = Kb::new(graph, name, d.b * d.t * heads);
    let src = kb.temp("src", src_arg, temps, Access::Read);
    let cs = cs.map(|a| kb.temp("cs", a, temps, Access::Read));
    let o = kb.r.buffer(&mut kb.k, out, Access::Write);
    let names = Names::default();
    let ty = d.ty();
    let k = &mut kb.k;
    let bi = k.let_("bi", item() / ix(d.t * heads));
    let t = k.let_("t", (item() / ix(heads)) % ix(d.t));
    let g = k.let_("g", item() % ix(heads));
    let dst = k.let_("dst", item() * ix(d.dh));
    let row = |h: Expr| ((bi.clone() * ix(d.h) + h) * ix(d.t) + t.clone()) * ix(d.dh);
    let store = |b: &mut Block, e: Expr, v: Expr| b.store(&o, dst.clone() + e, v);
    if heads == d.h {
        let from = k.let_("from", row(g));
        copy_row(k, &names, d, cs.as_ref(), &|e| src.at(from.clone() + e), &store, &t, true);
        return kb.finish();
    }
    // Sum the query heads h with g(h) = g (docs/math.md §1.3) into a local row first.
    let acc = k.local_array("acc", ty, d.dh);
    k.for_("e", ix(0), ix(d.dh), |b, e| b.store(&acc, e, lit(ty, 0.0)));
    k.for_("hh", ix(0), ix(d.h), |b, hh| {
        b.if_(((hh.clone() * ix(d.hkv)) / ix(d.h)).eq_(g.clone()), |b| {
            let from = b.let_("from", row(hh));
            b.for_("e", ix(0), ix(d.dh), |b, e| {
                b.store(&acc, e.clone(), acc.at(e.clone()) + src.at(from.clone() + e));
            });
        });
    });
    copy_row(k, &names, d, cs.as_ref(), &|e| acc.at(e), &store, &t, true);
    kb.finish()
}

/// The name of block `q`'s softmax kernel: `…_softmax` for a single block,
/// `…_b{i}_softmax` for block i of several.
fn softmax_name(name: &str, d: &Dims, q: QueryBlock) -> String {
    if d.t <= d.tq {
        format!("{name}_softmax")
    } else {
        format!("{name}_b{}_softmax", q.index)
    }
}

/// Causal attention forward (see the module docs).
pub(super) fn attention(
    graph: &Graph,
    id: NodeId,
    name: &str,
    target: Target,
) -> Result<Lowering, EmitError> {
    let d = Dims::of(graph, id, target)?;
    let mut temps = Temps::default();
    let cs = d.rope.map(|_| temps.add(d.t * d.half() * 2, d.dtype));
    let [qp, kp, vp, op] = [0; 4].map(|_| temps.add(d.mat(), d.dtype));
    let s = temps.add(d.scores(), d.dtype);
    let mut steps = Vec::new();
    if let (Some(base), Some(cs)) = (d.rope, cs) {
        steps.push(rope_table(graph, &d, base, name, cs, &temps)?);
    }
    let first = steps.len();
    steps.push(prepare(graph, id, &d, name, &temps, cs, [qp, kp, vp], None)?);
    for q in d.blocks() {
        steps.push(d.scores_gemm(q, qp, kp, s));
        steps.push(softmax_rows(graph, &d, q, &softmax_name(name, &d, q), &temps, s, None, target)?);
        steps.push(d.rows_gemm(q, s, vp, op, false));
    }
    let chain = d.chain(first..steps.len(), target);
    steps.push(gather_back(graph, id, &d, &format!("{name}_out"), &temps, op, None)?);
    Ok(Lowering { steps, temps: temps.0, chain })
}

/// The gradients of one attention w.r.t. q, k and v (`outs[wrt]`, the
/// `CausalAttentionGrad` nodes sharing q, k, v and dO; at least one present),
/// sharing the recomputed probabilities and the softmax statistics of each
/// query block (see the module docs).
pub fn attention_grads(
    graph: &Graph,
    outs: [Option<NodeId>; 3],
    name: &str,
    target: Target,
) -> Result<Lowering, EmitError> {
    let id = super::first_requested(&outs, "causal_attention_grad", "gradient")?;
    let d = Dims::of(graph, id, target)?;
    let mut temps = Temps::default();
    let cs = d.rope.map(|_| temps.add(d.t * d.half() * 2, d.dtype));
    let [qp, kp, vp, dop] = [0; 4].map(|_| temps.add(d.mat(), d.dtype));
    let (s, dp) = (temps.add(d.scores(), d.dtype), temps.add(d.scores(), d.dtype));
    let mut steps = Vec::new();
    if let (Some(base), Some(cs)) = (d.rope, cs) {
        steps.push(rope_table(graph, &d, base, name, cs, &temps)?);
    }
    let first = steps.len();
    steps.push(prepare(graph, id, &d, name, &temps, cs, [qp, kp, vp], Some(dop))?);
    // dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO; RoPE undone for dQ and dK.
    let plans = [(dp, kp, false, "dq", true), (dp, qp, true, "dk", true), (s, dop, true, "dv", false)];
    let grads: Vec<Option<Arg>> = outs.iter().map(|o| o.map(|_| temps.add(d.mat(), d.dtype))).collect();
    // The last block first: its key prefix is every row of dK and dV, which its
    // products overwrite and the earlier blocks' add to.
    for q in d.blocks().into_iter().rev() {
        steps.push(d.scores_gemm(q, qp, kp, s));
        steps.push(d.scores_gemm(q, dop, vp, dp));
        steps.push(softmax_rows(graph, &d, q, &softmax_name(name, &d, q), &temps, s, Some(dp), target)?);
        for (wrt, grad) in grads.iter().enumerate() {
            let Some(grad) = *grad else { continue };
            let (x, y, trans, _, _) = plans[wrt];
            steps.push(d.rows_gemm(q, x, y, grad, trans));
        }
    }
    // The products first, all of them head-major (the chain), then the copies back.
    let chain = d.chain(first..steps.len(), target);
    for (wrt, (out, grad)) in outs.iter().zip(&grads).enumerate() {
        let (Some(out), Some(grad)) = (*out, *grad) else { continue };
        let (_, _, _, label, rotated) = plans[wrt];
        steps.push(gather_back(
            graph,
            out,
            &d,
            &format!("{name}_{label}"),
            &temps,
            grad,
            if rotated { cs } else { None },
        )?);
    }
    Ok(Lowering { steps, temps: temps.0, chain })
}
