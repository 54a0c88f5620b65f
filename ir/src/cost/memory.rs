//! A closed-form estimate of the memory one training step needs, computed from the
//! spec alone, before any graph is built (README, "What widen guarantees": a spec too large for any machine
//! must be refused before widen allocates for it).
//!
//! Everything else in [`crate::cost`] is counted on the lowered graph; this cannot be,
//! because lowering a spec that is too large is exactly what must not happen. It uses
//! the same parameter shapes as the lowering (and docs/math.md's closed forms of the
//! connection parameters, [`super::paper_figures`]), and the activation convention of
//! the module doc (every stored op output, 4 bytes per element) reduced to dominant
//! terms per token. The test `ir/tests/cost_memory.rs` checks it against the graph's
//! counts for every spec in `specs/`.
//!
//! It is the guard, not the figure shown: once a spec passes it, `widen check`
//! prints the peak counted from the compiled Plan and what the device holds
//! beside it (`runtime::device::memory`, docs/performance.md, "Memory"), which a
//! run's measured peak is held to.
//!
//! All arithmetic is in `f64`: a product of user sizes can only grow to infinity,
//! never wrap or panic, and any comparison with a limit then refuses it.

use serde::Serialize;

use crate::passes::vocab_loss::{CHUNK_ELEMENTS, MAX_CHUNKS};
use crate::spec::{
    Coefficient, CollapseRule, ConnectionSpec, Constraint, Create, DepthWeights, EmbedMode, Entries, FfnSpec,
    Flash, Form, Gate, GenNorm, Generator, History, ModelSpec, MoeBalance, MoeDispatch, Precision, Recompute,
    ReduceNorm, ResidualSpec,
};

/// Bytes per parameter in training: the f32 weight, its gradient and two optimizer
/// moments (AdamW; Muon keeps one momentum for hidden matrices, so this bounds it).
pub const TRAIN_BYTES_PER_PARAM: f64 = 16.0;

/// Bytes per stored activation element (f32; bf16 mode stores some state at 2, which
/// this overestimates).
pub const BYTES_PER_ACTIVATION: f64 = 4.0;

/// The estimate, in parameters and bytes. See the module doc for the conventions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TrainingMemory {
    /// Embedding tables (E, VWN's E_wide or E_base and W_expand).
    pub embedding_params: f64,
    /// Attention and FFN weights of the trunk's blocks.
    pub block_params: f64,
    /// Connection parameters of the residual scheme (trunk and collapse).
    pub connection_params: f64,
    /// Final norm and unembedding.
    pub head_params: f64,
    /// MTP modules (their own blocks, norms and mixing).
    pub mtp_params: f64,
    /// All parameters.
    pub params: f64,
    /// `params` x [`TRAIN_BYTES_PER_PARAM`].
    pub param_bytes: f64,
    /// Stored activations of one step at `train.batch` x `train.seq_len`.
    pub activation_bytes: f64,
    /// `param_bytes + activation_bytes`.
    pub total_bytes: f64,
}

/// One share of the estimate and the spec fields that drive it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryShare {
    /// The field an error points at.
    pub path: &'static str,
    /// What the share is, naming every field that scales it.
    pub what: &'static str,
    pub bytes: f64,
}

impl TrainingMemory {
    /// The shares of `total_bytes`, largest first.
    pub fn shares(&self) -> Vec<MemoryShare> {
        let b = TRAIN_BYTES_PER_PARAM;
        let mut shares = vec![
            MemoryShare {
                path: "vocab",
                what: "embedding and unembedding (vocab x d_model)",
                bytes: (self.embedding_params + self.head_params) * b,
            },
            MemoryShare {
                path: "layers",
                what: "block weights (layers x d_model x heads / ffn width)",
                bytes: self.block_params * b,
            },
            MemoryShare {
                path: "residual",
                what: "connection parameters (residual streams x d_model)",
                bytes: self.connection_params * b,
            },
            MemoryShare { path: "mtp.depth", what: "MTP modules (mtp.depth)", bytes: self.mtp_params * b },
            MemoryShare {
                path: "train.batch",
                what: "activations (train.batch x train.seq_len x layers x width)",
                bytes: self.activation_bytes,
            },
        ];
        // NaN cannot occur (every term is a product of non-negative finite or infinite
        // sizes, and no term multiplies infinity by zero without a zero-sized spec being
        // refused first), but compare totally anyway.
        shares.sort_by(|a, b| b.bytes.total_cmp(&a.bytes));
        shares
    }
}

