//! The derivative table: one vector-Jacobian rule per op, dispatched from one match
//! (docs/architecture.md §4). Each arm receives the output adjoint `dy` and returns the
//! adjoint of every input the sweep asked for (`needs`), shaped like that input.
//! Rules are graph-building code: derivatives are expressed with the primitive
//! ops wherever that is natural, and with a backward op (`*Grad`) for composites
//! whose derivative would otherwise need their internals spelled out.

use super::builder::Builder;
use super::AutodiffError;
use crate::graph::Build;
use crate::graph::{BinaryOp, GraphError, NodeId, Op, ReduceOp, UnaryOp};
use crate::shape::Shape;

type Adjoints = Vec<Option<NodeId>>;

/// The adjoints of the inputs of node `y` given its output adjoint `dy`. Entries for
/// inputs with `needs[slot] == false` are `None`. Short rules are written here; the
/// longer ones are functions below, one per op or family.
pub(super) fn vjp(b: &mut Builder, y: NodeId, dy: NodeId, needs: &[bool]) -> Result<Adjoints, AutodiffError> {
    let op = b.g.node(y).op.clone();
    let xs = b.g.inputs(y);
    let mut out: Adjoints = vec![None; xs.len()];
    match op {
        Op::Unary(u) => out[0] = Some(unary(b, u, xs[0], y, dy)?),
        Op::Binary(op) => {
            let (l, r) = (xs[0], xs[1]);
            let (dl, dr) = binary(b, op, l, r, y, dy, needs)?;
            out[0] = dl.map(|d| b.sum_to(d, &b.shape(l))).transpose()?;
            out[1] = dr.map(|d| b.sum_to(d, &b.shape(r))).transpose()?;
        }
        Op::Affine { mul, .. } => out[0] = Some(b.affine(dy, mul, 0.0)?),
        Op::Cast { .. } => out[0] = Some(cast(b, xs[0], dy)?),
        Op::Reduce { op, axis, .. } => out[0] = Some(reduce(b, op, axis, xs[0], dy)?),
        Op::MatMul { trans_a, trans_b } => matmul(b, trans_a, trans_b, &xs, dy, needs, &mut out)?,
        Op::Reshape { .. } => out[0] = Some(b.reshape(dy, b.shape(xs[0]).dims())?),
        Op::Permute { perm } => {
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            out[0] = Some(b.permute(dy, &inverse)?);
        }
        Op::Broadcast { .. } => out[0] = Some(b.sum_to(dy, &b.shape(xs[0]))?),
        Op::Slice { axis, start, end } => out[0] = Some(slice(b, xs[0], axis, start, end, dy)?),
        Op::Concat { axis } => concat(b, axis, &xs, dy, needs, &mut out)?,
        Op::Gather { axis } => {
            let zeros = b.zeros_like(xs[0]);
            out[0] = Some(b.op(Op::ScatterAdd { axis }, &[zeros, xs[1], dy])?);
        }
        Op::ScatterAdd { axis } => {
            out[0] = needs[0].then_some(dy);
            if needs[2] {
                out[2] = Some(b.op(Op::Gather { axis }, &[dy, xs[1]])?);
            }
        }
        Op::ScatterRows { axis } => {
            if needs[0] {
                let zeros = b.zeros_like(xs[2]);
                out[0] = Some(b.op(Op::ScatterRows { axis }, &[dy, xs[1], zeros])?);
            }
            if needs[2] {
                out[2] = Some(b.op(Op::Gather { axis }, &[dy, xs[1]])?);
            }
        }
        Op::Softmax => out[0] = Some(softmax(b, y, dy)?),
        Op::RmsNorm { eps } => rms_norm(b, eps, &xs, dy, needs, &mut out)?,
        Op::LayerNorm { eps } => layer_norm(b, eps, &xs, dy, needs, &mut out)?,
        Op::GroupNorm { groups, eps } => group_norm(b, groups, eps, &xs, dy, needs, &mut out)?,
        Op::NormProject { eps, centered } => {
            let (dx, dw) = norm_project(b, xs[0], xs[1], y, dy, eps, centered, needs)?;
            out[0] = dx;
            out[1] = dw;
        }
        Op::SoftmaxCrossEntropy => out[0] = Some(softmax_cross_entropy(b, xs[0], xs[1], dy)?),
        // Both gradients recompute the chunks' logits (docs/math.md §1.7); the targets have none.
        Op::LinearCrossEntropy { trans_b, scale, chunk } => {
            let args = [xs[0], xs[1], xs[2], dy];
            for wrt in (0..2).filter(|&i| needs[i]) {
                out[wrt] = Some(b.op(Op::LinearCrossEntropyGrad { trans_b, scale, chunk, wrt }, &args)?);
            }
        }
        Op::CausalAttention { scale, rope_base } => {
            let args = [xs[0], xs[1], xs[2], dy];
            for wrt in (0..3).filter(|&i| needs[i]) {
                out[wrt] = Some(b.op(Op::CausalAttentionGrad { scale, rope_base, wrt }, &args)?);
            }
        }
        Op::Sinkhorn { iters, eps } => out[0] = Some(b.op(Op::SinkhornGrad { iters, eps }, &[xs[0], dy])?),
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            let mut args = xs.clone();
            args.push(dy);
            for wrt in (0..xs.len()).filter(|&i| needs[i]) {
                out[wrt] = Some(b.op(Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt }, &args)?);
            }
        }
        // Gradients flow through the experts to x and w, never to the group sizes
        // (docs/math.md §1.6): dx = dy · w[e]ᵀ per group, dw[e] = Σ_group x ⊗ dy.
        Op::GroupedMatMul { trans_b } => {
            if needs[0] {
                out[0] = Some(b.op(Op::GroupedMatMul { trans_b: !trans_b }, &[dy, xs[1], xs[2]])?);
            }
            if needs[1] {
                out[1] = Some(b.op(Op::GroupedMatMulGrad { trans_b }, &[xs[0], dy, xs[2]])?);
            }
        }
        Op::Input { .. } | Op::Param(_) | Op::Constant { .. } => {}
        Op::TopK { .. }
        | Op::MoeRoute { .. }
        | Op::GroupedMatMulGrad { .. }
        | Op::CausalAttentionGrad { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::SinkhornGrad { .. }
        | Op::TemporalAugmentGrad { .. } => {
            return Err(AutodiffError::NoRule { op: op.name(), node: y.index() })
        }
    }
    Ok(out)
}

