//! `widen train` and `widen sample` as a user runs them.

mod common;

use common::{stderr, widen};

const SPEC: &str = r#"Model(
    name: "cli-tiny",
    vocab: 256, d_model: 16, layers: 1, heads: 2,
    train: (seq_len: 16, batch: 2, steps: 4, eval_every: 2, eval_batches: 1, checkpoint_every: 2,
            optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 1)),
)
"#;

#[test]
fn train_writes_the_run_folder_and_sample_continues_the_prompt() {
    let dir = common::workdir("train-train", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = dir.join("runs/cli-tiny");
    for f in ["metrics.jsonl", "ckpt-2.safetensors", "ckpt-4.safetensors", "final.safetensors"] {
        assert!(run.join(f).exists(), "missing {f}");
    }
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 4);
    assert!(stderr(&o).contains("step 4/4"), "{}", stderr(&o));

    // A second fresh run into the same folder is refused; --resume continues it.
    let o = widen(&dir, &["train", "spec.ron"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("metrics.jsonl"), "{}", stderr(&o));
    let o =
        widen(&dir, &["train", "spec.ron", "--resume", "runs/cli-tiny/ckpt-2.safetensors", "--steps", "6"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 6);

    let args =
        ["sample", "runs/cli-tiny/final.safetensors", "--prompt", "Hello", "--tokens", "10", "--seed", "3"];
    let a = widen(&dir, &args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(a.stdout.starts_with(b"Hello"));
    assert_eq!(a.stdout.len(), "Hello".len() + 10 + 1);
    assert_eq!(a.stdout, widen(&dir, &args).stdout, "same seed, same text");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn data_override_errors_name_the_file() {
    let dir = common::workdir("train-data", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--data", "absent.txt", "--out", "run"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("absent.txt"), "{}", stderr(&o));
    std::fs::write(dir.join("short.txt"), "too short").unwrap();
    let o = widen(&dir, &["train", "spec.ron", "--data", "short.txt", "--out", "run"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("short.txt") && e.contains("170"), "{e}");
    // A long enough file trains.
    let text: String = "the quick brown fox jumps over the lazy dog. ".repeat(20);
    std::fs::write(dir.join("ok.txt"), text).unwrap();
    let o = widen(&dir, &["train", "spec.ron", "--data", "ok.txt", "--out", "run", "--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sampling_a_corrupt_checkpoint_names_it() {
    let dir = common::workdir("train-corrupt", Some(SPEC));
    std::fs::write(dir.join("bad.safetensors"), b"\x08\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let o = widen(&dir, &["sample", "bad.safetensors", "--prompt", "x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("bad.safetensors"), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}
