//! The built-in schemes are spellings of the connection language (docs/connections.md,
//! docs/math.md §12): every ```ron block of docs/connections.md whose first line is
//! `// spelled: <Scheme>(..)` is the written-out form of that built-in. Each block must parse,
//! validate and lower to the same graph as the built-in (the same canonical dump and the
//! same parameters with the same names, shapes, inits and classes), with and without MTP
//! and muP, and the built-in's own spelling (`ResidualSpec::connection`) must equal it.

use std::path::Path;

use widen::ir::graph::{to_text, Op};
use widen::ir::lower::lower;
use widen::ir::spec::{parse_spec, ModelSpec, MtpSpec, MupSpec, Parametrization, ResidualSpec};

/// `(built-in, written-out)` residual texts from docs/connections.md.
fn spelled_blocks() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/connections.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "```ron" {
            continue;
        }
        let block: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        if let Some(builtin) = block.first().and_then(|l| l.trim().strip_prefix("// spelled: ")) {
            out.push((builtin.to_string(), block[1..].join("\n")));
        }
    }
    out
}

fn model(residual: &str, name: &str) -> ModelSpec {
    let text = format!("Model(name: \"{name}\", d_model: 64, layers: 2, heads: 4, residual: {residual})");
    let spec = parse_spec(&text, &format!("{name}.ron")).unwrap_or_else(|e| panic!("{name}: {e}"));
    spec.validate().unwrap_or_else(|e| panic!("{name}: {e:?}"));
    spec
}

/// The canonical dump plus every parameter's name, shape, init and class.
fn fingerprint(spec: &ModelSpec) -> (String, Vec<String>) {
    let lowered = lower(spec, 2, 8).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    let g = &lowered.graph;
    let params = g
        .params()
        .into_iter()
        .map(|p| match &g.node(p).op {
            Op::Param(info) => {
                format!("{} {:?} {:?} {:?}", info.name, g.node(p).shape, info.init, info.class)
            }
            other => panic!("not a parameter: {other:?}"),
        })
        .collect();
    (to_text(g), params)
}

#[test]
fn every_written_out_builtin_lowers_to_the_builtins_graph() {
    let blocks = spelled_blocks();
    let names: Vec<&str> = blocks.iter().map(|(b, _)| b.split('(').next().unwrap_or("")).collect();
    assert_eq!(names, ["Hc", "Fc", "Mhc", "Ghc"], "docs/connections.md spells these built-ins");
    for (builtin, written) in &blocks {
        let base = model(builtin, "builtin");
        let spelled = model(written, "builtin");
        assert!(matches!(spelled.residual, ResidualSpec::Connection(_)), "{builtin}: a Connection");
        assert_eq!(base.residual.connection(), spelled.residual.connection(), "{builtin}: its spelling");
        let variants: [fn(&mut ModelSpec); 3] = [
            |_| {},
            |s| s.mtp = MtpSpec { depth: 1, ..MtpSpec::default() },
            |s| s.parametrization = Parametrization::MuP(MupSpec { base_width: 32, ..MupSpec::default() }),
        ];
        for (i, edit) in variants.iter().enumerate() {
            let (mut a, mut b) = (base.clone(), spelled.clone());
            edit(&mut a);
            edit(&mut b);
            let (dump_a, params_a) = fingerprint(&a);
            let (dump_b, params_b) = fingerprint(&b);
            assert_eq!(params_a, params_b, "{builtin} (variant {i}): parameters");
            assert!(dump_a == dump_b, "{builtin} (variant {i}): the graphs differ");
            assert!(params_a.iter().any(|p| p.contains(".conn.")), "{builtin}: has connection parameters");
        }
    }
}

/// A written-out design is refused field by field, with what would be valid.
#[test]
fn inconsistent_designs_name_the_field_and_the_fix() {
    let cases = [
        (
            "Connection(segments: 2, create: Replicate, collapse: Reduce(norm: Off, init: BlockIdentity))",
            "residual.create",
            "Split or Wide(Full)",
        ),
        (
            "Connection(streams: 4, segments: 2, create: Wide(Full), collapse: Concat)",
            "residual.collapse",
            "use Reduce",
        ),
        (
            "Connection(streams: 8, carry: (constraint: Permutations), generator: Flat())",
            "residual.carry.constraint",
            "streams <= 6",
        ),
        (
            "Connection(streams: 3, carry: (constraint: Permutations), generator: PerSlot())",
            "residual.carry.constraint",
            "Flat generator",
        ),
        (
            "Connection(streams: 6, carry: (constraint: Kronecker), generator: Flat())",
            "residual.carry.constraint",
            "streams = 2^K",
        ),
        (
            "Connection(streams: 4, carry: (constraint: Kronecker, init: Values([0.0, -8.0])))",
            "residual.carry.init",
            "4 logits",
        ),
        ("Connection(streams: 4, read: (constraint: Kronecker))", "residual.read.constraint", "only a carry"),
        (
            "Connection(read: (constraint: Sinkhorn(iters: 3, eps: 0.0)))",
            "residual.read.constraint",
            "square carry",
        ),
        ("Connection(streams: 2, write: (init: Values([1.0])))", "residual.write.init", "2 logits"),
        ("Connection(read: (init: Logit(1.5)))", "residual.read.init", "(0, 1)"),
        (
            "Connection(streams: 2, segments: 1, write: (form: PerSlot))",
            "residual.write.form",
            "streams = segments",
        ),
        (
            "Connection(collapse: Readout(init: Constant(1.0), form: PerSlot))",
            "residual.collapse.form",
            "leave form out",
        ),
    ];
    for (residual, path, hint) in cases {
        let text = format!("Model(d_model: 64, layers: 2, heads: 4, residual: {residual})");
        let spec = parse_spec(&text, "bad.ron").unwrap_or_else(|e| panic!("{residual}: {e}"));
        let errors = spec.validate().expect_err(residual);
        let e = errors
            .iter()
            .find(|e| e.path == path)
            .unwrap_or_else(|| panic!("{residual}: no error at {path}: {errors:?}"));
        assert!(e.message.contains(hint), "{residual}: `{}` lacks `{hint}`", e.message);
    }
}
