//! `widen parity SPEC... [--device cpu|cuda] [--steps N] [--json FILE]`: each
//! spec on a compiled device against the reference executor, from the same
//! initial parameters and batches (docs/architecture.md §9.4, §9.6): the loss, the
//! validation loss, the logits, every gradient and every parameter after N
//! optimizer steps, each held to an f32 tolerance ([`runtime::parity`]).
//!
//! Prints one line per spec as it finishes (on the Cuda device several specs
//! run at once), then every check out of tolerance; exits non-zero when any
//! spec fails or cannot be run. The backbone can be shrunk
//! for all specs at once (`--d-model 32 --layers 1 --seq-len 8 --batch 2`);
//! by default each spec runs as written. With `--isolate` each spec runs in its own
//! process, so that a fault in one (on a GPU, a sticky context error poisons the
//! whole process) fails only that spec. The JSON file is rewritten after
//! every spec, so a run cut short still leaves the specs it finished.

use super::{parallel_map, Backbone};
use anyhow::Context;
use ir::spec::load_spec;
use runtime::device::cuda::{driver_available, CudaError};
use runtime::device::Device;
use runtime::parity::{compare, Tolerances};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;

/// The compiled devices parity is measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CompiledDevice {
    /// The fused Plan compiled to C, on every core.
    Cpu,
    /// The fused Plan compiled by NVRTC, on GPU 0.
    Cuda,
}

