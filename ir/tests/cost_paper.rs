//! The cost model's graph counts against the papers' closed forms (docs/math.md §1.5,
//! §4.7, §5.9, §6.9, §9.2 items 3 and 5). The figures are counted from the lowered
//! graph; the formulas here are independent of the counting code.

use ir::cost::{cost_report, count_spec, paper_figures};
use ir::spec::{FfnSpec, GhcSpec, MhcSpec, ModelSpec, ResidualSpec, SwiGluSpec, TrainSpec, XhcSpec};

fn backbone(d: usize, layers: usize, heads: usize, hidden: usize, vocab: usize, seq_len: usize) -> ModelSpec {
    ModelSpec {
        name: "cost".into(),
        d_model: d,
        layers,
        heads,
        vocab,
        ffn: FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(hidden) }),
        train: TrainSpec { seq_len, ..TrainSpec::default() },
        ..ModelSpec::default()
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

#[test]
fn plain_residual_has_12_l_d2_matrix_params_plus_gains() {
    let (d, l, v) = (384usize, 3usize, 512usize);
    let spec = backbone(d, l, 6, 1024, v, 32);
    let counts = count_spec(&spec).unwrap();
    let p = counts.params;
    assert_eq!(p.embedding as usize, v * d);
    assert_eq!(p.backbone as usize, 12 * l * d * d + 2 * d * l + d + d * v);
    assert_eq!((p.connection, p.mtp), (0, 0));
    assert_eq!(p.total, p.embedding + p.backbone);

    let tied = ModelSpec { tie_embeddings: true, ..spec };
    let p = count_spec(&tied).unwrap().params;
    assert_eq!(p.backbone as usize, 12 * l * d * d + 2 * d * l + d);
    assert_eq!(p.total as usize, 12 * l * d * d + 2 * d * l + d + v * d);
}

#[test]
fn residual_forward_flops_match_math_1_5() {
    // GQA so that P_attn = D·d_h·(2H + 2H_kv) is not just 4D².
    let (d, l, h, hkv, f, v, t) = (256usize, 2usize, 8usize, 2usize, 704usize, 1000usize, 64usize);
    let spec = ModelSpec { kv_heads: Some(hkv), ..backbone(d, l, h, f, v, t) };
    let report = cost_report(&spec).unwrap();
    let dh = d / h;
    let p_attn = d * dh * (2 * h + 2 * hkv);
    let p_ffn = 3 * d * f;
    let t_bar = (t as f64 + 1.0) / 2.0;
    let per_block = 2.0 * (p_attn + p_ffn) as f64 + 4.0 * (h * dh) as f64 * t_bar;
    let expected = l as f64 * per_block + 2.0 * (d * v) as f64;
    let counted = report.flops_per_token.forward as f64;
    // The formula leaves out norms, SwiGLU's elementwise ops, the residual adds and the
    // cross-entropy: all positive and well under 1% here.
    assert!(counted > expected, "{counted} <= {expected}");
    assert!(rel(counted, expected) < 0.01, "{counted} vs {expected}");
    assert_eq!(report.flops_per_token.train, 3 * report.flops_per_token.forward);
}

#[test]
fn plain_residual_traffic_is_2_read_1_write_and_no_overhead() {
    let spec = backbone(128, 2, 4, 352, 256, 16);
    let report = cost_report(&spec).unwrap();
    assert!((report.traffic_per_sublayer.read - 2.0).abs() < 1e-12);
    assert!((report.traffic_per_sublayer.write - 1.0).abs() < 1e-12);
    assert_eq!(report.connection_flops_per_sublayer, 0.0);
    // The all-ops count has the residual add: D per sublayer (docs/math.md §9.1).
    assert!((report.connection_flops_per_sublayer_all_ops - 128.0).abs() < 1e-9);
    assert_eq!(report.overhead_vs_residual.params, 0.0);
    assert_eq!(report.overhead_vs_residual.flops, 0.0);
    assert_eq!(report.overhead_vs_residual.traffic, 0.0);
}

