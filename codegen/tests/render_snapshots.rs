//! Snapshot tests of the rendered C and CUDA for the canonical kernels.
//! Run with `WIDEN_UPDATE_SNAPSHOTS=1` to rewrite the expected files.

mod common;

use std::path::PathBuf;

use codegen::kernel::Kernel;
use codegen::render::{render_module, Dialect};

fn check(name: &str, kernels: &[Kernel], dialect: Dialect) {
    let ext = if dialect == Dialect::C { "c" } else { "cu" };
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots").join(format!("{name}.{ext}"));
    let got = render_module(kernels, dialect).expect("canonical kernels are valid");
    if std::env::var_os("WIDEN_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &got).expect("write snapshot");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("{}: {e} (run with WIDEN_UPDATE_SNAPSHOTS=1 to create it)", path.display())
    });
    assert!(got == want, "{} differs from the rendered output:\n{got}", path.display());
}

#[test]
fn rmsnorm_snapshots() {
    check("rmsnorm", &[common::kernels::rmsnorm()], Dialect::C);
    check("rmsnorm", &[common::kernels::rmsnorm()], Dialect::Cuda);
}

#[test]
fn elementwise_snapshots() {
    check("silu_mul", &[common::kernels::silu_mul()], Dialect::C);
    check("silu_mul", &[common::kernels::silu_mul()], Dialect::Cuda);
}

#[test]
fn unrolled_local_array_snapshots() {
    check("stream_mix", &[common::kernels::stream_mix()], Dialect::C);
    check("stream_mix", &[common::kernels::stream_mix()], Dialect::Cuda);
}

#[test]
fn bf16_snapshots() {
    check("bf16_convert", &[common::kernels::bf16_convert()], Dialect::C);
    check("bf16_convert", &[common::kernels::bf16_convert()], Dialect::Cuda);
}

#[test]
fn block_per_item_snapshots() {
    check("softmax", &[common::kernels::softmax()], Dialect::C);
    check("softmax", &[common::kernels::softmax()], Dialect::Cuda);
}

#[test]
fn rendering_is_deterministic() {
    let a = render_module(&common::kernels::all(), Dialect::C).unwrap();
    let b = render_module(&common::kernels::all(), Dialect::C).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.matches("#include").count(), 2, "one prelude per module");
}
