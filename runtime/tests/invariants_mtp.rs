//! MTP alignment (docs/math.md §9.2.6, §7.1), checked by behaviour on the f64 reference
//! executor: module k at position i consumes Emb(t_{i+k}) and the module k − 1 hidden
//! state at position i, attends causally, and its loss target is t_{i+k+1}; the last k
//! positions have no module-k prediction, and L^k averages over exactly T − k positions.
//!
//! Positions and window indices are 0-based here: the window is w[0..=T], the main head
//! at position i reads w[0..=i] and predicts w[i + 1]; module k at position i
//! (0 <= i < T − k) reads w[0..=i + k] and predicts w[i + k + 1].

mod common;

use common::tiny_model::{perturbed_params, random_window, tiny_spec};
use ir::exec::{run, Value};
use ir::graph::{Graph, NodeId, Op};
use ir::lower::{lower, Lowered};
use ir::spec::{GhcSpec, MhcSpec, ModelSpec, MtpSpec, ResidualSpec, XhcSpec};
use runtime::rng::Rng;
use std::collections::HashMap;

const B: usize = 2;
const T: usize = 6;

/// A module's loss node and the logits and targets it reads.
struct Head {
    loss: NodeId,
    logits: NodeId,
    targets: NodeId,
}

/// The main head (k = 0) and every MTP module head (k = 1..=K), found through the
/// graph outputs `loss_main` and `loss_mtp{k}`.
fn heads(g: &Graph, depth: usize) -> Vec<Head> {
    let names = std::iter::once("loss_main".to_string()).chain((1..=depth).map(|k| format!("loss_mtp{k}")));
    names
        .map(|name| {
            let loss = g.output(&name).unwrap_or_else(|| panic!("no output {name}"));
            assert!(matches!(g.node(loss).op, Op::SoftmaxCrossEntropy), "{name} is not a cross-entropy");
            let inputs = g.inputs(loss);
            Head { loss, logits: inputs[0], targets: inputs[1] }
        })
        .collect()
}

fn mtp_spec(name: &str, residual: ResidualSpec, depth: usize) -> ModelSpec {
    ModelSpec { mtp: MtpSpec { depth, ..MtpSpec::default() }, ..tiny_spec(name, residual) }
}

/// The three MTP settings checked: depth 2 on GHC (the VWN head, docs/math.md §5.7), depth 1
/// on mHC and on xHC (the replicated-stream form, docs/math.md §7.2).
fn specs() -> Vec<ModelSpec> {
    vec![
        mtp_spec("mtp2-ghc", ResidualSpec::Ghc(GhcSpec { m: 2, n: 4, ..GhcSpec::default() }), 2),
        mtp_spec("mtp1-mhc", ResidualSpec::Mhc(MhcSpec { n: 4, ..MhcSpec::default() }), 1),
        mtp_spec(
            "mtp1-xhc",
            ResidualSpec::Xhc(XhcSpec {
                n: 4,
                k: 2,
                fixed: 1,
                conv_kernels: vec![2, 3],
                ..XhcSpec::default()
            }),
            1,
        ),
    ]
}

/// A lowered spec with perturbed parameters and a random window bound.
struct Fixture {
    spec: ModelSpec,
    lowered: Lowered,
    values: HashMap<NodeId, Value<f64>>,
    rng: Rng,
}

impl Fixture {
    fn new(spec: ModelSpec, seed: u64) -> Fixture {
        let lowered = lower(&spec, B, T).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        let mut values = perturbed_params(&lowered.graph, seed, 0.1);
        let mut rng = Rng::stream(seed, "test.windows");
        values.insert(lowered.tokens, random_window(&lowered.graph, lowered.tokens, spec.vocab, &mut rng));
        Fixture { spec, lowered, values, rng }
    }

    fn window(&self) -> Vec<i32> {
        self.values[&self.lowered.tokens].as_int().expect("i32 tokens").data.clone()
    }

    fn set_window(&mut self, w: Vec<i32>) {
        let Some(Value::Int(t)) = self.values.get_mut(&self.lowered.tokens) else {
            unreachable!("i32 tokens")
        };
        t.data = w;
    }

