//! Tokenizers: exact round trips (invalid UTF-8 included), GPT-2's published ids, a
//! handwritten tokenizer.json, and a changed tokenizer.json refused by its hash
//! (docs/data.md, "Tokenizers").

use dataset::tokenizer::{byte_chars, Tokenizer, TokenizerError, GPT2_EOT};
use ir::spec::TokenizerSpec;
use std::path::PathBuf;

fn shakespeare() -> Option<Vec<u8>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tinyshakespeare.txt");
    match std::fs::read(&path) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipping the tinyshakespeare case: {} is not readable ({e})", path.display());
            None
        }
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("widen-dataset-tok-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const INVALID: &[u8] = b"\xff\xfeab \xc3( caf\xc3\xa9 \xe2\x82 x\xed\xa0\x80y \xf0\x9f\x98\x80 \xf0\x9f\x98";

#[test]
fn gpt2_ids_match_the_published_ones() {
    let t = Tokenizer::from_arg("gpt2").unwrap();
    assert_eq!(t.spec(), &TokenizerSpec::Gpt2);
    assert_eq!(t.vocab(), 50257);
    assert_eq!(t.eot(), Some(50256));
    assert_eq!(t.encode(b"Hello world"), [15496, 995]);
    assert_eq!(t.encode(b" the"), [262]);
    // encode_ordinary: a literal <|endoftext|> is text, not the special id.
    let ids = t.encode(b"<|endoftext|>");
    assert!(!ids.contains(&GPT2_EOT) && ids.len() > 1, "{ids:?}");
    assert_eq!(t.decode(&[GPT2_EOT]).unwrap(), b"<|endoftext|>");
    assert_eq!(t.token_bytes(GPT2_EOT), 0);
    assert_eq!(t.token_bytes(15496), 5);
    assert_eq!(t.token_bytes(995), 6);
}

#[test]
fn gpt2_and_bytes_round_trip_invalid_utf8() {
    for arg in ["gpt2", "bytes"] {
        let t = Tokenizer::from_arg(arg).unwrap();
        let ids = t.encode(INVALID);
        assert!(ids.iter().all(|&id| (id as usize) < t.vocab()));
        assert_eq!(t.decode(&ids).unwrap(), INVALID, "{arg}");
        let bytes: usize = ids.iter().map(|&id| t.token_bytes(id)).sum();
        assert_eq!(bytes, INVALID.len(), "{arg}");
    }
    // Each invalid byte is its single-byte token.
    let t = Tokenizer::from_arg("gpt2").unwrap();
    let ff = t.encode(b"\xff");
    assert_eq!(ff.len(), 1);
    assert_eq!(t.decode(&ff).unwrap(), b"\xff");
}

#[test]
fn round_trip_on_tinyshakespeare() {
    let Some(text) = shakespeare() else { return };
    for arg in ["gpt2", "bytes"] {
        let t = Tokenizer::from_arg(arg).unwrap();
        let ids = t.encode(&text);
        assert_eq!(t.decode(&ids).unwrap(), text, "{arg}");
        let bytes: usize = ids.iter().map(|&id| t.token_bytes(id)).sum();
        assert_eq!(bytes, text.len(), "{arg}");
    }
}

#[test]
fn decode_refuses_ids_outside_the_vocabulary() {
    let t = Tokenizer::from_arg("gpt2").unwrap();
    let e = t.decode(&[15496, 50257]).unwrap_err().to_string();
    assert!(e.contains("50257") && e.contains("position 1") && e.contains("< 50257"), "{e}");
    let b = Tokenizer::from_arg("bytes").unwrap();
    let e = b.decode(&[256]).unwrap_err().to_string();
    assert!(e.contains("256") && e.contains("< 256"), "{e}");
    assert_eq!(b.token_bytes(300), 0);
}

#[test]
fn unknown_tokenizer_words_are_refused() {
    let e = Tokenizer::from_arg("gpt3").err().unwrap().to_string();
    assert!(e.contains("gpt3") && e.contains("gpt2") && e.contains("bytes"), "{e}");
}

/// A byte-level BPE tokenizer.json: the 256 byte characters, three merges, and an
/// `<|endoftext|>` added token.
fn tiny_json(extra_merge: bool) -> String {
    let chars = byte_chars();
    let mut vocab: Vec<(String, u32)> =
        chars.iter().enumerate().map(|(b, c)| (c.to_string(), b as u32)).collect();
    vocab.push(("he".into(), 256));
    vocab.push(("ll".into(), 257));
    vocab.push(("hell".into(), 258));
    let mut merges = vec!["h e", "l l", "he ll"];
    if extra_merge {
        vocab.push(("hello".into(), 259));
        merges.push("hell o");
    }
    let eot = vocab.len();
    let vocab_json: serde_json::Map<String, serde_json::Value> =
        vocab.into_iter().map(|(k, v)| (k, serde_json::Value::from(v))).collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": eot, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": vocab_json, "merges": merges
        }
    })
    .to_string()
}

