//! The connection language's lowering (docs/connections.md, docs/math.md §12): one
//! implementation of the unified Read / Carry / Write form of docs/math.md §0.3 for every
//! design written as a [`ConnectionSpec`], and for HC (§2), FC (§3), mHC (§4) and GHC / VWN
//! (§5), which are spellings of it (`ConnectionSpec::hc` and its siblings).
//!
//! State `[B, T, s, d_s]`, d_s = D/m. One sublayer, output-major (§0.2):
//! ```text
//! X   = Read · H            Read `[m, s]`
//! z   = F(vec X);  Z = reshape(z, m × d_s)
//! H'' = Carry · H + Write · Z          Carry `[s, s]` (or ρ ⊙ H),  Write `[s, m]` (or w ⊙ Z)
//! ```
//! each coefficient being `constraint(static + dynamic)`. The dynamic part comes from the
//! generator: per slot (`PerSlot`: the slot's norm times `[W_alpha | W_beta]`, scaled by 1/τ,
//! activated, gated, §5.5) or from the whole state (`Flat`: RMSNorm(vec H) φ, gated by α and
//! offset by the static bias b, §4.3).
//!
//! Parameter names (checkpoint keys); `{p}` is the sublayer prefix, e.g. `blocks.0.attn`:
//! - Static parts, without a generator or with `PerSlot`: `{p}.conn.h_pre` `[m, s]`,
//!   `{p}.conn.h_res` `[s, s]` (`[s, 1]` per slot), `{p}.conn.h_post` `[s, m]` (`[s, 1]`).
//! - `PerSlot`: `{p}.conn.norm` `[d_s]` (and `{p}.conn.norm_bias` for LayerNorm),
//!   `{p}.conn.w_alpha` `[d_s, m + c]` (read, then c carry columns: s, or 1 per slot),
//!   `{p}.conn.w_beta` `[d_s, w]` (write: m, or 1 per slot); the gate `{p}.conn.s_alpha`,
//!   `{p}.conn.s_beta` `[1]` (`Paired`) or `{p}.conn.s_pre`, `s_res`, `s_post` in the layout
//!   of their matrix (`Entrywise`).
//! - `Flat`: `{p}.conn.phi` `[s·d_s, cols]` and `{p}.conn.bias` `[cols]`, columns
//!   `[read | write | carry]` (§4.6), `{p}.conn.alpha` `[3]` (read, write, carry), and with
//!   `gain` the norm gain `{p}.conn.norm` `[s·d_s]`.
//! - `Permutations`: the constant table `conn.permutations` `[s!, s²]` (never optimized);
//!   `Kronecker`: the constant table `conn.kronecker` `[2K, s²]` (§12.6).
//! - Creation: `embed` `[V, D]` (`Replicate`, `Split`), `embed_wide` `[V, s·d_s]` or
//!   `embed` + `embed_expand` (`Wide`, §5.2). Collapse: `reduce.norm`, `reduce.norm_bias`,
//!   `reduce.w` (`Reduce`, §5.6; `mtp.{k}.reduce.norm*` per MTP module), `collapse.readout`
//!   `[1, s]` (`Readout`).

use super::residual::{embedding_table, lookup};
use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass, ReduceOp, UnaryOp};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{
    CoefInit, CollapseRule, ConnectionSpec, Constraint, Create, EmbedMode, FlatGenerator, Form, GateAct,
    GenNorm, Generator, ModelSpec, OutProjStdMult, Parametrization, PerSlotGenerator, ProjInit, ReduceInit,
    ReduceNorm,
};

/// The output-major mixing matrices of one sublayer (docs/math.md §0.2, §0.3): `read`
/// `[.., m, s]`, `carry` `[.., s, s]` (or `[.., s, 1]`) and `write` `[.., s, m]` (or
/// `[.., s, 1]`). Static matrices are parameters broadcast over `[B, T]`; dynamic ones are
/// per-token `[B, T, .., ..]` tensors.
struct Mixing {
    read: NodeId,
    carry: NodeId,
    write: NodeId,
}

/// Which of the three coefficients (docs/math.md §0.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Read,
    Carry,
    Write,
}

