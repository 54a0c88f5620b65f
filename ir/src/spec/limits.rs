//! The valid range of every whole-number field of a spec, in one table.
//!
//! Validation ([`super::validate`]) checks each integer against its row, and the
//! parser ([`super::parse`]) quotes the same row when a value is not a whole number
//! at all (`batch: -4`, `layers: 2.5`, `vocab: 1e99`), so the two can never disagree.
//!
//! Upper bounds exist so that nothing a user types can make widen hang, overflow or
//! allocate without limit (README, "What widen guarantees"). Sizes that only cost memory (`d_model`,
//! `vocab`, `train.batch`, ...) have generous bounds that merely keep later arithmetic
//! in range; what binds them in practice is the training-memory estimate
//! ([`crate::cost::training_memory`]), checked against [`MAX_TRAINING_BYTES`] here and
//! against the machine's memory by [`super::ModelSpec::check_fits`]. Counts that drive
//! loops or unroll the graph (`layers`, `sinkhorn_iters`, `eval_batches`, ...) get
//! bounds far above any published setting, each with its reason below.

/// One integer field's valid range and why the upper bound is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntegerLimit {
    /// RON field path; list items share the list's path (`residual.conv_kernels`).
    pub path: &'static str,
    pub min: u64,
    pub max: u64,
    /// Why values above `max` are refused; quoted in the error.
    pub why: &'static str,
}

/// 2^24: bound of every width. 1000x the widest published transformer (D = 16384 ..
/// 18432); it only keeps products of widths in range before the memory estimate.
pub const MAX_WIDTH: u64 = 1 << 24;

/// Stream counts (HC/mHC/GHC/xHC `n`): the papers use 2..=16; every connection holds
/// n x n maps and the state n copies of the stream.
pub const MAX_STREAMS: u64 = 1024;

/// The hard ceiling of the training-memory estimate: 16 TiB, more than any single
/// machine or accelerator holds, so a spec above it can never run anywhere. Fixed (not
/// the host's memory) so validation and the derive macro stay deterministic; the
/// host-dependent check is [`super::ModelSpec::check_fits`].
pub const MAX_TRAINING_BYTES: u64 = 16 << 40;

/// Longest `name` (it becomes one directory name under `runs/`).
pub const MAX_NAME_LEN: usize = 64;

/// Longest `train.data` text path, in bytes (Linux PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;

/// Most temporal-conv kernels on an xHC sublayer: each adds one augmented component
/// (K_r = len + 1) and one parameter; the paper uses 3.
pub const MAX_CONV_KERNELS: usize = 16;

const WIDTH: &str = "widths above 2^24 exceed any model by 1000x";

