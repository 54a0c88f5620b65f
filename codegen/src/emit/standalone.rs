//! Ops lowered on grids of their own (DESIGN.md §5 "heavy ops are kernels of
//! their own"): causal attention and its gradient (in [`super::attention`]),
//! the cross-entropy loss and xHC's temporal augmentation and its gradient. Operands are read through
//! [`Reader`], so views fold into their index math like everywhere else.

use ir::graph::{Graph, NodeId, Op};

use super::{
    grid, ix, lit, maximum, Arg, EmitError, GemmCall, Kb, Launch, Lowering, Names, Reader, Temps, Val, Work,
};
use crate::kernel::{i64, item, lane, select, Access, Block, Buf, Expr, Grid, KernelBuilder, ReduceOp, Ty};

/// ε_abs of the Gram–Schmidt guard (MATH.md §6.5 DECISION; `ir::exec` uses the same).
const GS_EPS_ABS: f64 = 1e-20;

/// Lanes of the block-per-item loss kernel.
const LOSS_THREADS: u32 = 256;

/// Lowers one standalone op (see [`super::is_standalone`]) into its launches.
pub fn lower_standalone(graph: &Graph, id: NodeId, name: &str) -> Result<Lowering, EmitError> {
    let node = graph.node(id);
    match &node.op {
        Op::CausalAttention { .. } => super::attention::attention(graph, id, name),
        Op::CausalAttentionGrad { wrt, .. } if *wrt < 3 => {
            let mut outs = [None; 3];
            outs[*wrt] = Some(id);
            super::attention_grads(graph, outs, name)
        }
        Op::SoftmaxCrossEntropy => Ok(single(cross_entropy(graph, id, name)?)),
        Op::NormProject { eps, centered } => norm_project(graph, id, name, *eps, *centered),
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            Ok(single(temporal(graph, id, name, *gram_schmidt, *eps_rel)?))
        }
        Op::TemporalAugmentGrad { wrt, .. } => {
            let mut outs = vec![None; graph.inputs(id).len() - 1];
            match outs.get_mut(*wrt) {
                Some(slot) => *slot = Some(id),
                None => return Err(EmitError::at(id, &node.op, format!("no operand {wrt}"))),
            }
            temporal_grads(graph, &outs, name)
        }
        op => Err(EmitError::at(id, op, "is not lowered on a grid of its own")),
    }
}

