//! The Cuda device.
//!
//! Everywhere: the typed error without a driver, and the pure pieces that
//! decide what the GPU is asked to do (launch configurations, the row-major
//! to column-major cuBLAS mapping, arena placement), checked against plain
//! Rust. On a machine with a CUDA driver (scripts/gpu_check.sh runs this
//! binary there), the `gpu_*` tests also run a hand-built Plan on the GPU
//! against an f64 host reference; without one they return after checking
//! that the device reports the missing driver.

mod common;

use codegen::kernel::Grid;
use codegen::plan::{BufferId, BufferRole, Gemm, Plan, Step};
use common::plan::{data, decl, rms_rows, scale_bias};
use ir::DType;
use runtime::device::cuda::{
    column_major_gemm, copy_bandwidth, driver_available, launch_config, probe, BlasGemm, CudaDevice,
    CudaError, Layout, Placement,
};
use runtime::device::plan_check::PlanCheckError;

fn scratch(offset: usize) -> BufferRole {
    BufferRole::Scratch { offset }
}

// ---------------------------------------------------------------- no driver

#[test]
fn missing_driver_is_a_typed_error_naming_libcuda() {
    let plan = Plan {
        kernels: vec![],
        steps: vec![],
        buffers: vec![],
        arena_len: 0,
        update_start: None,
        chains: vec![],
    };
    match CudaDevice::new(plan) {
        Err(e @ CudaError::NoCudaDriver) => {
            assert!(!driver_available());
            let msg = e.to_string();
            assert!(msg.contains("libcuda"), "{msg}");
            assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
            assert!(matches!(probe(), Err(CudaError::NoCudaDriver)));
            assert!(matches!(copy_bandwidth(1 << 20, 1), Err(CudaError::NoCudaDriver)));
        }
        Ok(dev) => assert!(driver_available(), "a device without a driver: {dev:?}"),
        Err(e) => assert!(driver_available(), "with no driver the error must be NoCudaDriver, got {e}"),
    }
}

// ---------------------------------------------------------------- launch configs

#[test]
fn thread_per_item_launch_rounds_blocks_up() {
    let cfg = launch_config(&Grid::ThreadPerItem { n: 1000, block: 256 }).unwrap().unwrap();
    assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((4, 1, 1), (256, 1, 1), 0));
    let cfg = launch_config(&Grid::ThreadPerItem { n: 1024, block: 256 }).unwrap().unwrap();
    assert_eq!(cfg.grid_dim, (4, 1, 1));
    let cfg = launch_config(&Grid::ThreadPerItem { n: 1025, block: 128 }).unwrap().unwrap();
    assert_eq!((cfg.grid_dim, cfg.block_dim), ((9, 1, 1), (128, 1, 1)));
}

#[test]
fn block_per_item_launch_is_one_block_per_item() {
    let cfg = launch_config(&Grid::BlockPerItem { n: 7, threads: 64 }).unwrap().unwrap();
    assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((7, 1, 1), (64, 1, 1), 0));
}

#[test]
fn empty_and_oversized_grids() {
    assert!(launch_config(&Grid::ThreadPerItem { n: 0, block: 256 }).unwrap().is_none());
    assert!(launch_config(&Grid::BlockPerItem { n: 4, threads: 2048 }).is_err());
    assert!(launch_config(&Grid::ThreadPerItem { n: 4, block: 0 }).is_err());
    assert!(launch_config(&Grid::BlockPerItem { n: 1 << 32, threads: 32 }).is_err());
}

// ---------------------------------------------------------------- cuBLAS mapping

/// cuBLAS `sgemm_strided_batched` (alpha = 1) on host column-major arrays,
/// as the cuBLAS documentation defines it.
fn host_blas(call: &BlasGemm, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
    let (lda, ldb, ldc) = (call.lda as usize, call.ldb as usize, call.ldc as usize);
    for batch in 0..call.batch as usize {
        let ao = call.a_offset + batch * call.stride_a as usize;
        let bo = call.b_offset + batch * call.stride_b as usize;
        let co = call.c_offset + batch * call.stride_c as usize;
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| {
                        let av = if call.trans_a { a[ao + p + i * lda] } else { a[ao + i + p * lda] };
                        let bv = if call.trans_b { b[bo + j + p * ldb] } else { b[bo + p + j * ldb] };
                        f64::from(av) * f64::from(bv)
                    })
                    .sum();
                let old = f64::from(c[co + i + j * ldc]);
                c[co + i + j * ldc] = (s + f64::from(call.beta) * old) as f32;
            }
        }
    }
}