pub(crate) struct Connection {
    spec: ConnectionSpec,
    d: usize,
    /// Slot width d_s = D/m.
    ds: usize,
    /// The embedding (E, E_wide or E_base), created once and shared with MTP modules.
    table: Option<NodeId>,
    /// W_expand (`Wide(Expand)`), created once.
    expand: Option<NodeId>,
    /// W_reduce or the readout weights, shared by the trunk and every MTP module
    /// (docs/math.md §5.7 DECISION (b)).
    exit: Option<NodeId>,
    /// The permutation table of `Permutations`, created once.
    permutations: Option<NodeId>,
    /// The factor table of `Kronecker`, created once.
    kronecker: Option<NodeId>,
}

impl Connection {
    pub(crate) fn new(model: &ModelSpec, spec: ConnectionSpec) -> Self {
        let d = model.d_model;
        let ds = spec.slot_width(d);
        Connection { spec, d, ds, table: None, expand: None, exit: None, permutations: None, kronecker: None }
    }

    fn s(&self) -> usize {
        self.spec.streams
    }

    fn m(&self) -> usize {
        self.spec.segments
    }

    /// `[rows, cols]` of a coefficient's matrix (its logits may differ: `Permutations`).
    fn matrix_shape(&self, which: Which) -> [usize; 2] {
        let (s, m) = (self.s(), self.m());
        match which {
            Which::Read => [m, s],
            Which::Carry => match self.spec.carry.form {
                Form::Matrix => [s, s],
                Form::PerSlot => [s, 1],
            },
            Which::Write => match self.spec.write.form {
                Form::Matrix => [s, m],
                Form::PerSlot => [s, 1],
            },
        }
    }

    fn coefficient(&self, which: Which) -> &crate::spec::Coefficient {
        match which {
            Which::Read => &self.spec.read,
            Which::Carry => &self.spec.carry,
            Which::Write => &self.spec.write,
        }
    }

    /// The number of logits of a coefficient: its entries, or s! for `Permutations` (counted,
    /// not enumerated: the table is built once, in `permutation_table`).
    fn logits(&self, which: Which) -> usize {
        match self.coefficient(which).constraint {
            Constraint::Permutations => (1..=self.s()).product(),
            Constraint::Kronecker => 2 * crate::spec::kronecker_factors(self.s()).unwrap_or(0),
            _ => {
                let [r, c] = self.matrix_shape(which);
                r * c
            }
        }
    }

    /// Whether a coefficient's logits are not its matrix's entries (a vector of them).
    fn structured(&self, which: Which) -> bool {
        matches!(self.coefficient(which).constraint, Constraint::Permutations | Constraint::Kronecker)
    }

    /// The static part's values over the logits of sublayer l (docs/math.md §12.1).
    fn init_values(&self, which: Which, sublayer: usize) -> Vec<f64> {
        let cols = self.matrix_shape(which)[1];
        init_values(&self.coefficient(which).init, self.logits(which), cols, sublayer % self.s())
    }

    /// The static part as a parameter's `Init`: the named rule where one exists, so that the
    /// spellings of HC, FC and GHC keep their documented inits, else the values.
    fn static_init(&self, which: Which, sublayer: usize) -> Init {
        match &self.coefficient(which).init {
            CoefInit::Identity => Init::Eye,
            CoefInit::Constant(v) if *v == 1.0 => Init::Ones,
            CoefInit::Constant(v) if *v == 0.0 => Init::Zeros,
            CoefInit::Constant(v) => Init::Constant(*v),
            _ => Init::Values(self.init_values(which, sublayer)),
        }
    }

    /// The temperature actually applied, τ_eff. Under muP the generators are readouts
    /// with a 1/w forward multiplier folded into τ: τ_eff = τ_base · w, where τ_base is
    /// the knob's value at the base width (default √(d_s) at the base width)
    /// (docs/math.md §8.1 DECISION).
    fn tau_eff(&self, cx: &Cx, gen: &PerSlotGenerator) -> f64 {
        let tau = |d: usize| gen.temperature.unwrap_or(((d / self.m().max(1)) as f64).sqrt());
        match &cx.spec.parametrization {
            Parametrization::Standard => tau(self.d),
            Parametrization::MuP(mup) => tau(mup.base_width) * cx.width_mult(),
        }
    }

