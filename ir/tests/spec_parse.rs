//! Reading spec text and files: syntax errors, unknown names, the RON extensions
//! specs rely on, load-time validation, and the `to_ron` round trip (docs/architecture.md §3).

use std::path::{Path, PathBuf};

use ir::spec::{
    load_spec, parse_spec, AdamWSpec, AuxLossScope, AuxLossSpec, BiasUpdateSpec, DataSpec, FfnSpec, Flash,
    GhcSpec, ModelSpec, MoeBalance, MoeDispatch, MoeGate, MoeSpec, MtpSpec, MuonScale, MuonSpec, MupSpec,
    OptimizerSpec, Parametrization, Precision, ReduceNorm, ResidualSpec, ScheduleSpec, SpecLoadError,
    UnknownName, WsdSpec, XhcSpec,
};

fn unknown_names(text: &str) -> Vec<UnknownName> {
    match parse_spec(text, "t.ron") {
        Err(SpecLoadError::UnknownNames { names, .. }) => names,
        other => panic!("expected unknown names, got {other:?}"),
    }
}

/// A file under the system temp folder, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("widen-spec-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("temp file writable");
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn syntax_error_carries_line_and_column() {
    let text = "Model(\n    vocab: 256,\n    d_model: ,\n)";
    match parse_spec(text, "bad.ron") {
        Err(e @ SpecLoadError::Syntax { line, col, .. }) => {
            assert_eq!((line, col), (3, 14), "{e}");
            assert!(e.to_string().starts_with("bad.ron:3:14: "), "{e}");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
}

#[test]
fn wrong_value_type_carries_line_and_column() {
    let text = "Model(\n  vocab: \"many\",\n)";
    match parse_spec(text, "bad.ron") {
        Err(SpecLoadError::Syntax { line, col, message, .. }) => {
            assert_eq!((line, col), (2, 10));
            assert!(message.starts_with("in `vocab`: "), "{message}");
            assert!(message.contains("integer"), "{message}");
        }
        other => panic!("expected a type error, got {other:?}"),
    }
}

#[test]
fn type_error_in_a_variant_names_the_nested_field() {
    match parse_spec("Model(residual: Ghc(m: 2, n: 4.5))", "bad.ron") {
        Err(SpecLoadError::Syntax { line, message, .. }) => {
            assert_eq!(line, 1);
            assert!(message.starts_with("in `residual.n`: "), "{message}");
        }
        other => panic!("expected a type error, got {other:?}"),
    }
}

#[test]
fn missing_file_names_the_path() {
    let path = Path::new("/no/such/folder/model.ron");
    let err = load_spec(path).expect_err("missing file");
    assert!(matches!(err, SpecLoadError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("/no/such/folder/model.ron"), "{err}");
}

#[test]
fn unknown_field_gets_path_position_suggestion_and_valid_fields() {
    let names = unknown_names("Model(\n  residual: Ghc(m: 4, nn: 16),\n)");
    assert_eq!(names.len(), 1);
    let n = &names[0];
    assert_eq!((n.path.as_str(), n.line, n.col), ("residual.nn", 2, 23));
    assert!(
        n.message.starts_with(
            "unknown field `nn` in residual (Ghc); did you mean `n`? valid fields: m, n, dynamic,"
        ),
        "{}",
        n.message
    );
}

#[test]
fn every_unknown_field_is_reported_at_once() {
    let text = "Model(\n  vocab_size: 256,\n  residual: Ghc(nn: 16),\n  train: (optimizer: AdamW(lrr: 0.1), zzz: 1),\n)";
    let names = unknown_names(text);
    let got: Vec<(&str, usize)> = names.iter().map(|n| (n.path.as_str(), n.line)).collect();
    assert_eq!(got, [("vocab_size", 2), ("residual.nn", 3), ("train.optimizer.lrr", 4), ("train.zzz", 4)]);
    assert!(names[0].message.contains("in Model; did you mean `vocab`?"), "{}", names[0].message);
    assert!(
        names[2].message.contains("in train.optimizer (AdamW); did you mean `lr`?"),
        "{}",
        names[2].message
    );
    // No valid field is close to `zzz`: no suggestion, just the valid names.
    assert!(names[3].message.contains("in train; valid fields: data, seq_len,"), "{}", names[3].message);
    let shown = parse_spec(text, "t.ron").unwrap_err().to_string();
    assert!(shown.starts_with("t.ron: 4 problems\n  - 2:3: unknown field `vocab_size`"), "{shown}");
}

#[test]
fn unknown_variant_names_the_field_and_valid_variants() {
    let names = unknown_names("Model(residual: Ghx(m: 4), ffn: SwiGlu())");
    assert_eq!(names.len(), 1);
    assert_eq!((names[0].path.as_str(), names[0].line, names[0].col), ("residual", 1, 17));
    assert_eq!(
        names[0].message,
        "unknown variant `Ghx` for residual; did you mean `Ghc`? valid variants: Residual, Hc, Fc, Mhc, Ghc, Xhc, Connection"
    );
}

#[test]
fn unknown_variant_inside_an_option_and_a_newtype() {
    let names =
        unknown_names("Model(residual: Ghc(reduce_norm: Groupnorm), train: (data: Synthetic(Shakespeare)))");
    let paths: Vec<&str> = names.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(paths, ["residual.reduce_norm", "train.data"]);
    assert!(names[0].message.contains("did you mean `GroupNorm`?"), "{}", names[0].message);
    assert!(names[1].message.ends_with("valid variants: Default"), "{}", names[1].message);
}

#[test]
fn options_read_without_some_and_none_means_default() {
    let spec = parse_spec(
        "Model(kv_heads: 2, head_dim: Some(16), residual: Ghc(m: 2, n: 3, reduce_norm: Off, tau: 2.5), \
         train: (clip: None))",
        "t.ron",
    )
    .expect("parses");
    assert_eq!((spec.kv_heads, spec.head_dim, spec.train.clip), (Some(2), Some(16), None));
    let ResidualSpec::Ghc(g) = &spec.residual else { panic!("ghc expected") };
    assert_eq!((g.reduce_norm, g.tau), (Some(ReduceNorm::Off), Some(2.5)));

    let spec = parse_spec("Model(residual: Ghc(m: 2, n: 4, reduce_norm: None))", "t.ron").expect("parses");
    let ResidualSpec::Ghc(g) = &spec.residual else { panic!("ghc expected") };
    assert_eq!(g.reduce_norm, None);
    assert_eq!(g.reduce_norm(), ReduceNorm::GroupNorm, "None resolves to the docs/math.md §5.2 default");
}

#[test]
fn omitted_fields_take_defaults() {
    let spec = parse_spec("Model(d_model: 128)", "t.ron").expect("parses");
    assert_eq!(spec, ModelSpec { d_model: 128, ..ModelSpec::default() });
    let spec = parse_spec("()", "t.ron").expect("anonymous top-level struct parses");
    assert_eq!(spec, ModelSpec::default());
}

#[test]
fn load_spec_validates_and_lists_every_problem() {
    let file = TempFile::new("invalid.ron", "Model(vocab: 1, residual: Xhc(n: 4, k: 5))");
    let err = load_spec(&file.0).expect_err("invalid");
    let SpecLoadError::Invalid { ref errors, ref path } = err else {
        panic!("expected Invalid, got {err:?}")
    };
    assert_eq!(path, &file.0.display().to_string());
    let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["vocab", "residual.k"]);
    let shown = err.to_string();
    assert!(shown.contains("invalid spec: 2 problems"), "{shown}");
    assert!(shown.contains("\n  - residual.k = 5 must be <= residual.n = 4"), "{shown}");
}

#[test]
fn load_spec_reads_a_valid_file() {
    let file = TempFile::new("valid.ron", "Model(name: \"ok\", residual: Fc(m: 2))");
    let spec = load_spec(&file.0).expect("valid");
    assert_eq!(spec.name, "ok");
    assert!(matches!(spec.residual, ResidualSpec::Fc(ref f) if f.m == 2));
}

#[test]
fn from_ron_str_parses_and_validates() {
    assert_eq!(ModelSpec::from_ron_str("Model(layers: 3)").expect("valid").layers, 3);
    match ModelSpec::from_ron_str("Model(layers: 0)") {
        Err(SpecLoadError::Invalid { errors, .. }) => assert_eq!(errors[0].path, "layers"),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// A spec that sets a non-default value in every kind of field (options set and
/// unset, tuples, lists, nested enums, strings that need escaping).
fn busy_spec() -> ModelSpec {
    let mut spec = ModelSpec {
        name: "busy \"quoted\" \\ name".into(),
        vocab: 300,
        d_model: 96,
        layers: 4,
        heads: 6,
        kv_heads: Some(3),
        head_dim: Some(16),
        ffn: FfnSpec::Moe(MoeSpec {
            experts: 6,
            top_k: 3,
            shared: 0,
            hidden: 80,
            gate: MoeGate::Sigmoid,
            dispatch: MoeDispatch::Sparse,
            capacity_factor: Some(1.25),
            balance: MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 2.5e-4, seq_aux_coef: 1e-4 }),
            renormalize: false,
        }),
        norm_eps: 1e-6,
        rope_base: 500000.0,
        tie_embeddings: true,
        init_std: 0.0123456789,
        out_proj_depth_scaled: false,
        residual: ResidualSpec::Xhc(XhcSpec {
            conv_kernels: vec![3, 5],
            gram_schmidt: Some(false),
            flash: Flash::TwoBlock,
            ..XhcSpec::default()
        }),
        mtp: MtpSpec { depth: 2, lambda: 0.1, ..MtpSpec::default() },
        parametrization: Parametrization::MuP(MupSpec { base_width: 32, ..MupSpec::default() }),
        precision: Precision::Bf16,
        ..ModelSpec::default()
    };
    spec.train.data = DataSpec::Text("data/tiny shakespeare.txt".into());
    spec.train.optimizer = OptimizerSpec::Muon(MuonSpec {
        scale: MuonScale::MatchRmsAdamW,
        adamw: AdamWSpec { betas: (0.8, 0.99), ..AdamWSpec::default() },
        ..MuonSpec::default()
    });
    spec.train.schedule = ScheduleSpec::Wsd(WsdSpec { warmup: 7, decay_fraction: 0.3, final_ratio: 0.0 });
    spec.train.clip = None;
    spec.train.seed = u64::MAX;
    spec
}

#[test]
fn to_ron_round_trips() {
    let ghc = ModelSpec {
        residual: ResidualSpec::Ghc(GhcSpec {
            tau: Some(0.75),
            reduce_norm: Some(ReduceNorm::Off),
            ..GhcSpec::default()
        }),
        ..ModelSpec::default()
    };
    for spec in [ModelSpec::default(), busy_spec(), ghc] {
        let text = spec.to_ron();
        let back = parse_spec(&text, "round-trip").unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(back, spec, "{text}");
    }
}

#[test]
fn to_ron_is_readable() {
    let text = busy_spec().to_ron();
    assert!(text.contains("kv_heads: 3,"), "options are written without Some(..):\n{text}");
    assert!(text.contains("residual: Xhc("), "variant newtypes are unwrapped:\n{text}");
    assert!(text.lines().count() > 20, "pretty-printed one field per line:\n{text}");
}

/// The example in docs/architecture.md §3, verbatim: the documented syntax must stay valid.
#[test]
fn design_doc_example_loads() {
    let text = r#"
Model(
  name: "vwn-r4",
  vocab: 256, d_model: 256, layers: 4, heads: 4, kv_heads: 4,
  ffn: SwiGlu(hidden: 704),        // or Moe(experts: 8, top_k: 2, shared: 1, hidden: 256)
  residual: Ghc(m: 4, n: 16, dynamic: true),
  // Residual | Hc(n: 4, dynamic: true) | Fc(m: 4) | Mhc(n: 4, sinkhorn_iters: 20)
  // | Xhc(n: 16, k: 4, fixed: 2, conv_kernels: [4, 8, 12], gram_schmidt: true, flash: None)
  mtp: (depth: 1, lambda: 0.3),
  parametrization: Standard,       // or MuP(base_width: 128)
  train: (
    data: Synthetic(Default), seq_len: 128, batch: 8, steps: 500,
    optimizer: AdamW(lr: 3e-3, betas: (0.9, 0.95), weight_decay: 0.1),
    schedule: Cosine(warmup: 50), seed: 0,
  ),
)
"#;
    let spec = ModelSpec::from_ron_str(text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((spec.d_model, spec.kv_heads, spec.mtp.depth), (256, Some(4), 1));
    assert!(matches!(spec.ffn, FfnSpec::SwiGlu(ref s) if s.hidden == Some(704)));
    for alternative in [
        "Hc(n: 4, dynamic: true)",
        "Fc(m: 4)",
        "Mhc(n: 4, sinkhorn_iters: 20)",
        "Xhc(n: 16, k: 4, fixed: 2, conv_kernels: [4, 8, 12], gram_schmidt: true, flash: None)",
    ] {
        let text = text.replace("Ghc(m: 4, n: 16, dynamic: true)", alternative);
        ModelSpec::from_ron_str(&text).unwrap_or_else(|e| panic!("{alternative}: {e}"));
    }
    let moe = text.replace("SwiGlu(hidden: 704)", "Moe(experts: 8, top_k: 2, shared: 1, hidden: 256)");
    ModelSpec::from_ron_str(&moe).unwrap_or_else(|e| panic!("{e}"));
    let mup = text.replace("parametrization: Standard", "parametrization: MuP(base_width: 128)");
    ModelSpec::from_ron_str(&mup).unwrap_or_else(|e| panic!("{e}"));
}

fn syntax_message(text: &str) -> String {
    match parse_spec(text, "bad.ron") {
        Err(SpecLoadError::Syntax { message, .. }) => message,
        other => panic!("{text}: expected a syntax error, got {other:?}"),
    }
}

#[test]
fn a_byte_order_mark_is_accepted() {
    let spec = parse_spec("\u{feff}Model(name: \"bom\", layers: 3)", "bom.ron").expect("a BOM is skipped");
    assert_eq!((spec.name.as_str(), spec.layers), ("bom", 3));
    let file = TempFile::new("bom.ron", "\u{feff}Model(name: \"bom\")");
    assert_eq!(load_spec(&file.0).expect("valid").name, "bom");
}

#[test]
fn non_ascii_field_names_are_reported_whole() {
    let names = unknown_names("Model(\n  vöcab: 256,\n  名前: \"x\",\n)");
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!((names[0].path.as_str(), names[0].line, names[0].col), ("vöcab", 2, 3));
    assert!(names[0].message.contains("unknown field `vöcab`"), "{}", names[0].message);
    assert!(names[0].message.contains("did you mean `vocab`?"), "{}", names[0].message);
    assert!(names[1].message.contains("unknown field `名前`"), "{}", names[1].message);
}

#[test]
fn bad_whole_numbers_name_the_field_and_its_range() {
    for (text, field, written, range) in [
        ("Model(train: (batch: -4))", "train.batch", "-4", "a whole number in 1..=1048576"),
        ("Model(layers: 2.5)", "layers", "2.5", "a whole number in 1..=1024"),
        ("Model(vocab: 1e99)", "vocab", "1e99", "a whole number in 256..=2147483648"),
        ("Model(residual: Ghc(m: 2, n: 4.5))", "residual.n", "4.5", "a whole number in 1..=1024"),
        ("Model(train: (seed: -1))", "train.seed", "-1", "a whole number >= 0"),
        ("Model(layers: 99999999999999999999999)", "layers", "99999999999999999999999", "1..=1024"),
        ("Model(residual: Xhc(conv_kernels: [4, -8]))", "residual.conv_kernels", "-8", "1..=1024"),
        ("Model(train: (optimizer: Muon(ns_steps: 0.5)))", "train.optimizer.ns_steps", "0.5", "1..=100"),
    ] {
        let message = syntax_message(text);
        assert!(message.starts_with(&format!("in `{field}`: {written} is not valid")), "{text}: {message}");
        assert!(message.contains(range), "{text}: {message}");
    }
}

#[test]
fn duplicate_fields_are_named() {
    let message = syntax_message("Model(vocab: 256, vocab: 300)");
    assert!(message.contains("vocab") && message.to_lowercase().contains("duplicate"), "{message}");
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    for depth in [200, 100_000] {
        let text = format!("Model(residual: {}{})", "(".repeat(depth), ")".repeat(depth));
        assert!(parse_spec(&text, "deep.ron").is_err());
        let text = format!("Model(train: (data: Text({})))", "[".repeat(depth));
        assert!(parse_spec(&text, "deep.ron").is_err());
    }
}

#[test]
fn non_finite_floats_are_refused_by_field() {
    let errors = match ModelSpec::from_ron_str(
        "Model(norm_eps: NaN, rope_base: inf, mtp: (lambda: NaN), train: (clip: -inf, val_fraction: NaN))",
    ) {
        Err(SpecLoadError::Invalid { errors, .. }) => errors,
        other => panic!("expected Invalid, got {other:?}"),
    };
    let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["norm_eps", "rope_base", "mtp.lambda", "train.clip", "train.val_fraction"]);
}

#[test]
fn balance_settings_read_their_scope_and_the_sequence_wise_weight() {
    let balance = |text: &str| {
        let spec = parse_spec(&format!("Model(ffn: Moe(balance: {text}))"), "t.ron").expect("parses");
        let FfnSpec::Moe(m) = spec.ffn else { panic!("moe expected") };
        m.balance
    };
    let per_sequence = AuxLossSpec { coef: 1e-3, per: AuxLossScope::Sequence };
    assert_eq!(balance("AuxLoss(coef: 1e-3, per: Sequence)"), MoeBalance::AuxLoss(per_sequence.clone()));
    assert_eq!(
        balance("AuxLoss()"),
        MoeBalance::AuxLoss(AuxLossSpec { coef: 0.01, per: AuxLossScope::Batch })
    );
    let beside = balance("BiasUpdate(rate: 1e-3, seq_aux_coef: 1e-3)");
    assert_eq!(beside.aux_loss(), Some(per_sequence));
    assert_eq!(balance("BiasUpdate(rate: 1e-3)").aux_loss(), None);
    let names = unknown_names("Model(ffn: Moe(balance: AuxLoss(per: Token)))");
    assert_eq!(names.len(), 1);
    assert!(names[0].message.contains("valid variants: Batch, Sequence"), "{}", names[0].message);
}

#[test]
fn recompute_schedules_parse_and_default_to_none() {
    let parse = |train: &str| {
        let text = format!("Model(name: \"r\", residual: Mhc(n: 4), train: ({train}))");
        parse_spec(&text, "r.ron").unwrap_or_else(|e| panic!("{text}: {e}")).train.recompute
    };
    assert_eq!(parse(""), ir::spec::Recompute::None);
    assert_eq!(parse("recompute: Stream"), ir::spec::Recompute::Stream);
    assert_eq!(parse("recompute: Block(3)"), ir::spec::Recompute::Block(3));
    let err = parse_spec("Model(name: \"r\", train: (recompute: Sometimes))", "r.ron").expect_err("unknown");
    assert!(err.to_string().contains("Sometimes"), "{err}");
}
