//! A sweep folder's results: every run's outcome and metrics read back, aggregated
//! into `results.csv` and `results.json`, and drawn into `plots/` (what `widen
//! report` does, and what a sweep does after every run).
//!
//! **What a run measured** (from its `metrics.jsonl`): the training loss is the mean
//! over the last tenth of its steps (one batch's loss is noisy), the validation loss
//! the last evaluation (every run evaluates at its last step), ms/step the mean step
//! time without the first step (which includes one-off setup).
//!
//! **Any number of reports may run during a sweep.** Rewrites hold the folder's
//! results lock ([`crate::folder::lock_results`]) and every file is replaced whole,
//! so a report sees each run as its last complete `outcome.json` says, and a run
//! still writing its metrics as far as its last complete line. Reading is linear in
//! the metrics lines, and curves are thinned to at most [`crate::plot::MAX_DRAWN`]
//! positions for drawing.

use std::path::{Path, PathBuf};

use ir::cost::cost_report;
use runtime::train::{FINAL_CHECKPOINT, INIT_CHECKPOINT, METRICS_FILE};
use serde::Deserialize;

use crate::budget::Budget;
use crate::folder::{
    lock_results, read_record, write_atomic, PlanFile, PLOTS_DIR, RESULTS_CSV, RESULTS_JSON,
};
use crate::plot::{
    self, CostPoint, FrontierPlot, LawPlot, LawPoint, LossCurves, LossOptions, PointCurves, RunPanel,
    RunPanels, SpeedBar, SpeedPlot, TrainCurve,
};
use crate::point::{Point, RATIO_AXIS};
use crate::results::{
    self, fill_overheads, fill_significance, PointResult, RunMetrics, RunOutcome, SeedProvenance,
};
use crate::runner::SweepRunError;

/// What a sweep did, or what a folder holds.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepReport {
    pub dir: PathBuf,
    /// One row per point, as in `results.csv`.
    pub results: Vec<PointResult>,
    /// Points skipped as invalid: name and reason.
    pub invalid: Vec<(String, String)>,
    /// Runs trained (or continued) by this call.
    pub trained: usize,
    /// Runs whose earlier outcome was reused.
    pub reused: usize,
    /// Runs that ended in failure (this call or before).
    pub failed: usize,
    /// Runs of earlier sweeps into the folder that this call did not ask for: kept
    /// in the results, named here (run folders relative to the sweep folder).
    pub kept: Vec<PathBuf>,
    /// Runs whose `outcome.json` does not read: the reason (they count as no result).
    pub damaged: Vec<String>,
    /// The fits of the log-linear law, one per plot drawn.
    pub laws: Vec<LawSummary>,
}

/// One fitted law `L = a + b·log2(x)` over an axis.
#[derive(Debug, Clone, PartialEq)]
pub struct LawSummary {
    /// The plot file.
    pub file: PathBuf,
    pub axis: String,
    /// The fit's equation with standard errors and R², or why there is none.
    pub fit: Result<crate::fit::LinearFit, crate::fit::FitError>,
    /// Whether the fit is over log2 of the axis or (an axis through 0) the axis itself.
    pub form: plot::LawForm,
}

/// Re-reads a sweep folder: collects every run's outcome, writes `results.csv`,
/// `results.json` and the plots (what `widen report` does).
pub fn report(dir: &Path) -> Result<SweepReport, SweepRunError> {
    report_against(dir, None)
}

/// [`report`] comparing every point with `against` (a point of the folder) instead
/// of the folder's choice.
pub fn report_against(dir: &Path, against: Option<&str>) -> Result<SweepReport, SweepRunError> {
    let mut file = PlanFile::read(dir)?;
    if let Some(a) = against {
        check_against(&file, a)?;
        file.against = Some(a.to_string());
    }
    report_into(dir, &file)
}

/// Refuses an `--against` that names no point of `file`, listing the points.
pub(crate) fn check_against(file: &PlanFile, against: &str) -> Result<(), SweepRunError> {
    if file.points.iter().any(|p| p.name == against) {
        return Ok(());
    }
    Err(SweepRunError::UnknownAgainst {
        point: against.to_string(),
        points: file.points.iter().map(|p| p.name.clone()).collect::<Vec<_>>().join(", "),
    })
}

