//! Fused vs reference (docs/architecture.md §9.4): every spec in `specs/`, shrunk, runs
//! one training step on the Cpu device (the fused Plan from `codegen::compile`)
//! and on the reference executor (the unfused graph), both in f32, and then
//! five optimizer steps on each.
//!
//! Tolerances and what is compared: [`runtime::parity`] (f32 rounding
//! level, [`Tolerances::FP32`]; bf16 specs [`Tolerances::BF16`]).

use codegen::cc::Compiler;
use codegen::training::TrainingGraph;
use ir::spec::{ConstantSpec, FfnSpec, ModelSpec, MoeDispatch, MoeGate, Precision, ScheduleSpec};
use runtime::data::{BatchSampler, Corpus};
use runtime::device::cpu::{CpuDevice, CpuExecutor, CpuOptions};
use runtime::init::init_params;
use runtime::parity::{compare, Quantity, Tolerances};
use runtime::step::StepExecutor;
use std::path::PathBuf;

mod common;
use common::spec::{shrunk_spec, Shrink};

const OPT_STEPS: usize = 5;

/// The spec at parity-test size: D = 32, one block (two for two-block
/// xHC-Flash), 2 windows of 8 tokens.
fn shrunk(file: &str) -> ModelSpec {
    let sizes = Shrink { ffn_hidden: 48, moe_hidden: 16, seq_len: 8, batch: 2 };
    let mut spec = shrunk_spec(file, &sizes);
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    spec
}

fn check_spec(file: &str) {
    check_model(file, &shrunk(file));
}

fn check_model(file: &str, spec: &ModelSpec) {
    let spec = spec.clone();
    let (batch, seq) = (spec.train.batch, spec.train.seq_len);
    let lowered = ir::lower::lower(&spec, batch, seq).unwrap_or_else(|e| panic!("{file}: lower: {e}"));
    let params = init_params(&lowered.graph, spec.train.seed).expect("init");
    let mut cpu = CpuExecutor::from_lowered(lowered, CpuOptions { threads: 2 });
    let report = compare(&spec, &mut cpu, OPT_STEPS, Tolerances::for_spec(&spec))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    let failures: Vec<String> = report
        .failures()
        .map(|c| format!("{} {}: {:.2e} > {:.0e}", c.quantity.key(), c.name, c.err, c.tol))
        .collect();
    assert!(failures.is_empty(), "{report}\n{}", failures.join("\n"));
    let grads = report.checks.iter().filter(|c| c.quantity == Quantity::Grad).count();
    assert_eq!(grads, params.len(), "{file}: one gradient check per parameter");

    // The validation path reruns the same Plan: bit-identical on the host.
    let corpus =
        Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq + 1, spec.vocab).expect("corpus");
    let tokens =
        BatchSampler::train(spec.train.seed, batch, seq + 1).next_batch(corpus.train()).expect("a batch");
    let (loss, _) = cpu.loss_and_grads(&params, &tokens).expect("cpu step");
    let val = cpu.loss(&params, &tokens).expect("cpu loss");
    assert_eq!(val.to_bits(), loss.to_bits(), "{file}: loss() differs from loss_and_grads()");
}

