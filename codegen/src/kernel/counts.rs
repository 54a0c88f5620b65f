//! What a kernel costs, counted from its IR: the floating-point operations
//! of every item and the bytes of its parameters. The cost table of
//! `widen compile` (`kernels.tsv`), the roofline of `widen bench` and the C
//! renderer's prefetch decision all read these counts.

use std::collections::HashSet;

use super::{each_expr, BinOp, Expr, Grid, Kernel, Stmt, Ty};

impl Kernel {
    /// Floating-point operations of one launch (every item, every lane):
    /// float `+ - * /`, comparisons and math calls. The flag is false when a
    /// loop bound is not a literal (such a loop is counted once).
    pub fn flops(&self) -> (u64, bool) {
        let (per_item, exact) = match self.grid {
            Grid::ThreadPerItem { .. } => count(&self.body, &Count::Flops),
            Grid::BlockPerItem { threads, .. } => lane_flops(&self.body, u64::from(threads)),
        };
        (per_item.saturating_mul(self.grid.items() as u64), exact)
    }

    /// Bytes of the parameters the kernel reads and of those it writes, each
    /// counted once (a read-write parameter in both; one the kernel writes
    /// before it reads it back, [`super::Access::WriteThenRead`], as written only).
    pub fn param_bytes(&self) -> (usize, usize) {
        let (mut read, mut written) = (0, 0);
        for p in &self.params {
            let b = p.len * p.dtype.size_bytes();
            if p.access.reads_memory() {
                read += b;
            }
            if p.access.writable() {
                written += b;
            }
        }
        (read, written)
    }
}

/// FLOPs of one item of a block-per-item kernel with `threads` lanes. A
/// top-level statement that depends on the lane (reads `lane` or a variable
/// derived from it) runs on every lane and counts `threads` times; one that
/// does not is the same arithmetic on the same values on every lane (the
/// per-token scalars of a kernel spread over lanes, [`super::spread_over_lanes`])
/// and counts once, as in the item's thread-per-item form.
fn lane_flops(stmts: &[Stmt], threads: u64) -> (u64, bool) {
    let mut lane_dependent: HashSet<String> = HashSet::new();
    let (mut total, mut exact) = (0u64, true);
    for s in stmts {
        // A block reduction combines one value from every lane.
        let mut reads_lane = matches!(s, Stmt::BlockReduce { .. });
        each_expr(std::slice::from_ref(s), &mut |e| {
            e.visit(&mut |x| {
                reads_lane |= matches!(x, Expr::Lane)
                    || matches!(x, Expr::Var { name, .. } if lane_dependent.contains(name));
            })
        });
        if reads_lane {
            if let Stmt::Let { var, .. } | Stmt::Var { var, .. } = s {
                lane_dependent.insert(var.clone());
            }
        }
        let (c, ok) = count(std::slice::from_ref(s), &Count::Flops);
        exact &= ok;
        total = total.saturating_add(if reads_lane { c.saturating_mul(threads) } else { c });
    }
    (total, exact)
}

/// Operations of one statement (with its loops' trips): its FLOPs, and,
/// for the C renderer's prefetch schedule, its work (FLOPs plus element
/// loads and stores: a transpose or a gather does no arithmetic and still
/// takes time).
pub(crate) fn stmt_work(s: &Stmt) -> u64 {
    count(std::slice::from_ref(s), &Count::Work).0
}

/// What [`count`] counts.
enum Count {
    Flops,
    Work,
}

/// Count of one expression evaluation: float arithmetic and math calls, and
/// for [`Count::Work`] loads too.
fn expr_count(e: &Expr, what: &Count) -> u64 {
    let c = |x: &Expr| expr_count(x, what);
    match e {
        Expr::Binary { op, lhs, rhs } => {
            let own = u64::from(
                lhs.ty().is_float() && matches!(op, BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div),
            );
            own + c(lhs) + c(rhs)
        }
        Expr::Call { args, .. } => 1 + args.iter().map(c).sum::<u64>(),
        Expr::Unary { arg, .. } | Expr::Cast { arg, .. } => c(arg),
        Expr::Load { index, .. } => u64::from(matches!(what, Count::Work)) + c(index),
        Expr::Cmp { lhs, rhs, .. } => u64::from(lhs.ty().is_float()) + c(lhs) + c(rhs),
        Expr::Select { cond, then, else_ } => c(cond) + c(then).max(c(else_)),
        _ => 0,
    }
}

/// Literal loop bounds; `Lane` counts as 0 (a lane-strided loop's trips are
/// per lane, and the caller multiplies by the lanes).
fn bound(e: &Expr) -> Option<i64> {
    match e {
        Expr::I64(v) => Some(*v),
        Expr::I32(v) => Some(i64::from(*v)),
        Expr::Lane => Some(0),
        Expr::Binary { op: BinOp::Add, lhs, rhs } => bound(lhs)?.checked_add(bound(rhs)?),
        Expr::Binary { op: BinOp::Mul, lhs, rhs } => bound(lhs)?.checked_mul(bound(rhs)?),
        _ => None,
    }
}

/// The count of one execution of `stmts`, and whether every loop bound was literal.
fn count(stmts: &[Stmt], what: &Count) -> (u64, bool) {
    let e = |x: &Expr| expr_count(x, what);
    let store = u64::from(matches!(what, Count::Work));
    let mut exact = true;
    let mut total = 0u64;
    for s in stmts {
        let f = match s {
            Stmt::Let { expr, .. } | Stmt::Var { init: expr, .. } | Stmt::Assign { value: expr, .. } => {
                e(expr)
            }
            Stmt::Store { index, value, .. } => store + e(index) + e(value),
            Stmt::AccumStore { index, value, target } => {
                store + e(index) + e(value) + u64::from(target.elem_ty() != Ty::I64)
            }
            Stmt::BlockReduce { value, .. } => e(value) + 1,
            Stmt::For { start, end, step, body, .. } => {
                let (inner, ok) = count(body, what);
                exact &= ok;
                match (bound(start), bound(end)) {
                    (Some(a), Some(b)) => {
                        ((b - a).max(0) as u64).div_ceil((*step).max(1) as u64).saturating_mul(inner)
                    }
                    _ => {
                        exact = false;
                        inner
                    }
                }
            }
            Stmt::If { cond, then, else_ } => {
                let ((t, t_ok), (f, f_ok)) = (count(then, what), count(else_, what));
                exact &= t_ok && f_ok;
                e(cond) + t.max(f)
            }
            Stmt::LocalArray { .. } | Stmt::Comment(_) | Stmt::Barrier => 0,
        };
        total = total.saturating_add(f);
    }
    (total, exact)
}
