//! The Cpu device on hand-built Plans: kernel, GEMM and zero steps against
//! plain Rust, thread-count independence, and load-time rejection of Plans
//! that would bind buffers unsoundly.

mod common;

use codegen::cc::Compiler;
use codegen::kernel::Grid;
use codegen::plan::{BufferId, BufferRole, Chain, Gemm, Plan, Step};
use common::plan::{data, decl, rms_rows, scale_bias};
use ir::DType;
use runtime::device::cpu::{CpuDevice, CpuError, CpuOptions, Profile, ProfileRows};
use runtime::device::plan_check::PlanCheckError;
use std::path::PathBuf;

/// A cache folder per test (removed at the end), so tests never share objects.
struct TempCache(PathBuf);

impl TempCache {
    fn new(name: &str) -> TempCache {
        let dir = std::env::temp_dir().join(format!("widen-cpu-device-{}-{name}", std::process::id()));
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

const ROWS: usize = 256;
const D: usize = 64;
const F: usize = 48;
const EPS: f32 = 1e-5;

fn input(name: &str) -> BufferRole {
    BufferRole::Input { name: name.into() }
}

fn output(name: &str) -> BufferRole {
    BufferRole::Output { name: name.into() }
}

/// Buffers of the test Plan, by position.
const X: BufferId = BufferId(0);
const SCALE: BufferId = BufferId(1);
const BIAS: BufferId = BufferId(2);
const W: BufferId = BufferId(3);
const H: BufferId = BufferId(4); // scratch: scale_bias output
const P: BufferId = BufferId(5); // scratch: h @ w
const Y: BufferId = BufferId(6);
const G: BufferId = BufferId(7);

/// x -> h = x * 0.5 + bias -> p = h @ w -> y = rmsnorm(p); g = 0, then
/// g += h^T @ p twice (a weight-gradient-shaped product, accumulated).
fn test_plan() -> Plan {
    let buffers = vec![
        decl(0, ROWS * D, DType::F32, input("x")),
        decl(1, 1, DType::F32, BufferRole::Constant { value: 0.5 }),
        decl(2, D, DType::F32, BufferRole::Param { name: "bias".into() }),
        decl(3, D * F, DType::F32, BufferRole::Param { name: "w".into() }),
        decl(4, ROWS * D, DType::F32, BufferRole::Scratch { offset: 0 }),
        decl(5, ROWS * F, DType::F32, BufferRole::Scratch { offset: ROWS * D }),
        decl(6, ROWS * F, DType::F32, output("y")),
        decl(7, D * F, DType::F32, BufferRole::Grad { name: "w".into() }),
    ];
    let gemm = |a, b, c, m, n, k, trans_a, accumulate| {
        Step::Gemm(Gemm {
            a,
            b,
            c,
            batch: 1,
            m,
            n,
            k,
            trans_a,
            trans_b: false,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            offsets: [0; 3],
            accumulate,
        })
    };
    Plan {
        kernels: vec![scale_bias(ROWS, D, Grid::DEFAULT_BLOCK), rms_rows(ROWS, F, 32, EPS)],
        steps: vec![
            Step::Kernel { kernel: 0, args: vec![X, SCALE, BIAS, H] },
            gemm(H, W, P, ROWS, F, D, false, false),
            Step::Kernel { kernel: 1, args: vec![P, Y] },
            Step::Zero { buffer: G },
            gemm(H, P, G, D, F, ROWS, true, true),
            gemm(H, P, G, D, F, ROWS, true, true),
        ],
        buffers,
        arena_len: ROWS * D + ROWS * F,
        update_start: None,
        chains: vec![],
    }
}

/// f64 matrix product of row-major `a` [m, k] (or its stored transpose) and `b` [k, n].
fn matmul(a: &[f32], b: &[f32], m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> Vec<f64> {
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| {
                    let av = if trans_a { a[p * m + i] } else { a[i * k + p] };
                    let bv = if trans_b { b[j * k + p] } else { b[p * n + j] };
                    f64::from(av) * f64::from(bv)
                })
                .sum();
        }
    }
    c
}

fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() <= rel * scale, "{what}[{i}]: got {g}, want {w} (scale {scale})");
    }
}

fn load(plan: Plan, cache: &TempCache, threads: usize) -> CpuDevice {
    CpuDevice::with_options(plan, &cache.compiler(), CpuOptions { threads }).expect("plan loads")
}

fn fill(dev: &mut CpuDevice) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x, bias, w) = (data(ROWS * D, 1, 2.0), data(D, 2, 0.5), data(D * F, 3, 0.2));
    dev.write_f32(X, &x).unwrap();
    dev.write_f32(BIAS, &bias).unwrap();
    dev.write_f32(W, &w).unwrap();
    (x, bias, w)
}

