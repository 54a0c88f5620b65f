//! Whole-loss gradient checks for every residual scheme (docs/architecture.md §9.2): autodiff's
//! gradient of the training loss against central differences of the f64 reference
//! executor, for EVERY element of EVERY parameter, at tiny sizes (V = 11, D = 8, H = 2,
//! T = 5, B = 2; xHC N = 4, k = 2, m_f = 1, kernels [2, 3]).
//!
//! Parameters start from their `Init` rules and are then perturbed (±0.1·N(0, 1)), so
//! zero-initialized generators and identity-initialized mixings are checked away from
//! the points where their gradient terms vanish.
//!
//! The loss is only piecewise smooth where a hard TopK routes (xHC routing, docs/math.md
//! §6.8; MoE experts): the token window is chosen so that every TopK decision has a
//! score margin of at least [`MIN_MARGIN`] at the base point, and every finite-difference
//! evaluation must reproduce the base point's routing exactly. The row clamp of xHC
//! (docs/math.md §6.4) sits at its kink by construction (Sinkhorn ends on a row
//! normalization, so the row sums are 1), but both sides of that kink agree there
//! because the row sums are identically 1: it needs no guard.

mod common;

use common::tiny_model::{perturbed_params, random_window, tiny_spec};
use ir::autodiff::grad;
use ir::exec::{run, Value};
use ir::graph::{Graph, NodeId, Op, Region};
use ir::lower::lower;
use ir::spec::{
    AugSublayers, Collapse, EmbedMode, FcSpec, FfnSpec, Flash, GateAct, GenNorm, GhcSpec, HcSpec,
    MhcBiasInit, MhcSpec, ModelSpec, MoeSpec, MtpSpec, MupSpec, Parametrization, ProjInit, ResidualSpec,
    Router, XhcSpec,
};
use runtime::rng::Rng;
use std::collections::HashMap;

const B: usize = 2;
const T: usize = 5;
/// Central-difference step.
const STEP: f64 = 1e-5;
/// Perturbation of the initialized parameters (std).
const NOISE: f64 = 0.1;
/// Passing bound: |autodiff - central difference| <= ABS_TOL + REL_TOL·|central difference|.
const ABS_TOL: f64 = 1e-6;
const REL_TOL: f64 = 1e-5;
/// Smallest score gap between a selected and an unselected candidate of any TopK at the
/// base point. A step of 1e-5 moves scores by far less, so no decision can flip.
const MIN_MARGIN: f64 = 1e-3;

/// The forward TopK nodes of a graph with their score inputs: the only non-smooth
/// decisions of the loss. (Autodiff also builds TopKs, to route the gradient of a
/// maximum; those are not part of the loss.)
fn topk_nodes(g: &Graph) -> Vec<(NodeId, NodeId, usize, usize)> {
    g.node_ids()
        .into_iter()
        .filter(|&id| g.node(id).role.region != Region::Backward)
        .filter_map(|id| match g.node(id).op {
            Op::TopK { k, fixed } => Some((id, g.inputs(id)[0], k, fixed)),
            _ => None,
        })
        .collect()
}

/// The smallest gap, over every token of every TopK, between the lowest selected routed
/// score and the highest unselected candidate score (infinite when nothing is routed).
fn routing_margin(values: &HashMap<NodeId, Value<f64>>, topk: &[(NodeId, NodeId, usize, usize)]) -> f64 {
    let mut margin = f64::INFINITY;
    for &(idx, scores, k, fixed) in topk {
        let idx = values[&idx].as_int().expect("i32 indices");
        let scores = values[&scores].as_float().expect("float scores");
        let n = *scores.shape.dims().last().expect("scores have a last axis");
        for (row, chosen) in scores.data.chunks(n).zip(idx.data.chunks(k)) {
            let routed = &chosen[fixed..];
            let lowest_chosen = routed.iter().map(|&i| row[i as usize]).fold(f64::INFINITY, f64::min);
            let highest_other = (fixed..n)
                .filter(|j| !routed.contains(&(*j as i32)))
                .map(|j| row[j])
                .fold(f64::NEG_INFINITY, f64::max);
            margin = margin.min(lowest_chosen - highest_other);
        }
    }
    margin
}

fn param_name(g: &Graph, p: NodeId) -> String {
    match &g.node(p).op {
        Op::Param(info) => info.name.clone(),
        other => other.name().to_string(),
    }
}

