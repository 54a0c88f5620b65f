//! The per-op cost table and the report's buckets on small hand-built graphs and specs.

use ir::cost::{cost_report, count_spec, op_cost, GraphCounts};
use ir::graph::{Graph, Init, Op, ParamClass, ParamInfo, Region, Role};
use ir::spec::{FfnSpec, ModelSpec, MoeSpec, MtpSpec, SwiGluSpec, TrainSpec};
use ir::{DType, Shape};

fn param(g: &mut Graph, name: &str, dims: &[usize]) -> ir::graph::NodeId {
    let info = ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Hidden };
    g.add_source(Op::Param(info), Shape::new(dims), DType::F32, Some(name.into()))
}

fn input(g: &mut Graph, dims: &[usize]) -> ir::graph::NodeId {
    g.add_source(Op::Input { name: "x".into() }, Shape::new(dims), DType::F32, None)
}

#[test]
fn matmul_counts_two_flops_per_mac_and_skips_parameter_reads() {
    let mut g = Graph::new();
    let x = input(&mut g, &[2, 5, 8]);
    let w = param(&mut g, "w", &[8, 3]);
    let y = g.add(Op::MatMul { trans_a: false, trans_b: false }, &[x, w]).unwrap();
    let c = op_cost(&g, y);
    assert_eq!(c.flops, 2.0 * 2.0 * 5.0 * 8.0 * 3.0);
    assert_eq!(c.flops_papers, c.flops);
    assert_eq!(c.read, 80.0, "x only, not the parameter");
    assert_eq!(c.written, 30.0);
    // Transposed operand: the contraction is over a's second-to-last axis.
    let xt = input(&mut g, &[8, 5]);
    let z = g.add(Op::MatMul { trans_a: true, trans_b: false }, &[xt, w]).unwrap();
    assert_eq!(op_cost(&g, z).flops, 2.0 * 5.0 * 8.0 * 3.0);
}

#[test]
fn views_and_scatter_rows_move_nothing() {
    let mut g = Graph::new();
    let x = input(&mut g, &[1, 4, 16, 8]);
    let r = g.add(Op::Reshape { shape: vec![1, 4, 128] }, &[x]).unwrap();
    let c = op_cost(&g, r);
    assert_eq!((c.flops, c.read, c.written), (0.0, 0.0, 0.0));
    let scores = input(&mut g, &[1, 4, 16]);
    let idx = g.add(Op::TopK { k: 4, fixed: 2 }, &[scores]).unwrap();
    let act = g.add(Op::Gather { axis: 2 }, &[x, idx]).unwrap();
    // A gather reads only the gathered rows, plus the indices.
    let gather = op_cost(&g, act);
    assert_eq!(gather.read, (4 * 4 * 8 + 4 * 4) as f64);
    assert_eq!(gather.written, (4 * 4 * 8) as f64);
    let back = g.add(Op::ScatterRows { axis: 2 }, &[x, idx, act]).unwrap();
    let c = op_cost(&g, back);
    assert_eq!((c.flops, c.read, c.written), (0.0, 0.0, 0.0));
}

#[test]
fn broadcast_reads_depend_on_which_axes_expand() {
    let mut g = Graph::new();
    // A per-token row replicated over 4 streams: every element counts (materialized state).
    let row = input(&mut g, &[1, 6, 1, 8]);
    let wide = g.add(Op::Broadcast { shape: vec![1, 6, 4, 8] }, &[row]).unwrap();
    let sum = g.add(Op::Binary(ir::graph::BinaryOp::Add), &[wide, wide]).unwrap();
    assert_eq!(op_cost(&g, sum).read, 2.0 * 192.0);
    // A small constant broadcast over the token axes counts its real elements once.
    let small = g.add_source(Op::Constant { value: 1.0 }, Shape::new([4, 4]), DType::F32, None);
    let tiled = g.add(Op::Broadcast { shape: vec![1, 6, 4, 4] }, &[small]).unwrap();
    let coef = input(&mut g, &[1, 6, 4, 4]);
    let prod = g.add(Op::Binary(ir::graph::BinaryOp::Mul), &[coef, tiled]).unwrap();
    assert_eq!(op_cost(&g, prod).read, 96.0 + 16.0);
}

