//! Batched matrix product through the `gemm` crate (docs/architecture.md §5: heavy ops use a
//! real GEMM even in the reference, since CPU training runs on it).

use super::movement::{broadcast_strides, StridedIter};
use super::{Float, Tensor};
use crate::Shape;

/// One operand of a product: a [rows, cols] matrix (after the optional transpose)
/// stored row-major at `data[offset..]`, as gemm's row and column strides.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A row-major [rows, cols] matrix, or the transpose of a row-major [cols, rows]
    /// matrix when `trans` is set.
    pub(crate) fn new(data: &'a [T], offset: usize, rows: usize, cols: usize, trans: bool) -> Self {
        if trans {
            MatRef { data, offset, rows, cols, row_stride: 1, col_stride: rows }
        } else {
            MatRef { data, offset, rows, cols, row_stride: cols, col_stride: 1 }
        }
    }

    /// The largest element index the matrix touches, plus one.
    fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return self.offset;
        }
        self.offset + (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
    }
}

/// dst[m, n] (row-major, contiguous) = a[m, k] · b[k, n].
///
/// Panics if the operands' shapes disagree or a view reaches past its slice: both
/// are invariants the callers establish from inferred shapes.
pub(crate) fn gemm_into<T: Float>(dst: &mut [T], a: MatRef<T>, b: MatRef<T>) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(b.rows == k && dst.len() == m * n, "gemm operands disagree");
    assert!(a.extent() <= a.data.len() && b.extent() <= b.data.len(), "gemm view out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        dst.iter_mut().for_each(|v| *v = T::zero());
        return;
    }
    // SAFETY: the asserts above keep every element gemm reads within `a.data` and
    // `b.data` and every element it writes within `dst` (m*n contiguous values with
    // row stride n). `T` is f32 or f64 (`Float` is sealed), the two types gemm's
    // dispatch supports. With read_dst = false the destination is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr().add(a.offset),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr().add(b.offset),
            b.col_stride as isize,
            b.row_stride as isize,
            T::zero(),
            T::one(),
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

/// Batched product (a [.., M, K], b [.., K, N]) -> [.., M, N] with broadcast batch
/// axes; `trans_a`/`trans_b` read an operand's last two axes transposed.
pub(crate) fn matmul<T: Float>(
    a: &Tensor<T>,
    b: &Tensor<T>,
    trans_a: bool,
    trans_b: bool,
    out_shape: &Shape,
) -> Tensor<T> {
    let (ad, bd, od) = (a.shape.dims(), b.shape.dims(), out_shape.dims());
    let (ar, br, or) = (ad.len(), bd.len(), od.len());
    let (m, n) = (od[or - 2], od[or - 1]);
    let k = if trans_a { ad[ar - 2] } else { ad[ar - 1] };
    let batch = &od[..or - 2];
    let a_batch = broadcast_strides(&ad[..ar - 2], &a.shape.strides()[..ar - 2], batch);
    let b_batch = broadcast_strides(&bd[..br - 2], &b.shape.strides()[..br - 2], batch);
    let mut data = vec![T::zero(); out_shape.numel()];
    if m * n > 0 {
        let offsets = StridedIter::new(batch, &a_batch, 0).zip(StridedIter::new(batch, &b_batch, 0));
        for (dst, (ao, bo)) in data.chunks_exact_mut(m * n).zip(offsets) {
            gemm_into(dst, MatRef::new(&a.data, ao, m, k, trans_a), MatRef::new(&b.data, bo, k, n, trans_b));
        }
    }
    Tensor { shape: out_shape.clone(), data }
}
