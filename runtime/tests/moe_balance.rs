//! MoE load balancing in the training loop (docs/math.md §1.6, "Load balancing"): the
//! expert-load metrics of every step, the loss-free bias update evening out a router that
//! sends every token to one expert (against the same run at a negligible rate), the
//! dropped assignments of a capacity, and the Cpu device reading the same statistics,
//! moving the same biases and differentiating the same auxiliary loss as the reference.

use ir::spec::{AuxLossSpec, BiasUpdateSpec, FfnSpec, ModelSpec, MoeBalance, MoeDispatch, MoeGate, MoeSpec};
use runtime::checkpoint::Checkpoint;
use runtime::data::{BatchSampler, Corpus};
use runtime::device::cpu::{CpuExecutor, CpuOptions};
use runtime::device::Device;
use runtime::init::init_params;
use runtime::optim::Optimizer;
use runtime::parity::{compare, Tolerances};
use runtime::train::train;
use serde_json::Value;
use std::path::Path;

mod common;
use common::run::{opts, temp_dir, tiny_spec};

const EXPERTS: usize = 8;
const TOP_K: usize = 2;

/// The one-block D = 16 test model with an MoE FFN of 8 experts, 2 per token, sigmoid gates.
fn moe_spec(name: &str, steps: usize, balance: MoeBalance) -> ModelSpec {
    let mut spec = tiny_spec(name, steps, steps, 0);
    spec.ffn = FfnSpec::Moe(MoeSpec {
        experts: EXPERTS,
        top_k: TOP_K,
        shared: 1,
        hidden: 8,
        gate: MoeGate::Sigmoid,
        dispatch: MoeDispatch::Dense,
        capacity_factor: None,
        balance,
        renormalize: false,
    });
    spec
}

fn bias(rate: f64) -> MoeBalance {
    MoeBalance::BiasUpdate(BiasUpdateSpec { rate, ..Default::default() })
}

