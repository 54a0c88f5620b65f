//! The reference device: the unfused graph on the reference interpreter
//! (`ir::exec`) in f32 (docs/architecture.md §7, §9). It compiles nothing, so
//! it is the oracle the compiled devices are checked against
//! (`crate::parity`) and the device of the muP coordinate check.

use crate::params::ParamSet;
use crate::step::{check_tokens, token_shape_of, StepError, StepExecutor};
use ir::exec::{Tensor, Value};
use ir::graph::{Graph, NodeId};
use ir::lower::Lowered;
use ir::Shape;
use std::collections::HashMap;

/// Runs the unfused graph on the reference interpreter (`ir::exec`) in f32.
#[derive(Debug)]
pub struct ReferenceExecutor {
    graph: Graph,
    tokens: NodeId,
    /// The reported loss (the graph output `loss`).
    loss: NodeId,
    /// The differentiated objective: `loss`, plus the MoE auxiliary balance loss where the
    /// model has one ([`ir::lower::Lowered::loss`]).
    objective: NodeId,
    logits: NodeId,
    /// The per-step statistics read back with every gradient run, and their nodes.
    statistics: Vec<String>,
    statistic_nodes: Vec<NodeId>,
    /// Their values at the last gradient run.
    last_statistics: Vec<Vec<f32>>,
    /// Gradient nodes, appended by autodiff on the first training step (a
    /// sampling-only executor never differentiates).
    grads: Option<Vec<NodeId>>,
    token_shape: [usize; 2],
    /// The last axis of the logits: token ids must lie in `0..vocab`.
    vocab: usize,
}

impl ReferenceExecutor {
    /// An executor for a model graph: `tokens` is its i32 `[batch, seq_len + 1]`
    /// input, `loss` the scalar training loss, `logits` the main head's output.
    pub fn new(graph: Graph, tokens: NodeId, loss: NodeId, logits: NodeId) -> Self {
        let token_shape = token_shape_of(&graph, tokens);
        let vocab = graph.node(logits).shape.dims().last().copied().unwrap_or(0);
        ReferenceExecutor {
            graph,
            tokens,
            loss,
            objective: loss,
            logits,
            statistics: Vec::new(),
            statistic_nodes: Vec::new(),
            last_statistics: Vec::new(),
            grads: None,
            token_shape,
            vocab,
        }
    }

    /// An executor for the output of `ir::lower::lower`: it reports the graph output
    /// `loss`, differentiates [`Lowered::loss`] and reads back [`Lowered::statistics`]
    /// with every gradient.
    pub fn from_lowered(lowered: Lowered) -> Self {
        let reported = lowered.graph.output("loss").unwrap_or(lowered.loss);
        let (statistics, statistic_nodes) = lowered
            .statistics
            .iter()
            .filter_map(|name| lowered.graph.output(name).map(|node| (name.clone(), node)))
            .unzip();
        ReferenceExecutor {
            objective: lowered.loss,
            statistics,
            statistic_nodes,
            ..ReferenceExecutor::new(lowered.graph, lowered.tokens, reported, lowered.logits)
        }
    }

    fn sources(&self, params: &ParamSet, tokens: &[i32]) -> Result<HashMap<NodeId, Value<f32>>, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        let mut sources = HashMap::with_capacity(params.len() + 1);
        for p in params.iter() {
            sources.insert(p.node, Value::Float(Tensor::new(p.shape.clone(), p.value.clone())));
        }
        sources.insert(self.tokens, Value::Int(Tensor::new(Shape::new(self.token_shape), tokens.to_vec())));
        Ok(sources)
    }

    fn run(
        &self,
        params: &ParamSet,
        tokens: &[i32],
        outputs: &[NodeId],
    ) -> Result<HashMap<NodeId, Value<f32>>, StepError> {
        let sources = self.sources(params, tokens)?;
        Ok(ir::exec::run::<f32>(&self.graph, &sources, outputs)?)
    }
}

fn float_output(
    values: &mut HashMap<NodeId, Value<f32>>,
    node: NodeId,
    what: &'static str,
) -> Result<Vec<f32>, StepError> {
    match values.remove(&node) {
        Some(Value::Float(t)) => Ok(t.data),
        _ => Err(StepError::MissingOutput { what }),
    }
}

impl StepExecutor for ReferenceExecutor {
    fn device(&self) -> &'static str {
        "reference"
    }

    fn token_shape(&self) -> [usize; 2] {
        self.token_shape
    }

    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError> {
        let grads = match &self.grads {
            Some(g) => g.clone(),
            None => {
                let wrt: Vec<NodeId> = params.iter().map(|p| p.node).collect();
                let g = ir::autodiff::grad(&mut self.graph, self.objective, &wrt)?;
                self.grads = Some(g.clone());
                g
            }
        };
        let mut outputs = vec![self.loss];
        outputs.extend(&grads);
        outputs.extend(&self.statistic_nodes);
        let mut values = self.run(params, tokens, &outputs)?;
        let loss = float_output(&mut values, self.loss, "loss")?;
        let loss = *loss.first().ok_or(StepError::MissingOutput { what: "loss" })?;
        self.last_statistics = self
            .statistic_nodes
            .iter()
            .map(|node| match values.get(node) {
                Some(Value::Float(t)) => Ok(t.data.clone()),
                _ => Err(StepError::MissingOutput { what: "step statistic" }),
            })
            .collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(grads.len());
        for &g in &grads {
            // Several parameters may share one zero-gradient node: clone rather than remove.
            match values.get(&g) {
                Some(Value::Float(t)) => out.push(t.data.clone()),
                _ => return Err(StepError::MissingOutput { what: "gradient" }),
            }
        }
        Ok((loss, out))
    }

    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError> {
        let mut values = self.run(params, tokens, &[self.loss])?;
        let loss = float_output(&mut values, self.loss, "loss")?;
        loss.first().copied().ok_or(StepError::MissingOutput { what: "loss" })
    }

    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError> {
        let mut values = self.run(params, tokens, &[self.logits])?;
        float_output(&mut values, self.logits, "logits")
    }

    fn statistics(&self) -> &[String] {
        &self.statistics
    }

    fn step_statistics(&self) -> &[Vec<f32>] {
        &self.last_statistics
    }
}
