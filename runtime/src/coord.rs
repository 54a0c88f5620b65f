//! The muP coordinate check (docs/math.md §8.1, after microsoft/mup's "Coord Check"):
//! train the same model at several widths for a few steps on the same data and
//! measure how large every layer's activations are. Under muP the size of each
//! activation coordinate must not depend on the width (a flat line against width
//! on log-log axes); under the standard parametrization the hidden activations
//! and the logits grow with width once training moves the weights.
//!
//! What is measured: after initialization (step 0) and after each optimizer step,
//! the root mean square of every trunk activation `ir::lower` records
//! ([`ir::lower::Lowered::activations`]): the embedding output (`embed`), each
//! sublayer's branch output (`blocks.{i}.attn`, `blocks.{i}.ffn`), the residual
//! state after each block (`blocks.{i}.out`) and the `logits`, on one fixed batch
//! drawn from the validation split. RMS is the "typical coordinate size" the
//! check is about (it is what muP keeps Θ(1)); the reference interpreter
//! (`ir::exec`, f32) evaluates the nodes.
//!
//! How a width is made from the base spec ([`width_spec`]): `d_model` is the width;
//! the head count (and kv heads) stay and the head dimension scales with it (an
//! explicit `head_dim` is scaled by width / base d_model); the SwiGLU hidden width
//! (or the MoE expert width) scales in proportion to the base's. Everything
//! docs/math.md §8.1 calls finite stays: stream counts n, N, k, m, vocabulary,
//! sequence length, depth. Under muP the base width is the smallest width checked.
//!
//! How it trains: the spec's optimizer at its peak learning rate with no warmup
//! or decay (a warmup over a few steps would hide the growth the check looks
//! for) and no gradient clipping (a global norm clip rescales the update by a
//! width-dependent factor, which is not part of either parametrization). Each
//! width starts from the spec's seed and sees the same batches.

use crate::data::{BatchSampler, Corpus, DataError};
use crate::device::reference::ReferenceExecutor;
use crate::init::{init_params, InitError};
use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::step::{StepError, StepExecutor, UpdateSettings};
use ir::exec::{ExecError, Tensor, Value};
use ir::graph::NodeId;
use ir::spec::{ConstantSpec, FfnSpec, ModelSpec, MupSpec, Parametrization, ScheduleSpec, SwiGluSpec};
use ir::Shape;
use std::collections::HashMap;
use std::fmt::Write as _;

/// Which parametrization a check runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoordParam {
    /// The standard parametrization (`Parametrization::Standard`).
    Standard,
    /// muP (`Parametrization::MuP`) with the base spec's muP knobs, or the defaults.
    MuP,
}

impl CoordParam {
    /// `SP` or `muP`, as tables, CSV and plots name it.
    pub fn name(self) -> &'static str {
        match self {
            CoordParam::Standard => "SP",
            CoordParam::MuP => "muP",
        }
    }
}

/// Errors running a coordinate check.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("a coordinate check needs at least two different widths, got {got:?}")]
    TooFewWidths { got: Vec<usize> },
    #[error("width {width} is listed twice")]
    DuplicateWidth { width: usize },
    #[error("a coordinate check needs at least one training step")]
    NoSteps,
    #[error("width {width}: {field}: {message}")]
    InvalidWidth { width: usize, field: String, message: String },
    #[error("width {width}: cannot lower the model")]
    Lower {
        width: usize,
        #[source]
        source: ir::lower::LowerError,
    },
    #[error("width {width}: cannot initialize the parameters")]
    Init {
        width: usize,
        #[source]
        source: InitError,
    },
    #[error("width {width}: training step {step} failed")]
    Step {
        width: usize,
        step: usize,
        #[source]
        source: StepError,
    },
    #[error("width {width}: cannot evaluate the activations after step {step}")]
    Probe {
        width: usize,
        step: usize,
        #[source]
        source: ExecError,
    },
    #[error("width {width}: the graph produced no value for activation `{layer}`")]
    MissingActivation { width: usize, layer: String },
    #[error(transparent)]
    Data(#[from] DataError),
}

