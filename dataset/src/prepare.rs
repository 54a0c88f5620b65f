//! `widen data prepare`: text in, llm.c token shards and a manifest out (docs/data.md,
//! "Preparing a corpus").
//!
//! The sources (a path or a glob, read in name order) are memory-mapped; each split is
//! encoded on its own, streamed into shards of at most `shard_tokens` tokens, so memory
//! stays at one shard's tokens whatever the corpus size. GPT-2 encoding runs on every
//! core: the text is cut into chunks at a newline between two non-whitespace characters,
//! where GPT-2's pre-tokenizer always ends a piece (the newline is a piece of its own,
//! whatever precedes or follows it), so encoding the chunks separately and concatenating
//! the ids in order gives exactly the ids of encoding the whole text
//! (`tests/prepare.rs: parallel_encoding_equals_sequential`). Byte tokens are cut anywhere;
//! Hugging Face tokenizers, whose pre-tokenizers differ, encode each split whole.

use crate::manifest::{FileEntry, Manifest, SourceInfo, SplitFiles, SplitInfo, SplitRule, MANIFEST_VERSION};
use crate::shard::{self, ShardError, ShardSet};
use crate::tokenizer::{Tokenizer, TokenizerError};
use ir::spec::{TokenWidth, TokenizerSpec};
use std::io::IsTerminal;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// llm.c's shard size.
pub const DEFAULT_SHARD_TOKENS: usize = 100_000_000;
/// Bytes of text per parallel encoding chunk.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Inputs at least this large show progress.
const LARGE_INPUT: u64 = 32 << 20;

/// What to prepare and where.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// A text file or a glob of them (read in name order).
    pub input: String,
    /// The held-out fraction, strictly between 0 and 1.
    pub val_fraction: f64,
    /// The output folder (created if missing).
    pub out: PathBuf,
    /// Shard names' prefix; default: the input's file stem (one input) or `data`.
    pub name: Option<String>,
    /// Tokens per shard at most.
    pub shard_tokens: usize,
    pub split: SplitRule,
    /// Replace the shards and manifest already in `out`.
    pub force: bool,
    /// Report progress on stderr for large inputs (a bar on a terminal, lines otherwise).
    pub progress: bool,
    /// Encoding threads; 0: one per core.
    pub threads: usize,
}

impl PrepareOptions {
    /// The defaults for `input` into `out`: validation fraction 0.1, 100M-token shards,
    /// the line-boundary split, no progress.
    pub fn new(input: impl Into<String>, out: impl Into<PathBuf>) -> PrepareOptions {
        PrepareOptions {
            input: input.into(),
            val_fraction: 0.1,
            out: out.into(),
            name: None,
            shard_tokens: DEFAULT_SHARD_TOKENS,
            split: SplitRule::Lines,
            force: false,
            progress: false,
            threads: 0,
        }
    }
}

