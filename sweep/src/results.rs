//! Per-point results: the runs of a point aggregated over seeds, and the files
//! `results.csv` and `results.json` that hold them.
//!
//! One row per point. The cost columns come from the cost model (what the point
//! is), the loss and speed columns from its runs (what it did): train and validation
//! loss as mean and sample standard deviation over the seeds that finished, bits per
//! byte, time per step, throughput, wall time, and the overhead over the point's
//! plain-residual twin when the sweep trains one.
//!
//! Conventions:
//! - Losses are in nats. **Bits per byte** = validation nats / ln 2; it is a per-byte
//!   figure only because the vocabulary is the 256 byte values, so it is reported
//!   only for `vocab = 256` and left empty otherwise.
//! - A std needs two finished seeds; with fewer it is empty (CSV) or `null` (JSON).
//! - A point is `failed` if any of its runs failed (or ended with a non-finite loss);
//!   the reason lists each failed seed, and the means cover the seeds that finished.
//! - Overheads are ratios to the twin minus one: `overhead_ms_per_step` measured,
//!   `overhead_train_flops` from the cost model; the twin's own are 0.
//! - `wall_s` sums the point's runs; `tokens_per_s` = tokens per step / mean step time.
//! - Significance (crate::stats): `val_loss_seeds` lists each finished seed's validation
//!   loss (`seed:loss;...`), `val_loss_ci95` is the half-width of the 95% interval of
//!   their mean; `delta_*` compare the point with `compared_to` (its plain-residual
//!   twin, a point the user names, or else the first point): the mean difference in
//!   validation loss (point minus reference, negative is better), its 95% interval,
//!   the two-sided p-value and the test (`paired` by seed, or `welch`).
//! - CSV columns: one per axis (its path, in the sweep's order; empty where a point
//!   does not set it, as for a baseline twin), then [`COLUMNS`] in that order.
//!   Files are written to a temporary name and renamed, so a reader never sees half a file.

use std::path::Path;

use ir::cost::CostReport;
use serde::{Deserialize, Serialize};

use crate::budget::Calibration;
use crate::folder::{DataRecord, Provenance};
use crate::point::Point;
use crate::stats::{self, Difference};

/// The CSV columns after the axis columns, in order.
pub const COLUMNS: [&str; 40] = [
    "point",
    "baseline",
    "status",
    "reason",
    "seeds",
    "seeds_finished",
    "params_total",
    "params_non_embedding",
    "params_active",
    "flops_per_token_forward",
    "flops_per_token_train",
    "connection_bytes_per_sublayer",
    "tokens_trained",
    "train_loss_mean",
    "train_loss_std",
    "val_loss_mean",
    "val_loss_std",
    "val_bits_per_byte",
    "ms_per_step_mean",
    "ms_per_step_std",
    "tokens_per_s",
    "wall_s",
    "overhead_ms_per_step",
    "overhead_train_flops",
    "val_loss_seeds",
    "val_loss_ci95",
    "compared_to",
    "delta_val_loss",
    "delta_ci95_lo",
    "delta_ci95_hi",
    "delta_p_value",
    "delta_test",
    "widen_version",
    "git_commit",
    "device",
    "host",
    "threads",
    "data_sha256",
    "steps",
    "calibrated_s_per_step",
];

/// What one finished run measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    /// Final training loss (nats).
    pub train_loss: f64,
    /// Final validation loss (nats per token).
    pub val_loss: f64,
    /// Final validation bits per byte, when the run knew the bytes behind its tokens
    /// (absent from older outcomes).
    #[serde(default)]
    pub val_bpb: Option<f64>,
    /// Mean milliseconds per optimizer step.
    pub ms_per_step: f64,
    /// Tokens trained.
    pub tokens: u64,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
}

/// How one run ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RunOutcome {
    Finished(RunMetrics),
    /// Diverged, killed, invalid, ...: the reason as the runner saw it.
    Failed(String),
}

/// Whether every run of a point finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", content = "reason", rename_all = "lowercase")]
pub enum Status {
    Ok,
    Failed(String),
}

