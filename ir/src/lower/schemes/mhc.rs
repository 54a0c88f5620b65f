//! Manifold-constrained hyper-connections, mHC (docs/math.md §4): n streams of width C,
//! per-token coefficients generated from the whole flattened state.
//!
//! Per sublayer, in the fused form of docs/math.md §4.3:
//! ```text
//! [h_pre, h_post, h_res] = NormProject(vec(X), phi)        reads nC once, norm folded after the matmul
//! logits = [a_pre, a_post, a_res] * [h_pre, h_post, h_res] + b
//! H_pre  = sigmoid(.) + pre_eps      [1, n]
//! H_post = post_max * sigmoid(.)     [n, 1]   (already the transposed write vector)
//! H_res  = Sinkhorn(mat(.))          [n, n]   output-major (docs/math.md §0.2)
//! u = H_pre X;   y = F(u);   X' = H_res X + H_post y
//! ```
//! Each application is one MatMul, so the unfused traffic is (5n+1)C read and
//! (3n+1)C written plus the O(n²) coefficient terms (docs/math.md §4.7).
//!
//! Parameter names (checkpoint keys), per sublayer prefix `P` (e.g. `blocks.0.attn`):
//! - `P.conn.phi`   `[nC, n²+2n]`, columns `[phi_pre | phi_post | phi_res]` in that order
//!   (§4.6 transpose hazard), `phi_res` row-major over (out, in); generator, weight decay;
//! - `P.conn.alpha` `[3]`: alpha_pre, alpha_post, alpha_res (init `alpha_init`, §4.4);
//! - `P.conn.bias`  `[n²+2n]`, laid out like the columns of phi (init per `bias_init`, §4.4).
//!
//! Global: `embed` `[V, C]`, replicated into the n streams (docs/math.md §4.4 DECISION).

use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass, ReduceOp, UnaryOp};
use crate::lower::schemes::residual::{embedding_table, lookup};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{Collapse, MhcBiasInit, MhcSpec, ModelSpec, ProjInit};

pub(crate) struct Mhc {
    cfg: MhcSpec,
    d: usize,
    embedding: Option<NodeId>,
}

impl Mhc {
    pub(crate) fn new(spec: &ModelSpec, cfg: &MhcSpec) -> Self {
        Mhc { cfg: cfg.clone(), d: spec.d_model, embedding: None }
    }

    /// The static bias b = [b_pre | b_post | b_res] of sublayer l (docs/math.md §4.4). The
    /// single-stream DECISION (convention 1): b_pre = +3 on the home stream l mod n and -3
    /// elsewhere, b_post = 0 (H_post = 1 at post_max = 2), b_res = 6I - 3 (H_res ≈ I).
    fn bias_init(&self, sublayer: usize) -> Vec<f64> {
        let n = self.cfg.n;
        let mut b = vec![0.0; n * n + 2 * n];
        if self.cfg.bias_init == MhcBiasInit::SingleStream {
            for (i, v) in b[..n].iter_mut().enumerate() {
                *v = if i == sublayer % n { 3.0 } else { -3.0 };
            }
            for i in 0..n {
                for j in 0..n {
                    b[2 * n + i * n + j] = if i == j { 3.0 } else { -3.0 };
                }
            }
        }
        b
    }
}

/// Stream creation by replication (docs/math.md §4.4, §6.7 DECISION): the embedding row of
/// each token copied into all `s` streams, `[B, T'] -> [B, T', s, C]`. The copy is a
/// broadcast view: no data moves until a consumer reads the state.
pub(crate) fn replicate_embedding(
    cx: &mut Cx,
    slot: &mut Option<NodeId>,
    ids: NodeId,
    s: usize,
) -> Result<NodeId, GraphError> {
    let table = embedding_table(cx, slot);
    let h = lookup(cx, table, ids)?;
    let (b, t, d) = (cx.shape(h)[0], cx.shape(h)[1], cx.shape(h)[2]);
    let h = cx.reshape(h, &[b, t, 1, d])?;
    cx.broadcast(h, &[b, t, s, d])
}

/// Sum of the streams, `[B, T', s, C] -> [B, T', C]` (docs/math.md §0.3; HC, mHC, xHC), or
/// their mean (the PaddleFleet option, §4.4). The final RMSNorm makes the two equivalent
/// up to its epsilon.
pub(crate) fn collapse_streams(cx: &mut Cx, state: NodeId, collapse: Collapse) -> Result<NodeId, GraphError> {
    let op = match collapse {
        Collapse::Sum => ReduceOp::Sum,
        Collapse::Mean => ReduceOp::Mean,
    };
    cx.g.add(Op::Reduce { op, axis: 2, keepdim: false }, &[state])
}