    /// One matrix's value from its logits `[.., logits]` (per token) or `[logits]`
    /// (static): elementwise constraints apply before the reshape to the matrix, row-wise
    /// ones after it (docs/math.md §12.1).
    fn constrain(
        &mut self,
        cx: &mut Cx,
        which: Which,
        logits: NodeId,
        lead: &[usize],
    ) -> Result<NodeId, GraphError> {
        let [rows, cols] = self.matrix_shape(which);
        let mut dims = lead.to_vec();
        dims.extend([rows, cols]);
        let constraint = self.coefficient(which).constraint;
        if constraint == Constraint::Permutations {
            let a = cx.g.add(Op::Softmax, &[logits])?;
            let table = self.permutation_table(cx);
            let h = cx.matmul(a, table)?;
            return cx.reshape(h, &dims);
        }
        if constraint == Constraint::Kronecker {
            return self.kronecker(cx, logits, &dims);
        }
        let x = elementwise(cx, constraint, logits)?;
        let x = if cx.shape(x) == dims.as_slice() { x } else { cx.reshape(x, &dims)? };
        match self.coefficient(which).constraint {
            Constraint::Softmax => cx.g.add(Op::Softmax, &[x]),
            Constraint::Sinkhorn { iters, eps } => cx.g.add(Op::Sinkhorn { iters, eps }, &[x]),
            _ => Ok(x),
        }
    }

    /// H = U_1 ⊗ … ⊗ U_K from 2K logits `[.., 2K]` (docs/math.md §12.6): each pair's softmax
    /// (p_k, 1 - p_k) times rows 2k and 2k + 1 of the factor table, which say where U_k puts
    /// p_k and where 1 - p_k over the s² entries of H, then the product over the factors.
    fn kronecker(&mut self, cx: &mut Cx, logits: NodeId, dims: &[usize]) -> Result<NodeId, GraphError> {
        let s = self.s();
        let k = crate::spec::kronecker_factors(s).expect("validation admits streams = 2^K only");
        let mut pairs = cx.shape(logits).to_vec();
        pairs.pop();
        pairs.extend([k, 2]);
        let pairs = cx.reshape(logits, &pairs)?;
        let a = cx.g.add(Op::Softmax, &[pairs])?;
        let table = self.kronecker_table(cx, k);
        let axis = cx.shape(a).len() - 2;
        let mut h: Option<NodeId> = None;
        for f in 0..k {
            let pk = cx.slice(a, axis, f, f + 1)?;
            let rows = cx.slice(table, 0, 2 * f, 2 * f + 2)?;
            let u = cx.matmul(pk, rows)?;
            h = Some(match h {
                None => u,
                Some(acc) => cx.mul(acc, u)?,
            });
        }
        cx.reshape(h.expect("K >= 1 factors"), dims)
    }

    /// The constant table `[2K, s²]` of a `Kronecker` carry: for factor f (the f-th from the
    /// left of U_1 ⊗ … ⊗ U_K, acting on bit K - 1 - f of the slot index), row 2f is 1 where
    /// entry (i, j) of H takes that factor's diagonal p_f (the bits agree) and row 2f + 1 is 1
    /// where it takes 1 - p_f (docs/math.md §12.6).
    fn kronecker_table(&mut self, cx: &mut Cx, k: usize) -> NodeId {
        let s = self.s();
        *self.kronecker.get_or_insert_with(|| {
            let values = kronecker_values(k);
            cx.param("conn.kronecker", &[2 * k, s * s], Init::Values(values), ParamClass::Table)
        })
    }

    /// The constant table `[s!, s²]` whose row k is permutation matrix P_k, output-major
    /// (docs/math.md §12.2); row 0 is the identity.
    fn permutation_table(&mut self, cx: &mut Cx) -> NodeId {
        let s = self.s();
        *self.permutations.get_or_insert_with(|| {
            let perms = permutations(s);
            let mut values = vec![0.0; perms.len() * s * s];
            for (k, p) in perms.iter().enumerate() {
                for (i, &j) in p.iter().enumerate() {
                    values[k * s * s + i * s + j] = 1.0;
                }
            }
            cx.param("conn.permutations", &[perms.len(), s * s], Init::Values(values), ParamClass::Table)
        })
    }

    /// The static parameters h_pre, h_res, h_post, constrained (no generator).
    fn static_mixing(&mut self, cx: &mut Cx, p: &str, sublayer: usize) -> Result<Mixing, GraphError> {
        let base = self.static_params(cx, p, sublayer);
        let read = self.constrain(cx, Which::Read, base.read, &[])?;
        let carry = self.constrain(cx, Which::Carry, base.carry, &[])?;
        let write = self.constrain(cx, Which::Write, base.write, &[])?;
        Ok(Mixing { read, carry, write })
    }

