//! Training data: byte-level tokens (vocab 256), a train/validation split and
//! deterministic random windows (docs/architecture.md §7).
//!
//! A batch is `batch` windows of `seq_len + 1` consecutive bytes; the graph
//! slices inputs and next-token targets from each window itself. Windows start
//! at uniformly random offsets drawn from the `data.train` stream of the run's
//! seed; the sampler's state is checkpointed, so a resumed run sees exactly
//! the batches an uninterrupted run would. Validation windows come from a fresh
//! `data.validation` stream at every evaluation, so every evaluation of a run
//! scores the same windows and the numbers are comparable.
//!
//! A `Text(path)` is read as raw bytes; a relative path is relative to the
//! working directory, like every other path on the command line. It must name a
//! regular file (or a symlink to one): a FIFO, a character device such as
//! `/dev/zero`, a socket or a folder is refused before it is opened, since
//! reading one would block or never end.

use crate::rng::Rng;
use ir::spec::{DataSpec, SyntheticCorpus};
use std::path::Path;

/// Errors loading or splitting training text.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read training text {path}")]
    Read { path: String, source: std::io::Error },
    #[error("training text {path} is {kind}, not a regular file; give a file of bytes")]
    NotAFile { path: String, kind: &'static str },
    #[error(
        "training text {path} is too short: {len} bytes, but a window of {window} tokens \
         (seq_len + 1) in both the training and the validation split needs at least {needed} bytes"
    )]
    TooShort { path: String, len: usize, window: usize, needed: usize },
    #[error("token shards {path}: not readable yet")]
    Tokens { path: String },
    #[error("validation fraction {fraction} must be strictly between 0 and 1")]
    Fraction { fraction: f64 },
}

/// A byte corpus split into a training part and a held-out validation tail.
#[derive(Debug, Clone, PartialEq)]
pub struct Corpus {
    /// Where the text came from (a path, or `synthetic:Default`), for messages.
    pub source: String,
    val_fraction: f64,
    train: Vec<u8>,
    validation: Vec<u8>,
}

fn validation_len(len: usize, fraction: f64) -> usize {
    (len as f64 * fraction).round() as usize
}

/// Whether a text of `len` bytes split at `fraction` holds a window in both parts.
fn fits(len: usize, fraction: f64, window: usize) -> bool {
    let v = validation_len(len, fraction);
    v >= window && len - v >= window
}

/// The shortest text that [`fits`].
fn needed_len(window: usize, fraction: f64) -> usize {
    let mut needed = (window as f64 / fraction.min(1.0 - fraction)).ceil() as usize;
    while !fits(needed, fraction, window) {
        needed += 1;
    }
    needed
}

impl Corpus {
    /// Loads the data a spec names; `window` is `seq_len + 1`.
    pub fn load(spec: &DataSpec, val_fraction: f64, window: usize) -> Result<Corpus, DataError> {
        match spec {
            DataSpec::Synthetic(kind) => Corpus::from_bytes(
                format!("synthetic:{kind:?}"),
                synthetic_corpus(*kind),
                val_fraction,
                window,
            ),
            DataSpec::Text(path) => {
                Corpus::from_bytes(path.clone(), read_text(Path::new(path))?, val_fraction, window)
            }
            DataSpec::Tokens(t) => Err(DataError::Tokens { path: t.train.clone() }),
        }
    }

    /// Splits `bytes`: the last `val_fraction` (rounded) is validation. Both parts
    /// must hold at least one window.
    pub fn from_bytes(
        source: String,
        mut bytes: Vec<u8>,
        val_fraction: f64,
        window: usize,
    ) -> Result<Corpus, DataError> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(DataError::Fraction { fraction: val_fraction });
        }
        if !fits(bytes.len(), val_fraction, window) {
            let needed = needed_len(window, val_fraction);
            return Err(DataError::TooShort { path: source, len: bytes.len(), window, needed });
        }
        let split = bytes.len() - validation_len(bytes.len(), val_fraction);
        let validation = bytes.split_off(split);
        Ok(Corpus { source, val_fraction, train: bytes, validation })
    }

    /// Errors unless both splits hold at least one window of `window` tokens.
    pub fn check_window(&self, window: usize) -> Result<(), DataError> {
        let len = self.train.len() + self.validation.len();
        if fits(len, self.val_fraction, window) {
            return Ok(());
        }
        Err(DataError::TooShort {
            path: self.source.clone(),
            len,
            window,
            needed: needed_len(window, self.val_fraction),
        })
    }

    pub fn train(&self) -> &[u8] {
        &self.train
    }

    pub fn validation(&self) -> &[u8] {
        &self.validation
    }

    /// What the corpus is, for checkpoints: its source, its length and the SHA-256
    /// of its bytes (both splits, in file order).
    pub fn identity(&self) -> DataIdentity {
        DataIdentity::of_parts(self.source.clone(), &[&self.train, &self.validation])
    }
}

