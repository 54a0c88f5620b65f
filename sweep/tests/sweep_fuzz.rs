//! Fuzzing the sweep front end (docs/sweeps.md, Limits): any sweep file or any
//! `--set/--seeds/--budget` arguments in, a `Result` out; never a panic, a hang, an
//! abort, more than a bounded amount of memory, or a message in a parser's words.
//!
//! Each input goes through what `widen sweep --dry-run` does: a sweep file (`*.ron`)
//! through [`Sweep::parse`], or CLI arguments (`*.args`: lines `set PATH=V1,V2`,
//! `seeds ARG`, `budget ARG`, and optionally `base MODEL`, the spec the CLI loads and
//! validates) through [`Sweep::from_cli`]; then the expansion into points
//! ([`expand_within`], with the memory check against [`FUZZ_MACHINE_BYTES`], a small
//! machine, as `widen check` checks a spec against the host). A plan must hold only
//! valid specs that read back from the JSON the sweep folder's `plan.json` is written
//! in.
//!
//! Two parts, as in the spec fuzz target (`ir/tests/spec_fuzz.rs`):
//! - `corpus_replays_cleanly` replays every file of `tests/fuzz-corpus/`: valid sweeps
//!   and the hostile inputs (huge seed counts, huge axis products, NaN and infinite
//!   values, deep nesting, budgets past `u64`, numbers given to enum fields, axes that
//!   do nothing, equal points, a model too large for the machine, ...). A failing
//!   input found by the mutation run belongs there once fixed.
//! - `mutations_never_panic` mutates corpus files with proptest for
//!   `WIDEN_SWEEP_FUZZ_SECS` seconds (default 20, so CI stays bounded; raise it
//!   locally). The corpus bases are tiny models, so each case lowers in milliseconds.
//!
//! A counting global allocator records the peak bytes of each case, which must stay
//! under [`PEAK_LIMIT`]; an allocation larger than the limit is refused, which aborts
//! the process, so the input being run is first written to
//! `$CARGO_TARGET_TMPDIR/sweep-fuzz-current` to be found after a crash.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ir::spec::{parse_spec, ModelSpec};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sweep::file::{MAX_RUNS, MAX_SEEDS};
use sweep::point::expand_within;
use sweep::Sweep;

/// Peak heap of one case, above what the process held before it.
const PEAK_LIMIT: usize = 256 << 20;

/// The machine the fuzzed points are checked against before the cost model lowers them.
const FUZZ_MACHINE_BYTES: u64 = 64 << 20;

/// The spec `*.args` cases start from unless they give a `base` line.
const TINY: &str = "Model(d_model: 32, heads: 2, layers: 1, residual: Ghc(m: 2, n: 4), \
                    train: (batch: 2, seq_len: 16, schedule: Constant()))";

/// Words of parser internals that no message may show.
const INTERNALS: &[&str] =
    &["serde_stacker", "recursion_limit", "raw identifier", "invalid type: null", "ron::", "serde"];

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the same layout and pointer; the
// counters are only statistics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // Refuse (and so abort) rather than let one request take the machine down.
        if layout.size() > 4 * PEAK_LIMIT {
            return std::ptr::null_mut();
        }
        let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Cases run one at a time, so the peak belongs to one input.
static SERIAL: Mutex<()> = Mutex::new(());

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus")
}

/// Which front end a corpus file feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Args,
}

fn corpus() -> Vec<(String, Kind, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("tests/fuzz-corpus exists")
        .map(|e| e.expect("readable entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .filter_map(|p| {
            let kind = match p.extension()?.to_str()? {
                "ron" => Kind::File,
                "args" => Kind::Args,
                // `tiny.spec`: a base the sweep files name by path.
                _ => return None,
            };
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            Some((name, kind, std::fs::read(&p).expect("readable corpus file")))
        })
        .collect()
}

/// What happened to one input.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The CLI's base spec does not load (`widen sweep` stops there, before the sweep).
    BadBase,
    /// `Sweep::parse` or `Sweep::from_cli` refused it.
    Refused,
    /// The expansion refused it.
    ExpandError,
    Planned,
}

fn assert_plain(message: &str) {
    assert!(!message.is_empty());
    for word in INTERNALS {
        assert!(!message.contains(word), "a message shows parser internals (`{word}`): {message}");
    }
}

