//! The reference executor: a plain Rust interpreter of the unfused graph,
//! generic over f32 and f64 (docs/architecture.md §2). It is the oracle every other
//! backend is tested against, so clarity beats speed here, except for the heavy
//! ops (MatMul through `gemm`, attention with contiguous inner loops), which CPU
//! training of small models runs on.
//!
//! One function per op, grouped by file: `elementwise`, `reduce`, `matmul`,
//! `movement`, `norms`, `attention`, `connection` (Sinkhorn, TopK,
//! TemporalAugment, NormProject) and `loss`. Backward-only ops live in
//! `backward_ops`. `incremental` evaluates the forward graph of one position with
//! caches for the ops that look across positions (sampling, docs/architecture.md §7).

mod attention;
mod backward_ops;
mod connection;
mod elementwise;
pub mod incremental;
mod loss;
mod matmul;
pub mod moe;
mod movement;
mod norms;
mod reduce;
mod tensor;

pub use tensor::{Float, Tensor, Value};

use crate::graph::{Graph, GraphError, Node, NodeId, Op, OpFamily, Source};
use crate::{DType, Shape};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

/// Errors while executing a graph.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("no value bound for {kind} node %{node} ({name})")]
    Unbound { kind: &'static str, node: usize, name: String },
    #[error("value bound to %{node} ({name}) has shape {got}, the graph expects {expected}")]
    BoundShape { node: usize, name: String, got: crate::Shape, expected: crate::Shape },
    #[error("value bound to %{node} ({name}) holds {got} values, the graph expects {expected}")]
    BoundKind { node: usize, name: String, got: &'static str, expected: DType },
    #[error("node %{node} is not in the graph")]
    UnknownNode { node: usize },
    #[error("{op} at %{node}: {message}")]
    Op { op: &'static str, node: usize, message: String },
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// The op being evaluated and its node: operand access and errors that name both.
pub(crate) struct OpCtx<'a> {
    pub op: &'a Op,
    pub node: usize,
}

impl OpCtx<'_> {
    pub(crate) fn err(&self, message: impl Into<String>) -> ExecError {
        ExecError::Op { op: self.op.name(), node: self.node, message: message.into() }
    }

    fn input<'v, T>(&self, inputs: &[&'v Value<T>], slot: usize) -> Result<&'v Value<T>, ExecError> {
        inputs.get(slot).copied().ok_or_else(|| self.err(format!("missing operand {slot}")))
    }

    /// The float operand in `slot`.
    pub(crate) fn float<'v, T>(
        &self,
        inputs: &[&'v Value<T>],
        slot: usize,
    ) -> Result<&'v Tensor<T>, ExecError> {
        self.input(inputs, slot)?.as_float().ok_or_else(|| self.err(format!("operand {slot} must be float")))
    }

    /// The i32 operand in `slot`.
    pub(crate) fn int<'v, T>(
        &self,
        inputs: &[&'v Value<T>],
        slot: usize,
    ) -> Result<&'v Tensor<i32>, ExecError> {
        self.input(inputs, slot)?.as_int().ok_or_else(|| self.err(format!("operand {slot} must be i32")))
    }

    /// The optional float operand in `slot` (norm gains and biases).
    fn float_opt<'v, T>(
        &self,
        inputs: &[&'v Value<T>],
        slot: usize,
    ) -> Result<Option<&'v Tensor<T>>, ExecError> {
        if slot < inputs.len() {
            self.float(inputs, slot).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Applies a kind-generic movement function to a float or an i32 value alike.
macro_rules! per_kind {
    ($value:expr, |$t:ident| $body:expr) => {
        match $value {
            Value::Float($t) => Value::Float($body),
            Value::Int($t) => Value::Int($body),
        }
    };
}

/// Evaluates `outputs` given values for every `Input` and `Param` node they depend on.
/// Only the nodes the outputs need run, in `Graph::topo_order`; bound values are
/// borrowed, not copied; intermediates are freed as soon as their last consumer has
/// run.
pub fn run<T: Float>(
    graph: &Graph,
    sources: &HashMap<NodeId, Value<T>>,
    outputs: &[NodeId],
) -> Result<HashMap<NodeId, Value<T>>, ExecError> {
    let mut needed = HashSet::new();
    let mut stack = outputs.to_vec();
    while let Some(id) = stack.pop() {
        if !graph.g.contains_node(id) {
            return Err(ExecError::UnknownNode { node: id.index() });
        }
        if needed.insert(id) {
            stack.extend(graph.inputs(id));
        }
    }
    let mut uses: HashMap<NodeId, usize> = HashMap::new();
    for &id in &needed {
        for input in graph.inputs(id) {
            *uses.entry(input).or_default() += 1;
        }
    }
    let keep: HashSet<NodeId> = outputs.iter().copied().collect();
    let mut values: HashMap<NodeId, Cow<Value<T>>> = HashMap::new();
    for id in graph.topo_order().into_iter().filter(|id| needed.contains(id)) {
        let node = graph.node(id);
        let input_ids = graph.inputs(id);
        let value = match node.op.family() {
            OpFamily::Source(Source::Input { name }) => Cow::Borrowed(bound(node, name, id, sources)?),
            OpFamily::Source(Source::Param(p)) => Cow::Borrowed(bound(node, &p.name, id, sources)?),
            OpFamily::Source(Source::Constant { value }) => Cow::Owned(constant(node, value)),
            OpFamily::Elementwise
            | OpFamily::View(_)
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => {
                let op = &node.op;
                let args: Vec<&Value<T>> = input_ids.iter().map(|i| values[i].as_ref()).collect();
                let cx = OpCtx { op, node: id.index() };
                let value = eval_op(&cx, &args, &node.shape)?;
                check_result(&cx, node, &value)?;
                Cow::Owned(value)
            }
        };
        values.insert(id, value);
        for input in input_ids {
            let left = uses.get_mut(&input).expect("every operand is counted");
            *left -= 1;
            if *left == 0 && !keep.contains(&input) {
                values.remove(&input);
            }
        }
    }
    Ok(keep
        .into_iter()
        .map(|id| (id, values.remove(&id).expect("outputs are evaluated").into_owned()))
        .collect())
}

/// The value bound to a source node, checked against the node's shape and dtype.
fn bound<'a, T>(
    node: &Node,
    name: &str,
    id: NodeId,
    sources: &'a HashMap<NodeId, Value<T>>,
) -> Result<&'a Value<T>, ExecError> {
    let value = sources.get(&id).ok_or_else(|| ExecError::Unbound {
        kind: if matches!(node.op, Op::Param(_)) { "param" } else { "input" },
        node: id.index(),
        name: name.to_string(),
    })?;
    if *value.shape() != node.shape {
        return Err(ExecError::BoundShape {
            node: id.index(),
            name: name.to_string(),
            got: value.shape().clone(),
            expected: node.shape.clone(),
        });
    }
    if matches!(value, Value::Int(_)) != (node.dtype == DType::I32) {
        return Err(ExecError::BoundKind {
            node: id.index(),
            name: name.to_string(),
            got: value.kind(),
            expected: node.dtype,
        });
    }
    Ok(value)
}

