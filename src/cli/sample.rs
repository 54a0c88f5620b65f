//! `widen sample`: generate text from a checkpoint.

use super::train::DeviceArg;
use anyhow::Context;
use runtime::sample::{sample_checkpoint, SampleOptions};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint written by `widen train` (its header holds the spec).
    pub checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Bytes to generate (at most 1048576).
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample only among the k most likely bytes.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.tokens <= runtime::sample::MAX_TOKENS,
        "--tokens {} is more than {}, the most one `widen sample` generates",
        args.tokens,
        runtime::sample::MAX_TOKENS
    );
    let opts = SampleOptions {
        tokens: args.tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
    };
    let text = sample_checkpoint(&args.checkpoint, args.device.into(), args.prompt.as_bytes(), &opts)
        .with_context(|| format!("sampling from {}", args.checkpoint.display()))?;
    let mut out = std::io::stdout().lock();
    out.write_all(args.prompt.as_bytes())?;
    out.write_all(&text)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
