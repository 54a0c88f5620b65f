//! The model spec: everything a user says about a model (docs/math.md §10).
//!
//! A RON file holds one `Model(...)`; every field has a documented default so
//! a minimal spec is a few lines. The derive macro builds the same
//! [`ModelSpec`] and runs the same [`ModelSpec::validate`].
//!
//! Fields that default to a value computed from other fields (`kv_heads`,
//! `head_dim`, the SwiGLU hidden width, GHC's `tau` and `reduce_norm`, xHC's
//! `gram_schmidt`) are `Option`s; use the resolving accessors
//! ([`ModelSpec::kv_heads`], [`ModelSpec::head_dim`], ...) rather than the raw field.

mod connection;
mod fits;
pub mod limits;
mod names;
mod parse;
pub mod reference;
mod ron_tree;
mod validate;
mod virtual_width;

pub use connection::{
    kronecker_factors, CoefInit, Coefficient, CollapseRule, ConnectionSpec, Constraint, Create, DepthInit,
    DepthWeights, Entries, FlatGenerator, Form, Gate, Generator, History, PerSlotGenerator,
    MAX_PERMUTATION_STREAMS,
};
pub use fits::host_memory_bytes;
pub use names::{field_paths, path_hint, similar_paths, UnknownName};
pub use parse::{load_spec, parse_spec, SpecLoadError};
pub use validate::FieldError;
pub use virtual_width::VirtualWidth;

use serde::{Deserialize, Serialize};

/// Edit distance between two names, counting insertions, deletions, substitutions and
/// swaps of two adjacent characters (optimal string alignment), so the common
/// `dpeth` typo is one edit from `depth`. Every "did you mean" suggestion (spec
/// files and the derive's attributes) ranks names by it.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// A whole model: backbone, residual-stream scheme, MTP, parametrization, training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename = "Model")]
pub struct ModelSpec {
    /// Name of reports and of the run's folder under `runs/`: 1..=64 characters from
    /// `A-Za-z0-9._-`, not `.` or `..` (one safe path component).
    pub name: String,
    /// Vocabulary size V: the tokenizer's, every token id lies in `0..vocab` [>= 256 to
    /// train on bytes; >= 2 for a graph].
    pub vocab: usize,
    /// Pad the embedding and output rows up to a multiple of this (nanoGPT pads GPT-2's
    /// 50257 to 50304 = 64 x 786) for aligned matmuls; the padded rows are never a
    /// target and never sampled. `None` (the default): no padding (docs/data.md).
    pub vocab_pad_to: Option<usize>,
    /// Backbone width D (= C) [>= 1].
    pub d_model: usize,
    /// Transformer blocks L [>= 1]; each has two sublayers (attention, FFN).
    pub layers: usize,
    /// Query heads H [>= 1].
    pub heads: usize,
    /// Key/value heads H_kv (GQA) [1 <= H_kv <= H, H % H_kv == 0]; default H.
    pub kv_heads: Option<usize>,
    /// Head dimension d_h [even, for RoPE]; default D / H.
    pub head_dim: Option<usize>,
    /// Feed-forward sublayer.
    pub ffn: FfnSpec,
    /// RMSNorm epsilon (> 0); default 1e-5.
    pub norm_eps: f64,
    /// RoPE base (> 0); default 10000 (docs/math.md §1.2).
    pub rope_base: f64,
    /// Tie the unembedding to the embedding (U = E^T); default false (docs/math.md §10 (D)).
    pub tie_embeddings: bool,
    /// Standard-parametrization init std (> 0); default 0.02 (docs/math.md §1.2).
    pub init_std: f64,
    /// Depth-scale the output projections W_o, W_2 by 1/sqrt(2L) (docs/math.md §1.2); default true.
    pub out_proj_depth_scaled: bool,
    /// The residual-stream scheme.
    pub residual: ResidualSpec,
    /// Multi-token prediction (docs/math.md §7).
    pub mtp: MtpSpec,
    /// Standard or muP (docs/math.md §8.1).
    pub parametrization: Parametrization,
    /// Numeric precision of the residual state and matmul operands (docs/math.md §6.12).
    pub precision: Precision,
    /// Training configuration.
    pub train: TrainSpec,
}

impl ModelSpec {
    /// The rows of the embedding and the output layer: `vocab` rounded up to a multiple
    /// of `vocab_pad_to` (docs/data.md). Every shape uses this; token checks use `vocab`.
    pub fn model_vocab(&self) -> usize {
        match self.vocab_pad_to {
            Some(m) if m > 1 => self.vocab.div_ceil(m).saturating_mul(m),
            _ => self.vocab,
        }
    }
}

