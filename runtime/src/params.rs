//! The trainable parameters of a model, held on the host in f32.
//!
//! Order is the graph's parameter order (insertion order of `Param` nodes), so
//! gradients, optimizer state and checkpoints line up index by index; names
//! (the graph's stable `ParamInfo::name`s) identify parameters across files.

use ir::graph::{Graph, NodeId, Op, ParamClass};
use ir::Shape;

/// One parameter: where it lives in the graph, how it is optimized, and its values.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub node: NodeId,
    pub class: ParamClass,
    pub shape: Shape,
    /// Row-major values. Matrices are stored `[in, out]` (the graph computes x @ W).
    pub value: Vec<f32>,
}

/// All parameters of a graph.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParamSet {
    params: Vec<Param>,
}

/// Errors collecting parameters from a graph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    #[error("two parameters are named `{name}`; checkpoint names must be unique")]
    DuplicateName { name: String },
    #[error(
        "parameter `{name}`: names starting with `opt.` are reserved for optimizer state in checkpoints"
    )]
    ReservedName { name: String },
    #[error("parameter `{name}` has dtype {dtype}; trainable parameters must be f32")]
    NotF32 { name: String, dtype: String },
}

impl ParamSet {
    /// Zero-filled parameters for every `Param` node of `graph`.
    pub fn zeros(graph: &Graph) -> Result<ParamSet, ParamError> {
        let mut params: Vec<Param> = Vec::new();
        for id in graph.params() {
            let node = graph.node(id);
            let Op::Param(info) = &node.op else { continue };
            if params.iter().any(|p| p.name == info.name) {
                return Err(ParamError::DuplicateName { name: info.name.clone() });
            }
            if info.name.starts_with("opt.") {
                return Err(ParamError::ReservedName { name: info.name.clone() });
            }
            if node.dtype != ir::DType::F32 {
                return Err(ParamError::NotF32 { name: info.name.clone(), dtype: node.dtype.name().into() });
            }
            params.push(Param {
                name: info.name.clone(),
                node: id,
                class: info.class,
                shape: node.shape.clone(),
                value: vec![0.0; node.shape.numel()],
            });
        }
        Ok(ParamSet { params })
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Param> {
        self.params.iter()
    }

    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Param> {
        self.params.iter_mut()
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Total number of scalars.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.value.len()).sum()
    }
}

impl std::ops::Index<usize> for ParamSet {
    type Output = Param;
    fn index(&self, i: usize) -> &Param {
        &self.params[i]
    }
}

impl std::ops::IndexMut<usize> for ParamSet {
    fn index_mut(&mut self, i: usize) -> &mut Param {
        &mut self.params[i]
    }
}
