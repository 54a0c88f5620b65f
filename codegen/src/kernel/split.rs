//! Loop splitting inside one item's body: strip-mining by a divisor and
//! index-set splitting at comparison thresholds.
//!
//! The item emitter addresses a segmented over-width row (VWN's `n/m · D`
//! state, docs/math.md §5.1, or xHC's `N` streams, §6.1) with one flat loop and
//! recovers the segment and the offset as `l / d_b` and `l % d_b`; a
//! concatenation of coefficient blocks (DGHC's `[A | B]` columns, §5.5)
//! selects its source with `l % 24 < 4 ? … : …`. Both keep the C compiler
//! from vectorizing the loop (a gather per element, a blend per element) and
//! cost a multiply-high per element when the divisor is not a power of two.
//! This pass rewrites
//! 1. `for l in 0..R` into `for lo in 0..R/c { for li in 0..c }` with
//!    `l = lo·c + li`, so that `l / c` and `l % c` become `lo` and `li`
//!    (the index simplifier proves it from the ranges), and
//! 2. `for l in s..e` into consecutive loops over `[s, t1)`, `[t1, t2)`, … at
//!    the thresholds `t` of comparisons of `l` with constants, so that every
//!    such comparison is decided in each piece and its `Select` folds away.
//!
//! Both keep every iteration, in the same order, with the same operations on
//! the same operands, so results are bit for bit those of the unsplit body.
//! A rewrite is kept only when it lowers the estimated index cost of the
//! kernel (see [`index_cost`]); it is tried loop by loop, outermost first.

use std::collections::{HashSet, VecDeque};

use super::{
    collect_declared, collect_refs, each_expr, expr_refs, rewrite_stmts, simplify_indices, BinOp, CmpOp,
    Expr, Kernel, Stmt, Ty, Unroll,
};

/// Candidate divisors tried per loop, largest first.
const MAX_DIVISORS: usize = 6;
/// Thresholds an index-set split may cut a loop at (at most this plus one pieces).
const MAX_THRESHOLDS: usize = 3;
/// The trip count assumed for a loop whose bounds are not constants.
const UNKNOWN_TRIPS: u64 = 16;
/// Iterations from which the loops a division changes with run as several
/// vectors (four of 16 f32 lanes), so that what keeps them scalar weighs more.
const LONG_LOOP: u64 = 64;
/// The weight of a division or remainder in such a loop: strip-mining trades
/// it for affine indices (`lo·c + li`, one more integer operation per use,
/// which the compiler folds into the addresses anyway), and VWN's group
/// statistics over a token's four 256-wide groups (`x[l] − μ[l / 256]`,
/// docs/math.md §5.1) stayed a 1024-iteration loop reading μ by gather at 8.
const LONG_LOOP_DIVISION: u64 = 16;

/// Applies both rewrites to a thread-per-item kernel whose indices are
/// already simplified (block-per-item kernels keep their shape: the C
/// renderer splits their bodies at barriers).
pub fn split_loops(kernel: Kernel) -> Kernel {
    if kernel.grid.is_block() {
        return kernel;
    }
    let mut taken = names(&kernel);
    let mut best_cost = index_cost(&kernel.body, 1, &mut Vec::new());
    let mut best = kernel;
    let mut work: VecDeque<String> = VecDeque::new();
    loop_vars(&best.body, &mut work);
    while let Some(var) = work.pop_front() {
        let Some(lp) = find_loop(&best.body, &var) else { continue };
        let mut candidates: Vec<(Kernel, Option<String>)> = Vec::new();
        let (outer, inner) = (fresh(&taken, &format!("{var}o")), fresh(&taken, &format!("{var}i")));
        for c in divisors(&lp) {
            let body = replace_loop(&best.body, &var, &|s| strip_mine(s, c, &outer, &inner));
            candidates.push((simplify_indices(Kernel { body, ..best.clone() }), Some(inner.clone())));
        }
        let cuts = thresholds(&lp, &var);
        if !cuts.is_empty() {
            let body = replace_loop(&best.body, &var, &|s| cut(s, &cuts));
            candidates.push((simplify_indices(Kernel { body, ..best.clone() }), None));
        }
        let chosen = candidates
            .into_iter()
            .map(|(k, inner)| (index_cost(&k.body, 1, &mut Vec::new()), k, inner))
            .min_by_key(|(cost, ..)| *cost)
            .filter(|(cost, ..)| *cost < best_cost);
        if let Some((cost, k, strip_mined)) = chosen {
            (best_cost, best) = (cost, k);
            if let Some(inner) = strip_mined {
                // The inner loop of a strip-mined loop may still need an
                // index-set split (a concatenation's column selects).
                taken.insert(outer);
                taken.insert(inner.clone());
                work.push_front(inner);
            }
        }
    }
    best
}

