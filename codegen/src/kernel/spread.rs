//! Thread-per-item kernels spread over a block of lanes, for the GPU
//! (docs/architecture.md §5, §6, §10).
//!
//! A fused token-local kernel runs one thread per item (a token) and walks
//! the item's rows (`C`, `n·C` or `N·C` floats) in loops. On the GPU the 32
//! threads of a warp then load from 32 different rows at once, one memory
//! transaction each: such kernels reached 3-7 % of the H200's copy bandwidth.
//! This pass gives each item a block of [`LANES`] threads instead:
//! - every long loop (at least [`LANES`] iterations) at the item's top level
//!   whose iterations are independent is split across the lanes (lane `l`
//!   takes iterations `l, l + LANES, …`), so a warp's loads fall in one row,
//!   consecutive;
//! - a sum such a loop accumulates into a scalar becomes a per-lane partial
//!   and a block reduction ([`Stmt::BlockReduce`], a fixed tree: the result
//!   is deterministic and the same in the C rendering);
//! - everything else (the per-token scalars, the small loops over the stream
//!   and segment axes) runs on every lane alike, on the same values; such a
//!   statement's accumulating stores are made by lane 0 alone;
//! - a [`Stmt::Barrier`] goes before a statement that reads what an earlier
//!   one stored, or stores over what an earlier one accessed, since the last
//!   barrier or reduction.
//!
//! Small loops (at most [`UNROLL_MAX_TRIPS`] iterations) around long ones are
//! unrolled first, so that mHC's `n × n` Gram products over `C` (docs/math.md §4.2)
//! become top-level loops the lanes can share.
//!
//! A kernel whose shape does not fit (no long loop to split, a long loop that
//! must stay serial, or more work repeated on every lane than
//! [`REPEATED_WORK_PER_SPLIT_WORK`] allows) keeps its thread-per-item form.

use std::collections::{HashMap, HashSet};

use super::{
    collect_declared, each_expr, renamed, rewrite_stmts, stmt_work, BinOp, Buf, Combine, Expr, Grid, Kernel,
    KernelError, Stmt, Ty, Unroll,
};

/// Lanes per item: one warp, so a block reduction stays within the warp.
pub const LANES: u32 = 32;

/// Largest loop unrolled to bring the long loops inside it to the top level:
/// the stream axes of mHC (n = 4, a 4 × 4 Gram product) and xHC (N = 16).
const UNROLL_MAX_TRIPS: i64 = 16;

/// Largest body (top-level statements) unrolling may produce.
const MAX_TOP_LEVEL: usize = 1024;

/// How much work every lane may repeat, per unit of work split across the
/// lanes: the repeated part costs `LANES` times its thread-per-item share,
/// and pays when the split part's loads, consecutive now, dominate. On an
/// H200 a limit of 16 let kernels that repeat a few times their split work
/// (xHC's temporal augmentation and its kernel gradient, as they were then)
/// run slower than one thread per token; at 1 none did.
const REPEATED_WORK_PER_SPLIT_WORK: u64 = 1;

/// Most work (operations, loads and stores) every lane may repeat per item.
const MAX_REPEATED_WORK: u64 = 65536;

