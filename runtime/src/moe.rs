//! MoE load balancing and load metrics in the training loop (docs/math.md §1.6, "Load
//! balancing").
//!
//! After every training step the executor hands back each MoE sublayer's expert loads
//! (the graph outputs [`ir::lower::expert_load_output`], `StepExecutor::step_statistics`)
//! and, with `balance: AuxLoss`, the auxiliary loss. [`ExpertLoads::after_step`] turns
//! them into the step's metrics and, with `balance: BiasUpdate`, moves every router
//! bias: b_e += rate · sign(mean load − load_e), from the loads of that step, outside the
//! gradient and the optimizer. The bias is a parameter, so checkpoints hold it and a
//! resumed run continues with the bias the uninterrupted run had.
//!
//! In a data-parallel run each rank counts its shard; the counts are averaged across the
//! ranks before anything uses them, so every rank moves its biases alike (the parameter
//! fingerprints before a checkpoint stay equal) and the metrics count the global batch.

use crate::dist::Group;
use crate::params::ParamSet;
use crate::step::StepExecutor;
use ir::lower::{expert_load_output, router_bias_param, MOE_AUX_LOSS_OUTPUT};
use ir::spec::{FfnSpec, ModelSpec, MoeBalance, MoeSpec};

/// Errors setting up the balancing of a run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MoeError {
    #[error(
        "ffn.balance: BiasUpdate moves the router bias from every step's expert loads, which the \
         {device} executor does not read back; train on the reference or cpu device, or choose \
         another ffn.balance"
    )]
    NoLoads { device: &'static str },
    #[error("the model has no router bias `{name}`, which ffn.balance: BiasUpdate moves")]
    NoBias { name: String },
}

/// One MoE sublayer: its parameter prefix, the index of its loads among the executor's
/// statistics, and the index of its router bias in the parameter set (BiasUpdate).
#[derive(Debug, Clone)]
struct Layer {
    prefix: String,
    load: usize,
    bias: Option<usize>,
}

/// What the training loop needs to balance an MoE model's experts and report its loads.
#[derive(Debug, Clone)]
pub struct ExpertLoads {
    moe: MoeSpec,
    layers: Vec<Layer>,
    /// Index of the auxiliary loss among the statistics.
    aux: Option<usize>,
}

/// The loads of one step, reduced across ranks: per MoE sublayer, the assignments each
/// expert received in the global batch, the assignments dropped over capacity, and the
/// auxiliary loss.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLoads {
    pub layers: Vec<(String, Vec<f64>)>,
    /// Assignments dropped over the capacity, per sublayer (zero without a capacity).
    pub dropped: Vec<f64>,
    pub aux_loss: Option<f64>,
}

