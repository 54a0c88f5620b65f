//! `widen eval`: a checkpoint's validation loss, and a dump of one batch's
//! logits, loss and gradients for comparison with another implementation
//! (`runtime::eval`, docs/checkpoints.md).
//!
//! The results go to stdout; notes about the data and the progress of a long
//! evaluation go to stderr, so stdout stays the same for scripts.

use super::train::DeviceArg;
use anyhow::Context;
use runtime::eval::{evaluate_with_progress, EvalOptions};
use runtime::progress::{clock, eta_text, write_stderr, Line, Mark, Mode};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint written by `widen train` (its header holds the spec).
    pub checkpoint: PathBuf,
    /// Evaluate on this data instead of the checkpoint's: token shards (a glob, or a
    /// file with an llm.c header) or a byte-level text file (without it, the
    /// checkpoint's data must hold the content the run trained on).
    #[arg(long, value_name = "PATH_OR_GLOB")]
    pub data: Option<String>,
    /// Score this many batches of random validation windows, 1..=100000 like
    /// train.eval_batches [default: what training scored: train.val_tokens in order
    /// when the spec sets it, else train.eval_batches random batches].
    #[arg(long, value_parser = batches_parser())]
    pub batches: Option<u64>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Write the first validation batch, its logits, loss and every gradient as
    /// safetensors files into this folder.
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Let --dump replace the dump files already in its folder.
    #[arg(long, requires = "dump")]
    pub force: bool,
}

/// `--batches`: the range of the spec's `train.eval_batches` (`runtime::eval::max_batches`).
fn batches_parser() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=runtime::eval::max_batches() as u64)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let opts = EvalOptions {
        data: args.data.clone(),
        batches: args.batches.map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
        dump: args.dump.clone(),
        force: args.force,
    };
    runtime::progress::show_compiles();
    let mut progress = ProgressLine::new(std::io::stderr().is_terminal());
    let started = Instant::now();
    let result = evaluate_with_progress(&args.checkpoint, args.device.into(), &opts, &mut |done, total| {
        if let Some(text) = progress.update(done, total, started.elapsed()) {
            write_stderr(&text);
        }
    });
    if let Some(text) = progress.finish() {
        eprint!("{text}");
    }
    let report = result.with_context(|| format!("evaluating {}", args.checkpoint.display()))?;
    for note in &report.notes {
        eprintln!("note: {note}");
    }
    let [batch, window] = report.token_shape;
    println!("checkpoint {} (step {})", args.checkpoint.display(), report.step);
    println!("data {}", report.data.describe());
    println!("validation batches {} of {batch} x {}", report.batches, window - 1);
    println!("val_loss {:.6} nats/token over {} tokens", report.val_loss(), report.validation.targets);
    match report.bits_per_byte() {
        Some(bpb) => println!("bits_per_byte {bpb:.6}"),
        None => println!("bits_per_byte unknown (the tokenizer behind the ids is not recorded)"),
    }
    for path in &report.dumped {
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The progress of a long evaluation on stderr ([`runtime::progress`]). Nothing is
/// shown for the first [`ProgressLine::QUIET`] (most evaluations end before); then a
/// terminal gets one line refreshed in place, and anything else (a log file) one line
/// at each quarter of the batches, so a log never fills with progress.
struct ProgressLine {
    line: Line,
    /// Quarters of the batches already reached.
    quarters: usize,
}

impl ProgressLine {
    /// How long an evaluation runs before its progress is shown.
    const QUIET: Duration = Duration::from_secs(2);

    fn new(terminal: bool) -> Self {
        ProgressLine { line: Line::new(if terminal { Mode::Terminal } else { Mode::Log }), quarters: 0 }
    }

    /// What to write to stderr after `done` of `total` batches, `elapsed` in.
    fn update(&mut self, done: usize, total: usize, elapsed: Duration) -> Option<String> {
        if done >= total || elapsed < Self::QUIET {
            return None;
        }
        let text = format!(
            "eval: batch {done}/{total}, {} elapsed, about {} left",
            clock(elapsed),
            eta_text(elapsed, done as f64, total as f64)
        );
        let quarter = done * 4 / total.max(1);
        let mark = if quarter > self.quarters { Mark::Line } else { Mark::Tick };
        self.quarters = self.quarters.max(quarter);
        self.line.update(&text, elapsed, mark)
    }

    /// What clears the terminal line at the end, if one was drawn.
    fn finish(&mut self) -> Option<String> {
        self.line.finish(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: usize) -> Duration {
        Duration::from_millis(ms as u64)
    }

    #[test]
    fn a_short_evaluation_shows_no_progress() {
        for terminal in [true, false] {
            let mut p = ProgressLine::new(terminal);
            let shown: Vec<_> = (1..=1000).filter_map(|done| p.update(done, 1000, ms(done))).collect();
            assert!(shown.is_empty(), "{shown:?}");
            assert_eq!(p.finish(), None);
        }
    }

    #[test]
    fn a_log_gets_at_most_a_line_per_quarter_with_counts_elapsed_and_eta() {
        let mut p = ProgressLine::new(false);
        // 10 000 batches at 10 ms each: 100 s.
        let shown: Vec<String> =
            (1..=10_000).filter_map(|done| p.update(done, 10_000, ms(done * 10))).collect();
        assert_eq!(
            shown,
            [
                "eval: batch 2500/10000, 25s elapsed, about 1m15s left\n",
                "eval: batch 5000/10000, 50s elapsed, about 50s left\n",
                "eval: batch 7500/10000, 1m15s elapsed, about 25s left\n",
            ]
        );
        assert_eq!(p.finish(), None, "no line to clear in a log");
    }

    #[test]
    fn a_terminal_line_is_redrawn_at_most_four_times_a_second_and_cleared() {
        let mut p = ProgressLine::new(true);
        let shown: Vec<String> = (1..=1000).filter_map(|done| p.update(done, 1000, ms(done * 10))).collect();
        // Drawn from 2 s to the end (10 s) every 250 ms.
        assert_eq!(shown.len(), 32, "{shown:?}");
        assert_eq!(shown[0], "\reval: batch 200/1000, 2s elapsed, about 8s left\x1b[K");
        assert_eq!(p.finish().as_deref(), Some("\r\x1b[K"));
        assert_eq!(p.finish(), None, "cleared once");
    }
}
