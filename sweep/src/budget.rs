//! Steps per point from the sweep's budget.
//!
//! A fair comparison fixes what every point may spend: the same number of training
//! tokens, the same training FLOPs, the same number of steps, or the same seconds of
//! steps on the sweep's device (a time budget, whose steps the runner fixes from a
//! measured [`Calibration`], docs/sweeps.md "Budgets"). Tokens per step are
//! `batch · seq_len`; training FLOPs per token come from the cost model
//! ([`ir::cost::cost_report`]: `flops_per_token.train`, 3 × forward, counted from the
//! lowered graph). Steps are rounded to the nearest whole step, so the tokens (or
//! FLOPs) a point actually trains are within half a step of the budget; at least one
//! step is always trained. The plan reports what is actually trained, which is what
//! results and fits must use.
//!
//! Every step count, given or planned, is at most the spec's own limit on
//! `train.steps` ([`max_steps`], from [`ir::spec::limits`]), so a budget can never
//! plan a run the validator would refuse, and the error says which budget did it.

use ir::cost::cost_report;
use ir::spec::limits::integer_limit;
use ir::spec::ModelSpec;
use serde::{Deserialize, Serialize};

/// What every point of a sweep may spend.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Budget {
    /// Training tokens per point: equal data.
    Tokens(u64),
    /// Training FLOPs per point (3 × forward, the cost model's convention): equal compute.
    Flops(f64),
    /// Optimizer steps per point.
    Steps(u64),
    /// Seconds of training steps per point on the sweep's device: equal time. Each
    /// point's steps are fixed up front from a short measured calibration
    /// ([`Calibration`], [`plan_time`]) and recorded, so runs stay deterministic.
    Time(f64),
}

/// Steps a [`Budget::Time`] calibration times (after one untimed first step, which
/// includes one-off setup and compilation).
pub const CALIBRATION_STEPS: usize = 3;

/// How a point's steps under a time budget were chosen: its measured time per step
/// on the sweep's device, and the steps that fill the budget.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Mean seconds per training step over the timed steps.
    pub seconds_per_step: f64,
    /// How many steps were timed.
    pub steps_timed: usize,
    /// floor(budget / seconds_per_step), at least 1, at most the spec's limit.
    pub steps: usize,
}

/// The most steps a point may train: the spec's limit on `train.steps`.
pub fn max_steps() -> u64 {
    integer_limit("train.steps").map_or(u64::MAX, |l| l.max)
}

impl Budget {
    /// A budget must train something: a positive amount, for FLOPs a finite one, and
    /// for steps at most [`max_steps`].
    pub fn check(&self) -> Result<(), String> {
        match *self {
            Budget::Tokens(0) => Err("Tokens(0) trains nothing; give a token count >= 1".into()),
            Budget::Steps(0) => Err("Steps(0) trains nothing; give a step count >= 1".into()),
            Budget::Steps(n) if n > max_steps() => Err(format!(
                "Steps({n}) is above the limit of {} steps (the spec's limit on train.steps)",
                max_steps()
            )),
            Budget::Flops(f) if !(f.is_finite() && f > 0.0) => {
                Err(format!("Flops({f}) must be a finite FLOP count > 0"))
            }
            Budget::Time(t) if !(t.is_finite() && t > 0.0) => {
                Err(format!("Time({t}) must be a finite number of seconds > 0"))
            }
            Budget::Tokens(_) | Budget::Steps(_) | Budget::Flops(_) | Budget::Time(_) => Ok(()),
        }
    }
}

/// What one point trains under a budget.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BudgetPlan {
    /// Optimizer steps (`train.steps` of the point's runs).
    pub steps: usize,
    /// batch · seq_len.
    pub tokens_per_step: u64,
    /// Tokens actually trained: steps · tokens_per_step.
    pub tokens: u64,
    /// Training FLOPs per token (cost model, 3 × forward).
    pub train_flops_per_token: u64,
    /// Training FLOPs actually spent: tokens · train_flops_per_token.
    pub flops: f64,
    /// Under a time budget, how the steps were chosen; `None` before calibration
    /// (and under every other budget).
    #[serde(default)]
    pub calibration: Option<Calibration>,
}

