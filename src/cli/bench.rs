//! `widen bench SPEC... [--device D] [--steps N] [--warmup N] [--json FILE]
//! [--profile-kernels FILE]`:
//! whole training steps (forward, backward, clipping, optimizer update) per
//! second, each spec side by side with the plain-residual model of the same
//! backbone (docs/architecture.md §10: the overhead ratio the papers report).
//!
//! Every model of the run is built up front; timed steps are then interleaved
//! (one step of each model per round) so that a noisy machine slows all of
//! them alike, and the median step time is reported. The backbone can be
//! overridden for every spec at once (`--d-model 256 --layers 4 --heads 4
//! --seq-len 256 --batch 8`); the overrides are validated like the spec.
//!
//! Each row also says what the step costs as counted from its Plan: FLOPs and
//! bytes moved. On the Cpu device the host's ceilings (peak FMA rate, streaming
//! bandwidth; `runtime::device::ceilings`) are measured before the first round
//! and after every round, the best of each kept, and each Plan's roofline
//! floor under them (every step at the larger of its arithmetic and memory
//! times) is printed next to the measured time. A scheme's least overhead is
//! its floor's excess over the baseline's floor against the baseline's
//! measured step: the overhead it would have if the steps both Plans share
//! ran as they do and every other step ran at its floor, the least that
//! kernels moving its Plan's bytes could reach on this host.
//!
//! Each row's `mem GiB` is the peak memory the model's steps are expected to
//! hold, counted from its Plan (`runtime::device::memory`); after the table the
//! process's measured peak is set against the models' estimates together, since
//! every model is resident at once.
//!
//! On the compiled devices a step is what training runs: the AdamW update in
//! the Plan, Muon on the host. `--profile-kernels FILE` (Cuda) times every
//! step of each Plan on the GPU and writes, per fused kernel, the achieved
//! bytes/s against the copy bandwidth.

use super::train::DeviceArg;
use super::{parallel_map, Backbone};
use anyhow::Context;
use codegen::plan::{BufferRole, Step};
use codegen::training::TrainingGraph;
use ir::spec::{load_spec, ModelSpec, ResidualSpec};
use runtime::data::{BatchSampler, Corpus};
use runtime::device::ceilings::{self, CpuCeilings};
use runtime::device::cpu::{CpuExecutor, CpuOptions};
use runtime::device::cuda::{copy_bandwidth, CudaExecutor};
use runtime::device::memory::{self, MeasuredPeak, Memory, PeakEstimate, Workload};
use runtime::device::{cuda_executor, Device};
use runtime::init::init_params;
use runtime::optim::schedule::lr_multiplier;
use runtime::optim::Optimizer;
use runtime::params::ParamSet;
use runtime::step::{StepExecutor, StepStats, UpdateSettings};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// RON specs to measure.
    #[arg(required = true)]
    pub specs: Vec<PathBuf>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Timed steps per model.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed steps per model before timing (compilation, caches, allocator).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub backbone: Backbone,
    /// With `--device cuda`: after the timed steps, time every step of each
    /// model's Plan and write, per fused kernel, the achieved bytes/s against
    /// the device-to-device copy bandwidth to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub profile_kernels: Option<PathBuf>,
}

/// A model's executor; the Cuda one is kept concrete for `--profile-kernels`.
enum Exec {
    Any(Box<dyn StepExecutor + Send>),
    Cuda(Box<CudaExecutor>),
}

impl Exec {
    fn get(&mut self) -> &mut dyn StepExecutor {
        match self {
            Exec::Any(e) => e.as_mut(),
            Exec::Cuda(e) => e.as_mut(),
        }
    }
}

