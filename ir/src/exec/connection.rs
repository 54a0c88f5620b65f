//! Residual-stream connection ops: Sinkhorn-Knopp (docs/math.md §4.2), xHC routing TopK
//! (§6.2), temporal augmentation with modified Gram–Schmidt (§6.5) and the fused
//! norm-then-project NormProject (§4.3, §6.2–6.3).

use super::matmul::{gemm_into, MatRef};
use super::norms::{centered_stats, rms_scale};
use super::{Float, Tensor};
use crate::Shape;
use std::cmp::Ordering;

/// Sinkhorn-Knopp on one row-major n×n matrix (docs/math.md §4.2): M = exp(x - colmax),
/// then `iters` times divide each column by (its sum + eps), then each row by
/// (its sum + eps). Subtracting the column max is exact because the first step is a
/// column normalization; the last step is a row normalization, so with eps = 0 the
/// rows sum to 1 while the columns only approach it.
pub(crate) fn sinkhorn_matrix<T: Float>(x: &[T], n: usize, iters: usize, eps: T, out: &mut [T]) {
    for j in 0..n {
        let colmax = (0..n).fold(T::from_f64(f64::NEG_INFINITY), |m, i| m.maximum(x[i * n + j]));
        for i in 0..n {
            out[i * n + j] = (x[i * n + j] - colmax).exp();
        }
    }
    let mut colsum = vec![T::zero(); n];
    for _ in 0..iters {
        colsum.iter_mut().for_each(|s| *s = eps);
        for row in out.chunks_exact(n) {
            colsum.iter_mut().zip(row).for_each(|(s, &v)| *s += v);
        }
        for row in out.chunks_exact_mut(n) {
            row.iter_mut().zip(&colsum).for_each(|(v, &s)| *v /= s);
        }
        for row in out.chunks_exact_mut(n) {
            let sum = row.iter().fold(eps, |s, &v| s + v);
            row.iter_mut().for_each(|v| *v /= sum);
        }
    }
}

/// Sinkhorn over the last two (square) axes of x.
pub(crate) fn sinkhorn<T: Float>(x: &Tensor<T>, iters: usize, eps: f64) -> Tensor<T> {
    let n = x.shape.last();
    let mut data = vec![T::zero(); x.data.len()];
    if n > 0 {
        for (xm, om) in x.data.chunks_exact(n * n).zip(data.chunks_exact_mut(n * n)) {
            sinkhorn_matrix(xm, n, iters, T::from_f64(eps), om);
        }
    }
    Tensor { shape: x.shape.clone(), data }
}

/// Higher score first, NaN last, then lower index first: a total order, so the
/// selection is deterministic (docs/math.md §6.2: ties go to the lowest index).
fn routing_order<T: Float>(scores: &[T], a: usize, b: usize) -> Ordering {
    let (sa, sb) = (scores[a], scores[b]);
    let by_score = match (sa.is_nan(), sb.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => sb.partial_cmp(&sa).unwrap_or(Ordering::Equal),
    };
    by_score.then(a.cmp(&b))
}

/// xHC routing over the last axis (docs/math.md §6.2): indices 0..fixed, then the
/// k - fixed highest-scoring indices among fixed..N in ascending index order.
pub(crate) fn topk<T: Float>(
    scores: &Tensor<T>,
    k: usize,
    fixed: usize,
    out_shape: &Shape,
) -> Result<Tensor<i32>, String> {
    let n = scores.shape.last();
    let as_index = |i: usize| i32::try_from(i).map_err(|_| format!("index {i} does not fit in i32"));
    let mut data = Vec::with_capacity(out_shape.numel());
    if n > 0 {
        let mut rest: Vec<usize> = Vec::with_capacity(n);
        for row in scores.data.chunks_exact(n) {
            for i in 0..fixed {
                data.push(as_index(i)?);
            }
            rest.clear();
            rest.extend(fixed..n);
            rest.sort_by(|&a, &b| routing_order(row, a, b));
            rest.truncate(k - fixed);
            rest.sort_unstable();
            for &i in &rest {
                data.push(as_index(i)?);
            }
        }
    }
    Ok(Tensor { shape: out_shape.clone(), data })
}

/// Causal depthwise convolution over t of x [B, T, C] with kernel w [κ, C]
/// (docs/math.md §6.5): g[b, t, c] = Σ_{i < κ, i ≤ t} w[i, c] · x[b, t - i, c]; positions
/// before t = 0 count as zero.
pub(crate) fn causal_depthwise_conv<T: Float>(x: &Tensor<T>, w: &Tensor<T>) -> Vec<T> {
    let (b, t, c) = (x.shape.0[0], x.shape.0[1], x.shape.0[2]);
    let kappa = w.shape.0[0];
    let mut g = vec![T::zero(); b * t * c];
    for bi in 0..b {
        for ti in 0..t {
            let dst = &mut g[(bi * t + ti) * c..(bi * t + ti + 1) * c];
            for i in 0..kappa.min(ti + 1) {
                let src = &x.data[(bi * t + ti - i) * c..(bi * t + ti - i + 1) * c];
                let wi = &w.data[i * c..(i + 1) * c];
                for ((d, &s), &wv) in dst.iter_mut().zip(src).zip(wi) {
                    *d += wv * s;
                }
            }
        }
    }
    g
}

fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |s, (&x, &y)| s + x * y)
}

/// ε_abs of the Gram–Schmidt guard (docs/math.md §6.5 DECISION).
pub(crate) const GS_EPS_ABS: f64 = 1e-20;

/// Modified Gram–Schmidt for one token (docs/math.md §6.5): `ys` holds r rows of length
/// `out.len()`; row j is replaced by the residual of g_j after subtracting, one
/// after the other, its projections on out, y_0, ..., y_{j-1}, each with the
/// denominator ⟨v, v⟩ + eps_rel·⟨out, out⟩ + ε_abs.
pub(crate) fn gram_schmidt_token<T: Float>(out: &[T], ys: &mut [T], eps_rel: f64) {
    let c = out.len();
    if c == 0 {
        return;
    }
    let out_sq = dot(out, out);
    let guard = T::from_f64(eps_rel) * out_sq + T::from_f64(GS_EPS_ABS);
    let out_norm = out_sq + guard;
    for j in 0..ys.len() / c {
        let (done, rest) = ys.split_at_mut(j * c);
        let u = &mut rest[..c];
        let coef = dot(u, out) / out_norm;
        u.iter_mut().zip(out).for_each(|(x, &v)| *x -= coef * v);
        for v in done.chunks_exact(c) {
            let coef = dot(u, v) / (dot(v, v) + guard);
            u.iter_mut().zip(v).for_each(|(x, &vv)| *x -= coef * vv);
        }
    }
}

/// xHC temporal augmentation (docs/math.md §6.5): out [B, T, C] and kernels w_j [κ_j, C]
/// -> [B, T, r, C] holding v_2..v_{r+1}: the causal convolutions g_j, made orthogonal
/// per token to out and to each other when `gram_schmidt` is set.
pub(crate) fn temporal_augment<T: Float>(
    out: &Tensor<T>,
    kernels: &[&Tensor<T>],
    gram_schmidt: bool,
    eps_rel: f64,
) -> Tensor<T> {
    let (b, t, c) = (out.shape.0[0], out.shape.0[1], out.shape.0[2]);
    let r = kernels.len();
    let shape = Shape::new([b, t, r, c]);
    let mut y = vec![T::zero(); b * t * r * c];
    if c == 0 {
        return Tensor { shape, data: y };
    }
    for (j, w) in kernels.iter().enumerate() {
        let g = causal_depthwise_conv(out, w);
        for (token, row) in g.chunks_exact(c).enumerate() {
            let at = (token * r + j) * c;
            y[at..at + c].copy_from_slice(row);
        }
    }
    if gram_schmidt {
        for (o, ys) in out.data.chunks_exact(c).zip(y.chunks_exact_mut(r * c)) {
            gram_schmidt_token(o, ys, eps_rel);
        }
    }
    Tensor { shape, data: y }
}

/// out[.., j] = ρ · (Σ_i x_i w_ij - c_j · μ · Σ_i w_ij): the projection of the
/// normalized x computed from x itself (docs/math.md §4.3, §6.2). For the first
/// `centered` columns c_j = 1, μ = mean(x), ρ = (var(x) + eps)^-1/2 (LayerNorm
/// statistics); for the rest c_j = 0, ρ = (mean(x²) + eps)^-1/2 (RMSNorm).
pub(crate) fn norm_project<T: Float>(
    x: &Tensor<T>,
    w: &Tensor<T>,
    eps: f64,
    centered: usize,
    out_shape: &Shape,
) -> Tensor<T> {
    let (kk, m) = (w.shape.0[0], w.shape.0[1]);
    let rows: usize = out_shape.0[..out_shape.rank() - 1].iter().product();
    let mut data = vec![T::zero(); rows * m];
    if m == 0 || kk == 0 {
        return Tensor { shape: out_shape.clone(), data };
    }
    gemm_into(&mut data, MatRef::new(&x.data, 0, rows, kk, false), MatRef::new(&w.data, 0, kk, m, false));
    let mut colsum = vec![T::zero(); m];
    for wrow in w.data.chunks_exact(m) {
        colsum.iter_mut().zip(wrow).for_each(|(s, &v)| *s += v);
    }
    let eps = T::from_f64(eps);
    for (xr, orow) in x.data.chunks_exact(kk).zip(data.chunks_exact_mut(m)) {
        let (head, tail) = orow.split_at_mut(centered);
        if !head.is_empty() {
            let (mu, rho) = centered_stats(xr, eps);
            head.iter_mut().zip(&colsum).for_each(|(o, &s)| *o = rho * (*o - s * mu));
        }
        if !tail.is_empty() {
            let rho = rms_scale(xr, eps);
            tail.iter_mut().for_each(|o| *o *= rho);
        }
    }
    Tensor { shape: out_shape.clone(), data }
}
