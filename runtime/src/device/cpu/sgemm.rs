//! Single-threaded f32 matrix product with AVX-512 or AVX2 (`c (=|+=) a @ b`),
//! the Cpu device's GEMM on hosts that have either.
//!
//! Why its own kernel: the `gemm` crate reaches AVX-512 only on a nightly
//! compiler, so on stable it runs 256-bit FMAs, which use half of an
//! AVX-512 core's arithmetic (a Zen 5 core retires two 512-bit FMAs per
//! cycle). The backbone's projections are most of a training step (docs/architecture.md
//! §6), so they decide its speed. On AVX2 hosts the crate's kernels are
//! 256-bit too; there this kernel's 6 x 16 tile takes the products whose `a`
//! is row-major and read in place (the projections forward and the input
//! gradients; a 3 x 24 tile those of 17 to 24 columns, the coefficient
//! projections), a 16 x 6 tile the narrow ones whose `a` is column-major (the
//! weight gradients of routers and coefficient projections), which it runs
//! faster, and leaves the others to the crate ([`Isa::takes`]).
//!
//! Structure (the classic blocked scheme): for each block of `KC` contraction
//! steps and `NC` columns, `b` is packed into column slivers of `NR` floats
//! per step; for each block of `MC` rows, `a` is packed into row slivers of
//! `MR` floats per step (or read in place where packing would not pay); a
//! register-tiled micro-kernel then accumulates each `MR x NR` tile of `c`
//! over the block's steps (the `b` sliver stays in L1,
//! the packed `a` block in L2). Packing reads the operands through arbitrary
//! row and column strides, so transposed operands cost nothing extra, and pads
//! ragged edges with zeros, so the micro-kernel always runs full tiles and
//! only the stores to `c` are masked. Where `a` streams from memory (read in
//! place column-major, or row-major with short rows under one column sliver)
//! the micro-kernels also prefetch the next block's slivers while they
//! compute the current one. The tile's shape and the few operations that
//! depend on the vector width are a [`Tile`]: 14 x 32 with AVX-512, 6 x 16,
//! 3 x 24 and 16 x 6 with AVX2; the drivers are compiled once for each.
//!
//! Each product's sum over `k` runs in order within a `KC` block, blocks
//! added in order, one FMA per step: deterministic and independent of the
//! thread split (threads own disjoint bands of `c`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m256, __m256i, __m512, _mm256_add_ps, _mm256_broadcast_ss, _mm256_castps256_ps128, _mm256_cmpgt_epi32,
    _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_maskload_ps, _mm256_permute2f128_ps,
    _mm256_set1_epi32, _mm256_setr_epi32, _mm256_setr_ps, _mm256_setzero_ps, _mm256_shuffle_ps,
    _mm256_storeu_ps, _mm256_stream_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps, _mm512_add_ps,
    _mm512_castpd_ps, _mm512_castps_pd, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_loadu_ps,
    _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4,
    _mm512_storeu_ps, _mm512_stream_ps, _mm512_unpackhi_pd, _mm512_unpackhi_ps, _mm512_unpacklo_pd,
    _mm512_unpacklo_ps, _mm_castps_pd, _mm_movehl_ps, _mm_prefetch, _mm_sfence, _mm_store_sd, _mm_store_ss,
    _mm_storeu_ps, _MM_HINT_T0,
};
use std::cell::RefCell;

/// Contraction steps per packed block: a `b` sliver (`KC * NR` floats, 32 KiB
/// with AVX-512) fits in L1 next to the streamed `a` sliver.
const KC: usize = 256;
/// Columns per packed `b` panel (`KC * NC` floats, 1 MiB).
#[cfg(target_arch = "x86_64")]
const NC: usize = 1024;

/// A read-only operand: element `(i, j)` is at `ptr + i * rows + j * cols`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: *const f32,
    pub rows: usize,
    pub cols: usize,
}

/// A writable `c`: row `i` starts at `ptr + i * ldc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    pub ptr: *mut f32,
    pub ldc: usize,
    /// Write whole aligned vectors with non-temporal stores where `c` is
    /// written once (no accumulation, one contraction block): for an output
    /// far larger than the last-level cache, which the next step reads back
    /// from memory anyway, they skip reading every line before writing it.
    pub stream: bool,
}

/// Whether a product over `k` contraction steps writes each element of `c`
/// once (one contraction block).
pub(crate) fn single_pass(k: usize) -> bool {
    k <= KC
}

/// The vector instruction sets [`sgemm_on`] has a tile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F: a 14 x 32 tile, 28 of the 32 512-bit registers.
    Avx512,
    /// AVX2 with FMA: a 6 x 16 tile, 12 of the 16 256-bit registers (3 x 24
    /// for 17 to 24 columns, 16 x 6 for a column-major `a`).
    Avx2,
}

impl Isa {
    /// The widest set this host runs (checked once), if any.
    pub(crate) fn host() -> Option<Isa> {
        use std::sync::OnceLock;
        static HOST: OnceLock<Option<Isa>> = OnceLock::new();
        *HOST.get_or_init(|| Isa::supported().first().copied())
    }

    /// Every set this host runs, widest first.
    pub(crate) fn supported() -> Vec<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = std::arch::is_x86_feature_detected!("avx512f");
            let avx2 =
                std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
            [(avx512, Isa::Avx512), (avx2, Isa::Avx2)]
                .into_iter()
                .filter(|&(on, _)| on)
                .map(|(_, isa)| isa)
                .collect()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Vec::new()
        }
    }

    /// The micro-tile's rows and columns for a product of `n` columns whose
    /// `a` is laid out as `a`, for callers that split work by whole tiles.
    pub(crate) fn tile(self, n: usize, a: Operand) -> (usize, usize) {
        match self {
            Isa::Avx512 => AVX512_TILE,
            Isa::Avx2 if is_column_major(a) => AVX2_TALL_TILE,
            Isa::Avx2 if avx2_narrow(n, a) => AVX2_NARROW_TILE,
            Isa::Avx2 => AVX2_TILE,
        }
    }
}

/// Whether `a`'s rows are one apart and its columns not (a transposed operand).
fn is_column_major(a: Operand) -> bool {
    a.rows == 1 && a.cols > 1
}

/// Rows and columns of the AVX-512 tile.
const AVX512_TILE: (usize, usize) = (14, 32);
/// Rows and columns of the AVX2 tile.
const AVX2_TILE: (usize, usize) = (6, 16);
/// Rows and columns of the AVX2 tile for products of 17 to 24 columns.
const AVX2_NARROW_TILE: (usize, usize) = (3, 24);

/// Whether an AVX2 product of `n` columns whose `a` is laid out as `a` runs
/// on [`Avx2Narrow`]: a row-major `a` (the column-major one has its own tile)
/// under 17 to 24 columns, which the 6 x 16 tile pads to 32.
fn avx2_narrow(n: usize, a: Operand) -> bool {
    !is_column_major(a) && (AVX2_TILE.1 + 1..=AVX2_NARROW_TILE.1).contains(&n)
}

impl Isa {
    /// Whether [`sgemm_on`] with this set's tiles takes a product of `m` rows
    /// and `n` columns whose `a` is laid out as `a`, one of `batch` entries
    /// (else the `gemm` crate does). AVX-512 takes every product. AVX2 takes
    /// - a row-major `a` read in place over at least a packed block of rows
    ///   (6 x 16 tile): in training-step profiles those ran faster than the
    ///   `gemm` crate's;
    /// - a row-major `a` of fewer rows in a batched product: attention's
    ///   per-head products, which the Cpu device runs in a chain with their
    ///   operands in cache (`codegen::plan::Chain`), where the tile beats the
    ///   crate (streamed from memory step by step, before chains, the crate
    ///   had been faster);
    /// - a column-major `a` under at most [`AVX2_TALL_MAX_COLS`] columns (16
    ///   x 6 tile): the weight gradients of routers and coefficient
    ///   projections (`4096 x 32`, `1024 x 24` over 2048 tokens) and products
    ///   of 64 to 128 columns run faster than in the crate. The backbone's
    ///   wider ones (256 to 768 columns) gain too since the tile's packing
    ///   reads the next block from cache (`NextColumns`).
    pub(crate) fn takes(self, m: usize, n: usize, a: Operand, batch: usize) -> bool {
        match self {
            Isa::Avx512 => true,
            Isa::Avx2 if is_column_major(a) => n <= AVX2_TALL_MAX_COLS,
            Isa::Avx2 => a.cols == 1 && a.rows > 1 && (m >= AVX2_MIN_ROWS || batch > 1),
        }
    }
}

/// Widest product with a column-major `a` that AVX2 runs on its own tile
/// (see [`Isa::takes`]): above the widest measured (768 columns), with room
/// for the backbone's 4·D at D = 256.
const AVX2_TALL_MAX_COLS: usize = 1024;

/// Rows of `c` from which AVX2 products go to [`sgemm_on`] (see
/// [`Isa::takes`]): one packed block of rows of the AVX2 tile.
const AVX2_MIN_ROWS: usize = 96;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Packing space reused across calls on each thread: `a` block then `b`
    /// panel, in 64-byte lines so vector loads are aligned.
    static PACKED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's packing space, grown to at least `floats`
/// floats in whole 64-byte lines, from its first float.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn with_packing<R>(floats: usize, f: impl FnOnce(*mut f32) -> R) -> R {
    PACKED.with_borrow_mut(|packed| {
        let lines = floats.div_ceil(16);
        if packed.len() < lines {
            packed.resize(lines, Line([0.0; 16]));
        }
        f(packed.as_mut_ptr().cast::<f32>())
    })
}

