//! Optimizers, schedules and clipping against hand-computed values (docs/math.md §8, §10).

use ir::graph::{Graph, Init, Op, ParamClass, ParamInfo};
use ir::spec::{
    AdamWSpec, ConstantSpec, CosineSpec, ModelSpec, MuonScale, MuonSpec, MupSpec, OptimizerSpec,
    Parametrization, ScheduleSpec, WsdSpec,
};
use ir::{DType, Shape};
use runtime::optim::adamw::{adamw_update, AdamWStep};
use runtime::optim::clip::clip_global_norm;
use runtime::optim::muon::{muon_update, newton_schulz, MuonStep};
use runtime::optim::schedule::lr_multiplier;
use runtime::optim::{Optimizer, Rule};
use runtime::params::ParamSet;
use runtime::rng::Rng;

fn graph_with(params: &[(&str, &[usize], ParamClass)]) -> Graph {
    let mut g = Graph::new();
    for (name, dims, class) in params {
        let info = ParamInfo { name: name.to_string(), init: Init::Zeros, class: *class };
        g.add_source(Op::Param(info), Shape::new(dims.to_vec()), DType::F32, None);
    }
    g
}

/// Plain f64 AdamW, written out from the formula for comparison.
fn adamw_reference(p: f64, grads: &[f64], lr: f64, b1: f64, b2: f64, eps: f64, wd: f64) -> f64 {
    let (mut p, mut m, mut v) = (p, 0.0, 0.0);
    for (i, &g) in grads.iter().enumerate() {
        let t = (i + 1) as i32;
        p *= 1.0 - lr * wd;
        m = b1 * m + (1.0 - b1) * g;
        v = b2 * v + (1.0 - b2) * g * g;
        p -= lr * (m / (1.0 - b1.powi(t))) / ((v / (1.0 - b2.powi(t))).sqrt() + eps);
    }
    p
}

#[test]
fn adamw_first_step_is_hand_computed_sign_step() {
    // Step 1: m̂ = g, v̂ = g², so the update is lr·g/(|g| + eps) ≈ lr·sign(g).
    let mut p = vec![1.0f32, -2.0];
    let g = [0.5f32, -4.0];
    let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
    let h =
        AdamWStep { lr: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0, t: 1, grad_scale: 1.0 };
    adamw_update(&mut p, &g, &mut m, &mut v, &h, None);
    assert!((p[0] - 0.9).abs() < 1e-6, "{p:?}");
    assert!((p[1] - -1.9).abs() < 1e-6, "{p:?}");
    // With decay 0.5: p·(1 − 0.05) − 0.1·sign(g).
    let mut p = vec![1.0f32, -2.0];
    let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
    adamw_update(&mut p, &g, &mut m, &mut v, &AdamWStep { weight_decay: 0.5, ..h }, None);
    assert!((p[0] - (0.95 - 0.1)).abs() < 1e-6, "{p:?}");
    assert!((p[1] - (-1.9 + 0.1)).abs() < 1e-6, "{p:?}");
}