/// `kernel` spread over [`LANES`] lanes per item, `None` when its shape does
/// not fit (see the module documentation). An error is a spread kernel that
/// fails validation: a defect of this pass, which the callers' fallback (the
/// kernel as it was) hides from users and the tests must not.
pub fn spread_over_lanes(kernel: &Kernel) -> Result<Option<Kernel>, KernelError> {
    let Grid::ThreadPerItem { n, .. } = kernel.grid else { return Ok(None) };
    let lanes = i64::from(LANES);
    let body = with_unique_names(kernel.body.clone(), &mut HashSet::new(), &mut 0);
    let Some(body) = unroll_around_long_loops(&body, lanes, &mut 0) else { return Ok(None) };
    let owned = lane_owned_arrays(&body, lanes);
    let mut out = Vec::with_capacity(body.len());
    let mut hazards = Hazards::default();
    let (mut split_work, mut repeated_work) = (0u64, 0u64);
    for s in body {
        if let Some(reductions) = splittable(&s, lanes, &owned) {
            split_work += stmt_work(&s);
            // A scalar may sum over several loops: each loop's names are its own.
            let loop_index = out.len();
            let partials: Vec<(String, String, Ty)> = reductions
                .into_iter()
                .map(|(r, ty)| (r.clone(), format!("{r}_lane{loop_index}"), ty))
                .collect();
            for (_, p, ty) in &partials {
                out.push(Stmt::Var { var: p.clone(), ty: *ty, init: zero(*ty) });
            }
            let looped = split(s, &partials, lanes);
            hazards.before(&looped, &mut out);
            out.push(looped);
            for (r, p, ty) in partials {
                let sum = format!("{r}_sum{loop_index}");
                out.push(Stmt::BlockReduce { var: sum.clone(), op: Combine::Sum, value: scalar(&p, ty) });
                out.push(Stmt::Assign { var: r.clone(), value: scalar(&r, ty) + scalar(&sum, ty) });
                hazards.clear();
            }
        } else if let Some((branches, work)) = split_branches(&s, lanes, &owned) {
            split_work += work;
            repeated_work += stmt_work(&s).saturating_sub(work);
            hazards.before(&branches, &mut out);
            out.push(branches);
        } else {
            if !repeatable(&s) {
                return Ok(None);
            }
            repeated_work += stmt_work(&s);
            let s = accumulated_by_lane_zero(s);
            hazards.before(&s, &mut out);
            out.push(s);
        }
    }
    if split_work == 0
        || repeated_work > REPEATED_WORK_PER_SPLIT_WORK * split_work
        || repeated_work > MAX_REPEATED_WORK
    {
        return Ok(None);
    }
    let spread = Kernel {
        name: kernel.name.clone(),
        params: kernel.params.clone(),
        grid: Grid::BlockPerItem { n, threads: LANES },
        body: compacted(out, &owned.arrays),
    };
    spread.validate()?;
    Ok(Some(spread))
}

/// A splittable loop (see [`splittable`]) with its iterations dealt to the
/// lanes and its sums into `partials` made into the lanes' partials.
fn split(s: Stmt, partials: &[(String, String, Ty)], lanes: i64) -> Stmt {
    let Stmt::For { var, start, end, step, body, .. } = s else { return s };
    let offset = if step == 1 { Expr::Lane } else { Expr::Lane * Expr::I64(step) };
    let start = if start.int_literal() == Some(0) { offset } else { start + offset };
    Stmt::For {
        var,
        start,
        end,
        step: step * lanes,
        unroll: Unroll::Auto,
        body: with_partials(body, partials),
    }
}

/// A top-level `if` whose branches' long loops the lanes may share without a
/// barrier or a reduction inside the branch (xHC's row scatter: copy the
/// routed row or the kept one, docs/math.md §6.4): the `if` with those loops
/// split, and their work. The condition is the same on every lane (it
/// reads only values every lane has alike).
fn split_branches(s: &Stmt, lanes: i64, owned: &Owned) -> Option<(Stmt, u64)> {
    let Stmt::If { cond, then, else_ } = s else { return None };
    let mut work = 0;
    let mut branch = |stmts: &[Stmt]| -> Option<Vec<Stmt>> {
        let mut hazards = Hazards::default();
        let mut out = Vec::with_capacity(stmts.len());
        for st in stmts {
            let st = match splittable(st, lanes, owned) {
                Some(sums) if sums.is_empty() => {
                    work += stmt_work(st);
                    split(st.clone(), &[], lanes)
                }
                Some(_) => return None,
                None if repeatable(st) => accumulated_by_lane_zero(st.clone()),
                None => return None,
            };
            let mut barrier = Vec::new();
            hazards.before(&st, &mut barrier);
            if !barrier.is_empty() {
                return None;
            }
            out.push(st);
        }
        Some(out)
    };
    let (then, else_) = (branch(then)?, branch(else_)?);
    (work > 0).then(|| (Stmt::If { cond: cond.clone(), then, else_ }, work))
}

