//! Reference executor, one test per op family, each against values computed here
//! independently (naive loops in f64), in both f32 and f64.

mod common;

use common::exec::{assert_close, offset, tol, unravel, Case, Rng};
use ir::exec::Float;
use ir::graph::{BinaryOp, Op, ReduceOp, UnaryOp};

/// Runs a generic check in both precisions.
macro_rules! both {
    ($name:ident, $check:ident) => {
        #[test]
        fn $name() {
            $check::<f32>();
            $check::<f64>();
        }
    };
}

type Scalar1 = fn(f64) -> f64;
type Scalar2 = fn(f64, f64) -> f64;

fn check_unary<T: Float>() {
    let mut rng = Rng::new(1);
    let xs: Vec<f64> = (0..24).map(|_| rng.unit() * 3.0 + 0.1).collect();
    let cases: [(UnaryOp, Scalar1); 10] = [
        (UnaryOp::Neg, |x| -x),
        (UnaryOp::Exp, f64::exp),
        (UnaryOp::Log, f64::ln),
        (UnaryOp::Tanh, f64::tanh),
        (UnaryOp::Sigmoid, |x| 1.0 / (1.0 + (-x).exp())),
        (UnaryOp::Silu, |x| x / (1.0 + (-x).exp())),
        (UnaryOp::Sqrt, f64::sqrt),
        (UnaryOp::Rsqrt, |x| 1.0 / x.sqrt()),
        (UnaryOp::Recip, |x| 1.0 / x),
        (UnaryOp::Square, |x| x * x),
    ];
    for (op, f) in cases {
        let mut c = Case::new();
        let x = c.param(&[2, 3, 4], xs.clone());
        let y = c.add(Op::Unary(op), &[x]);
        let want: Vec<f64> = xs.iter().map(|&v| f(v)).collect();
        assert_close(&c.eval::<T>(y), &want, tol::<T>(), &format!("{op:?}"));
    }
    let mut c = Case::new();
    let x = c.param(&[2, 3, 4], xs.clone());
    let y = c.add(Op::Affine { mul: -1.5, add: 0.25 }, &[x]);
    let want: Vec<f64> = xs.iter().map(|&v| -1.5 * v + 0.25).collect();
    assert_close(&c.eval::<T>(y), &want, tol::<T>(), "affine");
}
both!(unary_and_affine_match_std_functions, check_unary);

fn check_binary_broadcast<T: Float>() {
    let mut rng = Rng::new(2);
    let cases: [(BinaryOp, Scalar2); 5] = [
        (BinaryOp::Add, |a, b| a + b),
        (BinaryOp::Sub, |a, b| a - b),
        (BinaryOp::Mul, |a, b| a * b),
        (BinaryOp::Div, |a, b| a / b),
        (BinaryOp::Max, f64::max),
    ];
    let shapes: [(&[usize], &[usize]); 4] =
        [(&[2, 1, 4], &[3, 1]), (&[2, 3, 4], &[2, 3, 4]), (&[4], &[2, 3, 1]), (&[2, 3], &[])];
    for (op, f) in cases {
        for (sa, sb) in shapes {
            let mut c = Case::new();
            let av = rng.normals(sa.iter().product());
            let bv: Vec<f64> = (0..sb.iter().product()).map(|_| rng.unit() + 0.5).collect();
            let a = c.param(sa, av.clone());
            let b = c.param(sb, bv.clone());
            let y = c.add(Op::Binary(op), &[a, b]);
            let out = c.g.node(y).shape.0.clone();
            let want: Vec<f64> = (0..out.iter().product())
                .map(|flat| {
                    let idx = unravel(&out, flat);
                    // NumPy rule by hand: right-align, size-1 axes read index 0.
                    let pick = |dims: &[usize]| {
                        let lead = out.len() - dims.len();
                        let sub: Vec<usize> = dims
                            .iter()
                            .enumerate()
                            .map(|(i, &d)| if d == 1 { 0 } else { idx[lead + i] })
                            .collect();
                        offset(dims, &sub)
                    };
                    f(av[pick(sa)], bv[pick(sb)])
                })
                .collect();
            assert_close(&c.eval::<T>(y), &want, tol::<T>(), &format!("{op:?} {sa:?} {sb:?}"));
        }
    }
}
both!(binary_ops_broadcast_like_numpy, check_binary_broadcast);