/// GiB, for messages.
pub fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// The estimate for `spec` at its own `train.batch` and `train.seq_len`.
pub fn training_memory(spec: &ModelSpec) -> TrainingMemory {
    let f = |x: usize| x as f64;
    let (v, d, l) = (f(spec.model_vocab()), f(spec.d_model), f(spec.layers));
    let (h, hkv, dh) = (f(spec.heads), f(spec.kv_heads()), f(spec.head_dim()));
    let tokens = f(spec.train.batch) * f(spec.train.seq_len);

    // Per block: attention (W_q, W_k, W_v, W_o and the norm) and the FFN (docs/math.md §1.3).
    let attention = 2.0 * d * h * dh + 2.0 * d * hkv * dh + d;
    let (ffn, ffn_act) = match &spec.ffn {
        FfnSpec::SwiGlu(s) => {
            let hidden = s.hidden.map(f).unwrap_or_else(|| default_hidden(d));
            (3.0 * d * hidden + d, 4.0 * hidden)
        }
        // Shared experts are one SwiGLU of width shared x hidden. Dense dispatch computes
        // every routed expert on every token; sparse dispatch stores, per routed row
        // (top_k per token), the gathered input, four hidden-wide values and the output
        // gathered back and weighted (docs/math.md §1.6).
        FfnSpec::Moe(m) => {
            // The router, and the router bias of the loss-free balancing (docs/math.md §1.6).
            let router_params = match m.balance {
                MoeBalance::BiasUpdate(_) => (d + 1.0) * f(m.experts),
                MoeBalance::None | MoeBalance::AuxLoss(_) => d * f(m.experts),
            };
            let params = 3.0 * d * (f(m.experts) + f(m.shared)) * f(m.hidden) + router_params + d;
            let router = 2.0 * f(m.experts);
            let shared = 4.0 * f(m.shared) * f(m.hidden);
            let routed = match m.dispatch {
                MoeDispatch::Dense => 4.0 * f(m.experts) * f(m.hidden),
                MoeDispatch::Sparse => f(m.top_k) * (4.0 * f(m.hidden) + 4.0 * d),
            };
            (params, routed + shared + router)
        }
    };
    let block = attention + ffn;

    // Residual-state width per token (elements), the width of one slot of it (the
    // lowering's `layout`), and the embedding shape.
    let (state, slot, embedding) = match &spec.residual {
        ResidualSpec::Residual => (d, d, v * d),
        ResidualSpec::Fc(x) => (d, d / f(x.m.max(1)), v * d),
        ResidualSpec::Hc(x) => (f(x.n) * d, d, v * d),
        ResidualSpec::Mhc(x) => (f(x.n) * d, d, v * d),
        ResidualSpec::Xhc(x) => (f(x.n) * d, d, v * d),
        ResidualSpec::Ghc(g) => {
            let segment = d / f(g.m.max(1));
            let wide = f(g.n) * segment;
            let embedding = match g.embed_mode {
                EmbedMode::Full => v * wide,
                EmbedMode::Expand => v * d + d * wide,
            };
            (wide, segment, embedding)
        }
        ResidualSpec::Connection(c) => {
            let slot = d / f(c.segments.max(1));
            let wide = f(c.streams) * slot;
            let embedding = match c.create {
                Create::Wide(EmbedMode::Full) => v * wide,
                Create::Wide(EmbedMode::Expand) => v * d + d * wide,
                Create::Replicate | Create::Split => v * d,
            };
            (wide, slot, embedding)
        }
    };
    // A depth history's reads (docs/math.md §12.5): parameters and stored values of the
    // trunk's 2L sublayers and of each MTP module's 2.
    let history = |sublayers: usize| match &spec.residual {
        ResidualSpec::Connection(c) => {
            c.history.as_ref().map_or((0.0, 0.0), |h| history_terms(h, state, sublayers))
        }
        _ => (0.0, 0.0),
    };
    let (trunk_history, trunk_history_act) = history(2 * spec.layers);
    let (module_history, module_history_act) = history(2);
    let connection =
        l * connection_params_per_block(spec, state) + collapse_params(spec, state) + trunk_history;
    let head = d + if spec.tie_embeddings { 0.0 } else { v * d };
    // An MTP module: two norms over the state, the per-slot [2W, W] mixing, one block
    // with its connections, its collapse and final norm (docs/math.md §7.1, §5.7).
    let depth = f(spec.mtp.depth);
    let module = 2.0 * state
        + 2.0 * slot * slot
        + block
        + connection_params_per_block(spec, state)
        + collapse_params(spec, state)
        + module_history
        + d;
    let mtp = depth * module;
    let params = embedding + l * block + connection + head + mtp;

    // Activations per token: per block, the attention sublayer's norm, q/k/v, output and
    // projection; the FFN's inner width; and the connection's copies of the state on
    // both sublayers. Then the logits and their softmax on every head.
    let attention_act = 4.0 * d + 2.0 * (h + hkv) * dh;
    // Each sublayer's connection keeps a few copies of the state and, when dynamic,
    // about six intermediates (projection, scale, activation, offset) of every mixing
    // coefficient it generates per token.
    // xHC reads and writes only the k active streams (docs/math.md §6.6).
    let touched = match &spec.residual {
        ResidualSpec::Xhc(x) => f(x.k) * d,
        ResidualSpec::Residual
        | ResidualSpec::Hc(_)
        | ResidualSpec::Fc(_)
        | ResidualSpec::Mhc(_)
        | ResidualSpec::Ghc(_)
        | ResidualSpec::Connection(_) => state,
    };
    let coefficients = coefficients_per_token(spec);
    let sublayers = 2.0 * (l + depth);
    let connection_act = connection_activations(spec, sublayers, state, touched, coefficients);
    let per_block = attention_act + ffn_act + 2.0 * d;
    let heads = 1.0 + depth;
    let per_token =
        (l + depth) * per_block + connection_act + state + trunk_history_act + depth * module_history_act;
    // Each head's logits and their gradient: one chunk of rows at a time where the head's
    // projection and loss fuse (f32, docs/math.md §1.7), every row in bf16 mode.
    let logit_rows = match spec.precision {
        Precision::F32 => vocab_chunk_rows(tokens, v),
        Precision::Bf16 => tokens,
    };
    let logits = heads * 2.0 * logit_rows * v;
    let activation_bytes = (tokens * per_token + logits) * BYTES_PER_ACTIVATION;

    let param_bytes = params * TRAIN_BYTES_PER_PARAM;
    TrainingMemory {
        embedding_params: embedding,
        block_params: l * block,
        connection_params: connection,
        head_params: head,
        mtp_params: mtp,
        params,
        param_bytes,
        activation_bytes,
        total_bytes: param_bytes + activation_bytes,
    }
}