fn ghc(d: usize, m: usize, n: usize) -> ModelSpec {
    ModelSpec {
        residual: ResidualSpec::Ghc(GhcSpec { m, n, ..GhcSpec::default() }),
        ..backbone(d, 2, 4, 2 * d, 256, 8)
    }
}

#[test]
fn ghc_connection_flops_are_48d_at_2_3_and_2592d_at_8_64() {
    for (m, n, per_d) in [(2usize, 3usize, 48.0), (8, 64, 2592.0)] {
        let d = 512;
        let spec = ghc(d, m, n);
        let report = cost_report(&spec).unwrap();
        let expected = per_d * d as f64;
        assert!(
            rel(report.connection_flops_per_sublayer, expected) < 1e-9,
            "(m, n) = ({m}, {n}): {} vs {expected}",
            report.connection_flops_per_sublayer
        );
        // Every sublayer, not only the mean.
        for s in &report.sublayers {
            assert!(rel(s.connection_flops, expected) < 1e-9, "sublayer {}: {}", s.index, s.connection_flops);
        }
        // The closed form of docs/math.md §5.9 agrees (it is the papers' own convention).
        let paper = paper_figures(&spec).connection_flops_per_sublayer_d.unwrap();
        assert!((paper - per_d).abs() < 1e-9, "{paper}");
        assert!(report.overhead_vs_residual.flops > 0.0);
        assert!(report.params.connection > 0);
    }
}

#[test]
fn mhc_traffic_is_34c_at_n4_and_130c_at_n16() {
    for (n, expected) in [(4usize, 34.0), (16, 130.0)] {
        let spec = ModelSpec {
            residual: ResidualSpec::Mhc(MhcSpec { n, ..MhcSpec::default() }),
            ..backbone(4096, 1, 32, 8192, 256, 8)
        };
        let report = cost_report(&spec).unwrap();
        let t = report.traffic_per_sublayer;
        assert!(rel(t.total, expected) < 0.01, "n = {n}: {} + {} = {}", t.read, t.write, t.total);
        // Read and write separately: (5n+1)C and (3n+1)C (docs/math.md §4.7).
        assert!(rel(t.read, (5 * n + 1) as f64) < 0.01, "read {}", t.read);
        assert!(rel(t.write, (3 * n + 1) as f64) < 0.01, "write {}", t.write);
    }
}

fn xhc(c: usize) -> ModelSpec {
    ModelSpec {
        residual: ResidualSpec::Xhc(XhcSpec {
            n: 16,
            k: 4,
            conv_kernels: vec![4, 8, 12],
            ..XhcSpec::default()
        }),
        ..backbone(c, 2, 16, 2 * c, 256, 16)
    }
}

#[test]
fn xhc_connection_params_per_block_are_1256c() {
    let c = 1024;
    let report = cost_report(&xhc(c)).unwrap();
    let expected = 1256.0 * c as f64;
    assert!(
        rel(report.connection_params_per_block, expected) < 0.01,
        "{} vs {expected}",
        report.connection_params_per_block
    );
    let paper = paper_figures(&xhc(c)).connection_params_per_block.unwrap();
    assert!((paper - expected).abs() < 1e-6, "{paper}");
}

#[test]
fn xhc_traffic_is_73_5c() {
    let report = cost_report(&xhc(4096)).unwrap();
    let t = report.traffic_per_sublayer;
    assert!(rel(t.total, 73.5) < 0.01, "{} + {} = {}", t.read, t.write, t.total);
    // Attention 53C / 17C, MLP 57C / 20C (docs/math.md §6.9).
    let attn = &report.sublayers[0];
    let mlp = &report.sublayers[1];
    assert!(rel(attn.traffic_read, 53.0) < 0.01 && rel(attn.traffic_write, 17.0) < 0.01, "{attn:?}");
    assert!(rel(mlp.traffic_read, 57.0) < 0.01 && rel(mlp.traffic_write, 20.0) < 0.01, "{mlp:?}");
}
