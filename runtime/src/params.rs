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
///
/// A set carries a [`ParamVersion`]: a compiled device keeps its own copy of
/// the parameters and uploads them again only when the set it is handed is
/// another one, or has been written since (docs/architecture.md §7: parameters stay on
/// the device across steps). Every mutable access bumps the version, so no
/// write can be missed.
#[derive(Debug)]
pub struct ParamSet {
    params: Vec<Param>,
    version: ParamVersion,
}

/// Which parameter set, and how many times it has been opened for writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamVersion {
    identity: u64,
    generation: u64,
}

impl ParamVersion {
    /// A version no other set has: every set, clones included, gets its own identity.
    fn fresh() -> ParamVersion {
        ParamVersion { identity: fresh_identity(), generation: 0 }
    }
}

/// A number no earlier call returned: what tells apart the parameter sets
/// and optimizers whose contents a device holds.
pub(crate) fn fresh_identity() -> u64 {
    static NEXT_IDENTITY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT_IDENTITY.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Clone for ParamSet {
    fn clone(&self) -> ParamSet {
        ParamSet { params: self.params.clone(), version: ParamVersion::fresh() }
    }
}

/// Sets are equal when their parameters are; the version is bookkeeping.
impl PartialEq for ParamSet {
    fn eq(&self, other: &ParamSet) -> bool {
        self.params == other.params
    }
}

impl Default for ParamSet {
    fn default() -> ParamSet {
        ParamSet { params: Vec::new(), version: ParamVersion::fresh() }
    }
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
        Ok(ParamSet { params, version: ParamVersion::fresh() })
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

    /// Mutable access to every parameter; bumps the version.
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Param> {
        self.version.generation += 1;
        self.params.iter_mut()
    }

    /// The current version: equal versions mean the same set, unwritten since.
    pub fn version(&self) -> ParamVersion {
        self.version
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
    /// Bumps the version, like [`ParamSet::iter_mut`].
    fn index_mut(&mut self, i: usize) -> &mut Param {
        self.version.generation += 1;
        &mut self.params[i]
    }
}
