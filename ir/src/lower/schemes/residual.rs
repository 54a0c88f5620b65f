//! The plain pre-norm residual (docs/math.md §1): one slot of width D.
//! Read is the identity view, Carry + Write is h + y (docs/math.md §0.3, first row).

use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::ModelSpec;

pub(crate) struct PlainResidual {
    d: usize,
    embedding: Option<NodeId>,
}

impl PlainResidual {
    pub(crate) fn new(spec: &ModelSpec) -> Self {
        PlainResidual { d: spec.d_model, embedding: None }
    }
}

/// The V x D token embedding E ~ N(0, init_std^2), no weight decay (docs/math.md §1.2).
/// Created once and shared with MTP modules and a tied head.
pub(crate) fn embedding_table(cx: &mut Cx, slot: &mut Option<NodeId>) -> NodeId {
    if let Some(table) = *slot {
        return table;
    }
    let (v, d, std) = (cx.spec.model_vocab(), cx.spec.d_model, cx.spec.init_std);
    let table = cx.param("embed", &[v, d], Init::Normal { std }, ParamClass::Embedding);
    cx.embedding_table = Some(table);
    *slot = Some(table);
    table
}

/// Looks up token ids `[B, T']` in a table `[V, W]`, giving `[B, T', W]`.
pub(crate) fn lookup(cx: &mut Cx, table: NodeId, ids: NodeId) -> Result<NodeId, GraphError> {
    cx.g.add(Op::Gather { axis: 0 }, &[table, ids])
}

impl Scheme for PlainResidual {
    fn layout(&self) -> (usize, usize) {
        (1, self.d)
    }

    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        let table = embedding_table(cx, &mut self.embedding);
        let h = lookup(cx, table, ids)?;
        let (b, t) = (cx.shape(ids)[0], cx.shape(ids)[1]);
        cx.reshape(h, &[b, t, 1, self.d])
    }

    fn sublayer(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        sublayer: usize,
        _kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        cx.connection(sublayer);
        let dims = cx.shape(state).to_vec();
        let u = cx.reshape(state, &[dims[0], dims[1], self.d])?;
        let y = branch(cx, u)?;
        let y = cx.reshape(y, &dims)?;
        cx.add(state, y)
    }

    fn collapse(&mut self, cx: &mut Cx, state: NodeId, _module: Option<usize>) -> Result<NodeId, GraphError> {
        let dims = cx.shape(state).to_vec();
        cx.reshape(state, &[dims[0], dims[1], self.d])
    }
}
