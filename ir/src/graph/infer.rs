//! Shape and dtype inference, one rule per op (docs/architecture.md §4).

use super::{GraphError, MoeRouteOut, Op};
use crate::{DType, Shape};

type Typed<'a> = (&'a Shape, DType);

fn arity(op: &Op, inputs: &[Typed], expected: &[usize]) -> Result<(), GraphError> {
    if expected.contains(&inputs.len()) {
        Ok(())
    } else {
        let expected = expected.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" or ");
        Err(GraphError::Arity { op: op.name().into(), expected, got: inputs.len() })
    }
}

fn invalid(op: &Op, message: impl Into<String>) -> GraphError {
    GraphError::Invalid { op: op.name().into(), message: message.into() }
}

fn mismatch(op: &Op, detail: impl Into<String>, lhs: &Shape, rhs: &Shape) -> GraphError {
    GraphError::ShapeMismatch {
        op: op.name().into(),
        detail: detail.into(),
        lhs: lhs.clone(),
        rhs: rhs.clone(),
    }
}

/// The type arithmetic on a float operand produces: Bf16 operands are widened to F32
/// (docs/math.md §6.12: bf16 is a storage type, arithmetic is f32).
fn float(op: &Op, inputs: &[Typed], slot: usize) -> Result<DType, GraphError> {
    let dt = inputs[slot].1;
    if dt.is_float() {
        Ok(dt.compute())
    } else {
        Err(GraphError::DType { op: op.name().into(), slot, got: dt, expected: "a float type".into() })
    }
}

fn int(op: &Op, inputs: &[Typed], slot: usize) -> Result<(), GraphError> {
    let dt = inputs[slot].1;
    if dt == DType::I32 {
        Ok(())
    } else {
        Err(GraphError::DType { op: op.name().into(), slot, got: dt, expected: "i32".into() })
    }
}

/// The common compute type of float operands: Bf16 mixes with F32 and gives F32 (a MatMul
/// of bf16 operands accumulates and returns f32, docs/math.md §6.12); F32 and F64 do not mix.
fn same_dtype(op: &Op, inputs: &[Typed]) -> Result<DType, GraphError> {
    let first = float(op, inputs, 0)?;
    for (slot, &(_, dtype)) in inputs.iter().enumerate().skip(1) {
        if !dtype.is_float() || dtype.compute() != first {
            return Err(GraphError::DType {
                op: op.name().into(),
                slot,
                got: dtype,
                expected: first.name().into(),
            });
        }
    }
    Ok(first)
}

fn last_axis_param(op: &Op, x: &Shape, p: &Shape, what: &str) -> Result<(), GraphError> {
    if p.dims() != [x.last()] {
        return Err(mismatch(op, format!("{what} must be [{}] (the last axis of x)", x.last()), x, p));
    }
    Ok(())
}

/// A backward op of autodiff: (forward inputs [..n_forward], output gradient) -> the
/// gradient of forward input `wrt`. The forward inputs must satisfy `forward`'s rule and
/// the output gradient must have the forward output's type.
fn grad_of(
    op: &Op,
    forward: &Op,
    inputs: &[Typed],
    wrt: usize,
    n_forward: usize,
) -> Result<(Shape, DType), GraphError> {
    let (out, dt) = infer(forward, &inputs[..n_forward])?;
    let dout = &inputs[n_forward];
    if *dout.0 != out || dout.1 != dt {
        return Err(mismatch(op, "the output gradient must have the forward output's type", &out, dout.0));
    }
    if wrt >= n_forward {
        return Err(invalid(op, format!("wrt {wrt} is not one of the {n_forward} forward inputs")));
    }
    // Gradients are never bf16 (docs/math.md §6.12 DECISION): the adjoint of a bf16 operand is f32.
    Ok((inputs[wrt].0.clone(), inputs[wrt].1.compute()))
}

/// Like [`arity`] for ops with a variable number of operands: at least `min`.
fn min_arity(op: &Op, inputs: &[Typed], min: usize) -> Result<(), GraphError> {
    if inputs.len() < min {
        return Err(GraphError::Arity {
            op: op.name().into(),
            expected: format!(">= {min}"),
            got: inputs.len(),
        });
    }
    Ok(())
}

