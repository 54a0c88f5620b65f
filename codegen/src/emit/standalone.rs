//! Ops lowered on grids of their own (DESIGN.md §5 "heavy ops are kernels of
//! their own"): causal attention and its gradient, the cross-entropy loss and
//! xHC's temporal augmentation and its gradient. Operands are read through
//! [`Reader`], so views fold into their index math like everywhere else.

use ir::graph::{Graph, NodeId, Op};

use super::{grid, ix, lit, maximum, EmitError, Launch, Lowering, Names, Reader, Val};
use crate::kernel::{
    f64, i64, item, lane, select, Access, Block, Buf, Expr, Grid, KernelBuilder, ReduceOp, Ty,
};

/// ε_abs of the Gram–Schmidt guard (MATH.md §6.5 DECISION; `ir::exec` uses the same).
const GS_EPS_ABS: f64 = 1e-20;

/// Lanes of the block-per-item loss kernel.
const LOSS_THREADS: u32 = 256;

/// Lowers one standalone op (see [`super::is_standalone`]) into its launches.
pub fn lower_standalone(graph: &Graph, id: NodeId, name: &str) -> Result<Lowering, EmitError> {
    let node = graph.node(id);
    match &node.op {
        Op::CausalAttention { scale, rope_base } => {
            Ok(single(attention(graph, id, name, *scale, *rope_base)?))
        }
        Op::CausalAttentionGrad { scale, rope_base, wrt } => {
            attention_grad(graph, id, name, *scale, *rope_base, *wrt)
        }
        Op::SoftmaxCrossEntropy => Ok(single(cross_entropy(graph, id, name)?)),
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            Ok(single(temporal(graph, id, name, *gram_schmidt, *eps_rel, None)?))
        }
        Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt } => {
            Ok(single(temporal(graph, id, name, *gram_schmidt, *eps_rel, Some(*wrt))?))
        }
        op => Err(EmitError::at(id, op, "is not lowered on a grid of its own")),
    }
}

fn single(launch: Launch) -> Lowering {
    Lowering { launches: vec![launch], temps: Vec::new() }
}

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

/// Half-split RoPE (MATH.md §1.3) with the angles θ_i = base^(-2i/dh) in a
/// per-item f64 table; angles and their sines are computed in f64 and rounded
/// once, as the reference does.
struct Rope {
    theta: Buf,
    half: usize,
    ty: Ty,
}

impl Rope {
    fn new(b: &mut Block, names: &Names, base: f64, dh: usize, ty: Ty) -> Rope {
        let half = dh / 2;
        let theta = b.local_array(&names.fresh("theta"), Ty::F64, half.max(1));
        b.for_(&names.fresh("i"), ix(0), ix(half), |b, i| {
            let e = (f64(-2.0) * i.clone().cast(Ty::F64)) / f64(dh as f64);
            b.store(&theta, i, f64(base).pow(e));
        });
        Rope { theta, half, ty }
    }

    /// Element `i` of a row rotated to position `pos` (`sign` = -1: the inverse
    /// rotation, which is also its VJP); `raw(j)` loads element j of the row.
    fn rotated(&self, raw: impl Fn(Expr) -> Expr, pos: &Expr, i: &Expr, sign: f64) -> Expr {
        let lo = i.clone().lt(ix(self.half));
        let j = select(lo.clone(), i.clone(), i.clone() - ix(self.half));
        let phi = pos.clone().cast(Ty::F64) * self.theta.at(j.clone());
        let c = phi.clone().cos().cast(self.ty);
        let s = (f64(sign) * phi.sin()).cast(self.ty);
        let (x0, x1) = (raw(j.clone()), raw(j + ix(self.half)));
        select(lo, x0.clone() * c.clone() - x1.clone() * s.clone(), x0 * s + x1 * c)
    }
}

/// Sizes of an attention node: q [B, T, H, dh], k and v [B, T, Hkv, dh].
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    h: usize,
    hkv: usize,
    dh: usize,
}

/// Loads of q, k, v (and dout) with their row offsets.
struct Attn<'a> {
    names: &'a Names,
    d: Dims,
    ty: Ty,
    scale: f64,
    rope: Option<Rope>,
    q: Val,
    k: Val,
    v: Val,
}

