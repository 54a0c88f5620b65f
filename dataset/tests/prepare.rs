//! Corpus preparation: nanoGPT's published counts, the default split rule, sharding, the
//! manifest, parallel encoding equal to sequential, and refused inputs (docs/data.md,
//! "Preparing a corpus").

use dataset::manifest::{Manifest, SplitRule};
use dataset::prepare::{chunk_ends, encode_parallel, prepare, PrepareOptions};
use dataset::shard::{self, ShardFormat, ShardSet};
use dataset::tokenizer::Tokenizer;
use ir::spec::{TokenWidth, TokenizerSpec};
use std::path::{Path, PathBuf};

fn shakespeare_path() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tinyshakespeare.txt");
    if path.is_file() {
        Some(path)
    } else {
        println!("skipping the tinyshakespeare case: {} is absent", path.display());
        None
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("widen-dataset-prep-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// All ids of a split's shards, as the manifest lists them.
fn split_ids(dir: &Path, paths: Vec<PathBuf>, vocab: usize) -> Vec<u32> {
    assert!(paths.iter().all(|p| p.starts_with(dir)));
    let set = ShardSet::from_paths(&paths, None).unwrap();
    let mut out = vec![0i32; set.len() as usize];
    set.read(0, &mut out, vocab).unwrap();
    out.into_iter().map(|t| t as u32).collect()
}

#[test]
fn nanogpt_split_gives_nanogpts_published_counts() {
    let Some(path) = shakespeare_path() else { return };
    let dir = temp_dir("nanogpt");
    let gpt2 = Tokenizer::from_arg("gpt2").unwrap();
    let opts = PrepareOptions {
        split: SplitRule::NanoGpt,
        name: Some("shakespeare".into()),
        ..PrepareOptions::new(path.to_str().unwrap(), dir.join("out"))
    };
    let m = prepare(&opts, &gpt2).unwrap();
    // nanoGPT's data/shakespeare/readme.md: "train.bin has 301,966 tokens, val.bin has 36,059 tokens".
    assert_eq!(m.train.tokens, 301_966);
    assert_eq!(m.val.tokens, 36_059);
    assert_eq!(m.dtype, TokenWidth::U16);
    assert_eq!(m.vocab, 50257);
    assert_eq!(m.eot, Some(50256));
    assert!(!m.split.eot_per_document);
    assert_eq!(m.train.bytes + m.val.bytes, std::fs::metadata(&path).unwrap().len());
    // The shards' headers agree, and they decode to the text.
    let out = dir.join("out");
    assert_eq!(m.train.files[0].name, "shakespeare_train_000000.bin");
    assert_eq!(m.val.files[0].name, "shakespeare_val_000000.bin");
    let set = ShardSet::open(out.join("shakespeare_train_*.bin").to_str().unwrap(), None).unwrap();
    assert_eq!(set.len(), 301_966);
    assert_eq!(set.files()[0].format, ShardFormat::Llmc(TokenWidth::U16));
    let mut text = gpt2.decode(&split_ids(&out, m.train_paths(&out), 50257)).unwrap();
    text.extend(gpt2.decode(&split_ids(&out, m.val_paths(&out), 50257)).unwrap());
    assert_eq!(text, std::fs::read(&path).unwrap());
    // The manifest on disk is the one returned.
    assert_eq!(Manifest::read(&out).unwrap(), Some(m.clone()));
    assert_eq!(m.sources.len(), 1);
    assert_eq!(m.sources[0].sha256, shard::hex(&sha(&std::fs::read(&path).unwrap())));
    assert_eq!(
        m.train.files[0].sha256,
        shard::hex(&sha(&std::fs::read(out.join(&m.train.files[0].name)).unwrap()))
    );
}

fn sha(bytes: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).to_vec()
}

/// Text that stresses GPT-2's pre-tokenizer around newlines: runs of spaces and newlines,
/// CRLF, Unicode whitespace, contractions, digits, punctuation and invalid UTF-8.
fn tricky_text() -> Vec<u8> {
    let parts: [&[u8]; 16] = [
        b"Hello world\n",
        b"x\ny",
        b"  \n  indented\n",
        b"\n\n\nThree blank\n",
        b"crlf\r\nline\r\n",
        "nbsp\u{a0}\nsep\u{2028}\nX".as_bytes(),
        b"it's they'll we've\nI'd\n",
        b"123 4567\n89\n",
        b"?!\n...\n",
        b"\xff\n\xfe\nok\n",
        "caf\u{e9}\n\u{e9}t\u{e9}\n".as_bytes(),
        b"\t\ttabs\n\t\n",
        b"end \n",
        b"a\nb\nc\nd\n",
        b"  \n",
        b"<|endoftext|>\nq\n",
    ];
    let mut text = Vec::new();
    let mut state = 12345u64;
    for _ in 0..3000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        text.extend_from_slice(parts[(state >> 33) as usize % parts.len()]);
    }
    text
}

