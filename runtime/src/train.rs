//! The training loop (docs/architecture.md §7). Per step: sample a batch, forward and
//! backward on a [`StepExecutor`], clip the global gradient norm, take an
//! optimizer step at the scheduled LR; validate every `eval_every` steps.
//!
//! Outputs in the run folder:
//! - `metrics.jsonl`: one JSON object per step (`step`, `device`, `loss`, `lr`,
//!   `grad_norm`, `tokens_per_s`, `tokens` trained so far, and `val_loss` when evaluated), flushed after
//!   every step and synced to disk before every checkpoint, so a checkpoint never
//!   outlives the metrics of the steps it holds. `loss` is the language-model
//!   objective (with MTP terms); `val_loss` is the main head's next-token loss alone, so
//!   models of any MTP depth compare on it.
//!
//!   A model with an MoE FFN (docs/math.md §1.6) adds the step's expert loads, counted in
//!   token-to-expert assignments of the global batch (N·k per sublayer):
//!   `moe_load_min`, `moe_load_max` and `moe_load_mean` over every expert of every MoE
//!   sublayer; `moe_imbalance`, the largest max/mean load of a sublayer (1 is even);
//!   `moe_load_max_by_layer`, each sublayer's max load by its parameter prefix
//!   (`blocks.0.ffn`); `moe_dropped`, the assignments dropped over capacity in all
//!   sublayers (with `capacity_factor` only); and `moe_aux_loss` with `balance:
//!   AuxLoss`, the auxiliary loss the gradients include and `loss` does not. With
//!   `balance: BiasUpdate` the step's loads then move the router biases ([`crate::moe`]).
//! - `ckpt-<step>.safetensors` every `checkpoint_every` steps (only the newest
//!   `keep_last` of them when that is set), and `final.safetensors` at the end
//!   (see [`crate::checkpoint`]).
//! - `init.safetensors`: the initial state (step 0) alone, written by
//!   [`write_initial`] (`widen train --steps 0`) instead of a run.
//! - `run.lock`: locked while a run writes the folder (and naming that run), so a
//!   second run on the same folder is refused instead of interleaving metrics and
//!   overwriting checkpoints.
//!
//! **Nothing is lost or replaced silently.** A fresh run refuses a folder that
//! holds metrics or checkpoints. A resume continues in the checkpoint's own
//! folder (metrics lines after the checkpoint's step, written by a run that
//! stopped before its next checkpoint, are dropped with a note), or in a new
//! folder (which gets the checkpoint's metrics up to its step); it refuses to
//! replace results past its step (a later checkpoint or final file, or another
//! run's files) unless [`TrainOptions::overwrite`] says so.
//!
//! **Stopping.** A NaN or infinite loss stops the run with an error naming the
//! step; what was written before that step stays on disk. Parameters are checked
//! before every save: a non-finite one stops the run without a checkpoint of it.
//! With [`TrainOptions::catch_signals`], Ctrl-C (SIGINT) or SIGTERM finishes the
//! running step, saves `ckpt-<step>` and returns [`TrainError::Interrupted`]; a
//! second signal ends the process at once. A save that fails (a full disk) stops
//! the run with [`TrainError::SaveFailed`], naming the last good checkpoint.
//!
//! **Resuming** (see [`crate::checkpoint::RESUMABLE_FIELDS`] for what may
//! change): the run continues bit for bit from the checkpoint's step. A resume
//! with another step budget recomputes the learning-rate schedule for the new
//! total from the resumed step on (the LR at each later step is the one a fresh
//! run of that many steps would use), and says so.
//!
//! A checkpoint records the identity of the data it was trained on (path, length,
//! SHA-256); resuming on other data is allowed and said in a note.
//!
//! Steps are numbered from 1: step k is the k-th optimizer update, and `ckpt-k`
//! holds the state after it.

use crate::checkpoint::{self, Checkpoint, CheckpointError, TrainState};
use crate::data::{BatchSampler, Corpus, DataError, DataIdentity, ValidationPlan};
use crate::device::memory::MeasuredPeak;
use crate::device::Device;
use crate::dist::{DistError, Fault, Group, Shard};
use crate::init::{init_params, InitError};
use crate::moe::{ExpertLoads, MoeError};
use crate::optim::schedule::lr_multiplier;
use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::step::{StepError, StepExecutor, StepStats, UpdateSettings};
use ir::spec::{ModelSpec, OptimizerSpec, ScheduleSpec};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The metrics file in a run folder.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The last checkpoint of a finished run.
pub const FINAL_CHECKPOINT: &str = "final.safetensors";
/// The initial checkpoint `--steps 0` writes (step 0, before any update).
pub const INIT_CHECKPOINT: &str = "init.safetensors";
/// The lock file of a run folder.
pub const LOCK_FILE: &str = "run.lock";