/// The connection's stored activations per token over all `sublayers`
/// (docs/math.md §4.5, "Recompute schedule"). Without recompute each sublayer
/// keeps a few copies of the `touched` state and about six intermediates of
/// every coefficient. With blocks of L_r sublayers (`train.recompute`,
/// `ir::passes::recompute_blocks`) the backward keeps the `state` entering each
/// block and the coefficients' projections, and one block's recomputed values
/// exist at a time, while its backward runs, each sublayer's the paper's
/// (n+2)C (the state, the read and its norm): ⌈L/L_r⌉·state + L·coefficients +
/// L_r·(state + 2·d_model), mHC's nC⌈L/L_r⌉ + (n+2)C·L_r. A plain residual
/// keeps nothing of its connection for the backward beyond the state; the
/// pre-norm the pass recomputes there (d_model per sublayer) is below this
/// estimate's resolution, which leaves it unchanged.
fn connection_activations(
    spec: &ModelSpec,
    sublayers: f64,
    state: f64,
    touched: f64,
    coefficients: f64,
) -> f64 {
    match (spec.train.recompute.block(), &spec.residual) {
        (None, _) | (_, ResidualSpec::Residual) => sublayers * (6.0 * touched + 6.0 * coefficients),
        (Some(l_r), _) => {
            let l_r = (l_r as f64).clamp(1.0, sublayers.max(1.0));
            let transient = state + 2.0 * spec.d_model as f64;
            (sublayers / l_r).ceil() * state + sublayers * coefficients + l_r * transient
        }
    }
}