/// Errors preparing a corpus; each names the input, flag or folder and what would be valid.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("input {input:?} matches no file; give a text file or a glob of text files")]
    NoInput { input: String },
    #[error("input pattern {input:?} is not a valid glob: {message}")]
    BadPattern { input: String, message: String },
    #[error("cannot read input {path}")]
    Input { path: PathBuf, source: std::io::Error },
    #[error("input {path} is {kind}, not a regular file; give a text file")]
    InputNotAFile { path: PathBuf, kind: String },
    #[error("input {path} is already an llm.c token shard; give the text it was made from")]
    InputIsShard { path: PathBuf },
    #[error("--val-fraction {value} must be strictly between 0 and 1 (e.g. 0.1)")]
    Fraction { value: f64 },
    #[error("--shard-tokens {value} must be between 1 and {max} (an llm.c header counts in int32)")]
    ShardTokens { value: usize, max: usize },
    #[error(
        "shard name {name:?} must be 1..=64 characters from A-Za-z0-9._- and not start with '.'; \
         give one with --name"
    )]
    Name { name: String },
    #[error("the tokenizer's vocabulary of {vocab} ids exceeds u32 (4294967296 ids); shards store ids as u16 or u32")]
    VocabTooLarge { vocab: usize },
    #[error("output {path} exists and is not a folder; give a folder for --out")]
    OutNotAFolder { path: PathBuf },
    #[error(
        "output folder {dir} already holds token shards ({file}); choose another --out, or pass \
         --force to replace them"
    )]
    OutHasShards { dir: PathBuf, file: String },
    #[error("cannot write to output folder {dir}")]
    Out { dir: PathBuf, source: std::io::Error },
    #[error("cannot split {what} at --val-fraction {fraction}: {why}")]
    TooSmall { what: String, fraction: f64, why: String },
    #[error(
        "--split-like nanogpt reads the text as UTF-8 like nanoGPT's prepare.py, but {path} is not \
         valid UTF-8 at byte {offset}; use the default split, which takes any bytes"
    )]
    NotUtf8 { path: PathBuf, offset: usize },
    #[error(
        "--split-like nanogpt takes one text file, as nanoGPT's prepare.py does; {input:?} matches {count}"
    )]
    NanoGptSources { input: String, count: usize },
    #[error("the {split} split encodes to no tokens; give more text or another --val-fraction")]
    EmptySplit { split: &'static str },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(transparent)]
    Manifest(#[from] crate::manifest::ManifestError),
}

/// A source's bytes: mapped, or empty (a zero-length file cannot be mapped).
enum Text {
    Map(memmap2::Mmap),
    Empty,
}

impl Deref for Text {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Text::Map(m) => m,
            Text::Empty => &[],
        }
    }
}

/// A piece of one split: a range of one source, and whether a document starts there.
struct Segment<'a> {
    text: &'a [u8],
    doc_start: bool,
}

/// Prepares the corpus `opts` describes with `tokenizer`; the manifest it wrote.
pub fn prepare(opts: &PrepareOptions, tokenizer: &Tokenizer) -> Result<Manifest, PrepareError> {
    // Everything is checked before anything is written.
    if !(opts.val_fraction > 0.0 && opts.val_fraction < 1.0) {
        return Err(PrepareError::Fraction { value: opts.val_fraction });
    }
    let max = i32::MAX as usize;
    if opts.shard_tokens == 0 || opts.shard_tokens > max {
        return Err(PrepareError::ShardTokens { value: opts.shard_tokens, max });
    }
    let vocab = tokenizer.vocab();
    if vocab as u64 > 1 << 32 {
        return Err(PrepareError::VocabTooLarge { vocab });
    }
    let width = if vocab <= 1 << 16 { TokenWidth::U16 } else { TokenWidth::U32 };
    let paths = input_paths(&opts.input)?;
    if opts.split == SplitRule::NanoGpt && paths.len() != 1 {
        return Err(PrepareError::NanoGptSources { input: opts.input.clone(), count: paths.len() });
    }
    let name = match &opts.name {
        Some(n) => n.clone(),
        None if paths.len() == 1 => {
            paths[0].file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        }
        None => "data".to_string(),
    };
    if !valid_name(&name) {
        return Err(PrepareError::Name { name });
    }
    let texts = paths.iter().map(|p| map_text(p)).collect::<Result<Vec<_>, _>>()?;
    let (train, val) = match opts.split {
        SplitRule::Lines => split_lines(&texts, opts.val_fraction, &opts.input)?,
        SplitRule::NanoGpt => split_nanogpt(&paths[0], &texts[0], opts.val_fraction)?,
    };
    check_out(&opts.out, &name, opts.force)?;

    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let sources = hash_sources(&paths, &texts, threads);
    let eot = tokenizer.eot().filter(|_| opts.split == SplitRule::Lines);
    let total: u64 = texts.iter().map(|t| t.len() as u64).sum();
    let mut progress = Progress::new(opts.progress && total >= LARGE_INPUT, total);
    let mut files = Vec::new();
    for (split, segments) in [("train", &train), ("val", &val)] {
        let mut writer = Writer::new(&opts.out, &name, split, width, opts.shard_tokens);
        for seg in segments.iter() {
            if let (Some(eot), true) = (eot, seg.doc_start) {
                writer.push(&[eot])?;
            }
            encode_chunks(tokenizer, seg.text, threads, CHUNK_BYTES, |ids, bytes| {
                progress.advance(bytes as u64);
                writer.push(ids)
            })?;
        }
        let paths = writer.finish()?;
        if paths.is_empty() {
            return Err(PrepareError::EmptySplit { split });
        }
        files.push(paths);
    }
    progress.finish();

    // Read the shards back: the manifest's counts are their headers'.
    let mut splits = Vec::new();
    for (paths, segments) in files.iter().zip([&train, &val]) {
        let set = ShardSet::from_paths(paths, None)?;
        let hashes = set.file_sha256s()?;
        let entries = set
            .files()
            .iter()
            .zip(hashes)
            .map(|(info, sha256)| FileEntry {
                name: info.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
                tokens: info.tokens,
                sha256,
            })
            .collect();
        let bytes = segments.iter().map(|s| s.text.len() as u64).sum();
        splits.push(SplitFiles { tokens: set.len(), bytes, files: entries });
    }
    let val_files = splits.pop().unwrap_or(SplitFiles { tokens: 0, bytes: 0, files: Vec::new() });
    let train_files = splits.pop().unwrap_or(SplitFiles { tokens: 0, bytes: 0, files: Vec::new() });
    let manifest = Manifest {
        version: MANIFEST_VERSION,
        format: "llm.c".into(),
        dtype: width,
        tokenizer: tokenizer.spec().clone(),
        vocab,
        eot: tokenizer.eot(),
        split: SplitInfo {
            rule: opts.split,
            val_fraction: opts.val_fraction,
            eot_per_document: eot.is_some(),
            description: describe_rule(opts.split, opts.val_fraction, eot.is_some()),
        },
        sources,
        train: train_files,
        val: val_files,
    };
    manifest.write(&opts.out)?;
    Ok(manifest)
}

