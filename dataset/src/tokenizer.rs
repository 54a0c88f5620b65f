//! Tokenizers that turn text into the ids a token dataset stores (docs/data.md,
//! "Tokenizers").
//!
//! - `Bytes`: one id per byte, vocabulary 256 (what widen trains on for `Text(..)` data).
//! - `Gpt2`: GPT-2's byte-level BPE (`r50k_base`, vocabulary 50257) with its merge ranks
//!   embedded in the binary by `tiktoken-rs`: nothing is downloaded. Text is encoded like
//!   tiktoken's `encode_ordinary` (what nanoGPT's and llm.c's prepare scripts call): a
//!   literal `<|endoftext|>` in the text is ordinary text, not id 50256.
//! - `HuggingFace`: a `tokenizer.json`, identified by the SHA-256 of its bytes so that a
//!   changed file is refused rather than silently giving other ids.
//!
//! Any bytes can be encoded, invalid UTF-8 included. Byte-level BPE has a token for each of
//! the 256 bytes, so the text is cut into runs of valid UTF-8, each encoded on its own (the
//! pre-tokenizer never joins a piece across an invalid byte), and every byte of an invalid
//! run becomes its single-byte token. `decode(encode(text)) == text` for every input with
//! `Bytes`, `Gpt2` and byte-level Hugging Face tokenizers; other Hugging Face tokenizers
//! encode an invalid byte as its byte-fallback token `<0xXX>` where they have one, else as
//! their unknown token, and decode through the tokenizer's own decoder.

use ir::spec::TokenizerSpec;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

