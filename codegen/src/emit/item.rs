//! Per-op emitters of fused kernels: the code computing one item's part of an
//! op's output (see the module docs of [`super`]). Each follows the reference
//! executor's arithmetic (`ir::exec`) so results agree to rounding; long
//! reductions split into interleaved partial sums ([`folds::fold`]).

use ir::graph::{BinaryOp, Node, NodeId, Op, ReduceOp, UnaryOp};

use super::buffers::Sink;
use super::folds::{self, maximum, pairwise, shift_maximum};
use super::views::{self, view_of, Val};
use super::{ix, lit, strides, EmitError, Names, Target};
use crate::kernel::{i64, item, select, Block, Expr, Ty};

/// One op of a fused kernel: its operands as the kernel reads them, and where
/// its item's `per` elements go.
pub(super) struct ItemOp<'a> {
    pub names: &'a Names,
    pub id: NodeId,
    pub node: &'a Node,
    pub in_dims: &'a [&'a [usize]],
    pub ins: &'a [Val],
    pub sink: &'a Sink,
    pub per: usize,
    pub target: Target,
}

impl ItemOp<'_> {
    fn ty(&self) -> Ty {
        Ty::of_storage(self.node.dtype)
    }

    fn lit(&self, v: f64) -> Expr {
        lit(self.ty(), v)
    }

    fn fresh(&self, p: &str) -> String {
        self.names.fresh(p)
    }

    /// `for l in 0..per { g = item·per + l; sink[g] = f(g) }`.
    fn pointwise(&self, b: &mut Block, f: impl FnOnce(&mut Block, Expr) -> Expr) {
        let (per, sink) = (self.per, self.sink);
        let (l, gn) = (self.fresh("l"), self.fresh("g"));
        b.for_(&l, ix(0), ix(per), |b, l| {
            let g = b.let_(&gn, item() * ix(per) + l);
            let v = f(b, g.clone());
            sink.store(b, g, v);
        });
    }

    /// `for r in 0..per/len { f(global row index) }` for ops over rows of `len` output elements.
    fn rows(&self, b: &mut Block, len: usize, f: impl FnOnce(&mut Block, Expr)) {
        let count = self.per / len.max(1);
        let (r, rn) = (self.fresh("r"), self.fresh("row"));
        b.for_(&r, ix(0), ix(count), |b, r| {
            let row = b.let_(&rn, item() * ix(count) + r);
            f(b, row);
        });
    }

    /// [`folds::fold`] in this op's names; for the GPU its serial form
    /// ([`folds::serial_fold`]), which the lane spreading splits across a block.
    fn fold(
        &self,
        b: &mut Block,
        init: Expr,
        n: usize,
        op: impl Fn(Expr, Expr) -> Expr,
        f: impl Fn(&mut Block, Expr) -> Expr,
    ) -> Expr {
        match self.target {
            Target::Cpu => folds::fold(self.names, b, init, n, op, f),
            Target::Cuda => folds::serial_fold(self.names, b, init, n, op, f),
        }
    }

    /// Every output element of this item as the fold of its own row:
    /// `sink[g] = finish(op(init, fold of f(row(g), j) over j))`, where `row`
    /// emits what the row's elements share. On the C target all rows at once
    /// ([`folds::fold_rows`], same bits), else one row per output element.
    #[allow(clippy::too_many_arguments)]
    fn fold_each<R>(
        &self,
        b: &mut Block,
        init: Expr,
        n: usize,
        op: impl Fn(Expr, Expr) -> Expr,
        row: impl Fn(&mut Block, Expr) -> R,
        f: impl Fn(&mut Block, &R, Expr) -> Expr,
        finish: impl Fn(Expr) -> Expr,
    ) {
        let per = self.per;
        if self.target == Target::Cpu {
            let global_row = |b: &mut Block, r: Expr| {
                let g = b.let_(&self.fresh("g"), item() * ix(per) + r);
                row(b, g)
            };
            if let Some(rows) = folds::fold_rows(self.names, b, self.ty(), per, n, &op, global_row, &f) {
                b.for_(&self.fresh("l"), ix(0), ix(per), |b, l| {
                    let v = finish(op(init, rows.at(l.clone())));
                    self.sink.store(b, item() * ix(per) + l, v);
                });
                return;
            }
        }
        self.pointwise(b, |b, g| {
            let at_row = row(b, g);
            let acc = self.fold(b, init, n, &op, |b, j| f(b, &at_row, j));
            finish(acc)
        });
    }
}

fn numel(d: &[usize]) -> usize {
    d.iter().product()
}

