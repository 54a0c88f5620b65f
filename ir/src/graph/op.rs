//! The op set, defined once (docs/architecture.md §4). Every op's semantics is its
//! reference implementation in `exec`; every op's derivative is one rule in
//! `autodiff`. Shapes follow NumPy broadcasting for elementwise binaries.

use serde::{Deserialize, Serialize};

/// Elementwise unary functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Tanh,
    Sigmoid,
    /// x * sigmoid(x)
    Silu,
    Sqrt,
    Rsqrt,
    Recip,
    Square,
}

/// Elementwise binary functions (NumPy broadcasting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    /// Elementwise maximum; the derivative goes to the larger operand (ties: the first).
    Max,
}

/// Reductions over one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Max,
    Mean,
}

/// How a parameter is initialized. Initialization itself is done by the runtime
/// from a seeded RNG; the graph only records the rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Init {
    Zeros,
    Ones,
    Constant(f64),
    /// N(0, std^2).
    Normal {
        std: f64,
    },
    /// U(-bound, bound).
    Uniform {
        bound: f64,
    },
    /// Rectangular identity: 1 where row == col (e.g. W_reduce = [I_D | 0], docs/math.md §5.6).
    Eye,
    /// Explicit row-major values (small static connection matrices: GHC A/B, mHC b).
    Values(Vec<f64>),
}

/// How a parameter is treated by optimizers and muP (docs/math.md §8.1, §8.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParamClass {
    /// Embedding tables (E, E_wide, E_base): AdamW, no weight decay, muP vector-like.
    Embedding,
    /// Hidden matrices (attention, FFN, experts, W_reduce, W_expand, MTP mixers):
    /// weight decay, Muon-eligible, muP hidden.
    Hidden,
    /// The unembedding U: weight decay, AdamW, muP readout.
    Readout,
    /// Norm gains and biases: no weight decay.
    Gain,
    /// Connection-coefficient generators that read a width-sized vector
    /// (HC W, mHC phi, GHC W_alpha/W_beta, xHC W^r/W^pre/W^res/W^post):
    /// AdamW with weight decay, muP readout-like (docs/math.md §8.1 DECISION).
    ConnectionProjection,
    /// Static connection parameters (A, B, b, S, alpha scalars): AdamW, no weight decay.
    ConnectionStatic,
    /// xHC temporal-conv kernels: AdamW, weight decay, muP vector-like.
    Conv,
    /// MoE router matrices: AdamW, weight decay (Muon-eligible per xHC §4.6).
    Router,
    /// The MoE router's load-balancing bias (`balance: BiasUpdate`, docs/math.md §1.6). It
    /// only shifts the top-k choice, so no gradient reaches it; the trainer moves it after
    /// every step from that step's expert loads, and the optimizer leaves it alone: no
    /// learning rate, no weight decay.
    RouterBias,
    /// A constant table the lowering needs as a tensor, e.g. the permutation matrices of
    /// the connection language's `Permutations` carry (docs/math.md §12.2): set from its
    /// `Init`, never optimized, no weight decay.
    Table,
}

impl ParamClass {
    /// Whether AdamW applies decoupled weight decay (docs/math.md §1.2, §2.4, §5.6, §6.7).
    pub fn weight_decay(self) -> bool {
        matches!(
            self,
            ParamClass::Hidden
                | ParamClass::Readout
                | ParamClass::ConnectionProjection
                | ParamClass::Conv
                | ParamClass::Router
        )
    }

    /// Whether the optimizer updates this parameter at all: every class but the MoE
    /// router bias, which the trainer sets from the expert loads (docs/math.md §1.6).
    pub fn optimized(self) -> bool {
        !matches!(self, ParamClass::RouterBias | ParamClass::Table)
    }

    /// Whether Muon (rather than AdamW) updates this parameter when Muon is selected (§8.2).
    pub fn muon_eligible(self) -> bool {
        matches!(self, ParamClass::Hidden | ParamClass::Router)
    }
}

/// A trainable parameter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamInfo {
    /// Stable, documented name (checkpoint key), e.g. `blocks.0.attn.wq`.
    pub name: String,
    pub init: Init,
    pub class: ParamClass,
}

