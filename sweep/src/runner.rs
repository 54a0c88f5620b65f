//! Running a sweep: every (point, seed) run trained into its own folder, results and
//! plots written after each run, and a folder that survives interruptions and
//! reruns. The folder's files are described in [`crate::folder`].
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
//! **A rerun adds to the folder; it never drops a result.** `plan.json` holds the
//! union of every sweep into the folder: a rerun with fewer points or seeds trains
//! what it asks for, and every run of an earlier sweep that has an outcome stays in
//! the plan and the results ([`SweepReport::kept`] names them; sweep into another
//! folder to compare without them). Runs of earlier sweeps that never ended and
//! that this sweep does not ask for are dropped from the plan (their folders stay).
//! A rerun whose point of the same name has another spec, whose budget differs, or
//! whose data differs in content is refused, naming the point and the field: its
//! runs would not compare with the earlier ones.
//!
//! **Data is identified by content.** Each point's data is recorded in `plan.json`
//! with its length and SHA-256 (crate::folder::DataRecord). The path is how a run
//! finds it, so the same bytes at another path (a rerun from another folder) are the
//! same data; other bytes under the same name are refused before anything trains,
//! and the data is checked again before every run, so a file changed during a sweep
//! stops it instead of training the remaining runs on other text.
//!
//! **Many runs at once.** [`SweepOptions::jobs`] above 1 trains that many runs at
//! once, each in a process of its own that trains one run of the plan
//! ([`run_index`], `widen sweep DIR --run-index K`): the parent holds the sweep lock,
//! each run its own `run.lock`, and results rewrites take `results.lock`. A cluster's
//! job array runs the same [`run_index`] per task ([`plan_only`] writes the plan).
//! Every run trains as it would alone, so on the reference device the results do not
//! depend on the jobs.
//!
//! **Equal time.** Under [`Budget::Time`] every point's steps are fixed before anything
//! trains from a short timing of its steps on the sweep's device, recorded in
//! `plan.json`; a rerun reads the recording, so the runs stay deterministic.
//!
//! **Seeds until decided.** With [`SweepOptions::until`], points whose comparison is
//! undecided get more seeds after the planned ones, each recorded with why.
//!
//! **Fairness.** Every point trained with seed s sees the same batches in the same
//! order and is validated on the same held-out windows (both follow `train.seed`,
//! crate::point). Validation loss is the main head's next-token loss in nats; bits
//! per byte is that over ln 2 (the vocabulary is the 256 byte values).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use ir::spec::{DataSpec, ModelSpec, ScheduleSpec};
use runtime::data::Corpus;
use runtime::device::Device;
use runtime::progress::{clock, eta_text, Line, Mark, Mode};
use runtime::train::{
    train_spec, StepEvent, StepObserver, TrainError, TrainOptions, FINAL_CHECKPOINT, METRICS_FILE,
};

use crate::budget::{plan_time, Budget, CALIBRATION_STEPS};
use crate::file::Sweep;
use crate::folder::{
    check_sweep_folder, lock_sweep, read_outcome, write_atomic, write_outcome, DataRecord, FolderError,
    OutcomeFile, PlanFile, Provenance, ELAPSED_FILE,
};
use crate::point::{expand, ExpandError, Expansion, Point};
use crate::report::{measured, report_into, SweepReport};
use crate::results::{self, RunOutcome};

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
    /// The point every other is compared with in the results (a point name); `None`
    /// keeps the folder's choice, or each point's twin, else the first point.
    pub against: Option<String>,
    /// How many runs train at once, each in a process of its own ([`SweepOptions::child`]);
    /// 1 trains them one after another in this process.
    pub jobs: usize,
    /// How to start a process that trains one run of the plan (`--jobs` above 1).
    pub child: Option<ChildCommand>,
    /// After the planned seeds, add seeds to points whose comparison is undecided.
    pub until: Option<Until>,
}

/// `--until p<P --max-seeds M`: a point's comparison with its reference is undecided
/// while its p-value is above `p` and its 95% interval includes 0 (or it has no test
/// yet); such a point gets one more seed (and its reference the same seed, so the
/// test stays paired), round after round, until every comparison is decided or has
/// `max_seeds` seeds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Until {
    pub p: f64,
    pub max_seeds: usize,
}

/// The command that trains run `K` of a sweep folder's plan in a process of its own:
/// `program args... DIR --run-index K --device NAME --quiet [--retry-failed]` (the
/// `widen sweep` flags, docs/sweeps.md "Many runs at once").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildCommand {
    pub program: PathBuf,
    /// The arguments before the folder (`["sweep"]` for widen).
    pub args: Vec<String>,
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
            against: None,
            jobs: 1,
            child: None,
            until: None,
        }
    }
}

