//! Token shards: every format read back across shard boundaries, every broken file refused
//! with a message naming the file and what is wrong (docs/data.md, "Formats").

use dataset::shard::{self, ShardError, ShardFormat, ShardSet, HEADER_BYTES, LLMC_MAGIC_U16, LLMC_MAGIC_U32};
use ir::spec::TokenWidth;
use proptest::prelude::*;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// An empty folder `widen-dataset-<tag>-<pid>` under the system temp folder.
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("widen-dataset-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_raw(path: &Path, tokens: &[u32], width: TokenWidth) {
    let mut bytes = Vec::new();
    for &t in tokens {
        match width {
            TokenWidth::U16 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
            TokenWidth::U32 => bytes.extend_from_slice(&t.to_le_bytes()),
        }
    }
    std::fs::write(path, bytes).unwrap();
}

/// An llm.c header with these three ints, then `body`.
fn write_headed(path: &Path, magic: i32, version: i32, count: i32, body: &[u8]) {
    let mut bytes = vec![0u8; HEADER_BYTES];
    bytes[0..4].copy_from_slice(&magic.to_le_bytes());
    bytes[4..8].copy_from_slice(&version.to_le_bytes());
    bytes[8..12].copy_from_slice(&count.to_le_bytes());
    bytes.extend_from_slice(body);
    std::fs::write(path, bytes).unwrap();
}

fn err_text(r: Result<ShardSet, ShardError>) -> String {
    match r {
        Ok(set) => panic!("expected an error, opened {}", set.describe()),
        Err(e) => e.to_string(),
    }
}

fn tokens(n: usize, seed: u32, below: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed)) % below).collect()
}

#[test]
fn every_format_reads_back_across_shard_boundaries() {
    let dir = temp_dir("formats");
    let cases = [
        ("llmc16", ShardFormat::Llmc(TokenWidth::U16), 50257u32),
        ("llmc32", ShardFormat::Llmc(TokenWidth::U32), 200_000),
        ("raw16", ShardFormat::Raw(TokenWidth::U16), 65536),
        ("raw32", ShardFormat::Raw(TokenWidth::U32), 1 << 31),
    ];
    for (tag, format, vocab) in cases {
        let sizes = [7usize, 1, 13];
        let mut all = Vec::new();
        for (k, &n) in sizes.iter().enumerate() {
            let t = tokens(n, k as u32 * 17, vocab);
            // Named so that name order differs from creation order: 2, 1, 0 is written first.
            let path = dir.join(format!("{tag}_{k:06}.bin"));
            match format {
                ShardFormat::Llmc(w) => shard::write_llmc(&path, &t, w).unwrap(),
                ShardFormat::Raw(w) => write_raw(&path, &t, w),
            }
            all.extend(t);
        }
        let raw = match format {
            ShardFormat::Raw(w) => Some(w),
            ShardFormat::Llmc(_) => None,
        };
        let set = ShardSet::open(dir.join(format!("{tag}_*.bin")).to_str().unwrap(), raw).unwrap();
        assert_eq!(set.len(), all.len() as u64, "{tag}");
        assert_eq!(set.files().len(), 3);
        assert!(set.files().iter().all(|f| f.format == format), "{tag}: {:?}", set.files());
        assert_eq!(set.files().iter().map(|f| f.tokens).collect::<Vec<_>>(), [7, 1, 13]);
        let width = format.width().bytes() as u64;
        let header = format.header_bytes() as u64;
        for f in set.files() {
            assert_eq!(f.file_bytes, header + f.tokens * width, "{tag}");
        }
        // Every window, including ones that start in one shard and end two shards later.
        for start in 0..all.len() {
            for len in 0..=all.len() - start {
                let mut out = vec![-1i32; len];
                set.read(start as u64, &mut out, vocab as usize).unwrap();
                let want: Vec<i32> = all[start..start + len].iter().map(|&t| t as i32).collect();
                assert_eq!(out, want, "{tag}: tokens {start}..{}", start + len);
            }
        }
    }
}

