//! What the training-loop tests share: a tiny spec, a fresh temporary run folder,
//! library-run options and the `(step, loss)` lines of a run's metrics.

use ir::spec::{AdamWSpec, ConstantSpec, ModelSpec, OptimizerSpec, ScheduleSpec};
use runtime::train::TrainOptions;
use std::path::{Path, PathBuf};

/// A one-block D = 16 model with `steps` AdamW steps at a constant rate after `warmup`.
pub fn tiny_spec(name: &str, steps: usize, eval_every: usize, warmup: usize) -> ModelSpec {
    let mut spec = ModelSpec { name: name.into(), d_model: 16, layers: 1, heads: 2, ..ModelSpec::default() };
    spec.train.seq_len = 16;
    spec.train.batch = 2;
    spec.train.steps = steps;
    spec.train.eval_every = eval_every;
    spec.train.eval_batches = 1;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup });
    spec.train.optimizer = OptimizerSpec::AdamW(AdamWSpec { lr: 1e-2, ..AdamWSpec::default() });
    spec
}

/// An empty folder `widen-<prefix>-<tag>-<pid>` under the system temp folder.
pub fn temp_dir(prefix: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("widen-{prefix}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn opts(out: &Path, resume: Option<PathBuf>) -> TrainOptions {
    TrainOptions { resume, ..TrainOptions::quiet(out.to_path_buf()) }
}

/// `(step, loss)` of every line of the metrics file at `path`.
pub fn metric_losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}
