//! The CUDA dialect executed on the CPU (`codegen::cuda_emu`): every kernel of
//! the GPU Plan of each spec (shrunk: d_model 16, one layer, seq 8, batch 2;
//! fused as the runtime fuses, kernels sized for the Cuda target, with the
//! optimizer update) runs through the emulation with the Cuda device's launch
//! geometry (`grid.cuda_blocks()` blocks of `grid.block_threads()` threads,
//! as `runtime::device::cuda::launch_config` computes it), once with the lanes
//! of each block first to last and once last to first, and must give what the
//! C dialect of the same kernel gives on the same inputs.
//!
//! The Plan runs step by step on the host (kernels in the C dialect, GEMMs as
//! plain loops, the steps cuBLAS takes on the GPU), from random parameters,
//! tokens, optimizer settings and moments, so each kernel sees the inputs it
//! would see in training; before each kernel step its argument buffers are
//! copied for the two emulated runs.
//!
//! Results are compared bit for bit, except in kernels that call the f32
//! `exp` or `tanh`: the C dialect computes those with its own vectorizable
//! polynomials (within 1 and 2 ulp of the correctly rounded values,
//! `codegen/src/render.rs`), the CUDA dialect with the device library's
//! `expf`/`tanhf`, which the emulation takes from the host's libm. Those
//! kernels are held to [`F32_TOL`] relative error (bf16 results to one bf16
//! rounding step, [`BF16_TOL`]).

mod common;

use std::ffi::c_void;
use std::path::PathBuf;
use std::time::Instant;

use codegen::cc::{Compiler, Entry};
use codegen::compile::{compile, fused_partition, Request, Target};
use codegen::cuda_emu::{EmuKernel, Emulator, LaneOrder};
use codegen::kernel::Kernel;
use codegen::plan::{BufferRole, Gemm, GroupedGemm, MoeRoute, Plan, Step};
use codegen::render::render_cuda;
use common::emit::{spec_training_graph, Rng, Sources};

use ir::exec::Value;
use ir::graph::{Graph, Op};
use ir::DType;

/// Relative error allowed where the dialects' exponentials differ (see the module docs).
const F32_TOL: f64 = 1e-4;

/// bf16 results of those kernels: one rounding step of bf16 (8 significant bits).
const BF16_TOL: f64 = 1.0 / 128.0;

/// Magnitudes below which two f32 results are both rounding noise of the O(1)
/// values the test's kernels take in (a hundredth of f32's epsilon).
const NOISE_FLOOR: f64 = 1e-9;

fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("widen-cuda-emulation")
}

fn c_compiler() -> Compiler {
    Compiler::new("cc", cache_dir()).expect("a C compiler `cc` on PATH")
}

fn emulator() -> Emulator {
    let cxx = std::env::var("CXX").ok().filter(|v| !v.trim().is_empty()).unwrap_or_else(|| "c++".into());
    let sanitizer = codegen::cuda_emu::Sanitizer::from_env().expect("a valid sanitizer setting");
    Emulator::new(&cxx, cache_dir(), sanitizer).expect("a C++ compiler on PATH")
}

/// The training Plan the Cuda device loads for `spec` at test size.
/// Also the random parameters and tokens, by buffer role.
fn gpu_plan(spec: &str) -> (Plan, Vec<(BufferRole, Value<f32>)>) {
    gpu_plan_sized(spec, 8, 16)
}

/// [`gpu_plan`] at batch 2, `seq_len` and `d_model`, one layer.
fn gpu_plan_sized(spec: &str, seq_len: usize, d_model: usize) -> (Plan, Vec<(BufferRole, Value<f32>)>) {
    let model = gpu_model(spec, seq_len, |s| {
        s.d_model = d_model;
        s.layers = 1;
    });
    (model.plan, model.named)
}

/// A spec's training graph, its Request and GPU Plan, and the random
/// parameters and tokens, by buffer role and by graph node.
struct GpuModel {
    graph: Graph,
    request: Request,
    plan: Plan,
    named: Vec<(BufferRole, Value<f32>)>,
    sources: Sources,
}

