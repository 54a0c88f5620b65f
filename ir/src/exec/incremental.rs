//! Incremental decoding: the model's main-head logits one position at a time, with a
//! cache, on the reference executor's op functions (docs/architecture.md §7, "Sampling").
//!
//! The decoder evaluates the forward graph lowered for one position (`ir::lower::lower`
//! at batch 1 and sequence length 1, without MTP modules: they neither feed the trunk nor
//! the main head, docs/math.md §7.1). Almost every op of that graph computes a position
//! from that position alone, so it runs as it is; [`eval_kind`] names, for every op, why.
//! The ops that look across positions keep a cache per node instead:
//!
//! - `CausalAttention` keeps the keys (rotated by RoPE at their absolute position,
//!   docs/math.md §1.3) and values of every earlier position, and the query of the new
//!   position attends over them and itself, in the same arithmetic order as the
//!   full-window op;
//! - `TemporalAugment` (xHC, docs/math.md §6.5) keeps the last κ − 1 rows of its input
//!   `out`, the rows its causal convolutions read, and evaluates the op on that short
//!   window (the Gram–Schmidt sweep is per position).
//!
//! [`Decoder::prefill`] fills every cache at once from one whole-window forward of the
//! reference executor (the same spec lowered for the window's length): the keys, values
//! and temporal rows are read from that graph's operands of the matching ops.
//!
//! MoE routing (`MoeRoute`, docs/math.md §1.6) orders the assignments of every position
//! of the window jointly, so with a capacity limit a full-window forward may drop a
//! position's assignment that an earlier position crowded out. Here it routes one
//! position: each chosen expert has one assignment and the capacity (at least 1) never
//! binds, so the decoder equals the full window exactly when the window drops nothing
//! (a prefill routes its window jointly, as the full window does).

use super::attention::AttnDims;
use super::reduce::softmax_row;
use super::{connection, eval_op, ExecError, Float, OpCtx, Tensor, Value};
use crate::graph::{Graph, NodeId, Op};
use crate::lower::{lower, LowerError};
use crate::spec::ModelSpec;
use crate::{DType, Shape};
use std::borrow::Cow;
use std::collections::HashMap;