fn single(launch: Launch) -> Lowering {
    Lowering { steps: vec![Work::Launch(launch)], temps: Vec::new() }
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

/// A buffer holding node `id`'s value in its own layout: the node's buffer
/// (through reshapes, its source's), or a copy into a temporary for other views
/// and constants, which have none.
fn memory(
    graph: &Graph,
    id: NodeId,
    name: &str,
    temps: &mut Temps,
    steps: &mut Vec<Work>,
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
    let mut kb = Kb::new(graph, &format!("{name}_copy{}", steps.len()), len);
    let src = kb.r.read(&mut kb.k, id);
    let dst = kb.temp("dst", arg, temps, Access::Write);
    kb.k.store(&dst, item(), src.load(item()));
    steps.push(kb.finish()?);
    Ok(arg)
}

/// The projection of the normalized rows computed from the rows themselves
/// (MATH.md §4.3, §6.2), as the reference computes it: one GEMM `x·W` over
/// all rows, the column sums of `W` (for the centred columns), then one
/// kernel per row with the row's statistics: `ρ_c·(dot − Σw·μ)` for the first
/// `centered` columns (LayerNorm statistics), `ρ_r·dot` for the rest (RMS).
fn norm_project(
    graph: &Graph,
    id: NodeId,
    name: &str,
    eps: f64,
    centered: usize,
) -> Result<Lowering, EmitError> {
    let inputs = graph.inputs(id);
    let node = graph.node(id);
    let (kk, m) = (graph.node(inputs[1]).shape.dims()[0], graph.node(inputs[1]).shape.dims()[1]);
    let rows = node.shape.numel() / m.max(1);
    let ty = Ty::of_storage(node.dtype);
    let mut temps = Temps::default();
    let mut steps = Vec::new();
    let x = memory(graph, inputs[0], name, &mut temps, &mut steps)?;
    let w = memory(graph, inputs[1], name, &mut temps, &mut steps)?;
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
    let xb = k.let_("xb", item() * ix(kk));
    let ob = k.let_("ob", item() * ix(m));
    let at = |j: Expr| xv.load(xb.clone() + j);
    let head = cs.as_ref().map(|_| {
        let s = sum(&names, k, lit(ty, 0.0), ix(0), ix(kk), |_, j| at(j));
        let mu = k.let_("mu", s / lit(ty, kk as f64));
        let sq = sum(&names, k, lit(ty, 0.0), ix(0), ix(kk), |b, j| {
            let dv = b.let_(&names.fresh("d"), at(j) - mu.clone());
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
        let ss = sum(&names, k, lit(ty, 0.0), ix(0), ix(kk), |b, j| {
            let v = b.let_(&names.fresh("v"), at(j));
            v.clone() * v
        });
        let rho = k.let_("rhor", lit(ty, 1.0) / (ss / lit(ty, kk as f64) + lit(ty, eps)).sqrt());
        k.for_("col", ix(centered), ix(m), |b, col| {
            b.store(&out, ob.clone() + col.clone(), d.at(ob.clone() + col) * rho.clone());
        });
    }
    steps.push(kb.finish()?);
    Ok(Lowering { steps, temps: temps.0 })
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

/// TemporalAugment (MATH.md §6.5) with one item per token: the causal
/// convolutions, then Gram–Schmidt against `out` and the earlier rows.
fn temporal(
    graph: &Graph,
    id: NodeId,
    name: &str,
    gram_schmidt: bool,
    eps_rel: f64,
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
    let ta = Ta { names: &names, ty, x, ws, t, c, eps_rel };
    let y = k.local_array("y", ty, rk * c);
    for j in 0..rk {
        ta.conv(&mut k, j, &item(), &y, j * c);
    }
    if gram_schmidt {
        let ob = k.let_("ob", item() * ix(c));
        let guard = ta.guard(&mut k, &ob);
        for j in 0..rk {
            for i in 0..=j {
                let v = |e: Expr| if i == 0 { ta.x.load(ob.clone() + e) } else { y.at(ix((i - 1) * c) + e) };
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
    finish(k, r)
}

/// The gradients of one TemporalAugment (MATH.md §6.8) w.r.t. `out`
/// (`outs[0]`) and the kernels (`outs[j]`), whichever are present: the
/// TemporalAugmentGrad nodes sharing their inputs. With Gram–Schmidt, a first
/// kernel runs each token's reverse sweep once (one item per token) into
/// d g `[tokens, r, C]` and d out's direct part `[tokens, C]`; without it d g
/// is dY itself. Then d out (one item per token) adds the transposed
/// convolutions, and d w_j (one item per (tap, channel)) sums over tokens.
pub fn temporal_grads(graph: &Graph, outs: &[Option<NodeId>], name: &str) -> Result<Lowering, EmitError> {
    let id = outs.iter().flatten().copied().next().ok_or_else(|| EmitError::Unsupported {
        node: usize::MAX,
        op: "temporal_augment_grad",
        message: "no gradient requested".into(),
    })?;
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
    // Reads d g_j[tok][e] (at (tok·r + j)·C + e) and, with Gram–Schmidt, the direct part.
    let setup = |kb: &mut Kb| {
        let names = Names::default();
        let x = kb.r.read(&mut kb.k, inputs[0]);
        let ws: Vec<(Val, usize)> =
            (1..=rk).map(|j| (kb.r.read(&mut kb.k, inputs[j]), kappa[j - 1])).collect();
        (names, x, ws)
    };
    let stored = if gram_schmidt {
        let dg = temps.add(tokens * rk * c, dtype);
        let direct = temps.add(tokens * c, dtype);
        let mut kb = Kb::new(graph, &format!("{name}_sweep"), tokens);
        let (names, x, ws) = setup(&mut kb);
        let dy = kb.r.read(&mut kb.k, inputs[rk + 1]);
        let dgb = kb.temp("dg", dg, &temps, Access::Write);
        let db = kb.temp("direct", direct, &temps, Access::Write);
        let ta = Ta { names: &names, ty, x, ws, t, c, eps_rel };
        let arr = GsArrays::new(&mut kb.k, ty, rk, c);
        let row = kb.k.local_array("dgrow", ty, rk * c);
        let dir = kb.k.local_array("dir", ty, c);
        gs_back(&mut kb.k, &ta, &arr, &item(), &dy, &row, Some(&dir));
        kb.k.for_("e", ix(0), ix(rk * c), |b, e| b.store(&dgb, item() * ix(rk * c) + e.clone(), row.at(e)));
        kb.k.for_("e", ix(0), ix(c), |b, e| b.store(&db, item() * ix(c) + e.clone(), dir.at(e)));
        steps.push(kb.finish()?);
        Some((dg, direct))
    } else {
        None
    };
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
        let acc = k.local_array("acc", ty, c);
        k.for_("e", ix(0), ix(c), |b, e| {
            let v = match &direct {
                Some(d) => d.at(item() * ix(c) + e.clone()),
                None => lit(ty, 0.0),
            };
            b.store(&acc, e, v);
        });
        for (j, (w, kj)) in ws.iter().enumerate() {
            let end = select(reach.clone().lt(ix(*kj)), reach.clone(), ix(*kj));
            k.for_(&names.fresh("i"), ix(0), end, |b, i| {
                let src = b.let_(&names.fresh("src"), ((item() + i.clone()) * ix(rk) + ix(j)) * ix(c));
                b.for_("e", ix(0), ix(c), |b, e| {
                    let add = w.load(i.clone() * ix(c) + e.clone()) * dg.load(src.clone() + e.clone());
                    b.store(&acc, e.clone(), acc.at(e) + add);
                });
            });
        }
        k.for_("e", ix(0), ix(c), |b, e| b.store(&o, item() * ix(c) + e.clone(), acc.at(e)));
        steps.push(kb.finish()?);
    }
    for (j, out) in outs.iter().enumerate().skip(1) {
        let Some(out) = *out else { continue };
        let kj = kappa[j - 1];
        let mut kb = Kb::new(graph, &format!("{name}_dw{j}"), kj * c);
        let (names, x, _) = setup(&mut kb);
        let (dg, _) = reads(&mut kb);
        let o = kb.r.buffer(&mut kb.k, out, Access::Write);
        let k = &mut kb.k;
        let tap = k.let_("tap", item() / ix(c));
        let e = k.let_("e", item() % ix(c));
        // Σ over tokens with t ≥ tap of d g_j[tok] ⊙ out[tok − tap], in token order.
        let acc = k.var("acc", lit(ty, 0.0));
        k.for_("bi", ix(0), ix(bsz), |b, bi| {
            b.for_("tt", tap.clone(), ix(t), |b, tt| {
                let tok = b.let_(&names.fresh("tok"), bi.clone() * ix(t) + tt);
                let g = dg.load((tok.clone() * ix(rk) + ix(j - 1)) * ix(c) + e.clone());
                let v = x.load((tok - tap.clone()) * ix(c) + e.clone());
                b.assign(&acc, acc.clone() + g * v);
            });
        });
        k.store(&o, item(), acc);
        steps.push(kb.finish()?);
    }
    Ok(Lowering { steps, temps: temps.0 })
}