/// The Plan's row-major semantics: for each batch entry in order,
/// `c[b] (=|+=) op(a[b]) @ op(b[b])`.
fn row_major(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (g.m, g.n, g.k);
    for batch in 0..g.batch {
        let [oa, ob, oc] = g.offsets;
        let (ao, bo, co) = (oa + batch * g.stride_a, ob + batch * g.stride_b, oc + batch * g.stride_c);
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| {
                        let av = if g.trans_a { a[ao + p * m + i] } else { a[ao + i * k + p] };
                        let bv = if g.trans_b { b[bo + j * k + p] } else { b[bo + p * n + j] };
                        f64::from(av) * f64::from(bv)
                    })
                    .sum();
                let dst = &mut c[co + i * n + j];
                *dst = if g.accumulate { (f64::from(*dst) + s) as f32 } else { s as f32 };
            }
        }
    }
}

fn gemm(
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    trans: (bool, bool),
    strides: [usize; 3],
    acc: bool,
) -> Gemm {
    Gemm {
        a: BufferId(0),
        b: BufferId(1),
        c: BufferId(2),
        batch,
        m,
        n,
        k,
        trans_a: trans.0,
        trans_b: trans.1,
        stride_a: strides[0],
        stride_b: strides[1],
        stride_c: strides[2],
        offsets: [0; 3],
        accumulate: acc,
    }
}

/// Every cuBLAS-visible argument is valid (leading dimensions at least the
/// stored rows, as cuBLAS requires) and the calls reproduce the row-major product.
fn check_mapping(g: &Gemm) {
    let len = |stride: usize, size: usize, offset: usize| {
        if g.batch == 0 {
            0
        } else {
            offset + (g.batch - 1) * stride + size
        }
    };
    let a = data(len(g.stride_a, g.m * g.k, g.offsets[0]), 11, 1.0);
    let b = data(len(g.stride_b, g.k * g.n, g.offsets[1]), 12, 1.0);
    let c0 = data(len(g.stride_c, g.m * g.n, g.offsets[2]), 13, 1.0);
    let mut want = c0.clone();
    row_major(g, &a, &b, &mut want);
    let mut got = c0;
    for call in column_major_gemm(g).unwrap() {
        let rows = |trans: bool, r: i32, c: i32| if trans { c } else { r };
        assert!(call.lda >= rows(call.trans_a, call.m, call.k).max(1), "lda of {call:?}");
        assert!(call.ldb >= rows(call.trans_b, call.k, call.n).max(1), "ldb of {call:?}");
        assert!(call.ldc >= call.m.max(1), "ldc of {call:?}");
        // The swapped operands: cuBLAS's A is the Plan's b and vice versa.
        assert_eq!((call.a, call.b, call.c), (g.b, g.a, g.c));
        host_blas(&call, &b, &a, &mut got);
    }
    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{g:?}: c[{i}] = {x}, want {y}");
    }
}

#[test]
fn column_major_mapping_matches_row_major_for_every_transpose() {
    for trans in [(false, false), (true, false), (false, true), (true, true)] {
        for acc in [false, true] {
            check_mapping(&gemm(3, 5, 4, 1, trans, [0, 0, 0], acc));
            check_mapping(&gemm(3, 5, 4, 3, trans, [12, 20, 15], acc));
            check_mapping(&gemm(6, 2, 7, 2, trans, [50, 14, 13], acc));
            // Sub-blocks of larger buffers (causal attention's key prefixes).
            check_mapping(&Gemm { offsets: [5, 3, 7], ..gemm(3, 5, 4, 3, trans, [12, 20, 15], acc) });
        }
    }
}

