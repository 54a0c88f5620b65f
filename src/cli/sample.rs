//! `widen sample`: generate text from a checkpoint.

use super::train::DeviceArg;
use anyhow::Context;
use runtime::sample::{decode_output, encode_prompt, load_checkpoint, Decoding, Generator, SampleOptions};
use std::io::Write;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;

/// How `widen sample --help` ends: the context limit and what goes where.
const SAMPLE_HELP: &str = "The model sees at most the trained sequence length (the checkpoint's \
train.seq_len) of tokens: the last seq_len of the prompt and the generated text. Past it the window \
slides by one token per generated token, and the cached decoder rebuilds its cache from the new \
window, so cached and uncached generation see the same context (and each token past seq_len costs a \
whole window). The text goes to stdout; the tokens per second go to stderr.";

#[derive(clap::Args)]
#[command(after_help = SAMPLE_HELP)]
pub struct Args {
    /// A checkpoint written by `widen train` (its header holds the spec).
    pub checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate, 1..=1048576.
    #[arg(long, default_value_t = 200, value_parser = tokens_parser())]
    pub tokens: u64,
    /// Softmax temperature, a finite number >= 0; 0 is greedy.
    #[arg(long, default_value_t = 0.8, value_parser = parse_temperature, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Sample only among the k most likely tokens, 1..=vocab (1..=256 for a byte-level model)
    /// [default: all].
    #[arg(long, value_parser = parse_top_k)]
    pub top_k: Option<NonZeroUsize>,
    /// Nucleus sampling: only among the most likely tokens whose probability reaches p,
    /// in (0, 1] (applied after --top-k) [default: all].
    #[arg(long, value_parser = parse_top_p, allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the whole window through --device for every token instead of the cached decoder.
    #[arg(long)]
    pub no_cache: bool,
    /// Where to run. The cached decoder (the default) runs on the host in f32 with the
    /// reference executor's ops for `cpu` and `reference` alike; --no-cache runs the
    /// compiled Plan (`cpu`, `cuda`) or the reference interpreter.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
}

/// `--tokens`: at least one (zero would print the prompt back), at most
/// `runtime::sample::MAX_TOKENS`, since every token is a forward pass of the model.
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

/// `--top-k`: at least one token; the model's vocabulary bounds it once the checkpoint is read.
fn parse_top_k(text: &str) -> Result<NonZeroUsize, String> {
    let valid = "in 1..=vocab (1..=256 for a byte-level model)";
    match text.parse::<usize>() {
        Ok(k) => NonZeroUsize::new(k).ok_or_else(|| format!("must be {valid}")),
        Err(e) => Err(format!("{e}; must be {valid}")),
    }
}

/// `--top-p`: a probability mass that keeps at least the most likely token.
fn parse_top_p(text: &str) -> Result<f64, String> {
    let valid = "a number in (0, 1] (1 keeps every token)";
    match text.parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        Ok(_) => Err(format!("must be {valid}")),
        Err(e) => Err(format!("{e}; must be {valid}")),
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let decoding = match (args.no_cache, args.device) {
        (true, device) => Decoding::Full(device.into()),
        (false, DeviceArg::Cuda) => anyhow::bail!(
            "--device cuda runs the whole window only: the cached decoder runs on the host; pass \
             --no-cache to sample on cuda"
        ),
        (false, DeviceArg::Cpu | DeviceArg::Reference) => Decoding::Cached,
    };
    // `--tokens` is bounded by its parser, far inside usize.
    let opts = SampleOptions {
        tokens: args.tokens as usize,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let from = || format!("sampling from {}", args.checkpoint.display());
    let (spec, params, tokenizer) = load_checkpoint(&args.checkpoint).with_context(from)?;
    if let Some(k) = args.top_k.filter(|k| k.get() > spec.vocab) {
        anyhow::bail!(
            "invalid value '{k}' for '--top-k <TOP_K>': must be in 1..={}, the vocabulary of {}",
            spec.vocab,
            args.checkpoint.display()
        );
    }
    let prompt = encode_prompt(args.prompt.as_bytes(), &tokenizer);
    let mut generator = Generator::new(&spec, params, decoding).with_context(from)?;
    let generation = generator.generate(&prompt, &opts).with_context(from)?;
    let text = decode_output(&generation.ids, &tokenizer).with_context(from)?;
    let mut out = std::io::stdout().lock();
    out.write_all(args.prompt.as_bytes())?;
    out.write_all(&text)?;
    out.write_all(b"\n")?;
    out.flush()?;
    let how = match decoding {
        Decoding::Cached => "cached decoder on the host".to_string(),
        Decoding::Full(device) => format!("whole window on {}", device.name()),
    };
    eprintln!(
        "{} tokens in {:.3} s: {:.1} tokens/s ({how}; the time includes reading the {}-token prompt)",
        generation.ids.len(),
        generation.elapsed.as_secs_f64(),
        generation.tokens_per_second(),
        prompt.len(),
    );
    Ok(ExitCode::SUCCESS)
}
