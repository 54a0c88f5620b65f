//! Evaluation of a checkpoint (`widen eval`): the validation loss over the
//! held-out windows training scores, and a dump of one batch's logits, loss and
//! gradients for comparing another implementation with widen's
//! (docs/checkpoints.md describes the files).
//!
//! The model is the one the checkpoint's header holds, rebuilt for its own batch
//! and sequence length; the validation windows are those of
//! [`crate::train::validation_loss`] (the `data.validation` stream of the spec's
//! seed over the tail of the data, summed in the same order here so each batch
//! can report progress; `runtime/tests/eval.rs` checks the two agree bit for
//! bit), so `widen eval` of a run's checkpoint
//! reproduces the `val_loss` the run logged at that step when `--batches` is the
//! spec's `eval_batches` and the data is the same.
//!
//! **Dump files** (`--dump DIR`), all safetensors, the first validation batch:
//! - `batch.safetensors`: `tokens`, i32 `[batch, seq_len + 1]` (a window: inputs
//!   are `tokens[:, :-1]`, targets `tokens[:, 1:]`);
//! - `logits.safetensors`: `logits`, f32 `[batch, seq_len, vocab]`, the main head;
//! - `loss.safetensors`: `loss`, f32 `[]`, the training loss of that batch as
//!   `metrics.jsonl` reports it (with the MTP terms, docs/math.md §7.1), and
//!   `loss_main`, f32 `[]`, the main head's next-token loss;
//! - `grads.safetensors`: the gradient of `loss` for every parameter, f32, under
//!   the parameter's checkpoint name and shape (with `balance: AuxLoss`, of `loss`
//!   plus the MoE auxiliary loss, the objective training differentiates,
//!   docs/math.md §1.6).
//!
//! Each file's header metadata names the checkpoint, its step and spec hash.
//! Dump files already in the folder are replaced only with
//! [`EvalOptions::force`]: a dump is often kept to compare against later.
//!
//! **The data.** Without [`EvalOptions::data`] the checkpoint's own training
//! data is evaluated, and it must be the very bytes the run trained on: a
//! checkpoint records their length and SHA-256 (docs/checkpoints.md), and a file
//! of the recorded name holding other bytes is refused, naming both hashes,
//! rather than scored as if it were the run's. A relative data path is relative
//! to the folder the run was started in: a checkpoint records the absolute path
//! the run resolved (`data_path`), which is tried first; then (for checkpoints
//! without it, or a moved file) the path in the working folder, and in the
//! checkpoint's folder and each folder above it (a run started in `DIR` writes
//! `DIR/runs/<name>/`). The first file that holds the recorded bytes is used. With [`EvalOptions::data`] the given file is scored whatever it holds,
//! and [`EvalReport::notes`] says so when it is not the run's data.
//!
//! **Batches** are bounded like the spec's `train.eval_batches`
//! ([`max_batches`]).

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::data::{read_text, BatchSampler, Corpus, DataError, DataIdentity, ValidationPlan};
use crate::device::Device;
use crate::params::{ParamError, ParamSet};
use crate::step::{StepError, StepExecutor};
use crate::train::{Validation, ValidationError};
use ir::spec::{DataSpec, ModelSpec};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The dump files, in the order they are written (see the module doc).
pub const DUMP_FILES: [&str; 4] =
    ["batch.safetensors", "logits.safetensors", "loss.safetensors", "grads.safetensors"];

/// The most validation batches one evaluation averages: the bound of the spec's
/// `train.eval_batches` (`ir::spec::limits`), whose reason holds here too.
pub fn max_batches() -> usize {
    let limit =
        ir::spec::limits::integer_limit("train.eval_batches").expect("train.eval_batches has a limit");
    usize::try_from(limit.max).unwrap_or(usize::MAX)
}

/// What to evaluate on and what to write.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalOptions {
    /// Other data than the checkpoint's (`--data`): a text file, or token shards
    /// ([`crate::data::data_from_arg`]).
    pub data: Option<String>,
    /// Validation batches to average (default: the spec's `eval_batches`), at
    /// most [`max_batches`].
    pub batches: Option<usize>,
    /// Folder for the dump files (see the module doc).
    pub dump: Option<PathBuf>,
    /// Let the dump replace dump files already in its folder.
    pub force: bool,
}

