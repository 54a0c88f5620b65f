//! Index simplification: rewrites the integer index arithmetic of a kernel
//! into an equivalent, cheaper form before the kernel enters a Plan.
//!
//! Fused kernels address their operands through chains of views (docs/architecture.md
//! §6), so a single load index often re-derives the same coordinates several
//! times with `/` and `%` by constants that are not powers of two, each of
//! which costs a multiply-high and shifts per element. Interval (range)
//! analysis knows that the grid item, the lane and most loop variables are
//! bounded, and with those bounds the classic identities of truncating
//! integer division collapse the chains.
//!
//! Every rewrite is exact under C semantics (truncating `/` and `%`) and is
//! applied only when range analysis proves its preconditions: for `x ≥ 0`
//! written `x = c1·Q + R` with `c1 | c` and `R ∈ [0, c1)`,
//! `x / c = Q / (c/c1)` and `x % c = c1·(Q % (c/c1)) + R`; for `x, R ≥ 0`
//! with `x = c·A + R`, `x / c = A + R / c` and `x % c = R % c`. Sums of
//! products are normalized to a linear form, `(x/a)/b` becomes `x/(a·b)` and
//! `c·(x / c) + x % c` becomes `x`. Float expressions are never reordered:
//! only integer expressions and integer comparisons are rewritten (a
//! `Select` whose condition becomes a constant keeps its chosen branch).

use std::collections::{HashMap, HashSet};

use super::{BinOp, CmpOp, Expr, Grid, Kernel, Stmt, Ty, UnOp};

/// A closed interval `[lo, hi]` of integer values.
type Range = (i64, i64);

/// Expansions of `Let` variables tried per index expression.
const MAX_EXPANSIONS: usize = 16;

/// Rewrites every integer index expression of `kernel` into an equivalent
/// cheaper one (see the module docs) and drops integer `Let`s left unused.
pub fn simplify_indices(mut kernel: Kernel) -> Kernel {
    let lane = match kernel.grid {
        Grid::BlockPerItem { threads, .. } => Some((0, i64::from(threads.max(1)) - 1)),
        Grid::ThreadPerItem { .. } => None,
    };
    let items = i64::try_from(kernel.grid.items()).unwrap_or(i64::MAX);
    let mut s = Simplifier { item: (0, (items - 1).max(0)), lane, scopes: Vec::new() };
    let body = s.block(std::mem::take(&mut kernel.body));
    kernel.body = drop_dead_lets(body);
    kernel
}

/// What the pass knows about a scalar variable in scope.
#[derive(Clone)]
struct Info {
    range: Option<Range>,
    /// Whether the variable keeps its value for its whole scope (`Let`, `For`).
    immutable: bool,
    /// The simplified definition of an integer `Let` built only from
    /// immutable variables, the grid indices and integer arithmetic: it may be
    /// substituted for the variable anywhere in the variable's scope.
    def: Option<Expr>,
}

struct Simplifier {
    item: Range,
    lane: Option<Range>,
    scopes: Vec<HashMap<String, Info>>,
}

/// `Σ coefficient·atom + constant` of one integer type. Atoms are
/// simplified expressions that are not sums or products by constants.
#[derive(Clone, Debug)]
struct Lin {
    ty: Ty,
    terms: Vec<(Expr, i64)>,
    c: i64,
}

impl Lin {
    fn constant(ty: Ty, c: i64) -> Lin {
        Lin { ty, terms: Vec::new(), c }
    }

    fn atom(ty: Ty, e: Expr) -> Lin {
        Lin { ty, terms: vec![(e, 1)], c: 0 }
    }

    fn as_const(&self) -> Option<i64> {
        self.terms.is_empty().then_some(self.c)
    }

    fn is_zero(&self) -> bool {
        self.terms.is_empty() && self.c == 0
    }

    /// The atom of `1·atom + 0`.
    fn single_atom(&self) -> Option<&Expr> {
        match self.terms.as_slice() {
            [(a, 1)] if self.c == 0 => Some(a),
            _ => None,
        }
    }

    fn add_term(&mut self, e: Expr, k: i64) -> Option<()> {
        if let Some(i) = self.terms.iter().position(|(a, _)| *a == e) {
            let sum = self.terms[i].1.checked_add(k)?;
            if sum == 0 {
                self.terms.remove(i);
            } else {
                self.terms[i].1 = sum;
            }
        } else if k != 0 {
            self.terms.push((e, k));
        }
        Some(())
    }