/// Straight-through (docs/math.md §6.12 DECISION): rounding to bf16 is treated as the
/// identity, and gradients stay in the input's compute type, so the adjoint of a bf16
/// value is f32 and a gradient is never rounded to bf16.
fn cast(b: &mut Builder, x: NodeId, dy: NodeId) -> Result<NodeId, GraphError> {
    let want = b.dtype(x).compute();
    Ok(if b.dtype(dy) == want { dy } else { b.op(Op::Cast { to: want }, &[dy])? })
}

/// The output adjoint spread back over the reduced axis: every element for a sum,
/// scaled by 1/n for a mean, the first maximum only for a max.
fn reduce(b: &mut Builder, op: ReduceOp, axis: usize, x: NodeId, dy: NodeId) -> Result<NodeId, GraphError> {
    let xshape = b.shape(x);
    let mut kept = xshape.dims().to_vec();
    kept[axis] = 1;
    let dyk = b.reshape(dy, &kept)?;
    match op {
        ReduceOp::Sum => b.broadcast(dyk, xshape.dims()),
        ReduceOp::Mean => {
            let spread = b.broadcast(dyk, xshape.dims())?;
            b.affine(spread, 1.0 / xshape.dims()[axis] as f64, 0.0)
        }
        ReduceOp::Max => b.route_to_first_max(x, axis, dyk),
    }
}

