//! CausalAttention in the reference executor (docs/math.md §1.3): against a naive
//! per-element implementation written here (RoPE by its defining formula), plus
//! causality and the GQA head mapping, in f32 and f64.

mod common;

use common::exec::{assert_close, tol, Case, Rng};
use ir::exec::Float;
use ir::graph::Op;

macro_rules! both {
    ($name:ident, $check:ident) => {
        #[test]
        fn $name() {
            $check::<f32>();
            $check::<f64>();
        }
    };
}

/// x [b, t, heads, dh] rotated with the half-split convention, by position t.
fn rope(x: &[f64], t: usize, heads: usize, dh: usize, base: f64) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = dh / 2;
    for (row_index, row) in y.chunks_mut(dh).enumerate() {
        let pos = ((row_index / heads) % t) as f64;
        for i in 0..half {
            let phi = pos * base.powf(-2.0 * i as f64 / dh as f64);
            let (a, b) = (row[i], row[i + half]);
            row[i] = a * phi.cos() - b * phi.sin();
            row[i + half] = a * phi.sin() + b * phi.cos();
        }
    }
    y
}

struct Dims {
    b: usize,
    t: usize,
    h: usize,
    hkv: usize,
    dh: usize,
}

/// softmax over t' <= t of scale · q·k, weights on v, head h reading kv head h·Hkv/H.
fn naive_attention(q: &[f64], k: &[f64], v: &[f64], d: &Dims, scale: f64, base: Option<f64>) -> Vec<f64> {
    let (q, k) = match base {
        Some(base) => (rope(q, d.t, d.h, d.dh, base), rope(k, d.t, d.hkv, d.dh, base)),
        None => (q.to_vec(), k.to_vec()),
    };
    let qi = |b: usize, t: usize, h: usize, i: usize| q[((b * d.t + t) * d.h + h) * d.dh + i];
    let kvi = |x: &[f64], b: usize, t: usize, g: usize, i: usize| x[((b * d.t + t) * d.hkv + g) * d.dh + i];
    let mut out = vec![0.0; d.b * d.t * d.h * d.dh];
    for b in 0..d.b {
        for h in 0..d.h {
            let g = h * d.hkv / d.h;
            for t in 0..d.t {
                let s: Vec<f64> = (0..=t)
                    .map(|tp| (0..d.dh).map(|i| qi(b, t, h, i) * kvi(&k, b, tp, g, i)).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for i in 0..d.dh {
                    out[((b * d.t + t) * d.h + h) * d.dh + i] =
                        (0..=t).map(|tp| (s[tp] - m).exp() / z * kvi(v, b, tp, g, i)).sum();
                }
            }
        }
    }
    out
}

fn setup(rng: &mut Rng, d: &Dims, op: Op) -> (Case, [ir::graph::NodeId; 4]) {
    let mut c = Case::new();
    let q = c.param(&[d.b, d.t, d.h, d.dh], rng.normals(d.b * d.t * d.h * d.dh));
    let k = c.param(&[d.b, d.t, d.hkv, d.dh], rng.normals(d.b * d.t * d.hkv * d.dh));
    let v = c.param(&[d.b, d.t, d.hkv, d.dh], rng.normals(d.b * d.t * d.hkv * d.dh));
    let o = c.add(op, &[q, k, v]);
    (c, [q, k, v, o])
}

fn check_against_naive<T: Float>() {
    let mut rng = Rng::new(20);
    for (hkv, base) in [(4, None), (2, Some(10000.0)), (1, Some(50.0)), (4, Some(10000.0))] {
        let d = Dims { b: 2, t: 7, h: 4, hkv, dh: 6 };
        let scale = 1.0 / (d.dh as f64).sqrt();
        let (c, [q, k, v, o]) = setup(&mut rng, &d, Op::CausalAttention { scale, rope_base: base });
        let want = naive_attention(c.get(q), c.get(k), c.get(v), &d, scale, base);
        assert_close(&c.eval::<T>(o), &want, 10.0 * tol::<T>(), &format!("hkv {hkv} rope {base:?}"));
    }
}
both!(attention_matches_naive_with_rope_and_gqa, check_against_naive);

fn check_causality<T: Float>() {
    let mut rng = Rng::new(21);
    let d = Dims { b: 2, t: 9, h: 4, hkv: 2, dh: 8 };
    let (mut c, [_, k, v, o]) =
        setup(&mut rng, &d, Op::CausalAttention { scale: 0.3, rope_base: Some(100.0) });
    let before = c.eval::<T>(o);
    let t0 = 4;
    let row = d.hkv * d.dh;
    for node in [k, v] {
        let mut data = c.get(node).to_vec();
        for b in 0..d.b {
            for x in &mut data[(b * d.t + t0 + 1) * row..(b + 1) * d.t * row] {
                *x += 5.0;
            }
        }
        c.set(node, data);
    }
    let after = c.eval::<T>(o);
    let orow = d.h * d.dh;
    for b in 0..d.b {
        let (past, future) =
            ((b * d.t) * orow..(b * d.t + t0 + 1) * orow, (b * d.t + t0 + 1) * orow..(b + 1) * d.t * orow);
        assert_eq!(before[past.clone()], after[past], "outputs at t <= {t0} moved");
        assert_ne!(before[future.clone()], after[future], "the perturbation had no effect at all");
    }
}
both!(attention_is_causal, check_causality);

/// GQA with Hkv < H equals MHA whose kv head h is a copy of kv head floor(h·Hkv/H).
fn check_gqa_mapping<T: Float>() {
    let mut rng = Rng::new(22);
    let d = Dims { b: 1, t: 5, h: 6, hkv: 2, dh: 4 };
    let op = Op::CausalAttention { scale: 0.5, rope_base: Some(10000.0) };
    let (c, [q, k, v, o]) = setup(&mut rng, &d, op.clone());
    let repeat = |x: &[f64]| -> Vec<f64> {
        let mut y = Vec::new();
        for t in 0..d.t {
            for h in 0..d.h {
                let g = h * d.hkv / d.h;
                y.extend_from_slice(&x[(t * d.hkv + g) * d.dh..(t * d.hkv + g + 1) * d.dh]);
            }
        }
        y
    };
    let mut mha = Case::new();
    let q2 = mha.param(&[1, d.t, d.h, d.dh], c.get(q).to_vec());
    let k2 = mha.param(&[1, d.t, d.h, d.dh], repeat(c.get(k)));
    let v2 = mha.param(&[1, d.t, d.h, d.dh], repeat(c.get(v)));
    let o2 = mha.add(op, &[q2, k2, v2]);
    assert_close(&c.eval::<T>(o), &mha.eval::<T>(o2), 0.0, "gqa vs repeated kv");
}
both!(gqa_reads_kv_head_h_times_hkv_over_h, check_gqa_mapping);

#[test]
fn rope_with_odd_head_dim_is_an_error() {
    let mut rng = Rng::new(23);
    let d = Dims { b: 1, t: 3, h: 2, hkv: 2, dh: 5 };
    let (c, [.., o]) = setup(&mut rng, &d, Op::CausalAttention { scale: 1.0, rope_base: Some(10000.0) });
    let err = c.try_run::<f64>(&[o]).unwrap_err().to_string();
    assert!(err.contains("causal_attention") && err.contains("even head dim"), "{err}");
}