fn scalar(name: &str, ty: Ty) -> Expr {
    Expr::Var { name: name.to_string(), ty }
}

fn zero(ty: Ty) -> Expr {
    match ty {
        Ty::F64 => Expr::F64(0.0),
        _ => Expr::F32(0.0),
    }
}

/// A loop's literal trip count.
fn trips(s: &Stmt) -> Option<i64> {
    let Stmt::For { start, end, step, .. } = s else { return None };
    let (a, b) = (start.int_literal()?, end.int_literal()?);
    Some(if b > a { (b - a + step - 1) / step } else { 0 })
}

/// Whether `stmts` hold, at any depth, a loop of at least `lanes` literal trips.
fn has_long_loop(stmts: &[Stmt], lanes: i64) -> bool {
    stmts.iter().any(|s| match s {
        Stmt::For { body, .. } => trips(s).is_some_and(|t| t >= lanes) || has_long_loop(body, lanes),
        Stmt::If { then, else_, .. } => has_long_loop(then, lanes) || has_long_loop(else_, lanes),
        _ => false,
    })
}

/// `stmts` with every top-level loop of at most [`UNROLL_MAX_TRIPS`] literal
/// trips that holds a long loop replaced by its iterations, repeatedly: each
/// copy binds the loop variable to its value and renames what it declares
/// (`name_u<copy>`, `copies` counting every copy made), so every name stays
/// unique, also where sibling loops declared the same one. `None` past
/// [`MAX_TOP_LEVEL`].
fn unroll_around_long_loops(stmts: &[Stmt], lanes: i64, copies: &mut usize) -> Option<Vec<Stmt>> {
    let mut out = Vec::new();
    for s in stmts {
        let small = trips(s).is_some_and(|t| t <= UNROLL_MAX_TRIPS);
        match s {
            Stmt::For { var, start, step, body, .. } if small && has_long_loop(body, lanes) => {
                let first = start.int_literal()?;
                let mut declared = HashSet::new();
                collect_declared(body, &mut declared);
                for k in 0..trips(s)? {
                    *copies += 1;
                    let copy = *copies;
                    let names: HashMap<String, String> =
                        declared.iter().map(|d| (d.clone(), format!("{d}_u{copy}"))).collect();
                    let value = Expr::I64(first + k * step);
                    let bound = rewrite_stmts(body, &|e| match e {
                        Expr::Var { name, .. } if name == var => Some(value.clone()),
                        _ => None,
                    });
                    let copy = with_literals_folded(renamed(&bound, &names));
                    out.extend(unroll_around_long_loops(&copy, lanes, copies)?);
                }
            }
            _ => out.push(s.clone()),
        }
        if out.len() > MAX_TOP_LEVEL {
            return None;
        }
    }
    Some(out)
}

/// `stmts` with every name declared once in the whole body: a name a sibling
/// scope declared again (two loops each with their own `g`) is renamed
/// (`name_d<k>`) from its declaration to the end of its block. The analyses
/// below look scalars up by name across scopes.
fn with_unique_names(mut stmts: Vec<Stmt>, seen: &mut HashSet<String>, renames: &mut usize) -> Vec<Stmt> {
    let mut out = Vec::with_capacity(stmts.len());
    let mut i = 0;
    while i < stmts.len() {
        let declared = match &stmts[i] {
            Stmt::Let { var, .. }
            | Stmt::Var { var, .. }
            | Stmt::LocalArray { var, .. }
            | Stmt::BlockReduce { var, .. }
            | Stmt::For { var, .. } => Some(var.clone()),
            _ => None,
        };
        if let Some(name) = declared {
            if !seen.insert(name.clone()) {
                *renames += 1;
                let fresh = format!("{name}_d{renames}");
                let tail = renamed(&stmts[i..], &HashMap::from([(name, fresh.clone())]));
                stmts.truncate(i);
                stmts.extend(tail);
                seen.insert(fresh);
            }
        }
        out.push(match stmts[i].clone() {
            Stmt::For { var, start, end, step, unroll, body } => {
                Stmt::For { var, start, end, step, unroll, body: with_unique_names(body, seen, renames) }
            }
            Stmt::If { cond, then, else_ } => Stmt::If {
                cond,
                then: with_unique_names(then, seen, renames),
                else_: with_unique_names(else_, seen, renames),
            },
            s => s,
        });
        i += 1;
    }
    out
}