    /// h_pre, h_res, h_post as parameters over their logits (a matrix, or s! logits).
    fn static_params(&self, cx: &mut Cx, p: &str, sublayer: usize) -> Mixing {
        let mut param = |which: Which, name: &str| {
            let stat = static_class(self.coefficient(which));
            let dims: Vec<usize> = if self.structured(which) {
                vec![1, self.logits(which)]
            } else {
                self.matrix_shape(which).to_vec()
            };
            cx.param(&format!("{p}.{name}"), &dims, self.static_init(which, sublayer), stat)
        };
        Mixing {
            read: param(Which::Read, "h_pre"),
            carry: param(Which::Carry, "h_res"),
            write: param(Which::Write, "h_post"),
        }
    }

    /// The per-slot generator (docs/math.md §2.3, §3, §5.5): static + gate ⊙ act(norm(H)[W_α | W_β] / τ).
    fn per_slot_mixing(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        p: &str,
        sublayer: usize,
        gen: &PerSlotGenerator,
    ) -> Result<Mixing, GraphError> {
        let (m, ds) = (self.m(), self.ds);
        let carry_cols = self.matrix_shape(Which::Carry)[1];
        let write_cols = self.matrix_shape(Which::Write)[1];
        let base = self.static_params(cx, p, sublayer);
        let gain = cx.param(&format!("{p}.norm"), &[ds], Init::Ones, ParamClass::Gain);
        let norm_bias = match gen.norm {
            GenNorm::LayerNorm => {
                Some(cx.param(&format!("{p}.norm_bias"), &[ds], Init::Zeros, ParamClass::Gain))
            }
            GenNorm::RmsNorm => None,
        };
        let proj = ParamClass::ConnectionProjection;
        let w_alpha = cx.param(&format!("{p}.w_alpha"), &[ds, m + carry_cols], Init::Zeros, proj);
        let w_beta = cx.param(&format!("{p}.w_beta"), &[ds, write_cols], Init::Zeros, proj);
        let stat = ParamClass::ConnectionStatic;
        let s = Init::Constant(gen.gate_init);
        let scale = match gen.gate {
            crate::spec::Gate::Paired => {
                let s_alpha = cx.param(&format!("{p}.s_alpha"), &[1], s.clone(), stat);
                let s_beta = cx.param(&format!("{p}.s_beta"), &[1], s, stat);
                [s_alpha, s_alpha, s_beta]
            }
            crate::spec::Gate::Entrywise => [
                cx.param(&format!("{p}.s_pre"), &self.matrix_shape(Which::Read), s.clone(), stat),
                cx.param(&format!("{p}.s_res"), &self.matrix_shape(Which::Carry), s.clone(), stat),
                cx.param(&format!("{p}.s_post"), &self.matrix_shape(Which::Write), s, stat),
            ],
        };
        let normed = match norm_bias {
            Some(bias) => {
                let eps = cx.spec.norm_eps;
                cx.g.add(Op::LayerNorm { eps }, &[state, gain, bias])?
            }
            None => cx.rms_norm(state, Some(gain))?,
        };
        let delta = self.generate(cx, normed, w_alpha, w_beta, 1.0 / self.tau_eff(cx, gen), gen.act)?;
        let read = cx.mul(delta.read, scale[0])?;
        let read = cx.add(read, base.read)?;
        let carry = cx.mul(delta.carry, scale[1])?;
        let carry = cx.add(carry, base.carry)?;
        let write = cx.mul(delta.write, scale[2])?;
        let write = cx.add(write, base.write)?;
        let lead = cx.shape(read)[..2].to_vec();
        Ok(Mixing {
            read: self.constrain(cx, Which::Read, read, &lead)?,
            carry: self.constrain(cx, Which::Carry, carry, &lead)?,
            write: self.constrain(cx, Which::Write, write, &lead)?,
        })
    }