/// Errors that stop a sweep (a failing run does not: its failure is recorded).
#[derive(Debug, thiserror::Error)]
pub enum SweepRunError {
    #[error(transparent)]
    Expand(#[from] ExpandError),
    #[error(transparent)]
    Folder(#[from] FolderError),
    #[error("cannot write {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error(
        "point `{point}` in {dir} was planned with another spec ({fields}); its runs would not compare with \
         this sweep's: choose another --out folder or remove {dir}"
    )]
    Changed { dir: PathBuf, point: String, fields: String },
    /// Another budget than the folder's earlier runs were trained with.
    #[error(
        "{dir} holds runs trained with budget {then:?}, and this sweep's budget is {now:?}: results at two \
         budgets would not compare; use the same budget or choose another --out folder"
    )]
    OtherBudget { dir: PathBuf, then: crate::budget::Budget, now: crate::budget::Budget },
    /// The data of a point differs in content from what its earlier runs trained on.
    #[error(
        "point `{point}` in {dir} was trained on {then}, but its data is now {now}: its runs would not \
         compare; give the same data (by content, any path), or choose another --out folder"
    )]
    OtherData { dir: PathBuf, point: String, then: String, now: String },
    /// `--against` names no point.
    #[error("--against {point}: no point of the sweep has that name; its points are {points}")]
    UnknownAgainst { point: String, points: String },
    #[error("--device cuda: no CUDA driver (libcuda) on this machine; run on --device cpu or reference")]
    NoCuda,
    /// A point's data cannot be read: every run of it would fail the same way.
    #[error("point `{point}` cannot load its data")]
    PointData {
        point: String,
        #[source]
        source: runtime::data::DataError,
    },
    /// A run cannot read its data: every run would fail the same way.
    #[error("run {run} cannot load its data")]
    Data {
        run: PathBuf,
        #[source]
        source: runtime::data::DataError,
    },
    /// Another process trains this run now (its `run.lock` is held): `--run-index K`
    /// twice at once, or a job array task run by hand.
    #[error(
        "run {run} is training in another process; wait for it (its outcome will be recorded) or stop it"
    )]
    RunInUse {
        run: PathBuf,
        #[source]
        source: Box<TrainError>,
    },
    /// A run cannot write its folder (a full disk, no permission): the sweep cannot record results.
    #[error("run {run} cannot write its folder")]
    Write { run: PathBuf, source: Box<TrainError> },
    #[error("interrupted during run {run}; it is saved in {}; run the same command again to continue the sweep", checkpoint.display())]
    Interrupted { run: PathBuf, checkpoint: PathBuf },
    /// A time budget's calibration could not train the point.
    #[error("point `{point}`: cannot time its steps for the time budget: {message}")]
    Calibration { point: String, message: String },
    /// A time budget gives a point steps its spec refuses (a warmup longer than them).
    #[error(
        "point `{point}`: the time budget of {seconds} s gives {steps} steps, which its spec refuses ({errors}); \
         give a larger time budget"
    )]
    TimeSteps { point: String, steps: usize, seconds: f64, errors: String },
    /// `--run-index` past the plan's runs.
    #[error("--run-index {index}: {dir} plans {runs} runs, so the index must be in 0..={}", runs.saturating_sub(1))]
    NoSuchRun { dir: PathBuf, index: usize, runs: usize },
    /// `--jobs 0`, or `--jobs` above 1 with no way to start a process.
    #[error("--jobs {jobs}: {why}")]
    Jobs { jobs: usize, why: String },
    /// A process training one run could not start.
    #[error("cannot start the process training run {run}")]
    Spawn { run: PathBuf, source: std::io::Error },
    /// A process training one run ended without recording an outcome.
    #[error(
        "the process training run {run} ended with {status} without recording an outcome (its error is \
         above); run the same command again to continue the sweep"
    )]
    Child { run: PathBuf, status: String },
    #[error(transparent)]
    Results(#[from] results::ResultsError),
    #[error("cannot catch Ctrl-C and SIGTERM")]
    Signals(#[source] Box<TrainError>),
}

impl PlanFile {
    fn of(
        sweep: &Sweep,
        plan: &Expansion,
        data: BTreeMap<String, DataRecord>,
        against: Option<String>,
    ) -> PlanFile {
        PlanFile {
            axes: sweep.axes.iter().map(|a| a.path.clone()).collect(),
            budget: sweep.budget,
            seeds: sweep.seeds.clone(),
            points: plan.points.clone(),
            invalid: plan.invalid.iter().map(|p| (p.name.clone(), p.error.to_string())).collect(),
            data,
            against,
            added_seeds: Vec::new(),
        }
    }
}

impl Sweep {
    /// Expands and runs the sweep into `opts.out_dir` (see the module doc).
    pub fn run(&self, opts: &SweepOptions) -> Result<SweepReport, SweepRunError> {
        run(self, opts)
    }
}

/// What makes two points' corpora the same load: the source, the split and the window.
type DataKey = (String, u64, usize);

fn data_key(point: &Point) -> DataKey {
    let t = &point.spec.train;
    (format!("{:?}", t.data), t.val_fraction.to_bits(), t.seq_len)
}

/// Loads a point's data as its runs will, and identifies it.
fn load_record(point: &Point) -> Result<DataRecord, SweepRunError> {
    Ok(Corpus::load(&point.spec)
        .map_err(|source| SweepRunError::PointData { point: point.name.clone(), source })?
        .identity()
        .into())
}

/// The data every point of `plan` trains on, by point name, read and hashed once
/// per distinct source: an unreadable or too short file is an error before
/// anything trains (`widen sweep --dry-run` reports the same).
pub fn data_records(plan: &Expansion) -> Result<BTreeMap<String, DataRecord>, SweepRunError> {
    let mut seen: HashMap<DataKey, DataRecord> = HashMap::new();
    let mut out = BTreeMap::new();
    for p in &plan.points {
        let key = data_key(p);
        let record = match seen.get(&key) {
            Some(r) => r.clone(),
            None => {
                let r = load_record(p)?;
                seen.insert(key, r.clone());
                r
            }
        };
        out.insert(p.name.clone(), record);
    }
    Ok(out)
}

/// The sweep planned into its folder: the expansion, the joined `plan.json` (written),
/// the kept runs and the folder's training lock.
struct Prepared {
    plan: Expansion,
    file: PlanFile,
    kept: Vec<PathBuf>,
    _lock: std::fs::File,
}

/// Expands `sweep`, checks the folder holds no other sweep, takes its lock, joins the
/// plan with the folder's and writes `plan.json`.
fn prepare(sweep: &Sweep, opts: &SweepOptions) -> Result<Prepared, SweepRunError> {
    let mut plan = expand(sweep)?;
    let dir = &opts.out_dir;
    check_sweep_folder(dir)?;
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let lock = lock_sweep(dir)?;
    let data = data_records(&plan)?;
    if let Budget::Time(seconds) = sweep.budget {
        calibrate_plan(dir, &mut plan, seconds, opts, sweep.base.train.steps)?;
    }
    if let Some(note) = plan.warmup_note().filter(|_| opts.progress) {
        eprintln!("note: {note}");
    }
    let (mut file, kept) = merge_with_folder(dir, PlanFile::of(sweep, &plan, data, None))?;
    if let Some(a) = &opts.against {
        crate::report::check_against(&file, a)?;
        file.against = Some(a.clone());
    }
    file.write(dir)?;
    Ok(Prepared { plan, file, kept, _lock: lock })
}

/// Fixes every point's steps under a time budget of `seconds`: from the calibration
/// the folder's plan recorded for a point of the same name (so a rerun trains the same
/// steps), else from [`calibrate`] on `opts.device`. A warmup longer than the steps
/// keeps its fraction of the spec's own `planned` steps, as under every budget
/// ([`runtime::standalone::set_steps`], recorded in `plan.warmup_scaled`).
fn calibrate_plan(
    dir: &Path,
    plan: &mut Expansion,
    seconds: f64,
    opts: &SweepOptions,
    planned: usize,
) -> Result<(), SweepRunError> {
    if opts.device == Device::Cuda && !runtime::device::cuda::driver_available() {
        return Err(SweepRunError::NoCuda);
    }
    let old = if dir.join(crate::folder::PLAN_FILE).exists() { Some(PlanFile::read(dir)?) } else { None };
    for point in &mut plan.points {
        let recorded = old
            .as_ref()
            .and_then(|o| o.points.iter().find(|p| p.name == point.name))
            .and_then(|p| p.budget.calibration);
        let (per_step, timed) = match recorded {
            Some(c) => (c.seconds_per_step, c.steps_timed),
            None => (calibrate(dir, point, opts.device)?, CALIBRATION_STEPS),
        };
        let budget = plan_time(
            seconds,
            per_step,
            timed,
            point.budget.tokens_per_step,
            point.budget.train_flops_per_token,
        );
        if opts.progress && recorded.is_none() {
            eprintln!(
                "calibrated {} on {}: {:.2} ms/step, {} steps in {seconds} s",
                point.name,
                opts.device.name(),
                1000.0 * per_step,
                budget.steps
            );
        }
        point.budget = budget;
        point.spec.train.steps = planned;
        if let Some(w) = runtime::standalone::set_steps(&mut point.spec, budget.steps) {
            plan.warmup_scaled.push((point.name.clone(), w));
        }
        for run in &mut point.runs {
            run.spec.train.steps = budget.steps;
            run.spec.train.schedule = point.spec.train.schedule.clone();
        }
        point.spec.validate().map_err(|errors| SweepRunError::TimeSteps {
            point: point.name.clone(),
            steps: budget.steps,
            seconds,
            errors: errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "),
        })?;
    }
    let scratch = dir.join(crate::folder::CALIBRATION_DIR);
    if scratch.exists() {
        std::fs::remove_dir(&scratch).map_err(io(&scratch))?;
    }
    Ok(())
}

/// Times a point's training steps on `device`: [`CALIBRATION_STEPS`] steps after an
/// untimed first one (one-off setup, compilation), in a scratch folder removed after,
/// with the step time every run's metrics report (evaluation and checkpoints are not
/// in it). Returns the mean seconds per step.
fn calibrate(dir: &Path, point: &Point, device: Device) -> Result<f64, SweepRunError> {
    let scratch = dir.join(crate::folder::CALIBRATION_DIR).join(&point.name);
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch).map_err(io(&scratch))?;
    }
    let mut spec = point.spec.clone();
    spec.train.steps = CALIBRATION_STEPS + 1;
    spec.train.eval_every = spec.train.steps;
    spec.train.checkpoint_every = 0;
    // The schedule changes no step's time; its warmup must fit in the few steps timed.
    match &mut spec.train.schedule {
        ScheduleSpec::Constant(c) => c.warmup = 0,
        ScheduleSpec::Cosine(c) => c.warmup = 0,
        ScheduleSpec::Wsd(c) => c.warmup = 0,
    }
    let fail = |message: String| SweepRunError::Calibration { point: point.name.clone(), message };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        train_spec(&spec, device, &TrainOptions::quiet(scratch.clone()))
    }));
    match result {
        Ok(Ok(_)) => {}
        Ok(Err(err)) => return Err(fail(chain(&err))),
        Err(_) => return Err(fail("training panicked".into())),
    }
    let lines = crate::report::metrics_lines(&scratch).map_err(fail)?;
    let per_step = point.budget.tokens_per_step as f64;
    let times: Vec<f64> = lines
        .iter()
        .skip(1)
        .filter_map(|l| l.tokens_per_s().filter(|t| *t > 0.0).map(|t| per_step / t))
        .collect();
    std::fs::remove_dir_all(&scratch).map_err(io(&scratch))?;
    if times.is_empty() {
        return Err(fail("its metrics hold no timed step".into()));
    }
    Ok(times.iter().sum::<f64>() / times.len() as f64)
}

