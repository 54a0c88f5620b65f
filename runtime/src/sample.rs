//! Text generation from a trained model: greedy, temperature, top-k and top-p (nucleus)
//! sampling over token ids, seeded, with or without a cache (docs/architecture.md §7,
//! "Sampling").
//!
//! The core loop ([`Generator::generate`]) works on token ids `0..spec.vocab`; the logits
//! row is `spec.model_vocab()` long (`vocab_pad_to` pads it), and a padded id is never
//! drawn. Text enters and leaves only through [`encode_prompt`] and [`decode_output`], by
//! the tokenizer the checkpoint records ([`checkpoint_tokenizer`]).
//!
//! The context the model sees is at most the trained `seq_len` tokens: the last
//! `seq_len` of the prompt and the tokens generated so far, placed at positions
//! `0..len`. Past `seq_len` the window slides by one token per generated token, so both
//! paths see exactly the same window:
//!
//! - [`Decoding::Full`] runs the whole `[1, seq_len + 1]` window through a device's
//!   [`StepExecutor::logits`] for every token (the rest of the window is padding, which
//!   causal attention does not let position `len - 1` see);
//! - [`Decoding::Cached`] runs the incremental decoder (`ir::exec::incremental`) on the
//!   host: one whole-window pass over the prompt fills its cache, then each token is one
//!   position; when the window slides, another whole-window pass rebuilds the cache from
//!   the new window (so past `seq_len` every token costs a whole window again).

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::device::Device;
use crate::params::{ParamError, ParamSet};
use crate::rng::Rng;
use crate::step::{StepError, StepExecutor};
use dataset::tokenizer::{Tokenizer, TokenizerError};
use ir::exec::incremental::{DecodeError, Decoder};
use ir::exec::Tensor;
use ir::spec::{ModelSpec, TokenizerSpec};
use std::num::NonZeroUsize;
use std::path::Path;
use std::time::{Duration, Instant};

/// The most tokens one [`Generator::generate`] call produces. Each token is a forward
/// pass of the model, so a larger request is a mistake, not a long run; bounding it keeps
/// a typo such as `--tokens 100000000000000` from aborting on allocation.
pub const MAX_TOKENS: usize = 1 << 20;

/// Sampling knobs. The draw applies the temperature, then keeps the `top_k` most likely
/// tokens, then the smallest most-likely set among those whose probability reaches
/// `top_p`, and draws from what is left, renormalized.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    /// Tokens to generate, at most [`MAX_TOKENS`].
    pub tokens: usize,
    /// Softmax temperature, finite and >= 0; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Keep only the k most likely tokens (None: all), at most the vocabulary.
    pub top_k: Option<NonZeroUsize>,
    /// Nucleus sampling: keep the most likely tokens until their probability reaches p,
    /// in (0, 1] (None: all).
    pub top_p: Option<f64>,
    pub seed: u64,
}

/// How the logits of each next token are computed (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoding {
    /// The incremental decoder on the host, in f32 with the reference executor's ops.
    Cached,
    /// The whole window through this device for every token.
    Full(Device),
}

/// Errors while sampling.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("temperature {0} must be finite and >= 0")]
    Temperature(f64),
    #[error("top_p {0} must be in (0, 1]")]
    TopP(f64),
    #[error("top_k = {top_k} is more than the model's {vocab} tokens; it must be in 1..={vocab}")]
    TopK { top_k: usize, vocab: usize },
    #[error("tokens = {0} is more than the {MAX_TOKENS} tokens one sampling call generates")]
    Tokens(usize),
    #[error("the prompt has no tokens; generation continues at least one")]
    EmptyPrompt,
    #[error("prompt token {id} at index {index} is outside the model's vocabulary 0..{vocab}")]
    PromptToken { id: u32, index: usize, vocab: usize },
    #[error(
        "the checkpoint records no tokenizer and its data names none, so its {vocab} token ids \
         are not text; name one in the spec's Tokens(.., tokenizer: Gpt2) and train, or sample \
         a checkpoint of such a run"
    )]
    NoTokenizer { vocab: usize },
    #[error("the tokenizer {tokenizer} has {tokenizer_vocab} tokens, more than the model's vocab = {vocab}")]
    TokenizerVocab { tokenizer: String, tokenizer_vocab: usize, vocab: usize },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the logits at position {position} hold a non-finite value ({value})")]
    NonFinite { position: usize, value: f32 },
    #[error("the {what} logits hold {got} values, not a multiple of the {expected} per position")]
    LogitsLength { what: &'static str, got: usize, expected: usize },
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Params(#[from] ParamError),
}

/// What one [`Generator::generate`] call produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The generated token ids, each in `0..spec.vocab`.
    pub ids: Vec<u32>,
    /// Wall time of the call: the prompt's forward passes and every generated token's.
    pub elapsed: Duration,
}