#[test]
fn optimizer_groups_decay_only_where_the_class_says() {
    let g = graph_with(&[("w", &[2], ParamClass::Hidden), ("gain", &[2], ParamClass::Gain)]);
    let mut params = ParamSet::zeros(&g).unwrap();
    params[0].value = vec![1.0, -1.0];
    params[1].value = vec![1.0, -1.0];
    let mut spec = ModelSpec::default();
    let (lr, wd) = (0.01, 0.1);
    spec.train.optimizer =
        OptimizerSpec::AdamW(AdamWSpec { lr, betas: (0.9, 0.95), eps: 1e-8, weight_decay: wd });
    let mut opt = Optimizer::new(&spec, &params);
    assert_eq!(
        opt.rules(),
        vec![
            Rule::AdamW { lr_scale: 1.0, weight_decay: wd },
            Rule::AdamW { lr_scale: 1.0, weight_decay: 0.0 }
        ]
    );
    let steps: [[f32; 2]; 3] = [[0.3, -0.2], [0.1, 0.4], [-0.5, 0.05]];
    for (k, grad) in steps.iter().enumerate() {
        let grads = vec![grad.to_vec(), grad.to_vec()];
        // Half the LR on the second step: the multiplier reaches every group.
        let mult = if k == 1 { 0.5 } else { 1.0 };
        opt.step(&mut params, &grads, mult);
    }
    for (j, start) in [1.0, -1.0].into_iter().enumerate() {
        let gs: Vec<f64> = steps.iter().map(|s| f64::from(s[j])).collect();
        // Reference with the per-step LR multipliers.
        let (mut p_dec, mut p_nodec) = (start, start);
        let (mut m, mut v) = (0.0, 0.0);
        for (i, &gv) in gs.iter().enumerate() {
            let t = (i + 1) as i32;
            let lr_t = if i == 1 { lr * 0.5 } else { lr };
            m = 0.9 * m + 0.1 * gv;
            v = 0.95 * v + 0.05 * gv * gv;
            let upd = lr_t * (m / (1.0 - 0.9f64.powi(t))) / ((v / (1.0 - 0.95f64.powi(t))).sqrt() + 1e-8);
            p_dec = p_dec * (1.0 - lr_t * wd) - upd;
            p_nodec -= upd;
        }
        assert!((f64::from(params[0].value[j]) - p_dec).abs() < 1e-6, "decayed {j}");
        assert!((f64::from(params[1].value[j]) - p_nodec).abs() < 1e-6, "not decayed {j}");
        assert!((p_dec - p_nodec).abs() > 1e-4, "decay must make a visible difference");
    }
    // Constant-LR runs agree with the closed-form reference too.
    let p = adamw_reference(1.0, &[0.3, 0.1], 0.01, 0.9, 0.95, 1e-8, 0.1);
    let mut q = vec![1.0f32];
    let (mut m, mut v) = (vec![0.0], vec![0.0]);
    for (t, g) in [[0.3f32], [0.1]].iter().enumerate() {
        let h = AdamWStep {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            t: t as u64 + 1,
            grad_scale: 1.0,
        };
        adamw_update(&mut q, g, &mut m, &mut v, &h, None);
    }
    assert!((f64::from(q[0]) - p).abs() < 1e-6);
}

#[test]
fn mup_scales_hidden_lr_down_and_decay_up() {
    let g = graph_with(&[
        ("wq", &[4, 4], ParamClass::Hidden),
        ("embed", &[8, 4], ParamClass::Embedding),
        ("head", &[4, 8], ParamClass::Readout),
    ]);
    let params = ParamSet::zeros(&g).unwrap();
    let mut spec = ModelSpec { d_model: 256, ..ModelSpec::default() };
    spec.parametrization = Parametrization::MuP(MupSpec { base_width: 64, ..MupSpec::default() });
    let wd = AdamWSpec::default().weight_decay;
    let rules = Optimizer::new(&spec, &params).rules();
    assert_eq!(rules[0], Rule::AdamW { lr_scale: 0.25, weight_decay: wd * 4.0 });
    assert_eq!(rules[1], Rule::AdamW { lr_scale: 1.0, weight_decay: 0.0 });
    assert_eq!(rules[2], Rule::AdamW { lr_scale: 1.0, weight_decay: wd });
}

#[test]
fn muon_routes_hidden_matrices_and_leaves_the_rest_to_adamw() {
    let g = graph_with(&[
        ("wq", &[4, 6], ParamClass::Hidden),
        ("experts", &[2, 4, 6], ParamClass::Hidden),
        ("gain", &[4], ParamClass::Gain),
        ("embed", &[8, 4], ParamClass::Embedding),
        ("phi", &[4, 3], ParamClass::ConnectionProjection),
    ]);
    let params = ParamSet::zeros(&g).unwrap();
    let mut spec = ModelSpec::default();
    spec.train.optimizer = OptimizerSpec::Muon(MuonSpec::default());
    let rules = Optimizer::new(&spec, &params).rules();
    assert_eq!(rules[0], Rule::Muon);
    assert_eq!(rules[1], Rule::Muon);
    assert!(rules[2..].iter().all(|r| matches!(r, Rule::AdamW { .. })), "{rules:?}");
}

