//! Shared fixtures of the pass tests: every spec in `specs/`, lowered at a small size
//! and differentiated with respect to every parameter.
use ir::autodiff::grad;
use ir::exec::{run, Tensor, Value};
use ir::graph::{Graph, NodeId};
use ir::lower::{lower, Lowered};
use ir::spec::{load_spec, FfnSpec, ModelSpec};
use std::collections::HashMap;
use std::path::PathBuf;

/// SplitMix64, so failures reproduce.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn signed(&mut self) -> f64 {
        2.0 * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 - 1.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn spec_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ron"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no specs in {}", dir.display());
    files
}

pub fn load(path: &std::path::Path) -> ModelSpec {
    load_spec(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn name(path: &std::path::Path) -> String {
    path.file_stem().expect("file name").to_string_lossy().into_owned()
}

/// The spec at test size: narrow, small vocabulary, short FFN.
pub fn shrink(mut spec: ModelSpec) -> ModelSpec {
    spec.vocab = 11;
    spec.d_model = 16;
    spec.heads = 2;
    spec.kv_heads = None;
    spec.head_dim = None;
    spec.ffn = match spec.ffn {
        FfnSpec::SwiGlu(mut s) => {
            s.hidden = Some(6);
            FfnSpec::SwiGlu(s)
        }
        FfnSpec::Moe(mut m) => {
            m.hidden = 4;
            FfnSpec::Moe(m)
        }
    };
    spec
}

/// The forward graph of `spec` plus its backward pass; returns the lowered graph and
/// (parameter, gradient) pairs.
pub fn training_graph(spec: &ModelSpec, batch: usize, seq: usize) -> (Lowered, Vec<(NodeId, NodeId)>) {
    let mut lowered = lower(spec, batch, seq).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    let params = lowered.graph.params();
    let grads = grad(&mut lowered.graph, lowered.loss, &params).unwrap_or_else(|e| panic!("autodiff: {e}"));
    (lowered, params.into_iter().zip(grads).collect())
}

/// Random parameters in [-0.5, 0.5) and random token ids for a training graph,
/// as the f64 reference executor takes them.
pub fn random_sources(
    lowered: &Lowered,
    pairs: &[(NodeId, NodeId)],
    vocab: usize,
    rng: &mut Rng,
) -> HashMap<NodeId, Value<f64>> {
    let g = &lowered.graph;
    let mut values: HashMap<NodeId, Value<f64>> = HashMap::new();
    for &(p, _) in pairs {
        let shape = g.node(p).shape.clone();
        let data = (0..shape.numel()).map(|_| 0.5 * rng.signed()).collect();
        values.insert(p, Value::Float(Tensor::new(shape, data)));
    }
    let shape = g.node(lowered.tokens).shape.clone();
    let tokens = (0..shape.numel()).map(|_| rng.below(vocab) as i32).collect();
    values.insert(lowered.tokens, Value::Int(Tensor::new(shape, tokens)));
    values
}

/// Every value of `wanted` in `after` equals the one in `before` within
/// `rel` (relative, absolute below 1).
pub fn assert_same_values(
    before: &HashMap<NodeId, Value<f64>>,
    after: &HashMap<NodeId, Value<f64>>,
    wanted: &[NodeId],
    rel: f64,
    what: &str,
) {
    for id in wanted {
        let (x, y) =
            (&before[id].as_float().expect("float").data, &after[id].as_float().expect("float").data);
        assert_eq!(x.len(), y.len(), "{what}: n{}", id.index());
        for (a, b) in x.iter().zip(y) {
            assert!((a - b).abs() <= rel * a.abs().max(1.0), "{what}: n{} changed: {a} vs {b}", id.index());
        }
    }
}

/// One spec's shrunk training graph (batch `B_REF`, `T_REF` tokens) with random
/// sources and the f64 values of its loss and every gradient: what a pass's
/// rewritten graph must reproduce.
pub struct Reference {
    pub name: String,
    pub spec: ModelSpec,
    pub lowered: Lowered,
    pub pairs: Vec<(NodeId, NodeId)>,
    pub grads: Vec<NodeId>,
    /// The loss, then every gradient.
    pub wanted: Vec<NodeId>,
    values: HashMap<NodeId, Value<f64>>,
    before: HashMap<NodeId, Value<f64>>,
}

pub const B_REF: usize = 2;
pub const T_REF: usize = 8;

impl Reference {
    /// The reference of the spec at `path`, its sources drawn from `seed`.
    pub fn of(path: &std::path::Path, seed: u64) -> Self {
        let name = name(path);
        let spec = shrink(load(path));
        let (lowered, pairs) = training_graph(&spec, B_REF, T_REF);
        let grads: Vec<NodeId> = pairs.iter().map(|&(_, g)| g).collect();
        let wanted: Vec<NodeId> = std::iter::once(lowered.loss).chain(grads.iter().copied()).collect();
        let values = random_sources(&lowered, &pairs, spec.vocab, &mut Rng::new(seed));
        let before = run::<f64>(&lowered.graph, &values, &wanted).unwrap_or_else(|e| panic!("{name}: {e}"));
        Reference { name, spec, lowered, pairs, grads, wanted, values, before }
    }

    /// `rewritten` (the graph after a pass) is valid, keeps the parameters and
    /// computes the loss and every gradient within `rel` of the reference.
    pub fn assert_kept_by(&self, rewritten: &Graph, rel: f64) {
        let name = &self.name;
        rewritten.check().unwrap_or_else(|e| panic!("{name}: rewritten graph: {e}"));
        assert_eq!(rewritten.params(), self.lowered.graph.params(), "{name}: parameters must survive");
        let after =
            run::<f64>(rewritten, &self.values, &self.wanted).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_same_values(&self.before, &after, &self.wanted, rel, name);
    }
}