/// Emits one op of a fused kernel.
pub(super) fn emit(b: &mut Block, cx: &ItemOp) -> Result<(), EmitError> {
    let o = cx.node.shape.dims();
    let ty = cx.ty();
    match &cx.node.op {
        Op::Constant { value } => cx.pointwise(b, |_, _| lit(ty, *value)),
        op @ (Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }) => {
            if let Some(view) = op.view() {
                let v = view_of(view, cx.in_dims, o, cx.ins.to_vec());
                cx.pointwise(b, |_, g| v.load(g));
            }
        }
        Op::Unary(u) => {
            let x = cx.ins[0].clone();
            let name = cx.fresh("x");
            cx.pointwise(b, |b, g| {
                let v = b.let_(&name, x.load(g));
                unary(*u, v, ty)
            });
        }
        Op::Affine { mul, add } => {
            let x = cx.ins[0].clone();
            let (m, a) = (cx.lit(*mul), cx.lit(*add));
            cx.pointwise(b, |_, g| m * x.load(g) + a);
        }
        Op::Binary(op) => {
            let x = cx.ins[0].clone().broadcast(cx.in_dims[0], o);
            let y = cx.ins[1].clone().broadcast(cx.in_dims[1], o);
            let (an, bn) = (cx.fresh("a"), cx.fresh("b"));
            cx.pointwise(b, |b, g| {
                let l = b.let_(&an, x.load(g.clone()));
                let r = b.let_(&bn, y.load(g));
                match op {
                    BinaryOp::Add => l + r,
                    BinaryOp::Sub => l - r,
                    BinaryOp::Mul => l * r,
                    BinaryOp::Div => l / r,
                    BinaryOp::Max => maximum(l, r),
                }
            });
        }
        Op::Reduce { op, axis, .. } => reduce(b, cx, *op, *axis),
        Op::Softmax => softmax(b, cx),
        Op::RmsNorm { eps } => rms_norm(b, cx, *eps),
        Op::LayerNorm { eps } => group_norm(b, cx, 1, *eps),
        Op::GroupNorm { groups, eps } => group_norm(b, cx, *groups, *eps),
        Op::TopK { k, fixed } => topk(b, cx, *k, *fixed),
        Op::MatMul { trans_a, trans_b } => matmul(b, cx, *trans_a, *trans_b),
        Op::Gather { axis } => gather(b, cx, *axis),
        Op::ScatterAdd { axis } => scatter(b, cx, *axis, true),
        Op::ScatterRows { axis } => scatter(b, cx, *axis, false),
        Op::Sinkhorn { iters, eps } => sinkhorn(b, cx, *iters, *eps),
        Op::SinkhornGrad { iters, eps } => sinkhorn_grad(b, cx, *iters, *eps),
        Op::Cast { to } => cast(b, cx, *to),
        op @ (Op::Input { .. }
        | Op::Param(_)
        | Op::NormProject { .. }
        | Op::SoftmaxCrossEntropy
        | Op::LinearCrossEntropy { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::CausalAttention { .. }
        | Op::TemporalAugment { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMul { .. }
        | Op::GroupedMatMulGrad { .. }) => {
            return Err(EmitError::at(cx.id, op, "has no item emitter (it is lowered on its own grid)"))
        }
    }
    Ok(())
}

/// The scalar function of a unary op (`ir::exec::elementwise::unary_fn`).
fn unary(u: UnaryOp, x: Expr, ty: Ty) -> Expr {
    let one = lit(ty, 1.0);
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => one.clone() / (one + (-x).exp()),
        UnaryOp::Silu => x.clone() * (one.clone() / (one + (-x).exp())),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => x.rsqrt(),
        UnaryOp::Recip => one / x,
        UnaryOp::Square => x.clone() * x,
    }
}

/// Sum, max or mean over one axis: one output element per loop step, the axis
/// folded from the identity (as `ir::exec::reduce`; long axes in partial folds,
/// see [`folds::fold`]).
fn reduce(b: &mut Block, cx: &ItemOp, op: ReduceOp, axis: usize) {
    let x = cx.ins[0].clone();
    let xd = cx.in_dims[0];
    let n = xd[axis];
    let inner = numel(&xd[axis + 1..]);
    let init = match op {
        ReduceOp::Max => cx.lit(f64::NEG_INFINITY),
        ReduceOp::Sum | ReduceOp::Mean => cx.lit(0.0),
    };
    let count = cx.lit(n as f64);
    cx.fold_each(
        b,
        init,
        n,
        |a, v| match op {
            ReduceOp::Max => maximum(a, v),
            ReduceOp::Sum | ReduceOp::Mean => a + v,
        },
        |b, g| (b.let_(&cx.fresh("o"), g.clone() / ix(inner)), b.let_(&cx.fresh("w"), g % ix(inner))),
        |b, (o, w), j| b.let_(&cx.fresh("v"), x.load((o.clone() * ix(n) + j) * ix(inner) + w.clone())),
        |acc| match op {
            ReduceOp::Mean => acc / count.clone(),
            ReduceOp::Sum | ReduceOp::Max => acc,
        },
    );
}

/// Softmax over the last axis: max, sum of exp(x - max), then exp(x - max) / sum
/// recomputed (`ir::exec::reduce::softmax_row`).
fn softmax(b: &mut Block, cx: &ItemOp) {
    let x = cx.ins[0].clone();
    let len = cx.node.shape.last();
    cx.rows(b, len, |b, row| {
        let base = b.let_(&cx.fresh("base"), row * ix(len));
        let at = |j: Expr| x.load(base.clone() + j);
        let m =
            cx.fold(b, cx.lit(f64::NEG_INFINITY), len, shift_maximum, |b, j| b.let_(&cx.fresh("v"), at(j)));
        let s = cx.fold(b, cx.lit(0.0), len, |a, v| a + v, |_, j| (at(j) - m.clone()).exp());
        let inv = b.let_(&cx.fresh("inv"), cx.lit(1.0) / s);
        let j = cx.fresh("j");
        b.for_(&j, ix(0), ix(len), |b, j| {
            cx.sink.store(b, base.clone() + j.clone(), (at(j) - m.clone()).exp() * inv.clone());
        });
    });
}

