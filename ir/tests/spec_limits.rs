//! Bounds on everything a user can type into a spec (README, "What widen guarantees"): a byte corpus needs
//! `vocab >= 256`, `name` is one safe path component, every integer has an upper bound
//! with its reason, the training-memory estimate has a fixed ceiling and a machine
//! check, and MTP depth stays below the sequence length.

use ir::cost::{cost_report, training_memory};
use ir::lower::{lower, LowerError};
use ir::spec::limits::{integer_limit, INTEGER_LIMITS, MAX_TRAINING_BYTES};
use ir::spec::{load_spec, DataSpec, FieldError, GhcSpec, ModelSpec, ResidualSpec, SpecLoadError};

fn invalid(text: &str) -> Vec<FieldError> {
    match ModelSpec::from_ron_str(text) {
        Err(SpecLoadError::Invalid { errors, .. }) => errors,
        other => panic!("{text}: expected Invalid, got {other:?}"),
    }
}

fn error_at<'a>(errors: &'a [FieldError], path: &str) -> &'a FieldError {
    errors.iter().find(|e| e.path == path).unwrap_or_else(|| panic!("no error at `{path}`: {errors:#?}"))
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{message}` does not mention `{part}`");
    }
}

#[test]
fn byte_corpora_need_vocab_256() {
    for (data, corpus) in [
        (DataSpec::Synthetic(ir::spec::SyntheticCorpus::Default), "Synthetic(Default)"),
        (DataSpec::Text("data/shakespeare.txt".into()), "Text(\"data/shakespeare.txt\")"),
    ] {
        let mut spec = ModelSpec { vocab: 255, ..ModelSpec::default() };
        spec.train.data = data;
        let errors = spec.validate().expect_err("vocab 255 is refused");
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert_mentions(&error_at(&errors, "vocab").message, &["vocab = 255", ">= 256", corpus, "0..=255"]);
        spec.vocab = 256;
        assert_eq!(spec.validate(), Ok(()));
    }
}

#[test]
fn graphs_alone_keep_small_vocabularies() {
    // Gradient checks lower tiny models that are never trained on bytes.
    let spec = ModelSpec { vocab: 11, d_model: 8, layers: 1, heads: 2, ..ModelSpec::default() };
    assert!(spec.validate().is_err());
    assert_eq!(spec.validate_graph(), Ok(()));
    lower(&spec, 1, 4).expect("a graph with V = 11 lowers");
    let spec = ModelSpec { vocab: 1, ..spec };
    let errors = spec.validate_graph().expect_err("a softmax needs 2 classes");
    assert_mentions(&error_at(&errors, "vocab").message, &["vocab = 1", ">= 2"]);
}

#[test]
fn names_are_one_safe_path_component() {
    for bad in ["../../x", "/tmp/x", "a/b", "..", ".", "a b", "C:\\x", "naïve", "x\0y", ""] {
        let spec = ModelSpec { name: bad.into(), ..ModelSpec::default() };
        let errors = spec.validate().expect_err(bad);
        let message = &error_at(&errors, "name").message;
        assert_mentions(message, &["name = ", "A-Z a-z 0-9 . _ -", "runs/"]);
    }
    let long = "a".repeat(65);
    let errors = ModelSpec { name: long.clone(), ..ModelSpec::default() }.validate().expect_err("long");
    assert_mentions(&error_at(&errors, "name").message, &["65 characters", "1 to 64"]);
    for good in ["tiny", "vwn-1.5x", "My_Model.v2", ".hidden", &"a".repeat(64)] {
        let spec = ModelSpec { name: good.into(), ..ModelSpec::default() };
        assert_eq!(spec.validate(), Ok(()), "{good}");
    }
}

/// A RON spec with the field at `path` set to `value` (`{}`), in a context where the
/// field exists and its neighbours allow large values.
fn template(path: &str) -> &'static str {
    match path {
        "vocab" => "Model(vocab: {})",
        "vocab_pad_to" => "Model(vocab_pad_to: {})",
        "d_model" => "Model(d_model: {}, heads: 1, head_dim: 2)",
        "layers" => "Model(layers: {})",
        "heads" => "Model(heads: {}, head_dim: 2)",
        "kv_heads" => "Model(kv_heads: {})",
        "head_dim" => "Model(head_dim: {})",
        "ffn.hidden" => "Model(ffn: SwiGlu(hidden: {}))",
        "ffn.experts" => "Model(ffn: Moe(experts: {}))",
        "ffn.top_k" => "Model(ffn: Moe(top_k: {}))",
        "ffn.shared" => "Model(ffn: Moe(shared: {}))",
        "residual.n" => "Model(residual: Hc(n: {}))",
        "residual.m" => "Model(residual: Fc(m: {}))",
        "residual.k" => "Model(residual: Xhc(k: {}))",
        "residual.fixed" => "Model(residual: Xhc(fixed: {}))",
        "residual.conv_kernels" => "Model(residual: Xhc(conv_kernels: [{}]))",
        "residual.sinkhorn_iters" => "Model(residual: Mhc(sinkhorn_iters: {}))",
        "mtp.depth" => "Model(mtp: (depth: {}), train: (seq_len: 100))",
        "parametrization.base_width" => "Model(parametrization: MuP(base_width: {}))",
        "residual.streams" => "Model(residual: Connection(streams: {}))",
        "residual.segments" => "Model(residual: Connection(segments: {}))",
        "residual.carry.constraint.iters" => {
            "Model(residual: Connection(carry: (constraint: Sinkhorn(iters: {}, eps: 0.0))))"
        }
        "residual.history.block" => "Model(residual: Connection(streams: 1, history: History(block: {})))",
        "residual.history.dilation" => {
            "Model(residual: Connection(history: History(entries: States, dilation: {})))"
        }
        "residual.history.period" => {
            "Model(residual: Connection(history: History(entries: States, period: {})))"
        }
        "train.seq_len" => "Model(train: (seq_len: {}))",
        "train.batch" => "Model(train: (batch: {}))",
        "train.steps" => "Model(train: (steps: {}))",
        "train.seed" => "Model(train: (seed: {}))",
        "train.eval_every" => "Model(train: (eval_every: {}))",
        "train.eval_batches" => "Model(train: (eval_batches: {}))",
        "train.val_tokens" => "Model(train: (val_tokens: {}))",
        "train.checkpoint_every" => "Model(train: (checkpoint_every: {}))",
        "train.recompute" => "Model(train: (recompute: Block({})))",
        "train.schedule.warmup" => "Model(train: (schedule: Constant(warmup: {})))",
        "train.optimizer.ns_steps" => "Model(train: (optimizer: Muon(ns_steps: {})))",
        other => panic!("no template for `{other}`: add one"),
    }
}

#[test]
fn every_integer_has_an_upper_bound_with_its_reason() {
    for limit in INTEGER_LIMITS {
        let spec_path =
            if limit.path == "residual.conv_kernels" { "residual.conv_kernels[0]" } else { limit.path };
        if limit.max == u64::MAX {
            continue;
        }
        let text = template(limit.path).replace("{}", &(limit.max + 1).to_string());
        let errors = invalid(&text);
        let bound = format!("must be <= {}", limit.max);
        let e = errors
            .iter()
            .find(|e| e.path == spec_path && e.message.contains(&bound))
            .unwrap_or_else(|| panic!("{text}: no `{bound}` at `{spec_path}`: {errors:#?}"));
        assert_mentions(&e.message, &[limit.why]);
    }
}

#[test]
fn every_integer_field_has_a_row() {
    let mut spec = ModelSpec::default();
    let mut paths = Vec::new();
    for residual in [
        ResidualSpec::Hc(Default::default()),
        ResidualSpec::Fc(Default::default()),
        ResidualSpec::Mhc(Default::default()),
        ResidualSpec::Ghc(Default::default()),
        ResidualSpec::Xhc(Default::default()),
        ResidualSpec::Connection(ir::spec::ConnectionSpec::mhc(&Default::default())),
        ResidualSpec::Connection(ir::spec::ConnectionSpec {
            history: Some(Default::default()),
            ..ir::spec::ConnectionSpec::mhc(&Default::default())
        }),
    ] {
        spec.residual = residual;
        paths.extend(ir::spec::limits::integer_paths(&spec));
    }
    spec.kv_heads = Some(4);
    spec.head_dim = Some(16);
    spec.vocab_pad_to = Some(64);
    spec.train.val_tokens = Some(1 << 20);
    spec.train.recompute = ir::spec::Recompute::Block(2);
    spec.ffn = ir::spec::FfnSpec::Moe(Default::default());
    spec.parametrization = ir::spec::Parametrization::MuP(Default::default());
    spec.train.optimizer = ir::spec::OptimizerSpec::Muon(Default::default());
    paths.extend(ir::spec::limits::integer_paths(&spec));
    spec.ffn = ir::spec::FfnSpec::SwiGlu(ir::spec::SwiGluSpec { hidden: Some(8) });
    paths.extend(ir::spec::limits::integer_paths(&spec));
    for path in &paths {
        let row = path.split('[').next().unwrap();
        assert!(integer_limit(row).is_some(), "`{path}` has no row in INTEGER_LIMITS");
    }
    for limit in INTEGER_LIMITS {
        assert!(paths.iter().any(|p| p.split('[').next() == Some(limit.path)), "unused row {}", limit.path);
    }
}

#[test]
fn the_issues_huge_values_are_refused_by_field() {
    let cases = [
        ("Model(residual: Ghc(m: 4, n: 18446744073709551615))", "residual.n"),
        ("Model(layers: 100000000000)", "layers"),
        ("Model(residual: Mhc(sinkhorn_iters: 1000000000))", "residual.sinkhorn_iters"),
        ("Model(residual: Xhc(sinkhorn_iters: 1000000000))", "residual.sinkhorn_iters"),
        ("Model(train: (eval_batches: 1000000000000))", "train.eval_batches"),
        ("Model(train: (steps: 1000000000000))", "train.steps"),
        ("Model(ffn: Moe(experts: 1000000000, top_k: 1))", "ffn.experts"),
        ("Model(residual: Xhc(conv_kernels: [1000000000000]))", "residual.conv_kernels[0]"),
    ];
    for (text, path) in cases {
        let errors = invalid(text);
        assert_mentions(&error_at(&errors, path).message, &[path, "must be <="]);
    }
    let kernels = format!("Model(residual: Xhc(conv_kernels: [{}]))", ["3"; 17].join(", "));
    assert_mentions(
        &error_at(&invalid(&kernels), "residual.conv_kernels").message,
        &["17 kernels", "at most 16"],
    );
}

#[test]
fn mtp_depth_stays_below_seq_len() {
    let errors = invalid("Model(mtp: (depth: 8), train: (seq_len: 8))");
    assert_mentions(&error_at(&errors, "mtp.depth").message, &["mtp.depth = 8", "< train.seq_len = 8"]);
    assert!(ModelSpec::from_ron_str("Model(mtp: (depth: 7), train: (seq_len: 8))").is_ok());
    // The graph's own T counts when lowering at another length.
    let spec =
        ModelSpec { mtp: ir::spec::MtpSpec { depth: 4, ..Default::default() }, ..ModelSpec::default() };
    match lower(&spec, 1, 4) {
        Err(LowerError::Invalid(errors)) => {
            assert_mentions(&error_at(&errors, "mtp.depth").message, &["mtp.depth = 4", "sequence length 4"])
        }
        Err(other) => panic!("expected Invalid, got {other}"),
        Ok(_) => panic!("expected Invalid, got a graph"),
    }
    lower(&spec, 1, 5).expect("depth 4 at T = 5 lowers");
}

#[test]
fn memory_ceiling_names_the_dominant_field_and_the_estimate() {
    // 64 blocks at D = 2^18: ~50 T parameters, far above any machine.
    let errors = invalid("Model(d_model: 262144, heads: 1024, layers: 64)");
    let e = error_at(&errors, "layers");
    assert_mentions(&e.message, &["training needs about", "GiB", "block weights", "no machine holds that"]);
    // Activations: the batch and sequence length.
    let errors = invalid("Model(d_model: 4096, train: (batch: 1048576, seq_len: 65536))");
    assert_mentions(&error_at(&errors, "train.batch").message, &["activations", "train.seq_len", "GiB"]);
    // The vocabulary.
    let errors = invalid("Model(vocab: 2147483648, d_model: 65536, heads: 64)");
    assert_mentions(&error_at(&errors, "vocab").message, &["embedding and unembedding", "GiB"]);
    // Below the ceiling passes validation whatever this machine holds.
    let big =
        ModelSpec::from_ron_str("Model(d_model: 16384, heads: 128, layers: 64)").expect("under the ceiling");
    let memory = training_memory(&big);
    assert!(memory.total_bytes > (1u64 << 40) as f64 && memory.total_bytes < MAX_TRAINING_BYTES as f64);
}

#[test]
fn check_fits_compares_with_the_machine() {
    let spec = ModelSpec::default();
    let memory = spec.check_fits(1 << 30).expect("the default spec fits in 1 GiB");
    assert!(memory.total_bytes > 0.0 && memory.total_bytes < (1u64 << 30) as f64);
    let e = spec.check_fits(1 << 20).expect_err("not in 1 MiB");
    assert!(!e.path.is_empty());
    assert_mentions(&e.message, &["training needs about", "GiB", "0.0 GiB of memory available"]);
}

/// The closed-form estimate against the graph's counts, for every spec of `specs/`:
/// parameters within 10 %, activations per token within a factor of 2 above or below.
#[test]
fn estimate_agrees_with_the_graph() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut checked = 0;
    for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "ron")) {
        let spec = load_spec(path).unwrap_or_else(|e| panic!("{e}"));
        let report = cost_report(&spec).unwrap();
        let memory = training_memory(&spec);
        let counted = report.params.total as f64;
        let ratio = memory.params / counted;
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{}: params {} vs counted {counted}",
            path.display(),
            memory.params
        );
        let tokens = (spec.train.batch * spec.train.seq_len) as f64;
        let per_token = memory.activation_bytes / tokens;
        let counted = report.activation_bytes_per_token as f64;
        let ratio = per_token / counted;
        assert!(
            (0.5..=2.0).contains(&ratio),
            "{}: activations/token {per_token} vs counted {counted}",
            path.display()
        );
        checked += 1;
    }
    assert!(checked >= 10);
}

#[test]
fn ghc_with_huge_streams_is_refused_before_lowering() {
    let spec = ModelSpec {
        residual: ResidualSpec::Ghc(GhcSpec { m: 4, n: 1 << 40, ..GhcSpec::default() }),
        ..ModelSpec::default()
    };
    match lower(&spec, 1, 8) {
        Err(LowerError::Invalid(errors)) => assert!(errors.iter().any(|e| e.path == "residual.n")),
        Err(other) => panic!("expected Invalid, got {other}"),
        Ok(_) => panic!("expected Invalid, got a graph"),
    }
}
