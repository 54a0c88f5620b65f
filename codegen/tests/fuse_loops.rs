//! The item-level loop fusion pass: which loops it merges, which it must
//! not, and that a merged kernel computes bit for bit what the unfused one
//! does (both compiled by the system C compiler).

use std::ffi::c_void;

use codegen::cc::Compiler;
use codegen::kernel::{f32, fuse_loops, i64, item, Access, Expr, Grid, Kernel, KernelBuilder, Stmt, Ty};
use ir::DType;

const ROWS: usize = 37;
const N: usize = 64;

fn loops(stmts: &[Stmt]) -> usize {
    stmts.iter().filter(|s| matches!(s, Stmt::For { .. })).count()
}

fn arrays(stmts: &[Stmt]) -> usize {
    stmts.iter().filter(|s| matches!(s, Stmt::LocalArray { .. })).count()
}

/// `t = x·x; u = t + 1; y = u·t` as three loops through two local arrays, the
/// item emitter's shape, followed by a row sum of `t` (a non-elementwise
/// reader that keeps `t` an array).
fn chain() -> Kernel {
    let mut k = KernelBuilder::new("chain", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::Write, ROWS * N);
    let s = k.param("s", DType::F32, Access::Write, ROWS);
    let t = k.local_array("t", Ty::F32, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| {
        let v = b.let_("v", x.at(item() * i64(N as i64) + l.clone()));
        b.store(&t, l, v.clone() * v);
    });
    let u = k.local_array("u", Ty::F32, N);
    k.for_("l1", i64(0), i64(N as i64), |b, l| b.store(&u, l.clone(), t.at(l) + f32(1.0)));
    k.for_("l2", i64(0), i64(N as i64), |b, l| {
        let g = b.let_("g", item() * i64(N as i64) + l.clone());
        b.store(&y, g, u.at(l.clone()) * t.at(l));
    });
    let acc = k.var("acc", f32(0.0));
    k.for_("l3", i64(0), i64(N as i64), |b, l| b.assign(&acc, acc.clone() + t.at(l)));
    k.store(&s, item(), acc);
    k.finish()
}

#[test]
fn elementwise_chain_becomes_one_loop_with_scalars() {
    let fused = fuse_loops(chain());
    fused.validate().expect("the fused kernel is valid");
    // l0..l2 merged; the accumulation loop stays.
    assert_eq!(loops(&fused.body), 2, "{:#?}", fused.body);
    // `u` lives in one loop and becomes a scalar; `t` is read by the sum loop.
    assert_eq!(arrays(&fused.body), 1, "{:#?}", fused.body);
}

#[test]
fn fused_kernel_computes_the_same_bits() {
    let cache = std::env::temp_dir().join(format!("widen-fuse-test-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut fused = fuse_loops(chain());
    fused.name = "chain_fused".into();
    let lib = compiler.compile_kernels(&[chain(), fused]).expect("compiles");
    let x: Vec<f32> = (0..ROWS * N).map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0).collect();
    let run = |name: &str| {
        let (mut y, mut s) = (vec![0.0f32; ROWS * N], vec![0.0f32; ROWS]);
        let args = [x.as_ptr() as *mut c_void, y.as_mut_ptr().cast(), s.as_mut_ptr().cast()];
        let entry = lib.entry(name).expect("entry");
        // SAFETY: buffers match the parameters' types and lengths.
        unsafe { entry.call(&args, 0, ROWS as i64) };
        (y, s)
    };
    let (plain, merged) = (run("chain"), run("chain_fused"));
    assert!(plain.0.iter().zip(&merged.0).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(plain.1.iter().zip(&merged.1).all(|(a, b)| a.to_bits() == b.to_bits()));
    let _ = std::fs::remove_dir_all(cache);
}

/// Two loops over one local array where the second reads `index(l)`.
fn pair(index: impl Fn(Expr) -> Expr) -> Kernel {
    let mut k = KernelBuilder::new("pair", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::Write, ROWS * N);
    let t = k.local_array("t", Ty::F32, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| {
        b.store(&t, l.clone(), x.at(item() * i64(N as i64) + l) * f32(2.0))
    });
    k.for_("l1", i64(0), i64(N as i64), |b, l| {
        b.store(&y, item() * i64(N as i64) + l.clone(), t.at(index(l)));
    });
    k.finish()
}

#[test]
fn reads_of_other_iterations_keep_loops_apart() {
    // Reversed, shifted and strided reads would see values the merged loop has
    // not written yet.
    let reversed = pair(|l| i64(N as i64 - 1) - l);
    let halved = pair(|l| l / i64(2));
    let shifted = pair(|l| (l + i64(1)) % i64(N as i64));
    for (what, k) in [("reversed", reversed), ("halved", halved), ("shifted", shifted)] {
        let fused = fuse_loops(k);
        assert_eq!(loops(&fused.body), 2, "{what}: {:#?}", fused.body);
        assert_eq!(arrays(&fused.body), 1, "{what}");
    }
    let same = fuse_loops(pair(|l| l));
    assert_eq!((loops(&same.body), arrays(&same.body)), (1, 0), "{:#?}", same.body);
}

#[test]
fn a_buffer_written_by_both_loops_or_read_ahead_is_not_merged() {
    // Anti-dependence: the first loop reads y[l + 1], the second writes y[l].
    let mut k = KernelBuilder::new("anti", Grid::thread_per_item(1));
    let y = k.param("y", DType::F32, Access::ReadWrite, N + 1);
    let z = k.param("z", DType::F32, Access::Write, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| b.store(&z, l.clone(), y.at(l + i64(1))));
    k.for_("l1", i64(0), i64(N as i64), |b, l| b.store(&y, l, f32(0.0)));
    assert_eq!(loops(&fuse_loops(k.finish()).body), 2);

    // Output dependence: both loops write z.
    let mut k = KernelBuilder::new("both", Grid::thread_per_item(1));
    let z = k.param("z", DType::F32, Access::Write, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| b.store(&z, l, f32(1.0)));
    k.for_("l1", i64(0), i64(N as i64), |b, l| b.store(&z, l, f32(2.0)));
    assert_eq!(loops(&fuse_loops(k.finish()).body), 2);

    // Different trip counts.
    let mut k = KernelBuilder::new("lengths", Grid::thread_per_item(1));
    let z = k.param("z", DType::F32, Access::Write, N);
    let w = k.param("w", DType::F32, Access::Write, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| b.store(&z, l, f32(1.0)));
    k.for_("l1", i64(0), i64(N as i64 / 2), |b, l| b.store(&w, l, f32(2.0)));
    assert_eq!(loops(&fuse_loops(k.finish()).body), 2);
}
