//! Token shards on disk, read as one token sequence (docs/data.md, "Formats").
//!
//! Two layouts are read:
//!
//! - **llm.c shards** (also modded-nanogpt's FineWeb shards): a header of [`HEADER_INTS`]
//!   little-endian int32 (`magic`, `version`, token count, the rest 0), then the tokens as
//!   little-endian u16 (magic [`LLMC_MAGIC_U16`], version 1) or u32 (magic
//!   [`LLMC_MAGIC_U32`], version 7).
//! - **headerless files** (nanoGPT's `train.bin`/`val.bin`): the tokens alone; nothing in
//!   the file says its width, so the spec must state it (`Tokens(.., dtype: Some(U16))`).
//!
//! A file whose first int32 is an llm.c magic is always read as an llm.c shard, even when
//! a headerless width is given: a u16 headerless file starting with that magic would begin
//! with the ids 54600 and 308, and a u32 one with the id 20240520 or 20240801, all outside
//! every vocabulary widen reads at u16 (GPT-2's 50257) and of any real u32 tokenizer.
//!
//! Files are memory-mapped, never read whole, so a 10B-token corpus costs no memory beyond
//! the page cache. Only regular files are opened: a FIFO, a device such as `/dev/zero` or
//! a folder is refused from its metadata before it is opened (a FIFO would block the open,
//! a device would never end), as for text (docs/architecture.md §7).

use ir::spec::TokenWidth;
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Magic of an llm.c shard of u16 tokens (GPT-2), header version 1.
pub const LLMC_MAGIC_U16: i32 = 20240520;
/// Magic of an llm.c shard of u32 tokens (Llama 3), header version 7.
pub const LLMC_MAGIC_U32: i32 = 20240801;
/// Header length of an llm.c shard in int32: magic, version, token count, the rest 0.
pub const HEADER_INTS: usize = 256;
/// The header in bytes.
pub const HEADER_BYTES: usize = HEADER_INTS * 4;
/// Header version that goes with [`LLMC_MAGIC_U16`].
pub const LLMC_VERSION_U16: i32 = 1;
/// Header version that goes with [`LLMC_MAGIC_U32`].
pub const LLMC_VERSION_U32: i32 = 7;

/// How one file stores its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardFormat {
    /// An llm.c header, then tokens of this width.
    Llmc(TokenWidth),
    /// Tokens of this width and nothing else (nanoGPT's `.bin`).
    Raw(TokenWidth),
}

impl ShardFormat {
    /// The width of one stored token.
    pub fn width(self) -> TokenWidth {
        match self {
            ShardFormat::Llmc(w) | ShardFormat::Raw(w) => w,
        }
    }

    /// Bytes before the first token.
    pub fn header_bytes(self) -> usize {
        match self {
            ShardFormat::Llmc(_) => HEADER_BYTES,
            ShardFormat::Raw(_) => 0,
        }
    }
}

/// One file of a [`ShardSet`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub path: PathBuf,
    pub format: ShardFormat,
    /// Tokens in the file.
    pub tokens: u64,
    /// The file's size in bytes, header included.
    pub file_bytes: u64,
}

