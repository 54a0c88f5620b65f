//! Loop fusion and scalar replacement inside one item's body.
//!
//! The item emitter (docs/architecture.md §5) writes one loop per graph op of a fused
//! region, each storing its result to a per-item local array that the next
//! op's loop reads back: a VWN connection backward over a 1024-wide over-width
//! row runs a dozen such passes, with a dozen 4 KiB arrays that no longer fit
//! the L1 cache together. This pass
//! 1. merges consecutive elementwise loops over the same range when that
//!    cannot change any value read (see [`can_merge`]); loops of one
//!    iteration (a row-form product over an item's one row) are replaced by
//!    their bodies first, and scalars between two loops that read nothing the
//!    first writes move above it, so that such products merge too (see
//!    [`peel_single_iterations`]); and then
//! 2. turns a local array that is written and read only at the loop variable
//!    of one loop, read after it is written, into a scalar of that loop, and
//! 3. computes a local array that is a function of read-only parameters alone
//!    (the squares of a row before its mean, docs/math.md §4.3's RMS statistic)
//!    where it is read, when that costs no more arithmetic: the array then never
//!    exists. On the GPU a 256-element array of this kind is promoted to
//!    registers next to the rest of a fused body and spills; on the CPU it is
//!    one store and one load less per element.
//!
//! All these rewrites keep every float operation and its operands as they were
//! (only where intermediate values live changes, or, for the third, when they
//! are computed), so results are bit for bit those of the unfused body.

use std::collections::HashSet;

use super::{
    collect_declared, collect_refs, each_expr, expr_refs, rewrite_stmts, BinOp, Buf, Expr, Kernel, Stmt,
    Unroll,
};

/// Applies the rewrites to a thread-per-item kernel (block-per-item kernels
/// split their bodies at barriers and keep their shape).
pub fn fuse_loops(mut kernel: Kernel) -> Kernel {
    if kernel.grid.is_block() {
        return kernel;
    }
    let body = merge_loops(std::mem::take(&mut kernel.body));
    let mut taken = HashSet::new();
    collect_refs(&body, &mut taken);
    kernel.params.iter().for_each(|p| {
        taken.insert(p.name.clone());
    });
    let read_only: HashSet<String> =
        kernel.params.iter().filter(|p| p.access == super::Access::Read).map(|p| p.name.clone()).collect();
    kernel.body = compute_at_reads(scalarize(body, &mut taken), &read_only);
    kernel
}

/// A loop `for (v = 0; v < n; ++v)` whose body only binds `Let`s and stores
/// (no nested control flow, no accumulation): the shape the item emitter gives
/// elementwise ops.
fn elementwise_len(s: &Stmt) -> Option<i64> {
    let Stmt::For { start, end, step: 1, unroll: Unroll::Auto, body, .. } = s else { return None };
    let zero = matches!(start, Expr::I64(0) | Expr::I32(0));
    let simple = body.iter().all(|s| matches!(s, Stmt::Let { .. } | Stmt::Store { .. } | Stmt::Comment(_)));
    match end {
        Expr::I64(n) if zero && simple => Some(*n),
        Expr::I32(n) if zero && simple => Some(i64::from(*n)),
        _ => None,
    }
}

fn merge_loops(stmts: Vec<Stmt>) -> Vec<Stmt> {
    let stmts = peel_single_iterations(stmts);
    let mut out: Vec<Stmt> = Vec::with_capacity(stmts.len());
    // Index in `out` of the last loop still open to merging.
    let mut open: Option<usize> = None;
    for s in stmts {
        let s = match s {
            Stmt::For { var, start, end, step, unroll, body } => {
                Stmt::For { var, start, end, step, unroll, body: merge_loops(body) }
            }
            Stmt::If { cond, then, else_ } => {
                Stmt::If { cond, then: merge_loops(then), else_: merge_loops(else_) }
            }
            s => s,
        };
        if let (Stmt::LocalArray { .. }, Some(at)) = (&s, open) {
            // A declaration has no effect: hoist it above the open loop.
            out.insert(at, s);
            open = Some(at + 1);
            continue;
        }
        if let (Stmt::Let { expr, .. }, Some(at)) = (&s, open) {
            // A scalar that reads nothing the open loop writes has the same
            // value above it: hoist it, so that the loop after it (a
            // row-form product's, whose coefficients it loads) may merge.
            if !reads_any(expr, &stored_buffers(&out[at])) {
                out.insert(at, s);
                open = Some(at + 1);
                continue;
            }
        }
        match (elementwise_len(&s), open) {
            (Some(n), Some(at)) if elementwise_len(&out[at]) == Some(n) && can_merge(&out[at], &s) => {
                let Stmt::For { var: v2, body: b2, .. } = s else { unreachable!("an elementwise loop") };
                let Stmt::For { var: v1, body: b1, .. } = &mut out[at] else {
                    unreachable!("an elementwise loop")
                };
                let v1 = v1.clone();
                b1.extend(rewrite_stmts(&b2, &|x| renamed(x, &v2, &v1)));
            }
            (Some(_), _) => {
                out.push(s);
                open = Some(out.len() - 1);
            }
            (None, _) => {
                out.push(s);
                open = None;
            }
        }
    }
    out
}