/// The ops. Inputs are ordered by edge slot; the doc of each variant lists them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// Per-step data (token windows). No inputs.
    Input { name: String },
    /// A trainable parameter. No inputs.
    Param(ParamInfo),
    /// A tensor filled with one value. No inputs.
    Constant { value: f64 },
    /// Elementwise unary: (x).
    Unary(UnaryOp),
    /// Elementwise binary with broadcasting: (a, b).
    Binary(BinaryOp),
    /// a * x + b with constants, elementwise: (x).
    Affine { mul: f64, add: f64 },
    /// Elementwise conversion to the float type `to`: (x). Mixed precision (docs/math.md §6.12):
    /// `Bf16` is a storage type, so a cast to Bf16 rounds each value to the nearest bf16
    /// (ties to even, NaN stays NaN, overflow gives ±inf) and every consumer computes in
    /// f32 on the exactly widened value; a cast of a Bf16 value to F32 is exact.
    Cast { to: crate::DType },
    /// Reduce one axis: (x).
    Reduce { op: ReduceOp, axis: usize, keepdim: bool },
    /// Batched matrix product: (a [.., M, K], b [.., K, N]) -> [.., M, N], batch dims
    /// broadcast; `trans_a`/`trans_b` transpose the last two axes of an operand first.
    MatMul { trans_a: bool, trans_b: bool },
    /// View with a new shape of the same element count: (x).
    Reshape { shape: Vec<usize> },
    /// Axis permutation, `out.dims[i] = x.dims[perm[i]]`: (x).
    Permute { perm: Vec<usize> },
    /// NumPy broadcast to `shape`: (x).
    Broadcast { shape: Vec<usize> },
    /// x[.., start..end, ..] on `axis`: (x).
    Slice { axis: usize, start: usize, end: usize },
    /// Concatenate along `axis`: (x0, x1, ...).
    Concat { axis: usize },
    /// Gather along `axis`: (x [P.., S, R..], idx i32 [P.., J..]) -> [P.., J.., R..],
    /// where P = x.dims[..axis]. Embedding lookup is axis 0; per-token stream gather
    /// is axis 2 of [B, T, N, C] with idx [B, T, k].
    Gather { axis: usize },
    /// Inverse of `Gather`, accumulating: (base, idx, src) -> base with src added at idx.
    ScatterAdd { axis: usize },
    /// Row replacement: (base, idx, src) -> base with rows idx replaced by src
    /// (indices distinct within each P). Used for xHC's sparse write-back (docs/math.md §6.6).
    ScatterRows { axis: usize },
    /// xHC routing over the last axis (docs/math.md §6.2): (scores [.., N]) -> i32 [.., k]:
    /// indices 0..fixed, then the k - fixed highest scores among the rest, in ascending
    /// index order; ties go to the lowest index. Not differentiable.
    TopK { k: usize, fixed: usize },
    /// Softmax over the last axis: (x).
    Softmax,
    /// RMSNorm over the last axis: (x, gain `[d]`) or (x) without gain (docs/math.md §1.3).
    RmsNorm { eps: f64 },
    /// LayerNorm over the last axis: (x, gain, bias) or (x) without affine.
    LayerNorm { eps: f64 },
    /// GroupNorm over the last axis split into `groups` groups, per-channel affine:
    /// (x, gain, bias) (docs/math.md §5.2).
    GroupNorm { groups: usize, eps: f64 },
    /// Projection of the normalized input, reading x once (mHC fused form, docs/math.md §4.3;
    /// xHC fused router + pre, §6.2–6.3): (x [.., K], w [K, M]) -> [.., M]. The first
    /// `centered` output columns use LayerNorm statistics (mean-centred, no affine),
    /// the rest RMSNorm statistics (no gain: it is folded into w).
    NormProject { eps: f64, centered: usize },
    /// Mean softmax cross-entropy: (logits [.., V], targets i32 [..]) -> scalar.
    SoftmaxCrossEntropy,
    /// The output projection fused with the mean softmax cross-entropy (docs/math.md §1.7):
    /// (x [.., D], w [D, V] (`trans_b`: [V, D], read transposed), targets i32 [..]) -> scalar
    /// mean over rows r of CE(scale · x_r·w, target_r). It is `SoftmaxCrossEntropy` of
    /// `scale · MatMul(x, w)`; compiled devices compute the logits `chunk` rows at a time,
    /// forward and backward, so neither the logits nor their gradient exists whole
    /// (`passes::vocab_loss` forms it).
    LinearCrossEntropy { trans_b: bool, scale: f64, chunk: usize },
    /// Causal self-attention with optional half-split RoPE (docs/math.md §1.3):
    /// (q [B, T, H, dh], k [B, T, Hkv, dh], v [B, T, Hkv, dh]) -> [B, T, H, dh].
    CausalAttention { scale: f64, rope_base: Option<f64> },
    /// Sinkhorn-Knopp over the last two axes (docs/math.md §4.2): (logits [.., n, n]).
    /// exp(x - colmax), then `iters` x (column normalize, row normalize), each sum + eps.
    Sinkhorn { iters: usize, eps: f64 },
    /// xHC temporal augmentation (docs/math.md §6.5): (out [B, T, C], w_1 [κ_1, C], ..., w_r [κ_r, C])
    /// -> [B, T, r, C] = v_2..v_{r+1}: causal depthwise convolutions g_j, then (optionally)
    /// modified Gram–Schmidt against out and the earlier components.
    TemporalAugment { gram_schmidt: bool, eps_rel: f64 },
    /// Backward of `CausalAttention`, added by autodiff: (q, k, v, dout) -> the gradient
    /// of q, k or v (`wrt` = 0, 1, 2), recomputing the probabilities (docs/math.md §1.4).
    CausalAttentionGrad { scale: f64, rope_base: Option<f64>, wrt: usize },
    /// Backward of `LinearCrossEntropy`, added by autodiff: (x, w, targets, dy) -> the
    /// gradient of x (`wrt` = 0) or of w (`wrt` = 1), recomputing each chunk's logits
    /// (docs/math.md §1.7).
    LinearCrossEntropyGrad { trans_b: bool, scale: f64, chunk: usize, wrt: usize },
    /// Backward of `Sinkhorn`, added by autodiff: (logits, dout) -> d logits, unrolled
    /// through every normalization of the recomputed finite iteration (docs/math.md §4.5).
    SinkhornGrad { iters: usize, eps: f64 },
    /// Backward of `TemporalAugment`, added by autodiff: (out, w_1, ..., w_r, dY) -> the
    /// gradient of input `wrt` (0 = out, j = w_j), recomputing the convolutions and the
    /// Gram–Schmidt sweep (docs/math.md §6.8).
    TemporalAugmentGrad { gram_schmidt: bool, eps_rel: f64, wrt: usize },
    /// Sparse MoE routing (docs/math.md §1.6): (idx i32 [N, k], the chosen experts of each
    /// token in ascending order) -> the index tensor `out` selects. Assignments (n, j) are
    /// ordered by expert, then by token: the first `capacity` of each expert (all, when
    /// `None`) are kept, the rest dropped and placed after every kept one, in token order.
    /// Not differentiable.
    MoeRoute { experts: usize, capacity: Option<usize>, out: MoeRouteOut },
    /// Grouped matrix product over contiguous row groups (docs/math.md §1.6):
    /// (x [M, K], w [E, K, N] (`trans_b`: [E, N, K], read transposed), counts i32 [E])
    /// -> [M, N]. Group e is the `counts[e]` rows after those of groups 0..e and is
    /// multiplied by w[e]; rows past the sum of the counts are zero.
    GroupedMatMul { trans_b: bool },
    /// Weight gradient of `GroupedMatMul`, added by autodiff: (x [M, K], dy [M, N], counts)
    /// -> [E, K, N] = per group Σ_rows x_r ⊗ dy_r (`trans_b`: [E, N, K] = Σ dy_r ⊗ x_r).
    GroupedMatMulGrad { trans_b: bool },
}