#[test]
fn plan_matches_rust() {
    let cache = TempCache::new("matches");
    let mut dev = load(test_plan(), &cache, 4);
    let (x, bias, w) = fill(&mut dev);
    // Stale gradient values must be cleared by the Zero step.
    dev.write_f32(G, &vec![7.0; D * F]).unwrap();
    dev.run().unwrap();

    let h: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * 0.5 + bias[i % D]).collect();
    let h64: Vec<f64> = h.iter().map(|&v| f64::from(v)).collect();
    assert_close(dev.read_f32(H).unwrap(), &h64, 1e-7, "h");
    let p = matmul(&h, &w, ROWS, F, D, false, false);
    assert_close(dev.read_f32(P).unwrap(), &p, 1e-5, "p");
    let mut y = vec![0.0f64; ROWS * F];
    for r in 0..ROWS {
        let row = &p[r * F..(r + 1) * F];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / F as f64 + f64::from(EPS)).sqrt();
        for j in 0..F {
            y[r * F + j] = row[j] * inv;
        }
    }
    assert_close(dev.read_f32(Y).unwrap(), &y, 1e-5, "y");
    let p32: Vec<f32> = dev.read_f32(P).unwrap().to_vec();
    let g: Vec<f64> = matmul(&h, &p32, D, F, ROWS, true, false).iter().map(|v| 2.0 * v).collect();
    assert_close(dev.read_f32(G).unwrap(), &g, 1e-5, "g");

    // A second run gives the same results: Zero re-clears the accumulator.
    let first: Vec<f32> = dev.read_f32(G).unwrap().to_vec();
    dev.run().unwrap();
    assert_eq!(dev.read_f32(G).unwrap(), first.as_slice());
}

#[test]
fn threads_give_bitwise_identical_results() {
    let cache = TempCache::new("threads");
    let run = |threads: usize| {
        let mut dev = load(test_plan(), &cache, threads);
        assert_eq!(dev.threads(), threads);
        // Both kernels are large enough to use every thread.
        assert_eq!((dev.step_threads(0), dev.step_threads(2)), (Some(threads), Some(threads)));
        fill(&mut dev);
        dev.run().unwrap();
        [H, P, Y, G].map(|b| dev.read_f32(b).unwrap().to_vec())
    };
    let one = run(1);
    for threads in [2, 3, 4] {
        let many = run(threads);
        for (name, (a, b)) in ["h", "p", "y", "g"].iter().zip(one.iter().zip(&many)) {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{name} differs between 1 and {threads} threads");
        }
    }
}

/// Batched, transposed and broadcast GEMMs against a naive product.
#[test]
fn gemm_strides_transposes_and_broadcast() {
    let cache = TempCache::new("gemm");
    let (batch, m, n, k) = (3, 5, 7, 4);
    for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
        let buffers = vec![
            decl(0, batch * m * k, DType::F32, input("a")),
            decl(1, k * n, DType::F32, input("b")),
            decl(2, batch * m * n, DType::F32, output("c")),
        ];
        let step = Gemm {
            a: BufferId(0),
            b: BufferId(1),
            c: BufferId(2),
            batch,
            m,
            n,
            k,
            trans_a,
            trans_b,
            stride_a: m * k,
            stride_b: 0,
            stride_c: m * n,
            offsets: [0; 3],
            accumulate: true,
        };
        let plan = Plan {
            kernels: vec![],
            steps: vec![Step::Gemm(step)],
            buffers,
            arena_len: 0,
            update_start: None,
            chains: vec![],
        };
        let mut dev = load(plan, &cache, 2);
        let (a, b, c0) = (data(batch * m * k, 4, 1.0), data(k * n, 5, 1.0), data(batch * m * n, 6, 1.0));
        dev.write_f32(BufferId(0), &a).unwrap();
        dev.write_f32(BufferId(1), &b).unwrap();
        dev.write_f32(BufferId(2), &c0).unwrap();
        dev.run().unwrap();
        let mut want = Vec::new();
        for i in 0..batch {
            let prod = matmul(&a[i * m * k..(i + 1) * m * k], &b, m, n, k, trans_a, trans_b);
            want.extend(prod.iter().zip(&c0[i * m * n..]).map(|(p, &c)| p + f64::from(c)));
        }
        assert_close(dev.read_f32(BufferId(2)).unwrap(), &want, 1e-6, &format!("c ({trans_a}, {trans_b})"));
    }
}