/// One cache line of floats.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// The register tile of one vector instruction set: its shape and the
/// operations whose code depends on the vector width. The drivers
/// ([`sgemm_blocks`], [`sgemm_row_streams`]) and the packing are generic over
/// it and inlined into each set's entry point, so they compile with its
/// instructions.
#[cfg(target_arch = "x86_64")]
trait Tile {
    /// Rows of `c` per micro-tile.
    const MR: usize;
    /// Columns of `c` per micro-tile.
    const NR: usize;
    /// Rows per packed `a` block (`MC * KC` floats, about 100 KiB, in L2).
    const MC: usize;
    /// Whether whole slivers of a column-major `a` are read in place rather
    /// than packed: only where a step's `MR` rows fill most of a cache line.
    const READS_COLUMNS_IN_PLACE: bool;
    /// Longest contraction block for which [`sgemm_blocks`] walks the tiles
    /// of a block of rows band by band (each `MR`-row band through every
    /// column sliver) rather than sliver by sliver, unless `c` is streamed.
    /// Over so few steps a tile's arithmetic is short next to writing it, and
    /// the product waits on `c`'s lines: band by band, `MR` rows of `c` fill
    /// in order, streams the hardware prefetcher follows, where sliver by
    /// sliver every tile starts `MR` new lines scattered over the block's
    /// rows. Each tile's sums are the same either way.
    const ROW_BANDS_MAX_STEPS: usize;

    /// One `MR x NR` tile: `c (=|+=) a_sliver @ b_sliver` over `kc` steps,
    /// storing only the tile's first `rows` rows and `cols` columns. Row `r`
    /// of step `p` of the `a` sliver is at `a.ptr + r * a.rows + p * a.cols`
    /// (packed: `rows = 1`, `cols = MR`). Unless `prefetch` is null (it
    /// addresses a sliver laid out as `a` is), the steps also prefetch that
    /// sliver's lines: step `p`'s rows where rows are one apart, else one
    /// line of one row a step, so the steps together cover the sliver's rows.
    ///
    /// # Safety
    /// The set is available; the `a` sliver holds `kc` steps of `MR` rows, the
    /// `b` sliver `kc * NR` floats; `c` addresses `rows` rows of `cols`
    /// elements.
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_kernel<const UNIT_ROWS: bool>(
        kc: usize,
        a: Operand,
        b: *const f32,
        c: Output,
        rows: usize,
        cols: usize,
        load_c: bool,
        prefetch: *const f32,
    );

    /// Copies the first `len` of `n <= NR` contiguous floats with vector
    /// moves and zero-fills the rest up to `n` (a plain copy of a short run
    /// becomes a `memmove` call).
    ///
    /// # Safety
    /// The set is available; `src` holds `len` floats and `dst` `n`, `len <= n`.
    unsafe fn copy_row(src: *const f32, dst: *mut f32, len: usize, n: usize);

    /// Packs `kc` steps of `NR` whole columns of a column-major `b` (column
    /// `j`'s steps contiguous from `first + j * stride`) as a sliver of `NR`
    /// floats a step, transposing in registers (an element-wise copy
    /// compiles to gathers and took about as long as the attention scores'
    /// arithmetic).
    ///
    /// # Safety
    /// The set is available; the columns hold `kc` floats each and `dst`
    /// `kc * NR`.
    unsafe fn pack_columns(first: *const f32, stride: usize, kc: usize, dst: *mut f32);
}

/// `c(i, j) (=|+=) sum_p a(i, p) * b(p, j)` for `i < m`, `j < n`,
/// `p < k`, with `k >= 1`, with the tile of `isa`.
///
/// # Safety
/// `isa` is among [`Isa::supported`]; `a` addresses `m x k` elements and `b`
/// `k x n` elements through their strides; `c` addresses `m` rows of `n`
/// writable elements and overlaps neither operand.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_on(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    debug_assert!(Isa::supported().contains(&isa) && k >= 1);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded contract; the set is available.
    unsafe {
        match isa {
            Isa::Avx512 => sgemm_avx512(m, n, k, a, b, c, accumulate, false),
            Isa::Avx2 if is_column_major(a) => sgemm_avx2_tall(m, n, k, a, b, c, accumulate, false),
            Isa::Avx2 if avx2_narrow(n, a) => sgemm_avx2_narrow(m, n, k, a, b, c, accumulate, false),
            Isa::Avx2 => sgemm_avx2(m, n, k, a, b, c, accumulate, false),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no tile on this architecture: {isa:?} {m} {n} {k} {a:?} {b:?} {c:?} {accumulate}")
}

/// [`sgemm_on`] in block order whatever the shape ([`sgemm_blocks`]): what
/// the row order is checked against.
///
/// # Safety
/// As for [`sgemm_on`].
#[cfg(all(test, target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_blocks_on(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    // SAFETY: forwarded contract.
    unsafe {
        match isa {
            Isa::Avx512 => sgemm_avx512(m, n, k, a, b, c, accumulate, true),
            Isa::Avx2 if is_column_major(a) => sgemm_avx2_tall(m, n, k, a, b, c, accumulate, true),
            Isa::Avx2 if avx2_narrow(n, a) => sgemm_avx2_narrow(m, n, k, a, b, c, accumulate, true),
            Isa::Avx2 => sgemm_avx2(m, n, k, a, b, c, accumulate, true),
        }
    }
}

/// The entry point of one instruction set: the generic drivers inlined into a
/// function compiled for it.
macro_rules! entry_point {
    ($name:ident, $tile:ty, $features:literal) => {
        /// [`sgemm_on`] for one instruction set; `blocks_only` keeps block
        /// order whatever the shape.
        ///
        /// # Safety
        /// As for [`sgemm_on`].
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            m: usize,
            n: usize,
            k: usize,
            a: Operand,
            b: Operand,
            c: Output,
            accumulate: bool,
            blocks_only: bool,
        ) {
            // SAFETY: forwarded contract.
            unsafe {
                if !blocks_only && n <= <$tile>::NR && streams_rows(k, a, KC, <$tile>::NR) {
                    sgemm_row_streams::<$tile>(m, n, k, a, b, c, accumulate);
                } else if !blocks_only
                    && n <= <$tile>::NR
                    && <$tile>::READS_COLUMNS_IN_PLACE
                    && streams_columns(k, a)
                {
                    sgemm_column_streams::<$tile>(m, n, k, a, b, c, accumulate);
                } else {
                    sgemm_blocks::<$tile>(m, n, k, a, b, c, accumulate);
                }
                if c.stream {
                    // Non-temporal stores are weakly ordered: make them visible
                    // before the pool's completion flag tells other threads to
                    // read `c`.
                    _mm_sfence();
                }
            }
        }
    };
}
entry_point!(sgemm_avx512, Avx512, "avx512f");
entry_point!(sgemm_avx2, Avx2, "avx2,fma");
entry_point!(sgemm_avx2_narrow, Avx2Narrow, "avx2,fma");
entry_point!(sgemm_avx2_tall, Avx2Tall, "avx2,fma");

/// Floats of packed `b` a product may hold at once to walk its rows whole
/// ([`streams_rows`]): 512 KiB, half of the L2 of the hosts this runs on,
/// where it stays while the rows stream past.
const ROW_STREAMS_MAX_PACKED_B: usize = 1 << 17;

/// Whether a product under a single column tile walks each tile's rows of
/// `a` through every contraction block before the next tile
/// ([`sgemm_row_streams`], and the same order in [`super::paired_gemm`])
/// instead of every tile through one block at a time: for a row-major `a`
/// read in place whose rows span several blocks of `block` steps (a router
/// or coefficient projection over a whole expanded state, docs/math.md §4.3,
/// §6.2: `2048 x 32 x 4096` for xHC), with all of `b`, `packed_step` floats a
/// step, within [`ROW_STREAMS_MAX_PACKED_B`].
///
/// Why: in block order each tile reads one block's stretch of its rows (1 KiB
/// of a 16 KiB row) and jumps to the next tile, so every row is a string of
/// short streams the hardware prefetcher keeps losing, and prefetching the
/// next tile's stretch made it slower. Row by row, each of a tile's rows is
/// one long sequential stream, and while it computes one block the tile
/// prefetches its next. Each element still adds its blocks in
/// order, so the result is the same bits.
pub(crate) fn streams_rows(k: usize, a: Operand, block: usize, packed_step: usize) -> bool {
    let row_major = a.cols == 1 && a.rows > 1;
    row_major && k > block && k.div_ceil(block) * block * packed_step <= ROW_STREAMS_MAX_PACKED_B
}

/// Contraction steps a block holds in column order ([`streams_columns`]):
/// each block's steps are that many rows of the activations read side by
/// side, so few enough for the hardware prefetcher to follow each as a
/// stream, and enough that a tile's arithmetic outweighs loading and storing
/// its part of `c` once a block. 32 was the fastest of 16 to 128 on xHC's
/// router weight gradient, the product this order is for.
pub(crate) const COLUMN_BLOCK: usize = 32;

/// Floats past its own rows that each step of a tile in column order
/// prefetches in that step's row of the activations: four 14-row tiles
/// ahead, the lines the tile after next reaches while this one computes.
/// Measured as for [`COLUMN_BLOCK`]: the farthest of none, 28 and 56 floats
/// was the fastest.
const COLUMN_AHEAD: usize = 56;

/// Whether a product with a column-major `a` (a weight gradient's transposed
/// activations, `x^T @ dy`) under a single column tile walks every tile
/// through one short block of [`COLUMN_BLOCK`] steps before the next block
/// ([`sgemm_column_streams`], and the same order in [`super::paired_gemm`]
/// with its own block) instead of a block of rows through [`KC`] steps.
///
/// Why: `a`'s step `p` is row `p` of the activations, so in block order a
/// block of 112 rows of `c` over 256 steps reads 448 bytes of each of 256
/// activation rows a whole row apart, 256 short runs no prefetcher follows
/// (the connections' coefficient and router weight gradients, docs/math.md §4.3,
/// §6.2, ran at a third of their roofline). In column order the tiles walk
/// along a block's few rows, each row one sequential stream, and each tile
/// prefetches the lines of the tile after next. Every element still adds
/// its blocks in order from step 0, so the bits do not depend on the
/// thread split.
pub(crate) fn streams_columns(k: usize, a: Operand) -> bool {
    is_column_major(a) && a.cols >= COLUMN_MIN_STRIDE && k > COLUMN_BLOCK
}

