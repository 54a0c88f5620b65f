//! The connection language: a residual-stream design written in the spec
//! (`residual: Connection(...)`, docs/connections.md, docs/math.md §12).
//!
//! A design is the unified form of docs/math.md §0.3 made explicit: a state of `streams`
//! slots per token, each of width D / `segments`; per sublayer a Read `[m, s]`, a Carry
//! `[s, s]` (or one retention per slot) and a Write `[s, m]` (or one scale per segment),
//! each the constraint of a static part plus, with a generator, a gated per-token part;
//! how the state is created from the embedding and collapsed before the final norm.
//! HC, FC, mHC and GHC are spellings of it ([`ConnectionSpec::hc`] and its siblings),
//! lowered by the same code (`ir/src/lower/schemes/connection.rs`).

use serde::{Deserialize, Serialize};

use super::{
    Collapse, EmbedMode, FcSpec, GateAct, GenNorm, GhcSpec, HcSpec, MhcBiasInit, MhcSpec, OutProjStdMult,
    ProjInit, ReduceInit, ReduceNorm,
};

/// A residual-stream design in the connection language (docs/connections.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionSpec {
    /// Slots s of the state per token [1 ..= 64]; default 4.
    pub streams: usize,
    /// Segments m the sublayer reads and writes [>= 1, divides d_model, <= streams]; every
    /// slot is d_model / m wide. Default 1 (full-width streams).
    pub segments: usize,
    /// How the embedding becomes the state; default replicate.
    pub create: Create,
    /// How the state becomes one d_model vector before the final norm; default sum.
    pub collapse: CollapseRule,
    /// Where the per-token (dynamic) parts of the coefficients come from; default none.
    pub generator: Generator,
    /// H_pre `[m, s]`: what the sublayer reads. Default `Home(on: 1, off: 0)`.
    pub read: Coefficient,
    /// H_res `[s, s]` (or `[s, 1]` with `form: PerSlot`): what each slot keeps. Default identity.
    pub carry: Coefficient,
    /// H_post `[s, m]` (or `[s, 1]` with `form: PerSlot`, needs s = m): where the output goes.
    /// Default all ones.
    pub write: Coefficient,
    /// Init std multiplier of the sublayers' output projections (docs/math.md §2.4); default one.
    pub out_proj_std_mult: OutProjStdMult,
    /// A depth history beside (or instead of) the fixed state: earlier sublayers' outputs or
    /// blocks' states that a read combines (docs/math.md §12.5); default none.
    pub history: Option<History>,
}

impl Default for ConnectionSpec {
    fn default() -> Self {
        ConnectionSpec {
            streams: 4,
            segments: 1,
            create: Create::Replicate,
            collapse: CollapseRule::Sum,
            generator: Generator::None,
            read: Coefficient::new(CoefInit::Home { on: 1.0, off: 0.0 }),
            carry: Coefficient::new(CoefInit::Identity),
            write: Coefficient::new(CoefInit::Constant(1.0)),
            out_proj_std_mult: OutProjStdMult::One,
            history: None,
        }
    }
}

/// A depth history (docs/math.md §12.5): a list of entries that grows with depth, entry 0
/// being the created state (the embedding, or an MTP module's fused input), and reads that
/// combine a subset of them with static or attention weights. Attention residuals (block
/// or full) and DenseFormer's depth-weighted averages are written with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct History {
    /// What an entry holds; default outputs.
    pub entries: Entries,
    /// Sublayers per entry [1 ..= 2 · layers]: 1 gives one entry per sublayer (full
    /// attention residuals), 2 one per transformer block (DenseFormer). Default 2.
    pub block: usize,
    /// How a read weighs the entries it combines; default attention.
    pub weights: DepthWeights,
    /// k [>= 1]: the read after entry i combines the entries j <= i with j ≡ i (mod k) only.
    /// `entries: States` only; default 1.
    pub dilation: usize,
    /// p [>= 1]: a read follows entry i only where p divides i. `entries: States` only;
    /// default 1.
    pub period: usize,
}

impl Default for History {
    fn default() -> Self {
        History {
            entries: Entries::Outputs,
            block: 2,
            weights: DepthWeights::Attention,
            dilation: 1,
            period: 1,
        }
    }
}

/// What a depth history's entries hold (docs/math.md §12.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Entries {
    /// The sum of the branch outputs of each `block` sublayers (attention residuals). There is
    /// no carried state: every sublayer reads the finished entries and the current block's
    /// partial sum, and the head reads them all. Needs streams = 1 and the coefficient fields
    /// left out.
    Outputs,
    /// The state after each `block` sublayers, its residual included (DenseFormer). The fixed
    /// state carries on as written; after entry i (where `period` divides i) it is replaced
    /// by the read of the entries j ≡ i (mod `dilation`).
    States,
}

