//! The PyTorch loader's checks (`python/widen_torch.py`, docs/checkpoints.md, "Reading a
//! checkpoint from Python"): `python/test_hostile_checkpoints.py` writes malformed and
//! lying checkpoints and asserts that each is refused with its specific message, and
//! that the checkpoints this widen writes pass. It needs only the Python standard
//! library, so it runs wherever `python3` does (no numpy or torch).

use std::path::Path;
use std::process::Command;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn the_python_loader_refuses_hostile_checkpoints() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: `python3` is not on PATH (python/test_hostile_checkpoints.py needs it)");
        return;
    }
    let out = Command::new("python3")
        .arg(repo("python/test_hostile_checkpoints.py"))
        .arg("-v")
        .env("WIDEN", env!("CARGO_BIN_EXE_widen"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python/test_hostile_checkpoints.py failed:\n{stderr}");
    // With WIDEN set, the checkpoints this widen writes were made and checked (a test
    // per line with -v: `test_name (module.Class...) ... ok`), not skipped.
    let ran =
        |test: &str| stderr.lines().any(|l| l.starts_with(&format!("{test} (")) && l.ends_with("... ok"));
    for test in ["test_widen_checkpoints_pass", "test_widen_huge_layers", "test_widen_overlapping_offsets"] {
        assert!(ran(test), "{test} did not run and pass:\n{stderr}");
    }
}

/// The loader's `SPEC_LIMITS`: the JSON literal between its BEGIN and END lines.
fn loader_limits() -> serde_json::Map<String, serde_json::Value> {
    let source = std::fs::read_to_string(repo("python/widen_torch.py")).unwrap();
    let start =
        source.find("# BEGIN SPEC_LIMITS\n").expect("python/widen_torch.py has a BEGIN SPEC_LIMITS line");
    let end = source.find("# END SPEC_LIMITS").expect("python/widen_torch.py has an END SPEC_LIMITS line");
    let literal = source[start..end].split_once('\n').unwrap().1.trim();
    let json = literal.strip_prefix("SPEC_LIMITS = ").expect("the block assigns SPEC_LIMITS");
    let value: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("SPEC_LIMITS is not JSON: {e}"));
    value.as_object().expect("SPEC_LIMITS is an object").clone()
}

#[test]
fn the_python_loader_applies_the_spec_limits_widen_applies() {
    let limits = loader_limits();
    assert!(limits.len() >= 10, "SPEC_LIMITS has {} rows", limits.len());
    for (path, row) in &limits {
        let rust = ir::spec::limits::integer_limit(path).unwrap_or_else(|| {
            panic!("SPEC_LIMITS row `{path}` is no integer field of ir/src/spec/limits.rs")
        });
        let want = serde_json::json!([rust.min, rust.max, rust.why]);
        assert_eq!(row, &want, "SPEC_LIMITS[{path:?}] differs from INTEGER_LIMITS");
    }
    let source = std::fs::read_to_string(repo("python/widen_torch.py")).unwrap();
    let conv = format!("MAX_CONV_KERNELS = {}\n", ir::spec::limits::MAX_CONV_KERNELS);
    assert!(source.contains(&conv), "python/widen_torch.py must say `{}`", conv.trim());
}
