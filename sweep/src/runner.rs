//! Running a sweep: every (point, seed) run trained into its own folder, results and
//! plots written after each run, and a folder that survives interruptions.
//!
//! The sweep folder:
//!
//! ```text
//! DIR/
//!   sweep.lock            held while a sweep runs in DIR (a second one is refused)
//!   plan.json             the expanded sweep: axes, budget, every point's spec and runs,
//!                         the invalid points and why; `widen report` reads it
//!   <point>/seed-<s>/     a run folder (metrics.jsonl, checkpoints, final.safetensors)
//!                         and outcome.json once the run has ended
//!   results.csv           one row per point (crate::results)
//!   results.json
//!   plots/                loss.svg, law*.svg, frontier.svg, speed.svg (crate::plot)
//! ```
//!
//! **Nothing finished is redone.** A run whose `outcome.json` says it finished is
//! read back, not trained. A run that failed (diverged, too large, a device
//! error, a panic) has its reason in `outcome.json` and is not retried unless
//! [`SweepOptions::retry_failed`] says so: its failure is a result, and the sweep
//! goes on to the next run. A run that was stopped part way (a signal, a killed
//! process) resumes from its newest checkpoint, bit for bit; one stopped before its
//! first checkpoint starts again. A run that saved `final.safetensors` but was
//! killed before writing its outcome is read back from its metrics.
//!
//! **A rerun is the same sweep.** Rerunning into a folder whose `plan.json` gives a
//! point another spec (another budget, base or value) is refused, naming the point:
//! its runs would not compare with the new ones. Adding points or seeds is allowed;
//! the finished runs are kept.
//!
//! **Fairness.** Every point trained with seed s sees the same batches in the same
//! order and is validated on the same held-out windows (both follow `train.seed`,
//! crate::point). Validation loss is the main head's next-token loss in nats; bits
//! per byte is that over ln 2 (the vocabulary is the 256 byte values).
//!
//! **What a run measured** (from its `metrics.jsonl`): the training loss is the mean
//! over the last tenth of its steps (one batch's loss is noisy), the validation loss
//! the last evaluation (every run evaluates at its last step), ms/step the mean
//! step time without the first step (which includes one-off setup).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ir::cost::cost_report;
use runtime::executor::Device;
use runtime::train::{
    train_spec, StepEvent, StepObserver, TrainError, TrainOptions, FINAL_CHECKPOINT, METRICS_FILE,
};
use serde::{Deserialize, Serialize};

use crate::budget::Budget;
use crate::file::Sweep;
use crate::plot::{
    self, CostPoint, FrontierPlot, LawPlot, LawPoint, LossCurves, PointCurves, SpeedBar, SpeedPlot,
};
use crate::point::{expand, Plan, PlanError, Point, RATIO_AXIS};
use crate::results::{self, fill_overheads, PointResult, RunMetrics, RunOutcome};

/// The expanded sweep in the folder.
pub const PLAN_FILE: &str = "plan.json";
/// A run's ending: finished with its metrics, or failed with the reason.
pub const OUTCOME_FILE: &str = "outcome.json";
/// Time a stopped run had already trained, added to its wall time when it finishes.
const ELAPSED_FILE: &str = "elapsed.json";
/// The lock of a sweep folder.
pub const LOCK_FILE: &str = "sweep.lock";
/// The results table, as CSV and as JSON.
pub const RESULTS_CSV: &str = "results.csv";
pub const RESULTS_JSON: &str = "results.json";
/// The plots' folder.
pub const PLOTS_DIR: &str = "plots";

/// How to run a sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepOptions {
    /// The sweep folder (created if missing).
    pub out_dir: PathBuf,
    /// Where every run trains.
    pub device: Device,
    /// Show progress on stderr: point i/n, the run's step, elapsed time and ETA.
    pub progress: bool,
    /// Catch Ctrl-C and SIGTERM: the running run saves a checkpoint and the sweep
    /// stops with [`SweepRunError::Interrupted`]; a rerun continues it.
    pub catch_signals: bool,
    /// Train again the runs whose outcome is a failure.
    pub retry_failed: bool,
}