/// The parts of a loop the rewrites need.
struct Loop<'a> {
    start: Option<i64>,
    end: Option<i64>,
    step: i64,
    body: &'a [Stmt],
}

/// Loop variables of `stmts`, outermost first.
fn loop_vars(stmts: &[Stmt], out: &mut VecDeque<String>) {
    for s in stmts {
        match s {
            Stmt::For { var, body, .. } => {
                out.push_back(var.clone());
                loop_vars(body, out);
            }
            Stmt::If { then, else_, .. } => {
                loop_vars(then, out);
                loop_vars(else_, out);
            }
            _ => {}
        }
    }
}

fn find_loop<'a>(stmts: &'a [Stmt], name: &str) -> Option<Loop<'a>> {
    stmts.iter().find_map(|s| match s {
        Stmt::For { var, start, end, step, body, .. } if var == name => {
            Some(Loop { start: start.int_literal(), end: end.int_literal(), step: *step, body })
        }
        Stmt::For { body, .. } => find_loop(body, name),
        Stmt::If { then, else_, .. } => find_loop(then, name).or_else(|| find_loop(else_, name)),
        _ => None,
    })
}

/// `stmts` with the first loop over `name` replaced by `f(loop)`.
fn replace_loop(stmts: &[Stmt], name: &str, f: &dyn Fn(&Stmt) -> Vec<Stmt>) -> Vec<Stmt> {
    let mut done = false;
    replace_in(stmts, name, f, &mut done)
}

fn replace_in(stmts: &[Stmt], name: &str, f: &dyn Fn(&Stmt) -> Vec<Stmt>, done: &mut bool) -> Vec<Stmt> {
    let mut out = Vec::with_capacity(stmts.len());
    for s in stmts {
        if *done {
            out.push(s.clone());
            continue;
        }
        match s {
            Stmt::For { var, .. } if var == name => {
                *done = true;
                out.extend(f(s));
            }
            Stmt::For { var, start, end, step, unroll, body } => out.push(Stmt::For {
                var: var.clone(),
                start: start.clone(),
                end: end.clone(),
                step: *step,
                unroll: *unroll,
                body: replace_in(body, name, f, done),
            }),
            Stmt::If { cond, then, else_ } => {
                let then = replace_in(then, name, f, done);
                let else_ = replace_in(else_, name, f, done);
                out.push(Stmt::If { cond: cond.clone(), then, else_ });
            }
            s => out.push(s.clone()),
        }
    }
    out
}

/// Constant divisors and moduli in the loop body that divide its trip count,
/// largest first: the candidates for strip-mining.
fn divisors(lp: &Loop) -> Vec<i64> {
    let (Some(0), Some(trips), 1) = (lp.start, lp.end, lp.step) else { return Vec::new() };
    let mut found = Vec::new();
    each_expr(lp.body, &mut |e| {
        e.visit(&mut |x| {
            if let Expr::Binary { op: BinOp::Div | BinOp::Rem, rhs, .. } = x {
                if let Some(c) = rhs.int_literal() {
                    if c > 1 && c < trips && trips % c == 0 && !found.contains(&c) {
                        found.push(c);
                    }
                }
            }
        })
    });
    found.sort_unstable_by(|a, b| b.cmp(a));
    found.truncate(MAX_DIVISORS);
    found
}