/// GEMMs large enough to be split over the threads, by batch entries, by
/// row bands, by column bands (uneven parts with 3 threads) and by chunks of
/// a long contraction (a small output), against a naive product, and bitwise
/// equal to the single-threaded result.
#[test]
fn gemm_split_over_threads() {
    let cache = TempCache::new("gemm-split");
    // (batch, m, n, k): split by batch, by rows (m >= n), by columns (n > m),
    // by the contraction (16 x 8 outputs over 9001 steps).
    for (batch, m, n, k) in [(4, 24, 24, 32), (1, 97, 40, 32), (1, 24, 101, 32), (1, 16, 8, 9001)] {
        for (trans_a, trans_b) in [(false, false), (true, true)] {
            let buffers = vec![
                decl(0, batch * m * k, DType::F32, input("a")),
                decl(1, batch * k * n, DType::F32, input("b")),
                decl(2, batch * m * n, DType::F32, output("c")),
            ];
            let step = Gemm {
                a: BufferId(0),
                b: BufferId(1),
                c: BufferId(2),
                batch,
                m,
                n,
                k,
                trans_a,
                trans_b,
                stride_a: m * k,
                stride_b: k * n,
                stride_c: m * n,
                offsets: [0; 3],
                accumulate: false,
            };
            let (a, b) = (data(batch * m * k, 7, 1.0), data(batch * k * n, 8, 1.0));
            let run = |threads: usize| {
                let buffers = buffers.clone();
                let plan = Plan {
                    kernels: vec![],
                    steps: vec![Step::Gemm(step.clone())],
                    buffers,
                    arena_len: 0,
                    update_start: None,
                    chains: vec![],
                };
                let mut dev = load(plan, &cache, threads);
                dev.write_f32(BufferId(0), &a).unwrap();
                dev.write_f32(BufferId(1), &b).unwrap();
                dev.run().unwrap();
                dev.read_f32(BufferId(2)).unwrap().to_vec()
            };
            let what = format!("{batch}x{m}x{n}x{k} ({trans_a}, {trans_b})");
            let split = run(3);
            let mut want = Vec::new();
            for i in 0..batch {
                let (ai, bi) = (&a[i * m * k..(i + 1) * m * k], &b[i * k * n..(i + 1) * k * n]);
                want.extend(matmul(ai, bi, m, n, k, trans_a, trans_b));
            }
            assert_close(&split, &want, 1e-5, &what);
            let one = run(1);
            assert!(
                one.iter().zip(&split).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{what}: 1 vs 3 threads"
            );
        }
    }
}

/// The profile counts every step of every run under its label (kernel name
/// without the ordinal, `gemm MxNxK`, `zero`) and is off by default.
#[test]
fn profile_counts_steps_by_label() {
    let cache = TempCache::new("profile");
    let mut dev = load(test_plan(), &cache, 2);
    fill(&mut dev);
    if std::env::var_os("WIDEN_PROFILE").is_none() {
        assert!(dev.profile().is_none(), "profiling is off unless asked for");
    }
    dev.set_profiling(true);
    dev.run().unwrap();
    dev.run().unwrap();
    dev.run_range(0..1).unwrap();
    let p = dev.profile().expect("profiling is on");
    assert_eq!(p.runs, 2, "a partial run is not a run");
    let calls = |label: &str| p.rows.iter().find(|r| r.label == label).map(|r| r.calls);
    assert_eq!(calls("scale_bias"), Some(3));
    assert_eq!(calls("rms_rows"), Some(2));
    assert_eq!(calls("zero"), Some(2));
    assert_eq!(calls(&format!("gemm {ROWS}x{F}x{D}")), Some(2));
    assert_eq!(calls(&format!("gemm {D}x{F}x{ROWS}")), Some(4), "two steps share a label");
    assert!(p.rows.windows(2).all(|w| w[0].seconds >= w[1].seconds), "slowest first");
    assert!(p.to_string().contains("scale_bias"));
    dev.set_profiling(false);
    assert!(dev.profile().is_none());
}

/// Two kernels of one op (`g<ordinal>_` names, as the compiler gives every
/// layer's): one row by label, a row each by kernel (`WIDEN_PROFILE=kernels`).
#[test]
fn profile_by_kernel_keeps_the_kernels_of_one_op_apart() {
    let cache = TempCache::new("profile-kernels");
    let mut plan = test_plan();
    plan.kernels[0].name = "g000_scale_bias".into();
    let mut again = plan.kernels[0].clone();
    again.name = "g001_scale_bias".into();
    plan.kernels.push(again);
    plan.steps.insert(1, Step::Kernel { kernel: 2, args: vec![X, SCALE, BIAS, H] });
    let mut dev = load(plan, &cache, 2);
    fill(&mut dev);
    dev.set_profiling(true);
    dev.run().unwrap();
    let by_label = dev.profile().expect("profiling is on");
    let by_kernel = dev.profile_by(ProfileRows::Kernel).expect("profiling is on");
    let calls = |p: &Profile, label: &str| p.rows.iter().find(|r| r.label == label).map(|r| r.calls);
    assert_eq!(calls(&by_label, "scale_bias"), Some(2));
    assert_eq!(calls(&by_label, "g000_scale_bias"), None);
    assert_eq!(calls(&by_kernel, "g000_scale_bias"), Some(1));
    assert_eq!(calls(&by_kernel, "g001_scale_bias"), Some(1));
    assert_eq!(calls(&by_kernel, "scale_bias"), None);
    assert_eq!(calls(&by_kernel, &format!("gemm {D}x{F}x{ROWS}")), Some(2), "GEMMs still by shape");
    let total = |p: &Profile| p.rows.iter().map(|r| r.calls).sum::<u64>();
    assert_eq!(total(&by_kernel), total(&by_label), "the same steps, grouped otherwise");
    // `WIDEN_PROFILE=steps`: a row per step, in launch order, each labelled
    // with its index and its kernel's name or GEMM shape.
    let by_step = dev.profile_by(ProfileRows::Step).expect("profiling is on");
    let steps = dev.plan().steps.len();
    assert_eq!(by_step.rows.len(), steps, "one row per step");
    assert!(by_step.rows.iter().all(|r| r.calls == 1), "each step ran once");
    assert_eq!(by_step.rows[0].label, "   0 g000_scale_bias");
    assert_eq!(by_step.rows[1].label, "   1 g001_scale_bias", "launch order, not time order");
    let gemms: Vec<&str> =
        by_step.rows.iter().map(|r| r.label.as_str()).filter(|l| l.contains("gemm")).collect();
    assert_eq!(gemms.len(), 3, "the two steps of one GEMM shape stay apart: {gemms:?}");
    assert_eq!(total(&by_step), total(&by_label));
}