/// Floats between a column-major `a`'s steps from which [`streams_columns`]
/// takes a product: a 4 KiB page, so each step starts a page of its own.
/// Below it a block's steps lie close together and block order reads them
/// as one sequential run, faster than column order (VWN's `64 x 24 x 32768`
/// coefficient weight gradients, 256 bytes a step).
pub(crate) const COLUMN_MIN_STRIDE: usize = 1024;

/// In row order ([`streams_rows`]), what the tile of `rows` rows of a
/// row-major `a` at row `i` prefetches while it computes the contraction
/// block at step `p` (blocks of `block` steps, `k` in all; whole tiles below
/// row `whole`): its own next block, else the next tile's first, else
/// nothing (null). A prefetch never faults: no bounds to keep.
pub(crate) fn next_in_row_order(
    a: Operand,
    (i, rows, whole): (usize, usize, usize),
    (p, block, k): (usize, usize, usize),
) -> *const f32 {
    if p + block < k {
        a.ptr.wrapping_add(i * a.rows + p + block)
    } else if i + rows < whole {
        a.ptr.wrapping_add((i + rows) * a.rows)
    } else {
        std::ptr::null()
    }
}

/// The product in block order: for each block of `KC` steps, every tile.
///
/// # Safety
/// As for [`sgemm_on`], with `T`'s set available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sgemm_blocks<T: Tile>(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    let (mr, nr) = (T::MR, T::NR);
    let a_lines = (T::MC * KC).div_ceil(16);
    let b_lines = NC.min(n.div_ceil(nr) * nr) * KC / 16;
    // Whole `MR`-row slivers of `a` are read in place, unpacked: a
    // column-major `a` (a transposed operand, as in weight gradients) already
    // holds each step's rows together, and a row-major sliver's `MR` rows of
    // `KC` steps (14 KiB with AVX-512) stay in L1 while the micro-kernel
    // walks the block's column slivers, so packing only copied what L1
    // already serves. Only a ragged last sliver is
    // packed, with its zero padding. AVX2's 6-row sliver of a column-major
    // `a` holds 24 bytes of each step's line: read in place, its 256 lines
    // and the `b` sliver fill L1, and the backbone's weight gradients ran at
    // two thirds the speed of the `gemm` crate's; packed, they do not.
    let reads_in_place = (a.rows == 1 && T::READS_COLUMNS_IN_PLACE) || a.cols == 1;
    // Operands the micro-kernels stream from memory wait on their first
    // reads of each block, so while they walk one block (on its first column
    // sliver), each fetches, one line a step, the same sliver of the block
    // that comes next: its lines arrive spread over this block's arithmetic.
    // - A column-major `a` read in place (a weight gradient's transposed
    //   activations) reaches each step's rows a whole activation row apart,
    //   a stride the hardware prefetcher does not follow.
    // - A row-major `a` with short rows (a contraction of at most one block)
    //   under a single column sliver (a coefficient projection's 24 outputs)
    //   is read once, sliver after sliver; wider products reuse each sliver
    //   from cache across their column slivers, and prefetching there only
    //   takes issue slots (the backbone's products got slower).
    let prefetches_next_block =
        (a.rows == 1 && a.cols > 1) || (a.cols == 1 && a.rows > 1 && a.rows <= KC && n <= nr);
    with_packing((a_lines + b_lines) * 16, |pa| {
        // SAFETY: the packing holds a_lines of a's block, then b's panel.
        let pb = unsafe { pa.add(a_lines * 16) };
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                // SAFETY: the panel is inside b (caller) and inside the packing
                // space (sized for NC columns rounded to NR, KC steps).
                unsafe { pack_b::<T>(b, pc, jc, kc, nc, pb) };
                let load_c = accumulate || pc > 0;
                for ic in (0..m).step_by(T::MC) {
                    let mc = T::MC.min(m - ic);
                    let in_place = if reads_in_place { mc / mr * mr } else { 0 };
                    // The block after this one in loop order: the next rows
                    // of this contraction block, else the first rows of the
                    // next contraction block.
                    let next_block = if !prefetches_next_block {
                        None
                    } else if ic + T::MC < m {
                        Some((ic + T::MC, pc))
                    } else if pc + KC < k {
                        Some((0, pc + KC))
                    } else {
                        None
                    };
                    // SAFETY: as for b, with the rows of the block from
                    // `in_place` on.
                    unsafe { pack_a::<T>(a, ic + in_place, pc, mc - in_place, kc, pa) };
                    // Short blocks into a cached c: each row band across
                    // every column sliver ([`Tile::ROW_BANDS_MAX_STEPS`]).
                    let rows_outer = !c.stream && kc <= T::ROW_BANDS_MAX_STEPS;
                    let (outer, inner) = if rows_outer {
                        (mc.div_ceil(mr), nc.div_ceil(nr))
                    } else {
                        (nc.div_ceil(nr), mc.div_ceil(mr))
                    };
                    // A packed column-major `a`: the next block's lines,
                    // spread over this block's micro-kernels.
                    let next_packed = match next_block {
                        Some((i, p)) if a.rows == 1 && in_place == 0 => {
                            Some(NextColumns::new(a, (i, T::MC.min(m - i)), (p, KC.min(k - p))))
                        }
                        _ => None,
                    };
                    let calls = outer * inner;
                    for o in 0..outer {
                        for i in 0..inner {
                            if let Some(next) = &next_packed {
                                next.prefetch_part(o * inner + i, calls);
                            }
                            let (jr, ir) = if rows_outer { (i * nr, o * mr) } else { (o * nr, i * mr) };
                            let sliver = if ir < in_place {
                                // SAFETY: rows ic + ir.., step pc of a.
                                Operand { ptr: unsafe { a.ptr.add((ic + ir) * a.rows + pc * a.cols) }, ..a }
                            } else {
                                // SAFETY: sliver (ir - in_place) / MR of the packing.
                                Operand { ptr: unsafe { pa.add((ir - in_place) * kc) }, rows: 1, cols: mr }
                            };
                            let tile = Output { ptr: unsafe { c.ptr.add((ic + ir) * c.ldc + jc + jr) }, ..c };
                            let (rows, cols) = (mr.min(mc - ir), nr.min(nc - jr));
                            let b_sliver = unsafe { pb.add(jr * kc) };
                            // The same sliver of the next block, from slivers
                            // read in place on this block's first column
                            // sliver (a prefetch never faults, so rows or
                            // steps past a's end are harmless).
                            let prefetch = match next_block {
                                Some((i, p)) if jr == 0 && ir < in_place => {
                                    a.ptr.wrapping_add((i + ir) * a.rows + p * a.cols)
                                }
                                _ => std::ptr::null(),
                            };
                            // SAFETY: both slivers hold kc steps of MR rows and
                            // NR columns; the tile's rows and columns are
                            // clipped to c's extent. Rows one apart (packed,
                            // column-major) get constant offsets; only a
                            // row-major a pays for a row stride.
                            unsafe {
                                if sliver.rows == 1 {
                                    T::micro_kernel::<true>(
                                        kc, sliver, b_sliver, tile, rows, cols, load_c, prefetch,
                                    );
                                } else {
                                    T::micro_kernel::<false>(
                                        kc, sliver, b_sliver, tile, rows, cols, load_c, prefetch,
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    });
}

/// The product in row order ([`streams_rows`]): all of `b` packed once, then
/// each `MR`-row sliver of `a` through every block of `KC` steps, the tile
/// of `c` accumulating block after block; while it computes one block the
/// micro-kernel prefetches the sliver's next block (or the next sliver's
/// first). A ragged last sliver is packed block by block.
///
/// # Safety
/// As for [`sgemm_on`], with `T`'s set available, `n <= NR` and a row-major `a`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sgemm_row_streams<T: Tile>(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    let (mr, nr) = (T::MR, T::NR);
    let b_floats = k.div_ceil(KC) * KC * nr;
    with_packing(b_floats + mr * KC, |pb| {
        // SAFETY: the packing holds b_floats for b, then one sliver of KC steps.
        let pa = unsafe { pb.add(b_floats) };
        for pc in (0..k).step_by(KC) {
            // SAFETY: steps pc.. of b (caller); block pc / KC of the packing.
            unsafe { pack_b::<T>(b, pc, 0, KC.min(k - pc), n, pb.add(pc * nr)) };
        }
        let whole = m / mr * mr;
        for ir in (0..m).step_by(mr) {
            let rows = mr.min(m - ir);
            // SAFETY: row ir of c is below m.
            let tile = Output { ptr: unsafe { c.ptr.add(ir * c.ldc) }, ..c };
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let load_c = accumulate || pc > 0;
                // SAFETY: block pc / KC of the packed b.
                let b_sliver = unsafe { pb.add(pc * nr) };
                if ir < whole {
                    // SAFETY: rows ir.., step pc of a.
                    let sliver = Operand { ptr: unsafe { a.ptr.add(ir * a.rows + pc) }, ..a };
                    let prefetch = next_in_row_order(a, (ir, mr, whole), (pc, KC, k));
                    // SAFETY: MR rows of kc steps of a, kc packed steps of b,
                    // the tile clipped to c's rows and n columns.
                    unsafe {
                        T::micro_kernel::<false>(kc, sliver, b_sliver, tile, rows, n, load_c, prefetch)
                    };
                } else {
                    // SAFETY: the ragged rows' block fits the sliver after b.
                    unsafe { pack_a::<T>(a, ir, pc, rows, kc, pa) };
                    let sliver = Operand { ptr: pa, rows: 1, cols: mr };
                    // SAFETY: as above, with the packed sliver.
                    unsafe {
                        T::micro_kernel::<true>(kc, sliver, b_sliver, tile, rows, n, load_c, std::ptr::null())
                    };
                }
            }
        }
    });
}

/// The product in column order ([`streams_columns`]): for each block of
/// [`COLUMN_BLOCK`] steps, `b`'s block packed, then every `MR`-row tile of
/// `c` in order, reading its rows of the column-major `a` in place and
/// prefetching [`COLUMN_AHEAD`] floats ahead in each step; a ragged last
/// tile is packed block by block.
///
/// # Safety
/// As for [`sgemm_on`], with `T`'s set available, `n <= NR`, a column-major
/// `a` and `T::READS_COLUMNS_IN_PLACE`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sgemm_column_streams<T: Tile>(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Output,
    accumulate: bool,
) {
    let (mr, nr) = (T::MR, T::NR);
    with_packing(COLUMN_BLOCK * (nr + mr), |pb| {
        // SAFETY: the packing holds one block of b, then one sliver of a.
        let pa = unsafe { pb.add(COLUMN_BLOCK * nr) };
        let whole = m / mr * mr;
        for pc in (0..k).step_by(COLUMN_BLOCK) {
            let kc = COLUMN_BLOCK.min(k - pc);
            let load_c = accumulate || pc > 0;
            // SAFETY: steps pc..pc + kc of b's n <= NR columns (caller).
            unsafe { pack_b::<T>(b, pc, 0, kc, n, pb) };
            for ir in (0..m).step_by(mr) {
                let rows = mr.min(m - ir);
                // SAFETY: row ir of c is below m.
                let tile = Output { ptr: unsafe { c.ptr.add(ir * c.ldc) }, ..c };
                if ir < whole {
                    // SAFETY: rows ir.., step pc of a.
                    let sliver = Operand { ptr: unsafe { a.ptr.add(ir + pc * a.cols) }, ..a };
                    // A hint only: the address need not be inside `a`.
                    let prefetch = sliver.ptr.wrapping_add(COLUMN_AHEAD);
                    // SAFETY: MR rows one apart over kc steps of a, kc packed
                    // steps of b, the tile clipped to c's rows and n columns.
                    unsafe { T::micro_kernel::<true>(kc, sliver, pb, tile, rows, n, load_c, prefetch) };
                } else {
                    // SAFETY: the ragged rows' block fits the sliver after b.
                    unsafe { pack_a::<T>(a, ir, pc, rows, kc, pa) };
                    let sliver = Operand { ptr: pa, rows: 1, cols: mr };
                    // SAFETY: as above, with the packed sliver.
                    unsafe {
                        T::micro_kernel::<true>(kc, sliver, pb, tile, rows, n, load_c, std::ptr::null())
                    };
                }
            }
        }
    });
}

/// The block of a column-major `a` (a weight gradient's activations) that
/// [`sgemm_blocks`] packs next, prefetched in parts while the micro-kernels
/// compute the current one: packing then reads from cache instead of waiting
/// on memory between blocks of arithmetic. Whole slivers are packed by plain
/// copies (no masks).
#[cfg(target_arch = "x86_64")]
struct NextColumns {
    /// The block's first row at its first step.
    first: *const f32,
    /// Floats between its steps.
    step_stride: usize,
    /// Lines of each step's rows.
    lines_per_step: usize,
    /// Lines of the block.
    lines: usize,
}

#[cfg(target_arch = "x86_64")]
impl NextColumns {
    /// Rows `i..i + mc` over steps `p..p + kc` of the column-major `a`.
    fn new(a: Operand, (i, mc): (usize, usize), (p, kc): (usize, usize)) -> Self {
        let lines_per_step = mc.div_ceil(16);
        let first = a.ptr.wrapping_add(i + p * a.cols);
        NextColumns { first, step_stride: a.cols, lines_per_step, lines: lines_per_step * kc }
    }

    /// Prefetches part `part` of `parts` equal parts of the block's lines.
    #[inline(always)]
    fn prefetch_part(&self, part: usize, parts: usize) {
        for offset in self.part_offsets(part, parts) {
            // SAFETY: a prefetch is a hint and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.first.wrapping_add(offset).cast()) };
        }
    }

    /// The floats from the block's first row at its first step to each line
    /// of part `part` of `parts`, in order, walked step by step (one division
    /// a part, not one a line). Together the parts list every line once.
    #[inline(always)]
    fn part_offsets(&self, part: usize, parts: usize) -> impl Iterator<Item = usize> + '_ {
        let (from, to) = (self.lines * part / parts, self.lines * (part + 1) / parts);
        let (mut step, mut within) = (from / self.lines_per_step, from % self.lines_per_step);
        (from..to).map(move |_| {
            let offset = step * self.step_stride + within * 16;
            within += 1;
            if within == self.lines_per_step {
                (step, within) = (step + 1, 0);
            }
            offset
        })
    }
}

/// Steps ahead of the one it packs that [`pack_a`] prefetches a column-major
/// `a` (a weight gradient's activations): each step's rows are a short run
/// (a block's 96 rows, six lines) a whole activation row after the last, a
/// new page the hardware prefetcher has not seen, so without it packing
/// waited on memory at every step. 4, 8 or 16 steps ahead measured alike,
/// all far faster than none (the router weight gradient).
const PACK_AHEAD: usize = 8;

/// Packs rows `i0..i0 + mc`, steps `p0..p0 + kc` of `a` as slivers of `MR`
/// rows: sliver `s` holds, for each step, its `MR` rows' values (zero past
/// row `mc`).
///
/// # Safety
/// `T`'s set is available; the block is inside `a`; `dst` holds
/// `mc.div_ceil(MR) * MR * kc` floats.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_a<T: Tile>(a: Operand, i0: usize, p0: usize, mc: usize, kc: usize, dst: *mut f32) {
    let mr = T::MR;
    if a.rows == 1 {
        // Column-major a (a transposed operand): each step's rows are
        // contiguous, so step by step the block's rows are one sequential
        // read, dealt out to the slivers.
        for p in 0..kc {
            let step = unsafe { a.ptr.add(i0 + (p0 + p) * a.cols) };
            // A hint only: the address need not be inside `a`.
            let ahead = step.wrapping_add(PACK_AHEAD * a.cols);
            for line in (0..mc).step_by(16) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
            }
            for s in 0..mc.div_ceil(mr) {
                let height = mr.min(mc - s * mr);
                unsafe { copy_run::<T>(step.add(s * mr), dst.add(s * mr * kc + p * mr), height, mr) };
            }
        }
        return;
    }
    for s in 0..mc.div_ceil(mr) {
        let sliver = unsafe { dst.add(s * mr * kc) };
        let height = mr.min(mc - s * mr);
        let first = unsafe { a.ptr.add((i0 + s * mr) * a.rows + p0 * a.cols) };
        {
            // All MR rows advance together, so every write is sequential and
            // each row is a read stream the prefetcher follows.
            for p in 0..kc {
                let out = unsafe { sliver.add(p * mr) };
                for r in 0..mr {
                    let v = if r < height { unsafe { *first.add(r * a.rows + p * a.cols) } } else { 0.0 };
                    unsafe { *out.add(r) = v };
                }
            }
        }
    }
}