/// `stmts` with integer arithmetic and comparisons of literals folded and
/// every `if` on a literal condition replaced by its branch: a copy of a
/// triangular loop nest (`for i in 0..j + 1`, `if i == j`, Gram–Schmidt's
/// projections, docs/math.md §6.5) then has literal bounds and no branch.
fn with_literals_folded(stmts: Vec<Stmt>) -> Vec<Stmt> {
    let fold = |e: &Expr| -> Option<Expr> {
        let folded = e.rewrite(&|x| match x {
            Expr::Binary { op: BinOp::Add | BinOp::Sub | BinOp::Mul, .. } if x.ty() == Ty::I64 => {
                literal_value(x).map(Expr::I64)
            }
            Expr::Cmp { op, lhs, rhs } => {
                Some(Expr::Bool(op.holds(literal_value(lhs)?, literal_value(rhs)?)))
            }
            _ => None,
        });
        (folded != *e).then_some(folded)
    };
    let folded = rewrite_stmts(&stmts, &fold);
    let mut out = Vec::with_capacity(folded.len());
    for s in folded {
        match s {
            Stmt::If { cond: Expr::Bool(true), then, .. } => out.extend(with_literals_folded(then)),
            Stmt::If { cond: Expr::Bool(false), else_, .. } => out.extend(with_literals_folded(else_)),
            Stmt::For { var, start, end, step, unroll, body } => {
                out.push(Stmt::For { var, start, end, step, unroll, body: with_literals_folded(body) })
            }
            Stmt::If { cond, then, else_ } => out.push(Stmt::If {
                cond,
                then: with_literals_folded(then),
                else_: with_literals_folded(else_),
            }),
            s => out.push(s),
        }
    }
    out
}

/// For a top-level loop of at least `lanes` literal trips whose iterations
/// the lanes may share, the scalars it sums into (name, type); else `None`.
///
/// The iterations are independent when the body (at any depth)
/// - assigns a scalar declared outside only as `r = r + e`, with `r` read
///   nowhere else in the body (a sum, reassociated into lane partials);
/// - stores to no local array declared outside (each lane has its own),
///   except a lane-owned one ([`lane_owned_arrays`]) at its lane's element;
/// - stores to a buffer at an index affine in the loop variable with a
///   non-zero coefficient (each iteration its own elements), an accumulating
///   store at one that depends on nothing else the body declares;
/// - reads a buffer it stores to only at an index it stores to (the element
///   the same iteration wrote).
fn splittable(s: &Stmt, lanes: i64, owned: &Owned) -> Option<Vec<(String, Ty)>> {
    let Stmt::For { var: v, body, step, .. } = s else { return None };
    if trips(s)? < lanes || *step < 1 {
        return None;
    }
    let mut inner = HashSet::new();
    collect_declared(body, &mut inner);
    let mut lets = owned.lets.clone();
    lets.extend(let_definitions(body));
    let inline = |e: &Expr| inlined(e, &lets, 0);
    let mut sums: Vec<(String, Ty)> = Vec::new();
    let mut stores: HashMap<String, Vec<Expr>> = HashMap::new();
    let mut ok = true;
    walk(body, &mut |st| match st {
        Stmt::Assign { var: r, value } if !inner.contains(r) => match value {
            Expr::Binary { op: BinOp::Add, lhs, rhs }
                if matches!(&**lhs, Expr::Var { name, .. } if name == r)
                    && lhs.ty().is_float()
                    && !mentions(rhs, r) =>
            {
                sums.push((r.clone(), lhs.ty()));
            }
            _ => ok = false,
        },
        Stmt::Store { target: Buf::Local { name, .. }, index, .. }
        | Stmt::AccumStore { target: Buf::Local { name, .. }, index, .. } => {
            ok &= inner.contains(name) || (owned.arrays.contains(name) && is_lane_element(&inline(index), v));
        }
        Stmt::Store { target, index, .. } | Stmt::AccumStore { target, index, .. } => {
            let index = inline(index);
            let accumulates = matches!(st, Stmt::AccumStore { .. });
            let mut refs = HashSet::new();
            super::expr_refs(&index, &mut refs);
            let own_elements = affine_coefficient(&index, v).is_some_and(|c| c != 0)
                && (!accumulates || refs.iter().all(|r| r == v || !inner.contains(r)));
            ok &= own_elements;
            stores.entry(target.name().to_string()).or_default().push(index);
        }
        _ => {}
    });
    if !ok {
        return None;
    }
    // A summed scalar read anywhere but its own update would see a partial.
    for (r, _) in &sums {
        let mut reads = 0;
        each_expr(body, &mut |e| {
            e.visit(&mut |x| reads += usize::from(matches!(x, Expr::Var { name, .. } if name == r)))
        });
        if reads != sums.iter().filter(|(q, _)| q == r).count() {
            return None;
        }
    }
    let mut own_reads = true;
    each_expr(body, &mut |e| {
        e.visit(&mut |x| {
            if let Expr::Load { src: Buf::Param { name, .. }, index } = x {
                if let Some(indices) = stores.get(name) {
                    own_reads &= indices.contains(&inline(index));
                }
            }
        })
    });
    own_reads.then_some(sums.into_iter().fold(Vec::new(), |mut acc, (r, ty)| {
        if !acc.iter().any(|(q, _)| *q == r) {
            acc.push((r, ty));
        }
        acc
    }))
}