#[test]
fn unsound_plans_are_rejected_at_load() {
    let cache = TempCache::new("reject");
    let compiler = cache.compiler();
    let opts = CpuOptions { threads: 2 };
    let try_load = |plan: Plan| CpuDevice::with_options(plan, &compiler, opts).err();

    // A buffer shorter than the kernel parameter it is bound to.
    let mut short = test_plan();
    short.buffers[BIAS.0].len = D - 1;
    assert!(
        matches!(try_load(short), Some(CpuError::Plan(PlanCheckError::ParamMismatch { ref param, .. })) if param == "b")
    );

    // A kernel output placed over its own input in the arena.
    let mut aliased = test_plan();
    aliased.buffers[Y.0].role = BufferRole::Scratch { offset: ROWS * D + 10 };
    assert!(matches!(
        try_load(aliased),
        Some(CpuError::Plan(PlanCheckError::Aliased { step: 2, written: 6, other: 5, .. }))
    ));

    // A GEMM reaching past its operand.
    let mut past = test_plan();
    past.buffers[W.0].len = D * F - 1;
    assert!(matches!(try_load(past), Some(CpuError::Plan(PlanCheckError::Gemm { step: 1, .. }))));

    // Sizes whose ends overflow: a scratch placement, a buffer's bytes, a
    // GEMM's batch extent. Each is a load error, not a wrapped (short) arena.
    let mut placed = test_plan();
    placed.buffers[H.0].role = BufferRole::Scratch { offset: usize::MAX - 8 };
    assert!(matches!(try_load(placed), Some(CpuError::Plan(PlanCheckError::TooLarge { .. }))));
    let mut huge = test_plan();
    huge.buffers[Y.0].len = usize::MAX / 2;
    assert!(matches!(try_load(huge), Some(CpuError::Plan(PlanCheckError::TooLarge { .. }))));
    let mut strided = test_plan();
    if let Step::Gemm(g) = &mut strided.steps[1] {
        (g.batch, g.stride_b) = (3, usize::MAX / 2);
    }
    assert!(matches!(try_load(strided), Some(CpuError::Plan(PlanCheckError::Gemm { step: 1, .. }))));

    // Wrong arity and unknown buffers.
    let mut arity = test_plan();
    arity.steps[0] = Step::Kernel { kernel: 0, args: vec![X, SCALE, BIAS] };
    assert!(matches!(
        try_load(arity),
        Some(CpuError::Plan(PlanCheckError::Arity { got: 3, expected: 4, .. }))
    ));
    let mut unknown = test_plan();
    unknown.steps[3] = Step::Zero { buffer: BufferId(99) };
    assert!(matches!(
        try_load(unknown),
        Some(CpuError::Plan(PlanCheckError::UnknownBuffer { step: 3, id: 99, .. }))
    ));

    // Chains: a valid one loads; one past the steps, one whose kernel's items
    // do not split into its entries, one with a zeroing step, none of them.
    let chained = |start, end, entries| Plan { chains: vec![Chain { start, end, entries }], ..test_plan() };
    assert!(try_load(chained(0, 3, 1)).is_none(), "scale, product, norm over one entry");
    let rejected = |plan: Plan| matches!(try_load(plan), Some(CpuError::Plan(PlanCheckError::Chain { .. })));
    assert!(rejected(chained(4, 7, 1)), "past the last step");
    assert!(rejected(chained(0, 1, 7)), "{ROWS} rows do not split into 7 entries");
    assert!(rejected(chained(2, 4, 1)), "a zeroing step");
    assert!(rejected(chained(1, 1, 1)), "empty");
}

#[test]
fn host_access_checks_dtype_and_length() {
    let cache = TempCache::new("access");
    let mut dev = load(test_plan(), &cache, 1);
    assert!(matches!(dev.write_f32(X, &[1.0; 3]), Err(CpuError::WrongLength { id: 0, got: 3, .. })));
    assert!(matches!(dev.write_i32(X, &[1; ROWS * D]), Err(CpuError::WrongDType { id: 0, .. })));
    assert!(matches!(dev.read_f32(BufferId(42)), Err(CpuError::NoSuchBuffer { id: 42, .. })));
    // Constants are filled at load time.
    assert_eq!(dev.read_f32(SCALE).unwrap(), &[0.5]);
}

/// Views for the optimizer: persistent buffers only, each named once; what
/// is written through a view is what the device holds.
#[test]
fn persistent_views_are_disjoint_and_live() {
    let cache = TempCache::new("views");
    let mut dev = load(test_plan(), &cache, 1);
    dev.write_f32(G, &data(D * F, 5, 1.0)).unwrap();
    let (mut writes, reads) = dev.persistent_views(&[W, BIAS], &[G]).expect("disjoint persistent buffers");
    assert_eq!((writes[0].len(), writes[1].len(), reads[0].len()), (D * F, D, D * F));
    let grad = reads[0].to_vec();
    writes[0].copy_from_slice(&grad);
    assert_eq!(dev.read_f32(W).unwrap(), grad.as_slice());

    assert!(matches!(dev.persistent_views(&[W], &[W]), Err(CpuError::SharedView { id: 3 })));
    assert!(matches!(dev.persistent_views(&[], &[H]), Err(CpuError::SharedView { id: 4 })));
    assert!(matches!(dev.persistent_views(&[BufferId(42)], &[]), Err(CpuError::NoSuchBuffer { id: 42, .. })));
}

