//! The connection language's depth history (docs/math.md §12.5) against the designs it
//! must reduce to, on the f64 reference executor at the parameters' inits: a history of
//! outputs with unit static weights is the plain residual (the same sums in another
//! order), and DenseFormer at init (α_{i,i} = 1, the rest 0, read, carry and write fixed
//! at 1) is the plain residual bit for bit. Also: an MTP module's own history, and the
//! refusals of validation, each naming its field.

mod common;

use common::tiny_model::{perturbed_params, random_window, tiny_spec};
use ir::exec::run;
use ir::lower::lower;
use ir::spec::{parse_spec, ModelSpec, ResidualSpec};
use runtime::rng::Rng;

const B: usize = 2;
const T: usize = 6;

fn residual_of(text: &str) -> ResidualSpec {
    parse_spec(&format!("Model(residual: {text})"), "history.ron")
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .residual
}

fn spec(name: &str, residual: ResidualSpec) -> ModelSpec {
    ModelSpec { layers: 3, ..tiny_spec(name, residual) }
}

/// The f64 loss at the parameters' inits (seed 7) on one fixed token window.
fn loss_at_init(spec: &ModelSpec) -> f64 {
    let lowered = lower(spec, B, T).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    let g = &lowered.graph;
    let mut values = perturbed_params(g, 7, 0.0);
    let mut rng = Rng::stream(3, "test.history.window");
    values.insert(lowered.tokens, random_window(g, lowered.tokens, spec.vocab, &mut rng));
    let out = run::<f64>(g, &values, &[lowered.loss]).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    out[&lowered.loss].as_float().expect("a float loss").data[0]
}

#[test]
fn outputs_with_unit_static_weights_are_the_plain_residual() {
    let plain = loss_at_init(&spec("residual", ResidualSpec::Residual));
    for block in [1, 2, 3, 6] {
        let text =
            format!("Connection(streams: 1, history: History(entries: Outputs, block: {block}, weights: Static(Ones)))");
        let history = loss_at_init(&spec("history", residual_of(&text)));
        println!("block {block}: residual {plain:.17}, history {history:.17}");
        assert!((history - plain).abs() <= 1e-12 * plain.abs(), "block {block}: {history} vs {plain}");
    }
    // Attention weights at init average the entries instead of adding them: another model.
    let mean = residual_of("Connection(streams: 1, history: History(entries: Outputs, block: 1))");
    let attention = loss_at_init(&spec("attention", mean));
    assert!((attention - plain).abs() > 1e-6, "attention {attention} vs residual {plain}");
}

#[test]
fn denseformer_at_init_is_the_plain_residual_bit_for_bit() {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/denseformer.ron");
    let dense = ir::spec::load_spec(&file).expect("specs/denseformer.ron loads");
    let plain = loss_at_init(&spec("residual", ResidualSpec::Residual));
    let with = loss_at_init(&spec("denseformer", dense.residual.clone()));
    assert_eq!(with.to_bits(), plain.to_bits(), "denseformer {with} vs residual {plain}");
    // With learned (not fixed) unit coefficients the init is the same model too; a dilated,
    // periodic history of states with mean weights is not.
    let learned = residual_of(
        "Connection(streams: 1, read: (init: Constant(1.0)), carry: (init: Constant(1.0)), \
         write: (init: Constant(1.0)), history: History(entries: States, weights: Static(Newest)))",
    );
    assert_eq!(loss_at_init(&spec("learned", learned)).to_bits(), plain.to_bits());
    let mean = residual_of(
        "Connection(streams: 1, read: (init: Constant(1.0), learned: false), \
         carry: (init: Constant(1.0), learned: false), write: (init: Constant(1.0), learned: false), \
         history: History(entries: States, block: 1, weights: Static(Mean), dilation: 2, period: 2))",
    );
    assert!((loss_at_init(&spec("mean", mean)) - plain).abs() > 1e-6);
}

