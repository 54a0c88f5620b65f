//! `Kernel::structure_key`: kernels that differ only in names and comments
//! share a key (a Plan keeps one of them); any difference in the work they
//! do, or in how they bind their buffers, gives different keys.

use codegen::kernel::{f32, i64, item, Access, Grid, Kernel, KernelBuilder};
use ir::DType;

/// `y[i] = sum_j x[i * 4 + j] * scale + bias[0]`, with the given names.
fn scaled_sum(kernel: &str, x: &str, bias: &str, y: &str, var: &str, scale: f32, comment: &str) -> Kernel {
    let mut k = KernelBuilder::new(kernel, Grid::thread_per_item(8));
    let xb = k.param(x, DType::F32, Access::Read, 32);
    let bb = k.param(bias, DType::F32, Access::Read, 1);
    let yb = k.param(y, DType::F32, Access::Write, 8);
    k.comment(comment);
    let acc = k.var(var, f32(0.0));
    k.for_(&format!("{var}_j"), i64(0), i64(4), |b, j| {
        let v = b.let_(&format!("{var}_v"), xb.at(item() * i64(4) + j));
        b.assign(&acc, acc.clone() + v * f32(scale));
    });
    k.store(&yb, item(), acc + bb.at(i64(0)));
    k.finish()
}

#[test]
fn names_and_comments_do_not_change_the_key() {
    let a = scaled_sum("g001_sum", "n3", "n7", "n9", "acc4", 0.5, "%9 = sum");
    let b = scaled_sum("g020_sum", "n103", "n107", "n109", "acc104", 0.5, "%109 = sum");
    assert_ne!(a, b);
    assert_eq!(a.structure_key(), b.structure_key());
}

#[test]
fn different_work_changes_the_key() {
    let base = scaled_sum("k", "x", "b", "y", "acc", 0.5, "");
    let other_constant = scaled_sum("k", "x", "b", "y", "acc", 0.25, "");
    assert_ne!(base.structure_key(), other_constant.structure_key());

    let mut other_grid = base.clone();
    other_grid.grid = Grid::thread_per_item(9);
    assert_ne!(base.structure_key(), other_grid.structure_key());

    let mut other_length = base.clone();
    other_length.params[0].len = 64;
    assert_ne!(base.structure_key(), other_length.structure_key());

    let mut other_access = base.clone();
    other_access.params[2].access = Access::ReadWrite;
    assert_ne!(base.structure_key(), other_access.structure_key());
}

/// Swapping which parameter a load reads (x and bias trade positions in the
/// signature, the body unchanged) binds other buffers: a different key.
#[test]
fn parameter_positions_are_part_of_the_key() {
    let base = scaled_sum("k", "x", "b", "y", "acc", 0.5, "");
    let mut swapped = base.clone();
    swapped.params.swap(0, 1);
    assert_ne!(base.structure_key(), swapped.structure_key());
}