/// The optimizer update appended to a Plan (`codegen::optimizer`) on its
/// own: a parameter of several norm chunks with a gradient, one the loss
/// does not reach (updated with a zero gradient, as on the host). Against
/// the host's `global_norm`, `clip_scale` and `adamw_update`, bit for bit;
/// a loss that is not finite, or a run not asked to apply, leaves parameters
/// and moments as they were.
#[test]
fn plan_update_matches_the_host_adamw() {
    use codegen::optimizer::{
        append_adamw, moment_names, rates_input, Rate, Setting, GRAD_NORM_OUTPUT, SETTINGS_INPUT,
    };
    use runtime::optim::adamw::{adamw_update, AdamWStep};
    use runtime::optim::clip::{clip_scale, global_norm};
    let (w_len, b_len) = (3 * codegen::optimizer::NORM_CHUNK + 5, 7);
    let mut plan = Plan {
        kernels: vec![],
        steps: vec![],
        buffers: vec![
            decl(0, w_len, DType::F32, BufferRole::Param { name: "w".into() }),
            decl(1, w_len, DType::F32, BufferRole::Grad { name: "w".into() }),
            decl(2, b_len, DType::F32, BufferRole::Param { name: "b".into() }),
            decl(3, 1, DType::F32, BufferRole::Output { name: "loss".into() }),
        ],
        arena_len: 0,
        update_start: None,
        chains: vec![],
    };
    append_adamw(&mut plan, codegen::compile::Target::Cpu).expect("update appended");
    assert_eq!(plan.update_start, Some(0));
    let cache = TempCache::new("update");
    let mut dev = load(plan, &cache, 2);
    let find = |dev: &CpuDevice, role: BufferRole| dev.find(&role).expect("update buffer");
    let input = |name: String| BufferRole::Input { name };
    let (settings, norm_out) = (
        find(&dev, input(SETTINGS_INPUT.into())),
        find(&dev, BufferRole::Output { name: GRAD_NORM_OUTPUT.into() }),
    );
    let (w, b) = (data(w_len, 1, 1.0), data(b_len, 2, 1.0));
    let grad = data(w_len, 3, 0.5);
    let (m0, v0) = (data(w_len, 4, 0.1), data(w_len, 5, 0.1).iter().map(|x| x.abs()).collect::<Vec<f32>>());
    dev.write_f32(BufferId(0), &w).unwrap();
    dev.write_f32(BufferId(1), &grad).unwrap();
    dev.write_f32(BufferId(2), &b).unwrap();
    let [wm, wv] = moment_names("w").map(|n| find(&dev, BufferRole::OptState { name: n }));
    dev.write_f32(wm, &m0).unwrap();
    dev.write_f32(wv, &v0).unwrap();

    let h =
        AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3, grad_scale: 1.0 };
    let folded = h.folded();
    let max_norm = 0.5 * global_norm(std::slice::from_ref(&grad));
    let values = |apply: f64| {
        Setting::ALL
            .iter()
            .map(|s| match s {
                Setting::Apply => apply,
                Setting::MaxNorm => max_norm,
                Setting::Beta1 => h.beta1,
                Setting::Beta2 => h.beta2,
                Setting::Eps => h.eps,
                Setting::InvSqrtBias2 => folded.inv_sqrt_bc2,
            })
            .collect::<Vec<f64>>()
    };
    let rates: Vec<f64> =
        Rate::ALL.iter().map(|r| if *r == Rate::Decay { folded.decay } else { folded.step }).collect();
    for name in ["w", "b"] {
        dev.write_f64(find(&dev, input(rates_input(name))), &rates).unwrap();
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();

    // Not asked to apply, or a loss that is not finite: nothing moves, the norm is still reported.
    for (apply, loss) in [(0.0, 1.0f32), (1.0, f32::NAN), (1.0, f32::INFINITY)] {
        dev.write_f64(settings, &values(apply)).unwrap();
        dev.write_f32(BufferId(3), &[loss]).unwrap();
        dev.run().unwrap();
        assert_eq!(bits(dev.read_f32(BufferId(0)).unwrap()), bits(&w), "apply {apply}, loss {loss}");
        assert_eq!(bits(dev.read_f32(wm).unwrap()), bits(&m0));
        assert_eq!(
            dev.read_f64(norm_out).unwrap()[0].to_bits(),
            global_norm(&[grad.clone(), vec![0.0; b_len]]).to_bits()
        );
    }

    dev.write_f64(settings, &values(1.0)).unwrap();
    dev.write_f32(BufferId(3), &[2.5]).unwrap();
    dev.run().unwrap();
    let norm = global_norm(&[grad.clone(), vec![0.0; b_len]]);
    let scale = clip_scale(norm, Some(max_norm));
    assert!(scale < 1.0, "the clip acts");
    let (mut w1, mut m1, mut v1) = (w.clone(), m0.clone(), v0.clone());
    adamw_update(&mut w1, &grad, &mut m1, &mut v1, &AdamWStep { grad_scale: scale, ..h }, None);
    let (mut b1, mut bm, mut bv) = (b.clone(), vec![0.0; b_len], vec![0.0; b_len]);
    adamw_update(&mut b1, &vec![0.0; b_len], &mut bm, &mut bv, &AdamWStep { grad_scale: scale, ..h }, None);
    assert_eq!(bits(dev.read_f32(BufferId(0)).unwrap()), bits(&w1), "parameter");
    assert_eq!(bits(dev.read_f32(wm).unwrap()), bits(&m1), "first moment");
    assert_eq!(bits(dev.read_f32(wv).unwrap()), bits(&v1), "second moment");
    assert_eq!(bits(dev.read_f32(BufferId(2)).unwrap()), bits(&b1), "parameter without a gradient");
    assert_ne!(bits(&b1), bits(&b), "weight decay moves it");
}