impl Attn<'_> {
    fn lit(&self, v: f64) -> Expr {
        lit(self.ty, v)
    }

    /// Row offset of key/value head `g` at (b, t).
    fn kv_row(&self, b: &Expr, t: &Expr, g: &Expr) -> Expr {
        ((b.clone() * ix(self.d.t) + t.clone()) * ix(self.d.hkv) + g.clone()) * ix(self.d.dh)
    }

    fn q_row(&self, b: &Expr, t: &Expr, h: &Expr) -> Expr {
        ((b.clone() * ix(self.d.t) + t.clone()) * ix(self.d.h) + h.clone()) * ix(self.d.dh)
    }

    /// Fills the local `dst` with the row of `src` at `row`, rotated to `pos` when RoPE is on.
    fn load_rotated(&self, b: &mut Block, dst: &Buf, src: &Val, row: &Expr, pos: &Expr) {
        b.for_(&self.names.fresh("i"), ix(0), ix(self.d.dh), |b, i| {
            let v = match &self.rope {
                Some(rope) => rope.rotated(|j| src.load(row.clone() + j), pos, &i, 1.0),
                None => src.load(row.clone() + i.clone()),
            };
            b.store(dst, i, v);
        });
    }

    /// scale · ⟨qr, rotated k row at key position tp⟩, summed in element order.
    fn score(&self, b: &mut Block, qr: &Buf, krow: &Expr, tp: &Expr) -> Expr {
        let dot = sum(self.names, b, self.lit(0.0), ix(0), ix(self.d.dh), |_, i| {
            let kv = match &self.rope {
                Some(rope) => rope.rotated(|j| self.k.load(krow.clone() + j), tp, &i, 1.0),
                None => self.k.load(krow.clone() + i.clone()),
            };
            qr.at(i) * kv
        });
        b.let_(&self.names.fresh("s"), dot * self.lit(self.scale))
    }

    /// Stores the local row `src` to `out` at `row`, rotated back from `pos` when RoPE is on.
    fn store_unrotated(&self, b: &mut Block, out: &Buf, row: &Expr, src: &Buf, pos: &Expr) {
        b.for_(&self.names.fresh("i"), ix(0), ix(self.d.dh), |b, i| {
            let v = match &self.rope {
                Some(rope) => rope.rotated(|j| src.at(j), pos, &i, -1.0),
                None => src.at(i.clone()),
            };
            b.store(out, row.clone() + i, v);
        });
    }
}

fn attn_setup<'a>(
    graph: &Graph,
    id: NodeId,
    k: &mut KernelBuilder,
    r: &mut Reader,
    names: &'a Names,
    scale: f64,
    rope_base: Option<f64>,
) -> Attn<'a> {
    let inputs = graph.inputs(id);
    let (qd, kd) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
    let d = Dims { t: qd[1], h: qd[2], hkv: kd[2], dh: qd[3] };
    let ty = Ty::of_storage(graph.node(id).dtype);
    let (q, kk, v) = (r.read(k, inputs[0]), r.read(k, inputs[1]), r.read(k, inputs[2]));
    let rope = rope_base.map(|base| Rope::new(k, names, base, d.dh, ty));
    Attn { names, d, ty, scale, rope, q, k: kk, v }
}

