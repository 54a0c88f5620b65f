//! The sweep's four plots, as SVG drawn with `plotters`.
//!
//! Each plot takes a plain data struct, so the runner (or `widen report`, from a
//! results folder) fills it and gets SVG text back:
//!
//! - [`loss_curves`] (a): training and validation loss against tokens, one line per
//!   point (the mean over seeds) with a band from the seeds' minimum to maximum; the
//!   training loss as a trailing mean over a fiftieth of the steps; series of at
//!   most [`MARKED_UP_TO`] positions also get a marker at each; the y axis covers
//!   every value unless the first steps lie far above the rest
//!   ([`FULL_RANGE_WITHIN`]), and then marks what it leaves out.
//! - [`run_panels`]: one run's learning rate, gradient norm and MoE load balance
//!   against steps (`widen plot`'s `train.svg`).
//! - [`law`] (b): final validation loss against log2 of the swept axis, the fitted
//!   line `L = a + b·log2(x)` of docs/math.md §5 and its equation with standard errors;
//!   over an axis that includes 0 or a negative value (log2 undefined), the linear
//!   law `L = a + b·x` over every point instead ([`LawForm`]).
//! - [`frontier`] (c): validation loss against training FLOPs (log axis), the
//!   non-dominated points joined and filled ([`crate::frontier`]).
//! - [`speed`] (d): milliseconds per step and overhead over the plain-residual twin,
//!   one bar per point.
//!
//! Every point is its own series: its own colour and a legend entry with its name.
//! Series are drawn with 2-pixel strokes and axes with 1-pixel ones. Text is left
//! to the SVG viewer's sans-serif font (no font files are read). Points with a
//! non-finite value (failed runs) are left out of a plot rather than drawn at
//! infinity.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::fit::{linear, FitError, LinearFit};

const SIZE: (u32, u32) = (1200, 560);
const FONT: &str = "sans-serif";

/// Errors drawing a plot.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlotError {
    /// Nothing finite to draw.
    #[error("{plot}: no point has finite values to draw")]
    NoData { plot: &'static str },
    /// The plotting library failed.
    #[error("{plot}: drawing failed: {message}")]
    Draw { plot: &'static str, message: String },
}

/// One point's curves for [`loss_curves`]: per seed, `(tokens, loss)` pairs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PointCurves {
    pub label: String,
    pub train: Vec<Vec<(f64, f64)>>,
    pub val: Vec<Vec<(f64, f64)>>,
}

/// Data of plot (a).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossCurves {
    pub title: String,
    pub points: Vec<PointCurves>,
}

/// One point of plot (b): the swept axis value and the final validation loss.
#[derive(Debug, Clone, PartialEq)]
pub struct LawPoint {
    pub label: String,
    /// The axis value x (> 0); plotted at log2(x).
    pub x: f64,
    /// Mean final validation loss (nats).
    pub loss: f64,
    /// Half-width of the 95% interval of that mean over seeds, drawn as an error bar.
    pub ci95: Option<f64>,
}

/// Data of plot (b).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LawPlot {
    pub title: String,
    /// The axis' name as it should read in `log2(...)`, e.g. `r` or `residual.n`.
    pub axis: String,
    pub points: Vec<LawPoint>,
}

/// One point of plot (c).
#[derive(Debug, Clone, PartialEq)]
pub struct CostPoint {
    pub label: String,
    /// What the point spent, on the x axis: training FLOPs, or training seconds
    /// ([`FrontierX`]).
    pub cost: f64,
    /// Mean final validation loss (nats).
    pub loss: f64,
    /// Half-width of the 95% interval of that mean over seeds, drawn as an error bar.
    pub ci95: Option<f64>,
}

/// Data of plot (c).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FrontierPlot {
    pub title: String,
    pub points: Vec<CostPoint>,
}

/// What the frontier's x axis measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FrontierX {
    /// Training FLOPs (the cost model's count).
    #[default]
    Flops,
    /// Training wall-clock seconds (steps × measured step time): hyper-connections
    /// cost memory traffic more than FLOPs, so equal FLOPs can flatter them.
    Seconds,
}

/// One bar pair of plot (d).
#[derive(Debug, Clone, PartialEq)]
pub struct SpeedBar {
    pub label: String,
    pub ms_per_step: f64,
    /// Ratio to the plain-residual twin minus one, if the sweep has twins.
    pub overhead: Option<f64>,
}

/// Data of plot (d).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpeedPlot {
    pub title: String,
    pub bars: Vec<SpeedBar>,
}

/// Draws a chart's legend as every sweep plot does: a light box with a black border.
pub(crate) fn legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    font_size: u32,
    position: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, font_size))
        .position(position)
        .draw()
}

/// The i-th series colour (every sweep plot and the coordinate check use one palette).
pub(crate) fn color(i: usize) -> RGBColor {
    let c = Palette99::pick(i).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

fn draw_err<E: std::error::Error + Send + Sync>(
    plot: &'static str,
) -> impl Fn(DrawingAreaErrorKind<E>) -> PlotError {
    move |e| PlotError::Draw { plot, message: e.to_string() }
}

/// `3200` as `3.2k`, `2.5e6` as `2.5M`: tick labels a reader takes in at a glance.
fn si(x: f64) -> String {
    let a = x.abs();
    let (v, unit) = match a {
        _ if a >= 1e12 => (x / 1e12, "T"),
        _ if a >= 1e9 => (x / 1e9, "G"),
        _ if a >= 1e6 => (x / 1e6, "M"),
        _ if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    let text = format!("{v:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{unit}")
}

/// Head room above the tallest bar, so the legend (one line per point) clears the bars.
fn headroom(points: usize) -> f64 {
    (1.15 + 0.08 * points as f64).min(2.5)
}

/// A padded range around finite values; a single value gets a unit-wide range.
fn range(values: impl Iterator<Item = f64>, pad: f64) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return None;
    }
    let span = hi - lo;
    if span <= f64::EPSILON * hi.abs().max(1.0) {
        let w = (lo.abs() * 0.05).max(0.5);
        return Some((lo - w, hi + w));
    }
    Some((lo - pad * span, hi + pad * span))
}