/// The norm kernels' two forms (`codegen::optimizer`: one item per chunk in
/// C, one block per chunk for CUDA, whose C rendering replays the block's
/// reduction tree) give the same bits, here both run as C.
#[test]
fn norm_kernels_agree_across_target_forms() {
    use codegen::compile::Target;
    use codegen::optimizer::{append_adamw, GRAD_NORM_OUTPUT};
    let len = 2 * codegen::optimizer::NORM_CHUNK + 300;
    let cache = TempCache::new("norm-forms");
    let grad = data(len, 11, 3.0);
    let norms: Vec<u64> = [Target::Cpu, Target::Cuda]
        .into_iter()
        .map(|target| {
            let mut plan = Plan {
                kernels: vec![],
                steps: vec![],
                buffers: vec![
                    decl(0, len, DType::F32, BufferRole::Param { name: "w".into() }),
                    decl(1, len, DType::F32, BufferRole::Grad { name: "w".into() }),
                    decl(2, 1, DType::F32, BufferRole::Output { name: "loss".into() }),
                ],
                arena_len: 0,
                update_start: None,
                chains: vec![],
            };
            append_adamw(&mut plan, target).expect("update appended");
            let mut dev = load(plan, &cache, 2);
            dev.write_f32(BufferId(1), &grad).unwrap();
            dev.run().unwrap();
            let out = dev.find(&BufferRole::Output { name: GRAD_NORM_OUTPUT.into() }).unwrap();
            dev.read_f64(out).unwrap()[0].to_bits()
        })
        .collect();
    assert_eq!(norms[0], norms[1]);
    assert_eq!(norms[0], runtime::optim::clip::global_norm(&[grad]).to_bits(), "and the host's");
}

// ---------------------------------------------------------------------------------------
// Sparse MoE steps (docs/math.md §1.6): routing and grouped GEMMs on a hand-built Plan.

/// Tokens, experts per token, experts, widths of the MoE test Plan.
const MOE_TOKENS: usize = 40;
const MOE_K: usize = 2;
const MOE_E: usize = 5;
const MOE_D: usize = 24;
const MOE_F: usize = 16;
const MOE_ROWS: usize = MOE_TOKENS * MOE_K;

/// Buffers of the MoE test Plan.
const M_IDX: BufferId = BufferId(0);
const M_ROWS: BufferId = BufferId(1);
const M_TOKENS: BufferId = BufferId(2);
const M_COUNTS: BufferId = BufferId(3);
const M_X: BufferId = BufferId(4); // [rows, D]
const M_W: BufferId = BufferId(5); // [E, D, F]
const M_Y: BufferId = BufferId(6); // [rows, F] = x · w[e]
const M_DY: BufferId = BufferId(7); // [rows, F]
const M_DW: BufferId = BufferId(8); // [E, D, F] = Σ x ⊗ dy
const M_DX: BufferId = BufferId(9); // [rows, D] = dy · w[e]ᵀ
const M_DWT: BufferId = BufferId(10); // the trans_b gradient over (dy, x): [E, D, F]