fn check_reduce<T: Float>() {
    let mut rng = Rng::new(3);
    let dims = [2usize, 3, 4];
    let xs = rng.normals(24);
    for axis in 0..3 {
        for keepdim in [false, true] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
                let mut c = Case::new();
                let x = c.param(&dims, xs.clone());
                let y = c.add(Op::Reduce { op, axis, keepdim }, &[x]);
                let mut kept = dims.to_vec();
                kept[axis] = 1;
                let want: Vec<f64> = (0..24 / dims[axis])
                    .map(|flat| {
                        let mut idx = unravel(&kept, flat);
                        let vals: Vec<f64> = (0..dims[axis])
                            .map(|j| {
                                idx[axis] = j;
                                xs[offset(&dims, &idx)]
                            })
                            .collect();
                        match op {
                            ReduceOp::Sum => vals.iter().sum(),
                            ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
                            ReduceOp::Mean => vals.iter().sum::<f64>() / vals.len() as f64,
                        }
                    })
                    .collect();
                let want_dims: Vec<usize> = if keepdim {
                    kept.clone()
                } else {
                    dims.iter().enumerate().filter(|&(i, _)| i != axis).map(|(_, &d)| d).collect()
                };
                assert_eq!(c.g.node(y).shape.0, want_dims);
                assert_close(&c.eval::<T>(y), &want, tol::<T>(), &format!("{op:?} axis {axis}"));
            }
        }
    }
}
both!(reductions_over_every_axis, check_reduce);

/// C[b] = op(A[b]) · op(B[b]) by a naive triple loop over explicit indices.
fn naive_matmul(
    a: &[f64],
    ad: &[usize],
    b: &[f64],
    bd: &[usize],
    ta: bool,
    tb: bool,
    out: &[usize],
) -> Vec<f64> {
    let r = out.len();
    let (m, n) = (out[r - 2], out[r - 1]);
    let k = if ta { ad[ad.len() - 2] } else { ad[ad.len() - 1] };
    let batch = &out[..r - 2];
    let nb: usize = batch.iter().product();
    let batch_index = |dims: &[usize], bidx: &[usize]| -> Vec<usize> {
        let own = &dims[..dims.len() - 2];
        let lead = batch.len() - own.len();
        own.iter().enumerate().map(|(i, &d)| if d == 1 { 0 } else { bidx[lead + i] }).collect()
    };
    let mut c = vec![0.0; nb * m * n];
    for bf in 0..nb {
        let bidx = unravel(batch, bf);
        let (pa, pb) = (batch_index(ad, &bidx), batch_index(bd, &bidx));
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for kk in 0..k {
                    let ai = if ta { [kk, i] } else { [i, kk] };
                    let bi = if tb { [j, kk] } else { [kk, j] };
                    let a_full: Vec<usize> = pa.iter().chain(&ai).copied().collect();
                    let b_full: Vec<usize> = pb.iter().chain(&bi).copied().collect();
                    s += a[offset(ad, &a_full)] * b[offset(bd, &b_full)];
                }
                c[(bf * m + i) * n + j] = s;
            }
        }
    }
    c
}

fn check_matmul<T: Float>() {
    let mut rng = Rng::new(4);
    for case in 0..24 {
        let (ta, tb) = (case % 2 == 1, (case / 2) % 2 == 1);
        let (m, k, n) = (1 + rng.below(9), 1 + rng.below(9), 1 + rng.below(9));
        // Batch layouts: none, same, broadcast against a missing axis, size-1 axes on both sides.
        let (ba, bb): (Vec<usize>, Vec<usize>) = match case / 4 {
            0 => (vec![], vec![]),
            1 => (vec![3], vec![3]),
            2 => (vec![2, 3], vec![]),
            3 => (vec![2, 1], vec![3]),
            4 => (vec![1, 4], vec![2, 1]),
            _ => (vec![], vec![2, 2]),
        };
        let ad: Vec<usize> = ba.iter().copied().chain(if ta { [k, m] } else { [m, k] }).collect();
        let bd: Vec<usize> = bb.iter().copied().chain(if tb { [n, k] } else { [k, n] }).collect();
        let (av, bv) = (rng.normals(ad.iter().product()), rng.normals(bd.iter().product()));
        let mut c = Case::new();
        let a = c.param(&ad, av.clone());
        let b = c.param(&bd, bv.clone());
        let y = c.add(Op::MatMul { trans_a: ta, trans_b: tb }, &[a, b]);
        let out = c.g.node(y).shape.0.clone();
        let want = naive_matmul(&av, &ad, &bv, &bd, ta, tb, &out);
        assert_close(&c.eval::<T>(y), &want, 10.0 * tol::<T>(), &format!("matmul {ad:?} {bd:?} {ta} {tb}"));
    }
}
both!(matmul_matches_naive_loops_with_transposes_and_batch_broadcast, check_matmul);

