//! What `widen sweep` builds from its arguments and sweep files (docs/sweeps.md): values
//! set on the base without loss, every point validated as `widen check` validates a
//! spec, axes that change nothing refused, the sizes of a sweep bounded before it is
//! built, budgets read exactly, and value errors that say what is valid.

use std::path::Path;
use std::time::{Duration, Instant};

use ir::spec::{parse_spec, ModelSpec};
use serde_json::Value;
use sweep::file::parse_seeds;
use sweep::point::apply;
use sweep::{expand, Budget, ExpandError, PointError, Sweep, SweepError};

/// A small GHC model: every point of these sweeps lowers in well under a millisecond.
const TINY: &str = "Model(d_model: 32, heads: 2, layers: 1, residual: Ghc(m: 2, n: 4), \
                    train: (batch: 2, seq_len: 16, schedule: Constant()))";

fn tiny() -> ModelSpec {
    parse_spec(TINY, "tiny").unwrap()
}

fn cli(sets: &[&str], seeds: &str, budget: &str) -> Result<Sweep, SweepError> {
    Sweep::from_cli(tiny(), "tiny.ron", sets, seeds, budget)
}

fn cli_err(sets: &[&str], seeds: &str, budget: &str) -> String {
    cli(sets, seeds, budget).unwrap_err().to_string()
}

fn file(text: &str) -> Result<Sweep, SweepError> {
    Sweep::parse(text, "sweep.ron", Path::new("."))
}

fn v(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(p, v)| (p.to_string(), v.to_string())).collect()
}

/// The error of the single point of a one-point sweep that is invalid.
fn point_error(base: &str, set: &str) -> PointError {
    let spec = parse_spec(base, "base").unwrap();
    let s = Sweep::from_cli(spec, "base", &[set], "1", "steps=10").unwrap();
    match expand(&s) {
        Err(ExpandError::NothingValid { invalid }) => invalid[0].error.clone(),
        other => panic!("{set}: expected one invalid point, got {other:?}"),
    }
}

#[test]
fn non_finite_values_reach_the_validator() {
    let moe = "Model(d_model: 32, heads: 2, layers: 1, ffn: Moe(experts: 4, top_k: 2, hidden: 16, \
               dispatch: Sparse), train: (batch: 2, seq_len: 16, schedule: Constant()))";
    for (base, set, message) in [
        (TINY, "train.clip=NaN", "train.clip = NaN must be > 0 and finite"),
        (TINY, "train.clip=inf", "train.clip = inf must be > 0 and finite"),
        (TINY, "residual.tau=-inf", "residual.tau = -inf must be > 0 and finite"),
        (TINY, "init_std=NaN", "init_std = NaN must be > 0 and finite"),
        (moe, "ffn.capacity_factor=-inf", "ffn.capacity_factor = -inf must be > 0 and finite"),
    ] {
        let e = point_error(base, set);
        assert_eq!(e.to_string(), format!("invalid spec: {message}"), "{set}");
    }
    // The values themselves are set, not dropped to `None`.
    let s = apply(&tiny(), &v(&[("train.clip", "NaN")])).unwrap();
    assert!(s.train.clip.is_some_and(f64::is_nan), "{:?}", s.train.clip);
    let s = apply(&tiny(), &v(&[("train.clip", "-inf"), ("init_std", "inf")])).unwrap();
    assert_eq!((s.train.clip, s.init_std), (Some(f64::NEG_INFINITY), f64::INFINITY));
}

#[test]
fn an_inline_base_is_validated_as_widen_check_validates_a_spec() {
    let model = "Model(d_model: 32, heads: 2, layers: 1, \
                 train: (batch: 2, seq_len: 16, schedule: Constant(), clip: Some(NaN)))";
    let s = file(&format!("Sweep(base: {model}, budget: Steps(10))")).unwrap();
    assert!(s.base.train.clip.is_some_and(f64::is_nan), "the base keeps its NaN");
    let err = expand(&s).unwrap_err();
    let ExpandError::NothingValid { invalid } = &err else { panic!("{err:?}") };
    // What `widen check` runs on a spec file: `parse_spec`, then `validate` (with the
    // budget's step count, which the sweep sets).
    let mut checked = parse_spec(model, "model").unwrap();
    checked.train.steps = 10;
    let errors = checked.validate().unwrap_err();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(invalid[0].error, PointError::Invalid { errors });
}