/// Causal attention forward (MATH.md §1.3): one item per (b, t, h) query row,
/// one pass over the keys t' ≤ t with an online softmax.
fn attention(
    graph: &Graph,
    id: NodeId,
    name: &str,
    scale: f64,
    rope_base: Option<f64>,
) -> Result<Launch, EmitError> {
    let node = graph.node(id);
    let dims = node.shape.dims();
    let mut k = KernelBuilder::new(name, grid(dims[0] * dims[1] * dims[2]));
    let mut r = Reader::new(graph);
    let names = Names::default();
    let a = attn_setup(graph, id, &mut k, &mut r, &names, scale, rope_base);
    let out = r.buffer(&mut k, id, Access::Write);
    let d = a.d;
    let bi = k.let_("bi", item() / ix(d.t * d.h));
    let t = k.let_("t", (item() / ix(d.h)) % ix(d.t));
    let h = k.let_("h", item() % ix(d.h));
    let g = k.let_("g", (h.clone() * ix(d.hkv)) / ix(d.h));
    let qrow = k.let_("qrow", item() * ix(d.dh));
    let qr = k.local_array("qr", a.ty, d.dh);
    a.load_rotated(&mut k, &qr, &a.q, &qrow, &t);
    let acc = k.local_array("acc", a.ty, d.dh);
    k.for_("i", ix(0), ix(d.dh), |b, i| b.store(&acc, i, a.lit(0.0)));
    let m = k.var("m", a.lit(f64::NEG_INFINITY));
    let l = k.var("l", a.lit(0.0));
    k.for_("tp", ix(0), t.clone() + i64(1), |b, tp| {
        let krow = b.let_("krow", a.kv_row(&bi, &tp, &g));
        let s = a.score(b, &qr, &krow, &tp);
        let mnew = b.let_("mnew", maximum(m.clone(), s.clone()));
        let corr = b.let_("corr", (m.clone() - mnew.clone()).exp());
        let p = b.let_("p", (s - mnew.clone()).exp());
        b.assign(&l, l.clone() * corr.clone() + p.clone());
        b.for_("e", ix(0), ix(d.dh), |b, e| {
            let v = acc.at(e.clone()) * corr.clone() + p.clone() * a.v.load(krow.clone() + e.clone());
            b.store(&acc, e, v);
        });
        b.assign(&m, mnew);
    });
    k.for_("e", ix(0), ix(d.dh), |b, e| b.store(&out, qrow.clone() + e.clone(), acc.at(e) / l.clone()));
    finish(k, r)
}

/// The softmax statistics of one query row: (max score, 1 / Σ exp, Σ_t' p·dp) with
/// dp = ⟨dout row, v row⟩ (MATH.md §1.4), summed in key order as the reference does.
/// `at` = (batch, query position, kv head, query row offset).
fn row_stats(b: &mut Block, a: &Attn, dout: &Val, qr: &Buf, at: [&Expr; 4]) -> [Expr; 3] {
    let [bi, t, g, qrow] = at;
    let names = a.names;
    let end = t.clone() + i64(1);
    let m = b.var(&names.fresh("m"), a.lit(f64::NEG_INFINITY));
    b.for_(&names.fresh("tp"), ix(0), end.clone(), |b, tp| {
        let krow = a.kv_row(bi, &tp, g);
        let s = a.score(b, qr, &krow, &tp);
        b.assign(&m, maximum(m.clone(), s));
    });
    let total = sum(names, b, a.lit(0.0), ix(0), end.clone(), |b, tp| {
        let krow = a.kv_row(bi, &tp, g);
        let s = a.score(b, qr, &krow, &tp);
        (s - m.clone()).exp()
    });
    let inv = b.let_(&names.fresh("inv"), a.lit(1.0) / total);
    let centre = sum(names, b, a.lit(0.0), ix(0), end, |b, tp| {
        let krow = b.let_(&names.fresh("krow"), a.kv_row(bi, &tp, g));
        let s = a.score(b, qr, &krow, &tp);
        let p = (s - m.clone()).exp() * inv.clone();
        let dp = sum(names, b, a.lit(0.0), ix(0), ix(a.d.dh), |_, e| {
            dout.load(qrow.clone() + e.clone()) * a.v.load(krow.clone() + e)
        });
        p * dp
    });
    [m, inv, centre]
}