impl From<CompiledDevice> for Device {
    fn from(d: CompiledDevice) -> Device {
        match d {
            CompiledDevice::Cpu => Device::Cpu,
            CompiledDevice::Cuda => Device::Cuda,
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// RON specs to check.
    #[arg(required = true)]
    pub specs: Vec<PathBuf>,
    /// The device compared against the reference executor.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: CompiledDevice,
    /// Optimizer steps after which parameters are compared.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Run each spec in its own `widen parity` process, so that one spec's fault (a
    /// GPU exception, a crash) is reported as that spec's error and the others still
    /// run.
    #[arg(long)]
    pub isolate: bool,
    #[command(flatten)]
    pub backbone: Backbone,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let device = Device::from(args.device);
    // Every spec would fail alike: say it once.
    if device == Device::Cuda && !driver_available() {
        return Err(CudaError::NoCudaDriver.into());
    }
    // On the GPU a spec's time goes to compiling its Plan (NVRTC) and to the
    // reference executor, both on the host: one spec per core. The Cpu
    // device already uses every core for one spec.
    let workers = match device {
        Device::Cuda => std::thread::available_parallelism().map_or(1, |n| n.get()),
        _ => 1,
    };
    let records: Mutex<Vec<Option<Value>>> = Mutex::new(vec![None; args.specs.len()]);
    let outcomes = parallel_map(&args.specs, workers, |i, path| {
        if args.isolate {
            let (record, passed) = in_own_process(path, i, &args);
            let mut records = records.lock().unwrap_or_else(|e| e.into_inner());
            records[i] = Some(record);
            return match &args.json {
                Some(file) => write_json(file, device, &args, &records),
                None => Ok(()),
            }
            .map(|()| passed);
        }
        let (record, passed) = match check(path, device, &args) {
            Ok(report) => {
                let mut lines = report.to_string();
                for c in report.failures() {
                    lines += &format!("\n  {} {}: {:.2e} > {:.0e}", c.quantity.key(), c.name, c.err, c.tol);
                }
                println!("{lines}");
                (json!({ "path": path.display().to_string(), "report": report.to_json() }), report.passed())
            }
            Err(err) => {
                println!("{}: error: {err:#}", path.display());
                (json!({ "path": path.display().to_string(), "error": format!("{err:#}") }), false)
            }
        };
        let mut records = records.lock().unwrap_or_else(|e| e.into_inner());
        records[i] = Some(record);
        match &args.json {
            Some(file) => write_json(file, device, &args, &records),
            None => Ok(()),
        }
        .map(|()| passed)
    });
    let mut passed = 0;
    for outcome in outcomes {
        passed += usize::from(outcome?);
    }
    println!("{passed} of {} specs within tolerance on {}", args.specs.len(), device.name());
    Ok(if passed == args.specs.len() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Runs `widen parity` on one spec in a child process (its output passes through)
/// and reads its record back from the child's JSON file; a child that ends without
/// one (killed by a signal, a crash) is that spec's error, naming how it ended.
fn in_own_process(path: &Path, i: usize, args: &Args) -> (Value, bool) {
    let fail = |message: String| {
        println!("{}: error: {message}", path.display());
        (json!({ "path": path.display().to_string(), "error": message }), false)
    };
    let json_file = std::env::temp_dir().join(format!("widen-parity-{}-{i}.json", std::process::id()));
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return fail(format!("cannot find the widen executable to run the spec in: {e}")),
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("parity").arg(path).arg("--steps").arg(args.steps.to_string()).arg("--json").arg(&json_file);
    cmd.arg("--device").arg(match args.device {
        CompiledDevice::Cpu => "cpu",
        CompiledDevice::Cuda => "cuda",
    });
    let b = &args.backbone;
    for (flag, value) in [
        ("--d-model", b.d_model),
        ("--layers", b.layers),
        ("--heads", b.heads),
        ("--seq-len", b.seq_len),
        ("--batch", b.batch),
    ] {
        if let Some(v) = value {
            cmd.arg(flag).arg(v.to_string());
        }
    }
    let status = match cmd.stdout(std::process::Stdio::null()).status() {
        Ok(status) => status,
        Err(e) => return fail(format!("cannot start a process for it: {e}")),
    };
    let record = std::fs::read_to_string(&json_file)
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
        .and_then(|doc| doc["specs"].get(0).cloned());
    let _ = std::fs::remove_file(&json_file);
    match record {
        Some(record) => {
            let passed = record["report"]["passed"] == true;
            match (&record["report"], &record["error"]) {
                (Value::Null, Value::String(e)) => println!("{}: error: {e}", path.display()),
                _ => {
                    println!("{}: {} (own process)", path.display(), if passed { "passed" } else { "FAILED" })
                }
            }
            (record, passed)
        }
        None => {
            use std::os::unix::process::ExitStatusExt;
            match status.signal() {
                Some(sig) => fail(format!("its process was ended by signal {sig}")),
                None => fail(format!("its process ended with {status} and left no result")),
            }
        }
    }
}

/// Builds one spec (with the backbone overrides) on `device` and compares it.
fn check(path: &Path, device: Device, args: &Args) -> anyhow::Result<runtime::parity::ParityReport> {
    let mut spec = load_spec(path)?;
    args.backbone.apply(&mut spec);
    super::fits_this_machine(&spec)?;
    let lowered = ir::lower::lower(&spec, spec.train.batch, spec.train.seq_len)?;
    let mut exec =
        device.executor(lowered).with_context(|| format!("setting up the {} device", device.name()))?;
    // Each spec is held to the tolerances of its precision (f32, or bf16 mixed precision).
    Ok(compare(&spec, exec.as_mut(), args.steps, Tolerances::for_spec(&spec))?)
}

/// Writes the finished specs (in command-line order) and whether all passed.
fn write_json(file: &Path, device: Device, args: &Args, records: &[Option<Value>]) -> anyhow::Result<()> {
    let done: Vec<&Value> = records.iter().flatten().collect();
    let ok = |r: &&Value| r["report"]["passed"] == true;
    let doc = json!({
        "device": device.name(),
        "steps": args.steps,
        "passed": done.len() == args.specs.len() && done.iter().all(ok),
        "failed": done.iter().filter(|r| !ok(r)).count(),
        "specs": done,
    });
    std::fs::write(file, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("cannot write {}", file.display()))
}
