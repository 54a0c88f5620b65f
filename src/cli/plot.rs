//! `widen plot RUN_DIR`: draw one run's training and validation loss against
//! tokens into `RUN_DIR/loss.svg`, from its `metrics.jsonl` (a `widen train` run
//! folder, or one run of a sweep).

use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A run folder holding `metrics.jsonl`.
    pub run_dir: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let svg = sweep::report::plot_run(&args.run_dir)
        .with_context(|| format!("plotting run {}", args.run_dir.display()))?;
    println!("wrote {}", svg.display());
    Ok(ExitCode::SUCCESS)
}
