//! The unchanged backbone sublayers F_l, each including its own pre-RMSNorm
//! (docs/math.md §1.3; every HC-family paper applies the sublayer norm to the read
//! input, §2.2, §4.1, §5.3).

use super::{router_bias_param, Cx, MoeLayer};
use crate::graph::Build;
use crate::graph::{BinaryOp, GraphError, Init, MoeRouteOut, NodeId, Op, ParamClass, ReduceOp, UnaryOp};
use crate::spec::{AuxLossScope, AuxLossSpec, FfnSpec, MoeBalance, MoeDispatch, MoeGate, Parametrization};

/// Init std of an output projection (W_o, W_2): init_std / sqrt(2L) when depth-scaled
/// (GPT-2/Megatron, docs/math.md §1.2), times the scheme's multiplier (HC's 1/sqrt(n), §2.4).
fn out_proj_std(cx: &Cx, scheme_mult: f64) -> f64 {
    let base = if cx.spec.out_proj_depth_scaled {
        cx.spec.init_std / ((2 * cx.spec.layers) as f64).sqrt()
    } else {
        cx.spec.init_std
    };
    cx.hidden_std(base) * scheme_mult
}

/// Causal (GQA) self-attention with half-split RoPE: `[B, T, D] -> [B, T, D]` (docs/math.md §1.3).
/// Logit scale 1/sqrt(d_h), or alpha_attn/d_h under muP (§8.1).
pub(super) fn attention(cx: &mut Cx, u: NodeId, prefix: &str, out_mult: f64) -> Result<NodeId, GraphError> {
    let spec = cx.spec.clone();
    let (d, h, hkv, dh) = (spec.d_model, spec.heads, spec.kv_heads(), spec.head_dim());
    let (b, t) = (cx.shape(u)[0], cx.shape(u)[1]);
    let std = cx.hidden_std(spec.init_std);
    let gain = cx.param(&format!("{prefix}.norm"), &[d], Init::Ones, ParamClass::Gain);
    let wq = cx.param(&format!("{prefix}.wq"), &[d, h * dh], Init::Normal { std }, ParamClass::Hidden);
    let wk = cx.param(&format!("{prefix}.wk"), &[d, hkv * dh], Init::Normal { std }, ParamClass::Hidden);
    let wv = cx.param(&format!("{prefix}.wv"), &[d, hkv * dh], Init::Normal { std }, ParamClass::Hidden);
    let wo_std = out_proj_std(cx, out_mult);
    let wo =
        cx.param(&format!("{prefix}.wo"), &[h * dh, d], Init::Normal { std: wo_std }, ParamClass::Hidden);

    let a = cx.rms_norm(u, Some(gain))?;
    let a = cx.operand(a)?;
    let q = cx.project(a, wq, false, false)?;
    let k = cx.project(a, wk, false, false)?;
    let v = cx.project(a, wv, false, false)?;
    let q = cx.reshape(q, &[b, t, h, dh])?;
    let k = cx.reshape(k, &[b, t, hkv, dh])?;
    let v = cx.reshape(v, &[b, t, hkv, dh])?;
    let scale = match &spec.parametrization {
        Parametrization::Standard => 1.0 / (dh as f64).sqrt(),
        Parametrization::MuP(m) => m.attn_mult / dh as f64,
    };
    let o = cx.g.add(Op::CausalAttention { scale, rope_base: Some(spec.rope_base) }, &[q, k, v])?;
    let o = cx.reshape(o, &[b, t, h * dh])?;
    cx.project(o, wo, false, false)
}

/// The FFN sublayer: SwiGLU or MoE, with its own pre-RMSNorm.
pub(super) fn ffn(cx: &mut Cx, u: NodeId, prefix: &str, out_mult: f64) -> Result<NodeId, GraphError> {
    let d = cx.spec.d_model;
    let gain = cx.param(&format!("{prefix}.norm"), &[d], Init::Ones, ParamClass::Gain);
    let x = cx.rms_norm(u, Some(gain))?;
    match cx.spec.ffn.clone() {
        FfnSpec::SwiGlu(s) => {
            let hidden = s.hidden.unwrap_or_else(|| FfnSpec::default_hidden(d));
            swiglu(cx, x, prefix, hidden, out_mult)
        }
        FfnSpec::Moe(m) => moe(cx, x, prefix, &m, out_mult),
    }
}