impl Default for ModelSpec {
    fn default() -> Self {
        ModelSpec {
            name: "model".into(),
            vocab: 256,
            vocab_pad_to: None,
            d_model: 64,
            layers: 2,
            heads: 4,
            kv_heads: None,
            head_dim: None,
            ffn: FfnSpec::default(),
            norm_eps: 1e-5,
            rope_base: 10000.0,
            tie_embeddings: false,
            init_std: 0.02,
            out_proj_depth_scaled: true,
            residual: ResidualSpec::Residual,
            mtp: MtpSpec::default(),
            parametrization: Parametrization::Standard,
            precision: Precision::F32,
            train: TrainSpec::default(),
        }
    }
}

impl ModelSpec {
    /// Key/value heads, defaulting to the query heads (plain multi-head attention).
    pub fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// Head dimension, defaulting to D / H.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model.checked_div(self.heads).unwrap_or(0))
    }

    /// Number of sublayers 2L (docs/math.md §0.1: every HC-family paper counts a sublayer as a layer).
    pub fn sublayers(&self) -> usize {
        2 * self.layers
    }

    /// The same spec with a plain residual: the baseline every overhead is measured against.
    pub fn with_plain_residual(&self) -> ModelSpec {
        let mut s = self.clone();
        s.residual = ResidualSpec::Residual;
        s
    }
}

/// The feed-forward sublayer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FfnSpec {
    /// SwiGLU: (silu(x W_1) * (x W_3)) W_2 (docs/math.md §1.3).
    SwiGlu(SwiGluSpec),
    /// Mixture of experts: top-k routed SwiGLU experts plus always-on shared experts.
    Moe(MoeSpec),
}

impl Default for FfnSpec {
    fn default() -> Self {
        FfnSpec::SwiGlu(SwiGluSpec::default())
    }
}

impl FfnSpec {
    /// The SwiGLU inner width F. Default round_up(8D/3, 256) (Llama convention, docs/math.md §1.2),
    /// except that for D < 96 it is round_up(8D/3, 8), so tiny models stay tiny.
    pub fn default_hidden(d_model: usize) -> usize {
        let raw = (8 * d_model).div_ceil(3);
        let multiple = if d_model < 96 { 8 } else { 256 };
        raw.div_ceil(multiple) * multiple
    }
}

/// SwiGLU knobs.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwiGluSpec {
    /// Inner width F [>= 1]; default [`FfnSpec::default_hidden`].
    pub hidden: Option<usize>,
}

/// Mixture-of-experts knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MoeSpec {
    /// Routed experts E [>= 1].
    pub experts: usize,
    /// Experts active per token [1 <= top_k <= experts].
    pub top_k: usize,
    /// Always-active shared experts [>= 0].
    pub shared: usize,
    /// Inner width of each expert [>= 1].
    pub hidden: usize,
    /// Gate function over the routed experts' scores.
    pub gate: MoeGate,
    /// How routed tokens reach their experts (docs/math.md §1.6).
    pub dispatch: MoeDispatch,
    /// Per-expert capacity as a multiple of the even share, ceil(factor · tokens · top_k /
    /// experts) rows per step; assignments past it are dropped, first come first served in
    /// token order [> 0; needs dispatch: Sparse]. None: dropless.
    pub capacity_factor: Option<f64>,
    /// How the router's load is kept balanced across the routed experts (docs/math.md §1.6):
    /// None, an auxiliary loss, or DeepSeek-V3's loss-free bias update. Default None, so a
    /// spec without the field trains as it did before the field existed.
    pub balance: MoeBalance,
    /// Divide each token's kept top_k gates by their sum, so they add up to 1 (DeepSeek-V3's
    /// sigmoid gates, Mixtral's top-k softmax; docs/math.md §1.6). Default false: the kept
    /// gates as the gate function gives them.
    pub renormalize: bool,
}

impl Default for MoeSpec {
    fn default() -> Self {
        MoeSpec {
            experts: 8,
            top_k: 2,
            shared: 1,
            hidden: 128,
            gate: MoeGate::Softmax,
            dispatch: MoeDispatch::Sparse,
            capacity_factor: None,
            balance: MoeBalance::None,
            renormalize: false,
        }
    }
}

impl MoeSpec {
    /// The rows each expert keeps per step of `tokens` tokens (docs/math.md §1.6):
    /// ceil(capacity_factor · tokens · top_k / experts), at least 1; None when dropless.
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        let factor = self.capacity_factor?;
        let share = factor * (tokens * self.top_k) as f64 / self.experts.max(1) as f64;
        Some((share.ceil() as usize).max(1))
    }
}