#[test]
fn llmc_header_layout_is_magic_version_count_then_zeros() {
    let dir = temp_dir("header");
    for (width, magic, version, bytes) in
        [(TokenWidth::U16, LLMC_MAGIC_U16, 1, 2usize), (TokenWidth::U32, LLMC_MAGIC_U32, 7, 4)]
    {
        let path = dir.join("a.bin");
        shard::write_llmc(&path, &[1, 2, 65535, 3], width).unwrap();
        let b = std::fs::read(&path).unwrap();
        let int = |k: usize| i32::from_le_bytes(b[4 * k..4 * k + 4].try_into().unwrap());
        assert_eq!((int(0), int(1), int(2)), (magic, version, 4));
        assert!((3..256).all(|k| int(k) == 0));
        assert_eq!(b.len(), 1024 + 4 * bytes);
        assert_eq!(&b[1024 + 2 * bytes..1024 + 3 * bytes], &65535u32.to_le_bytes()[..bytes]);
        assert_eq!(shard::sniff(&path).unwrap(), Some(ShardFormat::Llmc(width)));
        // Atomic: the temp file was renamed away.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["a.bin"]);
    }
}

#[test]
fn sniff_says_none_for_text_and_short_files() {
    let dir = temp_dir("sniff");
    std::fs::write(dir.join("t.txt"), "First Citizen:\n").unwrap();
    std::fs::write(dir.join("s"), [0x48, 0xd5]).unwrap();
    assert_eq!(shard::sniff(&dir.join("t.txt")).unwrap(), None);
    assert_eq!(shard::sniff(&dir.join("s")).unwrap(), None);
    assert!(matches!(shard::sniff(&dir), Err(ShardError::NotAFile { .. })));
}

#[test]
fn write_refuses_ids_too_wide_and_empty_shards() {
    let dir = temp_dir("write");
    let path = dir.join("w.bin");
    let e = shard::write_llmc(&path, &[5, 70000], TokenWidth::U16).unwrap_err().to_string();
    assert!(
        e.contains("w.bin") && e.contains("token 1") && e.contains("70000") && e.contains("65536"),
        "{e}"
    );
    let e = shard::write_llmc(&path, &[], TokenWidth::U16).unwrap_err().to_string();
    assert!(e.contains("w.bin") && e.contains("empty"), "{e}");
    assert!(!path.exists());
    shard::write_llmc(&path, &[70000], TokenWidth::U32).unwrap();
}

#[test]
fn headerless_file_without_dtype_says_how_to_state_it() {
    let dir = temp_dir("nodtype");
    let path = dir.join("train.bin");
    write_raw(&path, &[1, 2, 3, 4], TokenWidth::U16);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("train.bin") && e.contains("no llm.c header"), "{e}");
    assert!(e.contains("dtype: Some(U16)"), "{e}");
    assert!(e.contains(&LLMC_MAGIC_U16.to_string()) && e.contains(&LLMC_MAGIC_U32.to_string()), "{e}");
    // With the width stated it reads.
    let set = ShardSet::open(path.to_str().unwrap(), Some(TokenWidth::U16)).unwrap();
    assert_eq!(set.len(), 4);
    assert_eq!(set.describe(), "nanoGPT-style headerless u16 file, 4 tokens");
}

#[test]
fn wrong_magic_is_a_headerless_file() {
    let dir = temp_dir("magic");
    let path = dir.join("m.bin");
    write_headed(&path, 20240519, 1, 2, &[1, 0, 2, 0]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("m.bin") && e.contains("20240519") && e.contains("no llm.c header"), "{e}");
}