#[test]
fn attention_costs_4_h_dh_per_query_key_pair_causally() {
    let mut g = Graph::new();
    let (b, t, h, hkv, dh) = (2usize, 10usize, 4usize, 2usize, 8usize);
    let q = input(&mut g, &[b, t, h, dh]);
    let k = input(&mut g, &[b, t, hkv, dh]);
    let v = input(&mut g, &[b, t, hkv, dh]);
    let o = g.add(Op::CausalAttention { scale: 0.3, rope_base: None }, &[q, k, v]).unwrap();
    let pairs: usize = (1..=t).sum();
    assert_eq!(op_cost(&g, o).flops, (4 * h * dh * pairs * b) as f64);
    assert_eq!(op_cost(&g, o).flops_papers, 0.0);
}

#[test]
fn norms_count_four_per_element_in_the_papers_convention() {
    let mut g = Graph::new();
    let x = input(&mut g, &[1, 3, 2, 16]);
    let gain = param(&mut g, "g", &[16]);
    let n = g.add(Op::RmsNorm { eps: 1e-5 }, &[x, gain]).unwrap();
    assert_eq!(op_cost(&g, n).flops_papers, 4.0 * 96.0);
    // NormProject: 4·K statistics per row plus the 2·K·M projection.
    let flat = g.add(Op::Reshape { shape: vec![1, 3, 32] }, &[x]).unwrap();
    let w = param(&mut g, "w", &[32, 6]);
    let np = g.add(Op::NormProject { eps: 1e-5, centered: 0 }, &[flat, w]).unwrap();
    assert_eq!(op_cost(&g, np).flops_papers, 3.0 * (4.0 * 32.0 + 2.0 * 32.0 * 6.0));
    assert_eq!(op_cost(&g, np).read, 96.0);
}

#[test]
fn active_fraction_scales_every_figure() {
    let mut g = Graph::new();
    g.set_role(Role::new(Region::Backbone).active_fraction(0.25));
    let x = input(&mut g, &[1, 4, 8]);
    let y = g.add(Op::Unary(ir::graph::UnaryOp::Silu), &[x]).unwrap();
    let c = op_cost(&g, y);
    assert_eq!((c.flops, c.read, c.written), (8.0, 8.0, 8.0));
}

fn small(seq_len: usize) -> ModelSpec {
    ModelSpec {
        d_model: 64,
        layers: 2,
        heads: 4,
        vocab: 128,
        ffn: FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(128) }),
        train: TrainSpec { seq_len, ..TrainSpec::default() },
        ..ModelSpec::default()
    }
}

#[test]
fn moe_flops_count_only_the_routed_experts_in_use() {
    let moe = |top_k: usize| ModelSpec {
        ffn: FfnSpec::Moe(MoeSpec { experts: 8, top_k, shared: 1, hidden: 96, ..MoeSpec::default() }),
        ..small(16)
    };
    let (one, three) = (count_spec(&moe(1)).unwrap(), count_spec(&moe(3)).unwrap());
    // Parameters do not depend on top_k; FLOPs grow by two experts' SwiGLU in each of
    // the 2 layers (3 matmuls of D x hidden at 2 FLOPs per MAC), plus their small
    // elementwise work.
    assert_eq!(one.params.total, three.params.total);
    let (layers, extra_experts) = (2.0, 2.0);
    // Active parameters: two more experts' three D x hidden matrices in each layer.
    let extra_active = (layers * extra_experts) as u64 * 3 * 64 * 96;
    assert_eq!(three.params.active - one.params.active, extra_active);
    let expert_matmuls = layers * extra_experts * 2.0 * 3.0 * (64 * 96) as f64;
    let delta = three.flops - one.flops;
    assert!(delta > expert_matmuls && delta < expert_matmuls * 1.02, "{delta} vs {expert_matmuls}");
}