    /// `self + scale·o`, or `None` on overflow.
    fn plus(mut self, o: &Lin, scale: i64) -> Option<Lin> {
        for (a, k) in &o.terms {
            self.add_term(a.clone(), k.checked_mul(scale)?)?;
        }
        self.c = self.c.checked_add(o.c.checked_mul(scale)?)?;
        Some(self)
    }

    fn scale(&self, k: i64) -> Option<Lin> {
        Lin::constant(self.ty, 0).plus(self, k)
    }

    /// `self = c1·q + r` with the terms whose coefficient `c1` divides in `q`
    /// and the constant split so that `r`'s constant is in `[0, c1)`.
    fn split(&self, c1: i64) -> (Lin, Lin) {
        let mut q = Lin::constant(self.ty, self.c.div_euclid(c1));
        let mut r = Lin::constant(self.ty, self.c.rem_euclid(c1));
        for (a, k) in &self.terms {
            if k % c1 == 0 {
                q.terms.push((a.clone(), k / c1));
            } else {
                r.terms.push((a.clone(), *k));
            }
        }
        (q, r)
    }

    /// Candidate `c1` for [`Lin::split`] under a division by `c`: `c` and the
    /// common divisors of `c` with each coefficient, largest first, above 1.
    fn split_candidates(&self, c: i64) -> Vec<i64> {
        let mut out: Vec<i64> =
            self.terms.iter().map(|(_, k)| gcd(k.unsigned_abs(), c.unsigned_abs())).collect();
        out.push(c);
        out.retain(|&d| d > 1);
        out.sort_unstable_by(|a, b| b.cmp(a));
        out.dedup();
        out
    }
}

fn gcd(mut a: u64, mut b: u64) -> i64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    i64::try_from(a).unwrap_or(i64::MAX)
}

fn bin(op: BinOp, lhs: Expr, rhs: Expr) -> Expr {
    Expr::Binary { op, lhs: Box::new(lhs), rhs: Box::new(rhs) }
}

/// The value of an integer literal.
fn lit_of(e: &Expr) -> Option<i64> {
    match e {
        Expr::I64(v) => Some(*v),
        Expr::I32(v) => Some(i64::from(*v)),
        _ => None,
    }
}

/// An integer literal of type `ty`, if `v` fits it.
fn lit(ty: Ty, v: i64) -> Option<Expr> {
    match ty {
        Ty::I64 => Some(Expr::I64(v)),
        Ty::I32 => i32::try_from(v).ok().map(Expr::I32),
        _ => None,
    }
}

fn fits_i32(r: Range) -> bool {
    r.0 >= i64::from(i32::MIN) && r.1 <= i64::from(i32::MAX)
}

fn add_ranges(a: Range, b: Range) -> Option<Range> {
    Some((a.0.checked_add(b.0)?, a.1.checked_add(b.1)?))
}

fn mul_ranges(a: Range, b: Range) -> Option<Range> {
    let p = [a.0.checked_mul(b.0)?, a.0.checked_mul(b.1)?, a.1.checked_mul(b.0)?, a.1.checked_mul(b.1)?];
    Some((*p.iter().min()?, *p.iter().max()?))
}

/// The relative cost of evaluating an integer expression: a division or
/// remainder by a constant that is not a power of two (a multiply-high and
/// shifts) is much dearer than an add; one by a variable dearer still. Load
/// indices are simplified on their own and not counted.
fn cost(e: &Expr) -> u32 {
    match e {
        Expr::Binary { op, lhs, rhs } => {
            let own = match op {
                BinOp::Add | BinOp::Sub | BinOp::And | BinOp::Or => 1,
                BinOp::Mul if lit_of(lhs).is_some() || lit_of(rhs).is_some() => 1,
                BinOp::Mul => 3,
                BinOp::Div | BinOp::Rem => match lit_of(rhs) {
                    Some(c) if c > 0 && c.count_ones() == 1 => 2,
                    Some(_) => 8,
                    None => 24,
                },
            };
            own + cost(lhs) + cost(rhs)
        }
        Expr::Unary { arg, .. } => 1 + cost(arg),
        Expr::Cmp { lhs, rhs, .. } => 1 + cost(lhs) + cost(rhs),
        Expr::Select { cond, then, else_ } => 1 + cost(cond) + cost(then) + cost(else_),
        Expr::Cast { arg, .. } => cost(arg),
        Expr::Call { args, .. } => args.iter().map(cost).sum(),
        _ => 0,
    }
}