/// Writes the sweep's plan into `opts.out_dir` as [`run`] would, and trains nothing
/// (for a cluster's job array: docs/sweeps.md, "A cluster"). Returns the plan.
pub fn plan_only(sweep: &Sweep, opts: &SweepOptions) -> Result<PlanFile, SweepRunError> {
    Ok(prepare(sweep, opts)?.file)
}

/// Expands `sweep`, checks the folder holds no other sweep, trains every run not yet
/// done, and writes the results and plots (after every run, so an interrupted sweep
/// leaves its results so far).
pub fn run(sweep: &Sweep, opts: &SweepOptions) -> Result<SweepReport, SweepRunError> {
    if opts.jobs == 0 {
        return Err(SweepRunError::Jobs { jobs: 0, why: "at least one run must train at a time".into() });
    }
    if opts.jobs > 1 && opts.child.is_none() {
        return Err(SweepRunError::Jobs {
            jobs: opts.jobs,
            why: "several runs at once need a command to start each run's process".into(),
        });
    }
    if opts.device == Device::Cuda && !runtime::device::cuda::driver_available() {
        return Err(SweepRunError::NoCuda);
    }
    let Prepared { plan, file, kept, _lock } = prepare(sweep, opts)?;
    let dir = &opts.out_dir;
    let mut watch = DataWatch::default();

    let runs: Vec<(usize, &Point, &crate::point::Run)> =
        plan.points.iter().enumerate().flat_map(|(i, p)| p.runs.iter().map(move |r| (i, p, r))).collect();
    let todo: Vec<bool> =
        runs.iter().map(|(_, _, r)| needs_training(&dir.join(&r.dir), opts.retry_failed)).collect();
    let work = |p: &Point| p.budget.flops;
    let progress = Arc::new(Mutex::new(ProgressState {
        on: opts.progress,
        line: Line::new(Mode::of_stderr()),
        started: Instant::now(),
        total_runs: runs.len(),
        work_total: runs.iter().zip(&todo).filter(|(_, t)| **t).map(|((_, p, _), _)| work(p)).sum(),
        work_done: 0.0,
        run_work_per_step: 0.0,
        label: String::new(),
    }));
    let (mut trained, mut reused) = (0, 0);
    let mut queue = Vec::new();
    for (n, ((i, point, run), todo)) in runs.iter().zip(todo).enumerate() {
        let run_dir = dir.join(&run.dir);
        if !todo {
            reused += 1;
            continue;
        }
        if finish_from_checkpoint(&run_dir, point, opts.device, &file)? {
            reused += 1;
            continue;
        }
        let label = format!(
            "point {}/{} {} seed {} (run {}/{})",
            i + 1,
            plan.points.len(),
            point.name,
            run.seed,
            n + 1,
            runs.len()
        );
        if opts.jobs > 1 {
            queue.push((label, run_dir));
            continue;
        }
        watch.check(dir, point, &file.data[&point.name])?;
        {
            let mut p = progress.lock().expect("progress lock");
            p.label = label;
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
        write_outcome(
            &run_dir,
            &outcome,
            &Provenance::here(opts.device, file.data.get(&point.name).cloned()),
        )?;
        report_into(dir, &file)?;
    }
    if !queue.is_empty() {
        trained += run_children(dir, &file, queue, opts)?;
    }
    let mut file = file;
    if let Some(until) = opts.until {
        trained += add_seeds(dir, &mut file, until, opts)?;
    }
    let mut report = report_into(dir, &file)?;
    report.trained = trained;
    report.reused = reused;
    report.kept = kept;
    Ok(report)
}

/// `--until`: rounds of one more seed for every undecided point (see [`Until`]), each
/// recorded in `plan.json` with why, until none is left. Returns the runs trained.
fn add_seeds(
    dir: &Path,
    file: &mut PlanFile,
    until: Until,
    opts: &SweepOptions,
) -> Result<usize, SweepRunError> {
    let mut trained = 0;
    loop {
        let report = report_into(dir, file)?;
        let mut added: Vec<crate::folder::AddedSeed> = Vec::new();
        for r in &report.results {
            let Some(reference) = &r.compared_to else { continue };
            if r.seeds.len() >= until.max_seeds {
                continue;
            }
            let why = match &r.delta_val_loss {
                Some(d) if d.p_value <= until.p || d.ci95_lo > 0.0 || d.ci95_hi < 0.0 => continue,
                Some(d) => format!(
                    "`{}` against `{reference}` undecided over {} seeds: p = {:.3e} > {}, 95% CI [{:+.4}, {:+.4}] \
                     includes 0",
                    r.point,
                    r.seeds_finished,
                    d.p_value,
                    until.p,
                    d.ci95_lo,
                    d.ci95_hi
                ),
                None => format!("`{}` against `{reference}`: no test yet (fewer than two finished seeds)", r.point),
            };
            let Some(seed) = (0..).find(|s| !r.seeds.contains(s)) else { continue };
            for (point, reason) in [
                (r.point.clone(), why.clone()),
                (reference.clone(), format!("pairs seed {seed} of `{}` ({why})", r.point)),
            ] {
                let taken = added.iter().any(|a| a.point == point && a.seed == seed);
                let has =
                    file.points.iter().any(|p| p.name == point && p.runs.iter().any(|x| x.seed == seed));
                if !taken && !has {
                    added.push(crate::folder::AddedSeed { point, seed, reason });
                }
            }
        }
        if added.is_empty() {
            return Ok(trained);
        }
        let mut queue = Vec::new();
        for a in &added {
            let point = file.points.iter_mut().find(|p| p.name == a.point).expect("a point of the results");
            let mut spec = point.spec.clone();
            spec.train.seed = a.seed;
            let run_dir = PathBuf::from(&point.name).join(format!("seed-{}", a.seed));
            point.runs.push(crate::point::Run { seed: a.seed, dir: run_dir.clone(), spec });
            point.runs.sort_by_key(|r| r.seed);
            if opts.progress {
                eprintln!("adding seed {} to {}: {}", a.seed, a.point, a.reason);
            }
            queue.push((format!("point {} seed {} (added)", a.point, a.seed), dir.join(run_dir)));
        }
        file.seeds.extend(added.iter().map(|a| a.seed));
        file.seeds.sort_unstable();
        file.seeds.dedup();
        file.added_seeds.extend(added);
        file.write(dir)?;
        trained += train_queue(dir, file, queue, opts)?;
    }
}

/// Trains the queued runs of `file` (label, run folder): in child processes with
/// `--jobs` above 1, else one after another here. Returns the runs that ended.
fn train_queue(
    dir: &Path,
    file: &PlanFile,
    queue: Vec<(String, PathBuf)>,
    opts: &SweepOptions,
) -> Result<usize, SweepRunError> {
    if opts.jobs > 1 {
        return run_children(dir, file, queue, opts);
    }
    let mut watch = DataWatch::default();
    for (label, run_dir) in &queue {
        let (point, run) =
            file.runs().find(|(_, r)| dir.join(&r.dir) == *run_dir).expect("a run of the plan");
        watch.check(dir, point, &file.data[&point.name])?;
        train_and_record(file, point, run, run_dir, opts, label)?;
        report_into(dir, file)?;
    }
    Ok(queue.len())
}

/// A run killed after its final checkpoint, before (or while) writing its outcome, is
/// finished: its outcome is written from its metrics. Says whether that was the case.
fn finish_from_checkpoint(
    run_dir: &Path,
    point: &Point,
    device: Device,
    file: &PlanFile,
) -> Result<bool, SweepRunError> {
    if matches!(read_outcome(run_dir), OutcomeFile::Read(_)) || !run_dir.join(FINAL_CHECKPOINT).exists() {
        return Ok(false);
    }
    let outcome = match measured(run_dir, point, read_elapsed(run_dir)) {
        Ok(m) => RunOutcome::Finished(m),
        Err(reason) => RunOutcome::Failed(reason),
    };
    write_outcome(run_dir, &outcome, &Provenance::here(device, file.data.get(&point.name).cloned()))?;
    Ok(true)
}

/// Trains the queued runs `opts.jobs` at a time, each in a process of its own started
/// by [`SweepOptions::child`] as `--run-index K` of the plan in `dir`. Each process
/// gets an even share of the cores: the Cpu device shares its threads among the
/// processes training on one machine (runtime::dist::local_ranks, read from
/// `OMPI_COMM_WORLD_LOCAL_SIZE`). Every run is trained exactly as it would be alone
/// (same data order, same steps), so on the reference device the results are those
/// of `--jobs 1` bit for bit (docs/sweeps.md, "Many runs at once"). One line per
/// finished run on stderr. Returns how many runs ended.
fn run_children(
    dir: &Path,
    file: &PlanFile,
    queue: Vec<(String, PathBuf)>,
    opts: &SweepOptions,
) -> Result<usize, SweepRunError> {
    let child = opts.child.as_ref().expect("checked by run");
    let index: HashMap<PathBuf, usize> =
        file.runs().enumerate().map(|(k, (_, r))| (dir.join(&r.dir), k)).collect();
    let share = opts.jobs.saturating_mul(runtime::dist::local_ranks());
    let mut queue: std::collections::VecDeque<(String, PathBuf)> = queue.into();
    let mut live: Vec<(std::process::Child, String, PathBuf)> = Vec::new();
    let mut error: Option<SweepRunError> = None;
    let mut ended = 0;
    while !live.is_empty() || (error.is_none() && !queue.is_empty()) {
        while error.is_none() && live.len() < opts.jobs {
            let Some((label, run_dir)) = queue.pop_front() else { break };
            let k = index[&run_dir];
            let mut cmd = std::process::Command::new(&child.program);
            cmd.args(&child.args)
                .arg(dir)
                .args(["--run-index", &k.to_string(), "--device", opts.device.name(), "--quiet"])
                .env(runtime::dist::LOCAL_SIZE_VARS[0], share.to_string())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null());
            if opts.retry_failed {
                cmd.arg("--retry-failed");
            }
            match cmd.spawn() {
                Ok(c) => live.push((c, label, run_dir)),
                Err(source) => error = Some(SweepRunError::Spawn { run: run_dir, source }),
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut i = 0;
        while i < live.len() {
            let status = match live[i].0.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Err(e) => {
                    error.get_or_insert(SweepRunError::Spawn { run: live[i].2.clone(), source: e });
                    i += 1;
                    continue;
                }
            };
            let (_, label, run_dir) = live.swap_remove(i);
            match read_outcome(&run_dir) {
                OutcomeFile::Read(outcome) => {
                    ended += 1;
                    if opts.progress {
                        let mut p = ProgressState::quiet(label);
                        p.on = true;
                        p.end_run(&outcome);
                    }
                }
                _ if status.code() == Some(130) => {
                    error.get_or_insert(SweepRunError::Interrupted {
                        checkpoint: newest_checkpoint(&run_dir).unwrap_or_else(|| run_dir.clone()),
                        run: run_dir,
                    });
                }
                _ => {
                    error.get_or_insert(SweepRunError::Child { run: run_dir, status: status.to_string() });
                }
            }
        }
    }
    match error {
        Some(e) => Err(e),
        None => Ok(ended),
    }
}

/// How `--run-index` ended: the run, and its outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct RunIndexReport {
    /// `point <name> seed <s>`.
    pub label: String,
    pub run_dir: PathBuf,
    pub outcome: RunOutcome,
    /// Whether this call trained it (false: its outcome was already recorded).
    pub trained: bool,
}