fn metrics(dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Trains `spec` on `device` into `dir`, its router biases starting at `skew` on expert 0
/// (zero elsewhere, as initialized); returns the metrics lines.
fn train_skewed(spec: &ModelSpec, device: Device, skew: f32, dir: &Path) -> Vec<Value> {
    let window = spec.train.seq_len + 1;
    let corpus = Corpus::load_data(&spec.train.data, spec.train.val_fraction, window, spec.vocab).unwrap();
    let lowered = ir::lower::lower(spec, spec.train.batch, spec.train.seq_len).unwrap();
    let mut params = init_params(&lowered.graph, spec.train.seed).unwrap();
    let mut skewed = 0;
    for i in 0..params.len() {
        if params[i].name.ends_with(".router_bias") {
            params[i].value[0] = skew;
            skewed += 1;
        }
    }
    assert_eq!(skewed, spec.layers, "one router bias per MoE sublayer");
    let mut exec = device.executor(lowered).unwrap();
    train(spec, exec.as_mut(), params, &corpus, &opts(dir, None)).unwrap_or_else(|e| panic!("{e}"));
    metrics(dir)
}

fn imbalance(line: &Value) -> f64 {
    line["moe_imbalance"].as_f64().expect("moe_imbalance")
}

/// The router biases of a run's final checkpoint.
fn final_biases(dir: &Path) -> Vec<Vec<f32>> {
    let ckpt = Checkpoint::read(&dir.join("final.safetensors")).unwrap();
    ckpt.tensors()
        .into_iter()
        .filter(|(n, _, _)| n.ends_with(".router_bias"))
        .map(|(_, _, v)| v.to_vec())
        .collect()
}

#[test]
fn bias_update_evens_out_a_router_that_sends_every_token_to_one_expert() {
    let steps = 40;
    let (moving, still) = (temp_dir("moe", "bias-moving"), temp_dir("moe", "bias-still"));
    let mut spec = moe_spec("moe-bias", steps, bias(0.005));
    // A tiny learning rate: the router itself hardly learns, so what evens the load out
    // is the bias. 128 tokens per step, 32 assignments per expert at an even load.
    if let ir::spec::OptimizerSpec::AdamW(a) = &mut spec.train.optimizer {
        a.lr = 1e-5;
    }
    spec.train.batch = 4;
    spec.train.seq_len = 32;
    let balanced = train_skewed(&spec, Device::Reference, 0.1, &moving);
    let mut control = spec.clone();
    control.ffn = moe_spec("moe-bias", steps, bias(1e-9)).ffn;
    let unbalanced = train_skewed(&control, Device::Reference, 0.1, &still);

    let tokens = (spec.train.batch * spec.train.seq_len) as f64;
    let even = tokens * TOP_K as f64 / EXPERTS as f64;
    for lines in [&balanced, &unbalanced] {
        assert_eq!(lines.len(), steps);
        for l in lines.iter() {
            assert_eq!(l["moe_load_mean"].as_f64(), Some(even), "{l}");
            let (min, max) = (l["moe_load_min"].as_u64().unwrap(), l["moe_load_max"].as_u64().unwrap());
            assert!(min as f64 <= even && even <= max as f64, "{l}");
            assert_eq!(l["moe_load_max_by_layer"]["blocks.0.ffn"].as_u64(), Some(max), "{l}");
            assert!(l.get("moe_dropped").is_none() && l.get("moe_aux_loss").is_none(), "{l}");
        }
        // Expert 0 is in every token's top-k: the max load is every token.
        assert_eq!(lines[0]["moe_load_max"].as_f64(), Some(tokens), "{}", lines[0]);
    }
    let late = |lines: &[Value]| lines[lines.len() - 10..].iter().map(imbalance).sum::<f64>() / 10.0;
    let (with, without) = (late(&balanced), late(&unbalanced));
    println!("max/mean load over the last 10 steps: {with:.3} with the bias update, {without:.3} without");
    assert!(without >= 0.9 * tokens / even, "the skew holds without a bias update: {without}");
    assert!(with < 0.6 * without, "the bias update evens the load: {with} vs {without}");

    // The bias moved down on the overloaded expert by whole steps of the rate; the
    // negligible rate left it where it started.
    let moved = &final_biases(&moving)[0];
    assert!(moved[0] < 0.1 - 10.0 * 0.005, "{moved:?}");
    for (e, b) in moved.iter().enumerate() {
        let start = if e == 0 { 0.1 } else { 0.0 };
        let steps_taken = (b - start) / 0.005;
        assert!(
            (steps_taken - steps_taken.round()).abs() < 1e-2,
            "expert {e}: {b} is not whole steps from {start}"
        );
    }
    let kept = &final_biases(&still)[0];
    assert!((kept[0] - 0.1).abs() < 1e-6, "{kept:?}");
    for d in [moving, still] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn capacity_runs_report_the_dropped_assignments() {
    let dir = temp_dir("moe", "capacity");
    let mut spec = moe_spec("moe-capacity", 2, bias(1e-3));
    if let FfnSpec::Moe(m) = &mut spec.ffn {
        m.dispatch = MoeDispatch::Sparse;
        m.capacity_factor = Some(1.0);
    }
    let lines = train_skewed(&spec, Device::Reference, 1.0, &dir);
    // Every token picks expert 0, which keeps C = N·k/E of them: N - C are dropped
    // there, and no other expert is over C when expert 0 holds N of the N·k slots.
    let n = (spec.train.batch * spec.train.seq_len) as u64;
    let capacity = n * TOP_K as u64 / EXPERTS as u64;
    assert_eq!(lines[0]["moe_load_max"].as_u64(), Some(n));
    let dropped = lines[0]["moe_dropped"].as_u64().expect("moe_dropped with a capacity");
    assert!(dropped >= n - capacity && dropped < n * TOP_K as u64, "{}", lines[0]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cpu_device_reads_the_same_loads_and_moves_the_same_biases() {
    let (reference, cpu) = (temp_dir("moe", "same-reference"), temp_dir("moe", "same-cpu"));
    let spec = moe_spec("moe-cpu", 6, bias(0.01));
    let want = train_skewed(&spec, Device::Reference, 0.05, &reference);
    let got = train_skewed(&spec, Device::Cpu, 0.05, &cpu);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(g["device"], "cpu");
        for key in ["moe_load_min", "moe_load_max", "moe_load_mean", "moe_load_max_by_layer"] {
            assert_eq!(w[key], g[key], "step {}: {key}", w["step"]);
        }
    }
    assert_eq!(final_biases(&cpu), final_biases(&reference));
    for d in [reference, cpu] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// The batch-wise aux loss, and the sequence-wise one beside the bias update
/// (DeepSeek-V3's pairing, docs/math.md §1.6), on the Cpu device against the reference.
#[test]
fn cpu_device_differentiates_and_reports_the_aux_loss_like_the_reference() {
    let balances = [
        MoeBalance::AuxLoss(AuxLossSpec { coef: 0.5, ..Default::default() }),
        MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 0.01, seq_aux_coef: 0.5 }),
    ];
    for balance in balances {
        cpu_aux_loss_case(balance);
    }
}

fn cpu_aux_loss_case(balance: MoeBalance) {
    let spec = moe_spec("moe-aux", 3, balance.clone());
    let (batch, seq) = (spec.train.batch, spec.train.seq_len);
    let lowered = ir::lower::lower(&spec, batch, seq).unwrap();
    assert!(lowered.statistics.iter().any(|s| s == ir::lower::MOE_AUX_LOSS_OUTPUT));

    // The gradients of the objective (the aux loss included) and the loss.
    let mut cpu = CpuExecutor::from_lowered(lowered.clone(), CpuOptions { threads: 2 });
    let report = compare(&spec, &mut cpu, 2, Tolerances::FP32).unwrap();
    let failures: Vec<String> =
        report.failures().map(|c| format!("{} {}", c.quantity.key(), c.name)).collect();
    assert!(failures.is_empty(), "{balance:?}: {report}");

    // One training step on each: the same statistics, the aux value at f32 rounding.
    let corpus = Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq + 1, spec.vocab).unwrap();
    let tokens =
        BatchSampler::train(spec.train.seed, batch, seq + 1).next_batch(corpus.train()).expect("a batch");
    let params = init_params(&lowered.graph, spec.train.seed).unwrap();
    let step = |device: Device| {
        let mut exec = device.executor(lowered.clone()).unwrap();
        let (mut p, mut optimizer) = (params.clone(), Optimizer::new(&spec, &params));
        let settings = runtime::step::UpdateSettings { lr_mult: 1.0, clip: None };
        let stats = exec.train_step(&mut p, &tokens, &mut optimizer, settings).unwrap();
        (stats.loss, exec.statistics().to_vec(), exec.step_statistics().to_vec())
    };
    let (want_loss, want_names, want) = step(Device::Reference);
    let (got_loss, got_names, got) = step(Device::Cpu);
    assert_eq!(got_names, want_names);
    assert_eq!(got_names.len(), 2, "the loads of the one MoE sublayer and the aux loss");
    assert_eq!(got[0], want[0], "expert loads");
    let (a, b) = (got[1][0], want[1][0]);
    assert!((a - b).abs() <= 1e-5 * b.abs(), "{balance:?}: aux loss: cpu {a} vs reference {b}");
    assert!(b > 0.1 * 0.5, "the aux loss is near its coefficient at init: {b}");
    // The reported loss is the language-model loss alone, on both.
    assert!((got_loss - want_loss).abs() <= 1e-5 * want_loss, "{got_loss} vs {want_loss}");
    let mut plain = spec.clone();
    plain.ffn = moe_spec("moe-aux", 3, MoeBalance::None).ffn;
    let lm = ir::lower::lower(&plain, batch, seq).unwrap();
    let lm_params = init_params(&lm.graph, spec.train.seed).unwrap();
    let lm_loss = Device::Reference.executor(lm).unwrap().loss(&lm_params, &tokens).unwrap();
    assert_eq!(want_loss.to_bits(), lm_loss.to_bits(), "the reported loss holds no aux term");
}
