//! `widen build SPEC -o PATH` as a user runs it: the standalone binary trains
//! with no spec file around and writes the metrics `widen train` writes.

mod common;

use common::stderr;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn spec_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/tiny.ron")
}

/// `widen` with its kernel and build caches in `cache`.
fn widen(cache: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_widen"));
    cmd.env("WIDEN_CACHE_DIR", cache);
    cmd
}

/// The per-step records of a run, without the wall-clock throughput.
fn metrics(run: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("tokens_per_s").expect("every step records its throughput");
            v
        })
        .collect()
}

/// Builds with `--profile dev` (unoptimised: it compiles in less than half the time of the
/// default `release`, which runs the same code path with another cargo argument) into the
/// workspace's target folder (`CARGO_TARGET_DIR`), so reruns reuse the compiled runtime.
#[test]
fn slow_built_binary_trains_like_widen_train_without_the_spec() {
    let dir = common::workdir("build-train", None);
    let cache = dir.join("cache");
    let target =
        Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("target/tmp is inside the target folder");
    let bin = dir.join("out/tiny-bin");
    let build = |output: &Path| {
        let o = widen(&cache)
            .env("CARGO_TARGET_DIR", target)
            .arg("build")
            .args(["--profile", "dev"])
            .arg(spec_path())
            .arg("-o")
            .arg(output)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };
    let first = build(&bin);
    assert!(first.contains("kernels") && first.contains("launch steps"), "{first}");
    // cargo's build is shown while it runs (a plain line in a log) and when it ends.
    assert!(first.contains("cargo build --profile dev --offline: done in"), "{first}");
    assert!(!first.contains('\r') && !first.contains('\x1b'), "no control codes in a log: {first:?}");

    // No spec anywhere near the binary: an empty working folder.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let run_bin = |args: &[&str]| {
        let o = Command::new(&bin)
            .current_dir(&empty)
            .env("WIDEN_CACHE_DIR", &cache)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        o
    };
    let run_widen = |args: &[&str]| {
        let o = widen(&cache).arg("train").arg(spec_path()).args(args).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    for (device, steps) in [("cpu", "3"), ("reference", "2")] {
        let (a, b) = (dir.join(format!("bin-{device}")), dir.join(format!("widen-{device}")));
        run_bin(&["--steps", steps, "--device", device, "--out", a.to_str().unwrap()]);
        run_widen(&["--steps", steps, "--device", device, "--out", b.to_str().unwrap()]);
        let (ours, theirs) = (metrics(&a), metrics(&b));
        assert_eq!(ours.len(), steps.parse::<usize>().unwrap(), "one record per step on {device}");
        assert!(ours.iter().all(|r| r["loss"].is_f64() && r["device"] == device), "{ours:?}");
        // Same init, batches and Plan: loss, lr, gradient norm and validation loss bit for bit.
        assert_eq!(ours, theirs, "{device}: the binary's metrics differ from widen train's");
        assert!(a.join("final.safetensors").is_file());
    }

    // Under a launcher of several processes a binary built without MPI refuses instead of
    // training copies (one with MPI trains across them: tests/cli_mpi.rs).
    let o = Command::new(&bin)
        .current_dir(&empty)
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .args(["--steps", "1", "--device", "reference"])
        .output()
        .unwrap();
    let refused = stderr(&o);
    assert!(!o.status.success() && refused.contains("independent copies"), "{refused}");
    assert!(refused.contains("--features mpi"), "says how to enable MPI: {refused}");
    assert!(!empty.join("runs").exists(), "nothing is trained");

    let help = run_bin(&["--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("`tiny`") && help.contains("--steps") && help.contains("tiny-bin"), "{help}");
    let o = Command::new(&bin).current_dir(&empty).arg("--stepz").output().unwrap();
    assert!(!o.status.success() && stderr(&o).contains("--stepz"), "{}", stderr(&o));

    // A second build of the same spec reuses the generated package (the binary
    // itself is relinked only if the widen sources changed in between).
    let package = std::fs::read_dir(cache.join("build")).unwrap().next().unwrap().unwrap().path();
    let written = |f: &str| std::fs::metadata(package.join(f)).and_then(|m| m.modified()).unwrap();
    let before = (written("src/main.rs"), written("src/plan.json"));
    let again = dir.join("out/tiny-bin-2");
    build(&again);
    assert!(again.is_file());
    // Not one file of the package is written again (cargo rewrote its lock file on the
    // first build), so cargo finds nothing to compile.
    assert_eq!((written("src/main.rs"), written("src/plan.json")), before, "the package was rewritten");
    let packages = std::fs::read_dir(cache.join("build")).unwrap().count();
    assert_eq!(packages, 1, "one package folder; the target folder is the workspace's");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn build_errors_say_what_to_fix() {
    let dir = common::workdir("build-errors", None);
    let cache = dir.join("cache");
    let build = |cmd: &mut Command, output: &Path| {
        let o =
            cmd.env_remove("CARGO_TARGET_DIR").arg("build").arg(spec_path()).arg("-o").arg(output).output();
        let o = o.unwrap();
        assert!(!o.status.success());
        stderr(&o)
    };

    // An output path whose folder is a file: refused before anything is built.
    std::fs::write(dir.join("file"), "not a folder").unwrap();
    let e = build(&mut widen(&cache), &dir.join("file/tiny-bin"));
    assert!(e.contains("cannot write the binary to") && e.contains("file is a file, not a folder"), "{e}");
    let e = build(&mut widen(&cache), &dir);
    assert!(e.contains("is a folder"), "{e}");

    // No cargo.
    let e = build(widen(&cache).env("CARGO", dir.join("no-such-cargo")), &dir.join("a"));
    assert!(e.contains("cannot run cargo") && e.contains("no-such-cargo"), "{e}");

    // A failing cargo build shows the end of cargo's output (here rustc
    // rejecting a flag, before anything compiles).
    let e = build(widen(&cache).env("RUSTFLAGS", "--no-such-rustc-flag"), &dir.join("b"));
    assert!(e.contains("cargo build of") && e.contains("no-such-rustc-flag"), "{e}");
    assert!(!dir.join("b").exists(), "no binary after a failed build");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `widen build -o PATH` refuses, before building anything, to replace a file
/// that is not a trainer an earlier build wrote (unless `--force`), and never
/// replaces the spec itself.
#[test]
fn build_refuses_to_overwrite_what_it_did_not_build() {
    let dir = common::workdir("build-overwrite", None);
    let cache = dir.join("cache");
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "my notes").unwrap();
    let o = widen(&cache).arg("build").arg(spec_path()).arg("-o").arg(&notes).output().unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("notes.txt") && e.contains("--force"), "{e}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes");

    let spec = dir.join("spec.ron");
    std::fs::copy(spec_path(), &spec).unwrap();
    let text = std::fs::read_to_string(&spec).unwrap();
    let o = widen(&cache).arg("build").arg(&spec).arg("-o").arg(&spec).arg("--force").output().unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is the spec"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&spec).unwrap(), text);
    assert!(!cache.join("build").exists(), "refused before building");
    std::fs::remove_dir_all(dir).unwrap();
}