/// The weights of a depth read over entries v_0 .. v_{n-1} (docs/math.md §12.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DepthWeights {
    /// softmax_i(w · RMSNorm(v_i)) with a learned query w (init 0, so a read starts as the
    /// mean of its entries) and a learned key-norm gain (init 1), per read (attention
    /// residuals).
    Attention,
    /// One learned scalar per entry read, not normalised (DenseFormer's α).
    Static(DepthInit),
}

/// Init of static depth weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DepthInit {
    /// 1 on the newest entry, 0 on the rest (DenseFormer: the plain model at init).
    Newest,
    /// 1 on every entry (over outputs: the plain residual's sum).
    Ones,
    /// 1/n on each of the n entries.
    Mean,
}

/// Stream creation from the embedding row E[tok] (docs/math.md §0.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Create {
    /// E[tok] `[D]` copied into every slot (HC, mHC); needs segments = 1.
    Replicate,
    /// E[tok] cut into s slots of D / m (FC); needs streams = segments.
    Split,
    /// An over-width embedding of s · D / m reshaped into the slots (GHC / VWN, docs/math.md §5.2).
    Wide(EmbedMode),
}

/// How the state becomes one `[D]` vector before the final norm (docs/math.md §0.3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CollapseRule {
    /// Σ_i X_i; needs segments = 1.
    Sum,
    /// The mean of the slots; needs segments = 1.
    Mean,
    /// The slots side by side (FC); needs streams = segments.
    Concat,
    /// VWN's norm and W_reduce `[s·D/m, D]` (docs/math.md §5.2, §5.6).
    Reduce {
        /// The norm before W_reduce (GroupNorm needs streams to be a multiple of segments).
        norm: ReduceNorm,
        /// W_reduce init.
        init: ReduceInit,
    },
    /// Σ_i c_i X_i with static per-slot weights `[1, s]` (`{init, constraint}` of a
    /// [`Coefficient`], e.g. the wide residual's σ(e_i), docs/math.md §12.3); needs segments = 1.
    Readout(Coefficient),
}

/// The source of the coefficients' per-token parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Generator {
    /// Static coefficients only (SHC, SFC, SGHC, the wide residual).
    None,
    /// One row of coefficients per slot from that slot's norm (HC Alg. 2, FC, VWN Alg. 2;
    /// docs/math.md §5.5).
    PerSlot(PerSlotGenerator),
    /// All coefficients from the RMS-normed flattened state (mHC, mHC-lite; docs/math.md §4.3).
    Flat(FlatGenerator),
}

/// `act(norm(X_i) [W_alpha | W_beta] / τ) ⊙ gate + static`, per slot i (docs/math.md §12.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PerSlotGenerator {
    /// The per-slot norm; default RmsNorm.
    pub norm: GenNorm,
    /// Temperature τ (> 0); default √(d_model / segments) (docs/math.md §5.5).
    pub temperature: Option<f64>,
    /// Activation on the projections; default tanh.
    pub act: GateAct,
    /// Shape of the learned gate; default entrywise.
    pub gate: Gate,
    /// Gate init (finite); default 1.
    pub gate_init: f64,
}

impl Default for PerSlotGenerator {
    fn default() -> Self {
        PerSlotGenerator {
            norm: GenNorm::RmsNorm,
            temperature: None,
            act: GateAct::Tanh,
            gate: Gate::Entrywise,
            gate_init: 1.0,
        }
    }
}

/// The gate of a per-slot generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Gate {
    /// HC's two scalars: s_alpha on read and carry, s_beta on write (docs/math.md §2.3).
    Paired,
    /// One gate per coefficient entry, S_alpha and S_beta (docs/math.md §5.5).
    Entrywise,
}

/// `constraint(α ⊙ (RMSNorm(vec X) φ) + b)`: one projection of the whole state, columns
/// `[read | write | carry]` (docs/math.md §4.3, §12.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlatGenerator {
    /// A learned RMSNorm gain `[s·D/m]` (init 1) before φ (mHC-lite); default false (mHC).
    pub gain: bool,
    /// Init of φ; default zero.
    pub proj_init: ProjInit,
    /// α_pre = α_post = α_res init (finite); default 0.01.
    pub gate_init: f64,
}

