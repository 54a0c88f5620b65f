//! Reference implementations of the backward-only ops that autodiff appends to the
//! op set (docs/architecture.md §4): the derivatives of the composites whose backward is not
//! written with primitive ops. Each recomputes what it needs from the forward
//! inputs (docs/math.md §4.5: recompute rather than store), reusing the forward kernels.
//! `eval_op` in `exec/mod.rs` dispatches to them.

use super::attention::{rope_in_place, AttnDims};
use super::connection::{causal_depthwise_conv, GS_EPS_ABS};
use super::reduce::softmax_row;
use super::{Float, Tensor};

fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |s, (&x, &y)| s + x * y)
}

/// d q, d k or d v of causal attention (docs/math.md §1.3–1.4), recomputing the
/// probabilities row by row: dV += Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)),
/// dQ = scale · dS K, dK += scale · dSᵀ Q, then the inverse RoPE rotation (its VJP).
pub(crate) fn causal_attention_grad<T: Float>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    dout: &Tensor<T>,
    scale: f64,
    rope_base: Option<f64>,
    wrt: usize,
) -> Result<Tensor<T>, String> {
    let d = AttnDims::new(q.shape.dims(), k.shape.dims());
    let (mut qr, mut kr) = (q.data.clone(), k.data.clone());
    if let Some(base) = rope_base {
        rope_in_place(&mut qr, d.t, d.h, d.dh, base, false)?;
        rope_in_place(&mut kr, d.t, d.hkv, d.dh, base, false)?;
    }
    let scale = T::from_f64(scale);
    let (mut dq, mut dk, mut dv) =
        (vec![T::zero(); q.data.len()], vec![T::zero(); k.data.len()], vec![T::zero(); v.data.len()]);
    let (mut scores, mut probs, mut dp) = (vec![T::zero(); d.t], vec![T::zero(); d.t], vec![T::zero(); d.t]);
    let q_row = |b: usize, t: usize, h: usize| ((b * d.t + t) * d.h + h) * d.dh;
    let kv_row = |b: usize, t: usize, g: usize| ((b * d.t + t) * d.hkv + g) * d.dh;
    for b in 0..d.b {
        for h in 0..d.h {
            let g = d.kv_head(h);
            for t in 0..d.t {
                let qa = q_row(b, t, h);
                let (qrow, dorow) = (&qr[qa..qa + d.dh], &dout.data[qa..qa + d.dh]);
                for (tp, s) in scores[..=t].iter_mut().enumerate() {
                    let ka = kv_row(b, tp, g);
                    *s = dot(qrow, &kr[ka..ka + d.dh]) * scale;
                }
                softmax_row(&scores[..=t], &mut probs[..=t]);
                for (tp, p) in dp[..=t].iter_mut().enumerate() {
                    let va = kv_row(b, tp, g);
                    *p = dot(dorow, &v.data[va..va + d.dh]);
                }
                let centre = probs[..=t].iter().zip(&dp[..=t]).fold(T::zero(), |s, (&p, &g)| s + p * g);
                for tp in 0..=t {
                    let ka = kv_row(b, tp, g);
                    let ds = probs[tp] * (dp[tp] - centre) * scale;
                    for i in 0..d.dh {
                        dv[ka + i] += probs[tp] * dorow[i];
                        dq[qa + i] += ds * kr[ka + i];
                        dk[ka + i] += ds * qrow[i];
                    }
                }
            }
        }
    }
    if let Some(base) = rope_base {
        rope_in_place(&mut dq, d.t, d.h, d.dh, base, true)?;
        rope_in_place(&mut dk, d.t, d.hkv, d.dh, base, true)?;
    }
    let (shape, data) = match wrt {
        0 => (&q.shape, dq),
        1 => (&k.shape, dk),
        _ => (&v.shape, dv),
    };
    Ok(Tensor { shape: shape.clone(), data })
}

