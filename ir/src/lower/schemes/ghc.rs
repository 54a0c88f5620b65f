//! Generalized hyper-connections / Virtual Width Networks (docs/math.md §5), and the
//! Read / Carry / Write machinery HC (§2) and FC (§3) share with it: both are special
//! cases of GHC (§5.4), HC with one backbone segment (m = 1), FC with n = m slots.
//!
//! State `[B, T, n, d_b]`: n slots of width d_b = D/m, D' = n d_b (§5.1). One sublayer,
//! with output-major mixing matrices (§0.2; the paper's Å^T, Â^T, B^T):
//! ```text
//! X   = Read · H'          Read  = Å^T  [m, n]
//! z   = F(vec X);  Z = reshape(z, m × d_b)
//! H'' = Carry · H' + Write · Z          Carry = Â^T [n, n],  Write = B^T [n, m]
//! ```
//! Dynamic GHC (§5.5) generates per-token matrices from the per-slot RMSNorm of H'
//! (one gain of size d_b) with one MatMul by `[W_alpha | W_beta]`, scaled by 1/τ,
//! tanh, times S, plus the static matrices. The graph holds exactly the contractions
//! and the norm of the §5.9 cost table, so counting it gives 48·D at (m, n) = (2, 3).
//!
//! Parameter names (checkpoint keys); `{p}` is the sublayer prefix, e.g. `blocks.0.attn`:
//! - `embed_wide` `[V, D']`: the over-width embedding E_wide (embed_mode Full), or
//!   `embed` `[V, D]` (E_base) and `embed_expand` `[D, D']` (W_expand) in Expand mode (§5.2).
//! - `{p}.conn.h_pre` `[m, n]` = Å^T (init [I_m | 0]), `{p}.conn.h_res` `[n, n]` = Â^T
//!   (init I_n), `{p}.conn.h_post` `[n, m]` = B^T (cyclic init: slot j receives backbone
//!   segment j mod m), all output-major (§5.6).
//! - Dynamic only: `{p}.conn.norm` `[d_b]` (RMSNorm_seg gain), `{p}.conn.w_alpha`
//!   `[d_b, m + n]` (W_α: read then carry columns), `{p}.conn.w_beta` `[d_b, m]` (W_β),
//!   both zero-initialized; `{p}.conn.s_pre` `[m, n]`, `{p}.conn.s_res` `[n, n]`,
//!   `{p}.conn.s_post` `[n, m]`: S_α and S_β entry by entry in the layout of the matrix they
//!   scale (S_α = [s_pre^T | s_res^T], S_β = s_post^T), init `s_init`.
//! - `reduce.norm`, `reduce.norm_bias` `[D']`: the GroupNorm affine before the reduce
//!   (reduce_norm GroupNorm); `mtp.{k}.reduce.norm(_bias)` for MTP module k (§5.7 DECISION (b)).
//! - `reduce.w` `[D', D]`: W_reduce in the `x @ W` convention, shared by the trunk and the
//!   MTP modules; block-identity init keeps the first D coordinates (§5.6 DECISION).

use super::residual::{embedding_table, lookup};
use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass, UnaryOp};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{EmbedMode, GateAct, GhcSpec, ModelSpec, Parametrization, ReduceInit, ReduceNorm};

/// The output-major mixing matrices of one sublayer (docs/math.md §0.2, §0.3): `read`
/// `[.., m, s]`, `carry` `[.., s, s]` and `write` `[.., s, m]` (or `[.., s, 1]` for a
/// per-segment scale). Static matrices are parameters broadcast over `[B, T]`; dynamic
/// ones are per-token `[B, T, .., ..]` tensors.
pub(super) struct Mixing {
    pub read: NodeId,
    pub carry: NodeId,
    pub write: NodeId,
}

