//! Device-vs-reference parity (docs/architecture.md §9.4, §9.6): one model, the same
//! initial parameters and the same token batches on a compiled device (the
//! fused Plan) and on the reference executor (the unfused graph), compared.
//!
//! What is compared, all in f32. The two paths sum in different orders (fused
//! loops, GEMM blocking, cuBLAS), so they agree to f32 rounding, not bitwise;
//! the errors are measured against [`Tolerances::FP32`]:
//! - the loss of one training step (relative error);
//! - the loss through the validation path ([`StepExecutor::loss`]) against
//!   the same reference loss;
//! - the logits and every parameter gradient: the largest difference relative
//!   to the largest magnitude of the reference tensor (elementwise relative
//!   error is meaningless for entries near zero);
//! - every parameter after N optimizer steps, each path taking its own
//!   training steps from the same start (a compiled device with the update
//!   its Plan runs, `codegen::optimizer`): the largest difference in units
//!   of the learning rate, the size of one step.
//!
//! Adam divides each gradient by its running RMS (docs/math.md §8), which turns
//! rounding noise on a gradient entry that is itself at noise level (around
//! 1e-9) into a step of O(1) learning rates. The optimizers of the comparison
//! therefore run with eps = [`ADAM_EPS`] instead of the spec's (typically
//! 1e-8): that bounds the amplification by 1/eps while leaving every gradient
//! of ordinary size normalized as before.

use crate::data::{BatchSampler, Corpus, DataError};
use crate::device::reference::ReferenceExecutor;
use crate::init::{init_params, InitError};
use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::step::{StepError, StepExecutor, UpdateSettings};
use ir::spec::{ModelSpec, OptimizerSpec};
use serde_json::{json, Value};
use std::fmt;

/// Adam's eps during the optimizer steps of a comparison (see the module docs).
pub const ADAM_EPS: f64 = 1e-4;

/// Largest acceptable errors (see the module docs for how each is measured).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// Relative error of the loss.
    pub loss: f64,
    /// Largest difference relative to the largest reference magnitude, for
    /// logits and gradients.
    pub tensor: f64,
    /// Largest parameter difference after the optimizer steps, in learning rates.
    pub params_lr: f64,
}

impl Tolerances {
    /// f32 rounding level: loss 1e-5, logits and gradients 1e-4, parameters
    /// after the steps 1e-3 learning rates.
    ///
    /// What differs between the devices and the reference on the same f32 inputs:
    /// the order of summation (blocked GEMMs, tree reductions across threads), FMA
    /// contraction (NVRTC contracts `a*b + c` by default, rounding once instead of
    /// twice: at most half an ulp, 2^-24 relative, per contracted operation), the
    /// device math functions (`expf`, `tanhf`, `rsqrtf` within 2 ulp; the C dialect's
    /// own exp and tanh within 1-2 ulp) and division as reciprocal-multiply
    /// (`--prec-div=false`, within 2 ulp). Each is an f32-rounding-sized change of a
    /// single operation; through a sum of K terms such changes add up like the
    /// summation's own rounding, about sqrt(K)·2^-24 relative for K of a few
    /// thousand: around 1e-6, which is what the H200 run measured on the gradients
    /// (docs/performance.md). 1e-4 leaves two orders of magnitude for reductions
    /// over cancelling terms, while a wrong index, a missing term or a missing
    /// barrier changes a gradient by far more.
    pub const FP32: Tolerances = Tolerances { loss: 1e-5, tensor: 1e-4, params_lr: 1e-3 };

    /// bf16 mixed precision (docs/math.md §6.12): both paths round the state and the
    /// projection operands to bf16 with the same rule, but an f32-rounding difference
    /// upstream can move a value across a bf16 rounding boundary, a change of one bf16
    /// ulp (up to 2^-7 relative) in that element, which every later layer sees. Loss
    /// 1e-3, logits and gradients 1e-2 (measured on specs/mhc-bf16.ron: 8e-4 and 3e-4),
    /// parameters after the steps 0.5 learning rates (measured: 0.15; Adam turns the
    /// flipped contributions to near-zero gradient entries into O(0.1) steps, while a
    /// wrong update direction would be off by whole steps).
    pub const BF16: Tolerances = Tolerances { loss: 1e-3, tensor: 1e-2, params_lr: 0.5 };

