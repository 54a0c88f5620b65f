//! Building blocks of the device tests' hand-built Plans: kernels sized by each
//! test, buffer declarations and deterministic data.

use codegen::kernel::{f32, i64, item, lane, Access, Combine, Grid, Kernel, KernelBuilder, Unroll};
use codegen::plan::{BufferDecl, BufferId, BufferRole};
use ir::DType;

/// Deterministic values in [-scale, scale).
pub fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A buffer of the Plan with no graph node.
pub fn decl(id: usize, len: usize, dtype: DType, role: BufferRole) -> BufferDecl {
    BufferDecl { id: BufferId(id), len, dtype, role, node: None }
}

/// `y = x * s + bias[col]` over `rows * d` elements, `block` threads per CUDA block.
pub fn scale_bias(rows: usize, d: usize, block: u32) -> Kernel {
    let mut k = KernelBuilder::new("scale_bias", Grid::ThreadPerItem { n: rows * d, block });
    let x = k.param("x", DType::F32, Access::Read, rows * d);
    let s = k.param("s", DType::F32, Access::Read, 1);
    let b = k.param("b", DType::F32, Access::Read, d);
    let y = k.param("y", DType::F32, Access::Write, rows * d);
    let col = k.let_("col", item() % i64(d as i64));
    k.store(&y, item(), x.at(item()) * s.at(i64(0)) + b.at(col));
    k.finish()
}

/// RMS scaling of each of `rows` rows of `f`, one block of `lanes` lanes per row:
/// lanes stride over the row and a block reduction gives the sum of squares
/// (loop fission in C).
pub fn rms_rows(rows: usize, f: usize, lanes: u32, eps: f32) -> Kernel {
    let mut k = KernelBuilder::new("rms_rows", Grid::block_per_item(rows, lanes));
    let x = k.param("x", DType::F32, Access::Read, rows * f);
    let y = k.param("y", DType::F32, Access::Write, rows * f);
    let base = k.let_("base", item() * i64(f as i64));
    let acc = k.var("acc", f32(0.0));
    k.for_step("j", lane(), i64(f as i64), i64::from(lanes), Unroll::Auto, |b, j| {
        let v = b.let_("v", x.at(&base + &j));
        b.assign(&acc, &acc + &v * &v);
    });
    let ss = k.block_reduce("ss", Combine::Sum, acc);
    let r = k.let_("r", (ss / f32(f as f32) + f32(eps)).rsqrt());
    k.for_step("j", lane(), i64(f as i64), i64::from(lanes), Unroll::Auto, |b, j| {
        b.store(&y, &base + &j, x.at(&base + &j) * &r);
    });
    k.finish()
}