impl Generation {
    /// Generated tokens per second of [`Self::elapsed`].
    pub fn tokens_per_second(&self) -> f64 {
        self.ids.len() as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// The tokenizer a checkpoint's ids read through (docs/data.md): the one its header
/// records, else the spec's `Tokens(.., tokenizer: ..)`, else bytes for a model of
/// vocabulary 256 trained on text (every checkpoint written before tokenizers were
/// recorded). Its vocabulary must fit the model's.
pub fn checkpoint_tokenizer(ckpt: &Checkpoint) -> Result<Tokenizer, SampleError> {
    let recorded = ckpt.tokenizer.clone().or_else(|| match &ckpt.spec.train.data {
        ir::spec::DataSpec::Tokens(t) => t.tokenizer.clone(),
        ir::spec::DataSpec::Text(_) | ir::spec::DataSpec::Synthetic(_) => Some(TokenizerSpec::Bytes),
    });
    let Some(spec) = recorded else {
        return Err(SampleError::NoTokenizer { vocab: ckpt.spec.vocab });
    };
    let tokenizer = Tokenizer::load(&spec)?;
    if tokenizer.vocab() > ckpt.spec.vocab {
        return Err(SampleError::TokenizerVocab {
            tokenizer: crate::data::tokenizer_name(&spec),
            tokenizer_vocab: tokenizer.vocab(),
            vocab: ckpt.spec.vocab,
        });
    }
    Ok(tokenizer)
}

/// The prompt's bytes as token ids through `tokenizer` (with [`decode_output`], the one
/// place that knows how text maps to ids). An empty prompt starts from the tokenizer's
/// end-of-text token (GPT-2's `<|endoftext|>`, as unconditional samples do), or a
/// newline where it has none.
pub fn encode_prompt(prompt: &[u8], tokenizer: &Tokenizer) -> Vec<u32> {
    if !prompt.is_empty() {
        return tokenizer.encode(prompt);
    }
    match tokenizer.eot() {
        Some(eot) => vec![eot],
        None => tokenizer.encode(b"\n"),
    }
}

/// Generated token ids as bytes through `tokenizer`: the inverse of [`encode_prompt`].
pub fn decode_output(ids: &[u32], tokenizer: &Tokenizer) -> Result<Vec<u8>, SampleError> {
    Ok(tokenizer.decode(ids)?)
}

/// A checkpoint's spec, parameters and tokenizer; `read` refuses a checkpoint holding a
/// non-finite value, naming the tensor.
pub fn load_checkpoint(checkpoint: &Path) -> Result<(ModelSpec, ParamSet, Tokenizer), SampleError> {
    let ckpt = Checkpoint::read(checkpoint)?;
    let tokenizer = checkpoint_tokenizer(&ckpt)?;
    let lowered = ir::lower::lower(&ckpt.spec, 1, ckpt.spec.train.seq_len)?;
    let mut params = ParamSet::zeros(&lowered.graph)?;
    ckpt.restore_params(&mut params)?;
    Ok((ckpt.spec, params, tokenizer))
}

/// The byte text generated from a checkpoint, and how fast.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub bytes: Vec<u8>,
    pub generation: Generation,
}

/// Loads `checkpoint` (its header carries the spec) and generates after the byte
/// `prompt` with `decoding`.
pub fn sample_checkpoint(
    checkpoint: &Path,
    decoding: Decoding,
    prompt: &[u8],
    opts: &SampleOptions,
) -> Result<Sampled, SampleError> {
    check_options(opts, None)?;
    let (spec, params, tokenizer) = load_checkpoint(checkpoint)?;
    let ids = encode_prompt(prompt, &tokenizer);
    let mut generator = Generator::new(&spec, params, decoding)?;
    let generation = generator.generate(&ids, opts)?;
    Ok(Sampled { bytes: decode_output(&generation.ids, &tokenizer)?, generation })
}

/// Refuses knobs that have no meaning; `vocab` bounds top-k where it is known.
fn check_options(opts: &SampleOptions, vocab: Option<usize>) -> Result<(), SampleError> {
    if !(opts.temperature.is_finite() && opts.temperature >= 0.0) {
        return Err(SampleError::Temperature(opts.temperature));
    }
    if let Some(p) = opts.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(SampleError::TopP(p));
        }
    }
    if opts.tokens > MAX_TOKENS {
        return Err(SampleError::Tokens(opts.tokens));
    }
    if let (Some(k), Some(vocab)) = (opts.top_k, vocab) {
        if k.get() > vocab {
            return Err(SampleError::TopK { top_k: k.get(), vocab });
        }
    }
    Ok(())
}