    /// The tolerances for a spec's precision: f32 specs keep [`Tolerances::FP32`].
    pub fn for_spec(spec: &ModelSpec) -> Tolerances {
        match spec.precision {
            ir::spec::Precision::F32 => Tolerances::FP32,
            ir::spec::Precision::Bf16 => Tolerances::BF16,
        }
    }
}

/// What one [`Check`] compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantity {
    Loss,
    ValidationLoss,
    Logits,
    Grad,
    Param,
}

impl Quantity {
    /// The key under which the JSON report lists checks of this quantity.
    pub fn key(self) -> &'static str {
        match self {
            Quantity::Loss => "loss",
            Quantity::ValidationLoss => "validation_loss",
            Quantity::Logits => "logits",
            Quantity::Grad => "grads",
            Quantity::Param => "params",
        }
    }
}

/// One compared value: its error and the tolerance it is held to.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub quantity: Quantity,
    /// The parameter name for gradients and parameters, else the quantity.
    pub name: String,
    pub err: f64,
    pub tol: f64,
}

impl Check {
    /// Within tolerance (a NaN error fails).
    pub fn passed(&self) -> bool {
        self.err <= self.tol
    }
}

/// Errors that stop a comparison before its checks are complete.
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    #[error("the {device} executor takes token batches of {got:?}, the reference executor {want:?}")]
    TokenShape { device: &'static str, got: [usize; 2], want: [usize; 2] },
    #[error("{what} on the {device} device has {got} values, on the reference executor {want}")]
    Length { device: &'static str, what: String, got: usize, want: usize },
    #[error("the reference executor failed")]
    Reference(#[source] StepError),
    #[error("the {device} executor failed")]
    Device { device: &'static str, source: StepError },
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error(transparent)]
    Init(#[from] InitError),
    #[error(transparent)]
    Data(#[from] DataError),
}

/// The outcome of one comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct ParityReport {
    pub spec: String,
    pub device: &'static str,
    /// Optimizer steps compared.
    pub steps: usize,
    /// The loss of the first step on the device and on the reference executor.
    pub loss: f32,
    pub reference_loss: f32,
    /// The learning rate parameter differences are measured in.
    pub lr: f64,
    pub tolerances: Tolerances,
    /// Loss, validation loss, logits, then one gradient per parameter, then
    /// one parameter-after-steps per parameter, both in parameter order.
    pub checks: Vec<Check>,
}

impl ParityReport {
    /// Every check within tolerance.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(Check::passed)
    }

    /// The checks out of tolerance.
    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.passed())
    }

    /// The check of `quantity` with the largest error (NaN counts as largest).
    pub fn worst(&self, quantity: Quantity) -> Option<&Check> {
        self.checks.iter().filter(|c| c.quantity == quantity).max_by(|a, b| {
            let key = |c: &Check| if c.err.is_nan() { f64::INFINITY } else { c.err };
            key(a).total_cmp(&key(b))
        })
    }

    /// The report as one JSON object: the checks grouped by [`Quantity::key`]
    /// (single objects for the loss, validation loss and logits; arrays in
    /// parameter order for gradients and parameters).
    pub fn to_json(&self) -> Value {
        let entry = |c: &Check| json!({ "name": c.name, "err": c.err, "tol": c.tol, "passed": c.passed() });
        let all = |q: Quantity| self.checks.iter().filter(|c| c.quantity == q).map(entry).collect::<Vec<_>>();
        let one = |q: Quantity| self.checks.iter().find(|c| c.quantity == q).map(entry);
        json!({
            "spec": self.spec,
            "device": self.device,
            "passed": self.passed(),
            "steps": self.steps,
            "device_loss": self.loss,
            "reference_loss": self.reference_loss,
            "lr": self.lr,
            "tolerances": {
                "loss": self.tolerances.loss,
                "logits_and_grads": self.tolerances.tensor,
                "params_in_lr": self.tolerances.params_lr,
                "units": "loss: relative error; logits and grads: max |difference| / max |reference|; \
                          params: max |difference| / lr after the optimizer steps",
            },
            "loss": one(Quantity::Loss),
            "validation_loss": one(Quantity::ValidationLoss),
            "logits": one(Quantity::Logits),
            "grads": all(Quantity::Grad),
            "params": all(Quantity::Param),
        })
    }
}

