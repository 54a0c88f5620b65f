//! `--device` on `widen train`, `sample`, `bench` and `parity` as a user runs
//! them: the Cpu device is the training default, the Cuda device fails with
//! a typed message on a machine without the driver, and `widen parity`
//! reports every gradient.

use runtime::device::cuda::driver_available;
use runtime::params::ParamSet;
mod common;

use common::{spec_file, stderr, widen};
use std::path::Path;
use std::process::Output;

/// A small spec that trains in seconds on any device, validating twice.
const SPEC: &str = r#"Model(
    name: "dev-tiny",
    vocab: 256, d_model: 16, layers: 1, heads: 2,
    residual: Ghc(m: 2, n: 4),
    train: (seq_len: 16, batch: 2, steps: 4, eval_every: 2, eval_batches: 1,
            optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 1)),
)
"#;

/// The `device` field of every line of a run's metrics.
fn metric_devices(run: &Path) -> Vec<String> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["device"].as_str().unwrap_or("<none>").to_string()
        })
        .collect()
}

/// Asserts a failed run reports the missing driver as an error, not a crash.
fn assert_clean_driver_error(o: &Output) {
    let e = stderr(o);
    assert!(!o.status.success(), "{e}");
    assert_eq!(o.status.code(), Some(1), "a clean error exit, not a signal or panic: {e}");
    assert!(e.lines().last().is_some_and(|l| l.starts_with("error: ")), "{e}");
    assert!(e.contains("libcuda"), "{e}");
    assert!(!e.contains("panicked") && !e.to_lowercase().contains("backtrace"), "{e}");
}

