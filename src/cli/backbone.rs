//! `--d-model --layers --heads --seq-len --batch`: one backbone for every spec of a `bench` or
//! `parity` run, so schemes compare at the same size.

use ir::spec::ModelSpec;

/// Backbone overrides applied to every spec (validated when the spec is lowered).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Backbone {
    /// Override the backbone width D.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Override the number of blocks L.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Override the number of query heads (key/value heads follow when they no longer divide it).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Override the sequence length T.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Override the batch size B.
    #[arg(long)]
    pub batch: Option<usize>,
}

impl Backbone {
    /// Applies the overrides; the result is validated when lowered.
    pub fn apply(&self, spec: &mut ModelSpec) {
        if let Some(d) = self.d_model {
            spec.d_model = d;
            spec.head_dim = None;
        }
        if let Some(l) = self.layers {
            spec.layers = l;
        }
        if let Some(h) = self.heads {
            spec.heads = h;
            spec.head_dim = None;
            if spec.kv_heads.is_some_and(|kv| kv == 0 || h % kv != 0) {
                spec.kv_heads = None;
            }
        }
        if let Some(t) = self.seq_len {
            spec.train.seq_len = t;
        }
        if let Some(b) = self.batch {
            spec.train.batch = b;
        }
    }
}