impl SweepOptions {
    /// A sweep into `out_dir` on the Cpu device, silent, signals left to the caller.
    pub fn new(out_dir: impl Into<PathBuf>) -> SweepOptions {
        SweepOptions {
            out_dir: out_dir.into(),
            device: Device::Cpu,
            progress: false,
            catch_signals: false,
            retry_failed: false,
        }
    }
}

/// Errors that stop a sweep (a failing run does not: its failure is recorded).
#[derive(Debug, thiserror::Error)]
pub enum SweepRunError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("cannot write {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("sweep folder {dir} is in use by another sweep; wait for it to finish, stop it, or choose another --out")]
    Locked { dir: PathBuf },
    #[error(
        "point `{point}` in {dir} was planned with another spec ({fields}); its runs would not compare with \
         this sweep's: choose another --out folder or remove {dir}"
    )]
    Changed { dir: PathBuf, point: String, fields: String },
    #[error("--device cuda: no CUDA driver (libcuda) on this machine; run on --device cpu or reference")]
    NoCuda,
    /// A run cannot read its data: every run would fail the same way.
    #[error("run {run}: {source}")]
    Data { run: PathBuf, source: runtime::data::DataError },
    /// A run cannot write its folder (a full disk, no permission): the sweep cannot record results.
    #[error("run {run} cannot write its folder")]
    Write { run: PathBuf, source: Box<TrainError> },
    #[error("interrupted during run {run}; it is saved in {}; run the same command again to continue the sweep", checkpoint.display())]
    Interrupted { run: PathBuf, checkpoint: PathBuf },
    #[error(transparent)]
    Results(#[from] results::ResultsError),
    #[error("cannot catch Ctrl-C and SIGTERM")]
    Signals(#[source] Box<TrainError>),
}

/// The expanded sweep as `plan.json` holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    /// Axis paths in the sweep's order.
    pub axes: Vec<String>,
    pub budget: Budget,
    pub seeds: Vec<u64>,
    pub points: Vec<Point>,
    /// Points the validator rejected (skipped): name and reason.
    pub invalid: Vec<(String, String)>,
}

impl PlanFile {
    fn of(sweep: &Sweep, plan: &Plan) -> PlanFile {
        PlanFile {
            axes: sweep.axes.iter().map(|a| a.path.clone()).collect(),
            budget: sweep.budget,
            seeds: sweep.seeds.clone(),
            points: plan.points.clone(),
            invalid: plan.invalid.iter().map(|p| (p.name.clone(), p.error.to_string())).collect(),
        }
    }

    /// Reads `DIR/plan.json`.
    pub fn read(dir: &Path) -> Result<PlanFile, SweepRunError> {
        let path = dir.join(PLAN_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| SweepRunError::Read { path: path.clone(), message: e.to_string() })?;
        serde_json::from_str(&text).map_err(|e| SweepRunError::Read { path, message: e.to_string() })
    }
}

/// What a sweep did.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepReport {
    pub dir: PathBuf,
    /// One row per point, as in `results.csv`.
    pub results: Vec<PointResult>,
    /// Points skipped as invalid: name and reason.
    pub invalid: Vec<(String, String)>,
    /// Runs trained (or continued) by this call.
    pub trained: usize,
    /// Runs whose earlier outcome was reused.
    pub reused: usize,
    /// Runs that ended in failure (this call or before).
    pub failed: usize,
    /// The fits of the log-linear law, one per plot drawn (see [`render`]).
    pub laws: Vec<LawSummary>,
}

/// One fitted law `L = a + b·log2(x)` over an axis.
#[derive(Debug, Clone, PartialEq)]
pub struct LawSummary {
    /// The plot file.
    pub file: PathBuf,
    pub axis: String,
    /// The fit's equation with standard errors and R², or why there is none.
    pub fit: Result<crate::fit::LinearFit, crate::fit::FitError>,
}

impl Sweep {
    /// Expands and runs the sweep into `opts.out_dir` (see the module doc).
    pub fn run(&self, opts: &SweepOptions) -> Result<SweepReport, SweepRunError> {
        run(self, opts)
    }
}