/// Errors building or running an incremental decoder.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "{op} at %{node} is on the path to the logits but is not a forward op the incremental decoder \
         evaluates ({why})"
    )]
    Unsupported { op: &'static str, node: usize, why: &'static str },
    #[error("the graph has no parameter `{name}`")]
    UnknownParam { name: String },
    #[error("parameter `{name}` has shape {got}, the graph expects {expected}")]
    ParamShape { name: String, got: Shape, expected: Shape },
    #[error("no value bound for parameter `{name}`")]
    Unbound { name: String },
    #[error("the token input must be i32 [1, 2] (one position's window), the graph has {dtype} {shape}")]
    TokenInput { dtype: DType, shape: Shape },
    #[error("the logits output must be float [1, 1, V], the graph has {dtype} {shape}")]
    LogitsOutput { dtype: DType, shape: Shape },
    #[error("{op} at %{node}: {message}")]
    Cache { op: &'static str, node: usize, message: String },
    #[error(transparent)]
    Lower(#[from] LowerError),
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// How the decoder evaluates an op of the one-position graph ([`eval_kind`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EvalKind {
    /// A source: the token input (bound per position), a parameter (bound once) or a
    /// constant (filled once).
    Source,
    /// The op's output at a position depends on that position's operands alone:
    /// evaluated as it is by the reference executor.
    PerPosition,
    /// Causal attention over the cached keys and values of the earlier positions.
    CachedAttention { scale: f64, rope_base: Option<f64> },
    /// xHC temporal augmentation over the cached earlier rows of its input.
    CachedTemporal { gram_schmidt: bool, eps_rel: f64 },
}

/// Where the decision "per position or cached" is made, for every op: a new op does not
/// compile until it is placed here (docs/adding-an-op.md). `Err` holds why the op cannot
/// be on the path from the tokens to the logits.
pub fn eval_kind(op: &Op) -> Result<EvalKind, &'static str> {
    Ok(match op {
        Op::Input { .. } | Op::Param(_) | Op::Constant { .. } => EvalKind::Source,
        // Elementwise: each element from the same-index elements of its operands.
        Op::Unary(_) | Op::Binary(_) | Op::Affine { .. } | Op::Cast { .. } => EvalKind::PerPosition,
        // Views and reductions of the one-position graph: the lowering moves and folds
        // the token axis only in the losses and the MoE statistics, which the logits do
        // not read (the logits-equality tests check every scheme).
        Op::Reduce { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. } => EvalKind::PerPosition,
        // Products with parameters (or within one position's stream/segment axes).
        Op::MatMul { .. } | Op::NormProject { .. } => EvalKind::PerPosition,
        // Rows chosen by indices computed from the same position (stream routing, the
        // MoE dispatch of one position's assignments).
        Op::Gather { .. } | Op::ScatterAdd { .. } | Op::ScatterRows { .. } => EvalKind::PerPosition,
        // Row-wise and matrix-wise: over the last axes of one position.
        Op::TopK { .. }
        | Op::Softmax
        | Op::RmsNorm { .. }
        | Op::LayerNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Sinkhorn { .. } => EvalKind::PerPosition,
        // Routing of one position's assignments: nothing to drop (see the module doc).
        Op::MoeRoute { .. } | Op::GroupedMatMul { .. } => EvalKind::PerPosition,
        Op::CausalAttention { scale, rope_base } => {
            EvalKind::CachedAttention { scale: *scale, rope_base: *rope_base }
        }
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            EvalKind::CachedTemporal { gram_schmidt: *gram_schmidt, eps_rel: *eps_rel }
        }
        Op::SoftmaxCrossEntropy | Op::LinearCrossEntropy { .. } => {
            return Err("a loss reads the targets, not a forward activation")
        }
        Op::CausalAttentionGrad { .. }
        | Op::LinearCrossEntropyGrad { .. }
        | Op::SinkhornGrad { .. }
        | Op::TemporalAugmentGrad { .. }
        | Op::GroupedMatMulGrad { .. } => return Err("a backward op, added by autodiff"),
    })
}

/// One node of the schedule: what it is, its operands and how it is evaluated.
#[derive(Debug)]
struct Step {
    id: NodeId,
    inputs: Vec<NodeId>,
    kind: EvalKind,
    /// Values of this schedule read by no later step are freed after this one.
    frees: Vec<NodeId>,
}

/// What a cached node remembers of the earlier positions.
#[derive(Debug, Clone)]
enum Cache<T> {
    /// Keys (after RoPE) and values of every earlier position, `[pos, hkv, dh]` each.
    Attention { keys: Vec<T>, values: Vec<T> },
    /// The most recent earlier rows of the `out` operand, oldest first, `[rows, C]`.
    Temporal { rows: Vec<T>, keep: usize },
}

/// The incremental decoder of one model (see the module doc). Bind every parameter with
/// [`Decoder::set_param`], then feed the context one token at a time with
/// [`Decoder::step`]; [`Decoder::reset`] starts a new context at position 0.
#[derive(Debug)]
pub struct Decoder<T> {
    graph: Graph,
    tokens: NodeId,
    logits: NodeId,
    schedule: Vec<Step>,
    /// Parameters and constants: bound once, borrowed at every position.
    fixed: HashMap<NodeId, Value<T>>,
    caches: HashMap<NodeId, Cache<T>>,
    position: usize,
    /// The spec without MTP modules, when the decoder was built from one: what
    /// [`Decoder::prefill`] lowers its whole-window graphs from.
    spec: Option<ModelSpec>,
    /// Whole-window graphs by window length, lowered on first use.
    prefills: HashMap<usize, Prefill>,
}

