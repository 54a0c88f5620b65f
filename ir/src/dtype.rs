//! Element types. Defined once here and reused by every crate (DESIGN.md §4).

use serde::{Deserialize, Serialize};

/// The element type of a graph value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE single precision: the default for parameters and activations.
    F32,
    /// IEEE double precision: the reference executor's gradient-check mode.
    F64,
    /// bfloat16: residual state and matmul operands in GPU mixed precision (MATH.md §6.12).
    Bf16,
    /// 32-bit signed integers: token ids and routing indices.
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 => 8,
            DType::Bf16 => 2,
        }
    }

    /// Whether values of this type carry gradients.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// Short lowercase name used in dumps and generated code.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::Bf16 => "bf16",
            DType::I32 => "i32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