/// d a and d c of `a · c` (either transposed), summed down over broadcast batch axes.
fn matmul(
    b: &mut Builder,
    trans_a: bool,
    trans_b: bool,
    xs: &[NodeId],
    dy: NodeId,
    needs: &[bool],
    out: &mut Adjoints,
) -> Result<(), GraphError> {
    let (a, c) = (xs[0], xs[1]);
    if needs[0] {
        let da =
            if trans_a { b.matmul_t(c, dy, trans_b, true)? } else { b.matmul_t(dy, c, false, !trans_b)? };
        out[0] = Some(b.sum_to(da, &b.shape(a))?);
    }
    if needs[1] {
        let dc =
            if trans_b { b.matmul_t(dy, a, true, trans_a)? } else { b.matmul_t(a, dy, !trans_a, false)? };
        out[1] = Some(b.sum_to(dc, &b.shape(c))?);
    }
    Ok(())
}

/// The adjoint of a slice: `dy` in place, zeros before and after it on `axis`.
fn slice(
    b: &mut Builder,
    x: NodeId,
    axis: usize,
    start: usize,
    end: usize,
    dy: NodeId,
) -> Result<NodeId, GraphError> {
    let dims = b.shape(x).dims().to_vec();
    let mut parts = Vec::new();
    for (lo, hi) in [(0, start), (start, end), (end, dims[axis])] {
        if (lo, hi) == (start, end) {
            parts.push(dy);
        } else if hi > lo {
            let mut zdims = dims.clone();
            zdims[axis] = hi - lo;
            parts.push(b.constant(0.0, zdims.into(), b.dtype(dy)));
        }
    }
    Ok(if parts.len() == 1 { dy } else { b.op(Op::Concat { axis }, &parts)? })
}

/// Each operand of a concat gets its own slice of `dy`.
fn concat(
    b: &mut Builder,
    axis: usize,
    xs: &[NodeId],
    dy: NodeId,
    needs: &[bool],
    out: &mut Adjoints,
) -> Result<(), GraphError> {
    let mut offset = 0;
    for (slot, &x) in xs.iter().enumerate() {
        let size = b.shape(x).dims()[axis];
        if needs[slot] {
            out[slot] =
                Some(if size == 0 { b.zeros_like(x) } else { b.slice(dy, axis, offset, offset + size)? });
        }
        offset += size;
    }
    Ok(())
}

/// dx = y ⊙ (dy − Σ dy ⊙ y), from the output alone.
fn softmax(b: &mut Builder, y: NodeId, dy: NodeId) -> Result<NodeId, GraphError> {
    let dyy = b.mul(dy, y)?;
    let s = b.sum_last(dyy)?;
    let centred = b.sub(dy, s)?;
    b.mul(y, centred)
}

/// RMSNorm (x) or (x, gain), statistics recomputed from x.
fn rms_norm(
    b: &mut Builder,
    eps: f64,
    xs: &[NodeId],
    dy: NodeId,
    needs: &[bool],
    out: &mut Adjoints,
) -> Result<(), GraphError> {
    let x = xs[0];
    let (xhat, rho) = rms_stats(b, x, eps)?;
    if needs[0] {
        let dxhat = if xs.len() > 1 { b.mul(dy, xs[1])? } else { dy };
        out[0] = Some(rms_back(b, xhat, rho, dxhat)?);
    }
    if xs.len() > 1 && needs[1] {
        let prod = b.mul(dy, xhat)?;
        out[1] = Some(b.sum_to(prod, &b.shape(xs[1]))?);
    }
    Ok(())
}

/// LayerNorm (x) or (x, gain, bias), statistics recomputed from x.
fn layer_norm(
    b: &mut Builder,
    eps: f64,
    xs: &[NodeId],
    dy: NodeId,
    needs: &[bool],
    out: &mut Adjoints,
) -> Result<(), GraphError> {
    let x = xs[0];
    let (xhat, rstd) = ln_stats(b, x, eps)?;
    if needs[0] {
        let dxhat = if xs.len() > 1 { b.mul(dy, xs[1])? } else { dy };
        out[0] = Some(ln_back(b, xhat, rstd, dxhat)?);
    }
    affine_adjoints(b, xs, xhat, dy, needs, out)
}

