//! The connection language's depth history (docs/math.md §12.5, docs/connections.md): a
//! list of entries that grows with depth, and reads that combine them. It wraps the
//! fixed-state lowering ([`Connection`]), which still creates the state from the embedding
//! and, for `entries: States`, carries it through every sublayer.
//!
//! ```text
//! entries: Outputs (attention residuals)       entries: States (DenseFormer)
//! v_0 = the created state                      X_0 = the created state
//! h_l = read_l(v_0 .. v_n, partial)            S'  = the fixed state's sublayer(S)
//! y_l = F_l(h_l);  partial += y_l              after every `block` sublayers: X_i = S',
//! after every `block` sublayers:                 and where p | i: S = read_i(X_j, j ≡ i mod k)
//!   v_{n+1} = partial, partial = 0
//! head: read(v_0 .. v_N, partial)              head: the fixed state's collapse
//! read(v) = Σ_i a_i v_i,  a = softmax_i(w · RMSNorm(v_i)) (Attention) or α (Static)
//! ```
//!
//! An MTP module starts a history of its own, its entry 0 being the module's fused input
//! (docs/math.md §12.5 DECISION), so a module reads no trunk entries.
//!
//! Parameter names (checkpoint keys); `{p}` is the sublayer prefix, e.g. `blocks.0.attn`:
//! `{p}.history.query` `[W]` (init 0) and `{p}.history.norm` `[W]` (init 1) with attention
//! weights, `{p}.history.weights` `[n]` with static ones, W = streams · d_model / segments
//! and n the number of entries the read combines. With `entries: Outputs` the read before
//! the head is `history.*` (`mtp.{k}.history.*` for MTP module k).

use super::connection::Connection;
use crate::graph::Build;
use crate::graph::{GraphError, Init, NodeId, Op, ParamClass};
use crate::lower::{Branch, Cx, Scheme, SublayerKind};
use crate::spec::{ConnectionSpec, DepthInit, DepthWeights, Entries, History, ModelSpec};

/// One entry of the history: its value `[B, T, s, d_s]` and, once a read with attention
/// weights has needed it, its RMS-normed key `[B, T, W]` (computed once per entry).
#[derive(Debug, Clone, Copy)]
struct Entry {
    value: NodeId,
    key: Option<NodeId>,
}

impl Entry {
    fn new(value: NodeId) -> Self {
        Entry { value, key: None }
    }
}

pub(crate) struct DepthHistory {
    /// The fixed state: creation, collapse and (`States`) every sublayer's Read, Carry, Write.
    fixed: Connection,
    history: History,
    /// The MTP module (None: the trunk) whose history `entries` holds, once one has started.
    owner: Option<Option<usize>>,
    entries: Vec<Entry>,
    /// `Outputs`: the sum of the current block's branch outputs so far.
    partial: Option<NodeId>,
    /// Sublayers since the current history started.
    done: usize,
}

impl DepthHistory {
    pub(crate) fn new(model: &ModelSpec, spec: ConnectionSpec) -> Self {
        let history = spec.history.clone().expect("a depth history design has a history");
        DepthHistory {
            fixed: Connection::new(model, spec),
            history,
            owner: None,
            entries: Vec::new(),
            partial: None,
            done: 0,
        }
    }

    /// Starts the history of the trunk or of an MTP module at its first sublayer, with the
    /// state it receives as entry 0 (the created state, or the module's fused input).
    fn start(&mut self, cx: &Cx, state: NodeId) {
        if self.owner != Some(cx.module) {
            self.owner = Some(cx.module);
            self.entries = vec![Entry::new(state)];
            self.partial = None;
            self.done = 0;
        }
    }

