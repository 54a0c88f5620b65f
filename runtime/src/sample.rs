//! Text generation from a trained model: temperature and top-k sampling over
//! bytes, seeded (docs/architecture.md §7).
//!
//! The model graph has a fixed window `[1, seq_len + 1]`. The context (the
//! last `seq_len` bytes generated so far) is placed at positions `0..len` and
//! the rest of the window is padding; attention is causal, so the logits at
//! position `len - 1` do not see the padding.

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::device::Device;
use crate::params::{ParamError, ParamSet};
use crate::rng::Rng;
use crate::step::{StepError, StepExecutor};
use std::path::Path;

/// The most bytes one [`generate`] call produces. Each byte is a forward pass of
/// the model, so a larger request is a mistake, not a long run; bounding it keeps
/// a typo such as `--tokens 100000000000000` from aborting on allocation.
pub const MAX_TOKENS: usize = 1 << 20;

/// Sampling knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// Bytes to generate.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely byte (greedy).
    pub temperature: f64,
    /// Keep only the k most likely bytes (None: all).
    pub top_k: Option<usize>,
    pub seed: u64,
}

/// Errors while sampling.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("temperature {0} must be finite and >= 0")]
    Temperature(f64),
    #[error("tokens = {0} is more than the {MAX_TOKENS} bytes one sampling call generates")]
    Tokens(usize),
    #[error("the model has vocabulary {vocab}; byte-level sampling needs 256")]
    Vocab { vocab: usize },
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Params(#[from] ParamError),
}

/// Loads `checkpoint` (its header carries the spec), rebuilds the model for
/// batch 1 on `device` and generates after `prompt`.
pub fn sample_checkpoint(
    checkpoint: &Path,
    device: Device,
    prompt: &[u8],
    opts: &SampleOptions,
) -> Result<Vec<u8>, SampleError> {
    if opts.tokens > MAX_TOKENS {
        return Err(SampleError::Tokens(opts.tokens));
    }
    // `read` refuses a checkpoint holding a non-finite value, naming the tensor.
    let ckpt = Checkpoint::read(checkpoint)?;
    let spec = &ckpt.spec;
    let lowered = ir::lower::lower(spec, 1, spec.train.seq_len)?;
    let mut params = ParamSet::zeros(&lowered.graph)?;
    ckpt.restore_params(&mut params)?;
    let mut exec = device.executor(lowered)?;
    generate(exec.as_mut(), &params, spec.vocab, prompt, opts)
}

/// Generates `opts.tokens` bytes after `prompt` (an empty prompt starts from a newline).
/// `exec` must be built for batch 1.
pub fn generate(
    exec: &mut dyn StepExecutor,
    params: &ParamSet,
    vocab: usize,
    prompt: &[u8],
    opts: &SampleOptions,
) -> Result<Vec<u8>, SampleError> {
    if !(opts.temperature.is_finite() && opts.temperature >= 0.0) {
        return Err(SampleError::Temperature(opts.temperature));
    }
    if opts.tokens > MAX_TOKENS {
        return Err(SampleError::Tokens(opts.tokens));
    }
    if vocab != 256 {
        return Err(SampleError::Vocab { vocab });
    }
    let window = exec.token_shape()[1];
    let seq_len = window - 1;
    let mut rng = Rng::stream(opts.seed, "sample");
    let mut context: Vec<u8> = if prompt.is_empty() { vec![b'\n'] } else { prompt.to_vec() };
    let mut out = Vec::with_capacity(opts.tokens);
    for _ in 0..opts.tokens {
        let ctx = &context[context.len().saturating_sub(seq_len)..];
        let mut tokens = vec![0i32; window];
        tokens.iter_mut().zip(ctx).for_each(|(t, &b)| *t = i32::from(b));
        let logits = exec.logits(params, &tokens)?;
        let pos = ctx.len() - 1;
        let row = &logits[pos * vocab..(pos + 1) * vocab];
        let byte = pick(row, opts, &mut rng) as u8;
        out.push(byte);
        context.push(byte);
    }
    Ok(out)
}

/// Draws an index from softmax(row / temperature) restricted to the top k.
fn pick(row: &[f32], opts: &SampleOptions, rng: &mut Rng) -> usize {
    let mut order: Vec<usize> = (0..row.len()).collect();
    // Highest logit first; ties by lowest index, so the draw is deterministic.
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    if opts.temperature == 0.0 {
        return order[0];
    }
    let k = opts.top_k.filter(|&k| k > 0).unwrap_or(row.len()).min(row.len());
    let kept = &order[..k];
    let max = f64::from(row[kept[0]]);
    let weights: Vec<f64> =
        kept.iter().map(|&i| ((f64::from(row[i]) - max) / opts.temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_f64() * total;
    for (&i, w) in kept.iter().zip(&weights) {
        if u < *w {
            return i;
        }
        u -= w;
    }
    kept[k - 1]
}