impl ExpertLoads {
    /// The bookkeeping of `spec`'s MoE sublayers as `exec` reports them; `None` for a model
    /// without an MoE FFN, or whose executor reads no statistics back when nothing but the
    /// metrics needs them.
    pub fn new(
        spec: &ModelSpec,
        exec: &dyn StepExecutor,
        params: &ParamSet,
    ) -> Result<Option<Self>, MoeError> {
        let FfnSpec::Moe(moe) = &spec.ffn else { return Ok(None) };
        let names = exec.statistics();
        let suffix = expert_load_output("");
        let mut layers = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let Some(prefix) = name.strip_suffix(&suffix) else { continue };
            let bias = match moe.balance {
                MoeBalance::BiasUpdate(_) => {
                    let bias = router_bias_param(prefix);
                    Some(params.iter().position(|p| p.name == bias).ok_or(MoeError::NoBias { name: bias })?)
                }
                MoeBalance::None | MoeBalance::AuxLoss(_) => None,
            };
            layers.push(Layer { prefix: prefix.to_string(), load: i, bias });
        }
        if layers.is_empty() {
            return match moe.balance {
                MoeBalance::BiasUpdate(_) => Err(MoeError::NoLoads { device: exec.device() }),
                MoeBalance::None | MoeBalance::AuxLoss(_) => Ok(None),
            };
        }
        let aux = names.iter().position(|n| n == MOE_AUX_LOSS_OUTPUT);
        Ok(Some(ExpertLoads { moe: moe.clone(), layers, aux }))
    }

    /// The loads of the step `exec` just took, averaged across `group` and scaled to the
    /// global batch; `None` when the executor has no values yet.
    pub fn read(&self, exec: &dyn StepExecutor, group: Option<&Group>) -> Option<StepLoads> {
        let values = exec.step_statistics();
        let mut flat: Vec<f32> = Vec::new();
        let mut dropped = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let load = values.get(layer.load)?;
            flat.extend_from_slice(load);
            // First come, first served: each expert keeps C of its assignments (§1.6), on
            // this rank's tokens (a layer's tokens are its assignments over top_k).
            let tokens = (load.iter().map(|&l| f64::from(l)).sum::<f64>() / self.moe.top_k as f64).round();
            let over = self
                .moe
                .capacity(tokens as usize)
                .map_or(0.0, |c| load.iter().map(|&l| (f64::from(l) - c as f64).max(0.0)).sum::<f64>());
            dropped.push(over);
        }
        flat.extend(dropped.iter().map(|&d| d as f32));
        let aux = match self.aux {
            Some(i) => Some(*values.get(i)?.first()?),
            None => None,
        };
        let (world, aux) = match group {
            Some(g) => {
                let mean_aux = g.average(aux.unwrap_or(0.0), &mut flat);
                (g.size() as f64, aux.map(|_| mean_aux))
            }
            None => (1.0, aux),
        };
        let experts = self.moe.experts;
        let global = |x: f32| (f64::from(x) * world).round();
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                (l.prefix.clone(), flat[i * experts..(i + 1) * experts].iter().map(|&x| global(x)).collect())
            })
            .collect();
        let dropped = flat[self.layers.len() * experts..].iter().map(|&x| global(x)).collect();
        Some(StepLoads { layers, dropped, aux_loss: aux.map(f64::from) })
    }

    /// With `balance: BiasUpdate`, moves every router bias by rate · sign(mean load −
    /// load_e) (docs/math.md §1.6), from `loads`.
    pub fn update_biases(&self, loads: &StepLoads, params: &mut ParamSet) {
        let MoeBalance::BiasUpdate(b) = &self.moe.balance else { return };
        let rate = b.rate as f32;
        for (layer, (_, load)) in self.layers.iter().zip(&loads.layers) {
            let Some(index) = layer.bias else { continue };
            let mean = load.iter().sum::<f64>() / load.len().max(1) as f64;
            let bias = &mut params[index].value;
            for (b, &l) in bias.iter_mut().zip(load) {
                let direction = match mean.partial_cmp(&l) {
                    Some(std::cmp::Ordering::Greater) => 1.0,
                    Some(std::cmp::Ordering::Less) => -1.0,
                    _ => 0.0,
                };
                *b += rate * direction;
            }
        }
    }

    /// The metrics of `loads` (see `crate::train`'s module doc for their names).
    pub fn metrics(&self, loads: &StepLoads) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::json;
        let all: Vec<f64> = loads.layers.iter().flat_map(|(_, l)| l.iter().copied()).collect();
        let min = all.iter().copied().fold(f64::INFINITY, f64::min);
        let max = all.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mean = all.iter().sum::<f64>() / all.len().max(1) as f64;
        let mut imbalance: f64 = 0.0;
        let mut by_layer = serde_json::Map::new();
        for (prefix, load) in &loads.layers {
            let layer_max = load.iter().copied().fold(0.0, f64::max);
            let layer_mean = load.iter().sum::<f64>() / load.len().max(1) as f64;
            if layer_mean > 0.0 {
                imbalance = imbalance.max(layer_max / layer_mean);
            }
            by_layer.insert(prefix.clone(), json!(layer_max as u64));
        }
        let mut out = serde_json::Map::new();
        out.insert("moe_load_min".into(), json!(min as u64));
        out.insert("moe_load_max".into(), json!(max as u64));
        out.insert("moe_load_mean".into(), json!(mean));
        out.insert("moe_imbalance".into(), json!(imbalance));
        out.insert("moe_load_max_by_layer".into(), serde_json::Value::Object(by_layer));
        if self.moe.capacity_factor.is_some() {
            out.insert("moe_dropped".into(), json!(loads.dropped.iter().sum::<f64>() as u64));
        }
        if let Some(aux) = loads.aux_loss {
            out.insert("moe_aux_loss".into(), json!(aux));
        }
        out
    }
}
