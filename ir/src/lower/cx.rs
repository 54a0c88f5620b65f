//! The lowering context: the graph being built plus small builders that keep
//! scheme code short. Every builder infers shapes through `Graph::add`, so a
//! mistake in a scheme surfaces as a `GraphError` naming the op and both shapes.

pub use crate::graph::Build;
use crate::graph::{Graph, GraphError, Init, NodeId, Op, ParamClass, ParamInfo, Region, Role};
use crate::spec::{ModelSpec, Parametrization, Precision};
use crate::{DType, Shape};

/// Lowering state shared by the driver, the backbone and the schemes.
pub struct Cx {
    pub g: Graph,
    pub spec: ModelSpec,
    pub batch: usize,
    /// Sequence length of the part being lowered (T for the trunk, T - k in MTP module k).
    pub seq_len: usize,
    /// None while lowering the trunk, Some(k) inside MTP module k.
    pub module: Option<usize>,
    /// The V x D embedding table, when the scheme has one (for tied unembeddings).
    pub embedding_table: Option<NodeId>,
    /// Named trunk activations recorded so far (see `Lowered::activations`).
    pub activations: Vec<(String, NodeId)>,
    /// The MoE sublayers lowered so far, in evaluation order (see `Lowered::moe_layers`).
    pub(crate) moe_layers: Vec<super::MoeLayer>,
}

impl Build for Cx {
    fn graph(&self) -> &Graph {
        &self.g
    }

    fn graph_mut(&mut self) -> &mut Graph {
        &mut self.g
    }
}

impl Cx {
    pub(crate) fn new(spec: &ModelSpec, batch: usize, seq_len: usize) -> Self {
        Cx {
            g: Graph::new(),
            spec: spec.clone(),
            batch,
            seq_len,
            module: None,
            embedding_table: None,
            activations: Vec::new(),
            moe_layers: Vec::new(),
        }
    }

    pub(crate) fn finish(self) -> Graph {
        self.g
    }

    /// Records a trunk activation under `name` (see `Lowered::activations`); nodes
    /// of MTP modules are not recorded.
    pub fn note_activation(&mut self, name: String, node: NodeId) {
        if self.module.is_none() {
            self.activations.push((name, node));
        }
    }

    pub fn set_role(&mut self, role: Role) {
        self.g.set_role(role);
    }

    /// Marks the nodes added next as connection machinery of `sublayer`.
    pub fn connection(&mut self, sublayer: usize) {
        self.g.set_role(Role::new(Region::Connection).sublayer(sublayer).mtp(self.module));
    }

    /// First global sublayer index of the block being lowered: 0 for the trunk,
    /// 2L + 2(k - 1) inside MTP module k (so per-sublayer inits such as HC's home
    /// stream e_{l mod n} keep rotating, docs/math.md §2.4).
    pub fn mtp_sublayer_offset(&self) -> usize {
        match self.module {
            None => 0,
            Some(k) => 2 * self.spec.layers + 2 * (k - 1),
        }
    }

    /// Stable parameter-name prefix of a sublayer: `blocks.{i}.attn|ffn` in the trunk,
    /// `mtp.{k}.block.attn|ffn` in MTP module k.
    pub fn sublayer_prefix(&self, sublayer: usize) -> String {
        let kind = if sublayer.is_multiple_of(2) { "attn" } else { "ffn" };
        match self.module {
            None => format!("blocks.{}.{kind}", sublayer / 2),
            Some(k) => format!("mtp.{k}.block.{kind}"),
        }
    }

    /// muP width multiplier w = D / D_base (docs/math.md §8.1); 1 under the standard parametrization.
    pub fn width_mult(&self) -> f64 {
        match &self.spec.parametrization {
            Parametrization::Standard => 1.0,
            Parametrization::MuP(m) => self.spec.d_model as f64 / m.base_width as f64,
        }
    }

