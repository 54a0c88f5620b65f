//! Elementwise ops: unary functions, `Affine`, and binaries with NumPy broadcasting.

use super::movement::{broadcast_strides, StridedIter};
use super::{Float, Tensor};
use crate::graph::{BinaryOp, UnaryOp};
use crate::{DType, Shape};

/// The scalar function of a unary op.
pub(crate) fn unary_fn<T: Float>(op: UnaryOp) -> fn(T) -> T {
    match op {
        UnaryOp::Neg => |v: T| -v,
        UnaryOp::Exp => T::exp,
        UnaryOp::Log => T::ln,
        UnaryOp::Tanh => T::tanh,
        UnaryOp::Sigmoid => T::sigmoid,
        UnaryOp::Silu => |v: T| v * v.sigmoid(),
        UnaryOp::Sqrt => T::sqrt,
        UnaryOp::Rsqrt => |v: T| T::one() / v.sqrt(),
        UnaryOp::Recip => |v: T| T::one() / v,
        UnaryOp::Square => |v: T| v * v,
    }
}

/// The scalar function of a binary op. `Max` propagates NaN from either side.
pub(crate) fn binary_fn<T: Float>(op: BinaryOp) -> fn(T, T) -> T {
    match op {
        BinaryOp::Add => |a: T, b: T| a + b,
        BinaryOp::Sub => |a: T, b: T| a - b,
        BinaryOp::Mul => |a: T, b: T| a * b,
        BinaryOp::Div => |a: T, b: T| a / b,
        BinaryOp::Max => T::maximum,
    }
}

pub(crate) fn unary<T: Float>(op: UnaryOp, x: &Tensor<T>) -> Tensor<T> {
    let f = unary_fn::<T>(op);
    Tensor { shape: x.shape.clone(), data: x.data.iter().map(|&v| f(v)).collect() }
}

/// Cast to `to` (docs/math.md §6.12). Values of Bf16 nodes are held as their exact values in T,
/// so a cast to Bf16 rounds each value onto the bf16 grid (in f64 directly, without a
/// double rounding through f32) and a cast to F32 or F64 keeps the value: the executor
/// runs F32 nodes in T, and widening a bf16 value is exact.
pub(crate) fn cast<T: Float>(x: &Tensor<T>, to: DType) -> Tensor<T> {
    match to {
        DType::Bf16 => {
            Tensor { shape: x.shape.clone(), data: x.data.iter().map(|&v| v.round_bf16()).collect() }
        }
        _ => x.clone(),
    }
}

/// mul * x + add, with the constants rounded to T once.
pub(crate) fn affine<T: Float>(x: &Tensor<T>, mul: f64, add: f64) -> Tensor<T> {
    let (m, a) = (T::from_f64(mul), T::from_f64(add));
    Tensor { shape: x.shape.clone(), data: x.data.iter().map(|&v| m * v + a).collect() }
}

/// f(a, b) with both operands broadcast to `out` (NumPy rules).
pub(crate) fn binary<T: Float>(op: BinaryOp, a: &Tensor<T>, b: &Tensor<T>, out: &Shape) -> Tensor<T> {
    let f = binary_fn::<T>(op);
    let data = if a.shape == b.shape {
        a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect()
    } else if b.data.len() == 1 && a.shape == *out {
        let y = b.data[0];
        a.data.iter().map(|&x| f(x, y)).collect()
    } else {
        let sa = broadcast_strides(a.shape.dims(), &a.shape.strides(), out.dims());
        let sb = broadcast_strides(b.shape.dims(), &b.shape.strides(), out.dims());
        StridedIter::new(out.dims(), &sa, 0)
            .zip(StridedIter::new(out.dims(), &sb, 0))
            .map(|(i, j)| f(a.data[i], b.data[j]))
            .collect()
    };
    Tensor { shape: out.clone(), data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_propagates_nan_from_either_operand() {
        let f = binary_fn::<f64>(BinaryOp::Max);
        assert!(f(f64::NAN, 1.0).is_nan() && f(1.0, f64::NAN).is_nan());
        assert_eq!(f(2.0, -3.0), 2.0);
    }

    #[test]
    fn sigmoid_saturates_without_nan() {
        let f = unary_fn::<f32>(UnaryOp::Sigmoid);
        assert_eq!(f(-1000.0), 0.0);
        assert_eq!(f(1000.0), 1.0);
        assert!((f(0.0) - 0.5).abs() < 1e-7);
    }
}