/// Trains run `index` of the plan in `opts.out_dir` (in [`PlanFile::runs`] order),
/// unless it has ended, then rewrites the results under the results lock. Takes only
/// the run's own lock (runtime's `run.lock`), not the sweep's, so any number of runs
/// of one folder train at once (`--jobs`, a cluster's job array).
pub fn run_index(index: usize, opts: &SweepOptions) -> Result<RunIndexReport, SweepRunError> {
    let dir = &opts.out_dir;
    let file = PlanFile::read(dir)?;
    let total = file.runs().count();
    let Some((point, run)) = file.runs().nth(index) else {
        return Err(SweepRunError::NoSuchRun { dir: dir.clone(), index, runs: total });
    };
    if opts.device == Device::Cuda && !runtime::device::cuda::driver_available() {
        return Err(SweepRunError::NoCuda);
    }
    let run_dir = dir.join(&run.dir);
    let label = format!("point {} seed {} (run {index} of 0..{total})", point.name, run.seed);
    let done = |trained| -> Result<RunIndexReport, SweepRunError> {
        report_into(dir, &file)?;
        let outcome = read_outcome(&run_dir).outcome().ok_or_else(|| SweepRunError::Read {
            path: run_dir.join(crate::folder::OUTCOME_FILE),
            message: "no outcome after training".into(),
        })?;
        Ok(RunIndexReport { label: label.clone(), run_dir: run_dir.clone(), outcome, trained })
    };
    if !needs_training(&run_dir, opts.retry_failed)
        || finish_from_checkpoint(&run_dir, point, opts.device, &file)?
    {
        return done(false);
    }
    DataWatch::default().check(dir, point, &file.data[&point.name])?;
    train_and_record(&file, point, run, &run_dir, opts, &label)?;
    done(true)
}

