//! `widen data prepare`: tokenize text into llm.c token shards and a `manifest.json`
//! (`dataset::prepare`, docs/data.md).
//!
//! The summary goes to stdout; progress on a large input goes to stderr.

use anyhow::Context;
use dataset::prepare::{PrepareOptions, DEFAULT_SHARD_TOKENS};
use dataset::{SplitRule, Tokenizer};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Subcommand)]
pub enum Command {
    /// Tokenize text into llm.c shards `<name>_train_*.bin`, `<name>_val_*.bin` and a manifest.json.
    Prepare(PrepareArgs),
}

/// Which split rule (docs/data.md, "Split rules").
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SplitLike {
    /// nanoGPT's data/shakespeare/prepare.py: the first 1 - F of the characters train.
    Nanogpt,
}

#[derive(clap::Args)]
pub struct PrepareArgs {
    /// A text file, or a glob of text files (quote it) read in name order.
    pub input: String,
    /// `gpt2`, `bytes`, or the path of a Hugging Face tokenizer.json.
    #[arg(long)]
    pub tokenizer: String,
    /// The fraction held out for validation, strictly between 0 and 1.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// The output folder (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// The shards' name prefix [default: the input's file stem, or `data` for several inputs].
    #[arg(long)]
    pub name: Option<String>,
    /// Tokens per shard at most (llm.c's 100M by default).
    #[arg(long, default_value_t = DEFAULT_SHARD_TOKENS)]
    pub shard_tokens: usize,
    /// Split like another project instead of at the last line start before the held-out tail.
    #[arg(long, value_enum)]
    pub split_like: Option<SplitLike>,
    /// Replace the shards and manifest already in --out.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Prepare(p) => prepare(p),
    }
}

fn prepare(args: PrepareArgs) -> anyhow::Result<ExitCode> {
    let tokenizer = Tokenizer::from_arg(&args.tokenizer).context("--tokenizer")?;
    let opts = PrepareOptions {
        input: args.input.clone(),
        val_fraction: args.val_fraction,
        out: args.out.clone(),
        name: args.name,
        shard_tokens: args.shard_tokens,
        split: match args.split_like {
            Some(SplitLike::Nanogpt) => SplitRule::NanoGpt,
            None => SplitRule::Lines,
        },
        force: args.force,
        progress: true,
        threads: 0,
    };
    let m = dataset::prepare(&opts, &tokenizer).with_context(|| format!("preparing {}", args.input))?;
    let width = match m.dtype {
        ir::spec::TokenWidth::U16 => "u16",
        ir::spec::TokenWidth::U32 => "u32",
    };
    println!(
        "tokenizer {} (vocab {}), {width} llm.c shards in {}",
        args.tokenizer,
        m.vocab,
        args.out.display()
    );
    for (split, files) in [("train", &m.train), ("val", &m.val)] {
        let shards = files.files.len();
        println!(
            "{split}: {} tokens from {} bytes in {shards} shard{}",
            files.tokens,
            files.bytes,
            if shards == 1 { "" } else { "s" }
        );
    }
    let name = m.train.files.first().and_then(|f| f.name.rsplit_once("_train_")).map(|(n, _)| n.to_string());
    if let Some(name) = name {
        let dir = args.out.display();
        println!(
            "spec: data: Tokens(train: \"{dir}/{name}_train_*.bin\", val: Some(\"{dir}/{name}_val_*.bin\"))"
        );
    }
    println!("wrote {}", args.out.join(dataset::manifest::MANIFEST_FILE).display());
    Ok(ExitCode::SUCCESS)
}