/// [`Tile::copy_row`] for packing, a whole run (`len == n`, `n` a tile
/// constant) as a plain copy: the masked copy builds its masks every call,
/// and under `perf` packing took as long as the arithmetic in VWN's `64 x 24
/// x 32768` weight gradient, whose packed values each feed only four tiles.
///
/// # Safety
/// As for [`Tile::copy_row`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn copy_run<T: Tile>(src: *const f32, dst: *mut f32, len: usize, n: usize) {
    if len == n {
        // SAFETY: both runs hold `n` floats (contract).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
    } else {
        // SAFETY: forwarded contract.
        unsafe { T::copy_row(src, dst, len, n) };
    }
}

/// Packs steps `p0..p0 + kc`, columns `j0..j0 + nc` of `b` as slivers of `NR`
/// columns: sliver `s` holds, for each step, its `NR` columns' values (zero
/// past column `nc`).
///
/// # Safety
/// `T`'s set is available; the panel is inside `b`; `dst` holds
/// `nc.div_ceil(NR) * NR * kc` floats.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_b<T: Tile>(b: Operand, p0: usize, j0: usize, kc: usize, nc: usize, dst: *mut f32) {
    let nr = T::NR;
    for s in 0..nc.div_ceil(nr) {
        let sliver = unsafe { dst.add(s * nr * kc) };
        let width = nr.min(nc - s * nr);
        let first = unsafe { b.ptr.add(p0 * b.rows + (j0 + s * nr) * b.cols) };
        if b.cols == 1 {
            // Row-major b: each step's columns are contiguous (a ragged last
            // sliver, such as the 24 columns of a coefficient projection,
            // masked and zero-filled).
            for p in 0..kc {
                unsafe { copy_run::<T>(first.add(p * b.rows), sliver.add(p * nr), width, nr) };
            }
        } else if width == nr && b.rows == 1 {
            // Column-major b (a transposed operand, such as a weight in the
            // backward pass or the keys of attention scores).
            unsafe { T::pack_columns(first, b.cols, kc, sliver) };
        } else {
            for p in 0..kc {
                let out = unsafe { sliver.add(p * nr) };
                for j in 0..nr {
                    let v = if j < width { unsafe { *first.add(p * b.rows + j * b.cols) } } else { 0.0 };
                    unsafe { *out.add(j) = v };
                }
            }
        }
    }
}

