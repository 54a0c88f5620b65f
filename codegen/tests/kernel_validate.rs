//! Malformed kernels are typed errors before anything is rendered.

mod common;

use codegen::kernel::{
    f32, f64, i32, i64, item, lane, Access, Combine, Expr, Grid, KernelBuilder, KernelError, MathFn, Ty,
    Unroll,
};
use codegen::render::{render_module, Dialect};
use ir::DType;

fn kernel(
    f: impl FnOnce(&mut KernelBuilder, &codegen::kernel::Buf, &codegen::kernel::Buf),
) -> codegen::kernel::Kernel {
    let mut k = KernelBuilder::new("k", Grid::thread_per_item(8));
    let x = k.param("x", DType::F32, Access::Read, 8);
    let y = k.param("y", DType::F32, Access::Write, 8);
    f(&mut k, &x, &y);
    k.finish()
}

#[test]
fn canonical_kernels_are_valid() {
    for k in common::kernels::all() {
        assert_eq!(k.validate(), Ok(()), "{}", k.name);
    }
}

#[test]
fn type_mismatches_are_reported() {
    let k = kernel(|k, x, y| k.store(y, item(), x.at(item()) + f64(1.0)));
    assert!(matches!(k.validate(), Err(KernelError::Type { got: Ty::F64, .. })), "{:?}", k.validate());
    let k = kernel(|k, x, y| k.store(y, i32(0), x.at(item())));
    assert!(matches!(k.validate(), Err(KernelError::Type { got: Ty::I32, .. })), "indices are i64");
    let k = kernel(|k, x, y| k.store(y, item(), x.at(item()).exp().max(i64(1))));
    assert!(matches!(k.validate(), Err(KernelError::Type { .. })));
    let k = kernel(|k, _, y| k.store(y, item(), i64(3).exp().cast(Ty::F32)));
    assert!(matches!(k.validate(), Err(KernelError::Type { got: Ty::I64, .. })), "math on floats only");
    let k = kernel(|k, x, y| k.store(y, item(), Expr::Call { f: MathFn::Max, args: vec![x.at(item())] }));
    assert!(matches!(k.validate(), Err(KernelError::Arity { expected: 2, got: 1, .. })));
}

#[test]
fn access_modes_are_enforced() {
    let k = kernel(|k, x, _| k.store(x, item(), f32(0.0)));
    assert!(matches!(k.validate(), Err(KernelError::Access { ref name, .. }) if name == "x"));
    let k = kernel(|k, _, y| k.store(y, item(), y.at(item())));
    assert!(matches!(k.validate(), Err(KernelError::Access { ref name, .. }) if name == "y"));
    let k = kernel(|k, _, y| k.accum(y, item(), f32(1.0)));
    assert!(matches!(k.validate(), Err(KernelError::Access { .. })), "+= reads the output");
}

#[test]
fn scopes_and_names_are_checked() {
    let k = kernel(|k, x, y| {
        k.for_("j", i64(0), i64(2), |b, j| {
            b.let_("t", x.at(j));
        });
        let t = Expr::Var { name: "t".into(), ty: Ty::F32 };
        k.store(y, item(), t);
    });
    assert!(
        matches!(k.validate(), Err(KernelError::Undeclared { ref name, .. }) if name == "t"),
        "loop scope ends"
    );
    let k = kernel(|k, x, y| {
        let a = k.let_("a", x.at(item()));
        k.assign(&a, f32(1.0));
        k.store(y, item(), a);
    });
    assert!(matches!(k.validate(), Err(KernelError::Access { .. })), "lets are immutable");
    let k = kernel(|k, x, _| {
        k.let_("x", x.at(item()));
    });
    assert!(matches!(k.validate(), Err(KernelError::Duplicate { .. })), "shadows a parameter");
    for bad in ["item", "widen_t", "2x", "a-b", "float"] {
        let k = kernel(|k, x, _| {
            k.let_(bad, x.at(item()));
        });
        assert!(matches!(k.validate(), Err(KernelError::InvalidName { .. })), "{bad}");
    }
    // Sibling scopes may reuse a name.
    let k = kernel(|k, x, y| {
        k.for_("j", i64(0), i64(1), |b, j| b.store(y, j, x.at(item())));
        k.for_("j", i64(1), i64(2), |b, j| b.store(y, j, x.at(item())));
    });
    assert_eq!(k.validate(), Ok(()));
    let k =
        kernel(|k, x, y| k.for_step("j", i64(0), i64(4), 0, Unroll::Auto, |b, j| b.store(y, &j, x.at(&j))));
    assert!(matches!(k.validate(), Err(KernelError::Step { step: 0, .. })));
}

#[test]
fn block_constructs_need_a_block_grid_at_top_level() {
    let k = kernel(|k, _, _| k.barrier());
    assert!(matches!(k.validate(), Err(KernelError::BlockOnly { .. })));
    let k = kernel(|k, _, y| k.store(y, lane(), f32(0.0)));
    assert!(matches!(k.validate(), Err(KernelError::BlockOnly { .. })));

    let mut b = KernelBuilder::new("b", Grid::block_per_item(2, 64));
    let x = b.param("x", DType::F32, Access::Read, 128);
    b.if_(lane().lt(i64(1)), |b| {
        b.block_reduce("s", Combine::Sum, x.at(lane()));
    });
    assert!(matches!(b.finish().validate(), Err(KernelError::NotTopLevel { .. })));

    let b = KernelBuilder::new("b", Grid::block_per_item(2, 96)).finish();
    assert!(matches!(b.validate(), Err(KernelError::Grid { .. })), "96 lanes is not a power of two");
    let b = KernelBuilder::new("b", Grid::ThreadPerItem { n: 2, block: 100 }).finish();
    assert!(matches!(b.validate(), Err(KernelError::Grid { .. })));
}

#[test]
fn modules_reject_duplicate_kernels_and_invalid_kernels() {
    let err =
        render_module(&[common::kernels::rmsnorm(), common::kernels::rmsnorm()], Dialect::C).unwrap_err();
    assert_eq!(err, KernelError::DuplicateKernel { name: "rmsnorm".into() });
    let bad = kernel(|k, x, _| k.store(x, item(), f32(0.0)));
    assert!(render_module(&[bad], Dialect::Cuda).is_err());
}

#[test]
fn grid_launch_shapes() {
    assert_eq!(Grid::ThreadPerItem { n: 1000, block: 256 }.cuda_blocks(), 4);
    assert_eq!(Grid::ThreadPerItem { n: 1024, block: 256 }.cuda_blocks(), 4);
    assert_eq!(Grid::block_per_item(7, 64).cuda_blocks(), 7);
    assert_eq!(Grid::block_per_item(7, 64).block_threads(), 64);
}