/// Reads a training text, refusing anything but a regular file (see the module
/// doc). `metadata` follows symlinks and does not open the file, so a FIFO is
/// named instead of blocking the read until a writer appears.
pub fn read_text(path: &Path) -> Result<Vec<u8>, DataError> {
    let read_err = |source| DataError::Read { path: path.display().to_string(), source };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if !meta.is_file() {
        return Err(DataError::NotAFile { path: path.display().to_string(), kind: file_kind(&meta) });
    }
    std::fs::read(path).map_err(read_err)
}

/// What a file that is not a regular file is, for [`DataError::NotAFile`].
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a folder";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "a special file"
}

/// The identity of a training text, recorded in checkpoints so that a resume on
/// other data can say so (`crate::checkpoint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataIdentity {
    /// The path given (or `synthetic:Default`).
    pub source: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// SHA-256 of its bytes, 64 lowercase hex digits.
    pub sha256: String,
}

impl DataIdentity {
    /// The identity of `bytes` read from `source`.
    pub fn of(source: String, bytes: &[u8]) -> DataIdentity {
        DataIdentity::of_parts(source, &[bytes])
    }

    /// The identity of the concatenation of `parts`.
    fn of_parts(source: String, parts: &[&[u8]]) -> DataIdentity {
        use sha2::Digest;
        let mut hasher = sha2::Sha256::new();
        parts.iter().for_each(|p| hasher.update(p));
        let sha256 = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        DataIdentity { source, bytes: parts.iter().map(|p| p.len() as u64).sum(), sha256 }
    }

    /// Whether `other` holds the same bytes (the source may differ).
    pub fn same_bytes(&self, other: &DataIdentity) -> bool {
        (self.bytes, &self.sha256) == (other.bytes, &other.sha256)
    }

    /// The first 12 hex digits of the SHA-256, as messages quote it.
    pub fn short_sha256(&self) -> &str {
        &self.sha256[..self.sha256.len().min(12)]
    }

    /// `path (N bytes, sha256 0123456789ab…)` for messages.
    pub fn describe(&self) -> String {
        format!("{} ({} bytes, sha256 {}…)", self.source, self.bytes, self.short_sha256())
    }
}

/// Draws batches of random windows from a text.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchSampler {
    rng: Rng,
    batch: usize,
    window: usize,
}

impl BatchSampler {
    /// The training sampler of a run with `seed`.
    pub fn train(seed: u64, batch: usize, window: usize) -> Self {
        BatchSampler { rng: Rng::stream(seed, "data.train"), batch, window }
    }

    /// A validation sampler, restarted at every evaluation.
    pub fn validation(seed: u64, batch: usize, window: usize) -> Self {
        BatchSampler { rng: Rng::stream(seed, "data.validation"), batch, window }
    }

    /// Continues a training sampler from a checkpointed [`BatchSampler::state`].
    pub fn from_state(state: [u64; 4], batch: usize, window: usize) -> Self {
        BatchSampler { rng: Rng::from_state(state), batch, window }
    }

    pub fn state(&self) -> [u64; 4] {
        self.rng.state()
    }

    /// `batch` windows from `text` (which holds at least one window), row-major
    /// `[batch, window]` token ids.
    pub fn next_batch(&mut self, text: &[u8]) -> Vec<i32> {
        let starts = (text.len() - self.window + 1) as u64;
        let mut out = Vec::with_capacity(self.batch * self.window);
        for _ in 0..self.batch {
            let s = self.rng.below(starts) as usize;
            out.extend(text[s..s + self.window].iter().map(|&b| i32::from(b)));
        }
        out
    }
}

/// Size of the built-in synthetic corpus in bytes (approximately; it ends at a paragraph).
pub const SYNTHETIC_BYTES: usize = 300_000;

/// The built-in corpus: English-like paragraphs from a small grammar with
/// subject–verb agreement, fixed word lists, punctuation and quoted speech,
/// generated from a fixed seed. It needs no download and has structure at the
/// byte level (spelling, agreement, sentence shape) that a small model learns
/// well below the unigram entropy.
pub fn synthetic_corpus(kind: SyntheticCorpus) -> Vec<u8> {
    match kind {
        SyntheticCorpus::Default => Grammar::new(0x5EED_0F7E_2700).text(SYNTHETIC_BYTES).into_bytes(),
    }
}

