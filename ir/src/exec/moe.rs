//! Sparse mixture-of-experts ops (docs/math.md §1.6): the routing of token-slot
//! assignments into expert-contiguous rows, and the grouped matrix product over
//! those rows with its weight gradient.
//!
//! [`route_into`] and [`group_ranges`] are public: the compiled devices route on the
//! host with the same function (codegen's `Step::MoeRoute`) and split their grouped
//! GEMMs by the same ranges, so the three paths cannot disagree on the order.

use super::tensor::{Float, Tensor};
use crate::graph::MoeRouteOut;
use crate::Shape;

/// The row of every assignment (n, j) and the kept rows per expert. Assignments are
/// ordered by expert, then by token (a token names an expert once); the first
/// `capacity` of each expert are kept, and the dropped ones follow every kept row in
/// token order (docs/math.md §1.6, capacity rule). `idx` holds the chosen experts of
/// every token, token-major.
pub fn route(
    idx: &[i32],
    experts: usize,
    capacity: Option<usize>,
) -> Result<(Vec<usize>, Vec<usize>), String> {
    let mut kept = vec![0usize; experts];
    let mut dropped = 0usize;
    let mut slot_of = Vec::with_capacity(idx.len());
    // First pass: each assignment's place among its expert's kept rows, or among the dropped.
    for &e in idx {
        let e = usize::try_from(e)
            .ok()
            .filter(|&e| e < experts)
            .ok_or_else(|| format!("expert index {e} out of range 0..{experts}"))?;
        if capacity.is_none_or(|c| kept[e] < c) {
            slot_of.push((Some(e), kept[e]));
            kept[e] += 1;
        } else {
            slot_of.push((None, dropped));
            dropped += 1;
        }
    }
    let mut offsets = vec![0usize; experts + 1];
    for e in 0..experts {
        offsets[e + 1] = offsets[e] + kept[e];
    }
    let rows = slot_of
        .into_iter()
        .map(|(e, i)| match e {
            Some(e) => offsets[e] + i,
            None => offsets[experts] + i,
        })
        .collect();
    Ok((rows, kept))
}

/// All three outputs of `MoeRoute` at once, from the expert indices `idx` [N, k]
/// (token-major, `k` per token): `rows[a]` the row of assignment `a`, `tokens[r]` the
/// token row `r` reads (rows of dropped assignments read their own token too), and
/// `counts[e]` the rows expert `e` keeps. One sequential counting pass; the compiled
/// devices call it on the host (docs/math.md §1.6).
pub fn route_into(
    idx: &[i32],
    k: usize,
    experts: usize,
    capacity: Option<usize>,
    rows: &mut [i32],
    tokens: &mut [i32],
    counts: &mut [i32],
) -> Result<(), String> {
    if k == 0 || !idx.len().is_multiple_of(k) {
        return Err(format!("{} assignments do not split into tokens of {k}", idx.len()));
    }
    if rows.len() != idx.len() || tokens.len() != idx.len() || counts.len() != experts {
        return Err(format!(
            "outputs of {}, {} and {} elements for {} assignments over {experts} experts",
            rows.len(),
            tokens.len(),
            counts.len(),
            idx.len()
        ));
    }
    let too_many = |what: usize| format!("{what} does not fit an i32 index");
    let (order, kept) = route(idx, experts, capacity)?;
    for (a, &r) in order.iter().enumerate() {
        rows[a] = i32::try_from(r).map_err(|_| too_many(r))?;
        tokens[r] = i32::try_from(a / k).map_err(|_| too_many(a / k))?;
    }
    for (c, &n) in counts.iter_mut().zip(&kept) {
        *c = i32::try_from(n).map_err(|_| too_many(n))?;
    }
    Ok(())
}