/// One model under measurement with its training state.
struct Model {
    /// Spec name as given (the baseline row reuses the spec's name).
    name: String,
    path: PathBuf,
    scheme: &'static str,
    baseline: bool,
    spec: ModelSpec,
    exec: Exec,
    params: ParamSet,
    optimizer: Optimizer,
    corpus: Corpus,
    sampler: BatchSampler,
    steps_taken: usize,
    total_steps: usize,
    last_loss: f32,
    times_ms: Vec<f64>,
    /// Arithmetic of one training step, counted from the Cpu Plan (the same
    /// graph on every device): the floor of the overhead at equal efficiency.
    flops: u64,
    /// Bytes one training step's Plan moves (its kernels' and GEMMs' reads
    /// plus writes, as in `kernels.tsv`); none for the reference executor,
    /// which runs the unfused graph, not the Plan.
    bytes: Option<u64>,
    /// Each Plan step's FLOPs and bytes, for its roofline on the Cpu device.
    step_costs: Vec<(u64, u64)>,
    /// The peak memory this model's steps are expected to hold, counted from
    /// the Plan the device loaded (`runtime::device::memory`); none for the
    /// reference executor.
    expected: Option<PeakEstimate>,
}

impl Model {
    fn build(
        path: &Path,
        spec: ModelSpec,
        baseline: bool,
        device: Device,
        total_steps: usize,
    ) -> anyhow::Result<Model> {
        let (batch, seq_len) = (spec.train.batch, spec.train.seq_len);
        let corpus = Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq_len + 1, spec.vocab)?;
        let lowered = ir::lower::lower(&spec, batch, seq_len)?;
        let params = init_params(&lowered.graph, spec.train.seed)?;
        let graph = lowered.graph.clone();
        let threads = CpuOptions::default().threads;
        let expect = |plan: &codegen::plan::Plan| {
            Some(memory::expected_peak(&spec, &graph, plan, device, Workload::Steps, threads))
        };
        let optimizer = Optimizer::new(&spec, &params);
        // Compile and load the Plan now, so no timed step pays for it.
        // FLOPs are counted from the Plan the device runs (the Cpu Plan for the
        // reference executor, which runs the same graph unfused).
        let costs = |plan: &codegen::plan::Plan| {
            let steps: Vec<(u64, u64)> =
                codegen::plan_report::step_costs(plan).iter().map(|s| (s.flops, s.bytes())).collect();
            Costs {
                flops: steps.iter().map(|s| s.0).sum(),
                bytes: Some(steps.iter().map(|s| s.1).sum()),
                steps,
            }
        };
        let (exec, costs, expected) = match device {
            Device::Cpu => {
                let mut cpu = CpuExecutor::from_lowered(lowered, CpuOptions::default());
                let plan = cpu.load()?.plan();
                let (costs, expected) = (costs(plan), expect(plan));
                (Exec::Any(Box::new(cpu)), costs, expected)
            }
            Device::Cuda => {
                let mut cuda = cuda_executor(lowered)?;
                let plan = cuda.device_mut().plan();
                let (costs, expected) = (costs(plan), expect(plan));
                (Exec::Cuda(Box::new(cuda)), costs, expected)
            }
            Device::Reference => {
                let costs = Costs { bytes: None, ..costs(&TrainingGraph::new(lowered.clone())?.plan()?) };
                (Exec::Any(device.executor(lowered)?), costs, None)
            }
        };
        Ok(Model {
            name: spec.name.clone(),
            path: path.to_path_buf(),
            scheme: spec.residual.kind_name(),
            baseline,
            sampler: BatchSampler::train(spec.train.seed, batch, seq_len + 1),
            spec,
            exec,
            params,
            optimizer,
            corpus,
            steps_taken: 0,
            total_steps,
            last_loss: f32::NAN,
            times_ms: Vec::new(),
            flops: costs.flops,
            bytes: costs.bytes,
            step_costs: costs.steps,
            expected,
        })
    }

    /// One full training step, as the training loop takes it; returns its wall time in ms.
    fn step(&mut self) -> anyhow::Result<f64> {
        let tokens = self.sampler.next_batch(self.corpus.train())?;
        let started = Instant::now();
        let lr_mult = lr_multiplier(&self.spec.train.schedule, self.steps_taken, self.total_steps);
        let settings = UpdateSettings { lr_mult, clip: self.spec.train.clip };
        let StepStats { loss, .. } =
            self.exec.get().train_step(&mut self.params, &tokens, &mut self.optimizer, settings)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.steps_taken += 1;
        self.last_loss = loss;
        Ok(ms)
    }

    fn tokens_per_step(&self) -> usize {
        self.spec.train.batch * self.spec.train.seq_len
    }
}

