//! The output projection fused with the vocabulary loss, chunk by chunk
//! (`LinearCrossEntropy` and its gradients, docs/math.md §1.7).
//!
//! The rows (tokens) split into chunks of `chunk` rows, the last one shorter when
//! `chunk` does not divide them. One temporary of `chunk × V` logits serves every
//! chunk in turn, so the Plan holds no `rows × V` buffer:
//!
//! - forward, per chunk: `L = x_c·w` (GEMM), then a row kernel writes each row's
//!   `logsumexp(s·L) − s·L[target]` into a per-row loss; a last kernel adds the
//!   rows in order and divides by their count;
//! - backward, per chunk: `L = x_c·w` again, a row kernel turns it in place into
//!   `G = (softmax(s·L) − onehot(target)) · s · dy / rows`, then `dx_c = G·wᵀ`
//!   (its rows of the gradient) and `dw += x_cᵀ·G` (the first chunk overwrites),
//!   for whichever of the two gradients the graph reads; both share the
//!   recomputed logits.
//!
//! Each chunk's row kernel is a kernel of its own (its rows' offset is part of its
//! index math), which is why `ir::passes::vocab_loss` bounds the chunk count.
//! On the Cpu device a row is one item, its max, sum of exponentials and scaling in
//! interleaved lanes; on the GPU a row is a block of lanes with block reductions.
//!
//! Index safety: the targets pick the logit each row subtracts unchecked;
//! `runtime::step::check_tokens` holds them to `0..vocab` before any batch is uploaded.

use ir::graph::{Graph, NodeId, Op};
use ir::DType;

use super::buffers::{memory, Kb};
use super::folds::{self, maximum, shift_maximum};
use super::{ix, lit, Arg, EmitError, GemmCall, Lowering, Names, Target, Temps, Work};
use crate::kernel::{i64, item, lane, Access, Combine, Expr, Grid, Ty, Unroll};

/// Lanes per row of the GPU's row kernels.
const ROW_LANES: u32 = 256;

/// Sizes and options of one fused vocabulary loss.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    d: usize,
    v: usize,
    chunk: usize,
    trans_b: bool,
    scale: f64,
    /// The logits' (and the loss's) type.
    dtype: DType,
}

impl Dims {
    fn of(graph: &Graph, id: NodeId) -> Result<Dims, EmitError> {
        let node = graph.node(id);
        let (Op::LinearCrossEntropy { trans_b, scale, chunk }
        | Op::LinearCrossEntropyGrad { trans_b, scale, chunk, .. }) = node.op
        else {
            return Err(EmitError::at(id, &node.op, "is not a fused vocabulary loss"));
        };
        let inputs = graph.inputs(id);
        let (x, w) = (graph.node(inputs[0]).shape.dims(), graph.node(inputs[1]).shape.dims());
        let d = x.last().copied().unwrap_or(0);
        let v = if trans_b { w[0] } else { w[1] };
        let rows = graph.node(inputs[2]).shape.numel();
        // The forward's type is the loss's; a gradient's logits have its compute type.
        let dtype = match node.op {
            Op::LinearCrossEntropy { .. } => node.dtype,
            _ => graph.node(inputs[3]).dtype,
        };
        Ok(Dims { rows, d, v, chunk: chunk.max(1), trans_b, scale, dtype })
    }

    fn ty(&self) -> Ty {
        Ty::of_storage(self.dtype)
    }

    /// (first row, row count) of each chunk.
    fn chunks(&self) -> Vec<(usize, usize)> {
        (0..self.rows).step_by(self.chunk).map(|r0| (r0, self.chunk.min(self.rows - r0))).collect()
    }

    /// `L = x[r0 .. r0 + rc]·w` into the chunk's logits.
    fn logits(&self, x: Arg, w: Arg, l: Arg, (r0, rc): (usize, usize)) -> Work {
        gemm(x, w, l, rc, self.v, self.d, false, self.trans_b, [r0 * self.d, 0, 0], false)
    }
}

/// A single (batch 1) library product ([`crate::plan::Gemm::single`]).
#[allow(clippy::too_many_arguments)]
fn gemm(
    a: Arg,
    b: Arg,
    c: Arg,
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    offsets: [usize; 3],
    accumulate: bool,
) -> Work {
    Work::Gemm(GemmCall::single(a, b, c, (m, n, k), trans_a, trans_b, offsets, accumulate))
}

/// What the forward and the gradients share: the sizes, the temporaries, the steps
/// that put x and w in memory (when they are views), their buffers and the chunk's
/// logits buffer.
struct Operands {
    d: Dims,
    temps: Temps,
    steps: Vec<Work>,
    x: Arg,
    w: Arg,
    l: Arg,
}

