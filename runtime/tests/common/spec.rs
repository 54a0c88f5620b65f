//! Shared test fixture: a spec from `specs/` shrunk to a test-sized backbone.

use ir::spec::{load_spec, DataSpec, FfnSpec, Flash, ModelSpec, ResidualSpec, SwiGluSpec, SyntheticCorpus};
use std::path::PathBuf;

/// The sizes a test shrinks a spec to.
pub struct Shrink {
    pub ffn_hidden: usize,
    pub moe_hidden: usize,
    pub seq_len: usize,
    pub batch: usize,
}

/// Loads `specs/<file>` and shrinks its backbone: d_model 32, 2 heads, one block (two
/// where the scheme shares decisions across a block pair, docs/math.md §6.11), the given
/// FFN widths, sequence length and batch, on the built-in synthetic corpus.
pub fn shrunk_spec(file: &str, sizes: &Shrink) -> ModelSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs").join(file);
    let mut spec = load_spec(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    spec.d_model = 32;
    spec.heads = 2;
    spec.kv_heads = None;
    spec.head_dim = None;
    spec.layers = match &spec.residual {
        ResidualSpec::Xhc(x) if x.flash == Flash::TwoBlock => 2,
        _ => 1,
    };
    spec.ffn = match spec.ffn {
        FfnSpec::SwiGlu(_) => FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(sizes.ffn_hidden) }),
        FfnSpec::Moe(mut m) => {
            m.hidden = sizes.moe_hidden;
            FfnSpec::Moe(m)
        }
    };
    spec.train.data = DataSpec::Synthetic(SyntheticCorpus::Default);
    spec.train.seq_len = sizes.seq_len;
    spec.train.batch = sizes.batch;
    spec
}