const NAMES: &[&str] =
    &["Alice", "Bruno", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Iris", "Jonas"];
const DETS: &[&str] = &["the", "a", "every", "this", "that", "my", "our", "one"];
const PLURAL_DETS: &[&str] = &["the", "some", "these", "those", "my", "our", "many", "two"];
const ADJS: &[&str] = &[
    "small", "quiet", "old", "bright", "green", "heavy", "clever", "gentle", "happy", "red", "cold", "tall",
];
const NOUNS: &[(&str, &str)] = &[
    ("cat", "cats"),
    ("dog", "dogs"),
    ("river", "rivers"),
    ("garden", "gardens"),
    ("window", "windows"),
    ("teacher", "teachers"),
    ("farmer", "farmers"),
    ("child", "children"),
    ("stone", "stones"),
    ("house", "houses"),
    ("bird", "birds"),
    ("book", "books"),
    ("tree", "trees"),
    ("letter", "letters"),
    ("ship", "ships"),
    ("mouse", "mice"),
];
/// (base, third person singular, past)
const TRANSITIVE: &[(&str, &str, &str)] = &[
    ("see", "sees", "saw"),
    ("find", "finds", "found"),
    ("carry", "carries", "carried"),
    ("watch", "watches", "watched"),
    ("follow", "follows", "followed"),
    ("paint", "paints", "painted"),
    ("build", "builds", "built"),
    ("open", "opens", "opened"),
    ("like", "likes", "liked"),
    ("help", "helps", "helped"),
];
const INTRANSITIVE: &[(&str, &str, &str)] = &[
    ("sleep", "sleeps", "slept"),
    ("run", "runs", "ran"),
    ("wait", "waits", "waited"),
    ("sing", "sings", "sang"),
    ("rest", "rests", "rested"),
    ("fall", "falls", "fell"),
    ("shine", "shines", "shone"),
    ("turn", "turns", "turned"),
];
const ADVERBS: &[&str] = &["slowly", "quickly", "often", "never", "always", "quietly", "again"];
const PREPS: &[&str] = &["near", "under", "behind", "over", "beside", "into", "across"];
const CONJS: &[&str] = &["and", "but", "because", "while", "so"];
const SPEECH: &[&str] = &["said", "asked", "whispered", "answered"];

struct Grammar {
    rng: Rng,
}

impl Grammar {
    fn new(seed: u64) -> Self {
        Grammar { rng: Rng::from_seed(seed) }
    }

    fn pick<'a>(&mut self, words: &[&'a str]) -> &'a str {
        words[self.rng.below(words.len() as u64) as usize]
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.next_f64() < p
    }

    /// A noun phrase and whether it is plural.
    fn noun_phrase(&mut self) -> (String, bool) {
        if self.chance(0.2) {
            return (self.pick(NAMES).to_string(), false);
        }
        let plural = self.chance(0.35);
        let (sg, pl) = NOUNS[self.rng.below(NOUNS.len() as u64) as usize];
        let det = if plural { self.pick(PLURAL_DETS) } else { self.pick(DETS) };
        let adj = if self.chance(0.45) { format!("{} ", self.pick(ADJS)) } else { String::new() };
        // "a" before a vowel sound becomes "an".
        let det = if det == "a" && adj.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { det };
        (format!("{det} {adj}{}", if plural { pl } else { sg }), plural)
    }

    fn clause(&mut self, past: bool) -> String {
        let (subject, plural) = self.noun_phrase();
        let mut s = subject;
        if self.chance(0.2) {
            s.push(' ');
            s.push_str(self.pick(ADVERBS));
        }
        let transitive = self.chance(0.6);
        let table = if transitive { TRANSITIVE } else { INTRANSITIVE };
        let (base, third, past_form) = table[self.rng.below(table.len() as u64) as usize];
        let verb = if past {
            past_form
        } else if plural {
            base
        } else {
            third
        };
        s.push(' ');
        s.push_str(verb);
        if transitive {
            s.push(' ');
            s.push_str(&self.noun_phrase().0);
        }
        if self.chance(0.35) {
            s.push(' ');
            s.push_str(self.pick(PREPS));
            s.push(' ');
            s.push_str(&self.noun_phrase().0);
        }
        s
    }

    fn sentence(&mut self, past: bool) -> String {
        let roll = self.rng.next_f64();
        let body = if roll < 0.15 {
            let (subject, plural) = self.noun_phrase();
            let aux = if past {
                "did"
            } else if plural {
                "do"
            } else {
                "does"
            };
            let (base, _, _) = TRANSITIVE[self.rng.below(TRANSITIVE.len() as u64) as usize];
            return capitalize(&format!("{aux} {subject} {base} {}?", self.noun_phrase().0));
        } else if roll < 0.3 {
            let inner = capitalize(&self.clause(past));
            let speaker = self.pick(NAMES);
            let verb = self.pick(SPEECH);
            return format!("\"{inner},\" {verb} {speaker}.");
        } else if roll < 0.55 {
            let first = self.clause(past);
            let conj = self.pick(CONJS);
            format!("{first}, {conj} {}", self.clause(past))
        } else {
            self.clause(past)
        };
        capitalize(&format!("{body}."))
    }

    fn text(&mut self, bytes: usize) -> String {
        let mut out = String::with_capacity(bytes + 1024);
        while out.len() < bytes {
            let past = self.chance(0.5);
            let sentences = 3 + self.rng.below(5);
            for i in 0..sentences {
                if i > 0 {
                    out.push(' ');
                }
                out.push_str(&self.sentence(past));
            }
            out.push_str("\n\n");
        }
        out
    }
}

fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}