/// One measurement: the RMS of activation `layer` at `width` after `step` updates.
#[derive(Debug, Clone, PartialEq)]
pub struct CoordRow {
    pub width: usize,
    /// 0 = at initialization; k = after the k-th optimizer step.
    pub step: usize,
    pub layer: String,
    pub rms: f64,
}

/// The result of one coordinate check.
#[derive(Debug, Clone, PartialEq)]
pub struct CoordCheck {
    pub parametrization: CoordParam,
    /// Widths in increasing order.
    pub widths: Vec<usize>,
    /// Optimizer steps taken; rows run over steps `0..=steps`.
    pub steps: usize,
    /// Activation names in evaluation order.
    pub layers: Vec<String>,
    pub rows: Vec<CoordRow>,
}

/// The spec of `base` at `width` under `param` (see the module doc for what scales).
pub fn width_spec(
    base: &ModelSpec,
    width: usize,
    base_width: usize,
    param: CoordParam,
) -> Result<ModelSpec, CoordError> {
    let invalid =
        |field: &str, message: String| CoordError::InvalidWidth { width, field: field.into(), message };
    let d0 = base.d_model.max(1);
    let scaled = |x: usize| ((x * width) as f64 / d0 as f64).round().max(1.0) as usize;
    let mut spec = base.clone();
    spec.d_model = width;
    if let Some(h) = base.head_dim {
        if !(h * width).is_multiple_of(d0) {
            return Err(invalid(
                "head_dim",
                format!("head_dim = {h} at d_model = {d0} does not scale to a whole head dimension at width {width}"),
            ));
        }
        spec.head_dim = Some(h * width / d0);
    }
    spec.ffn = match &base.ffn {
        FfnSpec::SwiGlu(s) => {
            let hidden = s.hidden.unwrap_or_else(|| FfnSpec::default_hidden(d0));
            FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(scaled(hidden)) })
        }
        FfnSpec::Moe(m) => {
            let mut m = m.clone();
            m.hidden = scaled(m.hidden);
            FfnSpec::Moe(m)
        }
    };
    spec.parametrization = match param {
        CoordParam::Standard => Parametrization::Standard,
        CoordParam::MuP => {
            let knobs = match &base.parametrization {
                Parametrization::MuP(m) => m.clone(),
                Parametrization::Standard => MupSpec::default(),
            };
            Parametrization::MuP(MupSpec { base_width, ..knobs })
        }
    };
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    spec.train.clip = None;
    spec.train.steps = spec.train.steps.max(1);
    if let Err(errors) = spec.validate() {
        let first = errors.into_iter().next().expect("a failed validation names a field");
        return Err(invalid(&first.path, first.message));
    }
    Ok(spec)
}

/// Runs the check with the data the spec names (`train.data`).
pub fn coord_check(
    base: &ModelSpec,
    widths: &[usize],
    steps: usize,
    param: CoordParam,
) -> Result<CoordCheck, CoordError> {
    let corpus = Corpus::load(base)?;
    coord_check_on(base, widths, steps, param, &corpus, &mut |_, _| {})
}