/// `e` with every `Var { name }` outside load indices replaced by `def`.
fn substitute(e: &Expr, name: &str, def: &Expr) -> Expr {
    e.rewrite(&|x| match x {
        Expr::Var { name: n, .. } if n == name => Some(def.clone()),
        Expr::Load { .. } => Some(x.clone()),
        _ => None,
    })
}

/// Names of the variables referenced by `e` outside load indices, in order.
fn vars_of(e: &Expr, out: &mut Vec<String>) {
    match e {
        Expr::Var { name, .. } if !out.contains(name) => out.push(name.clone()),
        Expr::Unary { arg, .. } | Expr::Cast { arg, .. } => vars_of(arg, out),
        Expr::Binary { lhs, rhs, .. } | Expr::Cmp { lhs, rhs, .. } => {
            vars_of(lhs, out);
            vars_of(rhs, out);
        }
        Expr::Select { cond, then, else_ } => {
            vars_of(cond, out);
            vars_of(then, out);
            vars_of(else_, out);
        }
        Expr::Call { args, .. } => args.iter().for_each(|a| vars_of(a, out)),
        _ => {}
    }
}

impl Simplifier {
    fn lookup(&self, name: &str) -> Option<&Info> {
        self.scopes.iter().rev().find_map(|s| s.get(name))
    }

    fn declare(&mut self, name: &str, info: Info) {
        if let Some(scope) = self.scopes.last_mut() {
            scope.insert(name.to_string(), info);
        }
    }

    fn block(&mut self, stmts: Vec<Stmt>) -> Vec<Stmt> {
        self.scopes.push(HashMap::new());
        let out = stmts.into_iter().map(|s| self.stmt(s)).collect();
        self.scopes.pop();
        out
    }

    fn stmt(&mut self, s: Stmt) -> Stmt {
        match s {
            Stmt::Let { var, ty, expr } => {
                let simplified = self.simp_index(&expr);
                let mut info = Info { range: None, immutable: true, def: None };
                if ty.is_int() {
                    info.range = match (self.range(&simplified), self.range(&expr)) {
                        (Some(a), Some(b)) => Some((a.0.max(b.0), a.1.min(b.1))),
                        (a, b) => a.or(b),
                    };
                    if self.is_pure(&simplified) {
                        info.def = Some(simplified.clone());
                    }
                }
                self.declare(&var, info);
                Stmt::Let { var, ty, expr: simplified }
            }
            Stmt::Var { var, ty, init } => {
                let init = self.simp_index(&init);
                self.declare(&var, Info { range: None, immutable: false, def: None });
                Stmt::Var { var, ty, init }
            }
            Stmt::Assign { var, value } => Stmt::Assign { value: self.simp_index(&value), var },
            Stmt::Store { target, index, value } => {
                Stmt::Store { index: self.simp_index(&index), value: self.simp_any(&value), target }
            }
            Stmt::AccumStore { target, index, value } => {
                Stmt::AccumStore { index: self.simp_index(&index), value: self.simp_any(&value), target }
            }
            Stmt::For { var, start, end, step, unroll, body } => {
                let (start, end) = (self.simp_index(&start), self.simp_index(&end));
                let range = match (self.range(&start), self.range(&end)) {
                    (Some((lo, _)), Some((_, hi))) if step > 0 && hi > lo => Some((lo, hi - 1)),
                    _ => None,
                };
                // A loop of one iteration (a row-form product's rows of one
                // item, docs/math.md §4.3) binds its variable to one value, which
                // indices may then fold in ([`super::fuse_loops`] drops the
                // loop itself).
                let def = match range {
                    Some((lo, hi)) if lo == hi => Some(Expr::I64(lo)),
                    _ => None,
                };
                self.scopes.push(HashMap::new());
                self.declare(&var, Info { range, immutable: true, def });
                let body = self.block(body);
                self.scopes.pop();
                Stmt::For { var, start, end, step, unroll, body }
            }
            Stmt::If { cond, then, else_ } => {
                let cond = self.simp_any(&cond);
                Stmt::If { cond, then: self.block(then), else_: self.block(else_) }
            }
            Stmt::BlockReduce { var, op, value } => {
                let value = self.simp_any(&value);
                self.declare(&var, Info { range: None, immutable: true, def: None });
                Stmt::BlockReduce { var, op, value }
            }
            s @ (Stmt::LocalArray { .. } | Stmt::Comment(_) | Stmt::Barrier) => s,
        }
    }

