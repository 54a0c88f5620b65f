//! Fused vs reference (DESIGN.md §9.4): every spec in `specs/`, shrunk, runs
//! one training step on the Cpu device (the fused Plan from `codegen::compile`)
//! and on the reference executor (the unfused graph), both in f32, and then
//! five optimizer steps on each.
//!
//! Tolerances. Loss and gradients are compared relative to the largest
//! magnitude of the tensor (elementwise relative error is meaningless for
//! entries near zero); the two paths sum in different orders (fused loops,
//! GEMM blocking), so they agree to f32 rounding, not bitwise:
//! - loss: 1e-5; logits and every parameter gradient: 1e-4.
//!
//! Parameters after five steps are compared in units of the learning rate,
//! the size of one step: every entry within 0.001 learning rates. Adam divides
//! each gradient by its running RMS, which turns rounding noise on a gradient
//! entry that is itself at noise level (around 1e-9) into a step of O(1)
//! learning rates; the test therefore runs AdamW with eps = 1e-4 (instead of
//! 1e-8), which bounds that amplification by 1/eps while leaving every
//! gradient of ordinary size normalized as before.

use ir::spec::{
    load_spec, ConstantSpec, DataSpec, FfnSpec, Flash, ModelSpec, OptimizerSpec, ResidualSpec, ScheduleSpec,
    SwiGluSpec, SyntheticCorpus,
};
use runtime::data::{BatchSampler, Corpus};
use runtime::device::cpu::CpuOptions;
use runtime::device::executor::CpuExecutor;
use runtime::executor::{ReferenceExecutor, StepExecutor};
use runtime::init::init_params;
use runtime::optim::Optimizer;
use runtime::params::ParamSet;
use std::path::PathBuf;

const LOSS_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 1e-4;
const PARAM_STEPS_TOL: f64 = 1e-3;
const ADAM_EPS: f64 = 1e-4;
const OPT_STEPS: usize = 5;

/// The spec at parity-test size: D = 32, one block (two for two-block
/// xHC-Flash), 2 windows of 8 tokens.
fn shrunk(file: &str) -> ModelSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs").join(file);
    let mut spec = load_spec(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    spec.d_model = 32;
    spec.heads = 2;
    spec.kv_heads = None;
    spec.head_dim = None;
    // Two blocks where a scheme shares decisions across a block pair (MATH.md §6.11).
    spec.layers = match &spec.residual {
        ResidualSpec::Xhc(x) if x.flash == Flash::TwoBlock => 2,
        _ => 1,
    };
    spec.ffn = match spec.ffn {
        FfnSpec::SwiGlu(_) => FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(48) }),
        FfnSpec::Moe(mut m) => {
            m.hidden = 16;
            FfnSpec::Moe(m)
        }
    };
    spec.train.data = DataSpec::Synthetic(SyntheticCorpus::Default);
    spec.train.seq_len = 8;
    spec.train.batch = 2;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    match &mut spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.eps = ADAM_EPS,
        OptimizerSpec::Muon(m) => m.adamw.eps = ADAM_EPS,
    }
    spec
}

/// The largest difference relative to the largest reference magnitude.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs())).max(1e-30);
    let diff = got.iter().zip(want).fold(0.0f64, |m, (&g, &w)| m.max((f64::from(g) - f64::from(w)).abs()));
    diff / scale
}

fn check_spec(file: &str) {
    let spec = shrunk(file);
    let (batch, seq) = (spec.train.batch, spec.train.seq_len);
    let lowered = ir::lower::lower(&spec, batch, seq).unwrap_or_else(|e| panic!("{file}: lower: {e}"));
    let mut params = init_params(&lowered.graph, spec.train.seed).expect("init");
    let mut reference = ReferenceExecutor::from_lowered(lowered.clone());
    let mut cpu = CpuExecutor::from_lowered(lowered, CpuOptions { threads: 2 });
    assert_eq!(cpu.token_shape(), reference.token_shape());
    let corpus = Corpus::load(&spec.train.data, spec.train.val_fraction, seq + 1).expect("corpus");
    let mut sampler = BatchSampler::train(spec.train.seed, batch, seq + 1);

    let tokens = sampler.next_batch(corpus.train());
    let (want_loss, want_grads) = reference.loss_and_grads(&params, &tokens).expect("reference step");
    let (loss, grads) =
        cpu.loss_and_grads(&params, &tokens).unwrap_or_else(|e| panic!("{file}: cpu step: {e}"));
    let loss_err = rel_err(&[loss], &[want_loss]);
    assert!(loss_err <= LOSS_TOL, "{file}: loss {loss} vs reference {want_loss} (rel {loss_err:.2e})");
    assert_eq!(grads.len(), params.len());
    for (p, (g, w)) in params.iter().zip(grads.iter().zip(&want_grads)) {
        let err = rel_err(g, w);
        assert!(err <= GRAD_TOL, "{file}: gradient of {} off by {err:.2e} (relative to its max)", p.name);
    }
    // Validation and sampling paths read the same Plan's outputs.
    let val = cpu.loss(&params, &tokens).expect("cpu loss");
    assert_eq!(val.to_bits(), loss.to_bits(), "{file}: loss() differs from loss_and_grads()");
    let logits = cpu.logits(&params, &tokens).expect("cpu logits");
    let want_logits = reference.logits(&params, &tokens).expect("reference logits");
    assert!(rel_err(&logits, &want_logits) <= GRAD_TOL, "{file}: logits");

    // Several optimizer steps on each path from the same start.
    let mut cpu_params: ParamSet = params.clone();
    let (mut opt_ref, mut opt_cpu) = (Optimizer::new(&spec, &params), Optimizer::new(&spec, &params));
    for _ in 0..OPT_STEPS {
        let tokens = sampler.next_batch(corpus.train());
        let (_, g_ref) = reference.loss_and_grads(&params, &tokens).expect("reference step");
        let (_, g_cpu) = cpu.loss_and_grads(&cpu_params, &tokens).expect("cpu step");
        opt_ref.step(&mut params, &g_ref, 1.0);
        opt_cpu.step(&mut cpu_params, &g_cpu, 1.0);
    }
    let lr = match &spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.lr,
        OptimizerSpec::Muon(m) => m.lr.max(m.adamw.lr),
    };
    for (a, b) in cpu_params.iter().zip(params.iter()) {
        let worst = a.value.iter().zip(&b.value).fold(0.0f64, |m, (x, y)| m.max(f64::from(x - y).abs()));
        assert!(
            worst <= PARAM_STEPS_TOL * lr,
            "{file}: {} after {OPT_STEPS} steps differs by {worst:.2e} = {:.2e} learning rates",
            a.name,
            worst / lr
        );
    }
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
    moe => "moe.ron",
    mtp => "mtp.ron",
    residual => "residual.ron",
    tiny => "tiny.ron",
    vwn_fractional => "vwn-1.5x.ron",
    vwn_r4 => "vwn-r4.ron",
    vwn_r8 => "vwn-r8.ron",
    xhc_flash => "xhc-flash.ron",
    xhc => "xhc.ron",
}