/// Routing of `MOE_TOKENS` tokens' expert choices, then the forward grouped
/// product, its weight gradient, the input gradient (`trans_b`) and the
/// transposed weight gradient, as the lowering of `GroupedMatMul` emits them.
fn moe_plan(capacity: Option<usize>) -> Plan {
    use codegen::plan::{GroupedForm, GroupedGemm, MoeRoute};
    let i32s = |id, len| decl(id, len, DType::I32, BufferRole::Scratch { offset: (id - 1) * 128 });
    let buffers = vec![
        decl(0, MOE_ROWS, DType::I32, input("idx")),
        i32s(1, MOE_ROWS),
        i32s(2, MOE_ROWS),
        i32s(3, MOE_E),
        decl(4, MOE_ROWS * MOE_D, DType::F32, input("x")),
        decl(5, MOE_E * MOE_D * MOE_F, DType::F32, BufferRole::Param { name: "w".into() }),
        decl(6, MOE_ROWS * MOE_F, DType::F32, output("y")),
        decl(7, MOE_ROWS * MOE_F, DType::F32, input("dy")),
        decl(8, MOE_E * MOE_D * MOE_F, DType::F32, BufferRole::Grad { name: "w".into() }),
        decl(9, MOE_ROWS * MOE_D, DType::F32, output("dx")),
        decl(10, MOE_E * MOE_D * MOE_F, DType::F32, output("dwt")),
    ];
    let grouped = |form, a, b, c, (k, n), trans_b| {
        Step::GroupedGemm(GroupedGemm {
            form,
            a,
            b,
            c,
            counts: M_COUNTS,
            groups: MOE_E,
            m: MOE_ROWS,
            routed: capacity.map_or(MOE_ROWS, |c| MOE_ROWS.min(MOE_E * c)),
            k,
            n,
            trans_b,
        })
    };
    Plan {
        kernels: vec![],
        steps: vec![
            Step::MoeRoute(MoeRoute {
                idx: M_IDX,
                rows: M_ROWS,
                tokens: M_TOKENS,
                counts: M_COUNTS,
                assignments: MOE_ROWS,
                k: MOE_K,
                experts: MOE_E,
                capacity,
            }),
            grouped(GroupedForm::Rows, M_X, M_W, M_Y, (MOE_D, MOE_F), false),
            grouped(GroupedForm::WeightGrad, M_X, M_DY, M_DW, (MOE_D, MOE_F), false),
            grouped(GroupedForm::Rows, M_DY, M_W, M_DX, (MOE_F, MOE_D), true),
            grouped(GroupedForm::WeightGrad, M_DY, M_X, M_DWT, (MOE_F, MOE_D), true),
        ],
        buffers,
        arena_len: 0,
        update_start: None,
        chains: vec![],
    }
}

/// Expert choices with no expert 4 (its weight gradient must be zero) and expert 1
/// chosen by every token (capacity drops some of its assignments).
fn moe_choices() -> Vec<i32> {
    (0..MOE_TOKENS).flat_map(|t| [1, [0, 2, 3][t % 3]]).collect()
}

/// Runs the MoE test Plan on `threads`; returns every output and the routing.
fn run_moe(capacity: Option<usize>, threads: usize, cache: &TempCache) -> Vec<Vec<f32>> {
    let mut dev = load(moe_plan(capacity), cache, threads);
    dev.write_i32(M_IDX, &moe_choices()).unwrap();
    dev.write_f32(M_X, &data(MOE_ROWS * MOE_D, 11, 1.0)).unwrap();
    dev.write_f32(M_W, &data(MOE_E * MOE_D * MOE_F, 12, 0.5)).unwrap();
    dev.write_f32(M_DY, &data(MOE_ROWS * MOE_F, 13, 1.0)).unwrap();
    // Garbage where the steps must write zeros.
    for id in [M_Y, M_DW, M_DX, M_DWT] {
        let len = dev.read_f32(id).unwrap().len();
        dev.write_f32(id, &vec![f32::NAN; len]).unwrap();
    }
    dev.run().expect("runs");
    let ints = |id| dev.read_i32(id).unwrap().iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let mut out = vec![ints(M_ROWS), ints(M_TOKENS), ints(M_COUNTS)];
    out.extend([M_Y, M_DW, M_DX, M_DWT].map(|id| dev.read_f32(id).unwrap().to_vec()));
    out
}

#[test]
fn moe_routing_and_grouped_gemms_match_rust() {
    let cache = TempCache::new("moe");
    for capacity in [None, Some(13)] {
        let what = format!("capacity {capacity:?}");
        let out = run_moe(capacity, 2, &cache);
        // The routing is the reference executor's.
        let choices = moe_choices();
        let (rows, kept) = ir::exec::moe::route(&choices, MOE_E, capacity).unwrap();
        let as_f32 = |v: &[usize]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        assert_eq!(out[0], as_f32(&rows), "{what}: rows");
        assert_eq!(out[2], as_f32(&kept), "{what}: counts");
        assert_eq!(kept[4], 0, "expert 4 is never chosen");
        assert!(capacity.is_none() || kept[1] == 13, "{what}: expert 1 is cut to the capacity");
        for (a, &r) in rows.iter().enumerate() {
            assert_eq!(out[1][r], (a / MOE_K) as f32, "{what}: row {r} reads its token");
        }
        // Products: f64 per group, zero past the groups and for the empty group.
        let (x, w, dy) = (
            data(MOE_ROWS * MOE_D, 11, 1.0),
            data(MOE_E * MOE_D * MOE_F, 12, 0.5),
            data(MOE_ROWS * MOE_F, 13, 1.0),
        );
        let mut y = vec![0.0f64; MOE_ROWS * MOE_F];
        let mut dw = vec![0.0f64; MOE_E * MOE_D * MOE_F];
        let mut dx = vec![0.0f64; MOE_ROWS * MOE_D];
        let mut dwt = vec![0.0f64; MOE_E * MOE_D * MOE_F];
        let mut start = 0;
        for (e, &count) in kept.iter().enumerate() {
            let we = &w[e * MOE_D * MOE_F..(e + 1) * MOE_D * MOE_F];
            for r in start..start + count {
                for j in 0..MOE_F {
                    for i in 0..MOE_D {
                        let (xv, dv) = (f64::from(x[r * MOE_D + i]), f64::from(dy[r * MOE_F + j]));
                        y[r * MOE_F + j] += xv * f64::from(we[i * MOE_F + j]);
                        dw[e * MOE_D * MOE_F + i * MOE_F + j] += xv * dv;
                        dx[r * MOE_D + i] += dv * f64::from(we[i * MOE_F + j]);
                        // The transposed form over (dy, x): [E, D, F] again, Σ x ⊗ dy.
                        dwt[e * MOE_D * MOE_F + i * MOE_F + j] += dv * xv;
                    }
                }
            }
            start += count;
        }
        assert!(capacity.is_none() || start < MOE_ROWS, "{what}: dropped rows exist");
        for (got, want, name) in
            [(&out[3], &y, "y"), (&out[4], &dw, "dw"), (&out[5], &dx, "dx"), (&out[6], &dwt, "dwt")]
        {
            assert_close(got, want, 1e-5, &format!("{what}: {name}"));
        }
        // Thread counts give the same bits: groups shared out whole (2 and 3 threads
        // over 4 non-empty groups) or each split over the threads (1 and 8).
        for threads in [1, 3, 8] {
            let other = run_moe(capacity, threads, &cache);
            for (a, b) in out.iter().zip(&other) {
                assert!(
                    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{what}: {threads} threads"
                );
            }
        }
    }
}

