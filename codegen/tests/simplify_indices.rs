//! Index simplification (`codegen::kernel::simplify_indices`): the rewritten
//! index expressions agree exactly with the originals under C semantics at
//! random points and at the corners of the variables' ranges, the index
//! chains of fused view kernels collapse to their short forms, and whole
//! models render with far fewer integer divisions and remainders.

mod common;

use std::collections::HashMap;

use codegen::compile::{compile, fused_partition};
use codegen::kernel::{
    f32, i64, item, lane, select, simplify_indices, Access, BinOp, Expr, Grid, Kernel, KernelBuilder, Stmt,
    UnOp,
};
use codegen::render::render_c;
use ir::DType;

/// SplitMix64: a small deterministic generator so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi]`.
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }

    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.next() as usize % xs.len()].clone()
    }
}

/// C semantics of an integer (or boolean, as 0/1) expression; `None` when
/// the original program would be undefined (overflow, division by zero).
fn eval(e: &Expr, env: &HashMap<String, i64>, it: i64, ln: i64) -> Option<i64> {
    let ev = |x: &Expr| eval(x, env, it, ln);
    match e {
        Expr::I64(v) => Some(*v),
        Expr::I32(v) => Some(i64::from(*v)),
        Expr::Bool(b) => Some(i64::from(*b)),
        Expr::Item => Some(it),
        Expr::Lane => Some(ln),
        Expr::Var { name, .. } => env.get(name).copied(),
        Expr::Unary { op: UnOp::Neg, arg } => ev(arg)?.checked_neg(),
        Expr::Unary { op: UnOp::Not, arg } => Some(i64::from(ev(arg)? == 0)),
        Expr::Binary { op, lhs, rhs } => {
            let (a, b) = (ev(lhs)?, ev(rhs)?);
            match op {
                BinOp::Add => a.checked_add(b),
                BinOp::Sub => a.checked_sub(b),
                BinOp::Mul => a.checked_mul(b),
                BinOp::Div => a.checked_div(b),
                BinOp::Rem => a.checked_rem(b),
                BinOp::And => Some(i64::from(a != 0 && b != 0)),
                BinOp::Or => Some(i64::from(a != 0 || b != 0)),
            }
        }
        Expr::Cmp { op, lhs, rhs } => Some(i64::from(op.holds(ev(lhs)?, ev(rhs)?))),
        Expr::Select { cond, then, else_ } => {
            if ev(cond)? != 0 {
                ev(then)
            } else {
                ev(else_)
            }
        }
        other => panic!("not an integer expression: {other:?}"),
    }
}

/// What a body computes at one point: every store index and branch taken,
/// in order. `None` if anything on the way is undefined.
fn trace(stmts: &[Stmt], env: &mut HashMap<String, i64>, it: i64, ln: i64, out: &mut Vec<i64>) -> Option<()> {
    for s in stmts {
        match s {
            Stmt::Let { var, expr, .. } => {
                let v = eval(expr, env, it, ln)?;
                env.insert(var.clone(), v);
            }
            Stmt::For { body, .. } => trace(body, env, it, ln, out)?,
            Stmt::Store { index, value, .. } => {
                out.push(eval(index, env, it, ln)?);
                out.push(flag(value, env, it, ln)?);
            }
            Stmt::If { cond, then, else_ } => {
                let c = eval(cond, env, it, ln)?;
                out.push(c);
                trace(if c != 0 { then } else { else_ }, env, it, ln, out)?;
            }
            other => panic!("unexpected statement {other:?}"),
        }
    }
    Some(())
}

/// The value of a store's `cond ? 1.0 : 0.0` flag (a literal once the
/// condition is decided).
fn flag(v: &Expr, env: &HashMap<String, i64>, it: i64, ln: i64) -> Option<i64> {
    match v {
        Expr::F32(x) => Some(*x as i64),
        Expr::Select { cond, then, else_ } => {
            flag(if eval(cond, env, it, ln)? != 0 { then } else { else_ }, env, it, ln)
        }
        other => panic!("unexpected store value {other:?}"),
    }
}

const DIVISORS: [i64; 16] = [1, 2, 3, 4, 5, 7, 8, 12, 16, 20, 24, 64, 100, 256, -3, -16];