/// x · (mean x² + ε)^-1/2 ⊙ g per row (docs/math.md §1.3, `ir::exec::norms::rms_norm`).
fn rms_norm(b: &mut Block, cx: &ItemOp, eps: f64) {
    let x = cx.ins[0].clone();
    let gain = cx.ins.get(1).cloned();
    let len = cx.node.shape.last();
    cx.rows(b, len, |b, row| {
        let base = b.let_(&cx.fresh("base"), row * ix(len));
        let ss = cx.fold(
            b,
            cx.lit(0.0),
            len,
            |a, v| a + v,
            |b, j| {
                let v = b.let_(&cx.fresh("v"), x.load(base.clone() + j));
                v.clone() * v
            },
        );
        let r = b.let_(&cx.fresh("rho"), (ss / cx.lit(len as f64) + cx.lit(eps)).rsqrt());
        let j = cx.fresh("j");
        b.for_(&j, ix(0), ix(len), |b, j| {
            let mut y = x.load(base.clone() + j.clone()) * r.clone();
            if let Some(g) = &gain {
                y = y * g.load(j.clone());
            }
            cx.sink.store(b, base.clone() + j, y);
        });
    });
}

/// (x − mean)·(var + ε)^-1/2 per group of the last axis, then the per-channel
/// affine (docs/math.md §5.2, `ir::exec::norms::group_norm`); LayerNorm is one group.
fn group_norm(b: &mut Block, cx: &ItemOp, groups: usize, eps: f64) {
    let x = cx.ins[0].clone();
    let affine = (cx.ins.len() == 3).then(|| (cx.ins[1].clone(), cx.ins[2].clone()));
    let len = cx.node.shape.last();
    let size = len / groups.max(1);
    cx.rows(b, len, |b, row| {
        let base = b.let_(&cx.fresh("base"), row * ix(len));
        let gi = cx.fresh("grp");
        b.for_(&gi, ix(0), ix(groups), |b, gi| {
            let gb = b.let_(&cx.fresh("gb"), base.clone() + gi.clone() * ix(size));
            let at = |j: Expr| x.load(gb.clone() + j);
            let s = cx.fold(b, cx.lit(0.0), size, |a, v| a + v, |_, j| at(j));
            let mu = b.let_(&cx.fresh("mu"), s / cx.lit(size as f64));
            let sq = cx.fold(
                b,
                cx.lit(0.0),
                size,
                |a, v| a + v,
                |b, j| {
                    let d = b.let_(&cx.fresh("d"), at(j) - mu.clone());
                    d.clone() * d
                },
            );
            let var = b.let_(&cx.fresh("var"), sq / cx.lit(size as f64));
            let r = b.let_(&cx.fresh("rho"), cx.lit(1.0) / (var + cx.lit(eps)).sqrt());
            let j = cx.fresh("j");
            b.for_(&j, ix(0), ix(size), |b, j| {
                let mut y = (at(j.clone()) - mu.clone()) * r.clone();
                if let Some((g, bias)) = &affine {
                    let c = gi.clone() * ix(size) + j.clone();
                    y = y * g.load(c.clone()) + bias.load(c);
                }
                cx.sink.store(b, gb.clone() + j, y);
            });
        });
    });
}

/// Top-k routing (docs/math.md §6.2 for xHC's streams, §1.6 for MoE experts,
/// `ir::exec::connection::topk`): the fixed slots, then each remaining index whose
/// rank (higher score first, NaN last, lower index first) is below k − fixed, in
/// ascending index order.
///
/// The order is total, so the kept set is every index at or before the
/// (k − fixed)-th in it. That threshold is found by k − fixed passes over the
/// scores, each taking the first index after the previous pass's in the order, and
/// one more pass writes the kept indices: O(n·k) comparisons a row, where ranking
/// every index against every other is O(n²) (a MoE router picks 2 of 64 experts). The
/// C target's form; the GPU keeps [`topk_by_rank`].
///
/// Index safety: every id written lies in `0..n` by construction (the fixed
/// ones are `0..fixed`, the rest loop variables over `fixed..n`); the order is
/// total, so exactly k − fixed of them are written after the fixed slots (graph
/// inference requires fixed ≤ k ≤ n): the `Gather`/`ScatterRows` that read these
/// ids stay in bounds. Every score read is at an index in `fixed..n`: a pass's
/// best starts as "none" with the score at `fixed` as a placeholder, never read
/// as a candidate's.
fn topk(b: &mut Block, cx: &ItemOp, k: usize, fixed: usize) {
    let x = cx.ins[0].clone();
    let n = cx.in_dims[0].last().copied().unwrap_or(1);
    cx.rows(b, k, |b, row| {
        let xb = b.let_(&cx.fresh("xb"), row.clone() * ix(n));
        let ob = b.let_(&cx.fresh("ob"), row * ix(k));
        for f in 0..fixed {
            cx.sink.store(b, ob.clone() + ix(f), crate::kernel::i32(f as i32));
        }
        let row = TopKRow { x: &x, xb, ob, n, k, fixed };
        match cx.target {
            Target::Cpu => topk_by_threshold(b, cx, row),
            Target::Cuda => topk_by_rank(b, cx, row),
        }
    });
}

/// One row of [`topk`]: the scores `x` from `xb`, the ids written from `ob`.
struct TopKRow<'a> {
    x: &'a Val,
    xb: Expr,
    ob: Expr,
    n: usize,
    k: usize,
    fixed: usize,
}