/// (silu(x W_1) * (x W_3)) W_2 on already-normalized x.
fn swiglu(cx: &mut Cx, x: NodeId, prefix: &str, hidden: usize, out_mult: f64) -> Result<NodeId, GraphError> {
    let d = cx.spec.d_model;
    let std = cx.hidden_std(cx.spec.init_std);
    let w1 = cx.param(&format!("{prefix}.w1"), &[d, hidden], Init::Normal { std }, ParamClass::Hidden);
    let w3 = cx.param(&format!("{prefix}.w3"), &[d, hidden], Init::Normal { std }, ParamClass::Hidden);
    let w2_std = out_proj_std(cx, out_mult);
    let w2 =
        cx.param(&format!("{prefix}.w2"), &[hidden, d], Init::Normal { std: w2_std }, ParamClass::Hidden);
    let x = cx.operand(x)?;
    let gate = cx.project(x, w1, false, false)?;
    let gate = cx.unary(UnaryOp::Silu, gate)?;
    let up = cx.project(x, w3, false, false)?;
    let inner = cx.mul(gate, up)?;
    cx.project(inner, w2, false, false)
}

/// Mixture of experts: gates from a router (softmax or sigmoid over E experts), the
/// top-k kept (ties to the lowest index) and the rest zeroed, routed SwiGLU experts
/// weighted by their gates, plus the always-on shared experts (one SwiGLU of width
/// shared x hidden, which equals the sum of `shared` experts of width `hidden`).
///
/// `dispatch` picks the routed experts' form (docs/math.md §1.6): Dense runs every expert
/// on every token and masks by the gate; Sparse permutes the tokens into per-expert groups
/// and runs only the routed work. Both give the same function when nothing is dropped.
///
/// `balance` (§1.6, "Load balancing"): with `BiasUpdate` the top-k choice ranks the gates
/// plus a per-expert bias (a parameter the trainer moves, not the optimizer) while the
/// kept gates stay the unbiased ones; with `AuxLoss` (or `seq_aux_coef` beside the bias)
/// the sublayer adds its auxiliary loss to the objective. Every MoE sublayer records its
/// expert loads for the trainer.
fn moe(
    cx: &mut Cx,
    x: NodeId,
    prefix: &str,
    m: &crate::spec::MoeSpec,
    out_mult: f64,
) -> Result<NodeId, GraphError> {
    let d = cx.spec.d_model;
    let (b, t) = (cx.shape(x)[0], cx.shape(x)[1]);
    let (e, hidden) = (m.experts, m.hidden);
    let std = cx.hidden_std(cx.spec.init_std);
    let router = cx.param(&format!("{prefix}.router"), &[d, e], Init::Normal { std }, ParamClass::Router);
    let scores = cx.matmul(x, router)?;
    let probs = match m.gate {
        MoeGate::Softmax => cx.g.add(Op::Softmax, &[scores])?,
        MoeGate::Sigmoid => cx.unary(UnaryOp::Sigmoid, scores)?,
    };
    let ranked = match m.balance {
        MoeBalance::BiasUpdate(_) => {
            let bias = cx.param(&router_bias_param(prefix), &[e], Init::Zeros, ParamClass::RouterBias);
            cx.add(probs, bias)?
        }
        MoeBalance::None | MoeBalance::AuxLoss(_) => probs,
    };
    let chosen = cx.g.add(Op::TopK { k: m.top_k, fixed: 0 }, &[ranked])?;
    let mut kept = cx.g.add(Op::Gather { axis: 2 }, &[probs, chosen])?;
    if m.renormalize {
        // g_i = p_i / Σ_{j∈I} p_j: the gradient reaches every kept gate through the sum.
        let total = cx.sum(kept, 2, true)?;
        kept = cx.g.add(Op::Binary(BinaryOp::Div), &[kept, total])?;
    }
    let one_hot = expert_one_hot(cx, chosen, e)?;
    let tokens = cx.reshape(one_hot, &[b * t, e])?;
    let load = cx.sum(tokens, 0, false)?;
    let aux_loss = match m.balance.aux_loss() {
        Some(a) => Some(aux_loss(cx, probs, (one_hot, load), m, &a)?),
        None => None,
    };
    cx.moe_layers.push(MoeLayer { prefix: prefix.to_string(), load, aux_loss });
    let routed = match m.dispatch {
        MoeDispatch::Dense => moe_dense(cx, x, prefix, m, out_mult, chosen, kept)?,
        MoeDispatch::Sparse => moe_sparse(cx, x, prefix, m, out_mult, chosen, kept)?,
    };
    let mut out = cx.reshape(routed, &[b, t, d])?;
    if m.shared > 0 {
        let shared = swiglu(cx, x, &format!("{prefix}.shared"), m.shared * hidden, out_mult)?;
        out = cx.add(out, shared)?;
    }
    Ok(out)
}