#[test]
fn column_major_mapping_broadcasts_zero_strides() {
    for trans in [(false, false), (true, true)] {
        // Shared weight (b) across the batch, and a shared left operand.
        check_mapping(&gemm(4, 3, 5, 3, trans, [20, 0, 12], false));
        check_mapping(&gemm(4, 3, 5, 3, trans, [0, 15, 12], true));
    }
    let calls = column_major_gemm(&gemm(4, 3, 5, 3, (false, false), [20, 0, 12], false)).unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].stride_a, calls[0].stride_b, calls[0].batch), (0, 20, 3));
}

#[test]
fn shared_output_runs_one_call_per_batch_entry() {
    // c += a[b]^T @ p[b] summed over the batch (a weight gradient).
    let g = gemm(4, 3, 6, 5, (true, false), [24, 18, 0], true);
    let calls = column_major_gemm(&g).unwrap();
    assert_eq!(calls.len(), 5);
    assert!(calls.iter().all(|c| c.batch == 1 && c.beta == 1.0 && c.c_offset == 0));
    assert_eq!(calls[2].b_offset, 48);
    check_mapping(&g);
    // Overwriting: the last entry wins, as in the sequential Plan semantics.
    check_mapping(&gemm(4, 3, 6, 5, (false, true), [24, 18, 0], false));
}

#[test]
fn empty_products_need_no_call_and_k0_clears() {
    assert!(column_major_gemm(&gemm(0, 3, 4, 1, (false, false), [0; 3], false)).unwrap().is_empty());
    assert!(column_major_gemm(&gemm(3, 4, 5, 0, (false, false), [0; 3], false)).unwrap().is_empty());
    check_mapping(&gemm(3, 4, 0, 2, (false, false), [0, 0, 12], false));
    assert!(column_major_gemm(&gemm(1 << 31, 1, 1, 1, (false, false), [0; 3], false)).is_err());
}

// ---------------------------------------------------------------- arena layout

#[test]
fn scratch_buffers_share_one_arena_per_dtype() {
    let plan = Plan {
        kernels: vec![],
        steps: vec![],
        buffers: vec![
            decl(0, 10, DType::F32, BufferRole::Param { name: "w".into() }),
            decl(1, 8, DType::F32, scratch(0)),
            decl(2, 6, DType::F32, scratch(40)),
            decl(3, 5, DType::I32, scratch(3)),
            decl(4, 4, DType::F64, scratch(0)),
        ],
        arena_len: 32,
        update_start: None,
        chains: vec![],
    };
    let layout = Layout::of(&plan).unwrap();
    assert_eq!(
        layout.placements,
        vec![
            Placement::Own,
            Placement::Arena { offset: 0 },
            Placement::Arena { offset: 40 },
            Placement::Arena { offset: 3 },
            Placement::Arena { offset: 0 },
        ]
    );
    // f32 covers both the declared 32 and offset 40 + 6; i32 and f64 their own extents.
    assert_eq!(layout.arena_len, [46, 4, 0, 8]);
}

#[test]
fn buffer_ids_must_match_positions() {
    let plan = Plan {
        kernels: vec![],
        steps: vec![],
        buffers: vec![decl(0, 1, DType::F32, scratch(0)), decl(2, 1, DType::F32, scratch(1))],
        arena_len: 2,
        update_start: None,
        chains: vec![],
    };
    assert!(matches!(Layout::of(&plan), Err(CudaError::Plan(PlanCheckError::BufferId { index: 1, id: 2 }))));
}

// ---------------------------------------------------------------- on a GPU

const ROWS: usize = 300;
const D: usize = 40;
const F: usize = 24;

