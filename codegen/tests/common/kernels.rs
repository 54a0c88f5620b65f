//! Canonical hand-built kernels shared by the codegen tests, each with the
//! plain Rust computation it must match.

use codegen::kernel::{
    f32, i64, item, lane, select, Access, Combine, Grid, Kernel, KernelBuilder, Ty, Unroll,
};
use ir::DType;

pub const ROWS: usize = 5;
pub const D: usize = 48;
pub const EPS: f32 = 1e-6;

/// RMSNorm per row: a reduction loop, then a scaling loop (docs/math.md §0.1 norm).
pub fn rmsnorm() -> Kernel {
    let mut k = KernelBuilder::new("rmsnorm", Grid::ThreadPerItem { n: ROWS, block: 128 });
    let x = k.param("x", DType::F32, Access::Read, ROWS * D);
    let g = k.param("g", DType::F32, Access::Read, D);
    let y = k.param("y", DType::F32, Access::Write, ROWS * D);
    k.comment("one row per item");
    let base = k.let_("base", item() * i64(D as i64));
    let ss = k.var("ss", f32(0.0));
    k.for_("j", i64(0), i64(D as i64), |b, j| {
        let v = b.let_("v", x.at(&base + &j));
        b.assign(&ss, &ss + &v * &v);
    });
    let r = k.let_("r", (ss / f32(D as f32) + f32(EPS)).rsqrt());
    k.for_("j", i64(0), i64(D as i64), |b, j| {
        b.store(&y, &base + &j, x.at(&base + &j) * &r * g.at(j));
    });
    k.finish()
}

pub fn rmsnorm_ref(x: &[f32], g: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for r in 0..ROWS {
        let row = &x[r * D..(r + 1) * D];
        let ss = row.iter().fold(0.0f32, |a, v| a + v * v);
        let inv = 1.0 / (ss / D as f32 + EPS).sqrt();
        for j in 0..D {
            y[r * D + j] = row[j] * inv * g[j];
        }
    }
    y
}

pub const N: usize = 1000;

/// SwiGLU-style elementwise kernel: silu(a) * b, with a clamp through `select`.
pub fn silu_mul() -> Kernel {
    let mut k = KernelBuilder::new("silu_mul", Grid::thread_per_item(N));
    let a = k.param("a", DType::F32, Access::Read, N);
    let b = k.param("b", DType::F32, Access::Read, N);
    let out = k.param("out", DType::F32, Access::Write, N);
    let av = k.let_("av", a.at(item()));
    let s = k.let_("s", &av / (f32(1.0) + (-&av).exp()));
    let v = k.let_("v", s * b.at(item()));
    k.store(&out, item(), select(v.clone().gt(f32(100.0)), f32(100.0), v));
    k.finish()
}

pub fn silu_mul_ref(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter()
        .zip(b)
        .map(|(&a, &b)| {
            let v = a / (1.0 + (-a).exp()) * b;
            if v > 100.0 {
                100.0
            } else {
                v
            }
        })
        .collect()
}

pub const TOKENS: usize = 6;
pub const S: usize = 4;
pub const C: usize = 8;

/// Stream mixing per token, `out[t, s, c] = sum_r h_mix[s, r] * h[t, r, c]`
/// (output-major mixing matrix, docs/math.md §0.2), through an unrolled local array.
pub fn stream_mix() -> Kernel {
    let mut k = KernelBuilder::new("stream_mix", Grid::ThreadPerItem { n: TOKENS, block: 128 });
    let h = k.param("h", DType::F32, Access::Read, TOKENS * S * C);
    let m = k.param("h_mix", DType::F32, Access::Read, S * S);
    let out = k.param("out", DType::F32, Access::Write, TOKENS * S * C);
    let base = k.let_("base", item() * i64((S * C) as i64));
    k.for_("c", i64(0), i64(C as i64), |b, c| {
        let acc = b.local_array("acc", Ty::F32, S);
        b.for_unrolled("s", i64(0), i64(S as i64), |b, s| b.store(&acc, s, f32(0.0)));
        b.for_unrolled("s", i64(0), i64(S as i64), |b, s| {
            b.for_unrolled("r", i64(0), i64(S as i64), |b, r| {
                let w = m.at(&s * i64(S as i64) + &r);
                b.accum(&acc, s.clone(), w * h.at(&base + &r * i64(C as i64) + &c));
            });
        });
        b.for_unrolled("s", i64(0), i64(S as i64), |b, s| {
            b.store(&out, &base + &s * i64(C as i64) + &c, acc.at(s));
        });
    });
    k.finish()
}