/// The result of [`evaluate`].
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// The checkpoint's step.
    pub step: u64,
    /// The data evaluated on.
    pub data: DataIdentity,
    /// The data the checkpoint's run trained on, when the checkpoint records it.
    pub trained_on: Option<DataIdentity>,
    /// What the user should know about the data: that `--data` is not the run's
    /// data, or that a file of the recorded name was passed over for holding
    /// other bytes.
    pub notes: Vec<String>,
    /// Validation batches averaged, and their shape `[batch, seq_len + 1]`.
    pub batches: usize,
    pub token_shape: [usize; 2],
    /// Main-head next-token loss in nats per token, with the targets it scored.
    pub validation: Validation,
    /// The files written by `--dump`.
    pub dumped: Vec<PathBuf>,
}

impl EvalReport {
    /// Main-head next-token loss in nats per token.
    pub fn val_loss(&self) -> f64 {
        self.validation.loss
    }

    /// The validation loss in bits per byte, when the bytes behind the tokens are known.
    pub fn bits_per_byte(&self) -> Option<f64> {
        self.validation.bits_per_byte()
    }
}

/// Errors of [`evaluate`]. The caller names the checkpoint (the CLI's context);
/// each variant names the other files concerned.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("the checkpoint's training data")]
    TrainingData(#[source] DataError),
    #[error("the --data file")]
    DataFile(#[source] DataError),
    #[error(
        "{} is not the data the checkpoint was trained on: it holds {} bytes with sha256 {}…, \
         the checkpoint records {} bytes with sha256 {}… (no file named {} in the working folder \
         or in the checkpoint's folder or those above it holds them); pass --data FILE naming the \
         training data, or --data {} to evaluate on this file on purpose",
        found.source, found.bytes, found.short_sha256(), recorded.bytes, recorded.short_sha256(),
        recorded.source, found.source
    )]
    OtherData { recorded: DataIdentity, found: DataIdentity },
    #[error(
        "{} are not the tokens the checkpoint was trained on: they hash to sha256 {}…, the \
         checkpoint records {} ({} bytes, sha256 {}…); pass --data naming the training shards",
        found.source, found.short_sha256(), recorded.source, recorded.bytes, recorded.short_sha256()
    )]
    OtherTokens { recorded: DataIdentity, found: DataIdentity },
    #[error(
        "this build's {} corpus ({} bytes, sha256 {}…) is not the one the checkpoint was trained on \
         ({} bytes, sha256 {}…); pass --data FILE to evaluate on a text file",
        found.source, found.bytes, found.short_sha256(), recorded.bytes, recorded.short_sha256()
    )]
    SyntheticChanged { recorded: DataIdentity, found: DataIdentity },
    #[error(
        "cannot find {}, the data the checkpoint was trained on: none of {} exists; pass --data FILE \
         naming it (or other data, to evaluate on that on purpose)",
        recorded.describe(),
        tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    DataNotFound { recorded: DataIdentity, tried: Vec<PathBuf> },
    #[error("--batches {batches} is not in 1..={max} (the bound of the spec's train.eval_batches)")]
    Batches { batches: usize, max: usize },
    #[error(
        "{} already holds a dump ({}); pass --force to replace it, or choose another --dump folder",
        dir.display(),
        existing.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    DumpExists { dir: PathBuf, existing: Vec<PathBuf> },
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Params(#[from] ParamError),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Validation(#[from] ValidationError),
    #[error("validation loss of {checkpoint} is {value}: not finite")]
    NonFinite { checkpoint: PathBuf, value: f64 },
    #[error("cannot write {path}: {message}")]
    Write { path: PathBuf, message: String },
}

/// Reads `checkpoint`, rebuilds its model on `device` and evaluates it (see the
/// module doc).
pub fn evaluate(checkpoint: &Path, device: Device, opts: &EvalOptions) -> Result<EvalReport, EvalError> {
    evaluate_with_progress(checkpoint, device, opts, &mut |_, _| {})
}

