//! The peak memory `widen check` expects of a training run against the peak the run
//! measures (docs/performance.md, "Memory"): each run is its own `widen train`
//! process, so its resident high-water mark is its own.

mod common;

use common::{spec_file, stderr, widen, workdir};
use serde_json::Value;

/// Two backbones per scheme, each one training step on the Cpu device: sized so the
/// Plan's buffers dominate the process itself (0.09 to 0.16 and 0.18 to 0.37 GiB
/// expected in all), and small enough for a 2-core machine.
const SIZES: [&[&str]; 2] = [
    &["d_model=256", "layers=2", "heads=4", "train.seq_len=128", "train.batch=4"],
    &["d_model=384", "layers=2", "heads=6", "train.seq_len=256", "train.batch=4"],
];

/// The schemes whose Plans differ most in what they hold: none, a few streams, a
/// wide state, and many streams of which a few are active.
const SPECS: [&str; 4] = ["residual.ron", "mhc.ron", "vwn-r4.ron", "xhc.ron"];

/// How far a measured peak may be from the expected one.
const TOLERANCE: f64 = 0.2;

/// `--set` arguments for a size, with one validation batch (the run's last step
/// evaluates) so the run is the training step, its validation and its checkpoint.
fn sets(size: &[&str]) -> Vec<String> {
    size.iter()
        .chain(&["train.eval_batches=1"])
        .flat_map(|kv| ["--set".to_string(), kv.to_string()])
        .collect()
}

/// The number after `key` in `text` (`... measured / expected 1.03)`).
fn number_after(text: &str, key: &str) -> Option<f64> {
    let rest = &text[text.find(key)? + key.len()..];
    let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

#[test]
fn measured_peak_is_within_a_fifth_of_the_plan_based_estimate() {
    let dir = workdir("memory-estimate", None);
    let mut failures = Vec::new();
    for spec in SPECS {
        for (i, size) in SIZES.iter().enumerate() {
            let path = spec_file(spec);
            let sets = sets(size);
            let args = |head: &[&'static str]| -> Vec<String> {
                let mut v: Vec<String> = head.iter().map(|s| s.to_string()).collect();
                v.push(path.clone());
                v.extend(sets.iter().cloned());
                v
            };
            let run_widen = |a: &[String]| widen(&dir, &a.iter().map(String::as_str).collect::<Vec<_>>());
            let check = run_widen(&args(&["check", "--json"]));
            assert!(check.status.success(), "{spec} size {i}: {}", stderr(&check));
            let report: Value = serde_json::from_slice(&check.stdout).expect("one JSON object");
            let expected = report["expected_peak"]["bytes"].as_u64().expect("a Plan-based estimate");
            let parts = report["expected_peak"]["parts"].as_array().expect("its parts");
            let plan: u64 = parts
                .iter()
                .filter(|p| p["name"].as_str().is_some_and(|n| n.starts_with("Plan")))
                .map(|p| p["bytes"].as_u64().unwrap())
                .sum();
            assert!(
                plan * 2 > expected,
                "{spec} size {i}: the Plan's buffers dominate the estimate ({report})"
            );

            let out = format!("run-{}-{i}", spec.trim_end_matches(".ron"));
            let mut train = args(&["train", "--steps", "1", "--out"]);
            train.insert(4, out);
            let run = run_widen(&train);
            let text = stderr(&run);
            assert!(run.status.success(), "{spec} size {i}: {text}");
            let line = text.lines().find(|l| l.starts_with("peak memory:")).unwrap_or_else(|| {
                panic!("{spec} size {i}: no peak memory line in\n{text}");
            });
            // The run's estimate is the one `widen check` printed.
            let gib = expected as f64 / (1u64 << 30) as f64;
            assert!(
                line.contains(&format!("expected {gib:.2} GiB")),
                "{spec} size {i}: {line} against {gib:.2}"
            );
            let ratio = number_after(line, "measured / expected ").expect("a measured peak on Linux");
            eprintln!("{spec} size {i}: {line}");
            if (ratio - 1.0).abs() > TOLERANCE {
                failures.push(format!("{spec} size {i}: {line}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "measured peaks off the estimate by more than 20%:\n{}",
        failures.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn number_after_reads_the_ratio() {
    let line = "peak memory: 0.33 GiB resident on the host (VmHWM); expected 0.31 GiB from the cpu Plan \
                (measured / expected 1.06)";
    assert_eq!(number_after(line, "measured / expected "), Some(1.06));
    assert_eq!(number_after(line, "no such key"), None);
}