/// How the MoE sublayer runs its routed experts (docs/math.md §1.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeDispatch {
    /// Every expert on every token, masked by the gates: experts / top_k times the routed
    /// work (the test oracle of Sparse; no capacity).
    Dense,
    /// Tokens permuted into per-expert groups and multiplied by a grouped matrix product:
    /// only the routed work runs, on every device. The default.
    Sparse,
}

/// Load balancing of the MoE router (docs/math.md §1.6, "Load balancing").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MoeBalance {
    /// No balancing: the router learns from the language-model loss alone.
    None,
    /// The Switch / DeepSeekMoE auxiliary loss coef · E · Σ_e f_e · P_e, added to the
    /// differentiated objective of every MoE layer and reported as `moe_aux_loss`.
    AuxLoss(AuxLossSpec),
    /// DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias, added to the scores
    /// for the top-k choice only, moves by `rate` after every step toward the even load.
    BiasUpdate(BiasUpdateSpec),
}

/// The auxiliary balance loss (docs/math.md §1.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuxLossSpec {
    /// Weight α of the loss, which is α at an even load [> 0, finite]; default 0.01 (the
    /// Switch Transformer's).
    pub coef: f64,
    /// Over what the loads and gate shares are taken: `Batch` (Switch, DeepSeekMoE: the
    /// step's tokens together) or `Sequence` (DeepSeek-V3's sequence-wise form: each
    /// sequence's own, the losses averaged over the sequences); default Batch.
    pub per: AuxLossScope,
}

impl Default for AuxLossSpec {
    fn default() -> Self {
        AuxLossSpec { coef: 0.01, per: AuxLossScope::Batch }
    }
}

/// Over which tokens the auxiliary balance loss measures the load (docs/math.md §1.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum AuxLossScope {
    /// All the tokens of the step (one rank's batch) together.
    #[default]
    Batch,
    /// Each sequence alone, the per-sequence losses averaged.
    Sequence,
}

/// The loss-free bias update (docs/math.md §1.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BiasUpdateSpec {
    /// Step γ of the bias per training step, b_e += γ · sign(mean load − load_e)
    /// [> 0, finite]; default 0.001 (DeepSeek-V3's).
    pub rate: f64,
    /// Weight α of DeepSeek-V3's complementary sequence-wise balance loss (an `AuxLoss`
    /// with `per: Sequence`) added beside the bias [≥ 0, finite]; default 0, none.
    /// DeepSeek-V3 uses 0.0001.
    pub seq_aux_coef: f64,
}

impl Default for BiasUpdateSpec {
    fn default() -> Self {
        BiasUpdateSpec { rate: 1e-3, seq_aux_coef: 0.0 }
    }
}

impl MoeBalance {
    /// The auxiliary balance loss this setting adds to the objective, if any: `AuxLoss`'s,
    /// or the sequence-wise one beside `BiasUpdate`.
    pub fn aux_loss(&self) -> Option<AuxLossSpec> {
        match self {
            MoeBalance::None => None,
            MoeBalance::AuxLoss(a) => Some(a.clone()),
            MoeBalance::BiasUpdate(b) => (b.seq_aux_coef != 0.0)
                .then_some(AuxLossSpec { coef: b.seq_aux_coef, per: AuxLossScope::Sequence }),
        }
    }
}

/// How the MoE router turns scores into gates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeGate {
    /// Softmax over all experts, then keep the top-k weights (unrenormalized).
    Softmax,
    /// Independent sigmoids (DeepSeek-V3 style), top-k kept.
    Sigmoid,
}

/// The residual-stream scheme (docs/math.md §0.3 unified Read / Carry / Write form).
// A spec is built once per run and copied rarely, so the written-out `Connection` variant's
// size costs nothing worth a box (which would show in every match and constructor).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub enum ResidualSpec {
    /// Plain pre-norm residual (docs/math.md §1).
    #[default]
    Residual,
    /// Hyper-connections, n streams (docs/math.md §2).
    Hc(HcSpec),
    /// Frac-connections, frac-rate m (docs/math.md §3).
    Fc(FcSpec),
    /// Manifold-constrained hyper-connections (docs/math.md §4).
    Mhc(MhcSpec),
    /// Generalized hyper-connections / Virtual Width Networks (docs/math.md §5).
    Ghc(GhcSpec),
    /// Expanded hyper-connections (docs/math.md §6).
    Xhc(XhcSpec),
    /// A design written in the connection language (docs/connections.md, docs/math.md §12).
    Connection(ConnectionSpec),
}