#[test]
fn parallel_encoding_equals_sequential() {
    let gpt2 = Tokenizer::from_arg("gpt2").unwrap();
    let bytes = Tokenizer::from_arg("bytes").unwrap();
    let mut texts = vec![tricky_text()];
    if let Some(p) = shakespeare_path() {
        texts.push(std::fs::read(p).unwrap());
    }
    for (k, text) in texts.iter().enumerate() {
        let (seq_gpt2, seq_bytes) = (gpt2.encode(text), bytes.encode(text));
        // Every size on the constructed text; one realistic size on tinyshakespeare.
        let sizes: &[usize] = if k == 0 { &[1, 7, 64, 4096] } else { &[4096] };
        for &chunk in sizes {
            let ends = chunk_ends(gpt2.spec(), text, chunk);
            assert!(ends.len() > text.len() / 10_000, "only {} chunks", ends.len());
            for threads in [2, 3] {
                let par = encode_parallel(&gpt2, text, threads, chunk).unwrap();
                assert!(par == seq_gpt2, "gpt2, chunks of {chunk} bytes, {threads} threads");
                let par = encode_parallel(&bytes, text, threads, chunk).unwrap();
                assert!(par == seq_bytes, "bytes, chunks of {chunk} bytes");
            }
        }
    }
    // Why the cut points matter: cutting after a blank line changes GPT-2's ids.
    let whole = gpt2.encode(b"a\n\nb");
    let cut = [gpt2.encode(b"a\n\n"), gpt2.encode(b"b")].concat();
    assert_ne!(whole, cut);
    assert_eq!(chunk_ends(gpt2.spec(), b"a\n\nb", 1), [4]);
    assert_eq!(chunk_ends(gpt2.spec(), b"a\nb\n\nc", 1), [2, 6]);
}

#[test]
fn default_split_cuts_at_a_line_start_and_marks_documents() {
    let dir = temp_dir("lines");
    let a: Vec<u8> = (0..40).flat_map(|i| format!("line {i} of a\n").into_bytes()).collect();
    let b: Vec<u8> = (0..40).flat_map(|i| format!("line {i} of b\n").into_bytes()).collect();
    std::fs::write(dir.join("a.txt"), &a).unwrap();
    std::fs::write(dir.join("b.txt"), &b).unwrap();
    let input = dir.join("*.txt");
    let all = [a.clone(), b.clone()].concat();

    // Bytes: no end-of-text token, the shards are the text.
    let tok = Tokenizer::from_arg("bytes").unwrap();
    let out = dir.join("bytes");
    let m = prepare(
        &PrepareOptions { val_fraction: 0.25, ..PrepareOptions::new(input.to_str().unwrap(), &out) },
        &tok,
    )
    .unwrap();
    assert_eq!(m.split.rule, SplitRule::Lines);
    assert_eq!(m.train.files[0].name, "data_train_000000.bin");
    let train = split_ids(&out, m.train_paths(&out), 256);
    let val = split_ids(&out, m.val_paths(&out), 256);
    let cut = train.len();
    assert_eq!([train.clone(), val].concat(), all.iter().map(|&b| u32::from(b)).collect::<Vec<_>>());
    assert_eq!(all[cut - 1], b'\n', "the cut {cut} is not at a line start");
    let target = all.len() - (all.len() as f64 * 0.25).round() as usize;
    assert!(cut >= target && all[target..cut - 1].iter().all(|&b| b != b'\n'), "cut {cut}, target {target}");
    assert_eq!((m.train.bytes, m.val.bytes), (cut as u64, (all.len() - cut) as u64));
    assert_eq!(m.sources.len(), 2);
    assert!(m.sources[0].path.ends_with("a.txt") && m.sources[1].path.ends_with("b.txt"));

    // GPT-2: <|endoftext|> before each source's text (the cut lies inside b.txt).
    let gpt2 = Tokenizer::from_arg("gpt2").unwrap();
    let out = dir.join("gpt2");
    let m = prepare(
        &PrepareOptions { val_fraction: 0.25, ..PrepareOptions::new(input.to_str().unwrap(), &out) },
        &gpt2,
    )
    .unwrap();
    assert!(m.split.eot_per_document);
    let train = split_ids(&out, m.train_paths(&out), 50257);
    let val = split_ids(&out, m.val_paths(&out), 50257);
    assert_eq!(train.iter().filter(|&&t| t == 50256).count(), 2);
    assert_eq!(train[0], 50256);
    assert!(!val.contains(&50256));
    let second = train.iter().rposition(|&t| t == 50256).unwrap();
    assert_eq!(gpt2.decode(&train[1..second]).unwrap(), a);
    let mut b_text = gpt2.decode(&train[second + 1..]).unwrap();
    b_text.extend(gpt2.decode(&val).unwrap());
    assert_eq!(b_text, b);
}

