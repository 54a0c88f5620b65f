//! Reductions inside one item: a fold of `n` values as interleaved partial
//! folds combined pairwise ([`fold`], several rows at once in [`fold_rows`],
//! a run-time length in [`fold_dynamic`]), as one serial loop where the GPU's
//! lane spreading splits it across a block instead ([`serial_fold`]), and the
//! maxima folds combine with.
//!
//! Why lanes: a serial chain of dependent float adds costs one add latency
//! per element (xHC's LayerNorm over N·C, docs/math.md §6.2), while
//! independent lanes pipeline and vectorize. Their order is fixed, so results
//! stay deterministic and thread-count independent.

use super::{ix, Names};
use crate::kernel::{select, Block, Buf, Expr, Ty};

/// IEEE `maximum` as the reference executor computes it: `a` when `a` is NaN or
/// `a >= b`, else `b` (NaN in either operand propagates). `a` and `b` must be
/// cheap (variables or loads): they are evaluated twice.
pub(crate) fn maximum(a: Expr, b: Expr) -> Expr {
    select(a.clone().ne_(a.clone()).or(a.clone().ge(b.clone())), a, b)
}

/// The larger of `a` and `b` as vector max instructions compute it (`b` when
/// `b > a`, else `a`): a NaN in `b` is skipped. Only for a softmax's shift,
/// where that cannot change the result: a NaN element makes its own
/// exponential, the sum, and so the whole row NaN whichever maximum is
/// subtracted, and for NaN-free rows both forms are the exact maximum. The
/// NaN-propagating [`maximum`] keeps the fold scalar. `a` and `b` must be
/// cheap (variables or loads): they are evaluated twice.
pub(crate) fn shift_maximum(a: Expr, b: Expr) -> Expr {
    select(b.clone().gt(a.clone()), b, a)
}

/// `op` over `terms` as a balanced tree (pairs first), so the combined values
/// do not form one serial chain.
pub(crate) fn pairwise(mut terms: Vec<Expr>, op: impl Fn(Expr, Expr) -> Expr) -> Expr {
    assert!(!terms.is_empty(), "pairwise over no terms");
    while terms.len() > 1 {
        let mut next = Vec::with_capacity(terms.len().div_ceil(2));
        let mut it = terms.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => op(a, b),
                None => a,
            });
        }
        terms = next;
    }
    terms.pop().expect("one term left")
}

/// Partial folds of a long reduction (see [`fold`]): 8 f32 lanes fill one AVX
/// register and hide the add latency.
pub(crate) const FOLD_LANES: usize = 8;

/// Partial folds of a reduction that fills them at least four times: 16 f32
/// lanes, one AVX-512 register. With 8 lanes GCC vectorizes the loop over lane
/// groups two groups per register and shuffles every load into even and odd
/// groups (mHC's 4×4 Gram products over C took 3.5x longer that way).
const WIDE_FOLD_LANES: usize = 16;

/// A `Var` accumulating `f(j)` over `j in 0..n` from `init` with `op`.
///
/// Long folds run as [`WIDE_FOLD_LANES`] or [`FOLD_LANES`] interleaved
/// partial folds (lane `w` of `W` takes `j ≡ w mod W`), combined pairwise and
/// then into `init`: a serial chain of dependent float adds over a 4096-wide row costs one add latency per
/// element (xHC's LayerNorm over N·C, docs/math.md §6.2; `-ffp-contract=off` and no
/// fast-math, so the C compiler keeps the order), while independent lanes
/// pipeline and vectorize. The order is fixed, so results stay deterministic and
/// thread-count independent; they differ from the reference executor's in-order
/// fold by rounding only.
pub(crate) fn fold(
    names: &Names,
    b: &mut Block,
    init: Expr,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    let acc = b.var(&names.fresh("acc"), init);
    if let Some(width) = fold_width(n) {
        // One variable per lane, not an array: GCC keeps a local array in
        // memory across the loop (a store-to-load chain per step) but packs
        // the lane variables into one vector register.
        let lanes: Vec<Expr> = (0..width)
            .map(|w| {
                let v = f(b, ix(w));
                b.var(&names.fresh("lane"), v)
            })
            .collect();
        b.for_(&names.fresh("jb"), ix(1), ix(n / width), |b, jb| {
            for (w, lane) in lanes.iter().enumerate() {
                let v = f(b, jb.clone() * ix(width) + ix(w));
                b.assign(lane, op(lane.clone(), v));
            }
        });
        let combined = pairwise(lanes, &op);
        b.assign(&acc, op(acc.clone(), combined));
        return acc;
    }
    serial_fold_into(names, b, &acc, n, op, f);
    acc
}

/// [`fold`] as one serial loop, `acc = op(acc, f(j))` for `j in 0..n` in
/// order: the form the GPU's lane spreading ([`crate::kernel::spread_over_lanes`])
/// splits across a block, each lane folding every `LANES`-th element, where
/// [`fold`]'s unrolled lanes would each be a serial chain in every thread.
pub(crate) fn serial_fold(
    names: &Names,
    b: &mut Block,
    init: Expr,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    let acc = b.var(&names.fresh("acc"), init);
    serial_fold_into(names, b, &acc, n, op, f);
    acc
}

fn serial_fold_into(
    names: &Names,
    b: &mut Block,
    acc: &Expr,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) {
    b.for_(&names.fresh("j"), ix(0), ix(n), |b, j| {
        let v = f(b, j);
        b.assign(acc, op(acc.clone(), v));
    });
}

/// The lanes [`fold`] splits a fold of `n` elements into, `None` for a serial fold.
fn fold_width(n: usize) -> Option<usize> {
    [WIDE_FOLD_LANES, FOLD_LANES].into_iter().find(|&w| n >= 4 * w && n.is_multiple_of(w))
}