fn describe_rule(rule: SplitRule, fraction: f64, eot: bool) -> String {
    match rule {
        SplitRule::Lines => format!(
            "the sources in name order; the last {fraction} of the bytes is validation, starting at the \
             first line start at or after that point; each split encoded separately{}",
            if eot { "; <|endoftext|> before each source's text" } else { "" }
        ),
        SplitRule::NanoGpt => format!(
            "nanoGPT's prepare.py: the first int(n * {}) of the n characters train, the rest validate; \
             each split encoded separately",
            1.0 - fraction
        ),
    }
}

/// The input files: a path, or a glob's matches in name order.
fn input_paths(input: &str) -> Result<Vec<PathBuf>, PrepareError> {
    let literal = Path::new(input);
    let paths = if !shard::has_glob_chars(input) || std::fs::symlink_metadata(literal).is_ok() {
        if std::fs::symlink_metadata(literal).is_err() {
            return Err(PrepareError::NoInput { input: input.to_string() });
        }
        vec![literal.to_path_buf()]
    } else {
        let iter = glob::glob(input)
            .map_err(|e| PrepareError::BadPattern { input: input.to_string(), message: e.to_string() })?;
        let mut paths = Vec::new();
        for entry in iter {
            match entry {
                Ok(p) => paths.push(p),
                Err(e) => return Err(PrepareError::Input { path: e.path().to_path_buf(), source: e.into() }),
            }
        }
        paths.sort();
        paths
    };
    if paths.is_empty() {
        return Err(PrepareError::NoInput { input: input.to_string() });
    }
    for path in &paths {
        match shard::sniff(path) {
            Ok(Some(_)) => return Err(PrepareError::InputIsShard { path: path.clone() }),
            Ok(None) => {}
            Err(ShardError::NotAFile { kind, .. }) => {
                return Err(PrepareError::InputNotAFile { path: path.clone(), kind: kind.to_string() })
            }
            Err(ShardError::Io { source, .. }) => {
                return Err(PrepareError::Input { path: path.clone(), source })
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(paths)
}

fn map_text(path: &Path) -> Result<Text, PrepareError> {
    let file =
        std::fs::File::open(path).map_err(|source| PrepareError::Input { path: path.into(), source })?;
    let len = file.metadata().map_err(|source| PrepareError::Input { path: path.into(), source })?.len();
    if len == 0 {
        return Ok(Text::Empty);
    }
    // SAFETY: read-only, and the input is assumed not to change while it is prepared
    // (as for shards, crate::shard::ShardSet).
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|source| PrepareError::Input { path: path.into(), source })?;
    Ok(Text::Map(map))
}

/// Shard and manifest names: one safe path component.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// Refuses an output folder that already holds shards or a manifest, unless `force`
/// (which removes this name's shards and the manifest first, so no stale shard of a
/// larger earlier run is left beside the new ones).
fn check_out(dir: &Path, name: &str, force: bool) -> Result<(), PrepareError> {
    let out_err = |source| PrepareError::Out { dir: dir.to_path_buf(), source };
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => return Err(PrepareError::OutNotAFolder { path: dir.to_path_buf() }),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return std::fs::create_dir_all(dir).map_err(out_err);
        }
        Err(e) => return Err(out_err(e)),
    }
    let mut found = None;
    let mut ours = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(out_err)? {
        let entry = entry.map_err(out_err)?;
        let file = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let is_ours =
            file.starts_with(&format!("{name}_train_")) || file.starts_with(&format!("{name}_val_"));
        let is_shard = file == crate::manifest::MANIFEST_FILE
            || (path.is_file() && file.ends_with(".bin") && matches!(shard::sniff(&path), Ok(Some(_))))
            || (is_ours && file.ends_with(".bin"));
        if is_shard {
            found.get_or_insert(file.clone());
            if is_ours || file == crate::manifest::MANIFEST_FILE {
                ours.push(path);
            }
        }
    }
    match found {
        Some(file) if !force => Err(PrepareError::OutHasShards { dir: dir.to_path_buf(), file }),
        _ => {
            for path in ours {
                std::fs::remove_file(&path).map_err(out_err)?;
            }
            Ok(())
        }
    }
}

