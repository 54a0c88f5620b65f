//! Training data: where tokens come from, the train/validation split, and the
//! windows a run trains and validates on (docs/data.md, docs/architecture.md §7).
//!
//! Three sources: the built-in synthetic text and a `Text(path)` file are bytes (one
//! token per byte, vocab 256), read whole; `Tokens(..)` are token shards
//! (`dataset::shard`), memory-mapped and read window by window, so a corpus larger
//! than memory trains with bounded resident memory. Every id is checked against the
//! model's `vocab` as it is read, before a device sees it, and an id out of range
//! names its file and offset.
//!
//! A batch is `batch` windows of `seq_len + 1` consecutive tokens; the graph slices
//! inputs and next-token targets from each window itself. The order of the windows
//! and the validation windows are [`sampler`]'s.
//!
//! A `Text(path)` is read as raw bytes; a relative path is relative to the
//! working directory, like every other path on the command line. It must name a
//! regular file (or a symlink to one): a FIFO, a character device such as
//! `/dev/zero`, a socket or a folder is refused before it is opened, since
//! reading one would block or never end.

mod sampler;
mod synthetic;

pub use sampler::{BatchSampler, SamplerState, ValidationPlan};
pub use synthetic::{synthetic_corpus, SYNTHETIC_BYTES};

use dataset::shard::{ShardError, ShardSet};
use dataset::tokenizer::{Tokenizer, TokenizerError};
use ir::spec::{DataSpec, ModelSpec, TokenData, TokenizerSpec};
use std::path::Path;

/// Errors loading, splitting or reading training data.
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
    #[error(
        "{split} tokens of {source_name} hold {len} tokens, fewer than one window of {window} \
         (train.seq_len + 1){hint}"
    )]
    ShortSplit { split: &'static str, source_name: String, len: u64, window: usize, hint: String },
    #[error("validation fraction {fraction} must be strictly between 0 and 1")]
    Fraction { fraction: f64 },
    #[error("tokens {start}..{} read past the end of a split of {len} tokens", start + count)]
    PastEnd { start: u64, count: u64, len: u64 },
    #[error(transparent)]
    Shards(#[from] ShardError),
    #[error("the tokenizer of {source_name}")]
    Tokenizer { source_name: String, source: TokenizerError },
    #[error("the manifest beside {path}")]
    Manifest { path: String, source: dataset::manifest::ManifestError },
    #[error(
        "{source_name} was tokenized by {found} (vocabulary {found_vocab}), but the spec's \
         train.data names {spec}; remove one of them or make them agree"
    )]
    TokenizerMismatch { source_name: String, found: String, found_vocab: usize, spec: String },
    #[error(
        "train.val_tokens = {val_tokens} is fewer than one validation batch of {batch} windows x \
         {seq_len} tokens = {needed}; give at least {needed} (or leave it unset for random windows)"
    )]
    ValTokensBelowBatch { val_tokens: usize, batch: usize, seq_len: usize, needed: usize },
    #[error(
        "train.val_tokens = {val_tokens} needs {needed} validation tokens (whole batches of \
         {batch} x {seq_len}, plus the last target), but the validation split of {source_name} holds \
         {len}; give at most {most} or more validation data"
    )]
    ValTokensBeyondSplit {
        val_tokens: usize,
        needed: u64,
        batch: usize,
        seq_len: usize,
        source_name: String,
        len: u64,
        most: u64,
    },
}

/// The tokens of one split: a slice of bytes, or a range of a shard set.
#[derive(Debug, Clone)]
enum Split {
    Bytes(Vec<u8>),
    Shards { set: std::sync::Arc<ShardSet>, start: u64, len: u64 },
}

/// A read-only view of one split's tokens with the vocabulary they are checked against.
#[derive(Debug, Clone, Copy)]
pub struct TokenView<'a> {
    split: &'a Split,
    vocab: usize,
}