/// [`topk`]'s selection on the C target: the k − fixed passes for the threshold, then
/// the pass that writes the kept ids.
fn topk_by_threshold(b: &mut Block, cx: &ItemOp, row: TopKRow) {
    let TopKRow { x, xb, ob, n, k, fixed } = row;
    if k == fixed {
        return;
    }
    // `before(a, sa, b, sb)`: index a (score sa) comes before index b in the order.
    let before = |a: &Expr, sa: &Expr, bi: &Expr, sb: &Expr| {
        let (na, nb) = (sa.clone().ne_(sa.clone()), sb.clone().ne_(sb.clone()));
        let first = a.clone().lt(bi.clone());
        let numbers = (!na.clone()).and(!nb.clone());
        let higher = sa.clone().gt(sb.clone()).or(sa.clone().eq_(sb.clone()).and(first.clone()));
        (!na.clone()).and(nb.clone()).or(numbers.and(higher)).or(na.and(nb).and(first))
    };
    // The previous pass's index and score; -1 before the first pass.
    let prev = b.var(&cx.fresh("prev"), i64(-1));
    let sprev = b.var(&cx.fresh("sprev"), x.load(xb.clone() + ix(fixed)));
    let p = cx.fresh("p");
    b.for_(&p, ix(0), ix(k - fixed), |b, _| {
        let best = b.var(&cx.fresh("best"), i64(-1));
        let sbest = b.var(&cx.fresh("sbest"), sprev.clone());
        let j = cx.fresh("j");
        b.for_(&j, ix(fixed), ix(n), |b, j| {
            let sj = b.let_(&cx.fresh("sj"), x.load(xb.clone() + j.clone()));
            let after_prev = prev.clone().lt(i64(0)).or(before(&prev, &sprev, &j, &sj));
            let beats_best = best.clone().lt(i64(0)).or(before(&j, &sj, &best, &sbest));
            b.if_(after_prev.and(beats_best), |b| {
                b.assign(&best, j.clone());
                b.assign(&sbest, sj.clone());
            });
        });
        b.assign(&prev, best.clone());
        b.assign(&sprev, sbest.clone());
    });
    let cnt = b.var(&cx.fresh("cnt"), ix(0));
    let i = cx.fresh("i");
    b.for_(&i, ix(fixed), ix(n), |b, i| {
        let si = b.let_(&cx.fresh("si"), x.load(xb.clone() + i.clone()));
        let kept = i.clone().eq_(prev.clone()).or(before(&i, &si, &prev, &sprev));
        b.if_(kept, |b| {
            cx.sink.store(b, ob.clone() + ix(fixed) + cnt.clone(), i.clone().cast(Ty::I32));
            b.assign(&cnt, cnt.clone() + i64(1));
        });
    });
}

/// [`topk`] on the GPU: each remaining index ranked against every other, kept when
/// its rank is below k − fixed, in ascending index order. O(n²) comparisons a row,
/// but no state carried across the passes: the threshold form's kernels spilled
/// registers under NVRTC (xHC's 16 streams), which `codegen/tests/compile_specs.rs`
/// refuses. Index safety as for [`topk`]: the order ranks every score, NaN
/// included, so exactly k − fixed loop indices in `fixed..n` are written.
fn topk_by_rank(b: &mut Block, cx: &ItemOp, row: TopKRow) {
    let TopKRow { x, xb, ob, n, k, fixed } = row;
    let cnt = b.var(&cx.fresh("cnt"), ix(0));
    let i = cx.fresh("i");
    b.for_(&i, ix(fixed), ix(n), |b, i| {
        let si = b.let_(&cx.fresh("si"), x.load(xb.clone() + i.clone()));
        let ni = b.let_(&cx.fresh("ni"), si.clone().ne_(si.clone()));
        let rank = b.var(&cx.fresh("rank"), ix(0));
        let j = cx.fresh("j");
        b.for_(&j, ix(fixed), ix(n), |b, j| {
            let sj = b.let_(&cx.fresh("sj"), x.load(xb.clone() + j.clone()));
            let nj = b.let_(&cx.fresh("nj"), sj.clone().ne_(sj.clone()));
            let first = j.clone().lt(i.clone());
            let numbers = (!nj.clone()).and(!ni.clone());
            let higher = sj.clone().gt(si.clone()).or(sj.eq_(si.clone()).and(first.clone()));
            let before =
                (!nj.clone()).and(ni.clone()).or(numbers.and(higher)).or(nj.and(ni.clone()).and(first));
            b.assign(&rank, rank.clone() + select(before, i64(1), i64(0)));
        });
        b.if_(rank.lt(ix(k - fixed)), |b| {
            cx.sink.store(b, ob.clone() + ix(fixed) + cnt.clone(), i.clone().cast(Ty::I32));
            b.assign(&cnt, cnt.clone() + i64(1));
        });
    });
}

/// Widest output row [`matmul`] accumulates in a per-item array.
const ROW_ACC_LIMIT: usize = 1024;

/// Contraction steps [`matmul`]'s row form adds into the row accumulator at once.
const ROW_K_GROUP: usize = 4;

/// Shortest contraction [`matmul`] computes as dot products: the length from
/// which [`folds::fold`] splits a fold into lanes.
const DOT_MIN_K: usize = 4 * folds::FOLD_LANES;

/// Contraction steps [`matmul`]'s row form adds into its accumulator at once:
/// [`ROW_K_GROUP`], or more on rows of few vectors, up to
/// [`ROW_GROUP_PRODUCTS`] vector products per update, so the chain of
/// accumulator updates through memory stays short (a 16-wide row over K = 64
/// was 16 dependent updates; grouped by 16 it is 4). 1 when K has no such factor.
fn row_k_group(k: usize, n: usize) -> usize {
    let vectors = n.div_ceil(VECTOR_LANES);
    [16, 8, ROW_K_GROUP]
        .into_iter()
        .find(|&g| k.is_multiple_of(g) && (g == ROW_K_GROUP || g * vectors <= ROW_GROUP_PRODUCTS))
        .unwrap_or(1)
}

/// Most vector products one update of [`matmul`]'s row accumulator sums.
const ROW_GROUP_PRODUCTS: usize = 16;

/// f32 lanes of the widest vectors the C compiler is expected to use (AVX-512),
/// for [`matmul`]'s choice between its row and dot-product forms.
const VECTOR_LANES: usize = 16;