#[test]
fn shards_hold_at_most_shard_tokens() {
    let dir = temp_dir("sharding");
    let text: Vec<u8> = (0..500).flat_map(|i| format!("{i}\n").into_bytes()).collect();
    std::fs::write(dir.join("t.txt"), &text).unwrap();
    let out = dir.join("out");
    let opts = PrepareOptions {
        shard_tokens: 300,
        ..PrepareOptions::new(dir.join("t.txt").to_str().unwrap(), &out)
    };
    let m = prepare(&opts, &Tokenizer::from_arg("bytes").unwrap()).unwrap();
    let counts: Vec<u64> = m.train.files.iter().map(|f| f.tokens).collect();
    assert!(counts.len() > 2 && counts.iter().all(|&c| c <= 300), "{counts:?}");
    assert!(counts[..counts.len() - 1].iter().all(|&c| c == 300), "{counts:?}");
    assert_eq!(counts.iter().sum::<u64>(), m.train.tokens);
    assert_eq!(m.train.files[2].name, "t_train_000002.bin");
    for f in m.train.files.iter().chain(&m.val.files) {
        let set = ShardSet::open(out.join(&f.name).to_str().unwrap(), None).unwrap();
        assert_eq!(set.len(), f.tokens);
    }
    assert_eq!(m.train.tokens + m.val.tokens, text.len() as u64);
}

#[test]
fn large_vocabularies_get_u32_shards() {
    let dir = temp_dir("u32");
    // A byte-level tokenizer.json with one added token at id 70000: vocabulary 70001.
    let chars = dataset::tokenizer::byte_chars();
    let mut vocab: serde_json::Map<String, serde_json::Value> =
        chars.iter().enumerate().map(|(b, c)| (c.to_string(), serde_json::Value::from(b))).collect();
    vocab.insert("<big>".into(), serde_json::Value::from(70000));
    let bl = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 257, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": bl, "post_processor": null, "decoder": bl,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tok.json"), json.to_string()).unwrap();
    std::fs::write(dir.join("t.txt"), "one\ntwo\nthree\nfour\n").unwrap();
    let tok = Tokenizer::from_arg(dir.join("tok.json").to_str().unwrap()).unwrap();
    assert_eq!(tok.vocab(), 70001);
    let out = dir.join("out");
    let m = prepare(&PrepareOptions::new(dir.join("t.txt").to_str().unwrap(), &out), &tok).unwrap();
    assert_eq!(m.dtype, TokenWidth::U32);
    assert!(matches!(m.tokenizer, TokenizerSpec::HuggingFace { .. }));
    let set = ShardSet::from_paths(&m.train_paths(&out), None).unwrap();
    assert_eq!(set.files()[0].format, ShardFormat::Llmc(TokenWidth::U32));
    let mut first = [0i32];
    set.read(0, &mut first, 70001).unwrap();
    assert_eq!(first, [257]);
    assert_eq!(tok.eot(), Some(257));
}

