//! Every spec in `specs/` trains (docs/architecture.md §9): shrunk to a fast size, f32 on the
//! reference executor, on the built-in synthetic corpus, the mean loss of the last steps
//! is clearly below the mean of the first steps. Also MoE routing and Muon on a GHC
//! (virtual-width) model, whose hidden matrices include W_reduce and the MTP mixers.

use ir::spec::{ConstantSpec, Flash, ModelSpec, MuonSpec, OptimizerSpec, ResidualSpec, ScheduleSpec};
use runtime::device::Device;
use runtime::train::{train_spec, TrainOptions};
use std::path::PathBuf;

mod common;
use common::spec::{shrunk_spec, Shrink};

const STEPS: usize = 40;
/// Steps averaged at each end of the run.
const WINDOW: usize = 8;
/// Required drop, in nats, from the first window's mean loss to the last window's.
const MIN_DROP: f64 = 1.0;

fn spec_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs").join(file)
}

/// The spec file at a size that trains in seconds: D = 32, one block (two for the
/// two-block xHC-Flash, docs/math.md §6.11), 4 windows of 32 bytes per step, a short constant
/// schedule and no evaluation until the last step. The residual scheme, MTP, FFN kind
/// and optimizer stay as the file says.
fn shrunk(file: &str) -> ModelSpec {
    let sizes = Shrink { ffn_hidden: 64, moe_hidden: 32, seq_len: 32, batch: 4 };
    let mut spec = shrunk_spec(file, &sizes);
    spec.train.steps = STEPS;
    spec.train.eval_every = STEPS;
    spec.train.eval_batches = 1;
    spec.train.checkpoint_every = 0;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 4 });
    match &mut spec.train.optimizer {
        OptimizerSpec::AdamW(a) => a.lr = 1e-2,
        OptimizerSpec::Muon(m) => m.adamw.lr = 1e-2,
    }
    spec
}

/// Trains `spec` and checks that the loss clearly goes down; returns (first, last)
/// window means.
fn assert_trains(spec: &ModelSpec) -> (f64, f64) {
    let name = &spec.name;
    let out = std::env::temp_dir().join(format!("widen-train-schemes-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = TrainOptions::quiet(out.clone());
    let started = std::time::Instant::now();
    let report = train_spec(spec, Device::Reference, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    std::fs::remove_dir_all(&out).expect("remove the run folder");
    let losses: Vec<f64> = report.losses.iter().map(|&l| f64::from(l)).collect();
    assert_eq!(losses.len(), spec.train.steps, "{name}");
    assert!(losses.iter().all(|l| l.is_finite()), "{name}: {losses:?}");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&losses[..WINDOW]), mean(&losses[losses.len() - WINDOW..]));
    let val = report.val_loss.map(f64::from).expect("the last step evaluates");
    println!(
        "{name}: first {WINDOW} steps {first:.3}, last {WINDOW} steps {last:.3}, validation {val:.3} \
         ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    assert!(last < first - MIN_DROP, "{name}: loss went from {first:.3} to {last:.3}: {losses:?}");
    // Byte-level vocabulary: ln 256 ≈ 5.55 is the uniform guess. A trained model scores
    // held-out text well below it too.
    assert!(val < 256f64.ln() - MIN_DROP, "{name}: validation loss {val:.3}");
    (first, last)
}

/// Every spec file has a test below, so a new one cannot go untrained.
const SPEC_FILES: [&str; 20] = [
    "attn-residuals.ron",
    "denseformer.ron",
    "fc.ron",
    "hc.ron",
    "kromhc.ron",
    "mhc-bf16.ron",
    "mhc-lite.ron",
    "mhc.ron",
    "moe.ron",
    "mtp.ron",
    "residual.ron",
    "tiny.ron",
    "vwn-1.5x.ron",
    "vwn-moe.ron",
    "vwn-r4.ron",
    "vwn-r8.ron",
    "wide-residual.ron",
    "xhc-flash.ron",
    "xhc-moe.ron",
    "xhc.ron",
];

#[test]
fn every_spec_file_is_trained_here() {
    let dir = spec_path("");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".ron"))
        .collect();
    files.sort();
    assert_eq!(files, SPEC_FILES, "add a training test for each new spec file");
}

#[test]
fn fc_trains() {
    assert_trains(&shrunk("fc.ron"));
}

#[test]
fn hc_trains() {
    assert_trains(&shrunk("hc.ron"));
}

#[test]
fn mhc_lite_trains() {
    assert_trains(&shrunk("mhc-lite.ron"));
}

#[test]
fn wide_residual_trains() {
    assert_trains(&shrunk("wide-residual.ron"));
}

#[test]
fn attn_residuals_trains() {
    assert_trains(&shrunk("attn-residuals.ron"));
}

#[test]
fn denseformer_trains() {
    assert_trains(&shrunk("denseformer.ron"));
}

#[test]
fn kromhc_trains() {
    assert_trains(&shrunk("kromhc.ron"));
}

#[test]
fn mhc_trains() {
    assert_trains(&shrunk("mhc.ron"));
}

#[test]
fn mhc_bf16_trains() {
    assert_trains(&shrunk("mhc-bf16.ron"));
}

#[test]
fn moe_trains() {
    assert_trains(&shrunk("moe.ron"));
}

#[test]
fn mtp_trains() {
    assert_trains(&shrunk("mtp.ron"));
}

#[test]
fn residual_trains() {
    assert_trains(&shrunk("residual.ron"));
}

#[test]
fn tiny_trains() {
    assert_trains(&shrunk("tiny.ron"));
}

#[test]
fn vwn_fractional_trains() {
    assert_trains(&shrunk("vwn-1.5x.ron"));
}

#[test]
fn vwn_moe_trains() {
    assert_trains(&shrunk("vwn-moe.ron"));
}

#[test]
fn vwn_r4_trains() {
    assert_trains(&shrunk("vwn-r4.ron"));
}

#[test]
fn vwn_r8_trains() {
    assert_trains(&shrunk("vwn-r8.ron"));
}

#[test]
fn xhc_flash_trains() {
    assert_trains(&shrunk("xhc-flash.ron"));
}

#[test]
fn xhc_flash_two_block_trains() {
    let mut spec = shrunk("xhc-flash.ron");
    spec.name = "xhc-flash4".into();
    spec.layers = 2;
    if let ResidualSpec::Xhc(x) = &mut spec.residual {
        x.flash = Flash::TwoBlock;
    }
    assert_trains(&spec);
}

#[test]
fn xhc_moe_trains() {
    assert_trains(&shrunk("xhc-moe.ron"));
}

#[test]
fn xhc_trains() {
    assert_trains(&shrunk("xhc.ron"));
}

/// Muon (docs/math.md §8.2) on the hidden matrices of a VWN model with an MTP module, AdamW
/// on the rest.
#[test]
fn muon_trains_a_ghc_model() {
    let mut spec = shrunk("mtp.ron");
    spec.name = "mtp-muon".into();
    spec.train.optimizer = OptimizerSpec::Muon(MuonSpec::default());
    if let OptimizerSpec::Muon(m) = &mut spec.train.optimizer {
        m.adamw.lr = 1e-2;
    }
    assert_trains(&spec);
}
