//! Movement ops. They are views in the op set (docs/architecture.md §4) but the reference
//! materializes every result, so each op here is a plain copy with index math.
//! Also gather/scatter, which move rows selected by i32 indices.

use super::{Float, Tensor};
use crate::Shape;

/// Walks the source offsets of a strided view in row-major order of `dims`:
/// element `idx` of the view lives at `base + Σ idx[d] * strides[d]`.
pub(crate) struct StridedIter {
    dims: Vec<usize>,
    strides: Vec<usize>,
    idx: Vec<usize>,
    offset: usize,
    remaining: usize,
}

impl StridedIter {
    pub(crate) fn new(dims: &[usize], strides: &[usize], base: usize) -> Self {
        debug_assert_eq!(dims.len(), strides.len());
        StridedIter {
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            idx: vec![0; dims.len()],
            offset: base,
            remaining: dims.iter().product(),
        }
    }
}

impl Iterator for StridedIter {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let current = self.offset;
        for d in (0..self.dims.len()).rev() {
            self.idx[d] += 1;
            self.offset += self.strides[d];
            if self.idx[d] < self.dims[d] {
                break;
            }
            self.offset -= self.strides[d] * self.dims[d];
            self.idx[d] = 0;
        }
        Some(current)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

/// Strides that read a tensor of `dims` (row-major strides `strides`) broadcast to
/// `out` (NumPy rules: right-aligned, missing or size-1 axes repeat with stride 0).
pub(crate) fn broadcast_strides(dims: &[usize], strides: &[usize], out: &[usize]) -> Vec<usize> {
    let lead = out.len() - dims.len();
    (0..out.len()).map(|i| if i < lead || dims[i - lead] == 1 { 0 } else { strides[i - lead] }).collect()
}

fn strided_copy<E: Copy>(data: &[E], dims: &[usize], strides: &[usize], base: usize) -> Vec<E> {
    StridedIter::new(dims, strides, base).map(|o| data[o]).collect()
}

/// Same data, new shape (row-major order is unchanged).
pub(crate) fn reshape<E: Clone>(x: &Tensor<E>, shape: &[usize]) -> Tensor<E> {
    Tensor { shape: Shape::new(shape), data: x.data.clone() }
}

/// out.dims[i] = x.dims[perm[i]].
pub(crate) fn permute<E: Copy>(x: &Tensor<E>, perm: &[usize]) -> Tensor<E> {
    let (dims, strides) = (x.shape.dims(), x.shape.strides());
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let src_strides: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let data = strided_copy(&x.data, &out_dims, &src_strides, 0);
    Tensor { shape: Shape(out_dims), data }
}

/// NumPy broadcast to `shape`.
pub(crate) fn broadcast<E: Copy>(x: &Tensor<E>, shape: &[usize]) -> Tensor<E> {
    let strides = broadcast_strides(x.shape.dims(), &x.shape.strides(), shape);
    Tensor { shape: Shape::new(shape), data: strided_copy(&x.data, shape, &strides, 0) }
}

/// x[.., start..end, ..] on `axis`.
pub(crate) fn slice<E: Copy>(x: &Tensor<E>, axis: usize, start: usize, end: usize) -> Tensor<E> {
    let strides = x.shape.strides();
    let mut dims = x.shape.0.clone();
    dims[axis] = end - start;
    let data = strided_copy(&x.data, &dims, &strides, start * strides[axis]);
    Tensor { shape: Shape(dims), data }
}

/// Concatenation along `axis`: for each index of the leading axes, the inputs'
/// blocks follow each other.
pub(crate) fn concat<E: Copy>(xs: &[&Tensor<E>], axis: usize) -> Tensor<E> {
    let first = &xs[0].shape;
    let outer: usize = first.0[..axis].iter().product();
    let inner: usize = first.0[axis + 1..].iter().product();
    let mut dims = first.0.clone();
    dims[axis] = xs.iter().map(|x| x.shape.0[axis]).sum();
    let mut data = Vec::with_capacity(dims.iter().product());
    for o in 0..outer {
        for x in xs {
            let block = x.shape.0[axis] * inner;
            data.extend_from_slice(&x.data[o * block..(o + 1) * block]);
        }
    }
    Tensor { shape: Shape(dims), data }
}

/// The sizes gather and scatter work with: x is [P.., S, R..] and the index
/// [P.., J..], flattened to P x S x R and P x J.
struct RowLayout {
    p: usize,
    s: usize,
    r: usize,
    j: usize,
}

impl RowLayout {
    fn new(x: &Shape, idx: &Shape, axis: usize) -> Self {
        let p: usize = x.0[..axis].iter().product();
        let j = idx.numel().checked_div(p).unwrap_or(0);
        RowLayout { p, s: x.0[axis], r: x.0[axis + 1..].iter().product(), j }
    }

