//! Causal self-attention with GQA and optional half-split RoPE (docs/math.md §1.3).

use super::reduce::softmax_row;
use super::{Float, Tensor};
use std::borrow::Cow;

/// Sizes of an attention call: q is [b, t, h, dh], k and v are [b, t, hkv, dh].
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub hkv: usize,
    pub dh: usize,
}

impl AttnDims {
    pub(crate) fn new(q: &[usize], kv: &[usize]) -> Self {
        AttnDims { b: q[0], t: q[1], h: q[2], hkv: kv[2], dh: q[3] }
    }

    /// The key/value head query head `h` reads: g(h) = floor(h · Hkv / H) (docs/math.md §1.3).
    pub(crate) fn kv_head(&self, h: usize) -> usize {
        h * self.hkv / self.h
    }
}

/// Rotates x [b, t, heads, dh] in place, half-split convention (docs/math.md §1.3): for
/// i < dh/2, θ_i = base^(-2i/dh), φ = t·θ_i, and the pair (x_i, x_{i+dh/2}) turns by φ.
/// `inverse` turns by -φ instead: the rotation is orthogonal, so that is also its VJP.
pub(crate) fn rope_in_place<T: Float>(
    x: &mut [T],
    t: usize,
    heads: usize,
    dh: usize,
    base: f64,
    inverse: bool,
) -> Result<(), String> {
    if dh % 2 == 1 {
        return Err(format!("RoPE needs an even head dim, got {dh}"));
    }
    if dh == 0 {
        return Ok(());
    }
    let half = dh / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let table: Vec<(T, T)> = (0..t)
        .flat_map(|pos| {
            (0..half).map(move |i| {
                let phi = pos as f64 * base.powf(-2.0 * i as f64 / dh as f64);
                (T::from_f64(phi.cos()), T::from_f64(sign * phi.sin()))
            })
        })
        .collect();
    for (row_index, row) in x.chunks_exact_mut(dh).enumerate() {
        let pos = (row_index / heads) % t;
        let angles = &table[pos * half..(pos + 1) * half];
        let (lo, hi) = row.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(angles) {
            let (x0, x1) = (*a, *b);
            *a = x0 * c - x1 * s;
            *b = x0 * s + x1 * c;
        }
    }
    Ok(())
}

/// out[b, t, h] = Σ_{t' ≤ t} softmax_t'(scale · q[b, t, h] · k[b, t', g(h)]) v[b, t', g(h)],
/// with RoPE applied to q and k first when `rope_base` is set (position = index along t).
pub(crate) fn causal_attention<T: Float>(
    q: &Tensor<T>,
    k: &Tensor<T>,
    v: &Tensor<T>,
    scale: f64,
    rope_base: Option<f64>,
) -> Result<Tensor<T>, String> {
    let d = AttnDims::new(q.shape.dims(), k.shape.dims());
    let shape = q.shape.clone();
    let (q, k): (Cow<[T]>, Cow<[T]>) = match rope_base {
        Some(base) => {
            let (mut qr, mut kr) = (q.data.clone(), k.data.clone());
            rope_in_place(&mut qr, d.t, d.h, d.dh, base, false)?;
            rope_in_place(&mut kr, d.t, d.hkv, d.dh, base, false)?;
            (Cow::Owned(qr), Cow::Owned(kr))
        }
        None => (Cow::Borrowed(&q.data), Cow::Borrowed(&k.data)),
    };
    let scale = T::from_f64(scale);
    let mut out = vec![T::zero(); d.b * d.t * d.h * d.dh];
    let (mut scores, mut probs) = (vec![T::zero(); d.t], vec![T::zero(); d.t]);
    let kv_row = |b: usize, t: usize, g: usize| ((b * d.t + t) * d.hkv + g) * d.dh;
    for b in 0..d.b {
        for h in 0..d.h {
            let g = d.kv_head(h);
            for t in 0..d.t {
                let q_at = ((b * d.t + t) * d.h + h) * d.dh;
                let qrow = &q[q_at..q_at + d.dh];
                for (tp, s) in scores[..=t].iter_mut().enumerate() {
                    let krow = &k[kv_row(b, tp, g)..kv_row(b, tp, g) + d.dh];
                    *s = qrow.iter().zip(krow).fold(T::zero(), |acc, (&x, &y)| acc + x * y) * scale;
                }
                softmax_row(&scores[..=t], &mut probs[..=t]);
                let orow = &mut out[q_at..q_at + d.dh];
                for (tp, &p) in probs[..=t].iter().enumerate() {
                    let vrow = &v.data[kv_row(b, tp, g)..kv_row(b, tp, g) + d.dh];
                    orow.iter_mut().zip(vrow).for_each(|(o, &x)| *o += p * x);
                }
            }
        }
    }
    Ok(Tensor { shape, data: out })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_preserves_norms_and_inverse_undoes_it() {
        let (t, heads, dh) = (6, 3, 8);
        let x: Vec<f64> = (0..t * heads * dh).map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0).collect();
        let mut y = x.clone();
        rope_in_place(&mut y, t, heads, dh, 10000.0, false).unwrap();
        for (a, b) in x.chunks(dh).zip(y.chunks(dh)) {
            let norm = |v: &[f64]| v.iter().map(|e| e * e).sum::<f64>();
            assert!((norm(a) - norm(b)).abs() < 1e-12 * (1.0 + norm(a)));
        }
        assert_ne!(x[heads * dh..], y[heads * dh..], "positions > 0 rotate");
        assert_eq!(x[..heads * dh], y[..heads * dh], "position 0 does not rotate");
        rope_in_place(&mut y, t, heads, dh, 10000.0, true).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn gqa_groups_consecutive_query_heads() {
        let d = AttnDims { b: 1, t: 1, h: 8, hkv: 2, dh: 4 };
        let heads: Vec<usize> = (0..8).map(|h| d.kv_head(h)).collect();
        assert_eq!(heads, vec![0, 0, 0, 0, 1, 1, 1, 1]);
    }
}
