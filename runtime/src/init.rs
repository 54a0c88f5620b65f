//! Parameter initialization: executes the `Init` rule each `Param` node
//! records (docs/math.md §1.2, §2.4, §4.4, §5.6, §6.7 decide the rules; the
//! lowering writes them into the graph, this module only draws the numbers).
//!
//! Each parameter draws from its own stream `Rng::stream(seed, name)`, so a
//! parameter's initial values depend only on the seed and its name: adding a
//! parameter elsewhere in the model, or iterating in a different order, does
//! not change them.

use crate::params::{ParamError, ParamSet};
use crate::rng::Rng;
use ir::graph::{Graph, Init, Op};

/// Errors initializing parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InitError {
    #[error(transparent)]
    Params(#[from] ParamError),
    #[error("parameter `{name}`: Values init has {got} values, its shape {shape} needs {expected}")]
    ValuesLength { name: String, got: usize, expected: usize, shape: ir::Shape },
    #[error("parameter `{name}`: Eye init needs a matrix (rank >= 2), shape is {shape}")]
    EyeRank { name: String, shape: ir::Shape },
}

/// Parameters of `graph` initialized from their recorded `Init` rules under `seed`.
pub fn init_params(graph: &Graph, seed: u64) -> Result<ParamSet, InitError> {
    let mut params = ParamSet::zeros(graph)?;
    for p in params.iter_mut() {
        let Op::Param(info) = &graph.node(p.node).op else { continue };
        let mut rng = Rng::stream(seed, &p.name);
        match &info.init {
            Init::Zeros => p.value.fill(0.0),
            Init::Ones => p.value.fill(1.0),
            Init::Constant(c) => p.value.fill(*c as f32),
            Init::Normal { std } => p.value.iter_mut().for_each(|v| *v = (std * rng.normal()) as f32),
            Init::Uniform { bound } => {
                p.value.iter_mut().for_each(|v| *v = (bound * (2.0 * rng.next_f64() - 1.0)) as f32)
            }
            Init::Eye => {
                let dims = p.shape.dims();
                if dims.len() < 2 {
                    return Err(InitError::EyeRank { name: p.name.clone(), shape: p.shape.clone() });
                }
                // Identity in the last two axes, repeated over any leading axes.
                let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
                for (i, v) in p.value.iter_mut().enumerate() {
                    let within = i % (rows * cols);
                    *v = if within / cols == within % cols { 1.0 } else { 0.0 };
                }
            }
            Init::Values(values) => {
                if values.len() != p.value.len() {
                    return Err(InitError::ValuesLength {
                        name: p.name.clone(),
                        got: values.len(),
                        expected: p.value.len(),
                        shape: p.shape.clone(),
                    });
                }
                p.value.iter_mut().zip(values).for_each(|(v, &x)| *v = x as f32);
            }
        }
    }
    Ok(params)
}
