//! Single-threaded f32 products with 17 to 24 output columns
//! (`c (=|+=) a @ b`), two rows of `c` to three vectors, with AVX-512.
//!
//! Why its own kernel: the connections' coefficient projections have 24
//! outputs per row (mHC's `φ`, VWN's `α | β`, docs/math.md §4.3, §5.3) or 20
//! (xHC's maps). [`super::sgemm`]'s tile has two 16-column vectors per row, so
//! a quarter (24 columns) to three eighths (20) of its FMAs compute padding.
//! Here rows `i` and `i + 1` of `c`, `2n` floats, share three vectors: the
//! first holds row `i`'s columns `0..16`, the second row `i`'s columns
//! `16..n` then row `i + 1`'s first `32 − n`, the third the rest of row
//! `i + 1`. Each step broadcasts `a(i, p)` and `a(i + 1, p)` and blends the two
//! for the middle vector; `b`'s step is packed in the same three-vector
//! layout. At 24 columns no FMA computes padding; a tile of
//! [`PAIRS`] row pairs (or [`PAIRS_ROW_MAJOR`] when `a`'s rows each need a
//! pointer) keeps its accumulators in registers, and prefetches the next
//! tile's rows while it computes, as [`super::sgemm`] does for operands
//! that stream from memory: without that, the kernel was faster than the
//! general tile with its operands in cache but slower in a training step.
//!
//! Each product's sum over `k` runs in order within a [`KC`] block, blocks
//! added in order through `c`, one FMA per step: deterministic and
//! independent of the thread split (threads own disjoint bands of `c`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512, _mm512_add_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_blend_ps, _mm512_mask_storeu_ps,
    _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm_prefetch, _MM_HINT_T0,
};
use std::cell::RefCell;

use super::sgemm::{Operand, Output};

/// Narrowest output this kernel takes: below 17 columns [`super::sgemm`]'s
/// second vector would be all padding and this layout has nothing to pair.
pub(crate) const MIN_COLS: usize = 17;
/// Widest output: two rows fill three vectors.
pub(crate) const MAX_COLS: usize = 24;
/// Row pairs per tile when the tile's rows are one float apart (a
/// column-major `a`, or a packed ragged tile): 24 accumulators, three `b`
/// vectors and three broadcasts fill 30 of the 32 vector registers, and every
/// row is a constant offset from one pointer.
const PAIRS: usize = 8;
/// Row pairs per tile when `a` is row-major, read in place: each row needs a
/// pointer of its own, and 12 of them still fit the general registers next to
/// the loop's own (16 spilled two a step).
const PAIRS_ROW_MAJOR: usize = 6;
/// Contraction steps per packed `b` block (`KC * 48` floats, 48 KiB, in L1
/// and L2 next to the rows being read).
const KC: usize = 256;
/// Contraction steps a block holds in column order (a column-major `a`,
/// [`super::sgemm::streams_columns`]), for this kernel's 16-row tiles.
/// 64 was the fastest of 16 to 128 on mHC's and xHC's coefficient weight
/// gradients. Each tile prefetches the next one's lines, as in block order:
/// prefetching two to four tiles ahead gained nothing.
const COLUMN_BLOCK: usize = 64;
/// Floats of one packed step of `b`: three vectors.
const STEP: usize = 48;

/// Whether this host runs [`paired_gemm`] (it has AVX-512F).
pub(crate) fn available() -> bool {
    super::sgemm::Isa::host() == Some(super::sgemm::Isa::Avx512)
}

/// Whether [`paired_gemm`] takes a product with `n` columns.
pub(crate) fn suits(n: usize) -> bool {
    (MIN_COLS..=MAX_COLS).contains(&n)
}

thread_local! {
    /// One packed block of `b`, then a packed ragged tile of `a`, per
    /// thread, reused across calls.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `c(i, j) (=|+=) sum_p a(i, p) * b(p, j)` for `i < m`, `j < n`, `p < k`.
///
/// # Safety
/// AVX-512F is available ([`available`]); [`suits`]`(n)`;
/// `k >= 1`; `a` addresses `m x k` elements and `b` `k x n` through their
/// strides; `c` addresses `m` rows of `n` writable elements and overlaps
/// neither operand.
pub(crate) unsafe fn paired_gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    debug_assert!(available() && suits(n) && k >= 1 && m >= 1);
    // SAFETY: forwarded contract.
    unsafe {
        if super::sgemm::streams_rows(k, a, KC, STEP) {
            paired_row_streams(m, n, k, a, b, c, accumulate);
        } else {
            paired_blocks(m, n, k, a, b, c, accumulate);
        }
    }
}