/// A random index expression over `vars`, shaped like view chains
/// (`x / a % b * s` digits, sums, offsets) with some arbitrary arithmetic.
fn rand_expr(r: &mut Rng, vars: &[Expr], depth: u32) -> Expr {
    if depth == 0 || r.next().is_multiple_of(5) {
        return if r.next().is_multiple_of(4) { i64(r.range(-20, 300)) } else { r.pick(vars) };
    }
    let sub = |r: &mut Rng| rand_expr(r, vars, depth - 1);
    match r.next() % 11 {
        0 | 1 => sub(r) + sub(r),
        2 => sub(r) - sub(r),
        3 => sub(r) * i64(r.range(-3, 300)),
        4 => sub(r) / i64(r.pick(&DIVISORS)),
        5 => sub(r) % i64(r.pick(&DIVISORS)),
        6 => sub(r) / i64(r.pick(&DIVISORS)) % i64(r.pick(&DIVISORS)) * i64(r.range(1, 64)),
        7 => {
            let x = sub(r);
            let s = r.pick(&[4i64, 16, 24, 64]);
            x.clone() % s * i64(r.range(1, 32)) + x / s % s + sub(r) * s
        }
        8 => {
            let (a, b) = (sub(r), sub(r));
            select(sub(r).lt(i64(r.range(-10, 200))), a, b)
        }
        9 => sub(r) * sub(r),
        _ => -sub(r),
    }
}

/// A kernel whose loops give random variables random ranges, with `Let`s
/// built from them, storing at random indices and branching on random
/// comparisons; also the ranges for sampling points.
fn rand_kernel(r: &mut Rng, case: usize) -> (Kernel, Vec<(String, i64, i64)>, i64, i64) {
    let items = r.range(1, 3000);
    let threads = 32;
    let mut k = KernelBuilder::new(&format!("p{case}"), Grid::block_per_item(items as usize, threads));
    let out = k.param("out", DType::F32, Access::Write, 1);
    let mut loops = Vec::new();
    for i in 0..r.range(1, 3) {
        let lo = if r.next().is_multiple_of(4) { r.range(-50, 10) } else { 0 };
        let hi = lo + r.range(0, 400);
        loops.push((format!("v{i}"), lo, hi));
    }
    let mut vars: Vec<Expr> = vec![item(), lane()];
    build_body(r, &mut k, &loops, &mut vars, &out);
    (k.finish(), loops, items, i64::from(threads))
}

fn build_body(
    r: &mut Rng,
    b: &mut codegen::kernel::Block,
    loops: &[(String, i64, i64)],
    vars: &mut Vec<Expr>,
    out: &codegen::kernel::Buf,
) {
    if let Some(((name, lo, hi), rest)) = loops.split_first() {
        b.for_(name, i64(*lo), i64(hi + 1), |b, v| {
            vars.push(v);
            build_body(r, b, rest, vars, out);
        });
        return;
    }
    for i in 0..r.range(0, 3) {
        let name = format!("t{}_{i}", vars.len());
        let e = rand_expr(r, vars, 3);
        vars.push(b.let_(&name, e));
    }
    for _ in 0..3 {
        let e = rand_expr(r, vars, 4);
        let c = rand_expr(r, vars, 2).ge(rand_expr(r, vars, 2));
        b.store(out, e, select(c, f32(1.0), f32(0.0)));
    }
    let c = rand_expr(r, vars, 3).lt(rand_expr(r, vars, 1));
    let (t, f) = (rand_expr(r, vars, 3), rand_expr(r, vars, 3));
    b.if_else(c, |b| b.store(out, t, f32(0.0)), |b| b.store(out, f, f32(0.0)));
}

fn points(
    r: &mut Rng,
    loops: &[(String, i64, i64)],
    items: i64,
    threads: i64,
) -> Vec<(HashMap<String, i64>, i64, i64)> {
    let mut out = Vec::new();
    for p in 0..40 {
        let corner = p < 8;
        let pick = |r: &mut Rng, lo: i64, hi: i64| {
            if corner {
                if r.next().is_multiple_of(2) {
                    lo
                } else {
                    hi
                }
            } else {
                r.range(lo, hi)
            }
        };
        let env = loops.iter().map(|(n, lo, hi)| (n.clone(), pick(r, *lo, *hi))).collect();
        out.push((env, pick(r, 0, items - 1), pick(r, 0, threads - 1)));
    }
    out
}