/// The [`GpuModel`] of `spec` after `edit` at batch 2 and `seq_len`.
fn gpu_model(spec: &str, seq_len: usize, edit: impl FnOnce(&mut ir::spec::ModelSpec)) -> GpuModel {
    let (graph, request, vocab) = spec_training_graph(spec, 2, seq_len, edit);
    // As `TrainingGraph::plan_for(Target::Cuda)`: the update appended, the
    // runtime's partition, kernels sized for the GPU.
    let request = request.with_update().for_target(Target::Cuda);
    let partition = fused_partition(&graph, &request).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let plan = compile(&graph, &partition, &request).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let mut rng = Rng::new(7);
    let sources = Sources::random(&graph, &mut rng, 0.1, &|_, n| {
        let mut r = Rng::new(11);
        (0..n).map(|_| r.below(vocab) as i32).collect()
    });
    let named = sources
        .values
        .iter()
        .map(|(id, v)| {
            let role = match &graph.node(*id).op {
                Op::Param(p) => BufferRole::Param { name: p.name.clone() },
                Op::Input { name } => BufferRole::Input { name: name.clone() },
                _ => unreachable!("sources are params and inputs"),
            };
            (role, v.clone())
        })
        .collect();
    GpuModel { graph, request, plan, named, sources }
}

/// A buffer's bytes, 8-byte aligned.
#[derive(Clone)]
struct Buffer {
    words: Vec<u64>,
    dtype: DType,
    len: usize,
}

impl Buffer {
    fn zeroed(dtype: DType, len: usize) -> Buffer {
        Buffer { words: vec![0; (len * dtype.size_bytes()).div_ceil(8).max(1)], dtype, len }
    }

    fn ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr().cast()
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as its bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len * self.dtype.size_bytes()) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size_bytes();
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), n) }
    }

    /// Element `i` widened to f64 (bf16 and ints converted).
    fn get(&self, i: usize) -> f64 {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => f64::from(f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())),
            DType::F64 => f64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap()),
            DType::I32 => f64::from(i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())),
            DType::Bf16 => {
                let h = u16::from_le_bytes(b[2 * i..2 * i + 2].try_into().unwrap());
                f64::from(f32::from_bits(u32::from(h) << 16))
            }
        }
    }

    fn set(&mut self, i: usize, v: f64) {
        let dtype = self.dtype;
        let b = self.bytes_mut();
        match dtype {
            DType::F32 => b[4 * i..4 * i + 4].copy_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => b[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes()),
            DType::I32 => b[4 * i..4 * i + 4].copy_from_slice(&(v as i32).to_le_bytes()),
            DType::Bf16 => {
                let u = (v as f32).to_bits();
                let h = ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16;
                b[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
    }
}

/// Every buffer of `plan` with its starting contents: parameters and tokens
/// from `sources`, the optimizer's settings and rates in (0.1, 0.9), moments
/// in [0, 1), constants their value, everything else zero.
fn initial_buffers(plan: &Plan, named: &[(BufferRole, Value<f32>)], rng: &mut Rng) -> Vec<Buffer> {
    plan.buffers
        .iter()
        .map(|d| {
            let mut b = Buffer::zeroed(d.dtype, d.len);
            let given = named.iter().find(|(role, _)| *role == d.role).map(|(_, v)| v);
            match (&d.role, given) {
                (_, Some(Value::Float(t))) => {
                    t.data.iter().enumerate().for_each(|(i, &v)| b.set(i, f64::from(v)))
                }
                (_, Some(Value::Int(t))) => {
                    t.data.iter().enumerate().for_each(|(i, &v)| b.set(i, f64::from(v)))
                }
                (BufferRole::Input { .. }, None) => {
                    (0..d.len).for_each(|i| b.set(i, 0.5 + 0.4 * f64::from(rng.uniform())))
                }
                (BufferRole::OptState { .. }, None) => {
                    (0..d.len).for_each(|i| b.set(i, 0.5 + 0.5 * f64::from(rng.uniform())))
                }
                (BufferRole::Constant { value }, None) => (0..d.len).for_each(|i| b.set(i, *value)),
                _ => {}
            }
            b
        })
        .collect()
}

/// `c (=|+=) op(a) @ op(b)` per batch entry, in f32 (bf16 operands widened).
fn gemm(g: &Gemm, bufs: &mut [Buffer]) {
    assert_eq!(bufs[g.c.0].dtype, DType::F32, "GEMM outputs are f32");
    let (a, b) = (bufs[g.a.0].clone(), bufs[g.b.0].clone());
    let c = &mut bufs[g.c.0];
    for bt in 0..g.batch {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0.0f32;
                for kk in 0..g.k {
                    let ai = if g.trans_a { kk * g.m + i } else { i * g.k + kk };
                    let bi = if g.trans_b { j * g.k + kk } else { kk * g.n + j };
                    let x = a.get(g.offsets[0] + bt * g.stride_a + ai) as f32;
                    let y = b.get(g.offsets[1] + bt * g.stride_b + bi) as f32;
                    acc += x * y;
                }
                let at = g.offsets[2] + bt * g.stride_c + i * g.n + j;
                let prev = if g.accumulate { c.get(at) as f32 } else { 0.0 };
                c.set(at, f64::from(prev + acc));
            }
        }
    }
}

