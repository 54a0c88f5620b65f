//! Checkpoints: one safetensors file per save (docs/architecture.md §7).
//!
//! **Tensor names.**
//! - `<param>`: each parameter under its graph name (`ParamInfo::name`, e.g.
//!   `embed`, `blocks.0.attn.wq`), f32, in its graph shape (matrices `[in, out]`).
//! - `opt.<param>.m`, `opt.<param>.v`: AdamW first and second moments.
//! - `opt.<param>.momentum`: Muon momentum buffer.
//!
//! **Header metadata** (safetensors `__metadata__`, all strings):
//! `format` = `widen-checkpoint`, `format_version`, `spec` (the model spec as
//! RON, `ModelSpec::to_ron`), `spec_hash` (16 hex digits, FNV-1a 64 of the canonical spec
//! with `train.steps` cleared, so a run may be resumed with a longer step
//! budget), `step` (optimizer steps taken) and the training sampler's state:
//! `data_rng` (a random-order sampler's generator state, four hex words) or
//! `data_position` (a sequential sampler's next token offset, decimal; docs/data.md).
//! Together with the optimizer tensors this is everything a resumed run needs to
//! continue bit for bit.
//! Written by this build and optional when read (older files lack them):
//! `spec_json` (the same spec as JSON, every field with its default filled in, for
//! readers without a RON parser) and the training data's identity, `data_source`
//! (the path, or `synthetic:Default`), `data_bytes` and `data_sha256` (of its
//! bytes), so a resume on other data can say so, and `tokenizer` (the tokenizer
//! behind the ids as RON, `Bytes`, `Gpt2` or `HuggingFace(..)`), which `widen sample`
//! encodes and decodes through. docs/checkpoints.md documents
//! the format for readers outside widen.
//!
//! Files are written to a temporary name, synced and renamed into place, so an
//! interrupted or failed save never destroys an earlier checkpoint; a save that
//! fails (a full disk, a file size limit) removes its temporary file.
//!
//! **Only finite values.** [`save`] refuses a parameter or optimizer tensor that
//! holds NaN or an infinity, and [`Checkpoint::read`] refuses such a file, naming
//! the first bad tensor (by name order): a diverged step must never become the
//! "last good" checkpoint that `widen sample` or `--resume` then trusts.
//!
//! **What a resume may change.** [`Checkpoint::check_spec`] compares the specs
//! field by field. A resume may change only [`RESUMABLE_FIELDS`]: the step budget
//! (and the warmup `--steps` rescales with it), the data and its validation split,
//! the evaluation and checkpoint cadence and the retention. Everything else (the
//! architecture, the residual scheme, the optimizer and its settings, clipping,
//! the seed, batch and sequence length, the name) is the model being trained,
//! and a difference in any of it is refused naming the field.

use crate::data::{DataIdentity, SamplerState};
use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::rng::fnv1a64;
use ir::spec::{ModelSpec, TokenizerSpec};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Version of the layout described in the module doc.
pub const FORMAT_VERSION: &str = "1";
const FORMAT: &str = "widen-checkpoint";

/// Errors reading or writing checkpoints. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot access checkpoint {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is corrupt or truncated: {message}")]
    Corrupt { path: PathBuf, message: String },
    /// A spec or sweep file given where a checkpoint belongs.
    #[error(
        "{path} is a {what} file, not a checkpoint; train it first (`widen train {path}`) and pass the \
         run's checkpoint, e.g. runs/<name>/final.safetensors"
    )]
    NotACheckpoint { path: PathBuf, what: &'static str },
    #[error("checkpoint {path} has format version {found}; this build reads version {FORMAT_VERSION}")]
    Version { path: PathBuf, found: String },
    #[error(
        "checkpoint {path} was written for a different model (differs at: {}); a resume may change only {}",
        differences.join(", "),
        RESUMABLE_FIELDS.join(", ")
    )]
    SpecMismatch { path: PathBuf, differences: Vec<String> },
    #[error("checkpoint {path} has no tensor `{tensor}` that this model needs")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("checkpoint {path}: tensor `{tensor}` has shape {got:?}, this model needs {expected:?}")]
    TensorShape { path: PathBuf, tensor: String, expected: Vec<usize>, got: Vec<usize> },
    #[error("checkpoint {path}: tensor `{tensor}` has dtype {got}, expected F32")]
    TensorDType { path: PathBuf, tensor: String, got: String },
    #[error("checkpoint {path} has a tensor `{tensor}` this model does not have")]
    UnexpectedTensor { path: PathBuf, tensor: String },
    #[error("cannot write checkpoint {path}: {message}")]
    Serialize { path: PathBuf, message: String },
    #[error(
        "checkpoint {path}: tensor `{tensor}` holds a non-finite value ({value}); the run diverged \
         before this checkpoint was written, so it cannot be used"
    )]
    NonFiniteTensor { path: PathBuf, tensor: String, value: f32 },
    #[error("refusing to write checkpoint {path}: tensor `{tensor}` holds a non-finite value ({value})")]
    NonFiniteSave { path: PathBuf, tensor: String, value: f32 },
    #[error(
        "cannot write checkpoint {path}: the optimizer's moments are still on the device that stepped it \
         (`StepExecutor::sync_optimizer` brings them back)"
    )]
    MomentsOnDevice { path: PathBuf },
}