#[test]
fn wrong_version_is_refused() {
    let dir = temp_dir("version");
    let path = dir.join("v.bin");
    write_headed(&path, LLMC_MAGIC_U16, 7, 2, &[1, 0, 2, 0]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("v.bin") && e.contains("version 7") && e.contains("has version 1"), "{e}");
    write_headed(&path, LLMC_MAGIC_U32, 1, 1, &[1, 0, 0, 0]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), Some(TokenWidth::U32)));
    assert!(e.contains("version 1") && e.contains("has version 7"), "{e}");
}

#[test]
fn header_count_disagreeing_with_the_size_is_refused() {
    let dir = temp_dir("count");
    let path = dir.join("c.bin");
    // The header says 2 tokens, the file holds 3.
    write_headed(&path, LLMC_MAGIC_U16, 1, 2, &[1, 0, 2, 0, 3, 0]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("c.bin") && e.contains("says 2 tokens") && e.contains("3 u16 tokens"), "{e}");
    assert!(e.contains("(file size - 1024) / 2"), "{e}");
    // A negative count.
    write_headed(&path, LLMC_MAGIC_U16, 1, -1, &[1, 0]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("c.bin") && e.contains("-1"), "{e}");
    // Half a token after the header.
    write_headed(&path, LLMC_MAGIC_U32, 7, 1, &[1, 0, 0, 0, 9, 9]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("c.bin") && e.contains("partial token") && e.contains("6 bytes"), "{e}");
}

#[test]
fn truncated_shards_are_refused() {
    let dir = temp_dir("trunc");
    let path = dir.join("t.bin");
    write_headed(&path, LLMC_MAGIC_U16, 1, 100, &[1, 0, 2, 0]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("t.bin") && e.contains("truncated") && e.contains("says 100 tokens"), "{e}");
    assert!(e.contains("1224 bytes") && e.contains("1028 bytes"), "{e}");
    // Cut inside the header.
    std::fs::write(&path, [&LLMC_MAGIC_U16.to_le_bytes()[..], &[1, 0, 0, 0]].concat()).unwrap();
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("t.bin") && e.contains("truncated") && e.contains("8 bytes"), "{e}");
    // A headerless file whose size is not a multiple of the width.
    std::fs::write(&path, [1, 2, 3]).unwrap();
    let e = err_text(ShardSet::open(path.to_str().unwrap(), Some(TokenWidth::U16)));
    assert!(e.contains("t.bin") && e.contains("partial token") && e.contains("u16"), "{e}");
}

#[test]
fn id_at_or_above_vocab_names_file_offset_id_and_vocab() {
    let dir = temp_dir("vocab");
    shard::write_llmc(&dir.join("a_0.bin"), &[1, 2, 3], TokenWidth::U16).unwrap();
    shard::write_llmc(&dir.join("a_1.bin"), &[4, 5, 256, 6], TokenWidth::U16).unwrap();
    let set = ShardSet::open(dir.join("a_*.bin").to_str().unwrap(), None).unwrap();
    let mut out = vec![0i32; 7];
    let e = set.read(0, &mut out, 256).unwrap_err().to_string();
    assert!(e.contains("a_1.bin") && e.contains("token 2 ") && e.contains("id 256"), "{e}");
    assert!(e.contains("vocab 256") && e.contains(&format!("byte {}", 1024 + 4)), "{e}");
    // The tokens before it are fine; with a larger vocabulary everything is.
    let mut out = vec![0i32; 5];
    set.read(0, &mut out, 256).unwrap();
    assert_eq!(out, [1, 2, 3, 4, 5]);
    let mut out = vec![0i32; 7];
    set.read(0, &mut out, 257).unwrap();
    assert_eq!(out, [1, 2, 3, 4, 5, 256, 6]);
    // u32 ids that do not fit the graph's i32 are refused whatever the vocabulary.
    shard::write_llmc(&dir.join("b.bin"), &[u32::MAX], TokenWidth::U32).unwrap();
    let set = ShardSet::open(dir.join("b.bin").to_str().unwrap(), None).unwrap();
    let e = set.read(0, &mut [0], usize::MAX).unwrap_err().to_string();
    assert!(e.contains("b.bin") && e.contains(&u32::MAX.to_string()), "{e}");
}