/// `stmts` with each loop of one iteration from zero replaced by its body,
/// where the body no longer names the loop's variable (the index
/// simplifier folds its one value in) and declares no name that the other
/// statements declare: a row-form product over an item's one row (docs/math.md
/// §4.3's `H_res` mixing, one stream an item) is then scalars and one
/// elementwise loop at the item's level, which [`merge_loops`] may merge with
/// the loops around it.
fn peel_single_iterations(stmts: Vec<Stmt>) -> Vec<Stmt> {
    let declared: Vec<HashSet<String>> = stmts.iter().map(|s| declared_in(std::slice::from_ref(s))).collect();
    let mut out = Vec::with_capacity(stmts.len());
    for (i, s) in stmts.into_iter().enumerate() {
        let Stmt::For { var, start, end, step: 1, body, .. } = &s else {
            out.push(s);
            continue;
        };
        let one_iteration =
            matches!(start, Expr::I64(0) | Expr::I32(0)) && matches!(end, Expr::I64(1) | Expr::I32(1));
        let mut refs = HashSet::new();
        collect_refs(body, &mut refs);
        let inner = declared_in(body);
        let clashes = declared.iter().enumerate().any(|(j, names)| j != i && !names.is_disjoint(&inner));
        if one_iteration && !refs.contains(var) && !clashes {
            let Stmt::For { body, .. } = s else { unreachable!("matched a loop") };
            out.extend(body);
        } else {
            out.push(s);
        }
    }
    out
}

/// Every name `stmts` declare, at any depth.
fn declared_in(stmts: &[Stmt]) -> HashSet<String> {
    let mut names = HashSet::new();
    collect_declared(stmts, &mut names);
    names
}

/// The buffers a statement stores to, at any depth.
fn stored_buffers(s: &Stmt) -> HashSet<String> {
    let mut out = HashSet::new();
    match s {
        Stmt::Store { target, .. } | Stmt::AccumStore { target, .. } => {
            out.insert(target.name().to_string());
        }
        Stmt::For { body, .. } => body.iter().for_each(|s| out.extend(stored_buffers(s))),
        Stmt::If { then, else_, .. } => then.iter().chain(else_).for_each(|s| out.extend(stored_buffers(s))),
        _ => {}
    }
    out
}

/// Whether `e` loads from any of `buffers`.
fn reads_any(e: &Expr, buffers: &HashSet<String>) -> bool {
    let mut found = false;
    e.visit(&mut |e| found |= matches!(e, Expr::Load { src, .. } if buffers.contains(src.name())));
    found
}

/// One buffer access of an elementwise loop body: the buffer, the index with
/// the body's `Let`s substituted, and whether it writes.
struct Access {
    buf: String,
    index: Expr,
    write: bool,
}

fn accesses(body: &[Stmt]) -> Vec<Access> {
    let mut lets: Vec<(String, Expr)> = Vec::new();
    let mut out = Vec::new();
    for s in body {
        match s {
            Stmt::Let { var, expr, .. } => {
                loads(expr, &lets, &mut out);
                lets.push((var.clone(), inline(expr, &lets)));
            }
            Stmt::Store { target, index, value } => {
                loads(index, &lets, &mut out);
                loads(value, &lets, &mut out);
                out.push(Access { buf: target.name().to_string(), index: inline(index, &lets), write: true });
            }
            _ => {}
        }
    }
    out
}

fn loads(e: &Expr, lets: &[(String, Expr)], out: &mut Vec<Access>) {
    e.visit(&mut |e| {
        if let Expr::Load { src, index } = e {
            out.push(Access { buf: src.name().to_string(), index: inline(index, lets), write: false });
        }
    });
}

