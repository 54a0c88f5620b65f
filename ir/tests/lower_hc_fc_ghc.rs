//! HC, FC and GHC (VWN) lowering: graph well-formedness, parameter names, shapes and
//! inits, the docs/math.md parameter-count and FLOP formulas counted on the graph, and the
//! init equivalences of docs/math.md §9.2.1 on the f64 reference executor.

use ir::exec::{run, Tensor, Value};
use ir::graph::{Graph, Init, NodeId, Op, ParamClass, Region};
use ir::lower::{lower, Lowered};
use ir::spec::{
    EmbedMode, FcSpec, GenNorm, GhcSpec, HcSpec, ModelSpec, MtpSpec, MupSpec, OutProjStdMult,
    Parametrization, ReduceInit, ReduceNorm, ResidualSpec,
};
use ir::Shape;
use std::collections::HashMap;

const B: usize = 2;
const T: usize = 8;

fn tiny(residual: ResidualSpec) -> ModelSpec {
    ModelSpec { d_model: 16, layers: 2, heads: 2, vocab: 32, residual, ..ModelSpec::default() }
}

fn hc(n: usize, dynamic: bool, gen_norm: GenNorm) -> ResidualSpec {
    ResidualSpec::Hc(HcSpec { n, dynamic, gen_norm, ..HcSpec::default() })
}

fn fc(m: usize, dynamic: bool) -> ResidualSpec {
    ResidualSpec::Fc(FcSpec { m, dynamic, ..FcSpec::default() })
}

fn ghc(m: usize, n: usize, dynamic: bool) -> GhcSpec {
    GhcSpec { m, n, dynamic, ..GhcSpec::default() }
}

fn lowered(spec: &ModelSpec) -> Lowered {
    let low = lower(spec, B, T).unwrap_or_else(|e| panic!("{}: {e}", spec.residual.kind_name()));
    low.graph.check().unwrap();
    low
}

fn param<'g>(graph: &'g Graph, name: &str) -> (&'g [usize], &'g Init, ParamClass) {
    let id = graph.param_by_name(name).unwrap_or_else(|| panic!("no parameter {name}"));
    let node = graph.node(id);
    match &node.op {
        Op::Param(p) => (node.shape.dims(), &p.init, p.class),
        _ => unreachable!("param_by_name returns parameters"),
    }
}

/// Parameters whose name starts with `prefix`, summed.
fn param_count(graph: &Graph, prefix: &str) -> usize {
    graph
        .params()
        .into_iter()
        .filter(|&id| matches!(&graph.node(id).op, Op::Param(p) if p.name.starts_with(prefix)))
        .map(|id| graph.node(id).shape.numel())
        .sum()
}

/// Connection FLOPs of one trunk sublayer per token, in the docs/math.md §5.9 convention:
/// 2 per multiply-add of every MatMul, 4 per element of every RmsNorm.
fn connection_flops_per_token(graph: &Graph, sublayer: usize) -> f64 {
    let mut flops = 0usize;
    for id in graph.node_ids() {
        let node = graph.node(id);
        let role = node.role;
        if role.region != Region::Connection || role.sublayer != Some(sublayer) || role.mtp.is_some() {
            continue;
        }
        match node.op {
            Op::MatMul { trans_a, .. } => {
                let a = graph.node(graph.inputs(id)[0]).shape.dims().to_vec();
                let k = if trans_a { a[a.len() - 2] } else { a[a.len() - 1] };
                flops += 2 * node.shape.numel() * k;
            }
            Op::RmsNorm { .. } => flops += 4 * node.shape.numel(),
            _ => {}
        }
    }
    flops as f64 / (B * T) as f64
}

#[test]
fn every_variant_lowers_with_and_without_mtp() {
    let mut variants = vec![
        hc(4, false, GenNorm::LayerNorm),
        hc(4, true, GenNorm::LayerNorm),
        hc(3, true, GenNorm::RmsNorm),
        fc(4, false),
        fc(4, true),
        fc(1, true),
    ];
    for (m, n) in [(1, 1), (2, 3), (2, 4), (4, 16), (8, 64)] {
        variants.push(ResidualSpec::Ghc(ghc(m, n, true)));
        variants.push(ResidualSpec::Ghc(ghc(m, n, false)));
    }
    variants.push(ResidualSpec::Ghc(GhcSpec { embed_mode: EmbedMode::Expand, ..ghc(2, 4, true) }));
    variants.push(ResidualSpec::Ghc(GhcSpec { reduce_init: ReduceInit::Normal, ..ghc(2, 4, true) }));
    for residual in variants {
        for depth in [0, 1] {
            let spec = ModelSpec { mtp: MtpSpec { depth, ..MtpSpec::default() }, ..tiny(residual.clone()) };
            let low = lowered(&spec);
            assert_eq!(low.graph.node(low.logits).shape.dims(), &[B, T, 32], "{residual:?}");
            if depth == 1 {
                assert!(low.graph.output("loss_mtp1").is_some(), "{residual:?}");
            }
        }
    }
}

