//! `widen plot RUN_DIR`: draw one run from its `metrics.jsonl` (a `widen train`
//! run folder, or one run of a sweep): its training and validation loss against
//! tokens into `RUN_DIR/loss.svg`, and its learning rate, gradient norm and MoE
//! load balance against steps into `RUN_DIR/train.svg` (docs/sweeps.md).

use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A run folder holding `metrics.jsonl`.
    pub run_dir: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let plots = sweep::report::plot_run(&args.run_dir)
        .with_context(|| format!("plotting run {}", args.run_dir.display()))?;
    println!("wrote {}", plots.loss.display());
    match &plots.train {
        Some(train) => println!("wrote {}", train.display()),
        None => println!(
            "no train.svg: {} holds no lr, grad_norm or MoE field (written by an older widen)",
            args.run_dir.join("metrics.jsonl").display()
        ),
    }
    Ok(ExitCode::SUCCESS)
}
