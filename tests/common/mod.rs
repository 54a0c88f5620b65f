//! Helpers of the CLI tests: fresh working folders, running the `widen` binary
//! as a user does, and the files it reads and writes.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty folder `widen-<tag>-<pid>` under cargo's scratch space for
/// integration tests, with `spec` written to `spec.ron` when given.
pub fn workdir(tag: &str, spec: Option<&str>) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("widen-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    if let Some(spec) = spec {
        std::fs::write(dir.join("spec.ron"), spec).unwrap();
    }
    dir
}

/// Runs `widen ARGS` in `dir`.
pub fn widen(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_widen")).current_dir(dir).args(args).output().unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The path of `specs/<file>` in this repository.
pub fn spec_file(file: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join(file).display().to_string()
}

/// The header of a safetensors file: `{name: {dtype, shape, data_offsets}, "__metadata__": {..}}`.
pub fn safetensors_header(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).unwrap()
}

/// The values of the f32 tensor `name` of a safetensors file.
pub fn safetensors_f32(path: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let entry = &header[name];
    assert_eq!(entry["dtype"], "F32", "{name} in {}", path.display());
    let (a, b) = (entry["data_offsets"][0].as_u64().unwrap(), entry["data_offsets"][1].as_u64().unwrap());
    bytes[8 + n + a as usize..8 + n + b as usize]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
