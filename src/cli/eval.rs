//! `widen eval`: a checkpoint's validation loss, and a dump of one batch's
//! logits, loss and gradients for comparison with another implementation
//! (`runtime::eval`, docs/checkpoints.md).

use super::train::DeviceArg;
use anyhow::Context;
use runtime::eval::{evaluate, EvalOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint written by `widen train` (its header holds the spec).
    pub checkpoint: PathBuf,
    /// Evaluate on this byte-level text file instead of the checkpoint's data.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Validation batches to average [default: the spec's train.eval_batches].
    #[arg(long)]
    pub batches: Option<usize>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Write the first validation batch, its logits, loss and every gradient as
    /// safetensors files into this folder.
    #[arg(long)]
    pub dump: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.batches != Some(0), "--batches must be at least 1");
    let opts = EvalOptions { data: args.data.clone(), batches: args.batches, dump: args.dump.clone() };
    let report = evaluate(&args.checkpoint, args.device.into(), &opts)
        .with_context(|| format!("evaluating {}", args.checkpoint.display()))?;
    let [batch, window] = report.token_shape;
    println!("checkpoint {} (step {})", args.checkpoint.display(), report.step);
    println!("data {}", report.data.describe());
    println!("validation batches {} of {batch} x {}", report.batches, window - 1);
    println!("val_loss {:.6} nats/byte", report.val_loss);
    println!("bits_per_byte {:.6}", report.bits_per_byte());
    for path in &report.dumped {
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