#[test]
fn reads_past_the_end_are_errors() {
    let dir = temp_dir("end");
    shard::write_llmc(&dir.join("a.bin"), &[1, 2, 3], TokenWidth::U16).unwrap();
    let set = ShardSet::open(dir.join("a.bin").to_str().unwrap(), None).unwrap();
    for (start, len) in [(0u64, 4usize), (3, 1), (4, 0), (u64::MAX, 2), (u64::MAX, 0)] {
        let e = set.read(start, &mut vec![0; len], 50257).unwrap_err().to_string();
        assert!(e.contains("3 tokens") && e.contains("past the end"), "{start}+{len}: {e}");
    }
    set.read(3, &mut [], 50257).unwrap();
}

#[test]
fn empty_shards_are_refused() {
    let dir = temp_dir("empty");
    let path = dir.join("e.bin");
    std::fs::write(&path, []).unwrap();
    for raw in [None, Some(TokenWidth::U16)] {
        let e = err_text(ShardSet::open(path.to_str().unwrap(), raw));
        assert!(e.contains("e.bin") && e.contains("empty"), "{e}");
    }
    write_headed(&path, LLMC_MAGIC_U16, 1, 0, &[]);
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("e.bin") && e.contains("empty"), "{e}");
    let e = ShardSet::from_paths(&[], None).unwrap_err().to_string();
    assert!(e.contains("no token shard files"), "{e}");
}

#[test]
fn non_regular_files_are_refused() {
    let dir = temp_dir("special");
    let e = err_text(ShardSet::open(dir.to_str().unwrap(), Some(TokenWidth::U16)));
    assert!(e.contains(dir.to_str().unwrap()) && e.contains("a folder"), "{e}");
    // A glob matching a folder refuses it too.
    std::fs::create_dir(dir.join("x_0.bin")).unwrap();
    let e = err_text(ShardSet::open(dir.join("x_*.bin").to_str().unwrap(), Some(TokenWidth::U16)));
    assert!(e.contains("x_0.bin") && e.contains("a folder"), "{e}");
    #[cfg(unix)]
    {
        let fifo = dir.join("fifo.bin");
        let ok =
            std::process::Command::new("mkfifo").arg(&fifo).status().map(|s| s.success()).unwrap_or(false);
        if ok {
            // Would block forever if it were opened.
            let e = err_text(ShardSet::open(fifo.to_str().unwrap(), Some(TokenWidth::U16)));
            assert!(e.contains("fifo.bin") && e.contains("FIFO"), "{e}");
            assert!(matches!(shard::sniff(&fifo), Err(ShardError::NotAFile { .. })));
        } else {
            println!("skipping the FIFO case: mkfifo is not available");
        }
        let e = err_text(ShardSet::open("/dev/zero", Some(TokenWidth::U16)));
        assert!(e.contains("/dev/zero") && e.contains("character device"), "{e}");
    }
}

#[test]
fn missing_files_and_patterns_are_named() {
    let dir = temp_dir("missing");
    let pattern = dir.join("fineweb_train_*.bin");
    let e = err_text(ShardSet::open(pattern.to_str().unwrap(), None));
    assert!(e.contains(pattern.to_str().unwrap()) && e.contains("matches no file"), "{e}");
    let path = dir.join("nope.bin");
    let e = err_text(ShardSet::open(path.to_str().unwrap(), None));
    assert!(e.contains("nope.bin"), "{e}");
    let e = err_text(ShardSet::open(dir.join("a[.bin").to_str().unwrap(), None));
    assert!(e.contains("a[.bin") && e.contains("not a valid glob"), "{e}");
}