/// Sparse MoE routing on the host, as the Cuda device runs it: the reference's
/// own function over the step's i32 buffers.
fn route(r: &MoeRoute, bufs: &mut [Buffer]) {
    let ints = |b: &Buffer, len: usize| (0..len).map(|i| b.get(i) as i32).collect::<Vec<i32>>();
    let idx = ints(&bufs[r.idx.0], r.assignments);
    let (mut rows, mut tokens, mut counts) =
        (vec![0; r.assignments], vec![0; r.assignments], vec![0; r.experts]);
    ir::exec::moe::route_into(&idx, r.k, r.experts, r.capacity, &mut rows, &mut tokens, &mut counts)
        .expect("routes");
    for (id, data) in [(r.rows, rows), (r.tokens, tokens), (r.counts, counts)] {
        data.iter().enumerate().for_each(|(i, &v)| bufs[id.0].set(i, f64::from(v)));
    }
}

/// A grouped GEMM as the Cuda device issues it: the zeroing of what no group
/// writes and one product per non-empty group.
fn grouped_gemm(g: &GroupedGemm, bufs: &mut [Buffer]) {
    let counts: Vec<i32> = (0..g.groups).map(|i| bufs[g.counts.0].get(i) as i32).collect();
    let (products, zeroed) = g.products(&counts).expect("group sizes fit the rows");
    for r in zeroed {
        r.for_each(|i| bufs[g.c.0].set(i, 0.0));
    }
    for p in &products {
        gemm(p, bufs);
    }
}

/// Whether a kernel calls a function the two dialects compute differently
/// (the f32 `exp` and `tanh`, see the module docs).
fn differs_in_math(k: &Kernel) -> bool {
    let src = render_cuda(std::slice::from_ref(k)).expect("renders");
    src.contains("expf(") || src.contains("tanhf(")
}

/// Runs the emulated kernel on copies of `args`' buffers; returns the copies.
fn emulate(kernel: &EmuKernel, k: &Kernel, bufs: &[Buffer], ids: &[usize], order: LaneOrder) -> Vec<Buffer> {
    let mut copies: Vec<Buffer> = ids.iter().map(|&id| bufs[id].clone()).collect();
    let ptrs: Vec<*mut c_void> = copies.iter_mut().map(Buffer::ptr).collect();
    let (blocks, threads) = (k.grid.cuda_blocks(), k.grid.block_threads());
    if blocks > 0 {
        // SAFETY: each pointer addresses a private copy of the bound buffer
        // (the Plan matched lengths and types to the parameters).
        unsafe { kernel.launch(&ptrs, blocks as u32, threads, order) }
            .unwrap_or_else(|e| panic!("{order:?}: {e}"));
    }
    copies
}