/// A constant node's value: its shape filled with `value` (truncated for i32).
fn constant<T: Float>(node: &Node, value: f64) -> Value<T> {
    if node.dtype == DType::I32 {
        Value::Int(Tensor::full(node.shape.clone(), value as i32))
    } else {
        Value::Float(Tensor::full(node.shape.clone(), T::from_f64(value)))
    }
}

/// Every computed value must have the type the graph inferred for its node: this
/// catches a kernel (or a backward op) that disagrees with its shape rule.
fn check_result<T>(cx: &OpCtx, node: &Node, value: &Value<T>) -> Result<(), ExecError> {
    let kind_ok = matches!(value, Value::Int(_)) == (node.dtype == DType::I32);
    if *value.shape() != node.shape || !kind_ok {
        return Err(cx.err(format!(
            "produced a {} value of shape {}, the graph records {} {}",
            value.kind(),
            value.shape(),
            node.dtype,
            node.shape
        )));
    }
    Ok(())
}

/// Evaluates one non-source op on its operands (slot order); `out_shape` is the
/// node's inferred shape.
pub(crate) fn eval_op<T: Float>(
    cx: &OpCtx,
    inputs: &[&Value<T>],
    out_shape: &Shape,
) -> Result<Value<T>, ExecError> {
    let float = |slot| cx.float(inputs, slot);
    let int = |slot| cx.int(inputs, slot);
    let value = match cx.op {
        Op::Input { .. } | Op::Param(_) | Op::Constant { .. } => {
            return Err(cx.err("source nodes are bound or filled by `run`, not evaluated"))
        }
        Op::Unary(u) => Value::Float(elementwise::unary(*u, float(0)?)),
        Op::Binary(b) => Value::Float(elementwise::binary(*b, float(0)?, float(1)?, out_shape)),
        Op::Affine { mul, add } => Value::Float(elementwise::affine(float(0)?, *mul, *add)),
        Op::Cast { to } => Value::Float(elementwise::cast(float(0)?, *to)),
        Op::Reduce { op, axis, .. } => Value::Float(reduce::reduce(*op, float(0)?, *axis, out_shape)),
        Op::MatMul { trans_a, trans_b } => {
            Value::Float(matmul::matmul(float(0)?, float(1)?, *trans_a, *trans_b, out_shape))
        }
        Op::Reshape { shape } => per_kind!(cx.input(inputs, 0)?, |x| movement::reshape(x, shape)),
        Op::Permute { perm } => per_kind!(cx.input(inputs, 0)?, |x| movement::permute(x, perm)),
        Op::Broadcast { shape } => per_kind!(cx.input(inputs, 0)?, |x| movement::broadcast(x, shape)),
        Op::Slice { axis, start, end } => {
            per_kind!(cx.input(inputs, 0)?, |x| movement::slice(x, *axis, *start, *end))
        }
        Op::Concat { axis } => concat(cx, inputs, *axis)?,
        Op::Gather { axis } => {
            let idx = int(1)?;
            per_kind!(cx.input(inputs, 0)?, |x| movement::gather(x, idx, *axis, out_shape)
                .map_err(|m| cx.err(m))?)
        }
        Op::ScatterAdd { axis } => {
            Value::Float(movement::scatter_add(float(0)?, int(1)?, float(2)?, *axis).map_err(|m| cx.err(m))?)
        }
        Op::ScatterRows { axis } => {
            Value::Float(movement::scatter_rows(float(0)?, int(1)?, float(2)?, *axis).map_err(|m| cx.err(m))?)
        }
        Op::TopK { k, fixed } => {
            Value::Int(connection::topk(float(0)?, *k, *fixed, out_shape).map_err(|m| cx.err(m))?)
        }
        Op::Softmax => Value::Float(reduce::softmax(float(0)?)),
        Op::RmsNorm { eps } => Value::Float(norms::rms_norm(float(0)?, cx.float_opt(inputs, 1)?, *eps)),
        Op::LayerNorm { eps } => {
            let affine = match cx.float_opt(inputs, 1)? {
                Some(gain) => Some((gain, float(2)?)),
                None => None,
            };
            Value::Float(norms::group_norm(float(0)?, 1, affine, *eps))
        }
        Op::GroupNorm { groups, eps } => {
            Value::Float(norms::group_norm(float(0)?, *groups, Some((float(1)?, float(2)?)), *eps))
        }
        Op::NormProject { eps, centered } => {
            Value::Float(connection::norm_project(float(0)?, float(1)?, *eps, *centered, out_shape))
        }
        Op::SoftmaxCrossEntropy => {
            Value::Float(loss::softmax_cross_entropy(float(0)?, int(1)?).map_err(|m| cx.err(m))?)
        }
        Op::LinearCrossEntropy { trans_b, scale, .. } => Value::Float(
            loss::linear_cross_entropy(float(0)?, float(1)?, int(2)?, *trans_b, *scale)
                .map_err(|m| cx.err(m))?,
        ),
        Op::CausalAttention { scale, rope_base } => Value::Float(
            attention::causal_attention(float(0)?, float(1)?, float(2)?, *scale, *rope_base)
                .map_err(|m| cx.err(m))?,
        ),
        Op::Sinkhorn { iters, eps } => Value::Float(connection::sinkhorn(float(0)?, *iters, *eps)),
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            let kernels = (1..inputs.len()).map(float).collect::<Result<Vec<_>, _>>()?;
            Value::Float(connection::temporal_augment(float(0)?, &kernels, *gram_schmidt, *eps_rel))
        }
        Op::MoeRoute { experts, capacity, out } => {
            Value::Int(moe::moe_route(int(0)?, *experts, *capacity, *out, out_shape).map_err(|m| cx.err(m))?)
        }
        Op::GroupedMatMul { trans_b } => Value::Float(
            moe::grouped_matmul(float(0)?, float(1)?, int(2)?, *trans_b, out_shape).map_err(|m| cx.err(m))?,
        ),
        // Backward-only ops appended to `Op` by autodiff (`backward_ops`).
        Op::CausalAttentionGrad { scale, rope_base, wrt } => Value::Float(
            backward_ops::causal_attention_grad(
                float(0)?,
                float(1)?,
                float(2)?,
                float(3)?,
                *scale,
                *rope_base,
                *wrt,
            )
            .map_err(|m| cx.err(m))?,
        ),
        Op::LinearCrossEntropyGrad { trans_b, scale, wrt, .. } => Value::Float(
            loss::linear_cross_entropy_grad(float(0)?, float(1)?, int(2)?, float(3)?, *trans_b, *scale, *wrt)
                .map_err(|m| cx.err(m))?,
        ),
        Op::SinkhornGrad { iters, eps } => {
            Value::Float(backward_ops::sinkhorn_grad(float(0)?, float(1)?, *iters, *eps))
        }
        Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt } => {
            let n = inputs.len();
            if n < 3 || *wrt >= n - 1 {
                return Err(cx.err(format!("wrt {wrt} is not a forward operand of {n} operands")));
            }
            let kernels = (1..n - 1).map(float).collect::<Result<Vec<_>, _>>()?;
            Value::Float(backward_ops::temporal_augment_grad(
                float(0)?,
                &kernels,
                float(n - 1)?,
                *gram_schmidt,
                *eps_rel,
                *wrt,
            ))
        }
        Op::GroupedMatMulGrad { trans_b } => Value::Float(
            moe::grouped_matmul_grad(float(0)?, float(1)?, int(2)?, *trans_b, out_shape)
                .map_err(|m| cx.err(m))?,
        ),
    };
    Ok(value)
}

/// Concatenation of operands that are all float or all i32.
fn concat<T: Float>(cx: &OpCtx, inputs: &[&Value<T>], axis: usize) -> Result<Value<T>, ExecError> {
    if inputs.is_empty() {
        return Err(cx.err("needs at least one operand"));
    }
    if let Some(xs) = inputs.iter().map(|v| v.as_float()).collect::<Option<Vec<_>>>() {
        Ok(Value::Float(movement::concat(&xs, axis)))
    } else if let Some(xs) = inputs.iter().map(|v| v.as_int()).collect::<Option<Vec<_>>>() {
        Ok(Value::Int(movement::concat(&xs, axis)))
    } else {
        Err(cx.err("operands mix float and i32 values"))
    }
}