/// Expands `sweep`, checks the folder holds no other sweep, trains every run not yet
/// done, and writes the results and plots (after every run, so an interrupted sweep
/// leaves its results so far).
pub fn run(sweep: &Sweep, opts: &SweepOptions) -> Result<SweepReport, SweepRunError> {
    let plan = expand(sweep)?;
    if opts.device == Device::Cuda && !runtime::device::cuda::driver_available() {
        return Err(SweepRunError::NoCuda);
    }
    let dir = &opts.out_dir;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let _lock = lock(dir)?;
    let file = PlanFile::of(sweep, &plan);
    check_same_sweep(dir, &file)?;
    write_atomic(&dir.join(PLAN_FILE), &serde_json::to_string_pretty(&file).expect("a plan serializes"))?;

    let runs: Vec<(usize, &Point, &crate::point::Run)> =
        plan.points.iter().enumerate().flat_map(|(i, p)| p.runs.iter().map(move |r| (i, p, r))).collect();
    let todo: Vec<bool> =
        runs.iter().map(|(_, _, r)| needs_training(&dir.join(&r.dir), opts.retry_failed)).collect();
    let work = |p: &Point| p.budget.flops;
    let progress = Arc::new(Mutex::new(ProgressState {
        on: opts.progress,
        terminal: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        started: Instant::now(),
        total_runs: runs.len(),
        work_total: runs.iter().zip(&todo).filter(|(_, t)| **t).map(|((_, p, _), _)| work(p)).sum(),
        work_done: 0.0,
        run_work_per_step: 0.0,
        label: String::new(),
        open: false,
    }));
    let (mut trained, mut reused) = (0, 0);
    for (n, ((i, point, run), todo)) in runs.iter().zip(todo).enumerate() {
        let run_dir = dir.join(&run.dir);
        if !todo {
            reused += 1;
            continue;
        }
        if read_outcome(&run_dir).is_none() && run_dir.join(FINAL_CHECKPOINT).exists() {
            // Killed after its final checkpoint, before its outcome: finished.
            let outcome = match measured(&run_dir, point, read_elapsed(&run_dir)) {
                Ok(m) => RunOutcome::Finished(m),
                Err(reason) => RunOutcome::Failed(reason),
            };
            write_outcome(&run_dir, &outcome)?;
            reused += 1;
            continue;
        }
        {
            let mut p = progress.lock().expect("progress lock");
            p.label = format!(
                "point {}/{} {} seed {} (run {}/{})",
                i + 1,
                plan.points.len(),
                point.name,
                run.seed,
                n + 1,
                runs.len()
            );
            p.run_work_per_step = work(point) / point.budget.steps.max(1) as f64;
            p.start_run();
        }
        let observer = {
            let progress = Arc::clone(&progress);
            StepObserver::new(move |e: StepEvent| progress.lock().expect("progress lock").step(e))
        };
        let outcome = train_run(point, run, &run_dir, opts, observer)?;
        progress.lock().expect("progress lock").end_run(&outcome);
        trained += 1;
        write_outcome(&run_dir, &outcome)?;
        report_into(dir, &file)?;
    }
    let mut report = report_into(dir, &file)?;
    report.trained = trained;
    report.reused = reused;
    Ok(report)
}

/// Re-reads a sweep folder: collects every run's outcome, writes `results.csv`,
/// `results.json` and the plots (what `widen report` does).
pub fn report(dir: &Path) -> Result<SweepReport, SweepRunError> {
    let file = PlanFile::read(dir)?;
    report_into(dir, &file)
}