fn gaussian(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::from_seed(seed);
    (0..rows * cols).map(|_| rng.normal() as f32).collect()
}

/// Eigenvalues of a symmetric matrix by cyclic Jacobi rotations.
fn jacobi_eigenvalues(mut a: Vec<f64>, n: usize) -> Vec<f64> {
    for _sweep in 0..50 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).map(move |j| (i, j)))
            .filter(|(i, j)| i != j)
            .map(|(i, j)| a[i * n + j].powi(2))
            .sum();
        if off < 1e-22 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
        }
    }
    (0..n).map(|i| a[i * n + i]).collect()
}

/// Singular values of a [rows, cols] matrix through the eigenvalues of its smaller Gram matrix.
fn singular_values(x: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    let (small, wide) = (rows.min(cols), rows.max(cols));
    let at = |i: usize, k: usize| -> f64 {
        // Element (i, k) of the orientation with `small` rows.
        if rows <= cols {
            f64::from(x[i * cols + k])
        } else {
            f64::from(x[k * cols + i])
        }
    };
    let mut gram = vec![0.0; small * small];
    for i in 0..small {
        for j in 0..small {
            gram[i * small + j] = (0..wide).map(|k| at(i, k) * at(j, k)).sum();
        }
    }
    jacobi_eigenvalues(gram, small).into_iter().map(|e| e.max(0.0).sqrt()).collect()
}

#[test]
fn jacobi_recovers_known_singular_values() {
    // diag(3, 2, 1) embedded in a 3x5 matrix with a rotation of the rows.
    let (c, s) = (0.6f32, 0.8f32);
    let x = [3.0 * c, -3.0 * s, 0.0, 0.0, 0.0, 2.0 * s, 2.0 * c, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
    let mut sv = singular_values(&x, 3, 5);
    sv.sort_by(f64::total_cmp);
    for (got, want) in sv.iter().zip([1.0, 2.0, 3.0]) {
        assert!((got - want).abs() < 1e-5, "{sv:?}");
    }
}

fn check_ns_range(rows: usize, cols: usize) {
    let g = gaussian(rows, cols, 11);
    let x = newton_schulz(&g, rows, cols, 5);
    assert_eq!(x.len(), rows * cols);
    let sv = singular_values(&x, rows, cols);
    let (lo, hi) = sv.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &s| (lo.min(s), hi.max(s)));
    // docs/math.md §9.2.7: rectangular Gaussian inputs land in ≈ [0.68, 1.14].
    assert!(lo >= 0.6 && hi <= 1.2, "{rows}x{cols}: singular values in [{lo}, {hi}]");
}

#[test]
fn newton_schulz_wide_gaussian_singular_values() {
    check_ns_range(256, 1024);
}

#[test]
fn newton_schulz_tall_gaussian_singular_values() {
    check_ns_range(1024, 256);
}

#[test]
fn newton_schulz_transposes_tall_matrices_back() {
    let (rows, cols) = (12, 4);
    let g = gaussian(rows, cols, 5);
    let gt: Vec<f32> =
        (0..cols).flat_map(|j| (0..rows).map(move |i| (i, j))).map(|(i, j)| g[i * cols + j]).collect();
    let tall = newton_schulz(&g, rows, cols, 5);
    let wide = newton_schulz(&gt, cols, rows, 5);
    for i in 0..rows {
        for j in 0..cols {
            assert!((tall[i * cols + j] - wide[j * rows + i]).abs() < 1e-5, "({i}, {j})");
        }
    }
    // A rank-1 tall input u·vᵀ keeps its orientation: the output is a positive multiple of it.
    let u: Vec<f32> = (0..rows).map(|i| (i as f32 - 5.5) / 3.0).collect();
    let v = [1.0f32, -2.0, 0.5, 3.0];
    let rank1: Vec<f32> = (0..rows * cols).map(|k| u[k / cols] * v[k % cols]).collect();
    let out = newton_schulz(&rank1, rows, cols, 5);
    let ratio = out[0] / rank1[0];
    assert!(ratio > 0.0);
    for (o, r) in out.iter().zip(&rank1) {
        assert!((o - ratio * r).abs() < 1e-5, "{o} vs {}", ratio * r);
    }
}

