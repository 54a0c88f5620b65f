//! Expanded hyper-connections, xHC (docs/math.md §6): N streams of width C, of which k are
//! active per token and sublayer (m_f fixed plus k - m_f routed), a dense read over
//! all N streams, mixing and write-back on the active set only.
//!
//! Per sublayer l (full xHC, docs/math.md §6.2–§6.6):
//! ```text
//! [r, h] = NormProject(vec(X), [W^r | W^pre], centered = N)    one read of the state:
//!                                                              LayerNorm stats for the router,
//!                                                              RMSNorm stats for the pre map
//! s = sigmoid(r) (or softmax);  I = TopK(s);  p = (1 for fixed, s_I for routed)
//! H_pre = sigmoid(a_pre h + b_pre);  u = H_pre X;  out = F(u)
//! X_act = Gather(X, I)
//! [g_res, g_post] = NormProject(vec(X_act), [W^res | W^post])
//! H_res = rowclamp(Sinkhorn(a_res g_res + b_res));  H_post = 2 sigmoid(a_post g_post + b_post)
//! Y = [out; TemporalAugment(out)]   (augmented sublayers; else Y = [out])
//! X' = ScatterRows(X, I, H_res X_act + (diag(p) H_post) Y)
//! ```
//! p is folded into the small k x K_r matrix so that the wide tensors are touched only
//! by the ops of the docs/math.md §6.9 traffic derivation: (2N + 5k + K_r)C read (+C for the
//! conv input) and (4k + K_r)C written per sublayer. The Flash variants (§6.10, §6.11)
//! are in [`flash`].
//!
//! Parameter names (checkpoint keys), per sublayer prefix `P` (e.g. `blocks.0.ffn`):
//! - `P.conn.router` `[NC, N]` W^r, N(0, 1/(NC)) (§6.7 DECISION); absent when m_f = k
//!   (no routing). Under Flash it exists only on the first sublayer of a sharing window;
//! - `P.conn.pre` `[NC, N]` W^pre (zero), `P.conn.b_pre` `[N]`, `P.conn.alpha_pre` `[1]`;
//! - `P.conn.res` `[kC, k²]` W^res (zero, columns row-major over (out, in)),
//!   `P.conn.b_res` `[k, k]` (6I - 3), `P.conn.alpha_res` `[1]`; only on sublayers that
//!   mix (every sublayer in full xHC; the MLP under Flash, the last MLP under Flash-4sub);
//! - `P.conn.post` `[kC, k·K_r]` W^post (zero, row-major over (slot, component)),
//!   `P.conn.b_post` `[k, K_r]`, `P.conn.alpha_post` `[1]`;
//! - `P.conn.conv{j}` `[κ_j, C]`, j = 0..r, on augmented sublayers, U(±1/sqrt κ_j).
//!
//! Global: `embed` `[V, C]`, replicated into the N streams (§6.7 DECISION); collapse is
//! the sum of the streams (§6.6).

mod flash;

use crate::graph::Build;
use crate::graph::{BinaryOp, GraphError, Init, NodeId, Op, ParamClass, ReduceOp, UnaryOp};
use crate::lower::schemes::connection::{collapse_streams, replicate_embedding};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{AugSublayers, Flash, ModelSpec, OptimizerSpec, Router, XhcSpec};

pub(crate) struct Xhc {
    cfg: XhcSpec,
    d: usize,
    /// Gram–Schmidt in the temporal augmentation, resolved from the optimizer.
    gram_schmidt: bool,
    embedding: Option<NodeId>,
    /// Flash-4sub: the sharing window opened by the previous block, if any.
    window: Option<flash::Window>,
}

/// The routing decision of one sharing window (one sublayer in full xHC).
pub(super) struct Routing {
    /// Active stream indices I, i32 `[B, T, k]` (fixed first, then routed ascending).
    idx: NodeId,
    /// Write gates p `[B, T, k, 1]`, or None when every active stream is fixed (p = 1).
    p: Option<NodeId>,
    /// H_pre `[B, T, N]` of each sublayer the routing pass generated a pre map for.
    pre: Vec<NodeId>,
}

