//! The view algebra: how a kernel reaches the elements of a value by global
//! flat index ([`Val`]). Views (`Reshape`, `Permute`, `Broadcast`, `Slice`,
//! `Concat`) are index math over their operands ([`view_of`]), so a consumer
//! folds a whole view chain into its loads and a view is only copied when its
//! value must exist in memory (see the module docs of [`super`]).

use ir::graph::View;

use super::{ix, lit, strides};
use crate::kernel::{item, select, Buf, Expr, Ty};

/// How a kernel reaches the elements of a value, by global flat index.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    /// The whole value in a kernel parameter.
    Buffer(Buf),
    /// The current item's part (elements `[item·per, (item+1)·per)`) in a local array.
    Local { arr: Buf, per: usize },
    /// Every element is `value`.
    Const { value: f64, ty: Ty },
    /// Element `g` (row-major over `dims`) is element `base + Σ idx_d·strides_d` of `src`.
    Strided { src: Box<Val>, dims: Vec<usize>, strides: Vec<usize>, base: usize },
    /// Concatenation along one axis: `[outer, total, inner]`, part `p` holds `sizes[p]` of `total`.
    Concat { parts: Vec<Val>, sizes: Vec<usize>, inner: usize, total: usize },
}

impl Val {
    /// The element at global flat index `g` (an `i64` expression).
    pub(crate) fn load(&self, g: Expr) -> Expr {
        match self {
            Val::Buffer(b) => b.at(g),
            Val::Local { arr, per } => arr.at(g - item() * ix(*per)),
            Val::Const { value, ty } => lit(*ty, *value),
            Val::Strided { src, dims, strides: st, base } => src.load(strided_index(&g, dims, st, *base)),
            Val::Concat { parts, sizes, inner, total } => {
                let along = if *inner == 1 { g.clone() } else { g.clone() / ix(*inner) };
                let along = along % ix(*total);
                let outer = g.clone() / ix(total * inner);
                let within = g % ix(*inner);
                let mut offsets = Vec::with_capacity(parts.len());
                let mut off = 0;
                for s in sizes {
                    offsets.push(off);
                    off += s;
                }
                let at = |p: usize| {
                    let a = along.clone() - ix(offsets[p]);
                    (outer.clone() * ix(sizes[p]) + a) * ix(*inner) + within.clone()
                };
                let last = parts.len() - 1;
                let mut e = parts[last].load(at(last));
                for p in (0..last).rev() {
                    e = select(along.clone().lt(ix(offsets[p] + sizes[p])), parts[p].load(at(p)), e);
                }
                e
            }
        }
    }

    /// The value viewed with a new shape that broadcasts it (NumPy rules) from `from` to `to`.
    pub(crate) fn broadcast(self, from: &[usize], to: &[usize]) -> Val {
        if from == to {
            return self;
        }
        if from.iter().product::<usize>() == 1 {
            return match self {
                Val::Const { .. } => self,
                other => Val::Strided {
                    src: Box::new(other),
                    dims: to.to_vec(),
                    strides: vec![0; to.len()],
                    base: 0,
                },
            };
        }
        let st = strides(from);
        let lead = to.len() - from.len();
        let bst =
            (0..to.len()).map(|i| if i < lead || from[i - lead] == 1 { 0 } else { st[i - lead] }).collect();
        Val::Strided { src: Box::new(self), dims: to.to_vec(), strides: bst, base: 0 }
    }
}

/// `base + Σ_d ((g / inner_d) % dims_d) · strides_d`, skipping size-1 and
/// zero-stride axes; the identity layout is `g` itself.
pub(super) fn strided_index(g: &Expr, dims: &[usize], st: &[usize], base: usize) -> Expr {
    if base == 0 && st == strides(dims).as_slice() {
        return g.clone();
    }
    let mut acc: Option<Expr> = (base != 0).then(|| ix(base));
    let mut inner = 1;
    for d in (0..dims.len()).rev() {
        if dims[d] > 1 && st[d] != 0 {
            let q = if inner == 1 { g.clone() } else { g.clone() / ix(inner) };
            let c = if d == 0 { q } else { q % ix(dims[d]) };
            let term = if st[d] == 1 { c } else { c * ix(st[d]) };
            acc = Some(match acc {
                Some(a) => a + term,
                None => term,
            });
        }
        inner *= dims[d];
    }
    acc.unwrap_or_else(|| ix(0))
}

/// The view a view op makes of its operands' values.
pub(crate) fn view_of(view: View<'_>, in_dims: &[&[usize]], out_dims: &[usize], ins: Vec<Val>) -> Val {
    let mut ins = ins;
    match view {
        View::Reshape { .. } => ins.swap_remove(0),
        View::Permute { perm } => {
            let st = strides(in_dims[0]);
            let pst = perm.iter().map(|&p| st[p]).collect();
            Val::Strided { src: Box::new(ins.swap_remove(0)), dims: out_dims.to_vec(), strides: pst, base: 0 }
        }
        View::Broadcast { .. } => ins.swap_remove(0).broadcast(in_dims[0], out_dims),
        View::Slice { axis, start, .. } => {
            let st = strides(in_dims[0]);
            let base = start * st[axis];
            Val::Strided { src: Box::new(ins.swap_remove(0)), dims: out_dims.to_vec(), strides: st, base }
        }
        View::Concat { axis } => {
            let sizes = in_dims.iter().map(|d| d[axis]).collect();
            let inner = out_dims[axis + 1..].iter().product();
            Val::Concat { parts: ins, sizes, inner, total: out_dims[axis] }
        }
    }
}