/// A CLI case: the arguments of its lines.
fn cli_sweep(text: &str) -> Option<Result<Sweep, sweep::SweepError>> {
    let (mut base, mut sets, mut seeds, mut budget) = (TINY.to_string(), Vec::new(), "1", "steps=10");
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("base", b)) => base = b.to_string(),
            Some(("set", s)) => sets.push(s.to_string()),
            Some(("seeds", s)) => seeds = s,
            Some(("budget", b)) => budget = b,
            _ => {}
        }
    }
    // `widen sweep SPEC --set ...` loads the spec with `load_spec`: parsed and validated.
    let base = parse_spec(&base, "base.ron").ok().filter(|b| b.validate().is_ok())?;
    Some(Sweep::from_cli(base, "base.ron", &sets, seeds, budget))
}

/// The front end on one input; panics on a broken invariant.
fn front_end(kind: Kind, bytes: &[u8]) -> Outcome {
    let text = String::from_utf8_lossy(bytes);
    let built = match kind {
        // Base paths resolve in the corpus folder (`tiny.spec`); nothing else is there.
        Kind::File => Sweep::parse(&text, "fuzz.ron", &corpus_dir()),
        Kind::Args => match cli_sweep(&text) {
            Some(built) => built,
            None => return Outcome::BadBase,
        },
    };
    let sweep = match built {
        Ok(sweep) => sweep,
        Err(e) => {
            assert_plain(&e.to_string());
            return Outcome::Refused;
        }
    };
    assert!(sweep.seeds.len() <= MAX_SEEDS);
    let plan = match expand_within(&sweep, Some(FUZZ_MACHINE_BYTES)) {
        Ok(plan) => plan,
        Err(e) => {
            assert_plain(&e.to_string());
            return Outcome::ExpandError;
        }
    };
    assert!(!plan.points.is_empty());
    assert!(plan.runs().count() <= MAX_RUNS);
    let mut names = HashSet::new();
    for p in &plan.points {
        assert!(names.insert(p.name.clone()), "two points named {}", p.name);
        p.spec.validate().unwrap_or_else(|e| panic!("point {} is invalid: {e:?}", p.name));
        assert_eq!(p.spec.train.steps, p.budget.steps);
        assert_eq!(p.runs.len(), sweep.seeds.len());
        for r in &p.runs {
            assert_eq!(r.spec.train.seed, r.seed);
        }
        // `plan.json` holds each spec as JSON; a valid spec reads back unchanged.
        let json = serde_json::to_string(&p.spec).expect("a spec serializes");
        let back: ModelSpec = serde_json::from_str(&json).expect("a spec reads back");
        assert_eq!(back, p.spec, "point {} changes through JSON", p.name);
    }
    for bad in &plan.invalid {
        assert_plain(&bad.to_string());
    }
    Outcome::Planned
}

/// Runs one input under the allocation counter; `Err` names the failure.
fn run_case(kind: Kind, bytes: &[u8]) -> Result<Outcome, String> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sweep-fuzz-current");
    // Best effort: only read after a crash.
    let _ = std::fs::write(&scratch, bytes);
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let outcome = catch_unwind(AssertUnwindSafe(|| front_end(kind, bytes)));
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    match outcome {
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {message}"))
        }
        Ok(_) if peak > PEAK_LIMIT => Err(format!("peak allocation {peak} bytes > {PEAK_LIMIT}")),
        Ok(outcome) => Ok(outcome),
    }
}

fn shown(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut s: String = text.chars().take(600).collect();
    if s.len() < text.len() {
        s.push_str("...");
    }
    s
}