impl Default for FlatGenerator {
    fn default() -> Self {
        FlatGenerator { gain: false, proj_init: ProjInit::Zero, gate_init: 0.01 }
    }
}

/// One of read, carry and write: `constraint(static + dynamic)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Coefficient {
    /// Init of the static part (a learned parameter, no weight decay).
    pub init: CoefInit,
    /// Applied to static + dynamic; default none.
    pub constraint: Constraint,
    /// A full matrix or one value per slot; default matrix.
    pub form: Form,
    /// Whether the static part is trained; default true. False keeps it at its init, a
    /// constant (e.g. the plain residual's read, carry and write of 1 inside DenseFormer,
    /// docs/math.md §12.5).
    pub learned: bool,
}

impl Coefficient {
    /// An unconstrained full matrix with this init.
    pub fn new(init: CoefInit) -> Self {
        Coefficient { init, constraint: Constraint::None, form: Form::Matrix, learned: true }
    }
}

impl Default for Coefficient {
    fn default() -> Self {
        Coefficient::new(CoefInit::Constant(0.0))
    }
}

/// The shape of a carry or write coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Form {
    /// Carry `[s, s]`, write `[s, m]`.
    Matrix,
    /// One value per slot `[s, 1]`: a carry keeps ρ_i X_i (retention); a write sends segment
    /// i to slot i only (FC's per-fraction scale, needs streams = segments).
    PerSlot,
}

/// Init of a coefficient's static part, laid out over its logits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CoefInit {
    /// The rectangular identity: 1 where row = column.
    Identity,
    /// Every entry this value.
    Constant(f64),
    /// Every entry ln(p / (1 - p)), so that a sigmoid constraint starts at p (0 < p < 1).
    Logit(f64),
    /// `on` on the home slot l mod s of sublayer l, `off` elsewhere (a `[1, s]` read or an
    /// `[s, 1]` write).
    Home {
        /// The home slot's value (finite).
        on: f64,
        /// Every other slot's value (finite).
        off: f64,
    },
    /// `on` where row = column, `off` elsewhere.
    Eye {
        /// The diagonal's value (finite).
        on: f64,
        /// Every other entry's value (finite).
        off: f64,
    },
    /// `on` on the first logit, `off` on the rest (the identity permutation of `Permutations`).
    First {
        /// The first logit's value (finite).
        on: f64,
        /// Every other logit's value (finite).
        off: f64,
    },
    /// Slot j receives segment j mod m (docs/math.md §5.6).
    Cyclic,
    /// From `lo` to `hi` in equal steps over the entries.
    Linspace(f64, f64),
    /// Row-major values, as many as the logits.
    Values(Vec<f64>),
}

/// The map from logits to a coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Constraint {
    /// The logits themselves.
    None,
    /// `scale · σ(x) + offset` (mHC's H_pre and 2σ H_post; retention 1 - f·σ(-g) is
    /// `scale: f, offset: 1 - f`).
    Sigmoid {
        /// The bound of the sigmoid (finite).
        scale: f64,
        /// Added after the scale (finite).
        offset: f64,
    },
    /// tanh(x).
    Tanh,
    /// Each row a softmax over its inputs (convex reads and carries).
    Softmax,
    /// Sinkhorn–Knopp onto the doubly stochastic matrices (docs/math.md §4.2); a square carry.
    Sinkhorn {
        /// Iterations t_max [1 ..= 1000].
        iters: usize,
        /// Guard added to the row and column sums [>= 0].
        eps: f64,
    },
    /// Σ_k softmax(a)_k P_k over all s! permutation matrices (mHC-lite, docs/math.md §12.2): an
    /// exactly doubly stochastic carry with s! logits, s <= 6.
    Permutations,
    /// U_1 ⊗ … ⊗ U_K with U_k = [[p_k, 1 - p_k], [1 - p_k, p_k]], (p_k, 1 - p_k) the softmax of
    /// the k-th pair of 2K logits (KromHC, docs/math.md §12.6): an exactly doubly stochastic
    /// carry for streams = 2^K.
    Kronecker,
}

/// The largest stream count `Permutations` accepts: 6! = 720 logits per sublayer.
pub const MAX_PERMUTATION_STREAMS: usize = 6;

/// The number of 2 x 2 factors K of a `Kronecker` carry over `streams` = 2^K slots, or None
/// when `streams` is not a power of two of at least 2.
pub fn kronecker_factors(streams: usize) -> Option<usize> {
    (streams >= 2 && streams.is_power_of_two()).then(|| streams.trailing_zeros() as usize)
}