/// Which index tensor a [`Op::MoeRoute`] produces (docs/math.md §1.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeRouteOut {
    /// i32 [N, k]: the row of assignment (n, j) in the expert-sorted order.
    Rows,
    /// i32 [N·k]: the token each row reads (the inverse of `Rows`, divided by k).
    Tokens,
    /// i32 [E]: the kept rows of each expert (the group sizes of `GroupedMatMul`).
    Counts,
}

/// What kind of computation an op is ([`Op::family`]): the questions passes and
/// lowerings ask of every op (is it fusable? does it move data? does it read other
/// rows? does it get a kernel of its own?) are answered per family, so a new op that
/// joins a family gets its family's answers (docs/adding-an-op.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OpFamily<'a> {
    /// No inputs: per-step data, a parameter or a filled constant. Nothing computes a
    /// source; the runtime binds it (a constant is folded into its readers' loads).
    Source(Source<'a>),
    /// Each output element is a function of the same-index element of each operand
    /// (NumPy broadcasting): `Unary`, `Binary`, `Affine`, `Cast`. Fuses into any
    /// kernel, may read an operand of its own kernel inside its item, and is cheap
    /// to recompute in a consumer (rematerialization).
    Elementwise,
    /// Index math only, no data moved (docs/architecture.md §4 "movement as views"):
    /// the output is the operands' elements at other indices. No traffic in the cost
    /// model; lowered as address arithmetic in the reader's loads.
    View(View<'a>),
    /// `Reduce`: folds one axis of one operand. A token reduction when the axis is a
    /// token axis (docs/architecture.md §5).
    Reduction,
    /// Each row of the output (last axis) from the same row of the first operand and
    /// whole, token-free further operands (a gain, a bias): `Softmax`, the norms, `TopK`.
    RowWise,
    /// Each trailing n×n matrix of the output from the same matrix of its operands:
    /// `Sinkhorn` and its gradient (docs/math.md §4.2, §4.5).
    MatrixWise,
    /// `MatMul`: a contraction the compile phase lowers to a library GEMM step, or
    /// unrolls per item when it is small (`passes::fuse`, docs/architecture.md §5).
    Contraction,
    /// Rows chosen by an index operand: `Gather`, `ScatterAdd`, `ScatterRows`.
    Indexed,
    /// Lowered as kernels of their own, never per item inside a fused kernel
    /// (`codegen::emit::lower_own_grid`): attention and its gradient, the loss, the
    /// norm projection, temporal augmentation and its gradient.
    OwnGrid,
    /// Plan steps that are no kernels: MoE routing (a sequential count a device runs
    /// on the host) and the grouped products (a library GEMM per expert whose row
    /// count is data) (docs/math.md §1.6).
    PlanStep,
}

/// Which view a view op makes ([`OpFamily::View`]), with its attributes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum View<'a> {
    /// Same elements, same order, new shape.
    Reshape { shape: &'a [usize] },
    /// `out.dims[i] = x.dims[perm[i]]`.
    Permute { perm: &'a [usize] },
    /// NumPy broadcast to `shape`: an element is read by every output it expands to.
    Broadcast { shape: &'a [usize] },
    /// `x[.., start..end, ..]` on `axis`.
    Slice { axis: usize, start: usize, end: usize },
    /// The operands one after the other along `axis`.
    Concat { axis: usize },
}

/// Which source a source op is ([`OpFamily::Source`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Source<'a> {
    /// Per-step data bound by name.
    Input { name: &'a str },
    /// A trainable parameter.
    Param(&'a ParamInfo),
    /// One value everywhere.
    Constant { value: f64 },
}

impl Op {
    /// Short op name for dumps and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param(_) => "param",
            Op::Constant { .. } => "constant",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Sigmoid => "sigmoid",
                UnaryOp::Silu => "silu",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Recip => "recip",
                UnaryOp::Square => "square",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Max => "max",
            },
            Op::Affine { .. } => "affine",
            Op::Cast { .. } => "cast",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "sum",
                ReduceOp::Max => "reduce_max",
                ReduceOp::Mean => "mean",
            },
            Op::MatMul { .. } => "matmul",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Broadcast { .. } => "broadcast",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Gather { .. } => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::ScatterRows { .. } => "scatter_rows",
            Op::TopK { .. } => "topk",
            Op::Softmax => "softmax",
            Op::RmsNorm { .. } => "rms_norm",
            Op::LayerNorm { .. } => "layer_norm",
            Op::GroupNorm { .. } => "group_norm",
            Op::NormProject { .. } => "norm_project",
            Op::SoftmaxCrossEntropy => "softmax_cross_entropy",
            Op::LinearCrossEntropy { .. } => "linear_cross_entropy",
            Op::CausalAttention { .. } => "causal_attention",
            Op::Sinkhorn { .. } => "sinkhorn",
            Op::TemporalAugment { .. } => "temporal_augment",
            Op::CausalAttentionGrad { .. } => "causal_attention_grad",
            Op::LinearCrossEntropyGrad { .. } => "linear_cross_entropy_grad",
            Op::SinkhornGrad { .. } => "sinkhorn_grad",
            Op::TemporalAugmentGrad { .. } => "temporal_augment_grad",
            Op::MoeRoute { out, .. } => match out {
                MoeRouteOut::Rows => "moe_route_rows",
                MoeRouteOut::Tokens => "moe_route_tokens",
                MoeRouteOut::Counts => "moe_route_counts",
            },
            Op::GroupedMatMul { .. } => "grouped_matmul",
            Op::GroupedMatMulGrad { .. } => "grouped_matmul_grad",
        }
    }

    /// The op's family: the one place that says which kind of computation each op is
    /// (docs/adding-an-op.md). Passes and lowerings that ask a yes/no question about an
    /// op ask it of the family, and name the ops that are exceptions to their family;
    /// only the sites that implement an op's own semantics (its shape, reference,
    /// derivative, cost and emitter) match on the op itself.
    pub fn family(&self) -> OpFamily<'_> {
        match self {
            Op::Input { name } => OpFamily::Source(Source::Input { name }),
            Op::Param(info) => OpFamily::Source(Source::Param(info)),
            Op::Constant { value } => OpFamily::Source(Source::Constant { value: *value }),
            Op::Unary(_) => OpFamily::Elementwise,
            Op::Binary(_) => OpFamily::Elementwise,
            Op::Affine { .. } => OpFamily::Elementwise,
            Op::Cast { .. } => OpFamily::Elementwise,
            Op::Reshape { shape } => OpFamily::View(View::Reshape { shape }),
            Op::Permute { perm } => OpFamily::View(View::Permute { perm }),
            Op::Broadcast { shape } => OpFamily::View(View::Broadcast { shape }),
            Op::Slice { axis, start, end } => {
                OpFamily::View(View::Slice { axis: *axis, start: *start, end: *end })
            }
            Op::Concat { axis } => OpFamily::View(View::Concat { axis: *axis }),
            Op::Reduce { .. } => OpFamily::Reduction,
            Op::Softmax => OpFamily::RowWise,
            Op::RmsNorm { .. } => OpFamily::RowWise,
            Op::LayerNorm { .. } => OpFamily::RowWise,
            Op::GroupNorm { .. } => OpFamily::RowWise,
            Op::TopK { .. } => OpFamily::RowWise,
            Op::Sinkhorn { .. } => OpFamily::MatrixWise,
            Op::SinkhornGrad { .. } => OpFamily::MatrixWise,
            Op::MatMul { .. } => OpFamily::Contraction,
            Op::Gather { .. } => OpFamily::Indexed,
            Op::ScatterAdd { .. } => OpFamily::Indexed,
            Op::ScatterRows { .. } => OpFamily::Indexed,
            Op::SoftmaxCrossEntropy => OpFamily::OwnGrid,
            Op::LinearCrossEntropy { .. } => OpFamily::OwnGrid,
            Op::LinearCrossEntropyGrad { .. } => OpFamily::OwnGrid,
            Op::NormProject { .. } => OpFamily::OwnGrid,
            Op::CausalAttention { .. } => OpFamily::OwnGrid,
            Op::CausalAttentionGrad { .. } => OpFamily::OwnGrid,
            Op::TemporalAugment { .. } => OpFamily::OwnGrid,
            Op::TemporalAugmentGrad { .. } => OpFamily::OwnGrid,
            Op::MoeRoute { .. } => OpFamily::PlanStep,
            Op::GroupedMatMul { .. } => OpFamily::PlanStep,
            Op::GroupedMatMulGrad { .. } => OpFamily::PlanStep,
        }
    }

    /// Pure views: no data is moved (docs/architecture.md §4 "movement as views"). The cost model
    /// counts no traffic for them.
    pub fn is_view(&self) -> bool {
        self.view().is_some()
    }

    /// The view this op makes of its operands, if it is one.
    pub fn view(&self) -> Option<View<'_>> {
        match self.family() {
            OpFamily::View(view) => Some(view),
            OpFamily::Source(_)
            | OpFamily::Elementwise
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => None,
        }
    }

    /// Sources have no inputs.
    pub fn is_source(&self) -> bool {
        self.source().is_some()
    }

    /// Which source this op is, if it is one.
    pub fn source(&self) -> Option<Source<'_>> {
        match self.family() {
            OpFamily::Source(source) => Some(source),
            OpFamily::View(_)
            | OpFamily::Elementwise
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => None,
        }
    }

    /// Heavy ops: those the fusion analysis may make a kernel of their own
    /// (docs/architecture.md §5; `passes::fuse` decides per node, a `MatMul` by its shapes).
    pub fn is_heavy(&self) -> bool {
        match self {
            // Own-grid ops the fusion analysis keeps with their token-local neighbours:
            // the norm projection is row-wise and a temporal augmentation a causal
            // stencil over tokens (docs/math.md §4.3, §6.5); each still gets a grid of
            // its own inside its fused unit.
            Op::NormProject { .. } | Op::TemporalAugment { .. } | Op::TemporalAugmentGrad { .. } => false,
            // Routing orders every token's assignments: a token reduction (docs/math.md §1.6).
            Op::MoeRoute { .. } => false,
            op => match op.family() {
                OpFamily::Contraction | OpFamily::OwnGrid | OpFamily::PlanStep => true,
                OpFamily::Source(_)
                | OpFamily::Elementwise
                | OpFamily::View(_)
                | OpFamily::Reduction
                | OpFamily::RowWise
                | OpFamily::MatrixWise
                | OpFamily::Indexed => false,
            },
        }
    }
}