#[test]
fn muon_step_applies_shape_scale_and_decay() {
    // Stored [in = 3, out = 6]: out > in, so the original scale is sqrt(6/3).
    let dims = [3usize, 6];
    let grad = gaussian(3, 6, 2);
    let ns = newton_schulz(&grad, 3, 6, 5);
    for (scale, factor) in [(MuonScale::Original, 2f32.sqrt()), (MuonScale::MatchRmsAdamW, 0.2 * 6f32.sqrt())]
    {
        let mut w = vec![1.0f32; 18];
        let mut momentum = vec![0.0f32; 18];
        let h = MuonStep { lr: 0.02, momentum: 0.95, nesterov: true, ns_steps: 5, scale, weight_decay: 0.5 };
        muon_update(&mut w, &grad, &mut momentum, &dims, &h);
        // First step: M = (1−β)G and the Nesterov blend is a positive multiple of G;
        // Newton–Schulz normalizes scale away, so the direction is NS(G).
        for k in 0..18 {
            let want = 1.0 * (1.0 - 0.02 * 0.5) - 0.02 * factor * ns[k];
            assert!((w[k] - want).abs() < 1e-5, "{scale:?} [{k}]: {} vs {want}", w[k]);
            assert!((momentum[k] - 0.05 * grad[k]).abs() < 1e-6);
        }
    }
}

#[test]
fn schedules_hit_their_key_values() {
    let total = 100;
    let cos = ScheduleSpec::Cosine(CosineSpec { warmup: 10, min_ratio: 0.1 });
    assert!((lr_multiplier(&cos, 0, total) - 0.1).abs() < 1e-12);
    assert!((lr_multiplier(&cos, 4, total) - 0.5).abs() < 1e-12);
    assert!((lr_multiplier(&cos, 10, total) - 1.0).abs() < 1e-12);
    // Midway through the decay the cosine is at the mean of peak and floor.
    let mid = 10 + (total - 1 - 10) / 2;
    let expect_mid = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * (mid - 10) as f64 / 89.0).cos());
    assert!((lr_multiplier(&cos, mid, total) - expect_mid).abs() < 1e-12);
    assert!((lr_multiplier(&cos, total - 1, total) - 0.1).abs() < 1e-12);

    let constant = ScheduleSpec::Constant(ConstantSpec { warmup: 4 });
    assert!((lr_multiplier(&constant, 1, total) - 0.5).abs() < 1e-12);
    assert_eq!(lr_multiplier(&constant, 50, total), 1.0);

    let wsd = ScheduleSpec::Wsd(WsdSpec { warmup: 5, decay_fraction: 0.2, final_ratio: 0.0 });
    assert!((lr_multiplier(&wsd, 0, total) - 0.2).abs() < 1e-12);
    assert_eq!(lr_multiplier(&wsd, 79, total), 1.0);
    assert!((lr_multiplier(&wsd, 80, total) - (1.0 - 1.0 / 20.0)).abs() < 1e-12);
    assert!((lr_multiplier(&wsd, 89, total) - 0.5).abs() < 1e-12);
    assert!(lr_multiplier(&wsd, 99, total).abs() < 1e-12);
}

#[test]
fn clipping_rescales_only_above_the_threshold() {
    let mut grads = vec![vec![3.0f32], vec![4.0f32]];
    let norm = clip_global_norm(&mut grads, 1.0);
    assert!((norm - 5.0).abs() < 1e-9);
    assert!((grads[0][0] - 0.6).abs() < 1e-6 && (grads[1][0] - 0.8).abs() < 1e-6, "{grads:?}");
    let mut small = vec![vec![0.3f32, 0.4]];
    let norm = clip_global_norm(&mut small, 1.0);
    assert!((norm - 0.5).abs() < 1e-7);
    assert_eq!(small, vec![vec![0.3f32, 0.4]]);
}

