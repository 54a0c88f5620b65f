//! Learning-rate schedules (docs/architecture.md §7): a multiplier of the peak LR per step.
//!
//! Steps are 0-based here (`step` = number of optimizer steps already taken).
//! Warmup is linear, reaching the peak at the end of step `warmup - 1`, so the
//! first step never uses LR 0. Decays end exactly at their final ratio on the
//! last step `total - 1`.

use ir::spec::ScheduleSpec;

/// LR multiplier in [0, 1] for 0-based `step` of a `total`-step run.
pub fn lr_multiplier(schedule: &ScheduleSpec, step: usize, total: usize) -> f64 {
    let warm = |warmup: usize| if step < warmup { (step + 1) as f64 / warmup as f64 } else { 1.0 };
    match schedule {
        ScheduleSpec::Constant(c) => warm(c.warmup),
        ScheduleSpec::Cosine(c) => {
            if step < c.warmup {
                return warm(c.warmup);
            }
            let span = total.saturating_sub(1).saturating_sub(c.warmup).max(1);
            let progress = ((step - c.warmup) as f64 / span as f64).min(1.0);
            c.min_ratio + (1.0 - c.min_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
        ScheduleSpec::Wsd(w) => {
            let decay_steps = ((w.decay_fraction * total as f64).ceil() as usize).clamp(1, total.max(1));
            let decay_start = total.saturating_sub(decay_steps);
            let decay = if step >= decay_start {
                let q = ((step - decay_start + 1) as f64 / decay_steps as f64).min(1.0);
                1.0 - (1.0 - w.final_ratio) * q
            } else {
                1.0
            };
            warm(w.warmup).min(decay)
        }
    }
}