    /// Dynamic coefficients in the row-per-slot layout of VWN Alg. 2 (docs/math.md §5.5; HC
    /// Alg. 2, FC Eqs. 11–14 have the same shape): `act(mult · H̄ [W_alpha | W_beta])`,
    /// `[B, T, s, m + c + w]`, one MatMul over the normalized state `[B, T, s, d_s]`. Row i
    /// depends only on slot i. Its column blocks are slot i's read weights (m), carry
    /// weights (c) and write weights (w); read and a full carry are transposed (free views)
    /// into the output-major `[B, T, m, s]` and `[B, T, s, s]`, while a per-slot carry
    /// `[B, T, s, 1]` and the write block are already output-major.
    fn generate(
        &self,
        cx: &mut Cx,
        normed: NodeId,
        w_alpha: NodeId,
        w_beta: NodeId,
        mult: f64,
        act: GateAct,
    ) -> Result<Mixing, GraphError> {
        let m = self.m();
        let w = cx.concat(&[w_alpha, w_beta], 1)?;
        let mut coef = cx.matmul(normed, w)?;
        if mult != 1.0 {
            coef = cx.affine(coef, mult, 0.0)?;
        }
        if act == GateAct::Tanh {
            coef = cx.unary(UnaryOp::Tanh, coef)?;
        }
        let dims = cx.shape(coef).to_vec();
        let cols = dims[3];
        let carry_cols = self.matrix_shape(Which::Carry)[1];
        let read = cx.slice(coef, 3, 0, m)?;
        let read = cx.permute(read, &[0, 1, 3, 2])?;
        let carry = cx.slice(coef, 3, m, m + carry_cols)?;
        let carry = match self.spec.carry.form {
            Form::Matrix => cx.permute(carry, &[0, 1, 3, 2])?,
            Form::PerSlot => carry,
        };
        let write = cx.slice(coef, 3, m + carry_cols, cols)?;
        Ok(Mixing { read, carry, write })
    }

    /// The flat generator (docs/math.md §4.3, §12.1): constraint(α ⊙ (RMSNorm(vec H) φ) + b),
    /// columns `[read | write | carry]`.
    fn flat_mixing(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        p: &str,
        sublayer: usize,
        gen: &FlatGenerator,
    ) -> Result<Mixing, GraphError> {
        let (b, t) = (cx.shape(state)[0], cx.shape(state)[1]);
        let width = self.s() * self.ds;
        let sizes = [self.logits(Which::Read), self.logits(Which::Write), self.logits(Which::Carry)];
        let cols: usize = sizes.iter().sum();
        let phi_init = match gen.proj_init {
            ProjInit::Zero => Init::Zeros,
            // Glorot uniform over (fan_in, fan_out) = (s·d_s, cols).
            ProjInit::Xavier => Init::Uniform { bound: (6.0 / (width + cols) as f64).sqrt() },
        };
        let phi = cx.param(&format!("{p}.phi"), &[width, cols], phi_init, ParamClass::ConnectionProjection);
        let alpha = cx.param(
            &format!("{p}.alpha"),
            &[3],
            Init::Constant(gen.gate_init),
            ParamClass::ConnectionStatic,
        );
        let mut bias = self.init_values(Which::Read, sublayer);
        bias.extend(self.init_values(Which::Write, sublayer));
        bias.extend(self.init_values(Which::Carry, sublayer));
        // The bias is the three coefficients' static parts: trained unless all three are fixed.
        let fixed = [Which::Read, Which::Write, Which::Carry].iter().all(|&w| !self.coefficient(w).learned);
        let class = if fixed { ParamClass::Table } else { ParamClass::ConnectionStatic };
        let bias = cx.param(&format!("{p}.bias"), &[cols], Init::Values(bias), class);

        let flat = cx.reshape(state, &[b, t, width])?;
        let raw = if gen.gain {
            let gain = cx.param(&format!("{p}.norm"), &[width], Init::Ones, ParamClass::Gain);
            let normed = cx.rms_norm(flat, Some(gain))?;
            cx.matmul(normed, phi)?
        } else {
            cx.g.add(Op::NormProject { eps: cx.spec.norm_eps, centered: 0 }, &[flat, phi])?
        };
        let scale = alpha_per_column(cx, alpha, sizes)?;
        let scaled = cx.mul(raw, scale)?;
        let logits = cx.add(scaled, bias)?;
        let mut start = 0;
        let mut part = |this: &mut Self, cx: &mut Cx, which: Which, len: usize| {
            let x = cx.slice(logits, 2, start, start + len)?;
            start += len;
            this.constrain(cx, which, x, &[b, t])
        };
        let read = part(self, cx, Which::Read, sizes[0])?;
        let write = part(self, cx, Which::Write, sizes[1])?;
        let carry = part(self, cx, Which::Carry, sizes[2])?;
        Ok(Mixing { read, carry, write })
    }