#[test]
fn corpus_replays_cleanly() {
    let files = corpus();
    assert!(files.len() >= 40, "the corpus holds valid sweeps and the hostile inputs");
    let mut failures = Vec::new();
    let mut planned = Vec::new();
    for (name, kind, bytes) in &files {
        let start = Instant::now();
        match run_case(*kind, bytes) {
            Ok(Outcome::Planned) => planned.push(name.as_str()),
            Ok(_) => {}
            Err(why) => failures.push(format!("{name}: {why}")),
        }
        if start.elapsed() > Duration::from_secs(5) {
            failures.push(format!("{name}: took {:?}", start.elapsed()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The valid sweeps get through to a plan (`skip-*`: with their invalid points
    // skipped); the hostile ones are refused, not planned.
    for (name, _, _) in &files {
        let valid = name.starts_with("valid-")
            || name.starts_with("skip-")
            || name == "cli-valid.args"
            || name == "cli-ratio.args";
        assert_eq!(planned.contains(&name.as_str()), valid, "{name}: planned {planned:?}");
    }
}

/// Values a number is replaced with.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "2.5",
    "1e-400",
    "1e400",
    "NaN",
    "inf",
    "-inf",
    "0x20",
    "1000",
    "1001",
    "10000",
    "100000000",
    "100000001",
    "1e12",
    "1000000000000",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999999",
    "1_000",
];

/// Text a field name, an axis path or a value is replaced with.
const WORDS: &[&str] = &[
    "seeds",
    "budget",
    "axes",
    "base",
    "combine",
    "baseline",
    "on_invalid",
    "\"train.steps\"",
    "\"train.seed\"",
    "\"residual.r\"",
    "\"residual\"",
    "\"residual.nn\"",
    "\"d_model\"",
    "GroupNorm",
    "Residual",
    "Ghc(m: 2, n: 8)",
    "Some(NaN)",
    "Zip",
    "Steps(5)",
    "Tokens(1e6)",
    "Flops(inf)",
    "r#x",
    "名前",
];

/// One edit of the input bytes; positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        byte: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Truncate {
        at: usize,
    },
    Number {
        which: usize,
        value: usize,
    },
    Word {
        which: usize,
        word: usize,
    },
    Nest {
        at: usize,
        depth: usize,
    },
    /// Repeat a byte range, as more axis values, seeds or axes.
    Repeat {
        at: usize,
        len: usize,
        times: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Flip { at, byte }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1usize..40).prop_map(|(at, len)| Mutation::Delete { at, len }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (any::<usize>(), 0..NUMBERS.len()).prop_map(|(which, value)| Mutation::Number { which, value }),
        (any::<usize>(), 0..WORDS.len()).prop_map(|(which, word)| Mutation::Word { which, word }),
        (any::<usize>(), 1usize..300).prop_map(|(at, depth)| Mutation::Nest { at, depth }),
        (any::<usize>(), 1usize..12, 1usize..40).prop_map(|(at, len, times)| Mutation::Repeat {
            at,
            len,
            times
        }),
    ]
}

/// Byte ranges of the numbers in `text` (a digit run with sign, dot, exponent, `_`).
fn number_spans(text: &[u8]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let starts_word = i == 0 || !(text[i - 1].is_ascii_alphanumeric() || text[i - 1] == b'_');
        if text[i].is_ascii_digit() && starts_word {
            let start = if i > 0 && text[i - 1] == b'-' { i - 1 } else { i };
            let mut end = i;
            while end < text.len() && (text[end].is_ascii_alphanumeric() || matches!(text[end], b'.' | b'_'))
            {
                end += 1;
            }
            spans.push((start, end));
            i = end;
        } else {
            i += 1;
        }
    }
    spans
}

/// Byte ranges of identifiers and quoted strings (field names, axis paths, variants).
fn word_spans(text: &[u8]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'"' {
            let start = i;
            i += 1;
            while i < text.len() && text[i] != b'"' {
                i += 1;
            }
            i = (i + 1).min(text.len());
            spans.push((start, i));
        } else if text[i].is_ascii_alphabetic() || text[i] == b'_' {
            let start = i;
            while i < text.len() && (text[i].is_ascii_alphanumeric() || text[i] == b'_') {
                i += 1;
            }
            spans.push((start, i));
        } else {
            i += 1;
        }
    }
    spans
}

