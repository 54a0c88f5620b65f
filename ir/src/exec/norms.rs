//! Normalizations over the last axis: RMSNorm (docs/math.md §1.3), LayerNorm and
//! GroupNorm (docs/math.md §5.2). Variances are population variances (divide by the
//! count), as in the papers' PyTorch references.

use super::{Float, Tensor};

fn mean<T: Float>(x: &[T]) -> T {
    x.iter().fold(T::zero(), |s, &v| s + v) / T::from_f64(x.len() as f64)
}

fn mean_square<T: Float>(x: &[T]) -> T {
    x.iter().fold(T::zero(), |s, &v| s + v * v) / T::from_f64(x.len() as f64)
}

/// (mean, (var + eps)^-1/2) of one row: the statistics of LayerNorm and GroupNorm.
pub(crate) fn centered_stats<T: Float>(x: &[T], eps: T) -> (T, T) {
    let mu = mean(x);
    let var = x.iter().fold(T::zero(), |s, &v| s + (v - mu) * (v - mu)) / T::from_f64(x.len() as f64);
    (mu, T::one() / (var + eps).sqrt())
}

/// (mean(x^2) + eps)^-1/2 of one row: the RMSNorm scale ρ of docs/math.md §1.3–1.4.
pub(crate) fn rms_scale<T: Float>(x: &[T], eps: T) -> T {
    T::one() / (mean_square(x) + eps).sqrt()
}

/// x · (mean x² + ε)^-1/2 ⊙ g, per row of the last axis (docs/math.md §1.3).
pub(crate) fn rms_norm<T: Float>(x: &Tensor<T>, gain: Option<&Tensor<T>>, eps: f64) -> Tensor<T> {
    let d = x.shape.last();
    let eps = T::from_f64(eps);
    let mut out = x.clone();
    if d == 0 {
        return out;
    }
    for row in out.data.chunks_exact_mut(d) {
        let r = rms_scale(row, eps);
        match gain {
            Some(g) => row.iter_mut().zip(&g.data).for_each(|(v, &gi)| *v = *v * r * gi),
            None => row.iter_mut().for_each(|v| *v *= r),
        }
    }
    out
}

/// (x - mean) · (var + ε)^-1/2 over `groups` equal slices of each row, then the
/// per-channel affine (gain, bias) if given. LayerNorm is the one-group case.
pub(crate) fn group_norm<T: Float>(
    x: &Tensor<T>,
    groups: usize,
    affine: Option<(&Tensor<T>, &Tensor<T>)>,
    eps: f64,
) -> Tensor<T> {
    let d = x.shape.last();
    let eps = T::from_f64(eps);
    let mut out = x.clone();
    if d == 0 {
        return out;
    }
    let size = d / groups;
    for row in out.data.chunks_exact_mut(d) {
        for group in row.chunks_exact_mut(size) {
            let (mu, r) = centered_stats(group, eps);
            group.iter_mut().for_each(|v| *v = (*v - mu) * r);
        }
        if let Some((g, b)) = affine {
            for ((v, &gi), &bi) in row.iter_mut().zip(&g.data).zip(&b.data) {
                *v = *v * gi + bi;
            }
        }
    }
    out
}