/// Largest `K·N` of op(b) that [`matmul`] stages transposed per batch entry.
const STAGE_LIMIT: usize = 4096;

/// A batched product as loops: each output element is a dot product over K of a
/// row of op(a) and a column of op(b), batch axes broadcast.
fn matmul(b: &mut Block, cx: &ItemOp, trans_a: bool, trans_b: bool) {
    let o = cx.node.shape.dims();
    let (ad, bd) = (cx.in_dims[0], cx.in_dims[1]);
    let (m, n) = (o[o.len() - 2], o[o.len() - 1]);
    let k = if trans_a { ad[ad.len() - 2] } else { ad[ad.len() - 1] };
    let batch = &o[..o.len() - 2];
    let batch_strides = |x: &[usize]| {
        let xb = &x[..x.len() - 2];
        let per = x[x.len() - 2] * x[x.len() - 1];
        let st: Vec<usize> = strides(xb).into_iter().map(|s| s * per).collect();
        let lead = batch.len() - xb.len();
        (0..batch.len())
            .map(|i| if i < lead || xb[i - lead] == 1 { 0 } else { st[i - lead] })
            .collect::<Vec<_>>()
    };
    let (sa, sb) = (batch_strides(ad), batch_strides(bd));
    let (am, ak) = if trans_a { (1, m) } else { (k, 1) };
    let (bk, bn) = if trans_b { (1, k) } else { (n, 1) };
    let (x, y) = (cx.ins[0].clone(), cx.ins[1].clone());
    // Both operands contiguous along K (op(b) = a transposed row-major b, as in
    // mHC's `4 x 4` stream Gram products over C, docs/math.md §4.5, or xHC's
    // one-row projections, §6.4): one lane-split dot product per output
    // element vectorizes over K. The row form vectorizes over N instead, but
    // must first stage op(b) transposed element by element, which only pays
    // when many rows reuse it and N fills vectors; compare the two by their
    // vector operations per batch entry.
    let staged = if trans_b { k * n } else { 0 };
    let row_cost = staged + m * k * n.div_ceil(VECTOR_LANES);
    // A lane-split fold: K / FOLD_LANES vector steps, then about FOLD_LANES
    // operations to combine its lanes.
    let dot_cost = m * n * (k.div_ceil(folds::FOLD_LANES) + folds::FOLD_LANES);
    let dot_form = ak == 1 && bk == 1 && k >= DOT_MIN_K && dot_cost < row_cost;
    if !dot_form && (2..=ROW_ACC_LIMIT).contains(&n) && cx.per.is_multiple_of(n) {
        // The item holds whole output rows: accumulate a row at a time, the
        // contraction outermost and the row's columns innermost, so the column
        // loop is independent across iterations and vectorizable.
        let (group, groups) = (row_k_group(k, n), k / row_k_group(k, n));
        let acc = if groups > 1 { Some(b.local_array(&cx.fresh("racc"), cx.ty(), n)) } else { None };
        let row_body =
            |b: &mut Block, row: Expr, mi: Expr, a_base: Expr, rhs: &Val, b0: Expr, bk: usize, bn: usize| {
                let a0 = b.let_(&cx.fresh("a0"), a_base + mi * ix(am));
                // Contraction steps in groups: the row accumulator (a stack array
                // the compiler keeps in memory) is loaded and stored once per group
                // instead of once per step, which was a store-to-load chain on
                // narrow rows (n = 16 in VWN, docs/math.md §5.3). Rows of one vector
                // take the widest group ([`row_k_group`]). The first group
                // initializes the accumulator and the last one stores the row, so
                // a single group (mHC's K = n = 4 stream mixes) is one pass with
                // no accumulator at all (GCC turned the zeroing and the final
                // copy of the accumulator into library memset and memcpy calls).
                let taps = |b: &mut Block, jg: Expr| {
                    let mut taps = Vec::with_capacity(group);
                    for u in 0..group {
                        let j = jg.clone() * ix(group) + ix(u);
                        let av = b.let_(&cx.fresh("av"), x.load(a0.clone() + j.clone() * ix(ak)));
                        let bj = b.let_(&cx.fresh("bj"), b0.clone() + j * ix(bk));
                        taps.push((av, bj));
                    }
                    taps
                };
                let sum = |taps: &[(Expr, Expr)], ni: &Expr| {
                    let terms: Vec<Expr> = taps
                        .iter()
                        .map(|(av, bj)| av.clone() * rhs.load(bj.clone() + ni.clone() * ix(bn)))
                        .collect();
                    pairwise(terms, |x, y| x + y)
                };
                if let Some(acc) = &acc {
                    let first = taps(b, ix(0));
                    b.for_(&cx.fresh("c"), ix(0), ix(n), |b, ni| {
                        let v = sum(&first, &ni);
                        b.store(acc, ni, v);
                    });
                    if groups > 2 {
                        b.for_(&cx.fresh("j"), ix(1), ix(groups - 1), |b, jg| {
                            let middle = taps(b, jg);
                            b.for_(&cx.fresh("c"), ix(0), ix(n), |b, ni| {
                                let v = sum(&middle, &ni);
                                b.accum(acc, ni, v);
                            });
                        });
                    }
                }
                let last = taps(b, ix(groups - 1));
                b.for_(&cx.fresh("c"), ix(0), ix(n), |b, ni| {
                    let v = sum(&last, &ni);
                    let v = match &acc {
                        Some(acc) => acc.at(ni.clone()) + v,
                        None => v,
                    };
                    cx.sink.store(b, row * ix(n) + ni, v);
                });
            };
        let entries = cx.per / (m * n);
        if trans_b && cx.per.is_multiple_of(m * n) && k * n <= STAGE_LIMIT {
            // The item holds whole batch entries: stage each entry's op(b)
            // transposed (`[K, N]`, row-major) so the column loop reads it
            // contiguously. The copy runs along the stage's rows, columns
            // innermost: the compiler then writes each row as one vector
            // (VWN's 16 x 64 segment products, docs/math.md §5.3); innermost along
            // K it stored element by element, a sixth of the kernel's time.
            let stage = Val::Buffer(b.local_array(&cx.fresh("bt"), cx.ty(), k * n));
            let Val::Buffer(bt) = &stage else { unreachable!("constructed as a buffer") };
            b.for_(&cx.fresh("e"), ix(0), ix(entries), |b, e| {
                let bi = b.let_(&cx.fresh("bi"), item() * ix(entries) + e);
                let sb0 = b.let_(&cx.fresh("sb"), views::strided_index(&bi, batch, &sb, 0));
                b.for_(&cx.fresh("j"), ix(0), ix(k), |b, j| {
                    b.for_(&cx.fresh("c"), ix(0), ix(n), |b, ni| {
                        let v = y.load(sb0 + ni.clone() * ix(k) + j.clone());
                        b.store(bt, j * ix(n) + ni, v);
                    });
                });
                let a_base = b.let_(&cx.fresh("sa"), views::strided_index(&bi, batch, &sa, 0));
                b.for_(&cx.fresh("mi"), ix(0), ix(m), |b, mi| {
                    let row = b.let_(&cx.fresh("row"), bi * ix(m) + mi.clone());
                    row_body(b, row, mi, a_base, &stage, ix(0), n, 1);
                });
            });
            return;
        }
        cx.rows(b, n, |b, row| {
            let bi = b.let_(&cx.fresh("bi"), row.clone() / ix(m));
            let mi = b.let_(&cx.fresh("mi"), row.clone() % ix(m));
            let a_base = views::strided_index(&bi, batch, &sa, 0);
            let b0 = b.let_(&cx.fresh("b0"), views::strided_index(&bi, batch, &sb, 0));
            row_body(b, row, mi, a_base, &y, b0, bk, bn);
        });
        return;
    }
    cx.fold_each(
        b,
        cx.lit(0.0),
        k,
        |a, v| a + v,
        |b, g| {
            let bi = b.let_(&cx.fresh("bi"), g.clone() / ix(m * n));
            let mi = b.let_(&cx.fresh("mi"), (g.clone() / ix(n)) % ix(m));
            let ni = b.let_(&cx.fresh("ni"), g % ix(n));
            let a0 = b.let_(&cx.fresh("a0"), views::strided_index(&bi, batch, &sa, 0) + mi * ix(am));
            let b0 = b.let_(&cx.fresh("b0"), views::strided_index(&bi, batch, &sb, 0) + ni * ix(bn));
            (a0, b0)
        },
        |_, (a0, b0), j| x.load(a0.clone() + j.clone() * ix(ak)) * y.load(b0.clone() + j * ix(bk)),
        |acc| acc,
    );
}