/// Where the next token's logits come from.
enum Engine {
    Cached {
        decoder: Box<Decoder<f32>>,
        /// The tokens the decoder has been fed since its last reset, and the logits
        /// after the last of them.
        fed: Vec<u32>,
        last: Vec<f32>,
    },
    Full(Box<dyn StepExecutor + Send>),
}

/// A model ready to generate: its spec, its parameters and a [`Decoding`].
pub struct Generator {
    params: ParamSet,
    engine: Engine,
    /// Ids `0..vocab` are tokens; the logits rows are `row` long (padded vocabulary).
    vocab: usize,
    row: usize,
    /// The most positions the model sees: the trained `train.seq_len`.
    seq_len: usize,
}

impl Generator {
    /// Builds the model of `spec` with `params` (the parameters of its training graph,
    /// as a checkpoint holds them) for `decoding`.
    pub fn new(spec: &ModelSpec, params: ParamSet, decoding: Decoding) -> Result<Generator, SampleError> {
        let seq_len = spec.train.seq_len;
        let engine = match decoding {
            Decoding::Cached => {
                let mut decoder = Decoder::<f32>::for_spec(spec)?;
                let wanted: Vec<(String, ir::Shape)> =
                    decoder.params().into_iter().map(|(n, s)| (n.to_string(), s.clone())).collect();
                for (name, shape) in wanted {
                    let p = params.get(&name).ok_or_else(|| DecodeError::Unbound { name: name.clone() })?;
                    if p.shape != shape {
                        return Err(
                            DecodeError::ParamShape { name, got: p.shape.clone(), expected: shape }.into()
                        );
                    }
                    decoder.set_param(&name, Tensor::new(shape, p.value.clone()))?;
                }
                Engine::Cached { decoder: Box::new(decoder), fed: Vec::new(), last: Vec::new() }
            }
            Decoding::Full(device) => Engine::Full(device.executor(ir::lower::lower(spec, 1, seq_len)?)?),
        };
        Ok(Generator { params, engine, vocab: spec.vocab, row: spec.model_vocab(), seq_len })
    }

    /// Generates `opts.tokens` token ids after `prompt` (ids in `0..spec.vocab`, at least
    /// one; only its last `seq_len` are seen). The same seed gives the same tokens on
    /// either [`Decoding`], up to the rounding differences of their arithmetic.
    pub fn generate(&mut self, prompt: &[u32], opts: &SampleOptions) -> Result<Generation, SampleError> {
        check_options(opts, Some(self.vocab))?;
        if prompt.is_empty() {
            return Err(SampleError::EmptyPrompt);
        }
        if let Some((index, &id)) = prompt.iter().enumerate().find(|(_, &id)| id as usize >= self.vocab) {
            return Err(SampleError::PromptToken { id, index, vocab: self.vocab });
        }
        let start = Instant::now();
        let mut rng = Rng::stream(opts.seed, "sample");
        let mut context = prompt.to_vec();
        let mut ids = Vec::with_capacity(opts.tokens);
        for _ in 0..opts.tokens {
            let window = &context[context.len().saturating_sub(self.seq_len)..];
            let row = self.next_logits(window)?;
            let id = pick(&row[..self.vocab], opts, &mut rng);
            ids.push(id as u32);
            context.push(id as u32);
        }
        Ok(Generation { ids, elapsed: start.elapsed() })
    }