/// Past `PARALLEL_MIN_ELEMENTS` the step spreads parameters over threads: every
/// parameter must still get exactly its own rule's update, as the update
/// functions compute it one parameter at a time.
#[test]
fn parallel_step_matches_per_parameter_updates() {
    let shapes: [(&str, &[usize], ParamClass); 5] = [
        ("big", &[1100, 1024], ParamClass::Embedding),
        ("wq", &[256, 384], ParamClass::Hidden),
        ("gain", &[768], ParamClass::Gain),
        ("embed", &[256, 512], ParamClass::Embedding),
        ("phi", &[512, 24], ParamClass::ConnectionProjection),
    ];
    let g = graph_with(&shapes);
    let mut params = ParamSet::zeros(&g).unwrap();
    assert!(params.numel() >= runtime::optim::PARALLEL_MIN_ELEMENTS, "the parallel path runs");
    for (i, p) in params.iter_mut().enumerate() {
        let n = p.value.len();
        p.value = gaussian(1, n, 10 + i as u64);
    }
    let grads: Vec<Vec<f32>> =
        params.iter().enumerate().map(|(i, p)| gaussian(1, p.value.len(), 50 + i as u64)).collect();
    let mut spec = ModelSpec::default();
    let adamw = AdamWSpec { lr: 0.01, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 };
    spec.train.optimizer = OptimizerSpec::Muon(MuonSpec { adamw: adamw.clone(), ..MuonSpec::default() });
    let mut opt = Optimizer::new(&spec, &params);
    let rules = opt.rules();
    let mut expected: Vec<Vec<f32>> = params.iter().map(|p| p.value.clone()).collect();
    let muon = MuonSpec::default();
    for (i, rule) in rules.iter().enumerate() {
        match *rule {
            Rule::AdamW { lr_scale, weight_decay } => {
                let n = expected[i].len();
                let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
                let h = AdamWStep {
                    lr: adamw.lr * 0.5 * lr_scale,
                    beta1: adamw.betas.0,
                    beta2: adamw.betas.1,
                    eps: adamw.eps,
                    weight_decay,
                    t: 1,
                    grad_scale: 1.0,
                };
                adamw_update(&mut expected[i], &grads[i], &mut m, &mut v, &h, None);
            }
            Rule::Muon => {
                let n = expected[i].len();
                let mut momentum = vec![0.0; n];
                let h = MuonStep {
                    lr: muon.lr * 0.5,
                    momentum: muon.momentum,
                    nesterov: muon.nesterov,
                    ns_steps: muon.ns_steps,
                    scale: muon.scale,
                    weight_decay: muon.weight_decay,
                };
                muon_update(&mut expected[i], &grads[i], &mut momentum, shapes[i].1, &h);
            }
        }
    }
    opt.step(&mut params, &grads, 0.5);
    for (i, p) in params.iter().enumerate() {
        assert_eq!(p.value, expected[i], "{}", p.name);
    }
}

/// The global norm sums each gradient in vector lanes and, past
/// `PARALLEL_MIN_ELEMENTS`, on several threads: it must still be the f64
/// norm of all elements (to f64 rounding), and every way of calling it the
/// same bits.
#[test]
fn global_norm_matches_a_plain_sum_on_the_parallel_path() {
    use runtime::optim::clip::global_norm;
    let sizes = [1_100_000, 7, 300_001, 1, 65_536];
    let grads: Vec<Vec<f32>> =
        sizes.iter().enumerate().map(|(i, &n)| gaussian(1, n, 90 + i as u64)).collect();
    assert!(sizes.iter().sum::<usize>() >= runtime::optim::PARALLEL_MIN_ELEMENTS, "the parallel path runs");
    let plain = grads.iter().flatten().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt();
    let norm = global_norm(&grads);
    assert!((norm - plain).abs() <= 1e-12 * plain, "{norm} against {plain}");
    let slices: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
    assert_eq!(global_norm(&slices).to_bits(), norm.to_bits());
}

