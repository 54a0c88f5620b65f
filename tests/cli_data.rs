//! `widen data prepare` as a user runs it (docs/data.md, docs/cli.md).

mod common;

use common::{stderr, widen};
use std::path::{Path, PathBuf};

fn shakespeare() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt");
    if path.is_file() {
        Some(path)
    } else {
        println!("skipping the tinyshakespeare case: {} is absent", path.display());
        None
    }
}

/// `(magic, version, count)` of an llm.c header, and the file's size.
fn header(path: &Path) -> (i32, i32, i32, u64) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let int = |k: usize| i32::from_le_bytes(bytes[4 * k..4 * k + 4].try_into().unwrap());
    (int(0), int(1), int(2), bytes.len() as u64)
}

#[test]
fn prepare_tinyshakespeare_with_gpt2_writes_shards_the_manifest_counts() {
    let Some(text) = shakespeare() else { return };
    let dir = common::workdir("data-prepare", None);
    let args =
        ["data", "prepare", text.to_str().unwrap(), "--tokenizer", "gpt2", "--out", "tok", "--shard-tokens"];
    let o = widen(&dir, &[&args[..], &["100000"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("vocab 50257") && stdout.contains("u16 llm.c shards"), "{stdout}");
    assert!(stdout.contains("Tokens(train: \"tok/tinyshakespeare_train_*.bin\""), "{stdout}");

    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tok/manifest.json")).unwrap()).unwrap();
    assert_eq!(m["tokenizer"], "Gpt2");
    assert_eq!(m["vocab"], 50257);
    assert_eq!(m["dtype"], "U16");
    assert_eq!(m["split"]["rule"], "lines");
    assert_eq!(m["sources"][0]["bytes"], std::fs::metadata(&text).unwrap().len());
    let mut total = 0;
    for split in ["train", "val"] {
        let files = m[split]["files"].as_array().unwrap();
        let mut sum = 0;
        for f in files {
            let (magic, version, count, size) = header(&dir.join("tok").join(f["name"].as_str().unwrap()));
            assert_eq!((magic, version), (20240520, 1));
            assert_eq!(count as u64, f["tokens"].as_u64().unwrap(), "{split}: {f}");
            assert_eq!(size, 1024 + 2 * count as u64);
            assert!(count <= 100_000);
            sum += count as u64;
        }
        assert_eq!(sum, m[split]["tokens"].as_u64().unwrap(), "{split}");
        total += sum;
    }
    // The train split spans several shards of 100000 tokens.
    assert!(m["train"]["files"].as_array().unwrap().len() >= 3, "{m}");
    // About nanoGPT's 338k tokens plus one <|endoftext|>.
    assert!((330_000..345_000).contains(&total), "{total}");

    // Again into the same folder: refused, then replaced with --force.
    let o = widen(&dir, &[&args[..], &["100000"]].concat());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("already holds token shards") && e.contains("--force"), "{e}");
    let o = widen(&dir, &[&args[..], &["1000000", "--force", "--split-like", "nanogpt"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tok/manifest.json")).unwrap()).unwrap();
    assert_eq!((m["train"]["tokens"].as_u64(), m["val"]["tokens"].as_u64()), (Some(301_966), Some(36_059)));
    assert_eq!(std::fs::read_dir(dir.join("tok")).unwrap().count(), 3, "stale shards were left");
}

#[test]
fn prepare_refuses_bad_inputs() {
    let dir = common::workdir("data-refuse", None);
    std::fs::write(dir.join("t.txt"), "one\ntwo\nthree\nfour\n").unwrap();
    let cases: [(&[&str], &[&str]); 5] = [
        (&["missing.txt", "--tokenizer", "bytes", "--out", "o"], &["missing.txt", "matches no file"]),
        (
            &["t.txt", "--tokenizer", "bytes", "--out", "o", "--val-fraction", "1"],
            &["--val-fraction 1", "between 0 and 1"],
        ),
        (
            &["t.txt", "--tokenizer", "bytes", "--out", "o", "--val-fraction", "0"],
            &["--val-fraction 0", "between 0 and 1"],
        ),
        (&["t.txt", "--tokenizer", "gpt3", "--out", "o"], &["--tokenizer", "\"gpt3\"", "gpt2"]),
        (&["t.txt", "--tokenizer", "nope.json", "--out", "o"], &["nope.json"]),
    ];
    for (args, want) in cases {
        let o = widen(&dir, &[&["data", "prepare"][..], args].concat());
        assert!(!o.status.success(), "{args:?}");
        let e = stderr(&o);
        for w in want {
            assert!(e.contains(w), "{args:?}: {w:?} not in {e}");
        }
        assert!(!e.contains("panicked"), "{e}");
    }
    assert!(!dir.join("o").exists(), "a refused run wrote its output folder");
}