fn report_into(dir: &Path, file: &PlanFile) -> Result<SweepReport, SweepRunError> {
    let mut rows = Vec::new();
    let mut curves = Vec::new();
    let mut failed = 0;
    for point in &file.points {
        let cost = cost_report(&point.spec)
            .map_err(|e| SweepRunError::Read { path: dir.join(&point.name), message: e.to_string() })?;
        let mut outcomes = Vec::new();
        let mut seeds = PointCurves { label: point.name.clone(), train: Vec::new(), val: Vec::new() };
        for run in &point.runs {
            let run_dir = dir.join(&run.dir);
            if let Some(outcome) = read_outcome(&run_dir) {
                failed += usize::from(matches!(outcome, RunOutcome::Failed(_)));
                outcomes.push((run.seed, outcome));
            }
            if let Ok(lines) = metrics_lines(&run_dir) {
                let tokens = |step: u64| (step * point.budget.tokens_per_step) as f64;
                seeds.train.push(lines.iter().map(|l| (tokens(l.step), l.loss)).collect());
                seeds
                    .val
                    .push(lines.iter().filter_map(|l| l.val_loss.map(|v| (tokens(l.step), v))).collect());
            }
        }
        rows.push(PointResult::aggregate(point, &cost, &outcomes));
        curves.push(seeds);
    }
    fill_overheads(&mut rows);
    results::write_csv(&dir.join(RESULTS_CSV), &file.axes, &rows)?;
    results::write_json(&dir.join(RESULTS_JSON), &file.axes, &rows)?;
    let laws = render(dir, file, &rows, curves)?;
    Ok(SweepReport {
        dir: dir.to_path_buf(),
        results: rows,
        invalid: file.invalid.clone(),
        trained: 0,
        reused: 0,
        failed,
        laws,
    })
}

/// Draws the plots into `DIR/plots`: loss curves, the law (one plot per numeric
/// axis, over the points that differ from the first point only on that axis, so a
/// fit never mixes two changes), the frontier and the speed bars. A plot with no
/// finished point to draw is left out.
fn render(
    dir: &Path,
    file: &PlanFile,
    rows: &[PointResult],
    curves: Vec<PointCurves>,
) -> Result<Vec<LawSummary>, SweepRunError> {
    let plots = dir.join(PLOTS_DIR);
    std::fs::create_dir_all(&plots).map_err(io(&plots))?;
    let write = |name: &str, svg: Result<String, plot::PlotError>| -> Result<(), SweepRunError> {
        match svg {
            Ok(svg) => write_atomic(&plots.join(name), &svg),
            Err(_) => Ok(()),
        }
    };
    let title = |what: &str| format!("{what} ({})", budget_text(&file.budget));
    write(
        "loss.svg",
        plot::loss_curves(&LossCurves { title: title("loss against tokens"), points: curves }),
    )?;
    let finished: Vec<&PointResult> = rows.iter().filter(|r| r.val_loss.mean.is_some()).collect();
    write(
        "frontier.svg",
        plot::frontier(&FrontierPlot {
            title: title("validation loss against training compute"),
            points: finished
                .iter()
                .map(|r| CostPoint {
                    label: r.point.clone(),
                    flops: r.tokens_trained as f64 * r.flops_per_token_train as f64,
                    loss: r.val_loss.mean.unwrap_or(f64::NAN),
                })
                .collect(),
        }),
    )?;
    write(
        "speed.svg",
        plot::speed(&SpeedPlot {
            title: "time per step and overhead over the plain-residual twin".into(),
            bars: finished
                .iter()
                .filter_map(|r| {
                    r.ms_per_step.mean.map(|ms| SpeedBar {
                        label: r.point.clone(),
                        ms_per_step: ms,
                        overhead: r.overhead_ms_per_step,
                    })
                })
                .collect(),
        }),
    )?;

    let mut laws = Vec::new();
    for (a, axis) in file.axes.iter().enumerate() {
        let Some(first) = file.points.iter().find(|p| !p.is_baseline_twin) else { break };
        let same_elsewhere =
            |p: &Point| p.values.iter().enumerate().all(|(b, (_, v))| b == a || *v == first.values[b].1);
        let points: Vec<LawPoint> = file
            .points
            .iter()
            .zip(rows)
            .filter(|(p, _)| !p.is_baseline_twin && p.values.len() == file.axes.len() && same_elsewhere(p))
            .filter_map(|(p, r)| {
                let x: f64 = p.values[a].1.parse().ok()?;
                Some(LawPoint { label: p.name.clone(), x, loss: r.val_loss.mean? })
            })
            .collect();
        let numeric =
            file.points.iter().filter(|p| !p.is_baseline_twin).all(|p| p.values[a].1.parse::<f64>().is_ok());
        if !numeric || points.is_empty() {
            continue;
        }
        let name = if file.axes.len() == 1 { "law.svg".to_string() } else { format!("law-{axis}.svg") };
        let shown = if axis == RATIO_AXIS { "r = n/m".to_string() } else { axis.clone() };
        if let Ok((svg, fit)) = plot::law(&LawPlot {
            title: title(&format!("validation loss against log2({shown})")),
            axis: shown,
            points,
        }) {
            write_atomic(&plots.join(&name), &svg)?;
            laws.push(LawSummary { file: plots.join(&name), axis: axis.clone(), fit });
        }
    }
    Ok(laws)
}