/// The default rule: the last `fraction` of all bytes is validation, cut at the first
/// line start (or source start) at or after that point, else the last one before it.
fn split_lines<'a>(
    texts: &'a [Text],
    fraction: f64,
    input: &str,
) -> Result<(Vec<Segment<'a>>, Vec<Segment<'a>>), PrepareError> {
    let total: usize = texts.iter().map(|t| t.len()).sum();
    let too_small = |why: String| PrepareError::TooSmall { what: format!("input {input:?}"), fraction, why };
    if total < 2 {
        return Err(too_small(format!("it has {total} bytes")));
    }
    let target = total - (total as f64 * fraction).round() as usize;
    // Global offsets of source starts.
    let mut starts = Vec::with_capacity(texts.len());
    let mut off = 0;
    for t in texts {
        starts.push(off);
        off += t.len();
    }
    let is_line_start = |p: usize| -> bool {
        let s = starts.partition_point(|&s| s <= p) - 1;
        let local = p - starts[s];
        local == 0 || texts[s][local - 1] == b'\n'
    };
    let forward = (target.max(1)..total).find(|&p| {
        // Fast path: only positions after a newline or at a source start qualify.
        is_line_start(p)
    });
    let cut = match forward {
        Some(p) => p,
        None => match (1..target.min(total)).rev().find(|&p| is_line_start(p)) {
            Some(p) => p,
            None => return Err(too_small("the text has no line break to cut at; give more lines".into())),
        },
    };
    let mut train = Vec::new();
    let mut val = Vec::new();
    for (t, &start) in texts.iter().zip(&starts) {
        let end = start + t.len();
        if end <= cut {
            train.push(Segment { text: t, doc_start: true });
        } else if start >= cut {
            val.push(Segment { text: t, doc_start: true });
        } else {
            let local = cut - start;
            train.push(Segment { text: &t[..local], doc_start: true });
            val.push(Segment { text: &t[local..], doc_start: false });
        }
    }
    Ok((train, val))
}

