//! Fuzzing the spec front end (README, "What widen guarantees"): any bytes in, a `Result` out; never a
//! panic, an abort, or more than a bounded amount of memory.
//!
//! Each input goes through what `widen check` does: UTF-8 decoding (as `load_spec`
//! reads the file), [`parse_spec`], [`ModelSpec::validate`], then for a valid spec the
//! machine check [`ModelSpec::check_fits`] (here against [`FUZZ_MACHINE_BYTES`], a
//! small machine) and, when that passes, the cost report and the fused traffic that
//! `widen check` prints, and the RON round trip of checkpoint headers.
//!
//! Two parts:
//! - `corpus_replays_cleanly` replays every file of `tests/fuzz-corpus/` (every spec of
//!   `specs/` plus the nasty inputs the issue names: huge sizes and loop counts, deep
//!   nesting, a byte-order mark, non-ASCII names, negative and fractional sizes, ...).
//!   A failing input found by the mutation run belongs there once fixed.
//! - `mutations_never_panic` mutates corpus files with proptest (byte flips,
//!   insertions, deletions, truncation, numbers replaced by huge, negative, fractional
//!   and non-finite values, field names replaced by random, valid and non-ASCII ones)
//!   for `WIDEN_FUZZ_SECS` seconds (default 40, so CI stays bounded; raise it locally).
//!
//! A counting global allocator records the peak bytes of each case, which must stay
//! under [`PEAK_LIMIT`]; an allocation larger than the limit is refused, which aborts
//! the process, so the input being run is first written to
//! `$CARGO_TARGET_TMPDIR/spec-fuzz-current.ron` to be found after a crash.

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ir::cost::cost_report;
use ir::passes::fused_connection_traffic;
use ir::spec::parse_spec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Peak heap of one case, above what the process held before it.
const PEAK_LIMIT: usize = 256 << 20;

/// The machine the fuzzed specs are checked against before the cost report.
const FUZZ_MACHINE_BYTES: u64 = 64 << 20;

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

fn corpus() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("tests/fuzz-corpus exists")
        .map(|e| e.expect("readable entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("readable corpus file"))
        })
        .collect()
}

/// What happened to one input.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Not UTF-8, and a parse error once the bad bytes are replaced.
    NotUtf8,
    ParseError,
    Invalid,
    TooBigForMachine,
    Reported,
}

/// The front end on one input; panics on a broken invariant.
fn front_end(bytes: &[u8]) -> Outcome {
    // `load_spec` refuses bytes that are not UTF-8; the parser still sees the rest of
    // such an input, with the bad bytes replaced.
    let utf8 = std::str::from_utf8(bytes).is_ok();
    let text = String::from_utf8_lossy(bytes);
    let spec = match parse_spec(&text, "fuzz.ron") {
        Ok(spec) => spec,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return if utf8 { Outcome::ParseError } else { Outcome::NotUtf8 };
        }
    };
    if let Err(errors) = spec.validate() {
        assert!(!errors.is_empty());
        for e in &errors {
            assert!(!e.path.is_empty() && !e.message.is_empty(), "{e:?}");
        }
        return Outcome::Invalid;
    }
    if spec.check_fits(FUZZ_MACHINE_BYTES).is_err() {
        return Outcome::TooBigForMachine;
    }
    let report = cost_report(&spec).unwrap_or_else(|e| panic!("a valid spec lowers: {e}"));
    assert!(report.params.total > 0);
    fused_connection_traffic(&spec).unwrap_or_else(|e| panic!("fused traffic of a valid spec: {e}"));
    fused_connection_traffic(&spec.with_plain_residual()).expect("baseline fused traffic");
    let back = parse_spec(&spec.to_ron(), "round trip").expect("to_ron parses back");
    assert_eq!(back, spec, "to_ron round trips");
    Outcome::Reported
}