/// Infers the output type of `op` applied to inputs of the given types: one rule per
/// op family below, so a new op gets its rule where its family's rules are.
pub(super) fn infer(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    match op {
        Op::Input { .. } | Op::Param(_) | Op::Constant { .. } => {
            Err(invalid(op, "source ops are added with Graph::add_source"))
        }
        Op::Unary(_) | Op::Affine { .. } | Op::Softmax => like_input(op, inputs),
        Op::Cast { to } => cast(op, inputs, *to),
        Op::Binary(_) => binary(op, inputs),
        Op::Reduce { axis, keepdim, .. } => reduce(op, inputs, *axis, *keepdim),
        Op::MatMul { trans_a, trans_b } => matmul(op, inputs, *trans_a, *trans_b),
        Op::Reshape { shape } => reshape(op, inputs, shape),
        Op::Permute { perm } => permute(op, inputs, perm),
        Op::Broadcast { shape } => broadcast(op, inputs, shape),
        Op::Slice { axis, start, end } => slice(op, inputs, *axis, *start, *end),
        Op::Concat { axis } => concat(op, inputs, *axis),
        Op::Gather { axis } => gather(op, inputs, *axis),
        Op::ScatterAdd { axis } => scatter(op, inputs, *axis, false),
        Op::ScatterRows { axis } => scatter(op, inputs, *axis, true),
        Op::TopK { k, fixed } => topk(op, inputs, *k, *fixed),
        Op::RmsNorm { .. } => norm(op, inputs, &[1, 2], None),
        Op::LayerNorm { .. } => norm(op, inputs, &[1, 3], None),
        Op::GroupNorm { groups, .. } => norm(op, inputs, &[3], Some(*groups)),
        Op::NormProject { centered, .. } => norm_project(op, inputs, *centered),
        Op::SoftmaxCrossEntropy => softmax_cross_entropy(op, inputs),
        Op::LinearCrossEntropy { trans_b, chunk, .. } => linear_cross_entropy(op, inputs, *trans_b, *chunk),
        Op::CausalAttention { .. } => causal_attention(op, inputs),
        Op::Sinkhorn { .. } => sinkhorn(op, inputs),
        Op::TemporalAugment { .. } => temporal_augment(op, inputs),
        Op::CausalAttentionGrad { scale, rope_base, wrt } => {
            arity(op, inputs, &[4])?;
            let forward = Op::CausalAttention { scale: *scale, rope_base: *rope_base };
            grad_of(op, &forward, inputs, *wrt, 3)
        }
        Op::LinearCrossEntropyGrad { trans_b, scale, chunk, wrt } => {
            arity(op, inputs, &[4])?;
            if *wrt > 1 {
                return Err(invalid(op, format!("wrt {wrt}: only x (0) and w (1) have gradients")));
            }
            let forward = Op::LinearCrossEntropy { trans_b: *trans_b, scale: *scale, chunk: *chunk };
            grad_of(op, &forward, inputs, *wrt, 3)
        }
        Op::SinkhornGrad { iters, eps } => {
            arity(op, inputs, &[2])?;
            grad_of(op, &Op::Sinkhorn { iters: *iters, eps: *eps }, inputs, 0, 1)
        }
        Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt } => {
            min_arity(op, inputs, 3)?;
            let forward = Op::TemporalAugment { gram_schmidt: *gram_schmidt, eps_rel: *eps_rel };
            grad_of(op, &forward, inputs, *wrt, inputs.len() - 1)
        }
        Op::MoeRoute { experts, capacity, out } => moe_route(op, inputs, *experts, *capacity, *out),
        Op::GroupedMatMul { trans_b } => grouped_matmul(op, inputs, *trans_b),
        Op::GroupedMatMulGrad { trans_b } => grouped_matmul_grad(op, inputs, *trans_b),
    }
}

// Sparse mixture of experts (docs/math.md §1.6).

/// (idx i32 [N, k]) -> Rows i32 [N, k], Tokens i32 [N·k] or Counts i32 [E].
fn moe_route(
    op: &Op,
    inputs: &[Typed],
    experts: usize,
    capacity: Option<usize>,
    out: MoeRouteOut,
) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    int(op, inputs, 0)?;
    let idx = inputs[0].0;
    if idx.rank() != 2 || idx.0[1] == 0 || idx.0[1] > experts {
        return Err(invalid(
            op,
            format!("needs expert indices [tokens, k] with 1 <= k <= {experts}, got {idx}"),
        ));
    }
    if experts == 0 || capacity == Some(0) {
        return Err(invalid(op, "needs experts >= 1 and a capacity >= 1 when given"));
    }
    let dims = match out {
        MoeRouteOut::Rows => idx.0.clone(),
        MoeRouteOut::Tokens => vec![idx.numel()],
        MoeRouteOut::Counts => vec![experts],
    };
    Ok((Shape(dims), DType::I32))
}

