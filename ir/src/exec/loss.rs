//! The loss ops: mean softmax cross-entropy (docs/math.md §1.3 "Loss"), alone and fused
//! with the output projection (§1.7).

use super::{Float, Tensor};
use crate::Shape;

/// log Σ exp(x), with the max taken out first so large logits do not overflow.
pub(crate) fn log_sum_exp<T: Float>(x: &[T]) -> T {
    let m = x.iter().fold(T::from_f64(f64::NEG_INFINITY), |m, &v| m.maximum(v));
    m + x.iter().fold(T::zero(), |s, &v| s + (v - m).exp()).ln()
}

/// The class a target names, or the error for one outside `0..v`.
fn target_class(target: i32, v: usize) -> Result<usize, String> {
    usize::try_from(target)
        .ok()
        .filter(|&c| c < v)
        .ok_or_else(|| format!("target {target} is out of range for {v} classes"))
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
            let class = target_class(target, v)?;
            total += log_sum_exp(row) - row[class];
        }
    }
    let mean = total / T::from_f64(targets.data.len() as f64);
    Ok(Tensor { shape: Shape::scalar(), data: vec![mean] })
}

/// The logits of the fused vocabulary loss, `scale · x·w` over x's rows
/// (docs/math.md §1.7), whole: the reference is the oracle of the chunked kernels.
fn vocab_logits<T: Float>(x: &Tensor<T>, w: &Tensor<T>, trans_b: bool, scale: f64) -> (Tensor<T>, usize) {
    let d = x.shape.last();
    let rows = x.data.len().checked_div(d).unwrap_or(0);
    let v = if trans_b { w.shape.dims()[0] } else { w.shape.dims()[1] };
    let flat = Tensor { shape: Shape::new([rows, d]), data: x.data.clone() };
    let mut logits = super::matmul::matmul(&flat, w, false, trans_b, &Shape::new([rows, v]));
    let s = T::from_f64(scale);
    for l in &mut logits.data {
        *l *= s;
    }
    (logits, v)
}

/// `LinearCrossEntropy`: [`softmax_cross_entropy`] of `scale · x·w` (docs/math.md §1.7).
pub(crate) fn linear_cross_entropy<T: Float>(
    x: &Tensor<T>,
    w: &Tensor<T>,
    targets: &Tensor<i32>,
    trans_b: bool,
    scale: f64,
) -> Result<Tensor<T>, String> {
    let (logits, _) = vocab_logits(x, w, trans_b, scale);
    softmax_cross_entropy(&logits, targets)
}

/// `LinearCrossEntropyGrad`: with g = (softmax(l) − onehot(target)) · scale · dy / rows,
/// d x = g·wᵀ (`trans_b`: g·w) and d w = xᵀ·g (`trans_b`: gᵀ·x) (docs/math.md §1.7).
pub(crate) fn linear_cross_entropy_grad<T: Float>(
    x: &Tensor<T>,
    w: &Tensor<T>,
    targets: &Tensor<i32>,
    dy: &Tensor<T>,
    trans_b: bool,
    scale: f64,
    wrt: usize,
) -> Result<Tensor<T>, String> {
    let (mut g, v) = vocab_logits(x, w, trans_b, scale);
    let d = x.shape.last();
    let rows = targets.data.len();
    let factor =
        T::from_f64(scale) * dy.data.first().copied().unwrap_or_else(T::zero) / T::from_f64(rows as f64);
    if v > 0 {
        for (row, &target) in g.data.chunks_exact_mut(v).zip(&targets.data) {
            let class = target_class(target, v)?;
            let logits = row.to_vec();
            super::reduce::softmax_row(&logits, row);
            row[class] -= T::one();
            for p in row.iter_mut() {
                *p *= factor;
            }
        }
    }
    let flat = Tensor { shape: Shape::new([rows, d]), data: x.data.clone() };
    Ok(match wrt {
        0 => {
            let dx = super::matmul::matmul(&g, w, false, !trans_b, &Shape::new([rows, d]));
            Tensor { shape: x.shape.clone(), data: dx.data }
        }
        _ if trans_b => super::matmul::matmul(&g, &flat, true, false, &w.shape),
        _ => super::matmul::matmul(&flat, &g, true, false, &w.shape),
    })
}