/// x -> h = x * 0.5 + bias -> p = h @ w -> y = rms_rows(p);
/// g = 0, g += h^T @ p twice (accumulated weight-gradient shape);
/// q[b] = h3[b] @ w for 3 batch entries of 100 rows with w broadcast.
fn gpu_plan() -> Plan {
    let role = |name: &str| BufferRole::Param { name: name.into() };
    let buffers = vec![
        decl(0, ROWS * D, DType::F32, BufferRole::Input { name: "x".into() }),
        decl(1, 1, DType::F32, BufferRole::Constant { value: 0.5 }),
        decl(2, D, DType::F32, role("bias")),
        decl(3, D * F, DType::F32, role("w")),
        decl(4, ROWS * D, DType::F32, scratch(0)),
        decl(5, ROWS * F, DType::F32, scratch(ROWS * D)),
        decl(6, ROWS * F, DType::F32, BufferRole::Output { name: "y".into() }),
        decl(7, D * F, DType::F32, BufferRole::Grad { name: "w".into() }),
        decl(8, ROWS * F, DType::F32, BufferRole::Output { name: "q".into() }),
    ];
    let mm = |a, b, c, (m, n, k): (usize, usize, usize), trans_a, acc, batch, strides: [usize; 3]| {
        Step::Gemm(Gemm {
            a: BufferId(a),
            b: BufferId(b),
            c: BufferId(c),
            batch,
            m,
            n,
            k,
            trans_a,
            trans_b: false,
            stride_a: strides[0],
            stride_b: strides[1],
            stride_c: strides[2],
            offsets: [0; 3],
            accumulate: acc,
        })
    };
    Plan {
        kernels: vec![scale_bias(ROWS, D, 128), rms_rows(ROWS, F, 64, 1e-5)],
        steps: vec![
            Step::Kernel { kernel: 0, args: vec![BufferId(0), BufferId(1), BufferId(2), BufferId(4)] },
            mm(4, 3, 5, (ROWS, F, D), false, false, 1, [0; 3]),
            Step::Kernel { kernel: 1, args: vec![BufferId(5), BufferId(6)] },
            Step::Zero { buffer: BufferId(7) },
            mm(4, 5, 7, (D, F, ROWS), true, true, 1, [0; 3]),
            mm(4, 5, 7, (D, F, ROWS), true, true, 1, [0; 3]),
            mm(4, 3, 8, (ROWS / 3, F, D), false, false, 3, [ROWS / 3 * D, 0, ROWS / 3 * F]),
        ],
        buffers,
        arena_len: ROWS * D + ROWS * F,
        update_start: None,
        chains: vec![],
    }
}

fn matmul(a: &[f64], b: &[f64], m: usize, n: usize, k: usize, trans_a: bool) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] =
                (0..k).map(|p| if trans_a { a[p * m + i] } else { a[i * k + p] } * b[p * n + j]).sum();
        }
    }
    c
}

/// Relative error ‖got − want‖ / ‖want‖, NaN never passing.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let e = (num / den.max(1e-300)).sqrt();
    if e.is_nan() {
        f64::INFINITY
    } else {
        e
    }
}

#[test]
fn gpu_plan_matches_f64_reference() {
    if !driver_available() {
        eprintln!("no CUDA driver: GPU execution not checked here (scripts/gpu_check.sh runs it)");
        return;
    }
    let mut dev = CudaDevice::new(gpu_plan()).expect("plan loads on the GPU");
    let (x, bias, w) = (data(ROWS * D, 1, 2.0), data(D, 2, 0.5), data(D * F, 3, 0.2));
    dev.write_f32(BufferId(0), &x).unwrap();
    dev.write_f32(BufferId(2), &bias).unwrap();
    dev.write_f32(BufferId(3), &w).unwrap();
    // Poison outputs: the Zero step and the kernels must overwrite them.
    dev.write_f32(BufferId(7), &vec![7.0; D * F]).unwrap();
    dev.write_f32(BufferId(6), &vec![f32::NAN; ROWS * F]).unwrap();
    dev.write_f32(BufferId(8), &vec![f32::NAN; ROWS * F]).unwrap();
    for _ in 0..2 {
        dev.run().unwrap();
    }

    let h: Vec<f64> =
        x.iter().enumerate().map(|(i, &v)| f64::from(v) * 0.5 + f64::from(bias[i % D])).collect();
    let w64: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
    let p = matmul(&h, &w64, ROWS, F, D, false);
    let y: Vec<f64> = p
        .chunks(F)
        .flat_map(|row| {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / F as f64 + 1e-5).sqrt();
            row.iter().map(move |v| v * r).collect::<Vec<_>>()
        })
        .collect();
    let g: Vec<f64> = matmul(&h, &p, D, F, ROWS, true).iter().map(|v| 2.0 * v).collect();
    for (id, want, what) in [(4, &h, "h"), (5, &p, "p"), (6, &y, "y"), (7, &g, "g"), (8, &p, "q")] {
        let got = dev.read_f32(BufferId(id)).unwrap();
        let e = rel_err(&got, want);
        assert!(e < 1e-5, "{what}: relative error {e:e}");
    }
    assert_eq!(dev.arch(), "sm_90", "the GPU machines are H200s");

    let timings = dev.profile(3).unwrap();
    assert_eq!(timings.len(), gpu_plan().steps.len());
    assert!(timings.iter().all(|t| t.ms.is_finite() && t.ms >= 0.0));
    assert_eq!(timings[0].bytes, 4 * (2 * ROWS * D + 1 + D) as u64);
    assert!(copy_bandwidth(64 << 20, 3).unwrap() > 1e11, "device copies run at over 100 GB/s");
}

