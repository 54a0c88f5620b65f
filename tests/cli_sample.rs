//! `widen sample` with and without the cache, its knobs and its report, as a user runs it.

mod common;

use common::{stderr, widen};

/// An xHC model (temporal convolutions, routed streams) with a short window, so a
/// sample of 40 tokens slides past it.
const SPEC: &str = r#"Model(
    name: "cli-sample",
    vocab: 256, d_model: 16, layers: 1, heads: 2,
    residual: Xhc(n: 4, k: 2, fixed: 1, conv_kernels: [2, 3]),
    train: (seq_len: 12, batch: 2, steps: 3, optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 1)),
)
"#;

fn trained(tag: &str) -> std::path::PathBuf {
    let dir = common::workdir(tag, Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    dir
}

#[test]
fn cached_and_uncached_sampling_print_the_same_text_past_seq_len_and_report_tokens_per_second() {
    let dir = trained("sample-cache");
    let base = ["sample", "run/final.safetensors", "--prompt", "The ", "--tokens", "40"];
    let run = |extra: &[&str]| {
        let o = widen(&dir, &[&base[..], extra].concat());
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        o
    };
    let cached = run(&["--top-p", "0.95", "--top-k", "200", "--seed", "4"]);
    assert!(cached.stdout.starts_with(b"The "));
    assert_eq!(cached.stdout.len(), "The ".len() + 40 + 1, "stdout holds the text alone");
    let report = stderr(&cached);
    assert!(
        report.contains("40 tokens in") && report.contains("tokens/s") && report.contains("cached decoder"),
        "{report}"
    );
    for device in ["reference", "cpu"] {
        let full =
            run(&["--top-p", "0.95", "--top-k", "200", "--seed", "4", "--no-cache", "--device", device]);
        assert_eq!(cached.stdout, full.stdout, "--no-cache --device {device}");
        assert!(stderr(&full).contains(&format!("whole window on {device}")), "{}", stderr(&full));
    }
    assert_ne!(cached.stdout, run(&["--top-p", "0.95", "--top-k", "200", "--seed", "5"]).stdout[..]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sample_refuses_a_bad_top_p_a_top_k_past_the_vocabulary_and_cuda_with_the_cache() {
    let dir = trained("sample-knobs");
    let sample = |extra: &[&str]| {
        let base = ["sample", "run/final.safetensors", "--prompt", "Hi", "--tokens", "3"];
        widen(&dir, &[&base[..], extra].concat())
    };
    for value in ["0", "1.5", "-0.1", "nan", "x"] {
        let o = sample(&["--top-p", value]);
        assert!(!o.status.success(), "--top-p {value} was accepted");
        let e = stderr(&o);
        assert!(
            e.contains("--top-p") && e.contains(&format!("'{value}'")) && e.contains("(0, 1]"),
            "{value}: {e}"
        );
    }
    let o = sample(&["--top-k", "300"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("'300'") && e.contains("--top-k") && e.contains("1..=256"), "{e}");
    assert!(o.stdout.is_empty());
    let o = sample(&["--device", "cuda"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--no-cache"), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sample_help_states_the_context_limit_and_the_cache() {
    let dir = common::workdir("sample-help", None);
    let o = widen(&dir, &["sample", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(help.contains("train.seq_len") && help.contains("slides"), "{help}");
    assert!(help.contains("--no-cache") && help.contains("--top-p"), "{help}");
    std::fs::remove_dir_all(dir).unwrap();
}