#[test]
fn values_and_bases_survive_exactly() {
    // Every spec of specs/ reads back unchanged through a sweep without axes.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ron") {
            let text = std::fs::read_to_string(&path).unwrap();
            if sweep::file::is_sweep_file(&text) {
                continue;
            }
            let base = parse_spec(&text, &path.display().to_string()).unwrap();
            assert_eq!(apply(&base, &[]).unwrap(), base, "{}", path.display());
            n += 1;
        }
    }
    assert!(n >= 5, "{n} specs");
    // Floats keep every bit; strings keep quotes and `#`s.
    let s = apply(
        &tiny(),
        &v(&[
            ("train.optimizer.lr", "1.0000000000000002e-3"),
            ("norm_eps", "5e-324"),
            ("rope_base", "1e300"),
            ("name", r####""q\"#x\"##y""####),
        ]),
    )
    .unwrap();
    let ir::spec::OptimizerSpec::AdamW(adam) = &s.train.optimizer else { panic!() };
    assert_eq!(adam.lr.to_bits(), 1.0000000000000002e-3f64.to_bits());
    assert_eq!(s.norm_eps.to_bits(), 5e-324f64.to_bits());
    assert_eq!(s.rope_base, 1e300);
    assert_eq!(s.name, r####"q"#x"##y"####);
}

/// The spec path of every float of `spec` (lists of floats as the list's path).
fn float_paths(at: &str, v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Number(n) if n.is_f64() => out.push(at.to_string()),
        Value::Array(items) if items.iter().any(|i| i.as_f64().is_some() && i.is_f64()) => {
            out.push(at.to_string())
        }
        Value::Object(map) => {
            // `{"Ghc": {...}}`: a variant; paths pass through it.
            if let (1, Some((k, inner))) = (map.len(), map.iter().next()) {
                if k.starts_with(|c: char| c.is_ascii_uppercase()) {
                    return float_paths(at, inner, out);
                }
            }
            for (k, inner) in map {
                let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
                float_paths(&path, inner, out);
            }
        }
        _ => {}
    }
}

/// A valid spec never holds NaN or an infinity, so the JSON of plans (which has
/// neither) loses nothing: every float field of every variant refuses all three.
#[test]
fn every_float_field_refuses_non_finite_values() {
    let bases = [
        "Model(d_model: 32, heads: 2, layers: 2, residual: Ghc(m: 2, n: 4, tau: 2.0), \
         ffn: Moe(experts: 4, top_k: 2, hidden: 16, dispatch: Sparse, capacity_factor: 1.25, \
         balance: AuxLoss(coef: 0.01)), parametrization: MuP(base_width: 16), mtp: (depth: 1), \
         train: (batch: 2, seq_len: 16, clip: 1.0, schedule: Cosine(warmup: 1)))",
        "Model(d_model: 32, heads: 2, layers: 2, residual: Xhc(n: 4, k: 2), \
         ffn: Moe(experts: 4, top_k: 2, hidden: 16, balance: BiasUpdate()), \
         train: (batch: 2, seq_len: 16, optimizer: Muon(), schedule: Wsd(warmup: 1)))",
        "Model(d_model: 32, heads: 2, layers: 2, residual: Mhc(n: 4), train: (batch: 2, seq_len: 16))",
        "Model(d_model: 32, heads: 2, layers: 2, residual: Hc(n: 4), train: (batch: 2, seq_len: 16))",
        "Model(d_model: 32, heads: 2, layers: 2, residual: Fc(m: 2), train: (batch: 2, seq_len: 16))",
    ];
    let mut checked = std::collections::BTreeSet::new();
    for text in bases {
        let base = parse_spec(text, "base").unwrap();
        base.validate().unwrap_or_else(|e| panic!("{text}: {e:?}"));
        let mut paths = Vec::new();
        float_paths("", &serde_json::to_value(&base).unwrap(), &mut paths);
        for path in &paths {
            for bad in ["NaN", "inf", "-inf"] {
                let value = if path.ends_with("betas") { format!("({bad}, 0.95)") } else { bad.to_string() };
                let spec = apply(&base, &v(&[(path, &value)])).unwrap();
                let errors = spec.validate().expect_err(&format!("{path} = {value} is refused"));
                assert!(errors.iter().any(|e| e.path == *path), "{path} = {value}: {errors:?}");
            }
            checked.insert(path.clone());
        }
    }
    assert!(checked.len() >= 30, "{} float fields: {checked:?}", checked.len());
}