/// out[p, j, r] = x[p, idx[p, j], r] (`ir::exec::movement::gather`).
///
/// Index safety: the kernel does not bound `idx`. Its ids are either token ids
/// (the embedding lookup), which `runtime::step::check_tokens` holds to
/// `0..vocab` before any batch is uploaded, or [`topk`]'s, in range by
/// construction.
fn gather(b: &mut Block, cx: &ItemOp, axis: usize) {
    let xd = cx.in_dims[0];
    let p: usize = numel(&xd[..axis]);
    let s = xd[axis];
    let r = numel(&xd[axis + 1..]);
    let j = numel(cx.in_dims[1]) / p.max(1);
    let (x, idx) = (cx.ins[0].clone(), cx.ins[1].clone());
    cx.pointwise(b, |b, g| {
        let pj = b.let_(&cx.fresh("pj"), g.clone() / ix(r));
        let pi = b.let_(&cx.fresh("pi"), pj.clone() / ix(j.max(1)));
        let row = b.let_(&cx.fresh("srow"), idx.load(pj).cast(Ty::I64));
        x.load((pi * ix(s) + row) * ix(r) + g % ix(r))
    });
}

/// base with src rows added at (or written over) the indexed rows
/// (`ir::exec::movement::scatter_add` / `scatter_rows`); the item holds whole
/// `[S, R..]` blocks, so every indexed row is its own.
///
/// Index safety: a scatter-add writes at `idx` unchecked; its ids are token
/// ids (the embedding's gradient, and the cross-entropy gradient's one-hot
/// targets over the vocabulary axis), checked by `runtime::step::check_tokens`
/// before upload, or [`topk`]'s. `ScatterRows` compares each id with the row it
/// writes, so only its reads follow an id, and those come from [`topk`].
fn scatter(b: &mut Block, cx: &ItemOp, axis: usize, add: bool) {
    let o = cx.node.shape.dims();
    let p: usize = numel(&o[..axis]);
    let s = o[axis];
    let r = numel(&o[axis + 1..]);
    let j = numel(cx.in_dims[1]) / p.max(1);
    let q = cx.per / (s * r).max(1);
    let (base, idx, src) = (cx.ins[0].clone(), cx.ins[1].clone(), cx.ins[2].clone());
    if !add {
        // Each output row written once, from the source row whose index names
        // it or else from the base (the indices are distinct): xHC's write-back
        // (docs/math.md §6.6) copied all N base rows, then wrote the k active rows
        // over them again.
        let qn = cx.fresh("q");
        b.for_(&qn, ix(0), ix(q), |b, qq| {
            let pi = b.let_(&cx.fresh("pi"), item() * ix(q) + qq);
            b.for_(&cx.fresh("s"), ix(0), ix(s), |b, row| {
                let sel = b.var(&cx.fresh("sel"), i64(-1));
                b.for_(&cx.fresh("j"), ix(0), ix(j), |b, jj| {
                    let named = idx.load(pi.clone() * ix(j) + jj.clone()).cast(Ty::I64).eq_(row.clone());
                    b.assign(&sel, select(named, jj, sel.clone()));
                });
                let dst = b.let_(&cx.fresh("dst"), (pi.clone() * ix(s) + row) * ix(r));
                let from = b.let_(&cx.fresh("from"), (pi.clone() * ix(j) + sel.clone()) * ix(r));
                let (dst2, en) = (dst.clone(), cx.fresh("e"));
                b.if_else(
                    sel.clone().ge(i64(0)),
                    |b| {
                        b.for_(&en, ix(0), ix(r), |b, e| {
                            cx.sink.store(b, dst + e.clone(), src.load(from + e))
                        })
                    },
                    |b| {
                        b.for_(&en, ix(0), ix(r), |b, e| {
                            cx.sink.store(b, dst2.clone() + e.clone(), base.load(dst2 + e))
                        })
                    },
                );
            });
        });
        return;
    }
    cx.pointwise(b, |_, g| base.load(g));
    let qn = cx.fresh("q");
    b.for_(&qn, ix(0), ix(q), |b, qq| {
        let pi = b.let_(&cx.fresh("pi"), item() * ix(q) + qq);
        let jn = cx.fresh("j");
        b.for_(&jn, ix(0), ix(j), |b, jj| {
            let pj = b.let_(&cx.fresh("pj"), pi.clone() * ix(j) + jj);
            let row = b.let_(&cx.fresh("srow"), idx.load(pj.clone()).cast(Ty::I64));
            let en = cx.fresh("e");
            b.for_(&en, ix(0), ix(r), |b, e| {
                let dst = (pi.clone() * ix(s) + row.clone()) * ix(r) + e.clone();
                let v = src.load(pj.clone() * ix(r) + e);
                if add {
                    cx.sink.accum(b, dst, v);
                } else {
                    cx.sink.store(b, dst, v);
                }
            });
        });
    });
}