#[test]
fn gpu_rejects_mismatched_uploads() {
    if !driver_available() {
        return;
    }
    let mut dev = CudaDevice::new(gpu_plan()).expect("plan loads on the GPU");
    assert!(matches!(dev.write_f32(BufferId(0), &[1.0; 3]), Err(CudaError::WrongLength { id: 0, .. })));
    assert!(matches!(dev.write_i32(BufferId(0), &vec![1; ROWS * D]), Err(CudaError::WrongDType { .. })));
    assert!(matches!(dev.read_f32(BufferId(99)), Err(CudaError::NoSuchBuffer { id: 99, .. })));
}

#[test]
fn gpu_plan_kernels_compile_for_sm_90_without_spills() {
    if !codegen::nvrtc::is_available() {
        eprintln!("NVRTC not on LD_LIBRARY_PATH: CUDA compile not checked here");
        return;
    }
    let plan = gpu_plan();
    let source = codegen::render::render_cuda(&plan.kernels).unwrap();
    let compiled = codegen::nvrtc::compile(&source, "sm_90").unwrap();
    for k in &plan.kernels {
        let r = compiled.resources_of(&k.symbol()).expect("ptxas reports every kernel");
        assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "{}", k.name);
    }
    assert!(compiled.ptx.contains(".visible .entry widen_rms_rows("), "extern \"C\" names survive");
}

#[test]
fn malformed_plans_are_rejected_before_touching_the_gpu() {
    let with_steps = |steps: Vec<Step>| Plan { steps, ..gpu_plan() };
    let launch =
        |args: Vec<usize>| Step::Kernel { kernel: 0, args: args.into_iter().map(BufferId).collect() };
    let err = |plan| CudaDevice::new(plan).expect_err("malformed plan");
    assert!(matches!(
        err(with_steps(vec![launch(vec![0, 1, 2])])),
        CudaError::Plan(PlanCheckError::Arity { got: 3, expected: 4, .. })
    ));
    // w (D * F elements) bound where x (ROWS * D) is expected.
    assert!(matches!(
        err(with_steps(vec![launch(vec![3, 1, 2, 4])])),
        CudaError::Plan(PlanCheckError::ParamMismatch { id: 3, want_len, .. }) if want_len == ROWS * D
    ));
    assert!(matches!(
        err(with_steps(vec![launch(vec![0, 1, 2, 42])])),
        CudaError::Plan(PlanCheckError::UnknownBuffer { id: 42, .. })
    ));
    assert!(matches!(
        err(with_steps(vec![Step::Kernel { kernel: 9, args: vec![] }])),
        CudaError::Plan(PlanCheckError::UnknownKernel { .. })
    ));
    // Four batch entries of h @ w overrun q.
    let overrun =
        Gemm { batch: 4, ..gemm(ROWS / 3, F, D, 1, (false, false), [ROWS / 3 * D, 0, ROWS / 3 * F], false) };
    let overrun = Gemm { a: BufferId(4), b: BufferId(3), c: BufferId(8), ..overrun };
    assert!(matches!(
        err(with_steps(vec![Step::Gemm(overrun)])),
        CudaError::Plan(PlanCheckError::Gemm { .. })
    ));
}