#[test]
fn cuda_without_a_driver_is_a_clean_error_naming_libcuda() {
    if driver_available() {
        // A GPU machine: the same command trains on the GPU.
        let dir = common::workdir("devices-cuda-gpu", Some(SPEC));
        let o = widen(&dir, &["train", "spec.ron", "--device", "cuda", "--steps", "1", "--out", "run"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(metric_devices(&dir.join("run")), ["cuda"]);
        std::fs::remove_dir_all(dir).unwrap();
        return;
    }
    let dir = common::workdir("devices-cuda", Some(SPEC));
    let tiny = spec_file("tiny.ron");
    let o = widen(&dir, &["train", &tiny, "--device", "cuda", "--steps", "1", "--out", "run"]);
    assert_clean_driver_error(&o);
    assert!(!dir.join("run/metrics.jsonl").exists(), "no run is started without a device");
    let residual = spec_file("residual.ron");
    for args in [
        vec!["bench", residual.as_str(), "--device", "cuda", "--steps", "1", "--warmup", "0"],
        vec!["parity", residual.as_str(), "--device", "cuda"],
    ] {
        assert_clean_driver_error(&widen(&dir, &args));
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn train_defaults_to_cpu_and_every_device_validates_and_samples() {
    let dir = common::workdir("devices-default", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--out", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("on cpu"), "{}", stderr(&o));
    assert_eq!(metric_devices(&dir.join("cpu")), ["cpu"; 4]);

    let o = widen(&dir, &["train", "spec.ron", "--out", "reference", "--device", "reference"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metric_devices(&dir.join("reference")), ["reference"; 4]);

    // Validation ran on both devices (steps 2 and 4) and agrees to f32 rounding.
    let val_losses = |run: &str| -> Vec<f64> {
        std::fs::read_to_string(dir.join(run).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
            .collect()
    };
    let (cpu, reference) = (val_losses("cpu"), val_losses("reference"));
    assert_eq!(cpu.len(), 2);
    assert_eq!(reference.len(), 2);
    for (c, r) in cpu.iter().zip(&reference) {
        assert!((c - r).abs() <= 1e-4 * r.abs(), "validation loss {c} on cpu vs {r} on reference");
    }

    // Greedy sampling from the same checkpoint on each device gives the same text.
    let sample = |device: &str| {
        let args = [
            "sample",
            "cpu/final.safetensors",
            "--prompt",
            "The ",
            "--tokens",
            "12",
            "--temperature",
            "0",
            "--device",
            device,
        ];
        let o = widen(&dir, &args);
        assert!(o.status.success(), "{device}: {}", stderr(&o));
        o.stdout
    };
    let on_cpu = sample("cpu");
    assert_eq!(on_cpu.len(), "The ".len() + 12 + 1);
    assert_eq!(on_cpu, sample("reference"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn parity_on_cpu_passes_and_lists_every_gradient() {
    let dir = common::workdir("devices-parity", Some(SPEC));
    let residual = spec_file("residual.ron");
    let shrink = ["--d-model", "32", "--layers", "1", "--seq-len", "8", "--batch", "2", "--steps", "2"];
    let mut args = vec!["parity", residual.as_str(), "--device", "cpu"];
    args.extend(shrink);
    args.extend(["--json", "f.json"]);
    let o = widen(&dir, &args);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("residual on cpu: pass"), "{out}");

    // The parameters of the same shrunk model, in order.
    let mut spec = ir::spec::load_spec(Path::new(&residual)).unwrap();
    (spec.d_model, spec.layers, spec.head_dim) = (32, 1, None);
    let lowered = ir::lower::lower(&spec, 2, 8).unwrap();
    let names: Vec<String> =
        ParamSet::zeros(&lowered.graph).unwrap().iter().map(|p| p.name.clone()).collect();
    assert!(names.len() > 5, "{names:?}");

    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("f.json")).unwrap()).unwrap();
    assert_eq!(doc["device"], "cpu");
    assert_eq!(doc["passed"], true);
    let report = &doc["specs"][0]["report"];
    assert_eq!(report["steps"], 2);
    for key in ["grads", "params"] {
        let entries = report[key].as_array().unwrap_or_else(|| panic!("{key}: {report}"));
        let listed: Vec<&str> = entries.iter().map(|g| g["name"].as_str().unwrap()).collect();
        assert_eq!(listed, names, "{key}");
        for e in entries {
            let (err, tol) = (e["err"].as_f64().unwrap(), e["tol"].as_f64().unwrap());
            assert!(err <= tol && e["passed"] == true, "{key}: {e}");
        }
    }
    for key in ["loss", "validation_loss", "logits"] {
        assert_eq!(report[key]["passed"], true, "{key}: {report}");
    }

    // A spec that cannot be run fails the command, and the JSON still holds the others.
    let mut args = vec!["parity", residual.as_str(), "absent.ron", "--device", "cpu"];
    args.extend(shrink);
    args.extend(["--json", "g.json"]);
    let o = widen(&dir, &args);
    assert!(!o.status.success());
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("g.json")).unwrap()).unwrap();
    assert_eq!(doc["passed"], false);
    assert_eq!(doc["specs"][0]["report"]["passed"], true);
    assert!(doc["specs"][1]["error"].as_str().unwrap().contains("absent.ron"), "{doc}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn parity_isolate_runs_each_spec_in_its_own_process_and_reports_a_broken_one() {
    let dir = common::workdir("parity-isolate", None);
    std::fs::write(dir.join("broken.ron"), "Model(d_model: 33)").unwrap();
    let tiny = spec_file("tiny.ron");
    let args =
        ["parity", &tiny, "broken.ron", "--isolate", "--d-model", "32", "--layers", "1", "--seq-len", "8"];
    let o = widen(&dir, &[&args[..], &["--batch", "2", "--steps", "1", "--json", "p.json"]].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("passed (own process)") && out.contains("1 of 2 specs"), "{out}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("p.json")).unwrap()).unwrap();
    assert_eq!(doc["specs"][0]["report"]["passed"], true);
    assert!(doc["specs"][1]["error"].as_str().is_some_and(|e| e.contains("d_model")), "{doc}");
    std::fs::remove_dir_all(&dir).unwrap();
}