    /// W_reduce `[D', D]` or the readout `[1, s]`, created on first use.
    fn exit_weight(&mut self, cx: &mut Cx) -> NodeId {
        if let Some(w) = self.exit {
            return w;
        }
        let (wide, d) = (self.spec.state_width(self.d), self.d);
        let w = match &self.spec.collapse {
            CollapseRule::Readout(coef) => {
                let values = init_values(&coef.init, self.s(), self.s(), 0);
                cx.param("collapse.readout", &[1, self.s()], Init::Values(values), static_class(coef))
            }
            CollapseRule::Reduce { init, .. } => {
                let init = match init {
                    ReduceInit::BlockIdentity => Init::Eye,
                    ReduceInit::Normal => Init::Normal { std: 1.0 / (wide as f64).sqrt() },
                };
                cx.param("reduce.w", &[wide, d], init, ParamClass::Hidden)
            }
            CollapseRule::Sum | CollapseRule::Mean | CollapseRule::Concat => {
                unreachable!("only Reduce and Readout have exit weights")
            }
        };
        self.exit = Some(w);
        w
    }
}

/// The class of a coefficient's static part: trained (`ConnectionStatic`), or a constant
/// (`Table`) with `learned: false` (docs/math.md §12.1).
fn static_class(coef: &crate::spec::Coefficient) -> ParamClass {
    if coef.learned {
        ParamClass::ConnectionStatic
    } else {
        ParamClass::Table
    }
}

/// A [`CoefInit`] laid out over `n` logits in rows of `cols`, `home` the sublayer's home slot.
fn init_values(init: &CoefInit, n: usize, cols: usize, home: usize) -> Vec<f64> {
    match init {
        CoefInit::Identity => (0..n).map(|k| if k / cols == k % cols { 1.0 } else { 0.0 }).collect(),
        CoefInit::Constant(v) => vec![*v; n],
        CoefInit::Logit(p) => vec![(p / (1.0 - p)).ln(); n],
        CoefInit::Home { on, off } => (0..n).map(|k| if k == home { *on } else { *off }).collect(),
        CoefInit::Eye { on, off } => (0..n).map(|k| if k / cols == k % cols { *on } else { *off }).collect(),
        CoefInit::First { on, off } => (0..n).map(|k| if k == 0 { *on } else { *off }).collect(),
        CoefInit::Cyclic => (0..n).map(|k| if (k / cols) % cols == k % cols { 1.0 } else { 0.0 }).collect(),
        CoefInit::Linspace(lo, hi) => {
            let steps = n.max(2) as f64 - 1.0;
            (0..n).map(|k| if n == 1 { *lo } else { lo + (hi - lo) * k as f64 / steps }).collect()
        }
        CoefInit::Values(v) => v.clone(),
    }
}

/// The elementwise constraints (docs/math.md §12.1): `scale·σ(x) + offset` or tanh(x); any
/// other constraint leaves `x` as it is, for the caller to apply after a reshape.
fn elementwise(cx: &mut Cx, constraint: Constraint, x: NodeId) -> Result<NodeId, GraphError> {
    match constraint {
        Constraint::Sigmoid { scale, offset } => {
            let y = cx.unary(UnaryOp::Sigmoid, x)?;
            if (scale, offset) != (1.0, 0.0) {
                cx.affine(y, scale, offset)
            } else {
                Ok(y)
            }
        }
        Constraint::Tanh => cx.unary(UnaryOp::Tanh, x),
        Constraint::None
        | Constraint::Softmax
        | Constraint::Sinkhorn { .. }
        | Constraint::Permutations
        | Constraint::Kronecker => Ok(x),
    }
}

/// The values of the `[2K, s²]` factor table of a `Kronecker` carry over s = 2^K slots
/// (see `Connection::kronecker_table`).
fn kronecker_values(k: usize) -> Vec<f64> {
    let s = 1usize << k;
    let mut values = vec![0.0; 2 * k * s * s];
    for f in 0..k {
        let bit = k - 1 - f;
        for i in 0..s {
            for j in 0..s {
                let same = (i >> bit) & 1 == (j >> bit) & 1;
                let row = 2 * f + usize::from(!same);
                values[row * s * s + i * s + j] = 1.0;
            }
        }
    }
    values
}

/// All permutations of 0..s in lexicographic order (the first is the identity).
pub(crate) fn permutations(s: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut p: Vec<usize> = (0..s).collect();
    loop {
        out.push(p.clone());
        // Next lexicographic permutation.
        let Some(i) = (1..s).rev().find(|&i| p[i - 1] < p[i]) else { return out };
        let j = (i..s).rev().find(|&j| p[j] > p[i - 1]).expect("a larger element exists");
        p.swap(i - 1, j);
        p[i..].reverse();
    }
}

