//! The cost model (docs/architecture.md §8): parameters, FLOPs, residual-stream memory traffic
//! and activation memory of a spec, each also as overhead against the same backbone
//! with a plain residual.
//!
//! Everything is **counted from the lowered graph**: the report walks the nodes of
//! [`crate::lower::lower`]'s forward graph and sums the per-op table of [`op_cost`].
//! The closed-form formulas of docs/math.md are not evaluated to produce the figures; they
//! appear only next to them ([`PaperFigures`]) and in the tests that check the counts.
//!
//! Conventions (all per token = graph totals / (B·T) of the trunk; the check graph is
//! built at B = 1 and the spec's `train.seq_len`, so attention sees t̄ = (T + 1)/2 keys):
//! - **Parameter buckets.** `embedding`: parameters created under
//!   [`Region::Embedding`] (E, or VWN's E_wide / E_base and W_expand). `connection`:
//!   everything the scheme adds over the plain residual except the embedding width:
//!   [`Region::Connection`] parameters (generators, static matrices, gains, conv
//!   kernels) and [`Region::Collapse`] parameters (VWN's GroupNorm and W_reduce, a
//!   learned collapse head). `backbone`: the unchanged sublayers plus the head (final
//!   norm and unembedding U). `mtp`: every parameter of an MTP module (role `mtp` set),
//!   whatever its region; the shared embedding and U stay in their trunk buckets.
//! - **FLOPs.** `flops_per_token.forward` counts every op of the forward graph, trunk
//!   and MTP modules ("all ops", [`OpCost::flops`]); `train` = 3 × forward, the
//!   convention of docs/math.md §1.5 (backward ≈ 2 × forward). Connection FLOPs per
//!   sublayer use the papers' convention ([`OpCost::flops_papers`], docs/math.md §5.9,
//!   §6.9) and are the mean over the trunk's 2L sublayers of the
//!   [`Region::Connection`] nodes outside MTP modules.
//! - **Traffic.** Elements read and written per token by the trunk's
//!   [`Region::Connection`] nodes, in units of D, mean over the 2L sublayers; the plain
//!   residual gives 2 / 1 (docs/math.md §1.5). Parameters, views and `ScatterRows` move
//!   nothing ([`op_cost`]).
//! - **Activation memory.** Bytes of every non-view op output of the forward graph per
//!   token at 4 bytes per element: what an unfused reverse pass keeps if it stores
//!   every intermediate (no recompute, no fusion). MoE routed-expert outputs count
//!   their active fraction.

mod memory;
mod ops;
mod paper;

pub use memory::{
    gib, optimal_recompute_block, recompute_activations, training_memory, MemoryShare, TrainingMemory,
    BYTES_PER_ACTIVATION, TRAIN_BYTES_PER_PARAM,
};
pub use ops::{grouped_rows, op_cost, stored_elements, Holding, OpCost};
pub use paper::{paper_figures, PaperFigures};

use serde::Serialize;

use crate::graph::{Graph, Op, Region};
use crate::lower::{lower, LowerError};
use crate::spec::{ModelSpec, Precision, ResidualSpec};

/// Parameter counts by bucket (see the module doc for what each bucket holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ParamCounts {
    pub total: u64,
    /// The parameters one token uses: the total less the routed experts a token is not
    /// sent to (each routed expert weight counts top_k / experts, docs/math.md §1.6).
    /// Equals `total` without MoE.
    pub active: u64,
    pub embedding: u64,
    pub backbone: u64,
    pub connection: u64,
    pub mtp: u64,
}

/// Forward FLOPs per token by region (all ops), trunk and MTP modules together;
/// `mtp` is the part of the total spent inside MTP modules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RegionFlops {
    pub embedding: f64,
    pub connection: f64,
    pub backbone: f64,
    pub collapse: f64,
    pub head: f64,
    pub loss: f64,
    pub mtp: f64,
}

/// The cost of one trunk sublayer, per token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SublayerCost {
    /// Global sublayer index l (2i = block i's attention, 2i + 1 its FFN).
    pub index: usize,
    /// `attention` or `ffn`.
    pub kind: &'static str,
    /// Connection FLOPs, papers' convention.
    pub connection_flops: f64,
    /// Connection FLOPs, all ops.
    pub connection_flops_all_ops: f64,
    /// Connection elements read, in units of D.
    pub traffic_read: f64,
    /// Connection elements written, in units of D.
    pub traffic_write: f64,
    /// Connection parameters of this sublayer.
    pub connection_params: u64,
    /// FLOPs of the backbone sublayer F_l (all ops).
    pub backbone_flops: f64,
}

