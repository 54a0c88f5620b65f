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