/// The (rows, groups, contraction, out) sizes of a grouped product's operands, checked.
fn grouped_dims(
    op: &Op,
    x: &Shape,
    w: &Shape,
    counts: &Shape,
    trans_b: bool,
) -> Result<[usize; 4], GraphError> {
    if x.rank() != 2 || w.rank() != 3 {
        return Err(mismatch(op, "needs x [M, K] and w [E, K, N]", x, w));
    }
    let (e, k, n) = if trans_b { (w.0[0], w.0[2], w.0[1]) } else { (w.0[0], w.0[1], w.0[2]) };
    if x.0[1] != k {
        return Err(mismatch(op, format!("contraction sizes differ ({} vs {k})", x.0[1]), x, w));
    }
    if counts.dims() != [e] {
        return Err(mismatch(op, format!("counts must be [{e}] (one per group of w)"), w, counts));
    }
    Ok([x.0[0], e, k, n])
}

/// (x [M, K], w [E, K, N] or [E, N, K], counts i32 [E]) -> [M, N].
fn grouped_matmul(op: &Op, inputs: &[Typed], trans_b: bool) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[3])?;
    int(op, inputs, 2)?;
    let dt = same_dtype(op, &inputs[..2])?;
    let [m, _, _, n] = grouped_dims(op, inputs[0].0, inputs[1].0, inputs[2].0, trans_b)?;
    Ok((Shape(vec![m, n]), dt))
}

/// (x [M, K], dy [M, N], counts i32 [E]) -> [E, K, N] (`trans_b`: [E, N, K]).
fn grouped_matmul_grad(op: &Op, inputs: &[Typed], trans_b: bool) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[3])?;
    int(op, inputs, 2)?;
    let dt = same_dtype(op, &inputs[..2])?;
    let (x, dy, counts) = (inputs[0].0, inputs[1].0, inputs[2].0);
    if x.rank() != 2 || dy.rank() != 2 || x.0[0] != dy.0[0] || counts.rank() != 1 {
        return Err(mismatch(op, "needs x [M, K], dy [M, N] and counts [E]", x, dy));
    }
    let (e, k, n) = (counts.0[0], x.0[1], dy.0[1]);
    Ok((Shape(if trans_b { vec![e, n, k] } else { vec![e, k, n] }), dt))
}

// Elementwise.

/// One float operand, and an output of its shape and compute type.
fn like_input(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    Ok((inputs[0].0.clone(), float(op, inputs, 0)?))
}

fn cast(op: &Op, inputs: &[Typed], to: DType) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    float(op, inputs, 0)?;
    if !to.is_float() {
        return Err(invalid(op, format!("casts only to a float type, not {to}")));
    }
    Ok((inputs[0].0.clone(), to))
}

fn binary(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[2])?;
    let dt = same_dtype(op, inputs)?;
    let (a, b) = (inputs[0].0, inputs[1].0);
    let shape = a.broadcast(b).ok_or_else(|| mismatch(op, "operands do not broadcast", a, b))?;
    Ok((shape, dt))
}

// Reductions and products.

fn reduce(op: &Op, inputs: &[Typed], axis: usize, keepdim: bool) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    let x = inputs[0].0;
    if axis >= x.rank() {
        return Err(invalid(op, format!("axis {axis} out of range for {x}")));
    }
    let mut dims = x.dims().to_vec();
    if keepdim {
        dims[axis] = 1;
    } else {
        dims.remove(axis);
    }
    Ok((Shape(dims), float(op, inputs, 0)?))
}

fn matmul(op: &Op, inputs: &[Typed], trans_a: bool, trans_b: bool) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[2])?;
    let dt = same_dtype(op, inputs)?;
    let (a, b) = (inputs[0].0, inputs[1].0);
    if a.rank() < 2 || b.rank() < 2 {
        return Err(mismatch(op, "operands need rank >= 2", a, b));
    }
    let (ar, br) = (a.rank(), b.rank());
    let (m, ka) = if trans_a { (a.0[ar - 1], a.0[ar - 2]) } else { (a.0[ar - 2], a.0[ar - 1]) };
    let (kb, n) = if trans_b { (b.0[br - 1], b.0[br - 2]) } else { (b.0[br - 2], b.0[br - 1]) };
    if ka != kb {
        return Err(mismatch(op, format!("contraction sizes differ ({ka} vs {kb})"), a, b));
    }
    let batch = Shape(a.0[..ar - 2].to_vec())
        .broadcast(&Shape(b.0[..br - 2].to_vec()))
        .ok_or_else(|| mismatch(op, "batch dimensions do not broadcast", a, b))?;
    let mut dims = batch.0;
    dims.extend([m, n]);
    Ok((Shape(dims), dt))
}