/// The points strictly inside the loop's range where a comparison of the
/// loop variable with a constant changes its value, ascending.
fn thresholds(lp: &Loop, var: &str) -> Vec<i64> {
    let (Some(start), Some(end), 1) = (lp.start, lp.end, lp.step) else { return Vec::new() };
    let mut cuts = Vec::new();
    each_expr(lp.body, &mut |e| {
        e.visit(&mut |x| {
            let Expr::Cmp { op, lhs, rhs } = x else { return };
            let is_var = |e: &Expr| matches!(e, Expr::Var { name, .. } if name == var);
            let (t, op) = match (lhs.int_literal(), rhs.int_literal()) {
                (None, Some(t)) if is_var(lhs) => (t, *op),
                (Some(t), None) if is_var(rhs) => (t, mirror(*op)),
                _ => return,
            };
            let t = match op {
                CmpOp::Lt | CmpOp::Ge => t,
                CmpOp::Le | CmpOp::Gt => t + 1,
                CmpOp::Eq | CmpOp::Ne => return,
            };
            if t > start && t < end && !cuts.contains(&t) {
                cuts.push(t);
            }
        })
    });
    cuts.sort_unstable();
    if cuts.len() > MAX_THRESHOLDS {
        return Vec::new();
    }
    cuts
}

/// `a op b` as `b op' a`.
fn mirror(op: CmpOp) -> CmpOp {
    match op {
        CmpOp::Lt => CmpOp::Gt,
        CmpOp::Le => CmpOp::Ge,
        CmpOp::Gt => CmpOp::Lt,
        CmpOp::Ge => CmpOp::Le,
        o => o,
    }
}

/// `for v in 0..R { body }` as `for o in 0..R/c { for i in 0..c { body[v := o·c + i] } }`.
fn strip_mine(s: &Stmt, c: i64, outer: &str, inner: &str) -> Vec<Stmt> {
    let Stmt::For { var, end, body, .. } = s else { return vec![s.clone()] };
    let trips = end.int_literal().unwrap_or(0);
    let int = |ty: Ty, v: i64| if ty == Ty::I32 { Expr::I32(v as i32) } else { Expr::I64(v) };
    let ty = end.ty();
    let index = Expr::Binary {
        op: BinOp::Add,
        lhs: Box::new(Expr::Binary {
            op: BinOp::Mul,
            lhs: Box::new(Expr::Var { name: outer.to_string(), ty: Ty::I64 }),
            rhs: Box::new(Expr::I64(c)),
        }),
        rhs: Box::new(Expr::Var { name: inner.to_string(), ty: Ty::I64 }),
    };
    let body = rewrite_stmts(body, &|x| match x {
        Expr::Var { name, .. } if name == var => Some(index.clone()),
        _ => None,
    });
    let inner_loop = Stmt::For {
        var: inner.to_string(),
        start: int(ty, 0),
        end: int(ty, c),
        step: 1,
        unroll: Unroll::Auto,
        body,
    };
    vec![Stmt::For {
        var: outer.to_string(),
        start: int(ty, 0),
        end: int(ty, trips / c),
        step: 1,
        unroll: Unroll::Auto,
        body: vec![inner_loop],
    }]
}

/// `for v in s..e` as consecutive loops over `[s, t1)`, `[t1, t2)`, …, `[tk, e)`.
fn cut(s: &Stmt, cuts: &[i64]) -> Vec<Stmt> {
    let Stmt::For { var, start, end, step, unroll, body } = s else { return vec![s.clone()] };
    let ty = end.ty();
    let int = |v: i64| if ty == Ty::I32 { Expr::I32(v as i32) } else { Expr::I64(v) };
    let bounds: Vec<Expr> =
        std::iter::once(start.clone()).chain(cuts.iter().map(|&t| int(t))).chain([end.clone()]).collect();
    bounds
        .windows(2)
        .map(|w| Stmt::For {
            var: var.clone(),
            start: w[0].clone(),
            end: w[1].clone(),
            step: *step,
            unroll: *unroll,
            body: body.clone(),
        })
        .collect()
}