/// [`evaluate`], calling `progress(done, total)` after each validation batch.
pub fn evaluate_with_progress(
    checkpoint: &Path,
    device: Device,
    opts: &EvalOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EvalReport, EvalError> {
    let batches = match opts.batches {
        Some(b) if !(1..=max_batches()).contains(&b) => {
            return Err(EvalError::Batches { batches: b, max: max_batches() })
        }
        Some(b) => b,
        None => 0,
    };
    // Before the work: a refused dump must not cost an evaluation first.
    if let Some(dir) = &opts.dump {
        check_dump_dir(dir, opts.force)?;
    }
    let ckpt = Checkpoint::read(checkpoint)?;
    let mut spec = ckpt.spec.clone();
    let (batch, seq_len) = (spec.train.batch, spec.train.seq_len);
    let mut notes = Vec::new();
    let corpus = match &opts.data {
        Some(data) => {
            spec.train.data = crate::data::data_from_arg(data);
            let corpus = Corpus::load(&spec).map_err(EvalError::DataFile)?;
            if let Some(recorded) = ckpt.data.as_ref().filter(|r| !r.same_bytes(&corpus.identity())) {
                notes.push(format!(
                    "the --data file {} is not the data the checkpoint was trained on, {}; \
                     the loss is of other data",
                    corpus.identity().describe(),
                    recorded.describe()
                ));
            }
            corpus
        }
        None => training_corpus(&ckpt, &spec, &mut notes)?,
    };
    let lowered = ir::lower::lower(&spec, batch, seq_len)?;
    let mut params = ParamSet::zeros(&lowered.graph)?;
    ckpt.restore_params(&mut params)?;
    let mut exec = device.executor(lowered)?;
    // `--batches` scores that many random windows; without it, what training scored.
    let plan = match batches {
        0 => ValidationPlan::of(&spec.train),
        b => ValidationPlan::Random { batches: b },
    };
    let batches = plan
        .batches(batch, seq_len + 1, corpus.validation(), &corpus.source)
        .map_err(EvalError::TrainingData)?;
    let validation =
        crate::train::validation_loss_with_progress(&spec, exec.as_mut(), &params, &corpus, plan, progress)?;
    if !validation.loss.is_finite() {
        return Err(EvalError::NonFinite { checkpoint: checkpoint.to_path_buf(), value: validation.loss });
    }
    let mut dumped = Vec::new();
    if let Some(dir) = &opts.dump {
        dumped = dump(dir, &ckpt, exec.as_mut(), &params, &corpus)?;
    }
    Ok(EvalReport {
        step: ckpt.state.step,
        data: corpus.identity(),
        trained_on: ckpt.data.clone(),
        notes,
        batches,
        token_shape: exec.token_shape(),
        validation,
        dumped,
    })
}

/// Errors unless `dir` holds none of the [`DUMP_FILES`] or `force` is set.
fn check_dump_dir(dir: &Path, force: bool) -> Result<(), EvalError> {
    if force {
        return Ok(());
    }
    // `symlink_metadata`: a dangling link of a dump file's name would be replaced too.
    let existing: Vec<PathBuf> =
        DUMP_FILES.iter().map(|name| dir.join(name)).filter(|p| p.symlink_metadata().is_ok()).collect();
    if existing.is_empty() {
        return Ok(());
    }
    Err(EvalError::DumpExists { dir: dir.to_path_buf(), existing })
}

/// The checkpoint's own training data, checked against the identity it records
/// (see the module doc for where a relative path is looked up).
fn training_corpus(
    ckpt: &Checkpoint,
    spec: &ModelSpec,
    notes: &mut Vec<String>,
) -> Result<Corpus, EvalError> {
    let window = spec.train.seq_len + 1;
    let fraction = spec.train.val_fraction;
    let Some(recorded) = &ckpt.data else {
        // Written before checkpoints recorded their data: nothing to check against.
        return Corpus::load(spec).map_err(EvalError::TrainingData);
    };
    let path = match &spec.train.data {
        DataSpec::Synthetic(_) => {
            let corpus = Corpus::load(spec).map_err(EvalError::TrainingData)?;
            let found = corpus.identity();
            if !found.same_bytes(recorded) {
                return Err(EvalError::SyntheticChanged { recorded: recorded.clone(), found });
            }
            return Ok(corpus);
        }
        DataSpec::Text(path) => PathBuf::from(path),
        // Shards are found where the spec names them; their content must be the run's.
        DataSpec::Tokens(_) => {
            let corpus = Corpus::load(spec).map_err(EvalError::TrainingData)?;
            let found = corpus.identity();
            if !found.same_bytes(recorded) {
                return Err(EvalError::OtherTokens { recorded: recorded.clone(), found });
            }
            return Ok(corpus);
        }
    };
    let mut seen: Vec<PathBuf> = Vec::new();
    let (mut tried, mut other, mut unreadable) = (Vec::new(), Vec::<DataIdentity>::new(), None);
    for candidate in ckpt.data_path.iter().cloned().chain(data_candidates(&path, &ckpt.path)) {
        // The same file reached twice (the working folder is above the checkpoint) is read once.
        let canonical = std::fs::canonicalize(&candidate).ok();
        if canonical.as_ref().is_some_and(|c| seen.contains(c)) {
            continue;
        }
        seen.extend(canonical);
        match read_text(&candidate) {
            Ok(bytes) => {
                let found = DataIdentity::of(candidate.display().to_string(), &bytes);
                if found.same_bytes(recorded) {
                    for o in &other {
                        notes.push(format!(
                            "{} holds other data than the checkpoint's run trained on; evaluating \
                             {}, which holds the recorded bytes",
                            o.describe(),
                            candidate.display()
                        ));
                    }
                    return Corpus::from_bytes(found.source, bytes, fraction, window)
                        .map_err(EvalError::TrainingData);
                }
                other.push(found);
            }
            Err(DataError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                unreadable.get_or_insert(e);
            }
        }
        tried.push(candidate);
    }
    if let Some(found) = other.into_iter().next() {
        return Err(EvalError::OtherData { recorded: recorded.clone(), found });
    }
    if let Some(e) = unreadable {
        return Err(EvalError::TrainingData(e));
    }
    Err(EvalError::DataNotFound { recorded: recorded.clone(), tried })
}

/// Where a run may have read its data `path` from: the path itself (absolute, or
/// relative to the working folder), then, when relative, joined to the
/// checkpoint's folder and to each folder above it.
fn data_candidates(path: &Path, checkpoint: &Path) -> Vec<PathBuf> {
    let mut out = vec![path.to_path_buf()];
    if path.is_relative() {
        let folder = std::fs::canonicalize(checkpoint).ok().and_then(|c| c.parent().map(Path::to_path_buf));
        if let Some(folder) = folder {
            out.extend(folder.ancestors().map(|a| a.join(path)));
        }
    }
    out
}

/// A tensor of a dump file: name, dtype, shape and little-endian bytes.
type DumpTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// Writes the dump files of the first validation batch into `dir`.
fn dump(
    dir: &Path,
    ckpt: &Checkpoint,
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    corpus: &Corpus,
) -> Result<Vec<PathBuf>, EvalError> {
    let write_err = |path: &Path, message: String| EvalError::Write { path: path.to_path_buf(), message };
    std::fs::create_dir_all(dir).map_err(|e| write_err(dir, e.to_string()))?;
    let [batch, window] = exec.token_shape();
    let tokens = BatchSampler::validation(ckpt.spec.train.seed, batch, window)
        .next_batch(corpus.validation())
        .map_err(EvalError::TrainingData)?;
    let logits = exec.logits(params, &tokens)?;
    let (loss, grads) = exec.loss_and_grads(params, &tokens)?;
    let loss_main = crate::train::next_token_loss(&logits, &tokens, batch, window) as f32;
    let vocab = logits.len() / (batch * (window - 1)).max(1);

    let metadata: HashMap<String, String> = [
        ("checkpoint", ckpt.path.display().to_string()),
        ("step", ckpt.state.step.to_string()),
        ("spec_hash", ckpt.spec_hash.clone()),
        ("device", exec.device().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|x| x.to_le_bytes()).collect();
    let files: Vec<(&str, Vec<DumpTensor>)> = vec![
        (DUMP_FILES[0], vec![("tokens".into(), Dtype::I32, vec![batch, window], token_bytes)]),
        (
            DUMP_FILES[1],
            vec![("logits".into(), Dtype::F32, vec![batch, window - 1, vocab], f32_bytes(&logits))],
        ),
        (
            DUMP_FILES[2],
            vec![
                ("loss".into(), Dtype::F32, vec![], f32_bytes(&[loss])),
                ("loss_main".into(), Dtype::F32, vec![], f32_bytes(&[loss_main])),
            ],
        ),
        (
            DUMP_FILES[3],
            params
                .iter()
                .zip(&grads)
                .map(|(p, g)| (p.name.clone(), Dtype::F32, p.shape.dims().to_vec(), f32_bytes(g)))
                .collect(),
        ),
    ];
    let mut written = Vec::new();
    for (name, tensors) in files {
        let path = dir.join(name);
        let mut views = Vec::with_capacity(tensors.len());
        for (tensor, dtype, shape, bytes) in &tensors {
            let view =
                TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| write_err(&path, e.to_string()))?;
            views.push((tensor.as_str(), view));
        }
        let bytes = safetensors::tensor::serialize(views, &Some(metadata.clone()))
            .map_err(|e| write_err(&path, e.to_string()))?;
        std::fs::write(&path, bytes).map_err(|e| write_err(&path, e.to_string()))?;
        written.push(path);
    }
    Ok(written)
}