macro_rules! parity {
    ($($test:ident => $file:literal),* $(,)?) => {
        $(#[test] fn $test() { check_spec($file); })*

        /// Every spec file has a parity test above.
        #[test]
        fn every_spec_is_covered() {
            let covered = [$($file),*];
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs");
            for entry in std::fs::read_dir(&dir).expect("specs/") {
                let name = entry.expect("entry").file_name().to_string_lossy().into_owned();
                if name.ends_with(".ron") {
                    assert!(covered.contains(&name.as_str()), "specs/{name} has no Cpu parity test");
                }
            }
        }
    };
}

parity! {
    fc => "fc.ron",
    hc => "hc.ron",
    mhc => "mhc.ron",
    mhc_bf16 => "mhc-bf16.ron",
    mhc_lite => "mhc-lite.ron",
    wide_residual => "wide-residual.ron",
    attn_residuals => "attn-residuals.ron",
    denseformer => "denseformer.ron",
    kromhc => "kromhc.ron",
    moe => "moe.ron",
    mtp => "mtp.ron",
    residual => "residual.ron",
    tiny => "tiny.ron",
    vwn_fractional => "vwn-1.5x.ron",
    vwn_moe => "vwn-moe.ron",
    vwn_r4 => "vwn-r4.ron",
    vwn_r8 => "vwn-r8.ron",
    xhc_flash => "xhc-flash.ron",
    xhc_moe => "xhc-moe.ron",
    xhc => "xhc.ron",
}

/// `moe.ron` at parity-test size with sparse dispatch (docs/math.md §1.6): the
/// given gate, shared experts, capacity factor and precision.
fn sparse_moe(gate: MoeGate, shared: usize, capacity_factor: Option<f64>, precision: Precision) -> ModelSpec {
    let mut spec = shrunk("moe.ron");
    let FfnSpec::Moe(m) = &mut spec.ffn else { panic!("moe.ron has a MoE FFN") };
    (m.gate, m.shared, m.dispatch, m.capacity_factor) = (gate, shared, MoeDispatch::Sparse, capacity_factor);
    spec.precision = precision;
    spec
}

/// Sparse MoE on the Cpu device (routing on the host, one GEMM per expert)
/// against the reference: loss, every parameter gradient and five training
/// steps, for softmax and sigmoid gates, with and without a shared expert, and
/// with a capacity of half the even share (16 tokens' 32 assignments over 4
/// experts keep at most 4 rows each, so assignments are dropped whatever the
/// router chooses).
#[test]
fn sparse_moe_matches_the_reference() {
    for (gate, shared, capacity) in [
        (MoeGate::Softmax, 1, None),
        (MoeGate::Sigmoid, 0, None),
        (MoeGate::Softmax, 0, Some(0.5)),
        (MoeGate::Sigmoid, 1, Some(0.5)),
    ] {
        let spec = sparse_moe(gate, shared, capacity, Precision::F32);
        let FfnSpec::Moe(m) = &spec.ffn else { unreachable!() };
        let tokens = spec.train.batch * spec.train.seq_len;
        assert!(capacity.is_none() || m.capacity(tokens).unwrap() * m.experts < tokens * m.top_k);
        check_model(&format!("sparse moe {gate:?} shared {shared} capacity {capacity:?}"), &spec);
    }
}

/// Sparse MoE under bf16 mixed precision: the grouped products take bf16
/// operands (widened to f32 on the Cpu device), at bf16 tolerances.
#[test]
fn sparse_moe_bf16_matches_the_reference() {
    check_model("sparse moe bf16", &sparse_moe(MoeGate::Softmax, 1, Some(1.25), Precision::Bf16));
}

/// The Cpu device's training step against the host path (`loss_and_grads`,
/// `clip_global_norm`, `Optimizer::step`): with AdamW the Plan's own update
/// (norm, clip and AdamW kernels, moments kept on the device), with Muon the
/// host update reading gradients in the Plan's buffers; uploads skipped
/// while the set is unchanged. Both run on one executor, alternating, so
/// each switch of parameter set must upload; the result must be the same
/// bits, moments included. Clipping is set low enough to act, and one
/// parameter is edited between steps (the next step must see the edit).
#[test]
fn train_step_matches_the_host_update() {
    use runtime::optim::clip::clip_global_norm;
    use runtime::optim::Optimizer;
    use runtime::step::UpdateSettings;
    for optimizer in [None, Some(ir::spec::OptimizerSpec::Muon(ir::spec::MuonSpec::default()))] {
        let mut spec = shrunk("mhc.ron");
        spec.train.clip = Some(0.05);
        if let Some(o) = optimizer {
            spec.train.optimizer = o;
        }
        let (batch, seq) = (spec.train.batch, spec.train.seq_len);
        let lowered = ir::lower::lower(&spec, batch, seq).expect("lower");
        let mut device_params = init_params(&lowered.graph, spec.train.seed).expect("init");
        let mut host_params = device_params.clone();
        let mut device_opt = Optimizer::new(&spec, &device_params);
        let mut host_opt = device_opt.clone();
        let mut cpu = CpuExecutor::from_lowered(lowered, CpuOptions { threads: 2 });
        let corpus = Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq + 1, spec.vocab)
            .expect("corpus");
        let mut sampler = BatchSampler::train(spec.train.seed, batch, seq + 1);
        let mut clipped = 0;
        for step in 0..4 {
            let tokens = sampler.next_batch(corpus.train()).expect("a batch");
            if step == 2 {
                device_params[0].value[0] += 0.5;
                host_params[0].value[0] += 0.5;
            }
            let settings = UpdateSettings { lr_mult: 0.5 + 0.1 * step as f64, clip: spec.train.clip };
            let stats =
                cpu.train_step(&mut device_params, &tokens, &mut device_opt, settings).expect("train step");

            let (loss, mut grads) = cpu.loss_and_grads(&host_params, &tokens).expect("host step");
            let norm = clip_global_norm(&mut grads, spec.train.clip.expect("clip set"));
            host_opt.step(&mut host_params, &grads, settings.lr_mult);

            assert_eq!(stats.loss.to_bits(), loss.to_bits(), "step {step}: loss");
            assert_eq!(stats.grad_norm.to_bits(), norm.to_bits(), "step {step}: gradient norm");
            clipped += usize::from(norm > 0.05);
            for (d, h) in device_params.iter().zip(host_params.iter()) {
                let same = d.value.iter().zip(&h.value).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "step {step}: `{}` differs after the update", d.name);
            }
        }
        assert!(clipped > 0, "the clip never acted: the test would not cover the scaled update");
        let adamw = matches!(spec.train.optimizer, ir::spec::OptimizerSpec::AdamW(_));
        assert_eq!(device_opt.moments_on_device(), adamw, "the Plan runs the update exactly for AdamW");
        cpu.sync_optimizer(&mut device_opt).expect("moments back from the device");
        assert!(!device_opt.moments_on_device());
        assert_eq!(device_opt, host_opt, "optimizer state");
        // The device's own copy is current: a validation loss without any
        // upload equals one after a forced upload (a fresh set's identity).
        let tokens = sampler.next_batch(corpus.train()).expect("a batch");
        let resident = cpu.loss(&device_params, &tokens).expect("loss");
        let uploaded = cpu.loss(&device_params.clone(), &tokens).expect("loss");
        assert_eq!(resident.to_bits(), uploaded.to_bits(), "the device's parameters are stale");
    }
}