/// Trains one run with a progress line of its own (one run of many, or of a
/// cluster task) and writes its outcome with this process's provenance.
fn train_and_record(
    file: &PlanFile,
    point: &Point,
    run: &crate::point::Run,
    run_dir: &Path,
    opts: &SweepOptions,
    label: &str,
) -> Result<(), SweepRunError> {
    let progress = Arc::new(Mutex::new(ProgressState::quiet(label.to_string())));
    {
        let mut p = progress.lock().expect("progress lock");
        p.on = opts.progress;
        p.start_run();
    }
    let observer = {
        let progress = Arc::clone(&progress);
        StepObserver::new(move |e: StepEvent| progress.lock().expect("progress lock").step(e))
    };
    let outcome = train_run(point, run, run_dir, opts, observer)?;
    progress.lock().expect("progress lock").end_run(&outcome);
    write_outcome(run_dir, &outcome, &Provenance::here(opts.device, file.data.get(&point.name).cloned()))?;
    Ok(())
}

/// Checks a point's data again before each run, re-hashing a file only when its
/// length or modification time moved since the last check.
#[derive(Default)]
struct DataWatch {
    checked: HashMap<DataKey, (Option<(u64, SystemTime)>, DataRecord)>,
}

impl DataWatch {
    fn check(&mut self, dir: &Path, point: &Point, planned: &DataRecord) -> Result<(), SweepRunError> {
        let stamp = runtime::data::data_stamp(&point.spec.train.data);
        let key = data_key(point);
        let now = match self.checked.get(&key) {
            Some((seen, record)) if stamp.is_some() && *seen == stamp => record.clone(),
            _ => {
                let record = load_record(point)?;
                self.checked.insert(key, (stamp, record.clone()));
                record
            }
        };
        if now.sha256 != planned.sha256 || now.bytes != planned.bytes {
            return Err(SweepRunError::OtherData {
                dir: dir.to_path_buf(),
                point: point.name.clone(),
                then: planned.describe(),
                now: now.describe(),
            });
        }
        Ok(())
    }
}