#[test]
fn axes_that_the_budget_the_seeds_or_another_axis_override_are_refused() {
    assert_eq!(
        cli_err(&["train.steps=5,10"], "1", "steps=100"),
        "axis `train.steps` has no effect: the budget sets every point's train.steps; give the step count as \
         the budget (--budget steps=N, or `budget: Steps(N)` in a sweep file), one sweep per count"
    );
    assert_eq!(
        cli_err(&["train.seed=5,6"], "2", "steps=10"),
        "axis `train.seed` has no effect: the seeds set every run's train.seed; give them with --seeds (or \
         `seeds:` in a sweep file)"
    );
    assert_eq!(
        cli_err(&["residual.n=4,8", "residual.r=1,2"], "1", "steps=10"),
        "axis `residual.n` has no effect: the derived axis `residual.r` sets residual.n = r·m on every point; \
         sweep one of the two"
    );
    assert_eq!(
        cli_err(&["residual.n=4,8", "residual=Ghc(m: 2, n: 4),Residual"], "1", "steps=10"),
        "axis `residual.n` has no effect: the later axis `residual` sets the whole of `residual` on every \
         point; give `residual` before `residual.n`"
    );
    // The other order is a sweep: `residual.n` then sets n of each residual value.
    let s = cli(&["residual=Ghc(m: 2, n: 4),Ghc(m: 1, n: 2)", "residual.n=4,8"], "1", "steps=10").unwrap();
    assert_eq!(expand(&s).unwrap().points.len(), 4);
    // Sweep files too.
    let err =
        file(r#"Sweep(base: Model(), axes: {"train.steps": [5, 10]}, budget: Steps(100))"#).unwrap_err();
    assert!(err.to_string().starts_with("axis `train.steps` has no effect: the budget sets"), "{err}");
    let err = file(r#"Sweep(base: Model(), axes: {"train.seed": [1, 2]}, budget: Steps(100))"#).unwrap_err();
    assert!(err.to_string().starts_with("axis `train.seed` has no effect: the seeds set"), "{err}");
}

#[test]
fn points_that_train_the_same_spec_are_refused() {
    let err = expand(&cli(&["d_model=32,0x20"], "1", "steps=10").unwrap()).unwrap_err().to_string();
    assert_eq!(
        err,
        "points `d_model-32` (d_model = 32) and `d_model-0x20` (d_model = 0x20) train the same spec; give each \
         axis values that make different models"
    );
    let err = expand(&cli(&["residual=Ghc(m: 2, n: 4),Ghc(n: 4, m: 2)"], "1", "steps=10").unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("points `residual-Ghc+m+2+n+4` (residual = Ghc(m: 2, n: 4)) and"), "{err}");
    // Whole `train` values that differ only in what the seeds and the budget set.
    let train = |seed: u64, steps: u64| {
        format!("(seed: {seed}, steps: {steps}, batch: 2, seq_len: 16, schedule: Constant())")
    };
    let set = format!("train={},{}", train(1, 3), train(2, 4));
    let err = expand(&cli(&[&set], "1", "steps=10").unwrap()).unwrap_err().to_string();
    assert!(err.contains("train the same spec"), "{err}");
}

#[test]
fn seed_counts_are_bounded_before_the_list_is_built() {
    for arg in ["1000000000000", "18446744073709551615", "1001"] {
        let start = Instant::now();
        let err = parse_seeds(arg).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("seeds: {arg} seeds per point is above the limit of 1000 (docs/sweeps.md, Limits)")
        );
        assert!(start.elapsed() < Duration::from_secs(1));
    }
    assert_eq!(parse_seeds("1000").unwrap().len(), 1000);
    let list: Vec<String> = (0..1001).map(|i| i.to_string()).collect();
    let err = parse_seeds(&list.join(",")).unwrap_err().to_string();
    assert!(err.starts_with("seeds: 1001 seeds per point is above the limit of 1000"), "{err}");
    // A thousand distinct seeds: checked without comparing every pair.
    let list: Vec<String> = (0..1000u64).map(|i| (i * 7919).to_string()).collect();
    assert_eq!(cli(&[], &list.join(","), "steps=10").unwrap().seeds.len(), 1000);
    for n in ["1000000000000", "18446744073709551615"] {
        let err =
            file(&format!("Sweep(base: Model(), seeds: {n}, budget: Steps(5))")).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("sweep.ron:1:29: seeds: {n} seeds per point is above the limit of 1000 (docs/sweeps.md, Limits)")
        );
    }
}