/// Mean and sample standard deviation over seeds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Stat {
    /// `None` when no seed finished.
    pub mean: Option<f64>,
    /// `None` with fewer than two finished seeds.
    pub std: Option<f64>,
}

impl Stat {
    /// Mean and sample (n − 1) standard deviation.
    pub fn of(xs: &[f64]) -> Stat {
        if xs.is_empty() {
            return Stat::default();
        }
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let std = (xs.len() >= 2)
            .then(|| (xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0)).sqrt());
        Stat { mean: Some(mean), std }
    }
}

/// One axis value of a point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AxisValue {
    pub path: String,
    /// RON text, as in the sweep.
    pub value: String,
}

/// One row of the results: a point, its cost and what its runs measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    pub point: String,
    pub values: Vec<AxisValue>,
    /// The plain-residual point compared against, if the sweep has baselines.
    pub baseline: Option<String>,
    /// `"status": "ok"`, or `"status": "failed", "reason": "..."`.
    #[serde(flatten)]
    pub status: Status,
    /// Every seed of the point.
    pub seeds: Vec<u64>,
    pub seeds_finished: usize,
    pub params_total: u64,
    /// Total minus the embedding bucket.
    pub params_non_embedding: u64,
    /// The parameters one token uses (routed experts count top_k / experts; equals the
    /// total without MoE).
    pub params_active: u64,
    pub flops_per_token_forward: u64,
    /// 3 × forward (cost model convention).
    pub flops_per_token_train: u64,
    /// Residual-stream bytes read and written per sublayer per token.
    pub connection_bytes_per_sublayer: f64,
    /// Tokens each run trains (the budget plan).
    pub tokens_trained: u64,
    pub train_loss: Stat,
    pub val_loss: Stat,
    /// Mean validation loss / ln 2, for a byte vocabulary only.
    pub val_bits_per_byte: Option<f64>,
    pub ms_per_step: Stat,
    pub tokens_per_s: Option<f64>,
    /// Sum over the point's runs.
    pub wall_s: f64,
    pub overhead_ms_per_step: Option<f64>,
    pub overhead_train_flops: Option<f64>,
    /// Each finished seed's validation loss, in seed order.
    #[serde(default)]
    pub val_loss_seeds: Vec<SeedLoss>,
    /// Half-width of the 95% confidence interval of the mean validation loss.
    #[serde(default)]
    pub val_loss_ci95: Option<f64>,
    /// The point the difference below is measured against.
    #[serde(default)]
    pub compared_to: Option<String>,
    /// Validation loss minus `compared_to`'s, with its interval and p-value.
    #[serde(default)]
    pub delta_val_loss: Option<Difference>,
    /// What trained each run that has an outcome recording it, in seed order
    /// (docs/sweeps.md, "Provenance").
    #[serde(default)]
    pub provenance: Vec<SeedProvenance>,
    /// The point's data by content, as `plan.json` records it.
    #[serde(default)]
    pub data: Option<DataRecord>,
    /// Optimizer steps each run trains (the budget plan).
    #[serde(default)]
    pub steps: usize,
    /// Under a time budget, the measured time per step that fixed the steps.
    #[serde(default)]
    pub calibration: Option<Calibration>,
}

/// One run's provenance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedProvenance {
    pub seed: u64,
    #[serde(flatten)]
    pub provenance: Provenance,
}

impl PointResult {
    /// The distinct values of one provenance field over the point's runs, `;`-joined
    /// in seed order (one value when every run agrees, as they should).
    pub fn provenance_values(&self, field: impl Fn(&Provenance) -> String) -> String {
        let mut out: Vec<String> = Vec::new();
        for p in &self.provenance {
            let v = field(&p.provenance);
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out.join(";")
    }
}

/// One seed's final validation loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeedLoss {
    pub seed: u64,
    pub val_loss: f64,
}