/// nanoGPT's rule: `n = len(data); train = data[:int(n*0.9)]` over code points.
fn split_nanogpt<'a>(
    path: &Path,
    text: &'a Text,
    fraction: f64,
) -> Result<(Vec<Segment<'a>>, Vec<Segment<'a>>), PrepareError> {
    let s = std::str::from_utf8(text)
        .map_err(|e| PrepareError::NotUtf8 { path: path.to_path_buf(), offset: e.valid_up_to() })?;
    let n = s.chars().count();
    let k = (n as f64 * (1.0 - fraction)) as usize;
    if k == 0 || k >= n {
        return Err(PrepareError::TooSmall {
            what: format!("{}", path.display()),
            fraction,
            why: format!("its {n} characters leave a split empty"),
        });
    }
    let byte = s.char_indices().nth(k).map_or(s.len(), |(i, _)| i);
    Ok((
        vec![Segment { text: &text[..byte], doc_start: true }],
        vec![Segment { text: &text[byte..], doc_start: false }],
    ))
}

fn hash_sources(paths: &[PathBuf], texts: &[Text], threads: usize) -> Vec<SourceInfo> {
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<SourceInfo>>> = Mutex::new(vec![None; paths.len()]);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, paths.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let (Some(path), Some(text)) = (paths.get(i), texts.get(i)) else { break };
                use sha2::Digest;
                let mut h = sha2::Sha256::new();
                for chunk in text.chunks(1 << 20) {
                    h.update(chunk);
                }
                let info = SourceInfo {
                    path: path.display().to_string(),
                    bytes: text.len() as u64,
                    sha256: shard::hex(&h.finalize()),
                };
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(info);
            });
        }
    });
    out.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
}

/// Where a chunk may end for this tokenizer so that encoding chunks separately equals
/// encoding the whole text (see the module doc).
pub fn chunk_ends(spec: &TokenizerSpec, text: &[u8], chunk_bytes: usize) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut pos = 0;
    let chunk_bytes = chunk_bytes.max(1);
    while pos < text.len() {
        let target = pos + chunk_bytes;
        let end = if target >= text.len() {
            text.len()
        } else {
            match spec {
                TokenizerSpec::Bytes => target,
                TokenizerSpec::Gpt2 => {
                    (target..text.len()).find(|&i| gpt2_safe_cut(text, i)).unwrap_or(text.len())
                }
                TokenizerSpec::HuggingFace { .. } => text.len(),
            }
        };
        ends.push(end);
        pos = end;
    }
    ends
}

/// Whether `text[i - 1]` is a newline between two non-whitespace characters (valid UTF-8).
fn gpt2_safe_cut(text: &[u8], i: usize) -> bool {
    if i < 2 || i >= text.len() || text[i - 1] != b'\n' {
        return false;
    }
    // The character ending at i - 1.
    let before = &text[i.saturating_sub(5)..i - 1];
    let prev = (1..=before.len().min(4)).find_map(|k| {
        std::str::from_utf8(&before[before.len() - k..]).ok().filter(|s| s.chars().count() == 1)
    });
    let next = text[i..text.len().min(i + 4)].utf8_chunks().next().and_then(|c| c.valid().chars().next());
    matches!((prev.and_then(|s| s.chars().next()), next), (Some(p), Some(n)) if !p.is_whitespace() && !n.is_whitespace())
}

/// Encodes `text` in chunks on `threads` threads, handing each chunk's ids (and its byte
/// length) to `sink` in text order.
fn encode_chunks<E: From<TokenizerError>>(
    tokenizer: &Tokenizer,
    text: &[u8],
    threads: usize,
    chunk_bytes: usize,
    mut sink: impl FnMut(&[u32], usize) -> Result<(), E>,
) -> Result<(), E> {
    let ends = chunk_ends(tokenizer.spec(), text, chunk_bytes);
    let mut chunks = Vec::with_capacity(ends.len());
    let mut start = 0;
    for end in ends {
        chunks.push(&text[start..end]);
        start = end;
    }
    let threads = threads.max(1);
    for batch in chunks.chunks(threads * 2) {
        let results = parallel(batch, threads, |c| tokenizer.try_encode(c));
        for (chunk, ids) in batch.iter().zip(results) {
            sink(&ids?, chunk.len())?;
        }
    }
    Ok(())
}

/// `f` over every item on up to `threads` threads; the results in item order.
fn parallel<T: Sync, R: Send>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if threads <= 1 || items.len() <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(items.len()) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    // Every index was taken by exactly one worker; a panicking worker re-raises at the
    // end of the scope.
    out.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
}

