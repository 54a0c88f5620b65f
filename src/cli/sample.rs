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
    /// Bytes to generate, 1..=1048576.
    #[arg(long, default_value_t = 200, value_parser = tokens_parser())]
    pub tokens: u64,
    /// Softmax temperature, a finite number >= 0; 0 is greedy.
    #[arg(long, default_value_t = 0.8, value_parser = parse_temperature, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Sample only among the k most likely bytes, 1..=256 [default: all 256].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub top_k: Option<u64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
}

/// `--tokens`: at least one byte (zero would print the prompt back), at most
/// `runtime::sample::MAX_TOKENS`, since every byte is a forward pass of the model.
fn tokens_parser() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=runtime::sample::MAX_TOKENS as u64)
}

/// `--temperature`: NaN, an infinity or a negative number has no softmax to sample from.
fn parse_temperature(text: &str) -> Result<f64, String> {
    let valid = "a finite number >= 0 (0 is greedy)";
    match text.parse::<f64>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        Ok(_) => Err(format!("must be {valid}")),
        Err(e) => Err(format!("{e}; must be {valid}")),
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // Both are bounded by their parsers, far inside usize.
    let opts = SampleOptions {
        tokens: args.tokens as usize,
        temperature: args.temperature,
        top_k: args.top_k.map(|k| k as usize),
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