/// Most lane partials [`fold_rows`] keeps (16 KiB of f32 with its pair levels).
const FOLD_ROWS_PARTIALS: usize = 2048;

/// Longest rows [`fold_rows`] takes, in lane steps. Its lanes live in memory,
/// a load and a store per step; one row at a time they stay in a register,
/// which wins once the steps outweigh the pairwise combination: mHC's 4 x 4
/// Gram products over C = 256 (16 steps) ran slower folded together than
/// one row at a time.
const FOLD_ROWS_STEPS: usize = 4;

/// [`fold`] of `rows` rows of `n` elements at once (C target): `f(row(r), j)`
/// is element `j` of local row `r`, where `row` emits what a row's elements
/// share (its offsets). Returns a local array whose element `row`
/// combines that row's lanes pairwise; `op(init, it)` is then bitwise the row's
/// [`fold`].
///
/// Why: an item holding many short rows (VWN's per-segment means and its
/// `[m, 4] x [4, n]` dot products over C/m = 64, docs/math.md §5.3) folded them one
/// row at a time, and GCC vectorized that loop across rows, reading each lane
/// of each row with a permute: 40 % of the kernel. Here the lanes of all rows
/// sit in one array, row-major, so every lane step is a contiguous vector op
/// (its loop kept a loop, [`Unroll::Never`](crate::kernel::Unroll::Never), or GCC vectorizes across rows
/// again), and each pairwise level (`next[i] = op(part[2i], part[2i+1])`, the pairs
/// [`pairwise`] takes) is one even/odd shuffle per vector over all rows.
/// `None` when [`fold`] would fold serially, for a single row, past
/// [`FOLD_ROWS_PARTIALS`] or for rows longer than [`FOLD_ROWS_STEPS`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn fold_rows<R>(
    names: &Names,
    b: &mut Block,
    ty: Ty,
    rows: usize,
    n: usize,
    op: impl Fn(Expr, Expr) -> Expr,
    row: impl Fn(&mut Block, Expr) -> R,
    f: impl Fn(&mut Block, &R, Expr) -> Expr,
) -> Option<Buf> {
    let width = fold_width(n)?;
    if rows < 2 || rows * width > FOLD_ROWS_PARTIALS || n / width > FOLD_ROWS_STEPS {
        return None;
    }
    let part = b.local_array(&names.fresh("part"), ty, rows * width);
    let lane_index = |r: &Expr, w: Expr| r.clone() * ix(width) + w;
    b.for_(&names.fresh("r"), ix(0), ix(rows), |b, r| {
        let at_row = row(b, r.clone());
        b.for_vector(&names.fresh("w"), ix(0), ix(width), |b, w| {
            let v = f(b, &at_row, w.clone());
            b.store(&part, lane_index(&r, w), v);
        });
    });
    b.for_(&names.fresh("jb"), ix(1), ix(n / width), |b, jb| {
        b.for_(&names.fresh("r"), ix(0), ix(rows), |b, r| {
            let at_row = row(b, r.clone());
            b.for_vector(&names.fresh("w"), ix(0), ix(width), |b, w| {
                let v = f(b, &at_row, jb.clone() * ix(width) + w.clone());
                let at = lane_index(&r, w);
                b.store(&part, at.clone(), op(part.at(at), v));
            });
        });
    });
    let (mut level, mut lanes) = (part, width);
    while lanes > 1 {
        lanes /= 2;
        let next = b.local_array(&names.fresh("pairs"), ty, rows * lanes);
        b.for_(&names.fresh("i"), ix(0), ix(rows * lanes), |b, i| {
            let v = op(level.at(i.clone() * ix(2)), level.at(i.clone() * ix(2) + ix(1)));
            b.store(&next, i, v);
        });
        level = next;
    }
    Some(level)
}

/// [`fold`] over a run-time length `n` (causal attention rows, whose length is
/// the query's position): every lane starts at `identity`, whole groups of
/// [`FOLD_LANES`] go lane by lane, the tail into lane 0, then the lanes are
/// combined pairwise. Same determinism as [`fold`].
pub(crate) fn fold_dynamic(
    names: &Names,
    b: &mut Block,
    identity: Expr,
    n: Expr,
    op: impl Fn(Expr, Expr) -> Expr,
    f: impl Fn(&mut Block, Expr) -> Expr,
) -> Expr {
    // One variable per lane, as in [`fold`].
    let lanes: Vec<Expr> = (0..FOLD_LANES).map(|_| b.var(&names.fresh("lane"), identity.clone())).collect();
    let groups = b.let_(&names.fresh("groups"), n.clone() / ix(FOLD_LANES));
    b.for_(&names.fresh("jb"), ix(0), groups.clone(), |b, jb| {
        for (w, lane) in lanes.iter().enumerate() {
            let v = f(b, jb.clone() * ix(FOLD_LANES) + ix(w));
            b.assign(lane, op(lane.clone(), v));
        }
    });
    b.for_(&names.fresh("j"), groups * ix(FOLD_LANES), n, |b, j| {
        let v = f(b, j);
        b.assign(&lanes[0], op(lanes[0].clone(), v));
    });
    // Pairwise, as [`pairwise`], with each partial named: `op` may repeat its
    // operands (a NaN-propagating max does), which nesting would multiply.
    let mut terms: Vec<Expr> = lanes;
    while terms.len() > 1 {
        terms = terms
            .chunks(2)
            .map(|pair| match pair {
                [x, y] => b.let_(&names.fresh("pair"), op(x.clone(), y.clone())),
                [x] => x.clone(),
                _ => unreachable!("chunks of two"),
            })
            .collect();
    }
    terms.pop().expect("one lane at least")
}
