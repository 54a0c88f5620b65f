//! A run's folder over its lifecycle: what is refused, what survives, what a
//! resume may change, and that no checkpoint holds a diverged state.

use ir::spec::{AdamWSpec, ConstantSpec, ModelSpec, OptimizerSpec, ResidualSpec, ScheduleSpec};
use runtime::checkpoint::{self, Checkpoint, CheckpointError, TrainState};
use runtime::device::Device;
use runtime::init::init_params;
use runtime::train::{train_spec, TrainError};
use std::path::{Path, PathBuf};

mod common;

use common::run::opts;

fn tiny_spec(steps: usize) -> ModelSpec {
    common::run::tiny_spec("run-folder", steps, 100, 1)
}

fn temp_dir(tag: &str) -> PathBuf {
    common::run::temp_dir("run-folder", tag)
}

/// `(step, loss)` of every metrics line.
fn metrics(dir: &Path) -> Vec<(u64, f64)> {
    common::run::metric_losses(&dir.join("metrics.jsonl"))
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Overwrites the first value of `tensor` in a checkpoint file with `value`.
fn poke(path: &Path, tensor: &str, value: f32) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
    bytes[start..start + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn non_finite_checkpoints_are_neither_written_nor_read() {
    let dir = temp_dir("nonfinite");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = tiny_spec(2);
    let lowered = ir::lower::lower(&spec, 1, spec.train.seq_len).unwrap();
    let mut params = init_params(&lowered.graph, 0).unwrap();
    let state = TrainState { step: 1, sampler: runtime::data::SamplerState::Random([0; 4]) };
    let good = dir.join("good.safetensors");
    checkpoint::save(&good, &spec, &params, None, &state).unwrap();

    // A diverged parameter: save refuses it, naming the tensor, and leaves no file.
    let name = params.iter().nth(1).unwrap().name.clone();
    params.iter_mut().nth(1).unwrap().value[3] = f32::NAN;
    let bad = dir.join("bad.safetensors");
    let err = checkpoint::save(&bad, &spec, &params, None, &state).unwrap_err();
    assert!(matches!(err, CheckpointError::NonFiniteSave { ref tensor, .. } if *tensor == name), "{err}");
    assert!(err.to_string().contains(&name), "{err}");
    assert_eq!(files(&dir), vec!["good.safetensors"], "no file and no temporary file");

    // A file holding infinity (written by an older build): read refuses it, naming the tensor.
    poke(&good, &name, f32::INFINITY);
    let err = Checkpoint::read(&good).unwrap_err();
    assert!(matches!(err, CheckpointError::NonFiniteTensor { ref tensor, .. } if *tensor == name), "{err}");
    assert!(err.to_string().contains("good.safetensors") && err.to_string().contains(&name), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// An update with an infinite learning rate makes the parameters non-finite
/// while the step's own loss (taken before the update) is finite: the run must
/// stop at the save, not write a checkpoint of the diverged state.
#[test]
fn a_diverging_update_is_not_checkpointed() {
    let out = temp_dir("diverge");
    let mut spec = tiny_spec(4);
    spec.train.checkpoint_every = 1;
    spec.train.clip = None;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    spec.train.optimizer = OptimizerSpec::AdamW(AdamWSpec { lr: 1e300, ..AdamWSpec::default() });
    let err = train_spec(&spec, Device::Reference, &opts(&out, None)).unwrap_err();
    let TrainError::Diverged { step, ref tensor, last_good: None, .. } = err else {
        panic!("expected a diverged state, got {err}")
    };
    assert_eq!(step, 1);
    assert!(err.to_string().contains(tensor.as_str()), "{err}");
    assert_eq!(files(&out), vec!["metrics.jsonl"], "no checkpoint of step 1, and the run's lock is gone");
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn a_resume_may_change_the_step_budget_and_data_but_not_the_model() {
    let dir = temp_dir("fields");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = tiny_spec(4);
    let lowered = ir::lower::lower(&spec, 1, spec.train.seq_len).unwrap();
    let params = init_params(&lowered.graph, 0).unwrap();
    let path = dir.join("ckpt-2.safetensors");
    checkpoint::save(
        &path,
        &spec,
        &params,
        None,
        &TrainState { step: 2, sampler: runtime::data::SamplerState::Random([0; 4]) },
    )
    .unwrap();
    let ckpt = Checkpoint::read(&path).unwrap();

    let mut longer = spec.clone();
    longer.train.steps = 40;
    longer.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 5 });
    longer.train.data = ir::spec::DataSpec::Text("other.txt".into());
    longer.train.checkpoint_every = 3;
    longer.train.keep_last = 2;
    let changed = ckpt.check_spec(&longer).unwrap();
    for field in ["train.steps", "train.data", "train.checkpoint_every", "train.keep_last"] {
        assert!(changed.iter().any(|c| c == field), "{field} not in {changed:?}");
    }
    assert!(changed.iter().any(|c| c.starts_with("train.schedule") && c.ends_with("warmup")), "{changed:?}");

    let refused = |other: ModelSpec, field: &str| {
        let err = ckpt.check_spec(&other).unwrap_err();
        assert!(matches!(err, CheckpointError::SpecMismatch { .. }), "{err}");
        assert!(err.to_string().contains(field), "{field}: {err}");
    };
    refused(ModelSpec { d_model: 32, ..spec.clone() }, "d_model");
    refused(ModelSpec { residual: ResidualSpec::Hc(Default::default()), ..spec.clone() }, "residual");
    let mut lr = spec.clone();
    lr.train.optimizer = OptimizerSpec::AdamW(AdamWSpec { lr: 2e-2, ..AdamWSpec::default() });
    refused(lr, "train.optimizer");
    let mut cosine = spec.clone();
    cosine.train.schedule = ScheduleSpec::Cosine(Default::default());
    refused(cosine, "train.schedule");
    let mut seed = spec.clone();
    seed.train.seed = 9;
    refused(seed, "train.seed");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A run extended past its planned end continues in its own folder: the step
/// checkpoints and metrics of the first part stay, and the final checkpoint of
/// the first part is kept as `ckpt-<step>` before the extended run replaces it.
#[test]
fn a_finished_run_extends_in_its_own_folder() {
    let out = temp_dir("extend");
    let short = tiny_spec(4);
    train_spec(&short, Device::Reference, &opts(&out, None)).unwrap();
    let first = metrics(&out);
    let mut long = tiny_spec(7);
    long.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 3 });
    let report =
        train_spec(&long, Device::Reference, &opts(&out, Some(out.join("final.safetensors")))).unwrap();
    assert_eq!(report.steps, 7);
    assert_eq!(report.losses.len(), 3);
    let all = metrics(&out);
    assert_eq!(all.iter().map(|m| m.0).collect::<Vec<_>>(), (1..=7).collect::<Vec<u64>>());
    assert_eq!(all[..4], first[..]);
    assert_eq!(Checkpoint::read(&out.join("ckpt-4.safetensors")).unwrap().state.step, 4);
    assert_eq!(Checkpoint::read(&out.join("final.safetensors")).unwrap().state.step, 7);
    std::fs::remove_dir_all(out).unwrap();
}

/// A fresh run refuses a folder holding another run's checkpoints even when its
/// metrics are gone; a resume into a new folder starts that folder's metrics
/// with the checkpoint's run's lines, so the record is whole.
#[test]
fn run_folders_are_never_mixed() {
    let (a, b) = (temp_dir("mix-a"), temp_dir("mix-b"));
    let mut spec = tiny_spec(4);
    spec.train.checkpoint_every = 2;
    train_spec(&spec, Device::Reference, &opts(&a, None)).unwrap();
    let whole = metrics(&a);
    std::fs::remove_file(a.join("metrics.jsonl")).unwrap();
    let err = train_spec(&spec, Device::Reference, &opts(&a, None)).unwrap_err();
    assert!(matches!(err, TrainError::RunExists { .. }), "{err}");
    assert_eq!(files(&a), vec!["ckpt-2.safetensors", "ckpt-4.safetensors", "final.safetensors"]);

    let mut lines = String::new();
    for (step, loss) in &whole {
        lines.push_str(&format!("{{\"step\":{step},\"loss\":{loss}}}\n"));
    }
    std::fs::write(a.join("metrics.jsonl"), lines).unwrap();
    let rest = train_spec(&spec, Device::Reference, &opts(&b, Some(a.join("ckpt-2.safetensors")))).unwrap();
    assert_eq!(metrics(&b), whole, "steps 1-2 copied, 3-4 trained again bit for bit");
    assert_eq!(rest.losses.len(), 2);
    // Resuming into a folder holding another run is refused too.
    let err =
        train_spec(&spec, Device::Reference, &opts(&b, Some(a.join("ckpt-2.safetensors")))).unwrap_err();
    assert!(matches!(err, TrainError::WouldReplace { .. }), "{err}");
    for d in [a, b] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A run killed between checkpoints leaves metrics lines past its last
/// checkpoint (the last one possibly cut short) and a partial temporary file:
/// the resume in its folder drops those lines, removes the file and writes the
/// steps again.
#[test]
fn a_resume_after_a_crash_replays_the_lost_steps() {
    let out = temp_dir("crash");
    let mut spec = tiny_spec(5);
    spec.train.checkpoint_every = 2;
    train_spec(&spec, Device::Reference, &opts(&out, None)).unwrap();
    let whole = metrics(&out);
    for f in ["ckpt-4.safetensors", "final.safetensors"] {
        std::fs::remove_file(out.join(f)).unwrap();
    }
    let mut text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.push_str("{\"step\":6,\"lo");
    std::fs::write(out.join("metrics.jsonl"), text).unwrap();
    std::fs::write(out.join(".ckpt-8.safetensors.tmp"), b"partial").unwrap();
    train_spec(&spec, Device::Reference, &opts(&out, Some(out.join("ckpt-2.safetensors")))).unwrap();
    assert_eq!(metrics(&out), whole);
    assert!(!out.join(".ckpt-8.safetensors.tmp").exists());
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn keep_last_keeps_the_newest_step_checkpoints() {
    let out = temp_dir("keep");
    let mut spec = tiny_spec(5);
    spec.train.checkpoint_every = 1;
    spec.train.keep_last = 2;
    train_spec(&spec, Device::Reference, &opts(&out, None)).unwrap();
    assert_eq!(
        files(&out),
        vec!["ckpt-4.safetensors", "ckpt-5.safetensors", "final.safetensors", "metrics.jsonl"],
        "a finished run leaves no run.lock"
    );
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn a_locked_run_folder_is_refused_naming_its_holder() {
    let out = temp_dir("lock");
    std::fs::create_dir_all(&out).unwrap();
    let holder = std::fs::File::create(out.join("run.lock")).unwrap();
    holder.try_lock().unwrap();
    std::fs::write(
        out.join("run.lock"),
        "{\"pid\":4242,\"command\":\"widen train other.ron\",\"started_unix\":0}\n",
    )
    .unwrap();
    let err = train_spec(&tiny_spec(2), Device::Reference, &opts(&out, None)).unwrap_err();
    assert!(matches!(err, TrainError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("pid 4242") && err.to_string().contains("other.ron"), "{err}");
    assert!(!out.join("metrics.jsonl").exists());
    assert!(out.join("run.lock").exists(), "the holder's lock is not removed by the refused run");
    drop(holder);
    train_spec(&tiny_spec(2), Device::Reference, &opts(&out, None)).unwrap();
    std::fs::remove_dir_all(out).unwrap();
}