/// The largest relative difference of `got` from `want`, or `None` when they
/// are equal bit for bit. Entries are compared relative to a thousandth of the
/// buffer's largest magnitude, and never below [`NOISE_FLOOR`]: a buffer whose
/// every entry is rounding noise (the gradient of a saturated Sinkhorn
/// projection, zero in exact arithmetic, comes out near 1e-14 from O(1)
/// inputs) has no digits the two exponentials could be held to.
fn difference(got: &Buffer, want: &Buffer) -> Option<(f64, usize)> {
    if got.bytes() == want.bytes() {
        return None;
    }
    let scale = (0..want.len).map(|i| want.get(i).abs()).fold(0.0, f64::max) * 1e-3 + NOISE_FLOOR;
    let mut worst = (0.0, 0);
    for i in 0..want.len {
        let (a, b) = (got.get(i), want.get(i));
        let e = if a.is_nan() && b.is_nan() {
            0.0
        } else if a.is_nan() || b.is_nan() {
            f64::INFINITY
        } else {
            (a - b).abs() / (b.abs() + scale)
        };
        if e > worst.0 || (e.is_nan() && !worst.0.is_nan()) {
            worst = (e, i);
        }
    }
    Some(worst)
}

/// What one spec's run covered.
#[derive(Debug, Default)]
struct Coverage {
    kernels: usize,
    launches: usize,
    block_kernels: usize,
    bitwise: usize,
    tolerance: usize,
    worst: f64,
}

/// Runs the GPU Plan of `spec` on the host, checking every kernel step's
/// emulated CUDA run against its C run.
fn check_spec(spec: &str) -> Coverage {
    check_plan(spec, gpu_plan(spec)).0
}

