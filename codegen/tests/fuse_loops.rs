//! The item-level loop fusion pass: which loops it merges, which it must
//! not, and that a merged kernel computes bit for bit what the unfused one
//! does (both compiled by the system C compiler).

use std::ffi::c_void;

use codegen::cc::Compiler;
use codegen::kernel::{
    f32, fuse_loops, i64, item, simplify_indices, Access, Expr, Grid, Kernel, KernelBuilder, Stmt, Ty,
};
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

/// Two loops over one local array where the second reads `index(l)`. `x` is
/// read-write so that the array is not computed at its reads instead.
fn pair(index: impl Fn(Expr) -> Expr) -> Kernel {
    let mut k = KernelBuilder::new("pair", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::ReadWrite, ROWS * N);
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

/// A row's squares through a local array, then their sum as interleaved
/// partial sums (the shape of the emitted RMS statistic): `reads` sum loops
/// read the squares, and the squares come from `x`, declared with `access`.
fn mean_square(access: Access, reads: usize) -> Kernel {
    const LANES: usize = 4;
    let mut k = KernelBuilder::new("mean_square", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, access, ROWS * N);
    let s = k.param("s", DType::F32, Access::Write, ROWS * reads);
    let t = k.local_array("t", Ty::F32, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| {
        let v = b.let_("v", x.at(item() * i64(N as i64) + l.clone()));
        b.store(&t, l, v.clone() * v);
    });
    for r in 0..reads {
        let lanes: Vec<Expr> = (0..LANES).map(|j| k.var(&format!("lane{r}_{j}"), f32(0.0))).collect();
        k.for_(&format!("jb{r}"), i64(0), i64((N / LANES) as i64), |b, jb| {
            for (j, lane) in lanes.iter().enumerate() {
                b.assign(lane, lane.clone() + t.at(jb.clone() * i64(LANES as i64) + i64(j as i64)));
            }
        });
        let total = (lanes[0].clone() + lanes[1].clone()) + (lanes[2].clone() + lanes[3].clone());
        k.store(&s, item() * i64(reads as i64) + i64(r as i64), total / f32(N as f32));
    }
    k.finish()
}

#[test]
fn an_array_of_read_only_values_read_once_is_computed_where_it_is_read() {
    let fused = fuse_loops(mean_square(Access::Read, 1));
    fused.validate().expect("the rewritten kernel is valid");
    assert_eq!((arrays(&fused.body), loops(&fused.body)), (0, 1), "{:#?}", fused.body);

    let cache = std::env::temp_dir().join(format!("widen-fuse-reads-test-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut renamed = fused;
    renamed.name = "mean_square_at_reads".into();
    let lib = compiler.compile_kernels(&[mean_square(Access::Read, 1), renamed]).expect("compiles");
    let x: Vec<f32> = (0..ROWS * N).map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0).collect();
    let run = |name: &str| {
        let mut s = vec![0.0f32; ROWS];
        let args = [x.as_ptr() as *mut c_void, s.as_mut_ptr().cast()];
        let entry = lib.entry(name).expect("entry");
        // SAFETY: buffers match the parameters' types and lengths.
        unsafe { entry.call(&args, 0, ROWS as i64) };
        s
    };
    let (plain, rewritten) = (run("mean_square"), run("mean_square_at_reads"));
    assert!(plain.iter().all(|v| *v > 0.0), "the test computes something");
    assert!(plain.iter().zip(&rewritten).all(|(a, b)| a.to_bits() == b.to_bits()));
    let _ = std::fs::remove_dir_all(cache);
}

#[test]
fn an_array_read_twice_or_of_writable_values_stays() {
    // Computing at two reads would square every element twice.
    assert_eq!(arrays(&fuse_loops(mean_square(Access::Read, 2)).body), 1);
    // A read-write `x` might change between the loop and the reads.
    assert_eq!(arrays(&fuse_loops(mean_square(Access::ReadWrite, 1)).body), 1);
}

/// The item emitter's row-form product over an item's one row (mHC's stream
/// update): `t = h·x` inside a loop of one iteration over the item's rows,
/// its coefficient loaded there, then a second such product into `u`, then
/// `y = t + u` elementwise. `row_name` names the second product's row
/// variable.
fn one_row_products(second_coefficient: &str) -> Kernel {
    let mut k = KernelBuilder::new("one_row", Grid::thread_per_item(ROWS));
    let h = k.param("h", DType::F32, Access::Read, ROWS * 2);
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::Write, ROWS * N);
    let n = i64(N as i64);
    let t = k.local_array("t", Ty::F32, N);
    k.for_("r0", i64(0), i64(1), |b, r| {
        let a = b.let_("a", h.at(item() * i64(2) + r.clone()));
        b.for_("c0", i64(0), n.clone(), |b, c| {
            b.store(&t, r * n.clone() + c.clone(), a * x.at(item() * n.clone() + c))
        });
    });
    let u = k.local_array("u", Ty::F32, N);
    k.for_("r1", i64(0), i64(1), |b, r| {
        let a = b.let_(second_coefficient, h.at(item() * i64(2) + i64(1) + r.clone()));
        b.for_("c1", i64(0), n.clone(), |b, c| {
            b.store(&u, r * n.clone() + c.clone(), a * x.at(item() * n.clone() + c) + f32(1.0))
        });
    });
    k.for_("l2", i64(0), n.clone(), |b, l| {
        b.store(&y, item() * n.clone() + l.clone(), t.at(l.clone()) + u.at(l))
    });
    k.finish()
}

#[test]
fn one_row_products_are_peeled_and_merged_into_one_loop_with_the_same_bits() {
    let plain = one_row_products("b");
    let fused = fuse_loops(simplify_indices(plain.clone()));
    fused.validate().expect("the fused kernel is valid");
    assert_eq!((loops(&fused.body), arrays(&fused.body)), (1, 0), "{:#?}", fused.body);

    let cache = std::env::temp_dir().join(format!("widen-fuse-rows-test-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut renamed = fused;
    renamed.name = "one_row_fused".into();
    let lib = compiler.compile_kernels(&[plain, renamed]).expect("compiles");
    let h: Vec<f32> = (0..ROWS * 2).map(|i| i as f32 / 13.0 - 1.5).collect();
    let x: Vec<f32> = (0..ROWS * N).map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0).collect();
    let run = |name: &str| {
        let mut y = vec![0.0f32; ROWS * N];
        let args = [h.as_ptr() as *mut c_void, x.as_ptr() as *mut c_void, y.as_mut_ptr().cast()];
        let entry = lib.entry(name).expect("entry");
        // SAFETY: buffers match the parameters' types and lengths.
        unsafe { entry.call(&args, 0, ROWS as i64) };
        y
    };
    let (plain, merged) = (run("one_row"), run("one_row_fused"));
    assert!(plain.iter().any(|v| *v != 0.0), "the test computes something");
    assert!(plain.iter().zip(&merged).all(|(a, b)| a.to_bits() == b.to_bits()));
    let _ = std::fs::remove_dir_all(cache);
}

#[test]
fn one_row_loops_stay_when_peeling_would_redeclare_a_name_or_a_scalar_reads_the_open_loop() {
    // Both products name their coefficient `a`: peeled, either would declare
    // it in a scope that holds the other's, so both stay loops.
    let fused = fuse_loops(simplify_indices(one_row_products("a")));
    fused.validate().expect("the rewritten kernel is valid");
    assert_eq!((loops(&fused.body), arrays(&fused.body)), (3, 2), "{:#?}", fused.body);

    // A scalar loaded from what the open loop writes keeps its place, and the
    // loop after it stays apart.
    let mut k = KernelBuilder::new("reads_open", Grid::thread_per_item(1));
    let z = k.param("z", DType::F32, Access::ReadWrite, N);
    let w = k.param("w", DType::F32, Access::Write, N);
    k.for_("l0", i64(0), i64(N as i64), |b, l| b.store(&z, l, f32(1.0)));
    let q = k.let_("q", z.at(i64(3)));
    k.for_("l1", i64(0), i64(N as i64), |b, l| b.store(&w, l, q.clone()));
    let fused = fuse_loops(k.finish());
    assert_eq!(loops(&fused.body), 2, "{:#?}", fused.body);
    assert!(matches!(&fused.body[1], Stmt::Let { var, .. } if var == "q"), "{:#?}", fused.body);
}