/// logit(q) = ln(q / (1 - q)).
fn logit(q: f64) -> f64 {
    (q / (1.0 - q)).ln()
}

impl Xhc {
    pub(crate) fn new(spec: &ModelSpec, cfg: &XhcSpec) -> Self {
        // GS on unless resolved false: true with AdamW, false with Muon (docs/math.md §6.5, §8.2).
        let gram_schmidt =
            cfg.gram_schmidt.unwrap_or(!matches!(spec.train.optimizer, OptimizerSpec::Muon(_)));
        Xhc { cfg: cfg.clone(), d: spec.d_model, gram_schmidt, embedding: None, window: None }
    }

    /// Whether a sublayer gets temporal augmentation (docs/math.md §6.5: MLP side by default).
    fn augmented(&self, kind: SublayerKind) -> bool {
        !self.cfg.conv_kernels.is_empty()
            && (kind == SublayerKind::Ffn || self.cfg.temporal_aug == AugSublayers::MlpAndAttention)
    }

    /// Write-back components K_r of a sublayer (docs/math.md §6.1).
    fn components(&self, kind: SublayerKind) -> usize {
        if self.augmented(kind) {
            self.cfg.conv_kernels.len() + 1
        } else {
            1
        }
    }

    /// Whether the router exists: with m_f = k every active stream is fixed (docs/math.md §10).
    fn routed(&self) -> bool {
        self.cfg.fixed < self.cfg.k
    }

    fn prefix(cx: &Cx, sublayer: usize) -> String {
        format!("{}.conn", cx.sublayer_prefix(sublayer))
    }

    /// A gate scalar alpha (init `alpha_init`, §6.7) as used in the forward pass: alpha / w
    /// under muP, where the generator it gates is a readout (docs/math.md §8.1 DECISION).
    fn alpha(&self, cx: &mut Cx, name: &str) -> Result<NodeId, GraphError> {
        let a = cx.param(name, &[1], Init::Constant(self.cfg.alpha_init), ParamClass::ConnectionStatic);
        let w = cx.width_mult();
        if w != 1.0 {
            cx.affine(a, 1.0 / w, 0.0)
        } else {
            Ok(a)
        }
    }

    /// b_pre of sublayer l (docs/math.md §6.7 DECISION): logit(0.95) on the home stream (fixed
    /// stream l mod m_f, or l mod N without fixed streams), logit(0.05 / (N - 1)) on every
    /// other stream, so that the total leakage is 5%.
    fn b_pre_init(&self, sublayer: usize) -> Vec<f64> {
        let n = self.cfg.n;
        let home = if self.cfg.fixed > 0 { sublayer % self.cfg.fixed } else { sublayer % n };
        let other = if n > 1 { logit(0.05 / (n - 1) as f64) } else { 0.0 };
        (0..n).map(|i| if i == home { logit(0.95) } else { other }).collect()
    }