    /// Σ_i a_i v_i over `sources` (indices into `entries`) and, for `Outputs`, the partial
    /// sum, with the weights of the read named `prefix` (docs/math.md §12.5).
    fn read(&mut self, cx: &mut Cx, prefix: &str, sources: &[usize]) -> Result<NodeId, GraphError> {
        let partial = self.partial.map(Entry::new);
        let mut values: Vec<Entry> = sources.iter().map(|&i| self.entries[i]).collect();
        values.extend(partial);
        let n = values.len();
        let dims = cx.shape(values[0].value).to_vec();
        let (b, t, width) = (dims[0], dims[1], dims[2] * dims[3]);
        let weights: Vec<NodeId> = match self.history.weights {
            DepthWeights::Attention => {
                // w · (g ⊙ RMSNorm(v)) = (g ⊙ w) · RMSNorm(v): the gain folds into the query,
                // so each entry's key is normed once and shared by every read of it.
                let query = cx.param(
                    &format!("{prefix}.query"),
                    &[width],
                    Init::Zeros,
                    ParamClass::ConnectionProjection,
                );
                let gain = cx.param(&format!("{prefix}.norm"), &[width], Init::Ones, ParamClass::Gain);
                let q = cx.mul(gain, query)?;
                let q = cx.reshape(q, &[width, 1])?;
                let mut logits = Vec::with_capacity(n);
                for (k, entry) in values.iter_mut().enumerate() {
                    let key = match entry.key {
                        Some(key) => key,
                        None => {
                            let flat = cx.reshape(entry.value, &[b, t, width])?;
                            let key = cx.rms_norm(flat, None)?;
                            entry.key = Some(key);
                            if k < sources.len() {
                                self.entries[sources[k]].key = Some(key);
                            }
                            key
                        }
                    };
                    logits.push(cx.matmul(key, q)?);
                }
                let mut logits = cx.concat(&logits, 2)?;
                // Under muP the query reads a width-sized vector like every connection
                // generator: a 1/w forward multiplier (docs/math.md §8.1 DECISION).
                let w = cx.width_mult();
                if w != 1.0 {
                    logits = cx.affine(logits, 1.0 / w, 0.0)?;
                }
                let a = cx.g.add(Op::Softmax, &[logits])?;
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    let ai = cx.slice(a, 2, i, i + 1)?;
                    out.push(cx.reshape(ai, &[b, t, 1, 1])?);
                }
                out
            }
            DepthWeights::Static(init) => {
                let values = static_init(init, n);
                let alpha = cx.param(
                    &format!("{prefix}.weights"),
                    &[n],
                    Init::Values(values),
                    ParamClass::ConnectionStatic,
                );
                (0..n).map(|i| cx.slice(alpha, 0, i, i + 1)).collect::<Result<_, _>>()?
            }
        };
        let mut sum: Option<NodeId> = None;
        for (entry, weight) in values.iter().zip(weights) {
            let term = cx.mul(entry.value, weight)?;
            sum = Some(match sum {
                None => term,
                Some(acc) => cx.add(acc, term)?,
            });
        }
        Ok(sum.expect("a read combines at least entry 0"))
    }

    /// Every finished entry (and the partial sum): an `Outputs` read.
    fn read_all(&mut self, cx: &mut Cx, prefix: &str) -> Result<NodeId, GraphError> {
        let sources: Vec<usize> = (0..self.entries.len()).collect();
        self.read(cx, prefix, &sources)
    }
}

/// Static depth weights over `n` entries, the newest last (docs/math.md §12.5).
fn static_init(init: DepthInit, n: usize) -> Vec<f64> {
    match init {
        DepthInit::Newest => (0..n).map(|i| if i + 1 == n { 1.0 } else { 0.0 }).collect(),
        DepthInit::Ones => vec![1.0; n],
        DepthInit::Mean => vec![1.0 / n as f64; n],
    }
}

impl Scheme for DepthHistory {
    fn layout(&self) -> (usize, usize) {
        self.fixed.layout()
    }

    fn embed(&mut self, cx: &mut Cx, ids: NodeId) -> Result<NodeId, GraphError> {
        self.fixed.embed(cx, ids)
    }