impl fmt::Display for ParityReport {
    /// One line: verdict and the worst error of each quantity.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed() { "pass" } else { "FAIL" };
        write!(f, "{} on {}: {verdict}", self.spec, self.device)?;
        for q in [Quantity::Loss, Quantity::ValidationLoss, Quantity::Logits, Quantity::Grad, Quantity::Param]
        {
            if let Some(c) = self.worst(q) {
                let at = matches!(q, Quantity::Grad | Quantity::Param).then(|| format!(" ({})", c.name));
                write!(f, "  {} {:.1e}{}", q.key(), c.err, at.unwrap_or_default())?;
            }
        }
        Ok(())
    }
}

/// The largest elementwise difference (NaN if any difference is NaN).
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f64 {
    got.iter().zip(want).fold(0.0f64, |m, (&g, &w)| {
        let d = (f64::from(g) - f64::from(w)).abs();
        // `f64::max` would drop a NaN difference.
        if d.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(d)
        }
    })
}

/// The largest difference relative to the largest reference magnitude.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs())).max(1e-30);
    max_abs_diff(got, want) / scale
}

/// The learning rate one optimizer step moves a parameter by (the larger of
/// Muon's and AdamW's under Muon).
fn step_lr(spec: &ModelSpec) -> f64 {
    match &spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.lr,
        OptimizerSpec::Muon(m) => m.lr.max(m.adamw.lr),
    }
}

/// `spec` with Adam's eps raised to [`ADAM_EPS`] (see the module docs).
fn comparison_optimizer(spec: &ModelSpec) -> ModelSpec {
    let mut spec = spec.clone();
    match &mut spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.eps = ADAM_EPS,
        OptimizerSpec::Muon(m) => m.adamw.eps = ADAM_EPS,
    }
    spec
}

fn same_len(device: &'static str, what: &str, got: &[f32], want: &[f32]) -> Result<(), ParityError> {
    if got.len() == want.len() {
        Ok(())
    } else {
        Err(ParityError::Length { device, what: what.into(), got: got.len(), want: want.len() })
    }
}