#[test]
fn hc_parameters_have_documented_names_shapes_and_inits() {
    let spec = tiny(hc(3, true, GenNorm::LayerNorm));
    let low = lowered(&spec);
    let g = &low.graph;
    assert_eq!(param(g, "embed").0, &[32, 16]);
    // Home stream e_{l mod n} rotates with the global sublayer index (docs/math.md §2.4).
    for (l, name) in ["blocks.0.attn", "blocks.0.ffn", "blocks.1.attn", "blocks.1.ffn"].iter().enumerate() {
        let (dims, init, class) = param(g, &format!("{name}.conn.h_pre"));
        assert_eq!(dims, &[1, 3]);
        assert_eq!(class, ParamClass::ConnectionStatic);
        let mut expected = vec![0.0; 3];
        expected[l % 3] = 1.0;
        assert_eq!(init, &Init::Values(expected), "{name}");
    }
    let p = "blocks.1.ffn.conn";
    assert_eq!(param(g, &format!("{p}.h_res")), (&[3, 3][..], &Init::Eye, ParamClass::ConnectionStatic));
    assert_eq!(param(g, &format!("{p}.h_post")), (&[3, 1][..], &Init::Ones, ParamClass::ConnectionStatic));
    assert_eq!(param(g, &format!("{p}.norm")), (&[16][..], &Init::Ones, ParamClass::Gain));
    assert_eq!(param(g, &format!("{p}.norm_bias")), (&[16][..], &Init::Zeros, ParamClass::Gain));
    let proj = ParamClass::ConnectionProjection;
    assert_eq!(param(g, &format!("{p}.w_alpha")), (&[16, 4][..], &Init::Zeros, proj));
    assert_eq!(param(g, &format!("{p}.w_beta")), (&[16, 1][..], &Init::Zeros, proj));
    let s = Init::Constant(0.01);
    assert_eq!(param(g, &format!("{p}.s_alpha")), (&[1][..], &s, ParamClass::ConnectionStatic));
    assert_eq!(param(g, &format!("{p}.s_beta")), (&[1][..], &s, ParamClass::ConnectionStatic));
}