/// Errors opening, reading or writing token shards; each names the file and what would be
/// valid.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("cannot read token shard {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot write token shard {path}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("token shard {path} is {kind}, not a regular file; give a file of tokens")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("token shard pattern {pattern:?} is not a valid glob: {message} (at character {position})")]
    BadPattern { pattern: String, message: String, position: usize },
    #[error(
        "token shard pattern {pattern:?} matches no file; give an existing path or a glob \
         such as dir/fineweb_train_*.bin"
    )]
    NoMatch { pattern: String },
    #[error("no token shard files given; give at least one path")]
    NoFiles,
    #[error("token shard {path} is empty (0 tokens); every shard needs at least one token")]
    Empty { path: PathBuf },
    #[error(
        "token shard {path} has magic {magic} but header version {version}; an llm.c shard with \
         magic {magic} has version {expected}"
    )]
    BadVersion { path: PathBuf, magic: i32, version: i32, expected: i32 },
    #[error(
        "token shard {path} is truncated: {file_bytes} bytes, shorter than its {HEADER_BYTES}-byte \
         llm.c header"
    )]
    TruncatedHeader { path: PathBuf, file_bytes: u64 },
    #[error(
        "token shard {path} is truncated: its header says {header} tokens ({expected_bytes} bytes \
         with the header) but the file has {file_bytes} bytes ({actual} tokens)"
    )]
    Truncated { path: PathBuf, header: i64, actual: u64, expected_bytes: u64, file_bytes: u64 },
    #[error(
        "token shard {path}: its header says {header} tokens but the file's {file_bytes} bytes hold \
         {actual} {width} tokens after the {HEADER_BYTES}-byte header; the count must equal \
         (file size - {HEADER_BYTES}) / {bytes}"
    )]
    CountMismatch { path: PathBuf, header: i64, actual: u64, file_bytes: u64, width: Width, bytes: usize },
    #[error(
        "token shard {path} ends in a partial token: its {body_bytes} bytes of tokens (after any \
         header) are not a multiple of the token width {width} ({bytes} bytes)"
    )]
    PartialToken { path: PathBuf, body_bytes: u64, width: Width, bytes: usize },
    #[error(
        "token shard {path} has no llm.c header (its first int32 is {first}, not {LLMC_MAGIC_U16} \
         for u16 or {LLMC_MAGIC_U32} for u32 tokens); if it is a headerless nanoGPT-style file, \
         state its token width in the spec: Tokens(.., dtype: Some(U16)) or Some(U32)"
    )]
    NoHeader { path: PathBuf, first: String },
    #[error("token {offset} of {path} (byte {byte}) is id {id}, outside the vocabulary: ids must be < vocab {vocab}")]
    IdOutOfRange { path: PathBuf, offset: u64, byte: u64, id: u64, vocab: usize },
    #[error(
        "tokens {start}..{end} are past the end of the shards ({len} tokens); reads must end at \
         or before {len}"
    )]
    OutOfBounds { start: u64, end: u128, len: u64 },
    #[error("cannot write token {index} (id {id}) to {path}: {width} holds ids below {limit}")]
    IdTooWide { path: PathBuf, index: usize, id: u32, width: Width, limit: u64 },
    #[error(
        "cannot write {tokens} tokens to {path}: an llm.c header counts at most {max} tokens; \
         split them into several shards"
    )]
    TooManyTokens { path: PathBuf, tokens: usize, max: usize },
}

/// A [`TokenWidth`] as `u16`/`u32` in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Width(pub TokenWidth);

impl std::fmt::Display for Width {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(width_name(self.0))
    }
}

fn width_name(w: TokenWidth) -> &'static str {
    match w {
        TokenWidth::U16 => "u16",
        TokenWidth::U32 => "u32",
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ShardError + '_ {
    move |source| ShardError::Io { path: path.to_path_buf(), source }
}

/// Refuses anything but a regular file (or a symlink to one) from its metadata, which
/// follows symlinks and does not open the file (a FIFO would block the open).
pub(crate) fn regular_file_len(path: &Path) -> Result<u64, ShardError> {
    let meta = std::fs::metadata(path).map_err(io_err(path))?;
    if !meta.is_file() {
        return Err(ShardError::NotAFile { path: path.to_path_buf(), kind: file_kind(&meta) });
    }
    Ok(meta.len())
}

/// What a file that is not a regular file is, for [`ShardError::NotAFile`] and every
/// other refusal of a data path that is not a regular file.
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
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

fn magic_format(magic: i32) -> Option<ShardFormat> {
    match magic {
        LLMC_MAGIC_U16 => Some(ShardFormat::Llmc(TokenWidth::U16)),
        LLMC_MAGIC_U32 => Some(ShardFormat::Llmc(TokenWidth::U32)),
        _ => None,
    }
}

/// The first int32 of a file, or `None` when it is shorter than 4 bytes.
fn first_int(path: &Path) -> Result<Option<i32>, ShardError> {
    regular_file_len(path)?;
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut buf = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match file.read(&mut buf[got..]) {
            Ok(0) => return Ok(None),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(path)(e)),
        }
    }
    Ok(Some(i32::from_le_bytes(buf)))
}

/// The shard format of `path` if its first int32 is a known llm.c magic (Ok(None): not a
/// shard, e.g. text). Only the magic is looked at; [`ShardSet::open`] validates the rest.
pub fn sniff(path: &Path) -> Result<Option<ShardFormat>, ShardError> {
    Ok(first_int(path)?.and_then(magic_format))
}

