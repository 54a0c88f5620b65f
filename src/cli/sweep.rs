//! `widen sweep`: train a family of models that differ in spec fields and compare
//! them at equal tokens, equal training FLOPs or equal steps.
//!
//! ```text
//! widen sweep SPEC --set residual.r=1,2,4 --seeds 3 --budget tokens=2e6 --baseline --out DIR
//! widen sweep SWEEP.ron --out DIR
//! ```
//!
//! The first form builds the sweep from the shorthand; the second reads a sweep file
//! (see `sweep::file`), which says everything the shorthand flags would. The library
//! does the work (`sweep::runner`): one run folder per (point, seed), results and
//! plots after every run, failures recorded, a rerun continuing where it stopped.
//! Ctrl-C saves the running run and exits with status 130; the same command
//! continues. Exit status 1 when any point failed, after the others finished.

use anyhow::Context;
use ir::spec::load_spec;
use std::path::PathBuf;
use std::process::ExitCode;
use sweep::{OnInvalid, Status, Sweep, SweepOptions, SweepReport, SweepRunError};

use super::train::DeviceArg;

#[derive(clap::Args)]
pub struct Args {
    /// A model spec (with --set) or a sweep file (`Sweep(base: ..., axes: {...}, ...)`).
    pub spec: PathBuf,
    /// An axis: a spec field path and its values, `residual.n=4,8,16`. Repeat for
    /// more axes; every combination is a point.
    #[arg(long = "set", value_name = "PATH=V1,V2,...")]
    pub sets: Vec<String>,
    /// Seeds per point: a count (3 = seeds 0, 1, 2) or a list (1,7).
    #[arg(long, default_value = "1")]
    pub seeds: String,
    /// How long each point trains: tokens=N, flops=F (steps from the cost model's
    /// training FLOPs per token), steps=N, or time=S (seconds of steps on the
    /// sweep's device, from a short timing of each point) [default: the spec's train.steps].
    #[arg(long)]
    pub budget: Option<String>,
    /// Also train each point's plain-residual twin and report the overhead over it.
    #[arg(long)]
    pub baseline: bool,
    /// Run the valid points when some are invalid (default: refuse the sweep).
    #[arg(long)]
    pub skip_invalid: bool,
    /// Sweep folder [default: sweeps/<spec name>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Train every point on this data instead of the spec's: token shards (a glob, or
    /// a file with an llm.c header) or a byte-level text file (docs/data.md).
    #[arg(long, value_name = "PATH_OR_GLOB")]
    pub data: Option<String>,
    /// Train again the runs recorded as failed.
    #[arg(long)]
    pub retry_failed: bool,
    /// Where every run trains.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Compare every point's validation loss with this point (a point name) [default:
    /// each point's plain-residual twin with --baseline, else the first point].
    #[arg(long, value_name = "POINT")]
    pub against: Option<String>,
    /// Validate every point and print the plan (steps, tokens and training FLOPs per
    /// point, the invalid points and why) without training.
    #[arg(long)]
    pub dry_run: bool,
    /// Train this many runs at once, each in a process of its own with an even share
    /// of the cores (results equal those of --jobs 1).
    #[arg(long, default_value = "1", value_name = "N")]
    pub jobs: usize,
    /// Train exactly run K of the plan in the sweep folder given instead of SPEC
    /// (what --jobs and a cluster's job array run); then rewrite the results.
    #[arg(long, value_name = "K")]
    pub run_index: Option<usize>,
    /// After the planned seeds, add seeds to every point whose comparison with its
    /// reference is undecided (p above P and the 95% interval includes 0), up to
    /// --max-seeds: `--until p<0.01`. `--seeds auto` starts from 2 seeds.
    #[arg(long, value_name = "p<P")]
    pub until: Option<String>,
    /// With --until: the most seeds any point gets.
    #[arg(long, default_value = "8", value_name = "N")]
    pub max_seeds: usize,
    /// No progress on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Write the plan and a job script for this scheduler into --out, and train nothing.
    #[arg(long, value_enum, value_name = "SCHEDULER")]
    pub emit: Option<Emit>,
    /// With --emit slurm: at most this many array tasks run at once.
    #[arg(long, default_value = "16", value_name = "M")]
    pub max_parallel: usize,
    /// With --emit slurm: GPUs per task (`#SBATCH --gpus=G`).
    #[arg(long, value_name = "G")]
    pub slurm_gpus: Option<u32>,
    /// With --emit slurm: CPUs per task (`#SBATCH --cpus-per-task=C`).
    #[arg(long, value_name = "C")]
    pub slurm_cpus: Option<u32>,
    /// With --emit slurm: time limit per task (`#SBATCH --time=T`, e.g. 01:00:00).
    #[arg(long, value_name = "T")]
    pub slurm_time: Option<String>,
    /// With --emit slurm: the partition (`#SBATCH --partition=P`).
    #[arg(long, value_name = "P")]
    pub slurm_partition: Option<String>,
    /// With --emit slurm: any other sbatch option, written as `#SBATCH OPTION`
    /// (repeat for more: --slurm-option=--account=lab).
    #[arg(long, value_name = "OPTION", allow_hyphen_values = true)]
    pub slurm_option: Vec<String>,
}

