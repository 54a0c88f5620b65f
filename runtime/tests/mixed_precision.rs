//! bf16 mixed precision end to end (docs/math.md §6.12) on `specs/mhc-bf16.ron`: the model's
//! loss at init stays close to the same model in f32, the fused Plan stores the residual
//! state in 2-byte buffers and so moves fewer activation bytes, and it trains on the Cpu
//! device.

use codegen::plan::{BufferRole, Plan};
use codegen::training::TrainingGraph;
use ir::spec::{ConstantSpec, ModelSpec, Precision, ScheduleSpec};
use ir::DType;
use runtime::data::{BatchSampler, Corpus};
use runtime::device::reference::ReferenceExecutor;
use runtime::device::Device;
use runtime::init::init_params;
use runtime::step::StepExecutor;
use runtime::train::{train_spec, TrainOptions};

mod common;
use common::spec::{shrunk_spec, Shrink};

fn bf16_spec() -> ModelSpec {
    let sizes = Shrink { ffn_hidden: 64, moe_hidden: 32, seq_len: 16, batch: 2 };
    let spec = shrunk_spec("mhc-bf16.ron", &sizes);
    assert_eq!(spec.precision, Precision::Bf16);
    spec
}

fn as_f32(spec: &ModelSpec) -> ModelSpec {
    ModelSpec { precision: Precision::F32, ..spec.clone() }
}

fn reference_loss(spec: &ModelSpec, tokens: &[i32]) -> f32 {
    let lowered = ir::lower::lower(spec, spec.train.batch, spec.train.seq_len).expect("lowers");
    let params = init_params(&lowered.graph, spec.train.seed).expect("init");
    ReferenceExecutor::from_lowered(lowered).loss(&params, tokens).expect("reference loss")
}

#[test]
fn bf16_loss_at_init_is_close_to_the_f32_loss() {
    let spec = bf16_spec();
    let (batch, seq) = (spec.train.batch, spec.train.seq_len);
    let corpus =
        Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq + 1, spec.vocab).expect("corpus");
    let tokens =
        BatchSampler::train(spec.train.seed, batch, seq + 1).next_batch(corpus.train()).expect("a batch");
    let bf16 = reference_loss(&spec, &tokens);
    let f32 = reference_loss(&as_f32(&spec), &tokens);
    let rel = f64::from((bf16 - f32).abs() / f32.abs());
    println!("loss at init: bf16 {bf16}, f32 {f32}, relative difference {rel:.2e}");
    assert!(rel < 1e-2, "bf16 {bf16} vs f32 {f32}");
    // The rounding really happens: the two models are not the same function.
    assert_ne!(bf16.to_bits(), f32.to_bits());
}

/// The training Plan with the main head's logits kept whole: bf16 heads are not fused
/// (docs/math.md §1.7), so the f32 twin keeps its logits too and the two Plans differ in
/// the state's precision alone.
fn plan_of(spec: &ModelSpec) -> Plan {
    let lowered = ir::lower::lower(spec, spec.train.batch, spec.train.seq_len).expect("lowers");
    TrainingGraph::keeping_logits(lowered).expect("differentiates").plan().expect("compiles")
}

/// Peak activation memory: the scratch arena of each element type (activations live
/// there, placed by liveness) in bytes, summed over the types.
fn activation_bytes(plan: &Plan) -> usize {
    let mut arena: std::collections::HashMap<DType, usize> = std::collections::HashMap::new();
    for d in &plan.buffers {
        if let BufferRole::Scratch { offset } = d.role {
            let end = arena.entry(d.dtype).or_default();
            *end = (*end).max(offset + d.len);
        }
    }
    arena.iter().map(|(dtype, len)| len * dtype.size_bytes()).sum()
}

#[test]
fn bf16_plan_stores_the_state_in_two_byte_buffers() {
    // Enough tokens that activations, not the per-step bf16 copies of the weights, dominate.
    let mut spec = bf16_spec();
    spec.train.seq_len = 64;
    spec.train.batch = 8;
    let (bf16, f32) = (plan_of(&spec), plan_of(&as_f32(&spec)));
    let n = match &spec.residual {
        ir::spec::ResidualSpec::Mhc(m) => m.n,
        other => panic!("expected mHC, got {other:?}"),
    };
    let state_len = spec.train.batch * spec.train.seq_len * n * spec.d_model;
    let bf16_states = bf16.buffers.iter().filter(|d| d.dtype == DType::Bf16 && d.len == state_len).count();
    assert!(bf16_states > 0, "no bf16 buffer of the state's size {state_len}");
    assert!(f32.buffers.iter().all(|d| d.dtype != DType::Bf16), "the f32 Plan holds bf16 buffers");
    // Parameters and gradients stay f32 (master weights, docs/math.md §6.12).
    let persistent =
        |d: &&codegen::plan::BufferDecl| matches!(d.role, BufferRole::Param { .. } | BufferRole::Grad { .. });
    assert!(bf16.buffers.iter().filter(persistent).all(|d| d.dtype == DType::F32));
    let (b, f) = (activation_bytes(&bf16), activation_bytes(&f32));
    println!("activation bytes: bf16 {b}, f32 {f} ({:.2}x)", b as f64 / f as f64);
    assert!(b < f, "bf16 activations {b} B are not below f32 {f} B");
}

#[test]
fn bf16_model_trains_on_the_cpu_device() {
    const STEPS: usize = 30;
    let mut spec = bf16_spec();
    spec.train.seq_len = 32;
    spec.train.batch = 4;
    spec.train.steps = STEPS;
    spec.train.eval_every = STEPS;
    spec.train.eval_batches = 1;
    spec.train.checkpoint_every = 0;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 4 });
    if let ir::spec::OptimizerSpec::AdamW(a) = &mut spec.train.optimizer {
        a.lr = 1e-2;
    }
    let out = std::env::temp_dir().join(format!("widen-mixed-precision-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = TrainOptions::quiet(out.clone());
    let report = train_spec(&spec, Device::Cpu, &opts).expect("trains");
    std::fs::remove_dir_all(&out).expect("remove the run folder");
    let losses: Vec<f64> = report.losses.iter().map(|&l| f64::from(l)).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&losses[..6]), mean(&losses[STEPS - 6..]));
    println!("bf16 on cpu: first 6 steps {first:.3}, last 6 steps {last:.3}");
    assert!(last < first - 1.0, "loss went from {first:.3} to {last:.3}: {losses:?}");
}