#[test]
fn handwritten_tokenizer_json_round_trips() {
    let dir = temp_dir("hf");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tiny_json(false)).unwrap();
    let t = Tokenizer::from_arg(path.to_str().unwrap()).unwrap();
    assert_eq!(t.vocab(), 260);
    assert_eq!(t.eot(), Some(259));
    let ids = t.encode(b"hello");
    assert_eq!(ids, [258, u32::from(b'o')]);
    assert_eq!(t.token_bytes(258), 4);
    assert_eq!(t.token_bytes(259), 0);
    for text in [&b"hello hell, shell\n\n  ll"[..], INVALID] {
        let ids = t.encode(text);
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert_eq!(ids.iter().map(|&id| t.token_bytes(id)).sum::<usize>(), text.len());
    }
    if let Some(text) = shakespeare() {
        let ids = t.encode(&text);
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    // The spec records the path and the file's hash, and loads again.
    let TokenizerSpec::HuggingFace { path: p, sha256 } = t.spec().clone() else { panic!("{:?}", t.spec()) };
    assert_eq!(p, path.to_str().unwrap());
    assert_eq!(sha256.len(), 64);
    let again = Tokenizer::load(t.spec()).unwrap();
    assert_eq!(again.encode(b"hello"), t.encode(b"hello"));
}

#[test]
fn changed_tokenizer_json_is_refused_by_hash() {
    let dir = temp_dir("hash");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tiny_json(false)).unwrap();
    let spec = Tokenizer::from_arg(path.to_str().unwrap()).unwrap().spec().clone();
    let TokenizerSpec::HuggingFace { sha256: old, .. } = &spec else { panic!() };
    std::fs::write(&path, tiny_json(true)).unwrap();
    let e = Tokenizer::load(&spec).err().unwrap();
    assert!(matches!(e, TokenizerError::HashMismatch { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains("tokenizer.json") && e.contains(old.as_str()) && e.contains("changed"), "{e}");
    // The new file, loaded by its own hash, has the extra merge.
    let new = Tokenizer::from_arg(path.to_str().unwrap()).unwrap();
    assert_eq!(new.encode(b"hello"), [259]);
    // A missing file names its path.
    std::fs::remove_file(&path).unwrap();
    let e = Tokenizer::load(&spec).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn tokenizer_json_that_cannot_encode_every_text_is_refused() {
    let dir = temp_dir("partial");
    let path = dir.join("tokenizer.json");
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": {"a": 0, "b": 1}, "merges": [] }
    });
    std::fs::write(&path, json.to_string()).unwrap();
    let e = Tokenizer::from_arg(path.to_str().unwrap()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json") && e.contains("cannot encode arbitrary text"), "{e}");
    std::fs::write(&path, "{ not json").unwrap();
    let e = Tokenizer::from_arg(path.to_str().unwrap()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json") && e.contains("not a Hugging Face tokenizer.json"), "{e}");
}