/// GroupNorm = LayerNorm over [.., groups, C / groups] then a per-channel affine.
fn group_norm(
    b: &mut Builder,
    groups: usize,
    eps: f64,
    xs: &[NodeId],
    dy: NodeId,
    needs: &[bool],
    out: &mut Adjoints,
) -> Result<(), GraphError> {
    let x = xs[0];
    let dims = b.shape(x).dims().to_vec();
    let mut grouped = dims.clone();
    let c = grouped.pop().expect("normalized input has rank >= 1");
    grouped.extend([groups, c / groups]);
    let xg = b.reshape(x, &grouped)?;
    let (xhat_g, rstd) = ln_stats(b, xg, eps)?;
    let xhat = b.reshape(xhat_g, &dims)?;
    if needs[0] {
        let dxhat = b.mul(dy, xs[1])?;
        let dxhat_g = b.reshape(dxhat, &grouped)?;
        let dx_g = ln_back(b, xhat_g, rstd, dxhat_g)?;
        out[0] = Some(b.reshape(dx_g, &dims)?);
    }
    affine_adjoints(b, xs, xhat, dy, needs, out)
}

/// d logits = (softmax(logits) − onehot(targets)) · dy / count.
fn softmax_cross_entropy(
    b: &mut Builder,
    logits: NodeId,
    targets: NodeId,
    dy: NodeId,
) -> Result<NodeId, GraphError> {
    let dims = b.shape(logits).dims().to_vec();
    let rank = dims.len();
    let count = b.shape(targets).numel();
    let p = b.op(Op::Softmax, &[logits])?;
    let mut col = b.shape(targets).dims().to_vec();
    col.push(1);
    let idx = b.reshape(targets, &col)?;
    let ones = b.constant(1.0, col.into(), b.dtype(logits));
    let zeros = b.zeros_like(logits);
    let onehot = b.op(Op::ScatterAdd { axis: rank - 1 }, &[zeros, idx, ones])?;
    let diff = b.sub(p, onehot)?;
    let scaled = b.affine(dy, 1.0 / count as f64, 0.0)?;
    b.mul(diff, scaled)
}

fn unary(b: &mut Builder, u: UnaryOp, x: NodeId, y: NodeId, dy: NodeId) -> Result<NodeId, GraphError> {
    Ok(match u {
        UnaryOp::Neg => b.unary(UnaryOp::Neg, dy)?,
        UnaryOp::Exp => b.mul(dy, y)?,
        UnaryOp::Log => b.div(dy, x)?,
        UnaryOp::Tanh => {
            // 1 − y²
            let y2 = b.unary(UnaryOp::Square, y)?;
            let d = b.affine(y2, -1.0, 1.0)?;
            b.mul(dy, d)?
        }
        UnaryOp::Sigmoid => {
            // y (1 − y)
            let one_minus = b.affine(y, -1.0, 1.0)?;
            let d = b.mul(y, one_minus)?;
            b.mul(dy, d)?
        }
        UnaryOp::Silu => {
            // σ(x) (1 + x (1 − σ(x)))
            let s = b.unary(UnaryOp::Sigmoid, x)?;
            let one_minus = b.affine(s, -1.0, 1.0)?;
            let t = b.mul(x, one_minus)?;
            let t1 = b.affine(t, 1.0, 1.0)?;
            let d = b.mul(s, t1)?;
            b.mul(dy, d)?
        }
        UnaryOp::Sqrt => {
            // 1 / (2 y)
            let half = b.affine(dy, 0.5, 0.0)?;
            b.div(half, y)?
        }
        UnaryOp::Rsqrt => {
            // −y³ / 2
            let y2 = b.unary(UnaryOp::Square, y)?;
            let y3 = b.mul(y2, y)?;
            let d = b.affine(y3, -0.5, 0.0)?;
            b.mul(dy, d)?
        }
        UnaryOp::Recip => {
            // −y²
            let y2 = b.unary(UnaryOp::Square, y)?;
            let d = b.mul(dy, y2)?;
            b.unary(UnaryOp::Neg, d)?
        }
        UnaryOp::Square => {
            let d = b.affine(x, 2.0, 0.0)?;
            b.mul(dy, d)?
        }
    })
}

