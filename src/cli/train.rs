//! `widen train`: train a model from a spec on the Cpu device (the default),
//! the reference executor or the Cuda device (docs/architecture.md §7).
//!
//! Ctrl-C or SIGTERM saves the run and exits with status 130, printing the
//! command that continues it; so does a failed save, naming the last good
//! checkpoint (status 1). See `runtime::train` for what a run refuses.
//!
//! Under an MPI launcher (`mpirun -n N widen train ...`, in a build with the
//! `mpi` feature) the N processes train one model data-parallel
//! (docs/distributed.md); a rank that fails prints its error and ends every
//! rank (`MPI_Abort`). A build without the feature refuses to start under a
//! launcher of more than one process, which would otherwise train N
//! independent copies into one folder.

use anyhow::Context;
use ir::spec::{load_spec, parse_spec, FieldError, ModelSpec, SpecLoadError};
use runtime::device::memory::{self, MeasuredPeak, Workload};
use runtime::device::Device;
use runtime::dist::Group;
use runtime::train::{train_spec, Progress, TrainError, TrainOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use sweep::PointError;

/// The device to run on: the reference interpreter, or the compiled Plan on
/// the host or on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// The reference interpreter of the unfused graph (f32).
    Reference,
    /// The fused Plan compiled to C, on every core.
    Cpu,
    /// The fused Plan compiled by NVRTC, on GPU 0 (needs the CUDA driver, cuBLAS and NVRTC).
    Cuda,
}

impl From<DeviceArg> for Device {
    fn from(d: DeviceArg) -> Device {
        match d {
            DeviceArg::Reference => Device::Reference,
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Cuda => Device::Cuda,
        }
    }
}

/// How `widen train --help` ends: how to train across processes.
#[cfg(feature = "mpi")]
const DISTRIBUTED_HELP: &str =
    "Data-parallel across processes: `mpirun -n N widen train SPEC ...` (train.batch \
is the global batch; it must divide by N). See docs/distributed.md.";
#[cfg(not(feature = "mpi"))]
const DISTRIBUTED_HELP: &str = "Data-parallel across processes (`mpirun -n N widen train SPEC ...`) needs a \
build with MPI: `cargo build --release --features mpi` (Open MPI and libclang: `apt-get install \
libopenmpi-dev openmpi-bin libclang-dev`). See docs/distributed.md.";

#[derive(clap::Args)]
#[command(after_help = DISTRIBUTED_HELP)]
pub struct Args {
    /// Path to the RON spec.
    pub spec: PathBuf,
    /// Train on this data instead of the spec's: token shards (a glob, or a file with
    /// an llm.c header) or a byte-level text file (docs/data.md).
    #[arg(long, value_name = "PATH_OR_GLOB")]
    pub data: Option<String>,
    /// Number of optimizer steps (overrides `train.steps`). 0 writes the initial
    /// checkpoint `init.safetensors` (step 0) and trains nothing.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Run folder for metrics and checkpoints [default: runs/<spec name>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue from a checkpoint of the same model. A resume may change the step
    /// budget, the data and the evaluation and checkpoint cadence, nothing else.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Let --resume replace the run folder's results past the checkpoint's step
    /// (later checkpoints, the final checkpoint, their metrics).
    #[arg(long, requires = "resume")]
    pub overwrite: bool,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Set a spec field before training, named as a sweep axis names it and written
    /// in RON as in a spec file: `--set train.optimizer.lr=1e-3`, `--set
    /// residual=Ghc(m: 2, n: 4)`. Repeatable; the spec with the values is validated
    /// as a spec file is.
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub sets: Vec<String>,
}