impl ResidualSpec {
    /// The spec keyword, as written in RON.
    pub fn kind_name(&self) -> &'static str {
        match self {
            ResidualSpec::Residual => "Residual",
            ResidualSpec::Hc(_) => "Hc",
            ResidualSpec::Fc(_) => "Fc",
            ResidualSpec::Mhc(_) => "Mhc",
            ResidualSpec::Ghc(_) => "Ghc",
            ResidualSpec::Xhc(_) => "Xhc",
            ResidualSpec::Connection(_) => "Connection",
        }
    }

    /// The design in the connection language: HC, FC, mHC and GHC written out
    /// (docs/connections.md), a `Connection` as given; None for the plain residual and xHC,
    /// which the language does not carry (docs/math.md §12.4).
    pub fn connection(&self) -> Option<ConnectionSpec> {
        match self {
            ResidualSpec::Hc(hc) => Some(ConnectionSpec::hc(hc)),
            ResidualSpec::Fc(fc) => Some(ConnectionSpec::fc(fc)),
            ResidualSpec::Mhc(mhc) => Some(ConnectionSpec::mhc(mhc)),
            ResidualSpec::Ghc(ghc) => Some(ConnectionSpec::ghc(ghc)),
            ResidualSpec::Connection(c) => Some(c.clone()),
            ResidualSpec::Residual | ResidualSpec::Xhc(_) => None,
        }
    }
}

/// Elementwise activation used by HC/FC dynamic coefficient generation (docs/math.md §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GateAct {
    Tanh,
    /// The paper's "W/O tanh" variant.
    Identity,
}

/// Norm applied to each stream before HC dynamic coefficient generation (docs/math.md §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GenNorm {
    /// HC Alg. 2 (the paper).
    LayerNorm,
    /// mHC's recap of HC and lucidrains.
    RmsNorm,
}

/// HC output-projection init multiplier (docs/math.md §2.4 DECISION: divide by sqrt(n)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutProjStdMult {
    One,
    InvSqrtN,
    SqrtN,
}

/// Hyper-connections (docs/math.md §2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HcSpec {
    /// Streams n [>= 1]; default 4.
    pub n: usize,
    /// Dynamic (DHC) coefficients; default true.
    pub dynamic: bool,
    /// Activation on the dynamic projections; default tanh.
    pub act: GateAct,
    /// Per-stream norm before the dynamic projections; default LayerNorm (the paper).
    pub gen_norm: GenNorm,
    /// s_alpha = s_beta init (finite); default 0.01.
    pub scale_init: f64,
    /// Output-projection init multiplier; default 1/sqrt(n) (docs/math.md §2.4 DECISION).
    pub out_proj_std_mult: OutProjStdMult,
}

impl Default for HcSpec {
    fn default() -> Self {
        HcSpec {
            n: 4,
            dynamic: true,
            act: GateAct::Tanh,
            gen_norm: GenNorm::LayerNorm,
            scale_init: 0.01,
            out_proj_std_mult: OutProjStdMult::InvSqrtN,
        }
    }
}

/// Frac-connections (docs/math.md §3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FcSpec {
    /// Frac-rate m [>= 1, D % m == 0]; default 4.
    pub m: usize,
    /// Dynamic (DFC) coefficients; default true.
    pub dynamic: bool,
    /// Activation on the dynamic projections; default tanh.
    pub act: GateAct,
    /// s_alpha = s_beta init; default 0.01.
    pub scale_init: f64,
}

impl Default for FcSpec {
    fn default() -> Self {
        FcSpec { m: 4, dynamic: true, act: GateAct::Tanh, scale_init: 0.01 }
    }
}

/// mHC static-bias init (docs/math.md §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MhcBiasInit {
    /// b_pre = +3 home / -3 elsewhere, b_post = 0, b_res = 6I - 3 (DECISION, convention 1).
    SingleStream,
    /// All biases zero (the "historical" convention).
    Zero,
}

/// Init of connection projections (mHC phi, docs/math.md §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProjInit {
    Zero,
    Xavier,
}

/// How the streams are collapsed before the final norm (docs/math.md §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Collapse {
    Sum,
    Mean,
}