/// Each point's y replaced by the mean of the last `window` finite values up to it:
/// one batch's training loss is noisy, a short trailing mean shows the trend.
pub fn trailing_mean(series: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut recent: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    let mut sum = 0.0;
    series
        .iter()
        .map(|&(x, y)| {
            if y.is_finite() {
                recent.push_back(y);
                sum += y;
                if recent.len() > window.max(1) {
                    sum -= recent.pop_front().unwrap_or(0.0);
                }
            }
            (x, if recent.is_empty() { f64::NAN } else { sum / recent.len() as f64 })
        })
        .collect()
}

/// Per x: (x, mean, min, max) over the seeds that have a finite value there, in
/// one sort of every (x, y) pair: linear in the points after the sort.
pub fn band(per_seed: &[Vec<(f64, f64)>]) -> Vec<(f64, f64, f64, f64)> {
    let mut pairs: Vec<(f64, f64)> =
        per_seed.iter().flatten().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64, f64, f64)> = Vec::new();
    let mut i = 0;
    while i < pairs.len() {
        let x = pairs[i].0;
        let (mut sum, mut n, mut lo, mut hi) = (0.0, 0usize, f64::INFINITY, f64::NEG_INFINITY);
        while i < pairs.len() && pairs[i].0 == x {
            let y = pairs[i].1;
            (sum, n, lo, hi) = (sum + y, n + 1, lo.min(y), hi.max(y));
            i += 1;
        }
        out.push((x, sum / n as f64, lo, hi));
    }
    out
}

/// One drawn position of a band: x, mean, minimum, maximum.
type Position = (f64, f64, f64, f64);

/// The most x positions a curve is drawn with: an SVG of a million-step run stays
/// small, and a screen shows no more.
pub const MAX_DRAWN: usize = 1000;

/// A band of more than `max` positions thinned to at most `max`: each run of
/// consecutive positions becomes one at its last x, with the mean of the means and
/// the extremes of the extremes, so no excursion is hidden.
pub fn thin(band: Vec<(f64, f64, f64, f64)>, max: usize) -> Vec<(f64, f64, f64, f64)> {
    if band.len() <= max.max(1) {
        return band;
    }
    let per = band.len().div_ceil(max.max(1));
    band.chunks(per)
        .map(|c| {
            let x = c[c.len() - 1].0;
            let mean = c.iter().map(|q| q.1).sum::<f64>() / c.len() as f64;
            let lo = c.iter().map(|q| q.2).fold(f64::INFINITY, f64::min);
            let hi = c.iter().map(|q| q.3).fold(f64::NEG_INFINITY, f64::max);
            (x, mean, lo, hi)
        })
        .collect()
}

/// The ends of a vertical error bar at `(x, y)` of half-height `half` (none when
/// `half` is absent or not finite).
fn bar_ends(x: f64, y: f64, half: Option<f64>) -> Option<[(f64, f64); 2]> {
    half.filter(|h| h.is_finite() && *h > 0.0).map(|h| [(x, y - h), (x, y + h)])
}

fn legend_box(c: RGBColor) -> impl Fn((i32, i32)) -> Rectangle<(i32, i32)> {
    move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled())
}

/// Series of at most this many positions get a marker at each position as well as
/// their line: one evaluation is a line of one point, which draws nothing visible.
pub const MARKED_UP_TO: usize = 20;

/// How far the first steps' training loss may rise above the rest before the y axis
/// stops covering it: up to this many times the span of the later curves above
/// their top, the axis covers everything; beyond, it covers the later curves and the
/// values above are drawn at its top edge and said so.
pub const FULL_RANGE_WITHIN: f64 = 3.0;

/// What the training curves of [`loss_curves_with`] measure, which sets the
/// training panel's title.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrainCurve {
    /// The main head's next-token loss (a model without MTP, or a `loss_main` metric).
    #[default]
    Loss,
    /// The training objective with its MTP terms (docs/math.md §7), which is larger
    /// than the next-token loss that the validation panel and models without MTP show.
    ObjectiveWithMtp,
    /// The training objective of a run whose spec could not be read: it includes
    /// MTP terms if the model has MTP.
    ObjectiveMaybeMtp,
}

/// Drawing options of [`loss_curves_with`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossOptions {
    /// What the training curves are; [`TrainCurve::ObjectiveWithMtp`] when any
    /// point's model has `mtp.depth` > 0 and its curves are the metrics' `loss`.
    pub train_curve: TrainCurve,
}