/// A whole-window forward graph for [`Decoder::prefill`] and how its nodes match the
/// one-position graph's.
#[derive(Debug)]
struct Prefill {
    graph: Graph,
    tokens: NodeId,
    logits: NodeId,
    /// Each parameter: its node here and in the one-position graph.
    params: Vec<(NodeId, NodeId)>,
    /// Each cached node of the one-position graph and the operands here it is filled
    /// from: keys and values of an attention, the `out` operand of a temporal augmentation.
    caches: Vec<(NodeId, Vec<NodeId>)>,
}

impl<T: Float> Decoder<T> {
    /// The decoder of `spec`'s main head: its forward graph lowered for one position at
    /// batch 1, without MTP modules (module doc).
    pub fn for_spec(spec: &ModelSpec) -> Result<Self, DecodeError> {
        let mut one = spec.clone();
        one.mtp.depth = 0;
        let lowered = lower(&one, 1, 1)?;
        let mut decoder = Decoder::new(lowered.graph, lowered.tokens, lowered.logits)?;
        decoder.spec = Some(one);
        Ok(decoder)
    }

    /// A decoder over a one-position graph: `tokens` its i32 `[1, 2]` window input (the
    /// position's token, then the target, which the logits do not read), `logits` its
    /// `[1, 1, V]` output. Refuses a graph whose logits need an op that is not a forward
    /// op ([`eval_kind`]).
    pub fn new(graph: Graph, tokens: NodeId, logits: NodeId) -> Result<Self, DecodeError> {
        for id in [tokens, logits] {
            if !graph.g.contains_node(id) {
                return Err(ExecError::UnknownNode { node: id.index() }.into());
            }
        }
        let t = graph.node(tokens);
        if t.dtype != DType::I32 || t.shape.dims() != [1, 2] {
            return Err(DecodeError::TokenInput { dtype: t.dtype, shape: t.shape.clone() });
        }
        let l = graph.node(logits);
        if l.dtype == DType::I32 || l.shape.rank() != 3 || l.shape.dims()[..2] != [1, 1] {
            return Err(DecodeError::LogitsOutput { dtype: l.dtype, shape: l.shape.clone() });
        }
        let mut needed = std::collections::HashSet::new();
        let mut stack = vec![logits];
        while let Some(id) = stack.pop() {
            if needed.insert(id) {
                stack.extend(graph.inputs(id));
            }
        }
        let order: Vec<NodeId> = graph.topo_order().into_iter().filter(|id| needed.contains(id)).collect();
        let mut last_use: HashMap<NodeId, usize> = HashMap::new();
        for (at, &id) in order.iter().enumerate() {
            for input in graph.inputs(id) {
                last_use.insert(input, at);
            }
        }
        let mut frees: Vec<Vec<NodeId>> = vec![Vec::new(); order.len()];
        for (&id, &at) in &last_use {
            if id != logits {
                frees[at].push(id);
            }
        }
        let mut schedule = Vec::with_capacity(order.len());
        let mut fixed = HashMap::new();
        for (at, &id) in order.iter().enumerate() {
            let node = graph.node(id);
            let kind = eval_kind(&node.op).map_err(|why| DecodeError::Unsupported {
                op: node.op.name(),
                node: id.index(),
                why,
            })?;
            if let Op::Constant { value } = node.op {
                fixed.insert(id, super::constant(node, value));
            }
            schedule.push(Step { id, inputs: graph.inputs(id), kind, frees: std::mem::take(&mut frees[at]) });
        }
        Ok(Decoder {
            graph,
            tokens,
            logits,
            schedule,
            fixed,
            caches: HashMap::new(),
            position: 0,
            spec: None,
            prefills: HashMap::new(),
        })
    }

    /// The parameters the logits read: name and shape, in schedule order.
    pub fn params(&self) -> Vec<(&str, &Shape)> {
        self.schedule
            .iter()
            .filter_map(|s| match &self.graph.node(s.id).op {
                Op::Param(p) => Some((p.name.as_str(), &self.graph.node(s.id).shape)),
                _ => None,
            })
            .collect()
    }

