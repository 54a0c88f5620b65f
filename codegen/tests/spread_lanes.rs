//! The GPU's lane spreading (`codegen::kernel::spread_over_lanes`): which
//! loops it deals to the lanes, where it puts barriers and reductions, what it
//! refuses, and that the spread kernel computes what the thread-per-item one
//! does (its C rendering, the lanes run one after another, against the
//! original, both compiled by the system C compiler).

use std::ffi::c_void;

use codegen::cc::Compiler;
use codegen::kernel::{
    f32, i64, item, spread_over_lanes, Access, Expr, Grid, Kernel, KernelBuilder, Stmt, SPREAD_LANES,
};
use ir::DType;

const ROWS: usize = 13;
const N: usize = 96;
const STREAMS: usize = 4;

/// An RMS-norm-like item over a row of `N` plus a small stream loop around a
/// long one (the shape of mHC's per-stream products):
/// `y = 2x; s = Σ y²; r = 1/sqrt(s/N + ε); z = y·r; w[k] = k·x (k < 4); out = r`.
fn norm_like() -> Kernel {
    let n = N as i64;
    let mut k = KernelBuilder::new("norm_like", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::WriteThenRead, ROWS * N);
    let z = k.param("z", DType::F32, Access::Write, ROWS * N);
    let w = k.param("w", DType::F32, Access::Write, ROWS * N * STREAMS);
    let out = k.param("out", DType::F32, Access::Write, ROWS);
    k.for_("l0", i64(0), i64(n), |b, l| {
        let g = b.let_("g0", item() * i64(n) + l);
        b.store(&y, g.clone(), x.at(g) * f32(2.0));
    });
    let acc = k.var("acc", f32(0.0));
    k.for_("l1", i64(0), i64(n), |b, l| {
        let v = b.let_("v1", y.at(item() * i64(n) + l));
        b.assign(&acc, acc.clone() + v.clone() * v);
    });
    let r = k.let_("r", f32(1.0) / (acc / f32(N as f32) + f32(1e-5)).sqrt());
    k.for_("l2", i64(0), i64(n), |b, l| {
        let g = b.let_("g2", item() * i64(n) + l);
        b.store(&z, g.clone(), y.at(g) * r.clone());
    });
    k.for_("s", i64(0), i64(STREAMS as i64), |b, s| {
        b.for_("l3", i64(0), i64(n), |b, l| {
            let at = (item() * i64(STREAMS as i64) + s.clone()) * i64(n) + l.clone();
            let v = x.at(item() * i64(n) + l)
                * Expr::Cast { ty: codegen::kernel::Ty::F32, arg: Box::new(s.clone()) };
            b.store(&w, at, v);
        });
    });
    k.store(&out, item(), r);
    k.finish()
}

/// Top-level loops whose first iteration is the lane.
fn split_loops(stmts: &[Stmt]) -> usize {
    stmts.iter().filter(|s| matches!(s, Stmt::For { start, .. } if mentions_lane(start))).count()
}

fn mentions_lane(e: &Expr) -> bool {
    match e {
        Expr::Lane => true,
        Expr::Binary { lhs, rhs, .. } => mentions_lane(lhs) || mentions_lane(rhs),
        _ => false,
    }
}

#[test]
fn long_loops_go_to_the_lanes_and_sums_to_a_block_reduction() {
    let spread = spread_over_lanes(&norm_like()).expect("valid").expect("the kernel spreads");
    assert_eq!(spread.grid, Grid::BlockPerItem { n: ROWS, threads: SPREAD_LANES });
    // l0, l1, l2 and the four copies of l3 (the stream loop unrolled).
    assert_eq!(split_loops(&spread.body), 3 + STREAMS, "{:#?}", spread.body);
    let reductions = spread.body.iter().filter(|s| matches!(s, Stmt::BlockReduce { .. })).count();
    assert_eq!(reductions, 1, "one sum");
    // l1 reads what l0 stored on other lanes: a barrier between them.
    let position = |pred: &dyn Fn(&Stmt) -> bool| spread.body.iter().position(pred).expect("present");
    let l0 = position(&|s| matches!(s, Stmt::For { var, .. } if var == "l0"));
    let l1 = position(&|s| matches!(s, Stmt::For { var, .. } if var == "l1"));
    assert!(spread.body[l0..l1].iter().any(|s| matches!(s, Stmt::Barrier)), "{:#?}", spread.body);
    // The same arithmetic, counted once where every lane repeats it, plus
    // the reduction's combine (one per lane) and the add of its result.
    let plain = norm_like().flops();
    assert!(plain.1 && spread.flops().1, "literal bounds");
    assert_eq!(spread.flops().0, plain.0 + ROWS as u64 * (u64::from(SPREAD_LANES) + 1));
}