impl PointResult {
    /// Aggregates a point's runs, `(seed, outcome)`, with its cost report.
    pub fn aggregate(point: &Point, cost: &CostReport, runs: &[(u64, RunOutcome)]) -> PointResult {
        let mut done: Vec<RunMetrics> = Vec::new();
        let mut failed: Vec<String> = Vec::new();
        for (seed, outcome) in runs {
            match outcome {
                RunOutcome::Finished(m) if [m.train_loss, m.val_loss].iter().all(|x| x.is_finite()) => {
                    done.push(*m)
                }
                RunOutcome::Finished(m) => failed.push(format!(
                    "seed {seed}: non-finite loss (train {}, val {})",
                    m.train_loss, m.val_loss
                )),
                RunOutcome::Failed(reason) => failed.push(format!("seed {seed}: {reason}")),
            }
        }
        for seed in point.runs.iter().map(|r| r.seed).filter(|s| !runs.iter().any(|(rs, _)| rs == s)) {
            failed.push(format!("seed {seed}: no result"));
        }
        let mut finished_seeds: Vec<SeedLoss> = runs
            .iter()
            .filter_map(|(seed, o)| match o {
                RunOutcome::Finished(m) if m.train_loss.is_finite() && m.val_loss.is_finite() => {
                    Some(SeedLoss { seed: *seed, val_loss: m.val_loss })
                }
                _ => None,
            })
            .collect();
        finished_seeds.sort_by_key(|s| s.seed);
        let col = |f: fn(&RunMetrics) -> f64| done.iter().map(f).collect::<Vec<f64>>();
        let val_loss = Stat::of(&col(|m| m.val_loss));
        let ms_per_step = Stat::of(&col(|m| m.ms_per_step));
        PointResult {
            point: point.name.clone(),
            values: point
                .values
                .iter()
                .map(|(p, v)| AxisValue { path: p.clone(), value: v.clone() })
                .collect(),
            baseline: point.baseline.clone(),
            status: if failed.is_empty() { Status::Ok } else { Status::Failed(failed.join("; ")) },
            seeds: point.runs.iter().map(|r| r.seed).collect(),
            seeds_finished: done.len(),
            params_total: cost.params.total,
            params_non_embedding: cost.params.total.saturating_sub(cost.params.embedding),
            params_active: cost.params.active,
            flops_per_token_forward: cost.flops_per_token.forward,
            flops_per_token_train: cost.flops_per_token.train,
            connection_bytes_per_sublayer: cost.traffic_per_sublayer.bytes,
            tokens_trained: point.budget.tokens,
            train_loss: Stat::of(&col(|m| m.train_loss)),
            val_loss,
            // The runs' own bits per byte (the tokenizer's bytes per token); for runs
            // recorded before that, byte-level data's loss in bits.
            val_bits_per_byte: match Stat::of(&col(|m| m.val_bpb.unwrap_or(f64::NAN)))
                .mean
                .filter(|b| b.is_finite())
            {
                Some(bpb) => Some(bpb),
                None if point.spec.vocab == 256
                    && !matches!(point.spec.train.data, ir::spec::DataSpec::Tokens(_)) =>
                {
                    val_loss.mean.map(|l| l / std::f64::consts::LN_2)
                }
                None => None,
            },
            ms_per_step,
            tokens_per_s: ms_per_step
                .mean
                .filter(|&ms| ms > 0.0)
                .map(|ms| point.budget.tokens_per_step as f64 / (ms / 1000.0)),
            wall_s: col(|m| m.wall_s).iter().sum(),
            overhead_ms_per_step: None,
            overhead_train_flops: None,
            val_loss_ci95: stats::mean_ci95(&col(|m| m.val_loss)),
            val_loss_seeds: finished_seeds,
            provenance: Vec::new(),
            data: None,
            steps: point.budget.steps,
            calibration: point.budget.calibration,
            compared_to: None,
            delta_val_loss: None,
        }
    }
}