#[test]
fn hc_output_projection_std_follows_the_sqrt_n_knob() {
    // Base std: init_std / sqrt(2L) (docs/math.md §1.2), then the HC multiplier (§2.4).
    let base = 0.02 / 2.0;
    for (mult, factor) in
        [(OutProjStdMult::One, 1.0), (OutProjStdMult::InvSqrtN, 0.5), (OutProjStdMult::SqrtN, 2.0)]
    {
        let spec = tiny(ResidualSpec::Hc(HcSpec { n: 4, out_proj_std_mult: mult, ..HcSpec::default() }));
        let low = lowered(&spec);
        for name in ["blocks.0.attn.wo", "blocks.1.ffn.w2"] {
            match param(&low.graph, name).1 {
                Init::Normal { std } => {
                    assert!((std - base * factor).abs() < 1e-15, "{mult:?} {name}: {std}")
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}

#[test]
fn fc_parameters_have_documented_names_and_shapes() {
    let low = lowered(&tiny(fc(4, true)));
    let g = &low.graph;
    let p = "blocks.0.attn.conn";
    assert_eq!(param(g, &format!("{p}.h_pre")).0, &[4, 4]);
    assert_eq!(param(g, &format!("{p}.h_res")).0, &[4, 4]);
    assert_eq!(param(g, &format!("{p}.h_post")).0, &[4, 1]);
    assert_eq!(param(g, &format!("{p}.norm")).0, &[4]);
    assert_eq!(param(g, &format!("{p}.w_alpha")).0, &[4, 8]);
    assert_eq!(param(g, &format!("{p}.w_beta")).0, &[4, 1]);
    assert!(g.param_by_name("embed_wide").is_none());
}

#[test]
fn ghc_parameters_have_documented_names_shapes_and_inits() {
    let spec = tiny(ResidualSpec::Ghc(ghc(2, 3, true)));
    let low = lowered(&spec);
    let g = &low.graph;
    assert_eq!(param(g, "embed_wide"), (&[32, 24][..], &Init::Normal { std: 0.02 }, ParamClass::Embedding));
    let p = "blocks.0.ffn.conn";
    let stat = ParamClass::ConnectionStatic;
    assert_eq!(param(g, &format!("{p}.h_pre")), (&[2, 3][..], &Init::Eye, stat));
    assert_eq!(param(g, &format!("{p}.h_res")), (&[3, 3][..], &Init::Eye, stat));
    // B = [[1, 0, 1], [0, 1, 0]] (cyclic, docs/math.md §5.6) stored output-major as B^T [3, 2].
    let cyclic = Init::Values(vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    assert_eq!(param(g, &format!("{p}.h_post")), (&[3, 2][..], &cyclic, stat));
    assert_eq!(param(g, &format!("{p}.norm")), (&[8][..], &Init::Ones, ParamClass::Gain));
    let proj = ParamClass::ConnectionProjection;
    assert_eq!(param(g, &format!("{p}.w_alpha")), (&[8, 5][..], &Init::Zeros, proj));
    assert_eq!(param(g, &format!("{p}.w_beta")), (&[8, 2][..], &Init::Zeros, proj));
    let one = Init::Constant(1.0);
    assert_eq!(param(g, &format!("{p}.s_pre")), (&[2, 3][..], &one, stat));
    assert_eq!(param(g, &format!("{p}.s_res")), (&[3, 3][..], &one, stat));
    assert_eq!(param(g, &format!("{p}.s_post")), (&[3, 2][..], &one, stat));
    // r = 1.5: no GroupNorm by default (docs/math.md §5.2); block-identity W_reduce [D', D].
    assert!(g.param_by_name("reduce.norm").is_none());
    assert_eq!(param(g, "reduce.w"), (&[24, 16][..], &Init::Eye, ParamClass::Hidden));
}

#[test]
fn ghc_mtp_owns_its_group_norm_and_shares_w_reduce() {
    let spec = ModelSpec {
        mtp: MtpSpec { depth: 2, ..MtpSpec::default() },
        ..tiny(ResidualSpec::Ghc(ghc(2, 4, true)))
    };
    let low = lowered(&spec);
    let g = &low.graph;
    for prefix in ["reduce", "mtp.1.reduce", "mtp.2.reduce"] {
        assert_eq!(param(g, &format!("{prefix}.norm")), (&[32][..], &Init::Ones, ParamClass::Gain));
        assert_eq!(param(g, &format!("{prefix}.norm_bias")), (&[32][..], &Init::Zeros, ParamClass::Gain));
    }
    let reduce: Vec<NodeId> = g
        .params()
        .into_iter()
        .filter(|&id| matches!(&g.node(id).op, Op::Param(p) if p.name.contains("reduce.w")))
        .collect();
    assert_eq!(reduce.len(), 1, "W_reduce is created once");
    // Used by the trunk's collapse and by each module's collapse.
    assert_eq!(g.users(reduce[0]).len(), 3);
    let groups: Vec<usize> = g
        .node_ids()
        .into_iter()
        .filter_map(|id| match g.node(id).op {
            Op::GroupNorm { groups, .. } => Some(groups),
            _ => None,
        })
        .collect();
    assert_eq!(groups, vec![2, 2, 2], "r = n/m groups of size D");
}

#[test]
fn ghc_expand_embedding_is_tieable() {
    let residual = ResidualSpec::Ghc(GhcSpec { embed_mode: EmbedMode::Expand, ..ghc(2, 4, true) });
    let spec = ModelSpec { tie_embeddings: true, ..tiny(residual) };
    let low = lowered(&spec);
    let g = &low.graph;
    assert_eq!(param(g, "embed"), (&[32, 16][..], &Init::Normal { std: 0.02 }, ParamClass::Embedding));
    assert_eq!(param(g, "embed_expand"), (&[16, 32][..], &Init::Normal { std: 0.25 }, ParamClass::Hidden));
    assert!(g.param_by_name("embed_wide").is_none());
    assert!(g.param_by_name("unembed").is_none(), "the head reuses E_base");
    let embed = g.param_by_name("embed").unwrap();
    assert!(g.users(embed).iter().any(|&(u, _)| g.node(u).role.region == Region::Head));
}

#[test]
fn connection_parameter_counts_match_math_formulas() {
    let d = 16;
    let count = |residual: ResidualSpec| param_count(&lowered(&tiny(residual)).graph, "blocks.1.attn.conn.");
    for n in [1, 2, 4] {
        // docs/math.md §2.4: SHC n(n+2); DHC |θ_norm| + D(n+2) + n(n+2) + 2.
        assert_eq!(count(hc(n, false, GenNorm::LayerNorm)), n * (n + 2), "SHC n = {n}");
        assert_eq!(count(hc(n, true, GenNorm::LayerNorm)), 2 * d + d * (n + 2) + n * (n + 2) + 2);
        assert_eq!(count(hc(n, true, GenNorm::RmsNorm)), d + d * (n + 2) + n * (n + 2) + 2);
    }
    for m in [1, 2, 4] {
        // docs/math.md §3: SFC m(2m+1); DFC D/m + (D/m)(2m+1) + m(2m+1) + 2.
        let df = d / m;
        assert_eq!(count(fc(m, false)), m * (2 * m + 1), "SFC m = {m}");
        assert_eq!(count(fc(m, true)), df + df * (2 * m + 1) + m * (2 * m + 1) + 2, "DFC m = {m}");
    }
    for (m, n) in [(1, 1), (2, 3), (4, 16), (8, 64)] {
        // docs/math.md §5.9: (D/m)(2m+n) + D/m + 2n(2m+n).
        let db = d / m;
        let expected = db * (2 * m + n) + db + 2 * n * (2 * m + n);
        assert_eq!(count(ResidualSpec::Ghc(ghc(m, n, true))), expected, "DGHC ({m}, {n})");
    }
}

#[test]
fn ghc_connection_flops_match_math_5_9() {
    let d = 16.0;
    for (m, n, per_d) in [(2, 3, 48.0), (8, 64, 2592.0)] {
        let low = lowered(&tiny(ResidualSpec::Ghc(ghc(m, n, true))));
        for sublayer in 0..4 {
            let flops = connection_flops_per_token(&low.graph, sublayer);
            assert_eq!(flops, per_d * d, "({m}, {n}) sublayer {sublayer}");
        }
    }
    // Static GHC: width 2(m+n)(n/m)D plus depth 2nD only (no norm, no generation).
    let low = lowered(&tiny(ResidualSpec::Ghc(ghc(2, 3, false))));
    assert_eq!(connection_flops_per_token(&low.graph, 1), 15.0 * d + 6.0 * d);
}

#[test]
fn hc_connection_flops_match_math_2_6() {
    let d = 16.0;
    for n in [2usize, 4] {
        let nf = n as f64;
        // Width connection 2n(n+1)D, depth (write) 2nD as one MatMul (docs/math.md §2.6).
        let low = lowered(&tiny(hc(n, false, GenNorm::RmsNorm)));
        let stat = 2.0 * nf * (nf + 1.0) * d + 2.0 * nf * d;
        assert_eq!(connection_flops_per_token(&low.graph, 0), stat, "SHC n = {n}");
        // Plus dynamic projections 2nD(n+2) and the per-stream norm 4nD.
        let low = lowered(&tiny(hc(n, true, GenNorm::RmsNorm)));
        let dynamic = stat + 2.0 * nf * d * (nf + 2.0) + 4.0 * nf * d;
        assert_eq!(connection_flops_per_token(&low.graph, 0), dynamic, "DHC n = {n}");
    }
}

/// The pre-activation multipliers of the generators of sublayer 0 (Affine nodes).
fn generator_multipliers(graph: &Graph) -> Vec<f64> {
    graph
        .node_ids()
        .into_iter()
        .filter(|&id| {
            let role = graph.node(id).role;
            role.region == Region::Connection && role.sublayer == Some(0) && role.mtp.is_none()
        })
        .filter_map(|id| match graph.node(id).op {
            Op::Affine { mul, add: 0.0 } => Some(mul),
            _ => None,
        })
        .collect()
}

#[test]
fn generator_multipliers_follow_tau_and_mup() {
    // SP: 1/τ with τ = √d_b (docs/math.md §5.5); d_b = 64/4 = 16.
    let wide =
        |residual, parametrization| ModelSpec { d_model: 64, heads: 4, parametrization, ..tiny(residual) };
    let g = ResidualSpec::Ghc(ghc(4, 8, true));
    let low = lowered(&wide(g.clone(), Parametrization::Standard));
    assert_eq!(generator_multipliers(&low.graph), vec![0.25]);
    // muP at w = 64/16 = 4: τ_eff = √(d_b,base) · w = √4 · 4 = 8 (docs/math.md §8.1).
    let mup = Parametrization::MuP(MupSpec { base_width: 16, ..MupSpec::default() });
    let low = lowered(&wide(g, mup.clone()));
    assert_eq!(generator_multipliers(&low.graph), vec![0.125]);
    // An explicit τ is the base-width value.
    let explicit = ResidualSpec::Ghc(GhcSpec { tau: Some(3.0), ..ghc(4, 8, true) });
    let low = lowered(&wide(explicit, mup.clone()));
    assert_eq!(generator_multipliers(&low.graph), vec![1.0 / 12.0]);
    // HC and FC: a constant 1/w, emitted only under muP.
    for residual in [hc(4, true, GenNorm::LayerNorm), fc(4, true)] {
        assert!(generator_multipliers(&lowered(&wide(residual.clone(), Parametrization::Standard)).graph)
            .is_empty());
        assert_eq!(generator_multipliers(&lowered(&wide(residual, mup.clone())).graph), vec![0.25]);
    }
}

// ---------------------------------------------------------------------------------
// Init equivalences on the f64 reference executor (docs/math.md §9.2.1).

/// splitmix64: a small seeded generator for test fixtures.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Box–Muller.
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// Values for a parameter from its `Init` rule.
fn init_values(init: &Init, dims: &[usize], rng: &mut Rng) -> Vec<f64> {
    let n: usize = dims.iter().product();
    match init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Constant(c) => vec![*c; n],
        Init::Normal { std } => (0..n).map(|_| std * rng.normal()).collect(),
        Init::Uniform { bound } => (0..n).map(|_| bound * (2.0 * rng.uniform() - 1.0)).collect(),
        Init::Eye => {
            let cols = dims[dims.len() - 1];
            let rows = if dims.len() >= 2 { dims[dims.len() - 2] } else { 1 };
            (0..n).map(|k| if (k / cols) % rows == k % cols { 1.0 } else { 0.0 }).collect()
        }
        Init::Values(v) => v.clone(),
    }
}

/// Parameter values by name: `shared` wins where it holds the name, else the `Init` rule.
fn param_values(graph: &Graph, seed: u64, shared: &HashMap<String, Vec<f64>>) -> HashMap<String, Vec<f64>> {
    let mut rng = Rng(seed);
    let mut out = HashMap::new();
    for id in graph.params() {
        let node = graph.node(id);
        let Op::Param(p) = &node.op else { unreachable!() };
        let values = match shared.get(&p.name) {
            Some(v) => {
                assert_eq!(v.len(), node.shape.numel(), "{}", p.name);
                v.clone()
            }
            None => init_values(&p.init, node.shape.dims(), &mut rng),
        };
        out.insert(p.name.clone(), values);
    }
    out
}

fn token_window(vocab: usize, seed: u64) -> Vec<i32> {
    let mut rng = Rng(seed);
    (0..B * (T + 1)).map(|_| (rng.next_u64() % vocab as u64) as i32).collect()
}

/// The main-head logits for one token window.
fn logits(low: &Lowered, params: &HashMap<String, Vec<f64>>, tokens: &[i32]) -> Vec<f64> {
    let g = &low.graph;
    let mut sources: HashMap<NodeId, Value<f64>> = HashMap::new();
    sources.insert(low.tokens, Value::Int(Tensor::new(Shape::new([B, T + 1]), tokens.to_vec())));
    for id in g.params() {
        let node = g.node(id);
        let Op::Param(p) = &node.op else { unreachable!() };
        sources.insert(id, Value::Float(Tensor::from_f64(node.shape.clone(), &params[&p.name])));
    }
    let out = run::<f64>(g, &sources, &[low.logits]).unwrap();
    out[&low.logits].as_float().unwrap().to_f64()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// A model with weights large enough that every sublayer visibly changes the state.
fn exec_spec(residual: ResidualSpec) -> ModelSpec {
    ModelSpec { init_std: 0.3, norm_eps: 1e-12, out_proj_depth_scaled: false, ..tiny(residual) }
}

/// The plain residual's logits and parameter values (the baseline to compare against).
fn plain(tokens: &[i32]) -> (Vec<f64>, HashMap<String, Vec<f64>>) {
    let low = lowered(&exec_spec(ResidualSpec::Residual));
    let params = param_values(&low.graph, 7, &HashMap::new());
    (logits(&low, &params, tokens), params)
}

/// E_wide = [E | extra] row by row, so the first D coordinates of every token's
/// over-width embedding are the plain embedding.
fn widened_embedding(embed: &[f64], vocab: usize, d: usize, wide: usize, rng: &mut Rng) -> Vec<f64> {
    let mut out = Vec::with_capacity(vocab * wide);
    for row in embed.chunks_exact(d).take(vocab) {
        out.extend_from_slice(row);
        out.extend((d..wide).map(|_| 0.3 * rng.normal()));
    }
    out
}

#[test]
fn fc_at_init_equals_the_plain_residual() {
    let tokens = token_window(32, 11);
    let (reference, shared) = plain(&tokens);
    for residual in [fc(4, true), fc(2, false)] {
        let low = lowered(&exec_spec(residual.clone()));
        let params = param_values(&low.graph, 3, &shared);
        let got = logits(&low, &params, &tokens);
        assert!(max_abs_diff(&got, &reference) <= 1e-12, "{residual:?}");
    }
}

#[test]
fn hc_at_init_equals_the_plain_residual_up_to_the_final_norm_epsilon() {
    let tokens = token_window(32, 12);
    let (reference, shared) = plain(&tokens);
    let scale = reference.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for residual in
        [hc(4, true, GenNorm::LayerNorm), hc(3, true, GenNorm::RmsNorm), hc(4, false, GenNorm::LayerNorm)]
    {
        let low = lowered(&exec_spec(residual.clone()));
        let params = param_values(&low.graph, 5, &shared);
        let got = logits(&low, &params, &tokens);
        // The final RMSNorm sees n·h instead of h: the relative change is about
        // ε / (2 mean h²), about 1e-11 at ε = 1e-12 with these weights.
        let diff = max_abs_diff(&got, &reference);
        assert!(diff <= 1e-9 * scale, "{residual:?}: {diff}");
    }
}

#[test]
fn ghc_with_one_slot_equals_the_plain_residual() {
    let tokens = token_window(32, 13);
    let (reference, mut shared) = plain(&tokens);
    shared.insert("embed_wide".into(), shared["embed"].clone());
    for dynamic in [true, false] {
        let low = lowered(&exec_spec(ResidualSpec::Ghc(ghc(1, 1, dynamic))));
        let params = param_values(&low.graph, 9, &shared);
        let got = logits(&low, &params, &tokens);
        assert!(max_abs_diff(&got, &reference) <= 1e-12, "dynamic = {dynamic}");
        if dynamic {
            // The generated coefficients reach the mixing once W_alpha is non-zero.
            let mut perturbed = params.clone();
            perturbed.get_mut("blocks.0.attn.conn.w_alpha").unwrap().iter_mut().for_each(|w| *w = 0.5);
            let moved = logits(&low, &perturbed, &tokens);
            assert!(max_abs_diff(&moved, &reference) > 1e-3);
        }
    }
}

#[test]
fn ghc_first_m_slots_carry_the_plain_residual() {
    let tokens = token_window(32, 14);
    let (reference, mut shared) = plain(&tokens);
    let mut rng = Rng(21);
    let (m, n) = (2, 4);
    shared.insert("embed_wide".into(), widened_embedding(&shared["embed"], 32, 16, 16 * n / m, &mut rng));
    for dynamic in [true, false] {
        // Without GroupNorm, the block-identity W_reduce reads exactly the first m slots.
        let residual =
            ResidualSpec::Ghc(GhcSpec { reduce_norm: Some(ReduceNorm::Off), ..ghc(m, n, dynamic) });
        let low = lowered(&exec_spec(residual));
        let params = param_values(&low.graph, 17, &shared);
        let got = logits(&low, &params, &tokens);
        assert!(max_abs_diff(&got, &reference) <= 1e-12, "dynamic = {dynamic}");
        // The extra slots matter as soon as W_reduce reads them.
        let mut perturbed = params.clone();
        let w = perturbed.get_mut("reduce.w").unwrap();
        w[16 * 16] = 1.0; // row D (first extra coordinate), column 0
        let moved = logits(&low, &perturbed, &tokens);
        assert!(max_abs_diff(&moved, &reference) > 1e-3, "dynamic = {dynamic}");
    }
}