/// Errors planning a point's budget.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// The cost model could not lower the spec.
    #[error("the cost model cannot count this spec: {0}")]
    Cost(String),
    /// `train.batch · train.seq_len` is zero, so no step trains a token.
    #[error("train.batch · train.seq_len is 0; both must be >= 1")]
    NoTokensPerStep,
    /// The cost model counted no FLOPs, so a FLOP budget gives no step count.
    #[error("the cost model counts 0 training FLOPs per token, so a FLOP budget fixes no step count")]
    NoFlops,
    /// The budget itself is not usable (see [`Budget::check`]).
    #[error("{0}")]
    Budget(String),
    /// The budget gives this point more steps than a spec may train.
    #[error(
        "{budget:?} is {steps} steps at {tokens_per_step} tokens per step, above the limit of {max} steps \
         (the spec's limit on train.steps); use a smaller budget"
    )]
    TooManySteps { budget: Budget, steps: u64, tokens_per_step: u64, max: u64 },
}

/// Plans `spec`'s steps under `budget`, counting the spec's cost with the cost model.
/// `spec` should be valid: the cost model lowers it.
pub fn plan(budget: &Budget, spec: &ModelSpec) -> Result<BudgetPlan, BudgetError> {
    let report = cost_report(spec).map_err(|e| BudgetError::Cost(e.to_string()))?;
    plan_with(budget, spec.train.batch, spec.train.seq_len, report.flops_per_token.train)
}

/// [`plan`] with the cost already known: `train_flops_per_token` for a batch of `batch`
/// sequences of `seq_len` tokens.
pub fn plan_with(
    budget: &Budget,
    batch: usize,
    seq_len: usize,
    train_flops_per_token: u64,
) -> Result<BudgetPlan, BudgetError> {
    budget.check().map_err(BudgetError::Budget)?;
    let tokens_per_step = (batch as u64).saturating_mul(seq_len as u64);
    if tokens_per_step == 0 {
        return Err(BudgetError::NoTokensPerStep);
    }
    let steps: u64 = match *budget {
        Budget::Steps(n) => n,
        // Nearest whole step, in integers so large budgets round exactly.
        Budget::Tokens(n) => (n / tokens_per_step) + u64::from(2 * (n % tokens_per_step) >= tokens_per_step),
        // Not calibrated yet: the most steps a spec may train, so validation sees
        // any warmup fit; the runner replaces it ([`plan_time`]) before training.
        Budget::Time(_) => max_steps(),
        Budget::Flops(f) => {
            if train_flops_per_token == 0 {
                return Err(BudgetError::NoFlops);
            }
            (f / (train_flops_per_token as f64 * tokens_per_step as f64)).round() as u64
        }
    }
    .max(1);
    // A FLOP budget over a cheap point can ask for any number of steps (the cast
    // above saturates); none past the spec's limit is planned.
    if steps > max_steps() {
        return Err(BudgetError::TooManySteps { budget: *budget, steps, tokens_per_step, max: max_steps() });
    }
    let tokens = steps.saturating_mul(tokens_per_step);
    Ok(BudgetPlan {
        steps: usize::try_from(steps).unwrap_or(usize::MAX),
        tokens_per_step,
        tokens,
        train_flops_per_token,
        flops: tokens as f64 * train_flops_per_token as f64,
        calibration: None,
    })
}