/// Compares each point's validation loss with a reference point's
/// (crate::stats::compare, paired by seed where the seeds match): `against` when
/// given, else the point's plain-residual twin, else the first point. A point is not
/// compared with itself, nor when either side has fewer than two finished seeds.
pub fn fill_significance(results: &mut [PointResult], against: Option<&str>) {
    let seeds: Vec<(String, Vec<(u64, f64)>)> = results
        .iter()
        .map(|r| (r.point.clone(), r.val_loss_seeds.iter().map(|s| (s.seed, s.val_loss)).collect()))
        .collect();
    let first = results.first().map(|r| r.point.clone());
    for r in results.iter_mut() {
        (r.compared_to, r.delta_val_loss) = (None, None);
        let reference = against.map(str::to_string).or_else(|| r.baseline.clone()).or_else(|| first.clone());
        let Some(reference) = reference.filter(|name| *name != r.point) else { continue };
        let Some((_, theirs)) = seeds.iter().find(|(n, _)| *n == reference) else { continue };
        let ours: Vec<(u64, f64)> = r.val_loss_seeds.iter().map(|s| (s.seed, s.val_loss)).collect();
        r.delta_val_loss = stats::compare(&ours, theirs);
        r.compared_to = Some(reference);
    }
}

/// Fills each point's overheads against its baseline twin (by name).
pub fn fill_overheads(results: &mut [PointResult]) {
    let ratio = |a: f64, b: f64| (b > 0.0 && a.is_finite() && b.is_finite()).then(|| a / b - 1.0);
    let bases: Vec<(String, Option<f64>, u64)> =
        results.iter().map(|r| (r.point.clone(), r.ms_per_step.mean, r.flops_per_token_train)).collect();
    for r in results.iter_mut() {
        let Some((_, base_ms, base_flops)) =
            r.baseline.as_ref().and_then(|b| bases.iter().find(|(n, ..)| n == b))
        else {
            continue;
        };
        r.overhead_ms_per_step = r.ms_per_step.mean.zip(*base_ms).and_then(|(a, b)| ratio(a, b));
        r.overhead_train_flops = ratio(r.flops_per_token_train as f64, *base_flops as f64);
    }
}

/// Errors writing or reading the results files.
#[derive(Debug, thiserror::Error)]
pub enum ResultsError {
    #[error("cannot write {path}")]
    Write { path: String, source: std::io::Error },
    #[error("cannot read {path}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: not a results file")]
    Json { path: String, source: serde_json::Error },
    #[error("cannot write results.csv")]
    Csv(#[from] csv::Error),
}

/// `results.json`: the axis paths and every point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultsFile {
    pub axes: Vec<String>,
    pub points: Vec<PointResult>,
}

fn cell<T: ToString>(x: Option<T>) -> String {
    x.map(|v| v.to_string()).unwrap_or_default()
}

