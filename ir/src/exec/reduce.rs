//! Reductions over one axis and softmax over the last axis.

use super::{Float, Tensor};
use crate::graph::ReduceOp;
use crate::Shape;

/// Sum, max or mean over `axis`. The data layout is [outer, n, inner]; the loop runs
/// over n in the middle so the innermost loop is contiguous.
pub(crate) fn reduce<T: Float>(op: ReduceOp, x: &Tensor<T>, axis: usize, out_shape: &Shape) -> Tensor<T> {
    let dims = x.shape.dims();
    let outer: usize = dims[..axis].iter().product();
    let n = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let init = match op {
        ReduceOp::Max => T::from_f64(f64::NEG_INFINITY),
        ReduceOp::Sum | ReduceOp::Mean => T::zero(),
    };
    let mut data = vec![init; outer * inner];
    for o in 0..outer {
        let acc = &mut data[o * inner..(o + 1) * inner];
        for j in 0..n {
            let row = &x.data[(o * n + j) * inner..(o * n + j + 1) * inner];
            match op {
                ReduceOp::Max => acc.iter_mut().zip(row).for_each(|(a, &v)| *a = a.maximum(v)),
                ReduceOp::Sum | ReduceOp::Mean => acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v),
            }
        }
    }
    if op == ReduceOp::Mean {
        let count = T::from_f64(n as f64);
        data.iter_mut().for_each(|v| *v /= count);
    }
    Tensor { shape: out_shape.clone(), data }
}

/// Softmax of one row, written into `out`: exp(x - max) / sum, so large logits do
/// not overflow.
pub(crate) fn softmax_row<T: Float>(x: &[T], out: &mut [T]) {
    let m = x.iter().fold(T::from_f64(f64::NEG_INFINITY), |m, &v| m.maximum(v));
    let mut sum = T::zero();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - m).exp();
        sum += *o;
    }
    let inv = T::one() / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// Softmax over the last axis.
pub(crate) fn softmax<T: Float>(x: &Tensor<T>) -> Tensor<T> {
    let n = x.shape.last();
    let mut data = vec![T::zero(); x.data.len()];
    if n > 0 {
        for (xr, yr) in x.data.chunks_exact(n).zip(data.chunks_exact_mut(n)) {
            softmax_row(xr, yr);
        }
    }
    Tensor { shape: x.shape.clone(), data }
}
