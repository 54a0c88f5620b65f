//! `widen build SPEC -o PATH`: compiles a spec into a standalone executable
//! that trains the model with no spec file and no `widen` command at run time
//! (the generator is `runtime::standalone`).

use anyhow::Context;
use ir::spec::load_spec;
use runtime::standalone::{build, BuildOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Path to the RON spec.
    pub spec: PathBuf,
    /// Where to write the executable.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Show cargo's progress while the binary builds.
    #[arg(short, long)]
    pub verbose: bool,
    /// Overwrite the output path even when it is not a trainer an earlier
    /// `widen build` wrote.
    #[arg(long)]
    pub force: bool,
    /// The cargo profile to build with: `release`, or `dev` for a quicker build of a slower
    /// trainer (same results).
    #[arg(long, default_value = "release", value_parser = ["release", "dev"])]
    pub profile: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let spec = load_spec(&args.spec)?;
    super::fits_this_machine(&spec)?;
    // The spec is the one file --force never replaces: the build has read it,
    // but it is the user's only copy of the model.
    let same = |a: &std::path::Path, b: &std::path::Path| matches!((std::fs::canonicalize(a), std::fs::canonicalize(b)), (Ok(a), Ok(b)) if a == b);
    if same(&args.spec, &args.output) {
        anyhow::bail!(
            "the output path {} is the spec being built; give the binary another path",
            args.output.display()
        );
    }
    let opts = BuildOptions {
        verbose: args.verbose,
        progress: !args.verbose,
        force: args.force,
        profile: args.profile.clone(),
        ..BuildOptions::from_env()
    };
    eprintln!(
        "building a standalone trainer for {} (cargo build --profile {} in {}; the first build compiles the runtime)",
        spec.name,
        opts.profile,
        opts.cache_dir.join("build").display()
    );
    runtime::progress::show_compiles();
    let built = build(&spec, &args.output, &opts)
        .with_context(|| format!("building {} into {}", args.spec.display(), args.output.display()))?;
    let online = if built.online { ", dependencies fetched online" } else { "" };
    eprintln!(
        "built {} in {:.1} s: {} kernels, {} launch steps embedded{online}; package {}",
        built.output.display(),
        built.elapsed.as_secs_f64(),
        built.kernels,
        built.steps,
        built.package_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
