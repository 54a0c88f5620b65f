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
use runtime::coord::{coord_check_on, to_csv, CoordCheck, CoordParam};
use runtime::data::Corpus;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
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
    /// Widths (d_model values) to train, comma-separated; the smallest is muP's base width.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub widths: Vec<usize>,
    /// Optimizer steps per width.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Folder for coord.csv and the SVG plots.
    #[arg(long, default_value = "coord-check")]
    pub out: PathBuf,
    /// Parametrizations to check.
    #[arg(long, value_enum, default_value = "both")]
    pub param: ParamArg,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let spec = load_spec(&args.spec)?;
    let params = match args.param {
        ParamArg::Sp => vec![CoordParam::Standard],
        ParamArg::Mup => vec![CoordParam::MuP],
        ParamArg::Both => vec![CoordParam::Standard, CoordParam::MuP],
    };
    // The largest width must fit this machine before anything trains.
    if let Some(&widest) = args.widths.iter().max() {
        let widest =
            runtime::coord::width_spec(&spec, widest, widest, CoordParam::Standard).context("--widths")?;
        super::fits_this_machine(&widest)?;
    }
    let corpus = Corpus::load(&spec.train.data, spec.train.val_fraction, spec.train.seq_len + 1)?;
    let mut checks = Vec::new();
    for param in params {
        let mut progress = |width: usize, step: usize| {
            eprint!("\r{} D={width}: step {step}/{}\x1b[K", param.name(), args.steps);
            let _ = std::io::stderr().flush();
        };
        let check = coord_check_on(&spec, &args.widths, args.steps, param, &corpus, &mut progress)
            .context("--widths");
        eprint!("\r\x1b[K");
        let check = check?;
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