/// One Sinkhorn half-step on the n×n matrix at `mb` of `m`: every column
/// (`by_column`) or every row divided by its sum plus `eps` (docs/math.md §4.2). The
/// direction is a compile-time choice, so the indices are static, and each line
/// multiplies by one reciprocal instead of dividing n times: n× fewer divisions,
/// the slowest scalar op of the per-token Sinkhorn loops, for ≤ 1 ulp more
/// rounding per element than the reference executor's division.
fn normalize(
    b: &mut Block,
    cx: &ItemOp,
    m: &crate::kernel::Buf,
    mb: Expr,
    n: usize,
    eps: f64,
    by_column: bool,
) {
    let an = cx.fresh("a");
    b.for_(&an, ix(0), ix(n), |b, a| {
        let at = |e: Expr| mb.clone() + line_index(by_column, n, &a, e);
        let s = cx.fold(b, cx.lit(eps), n, |x, v| x + v, |_, e| m.at(at(e)));
        let inv = b.let_(&cx.fresh("inv"), cx.lit(1.0) / s);
        let en = cx.fresh("e");
        b.for_(&en, ix(0), ix(n), |b, e| {
            b.store(m, at(e.clone()), m.at(at(e)) * inv.clone());
        });
    });
}

/// Flat index of element `e` of column `a` (`by_column`) or row `a` of an n×n matrix.
fn line_index(by_column: bool, n: usize, a: &Expr, e: Expr) -> Expr {
    if by_column {
        e * ix(n) + a.clone()
    } else {
        a.clone() * ix(n) + e
    }
}

/// exp(x − colmax) of one n×n matrix into the local `m` (at offset 0); with
/// `first_max`, the column max is the first strict maximum (the gradient's
/// convention) and its row is recorded in `argmax`.
fn exp_shifted(
    b: &mut Block,
    cx: &ItemOp,
    x: &Val,
    xb: &Expr,
    m: &crate::kernel::Buf,
    n: usize,
    argmax: Option<&crate::kernel::Buf>,
) {
    let jn = cx.fresh("c");
    b.for_(&jn, ix(0), ix(n), |b, j| {
        let at = |i: Expr| x.load(xb.clone() + i * ix(n) + j.clone());
        let cm = match argmax {
            None => cx.fold(b, cx.lit(f64::NEG_INFINITY), n, maximum, |b, i| b.let_(&cx.fresh("v"), at(i))),
            Some(am) => {
                let best = b.var(&cx.fresh("best"), ix(0));
                let i = cx.fresh("i");
                b.for_(&i, ix(1), ix(n), |b, i| {
                    b.if_(at(i.clone()).gt(at(best.clone())), |b| b.assign(&best, i));
                });
                b.store(am, j.clone(), best.clone());
                b.let_(&cx.fresh("cm"), at(best))
            }
        };
        let i = cx.fresh("i");
        b.for_(&i, ix(0), ix(n), |b, i| {
            b.store(m, i.clone() * ix(n) + j.clone(), (at(i) - cm.clone()).exp());
        });
    });
}