/// The expected view: element `i` of an `out`-shaped result reads x[source(i)] of
/// the [2, 3, 4] source, rounded to T like the executor's copy.
fn pick<T: Float>(xs: &[f64], out: &[usize], source: impl Fn(&[usize]) -> Vec<usize>) -> Vec<f64> {
    (0..out.iter().product())
        .map(|flat| T::from_f64(xs[offset(&[2, 3, 4], &source(&unravel(out, flat)))]).to_f64())
        .collect()
}

fn check_movement<T: Float>() {
    let mut rng = Rng::new(5);
    let xs = rng.normals(24);
    let mut c = Case::new();
    let x = c.param(&[2, 3, 4], xs.clone());
    let r = c.add(Op::Reshape { shape: vec![4, 6] }, &[x]);
    assert_eq!(c.eval::<T>(r), c.eval::<T>(x));
    let p = c.add(Op::Permute { perm: vec![1, 2, 0] }, &[x]);
    assert_eq!(c.eval::<T>(p), pick::<T>(&xs, &[3, 4, 2], |i| vec![i[2], i[0], i[1]]));
    let s = c.add(Op::Slice { axis: 2, start: 1, end: 3 }, &[x]);
    assert_eq!(c.eval::<T>(s), pick::<T>(&xs, &[2, 3, 2], |i| vec![i[0], i[1], i[2] + 1]));
    let head = c.add(Op::Slice { axis: 1, start: 0, end: 1 }, &[x]);
    let tail = c.add(Op::Slice { axis: 1, start: 1, end: 3 }, &[x]);
    let back = c.add(Op::Concat { axis: 1 }, &[head, tail]);
    assert_eq!(c.eval::<T>(back), c.eval::<T>(x), "slices concatenated back");
    let row = c.add(Op::Slice { axis: 0, start: 1, end: 2 }, &[x]);
    let bc = c.add(Op::Broadcast { shape: vec![3, 2, 3, 4] }, &[row]);
    assert_eq!(c.eval::<T>(bc), pick::<T>(&xs, &[3, 2, 3, 4], |i| vec![1, i[2], i[3]]));
}
both!(movement_ops_materialize_views, check_movement);

#[test]
fn movement_ops_carry_i32_values() {
    let mut c = Case::new();
    let ids = c.ints(&[2, 3], vec![0, 1, 2, 3, 4, 5]);
    let t = c.add(Op::Permute { perm: vec![1, 0] }, &[ids]);
    assert_eq!(c.eval_int::<f32>(t), vec![0, 3, 1, 4, 2, 5]);
    let cat = c.add(Op::Concat { axis: 0 }, &[ids, ids]);
    assert_eq!(c.eval_int::<f64>(cat), vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]);
}