    /// Binds parameter `name` (a checkpoint name). A parameter the logits do not read is
    /// refused as unknown.
    pub fn set_param(&mut self, name: &str, value: Tensor<T>) -> Result<(), DecodeError> {
        let id = self
            .schedule
            .iter()
            .map(|s| s.id)
            .find(|&id| matches!(&self.graph.node(id).op, Op::Param(p) if p.name == name))
            .ok_or_else(|| DecodeError::UnknownParam { name: name.to_string() })?;
        let expected = &self.graph.node(id).shape;
        if value.shape != *expected {
            return Err(DecodeError::ParamShape {
                name: name.to_string(),
                got: value.shape,
                expected: expected.clone(),
            });
        }
        self.fixed.insert(id, Value::Float(value));
        Ok(())
    }

    /// The logits row length (the model's padded vocabulary).
    pub fn vocab(&self) -> usize {
        self.graph.node(self.logits).shape.last()
    }

    /// The position the next [`Decoder::step`] evaluates: the tokens fed since the last
    /// reset.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Forgets every earlier position: the next token is at position 0.
    pub fn reset(&mut self) {
        self.caches.clear();
        self.position = 0;
    }

    /// Starts a new context with `tokens` (at least one) and returns the logits after the
    /// last of them: one whole-window forward of the reference executor fills every cache
    /// at once (the keys and values of every position, the last rows of every temporal
    /// input), the work of a full-window forward instead of one evaluation per position.
    /// A decoder built by [`Decoder::new`] (no spec to lower) feeds them one by one.
    pub fn prefill(&mut self, tokens: &[i32]) -> Result<Vec<T>, DecodeError> {
        self.reset();
        let Some((&last, _)) = tokens.split_last() else {
            return Err(cache_err(
                &OpCtx { op: &self.graph.node(self.tokens).op, node: self.tokens.index() },
                "a prefill needs at least one token",
            ));
        };
        if tokens.len() == 1 || self.spec.is_none() {
            for &t in &tokens[..tokens.len() - 1] {
                self.step(t)?;
            }
            return self.step(last);
        }
        let w = tokens.len();
        if !self.prefills.contains_key(&w) {
            let prefill = self.prefill_graph(w)?;
            self.prefills.insert(w, prefill);
        }
        let prefill = &self.prefills[&w];
        let mut sources: HashMap<NodeId, Value<T>> = HashMap::with_capacity(prefill.params.len() + 1);
        for &(here, one) in &prefill.params {
            let value = self.fixed.get(&one).ok_or_else(|| DecodeError::Unbound {
                name: match &self.graph.node(one).op {
                    Op::Param(p) => p.name.clone(),
                    op => op.name().to_string(),
                },
            })?;
            sources.insert(here, value.clone());
        }
        let mut window = tokens.to_vec();
        window.push(0);
        sources.insert(prefill.tokens, Value::Int(Tensor::new(Shape::new([1, w + 1]), window)));
        let mut outputs = vec![prefill.logits];
        outputs.extend(prefill.caches.iter().flat_map(|(_, operands)| operands.iter().copied()));
        let values = super::run(&prefill.graph, &sources, &outputs)?;
        let float = |id: &NodeId| -> &[T] { values[id].as_float().map_or(&[], |t| &t.data[..]) };
        for (one, operands) in &prefill.caches {
            let cache = match self.schedule.iter().find(|s| s.id == *one).map(|s| s.kind) {
                Some(EvalKind::CachedAttention { rope_base, .. }) => {
                    let mut keys = float(&operands[0]).to_vec();
                    let dims = prefill.graph.node(operands[0]).shape.dims().to_vec();
                    let (row, dh) = (dims[2] * dims[3], dims[3]);
                    if let Some(base) = rope_base.filter(|_| dh > 0) {
                        for (pos, chunk) in keys.chunks_exact_mut(row).enumerate() {
                            rope_position(chunk, pos, dh, base);
                        }
                    }
                    Cache::Attention { keys, values: float(&operands[1]).to_vec() }
                }
                Some(EvalKind::CachedTemporal { .. }) => {
                    let out = float(&operands[0]);
                    let c = prefill.graph.node(operands[0]).shape.last();
                    let keep = self.temporal_keep(*one);
                    Cache::Temporal { rows: out[out.len() - keep.min(w) * c..].to_vec(), keep }
                }
                _ => continue,
            };
            self.caches.insert(*one, cache);
        }
        self.position = w;
        let logits = float(&prefill.logits);
        let v = self.vocab();
        Ok(logits[logits.len() - v..].to_vec())
    }