/// The panel's note on values drawn at the edge of the y axis: how many positions
/// lie above and below it, and the extreme value.
fn clip_note(band: &[Vec<(f64, f64, f64, f64)>], y0: f64, y1: f64) -> Option<String> {
    let above = band.iter().map(|b| b.iter().filter(|q| q.3 > y1).count()).max().unwrap_or(0);
    let below = band.iter().map(|b| b.iter().filter(|q| q.2 < y0).count()).max().unwrap_or(0);
    let top = band.iter().flatten().map(|q| q.3).fold(f64::NEG_INFINITY, f64::max);
    let bottom = band.iter().flatten().map(|q| q.2).fold(f64::INFINITY, f64::min);
    let steps = |n: usize| if n == 1 { "1 step".to_string() } else { format!("{n} steps") };
    let mut parts = Vec::new();
    if above > 0 {
        parts.push(format!("▲ {} above the axis, up to {top:.3}, drawn at its top edge", steps(above)));
    }
    if below > 0 {
        parts.push(format!(
            "▼ {} below the axis, down to {bottom:.3}, drawn at its bottom edge",
            steps(below)
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Plot (a) with the default [`LossOptions`]: the training curves are the loss.
pub fn loss_curves(data: &LossCurves) -> Result<String, PlotError> {
    loss_curves_with(data, &LossOptions::default())
}

/// Plot (a): train and validation loss against tokens, per point.
///
/// The y axis, shared by both panels, covers every value when the first steps rise
/// at most [`FULL_RANGE_WITHIN`] times the later span above the later curves, and
/// otherwise what the curves do after the first tenth of the tokens; values outside
/// are drawn at the edge, with a triangle at each point's extreme and a note in the
/// panel saying how many steps and how far (docs/sweeps.md, "Fits and plots").
pub fn loss_curves_with(data: &LossCurves, options: &LossOptions) -> Result<String, PlotError> {
    const PLOT: &str = "loss curves";
    let steps = data.points.iter().flat_map(|p| p.train.iter().map(Vec::len)).max().unwrap_or(0);
    let window = (steps / 50).max(1);
    let full: Vec<(Vec<_>, Vec<_>)> = data
        .points
        .iter()
        .map(|p| {
            let smooth: Vec<Vec<(f64, f64)>> = p.train.iter().map(|s| trailing_mean(s, window)).collect();
            (band(&smooth), band(&p.val))
        })
        .collect();
    let all = || full.iter().flat_map(|(t, v)| t.iter().chain(v));
    let (x0, x1) = range(all().map(|b| b.0), 0.0).ok_or(PlotError::NoData { plot: PLOT })?;
    let extremes = |xs: &mut dyn Iterator<Item = &(f64, f64, f64, f64)>| {
        xs.flat_map(|b| [b.2, b.3]).filter(|v| v.is_finite()).fold(None, |acc: Option<(f64, f64)>, v| {
            Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
        })
    };
    let late = x0 + 0.1 * (x1 - x0);
    let whole = extremes(&mut all()).ok_or(PlotError::NoData { plot: PLOT })?;
    let (y0, y1) = match extremes(&mut all().filter(|b| b.0 >= late)) {
        Some((lo, hi))
            if whole.1 > hi + FULL_RANGE_WITHIN * (hi - lo)
                || whole.0 < lo - FULL_RANGE_WITHIN * (hi - lo) =>
        {
            range([lo, hi].into_iter(), 0.08)
        }
        _ => range([whole.0, whole.1].into_iter(), 0.05),
    }
    .ok_or(PlotError::NoData { plot: PLOT })?;
    let clamp = |y: f64| y.clamp(y0, y1);
    let what = match options.train_curve {
        TrainCurve::Loss => "training loss",
        TrainCurve::ObjectiveWithMtp => "training objective (with MTP terms)",
        TrainCurve::ObjectiveMaybeMtp => "training objective (with MTP terms if the model has MTP)",
    };
    let train_title =
        if window > 1 { format!("{what} (mean of the last {window} steps)") } else { what.to_string() };
    let notes: [Option<String>; 2] = [
        clip_note(&full.iter().map(|b| b.0.clone()).collect::<Vec<_>>(), y0, y1),
        clip_note(&full.iter().map(|b| b.1.clone()).collect::<Vec<_>>(), y0, y1),
    ];
    let bands: Vec<(Vec<_>, Vec<_>)> =
        full.into_iter().map(|(t, v)| (thin(t, MAX_DRAWN), thin(v, MAX_DRAWN))).collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err(PLOT))?;
        let root = root.titled(&data.title, (FONT, 22)).map_err(draw_err(PLOT))?;
        let (left, right) = root.split_horizontally(SIZE.0 / 2);
        for (area, which, title) in [(&left, 0, train_title.as_str()), (&right, 1, "validation loss")] {
            let mut chart = ChartBuilder::on(area)
                .caption(title, (FONT, 18))
                .margin(12)
                .x_label_area_size(44)
                .y_label_area_size(64)
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(draw_err(PLOT))?;
            chart
                .configure_mesh()
                .x_desc("tokens trained")
                .y_desc("loss (nats per token)")
                .x_label_formatter(&|x| si(*x))
                .draw()
                .map_err(draw_err(PLOT))?;
            for (i, (p, b)) in data.points.iter().zip(&bands).enumerate() {
                let b = if which == 0 { &b.0 } else { &b.1 };
                let c = color(i);
                let mut outline: Vec<(f64, f64)> = b.iter().map(|q| (q.0, clamp(q.3))).collect();
                outline.extend(b.iter().rev().map(|q| (q.0, clamp(q.2))));
                chart
                    .draw_series(std::iter::once(Polygon::new(outline, c.mix(0.18).filled())))
                    .map_err(draw_err(PLOT))?;
                chart
                    .draw_series(LineSeries::new(b.iter().map(|q| (q.0, clamp(q.1))), c.stroke_width(2)))
                    .map_err(draw_err(PLOT))?
                    .label(p.label.as_str())
                    .legend(legend_box(c));
                if b.len() <= MARKED_UP_TO {
                    chart
                        .draw_series(b.iter().map(|q| Circle::new((q.0, clamp(q.1)), 4, c.filled())))
                        .map_err(draw_err(PLOT))?;
                }
                // A triangle at each point's extreme beyond the axis, pointing off it.
                if let Some(q) = b.iter().filter(|q| q.3 > y1).max_by(|a, z| a.3.total_cmp(&z.3)) {
                    chart
                        .draw_series(std::iter::once(TriangleMarker::new((q.0, y1), 7, c.filled())))
                        .map_err(draw_err(PLOT))?;
                }
                if let Some(q) = b.iter().filter(|q| q.2 < y0).min_by(|a, z| a.2.total_cmp(&z.2)) {
                    let down = EmptyElement::at((q.0, y0))
                        + Polygon::new(vec![(-7, -4), (7, -4), (0, 8)], c.filled());
                    chart.draw_series(std::iter::once(down)).map_err(draw_err(PLOT))?;
                }
            }
            if let Some(note) = &notes[which] {
                chart
                    .draw_series(std::iter::once(Text::new(
                        note.clone(),
                        (x0 + 0.02 * (x1 - x0), y0 + 0.04 * (y1 - y0)),
                        (FONT, 12),
                    )))
                    .map_err(draw_err(PLOT))?;
            }
            legend(&mut chart, 13, SeriesLabelPosition::UpperRight).map_err(draw_err(PLOT))?;
        }
        root.present().map_err(draw_err(PLOT))?;
    }
    Ok(svg)
}

/// Which law [`law`] fits and draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LawForm {
    /// `L = a + b·log2(x)` (docs/math.md §5), over an axis of positive values.
    Log2,
    /// `L = a + b·x`, over an axis that includes 0 or a negative value (e.g.
    /// `mtp.depth = 0, 1, 2`), where log2 is undefined: no point is left out.
    Linear,
}

impl LawForm {
    /// The x of the fit's equation: `log2(axis)` or `axis`.
    pub fn x_label(self, axis: &str) -> String {
        match self {
            LawForm::Log2 => format!("log2({axis})"),
            LawForm::Linear => axis.to_string(),
        }
    }

    /// Where value `x` of the axis lies on the fit's x.
    pub fn position(self, x: f64) -> f64 {
        match self {
            LawForm::Log2 => x.log2(),
            LawForm::Linear => x,
        }
    }
}

impl LawPlot {
    /// The form [`law`] fits: [`LawForm::Linear`] when a point with a finite loss
    /// has an axis value of 0 or below, else [`LawForm::Log2`].
    pub fn form(&self) -> LawForm {
        let nonpositive = self.points.iter().any(|p| p.loss.is_finite() && p.x.is_finite() && p.x <= 0.0);
        if nonpositive {
            LawForm::Linear
        } else {
            LawForm::Log2
        }
    }
}

/// Plot (b): final validation loss against log2 of the axis, with the fitted law;
/// against the axis itself, with a linear law, when the axis includes 0 or a
/// negative value ([`LawPlot::form`]). Returns the SVG and the fit (or why there
/// is none: fewer than 3 points, all equal).
pub fn law(data: &LawPlot) -> Result<(String, Result<LinearFit, FitError>), PlotError> {
    const PLOT: &str = "loss vs log2(axis)";
    let form = data.form();
    let pts: Vec<(usize, &LawPoint)> =
        data.points.iter().enumerate().filter(|(_, p)| p.x.is_finite() && p.loss.is_finite()).collect();
    let xs: Vec<f64> = pts.iter().map(|(_, p)| form.position(p.x)).collect();
    let ls: Vec<f64> = pts.iter().map(|(_, p)| p.loss).collect();
    let fit = linear(&xs, &ls);
    let (x0, x1) = range(xs.iter().copied(), 0.08).ok_or(PlotError::NoData { plot: PLOT })?;
    let spans = pts.iter().flat_map(|(_, p)| {
        let h = p.ci95.filter(|h| h.is_finite()).unwrap_or(0.0);
        [p.loss - h, p.loss + h]
    });
    let (y0, y1) = range(spans, 0.15).ok_or(PlotError::NoData { plot: PLOT })?;
    let xlabel = form.x_label(&data.axis);
    let kind = match form {
        LawForm::Log2 => "fit".to_string(),
        LawForm::Linear => format!("linear fit (log2 is undefined at {} ≤ 0)", data.axis),
    };
    let bars = if pts.iter().any(|(_, p)| bar_ends(0.0, p.loss, p.ci95).is_some()) {
        "; bars: 95% interval of the mean over seeds"
    } else {
        ""
    };
    let caption = match &fit {
        Ok(f) => format!("{kind}: {}   (R² = {:.3}, n = {}{bars})", f.equation("L", &xlabel), f.r2, f.n),
        Err(e) => format!("no {kind}: {e}"),
    };
    let x_desc = match form {
        LawForm::Log2 => format!("{xlabel} (swept axis, log2 scale)"),
        LawForm::Linear => format!("{xlabel} (swept axis, linear scale)"),
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err(PLOT))?;
        let root = root.titled(&data.title, (FONT, 22)).map_err(draw_err(PLOT))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&caption, (FONT, 16))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(draw_err(PLOT))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc("final validation loss (nats per token)")
            .draw()
            .map_err(draw_err(PLOT))?;
        if let Ok(f) = &fit {
            chart
                .draw_series(LineSeries::new(
                    [(x0, f.predict(x0)), (x1, f.predict(x1))],
                    BLACK.stroke_width(1),
                ))
                .map_err(draw_err(PLOT))?
                .label(f.equation("L", &xlabel))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], BLACK.stroke_width(1)));
        }
        for (i, p) in &pts {
            let c = color(*i);
            if let Some(ends) = bar_ends(form.position(p.x), p.loss, p.ci95) {
                chart
                    .draw_series(std::iter::once(PathElement::new(ends, c.stroke_width(2))))
                    .map_err(draw_err(PLOT))?;
            }
            chart
                .draw_series(std::iter::once(Circle::new((form.position(p.x), p.loss), 6, c.filled())))
                .map_err(draw_err(PLOT))?
                .label(format!("{} ({} = {})", p.label, data.axis, p.x))
                .legend(legend_box(c));
        }
        legend(&mut chart, 13, SeriesLabelPosition::UpperRight).map_err(draw_err(PLOT))?;
        root.present().map_err(draw_err(PLOT))?;
    }
    Ok((svg, fit))
}