/// Whether running the second loop's body right after the first's, iteration
/// by iteration, reads and writes the same values as running all of the first
/// loop and then all of the second: no buffer is written by both, and a buffer
/// written by one and read by the other is only ever accessed, by both, at one
/// index `x + v` that is injective in the loop variable `v`, so iteration `i`
/// of either loop touches only what iteration `i` of the other does.
fn can_merge(first: &Stmt, second: &Stmt) -> bool {
    let (Stmt::For { var: v1, body: b1, .. }, Stmt::For { var: v2, body: b2, .. }) = (first, second) else {
        return false;
    };
    let a1 = accesses(b1);
    let a2: Vec<Access> =
        accesses(b2).into_iter().map(|a| Access { index: rename(&a.index, v2, v1), ..a }).collect();
    let written = |acc: &[Access]| -> HashSet<String> {
        acc.iter().filter(|a| a.write).map(|a| a.buf.clone()).collect()
    };
    let (w1, w2) = (written(&a1), written(&a2));
    if w1.intersection(&w2).next().is_some() {
        return false;
    }
    let shared = |w: &HashSet<String>, other: &[Access]| -> Vec<String> {
        other.iter().filter(|a| w.contains(&a.buf)).map(|a| a.buf.clone()).collect()
    };
    let conflicts: HashSet<String> = shared(&w1, &a2).into_iter().chain(shared(&w2, &a1)).collect();
    conflicts.iter().all(|buf| {
        let mut indices = a1.iter().chain(&a2).filter(|a| &a.buf == buf).map(|a| &a.index);
        let first = indices.next().expect("a conflicting buffer is accessed");
        injective_in(first, v1) && indices.all(|i| i == first)
    })
}

/// `e` is `v`, or `x + v`, `v + x` or `e' - x` with `e'` of that form and `x`
/// free of `v`.
fn injective_in(e: &Expr, v: &str) -> bool {
    match e {
        Expr::Var { name, .. } => name == v,
        Expr::Binary { op: BinOp::Add, lhs, rhs } => {
            (injective_in(lhs, v) && !mentions(rhs, v)) || (injective_in(rhs, v) && !mentions(lhs, v))
        }
        Expr::Binary { op: BinOp::Sub, lhs, rhs } => injective_in(lhs, v) && !mentions(rhs, v),
        _ => false,
    }
}

fn mentions(e: &Expr, v: &str) -> bool {
    let mut refs = HashSet::new();
    expr_refs(e, &mut refs);
    refs.contains(v)
}

/// Replaces every array that lives in one loop (see the module docs) with a
/// scalar `Let`, in this block and the blocks nested in it.
fn scalarize(stmts: Vec<Stmt>, taken: &mut HashSet<String>) -> Vec<Stmt> {
    let mut stmts: Vec<Stmt> = stmts
        .into_iter()
        .map(|s| match s {
            Stmt::For { var, start, end, step, unroll, body } => {
                Stmt::For { var, start, end, step, unroll, body: scalarize(body, taken) }
            }
            Stmt::If { cond, then, else_ } => {
                Stmt::If { cond, then: scalarize(then, taken), else_: scalarize(else_, taken) }
            }
            s => s,
        })
        .collect();
    let arrays: Vec<String> = stmts
        .iter()
        .filter_map(|s| if let Stmt::LocalArray { var, .. } = s { Some(var.clone()) } else { None })
        .collect();
    for array in arrays {
        let users: Vec<usize> = (0..stmts.len())
            .filter(|&i| !matches!(&stmts[i], Stmt::LocalArray { var, .. } if *var == array))
            .filter(|&i| {
                let mut refs = HashSet::new();
                collect_refs(std::slice::from_ref(&stmts[i]), &mut refs);
                refs.contains(&array)
            })
            .collect();
        let [user] = users[..] else { continue };
        let Stmt::For { var, body, .. } = &mut stmts[user] else { continue };
        let scalar = fresh(taken, &format!("{array}_v"));
        if let Some(new_body) = scalarize_in(body, &array, var, &scalar) {
            *body = new_body;
            stmts.retain(|s| !matches!(s, Stmt::LocalArray { var, .. } if *var == array));
        }
    }
    stmts
}

