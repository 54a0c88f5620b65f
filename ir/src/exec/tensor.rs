//! Host tensors for the reference executor.

use crate::Shape;

mod sealed {
    /// Keeps [`super::Float`] to f32 and f64: the matmul goes through the `gemm`
    /// crate, which only has kernels for those two.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A float element type the reference executor runs in (f32 for training, f64 for
/// gradient checks). Implemented for f32 and f64 only.
pub trait Float:
    sealed::Sealed
    + Copy
    + Default
    + PartialOrd
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + std::ops::DivAssign
{
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn abs(self) -> Self;
    fn is_nan(self) -> bool;
    /// The nearest bf16 value, ties to even (docs/math.md §6.12; [`crate::dtype::round_bf16`]).
    fn round_bf16(self) -> Self;

    fn zero() -> Self {
        Self::default()
    }

    fn one() -> Self {
        Self::from_f64(1.0)
    }

    /// The larger of two values (IEEE 754-2019 `maximum`): NaN in either operand gives
    /// NaN, so a NaN is never hidden by a max or a max-reduction.
    fn maximum(self, other: Self) -> Self {
        if self.is_nan() || self >= other {
            self
        } else {
            other
        }
    }

    /// 1 / (1 + e^-x): saturates to 0 and 1 without overflow trouble (e^-x = inf gives 0).
    fn sigmoid(self) -> Self {
        Self::one() / (Self::one() + (-self).exp())
    }
}

macro_rules! impl_float {
    ($t:ty, $round_bf16:path) => {
        impl Float for $t {
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn round_bf16(self) -> Self {
                $round_bf16(self)
            }
        }
    };
}

impl_float!(f32, crate::dtype::round_bf16);
impl_float!(f64, crate::dtype::round_bf16_f64);

/// A dense row-major tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    pub shape: Shape,
    pub data: Vec<T>,
}

impl<T: Clone + Default> Tensor<T> {
    pub fn new(shape: Shape, data: Vec<T>) -> Self {
        assert_eq!(shape.numel(), data.len(), "tensor data does not match shape {shape}");
        Tensor { shape, data }
    }

    pub fn zeros(shape: Shape) -> Self {
        let n = shape.numel();
        Tensor { shape, data: vec![T::default(); n] }
    }

    pub fn full(shape: Shape, value: T) -> Self {
        let n = shape.numel();
        Tensor { shape, data: vec![value; n] }
    }
}

impl<T: Float> Tensor<T> {
    /// A tensor from f64 values (test fixtures and gradient checks build tensors this way).
    pub fn from_f64(shape: Shape, data: &[f64]) -> Self {
        Tensor::new(shape, data.iter().map(|&v| T::from_f64(v)).collect())
    }

    /// The values widened to f64.
    pub fn to_f64(&self) -> Vec<f64> {
        self.data.iter().map(|v| v.to_f64()).collect()
    }
}

/// A value flowing through the graph: floats, or i32 ids / indices.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<T> {
    Float(Tensor<T>),
    Int(Tensor<i32>),
}

impl<T> Value<T> {
    pub fn shape(&self) -> &Shape {
        match self {
            Value::Float(t) => &t.shape,
            Value::Int(t) => &t.shape,
        }
    }

    pub fn as_float(&self) -> Option<&Tensor<T>> {
        match self {
            Value::Float(t) => Some(t),
            Value::Int(_) => None,
        }
    }

    pub fn as_int(&self) -> Option<&Tensor<i32>> {
        match self {
            Value::Int(t) => Some(t),
            Value::Float(_) => None,
        }
    }

    /// The float tensor, consuming the value.
    pub fn into_float(self) -> Option<Tensor<T>> {
        match self {
            Value::Float(t) => Some(t),
            Value::Int(_) => None,
        }
    }

    /// The kind of value, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Float(_) => "float",
            Value::Int(_) => "i32",
        }
    }
}
