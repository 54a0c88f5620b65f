//! Host tensors for the reference executor.

use crate::Shape;

/// A float element type the reference executor runs in (f32 for training, f64 for
/// gradient checks).
pub trait Float:
    Copy
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
{
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Float for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Float for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}

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
}