/// The top-level local arrays every lane may keep only its own elements of:
/// each access, at any depth, is inside a top-level loop of at least `lanes`
/// trips, at that loop's variable (plus a multiple of `lanes`), and each such
/// loop splits. Such an array
/// holds a row the item builds in several loops (VWN's row-form products
/// accumulate `[m, 4] × [4, C/m]` into one, docs/math.md §5.3); lane `l` then
/// builds and reads elements `l, l + LANES, …` only.
fn lane_owned_arrays(body: &[Stmt], lanes: i64) -> Owned {
    let lets = let_definitions(body);
    let mut arrays: HashSet<String> = body
        .iter()
        .filter_map(|s| match s {
            Stmt::LocalArray { var, .. } => Some(var.clone()),
            _ => None,
        })
        .collect();
    arrays.retain(|a| body.iter().all(|s| accesses_only_at_loop_variable(s, a, lanes, &lets)));
    let mut owned = Owned { arrays, lets };
    // Drop an array a non-splitting loop touches, until none does.
    loop {
        let touched_by_serial: HashSet<String> = body
            .iter()
            .filter(|s| matches!(s, Stmt::For { .. }) && splittable(s, lanes, &owned).is_none())
            .flat_map(|s| owned.arrays.iter().filter(|a| touches(s, a)).cloned().collect::<Vec<_>>())
            .collect();
        if touched_by_serial.is_empty() {
            return owned;
        }
        owned.arrays.retain(|a| !touched_by_serial.contains(a));
    }
}

