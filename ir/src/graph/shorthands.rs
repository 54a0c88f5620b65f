//! Graph-building shorthands shared by the lowering (`crate::lower`) and the
//! derivative rules (`crate::autodiff`): one op per call, with shape and dtype
//! inferred by [`Graph::add`]. The view helpers add no node when the view would
//! be an identity (a reshape or broadcast to the same shape, a slice of a whole
//! axis), so neither the forward nor the backward graph carries no-op views.

use super::{BinaryOp, Graph, GraphError, NodeId, Op, UnaryOp};

/// Implemented by anything that owns a graph under construction.
pub trait Build {
    fn graph(&self) -> &Graph;
    fn graph_mut(&mut self) -> &mut Graph;

    /// Adds `op` over `inputs` (see [`Graph::add`]).
    fn op(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId, GraphError> {
        self.graph_mut().add(op, inputs)
    }

    fn unary(&mut self, u: UnaryOp, x: NodeId) -> Result<NodeId, GraphError> {
        self.op(Op::Unary(u), &[x])
    }

    fn binary(&mut self, b: BinaryOp, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.op(Op::Binary(b), &[x, y])
    }

    fn add(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Add, x, y)
    }

    fn sub(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Sub, x, y)
    }

    fn mul(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Mul, x, y)
    }

    fn div(&mut self, x: NodeId, y: NodeId) -> Result<NodeId, GraphError> {
        self.binary(BinaryOp::Div, x, y)
    }

    /// `mul * x + add`.
    fn affine(&mut self, x: NodeId, mul: f64, add: f64) -> Result<NodeId, GraphError> {
        self.op(Op::Affine { mul, add }, &[x])
    }

    /// `op(a) @ op(b)` with each operand optionally transposed.
    fn matmul_t(&mut self, a: NodeId, b: NodeId, trans_a: bool, trans_b: bool) -> Result<NodeId, GraphError> {
        self.op(Op::MatMul { trans_a, trans_b }, &[a, b])
    }

    fn reshape(&mut self, x: NodeId, dims: &[usize]) -> Result<NodeId, GraphError> {
        if self.graph().node(x).shape.dims() == dims {
            return Ok(x);
        }
        self.op(Op::Reshape { shape: dims.to_vec() }, &[x])
    }

    fn broadcast(&mut self, x: NodeId, dims: &[usize]) -> Result<NodeId, GraphError> {
        if self.graph().node(x).shape.dims() == dims {
            return Ok(x);
        }
        self.op(Op::Broadcast { shape: dims.to_vec() }, &[x])
    }

    fn slice(&mut self, x: NodeId, axis: usize, start: usize, end: usize) -> Result<NodeId, GraphError> {
        if start == 0 && self.graph().node(x).shape.dims().get(axis) == Some(&end) {
            return Ok(x);
        }
        self.op(Op::Slice { axis, start, end }, &[x])
    }
}