/// Plot (c): validation loss against training FLOPs (log axis), frontier highlighted.
pub fn frontier(data: &FrontierPlot) -> Result<String, PlotError> {
    frontier_with(data, FrontierX::Flops)
}

/// [`frontier`] against the cost `x` says: FLOPs or training seconds.
pub fn frontier_with(data: &FrontierPlot, x: FrontierX) -> Result<String, PlotError> {
    const PLOT: &str = "loss vs compute";
    let pairs: Vec<(f64, f64)> = data
        .points
        .iter()
        .map(|p| if p.cost > 0.0 { (p.cost, p.loss) } else { (f64::NAN, p.loss) })
        .collect();
    let on = crate::frontier::frontier(&pairs);
    let usable: Vec<usize> =
        (0..pairs.len()).filter(|&i| pairs[i].0.is_finite() && pairs[i].1.is_finite()).collect();
    let (lx0, lx1) =
        range(usable.iter().map(|&i| pairs[i].0.log10()), 0.08).ok_or(PlotError::NoData { plot: PLOT })?;
    let half = |i: usize| data.points[i].ci95.filter(|h| h.is_finite()).unwrap_or(0.0);
    let (y0, y1) = range(usable.iter().flat_map(|&i| [pairs[i].1 - half(i), pairs[i].1 + half(i)]), 0.15)
        .ok_or(PlotError::NoData { plot: PLOT })?;
    // The x axis is log10(FLOPs) on a linear scale, labelled in FLOPs: a sweep's costs
    // often span less than a decade, where a log axis would show one tick label.
    let at = |i: usize| (pairs[i].0.log10(), pairs[i].1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err(PLOT))?;
        let root = root.titled(&data.title, (FONT, 22)).map_err(draw_err(PLOT))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("filled: on the frontier (no cheaper point has lower or equal loss)", (FONT, 16))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(lx0..lx1, y0..y1)
            .map_err(draw_err(PLOT))?;
        chart
            .configure_mesh()
            .x_desc(match x {
                FrontierX::Flops => "training FLOPs (log scale)",
                FrontierX::Seconds => "training time, seconds (log scale)",
            })
            .y_desc("final validation loss (nats per token)")
            .x_label_formatter(&|v| match x {
                FrontierX::Flops => format!("{:.2e}", 10f64.powf(*v)),
                FrontierX::Seconds => format!("{:.3}", 10f64.powf(*v)),
            })
            .draw()
            .map_err(draw_err(PLOT))?;
        chart
            .draw_series(LineSeries::new(on.iter().map(|&i| at(i)), BLACK.stroke_width(1)))
            .map_err(draw_err(PLOT))?
            .label("frontier")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], BLACK.stroke_width(1)));
        for &i in &usable {
            let c = color(i);
            if let Some(ends) = bar_ends(at(i).0, at(i).1, data.points[i].ci95) {
                chart
                    .draw_series(std::iter::once(PathElement::new(ends, c.stroke_width(2))))
                    .map_err(draw_err(PLOT))?;
            }
            let style = if on.contains(&i) { c.filled() } else { c.stroke_width(2) };
            chart
                .draw_series(std::iter::once(Circle::new(at(i), 6, style)))
                .map_err(draw_err(PLOT))?
                .label(data.points[i].label.as_str())
                .legend(legend_box(c));
        }
        legend(&mut chart, 13, SeriesLabelPosition::UpperRight).map_err(draw_err(PLOT))?;
        root.present().map_err(draw_err(PLOT))?;
    }
    Ok(svg)
}