/// How the branch output Z `[B, T, m, d]` is written back into the s slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriteForm {
    /// Slot i receives Σ_j write[i, j] Z[j]: one MatMul (HC, GHC).
    Matrix,
    /// Slot i receives write[i] Z[i]: FC's per-fraction scale (docs/math.md §3 DECISION), s = m.
    PerSegment,
}

/// One sublayer in the unified form (docs/math.md §0.3): Read as one MatMul, the branch on
/// the flattened read, Carry as one MatMul, Write as one MatMul (or a per-segment scale),
/// merged by one Add. `state` is `[B, T, s, d]`.
pub(super) fn connect(
    cx: &mut Cx,
    state: NodeId,
    mixing: &Mixing,
    form: WriteForm,
    branch: &mut Branch,
) -> Result<NodeId, GraphError> {
    let dims = cx.shape(state).to_vec();
    let (b, t, d) = (dims[0], dims[1], dims[3]);
    let read = cx.matmul(mixing.read, state)?;
    let m = cx.shape(read)[2];
    let u = cx.reshape(read, &[b, t, m * d])?;
    let y = branch(cx, u)?;
    let z = cx.reshape(y, &[b, t, m, d])?;
    let carried = cx.matmul(mixing.carry, state)?;
    let written = match form {
        WriteForm::Matrix => cx.matmul(mixing.write, z)?,
        WriteForm::PerSegment => cx.mul(z, mixing.write)?,
    };
    cx.add(carried, written)
}

/// Dynamic coefficients in the row-per-slot layout of VWN Alg. 2 (docs/math.md §5.5; HC Alg. 2,
/// FC Eqs. 11–14 have the same shape): `act(mult · H̄ [W_alpha | W_beta])`, `[B, T, s, m + s + w]`,
/// one MatMul over the normalized state `normed` `[B, T, s, d]`. Row i depends only on slot i.
/// Its column blocks are slot i's read weights (m), carry weights (s) and write weights (w);
/// the first two are transposed (free views) into the output-major `read` `[B, T, m, s]` and
/// `carry` `[B, T, s, s]`, while the write block is already output-major.
pub(super) fn generate(
    cx: &mut Cx,
    normed: NodeId,
    w_alpha: NodeId,
    w_beta: NodeId,
    m: usize,
    mult: f64,
    act: GateAct,
) -> Result<Mixing, GraphError> {
    let w = cx.concat(&[w_alpha, w_beta], 1)?;
    let mut coef = cx.matmul(normed, w)?;
    if mult != 1.0 {
        coef = cx.affine(coef, mult, 0.0)?;
    }
    if act == GateAct::Tanh {
        coef = cx.unary(UnaryOp::Tanh, coef)?;
    }
    let dims = cx.shape(coef).to_vec();
    let (s, cols) = (dims[2], dims[3]);
    let read = cx.slice(coef, 3, 0, m)?;
    let read = cx.permute(read, &[0, 1, 3, 2])?;
    let carry = cx.slice(coef, 3, m, m + s)?;
    let carry = cx.permute(carry, &[0, 1, 3, 2])?;
    let write = cx.slice(coef, 3, m + s, cols)?;
    Ok(Mixing { read, carry, write })
}

/// `delta · scale + base`, matrix by matrix: the gated dynamic part plus the static
/// matrices (docs/math.md §2.3, §3, §5.5). Scales broadcast (HC/FC scalars, GHC S matrices).
pub(super) fn scale_and_offset(
    cx: &mut Cx,
    delta: Mixing,
    scale: [NodeId; 3],
    base: &Mixing,
) -> Result<Mixing, GraphError> {
    let read = cx.mul(delta.read, scale[0])?;
    let read = cx.add(read, base.read)?;
    let carry = cx.mul(delta.carry, scale[1])?;
    let carry = cx.add(carry, base.carry)?;
    let write = cx.mul(delta.write, scale[2])?;
    let write = cx.add(write, base.write)?;
    Ok(Mixing { read, carry, write })
}