    /// The logits row (`row` long) after the last token of `window` (1..=seq_len tokens).
    pub fn next_logits(&mut self, window: &[u32]) -> Result<Vec<f32>, SampleError> {
        let position = window.len() - 1;
        let row = match &mut self.engine {
            Engine::Full(exec) => {
                let mut tokens = vec![0i32; exec.token_shape()[1]];
                tokens.iter_mut().zip(window).for_each(|(t, &id)| *t = id as i32);
                let logits = exec.logits(&self.params, &tokens)?;
                let positions = tokens.len() - 1;
                if logits.len() != positions * self.row {
                    return Err(SampleError::LogitsLength {
                        what: "window",
                        got: logits.len(),
                        expected: self.row,
                    });
                }
                logits[position * self.row..(position + 1) * self.row].to_vec()
            }
            Engine::Cached { decoder, fed, last } => {
                // A window that extends what was fed continues the cache; anything else
                // (the window slid) starts it again.
                let extends = !fed.is_empty() && fed.len() <= window.len() && window[..fed.len()] == fed[..];
                let result = if extends {
                    window[fed.len()..].iter().try_for_each(|&id| {
                        *last = decoder.step(id as i32)?;
                        fed.push(id);
                        Ok::<(), DecodeError>(())
                    })
                } else {
                    // A new context, or the window slid: one whole-window pass refills the cache.
                    fed.clear();
                    let ids: Vec<i32> = window.iter().map(|&id| id as i32).collect();
                    decoder.prefill(&ids).map(|logits| {
                        *last = logits;
                        fed.extend_from_slice(window);
                    })
                };
                if let Err(e) = result {
                    // A failed position leaves some caches a position ahead.
                    decoder.reset();
                    fed.clear();
                    return Err(e.into());
                }
                if last.len() != self.row {
                    return Err(SampleError::LogitsLength {
                        what: "cached",
                        got: last.len(),
                        expected: self.row,
                    });
                }
                last.clone()
            }
        };
        if let Some(&value) = row.iter().find(|v| !v.is_finite()) {
            return Err(SampleError::NonFinite { position, value });
        }
        Ok(row)
    }
}