/// Training progress stored with the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: u64,
    /// The training data sampler's state.
    pub sampler: SamplerState,
}

fn canonical_value(spec: &ModelSpec) -> serde_json::Value {
    let mut s = spec.clone();
    s.train.steps = 0;
    serde_json::to_value(&s).expect("a ModelSpec always serializes to JSON")
}

/// The spec fields (paths in the spec's JSON form) a resumed run may change:
/// they decide how long and on what the run continues, not what is trained.
/// `train.schedule.warmup` is here because `--steps` rescales it (the learning
/// rate schedule is recomputed for the new step budget, see `train`).
pub const RESUMABLE_FIELDS: &[&str] = &[
    "train.steps",
    "train.schedule.warmup",
    "train.data",
    "train.val_fraction",
    "train.eval_every",
    "train.eval_batches",
    "train.val_tokens",
    "train.checkpoint_every",
    "train.keep_last",
];

/// `spec` as JSON without the [`RESUMABLE_FIELDS`], which a resume may change.
fn frozen_value(spec: &ModelSpec) -> serde_json::Value {
    let mut v = serde_json::to_value(spec).expect("a ModelSpec always serializes to JSON");
    if let Some(train) = v.get_mut("train").and_then(|t| t.as_object_mut()) {
        for field in RESUMABLE_FIELDS.iter().filter_map(|f| f.strip_prefix("train.")) {
            train.remove(field);
        }
        // The schedule is an enum: `{"Cosine": {"warmup": .., ..}}`; its kind and the
        // other parameters stay frozen.
        if let Some(kind) = train.get_mut("schedule").and_then(|s| s.as_object_mut()) {
            kind.values_mut().filter_map(|p| p.as_object_mut()).for_each(|p| {
                p.remove("warmup");
            });
        }
    }
    v
}

/// The first tensor of `tensors` (in the order given) holding NaN or an infinity,
/// with that value.
pub fn first_non_finite<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [f32])>,
) -> Option<(&'a str, f32)> {
    tensors.into_iter().find_map(|(name, values)| values.iter().find(|v| !v.is_finite()).map(|&v| (name, v)))
}