/// A time budget's plan from a point's measured seconds per step: floor(seconds /
/// seconds_per_step) steps, at least 1 and at most the spec's limit.
pub fn plan_time(
    seconds: f64,
    seconds_per_step: f64,
    steps_timed: usize,
    tokens_per_step: u64,
    train_flops_per_token: u64,
) -> BudgetPlan {
    let raw = seconds / seconds_per_step;
    let steps = if raw.is_finite() { (raw.floor() as u64).clamp(1, max_steps()) } else { max_steps() };
    let steps = usize::try_from(steps).unwrap_or(usize::MAX);
    let tokens = (steps as u64).saturating_mul(tokens_per_step);
    BudgetPlan {
        steps,
        tokens_per_step,
        tokens,
        train_flops_per_token,
        flops: tokens as f64 * train_flops_per_token as f64,
        calibration: Some(Calibration { seconds_per_step, steps_timed, steps }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::spec::{GhcSpec, ResidualSpec};

    fn tiny(residual: ResidualSpec) -> ModelSpec {
        let mut s = ModelSpec { d_model: 32, residual, ..ModelSpec::default() };
        s.train.batch = 4;
        s.train.seq_len = 16;
        s
    }

    #[test]
    fn equal_flops_within_one_step_for_every_point() {
        let specs = [
            tiny(ResidualSpec::Residual),
            tiny(ResidualSpec::Ghc(GhcSpec { m: 2, n: 4, ..GhcSpec::default() })),
            tiny(ResidualSpec::Ghc(GhcSpec { m: 2, n: 16, ..GhcSpec::default() })),
        ];
        let budget = 3e11;
        let mut fpts = Vec::new();
        for spec in &specs {
            let p = plan(&Budget::Flops(budget), spec).unwrap();
            let fpt = cost_report(spec).unwrap().flops_per_token.train;
            assert_eq!(p.train_flops_per_token, fpt);
            assert!(p.steps > 1, "the budget is large enough not to clamp");
            let step_flops = p.tokens_per_step as f64 * fpt as f64;
            assert!(
                (p.tokens as f64 * fpt as f64 - budget).abs() <= step_flops,
                "tokens {} x FLOPs/token {fpt} vs budget {budget}: more than one step ({step_flops}) apart",
                p.tokens
            );
            assert_eq!(p.flops, p.tokens as f64 * fpt as f64);
            fpts.push(fpt);
        }
        assert!(fpts[0] < fpts[1] && fpts[1] < fpts[2], "wider streams cost more per token: {fpts:?}");
    }

    #[test]
    fn tokens_round_to_the_nearest_step_and_steps_are_exact() {
        // 64 tokens per step.
        let p = |b| plan_with(&b, 4, 16, 1000).unwrap();
        assert_eq!(p(Budget::Tokens(6400)).steps, 100);
        assert_eq!(p(Budget::Tokens(6431)).steps, 100);
        assert_eq!(p(Budget::Tokens(6432)).steps, 101);
        assert_eq!(p(Budget::Tokens(10)).steps, 1, "at least one step");
        let s = p(Budget::Steps(7));
        assert_eq!((s.steps, s.tokens, s.flops), (7, 448, 448_000.0));
        assert_eq!(p(Budget::Flops(64_000.0 * 3.4)).steps, 3);
    }

    #[test]
    fn time_budgets_floor_seconds_over_the_measured_step_time() {
        let p = plan_time(10.0, 0.3, 3, 64, 1000);
        assert_eq!((p.steps, p.tokens, p.flops), (33, 33 * 64, (33 * 64 * 1000) as f64));
        assert_eq!(p.calibration, Some(Calibration { seconds_per_step: 0.3, steps_timed: 3, steps: 33 }));
        assert_eq!(plan_time(1.0, 5.0, 3, 64, 1000).steps, 1, "at least one step");
        assert_eq!(plan_time(1e30, 1e-9, 3, 64, 1000).steps as u64, max_steps(), "within the limit");
        assert!(
            matches!(plan_with(&Budget::Time(0.0), 1, 16, 10), Err(BudgetError::Budget(m)) if m.contains("Time(0)"))
        );
        assert!(matches!(plan_with(&Budget::Time(f64::INFINITY), 1, 16, 10), Err(BudgetError::Budget(_))));
    }

    #[test]
    fn unusable_budgets_and_shapes_are_errors() {
        assert_eq!(plan_with(&Budget::Steps(1), 0, 16, 10), Err(BudgetError::NoTokensPerStep));
        assert_eq!(plan_with(&Budget::Flops(1e9), 1, 16, 0), Err(BudgetError::NoFlops));
        assert!(matches!(plan_with(&Budget::Flops(f64::NAN), 1, 16, 10), Err(BudgetError::Budget(_))));
        assert!(matches!(plan_with(&Budget::Tokens(0), 1, 16, 10), Err(BudgetError::Budget(_))));
    }
}
