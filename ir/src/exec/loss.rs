//! The loss op: mean softmax cross-entropy (docs/math.md §1.3 "Loss").

use super::{Float, Tensor};
use crate::Shape;

/// log Σ exp(x), with the max taken out first so large logits do not overflow.
pub(crate) fn log_sum_exp<T: Float>(x: &[T]) -> T {
    let m = x.iter().fold(T::from_f64(f64::NEG_INFINITY), |m, &v| m.maximum(v));
    m + x.iter().fold(T::zero(), |s, &v| s + (v - m).exp()).ln()
}

/// Mean over all positions of -log softmax(logits)[target] = logsumexp - logit[target].
/// A target outside 0..V is an error, not a silent zero.
pub(crate) fn softmax_cross_entropy<T: Float>(
    logits: &Tensor<T>,
    targets: &Tensor<i32>,
) -> Result<Tensor<T>, String> {
    let v = logits.shape.last();
    let mut total = T::zero();
    if v > 0 {
        for (row, &target) in logits.data.chunks_exact(v).zip(&targets.data) {
            let class = usize::try_from(target)
                .ok()
                .filter(|&c| c < v)
                .ok_or_else(|| format!("target {target} is out of range for {v} classes"))?;
            total += log_sum_exp(row) - row[class];
        }
    }
    let mean = total / T::from_f64(targets.data.len() as f64);
    Ok(Tensor { shape: Shape::scalar(), data: vec![mean] })
}