// Movement: views keep the operand's storage type.

fn reshape(op: &Op, inputs: &[Typed], shape: &[usize]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    let x = inputs[0].0;
    let target = Shape(shape.to_vec());
    if x.numel() != target.numel() {
        return Err(mismatch(op, "element counts differ", x, &target));
    }
    Ok((target, inputs[0].1))
}

fn permute(op: &Op, inputs: &[Typed], perm: &[usize]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    let x = inputs[0].0;
    let mut seen = vec![false; x.rank()];
    if perm.len() != x.rank() || perm.iter().any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true))
    {
        return Err(invalid(op, format!("{perm:?} is not a permutation of the axes of {x}")));
    }
    Ok((Shape(perm.iter().map(|&p| x.0[p]).collect()), inputs[0].1))
}

fn broadcast(op: &Op, inputs: &[Typed], shape: &[usize]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    let x = inputs[0].0;
    let target = Shape(shape.to_vec());
    if x.broadcast(&target).as_ref() != Some(&target) {
        return Err(mismatch(op, "cannot broadcast", x, &target));
    }
    Ok((target, inputs[0].1))
}

fn slice(
    op: &Op,
    inputs: &[Typed],
    axis: usize,
    start: usize,
    end: usize,
) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    let x = inputs[0].0;
    if axis >= x.rank() || start >= end || end > x.0[axis] {
        return Err(invalid(op, format!("slice {start}..{end} on axis {axis} is out of range for {x}")));
    }
    let mut dims = x.0.clone();
    dims[axis] = end - start;
    Ok((Shape(dims), inputs[0].1))
}

fn concat(op: &Op, inputs: &[Typed], axis: usize) -> Result<(Shape, DType), GraphError> {
    min_arity(op, inputs, 1)?;
    let first = inputs[0].0;
    if axis >= first.rank() {
        return Err(invalid(op, format!("axis {axis} out of range for {first}")));
    }
    let mut dims = first.0.clone();
    dims[axis] = 0;
    for (slot, (s, dt)) in inputs.iter().enumerate() {
        if *dt != inputs[0].1 {
            return Err(GraphError::DType {
                op: op.name().into(),
                slot,
                got: *dt,
                expected: inputs[0].1.name().into(),
            });
        }
        let same_rank = s.rank() == first.rank();
        if !same_rank || (0..first.rank()).any(|i| i != axis && s.0[i] != first.0[i]) {
            return Err(mismatch(op, format!("inputs differ off axis {axis}"), first, s));
        }
        dims[axis] += s.0[axis];
    }
    Ok((Shape(dims), inputs[0].1))
}

fn gather(op: &Op, inputs: &[Typed], axis: usize) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[2])?;
    int(op, inputs, 1)?;
    let (x, idx) = (inputs[0].0, inputs[1].0);
    if axis >= x.rank() || idx.rank() < axis || idx.0[..axis] != x.0[..axis] {
        return Err(mismatch(op, format!("index must share the {axis} leading dims of x"), x, idx));
    }
    let mut dims = idx.0.clone();
    dims.extend_from_slice(&x.0[axis + 1..]);
    Ok((Shape(dims), inputs[0].1))
}

/// `ScatterAdd` (`replaces_rows` false) and `ScatterRows` (true): the base's shape.
fn scatter(
    op: &Op,
    inputs: &[Typed],
    axis: usize,
    replaces_rows: bool,
) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[3])?;
    int(op, inputs, 1)?;
    let (base, idx, src) = (inputs[0].0, inputs[1].0, inputs[2].0);
    if axis >= base.rank() || idx.rank() < axis || idx.0[..axis] != base.0[..axis] {
        return Err(mismatch(op, format!("index must share the {axis} leading dims of base"), base, idx));
    }
    let mut expected = idx.0.clone();
    expected.extend_from_slice(&base.0[axis + 1..]);
    if src.0 != expected {
        return Err(mismatch(op, format!("src must be {}", Shape(expected)), base, src));
    }
    let (base_dt, src_dt) = (inputs[0].1, inputs[2].1);
    let base_compute = float(op, inputs, 0)?;
    if !src_dt.is_float() || src_dt.compute() != base_compute {
        return Err(GraphError::DType {
            op: op.name().into(),
            slot: 2,
            got: src_dt,
            expected: base_dt.name().into(),
        });
    }
    // Replacing rows moves data, so equal storage types are kept (a bf16 state stays
    // bf16); accumulating is arithmetic and computes in f32 (docs/math.md §6.12).
    let keeps_storage = replaces_rows && base_dt == src_dt;
    Ok((base.clone(), if keeps_storage { base_dt } else { base_compute }))
}

