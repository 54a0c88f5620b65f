//! `widen train --steps 0`, `widen eval` and resuming on other data, as a user runs them.

mod common;

use common::{safetensors_f32, safetensors_header, stderr, widen};
use std::path::Path;

const SPEC: &str = r#"Model(
    name: "cli-eval",
    vocab: 256, d_model: 16, layers: 1, heads: 2,
    train: (seq_len: 16, batch: 2, steps: 4, eval_every: 2, eval_batches: 3, checkpoint_every: 2,
            optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 1)),
)
"#;

/// `(step, loss, val_loss)` of each line of a run's metrics.
fn metrics(run: &Path) -> Vec<(u64, f64, Option<f64>)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap(), v["val_loss"].as_f64()))
        .collect()
}

/// The number after `key` on the line of `stdout` that starts with it.
fn printed(stdout: &str, key: &str) -> f64 {
    let line = stdout.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key} in {stdout}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn steps_zero_writes_an_initial_checkpoint_that_sample_eval_and_resume_read() {
    let dir = common::workdir("eval-init", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "init", "--device", "reference"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let init = dir.join("init/init.safetensors");
    assert!(init.exists(), "{}", stderr(&o));
    assert!(metrics(&dir.join("init")).is_empty(), "nothing was trained");
    let meta = &safetensors_header(&init)["__metadata__"];
    assert_eq!(meta["step"], "0");
    assert_eq!(meta["data_source"], "synthetic:Default");
    assert_eq!(meta["data_sha256"].as_str().unwrap().len(), 64);
    // The embedded spec keeps its planned step budget (a spec needs train.steps >= 1).
    let spec: serde_json::Value = serde_json::from_str(meta["spec_json"].as_str().unwrap()).unwrap();
    assert_eq!(spec["train"]["steps"], 4);

    // A second initialization into the same folder is refused, naming the file.
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "init"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("init.safetensors"), "{}", stderr(&o));

    let o = widen(
        &dir,
        &["sample", "init/init.safetensors", "--prompt", "Hi", "--tokens", "5", "--device", "reference"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // Untrained: about ln 256 nats (8 bits) per byte.
    let o = widen(&dir, &["eval", "init/init.safetensors", "--device", "reference"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bits = printed(&String::from_utf8_lossy(&o.stdout), "bits_per_byte");
    assert!((bits - 8.0).abs() < 0.5, "{bits}");

    // Resuming from it is a fresh run, bit for bit.
    let o = widen(
        &dir,
        &["train", "spec.ron", "--device", "reference", "--out", "init", "--resume", "init/init.safetensors"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--out", "fresh"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&dir.join("init")).len(), 4);
    assert_eq!(metrics(&dir.join("init")), metrics(&dir.join("fresh")));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eval_reports_the_validation_loss_training_logged_and_dumps_a_batch() {
    let dir = common::workdir("eval-dump", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let logged = metrics(&dir.join("run")).last().unwrap().2.unwrap();
    let o = widen(&dir, &["eval", "run/final.safetensors", "--device", "reference", "--dump", "dump"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let val = printed(&out, "val_loss");
    assert!((val - logged).abs() < 1e-5, "eval {val}, training logged {logged}\n{out}");
    assert!((printed(&out, "bits_per_byte") - val / std::f64::consts::LN_2).abs() < 1e-5, "{out}");
    // Fewer batches score a prefix of the same windows: a different mean.
    let o = widen(&dir, &["eval", "run/final.safetensors", "--device", "reference", "--batches", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("validation batches 1 of 2 x 16"));

    let dump = dir.join("dump");
    let tokens = &safetensors_header(&dump.join("batch.safetensors"))["tokens"];
    assert_eq!(tokens["dtype"], "I32");
    assert_eq!(tokens["shape"], serde_json::json!([2, 17]));
    let logits = &safetensors_header(&dump.join("logits.safetensors"))["logits"];
    assert_eq!(logits["shape"], serde_json::json!([2, 16, 256]));
    let loss = safetensors_f32(&dump.join("loss.safetensors"), "loss");
    let loss_main = safetensors_f32(&dump.join("loss.safetensors"), "loss_main");
    assert_eq!(loss.len(), 1);
    assert!((loss[0] - loss_main[0]).abs() < 1e-4 * loss[0], "no MTP: {loss:?} {loss_main:?}");
    // One gradient per parameter, under the checkpoint's names and shapes.
    let ckpt = safetensors_header(&dir.join("run/final.safetensors"));
    let grads = safetensors_header(&dump.join("grads.safetensors"));
    let params: Vec<(&String, &serde_json::Value)> = ckpt
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.starts_with("opt.") && *k != "__metadata__")
        .collect();
    let names: Vec<&String> = grads.as_object().unwrap().keys().filter(|k| *k != "__metadata__").collect();
    assert_eq!(names, params.iter().map(|(k, _)| *k).collect::<Vec<_>>());
    for (name, entry) in params {
        assert_eq!(grads[name]["shape"], entry["shape"], "{name}");
    }
    let g = safetensors_f32(&dump.join("grads.safetensors"), "blocks.0.attn.wq");
    assert!(g.iter().any(|v| *v != 0.0));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eval_errors_name_the_file() {
    let dir = common::workdir("eval-errors", Some(SPEC));
    let o = widen(&dir, &["eval", "absent.safetensors"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("absent.safetensors"), "{}", stderr(&o));
    std::fs::write(dir.join("bad.safetensors"), b"not a checkpoint at all").unwrap();
    let o = widen(&dir, &["eval", "bad.safetensors"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("bad.safetensors") && e.contains("corrupt"), "{e}");
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = widen(&dir, &["eval", "run/init.safetensors", "--data", "absent.txt", "--device", "reference"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("absent.txt"), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn resuming_on_other_data_works_and_says_so() {
    let dir = common::workdir("eval-newdata", Some(SPEC));
    std::fs::write(dir.join("a.txt"), "the quick brown fox jumps over the lazy dog. ".repeat(20)).unwrap();
    std::fs::write(dir.join("b.txt"), "pack my box with five dozen liquor jugs! ".repeat(20)).unwrap();
    std::fs::copy(dir.join("a.txt"), dir.join("a-copy.txt")).unwrap();
    let train =
        ["train", "spec.ron", "--device", "reference", "--data", "a.txt", "--steps", "2", "--out", "a"];
    let o = widen(&dir, &train);
    assert!(o.status.success(), "{}", stderr(&o));
    let meta = safetensors_header(&dir.join("a/final.safetensors"))["__metadata__"].clone();
    assert_eq!(meta["data_source"], "a.txt");
    assert_eq!(meta["data_bytes"], "900");

    let resume =
        ["train", "spec.ron", "--device", "reference", "--steps", "4", "--resume", "a/final.safetensors"];
    let o = widen(&dir, &[&resume[..], &["--data", "b.txt", "--out", "b"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("different data") && e.contains("a.txt") && e.contains("b.txt"), "{e}");
    assert_eq!(metrics(&dir.join("b")).len(), 4);
    assert_eq!(safetensors_header(&dir.join("b/final.safetensors"))["__metadata__"]["data_source"], "b.txt");

    // The same bytes under another path: a note that says so, not a warning.
    let o = widen(&dir, &[&resume[..], &["--data", "a-copy.txt", "--out", "copy"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("same bytes") && !e.contains("different data"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `SPEC` training on `data/a.txt` (a relative path, as specs name their data).
const SPEC_ON_FILE: &str = r#"Model(
    name: "cli-eval-file",
    vocab: 256, d_model: 16, layers: 1, heads: 2,
    train: (seq_len: 16, batch: 2, steps: 2, eval_every: 2, eval_batches: 3, checkpoint_every: 0,
            optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 1), data: Text("data/a.txt")),
)
"#;

/// The short SHA-256 `widen eval` prints on its `data` line (`... sha256 0123456789ab…)`).
fn printed_sha(stdout: &str) -> String {
    let line =
        stdout.lines().find(|l| l.starts_with("data ")).unwrap_or_else(|| panic!("no data in {stdout}"));
    line.split("sha256 ").nth(1).unwrap().trim_end_matches(['…', ')']).to_string()
}

#[test]
fn eval_without_data_finds_the_runs_data_and_refuses_other_bytes() {
    /// Rewrites a safetensors file without one `__metadata__` entry.
    fn drop_metadata(path: &std::path::Path, key: &str) {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        header["__metadata__"].as_object_mut().unwrap().remove(key).expect("the entry exists");
        let mut text = serde_json::to_vec(&header).unwrap();
        while !text.len().is_multiple_of(8) {
            text.push(b' ');
        }
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend(text);
        out.extend(&bytes[8 + n..]);
        std::fs::write(path, out).unwrap();
    }

    let dir = common::workdir("eval-identity", Some(SPEC_ON_FILE));
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(dir.join("data/a.txt"), "the quick brown fox jumps over the lazy dog. ".repeat(20))
        .unwrap();
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let logged = metrics(&dir.join("run")).last().unwrap().2.unwrap();
    let recorded = safetensors_header(&dir.join("run/final.safetensors"))["__metadata__"]["data_sha256"]
        .as_str()
        .unwrap()
        .to_string();

    // The checkpoint records the absolute path the run resolved.
    let header = safetensors_header(&dir.join("run/final.safetensors"));
    let absolute = std::fs::canonicalize(dir.join("data/a.txt")).unwrap();
    assert_eq!(header["__metadata__"]["data_path"].as_str(), Some(absolute.to_str().unwrap()));

    // From another folder that has a `data/a.txt` of its own, with other bytes:
    // the run's file is read from the recorded path, and the other one is not looked at.
    let other = dir.join("other");
    std::fs::create_dir_all(other.join("data")).unwrap();
    std::fs::write(other.join("data/a.txt"), "pack my box with five dozen liquor jugs! ".repeat(30)).unwrap();
    let o = widen(&other, &["eval", "../run/final.safetensors", "--device", "reference"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let val = printed(&out, "val_loss");
    assert!((val - logged).abs() < 1e-5, "eval {val}, training logged {logged}\n{out}");
    assert!(recorded.starts_with(&printed_sha(&out)), "{out}");
    assert!(!stderr(&o).contains("other data"), "{}", stderr(&o));

    // A checkpoint without `data_path` (an older widen): the run's file is found above
    // the checkpoint, the other one passed over with a note.
    drop_metadata(&dir.join("run/final.safetensors"), "data_path");
    let o = widen(&other, &["eval", "../run/final.safetensors", "--device", "reference"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!((printed(&out, "val_loss") - logged).abs() < 1e-5, "{out}");
    assert!(stderr(&o).contains("data/a.txt") && stderr(&o).contains("other data"), "{}", stderr(&o));

    // The other file's hash, as eval reports it when asked to score it on purpose;
    // it says that this is not the run's data.
    let o =
        widen(&other, &["eval", "../run/final.safetensors", "--device", "reference", "--data", "data/a.txt"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let other_sha = printed_sha(&String::from_utf8_lossy(&o.stdout));
    assert!(!recorded.starts_with(&other_sha));
    let e = stderr(&o);
    assert!(
        e.contains("--data file data/a.txt") && e.contains("not the data the checkpoint was trained on"),
        "{e}"
    );

    // Once the run's own file has changed, no file holds its bytes: refused,
    // naming the file, both hashes and the way to score other data.
    std::fs::write(dir.join("data/a.txt"), "changed ".repeat(200)).unwrap();
    let o = widen(&other, &["eval", "../run/final.safetensors", "--device", "reference"]);
    assert!(!o.status.success());
    assert!(o.stdout.is_empty(), "no loss of other data is printed");
    let e = stderr(&o);
    for needle in ["data/a.txt", &recorded[..12], &other_sha, "--data FILE"] {
        assert!(e.contains(needle), "missing {needle:?} in {e}");
    }

    // And with no file of that name anywhere: refused, naming the paths tried.
    std::fs::remove_file(dir.join("data/a.txt")).unwrap();
    std::fs::remove_file(other.join("data/a.txt")).unwrap();
    let o = widen(&other, &["eval", "../run/final.safetensors", "--device", "reference"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("cannot find data/a.txt") && e.contains(&recorded[..12]) && e.contains("--data FILE"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eval_data_errors_say_each_fact_once_and_name_the_data_flag() {
    let dir = common::workdir("eval-chain", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = widen(&dir, &["eval", "run/init.safetensors", "--data", "absent.txt", "--device", "reference"]);
    assert!(!o.status.success());
    assert_eq!(
        stderr(&o),
        "error: evaluating run/init.safetensors: the --data file: cannot read training text absent.txt: \
         No such file or directory (os error 2)\n"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eval_dump_refuses_to_replace_a_dump_without_force() {
    let dir = common::workdir("eval-dump-force", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::create_dir_all(dir.join("dump")).unwrap();
    std::fs::write(dir.join("dump/grads.safetensors"), b"kept").unwrap();
    let eval = ["eval", "run/init.safetensors", "--device", "reference", "--dump", "dump"];
    let o = widen(&dir, &eval);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("dump/grads.safetensors") && e.contains("--force"), "{e}");
    assert_eq!(std::fs::read(dir.join("dump/grads.safetensors")).unwrap(), b"kept");
    assert!(!dir.join("dump/batch.safetensors").exists(), "nothing is written by a refused dump");

    let o = widen(&dir, &[&eval[..], &["--force"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(safetensors_header(&dir.join("dump/grads.safetensors")).get("blocks.0.attn.wq").is_some());
    // A second dump over the first is refused too.
    let o = widen(&dir, &eval);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("batch.safetensors"), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Runs `widen ARGS` in `dir`, killing it after `secs` seconds: a command that
/// should refuse at once fails the test instead of hanging it.
fn widen_within(dir: &Path, args: &[&str], secs: u64) -> std::process::Output {
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(secs) {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!("widen {args:?} still ran after {secs} s\n{}", stderr(&o));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn eval_batches_out_of_range_is_refused_at_once() {
    let dir = common::workdir("eval-batches", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for bad in ["1000000000000", "100001", "0"] {
        let o = widen_within(
            &dir,
            &["eval", "run/init.safetensors", "--device", "reference", "--batches", bad],
            60,
        );
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains("--batches") && e.contains(bad) && e.contains("1..=100000"), "{e}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_fifo_or_device_as_data_is_refused_promptly_naming_it() {
    let dir = common::workdir("eval-fifo", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let made = std::process::Command::new("mkfifo").arg(dir.join("pipe.txt")).status().unwrap();
    assert!(made.success());
    let eval = |data: &str| {
        widen_within(&dir, &["eval", "run/init.safetensors", "--device", "reference", "--data", data], 60)
    };
    for (data, kind) in [("pipe.txt", "a FIFO"), ("/dev/null", "a character device"), (".", "a folder")] {
        let o = eval(data);
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains(&format!("training text {data} is {kind}")), "{e}");
    }
    let train =
        ["train", "spec.ron", "--device", "reference", "--steps", "1", "--out", "t", "--data", "pipe.txt"];
    let o = widen_within(&dir, &train, 60);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("training text pipe.txt is a FIFO"), "{}", stderr(&o));

    // A symlink to a regular file is a regular file.
    std::fs::write(dir.join("text.txt"), "the quick brown fox jumps over the lazy dog. ".repeat(20)).unwrap();
    std::os::unix::fs::symlink("text.txt", dir.join("link.txt")).unwrap();
    let o = eval("link.txt");
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sample_refuses_meaningless_flags_naming_the_flag_and_range() {
    let dir = common::workdir("sample-flags", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--steps", "0", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cases: [(&str, &str, &str); 7] = [
        ("--top-k", "0", "1..=256"),
        ("--top-k", "257", "1..=256"),
        ("--temperature", "nan", "finite number >= 0"),
        ("--temperature", "-1", "finite number >= 0"),
        ("--temperature", "inf", "finite number >= 0"),
        ("--tokens", "0", "1..=1048576"),
        ("--tokens", "1048577", "1..=1048576"),
    ];
    for (flag, value, valid) in cases {
        let o = widen(
            &dir,
            &["sample", "run/init.safetensors", "--prompt", "Hi", "--device", "reference", flag, value],
        );
        assert!(!o.status.success(), "{flag} {value} was accepted");
        let e = stderr(&o);
        assert!(
            e.contains(flag) && e.contains(&format!("'{value}'")) && e.contains(valid),
            "{flag} {value}: {e}"
        );
    }
    let o = widen(
        &dir,
        &[
            "sample",
            "run/init.safetensors",
            "--prompt",
            "Hi",
            "--device",
            "reference",
            "--top-k",
            "1",
            "--tokens",
            "3",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_spec_given_for_a_checkpoint_is_named_as_a_spec() {
    let dir = common::workdir("spec-for-ckpt", Some("// a spec\nModel(name: \"x\")\n"));
    for cmd in ["sample", "eval"] {
        let args: &[&str] =
            if cmd == "sample" { &["sample", "spec.ron", "--prompt", "a"] } else { &["eval", "spec.ron"] };
        let o = widen(&dir, args);
        assert_eq!(o.status.code(), Some(1), "{cmd}");
        let e = stderr(&o);
        assert!(
            e.contains("spec.ron is a spec file, not a checkpoint") && e.contains("widen train spec.ron"),
            "{cmd}: {e}"
        );
        assert!(!e.contains("corrupt"), "{cmd}: {e}");
    }
    std::fs::write(dir.join("sweep.ron"), "Sweep(base: \"spec.ron\", budget: Steps(2))").unwrap();
    let e = stderr(&widen(&dir, &["eval", "sweep.ron"]));
    assert!(e.contains("sweep.ron is a sweep file, not a checkpoint"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