fn budget_text(budget: &Budget) -> String {
    match budget {
        Budget::Tokens(n) => format!("equal tokens: {n} per point"),
        Budget::Flops(f) => format!("equal training compute: {f:.3e} FLOPs per point"),
        Budget::Steps(n) => format!("{n} steps per point"),
    }
}

/// Trains one run (or continues it from its newest checkpoint) and says how it ended.
/// Errors that are the sweep's, not the point's (data, a full disk, an interruption),
/// stop the sweep instead.
fn train_run(
    point: &Point,
    run: &crate::point::Run,
    run_dir: &Path,
    opts: &SweepOptions,
    observer: StepObserver,
) -> Result<RunOutcome, SweepRunError> {
    let resume = newest_checkpoint(run_dir);
    if resume.is_none() {
        // Stopped before its first checkpoint: nothing to continue, start again.
        for name in [METRICS_FILE, ELAPSED_FILE] {
            let path = run_dir.join(name);
            if path.exists() {
                std::fs::remove_file(&path).map_err(io(&path))?;
            }
        }
    }
    let before = read_elapsed(run_dir);
    let train_opts = TrainOptions {
        resume,
        catch_signals: opts.catch_signals,
        on_step: Some(observer),
        ..TrainOptions::quiet(run_dir.to_path_buf())
    };
    let started = Instant::now();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train_spec(&run.spec, opts.device, &train_opts)
    }));
    let wall_s = before + started.elapsed().as_secs_f64();
    let err = match result {
        Ok(Ok(_)) => {
            return Ok(match measured(run_dir, point, wall_s) {
                Ok(m) => RunOutcome::Finished(m),
                Err(reason) => RunOutcome::Failed(reason),
            })
        }
        Ok(Err(err)) => err,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            return Ok(RunOutcome::Failed(format!("panicked: {message}")));
        }
    };
    let run_path = run_dir.to_path_buf();
    match err {
        TrainError::Interrupted { checkpoint, .. } => {
            write_atomic(&run_dir.join(ELAPSED_FILE), &serde_json::json!({ "wall_s": wall_s }).to_string())?;
            Err(SweepRunError::Interrupted { run: run_path, checkpoint })
        }
        TrainError::Data(source) => Err(SweepRunError::Data { run: run_path, source }),
        TrainError::Signals(_) => Err(SweepRunError::Signals(Box::new(err))),
        TrainError::Io { .. } | TrainError::SaveFailed { .. } | TrainError::Locked { .. } => {
            Err(SweepRunError::Write { run: run_path, source: Box::new(err) })
        }
        TrainError::TooLarge(_)
        | TrainError::RunExists { .. }
        | TrainError::WouldReplace { .. }
        | TrainError::ResumePastEnd { .. }
        | TrainError::NonFinite { .. }
        | TrainError::Diverged { .. }
        | TrainError::Device(_)
        | TrainError::Step { .. }
        | TrainError::Checkpoint(_)
        | TrainError::Lower(_)
        | TrainError::Init(_)
        | TrainError::Dist(_)
        | TrainError::Moe(_) => Ok(RunOutcome::Failed(chain(&err))),
    }
}

/// An error and its sources, joined by `: `.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Whether a run still has to train: no outcome yet, or a failure to retry.
fn needs_training(run_dir: &Path, retry_failed: bool) -> bool {
    match read_outcome(run_dir) {
        Some(RunOutcome::Finished(_)) => false,
        Some(RunOutcome::Failed(_)) => retry_failed,
        None => true,
    }
}