/// Errors that stop a run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The spec's training memory estimate exceeds this machine's memory.
    #[error("{}: {}", .0.path, .0.message)]
    TooLarge(ir::spec::FieldError),
    #[error("cannot write {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "{path} belongs to an earlier run; choose another --out folder, remove it, \
         or pass --resume with one of that run's checkpoints to continue it"
    )]
    RunExists { path: PathBuf },
    #[error(
        "run folder {dir} is in use by another training run ({holder}); wait for it to finish, \
         stop it, or choose another --out folder"
    )]
    Locked { dir: PathBuf, holder: String },
    #[error(
        "resuming {checkpoint} (step {step}) in {dir} would replace {}; pass --out with a new \
         folder to continue there, or --overwrite to replace them",
        replaced.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    WouldReplace { checkpoint: PathBuf, step: u64, dir: PathBuf, replaced: Vec<PathBuf> },
    #[error("checkpoint {path} is at step {step}, past this run's {total} steps")]
    ResumePastEnd { path: PathBuf, step: u64, total: usize },
    #[error("{what} is {value} at step {step}; stopping (earlier checkpoints and metrics are kept)")]
    NonFinite { step: u64, what: &'static str, value: f32 },
    #[error(
        "tensor `{tensor}` is {value} after step {step}; stopping without checkpointing it ({})",
        last_good_text(last_good)
    )]
    Diverged { step: u64, tensor: String, value: f32, last_good: Option<(PathBuf, u64)> },
    #[error("cannot save the checkpoint of step {step} ({})", last_good_text(last_good))]
    SaveFailed {
        step: u64,
        last_good: Option<(PathBuf, u64)>,
        #[source]
        source: Box<CheckpointError>,
    },
    #[error("interrupted after step {step}; the run is saved in {}", checkpoint.display())]
    Interrupted { step: u64, checkpoint: PathBuf },
    #[error("cannot catch Ctrl-C and SIGTERM")]
    Signals(#[source] std::io::Error),
    #[error("cannot set up the device")]
    Device(#[source] StepError),
    #[error("training step {step} failed")]
    Step { step: u64, source: StepError },
    #[error("validation after step {step} failed")]
    Validation { step: u64, source: Box<ValidationError> },
    #[error(
        "{path} holds a {found:?}-order data sampler, but train.order = {order:?}; resume with the \
         checkpoint's order, or start a fresh run"
    )]
    OtherOrder { path: PathBuf, found: ir::spec::DataOrder, order: ir::spec::DataOrder },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Boxed: data errors name files and counts, and would make every `Result` of
    /// training as large as the largest of them.
    #[error(transparent)]
    Data(Box<DataError>),
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Init(#[from] InitError),
    #[error(transparent)]
    Dist(#[from] DistError),
    #[error(transparent)]
    Moe(#[from] MoeError),
}

impl From<DataError> for TrainError {
    fn from(e: DataError) -> Self {
        TrainError::Data(Box::new(e))
    }
}

fn last_good_text(last_good: &Option<(PathBuf, u64)>) -> String {
    match last_good {
        Some((path, step)) => format!("the last good checkpoint is {} at step {step}", path.display()),
        None => "no checkpoint of this run was written".to_string(),
    }
}

impl TrainError {
    /// The checkpoint to continue this run from with `--resume`, where the run
    /// stopped for a reason a resume gets past: an interruption or a failed save.
    pub fn resume_from(&self) -> Option<&Path> {
        match self {
            TrainError::Interrupted { checkpoint, .. } => Some(checkpoint),
            TrainError::SaveFailed { last_good, .. } => last_good.as_ref().map(|(p, _)| p.as_path()),
            _ => None,
        }
    }
}

/// How progress is shown on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Refresh one line in place when stderr is a terminal; otherwise print a
    /// line every `every` steps and at every evaluation. Notes (what a resume
    /// changes or drops) go to stderr too.
    Auto { every: usize },
    /// Nothing on stderr.
    Silent,
}

/// Where and how to run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    /// Run folder for metrics and checkpoints (created if missing).
    pub out_dir: PathBuf,
    /// Continue from this checkpoint.
    pub resume: Option<PathBuf>,
    pub progress: Progress,
    /// Catch Ctrl-C (SIGINT) and SIGTERM while training: finish the step, save a
    /// checkpoint and return [`TrainError::Interrupted`]; a second signal ends the
    /// process at once. Outside a run the signals keep their default action.
    pub catch_signals: bool,
    /// Let a resume replace results past its checkpoint in `out_dir` (later
    /// checkpoints, a later final checkpoint, their metrics, or another run's files).
    pub overwrite: bool,
    /// Called after every step, once its metrics line is written: a caller that
    /// drives many runs (a sweep) shows its own progress from it.
    pub on_step: Option<StepObserver>,
    /// The ranks of a data-parallel run this process is one of
    /// (docs/distributed.md); `None` (or one rank) trains alone.
    pub group: Option<Group>,
}

/// What a step reports to a [`StepObserver`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepEvent {
    /// The step just taken (from 1).
    pub step: u64,
    /// The run's step budget.
    pub total: u64,
    /// Its training loss.
    pub loss: f32,
    /// The validation loss, when this step evaluated.
    pub val_loss: Option<f32>,
}

/// A callback run after every training step ([`TrainOptions::on_step`]).
#[derive(Clone)]
pub struct StepObserver(pub std::sync::Arc<dyn Fn(StepEvent) + Send + Sync>);

impl StepObserver {
    pub fn new(f: impl Fn(StepEvent) + Send + Sync + 'static) -> StepObserver {
        StepObserver(std::sync::Arc::new(f))
    }
}

impl std::fmt::Debug for StepObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepObserver")
    }
}

impl PartialEq for StepObserver {
    /// Two observers are equal when they are the same callback.
    fn eq(&self, other: &StepObserver) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl TrainOptions {
    /// A fresh run into `out_dir` as a library caller (a test, a sweep) starts it: no
    /// progress output, signals left to the caller, nothing resumed or replaced.
    pub fn quiet(out_dir: PathBuf) -> TrainOptions {
        TrainOptions {
            out_dir,
            resume: None,
            progress: Progress::Silent,
            catch_signals: false,
            overwrite: false,
            on_step: None,
            group: None,
        }
    }
}

/// What a finished run did.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// Training loss of each step run in this invocation.
    pub losses: Vec<f32>,
    /// The last validation loss, if any evaluation ran.
    pub val_loss: Option<f32>,
    /// Steps taken in total (including those before a resume).
    pub steps: u64,
    pub final_checkpoint: PathBuf,
    pub metrics: PathBuf,
    /// The process's peak memory over the run, its final checkpoint included
    /// (`crate::device::memory`: the host's resident high-water mark, and on
    /// `cuda` the device's allocations).
    pub peak_memory: MeasuredPeak,
}

/// Lowers `spec` for its batch and sequence length, initializes the parameters
/// from its seed (or restores them from `opts.resume`), loads its data and trains
/// on `device`.
///
/// Before anything is allocated, the spec's estimated training memory must fit this
/// machine ([`crate::device::memory::check_fits`]: the closed form, then the Plan's
/// expected peak where the closed form alone would refuse); validation alone only bounds
/// it by what no machine holds.
pub fn train_spec(spec: &ModelSpec, device: Device, opts: &TrainOptions) -> Result<TrainReport, TrainError> {
    if let Some(bytes) = ir::spec::host_memory_bytes() {
        crate::device::memory::check_fits(spec, bytes, device).map_err(TrainError::TooLarge)?;
    }
    let corpus = Corpus::load(spec)?;
    // Across ranks, each rank's graph takes its shard of the global batch.
    let group = opts.group.as_ref().filter(|g| g.data_parallel());
    let batch = Shard::of(group).local_batch(spec.train.batch)?;
    let lowered = ir::lower::lower(spec, batch, spec.train.seq_len)?;
    let params = init_params(&lowered.graph, spec.train.seed)?;
    let mut exec = match (group, device) {
        // One GPU per rank, the gradients all-reduced through NCCL.
        (Some(g), Device::Cuda) => cuda_rank_executor(lowered, g)?,
        _ => device.executor(lowered).map_err(TrainError::Device)?,
    };
    train(spec, exec.as_mut(), params, &corpus, opts)
}