#[test]
fn spread_kernel_computes_what_the_thread_per_item_one_does() {
    let cache = std::env::temp_dir().join(format!("widen-spread-test-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut spread = spread_over_lanes(&norm_like()).expect("valid").expect("the kernel spreads");
    spread.name = "norm_like_spread".into();
    let lib = compiler.compile_kernels(&[norm_like(), spread]).expect("compiles");
    let x: Vec<f32> = (0..ROWS * N).map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0).collect();
    let run = |name: &str| {
        let mut bufs = [
            vec![0.0f32; ROWS * N],
            vec![0.0f32; ROWS * N],
            vec![0.0f32; ROWS * N * STREAMS],
            vec![0.0f32; ROWS],
        ];
        let [y, z, w, out] = &mut bufs;
        let args = [
            x.as_ptr() as *mut c_void,
            y.as_mut_ptr().cast(),
            z.as_mut_ptr().cast(),
            w.as_mut_ptr().cast(),
            out.as_mut_ptr().cast(),
        ];
        let entry = lib.entry(name).expect("entry");
        // SAFETY: buffers match the parameters' types and lengths.
        unsafe { entry.call(&args, 0, ROWS as i64) };
        bufs
    };
    let (plain, spread) = (run("norm_like"), run("norm_like_spread"));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&plain[0]), bits(&spread[0]), "y: elementwise, the same bits");
    assert_eq!(bits(&plain[2]), bits(&spread[2]), "w: elementwise, the same bits");
    // The sum is reassociated (lane partials, then a tree): close, not equal bits.
    for (name, (a, b)) in [("z", (&plain[1], &spread[1])), ("out", (&plain[3], &spread[3]))] {
        for (p, q) in a.iter().zip(b.iter()) {
            assert!((p - q).abs() <= 1e-6 * p.abs().max(1.0), "{name}: {p} vs {q}");
        }
    }
    assert!(plain[3].iter().all(|v| v.is_finite() && *v > 0.0), "the norm factor is computed");
    let _ = std::fs::remove_dir_all(cache);
}

#[test]
fn spread_kernel_compiles_under_nvrtc_without_spills() {
    if !codegen::nvrtc::is_available() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "NVRTC is required when CI=true");
        eprintln!("skipped: NVRTC is not loadable (put its lib folder on LD_LIBRARY_PATH)");
        return;
    }
    let spread = spread_over_lanes(&norm_like()).expect("valid").expect("the kernel spreads");
    let src = codegen::render::render_cuda(std::slice::from_ref(&spread)).expect("renders");
    assert!(src.contains("__shfl_down_sync"), "a warp's sum by shuffles");
    let out = codegen::nvrtc::compile(&src, "sm_90").expect("compiles");
    assert!(out.warnings().is_empty(), "{:?}", out.warnings());
    let r = out.resources_of(&spread.symbol()).expect("a resource report");
    assert_eq!((r.spill_stores, r.spill_loads), (0, 0));
}

/// A kernel with `body` over rows of `N` (one read-only and one written buffer).
fn kernel_with(
    body: impl FnOnce(&mut KernelBuilder, &codegen::kernel::Buf, &codegen::kernel::Buf),
) -> Kernel {
    let mut k = KernelBuilder::new("refused", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::ReadWrite, ROWS * N);
    body(&mut k, &x, &y);
    k.finish()
}

