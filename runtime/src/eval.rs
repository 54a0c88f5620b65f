//! Evaluation of a checkpoint (`widen eval`): the validation loss over the
//! held-out windows training scores, and a dump of one batch's logits, loss and
//! gradients for comparing another implementation with widen's
//! (docs/checkpoints.md describes the files).
//!
//! The model is the one the checkpoint's header holds, rebuilt for its own batch
//! and sequence length; the validation windows are those of
//! [`crate::train::validation_loss`] (the `data.validation` stream of the spec's
//! seed over the tail of the data), so `widen eval` of a run's checkpoint
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

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::data::{BatchSampler, Corpus, DataError, DataIdentity};
use crate::device::Device;
use crate::params::{ParamError, ParamSet};
use crate::step::{StepError, StepExecutor};
use ir::spec::DataSpec;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What to evaluate on and what to write.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalOptions {
    /// A byte-level text file instead of the checkpoint's data.
    pub data: Option<PathBuf>,
    /// Validation batches to average (default: the spec's `eval_batches`).
    pub batches: Option<usize>,
    /// Folder for the dump files (see the module doc).
    pub dump: Option<PathBuf>,
}

/// The result of [`evaluate`].
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// The checkpoint's step.
    pub step: u64,
    /// The data evaluated on.
    pub data: DataIdentity,
    /// Validation batches averaged, and their shape `[batch, seq_len + 1]`.
    pub batches: usize,
    pub token_shape: [usize; 2],
    /// Main-head next-token loss in nats per byte (tokens are bytes).
    pub val_loss: f64,
    /// The files written by `--dump`.
    pub dumped: Vec<PathBuf>,
}

impl EvalReport {
    /// The validation loss in bits per byte.
    pub fn bits_per_byte(&self) -> f64 {
        self.val_loss / std::f64::consts::LN_2
    }
}

/// Errors of [`evaluate`]; each names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("the data of checkpoint {checkpoint}: {source}")]
    Data {
        checkpoint: PathBuf,
        #[source]
        source: DataError,
    },
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Params(#[from] ParamError),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error("validation loss of {checkpoint} is {value}: not finite")]
    NonFinite { checkpoint: PathBuf, value: f64 },
    #[error("cannot write {path}: {message}")]
    Write { path: PathBuf, message: String },
}

/// Reads `checkpoint`, rebuilds its model on `device` and evaluates it (see the
/// module doc).
pub fn evaluate(checkpoint: &Path, device: Device, opts: &EvalOptions) -> Result<EvalReport, EvalError> {
    let ckpt = Checkpoint::read(checkpoint)?;
    let mut spec = ckpt.spec.clone();
    if let Some(data) = &opts.data {
        spec.train.data = DataSpec::Text(data.display().to_string());
    }
    let (batch, seq_len) = (spec.train.batch, spec.train.seq_len);
    let corpus = Corpus::load(&spec.train.data, spec.train.val_fraction, seq_len + 1)
        .map_err(|source| EvalError::Data { checkpoint: checkpoint.to_path_buf(), source })?;
    let lowered = ir::lower::lower(&spec, batch, seq_len)?;
    let mut params = ParamSet::zeros(&lowered.graph)?;
    ckpt.restore_params(&mut params)?;
    let mut exec = device.executor(lowered)?;
    let batches = opts.batches.unwrap_or(spec.train.eval_batches).max(1);
    let val_loss = crate::train::validation_loss(&spec, exec.as_mut(), &params, &corpus, batches)?;
    if !val_loss.is_finite() {
        return Err(EvalError::NonFinite { checkpoint: checkpoint.to_path_buf(), value: val_loss });
    }
    let mut dumped = Vec::new();
    if let Some(dir) = &opts.dump {
        dumped = dump(dir, &ckpt, exec.as_mut(), &params, &corpus)?;
    }
    Ok(EvalReport {
        step: ckpt.state.step,
        data: corpus.identity(),
        batches,
        token_shape: exec.token_shape(),
        val_loss,
        dumped,
    })
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
    let tokens =
        BatchSampler::validation(ckpt.spec.train.seed, batch, window).next_batch(corpus.validation());
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
        ("batch.safetensors", vec![("tokens".into(), Dtype::I32, vec![batch, window], token_bytes)]),
        (
            "logits.safetensors",
            vec![("logits".into(), Dtype::F32, vec![batch, window - 1, vocab], f32_bytes(&logits))],
        ),
        (
            "loss.safetensors",
            vec![
                ("loss".into(), Dtype::F32, vec![], f32_bytes(&[loss])),
                ("loss_main".into(), Dtype::F32, vec![], f32_bytes(&[loss_main])),
            ],
        ),
        (
            "grads.safetensors",
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