/// One panel of plot (d): area, title, y label, y range.
type Panel<'a, 'b> = (&'a DrawingArea<SVGBackend<'b>, Shift>, &'static str, &'static str, (f64, f64));

/// Plot (d): ms/step and overhead over the plain-residual twin, one bar per point.
pub fn speed(data: &SpeedPlot) -> Result<String, PlotError> {
    const PLOT: &str = "speed";
    let n = data.bars.len();
    let ms_max = data.bars.iter().map(|b| b.ms_per_step).filter(|v| v.is_finite()).fold(f64::NAN, f64::max);
    if !ms_max.is_finite() {
        return Err(PlotError::NoData { plot: PLOT });
    }
    let pct: Vec<Option<f64>> =
        data.bars.iter().map(|b| b.overhead.filter(|o| o.is_finite()).map(|o| 100.0 * o)).collect();
    let (p0, p1) = range(pct.iter().flatten().copied().chain([0.0]), 0.1).unwrap_or((-1.0, 1.0));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err(PLOT))?;
        let root = root.titled(&data.title, (FONT, 22)).map_err(draw_err(PLOT))?;
        let (left, right) = root.split_horizontally(SIZE.0 / 2);
        let panels: [Panel; 2] = [
            (&left, "time per step", "ms per step", (0.0, ms_max * headroom(n))),
            (
                &right,
                "overhead over the plain-residual twin",
                "overhead (%)",
                (p0.min(0.0), p1.max(0.0) + (p1 - p0).abs() * (headroom(n) - 1.0)),
            ),
        ];
        for (k, (area, title, ydesc, (y0, y1))) in panels.into_iter().enumerate() {
            let mut chart = ChartBuilder::on(area)
                .caption(title, (FONT, 18))
                .margin(12)
                .x_label_area_size(44)
                .y_label_area_size(64)
                .build_cartesian_2d(-0.5..(n as f64 - 0.5), y0..y1)
                .map_err(draw_err(PLOT))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(n.max(1))
                .x_label_formatter(&|x| format!("#{}", x.round() as i64 + 1))
                .x_desc("point (see legend)")
                .y_desc(ydesc)
                .draw()
                .map_err(draw_err(PLOT))?;
            for (i, b) in data.bars.iter().enumerate() {
                let value = if k == 0 { Some(b.ms_per_step).filter(|v| v.is_finite()) } else { pct[i] };
                let Some(value) = value else { continue };
                let c = color(i);
                let x = i as f64;
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x - 0.35, 0.0), (x + 0.35, value)],
                        c.filled(),
                    )))
                    .map_err(draw_err(PLOT))?
                    .label(format!("#{} {}", i + 1, b.label))
                    .legend(legend_box(c));
            }
            legend(&mut chart, 13, SeriesLabelPosition::UpperRight).map_err(draw_err(PLOT))?;
        }
        root.present().map_err(draw_err(PLOT))?;
    }
    Ok(svg)
}

/// One panel of [`run_panels`]: a quantity against training steps.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunPanel {
    pub title: String,
    pub y_desc: String,
    /// `(step, value)` pairs; non-finite values are left out.
    pub points: Vec<(f64, f64)>,
}

/// A figure of one run's training quantities, one panel each.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunPanels {
    pub title: String,
    pub panels: Vec<RunPanel>,
}

/// Panel size of [`run_panels`]; panels are laid out two to a row.
const RUN_PANEL: (u32, u32) = (600, 340);

