//! `widen coord-check`: tables, slopes, the CSV and the plots, and a width list
//! the spec cannot take.

mod common;

use common::{stderr, widen, workdir};

const SPEC: &str = r#"Model(
    name: "coord",
    vocab: 256,
    d_model: 32,
    layers: 1,
    heads: 2,
    train: (seq_len: 8, batch: 2, optimizer: AdamW(lr: 3e-3)),
)"#;

#[test]
fn coord_check_prints_slopes_and_writes_csv_and_plots() {
    let dir = workdir("coord-check", Some(SPEC));
    let out = widen(&dir, &["coord-check", "spec.ron", "--widths", "32,64", "--steps", "2", "--out", "cc"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains('\x1b'),
        "no terminal codes when stderr is not a terminal: {:?}",
        stderr(&out)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for needle in
        ["SP activation RMS, at init", "muP activation RMS, after step 2", "SP: slope", "muP: slope"]
    {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
    let csv = std::fs::read_to_string(dir.join("cc/coord.csv")).unwrap();
    let layers = ["embed", "blocks.0.attn", "blocks.0.ffn", "blocks.0.out", "logits"].len();
    // header + 2 parametrizations x 2 widths x 3 measurements (init, 2 steps) x layers
    assert_eq!(csv.lines().count(), 1 + 2 * 2 * 3 * layers, "{csv}");
    assert_eq!(csv.lines().next(), Some("parametrization,width,step,layer,rms"));
    for svg in ["coord-sp.svg", "coord-mup.svg"] {
        let text = std::fs::read_to_string(dir.join("cc").join(svg)).unwrap();
        assert!(text.contains("<svg") && text.contains("blocks.0.out"), "{svg}");
    }
}

#[test]
fn a_width_the_spec_cannot_take_is_refused_naming_the_field() {
    let dir = workdir("coord-check-bad", Some(SPEC));
    let out = widen(&dir, &["coord-check", "spec.ron", "--widths", "32,50", "--param", "mup"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.starts_with("error: --widths: width 50"), "the error alone, no progress codes: {err:?}");
    assert!(
        err.contains("width 50: head_dim: head_dim = 25 (d_model / heads, the default) must be even"),
        "{err}"
    );
    assert!(!dir.join("coord-check").exists(), "nothing is written for a refused width list");
}

#[test]
fn each_flag_error_names_its_own_flag() {
    let dir = workdir("coord-check-flags", Some(SPEC));
    for steps in ["0", "1001"] {
        let out = widen(&dir, &["coord-check", "spec.ron", "--widths", "32,64", "--steps", steps]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains("--steps") && err.contains(&format!("'{steps}'")) && err.contains("1..=1000"),
            "{err}"
        );
        assert!(!err.contains("--widths"), "a --steps error is not a --widths one: {err}");
    }
    for widths in ["0,32", "32,16777217"] {
        let out = widen(&dir, &["coord-check", "spec.ron", "--widths", widths]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains("--widths") && err.contains("1..=16777216"), "{err}");
    }
    let out = widen(&dir, &["coord-check", "spec.ron", "--widths", "32,32"]);
    assert!(stderr(&out).contains("--widths: width 32 is listed twice"), "{}", stderr(&out));
    let many: Vec<String> = (1..=33).map(|i| (32 * i).to_string()).collect();
    let out = widen(&dir, &["coord-check", "spec.ron", "--widths", &many.join(",")]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--widths lists 33 widths; a coordinate check takes 2..=32"),
        "{}",
        stderr(&out)
    );
    assert!(!dir.join("coord-check").exists(), "nothing is written for refused flags");
}