/// `Optimizer::apply` with a clip factor and mirrors: each parameter gets the
/// update of its gradient times the factor, and each mirror the same bits.
#[test]
fn apply_scales_gradients_and_fills_mirrors() {
    use runtime::optim::UpdateTarget;
    let g = graph_with(&[("w", &[64, 48], ParamClass::Hidden), ("gain", &[48], ParamClass::Gain)]);
    let mut params = ParamSet::zeros(&g).unwrap();
    for (i, p) in params.iter_mut().enumerate() {
        p.value = gaussian(1, p.value.len(), 3 + i as u64);
    }
    let grads: Vec<Vec<f32>> =
        params.iter().enumerate().map(|(i, p)| gaussian(1, p.value.len(), 7 + i as u64)).collect();
    let spec = ModelSpec::default();
    let (mut scaled_opt, mut plain_opt) = (Optimizer::new(&spec, &params), Optimizer::new(&spec, &params));
    let mut plain = params.clone();
    let scale = 0.37f32;
    let scaled_grads: Vec<Vec<f32>> = grads.iter().map(|g| g.iter().map(|&x| x * scale).collect()).collect();
    plain_opt.step(&mut plain, &scaled_grads, 0.8);

    let mut mirrors: Vec<Vec<f32>> = params.iter().map(|p| vec![f32::NAN; p.value.len()]).collect();
    let targets = params
        .iter_mut()
        .zip(&grads)
        .zip(&mut mirrors)
        .map(|((p, g), m)| UpdateTarget { value: &mut p.value, grad: g, mirror: Some(m) })
        .collect();
    scaled_opt.apply(targets, 0.8, scale);
    for ((p, q), m) in params.iter().zip(plain.iter()).zip(&mirrors) {
        assert!(p.value.iter().zip(&q.value).all(|(a, b)| a.to_bits() == b.to_bits()), "`{}`", p.name);
        assert!(p.value.iter().zip(m).all(|(a, b)| a.to_bits() == b.to_bits()), "mirror of `{}`", p.name);
    }
    assert_eq!(scaled_opt, plain_opt);
}

/// A step whose loss is not finite changes nothing: the caller reports it
/// with the parameters as they were.
#[test]
fn non_finite_loss_skips_the_update() {
    use runtime::optim::UpdateTarget;
    use runtime::step::host::update_on_host;
    use runtime::step::UpdateSettings;
    let g = graph_with(&[("w", &[8, 4], ParamClass::Hidden)]);
    let mut params = ParamSet::zeros(&g).unwrap();
    let before = params.clone();
    let version = params.version();
    let grads = vec![vec![1.0f32; 32]];
    let mut opt = Optimizer::new(&ModelSpec::default(), &params);
    let settings = UpdateSettings { lr_mult: 1.0, clip: Some(1.0) };
    let stats = update_on_host(f32::NAN, &grads, &mut opt, settings, |grads| {
        params
            .iter_mut()
            .zip(grads)
            .map(|(p, g)| UpdateTarget { value: &mut p.value, grad: g, mirror: None })
            .collect()
    });
    assert!(stats.loss.is_nan() && (stats.grad_norm - 32f64.sqrt()).abs() < 1e-12);
    assert_eq!(params, before);
    assert_eq!(params.version(), version, "not even opened for writing");
    assert_eq!(opt.steps_taken(), 0);
}

/// Every way to write a parameter set changes its version, and a clone is
/// another set: devices upload on any of these.
#[test]
fn parameter_versions_follow_writes_and_clones() {
    let g = graph_with(&[("w", &[2, 2], ParamClass::Hidden)]);
    let mut params = ParamSet::zeros(&g).unwrap();
    let v0 = params.version();
    assert_eq!(params.version(), v0, "reading does not change it");
    params[0].value[0] = 1.0;
    let v1 = params.version();
    assert_ne!(v1, v0);
    params.iter_mut().for_each(|p| p.value[1] = 2.0);
    assert_ne!(params.version(), v1);
    let copy = params.clone();
    assert_eq!(copy, params, "equal values");
    assert_ne!(copy.version(), params.version(), "but another set");
}