/// One run's training quantities against steps (`widen plot`'s `train.svg`): a
/// line per panel, thinned like the loss curves with a band from each thinned
/// run's minimum to maximum, and a marker at each position of a short series. A
/// panel without a finite value is left out.
pub fn run_panels(data: &RunPanels) -> Result<String, PlotError> {
    const PLOT: &str = "training quantities";
    let drawn: Vec<(&RunPanel, Vec<Position>)> = data
        .panels
        .iter()
        .map(|p| (p, thin(band(std::slice::from_ref(&p.points)), MAX_DRAWN)))
        .filter(|(_, b)| !b.is_empty())
        .collect();
    if drawn.is_empty() {
        return Err(PlotError::NoData { plot: PLOT });
    }
    let columns = drawn.len().min(2);
    let rows = drawn.len().div_ceil(columns);
    let size = (RUN_PANEL.0 * columns as u32, RUN_PANEL.1 * rows as u32 + 40);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err(PLOT))?;
        let root = root.titled(&data.title, (FONT, 22)).map_err(draw_err(PLOT))?;
        let areas = root.split_evenly((rows, columns));
        for (i, ((panel, b), area)) in drawn.iter().zip(&areas).enumerate() {
            let (x0, x1) = range(b.iter().map(|q| q.0), 0.0).ok_or(PlotError::NoData { plot: PLOT })?;
            let (y0, y1) =
                range(b.iter().flat_map(|q| [q.2, q.3]), 0.05).ok_or(PlotError::NoData { plot: PLOT })?;
            let mut chart = ChartBuilder::on(area)
                .caption(&panel.title, (FONT, 16))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(72)
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(draw_err(PLOT))?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc(panel.y_desc.as_str())
                .x_label_formatter(&|x| si(*x))
                .y_label_formatter(&|y| if *y == 0.0 { "0".into() } else { crate::coord_plot::tick(*y) })
                .draw()
                .map_err(draw_err(PLOT))?;
            let c = color(i);
            let mut outline: Vec<(f64, f64)> = b.iter().map(|q| (q.0, q.3)).collect();
            outline.extend(b.iter().rev().map(|q| (q.0, q.2)));
            chart
                .draw_series(std::iter::once(Polygon::new(outline, c.mix(0.18).filled())))
                .map_err(draw_err(PLOT))?;
            chart
                .draw_series(LineSeries::new(b.iter().map(|q| (q.0, q.1)), c.stroke_width(2)))
                .map_err(draw_err(PLOT))?;
            if b.len() <= MARKED_UP_TO {
                chart
                    .draw_series(b.iter().map(|q| Circle::new((q.0, q.1), 4, c.filled())))
                    .map_err(draw_err(PLOT))?;
            }
        }
        root.present().map_err(draw_err(PLOT))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `#rrggbb` of series `i`, as the SVG writes it.
    fn hex(i: usize) -> String {
        let c = color(i);
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// Elements named `tag` whose `attr` is series `i`'s colour.
    fn count(doc: &roxmltree::Document, tag: &str, attr: &str, i: usize) -> usize {
        let want = hex(i);
        doc.descendants()
            .filter(|n| {
                n.has_tag_name(tag) && n.attribute(attr).is_some_and(|v| v.eq_ignore_ascii_case(&want))
            })
            .count()
    }

    fn texts(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text().map(String::from))
            .collect()
    }

    fn curves(label: &str, base: f64) -> PointCurves {
        let seed = |shift: f64| (1..=5).map(|s| (s as f64 * 640.0, base + 2.0 / s as f64 + shift)).collect();
        PointCurves {
            label: label.into(),
            train: vec![seed(0.0), seed(0.1)],
            val: vec![seed(0.05), seed(0.15)],
        }
    }

    fn parse(svg: &str) -> roxmltree::Document<'_> {
        roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not XML: {e}"))
    }

    fn has_text(doc: &roxmltree::Document, needle: &str) -> bool {
        texts(doc).iter().any(|t| t.contains(needle))
    }

    #[test]
    fn loss_curves_hold_a_line_and_band_per_point_in_each_panel() {
        let data = LossCurves {
            title: "GHC over r".into(),
            points: vec![curves("residual.r-1", 1.0), curves("residual.r-2", 1.2), curves("a<b & c", 1.4)],
        };
        let svg = loss_curves(&data).unwrap();
        let doc = parse(&svg);
        for i in 0..3 {
            assert_eq!(count(&doc, "polyline", "stroke", i), 2, "one mean line per panel for point {i}");
            assert_eq!(count(&doc, "polygon", "fill", i), 2, "one min-max band per panel for point {i}");
            assert_eq!(count(&doc, "rect", "fill", i), 2, "one legend entry per panel for point {i}");
        }
        assert_eq!(count(&doc, "polyline", "stroke", 3), 0, "no fourth series");
        for needle in ["residual.r-1", "residual.r-2", "a<b & c", "tokens trained", "loss (nats per token)"] {
            assert!(has_text(&doc, needle), "missing text {needle:?}");
        }
        for needle in ["GHC over r", "training loss", "validation loss"] {
            assert!(has_text(&doc, needle), "missing title {needle:?}");
        }
    }

    /// One point: `steps` training steps of `loss(step)`, evaluated at `evals`.
    fn run(steps: u64, loss: impl Fn(u64) -> f64, evals: &[u64]) -> LossCurves {
        let x = |s: u64| s as f64 * 256.0;
        LossCurves {
            title: "one run".into(),
            points: vec![PointCurves {
                label: "run".into(),
                train: vec![(1..=steps).map(|s| (x(s), loss(s))).collect()],
                val: vec![evals.iter().map(|&s| (x(s), loss(s) + 0.05)).collect()],
            }],
        }
    }

    #[test]
    fn short_series_get_a_marker_at_each_position() {
        let decay = |s: u64| 2.0 + 1.0 / s as f64;
        for evals in [&[100][..], &[50, 100], &[10, 20, 30, 40, 50, 60, 70, 80, 90, 100]] {
            let doc_text = loss_curves(&run(100, decay, evals)).unwrap();
            let doc = parse(&doc_text);
            // The 100 training steps are a line alone; each evaluation is a dot.
            assert_eq!(count(&doc, "circle", "fill", 0), evals.len(), "{evals:?}");
        }
        let long: Vec<u64> = (1..=MARKED_UP_TO as u64 + 1).collect();
        let doc_text = loss_curves(&run(100, decay, &long)).unwrap();
        assert_eq!(count(&parse(&doc_text), "circle", "fill", 0), 0, "a long series is a line alone");
    }

    #[test]
    fn first_steps_far_above_the_rest_are_drawn_at_the_edge_and_said_so() {
        // Five steps at 5.5, then a slow decline from 2.0 to 1.9: the axis covers the
        // decline, and the steps above it are marked with a triangle and a note.
        let steep = |s: u64| if s <= 5 { 5.5 } else { 2.0 - 0.001 * s as f64 };
        let doc_text = loss_curves(&run(100, steep, &[50, 100])).unwrap();
        let doc = parse(&doc_text);
        let note = texts(&doc).into_iter().find(|t| t.contains("above the axis"));
        let note = note.unwrap_or_else(|| panic!("no note on the clipped steps: {:?}", texts(&doc)));
        // The trailing mean over 2 steps keeps step 6 above too.
        assert!(note.contains("6 steps above the axis, up to 5.500, drawn at its top edge"), "{note}");
        assert_eq!(count(&doc, "polygon", "fill", 0), 2 + 1, "two bands and one edge triangle");

        // Early values within a few times the later span: the axis covers them all.
        let gentle = |s: u64| if s <= 5 { 2.2 } else { 2.0 - 0.001 * s as f64 };
        let doc_text = loss_curves(&run(100, gentle, &[50, 100])).unwrap();
        let doc = parse(&doc_text);
        assert!(!has_text(&doc, "above the axis"), "{:?}", texts(&doc));
        assert_eq!(count(&doc, "polygon", "fill", 0), 2, "two bands, no triangle");
    }

    #[test]
    fn the_training_panel_names_an_objective_with_mtp_terms() {
        let data = run(10, |s| 2.0 + 1.0 / s as f64, &[10]);
        let plain = loss_curves(&data).unwrap();
        assert!(has_text(&parse(&plain), "training loss"));
        for (curve, title) in [
            (TrainCurve::ObjectiveWithMtp, "training objective (with MTP terms)"),
            (TrainCurve::ObjectiveMaybeMtp, "training objective (with MTP terms if the model has MTP)"),
        ] {
            let svg = loss_curves_with(&data, &LossOptions { train_curve: curve }).unwrap();
            let doc = parse(&svg);
            assert!(has_text(&doc, title), "{:?}", texts(&doc));
            assert!(!has_text(&doc, "training loss"), "{:?}", texts(&doc));
        }
    }

    #[test]
    fn tick_labels_use_si_prefixes() {
        assert_eq!(si(3200.0), "3.2k");
        assert_eq!(si(2.5e6), "2.5M");
        assert_eq!(si(1e12), "1T");
        assert_eq!(si(640.0), "640");
        assert_eq!(si(0.5), "0.5");
    }

    #[test]
    fn trailing_mean_averages_the_last_values_and_skips_non_finite_ones() {
        let s = [(1.0, 4.0), (2.0, 2.0), (3.0, f64::NAN), (4.0, 6.0), (5.0, 0.0)];
        let m: Vec<f64> = trailing_mean(&s, 2).iter().map(|p| p.1).collect();
        assert_eq!(m, [4.0, 3.0, 3.0, 4.0, 3.0]);
        assert_eq!(trailing_mean(&s[..2], 1), s[..2]);
    }

    #[test]
    fn band_is_mean_min_max_over_seeds() {
        let b = band(&[vec![(1.0, 2.0), (2.0, 1.0)], vec![(1.0, 4.0), (2.0, f64::NAN)], vec![(1.0, 3.0)]]);
        assert_eq!(b, [(1.0, 3.0, 2.0, 4.0), (2.0, 1.0, 1.0, 1.0)]);
    }

    #[test]
    fn thinning_keeps_every_extreme_and_the_last_position() {
        let b: Vec<(f64, f64, f64, f64)> = (0..10).map(|i| (i as f64, 1.0, 0.5, 1.5)).collect();
        assert_eq!(thin(b.clone(), 10), b, "short bands are drawn as they are");
        let mut spiky = b;
        spiky[3].3 = 9.0;
        spiky[6].2 = -9.0;
        let t = thin(spiky, 4);
        assert_eq!(t.len(), 4);
        assert_eq!(t.iter().map(|q| q.0).collect::<Vec<_>>(), [2.0, 5.0, 8.0, 9.0]);
        assert_eq!((t[1].3, t[2].2), (9.0, -9.0), "a spike in a thinned run is still drawn");
    }

    #[test]
    fn a_million_step_curve_is_drawn_in_a_bounded_svg() {
        let seeds: Vec<Vec<(f64, f64)>> = (0..2)
            .map(|s| (0..1_000_000).map(|i| (i as f64, 5.0 - (i + s) as f64 * 1e-6)).collect())
            .collect();
        let svg = loss_curves(&LossCurves {
            title: "long".into(),
            points: vec![PointCurves { label: "p".into(), train: seeds.clone(), val: seeds }],
        })
        .unwrap();
        assert!(svg.len() < 1 << 20, "{} bytes", svg.len());
        let doc = parse(&svg);
        for line in doc.descendants().filter(|n| n.has_tag_name("polyline")) {
            let points = line.attribute("points").unwrap_or("").split_whitespace().count();
            assert!(points <= MAX_DRAWN, "{points} positions drawn");
        }
    }

    fn law_data(n: usize) -> LawPlot {
        let xs = [1.0, 1.5, 2.0, 4.0, 8.0];
        LawPlot {
            title: "final loss vs r".into(),
            axis: "r".into(),
            points: xs[..n]
                .iter()
                .enumerate()
                .map(|(i, &x)| LawPoint {
                    label: format!("residual.r-{x}"),
                    x,
                    loss: 1.6 - 0.01 * f64::log2(x) + [0.001, -0.001][i % 2],
                    ci95: (i % 2 == 0).then_some(0.003),
                })
                .collect(),
        }
    }

    #[test]
    fn law_plot_has_a_marker_per_point_and_the_fitted_equation() {
        let (svg, fit) = law(&law_data(5)).unwrap();
        let fit = fit.unwrap();
        assert!((fit.b + 0.01).abs() < 3.0 * fit.se_b.max(1e-9) + 1e-3, "{fit:?}");
        let doc = parse(&svg);
        for i in 0..5 {
            assert_eq!(count(&doc, "circle", "fill", i), 1, "one marker for point {i}");
            assert_eq!(count(&doc, "rect", "fill", i), 1, "one legend entry for point {i}");
            let bars = usize::from(i % 2 == 0);
            assert_eq!(count(&doc, "polyline", "stroke", i), bars, "an error bar where seeds give one: {i}");
        }
        let eq = fit.equation("L", "log2(r)");
        assert!(has_text(&doc, &eq), "the equation {eq:?} is shown");
        assert!(has_text(&doc, "R² = ") && has_text(&doc, "log2(r) (swept axis, log2 scale)"));
        assert!(has_text(&doc, "bars: 95% interval of the mean over seeds"), "the error bars are explained");
        assert!(has_text(&doc, "final validation loss (nats per token)"));

        // Two points: no fit, said so, and the points are still drawn.
        let (svg, fit) = law(&law_data(2)).unwrap();
        assert!(matches!(fit, Err(FitError::TooFew { n: 2 })));
        let doc = parse(&svg);
        assert!(has_text(&doc, "no fit: 2 points"));
        assert_eq!(count(&doc, "circle", "fill", 1), 1);
    }

    #[test]
    fn an_axis_through_zero_gets_a_linear_law_over_every_point() {
        let data = LawPlot {
            title: "final loss vs mtp.depth".into(),
            axis: "mtp.depth".into(),
            points: [0.0, 1.0, 2.0]
                .iter()
                .map(|&x| LawPoint {
                    label: format!("mtp.depth-{x}"),
                    x,
                    loss: 2.0 - 0.05 * x + if x == 1.0 { 0.01 } else { 0.0 },
                    ci95: None,
                })
                .collect(),
        };
        assert_eq!(data.form(), LawForm::Linear);
        assert_eq!(law_data(3).form(), LawForm::Log2);
        let (svg, fit) = law(&data).unwrap();
        let fit = fit.unwrap_or_else(|e| panic!("no fit: {e}"));
        assert_eq!(fit.n, 3, "the depth-0 point is fitted");
        let want = linear(&[0.0, 1.0, 2.0], &data.points.iter().map(|p| p.loss).collect::<Vec<_>>()).unwrap();
        assert_eq!(fit, want, "the fit is L = a + b·x over x itself");
        let doc = parse(&svg);
        for i in 0..3 {
            assert_eq!(count(&doc, "circle", "fill", i), 1, "point {i} is drawn");
        }
        let eq = fit.equation("L", "mtp.depth");
        assert!(
            has_text(&doc, &format!("linear fit (log2 is undefined at mtp.depth ≤ 0): {eq}")),
            "{:?}",
            texts(&doc)
        );
        assert!(has_text(&doc, "mtp.depth (swept axis, linear scale)"));
        assert!(!has_text(&doc, "log2("), "{:?}", texts(&doc));
    }

    #[test]
    fn frontier_plot_fills_exactly_the_frontier_points() {
        let pts = [(1e12, 2.0), (2e12, 1.8), (3e12, 1.9), (4e12, 1.7), (5e12, f64::NAN)];
        let data = FrontierPlot {
            title: "loss vs compute".into(),
            points: pts
                .iter()
                .enumerate()
                .map(|(i, &(flops, loss))| CostPoint {
                    label: format!("p{i}"),
                    cost: flops,
                    loss,
                    ci95: None,
                })
                .collect(),
        };
        let doc_text = frontier(&data).unwrap();
        let doc = parse(&doc_text);
        for i in [0, 1, 3] {
            assert_eq!(count(&doc, "circle", "fill", i), 1, "point {i} is on the frontier: filled");
            assert_eq!(count(&doc, "circle", "stroke", i), 0);
        }
        assert_eq!(count(&doc, "circle", "stroke", 2), 1, "point 2 is dominated: hollow");
        assert_eq!(count(&doc, "circle", "fill", 2), 0);
        assert_eq!(
            count(&doc, "circle", "stroke", 4) + count(&doc, "circle", "fill", 4),
            0,
            "failed point left out"
        );
        assert!(has_text(&doc, "training FLOPs (log scale)") && has_text(&doc, "frontier"));
        let timed = frontier_with(&data, FrontierX::Seconds).unwrap();
        assert!(has_text(&parse(&timed), "training time, seconds (log scale)"));
    }

    #[test]
    fn speed_plot_has_a_bar_per_point_and_panel() {
        let data = SpeedPlot {
            title: "cost per step".into(),
            bars: vec![
                SpeedBar { label: "baseline".into(), ms_per_step: 10.0, overhead: Some(0.0) },
                SpeedBar { label: "residual.n-4".into(), ms_per_step: 12.0, overhead: Some(0.2) },
                SpeedBar { label: "residual.n-8".into(), ms_per_step: 15.0, overhead: None },
            ],
        };
        let doc_text = speed(&data).unwrap();
        let doc = parse(&doc_text);
        // Bar + legend entry in each panel that has a value.
        assert_eq!(count(&doc, "rect", "fill", 0), 4);
        assert_eq!(count(&doc, "rect", "fill", 1), 4);
        assert_eq!(count(&doc, "rect", "fill", 2), 2, "no overhead: only the ms/step bar");
        assert!(
            has_text(&doc, "ms per step")
                && has_text(&doc, "overhead (%)")
                && has_text(&doc, "#2 residual.n-4")
        );
    }

    #[test]
    fn nothing_finite_is_an_error() {
        assert_eq!(loss_curves(&LossCurves::default()), Err(PlotError::NoData { plot: "loss curves" }));
        assert!(matches!(law(&LawPlot::default()), Err(PlotError::NoData { .. })));
        let nan = FrontierPlot {
            title: String::new(),
            points: vec![CostPoint { label: "x".into(), cost: 1.0, loss: f64::NAN, ci95: None }],
        };
        assert!(matches!(frontier(&nan), Err(PlotError::NoData { .. })));
        let none = SpeedPlot {
            title: String::new(),
            bars: vec![SpeedBar { label: "x".into(), ms_per_step: f64::NAN, overhead: None }],
        };
        assert!(matches!(speed(&none), Err(PlotError::NoData { .. })));
    }

    #[test]
    #[ignore = "writes the four plots to $WIDEN_PLOT_DIR for viewing"]
    fn write_examples() {
        let dir = std::path::PathBuf::from(std::env::var("WIDEN_PLOT_DIR").unwrap_or_else(|_| "/tmp".into()));
        let a = LossCurves {
            title: "loss curves".into(),
            points: vec![curves("a", 1.0), curves("b", 1.2), curves("c", 1.4)],
        };
        std::fs::write(dir.join("a.svg"), loss_curves(&a).unwrap()).unwrap();
        std::fs::write(dir.join("b.svg"), law(&law_data(5)).unwrap().0).unwrap();
        let c = FrontierPlot {
            title: "loss vs compute".into(),
            points: (0..4)
                .map(|i| CostPoint {
                    ci95: None,
                    label: format!("p{i}"),
                    cost: 1e12 * (i + 1) as f64,
                    loss: [2.0, 1.8, 1.9, 1.7][i],
                })
                .collect(),
        };
        std::fs::write(dir.join("c.svg"), frontier(&c).unwrap()).unwrap();
        let d = SpeedPlot {
            title: "cost per step".into(),
            bars: (0..4)
                .map(|i| SpeedBar {
                    label: format!("p{i}"),
                    ms_per_step: 10.0 + i as f64,
                    overhead: Some(0.1 * i as f64),
                })
                .collect(),
        };
        std::fs::write(dir.join("d.svg"), speed(&d).unwrap()).unwrap();
        let steep = run(2000, |s| if s <= 30 { 5.5 } else { 2.0 - 0.0001 * s as f64 }, &[1000, 2000]);
        std::fs::write(dir.join("a-clipped.svg"), loss_curves(&steep).unwrap()).unwrap();
        let e = RunPanels {
            title: "run: training against steps".into(),
            panels: ["learning rate", "gradient norm", "MoE load imbalance"]
                .iter()
                .enumerate()
                .map(|(k, t)| RunPanel {
                    title: (*t).into(),
                    y_desc: (*t).into(),
                    points: (1..=200)
                        .map(|s| (s as f64, 1e-3 * (k + 1) as f64 / (s as f64).sqrt()))
                        .collect(),
                })
                .collect(),
        };
        std::fs::write(dir.join("e.svg"), run_panels(&e).unwrap()).unwrap();
    }
}
