//! Progress on stderr: the one home of every progress display widen prints (training
//! steps, a sweep's runs, a long evaluation, the coordinate check, kernel compiles and
//! `widen build`'s cargo run).
//!
//! Two modes, chosen once from whether stderr is a terminal ([`Mode::of_stderr`]):
//!
//! - **Terminal**: one line redrawn in place (`\r` and erase-to-end), at most every
//!   [`REDRAW`], so a fast loop does not spend its time drawing; a line that must stay
//!   (an evaluation's result) ends with a newline.
//! - **Log** (a file, a pipe, a cluster's job log): plain lines only, no `\r` and no
//!   escape codes, and only at the points the caller marks as worth a line (every
//!   N-th step, each evaluation, each quarter of an evaluation) or, for a long wait with
//!   nothing to mark, at most every [`LOG_EVERY`], so a log never fills with progress.
//!
//! Hand-written rather than built on `indicatif`: every display here is a pure
//! function from (what happened, time elapsed) to the text to write ([`Line::update`],
//! [`StageLine::tick`]), which the tests check string for string in both modes; the
//! log mode is a rule of widen's own (marked events, not a redraw rate); and what
//! drawing needs beyond that is a `\r` and one escape code. The only thread is the
//! ticker of a [`Stage`], which shows time passing while a blocking call (the C
//! compiler, cargo) runs.
//!
//! Writing is best effort: a closed stderr must never stop training or a build.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How often a terminal line is redrawn at most.
pub const REDRAW: Duration = Duration::from_millis(250);
/// In a log, the longest a wait goes without a line (when nothing marks one sooner).
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// A stage that ends sooner shows nothing on a terminal (a log records every stage).
pub const STAGE_QUIET: Duration = Duration::from_secs(1);

/// Where progress goes: a terminal (redrawn in place) or a log (plain lines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Terminal,
    Log,
}

impl Mode {
    /// [`Mode::Terminal`] when stderr is a terminal.
    pub fn of_stderr() -> Mode {
        if std::io::stderr().is_terminal() {
            Mode::Terminal
        } else {
            Mode::Log
        }
    }
}

/// How much an update matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// Progress a terminal shows (throttled) and a log leaves out.
    Tick,
    /// A log gets a line too (every N-th step, a quarter of the batches, the last step).
    Line,
    /// The line stays on a terminal as well (an evaluation's result).
    Keep,
}

/// One progress line: what to write for each update, in either mode.
#[derive(Debug)]
pub struct Line {
    mode: Mode,
    /// When the terminal line was last drawn.
    drawn: Option<Duration>,
    /// Whether a terminal line is open (drawn without a newline).
    open: bool,
}

impl Line {
    pub fn new(mode: Mode) -> Line {
        Line { mode, drawn: None, open: false }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// What to write for progress `text` at `elapsed`, marked `mark`; `None` when
    /// nothing is due.
    pub fn update(&mut self, text: &str, elapsed: Duration, mark: Mark) -> Option<String> {
        match self.mode {
            Mode::Terminal => {
                let due = self.drawn.is_none_or(|t| elapsed >= t + REDRAW);
                if mark == Mark::Tick && !due {
                    return None;
                }
                self.drawn = Some(elapsed);
                self.open = mark != Mark::Keep;
                let end = if mark == Mark::Keep { "\n" } else { "" };
                Some(format!("\r{text}\x1b[K{end}"))
            }
            Mode::Log => (mark != Mark::Tick).then(|| format!("{text}\n")),
        }
    }

    /// What ends an open terminal line, so later messages start on a fresh line:
    /// erased when `erase`, else kept with a newline.
    pub fn finish(&mut self, erase: bool) -> Option<String> {
        if !std::mem::take(&mut self.open) {
            return None;
        }
        Some(if erase { "\r\x1b[K".into() } else { "\n".into() })
    }

    /// [`Line::update`], written to stderr.
    pub fn show(&mut self, text: &str, elapsed: Duration, mark: Mark) {
        if let Some(out) = self.update(text, elapsed, mark) {
            write_stderr(&out);
        }
    }

    /// [`Line::finish`], written to stderr.
    pub fn end(&mut self, erase: bool) {
        if let Some(out) = self.finish(erase) {
            write_stderr(&out);
        }
    }

    /// Writes a message of its own (a note, a run's result) on a fresh line.
    pub fn say(&mut self, message: &str) {
        self.end(false);
        write_stderr(&format!("{message}\n"));
    }
}

/// Writes `text` to stderr and flushes, ignoring failures (see the module doc).
pub fn write_stderr(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes());
    let _ = err.flush();
}

