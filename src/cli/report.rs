//! `widen report SWEEP_DIR`: re-read a sweep folder and write its `results.csv`,
//! `results.json` and plots again, then print the results table and the fitted
//! laws (the same as the end of `widen sweep`). It trains nothing, so it can run
//! while a sweep is still going, on the runs finished so far.

use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A folder written by `widen sweep`.
    pub dir: PathBuf,
    /// Compare every point's validation loss with this point [default: the sweep's
    /// --against, else each point's plain-residual twin, else the first point].
    #[arg(long, value_name = "POINT")]
    pub against: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let report = sweep::report::report_against(&args.dir, args.against.as_deref())
        .with_context(|| format!("reporting sweep {}", args.dir.display()))?;
    super::sweep::print_report(&report);
    Ok(ExitCode::SUCCESS)
}
