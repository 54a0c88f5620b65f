//! The training loop end to end with tiny lowered models, on the reference
//! executor and, where the device changes how a step is taken (the Cpu
//! device's Plan runs the optimizer update and keeps the moments), on the
//! Cpu device too.

use ir::spec::{
    AdamWSpec, BiasUpdateSpec, ConstantSpec, FfnSpec, ModelSpec, MoeBalance, MoeGate, MoeSpec, MuonSpec,
    OptimizerSpec, ScheduleSpec,
};
use runtime::checkpoint::Checkpoint;
use runtime::device::Device;
use runtime::train::{train_spec, TrainError, TrainOptions};
use std::path::PathBuf;

mod common;

use common::run::{metric_losses, opts};

fn tiny_spec(steps: usize) -> ModelSpec {
    common::run::tiny_spec("tiny-test", steps, 3, 2)
}

fn temp_dir(tag: &str) -> PathBuf {
    common::run::temp_dir("train", tag)
}

#[test]
fn same_seed_gives_identical_losses_and_another_seed_does_not() {
    let (a, b, c) = (temp_dir("seed-a"), temp_dir("seed-b"), temp_dir("seed-c"));
    let spec = tiny_spec(4);
    let ra = train_spec(&spec, Device::Reference, &opts(&a, None)).unwrap();
    let rb = train_spec(&spec, Device::Reference, &opts(&b, None)).unwrap();
    assert_eq!(ra.losses.len(), 4);
    assert_eq!(ra.losses, rb.losses);
    assert!(ra.losses.iter().all(|l| l.is_finite()));
    let mut other = spec.clone();
    other.train.seed = 1;
    let rc = train_spec(&other, Device::Reference, &opts(&c, None)).unwrap();
    assert_ne!(ra.losses, rc.losses);
    // Metrics: one line per step, validation at the eval steps (3) and the last step (4).
    let text = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 4);
    let with_val: Vec<u64> =
        lines.iter().filter(|l| l.get("val_loss").is_some()).map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(with_val, vec![3, 4]);
    assert!(lines.iter().all(|l| l["tokens_per_s"].as_f64().unwrap() > 0.0 && l["lr"].as_f64().is_some()));
    let per_step = (spec.train.batch * spec.train.seq_len) as u64;
    assert!(lines.iter().all(|l| l["tokens"].as_u64() == Some(l["step"].as_u64().unwrap() * per_step)));
    // A fresh run never overwrites an earlier run's metrics.
    let err = train_spec(&spec, Device::Reference, &opts(&a, None)).unwrap_err();
    assert!(matches!(err, TrainError::RunExists { .. }), "{err}");
    for d in [a, b, c] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn resumed_run_matches_the_uninterrupted_run_bitwise() {
    resume_matches(Device::Reference, tiny_spec(6));
}

/// On the Cpu device the checkpoint's moments come back from the Plan's
/// buffers, and the resumed run writes the checkpoint's moments into them.
#[test]
fn resumed_cpu_run_matches_the_uninterrupted_run_bitwise() {
    resume_matches(Device::Cpu, tiny_spec(6));
}

/// An MoE model whose router biases move every step (docs/math.md §1.6): the biases
/// are checkpointed like parameters, so the resumed run continues with the same ones,
/// routes the same tokens and writes the same expert loads.
fn moe_spec() -> ModelSpec {
    let mut spec = tiny_spec(6);
    spec.name = "tiny-moe".into();
    spec.ffn = FfnSpec::Moe(MoeSpec {
        experts: 8,
        top_k: 2,
        hidden: 8,
        gate: MoeGate::Sigmoid,
        balance: MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 0.01, ..Default::default() }),
        ..MoeSpec::default()
    });
    spec
}

#[test]
fn resumed_moe_run_with_moving_router_biases_matches_the_uninterrupted_run_bitwise() {
    resume_matches(Device::Reference, moe_spec());
}

#[test]
fn resumed_cpu_moe_run_with_moving_router_biases_matches_the_uninterrupted_run_bitwise() {
    resume_matches(Device::Cpu, moe_spec());
}