/// Which experts each token chose (docs/math.md §1.6): `[B, T, E]`, 1 where an expert is
/// among the token's `chosen` (`[B, T, k]`), else 0. Summed over tokens it is the expert
/// loads; built by a scatter of ones, so no gradient flows through it. Dense and Sparse
/// dispatch count the same router decision.
fn expert_one_hot(cx: &mut Cx, chosen: NodeId, experts: usize) -> Result<NodeId, GraphError> {
    let (b, t, k) = (cx.shape(chosen)[0], cx.shape(chosen)[1], cx.shape(chosen)[2]);
    let zeros = cx.constant(0.0, &[b, t, experts]);
    let ones = cx.constant(1.0, &[b, t, k]);
    cx.g.add(Op::ScatterRows { axis: 2 }, &[zeros, chosen, ones])
}

/// The auxiliary balance loss of one MoE sublayer (docs/math.md §1.6):
/// coef · E · Σ_e f_e · P_e with f_e the fraction of the assignments that chose e (no
/// gradient) and P_e the mean gate share of e, the gates normalized to sum 1 per token
/// (softmax gates already do; sigmoid gates are divided by their sum, DeepSeek-V3's s').
/// `per: Batch` takes f and P over the N tokens of the step; `per: Sequence` over each
/// sequence's T tokens, the B losses averaged (DeepSeek-V3's sequence-wise loss); f
/// counts the `one_hot` choices (over the batch, the layer's `load` already has them). At an even load and even shares it
/// is coef either way. A scalar.
fn aux_loss(
    cx: &mut Cx,
    probs: NodeId,
    (one_hot, load): (NodeId, NodeId),
    m: &crate::spec::MoeSpec,
    spec: &AuxLossSpec,
) -> Result<NodeId, GraphError> {
    let (b, t, e) = (cx.shape(probs)[0], cx.shape(probs)[1], cx.shape(probs)[2]);
    let n = b * t;
    let share = match m.gate {
        MoeGate::Softmax => probs,
        MoeGate::Sigmoid => {
            let total = cx.sum(probs, 2, true)?;
            cx.div(probs, total)?
        }
    };
    // The tokens in G groups of S: one group of all N (Batch), or the B sequences of T.
    let (groups, size) = match spec.per {
        AuxLossScope::Batch => (1, n),
        AuxLossScope::Sequence => (b, t),
    };
    let mean = |cx: &mut Cx, x, axis| cx.g.add(Op::Reduce { op: ReduceOp::Mean, axis, keepdim: false }, &[x]);
    // [G, E]: each group's mean share, and the fraction of its S·k assignments.
    let share = cx.reshape(share, &[groups, size, e])?;
    let mean_share = mean(cx, share, 1)?;
    // The batch's counts are the layer's `load`; sequences count their own.
    let loads = if groups == 1 {
        cx.reshape(load, &[1, e])?
    } else {
        let chose = cx.reshape(one_hot, &[groups, size, e])?;
        cx.sum(chose, 1, false)?
    };
    let fraction = cx.affine(loads, 1.0 / (size * m.top_k) as f64, 0.0)?;
    let product = cx.mul(fraction, mean_share)?;
    let per_group = cx.sum(product, 1, false)?;
    let total = mean(cx, per_group, 0)?;
    cx.affine(total, spec.coef * e as f64, 0.0)
}

/// The routed experts' weights w1, w3 [E, D, F] and w2 [E, F, D].
fn expert_weights(cx: &mut Cx, prefix: &str, m: &crate::spec::MoeSpec, out_mult: f64) -> [NodeId; 3] {
    let (d, e, hidden) = (cx.spec.d_model, m.experts, m.hidden);
    let std = cx.hidden_std(cx.spec.init_std);
    let w1 =
        cx.param(&format!("{prefix}.experts.w1"), &[e, d, hidden], Init::Normal { std }, ParamClass::Hidden);
    let w3 =
        cx.param(&format!("{prefix}.experts.w3"), &[e, d, hidden], Init::Normal { std }, ParamClass::Hidden);
    let w2_std = out_proj_std(cx, out_mult);
    let w2 = cx.param(
        &format!("{prefix}.experts.w2"),
        &[e, hidden, d],
        Init::Normal { std: w2_std },
        ParamClass::Hidden,
    );
    [w1, w3, w2]
}