/// A data-parallel rank's Cuda executor ([`crate::device::cuda::nccl::executor_for_rank`]).
#[cfg(feature = "mpi")]
fn cuda_rank_executor(
    lowered: ir::lower::Lowered,
    group: &Group,
) -> Result<Box<dyn StepExecutor + Send>, TrainError> {
    Ok(Box::new(crate::device::cuda::nccl::executor_for_rank(lowered, group).map_err(TrainError::Device)?))
}

/// Without MPI there is no NCCL id broadcast, so no NCCL path.
#[cfg(not(feature = "mpi"))]
fn cuda_rank_executor(
    _: ir::lower::Lowered,
    group: &Group,
) -> Result<Box<dyn StepExecutor + Send>, TrainError> {
    Err(DistError::NcclNotBuilt { world: group.size() }.into())
}

/// Writes the initial state of a run of `spec` to `opts.out_dir/init.safetensors`
/// without training: the parameters as initialized from the spec's seed, zero
/// optimizer moments, step 0 and the training sampler's starting state, so that
/// resuming from it continues exactly as a fresh run would. The data is loaded
/// (and must fit a window) so that its identity is recorded. Like a fresh run, it
/// refuses a folder that already holds a run's files.
pub fn write_initial(spec: &ModelSpec, opts: &TrainOptions) -> Result<PathBuf, TrainError> {
    let window = spec.train.seq_len + 1;
    let corpus = Corpus::load(spec)?;
    let lowered = ir::lower::lower(spec, spec.train.batch, spec.train.seq_len)?;
    let params = init_params(&lowered.graph, spec.train.seed)?;
    let out = &opts.out_dir;
    std::fs::create_dir_all(out).map_err(|source| TrainError::Io { path: out.clone(), source })?;
    let _lock = folder::lock(out)?;
    folder::remove_partial_files(out, &Notes(opts.progress));
    if let Some(path) = folder::run_files(out)?.into_iter().next() {
        return Err(TrainError::RunExists { path });
    }
    let optimizer = Optimizer::new(spec, &params);
    let state =
        TrainState { step: 0, sampler: BatchSampler::for_run(&spec.train, spec.train.batch, window).state() };
    let path = out.join(INIT_CHECKPOINT);
    let tokenizer = corpus.tokenizer().map(|t| t.spec());
    checkpoint::save_with_data(
        &path,
        spec,
        &params,
        Some(&optimizer),
        &state,
        Some(&corpus.identity()),
        tokenizer,
    )
    .map_err(|source| TrainError::SaveFailed { step: 0, last_good: None, source: Box::new(source) })?;
    Ok(path)
}