/// Manifold-constrained hyper-connections (docs/math.md §4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MhcSpec {
    /// Streams n [>= 1]; default 4.
    pub n: usize,
    /// Sinkhorn iterations t_max [>= 1]; default 20.
    pub sinkhorn_iters: usize,
    /// Guard added to Sinkhorn row/column sums [>= 0]; default 0 (the paper's exact form).
    pub sinkhorn_eps: f64,
    /// Added to H_pre to keep reads strictly positive [>= 0]; default 0 (paper).
    pub pre_eps: f64,
    /// Upper bound of the write gate, H_post = post_max * sigmoid (> 0); default 2.
    pub post_max: f64,
    /// alpha_pre = alpha_post = alpha_res init; default 0.01 (paper Table 5).
    pub alpha_init: f64,
    /// Static-bias init; default single-stream.
    pub bias_init: MhcBiasInit,
    /// Projection init; default zero.
    pub proj_init: ProjInit,
    /// Collapse before the head; default sum.
    pub collapse: Collapse,
}

impl Default for MhcSpec {
    fn default() -> Self {
        MhcSpec {
            n: 4,
            sinkhorn_iters: 20,
            sinkhorn_eps: 0.0,
            pre_eps: 0.0,
            post_max: 2.0,
            alpha_init: 0.01,
            bias_init: MhcBiasInit::SingleStream,
            proj_init: ProjInit::Zero,
            collapse: Collapse::Sum,
        }
    }
}

/// VWN over-width embedding (docs/math.md §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EmbedMode {
    /// E_wide in R^{V x D'}.
    Full,
    /// E_base W_expand, E_base in R^{V x D}, W_expand in R^{D x D'}.
    Expand,
}

/// Norm before W_reduce (docs/math.md §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReduceNorm {
    /// GroupNorm with group size D (r groups over D'); requires n % m == 0.
    GroupNorm,
    /// No norm (the paper's 1.5x runs). Named `Off` so that `reduce_norm: None`
    /// keeps meaning "the default".
    Off,
}

/// W_reduce init (docs/math.md §5.6 DECISION).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReduceInit {
    /// [I_D | 0]: reads the first m slots, equivalent to the baseline at init.
    BlockIdentity,
    /// N(0, 1/D').
    Normal,
}

/// Generalized hyper-connections / Virtual Width Networks (docs/math.md §5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GhcSpec {
    /// Fraction rate m [>= 1, D % m == 0]: backbone segments of width d_b = D/m. Default 4.
    pub m: usize,
    /// Over-width slots n [>= m]; r = n/m, D' = n*d_b. Default 16 (r = 4).
    pub n: usize,
    /// Dynamic (DGHC) coefficients; default true.
    pub dynamic: bool,
    /// Temperature tau (> 0); default sqrt(d_b) (docs/math.md §5.5).
    pub tau: Option<f64>,
    /// S_alpha, S_beta init; default 1.
    pub s_init: f64,
    /// Over-width embedding form; default full.
    pub embed_mode: EmbedMode,
    /// Norm before W_reduce; default GroupNorm when n % m == 0 and r >= 2, else off.
    pub reduce_norm: Option<ReduceNorm>,
    /// W_reduce init; default block identity.
    pub reduce_init: ReduceInit,
}

impl Default for GhcSpec {
    fn default() -> Self {
        GhcSpec {
            m: 4,
            n: 16,
            dynamic: true,
            tau: None,
            s_init: 1.0,
            embed_mode: EmbedMode::Full,
            reduce_norm: None,
            reduce_init: ReduceInit::BlockIdentity,
        }
    }
}

impl GhcSpec {
    /// Segment width d_b = D/m.
    pub fn segment_width(&self, d_model: usize) -> usize {
        d_model / self.m.max(1)
    }

    /// Temperature, defaulting to sqrt(d_b) (docs/math.md §5.5).
    pub fn tau(&self, d_model: usize) -> f64 {
        self.tau.unwrap_or((self.segment_width(d_model) as f64).sqrt())
    }

    /// The reduce norm, defaulting to GroupNorm when r is an integer >= 2 (docs/math.md §5.2 DECISION).
    pub fn reduce_norm(&self) -> ReduceNorm {
        self.reduce_norm.unwrap_or(if self.n.is_multiple_of(self.m.max(1)) && self.n >= 2 * self.m {
            ReduceNorm::GroupNorm
        } else {
            ReduceNorm::Off
        })
    }
}

/// xHC router gate (docs/math.md §6.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Router {
    Sigmoid,
    Softmax,
}

/// xHC-Flash sharing (docs/math.md §6.10, §6.11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Flash {
    /// Full xHC: routing and maps per sublayer.
    None,
    /// xHC-Flash: one routing decision per block.
    Block,
    /// xHC-Flash-4sub: one routing decision per two blocks.
    TwoBlock,
}

/// Which sublayers get temporal feature augmentation (docs/math.md §6.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AugSublayers {
    /// The paper's default.
    Mlp,
    MlpAndAttention,
}

