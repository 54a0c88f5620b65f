//! Connection ops in the reference executor: Sinkhorn (docs/math.md §4.2), TopK routing
//! (§6.2), TemporalAugment (§6.5) and NormProject (§4.3, §6.2), each against an
//! independent computation written here, in f32 and f64.

mod common;

use common::exec::{assert_close, tol, Case, Rng};
use ir::exec::Float;
use ir::graph::{Op, ReduceOp};

macro_rules! both {
    ($name:ident, $check:ident) => {
        #[test]
        fn $name() {
            $check::<f32>();
            $check::<f64>();
        }
    };
}

/// The same finite iteration, written out on nested Vec rows in f64.
fn naive_sinkhorn(x: &[f64], n: usize, iters: usize, eps: f64) -> Vec<f64> {
    let mut m: Vec<Vec<f64>> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    let colmax = (0..n).map(|r| x[r * n + j]).fold(f64::MIN, f64::max);
                    (x[i * n + j] - colmax).exp()
                })
                .collect()
        })
        .collect();
    for _ in 0..iters {
        let colsums: Vec<f64> = (0..n).map(|j| (0..n).map(|i| m[i][j]).sum::<f64>() + eps).collect();
        for row in m.iter_mut() {
            for (v, s) in row.iter_mut().zip(&colsums) {
                *v /= s;
            }
        }
        for row in m.iter_mut() {
            let s: f64 = row.iter().sum::<f64>() + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
    }
    m.concat()
}

fn check_sinkhorn<T: Float>() {
    let mut rng = Rng::new(30);
    let n = 4;
    for (iters, eps, std) in [(20, 0.0, 3.0), (20, 1e-6, 1.0), (1, 0.0, 5.0), (0, 0.0, 1.0)] {
        let xs: Vec<f64> = rng.normals(6 * n * n).iter().map(|v| v * std).collect();
        let mut c = Case::new();
        let x = c.param(&[2, 3, n, n], xs.clone());
        let y = c.add(Op::Sinkhorn { iters, eps }, &[x]);
        let got = c.eval::<T>(y);
        let want: Vec<f64> = xs.chunks(n * n).flat_map(|m| naive_sinkhorn(m, n, iters, eps)).collect();
        assert_close(&got, &want, 10.0 * tol::<T>(), &format!("sinkhorn iters {iters} eps {eps}"));
        if iters > 0 && eps == 0.0 {
            for row in got.chunks(n) {
                let s: f64 = row.iter().sum();
                assert!((s - 1.0).abs() < 4.0 * tol::<T>(), "row sum {s}");
            }
        }
    }
}
both!(sinkhorn_matches_the_same_finite_iteration_and_rows_sum_to_one, check_sinkhorn);

/// Index i >= fixed is routed iff fewer than k - fixed others beat it (higher
/// score, or equal score and lower index).
fn routed(row: &[f64], i: usize, k: usize, fixed: usize) -> bool {
    let beaten_by = (fixed..row.len()).filter(|&j| row[j] > row[i] || (row[j] == row[i] && j < i)).count();
    beaten_by < k - fixed
}

fn check_topk<T: Float>() {
    let mut c = Case::new();
    let s = c.param(&[1, 7], vec![9.0, 9.0, 1.0, 5.0, 5.0, 5.0, 0.0]);
    let idx = c.add(Op::TopK { k: 4, fixed: 1 }, &[s]);
    assert_eq!(c.eval_int::<T>(idx), vec![0, 1, 3, 4], "ties go to the lowest index");

    let mut rng = Rng::new(31);
    let (n, k, fixed) = (10, 5, 2);
    // Few distinct values, so ties are common.
    let xs: Vec<f64> = (0..3 * 4 * n).map(|_| rng.below(4) as f64 * 0.25).collect();
    let mut c = Case::new();
    let s = c.param(&[3, 4, n], xs.clone());
    let idx = c.add(Op::TopK { k, fixed }, &[s]);
    assert_eq!(c.g.node(idx).shape.0, vec![3, 4, k]);
    let got = c.eval_int::<T>(idx);
    for (row, picks) in xs.chunks(n).zip(got.chunks(k)) {
        assert_eq!(picks[..fixed], [0, 1], "fixed prefix");
        assert!(picks.windows(2).all(|w| w[0] < w[1]), "ascending: {picks:?}");
        let want: Vec<i32> = (fixed..n).filter(|&i| routed(row, i, k, fixed)).map(|i| i as i32).collect();
        assert_eq!(picks[fixed..], want[..], "scores {row:?}");
    }
}
both!(topk_keeps_fixed_prefix_ascending_order_and_lowest_index_ties, check_topk);

