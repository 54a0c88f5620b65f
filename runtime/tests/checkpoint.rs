//! Checkpoint round trip and error reporting.

use ir::graph::{Graph, Init, Op, ParamClass, ParamInfo};
use ir::spec::{ModelSpec, MuonSpec, OptimizerSpec};
use ir::{DType, Shape};
use runtime::checkpoint::{self, Checkpoint, CheckpointError, TrainState};
use runtime::init::init_params;
use runtime::optim::Optimizer;
use runtime::params::ParamSet;
use std::path::PathBuf;

fn graph(extra: Option<(&str, Vec<usize>)>, wq_dims: Vec<usize>) -> Graph {
    let mut g = Graph::new();
    let mut add = |name: &str, dims: Vec<usize>, init: Init, class: ParamClass| {
        let info = ParamInfo { name: name.into(), init, class };
        g.add_source(Op::Param(info), Shape::new(dims), DType::F32, None);
    };
    add("embed", vec![8, 4], Init::Normal { std: 0.02 }, ParamClass::Embedding);
    add("blocks.0.attn.wq", wq_dims, Init::Normal { std: 0.02 }, ParamClass::Hidden);
    add("blocks.0.attn_norm", vec![4], Init::Ones, ParamClass::Gain);
    if let Some((name, dims)) = extra {
        add(name, dims, Init::Zeros, ParamClass::Gain);
    }
    g
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("widen-ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn muon_spec() -> ModelSpec {
    let mut spec = ModelSpec::default();
    spec.train.optimizer = OptimizerSpec::Muon(MuonSpec::default());
    spec
}

/// Params and optimizer after two steps with arbitrary gradients.
fn trained(spec: &ModelSpec, g: &Graph) -> (ParamSet, Optimizer) {
    let mut params = init_params(g, 5).unwrap();
    let mut opt = Optimizer::new(spec, &params);
    for k in 0..2 {
        let grads: Vec<Vec<f32>> = params
            .iter()
            .map(|p| (0..p.value.len()).map(|i| ((i + k) as f32 * 0.37).sin()).collect())
            .collect();
        opt.step(&mut params, &grads, 1.0);
    }
    (params, opt)
}

#[test]
fn round_trip_restores_params_optimizer_and_state() {
    let dir = temp_dir("roundtrip");
    let spec = muon_spec();
    let g = graph(None, vec![4, 4]);
    let (params, opt) = trained(&spec, &g);
    let state =
        TrainState { step: 2, sampler: runtime::data::SamplerState::Random([1, u64::MAX, 3, 0xDEAD_BEEF]) };
    let path = dir.join("ckpt-2.safetensors");
    checkpoint::save(&path, &spec, &params, Some(&opt), &state).unwrap();

    let ckpt = Checkpoint::read(&path).unwrap();
    assert_eq!(ckpt.spec, spec);
    assert_eq!(ckpt.state, state);
    ckpt.check_spec(&spec).unwrap();
    let mut restored = init_params(&g, 99).unwrap();
    assert_ne!(restored, params);
    ckpt.restore_params(&mut restored).unwrap();
    assert_eq!(restored, params);
    let mut fresh = Optimizer::new(&spec, &restored);
    ckpt.restore_optimizer(&mut fresh).unwrap();
    assert_eq!(fresh, opt);
    // Saving over an existing checkpoint leaves no temporary file behind.
    checkpoint::save(&path, &spec, &params, Some(&opt), &state).unwrap();
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["ckpt-2.safetensors".to_string()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_and_garbage_files_are_reported_with_their_path() {
    let dir = temp_dir("corrupt");
    let spec = ModelSpec::default();
    let g = graph(None, vec![4, 4]);
    let (params, opt) = trained(&spec, &g);
    let path = dir.join("final.safetensors");
    checkpoint::save(&path, &spec, &params, Some(&opt), &at_step_2()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let err = Checkpoint::read(&path).unwrap_err();
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("final.safetensors"), "{err}");
    std::fs::write(&path, b"not a checkpoint at all").unwrap();
    let err = Checkpoint::read(&path).unwrap_err();
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    let missing = dir.join("absent.safetensors");
    let err = Checkpoint::read(&missing).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }) && err.to_string().contains("absent.safetensors"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn another_spec_is_rejected_naming_the_difference_or_tensor() {
    let dir = temp_dir("wrongspec");
    let spec = ModelSpec::default();
    let g = graph(None, vec![4, 4]);
    let (params, opt) = trained(&spec, &g);
    let path = dir.join("ckpt.safetensors");
    checkpoint::save(&path, &spec, &params, Some(&opt), &at_step_2()).unwrap();
    let ckpt = Checkpoint::read(&path).unwrap();

    let other = ModelSpec { d_model: 128, ..spec.clone() };
    let err = ckpt.check_spec(&other).unwrap_err();
    assert!(matches!(err, CheckpointError::SpecMismatch { .. }));
    assert!(err.to_string().contains("d_model") && err.to_string().contains("ckpt.safetensors"), "{err}");
    // A longer step budget is the same run continued, not another spec.
    let mut longer = spec.clone();
    longer.train.steps += 100;
    ckpt.check_spec(&longer).unwrap();

    let mut wrong_shape = ParamSet::zeros(&graph(None, vec![4, 6])).unwrap();
    let err = ckpt.restore_params(&mut wrong_shape).unwrap_err();
    assert!(matches!(err, CheckpointError::TensorShape { .. }));
    assert!(err.to_string().contains("blocks.0.attn.wq"), "{err}");

    let mut more = ParamSet::zeros(&graph(Some(("final_norm", vec![4])), vec![4, 4])).unwrap();
    let err = ckpt.restore_params(&mut more).unwrap_err();
    assert!(matches!(err, CheckpointError::MissingTensor { .. }));
    assert!(err.to_string().contains("final_norm"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn init_is_deterministic_per_name_and_follows_the_rules() {
    let g = graph(None, vec![4, 4]);
    let a = init_params(&g, 1).unwrap();
    assert_eq!(a, init_params(&g, 1).unwrap());
    assert_ne!(a.get("embed").unwrap().value, init_params(&g, 2).unwrap().get("embed").unwrap().value);
    // A parameter's values do not depend on which other parameters exist.
    let bigger = init_params(&graph(Some(("z", vec![3])), vec![4, 4]), 1).unwrap();
    assert_eq!(a.get("blocks.0.attn.wq"), bigger.get("blocks.0.attn.wq"));
    assert!(a.get("blocks.0.attn_norm").unwrap().value.iter().all(|&v| v == 1.0));
    let embed = &a.get("embed").unwrap().value;
    let std = (embed.iter().map(|v| v * v).sum::<f32>() / embed.len() as f32).sqrt();
    assert!(std > 0.01 && std < 0.03, "std {std}");
}

/// The training state of a checkpoint two steps in, with a fresh random sampler.
fn at_step_2() -> TrainState {
    TrainState { step: 2, sampler: runtime::data::SamplerState::Random([0; 4]) }
}
