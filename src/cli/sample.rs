//! `widen sample`.

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Path to the RON spec.
    pub spec: std::path::PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("widen sample is not implemented yet ({})", args.spec.display())
}