/// Trains `params` (already initialized) on `corpus` with `exec`.
///
/// In a data-parallel run (`opts.group` of more than one rank,
/// docs/distributed.md) `exec` takes this rank's shard of the global batch
/// `train.batch`: every rank draws the same global batches and trains on its
/// rows of each, the steps average the loss and the gradients across the ranks,
/// and rank 0 alone writes the run folder and the console output.
pub fn train(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    mut params: ParamSet,
    corpus: &Corpus,
    opts: &TrainOptions,
) -> Result<TrainReport, TrainError> {
    let group = opts.group.as_ref().filter(|g| g.data_parallel());
    let shard = Shard::of(group);
    // Rank 0 (or a run alone) writes the folder and the console.
    let root = shard.rank == 0;
    let out = &opts.out_dir;
    let progress_mode = if root { opts.progress } else { Progress::Silent };
    let notes = Notes(progress_mode);
    // Held until this function returns: no other run writes this folder meanwhile.
    let _lock = if root {
        std::fs::create_dir_all(out).map_err(|source| TrainError::Io { path: out.clone(), source })?;
        let lock = folder::lock(out)?;
        folder::remove_partial_files(out, &notes);
        Some(lock)
    } else {
        None
    };
    let [local_batch, window] = exec.token_shape();
    // The global batch: the sampler draws it whole on every rank, so the
    // batches depend on the step alone, not on the number of ranks.
    let batch = local_batch * shard.world;
    if group.is_some() && batch != spec.train.batch {
        return Err(DistError::Batch { batch: spec.train.batch, world: shard.world }.into());
    }
    corpus.check_window(window)?;
    // A validation budget the split cannot hold is refused now, not at the first evaluation.
    let validation = ValidationPlan::of(&spec.train);
    validation.batches(batch, window, corpus.validation(), &corpus.source)?;
    let total = spec.train.steps;
    let mut optimizer = Optimizer::new(spec, &params);
    let experts = ExpertLoads::new(spec, &*exec, &params)?;
    let metrics_path = out.join(METRICS_FILE);
    let data = corpus.identity();

    let (start, mut sampler, last_good) = match &opts.resume {
        Some(path) => {
            let ckpt = Checkpoint::read(path)?;
            let changed = ckpt.check_spec(spec)?;
            if ckpt.state.step > total as u64 {
                return Err(TrainError::ResumePastEnd { path: path.clone(), step: ckpt.state.step, total });
            }
            ckpt.restore_params(&mut params)?;
            ckpt.restore_optimizer(&mut optimizer)?;
            if root {
                folder::prepare_resume(out, &ckpt, opts.overwrite, &notes)?;
            }
            note_resume_changes(&ckpt, spec, &changed, &notes);
            note_data_change(&ckpt, &data, &notes);
            let step = ckpt.state.step;
            if ckpt.state.sampler.order() != spec.train.order {
                return Err(TrainError::OtherOrder {
                    path: path.clone(),
                    found: ckpt.state.sampler.order(),
                    order: spec.train.order,
                });
            }
            (step, BatchSampler::from_state(ckpt.state.sampler, batch, window), Some((path.clone(), step)))
        }
        None => {
            if root {
                if let Some(path) = folder::run_files(out)?.into_iter().next() {
                    return Err(TrainError::RunExists { path });
                }
            }
            (0, BatchSampler::for_run(&spec.train, batch, window), None)
        }
    };
    let mut metrics = if root {
        Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&metrics_path)
                .map_err(|source| TrainError::Io { path: metrics_path.clone(), source })?,
        )
    } else {
        None
    };
    let signals =
        if opts.catch_signals { Some(signals::catch().map_err(TrainError::Signals)?) } else { None };
    let tokenizer = corpus.tokenizer().map(|t| t.spec().clone());
    let mut saver =
        Saver { spec, metrics_path: &metrics_path, last_good, data: &data, tokenizer: tokenizer.as_ref() };
    let fault = group.and_then(|_| Fault::from_env());

    let peak_lr = match &spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.lr,
        OptimizerSpec::Muon(m) => m.adamw.lr,
    };
    if let Progress::Auto { .. } = progress_mode {
        let per_rank = match group {
            Some(_) => format!(" ({local_batch} per rank)"),
            None => String::new(),
        };
        eprintln!(
            "training {} on {}: world_size {}, batch {batch}{per_rank}, steps {}..={total}",
            spec.name,
            exec.device(),
            shard.world,
            start + 1
        );
        eprintln!("data: {}", corpus.describe());
    }
    let mut progress = ProgressLine::new(progress_mode, total, start);
    let mut losses = Vec::new();
    let mut val_loss = None;
    let mut val_bpb = None;
    for step in start + 1..=total as u64 {
        if let Some(fault) = &fault {
            fault.strike(shard.rank, step);
        }
        let started = Instant::now();
        let reduced_before = group.map(Group::reduce_time);
        let tokens = sampler.next_batch(corpus.train())?;
        let lr_mult = lr_multiplier(&spec.train.schedule, (step - 1) as usize, total);
        let settings = UpdateSettings { lr_mult, clip: spec.train.clip };
        let stepped = match group {
            None => exec.train_step(&mut params, &tokens, &mut optimizer, settings),
            Some(g) => {
                let mine = shard.rows(&tokens, window);
                exec.train_step_averaged(&mut params, mine, &mut optimizer, settings, g)
            }
        };
        let StepStats { loss, grad_norm } = stepped.map_err(|source| TrainError::Step { step, source })?;
        if !loss.is_finite() {
            return Err(TrainError::NonFinite { step, what: "training loss", value: loss });
        }
        let loads = match &experts {
            Some(e) => Some(e.read(&*exec, group).ok_or(MoeError::NoLoads { device: exec.device() })?),
            None => None,
        };
        if let (Some(e), Some(loads)) = (&experts, &loads) {
            e.update_biases(loads, &mut params);
        }
        let elapsed = started.elapsed();
        let tokens_per_s = (batch * (window - 1)) as f64 / elapsed.as_secs_f64().max(1e-9);
        losses.push(loss);

        let mut record = serde_json::json!({
            "step": step,
            "device": exec.device(),
            "world_size": shard.world,
            "loss": loss,
            "lr": peak_lr * lr_mult,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "tokens": step * (batch * (window - 1)) as u64,
        });
        if let (Some(e), Some(loads), Some(fields)) = (&experts, &loads, record.as_object_mut()) {
            fields.extend(e.metrics(loads));
        }
        if let (Some(g), Some(before)) = (group, reduced_before) {
            // The step's time in all-reduces (this rank's wait for the others included).
            record["allreduce_ms"] = serde_json::json!((g.reduce_time() - before).as_secs_f64() * 1e3);
            record["step_ms"] = serde_json::json!(elapsed.as_secs_f64() * 1e3);
        }
        let evaluate = step.is_multiple_of(spec.train.eval_every.max(1) as u64) || step == total as u64;
        if evaluate {
            let scored = sharded_validation_loss(spec, exec, &params, corpus, validation, group)
                .map_err(|source| TrainError::Validation { step, source: Box::new(source) })?;
            let v = scored.loss as f32;
            if !v.is_finite() {
                return Err(TrainError::NonFinite { step, what: "validation loss", value: v });
            }
            record["val_loss"] = serde_json::json!(v);
            // From the loss as logged (f32), so the two columns agree exactly.
            val_bpb = Validation { loss: f64::from(v), ..scored }.bits_per_byte();
            if let Some(bpb) = val_bpb {
                record["val_bpb"] = serde_json::json!(bpb);
            }
            val_loss = Some(v);
        }
        if let Some(metrics) = &mut metrics {
            writeln!(metrics, "{record}")
                .and_then(|_| metrics.flush())
                .map_err(|source| TrainError::Io { path: metrics_path.clone(), source })?;
        }
        progress.show(
            step,
            loss,
            peak_lr * lr_mult,
            tokens_per_s,
            evaluate.then_some(val_loss).flatten().map(|v| (v, val_bpb)),
        );
        if let Some(observer) = &opts.on_step {
            let val_loss = evaluate.then_some(val_loss).flatten();
            (observer.0)(StepEvent { step, total: total as u64, loss, val_loss });
        }

        let every = spec.train.checkpoint_every as u64;
        let mut interrupted = signals.as_ref().is_some_and(signals::Guard::stop_requested);
        if let Some(g) = group {
            // A signal may reach the ranks at different steps: they stop together.
            interrupted = g.any(interrupted);
        }
        if (every > 0 && step.is_multiple_of(every)) || (interrupted && step < total as u64) {
            let path = out.join(format!("ckpt-{step}.safetensors"));
            check_ranks_agree(group, &params, step)?;
            if let Some(metrics) = &metrics {
                saver.save(exec, &params, &mut optimizer, &sampler, step, &path, metrics)?;
                folder::keep_newest(out, spec.train.keep_last, &notes);
            }
        }
        if interrupted && step < total as u64 {
            drop(progress);
            let checkpoint = out.join(format!("ckpt-{step}.safetensors"));
            return Err(TrainError::Interrupted { step, checkpoint });
        }
    }
    drop(progress);
    let final_checkpoint = out.join(FINAL_CHECKPOINT);
    let steps = optimizer.steps_taken();
    check_ranks_agree(group, &params, steps)?;
    if let Some(metrics) = &metrics {
        saver.save(exec, &params, &mut optimizer, &sampler, steps, &final_checkpoint, metrics)?;
    }
    // The run's peak so far, the final checkpoint's included; on `cuda`, the
    // device's allocations besides the host's (docs/performance.md, "Memory").
    let measured_on = if exec.device() == Device::Cuda.name() { Device::Cuda } else { Device::Cpu };
    let peak_memory = MeasuredPeak::now(measured_on);
    Ok(TrainReport { losses, val_loss, steps, final_checkpoint, metrics: metrics_path, peak_memory })
}

/// Before a checkpoint of a data-parallel run: every rank must hold the same
/// parameters, or the checkpoint (rank 0's) would not be the run's model.
fn check_ranks_agree(group: Option<&Group>, params: &ParamSet, step: u64) -> Result<(), TrainError> {
    match group {
        Some(g) if !g.all_equal(crate::dist::fingerprint(params)) => Err(DistError::Diverged { step }.into()),
        _ => Ok(()),
    }
}