    /// The routing pass at the window-entry state (docs/math.md §6.2–§6.3): one NormProject
    /// over `[W^r | W^pre_{l_1} | ... ]` (router columns mean-centred), the router gate,
    /// TopK, the write gates p and one H_pre per sublayer in `pre_for`.
    fn route(&self, cx: &mut Cx, state: NodeId, pre_for: &[usize]) -> Result<Routing, GraphError> {
        let (n, k, fixed, c) = (self.cfg.n, self.cfg.k, self.cfg.fixed, self.d);
        let (b, t) = (cx.shape(state)[0], cx.shape(state)[1]);
        let routed = self.routed();
        let mut weights = Vec::with_capacity(pre_for.len() + 1);
        if routed {
            let name = format!("{}.router", Self::prefix(cx, pre_for[0]));
            let std = (1.0 / (n * c) as f64).sqrt();
            weights.push(cx.param(
                &name,
                &[n * c, n],
                Init::Normal { std },
                ParamClass::ConnectionProjection,
            ));
        }
        for &l in pre_for {
            let name = format!("{}.pre", Self::prefix(cx, l));
            weights.push(cx.param(&name, &[n * c, n], Init::Zeros, ParamClass::ConnectionProjection));
        }
        let w = cx.concat(&weights, 1)?;
        let flat = cx.reshape(state, &[b, t, n * c])?;
        let centered = if routed { n } else { 0 };
        let proj = cx.g.add(Op::NormProject { eps: cx.spec.norm_eps, centered }, &[flat, w])?;

        let offset = if routed { n } else { 0 };
        let mut pre = Vec::with_capacity(pre_for.len());
        for (i, &l) in pre_for.iter().enumerate() {
            let prefix = Self::prefix(cx, l);
            let alpha = self.alpha(cx, &format!("{prefix}.alpha_pre"))?;
            let bias = cx.param(
                &format!("{prefix}.b_pre"),
                &[n],
                Init::Values(self.b_pre_init(l)),
                ParamClass::ConnectionStatic,
            );
            let h = cx.slice(proj, 2, offset + i * n, offset + (i + 1) * n)?;
            let h = cx.mul(h, alpha)?;
            let h = cx.add(h, bias)?;
            let h = cx.unary(UnaryOp::Sigmoid, h)?;
            label(cx, h, format!("{prefix}.h_pre"));
            pre.push(h);
        }

        if !routed {
            // Every active stream is fixed: TopK returns 0..k whatever its scores.
            let idx = cx.g.add(Op::TopK { k, fixed }, &[pre[0]])?;
            label(cx, idx, format!("{}.active", Self::prefix(cx, pre_for[0])));
            return Ok(Routing { idx, p: None, pre });
        }
        let r = cx.slice(proj, 2, 0, n)?;
        // The router is a readout too (§8.1); it has no gate to fold 1/w into.
        let w_mult = cx.width_mult();
        let r = if w_mult != 1.0 { cx.affine(r, 1.0 / w_mult, 0.0)? } else { r };
        let scores = match self.cfg.router {
            Router::Sigmoid => cx.unary(UnaryOp::Sigmoid, r)?,
            Router::Softmax => cx.g.add(Op::Softmax, &[r])?,
        };
        let idx = cx.g.add(Op::TopK { k, fixed }, &[scores])?;
        label(cx, idx, format!("{}.active", Self::prefix(cx, pre_for[0])));
        // p_j = 1 for fixed slots, s_{I_j} for routed ones (§6.2).
        let routed_idx = cx.slice(idx, 2, fixed, k)?;
        let gates = cx.g.add(Op::Gather { axis: 2 }, &[scores, routed_idx])?;
        let p = if fixed > 0 {
            let ones = cx.constant(1.0, &[b, t, fixed]);
            cx.concat(&[ones, gates], 2)?
        } else {
            gates
        };
        let p = cx.reshape(p, &[b, t, k, 1])?;
        Ok(Routing { idx, p: Some(p), pre })
    }

