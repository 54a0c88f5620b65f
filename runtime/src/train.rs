//! The training loop (DESIGN.md §7). Per step: sample a batch, forward and
//! backward on a [`StepExecutor`], clip the global gradient norm, take an
//! optimizer step at the scheduled LR; validate every `eval_every` steps.
//!
//! Outputs in the run folder:
//! - `metrics.jsonl`: one JSON object per step (`step`, `device`, `loss`, `lr`,
//!   `grad_norm`, `tokens_per_s`, and `val_loss` when evaluated). A fresh run
//!   refuses to overwrite an earlier run's metrics; a resumed run keeps the
//!   lines up to the checkpoint's step and appends after them.
//! - `ckpt-<step>.safetensors` every `checkpoint_every` steps, and
//!   `final.safetensors` at the end (see [`crate::checkpoint`]).
//!
//! A NaN or infinite loss stops the run with an error naming the step; what
//! was written before that step stays on disk. Steps are numbered from 1: step
//! k is the k-th optimizer update, and `ckpt-k` holds the state after it.

use crate::checkpoint::{self, Checkpoint, CheckpointError, TrainState};
use crate::data::{BatchSampler, Corpus, DataError};
use crate::executor::{Device, StepError, StepExecutor, StepStats, UpdateSettings};
use crate::init::{init_params, InitError};
use crate::optim::schedule::lr_multiplier;
use crate::optim::Optimizer;
use crate::params::ParamSet;
use ir::spec::{ModelSpec, OptimizerSpec};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Errors that stop a run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("cannot write {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "{path} already holds metrics of an earlier run; choose another --out folder, \
         remove it, or pass --resume to continue that run"
    )]
    MetricsExist { path: PathBuf },
    #[error("checkpoint {path} is at step {step}, past this run's {total} steps")]
    ResumePastEnd { path: PathBuf, step: u64, total: usize },
    #[error("{what} is {value} at step {step}; stopping (earlier checkpoints and metrics are kept)")]
    NonFinite { step: u64, what: &'static str, value: f32 },
    #[error("cannot set up the device")]
    Device(#[source] StepError),
    #[error("training step {step} failed")]
    Step { step: u64, source: StepError },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Init(#[from] InitError),
}

/// How progress is shown on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Refresh one line in place when stderr is a terminal; otherwise print a
    /// line every `every` steps and at every evaluation.
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
}

/// Lowers `spec` for its batch and sequence length, initializes the parameters
/// from its seed (or restores them from `opts.resume`), loads its data and trains
/// on `device`.
pub fn train_spec(spec: &ModelSpec, device: Device, opts: &TrainOptions) -> Result<TrainReport, TrainError> {
    let window = spec.train.seq_len + 1;
    let corpus = Corpus::load(&spec.train.data, spec.train.val_fraction, window)?;
    let lowered = ir::lower::lower(spec, spec.train.batch, spec.train.seq_len)?;
    let params = init_params(&lowered.graph, spec.train.seed)?;
    let mut exec = device.executor(lowered).map_err(TrainError::Device)?;
    train(spec, exec.as_mut(), params, &corpus, opts)
}

/// Trains `params` (already initialized) on `corpus` with `exec`.
pub fn train(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    mut params: ParamSet,
    corpus: &Corpus,
    opts: &TrainOptions,
) -> Result<TrainReport, TrainError> {
    let out = &opts.out_dir;
    std::fs::create_dir_all(out).map_err(|source| TrainError::Io { path: out.clone(), source })?;
    let [batch, window] = exec.token_shape();
    corpus.check_window(window)?;
    let total = spec.train.steps;
    let mut optimizer = Optimizer::new(spec, &params);
    let metrics_path = out.join("metrics.jsonl");

    let (start, mut sampler) = match &opts.resume {
        Some(path) => {
            let ckpt = Checkpoint::read(path)?;
            ckpt.check_spec(spec)?;
            if ckpt.state.step > total as u64 {
                return Err(TrainError::ResumePastEnd { path: path.clone(), step: ckpt.state.step, total });
            }
            ckpt.restore_params(&mut params)?;
            ckpt.restore_optimizer(&mut optimizer)?;
            truncate_metrics(&metrics_path, ckpt.state.step)?;
            (ckpt.state.step, BatchSampler::from_state(ckpt.state.data_rng, batch, window))
        }
        None => {
            if std::fs::metadata(&metrics_path).map(|m| m.len() > 0).unwrap_or(false) {
                return Err(TrainError::MetricsExist { path: metrics_path });
            }
            (0, BatchSampler::train(spec.train.seed, batch, window))
        }
    };
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .map_err(|source| TrainError::Io { path: metrics_path.clone(), source })?;

    let peak_lr = match &spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.lr,
        OptimizerSpec::Muon(m) => m.adamw.lr,
    };
    let mut progress = ProgressLine::new(opts.progress, total);
    let mut losses = Vec::new();
    let mut val_loss = None;
    for step in start + 1..=total as u64 {
        let started = Instant::now();
        let tokens = sampler.next_batch(corpus.train());
        let lr_mult = lr_multiplier(&spec.train.schedule, (step - 1) as usize, total);
        let settings = UpdateSettings { lr_mult, clip: spec.train.clip };
        let StepStats { loss, grad_norm } = exec
            .train_step(&mut params, &tokens, &mut optimizer, settings)
            .map_err(|source| TrainError::Step { step, source })?;
        if !loss.is_finite() {
            return Err(TrainError::NonFinite { step, what: "training loss", value: loss });
        }
        let tokens_per_s = (batch * (window - 1)) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        losses.push(loss);

        let mut record = serde_json::json!({
            "step": step,
            "device": exec.device(),
            "loss": loss,
            "lr": peak_lr * lr_mult,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
        });
        let evaluate = step.is_multiple_of(spec.train.eval_every.max(1) as u64) || step == total as u64;
        if evaluate {
            let v = validation_loss(spec, exec, &params, corpus, batch, window)
                .map_err(|source| TrainError::Step { step, source })?;
            if !v.is_finite() {
                return Err(TrainError::NonFinite { step, what: "validation loss", value: v });
            }
            record["val_loss"] = serde_json::json!(v);
            val_loss = Some(v);
        }
        writeln!(metrics, "{record}")
            .and_then(|_| metrics.flush())
            .map_err(|source| TrainError::Io { path: metrics_path.clone(), source })?;
        progress.show(step, loss, peak_lr * lr_mult, tokens_per_s, evaluate.then_some(val_loss).flatten());

        let every = spec.train.checkpoint_every as u64;
        if every > 0 && step.is_multiple_of(every) {
            exec.sync_optimizer(&mut optimizer).map_err(|source| TrainError::Step { step, source })?;
            let state = TrainState { step, data_rng: sampler.state() };
            checkpoint::save(
                &out.join(format!("ckpt-{step}.safetensors")),
                spec,
                &params,
                Some(&optimizer),
                &state,
            )?;
        }
    }
    drop(progress);
    let final_checkpoint = out.join("final.safetensors");
    let steps = optimizer.steps_taken();
    exec.sync_optimizer(&mut optimizer).map_err(|source| TrainError::Step { step: steps, source })?;
    let state = TrainState { step: steps, data_rng: sampler.state() };
    checkpoint::save(&final_checkpoint, spec, &params, Some(&optimizer), &state)?;
    Ok(TrainReport { losses, val_loss, steps, final_checkpoint, metrics: metrics_path })
}