fn check_gather_scatter<T: Float>() {
    let mut rng = Rng::new(6);
    // Embedding lookup: axis 0.
    let table = rng.normals(5 * 3);
    let mut c = Case::new();
    let e = c.param(&[5, 3], table.clone());
    let ids = c.ints(&[2, 2], vec![4, 0, 0, 2]);
    let rows = c.add(Op::Gather { axis: 0 }, &[e, ids]);
    let want: Vec<f64> = [4, 0, 0, 2].iter().flat_map(|&r| table[r * 3..r * 3 + 3].to_vec()).collect();
    assert_close(&c.eval::<T>(rows), &want, tol::<T>(), "embedding gather");
    // ScatterAdd of ones counts how often each row was picked.
    let zeros = c.param(&[5, 3], vec![0.0; 15]);
    let ones = c.param(&[2, 2, 3], vec![1.0; 12]);
    let counts = c.add(Op::ScatterAdd { axis: 0 }, &[zeros, ids, ones]);
    let want: Vec<f64> = [1.0, 0.0, 1.0, 0.0, 1.0].iter().flat_map(|&n: &f64| [n * 1.0; 3]).collect();
    let mut want = want;
    want[0..3].copy_from_slice(&[2.0; 3]);
    assert_close(&c.eval::<T>(counts), &want, 0.0, "scatter_add counts");

    // Per-token stream gather on axis 2 of [B, T, N, C], then scatter back.
    let (b, t, n, ch) = (2, 3, 6, 4);
    let xs = rng.normals(b * t * n * ch);
    let mut idx = Vec::new();
    for _ in 0..b * t {
        let mut picks: Vec<i32> = (0..n as i32).collect();
        for i in 0..3 {
            let j = i + rng.below(n - i);
            picks.swap(i, j);
        }
        idx.extend_from_slice(&picks[..3]);
    }
    let mut c = Case::new();
    let x = c.param(&[b, t, n, ch], xs.clone());
    let ix = c.ints(&[b, t, 3], idx.clone());
    let act = c.add(Op::Gather { axis: 2 }, &[x, ix]);
    let got = c.eval::<T>(act);
    for bt in 0..b * t {
        for j in 0..3 {
            let s = idx[bt * 3 + j] as usize;
            let want = &xs[(bt * n + s) * ch..(bt * n + s + 1) * ch];
            assert_close(&got[(bt * 3 + j) * ch..(bt * 3 + j + 1) * ch], want, tol::<T>(), "stream gather");
        }
    }
    // ScatterRows of the gathered rows into x is x again.
    let same = c.add(Op::ScatterRows { axis: 2 }, &[x, ix, act]);
    assert_close(&c.eval::<T>(same), &c.eval::<T>(x), 0.0, "scatter_rows round trip");
    // ScatterRows of new rows changes exactly the selected rows.
    let fresh = c.param(&[b, t, 3, ch], rng.normals(b * t * 3 * ch));
    let written = c.add(Op::ScatterRows { axis: 2 }, &[x, ix, fresh]);
    let back = c.add(Op::Gather { axis: 2 }, &[written, ix]);
    assert_close(&c.eval::<T>(back), &c.eval::<T>(fresh), 0.0, "gather after scatter_rows");
    let got = c.eval::<T>(written);
    let base = c.eval::<T>(x);
    for bt in 0..b * t {
        for s in 0..n {
            if !idx[bt * 3..bt * 3 + 3].contains(&(s as i32)) {
                let r = (bt * n + s) * ch..(bt * n + s + 1) * ch;
                assert_eq!(got[r.clone()], base[r], "inactive row changed");
            }
        }
    }
}
both!(gather_and_scatter_round_trip, check_gather_scatter);

#[test]
fn gather_and_scatter_reject_bad_indices() {
    let mut c = Case::new();
    let e = c.param(&[5, 3], vec![0.0; 15]);
    let ids = c.ints(&[2], vec![1, 5]);
    let rows = c.add(Op::Gather { axis: 0 }, &[e, ids]);
    let err = c.try_run::<f32>(&[rows]).unwrap_err().to_string();
    assert!(err.contains("gather") && err.contains("index 5"), "{err}");
    let dup = c.ints(&[2], vec![1, 1]);
    let src = c.param(&[2, 3], vec![1.0; 6]);
    let w = c.add(Op::ScatterRows { axis: 0 }, &[e, dup, src]);
    let err = c.try_run::<f64>(&[w]).unwrap_err().to_string();
    assert!(err.contains("scatter_rows") && err.contains("twice"), "{err}");
}

fn check_softmax<T: Float>() {
    let mut rng = Rng::new(7);
    let xs: Vec<f64> = rng.normals(12).iter().map(|v| v * 30.0).collect();
    let mut c = Case::new();
    let x = c.param(&[3, 4], xs.clone());
    let y = c.add(Op::Softmax, &[x]);
    let mut want = Vec::new();
    for row in xs.chunks(4) {
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        want.extend(row.iter().map(|v| (v - m).exp() / z));
    }
    assert_close(&c.eval::<T>(y), &want, tol::<T>(), "softmax");
}
both!(softmax_of_large_logits, check_softmax);

fn check_cross_entropy<T: Float>() {
    let mut rng = Rng::new(8);
    let (rows, v) = (6, 7);
    let xs: Vec<f64> = rng.normals(rows * v).iter().map(|x| 4.0 * x).collect();
    let targets: Vec<i32> = (0..rows).map(|_| rng.below(v) as i32).collect();
    let mut c = Case::new();
    let logits = c.param(&[2, 3, v], xs.clone());
    let tg = c.ints(&[2, 3], targets.clone());
    let loss = c.add(Op::SoftmaxCrossEntropy, &[logits, tg]);
    let mut total = 0.0;
    for (row, &t) in xs.chunks(v).zip(&targets) {
        let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        total += lse - row[t as usize];
    }
    assert_close(&c.eval::<T>(loss), &[total / rows as f64], tol::<T>(), "cross entropy");

    let bad = c.ints(&[2, 3], vec![0, 1, 2, 3, 4, v as i32]);
    let loss = c.add(Op::SoftmaxCrossEntropy, &[logits, bad]);
    let err = c.try_run::<T>(&[loss]).unwrap_err().to_string();
    assert!(err.contains("softmax_cross_entropy") && err.contains("target 7"), "{err}");
}
both!(cross_entropy_matches_log_sum_exp, check_cross_entropy);