/// Joins this sweep's plan with the folder's: refuses a point whose spec or data
/// differs, or another budget once runs have ended; keeps every earlier run that
/// has an outcome. Returns the joined plan and the kept runs this sweep did not ask for.
fn merge_with_folder(dir: &Path, mut new: PlanFile) -> Result<(PlanFile, Vec<PathBuf>), SweepRunError> {
    if !dir.join(crate::folder::PLAN_FILE).exists() {
        return Ok((new, Vec::new()));
    }
    let old = PlanFile::read(dir)?;
    let ended = |r: &crate::point::Run| read_outcome(&dir.join(&r.dir)) != OutcomeFile::Missing;
    let mut kept = Vec::new();
    // Data by the name runs find it under: an earlier run on other bytes of that name
    // would be mixed with this sweep's, whichever point it belongs to.
    let by_source: HashMap<String, DataRecord> =
        new.data.values().map(|d| (d.source.clone(), d.clone())).collect();
    for before in &old.points {
        let ended_runs: Vec<&crate::point::Run> = before.runs.iter().filter(|r| ended(r)).collect();
        if let Some(then) = old.data.get(&before.name).filter(|_| !ended_runs.is_empty()) {
            if let Some(now) = by_source.get(&then.source) {
                if (then.bytes, &then.sha256) != (now.bytes, &now.sha256) {
                    return Err(SweepRunError::OtherData {
                        dir: dir.to_path_buf(),
                        point: before.name.clone(),
                        then: then.describe(),
                        now: now.describe(),
                    });
                }
            }
        }
        match new.points.iter_mut().find(|p| p.name == before.name) {
            Some(point) => {
                let fields = spec_difference(&before.spec, &point.spec);
                if !fields.is_empty() {
                    return Err(SweepRunError::Changed {
                        dir: dir.to_path_buf(),
                        point: point.name.clone(),
                        fields: fields.join(", "),
                    });
                }
                if let (Some(then), Some(now)) = (old.data.get(&before.name), new.data.get(&point.name)) {
                    if (then.bytes, &then.sha256) != (now.bytes, &now.sha256) {
                        return Err(SweepRunError::OtherData {
                            dir: dir.to_path_buf(),
                            point: point.name.clone(),
                            then: then.describe(),
                            now: now.describe(),
                        });
                    }
                }
                for r in ended_runs {
                    if !point.runs.iter().any(|x| x.seed == r.seed) {
                        kept.push(r.dir.clone());
                        point.runs.push(r.clone());
                    }
                }
                point.runs.sort_by_key(|r| r.seed);
            }
            None if !ended_runs.is_empty() => {
                let mut point = before.clone();
                point.runs = ended_runs.into_iter().cloned().collect();
                kept.extend(point.runs.iter().map(|r| r.dir.clone()));
                if let Some(d) = old.data.get(&point.name) {
                    new.data.insert(point.name.clone(), d.clone());
                }
                new.points.push(point);
            }
            None => {}
        }
    }
    // Checked after the points, so a point planned with other steps is named.
    if old.budget != new.budget && old.points.iter().flat_map(|p| &p.runs).any(ended) {
        return Err(SweepRunError::OtherBudget { dir: dir.to_path_buf(), then: old.budget, now: new.budget });
    }
    // A kept point's baseline twin is kept with it (or is one of this sweep's points).
    let names: HashSet<String> = new.points.iter().map(|p| p.name.clone()).collect();
    for p in &mut new.points {
        if p.baseline.as_ref().is_some_and(|b| !names.contains(b)) {
            p.baseline = None;
        }
    }
    for axis in old.axes {
        if !new.axes.contains(&axis) && new.points.iter().any(|p| p.values.iter().any(|(a, _)| *a == axis)) {
            new.axes.push(axis);
        }
    }
    if new.against.is_none() {
        new.against = old.against.filter(|a| new.points.iter().any(|p| p.name == *a));
    }
    new.added_seeds = old
        .added_seeds
        .into_iter()
        .filter(|a| new.points.iter().any(|p| p.name == a.point && p.runs.iter().any(|r| r.seed == a.seed)))
        .collect();
    let mut seeds: Vec<u64> = new.points.iter().flat_map(|p| p.runs.iter().map(|r| r.seed)).collect();
    seeds.sort_unstable();
    seeds.dedup();
    new.seeds = seeds;
    new.check().map_err(|(field, message)| FolderError::BadPlan {
        path: dir.join(crate::folder::PLAN_FILE),
        field,
        message: format!("joining this sweep with the folder's: {message}"),
    })?;
    Ok((new, kept))
}