#[test]
fn kernels_whose_iterations_or_lanes_depend_on_each_other_keep_one_thread_per_item() {
    let n = N as i64;
    // An iteration reads the element the previous one stored.
    let neighbour = kernel_with(|k, x, y| {
        k.for_("l", i64(1), i64(n), |b, l| {
            let g = b.let_("g", item() * i64(n) + l);
            b.store(y, g.clone(), x.at(g.clone()) + y.at(g - i64(1)));
        });
    });
    assert!(
        spread_over_lanes(&neighbour).expect("valid").is_none(),
        "a loop-carried dependence through memory"
    );
    // A running maximum is not a sum.
    let maximum = kernel_with(|k, x, y| {
        let m = k.var("m", f32(f32::NEG_INFINITY));
        k.for_("l", i64(0), i64(n), |b, l| {
            let v = b.let_("v", x.at(item() * i64(n) + l));
            b.assign(&m, codegen::kernel::select(v.clone().gt(m.clone()), v, m.clone()));
        });
        k.store(y, item() * i64(n), m);
    });
    assert!(spread_over_lanes(&maximum).expect("valid").is_none(), "only sums become block reductions");
    // A short loop only: nothing for the lanes to share.
    let short = kernel_with(|k, x, y| {
        k.for_("l", i64(0), i64(8), |b, l| {
            let g = b.let_("g", item() * i64(n) + l);
            b.store(y, g.clone(), x.at(g));
        });
    });
    assert!(spread_over_lanes(&short).expect("valid").is_none(), "no long loop");
    // Every lane would run a loop that reads an element another lane's copy
    // of the same loop may already have overwritten.
    let shifted = kernel_with(|k, x, y| {
        k.for_("l", i64(0), i64(n), |b, l| {
            let g = b.let_("g", item() * i64(n) + l);
            b.store(y, g.clone(), x.at(g));
        });
        k.for_("s", i64(0), i64(8), |b, s| {
            let g = b.let_("gs", item() * i64(n) + s);
            b.store(y, g.clone() + i64(1), y.at(g));
        });
    });
    assert!(
        spread_over_lanes(&shifted).expect("valid").is_none(),
        "a repeated statement reading another element it writes"
    );
}

/// A row built in a local array over several loops, as the row-form product
/// accumulates `[m, 4] × [4, C/m]` (VWN, docs/math.md §5.3): `acc = 2x; acc += x;
/// y = 3·acc`. When only those loops touch the array, each at its own
/// variable, every lane keeps its own elements and all three loops split.
fn row_form(read_one_element_too: bool) -> Kernel {
    let n = N as i64;
    let mut k = KernelBuilder::new("row_form", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::Write, ROWS * N);
    let first = k.param("first", DType::F32, Access::Write, ROWS);
    let acc = k.local_array("acc", codegen::kernel::Ty::F32, N);
    k.for_("c0", i64(0), i64(n), |b, c| b.store(&acc, c.clone(), x.at(item() * i64(n) + c) * f32(2.0)));
    k.for_("c1", i64(0), i64(n), |b, c| b.accum(&acc, c.clone(), x.at(item() * i64(n) + c)));
    k.for_("c2", i64(0), i64(n), |b, c| b.store(&y, item() * i64(n) + c.clone(), acc.at(c) * f32(3.0)));
    if read_one_element_too {
        // Lane 0's element, read by every lane.
        k.store(&first, item(), acc.at(i64(0)));
    } else {
        k.store(&first, item(), f32(0.0));
    }
    k.finish()
}