/// The first parameter or optimizer tensor, by name, that is not finite.
pub fn first_non_finite_state(params: &ParamSet, optimizer: Option<&Optimizer>) -> Option<(String, f32)> {
    let mut all: Vec<(String, &[f32])> =
        params.iter().map(|p| (p.name.clone(), p.value.as_slice())).collect();
    if let Some(opt) = optimizer {
        all.extend(opt.state_tensors().into_iter().map(|(name, _, values)| (name, values)));
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    first_non_finite(all.iter().map(|(n, v)| (n.as_str(), *v))).map(|(n, v)| (n.to_string(), v))
}

/// The spec fingerprint recorded in checkpoints (see the module doc).
pub fn spec_hash(spec: &ModelSpec) -> String {
    format!("{:016x}", fnv1a64(canonical_value(spec).to_string().as_bytes()))
}

/// Writes a checkpoint atomically. `optimizer` is omitted for weights-only files.
pub fn save(
    path: &Path,
    spec: &ModelSpec,
    params: &ParamSet,
    optimizer: Option<&Optimizer>,
    state: &TrainState,
) -> Result<(), CheckpointError> {
    save_with_data(path, spec, params, optimizer, state, None, None)
}

/// [`save`], recording the identity of the data the run trains on.
pub fn save_with_data(
    path: &Path,
    spec: &ModelSpec,
    params: &ParamSet,
    optimizer: Option<&Optimizer>,
    state: &TrainState,
    data: Option<&DataIdentity>,
    tokenizer: Option<&TokenizerSpec>,
) -> Result<(), CheckpointError> {
    let ser_err = |message: String| CheckpointError::Serialize { path: path.to_path_buf(), message };
    if optimizer.is_some_and(|opt| opt.moments_on_device()) {
        return Err(CheckpointError::MomentsOnDevice { path: path.to_path_buf() });
    }
    if let Some((tensor, value)) = first_non_finite_state(params, optimizer) {
        return Err(CheckpointError::NonFiniteSave { path: path.to_path_buf(), tensor, value });
    }
    // Each tensor is encoded as the file is written, one at a time: a copy of
    // the whole state would add its size again to the run's peak memory
    // (docs/performance.md, "Memory").
    let mut tensors = Vec::new();
    for p in params.iter() {
        tensors.push((p.name.clone(), F32Tensor::new(p.shape.dims().to_vec(), &p.value).map_err(ser_err)?));
    }
    if let Some(opt) = optimizer {
        for (name, dims, values) in opt.state_tensors() {
            tensors.push((name, F32Tensor::new(dims.to_vec(), values).map_err(ser_err)?));
        }
    }
    let spec_json = serde_json::to_string(spec).map_err(|e| ser_err(e.to_string()))?;
    let mut metadata: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("format_version", FORMAT_VERSION.to_string()),
        ("spec", spec.to_ron()),
        ("spec_json", spec_json),
        ("spec_hash", spec_hash(spec)),
        ("step", state.step.to_string()),
        match state.sampler {
            SamplerState::Random(words) => {
                ("data_rng", words.iter().map(|w| format!("{w:016x}")).collect::<Vec<_>>().join(" "))
            }
            SamplerState::Sequential { position } => ("data_position", position.to_string()),
        },
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(tokenizer) = tokenizer {
        let ron = ron::to_string(tokenizer).map_err(|e| ser_err(e.to_string()))?;
        metadata.insert("tokenizer".into(), ron);
    }
    if let Some(data) = data {
        metadata.insert("data_source".into(), data.source.clone());
        metadata.insert("data_bytes".into(), data.bytes.to_string());
        metadata.insert("data_sha256".into(), data.sha256.clone());
        // The absolute path the run read, resolved now, from the run's own working
        // folder: how `widen eval` finds a relative path as the run did.
        if let Ok(absolute) = std::fs::canonicalize(&data.source) {
            metadata.insert("data_path".into(), absolute.display().to_string());
        }
    }
    let metadata = Some(metadata);
    write_atomic(path, |tmp| {
        safetensors::tensor::serialize_to_file(tensors, &metadata, tmp).map_err(|e| match e {
            SafeTensorError::IoError(source) => CheckpointError::Io { path: path.to_path_buf(), source },
            other => ser_err(other.to_string()),
        })
    })
}

/// An f32 tensor of the state being saved, encoded to little-endian bytes
/// only when the file writer asks for it.
struct F32Tensor<'a> {
    dims: Vec<usize>,
    values: &'a [f32],
}

impl<'a> F32Tensor<'a> {
    /// Refuses dims that do not hold `values`, as `TensorView::new` does.
    fn new(dims: Vec<usize>, values: &'a [f32]) -> Result<F32Tensor<'a>, String> {
        let numel = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if numel != Some(values.len()) {
            return Err(format!("a tensor of shape {dims:?} cannot hold {} values", values.len()));
        }
        Ok(F32Tensor { dims, values })
    }
}

impl View for F32Tensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.dims
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(f32_bytes(self.values))
    }

    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// The temporary name a save of `path` writes first: `.<name>.tmp` beside it.
pub fn temp_path(path: &Path) -> PathBuf {
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{file_name}.tmp"))
}

/// Writes the file with `write` under the temporary name, syncs it, renames it over `path` and
/// syncs the folder, so `path` is either the old file or the whole new one. On
/// failure the temporary file is removed: a full disk must not fill up further
/// with partial checkpoints.
fn write_atomic(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), CheckpointError>,
) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let tmp = temp_path(path);
    let written = write(&tmp).and_then(|()| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .and_then(|f| f.sync_all())
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(io)
    });
    if let Err(e) = written {
        // Best effort: the write error is what the caller needs to see.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename is durable once the folder is synced; where a folder cannot be
    // opened for that (some platforms), the file itself is already synced.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The step recorded in a checkpoint's header, read without its tensors (the
/// training loop uses it to tell what a resume would replace in a run folder).
pub fn read_step(path: &Path) -> Result<u64, CheckpointError> {
    use std::io::Read;
    let corrupt = |message: String| CheckpointError::Corrupt { path: path.to_path_buf(), message };
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    // safetensors caps headers at 100 MB; a larger length is garbage, not a header to allocate.
    let n = usize::try_from(u64::from_le_bytes(len)).ok().filter(|&n| n <= 100_000_000);
    let n = n.ok_or_else(|| corrupt("header length is out of range".into()))?;
    let mut header = vec![0u8; n];
    file.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("header: {e}")))?;
    let step = header.get("__metadata__").and_then(|m| m.get("step")).and_then(|s| s.as_str());
    step.and_then(|s| s.parse().ok()).ok_or_else(|| corrupt("header has no numeric `step`".into()))
}