/// [`paired_gemm`] in block order: for each block of [`KC`] steps, every tile.
///
/// # Safety
/// As for [`paired_gemm`].
unsafe fn paired_blocks(m: usize, n: usize, k: usize, a: Operand, b: Operand, c: Output, accumulate: bool) {
    let layout = Layout::of(n);
    let row_major = a.cols == 1 && a.rows != 1;
    let tile_rows = 2 * if row_major { PAIRS_ROW_MAJOR } else { PAIRS };
    PACKED.with_borrow_mut(|packed| {
        packed.resize(KC * STEP + KC * 2 * PAIRS, 0.0);
        let (pb, pa) = packed.split_at_mut(KC * STEP);
        let (pb, pa) = (pb.as_mut_ptr(), pa.as_mut_ptr());
        let column_order = super::sgemm::streams_columns(k, a);
        let block = if column_order { COLUMN_BLOCK } else { KC };
        for p0 in (0..k).step_by(block) {
            let kc = block.min(k - p0);
            // SAFETY: steps p0..p0 + kc of b; the packing holds KC steps.
            unsafe { pack_b(b, p0, kc, layout, pb) };
            let load_c = accumulate || p0 > 0;
            let whole = if a.rows == 1 || row_major { m / tile_rows * tile_rows } else { 0 };
            for i0 in (0..whole).step_by(tile_rows) {
                // The tile after this one in loop order: the next rows of this
                // contraction block, else the first rows of the next block.
                let next = if i0 + tile_rows < whole {
                    a.ptr.wrapping_add((i0 + tile_rows) * a.rows + p0 * a.cols)
                } else if p0 + block < k && whole > 0 {
                    a.ptr.wrapping_add((p0 + block) * a.cols)
                } else {
                    std::ptr::null()
                };
                // SAFETY: rows i0..i0 + tile_rows and steps p0..p0 + kc of a;
                // the tile's rows of c are below m.
                unsafe {
                    let first = a.ptr.add(i0 * a.rows + p0 * a.cols);
                    let c_tile = c.ptr.add(i0 * c.ldc);
                    let out = (c_tile, c.ldc, tile_rows, load_c);
                    if row_major {
                        tile::<PAIRS_ROW_MAJOR>(kc, (first, a.rows, 1), next, pb, layout, out);
                    } else {
                        tile::<PAIRS>(kc, (first, 1, a.cols), next, pb, layout, out);
                    }
                }
            }
            // The rows left (all of them for an operand with neither unit
            // stride), packed a tile at a time.
            for i0 in (whole..m).step_by(2 * PAIRS) {
                // SAFETY: rows i0.. of a and c, the packed block of steps p0...
                unsafe { packed_tile(a, (i0, m), (p0, kc), pa, pb, layout, c, accumulate) };
            }
        }
    });
}