/// Every integer field of a spec with its range.
pub const INTEGER_LIMITS: &[IntegerLimit] = &[
    IntegerLimit { path: "vocab", min: 256, max: 1 << 31, why: "token ids are 32-bit integers in the graph" },
    IntegerLimit {
        path: "vocab_pad_to",
        min: 1,
        max: 1 << 16,
        why: "it is an alignment; nanoGPT pads to 64, and 65536 rows of padding would only waste memory",
    },
    IntegerLimit { path: "d_model", min: 1, max: MAX_WIDTH, why: WIDTH },
    IntegerLimit {
        path: "layers",
        min: 1,
        max: 1024,
        why: "the graph unrolls every block; 1024 is 8x the deepest published language model",
    },
    IntegerLimit { path: "heads", min: 1, max: MAX_WIDTH, why: WIDTH },
    IntegerLimit { path: "kv_heads", min: 1, max: MAX_WIDTH, why: WIDTH },
    IntegerLimit { path: "head_dim", min: 2, max: MAX_WIDTH, why: WIDTH },
    IntegerLimit { path: "ffn.hidden", min: 1, max: MAX_WIDTH, why: WIDTH },
    IntegerLimit {
        path: "ffn.experts",
        min: 1,
        max: 4096,
        why: "the router scores every expert per token; 4096 is 16x the largest published MoE",
    },
    IntegerLimit { path: "ffn.top_k", min: 1, max: 4096, why: "it is at most ffn.experts" },
    IntegerLimit {
        path: "ffn.shared",
        min: 0,
        max: 4096,
        why: "shared experts are one SwiGLU of width shared x hidden; 4096 is far past any published model",
    },
    IntegerLimit {
        path: "residual.n",
        min: 1,
        max: MAX_STREAMS,
        why: "connections hold n x n maps; the papers use 2..16 streams",
    },
    IntegerLimit { path: "residual.m", min: 1, max: MAX_STREAMS, why: "it is at most residual.n or d_model" },
    IntegerLimit {
        path: "residual.streams",
        min: 1,
        max: MAX_STREAMS,
        why: "connections hold s x s maps; the papers use 2..16 streams",
    },
    IntegerLimit {
        path: "residual.segments",
        min: 1,
        max: MAX_STREAMS,
        why: "it is at most residual.streams or d_model",
    },
    IntegerLimit {
        path: "residual.history.block",
        min: 1,
        max: 2048,
        why: "an entry holds at most every sublayer of the model (2 x layers)",
    },
    IntegerLimit {
        path: "residual.history.dilation",
        min: 1,
        max: 2048,
        why: "a dilation above the number of entries (2 x layers + 1) reads the newest entry only",
    },
    IntegerLimit {
        path: "residual.history.period",
        min: 1,
        max: 2048,
        why: "a period above the number of entries (2 x layers + 1) never reads",
    },
    IntegerLimit {
        path: "residual.carry.constraint.iters",
        min: 1,
        max: 1000,
        why: "every sublayer runs them on every step; 20 converge (the papers' setting)",
    },
    IntegerLimit { path: "residual.k", min: 1, max: MAX_STREAMS, why: "it is at most residual.n" },
    IntegerLimit { path: "residual.fixed", min: 0, max: MAX_STREAMS, why: "it is at most residual.k" },
    IntegerLimit {
        path: "residual.conv_kernels",
        min: 1,
        max: 1024,
        why: "a temporal kernel spans that many positions; the paper's widest is 12",
    },
    IntegerLimit {
        path: "residual.sinkhorn_iters",
        min: 1,
        max: 1000,
        why: "every sublayer runs them on every step; 20 converge (the papers' setting)",
    },
    IntegerLimit {
        path: "mtp.depth",
        min: 0,
        max: 16,
        why: "each module is one more block and head; DeepSeek-V3 uses 1",
    },
    IntegerLimit { path: "parametrization.base_width", min: 1, max: MAX_WIDTH, why: "it is at most d_model" },
    IntegerLimit {
        path: "train.seq_len",
        min: 2,
        max: 1 << 20,
        why: "attention is quadratic in it; 2^20 tokens is past any context trained from scratch",
    },
    IntegerLimit {
        path: "train.batch",
        min: 1,
        max: 1 << 20,
        why: "2^20 sequences per step is past any published batch",
    },
    IntegerLimit {
        path: "train.steps",
        min: 1,
        max: 100_000_000,
        why: "1e8 steps is 100x the longest published runs; larger counts would never finish",
    },
    IntegerLimit { path: "train.seed", min: 0, max: u64::MAX, why: "it is a 64-bit seed" },
    IntegerLimit {
        path: "train.eval_every",
        min: 1,
        max: 100_000_000,
        why: "it counts steps, which are at most 1e8",
    },
    IntegerLimit {
        path: "train.eval_batches",
        min: 1,
        max: 100_000,
        why: "every evaluation runs them all; 1e5 batches would dwarf the training it measures",
    },
    IntegerLimit {
        path: "train.val_tokens",
        min: 3,
        max: 1 << 40,
        why: "every evaluation reads them all; 2^40 tokens is 100x the largest published corpus",
    },
    IntegerLimit {
        path: "train.checkpoint_every",
        min: 0,
        max: 100_000_000,
        why: "it counts steps, which are at most 1e8",
    },
    IntegerLimit {
        path: "train.recompute",
        min: 1,
        max: 2048,
        why: "it counts sublayers, at most 2 x layers",
    },
    IntegerLimit { path: "train.schedule.warmup", min: 0, max: 100_000_000, why: "it is below train.steps" },
    IntegerLimit {
        path: "train.optimizer.ns_steps",
        min: 1,
        max: 100,
        why: "every hidden matrix runs them on every step; 5 converge (Muon's setting)",
    },
];

/// The row of `path`, if it is an integer field.
pub fn integer_limit(path: &str) -> Option<&'static IntegerLimit> {
    INTEGER_LIMITS.iter().find(|l| l.path == path)
}

impl IntegerLimit {
    /// "a whole number in 1..=1024" (or ">= 0" when unbounded above).
    pub fn describe(&self) -> String {
        if self.max == u64::MAX {
            format!("a whole number >= {}", self.min)
        } else {
            format!("a whole number in {}..={}", self.min, self.max)
        }
    }
}

/// The path of every integer field `spec` holds (list items as `path[i]`), in field
/// order; each has a row in [`INTEGER_LIMITS`] (checked by `ir/tests/spec_limits.rs`).
pub fn integer_paths(spec: &super::ModelSpec) -> Vec<String> {
    spec.integer_fields().into_iter().map(|(path, _)| path).collect()
}