/// Adjoints of a broadcasting binary at the output shape (the caller sums them down).
fn binary(
    b: &mut Builder,
    op: BinaryOp,
    l: NodeId,
    r: NodeId,
    y: NodeId,
    dy: NodeId,
    needs: &[bool],
) -> Result<(Option<NodeId>, Option<NodeId>), GraphError> {
    let (nl, nr) = (needs[0], needs[1]);
    Ok(match op {
        BinaryOp::Add => (nl.then_some(dy), nr.then_some(dy)),
        BinaryOp::Sub => (nl.then_some(dy), if nr { Some(b.unary(UnaryOp::Neg, dy)?) } else { None }),
        BinaryOp::Mul => {
            (if nl { Some(b.mul(dy, r)?) } else { None }, if nr { Some(b.mul(dy, l)?) } else { None })
        }
        BinaryOp::Div => {
            // d l = dy / r;  d r = −dy · y / r
            let dl = if nl { Some(b.div(dy, r)?) } else { None };
            let dr = if nr {
                let t = b.mul(dy, y)?;
                let t = b.div(t, r)?;
                Some(b.unary(UnaryOp::Neg, t)?)
            } else {
                None
            };
            (dl, dr)
        }
        BinaryOp::Max => {
            // Stack both operands on a new last axis; the first maximum of each pair
            // (ties: the first operand) receives dy.
            let dims = b.shape(y).dims().to_vec();
            let mut col = dims.clone();
            col.push(1);
            let lb = b.broadcast(l, &dims)?;
            let lb = b.reshape(lb, &col)?;
            let rb = b.broadcast(r, &dims)?;
            let rb = b.reshape(rb, &col)?;
            let pair = b.op(Op::Concat { axis: dims.len() }, &[lb, rb])?;
            let dyc = b.reshape(dy, &col)?;
            let routed = b.route_to_first_max(pair, dims.len(), dyc)?;
            let pick = |b: &mut Builder, slot: usize| -> Result<NodeId, GraphError> {
                let s = b.slice(routed, dims.len(), slot, slot + 1)?;
                b.reshape(s, &dims)
            };
            (if nl { Some(pick(b, 0)?) } else { None }, if nr { Some(pick(b, 1)?) } else { None })
        }
    })
}

/// RMSNorm statistics over the last axis, recomputed from x: (x̂ = xρ, ρ) with
/// ρ = (mean x² + ε)^(-1/2) (docs/math.md §1.3).
fn rms_stats(b: &mut Builder, x: NodeId, eps: f64) -> Result<(NodeId, NodeId), GraphError> {
    let x2 = b.unary(UnaryOp::Square, x)?;
    let ms = b.mean_last(x2)?;
    let ms = b.affine(ms, 1.0, eps)?;
    let rho = b.unary(UnaryOp::Rsqrt, ms)?;
    Ok((b.mul(x, rho)?, rho))
}

/// RMSNorm VJP (docs/math.md §1.4) given the adjoint of x̂: dx = ρ (dx̂ − x̂ mean(x̂ ⊙ dx̂)).
fn rms_back(b: &mut Builder, xhat: NodeId, rho: NodeId, dxhat: NodeId) -> Result<NodeId, GraphError> {
    let p = b.mul(xhat, dxhat)?;
    let m = b.mean_last(p)?;
    let t = b.mul(xhat, m)?;
    let t = b.sub(dxhat, t)?;
    b.mul(rho, t)
}