fn total_cost(stmts: &[Stmt]) -> usize {
    stmts
        .iter()
        .map(|s| match s {
            Stmt::Let { expr, .. } => format!("{expr:?}").matches("Binary").count(),
            Stmt::Store { index, .. } => format!("{index:?}").matches("Binary").count(),
            Stmt::For { body, .. } => total_cost(body),
            Stmt::If { cond, then, else_ } => {
                format!("{cond:?}").matches("Binary").count() + total_cost(then) + total_cost(else_)
            }
            _ => 0,
        })
        .sum()
}

#[test]
fn random_index_expressions_keep_their_values() {
    let mut r = Rng(0x5eed);
    let (mut checked, mut smaller) = (0, 0);
    for case in 0..400 {
        let (original, loops, items, threads) = rand_kernel(&mut r, case);
        let simplified = simplify_indices(original.clone());
        assert!(simplified.validate().is_ok(), "case {case}: {:?}", simplified.validate());
        if total_cost(&simplified.body) < total_cost(&original.body) {
            smaller += 1;
        }
        for (env, it, ln) in points(&mut r, &loops, items, threads) {
            let mut want = Vec::new();
            if trace(&original.body, &mut env.clone(), it, ln, &mut want).is_none() {
                continue; // undefined in C: nothing to preserve
            }
            let mut got = Vec::new();
            let ok = trace(&simplified.body, &mut env.clone(), it, ln, &mut got);
            assert!(
                ok.is_some() && got == want,
                "case {case} at item {it} lane {ln} {env:?}: {want:?} vs {got:?}\noriginal {:#?}\nsimplified {:#?}",
                original.body,
                simplified.body
            );
            checked += 1;
        }
    }
    assert!(checked > 6000, "only {checked} points were defined");
    assert!(smaller > 200, "only {smaller} of 400 kernels got cheaper");
}