fn splice(bytes: &mut Vec<u8>, (start, end): (usize, usize), with: &[u8]) {
    bytes.splice(start..end, with.iter().copied());
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len();
    let pos = |at: usize| if len == 0 { 0 } else { at % (len + 1) };
    match m {
        Mutation::Flip { at, byte } => {
            if len > 0 {
                bytes[at % len] = *byte;
            }
        }
        Mutation::Insert { at, bytes: new } => splice(bytes, (pos(*at), pos(*at)), new),
        Mutation::Delete { at, len: n } => {
            let start = pos(*at);
            let end = (start + n).min(len);
            bytes.drain(start..end);
        }
        Mutation::Truncate { at } => bytes.truncate(pos(*at)),
        Mutation::Number { which, value } => {
            let spans = number_spans(bytes);
            if !spans.is_empty() {
                splice(bytes, spans[which % spans.len()], NUMBERS[*value].as_bytes());
            }
        }
        Mutation::Word { which, word } => {
            let spans = word_spans(bytes);
            if !spans.is_empty() {
                splice(bytes, spans[which % spans.len()], WORDS[*word].as_bytes());
            }
        }
        Mutation::Nest { at, depth } => {
            let at = pos(*at);
            let mut nested = "(".repeat(*depth).into_bytes();
            nested.extend(")".repeat(*depth).into_bytes());
            splice(bytes, (at, at), &nested);
        }
        Mutation::Repeat { at, len: n, times } => {
            let start = pos(*at);
            let end = (start + n).min(len);
            let piece = bytes[start..end].to_vec();
            let copies: Vec<u8> = std::iter::repeat_n(piece, *times).flatten().collect();
            splice(bytes, (end, end), &copies);
        }
    }
}

fn fuzz_duration() -> Duration {
    let secs = std::env::var("WIDEN_SWEEP_FUZZ_SECS").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(20);
    Duration::from_secs(secs)
}

#[test]
fn mutations_never_panic() {
    // The large inputs (long axes, deep nesting) are replayed above and would only slow this down.
    let seeds: Vec<(Kind, Vec<u8>)> =
        corpus().into_iter().map(|(_, k, b)| (k, b)).filter(|(_, b)| b.len() <= 4096).collect();
    let strategy = (0..seeds.len(), prop::collection::vec(mutation(), 1..5));
    let deadline = Instant::now() + fuzz_duration();
    let cases = std::cell::Cell::new(0u64);
    let outcomes = std::cell::RefCell::new(std::collections::BTreeMap::<String, u64>::new());
    let mut round = 0u32;
    while Instant::now() < deadline {
        // Fresh seeds each round (deterministic per round, so a failure reproduces).
        let config = Config { cases: 32, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new_with_rng(
            config,
            proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha,
                &[round.to_le_bytes(), [11; 4], [0; 4], [0; 4], [0; 4], [0; 4], [0; 4], [0; 4]].concat(),
            ),
        );
        let result = runner.run(&strategy, |(seed, mutations)| {
            let (kind, mut bytes) = seeds[seed].clone();
            for m in &mutations {
                apply(&mut bytes, m);
            }
            let start = Instant::now();
            let outcome = run_case(kind, &bytes);
            if start.elapsed() > Duration::from_secs(5) {
                return Err(TestCaseError::fail(format!(
                    "took {:?}\ninput:\n{}",
                    start.elapsed(),
                    shown(&bytes)
                )));
            }
            match outcome {
                Ok(outcome) => {
                    *outcomes.borrow_mut().entry(format!("{kind:?} {outcome:?}")).or_default() += 1;
                    cases.set(cases.get() + 1);
                    Ok(())
                }
                Err(why) => Err(TestCaseError::fail(format!("{why}\ninput ({kind:?}):\n{}", shown(&bytes)))),
            }
        });
        if let Err(e) = result {
            panic!("round {round}: {e}");
        }
        round += 1;
    }
    eprintln!("sweep fuzz: {} cases in {round} rounds: {:?}", cases.get(), outcomes.borrow());
    assert!(cases.get() > 0);
}

#[test]
fn mutations_apply_where_meant() {
    let mut b = br#"Sweep(seeds: 3, axes: {"d_model": [32]})"#.to_vec();
    apply(&mut b, &Mutation::Number { which: 0, value: 16 });
    assert_eq!(
        String::from_utf8(b.clone()).unwrap(),
        r#"Sweep(seeds: 1000000000000, axes: {"d_model": [32]})"#
    );
    apply(&mut b, &Mutation::Word { which: 3, word: 7 });
    assert_eq!(
        String::from_utf8(b.clone()).unwrap(),
        r#"Sweep(seeds: 1000000000000, axes: {"train.steps": [32]})"#
    );
    let mut b = b"[1, ]".to_vec();
    apply(&mut b, &Mutation::Repeat { at: 1, len: 3, times: 2 });
    assert_eq!(String::from_utf8(b).unwrap(), "[1, 1, 1, ]");
}