/// B^T `[n, m]` with the cyclic init of docs/math.md §5.6: slot j receives segment j mod m.
fn cyclic_write(n: usize, m: usize) -> Vec<f64> {
    (0..n * m).map(|k| if (k / m) % m == k % m { 1.0 } else { 0.0 }).collect()
}

pub(crate) struct Ghc {
    spec: GhcSpec,
    d: usize,
    /// Segment width d_b = D/m.
    db: usize,
    /// E_wide (Full) or E_base (Expand), created once and shared with MTP modules.
    table: Option<NodeId>,
    /// W_expand (Expand mode), created once.
    expand: Option<NodeId>,
    /// W_reduce, shared by the trunk and every MTP module (docs/math.md §5.7 DECISION (b)).
    reduce: Option<NodeId>,
}

impl Ghc {
    pub(crate) fn new(model: &ModelSpec, spec: &GhcSpec) -> Self {
        let d = model.d_model;
        Ghc { spec: spec.clone(), d, db: spec.segment_width(d), table: None, expand: None, reduce: None }
    }

    /// Over-width D' = n d_b.
    fn wide(&self) -> usize {
        self.spec.n * self.db
    }

    /// The temperature actually applied, τ_eff. Under muP the generators are readouts
    /// with a 1/w forward multiplier folded into τ: τ_eff = τ_base · w, where τ_base is
    /// the knob's value at the base width (default √(d_b,base)) (docs/math.md §8.1 DECISION).
    fn tau_eff(&self, cx: &Cx) -> f64 {
        match &cx.spec.parametrization {
            Parametrization::Standard => self.spec.tau(self.d),
            Parametrization::MuP(mup) => self.spec.tau(mup.base_width) * cx.width_mult(),
        }
    }

    /// W_reduce `[D', D]`, created on first use (docs/math.md §5.6 DECISION: block identity,
    /// or N(0, 1/D') which is already the muP hidden variance 1/fan_in).
    fn reduce_weight(&mut self, cx: &mut Cx) -> NodeId {
        let (wide, d) = (self.wide(), self.d);
        let init = match self.spec.reduce_init {
            ReduceInit::BlockIdentity => Init::Eye,
            ReduceInit::Normal => Init::Normal { std: 1.0 / (wide as f64).sqrt() },
        };
        *self.reduce.get_or_insert_with(|| cx.param("reduce.w", &[wide, d], init, ParamClass::Hidden))
    }
}

impl Scheme for Ghc {
    fn layout(&self) -> (usize, usize) {
        (self.spec.n, self.db)
    }

