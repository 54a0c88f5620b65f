//! Lowering of a validated [`ModelSpec`] into the forward training graph.
//!
//! Every scheme lowers through the unified Read / Carry / Write form of
//! docs/math.md §0.3: the persistent state is a `[B, T, s, d_s]` tensor (one row per
//! stream, stream axis next to the feature axis, docs/math.md §0.2) and a `Scheme`
//! decides how it is created from the embedding, how each sublayer reads it and
//! writes back, and how it is collapsed before the final norm. The backbone
//! sublayers (the `backbone` module) are shared by every scheme unchanged.
//!
//! Graph interface (used by the runtime): one `Input` node `tokens`, i32
//! `[B, T + 1]` (a window: inputs are `tokens[:, :T]`, targets `tokens[:, 1:]`;
//! MTP module k reads `tokens[:, k:T]` and predicts `tokens[:, k+1:]`,
//! docs/math.md §7.1), outputs `loss` (scalar), `logits` (`[B, T, V]`), `loss_main`
//! and `loss_mtp{k}`. A model with an MoE FFN also has, per MoE sublayer, the output
//! [`expert_load_output`] (its expert loads) and, with `balance: AuxLoss`,
//! [`MOE_AUX_LOSS_OUTPUT`] (docs/math.md §1.6).
//!
//! Mixed precision (`precision: Bf16`, docs/math.md §6.12): the state the embedding and every
//! sublayer produce passes through [`Cx::state`] here, in the shared skeleton (and in a
//! scheme that overrides `Scheme::block` between its sublayers), and every backbone
//! projection goes through [`Cx::project`]; both add a bf16 `Cast` only in bf16 mode, so
//! an f32 spec lowers to exactly the graph it always did.

mod backbone;
mod cx;
mod schemes;

pub use cx::Cx;

use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass, Region, Role};
use crate::spec::{ConcatOrder, FieldError, ModelSpec, Parametrization};
use crate::{DType, Shape};

/// The lowered forward training graph and its interface nodes.
#[derive(Debug, Clone)]
pub struct Lowered {
    pub graph: crate::graph::Graph,
    /// i32 `[B, T + 1]` token window.
    pub tokens: NodeId,
    /// The scalar the backward pass differentiates: the graph output `loss`, L_main +
    /// lambda/K * sum_k L^k (docs/math.md §7.1), plus [`MOE_AUX_LOSS_OUTPUT`] when the
    /// model has the MoE auxiliary balance loss (§1.6); otherwise the `loss` output itself.
    /// The reported loss stays the `loss` output, so designs compare on the same number.
    pub loss: NodeId,
    /// Main-head logits `[B, T, V]`.
    pub logits: NodeId,
    /// The trunk's activations by name, in evaluation order: `embed` (the state
    /// stream creation produces), `blocks.{i}.attn` and `blocks.{i}.ffn` (each
    /// backbone sublayer's output F_l before it is written back), `blocks.{i}.out`
    /// (the state after block i) and `logits`. The coordinate check
    /// (`runtime::coord`) evaluates these nodes to measure activation size per layer.
    pub activations: Vec<(String, NodeId)>,
    /// The parameter prefixes of the MoE sublayers (`blocks.0.ffn`, `mtp.1.block.ffn`), in
    /// evaluation order: the trunk's blocks, then the MTP modules'. Sublayer `p` has the
    /// graph output [`expert_load_output`]`(p)` and, with `balance: BiasUpdate`, the
    /// parameter [`router_bias_param`]`(p)` (docs/math.md §1.6).
    pub moe_layers: Vec<String>,
    /// The graph outputs a trainer reads back after every training step, besides the loss:
    /// every MoE sublayer's expert loads, then [`MOE_AUX_LOSS_OUTPUT`] when the model has
    /// the auxiliary balance loss. Empty without an MoE FFN.
    pub statistics: Vec<String>,
    /// The spec's `train.recompute`: what the training graph's backward recomputes
    /// (`crate::passes::recompute_blocks`, docs/math.md §4.5).
    pub recompute: crate::spec::Recompute,
}