#[test]
fn axis_products_and_runs_are_bounded_before_any_point_is_built() {
    let ten: Vec<String> = (1..=10).map(|i| i.to_string()).collect();
    let paths =
        ["d_model", "layers", "heads", "vocab", "train.batch", "train.seq_len", "mtp.depth", "residual.m"];
    let sets: Vec<String> = paths.iter().map(|p| format!("{p}={}", ten.join(","))).collect();
    let start = Instant::now();
    let err = Sweep::from_cli(tiny(), "tiny.ron", &sets, "1", "steps=10").unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "axes: {} make 100000000 points, above the limit of 10000 (docs/sweeps.md, Limits); use fewer values",
            paths.iter().map(|p| format!("`{p}` (10 values)")).collect::<Vec<_>>().join(" x ")
        )
    );
    let hundred: Vec<String> = (1..=100).map(|i| i.to_string()).collect();
    let sets: Vec<String> = paths[..3].iter().map(|p| format!("{p}={}", hundred.join(","))).collect();
    let err = Sweep::from_cli(tiny(), "tiny.ron", &sets, "1", "steps=10").unwrap_err().to_string();
    assert!(err.contains("make 1000000 points, above the limit of 10000"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());

    // A product past 2^128 is counted without overflow.
    let mut s = cli(&[], "1", "steps=10").unwrap();
    s.axes = (0..32)
        .map(|i| sweep::Axis { path: format!("a{i}"), values: (0..20).map(|j| j.to_string()).collect() })
        .collect();
    assert!(expand(&s).unwrap_err().to_string().contains("make more than 10^38 points"));
    s.axes.push(sweep::Axis { path: "b".into(), values: vec!["1".into()] });
    assert_eq!(
        expand(&s).unwrap_err().to_string(),
        "axes: 33 axes is above the limit of 32 (docs/sweeps.md, Limits)"
    );
    // Zip counts one point per value.
    let mut s = cli(&[], "1", "steps=10").unwrap();
    s.combine = sweep::Combine::Zip;
    s.axes =
        vec![sweep::Axis { path: "d_model".into(), values: (0..10_001).map(|j| j.to_string()).collect() }];
    assert!(expand(&s).unwrap_err().to_string().contains("make 10001 points"));

    let err = cli_err(&[&format!("d_model={}", hundred.join(","))], "101", "steps=10");
    assert_eq!(
        err,
        "100 points x 101 seeds make 10100 runs, above the limit of 10000 (docs/sweeps.md, Limits); use fewer \
         axis values or seeds"
    );
}