/// The AVX-512 tile: 14 rows of two 16-float vectors, 28 of the 32 vector
/// registers.
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Tile for Avx512 {
    const MR: usize = AVX512_TILE.0;
    const NR: usize = AVX512_TILE.1;
    /// 112 KiB of packed `a`.
    const MC: usize = 14 * 8;
    /// 14 rows are 56 of a line's 64 bytes.
    const READS_COLUMNS_IN_PLACE: bool = true;
    /// The connections' coefficient input gradients (`dy @ W^T` over 20 to
    /// 32 coefficients, docs/math.md §4.3, §6.2) and nothing of the backbone's
    /// (attention's 64-step products stay sliver by sliver, as tuned); band
    /// by band these ran faster in training-step profiles. xHC's streamed
    /// `2048 x 4096 x 32` (32 MiB) stays sliver by sliver: band by band it
    /// gained nothing.
    const ROW_BANDS_MAX_STEPS: usize = 32;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn micro_kernel<const UNIT_ROWS: bool>(
        kc: usize,
        a: Operand,
        b: *const f32,
        c: Output,
        rows: usize,
        cols: usize,
        load_c: bool,
        prefetch: *const f32,
    ) {
        const MR: usize = Avx512::MR;
        const NR: usize = Avx512::NR;
        let mut acc: [[__m512; 2]; MR] = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kc {
            // SAFETY: step p of each sliver is in bounds (contract).
            let (b0, b1) = unsafe { (_mm512_loadu_ps(b.add(p * NR)), _mm512_loadu_ps(b.add(p * NR + 16))) };
            let step = unsafe { a.ptr.add(p * a.cols) };
            if !prefetch.is_null() {
                // A hint only: the address need not be inside `a`.
                // Column-major: step p's rows. Row-major: the sliver's rows hold
                // its steps, 16 floats a line; step p fetches line p / MR of row
                // p % MR, so the kc steps cover every line of all MR rows.
                let at = if UNIT_ROWS { p * a.cols } else { (p % MR) * a.rows + (p / MR) * 16 };
                _mm_prefetch::<_MM_HINT_T0>(prefetch.wrapping_add(at).cast());
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let at = if UNIT_ROWS { r } else { r * a.rows };
                let x = _mm512_set1_ps(unsafe { *step.add(at) });
                acc_r[0] = _mm512_fmadd_ps(x, b0, acc_r[0]);
                acc_r[1] = _mm512_fmadd_ps(x, b1, acc_r[1]);
            }
        }
        let masks = [lane_mask_16(cols), lane_mask_16(cols.saturating_sub(16))];
        // The rows are stored by an unrolled sequence with constant indices: a
        // loop over the run-time `rows` made the accumulators a zeroed stack
        // array (a 1.8 KiB memset and a spill per tile) instead of registers.
        macro_rules! store_rows {
            ($($r:literal)*) => {$(
                if $r < rows {
                    for (v, &value) in acc[$r].iter().enumerate() {
                        // SAFETY: masked lanes stay within the tile's `cols`
                        // columns of row $r, which is below `rows`.
                        unsafe {
                            let at = c.ptr.add($r * c.ldc + 16 * v);
                            let value = if load_c {
                                _mm512_add_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), masks[v], at), value)
                            } else {
                                value
                            };
                            if masks[v] == u16::MAX && c.stream && !load_c && at.align_offset(64) == 0 {
                                _mm512_stream_ps(at, value);
                            } else if masks[v] == u16::MAX {
                                _mm512_storeu_ps(at, value);
                            } else {
                                _mm512_mask_storeu_ps(at, masks[v], value);
                            }
                        }
                    }
                }
            )*};
        }
        const _: () = assert!(MR == 14, "store_rows lists MR row indices");
        store_rows!(0 1 2 3 4 5 6 7 8 9 10 11 12 13);
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn copy_row(src: *const f32, dst: *mut f32, len: usize, n: usize) {
        for v in 0..n.div_ceil(16) {
            let (read, write) = (lane_mask_16(len.saturating_sub(16 * v)), lane_mask_16(n - 16 * v));
            // SAFETY: masked lanes stay within the `len` floats read and the `n` written.
            unsafe {
                let x = _mm512_mask_loadu_ps(_mm512_setzero_ps(), read, src.add(16 * v));
                _mm512_mask_storeu_ps(dst.add(16 * v), write, x);
            }
        }
    }

    /// 16 columns' runs of 16 steps at a time, transposed in registers.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_columns(first: *const f32, stride: usize, kc: usize, dst: *mut f32) {
        for half in 0..Self::NR / 16 {
            for p in (0..kc).step_by(16) {
                let steps = 16.min(kc - p);
                // SAFETY: columns `16 * half..` of the sliver, steps
                // `p..p + steps`, are inside b and the sliver (contract).
                unsafe {
                    transpose_16(
                        first.add(16 * half * stride + p),
                        stride,
                        steps,
                        dst.add(p * Self::NR + 16 * half),
                    )
                };
            }
        }
    }
}

/// Writes the transpose of a 16 x `steps` block: row `j` (read at
/// `src + j * stride`, `steps` contiguous floats) becomes lane `j` of the 16
/// floats at `dst + t * 32` for each step `t < steps`.
///
/// # Safety
/// AVX-512F is available; the 16 rows hold `steps <= 16` floats each and the
/// `steps` destinations 16 floats each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose_16(src: *const f32, stride: usize, steps: usize, dst: *mut f32) {
    let read = lane_mask_16(steps);
    // SAFETY: masked lanes stay within each row's `steps` floats.
    let rows: [__m512; 16] =
        std::array::from_fn(|j| unsafe { _mm512_maskz_loadu_ps(read, src.add(j * stride)) });
    // Pairs of rows interleaved, then pairs of pairs: lane group g of
    // `quads[4 * q + e]` holds element 4 g + e of rows 4 q..4 q + 4.
    let pairs: [__m512; 16] = std::array::from_fn(|i| {
        let (lo, hi) = (rows[2 * (i / 2)], rows[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(lo, hi)
        } else {
            _mm512_unpackhi_ps(lo, hi)
        }
    });
    let quads: [__m512; 16] = std::array::from_fn(|i| {
        let (q, e) = (i / 4, i % 4);
        let (lo, hi) = (_mm512_castps_pd(pairs[4 * q + e / 2]), _mm512_castps_pd(pairs[4 * q + e / 2 + 2]));
        _mm512_castpd_ps(if e % 2 == 0 { _mm512_unpacklo_pd(lo, hi) } else { _mm512_unpackhi_pd(lo, hi) })
    });
    for e in 0..4 {
        let (r0, r1, r2, r3) = (quads[e], quads[4 + e], quads[8 + e], quads[12 + e]);
        // Lane groups 0, 1 then 2, 3 of rows 0..8, and of rows 8..16.
        let (low01, high01) = (_mm512_shuffle_f32x4::<0x44>(r0, r1), _mm512_shuffle_f32x4::<0xEE>(r0, r1));
        let (low23, high23) = (_mm512_shuffle_f32x4::<0x44>(r2, r3), _mm512_shuffle_f32x4::<0xEE>(r2, r3));
        let columns = [
            _mm512_shuffle_f32x4::<0x88>(low01, low23),
            _mm512_shuffle_f32x4::<0xDD>(low01, low23),
            _mm512_shuffle_f32x4::<0x88>(high01, high23),
            _mm512_shuffle_f32x4::<0xDD>(high01, high23),
        ];
        for (g, column) in columns.into_iter().enumerate() {
            let t = 4 * g + e;
            if t < steps {
                // SAFETY: step t is below `steps`.
                unsafe { _mm512_storeu_ps(dst.add(t * Avx512::NR), column) };
            }
        }
    }
}

/// Lanes `0..cols.min(16)` set.
#[cfg(target_arch = "x86_64")]
fn lane_mask_16(cols: usize) -> u16 {
    if cols >= 16 {
        u16::MAX
    } else {
        (1u16 << cols) - 1
    }
}

/// An AVX2 tile of `ROWS` rows of `VECTORS` 8-float vectors, read from a
/// row-major or packed `a`: `ROWS * VECTORS` accumulators next to the
/// `VECTORS` `b` vectors and one broadcast a step, with at least one of the
/// 16 vector registers to spare (see [`Avx2Narrow`]).
#[cfg(target_arch = "x86_64")]
struct Avx2Rows<const ROWS: usize, const VECTORS: usize>;

/// The AVX2 tile: 6 rows of two vectors, 12 accumulators.
#[cfg(target_arch = "x86_64")]
type Avx2 = Avx2Rows<{ AVX2_TILE.0 }, { AVX2_TILE.1 / 8 }>;

/// The AVX2 tile for products of 17 to 24 columns (the connections'
/// coefficient projections, docs/math.md §4.3, §5.5, §6.2): 3 rows of three
/// vectors, so that 24 columns compute no padding where [`Avx2`]'s two
/// vectors a row pad them to 32 (a quarter of its FMAs; three eighths at
/// xHC's 20); it beats the 6 x 16 tile on these shapes, operands in cache
/// or not. Four rows (12 accumulators, three `b` vectors and a
/// broadcast: all 16 registers) left the compiler none to spare: it kept
/// one accumulator on the stack, and that accumulator's store and reload
/// each step made the tile slower than the 6 x 16 one.
#[cfg(target_arch = "x86_64")]
type Avx2Narrow = Avx2Rows<{ AVX2_NARROW_TILE.0 }, { AVX2_NARROW_TILE.1 / 8 }>;