impl Operands {
    fn of(graph: &Graph, id: NodeId, name: &str, target: Target) -> Result<Operands, EmitError> {
        let d = Dims::of(graph, id)?;
        let inputs = graph.inputs(id);
        let mut temps = Temps::default();
        let mut steps = Vec::new();
        let x = memory(graph, inputs[0], name, &mut temps, &mut steps, target)?;
        let w = memory(graph, inputs[1], name, &mut temps, &mut steps, target)?;
        let l = temps.add(d.chunk.min(d.rows) * d.v, d.dtype);
        Ok(Operands { d, temps, steps, x, w, l })
    }
}

/// What a chunk's row kernel does with its row of logits.
#[derive(Clone, Copy)]
enum RowWork {
    /// Write the row's loss into the per-row losses.
    Loss(Arg),
    /// Replace the row by its gradient, scaled by the loss gradient node.
    Grad(NodeId),
}

/// The row kernel of chunk `(r0, rc)` over the logits `l` (see the module doc).
#[allow(clippy::too_many_arguments)]
fn rows_kernel(
    graph: &Graph,
    id: NodeId,
    d: &Dims,
    name: &str,
    temps: &Temps,
    l_arg: Arg,
    (r0, rc): (usize, usize),
    work: RowWork,
    target: Target,
) -> Result<Work, EmitError> {
    let lanes = match target {
        Target::Cpu => None,
        Target::Cuda => Some(ROW_LANES),
    };
    let mut kb = match lanes {
        None => Kb::new(graph, name, rc),
        Some(lanes) => Kb::with_grid(graph, name, Grid::block_per_item(rc, lanes)),
    };
    let access = match work {
        RowWork::Loss(_) => Access::Read,
        RowWork::Grad(_) => Access::ReadWrite,
    };
    let l = kb.temp("l", l_arg, temps, access);
    let targets = kb.r.read(&mut kb.k, graph.inputs(id)[2]);
    let out = match work {
        RowWork::Loss(losses) => Some(kb.temp("losses", losses, temps, Access::Write)),
        RowWork::Grad(_) => None,
    };
    let dy = match work {
        RowWork::Grad(dy) => Some(kb.r.read(&mut kb.k, dy)),
        RowWork::Loss(_) => None,
    };
    let ty = d.ty();
    let v = d.v;
    let names = Names::default();
    let k = &mut kb.k;
    let base = k.let_("base", item() * ix(v));
    let scale = lit(ty, d.scale);
    let logit = |j: Expr| l.at(base.clone() + j) * scale.clone();
    let target_at = k.let_("target", targets.load(item() + ix(r0)).cast(Ty::I64));
    // The row's max and Σ exp(s·l − max): interleaved lanes of one item on the CPU,
    // a block's lanes and two block reductions on the GPU.
    let (m, total) = match lanes {
        None => {
            let m = folds::fold(&names, k, lit(ty, f64::NEG_INFINITY), v, shift_maximum, |b, j| {
                b.let_(&names.fresh("xv"), logit(j))
            });
            let total =
                folds::fold(&names, k, lit(ty, 0.0), v, |a, b| a + b, |_, j| (logit(j) - m.clone()).exp());
            (m, total)
        }
        Some(lanes) => {
            let step = i64::from(lanes);
            let lane_max = k.var("lane_max", lit(ty, f64::NEG_INFINITY));
            k.for_step("j0", lane(), ix(v), step, Unroll::Auto, |b, j| {
                b.assign(&lane_max, maximum(lane_max.clone(), logit(j)));
            });
            let m = k.block_reduce("row_max", Combine::Max, lane_max);
            let lane_sum = k.var("lane_sum", lit(ty, 0.0));
            k.for_step("j1", lane(), ix(v), step, Unroll::Auto, |b, j| {
                b.assign(&lane_sum, lane_sum.clone() + (logit(j) - m.clone()).exp());
            });
            (m, k.block_reduce("row_sum", Combine::Sum, lane_sum))
        }
    };
    match (out, dy) {
        (Some(out), _) => {
            let loss = k.let_("loss", m + total.log() - logit(target_at));
            let first = lanes.map(|_| lane().eq_(i64(0)));
            match first {
                None => k.store(&out, item() + ix(r0), loss),
                Some(first) => k.if_(first, |b| b.store(&out, item() + ix(r0), loss)),
            }
        }
        (None, Some(dy)) => {
            let inv = k.let_("inv", lit(ty, 1.0) / total);
            let factor = k.let_("factor", scale.clone() * dy.load(i64(0)) / lit(ty, d.rows as f64));
            // softmax · factor over the row, then the target's −factor: a loop without a
            // per-element comparison vectorizes (with one it ran 5x slower on the CPU).
            let body = |b: &mut crate::kernel::Block, j: Expr| {
                let at = b.let_("at", base.clone() + j);
                let p = (l.at(at.clone()) * scale.clone() - m.clone()).exp() * inv.clone();
                b.store(&l, at, p * factor.clone());
            };
            match lanes {
                None => k.for_("j", ix(0), ix(v), body),
                Some(lanes) => k.for_step("j2", lane(), ix(v), i64::from(lanes), Unroll::Auto, body),
            }
            if let Some(lanes) = lanes {
                // The lane that wrote the target's element corrects it: no barrier needed.
                let owner = (target_at.clone() % i64::from(lanes)).eq_(lane());
                k.if_(owner, |b| {
                    let at = b.let_("hit", base.clone() + target_at.clone());
                    b.store(&l, at.clone(), l.at(at) - factor.clone());
                });
            } else {
                let at = k.let_("hit", base.clone() + target_at.clone());
                k.store(&l, at.clone(), l.at(at) - factor.clone());
            }
        }
        (None, None) => unreachable!("a row kernel either writes losses or a gradient"),
    }
    kb.finish()
}