/// [`check_spec`] for a Plan; also returns every buffer after the run.
fn check_plan(spec: &str, (plan, named): (Plan, Vec<(BufferRole, Value<f32>)>)) -> (Coverage, Vec<Buffer>) {
    let start = Instant::now();
    let c = c_compiler().compile_kernels(&plan.kernels).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let emu = emulator().compile_kernels(&plan.kernels).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let built = start.elapsed();
    let entries: Vec<(Entry, &EmuKernel)> =
        plan.kernels.iter().map(|k| (c.entry(&k.name).unwrap(), emu.kernel(&k.name).unwrap())).collect();
    let mut rng = Rng::new(3);
    let mut bufs = initial_buffers(&plan, &named, &mut rng);
    let mut cov = Coverage {
        kernels: plan.kernels.len(),
        block_kernels: plan.kernels.iter().filter(|k| k.grid.is_block()).count(),
        ..Coverage::default()
    };
    for (step_index, step) in plan.steps.iter().enumerate() {
        match step {
            Step::Kernel { kernel, args } => {
                let k = &plan.kernels[*kernel];
                let (entry, emulated) = &entries[*kernel];
                let ids: Vec<usize> = args.iter().map(|a| a.0).collect();
                let runs = [LaneOrder::Forward, LaneOrder::Reverse]
                    .map(|order| (order, emulate(emulated, k, &bufs, &ids, order)));
                let ptrs: Vec<*mut c_void> = ids.iter().map(|&id| bufs[id].ptr()).collect();
                // SAFETY: the pointers address the bound buffers, of the
                // parameters' lengths and types (the Plan's invariant); one thread.
                unsafe { entry.call(&ptrs, 0, k.grid.items() as i64) };
                let tolerant = differs_in_math(k);
                let mut exact = true;
                for (order, copies) in &runs {
                    for (p, (copy, &id)) in k.params.iter().zip(copies.iter().zip(&ids)) {
                        if !p.access.writable() {
                            continue;
                        }
                        let Some((err, at)) = difference(copy, &bufs[id]) else { continue };
                        exact = false;
                        let tol = if p.dtype == DType::Bf16 { BF16_TOL } else { F32_TOL };
                        assert!(
                            tolerant && err <= tol,
                            "{spec}: step {step_index}, kernel `{}` ({:?}), {order:?} lanes: `{}`[{at}] is {} \
                             emulated, {} in C (relative difference {err:e}{})",
                            k.name,
                            k.grid,
                            p.name,
                            copy.get(at),
                            bufs[id].get(at),
                            if tolerant { ", over the tolerance" } else { "; the kernel must match bit for bit" },
                        );
                        cov.worst = cov.worst.max(err);
                    }
                }
                cov.launches += 1;
                if exact {
                    cov.bitwise += 1;
                } else {
                    cov.tolerance += 1;
                }
            }
            Step::Gemm(g) => gemm(g, &mut bufs),
            Step::Zero { buffer } => bufs[buffer.0].bytes_mut().fill(0),
            Step::MoeRoute(r) => route(r, &mut bufs),
            Step::GroupedGemm(g) => grouped_gemm(g, &mut bufs),
        }
    }
    eprintln!(
        "{spec}: {} kernels ({} block-per-item), {} launches: {} bit for bit, {} within tolerance \
         (worst {:.1e}); compiles {:.1}s, total {:.1}s",
        cov.kernels,
        cov.block_kernels,
        cov.launches,
        cov.bitwise,
        cov.tolerance,
        cov.worst,
        built.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    assert!(cov.launches > 0, "{spec}: no kernel ran");
    (cov, bufs)
}

#[test]
fn residual_kernels_match_c() {
    check_spec("residual");
}

#[test]
fn mhc_kernels_match_c() {
    check_spec("mhc");
}

#[test]
fn mhc_bf16_kernels_match_c() {
    check_spec("mhc-bf16");
}

/// The connection language's new designs (docs/math.md §12.2, §12.3).
#[test]
fn mhc_lite_kernels_match_c() {
    check_spec("mhc-lite");
}

#[test]
fn wide_residual_kernels_match_c() {
    check_spec("wide-residual");
}

/// KromHC's Kronecker carry (docs/math.md §12.6).
#[test]
fn kromhc_kernels_match_c() {
    check_spec("kromhc");
}

/// The depth history (docs/math.md §12.5).
#[test]
fn attn_residuals_kernels_match_c() {
    check_spec("attn-residuals");
}

#[test]
fn denseformer_kernels_match_c() {
    check_spec("denseformer");
}

#[test]
fn vwn_r4_kernels_match_c() {
    check_spec("vwn-r4");
}

#[test]
fn xhc_kernels_match_c() {
    check_spec("xhc");
}

#[test]
fn xhc_flash_kernels_match_c() {
    check_spec("xhc-flash");
}

#[test]
fn moe_kernels_match_c() {
    check_spec("moe");
}

/// Sparse MoE dispatch (docs/math.md §1.6) with a capacity that drops
/// assignments, a sigmoid gate and a shared expert: the kernels of its GPU Plan
/// match C as for every spec, and the run, routing and grouped GEMMs done on the
/// host as the Cuda device does them, gives the loss and every parameter
/// gradient of the f32 reference.
#[test]
fn sparse_moe_kernels_match_c_and_the_plan_matches_the_reference() {
    let GpuModel { graph, request, plan, named, sources } = gpu_model("moe", 8, |s| {
        s.d_model = 16;
        s.layers = 1;
        s.ffn = ir::spec::FfnSpec::Moe(ir::spec::MoeSpec {
            experts: 4,
            top_k: 2,
            shared: 1,
            hidden: 8,
            gate: ir::spec::MoeGate::Sigmoid,
            dispatch: ir::spec::MoeDispatch::Sparse,
            capacity_factor: Some(0.5),
            balance: ir::spec::MoeBalance::None,
            renormalize: false,
        });
    });
    let grouped = plan.steps.iter().filter(|s| matches!(s, Step::GroupedGemm(_))).count();
    assert!(grouped > 0 && plan.steps.iter().any(|s| matches!(s, Step::MoeRoute(_))));
    let (_, bufs) = check_plan("moe sparse", (plan.clone(), named));
    let mut want: Vec<(String, BufferRole, ir::graph::NodeId)> = request
        .outputs
        .iter()
        .map(|(n, id)| (n.clone(), BufferRole::Output { name: n.clone() }, *id))
        .collect();
    for &(p, g) in &request.grads {
        let Op::Param(info) = &graph.node(p).op else { unreachable!("grads pair params") };
        want.push((format!("d {}", info.name), BufferRole::Grad { name: info.name.clone() }, g));
    }
    let roots: Vec<_> = want.iter().map(|w| w.2).collect();
    let reference = ir::exec::run::<f32>(&graph, &sources.values, &roots).expect("reference runs");
    for (name, role, id) in want {
        let buf = &bufs[plan.find(&role).unwrap_or_else(|| panic!("no buffer for {name}")).0];
        let Value::Float(t) = &reference[&id] else { panic!("{name}: not a float value") };
        let got: Vec<f32> = (0..buf.len).map(|i| buf.get(i) as f32).collect();
        let err = common::emit::rel_err(&got, &t.data);
        assert!(
            err <= 2e-4,
            "{name}: relative error {err}\n got {:?}\nwant {:?}",
            &got[..got.len().min(8)],
            &t.data[..t.data.len().min(8)]
        );
    }
}

/// At 256 tokens of width 64 the GPU Plan takes its larger forms: token
/// reductions of parameter gradients as blocks of up to 256 threads, the
/// embedding gradient a thread per column, attention's softmax a block per
/// score row.
#[test]
fn residual_kernels_at_gpu_sizes_match_c() {
    let (cov, _) = check_plan("residual d64 seq128", gpu_plan_sized("residual", 128, 64));
    assert!(cov.block_kernels > 0);
}

/// The emulation detects a missing barrier: a block reduction of the GPU Plan
/// with its `__syncthreads()` removed (in a copy of the source) no longer
/// matches the C dialect when the lanes run last to first.
#[test]
fn a_block_reduction_without_barriers_differs() {
    let (plan, named) = gpu_plan("residual");
    let mut rng = Rng::new(3);
    let bufs = initial_buffers(&plan, &named, &mut rng);
    let (kernel, args) = plan
        .steps
        .iter()
        .find_map(|s| match s {
            Step::Kernel { kernel, args }
                if plan.kernels[*kernel].grid.block_threads() > 32
                    && plan.kernels[*kernel].grid.is_block() =>
            {
                Some((&plan.kernels[*kernel], args))
            }
            _ => None,
        })
        .expect("the GPU Plan has a block reduction over more than one warp");
    let source = render_cuda(std::slice::from_ref(kernel)).unwrap();
    assert!(source.contains("__syncthreads();"), "{source}");
    let broken = source.replace("__syncthreads();", "");
    let emulator = emulator();
    let ids: Vec<usize> = args.iter().map(|a| a.0).collect();
    let c = c_compiler().compile_kernels(std::slice::from_ref(kernel)).unwrap();
    let mut want: Vec<Buffer> = ids.iter().map(|&id| bufs[id].clone()).collect();
    let ptrs: Vec<*mut c_void> = want.iter_mut().map(Buffer::ptr).collect();
    // SAFETY: private copies of the bound buffers; one thread.
    unsafe { c.entry(&kernel.name).unwrap().call(&ptrs, 0, kernel.grid.items() as i64) };
    let written = |runs: &[Buffer]| -> bool {
        kernel.params.iter().zip(runs.iter().zip(&want)).any(|(p, (got, want))| {
            p.access.writable() && difference(got, want).is_some_and(|(e, _)| e > F32_TOL)
        })
    };
    for (label, src, differs) in [("as rendered", &source, false), ("without barriers", &broken, true)] {
        let module = emulator.compile_cuda(src, std::slice::from_ref(kernel)).unwrap();
        let got = emulate(module.kernel(&kernel.name).unwrap(), kernel, &bufs, &ids, LaneOrder::Reverse);
        assert_eq!(written(&got), differs, "`{}` {label}", kernel.name);
    }
}