// Norms.

/// RMSNorm, LayerNorm and GroupNorm (`groups`): x with optional last-axis gain and
/// bias (`allowed` operand counts).
fn norm(
    op: &Op,
    inputs: &[Typed],
    allowed: &[usize],
    groups: Option<usize>,
) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, allowed)?;
    let dt = same_dtype(op, inputs)?;
    let x = inputs[0].0;
    if x.rank() == 0 {
        return Err(invalid(op, "cannot normalize a scalar"));
    }
    for (slot, (p, _)) in inputs.iter().enumerate().skip(1) {
        last_axis_param(op, x, p, if slot == 1 { "gain" } else { "bias" })?;
    }
    if let Some(groups) = groups {
        if groups == 0 || !x.last().is_multiple_of(groups) {
            return Err(invalid(op, format!("{} channels do not split into {groups} groups", x.last())));
        }
    }
    Ok((x.clone(), dt))
}

fn norm_project(op: &Op, inputs: &[Typed], centered: usize) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[2])?;
    let dt = same_dtype(op, inputs)?;
    let (x, w) = (inputs[0].0, inputs[1].0);
    if x.rank() == 0 || w.rank() != 2 || w.0[0] != x.last() {
        return Err(mismatch(op, "w must be [K, M] with K the last axis of x", x, w));
    }
    if centered > w.0[1] {
        return Err(invalid(op, format!("centered {centered} exceeds the {} outputs", w.0[1])));
    }
    let mut dims = x.0.clone();
    *dims.last_mut().expect("rank >= 1") = w.0[1];
    Ok((Shape(dims), dt))
}

// Loss and attention.

fn softmax_cross_entropy(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[2])?;
    float(op, inputs, 0)?;
    int(op, inputs, 1)?;
    let (logits, targets) = (inputs[0].0, inputs[1].0);
    if logits.rank() == 0 || logits.0[..logits.rank() - 1] != targets.0[..] {
        return Err(mismatch(
            op,
            "targets must be the logits' shape without the class axis",
            logits,
            targets,
        ));
    }
    Ok((Shape::scalar(), inputs[0].1))
}

/// (x [.., D], w [D, V] or, `trans_b`, [V, D], targets [..]) -> scalar (docs/math.md §1.7).
fn linear_cross_entropy(
    op: &Op,
    inputs: &[Typed],
    trans_b: bool,
    chunk: usize,
) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[3])?;
    let dt = same_dtype(op, &inputs[..2])?;
    int(op, inputs, 2)?;
    let (x, w, targets) = (inputs[0].0, inputs[1].0, inputs[2].0);
    if chunk == 0 {
        return Err(invalid(op, "chunk must be at least one row"));
    }
    if x.rank() == 0 || w.rank() != 2 {
        return Err(mismatch(op, "x must be [.., D] and w a matrix", x, w));
    }
    let contracted = if trans_b { w.0[1] } else { w.0[0] };
    if contracted != x.last() {
        return Err(mismatch(op, "x's last axis must be w's contraction axis", x, w));
    }
    if x.0[..x.rank() - 1] != targets.0[..] {
        return Err(mismatch(op, "targets must be x's shape without its last axis", x, targets));
    }
    Ok((Shape::scalar(), dt))
}

fn causal_attention(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[3])?;
    let dt = same_dtype(op, inputs)?;
    let (q, k, v) = (inputs[0].0, inputs[1].0, inputs[2].0);
    if q.rank() != 4 || k.rank() != 4 || k != v {
        return Err(mismatch(op, "q must be [B, T, H, dh]; k and v equal [B, T, Hkv, dh]", q, k));
    }
    let (h, hkv) = (q.0[2], k.0[2]);
    if q.0[0] != k.0[0] || q.0[1] != k.0[1] || q.0[3] != k.0[3] || hkv == 0 || h % hkv != 0 {
        return Err(mismatch(op, "q and k/v disagree on B, T or dh, or H % Hkv != 0", q, k));
    }
    Ok((q.clone(), dt))
}