/// Compares `device`, an executor built for `spec` at its `train.batch` and
/// `train.seq_len`, against the reference executor: one training step, the
/// validation loss and the logits on the first batch of the spec's training
/// data, then `steps` optimizer steps on the following batches (at the
/// spec's peak learning rate), all from the parameters the spec's seed
/// initializes.
pub fn compare(
    spec: &ModelSpec,
    device: &mut dyn StepExecutor,
    steps: usize,
    tol: Tolerances,
) -> Result<ParityReport, ParityError> {
    let (batch, seq_len) = (spec.train.batch, spec.train.seq_len);
    let lowered = ir::lower::lower(spec, batch, seq_len)?;
    let mut ref_params = init_params(&lowered.graph, spec.train.seed)?;
    let mut reference = ReferenceExecutor::from_lowered(lowered);
    let name = device.device();
    if device.token_shape() != reference.token_shape() {
        return Err(ParityError::TokenShape {
            device: name,
            got: device.token_shape(),
            want: reference.token_shape(),
        });
    }
    let corpus = Corpus::load(spec)?;
    let mut sampler = BatchSampler::for_run(&spec.train, batch, seq_len + 1);
    let on_device = |source| ParityError::Device { device: name, source };

    let tokens = sampler.next_batch(corpus.train())?;
    let (want_loss, want_grads) =
        reference.loss_and_grads(&ref_params, &tokens).map_err(ParityError::Reference)?;
    let (loss, grads) = device.loss_and_grads(&ref_params, &tokens).map_err(on_device)?;
    let val = device.loss(&ref_params, &tokens).map_err(on_device)?;
    let want_logits = reference.logits(&ref_params, &tokens).map_err(ParityError::Reference)?;
    let logits = device.logits(&ref_params, &tokens).map_err(on_device)?;
    same_len(name, "logits", &logits, &want_logits)?;
    if grads.len() != want_grads.len() {
        return Err(ParityError::Length {
            device: name,
            what: "the gradient list".into(),
            got: grads.len(),
            want: want_grads.len(),
        });
    }
    let check = |quantity, name: &str, err, tol| Check { quantity, name: name.into(), err, tol };
    let mut checks = vec![
        check(Quantity::Loss, "loss", rel_err(&[loss], &[want_loss]), tol.loss),
        check(Quantity::ValidationLoss, "validation_loss", rel_err(&[val], &[want_loss]), tol.loss),
        check(Quantity::Logits, "logits", rel_err(&logits, &want_logits), tol.tensor),
    ];
    for (p, (g, w)) in ref_params.iter().zip(grads.iter().zip(&want_grads)) {
        same_len(name, &format!("the gradient of {}", p.name), g, w)?;
        checks.push(check(Quantity::Grad, &p.name, rel_err(g, w), tol.tensor));
    }

    let opt_spec = comparison_optimizer(spec);
    let mut dev_params: ParamSet = ref_params.clone();
    let mut opt_ref = Optimizer::new(&opt_spec, &ref_params);
    let mut opt_dev = Optimizer::new(&opt_spec, &dev_params);
    // Each path takes its own training steps: a compiled device runs the
    // update in its Plan (parameters and moments on the device), so this
    // checks that update too.
    let settings = UpdateSettings { lr_mult: 1.0, clip: None };
    for _ in 0..steps {
        let tokens = sampler.next_batch(corpus.train())?;
        reference
            .train_step(&mut ref_params, &tokens, &mut opt_ref, settings)
            .map_err(ParityError::Reference)?;
        device.train_step(&mut dev_params, &tokens, &mut opt_dev, settings).map_err(on_device)?;
    }
    let lr = step_lr(spec);
    for (d, r) in dev_params.iter().zip(ref_params.iter()) {
        checks.push(check(Quantity::Param, &r.name, max_abs_diff(&d.value, &r.value) / lr, tol.params_lr));
    }
    Ok(ParityReport {
        spec: spec.name.clone(),
        device: name,
        steps,
        loss,
        reference_loss: want_loss,
        lr,
        tolerances: tol,
        checks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_relative_to_the_largest_reference_magnitude() {
        assert_eq!(max_abs_diff(&[1.0, -2.0], &[1.5, -2.0]), 0.5);
        assert_eq!(rel_err(&[1.0, -2.0], &[1.5, -4.0]), 0.5);
        assert_eq!(rel_err(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
    }

    #[test]
    fn a_nan_anywhere_fails_the_check() {
        for got in [[f32::NAN, 1.0], [1.0, f32::NAN]] {
            let err = rel_err(&got, &[1.0, 1.0]);
            assert!(err.is_nan());
            let c = Check { quantity: Quantity::Grad, name: "w".into(), err, tol: 1.0 };
            assert!(!c.passed());
        }
    }

    #[test]
    fn the_worst_check_counts_nan_as_largest() {
        let check = |name: &str, err| Check { quantity: Quantity::Grad, name: name.into(), err, tol: 1e-4 };
        let report = ParityReport {
            spec: "s".into(),
            device: "cpu",
            steps: 0,
            loss: 1.0,
            reference_loss: 1.0,
            lr: 1e-3,
            tolerances: Tolerances::FP32,
            checks: vec![check("a", 1e-6), check("b", f64::NAN), check("c", 1e-2)],
        };
        assert_eq!(report.worst(Quantity::Grad).map(|c| c.name.as_str()), Some("b"));
        let failed: Vec<_> = report.failures().map(|c| c.name.as_str()).collect();
        assert_eq!(failed, ["b", "c"]);
        assert!(!report.passed());
        assert_eq!(report.to_json()["grads"].as_array().map(Vec::len), Some(3));
    }
}