/// Sinkhorn-Knopp per n×n matrix (docs/math.md §4.2, `ir::exec::connection::sinkhorn`).
fn sinkhorn(b: &mut Block, cx: &ItemOp, iters: usize, eps: f64) {
    let n = cx.node.shape.last();
    let nn = n * n;
    let x = cx.ins[0].clone();
    let m = b.local_array(&cx.fresh("sk"), cx.ty(), nn.max(1));
    cx.rows(b, nn, |b, mat| {
        let mb = b.let_(&cx.fresh("mb"), mat * ix(nn));
        exp_shifted(b, cx, &x, &mb, &m, n, None);
        let it = cx.fresh("it");
        b.for_(&it, ix(0), ix(iters), |b, _| {
            normalize(b, cx, &m, ix(0), n, eps, true);
            normalize(b, cx, &m, ix(0), n, eps, false);
        });
        let e = cx.fresh("e");
        b.for_(&e, ix(0), ix(nn), |b, e| cx.sink.store(b, mb.clone() + e.clone(), m.at(e)));
    });
}

/// The VJP of Sinkhorn per matrix, unrolled through the recomputed iteration
/// (docs/math.md §4.5, `ir::exec::backward_ops::sinkhorn_grad`).
fn sinkhorn_grad(b: &mut Block, cx: &ItemOp, iters: usize, eps: f64) {
    let n = cx.node.shape.last();
    let nn = n * n;
    let steps = 2 * iters;
    let (x, dout) = (cx.ins[0].clone(), cx.ins[1].clone());
    let states = b.local_array(&cx.fresh("st"), cx.ty(), (nn * (steps + 1)).max(1));
    let g = b.local_array(&cx.fresh("gr"), cx.ty(), nn.max(1));
    let am = b.local_array(&cx.fresh("am"), Ty::I64, n.max(1));
    cx.rows(b, nn, |b, mat| {
        let mb = b.let_(&cx.fresh("mb"), mat * ix(nn));
        exp_shifted(b, cx, &x, &mb, &states, n, Some(&am));
        // Half-steps alternate columns (even steps) and rows (odd steps); the
        // loops run over whole iterations so each direction is static.
        let itn = cx.fresh("it");
        b.for_(&itn, ix(0), ix(iters), |b, it| {
            for (half, by_column) in [(0, true), (1, false)] {
                let s = b.let_(&cx.fresh("s"), it.clone() * i64(2) + i64(half));
                let e = cx.fresh("e");
                b.for_(&e, ix(0), ix(nn), |b, e| {
                    b.store(
                        &states,
                        (s.clone() + i64(1)) * ix(nn) + e.clone(),
                        states.at(s.clone() * ix(nn) + e),
                    );
                });
                normalize(b, cx, &states, (s + i64(1)) * ix(nn), n, eps, by_column);
            }
        });
        let e = cx.fresh("e");
        b.for_(&e, ix(0), ix(nn), |b, e| b.store(&g, e.clone(), dout.load(mb.clone() + e)));
        let itn = cx.fresh("it");
        b.for_(&itn, ix(0), ix(iters), |b, it| {
            // Reverse order: the row half-step (odd) of each iteration, then its column half-step.
            for (half, by_column) in [(1, false), (0, true)] {
                let step = b.let_(&cx.fresh("step"), (ix(iters - 1) - it.clone()) * i64(2) + i64(half));
                let inb = b.let_(&cx.fresh("inb"), step.clone() * ix(nn));
                let outb = b.let_(&cx.fresh("outb"), (step + i64(1)) * ix(nn));
                let an = cx.fresh("a");
                b.for_(&an, ix(0), ix(n), |b, a| {
                    let at = |e: Expr| line_index(by_column, n, &a, e);
                    let sum = cx.fold(b, cx.lit(eps), n, |p, v| p + v, |_, e| states.at(inb.clone() + at(e)));
                    let inv = b.let_(&cx.fresh("inv"), cx.lit(1.0) / sum);
                    let centre = cx.fold(
                        b,
                        cx.lit(0.0),
                        n,
                        |p, v| p + v,
                        |_, e| g.at(at(e.clone())) * states.at(outb.clone() + at(e)),
                    );
                    let en = cx.fresh("e");
                    b.for_(&en, ix(0), ix(n), |b, e| {
                        b.store(&g, at(e.clone()), (g.at(at(e)) - centre.clone()) * inv.clone());
                    });
                });
            }
        });
        let jn = cx.fresh("c");
        b.for_(&jn, ix(0), ix(n), |b, j| {
            let shift = cx.fold(
                b,
                cx.lit(0.0),
                n,
                |p, v| p + v,
                |b, i| {
                    let at = i * ix(n) + j.clone();
                    let v = b.let_(&cx.fresh("v"), g.at(at.clone()) * states.at(at.clone()));
                    b.store(&g, at, v.clone());
                    v
                },
            );
            let top = am.at(j.clone()) * ix(n) + j;
            b.store(&g, top.clone(), g.at(top) - shift);
        });
        let e = cx.fresh("e");
        b.for_(&e, ix(0), ix(nn), |b, e| cx.sink.store(b, mb.clone() + e.clone(), g.at(e)));
    });
}

/// `Cast` (docs/math.md §6.12): a cast to bf16 rounds in registers, since its value may stay in
/// a local array of the kernel rather than pass through a bf16 store; a cast to f32 or f64
/// converts the loaded value (widening a bf16 value is exact).
fn cast(b: &mut Block, cx: &ItemOp, to: ir::DType) {
    let x = cx.ins[0].clone();
    let ty = cx.ty();
    cx.pointwise(b, |_, g| {
        let v = x.load(g);
        let v = if v.ty() == ty { v } else { v.cast(ty) };
        if to == ir::DType::Bf16 {
            v.round_bf16()
        } else {
            v
        }
    });
}