/// The graph output of the expert loads of MoE sublayer `prefix`: f32 `[E]`, how many of
/// the step's N·k token-to-expert assignments chose each routed expert (before any capacity
/// drop; docs/math.md §1.6).
pub fn expert_load_output(prefix: &str) -> String {
    format!("{prefix}.expert_load")
}

/// The graph output of the MoE auxiliary balance loss (`balance: AuxLoss`), the sum of
/// every MoE sublayer's α·E·Σ_e f_e·P_e (docs/math.md §1.6). It is part of the
/// differentiated objective [`Lowered::loss`], not of the `loss` output.
pub const MOE_AUX_LOSS_OUTPUT: &str = "moe_aux_loss";

/// The parameter name of the router bias of MoE sublayer `prefix` (`balance: BiasUpdate`,
/// docs/math.md §1.6).
pub fn router_bias_param(prefix: &str) -> String {
    format!("{prefix}.router_bias")
}

/// One lowered MoE sublayer: its parameter prefix, its expert-load node (`[E]`) and, with
/// the auxiliary balance loss, that loss's node (a scalar).
#[derive(Debug, Clone)]
pub(crate) struct MoeLayer {
    pub prefix: String,
    pub load: NodeId,
    pub aux_loss: Option<NodeId>,
}

/// Errors while lowering.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    #[error("invalid spec: {}", .0.iter().map(|e| format!("{}: {}", e.path, e.message)).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
    #[error("lowering produced a malformed graph: {0}")]
    Graph(#[from] GraphError),
}

/// Whether a sublayer is attention or FFN (docs/math.md §0.1: sublayer 2i is block i's attention,
/// 2i + 1 its FFN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SublayerKind {
    Attention,
    Ffn,
}

/// A backbone sublayer F_l: `[B, T, D] -> [B, T, D]`, including its own pre-norm.
pub type Branch<'b> = dyn FnMut(&mut Cx, NodeId) -> Result<NodeId, GraphError> + 'b;

/// A residual-stream scheme in the unified form of docs/math.md §0.3.
pub(crate) trait Scheme {
    /// Per-token state layout `(s, d_s)`: s slots of width d_s.
    fn layout(&self) -> (usize, usize);

    /// Stream creation (docs/math.md §0.3): token ids `[B, T']` to the state `[B, T', s, d_s]`.
    /// Also used for the next-token embedding of MTP modules (docs/math.md §7.2), so the
    /// embedding parameters must be created once (reuse them on later calls).
    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError>;