/// Every read's weights: one per sublayer (and the head's) for outputs, one per finished
/// entry whose index the period divides for states, each over as many entries as its
/// index set holds (docs/math.md §12.5).
#[test]
fn reads_combine_the_documented_entries() {
    let weights = |text: &str, mtp: usize| -> Vec<(String, usize)> {
        let mut s = spec("h", residual_of(text));
        s.mtp.depth = mtp;
        let lowered = lower(&s, B, T).unwrap_or_else(|e| panic!("{text}: {e}"));
        let g = &lowered.graph;
        let mut out: Vec<(String, usize)> = g
            .params()
            .into_iter()
            .filter_map(|p| match &g.node(p).op {
                ir::graph::Op::Param(info) if info.name.ends_with("history.weights") => {
                    Some((info.name.clone(), g.node(p).shape.dims()[0]))
                }
                _ => None,
            })
            .collect();
        out.sort();
        out
    };
    let named = |v: &[(&str, usize)]| v.iter().map(|(n, k)| (n.to_string(), *k)).collect::<Vec<_>>();
    // Outputs, block 2 over 6 sublayers: sublayer l reads 1 + l/2 entries and, inside a
    // block, the partial sum; the head reads the embedding and the 3 block sums.
    assert_eq!(
        weights("Connection(streams: 1, history: History(block: 2, weights: Static(Mean)))", 0),
        named(&[
            ("blocks.0.attn.history.weights", 1),
            ("blocks.0.ffn.history.weights", 2),
            ("blocks.1.attn.history.weights", 2),
            ("blocks.1.ffn.history.weights", 3),
            ("blocks.2.attn.history.weights", 3),
            ("blocks.2.ffn.history.weights", 4),
            ("history.weights", 4),
        ])
    );
    // States, one entry per sublayer, dilation 2, period 2: reads after entries 2, 4, 6
    // over j ≡ i (mod 2), j <= i.
    assert_eq!(
        weights(
            "Connection(streams: 2, history: History(entries: States, block: 1, weights: Static(Newest), dilation: 2, period: 2))",
            0
        ),
        named(&[
            ("blocks.0.ffn.history.weights", 2),
            ("blocks.1.ffn.history.weights", 3),
            ("blocks.2.ffn.history.weights", 4),
        ])
    );
    // An MTP module's history starts at its fused input: its first read has one entry, and
    // its head reads the fused input and its block's sum.
    let mtp = weights("Connection(streams: 1, history: History(block: 2, weights: Static(Ones)))", 1);
    let module: Vec<_> = mtp.into_iter().filter(|(n, _)| n.starts_with("mtp.")).collect();
    assert_eq!(
        module,
        named(&[
            ("mtp.1.block.attn.history.weights", 1),
            ("mtp.1.block.ffn.history.weights", 2),
            ("mtp.1.history.weights", 2),
        ])
    );
}

#[test]
fn validation_names_the_field_and_what_would_be_valid() {
    let refused = |text: &str, path: &str, words: &str| {
        let spec = parse_spec(&format!("Model(layers: 2, residual: {text})"), "h.ron").expect("parses");
        let errors = spec.validate().expect_err(text);
        let hit = errors
            .iter()
            .find(|e| e.path == path)
            .unwrap_or_else(|| panic!("{text}: no error at {path}: {errors:?}"));
        assert!(hit.message.contains(words), "{text}: `{}` lacks `{words}`", hit.message);
    };
    refused("Connection(history: History())", "residual.streams", "streams: 1");
    refused(
        "Connection(streams: 1, generator: Flat(), history: History())",
        "residual.generator",
        "entries: States",
    );
    refused(
        "Connection(streams: 1, read: (init: Constant(2.0)), history: History())",
        "residual.read",
        "read left out",
    );
    refused(
        "Connection(streams: 1, history: History(dilation: 2))",
        "residual.history.dilation",
        "entries: States",
    );
    refused("Connection(streams: 1, history: History(block: 5))", "residual.history.block", "2 x layers = 4");
    refused("Connection(streams: 1, history: History(block: 0))", "residual.history.block", ">= 1");
    refused(
        "Connection(streams: 1, history: History(entries: States, period: 0))",
        "residual.history.period",
        ">= 1",
    );
    refused(
        "Connection(streams: 2, generator: Flat(), read: (init: Constant(1.0), learned: false), history: History(entries: States))",
        "residual.read.learned",
        "the same for all three",
    );
    // The same fields with a fixed state beside the history are a valid design.
    let ok = parse_spec(
        "Model(layers: 2, residual: Connection(streams: 4, generator: Flat(), history: History(entries: States, dilation: 2)))",
        "h.ron",
    )
    .expect("parses");
    assert!(ok.validate().is_ok(), "{:?}", ok.validate());
}