/// Per-token sums over one lowered forward graph.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraphCounts {
    /// B·T of the trunk: the divisor of every per-token figure.
    pub tokens: usize,
    pub params: ParamCounts,
    /// Forward FLOPs per token, all ops.
    pub flops: f64,
    pub flops_by_region: RegionFlops,
    /// Bytes of forward op outputs per token (4 bytes per element).
    pub activation_bytes: f64,
    /// The trunk's 2L sublayers, in order.
    pub sublayers: Vec<SublayerCost>,
}

impl GraphCounts {
    /// Counts a forward graph whose trunk runs `tokens` = B·T tokens through
    /// `sublayers` = 2L sublayers of width `d_model`.
    pub fn of(graph: &Graph, tokens: usize, sublayers: usize, d_model: usize) -> GraphCounts {
        let per_token = 1.0 / tokens as f64;
        let per_token_d = per_token / d_model as f64;
        let mut params = ParamCounts::default();
        let mut active = 0.0;
        let mut by_region = RegionFlops::default();
        let mut flops = 0.0;
        let mut activation = 0.0;
        let mut subs: Vec<SublayerCost> = (0..sublayers)
            .map(|index| SublayerCost {
                index,
                kind: if index % 2 == 0 { "attention" } else { "ffn" },
                connection_flops: 0.0,
                connection_flops_all_ops: 0.0,
                traffic_read: 0.0,
                traffic_write: 0.0,
                connection_params: 0,
                backbone_flops: 0.0,
            })
            .collect();

        for id in graph.node_ids() {
            let node = graph.node(id);
            let role = node.role;
            if role.region == Region::Backward {
                continue;
            }
            let trunk_sublayer = match role.sublayer {
                Some(l) if role.mtp.is_none() && l < sublayers => Some(l),
                _ => None,
            };
            if let Op::Param(info) = &node.op {
                // A constant table (the permutations of docs/math.md §12.2) is not learned.
                if info.class == crate::graph::ParamClass::Table {
                    continue;
                }
                let count = node.shape.numel() as u64;
                params.total += count;
                active += count as f64 * role.active_fraction;
                let bucket = match role.region {
                    _ if role.mtp.is_some() => &mut params.mtp,
                    Region::Embedding => &mut params.embedding,
                    Region::Connection | Region::Collapse => &mut params.connection,
                    _ => &mut params.backbone,
                };
                *bucket += count;
                if let (Region::Connection, Some(l)) = (role.region, trunk_sublayer) {
                    subs[l].connection_params += count;
                }
                continue;
            }
            if node.op.is_source() {
                continue;
            }
            let cost = op_cost(graph, id);
            let f = cost.flops * per_token;
            flops += f;
            if !node.op.is_view() {
                activation += 4.0 * node.shape.numel() as f64 * role.active_fraction * per_token;
            }
            let slot = match role.region {
                Region::Embedding => &mut by_region.embedding,
                Region::Connection => &mut by_region.connection,
                Region::Backbone => &mut by_region.backbone,
                Region::Collapse => &mut by_region.collapse,
                Region::Head => &mut by_region.head,
                Region::Loss | Region::Backward => &mut by_region.loss,
            };
            *slot += f;
            if role.mtp.is_some() {
                by_region.mtp += f;
            }
            if let Some(l) = trunk_sublayer {
                let sub = &mut subs[l];
                match role.region {
                    Region::Connection => {
                        sub.connection_flops += cost.flops_papers * per_token;
                        sub.connection_flops_all_ops += f;
                        sub.traffic_read += cost.read * per_token_d;
                        sub.traffic_write += cost.written * per_token_d;
                    }
                    Region::Backbone => sub.backbone_flops += f,
                    _ => {}
                }
            }
        }
        params.active = active.round() as u64;
        GraphCounts {
            tokens,
            params,
            flops,
            flops_by_region: by_region,
            activation_bytes: activation,
            sublayers: subs,
        }
    }

    /// Mean of a per-sublayer figure over the trunk's sublayers.
    fn mean(&self, f: impl Fn(&SublayerCost) -> f64) -> f64 {
        if self.sublayers.is_empty() {
            return 0.0;
        }
        self.sublayers.iter().map(f).sum::<f64>() / self.sublayers.len() as f64
    }