// ---------------------------------------------------------------- training steps

/// Training steps with the update in the Plan (`codegen::optimizer`) on the
/// GPU against the same steps on the Cpu device, whose update matches the
/// host's bit for bit (`cpu_device_parity`): parameters within a few
/// learning rates' worth of f32 rounding after the steps, the moments back
/// through `sync_optimizer`, and the GPU's resident parameters used by a
/// later validation loss.
#[test]
fn gpu_training_steps_match_the_cpu_device() {
    use ir::spec::{AdamWSpec, ConstantSpec, ModelSpec, OptimizerSpec, ScheduleSpec};
    use runtime::device::cpu::{CpuExecutor, CpuOptions};
    use runtime::device::cuda_executor;
    use runtime::init::init_params;
    use runtime::optim::Optimizer;
    use runtime::step::{StepExecutor, UpdateSettings};
    if !driver_available() {
        eprintln!("no CUDA driver: GPU training steps not checked here (scripts/gpu_check.sh runs it)");
        return;
    }
    let mut spec =
        ModelSpec { name: "gpu-steps".into(), d_model: 32, layers: 1, heads: 2, ..ModelSpec::default() };
    spec.train.seq_len = 16;
    spec.train.batch = 2;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    let lr = 1e-2;
    spec.train.optimizer = OptimizerSpec::AdamW(AdamWSpec { lr, eps: 1e-6, ..AdamWSpec::default() });
    let lowered = || ir::lower::lower(&spec, spec.train.batch, spec.train.seq_len).expect("lower");
    let mut gpu = cuda_executor(lowered()).expect("the Plan loads on the GPU");
    let mut cpu = CpuExecutor::from_lowered(lowered(), CpuOptions { threads: 2 });
    let mut gpu_params = init_params(&lowered().graph, 0).expect("init");
    let mut cpu_params = gpu_params.clone();
    let mut gpu_opt = Optimizer::new(&spec, &gpu_params);
    let mut cpu_opt = gpu_opt.clone();
    let window = spec.train.batch * (spec.train.seq_len + 1);
    let batch = |step: usize| (0..window).map(|i| ((i * 7 + step * 13) % 256) as i32).collect::<Vec<i32>>();
    for step in 0..4 {
        let settings = UpdateSettings { lr_mult: 1.0, clip: Some(0.5) };
        let g = gpu.train_step(&mut gpu_params, &batch(step), &mut gpu_opt, settings).expect("GPU step");
        let c = cpu.train_step(&mut cpu_params, &batch(step), &mut cpu_opt, settings).expect("Cpu step");
        assert!(
            (g.loss - c.loss).abs() <= 1e-4 * c.loss.abs(),
            "step {step}: loss {} against {}",
            g.loss,
            c.loss
        );
        assert!((g.grad_norm - c.grad_norm).abs() <= 1e-4 * c.grad_norm, "step {step}: gradient norm");
    }
    assert!(gpu_opt.moments_on_device(), "the GPU's Plan ran the update");
    for (g, c) in gpu_params.iter().zip(cpu_params.iter()) {
        let diff = g.value.iter().zip(&c.value).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(f64::from(diff) <= 0.05 * lr, "`{}` differs by {diff}", g.name);
    }
    gpu.sync_optimizer(&mut gpu_opt).expect("moments from the GPU");
    cpu.sync_optimizer(&mut cpu_opt).expect("moments from the Cpu device");
    for ((name, _, g), (_, _, c)) in gpu_opt.state_tensors().into_iter().zip(cpu_opt.state_tensors()) {
        let scale = c.iter().map(|v| v.abs()).fold(1e-12f32, f32::max);
        let diff = g.iter().zip(c).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-2 * scale, "{name}: moments differ by {diff} (scale {scale})");
    }
    let tokens = batch(9);
    let resident = gpu.loss(&gpu_params, &tokens).expect("loss");
    let uploaded = gpu.loss(&gpu_params.clone(), &tokens).expect("loss");
    assert_eq!(resident.to_bits(), uploaded.to_bits(), "the GPU's parameters are the host's");
}