/// Dense dispatch (docs/math.md §1.6): every expert on every token, each output scaled by
/// its gate (zero for the unchosen experts). The role's `active_fraction` tells the cost
/// model that a routed implementation does top_k / E of this work. Returns [B·T, D].
fn moe_dense(
    cx: &mut Cx,
    x: NodeId,
    prefix: &str,
    m: &crate::spec::MoeSpec,
    out_mult: f64,
    chosen: NodeId,
    kept: NodeId,
) -> Result<NodeId, GraphError> {
    let d = cx.spec.d_model;
    let (b, t) = (cx.shape(x)[0], cx.shape(x)[1]);
    let e = m.experts;
    let zeros = cx.constant(0.0, &[b, t, e]);
    let gates = cx.g.add(Op::ScatterRows { axis: 2 }, &[zeros, chosen, kept])?;

    let saved = cx.g.role();
    cx.set_role(saved.active_fraction(m.top_k as f64 / e as f64));
    let [w1, w3, w2] = expert_weights(cx, prefix, m, out_mult);
    // Expert matmuls are backbone projections (bf16 operands under mixed precision); the
    // router above and the gates stay f32 (docs/math.md §6.12).
    let flat = cx.reshape(x, &[1, b * t, d])?;
    let flat = cx.operand(flat)?;
    let gate = cx.project(flat, w1, false, false)?;
    let gate = cx.unary(UnaryOp::Silu, gate)?;
    let up = cx.project(flat, w3, false, false)?;
    let inner = cx.mul(gate, up)?;
    let expert_out = cx.project(inner, w2, false, false)?; // [E, B*T, D]
    let gates = cx.reshape(gates, &[b * t, e])?;
    let gates = cx.permute(gates, &[1, 0])?;
    let gates = cx.reshape(gates, &[e, b * t, 1])?;
    let weighted = cx.mul(expert_out, gates)?;
    let routed = cx.sum(weighted, 0, false)?;
    cx.set_role(saved);
    Ok(routed)
}

/// Sparse dispatch (docs/math.md §1.6): the token-slot assignments sorted by expert
/// (`MoeRoute`), each token's row gathered once per chosen expert, the SwiGLU experts as
/// grouped products over the contiguous groups, then every assignment's output gathered
/// back and summed with its gate. Dropped assignments (over capacity) sit past the groups,
/// where the grouped product leaves zeros. Returns [B·T, D].
fn moe_sparse(
    cx: &mut Cx,
    x: NodeId,
    prefix: &str,
    m: &crate::spec::MoeSpec,
    out_mult: f64,
    chosen: NodeId,
    kept: NodeId,
) -> Result<NodeId, GraphError> {
    let d = cx.spec.d_model;
    let (b, t) = (cx.shape(x)[0], cx.shape(x)[1]);
    let (n, k, e) = (b * t, m.top_k, m.experts);
    let capacity = m.capacity(n);
    let idx = cx.reshape(chosen, &[n, k])?;
    let route = |cx: &mut Cx, out| cx.g.add(Op::MoeRoute { experts: e, capacity, out }, &[idx]);
    let rows = route(cx, MoeRouteOut::Rows)?;
    let tokens = route(cx, MoeRouteOut::Tokens)?;
    let counts = route(cx, MoeRouteOut::Counts)?;
    // Each token uses top_k of the E experts' weights: the parameters' role says so to the
    // parameter count (active parameters); the grouped products count their own rows.
    let saved = cx.g.role();
    cx.set_role(saved.active_fraction(k as f64 / e as f64));
    let [w1, w3, w2] = expert_weights(cx, prefix, m, out_mult);
    cx.set_role(saved);
    let (w1, w3, w2) = (cx.operand(w1)?, cx.operand(w3)?, cx.operand(w2)?);
    let flat = cx.reshape(x, &[n, d])?;
    let flat = cx.operand(flat)?;
    let xs = cx.g.add(Op::Gather { axis: 0 }, &[flat, tokens])?; // [N·k, D], expert-sorted
    let grouped = Op::GroupedMatMul { trans_b: false };
    let gate = cx.g.add(grouped.clone(), &[xs, w1, counts])?;
    let gate = cx.unary(UnaryOp::Silu, gate)?;
    let up = cx.g.add(grouped.clone(), &[xs, w3, counts])?;
    let inner = cx.mul(gate, up)?;
    let inner = cx.operand(inner)?;
    let ys = cx.g.add(grouped, &[inner, w2, counts])?; // [N·k, D]
    let per_slot = cx.g.add(Op::Gather { axis: 0 }, &[ys, rows])?; // [N, k, D]
    let gates = cx.reshape(kept, &[n, k, 1])?;
    let weighted = cx.mul(per_slot, gates)?;
    cx.sum(weighted, 1, false)
}