/// d q, d k or d v of causal attention (MATH.md §1.4, recomputing probabilities):
/// a statistics kernel per query row (max, 1/Σ, centre) into a temporary, then
/// dq per (b, t, h) or dk / dv per (b, t', hkv) looping over the query heads
/// of the group and the queries t ≥ t'.
fn attention_grad(
    graph: &Graph,
    id: NodeId,
    name: &str,
    scale: f64,
    rope_base: Option<f64>,
    wrt: usize,
) -> Result<Lowering, EmitError> {
    let inputs = graph.inputs(id);
    let qd = graph.node(inputs[0]).shape.dims();
    let kd = graph.node(inputs[1]).shape.dims();
    let rows = qd[0] * qd[1] * qd[2];
    let dtype = graph.node(id).dtype;
    let stats_len = rows * 3;

    // Kernel 1: per query row statistics.
    let stats = {
        let mut k = KernelBuilder::new(&format!("{name}_stats"), grid(rows));
        let mut r = Reader::new(graph);
        let names = Names::default();
        let a = attn_setup(graph, id, &mut k, &mut r, &names, scale, rope_base);
        let dout = r.read(&mut k, inputs[3]);
        let st = k.param("stats", dtype, Access::Write, stats_len);
        r.args.push(super::Arg::Temp(0));
        let d = a.d;
        let bi = k.let_("bi", item() / ix(d.t * d.h));
        let t = k.let_("t", (item() / ix(d.h)) % ix(d.t));
        let h = k.let_("h", item() % ix(d.h));
        let g = k.let_("g", (h * ix(d.hkv)) / ix(d.h));
        let qrow = k.let_("qrow", item() * ix(d.dh));
        let qr = k.local_array("qr", a.ty, d.dh);
        a.load_rotated(&mut k, &qr, &a.q, &qrow, &t);
        let [m, inv, centre] = row_stats(&mut k, &a, &dout, &qr, [&bi, &t, &g, &qrow]);
        k.store(&st, item() * i64(3), m);
        k.store(&st, item() * i64(3) + i64(1), inv);
        k.store(&st, item() * i64(3) + i64(2), centre);
        finish(k, r)?
    };

    // Kernel 2: the gradient itself.
    let items = if wrt == 0 { rows } else { kd[0] * kd[1] * kd[2] };
    let mut k = KernelBuilder::new(name, grid(items));
    let mut r = Reader::new(graph);
    let names = Names::default();
    let a = attn_setup(graph, id, &mut k, &mut r, &names, scale, rope_base);
    let dout = r.read(&mut k, inputs[3]);
    let st = k.param("stats", dtype, Access::Read, stats_len);
    r.args.push(super::Arg::Temp(0));
    let out = r.buffer(&mut k, id, Access::Write);
    let d = a.d;
    let acc = k.local_array("acc", a.ty, d.dh);
    k.for_("i", ix(0), ix(d.dh), |b, i| b.store(&acc, i, a.lit(0.0)));
    // p for query row `qi` (row offset qrow) and key row krow, and (for dq and dk)
    // ds = p · (dp − centre) · scale.
    let probs = |b: &mut Block, qr: &Buf, qi: &Expr, qrow: &Expr, krow: &Expr, tp: &Expr| {
        let s = a.score(b, qr, krow, tp);
        let p = b.let_(
            &names.fresh("p"),
            (s - st.at(qi.clone() * i64(3))).exp() * st.at(qi.clone() * i64(3) + i64(1)),
        );
        if wrt == 2 {
            return (p.clone(), p);
        }
        let dp = sum(&names, b, a.lit(0.0), ix(0), ix(d.dh), |_, e| {
            dout.load(qrow.clone() + e.clone()) * a.v.load(krow.clone() + e)
        });
        let ds =
            b.let_(&names.fresh("ds"), p.clone() * (dp - st.at(qi.clone() * i64(3) + i64(2))) * a.lit(scale));
        (p, ds)
    };
    if wrt == 0 {
        let bi = k.let_("bi", item() / ix(d.t * d.h));
        let t = k.let_("t", (item() / ix(d.h)) % ix(d.t));
        let h = k.let_("h", item() % ix(d.h));
        let g = k.let_("g", (h * ix(d.hkv)) / ix(d.h));
        let qrow = k.let_("qrow", item() * ix(d.dh));
        let qr = k.local_array("qr", a.ty, d.dh);
        a.load_rotated(&mut k, &qr, &a.q, &qrow, &t);
        k.for_("tp", ix(0), t.clone() + i64(1), |b, tp| {
            let krow = b.let_("krow", a.kv_row(&bi, &tp, &g));
            let (_, ds) = probs(b, &qr, &item(), &qrow, &krow, &tp);
            b.for_("e", ix(0), ix(d.dh), |b, e| {
                let kv = match &a.rope {
                    Some(rope) => rope.rotated(|j| a.k.load(krow.clone() + j), &tp, &e, 1.0),
                    None => a.k.load(krow.clone() + e.clone()),
                };
                b.store(&acc, e.clone(), acc.at(e) + ds.clone() * kv);
            });
        });
        a.store_unrotated(&mut k, &out, &qrow, &acc, &t);
    } else {
        let bi = k.let_("bi", item() / ix(d.t * d.hkv));
        let tp = k.let_("tp", (item() / ix(d.hkv)) % ix(d.t));
        let g = k.let_("g", item() % ix(d.hkv));
        let krow = k.let_("krow", item() * ix(d.dh));
        let group = d.h / d.hkv;
        let qr = k.local_array("qr", a.ty, d.dh);
        k.for_("hh", ix(0), ix(group), |b, hh| {
            let h = b.let_("h", g.clone() * ix(group) + hh);
            b.for_("t", tp.clone(), ix(d.t), |b, t| {
                let qi = b.let_("qi", (bi.clone() * ix(d.t) + t.clone()) * ix(d.h) + h.clone());
                let qrow = b.let_("qrow", a.q_row(&bi, &t, &h));
                a.load_rotated(b, &qr, &a.q, &qrow, &t);
                let (p, ds) = probs(b, &qr, &qi, &qrow, &krow, &tp);
                b.for_("e", ix(0), ix(d.dh), |b, e| {
                    let add = if wrt == 1 {
                        ds.clone() * qr.at(e.clone())
                    } else {
                        p.clone() * dout.load(qrow.clone() + e.clone())
                    };
                    b.store(&acc, e.clone(), acc.at(e) + add);
                });
            });
        });
        if wrt == 1 {
            a.store_unrotated(&mut k, &out, &krow, &acc, &tp);
        } else {
            k.for_("e", ix(0), ix(d.dh), |b, e| b.store(&out, krow.clone() + e.clone(), acc.at(e)));
        }
    }
    let grad = finish(k, r)?;
    Ok(Lowering { launches: vec![stats, grad], temps: vec![(stats_len, dtype)] })
}