/// `body` with each lane-owned array (see [`lane_owned_arrays`]) holding only
/// its lane's elements: element `e` at `e / LANES`, the array `LANES` times
/// shorter. The lanes of a warp then access the same slot of their local
/// memory at once, which the GPU interleaves across lanes into consecutive
/// words; with whole rows, lane `l` accessed element `l + LANES·k` of its
/// own row, 32 scattered lines per access (xHC's temporal augmentation then
/// ran slower than with one thread per token).
fn compacted(body: Vec<Stmt>, owned: &HashSet<String>) -> Vec<Stmt> {
    if owned.is_empty() {
        return body;
    }
    let lanes = i64::from(LANES);
    let slot = |index: &Expr| index.clone() / Expr::I64(lanes);
    let rewrite = |e: &Expr| -> Option<Expr> {
        match e {
            Expr::Load { src: src @ Buf::Local { name, .. }, index } if owned.contains(name) => {
                Some(Expr::Load { src: src.clone(), index: Box::new(slot(index)) })
            }
            _ => None,
        }
    };
    fn stores(stmts: Vec<Stmt>, owned: &HashSet<String>, slot: &dyn Fn(&Expr) -> Expr) -> Vec<Stmt> {
        stmts
            .into_iter()
            .map(|s| match s {
                Stmt::LocalArray { var, ty, len } if owned.contains(&var) => {
                    Stmt::LocalArray { var, ty, len: len.div_ceil(LANES as usize) }
                }
                Stmt::Store { target: target @ Buf::Local { .. }, index, value }
                    if owned.contains(target.name()) =>
                {
                    Stmt::Store { index: slot(&index), target, value }
                }
                Stmt::AccumStore { target: target @ Buf::Local { .. }, index, value }
                    if owned.contains(target.name()) =>
                {
                    Stmt::AccumStore { index: slot(&index), target, value }
                }
                Stmt::For { var, start, end, step, unroll, body } => {
                    Stmt::For { var, start, end, step, unroll, body: stores(body, owned, slot) }
                }
                Stmt::If { cond, then, else_ } => {
                    Stmt::If { cond, then: stores(then, owned, slot), else_: stores(else_, owned, slot) }
                }
                s => s,
            })
            .collect()
    }
    stores(rewrite_stmts(&body, &rewrite), owned, &slot)
}

/// The lane-owned local arrays of a kernel body, and the definitions of all
/// its immutable scalars (an element's offset is often a scalar computed
/// before the loop, such as a row's start).
struct Owned {
    arrays: HashSet<String>,
    lets: HashMap<String, Expr>,
}

/// Whether `s` accesses the local array `a` only at elements of its own lane
/// ([`is_lane_element`]) of the variable `v` of `s` itself, a top-level loop
/// from 0 by 1 of at least `lanes` trips (or not at all).
fn accesses_only_at_loop_variable(s: &Stmt, a: &str, lanes: i64, lets: &HashMap<String, Expr>) -> bool {
    if !touches(s, a) {
        return true;
    }
    // From 0 by 1, so that element `e` is lane `e mod LANES`'s in every such loop.
    let Stmt::For { var: v, body, start, step: 1, .. } = s else { return false };
    if start.int_literal() != Some(0) || trips(s).is_none_or(|t| t < lanes) {
        return false;
    }
    let at_own = |index: &Expr| is_lane_element(&inlined(index, lets, 0), v);
    let mut ok = true;
    walk(body, &mut |st| {
        if let Stmt::Store { target: Buf::Local { name, .. }, index, .. }
        | Stmt::AccumStore { target: Buf::Local { name, .. }, index, .. } = st
        {
            ok &= name != a || at_own(index);
        }
    });
    each_expr(body, &mut |e| {
        e.visit(&mut |x| {
            if let Expr::Load { src: Buf::Local { name, .. }, index } = x {
                ok &= name != a || at_own(index);
            }
        })
    });
    ok
}

/// Whether `s` loads from or stores to the local array `a`, at any depth.
fn touches(s: &Stmt, a: &str) -> bool {
    let body = std::slice::from_ref(s);
    let mut found = false;
    walk(body, &mut |st| {
        found |= matches!(st, Stmt::Store { target: Buf::Local { name, .. }, .. }
            | Stmt::AccumStore { target: Buf::Local { name, .. }, .. } if name == a);
    });
    each_expr(body, &mut |e| {
        e.visit(&mut |x| found |= matches!(x, Expr::Load { src: Buf::Local { name, .. }, .. } if name == a))
    });
    found
}

/// Whether `index` is `v + k` for a literal `k` that is a multiple of
/// [`LANES`]: element `index` then belongs to the lane of iteration `v` in
/// every loop from 0 by 1 (several rows of one array, each a multiple of
/// `LANES` long, as xHC's temporal features `[r, C]`, docs/math.md §6.5).
fn is_lane_element(index: &Expr, v: &str) -> bool {
    let offset = index.rewrite(&|x| match x {
        Expr::Var { name, .. } if name == v => Some(Expr::I64(0)),
        _ => None,
    });
    affine_coefficient(index, v) == Some(1)
        && literal_value(&offset).is_some_and(|k| k % i64::from(LANES) == 0)
}