/// The CSV text: header, then one row per point.
pub fn to_csv(axes: &[String], results: &[PointResult]) -> Result<String, ResultsError> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(axes.iter().map(String::as_str).chain(COLUMNS))?;
    for r in results {
        let mut row: Vec<String> = axes
            .iter()
            .map(|a| r.values.iter().find(|v| v.path == *a).map(|v| v.value.clone()).unwrap_or_default())
            .collect();
        let (status, reason) = match &r.status {
            Status::Ok => ("ok", String::new()),
            Status::Failed(why) => ("failed", why.clone()),
        };
        row.extend([
            r.point.clone(),
            r.baseline.clone().unwrap_or_default(),
            status.to_string(),
            reason,
            r.seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(";"),
            r.seeds_finished.to_string(),
            r.params_total.to_string(),
            r.params_non_embedding.to_string(),
            r.params_active.to_string(),
            r.flops_per_token_forward.to_string(),
            r.flops_per_token_train.to_string(),
            r.connection_bytes_per_sublayer.to_string(),
            r.tokens_trained.to_string(),
            cell(r.train_loss.mean),
            cell(r.train_loss.std),
            cell(r.val_loss.mean),
            cell(r.val_loss.std),
            cell(r.val_bits_per_byte),
            cell(r.ms_per_step.mean),
            cell(r.ms_per_step.std),
            cell(r.tokens_per_s),
            r.wall_s.to_string(),
            cell(r.overhead_ms_per_step),
            cell(r.overhead_train_flops),
            r.val_loss_seeds
                .iter()
                .map(|s| format!("{}:{}", s.seed, s.val_loss))
                .collect::<Vec<_>>()
                .join(";"),
            cell(r.val_loss_ci95),
            r.compared_to.clone().unwrap_or_default(),
            cell(r.delta_val_loss.map(|d| d.mean)),
            cell(r.delta_val_loss.map(|d| d.ci95_lo)),
            cell(r.delta_val_loss.map(|d| d.ci95_hi)),
            cell(r.delta_val_loss.map(|d| d.p_value)),
            r.delta_val_loss.map(|d| d.test.name().to_string()).unwrap_or_default(),
            r.provenance_values(|p| p.widen_version.clone()),
            r.provenance_values(|p| p.git_commit.clone()),
            r.provenance_values(|p| p.device.clone()),
            r.provenance_values(|p| p.host.clone()),
            r.provenance_values(|p| p.threads.to_string()),
            r.data.as_ref().map(|d| d.sha256.clone()).unwrap_or_default(),
            r.steps.to_string(),
            cell(r.calibration.map(|c| c.seconds_per_step)),
        ]);
        w.write_record(&row)?;
    }
    let bytes = w.into_inner().map_err(|e| ResultsError::Csv(e.into_error().into()))?;
    Ok(String::from_utf8(bytes).expect("CSV of UTF-8 strings is UTF-8"))
}

/// Writes `text` to `path` whole ([`crate::folder::write_atomic`]: a temporary of
/// this process and call, renamed into place).
fn write_atomic(path: &Path, text: &str) -> Result<(), ResultsError> {
    crate::folder::write_atomic(path, text.as_bytes()).map_err(|e| match e {
        crate::folder::FolderError::Write { path, source } => {
            ResultsError::Write { path: path.display().to_string(), source }
        }
        other => ResultsError::Write {
            path: path.display().to_string(),
            source: std::io::Error::other(other.to_string()),
        },
    })
}

/// Writes `results.csv` at `path`.
pub fn write_csv(path: &Path, axes: &[String], results: &[PointResult]) -> Result<(), ResultsError> {
    write_atomic(path, &to_csv(axes, results)?)
}

/// Writes `results.json` at `path`.
pub fn write_json(path: &Path, axes: &[String], results: &[PointResult]) -> Result<(), ResultsError> {
    let file = ResultsFile { axes: axes.to_vec(), points: results.to_vec() };
    let text = serde_json::to_string_pretty(&file)
        .map_err(|source| ResultsError::Json { path: path.display().to_string(), source })?;
    write_atomic(path, &text)
}