/// Writes an llm.c shard atomically (temp file + rename): a reader never sees a partial
/// shard, and an interrupted write leaves the previous file (if any) in place.
pub fn write_llmc(path: &Path, tokens: &[u32], width: TokenWidth) -> Result<(), ShardError> {
    let max = i32::MAX as usize;
    if tokens.len() > max {
        return Err(ShardError::TooManyTokens { path: path.to_path_buf(), tokens: tokens.len(), max });
    }
    if tokens.is_empty() {
        return Err(ShardError::Empty { path: path.to_path_buf() });
    }
    let limit: u64 = match width {
        TokenWidth::U16 => 1 << 16,
        TokenWidth::U32 => 1 << 32,
    };
    if let Some((index, &id)) = tokens.iter().enumerate().find(|(_, &id)| u64::from(id) >= limit) {
        return Err(ShardError::IdTooWide {
            path: path.to_path_buf(),
            index,
            id,
            width: Width(width),
            limit,
        });
    }
    let (magic, version) = match width {
        TokenWidth::U16 => (LLMC_MAGIC_U16, LLMC_VERSION_U16),
        TokenWidth::U32 => (LLMC_MAGIC_U32, LLMC_VERSION_U32),
    };
    let mut header = [0i32; HEADER_INTS];
    header[0] = magic;
    header[1] = version;
    header[2] = tokens.len() as i32;

    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "shard".into());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let werr = |source| ShardError::Write { path: path.to_path_buf(), source };
    let result = (|| -> std::io::Result<()> {
        let file = std::fs::File::create(&tmp)?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        for h in header {
            out.write_all(&h.to_le_bytes())?;
        }
        match width {
            TokenWidth::U16 => {
                for &t in tokens {
                    out.write_all(&(t as u16).to_le_bytes())?;
                }
            }
            TokenWidth::U32 => {
                for &t in tokens {
                    out.write_all(&t.to_le_bytes())?;
                }
            }
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(werr(e));
    }
    Ok(())
}

/// One opened file: its info and its map.
struct Shard {
    info: ShardInfo,
    map: memmap2::Mmap,
}

impl Shard {
    /// The token bytes (after any header).
    fn payload(&self) -> &[u8] {
        &self.map[self.info.format.header_bytes()..]
    }
}

/// Shards read as one token sequence in name order, memory-mapped (memmap2), never read
/// whole.
///
/// The maps assume the files do not change while the set is open (like every reader of
/// memory-mapped data); a shard truncated underneath a run would fault on access.
pub struct ShardSet {
    shards: Vec<Shard>,
    infos: Vec<ShardInfo>,
    /// `starts[i]`: the offset of shard `i`'s first token in the concatenation.
    starts: Vec<u64>,
    len: u64,
}

impl std::fmt::Debug for ShardSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardSet").field("files", &self.infos).field("len", &self.len).finish()
    }
}