impl TokenView<'_> {
    /// Tokens in the split.
    pub fn len(&self) -> u64 {
        match self.split {
            Split::Bytes(b) => b.len() as u64,
            Split::Shards { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies tokens `[start, start + out.len())` of the split into `out` as ids,
    /// refusing an id >= vocab (naming the shard and offset) or a range past the end.
    pub fn read(&self, start: u64, out: &mut [i32]) -> Result<(), DataError> {
        match self.split {
            Split::Bytes(b) => {
                // Callers draw windows inside the split; a range past it is a bug, but
                // it is reported, not a panic.
                let range = usize::try_from(start).ok().and_then(|s| Some(s..s.checked_add(out.len())?));
                let Some(src) = range.and_then(|r| b.get(r)) else {
                    return Err(DataError::PastEnd { start, count: out.len() as u64, len: b.len() as u64 });
                };
                out.iter_mut().zip(src).for_each(|(o, &x)| *o = i32::from(x));
                Ok(())
            }
            Split::Shards { set, start: base, len } => {
                if start.saturating_add(out.len() as u64) > *len {
                    return Err(DataError::PastEnd { start, count: out.len() as u64, len: *len });
                }
                Ok(set.read(base + start, out, self.vocab)?)
            }
        }
    }

    /// The split's bytes, for byte data (tests and the byte-level eval search).
    pub fn bytes(&self) -> Option<&[u8]> {
        match self.split {
            Split::Bytes(b) => Some(b),
            Split::Shards { .. } => None,
        }
    }
}

/// A corpus split into a training part and a held-out validation part.
#[derive(Clone)]
pub struct Corpus {
    /// Where the data came from (a path, a shard pattern, or `synthetic:Default`), for messages.
    pub source: String,
    val_fraction: f64,
    train: Split,
    validation: Split,
    /// Token ids are checked against this as they are read.
    vocab: usize,
    /// The tokenizer behind the ids, when known (bytes for text; a token dataset's
    /// spec or manifest): bits per byte and `widen sample` need it.
    tokenizer: Option<std::sync::Arc<Tokenizer>>,
    /// A line for the run's first output: what the data is and how it is read.
    describe: String,
    identity: DataIdentity,
}

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corpus")
            .field("source", &self.source)
            .field("train_tokens", &self.train().len())
            .field("validation_tokens", &self.validation().len())
            .field("tokenizer", &self.tokenizer.as_ref().map(|t| t.spec()))
            .finish()
    }
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
    /// Loads the data `spec` trains on, for windows of `train.seq_len + 1` tokens.
    pub fn load(spec: &ModelSpec) -> Result<Corpus, DataError> {
        Corpus::load_data(&spec.train.data, spec.train.val_fraction, spec.train.seq_len + 1, spec.vocab)
    }

    /// Loads `data`; `window` is `seq_len + 1`, `vocab` bounds every token id.
    pub fn load_data(
        data: &DataSpec,
        val_fraction: f64,
        window: usize,
        vocab: usize,
    ) -> Result<Corpus, DataError> {
        match data {
            DataSpec::Synthetic(kind) => Corpus::from_bytes(
                format!("synthetic:{kind:?}"),
                synthetic_corpus(*kind),
                val_fraction,
                window,
            ),
            DataSpec::Text(path) => {
                Corpus::from_bytes(path.clone(), read_text(Path::new(path))?, val_fraction, window)
            }
            DataSpec::Tokens(tokens) => Corpus::from_shards(tokens, val_fraction, window, vocab),
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
        let identity = DataIdentity::of(source.clone(), &bytes);
        let split = bytes.len() - validation_len(bytes.len(), val_fraction);
        let validation = bytes.split_off(split);
        let describe = format!("{source}: {} bytes as byte tokens", identity.bytes);
        Ok(Corpus {
            source,
            val_fraction,
            train: Split::Bytes(bytes),
            validation: Split::Bytes(validation),
            vocab: 256,
            // The byte tokenizer reads no file, so it always loads.
            tokenizer: Tokenizer::load(&TokenizerSpec::Bytes).ok().map(std::sync::Arc::new),
            describe,
            identity,
        })
    }

    /// Opens a token dataset: its shards memory-mapped, the validation split either
    /// its own shards or the last `val_fraction` of the training tokens, the
    /// tokenizer from the spec or the manifest beside the shards (docs/data.md).
    fn from_shards(
        data: &TokenData,
        val_fraction: f64,
        window: usize,
        vocab: usize,
    ) -> Result<Corpus, DataError> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(DataError::Fraction { fraction: val_fraction });
        }
        let source = match &data.val {
            Some(val) => format!("Tokens(train: {:?}, val: {val:?})", data.train),
            None => format!("Tokens(train: {:?})", data.train),
        };
        let train_set = std::sync::Arc::new(ShardSet::open(&data.train, data.dtype)?);
        let tokenizer = shard_tokenizer(data, &train_set, &source)?;
        let (train, validation, val_set) = match &data.val {
            Some(val) => {
                let val_set = std::sync::Arc::new(ShardSet::open(val, data.dtype)?);
                let train = Split::Shards { set: train_set.clone(), start: 0, len: train_set.len() };
                let validation = Split::Shards { set: val_set.clone(), start: 0, len: val_set.len() };
                (train, validation, Some(val_set))
            }
            None => {
                let len = train_set.len();
                let v = (len as f64 * val_fraction).round() as u64;
                let train = Split::Shards { set: train_set.clone(), start: 0, len: len - v };
                let validation = Split::Shards { set: train_set.clone(), start: len - v, len: v };
                (train, validation, None)
            }
        };
        for (name, split) in [("training", &train), ("validation", &validation)] {
            let view = TokenView { split, vocab };
            if view.len() < window as u64 {
                let hint = if data.val.is_none() {
                    format!(" (the last train.val_fraction = {val_fraction} of the training tokens is validation)")
                } else {
                    String::new()
                };
                return Err(DataError::ShortSplit {
                    split: name,
                    source_name: source.clone(),
                    len: view.len(),
                    window,
                    hint,
                });
            }
        }
        let mut hasher = <sha2::Sha256 as sha2::Digest>::new();
        sha2::Digest::update(&mut hasher, train_set.sha256()?.as_bytes());
        let mut describe = train_set.describe();
        let mut bytes: u64 = train_set.files().iter().map(|f| f.file_bytes).sum();
        if let Some(val_set) = &val_set {
            sha2::Digest::update(&mut hasher, b"\0val\0");
            sha2::Digest::update(&mut hasher, val_set.sha256()?.as_bytes());
            bytes += val_set.files().iter().map(|f| f.file_bytes).sum::<u64>();
            describe = format!("{describe}; validation: {}", val_set.describe());
        } else {
            describe = format!("{describe}; the last {val_fraction} is validation");
        }
        let sha256 = sha2::Digest::finalize(hasher).iter().map(|b| format!("{b:02x}")).collect();
        let identity = DataIdentity { source: source.clone(), bytes, sha256 };
        let describe = match &tokenizer {
            Some(t) => format!("{source}: {describe}, tokenizer {}", tokenizer_name(t.spec())),
            None => format!("{source}: {describe}, tokenizer unknown (no bits per byte)"),
        };
        Ok(Corpus { source, val_fraction, train, validation, vocab, tokenizer, describe, identity })
    }

    /// Errors unless both splits hold at least one window of `window` tokens.
    pub fn check_window(&self, window: usize) -> Result<(), DataError> {
        match (&self.train, &self.validation) {
            (Split::Bytes(t), Split::Bytes(v)) => {
                let len = t.len() + v.len();
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
            _ => {
                for (split, view) in [("training", self.train()), ("validation", self.validation())] {
                    if view.len() < window as u64 {
                        return Err(DataError::ShortSplit {
                            split,
                            source_name: self.source.clone(),
                            len: view.len(),
                            window,
                            hint: String::new(),
                        });
                    }
                }
                Ok(())
            }
        }
    }

    pub fn train(&self) -> TokenView<'_> {
        TokenView { split: &self.train, vocab: self.vocab }
    }

    pub fn validation(&self) -> TokenView<'_> {
        TokenView { split: &self.validation, vocab: self.vocab }
    }

    /// The tokenizer behind the ids, when known.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_deref()
    }

    /// One line saying what the data is and how it is read, for a run's first output.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// What the corpus is, for checkpoints: its source, its length in bytes (of the
    /// text, or of the shard files) and a SHA-256 of its content.
    pub fn identity(&self) -> DataIdentity {
        self.identity.clone()
    }
}

