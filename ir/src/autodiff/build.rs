//! Small graph-building helpers the derivative rules are written with. Helpers
//! that would be identities (a reshape to the same shape, a slice of a whole axis)
//! add no node, so the backward graph stays as small as the rules allow.

use crate::graph::{BinaryOp, Graph, GraphError, NodeId, Op, ReduceOp, UnaryOp};
use crate::{DType, Shape};

/// A graph under construction by the backward sweep.
pub(super) struct Builder<'a> {
    pub g: &'a mut Graph,
}

impl Builder<'_> {
    pub fn shape(&self, id: NodeId) -> Shape {
        self.g.node(id).shape.clone()
    }

    pub fn dtype(&self, id: NodeId) -> DType {
        self.g.node(id).dtype
    }

    pub fn op(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId, GraphError> {
        self.g.add(op, inputs)
    }

    /// A constant of the given type.
    pub fn constant(&mut self, value: f64, shape: Shape, dtype: DType) -> NodeId {
        self.g.add_source(Op::Constant { value }, shape, dtype, None)
    }

    /// Zeros shaped like `like`, in its compute type (adjoints are never bf16, MATH.md §6.12).
    pub fn zeros_like(&mut self, like: NodeId) -> NodeId {
        let (shape, dtype) = (self.shape(like), self.dtype(like).compute());
        self.constant(0.0, shape, dtype)
    }

    pub fn unary(&mut self, u: UnaryOp, x: NodeId) -> Result<NodeId, GraphError> {
        self.op(Op::Unary(u), &[x])
    }

    pub fn binary(&mut self, b: BinaryOp, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.op(Op::Binary(b), &[x, y])
    }

    pub fn add(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Add, x, y)
    }

    pub fn sub(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Sub, x, y)
    }

    pub fn mul(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Mul, x, y)
    }

    pub fn div(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Div, x, y)
    }

    /// `mul * x + add`.
    pub fn affine(&mut self, x: NodeId, mul: f64, add: f64) -> Result<NodeId, GraphError> {
        self.op(Op::Affine { mul, add }, &[x])
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

    pub fn reshape(&mut self, x: NodeId, dims: &[usize]) -> Result<NodeId, GraphError> {
        if self.shape(x).dims() == dims {
            return Ok(x);
        }
        self.op(Op::Reshape { shape: dims.to_vec() }, &[x])
    }

    pub fn broadcast(&mut self, x: NodeId, dims: &[usize]) -> Result<NodeId, GraphError> {
        if self.shape(x).dims() == dims {
            return Ok(x);
        }
        self.op(Op::Broadcast { shape: dims.to_vec() }, &[x])
    }

    pub fn permute(&mut self, x: NodeId, perm: &[usize]) -> Result<NodeId, GraphError> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x);
        }
        self.op(Op::Permute { perm: perm.to_vec() }, &[x])
    }

    pub fn slice(&mut self, x: NodeId, axis: usize, start: usize, end: usize) -> Result<NodeId, GraphError> {
        if start == 0 && end == self.shape(x).dims()[axis] {
            return Ok(x);
        }
        self.op(Op::Slice { axis, start, end }, &[x])
    }

    pub fn matmul(
        &mut self,
        a: NodeId,
        b: NodeId,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<NodeId, GraphError> {
        self.op(Op::MatMul { trans_a, trans_b }, &[a, b])
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
