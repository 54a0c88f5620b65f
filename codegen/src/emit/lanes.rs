//! Sinkhorn projections computed for a block of matrices at once, lanes
//! innermost (C target).
//!
//! mHC's and xHC's stream-mixing matrices are small (n×n, n = 4) and their
//! Sinkhorn-Knopp projection (docs/math.md §4.2) is `2·t_max` dependent half-steps:
//! a column or row sum, its reciprocal, a scaling, each waiting on the last.
//! As one item per token ([`super::item`]) that chain runs at the latency of
//! scalar adds and divisions, at t_max = 20 longer than the rest of the
//! connection's per-token work. Here one
//! item owns `LANES` consecutive matrices, every local is stored lane-minor
//! (`[element][lane]`) and every loop body is straight-line code inside a loop
//! over the lanes, so the C compiler vectorizes across matrices: one vector
//! operation advances `LANES` independent chains.
//!
//! Each matrix sees the item emitter's arithmetic op for op (the same sums in
//! the same order from ε, the same reciprocals and products, the same
//! first-maximum convention), so the results are bitwise those of the fused form.

use ir::graph::{Graph, NodeId, Op, OpFamily};

use super::buffers::Reader;
use super::folds::maximum;
use super::views::Val;
use super::{grid, ix, lit, numel, EmitError, Launch};
use crate::kernel::{item, select, Access, Block, Buf, Expr, KernelBuilder, Ty};

/// Matrices per item: one AVX-512 register of f32.
pub const LANES: usize = 16;

/// Largest matrix side computed in lanes: the loop bodies are unrolled over
/// the matrix's elements, `n²` statements per half-step.
const MAX_SIDE: usize = 8;

/// Whether node `id` has a lanes form: a Sinkhorn or its gradient on float
/// matrices of side 2 to `MAX_SIDE` (larger sides stay in the item form,
/// whose loops are not unrolled per element).
pub fn has_lanes_form(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    matches!(node.op, Op::Sinkhorn { .. } | Op::SinkhornGrad { .. })
        && (2..=MAX_SIDE).contains(&node.shape.last())
        && Ty::of_storage(node.dtype).is_float()
}

/// A `Sinkhorn` or `SinkhornGrad` node as a kernel over blocks of `LANES`
/// matrices (see the module docs); `None` when [`has_lanes_form`] is false.
pub fn lower_sinkhorn_lanes(graph: &Graph, id: NodeId, name: &str) -> Result<Option<Launch>, EmitError> {
    if !has_lanes_form(graph, id) {
        return Ok(None);
    }
    let node = graph.node(id);
    let (iters, eps, grad) = match node.op {
        Op::Sinkhorn { iters, eps } => (iters, eps, false),
        Op::SinkhornGrad { iters, eps } => (iters, eps, true),
        // Only the Sinkhorn ops have a lanes form (checked by `has_lanes_form`).
        ref op => match op.family() {
            OpFamily::Source(_)
            | OpFamily::Elementwise
            | OpFamily::View(_)
            | OpFamily::Reduction
            | OpFamily::RowWise
            | OpFamily::MatrixWise
            | OpFamily::Contraction
            | OpFamily::Indexed
            | OpFamily::OwnGrid
            | OpFamily::PlanStep => return Ok(None),
        },
    };
    let n = node.shape.last();
    let mats = numel(node.shape.dims()) / (n * n);
    let mut k = KernelBuilder::new(name, grid(mats.div_ceil(LANES)));
    let mut r = Reader::new(graph);
    let inputs = graph.inputs(id);
    let x = r.read(&mut k, inputs[0]);
    let dout = if grad { Some(r.read(&mut k, inputs[1])) } else { None };
    let out = r.buffer(&mut k, id, Access::Write);
    k.comment(&format!(
        "{LANES} {n}x{n} matrices per item, lane-minor: the lane loops vectorize across tokens"
    ));
    let m = Matrices { ty: Ty::of_storage(node.dtype), n, eps };
    let base = if !grad && mats.is_multiple_of(LANES) {
        LaneOffsets::Affine { matrix: n * n }
    } else {
        // Lanes past the last matrix repeat it (their stores write the same
        // values again, within this item).
        let offsets = k.local_array("mb", Ty::I64, LANES);
        lanes(&mut k, |b, l| {
            let mat = b.let_("mat", item() * ix(LANES) + l.clone());
            b.store(&offsets, l, select(mat.clone().lt(ix(mats)), mat, ix(mats - 1)) * ix(n * n));
        });
        LaneOffsets::Array(offsets)
    };
    match dout {
        None => m.forward(&mut k, &x, &base, &out, iters),
        Some(dout) => m.backward(&mut k, &x, &dout, &base, &out, iters),
    }
    let kernel = k.finish();
    kernel.validate()?;
    Ok(Some(Launch { kernel, args: r.args }))
}