/// Reads a `results.json` written by [`write_json`] (for re-rendering reports).
pub fn read_json(path: &Path) -> Result<ResultsFile, ResultsError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| ResultsError::Read { path: shown.clone(), source })?;
    serde_json::from_str(&text).map_err(|source| ResultsError::Json { path: shown, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Budget;
    use crate::file::{Axis, Combine, OnInvalid, Sweep};
    use crate::point::expand;
    use ir::cost::cost_report;
    use ir::spec::{GhcSpec, ModelSpec, ResidualSpec, ScheduleSpec};

    fn plan() -> crate::point::Expansion {
        let mut base = ModelSpec {
            d_model: 32,
            residual: ResidualSpec::Ghc(GhcSpec { m: 2, n: 4, ..GhcSpec::default() }),
            ..ModelSpec::default()
        };
        base.train.batch = 2;
        base.train.seq_len = 16;
        base.train.schedule = ScheduleSpec::Constant(Default::default());
        let sweep = Sweep {
            base,
            base_source: "t".into(),
            axes: vec![Axis { path: "residual.n".into(), values: vec!["4".into(), "8".into()] }],
            combine: Combine::Product,
            seeds: vec![0, 1],
            budget: Budget::Steps(10),
            baseline: true,
            on_invalid: OnInvalid::Refuse,
        };
        expand(&sweep).unwrap()
    }

    fn metrics(val: f64, ms: f64) -> RunOutcome {
        RunOutcome::Finished(RunMetrics {
            train_loss: val + 0.1,
            val_loss: val,
            val_bpb: None,
            ms_per_step: ms,
            tokens: 320,
            wall_s: 2.0,
        })
    }

    fn results() -> Vec<PointResult> {
        let plan = plan();
        let outcomes = [
            vec![(0, metrics(2.0, 10.0)), (1, metrics(2.2, 14.0))],
            vec![(0, metrics(1.9, 20.0)), (1, RunOutcome::Failed("NaN loss at step 7".into()))],
            vec![(0, metrics(2.1, 8.0)), (1, metrics(2.1, 8.0))],
        ];
        let mut out: Vec<PointResult> = plan
            .points
            .iter()
            .zip(&outcomes)
            .map(|(p, runs)| PointResult::aggregate(p, &cost_report(&p.spec).unwrap(), runs))
            .collect();
        fill_overheads(&mut out);
        out
    }

    #[test]
    fn aggregation_over_seeds() {
        let r = results();
        assert_eq!(r[0].point, "residual.n-4");
        assert_eq!(r[0].seeds, [0, 1]);
        assert_eq!(r[0].seeds_finished, 2);
        assert_eq!(r[0].status, Status::Ok);
        let v = r[0].val_loss;
        assert!((v.mean.unwrap() - 2.1).abs() < 1e-12);
        assert!((v.std.unwrap() - 0.02f64.sqrt()).abs() < 1e-12, "sample std of 2.0, 2.2");
        assert!((r[0].val_bits_per_byte.unwrap() - 2.1 / std::f64::consts::LN_2).abs() < 1e-12);
        assert!((r[0].tokens_per_s.unwrap() - 32.0 / 0.012).abs() < 1e-9, "32 tokens per 12 ms");
        assert_eq!(r[0].wall_s, 4.0);
        assert_eq!(r[0].tokens_trained, 320);
        let cost = cost_report(&plan().points[0].spec).unwrap();
        assert_eq!(r[0].params_non_embedding, cost.params.total - cost.params.embedding);
        assert!(r[0].params_non_embedding < r[0].params_total);
        assert_eq!(r[0].params_active, cost.params.active);

        // One failed seed: the point is failed, the means cover the seed that finished.
        assert_eq!(r[1].status, Status::Failed("seed 1: NaN loss at step 7".into()));
        assert_eq!(r[1].seeds_finished, 1);
        assert_eq!(r[1].val_loss, Stat { mean: Some(1.9), std: None });
    }

    #[test]
    fn non_finite_and_missing_runs_fail_the_point() {
        let p = &plan().points[0];
        let cost = cost_report(&p.spec).unwrap();
        let r = PointResult::aggregate(p, &cost, &[(0, metrics(f64::NAN, 1.0))]);
        let Status::Failed(why) = &r.status else { panic!("{:?}", r.status) };
        assert!(why.contains("seed 0: non-finite loss") && why.contains("seed 1: no result"), "{why}");
        assert_eq!(r.val_loss, Stat::default());
        assert_eq!(r.tokens_per_s, None);
    }

    #[test]
    fn overheads_against_the_twin() {
        let r = results();
        assert_eq!(r[2].point, "baseline");
        assert_eq!(r[0].baseline.as_deref(), Some("baseline"));
        // ms/step 12 vs 8.
        assert!((r[0].overhead_ms_per_step.unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(r[2].overhead_ms_per_step, Some(0.0));
        let f = r[1].overhead_train_flops.unwrap();
        assert!(f > r[0].overhead_train_flops.unwrap() && f > 0.0, "n = 8 costs more than n = 4");
    }

    #[test]
    fn csv_has_axis_columns_first_and_one_row_per_point() {
        let r = results();
        let axes = vec!["residual.n".to_string()];
        let text = to_csv(&axes, &r).unwrap();
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        let expected: Vec<String> =
            axes.iter().cloned().chain(COLUMNS.iter().map(|c| c.to_string())).collect();
        assert_eq!(header, expected);
        let rows: Vec<csv::StringRecord> = rd.records().map(Result::unwrap).collect();
        assert_eq!(rows.len(), 3);
        let get = |row: &csv::StringRecord, col: &str| {
            row[header.iter().position(|h| h == col).unwrap()].to_string()
        };
        assert_eq!(get(&rows[0], "residual.n"), "4");
        assert_eq!(get(&rows[2], "residual.n"), "", "the twin does not set the residual axis");
        assert_eq!(get(&rows[0], "seeds"), "0;1");
        assert_eq!(get(&rows[1], "status"), "failed");
        assert_eq!(get(&rows[1], "reason"), "seed 1: NaN loss at step 7");
        assert_eq!(get(&rows[1], "val_loss_std"), "", "one finished seed has no std");
        assert_eq!(get(&rows[0], "val_loss_mean").parse::<f64>().unwrap(), r[0].val_loss.mean.unwrap());
        assert_eq!(get(&rows[0], "overhead_ms_per_step"), "0.5");
    }

    #[test]
    fn json_round_trips_and_files_are_written_whole() {
        let r = results();
        let dir = std::env::temp_dir().join(format!("widen-sweep-results-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let axes = vec!["residual.n".to_string()];
        write_json(&dir.join("results.json"), &axes, &r).unwrap();
        write_csv(&dir.join("results.csv"), &axes, &r).unwrap();
        let back = read_json(&dir.join("results.json")).unwrap();
        let raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
        assert_eq!(raw["points"][1]["status"], "failed");
        assert_eq!(raw["points"][1]["reason"], "seed 1: NaN loss at step 7");
        assert_eq!(raw["points"][0]["status"], "ok");
        assert_eq!(back, ResultsFile { axes: axes.clone(), points: r.clone() });
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        names.sort();
        assert_eq!(names, ["results.csv", "results.json"], "no temporary file is left");
        std::fs::write(dir.join("bad.json"), "{").unwrap();
        let err = read_json(&dir.join("bad.json")).unwrap_err().to_string();
        assert!(err.contains("bad.json: not a results file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn significance_pairs_seeds_against_the_twin_or_the_named_point() {
        let mut r = results();
        fill_significance(&mut r, None);
        assert_eq!(
            r[0].val_loss_seeds,
            [SeedLoss { seed: 0, val_loss: 2.0 }, SeedLoss { seed: 1, val_loss: 2.2 }]
        );
        assert_eq!(r[0].compared_to.as_deref(), Some("baseline"));
        let d = r[0].delta_val_loss.unwrap();
        // Per-seed differences -0.1 and +0.1: mean 0, sd 0.1414, t(0.975, 1) = 12.706.
        assert_eq!(d.test, crate::stats::Test::Paired { n: 2 });
        assert!(d.mean.abs() < 1e-12 && (d.p_value - 1.0).abs() < 1e-9, "{d:?}");
        assert!((d.ci95_hi - 12.706204736174707 * 0.1).abs() < 1e-6, "{d:?}");
        assert_eq!(r[1].delta_val_loss, None, "one finished seed gives no test");
        assert_eq!(r[2].compared_to, None, "the twin is not compared with itself");
        let half = r[0].val_loss_ci95.unwrap();
        assert!((half - 12.706204736174707 * 0.1).abs() < 1e-6, "mean 2.1, sd 0.1414, n 2: {half}");

        fill_significance(&mut r, Some("residual.n-4"));
        assert_eq!(r[2].compared_to.as_deref(), Some("residual.n-4"));
        assert_eq!(r[0].compared_to, None, "the named point is the reference");
        let csv = to_csv(&["residual.n".to_string()], &r).unwrap();
        assert!(csv.contains("0:2;1:2.2"), "{csv}");
    }
}