/// What one training step's Plan costs, counted before it runs.
struct Costs {
    flops: u64,
    bytes: Option<u64>,
    steps: Vec<(u64, u64)>,
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.steps >= 1, "--steps must be at least 1");
    let device: Device = args.device.into();
    anyhow::ensure!(
        args.profile_kernels.is_none() || device == Device::Cuda,
        "--profile-kernels needs --device cuda (kernels are timed with CUDA events)"
    );
    let total_steps = args.warmup + args.steps;
    let mut jobs = Vec::new();
    for path in &args.specs {
        let mut spec = load_spec(path)?;
        args.backbone.apply(&mut spec);
        super::fits_this_machine(&spec)?;
        let plain = !matches!(spec.residual, ResidualSpec::Residual);
        let baseline = spec.with_plain_residual();
        jobs.push((path, spec, !plain));
        if plain {
            jobs.push((path, baseline, true));
        }
    }
    // The Cpu device's roofline: the host's ceilings on the threads the Plan
    // runs on, measured once the specs are known to load and before any model
    // is built, then again after every round; a shared machine's ceilings
    // move, and the best measured is the host's.
    let probe = (device == Device::Cpu).then(|| ceilings::Probe::new(CpuOptions::default().threads));
    let mut ceilings = probe.as_ref().map(ceilings::Probe::measure);
    if let Some(c) = &ceilings {
        eprintln!("host ceilings: {}", ceilings_text(c));
    }
    // Building is mostly Plan compilation (NVRTC or the C compiler), one
    // model per core at a time.
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Progress goes to stderr, so a run cut short by a time limit still says
    // how far it got.
    let built = parallel_map(&jobs, workers, |_, (path, spec, baseline)| {
        let started = Instant::now();
        let model = Model::build(path, spec.clone(), *baseline, device, total_steps)
            .with_context(|| format!("building {} for --device {}", path.display(), device.name()))?;
        eprintln!("built {} ({}) in {:.1} s", model.name, model.scheme, started.elapsed().as_secs_f64());
        Ok(model)
    });
    let mut models = built.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    for round in 0..total_steps {
        let mut times = Vec::with_capacity(models.len());
        for m in &mut models {
            let ms = m.step().with_context(|| format!("{} ({}) step {}", m.name, m.scheme, round + 1))?;
            if round >= args.warmup {
                m.times_ms.push(ms);
            }
            times.push(format!("{} {ms:.1}", m.scheme));
        }
        let kind = if round < args.warmup { "warmup" } else { "timed" };
        eprintln!("{kind} round {}/{total_steps}: ms {}", round + 1, times.join(", "));
        if let (Some(probe), Some(c)) = (&probe, ceilings) {
            ceilings = Some(c.best(probe.measure()));
        }
    }
    let rows = rows(&models, ceilings.as_ref());
    // Every model is resident at once, in one process: its peak is measured
    // against the models' estimates together, the process counted once.
    let measured = MeasuredPeak::now(device);
    let expected = expected_together(&models, probe.as_ref().map_or(0, |p| p.bytes() as u64));
    if let Some(c) = &ceilings {
        println!(
            "host ceilings, the best of {} measurements in this run: {}",
            total_steps + 1,
            ceilings_text(c)
        );
    }
    print_table(&rows, &args, device);
    println!("{}", peak_text(&measured, expected.as_ref(), device, models.len()));
    if let Some(path) = &args.json {
        let doc = json!({
            "device": device.name(),
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "ceilings": ceilings.map(|c| json!({
                "flops_per_s": c.flops_per_s,
                "bytes_per_s": c.bytes_per_s,
                "threads": c.threads,
                "vector": c.vector,
            })),
            "rows": rows,
            "peak_memory": json!({
                "measured": measured,
                "expected_bytes": expected.as_ref().map(|e| e.bytes),
                "expected_host_bytes": expected.as_ref().map(|e| e.host_bytes),
            }),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.profile_kernels {
        let doc = profile_kernels(&mut models, args.steps).context("profiling kernels")?;
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote per-kernel bandwidth to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes per copy when measuring the copy bandwidth: far beyond any L2 cache
/// (60 MiB on an H200), so the copy streams from HBM as the kernels do.
const COPY_BYTES: usize = 1 << 30;

/// A buffer of a residual connection: a parameter (or its gradient) whose
/// name has a `.conn.` segment, as every scheme names its connection
/// parameters (`blocks.0.attn.conn.phi`, ...).
fn is_connection(role: &BufferRole) -> bool {
    match role {
        BufferRole::Param { name } | BufferRole::Grad { name } => name.contains(".conn."),
        _ => false,
    }
}

/// Per-kernel bandwidth of every model's Plan (docs/architecture.md §10): each step
/// timed with CUDA events over `reps` runs (`CudaDevice::profile`), each
/// kernel's fewest bytes (arguments read once, written once) over its median
/// time, against the device-to-device copy bandwidth measured the same way
/// (bytes read plus bytes written). Connection kernels, those binding a
/// connection parameter or its gradient, are flagged and summed separately.
fn profile_kernels(models: &mut [Model], reps: usize) -> anyhow::Result<serde_json::Value> {
    let copy = copy_bandwidth(COPY_BYTES, 20).context("measuring the copy bandwidth")?;
    let rate = |bytes: u64, ms: f64| if ms > 0.0 { Some(bytes as f64 / (ms * 1e-3)) } else { None };
    let mut out = Vec::new();
    for m in models.iter_mut() {
        let Exec::Cuda(exec) = &mut m.exec else { continue };
        let device = exec.device_mut();
        let timings = device.profile(reps.max(1))?;
        let plan = device.plan();
        let mut kernels = Vec::new();
        let (mut kernel_ms, mut gemm_ms, mut zero_ms, mut route_ms) = (0.0, 0.0, 0.0, 0.0);
        let (mut conn_ms, mut conn_bytes) = (0.0, 0u64);
        for t in &timings {
            match &plan.steps[t.step] {
                Step::Kernel { kernel, args } => {
                    kernel_ms += t.ms;
                    let connection = args.iter().any(|id| is_connection(&plan.buffers[id.0].role));
                    if connection {
                        conn_ms += t.ms;
                        conn_bytes += t.bytes;
                    }
                    let bytes_per_s = rate(t.bytes, t.ms);
                    kernels.push(json!({
                        "step": t.step,
                        "kernel": plan.kernels[*kernel].name,
                        "connection": connection,
                        "ms": t.ms,
                        "bytes": t.bytes,
                        "bytes_per_s": bytes_per_s,
                        "fraction_of_copy": bytes_per_s.map(|r| r / copy),
                    }));
                }
                // A grouped GEMM is library products too (one per expert).
                Step::Gemm(_) | Step::GroupedGemm(_) => gemm_ms += t.ms,
                Step::Zero { .. } => zero_ms += t.ms,
                // The host round trip of sparse MoE routing (docs/math.md §1.6).
                Step::MoeRoute(_) => route_ms += t.ms,
            }
        }
        let conn_rate = rate(conn_bytes, conn_ms);
        out.push(json!({
            "spec": m.name,
            "scheme": m.scheme,
            "baseline": m.baseline,
            "arch": device.arch(),
            "ms": { "kernels": kernel_ms, "gemms": gemm_ms, "zeros": zero_ms, "routing": route_ms },
            "connection_kernels": {
                "count": kernels.iter().filter(|k| k["connection"] == true).count(),
                "ms": conn_ms,
                "bytes": conn_bytes,
                "bytes_per_s": conn_rate,
                "fraction_of_copy": conn_rate.map(|r| r / copy),
            },
            "kernels": kernels,
        }));
    }
    Ok(json!({ "copy_bytes_per_s": copy, "copy_bytes": COPY_BYTES, "reps": reps.max(1), "models": out }))
}

/// What the models of this run are expected to hold at once: their estimates
/// summed with the process counted once, and the ceilings probe's buffers
/// (`probe_bytes`); none when a model has no estimate (the reference executor).
fn expected_together(models: &[Model], probe_bytes: u64) -> Option<PeakEstimate> {
    let mut estimates = models.iter().map(|m| m.expected.as_ref());
    let first = estimates.next()??.clone();
    let mut parts = first.parts;
    for e in estimates {
        for (sum, part) in parts.iter_mut().zip(&e?.parts) {
            if part.name != "process" {
                sum.bytes += part.bytes;
            }
        }
    }
    let probe = memory::MemoryPart { name: "ceilings probe", memory: Memory::Host, bytes: probe_bytes };
    parts.push(probe);
    let sum = |memory: Memory| parts.iter().filter(|p| p.memory == memory).map(|p| p.bytes).sum::<u64>();
    let host_bytes = sum(Memory::Host);
    let bytes = if first.device == "cuda" { sum(Memory::Gpu) } else { host_bytes };
    Some(PeakEstimate { device: first.device, bytes, host_bytes, parts })
}

/// The measured peak against the expected one, in words.
fn peak_text(
    measured: &MeasuredPeak,
    expected: Option<&PeakEstimate>,
    device: Device,
    models: usize,
) -> String {
    let of = if models == 1 { "the model".to_string() } else { format!("all {models} models together") };
    let Some(e) = expected else {
        return format!("peak memory ({of}): {}; no Plan-based estimate", measured.text());
    };
    let ratio = measured
        .device_bytes(device)
        .filter(|_| e.bytes > 0)
        .map(|m| format!(", measured / expected {:.2}", m as f64 / e.bytes as f64))
        .unwrap_or_default();
    let memory = if device == Device::Cuda { Memory::Gpu } else { Memory::Host };
    format!(
        "peak memory ({of}): {}; expected {:.2} GiB ({}){ratio}",
        measured.text(),
        memory::gib(e.bytes),
        e.parts_text(memory)
    )
}

/// The ceilings in words.
fn ceilings_text(c: &CpuCeilings) -> String {
    format!(
        "{:.0} GFLOP/s ({} FMA chains), {:.1} GB/s streaming (4 reads + 2 writes), {} threads",
        c.flops_per_s / 1e9,
        c.vector,
        c.bytes_per_s / 1e9,
        c.threads
    )
}

/// One JSON row per model; the overhead is against the baseline of the same
/// spec file, the roofline under `ceilings` where they were measured.
fn rows(models: &[Model], ceilings: Option<&CpuCeilings>) -> Vec<serde_json::Value> {
    let roofline_ms = |m: &Model| ceilings.map(|c| c.roofline_seconds(&m.step_costs) * 1e3);
    models
        .iter()
        .map(|m| {
            let ms = median(&m.times_ms);
            let base = models.iter().find(|b| b.baseline && b.path == m.path).map(|b| median(&b.times_ms));
            let overhead = base.map(|b| (ms / b - 1.0) * 100.0);
            let baseline = models.iter().find(|b| b.baseline && b.path == m.path);
            let flop_overhead = baseline.map(|b| (m.flops as f64 / b.flops.max(1) as f64 - 1.0) * 100.0);
            // The scheme's extra roofline time against the baseline's measured
            // step: its overhead if the steps both Plans share ran as they do
            // and every other step ran at its floor.
            let least_overhead = baseline
                .and_then(|b| Some((roofline_ms(m)? - roofline_ms(b)?) / median(&b.times_ms) * 100.0));
            json!({
                "spec": m.name,
                "path": m.path.display().to_string(),
                "scheme": m.scheme,
                "baseline": m.baseline,
                "ms_per_step": ms,
                "ms_min": m.times_ms.iter().copied().fold(f64::INFINITY, f64::min),
                "tokens_per_s": m.tokens_per_step() as f64 / (ms / 1e3),
                "overhead_pct": overhead,
                "gflop_per_step": m.flops as f64 / 1e9,
                "flop_overhead_pct": flop_overhead,
                "gb_per_step": m.bytes.map(|b| b as f64 / 1e9),
                "roofline_ms": roofline_ms(m),
                "least_overhead_pct": least_overhead,
                "fraction_of_roofline": roofline_ms(m).map(|r| r / ms),
                "params": m.params.numel(),
                "d_model": m.spec.d_model,
                "layers": m.spec.layers,
                "heads": m.spec.heads,
                "seq_len": m.spec.train.seq_len,
                "batch": m.spec.train.batch,
                "final_loss": m.last_loss,
                "expected_peak_bytes": m.expected.as_ref().map(|e| e.bytes),
                "expected_peak": m.expected,
                "times_ms": m.times_ms,
            })
        })
        .collect()
}

fn print_table(rows: &[serde_json::Value], args: &Args, device: Device) {
    println!(
        "device {}, {} timed steps after {} warmup (median ms per full training step)",
        device.name(),
        args.steps,
        args.warmup
    );
    println!(
        "{:<16} {:<9} {:>9} {:>9} {:>12} {:>7} {:>10} {:>6} {:>9} {:>8} {:>10} {:>8}",
        "spec",
        "scheme",
        "ms/step",
        "tok/s",
        "vs residual",
        "GFLOP",
        "FLOP ratio",
        "GB",
        "roofline",
        "of floor",
        "least ovh",
        "mem GiB"
    );
    let pct = |r: &serde_json::Value, key: &str| match r[key].as_f64() {
        _ if r["baseline"].as_bool() == Some(true) => "baseline".into(),
        Some(o) => format!("{o:+.1}%"),
        None => "-".into(),
    };
    let ms =
        |r: &serde_json::Value, key: &str| r[key].as_f64().map_or_else(|| "-".into(), |v| format!("{v:.1}"));
    for r in rows {
        println!(
            "{:<16} {:<9} {:>9.2} {:>9.0} {:>12} {:>7.1} {:>10} {:>6} {:>9} {:>8} {:>10} {:>8}",
            r["spec"].as_str().unwrap_or("?"),
            r["scheme"].as_str().unwrap_or("?"),
            r["ms_per_step"].as_f64().unwrap_or(f64::NAN),
            r["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            pct(r, "overhead_pct"),
            r["gflop_per_step"].as_f64().unwrap_or(f64::NAN),
            pct(r, "flop_overhead_pct"),
            r["gb_per_step"].as_f64().map_or_else(|| "-".into(), |v| format!("{v:.2}")),
            ms(r, "roofline_ms"),
            r["fraction_of_roofline"].as_f64().map_or_else(|| "-".into(), |f| format!("{:.0}%", f * 100.0)),
            pct(r, "least_overhead_pct"),
            r["expected_peak_bytes"]
                .as_u64()
                .map_or_else(|| "-".into(), |b| format!("{:.2}", memory::gib(b))),
        );
    }
    println!("(FLOP ratio: the step's arithmetic against the baseline's, counted from the Plan; the overhead's floor at equal efficiency)");
    println!(
        "(mem GiB: the peak memory the model's training steps are expected to hold, counted from its Plan \
         (`widen check` adds a run's validation and checkpoints))"
    );
    if device == Device::Cpu {
        println!(
            "(roofline: the Plan's steps each at the larger of FLOPs / peak FLOP rate and bytes / streaming rate, summed, \
             under the host ceilings above; of floor: roofline / measured; least ovh: the \
             roofline's excess over the baseline's roofline, against the baseline's measured step: the overhead if the \
             steps both Plans share ran as measured and the others at their floor)"
        );
    }
}