/// The per-column gate `[α_read × n_r | α_write × n_w | α_carry × n_c]` of the flat
/// generator's logits, built from the `[3]` α parameter by views. Under muP the generator
/// is a readout and its 1/w forward multiplier is folded into the gate, α_eff = α / w
/// (docs/math.md §8.1 DECISION).
fn alpha_per_column(cx: &mut Cx, alpha: NodeId, sizes: [usize; 3]) -> Result<NodeId, GraphError> {
    let mut parts = Vec::with_capacity(3);
    for (i, width) in sizes.into_iter().enumerate() {
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
pub(crate) fn collapse_streams(cx: &mut Cx, state: NodeId, op: ReduceOp) -> Result<NodeId, GraphError> {
    cx.g.add(Op::Reduce { op, axis: 2, keepdim: false }, &[state])
}

impl Scheme for Connection {
    fn layout(&self) -> (usize, usize) {
        (self.s(), self.ds)
    }

    /// Stream creation (docs/math.md §0.3): replicate (§2.1, §4.4), split (§3, Eq. 6) or the
    /// over-width embedding (§5.2: E_wide[tok], or E_base[tok] W_expand; both tables draw
    /// N(0, init_std²) like the baseline embedding, W_expand N(0, 1/D), §5.6 DECISION).
    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        let (b, t) = (cx.shape(ids)[0], cx.shape(ids)[1]);
        let (s, ds, d) = (self.s(), self.ds, self.d);
        match self.spec.create {
            Create::Replicate => replicate_embedding(cx, &mut self.table, ids, s),
            Create::Split => {
                let table = embedding_table(cx, &mut self.table);
                let h = lookup(cx, table, ids)?;
                cx.reshape(h, &[b, t, s, ds])
            }
            Create::Wide(mode) => {
                let (v, wide, std) = (cx.spec.model_vocab(), s * ds, cx.spec.init_std);
                let flat = match mode {
                    EmbedMode::Full => {
                        let table = *self.table.get_or_insert_with(|| {
                            cx.param("embed_wide", &[v, wide], Init::Normal { std }, ParamClass::Embedding)
                        });
                        if wide == d {
                            // s = m: E_wide is a V x D table a tied head can use.
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
                cx.reshape(flat, &[b, t, s, ds])
            }
        }
    }

    /// Read, the branch, Carry and Write (docs/math.md §0.3): Read as one MatMul, the branch
    /// on the flattened read, Carry as one MatMul (or a per-slot scale), Write as one MatMul
    /// (or a per-segment scale), merged by one Add. `state` is `[B, T, s, d_s]`.
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
        let mixing = match self.spec.generator.clone() {
            Generator::None => self.static_mixing(cx, &p, sublayer)?,
            Generator::PerSlot(gen) => self.per_slot_mixing(cx, state, &p, sublayer, &gen)?,
            Generator::Flat(gen) => self.flat_mixing(cx, state, &p, sublayer, &gen)?,
        };
        let dims = cx.shape(state).to_vec();
        let (b, t, d) = (dims[0], dims[1], dims[3]);
        let read = cx.matmul(mixing.read, state)?;
        let m = cx.shape(read)[2];
        let u = cx.reshape(read, &[b, t, m * d])?;
        let y = branch(cx, u)?;
        let z = cx.reshape(y, &[b, t, m, d])?;
        let carried = match self.spec.carry.form {
            Form::Matrix => cx.matmul(mixing.carry, state)?,
            Form::PerSlot => cx.mul(state, mixing.carry)?,
        };
        let written = match self.spec.write.form {
            Form::Matrix => cx.matmul(mixing.write, z)?,
            Form::PerSlot => cx.mul(z, mixing.write)?,
        };
        cx.add(carried, written)
    }

    /// The collapse (docs/math.md §0.3): Σ_i X_i or the mean (§2.1, §4.4), the slots side by
    /// side (§3), VWN's GroupNorm with groups of size D and `x @ W_reduce` (§5.2, Alg. 1), or
    /// Σ_i c_i X_i with static readout weights (§12.3).
    fn collapse(&mut self, cx: &mut Cx, state: NodeId, module: Option<usize>) -> Result<NodeId, GraphError> {
        let dims = cx.shape(state).to_vec();
        match self.spec.collapse.clone() {
            CollapseRule::Sum => collapse_streams(cx, state, ReduceOp::Sum),
            CollapseRule::Mean => collapse_streams(cx, state, ReduceOp::Mean),
            CollapseRule::Concat => cx.reshape(state, &[dims[0], dims[1], self.d]),
            CollapseRule::Reduce { norm, .. } => {
                let (s, m, wide) = (self.s(), self.m(), self.spec.state_width(self.d));
                let flat = cx.reshape(state, &[dims[0], dims[1], wide])?;
                let normed = match norm {
                    ReduceNorm::GroupNorm => {
                        if s % m != 0 {
                            return Err(GraphError::Invalid {
                                op: "group_norm".into(),
                                message: format!("reduce norm GroupNorm needs streams = {s} to be a multiple of segments = {m}"),
                            });
                        }
                        let prefix = match module {
                            None => "reduce".to_string(),
                            Some(k) => format!("mtp.{k}.reduce"),
                        };
                        let gain = cx.param(&format!("{prefix}.norm"), &[wide], Init::Ones, ParamClass::Gain);
                        let bias =
                            cx.param(&format!("{prefix}.norm_bias"), &[wide], Init::Zeros, ParamClass::Gain);
                        let eps = cx.spec.norm_eps;
                        cx.g.add(Op::GroupNorm { groups: s / m, eps }, &[flat, gain, bias])?
                    }
                    ReduceNorm::Off => flat,
                };
                let w = self.exit_weight(cx);
                cx.project(normed, w, false, false)
            }
            CollapseRule::Readout(coef) => {
                let w = self.exit_weight(cx);
                // Validation admits only the elementwise constraints and Softmax here.
                let c = match coef.constraint {
                    Constraint::Softmax => cx.g.add(Op::Softmax, &[w])?,
                    other => elementwise(cx, other, w)?,
                };
                // [1, s] @ [B, T, s, D] -> [B, T, 1, D].
                let y = cx.matmul(c, state)?;
                cx.reshape(y, &[dims[0], dims[1], dims[3]])
            }
        }
    }

    /// The output projections' init std times 1/√s, √s or 1 (docs/math.md §2.4 DECISION: 1/√n
    /// damps the n-fold amplification of the final sum).
    fn out_proj_std_mult(&self) -> f64 {
        let root = (self.s() as f64).sqrt();
        match self.spec.out_proj_std_mult {
            OutProjStdMult::One => 1.0,
            OutProjStdMult::InvSqrtN => 1.0 / root,
            OutProjStdMult::SqrtN => root,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{kronecker_values, permutations};

    /// The table's product over factors is U_1 ⊗ U_2 ⊗ U_3 written out, and doubly
    /// stochastic (docs/math.md §12.6).
    #[test]
    fn the_kronecker_table_builds_the_kronecker_product() {
        let (k, s) = (3, 8);
        let p = [0.9, 0.3, 0.65];
        let table = kronecker_values(k);
        let u = |f: usize, a: usize, b: usize| if a == b { p[f] } else { 1.0 - p[f] };
        for i in 0..s {
            let mut row_sum = 0.0;
            for j in 0..s {
                let from_table: f64 = (0..k)
                    .map(|f| {
                        p[f] * table[2 * f * s * s + i * s + j]
                            + (1.0 - p[f]) * table[(2 * f + 1) * s * s + i * s + j]
                    })
                    .product();
                // (U_1 ⊗ U_2 ⊗ U_3)[i, j] with i = (i_1 i_2 i_3) in binary, i_1 the top bit.
                let explicit = u(0, i >> 2, j >> 2) * u(1, (i >> 1) & 1, (j >> 1) & 1) * u(2, i & 1, j & 1);
                assert!((from_table - explicit).abs() < 1e-15, "({i}, {j}): {from_table} vs {explicit}");
                row_sum += from_table;
            }
            assert!((row_sum - 1.0).abs() < 1e-12, "row {i} sums to {row_sum}");
        }
    }

    #[test]
    fn permutations_are_all_distinct_and_start_with_the_identity() {
        for s in 1..=5 {
            let p = permutations(s);
            let expected: usize = (1..=s).product();
            assert_eq!(p.len(), expected, "s = {s}");
            assert_eq!(p[0], (0..s).collect::<Vec<_>>());
            let mut sorted = p.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), expected, "s = {s}: duplicates");
        }
    }
}
