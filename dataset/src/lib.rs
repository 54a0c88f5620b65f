//! Token datasets for widen: llm.c / modded-nanogpt token shards and nanoGPT's headerless
//! `.bin` files read memory-mapped ([`shard`]), the tokenizers that produce their ids, and
//! `widen data prepare`'s corpus preparation. The formats, the split rules and the manifest
//! are described in docs/data.md.

pub mod manifest;
pub mod prepare;
pub mod shard;
pub mod tokenizer;

pub use manifest::{Manifest, ManifestError, SplitRule};
pub use prepare::{prepare, PrepareError, PrepareOptions};
pub use shard::{ShardError, ShardFormat, ShardInfo, ShardSet};
pub use tokenizer::{Tokenizer, TokenizerError};