/// The index of the first store of a kernel whose body is `for l in [0, 256) { lets; store }`
/// over 2048 items, after simplification.
fn simplified_index(build: impl FnOnce(&mut codegen::kernel::Block, Expr) -> Expr) -> Expr {
    let mut k = KernelBuilder::new("views", Grid::thread_per_item(2048));
    let out = k.param("out", DType::F32, Access::Write, 1 << 20);
    k.for_("l", i64(0), i64(256), |b, l| {
        let index = build(b, l);
        b.store(&out, index, f32(0.0));
    });
    let kernel = simplify_indices(k.finish());
    let Stmt::For { body, .. } = &kernel.body[0] else { panic!("{:?}", kernel.body) };
    match body.last() {
        Some(Stmt::Store { index, .. }) => index.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn view_chains_collapse_to_short_forms() {
    let l = Expr::Var { name: "l".into(), ty: codegen::kernel::Ty::I64 };
    assert_eq!(simplified_index(|_, l| (item() * 256 + l) % 16), l.clone() % 16i64);
    assert_eq!(simplified_index(|_, l| (item() * 256 + l) / 256 % 64), item() % 64i64);
    assert_eq!(simplified_index(|_, l| (item() * 256 + l) / 16 % 16), l.clone() / 16i64);
    assert_eq!(simplified_index(|_, l| (item() * 256 + l) / 256), item());
    assert_eq!(
        simplified_index(|_, l| (l.clone() * i64(1) + i64(0)) * 4 / i64(1) + item() * i64(0) + l % i64(1)),
        l.clone() * 4i64
    );
    assert_eq!(simplified_index(|_, l| l / 4 / 8 % 1024), l.clone() / 32i64);
    // A `Let` of the flat index: expanded where that is cheaper, kept otherwise.
    assert_eq!(
        simplified_index(|b, l| {
            let g = b.let_("g", item() * 256 + l);
            g.clone() - item() * 256 + g % 16
        }),
        l.clone() + l.clone() % 16i64
    );
    let g = Expr::Var { name: "g".into(), ty: codegen::kernel::Ty::I64 };
    assert_eq!(
        simplified_index(|b, l| {
            let g = b.let_("g", item() * 384 + l);
            g + 7i64
        }),
        g + 7i64
    );
    // The transposed-view gather of a fused matmul prologue (a D = 256 dump):
    // four digits of a flat index, re-split by a second view.
    let index = simplified_index(|b, l| {
        let g = b.let_("g", item() * 256 + l);
        let x = g.clone() % 16 * 16 + g.clone() / 16 % 16 + g.clone() / 256 % 64 * 256 + g / 16384 * 16384;
        i64(4) + x.clone() % 16 + x.clone() / 16 % 16 * 24 + x.clone() / 256 % 64 * 384 + x / 16384 * 24576
    });
    assert_eq!(index, l.clone() / 16i64 + l.clone() % 16i64 * 24i64 + item() * 384i64 + 4i64);
    // Comparisons on simplified operands; decided ones fold, and so do the selects.
    let index =
        simplified_index(|_, l| select(((item() * 24 + l.clone()) % 24i64).lt(20i64), l.clone(), i64(0)));
    assert_eq!(index, select((l.clone() % 24i64).lt(20i64), l.clone(), i64(0)));
    let index = simplified_index(|_, l| select(l.clone().lt(256i64), l.clone() % 256, i64(7)));
    assert_eq!(index, l);
}

#[test]
fn offsets_below_a_range_start_are_shared_out_by_range() {
    // `i - 4` with `i ∈ [4, 20)` is in `[0, 16)`: its remainder by 16 is
    // itself and its quotient 0, though the constant's own residue is 12.
    let mut k = KernelBuilder::new("shifted", Grid::thread_per_item(2048));
    let out = k.param("out", DType::F32, Access::Write, 1 << 20);
    k.for_("i", i64(4), i64(20), |b, i| {
        let x = item() * 16 + i - 4;
        b.store(&out, x.clone() % 16 * 2048 + x / 16, f32(0.0));
    });
    let kernel = simplify_indices(k.finish());
    let Stmt::For { body, .. } = &kernel.body[0] else { panic!("{:?}", kernel.body) };
    let Some(Stmt::Store { index, .. }) = body.last() else { panic!("{body:?}") };
    let i = Expr::Var { name: "i".into(), ty: codegen::kernel::Ty::I64 };
    assert_eq!(*index, i * 2048i64 + item() - 8192i64);
}

/// Integer divisions and remainders by literals in rendered C: (all,
/// by a non-power of two). Float divisions have float literals.
fn div_rem_counts(c: &str) -> (usize, usize) {
    let (mut all, mut odd) = (0, 0);
    for op in [" / ", " % "] {
        for (i, _) in c.match_indices(op) {
            let rest = &c[i + 3..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let next = rest[digits.len()..].chars().next();
            let Ok(v) = digits.parse::<u64>() else { continue };
            if matches!(next, Some('.' | 'e' | 'f')) {
                continue;
            }
            all += 1;
            if !v.is_power_of_two() {
                odd += 1;
            }
        }
    }
    (all, odd)
}

/// The rendered C of a spec at D = 256, four layers, four heads, 256 tokens.
fn model_c(name: &str) -> String {
    let (graph, request, _) = common::emit::spec_training_graph(name, 8, 256, |spec| {
        (spec.d_model, spec.layers, spec.heads) = (256, 4, 4);
    });
    let partition = fused_partition(&graph, &request).unwrap_or_else(|e| panic!("{name}: {e}"));
    let plan = compile(&graph, &partition, &request).unwrap_or_else(|e| panic!("{name}: {e}"));
    render_c(&plan.kernels).expect("renders")
}

#[test]
fn whole_models_render_far_fewer_divisions() {
    // Counts of the same C rendered without the pass (measured when the pass
    // was introduced): (all integer div/rem, by a non-power of two).
    for (name, before) in [("vwn-r4", (2681, 232)), ("xhc", (3419, 84))] {
        let (all, odd) = div_rem_counts(&model_c(name));
        eprintln!("{name}: {all} integer div/rem ({odd} by a non-power of two), before {before:?}");
        assert!(all * 3 < before.0, "{name}: {all} integer div/rem, {} before", before.0);
        assert!(odd * 8 < before.1 * 7, "{name}: {odd} by non-powers of two, {} before", before.1);
    }
}