/// Draws an index of `row` (finite logits): the highest when the temperature is 0,
/// otherwise from softmax(row / temperature) cut to the top k, then to the top p.
fn pick(row: &[f32], opts: &SampleOptions, rng: &mut Rng) -> usize {
    let mut order: Vec<usize> = (0..row.len()).collect();
    // Highest logit first; ties by lowest index, so the draw is deterministic.
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    if opts.temperature == 0.0 {
        return order[0];
    }
    let k = opts.top_k.map_or(row.len(), NonZeroUsize::get).min(row.len());
    let kept = &order[..k];
    let max = f64::from(row[kept[0]]);
    let mut weights: Vec<f64> =
        kept.iter().map(|&i| ((f64::from(row[i]) - max) / opts.temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    if let Some(p) = opts.top_p {
        // The smallest prefix (most likely first) whose probability reaches p; at least one.
        let mut mass = 0.0;
        let cut = weights
            .iter()
            .position(|w| {
                mass += w / total;
                mass >= p
            })
            .map_or(weights.len(), |i| i + 1);
        weights.truncate(cut);
    }
    let total: f64 = weights.iter().sum();
    let mut u = rng.next_f64() * total;
    for (&i, w) in kept.iter().zip(&weights) {
        if u < *w {
            return i;
        }
        u -= w;
    }
    kept[weights.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(temperature: f64, top_k: Option<usize>, top_p: Option<f64>) -> SampleOptions {
        SampleOptions { tokens: 1, temperature, top_k: top_k.and_then(NonZeroUsize::new), top_p, seed: 0 }
    }

    /// Draws from `row` many times and counts how often each index came.
    fn histogram(row: &[f32], o: &SampleOptions) -> Vec<usize> {
        let mut rng = Rng::stream(5, "pick-test");
        let mut counts = vec![0; row.len()];
        for _ in 0..4000 {
            counts[pick(row, o, &mut rng)] += 1;
        }
        counts
    }

    #[test]
    fn top_p_keeps_the_smallest_likely_set_reaching_p() {
        // Probabilities at temperature 1: 0.5, 0.25, 0.125, 0.125.
        let row = [2f32.ln() + 1.0, 1.0, 0.5f32.ln() + 1.0, 0.5f32.ln() + 1.0];
        let counts = histogram(&row, &opts(1.0, None, Some(0.7)));
        assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
        assert_eq!(&counts[2..], [0, 0], "0.5 + 0.25 reaches 0.7: the rest is cut");
        // Renormalized over the two kept: 2/3 and 1/3.
        let share = counts[0] as f64 / 4000.0;
        assert!((share - 2.0 / 3.0).abs() < 0.04, "{share}");
        let counts = histogram(&row, &opts(1.0, None, Some(1.0)));
        assert!(counts.iter().all(|&c| c > 0), "p = 1 keeps every token: {counts:?}");
        let counts = histogram(&row, &opts(1.0, None, Some(1e-9)));
        assert_eq!(counts, [4000, 0, 0, 0], "a tiny p is greedy");
    }

    #[test]
    fn top_k_then_top_p_and_ties_go_to_the_lowest_index() {
        let row = [1.0f32, 3.0, 3.0, 2.0];
        assert_eq!(pick(&row, &opts(0.0, None, None), &mut Rng::stream(0, "t")), 1);
        let counts = histogram(&row, &opts(1.0, Some(3), None));
        assert_eq!(counts[0], 0, "top-3 drops the least likely");
        let counts = histogram(&row, &opts(1.0, Some(1), Some(1.0)));
        assert_eq!(counts, [0, 4000, 0, 0]);
    }

    #[test]
    fn knobs_without_meaning_are_refused() {
        let bad = |o: SampleOptions| check_options(&o, Some(256)).unwrap_err().to_string();
        assert_eq!(bad(opts(-1.0, None, None)), "temperature -1 must be finite and >= 0");
        assert_eq!(bad(opts(1.0, None, Some(0.0))), "top_p 0 must be in (0, 1]");
        assert_eq!(bad(opts(1.0, None, Some(1.5))), "top_p 1.5 must be in (0, 1]");
        assert_eq!(bad(opts(1.0, None, Some(f64::NAN))), "top_p NaN must be in (0, 1]");
        assert_eq!(
            bad(opts(1.0, Some(257), None)),
            "top_k = 257 is more than the model's 256 tokens; it must be in 1..=256"
        );
        assert!(check_options(&opts(1.0, Some(256), Some(1.0)), Some(256)).is_ok());
    }

    #[test]
    fn prompts_and_output_go_through_the_tokenizer() {
        let bytes = Tokenizer::load(&TokenizerSpec::Bytes).unwrap();
        assert_eq!(encode_prompt(b"Hi", &bytes), [72, 105]);
        assert_eq!(encode_prompt(b"", &bytes), [10]);
        assert_eq!(decode_output(&[72, 105], &bytes).unwrap(), b"Hi");
        assert!(decode_output(&[300], &bytes).is_err());
        let gpt2 = Tokenizer::load(&TokenizerSpec::Gpt2).unwrap();
        assert_eq!(encode_prompt(b"Hello world", &gpt2), [15496, 995]);
        // An empty prompt starts from <|endoftext|>, as GPT-2's unconditional samples do.
        assert_eq!(encode_prompt(b"", &gpt2), [50256]);
        assert_eq!(decode_output(&[15496, 995], &gpt2).unwrap(), b"Hello world");
    }
}