impl Scheme for Mhc {
    fn layout(&self) -> (usize, usize) {
        (self.cfg.n, self.d)
    }

    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        replicate_embedding(cx, &mut self.embedding, ids, self.cfg.n)
    }

    fn sublayer(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        sublayer: usize,
        _kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        cx.connection(sublayer);
        let (n, c) = (self.cfg.n, self.d);
        let m = n * n + 2 * n;
        let (b, t) = (cx.shape(state)[0], cx.shape(state)[1]);
        let prefix = format!("{}.conn", cx.sublayer_prefix(sublayer));

        let phi_init = match self.cfg.proj_init {
            ProjInit::Zero => Init::Zeros,
            // Glorot uniform over (fan_in, fan_out) = (nC, n² + 2n).
            ProjInit::Xavier => Init::Uniform { bound: (6.0 / (n * c + m) as f64).sqrt() },
        };
        let phi = cx.param(&format!("{prefix}.phi"), &[n * c, m], phi_init, ParamClass::ConnectionProjection);
        let alpha = cx.param(
            &format!("{prefix}.alpha"),
            &[3],
            Init::Constant(self.cfg.alpha_init),
            ParamClass::ConnectionStatic,
        );
        let bias = cx.param(
            &format!("{prefix}.bias"),
            &[m],
            Init::Values(self.bias_init(sublayer)),
            ParamClass::ConnectionStatic,
        );

        // Coefficient generation (§4.3): one read of the flattened state.
        let flat = cx.reshape(state, &[b, t, n * c])?;
        let raw = cx.g.add(Op::NormProject { eps: cx.spec.norm_eps, centered: 0 }, &[flat, phi])?;
        let scale = alpha_per_column(cx, alpha, n)?;
        let scaled = cx.mul(raw, scale)?;
        let logits = cx.add(scaled, bias)?;

        let pre = cx.slice(logits, 2, 0, n)?;
        let pre = cx.unary(UnaryOp::Sigmoid, pre)?;
        let pre = if self.cfg.pre_eps != 0.0 { cx.affine(pre, 1.0, self.cfg.pre_eps)? } else { pre };
        let pre = cx.reshape(pre, &[b, t, 1, n])?;
        let post = cx.slice(logits, 2, n, 2 * n)?;
        let post = cx.unary(UnaryOp::Sigmoid, post)?;
        let post = cx.affine(post, self.cfg.post_max, 0.0)?;
        let post = cx.reshape(post, &[b, t, n, 1])?;
        let res = cx.slice(logits, 2, 2 * n, m)?;
        let res = cx.reshape(res, &[b, t, n, n])?;
        let res =
            cx.g.add(Op::Sinkhorn { iters: self.cfg.sinkhorn_iters, eps: self.cfg.sinkhorn_eps }, &[res])?;

        // Read, branch, Carry + Write, merge.
        let u = cx.matmul(pre, state)?;
        let u = cx.reshape(u, &[b, t, c])?;
        let y = branch(cx, u)?;
        let y = cx.reshape(y, &[b, t, 1, c])?;
        let write = cx.matmul(post, y)?;
        let carry = cx.matmul(res, state)?;
        cx.add(carry, write)
    }

    fn collapse(&mut self, cx: &mut Cx, state: NodeId, _module: Option<usize>) -> Result<NodeId, GraphError> {
        collapse_streams(cx, state, self.cfg.collapse)
    }
}

/// The per-column gate `[a_pre x n | a_post x n | a_res x n²]` of the fused coefficient
/// vector, built from the `[3]` alpha parameter by views. Under muP the generator is a
/// readout and its 1/w forward multiplier is folded into the gate, a_eff = a / w
/// (docs/math.md §8.1 DECISION).
fn alpha_per_column(cx: &mut Cx, alpha: NodeId, n: usize) -> Result<NodeId, GraphError> {
    let mut parts = Vec::with_capacity(3);
    for (i, width) in [n, n, n * n].into_iter().enumerate() {
        let a = cx.slice(alpha, 0, i, i + 1)?;
        parts.push(cx.broadcast(a, &[width])?);
    }
    let scale = cx.concat(&parts, 0)?;
    let w = cx.width_mult();
    if w != 1.0 {
        cx.affine(scale, 1.0 / w, 0.0)
    } else {
        Ok(scale)
    }
}