/// g[t] = Σ_{i < κ, i ≤ t} w[i] ⊙ out[t - i], per batch entry.
fn naive_conv(out: &[f64], b: usize, t: usize, c: usize, w: &[f64]) -> Vec<f64> {
    let kappa = w.len() / c;
    let mut g = vec![0.0; b * t * c];
    for bi in 0..b {
        for ti in 0..t {
            for ch in 0..c {
                g[(bi * t + ti) * c + ch] = (0..kappa)
                    .filter(|&i| i <= ti)
                    .map(|i| w[i * c + ch] * out[(bi * t + ti - i) * c + ch])
                    .sum();
            }
        }
    }
    g
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

struct Augment {
    c: Case,
    out: ir::graph::NodeId,
    y: ir::graph::NodeId,
    kernels: Vec<Vec<f64>>,
}

fn augment(
    rng: &mut Rng,
    b: usize,
    t: usize,
    ch: usize,
    kappas: &[usize],
    gram_schmidt: bool,
    eps_rel: f64,
) -> Augment {
    let mut c = Case::new();
    let out = c.param(&[b, t, ch], rng.normals(b * t * ch));
    let mut ids = vec![out];
    let mut kernels = Vec::new();
    for &kappa in kappas {
        let w: Vec<f64> = (0..kappa * ch).map(|i| rng.normal() / (1.0 + (i / ch) as f64)).collect();
        ids.push(c.param(&[kappa, ch], w.clone()));
        kernels.push(w);
    }
    let y = c.add(Op::TemporalAugment { gram_schmidt, eps_rel }, &ids);
    Augment { c, out, y, kernels }
}

fn check_augment_without_gs_is_the_convolution<T: Float>() {
    let mut rng = Rng::new(32);
    let (b, t, ch) = (2, 6, 3);
    let a = augment(&mut rng, b, t, ch, &[2, 4], false, 1e-6);
    assert_eq!(a.c.g.node(a.y).shape.0, vec![b, t, 2, ch]);
    let got = a.c.eval::<T>(a.y);
    for (j, w) in a.kernels.iter().enumerate() {
        let g = naive_conv(a.c.get(a.out), b, t, ch, w);
        let mine: Vec<f64> =
            (0..b * t).flat_map(|bt| got[(bt * 2 + j) * ch..(bt * 2 + j + 1) * ch].to_vec()).collect();
        assert_close(&mine, &g, tol::<T>(), &format!("conv {j}"));
    }
}
both!(temporal_augment_without_gram_schmidt_is_the_causal_conv, check_augment_without_gs_is_the_convolution);

fn check_augment_causal<T: Float>() {
    let mut rng = Rng::new(33);
    let (b, t, ch) = (2, 10, 8);
    let mut a = augment(&mut rng, b, t, ch, &[4, 8, 12], true, 1e-6);
    let before = a.c.eval::<T>(a.y);
    let t0 = 5;
    let mut data = a.c.get(a.out).to_vec();
    for bi in 0..b {
        for x in &mut data[(bi * t + t0 + 1) * ch..(bi + 1) * t * ch] {
            *x = -2.0 * *x + 1.0;
        }
    }
    a.c.set(a.out, data);
    let after = a.c.eval::<T>(a.y);
    let row = 3 * ch;
    for bi in 0..b {
        let past = (bi * t) * row..(bi * t + t0 + 1) * row;
        assert_eq!(before[past.clone()], after[past], "Y[t <= {t0}] moved");
        let future = (bi * t + t0 + 1) * row..(bi + 1) * t * row;
        assert_ne!(before[future.clone()], after[future]);
    }
}
both!(temporal_augment_is_causal, check_augment_causal);

#[test]
fn temporal_augment_matches_classical_gram_schmidt() {
    let mut rng = Rng::new(34);
    let (b, t, ch) = (2, 16, 16);
    // eps_rel = 0: the modified and classical forms agree up to rounding.
    let a = augment(&mut rng, b, t, ch, &[4, 8, 12], true, 0.0);
    let got = a.c.eval::<f64>(a.y);
    let out = a.c.get(a.out);
    let gs: Vec<Vec<f64>> = a.kernels.iter().map(|w| naive_conv(out, b, t, ch, w)).collect();
    for bt in 0..b * t {
        let mut basis: Vec<Vec<f64>> = vec![out[bt * ch..(bt + 1) * ch].to_vec()];
        for j in 0..3 {
            let g = &gs[j][bt * ch..(bt + 1) * ch];
            let mut want = g.to_vec();
            for v in &basis {
                let coef = dot(g, v) / dot(v, v);
                want.iter_mut().zip(v).for_each(|(w, x)| *w -= coef * x);
            }
            let scale = dot(g, g).sqrt();
            let y = &got[(bt * 3 + j) * ch..(bt * 3 + j + 1) * ch];
            for (i, (a, w)) in y.iter().zip(&want).enumerate() {
                assert!((a - w).abs() < 1e-9 * scale, "token {bt} component {j}[{i}]: {a} vs {w}");
            }
            basis.push(want);
        }
    }
}

#[test]
fn temporal_augment_outputs_are_orthogonal() {
    let mut rng = Rng::new(37);
    let (b, t, ch) = (2, 16, 16);
    let a = augment(&mut rng, b, t, ch, &[4, 8, 12], true, 1e-6);
    let got = a.c.eval::<f64>(a.y);
    let out = a.c.get(a.out);
    for bt in 0..b * t {
        let mut vs = vec![&out[bt * ch..(bt + 1) * ch]];
        vs.extend(got[bt * 3 * ch..(bt + 1) * 3 * ch].chunks(ch));
        for i in 0..vs.len() {
            for j in 0..i {
                let bound = 1e-4 * dot(vs[i], vs[i]).sqrt() * dot(vs[j], vs[j]).sqrt();
                assert!(dot(vs[i], vs[j]).abs() < bound, "token {bt}: <v{i}, v{j}> = {}", dot(vs[i], vs[j]));
            }
        }
    }
}

/// A width-1 kernel w = 2 makes g = 2·out, which Gram–Schmidt would cancel exactly;
/// the guard ⟨out, out⟩·(1 + eps_rel) leaves 2·eps_rel / (1 + eps_rel) · out.
fn check_gram_schmidt_guard<T: Float>() {
    let (t, ch, eps_rel) = (3, 4, 1e-3);
    let mut rng = Rng::new(38);
    let mut c = Case::new();
    let out = c.param(&[1, t, ch], rng.normals(t * ch));
    let w = c.param(&[1, ch], vec![2.0; ch]);
    let y = c.add(Op::TemporalAugment { gram_schmidt: true, eps_rel }, &[out, w]);
    let factor = 2.0 * eps_rel / (1.0 + eps_rel);
    let want: Vec<f64> = c.get(out).iter().map(|v| factor * v).collect();
    // The result is a difference of O(1) terms: f32 keeps about 1e-7 absolute of it.
    let abs_tol = if std::mem::size_of::<T>() == 4 { 1e-6 } else { 1e-13 };
    for (g, w) in c.eval::<T>(y).iter().zip(&want) {
        assert!((g - w).abs() < abs_tol, "got {g}, want {w}");
    }
}
both!(gram_schmidt_guard_is_relative_to_out, check_gram_schmidt_guard);

/// NormProject equals LayerNorm(x) · w[:, ..centered] next to RmsNorm(x) · w[:, centered..],
/// both built from separate ops.
fn check_norm_project<T: Float>() {
    let mut rng = Rng::new(35);
    let (rows, k, m) = (6, 12, 5);
    let xs: Vec<f64> = rng.normals(rows * k).iter().map(|v| v + 0.5).collect();
    let ws: Vec<f64> = rng.normals(k * m).iter().map(|v| v * 0.3).collect();
    let eps = 1e-6;
    for centered in [0, 2, m] {
        let mut c = Case::new();
        let x = c.param(&[2, 3, k], xs.clone());
        let w = c.param(&[k, m], ws.clone());
        let fused = c.add(Op::NormProject { eps, centered }, &[x, w]);
        let mut parts = Vec::new();
        if centered > 0 {
            let ln = c.add(Op::LayerNorm { eps }, &[x]);
            let wc = c.add(Op::Slice { axis: 1, start: 0, end: centered }, &[w]);
            parts.push(c.add(Op::MatMul { trans_a: false, trans_b: false }, &[ln, wc]));
        }
        if centered < m {
            let rms = c.add(Op::RmsNorm { eps }, &[x]);
            let wr = c.add(Op::Slice { axis: 1, start: centered, end: m }, &[w]);
            parts.push(c.add(Op::MatMul { trans_a: false, trans_b: false }, &[rms, wr]));
        }
        let explicit = c.add(Op::Concat { axis: 2 }, &parts);
        assert_close(
            &c.eval::<T>(fused),
            &c.eval::<T>(explicit),
            20.0 * tol::<T>(),
            &format!("centered {centered}"),
        );
    }
}
both!(norm_project_equals_norm_then_matmul, check_norm_project);

/// The reduce-then-sum structure of §6.6 is not needed here; this checks that a
/// row-sum reduction of Sinkhorn output agrees with the op's own row normalization.
fn check_sinkhorn_row_sums_through_the_graph<T: Float>() {
    let mut rng = Rng::new(36);
    let mut c = Case::new();
    let x = c.param(&[3, 5, 5], rng.normals(75));
    let y = c.add(Op::Sinkhorn { iters: 20, eps: 0.0 }, &[x]);
    let rows = c.add(Op::Reduce { op: ReduceOp::Sum, axis: 2, keepdim: false }, &[y]);
    assert_close(&c.eval::<T>(rows), &[1.0; 15], 4.0 * tol::<T>(), "row sums");
}
both!(sinkhorn_rows_sum_to_one_through_the_graph, check_sinkhorn_row_sums_through_the_graph);