/// Saves checkpoints and remembers the last one that was written whole.
struct Saver<'a> {
    spec: &'a ModelSpec,
    metrics_path: &'a Path,
    last_good: Option<(PathBuf, u64)>,
    /// The data this run trains on, recorded in every checkpoint.
    data: &'a DataIdentity,
    /// The tokenizer behind its ids, when known, recorded too.
    tokenizer: Option<&'a ir::spec::TokenizerSpec>,
}

impl Saver<'_> {
    /// Checks that the state is finite, syncs the metrics up to this step, then
    /// writes the checkpoint atomically. A failure names the last good checkpoint.
    #[allow(clippy::too_many_arguments)]
    fn save(
        &mut self,
        exec: &mut dyn StepExecutor,
        params: &ParamSet,
        optimizer: &mut Optimizer,
        sampler: &BatchSampler,
        step: u64,
        path: &Path,
        metrics: &File,
    ) -> Result<(), TrainError> {
        exec.sync_optimizer(optimizer).map_err(|source| TrainError::Step { step, source })?;
        if let Some((tensor, value)) = checkpoint::first_non_finite_state(params, Some(optimizer)) {
            return Err(TrainError::Diverged { step, tensor, value, last_good: self.last_good.clone() });
        }
        metrics
            .sync_data()
            .map_err(|source| TrainError::Io { path: self.metrics_path.to_path_buf(), source })?;
        let state = TrainState { step, sampler: sampler.state() };
        checkpoint::save_with_data(
            path,
            self.spec,
            params,
            Some(optimizer),
            &state,
            Some(self.data),
            self.tokenizer,
        )
        .map_err(|source| TrainError::SaveFailed {
            step,
            last_good: self.last_good.clone(),
            source: Box::new(source),
        })?;
        self.last_good = Some((path.to_path_buf(), step));
        Ok(())
    }
}

/// Notes on stderr about what a run does to its folder, unless progress is silent.
struct Notes(Progress);

impl Notes {
    fn say(&self, message: impl std::fmt::Display) {
        match self.0 {
            Progress::Auto { .. } => eprintln!("note: {message}"),
            Progress::Silent => {}
        }
    }
}

/// Says which resumable fields the run changes and, when the step budget or
/// warmup changes, how the learning-rate schedule continues.
fn note_resume_changes(ckpt: &Checkpoint, spec: &ModelSpec, changed: &[String], notes: &Notes) {
    if changed.is_empty() {
        return;
    }
    notes.say(format!("resuming {} with changed {}", ckpt.path.display(), changed.join(", ")));
    let (planned, total) = (ckpt.spec.train.steps, spec.train.steps);
    let step = ckpt.state.step as usize;
    let warmup = |s: &ScheduleSpec| match s {
        ScheduleSpec::Constant(c) => c.warmup,
        ScheduleSpec::Cosine(c) => c.warmup,
        ScheduleSpec::Wsd(w) => w.warmup,
    };
    if (planned, warmup(&ckpt.spec.train.schedule)) != (total, warmup(&spec.train.schedule)) && step < total {
        let now = lr_multiplier(&spec.train.schedule, step, total);
        let was = if step < planned {
            format!(" (the planned run's: {:.4})", lr_multiplier(&ckpt.spec.train.schedule, step, planned))
        } else {
            String::new()
        };
        notes.say(format!(
            "the learning-rate schedule is recomputed for {total} steps (the checkpoint's run planned \
             {planned}); from step {} on each step's rate is that of a fresh {total}-step run: \
             multiplier {now:.4} at step {}{was}",
            step + 1,
            step + 1
        ));
    }
}

/// Says so when a resumed run trains on other data than the checkpoint's run did
/// (a change the resume allows; the comparison is by content, then by path).
fn note_data_change(ckpt: &Checkpoint, data: &DataIdentity, notes: &Notes) {
    let Some(old) = &ckpt.data else { return };
    if (old.bytes, &old.sha256) != (data.bytes, &data.sha256) {
        notes.say(format!(
            "{} was trained on {}; this run continues on different data: {}",
            ckpt.path.display(),
            old.describe(),
            data.describe()
        ));
    } else if old.source != data.source {
        notes.say(format!(
            "{} was trained on {}; this run reads the same bytes from {}",
            ckpt.path.display(),
            old.source,
            data.source
        ));
    }
}

