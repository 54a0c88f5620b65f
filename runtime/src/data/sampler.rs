//! The windows a run trains and validates on (docs/data.md, "Order and validation").
//!
//! Training windows come in one of two orders (`train.order`):
//! - `Random`: each window starts at a uniformly random offset drawn from the
//!   `data.train` stream of the run's seed, with replacement;
//! - `Sequential`: consecutive windows in shard order without replacement, each
//!   starting `seq_len` tokens after the last (so every token after the first is a
//!   target exactly once per pass, as modded-nanogpt's loader reads), wrapping to the
//!   start when the next window would pass the end.
//!
//! Either sampler's state is checkpointed ([`SamplerState`]), so a resumed run sees
//! exactly the batches an uninterrupted run would, and it depends on the seed and the
//! step alone, so every sweep point with one seed trains on the same batches.
//!
//! Validation ([`ValidationPlan`]) scores either `eval_batches` random windows from a
//! fresh `data.validation` stream at every evaluation (the same windows each time), or
//! a fixed token budget `train.val_tokens` read in order from the start of the
//! validation split, the number published results report.

use super::{DataError, TokenView};
use crate::rng::Rng;
use ir::spec::{DataOrder, TrainSpec};

/// Where a training sampler stands, as checkpoints record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplerState {
    /// The random stream's state.
    Random([u64; 4]),
    /// The token offset of the next window in the training split.
    Sequential { position: u64 },
}

impl SamplerState {
    /// The order this state belongs to.
    pub fn order(&self) -> DataOrder {
        match self {
            SamplerState::Random(_) => DataOrder::Random,
            SamplerState::Sequential { .. } => DataOrder::Sequential,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Order {
    Random(Rng),
    Sequential(u64),
}

/// Draws batches of windows from a split.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchSampler {
    order: Order,
    batch: usize,
    window: usize,
}

impl BatchSampler {
    /// The training sampler of a run: `train.order` from the start.
    pub fn for_run(train: &TrainSpec, batch: usize, window: usize) -> Self {
        match train.order {
            DataOrder::Random => BatchSampler::train(train.seed, batch, window),
            DataOrder::Sequential => BatchSampler { order: Order::Sequential(0), batch, window },
        }
    }

    /// The random training sampler of a run with `seed`.
    pub fn train(seed: u64, batch: usize, window: usize) -> Self {
        BatchSampler { order: Order::Random(Rng::stream(seed, "data.train")), batch, window }
    }

    /// A random validation sampler, restarted at every evaluation.
    pub fn validation(seed: u64, batch: usize, window: usize) -> Self {
        BatchSampler { order: Order::Random(Rng::stream(seed, "data.validation")), batch, window }
    }

    /// Continues a training sampler from a checkpointed [`BatchSampler::state`].
    pub fn from_state(state: SamplerState, batch: usize, window: usize) -> Self {
        let order = match state {
            SamplerState::Random(words) => Order::Random(Rng::from_state(words)),
            SamplerState::Sequential { position } => Order::Sequential(position),
        };
        BatchSampler { order, batch, window }
    }

    pub fn state(&self) -> SamplerState {
        match &self.order {
            Order::Random(rng) => SamplerState::Random(rng.state()),
            Order::Sequential(position) => SamplerState::Sequential { position: *position },
        }
    }

    /// `batch` windows from `view` (which holds at least one window), row-major
    /// `[batch, window]` token ids, each checked against the vocabulary.
    pub fn next_batch(&mut self, view: TokenView<'_>) -> Result<Vec<i32>, DataError> {
        let len = view.len();
        let window = self.window as u64;
        if len < window {
            return Err(DataError::PastEnd { start: 0, count: window, len });
        }
        let mut out = vec![0i32; self.batch * self.window];
        for row in out.chunks_mut(self.window) {
            let start = match &mut self.order {
                Order::Random(rng) => rng.below(len - window + 1),
                Order::Sequential(position) => {
                    if *position + window > len {
                        *position = 0;
                    }
                    let start = *position;
                    *position += window - 1;
                    start
                }
            };
            view.read(start, row)?;
        }
        Ok(out)
    }
}

/// What one evaluation scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidationPlan {
    /// This many batches of random windows (the same ones at every evaluation).
    Random { batches: usize },
    /// This many tokens in order from the start of the validation split, in whole
    /// batches (the remainder below one batch is not scored).
    Fixed { tokens: usize },
}

impl ValidationPlan {
    /// The spec's: `val_tokens` when set, else `eval_batches` random batches.
    pub fn of(train: &TrainSpec) -> Self {
        match train.val_tokens {
            Some(tokens) => ValidationPlan::Fixed { tokens },
            None => ValidationPlan::Random { batches: train.eval_batches.max(1) },
        }
    }

    /// The batches of `batch` windows of `window` tokens an evaluation scores, checked
    /// against the validation split `view` of `source`.
    pub fn batches(
        &self,
        batch: usize,
        window: usize,
        view: TokenView<'_>,
        source: &str,
    ) -> Result<usize, DataError> {
        match *self {
            ValidationPlan::Random { batches } => Ok(batches.max(1)),
            ValidationPlan::Fixed { tokens } => {
                let seq_len = window - 1;
                let per_batch = batch * seq_len;
                let batches = tokens / per_batch.max(1);
                if batches == 0 {
                    return Err(DataError::ValTokensBelowBatch {
                        val_tokens: tokens,
                        batch,
                        seq_len,
                        needed: per_batch,
                    });
                }
                let needed = (batches * per_batch) as u64 + 1;
                if needed > view.len() {
                    let most = (view.len().saturating_sub(1) / per_batch as u64) * per_batch as u64;
                    return Err(DataError::ValTokensBeyondSplit {
                        val_tokens: tokens,
                        needed,
                        batch,
                        seq_len,
                        source_name: source.to_string(),
                        len: view.len(),
                        most,
                    });
                }
                Ok(batches)
            }
        }
    }

    /// The sampler of one evaluation, for a global batch of `batch` windows.
    pub fn sampler(&self, seed: u64, batch: usize, window: usize) -> BatchSampler {
        match self {
            ValidationPlan::Random { .. } => BatchSampler::validation(seed, batch, window),
            ValidationPlan::Fixed { .. } => BatchSampler { order: Order::Sequential(0), batch, window },
        }
    }
}
