//! `runtime::eval`: the loss it reports is the one training logs, and what it refuses.

mod common;

use common::run::{temp_dir, tiny_spec};
use runtime::checkpoint::Checkpoint;
use runtime::data::{Corpus, ValidationPlan};
use runtime::device::Device;
use runtime::eval::{evaluate, evaluate_with_progress, max_batches, EvalError, EvalOptions};
use runtime::params::ParamSet;
use runtime::train::{validation_loss, write_initial, TrainOptions};

#[test]
fn eval_scores_the_windows_training_scores_bit_for_bit_and_reports_each_batch() {
    for depth in [0, 1] {
        let mut spec = tiny_spec("eval-same", 2, 1, 0);
        spec.mtp.depth = depth;
        let dir = temp_dir("eval", &format!("same-{depth}"));
        let init = write_initial(&spec, &TrainOptions::quiet(dir.clone())).unwrap();

        let mut seen = Vec::new();
        let opts = EvalOptions { batches: Some(5), ..EvalOptions::default() };
        let report = evaluate_with_progress(&init, Device::Reference, &opts, &mut |done, total| {
            seen.push((done, total))
        })
        .unwrap();
        assert_eq!(seen, (1..=5).map(|d| (d, 5)).collect::<Vec<_>>());
        assert_eq!(report.batches, 5);
        assert_eq!(report.trained_on.as_ref(), Some(&report.data));
        assert!(report.notes.is_empty(), "{:?}", report.notes);

        let ckpt = Checkpoint::read(&init).unwrap();
        let lowered = ir::lower::lower(&spec, spec.train.batch, spec.train.seq_len).unwrap();
        let mut params = ParamSet::zeros(&lowered.graph).unwrap();
        ckpt.restore_params(&mut params).unwrap();
        let mut exec = Device::Reference.executor(lowered).unwrap();
        let corpus =
            Corpus::load_data(&spec.train.data, spec.train.val_fraction, spec.train.seq_len + 1, spec.vocab)
                .unwrap();
        let logged =
            validation_loss(&spec, exec.as_mut(), &params, &corpus, ValidationPlan::Random { batches: 5 })
                .unwrap()
                .loss;
        assert_eq!(report.val_loss().to_bits(), logged.to_bits(), "mtp depth {depth}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn batches_outside_the_specs_bound_are_refused_before_any_work() {
    assert_eq!(max_batches(), 100_000);
    for batches in [0, 100_001, usize::MAX] {
        // The checkpoint does not exist: the bound is checked first.
        let opts = EvalOptions { batches: Some(batches), ..EvalOptions::default() };
        let err = evaluate(std::path::Path::new("absent.safetensors"), Device::Reference, &opts).unwrap_err();
        assert!(matches!(err, EvalError::Batches { batches: b, max: 100_000 } if b == batches), "{err}");
        assert_eq!(
            err.to_string(),
            format!("--batches {batches} is not in 1..=100000 (the bound of the spec's train.eval_batches)")
        );
    }
}

#[test]
fn a_dump_folder_holding_a_dump_is_refused_unless_forced() {
    let spec = tiny_spec("eval-dump", 2, 1, 0);
    let dir = temp_dir("eval", "dump");
    let init = write_initial(&spec, &TrainOptions::quiet(dir.clone())).unwrap();
    let dump = dir.join("dump");
    std::fs::create_dir_all(&dump).unwrap();
    std::fs::write(dump.join("loss.safetensors"), b"kept").unwrap();
    let opts = EvalOptions { batches: Some(1), dump: Some(dump.clone()), ..EvalOptions::default() };
    let err = evaluate(&init, Device::Reference, &opts).unwrap_err();
    assert!(
        matches!(&err, EvalError::DumpExists { existing, .. } if existing == &[dump.join("loss.safetensors")])
    );
    assert!(err.to_string().contains("--force"), "{err}");
    assert_eq!(std::fs::read(dump.join("loss.safetensors")).unwrap(), b"kept");
    let report = evaluate(&init, Device::Reference, &EvalOptions { force: true, ..opts }).unwrap();
    assert_eq!(report.dumped.len(), 4);
    assert_ne!(std::fs::read(dump.join("loss.safetensors")).unwrap(), b"kept");
    std::fs::remove_dir_all(dir).unwrap();
}