    /// Mean connection FLOPs per sublayer, papers' convention.
    pub fn connection_flops_per_sublayer(&self) -> f64 {
        self.mean(|s| s.connection_flops)
    }

    /// Mean connection FLOPs per sublayer, all ops.
    pub fn connection_flops_per_sublayer_all_ops(&self) -> f64 {
        self.mean(|s| s.connection_flops_all_ops)
    }

    /// Mean connection (read, write) per sublayer in units of D.
    pub fn traffic_per_sublayer(&self) -> (f64, f64) {
        (self.mean(|s| s.traffic_read), self.mean(|s| s.traffic_write))
    }

    /// Mean connection parameters per block (two sublayers); collapse parameters excluded.
    pub fn connection_params_per_block(&self) -> f64 {
        2.0 * self.mean(|s| s.connection_params as f64)
    }
}

/// Forward and training FLOPs per token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FlopsPerToken {
    /// All ops of the forward graph (trunk + MTP), rounded to an integer.
    pub forward: u64,
    /// 3 × forward (docs/math.md §1.5).
    pub train: u64,
    /// The forward count by region.
    pub by_region: RegionFlops,
}

/// Residual-stream traffic per sublayer per token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Traffic {
    /// Elements read, in units of D.
    pub read: f64,
    /// Elements written, in units of D.
    pub write: f64,
    /// read + write, in units of D.
    pub total: f64,
    /// (read + write) · D · bytes per element of the residual state (4 for f32, 2 for bf16,
    /// docs/math.md §6.12).
    pub bytes: f64,
}

/// Ratios scheme / plain-residual baseline − 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Overhead {
    /// Total parameters.
    pub params: f64,
    /// Forward FLOPs per token (all ops).
    pub flops: f64,
    /// Connection read + write per sublayer.
    pub traffic: f64,
    /// Activation bytes per token.
    pub activation: f64,
}

/// The plain-residual baseline's headline figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Baseline {
    pub params: u64,
    pub flops_forward: u64,
    pub traffic_read: f64,
    pub traffic_write: f64,
    /// Connection FLOPs per sublayer, papers' convention (0: the add is not counted).
    pub connection_flops: f64,
    /// Connection FLOPs per sublayer, all ops (the residual add: D).
    pub connection_flops_all_ops: f64,
    /// Connection parameters per block.
    pub connection_params_per_block: f64,
    pub activation_bytes_per_token: u64,
}

/// The cost report of one spec (the `widen check --json` payload, docs/architecture.md §8).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostReport {
    pub name: String,
    /// The residual scheme with its main knobs, e.g. `Ghc(m: 2, n: 3, dynamic)`.
    pub scheme: String,
    pub d_model: usize,
    pub layers: usize,
    pub vocab: usize,
    /// T of the graph the figures were counted on (batch 1).
    pub seq_len: usize,
    pub params: ParamCounts,
    /// Connection parameters per block, mean over the trunk (collapse excluded).
    pub connection_params_per_block: f64,
    pub flops_per_token: FlopsPerToken,
    /// Connection FLOPs per sublayer per token, papers' convention (docs/math.md §5.9).
    pub connection_flops_per_sublayer: f64,
    /// The same in units of D.
    pub connection_flops_per_sublayer_d: f64,
    /// Connection FLOPs per sublayer per token, all ops.
    pub connection_flops_per_sublayer_all_ops: f64,
    pub traffic_per_sublayer: Traffic,
    pub activation_bytes_per_token: u64,
    pub overhead_vs_residual: Overhead,
    pub baseline: Baseline,
    /// docs/math.md's closed forms, for comparison.
    pub paper: PaperFigures,
    /// Per trunk sublayer.
    pub sublayers: Vec<SublayerCost>,
}