    /// `Outputs`: the read of the history, the branch, and the output added to the block's
    /// partial sum. `States`: the fixed state's sublayer, then, at the end of an entry, the
    /// entry recorded and (where the period divides its index) the state replaced by the
    /// read (docs/math.md §12.5).
    fn sublayer(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        sublayer: usize,
        kind: SublayerKind,
        branch: &mut Branch,
    ) -> Result<NodeId, GraphError> {
        self.start(cx, state);
        let block = self.history.block;
        match self.history.entries {
            Entries::Outputs => {
                cx.connection(sublayer);
                let prefix = format!("{}.history", cx.sublayer_prefix(sublayer));
                let h = self.read_all(cx, &prefix)?;
                let dims = cx.shape(h).to_vec();
                let u = cx.reshape(h, &[dims[0], dims[1], dims[2] * dims[3]])?;
                let y = branch(cx, u)?;
                let y = cx.reshape(y, &dims)?;
                let sum = match self.partial {
                    Some(partial) => cx.add(partial, y)?,
                    None => y,
                };
                let sum = cx.state(sum)?;
                self.done += 1;
                if self.done.is_multiple_of(block) {
                    self.entries.push(Entry::new(sum));
                    self.partial = None;
                } else {
                    self.partial = Some(sum);
                }
                Ok(sum)
            }
            Entries::States => {
                let next = self.fixed.sublayer(cx, state, sublayer, kind, branch)?;
                self.done += 1;
                if !self.done.is_multiple_of(block) {
                    return Ok(next);
                }
                let next = cx.state(next)?;
                let i = self.entries.len();
                self.entries.push(Entry::new(next));
                if !i.is_multiple_of(self.history.period) {
                    return Ok(next);
                }
                cx.connection(sublayer);
                let prefix = format!("{}.history", cx.sublayer_prefix(sublayer));
                let k = self.history.dilation;
                let sources: Vec<usize> = (0..=i).filter(|j| j % k == i % k).collect();
                let y = self.read(cx, &prefix, &sources)?;
                cx.state(y)
            }
        }
    }

    /// `Outputs`: the head's own read of every entry (docs/math.md §12.5 DECISION).
    /// `States`: the fixed state's collapse.
    fn collapse(&mut self, cx: &mut Cx, state: NodeId, module: Option<usize>) -> Result<NodeId, GraphError> {
        match self.history.entries {
            Entries::States => self.fixed.collapse(cx, state, module),
            Entries::Outputs => {
                if self.owner != Some(module) {
                    return Err(GraphError::Invalid {
                        op: "history".into(),
                        message: format!("the depth history of {module:?} was never started"),
                    });
                }
                let prefix = match module {
                    None => "history".to_string(),
                    Some(k) => format!("mtp.{k}.history"),
                };
                let h = self.read_all(cx, &prefix)?;
                let dims = cx.shape(h).to_vec();
                cx.reshape(h, &[dims[0], dims[1], dims[2] * dims[3]])
            }
        }
    }

    /// `Outputs` has no carried state: an MTP module continues from the head's read.
    fn continued_state(
        &mut self,
        cx: &mut Cx,
        state: NodeId,
        collapsed: NodeId,
    ) -> Result<NodeId, GraphError> {
        match self.history.entries {
            Entries::States => Ok(state),
            Entries::Outputs => {
                let dims = cx.shape(collapsed).to_vec();
                cx.reshape(collapsed, &[dims[0], dims[1], 1, dims[2]])
            }
        }
    }

    fn out_proj_std_mult(&self) -> f64 {
        self.fixed.out_proj_std_mult()
    }
}

#[cfg(test)]
mod tests {
    use super::static_init;
    use crate::spec::DepthInit;

    #[test]
    fn static_inits_put_their_weight_where_documented() {
        assert_eq!(static_init(DepthInit::Newest, 3), vec![0.0, 0.0, 1.0]);
        assert_eq!(static_init(DepthInit::Ones, 2), vec![1.0, 1.0]);
        assert_eq!(static_init(DepthInit::Mean, 4), vec![0.25; 4]);
        assert_eq!(static_init(DepthInit::Newest, 1), vec![1.0]);
    }
}
