//! Frac-connections (docs/math.md §3): the hidden state split into m fractions of width
//! D/m, state `[B, T, m, D/m]`; total width stays D.
//!
//! The paper's FC matrix [[0, B], [Y, A]] lowers to output-major matrices (§0.2):
//! H_pre = Y^T `[m, m]` (read), H_res = A^T `[m, m]` (carry) and a per-fraction write
//! scale β `[m, 1]` (fraction i of the output times β_i, §3 DECISION). It is GHC with
//! n = m (§5.4) and shares its Read / Carry / Write lowering. Streams are created by
//! splitting the embedding and collapsed by reshaping back to D.
//!
//! Parameter names (checkpoint keys); `{p}` is the sublayer prefix, e.g. `blocks.0.attn`:
//! - `embed` `[V, D]`: the token embedding, split into m fractions.
//! - `{p}.conn.h_pre` `[m, m]` = Y^T (init I), `{p}.conn.h_res` `[m, m]` = A^T (init I),
//!   `{p}.conn.h_post` `[m, 1]` = B^T, the per-fraction write scale (init 1).
//! - Dynamic only (DFC, Eqs. 11–14): `{p}.conn.norm` `[D/m]` (per-fraction RMSNorm gain);
//!   `{p}.conn.w_alpha` `[D/m, 2m]` = [W_γ | W_α] and `{p}.conn.w_beta` `[D/m, 1]` = W_β
//!   (zero init); `{p}.conn.s_alpha`, `{p}.conn.s_beta` `[1]` (init `scale_init`).

use super::ghc::{connect, generate, scale_and_offset, Mixing, WriteForm};
use super::residual::{embedding_table, lookup};
use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, ParamClass};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{FcSpec, ModelSpec};

pub(crate) struct Fc {
    spec: FcSpec,
    d: usize,
    /// Fraction width D/m.
    df: usize,
    /// The embedding E, created once and shared with MTP modules and a tied head.
    table: Option<NodeId>,
}

impl Fc {
    pub(crate) fn new(model: &ModelSpec, spec: &FcSpec) -> Self {
        let d = model.d_model;
        Fc { spec: spec.clone(), d, df: d / spec.m.max(1), table: None }
    }
}

impl Scheme for Fc {
    fn layout(&self) -> (usize, usize) {
        (self.spec.m, self.df)
    }

    /// H^0 = reshape(E[tok], (m, D/m)) (docs/math.md §3, Eq. 6).
    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        let (b, t) = (cx.shape(ids)[0], cx.shape(ids)[1]);
        let table = embedding_table(cx, &mut self.table);
        let h = lookup(cx, table, ids)?;
        cx.reshape(h, &[b, t, self.spec.m, self.df])
    }

    /// SFC or DFC (docs/math.md §3) with the Pre-Norm-equivalent init of Eq. 15.
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
        let (m, df) = (self.spec.m, self.df);
        let stat = ParamClass::ConnectionStatic;
        let base = Mixing {
            read: cx.param(&format!("{p}.h_pre"), &[m, m], Init::Eye, stat),
            carry: cx.param(&format!("{p}.h_res"), &[m, m], Init::Eye, stat),
            write: cx.param(&format!("{p}.h_post"), &[m, 1], Init::Ones, stat),
        };
        let mixing = if self.spec.dynamic {
            let gain = cx.param(&format!("{p}.norm"), &[df], Init::Ones, ParamClass::Gain);
            let proj = ParamClass::ConnectionProjection;
            let w_alpha = cx.param(&format!("{p}.w_alpha"), &[df, 2 * m], Init::Zeros, proj);
            let w_beta = cx.param(&format!("{p}.w_beta"), &[df, 1], Init::Zeros, proj);
            let s = Init::Constant(self.spec.scale_init);
            let s_alpha = cx.param(&format!("{p}.s_alpha"), &[1], s.clone(), stat);
            let s_beta = cx.param(&format!("{p}.s_beta"), &[1], s, stat);
            let normed = cx.rms_norm(state, Some(gain))?;
            // muP: the generators are readouts with a constant 1/w forward multiplier (§8.1).
            let mult = 1.0 / cx.width_mult();
            let delta = generate(cx, normed, w_alpha, w_beta, m, mult, self.spec.act)?;
            scale_and_offset(cx, delta, [s_alpha, s_alpha, s_beta], &base)?
        } else {
            base
        };
        connect(cx, state, &mixing, WriteForm::PerSegment, branch)
    }

    /// h_L = reshape(H_L, (D,)) (docs/math.md §3).
    fn collapse(&mut self, cx: &mut Cx, state: NodeId, _module: Option<usize>) -> Result<NodeId, GraphError> {
        let dims = cx.shape(state).to_vec();
        cx.reshape(state, &[dims[0], dims[1], self.d])
    }
}