/// Mean softmax cross-entropy (MATH.md §1.3 "Loss"): one block whose lanes take
/// rows lane, lane + 256, ..., each adding logsumexp − logit[target]; a block
/// reduction sums the lanes.
fn cross_entropy(graph: &Graph, id: NodeId, name: &str) -> Result<Launch, EmitError> {
    let inputs = graph.inputs(id);
    let v = graph.node(inputs[0]).shape.last();
    let rows = graph.node(inputs[1]).shape.numel();
    let ty = Ty::of_storage(graph.node(id).dtype);
    let mut k = KernelBuilder::new(name, Grid::block_per_item(1, LOSS_THREADS));
    let mut r = Reader::new(graph);
    let names = Names::default();
    let x = r.read(&mut k, inputs[0]);
    let targets = r.read(&mut k, inputs[1]);
    let out = r.buffer(&mut k, id, Access::Write);
    let part = k.var("part", lit(ty, 0.0));
    k.for_step("row", lane(), ix(rows), i64::from(LOSS_THREADS), false, |b, row| {
        let base = b.let_("base", row.clone() * ix(v));
        let m = b.var("m", lit(ty, f64::NEG_INFINITY));
        b.for_("j", ix(0), ix(v), |b, j| {
            let xv = b.let_("xv", x.load(base.clone() + j));
            b.assign(&m, maximum(m.clone(), xv));
        });
        let s =
            sum(&names, b, lit(ty, 0.0), ix(0), ix(v), |_, j| (x.load(base.clone() + j) - m.clone()).exp());
        let lse = b.let_("lse", m.clone() + s.log());
        let target = b.let_("target", targets.load(row).cast(Ty::I64));
        b.assign(&part, part.clone() + (lse - x.load(base + target)));
    });
    let total = k.block_reduce("total", ReduceOp::Sum, part);
    k.if_(lane().eq_(i64(0)), |b| b.store(&out, ix(0), total / lit(ty, rows as f64)));
    finish(k, r)
}