/// Where each lane's matrix starts in the node's operands (an element offset).
enum LaneOffsets {
    /// `(item · LANES + l) · matrix`: an expression of the item and lane, so
    /// the index simplifier folds the view arithmetic of every load through
    /// it. Read from an array, the offset is opaque, and each load of mHC's
    /// 4 x 4 matrices (16 of a token's 24 coefficients) kept a division and
    /// remainders. Taken by the forward when the matrices fill whole blocks:
    /// its first lane loop stays scalar either way (GCC vectorizes neither the
    /// array's store nor the strided loads, which it groups by their common
    /// stride and then finds no vector type for), its indices get cheap and
    /// its last lane loop, the stores, vectorizes, so the forward kernel gets
    /// faster. The gradient keeps the array: its first lane loop (the column
    /// maxima and their rows) vectorizes only with the array's opaque
    /// indices, as gathers, and with the affine offsets it got slower.
    Affine { matrix: usize },
    /// An array of the lanes' offsets, the last block's spare lanes clamped to
    /// the last matrix.
    Array(Buf),
}

impl LaneOffsets {
    /// Lane `l`'s offset, bound to `name` where it is read from the array.
    fn at(&self, b: &mut Block, name: &str, l: &Expr) -> Expr {
        match self {
            LaneOffsets::Affine { matrix } => (item() * ix(LANES) + l.clone()) * ix(*matrix),
            LaneOffsets::Array(offsets) => b.let_(name, offsets.at(l.clone())),
        }
    }
}

/// `for l in 0..LANES { f(l) }`: the loop the C compiler vectorizes.
fn lanes(b: &mut Block, f: impl FnOnce(&mut Block, Expr)) {
    b.for_("l", ix(0), ix(LANES), f);
}

/// The block's n×n matrices and their arithmetic.
struct Matrices {
    ty: Ty,
    n: usize,
    eps: f64,
}

impl Matrices {
    fn lit(&self, v: f64) -> Expr {
        lit(self.ty, v)
    }

    /// Where element `e` of lane `l`'s matrix `step` sits in a lane-minor
    /// stack of matrices (`[step][element][lane]`).
    fn index(&self, step: Expr, e: usize, l: &Expr) -> Expr {
        (step * ix(self.n * self.n) + ix(e)) * ix(LANES) + l.clone()
    }

    /// That element's value.
    fn at(&self, buf: &Buf, step: Expr, e: usize, l: &Expr) -> Expr {
        buf.at(self.index(step, e, l))
    }

    /// Flat index of element `j` of column `a` (`by_column`) or row `a`.
    fn line(&self, by_column: bool, a: usize, j: usize) -> usize {
        if by_column {
            j * self.n + a
        } else {
            a * self.n + j
        }
    }

    /// `((init ⊕ v0) ⊕ v1) …`: the item emitter's in-order fold of a short line.
    fn fold(init: Expr, terms: impl IntoIterator<Item = Expr>, op: impl Fn(Expr, Expr) -> Expr) -> Expr {
        terms.into_iter().fold(init, op)
    }

    /// exp(x − colmax) of each lane's matrix into step 0 of `dst`; with
    /// `argmax`, the column maximum is the first strict maximum and its row
    /// is recorded (the gradient's convention, `item::exp_shifted`).
    fn exp_shifted(&self, b: &mut Block, x: &Val, base: &LaneOffsets, dst: &Buf, argmax: Option<&Buf>) {
        let n = self.n;
        lanes(b, |b, l| {
            let mb = base.at(b, "xb", &l);
            let at = |i: usize, c: usize| x.load(mb.clone() + ix(i * n + c));
            for c in 0..n {
                let cm = match argmax {
                    None => {
                        let v: Vec<Expr> = (0..n).map(|i| b.let_(&format!("v{c}_{i}"), at(i, c))).collect();
                        let mut acc = self.lit(f64::NEG_INFINITY);
                        for (i, v) in v.into_iter().enumerate() {
                            acc = b.let_(&format!("cm{c}_{i}"), maximum(acc, v));
                        }
                        acc
                    }
                    Some(am) => {
                        let mut best = ix(0);
                        let mut top = b.let_(&format!("top{c}_0"), at(0, c));
                        for i in 1..n {
                            let v = b.let_(&format!("v{c}_{i}"), at(i, c));
                            let better = b.let_(&format!("gt{c}_{i}"), v.clone().gt(top.clone()));
                            best = b.let_(&format!("best{c}_{i}"), select(better.clone(), ix(i), best));
                            top = b.let_(&format!("top{c}_{i}"), select(better, v, top));
                        }
                        b.store(am, ix(c * LANES) + l.clone(), best);
                        top
                    }
                };
                for i in 0..n {
                    b.store(dst, self.index(ix(0), i * n + c, &l), (at(i, c) - cm.clone()).exp());
                }
            }
        });
    }