impl ConnectionSpec {
    /// Slot width d_model / segments.
    pub fn slot_width(&self, d_model: usize) -> usize {
        d_model / self.segments.max(1)
    }

    /// The per-token state width s · D / m.
    pub fn state_width(&self, d_model: usize) -> usize {
        self.streams * self.slot_width(d_model)
    }

    /// HC (docs/math.md §2) written in the language.
    pub fn hc(hc: &HcSpec) -> Self {
        ConnectionSpec {
            streams: hc.n,
            segments: 1,
            create: Create::Replicate,
            collapse: CollapseRule::Sum,
            generator: if hc.dynamic {
                Generator::PerSlot(PerSlotGenerator {
                    norm: hc.gen_norm,
                    temperature: Some(1.0),
                    act: hc.act,
                    gate: Gate::Paired,
                    gate_init: hc.scale_init,
                })
            } else {
                Generator::None
            },
            read: Coefficient::new(CoefInit::Home { on: 1.0, off: 0.0 }),
            carry: Coefficient::new(CoefInit::Identity),
            write: Coefficient::new(CoefInit::Constant(1.0)),
            out_proj_std_mult: hc.out_proj_std_mult,
            history: None,
        }
    }

    /// FC (docs/math.md §3) written in the language.
    pub fn fc(fc: &FcSpec) -> Self {
        ConnectionSpec {
            streams: fc.m,
            segments: fc.m,
            create: Create::Split,
            collapse: CollapseRule::Concat,
            generator: if fc.dynamic {
                Generator::PerSlot(PerSlotGenerator {
                    norm: GenNorm::RmsNorm,
                    temperature: Some(1.0),
                    act: fc.act,
                    gate: Gate::Paired,
                    gate_init: fc.scale_init,
                })
            } else {
                Generator::None
            },
            read: Coefficient::new(CoefInit::Identity),
            carry: Coefficient::new(CoefInit::Identity),
            write: Coefficient { form: Form::PerSlot, ..Coefficient::new(CoefInit::Constant(1.0)) },
            out_proj_std_mult: OutProjStdMult::One,
            history: None,
        }
    }

    /// GHC / VWN (docs/math.md §5) written in the language.
    pub fn ghc(ghc: &GhcSpec) -> Self {
        ConnectionSpec {
            streams: ghc.n,
            segments: ghc.m,
            create: Create::Wide(ghc.embed_mode),
            collapse: CollapseRule::Reduce { norm: ghc.reduce_norm(), init: ghc.reduce_init },
            generator: if ghc.dynamic {
                Generator::PerSlot(PerSlotGenerator {
                    norm: GenNorm::RmsNorm,
                    temperature: ghc.tau,
                    act: GateAct::Tanh,
                    gate: Gate::Entrywise,
                    gate_init: ghc.s_init,
                })
            } else {
                Generator::None
            },
            read: Coefficient::new(CoefInit::Identity),
            carry: Coefficient::new(CoefInit::Identity),
            write: Coefficient::new(CoefInit::Cyclic),
            out_proj_std_mult: OutProjStdMult::One,
            history: None,
        }
    }

    /// mHC (docs/math.md §4) written in the language.
    pub fn mhc(mhc: &MhcSpec) -> Self {
        let single = mhc.bias_init == MhcBiasInit::SingleStream;
        let (on, off) = if single { (3.0, -3.0) } else { (0.0, 0.0) };
        ConnectionSpec {
            streams: mhc.n,
            segments: 1,
            create: Create::Replicate,
            collapse: match mhc.collapse {
                Collapse::Sum => CollapseRule::Sum,
                Collapse::Mean => CollapseRule::Mean,
            },
            generator: Generator::Flat(FlatGenerator {
                gain: false,
                proj_init: mhc.proj_init,
                gate_init: mhc.alpha_init,
            }),
            read: Coefficient {
                constraint: Constraint::Sigmoid { scale: 1.0, offset: mhc.pre_eps },
                ..Coefficient::new(CoefInit::Home { on, off })
            },
            carry: Coefficient {
                constraint: Constraint::Sinkhorn { iters: mhc.sinkhorn_iters, eps: mhc.sinkhorn_eps },
                ..Coefficient::new(CoefInit::Eye { on, off })
            },
            write: Coefficient {
                constraint: Constraint::Sigmoid { scale: mhc.post_max, offset: 0.0 },
                ..Coefficient::new(CoefInit::Constant(0.0))
            },
            out_proj_std_mult: OutProjStdMult::One,
            history: None,
        }
    }
}