/// A loop around the statements [`index_cost`] weighs: its iterations, and
/// the names that change from one of its iterations to the next (its
/// variable and the lets computed from them).
struct Enclosing {
    trips: u64,
    varying: HashSet<String>,
}

/// Estimated index work of `stmts` run `trips` times inside `loops`
/// (outermost first): every integer division or remainder (it costs a
/// multiply-high, and it keeps the loop it sits in from vectorizing) weighs
/// 8, or [`LONG_LOOP_DIVISION`] when the loops its dividend changes with run
/// at least [`LONG_LOOP`] iterations together; a comparison or select 2, any
/// other integer operation 1, and every loop iteration 1 for its increment
/// and test, each multiplied by the iterations of the loops around it.
fn index_cost(stmts: &[Stmt], trips: u64, loops: &mut Vec<Enclosing>) -> u64 {
    let mut total = 0u64;
    for s in stmts {
        let mut here = 0u64;
        let mut add = |e: &Expr| {
            e.visit(&mut |x| {
                here += match x {
                    Expr::Binary { op: BinOp::Div | BinOp::Rem, lhs, .. } => {
                        let mut refs = HashSet::new();
                        expr_refs(lhs, &mut refs);
                        let changing: u64 = loops
                            .iter()
                            .filter(|l| refs.iter().any(|r| l.varying.contains(r)))
                            .map(|l| l.trips)
                            .product();
                        if changing >= LONG_LOOP {
                            LONG_LOOP_DIVISION
                        } else {
                            8
                        }
                    }
                    Expr::Binary { lhs, .. } if lhs.ty().is_int() => 1,
                    Expr::Cmp { lhs, .. } if lhs.ty().is_int() => 2,
                    Expr::Select { .. } => 2,
                    _ => 0,
                }
            })
        };
        match s {
            Stmt::For { var, start, end, step, body, .. } => {
                add(start);
                add(end);
                let n = match (start.int_literal(), end.int_literal()) {
                    (Some(a), Some(b)) if b > a && *step > 0 => ((b - a) as u64).div_ceil(*step as u64),
                    (Some(_), Some(_)) => 0,
                    _ => UNKNOWN_TRIPS,
                };
                // One more for the loop's own set-up, so that cutting a loop
                // into pieces is not free.
                total = total.saturating_add(trips.saturating_mul(n + 1));
                loops.push(Enclosing { trips: n, varying: HashSet::from([var.clone()]) });
                total = total.saturating_add(index_cost(body, trips.saturating_mul(n), loops));
                loops.pop();
            }
            Stmt::If { cond, then, else_ } => {
                add(cond);
                total = total.saturating_add(index_cost(then, trips, loops));
                total = total.saturating_add(index_cost(else_, trips, loops));
            }
            other => each_expr(std::slice::from_ref(other), &mut add),
        }
        total = total.saturating_add(trips.saturating_mul(here));
        if let Stmt::Let { var, expr, .. } = s {
            let mut refs = HashSet::new();
            expr_refs(expr, &mut refs);
            for l in loops.iter_mut() {
                if refs.iter().any(|r| l.varying.contains(r)) {
                    l.varying.insert(var.clone());
                }
            }
        }
    }
    total
}

/// Every name a kernel declares or mentions.
fn names(kernel: &Kernel) -> HashSet<String> {
    let mut out: HashSet<String> = kernel.params.iter().map(|p| p.name.clone()).collect();
    collect_refs(&kernel.body, &mut out);
    collect_declared(&kernel.body, &mut out);
    out
}

/// `base`, or `base` with the smallest numeric suffix that is not taken.
fn fresh(taken: &HashSet<String>, base: &str) -> String {
    let mut name = base.to_string();
    let mut n = 0;
    while taken.contains(&name) {
        n += 1;
        name = format!("{base}{n}");
    }
    name
}