/// The value of an integer expression of literals, sums and products.
fn literal_value(e: &Expr) -> Option<i64> {
    match e {
        Expr::Cast { arg, .. } => literal_value(arg),
        Expr::Binary { op: BinOp::Add, lhs, rhs } => literal_value(lhs)?.checked_add(literal_value(rhs)?),
        Expr::Binary { op: BinOp::Sub, lhs, rhs } => literal_value(lhs)?.checked_sub(literal_value(rhs)?),
        Expr::Binary { op: BinOp::Mul, lhs, rhs } => literal_value(lhs)?.checked_mul(literal_value(rhs)?),
        e => e.int_literal(),
    }
}

/// Every statement of `stmts` at any depth, in order.
fn walk(stmts: &[Stmt], f: &mut impl FnMut(&Stmt)) {
    for s in stmts {
        f(s);
        match s {
            Stmt::For { body, .. } => walk(body, f),
            Stmt::If { then, else_, .. } => {
                walk(then, f);
                walk(else_, f);
            }
            _ => {}
        }
    }
}

/// The definitions of the immutable scalars `stmts` declare, at any depth.
fn let_definitions(stmts: &[Stmt]) -> HashMap<String, Expr> {
    let mut lets = HashMap::new();
    walk(stmts, &mut |s| {
        if let Stmt::Let { var, expr, .. } = s {
            lets.insert(var.clone(), expr.clone());
        }
    });
    lets
}

/// `e` with the scalars of `lets` replaced by their definitions (a few levels deep).
fn inlined(e: &Expr, lets: &HashMap<String, Expr>, depth: usize) -> Expr {
    if depth > 8 {
        return e.clone();
    }
    e.rewrite(&|x| match x {
        Expr::Var { name, .. } => lets.get(name).map(|d| inlined(d, lets, depth + 1)),
        _ => None,
    })
}

/// Whether `e` mentions the variable `name`.
fn mentions(e: &Expr, name: &str) -> bool {
    let mut found = false;
    e.visit(&mut |x| found |= matches!(x, Expr::Var { name: n, .. } if n == name));
    found
}

/// The coefficient of `v` in `e` when `e` is affine in `v` (integer sums and
/// products by literals), 0 when `e` does not mention `v`, `None` otherwise.
fn affine_coefficient(e: &Expr, v: &str) -> Option<i64> {
    if !mentions(e, v) {
        return Some(0);
    }
    match e {
        Expr::Var { .. } => Some(1),
        Expr::Cast { arg, .. } => affine_coefficient(arg, v),
        Expr::Binary { op: BinOp::Add, lhs, rhs } => {
            Some(affine_coefficient(lhs, v)?.checked_add(affine_coefficient(rhs, v)?)?)
        }
        Expr::Binary { op: BinOp::Sub, lhs, rhs } => {
            Some(affine_coefficient(lhs, v)?.checked_sub(affine_coefficient(rhs, v)?)?)
        }
        Expr::Binary { op: BinOp::Mul, lhs, rhs } => match (lhs.int_literal(), rhs.int_literal()) {
            (Some(c), _) => affine_coefficient(rhs, v)?.checked_mul(c),
            (_, Some(c)) => affine_coefficient(lhs, v)?.checked_mul(c),
            _ => None,
        },
        _ => None,
    }
}

/// `body` with every sum into a scalar of `partials` (`r = r + e`) made into
/// its lane's partial (`p = p + e`).
fn with_partials(body: Vec<Stmt>, partials: &[(String, String, Ty)]) -> Vec<Stmt> {
    body.into_iter()
        .map(|s| match s {
            Stmt::Assign { var: r, value: Expr::Binary { op: BinOp::Add, rhs, .. } }
                if partials.iter().any(|(q, ..)| *q == r) =>
            {
                let (_, p, ty) = partials.iter().find(|(q, ..)| *q == r).expect("found above");
                Stmt::Assign { var: p.clone(), value: scalar(p, *ty) + *rhs }
            }
            Stmt::For { var, start, end, step, unroll, body } => {
                Stmt::For { var, start, end, step, unroll, body: with_partials(body, partials) }
            }
            Stmt::If { cond, then, else_ } => {
                Stmt::If { cond, then: with_partials(then, partials), else_: with_partials(else_, partials) }
            }
            s => s,
        })
        .collect()
}