/// The loop body with `array[v]` kept in the scalar `scalar`, if the body
/// stores `array[v]` exactly once at its top level and reads `array` only at
/// `v` after that store.
fn scalarize_in(body: &[Stmt], array: &str, v: &str, scalar: &str) -> Option<Vec<Stmt>> {
    let at_v = |index: &Expr| matches!(index, Expr::Var { name, .. } if name == v);
    let mut stored = false;
    let mut out = Vec::with_capacity(body.len());
    for s in body {
        match s {
            Stmt::Store { target: Buf::Local { name, ty }, index, value } if name == array => {
                if stored || !at_v(index) || !reads_only_at(value, array, v) {
                    return None;
                }
                stored = true;
                out.push(Stmt::Let { var: scalar.to_string(), ty: *ty, expr: value.clone() });
            }
            Stmt::Let { var, ty, expr } => {
                if !reads_only_at(expr, array, v) || (!stored && reads(expr, array)) {
                    return None;
                }
                out.push(Stmt::Let { var: var.clone(), ty: *ty, expr: replace_loads(expr, array, scalar) });
            }
            Stmt::Store { target, index, value } => {
                let ok = |e: &Expr| reads_only_at(e, array, v) && (stored || !reads(e, array));
                if !ok(index) || !ok(value) {
                    return None;
                }
                out.push(Stmt::Store {
                    target: target.clone(),
                    index: replace_loads(index, array, scalar),
                    value: replace_loads(value, array, scalar),
                });
            }
            Stmt::Comment(_) => out.push(s.clone()),
            _ => {
                let mut refs = HashSet::new();
                collect_refs(std::slice::from_ref(s), &mut refs);
                if refs.contains(array) {
                    return None;
                }
                out.push(s.clone());
            }
        }
    }
    stored.then_some(out)
}

fn reads(e: &Expr, array: &str) -> bool {
    let mut found = false;
    e.visit(&mut |e| found |= matches!(e, Expr::Load { src, .. } if src.name() == array));
    found
}

/// Every load of `array` in `e` is at index `v`.
fn reads_only_at(e: &Expr, array: &str, v: &str) -> bool {
    let mut ok = true;
    e.visit(&mut |e| {
        if let Expr::Load { src, index } = e {
            if src.name() == array {
                ok &= matches!(index.as_ref(), Expr::Var { name, .. } if name == v);
            }
        }
    });
    ok
}

fn fresh(taken: &mut HashSet<String>, base: &str) -> String {
    let mut name = base.to_string();
    let mut n = 0;
    while taken.contains(&name) {
        n += 1;
        name = format!("{base}{n}");
    }
    taken.insert(name.clone());
    name
}

/// `e` with the earlier `Let`s of the same body substituted.
fn inline(e: &Expr, lets: &[(String, Expr)]) -> Expr {
    e.rewrite(&|x| match x {
        Expr::Var { name, .. } => lets.iter().rev().find(|(n, _)| n == name).map(|(_, d)| d.clone()),
        _ => None,
    })
}

fn rename(e: &Expr, from: &str, to: &str) -> Expr {
    e.rewrite(&|x| renamed(x, from, to))
}

/// `x` as the variable `to` if it is the variable `from`.
fn renamed(x: &Expr, from: &str, to: &str) -> Option<Expr> {
    match x {
        Expr::Var { name, ty } if name == from => Some(Expr::Var { name: to.to_string(), ty: *ty }),
        _ => None,
    }
}

fn replace_loads(e: &Expr, array: &str, scalar: &str) -> Expr {
    e.rewrite(&|x| match x {
        Expr::Load { src, .. } if src.name() == array => {
            Some(Expr::Var { name: scalar.to_string(), ty: src.elem_ty() })
        }
        _ => None,
    })
}

/// Rewrite 3 of the module docs, for the arrays declared at the top of the
/// body (where the item emitter declares them). An array qualifies when the
/// first statement that mentions it is an elementwise loop over its length
/// that stores element `v` once, from loads of `read_only` parameters (which
/// no statement can change) indexed by `v` and the item, and when every later
/// statement only reads it, with no more reads in all than it has elements
/// (so computing at the reads does no more arithmetic than the loop did).
fn compute_at_reads(mut stmts: Vec<Stmt>, read_only: &HashSet<String>) -> Vec<Stmt> {
    let arrays: Vec<(String, usize)> = stmts
        .iter()
        .filter_map(
            |s| if let Stmt::LocalArray { var, len, .. } = s { Some((var.clone(), *len)) } else { None },
        )
        .collect();
    for (array, len) in arrays {
        let mentions_array = |s: &Stmt| {
            let mut refs = HashSet::new();
            collect_refs(std::slice::from_ref(s), &mut refs);
            refs.contains(&array)
        };
        let Some(at) = stmts.iter().position(|s| !matches!(s, Stmt::LocalArray { .. }) && mentions_array(s))
        else {
            continue;
        };
        let Some((value, var)) = element_of(&stmts[at], &array, len, read_only) else { continue };
        let later = &stmts[at + 1..];
        if stores_to(later, &array) || reads_in(later, &array).is_none_or(|n| n > len as u64) {
            continue;
        }
        let computed = |x: &Expr| match x {
            Expr::Load { src, index } if src.name() == array => Some(value.rewrite(&|y| match y {
                Expr::Var { name, .. } if *name == var => Some(index.as_ref().clone()),
                _ => None,
            })),
            _ => None,
        };
        let rest = rewrite_stmts(later, &computed);
        stmts.truncate(at + 1);
        let Stmt::For { body, .. } = &mut stmts[at] else { unreachable!("element_of takes a loop") };
        body.retain(|s| !matches!(s, Stmt::Store { target, .. } if target.name() == array));
        *body = live_lets(std::mem::take(body));
        if body.iter().all(|s| matches!(s, Stmt::Let { .. } | Stmt::Comment(_))) {
            stmts.pop();
        }
        stmts.retain(|s| !matches!(s, Stmt::LocalArray { var, .. } if *var == array));
        stmts.extend(rest);
    }
    stmts
}