/// Temporal augmentation state shared by the forward and gradient kernels.
struct Ta<'a> {
    names: &'a Names,
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

    fn dot(&self, b: &mut Block, u: impl Fn(Expr) -> Expr, v: impl Fn(Expr) -> Expr) -> Expr {
        sum(self.names, b, self.lit(0.0), ix(0), ix(self.c), |_, e| u(e.clone()) * v(e))
    }

    /// The causal depthwise convolution g_j at token `tok` into the local `dst`
    /// (MATH.md §6.5): Σ_{i < κ_j, i ≤ t} w_j[i] ⊙ x[tok − i].
    fn conv(&self, b: &mut Block, j: usize, tok: &Expr, dst: &Buf, at: usize) {
        let (w, kappa) = &self.ws[j];
        let t = b.let_(&self.names.fresh("tt"), tok.clone() % ix(self.t));
        let end = b.let_(
            &self.names.fresh("taps"),
            select((t.clone() + i64(1)).lt(ix(*kappa)), t + i64(1), ix(*kappa)),
        );
        b.for_(&self.names.fresh("e"), ix(0), ix(self.c), |b, e| {
            let acc = sum(self.names, b, self.lit(0.0), ix(0), end.clone(), |_, i| {
                w.load(i.clone() * ix(self.c) + e.clone())
                    * self.x.load((tok.clone() - i) * ix(self.c) + e.clone())
            });
            b.store(dst, ix(at) + e, acc);
        });
    }

    /// guard = ε_rel·⟨out, out⟩ + ε_abs for the token whose `out` row starts at `ob`.
    fn guard(&self, b: &mut Block, ob: &Expr) -> Expr {
        let sq = self.dot(b, |e| self.x.load(ob.clone() + e), |e| self.x.load(ob.clone() + e));
        b.let_(&self.names.fresh("guard"), self.lit(self.eps_rel) * sq + self.lit(GS_EPS_ABS))
    }
}

/// Local arrays of one token's Gram–Schmidt record and its reverse sweep.
struct GsArrays {
    /// v_0 = out, v_1..v_r: (r + 1) rows of C.
    v: Buf,
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
            u: k.local_array("gu", ty, r * (r + 1) * c),
            coef: k.local_array("gcoef", ty, r * (r + 1)),
            den: k.local_array("gden", ty, r * (r + 1)),
            dv: k.local_array("gdv", ty, (r + 1) * c),
            du: k.local_array("gdu", ty, c),
        }
    }
}

/// Modified Gram–Schmidt of one token, forward record and reverse sweep
/// (MATH.md §6.5, §6.8; `ir::exec::backward_ops::gram_schmidt_back`): writes
/// d g_j into `dg` (rows of C at `j·C`) and, when asked, d out's direct part
/// into `direct`. The projections run as loops over (j, i) with the record in
/// local arrays, which keeps the body small enough for registers.
fn gs_back(b: &mut Block, ta: &Ta, arr: &GsArrays, tok: &Expr, dy: &Val, dg: &Buf, direct: Option<&Buf>) {
    let (c, r) = (ta.c, ta.ws.len());
    let n = ta.names;
    let ob = b.let_(&n.fresh("ob"), tok.clone() * ix(c));
    let guard = ta.guard(b, &ob);
    let copy = |b: &mut Block, dst: &Buf, at: Expr, src: &dyn Fn(Expr) -> Expr| {
        b.for_(&n.fresh("e"), ix(0), ix(c), |b, e| b.store(dst, at.clone() + e.clone(), src(e)));
    };
    copy(b, &arr.v, ix(0), &|e| ta.x.load(ob.clone() + e));
    for j in 0..r {
        ta.conv(b, j, tok, &arr.u, j * (r + 1) * c);
    }
    let ur = |j: &Expr, i: &Expr| (j.clone() * ix(r + 1) + i.clone()) * ix(c);
    let ci = |j: &Expr, i: &Expr| j.clone() * ix(r + 1) + i.clone();
    b.for_(&n.fresh("j"), ix(0), ix(r), |b, j| {
        b.for_(&n.fresh("i"), ix(0), j.clone() + i64(1), |b, i| {
            let vi = i.clone() * ix(c);
            let dd = ta.dot(b, |e| arr.v.at(vi.clone() + e), |e| arr.v.at(vi.clone() + e));
            let dn = b.let_(&n.fresh("den"), dd + guard.clone());
            let uji = b.let_(&n.fresh("uji"), ur(&j, &i));
            let du = ta.dot(b, |e| arr.u.at(uji.clone() + e), |e| arr.v.at(vi.clone() + e));
            let cf = b.let_(&n.fresh("coef"), du / dn.clone());
            b.store(&arr.coef, ci(&j, &i), cf.clone());
            b.store(&arr.den, ci(&j, &i), dn);
            let next = |e: Expr| arr.u.at(uji.clone() + e.clone()) - cf.clone() * arr.v.at(vi.clone() + e);
            b.if_else(
                i.clone().eq_(j.clone()),
                |b| copy(b, &arr.v, (j.clone() + i64(1)) * ix(c), &next),
                |b| copy(b, &arr.u, uji.clone() + ix(c), &next),
            );
        });
    });
    copy(b, &arr.dv, ix(0), &|_| ta.lit(0.0));
    b.for_(&n.fresh("j"), ix(0), ix(r), |b, j| {
        let at = (j.clone() + i64(1)) * ix(c);
        copy(b, &arr.dv, at, &|e| dy.load((tok.clone() * ix(r) + j.clone()) * ix(c) + e));
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
        copy(b, dg, j * ix(c), &|e| arr.du.at(e));
    });
    if let Some(direct) = direct {
        let scale = b.let_(&n.fresh("gscale"), ta.lit(2.0) * ta.lit(ta.eps_rel) * d_guard);
        copy(b, direct, ix(0), &|e| arr.dv.at(e.clone()) + scale.clone() * arr.v.at(e));
    }
}

