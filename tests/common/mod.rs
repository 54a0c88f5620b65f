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