    /// The rows a temporal augmentation node keeps: κ − 1 of its longest kernel.
    fn temporal_keep(&self, id: NodeId) -> usize {
        let kernels = &self.graph.inputs(id)[1..];
        kernels.iter().map(|&k| self.graph.node(k).shape.dims()[0]).max().unwrap_or(1).saturating_sub(1)
    }

    /// Lowers the whole-window graph of `w` positions and matches its parameters (by
    /// name) and its cached ops (in evaluation order) to the one-position graph's.
    fn prefill_graph(&self, w: usize) -> Result<Prefill, DecodeError> {
        let spec = self.spec.as_ref().expect("only a decoder built from a spec prefills");
        let lowered = lower(spec, 1, w)?;
        let graph = lowered.graph;
        let mut needed = std::collections::HashSet::new();
        let mut stack = vec![lowered.logits];
        while let Some(id) = stack.pop() {
            if needed.insert(id) {
                stack.extend(graph.inputs(id));
            }
        }
        let order: Vec<NodeId> = graph.topo_order().into_iter().filter(|id| needed.contains(id)).collect();
        let mut params = Vec::new();
        for &id in &order {
            if let Op::Param(p) = &graph.node(id).op {
                let one = self
                    .schedule
                    .iter()
                    .map(|s| s.id)
                    .find(|&o| matches!(&self.graph.node(o).op, Op::Param(q) if q.name == p.name))
                    .ok_or_else(|| DecodeError::UnknownParam { name: p.name.clone() })?;
                params.push((id, one));
            }
        }
        let cached = |g: &Graph, ids: &[NodeId]| -> Vec<NodeId> {
            ids.iter()
                .copied()
                .filter(|&id| {
                    matches!(g.node(id).op, Op::CausalAttention { .. } | Op::TemporalAugment { .. })
                })
                .collect()
        };
        let here = cached(&graph, &order);
        let ones: Vec<NodeId> = self.schedule.iter().map(|s| s.id).collect();
        let ones = cached(&self.graph, &ones);
        let mismatch = |node: NodeId, message: String| DecodeError::Cache {
            op: self.graph.node(node).op.name(),
            node: node.index(),
            message,
        };
        if here.len() != ones.len() {
            return Err(mismatch(
                self.logits,
                format!(
                    "the {w}-position graph has {} cached ops, the one-position graph {}",
                    here.len(),
                    ones.len()
                ),
            ));
        }
        let mut caches = Vec::new();
        for (&h, &o) in here.iter().zip(&ones) {
            if graph.node(h).op != self.graph.node(o).op {
                return Err(mismatch(
                    o,
                    format!(
                        "matches {} at %{} of the {w}-position graph",
                        graph.node(h).op.name(),
                        h.index()
                    ),
                ));
            }
            let inputs = graph.inputs(h);
            let operands = match graph.node(h).op {
                Op::CausalAttention { .. } => vec![inputs[1], inputs[2]],
                _ => vec![inputs[0]],
            };
            caches.push((o, operands));
        }
        Ok(Prefill { graph, tokens: lowered.tokens, logits: lowered.logits, params, caches })
    }

    /// Feeds `token` at the next position and returns that position's logits (the
    /// prediction of the token after it). The token id is not range-checked here beyond
    /// what the embedding gather checks. A failed position forgets the whole context
    /// (some caches would otherwise be a position ahead of others): reset and feed again.
    pub fn step(&mut self, token: i32) -> Result<Vec<T>, DecodeError> {
        let result = self.step_once(token);
        if result.is_err() {
            self.reset();
        }
        result
    }

