//! The C path end to end: render, compile with the system compiler, load,
//! run through the entry ABI, compare with plain Rust.

mod common;

use std::ffi::c_void;
use std::path::PathBuf;

use codegen::cc::{CcError, Compiler, Library};
use codegen::kernel::{f32, f64, i64, item, Access, Grid, KernelBuilder, Ty};
use ir::DType;

/// A fresh cache folder per test, so tests do not share compiled objects;
/// removed when the test ends.
struct TempCache(PathBuf);

impl TempCache {
    fn new(name: &str) -> TempCache {
        let dir = std::env::temp_dir().join(format!("widen-codegen-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TempCache(dir)
    }

    fn compiler(&self) -> Compiler {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        Compiler::new(&cc, self.0.clone()).expect("a C compiler is installed")
    }
}

impl Drop for TempCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ptr<T>(v: &mut [T]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

/// Runs `name` over `[0, n)` split into two ranges, as two runtime threads would.
fn run(lib: &Library, name: &str, n: usize, args: &[*mut c_void]) {
    let entry = lib.entry(name).expect("entry exists");
    assert_eq!(entry.arity(), Some(args.len()));
    let mid = (n / 2) as i64;
    // SAFETY: every pointer is a live buffer of the parameter's type and length.
    unsafe {
        entry.call(args, 0, mid);
        entry.call(args, mid, n as i64);
    }
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn module_of_kernels_matches_rust() {
    use common::kernels::*;
    let lib = TempCache::new("module").compiler().compile_kernels(&all()).expect("module compiles");
    assert!(!lib.from_cache());

    let (x, g) = (data(ROWS * D, 1, 2.0), data(D, 2, 1.0));
    let mut y = vec![0.0f32; ROWS * D];
    run(&lib, "rmsnorm", ROWS, &[x.as_ptr() as *mut c_void, g.as_ptr() as *mut c_void, ptr(&mut y)]);
    assert_close(&y, &rmsnorm_ref(&x, &g), 1e-6, "rmsnorm");

    let (a, b) = (data(N, 3, 6.0), data(N, 4, 40.0));
    let mut out = vec![0.0f32; N];
    run(&lib, "silu_mul", N, &[a.as_ptr() as *mut c_void, b.as_ptr() as *mut c_void, ptr(&mut out)]);
    assert_close(&out, &silu_mul_ref(&a, &b), 1e-6, "silu_mul");
    assert!(out.contains(&100.0), "the clamp branch is exercised");

    let (h, m) = (data(TOKENS * S * C, 5, 1.0), data(S * S, 6, 1.0));
    let mut mixed = vec![0.0f32; TOKENS * S * C];
    run(&lib, "stream_mix", TOKENS, &[h.as_ptr() as *mut c_void, m.as_ptr() as *mut c_void, ptr(&mut mixed)]);
    // Same summation order as the kernel: exact.
    assert_eq!(mixed, stream_mix_ref(&h, &m));

    let sx = data(SM_ROWS * SM_D, 7, 5.0);
    let mut sy = vec![0.0f32; SM_ROWS * SM_D];
    let mut centered = vec![0.0f32; SM_ROWS * LANES as usize];
    run(&lib, "softmax", SM_ROWS, &[sx.as_ptr() as *mut c_void, ptr(&mut sy), ptr(&mut centered)]);
    let (want_y, want_c) = softmax_ref(&sx);
    assert_close(&sy, &want_y, 1e-6, "softmax");
    assert_eq!(centered, want_c);
    for r in 0..SM_ROWS {
        let s: f32 = sy[r * SM_D..(r + 1) * SM_D].iter().sum();
        assert!((s - 1.0).abs() < 1e-5, "row {r} sums to {s}");
    }
}

/// The C dialect's `widen_expf` against Rust's `f32::exp` (what the reference
/// executor computes): within 1 ulp for every normal result over a sweep of
/// 2^22 evenly spaced bit patterns covering [-104, 89] (subnormal and overflow
/// edges included), and exact on the specials; with fused multiply-adds
/// (`-march=native` on this host) and without (a compiler that rejects it
/// builds for the baseline target).
#[test]
fn c_exp_is_within_one_ulp_of_rust_exp() {
    let tmp = TempCache::new("expf");
    exp_sweep(&tmp.compiler());
    exp_sweep(&no_native_compiler(&tmp));
}

/// A compiler that rejects `-march=native`, so kernels build for the
/// baseline target.
fn no_native_compiler(tmp: &TempCache) -> Compiler {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(&tmp.0).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let wrapper = tmp.0.join("no-native-cc");
    let script = format!(
        "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = \"{}\" ] && {{ echo unsupported >&2; exit 1; }}; done\nexec {cc} \"$@\"\n",
        codegen::cc::NATIVE_FLAG
    );
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    Compiler::new(wrapper.to_str().unwrap(), tmp.0.join("no-native-cache")).expect("wrapper runs")
}

fn exp_sweep(compiler: &Compiler) {
    const SWEEP: usize = 1 << 22;
    let specials =
        [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 88.72283, 88.7229, -103.97, -104.5, 1e-30];
    let n = SWEEP + specials.len();
    let mut k = KernelBuilder::new("exp_sweep", Grid::thread_per_item(n));
    let x = k.param("x", DType::F32, Access::Read, n);
    let y = k.param("y", DType::F32, Access::Write, n);
    k.store(&y, item(), x.at(item()).exp());
    let lib = compiler.compile_kernels(&[k.finish()]).expect("compiles");
    // Positive and negative halves of the range, walking the bit patterns.
    let (pos_top, neg_top) = (89.0f32.to_bits(), 104.0f32.to_bits());
    let mut xs: Vec<f32> = (0..SWEEP / 2)
        .map(|i| f32::from_bits((i as u64 * u64::from(pos_top) / (SWEEP / 2) as u64) as u32))
        .chain(
            (0..SWEEP / 2)
                .map(|i| -f32::from_bits((i as u64 * u64::from(neg_top) / (SWEEP / 2) as u64) as u32)),
        )
        .collect();
    xs.extend(specials);
    let mut ys = vec![0.0f32; n];
    run(&lib, "exp_sweep", n, &[xs.as_ptr() as *mut c_void, ptr(&mut ys)]);
    let mut worst = 0u32;
    for (&x, &y) in xs.iter().zip(&ys) {
        let want = x.exp();
        if want.is_nan() {
            assert!(y.is_nan(), "exp({x}) = {y}, want NaN");
        } else if want.is_infinite() || want == 0.0 || x.abs() < 1e-20 {
            assert_eq!(y, want, "exp({x})");
        } else if want.is_normal() {
            let ulps = y.to_bits().abs_diff(want.to_bits());
            assert!(ulps <= 1, "exp({x}) = {y}, want {want} ({ulps} ulp)");
            worst = worst.max(ulps);
        } else {
            // Subnormal results: within one subnormal step of 2^-149.
            assert!((y - want).abs() <= f32::from_bits(1) * 2.0, "exp({x}) = {y}, want {want}");
        }
    }
    assert!(worst <= 1);
}

/// The C dialect's `widen_tanhf` against Rust's `f32::tanh`: within 2 ulp over
/// a sweep of 2^21 bit patterns of each sign up to |x| = 11 (where tanh is 1
/// in f32), signed zeros, infinities and NaN exact; with fused multiply-adds
/// and without, as for `exp`.
#[test]
fn c_tanh_is_within_two_ulp_of_rust_tanh() {
    let tmp = TempCache::new("tanhf");
    tanh_sweep(&tmp.compiler());
    tanh_sweep(&no_native_compiler(&tmp));
}

fn tanh_sweep(compiler: &Compiler) {
    const HALF: usize = 1 << 21;
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 0.625, -0.625, 50.0, -50.0, 1e-30];
    let n = 2 * HALF + specials.len();
    let mut k = KernelBuilder::new("tanh_sweep", Grid::thread_per_item(n));
    let x = k.param("x", DType::F32, Access::Read, n);
    let y = k.param("y", DType::F32, Access::Write, n);
    k.store(&y, item(), x.at(item()).tanh());
    let lib = compiler.compile_kernels(&[k.finish()]).expect("compiles");
    let top = u64::from(11.0f32.to_bits());
    let mut xs: Vec<f32> = (0..HALF).map(|i| f32::from_bits((i as u64 * top / HALF as u64) as u32)).collect();
    let negated: Vec<f32> = xs.iter().map(|x| -x).collect();
    xs.extend(negated);
    xs.extend(specials);
    let mut ys = vec![0.0f32; n];
    run(&lib, "tanh_sweep", n, &[xs.as_ptr() as *mut c_void, ptr(&mut ys)]);
    for (&x, &y) in xs.iter().zip(&ys) {
        let want = x.tanh();
        if want.is_nan() {
            assert!(y.is_nan(), "tanh({x}) = {y}, want NaN");
        } else if want == 0.0 || want.abs() == 1.0 {
            assert_eq!(y.to_bits(), want.to_bits(), "tanh({x}) = {y}, want {want}");
        } else {
            let ulps = y.to_bits().abs_diff(want.to_bits());
            assert!(ulps <= 2, "tanh({x}) = {y}, want {want} ({ulps} ulp)");
        }
    }
}

#[test]
fn bf16_storage_rounds_to_nearest_even() {
    use common::kernels::*;
    let lib = TempCache::new("bf16").compiler().compile_kernels(&[bf16_convert()]).expect("compiles");
    let mut xf = data(BF_N, 8, 3.0);
    // Ties and specials: exactly halfway values round to even, NaN stays NaN.
    xf[0] = f32::from_bits(0x3f80_8000); // tie, even below
    xf[1] = f32::from_bits(0x3f81_8000); // tie, odd below: rounds up
    xf[2] = f32::NAN;
    xf[3] = f32::INFINITY;
    xf[4] = f32::from_bits(0x7f7f_ffff); // max finite rounds to inf
    let xb: Vec<u16> = data(BF_N, 9, 3.0).into_iter().map(to_bf16).collect();
    let mut yf = vec![0.0f32; BF_N];
    let mut yb = vec![0u16; BF_N];
    run(
        &lib,
        "bf16_convert",
        BF_N,
        &[xb.as_ptr() as *mut c_void, xf.as_ptr() as *mut c_void, ptr(&mut yf), ptr(&mut yb)],
    );
    for i in 0..BF_N {
        assert_eq!(yf[i].to_bits(), (from_bf16(xb[i]) * 2.0).to_bits(), "yf[{i}]");
        let want = to_bf16(from_bf16(to_bf16(xf[i])) + 1.0);
        if xf[i].is_nan() {
            assert!(from_bf16(yb[i]).is_nan(), "yb[{i}] stays NaN");
        } else {
            assert_eq!(yb[i], want, "yb[{i}] from {}", xf[i]);
        }
    }
    assert_eq!(to_bf16(xf[0]), 0x3f80);
    assert_eq!(to_bf16(xf[1]), 0x3f82);
}

#[test]
fn float_literals_round_trip_exactly() {
    let f32s = [
        0.1f32,
        -0.0,
        1e-45,
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        16777217.0,
        std::f32::consts::PI,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let f64s = [0.1f64, 1e-300, 5e-324, f64::MAX, -std::f64::consts::E, f64::INFINITY];
    let mut k = KernelBuilder::new("literals", Grid::thread_per_item(1));
    let o32 = k.param("o32", DType::F32, Access::Write, f32s.len() + 1);
    let o64 = k.param("o64", DType::F64, Access::Write, f64s.len() + 2);
    for (i, v) in f32s.iter().enumerate() {
        k.store(&o32, item() + i as i64, f32(*v));
    }
    k.store(&o32, item() + f32s.len() as i64, f32(f32::NAN));
    for (i, v) in f64s.iter().enumerate() {
        k.store(&o64, item() + i as i64, f64(*v));
    }
    k.store(&o64, item() + f64s.len() as i64, f64(f64::NAN));
    // A product of two literals that fit in `int` must still be computed in 64 bits.
    k.store(&o64, item() + (f64s.len() as i64 + 1), (i64(100_000) * i64(100_000)).cast(Ty::F64));
    let lib = TempCache::new("literals").compiler().compile_kernels(&[k.finish()]).expect("compiles");
    let mut g32 = vec![0.0f32; f32s.len() + 1];
    let mut g64 = vec![0.0f64; f64s.len() + 2];
    run(&lib, "literals", 1, &[ptr(&mut g32), ptr(&mut g64)]);
    for (g, w) in g32.iter().zip(&f32s) {
        assert_eq!(g.to_bits(), w.to_bits(), "f32 literal {w:e}");
    }
    for (g, w) in g64.iter().zip(&f64s) {
        assert_eq!(g.to_bits(), w.to_bits(), "f64 literal {w:e}");
    }
    assert!(g32[f32s.len()].is_nan() && g64[f64s.len()].is_nan());
    assert_eq!(g64[f64s.len() + 1], 1e10);
}

#[test]
fn second_compile_hits_the_cache() {
    let tmp = TempCache::new("cache");
    let cc = tmp.compiler();
    let first = cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles");
    let stamp = std::fs::metadata(first.path()).and_then(|m| m.modified()).expect("object exists");
    assert!(!first.from_cache());
    assert!(first.path().starts_with(cc.cache_dir()));
    let source = first.path().with_extension("c");
    assert!(std::fs::read_to_string(&source).expect("source kept").contains("widen_rmsnorm_entry"));

    let second = cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles");
    assert!(second.from_cache());
    assert_eq!(second.path(), first.path());
    assert_eq!(std::fs::metadata(second.path()).and_then(|m| m.modified()).unwrap(), stamp, "not rebuilt");

    // A different module gets a different object.
    let other = cc.compile_kernels(&[common::kernels::silu_mul()]).expect("compiles");
    assert!(!other.from_cache());
    assert_ne!(other.path(), first.path());
    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(cc.cache_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn compile_error_reports_the_compiler_message_and_file() {
    let tmp = TempCache::new("error");
    let cc = tmp.compiler();
    let err = cc.compile_source("void widen_broken_entry(void) { return 1 +; }\n").unwrap_err();
    let CcError::Compile { file, stderr, .. } = &err else { panic!("expected a compile error, got {err}") };
    assert!(file.is_file(), "the failing source is kept at {}", file.display());
    assert!(stderr.contains("error"), "compiler stderr: {stderr}");
    let msg = err.to_string();
    assert!(msg.contains(&*file.to_string_lossy()) && msg.contains(stderr.trim()), "{msg}");
    // Nothing was cached.
    let objects = std::fs::read_dir(cc.cache_dir())
        .unwrap()
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "so")));
    assert_eq!(objects.count(), 0);
}

#[test]
fn missing_compiler_and_unknown_kernel_are_typed_errors() {
    let err = Compiler::new("widen-no-such-compiler", TempCache::new("missing").0.clone()).unwrap_err();
    assert!(matches!(err, CcError::CompilerNotFound { .. }), "{err}");
    assert!(err.to_string().contains("widen-no-such-compiler"));

    let lib = TempCache::new("unknown")
        .compiler()
        .compile_kernels(&[common::kernels::silu_mul()])
        .expect("compiles");
    let err = lib.entry("rmsnorm").unwrap_err();
    assert!(matches!(err, CcError::UnknownKernel { .. }), "{err}");
}

/// `-march=native` is passed only to compilers that accept it: a compiler that
/// rejects it still builds and runs kernels with the portable flags.
#[cfg(unix)]
#[test]
fn native_tuning_is_dropped_where_the_compiler_rejects_it() {
    let tmp = TempCache::new("native");
    let picky = no_native_compiler(&tmp);
    assert_eq!(picky.flags(), codegen::cc::FLAGS, "no -march=native for a compiler that rejects it");
    let lib = picky.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles without it");
    assert!(lib.entry("rmsnorm").is_ok());
    // The system compiler of this machine (gcc or clang on x86-64 or arm64 Linux) accepts it.
    assert!(tmp.compiler().flags().iter().any(|f| f == codegen::cc::NATIVE_FLAG));
}

/// With the driver's flags, GCC turns the item loop of a kernel with an `exp`
/// (SiLU, and the clamp's `select`) into vector code. It keeps it scalar on
/// AVX2 hosts when the exponential's range clamp cannot become a select:
/// without `-fno-trapping-math` a comparison evaluated on one side of a `?:`
/// may not be evaluated unconditionally. Skipped for compilers other than GCC,
/// whose vectorizer report this reads.
#[test]
fn exp_kernels_are_vectorized_by_gcc() {
    let tmp = TempCache::new("vectorized");
    let compiler = tmp.compiler();
    if !compiler.version().contains("Free Software Foundation") {
        println!("skipped: the C compiler is not GCC, whose -fopt-info report this test reads");
        return;
    }
    let source = codegen::render::render_c(&[common::kernels::silu_mul()]).expect("renders");
    let file = tmp.0.join("silu_mul.c");
    std::fs::create_dir_all(&tmp.0).unwrap();
    std::fs::write(&file, &source).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut command = cc.split_whitespace();
    let out = std::process::Command::new(command.next().unwrap())
        .args(command)
        .args(compiler.flags())
        .args(["-fopt-info-vec-optimized", "-c", "-o"])
        .arg(tmp.0.join("silu_mul.o"))
        .arg(&file)
        .output()
        .expect("the compiler runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = String::from_utf8_lossy(&out.stderr);
    // The kernel's lines: from its definition to the closing brace at column 0.
    let lines: Vec<&str> = source.lines().collect();
    let first =
        lines.iter().position(|l| l.starts_with("void widen_silu_mul(")).expect("kernel rendered") + 1;
    let last = first + lines[first..].iter().position(|l| *l == "}").expect("kernel closes");
    let vectorized = report.lines().any(|l| {
        l.contains("loop vectorized")
            && l.split(':')
                .nth(1)
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| (first..=last).contains(&n))
    });
    assert!(vectorized, "the SiLU item loop stays scalar under {:?}:\n{report}", compiler.flags());
}

/// A cached object that no longer is what its compile wrote (garbage,
/// truncated, emptied) is rebuilt in place instead of failing every run
/// until someone deletes the cache.
#[test]
fn a_corrupt_cached_object_is_rebuilt() {
    let tmp = TempCache::new("corrupt");
    let cc = tmp.compiler();
    let first = cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles");
    let good = std::fs::read(first.path()).expect("object exists");
    drop(first);
    let corruptions: [(&str, Vec<u8>); 3] = [
        ("garbage", b"this is not a shared object".to_vec()),
        ("truncated", good[..good.len() / 2].to_vec()),
        ("empty", Vec::new()),
    ];
    for (what, bytes) in corruptions {
        let so = cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles").path().to_path_buf();
        std::fs::write(&so, &bytes).unwrap();
        let lib = cc.compile_kernels(&[common::kernels::rmsnorm()]).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(!lib.from_cache(), "{what}: the corrupt object was used");
        assert!(lib.entry("rmsnorm").is_ok(), "{what}: the rebuilt object has the kernel");
        let again = cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles");
        assert!(again.from_cache(), "{what}: the rebuilt object is cached again");
    }
}

/// A cache folder that cannot be created or written is reported as the cache,
/// with the variable that moves it, never as a temporary file's error.
#[test]
fn an_unusable_cache_names_widen_cache_dir() {
    let tmp = TempCache::new("unusable");
    std::fs::create_dir_all(&tmp.0).unwrap();
    let file = tmp.0.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let dir = file.join("cache");
    let cc = Compiler::new(&std::env::var("CC").unwrap_or_else(|_| "cc".into()), dir.clone()).expect("cc");
    let err = cc.compile_kernels(&[common::kernels::rmsnorm()]).unwrap_err();
    assert!(matches!(&err, CcError::Cache { dir: d, .. } if *d == dir), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("WIDEN_CACHE_DIR") && msg.contains(&*dir.to_string_lossy()), "{msg}");
    assert!(!msg.contains(".tmp"), "{msg}");
}

/// Several compiles of one module at once (threads here, processes alike:
/// every temporary name is unique) all load a whole object, and leave one
/// verified object and no temporary files.
#[test]
fn concurrent_compiles_of_one_key_do_not_corrupt_the_cache() {
    let tmp = TempCache::new("concurrent");
    let cc = tmp.compiler();
    let paths: Vec<PathBuf> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let cc = cc.clone();
                s.spawn(move || {
                    let lib = cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles");
                    lib.entry("rmsnorm").expect("loads whole");
                    lib.path().to_path_buf()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("no panic")).collect()
    });
    assert!(paths.windows(2).all(|w| w[0] == w[1]), "{paths:?}");
    assert!(cc.compile_kernels(&[common::kernels::rmsnorm()]).expect("compiles").from_cache());
    let leftovers: Vec<_> = std::fs::read_dir(cc.cache_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
