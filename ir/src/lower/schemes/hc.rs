//! Hyper-connections (docs/math.md §2): n streams of width D, state `[B, T, n, D]`.
//!
//! The paper's HC matrix [[0, B], [A_m, A_r]] lowers to output-major matrices (§0.2):
//! H_pre = A_m^T `[1, n]` (read), H_res = A_r^T `[n, n]` (carry) and the write matrix
//! B^T `[n, 1]`, so one sublayer is GHC with one backbone segment (§5.4) and shares its
//! Read / Carry / Write lowering. Streams are created by replicating the embedding and
//! collapsed by summing them (§2.1).
//!
//! Parameter names (checkpoint keys); `{p}` is the sublayer prefix, e.g. `blocks.0.attn`:
//! - `embed` `[V, D]`: the token embedding, replicated into the n streams.
//! - `{p}.conn.h_pre` `[1, n]` = A_m^T (init e_{l mod n}, l the global sublayer index),
//!   `{p}.conn.h_res` `[n, n]` = A_r^T (init I), `{p}.conn.h_post` `[n, 1]` = B^T (init 1).
//! - Dynamic only (DHC, §2.3): `{p}.conn.norm` `[D]` (gain of the per-stream norm) and, for
//!   LayerNorm, `{p}.conn.norm_bias` `[D]`; `{p}.conn.w_alpha` `[D, n + 1]` = [W_m | W_r] and
//!   `{p}.conn.w_beta` `[D, 1]` = W_β (zero init); `{p}.conn.s_alpha`, `{p}.conn.s_beta` `[1]`
//!   (init `scale_init`).

use super::ghc::{connect, generate, scale_and_offset, Mixing, WriteForm};
use super::residual::{embedding_table, lookup};
use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{GenNorm, HcSpec, ModelSpec, OutProjStdMult};

pub(crate) struct Hc {
    spec: HcSpec,
    d: usize,
    /// The embedding E, created once and shared with MTP modules and a tied head.
    table: Option<NodeId>,
}

impl Hc {
    pub(crate) fn new(model: &ModelSpec, spec: &HcSpec) -> Self {
        Hc { spec: spec.clone(), d: model.d_model, table: None }
    }
}

impl Scheme for Hc {
    fn layout(&self) -> (usize, usize) {
        (self.spec.n, self.d)
    }

    /// H^0 = replicate(E[tok]): n identical rows as a broadcast view (docs/math.md §2.1).
    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        let (b, t) = (cx.shape(ids)[0], cx.shape(ids)[1]);
        let table = embedding_table(cx, &mut self.table);
        let h = lookup(cx, table, ids)?;
        let h = cx.reshape(h, &[b, t, 1, self.d])?;
        cx.broadcast(h, &[b, t, self.spec.n, self.d])
    }

    /// SHC (§2.2) or DHC (§2.3) with the init of §2.4: every stream equals the Pre-Norm
    /// residual at step 0.
    fn sublayer(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        sublayer: usize,
        _kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        cx.connection(sublayer);
        let p = format!("{}.conn", cx.sublayer_prefix(sublayer));
        let (n, d) = (self.spec.n, self.d);
        let stat = ParamClass::ConnectionStatic;
        let home = sublayer % n;
        let read_init: Vec<f64> = (0..n).map(|j| if j == home { 1.0 } else { 0.0 }).collect();
        let base = Mixing {
            read: cx.param(&format!("{p}.h_pre"), &[1, n], Init::Values(read_init), stat),
            carry: cx.param(&format!("{p}.h_res"), &[n, n], Init::Eye, stat),
            write: cx.param(&format!("{p}.h_post"), &[n, 1], Init::Ones, stat),
        };
        let mixing = if self.spec.dynamic {
            let gain = cx.param(&format!("{p}.norm"), &[d], Init::Ones, ParamClass::Gain);
            let normed = match self.spec.gen_norm {
                GenNorm::LayerNorm => {
                    let bias = cx.param(&format!("{p}.norm_bias"), &[d], Init::Zeros, ParamClass::Gain);
                    let eps = cx.spec.norm_eps;
                    cx.g.add(Op::LayerNorm { eps }, &[state, gain, bias])?
                }
                GenNorm::RmsNorm => cx.rms_norm(state, Some(gain))?,
            };
            let proj = ParamClass::ConnectionProjection;
            let w_alpha = cx.param(&format!("{p}.w_alpha"), &[d, n + 1], Init::Zeros, proj);
            let w_beta = cx.param(&format!("{p}.w_beta"), &[d, 1], Init::Zeros, proj);
            let s = Init::Constant(self.spec.scale_init);
            let s_alpha = cx.param(&format!("{p}.s_alpha"), &[1], s.clone(), stat);
            let s_beta = cx.param(&format!("{p}.s_beta"), &[1], s, stat);
            // muP: the generators are readouts with a constant 1/w forward multiplier (§8.1).
            let mult = 1.0 / cx.width_mult();
            let delta = generate(cx, normed, w_alpha, w_beta, 1, mult, self.spec.act)?;
            scale_and_offset(cx, delta, [s_alpha, s_alpha, s_beta], &base)?
        } else {
            base
        };
        connect(cx, state, &mixing, WriteForm::Matrix, branch)
    }

    /// h = Σ_i h_i (docs/math.md §2.1).
    fn collapse(&mut self, cx: &mut Cx, state: NodeId, _module: Option<usize>) -> Result<NodeId, GraphError> {
        cx.sum(state, 2, false)
    }

    /// The output projections' init std times 1/√n, √n or 1 (docs/math.md §2.4 DECISION: 1/√n
    /// damps the n-fold amplification of the final sum).
    fn out_proj_std_mult(&self) -> f64 {
        let root = (self.spec.n as f64).sqrt();
        match self.spec.out_proj_std_mult {
            OutProjStdMult::One => 1.0,
            OutProjStdMult::InvSqrtN => 1.0 / root,
            OutProjStdMult::SqrtN => root,
        }
    }
}