    fn step_once(&mut self, token: i32) -> Result<Vec<T>, DecodeError> {
        let window = Value::Int(Tensor::new(Shape::new([1, 2]), vec![token, 0]));
        let Decoder { graph, tokens, logits, schedule, fixed, caches, position, .. } = self;
        let mut values: HashMap<NodeId, Cow<Value<T>>> = HashMap::new();
        for step in schedule.iter() {
            let node = graph.node(step.id);
            let value = match step.kind {
                EvalKind::Source => match &node.op {
                    Op::Input { .. } if step.id == *tokens => Cow::Borrowed(&window),
                    Op::Input { name } => {
                        return Err(ExecError::Unbound {
                            kind: "input",
                            node: step.id.index(),
                            name: name.clone(),
                        }
                        .into())
                    }
                    Op::Param(p) => Cow::Borrowed(
                        fixed.get(&step.id).ok_or_else(|| DecodeError::Unbound { name: p.name.clone() })?,
                    ),
                    _ => Cow::Borrowed(&fixed[&step.id]),
                },
                kind => {
                    let args: Vec<&Value<T>> = step.inputs.iter().map(|i| values[i].as_ref()).collect();
                    let cx = OpCtx { op: &node.op, node: step.id.index() };
                    let value = match kind {
                        EvalKind::CachedAttention { scale, rope_base } => {
                            let cache = caches
                                .entry(step.id)
                                .or_insert_with(|| Cache::Attention { keys: Vec::new(), values: Vec::new() });
                            let (q, k, v) = (cx.float(&args, 0)?, cx.float(&args, 1)?, cx.float(&args, 2)?);
                            Value::Float(attend(&cx, cache, *position, (q, k, v), scale, rope_base)?)
                        }
                        EvalKind::CachedTemporal { gram_schmidt, eps_rel } => {
                            let out = cx.float(&args, 0)?;
                            let kernels =
                                (1..args.len()).map(|s| cx.float(&args, s)).collect::<Result<Vec<_>, _>>()?;
                            let keep = kernels
                                .iter()
                                .map(|w| w.shape.dims()[0])
                                .max()
                                .unwrap_or(1)
                                .saturating_sub(1);
                            let cache = caches
                                .entry(step.id)
                                .or_insert_with(|| Cache::Temporal { rows: Vec::new(), keep });
                            Value::Float(augment(&cx, cache, out, &kernels, gram_schmidt, eps_rel)?)
                        }
                        _ => eval_op(&cx, &args, &node.shape)?,
                    };
                    super::check_result(&cx, node, &value)?;
                    Cow::Owned(value)
                }
            };
            values.insert(step.id, value);
            for id in &step.frees {
                values.remove(id);
            }
        }
        *position += 1;
        match values.remove(logits).map(Cow::into_owned) {
            Some(Value::Float(t)) => Ok(t.data),
            _ => Err(ExecError::UnknownNode { node: logits.index() }.into()),
        }
    }
}

/// Rotates the `heads` rows of one position (`x`, `[heads, dh]`) by RoPE at `pos`, the
/// half-split convention of docs/math.md §1.3 with the angles computed as the
/// full-window op computes them (`attention::rope_in_place`), so both agree bit for bit.
fn rope_position<T: Float>(x: &mut [T], pos: usize, dh: usize, base: f64) {
    let half = dh / 2;
    let angles: Vec<(T, T)> = (0..half)
        .map(|i| {
            let phi = pos as f64 * base.powf(-2.0 * i as f64 / dh as f64);
            (T::from_f64(phi.cos()), T::from_f64(phi.sin()))
        })
        .collect();
    for row in x.chunks_exact_mut(dh) {
        let (lo, hi) = row.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(&angles) {
            let (x0, x1) = (*a, *b);
            *a = x0 * c - x1 * s;
            *b = x0 * s + x1 * c;
        }
    }
}