    /// The over-width embedding (docs/math.md §5.2): E_wide[tok], or E_base[tok] W_expand, as n
    /// slots of width d_b. Both tables draw N(0, init_std^2) like the baseline embedding
    /// (§5.6 DECISION); W_expand draws N(0, 1/D).
    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        let (b, t) = (cx.shape(ids)[0], cx.shape(ids)[1]);
        let (v, d, wide, std) = (cx.spec.model_vocab(), self.d, self.wide(), cx.spec.init_std);
        let flat = match self.spec.embed_mode {
            EmbedMode::Full => {
                let table = *self.table.get_or_insert_with(|| {
                    cx.param("embed_wide", &[v, wide], Init::Normal { std }, ParamClass::Embedding)
                });
                if wide == d {
                    // n = m: E_wide is a V x D table a tied head can use.
                    cx.embedding_table = Some(table);
                }
                lookup(cx, table, ids)?
            }
            EmbedMode::Expand => {
                let table = embedding_table(cx, &mut self.table);
                let std = 1.0 / (d as f64).sqrt();
                let expand = *self.expand.get_or_insert_with(|| {
                    cx.param("embed_expand", &[d, wide], Init::Normal { std }, ParamClass::Hidden)
                });
                let base = lookup(cx, table, ids)?;
                cx.project(base, expand, false, false)?
            }
        };
        cx.reshape(flat, &[b, t, self.spec.n, self.db])
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
        let p = format!("{}.conn", cx.sublayer_prefix(sublayer));
        let (m, n, db) = (self.spec.m, self.spec.n, self.db);
        let stat = ParamClass::ConnectionStatic;
        let base = Mixing {
            read: cx.param(&format!("{p}.h_pre"), &[m, n], Init::Eye, stat),
            carry: cx.param(&format!("{p}.h_res"), &[n, n], Init::Eye, stat),
            write: cx.param(&format!("{p}.h_post"), &[n, m], Init::Values(cyclic_write(n, m)), stat),
        };
        let mixing = if self.spec.dynamic {
            let gain = cx.param(&format!("{p}.norm"), &[db], Init::Ones, ParamClass::Gain);
            let proj = ParamClass::ConnectionProjection;
            let w_alpha = cx.param(&format!("{p}.w_alpha"), &[db, m + n], Init::Zeros, proj);
            let w_beta = cx.param(&format!("{p}.w_beta"), &[db, m], Init::Zeros, proj);
            let s = Init::Constant(self.spec.s_init);
            let scale = [
                cx.param(&format!("{p}.s_pre"), &[m, n], s.clone(), stat),
                cx.param(&format!("{p}.s_res"), &[n, n], s.clone(), stat),
                cx.param(&format!("{p}.s_post"), &[n, m], s, stat),
            ];
            let normed = cx.rms_norm(state, Some(gain))?;
            let delta = generate(cx, normed, w_alpha, w_beta, m, 1.0 / self.tau_eff(cx), GateAct::Tanh)?;
            scale_and_offset(cx, delta, scale, &base)?
        } else {
            base
        };
        connect(cx, state, &mixing, WriteForm::Matrix, branch)
    }

    /// Reduce (docs/math.md §5.2, Alg. 1): GroupNorm with groups of size D (r = n/m groups over
    /// D', per-channel affine) when enabled, then `x @ W_reduce` to `[B, T', D]`.
    fn collapse(&mut self, cx: &mut Cx, state: NodeId, module: Option<usize>) -> Result<NodeId, GraphError> {
        let dims = cx.shape(state).to_vec();
        let (m, n, wide) = (self.spec.m, self.spec.n, self.wide());
        let flat = cx.reshape(state, &[dims[0], dims[1], wide])?;
        let normed = match self.spec.reduce_norm() {
            ReduceNorm::GroupNorm => {
                if n % m != 0 {
                    return Err(GraphError::Invalid {
                        op: "group_norm".into(),
                        message: format!("reduce_norm GroupNorm needs n = {n} to be a multiple of m = {m}"),
                    });
                }
                let prefix = match module {
                    None => "reduce".to_string(),
                    Some(k) => format!("mtp.{k}.reduce"),
                };
                let gain = cx.param(&format!("{prefix}.norm"), &[wide], Init::Ones, ParamClass::Gain);
                let bias = cx.param(&format!("{prefix}.norm_bias"), &[wide], Init::Zeros, ParamClass::Gain);
                let eps = cx.spec.norm_eps;
                cx.g.add(Op::GroupNorm { groups: n / m, eps }, &[flat, gain, bias])?
            }
            ReduceNorm::Off => flat,
        };
        let w = self.reduce_weight(cx);
        cx.project(normed, w, false, false)
    }
}

#[cfg(test)]
mod tests {
    use super::cyclic_write;

    #[test]
    fn cyclic_write_sends_segment_i_to_every_slot_congruent_to_i() {
        // (m, n) = (2, 3): B = [[1, 0, 1], [0, 1, 0]], stored as B^T [3, 2].
        assert_eq!(cyclic_write(3, 2), vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
        // n = m: the identity (docs/math.md §5.4, FC).
        assert_eq!(cyclic_write(2, 2), vec![1.0, 0.0, 0.0, 1.0]);
    }
}