/// Runs the check on `corpus`; `progress(width, step)` is called after each
/// measurement.
pub fn coord_check_on(
    base: &ModelSpec,
    widths: &[usize],
    steps: usize,
    param: CoordParam,
    corpus: &Corpus,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CoordCheck, CoordError> {
    let mut sorted = widths.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(CoordError::DuplicateWidth { width: w[0] });
    }
    if sorted.len() < 2 {
        return Err(CoordError::TooFewWidths { got: widths.to_vec() });
    }
    if steps == 0 {
        return Err(CoordError::NoSteps);
    }
    let base_width = sorted[0];
    // Every width is checked before any trains, so a bad list fails at once.
    let specs = sorted
        .iter()
        .map(|&w| {
            width_spec(base, w, base_width, param).map(|mut s| {
                s.train.steps = steps;
                s
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (batch, seq_len) = (base.train.batch, base.train.seq_len);
    corpus.check_window(seq_len + 1)?;
    // One fixed batch to measure on, the same for every width and step.
    let probe_tokens =
        BatchSampler::validation(base.train.seed, batch, seq_len + 1).next_batch(corpus.validation())?;
    let mut check = CoordCheck {
        parametrization: param,
        widths: sorted.clone(),
        steps,
        layers: Vec::new(),
        rows: Vec::new(),
    };
    for (spec, &width) in specs.iter().zip(&sorted) {
        let lowered =
            ir::lower::lower(spec, batch, seq_len).map_err(|source| CoordError::Lower { width, source })?;
        let probe = Probe {
            graph: lowered.graph.clone(),
            tokens: lowered.tokens,
            activations: lowered.activations.clone(),
        };
        if check.layers.is_empty() {
            check.layers = probe.activations.iter().map(|(name, _)| name.clone()).collect();
        }
        let mut params = init_params(&lowered.graph, spec.train.seed)
            .map_err(|source| CoordError::Init { width, source })?;
        let mut exec = ReferenceExecutor::from_lowered(lowered);
        let mut optimizer = Optimizer::new(spec, &params);
        let mut sampler = BatchSampler::for_run(&spec.train, batch, seq_len + 1);
        let settings = UpdateSettings { lr_mult: 1.0, clip: None };
        for step in 0..=steps {
            if step > 0 {
                let tokens = sampler.next_batch(corpus.train())?;
                exec.train_step(&mut params, &tokens, &mut optimizer, settings)
                    .map_err(|source| CoordError::Step { width, step, source })?;
            }
            for (layer, rms) in probe.measure(&params, &probe_tokens, width, step)? {
                check.rows.push(CoordRow { width, step, layer, rms });
            }
            progress(width, step);
        }
    }
    Ok(check)
}

/// The forward graph of one width and the activation nodes to read.
struct Probe {
    graph: ir::graph::Graph,
    tokens: NodeId,
    activations: Vec<(String, NodeId)>,
}

impl Probe {
    /// `(layer, RMS)` of every activation on `tokens`.
    fn measure(
        &self,
        params: &ParamSet,
        tokens: &[i32],
        width: usize,
        step: usize,
    ) -> Result<Vec<(String, f64)>, CoordError> {
        let mut sources = HashMap::with_capacity(params.len() + 1);
        for p in params.iter() {
            sources.insert(p.node, Value::Float(Tensor::new(p.shape.clone(), p.value.clone())));
        }
        let shape: Shape = self.graph.node(self.tokens).shape.clone();
        sources.insert(self.tokens, Value::Int(Tensor::new(shape, tokens.to_vec())));
        let ids: Vec<NodeId> = self.activations.iter().map(|&(_, id)| id).collect();
        let values = ir::exec::run::<f32>(&self.graph, &sources, &ids)
            .map_err(|source| CoordError::Probe { width, step, source })?;
        self.activations
            .iter()
            .map(|(layer, id)| match values.get(id) {
                Some(Value::Float(t)) => Ok((layer.clone(), rms(&t.data))),
                _ => Err(CoordError::MissingActivation { width, layer: layer.clone() }),
            })
            .collect()
    }
}

/// Root mean square, accumulated in f64.
fn rms(xs: &[f32]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    (xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / xs.len() as f64).sqrt()
}

/// Least-squares slope of `ys` against `xs`; `None` with fewer than two distinct
/// x or a non-finite value.
pub fn slope(xs: &[f64], ys: &[f64]) -> Option<f64> {
    if xs.len() != ys.len() || xs.len() < 2 || xs.iter().chain(ys).any(|v| !v.is_finite()) {
        return None;
    }
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    Some(sxy / sxx)
}

impl CoordCheck {
    /// The RMS of `layer` at `width` after `step` updates.
    pub fn rms(&self, width: usize, step: usize, layer: &str) -> Option<f64> {
        self.rows.iter().find(|r| r.width == width && r.step == step && r.layer == layer).map(|r| r.rms)
    }

    /// RMS of `layer` at each width (in [`CoordCheck::widths`] order) after `step` updates.
    pub fn series(&self, step: usize, layer: &str) -> Vec<(usize, f64)> {
        self.widths.iter().filter_map(|&w| self.rms(w, step, layer).map(|r| (w, r))).collect()
    }

    /// The growth exponent of `layer` after `step` updates: the least-squares slope
    /// of log2(RMS) against log2(width). 0 is flat; 0.5 grows as sqrt(width); 1 as width.
    pub fn slope(&self, step: usize, layer: &str) -> Option<f64> {
        let series = self.series(step, layer);
        let xs: Vec<f64> = series.iter().map(|&(w, _)| (w as f64).log2()).collect();
        let ys: Vec<f64> = series.iter().map(|&(_, r)| r.log2()).collect();
        slope(&xs, &ys)
    }

    /// `(layer, slope)` of every layer after `step` updates (NaN where there is no slope).
    pub fn slopes(&self, step: usize) -> Vec<(String, f64)> {
        self.layers.iter().map(|l| (l.clone(), self.slope(step, l).unwrap_or(f64::NAN))).collect()
    }

    /// One line: each layer's slope after the last step.
    pub fn summary(&self) -> String {
        let parts: Vec<String> =
            self.slopes(self.steps).iter().map(|(l, s)| format!("{l} {s:+.2}")).collect();
        format!(
            "{}: slope of log2(RMS) vs log2(width) after step {}: {}",
            self.parametrization.name(),
            self.steps,
            parts.join(", ")
        )
    }

    /// Per step, one row per layer with its RMS at each width and its slope.
    pub fn to_table(&self) -> String {
        let name_w = self.layers.iter().map(String::len).max().unwrap_or(5).max(5);
        let mut out = String::new();
        for step in 0..=self.steps {
            let when = if step == 0 { "at init".to_string() } else { format!("after step {step}") };
            let _ = writeln!(out, "{} activation RMS, {when}", self.parametrization.name());
            let _ = write!(out, "  {:<name_w$}", "layer");
            for w in &self.widths {
                let _ = write!(out, " {:>10}", format!("D={w}"));
            }
            let _ = writeln!(out, " {:>7}", "slope");
            for layer in &self.layers {
                let _ = write!(out, "  {layer:<name_w$}");
                for &w in &self.widths {
                    match self.rms(w, step, layer) {
                        Some(r) => {
                            let _ = write!(out, " {r:>10.4e}");
                        }
                        None => {
                            let _ = write!(out, " {:>10}", "-");
                        }
                    }
                }
                let s = self.slope(step, layer).map_or("-".to_string(), |s| format!("{s:+.2}"));
                let _ = writeln!(out, " {s:>7}");
            }
        }
        out
    }

    /// The rows as CSV with a header (`parametrization,width,step,layer,rms`).
    pub fn to_csv(&self) -> String {
        to_csv(std::slice::from_ref(self))
    }
}

/// The rows of several checks as one CSV (`parametrization,width,step,layer,rms`).
pub fn to_csv(checks: &[CoordCheck]) -> String {
    let mut out = String::from("parametrization,width,step,layer,rms\n");
    for c in checks {
        for r in &c.rows {
            let _ =
                writeln!(out, "{},{},{},{},{:e}", c.parametrization.name(), r.width, r.step, r.layer, r.rms);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_power_law_is_its_exponent() {
        let xs: Vec<f64> = [32.0f64, 64.0, 128.0].iter().map(|x| x.log2()).collect();
        let ys: Vec<f64> = [32.0f64, 64.0, 128.0].iter().map(|x| (3.0 * x.sqrt()).log2()).collect();
        assert!((slope(&xs, &ys).unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(slope(&[1.0, 1.0], &[2.0, 3.0]), None);
    }

    #[test]
    fn widths_scale_heads_ffn_and_base_width() {
        let base = ModelSpec { d_model: 64, heads: 4, ..ModelSpec::default() };
        let s = width_spec(&base, 256, 64, CoordParam::MuP).unwrap();
        assert_eq!((s.d_model, s.heads, s.head_dim()), (256, 4, 64));
        let f0 = FfnSpec::default_hidden(64);
        assert_eq!(s.ffn, FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(f0 * 4) }));
        assert!(matches!(s.parametrization, Parametrization::MuP(MupSpec { base_width: 64, .. })));
        assert_eq!(s.train.clip, None);
    }

    #[test]
    fn a_width_that_makes_an_invalid_spec_names_the_field() {
        let base = ModelSpec { d_model: 64, heads: 4, ..ModelSpec::default() };
        let err = width_spec(&base, 66, 64, CoordParam::Standard).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("width 66: d_model:"), "{text}");
    }
}