    /// One sublayer: Read, the branch F_l, Carry and Write.
    /// `sublayer` is the global sublayer index (MTP modules continue after 2L).
    fn sublayer(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        sublayer: usize,
        kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError>;

    /// One block (attention then FFN). Schemes that share decisions across a block
    /// (xHC-Flash, docs/math.md §6.10) override this.
    fn block(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        first_sublayer: usize,
        attn: &mut Branch,
        ffn: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        let mid = self.sublayer(cx, state, first_sublayer, SublayerKind::Attention, attn)?;
        let mid = cx.state(mid)?;
        self.sublayer(cx, mid, first_sublayer + 1, SublayerKind::Ffn, ffn)
    }

    /// Collapse the state to `[B, T', D]` before the final norm. `module` is None for
    /// the trunk and Some(k) for MTP module k (which owns its collapse norms, §5.7).
    fn collapse(&mut self, cx: &mut Cx, state: NodeId, module: Option<usize>) -> Result<NodeId, GraphError>;

    /// The state an MTP module continues from (docs/math.md §7.2): the trunk's (or the
    /// previous module's) final `state`, or, for a design that carries no state (a depth
    /// history of outputs, §12.5), its `collapsed` `[B, T', D]` as a one-slot state.
    fn continued_state(
        &mut self,
        _cx: &mut Cx,
        state: NodeId,
        _collapsed: NodeId,
    ) -> Result<NodeId, GraphError> {
        Ok(state)
    }

    /// Multiplier on the init std of the output projections W_o, W_2 (HC's sqrt(n) rule,
    /// docs/math.md §2.4).
    fn out_proj_std_mult(&self) -> f64 {
        1.0
    }
}

/// Lowers a spec into its forward training graph for a `batch x seq_len` step.
pub fn lower(spec: &ModelSpec, batch: usize, seq_len: usize) -> Result<Lowered, LowerError> {
    spec.validate_graph().map_err(LowerError::Invalid)?;
    // docs/math.md §7.1: module k trains on the first T - k positions of this graph's T.
    if spec.mtp.depth >= seq_len {
        return Err(LowerError::Invalid(vec![FieldError {
            path: "mtp.depth".into(),
            message: format!(
                "mtp.depth = {} must be < the graph's sequence length {seq_len} (MTP module k trains on \
                 the first T - k positions)",
                spec.mtp.depth
            ),
        }]));
    }
    if spec.tie_embeddings {
        if let Some(c) = spec.residual.connection() {
            if c.create == crate::spec::Create::Wide(crate::spec::EmbedMode::Full) && c.streams != c.segments
            {
                return Err(LowerError::Invalid(vec![FieldError {
                    path: "tie_embeddings".into(),
                    message: "tie_embeddings = true needs a V x D embedding; with residual Ghc (or create: Wide(Full)) use \
                              embed_mode: Expand (create: Wide(Expand); E_base is then tied), or set tie_embeddings: false"
                        .into(),
                }]));
            }
        }
    }
    let mut scheme = schemes::build(spec);
    let mut cx = Cx::new(spec, batch, seq_len);
    let t = seq_len;

    cx.set_role(Role::new(Region::Embedding));
    let tokens = cx.g.add_source(
        Op::Input { name: "tokens".into() },
        Shape::new([batch, t + 1]),
        DType::I32,
        Some("tokens".into()),
    );
    let ids = cx.slice(tokens, 1, 0, t)?;
    let targets = cx.slice(tokens, 1, 1, t + 1)?;

    let mut state = scheme.embed(&mut cx, ids)?;
    state = cx.state(state)?;
    cx.activations.push(("embed".into(), state));
    for block in 0..spec.layers {
        state = lower_block(&mut cx, scheme.as_mut(), state, block)?;
        cx.activations.push((format!("blocks.{block}.out"), state));
    }
    let trunk_state = state;

    let head = HeadParams::new(&mut cx)?;
    let collapsed = {
        cx.set_role(Role::new(Region::Collapse));
        scheme.collapse(&mut cx, trunk_state, None)?
    };
    let logits = head.logits(&mut cx, collapsed, "final_norm")?;
    cx.set_role(Role::new(Region::Loss));
    let loss_main = cx.g.add(Op::SoftmaxCrossEntropy, &[logits, targets])?;
    cx.g.set_output("loss_main", loss_main);
    cx.g.set_output("logits", logits);
    cx.activations.push(("logits".into(), logits));

    let mut loss = loss_main;
    let depth = spec.mtp.depth;
    let mut prev =
        if depth > 0 { scheme.continued_state(&mut cx, trunk_state, collapsed)? } else { trunk_state };
    let mut mtp_sum = None;
    for k in 1..=depth {
        cx.module = Some(k);
        let module_loss = lower_mtp_module(&mut cx, scheme.as_mut(), &head, tokens, prev, k)?;
        prev = module_loss.1;
        cx.set_role(Role::new(Region::Loss).mtp(Some(k)));
        cx.g.set_output(&format!("loss_mtp{k}"), module_loss.0);
        mtp_sum = Some(match mtp_sum {
            None => module_loss.0,
            Some(acc) => cx.add(acc, module_loss.0)?,
        });
    }
    cx.module = None;
    if let Some(sum) = mtp_sum {
        cx.set_role(Role::new(Region::Loss));
        let weighted = cx.affine(sum, spec.mtp.lambda / depth as f64, 0.0)?;
        loss = cx.add(loss_main, weighted)?;
    }
    cx.g.set_output("loss", loss);
    let (objective, moe_layers, statistics) = moe_outputs(&mut cx, loss)?;
    let activations = std::mem::take(&mut cx.activations);
    let graph = cx.finish();
    let recompute = spec.train.recompute;
    Ok(Lowered { graph, tokens, loss: objective, logits, activations, moe_layers, statistics, recompute })
}

/// Records the MoE sublayers' expert loads and auxiliary losses as graph outputs
/// (docs/math.md §1.6). Returns the differentiated objective (`loss` plus the summed
/// auxiliary losses, if any), the MoE prefixes and the statistics' output names.
fn moe_outputs(cx: &mut Cx, loss: NodeId) -> Result<(NodeId, Vec<String>, Vec<String>), GraphError> {
    let layers = std::mem::take(&mut cx.moe_layers);
    let mut statistics = Vec::new();
    for layer in &layers {
        let name = expert_load_output(&layer.prefix);
        cx.g.set_output(&name, layer.load);
        statistics.push(name);
    }
    cx.set_role(Role::new(Region::Loss));
    let mut aux: Option<NodeId> = None;
    for term in layers.iter().filter_map(|l| l.aux_loss) {
        aux = Some(match aux {
            None => term,
            Some(acc) => cx.add(acc, term)?,
        });
    }
    let objective = match aux {
        Some(aux) => {
            cx.g.set_output(MOE_AUX_LOSS_OUTPUT, aux);
            statistics.push(MOE_AUX_LOSS_OUTPUT.to_string());
            cx.add(loss, aux)?
        }
        None => loss,
    };
    Ok((objective, layers.into_iter().map(|l| l.prefix).collect(), statistics))
}

/// One transformer block through the scheme: sublayers `first` and `first + 1`
/// (MTP modules continue the numbering after 2L, see [`Cx::sublayer_prefix`]).
fn lower_block(
    cx: &mut Cx,
    scheme: &mut dyn Scheme,
    state: NodeId,
    block: usize,
) -> Result<NodeId, GraphError> {
    let first = 2 * block + cx.mtp_sublayer_offset();
    let out_mult = scheme.out_proj_std_mult();
    let mut attn = |cx: &mut Cx, u: NodeId| {
        let saved = cx.g.role();
        cx.set_role(Role::new(Region::Backbone).sublayer(first).mtp(cx.module));
        let prefix = cx.sublayer_prefix(first);
        let y = backbone::attention(cx, u, &prefix, out_mult)?;
        cx.note_activation(prefix, y);
        cx.set_role(saved);
        Ok(y)
    };
    let mut ffn = |cx: &mut Cx, u: NodeId| {
        let saved = cx.g.role();
        cx.set_role(Role::new(Region::Backbone).sublayer(first + 1).mtp(cx.module));
        let prefix = cx.sublayer_prefix(first + 1);
        let y = backbone::ffn(cx, u, &prefix, out_mult)?;
        cx.note_activation(prefix, y);
        cx.set_role(saved);
        Ok(y)
    };
    cx.connection(first);
    let out = scheme.block(cx, state, first, &mut attn, &mut ffn)?;
    cx.state(out)
}

/// The final norm and unembedding, shared by the trunk and the MTP modules (docs/math.md §7.1).
struct HeadParams {
    unembed: NodeId,
    /// U is E^T: multiply with a transposed embedding table.
    tied: bool,
    /// muP readout forward multiplier output_mult / w (docs/math.md §8.1), or 1.
    readout_mult: f64,
}

impl HeadParams {
    fn new(cx: &mut Cx) -> Result<Self, GraphError> {
        cx.set_role(Role::new(Region::Head));
        let spec = cx.spec.clone();
        let (d, v) = (spec.d_model, spec.model_vocab());
        let readout_mult = match &spec.parametrization {
            Parametrization::Standard => 1.0,
            Parametrization::MuP(m) => m.output_mult / cx.width_mult(),
        };
        if spec.tie_embeddings {
            let table = cx.embedding_table.expect("the scheme created a V x D embedding table");
            return Ok(HeadParams { unembed: table, tied: true, readout_mult });
        }
        let init = match &spec.parametrization {
            Parametrization::MuP(m) if m.readout_zero_init => Init::Zeros,
            _ => Init::Normal { std: spec.init_std },
        };
        let unembed = cx.param("unembed", &[d, v], init, ParamClass::Readout);
        Ok(HeadParams { unembed, tied: false, readout_mult })
    }