/// Causal attention of the query at `pos` over the cached keys and values and its own
/// (docs/math.md §1.3), in the order of the full-window op (`attention::causal_attention`):
/// scores as dot products times the scale, a softmax, then the values summed in position
/// order.
fn attend<T: Float>(
    cx: &OpCtx,
    cache: &mut Cache<T>,
    pos: usize,
    (q, k, v): (&Tensor<T>, &Tensor<T>, &Tensor<T>),
    scale: f64,
    rope_base: Option<f64>,
) -> Result<Tensor<T>, DecodeError> {
    let Cache::Attention { keys, values } = cache else {
        return Err(cache_err(cx, "the cache of another op"));
    };
    let d = AttnDims::new(q.shape.dims(), k.shape.dims());
    if d.b != 1 || d.t != 1 {
        return Err(cache_err(cx, format!("needs one position at batch 1, got q {}", q.shape)));
    }
    if rope_base.is_some() && d.dh % 2 == 1 {
        return Err(cache_err(cx, format!("RoPE needs an even head dim, got {}", d.dh)));
    }
    let row = d.hkv * d.dh;
    if keys.len() != pos * row || values.len() != pos * row {
        return Err(cache_err(
            cx,
            format!("the cache holds {} positions, position {pos} is next", keys.len() / row.max(1)),
        ));
    }
    let mut qr = q.data.clone();
    let mut kr = k.data.clone();
    if let Some(base) = rope_base.filter(|_| d.dh > 0) {
        rope_position(&mut qr, pos, d.dh, base);
        rope_position(&mut kr, pos, d.dh, base);
    }
    keys.extend_from_slice(&kr);
    values.extend_from_slice(&v.data);
    let scale = T::from_f64(scale);
    let n = pos + 1;
    let mut out = vec![T::zero(); d.h * d.dh];
    let (mut scores, mut probs) = (vec![T::zero(); n], vec![T::zero(); n]);
    for h in 0..d.h {
        let g = d.kv_head(h);
        let qrow = &qr[h * d.dh..(h + 1) * d.dh];
        for (tp, s) in scores.iter_mut().enumerate() {
            let at = (tp * d.hkv + g) * d.dh;
            let krow = &keys[at..at + d.dh];
            *s = qrow.iter().zip(krow).fold(T::zero(), |acc, (&x, &y)| acc + x * y) * scale;
        }
        softmax_row(&scores, &mut probs);
        let orow = &mut out[h * d.dh..(h + 1) * d.dh];
        for (tp, &p) in probs.iter().enumerate() {
            let at = (tp * d.hkv + g) * d.dh;
            orow.iter_mut().zip(&values[at..at + d.dh]).for_each(|(o, &x)| *o += p * x);
        }
    }
    Ok(Tensor { shape: q.shape.clone(), data: out })
}

/// Temporal augmentation (docs/math.md §6.5) of the newest position: the op on the short
/// window of the cached earlier rows of `out` and the new row, whose last position is
/// what the full window computes there (each convolution reads at most κ − 1 earlier
/// rows; Gram–Schmidt is per position). The new row joins the cache.
fn augment<T: Float>(
    cx: &OpCtx,
    cache: &mut Cache<T>,
    out: &Tensor<T>,
    kernels: &[&Tensor<T>],
    gram_schmidt: bool,
    eps_rel: f64,
) -> Result<Tensor<T>, DecodeError> {
    let Cache::Temporal { rows, keep } = cache else {
        return Err(cache_err(cx, "the cache of another op"));
    };
    let dims = out.shape.dims();
    if dims.len() != 3 || dims[0] != 1 || dims[1] != 1 {
        return Err(cache_err(cx, format!("needs one position at batch 1, got out {}", out.shape)));
    }
    let c = dims[2];
    let r = kernels.len();
    let earlier = rows.len() / c.max(1);
    let mut window = Vec::with_capacity(rows.len() + c);
    window.extend_from_slice(rows);
    window.extend_from_slice(&out.data);
    let window = Tensor { shape: Shape::new([1, earlier + 1, c]), data: window };
    let y = connection::temporal_augment(&window, kernels, gram_schmidt, eps_rel);
    let last = y.data[earlier * r * c..].to_vec();
    rows.extend_from_slice(&out.data);
    let drop = rows.len().saturating_sub(*keep * c);
    rows.drain(..drop);
    Ok(Tensor { shape: Shape::new([1, 1, r, c]), data: last })
}