/// The run folder: its lock, the files of a run in it, and what a resume does to them.
mod folder {
    use super::{Notes, TrainError, FINAL_CHECKPOINT, INIT_CHECKPOINT, LOCK_FILE, METRICS_FILE};
    use crate::checkpoint::{self, Checkpoint};
    use std::fs::File;
    use std::path::{Path, PathBuf};

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
        move |source| TrainError::Io { path: path.to_path_buf(), source }
    }

    /// The held lock of a run folder. The advisory lock is released when the file
    /// closes, so a crashed run leaves no stale lock; a run that ends in the
    /// process (finished, failed or interrupted) also removes `run.lock`, so a
    /// finished folder holds only the run's results.
    pub(super) struct RunLock {
        path: PathBuf,
        _file: File,
    }

    impl Drop for RunLock {
        fn drop(&mut self) {
            // Removed while still held: a second run cannot lock this file meanwhile.
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Locks `dir` for this run (an advisory lock on `run.lock`) and records who holds it.
    pub(super) fn lock(dir: &Path) -> Result<RunLock, TrainError> {
        use std::io::Write;
        let path = dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io(&path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).ok().and_then(|t| describe_holder(&t));
                let holder = holder.unwrap_or_else(|| "it has not said which".to_string());
                return Err(TrainError::Locked { dir: dir.to_path_buf(), holder });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&path)(e)),
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let command: Vec<String> = std::env::args().collect();
        let record = serde_json::json!({
            "pid": std::process::id(),
            "command": command.join(" "),
            "started_unix": started,
        });
        file.set_len(0).and_then(|()| writeln!(file, "{record}")).map_err(io(&path))?;
        Ok(RunLock { path, _file: file })
    }

    /// "pid 123 (`widen train spec.ron`), started 5 s ago" from a lock file's record.
    fn describe_holder(text: &str) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(text.trim()).ok()?;
        let pid = v.get("pid")?.as_u64()?;
        let command = v.get("command").and_then(|c| c.as_str()).unwrap_or("?");
        let started = v.get("started_unix").and_then(|s| s.as_u64()).unwrap_or(0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Some(format!("pid {pid} (`{command}`), started {} s ago", now.saturating_sub(started)))
    }

    /// Removes the temporary files an interrupted save or metrics rewrite left
    /// (`.<name>.tmp`, `metrics.jsonl.tmp`); only a run holding the lock writes
    /// them, so none of them is in use.
    pub(super) fn remove_partial_files(dir: &Path, notes: &Notes) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let partial = (name.starts_with('.') && name.ends_with(".safetensors.tmp"))
                || name == format!("{METRICS_FILE}.tmp");
            if partial && std::fs::remove_file(entry.path()).is_ok() {
                notes.say(format!("removed {}, left by an interrupted save", entry.path().display()));
            }
        }
    }

    /// `ckpt-<step>.safetensors` files in `dir`, by step.
    pub(super) fn step_checkpoints(dir: &Path) -> Result<Vec<(u64, PathBuf)>, TrainError> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(dir)(e)),
        };
        let mut found = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io(dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("ckpt-").and_then(|n| n.strip_suffix(".safetensors"));
            if let Some(step) = step.and_then(|s| s.parse::<u64>().ok()) {
                found.push((step, entry.path()));
            }
        }
        found.sort();
        Ok(found)
    }

    /// The files of a run in `dir`: a non-empty metrics file and checkpoints
    /// (the initial one included).
    pub(super) fn run_files(dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
        let mut files = Vec::new();
        let metrics = dir.join(METRICS_FILE);
        if std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0) {
            files.push(metrics);
        }
        for name in [FINAL_CHECKPOINT, INIT_CHECKPOINT] {
            let path = dir.join(name);
            if path.exists() {
                files.push(path);
            }
        }
        files.extend(step_checkpoints(dir)?.into_iter().map(|(_, p)| p));
        Ok(files)
    }

    fn same_folder(a: &Path, b: &Path) -> bool {
        let canon = |p: &Path| {
            let p = if p.as_os_str().is_empty() { Path::new(".") } else { p };
            std::fs::canonicalize(p).ok()
        };
        matches!((canon(a), canon(b)), (Some(x), Some(y)) if x == y)
    }

    /// Readies `dir` for a run continuing from `ckpt` (see the module doc of
    /// `train`): refuses, or with `overwrite` removes, what the resume would
    /// replace; keeps the metrics up to the checkpoint's step.
    pub(super) fn prepare_resume(
        dir: &Path,
        ckpt: &Checkpoint,
        overwrite: bool,
        notes: &Notes,
    ) -> Result<(), TrainError> {
        let step = ckpt.state.step;
        let home = ckpt.path.parent().unwrap_or(Path::new("."));
        let own = same_folder(home, dir);
        let replaced: Vec<PathBuf> = if own {
            let mut later: Vec<PathBuf> =
                step_checkpoints(dir)?.into_iter().filter(|(s, _)| *s > step).map(|(_, p)| p).collect();
            let last = dir.join(FINAL_CHECKPOINT);
            // An unreadable final file is still a result: count it as later.
            if last.exists() && checkpoint::read_step(&last).map_or(true, |s| s > step) {
                later.push(last);
            }
            later
        } else {
            run_files(dir)?
        };
        if !replaced.is_empty() {
            if !overwrite {
                return Err(TrainError::WouldReplace {
                    checkpoint: ckpt.path.clone(),
                    step,
                    dir: dir.to_path_buf(),
                    replaced,
                });
            }
            for path in &replaced {
                std::fs::remove_file(path).map_err(io(path))?;
                notes.say(format!("--overwrite: removed {}", path.display()));
            }
        }
        let metrics = dir.join(METRICS_FILE);
        if own {
            let dropped = truncate_metrics(&metrics, step)?;
            if dropped > 0 {
                notes.say(format!(
                    "dropped {dropped} line(s) of {} after step {step} (or unreadable), written after the \
                     checkpoint by a run that stopped before its next one; this run writes those steps again",
                    metrics.display()
                ));
            }
            keep_final_as_step_checkpoint(dir, step, notes)?;
        } else {
            copy_metrics(&home.join(METRICS_FILE), &metrics, step, notes)?;
        }
        Ok(())
    }

    /// Resuming from (or at the step of) the final checkpoint in its own folder
    /// replaces that file at the end; keep its state as `ckpt-<step>` first.
    fn keep_final_as_step_checkpoint(dir: &Path, step: u64, notes: &Notes) -> Result<(), TrainError> {
        let last = dir.join(FINAL_CHECKPOINT);
        let kept = dir.join(format!("ckpt-{step}.safetensors"));
        if last.exists() && !kept.exists() && checkpoint::read_step(&last).is_ok_and(|s| s == step) {
            let tmp = checkpoint::temp_path(&kept);
            std::fs::copy(&last, &tmp).and_then(|_| std::fs::rename(&tmp, &kept)).map_err(io(&kept))?;
            notes.say(format!("kept {} as {} before continuing", last.display(), kept.display()));
        }
        Ok(())
    }

    /// Keeps only the metrics lines with `step <= last` (a resumed run replays the
    /// steps after its checkpoint), rewriting the file atomically; returns how
    /// many lines were dropped (later or unreadable ones).
    fn truncate_metrics(path: &Path, last: u64) -> Result<usize, TrainError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(source) => return Err(TrainError::Io { path: path.to_path_buf(), source }),
        };
        let (kept, dropped) = lines_up_to(&text, last);
        if dropped > 0 {
            write_synced(path, &kept)?;
        }
        Ok(dropped)
    }

    /// Starts a new run folder's metrics with the checkpoint's run's lines up to
    /// its step, so the folder holds the whole run's record.
    fn copy_metrics(from: &Path, to: &Path, last: u64, notes: &Notes) -> Result<(), TrainError> {
        let Ok(text) = std::fs::read_to_string(from) else {
            notes.say(format!("{} is missing; {} starts at step {}", from.display(), to.display(), last + 1));
            return Ok(());
        };
        let (kept, _) = lines_up_to(&text, last);
        write_synced(to, &kept)?;
        notes.say(format!("{} starts with the lines of {} up to step {last}", to.display(), from.display()));
        Ok(())
    }

    /// The lines of a metrics file with `step <= last`, and how many others there were.
    fn lines_up_to(text: &str, last: u64) -> (String, usize) {
        let (mut kept, mut dropped) = (String::new(), 0);
        for line in text.lines() {
            let step = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()));
            if step.is_some_and(|s| s <= last) {
                kept.push_str(line);
                kept.push('\n');
            } else {
                dropped += 1;
            }
        }
        (kept, dropped)
    }

    fn write_synced(path: &Path, text: &str) -> Result<(), TrainError> {
        use std::io::Write;
        let tmp = path.with_extension("jsonl.tmp");
        let written = File::create(&tmp).and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()
        });
        written.and_then(|()| std::fs::rename(&tmp, path)).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            TrainError::Io { path: path.to_path_buf(), source }
        })
    }

    /// Deletes all but the newest `keep` step checkpoints (none when `keep` is 0).
    pub(super) fn keep_newest(dir: &Path, keep: usize, notes: &Notes) {
        if keep == 0 {
            return;
        }
        let Ok(all) = step_checkpoints(dir) else { return };
        for (_, path) in all.iter().rev().skip(keep) {
            if let Err(e) = std::fs::remove_file(path) {
                notes.say(format!("cannot remove old checkpoint {} (train.keep_last): {e}", path.display()));
            }
        }
    }
}