#[cfg(target_arch = "x86_64")]
impl<const ROWS: usize, const VECTORS: usize> Tile for Avx2Rows<ROWS, VECTORS> {
    const MR: usize = ROWS;
    const NR: usize = 8 * VECTORS;
    /// 96 KiB of packed `a` (a whole number of slivers of either tile).
    const MC: usize = AVX2_MIN_ROWS;
    /// 6 rows are 24 of a line's 64 bytes.
    const READS_COLUMNS_IN_PLACE: bool = false;
    /// Band by band, the connections' short products (mHC's and VWN's
    /// coefficient products) ran faster in training-step profiles; the
    /// backbone's 256-step products did not change.
    const ROW_BANDS_MAX_STEPS: usize = 64;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn micro_kernel<const UNIT_ROWS: bool>(
        kc: usize,
        a: Operand,
        b: *const f32,
        c: Output,
        rows: usize,
        cols: usize,
        load_c: bool,
        prefetch: *const f32,
    ) {
        const { assert!(ROWS <= 6 && ROWS * VECTORS + VECTORS + 1 < 16, "a register to spare") };
        let nr = 8 * VECTORS;
        // Lines of one row of a KC-step sliver: a row-major prefetch covers
        // them in its first ROWS * LINES steps.
        const LINES: usize = KC / 16;
        let mut acc: [[__m256; VECTORS]; ROWS] = [[_mm256_setzero_ps(); VECTORS]; ROWS];
        // One contraction step into the accumulators.
        macro_rules! fma_step {
            ($p:expr) => {{
                let p = $p;
                let mut bs = [_mm256_setzero_ps(); VECTORS];
                for (v, b_v) in bs.iter_mut().enumerate() {
                    // SAFETY: step p of the b sliver is in bounds (contract).
                    *b_v = unsafe { _mm256_loadu_ps(b.add(p * nr + 8 * v)) };
                }
                let step = unsafe { a.ptr.add(p * a.cols) };
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let at = if UNIT_ROWS { r } else { r * a.rows };
                    // SAFETY: row r of step p is in bounds (contract).
                    let x = _mm256_broadcast_ss(unsafe { &*step.add(at) });
                    for (acc_v, &b_v) in acc_r.iter_mut().zip(&bs) {
                        *acc_v = _mm256_fmadd_ps(x, b_v, *acc_v);
                    }
                }
            }};
        }
        // The steps that prefetch, then the others, as two loops: a test per
        // step in one loop cost the 6 x 16 tile a tenth of its speed.
        let prefetch_steps = if prefetch.is_null() {
            0
        } else if UNIT_ROWS {
            kc
        } else {
            kc.min(ROWS * LINES)
        };
        for p in 0..prefetch_steps {
            // As for AVX-512: step p's rows, or line p / ROWS of row p % ROWS.
            let at = if UNIT_ROWS { p * a.cols } else { (p % ROWS) * a.rows + (p / ROWS) * 16 };
            _mm_prefetch::<_MM_HINT_T0>(prefetch.wrapping_add(at).cast());
            fma_step!(p);
        }
        for p in prefetch_steps..kc {
            fma_step!(p);
        }
        let masks: [__m256i; VECTORS] = std::array::from_fn(|v| lane_mask_8(cols.saturating_sub(8 * v)));
        // Constant row indices, as for AVX-512.
        macro_rules! store_rows {
            ($($r:literal)*) => {$(
                if $r < ROWS && $r < rows {
                    for (v, &value) in acc[$r].iter().enumerate() {
                        // SAFETY: masked lanes stay within the tile's `cols`
                        // columns of row $r, which is below `rows`.
                        unsafe {
                            let at = c.ptr.add($r * c.ldc + 8 * v);
                            let value = if load_c {
                                _mm256_add_ps(_mm256_maskload_ps(at, masks[v]), value)
                            } else {
                                value
                            };
                            if cols >= 8 * (v + 1) && c.stream && !load_c && at.align_offset(32) == 0 {
                                _mm256_stream_ps(at, value);
                            } else {
                                store_first(at, value, cols.saturating_sub(8 * v));
                            }
                        }
                    }
                }
            )*};
        }
        store_rows!(0 1 2 3 4 5);
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn copy_row(src: *const f32, dst: *mut f32, len: usize, n: usize) {
        for v in 0..n.div_ceil(8) {
            // SAFETY: masked lanes stay within the `len` floats read (the
            // others load as zero), the stores within the `n` written.
            unsafe {
                let x = _mm256_maskload_ps(src.add(8 * v), lane_mask_8(len.saturating_sub(8 * v)));
                store_first(dst.add(8 * v), x, n - 8 * v);
            }
        }
    }

    /// 8 columns' runs of 8 steps at a time, transposed in registers.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pack_columns(first: *const f32, stride: usize, kc: usize, dst: *mut f32) {
        for v in 0..VECTORS {
            for p in (0..kc).step_by(8) {
                let steps = 8.min(kc - p);
                // SAFETY: columns `8 * v..` of the sliver, steps `p..p +
                // steps`, are inside b and the sliver (contract).
                unsafe {
                    transpose_8(
                        first.add(8 * v * stride + p),
                        stride,
                        steps,
                        (dst.add(p * Self::NR + 8 * v), Self::NR),
                    )
                };
            }
        }
    }
}

/// The AVX2 tile for a column-major `a` (a weight gradient's transposed
/// activations): 16 rows by 6 columns, vectorized along the rows of `c`. Each
/// step loads its 16 rows as two vectors, one whole line read in place, and
/// broadcasts the 6 columns of `b`; 12 accumulators, the tile transposed to
/// rows of `c` once per block. The 6 x 16 tile would broadcast 6 of a line's
/// 16 floats a step (too little of each line to read in place, so it
/// packs, and ran slower than the `gemm` crate here).
#[cfg(target_arch = "x86_64")]
struct Avx2Tall;

/// Rows and columns of the AVX2 tile for a column-major `a`.
const AVX2_TALL_TILE: (usize, usize) = (16, 6);

#[cfg(target_arch = "x86_64")]
impl Tile for Avx2Tall {
    const MR: usize = AVX2_TALL_TILE.0;
    const NR: usize = AVX2_TALL_TILE.1;
    /// 96 KiB of `a` a block.
    const MC: usize = 96;
    /// Packed, though 16 rows are a whole line: a weight gradient's steps lie
    /// a whole activation row apart (16 KiB for xHC's state), a stride that
    /// maps a sliver's lines to one or a few cache sets, where they evict each
    /// other: read in place, the router's weight gradient ran at about half
    /// the rate it reaches packed with [`PACK_AHEAD`].
    const READS_COLUMNS_IN_PLACE: bool = false;
    /// Its products (weight gradients) contract over every token.
    const ROW_BANDS_MAX_STEPS: usize = 0;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn micro_kernel<const UNIT_ROWS: bool>(
        kc: usize,
        a: Operand,
        b: *const f32,
        c: Output,
        rows: usize,
        cols: usize,
        load_c: bool,
        prefetch: *const f32,
    ) {
        const NR: usize = Avx2Tall::NR;
        let mut acc: [[__m256; 2]; NR] = [[_mm256_setzero_ps(); 2]; NR];
        for p in 0..kc {
            let step = unsafe { a.ptr.add(p * a.cols) };
            if !prefetch.is_null() {
                // Column-major: step p's line; row-major: line p / 16 of row
                // p % 16, as for the other tiles.
                let at = if UNIT_ROWS { p * a.cols } else { (p % 16) * a.rows + (p / 16) * 16 };
                _mm_prefetch::<_MM_HINT_T0>(prefetch.wrapping_add(at).cast());
            }
            // SAFETY: step p's 16 rows are in bounds (contract).
            let (a0, a1) = unsafe {
                if UNIT_ROWS {
                    (_mm256_loadu_ps(step), _mm256_loadu_ps(step.add(8)))
                } else {
                    let row = |r: usize| *step.add(r * a.rows);
                    (
                        _mm256_setr_ps(row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7)),
                        _mm256_setr_ps(row(8), row(9), row(10), row(11), row(12), row(13), row(14), row(15)),
                    )
                }
            };
            for (j, acc_j) in acc.iter_mut().enumerate() {
                // SAFETY: step p of the b sliver holds NR floats (contract).
                let x = _mm256_broadcast_ss(unsafe { &*b.add(p * NR + j) });
                acc_j[0] = _mm256_fmadd_ps(a0, x, acc_j[0]);
                acc_j[1] = _mm256_fmadd_ps(a1, x, acc_j[1]);
            }
        }
        let read = lane_mask_8(cols);
        for half in [0, 1] {
            // Columns as rows (two zero columns pad the transpose to 8).
            let zero = _mm256_setzero_ps();
            let by_column = std::array::from_fn(|j| if j < NR { acc[j][half] } else { zero });
            for (r, value) in transposed_8(by_column).into_iter().enumerate() {
                let row = 8 * half + r;
                if row >= rows {
                    break;
                }
                // SAFETY: row `row` of the tile is below `rows`; the masked
                // load and the stores stay within its `cols` columns.
                unsafe {
                    let at = c.ptr.add(row * c.ldc);
                    let value =
                        if load_c { _mm256_add_ps(_mm256_maskload_ps(at, read), value) } else { value };
                    store_first(at, value, cols);
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn copy_row(src: *const f32, dst: *mut f32, len: usize, n: usize) {
        // SAFETY: forwarded contract (one vector set).
        unsafe { Avx2::copy_row(src, dst, len, n) }
    }

    /// Element by element: no weight gradient has a column-major `b`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pack_columns(first: *const f32, stride: usize, kc: usize, dst: *mut f32) {
        for p in 0..kc {
            for j in 0..Self::NR {
                // SAFETY: column j's step p and the sliver's step p (contract).
                unsafe { *dst.add(p * Self::NR + j) = *first.add(j * stride + p) };
            }
        }
    }
}

/// Writes the transpose of an 8 x `steps` block: row `j` (read at
/// `src + j * stride`, `steps` contiguous floats) becomes lane `j` of the 8
/// floats at `dst + t * dst_stride` for each step `t < steps`.
///
/// # Safety
/// AVX2 is available; the 8 rows hold `steps <= 8` floats each and the
/// `steps` destinations 8 floats each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn transpose_8(src: *const f32, stride: usize, steps: usize, (dst, dst_stride): (*mut f32, usize)) {
    let read = lane_mask_8(steps);
    // SAFETY: masked lanes stay within each row's `steps` floats.
    let r: [__m256; 8] = std::array::from_fn(|j| unsafe { _mm256_maskload_ps(src.add(j * stride), read) });
    for (step, column) in transposed_8(r).into_iter().enumerate().take(steps) {
        // SAFETY: step `step` is below `steps`.
        unsafe { _mm256_storeu_ps(dst.add(step * dst_stride), column) };
    }
}

/// The 8 x 8 transpose of `r` in registers: lane `j` of row `t` of the
/// result is lane `t` of `r[j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn transposed_8(r: [__m256; 8]) -> [__m256; 8] {
    // Rows interleaved in pairs: within each 128-bit half, elements e, e + 1
    // of two rows.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (lo, hi) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(lo, hi)
        } else {
            _mm256_unpackhi_ps(lo, hi)
        }
    });
    // Four rows' element e (low half) and e + 4 (high half), e = 0..4, for
    // rows 0..4 then rows 4..8.
    let s: [__m256; 8] = std::array::from_fn(|i| {
        let (q, e) = (i / 4, i % 4);
        let (lo, hi) = (t[4 * q + e / 2], t[4 * q + e / 2 + 2]);
        if e % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(lo, hi)
        } else {
            _mm256_shuffle_ps::<0xEE>(lo, hi)
        }
    });
    // Element e of every row is the low half of s[e] and s[4 + e]; e + 4 the
    // high halves.
    std::array::from_fn(|t| {
        let e = t % 4;
        if t < 4 {
            _mm256_permute2f128_ps::<0x20>(s[e], s[4 + e])
        } else {
            _mm256_permute2f128_ps::<0x31>(s[e], s[4 + e])
        }
    })
}