/// Aggregates `file`'s runs and rewrites the results and plots under the results lock.
pub(crate) fn report_into(dir: &Path, file: &PlanFile) -> Result<SweepReport, SweepRunError> {
    // Held from the first read to the last write, so rewrites land in the order
    // they read the folder and the last one holds the newest outcomes.
    let _turn = lock_results(dir)?;
    let mut rows = Vec::new();
    let mut curves = Vec::new();
    let mut failed = 0;
    let mut damaged = Vec::new();
    for point in &file.points {
        let cost = cost_report(&point.spec)
            .map_err(|e| SweepRunError::Read { path: dir.join(&point.name), message: e.to_string() })?;
        let mut outcomes = Vec::new();
        let mut seeds = PointCurves { label: point.name.clone(), train: Vec::new(), val: Vec::new() };
        let mut provenance = Vec::new();
        for run in &point.runs {
            let run_dir = dir.join(&run.dir);
            match read_record(&run_dir) {
                Ok(Some(record)) => {
                    failed += usize::from(matches!(record.outcome, RunOutcome::Failed(_)));
                    outcomes.push((run.seed, record.outcome));
                    if let Some(p) = record.provenance {
                        provenance.push(SeedProvenance { seed: run.seed, provenance: p });
                    }
                }
                Err(why) => damaged.push(why),
                Ok(None) => {}
            }
            if let Ok(lines) = metrics_lines(&run_dir) {
                let tokens = |step: u64| step.saturating_mul(point.budget.tokens_per_step) as f64;
                seeds.train.push(lines.iter().map(|l| (tokens(l.step), l.loss())).collect());
                seeds
                    .val
                    .push(lines.iter().filter_map(|l| l.val_loss.map(|v| (tokens(l.step), v))).collect());
            }
        }
        let mut row = PointResult::aggregate(point, &cost, &outcomes);
        provenance.sort_by_key(|p| p.seed);
        row.provenance = provenance;
        row.data = file.data.get(&point.name).cloned();
        rows.push(row);
        curves.push(seeds);
    }
    fill_overheads(&mut rows);
    fill_significance(&mut rows, file.against.as_deref());
    results::write_csv(&dir.join(RESULTS_CSV), &file.axes, &rows)?;
    results::write_json(&dir.join(RESULTS_JSON), &file.axes, &rows)?;
    let laws = render(dir, file, &rows, curves)?;
    Ok(SweepReport {
        dir: dir.to_path_buf(),
        results: rows,
        invalid: file.invalid.clone(),
        trained: 0,
        reused: 0,
        failed,
        kept: Vec::new(),
        damaged,
        laws,
    })
}

/// A point's value on `axis`, if it sets it.
fn value<'a>(p: &'a Point, axis: &str) -> Option<&'a str> {
    p.values.iter().find(|(path, _)| path == axis).map(|(_, v)| v.as_str())
}