#[test]
fn whole_number_budgets_are_read_exactly() {
    let ok = |arg: &str| arg.parse::<Budget>().unwrap_or_else(|e| panic!("{arg}: {e}"));
    assert_eq!(ok("tokens=1e6"), Budget::Tokens(1_000_000));
    assert_eq!(ok("tokens=2.5e3"), Budget::Tokens(2500));
    assert_eq!(ok("tokens=1_000"), Budget::Tokens(1000));
    assert_eq!(ok("tokens=18446744073709551615"), Budget::Tokens(u64::MAX));
    assert_eq!(ok("tokens=1.8446744073709551615e19"), Budget::Tokens(u64::MAX));
    assert_eq!(ok("steps=1e8"), Budget::Steps(100_000_000));
    assert_eq!(ok("steps=300"), Budget::Steps(300));
    let err = |arg: &str| arg.parse::<Budget>().unwrap_err().to_string();
    let tail = "; expected flops=2e14, tokens=1e6, steps=300 or time=600";
    for (arg, reason) in [
        (
            "steps=18446744073709551616",
            "steps must be a whole number in 1..=100000000, got 18446744073709551616",
        ),
        ("steps=1e9", "steps must be a whole number in 1..=100000000, got 1e9"),
        ("steps=0", "steps must be a whole number in 1..=100000000, got 0"),
        (
            "tokens=18446744073709551616",
            "tokens must be a whole number in 1..=18446744073709551615, got 18446744073709551616",
        ),
        (
            "tokens=1.8446744073709551616e19",
            "tokens must be a whole number in 1..=18446744073709551615, got 1.8446744073709551616e19",
        ),
        ("tokens=1.5", "tokens must be a whole number in 1..=18446744073709551615, got 1.5"),
        ("tokens=1e-3", "tokens must be a whole number in 1..=18446744073709551615, got 1e-3"),
        (
            "tokens=1e99999999999999999999",
            "tokens must be a whole number in 1..=18446744073709551615, got 1e99999999999999999999",
        ),
        ("tokens=x", "`x` is not a number; tokens must be a whole number in 1..=18446744073709551615, got x"),
    ] {
        assert_eq!(err(arg), format!("--budget {arg}: {reason}{tail}"));
    }
    let err = file("Sweep(base: Model(), budget: Steps(18446744073709551616))").unwrap_err().to_string();
    assert_eq!(
        err,
        "budget: Steps(18446744073709551616): steps must be a whole number in 1..=100000000, got \
         18446744073709551616; expected Tokens(1000000), Flops(2e14), Steps(300) or Time(600)"
    );
    assert_eq!(file("Sweep(base: Model(), budget: Tokens(1e6))").unwrap().budget, Budget::Tokens(1_000_000));
}

#[test]
fn time_budgets_are_seconds_and_refuse_what_trains_nothing() {
    assert_eq!("time=600".parse::<Budget>().unwrap(), Budget::Time(600.0));
    assert_eq!("time=1.5".parse::<Budget>().unwrap(), Budget::Time(1.5));
    assert_eq!(file("Sweep(base: Model(), budget: Time(600))").unwrap().budget, Budget::Time(600.0));
    let tail = "; expected flops=2e14, tokens=1e6, steps=300 or time=600";
    for (arg, reason) in [
        ("time=0", "Time(0) must be a finite number of seconds > 0"),
        ("time=-5", "Time(-5) must be a finite number of seconds > 0"),
        ("time=inf", "Time(inf) must be a finite number of seconds > 0"),
        ("time=ten", "`ten` is not a number of seconds"),
    ] {
        assert_eq!(arg.parse::<Budget>().unwrap_err().to_string(), format!("--budget {arg}: {reason}{tail}"));
    }
    let err = file("Sweep(base: Model(), budget: Time(NaN))").unwrap_err().to_string();
    assert!(err.contains("Time(NaN)") && err.contains("seconds > 0"), "{err}");
}

#[test]
fn budgets_never_plan_more_steps_than_a_spec_may_train() {
    let s = cli(&[], "1", "tokens=1e15").unwrap();
    let ExpandError::NothingValid { invalid } = expand(&s).unwrap_err() else { panic!() };
    assert_eq!(
        invalid[0].error.to_string(),
        "budget: Tokens(1000000000000000) is 31250000000000 steps at 32 tokens per step, above the limit of \
         100000000 steps (the spec's limit on train.steps); use a smaller budget"
    );
    let s = cli(&[], "1", "flops=1e300").unwrap();
    let ExpandError::NothingValid { invalid } = expand(&s).unwrap_err() else { panic!() };
    assert!(
        invalid[0].error.to_string().contains("above the limit of 100000000 steps"),
        "{}",
        invalid[0].error
    );
}