/// A checkpoint read into memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub path: PathBuf,
    /// The spec the checkpoint was written with.
    pub spec: ModelSpec,
    pub spec_hash: String,
    pub state: TrainState,
    /// The data the run trained on, when the file records it.
    pub data: Option<DataIdentity>,
    /// The absolute path of that data as the run resolved it (`data_path`), when recorded.
    pub data_path: Option<PathBuf>,
    /// The tokenizer behind the ids (`tokenizer`), when recorded.
    pub tokenizer: Option<TokenizerSpec>,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

/// `spec` or `sweep` when `bytes` are RON text of one (the first item after
/// comments is `Model(`/`(` or `Sweep(`), so a mistaken argument is named as such.
fn ron_kind(bytes: &[u8]) -> Option<&'static str> {
    let text = std::str::from_utf8(bytes.get(..bytes.len().min(4096))?).ok()?;
    let mut rest = text.trim_start_matches('\u{feff}');
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.split_once('\n').map_or("", |(_, r)| r);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.split_once("*/").map_or("", |(_, r)| r);
        } else {
            break;
        }
    }
    if rest.starts_with("Sweep") {
        Some("sweep")
    } else if rest.starts_with("Model") || rest.starts_with('(') {
        Some("spec")
    } else {
        None
    }
}