/// [`paired_gemm`] in row order ([`super::sgemm::streams_rows`]): all of `b`
/// packed once, then each tile of row pairs through every block of [`KC`]
/// steps, its rows of `c` accumulating block after block, prefetching the
/// tile's next block (or the next tile's first) while it computes one.
///
/// # Safety
/// As for [`paired_gemm`], with a row-major `a`.
unsafe fn paired_row_streams(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    let layout = Layout::of(n);
    let tile_rows = 2 * PAIRS_ROW_MAJOR;
    let b_floats = k.div_ceil(KC) * KC * STEP;
    PACKED.with_borrow_mut(|packed| {
        packed.resize(b_floats + KC * 2 * PAIRS, 0.0);
        let (pb, pa) = packed.split_at_mut(b_floats);
        let (pb, pa) = (pb.as_mut_ptr(), pa.as_mut_ptr());
        for p0 in (0..k).step_by(KC) {
            // SAFETY: steps p0.. of b; block p0 / KC of the packing.
            unsafe { pack_b(b, p0, KC.min(k - p0), layout, pb.add(p0 * STEP)) };
        }
        let whole = m / tile_rows * tile_rows;
        for i0 in (0..whole).step_by(tile_rows) {
            for p0 in (0..k).step_by(KC) {
                let next = super::sgemm::next_in_row_order(a, (i0, tile_rows, whole), (p0, KC, k));
                // SAFETY: rows i0..i0 + tile_rows and steps p0.. of a; the
                // tile's rows of c are below m.
                unsafe {
                    let first = a.ptr.add(i0 * a.rows + p0);
                    let out = (c.ptr.add(i0 * c.ldc), c.ldc, tile_rows, accumulate || p0 > 0);
                    let kc = KC.min(k - p0);
                    tile::<PAIRS_ROW_MAJOR>(kc, (first, a.rows, 1), next, pb.add(p0 * STEP), layout, out);
                }
            }
        }
        for i0 in (whole..m).step_by(2 * PAIRS) {
            for p0 in (0..k).step_by(KC) {
                // SAFETY: rows i0.. of a and c, block p0 / KC of the packed b.
                unsafe {
                    packed_tile(
                        a,
                        (i0, m),
                        (p0, KC.min(k - p0)),
                        pa,
                        pb.add(p0 * STEP),
                        layout,
                        c,
                        accumulate,
                    )
                };
            }
        }
    });
}

/// Rows `i0..` (at most `2 * PAIRS`, below `m`) of `c (=|+=)` steps
/// `p0..p0 + kc` of `a` times the packed block `pb`: the rows of `a` packed
/// into `pa` first as rows one float apart, zero past the last, for an
/// operand with neither unit stride or a ragged last tile.
///
/// # Safety
/// Those rows and steps are inside `a`, the rows inside `c`; `pa` holds
/// `KC * 2 * PAIRS` floats, `pb` `kc` packed steps.
#[allow(clippy::too_many_arguments)]
unsafe fn packed_tile(
    a: Operand,
    (i0, m): (usize, usize),
    (p0, kc): (usize, usize),
    pa: *mut f32,
    pb: *const f32,
    layout: Layout,
    c: Output,
    accumulate: bool,
) {
    let live = (2 * PAIRS).min(m - i0);
    for p in 0..kc {
        for r in 0..2 * PAIRS {
            // SAFETY: row i0 + r < m, step p0 + p of a; slot p·16 + r of the tile packing.
            unsafe {
                *pa.add(p * 2 * PAIRS + r) =
                    if r < live { *a.ptr.add((i0 + r) * a.rows + (p0 + p) * a.cols) } else { 0.0 };
            }
        }
    }
    // SAFETY: the packed tile holds kc steps of 2·PAIRS rows; rows below m of c.
    unsafe {
        let out = (c.ptr.add(i0 * c.ldc), c.ldc, live, accumulate || p0 > 0);
        tile::<PAIRS>(kc, (pa.cast_const(), 1, 2 * PAIRS), std::ptr::null(), pb, layout, out)
    };
}

