//! The [`StepExecutor`] over a [`CpuDevice`] (DESIGN.md §7): the training
//! loop hands it host parameters and a token batch; it uploads them into the
//! Plan's persistent buffers, runs the Plan, and reads back the loss, the
//! gradients or the logits. The optimizer stays on the host (in Rust), so the
//! parameter buffers are refreshed before every run.

use super::cpu::{CpuDevice, CpuError};
use crate::executor::{StepError, StepExecutor};
use crate::params::ParamSet;
use codegen::plan::{BufferId, BufferRole, Plan};
use std::collections::HashMap;

/// The interface buffers of a training Plan, resolved by role once.
#[derive(Debug)]
struct Interface {
    tokens: BufferId,
    loss: BufferId,
    logits: Option<BufferId>,
    /// `(name, parameter buffer, gradient buffer)` of every parameter of the Plan.
    params: Vec<(String, BufferId, Option<BufferId>)>,
    /// Gradient buffer by parameter name.
    grads: HashMap<String, BufferId>,
}

impl Interface {
    fn of(plan: &Plan) -> Result<Interface, StepError> {
        let output = |name: &str| plan.find(&BufferRole::Output { name: name.into() });
        let tokens = plan
            .find(&BufferRole::Input { name: "tokens".into() })
            .ok_or(StepError::MissingOutput { what: "`tokens` input buffer" })?;
        let loss = output("loss").ok_or(StepError::MissingOutput { what: "loss" })?;
        let params = plan
            .buffers
            .iter()
            .filter_map(|b| match &b.role {
                BufferRole::Param { name } => {
                    Some((name.clone(), b.id, plan.find(&BufferRole::Grad { name: name.clone() })))
                }
                _ => None,
            })
            .collect::<Vec<_>>();
        let grads = params.iter().filter_map(|(n, _, g)| g.map(|g| (n.clone(), g))).collect();
        Ok(Interface { tokens, loss, logits: output("logits"), params, grads })
    }
}

/// Runs a compiled training Plan on the Cpu device.
#[derive(Debug)]
pub struct CpuExecutor {
    device: CpuDevice,
    io: Interface,
    token_shape: [usize; 2],
}

impl CpuExecutor {
    /// An executor over a loaded Plan with a `tokens` input of `token_shape`
    /// (`[batch, seq_len + 1]`), a `loss` output and, for training, one
    /// gradient buffer per parameter.
    pub fn new(device: CpuDevice, token_shape: [usize; 2]) -> Result<CpuExecutor, StepError> {
        let io = Interface::of(device.plan())?;
        Ok(CpuExecutor { device, io, token_shape })
    }

    /// The underlying device.
    pub fn device_ref(&self) -> &CpuDevice {
        &self.device
    }

    /// Uploads parameters and tokens, then runs the Plan once.
    fn run(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<(), StepError> {
        let expected = self.token_shape[0] * self.token_shape[1];
        if tokens.len() != expected {
            return Err(StepError::TokenCount { got: tokens.len(), expected });
        }
        for (name, buffer, _) in &self.io.params {
            let p = params.get(name).ok_or_else(|| StepError::UnknownParam { name: name.clone() })?;
            self.device.write_f32(*buffer, &p.value)?;
        }
        self.device.write_i32(self.io.tokens, tokens)?;
        self.device.run()?;
        Ok(())
    }

    fn read_loss(&self) -> Result<f32, StepError> {
        let loss = self.device.read_f32(self.io.loss)?;
        loss.first().copied().ok_or(StepError::MissingOutput { what: "loss" })
    }
}

impl StepExecutor for CpuExecutor {
    fn device(&self) -> &'static str {
        "cpu"
    }

    fn token_shape(&self) -> [usize; 2] {
        self.token_shape
    }

    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError> {
        self.run(params, tokens)?;
        let loss = self.read_loss()?;
        let mut grads = Vec::with_capacity(params.len());
        for p in params.iter() {
            // A parameter the loss does not reach has no gradient buffer: its gradient is zero.
            grads.push(match self.io.grads.get(&p.name) {
                Some(&g) => self.device.read_f32(g).map_err(StepError::from)?.to_vec(),
                None => vec![0.0; p.value.len()],
            });
        }
        Ok((loss, grads))
    }

    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError> {
        self.run(params, tokens)?;
        self.read_loss()
    }

    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError> {
        let logits = self.io.logits.ok_or(StepError::MissingOutput { what: "logits" })?;
        self.run(params, tokens)?;
        Ok(self.device.read_f32(logits).map_err(StepError::from)?.to_vec())
    }
}

impl From<CpuError> for StepError {
    fn from(e: CpuError) -> StepError {
        StepError::Cpu(Box::new(e))
    }
}