/// Schedulers `--emit` writes a job script for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// An sbatch job array: one task per run.
    Slurm,
}

/// The sbatch script's name in the sweep folder.
pub const SBATCH_FILE: &str = "sweep.sbatch";

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let slurm_flags = args.slurm_gpus.is_some()
        || args.slurm_cpus.is_some()
        || args.slurm_time.is_some()
        || args.slurm_partition.is_some()
        || !args.slurm_option.is_empty();
    anyhow::ensure!(
        !slurm_flags || args.emit == Some(Emit::Slurm),
        "--slurm-gpus, --slurm-cpus, --slurm-time, --slurm-partition and --slurm-option shape the job \
         script of --emit slurm; add --emit slurm, or leave them out"
    );
    for (flag, value) in [("--slurm-time", &args.slurm_time), ("--slurm-partition", &args.slurm_partition)]
        .into_iter()
        .filter_map(|(f, v)| v.as_ref().map(|v| (f, v)))
        .chain(args.slurm_option.iter().map(|o| ("--slurm-option", o)))
    {
        anyhow::ensure!(
            !value.is_empty() && !value.chars().any(char::is_control),
            "{flag} {value:?}: must be one non-empty line (it becomes one #SBATCH line)"
        );
    }
    if let Some(k) = args.run_index {
        return run_index(&args, k);
    }
    let until = until(&args)?;
    if !args.quiet && args.jobs <= 1 && !args.dry_run {
        // With --jobs the runs train in processes of their own, whose progress is a line per run.
        runtime::progress::show_compiles();
    }
    let mut sweep = load(&args)?;
    if let Some(data) = &args.data {
        sweep.base.train.data = runtime::data::data_from_arg(data);
    }
    if args.dry_run {
        let plan = sweep::expand(&sweep)?;
        if let Some(note) = plan.warmup_note() {
            eprintln!("note: {note}");
        }
        // The data is read and hashed as a sweep would, so a missing or too short
        // file is found here rather than at the first run.
        let data = sweep::runner::data_records(&plan)?;
        print_plan(&plan, &data, &sweep.budget);
        return Ok(ExitCode::SUCCESS);
    }
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("sweeps").join(&sweep.base.name));
    let child = sweep::runner::ChildCommand {
        program: std::env::current_exe().context("cannot find the widen executable to start --jobs")?,
        args: vec!["sweep".into()],
    };
    let opts = SweepOptions {
        out_dir: out.clone(),
        device: args.device.into(),
        progress: !args.quiet,
        catch_signals: true,
        retry_failed: args.retry_failed,
        against: args.against.clone(),
        jobs: args.jobs,
        child: Some(child),
        until,
    };
    if let Some(Emit::Slurm) = args.emit {
        return emit_slurm(&args, &sweep, &opts);
    }
    match sweep.run(&opts) {
        Ok(report) => {
            print_report(&report);
            Ok(if report.failed > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
        }
        Err(err @ SweepRunError::Interrupted { .. }) => {
            eprintln!("{err}");
            eprintln!("results so far: {}", out.join(sweep::folder::RESULTS_CSV).display());
            // 130 = 128 + SIGINT, what a shell reports for a run stopped by Ctrl-C.
            Ok(ExitCode::from(130))
        }
        Err(err) => Err(err).with_context(|| format!("sweep {} into {}", args.spec.display(), out.display())),
    }
}