pub(crate) fn has_glob_chars(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

impl ShardSet {
    /// `pattern`: a path or a glob; matches sorted by name; no match is an error naming the
    /// pattern. An existing path is taken as it is, even if it contains glob characters.
    ///
    /// Headered files are validated (magic, version, header count == (file size - 1024) /
    /// width, not truncated); a headerless file needs `raw = Some(width)` (its size must be
    /// a multiple of the width), else an error saying the file has no llm.c header and how
    /// to state the dtype. Empty shards and non-regular files are refused.
    pub fn open(pattern: &str, raw: Option<TokenWidth>) -> Result<ShardSet, ShardError> {
        let literal = Path::new(pattern);
        let paths = if !has_glob_chars(pattern) || std::fs::symlink_metadata(literal).is_ok() {
            vec![literal.to_path_buf()]
        } else {
            let iter = glob::glob(pattern).map_err(|e| ShardError::BadPattern {
                pattern: pattern.to_string(),
                message: e.msg.to_string(),
                position: e.pos,
            })?;
            let mut paths = Vec::new();
            for entry in iter {
                match entry {
                    Ok(p) => paths.push(p),
                    Err(e) => {
                        let path = e.path().to_path_buf();
                        return Err(ShardError::Io { path, source: e.into() });
                    }
                }
            }
            if paths.is_empty() {
                return Err(ShardError::NoMatch { pattern: pattern.to_string() });
            }
            paths.sort();
            paths
        };
        Self::from_paths(&paths, raw)
    }

    /// These files in this order (no sorting); validated as [`ShardSet::open`] does.
    pub fn from_paths(paths: &[PathBuf], raw: Option<TokenWidth>) -> Result<ShardSet, ShardError> {
        if paths.is_empty() {
            return Err(ShardError::NoFiles);
        }
        let mut shards = Vec::with_capacity(paths.len());
        let mut starts = Vec::with_capacity(paths.len());
        let mut len = 0u64;
        for path in paths {
            let shard = open_one(path, raw)?;
            starts.push(len);
            len += shard.info.tokens;
            shards.push(shard);
        }
        let infos = shards.iter().map(|s| s.info.clone()).collect();
        Ok(ShardSet { shards, infos, starts, len })
    }

    /// The files in reading order.
    pub fn files(&self) -> &[ShardInfo] {
        &self.infos
    }

    /// Total tokens.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the set holds no token (never true of an opened set: empty shards are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies tokens `[start, start + out.len())` of the concatenation (may span shards)
    /// into `out`, checking every id < `vocab`: an id >= vocab is an error naming the file,
    /// the token offset in that file, the id and vocab. A read past the end is an error.
    /// Ids are returned as i32 (the graph's token type), so `vocab` is capped at 2^31.
    pub fn read(&self, start: u64, out: &mut [i32], vocab: usize) -> Result<(), ShardError> {
        let end = start as u128 + out.len() as u128;
        if end > self.len as u128 {
            return Err(ShardError::OutOfBounds { start, end, len: self.len });
        }
        if out.is_empty() {
            return Ok(());
        }
        let limit = (vocab as u64).min(1 << 31);
        let mut i = self.starts.partition_point(|&s| s <= start) - 1;
        let mut pos = start;
        let mut done = 0usize;
        while done < out.len() {
            let shard = &self.shards[i];
            let local = pos - self.starts[i];
            let take = ((shard.info.tokens - local) as usize).min(out.len() - done);
            let dst = &mut out[done..done + take];
            let w = shard.info.format.width().bytes();
            let src = &shard.payload()[local as usize * w..(local as usize + take) * w];
            let bad = match shard.info.format.width() {
                TokenWidth::U16 => {
                    decode(src.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u64), dst, limit)
                }
                TokenWidth::U32 => decode(
                    src.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64),
                    dst,
                    limit,
                ),
            };
            if let Some((k, id)) = bad {
                let offset = local + k as u64;
                return Err(ShardError::IdOutOfRange {
                    path: shard.info.path.clone(),
                    offset,
                    byte: shard.info.format.header_bytes() as u64 + offset * w as u64,
                    id,
                    vocab: limit as usize,
                });
            }
            done += take;
            pos += take as u64;
            i += 1;
        }
        Ok(())
    }

    /// The SHA-256 (hex) of each file's bytes, header included (what `sha256sum` prints),
    /// in reading order; files are hashed on parallel threads, streamed from the map.
    pub fn file_sha256s(&self) -> Result<Vec<String>, ShardError> {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(self.shards.len());
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<Option<Result<String, ShardError>>>> =
            Mutex::new((0..self.shards.len()).map(|_| None).collect());
        std::thread::scope(|scope| {
            for _ in 0..workers.max(1) {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(shard) = self.shards.get(i) else { break };
                    let hex = hash_file(&shard.info.path);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(hex);
                });
            }
        });
        results.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
    }

    /// SHA-256 (hex) identifying the set: over each file's content hash
    /// ([`ShardSet::file_sha256s`], independent of its name) and token count, in order, as
    /// the lines `"<sha256> <tokens>\n"`. Renaming or moving the shards keeps the identity;
    /// changing, reordering, adding or removing one changes it.
    pub fn sha256(&self) -> Result<String, ShardError> {
        let hashes = self.file_sha256s()?;
        let mut h = Sha256::new();
        for (hex, info) in hashes.iter().zip(&self.infos) {
            h.update(format!("{hex} {}\n", info.tokens).as_bytes());
        }
        Ok(hex(&h.finalize()))
    }

    /// One line for a run's first line: "3 llm.c u16 shards, 300000000 tokens" /
    /// "nanoGPT-style headerless u16 file, 1000 tokens".
    pub fn describe(&self) -> String {
        let mut groups: Vec<(ShardFormat, usize)> = Vec::new();
        for info in &self.infos {
            match groups.iter_mut().find(|(f, _)| *f == info.format) {
                Some((_, n)) => *n += 1,
                None => groups.push((info.format, 1)),
            }
        }
        let parts: Vec<String> = groups
            .iter()
            .map(|&(format, n)| match format {
                ShardFormat::Llmc(w) => {
                    format!("{n} llm.c {} shard{}", width_name(w), if n == 1 { "" } else { "s" })
                }
                ShardFormat::Raw(w) if n == 1 => format!("nanoGPT-style headerless {} file", width_name(w)),
                ShardFormat::Raw(w) => format!("{n} nanoGPT-style headerless {} files", width_name(w)),
            })
            .collect();
        format!("{}, {} tokens", parts.join(" + "), self.len)
    }
}

