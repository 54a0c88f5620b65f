//! End to end (docs/architecture.md §9.7): `specs/tiny.ron` trained on tinyshakespeare on the
//! fused Cpu device (the path `widen train` takes; its parity with the reference executor is
//! `cpu_device_parity.rs`'s job) reaches a validation loss well below the unigram entropy of the
//! text, within a fixed step budget. A unigram model (byte frequencies, no context) can
//! do no better than that entropy, so the gap is what the model learned from context.
//!
//! The text lives in `shared/data/` next to the repository; a clone without it skips
//! this test with a message.

use ir::spec::{load_spec, DataSpec};
use runtime::device::Device;
use runtime::train::{train_spec, TrainOptions};
use std::path::Path;

const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/tinyshakespeare.txt");
const SPEC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/tiny.ron");
/// Optimizer steps: the spec's own 300 (cosine schedule, 30 warmup).
const STEPS: usize = 300;
/// Required margin, in nats per byte, below the unigram entropy.
const MIN_GAP: f64 = 0.5;

/// Entropy of the byte frequencies of `bytes`, in nats per byte.
fn unigram_entropy(bytes: &[u8]) -> f64 {
    let mut counts = [0usize; 256];
    bytes.iter().for_each(|&b| counts[b as usize] += 1);
    let n = bytes.len() as f64;
    counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
}

#[test]
fn tiny_spec_learns_tinyshakespeare_beyond_byte_frequencies() {
    let text = match std::fs::read(TEXT) {
        Ok(t) => t,
        Err(e) => {
            println!("skipped: tinyshakespeare not found at {TEXT} ({e}); it ships in shared/data/");
            return;
        }
    };
    let mut spec = load_spec(Path::new(SPEC)).unwrap_or_else(|e| panic!("{SPEC}: {e}"));
    spec.train.data = DataSpec::Text(TEXT.into());
    spec.train.steps = STEPS;
    spec.train.eval_every = STEPS;

    // The bar: the whole text's unigram entropy, or the validation tail's own (lower
    // when the tail's byte mix is narrower), whichever is stricter.
    let tail = (text.len() as f64 * spec.train.val_fraction).round() as usize;
    let whole = unigram_entropy(&text);
    let held_out = unigram_entropy(&text[text.len() - tail..]);
    let bar = whole.min(held_out);

    let out = std::env::temp_dir().join(format!("widen-shakespeare-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = TrainOptions::quiet(out.clone());
    let started = std::time::Instant::now();
    let report = train_spec(&spec, Device::Cpu, &opts).unwrap_or_else(|e| panic!("training: {e}"));
    let seconds = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&out).expect("remove the run folder");

    let val = f64::from(report.val_loss.expect("the last step evaluates"));
    let first = f64::from(report.losses[0]);
    let last = f64::from(*report.losses.last().expect("losses"));
    println!(
        "tinyshakespeare: {} bytes, unigram entropy {whole:.3} nats/byte (validation tail {held_out:.3}); \
         tiny.ron, {STEPS} steps in {seconds:.1} s: train loss {first:.3} -> {last:.3}, \
         validation {val:.3} ({:.3} below the unigram bar)",
        text.len(),
        bar - val
    );
    assert_eq!(report.steps, STEPS as u64);
    assert!(
        val < bar - MIN_GAP,
        "validation loss {val:.3} is not {MIN_GAP} nats below the unigram entropy {bar:.3}"
    );
}