/// `--until p<P` with `--max-seeds`, checked.
fn until(args: &Args) -> anyhow::Result<Option<sweep::runner::Until>> {
    let Some(text) = &args.until else {
        anyhow::ensure!(
            args.seeds != "auto",
            "--seeds auto adds seeds until a comparison is decided: give --until p<0.01"
        );
        return Ok(None);
    };
    let p: f64 = text
        .trim()
        .strip_prefix("p<")
        .and_then(|v| v.trim().parse().ok())
        .filter(|p: &f64| *p > 0.0 && *p < 1.0)
        .ok_or_else(|| {
            anyhow::anyhow!("--until {text}: expected p<P with P in (0, 1), e.g. --until p<0.01")
        })?;
    let seeds = if args.seeds == "auto" { 2 } else { sweep::file::parse_seeds(&args.seeds)?.len() };
    anyhow::ensure!(
        (2..=1000).contains(&args.max_seeds) && args.max_seeds >= seeds,
        "--max-seeds {}: must be in 2..=1000 and at least the {seeds} planned seeds",
        args.max_seeds
    );
    Ok(Some(sweep::runner::Until { p, max_seeds: args.max_seeds }))
}

/// `--run-index K`: trains run K of the plan in the folder given as SPEC.
fn run_index(args: &Args, k: usize) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.sets.is_empty() && args.budget.is_none() && args.emit.is_none() && !args.dry_run,
        "--run-index {k} trains a run of the plan in the folder {}: --set, --budget, --emit and --dry-run do \
         not apply",
        args.spec.display()
    );
    let opts = SweepOptions {
        device: args.device.into(),
        progress: !args.quiet,
        catch_signals: true,
        retry_failed: args.retry_failed,
        ..SweepOptions::new(&args.spec)
    };
    match sweep::runner::run_index(k, &opts) {
        Ok(r) => {
            let how = if r.trained { "trained" } else { "already ended" };
            match &r.outcome {
                sweep::RunOutcome::Finished(m) => {
                    println!("{}: {how}, val loss {:.4} ({})", r.label, m.val_loss, r.run_dir.display());
                    Ok(ExitCode::SUCCESS)
                }
                sweep::RunOutcome::Failed(why) => {
                    println!("{}: {how}, FAILED: {why} ({})", r.label, r.run_dir.display());
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Err(err @ SweepRunError::Interrupted { .. }) => {
            eprintln!("{err}");
            Ok(ExitCode::from(130))
        }
        Err(err) => Err(err).with_context(|| format!("run {k} of the sweep in {}", args.spec.display())),
    }
}

/// `--emit slurm`: writes the plan into the folder as a sweep would, and beside it an
/// sbatch job array with one task per run, each `widen sweep DIR --run-index K`.
fn emit_slurm(args: &Args, sweep: &Sweep, opts: &SweepOptions) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.max_parallel >= 1, "--max-parallel 0: at least one task must run at a time");
    anyhow::ensure!(
        args.jobs == 1,
        "--jobs {} does not apply with --emit: each array task trains one run",
        args.jobs
    );
    let file = sweep::runner::plan_only(sweep, opts)
        .with_context(|| format!("planning sweep {} into {}", args.spec.display(), opts.out_dir.display()))?;
    let runs = file.runs().count();
    let dir = std::fs::canonicalize(&opts.out_dir)
        .with_context(|| format!("cannot resolve {}", opts.out_dir.display()))?;
    let exe = std::env::current_exe().context("cannot find the widen executable for the job script")?;
    let device: runtime::device::Device = args.device.into();
    let script = sbatch_script(args, &sweep.base.name, &dir, &exe, device.name(), runs);
    let path = dir.join(SBATCH_FILE);
    sweep::folder::write_atomic(&path, script.as_bytes())?;
    println!("planned {runs} runs into {}; submit them with: sbatch {}", dir.display(), path.display());
    println!("then `widen report {}` gathers the runs that have finished", dir.display());
    Ok(ExitCode::SUCCESS)
}

/// `'text'` for a POSIX shell.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// The job array: `#SBATCH` lines from the flags, then one command per task.
fn sbatch_script(
    args: &Args,
    name: &str,
    dir: &std::path::Path,
    exe: &std::path::Path,
    device: &str,
    runs: usize,
) -> String {
    let mut s = String::from("#!/bin/bash\n");
    s.push_str(&format!(
        "# widen sweep: {runs} runs of the plan in {}, one array task each.\n",
        dir.display()
    ));
    s.push_str("# Written by `widen sweep --emit slurm`; `widen report DIR` gathers what has finished.\n");
    let job: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    s.push_str(&format!("#SBATCH --job-name=widen-{job}\n"));
    s.push_str(&format!("#SBATCH --array=0-{}%{}\n", runs.saturating_sub(1), args.max_parallel));
    s.push_str(&format!("#SBATCH --output={}/slurm-%A_%a.out\n", dir.display()));
    if let Some(g) = args.slurm_gpus {
        s.push_str(&format!("#SBATCH --gpus={g}\n"));
    }
    if let Some(c) = args.slurm_cpus {
        s.push_str(&format!("#SBATCH --cpus-per-task={c}\n"));
    }
    if let Some(t) = &args.slurm_time {
        s.push_str(&format!("#SBATCH --time={t}\n"));
    }
    if let Some(p) = &args.slurm_partition {
        s.push_str(&format!("#SBATCH --partition={p}\n"));
    }
    for o in &args.slurm_option {
        s.push_str(&format!("#SBATCH {o}\n"));
    }
    s.push_str("set -euo pipefail\n");
    s.push_str(&format!(
        "exec {} sweep {} --run-index \"$SLURM_ARRAY_TASK_ID\" --device {device}{}\n",
        shell_quote(&exe.display().to_string()),
        shell_quote(&dir.display().to_string()),
        if args.retry_failed { " --retry-failed" } else { "" }
    ));
    s
}