/// Stores the first `count.min(8)` lanes of `x` at `dst`: a whole vector, else
/// a 4-, 2- and 1-lane store as `count` needs. Not `maskstore`: on AMD cores it
/// is microcoded, some 30 cycles a store here, and packing a column-major
/// `a` (a masked 6-lane store a step) took longer than its product's
/// arithmetic.
///
/// # Safety
/// AVX2 is available; `dst` holds `count.min(8)` writable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store_first(dst: *mut f32, x: __m256, count: usize) {
    // SAFETY (all stores): lanes at..at + width are below `count`.
    if count >= 8 {
        unsafe { _mm256_storeu_ps(dst, x) };
        return;
    }
    let (mut part, mut at) = (_mm256_castps256_ps128(x), 0);
    if count >= 4 {
        unsafe { _mm_storeu_ps(dst, part) };
        part = _mm256_extractf128_ps::<1>(x);
        at = 4;
    }
    if count - at >= 2 {
        unsafe { _mm_store_sd(dst.add(at).cast(), _mm_castps_pd(part)) };
        part = _mm_movehl_ps(part, part);
        at += 2;
    }
    if count > at {
        unsafe { _mm_store_ss(dst.add(at), part) };
    }
}

/// Lanes `0..cols.min(8)` set, as the sign bits `maskload` reads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn lane_mask_8(cols: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(cols.min(8) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// The check both of the device's f32 products are tested with.
#[cfg(test)]
pub(crate) mod triple_loop {
    use super::{Operand, Output};

    /// Deterministic values in [-1, 1).
    pub(crate) fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// A product `c (=|+=) a @ b` of shape `m x n x k` (as [`super::sgemm`]).
    pub(crate) type Product = unsafe fn(usize, usize, usize, Operand, Operand, Output, bool);