    /// RMSNorm (own gain `norm_name`) then U: `[B, T', D] -> [B, T', V]`.
    fn logits(&self, cx: &mut Cx, h: NodeId, norm_name: &str) -> Result<NodeId, GraphError> {
        cx.set_role(Role::new(Region::Head).mtp(cx.module));
        let d = cx.spec.d_model;
        let gain = cx.param(norm_name, &[d], Init::Ones, ParamClass::Gain);
        let normed = cx.rms_norm(h, Some(gain))?;
        let logits = cx.project(normed, self.unembed, false, self.tied)?;
        if self.readout_mult != 1.0 {
            cx.affine(logits, self.readout_mult, 0.0)
        } else {
            Ok(logits)
        }
    }
}

/// MTP module k on the expanded state (docs/math.md §7.2): per-slot fusion of the previous
/// hidden state with the next-token embedding, one block of the trunk's scheme, the
/// scheme's collapse, an own RMSNorm and the shared head. Returns (L^k, module state).
fn lower_mtp_module(
    cx: &mut Cx,
    scheme: &mut dyn Scheme,
    head: &HeadParams,
    tokens: NodeId,
    prev: NodeId,
    k: usize,
) -> Result<(NodeId, NodeId), GraphError> {
    let t = cx.seq_len;
    let len = t - k;
    let (s, ds) = scheme.layout();
    cx.set_role(Role::new(Region::Embedding).mtp(Some(k)));
    let ids = cx.slice(tokens, 1, k, t)?;
    let targets = cx.slice(tokens, 1, k + 1, t + 1)?;
    let emb = scheme.embed(cx, ids)?;
    let emb = cx.state(emb)?;
    let hidden = cx.slice(prev, 1, 0, len)?;

    // x'_j = W_mix^T [RMSNorm_h(h_j); RMSNorm_e(e_j)] with one W_mix shared by all slots.
    // Norm gains are per slot and channel, size s*d_s (docs/math.md §5.7 DECISION (a)).
    cx.set_role(Role::new(Region::Connection).mtp(Some(k)));
    let prefix = format!("mtp.{k}");
    let h_gain = cx.param(&format!("{prefix}.hidden_norm"), &[s, ds], Init::Ones, ParamClass::Gain);
    let e_gain = cx.param(&format!("{prefix}.emb_norm"), &[s, ds], Init::Ones, ParamClass::Gain);
    let h_norm = cx.rms_norm(hidden, None)?;
    let h_norm = cx.mul(h_norm, h_gain)?;
    let e_norm = cx.rms_norm(emb, None)?;
    let e_norm = cx.mul(e_norm, e_gain)?;
    let parts = match cx.spec.mtp.concat_order {
        ConcatOrder::HiddenFirst => [h_norm, e_norm],
        ConcatOrder::EmbFirst => [e_norm, h_norm],
    };
    let fused_in = cx.concat(&parts, 3)?;
    // W_mix init [I; I] / 2: the average of hidden and embedding (docs/math.md §5.7 DECISION (c)).
    let mut mix_init = vec![0.0; 2 * ds * ds];
    for i in 0..ds {
        mix_init[i * ds + i] = 0.5;
        mix_init[(ds + i) * ds + i] = 0.5;
    }
    let w_mix = cx.param(&format!("{prefix}.mix"), &[2 * ds, ds], Init::Values(mix_init), ParamClass::Hidden);
    let fused = cx.project(fused_in, w_mix, false, false)?;
    let fused = cx.state(fused)?;

    let saved_len = cx.seq_len;
    cx.seq_len = len;
    let state = lower_block(cx, scheme, fused, 0)?;
    cx.set_role(Role::new(Region::Collapse).mtp(Some(k)));
    let collapsed = scheme.collapse(cx, state, Some(k))?;
    let state = scheme.continued_state(cx, state, collapsed)?;
    let logits = head.logits(cx, collapsed, &format!("{prefix}.final_norm"))?;
    cx.seq_len = saved_len;
    cx.set_role(Role::new(Region::Loss).mtp(Some(k)));
    // Mean over the T - k valid positions (docs/math.md §7.1 DECISION: per-valid normalization).
    let loss = cx.g.add(Op::SoftmaxCrossEntropy, &[logits, targets])?;
    Ok((loss, state))
}