/// TemporalAugment (MATH.md §6.5) with one item per token, or its gradient
/// (§6.8) w.r.t. `out` (one item per token, recomputing the Gram–Schmidt sweep
/// of the κ_max tokens whose convolutions read it) or w.r.t. kernel j (one item
/// per tap, summing over every token).
fn temporal(
    graph: &Graph,
    id: NodeId,
    name: &str,
    gram_schmidt: bool,
    eps_rel: f64,
    wrt: Option<usize>,
) -> Result<Launch, EmitError> {
    let inputs = graph.inputs(id);
    let xd = graph.node(inputs[0]).shape.dims();
    let (bsz, t, c) = (xd[0], xd[1], xd[2]);
    let tokens = bsz * t;
    let nk = if wrt.is_some() { inputs.len() - 2 } else { inputs.len() - 1 };
    let ty = Ty::of_storage(graph.node(id).dtype);
    let items = match wrt {
        Some(j) if j > 0 => graph.node(inputs[j]).shape.dims()[0],
        _ => tokens,
    };
    let mut k = KernelBuilder::new(name, grid(items));
    let mut r = Reader::new(graph);
    let names = Names::default();
    let x = r.read(&mut k, inputs[0]);
    let ws: Vec<(Val, usize)> =
        (1..=nk).map(|j| (r.read(&mut k, inputs[j]), graph.node(inputs[j]).shape.dims()[0])).collect();
    let dy = wrt.map(|_| r.read(&mut k, inputs[nk + 1]));
    let out = r.buffer(&mut k, id, Access::Write);
    let ta = Ta { names: &names, ty, x, ws, t, c, eps_rel };
    let rk = nk;
    let Some(wrt) = wrt else {
        // Forward: convolutions, then Gram–Schmidt against out and earlier rows.
        let y = k.local_array("y", ty, rk * c);
        for j in 0..rk {
            ta.conv(&mut k, j, &item(), &y, j * c);
        }
        if gram_schmidt {
            let ob = k.let_("ob", item() * ix(c));
            let guard = ta.guard(&mut k, &ob);
            for j in 0..rk {
                for i in 0..=j {
                    let v =
                        |e: Expr| if i == 0 { ta.x.load(ob.clone() + e) } else { y.at(ix((i - 1) * c) + e) };
                    let dd = ta.dot(&mut k, v, v);
                    let den = k.let_(&names.fresh("den"), dd + guard.clone());
                    let du = ta.dot(&mut k, |e| y.at(ix(j * c) + e), v);
                    let cf = k.let_(&names.fresh("coef"), du / den);
                    k.for_(&names.fresh("e"), ix(0), ix(c), |b, e| {
                        let at = ix(j * c) + e.clone();
                        b.store(&y, at.clone(), y.at(at) - cf.clone() * v(e));
                    });
                }
            }
        }
        for j in 0..rk {
            k.for_(&names.fresh("e"), ix(0), ix(c), |b, e| {
                b.store(&out, (item() * ix(rk) + ix(j)) * ix(c) + e.clone(), y.at(ix(j * c) + e));
            });
        }
        return finish(k, r);
    };
    let dy = dy.expect("gradient kernels read dY");
    let arrays = gram_schmidt.then(|| GsArrays::new(&mut k, ty, rk, c));
    let dg = k.local_array("dg", ty, rk * c);
    let direct = (wrt == 0 && gram_schmidt).then(|| k.local_array("direct", ty, c));
    // d g_j at token `tok` into dg (and d out's direct part into `direct`).
    let token_dg = |b: &mut Block, tok: &Expr| match &arrays {
        Some(arr) => gs_back(b, &ta, arr, tok, &dy, &dg, direct.as_ref()),
        None => {
            for j in 0..rk {
                b.for_(&names.fresh("e"), ix(0), ix(c), |b, e| {
                    b.store(&dg, ix(j * c) + e.clone(), dy.load((tok.clone() * ix(rk) + ix(j)) * ix(c) + e));
                });
            }
        }
    };
    let acc = k.local_array("acc", ty, c);
    k.for_("e", ix(0), ix(c), |b, e| b.store(&acc, e, ta.lit(0.0)));
    if wrt == 0 {
        let tt = k.let_("tt", item() % ix(t));
        let kmax = ta.ws.iter().map(|w| w.1).max().unwrap_or(1);
        let all = k.local_array("dgall", ty, kmax * rk * c);
        // Offsets whose source token t + i exists; the i = 0 pass also gives the direct part.
        let reach = k.let_("reach", select((ix(t) - tt.clone()).lt(ix(kmax)), ix(t) - tt, ix(kmax)));
        k.for_("off", ix(0), reach.clone(), |b, off| {
            let tok = b.let_("src", item() + off.clone());
            token_dg(b, &tok);
            b.for_("e", ix(0), ix(rk * c), |b, e| {
                b.store(&all, off.clone() * ix(rk * c) + e.clone(), dg.at(e));
            });
            if let Some(direct) = &direct {
                b.if_(off.eq_(i64(0)), |b| {
                    b.for_("e", ix(0), ix(c), |b, e| b.store(&acc, e.clone(), direct.at(e)));
                });
            }
        });
        for j in 0..rk {
            let kappa = ta.ws[j].1;
            let w = ta.ws[j].0.clone();
            let end = select(reach.clone().lt(ix(kappa)), reach.clone(), ix(kappa));
            k.for_(&names.fresh("i"), ix(0), end, |b, i| {
                b.for_("e", ix(0), ix(c), |b, e| {
                    let g = all.at(i.clone() * ix(rk * c) + ix(j * c) + e.clone());
                    let add = w.load(i.clone() * ix(c) + e.clone()) * g;
                    b.store(&acc, e.clone(), acc.at(e) + add);
                });
            });
        }
        k.for_("e", ix(0), ix(c), |b, e| b.store(&out, item() * ix(c) + e.clone(), acc.at(e)));
    } else {
        let j = wrt - 1;
        // Item = tap i of kernel j: Σ over tokens with t ≥ i of d g_j[tok] ⊙ out[tok − i].
        k.for_("tok", ix(0), ix(tokens), |b, tok| {
            let tt = tok.clone() % ix(t);
            b.if_(tt.ge(item()), |b| {
                token_dg(b, &tok);
                b.for_("e", ix(0), ix(c), |b, e| {
                    let add =
                        dg.at(ix(j * c) + e.clone()) * ta.x.load((tok.clone() - item()) * ix(c) + e.clone());
                    b.store(&acc, e.clone(), acc.at(e) + add);
                });
            });
        });
        k.for_("e", ix(0), ix(c), |b, e| b.store(&out, item() * ix(c) + e.clone(), acc.at(e)));
    }
    finish(k, r)
}