#[test]
fn sha256_depends_on_content_and_order_not_names() {
    let dir = temp_dir("sha");
    let (a, b) = (tokens(100, 1, 50257), tokens(50, 2, 50257));
    shard::write_llmc(&dir.join("x_0.bin"), &a, TokenWidth::U16).unwrap();
    shard::write_llmc(&dir.join("x_1.bin"), &b, TokenWidth::U16).unwrap();
    shard::write_llmc(&dir.join("y_a.bin"), &a, TokenWidth::U16).unwrap();
    shard::write_llmc(&dir.join("y_b.bin"), &b, TokenWidth::U16).unwrap();
    let x = ShardSet::open(dir.join("x_*.bin").to_str().unwrap(), None).unwrap();
    let y = ShardSet::open(dir.join("y_*.bin").to_str().unwrap(), None).unwrap();
    assert_eq!(x.sha256().unwrap(), y.sha256().unwrap());
    // Each file's hash is its sha256sum.
    let file = Sha256::digest(std::fs::read(dir.join("x_1.bin")).unwrap());
    assert_eq!(x.file_sha256s().unwrap()[1], shard::hex(&file));
    // Order matters.
    let swapped = ShardSet::from_paths(&[dir.join("x_1.bin"), dir.join("x_0.bin")], None).unwrap();
    assert_ne!(swapped.sha256().unwrap(), x.sha256().unwrap());
    // So does one changed token.
    let mut b2 = b.clone();
    b2[49] ^= 1;
    shard::write_llmc(&dir.join("y_b.bin"), &b2, TokenWidth::U16).unwrap();
    let y = ShardSet::open(dir.join("y_*.bin").to_str().unwrap(), None).unwrap();
    assert_ne!(x.sha256().unwrap(), y.sha256().unwrap());
    assert_eq!(x.sha256().unwrap().len(), 64);
}

#[test]
fn describe_names_count_format_and_tokens() {
    let dir = temp_dir("describe");
    for k in 0..3 {
        shard::write_llmc(&dir.join(format!("f_{k}.bin")), &[1; 10], TokenWidth::U16).unwrap();
    }
    let set = ShardSet::open(dir.join("f_*.bin").to_str().unwrap(), None).unwrap();
    assert_eq!(set.describe(), "3 llm.c u16 shards, 30 tokens");
    let one = ShardSet::open(dir.join("f_0.bin").to_str().unwrap(), None).unwrap();
    assert_eq!(one.describe(), "1 llm.c u16 shard, 10 tokens");
    assert!(!one.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Whatever the bytes, opening (and reading everything) returns, never panics.
    #[test]
    fn open_never_panics(
        body in proptest::collection::vec(any::<u8>(), 0..2100),
        header in 0usize..4,
        count in -2i32..600,
        raw in 0usize..3,
    ) {
        let dir = temp_dir("prop");
        let path = dir.join("p.bin");
        let mut bytes = match header {
            0 => Vec::new(),
            1 => [LLMC_MAGIC_U16.to_le_bytes(), 1i32.to_le_bytes(), count.to_le_bytes()].concat(),
            2 => [LLMC_MAGIC_U32.to_le_bytes(), 7i32.to_le_bytes(), count.to_le_bytes()].concat(),
            _ => LLMC_MAGIC_U16.to_le_bytes().to_vec(),
        };
        if header == 1 || header == 2 {
            bytes.resize(HEADER_BYTES, 0);
        }
        bytes.extend_from_slice(&body);
        std::fs::write(&path, &bytes).unwrap();
        let raw = [None, Some(TokenWidth::U16), Some(TokenWidth::U32)][raw];
        let _ = shard::sniff(&path);
        if let Ok(set) = ShardSet::open(path.to_str().unwrap(), raw) {
            prop_assert!(!set.is_empty());
            let mut out = vec![0i32; set.len() as usize];
            let _ = set.read(0, &mut out, 1000);
            prop_assert!(set.read(1, &mut out, 1 << 31).is_err());
        }
    }
}