/// The loss and the routing decisions at one parameter point.
fn loss_and_routing(
    g: &Graph,
    values: &HashMap<NodeId, Value<f64>>,
    loss: NodeId,
    topk: &[NodeId],
) -> (f64, Vec<Vec<i32>>) {
    let mut outputs = vec![loss];
    outputs.extend_from_slice(topk);
    let out = run::<f64>(g, values, &outputs).unwrap_or_else(|e| panic!("forward: {e}"));
    let l = out[&loss].as_float().expect("float loss").data[0];
    let routes = topk.iter().map(|id| out[id].as_int().expect("i32 indices").data.clone()).collect();
    (l, routes)
}

/// Checks d loss / d θ for every element of every parameter of `spec` and prints the
/// worst |autodiff - central difference|. Every parameter must move the loss, except
/// those named in `inert`, which must not move it at all.
fn check(spec: &ModelSpec, seed: u64, inert: &[&str]) {
    let name = &spec.name;
    let mut lowered = lower(spec, B, T).unwrap_or_else(|e| panic!("{name}: {e}"));
    let params = lowered.graph.params();
    let grads = grad(&mut lowered.graph, lowered.loss, &params).unwrap_or_else(|e| panic!("{name}: {e}"));
    let (g, loss) = (&lowered.graph, lowered.loss);
    let mut values = perturbed_params(g, seed, NOISE);
    let topk = topk_nodes(g);
    let topk_ids: Vec<NodeId> = topk.iter().map(|t| t.0).collect();

    // A token window whose routing is well away from every tie.
    let mut rng = Rng::stream(seed, "test.windows");
    let mut inspect: Vec<NodeId> = topk.iter().flat_map(|t| [t.0, t.1]).collect();
    inspect.push(loss);
    let mut margin = 0.0;
    for _ in 0..64 {
        values.insert(lowered.tokens, random_window(g, lowered.tokens, spec.vocab, &mut rng));
        let out = run::<f64>(g, &values, &inspect).unwrap_or_else(|e| panic!("{name}: forward: {e}"));
        margin = routing_margin(&out, &topk);
        if margin >= MIN_MARGIN {
            break;
        }
    }
    assert!(margin >= MIN_MARGIN, "{name}: no window with a routing margin of {MIN_MARGIN} (best {margin})");
    let (_, base_routes) = loss_and_routing(g, &values, loss, &topk_ids);

    let analytic = run::<f64>(g, &values, &grads).unwrap_or_else(|e| panic!("{name}: backward: {e}"));
    let (mut worst, mut worst_ratio, mut checked) = (0.0f64, 0.0f64, 0usize);
    let mut failures = Vec::new();
    let mut largest = 0.0f64;
    for (&p, gp) in params.iter().zip(&grads) {
        let a_all = analytic[gp].as_float().expect("float gradient").data.clone();
        let pname = param_name(g, p);
        // A constant table (the permutations of docs/math.md §12.2) is never trained: its
        // gradient is zero by construction, though the loss depends on its values.
        if matches!(&g.node(p).op, Op::Param(info) if info.class == ir::graph::ParamClass::Table) {
            assert!(a_all.iter().all(|&a| a == 0.0), "{name}: `{pname}` is a table and gets no gradient");
            continue;
        }
        let mut touches_loss = false;
        for (i, &a) in a_all.iter().enumerate() {
            let x0 = values[&p].as_float().expect("float param").data[i];
            let mut at = |x: f64| {
                let Some(Value::Float(t)) = values.get_mut(&p) else { unreachable!("float param") };
                t.data[i] = x;
                let (l, routes) = loss_and_routing(g, &values, loss, &topk_ids);
                assert!(routes == base_routes, "{name}: moving {pname}[{i}] by {STEP} changed the routing");
                l
            };
            let numeric = (at(x0 + STEP) - at(x0 - STEP)) / (2.0 * STEP);
            let Some(Value::Float(t)) = values.get_mut(&p) else { unreachable!("float param") };
            t.data[i] = x0;
            let err = (a - numeric).abs();
            let tol = ABS_TOL + REL_TOL * numeric.abs();
            if err > tol {
                failures.push(format!("{pname}[{i}]: autodiff {a:.10e}, central difference {numeric:.10e}"));
            }
            worst = worst.max(err);
            worst_ratio = worst_ratio.max(err / tol);
            largest = largest.max(numeric.abs());
            touches_loss |= numeric.abs() > 1e-9;
            checked += 1;
        }
        let expected = !inert.contains(&pname.as_str());
        assert_eq!(touches_loss, expected, "{name}: whether the loss depends on `{pname}`");
    }
    println!(
        "{name}: {checked} elements, {} params, worst |g - fd| {worst:.3e} ({:.3} of tolerance), \
         largest |fd| {largest:.3e}, routing margin {margin:.3e}",
        params.len(),
        worst_ratio
    );
    assert!(
        failures.is_empty(),
        "{name}: {} of {checked} elements disagree:\n{}",
        failures.len(),
        failures.iter().take(12).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(largest > 1e-3, "{name}: every gradient is near zero (largest {largest:e})");
}

fn hc(dynamic: bool) -> ResidualSpec {
    ResidualSpec::Hc(HcSpec { n: 4, dynamic, ..HcSpec::default() })
}

fn fc(dynamic: bool) -> ResidualSpec {
    ResidualSpec::Fc(FcSpec { m: 4, dynamic, ..FcSpec::default() })
}

fn ghc(m: usize, n: usize, dynamic: bool) -> ResidualSpec {
    ResidualSpec::Ghc(GhcSpec { m, n, dynamic, ..GhcSpec::default() })
}

fn xhc(flash: Flash, temporal_aug: AugSublayers) -> XhcSpec {
    XhcSpec { n: 4, k: 2, fixed: 1, conv_kernels: vec![2, 3], temporal_aug, flash, ..XhcSpec::default() }
}

/// In full xHC the first sublayer's active rows are equal copies of the replicated
/// embedding (docs/math.md §6.7), and a row-stochastic H_res maps equal rows to themselves
/// (docs/math.md §6.4), so that sublayer's H_res generator cannot move the loss.
const FIRST_RES: [&str; 3] =
    ["blocks.0.attn.conn.res", "blocks.0.attn.conn.b_res", "blocks.0.attn.conn.alpha_res"];

fn xhc_spec(name: &str, cfg: XhcSpec) -> ModelSpec {
    let layers = if cfg.flash == Flash::TwoBlock { 2 } else { 1 };
    ModelSpec { layers, ..tiny_spec(name, ResidualSpec::Xhc(cfg)) }
}

#[test]
fn residual() {
    check(&tiny_spec("residual", ResidualSpec::Residual), 1, &[]);
}

#[test]
fn hc_static() {
    check(&tiny_spec("hc-static", hc(false)), 2, &[]);
}

#[test]
fn hc_dynamic() {
    check(&tiny_spec("hc-dynamic", hc(true)), 3, &[]);
}

/// DHC with the other generator norm and activation (docs/math.md §2.3).
#[test]
fn hc_dynamic_rmsnorm_identity() {
    let residual = ResidualSpec::Hc(HcSpec {
        n: 3,
        gen_norm: GenNorm::RmsNorm,
        act: GateAct::Identity,
        ..HcSpec::default()
    });
    check(&tiny_spec("hc-dynamic-rms-identity", residual), 4, &[]);
}

#[test]
fn fc_static() {
    check(&tiny_spec("fc-static", fc(false)), 5, &[]);
}

#[test]
fn fc_dynamic() {
    check(&tiny_spec("fc-dynamic", fc(true)), 6, &[]);
}

#[test]
fn mhc() {
    check(&tiny_spec("mhc", ResidualSpec::Mhc(MhcSpec { n: 4, ..MhcSpec::default() })), 7, &[]);
}

/// The factorized over-width embedding E_base W_expand with U tied to E_base (docs/math.md §5.2).
#[test]
fn ghc_expand_embedding_tied() {
    let residual =
        ResidualSpec::Ghc(GhcSpec { m: 2, n: 4, embed_mode: EmbedMode::Expand, ..GhcSpec::default() });
    check(&ModelSpec { tie_embeddings: true, ..tiny_spec("ghc-expand-tied", residual) }, 22, &[]);
}

/// muP forward multipliers on the readout and the dynamic generators (docs/math.md §8.1).
#[test]
fn ghc_mup() {
    let parametrization = Parametrization::MuP(MupSpec { base_width: 4, ..MupSpec::default() });
    check(&ModelSpec { parametrization, ..tiny_spec("ghc-mup", ghc(2, 4, true)) }, 23, &[]);
}

/// mHC with the other init conventions, a read floor and a mean collapse (docs/math.md §4.4).
#[test]
fn mhc_zero_bias_xavier_mean() {
    let residual = ResidualSpec::Mhc(MhcSpec {
        n: 3,
        bias_init: MhcBiasInit::Zero,
        proj_init: ProjInit::Xavier,
        collapse: Collapse::Mean,
        pre_eps: 0.01,
        ..MhcSpec::default()
    });
    check(&tiny_spec("mhc-zero-xavier-mean", residual), 24, &[]);
}

#[test]
fn ghc_static_2_4() {
    check(&tiny_spec("ghc-static-2x4", ghc(2, 4, false)), 8, &[]);
}

#[test]
fn ghc_dynamic_2_4() {
    check(&tiny_spec("ghc-dynamic-2x4", ghc(2, 4, true)), 9, &[]);
}

#[test]
fn ghc_static_2_3() {
    check(&tiny_spec("ghc-static-2x3", ghc(2, 3, false)), 10, &[]);
}

#[test]
fn ghc_dynamic_2_3() {
    check(&tiny_spec("ghc-dynamic-2x3", ghc(2, 3, true)), 11, &[]);
}

#[test]
fn xhc_full() {
    check(&xhc_spec("xhc", xhc(Flash::None, AugSublayers::Mlp)), 12, &FIRST_RES);
}

#[test]
fn xhc_full_attention_augmented() {
    check(&xhc_spec("xhc-aug-attn", xhc(Flash::None, AugSublayers::MlpAndAttention)), 13, &FIRST_RES);
}

/// Softmax router and no Gram–Schmidt (the Muon setting, docs/math.md §6.5).
#[test]
fn xhc_softmax_router_without_gram_schmidt() {
    let cfg =
        XhcSpec { router: Router::Softmax, gram_schmidt: Some(false), ..xhc(Flash::None, AugSublayers::Mlp) };
    check(&xhc_spec("xhc-softmax-nogs", cfg), 14, &FIRST_RES);
}

/// Every active stream routed: TopK picks 2 of 4 (docs/math.md §6.2).
#[test]
fn xhc_without_fixed_streams() {
    check(
        &xhc_spec("xhc-unfixed", XhcSpec { fixed: 0, ..xhc(Flash::None, AugSublayers::Mlp) }),
        25,
        &FIRST_RES,
    );
}

#[test]
fn xhc_flash_block() {
    check(&xhc_spec("xhc-flash", xhc(Flash::Block, AugSublayers::Mlp)), 15, &[]);
}

#[test]
fn xhc_flash_block_attention_augmented() {
    check(&xhc_spec("xhc-flash-aug-attn", xhc(Flash::Block, AugSublayers::MlpAndAttention)), 16, &[]);
}

#[test]
fn xhc_flash_two_block() {
    check(&xhc_spec("xhc-flash4", xhc(Flash::TwoBlock, AugSublayers::Mlp)), 17, &[]);
}

#[test]
fn xhc_flash_two_block_attention_augmented() {
    check(&xhc_spec("xhc-flash4-aug-attn", xhc(Flash::TwoBlock, AugSublayers::MlpAndAttention)), 18, &[]);
}

#[test]
fn mtp_depth_2_on_ghc() {
    let spec = ModelSpec {
        mtp: MtpSpec { depth: 2, ..MtpSpec::default() },
        ..tiny_spec("mtp2-ghc", ghc(2, 4, true))
    };
    check(&spec, 19, &[]);
}

#[test]
fn mtp_depth_1_on_mhc() {
    let residual = ResidualSpec::Mhc(MhcSpec { n: 4, ..MhcSpec::default() });
    let spec =
        ModelSpec { mtp: MtpSpec { depth: 1, ..MtpSpec::default() }, ..tiny_spec("mtp1-mhc", residual) };
    check(&spec, 20, &[]);
}

#[test]
fn moe_on_ghc() {
    let ffn = FfnSpec::Moe(MoeSpec { experts: 4, top_k: 2, shared: 1, hidden: 4, ..MoeSpec::default() });
    check(&ModelSpec { ffn, ..tiny_spec("moe-ghc", ghc(2, 4, true)) }, 21, &[]);
}

/// The `residual` of a spec file in `specs/`: the connection language's designs are
/// shipped as spec files only (docs/connections.md).
fn spec_file_residual(file: &str) -> ResidualSpec {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs").join(file);
    ir::spec::load_spec(&path).unwrap_or_else(|e| panic!("{e}")).residual
}

/// mHC-lite (docs/math.md §12.2): the flat generator with a gain and the permutation carry.
#[test]
fn mhc_lite() {
    check(&tiny_spec("mhc-lite", spec_file_residual("mhc-lite.ron")), 30, &[]);
}

/// KromHC (docs/math.md §12.6): mHC-lite's generator with the Kronecker carry of two 2 x 2
/// factors.
#[test]
fn kromhc() {
    check(&tiny_spec("kromhc", spec_file_residual("kromhc.ron")), 37, &[]);
}

/// The wide residual with retention (docs/math.md §12.3): static sigmoid-bounded scalars,
/// a per-slot carry and a readout collapse.
#[test]
fn wide_residual() {
    check(&tiny_spec("wide-residual", spec_file_residual("wide-residual.ron")), 31, &[]);
}

/// A design only the language can write: a per-slot generator with a LayerNorm and
/// paired gates, a softmax read, a per-slot tanh carry and a sigmoid write over 3 streams.
/// The first sublayer's streams are copies of the embedding, so a convex read of them
/// is the embedding whatever its weights: its static read is inert.
#[test]
fn connection_per_slot_softmax_read_tanh_retention() {
    let text = "Connection(streams: 3, collapse: Mean, \
        generator: PerSlot(norm: LayerNorm, gate: Paired, gate_init: 0.3, act: Identity), \
        read: (init: Home(on: 2.0, off: 0.0), constraint: Softmax), \
        carry: (init: Constant(1.5), constraint: Tanh, form: PerSlot), \
        write: (init: Linspace(0.0, 1.0), constraint: Sigmoid(scale: 2.0, offset: 0.0)))";
    let spec = ir::spec::parse_spec(&format!("Model(residual: {text})"), "mix.ron").expect("parses");
    check(&tiny_spec("connection-mix", spec.residual), 32, &["blocks.0.attn.conn.h_pre"]);
}

/// Block attention residuals (docs/math.md §12.5): attention reads over the embedding,
/// the finished blocks' sums and the partial sum, and the head's read. The first sublayer
/// reads the embedding alone: a softmax over one entry is 1 whatever its query and gain.
#[test]
fn attn_residuals() {
    let spec =
        ModelSpec { layers: 2, ..tiny_spec("attn-residuals", spec_file_residual("attn-residuals.ron")) };
    check(&spec, 33, &["blocks.0.attn.history.query", "blocks.0.attn.history.norm"]);
}

/// DenseFormer (docs/math.md §12.5): static weights over the block states, the fixed
/// unit read, carry and write of the plain residual inside the blocks (tables).
#[test]
fn denseformer() {
    let spec = ModelSpec { layers: 2, ..tiny_spec("denseformer", spec_file_residual("denseformer.ron")) };
    check(&spec, 34, &[]);
}

/// A history of states beside a two-stream state with a per-slot generator: attention
/// reads after every sublayer over a dilated index set, so the first read (entry 1 alone)
/// is inert; and an MTP module over a history of outputs with static mean weights.
#[test]
fn history_of_states_with_attention_and_outputs_with_mtp() {
    let states = ir::spec::parse_spec(
        "Model(residual: Connection(streams: 2, generator: PerSlot(), \
         history: History(entries: States, block: 1, weights: Attention, dilation: 2)))",
        "states.ron",
    )
    .expect("parses");
    let spec = ModelSpec { layers: 2, ..tiny_spec("history-states", states.residual) };
    check(&spec, 35, &["blocks.0.attn.history.query", "blocks.0.attn.history.norm"]);
    let outputs = ir::spec::parse_spec(
        "Model(residual: Connection(streams: 1, history: History(block: 1, weights: Static(Mean))))",
        "outputs.ron",
    )
    .expect("parses");
    let spec = ModelSpec {
        layers: 2,
        mtp: MtpSpec { depth: 1, lambda: 0.5, ..MtpSpec::default() },
        ..tiny_spec("history-outputs-mtp", outputs.residual)
    };
    check(&spec, 36, &[]);
}