fn cache_err(cx: &OpCtx, message: impl Into<String>) -> DecodeError {
    DecodeError::Cache { op: cx.op.name(), node: cx.node, message: message.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Init, ParamClass, ParamInfo};

    fn small() -> ModelSpec {
        ModelSpec { d_model: 16, layers: 1, heads: 2, ..ModelSpec::default() }
    }

    #[test]
    fn losses_and_backward_ops_are_not_placed_per_position() {
        assert!(eval_kind(&Op::SoftmaxCrossEntropy).is_err());
        assert!(eval_kind(&Op::SinkhornGrad { iters: 1, eps: 0.0 }).is_err());
        assert_eq!(
            eval_kind(&Op::CausalAttention { scale: 0.5, rope_base: None }).unwrap(),
            EvalKind::CachedAttention { scale: 0.5, rope_base: None }
        );
        assert_eq!(eval_kind(&Op::Softmax).unwrap(), EvalKind::PerPosition);
    }

    #[test]
    fn a_graph_whose_output_needs_a_loss_is_refused_naming_the_op() {
        let lowered = lower(&small(), 1, 1).unwrap();
        let loss = lowered.graph.output("loss_main").unwrap();
        // The loss is a scalar, so make a [1, 1, V]-shaped output that reads it.
        let mut graph = lowered.graph;
        let v = small().model_vocab();
        let wide = graph.add(Op::Broadcast { shape: vec![1, 1, v] }, &[loss]).unwrap();
        let e = Decoder::<f64>::new(graph, lowered.tokens, wide).unwrap_err().to_string();
        assert!(e.starts_with("softmax_cross_entropy at %") && e.contains("reads the targets"), "{e}");
    }

    #[test]
    fn parameters_are_checked_by_name_and_shape_and_must_all_be_bound() {
        let mut d = Decoder::<f64>::for_spec(&small()).unwrap();
        let (name, shape) = d.params().first().map(|(n, s)| (n.to_string(), (*s).clone())).unwrap();
        let e = d.set_param("nope", Tensor::zeros(shape.clone())).unwrap_err().to_string();
        assert_eq!(e, "the graph has no parameter `nope`");
        let e = d.set_param(&name, Tensor::zeros(Shape::new([3]))).unwrap_err().to_string();
        assert_eq!(e, format!("parameter `{name}` has shape [3], the graph expects {shape}"));
        let e = d.step(1).unwrap_err().to_string();
        assert!(e.starts_with("no value bound for parameter `"), "{e}");
        assert_eq!(d.position(), 0, "a failed position does not count");
    }

    #[test]
    fn a_graph_that_is_not_one_position_is_refused() {
        let lowered = lower(&small(), 1, 4).unwrap();
        let e = Decoder::<f64>::new(lowered.graph, lowered.tokens, lowered.logits).unwrap_err().to_string();
        assert_eq!(e, "the token input must be i32 [1, 2] (one position's window), the graph has i32 [1, 5]");
        let mut g = Graph::new();
        let tokens = g.add_source(Op::Input { name: "tokens".into() }, Shape::new([1, 2]), DType::I32, None);
        let info = ParamInfo { name: "w".into(), init: Init::Zeros, class: ParamClass::Gain };
        let w = g.add_source(Op::Param(info), Shape::new([1, 3]), DType::F32, None);
        let e = Decoder::<f64>::new(g, tokens, w).unwrap_err().to_string();
        assert_eq!(e, "the logits output must be float [1, 1, V], the graph has f32 [1, 3]");
    }
}