/// `42s`, `3m04s` or `2h05m`.
pub fn clock(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// The time left when `done` of `total` units took `elapsed`, at the same rate;
/// `None` before the first unit.
pub fn eta(elapsed: Duration, done: f64, total: f64) -> Option<Duration> {
    (done > 0.0 && done.is_finite() && total.is_finite())
        .then(|| elapsed.mul_f64(((total - done) / done).max(0.0)))
        .filter(|d| d.as_secs_f64().is_finite())
}

/// [`eta`] as text: a [`clock`], or `?` before the first unit.
pub fn eta_text(elapsed: Duration, done: f64, total: f64) -> String {
    eta(elapsed, done, total).map_or_else(|| "?".into(), clock)
}

/// The display of a stage: a wait on one blocking call whose length is unknown
/// (a compile), shown with its label, what it reports so far and the time it has
/// taken. A terminal gets nothing for the first [`STAGE_QUIET`], then a spinner line
/// redrawn every tick; a log gets a line at once and at most every [`LOG_EVERY`]
/// after (a log is read afterwards, so it says every stage, however short). At the
/// end, `label: done in 19.2s` when anything was shown.
#[derive(Debug)]
pub struct StageLine {
    label: String,
    line: Line,
    /// When a log line was last written.
    logged: Option<Duration>,
    ticks: usize,
}

impl StageLine {
    const SPINNER: [char; 4] = ['|', '/', '-', '\\'];

    pub fn new(mode: Mode, label: impl Into<String>) -> StageLine {
        StageLine { label: label.into(), line: Line::new(mode), logged: None, ticks: 0 }
    }

    /// What to write at `elapsed`, with `detail` the stage's report so far (may be empty).
    pub fn tick(&mut self, elapsed: Duration, detail: &str) -> Option<String> {
        if elapsed < STAGE_QUIET && self.line.mode == Mode::Terminal {
            return None;
        }
        let detail = if detail.is_empty() { String::new() } else { format!(": {detail}") };
        let text = format!("{}{detail}, {}", self.label, clock(elapsed));
        match self.line.mode {
            Mode::Terminal => {
                let spin = Self::SPINNER[self.ticks % Self::SPINNER.len()];
                self.ticks += 1;
                self.line.update(&format!("{spin} {text}"), elapsed, Mark::Tick)
            }
            Mode::Log => {
                if self.logged.is_some_and(|t| elapsed < t + LOG_EVERY) {
                    return None;
                }
                self.logged = Some(elapsed);
                self.line.update(&text, elapsed, Mark::Line)
            }
        }
    }

    /// What to write when the stage ends at `elapsed`: nothing if nothing was shown.
    pub fn finish(&mut self, elapsed: Duration) -> Option<String> {
        let shown = self.line.drawn.is_some() || self.logged.is_some();
        if !shown {
            return None;
        }
        let erase = self.line.finish(true).unwrap_or_default();
        Some(format!("{erase}{}: done in {:.1}s\n", self.label, elapsed.as_secs_f64()))
    }
}

/// A stage shown on stderr while the caller blocks: a ticker thread draws its
/// [`StageLine`] until the `Stage` is dropped. [`Stage::detail`] updates what it says.
pub struct Stage {
    shared: Arc<(Mutex<StageState>, Condvar)>,
    ticker: Option<std::thread::JoinHandle<()>>,
}

struct StageState {
    detail: String,
    done: bool,
}

impl Stage {
    /// Starts showing `label` on stderr, in the mode stderr calls for.
    pub fn start(label: impl Into<String>) -> Stage {
        Stage::start_in(Mode::of_stderr(), label)
    }

    pub fn start_in(mode: Mode, label: impl Into<String>) -> Stage {
        let shared =
            Arc::new((Mutex::new(StageState { detail: String::new(), done: false }), Condvar::new()));
        let theirs = Arc::clone(&shared);
        let mut display = StageLine::new(mode, label);
        let started = Instant::now();
        let ticker = std::thread::Builder::new()
            .name("widen-progress".into())
            .spawn(move || {
                let (state, wake) = &*theirs;
                let Ok(mut guard) = state.lock() else { return };
                loop {
                    if guard.done {
                        break;
                    }
                    if let Some(out) = display.tick(started.elapsed(), &guard.detail) {
                        write_stderr(&out);
                    }
                    match wake.wait_timeout(guard, REDRAW) {
                        Ok((g, _)) => guard = g,
                        Err(_) => return,
                    }
                }
                if let Some(out) = display.finish(started.elapsed()) {
                    write_stderr(&out);
                }
            })
            .ok();
        Stage { shared, ticker }
    }

    /// What the stage has got to (`12 crates built, last: gemm`).
    pub fn detail(&self, text: impl Into<String>) {
        if let Ok(mut state) = self.shared.0.lock() {
            state.detail = text.into();
        }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let Ok(mut state) = self.shared.0.lock() {
            state.done = true;
        }
        self.shared.1.notify_all();
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

/// Shows every C compile of kernels on stderr as a [`Stage`] (`compiling 37 kernels
/// for cpu, 12s`): installed by the commands that train or evaluate, so that the
/// wait for a cold kernel cache is never silent. A cached build shows nothing.
pub fn show_compiles() {
    codegen::cc::observe_compiles(|notice: &codegen::cc::CompileNotice| {
        let what = match notice.kernels {
            Some(n) => format!("compiling {n} kernel{} for cpu", if n == 1 { "" } else { "s" }),
            None => "compiling kernels".into(),
        };
        Box::new(Stage::start(format!("{what} with {}", notice.compiler)))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn a_terminal_line_is_redrawn_at_most_every_redraw_and_kept_lines_end_with_a_newline() {
        let mut line = Line::new(Mode::Terminal);
        let shown: Vec<String> =
            (0..100).filter_map(|i| line.update(&format!("step {i}"), ms(i * 10), Mark::Tick)).collect();
        // 1 s of updates every 10 ms: drawn at 0, 250, 500, 750 ms.
        assert_eq!(shown, ["\rstep 0\x1b[K", "\rstep 25\x1b[K", "\rstep 50\x1b[K", "\rstep 75\x1b[K"]);
        assert_eq!(line.update("val", ms(1001), Mark::Keep).as_deref(), Some("\rval\x1b[K\n"));
        assert_eq!(line.finish(false), None, "a kept line is closed already");
        line.update("step 101", ms(2000), Mark::Tick);
        assert_eq!(line.finish(true).as_deref(), Some("\r\x1b[K"));
    }

    #[test]
    fn a_log_gets_plain_lines_only_at_marked_updates() {
        let mut line = Line::new(Mode::Log);
        let mut out = Vec::new();
        for i in 1..=100u64 {
            let mark = if i % 25 == 0 { Mark::Line } else { Mark::Tick };
            out.extend(line.update(&format!("step {i}"), ms(i), mark));
        }
        out.extend(line.update("val", ms(101), Mark::Keep));
        assert_eq!(out, ["step 25\n", "step 50\n", "step 75\n", "step 100\n", "val\n"]);
        assert!(out.iter().all(|l| !l.contains('\r') && !l.contains('\x1b')));
        assert_eq!(line.finish(true), None);
    }

    #[test]
    fn a_short_stage_shows_nothing_on_a_terminal_and_two_lines_in_a_log() {
        let mut stage = StageLine::new(Mode::Terminal, "compiling 3 kernels for cpu");
        let shown: Vec<_> = (0..4).filter_map(|i| stage.tick(ms(i * 250), "")).collect();
        assert!(shown.is_empty(), "{shown:?}");
        assert_eq!(stage.finish(ms(999)), None);
        let mut stage = StageLine::new(Mode::Log, "compiling 3 kernels for cpu");
        let mut shown: Vec<_> = (0..4).filter_map(|i| stage.tick(ms(i * 250), "")).collect();
        shown.extend(stage.finish(ms(999)));
        assert_eq!(
            shown,
            ["compiling 3 kernels for cpu, 0s\n", "compiling 3 kernels for cpu: done in 1.0s\n"]
        );
    }

    #[test]
    fn a_stage_in_a_log_prints_a_line_at_most_every_ten_seconds_and_when_done() {
        let mut stage = StageLine::new(Mode::Log, "building");
        // Ticks every 250 ms for 25 s.
        let shown: Vec<String> = (0..100).filter_map(|i| stage.tick(ms(i * 250), "3 crates built")).collect();
        assert_eq!(
            shown,
            [
                "building: 3 crates built, 0s\n",
                "building: 3 crates built, 10s\n",
                "building: 3 crates built, 20s\n"
            ]
        );
        assert_eq!(stage.finish(ms(25_000)).as_deref(), Some("building: done in 25.0s\n"));
    }

    #[test]
    fn a_stage_on_a_terminal_spins_with_elapsed_time_and_is_replaced_by_its_result() {
        let mut stage = StageLine::new(Mode::Terminal, "compiling 37 kernels for cpu");
        assert_eq!(stage.tick(ms(500), ""), None, "quiet for the first second");
        assert_eq!(stage.tick(ms(1000), "").as_deref(), Some("\r| compiling 37 kernels for cpu, 1s\x1b[K"));
        assert_eq!(stage.tick(ms(1250), "").as_deref(), Some("\r/ compiling 37 kernels for cpu, 1s\x1b[K"));
        assert_eq!(
            stage.finish(ms(19_240)).as_deref(),
            Some("\r\x1b[Kcompiling 37 kernels for cpu: done in 19.2s\n")
        );
    }

    #[test]
    fn a_stage_thread_stops_when_dropped() {
        let stage = Stage::start_in(Mode::Log, "nothing");
        stage.detail("half");
        let started = Instant::now();
        drop(stage);
        assert!(started.elapsed() < Duration::from_secs(1), "the ticker is woken, not waited out");
    }

    #[test]
    fn clock_and_eta_read_as_seconds_minutes_or_hours() {
        assert_eq!(clock(Duration::from_secs_f64(59.4)), "59s");
        assert_eq!(clock(Duration::from_secs(184)), "3m04s");
        assert_eq!(clock(Duration::from_secs(7500)), "2h05m");
        assert_eq!(eta_text(Duration::from_secs(10), 25.0, 100.0), "30s");
        assert_eq!(eta_text(Duration::from_secs(10), 0.0, 100.0), "?");
        assert_eq!(eta(Duration::from_secs(10), 100.0, 100.0), Some(Duration::ZERO));
    }
}