    /// Sets every element of the named parameter to `value`.
    fn set_param(&mut self, name: &str, value: f64) {
        let id = self.lowered.graph.param_by_name(name).unwrap_or_else(|| panic!("no parameter {name}"));
        let Some(Value::Float(t)) = self.values.get_mut(&id) else { unreachable!("float param") };
        t.data.iter_mut().for_each(|v| *v = value);
    }

    /// The window with the token at (batch row `b`, index `j`) replaced by another one.
    fn changed_at(&mut self, b: usize, j: usize) -> Vec<i32> {
        let mut w = self.window();
        let v = self.spec.vocab as i32;
        let at = b * (T + 1) + j;
        w[at] = (w[at] + 1 + self.rng.below(v as u64 - 1) as i32) % v;
        w
    }

    fn eval(&self, nodes: &[NodeId]) -> HashMap<NodeId, Value<f64>> {
        run::<f64>(&self.lowered.graph, &self.values, nodes)
            .unwrap_or_else(|e| panic!("{}: {e}", self.spec.name))
    }

    /// Logits `[B, len, V]` of every head, as one row of V per (batch, position).
    fn logits(&self, heads: &[Head]) -> Vec<Vec<f64>> {
        let ids: Vec<NodeId> = heads.iter().map(|h| h.logits).collect();
        let out = self.eval(&ids);
        ids.iter().map(|id| out[id].as_float().expect("float logits").data.clone()).collect()
    }
}

/// Per-position cross-entropy −log softmax(z)[t] for logits rows `[rows, V]`.
fn per_position_ce(logits: &[f64], targets: &[i32], vocab: usize) -> Vec<f64> {
    logits
        .chunks(vocab)
        .zip(targets)
        .map(|(z, &t)| {
            let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + z.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
            lse - z[t as usize]
        })
        .collect()
}

/// Module k's targets are w[k + 1..=T] per row, its logits cover the T − k valid positions,
/// and L^k is the mean of the per-position losses over exactly those positions; the total
/// is L_main + λ/K Σ_k L^k (docs/math.md §7.1 DECISION: normalized by T − k).
#[test]
fn module_targets_are_shifted_by_k_and_the_loss_averages_over_t_minus_k_positions() {
    for (seed, spec) in specs().into_iter().enumerate() {
        let fx = Fixture::new(spec, seed as u64);
        let (name, v, depth) = (fx.spec.name.clone(), fx.spec.vocab, fx.spec.mtp.depth);
        let hs = heads(&fx.lowered.graph, depth);
        let mut nodes: Vec<NodeId> = hs.iter().flat_map(|h| [h.loss, h.logits, h.targets]).collect();
        nodes.push(fx.lowered.loss);
        let out = fx.eval(&nodes);
        let w = fx.window();
        let mut weighted = 0.0;
        for (k, h) in hs.iter().enumerate() {
            let len = T - k;
            assert_eq!(
                fx.lowered.graph.node(h.logits).shape.dims(),
                [B, len, v],
                "{name}: module {k} logits"
            );
            let targets = out[&h.targets].as_int().expect("i32 targets").data.clone();
            let expected: Vec<i32> =
                (0..B).flat_map(|b| w[b * (T + 1) + k + 1..(b + 1) * (T + 1)].to_vec()).collect();
            assert_eq!(targets, expected, "{name}: module {k} targets");
            let ce = per_position_ce(&out[&h.logits].as_float().expect("logits").data, &targets, v);
            assert_eq!(ce.len(), B * len);
            let mean = ce.iter().sum::<f64>() / (B * len) as f64;
            let loss = out[&h.loss].as_float().expect("float loss").data[0];
            assert!(
                (loss - mean).abs() <= 1e-12 * mean.abs(),
                "{name}: L^{k} = {loss}, mean over T - k = {mean}"
            );
            // Normalizing by T instead would be off by the factor (T - k) / T.
            if k > 0 {
                let by_t = ce.iter().sum::<f64>() / (B * T) as f64;
                assert!((loss - by_t).abs() > 1e-6, "{name}: L^{k} is normalized by T");
                weighted += fx.spec.mtp.lambda / depth as f64 * loss;
            }
        }
        let total = out[&fx.lowered.loss].as_float().expect("float loss").data[0];
        let main = out[&hs[0].loss].as_float().expect("float loss").data[0];
        assert!((total - (main + weighted)).abs() <= 1e-12 * total.abs(), "{name}: total loss {total}");
    }
}