/// The spec at `path` with the `--set` values on it: read without validating,
/// the values set by the sweep's own code (`sweep::apply_sets`: its field paths, RON
/// values and suggestions for a path that does not exist, docs/sweeps.md), then
/// validated as a spec file holding them would be. Without any, [`load_spec`].
pub fn load_spec_with_sets(path: &Path, sets: &[String]) -> Result<ModelSpec, SpecLoadError> {
    if sets.is_empty() {
        return load_spec(path);
    }
    let shown = format!("{} with --set {}", path.display(), sets.join(" --set "));
    let invalid = |path: &str, message: String| SpecLoadError::Invalid {
        path: shown.clone(),
        errors: vec![FieldError { path: path.to_string(), message }],
    };
    let text = std::fs::read_to_string(path)
        .map_err(|source| SpecLoadError::Io { path: path.display().to_string(), source })?;
    let base = parse_spec(&text, &path.display().to_string())?;
    let values = sets
        .iter()
        .map(|arg| sweep::parse_set(arg))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid("", e.to_string()))?;
    sweep::apply_sets(&base, &values).map_err(|e| match e {
        PointError::Invalid { errors } => SpecLoadError::Invalid { path: shown.clone(), errors },
        PointError::UnknownField { ref path, .. }
        | PointError::NoFields { ref path, .. }
        | PointError::Value { ref path, .. }
        | PointError::Derived { ref path, .. } => invalid(&path.clone(), e.to_string()),
        other => invalid("", other.to_string()),
    })
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // Dropped at the end of the run, which finalizes MPI (docs/distributed.md).
    let ranks = runtime::dist::Ranks::join()?;
    let group = ranks.group();
    match run_rank(&args, group.as_ref()) {
        Ok(code) => Ok(code),
        // Alone, the error is reported as every command's is.
        Err(err) if group.is_none() => Err(err),
        Err(err) => {
            let g = group.as_ref().expect("a group");
            eprintln!("error (rank {} of {}): {err:#}", g.rank(), g.size());
            g.abort(1)
        }
    }
}

/// This process's part of `widen train`: the whole run alone, or one rank's.
fn run_rank(args: &Args, group: Option<&Group>) -> anyhow::Result<ExitCode> {
    let root = group.is_none_or(Group::is_root);
    let mut spec = load_spec_with_sets(&args.spec, &args.sets)?;
    if root && !args.sets.is_empty() {
        // The run says what it trains: these values are in its spec and checkpoints.
        eprintln!("spec {} with --set {}", args.spec.display(), args.sets.join(", "));
    }
    if let Some(data) = &args.data {
        spec.train.data = runtime::data::data_from_arg(data);
    }
    if args.steps == Some(0) {
        // The initial state is the same on every rank: rank 0 writes it.
        return if root { write_initial(args, &spec) } else { Ok(ExitCode::SUCCESS) };
    }
    if let Some(steps) = args.steps {
        // Same rule as standalone binaries, so both follow one schedule for one --steps.
        if let Some(w) = runtime::standalone::set_steps(&mut spec, steps).filter(|_| root) {
            eprintln!(
                "note: --steps {} is shorter than the spec's warmup of {}; warmup scaled to {} \
                 (its fraction of the planned {} steps)",
                w.steps, w.from, w.to, w.planned
            );
        }
    }
    let out_dir = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let opts = TrainOptions {
        out_dir: out_dir.clone(),
        resume: args.resume.clone(),
        progress: Progress::Auto { every: (spec.train.steps / 20).max(1) },
        catch_signals: true,
        overwrite: args.overwrite,
        on_step: None,
        group: group.cloned(),
    };
    let device = Device::from(args.device);
    if root {
        runtime::progress::show_compiles();
    }
    let report = match train_spec(&spec, device, &opts) {
        Ok(report) => report,
        Err(err) => {
            let Some(checkpoint) = err.resume_from().map(Path::to_path_buf) else {
                return Err(err).with_context(|| {
                    format!("training {} (run folder {})", args.spec.display(), out_dir.display())
                });
            };
            let interrupted = matches!(err, TrainError::Interrupted { .. });
            if !root && interrupted {
                // Rank 0 says where the run is saved and how to continue it.
                return Ok(ExitCode::from(130));
            }
            let err = anyhow::Error::new(err);
            eprintln!("{}{err:#}", if interrupted { "" } else { "error: " });
            eprintln!("continue with: {}", resume_command(args, &out_dir, &checkpoint));
            // 130 = 128 + SIGINT, what a shell reports for a run stopped by Ctrl-C.
            return Ok(if interrupted { ExitCode::from(130) } else { ExitCode::FAILURE });
        }
    };
    if !root {
        return Ok(ExitCode::SUCCESS);
    }
    let last = report.losses.last().map(|l| format!("{l:.4}")).unwrap_or_else(|| "-".into());
    let val = report.val_loss.map(|v| format!(", validation loss {v:.4}")).unwrap_or_default();
    eprintln!(
        "trained {} steps on {}: loss {last}{val}; checkpoint {}, metrics {}",
        report.steps,
        device.name(),
        report.final_checkpoint.display(),
        report.metrics.display()
    );
    eprintln!("{}", peak_text(&spec, device, group, &report.peak_memory));
    Ok(ExitCode::SUCCESS)
}