/// Draws the plots into `DIR/plots`: loss curves, the law (one plot per numeric
/// axis, over the points that set the same axes as the first point and differ from
/// it only on that axis, so a fit never mixes two changes), the frontier and the
/// speed bars. A plot with no finished point to draw is left out.
fn render(
    dir: &Path,
    file: &PlanFile,
    rows: &[PointResult],
    curves: Vec<PointCurves>,
) -> Result<Vec<LawSummary>, SweepRunError> {
    let plots = dir.join(PLOTS_DIR);
    std::fs::create_dir_all(&plots).map_err(|source| SweepRunError::Io { path: plots.clone(), source })?;
    let write = |name: &str, svg: Result<String, plot::PlotError>| -> Result<(), SweepRunError> {
        match svg {
            Ok(svg) => Ok(write_atomic(&plots.join(name), svg.as_bytes())?),
            Err(_) => Ok(()),
        }
    };
    let title = |what: &str| format!("{what} ({})", budget_text(&file.budget));
    write(
        "loss.svg",
        plot::loss_curves_with(
            &LossCurves { title: title("loss against tokens"), points: curves },
            &plot::LossOptions {
                train_curve: if file.points.iter().any(|p| p.spec.mtp.depth > 0) {
                    plot::TrainCurve::ObjectiveWithMtp
                } else {
                    plot::TrainCurve::Loss
                },
            },
        ),
    )?;
    let finished: Vec<&PointResult> = rows.iter().filter(|r| r.val_loss.mean.is_some()).collect();
    let frontier = |what: &str, cost: &dyn Fn(&PointResult) -> f64| FrontierPlot {
        title: title(what),
        points: finished
            .iter()
            .map(|r| CostPoint {
                label: r.point.clone(),
                cost: cost(r),
                loss: r.val_loss.mean.unwrap_or(f64::NAN),
                ci95: r.val_loss_ci95,
            })
            .collect(),
    };
    let flops = |r: &PointResult| r.tokens_trained as f64 * r.flops_per_token_train as f64;
    write("frontier.svg", plot::frontier(&frontier("validation loss against training compute", &flops)))?;
    // Each run's training seconds: its tokens at the point's measured throughput.
    let seconds = |r: &PointResult| r.tokens_per_s.map_or(f64::NAN, |t| r.tokens_trained as f64 / t);
    write(
        "frontier-time.svg",
        plot::frontier_with(
            &frontier("validation loss against training time", &seconds),
            plot::FrontierX::Seconds,
        ),
    )?;
    write(
        "speed.svg",
        plot::speed(&SpeedPlot {
            title: "time per step and overhead over the plain-residual twin".into(),
            bars: finished
                .iter()
                .filter_map(|r| {
                    r.ms_per_step.mean.map(|ms| SpeedBar {
                        label: r.point.clone(),
                        ms_per_step: ms,
                        overhead: r.overhead_ms_per_step,
                    })
                })
                .collect(),
        }),
    )?;

    let mut laws = Vec::new();
    let swept: Vec<(&Point, &PointResult)> =
        file.points.iter().zip(rows).filter(|(p, _)| !p.is_baseline_twin).collect();
    let Some(&(first, _)) = swept.first() else { return Ok(laws) };
    for axis in &file.axes {
        if value(first, axis).is_none() {
            continue;
        }
        let same_elsewhere = |p: &Point| {
            p.values.len() == first.values.len()
                && first.values.iter().all(|(path, v)| path == axis || value(p, path) == Some(v.as_str()))
        };
        let on_axis: Vec<&(&Point, &PointResult)> =
            swept.iter().filter(|(p, _)| same_elsewhere(p) && value(p, axis).is_some()).collect();
        let numeric = on_axis.iter().all(|(p, _)| value(p, axis).is_some_and(|v| v.parse::<f64>().is_ok()));
        let points: Vec<LawPoint> = on_axis
            .iter()
            .filter_map(|(p, r)| {
                let x: f64 = value(p, axis)?.parse().ok()?;
                Some(LawPoint { label: p.name.clone(), x, loss: r.val_loss.mean?, ci95: r.val_loss_ci95 })
            })
            .collect();
        if !numeric || points.is_empty() {
            continue;
        }
        let name = if file.axes.len() == 1 { "law.svg".to_string() } else { format!("law-{axis}.svg") };
        let shown = if axis == RATIO_AXIS { "r = n/m".to_string() } else { axis.clone() };
        let mut data = LawPlot { title: String::new(), axis: shown.clone(), points };
        let form = data.form();
        data.title = title(&format!("validation loss against {}", form.x_label(&shown)));
        if let Ok((svg, fit)) = plot::law(&data) {
            write_atomic(&plots.join(&name), svg.as_bytes())?;
            laws.push(LawSummary { file: plots.join(&name), axis: axis.clone(), fit, form });
        }
    }
    Ok(laws)
}