/// Expanded hyper-connections (docs/math.md §6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct XhcSpec {
    /// Total streams N [>= 1]; default 16.
    pub n: usize,
    /// Active streams k [1 <= k <= N]; default 4.
    pub k: usize,
    /// Fixed streams m_f [0 <= fixed <= k]; default 2.
    pub fixed: usize,
    /// Temporal conv kernel sizes [each >= 1]; K_r = len + 1 on augmented sublayers. Default [4, 8, 12].
    pub conv_kernels: Vec<usize>,
    /// Sublayers with temporal augmentation; default MLP only.
    pub temporal_aug: AugSublayers,
    /// Gram-Schmidt on the augmented components; default true with AdamW, false with Muon (§8.2).
    pub gram_schmidt: Option<bool>,
    /// Relative Gram-Schmidt guard (docs/math.md §6.5 DECISION); default 1e-6.
    pub gs_eps: f64,
    /// Router gate; default sigmoid.
    pub router: Router,
    /// Sinkhorn iterations over the active set [>= 1]; default 20.
    pub sinkhorn_iters: usize,
    /// Row clamp after Sinkhorn (docs/math.md §6.4); default true.
    pub row_clamp: bool,
    /// alpha init; default 0.01.
    pub alpha_init: f64,
    /// Flash variant; default none.
    pub flash: Flash,
}

impl Default for XhcSpec {
    fn default() -> Self {
        XhcSpec {
            n: 16,
            k: 4,
            fixed: 2,
            conv_kernels: vec![4, 8, 12],
            temporal_aug: AugSublayers::Mlp,
            gram_schmidt: None,
            gs_eps: 1e-6,
            router: Router::Sigmoid,
            sinkhorn_iters: 20,
            row_clamp: true,
            alpha_init: 0.01,
            flash: Flash::None,
        }
    }
}

/// Order of the MTP concatenation (docs/math.md §7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConcatOrder {
    /// [h; e], the paper's order (DECISION).
    HiddenFirst,
    /// [e; h], vLLM's order.
    EmbFirst,
}

/// Multi-token prediction (docs/math.md §7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MtpSpec {
    /// Number of MTP modules K [>= 0]. docs/math.md §10 lists the papers' default of 1
    /// (DeepSeek-V3); widen defaults to 0 so that a spec without an `mtp` field is a
    /// plain next-token model, and `mtp: (depth: 1)` opts in.
    pub depth: usize,
    /// Loss weight lambda [>= 0]; L = L_main + lambda/K * sum_k L^k. Default 0.3.
    pub lambda: f64,
    /// Concatenation order of hidden and embedding; default hidden first.
    pub concat_order: ConcatOrder,
}

impl Default for MtpSpec {
    fn default() -> Self {
        MtpSpec { depth: 0, lambda: 0.3, concat_order: ConcatOrder::HiddenFirst }
    }
}

/// Standard parametrization or muP (docs/math.md §8.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub enum Parametrization {
    #[default]
    Standard,
    MuP(MupSpec),
}

/// muP knobs (docs/math.md §8.1, §10).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MupSpec {
    /// Base width D_base the hyper-parameters were tuned at [>= 1, <= d_model]. Default 64.
    pub base_width: usize,
    /// Readout output multiplier (> 0); default 1.
    pub output_mult: f64,
    /// Attention logit multiplier alpha_attn (logits scaled by alpha_attn / d_h) (> 0); default 8.
    pub attn_mult: f64,
    /// Zero-initialize the readout; default false.
    pub readout_zero_init: bool,
}

impl Default for MupSpec {
    fn default() -> Self {
        MupSpec { base_width: 64, output_mult: 1.0, attn_mult: 8.0, readout_zero_init: false }
    }
}

/// Numeric precision (docs/math.md §6.12). Norm statistics, routing coefficients and Sinkhorn
/// stay fp32 in every mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Precision {
    #[default]
    F32,
    /// Residual state and matmul operands in bf16 (GPU).
    Bf16,
}