#[test]
fn bad_inputs_are_refused_naming_what_is_wrong() {
    let dir = temp_dir("refuse");
    let bytes = Tokenizer::from_arg("bytes").unwrap();
    let text = dir.join("t.txt");
    std::fs::write(&text, "a\nb\nc\nd\ne\nf\ng\nh\n").unwrap();
    let t = text.to_str().unwrap();
    let err = |opts: PrepareOptions| prepare(&opts, &bytes).unwrap_err().to_string();

    let e = err(PrepareOptions::new(dir.join("missing.txt").to_str().unwrap(), dir.join("o1")));
    assert!(e.contains("missing.txt") && e.contains("matches no file"), "{e}");
    let e = err(PrepareOptions::new(dir.join("*.md").to_str().unwrap(), dir.join("o1")));
    assert!(e.contains("*.md") && e.contains("matches no file"), "{e}");
    for f in [0.0, 1.0, -0.5, 1.5, f64::NAN] {
        let e = err(PrepareOptions { val_fraction: f, ..PrepareOptions::new(t, dir.join("o1")) });
        assert!(e.contains("--val-fraction") && e.contains("between 0 and 1"), "{f}: {e}");
    }
    let e = err(PrepareOptions { shard_tokens: 0, ..PrepareOptions::new(t, dir.join("o1")) });
    assert!(e.contains("--shard-tokens 0"), "{e}");
    let e = err(PrepareOptions { name: Some("../x".into()), ..PrepareOptions::new(t, dir.join("o1")) });
    assert!(e.contains("\"../x\"") && e.contains("--name"), "{e}");
    // Nothing was written by the refusals.
    assert!(!dir.join("o1").exists());
    let e = err(PrepareOptions::new(dir.to_str().unwrap(), dir.join("o1")));
    assert!(e.contains("a folder"), "{e}");
    // A shard is not text.
    shard::write_llmc(&dir.join("s.bin"), &[1, 2, 3], TokenWidth::U16).unwrap();
    let e = err(PrepareOptions::new(dir.join("s.bin").to_str().unwrap(), dir.join("o1")));
    assert!(e.contains("s.bin") && e.contains("already an llm.c token shard"), "{e}");
    // nanoGPT's rule reads UTF-8, one file.
    std::fs::write(dir.join("bad.txt"), b"ok\n\xff\nmore\n").unwrap();
    let e = err(PrepareOptions {
        split: SplitRule::NanoGpt,
        ..PrepareOptions::new(dir.join("bad.txt").to_str().unwrap(), dir.join("o1"))
    });
    assert!(e.contains("bad.txt") && e.contains("UTF-8 at byte 3"), "{e}");
    let e = err(PrepareOptions {
        split: SplitRule::NanoGpt,
        ..PrepareOptions::new(dir.join("*.txt").to_str().unwrap(), dir.join("o1"))
    });
    assert!(e.contains("one text file") && e.contains("matches 2"), "{e}");
    // Too little text to split.
    std::fs::write(dir.join("one.txt"), "x").unwrap();
    let e = err(PrepareOptions::new(dir.join("one.txt").to_str().unwrap(), dir.join("o1")));
    assert!(e.contains("one.txt") && e.contains("cannot split"), "{e}");

    // An output folder with shards is refused without --force and replaced with it.
    let out = dir.join("out");
    prepare(&PrepareOptions { shard_tokens: 3, ..PrepareOptions::new(t, &out) }, &bytes).unwrap();
    assert!(out.join("t_train_000003.bin").exists());
    let e = err(PrepareOptions::new(t, &out));
    assert!(
        e.contains(out.to_str().unwrap())
            && e.contains("already holds token shards")
            && e.contains("--force"),
        "{e}"
    );
    let m = prepare(&PrepareOptions { force: true, ..PrepareOptions::new(t, &out) }, &bytes).unwrap();
    assert_eq!(m.train.files.len(), 1);
    // No stale shard of the earlier, finer run is left to be matched by a glob.
    assert!(!out.join("t_train_000003.bin").exists());
    let set = ShardSet::open(out.join("t_train_*.bin").to_str().unwrap(), None).unwrap();
    assert_eq!(set.len(), m.train.tokens);
    // A file as --out.
    let e = err(PrepareOptions::new(t, &text));
    assert!(e.contains("not a folder"), "{e}");
}

#[test]
fn manifest_is_none_when_absent_and_refuses_garbage() {
    let dir = temp_dir("manifest");
    assert_eq!(Manifest::read(&dir).unwrap(), None);
    std::fs::write(dir.join("manifest.json"), "{\"version\": 1}").unwrap();
    let e = Manifest::read(&dir).unwrap_err().to_string();
    assert!(e.contains("manifest.json") && e.contains("not a widen data manifest"), "{e}");
    let beside = Manifest::beside(dir.join("x_train_*.bin").to_str().unwrap());
    assert!(beside.is_err());
}