fn budget_text(budget: &Budget) -> String {
    match budget {
        Budget::Tokens(n) => format!("equal tokens: {n} per point"),
        Budget::Flops(f) => format!("equal training compute: {f:.3e} FLOPs per point"),
        Budget::Steps(n) => format!("{n} steps per point"),
        Budget::Time(t) => format!("equal time: {t} s of steps per point"),
    }
}

/// One line of a run's `metrics.jsonl` (the fields a report reads; a non-finite
/// loss is written as `null`).
#[derive(Deserialize)]
pub(crate) struct MetricsLine {
    pub step: u64,
    /// Tokens trained up to this step (absent from older metrics files).
    #[serde(default)]
    pub tokens: Option<u64>,
    #[serde(default)]
    loss: Option<f64>,
    #[serde(default)]
    pub val_loss: Option<f64>,
    #[serde(default)]
    val_bpb: Option<f64>,
    #[serde(default)]
    tokens_per_s: Option<f64>,
}

impl MetricsLine {
    fn loss(&self) -> f64 {
        self.loss.unwrap_or(f64::NAN)
    }

    /// The step's throughput, as the training measured it.
    pub(crate) fn tokens_per_s(&self) -> Option<f64> {
        self.tokens_per_s
    }
}

/// Every complete line of a run's `metrics.jsonl`, in one pass. A last line with
/// no newline that does not parse is one a running training is still writing, and
/// is left out; any other bad line is an error naming the file and line.
pub(crate) fn metrics_lines(run_dir: &Path) -> Result<Vec<MetricsLine>, String> {
    jsonl_lines(&run_dir.join(METRICS_FILE))
}

/// The files [`plot_run`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct RunPlots {
    /// `RUN_DIR/loss.svg`: training and validation loss against tokens.
    pub loss: PathBuf,
    /// `RUN_DIR/train.svg`: learning rate, gradient norm and (MoE) load balance
    /// against steps; `None` when the metrics hold none of them (older files).
    pub train: Option<PathBuf>,
}

/// One line of a run's `metrics.jsonl` as [`plot_run`] draws it.
#[derive(Deserialize)]
struct RunLine {
    /// The fields a report reads (`step`, `tokens`, `loss`, `val_loss`).
    #[serde(flatten)]
    base: MetricsLine,
    /// The main head's next-token training loss, when the metrics record it apart
    /// from the objective.
    #[serde(default)]
    loss_main: Option<f64>,
    #[serde(default)]
    lr: Option<f64>,
    #[serde(default)]
    grad_norm: Option<f64>,
    #[serde(default)]
    moe_imbalance: Option<f64>,
    #[serde(default)]
    moe_dropped: Option<f64>,
}

/// Every complete line of the JSON-lines file `path` as a `T`: an unparsable last
/// line without a newline is still being written and left out (see [`metrics_lines`]).
fn jsonl_lines<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let open_tail = !text.is_empty() && !text.ends_with('\n');
    let count = text.lines().count();
    let mut out = Vec::with_capacity(count);
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<T>(line) {
            Ok(l) => out.push(l),
            Err(_) if open_tail && i + 1 == count => {}
            Err(e) => return Err(format!("{} line {}: not a metrics line: {e}", path.display(), i + 1)),
        }
    }
    Ok(out)
}