/// mHC's block size L_r* ≈ √(nL/(n+2)) over the trunk's L = 2·layers
/// sublayers (docs/math.md §4.5), n the streams of the state (the state over
/// `d_model`), at least 1.
pub fn optimal_recompute_block(spec: &ModelSpec) -> usize {
    let n = match &spec.residual {
        ResidualSpec::Residual | ResidualSpec::Fc(_) => 1.0,
        ResidualSpec::Hc(x) => x.n as f64,
        ResidualSpec::Mhc(x) => x.n as f64,
        ResidualSpec::Xhc(x) => x.n as f64,
        ResidualSpec::Ghc(g) => g.n as f64 / g.m.max(1) as f64,
        ResidualSpec::Connection(c) => c.streams as f64 / c.segments.max(1) as f64,
    };
    let sublayers = 2.0 * spec.layers as f64;
    ((n * sublayers / (n + 2.0)).sqrt().round() as usize).clamp(1, (2 * spec.layers).max(1))
}

/// The closed-form activation bytes of `spec` under each recompute choice:
/// none, `Stream`, and `Block(L_r*)` ([`optimal_recompute_block`]), in that
/// order (`widen check` prints them).
pub fn recompute_activations(spec: &ModelSpec) -> Vec<(Recompute, f64)> {
    let best = Recompute::Block(optimal_recompute_block(spec));
    [Recompute::None, Recompute::Stream, best]
        .into_iter()
        .map(|r| {
            let mut s = spec.clone();
            s.train.recompute = r;
            (r, training_memory(&s).activation_bytes)
        })
        .collect()
}

/// `passes::vocab_loss::default_chunk` in `f64`: the rows of one chunk of logits.
fn vocab_chunk_rows(rows: f64, vocab: f64) -> f64 {
    let chunks = (rows * vocab / CHUNK_ELEMENTS as f64).ceil().clamp(1.0, MAX_CHUNKS as f64);
    (rows / chunks).ceil().max(1.0)
}

/// [`FfnSpec::default_hidden`] in `f64`, so a huge `d_model` cannot overflow.
fn default_hidden(d: f64) -> f64 {
    let multiple = if d < 96.0 { 8.0 } else { 256.0 };
    ((8.0 * d / 3.0).ceil() / multiple).ceil() * multiple
}

/// Connection parameters of one block (two sublayers), from docs/math.md's closed forms
/// where they exist, else the dominant projection terms of the lowering.
fn connection_params_per_block(spec: &ModelSpec, state: f64) -> f64 {
    let d = spec.d_model as f64;
    match &spec.residual {
        ResidualSpec::Residual => 0.0,
        ResidualSpec::Hc(x) => {
            let n = x.n as f64;
            2.0 * (2.0 * d + d * (n + 2.0) + n * (n + 2.0) + 2.0)
        }
        ResidualSpec::Fc(x) => {
            let m = x.m.max(1) as f64;
            2.0 * (d / m * (2.0 * m + 2.0) + m * (2.0 * m + 1.0) + 2.0)
        }
        ResidualSpec::Mhc(x) => {
            let n = x.n as f64;
            2.0 * (n * d * (n * n + 2.0 * n) + n * n + 2.0 * n + 3.0)
        }
        ResidualSpec::Ghc(g) => {
            let (m, n) = (g.m.max(1) as f64, g.n as f64);
            2.0 * ((d / m) * (2.0 * m + n + 1.0) + 3.0 * n * (2.0 * m + n))
        }
        // A history of outputs has no fixed state: its sublayers only read (§12.5).
        ResidualSpec::Connection(c) if outputs_only(c) => 0.0,
        ResidualSpec::Connection(c) => 2.0 * connection_terms(c, d).0,
        ResidualSpec::Xhc(x) => {
            // Routing over all N streams, maps over the k active ones with K_r
            // components, the temporal kernels (docs/math.md §6.9), per sublayer.
            let (big_n, k) = (x.n as f64, x.k as f64);
            let k_r = x.conv_kernels.len() as f64 + 1.0;
            let kernels: f64 = x.conv_kernels.iter().map(|&kappa| kappa as f64).sum();
            // xHC-Flash routes once per block or per two blocks (docs/math.md §6.10, §6.11).
            let routings = match x.flash {
                Flash::None => 2.0,
                Flash::Block => 1.0,
                Flash::TwoBlock => 0.5,
            };
            routings * 2.0 * big_n * big_n * d
                + 2.0 * ((k * k * k + k * k * k_r) * d + kernels * d + 2.0 * state)
        }
    }
}