fn resume_matches(device: Device, spec: ModelSpec) {
    let tag = format!("{}-{}", spec.name, device.name());
    let (full, resumed) = (temp_dir(&format!("full-{tag}")), temp_dir(&format!("resumed-{tag}")));
    let mut spec = spec;
    spec.train.checkpoint_every = 3;
    let whole = train_spec(&spec, device, &opts(&full, None)).unwrap();
    let ckpt3 = full.join("ckpt-3.safetensors");
    let rest = train_spec(&spec, device, &opts(&resumed, Some(ckpt3))).unwrap();
    assert_eq!(rest.losses, whole.losses[3..].to_vec());
    assert_eq!(rest.steps, 6);
    let (a, b) = (
        Checkpoint::read(&whole.final_checkpoint).unwrap(),
        Checkpoint::read(&rest.final_checkpoint).unwrap(),
    );
    assert_eq!(a.state, b.state);
    let (ta, tb) = (a.tensors(), b.tensors());
    assert_eq!(ta.len(), tb.len());
    assert!(ta.iter().any(|(n, _, _)| n.starts_with("opt.")), "optimizer state is checkpointed");
    for ((na, sa, va), (nb, sb, vb)) in ta.iter().zip(&tb) {
        assert_eq!((na, sa), (nb, sb));
        // Bitwise: compare the bit patterns, not float equality.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert!(bits(va) == bits(vb), "tensor {na} differs after resume");
        if na.ends_with(".router_bias") {
            assert!(va.iter().any(|&b| b != 0.0), "{na} moved during the run: {va:?}");
            let m = tb.iter().find(|(n, _, _)| n == &format!("opt.{na}.m")).expect("its moment");
            assert!(m.2.iter().all(|&x| x == 0.0), "the optimizer left {na} alone");
        }
    }
    // The metrics of the resumed steps, MoE loads included, are the uninterrupted run's.
    let lines = |dir: &std::path::Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let (a, b) = (lines(&full), lines(&resumed));
    assert_eq!(a.len(), b.len());
    for (la, lb) in a.iter().zip(&b) {
        for (key, value) in la.as_object().unwrap() {
            if key == "loss" || key.starts_with("moe_") {
                assert_eq!(Some(value), lb.get(key), "step {}: {key}", la["step"]);
            }
        }
    }

    // Resuming in the original folder would replace the later checkpoints: refused
    // unless asked for; with --overwrite it drops the metrics after the checkpoint and appends.
    let err = train_spec(&spec, device, &opts(&full, Some(full.join("ckpt-3.safetensors")))).unwrap_err();
    assert!(matches!(err, TrainError::WouldReplace { .. }), "{err}");
    assert_eq!(metric_losses(&full.join("metrics.jsonl")).len(), 6, "a refused resume changes nothing");
    let overwrite = TrainOptions { overwrite: true, ..opts(&full, Some(full.join("ckpt-3.safetensors"))) };
    let again = train_spec(&spec, device, &overwrite).unwrap();
    assert_eq!(again.losses, whole.losses[3..].to_vec());
    let steps: Vec<u64> = metric_losses(&full.join("metrics.jsonl")).iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 6]);
    for d in [full, resumed] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn diverging_run_stops_naming_the_step_and_keeps_earlier_output() {
    diverging_run_stops(Device::Reference);
}

/// On the Cpu device the Plan's update must skip the step whose loss is not
/// finite, and the checkpoints before it must hold the moments.
#[test]
fn diverging_cpu_run_stops_naming_the_step_and_keeps_earlier_output() {
    diverging_run_stops(Device::Cpu);
}

fn diverging_run_stops(device: Device) {
    let out = temp_dir(&format!("nan-{}", device.name()));
    let mut spec = tiny_spec(6);
    spec.train.checkpoint_every = 1;
    spec.train.clip = None;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    spec.train.optimizer = OptimizerSpec::AdamW(AdamWSpec { lr: 1e30, ..AdamWSpec::default() });
    let err = train_spec(&spec, device, &opts(&out, None)).unwrap_err();
    let TrainError::NonFinite { step, .. } = err else { panic!("expected a non-finite loss, got {err}") };
    assert!(step >= 2, "step {step}");
    assert!(err.to_string().contains(&format!("step {step}")), "{err}");
    let metrics = metric_losses(&out.join("metrics.jsonl"));
    assert_eq!(metrics.len() as u64, step - 1);
    let last = out.join(format!("ckpt-{}.safetensors", step - 1));
    assert_eq!(Checkpoint::read(&last).unwrap().state.step, step - 1);
    assert!(!out.join("final.safetensors").exists());
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn muon_runs_learn_the_synthetic_corpus() {
    let out = temp_dir("muon");
    let mut spec = tiny_spec(12);
    spec.train.optimizer = OptimizerSpec::Muon(MuonSpec {
        adamw: AdamWSpec { lr: 1e-2, ..AdamWSpec::default() },
        ..MuonSpec::default()
    });
    let report = train_spec(&spec, Device::Reference, &opts(&out, None)).unwrap();
    let first = report.losses[0];
    let last3: f32 = report.losses[9..].iter().sum::<f32>() / 3.0;
    // ln 256 ≈ 5.55 at init; byte frequencies alone take the loss well below that.
    assert!(first > 5.0 && last3 < first - 0.5, "losses {:?}", report.losses);
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn sampling_from_a_checkpoint_is_seeded() {
    use runtime::sample::{sample_checkpoint, Decoding, SampleError, SampleOptions};
    let out = temp_dir("sample");
    let report = train_spec(&tiny_spec(3), Device::Reference, &opts(&out, None)).unwrap();
    let ckpt = &report.final_checkpoint;
    let sample = |temperature: f64, top_k: Option<usize>, seed: u64| {
        let top_k = top_k.and_then(std::num::NonZeroUsize::new);
        let o = SampleOptions { tokens: 12, temperature, top_k, top_p: None, seed };
        sample_checkpoint(ckpt, Decoding::Full(Device::Reference), b"The cat", &o).map(|s| s.bytes)
    };
    let a = sample(1.0, None, 7).unwrap();
    assert_eq!(a.len(), 12);
    assert_eq!(a, sample(1.0, None, 7).unwrap());
    // A barely trained model is close to uniform, so another seed draws other bytes.
    assert_ne!(a, sample(1.0, None, 8).unwrap());
    // Greedy ignores the seed, and top-1 sampling is greedy.
    let greedy = sample(0.0, None, 1).unwrap();
    assert_eq!(greedy, sample(0.0, None, 2).unwrap());
    assert_eq!(greedy, sample(1.0, Some(1), 3).unwrap());
    assert!(matches!(sample(-1.0, None, 0), Err(SampleError::Temperature(_))));
    std::fs::remove_dir_all(out).unwrap();
}