/// Mean loss over `eval_batches` validation batches drawn from a fresh sampler.
fn validation_loss(
    spec: &ModelSpec,
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    corpus: &Corpus,
    batch: usize,
    window: usize,
) -> Result<f32, StepError> {
    let mut sampler = BatchSampler::validation(spec.train.seed, batch, window);
    let n = spec.train.eval_batches.max(1);
    let mut sum = 0.0f64;
    for _ in 0..n {
        let tokens = sampler.next_batch(corpus.validation());
        sum += f64::from(exec.loss(params, &tokens)?);
    }
    Ok((sum / n as f64) as f32)
}

/// Keeps only the metrics lines with `step <= last` (a resumed run replays
/// the steps after its checkpoint), rewriting the file atomically.
fn truncate_metrics(path: &Path, last: u64) -> Result<(), TrainError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(TrainError::Io { path: path.to_path_buf(), source }),
    };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s <= last)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|source| TrainError::Io { path: path.to_path_buf(), source })
}

/// The progress display on stderr.
struct ProgressLine {
    mode: Progress,
    terminal: bool,
    total: usize,
    open: bool,
}

impl ProgressLine {
    fn new(mode: Progress, total: usize) -> Self {
        ProgressLine { mode, terminal: std::io::stderr().is_terminal(), total, open: false }
    }

    fn show(&mut self, step: u64, loss: f32, lr: f64, tokens_per_s: f64, val: Option<f32>) {
        let Progress::Auto { every } = self.mode else { return };
        let val = val.map(|v| format!("  val {v:.4}")).unwrap_or_default();
        let line =
            format!("step {step}/{}  loss {loss:.4}  lr {lr:.3e}  {tokens_per_s:.0} tok/s{val}", self.total);
        let mut err = std::io::stderr().lock();
        // Progress output is best effort: a closed stderr must not stop training.
        if self.terminal {
            let _ = write!(err, "\r{line}\x1b[K");
            if !val.is_empty() {
                let _ = writeln!(err);
            }
            self.open = val.is_empty();
        } else if step.is_multiple_of(every.max(1) as u64) || !val.is_empty() || step == self.total as u64 {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }
}

impl Drop for ProgressLine {
    /// Ends an in-place line, however the loop exits, so later messages start on a fresh line.
    fn drop(&mut self) {
        if self.open {
            let _ = writeln!(std::io::stderr());
        }
    }
}
