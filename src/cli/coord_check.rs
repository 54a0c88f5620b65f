//! `widen coord-check SPEC --widths 64,128,256,512 --steps 4 [--out DIR] [--param sp|mup|both]`:
//! the muP coordinate check of docs/math.md §8.1 (see `runtime::coord` for what
//! scales with width and how the models train).
//!
//! For each parametrization it prints a table of every layer's activation RMS
//! per width and step with the slope of log2(RMS) against log2(width), then one
//! line per parametrization with each layer's slope after the last step (0 is
//! flat; muP should stay near it). Into `--out` (default `coord-check/`) it
//! writes `coord.csv` (all rows) and `coord-sp.svg` / `coord-mup.svg` (RMS
//! against width on log-log axes, a panel per step).

use anyhow::Context;
use ir::spec::load_spec;
use runtime::coord::{coord_check_on, to_csv, CoordCheck, CoordError, CoordParam};
use runtime::data::Corpus;
use runtime::progress::{clock, Line, Mark, Mode};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use sweep::coord_plot::{coord_plot, CoordPanel, CoordPlot, CoordSeries};

/// Which parametrizations to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ParamArg {
    /// Standard parametrization only.
    Sp,
    /// muP only (the spec's muP knobs, or the defaults).
    Mup,
    /// Both, SP first.
    Both,
}

#[derive(clap::Args)]
pub struct Args {
    /// Path to the RON spec (its d_model is the reference the other widths scale from).
    pub spec: PathBuf,
    /// Widths (d_model values) to train, comma-separated, at most 32 of them, each
    /// 1..=16777216 (the spec's bound of d_model); the smallest is muP's base width.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..,
          value_parser = clap::value_parser!(u64).range(1..=ir::spec::limits::MAX_WIDTH))]
    pub widths: Vec<u64>,
    /// Optimizer steps per width, 1..=1000.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS as u64))]
    pub steps: u64,
    /// Folder for coord.csv and the SVG plots.
    #[arg(long, default_value = "coord-check")]
    pub out: PathBuf,
    /// Parametrizations to check.
    #[arg(long, value_enum, default_value = "both")]
    pub param: ParamArg,
}

/// The most widths one check trains: each is a model trained from scratch, and
/// 32 doublings span every width a machine holds.
const MAX_WIDTHS: usize = 32;

/// The most steps per width: the check looks at the first updates (docs/math.md
/// §8.1), where muP and SP part ways; every step trains every width.
const MAX_STEPS: usize = 1000;

/// The flag a coordinate check's error is about: `--steps`, `--widths`, or none
/// (a failure of the run itself, or of the spec's data).
fn flag_of(err: &CoordError) -> Option<&'static str> {
    match err {
        CoordError::NoSteps => Some("--steps"),
        CoordError::TooFewWidths { .. }
        | CoordError::DuplicateWidth { .. }
        | CoordError::InvalidWidth { .. } => Some("--widths"),
        _ => None,
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.widths.len() <= MAX_WIDTHS,
        "--widths lists {} widths; a coordinate check takes 2..={MAX_WIDTHS}",
        args.widths.len()
    );
    // Bounded by their parsers: far inside usize.
    let widths: Vec<usize> = args.widths.iter().map(|&w| w as usize).collect();
    let steps = args.steps as usize;
    let spec = load_spec(&args.spec)?;
    let params = match args.param {
        ParamArg::Sp => vec![CoordParam::Standard],
        ParamArg::Mup => vec![CoordParam::MuP],
        ParamArg::Both => vec![CoordParam::Standard, CoordParam::MuP],
    };
    // The largest width must fit this machine before anything trains.
    if let Some(&widest) = widths.iter().max() {
        let widest =
            runtime::coord::width_spec(&spec, widest, widest, CoordParam::Standard).context("--widths")?;
        super::fits_this_machine(&widest)?;
    }
    let corpus = Corpus::load(&spec)?;
    let mut checks = Vec::new();
    for param in params {
        // A line redrawn in place on a terminal; a log gets a line as each width starts.
        let mut line = Line::new(Mode::of_stderr());
        let started = Instant::now();
        let mut progress = |width: usize, step: usize| {
            let mark = if step <= 1 { Mark::Line } else { Mark::Tick };
            let text =
                format!("{} D={width}: step {step}/{steps}, {}", param.name(), clock(started.elapsed()));
            line.show(&text, started.elapsed(), mark);
        };
        let check = coord_check_on(&spec, &widths, steps, param, &corpus, &mut progress);
        line.end(true);
        let check = match check {
            Ok(check) => check,
            Err(err) => {
                let flag = flag_of(&err);
                let err = anyhow::Error::new(err);
                return Err(match flag {
                    Some(flag) => err.context(flag),
                    None => {
                        err.context(format!("{} coordinate check of {}", param.name(), args.spec.display()))
                    }
                });
            }
        };
        println!("{}", check.to_table());
        checks.push(check);
    }
    for check in &checks {
        println!("{}", check.summary());
    }

    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    let csv = args.out.join("coord.csv");
    std::fs::write(&csv, to_csv(&checks)).with_context(|| format!("cannot write {}", csv.display()))?;
    let mut written = vec![csv];
    for check in &checks {
        let svg = coord_plot(&plot_data(&spec.name, check))?;
        let path = args.out.join(format!("coord-{}.svg", check.parametrization.name().to_lowercase()));
        std::fs::write(&path, svg).with_context(|| format!("cannot write {}", path.display()))?;
        written.push(path);
    }
    let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
    println!("wrote {}", names.join(", "));
    Ok(ExitCode::SUCCESS)
}

/// The plot's data: a panel per step, a series per layer.
fn plot_data(model: &str, check: &CoordCheck) -> CoordPlot {
    let panels = (0..=check.steps)
        .map(|step| CoordPanel {
            title: if step == 0 { "at init".into() } else { format!("after step {step}") },
            series: check
                .layers
                .iter()
                .map(|layer| CoordSeries {
                    layer: layer.clone(),
                    points: check.series(step, layer).into_iter().map(|(w, r)| (w as f64, r)).collect(),
                })
                .collect(),
        })
        .collect();
    CoordPlot {
        title: format!(
            "{model}: {} coordinate check (activation RMS vs width)",
            check.parametrization.name()
        ),
        panels,
    }
}