/// `LinearCrossEntropy` (see the module doc).
pub(super) fn linear_cross_entropy(
    graph: &Graph,
    id: NodeId,
    name: &str,
    target: Target,
) -> Result<Lowering, EmitError> {
    let Operands { d, mut temps, mut steps, x, w, l } = Operands::of(graph, id, name, target)?;
    let losses = temps.add(d.rows, d.dtype);
    for (i, c) in d.chunks().into_iter().enumerate() {
        steps.push(d.logits(x, w, l, c));
        steps.push(rows_kernel(
            graph,
            id,
            &d,
            &format!("{name}_c{i}"),
            &temps,
            l,
            c,
            RowWork::Loss(losses),
            target,
        )?);
    }
    // The mean, the rows added in order (the same order on every device and thread count).
    let mut kb = Kb::with_grid(graph, &format!("{name}_mean"), Grid::thread_per_item(1));
    let rows = kb.temp("losses", losses, &temps, Access::Read);
    let out = kb.r.buffer(&mut kb.k, id, Access::Write);
    let ty = d.ty();
    let k = &mut kb.k;
    let sum = k.var("sum", lit(ty, 0.0));
    k.for_("r", ix(0), ix(d.rows), |b, r| b.assign(&sum, sum.clone() + rows.at(r)));
    k.store(&out, ix(0), sum / lit(ty, d.rows as f64));
    steps.push(kb.finish()?);
    Ok(Lowering { steps, temps: temps.0, chain: None })
}

/// The gradients of one fused vocabulary loss w.r.t. x and w (`outs[wrt]`, the
/// `LinearCrossEntropyGrad` nodes sharing x, w, the targets and dy; at least one
/// present), sharing each chunk's recomputed logits (see the module doc).
pub fn linear_cross_entropy_grads(
    graph: &Graph,
    outs: [Option<NodeId>; 2],
    name: &str,
    target: Target,
) -> Result<Lowering, EmitError> {
    let id = super::first_requested(&outs, "linear_cross_entropy_grad", "gradient")?;
    let Operands { d, temps, mut steps, x, w, l } = Operands::of(graph, id, name, target)?;
    let dy = graph.inputs(id)[3];
    for (i, c @ (r0, rc)) in d.chunks().into_iter().enumerate() {
        steps.push(d.logits(x, w, l, c));
        let kernel =
            rows_kernel(graph, id, &d, &format!("{name}_c{i}"), &temps, l, c, RowWork::Grad(dy), target)?;
        steps.push(kernel);
        if let Some(dx) = outs[0] {
            // dx_c [rc, D] = G [rc, V] · wᵀ (w [D, V]), or G · w (w [V, D]).
            steps.push(gemm(l, w, Arg::Node(dx), rc, d.d, d.v, false, !d.trans_b, [0, 0, r0 * d.d], false));
        }
        if let Some(dw) = outs[1] {
            let first = i == 0;
            let step = if d.trans_b {
                // dw [V, D] += Gᵀ [V, rc] · x_c [rc, D].
                gemm(l, x, Arg::Node(dw), d.v, d.d, rc, true, false, [0, r0 * d.d, 0], !first)
            } else {
                // dw [D, V] += x_cᵀ [D, rc] · G [rc, V].
                gemm(x, l, Arg::Node(dw), d.d, d.v, rc, true, false, [r0 * d.d, 0, 0], !first)
            };
            steps.push(step);
        }
    }
    Ok(Lowering { steps, temps: temps.0, chain: None })
}