/// A sweep file when the file is one (its first item is `Sweep(`), else a spec and
/// the shorthand flags.
fn load(args: &Args) -> anyhow::Result<Sweep> {
    let text = std::fs::read_to_string(&args.spec)
        .with_context(|| format!("cannot read {}", args.spec.display()))?;
    if sweep::file::is_sweep_file(&text) {
        anyhow::ensure!(
            args.sets.is_empty() && args.budget.is_none() && args.seeds == "1",
            "{} is a sweep file: it gives the axes, seeds and budget, so --set, --seeds and --budget \
             do not apply (edit the file instead)",
            args.spec.display()
        );
        let mut sweep = Sweep::load(&args.spec)?;
        sweep.baseline |= args.baseline;
        if args.skip_invalid {
            sweep.on_invalid = OnInvalid::Skip;
        }
        return Ok(sweep);
    }
    let base = load_spec(&args.spec)?;
    let budget = args.budget.clone().unwrap_or_else(|| format!("steps={}", base.train.steps));
    let seeds = if args.seeds == "auto" { "2" } else { args.seeds.as_str() };
    let mut sweep = Sweep::from_cli(base, &args.spec.display().to_string(), &args.sets, seeds, &budget)?;
    sweep.baseline = args.baseline;
    sweep.on_invalid = if args.skip_invalid { OnInvalid::Skip } else { OnInvalid::Refuse };
    Ok(sweep)
}

/// What a sweep would train, on stdout.
fn print_plan(
    plan: &sweep::Expansion,
    data: &std::collections::BTreeMap<String, sweep::DataRecord>,
    budget: &sweep::Budget,
) {
    if let sweep::Budget::Time(seconds) = budget {
        // The steps are measured on the device when the sweep starts.
        println!("time budget: {seconds} s of steps per point; each point's steps are fixed by timing a few of its steps on the sweep's device when it starts (the counts below are before that)");
    }
    let width = plan.points.iter().map(|p| p.name.len()).max().unwrap_or(5).max(5);
    println!(
        "{:<width$}  {:>6}  {:>8}  {:>12}  {:>12}  {:>10}",
        "point", "seeds", "steps", "tokens", "train FLOPs", "baseline"
    );
    for p in &plan.points {
        println!(
            "{:<width$}  {:>6}  {:>8}  {:>12}  {:>12.3e}  {:>10}",
            p.name,
            p.runs.len(),
            p.budget.steps,
            p.budget.tokens,
            p.budget.flops,
            p.baseline.as_deref().unwrap_or("-")
        );
    }
    for bad in &plan.invalid {
        println!("skipped (invalid) {bad}");
    }
    let mut sources: Vec<String> = data.values().map(sweep::DataRecord::describe).collect();
    sources.sort();
    sources.dedup();
    for source in sources {
        println!("data {source}");
    }
    let runs: usize = plan.points.iter().map(|p| p.runs.len()).sum();
    let flops: f64 = plan.points.iter().map(|p| p.budget.flops * p.runs.len() as f64).sum();
    println!(
        "{} points, {runs} runs, {flops:.3e} training FLOPs in all; nothing trained (--dry-run)",
        plan.points.len()
    );
}

/// `residual.r-4 beats residual.r-1 by 0.0123 ± 0.0040 nats/token (95% CI, paired over
/// 3 seeds, p = 0.004)`: the direction is said only when the interval excludes 0.
pub fn significance_line(point: &str, against: &str, d: &sweep::stats::Difference) -> String {
    let half = (d.ci95_hi - d.ci95_lo) / 2.0;
    let how = format!("95% CI, {}, p = {:.2e}", d.test.describe(), d.p_value);
    if d.ci95_hi < 0.0 {
        format!("{point} beats {against} by {:.4} ± {half:.4} nats/token ({how})", -d.mean)
    } else if d.ci95_lo > 0.0 {
        format!("{point} is worse than {against} by {:.4} ± {half:.4} nats/token ({how})", d.mean)
    } else {
        format!(
            "{point} and {against} do not differ significantly: {:+.4} ± {half:.4} nats/token ({how})",
            d.mean
        )
    }
}