/// `tokenizer.encode(text)` on `threads` threads in chunks of about `chunk_bytes`: the
/// same ids as encoding the whole text at once (see the module doc).
pub fn encode_parallel(
    tokenizer: &Tokenizer,
    text: &[u8],
    threads: usize,
    chunk_bytes: usize,
) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = Vec::new();
    encode_chunks(tokenizer, text, threads, chunk_bytes, |c, _| {
        ids.extend_from_slice(c);
        Ok::<(), TokenizerError>(())
    })?;
    Ok(ids)
}

/// Streams one split's ids into shards of at most `shard_tokens`.
struct Writer<'a> {
    dir: &'a Path,
    name: &'a str,
    split: &'static str,
    width: TokenWidth,
    shard_tokens: usize,
    buf: Vec<u32>,
    paths: Vec<PathBuf>,
}

impl<'a> Writer<'a> {
    fn new(
        dir: &'a Path,
        name: &'a str,
        split: &'static str,
        width: TokenWidth,
        shard_tokens: usize,
    ) -> Self {
        Writer { dir, name, split, width, shard_tokens, buf: Vec::new(), paths: Vec::new() }
    }

    fn push(&mut self, mut ids: &[u32]) -> Result<(), PrepareError> {
        while !ids.is_empty() {
            let room = self.shard_tokens - self.buf.len();
            let take = room.min(ids.len());
            self.buf.extend_from_slice(&ids[..take]);
            ids = &ids[take..];
            if self.buf.len() == self.shard_tokens {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), PrepareError> {
        let path = self.dir.join(format!("{}_{}_{:06}.bin", self.name, self.split, self.paths.len()));
        shard::write_llmc(&path, &self.buf, self.width)?;
        self.buf.clear();
        self.paths.push(path);
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<PathBuf>, PrepareError> {
        if !self.buf.is_empty() {
            self.flush()?;
        }
        Ok(self.paths)
    }
}

/// Progress on stderr: a bar (throughput, ETA) on a terminal, a line every 10 s otherwise.
enum Progress {
    Quiet,
    Bar(indicatif::ProgressBar),
    Lines { start: Instant, last: Instant, done: u64, total: u64 },
}

impl Progress {
    fn new(show: bool, total: u64) -> Progress {
        if !show {
            return Progress::Quiet;
        }
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(total);
            let style = indicatif::ProgressStyle::with_template(
                "tokenizing [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}, ETA {eta}",
            )
            .map(|s| s.progress_chars("=> "));
            if let Ok(style) = style {
                bar.set_style(style);
            }
            Progress::Bar(bar)
        } else {
            let now = Instant::now();
            Progress::Lines { start: now, last: now, done: 0, total }
        }
    }

    fn advance(&mut self, bytes: u64) {
        match self {
            Progress::Quiet => {}
            Progress::Bar(bar) => bar.inc(bytes),
            Progress::Lines { start, last, done, total } => {
                *done += bytes;
                if last.elapsed() >= Duration::from_secs(10) {
                    *last = Instant::now();
                    let secs = start.elapsed().as_secs_f64().max(1e-9);
                    let rate = *done as f64 / secs;
                    let left = (*total - (*done).min(*total)) as f64 / rate.max(1.0);
                    eprintln!(
                        "tokenized {:.1} of {:.1} MiB ({:.0}%), {:.1} MiB/s, about {:.0} s left",
                        *done as f64 / 1048576.0,
                        *total as f64 / 1048576.0,
                        100.0 * *done as f64 / (*total).max(1) as f64,
                        rate / 1048576.0,
                        left
                    );
                }
            }
        }
    }

    fn finish(&mut self) {
        match self {
            Progress::Quiet => {}
            Progress::Bar(bar) => bar.finish_and_clear(),
            Progress::Lines { start, done, .. } => {
                let secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "tokenized {:.1} MiB in {secs:.1} s ({:.1} MiB/s)",
                    *done as f64 / 1048576.0,
                    *done as f64 / 1048576.0 / secs.max(1e-9)
                );
            }
        }
    }
}