/// Which (batch, position) rows of each head's logits differ between two evaluations,
/// bitwise.
fn moved_rows(before: &[Vec<f64>], after: &[Vec<f64>], vocab: usize) -> Vec<Vec<bool>> {
    before
        .iter()
        .zip(after)
        .map(|(a, b)| a.chunks(vocab).zip(b.chunks(vocab)).map(|(x, y)| x != y).collect())
        .collect()
}

/// Changes one token w[j] at a time and checks which logits move: head k at position i
/// must move exactly when j <= i + k (it reads w[0..=i + k] and nothing later) and only in
/// the batch row that changed. The unmoved rows must be bit-identical.
fn check_dependencies(fx: &mut Fixture, reads: impl Fn(usize, usize, usize) -> bool, what: &str) {
    let (name, v, depth) = (fx.spec.name.clone(), fx.spec.vocab, fx.spec.mtp.depth);
    let hs = heads(&fx.lowered.graph, depth);
    let base_window = fx.window();
    let base = fx.logits(&hs);
    for b in 0..B {
        for j in 0..=T {
            let changed = fx.changed_at(b, j);
            fx.set_window(changed);
            let moved = moved_rows(&base, &fx.logits(&hs), v);
            fx.set_window(base_window.clone());
            for (k, rows) in moved.iter().enumerate() {
                for (row, &m) in rows.iter().enumerate() {
                    let (rb, i) = (row / (T - k), row % (T - k));
                    let expected = rb == b && reads(k, i, j);
                    assert_eq!(
                        m, expected,
                        "{name} ({what}): head {k}, batch {rb}, position {i}, changed w[{j}] of batch {b}: \
                         moved {m}, expected {expected}"
                    );
                }
            }
        }
    }
}

/// Module k at position i reads w[0..=i + k]: the trunk's causal prefix plus Emb(t_{i+k}).
/// The last token w[T] is only ever a target, so no logits move when it changes.
#[test]
fn module_k_at_position_i_reads_exactly_the_tokens_up_to_i_plus_k() {
    for (seed, spec) in specs().into_iter().enumerate() {
        let mut fx = Fixture::new(spec, 10 + seed as u64);
        check_dependencies(&mut fx, |k, i, j| j <= i + k, "full model");
    }
}

/// Separates the two inputs of a module by zeroing one of its input norm gains.
/// Without the embedding input (emb_norm = 0 in every module) each module at position i
/// reads only the hidden state h^{k−1} at positions <= i, so w[0..=i]: the hidden state is
/// not shifted. Without module k's hidden input (hidden_norm = 0) it reads only
/// Emb(t_{i'+k}) for i' <= i, so w[k..=i + k]: the embedding is shifted by exactly k.
#[test]
fn module_inputs_are_the_hidden_at_i_and_the_embedding_of_t_i_plus_k() {
    for (seed, spec) in specs().into_iter().enumerate() {
        let depth = spec.mtp.depth;
        let mut fx = Fixture::new(spec.clone(), 20 + seed as u64);
        for k in 1..=depth {
            fx.set_param(&format!("mtp.{k}.emb_norm"), 0.0);
        }
        check_dependencies(&mut fx, |_, i, j| j <= i, "no embedding input");

        for k in 1..=depth {
            let mut fx = Fixture::new(spec.clone(), 30 + seed as u64);
            fx.set_param(&format!("mtp.{k}.hidden_norm"), 0.0);
            // Heads other than k keep both inputs; module k' > k chains on module k's hidden.
            check_dependencies(
                &mut fx,
                |head, i, j| match head {
                    h if h < k => j <= i + h,
                    h if h == k => (k..=i + k).contains(&j),
                    h => (k..=i + h).contains(&j),
                },
                &format!("no hidden input to module {k}"),
            );
        }
    }
}