/// Sparse MoE dispatch (docs/math.md §1.6) on the GPU: routing on the host
/// between the kernels, one cuBLAS call per expert group. Everywhere, the
/// compiled GPU Plan passes the load-time checks and, without a driver, is
/// refused with the typed error; with one, the loss and every gradient match
/// the Cpu device's, and so do training steps (a capacity drops assignments).
#[test]
fn gpu_sparse_moe_matches_the_cpu_device() {
    use codegen::training::TrainingGraph;
    use ir::spec::{FfnSpec, ModelSpec, MoeDispatch, MoeGate, MoeSpec};
    use runtime::device::cpu::{CpuExecutor, CpuOptions};
    use runtime::device::cuda_executor;
    use runtime::init::init_params;
    use runtime::optim::Optimizer;
    use runtime::step::{StepExecutor, UpdateSettings};
    let moe = MoeSpec {
        experts: 4,
        top_k: 2,
        shared: 1,
        hidden: 16,
        gate: MoeGate::Sigmoid,
        dispatch: MoeDispatch::Sparse,
        capacity_factor: Some(0.75),
        balance: ir::spec::MoeBalance::None,
        renormalize: false,
    };
    let mut spec = ModelSpec {
        name: "gpu-sparse-moe".into(),
        d_model: 32,
        layers: 2,
        heads: 2,
        ffn: FfnSpec::Moe(moe),
        ..ModelSpec::default()
    };
    spec.train.seq_len = 16;
    spec.train.batch = 2;
    let lowered = || ir::lower::lower(&spec, spec.train.batch, spec.train.seq_len).expect("lower");
    let plan = TrainingGraph::new(lowered())
        .and_then(|g| g.plan_for(codegen::compile::Target::Cuda))
        .expect("the sparse GPU Plan compiles");
    assert_eq!(plan.steps.iter().filter(|s| matches!(s, Step::MoeRoute(_))).count(), 2, "one per layer");
    if !driver_available() {
        assert!(matches!(CudaDevice::new(plan), Err(CudaError::NoCudaDriver)));
        eprintln!("no CUDA driver: sparse MoE on the GPU not checked here (scripts/gpu_check.sh runs it)");
        return;
    }
    let mut gpu = cuda_executor(lowered()).expect("the Plan loads on the GPU");
    let mut cpu = CpuExecutor::from_lowered(lowered(), CpuOptions { threads: 2 });
    let mut gpu_params = init_params(&lowered().graph, 0).expect("init");
    let mut cpu_params = gpu_params.clone();
    let window = spec.train.batch * (spec.train.seq_len + 1);
    let batch = |step: usize| (0..window).map(|i| ((i * 7 + step * 13) % 256) as i32).collect::<Vec<i32>>();
    let (gl, gg) = gpu.loss_and_grads(&gpu_params, &batch(0)).expect("GPU loss and gradients");
    let (cl, cg) = cpu.loss_and_grads(&cpu_params, &batch(0)).expect("Cpu loss and gradients");
    assert!((gl - cl).abs() <= 1e-4 * cl.abs(), "loss {gl} against {cl}");
    for (i, (g, c)) in gg.iter().zip(&cg).enumerate() {
        let scale = c.iter().map(|v| v.abs()).fold(1e-12f32, f32::max);
        let diff = g.iter().zip(c).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-3 * scale, "gradient {i} differs by {diff} (scale {scale})");
    }
    let mut gpu_opt = Optimizer::new(&spec, &gpu_params);
    let mut cpu_opt = gpu_opt.clone();
    for step in 1..4 {
        let settings = UpdateSettings { lr_mult: 1.0, clip: Some(1.0) };
        let g = gpu.train_step(&mut gpu_params, &batch(step), &mut gpu_opt, settings).expect("GPU step");
        let c = cpu.train_step(&mut cpu_params, &batch(step), &mut cpu_opt, settings).expect("Cpu step");
        assert!(
            (g.loss - c.loss).abs() <= 1e-3 * c.loss.abs(),
            "step {step}: loss {} against {}",
            g.loss,
            c.loss
        );
    }
}