    /// Init std of a hidden matrix: `std` in SP, std / sqrt(w) under muP (docs/math.md §8.1).
    pub fn hidden_std(&self, std: f64) -> f64 {
        std / self.width_mult().sqrt()
    }

    pub fn shape(&self, x: NodeId) -> &[usize] {
        self.g.node(x).shape.dims()
    }

    /// A trainable f32 parameter with a stable, documented name.
    pub fn param(&mut self, name: &str, dims: &[usize], init: Init, class: ParamClass) -> NodeId {
        let info = ParamInfo { name: name.to_string(), init, class };
        self.g.add_source(Op::Param(info), Shape::new(dims), DType::F32, Some(name.to_string()))
    }

    /// An f32 tensor filled with `value`.
    pub fn constant(&mut self, value: f64, dims: &[usize]) -> NodeId {
        self.g.add_source(Op::Constant { value }, Shape::new(dims), DType::F32, None)
    }

    pub fn matmul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, GraphError> {
        self.matmul_t(a, b, false, false)
    }

    /// The value stored as residual state between sublayers: under `precision: Bf16` the
    /// state each Write (and the embedding) produces is rounded to bf16 and every consumer
    /// reads that bf16 value (docs/math.md §6.12); under F32 it is `x` itself.
    pub fn state(&mut self, x: NodeId) -> Result<NodeId, GraphError> {
        self.bf16_if_mixed(x)
    }

    /// A backbone projection `a @ w` (transposes as in [`Cx::matmul_t`]). Under
    /// `precision: Bf16` both operands are read as bf16 (the f32 master weight is rounded
    /// per step) and the product accumulates in f32 (docs/math.md §6.12). Coefficient, routing,
    /// norm and Sinkhorn math never goes through here, so it stays f32.
    pub fn project(
        &mut self,
        a: NodeId,
        w: NodeId,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<NodeId, GraphError> {
        let (a, w) = (self.bf16_if_mixed(a)?, self.bf16_if_mixed(w)?);
        self.matmul_t(a, w, trans_a, trans_b)
    }

    /// An activation that feeds several projections, rounded once (see [`Cx::project`]).
    pub fn operand(&mut self, x: NodeId) -> Result<NodeId, GraphError> {
        self.bf16_if_mixed(x)
    }

    /// `x` as bf16 when the spec asks for bf16 mixed precision; `x` unchanged otherwise or
    /// when it already is bf16, so an f32 spec's graph has no casts at all.
    fn bf16_if_mixed(&mut self, x: NodeId) -> Result<NodeId, GraphError> {
        if self.spec.precision != Precision::Bf16 || self.g.node(x).dtype == DType::Bf16 {
            return Ok(x);
        }
        self.g.add(Op::Cast { to: DType::Bf16 }, &[x])
    }

    pub fn permute(&mut self, x: NodeId, perm: &[usize]) -> Result<NodeId, GraphError> {
        self.g.add(Op::Permute { perm: perm.to_vec() }, &[x])
    }

    pub fn concat(&mut self, xs: &[NodeId], axis: usize) -> Result<NodeId, GraphError> {
        if xs.len() == 1 {
            return Ok(xs[0]);
        }
        self.g.add(Op::Concat { axis }, xs)
    }

    pub fn sum(&mut self, x: NodeId, axis: usize, keepdim: bool) -> Result<NodeId, GraphError> {
        self.g.add(Op::Reduce { op: crate::graph::ReduceOp::Sum, axis, keepdim }, &[x])
    }

    /// RMSNorm over the last axis with the spec's epsilon (docs/math.md §1.3).
    pub fn rms_norm(&mut self, x: NodeId, gain: Option<NodeId>) -> Result<NodeId, GraphError> {
        let eps = self.spec.norm_eps;
        match gain {
            Some(g) => self.g.add(Op::RmsNorm { eps }, &[x, g]),
            None => self.g.add(Op::RmsNorm { eps }, &[x]),
        }
    }
}