/// `MoeRoute`: the index tensor `out` selects, from expert indices [N, k].
pub fn moe_route(
    idx: &Tensor<i32>,
    experts: usize,
    capacity: Option<usize>,
    out: MoeRouteOut,
    out_shape: &Shape,
) -> Result<Tensor<i32>, String> {
    let k = idx.shape.dims().last().copied().unwrap_or(1).max(1);
    let n = idx.data.len();
    let (mut rows, mut tokens, mut counts) = (vec![0i32; n], vec![0i32; n], vec![0i32; experts]);
    route_into(&idx.data, k, experts, capacity, &mut rows, &mut tokens, &mut counts)?;
    let data = match out {
        MoeRouteOut::Rows => rows,
        MoeRouteOut::Tokens => tokens,
        MoeRouteOut::Counts => counts,
    };
    Ok(Tensor::new(out_shape.clone(), data))
}

/// The row ranges of the groups of a grouped product (consecutive, from row 0), checked
/// against the `m` rows of the operand: a count that is negative or runs past the rows
/// is an error, never a read out of bounds.
pub fn group_ranges(counts: &[i32], m: usize) -> Result<Vec<std::ops::Range<usize>>, String> {
    let mut start = 0usize;
    let mut out = Vec::with_capacity(counts.len());
    for (e, &c) in counts.iter().enumerate() {
        let c = usize::try_from(c).map_err(|_| format!("group {e} has a negative count {c}"))?;
        if c > m - start {
            return Err(format!("groups cover {} rows, the operand has {m}", start + c));
        }
        out.push(start..start + c);
        start += c;
    }
    Ok(out)
}

/// `GroupedMatMul`: `y[r] = x[r] · w[e]` (`w[e]ᵀ` with `trans_b`) for every row r of
/// group e; rows past the groups are zero.
pub fn grouped_matmul<T: Float>(
    x: &Tensor<T>,
    w: &Tensor<T>,
    counts: &Tensor<i32>,
    trans_b: bool,
    out_shape: &Shape,
) -> Result<Tensor<T>, String> {
    let (m, k) = (x.shape.dims()[0], x.shape.dims()[1]);
    let n = out_shape.dims()[1];
    let mut y = Tensor::zeros(out_shape.clone());
    for (e, rows) in group_ranges(&counts.data, m)?.into_iter().enumerate() {
        let we = &w.data[e * k * n..(e + 1) * k * n];
        for r in rows {
            let xr = &x.data[r * k..(r + 1) * k];
            let yr = &mut y.data[r * n..(r + 1) * n];
            for (c, &xv) in xr.iter().enumerate() {
                for (o, yv) in yr.iter_mut().enumerate() {
                    let wv = if trans_b { we[o * k + c] } else { we[c * n + o] };
                    *yv += xv * wv;
                }
            }
        }
    }
    Ok(y)
}

/// `GroupedMatMulGrad`: `dw[e] = Σ_{r in group e} x[r] ⊗ dy[r]` (`[E, K, N]`; with
/// `trans_b` `dy[r] ⊗ x[r]`, `[E, N, K]`).
pub fn grouped_matmul_grad<T: Float>(
    x: &Tensor<T>,
    dy: &Tensor<T>,
    counts: &Tensor<i32>,
    trans_b: bool,
    out_shape: &Shape,
) -> Result<Tensor<T>, String> {
    let (m, k) = (x.shape.dims()[0], x.shape.dims()[1]);
    let n = dy.shape.dims()[1];
    let mut dw = Tensor::zeros(out_shape.clone());
    for (e, rows) in group_ranges(&counts.data, m)?.into_iter().enumerate() {
        let de = &mut dw.data[e * k * n..(e + 1) * k * n];
        for r in rows {
            let xr = &x.data[r * k..(r + 1) * k];
            let dr = &dy.data[r * n..(r + 1) * n];
            for (c, &xv) in xr.iter().enumerate() {
                for (o, &dv) in dr.iter().enumerate() {
                    let at = if trans_b { o * k + c } else { c * n + o };
                    de[at] += xv * dv;
                }
            }
        }
    }
    Ok(dw)
}