/// Whether every lane may run `s` alike: it reads no buffer it accumulates
/// into (lane 0 makes those stores, which the others would not see), and its
/// plain stores are read back only where they were written (every lane
/// writes the same value; a read of another element could see a faster
/// lane's later store).
fn repeatable(s: &Stmt) -> bool {
    let body = std::slice::from_ref(s);
    let lets = let_definitions(body);
    let mut stores: HashMap<String, Vec<Expr>> = HashMap::new();
    let mut accumulated = HashSet::new();
    walk(body, &mut |st| match st {
        Stmt::Store { target: Buf::Param { name, .. }, index, .. } => {
            stores.entry(name.clone()).or_default().push(inlined(index, &lets, 0));
        }
        Stmt::AccumStore { target: Buf::Param { name, .. }, .. } => {
            accumulated.insert(name.clone());
        }
        _ => {}
    });
    let mut ok = true;
    each_expr(body, &mut |e| {
        e.visit(&mut |x| {
            if let Expr::Load { src: Buf::Param { name, .. }, index } = x {
                ok &= !accumulated.contains(name)
                    && stores.get(name).is_none_or(|ix| ix.contains(&inlined(index, &lets, 0)));
            }
        })
    });
    ok
}

/// `s` with its accumulating stores to buffers made by lane 0 only.
fn accumulated_by_lane_zero(s: Stmt) -> Stmt {
    match s {
        Stmt::AccumStore { target: target @ Buf::Param { .. }, index, value } => Stmt::If {
            cond: Expr::Lane.eq_(Expr::I64(0)),
            then: vec![Stmt::AccumStore { target, index, value }],
            else_: vec![],
        },
        Stmt::For { var, start, end, step, unroll, body } => Stmt::For {
            var,
            start,
            end,
            step,
            unroll,
            body: body.into_iter().map(accumulated_by_lane_zero).collect(),
        },
        Stmt::If { cond, then, else_ } => Stmt::If {
            cond,
            then: then.into_iter().map(accumulated_by_lane_zero).collect(),
            else_: else_.into_iter().map(accumulated_by_lane_zero).collect(),
        },
        s => s,
    }
}

/// The buffers read and written since the last barrier or block reduction.
#[derive(Default)]
struct Hazards {
    read: HashSet<String>,
    written: HashSet<String>,
}

impl Hazards {
    /// Pushes a barrier onto `out` when `s` reads a buffer written since the
    /// last one, or writes one accessed since; then records `s`'s accesses.
    fn before(&mut self, s: &Stmt, out: &mut Vec<Stmt>) {
        let (reads, writes) = buffer_accesses(s);
        if !reads.is_disjoint(&self.written)
            || writes.iter().any(|w| self.written.contains(w) || self.read.contains(w))
        {
            out.push(Stmt::Barrier);
            self.clear();
        }
        self.read.extend(reads);
        self.written.extend(writes);
    }

    fn clear(&mut self) {
        self.read.clear();
        self.written.clear();
    }
}

/// The parameter buffers `s` loads from and stores to, at any depth.
fn buffer_accesses(s: &Stmt) -> (HashSet<String>, HashSet<String>) {
    let body = std::slice::from_ref(s);
    let (mut reads, mut writes) = (HashSet::new(), HashSet::new());
    each_expr(body, &mut |e| {
        e.visit(&mut |x| {
            if let Expr::Load { src: Buf::Param { name, .. }, .. } = x {
                reads.insert(name.clone());
            }
        })
    });
    walk(body, &mut |st| {
        if let Stmt::Store { target: Buf::Param { name, .. }, .. }
        | Stmt::AccumStore { target: Buf::Param { name, .. }, .. } = st
        {
            writes.insert(name.clone());
        }
    });
    (reads, writes)
}