/// The run's measured peak memory, beside what `widen check --device` expects of
/// it (its Plan's buffers and what the device holds beside them), which a run
/// alone on a compiled device can compare: a rank's share of a data-parallel
/// run is not the spec's Plan.
fn peak_text(spec: &ModelSpec, device: Device, group: Option<&Group>, measured: &MeasuredPeak) -> String {
    let mut text = format!("peak memory: {}", measured.text());
    if group.is_some_and(|g| g.size() > 1) {
        return text;
    }
    match memory::expected_training_peak(spec, device, Workload::Train) {
        Ok(expected) => {
            text.push_str(&format!(
                "; expected {:.2} GiB from the {} Plan",
                memory::gib(expected.bytes),
                expected.device
            ));
            if let Some(m) = measured.device_bytes(device).filter(|_| expected.bytes > 0) {
                text.push_str(&format!(" (measured / expected {:.2})", m as f64 / expected.bytes as f64));
            }
        }
        Err(memory::EstimateError::NoPlan) => {}
        Err(e) => text.push_str(&format!("; no estimate ({e})")),
    }
    text
}

/// `--steps 0`: the initial checkpoint alone (`runtime::train::write_initial`).
fn write_initial(args: &Args, spec: &ir::spec::ModelSpec) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.resume.is_none(),
        "--steps 0 writes an initial checkpoint; it cannot --resume a run"
    );
    let out_dir = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let opts = TrainOptions::quiet(out_dir.clone());
    let path = runtime::train::write_initial(spec, &opts).with_context(|| {
        format!("initializing {} (run folder {})", args.spec.display(), out_dir.display())
    })?;
    let sets: String = args.sets.iter().map(|s| format!(" --set {}", quote(s))).collect();
    eprintln!(
        "wrote the initial checkpoint {} (step 0, no training); continue with: widen train {}{sets} --out {} --resume {}",
        path.display(),
        quote(&args.spec.display().to_string()),
        quote(&out_dir.display().to_string()),
        quote(&path.display().to_string())
    );
    Ok(ExitCode::SUCCESS)
}

/// The `widen train` command that continues this run from `checkpoint`: the same
/// spec, data, step budget, device and run folder.
fn resume_command(args: &Args, out_dir: &Path, checkpoint: &Path) -> String {
    let mut words = vec!["widen".to_string(), "train".to_string(), quote(&args.spec.display().to_string())];
    for set in &args.sets {
        words.extend(["--set".to_string(), quote(set)]);
    }
    if let Some(data) = &args.data {
        words.extend(["--data".to_string(), quote(data)]);
    }
    if let Some(steps) = args.steps {
        words.extend(["--steps".to_string(), steps.to_string()]);
    }
    words.extend(["--out".to_string(), quote(&out_dir.display().to_string())]);
    words.extend(["--resume".to_string(), quote(&checkpoint.display().to_string())]);
    match args.device {
        DeviceArg::Cpu => {}
        DeviceArg::Reference => words.extend(["--device".to_string(), "reference".to_string()]),
        DeviceArg::Cuda => words.extend(["--device".to_string(), "cuda".to_string()]),
    }
    words.join(" ")
}

/// `word` as a POSIX shell reads it back: unchanged when it is plain, else in single quotes.
fn quote(word: &str) -> String {
    let plain =
        !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}
