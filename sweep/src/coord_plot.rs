//! The coordinate-check plot (docs/math.md §8.1): activation RMS against model
//! width on log-log axes, one line per layer, one panel per training step. A
//! flat line is a layer whose coordinate size does not depend on the width, what
//! muP promises; a rising one grows with width.
//!
//! Like the sweep's other plots ([`crate::plot`]) it takes plain data, so the
//! runtime that measured the activations fills [`CoordPlot`] and gets SVG text
//! back. Points that a log axis cannot show (zero, negative or not finite) are
//! left out.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::plot::PlotError;

/// Size of a panel's chart; panels are laid out in rows of at most [`COLUMNS`],
/// each with its legend in a strip to the right of the chart, so no legend covers
/// a line (the smallest width's points sit at the chart's left edge).
const PANEL: (u32, u32) = (520, 420);
/// Legend rows: height and font size.
const LEGEND_ROW: i32 = 16;
const LEGEND_FONT: u32 = 11;
const COLUMNS: usize = 3;
const TITLE_HEIGHT: u32 = 40;
const FONT: &str = "sans-serif";

/// One layer's line: `(width, rms)` pairs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CoordSeries {
    pub layer: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel: every layer at one training step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CoordPanel {
    /// E.g. `at init` or `after step 4`.
    pub title: String,
    pub series: Vec<CoordSeries>,
}

/// A whole coordinate-check figure (one parametrization).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CoordPlot {
    pub title: String,
    pub panels: Vec<CoordPanel>,
}

use crate::plot::color;

/// The legend strip's width: wide enough for the longest layer name.
fn legend_width(data: &CoordPlot) -> u32 {
    let longest = data.panels.iter().flat_map(|p| &p.series).map(|s| s.layer.chars().count()).max();
    (44 + 7 * longest.unwrap_or(0) as u32).clamp(100, 320)
}

/// Draws a legend (a white box with a black border, a line sample and the name
/// per layer) into `area`, beside the chart rather than on it.
fn side_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    series: &[CoordSeries],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (w, _) = area.dim_in_pixel();
    let top = 36;
    let bottom = top + LEGEND_ROW * series.len() as i32 + 8;
    area.draw(&Rectangle::new([(2, top), (w as i32 - 8, bottom)], WHITE.filled()))?;
    area.draw(&Rectangle::new([(2, top), (w as i32 - 8, bottom)], BLACK))?;
    for (i, s) in series.iter().enumerate() {
        let y = top + 4 + LEGEND_ROW * i as i32 + LEGEND_ROW / 2;
        area.draw(&PathElement::new([(8, y), (24, y)], color(i).stroke_width(2)))?;
        let style = TextStyle::from((FONT, LEGEND_FONT).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(s.layer.clone(), (30, y), style))?;
    }
    Ok(())
}

fn drawable(p: &(f64, f64)) -> bool {
    p.0 > 0.0 && p.1 > 0.0 && p.0.is_finite() && p.1.is_finite()
}

/// Smallest and largest of `values`, widened by `factor` on a log axis.
fn log_range(values: impl Iterator<Item = f64>, factor: f64) -> Option<(f64, f64)> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    lo.is_finite().then_some((lo / factor, hi * factor))
}