    /// The active-set maps of docs/math.md §6.4 from an active state `[B, T, k, C]`: one
    /// NormProject over `[W^res | W^post]` (RMS statistics), then H_res = Sinkhorn with
    /// the row clamp (when `mix`), and diag(p) H_post `[B, T, k, K_r]` with p folded in.
    fn active_maps(
        &self,
        cx: &mut Cx,
        x_act: NodeId,
        routing: &Routing,
        sublayer: usize,
        kind: SublayerKind,
        mix: bool,
    ) -> Result<(Option<NodeId>, NodeId), GraphError> {
        let (k, c) = (self.cfg.k, self.d);
        let kr = self.components(kind);
        let (b, t) = (cx.shape(x_act)[0], cx.shape(x_act)[1]);
        let prefix = Self::prefix(cx, sublayer);
        let mut weights = Vec::with_capacity(2);
        if mix {
            let name = format!("{prefix}.res");
            weights.push(cx.param(&name, &[k * c, k * k], Init::Zeros, ParamClass::ConnectionProjection));
        }
        let name = format!("{prefix}.post");
        weights.push(cx.param(&name, &[k * c, k * kr], Init::Zeros, ParamClass::ConnectionProjection));
        let w = cx.concat(&weights, 1)?;
        let flat = cx.reshape(x_act, &[b, t, k * c])?;
        let proj = cx.g.add(Op::NormProject { eps: cx.spec.norm_eps, centered: 0 }, &[flat, w])?;
        let post_at = if mix { k * k } else { 0 };

        let res = if mix {
            let alpha = self.alpha(cx, &format!("{prefix}.alpha_res"))?;
            // 6I - 3: H_res ≈ I at init (§6.7 DECISION, mHC convention 1).
            let init = (0..k * k).map(|i| if i / k == i % k { 3.0 } else { -3.0 }).collect();
            let bias = cx.param(
                &format!("{prefix}.b_res"),
                &[k, k],
                Init::Values(init),
                ParamClass::ConnectionStatic,
            );
            let h = cx.slice(proj, 2, 0, k * k)?;
            let h = cx.mul(h, alpha)?;
            let h = cx.reshape(h, &[b, t, k, k])?;
            let h = cx.add(h, bias)?;
            let h = cx.g.add(Op::Sinkhorn { iters: self.cfg.sinkhorn_iters, eps: 0.0 }, &[h])?;
            Some(if self.cfg.row_clamp { row_clamp(cx, h)? } else { h })
        } else {
            None
        };

        let alpha = self.alpha(cx, &format!("{prefix}.alpha_post"))?;
        // Column 0 (the raw output) 0, so 2 sigmoid = 1; conv components -3 (§6.7 DECISION).
        let init = (0..k * kr).map(|i| if i % kr == 0 { 0.0 } else { -3.0 }).collect();
        let bias =
            cx.param(&format!("{prefix}.b_post"), &[k, kr], Init::Values(init), ParamClass::ConnectionStatic);
        let h = cx.slice(proj, 2, post_at, post_at + k * kr)?;
        let h = cx.mul(h, alpha)?;
        let h = cx.reshape(h, &[b, t, k, kr])?;
        let h = cx.add(h, bias)?;
        let h = cx.unary(UnaryOp::Sigmoid, h)?;
        let h = cx.affine(h, 2.0, 0.0)?;
        let post = match routing.p {
            Some(p) => cx.mul(h, p)?,
            None => h,
        };
        Ok((res, post))
    }

    /// Runs the branch on `u` `[B, T, C]` and returns Y `[B, T, K_r, C]`: the output,
    /// followed on augmented sublayers by the temporal components (docs/math.md §6.5).
    fn branch_output(
        &self,
        cx: &mut Cx,
        u: NodeId,
        sublayer: usize,
        kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        let c = self.d;
        let (b, t) = (cx.shape(u)[0], cx.shape(u)[1]);
        let out = branch(cx, u)?;
        let row = cx.reshape(out, &[b, t, 1, c])?;
        if !self.augmented(kind) {
            return Ok(row);
        }
        let prefix = Self::prefix(cx, sublayer);
        let mut inputs = vec![out];
        for (j, &kappa) in self.cfg.conv_kernels.iter().enumerate() {
            // PyTorch Conv1d default init (§6.7 DECISION).
            let init = Init::Uniform { bound: 1.0 / (kappa as f64).sqrt() };
            inputs.push(cx.param(&format!("{prefix}.conv{j}"), &[kappa, c], init, ParamClass::Conv));
        }
        let op = Op::TemporalAugment { gram_schmidt: self.gram_schmidt, eps_rel: self.cfg.gs_eps };
        let aug = cx.g.add(op, &inputs)?;
        cx.concat(&[row, aug], 2)
    }
}

/// One sublayer on the active set: its maps, the branch, and the update
/// X_act' = H_res X_act + (diag(p) H_post) Y (docs/math.md §6.6), or X_act + (diag(p) H_post) Y
/// without mixing (the Flash variants' intermediate sublayers, §6.10–§6.11).
pub(super) struct Step {
    /// The updated active state `[B, T, k, C]`.
    x_act: NodeId,
    /// diag(p) H_post `[B, T, k, K_r]`.
    post: NodeId,
    /// The branch output with its temporal components, Y `[B, T, K_r, C]`.
    y: NodeId,
}