    /// The row index idx[p, j], checked against the axis length.
    fn row(&self, idx: &[i32], p: usize, j: usize) -> Result<usize, String> {
        let v = idx[p * self.j + j];
        usize::try_from(v)
            .ok()
            .filter(|&s| s < self.s)
            .ok_or_else(|| format!("index {v} is out of range for an axis of length {}", self.s))
    }
}

/// out[p, j, r] = x[p, idx[p, j], r].
pub(crate) fn gather<E: Copy>(
    x: &Tensor<E>,
    idx: &Tensor<i32>,
    axis: usize,
    out_shape: &Shape,
) -> Result<Tensor<E>, String> {
    let l = RowLayout::new(&x.shape, &idx.shape, axis);
    let mut data = Vec::with_capacity(l.p * l.j * l.r);
    for p in 0..l.p {
        for j in 0..l.j {
            let start = (p * l.s + l.row(&idx.data, p, j)?) * l.r;
            data.extend_from_slice(&x.data[start..start + l.r]);
        }
    }
    Ok(Tensor { shape: out_shape.clone(), data })
}

/// base with src[p, j, r] added at [p, idx[p, j], r]; repeated indices accumulate.
pub(crate) fn scatter_add<T: Float>(
    base: &Tensor<T>,
    idx: &Tensor<i32>,
    src: &Tensor<T>,
    axis: usize,
) -> Result<Tensor<T>, String> {
    let l = RowLayout::new(&base.shape, &idx.shape, axis);
    let mut out = base.clone();
    for p in 0..l.p {
        for j in 0..l.j {
            let dst = (p * l.s + l.row(&idx.data, p, j)?) * l.r;
            let from = (p * l.j + j) * l.r;
            for (o, &v) in out.data[dst..dst + l.r].iter_mut().zip(&src.data[from..from + l.r]) {
                *o += v;
            }
        }
    }
    Ok(out)
}

/// base with rows [p, idx[p, j], ..] replaced by src[p, j, ..] (docs/math.md §6.6). The
/// indices must be distinct within each p: a repeated row would make the result
/// depend on write order.
pub(crate) fn scatter_rows<T: Float>(
    base: &Tensor<T>,
    idx: &Tensor<i32>,
    src: &Tensor<T>,
    axis: usize,
) -> Result<Tensor<T>, String> {
    let l = RowLayout::new(&base.shape, &idx.shape, axis);
    let mut out = base.clone();
    let mut written = vec![usize::MAX; l.s];
    for p in 0..l.p {
        for j in 0..l.j {
            let s = l.row(&idx.data, p, j)?;
            if written[s] == p {
                return Err(format!("row {s} is written twice in batch entry {p}"));
            }
            written[s] = p;
            let (dst, from) = ((p * l.s + s) * l.r, (p * l.j + j) * l.r);
            out.data[dst..dst + l.r].copy_from_slice(&src.data[from..from + l.r]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(dims: &[usize]) -> Tensor<i32> {
        let n: usize = dims.iter().product();
        Tensor::new(Shape::new(dims), (0..n as i32).collect())
    }

    #[test]
    fn permute_matches_index_formula() {
        let x = iota(&[2, 3, 4]);
        let y = permute(&x, &[2, 0, 1]);
        assert_eq!(y.shape, Shape::new([4, 2, 3]));
        for a in 0..4 {
            for b in 0..2 {
                for c in 0..3 {
                    assert_eq!(y.data[(a * 2 + b) * 3 + c], x.data[(b * 3 + c) * 4 + a]);
                }
            }
        }
    }

    #[test]
    fn broadcast_repeats_size_one_and_missing_axes() {
        let x = iota(&[3, 1]);
        let y = broadcast(&x, &[2, 3, 2]);
        assert_eq!(y.data, vec![0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn slice_then_concat_restores_the_tensor() {
        let x = iota(&[2, 5, 3]);
        let a = slice(&x, 1, 0, 2);
        let b = slice(&x, 1, 2, 5);
        assert_eq!(a.data[..3], [0, 1, 2]);
        assert_eq!(concat(&[&a, &b], 1), x);
    }

    #[test]
    fn strided_iter_on_a_scalar_yields_one_offset() {
        assert_eq!(StridedIter::new(&[], &[], 7).collect::<Vec<_>>(), vec![7]);
    }
}
