//! Every spec shipped in `specs/` loads, validates and survives the `to_ron` round trip.

use std::path::PathBuf;

use ir::spec::{load_spec, parse_spec, ModelSpec, ResidualSpec};

fn specs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs")
}

fn all_specs() -> Vec<(String, ModelSpec)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(specs_dir())
        .expect("specs/ exists")
        .map(|entry| entry.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "ron"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let stem = path.file_stem().expect("file name").to_string_lossy().into_owned();
            let spec = load_spec(&path).unwrap_or_else(|e| panic!("{e}"));
            (stem, spec)
        })
        .collect()
}

#[test]
fn every_spec_loads_validates_and_is_named_after_its_file() {
    let specs = all_specs();
    let stems: Vec<&str> = specs.iter().map(|(s, _)| s.as_str()).collect();
    for expected in [
        "tiny",
        "residual",
        "hc",
        "fc",
        "mhc",
        "vwn-1.5x",
        "vwn-r4",
        "vwn-r8",
        "xhc",
        "xhc-flash",
        "mtp",
        "moe",
        "vwn-moe",
        "xhc-moe",
        "mhc-lite",
        "wide-residual",
        "attn-residuals",
        "denseformer",
        "kromhc",
    ] {
        assert!(stems.contains(&expected), "specs/{expected}.ron missing; found {stems:?}");
    }
    for (stem, spec) in &specs {
        assert_eq!(&spec.name, stem, "specs/{stem}.ron: name should match the file");
        let back = parse_spec(&spec.to_ron(), stem).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&back, spec, "specs/{stem}.ron round trip");
    }
}

#[test]
fn specs_are_small_enough_for_cpu_and_use_their_scheme() {
    for (stem, spec) in all_specs() {
        assert!((64..=128).contains(&spec.d_model), "{stem}: d_model = {}", spec.d_model);
        assert!((2..=4).contains(&spec.layers), "{stem}: layers = {}", spec.layers);
        let kind = spec.residual.kind_name();
        let expected = match stem.as_str() {
            "residual" | "moe" => "Residual",
            "hc" => "Hc",
            "fc" => "Fc",
            "mhc" | "mhc-bf16" => "Mhc",
            "xhc" | "xhc-flash" | "xhc-moe" => "Xhc",
            "mhc-lite" | "wide-residual" | "attn-residuals" | "denseformer" | "kromhc" => "Connection",
            _ => "Ghc",
        };
        assert_eq!(kind, expected, "specs/{stem}.ron");
    }
}

#[test]
fn vwn_specs_have_the_documented_widths() {
    let specs = all_specs();
    let ghc = |name: &str| {
        let (_, spec) = specs.iter().find(|(s, _)| s == name).expect("spec present");
        match &spec.residual {
            ResidualSpec::Ghc(g) => (g.m, g.n, g.reduce_norm()),
            other => panic!("{name}: expected Ghc, got {other:?}"),
        }
    };
    use ir::spec::ReduceNorm::{GroupNorm, Off};
    assert_eq!(ghc("tiny"), (2, 4, GroupNorm));
    assert_eq!(ghc("vwn-1.5x"), (2, 3, Off));
    assert_eq!(ghc("vwn-r4"), (4, 16, GroupNorm));
    assert_eq!(ghc("vwn-r8"), (8, 64, GroupNorm));
}