/// LayerNorm statistics over the last axis, recomputed from x: (x̂ = (x − μ) r, r)
/// with r = (mean (x − μ)² + ε)^(-1/2).
fn ln_stats(b: &mut Builder, x: NodeId, eps: f64) -> Result<(NodeId, NodeId), GraphError> {
    let mu = b.mean_last(x)?;
    let c = b.sub(x, mu)?;
    let c2 = b.unary(UnaryOp::Square, c)?;
    let var = b.mean_last(c2)?;
    let var = b.affine(var, 1.0, eps)?;
    let rstd = b.unary(UnaryOp::Rsqrt, var)?;
    Ok((b.mul(c, rstd)?, rstd))
}

/// LayerNorm VJP given the adjoint of x̂: dx = r (dx̂ − mean(dx̂) − x̂ mean(x̂ ⊙ dx̂)).
fn ln_back(b: &mut Builder, xhat: NodeId, rstd: NodeId, dxhat: NodeId) -> Result<NodeId, GraphError> {
    let m1 = b.mean_last(dxhat)?;
    let p = b.mul(xhat, dxhat)?;
    let m2 = b.mean_last(p)?;
    let t = b.mul(xhat, m2)?;
    let t = b.add(t, m1)?;
    let t = b.sub(dxhat, t)?;
    b.mul(rstd, t)
}

/// Gain and bias adjoints of a normalization with a per-channel affine, inputs
/// (x, gain, bias): d gain = Σ dy ⊙ x̂, d bias = Σ dy over every leading axis.
fn affine_adjoints(
    b: &mut Builder,
    xs: &[NodeId],
    xhat: NodeId,
    dy: NodeId,
    needs: &[bool],
    out: &mut Adjoints,
) -> Result<(), GraphError> {
    if xs.len() < 3 {
        return Ok(());
    }
    if needs[1] {
        let prod = b.mul(dy, xhat)?;
        out[1] = Some(b.sum_to(prod, &b.shape(xs[1]))?);
    }
    if needs[2] {
        out[2] = Some(b.sum_to(dy, &b.shape(xs[2]))?);
    }
    Ok(())
}