/// Ctrl-C and SIGTERM during a run (`TrainOptions::catch_signals`).
///
/// The handlers are registered once per process, through `signal-hook`, and
/// stay: on a signal they (1) end the process by the signal's default action if a
/// stop was already requested (the second Ctrl-C), (2) request a stop, and (3)
/// end the process by the default action if no run is catching signals, so
/// outside a run the signals behave as if no handler were installed.
mod signals {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, OnceLock};

    struct Flags {
        stop: Arc<AtomicBool>,
        idle: Arc<AtomicBool>,
        /// Runs in this process catching signals.
        active: Mutex<usize>,
    }

    static FLAGS: OnceLock<Flags> = OnceLock::new();
    static REGISTERED: Mutex<bool> = Mutex::new(false);

    fn flags() -> std::io::Result<&'static Flags> {
        let flags = FLAGS.get_or_init(|| Flags {
            stop: Arc::new(AtomicBool::new(false)),
            idle: Arc::new(AtomicBool::new(true)),
            active: Mutex::new(0),
        });
        let mut registered = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
        if !*registered {
            use signal_hook::consts::{SIGINT, SIGTERM};
            use signal_hook::flag;
            for sig in [SIGINT, SIGTERM] {
                flag::register_conditional_default(sig, Arc::clone(&flags.stop))?;
                flag::register(sig, Arc::clone(&flags.stop))?;
                flag::register_conditional_default(sig, Arc::clone(&flags.idle))?;
            }
            *registered = true;
        }
        Ok(flags)
    }

    /// A run catching signals; dropping it lets the signals act by default again
    /// once no other run in the process catches them.
    pub(super) struct Guard(&'static Flags);

    pub(super) fn catch() -> std::io::Result<Guard> {
        let flags = flags()?;
        let mut active = flags.active.lock().unwrap_or_else(|e| e.into_inner());
        if *active == 0 {
            flags.stop.store(false, Ordering::SeqCst);
            flags.idle.store(false, Ordering::SeqCst);
        }
        *active += 1;
        Ok(Guard(flags))
    }

    impl Guard {
        pub(super) fn stop_requested(&self) -> bool {
            self.0.stop.load(Ordering::SeqCst)
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            let mut active = self.0.active.lock().unwrap_or_else(|e| e.into_inner());
            *active -= 1;
            if *active == 0 {
                self.0.idle.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// Errors of one evaluation: reading its windows, or running the model on them.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Step(#[from] StepError),
}

/// What one evaluation measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Validation {
    /// The main head's mean next-token loss, nats per token.
    pub loss: f64,
    /// Next-token targets scored (per rank in a data-parallel run).
    pub targets: u64,
    /// Bytes behind those targets, when the tokenizer is known.
    pub target_bytes: Option<u64>,
}

impl Validation {
    /// Bits per byte: the loss per target times targets per byte, over ln 2
    /// (docs/data.md), when the bytes behind the tokens are known.
    pub fn bits_per_byte(&self) -> Option<f64> {
        let bytes = self.target_bytes.filter(|&b| b > 0)?;
        Some(self.loss * self.targets as f64 / bytes as f64 / std::f64::consts::LN_2)
    }
}

/// The validation loss of `params`: the main head's mean next-token loss (nats
/// per token) over the windows `plan` names (docs/data.md, "Validation"): the first
/// batches of a fresh `data.validation` sampler of the spec's seed, or a fixed token
/// budget in order from the start of the validation split. Either way every
/// evaluation of a run, and `widen eval` of its checkpoints, scores the same windows.
/// `exec` fixes the batch shape.
pub fn validation_loss(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    corpus: &Corpus,
    plan: ValidationPlan,
) -> Result<Validation, ValidationError> {
    validation_loss_of_shard(spec, exec, params, corpus, plan, Shard::WHOLE, &mut |_, _| {})
}

/// [`validation_loss`], calling `progress(done, batches)` after each batch (`widen
/// eval` shows it for long evaluations).
pub fn validation_loss_with_progress(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    corpus: &Corpus,
    plan: ValidationPlan,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Validation, ValidationError> {
    validation_loss_of_shard(spec, exec, params, corpus, plan, Shard::WHOLE, progress)
}

/// [`validation_loss`] in a data-parallel run: each rank scores its rows of
/// the validation batches a single process would draw (of the global batch),
/// and the ranks average their means, so the number does not depend on how
/// many ranks there are.
fn sharded_validation_loss(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    corpus: &Corpus,
    plan: ValidationPlan,
    group: Option<&Group>,
) -> Result<Validation, ValidationError> {
    let mine = validation_loss_of_shard(spec, exec, params, corpus, plan, Shard::of(group), &mut |_, _| {})?;
    Ok(match group {
        // Every rank scores as many targets, so the mean of means is the mean; the
        // bytes per target are averaged the same way.
        Some(g) => Validation {
            loss: g.mean(mine.loss),
            targets: mine.targets * g.size() as u64,
            target_bytes: mine.target_bytes.map(|b| (g.mean(b as f64) * g.size() as f64).round() as u64),
        },
        None => mine,
    })
}

/// The validation loss over `shard`'s rows of the validation batches of
/// `shard.world` times `exec`'s batch.
fn validation_loss_of_shard(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    corpus: &Corpus,
    plan: ValidationPlan,
    shard: Shard,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Validation, ValidationError> {
    let [batch, window] = exec.token_shape();
    let global = batch * shard.world;
    let n = plan.batches(global, window, corpus.validation(), &corpus.source)?;
    let mut sampler = plan.sampler(spec.train.seed, global, window);
    let tokenizer = corpus.tokenizer();
    let (mut sum, mut targets, mut bytes) = (0.0f64, 0u64, 0u64);
    for done in 1..=n {
        let all = sampler.next_batch(corpus.validation())?;
        let tokens = shard.rows(&all, window);
        sum += if spec.mtp.depth == 0 {
            f64::from(exec.loss(params, tokens)?)
        } else {
            exec.main_loss(params, tokens)?
        };
        for row in tokens.chunks(window) {
            targets += (window - 1) as u64;
            if let Some(t) = tokenizer {
                bytes += row[1..].iter().map(|&id| t.token_bytes(id as u32) as u64).sum::<u64>();
            }
        }
        progress(done, n);
    }
    Ok(Validation { loss: sum / n as f64, targets, target_bytes: tokenizer.map(|_| bytes) })
}

pub use crate::step::next_token_loss;

/// The progress display on stderr ([`crate::progress`]): the step, loss, learning
/// rate, throughput and, from the steps this invocation has taken, the time elapsed
/// and left. A log gets a line every `every` steps, at each evaluation and at the end.
struct ProgressLine {
    mode: Progress,
    line: crate::progress::Line,
    total: usize,
    /// The step before the first of this invocation, and when the loop started.
    first: u64,
    started: Instant,
    /// When the first step of this invocation ended: it holds one-off work (the
    /// kernels' compilation), so the ETA is at the rate of the steps after it.
    first_done: Option<Duration>,
}

impl ProgressLine {
    fn new(mode: Progress, total: usize, first: u64) -> Self {
        let line = crate::progress::Line::new(crate::progress::Mode::of_stderr());
        ProgressLine { mode, line, total, first, started: Instant::now(), first_done: None }
    }

    /// `val`: the validation loss and, when the bytes behind the tokens are known, bits per byte.
    fn show(&mut self, step: u64, loss: f32, lr: f64, tokens_per_s: f64, val: Option<(f32, Option<f64>)>) {
        let Progress::Auto { every } = self.mode else { return };
        let elapsed = self.started.elapsed();
        let since = *self.first_done.get_or_insert(elapsed);
        let text =
            step_text(step, self.total as u64, loss, lr, tokens_per_s, val, elapsed, self.first, since);
        use crate::progress::Mark;
        let mark = if val.is_some() {
            Mark::Keep
        } else if step.is_multiple_of(every.max(1) as u64) || step == self.total as u64 {
            Mark::Line
        } else {
            Mark::Tick
        };
        self.line.show(&text, elapsed, mark);
    }
}

/// One progress line of a run: `step 40/300  loss 2.1234  lr 3.000e-3  51234 tok/s
/// elapsed 4s  ETA 26s`, with the validation loss when the step evaluated. The ETA is
/// at the rate of the steps after the first of this invocation (step `first + 1`,
/// which ended at `first_done`), so one-off setup does not inflate it.
#[allow(clippy::too_many_arguments)]
fn step_text(
    step: u64,
    total: u64,
    loss: f32,
    lr: f64,
    tokens_per_s: f64,
    val: Option<(f32, Option<f64>)>,
    elapsed: Duration,
    first: u64,
    first_done: Duration,
) -> String {
    use crate::progress::{clock, eta_text};
    let val = match val {
        Some((v, Some(bpb))) => format!("  val {v:.4} ({bpb:.3} bits/byte)"),
        Some((v, None)) => format!("  val {v:.4}"),
        None => String::new(),
    };
    let done = step.saturating_sub(first + 1) as f64;
    let eta = match step >= total {
        true => clock(Duration::ZERO),
        false => eta_text(elapsed.saturating_sub(first_done), done, total.saturating_sub(first + 1) as f64),
    };
    format!(
        "step {step}/{total}  loss {loss:.4}  lr {lr:.3e}  {tokens_per_s:.0} tok/s{val}  elapsed {}  ETA {eta}",
        clock(elapsed)
    )
}

impl Drop for ProgressLine {
    /// Ends an in-place line, however the loop exits, so later messages start on a fresh line.
    fn drop(&mut self) {
        self.line.end(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::spec::ModelSpec;

    #[test]
    fn a_step_line_says_elapsed_time_and_the_time_left_at_this_invocations_rate() {
        // Resumed after step 10; step 11 (compilation included) ended at 5 s, and 29
        // more steps took 7 s: 60 more take about 14 s.
        let line =
            step_text(40, 100, 2.5, 3e-3, 1000.0, None, Duration::from_secs(12), 10, Duration::from_secs(5));
        assert_eq!(line, "step 40/100  loss 2.5000  lr 3.000e-3  1000 tok/s  elapsed 12s  ETA 14s");
        let first =
            step_text(11, 100, 2.5, 3e-3, 1000.0, None, Duration::from_secs(5), 10, Duration::from_secs(5));
        assert!(first.ends_with("ETA ?"), "no rate before a second step: {first}");
        let line = step_text(
            100,
            100,
            2.0,
            0.0,
            1.0,
            Some((1.0, Some(1.443))),
            Duration::from_secs(75),
            0,
            Duration::from_secs(1),
        );
        assert!(
            line.contains("val 1.0000 (1.443 bits/byte)") && line.ends_with("elapsed 1m15s  ETA 0s"),
            "{line}"
        );
    }

    /// The validation loss of a model with MTP modules is computed from the main
    /// head's logits; on a model without them it must equal the graph's own loss.
    #[test]
    fn next_token_loss_matches_the_graph_loss_without_mtp() {
        let mut spec = ModelSpec { d_model: 16, layers: 1, heads: 2, ..ModelSpec::default() };
        spec.train.batch = 2;
        spec.train.seq_len = 8;
        let (batch, window) = (2, 9);
        let lowered = ir::lower::lower(&spec, batch, window - 1).unwrap();
        let params = init_params(&lowered.graph, 3).unwrap();
        let mut exec = Device::Reference.executor(lowered).unwrap();
        let tokens: Vec<i32> = (0..batch * window).map(|i| ((i * 37 + 11) % 256) as i32).collect();
        let graph = f64::from(exec.loss(&params, &tokens).unwrap());
        let ours = next_token_loss(&exec.logits(&params, &tokens).unwrap(), &tokens, batch, window);
        assert!((graph - ours).abs() < 1e-4 * graph, "graph loss {graph}, from logits {ours}");
        assert!(ours > 1.0, "an untrained byte model's loss is near ln 256, got {ours}");
    }
}