/// The tokenizer of a token dataset: the spec's, else the manifest's beside the
/// training shards; both present must agree.
fn shard_tokenizer(
    data: &TokenData,
    set: &ShardSet,
    source: &str,
) -> Result<Option<std::sync::Arc<Tokenizer>>, DataError> {
    let dir = set.files().first().and_then(|f| f.path.parent()).map(Path::to_path_buf).unwrap_or_default();
    let manifest = dataset::manifest::Manifest::read(&dir)
        .map_err(|source| DataError::Manifest { path: dir.display().to_string(), source })?;
    let spec = match (&data.tokenizer, &manifest) {
        (Some(spec), Some(m)) if *spec != m.tokenizer => {
            return Err(DataError::TokenizerMismatch {
                source_name: format!("{} (manifest.json)", dir.display()),
                found: tokenizer_name(&m.tokenizer),
                found_vocab: m.vocab,
                spec: tokenizer_name(spec),
            })
        }
        (Some(spec), _) => spec.clone(),
        (None, Some(m)) => m.tokenizer.clone(),
        (None, None) => return Ok(None),
    };
    Tokenizer::load(&spec)
        .map(|t| Some(std::sync::Arc::new(t)))
        .map_err(|e| DataError::Tokenizer { source_name: source.to_string(), source: e })
}