/// Runs one input under the allocation counter; `Err` names the failure.
fn run_case(bytes: &[u8]) -> Result<Outcome, String> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("spec-fuzz-current.ron");
    // Best effort: only read after a crash.
    let _ = std::fs::write(&scratch, bytes);
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let outcome = catch_unwind(AssertUnwindSafe(|| front_end(bytes)));
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
    assert!(files.len() >= 30, "the corpus holds the specs and the nasty inputs");
    let mut failures = Vec::new();
    let mut reported = 0;
    for (name, bytes) in &files {
        match run_case(bytes) {
            Ok(Outcome::Reported) => reported += 1,
            Ok(_) => {}
            Err(why) => failures.push(format!("{name}: {why}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Every spec of specs/ (copied in as spec-*.ron) gets through to the report.
    let specs = files.iter().filter(|(n, _)| n.starts_with("spec-")).count();
    assert!(specs > 0 && reported >= specs, "{reported} reported, {specs} specs");
}

/// Values a number is replaced with.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "-4",
    "2.5",
    "0.5",
    "-0.0",
    "1e99",
    "1e-320",
    "NaN",
    "inf",
    "-inf",
    "255",
    "257",
    "1024",
    "1025",
    "65536",
    "2147483648",
    "4294967296",
    "1099511627776",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999999",
    "0x10",
    "1_000",
];

/// Names a field name is replaced with: valid ones elsewhere (duplicates, misplaced
/// fields), typos, non-ASCII and junk.
const NAMES: &[&str] = &[
    "vocab",
    "name",
    "layers",
    "n",
    "m",
    "k",
    "depth",
    "seq_len",
    "batch",
    "sinkhorn_iters",
    "conv_kernels",
    "eval_batches",
    "vöcab",
    "名前",
    "r#vocab",
    "_",
    "a_very_long_field_name_that_does_not_exist_anywhere",
    "Model",
    "Some",
    "None",
];

/// One edit of the input bytes; positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, byte: u8 },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
    Truncate { at: usize },
    Number { which: usize, value: usize },
    FieldName { which: usize, name: usize },
    Nest { at: usize, depth: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Flip { at, byte }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1usize..40).prop_map(|(at, len)| Mutation::Delete { at, len }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (any::<usize>(), 0..NUMBERS.len()).prop_map(|(which, value)| Mutation::Number { which, value }),
        (any::<usize>(), 0..NAMES.len()).prop_map(|(which, name)| Mutation::FieldName { which, name }),
        (any::<usize>(), 1usize..300).prop_map(|(at, depth)| Mutation::Nest { at, depth }),
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

/// Byte ranges of identifiers directly followed by `:` (field names).
fn field_spans(text: &[u8]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < text.len() {
        if text[i].is_ascii_alphabetic() || text[i] == b'_' {
            let start = i;
            while i < text.len() && (text[i].is_ascii_alphanumeric() || text[i] == b'_') {
                i += 1;
            }
            if text.get(i) == Some(&b':') {
                spans.push((start, i));
            }
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
        Mutation::FieldName { which, name } => {
            let spans = field_spans(bytes);
            if !spans.is_empty() {
                splice(bytes, spans[which % spans.len()], NAMES[*name].as_bytes());
            }
        }
        Mutation::Nest { at, depth } => {
            let at = pos(*at);
            let mut nested = "(".repeat(*depth).into_bytes();
            nested.extend(")".repeat(*depth).into_bytes());
            splice(bytes, (at, at), &nested);
        }
    }
}

fn fuzz_duration() -> Duration {
    let secs = std::env::var("WIDEN_FUZZ_SECS").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(40);
    Duration::from_secs(secs)
}

#[test]
fn mutations_never_panic() {
    let files = corpus();
    // Mutate the specs that parse (the interesting neighbourhood) and the rest alike;
    // the large deep-nesting inputs are replayed above and would only slow this down.
    let seeds: Vec<Vec<u8>> = files.into_iter().map(|(_, b)| b).filter(|b| b.len() <= 4096).collect();
    let strategy = (0..seeds.len(), prop::collection::vec(mutation(), 1..5));
    let deadline = Instant::now() + fuzz_duration();
    let cases = std::cell::Cell::new(0u64);
    let outcomes = std::cell::RefCell::new(std::collections::BTreeMap::<String, u64>::new());
    let mut round = 0u32;
    while Instant::now() < deadline {
        // Fresh seeds each round (deterministic per round, so a failure reproduces).
        let config = Config { cases: 64, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new_with_rng(
            config,
            proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha,
                &[round.to_le_bytes(), [7; 4], [0; 4], [0; 4], [0; 4], [0; 4], [0; 4], [0; 4]].concat(),
            ),
        );
        let result = runner.run(&strategy, |(seed, mutations)| {
            let mut bytes = seeds[seed].clone();
            for m in &mutations {
                apply(&mut bytes, m);
            }
            match run_case(&bytes) {
                Ok(outcome) => {
                    *outcomes.borrow_mut().entry(format!("{outcome:?}")).or_default() += 1;
                    cases.set(cases.get() + 1);
                    Ok(())
                }
                Err(why) => Err(TestCaseError::fail(format!("{why}\ninput:\n{}", shown(&bytes)))),
            }
        });
        if let Err(e) = result {
            panic!("round {round}: {e}");
        }
        round += 1;
    }
    eprintln!("spec fuzz: {} cases in {round} rounds: {:?}", cases.get(), outcomes.borrow());
    assert!(cases.get() > 0);
}

#[test]
fn mutations_apply_where_meant() {
    let mut b = b"Model(vocab: 300, d_model: 64)".to_vec();
    apply(&mut b, &Mutation::Number { which: 1, value: 3 });
    assert_eq!(b, b"Model(vocab: 300, d_model: -4)");
    apply(&mut b, &Mutation::FieldName { which: 0, name: 12 });
    assert_eq!(String::from_utf8(b).unwrap(), "Model(vöcab: 300, d_model: -4)");
}