#[test]
fn value_errors_name_the_field_the_value_and_what_is_valid() {
    for (set, message) in [
        (
            "residual.reduce_norm=1e-400",
            "`residual.reduce_norm` = 1e-400: expected one of the variants GroupNorm, Off, or None",
        ),
        ("residual.n=\"eight\"", "`residual.n` = \"eight\": expected a whole number in 1..=1024"),
        ("residual.n=-4", "`residual.n` = -4: expected a whole number in 1..=1024"),
        (
            "train.clip=true",
            "`train.clip` = true: expected a number (64-bit floating point, such as 0.5 or 3e-4), or None",
        ),
        ("name=x", "`name` = x: expected a string in double quotes, such as \"text\""),
        ("tie_embeddings=1", "`tie_embeddings` = 1: expected `true` or `false`"),
        ("kv_heads=-1", "`kv_heads` = -1: expected a whole number in 1..=16777216, or None"),
        (
            "train.optimizer.betas=1",
            "`train.optimizer.betas` = 1: expected a tuple of 2 values (..), each a number (64-bit floating \
             point, such as 0.5 or 3e-4)",
        ),
        ("residual=Ghc(m: x)", "`residual` = Ghc(m: x): in `residual.m`: expected a whole number in 1..=1024"),
        (
            "train.optimizer=Muon(adamw: (lr: x))",
            "`train.optimizer` = Muon(adamw: (lr: x)): in `train.optimizer.adamw.lr`: expected a number \
             (64-bit floating point, such as 0.5 or 3e-4)",
        ),
        (
            "residual=Zzz",
            "`residual` = Zzz: unknown variant `Zzz` for residual; valid variants: Residual, Hc, Fc, Mhc, Ghc, Xhc, Connection",
        ),
    ] {
        let e = point_error(TINY, set);
        assert!(matches!(e, PointError::Value { .. }), "{set}: {e:?}");
        assert_eq!(e.to_string(), message, "{set}");
    }
}

#[test]
fn deep_nesting_is_refused_in_plain_words() {
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    let err = cli_err(&[&format!("residual.n={deep}")], "1", "steps=10");
    assert!(err.contains("values nest too deeply (more than 128 levels of brackets)"), "{err}");
    let err = file(&format!(r#"Sweep(base: Model(), axes: {{"d_model": [{deep}]}}, budget: Steps(5))"#))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "sweep.ron:1:102: values nest too deeply (more than 128 levels of brackets); no sweep or spec needs that"
    );
    for e in [cli_err(&[&format!("residual.n={deep}")], "1", "steps=10"), err] {
        assert!(!e.contains("serde_stacker") && !e.contains("recursion_limit"), "{e}");
    }
}

#[test]
fn points_too_large_for_the_machine_are_refused_before_lowering() {
    // Valid (under the fixed 16 TiB ceiling) but far above a small machine: lowering
    // its MTP block would allocate a 2·D² init, so the memory check comes first.
    let big = "Model(d_model: 131072, heads: 2, layers: 1, mtp: (depth: 1), \
               train: (batch: 1, seq_len: 2, schedule: Constant()))";
    let base = parse_spec(big, "big").unwrap();
    base.validate().unwrap();
    let s = Sweep::from_cli(base, "big", &[] as &[&str], "1", "steps=5").unwrap();
    let err = sweep::point::expand_within(&s, Some(64 << 20)).unwrap_err();
    let ExpandError::NothingValid { invalid } = &err else { panic!("{err:?}") };
    let PointError::Invalid { errors } = &invalid[0].error else { panic!("{:?}", invalid[0].error) };
    assert!(errors[0].message.starts_with("training needs about"), "{errors:?}");
    assert!(errors[0].message.contains("above the 0.1 GiB of memory available"), "{errors:?}");
}