/// Mixing coefficients a sublayer generates per token (dynamic schemes; docs/math.md §2.3,
/// §3, §4.2, §5.5, §6.2).
fn coefficients_per_token(spec: &ModelSpec) -> f64 {
    match &spec.residual {
        ResidualSpec::Residual => 0.0,
        ResidualSpec::Hc(x) => {
            let n = x.n as f64;
            if x.dynamic {
                n * (n + 2.0)
            } else {
                0.0
            }
        }
        ResidualSpec::Fc(x) => {
            let m = x.m as f64;
            if x.dynamic {
                m * (2.0 * m + 1.0)
            } else {
                0.0
            }
        }
        ResidualSpec::Mhc(x) => {
            let n = x.n as f64;
            n * (n + 2.0)
        }
        ResidualSpec::Ghc(g) => {
            let (m, n) = (g.m as f64, g.n as f64);
            if g.dynamic {
                n * (n + 2.0 * m)
            } else {
                0.0
            }
        }
        ResidualSpec::Xhc(x) => {
            let (big_n, k) = (x.n as f64, x.k as f64);
            let k_r = x.conv_kernels.len() as f64 + 1.0;
            2.0 * big_n + k * k + k * k_r
        }
        ResidualSpec::Connection(c) => connection_terms(c, spec.d_model as f64).1,
    }
}

/// Whether a design is a depth history of outputs, which carries no fixed state.
fn outputs_only(c: &ConnectionSpec) -> bool {
    c.history.as_ref().is_some_and(|h| h.entries == Entries::Outputs)
}

/// A depth history's parameters and stored values per token over `sublayers` sublayers
/// (docs/math.md §12.5), for entries `width` wide. Every read has 2·width attention
/// parameters (query and gain) or one static weight per entry it combines; it stores its
/// weighted sum (width) and, with attention, each entry's key once (width).
fn history_terms(h: &History, width: f64, sublayers: usize) -> (f64, f64) {
    let block = h.block.max(1);
    let (dilation, period) = (h.dilation.max(1), h.period.max(1));
    // The sizes of the reads' index sets.
    let reads: Vec<usize> = match h.entries {
        Entries::Outputs => {
            (0..=sublayers).map(|l| 1 + l / block + usize::from(!l.is_multiple_of(block))).collect()
        }
        Entries::States => {
            (1..=sublayers / block).filter(|i| i.is_multiple_of(period)).map(|i| i / dilation + 1).collect()
        }
    };
    let entries = 1.0 + (sublayers / block) as f64;
    match h.weights {
        DepthWeights::Attention => {
            let params = reads.len() as f64 * 2.0 * width;
            (params, reads.len() as f64 * width + entries * width)
        }
        DepthWeights::Static(_) => (reads.iter().sum::<usize>() as f64, reads.len() as f64 * width),
    }
}

/// A connection-language design's parameters per sublayer and the coefficients it
/// generates per token (zero without a generator), from its fields (docs/math.md §12.1).
fn connection_terms(c: &ConnectionSpec, d: f64) -> (f64, f64) {
    let (s, m) = (c.streams as f64, c.segments.max(1) as f64);
    let slot = d / m;
    let entries = |coef: &Coefficient, rows: f64, cols: f64| match (coef.constraint, coef.form) {
        // s! logits; s is at most 6 in a valid spec, and 171! is already past f64.
        (Constraint::Permutations, _) => (1..=c.streams.min(171)).map(|k| k as f64).product(),
        (Constraint::Kronecker, _) => 2.0 * crate::spec::kronecker_factors(c.streams).unwrap_or(0) as f64,
        (_, Form::PerSlot) => s,
        (_, Form::Matrix) => rows * cols,
    };
    // A coefficient with `learned: false` is a constant table, not a parameter (§12.1).
    let trained = |coef: &Coefficient, n: f64| if coef.learned { n } else { 0.0 };
    let (read, carry, write) = (entries(&c.read, m, s), entries(&c.carry, s, s), entries(&c.write, s, m));
    let learned = trained(&c.read, read) + trained(&c.carry, carry) + trained(&c.write, write);
    let all = read + carry + write;
    match &c.generator {
        Generator::None => (learned, 0.0),
        Generator::PerSlot(g) => {
            let norm = match g.norm {
                GenNorm::RmsNorm => slot,
                GenNorm::LayerNorm => 2.0 * slot,
            };
            let columns = m + carry / s + write / s;
            let gates = match g.gate {
                Gate::Paired => 2.0,
                Gate::Entrywise => all,
            };
            (learned + norm + slot * columns + gates, all)
        }
        Generator::Flat(g) => {
            let gain = if g.gain { s * slot } else { 0.0 };
            // One bias holds the three static parts, trained unless all three are fixed.
            let bias = if c.read.learned { all } else { 0.0 };
            (s * slot * all + bias + 3.0 + gain, all)
        }
    }
}