// Connections (docs/math.md §4, §6).

fn topk(op: &Op, inputs: &[Typed], k: usize, fixed: usize) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    float(op, inputs, 0)?;
    let x = inputs[0].0;
    if x.rank() == 0 || k > x.last() || fixed > k {
        return Err(invalid(op, format!("need fixed {fixed} <= k {k} <= last axis of {x}")));
    }
    let mut dims = x.0.clone();
    *dims.last_mut().expect("rank >= 1") = k;
    Ok((Shape(dims), DType::I32))
}

fn sinkhorn(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    arity(op, inputs, &[1])?;
    let x = inputs[0].0;
    if x.rank() < 2 || x.0[x.rank() - 1] != x.0[x.rank() - 2] {
        return Err(invalid(op, format!("needs square trailing matrices, got {x}")));
    }
    Ok((x.clone(), float(op, inputs, 0)?))
}

fn temporal_augment(op: &Op, inputs: &[Typed]) -> Result<(Shape, DType), GraphError> {
    min_arity(op, inputs, 2)?;
    let dt = same_dtype(op, inputs)?;
    let out = inputs[0].0;
    if out.rank() != 3 {
        return Err(invalid(op, format!("out must be [B, T, C], got {out}")));
    }
    for (w, _) in &inputs[1..] {
        if w.rank() != 2 || w.0[1] != out.0[2] || w.0[0] == 0 {
            return Err(mismatch(op, "kernels must be [kappa, C]", out, w));
        }
    }
    Ok((Shape::new([out.0[0], out.0[1], inputs.len() - 1, out.0[2]]), dt))
}

#[cfg(test)]
mod tests {
    use super::super::{Graph, Init, Op, ParamClass, ParamInfo};
    use crate::{DType, Shape};

    fn param(g: &mut Graph, name: &str, dims: &[usize]) -> super::super::NodeId {
        let info = ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Hidden };
        g.add_source(Op::Param(info), Shape::new(dims), DType::F32, None)
    }

    #[test]
    fn matmul_rejects_mismatched_contraction_naming_op_and_shapes() {
        let mut g = Graph::new();
        let a = param(&mut g, "a", &[2, 3, 4]);
        let b = param(&mut g, "b", &[5, 6]);
        let err = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[a, b]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("matmul"), "{msg}");
        assert!(msg.contains("[2, 3, 4]") && msg.contains("[5, 6]"), "{msg}");
    }

    #[test]
    fn matmul_broadcasts_batch_and_honours_transposes() {
        let mut g = Graph::new();
        let a = param(&mut g, "a", &[2, 3, 4]);
        let b = param(&mut g, "b", &[5, 4]);
        let c = g.add(Op::MatMul { trans_a: false, trans_b: true }, &[a, b]).unwrap();
        assert_eq!(g.node(c).shape, Shape::new([2, 3, 5]));
    }

    #[test]
    fn gather_and_scatter_shapes() {
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[2, 3, 16, 8]);
        let scores = param(&mut g, "s", &[2, 3, 16]);
        let idx = g.add(Op::TopK { k: 4, fixed: 2 }, &[scores]).unwrap();
        assert_eq!(g.node(idx).dtype, DType::I32);
        let act = g.add(Op::Gather { axis: 2 }, &[x, idx]).unwrap();
        assert_eq!(g.node(act).shape, Shape::new([2, 3, 4, 8]));
        let back = g.add(Op::ScatterRows { axis: 2 }, &[x, idx, act]).unwrap();
        assert_eq!(g.node(back).shape, Shape::new([2, 3, 16, 8]));
        let err = g.add(Op::ScatterRows { axis: 2 }, &[x, idx, x]).unwrap_err();
        assert!(err.to_string().contains("scatter_rows"));
    }

    #[test]
    fn norm_gain_must_match_last_axis() {
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[2, 8]);
        let gain = param(&mut g, "g", &[4]);
        let err = g.add(Op::RmsNorm { eps: 1e-5 }, &[x, gain]).unwrap_err().to_string();
        assert!(err.contains("rms_norm") && err.contains("[2, 8]") && err.contains("[4]"), "{err}");
    }
}
