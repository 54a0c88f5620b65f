//! Per-step statistics from the compiled devices (docs/architecture.md §7): the graph
//! outputs a trainer reads back after every training step besides the loss
//! ([`ir::lower::Lowered::statistics`]: the MoE expert loads and auxiliary loss,
//! docs/math.md §1.6).
//!
//! The compiled Plan computes them as `Output` buffers like `loss` and `logits`;
//! [`WithStatistics`] wraps a Cpu or Cuda executor and reads those buffers after each
//! training step through the executor's read-only device access, which leaves the
//! parameters and optimizer moments where they are. (The trainer's router-bias update
//! changes the host's parameter set, so the next step uploads the parameters again;
//! the moments stay on the device.)

use super::{StepError, StepExecutor, StepStats, UpdateSettings};
use crate::dist::Group;
use crate::optim::Optimizer;
use crate::params::ParamSet;

/// An executor whose Plan's named outputs can be read after a run; each
/// compiled device implements it for its executor.
pub trait ReadsOutputs: StepExecutor {
    /// The f32 values of the Plan output `name` as the last run left them.
    fn read_output(&self, name: &str) -> Result<Vec<f32>, StepError>;
}

/// `exec` reading back `statistics` after every training step, or `exec` itself when
/// there are none.
pub fn with_statistics<E: ReadsOutputs + Send + 'static>(
    exec: E,
    statistics: Vec<String>,
) -> Box<dyn StepExecutor + Send> {
    if statistics.is_empty() {
        Box::new(exec)
    } else {
        Box::new(WithStatistics { inner: exec, statistics, last: Vec::new() })
    }
}

/// A compiled executor that reads its Plan's statistics outputs after every training
/// step (see the module doc).
#[derive(Debug)]
pub struct WithStatistics<E> {
    inner: E,
    statistics: Vec<String>,
    last: Vec<Vec<f32>>,
}

impl<E: ReadsOutputs> WithStatistics<E> {
    /// Reads every statistic of the step just taken.
    fn read(&mut self) -> Result<(), StepError> {
        self.last =
            self.statistics.iter().map(|name| self.inner.read_output(name)).collect::<Result<_, _>>()?;
        Ok(())
    }
}

impl<E: ReadsOutputs> StepExecutor for WithStatistics<E> {
    fn device(&self) -> &'static str {
        self.inner.device()
    }

    fn token_shape(&self) -> [usize; 2] {
        self.inner.token_shape()
    }

    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError> {
        self.inner.loss_and_grads(params, tokens)
    }

    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError> {
        self.inner.loss(params, tokens)
    }

    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError> {
        self.inner.logits(params, tokens)
    }

    fn main_loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f64, StepError> {
        self.inner.main_loss(params, tokens)
    }

    fn train_step(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
    ) -> Result<StepStats, StepError> {
        let stats = self.inner.train_step(params, tokens, optimizer, settings)?;
        self.read()?;
        Ok(stats)
    }

    fn train_step_averaged(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
        group: &Group,
    ) -> Result<StepStats, StepError> {
        let stats = self.inner.train_step_averaged(params, tokens, optimizer, settings, group)?;
        self.read()?;
        Ok(stats)
    }

    fn sync_optimizer(&mut self, optimizer: &mut Optimizer) -> Result<(), StepError> {
        self.inner.sync_optimizer(optimizer)
    }

    fn statistics(&self) -> &[String] {
        &self.statistics
    }

    fn step_statistics(&self) -> &[Vec<f32>] {
        &self.last
    }
}