    /// Whether `e` can be substituted for a variable anywhere in that
    /// variable's scope: integer arithmetic of immutable variables.
    fn is_pure(&self, e: &Expr) -> bool {
        match e {
            Expr::I64(_) | Expr::I32(_) | Expr::Bool(_) | Expr::Item | Expr::Lane => true,
            Expr::Var { name, ty } => ty.is_int() && self.lookup(name).is_some_and(|i| i.immutable),
            Expr::Unary { arg, .. } => self.is_pure(arg),
            Expr::Binary { lhs, rhs, .. } | Expr::Cmp { lhs, rhs, .. } => {
                !lhs.ty().is_float() && self.is_pure(lhs) && self.is_pure(rhs)
            }
            Expr::Select { cond, then, else_ } => {
                self.is_pure(cond) && self.is_pure(then) && self.is_pure(else_)
            }
            Expr::Cast { ty, arg } => ty.is_int() && arg.ty().is_int() && self.is_pure(arg),
            _ => false,
        }
    }

    /// An integer expression as the cheapest of: itself simplified, and
    /// itself with `Let` variables replaced by their definitions (greedily,
    /// one variable at a time, and all at once).
    fn simp_index(&self, e: &Expr) -> Expr {
        if !e.ty().is_int() {
            return self.simp_any(e);
        }
        let mut best = self.simp_int(e);
        let mut best_cost = cost(&best);
        let mut cur = e.clone();
        for _ in 0..MAX_EXPANSIONS {
            let mut names = Vec::new();
            vars_of(&cur, &mut names);
            let mut improved = false;
            for name in names {
                let Some(def) = self.lookup(&name).and_then(|i| i.def.clone()) else { continue };
                let src = substitute(&cur, &name, &def);
                let cand = self.simp_int(&src);
                let k = cost(&cand);
                if k <= best_cost {
                    (best, best_cost, cur, improved) = (cand, k, src, true);
                    break;
                }
            }
            if !improved {
                break;
            }
        }
        let full = self.expand_all(&cur, MAX_EXPANSIONS);
        if full != cur {
            let cand = self.simp_int(&full);
            if cost(&cand) < best_cost {
                best = cand;
            }
        }
        best
    }

    /// `e` with expandable variables substituted transitively, `depth` levels.
    fn expand_all(&self, e: &Expr, depth: usize) -> Expr {
        let mut names = Vec::new();
        vars_of(e, &mut names);
        let mut out = e.clone();
        let mut changed = false;
        for name in names {
            if let Some(def) = self.lookup(&name).and_then(|i| i.def.as_ref()) {
                out = substitute(&out, &name, def);
                changed = true;
            }
        }
        if changed && depth > 0 {
            self.expand_all(&out, depth - 1)
        } else {
            out
        }
    }

    /// An integer expression simplified without expanding variables. `I32`
    /// results are kept only when every intermediate provably fits `i32`.
    fn simp_int(&self, e: &Expr) -> Expr {
        let ty = e.ty();
        match self.build(&self.linear(e)) {
            Some(r) if ty == Ty::I64 || self.fits(&r) => r,
            _ => self.shallow(e),
        }
    }

    /// Whether every `I32` subexpression of `e` provably fits `i32`.
    fn fits(&self, e: &Expr) -> bool {
        if e.ty() == Ty::I32 && !self.range(e).is_some_and(fits_i32) {
            return false;
        }
        match e {
            Expr::Unary { arg, .. } => self.fits(arg),
            Expr::Binary { lhs, rhs, .. } => self.fits(lhs) && self.fits(rhs),
            Expr::Select { then, else_, .. } => self.fits(then) && self.fits(else_),
            _ => true,
        }
    }