impl Checkpoint {
    /// Reads and validates a checkpoint file (header, metadata and every tensor's dtype).
    pub fn read(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let corrupt = |message: String| CheckpointError::Corrupt { path: path.to_path_buf(), message };
        let bytes =
            std::fs::read(path).map_err(|source| CheckpointError::Io { path: path.to_path_buf(), source })?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| match ron_kind(&bytes) {
            Some(what) => CheckpointError::NotACheckpoint { path: path.to_path_buf(), what },
            None => corrupt(format!("{e:?}")),
        })?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(format!("{e:?}")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let field =
            |key: &str| meta.get(key).cloned().ok_or_else(|| corrupt(format!("header has no `{key}`")));
        if field("format")? != FORMAT {
            return Err(corrupt("not a widen checkpoint (header `format` differs)".into()));
        }
        let version = field("format_version")?;
        if version != FORMAT_VERSION {
            return Err(CheckpointError::Version { path: path.to_path_buf(), found: version });
        }
        let spec =
            ir::spec::parse_spec(&field("spec")?, "header `spec`").map_err(|e| corrupt(e.to_string()))?;
        let step = field("step")?.parse::<u64>().map_err(|e| corrupt(format!("header `step`: {e}")))?;
        let sampler = match (meta.get("data_rng"), meta.get("data_position")) {
            (Some(words), None) => {
                let words: Vec<u64> = words
                    .split_whitespace()
                    .map(|w| u64::from_str_radix(w, 16))
                    .collect::<Result<_, _>>()
                    .map_err(|e| corrupt(format!("header `data_rng`: {e}")))?;
                SamplerState::Random(
                    words.try_into().map_err(|_| corrupt("header `data_rng` must hold four words".into()))?,
                )
            }
            (None, Some(position)) => SamplerState::Sequential {
                position: position.parse().map_err(|e| corrupt(format!("header `data_position`: {e}")))?,
            },
            (Some(_), Some(_)) => {
                return Err(corrupt(
                    "header has both `data_rng` and `data_position`; a run has one sampler".into(),
                ))
            }
            (None, None) => return Err(corrupt("header has no `data_rng` (nor `data_position`)".into())),
        };
        let tokenizer = match meta.get("tokenizer") {
            Some(text) => Some(
                ron::from_str::<TokenizerSpec>(text)
                    .map_err(|e| corrupt(format!("header `tokenizer`: {e}")))?,
            ),
            None => None,
        };
        let data = match (meta.get("data_source"), meta.get("data_bytes"), meta.get("data_sha256")) {
            (Some(source), Some(bytes), Some(sha256)) => Some(DataIdentity {
                source: source.clone(),
                bytes: bytes.parse().map_err(|e| corrupt(format!("header `data_bytes`: {e}")))?,
                sha256: sha256.clone(),
            }),
            _ => None,
        };
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            if view.dtype() != Dtype::F32 {
                return Err(CheckpointError::TensorDType {
                    path: path.to_path_buf(),
                    tensor: name,
                    got: format!("{:?}", view.dtype()),
                });
            }
            let values: Vec<f32> =
                view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            tensors.insert(name, (view.shape().to_vec(), values));
        }
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        let bad = first_non_finite(names.into_iter().map(|n| (n.as_str(), tensors[n].1.as_slice())));
        if let Some((tensor, value)) = bad {
            return Err(CheckpointError::NonFiniteTensor {
                path: path.to_path_buf(),
                tensor: tensor.to_string(),
                value,
            });
        }
        Ok(Checkpoint {
            path: path.to_path_buf(),
            spec,
            spec_hash: field("spec_hash")?,
            state: TrainState { step, sampler },
            data,
            tokenizer,
            data_path: meta.get("data_path").map(PathBuf::from),
            tensors,
        })
    }

    /// Whether a run of `spec` may continue from this checkpoint: errors naming
    /// the fields that differ outside [`RESUMABLE_FIELDS`] (see the module doc);
    /// otherwise returns the resumable fields that `spec` changes.
    pub fn check_spec(&self, spec: &ModelSpec) -> Result<Vec<String>, CheckpointError> {
        let mut differences = Vec::new();
        diff_values("", &frozen_value(&self.spec), &frozen_value(spec), &mut differences);
        if !differences.is_empty() {
            return Err(CheckpointError::SpecMismatch { path: self.path.clone(), differences });
        }
        let mut paths = Vec::new();
        let (ours, theirs) = (serde_json::to_value(&self.spec), serde_json::to_value(spec));
        if let (Ok(a), Ok(b)) = (ours, theirs) {
            diff_values("", &a, &b, &mut paths);
        }
        // Name the field, not the path inside its value (`train.data`, not
        // `train.data.Text`; `train.schedule.warmup`, not `train.schedule.Cosine.warmup`).
        let mut changed: Vec<String> = Vec::new();
        for path in paths {
            let field = RESUMABLE_FIELDS.iter().find(|f| {
                path == **f
                    || path.starts_with(&format!("{f}."))
                    || (**f == "train.schedule.warmup"
                        && path.starts_with("train.schedule.")
                        && path.ends_with(".warmup"))
            });
            let name = field.map_or(path, |f| f.to_string());
            if !changed.contains(&name) {
                changed.push(name);
            }
        }
        Ok(changed)
    }

    /// Every tensor (parameters and optimizer state) as `(name, shape, values)`, sorted by name.
    pub fn tensors(&self) -> Vec<(&str, &[usize], &[f32])> {
        let mut all: Vec<(&str, &[usize], &[f32])> =
            self.tensors.iter().map(|(n, (s, v))| (n.as_str(), s.as_slice(), v.as_slice())).collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        all
    }

    fn take(&self, name: &str, dims: &[usize]) -> Result<&[f32], CheckpointError> {
        let (shape, values) = self.tensors.get(name).ok_or_else(|| CheckpointError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })?;
        if shape != dims {
            return Err(CheckpointError::TensorShape {
                path: self.path.clone(),
                tensor: name.to_string(),
                expected: dims.to_vec(),
                got: shape.clone(),
            });
        }
        Ok(values)
    }

    /// Copies the parameters into `params`. Every parameter must be present with
    /// its shape, and the file must hold no parameter the model lacks.
    pub fn restore_params(&self, params: &mut ParamSet) -> Result<(), CheckpointError> {
        let mut names: Vec<&String> = self.tensors.keys().filter(|n| !n.starts_with("opt.")).collect();
        names.sort();
        if let Some(extra) = names.into_iter().find(|n| params.get(n).is_none()) {
            return Err(CheckpointError::UnexpectedTensor { path: self.path.clone(), tensor: extra.clone() });
        }
        for p in params.iter_mut() {
            let values = self.take(&p.name, p.shape.dims())?;
            p.value.copy_from_slice(values);
        }
        Ok(())
    }

    /// Restores optimizer moments and step count.
    pub fn restore_optimizer(&self, optimizer: &mut Optimizer) -> Result<(), CheckpointError> {
        for (name, dims, values) in optimizer.state_tensors_mut() {
            values.copy_from_slice(self.take(&name, dims)?);
        }
        optimizer.set_steps_taken(self.state.step);
        Ok(())
    }
}

/// Collects the paths (`train.optimizer...`) where two JSON trees differ, at most 8.
fn diff_values(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    if out.len() >= 8 || a == b {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let sub = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match (x.get(k), y.get(k)) {
                    (Some(va), Some(vb)) => diff_values(&sub, va, vb, out),
                    _ => out.push(sub),
                }
            }
        }
        _ => out.push(if path.is_empty() { "spec".into() } else { path.to_string() }),
    }
}
