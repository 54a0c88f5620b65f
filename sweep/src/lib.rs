//! widen's configuration sweeps: the data and the arithmetic behind `widen sweep`.
//!
//! A sweep asks one question of many models: at equal tokens (or equal training
//! FLOPs), how does loss move with a spec field such as the virtual width r, the
//! stream count n or the MTP depth, and is it worth the overhead? This crate holds
//! everything about a sweep:
//!
//! - [`file`]: the sweep as data: a RON sweep file, or the CLI shorthand
//!   (`--set residual.n=4,8,16 --seeds 3 --budget flops=2e14`).
//! - [`point`]: setting spec field paths on a base spec, naming points, and the
//!   expansion into validated (point, seed) runs with their folders.
//! - [`budget`]: steps per point from a token, FLOP or step budget (the cost model
//!   gives the training FLOPs per token).
//! - [`fit`] and [`frontier`]: the log-linear law `L = a + b·log2(x)` of
//!   docs/math.md §5 with standard errors, and the loss-vs-compute frontier.
//! - [`results`]: per-point results aggregated over seeds, written as
//!   `results.csv` and `results.json`.
//! - [`stats`]: whether a difference is real: paired (by seed) and Welch t-tests,
//!   95% confidence intervals and p-values.
//! - [`plot`]: the four SVG plots, drawn with `plotters` from plain data structs.
//! - [`coord_plot`]: the muP coordinate-check plot (activation RMS against width).
//!
//! - [`folder`]: the sweep folder on disk: file names, locks, atomic writes,
//!   outcomes and `plan.json` checked when read.
//! - [`runner`]: training every (point, seed) run into its own folder, resuming an
//!   interrupted sweep, joining a rerun with the folder's earlier runs, recording
//!   failures ([`Sweep::run`]).
//! - [`report`]: results and plots from a folder, after every run and for
//!   `widen report` ([`report()`]).

pub mod budget;
pub mod coord_plot;
pub mod file;
pub mod fit;
pub mod folder;
pub mod frontier;
pub mod plot;
pub mod point;
pub mod report;
pub mod results;
pub mod runner;
pub mod stats;

pub use budget::{Budget, BudgetError, BudgetPlan};
pub use file::{Axis, Combine, OnInvalid, Sweep, SweepError};
pub use fit::{FitError, LinearFit};
pub use folder::{DataRecord, FolderError, PlanFile};
pub use point::{
    apply_sets, expand, parse_set, ExpandError, Expansion, InvalidPoint, Point, PointError, Run,
};
pub use report::{report, SweepReport};
pub use results::{PointResult, RunMetrics, RunOutcome, Stat, Status};
pub use runner::{SweepOptions, SweepRunError};