/// Training configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSpec {
    /// Training data; default the built-in synthetic corpus.
    pub data: DataSpec,
    /// Tokens per sequence T [>= 2].
    pub seq_len: usize,
    /// Sequences per step B [>= 1].
    pub batch: usize,
    /// Optimizer steps [>= 1].
    pub steps: usize,
    /// Optimizer.
    pub optimizer: OptimizerSpec,
    /// Learning-rate schedule.
    pub schedule: ScheduleSpec,
    /// Global gradient-norm clip (> 0), or none. Default 1.0 (docs/math.md §10).
    pub clip: Option<f64>,
    /// RNG seed for init and data order.
    pub seed: u64,
    /// Validate every this many steps [>= 1]; default 50.
    pub eval_every: usize,
    /// Validation batches per evaluation [>= 1]; default 4.
    pub eval_batches: usize,
    /// Fraction of the text held out for validation (0 < f < 1); default 0.1.
    pub val_fraction: f64,
    /// Order of the training windows; default `Random` (docs/data.md).
    pub order: DataOrder,
    /// Validate on this many tokens taken in order from the start of the validation
    /// split (modded-nanogpt uses 10485760), so the number is comparable with published
    /// ones; `None` (the default) scores `eval_batches` random windows instead.
    pub val_tokens: Option<usize>,
    /// Checkpoint every this many steps (0 = only at the end); default 0.
    pub checkpoint_every: usize,
    /// Keep only the newest this many `ckpt-<step>` files of a run, deleting older
    /// ones after each save (0 = keep all), so frequent checkpoints do not fill the
    /// disk; `final.safetensors` is always kept. Default 0.
    pub keep_last: usize,
    /// What the backward pass reads stored and what it recomputes, per block of
    /// residual sublayers (docs/math.md §4.5, "Recompute schedule"); default `None`
    /// (every value the backward reads is stored).
    pub recompute: Recompute,
}

impl Default for TrainSpec {
    fn default() -> Self {
        TrainSpec {
            data: DataSpec::Synthetic(SyntheticCorpus::Default),
            seq_len: 64,
            batch: 8,
            steps: 200,
            optimizer: OptimizerSpec::AdamW(AdamWSpec::default()),
            schedule: ScheduleSpec::Cosine(CosineSpec::default()),
            clip: Some(1.0),
            seed: 0,
            eval_every: 50,
            eval_batches: 4,
            val_fraction: 0.1,
            order: DataOrder::Random,
            val_tokens: None,
            checkpoint_every: 0,
            keep_last: 0,
            recompute: Recompute::None,
        }
    }
}

/// Where training text comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum DataSpec {
    /// A built-in generated corpus: no download needed.
    Synthetic(SyntheticCorpus),
    /// A byte-level text file, `Text("data/input.txt")`: a path relative to the folder
    /// widen runs in (not the spec's folder), or absolute.
    Text(String),
    /// Token shards on disk (llm.c / modded-nanogpt shards, or nanoGPT's headerless
    /// `.bin`), memory-mapped and never read whole (docs/data.md).
    Tokens(TokenData),
}

/// A token dataset: the training shards, optionally separate validation shards, and
/// how to read headerless files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenData {
    /// A path or glob (`dir/fineweb_train_*.bin`); the matches are read in name order.
    pub train: String,
    /// A path or glob of validation shards; `None` splits the training tokens by
    /// `train.val_fraction` (the last fraction is validation), as for text.
    pub val: Option<String>,
    /// Token width of headerless files (nanoGPT's `train.bin` is `U16`); `None` accepts
    /// only files with an llm.c header, which states the width itself.
    pub dtype: Option<TokenWidth>,
    /// The tokenizer the ids come from; `None` reads it from the `manifest.json` beside
    /// the training shards (written by `widen data prepare`), if there is one.
    pub tokenizer: Option<TokenizerSpec>,
}

/// The stored width of one token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TokenWidth {
    /// Little-endian u16 (ids below 65536: GPT-2's 50257 fit).
    U16,
    /// Little-endian u32 (128k-class vocabularies).
    U32,
}

impl TokenWidth {
    /// Bytes per token id.
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// Which tokenizer turns text into ids (docs/data.md).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TokenizerSpec {
    /// One token per byte, vocabulary 256 (the default for text).
    Bytes,
    /// GPT-2's byte-level BPE (`r50k_base`, vocabulary 50257, `<|endoftext|>` = 50256),
    /// embedded in the binary.
    Gpt2,
    /// A Hugging Face `tokenizer.json`, identified by its path and the SHA-256 of its
    /// bytes, so a changed file is refused rather than silently decoding other ids.
    HuggingFace {
        /// The `tokenizer.json` file (relative to the folder widen runs in, or absolute).
        path: String,
        /// SHA-256 of its bytes, 64 hex digits (`widen data prepare` records it).
        sha256: String,
    },
}