#[test]
fn mtp_module_parameters_go_to_the_mtp_bucket() {
    let d = 64usize;
    let plain = count_spec(&small(16)).unwrap();
    let spec = ModelSpec { mtp: MtpSpec { depth: 1, ..MtpSpec::default() }, ..small(16) };
    let with_mtp = count_spec(&spec).unwrap();
    // docs/math.md §7.3: 2D² (W_mix) + 3D (two fusion norms and the module's final norm) + one
    // block; the embedding and the unembedding are shared.
    let block = 4 * d * d + 3 * d * 128 + 2 * d;
    assert_eq!(with_mtp.params.mtp as usize, 2 * d * d + 3 * d + block);
    assert_eq!(with_mtp.params.backbone, plain.params.backbone);
    assert_eq!(with_mtp.params.embedding, plain.params.embedding);
    assert!(with_mtp.flops_by_region.mtp > 0.0 && plain.flops_by_region.mtp == 0.0);
    // The trunk's per-sublayer figures do not see the module.
    assert_eq!(with_mtp.sublayers, plain.sublayers);
    let report = cost_report(&spec).unwrap();
    assert_eq!(report.params.total, with_mtp.params.total);
}

#[test]
fn per_token_figures_do_not_depend_on_the_batch() {
    let spec = small(12);
    let one = ir::lower::lower(&spec, 1, 12).unwrap();
    let three = ir::lower::lower(&spec, 3, 12).unwrap();
    let a = GraphCounts::of(&one.graph, 12, 4, 64);
    let b = GraphCounts::of(&three.graph, 36, 4, 64);
    assert!((a.flops - b.flops).abs() < 1e-6 * a.flops);
    // Only the scalar losses (a few bytes per graph, not per token) differ.
    assert!((a.activation_bytes - b.activation_bytes).abs() < 1e-3 * a.activation_bytes);
    assert_eq!(a.traffic_per_sublayer(), b.traffic_per_sublayer());
}

/// The two counts of `stored_elements` differ only where the papers' traffic model
/// departs from what memory holds: a parameter (not traffic, but held), and a
/// broadcast over inner axes (re-read as materialized, but held once). A slice holds
/// at most what its source holds under both, so a slice of a broadcast scalar is
/// one element of memory, not its own size.
#[test]
fn stored_elements_memory_and_paper_traffic_differ_only_at_params_and_inner_broadcasts() {
    use ir::cost::{stored_elements, Holding};
    let mut g = Graph::new();
    let w = param(&mut g, "w", &[8, 3]);
    assert_eq!(stored_elements(&g, w, Holding::Memory), 24);
    assert_eq!(stored_elements(&g, w, Holding::PaperTraffic), 0);
    // The stream copies of an embedding: inner axes only.
    let x = input(&mut g, &[2, 5, 1, 8]);
    let streams = g.add(Op::Broadcast { shape: vec![2, 5, 4, 8] }, &[x]).unwrap();
    assert_eq!(stored_elements(&g, streams, Holding::Memory), 80);
    assert_eq!(stored_elements(&g, streams, Holding::PaperTraffic), 320);
    // A scalar broadcast over the token axes, then sliced: one element either way.
    let s = input(&mut g, &[1]);
    let wide = g.add(Op::Broadcast { shape: vec![2, 5, 8] }, &[s]).unwrap();
    let part = g.add(Op::Slice { axis: 2, start: 0, end: 4 }, &[wide]).unwrap();
    assert_eq!(stored_elements(&g, part, Holding::Memory), 1);
    assert_eq!(stored_elements(&g, part, Holding::PaperTraffic), 1);
    // Views of a stored operand hold what it holds.
    let r = g.add(Op::Reshape { shape: vec![10, 8] }, &[wide]).unwrap();
    let c = g.add(Op::Concat { axis: 0 }, &[r, r]).unwrap();
    assert_eq!(stored_elements(&g, c, Holding::Memory), 2);
}