/// Causal attention's head-major steps form chains (`codegen::plan::Chain`)
/// that the Cpu device runs one (batch, head) at a time: the loss and every
/// gradient are the bits of the same Plan run step by step, with every query
/// head its own key/value head and with two query heads sharing one.
#[test]
fn attention_chains_give_the_bits_of_their_steps_in_order() {
    for kv_heads in [None, Some(1)] {
        let mut spec = shrunk("residual.ron");
        spec.kv_heads = kv_heads;
        chained_and_in_order_agree(&spec);
    }
}

fn chained_and_in_order_agree(spec: &ModelSpec) {
    let what = format!("kv_heads {}", spec.kv_heads());
    let (batch, seq) = (spec.train.batch, spec.train.seq_len);
    let lowered = ir::lower::lower(spec, batch, seq).expect("lower");
    let params = init_params(&lowered.graph, spec.train.seed).expect("init");
    let plan = TrainingGraph::new(lowered).and_then(|g| g.plan()).expect("plan");
    let threads = 2;
    assert_eq!(plan.chains.len(), 2 * spec.layers, "{what}: one chain per attention forward and backward");
    assert!(plan.chains.iter().all(|c| c.entries == batch * spec.heads && c.entries >= threads), "{what}");
    let mut in_order = plan.clone();
    in_order.chains.clear();
    let corpus =
        Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq + 1, spec.vocab).expect("corpus");
    let tokens =
        BatchSampler::train(spec.train.seed, batch, seq + 1).next_batch(corpus.train()).expect("a batch");
    let run = |plan| {
        let compiler = Compiler::from_env().expect("C compiler");
        let device = CpuDevice::with_options(plan, &compiler, CpuOptions { threads }).expect("load");
        let mut cpu = CpuExecutor::new(device, [batch, seq + 1], spec.model_vocab()).expect("executor");
        cpu.loss_and_grads(&params, &tokens).expect("step")
    };
    let ((chained_loss, chained), (loss, grads)) = (run(plan), run(in_order));
    assert_eq!(chained_loss.to_bits(), loss.to_bits(), "{what}: loss");
    for (i, (a, b)) in chained.iter().zip(&grads).enumerate() {
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{what}: gradient {i} differs between the chained and the in-order run");
    }
}
