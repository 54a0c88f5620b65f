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