/// A log axis' tick label: `512`, `0.02`, `1.5`, or `3e-5` outside 0.001..10000.
pub(crate) fn tick(x: f64) -> String {
    if !(1e-3..1e4).contains(&x.abs()) {
        return format!("{x:.0e}");
    }
    // Three significant digits, trailing zeros dropped.
    let decimals = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    let text = format!("{x:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// Draws the figure: each panel has width on x and activation RMS on y, both
/// log scale, a line per layer with a legend entry naming it.
pub fn coord_plot(data: &CoordPlot) -> Result<String, PlotError> {
    const PLOT: &str = "coordinate check";
    let draw_err =
        |e: DrawingAreaErrorKind<std::io::Error>| PlotError::Draw { plot: PLOT, message: e.to_string() };
    let points =
        || data.panels.iter().flat_map(|p| &p.series).flat_map(|s| &s.points).filter(|p| drawable(p));
    let (x0, x1) = log_range(points().map(|p| p.0), 1.15).ok_or(PlotError::NoData { plot: PLOT })?;
    let mut widths: Vec<f64> = points().map(|p| p.0).collect();
    widths.sort_by(f64::total_cmp);
    widths.dedup();
    let columns = data.panels.len().clamp(1, COLUMNS);
    let rows = data.panels.len().div_ceil(columns).max(1);
    let legend_w = legend_width(data);
    let size = ((PANEL.0 + legend_w) * columns as u32, PANEL.1 * rows as u32 + TITLE_HEIGHT);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(&draw_err)?;
        let root = root.titled(&data.title, (FONT, 22)).map_err(&draw_err)?;
        let areas = root.split_evenly((rows, columns));
        for (panel, area) in data.panels.iter().zip(&areas) {
            let ys = panel.series.iter().flat_map(|s| &s.points).filter(|p| drawable(p)).map(|p| p.1);
            let Some((y0, y1)) = log_range(ys, 1.6) else { continue };
            let x_axis =
                LogCoord::<f64>::from((x0..x1).log_scale().base(2.0)).with_key_points(widths.clone());
            let y_axis = (y0..y1).log_scale();
            let (chart_area, legend_area) = area.split_horizontally(PANEL.0);
            let mut chart = ChartBuilder::on(&chart_area)
                .caption(&panel.title, (FONT, 16))
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(66)
                .build_cartesian_2d(x_axis, y_axis)
                .map_err(&draw_err)?;
            chart
                .configure_mesh()
                .x_desc("width d_model (log scale)")
                .y_desc("activation RMS (log scale)")
                .x_label_formatter(&|x| tick(*x))
                .y_label_formatter(&|y| tick(*y))
                .draw()
                .map_err(&draw_err)?;
            for (i, s) in panel.series.iter().enumerate() {
                let c = color(i);
                let line: Vec<(f64, f64)> = s.points.iter().copied().filter(drawable).collect();
                chart
                    .draw_series(LineSeries::new(line, c.stroke_width(2)).point_size(3))
                    .map_err(&draw_err)?;
            }
            side_legend(&legend_area, &panel.series).map_err(&draw_err)?;
        }
        root.present().map_err(&draw_err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(i: usize) -> String {
        let c = color(i);
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// Polylines drawn in series `i`'s colour (its line and its legend sample).
    fn lines(doc: &roxmltree::Document, i: usize) -> usize {
        let want = hex(i);
        doc.descendants()
            .filter(|n| {
                n.has_tag_name("polyline")
                    && n.attribute("stroke").is_some_and(|v| v.eq_ignore_ascii_case(&want))
            })
            .count()
    }

    fn texts(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text().map(String::from))
            .collect()
    }

    fn data(panels: usize) -> CoordPlot {
        let layers = ["embed", "blocks.0.attn", "blocks.0.out", "logits"];
        CoordPlot {
            title: "muP coordinate check".into(),
            panels: (0..panels)
                .map(|step| CoordPanel {
                    title: format!("after step {step}"),
                    series: layers
                        .iter()
                        .enumerate()
                        .map(|(i, l)| CoordSeries {
                            layer: (*l).into(),
                            points: [64.0, 128.0, 256.0]
                                .iter()
                                .map(|&w| (w, 0.02 * (i + 1) as f64 * (w / 64.0f64).powf(0.1 * step as f64)))
                                .collect(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick(512.0), "512");
        assert_eq!(tick(0.02), "0.02");
        assert_eq!(tick(0.0123456), "0.0123");
        assert_eq!(tick(1.0), "1");
        assert_eq!(tick(3e-5), "3e-5");
    }

    #[test]
    fn a_panel_per_step_holds_one_line_per_layer() {
        let svg = coord_plot(&data(5)).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("not XML: {e}"));
        for i in 0..4 {
            // Per panel: the layer's line and its legend sample.
            assert_eq!(lines(&doc, i), 2 * 5, "series {i}");
        }
        assert_eq!(lines(&doc, 4), 0, "no fifth series");
        let texts = texts(&doc);
        for needle in [
            "muP coordinate check",
            "after step 0",
            "after step 4",
            "embed",
            "logits",
            "width d_model (log scale)",
            "activation RMS (log scale)",
            "128",
        ] {
            assert!(texts.iter().any(|t| t.contains(needle)), "missing text {needle:?}");
        }
    }

    fn number(n: &roxmltree::Node, attr: &str) -> f64 {
        n.attribute(attr).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    }

    #[test]
    fn no_legend_box_covers_a_data_marker() {
        // Flat lines at init and rising ones later: markers at every corner of a panel.
        let svg = coord_plot(&data(3)).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("not XML: {e}"));
        let boxes: Vec<(f64, f64, f64, f64)> = doc
            .descendants()
            .filter(|n| {
                n.has_tag_name("rect")
                    && n.attribute("stroke").is_some_and(|c| c.eq_ignore_ascii_case("#000000"))
            })
            .map(|n| {
                let (x, y) = (number(&n, "x"), number(&n, "y"));
                (x, y, x + number(&n, "width"), y + number(&n, "height"))
            })
            .collect();
        assert_eq!(boxes.len(), 3, "one legend box per panel");
        let markers: Vec<(f64, f64, f64)> = doc
            .descendants()
            .filter(|n| n.has_tag_name("circle"))
            .map(|n| (number(&n, "cx"), number(&n, "cy"), number(&n, "r")))
            .collect();
        assert_eq!(markers.len(), 3 * 4 * 3, "a marker per panel, layer and width");
        for &(x0, y0, x1, y1) in &boxes {
            for &(cx, cy, r) in &markers {
                let clear = cx + r < x0 || cx - r > x1 || cy + r < y0 || cy - r > y1;
                assert!(clear, "legend box {:?} covers the marker at ({cx}, {cy})", (x0, y0, x1, y1));
            }
        }
    }

    #[test]
    #[ignore = "writes a coordinate-check figure to $WIDEN_PLOT_DIR for viewing"]
    fn write_example() {
        let dir = std::path::PathBuf::from(std::env::var("WIDEN_PLOT_DIR").unwrap_or_else(|_| "/tmp".into()));
        std::fs::write(dir.join("coord.svg"), coord_plot(&data(4)).unwrap()).unwrap();
    }

    #[test]
    fn points_a_log_axis_cannot_show_are_left_out_and_nothing_drawable_is_an_error() {
        let mut d = data(1);
        d.panels[0].series[0].points.push((512.0, 0.0));
        d.panels[0].series[0].points.push((1024.0, f64::NAN));
        assert!(coord_plot(&d).is_ok());
        let empty = CoordPlot {
            title: "x".into(),
            panels: vec![CoordPanel {
                title: "at init".into(),
                series: vec![CoordSeries { layer: "embed".into(), points: vec![(64.0, 0.0)] }],
            }],
        };
        assert_eq!(coord_plot(&empty), Err(PlotError::NoData { plot: "coordinate check" }));
    }
}
