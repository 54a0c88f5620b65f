//! `widen train` on token shards from the command line (docs/data.md): `--data` tells
//! shards from text by their header, a dataset several times larger than the process's
//! memory limit trains, since shards are memory-mapped, never read whole.

mod common;

use common::{stderr, widen, workdir};
use std::io::Write;
use std::path::Path;

/// Writes an llm.c u16 shard of `tokens` ids below 256 without holding it in memory.
fn write_big_shard(path: &Path, tokens: usize) {
    let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path).unwrap());
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[20240520, 1, tokens as i32]);
    for h in header {
        file.write_all(&h.to_le_bytes()).unwrap();
    }
    let chunk: Vec<u8> =
        (0..1 << 16).flat_map(|i: u32| ((i * 31 + i / 7) as u16 % 256).to_le_bytes()).collect();
    let mut left = tokens * 2;
    while left > 0 {
        let n = left.min(chunk.len());
        file.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    file.flush().unwrap();
}

const SPEC: &str = r#"Model(
    name: "big",
    vocab: 256,
    d_model: 16,
    layers: 1,
    heads: 2,
    train: (seq_len: 16, batch: 2, steps: 3, eval_every: 3, eval_batches: 1, order: Sequential, schedule: Constant(warmup: 0)),
)"#;

/// `widen ARGS` in `dir` with the data segment (heap and private memory, not the
/// file-backed maps) limited to `kib` KiB.
fn widen_limited(dir: &Path, kib: u64, args: &[&str]) -> std::process::Output {
    let mut command = format!("ulimit -d {kib} && exec \"$0\"");
    for i in 0..args.len() {
        command.push_str(&format!(" \"${}\"", i + 1));
    }
    std::process::Command::new("sh")
        .current_dir(dir)
        .arg("-c")
        .arg(command)
        .arg(env!("CARGO_BIN_EXE_widen"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_token_set_four_times_the_memory_limit_trains() {
    let dir = workdir("tokens-big", Some(SPEC));
    // 512 Mi tokens of u16: 1 GiB of shard, four times the 256 MiB limit below.
    write_big_shard(&dir.join("big.bin"), 512 << 20);
    let limit_kib = 256 << 10;
    let out =
        widen_limited(&dir, limit_kib, &["train", "spec.ron", "--data", "big.bin", "--device", "reference"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // The run's first lines say what the data is and how it is read.
    assert!(err.contains("data: Tokens(train: \"big.bin\"): 1 llm.c u16 shard, 536870912 tokens"), "{err}");
    assert!(dir.join("runs/big/final.safetensors").is_file());
    // The limit binds: the same bytes read whole as a text file do not fit it.
    std::fs::write(dir.join("text.ron"), SPEC.replace("order: Sequential", "data: Text(\"big.bin\")"))
        .unwrap();
    let text =
        widen_limited(&dir, limit_kib, &["train", "text.ron", "--device", "reference", "--out", "text-run"]);
    assert!(!text.status.success(), "a 1 GiB text read whole under a 256 MiB limit: {}", stderr(&text));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn data_names_shards_by_their_header_and_anything_else_as_text() {
    let dir = workdir("tokens-sniff", Some(SPEC));
    write_big_shard(&dir.join("small.bin"), 4000);
    std::fs::write(dir.join("small.txt"), "hello widen ".repeat(400)).unwrap();
    for (data, kind) in
        [("small.bin", "1 llm.c u16 shard, 4000 tokens"), ("small.txt", "bytes as byte tokens")]
    {
        let run = format!("run-{data}");
        let out = widen(&dir, &["train", "spec.ron", "--data", data, "--device", "reference", "--out", &run]);
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert!(err.contains(kind), "{data}: {err}");
    }
    // A glob is shards; one that matches nothing says so.
    let out = widen(&dir, &["train", "spec.ron", "--data", "nothing_*.bin", "--device", "reference"]);
    let err = stderr(&out);
    assert!(!out.status.success() && err.contains("nothing_*.bin"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The shared corpus, when the repository sits beside `../shared`.
fn shakespeare() -> Option<std::path::PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt");
    if !path.is_file() {
        println!("skipping: {} is absent", path.display());
        return None;
    }
    Some(path)
}

/// The `val_loss` of the last line of a run's metrics.
fn logged_val_loss(run: &Path) -> f64 {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    last["val_loss"].as_f64().unwrap()
}

const GPT2_SPEC: &str = r#"Model(
    name: "gpt2-shakespeare",
    vocab: 50257,
    vocab_pad_to: 64,
    d_model: 16,
    layers: 1,
    heads: 2,
    train: (
        data: Tokens(train: "tok/shakespeare_train_*.bin", val: "tok/shakespeare_val_*.bin"),
        seq_len: 16, batch: 2, steps: 3, eval_every: 3, eval_batches: 2,
        schedule: Constant(warmup: 0),
    ),
)"#;

/// The whole path a user takes: prepare the corpus with GPT-2's tokenizer, train at the
/// padded vocabulary 50304 on the reference and Cpu devices, evaluate the checkpoint
/// (which reproduces the logged loss) and sample text from it through the tokenizer the
/// checkpoint records.
#[test]
fn gpt2_tokens_prepare_train_eval_and_sample() {
    let Some(text) = shakespeare() else { return };
    let dir = workdir("tokens-gpt2", Some(GPT2_SPEC));
    let text = text.display().to_string();
    let prepared = widen(
        &dir,
        &["data", "prepare", &text, "--tokenizer", "gpt2", "--out", "tok", "--name", "shakespeare"],
    );
    assert!(prepared.status.success(), "{}", stderr(&prepared));
    for device in ["reference", "cpu"] {
        let run = format!("run-{device}");
        let out = widen(&dir, &["train", "spec.ron", "--device", device, "--out", &run]);
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        assert!(err.contains("tokenizer gpt2"), "the manifest names the tokenizer: {err}");
        let header = common::safetensors_header(&dir.join(&run).join("final.safetensors"));
        assert_eq!(header["__metadata__"]["tokenizer"], "Gpt2");
        assert_eq!(header["embed"]["shape"][0], 50304, "the padded vocabulary");
        let eval = widen(&dir, &["eval", &format!("{run}/final.safetensors"), "--device", device]);
        let printed = String::from_utf8_lossy(&eval.stdout).into_owned();
        assert!(eval.status.success(), "{}", stderr(&eval));
        let val: f64 = printed
            .lines()
            .find_map(|l| l.strip_prefix("val_loss "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{printed}"));
        assert!((val - logged_val_loss(&dir.join(&run))).abs() < 1e-5, "{printed}");
        assert!(printed.contains("bits_per_byte "), "{printed}");
    }
    let sample =
        widen(&dir, &["sample", "run-cpu/final.safetensors", "--prompt", "ROMEO:", "--tokens", "20"]);
    assert!(sample.status.success(), "{}", stderr(&sample));
    let stdout = String::from_utf8_lossy(&sample.stdout).into_owned();
    // The prompt, then 20 GPT-2 tokens decoded to text (each at least one byte).
    assert!(stdout.starts_with("ROMEO:") && stdout.len() > "ROMEO:".len() + 20, "{stdout:?}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A sweep and a coordinate check read token shards as training does; with the byte
/// tokenizer named, the sweep's bits per byte are the runs' own.
#[test]
fn sweep_and_coord_check_run_on_token_shards() {
    let spec = r#"Model(
    name: "tokens-sweep", vocab: 256, d_model: 32, layers: 1, heads: 2,
    train: (data: Tokens(train: "toy_train_*.bin", val: "toy_val_*.bin", tokenizer: Bytes),
            seq_len: 16, batch: 2, steps: 2, eval_every: 2, eval_batches: 1, schedule: Constant(warmup: 0)),
)"#;
    let dir = workdir("tokens-sweep", Some(spec));
    write_big_shard(&dir.join("toy_train_000000.bin"), 3000);
    write_big_shard(&dir.join("toy_val_000000.bin"), 1000);
    std::fs::write(
        dir.join("sweep.ron"),
        r#"Sweep(base: "spec.ron", axes: {"residual": [Residual, Hc(n: 2)]}, seeds: [0], budget: Steps(2))"#,
    )
    .unwrap();
    let out = widen(&dir, &["sweep", "sweep.ron", "--out", "sw", "--device", "reference"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let csv = std::fs::read_to_string(dir.join("sw/results.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2, "{csv}");
    for row in &rows {
        assert_eq!(row[col("status")], "ok", "{csv}");
        let (val, bpb): (f64, f64) =
            (row[col("val_loss_mean")].parse().unwrap(), row[col("val_bits_per_byte")].parse().unwrap());
        assert!((bpb - val / std::f64::consts::LN_2).abs() < 1e-6, "{csv}");
    }
    let out = widen(&dir, &["coord-check", "spec.ron", "--widths", "16,32", "--steps", "1", "--out", "cc"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.join("cc").read_dir().unwrap().next().is_some(), "coord-check wrote its files");
    std::fs::remove_dir_all(dir).unwrap();
}