/// The fields where two points' specs differ, as `` `path`: then, now ``. The data
/// path is left out: data is compared by content ([`DataRecord`]).
fn spec_difference(before: &ModelSpec, now: &ModelSpec) -> Vec<String> {
    let json = |s: &ModelSpec| {
        let mut s = s.clone();
        s.train.data = DataSpec::Text(String::new());
        serde_json::to_value(&s)
    };
    let (Ok(a), Ok(b)) = (json(before), json(now)) else { return Vec::new() };
    let mut fields = Vec::new();
    diff_fields("", &a, &b, &mut fields);
    fields
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

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SweepRunError + '_ {
    move |source| SweepRunError::Io { path: path.to_path_buf(), source }
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
            write_atomic(
                &run_dir.join(ELAPSED_FILE),
                serde_json::json!({ "wall_s": wall_s }).to_string().as_bytes(),
            )?;
            Err(SweepRunError::Interrupted { run: run_path, checkpoint })
        }
        TrainError::Data(source) => Err(SweepRunError::Data { run: run_path, source: *source }),
        TrainError::Validation { source, .. }
            if matches!(*source, runtime::train::ValidationError::Data(_)) =>
        {
            let runtime::train::ValidationError::Data(source) = *source else {
                unreachable!("matched above")
            };
            Err(SweepRunError::Data { run: run_path, source })
        }
        TrainError::Signals(_) => Err(SweepRunError::Signals(Box::new(err))),
        TrainError::Locked { .. } => Err(SweepRunError::RunInUse { run: run_path, source: Box::new(err) }),
        TrainError::Io { .. } | TrainError::SaveFailed { .. } => {
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
        | TrainError::Validation { .. }
        | TrainError::OtherOrder { .. }
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

/// Whether a run still has to train: no outcome yet (or one that does not read),
/// or a failure to retry.
fn needs_training(run_dir: &Path, retry_failed: bool) -> bool {
    match read_outcome(run_dir) {
        OutcomeFile::Read(RunOutcome::Finished(_)) => false,
        OutcomeFile::Read(RunOutcome::Failed(_)) => retry_failed,
        OutcomeFile::Missing | OutcomeFile::Damaged(_) => true,
    }
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

/// The sweep's progress line: run i/n, the run's step, elapsed time and an ETA from
/// the training FLOPs still to do at the rate seen so far in this call. Drawn by
/// [`runtime::progress::Line`]: in place on a terminal, else a line every tenth of a
/// run's steps and at its evaluations.
struct ProgressState {
    on: bool,
    line: Line,
    started: Instant,
    total_runs: usize,
    /// Training FLOPs of the runs this call trains, and of the steps done so far.
    work_total: f64,
    work_done: f64,
    run_work_per_step: f64,
    label: String,
}

impl ProgressState {
    /// A state for one run labelled `label`, off until `on` is set.
    fn quiet(label: String) -> ProgressState {
        ProgressState {
            on: false,
            line: Line::new(Mode::of_stderr()),
            started: Instant::now(),
            total_runs: 1,
            work_total: 0.0,
            work_done: 0.0,
            run_work_per_step: 0.0,
            label,
        }
    }

    fn start_run(&mut self) {
        if self.on && self.line.mode() == Mode::Log {
            self.line.say(&format!("{}: starting ({} runs in all)", self.label, self.total_runs));
        }
    }

    fn step(&mut self, e: StepEvent) {
        self.work_done += self.run_work_per_step;
        if !self.on {
            return;
        }
        if let Some(text) = self.update(e, self.started.elapsed()) {
            runtime::progress::write_stderr(&text);
        }
    }

    /// What to write after step event `e`, `elapsed` into the sweep.
    fn update(&mut self, e: StepEvent, elapsed: std::time::Duration) -> Option<String> {
        let eta = eta_text(elapsed, self.work_done, self.work_total);
        let val = e.val_loss.map(|v| format!("  val {v:.4}")).unwrap_or_default();
        let text = format!(
            "{}  step {}/{}  loss {:.4}{val}  elapsed {}  ETA {eta}",
            self.label,
            e.step,
            e.total,
            e.loss,
            clock(elapsed)
        );
        let every = (e.total / 10).max(1);
        let mark = if e.step.is_multiple_of(every) || e.step == e.total || e.val_loss.is_some() {
            Mark::Line
        } else {
            Mark::Tick
        };
        self.line.update(&text, elapsed, mark)
    }

    fn end_run(&mut self, outcome: &RunOutcome) {
        if !self.on {
            return;
        }
        let text = match outcome {
            RunOutcome::Finished(m) => format!(
                "{}: done, val loss {:.4} ({:.4} bits/byte), {:.1} ms/step",
                self.label,
                m.val_loss,
                m.val_loss / std::f64::consts::LN_2,
                m.ms_per_step
            ),
            RunOutcome::Failed(reason) => format!("{}: FAILED: {reason}; the sweep goes on", self.label),
        };
        self.line.say(&text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn state(mode: Mode) -> ProgressState {
        let mut p = ProgressState::quiet("point 1/2 base seed 0 (run 1/2)".into());
        p.on = true;
        p.line = Line::new(mode);
        p.work_total = 200.0;
        p.run_work_per_step = 1.0;
        p
    }

    fn event(step: u64, val_loss: Option<f32>) -> StepEvent {
        StepEvent { step, total: 100, loss: 2.0, val_loss }
    }

    /// In a log the sweep's line is plain text, every tenth of a run's steps and at
    /// its evaluations, with the ETA from the FLOPs still to do.
    #[test]
    fn a_log_gets_a_plain_line_every_tenth_of_the_steps_with_an_eta() {
        let mut p = state(Mode::Log);
        let mut out = Vec::new();
        for step in 1..=100 {
            p.work_done += p.run_work_per_step;
            let val = (step == 55).then_some(1.5);
            out.extend(p.update(event(step, val), Duration::from_millis(step * 100)));
        }
        assert_eq!(out.len(), 11, "{out:?}");
        assert_eq!(
            out[0],
            "point 1/2 base seed 0 (run 1/2)  step 10/100  loss 2.0000  elapsed 1s  ETA 19s\n"
        );
        assert!(out[5].contains("step 55/100") && out[5].contains("val 1.5000"), "{out:?}");
        assert!(out.iter().all(|l| !l.contains('\r') && !l.contains('\x1b')));
    }

    #[test]
    fn a_terminal_line_is_redrawn_in_place() {
        let mut p = state(Mode::Terminal);
        p.work_done = 50.0;
        let out = p.update(event(50, None), Duration::from_secs(5)).unwrap();
        assert_eq!(
            out,
            "\rpoint 1/2 base seed 0 (run 1/2)  step 50/100  loss 2.0000  elapsed 5s  ETA 15s\x1b[K"
        );
    }
}