    /// Any expression: integer parts simplified, float parts only recursed into.
    fn simp_any(&self, e: &Expr) -> Expr {
        if e.ty().is_int() {
            return self.simp_int(e);
        }
        match e {
            Expr::Cmp { op, lhs, rhs } => self.cmp(*op, lhs, rhs),
            Expr::Unary { op: UnOp::Not, arg } => match self.simp_any(arg) {
                Expr::Bool(b) => Expr::Bool(!b),
                a => Expr::Unary { op: UnOp::Not, arg: Box::new(a) },
            },
            Expr::Binary { op: op @ (BinOp::And | BinOp::Or), lhs, rhs } => {
                let (l, r) = (self.simp_any(lhs), self.simp_any(rhs));
                let absorbing = *op == BinOp::Or;
                match (&l, &r) {
                    (Expr::Bool(b), _) | (_, Expr::Bool(b)) if *b == absorbing => Expr::Bool(absorbing),
                    (Expr::Bool(_), _) => r,
                    (_, Expr::Bool(_)) => l,
                    _ => bin(*op, l, r),
                }
            }
            Expr::Select { cond, then, else_ } => match self.simp_any(cond) {
                Expr::Bool(true) => self.simp_any(then),
                Expr::Bool(false) => self.simp_any(else_),
                c => Expr::Select {
                    cond: Box::new(c),
                    then: Box::new(self.simp_any(then)),
                    else_: Box::new(self.simp_any(else_)),
                },
            },
            _ => self.shallow(e),
        }
    }

    /// An integer comparison with simplified operands, decided when the
    /// operands' ranges decide it.
    fn cmp(&self, op: CmpOp, lhs: &Expr, rhs: &Expr) -> Expr {
        if !lhs.ty().is_int() {
            return Expr::Cmp { op, lhs: Box::new(self.simp_any(lhs)), rhs: Box::new(self.simp_any(rhs)) };
        }
        let (l, r) = (self.simp_index(lhs), self.simp_index(rhs));
        if let (Some(a), Some(b)) = (self.range(&l), self.range(&r)) {
            let decided = match op {
                CmpOp::Lt => (a.1 < b.0).then_some(true).or((a.0 >= b.1).then_some(false)),
                CmpOp::Le => (a.1 <= b.0).then_some(true).or((a.0 > b.1).then_some(false)),
                CmpOp::Gt => (a.0 > b.1).then_some(true).or((a.1 <= b.0).then_some(false)),
                CmpOp::Ge => (a.0 >= b.1).then_some(true).or((a.1 < b.0).then_some(false)),
                CmpOp::Eq | CmpOp::Ne => {
                    let eq = if a.0 == a.1 && b.0 == b.1 && a.0 == b.0 {
                        Some(true)
                    } else if a.1 < b.0 || b.1 < a.0 {
                        Some(false)
                    } else {
                        None
                    };
                    eq.map(|v| v == (op == CmpOp::Eq))
                }
            };
            if let Some(v) = decided {
                return Expr::Bool(v);
            }
        }
        Expr::Cmp { op, lhs: Box::new(l), rhs: Box::new(r) }
    }

    /// `e` with its operands simplified and its own node kept.
    fn shallow(&self, e: &Expr) -> Expr {
        let sub = |x: &Expr| Box::new(self.simp_any(x));
        match e {
            Expr::Load { src, index } => {
                Expr::Load { src: src.clone(), index: Box::new(self.simp_index(index)) }
            }
            Expr::Unary { op, arg } => Expr::Unary { op: *op, arg: sub(arg) },
            Expr::Binary { op, lhs, rhs } => Expr::Binary { op: *op, lhs: sub(lhs), rhs: sub(rhs) },
            Expr::Cmp { op, lhs, rhs } => self.cmp(*op, lhs, rhs),
            Expr::Select { cond, then, else_ } => {
                Expr::Select { cond: sub(cond), then: sub(then), else_: sub(else_) }
            }
            Expr::Cast { ty, arg } => Expr::Cast { ty: *ty, arg: sub(arg) },
            Expr::Call { f, args } => {
                Expr::Call { f: *f, args: args.iter().map(|a| self.simp_any(a)).collect() }
            }
            _ => e.clone(),
        }
    }

    /// The linear form of an integer expression.
    fn linear(&self, e: &Expr) -> Lin {
        self.try_linear(e).unwrap_or_else(|| Lin::atom(e.ty(), self.shallow(e)))
    }

