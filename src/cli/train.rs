//! `widen train`: train a model from a spec on the Cpu device (the default),
//! the reference executor or the Cuda device (DESIGN.md §7).

use anyhow::Context;
use ir::spec::{load_spec, DataSpec};
use runtime::executor::Device;
use runtime::train::{train_spec, Progress, TrainOptions};
use std::path::PathBuf;
use std::process::ExitCode;

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

#[derive(clap::Args)]
pub struct Args {
    /// Path to the RON spec.
    pub spec: PathBuf,
    /// Train on this byte-level text file instead of the spec's data.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Number of optimizer steps (overrides `train.steps`).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Run folder for metrics and checkpoints [default: runs/<spec name>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue from a checkpoint of the same spec.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut spec = load_spec(&args.spec)?;
    if let Some(data) = &args.data {
        spec.train.data = DataSpec::Text(data.display().to_string());
    }
    if let Some(steps) = args.steps {
        anyhow::ensure!(steps >= 1, "--steps must be at least 1");
        // Same rule as standalone binaries, so both follow one schedule for one --steps.
        if let Some(w) = runtime::standalone::set_steps(&mut spec, steps) {
            eprintln!(
                "note: --steps {} is shorter than the spec's warmup of {}; warmup scaled to {} \
                 (its fraction of the planned {} steps)",
                w.steps, w.from, w.to, w.planned
            );
        }
    }
    let out_dir = args.out.unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let opts = TrainOptions {
        out_dir: out_dir.clone(),
        resume: args.resume,
        progress: Progress::Auto { every: (spec.train.steps / 20).max(1) },
    };
    let device = Device::from(args.device);
    let report = train_spec(&spec, device, &opts)
        .with_context(|| format!("training {} (run folder {})", args.spec.display(), out_dir.display()))?;
    let last = report.losses.last().map(|l| format!("{l:.4}")).unwrap_or_else(|| "-".into());
    let val = report.val_loss.map(|v| format!(", validation loss {v:.4}")).unwrap_or_default();
    eprintln!(
        "trained {} steps on {}: loss {last}{val}; checkpoint {}, metrics {}",
        report.steps,
        device.name(),
        report.final_checkpoint.display(),
        report.metrics.display()
    );
    Ok(ExitCode::SUCCESS)
}