/// VJP of Sinkhorn-Knopp on one n×n matrix, unrolled through the recomputed finite
/// iteration (docs/math.md §4.5): row step (G − rowsum(G ⊙ Y)) / ρ, column step
/// (G − colsum(G ⊙ Y)) / κ, exp step G ⊙ M⁽⁰⁾; the column-max shift sends minus the
/// column sum of G ⊙ M⁽⁰⁾ to the first maximum of each column (with eps > 0 the
/// shift is not exactly cancelled by the first column normalization).
fn sinkhorn_grad_matrix<T: Float>(x: &[T], dout: &[T], n: usize, iters: usize, eps: T, dx: &mut [T]) {
    let mut argmax = vec![0; n];
    let mut states = vec![vec![T::zero(); n * n]];
    for j in 0..n {
        for i in 1..n {
            if x[i * n + j] > x[argmax[j] * n + j] {
                argmax[j] = i;
            }
        }
        let colmax = x[argmax[j] * n + j];
        for i in 0..n {
            states[0][i * n + j] = (x[i * n + j] - colmax).exp();
        }
    }
    for step in 0..2 * iters {
        let mut next = states[step].clone();
        normalize(&mut next, n, eps, step % 2 == 0);
        states.push(next);
    }
    let mut g = dout.to_vec();
    for step in (0..2 * iters).rev() {
        let (input, output) = (&states[step], &states[step + 1]);
        let by_column = step % 2 == 0;
        for a in 0..n {
            let at = |b: usize| if by_column { b * n + a } else { a * n + b };
            let sum = (0..n).fold(eps, |s, b| s + input[at(b)]);
            let centre = (0..n).fold(T::zero(), |s, b| s + g[at(b)] * output[at(b)]);
            for b in 0..n {
                g[at(b)] = (g[at(b)] - centre) / sum;
            }
        }
    }
    for j in 0..n {
        let mut shift = T::zero();
        for i in 0..n {
            let v = g[i * n + j] * states[0][i * n + j];
            dx[i * n + j] = v;
            shift += v;
        }
        dx[argmax[j] * n + j] -= shift;
    }
}

/// One Sinkhorn half-step in place: divide each column (or row) by its sum + eps.
fn normalize<T: Float>(m: &mut [T], n: usize, eps: T, by_column: bool) {
    for a in 0..n {
        let at = |b: usize| if by_column { b * n + a } else { a * n + b };
        let sum = (0..n).fold(eps, |s, b| s + m[at(b)]);
        for b in 0..n {
            m[at(b)] /= sum;
        }
    }
}

/// d logits of Sinkhorn over the last two axes.
pub(crate) fn sinkhorn_grad<T: Float>(x: &Tensor<T>, dout: &Tensor<T>, iters: usize, eps: f64) -> Tensor<T> {
    let n = x.shape.last();
    let mut data = vec![T::zero(); x.data.len()];
    if n > 0 {
        let blocks = x.data.chunks_exact(n * n).zip(dout.data.chunks_exact(n * n));
        for ((xm, gm), dm) in blocks.zip(data.chunks_exact_mut(n * n)) {
            sinkhorn_grad_matrix(xm, gm, n, iters, T::from_f64(eps), dm);
        }
    }
    Tensor { shape: x.shape.clone(), data }
}

/// The forward record of modified Gram–Schmidt for one token (docs/math.md §6.5): for
/// row j, the running residual before each projection and that projection's
/// coefficient and denominator.
struct GsRecord<T> {
    /// v_0 = out, v_1..v_r = the finished rows.
    v: Vec<Vec<T>>,
    /// u[j][i]: row j's residual before projecting on v_i (i ≤ j).
    u: Vec<Vec<Vec<T>>>,
    coef: Vec<Vec<T>>,
    den: Vec<Vec<T>>,
}

fn gram_schmidt_record<T: Float>(out: &[T], g: &[Vec<T>], guard: T) -> GsRecord<T> {
    let mut rec = GsRecord { v: vec![out.to_vec()], u: Vec::new(), coef: Vec::new(), den: Vec::new() };
    for gj in g {
        let (mut us, mut coefs, mut dens) = (Vec::new(), Vec::new(), Vec::new());
        let mut u = gj.clone();
        for v in &rec.v {
            let den = dot(v, v) + guard;
            let coef = dot(&u, v) / den;
            us.push(u.clone());
            u.iter_mut().zip(v).for_each(|(x, &vv)| *x -= coef * vv);
            coefs.push(coef);
            dens.push(den);
        }
        rec.v.push(u);
        rec.u.push(us);
        rec.coef.push(coefs);
        rec.den.push(dens);
    }
    rec
}