    /// One half-step of every lane's matrix from step `from` of `src` into
    /// step `to` of `dst` (the same buffer and step for an in-place update):
    /// each column (`by_column`) or row scaled by the reciprocal of its sum
    /// from ε (`item::normalize`).
    fn normalize(
        &self,
        b: &mut Block,
        (src, from): (&Buf, &Expr),
        (dst, to): (&Buf, &Expr),
        by_column: bool,
    ) {
        let n = self.n;
        lanes(b, |b, l| {
            for a in 0..n {
                let vals: Vec<Expr> = (0..n)
                    .map(|j| {
                        b.let_(
                            &format!("s{a}_{j}"),
                            self.at(src, from.clone(), self.line(by_column, a, j), &l),
                        )
                    })
                    .collect();
                let sum = Self::fold(self.lit(self.eps), vals.iter().cloned(), |p, v| p + v);
                let inv = b.let_(&format!("inv{a}"), self.lit(1.0) / sum);
                for (j, v) in vals.into_iter().enumerate() {
                    b.store(dst, self.index(to.clone(), self.line(by_column, a, j), &l), v * inv.clone());
                }
            }
        });
    }

    /// Sinkhorn-Knopp (`item::sinkhorn`).
    fn forward(&self, b: &mut Block, x: &Val, base: &LaneOffsets, out: &Buf, iters: usize) {
        let nn = self.n * self.n;
        let m = b.local_array("sk", self.ty, nn * LANES);
        self.exp_shifted(b, x, base, &m, None);
        b.for_("it", ix(0), ix(iters), |b, _| {
            self.normalize(b, (&m, &ix(0)), (&m, &ix(0)), true);
            self.normalize(b, (&m, &ix(0)), (&m, &ix(0)), false);
        });
        lanes(b, |b, l| {
            let mb = base.at(b, "ob", &l);
            for e in 0..nn {
                b.store(out, mb.clone() + ix(e), self.at(&m, ix(0), e, &l));
            }
        });
    }

    /// The VJP through the recomputed iteration (`item::sinkhorn_grad`): every
    /// half-step's result is kept, then the gradient walks them backwards.
    fn backward(&self, b: &mut Block, x: &Val, dout: &Val, base: &LaneOffsets, out: &Buf, iters: usize) {
        let n = self.n;
        let nn = n * n;
        let states = b.local_array("st", self.ty, nn * (2 * iters + 1) * LANES);
        let g = b.local_array("gr", self.ty, nn * LANES);
        let am = b.local_array("am", Ty::I64, n * LANES);
        self.exp_shifted(b, x, base, &states, Some(&am));
        b.for_("it", ix(0), ix(iters), |b, it| {
            for (half, by_column) in [(0, true), (1, false)] {
                let s = b.let_(&format!("s{half}"), it.clone() * ix(2) + ix(half));
                let next = b.let_(&format!("t{half}"), s.clone() + ix(1));
                self.normalize(b, (&states, &s), (&states, &next), by_column);
            }
        });
        lanes(b, |b, l| {
            let mb = base.at(b, "db", &l);
            for e in 0..nn {
                b.store(&g, self.index(ix(0), e, &l), dout.load(mb.clone() + ix(e)));
            }
        });
        b.for_("it", ix(0), ix(iters), |b, it| {
            // Reverse order: each iteration's row half-step, then its column half-step.
            for (half, by_column) in [(1, false), (0, true)] {
                let step = b.let_(&format!("step{half}"), (ix(iters - 1) - it.clone()) * ix(2) + ix(half));
                let after = b.let_(&format!("after{half}"), step.clone() + ix(1));
                lanes(b, |b, l| {
                    for a in 0..n {
                        let line: Vec<usize> = (0..n).map(|j| self.line(by_column, a, j)).collect();
                        let sum = Self::fold(
                            self.lit(self.eps),
                            line.iter().map(|&e| self.at(&states, step.clone(), e, &l)),
                            |p, v| p + v,
                        );
                        let inv = b.let_(&format!("inv{a}"), self.lit(1.0) / sum);
                        let gs: Vec<Expr> = line
                            .iter()
                            .map(|&e| b.let_(&format!("g{a}_{e}"), self.at(&g, ix(0), e, &l)))
                            .collect();
                        let centre = Self::fold(
                            self.lit(0.0),
                            line.iter()
                                .zip(&gs)
                                .map(|(&e, gv)| gv.clone() * self.at(&states, after.clone(), e, &l)),
                            |p, v| p + v,
                        );
                        let centre = b.let_(&format!("centre{a}"), centre);
                        for (&e, gv) in line.iter().zip(gs) {
                            b.store(&g, self.index(ix(0), e, &l), (gv - centre.clone()) * inv.clone());
                        }
                    }
                });
            }
        });
        lanes(b, |b, l| {
            let mb = base.at(b, "ob", &l);
            for c in 0..n {
                let vs: Vec<Expr> = (0..n)
                    .map(|i| {
                        let e = i * n + c;
                        b.let_(
                            &format!("p{c}_{i}"),
                            self.at(&g, ix(0), e, &l) * self.at(&states, ix(0), e, &l),
                        )
                    })
                    .collect();
                let shift =
                    b.let_(&format!("shift{c}"), Self::fold(self.lit(0.0), vs.iter().cloned(), |p, v| p + v));
                let top = b.let_(&format!("top{c}"), am.at(ix(c * LANES) + l.clone()));
                for (i, v) in vs.into_iter().enumerate() {
                    let moved = select(top.clone().eq_(ix(i)), v.clone() - shift.clone(), v);
                    b.store(out, mb.clone() + ix(i * n + c), moved);
                }
            }
        });
    }
}
