//! Checkpoints: one safetensors file per save (DESIGN.md §7).
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
//! budget), `step` (optimizer steps taken) and `data_rng` (the training data
//! sampler's generator state, four hex words). Together with the optimizer
//! tensors this is everything a resumed run needs to continue bit for bit.
//!
//! Files are written to a temporary name and renamed into place, so an
//! interrupted save never destroys an earlier checkpoint.

use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::rng::fnv1a64;
use ir::spec::ModelSpec;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
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
    #[error("checkpoint {path} has format version {found}; this build reads version {FORMAT_VERSION}")]
    Version { path: PathBuf, found: String },
    #[error("checkpoint {path} was written for a different spec (differs at: {})", differences.join(", "))]
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
    /// The training data sampler's generator state.
    pub data_rng: [u64; 4],
}

fn canonical_value(spec: &ModelSpec) -> serde_json::Value {
    let mut s = spec.clone();
    s.train.steps = 0;
    serde_json::to_value(&s).expect("a ModelSpec always serializes to JSON")
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
    let ser_err = |message: String| CheckpointError::Serialize { path: path.to_path_buf(), message };
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for p in params.iter() {
        owned.push((p.name.clone(), p.shape.dims().to_vec(), f32_bytes(&p.value)));
    }
    if let Some(opt) = optimizer {
        if opt.moments_on_device() {
            return Err(CheckpointError::MomentsOnDevice { path: path.to_path_buf() });
        }
        for (name, dims, values) in opt.state_tensors() {
            owned.push((name, dims.to_vec(), f32_bytes(values)));
        }
    }
    let mut views = Vec::with_capacity(owned.len());
    for (name, dims, bytes) in &owned {
        let view = TensorView::new(Dtype::F32, dims.clone(), bytes).map_err(|e| ser_err(e.to_string()))?;
        views.push((name.as_str(), view));
    }
    let metadata: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("format_version", FORMAT_VERSION.to_string()),
        ("spec", spec.to_ron()),
        ("spec_hash", spec_hash(spec)),
        ("step", state.step.to_string()),
        ("data_rng", state.data_rng.iter().map(|w| format!("{w:016x}")).collect::<Vec<_>>().join(" ")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let bytes = safetensors::tensor::serialize(views, &Some(metadata)).map_err(|e| ser_err(e.to_string()))?;
    write_atomic(path, &bytes)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    use std::io::Write;
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.tmp"));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io)
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A checkpoint read into memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub path: PathBuf,
    /// The spec the checkpoint was written with.
    pub spec: ModelSpec,
    pub spec_hash: String,
    pub state: TrainState,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl Checkpoint {
    /// Reads and validates a checkpoint file (header, metadata and every tensor's dtype).
    pub fn read(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let corrupt = |message: String| CheckpointError::Corrupt { path: path.to_path_buf(), message };
        let bytes =
            std::fs::read(path).map_err(|source| CheckpointError::Io { path: path.to_path_buf(), source })?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| corrupt(format!("{e:?}")))?;
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
        let words: Vec<u64> = field("data_rng")?
            .split_whitespace()
            .map(|w| u64::from_str_radix(w, 16))
            .collect::<Result<_, _>>()
            .map_err(|e| corrupt(format!("header `data_rng`: {e}")))?;
        let data_rng: [u64; 4] =
            words.try_into().map_err(|_| corrupt("header `data_rng` must hold four words".into()))?;
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
        Ok(Checkpoint {
            path: path.to_path_buf(),
            spec,
            spec_hash: field("spec_hash")?,
            state: TrainState { step, data_rng },
            tensors,
        })
    }

    /// Errors unless `spec` has this checkpoint's hash, naming the fields that differ.
    pub fn check_spec(&self, spec: &ModelSpec) -> Result<(), CheckpointError> {
        if spec_hash(spec) == self.spec_hash {
            return Ok(());
        }
        let mut differences = Vec::new();
        diff_values("", &canonical_value(&self.spec), &canonical_value(spec), &mut differences);
        if differences.is_empty() {
            differences.push("spec_hash".into());
        }
        Err(CheckpointError::SpecMismatch { path: self.path.clone(), differences })
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