    /// `None` when a coefficient overflows; the caller keeps the node then.
    fn try_linear(&self, e: &Expr) -> Option<Lin> {
        let ty = e.ty();
        Some(match e {
            Expr::I64(_) | Expr::I32(_) => Lin::constant(ty, lit_of(e)?),
            Expr::Unary { op: UnOp::Neg, arg } => self.linear(arg).scale(-1)?,
            Expr::Binary { op, lhs, rhs } => match op {
                BinOp::Add | BinOp::Sub => {
                    let scale = if *op == BinOp::Add { 1 } else { -1 };
                    self.recombine(self.linear(lhs).plus(&self.linear(rhs), scale)?)
                }
                BinOp::Mul => {
                    let (a, b) = (self.linear(lhs), self.linear(rhs));
                    match (a.as_const(), b.as_const()) {
                        (Some(k), _) => b.scale(k)?,
                        (_, Some(k)) => a.scale(k)?,
                        _ => Lin::atom(ty, bin(BinOp::Mul, self.build(&a)?, self.build(&b)?)),
                    }
                }
                BinOp::Div | BinOp::Rem => {
                    let (x, d) = (self.linear(lhs), self.linear(rhs));
                    match d.as_const() {
                        Some(c) if c > 0 && *op == BinOp::Div => self.div(x, c)?,
                        Some(c) if c > 0 => self.rem(x, c)?,
                        _ => Lin::atom(ty, bin(*op, self.build(&x)?, self.build(&d)?)),
                    }
                }
                BinOp::And | BinOp::Or => return None,
            },
            Expr::Select { cond, then, else_ } => match self.simp_any(cond) {
                Expr::Bool(true) => self.linear(then),
                Expr::Bool(false) => self.linear(else_),
                c => Lin::atom(
                    ty,
                    Expr::Select {
                        cond: Box::new(c),
                        then: Box::new(self.simp_int(then)),
                        else_: Box::new(self.simp_int(else_)),
                    },
                ),
            },
            _ => Lin::atom(ty, self.shallow(e)),
        })
    }

