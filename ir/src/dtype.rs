//! Element types. Defined once here and reused by every crate (docs/architecture.md §4).

use serde::{Deserialize, Serialize};

/// The element type of a graph value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE single precision: the default for parameters and activations.
    F32,
    /// IEEE double precision: the reference executor's gradient-check mode.
    F64,
    /// bfloat16: residual state and matmul operands in GPU mixed precision (docs/math.md §6.12).
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

    /// The type arithmetic on values of this type is carried out in: `Bf16` is a storage
    /// type whose values are widened exactly to f32 before any arithmetic (docs/math.md §6.12),
    /// every other type computes in itself.
    pub fn compute(self) -> DType {
        match self {
            DType::Bf16 => DType::F32,
            other => other,
        }
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

/// Rounds an f32 to the nearest bfloat16 value, returned as the exactly representable f32
/// (docs/math.md §6.12): round to nearest, ties to even; NaN stays NaN (quieted); values beyond
/// the largest finite bf16 round to ±inf like any IEEE narrowing. Every backend rounds with
/// this rule, so the reference executor and the generated kernels agree bit for bit.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return f32::from_bits(x.to_bits() | 0x0040_0000);
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f32::from_bits(bits.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// [`round_bf16`] for the f64 reference executor: rounds an f64 directly onto the bf16
/// grid (8 significant bits, the f32 exponent range with gradual underflow), without a
/// double rounding through f32. Equal to `round_bf16(x as f32)` whenever `x` is an f32.
pub fn round_bf16_f64(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    // Binary exponent e with 2^e <= |x| < 2^(e+1), clamped at bf16's smallest normal
    // exponent (-126) so subnormals keep their fixed quantum 2^-133.
    let e = (((x.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(-126);
    let quantum = 2f64.powi(e - 7);
    let r = (x / quantum).round_ties_even() * quantum;
    if r.abs() >= 2f64.powi(128) {
        f64::INFINITY.copysign(x)
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::{round_bf16, round_bf16_f64};

    #[test]
    fn bf16_rounding_ties_to_even() {
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: the even neighbour 1 wins.
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: the even one is 1 + 2^-6.
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        // Just above the tie rounds up, just below rounds down.
        assert_eq!(round_bf16(f32::from_bits((1.0f32 + 2f32.powi(-8)).to_bits() + 1)), 1.0 + 2f32.powi(-7));
        assert_eq!(round_bf16(f32::from_bits((1.0f32 + 2f32.powi(-8)).to_bits() - 1)), 1.0);
        assert_eq!(round_bf16(-2.0 - 2f32.powi(-7)), -2.0);
    }

    #[test]
    fn bf16_rounding_keeps_nan_and_overflows_to_inf() {
        assert!(round_bf16(f32::NAN).is_nan());
        // A NaN whose payload sits only in the low 16 bits must not become inf.
        assert!(round_bf16(f32::from_bits(0x7f80_0001)).is_nan());
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(-f32::MAX), f32::NEG_INFINITY);
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        // The largest finite bf16 stays finite.
        let max_bf16 = f32::from_bits(0x7f7f_0000);
        assert_eq!(round_bf16(max_bf16), max_bf16);
        assert!(round_bf16_f64(f64::NAN).is_nan());
        assert_eq!(round_bf16_f64(f32::MAX as f64), f64::INFINITY);
        assert_eq!(round_bf16_f64(1e300), f64::INFINITY);
    }

    #[test]
    fn f64_rounding_agrees_with_f32_rounding_on_f32_values() {
        let mut bits = 0x1234_5678u32;
        let specials = [0x0000_8000u32, 0x0001_8000, 0x0080_0000, 0x3f80_8000, 0x3f81_8000, 0x7f7f_8000];
        for step in 0..20_000u32 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let b = if (step as usize) < specials.len() { specials[step as usize] } else { bits };
            let x = f32::from_bits(b);
            if x.is_nan() {
                continue;
            }
            let want = round_bf16(x);
            let got = round_bf16_f64(x as f64);
            assert_eq!(got, want as f64, "x = {x:e} ({b:#010x})");
        }
    }

    #[test]
    fn f64_rounding_avoids_double_rounding() {
        // 1 + 2^-8 + 2^-40 is above the bf16 tie at 1 + 2^-8, but rounds to the tie in f32.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(round_bf16_f64(x), 1.0 + 2f64.powi(-7));
        assert_eq!(round_bf16(x as f32), 1.0);
    }
}