/// Lowers `spec` and its plain-residual baseline at batch 1 and `train.seq_len`, and
/// counts both graphs.
pub fn cost_report(spec: &ModelSpec) -> Result<CostReport, LowerError> {
    let counts = count_spec(spec)?;
    let base = if spec.residual == ResidualSpec::Residual {
        counts.clone()
    } else {
        count_spec(&spec.with_plain_residual())?
    };
    let d = spec.d_model as f64;
    let (read, write) = counts.traffic_per_sublayer();
    let (base_read, base_write) = base.traffic_per_sublayer();
    let state_bytes = match spec.precision {
        Precision::F32 => 4.0,
        Precision::Bf16 => 2.0,
    };
    let forward = counts.flops.round() as u64;
    let ratio = |a: f64, b: f64| if b == 0.0 { 0.0 } else { a / b - 1.0 };
    let connection_flops = counts.connection_flops_per_sublayer();
    Ok(CostReport {
        name: spec.name.clone(),
        scheme: scheme_label(&spec.residual),
        d_model: spec.d_model,
        layers: spec.layers,
        vocab: spec.model_vocab(),
        seq_len: spec.train.seq_len,
        params: counts.params,
        connection_params_per_block: counts.connection_params_per_block(),
        flops_per_token: FlopsPerToken { forward, train: 3 * forward, by_region: counts.flops_by_region },
        connection_flops_per_sublayer: connection_flops,
        connection_flops_per_sublayer_d: connection_flops / d,
        connection_flops_per_sublayer_all_ops: counts.connection_flops_per_sublayer_all_ops(),
        traffic_per_sublayer: Traffic {
            read,
            write,
            total: read + write,
            bytes: (read + write) * d * state_bytes,
        },
        activation_bytes_per_token: counts.activation_bytes.round() as u64,
        overhead_vs_residual: Overhead {
            params: ratio(counts.params.total as f64, base.params.total as f64),
            flops: ratio(counts.flops, base.flops),
            traffic: ratio(read + write, base_read + base_write),
            activation: ratio(counts.activation_bytes, base.activation_bytes),
        },
        baseline: Baseline {
            params: base.params.total,
            flops_forward: base.flops.round() as u64,
            traffic_read: base_read,
            traffic_write: base_write,
            connection_flops: base.connection_flops_per_sublayer(),
            connection_flops_all_ops: base.connection_flops_per_sublayer_all_ops(),
            connection_params_per_block: base.connection_params_per_block(),
            activation_bytes_per_token: base.activation_bytes.round() as u64,
        },
        paper: paper_figures(spec),
        sublayers: counts.sublayers,
    })
}

/// Lowers `spec` at batch 1 and `train.seq_len` and counts the graph.
pub fn count_spec(spec: &ModelSpec) -> Result<GraphCounts, LowerError> {
    let t = spec.train.seq_len;
    let lowered = lower(spec, 1, t)?;
    Ok(GraphCounts::of(&lowered.graph, t, spec.sublayers(), spec.d_model))
}

/// The scheme keyword with its main knobs, in RON-like form.
pub fn scheme_label(residual: &ResidualSpec) -> String {
    let mode = |dynamic: bool| if dynamic { "dynamic" } else { "static" };
    match residual {
        ResidualSpec::Residual => "Residual".into(),
        ResidualSpec::Hc(h) => format!("Hc(n: {}, {})", h.n, mode(h.dynamic)),
        ResidualSpec::Fc(f) => format!("Fc(m: {}, {})", f.m, mode(f.dynamic)),
        ResidualSpec::Mhc(m) => format!("Mhc(n: {}, sinkhorn_iters: {})", m.n, m.sinkhorn_iters),
        ResidualSpec::Ghc(g) => format!("Ghc(m: {}, n: {}, {})", g.m, g.n, mode(g.dynamic)),
        ResidualSpec::Xhc(x) => format!(
            "Xhc(n: {}, k: {}, fixed: {}, conv_kernels: {:?}, flash: {:?})",
            x.n, x.k, x.fixed, x.conv_kernels, x.flash
        ),
        ResidualSpec::Connection(c) => {
            let generator = match c.generator {
                crate::spec::Generator::None => "static",
                crate::spec::Generator::PerSlot(_) => "per-slot",
                crate::spec::Generator::Flat(_) => "flat",
            };
            let history = match &c.history {
                None => String::new(),
                Some(h) => {
                    let weights = match h.weights {
                        crate::spec::DepthWeights::Attention => "attention".to_string(),
                        crate::spec::DepthWeights::Static(init) => format!("static {init:?}"),
                    };
                    format!(
                        ", history of {:?} every {} sublayers, {weights}, dilation {}, period {}",
                        h.entries, h.block, h.dilation, h.period
                    )
                }
            };
            match &c.history {
                // A history of outputs has no fixed state to describe.
                Some(h) if h.entries == crate::spec::Entries::Outputs => {
                    format!("Connection({})", history.trim_start_matches(", "))
                }
                _ => format!(
                    "Connection(streams: {}, segments: {}, {generator}{history})",
                    c.streams, c.segments
                ),
            }
        }
    }
}