#[test]
fn malformed_moe_steps_are_rejected() {
    use codegen::plan::Step::{GroupedGemm, MoeRoute};
    let cache = TempCache::new("moe-reject");
    let compiler = cache.compiler();
    let try_load = |plan: Plan| CpuDevice::with_options(plan, &compiler, CpuOptions { threads: 2 }).err();
    let grouped_error = |plan: Plan, what: &str| match try_load(plan) {
        Some(CpuError::Plan(PlanCheckError::Grouped { what: message, .. })) => {
            assert!(message.contains(what), "{message}")
        }
        other => panic!("expected a grouped GEMM error naming {what}, got {other:?}"),
    };

    // Counts that are not i32.
    let mut float_counts = moe_plan(None);
    float_counts.buffers[M_COUNTS.0].dtype = DType::F32;
    assert!(matches!(
        try_load(float_counts.clone()),
        Some(CpuError::Plan(PlanCheckError::Route { step: 0, .. }))
    ));
    float_counts.steps.remove(0);
    grouped_error(float_counts, "counts");
    // Sizes past an operand: more rows than x holds, a wider product than w holds.
    let mut rows = moe_plan(None);
    if let GroupedGemm(g) = &mut rows.steps[1] {
        g.m = MOE_ROWS + 1;
    }
    grouped_error(rows, "operand a");
    let mut wide = moe_plan(None);
    if let GroupedGemm(g) = &mut wide.steps[1] {
        g.n = MOE_F + 1;
    }
    grouped_error(wide, "operand b");
    // More kept rows than routed ones.
    let mut kept = moe_plan(None);
    if let GroupedGemm(g) = &mut kept.steps[1] {
        g.routed = MOE_ROWS + 1;
    }
    grouped_error(kept, "keeps");
    // An output over an input.
    let mut aliased = moe_plan(None);
    if let GroupedGemm(g) = &mut aliased.steps[2] {
        g.c = M_X;
        g.form = codegen::plan::GroupedForm::Rows;
        (g.k, g.n) = (MOE_D, MOE_D);
    }
    assert!(matches!(try_load(aliased), Some(CpuError::Plan(PlanCheckError::Grouped { step: 2, .. }))));
    // A routing output over another, and a routing of too many assignments.
    let mut route_aliased = moe_plan(None);
    route_aliased.buffers[M_TOKENS.0].role = BufferRole::Scratch { offset: 10 };
    assert!(matches!(try_load(route_aliased), Some(CpuError::Plan(PlanCheckError::Route { step: 0, .. }))));
    let mut long = moe_plan(None);
    if let MoeRoute(r) = &mut long.steps[0] {
        r.assignments = MOE_ROWS + 2;
    }
    assert!(matches!(try_load(long), Some(CpuError::Plan(PlanCheckError::Route { step: 0, .. }))));

    // At run time: an expert index out of range is an error, not an access past counts.
    let mut dev =
        CpuDevice::with_options(moe_plan(None), &compiler, CpuOptions { threads: 2 }).expect("loads");
    let mut choices = moe_choices();
    choices[7] = MOE_E as i32;
    dev.write_i32(M_IDX, &choices).unwrap();
    assert!(matches!(dev.run(), Err(CpuError::Step { step: 0, ref what }) if what.contains("out of range")));

    // A grouped product whose routing keeps more rows than it claims (a dropless route
    // under a product costed for a capacity) is refused, not counted short.
    let mut short = moe_plan(None);
    if let GroupedGemm(g) = &mut short.steps[1] {
        g.routed = MOE_ROWS - 1;
    }
    let mut dev = CpuDevice::with_options(short, &compiler, CpuOptions { threads: 2 }).expect("loads");
    dev.write_i32(M_IDX, &moe_choices()).unwrap();
    assert!(matches!(dev.run(), Err(CpuError::Step { step: 1, ref what }) if what.contains("keeps at most")));
}