/// GPT-2's vocabulary: 50000 merges, 256 bytes and `<|endoftext|>`.
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>` id.
pub const GPT2_EOT: u32 = 50256;

/// Errors loading a tokenizer or decoding ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read tokenizer file {path}")]
    Read { path: String, source: std::io::Error },
    #[error(
        "tokenizer file {path} has SHA-256 {actual}, but {expected} was recorded: the file changed \
         since the data was tokenized; restore that file, or re-tokenize the data with this one"
    )]
    HashMismatch { path: String, expected: String, actual: String },
    #[error("tokenizer file {path} is not a Hugging Face tokenizer.json: {message}")]
    Parse { path: String, message: String },
    #[error(
        "tokenizer file {path} cannot encode arbitrary text: it has neither a token for every byte \
         (byte-level or byte-fallback) nor an unknown token"
    )]
    NotTotal { path: String },
    #[error("tokenizer {arg:?} is neither gpt2, bytes nor an existing tokenizer.json file")]
    UnknownArg { arg: String },
    #[error("GPT-2's embedded BPE ranks failed to load: {message}")]
    Gpt2 { message: String },
    #[error(
        "token id {id} at position {index} is outside the tokenizer's vocabulary (ids must be < {vocab})"
    )]
    IdOutOfRange { id: u32, index: usize, vocab: usize },
    #[error("the Hugging Face tokenizer {path} failed on this text: {message}")]
    Encode { path: String, message: String },
}

/// A loaded tokenizer. `Send + Sync`: one instance encodes on many threads.
pub struct Tokenizer {
    spec: TokenizerSpec,
    kind: Kind,
}

enum Kind {
    Bytes,
    Gpt2(&'static Gpt2),
    Hf(Box<Hf>),
}

/// GPT-2's BPE and, per id, the bytes it stands for.
struct Gpt2 {
    bpe: tiktoken_rs::CoreBPE,
    table: Vec<Vec<u8>>,
    byte_ids: [u32; 256],
}

struct Hf {
    path: String,
    tok: tokenizers::Tokenizer,
    /// Per id, the bytes it decodes to on its own (empty for special tokens and holes).
    table: Vec<Vec<u8>>,
    /// Decoding is the concatenation of `table` entries (the decoder is plain ByteLevel).
    byte_level: bool,
    /// Per byte, the token that stands for it alone, where every byte has one.
    byte_ids: Option<[u32; 256]>,
    unk: Option<u32>,
    vocab: usize,
    eot: Option<u32>,
}

fn gpt2() -> Result<&'static Gpt2, TokenizerError> {
    static GPT2: OnceLock<Result<Gpt2, String>> = OnceLock::new();
    GPT2.get_or_init(|| {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| e.to_string())?;
        let table: Vec<Vec<u8>> = bpe._decode_native_and_split((0..GPT2_VOCAB as u32).collect()).collect();
        let mut byte_ids = [u32::MAX; 256];
        for (id, bytes) in table.iter().enumerate() {
            if let [b] = bytes[..] {
                byte_ids[b as usize] = id as u32;
            }
        }
        if byte_ids.contains(&u32::MAX) {
            return Err("a byte has no single-byte token".into());
        }
        Ok(Gpt2 { bpe, table, byte_ids })
    })
    .as_ref()
    .map_err(|message| TokenizerError::Gpt2 { message: message.clone() })
}

/// GPT-2's byte-to-character map used by byte-level BPE vocabularies
/// (`bytes_to_unicode` of GPT-2's encoder).
pub fn byte_chars() -> [char; 256] {
    let mut bs: Vec<u32> = (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF).map(u32::from).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = ['\0'; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        out[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    out
}

/// SHA-256 (hex) of a file's bytes.
pub fn file_sha256(path: &Path) -> Result<(Vec<u8>, String), std::io::Error> {
    let bytes = std::fs::read(path)?;
    let hex = crate::shard::hex(&Sha256::digest(&bytes));
    Ok((bytes, hex))
}

impl Tokenizer {
    /// The tokenizer a spec names. A Hugging Face file must have the recorded SHA-256.
    pub fn load(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let kind = match spec {
            TokenizerSpec::Bytes => Kind::Bytes,
            TokenizerSpec::Gpt2 => Kind::Gpt2(gpt2()?),
            TokenizerSpec::HuggingFace { path, sha256 } => {
                let (bytes, actual) = file_sha256(Path::new(path))
                    .map_err(|source| TokenizerError::Read { path: path.clone(), source })?;
                if !actual.eq_ignore_ascii_case(sha256) {
                    return Err(TokenizerError::HashMismatch {
                        path: path.clone(),
                        expected: sha256.clone(),
                        actual,
                    });
                }
                Kind::Hf(Box::new(Hf::parse(path, &bytes)?))
            }
        };
        Ok(Tokenizer { spec: spec.clone(), kind })
    }

    /// From a command-line word: `gpt2` | `bytes` | a path to a tokenizer.json (hashed and
    /// recorded with its path as given).
    pub fn from_arg(arg: &str) -> Result<Tokenizer, TokenizerError> {
        match arg {
            "gpt2" | "GPT2" | "gpt-2" => Tokenizer::load(&TokenizerSpec::Gpt2),
            "bytes" => Tokenizer::load(&TokenizerSpec::Bytes),
            _ if Path::new(arg).is_file() => {
                let (bytes, sha256) = file_sha256(Path::new(arg))
                    .map_err(|source| TokenizerError::Read { path: arg.to_string(), source })?;
                let hf = Hf::parse(arg, &bytes)?;
                Ok(Tokenizer {
                    spec: TokenizerSpec::HuggingFace { path: arg.to_string(), sha256 },
                    kind: Kind::Hf(Box::new(hf)),
                })
            }
            _ => Err(TokenizerError::UnknownArg { arg: arg.to_string() }),
        }
    }

    /// What to record in a manifest or checkpoint to load this tokenizer again.
    pub fn spec(&self) -> &TokenizerSpec {
        &self.spec
    }

    /// Ids lie in `0..vocab()`: 256, 50257, or the Hugging Face tokenizer's largest id + 1.
    pub fn vocab(&self) -> usize {
        match &self.kind {
            Kind::Bytes => 256,
            Kind::Gpt2(_) => GPT2_VOCAB,
            Kind::Hf(h) => h.vocab,
        }
    }

    /// The end-of-text id that separates documents: GPT-2's `<|endoftext|>` 50256; a Hugging
    /// Face tokenizer's `<|endoftext|>`, `<|end_of_text|>`, `</s>` or `<eos>`, the first it has.
    pub fn eot(&self) -> Option<u32> {
        match &self.kind {
            Kind::Bytes => None,
            Kind::Gpt2(_) => Some(GPT2_EOT),
            Kind::Hf(h) => h.eot,
        }
    }

    /// Any bytes, invalid UTF-8 included (see the module doc for how invalid runs are
    /// encoded). Never fails: a Hugging Face tokenizer that refuses a text (which
    /// [`Tokenizer::try_encode`] reports) has it encoded byte by byte instead.
    pub fn encode(&self, text: &[u8]) -> Vec<u32> {
        match &self.kind {
            Kind::Bytes => text.iter().map(|&b| u32::from(b)).collect(),
            Kind::Gpt2(g) => g.encode(text),
            Kind::Hf(h) => {
                h.encode(text).unwrap_or_else(|_| text.iter().filter_map(|&b| h.byte_or_unk(b)).collect())
            }
        }
    }

    /// [`Tokenizer::encode`], reporting a Hugging Face tokenizer's own failure.
    pub fn try_encode(&self, text: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::Hf(h) => h.encode(text),
            _ => Ok(self.encode(text)),
        }
    }

    /// The bytes behind the ids; an id >= vocab is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let vocab = self.vocab();
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(TokenizerError::IdOutOfRange { id, index, vocab });
        }
        match &self.kind {
            Kind::Bytes => Ok(ids.iter().map(|&id| id as u8).collect()),
            Kind::Gpt2(g) => Ok(ids.iter().flat_map(|&id| g.table[id as usize].iter().copied()).collect()),
            Kind::Hf(h) if h.byte_level => {
                Ok(ids.iter().flat_map(|&id| h.table[id as usize].iter().copied()).collect())
            }
            Kind::Hf(h) => h
                .tok
                .decode(ids, false)
                .map(String::into_bytes)
                .map_err(|e| TokenizerError::Encode { path: h.path.clone(), message: e.to_string() }),
        }
    }

    /// Bytes of text behind one id, for bits per byte. Special tokens such as
    /// `<|endoftext|>` stand for no text and count 0; an id >= vocab counts 0.
    pub fn token_bytes(&self, id: u32) -> usize {
        match &self.kind {
            Kind::Bytes => usize::from(id < 256),
            Kind::Gpt2(_) if id == GPT2_EOT => 0,
            Kind::Gpt2(g) => g.table.get(id as usize).map_or(0, Vec::len),
            Kind::Hf(h) => h.table.get(id as usize).map_or(0, Vec::len),
        }
    }
}

impl Gpt2 {
    fn encode(&self, text: &[u8]) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        for chunk in text.utf8_chunks() {
            ids.extend(self.bpe.encode_ordinary(chunk.valid()));
            ids.extend(chunk.invalid().iter().map(|&b| self.byte_ids[b as usize]));
        }
        ids
    }
}

impl Hf {
    fn encode(&self, text: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        for chunk in text.utf8_chunks() {
            if !chunk.valid().is_empty() {
                let enc = self.tok.encode(chunk.valid(), false).map_err(|e| TokenizerError::Encode {
                    path: self.path.clone(),
                    message: e.to_string(),
                })?;
                ids.extend_from_slice(enc.get_ids());
            }
            ids.extend(chunk.invalid().iter().filter_map(|&b| self.byte_or_unk(b)));
        }
        Ok(ids)
    }

    fn parse(path: &str, bytes: &[u8]) -> Result<Hf, TokenizerError> {
        let parse_err = |message: String| TokenizerError::Parse { path: path.to_string(), message };
        let json: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| parse_err(e.to_string()))?;
        let mut tok = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| parse_err(e.to_string()))?;
        // Ids for a corpus: never cut or padded.
        tok.with_truncation(None).map_err(|e| parse_err(e.to_string()))?;
        tok.with_padding(None);

        let vocab_map = tok.get_vocab(true);
        let vocab = vocab_map.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        if vocab == 0 {
            return Err(parse_err("its vocabulary is empty".into()));
        }
        if vocab > u32::MAX as usize {
            return Err(parse_err(format!("its vocabulary of {vocab} ids does not fit u32")));
        }
        let byte_level = json["decoder"].get("type").and_then(|t| t.as_str()) == Some("ByteLevel");
        let special: HashMap<u32, String> = tok
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        let added: HashMap<u32, String> =
            tok.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content)).collect();
        let chars = byte_chars();
        let inverse: HashMap<char, u8> = chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut table = vec![Vec::new(); vocab];
        for (token, &id) in &vocab_map {
            let bytes = if special.contains_key(&id) {
                Vec::new()
            } else if let Some(content) = added.get(&id) {
                content.as_bytes().to_vec()
            } else if let Some(b) = byte_fallback(token) {
                vec![b]
            } else if byte_level {
                let mapped: Option<Vec<u8>> = token.chars().map(|c| inverse.get(&c).copied()).collect();
                mapped.unwrap_or_else(|| token.as_bytes().to_vec())
            } else {
                tok.decode(&[id], false).map(String::into_bytes).unwrap_or_else(|_| token.as_bytes().to_vec())
            };
            table[id as usize] = bytes;
        }
        // A token for each byte: the byte-level character, or the byte-fallback `<0xXX>`.
        let mut byte_ids = [u32::MAX; 256];
        for b in 0..256usize {
            let level = if byte_level { tok.token_to_id(&chars[b].to_string()) } else { None };
            byte_ids[b] = level.or_else(|| tok.token_to_id(&format!("<0x{b:02X}>"))).unwrap_or(u32::MAX);
        }
        let byte_ids = (!byte_ids.contains(&u32::MAX)).then_some(byte_ids);
        let unk = match json["model"].get("unk_token").and_then(|u| u.as_str()) {
            Some(s) => tok.token_to_id(s),
            None => json["model"].get("unk_id").and_then(|u| u.as_u64()).map(|u| u as u32),
        };
        if byte_ids.is_none() && unk.is_none() {
            return Err(TokenizerError::NotTotal { path: path.to_string() });
        }
        let eot =
            ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"].iter().find_map(|t| tok.token_to_id(t));
        Ok(Hf { path: path.to_string(), tok, table, byte_level, byte_ids, unk, vocab, eot })
    }

    fn byte_or_unk(&self, b: u8) -> Option<u32> {
        self.byte_ids.map(|ids| ids[b as usize]).or(self.unk)
    }
}

/// The byte of a byte-fallback token `<0xXX>`.
fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