/// Which forward values of the residual-stream machinery the backward pass
/// recomputes instead of reading them stored (docs/math.md §4.5, "Recompute
/// schedule"; HC App. B, §2.5; VWN §5.8). Losses and gradients are the same bits
/// with every choice on the Cpu device; only the activation memory and the time
/// of a step change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Recompute {
    /// Every forward value the backward reads is stored.
    #[default]
    None,
    /// The connection's intermediates of every sublayer (coefficients' gates,
    /// reads, norms, Sinkhorn iterates, writes) recomputed from the stored
    /// stream state entering the sublayer; `Block(1)`.
    Stream,
    /// mHC's block schedule with L_r sublayers per block [1 <= L_r <= 2 x layers]:
    /// only the stream state entering each block and each sublayer's F output (and
    /// F's own activations) stay stored; the states inside a block are recomputed.
    Block(usize),
}

impl Recompute {
    /// Sublayers per recompute block, `None` when nothing is recomputed.
    pub fn block(self) -> Option<usize> {
        match self {
            Recompute::None => None,
            Recompute::Stream => Some(1),
            Recompute::Block(l) => Some(l),
        }
    }
}

/// The order in which training windows are drawn (docs/data.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum DataOrder {
    /// Windows at uniformly random offsets, with replacement (resumable: the sampler's
    /// state is checkpointed).
    #[default]
    Random,
    /// Consecutive windows in shard order without replacement, wrapping at the end
    /// (modded-nanogpt's loader); resumable from the position in the stream.
    Sequential,
}

/// Built-in corpora.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyntheticCorpus {
    /// Deterministic English-like text from a small grammar; learnable structure at byte level.
    Default,
}

/// Optimizer choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum OptimizerSpec {
    AdamW(AdamWSpec),
    /// Muon for hidden matrices, AdamW for everything else (docs/math.md §8.2).
    Muon(MuonSpec),
}

/// AdamW (decoupled weight decay). No decay on gains, biases, embeddings and static
/// connection parameters (docs/math.md §1.2, §2.4, §5.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWSpec {
    /// Peak learning rate (> 0).
    pub lr: f64,
    /// (beta1, beta2), each in [0, 1).
    pub betas: (f64, f64),
    /// Denominator epsilon (> 0); default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay [>= 0]; default 0.1.
    pub weight_decay: f64,
}

impl Default for AdamWSpec {
    fn default() -> Self {
        AdamWSpec { lr: 3e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 }
    }
}

/// Muon update scaling (docs/math.md §8.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MuonScale {
    /// sqrt(max(1, out/in)) (Keller Jordan's original).
    Original,
    /// 0.2 * sqrt(max(out, in)): matches AdamW's update RMS (Moonlight; xHC).
    MatchRmsAdamW,
}

/// Muon knobs (docs/math.md §8.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MuonSpec {
    /// Muon learning rate (> 0); default 0.02.
    pub lr: f64,
    /// Momentum beta [0, 1); default 0.95.
    pub momentum: f64,
    /// Nesterov momentum; default true.
    pub nesterov: bool,
    /// Newton-Schulz steps [>= 1]; default 5.
    pub ns_steps: usize,
    /// Update scaling; default original.
    pub scale: MuonScale,
    /// Decoupled weight decay on Muon matrices [>= 0]; default 0.
    pub weight_decay: f64,
    /// AdamW for the non-hidden parameters.
    pub adamw: AdamWSpec,
}

impl Default for MuonSpec {
    fn default() -> Self {
        MuonSpec {
            lr: 0.02,
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            scale: MuonScale::Original,
            weight_decay: 0.0,
            adamw: AdamWSpec::default(),
        }
    }
}

/// Learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ScheduleSpec {
    /// Linear warmup then constant.
    Constant(ConstantSpec),
    /// Linear warmup then cosine decay to `min_ratio` of the peak.
    Cosine(CosineSpec),
    /// Warmup-stable-decay: warmup, constant, then linear decay over the last `decay_fraction`.
    Wsd(WsdSpec),
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConstantSpec {
    /// Warmup steps [>= 0, < steps].
    pub warmup: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CosineSpec {
    /// Warmup steps [>= 0, < steps]; default 20.
    pub warmup: usize,
    /// Final LR as a fraction of the peak [0, 1]; default 0.1.
    pub min_ratio: f64,
}

impl Default for CosineSpec {
    fn default() -> Self {
        CosineSpec { warmup: 20, min_ratio: 0.1 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WsdSpec {
    /// Warmup steps [>= 0, < steps]; default 20.
    pub warmup: usize,
    /// Fraction of steps spent decaying (0, 1]; default 0.2.
    pub decay_fraction: f64,
    /// Final LR as a fraction of the peak [0, 1]; default 0.1.
    pub final_ratio: f64,
}

impl Default for WsdSpec {
    fn default() -> Self {
        WsdSpec { warmup: 20, decay_fraction: 0.2, final_ratio: 0.1 }
    }
}