fn check_rms_norm<T: Float>() {
    let mut rng = Rng::new(9);
    let (rows, d) = (5, 8);
    let xs = rng.normals(rows * d);
    let gv: Vec<f64> = (0..d).map(|_| 1.0 + rng.normal() * 0.1).collect();
    let mut c = Case::new();
    let x = c.param(&[rows, d], xs.clone());
    let g = c.param(&[d], gv.clone());
    let eps = 1e-5;
    let y = c.add(Op::RmsNorm { eps }, &[x, g]);
    let plain = c.add(Op::RmsNorm { eps }, &[x]);
    let mut want = Vec::new();
    let mut want_plain = Vec::new();
    for row in xs.chunks(d) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let rho = 1.0 / (ms + eps).sqrt();
        want.extend(row.iter().zip(&gv).map(|(v, g)| v * rho * g));
        want_plain.extend(row.iter().map(|v| v * rho));
    }
    assert_close(&c.eval::<T>(y), &want, tol::<T>(), "rms_norm");
    assert_close(&c.eval::<T>(plain), &want_plain, tol::<T>(), "rms_norm without gain");
}
both!(rms_norm_matches_formula, check_rms_norm);

/// (mean, population variance) of a slice.
fn stats(v: &[f64]) -> (f64, f64) {
    let mu = v.iter().sum::<f64>() / v.len() as f64;
    (mu, v.iter().map(|x| (x - mu) * (x - mu)).sum::<f64>() / v.len() as f64)
}

fn check_group_and_layer_norm<T: Float>() {
    let mut rng = Rng::new(10);
    let (rows, d, groups) = (4, 12, 3);
    let xs: Vec<f64> =
        rng.normals(rows * d).iter().enumerate().map(|(i, v)| v * 3.0 + i as f64 * 0.1).collect();
    let gv: Vec<f64> = (0..d).map(|_| 1.0 + rng.normal() * 0.2).collect();
    let bv = rng.normals(d);
    let mut c = Case::new();
    let x = c.param(&[rows, d], xs.clone());
    let ones = c.param(&[d], vec![1.0; d]);
    let zeros = c.param(&[d], vec![0.0; d]);
    let g = c.param(&[d], gv.clone());
    let b = c.param(&[d], bv.clone());
    let eps = 1e-12;
    let plain = c.add(Op::GroupNorm { groups, eps }, &[x, ones, zeros]);
    let got = c.eval::<T>(plain);
    let size = d / groups;
    let stat_tol = if std::mem::size_of::<T>() == 4 { 1e-5 } else { 1e-12 };
    for group in got.chunks(size) {
        let (mu, var) = stats(group);
        assert!(mu.abs() < stat_tol && (var - 1.0).abs() < 10.0 * stat_tol, "group mean {mu} var {var}");
    }
    let affine = c.add(Op::GroupNorm { groups, eps }, &[x, g, b]);
    let want: Vec<f64> = got.iter().enumerate().map(|(i, v)| v * gv[i % d] + bv[i % d]).collect();
    assert_close(&c.eval::<T>(affine), &want, tol::<T>(), "group_norm affine");

    let ln = c.add(Op::LayerNorm { eps }, &[x, g, b]);
    let ln_plain = c.add(Op::LayerNorm { eps }, &[x]);
    let mut want = Vec::new();
    let mut want_plain = Vec::new();
    for row in xs.chunks(d) {
        let (mu, var) = stats(row);
        let r = 1.0 / (var + eps).sqrt();
        want_plain.extend(row.iter().map(|v| (v - mu) * r));
        want.extend(row.iter().enumerate().map(|(i, v)| (v - mu) * r * gv[i] + bv[i]));
    }
    assert_close(&c.eval::<T>(ln), &want, tol::<T>(), "layer_norm");
    assert_close(&c.eval::<T>(ln_plain), &want_plain, tol::<T>(), "layer_norm without affine");
}
both!(group_norm_standardizes_each_group_and_layer_norm_matches, check_group_and_layer_norm);
