//! xHC-Flash (docs/math.md §6.10) and xHC-Flash-4sub (§6.11): one routing decision and one
//! full-state read pass per sharing window (one block, or two blocks = four sublayers).
//! Inside a window the intermediate sublayers only add their sparse writes to the active
//! state; residual mixing and the scatter into the full state happen once, at the
//! window's last MLP.
//!
//! Map sources (docs/math.md §6.10 DECISION, extended to Flash-4sub): every H_pre comes
//! from the window-entry state X^(0); each sublayer's H_post, and the final H_res, come
//! from the active state that sublayer sees (X_act^(0) for the first attention, X_act^(A)
//! after it, ...), available without a full-state read.
//!
//! A Flash-4sub window opens on every even trunk block (validation requires an even
//! number of blocks, docs/math.md §10). MTP modules hold one block each and fall back to
//! Flash.

use super::{label, Routing, Xhc};
use crate::graph::Build;
use crate::graph::{GraphError, NodeId, Op};
use crate::lower::{Branch, Cx, SublayerKind};

/// A Flash-4sub window left open by its first block.
pub(super) struct Window {
    /// The state the first block returned: the explicit X^(2) = X^(0) with the active
    /// rows replaced. The window continues only if the next block receives it.
    mid: NodeId,
    /// First sublayer of the window.
    first: usize,
    routing: Routing,
    /// Non-active bases Σ_{i∉I} H_pre^t_i x_i^(0) `[B, T, 1, C]` of sublayers 3 and 4.
    bases: [NodeId; 2],
    /// H_pre^t at the active indices, `[B, T, k, 1]`, of sublayers 3 and 4.
    pre_act: [NodeId; 2],
    /// X_act^(2) `[B, T, k, C]`.
    x_act: NodeId,
}

impl Xhc {
    /// xHC-Flash over one block (docs/math.md §6.10).
    pub(super) fn flash_block(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        first: usize,
        attn: &mut Branch,
        ffn: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        let (a, f) = (first, first + 1);
        let d = cx.shape(state).to_vec();
        let (b, t, n, c) = (d[0], d[1], d[2], d[3]);
        cx.connection(a);
        let routing = self.route(cx, state, &[a, f])?;

        // The second full pass: both dense reads in one MatMul [B,T,2,N] x [B,T,N,C].
        let rows = [cx.reshape(routing.pre[0], &[b, t, 1, n])?, cx.reshape(routing.pre[1], &[b, t, 1, n])?];
        let rows = cx.concat(&rows, 2)?;
        let inputs = cx.matmul(rows, state)?;
        let inp_a = cx.slice(inputs, 2, 0, 1)?;
        let inp_a = cx.reshape(inp_a, &[b, t, c])?;
        let inp_m = cx.slice(inputs, 2, 1, 2)?;
        let x0 = cx.g.add(Op::Gather { axis: 2 }, &[state, routing.idx])?;

        // Attention: H_res^A = I_k, sparse write only.
        let att = self.step(cx, &routing, x0, inp_a, a, SublayerKind::Attention, attn, false)?;

        // MLP input by exact correction (Eq. 19): H_pre^M applied to the updated state is
        // inp_M + Σ_c α_c Y_A[c] with α = (H_pre^M)_I (diag(p) H_post^A), one FMA over C.
        cx.connection(f);
        let k = self.cfg.k;
        let pre_m_act = cx.g.add(Op::Gather { axis: 2 }, &[routing.pre[1], routing.idx])?;
        let pre_m_act = cx.reshape(pre_m_act, &[b, t, 1, k])?;
        let alpha = cx.matmul(pre_m_act, att.post)?;
        let one = cx.constant(1.0, &[b, t, 1, 1]);
        let coef = cx.concat(&[one, alpha], 3)?;
        let stack = cx.concat(&[inp_m, att.y], 2)?;
        let inp_mlp = cx.matmul(coef, stack)?;
        let inp_mlp = cx.reshape(inp_mlp, &[b, t, c])?;

        let mlp = self.step(cx, &routing, att.x_act, inp_mlp, f, SublayerKind::Ffn, ffn, true)?;
        cx.g.add(Op::ScatterRows { axis: 2 }, &[state, routing.idx, mlp.x_act])
    }

    /// xHC-Flash-4sub (docs/math.md §6.11): opens a window on its first block and closes it on
    /// the next; runs xHC-Flash in MTP modules.
    pub(super) fn flash_two_block(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        first: usize,
        attn: &mut Branch,
        ffn: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        if let Some(window) = self.window.take() {
            if window.mid == state && window.first + 2 == first {
                return self.close_window(cx, window, attn, ffn);
            }
        }
        if cx.module.is_none() && (first / 2).is_multiple_of(2) {
            self.open_window(cx, state, first, attn, ffn)
        } else {
            self.flash_block(cx, state, first, attn, ffn)
        }
    }