/// The run's `outcome.json`, if it has one that reads.
fn read_outcome(run_dir: &Path) -> Option<RunOutcome> {
    let text = std::fs::read_to_string(run_dir.join(OUTCOME_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_outcome(run_dir: &Path, outcome: &RunOutcome) -> Result<(), SweepRunError> {
    write_atomic(
        &run_dir.join(OUTCOME_FILE),
        &serde_json::to_string_pretty(outcome).expect("an outcome serializes"),
    )?;
    let elapsed = run_dir.join(ELAPSED_FILE);
    if elapsed.exists() {
        std::fs::remove_file(&elapsed).map_err(io(&elapsed))?;
    }
    Ok(())
}

fn read_elapsed(run_dir: &Path) -> f64 {
    std::fs::read_to_string(run_dir.join(ELAPSED_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["wall_s"].as_f64())
        .unwrap_or(0.0)
}

/// The newest `ckpt-<step>.safetensors` of a run folder.
fn newest_checkpoint(run_dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(run_dir).ok()?;
    entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("ckpt-")?.strip_suffix(".safetensors")?.parse().ok()?;
            Some((step, run_dir.join(name)))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, path)| path)
}

/// One line of a run's `metrics.jsonl`.
struct MetricsLine {
    step: u64,
    /// Tokens trained up to this step (absent from older metrics files).
    tokens: Option<u64>,
    loss: f64,
    val_loss: Option<f64>,
    tokens_per_s: f64,
}

fn metrics_lines(run_dir: &Path) -> Result<Vec<MetricsLine>, String> {
    let path = run_dir.join(METRICS_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).map_err(|e| format!("{}: bad line: {e}", path.display()))?;
            Ok(MetricsLine {
                step: v["step"].as_u64().ok_or_else(|| format!("{}: a line has no step", path.display()))?,
                tokens: v["tokens"].as_u64(),
                loss: v["loss"].as_f64().unwrap_or(f64::NAN),
                val_loss: v["val_loss"].as_f64(),
                tokens_per_s: v["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            })
        })
        .collect()
}

/// Draws one run's training and validation loss against tokens into
/// `RUN_DIR/loss.svg` (what `widen plot` does); returns the file.
pub fn plot_run(run_dir: &Path) -> Result<PathBuf, SweepRunError> {
    let path = run_dir.join(METRICS_FILE);
    let lines =
        metrics_lines(run_dir).map_err(|message| SweepRunError::Read { path: path.clone(), message })?;
    if lines.is_empty() {
        return Err(SweepRunError::Read { path, message: "it holds no step yet".into() });
    }
    let Some(per_step) = lines.iter().find_map(|l| l.tokens.map(|t| t / l.step.max(1))) else {
        return Err(SweepRunError::Read {
            path,
            message:
                "its lines have no `tokens` field (written by an older widen); train it again to plot it"
                    .into(),
        });
    };
    let x = |l: &MetricsLine| l.tokens.unwrap_or(l.step * per_step) as f64;
    let label = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
    let curves = PointCurves {
        label: label.clone(),
        train: vec![lines.iter().map(|l| (x(l), l.loss)).collect()],
        val: vec![lines.iter().filter_map(|l| l.val_loss.map(|v| (x(l), v))).collect()],
    };
    let svg = plot::loss_curves(&LossCurves {
        title: format!("{label}: loss against tokens"),
        points: vec![curves],
    })
    .map_err(|e| SweepRunError::Read { path, message: e.to_string() })?;
    let out = run_dir.join("loss.svg");
    write_atomic(&out, &svg)?;
    Ok(out)
}

/// What a finished run measured, from its metrics (see the module doc).
fn measured(run_dir: &Path, point: &Point, wall_s: f64) -> Result<RunMetrics, String> {
    let lines = metrics_lines(run_dir)?;
    if !run_dir.join(FINAL_CHECKPOINT).exists() {
        return Err(format!("{} has no {FINAL_CHECKPOINT}", run_dir.display()));
    }
    let tail = (lines.len() / 10).max(1);
    let last: Vec<f64> = lines.iter().rev().take(tail).map(|l| l.loss).collect();
    let val_loss = lines
        .iter()
        .rev()
        .find_map(|l| l.val_loss)
        .ok_or_else(|| format!("{} holds no validation loss", run_dir.display()))?;
    let per_step = point.budget.tokens_per_step as f64;
    let times: Vec<f64> =
        lines.iter().skip(usize::from(lines.len() > 1)).map(|l| 1000.0 * per_step / l.tokens_per_s).collect();
    Ok(RunMetrics {
        train_loss: last.iter().sum::<f64>() / last.len() as f64,
        val_loss,
        ms_per_step: times.iter().sum::<f64>() / times.len().max(1) as f64,
        tokens: point.budget.tokens,
        wall_s,
    })
}

/// Refuses a folder whose plan gives one of this sweep's points another spec.
fn check_same_sweep(dir: &Path, file: &PlanFile) -> Result<(), SweepRunError> {
    if !dir.join(PLAN_FILE).exists() {
        return Ok(());
    }
    let old = PlanFile::read(dir)?;
    for point in &file.points {
        let Some(before) = old.points.iter().find(|p| p.name == point.name) else { continue };
        let (a, b) = (serde_json::to_value(&before.spec), serde_json::to_value(&point.spec));
        let (Ok(a), Ok(b)) = (a, b) else { continue };
        let mut fields = Vec::new();
        diff_fields("", &a, &b, &mut fields);
        if !fields.is_empty() {
            return Err(SweepRunError::Changed {
                dir: dir.to_path_buf(),
                point: point.name.clone(),
                fields: fields.join(", "),
            });
        }
    }
    Ok(())
}

/// The field paths where two JSON values differ.
fn diff_fields(at: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) if x.keys().eq(y.keys()) => {
            for (k, v) in x {
                let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
                diff_fields(&path, v, &y[k], out);
            }
        }
        _ if a != b => out.push(format!("`{at}`: {a} then, {b} now")),
        _ => {}
    }
}

/// Locks the sweep folder for this process (released when the file closes).
fn lock(dir: &Path) -> Result<File, SweepRunError> {
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(SweepRunError::Locked { dir: dir.to_path_buf() }),
        Err(std::fs::TryLockError::Error(source)) => Err(SweepRunError::Io { path, source }),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SweepRunError + '_ {
    move |source| SweepRunError::Io { path: path.to_path_buf(), source }
}

/// Writes `text` to a temporary name beside `path` and renames it into place.
fn write_atomic(path: &Path, text: &str) -> Result<(), SweepRunError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The sweep's progress line: run i/n, the run's step, elapsed time and an ETA from
/// the training FLOPs still to do at the rate seen so far in this call.
struct ProgressState {
    on: bool,
    terminal: bool,
    started: Instant,
    total_runs: usize,
    /// Training FLOPs of the runs this call trains, and of the steps done so far.
    work_total: f64,
    work_done: f64,
    run_work_per_step: f64,
    label: String,
    open: bool,
}

impl ProgressState {
    fn start_run(&mut self) {
        if self.on && !self.terminal {
            eprintln!("{}: starting ({} runs in all)", self.label, self.total_runs);
        }
    }

    fn step(&mut self, e: StepEvent) {
        self.work_done += self.run_work_per_step;
        if !self.on {
            return;
        }
        let elapsed = self.started.elapsed().as_secs_f64();
        let eta = if self.work_done > 0.0 {
            duration(elapsed * (self.work_total - self.work_done).max(0.0) / self.work_done)
        } else {
            "?".into()
        };
        let val = e.val_loss.map(|v| format!("  val {v:.4}")).unwrap_or_default();
        let line = format!(
            "{}  step {}/{}  loss {:.4}{val}  elapsed {}  ETA {eta}",
            self.label,
            e.step,
            e.total,
            e.loss,
            duration(elapsed)
        );
        let every = (e.total / 10).max(1);
        if self.terminal {
            eprint!("\r{line}\x1b[K");
            self.open = true;
        } else if e.step.is_multiple_of(every) || e.step == e.total {
            eprintln!("{line}");
        }
    }

    fn end_run(&mut self, outcome: &RunOutcome) {
        if !self.on {
            return;
        }
        if self.open {
            eprintln!();
            self.open = false;
        }
        match outcome {
            RunOutcome::Finished(m) => eprintln!(
                "{}: done, val loss {:.4} ({:.4} bits/byte), {:.1} ms/step",
                self.label,
                m.val_loss,
                m.val_loss / std::f64::consts::LN_2,
                m.ms_per_step
            ),
            RunOutcome::Failed(reason) => eprintln!("{}: FAILED: {reason}; the sweep goes on", self.label),
        }
    }
}

/// `75` as `1m15s`.
fn duration(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}
