//! `manifest.json`: what `widen data prepare` wrote into a token folder, so a run on those
//! shards knows their tokenizer and a reader can check every file (docs/data.md, "The
//! manifest").

use ir::spec::{TokenWidth, TokenizerSpec};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The manifest's file name inside a token folder.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The manifest layout this crate writes and reads.
pub const MANIFEST_VERSION: u32 = 1;

/// How the text was split into training and validation (docs/data.md, "Split rules").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum SplitRule {
    /// The last `val_fraction` of the bytes is validation, cut at the start of a line
    /// (or of a source file); an end-of-text token precedes every source file's text.
    #[default]
    #[serde(rename = "lines")]
    Lines,
    /// nanoGPT's `data/shakespeare/prepare.py`: the first `1 - val_fraction` of the
    /// characters (Unicode code points) train, the rest validate; no end-of-text tokens.
    #[serde(rename = "nanogpt")]
    NanoGpt,
}

/// The split rule and its parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitInfo {
    pub rule: SplitRule,
    pub val_fraction: f64,
    /// Whether an end-of-text token precedes each source file's text.
    pub eot_per_document: bool,
    /// The rule in words, for a reader of the file.
    pub description: String,
}

/// One input text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceInfo {
    /// As given on the command line (or matched by its glob).
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

/// One shard file, named relative to the manifest's folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub tokens: u64,
    /// SHA-256 of the file's bytes, header included (what `sha256sum` prints).
    pub sha256: String,
}

/// One split's shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitFiles {
    pub tokens: u64,
    /// Bytes of text the split's tokens encode.
    pub bytes: u64,
    pub files: Vec<FileEntry>,
}

/// Everything `widen data prepare` records about a token folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub version: u32,
    /// Always `"llm.c"`: every shard has an llm.c header.
    pub format: String,
    pub dtype: TokenWidth,
    pub tokenizer: TokenizerSpec,
    pub vocab: usize,
    pub eot: Option<u32>,
    pub split: SplitInfo,
    pub sources: Vec<SourceInfo>,
    pub train: SplitFiles,
    pub val: SplitFiles,
}

/// Errors reading or writing a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read manifest {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write manifest {path}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("manifest {path} is not a widen data manifest: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("manifest {path} has version {version}; this widen reads version {MANIFEST_VERSION}")]
    Version { path: PathBuf, version: u32 },
}

impl Manifest {
    /// The manifest in `dir`; `Ok(None)` when there is none.
    pub fn read(dir: &Path) -> Result<Option<Manifest>, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ManifestError::Read { path, source }),
        };
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| ManifestError::Parse { path: path.clone(), message: e.to_string() })?;
        if m.version != MANIFEST_VERSION {
            return Err(ManifestError::Version { path, version: m.version });
        }
        Ok(Some(m))
    }

    /// The manifest beside a shard path or glob (in the folder of its last component),
    /// with that folder; `Ok(None)` when there is none.
    pub fn beside(pattern: &str) -> Result<Option<(PathBuf, Manifest)>, ManifestError> {
        let dir = match Path::new(pattern).parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Ok(Manifest::read(&dir)?.map(|m| (dir, m)))
    }

    /// Writes `dir/manifest.json` atomically (temp file + rename).
    pub fn write(&self, dir: &Path) -> Result<(), ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!(".{MANIFEST_FILE}.tmp-{}", std::process::id()));
        let result = serde_json::to_string_pretty(self)
            .map_err(std::io::Error::other)
            .and_then(|text| std::fs::write(&tmp, text + "\n"))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(source) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(ManifestError::Write { path, source });
        }
        Ok(())
    }

    /// The training shards' paths in `dir` (the folder the manifest is in), in order.
    pub fn train_paths(&self, dir: &Path) -> Vec<PathBuf> {
        self.train.files.iter().map(|f| dir.join(&f.name)).collect()
    }

    /// The validation shards' paths in `dir`, in order.
    pub fn val_paths(&self, dir: &Path) -> Vec<PathBuf> {
        self.val.files.iter().map(|f| dir.join(&f.name)).collect()
    }
}