/// Reverse of `gram_schmidt_record` for one token: from the adjoints of v_1..v_r
/// (`dy`, r rows of C) to the adjoints of g_1..g_r (written into `dg`) and the direct
/// adjoint of out (returned), including the guard's ε_rel·⟨out, out⟩ term.
fn gram_schmidt_back<T: Float>(rec: &GsRecord<T>, dy: &[T], eps_rel: T, dg: &mut [Vec<T>]) -> Vec<T> {
    let c = rec.v[0].len();
    let mut dv: Vec<Vec<T>> = vec![vec![T::zero(); c]];
    dv.extend(dy.chunks_exact(c).map(<[T]>::to_vec));
    let mut d_guard = T::zero();
    for j in (0..dg.len()).rev() {
        let mut du = dv[j + 1].clone();
        for i in (0..=j).rev() {
            // u_{i+1} = u_i − coef·v_i, coef = ⟨u_i, v_i⟩ / (⟨v_i, v_i⟩ + guard).
            let (v, u, coef, den) = (&rec.v[i], &rec.u[j][i], rec.coef[j][i], rec.den[j][i]);
            let dcoef = -dot(&du, v);
            let ddot = dcoef / den;
            let dden = -dcoef * coef / den;
            for e in 0..c {
                dv[i][e] += ddot * u[e] + T::from_f64(2.0) * dden * v[e] - coef * du[e];
                du[e] += ddot * v[e];
            }
            d_guard += dden;
        }
        dg[j] = du;
    }
    let scale = T::from_f64(2.0) * eps_rel * d_guard;
    dv[0].iter().zip(&rec.v[0]).map(|(&d, &o)| d + scale * o).collect()
}

/// Gradient of TemporalAugment (docs/math.md §6.5, §6.8) with respect to input `wrt`
/// (0 = out, j = w_j): convolutions and Gram–Schmidt are recomputed, Gram–Schmidt is
/// reversed per token, and each causal convolution's backward is a correlation with
/// its kernel (d out[t − i] += w[i] ⊙ d g[t], d w[i] += Σ d g[t] ⊙ out[t − i]).
pub(crate) fn temporal_augment_grad<T: Float>(
    out: &Tensor<T>,
    kernels: &[&Tensor<T>],
    dy: &Tensor<T>,
    gram_schmidt: bool,
    eps_rel: f64,
    wrt: usize,
) -> Tensor<T> {
    let (b, t, c) = (out.shape.0[0], out.shape.0[1], out.shape.0[2]);
    let r = kernels.len();
    let tokens = b * t;
    // dg[j][token * c + e]: adjoint of the convolution outputs.
    let mut dg = vec![vec![T::zero(); tokens * c]; r];
    let mut dout = vec![T::zero(); tokens * c];
    if c > 0 {
        if gram_schmidt {
            let convs: Vec<Vec<T>> = kernels.iter().map(|w| causal_depthwise_conv(out, w)).collect();
            let eps_rel = T::from_f64(eps_rel);
            for token in 0..tokens {
                let o = &out.data[token * c..(token + 1) * c];
                let g: Vec<Vec<T>> = convs.iter().map(|gj| gj[token * c..(token + 1) * c].to_vec()).collect();
                let guard = eps_rel * dot(o, o) + T::from_f64(GS_EPS_ABS);
                let rec = gram_schmidt_record(o, &g, guard);
                let mut dgt = vec![Vec::new(); r];
                let direct =
                    gram_schmidt_back(&rec, &dy.data[token * r * c..(token + 1) * r * c], eps_rel, &mut dgt);
                dout[token * c..(token + 1) * c].copy_from_slice(&direct);
                for (j, d) in dgt.into_iter().enumerate() {
                    dg[j][token * c..(token + 1) * c].copy_from_slice(&d);
                }
            }
        } else {
            for token in 0..tokens {
                for (j, d) in dg.iter_mut().enumerate() {
                    let at = (token * r + j) * c;
                    d[token * c..(token + 1) * c].copy_from_slice(&dy.data[at..at + c]);
                }
            }
        }
    }
    let mut dws: Vec<Vec<T>> = kernels.iter().map(|w| vec![T::zero(); w.data.len()]).collect();
    for ((w, d), dw) in kernels.iter().zip(&dg).zip(&mut dws) {
        let kappa = w.shape.0[0];
        for bi in 0..b {
            for ti in 0..t {
                let src = (bi * t + ti) * c;
                for i in 0..kappa.min(ti + 1) {
                    let dst = (bi * t + ti - i) * c;
                    for e in 0..c {
                        dout[dst + e] += w.data[i * c + e] * d[src + e];
                        dw[i * c + e] += d[src + e] * out.data[dst + e];
                    }
                }
            }
        }
    }
    match wrt {
        0 => Tensor { shape: out.shape.clone(), data: dout },
        j => Tensor { shape: kernels[j - 1].shape.clone(), data: dws.swap_remove(j - 1) },
    }
}