impl Xhc {
    /// Runs one sublayer of a window on the active state `x_act` with branch input `u`,
    /// generating H_res only when the sublayer mixes.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        cx: &mut Cx,
        routing: &Routing,
        x_act: NodeId,
        u: NodeId,
        sublayer: usize,
        kind: SublayerKind,
        branch: &mut Branch,
        mix: bool,
    ) -> Result<Step, GraphError> {
        label(cx, u, format!("{}.input", Self::prefix(cx, sublayer)));
        let (res, post) = self.active_maps(cx, x_act, routing, sublayer, kind, mix)?;
        let y = self.branch_output(cx, u, sublayer, kind, branch)?;
        let write = cx.matmul(post, y)?;
        let carried = match res {
            Some(res) => cx.matmul(res, x_act)?,
            None => x_act,
        };
        let x_new = cx.add(carried, write)?;
        label(cx, x_new, format!("{}.x_act", Self::prefix(cx, sublayer)));
        Ok(Step { x_act: x_new, post, y })
    }
}

/// Names a node (shown in dumps; lets tests find the branch inputs and active sets).
fn label(cx: &mut Cx, node: NodeId, name: String) {
    cx.g.node_mut(node).label = Some(name);
}

/// Dense read (docs/math.md §6.3): u = H_pre X as one MatMul, `[B, T, N] x [B, T, N, C] -> [B, T, C]`.
fn dense_read(cx: &mut Cx, pre: NodeId, state: NodeId) -> Result<NodeId, GraphError> {
    let d = cx.shape(state).to_vec();
    let (b, t, n, c) = (d[0], d[1], d[2], d[3]);
    let pre = cx.reshape(pre, &[b, t, 1, n])?;
    let u = cx.matmul(pre, state)?;
    cx.reshape(u, &[b, t, c])
}

/// The row clamp of docs/math.md §6.4, H[i, :] /= max(Σ_j H[i, j], 1), from primitives on the
/// small `[B, T, k, k]` tensor.
fn row_clamp(cx: &mut Cx, h: NodeId) -> Result<NodeId, GraphError> {
    let rows = cx.sum(h, 3, true)?;
    let one = cx.constant(1.0, &[1]);
    let denom = cx.binary(BinaryOp::Max, rows, one)?;
    cx.div(h, denom)
}

impl Scheme for Xhc {
    fn layout(&self) -> (usize, usize) {
        (self.cfg.n, self.d)
    }

    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        replicate_embedding(cx, &mut self.embedding, ids, self.cfg.n)
    }

    /// One full-xHC sublayer (docs/math.md §6.2–§6.6).
    fn sublayer(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        sublayer: usize,
        kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        cx.connection(sublayer);
        let routing = self.route(cx, state, &[sublayer])?;
        let u = dense_read(cx, routing.pre[0], state)?;
        let x_act = cx.g.add(Op::Gather { axis: 2 }, &[state, routing.idx])?;
        let step = self.step(cx, &routing, x_act, u, sublayer, kind, branch, true)?;
        cx.g.add(Op::ScatterRows { axis: 2 }, &[state, routing.idx, step.x_act])
    }

    fn block(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        first_sublayer: usize,
        attn: &mut Branch,
        ffn: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        match self.cfg.flash {
            Flash::None => {
                let mid = self.sublayer(cx, state, first_sublayer, SublayerKind::Attention, attn)?;
                let mid = cx.state(mid)?;
                self.sublayer(cx, mid, first_sublayer + 1, SublayerKind::Ffn, ffn)
            }
            Flash::Block => self.flash_block(cx, state, first_sublayer, attn, ffn),
            Flash::TwoBlock => self.flash_two_block(cx, state, first_sublayer, attn, ffn),
        }
    }

    fn collapse(&mut self, cx: &mut Cx, state: NodeId, _module: Option<usize>) -> Result<NodeId, GraphError> {
        collapse_streams(cx, state, ReduceOp::Sum)
    }
}