pub fn stream_mix_ref(h: &[f32], m: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; h.len()];
    for t in 0..TOKENS {
        for c in 0..C {
            for s in 0..S {
                let mut acc = 0.0f32;
                for r in 0..S {
                    acc += m[s * S + r] * h[t * S * C + r * C + c];
                }
                out[t * S * C + s * C + c] = acc;
            }
        }
    }
    out
}

pub const BF_N: usize = 300;

/// bf16 storage: widen a bf16 input, round an f32 output to bf16.
pub fn bf16_convert() -> Kernel {
    let mut k = KernelBuilder::new("bf16_convert", Grid::thread_per_item(BF_N));
    let xb = k.param("xb", DType::Bf16, Access::Read, BF_N);
    let xf = k.param("xf", DType::F32, Access::Read, BF_N);
    let yf = k.param("yf", DType::F32, Access::Write, BF_N);
    let yb = k.param("yb", DType::Bf16, Access::ReadWrite, BF_N);
    k.store(&yf, item(), xb.at(item()) * f32(2.0));
    k.store(&yb, item(), xf.at(item()));
    k.accum(&yb, item(), f32(1.0));
    k.finish()
}

/// bf16 round-to-nearest-even (NaN stays NaN), the rule the emitted conversions implement.
pub fn to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

pub const SM_ROWS: usize = 3;
pub const SM_D: usize = 200;
pub const LANES: u32 = 64;

/// Row softmax with one block per row: two block reductions (max, sum),
/// a lane-local value that lives across them, and a barrier.
pub fn softmax() -> Kernel {
    let t = i64::from(LANES);
    let mut k = KernelBuilder::new("softmax", Grid::block_per_item(SM_ROWS, LANES));
    let x = k.param("x", DType::F32, Access::Read, SM_ROWS * SM_D);
    let y = k.param("y", DType::F32, Access::Write, SM_ROWS * SM_D);
    let centered = k.param("centered", DType::F32, Access::Write, SM_ROWS * LANES as usize);
    let base = k.let_("base", item() * i64(SM_D as i64));
    let own = k.let_("own", x.at(&base + lane()));
    let mx = k.var("mx", f32(f32::NEG_INFINITY));
    k.for_step("j", lane(), i64(SM_D as i64), t, Unroll::Auto, |b, j| {
        b.assign(&mx, mx.clone().max(x.at(&base + &j)))
    });
    let m = k.block_reduce("m", Combine::Max, mx);
    let sum = k.var("sum", f32(0.0));
    k.for_step("j", lane(), i64(SM_D as i64), t, Unroll::Auto, |b, j| {
        b.assign(&sum, &sum + (x.at(&base + &j) - &m).exp());
    });
    let total = k.block_reduce("total", Combine::Sum, sum);
    k.store(&centered, item() * t + lane(), &own - &m);
    k.barrier();
    k.for_step("j", lane(), i64(SM_D as i64), t, Unroll::Auto, |b, j| {
        b.store(&y, &base + &j, (x.at(&base + &j) - &m).exp() / &total);
    });
    k.finish()
}

/// The reference softmax, with the sums in the kernel's tree order.
pub fn softmax_ref(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let t = LANES as usize;
    let mut y = vec![0.0; x.len()];
    let mut centered = vec![0.0; SM_ROWS * t];
    for r in 0..SM_ROWS {
        let row = &x[r * SM_D..(r + 1) * SM_D];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut part: Vec<f32> =
            (0..t).map(|l| (l..SM_D).step_by(t).fold(0.0, |a, j| a + (row[j] - m).exp())).collect();
        let mut s = t / 2;
        while s > 0 {
            for l in 0..s {
                part[l] += part[l + s];
            }
            s /= 2;
        }
        for j in 0..SM_D {
            y[r * SM_D + j] = (row[j] - m).exp() / part[0];
        }
        for l in 0..t {
            centered[r * t + l] = row[l] - m;
        }
    }
    (y, centered)
}

pub fn all() -> Vec<Kernel> {
    vec![rmsnorm(), silu_mul(), stream_mix(), bf16_convert(), softmax()]
}

/// Deterministic pseudo-random values in [-scale, scale).
pub fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}