/// The model spec a run folder's newest checkpoint records in its header
/// (docs/checkpoints.md): `final.safetensors`, else the `ckpt-<step>` of the
/// highest step, else `init.safetensors`. Only the header is read.
fn run_spec(run_dir: &Path) -> Option<ir::spec::ModelSpec> {
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(run_dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("ckpt-")?.strip_suffix(".safetensors")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    let candidates = std::iter::once(run_dir.join(FINAL_CHECKPOINT))
        .chain(steps.into_iter().map(|s| s.1))
        .chain(std::iter::once(run_dir.join(INIT_CHECKPOINT)));
    candidates.filter(|p| p.is_file()).find_map(|p| header_spec(&p))
}

/// The `spec` of a safetensors file's `__metadata__`, parsed.
fn header_spec(path: &Path) -> Option<ir::spec::ModelSpec> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    // safetensors caps headers at 100 MB; a larger length is not a header.
    let n = usize::try_from(u64::from_le_bytes(len)).ok().filter(|&n| n <= 100_000_000)?;
    let mut header = vec![0u8; n];
    file.read_exact(&mut header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
    let spec = header.get("__metadata__")?.get("spec")?.as_str()?;
    ir::spec::parse_spec(spec, "header `spec`").ok()
}

/// Draws one run's training and validation loss against tokens into
/// `RUN_DIR/loss.svg`, and its learning rate, gradient norm and MoE load balance
/// against steps into `RUN_DIR/train.svg` (what `widen plot` does).
///
/// The training curve is the main head's loss `loss_main` when the metrics hold
/// it, else the objective `loss`, titled as including MTP terms when the run's
/// checkpoint says the model has MTP (or that it may, when no checkpoint reads).
pub fn plot_run(run_dir: &Path) -> Result<RunPlots, SweepRunError> {
    let path = run_dir.join(METRICS_FILE);
    let lines: Vec<RunLine> =
        jsonl_lines(&path).map_err(|message| SweepRunError::Read { path: path.clone(), message })?;
    if lines.is_empty() {
        return Err(SweepRunError::Read { path, message: "it holds no step yet".into() });
    }
    let Some(per_step) = lines.iter().find_map(|l| l.base.tokens.map(|t| t / l.base.step.max(1))) else {
        return Err(SweepRunError::Read {
            path,
            message:
                "its lines have no `tokens` field (written by an older widen); train it again to plot it"
                    .into(),
        });
    };
    let x = |l: &RunLine| l.base.tokens.unwrap_or(l.base.step.saturating_mul(per_step)) as f64;
    let main = lines.iter().any(|l| l.loss_main.is_some());
    let train_curve = if main {
        TrainCurve::Loss
    } else {
        match run_spec(run_dir) {
            Some(spec) if spec.mtp.depth > 0 => TrainCurve::ObjectiveWithMtp,
            Some(_) => TrainCurve::Loss,
            None => TrainCurve::ObjectiveMaybeMtp,
        }
    };
    let train_y = |l: &RunLine| if main { l.loss_main.unwrap_or(f64::NAN) } else { l.base.loss() };
    let label = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
    let curves = PointCurves {
        label: label.clone(),
        train: vec![lines.iter().map(|l| (x(l), train_y(l))).collect()],
        val: vec![lines.iter().filter_map(|l| l.base.val_loss.map(|v| (x(l), v))).collect()],
    };
    let svg = plot::loss_curves_with(
        &LossCurves { title: format!("{label}: loss against tokens"), points: vec![curves] },
        &LossOptions { train_curve },
    )
    .map_err(|e| SweepRunError::Read { path: path.clone(), message: e.to_string() })?;
    let loss = run_dir.join("loss.svg");
    write_atomic(&loss, svg.as_bytes())?;

    let series = |f: fn(&RunLine) -> Option<f64>| -> Vec<(f64, f64)> {
        lines.iter().filter_map(|l| f(l).map(|v| (l.base.step as f64, v))).collect()
    };
    let panel =
        |title: &str, y_desc: &str, points| RunPanel { title: title.into(), y_desc: y_desc.into(), points };
    let panels = vec![
        panel("learning rate", "learning rate", series(|l| l.lr)),
        panel("gradient norm", "global gradient norm", series(|l| l.grad_norm)),
        panel(
            "MoE load imbalance (largest max/mean load of a sublayer; 1 is even)",
            "max / mean expert load",
            series(|l| l.moe_imbalance),
        ),
        panel("MoE assignments dropped over capacity", "assignments dropped", series(|l| l.moe_dropped)),
    ];
    let train =
        match plot::run_panels(&RunPanels { title: format!("{label}: training against steps"), panels }) {
            Ok(svg) => {
                let out = run_dir.join("train.svg");
                write_atomic(&out, svg.as_bytes())?;
                Some(out)
            }
            Err(plot::PlotError::NoData { .. }) => None,
            Err(e) => return Err(SweepRunError::Read { path, message: e.to_string() }),
        };
    Ok(RunPlots { loss, train })
}

/// What a finished run measured, from its metrics (see the module doc).
pub(crate) fn measured(run_dir: &Path, point: &Point, wall_s: f64) -> Result<RunMetrics, String> {
    let lines = metrics_lines(run_dir)?;
    if !run_dir.join(FINAL_CHECKPOINT).exists() {
        return Err(format!("{} has no {FINAL_CHECKPOINT}", run_dir.display()));
    }
    let tail = (lines.len() / 10).max(1);
    let last: Vec<f64> = lines.iter().rev().take(tail).map(MetricsLine::loss).collect();
    let val_loss = lines
        .iter()
        .rev()
        .find_map(|l| l.val_loss)
        .ok_or_else(|| format!("{} holds no validation loss", run_dir.display()))?;
    let val_bpb = lines.iter().rev().find(|l| l.val_loss.is_some()).and_then(|l| l.val_bpb);
    let per_step = point.budget.tokens_per_step as f64;
    let times: Vec<f64> = lines
        .iter()
        .skip(usize::from(lines.len() > 1))
        .map(|l| 1000.0 * per_step / l.tokens_per_s.unwrap_or(f64::NAN))
        .collect();
    Ok(RunMetrics {
        train_loss: last.iter().sum::<f64>() / last.len() as f64,
        val_loss,
        val_bpb,
        ms_per_step: times.iter().sum::<f64>() / times.len().max(1) as f64,
        tokens: point.budget.tokens,
        wall_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_still_being_written_is_left_out_and_a_bad_line_named() {
        let dir = std::env::temp_dir().join(format!("widen-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = "{\"step\":1,\"loss\":5.0,\"tokens\":32,\"tokens_per_s\":100.0}\n";
        std::fs::write(dir.join(METRICS_FILE), format!("{good}{good}{{\"step\":3,\"lo")).unwrap();
        assert_eq!(metrics_lines(&dir).unwrap().len(), 2);
        std::fs::write(dir.join(METRICS_FILE), format!("{good}{{\"step\":3,\"lo\n{good}")).unwrap();
        let err = metrics_lines(&dir).err().unwrap();
        assert!(err.contains("line 2: not a metrics line"), "{err}");
        std::fs::write(dir.join(METRICS_FILE), format!("{good}{{\"step\":3,\"loss\":null}}")).unwrap();
        let lines = metrics_lines(&dir).unwrap();
        assert!(lines.len() == 2 && lines[1].loss().is_nan(), "a complete last line counts, null is NaN");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn run_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("widen-plot-run-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// 30 steps of 256 tokens, evaluated at steps 10, 20 and 30; `extra(step)` adds fields.
    fn write_metrics(dir: &Path, extra: impl Fn(u64) -> String) {
        let text: String = (1..=30u64)
            .map(|s| {
                let val = if s % 10 == 0 {
                    format!(",\"val_loss\":{}", 2.05 + 1.0 / s as f64)
                } else {
                    String::new()
                };
                format!(
                    "{{\"step\":{s},\"tokens\":{},\"loss\":{},\"tokens_per_s\":100.0{val}{}}}\n",
                    256 * s,
                    2.0 + 1.0 / s as f64,
                    extra(s)
                )
            })
            .collect();
        std::fs::write(dir.join(METRICS_FILE), text).unwrap();
    }

    fn svg_texts(path: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(path).unwrap();
        let doc =
            roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{}: not XML: {e}", path.display()));
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text())
            .map(|t| t.trim().into())
            .collect()
    }

    fn circles(path: &Path) -> usize {
        let text = std::fs::read_to_string(path).unwrap();
        let doc = roxmltree::Document::parse(&text).unwrap();
        doc.descendants().filter(|n| n.has_tag_name("circle")).count()
    }

    #[test]
    fn plot_run_draws_the_learning_rate_gradient_norm_and_moe_balance() {
        let dir = run_dir("train");
        write_metrics(&dir, |s| {
            format!(",\"lr\":{},\"grad_norm\":{}", 1e-3 * s as f64 / 30.0, 1.0 / s as f64)
        });
        let plots = plot_run(&dir).unwrap();
        assert_eq!(plots.loss, dir.join("loss.svg"));
        assert_eq!(circles(&plots.loss), 3, "each of the 3 evaluations is a dot");
        let train = plots.train.clone().expect("train.svg is written");
        assert_eq!(train, dir.join("train.svg"));
        let t = svg_texts(&train);
        for needle in ["learning rate", "gradient norm", "step"] {
            assert!(t.iter().any(|x| x.contains(needle)), "missing {needle:?}: {t:?}");
        }
        assert!(!t.iter().any(|x| x.contains("MoE")), "no MoE panel without MoE fields: {t:?}");

        write_metrics(&dir, |s| {
            format!(
                ",\"lr\":1e-3,\"grad_norm\":0.5,\"moe_imbalance\":{},\"moe_dropped\":{}",
                1.0 + 1.0 / s as f64,
                30 - s
            )
        });
        let t = svg_texts(&plot_run(&dir).unwrap().train.unwrap());
        for needle in
            ["learning rate", "gradient norm", "MoE load imbalance", "MoE assignments dropped over capacity"]
        {
            assert!(t.iter().any(|x| x.contains(needle)), "missing {needle:?}: {t:?}");
        }

        // Metrics of an older widen, without lr or grad_norm: loss.svg alone.
        std::fs::remove_file(dir.join("train.svg")).unwrap();
        write_metrics(&dir, |_| String::new());
        let plots = plot_run(&dir).unwrap();
        assert!(plots.train.is_none() && !dir.join("train.svg").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A checkpoint file holding only a safetensors header whose metadata records `spec`.
    fn write_header(path: &Path, spec: &ir::spec::ModelSpec) {
        let header = serde_json::json!({ "__metadata__": { "spec": spec.to_ron() } }).to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn plot_run_titles_the_training_curve_by_what_it_measures() {
        let dir = run_dir("mtp");
        write_metrics(&dir, |_| String::new());
        let title = |dir: &Path| {
            let t = svg_texts(&plot_run(dir).unwrap().loss);
            t.into_iter().find(|x| x.starts_with("training")).unwrap_or_default()
        };
        assert_eq!(title(&dir), "training objective (with MTP terms if the model has MTP)", "no checkpoint");
        let mut spec = ir::spec::ModelSpec::default();
        spec.mtp.depth = 1;
        write_header(&dir.join("ckpt-30.safetensors"), &spec);
        assert_eq!(title(&dir), "training objective (with MTP terms)");
        spec.mtp.depth = 0;
        write_header(&dir.join(FINAL_CHECKPOINT), &spec);
        assert_eq!(title(&dir), "training loss", "the final checkpoint comes first");

        // `loss_main` is the main head's loss: drawn instead of the objective (here 9+).
        spec.mtp.depth = 1;
        write_header(&dir.join(FINAL_CHECKPOINT), &spec);
        let text: String = std::fs::read_to_string(dir.join(METRICS_FILE))
            .unwrap()
            .lines()
            .map(|l| {
                l.replacen("\"loss\":", "\"loss\":7.0,\"loss_main\":", 1).replacen(
                    ",\"loss\":7.0",
                    ",\"loss\":9.0",
                    1,
                ) + "\n"
            })
            .collect();
        assert!(text.contains("\"loss\":9.0,\"loss_main\":2"), "{text}");
        std::fs::write(dir.join(METRICS_FILE), text).unwrap();
        assert_eq!(title(&dir), "training loss");
        let t = svg_texts(&dir.join("loss.svg"));
        // y tick labels are the only numbers with a decimal point (token ticks are whole).
        let ticks: Vec<f64> = t.iter().filter(|x| x.contains('.')).filter_map(|x| x.parse().ok()).collect();
        assert!(
            !ticks.is_empty() && ticks.iter().all(|&y| y < 4.0),
            "the axis holds loss_main, not 9: {ticks:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