    /// `k·(z % c) + k·c·(z / c) → k·z`, also with `z = y / a` paired with
    /// `y / (a·c)` for `y ≥ 0` (C's `(z / c)·c + z % c == z`).
    fn recombine(&self, mut x: Lin) -> Lin {
        'again: loop {
            for i in 0..x.terms.len() {
                let (Expr::Binary { op: BinOp::Rem, lhs: z, rhs: m }, k) = &x.terms[i] else { continue };
                let Some(c) = lit_of(m).filter(|&c| c > 0) else { continue };
                let Some(kc) = k.checked_mul(c) else { continue };
                for j in 0..x.terms.len() {
                    let (Expr::Binary { op: BinOp::Div, lhs: w, rhs: d }, k2) = &x.terms[j] else { continue };
                    if *k2 != kc || j == i {
                        continue;
                    }
                    let d = lit_of(d);
                    let paired = (**w == **z && d == Some(c))
                        || match &**z {
                            Expr::Binary { op: BinOp::Div, lhs: y, rhs: a } => {
                                **w == **y
                                    && lit_of(a).filter(|&a| a > 0).and_then(|a| a.checked_mul(c)) == d
                                    && self.range(y).is_some_and(|r| r.0 >= 0)
                            }
                            _ => false,
                        };
                    if !paired {
                        continue;
                    }
                    let Some(whole) = self.linear(z).scale(*k) else { continue };
                    let mut rest = x.clone();
                    rest.terms.remove(i.max(j));
                    rest.terms.remove(i.min(j));
                    if let Some(y) = rest.plus(&whole, 1) {
                        x = y;
                        continue 'again;
                    }
                }
            }
            return x;
        }
    }

    /// `x = c1·q + r` with `r ∈ [0, c1)`, if the ranges allow it. The
    /// constant is shared out by `r`'s range rather than by its own residue,
    /// so that `(i + 12) % 16` is not produced for `i - 4` with `i ∈ [4, 20)`.
    fn split_fitting(&self, x: &Lin, c1: i64) -> Option<(Lin, Lin)> {
        let (mut q, mut r) = x.split(c1);
        let (lo, hi) = self.lin_range(&r)?;
        let shift = lo.div_euclid(c1);
        let moved = shift.checked_mul(c1)?;
        r.c = r.c.checked_sub(moved)?;
        q.c = q.c.checked_add(shift)?;
        let (lo, hi) = (lo.checked_sub(moved)?, hi.checked_sub(moved)?);
        (lo >= 0 && hi < c1).then_some((q, r))
    }

    /// `x / c` for `c > 0`.
    fn div(&self, x: Lin, c: i64) -> Option<Lin> {
        if c == 1 {
            return Some(x);
        }
        if let Some(v) = x.as_const() {
            return Some(Lin::constant(x.ty, v / c));
        }
        let Some((lo, hi)) = self.lin_range(&x) else { return self.div_atom(x, c) };
        if lo > -c && hi < c {
            return Some(Lin::constant(x.ty, 0));
        }
        if lo < 0 {
            return self.div_atom(x, c);
        }
        // x ≥ 0 and x = c1·q + r with r ∈ [0, c1): x / c = q / (c / c1).
        for c1 in x.split_candidates(c) {
            if let Some((q, _)) = self.split_fitting(&x, c1) {
                return if c1 == c { Some(q) } else { self.div(q, c / c1) };
            }
        }
        // x ≥ 0, x = c·q + r with r ≥ 0: x / c = q + r / c.
        let (q, r) = x.split(c);
        if !q.is_zero() && self.lin_range(&r).is_some_and(|(a, _)| a >= 0) {
            return q.plus(&self.div(r, c)?, 1);
        }
        self.div_atom(x, c)
    }

    /// `x / c` kept as a division, merging `(y / a) / c` into `y / (a·c)` for `y ≥ 0`.
    fn div_atom(&self, x: Lin, c: i64) -> Option<Lin> {
        if let Some(Expr::Binary { op: BinOp::Div, lhs: y, rhs: a }) = x.single_atom() {
            if let Some(ac) = lit_of(a).filter(|&a| a > 0).and_then(|a| a.checked_mul(c)) {
                if self.range(y).is_some_and(|r| r.0 >= 0) {
                    return self.div(self.linear(y), ac);
                }
            }
        }
        Some(Lin::atom(x.ty, bin(BinOp::Div, self.build(&x)?, lit(x.ty, c)?)))
    }

    /// `x % c` for `c > 0`.
    fn rem(&self, x: Lin, c: i64) -> Option<Lin> {
        if c == 1 {
            return Some(Lin::constant(x.ty, 0));
        }
        if let Some(v) = x.as_const() {
            return Some(Lin::constant(x.ty, v % c));
        }
        let Some((lo, hi)) = self.lin_range(&x) else { return self.rem_atom(x, c) };
        if lo > -c && hi < c {
            return Some(x);
        }
        if lo < 0 {
            return self.rem_atom(x, c);
        }
        // x ≥ 0 and x = c1·q + r with r ∈ [0, c1): x % c = c1·(q % (c / c1)) + r.
        for c1 in x.split_candidates(c) {
            if let Some((q, r)) = self.split_fitting(&x, c1) {
                return if c1 == c { Some(r) } else { self.rem(q, c / c1)?.scale(c1)?.plus(&r, 1) };
            }
        }
        // x ≥ 0, x = c·q + r with r ≥ 0: x % c = r % c.
        let (q, r) = x.split(c);
        if !q.is_zero() && self.lin_range(&r).is_some_and(|(a, _)| a >= 0) {
            return self.rem(r, c);
        }
        self.rem_atom(x, c)
    }

    /// `x % c` kept as a remainder, merging `(y % m) % c` into `y % c` when
    /// `c | m` (true in C for either sign of `y`).
    fn rem_atom(&self, x: Lin, c: i64) -> Option<Lin> {
        if let Some(Expr::Binary { op: BinOp::Rem, lhs: y, rhs: m }) = x.single_atom() {
            if lit_of(m).is_some_and(|m| m > 0 && m % c == 0) {
                return self.rem(self.linear(y), c);
            }
        }
        Some(Lin::atom(x.ty, bin(BinOp::Rem, self.build(&x)?, lit(x.ty, c)?)))
    }

    /// The expression of a linear form: positive terms in order, then the
    /// negative ones, then the constant. `None` if a literal does not fit
    /// the type.
    fn build(&self, x: &Lin) -> Option<Expr> {
        let ty = x.ty;
        let term = |a: &Expr, k: i64| -> Option<Expr> {
            let m = k.checked_abs()?;
            Some(if m == 1 { a.clone() } else { bin(BinOp::Mul, a.clone(), lit(ty, m)?) })
        };
        let mut acc: Option<Expr> = None;
        for (a, k) in x.terms.iter().filter(|(_, k)| *k > 0) {
            let t = term(a, *k)?;
            acc = Some(match acc {
                None => t,
                Some(s) => bin(BinOp::Add, s, t),
            });
        }
        let mut c = x.c;
        if acc.is_none() && c > 0 && x.terms.iter().any(|(_, k)| *k < 0) {
            acc = Some(lit(ty, c)?);
            c = 0;
        }
        for (a, k) in x.terms.iter().filter(|(_, k)| *k < 0) {
            let t = term(a, *k)?;
            acc = Some(match acc {
                None => Expr::Unary { op: UnOp::Neg, arg: Box::new(t) },
                Some(s) => bin(BinOp::Sub, s, t),
            });
        }
        Some(match acc {
            None => lit(ty, c)?,
            Some(s) if c > 0 => bin(BinOp::Add, s, lit(ty, c)?),
            Some(s) if c < 0 => bin(BinOp::Sub, s, lit(ty, c.checked_neg()?)?),
            Some(s) => s,
        })
    }

    fn lin_range(&self, x: &Lin) -> Option<Range> {
        let mut r = (x.c, x.c);
        for (a, k) in &x.terms {
            r = add_ranges(r, mul_ranges(self.range(a)?, (*k, *k))?)?;
        }
        Some(r)
    }

    /// Bounds of an integer expression, `None` when unknown.
    fn range(&self, e: &Expr) -> Option<Range> {
        match e {
            Expr::I64(_) | Expr::I32(_) => lit_of(e).map(|v| (v, v)),
            Expr::Item => Some(self.item),
            Expr::Lane => self.lane,
            Expr::Var { name, ty } if ty.is_int() => self.lookup(name)?.range,
            Expr::Unary { op: UnOp::Neg, arg } => {
                let (lo, hi) = self.range(arg)?;
                Some((hi.checked_neg()?, lo.checked_neg()?))
            }
            Expr::Binary { op, lhs, rhs } if e.ty().is_int() => {
                let a = self.range(lhs)?;
                match op {
                    BinOp::Add => add_ranges(a, self.range(rhs)?),
                    BinOp::Sub => {
                        let (lo, hi) = self.range(rhs)?;
                        add_ranges(a, (hi.checked_neg()?, lo.checked_neg()?))
                    }
                    BinOp::Mul => mul_ranges(a, self.range(rhs)?),
                    BinOp::Div => {
                        let c = lit_of(rhs)?;
                        match c {
                            0 => None,
                            c if c > 0 => Some((a.0 / c, a.1 / c)),
                            c => Some((a.1.checked_div(c)?, a.0.checked_div(c)?)),
                        }
                    }
                    BinOp::Rem => {
                        let m = lit_of(rhs)?.checked_abs().filter(|&m| m > 0)?;
                        let lo = if a.0 < 0 { a.0.max(1 - m) } else { 0 };
                        let hi = if a.1 > 0 { a.1.min(m - 1) } else { 0 };
                        Some(if a.0 > -m && a.1 < m { a } else { (lo, hi) })
                    }
                    BinOp::And | BinOp::Or => None,
                }
            }
            Expr::Select { then, else_, .. } if e.ty().is_int() => {
                let (a, b) = (self.range(then)?, self.range(else_)?);
                Some((a.0.min(b.0), a.1.max(b.1)))
            }
            Expr::Cast { ty: Ty::I64, arg } if arg.ty().is_int() => self.range(arg),
            Expr::Cast { ty: Ty::I32, arg } if arg.ty().is_int() => self.range(arg).filter(|&r| fits_i32(r)),
            _ => None,
        }
    }
}

/// Drops integer `Let`s no expression refers to any more (their definitions
/// were substituted into every use).
fn drop_dead_lets(mut body: Vec<Stmt>) -> Vec<Stmt> {
    loop {
        let mut used = HashSet::new();
        super::collect_refs(&body, &mut used);
        let mut removed = false;
        body = retain_lets(body, &used, &mut removed);
        if !removed {
            return body;
        }
    }
}

fn retain_lets(stmts: Vec<Stmt>, used: &HashSet<String>, removed: &mut bool) -> Vec<Stmt> {
    stmts
        .into_iter()
        .filter_map(|s| match s {
            Stmt::Let { ref var, ty, .. } if ty.is_int() && !used.contains(var) => {
                *removed = true;
                None
            }
            Stmt::For { var, start, end, step, unroll, body } => {
                Some(Stmt::For { var, start, end, step, unroll, body: retain_lets(body, used, removed) })
            }
            Stmt::If { cond, then, else_ } => Some(Stmt::If {
                cond,
                then: retain_lets(then, used, removed),
                else_: retain_lets(else_, used, removed),
            }),
            s => Some(s),
        })
        .collect()
}