/// Decodes ids into `dst`; the first (index, id) at or above `limit`, if any.
fn decode(ids: impl Iterator<Item = u64>, dst: &mut [i32], limit: u64) -> Option<(usize, u64)> {
    for (k, (id, d)) in ids.zip(dst.iter_mut()).enumerate() {
        if id >= limit {
            return Some((k, id));
        }
        *d = id as i32;
    }
    None
}

/// SHA-256 of a shard's file, read through a 1 MiB buffer rather than the map: the pages
/// pass through the page cache without becoming part of this process's resident set, so
/// hashing a corpus larger than memory keeps the process small (docs/data.md).
fn hash_file(path: &Path) -> Result<String, ShardError> {
    use std::io::Read;
    let io = |source| ShardError::Io { path: path.to_path_buf(), source };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn open_one(path: &Path, raw: Option<TokenWidth>) -> Result<Shard, ShardError> {
    let file_bytes = regular_file_len(path)?;
    if file_bytes == 0 {
        return Err(ShardError::Empty { path: path.to_path_buf() });
    }
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    // SAFETY: the map is read-only and the files are assumed not to change while the set
    // is open (see the type's doc); every access is bounds-checked against the length the
    // file had when it was validated below.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
    let path_buf = path.to_path_buf();
    let first = (map.len() >= 4).then(|| i32::from_le_bytes([map[0], map[1], map[2], map[3]]));
    let format = match first.and_then(magic_format) {
        Some(f) => f,
        None => match raw {
            Some(w) => ShardFormat::Raw(w),
            None => {
                let first = match first {
                    Some(v) => v.to_string(),
                    None => format!("missing: the file has only {file_bytes} bytes"),
                };
                return Err(ShardError::NoHeader { path: path_buf, first });
            }
        },
    };
    let width = format.width();
    let w = width.bytes() as u64;
    let tokens = match format {
        ShardFormat::Raw(_) => {
            if !file_bytes.is_multiple_of(w) {
                return Err(ShardError::PartialToken {
                    path: path_buf,
                    body_bytes: file_bytes,
                    width: Width(width),
                    bytes: width.bytes(),
                });
            }
            file_bytes / w
        }
        ShardFormat::Llmc(_) => {
            if file_bytes < HEADER_BYTES as u64 {
                return Err(ShardError::TruncatedHeader { path: path_buf, file_bytes });
            }
            let int =
                |k: usize| i32::from_le_bytes([map[4 * k], map[4 * k + 1], map[4 * k + 2], map[4 * k + 3]]);
            let (magic, version) = (int(0), int(1));
            let expected = if magic == LLMC_MAGIC_U16 { LLMC_VERSION_U16 } else { LLMC_VERSION_U32 };
            if version != expected {
                return Err(ShardError::BadVersion { path: path_buf, magic, version, expected });
            }
            let header = int(2) as i64;
            let body = file_bytes - HEADER_BYTES as u64;
            let actual = body / w;
            let expected_bytes = HEADER_BYTES as u64 + header.max(0) as u64 * w;
            if header > actual as i64 {
                return Err(ShardError::Truncated {
                    path: path_buf,
                    header,
                    actual,
                    expected_bytes,
                    file_bytes,
                });
            }
            if !body.is_multiple_of(w) {
                return Err(ShardError::PartialToken {
                    path: path_buf,
                    body_bytes: body,
                    width: Width(width),
                    bytes: width.bytes(),
                });
            }
            if header < 0 || header as u64 != actual {
                return Err(ShardError::CountMismatch {
                    path: path_buf,
                    header,
                    actual,
                    file_bytes,
                    width: Width(width),
                    bytes: width.bytes(),
                });
            }
            actual
        }
    };
    if tokens == 0 {
        return Err(ShardError::Empty { path: path_buf });
    }
    Ok(Shard { info: ShardInfo { path: path_buf, format, tokens, file_bytes }, map })
}