    /// Sublayers 1 and 2 of a Flash-4sub window: routing and the four pre maps from X^(0),
    /// one dense pass giving the first input and the non-active bases of the later ones
    /// (Eq. 37), then two sparse writes.
    fn open_window(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        first: usize,
        attn: &mut Branch,
        ffn: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        let d = cx.shape(state).to_vec();
        let (b, t, n, c) = (d[0], d[1], d[2], d[3]);
        let k = self.cfg.k;
        cx.connection(first);
        let routing = self.route(cx, state, &[first, first + 1, first + 2, first + 3])?;

        // Columns of [H_pre^1 | H_pre^2..4 with the active entries zeroed], `[B, T, N, 4]`.
        let mut later = Vec::with_capacity(3);
        for &pre in &routing.pre[1..] {
            later.push(cx.reshape(pre, &[b, t, n, 1])?);
        }
        let later = cx.concat(&later, 3)?;
        let zeros = cx.constant(0.0, &[b, t, k, 3]);
        let masked = cx.g.add(Op::ScatterRows { axis: 2 }, &[later, routing.idx, zeros])?;
        let first_col = cx.reshape(routing.pre[0], &[b, t, n, 1])?;
        let cols = cx.concat(&[first_col, masked], 3)?;
        let reads = cx.matmul_t(cols, state, true, false)?;
        let u1 = cx.slice(reads, 2, 0, 1)?;
        let u1 = cx.reshape(u1, &[b, t, c])?;
        let pre_act = cx.g.add(Op::Gather { axis: 2 }, &[later, routing.idx])?;
        let mut bases = Vec::with_capacity(3);
        let mut pre_acts = Vec::with_capacity(3);
        for i in 0..3 {
            bases.push(cx.slice(reads, 2, i + 1, i + 2)?);
            pre_acts.push(cx.slice(pre_act, 3, i, i + 1)?);
        }
        let x0 = cx.g.add(Op::Gather { axis: 2 }, &[state, routing.idx])?;

        let s1 = self.step(cx, &routing, x0, u1, first, SublayerKind::Attention, attn, false)?;
        cx.connection(first + 1);
        let u2 = window_input(cx, bases[0], pre_acts[0], s1.x_act)?;
        let s2 = self.step(cx, &routing, s1.x_act, u2, first + 1, SublayerKind::Ffn, ffn, false)?;
        let mid = cx.g.add(Op::ScatterRows { axis: 2 }, &[state, routing.idx, s2.x_act])?;
        label(cx, mid, format!("{}.state", Self::prefix(cx, first + 1)));
        // The state between the window's blocks is stored like every residual state (bf16
        // under mixed precision, docs/math.md §6.12); casting it here, not in the driver, keeps
        // `mid` the node the window's second block receives, so the window closes.
        let mid = cx.state(mid)?;
        self.window = Some(Window {
            mid,
            first,
            routing,
            bases: [bases[1], bases[2]],
            pre_act: [pre_acts[1], pre_acts[2]],
            x_act: s2.x_act,
        });
        Ok(mid)
    }

    /// Sublayers 3 and 4 of a Flash-4sub window: a sparse write, then the window's only
    /// residual mixing and its one scatter.
    fn close_window(
        &mut self,
        cx: &mut Cx,
        window: Window,
        attn: &mut Branch,
        ffn: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        let (a, f) = (window.first + 2, window.first + 3);
        let routing = &window.routing;
        cx.connection(a);
        let u3 = window_input(cx, window.bases[0], window.pre_act[0], window.x_act)?;
        let s3 = self.step(cx, routing, window.x_act, u3, a, SublayerKind::Attention, attn, false)?;
        cx.connection(f);
        let u4 = window_input(cx, window.bases[1], window.pre_act[1], s3.x_act)?;
        let s4 = self.step(cx, routing, s3.x_act, u4, f, SublayerKind::Ffn, ffn, true)?;
        // The active rows of `mid` are replaced again: the result is X^(0) with rows I
        // set to X_act^(4).
        cx.g.add(Op::ScatterRows { axis: 2 }, &[window.mid, routing.idx, s4.x_act])
    }
}

/// A later input of a Flash-4sub window (Eq. 37): the non-active base plus the current
/// active state read with H_pre^t at I, as one MatMul `[1 | H_pre^t_I] [base; X_act]`,
/// `-> [B, T, C]`.
fn window_input(cx: &mut Cx, base: NodeId, pre_act: NodeId, x_act: NodeId) -> Result<NodeId, GraphError> {
    let d = cx.shape(base).to_vec();
    let (b, t, c) = (d[0], d[1], d[3]);
    let one = cx.constant(1.0, &[b, t, 1, 1]);
    let coef = cx.concat(&[one, pre_act], 2)?;
    let stack = cx.concat(&[base, x_act], 2)?;
    let u = cx.matmul_t(coef, stack, true, false)?;
    cx.reshape(u, &[b, t, c])
}