/// Packs steps `p0..p0 + kc` of `b` in the three-vector layout of
/// [`Layout`]: masked vector loads where `b` is row-major, element by element
/// otherwise.
///
/// # Safety
/// AVX-512F is available; the steps are inside `b`; `dst` holds `kc * STEP` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_b(b: Operand, p0: usize, kc: usize, layout: Layout, dst: *mut f32) {
    let (n, tail) = (layout.n, layout.first_tail());
    let (first, last) = (layout.first_row_lanes(), layout.last_lanes());
    for p in 0..kc {
        // SAFETY: step p0 + p of b (contract); slots p·STEP.. of dst.
        unsafe {
            let out = dst.add(p * STEP);
            if b.cols == 1 {
                // Masked-off lanes are not read, so the second load may start
                // `tail` floats before the row.
                let row = b.ptr.add((p0 + p) * b.rows);
                let head = _mm512_loadu_ps(row);
                let middle = _mm512_mask_blend_ps(
                    !first,
                    _mm512_maskz_loadu_ps(first, row.add(16)),
                    _mm512_maskz_loadu_ps(!first, row.wrapping_sub(tail)),
                );
                let rest = _mm512_maskz_loadu_ps(last, row.add(32 - n));
                _mm512_storeu_ps(out, head);
                _mm512_storeu_ps(out.add(16), middle);
                _mm512_storeu_ps(out.add(32), rest);
            } else {
                for slot in 0..STEP {
                    *out.add(slot) =
                        layout.column_of(slot).map_or(0.0, |j| *b.ptr.add((p0 + p) * b.rows + j * b.cols));
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn pack_b(_b: Operand, _p0: usize, _kc: usize, _layout: Layout, _dst: *mut f32) {
    unreachable!("paired_gemm runs only where `available()` is true")
}

/// Where the columns of a row pair sit in the three vectors.
#[derive(Debug, Clone, Copy)]
struct Layout {
    n: usize,
}

impl Layout {
    fn of(n: usize) -> Self {
        Layout { n }
    }

    /// Row `i`'s columns in the middle vector: lanes `0..first_tail`.
    fn first_tail(self) -> usize {
        self.n - 16
    }

    /// The middle vector's lanes that hold row `i` (the rest hold row `i + 1`).
    fn first_row_lanes(self) -> u16 {
        (1u16 << self.first_tail()) - 1
    }

    /// The last vector's lanes that hold columns (the rest are padding).
    fn last_lanes(self) -> u16 {
        ((1u32 << (2 * self.n - 32)) - 1) as u16
    }

    /// The column of `b` a slot of a packed step holds (`None`: padding).
    fn column_of(self, slot: usize) -> Option<usize> {
        let (n, tail) = (self.n, self.first_tail());
        match slot {
            0..16 => Some(slot),
            16..32 if slot - 16 < tail => Some(slot),
            16..32 => Some(slot - 16 - tail),
            _ if slot - 32 < 2 * n - 32 => Some(32 - n + slot - 32),
            _ => None,
        }
    }
}

/// One tile of `2 * P` rows (`live` of them stored): `c (=|+=)` their `kc`
/// steps times the packed block. `rows` is `(a, row_stride, step)`: row `r`'s
/// step `p` is at `a + r * row_stride + p * step`. `out` is `(c, ldc, live,
/// load_c)`. Unless `prefetch` is null (the next tile, laid out as this
/// one), each step also fetches one of its lines: the next tile's operand
/// streams from memory (a weight gradient's transposed activations, whose
/// steps are a whole row apart, a stride the hardware prefetcher does not
/// follow), and this tile's arithmetic hides the fetches.
///
/// # Safety
/// AVX-512F is available; those elements of `a` are readable; `packed` holds
/// `kc` packed steps; `c` addresses `live` rows of `n` elements, `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const P: usize>(
    kc: usize,
    (a, row_stride, step): (*const f32, usize, usize),
    prefetch: *const f32,
    packed: *const f32,
    layout: Layout,
    (c, ldc, live, load_c): (*mut f32, usize, usize, bool),
) {
    let (n, tail) = (layout.n, layout.first_tail());
    let second = !layout.first_row_lanes();
    let mut acc: [[__m512; 3]; P] = [[_mm512_setzero_ps(); 3]; P];
    for p in 0..kc {
        if !prefetch.is_null() {
            // Rows one apart: step p's line. Otherwise line p / 2P of row
            // p % 2P, so the steps together cover every line of the rows.
            let at = if row_stride == 1 { p * step } else { (p % (2 * P)) * row_stride + (p / (2 * P)) * 16 };
            // A hint only: the address need not be inside `a`.
            _mm_prefetch::<_MM_HINT_T0>(prefetch.wrapping_add(at).cast());
        }
        // SAFETY: step p of the packed block and of every row (contract).
        unsafe {
            let bp = packed.add(p * STEP);
            let (b0, b1, b2) =
                (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)), _mm512_loadu_ps(bp.add(32)));
            for (q, acc_q) in acc.iter_mut().enumerate() {
                let x0 = _mm512_set1_ps(*a.add(2 * q * row_stride + p * step));
                let x1 = _mm512_set1_ps(*a.add((2 * q + 1) * row_stride + p * step));
                let xm = _mm512_mask_blend_ps(second, x0, x1);
                acc_q[0] = _mm512_fmadd_ps(x0, b0, acc_q[0]);
                acc_q[1] = _mm512_fmadd_ps(xm, b1, acc_q[1]);
                acc_q[2] = _mm512_fmadd_ps(x1, b2, acc_q[2]);
            }
        }
    }
    // (vector, row of the pair, offset of lane 0 in that row, lanes).
    let parts = [
        (0, 0, 0isize, u16::MAX),
        (1, 0, 16, layout.first_row_lanes()),
        (1, 1, -(tail as isize), second),
        (2, 1, 32 - n as isize, layout.last_lanes()),
    ];
    for (q, acc_q) in acc.iter().enumerate() {
        for &(v, row, offset, mask) in &parts {
            let r = 2 * q + row;
            if r >= live {
                continue;
            }
            // SAFETY: the masked lanes address columns 0..n of row r < live;
            // masked-off lanes are neither read nor written.
            unsafe {
                let at = c.add(r * ldc).offset(offset);
                let value =
                    if load_c { _mm512_add_ps(_mm512_maskz_loadu_ps(mask, at), acc_q[v]) } else { acc_q[v] };
                _mm512_mask_storeu_ps(at, mask, value);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile<const P: usize>(
    _kc: usize,
    _rows: (*const f32, usize, usize),
    _prefetch: *const f32,
    _packed: *const f32,
    _layout: Layout,
    _out: (*mut f32, usize, usize, bool),
) {
    unreachable!("paired_gemm runs only where `available()` is true")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::sgemm::triple_loop;

    #[test]
    fn the_packed_layout_holds_each_column_of_both_rows_once() {
        for n in MIN_COLS..=MAX_COLS {
            let layout = Layout::of(n);
            let mut seen = vec![0; n];
            for slot in 0..STEP {
                if let Some(j) = layout.column_of(slot) {
                    seen[j] += 1;
                }
            }
            // Each column appears twice: once for each row of the pair.
            assert_eq!(seen, vec![2; n], "n = {n}");
        }
    }

    /// Ragged row tiles, both layouts of `a` and `b`, several contraction
    /// blocks, a padded `ldc` and accumulation, against an f64 loop.
    #[test]
    fn matches_a_triple_loop() {
        if !available() {
            println!("skipped: this host has no AVX-512F, its products of 17 to 24 columns use sgemm");
            return;
        }
        let shapes = [(1, 24, 1), (2, 17, 3), (16, 24, 64), (37, 20, 300), (5, 23, 513), (64, 24, 40)];
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            for layout in [(false, false, false), (true, true, true), (false, true, true)] {
                let ldc = if case % 2 == 0 { n } else { n + 5 };
                triple_loop::check(case as u64, (m, n, k), layout, (ldc, false), |a, b, c, acc| unsafe {
                    paired_gemm(m, n, k, a, b, c, acc)
                });
            }
        }
    }

    /// Row-major products over several contraction blocks walk each tile's
    /// rows whole: the same bits as block order (whole tiles, a ragged last
    /// tile, a ragged last block) and the same values as an f64 loop.
    #[test]
    fn row_order_gives_the_bits_of_block_order() {
        if !available() {
            println!("skipped: this host has no AVX-512F, its products of 17 to 24 columns use sgemm");
            return;
        }
        let shapes = [(37, 20, 600), (24, 24, 1024), (5, 17, 257)];
        for &(m, n, k) in &shapes {
            let row_major = Operand { ptr: std::ptr::null(), rows: k, cols: 1 };
            assert!(super::super::sgemm::streams_rows(k, row_major, KC, STEP), "{m}x{n}x{k} streams rows");
        }
        triple_loop::check_orders(&shapes, 5, paired_gemm, paired_blocks);
    }

    /// Products with a column-major `a` (coefficient weight gradients) run in
    /// column order: block after block of [`COLUMN_BLOCK`] steps, whatever
    /// the thread split (whole tiles, ragged last tiles and blocks).
    #[test]
    fn column_order_adds_its_blocks_in_order_whatever_the_split() {
        if !available() {
            println!("skipped: this host has no AVX-512F, its products of 17 to 24 columns use sgemm");
            return;
        }
        let shapes = [(64, 24, 300), (37, 20, 129), (16, 17, 65), (90, 23, KC + 3)];
        let stride = super::super::sgemm::COLUMN_MIN_STRIDE + 5;
        triple_loop::check_column_order(&shapes, stride, COLUMN_BLOCK, paired_gemm);
    }
}