/// The value `loop` stores at `array[v]` with its `Let`s substituted, and `v`,
/// if `loop` is an elementwise loop over `len` that stores the array once, at
/// `v`, never reads it, and computes the value from `v`, the item and loads of
/// `read_only` parameters only.
fn element_of(lp: &Stmt, array: &str, len: usize, read_only: &HashSet<String>) -> Option<(Expr, String)> {
    if elementwise_len(lp) != Some(len as i64) {
        return None;
    }
    let Stmt::For { var: loop_var, body, .. } = lp else { return None };
    let mut lets: Vec<(String, Expr)> = Vec::new();
    let mut value = None;
    for s in body {
        match s {
            Stmt::Let { var, expr, .. } => lets.push((var.clone(), inline(expr, &lets))),
            Stmt::Store { target, index, value: v } if target.name() == array => {
                let at_v = matches!(index, Expr::Var { name, .. } if name == loop_var);
                if value.is_some() || !at_v {
                    return None;
                }
                value = Some(inline(v, &lets));
            }
            _ => {}
        }
    }
    let value = value?;
    let mut pure = true;
    value.visit(&mut |e| match e {
        Expr::Var { name, .. } => pure &= name == loop_var,
        Expr::Load { src, .. } => pure &= read_only.contains(src.name()),
        Expr::Lane => pure = false,
        _ => {}
    });
    let reads_itself = body.iter().any(|s| {
        let mut found = false;
        each_expr(std::slice::from_ref(s), &mut |e| found |= reads(e, array));
        found
    });
    (pure && !reads_itself).then(|| (value, loop_var.clone()))
}

/// Whether any statement stores or accumulates into `array`.
fn stores_to(stmts: &[Stmt], array: &str) -> bool {
    stmts.iter().any(|s| match s {
        Stmt::Store { target, .. } | Stmt::AccumStore { target, .. } => target.name() == array,
        Stmt::For { body, .. } => stores_to(body, array),
        Stmt::If { then, else_, .. } => stores_to(then, array) || stores_to(else_, array),
        _ => false,
    })
}

/// How many loads of `array` running `stmts` executes at most (both branches
/// of a condition counted); `None` when a loop around one has a bound that is
/// not a literal.
fn reads_in(stmts: &[Stmt], array: &str) -> Option<u64> {
    let in_expr = |e: &Expr| {
        let mut n = 0u64;
        e.visit(&mut |x| n += u64::from(matches!(x, Expr::Load { src, .. } if src.name() == array)));
        n
    };
    let mut total = 0u64;
    for s in stmts {
        total += match s {
            Stmt::For { start, end, step, body, .. } => {
                let inner = reads_in(body, array)?;
                let bounds = (start.int_literal(), end.int_literal());
                match bounds {
                    _ if inner == 0 => in_expr(start) + in_expr(end),
                    (Some(a), Some(b)) => {
                        let trips = ((b - a).max(0) as u64).div_ceil((*step).max(1) as u64);
                        in_expr(start) + in_expr(end) + trips * inner
                    }
                    _ => return None,
                }
            }
            Stmt::If { cond, then, else_ } => {
                in_expr(cond) + reads_in(then, array)? + reads_in(else_, array)?
            }
            s => {
                let mut n = 0;
                each_expr(std::slice::from_ref(s), &mut |e| n += in_expr(e));
                n
            }
        };
    }
    Some(total)
}

/// The body without the `Let`s nothing after them reads.
fn live_lets(body: Vec<Stmt>) -> Vec<Stmt> {
    let mut used = HashSet::new();
    let mut kept = Vec::with_capacity(body.len());
    for s in body.into_iter().rev() {
        if let Stmt::Let { var, .. } = &s {
            if !used.contains(var) {
                continue;
            }
        }
        collect_refs(std::slice::from_ref(&s), &mut used);
        kept.push(s);
    }
    kept.reverse();
    kept
}