/// `gpt2`, `bytes` or the tokenizer.json path, as messages and the run's first line name it.
pub fn tokenizer_name(spec: &TokenizerSpec) -> String {
    match spec {
        TokenizerSpec::Bytes => "bytes".into(),
        TokenizerSpec::Gpt2 => "gpt2".into(),
        TokenizerSpec::HuggingFace { path, sha256 } => {
            format!("{path} (sha256 {}…)", &sha256[..sha256.len().min(12)])
        }
    }
}

/// Reads a training text, refusing anything but a regular file (see the module
/// doc). `metadata` follows symlinks and does not open the file, so a FIFO is
/// named instead of blocking the read until a writer appears.
pub fn read_text(path: &Path) -> Result<Vec<u8>, DataError> {
    let read_err = |source| DataError::Read { path: path.display().to_string(), source };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if !meta.is_file() {
        return Err(DataError::NotAFile {
            path: path.display().to_string(),
            kind: dataset::shard::file_kind(&meta),
        });
    }
    std::fs::read(path).map_err(read_err)
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

/// The data a command-line `--data PATH_OR_GLOB` names: a glob, or a file whose first
/// int32 is a known llm.c magic, is token shards; anything else is a byte-level text
/// file, as before token datasets (docs/data.md). A headerless token file (nanoGPT's
/// `train.bin`) needs a spec's `Tokens(.., dtype: Some(U16))`.
pub fn data_from_arg(arg: &str) -> DataSpec {
    let is_glob = arg.contains(['*', '?', '[']) && !Path::new(arg).exists();
    // A file that cannot be sniffed (missing, a FIFO, a folder) is left to the text
    // reader, whose errors name it as the data given.
    let shard = is_glob || matches!(dataset::shard::sniff(Path::new(arg)), Ok(Some(_)));
    if shard {
        DataSpec::Tokens(TokenData { train: arg.to_string(), ..TokenData::default() })
    } else {
        DataSpec::Text(arg.to_string())
    }
}

/// The total length and the newest modification time of the files `data` reads, or
/// `None` for built-in data or files that cannot be read: a cheap stamp that tells a
/// caller holding an earlier [`DataIdentity`] whether it must hash the data again (the
/// sweep re-checks its data before every run; hashing a large token set each time would
/// cost more than the run).
pub fn data_stamp(data: &DataSpec) -> Option<(u64, std::time::SystemTime)> {
    let paths: Vec<std::path::PathBuf> = match data {
        DataSpec::Synthetic(_) => return None,
        DataSpec::Text(path) => vec![path.into()],
        DataSpec::Tokens(t) => {
            let mut sets = vec![ShardSet::open(&t.train, t.dtype).ok()?];
            if let Some(val) = &t.val {
                sets.push(ShardSet::open(val, t.dtype).ok()?);
            }
            sets.iter().flat_map(|s| s.files().iter().map(|f| f.path.clone())).collect()
        }
    };
    let mut stamp = (0u64, std::time::SystemTime::UNIX_EPOCH);
    for path in paths {
        let meta = std::fs::metadata(path).ok()?;
        stamp = (stamp.0 + meta.len(), stamp.1.max(meta.modified().ok()?));
    }
    Some(stamp)
}