/// Parameters of the collapse before the head (VWN's GroupNorm and W_reduce).
fn collapse_params(spec: &ModelSpec, state: f64) -> f64 {
    let d = spec.d_model as f64;
    match &spec.residual {
        ResidualSpec::Ghc(_) => state * d + 2.0 * state,
        ResidualSpec::Connection(c) => match &c.collapse {
            CollapseRule::Reduce { norm: ReduceNorm::GroupNorm, .. } => state * d + 2.0 * state,
            CollapseRule::Reduce { norm: ReduceNorm::Off, .. } => state * d,
            CollapseRule::Readout(coef) if coef.learned => c.streams as f64,
            CollapseRule::Readout(_) => 0.0,
            CollapseRule::Sum | CollapseRule::Mean | CollapseRule::Concat => 0.0,
        },
        ResidualSpec::Residual
        | ResidualSpec::Hc(_)
        | ResidualSpec::Fc(_)
        | ResidualSpec::Mhc(_)
        | ResidualSpec::Xhc(_) => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::MhcSpec;

    fn mhc(layers: usize, recompute: Recompute) -> ModelSpec {
        let mut spec = ModelSpec {
            residual: ResidualSpec::Mhc(MhcSpec { n: 4, ..MhcSpec::default() }),
            layers,
            ..ModelSpec::default()
        };
        spec.train.recompute = recompute;
        spec
    }

    #[test]
    fn recompute_stores_one_state_per_block_and_one_block_of_intermediates() {
        let none = training_memory(&mhc(8, Recompute::None));
        let spec = mhc(8, Recompute::Stream);
        let (d, n) = (spec.d_model as f64, 4.0);
        let (state, coefficients) = (n * d, n * (n + 2.0));
        let tokens = (spec.train.batch * spec.train.seq_len) as f64;
        // docs/math.md §4.5 over L = 16 sublayers: ⌈L/L_r⌉ states, L coefficient
        // projections and L_r sublayers' (n+2)C instead of every sublayer's copies.
        for l_r in [1usize, 3, 4, 16] {
            let r = if l_r == 1 { Recompute::Stream } else { Recompute::Block(l_r) };
            let with = training_memory(&mhc(8, r));
            let stored =
                (16.0 / l_r as f64).ceil() * state + 16.0 * coefficients + l_r as f64 * (n + 2.0) * d;
            let expected =
                (16.0 * (6.0 * state + 6.0 * coefficients) - stored) * tokens * BYTES_PER_ACTIVATION;
            let saved = none.activation_bytes - with.activation_bytes;
            assert!((saved - expected).abs() < 1e-6 * expected, "L_r = {l_r}: {saved} vs {expected}");
            assert_eq!(with.param_bytes, none.param_bytes);
        }
        // L_r* = round(√(4·16/6)) = 3.
        assert_eq!(optimal_recompute_block(&spec), 3);
        let choices = recompute_activations(&spec);
        assert_eq!(
            choices.iter().map(|c| c.0).collect::<Vec<_>>(),
            [Recompute::None, Recompute::Stream, Recompute::Block(3)]
        );
        assert!(choices[1].1 < choices[0].1 && choices[2].1 < choices[1].1, "{choices:?}");
    }

    #[test]
    fn a_plain_residual_recomputes_nothing() {
        let spec = ModelSpec::default();
        assert_eq!(spec.residual, ResidualSpec::Residual);
        let choices = recompute_activations(&spec);
        assert!(choices.iter().all(|c| c.1 == choices[0].1), "{choices:?}");
    }
}