#[test]
fn a_row_only_its_loops_touch_is_kept_by_lanes_and_its_loops_split() {
    let spread = spread_over_lanes(&row_form(false)).expect("valid").expect("the kernel spreads");
    assert_eq!(split_loops(&spread.body), 3, "{:#?}", spread.body);
    let cache = std::env::temp_dir().join(format!("widen-spread-row-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut renamed = spread;
    renamed.name = "row_form_spread".into();
    let lib = compiler.compile_kernels(&[row_form(false), renamed]).expect("compiles");
    let x: Vec<f32> = (0..ROWS * N).map(|i| ((i * 31) % 97) as f32 / 7.0 - 5.0).collect();
    let run = |name: &str| {
        let (mut y, mut first) = (vec![0.0f32; ROWS * N], vec![1.0f32; ROWS]);
        let args = [x.as_ptr() as *mut c_void, y.as_mut_ptr().cast(), first.as_mut_ptr().cast()];
        // SAFETY: buffers match the parameters' types and lengths.
        unsafe { lib.entry(name).expect("entry").call(&args, 0, ROWS as i64) };
        y
    };
    let (plain, spread) = (run("row_form"), run("row_form_spread"));
    assert!(plain.iter().zip(&spread).all(|(a, b)| a.to_bits() == b.to_bits()), "the same bits");
    assert!(plain.iter().any(|v| *v != 0.0));
    let _ = std::fs::remove_dir_all(cache);

    // Read at another index too, the row must stay whole in every lane: the
    // loops that build it do not split.
    let whole = spread_over_lanes(&row_form(true)).expect("valid");
    let builds_split = whole.is_some_and(|k| {
        k.body
            .iter()
            .any(|s| matches!(s, Stmt::For { var, start, .. } if var != "c2" && mentions_lane(start)))
    });
    assert!(!builds_split, "a row read at a fixed element is built by every lane");
}

/// Two rows of one local array (xHC's temporal features `[r, C]`, docs/math.md
/// §6.5), built at offsets `0` and `offset`, then copied out whole: lanes
/// keep their own elements when the offset is a multiple of the lanes (the
/// element of `c + offset` is then the lane of `c`'s), not otherwise.
fn two_rows(offset: usize) -> Kernel {
    let n = N as i64;
    let len = offset + N;
    let mut k = KernelBuilder::new("two_rows", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::Write, ROWS * len);
    let rows = k.local_array("rows", codegen::kernel::Ty::F32, len);
    k.for_("a", i64(0), i64(len as i64), |b, c| b.store(&rows, c, f32(0.0)));
    k.for_("c0", i64(0), i64(n), |b, c| b.store(&rows, c.clone(), x.at(item() * i64(n) + c) * f32(2.0)));
    k.for_("c1", i64(0), i64(n), |b, c| {
        b.store(&rows, c.clone() + i64(offset as i64), x.at(item() * i64(n) + c) + f32(1.0))
    });
    k.for_("e", i64(0), i64(len as i64), |b, e| {
        b.store(&y, item() * i64(len as i64) + e.clone(), rows.at(e))
    });
    k.finish()
}

#[test]
fn rows_at_offsets_that_are_multiples_of_the_lanes_stay_with_their_lanes() {
    let lanes = SPREAD_LANES as usize;
    let kept = spread_over_lanes(&two_rows(3 * lanes)).expect("valid").expect("the kernel spreads");
    assert_eq!(split_loops(&kept.body), 4, "{:#?}", kept.body);
    let shifted = spread_over_lanes(&two_rows(3 * lanes + 8)).expect("valid");
    let builds_split = shifted.is_some_and(|k| {
        k.body.iter().any(|s| matches!(s, Stmt::For { var, start, .. } if var != "e" && mentions_lane(start)))
    });
    assert!(!builds_split, "an offset of 8 would hand a row's elements to other lanes");
}

/// A triangular nest (Gram–Schmidt's projections, docs/math.md §6.5): `for j in
/// 0..3 { for i in 0..j + 1 { if i == j { … } else { … } } }` around long
/// loops, two sibling loops declaring the same scalar. Unrolled, its copies
/// have literal bounds and no branch, and every long loop splits; the spread
/// kernel computes the same bits.
fn triangular() -> Kernel {
    let n = N as i64;
    let mut k = KernelBuilder::new("triangular", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * N);
    let y = k.param("y", DType::F32, Access::Write, ROWS * N * 9);
    k.for_("j", i64(0), i64(3), |b, j| {
        b.for_("i", i64(0), j.clone() + i64(1), |b, i| {
            let slot = b.let_("slot", (j.clone() * i64(3) + i.clone()) * i64(n));
            b.if_else(
                i.clone().eq_(j.clone()),
                |b| {
                    b.for_("c", i64(0), i64(n), |b, c| {
                        let g = b.let_("g", item() * i64(9 * n) + slot.clone() + c.clone());
                        b.store(&y, g, x.at(item() * i64(n) + c) * f32(2.0));
                    })
                },
                |b| {
                    b.for_("c", i64(0), i64(n), |b, c| {
                        let g = b.let_("g", item() * i64(9 * n) + slot.clone() + c.clone());
                        b.store(&y, g, x.at(item() * i64(n) + c) + f32(1.0));
                    })
                },
            );
        });
    });
    k.finish()
}

#[test]
fn triangular_nests_unroll_into_split_loops_with_the_same_bits() {
    let spread = spread_over_lanes(&triangular()).expect("valid").expect("the kernel spreads");
    // j = 0: one copy of i; j = 1: two; j = 2: three.
    assert_eq!(split_loops(&spread.body), 6, "{:#?}", spread.body);
    assert!(!spread.body.iter().any(|s| matches!(s, Stmt::If { .. })), "branches decided");
    let cache = std::env::temp_dir().join(format!("widen-spread-tri-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut renamed = spread;
    renamed.name = "triangular_spread".into();
    let lib = compiler.compile_kernels(&[triangular(), renamed]).expect("compiles");
    let x: Vec<f32> = (0..ROWS * N).map(|i| ((i * 13) % 89) as f32 / 5.0 - 8.0).collect();
    let run = |name: &str| {
        let mut y = vec![0.5f32; ROWS * N * 9];
        let args = [x.as_ptr() as *mut c_void, y.as_mut_ptr().cast()];
        // SAFETY: buffers match the parameters' types and lengths.
        unsafe { lib.entry(name).expect("entry").call(&args, 0, ROWS as i64) };
        y
    };
    let (plain, spread) = (run("triangular"), run("triangular_spread"));
    assert!(plain.iter().zip(&spread).all(|(a, b)| a.to_bits() == b.to_bits()), "the same bits");
    let _ = std::fs::remove_dir_all(cache);
}
