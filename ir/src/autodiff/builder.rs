//! Small graph-building helpers the derivative rules are written with. Helpers
//! that would be identities (a reshape to the same shape, a slice of a whole axis)
//! add no node, so the backward graph stays as small as the rules allow.

use crate::graph::{Build, Graph, GraphError, NodeId, Op, ReduceOp};
use crate::{DType, Shape};

/// A graph under construction by the backward sweep.
pub(super) struct Builder<'a> {
    pub g: &'a mut Graph,
}

impl Build for Builder<'_> {
    fn graph(&self) -> &Graph {
        self.g
    }

    fn graph_mut(&mut self) -> &mut Graph {
        self.g
    }
}

impl Builder<'_> {
    pub fn shape(&self, id: NodeId) -> Shape {
        self.g.node(id).shape.clone()
    }

    pub fn dtype(&self, id: NodeId) -> DType {
        self.g.node(id).dtype
    }

    /// A constant of the given type.
    pub fn constant(&mut self, value: f64, shape: Shape, dtype: DType) -> NodeId {
        self.g.add_source(Op::Constant { value }, shape, dtype, None)
    }

    /// Zeros shaped like `like`, in its compute type (adjoints are never bf16, docs/math.md §6.12).
    pub fn zeros_like(&mut self, like: NodeId) -> NodeId {
        let (shape, dtype) = (self.shape(like), self.dtype(like).compute());
        self.constant(0.0, shape, dtype)
    }

    /// Reduction over `axis`, keeping it as size 1 so the result broadcasts back.
    pub fn reduce_keep(&mut self, op: ReduceOp, x: NodeId, axis: usize) -> Result<NodeId, GraphError> {
        self.op(Op::Reduce { op, axis, keepdim: true }, &[x])
    }

    /// Mean over the last axis, kept as size 1.
    pub fn mean_last(&mut self, x: NodeId) -> Result<NodeId, GraphError> {
        let axis = self.shape(x).rank() - 1;
        self.reduce_keep(ReduceOp::Mean, x, axis)
    }

    /// Sum over the last axis, kept as size 1.
    pub fn sum_last(&mut self, x: NodeId) -> Result<NodeId, GraphError> {
        let axis = self.shape(x).rank() - 1;
        self.reduce_keep(ReduceOp::Sum, x, axis)
    }

    pub fn permute(&mut self, x: NodeId, perm: &[usize]) -> Result<NodeId, GraphError> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x);
        }
        self.op(Op::Permute { perm: perm.to_vec() }, &[x])
    }

    /// Sums `x` down to `target`, the inverse of NumPy broadcasting: leading axes
    /// that `target` lacks are summed away, axes where `target` has size 1 are summed
    /// and kept.
    pub fn sum_to(&mut self, x: NodeId, target: &Shape) -> Result<NodeId, GraphError> {
        let shape = self.shape(x);
        if &shape == target {
            return Ok(x);
        }
        let extra = shape.rank() - target.rank();
        let mut y = x;
        if extra > 0 {
            let lead: usize = shape.dims()[..extra].iter().product();
            let mut dims = vec![lead];
            dims.extend_from_slice(&shape.dims()[extra..]);
            y = self.reshape(y, &dims)?;
            y = self.op(Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[y])?;
        }
        for (axis, &d) in target.dims().iter().enumerate() {
            if d == 1 && self.shape(y).dims()[axis] != 1 {
                y = self.reduce_keep(ReduceOp::Sum, y, axis)?;
            }
        }
        Ok(y)
    }

    /// Routes `dy` (shaped like the reduction of `x` over `axis`, kept as size 1) to the
    /// first maximum of `x` along `axis` and zeros elsewhere. Built from `TopK` with
    /// k = 1, no fixed slots, whose ties go to the lowest index, and `ScatterAdd`.
    pub fn route_to_first_max(&mut self, x: NodeId, axis: usize, dy: NodeId) -> Result<NodeId, GraphError> {
        let rank = self.shape(x).rank();
        let mut perm: Vec<usize> = (0..rank).filter(|&a| a != axis).collect();
        perm.push(axis);
        let mut inverse = vec![0; rank];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        let xp = self.permute(x, &perm)?;
        let dyp = self.permute(dy, &perm)?;
        let idx = self.op(Op::TopK { k: 1, fixed: 0 }, &[xp])?;
        let zeros = self.zeros_like(xp);
        let routed = self.op(Op::ScatterAdd { axis: rank - 1 }, &[zeros, idx, dyp])?;
        self.permute(routed, &inverse)
    }
}