/// NormProject (x [.., K], w [K, M], y = x̂ w): the first `centered` columns are
/// LayerNorm(x) w[:, ..centered], the rest RMSNorm(x) w[:, centered..] (docs/math.md §4.3,
/// §6.2–6.3). Works on x flattened to [N, K].
///
/// The normalized x̂ is never formed: with s the per-row scale (LayerNorm's 1/σ,
/// RMSNorm's 1/rms) and dŷ = s ⊙ dy, both parts share one product each way,
/// - dw = xᵀ dŷ, less `1 ⊗ Σ_t s_t μ_t dy_t` on the centred columns (x̂ = s (x − μ)), and
/// - dx = dŷ wᵀ − s mean_K(dx̂) − (x − μ) s² mean_K(x̂ ⊙ dx̂) − x ρ² mean_K(x̂' ⊙ dx̂'),
///
/// where the row means come from M-wide dot products instead of K-wide passes:
/// mean_K(dx̂) = dy · Σ_K w / K and mean_K(x̂ ⊙ dx̂) = dy · y / K (x̂ w = y). At the
/// xHC state width (K = N·C = 4096, M = 2N) that turns two `[N, K]` normalized
/// copies, two dx̂ products and two norm VJPs over K into one `K = 32` product,
/// one weight product over x and one elementwise pass (docs/math.md §6.9's traffic).
/// The centred term keeps `x − μ` (not `x s² − μ s²`) so a large mean does not
/// cancel.
#[allow(clippy::too_many_arguments)]
fn norm_project(
    b: &mut Builder,
    x: NodeId,
    w: NodeId,
    y: NodeId,
    dy: NodeId,
    eps: f64,
    centered: usize,
    needs: &[bool],
) -> Result<(Option<NodeId>, Option<NodeId>), GraphError> {
    let xdims = b.shape(x).dims().to_vec();
    let (k, m) = (b.shape(w).dims()[0], b.shape(w).dims()[1]);
    let n = b.shape(x).numel() / k;
    let x2 = b.reshape(x, &[n, k])?;
    let dy2 = b.reshape(dy, &[n, m])?;
    let y2 = b.reshape(y, &[n, m])?;
    // Per part: columns, row scale s, LayerNorm's row mean μ.
    let mut parts: Vec<(usize, usize, NodeId, Option<NodeId>)> = Vec::new();
    if centered > 0 {
        let mu = b.mean_last(x2)?;
        let c = b.sub(x2, mu)?;
        let c2 = b.unary(UnaryOp::Square, c)?;
        let var = b.mean_last(c2)?;
        let var = b.affine(var, 1.0, eps)?;
        parts.push((0, centered, b.unary(UnaryOp::Rsqrt, var)?, Some(mu)));
    }
    if centered < m {
        let x_sq = b.unary(UnaryOp::Square, x2)?;
        let ms = b.mean_last(x_sq)?;
        let ms = b.affine(ms, 1.0, eps)?;
        parts.push((centered, m, b.unary(UnaryOp::Rsqrt, ms)?, None));
    }
    let mut scaled = Vec::with_capacity(parts.len());
    for &(lo, hi, scale, _) in &parts {
        let dy_part = b.slice(dy2, 1, lo, hi)?;
        scaled.push(b.mul(dy_part, scale)?);
    }
    let dy_hat = if scaled.len() == 1 { scaled[0] } else { b.op(Op::Concat { axis: 1 }, &scaled)? };
    let mut dw = None;
    if needs[1] {
        let full = b.matmul_t(x2, dy_hat, true, false)?;
        let mut cols = Vec::with_capacity(parts.len());
        for (i, &(lo, hi, _, mu)) in parts.iter().enumerate() {
            let block = b.slice(full, 1, lo, hi)?;
            cols.push(match mu {
                Some(mu) => {
                    let shifted = b.mul(scaled[i], mu)?;
                    let correction = b.sum_to(shifted, &Shape::new(vec![1, hi - lo]))?;
                    b.sub(block, correction)?
                }
                None => block,
            });
        }
        dw = Some(if cols.len() == 1 { cols[0] } else { b.op(Op::Concat { axis: 1 }, &cols)? });
    }
    let mut dx = None;
    if needs[0] {
        let mut acc = b.matmul_t(dy_hat, w, false, true)?;
        for &(lo, hi, scale, mu) in &parts {
            let width = (hi - lo) as f64 / k as f64;
            let dy_part = b.slice(dy2, 1, lo, hi)?;
            let y_part = b.slice(y2, 1, lo, hi)?;
            // mean_K(x̂ ⊙ dx̂) = dy · y / K, times s².
            let dot = b.mul(dy_part, y_part)?;
            let dot = b.mean_last(dot)?;
            let dot = b.affine(dot, width, 0.0)?;
            let s2 = b.mul(scale, scale)?;
            let coef = b.mul(dot, s2)?;
            match mu {
                Some(mu) => {
                    // s · mean_K(dx̂) = s · dy · Σ_K w / K.
                    let w_part = b.slice(w, 1, lo, hi)?;
                    let w_sum = b.sum_to(w_part, &Shape::new(vec![1, hi - lo]))?;
                    let mean = b.mul(dy_part, w_sum)?;
                    let mean = b.mean_last(mean)?;
                    let mean = b.affine(mean, width, 0.0)?;
                    let mean = b.mul(mean, scale)?;
                    let centred = b.sub(x2, mu)?;
                    let term = b.mul(centred, coef)?;
                    acc = b.sub(acc, term)?;
                    acc = b.sub(acc, mean)?;
                }
                None => {
                    let term = b.mul(x2, coef)?;
                    acc = b.sub(acc, term)?;
                }
            }
        }
        dx = Some(b.reshape(acc, &xdims)?);
    }
    Ok((dx, dw))
}