    /// For each shape, with a row-major `a` and `b`: `row_order` gives the
    /// bits of `block_order` from the same start, accumulating or not (the
    /// same sums in the same order), and the values of an f64 loop into rows
    /// padded by `ldc_pad`.
    pub(crate) fn check_orders(
        shapes: &[(usize, usize, usize)],
        ldc_pad: usize,
        row_order: Product,
        block_order: Product,
    ) {
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            let seed = case as u64;
            let (a, b) = (values(m * k, seed * 5 + 1), values(k * n, seed * 5 + 2));
            let start = values(m * n, seed * 5 + 3);
            for accumulate in [false, true] {
                let [rows, blocks] = [row_order, block_order].map(|product| {
                    let mut c = start.clone();
                    // SAFETY: the operands and c hold m x k, k x n and m x n floats.
                    unsafe {
                        product(
                            m,
                            n,
                            k,
                            Operand { ptr: a.as_ptr(), rows: k, cols: 1 },
                            Operand { ptr: b.as_ptr(), rows: n, cols: 1 },
                            Output { ptr: c.as_mut_ptr(), ldc: n, stream: false },
                            accumulate,
                        )
                    };
                    c.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                });
                assert!(rows == blocks, "{m}x{n}x{k} accumulate={accumulate}: the orders differ");
            }
            check(seed, (m, n, k), (false, false, true), (n + ldc_pad, false), |a, b, c, acc| unsafe {
                row_order(m, n, k, a, b, c, acc)
            });
        }
    }

    /// For each shape, with a column-major `a` whose steps are `stride`
    /// floats apart (a weight gradient's transposed activations, `m` of a
    /// row's columns) and a row-major `b`: the product gives the bits of the
    /// same product taken block after block of `block` steps, each
    /// accumulated into `c` in order from step 0, and of its rows computed as
    /// two bands split at a row that is not a tile boundary (a thread split);
    /// and the values of an f64 loop.
    pub(crate) fn check_column_order(
        shapes: &[(usize, usize, usize)],
        stride: usize,
        block: usize,
        product: Product,
    ) {
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            let seed = case as u64 + 40;
            let (a, b) = (values(k * stride, seed * 5 + 1), values(k * n, seed * 5 + 2));
            let start = values(m * n, seed * 5 + 3);
            let a_at = |row: usize, step: usize| Operand {
                ptr: a[step * stride + row..].as_ptr(),
                rows: 1,
                cols: stride,
            };
            let b_at = |step: usize| Operand { ptr: b[step * n..].as_ptr(), rows: n, cols: 1 };
            let out =
                |c: &mut [f32], row: usize| Output { ptr: c[row * n..].as_mut_ptr(), ldc: n, stream: false };
            let bits = |c: &[f32]| c.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            for accumulate in [false, true] {
                let mut whole = start.clone();
                // SAFETY: a holds k steps of `stride` floats (m of them read), b k x n, c m x n.
                unsafe { product(m, n, k, a_at(0, 0), b_at(0), out(&mut whole, 0), accumulate) };
                let mut blocks = start.clone();
                for p in (0..k).step_by(block) {
                    let steps = block.min(k - p);
                    // SAFETY: steps p..p + steps of both operands.
                    unsafe {
                        product(m, n, steps, a_at(0, p), b_at(p), out(&mut blocks, 0), accumulate || p > 0)
                    };
                }
                assert!(
                    bits(&whole) == bits(&blocks),
                    "{m}x{n}x{k} accumulate={accumulate}: not block by block"
                );
                let mut bands = start.clone();
                let split = m / 2 + 3;
                // SAFETY: rows 0..split, then split..m, of a and c.
                unsafe {
                    product(split, n, k, a_at(0, 0), b_at(0), out(&mut bands, 0), accumulate);
                    product(m - split, n, k, a_at(split, 0), b_at(0), out(&mut bands, split), accumulate);
                }
                assert!(bits(&whole) == bits(&bands), "{m}x{n}x{k} accumulate={accumulate}: bands differ");
                for i in 0..m {
                    for j in 0..n {
                        let mut want = if accumulate { f64::from(start[i * n + j]) } else { 0.0 };
                        for p in 0..k {
                            want += f64::from(a[p * stride + i]) * f64::from(b[p * n + j]);
                        }
                        let (got, tol) = (f64::from(whole[i * n + j]), 1e-5 * (k as f64).sqrt() + 1e-6);
                        assert!(
                            (got - want).abs() <= tol * (1.0 + want.abs()),
                            "{m}x{n}x{k} ({i},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// One product of shape `m x n x k` with operands in the given layouts,
    /// computed by `product(a, b, c, accumulate)` into a line-aligned `c` of
    /// row length `ldc` (streamed if `stream`), against an f64 triple loop;
    /// `c`'s padding columns must stay untouched.
    pub(crate) fn check(
        seed: u64,
        (m, n, k): (usize, usize, usize),
        (trans_a, trans_b, accumulate): (bool, bool, bool),
        (ldc, stream): (usize, bool),
        product: impl Fn(Operand, Operand, Output, bool),
    ) {
        let a = values(m * k, seed * 7 + 1);
        let b = values(k * n, seed * 7 + 2);
        let mut storage = values(m * ldc + 16, seed * 7 + 3);
        let line = storage.as_ptr().cast::<u8>().align_offset(64) / 4;
        let c = &mut storage[line..line + m * ldc];
        let before = c.to_vec();
        let (a_rows, a_cols) = if trans_a { (1, m) } else { (k, 1) };
        let (b_rows, b_cols) = if trans_b { (1, k) } else { (n, 1) };
        product(
            Operand { ptr: a.as_ptr(), rows: a_rows, cols: a_cols },
            Operand { ptr: b.as_ptr(), rows: b_rows, cols: b_cols },
            Output { ptr: c.as_mut_ptr(), ldc, stream },
            accumulate,
        );
        for i in 0..m {
            for j in 0..ldc {
                let got = c[i * ldc + j];
                if j >= n {
                    assert_eq!(got, before[i * ldc + j], "padding ({i},{j}) was written");
                    continue;
                }
                let mut want = if accumulate { f64::from(before[i * ldc + j]) } else { 0.0 };
                for p in 0..k {
                    want += f64::from(a[i * a_rows + p * a_cols]) * f64::from(b[p * b_rows + j * b_cols]);
                }
                let tol = 1e-5 * (k as f64).sqrt() + 1e-6;
                assert!(
                    (f64::from(got) - want).abs() <= tol * (1.0 + want.abs()),
                    "{m}x{n}x{k} t=({trans_a},{trans_b}) acc={accumulate} ({i},{j}): {got} vs {want}"
                );
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::triple_loop::Product;
    use super::*;

    /// Every shape class (ragged tiles, several KC and NC blocks, transposed
    /// operands, padded `ldc`, accumulation) against an f64 triple loop, with
    /// every tile the host runs.
    #[test]
    fn matches_a_triple_loop() {
        if Isa::host().is_none() {
            println!("skipped: this host has neither AVX-512F nor AVX2, the Cpu device uses the gemm crate");
            return;
        }
        // Both layouts of a are read in place (a ragged last sliver packed):
        // several row and column blocks, a ragged last sliver, a single column.
        let shapes: [(usize, usize, usize); 12] = [
            (1, 1, 1),
            (45, 20, 300),
            (130, 24, 1100),
            (14, 32, 256),
            (15, 33, 257),
            (113, 70, 600),
            (3, 1100, 5),
            (200, 17, 1),
            (61, 16, 300),
            (57, 5, 513),
            (500, 9, 40),
            (97, 24, 19),
        ];
        for isa in Isa::supported() {
            for (case, &(m, n, k)) in shapes.iter().enumerate() {
                for layout in
                    [(false, false, false), (true, false, true), (false, true, false), (true, true, true)]
                {
                    // Odd cases: line-aligned rows, written with streaming stores
                    // where they are written once.
                    let ldc = if case % 2 == 1 { n.next_multiple_of(16) } else { n + 3 };
                    triple_loop::check(
                        case as u64,
                        (m, n, k),
                        layout,
                        (ldc, case % 2 == 1),
                        |a, b, c, acc| unsafe { sgemm_on(isa, m, n, k, a, b, c, acc) },
                    );
                }
            }
        }
    }

    /// The products of [`row_order_gives_the_bits_of_block_order`], one pair
    /// per instruction set.
    macro_rules! orders {
        ($rows:ident, $blocks:ident, $isa:expr) => {
            unsafe fn $rows(m: usize, n: usize, k: usize, a: Operand, b: Operand, c: Output, acc: bool) {
                unsafe { sgemm_on($isa, m, n, k, a, b, c, acc) }
            }
            unsafe fn $blocks(m: usize, n: usize, k: usize, a: Operand, b: Operand, c: Output, acc: bool) {
                unsafe { sgemm_blocks_on($isa, m, n, k, a, b, c, acc) }
            }
        };
    }
    orders!(avx512_rows, avx512_blocks, Isa::Avx512);
    orders!(avx2_rows, avx2_blocks, Isa::Avx2);

    /// Products whose row-major rows span several contraction blocks under
    /// one column tile walk each tile's rows whole ([`streams_rows`]): the
    /// same bits as block order, ragged last sliver and block included, and
    /// the same values as an f64 loop.
    #[test]
    fn row_order_gives_the_bits_of_block_order() {
        if Isa::host().is_none() {
            println!("skipped: this host has neither AVX-512F nor AVX2, the Cpu device uses the gemm crate");
            return;
        }
        for isa in Isa::supported() {
            let (rows, blocks): (Product, Product) = match isa {
                Isa::Avx512 => (avx512_rows, avx512_blocks),
                Isa::Avx2 => (avx2_rows, avx2_blocks),
            };
            // The narrow products' 24 and 19 columns run on AVX2's 3 x 24 tile.
            let nr = isa.tile(256, Operand { ptr: std::ptr::null(), rows: 2, cols: 1 }).1;
            let shapes = [(45, nr, 1000), (28, 7, 513), (3, nr, 2 * KC), (46, 24, 1000), (29, 19, 513)];
            for &(m, n, k) in &shapes {
                let row_major = Operand { ptr: std::ptr::null(), rows: k, cols: 1 };
                let nr = isa.tile(n, row_major).1;
                assert!(n <= nr && streams_rows(k, row_major, KC, nr), "{m}x{n}x{k} streams rows");
            }
            triple_loop::check_orders(&shapes, 3, rows, blocks);
        }
        // Past the packing bound, or with a column-major a, block order stays.
        let long = Operand { ptr: std::ptr::null(), rows: 8192, cols: 1 };
        assert!(!streams_rows(8192, long, KC, 32));
        assert!(!streams_rows(1000, Operand { ptr: std::ptr::null(), rows: 1, cols: 45 }, KC, 32));
    }

    /// Products with a column-major `a` under one column tile, over more than
    /// one block of [`COLUMN_BLOCK`] steps, run in column order
    /// ([`streams_columns`]) on the AVX-512 tile: block after block, whatever
    /// the thread split (whole tiles, a ragged last tile and block, a single
    /// tile, fewer columns than a vector).
    #[test]
    fn column_order_adds_its_blocks_in_order_whatever_the_split() {
        if Isa::host() != Some(Isa::Avx512) {
            println!(
                "skipped: this host has no AVX-512F, whose tile alone reads column-major slivers in place"
            );
            return;
        }
        let shapes = [(60, 32, 200), (29, 24, 97), (14, 32, 65), (45, 5, 128), (130, 17, 2 * KC + 7)];
        let stride = COLUMN_MIN_STRIDE + 3;
        for &(m, n, k) in &shapes {
            let column_major = Operand { ptr: std::ptr::null(), rows: 1, cols: stride };
            assert!(streams_columns(k, column_major), "{m}x{n}x{k} streams columns");
        }
        unsafe fn avx512(m: usize, n: usize, k: usize, a: Operand, b: Operand, c: Output, acc: bool) {
            unsafe { sgemm_on(Isa::Avx512, m, n, k, a, b, c, acc) }
        }
        triple_loop::check_column_order(&shapes, stride, COLUMN_BLOCK, avx512);
        // A single block, steps close together, a row-major a: block order as before.
        assert!(!streams_columns(COLUMN_BLOCK, Operand { ptr: std::ptr::null(), rows: 1, cols: 4096 }));
        assert!(!streams_columns(32768, Operand { ptr: std::ptr::null(), rows: 1, cols: 64 }));
        assert!(!streams_columns(1000, Operand { ptr: std::ptr::null(), rows: 1000, cols: 1 }));
    }

    /// The AVX2 tile for a column-major `a`, which [`sgemm_on`] gives only
    /// that layout, computes every layout right (a row-major `a` read in
    /// place row by row): the shapes of [`matches_a_triple_loop`] and the
    /// router weight gradient's columns.
    #[test]
    fn avx2_tall_tile_matches_a_triple_loop_in_every_layout() {
        if !Isa::supported().contains(&Isa::Avx2) {
            println!("skipped: this host has no AVX2");
            return;
        }
        let shapes: [(usize, usize, usize); 6] =
            [(1, 1, 1), (16, 6, 256), (17, 7, 257), (113, 70, 600), (200, 17, 1), (97, 32, 300)];
        for (case, &(m, n, k)) in shapes.iter().enumerate() {
            for layout in
                [(false, false, false), (true, false, true), (false, true, true), (true, true, false)]
            {
                let ldc = if case % 2 == 1 { n.next_multiple_of(16) } else { n + 3 };
                triple_loop::check(case as u64, (m, n, k), layout, (ldc, false), |a, b, c, acc| unsafe {
                    sgemm_avx2_tall(m, n, k, a, b, c, acc, case % 2 == 0)
                });
            }
        }
    }

    /// AVX2 gives a column-major `a` its 16 x 6 tile up to 1024 columns and a
    /// row-major `a` its 6 x 16 tile from a block of rows, or in a batched
    /// product; AVX-512 takes all.
    #[test]
    fn avx2_takes_tall_products_by_columns_and_wide_ones_by_rows() {
        let column_major = Operand { ptr: std::ptr::null(), rows: 1, cols: 4096 };
        let row_major = Operand { ptr: std::ptr::null(), rows: 2048, cols: 1 };
        assert!(Isa::Avx2.takes(4096, 32, column_major, 1) && Isa::Avx2.takes(8, 128, column_major, 1));
        assert!(
            Isa::Avx2.takes(256, 768, column_major, 1) && Isa::Avx2.takes(768, 256, column_major, 1),
            "the backbone's weight gradients"
        );
        assert!(!Isa::Avx2.takes(256, 1025, column_major, 1), "wider ones stay in the crate");
        assert!(Isa::Avx2.takes(96, 256, row_major, 1) && !Isa::Avx2.takes(95, 256, row_major, 1));
        assert!(Isa::Avx2.takes(64, 256, row_major, 32), "attention's per-head products");
        assert_eq!(Isa::Avx2.tile(24, column_major), (16, 6));
        assert_eq!(Isa::Avx2.tile(256, row_major), (6, 16));
        assert_eq!(Isa::Avx2.tile(16, row_major), (6, 16));
        assert_eq!(Isa::Avx2.tile(17, row_major), (3, 24));
        assert_eq!(Isa::Avx2.tile(24, row_major), (3, 24));
        assert_eq!(Isa::Avx2.tile(25, row_major), (6, 16));
        assert!(Isa::Avx512.takes(1, 256, column_major, 1) && Isa::Avx512.tile(24, column_major) == (14, 32));
    }

    /// The parts of a packed block's prefetch list each of its lines once,
    /// in order: every step's rows (a line per 16, the last one partial),
    /// whatever the number of parts, including more parts than lines.
    #[test]
    fn next_block_parts_cover_each_line_once() {
        for (rows, steps, stride) in [(96, 256, 4096), (64, 256, 64), (40, 7, 1024), (1, 3, 24)] {
            let a = Operand { ptr: std::ptr::null(), rows: 1, cols: stride };
            let next = NextColumns::new(a, (16, rows), (32, steps));
            assert_eq!(next.first as usize, (16 + 32 * stride) * std::mem::size_of::<f32>());
            let want: Vec<usize> =
                (0..steps).flat_map(|p| (0..rows.div_ceil(16)).map(move |l| p * stride + l * 16)).collect();
            for parts in [1, 3, 16, 36, want.len() + 5] {
                let got: Vec<usize> = (0..parts).flat_map(|part| next.part_offsets(part, parts)).collect();
                assert_eq!(got, want, "{rows} rows, {steps} steps, {parts} parts");
            }
        }
    }

    /// The AVX2 transpose puts element `t` of row `j` at lane `j` of step
    /// `t`, for every run length, and writes no step past the run.
    #[test]
    fn avx2_columns_pack_as_their_transpose() {
        if !Isa::supported().contains(&Isa::Avx2) {
            println!("skipped: this host has no AVX2");
            return;
        }
        let stride = 37;
        let b = triple_loop::values(Avx2::NR * stride, 11);
        for kc in [1, 7, 8, 9, 16, 37] {
            let mut packed = vec![f32::NAN; (kc + 1) * Avx2::NR];
            // SAFETY: NR columns of kc <= stride steps, kc steps of NR floats.
            unsafe { Avx2::pack_columns(b.as_ptr(), stride, kc, packed.as_mut_ptr()) };
            for t in 0..kc {
                for j in 0..Avx2::NR {
                    assert_eq!(packed[t * Avx2::NR + j], b[j * stride + t], "kc {kc}: step {t}, column {j}");
                }
            }
            assert!(packed[kc * Avx2::NR..].iter().all(|v| v.is_nan()), "kc {kc}: wrote past the run");
        }
    }
}