/// The results table, the skipped points and the fitted laws, on stdout.
pub fn print_report(report: &SweepReport) {
    let width = report.results.iter().map(|r| r.point.len()).max().unwrap_or(5).max(5);
    println!(
        "{:<width$}  {:>6}  {:>17}  {:>9}  {:>9}  {:>9}  status",
        "point", "seeds", "val loss (nats)", "bits/byte", "ms/step", "overhead"
    );
    for r in &report.results {
        let val = match (r.val_loss.mean, r.val_loss.std) {
            (Some(m), Some(s)) => format!("{m:.4} ± {s:.4}"),
            (Some(m), None) => format!("{m:.4}"),
            _ => "-".into(),
        };
        let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map(f).unwrap_or_else(|| "-".into());
        println!(
            "{:<width$}  {:>6}  {:>17}  {:>9}  {:>9}  {:>9}  {}",
            r.point,
            format!("{}/{}", r.seeds_finished, r.seeds.len()),
            val,
            opt(r.val_bits_per_byte, &|b| format!("{b:.4}")),
            opt(r.ms_per_step.mean, &|m| format!("{m:.2}")),
            opt(r.overhead_ms_per_step, &|o| format!("{:+.1}%", 100.0 * o)),
            match &r.status {
                Status::Ok => "ok".to_string(),
                Status::Failed(reason) => format!("failed: {reason}"),
            }
        );
    }
    println!(
        "losses are validation next-token losses in nats per token; bits/byte counts the bytes \
         behind the tokens (nats / ln 2 for byte data, '-' when the tokenizer is unknown); ± is the \
         standard deviation over seeds"
    );
    for (name, reason) in &report.invalid {
        println!("skipped (invalid) {name}: {reason}");
    }
    if !report.kept.is_empty() {
        let shown: Vec<String> = report.kept.iter().take(6).map(|d| d.display().to_string()).collect();
        let more = report.kept.len().saturating_sub(shown.len());
        println!(
            "kept {} run(s) of earlier sweeps into this folder that this command did not ask for: {}{}; \
             they stay in the results (sweep into another --out to compare without them)",
            report.kept.len(),
            shown.join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        );
    }
    for why in &report.damaged {
        println!("no result: {why}");
    }
    for r in &report.results {
        if let (Some(against), Some(d)) = (&r.compared_to, &r.delta_val_loss) {
            println!("{}", significance_line(&r.point, against, d));
        }
    }
    for law in &report.laws {
        match &law.fit {
            Ok(fit) => {
                let half = fit.slope_ci95();
                let per = match law.form {
                    sweep::plot::LawForm::Log2 => "per doubling".to_string(),
                    sweep::plot::LawForm::Linear => {
                        format!("per unit of {} (log2 is undefined at 0)", law.axis)
                    }
                };
                println!(
                    "law over {}: {}, R² = {:.3}, n = {}; slope {:+.4} ± {:.4} {per} (95% CI{}) ({})",
                    law.axis,
                    fit.equation("L", &law.form.x_label(&law.axis)),
                    fit.r2,
                    fit.n,
                    fit.b,
                    half,
                    if (fit.b - half) * (fit.b + half) > 0.0 { ", excludes 0" } else { ", includes 0" },
                    law.file.display()
                )
            }
            Err(e) => println!("law over {}: no fit ({e})", law.axis),
        }
    }
    // `widen report` trains and reuses nothing: it says what the folder holds.
    let counts = if report.trained == 0 && report.reused == 0 {
        let runs: usize = report.results.iter().map(|r| r.seeds.len()).sum();
        let finished: usize = report.results.iter().map(|r| r.seeds_finished).sum();
        format!(
            "{runs} runs: {finished} finished, {} failed, {} without a result yet",
            report.failed,
            runs.saturating_sub(finished + report.failed)
        )
    } else {
        format!("{} runs trained, {} reused, {} failed", report.trained, report.reused, report.failed)
    };
    println!(
        "{counts}; results in {} ({}, {}, {}/)",
        report.dir.display(),
        sweep::folder::RESULTS_CSV,
        sweep::folder::RESULTS_JSON,
        sweep::folder::PLOTS_DIR
    );
}
