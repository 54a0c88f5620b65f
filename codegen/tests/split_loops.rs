//! The item-level loop splitting pass: strip-mining a segmented row loop by
//! its segment width, cutting a concatenation loop at its column thresholds,
//! leaving loops alone when neither helps, and computing bit for bit what the
//! unsplit kernel does (both compiled by the system C compiler).

use std::ffi::c_void;

use codegen::cc::Compiler;
use codegen::kernel::{
    f32, i64, item, select, simplify_indices, split_loops, Access, BinOp, Expr, Grid, Kernel, KernelBuilder,
    Stmt, Ty,
};
use ir::DType;

const ROWS: usize = 5;
/// A row of 16 segments of 24 (not a power of two, as DGHC's `2m + n`).
const SEG: usize = 24;
const ROW: usize = 16 * SEG;

fn prepared(k: Kernel) -> Kernel {
    split_loops(simplify_indices(k))
}

/// Counts of (loops, integer divisions and remainders, selects) in `stmts`.
fn shape(stmts: &[Stmt]) -> (usize, usize, usize) {
    let mut counts = (0, 0, 0);
    walk(stmts, &mut counts);
    counts
}

fn walk(stmts: &[Stmt], c: &mut (usize, usize, usize)) {
    for s in stmts {
        match s {
            Stmt::Let { expr, .. } | Stmt::Var { init: expr, .. } | Stmt::Assign { value: expr, .. } => {
                count(expr, c)
            }
            Stmt::Store { index, value, .. } | Stmt::AccumStore { index, value, .. } => {
                count(index, c);
                count(value, c);
            }
            Stmt::For { body, .. } => {
                c.0 += 1;
                walk(body, c);
            }
            Stmt::If { cond, then, else_ } => {
                count(cond, c);
                walk(then, c);
                walk(else_, c);
            }
            _ => {}
        }
    }
}

fn count(e: &Expr, c: &mut (usize, usize, usize)) {
    match e {
        Expr::Binary { op, lhs, rhs } => {
            if matches!(op, BinOp::Div | BinOp::Rem) && lhs.ty().is_int() {
                c.1 += 1;
            }
            count(lhs, c);
            count(rhs, c);
        }
        Expr::Select { cond, then, else_ } => {
            c.2 += 1;
            count(cond, c);
            count(then, c);
            count(else_, c);
        }
        Expr::Load { index: arg, .. } | Expr::Unary { arg, .. } | Expr::Cast { arg, .. } => count(arg, c),
        Expr::Cmp { lhs, rhs, .. } => {
            count(lhs, c);
            count(rhs, c);
        }
        Expr::Call { args, .. } => args.iter().for_each(|a| count(a, c)),
        _ => {}
    }
}

/// A segmented row: `y = x · g[segment] + w[offset]` over one flat loop, the
/// item emitter's shape for a per-segment norm's scale and a shared gain.
fn segmented() -> Kernel {
    let mut k = KernelBuilder::new("segmented", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * ROW);
    let g = k.param("g", DType::F32, Access::Read, ROWS * 16);
    let w = k.param("w", DType::F32, Access::Read, SEG);
    let y = k.param("y", DType::F32, Access::Write, ROWS * ROW);
    k.for_("l", i64(0), i64(ROW as i64), |b, l| {
        let at = b.let_("at", item() * i64(ROW as i64) + l.clone());
        let v = x.at(at.clone()) * g.at(item() * i64(16) + l.clone() / i64(SEG as i64));
        b.store(&y, at, v + w.at(l % i64(SEG as i64)));
    });
    k.finish()
}

/// A concatenation `y = [a | b | c]` per segment of 24 columns (4 + 16 + 4),
/// written as one loop with column selects, as the DGHC coefficient packing.
fn concatenation() -> Kernel {
    let mut k = KernelBuilder::new("concat", Grid::thread_per_item(ROWS));
    let a = k.param("a", DType::F32, Access::Read, ROWS * 16 * 4);
    let b_ = k.param("b", DType::F32, Access::Read, ROWS * 16 * 16);
    let c = k.param("c", DType::F32, Access::Read, ROWS * 16 * 4);
    let y = k.param("y", DType::F32, Access::Write, ROWS * ROW);
    k.for_("l", i64(0), i64(ROW as i64), |b, l| {
        let g = b.let_("g", item() * i64(ROW as i64) + l.clone());
        let col = g.clone() % i64(SEG as i64);
        let seg = g.clone() / i64(SEG as i64);
        let from_a = a.at(seg.clone() * i64(4) + col.clone());
        let from_b = b_.at(seg.clone() * i64(16) + col.clone() - i64(4));
        let from_c = c.at(seg * i64(4) + col.clone() - i64(20));
        let v = select(col.clone().lt(i64(4)), from_a, select(col.lt(i64(20)), from_b, from_c));
        b.store(&y, g, v);
    });
    k.finish()
}

/// `s = Σ_l x[l] · w[l % 24]` in loop order: splitting must keep the order.
fn weighted_sum() -> Kernel {
    let mut k = KernelBuilder::new("wsum", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * ROW);
    let w = k.param("w", DType::F32, Access::Read, SEG);
    let s = k.param("s", DType::F32, Access::Write, ROWS);
    let acc = k.var("acc", f32(0.0));
    k.for_("l", i64(0), i64(ROW as i64), |b, l| {
        b.assign(&acc, acc.clone() + x.at(item() * i64(ROW as i64) + l.clone()) * w.at(l % i64(SEG as i64)));
    });
    k.store(&s, item(), acc);
    k.finish()
}

#[test]
fn segmented_loop_is_strip_mined_and_loses_its_divisions() {
    let before = shape(&simplify_indices(segmented()).body);
    assert_eq!(before, (1, 2, 0), "the flat loop divides and takes a remainder");
    let split = prepared(segmented());
    split.validate().expect("the split kernel is valid");
    assert_eq!(shape(&split.body), (2, 0, 0), "{:#?}", split.body);
    let Stmt::For { end, body, .. } = &split.body[0] else { panic!("{:#?}", split.body) };
    assert_eq!(*end, i64(16));
    assert!(matches!(&body[0], Stmt::For { end, .. } if *end == i64(SEG as i64)), "{body:#?}");
}

#[test]
fn concatenation_is_cut_at_its_column_thresholds() {
    let split = prepared(concatenation());
    split.validate().expect("the split kernel is valid");
    // One loop over segments holding three column loops, no select left.
    assert_eq!(shape(&split.body), (4, 0, 0), "{:#?}", split.body);
}

#[test]
fn loops_that_gain_nothing_are_left_alone() {
    // `(7·l) / 5` keeps a division whichever way the loop is cut.
    let mut k = KernelBuilder::new("odd", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, 100);
    let y = k.param("y", DType::F32, Access::Write, ROWS * 60);
    k.for_("l", i64(0), i64(60), |b, l| {
        b.store(&y, item() * i64(60) + l.clone(), x.at(l * i64(7) / i64(5)));
    });
    let plain = simplify_indices(k.finish());
    assert_eq!(split_loops(plain.clone()), plain);
    // Block-per-item kernels keep their shape.
    let mut k = KernelBuilder::new("block", Grid::block_per_item(ROWS, 32));
    let y = k.param("y", DType::F32, Access::Write, ROWS * ROW);
    k.for_("l", i64(0), i64(ROW as i64), |b, l| {
        b.store(&y, item() * i64(ROW as i64) + l.clone() / i64(24), f32(1.0))
    });
    let plain = simplify_indices(k.finish());
    assert_eq!(split_loops(plain.clone()), plain);
}

/// `c = x − μ[l / G]`, then `(c²)` through local rows, over a token's `4·G`
/// elements: the centring of a group statistic as the item emitter writes it
/// (VWN's output norm over 4 groups of 256, docs/math.md §5.1), a shift per
/// element where `G` is a power of two, and three local-array reads and
/// writes at `l` that strip-mining turns into `lo·G + li`.
fn group_centring(groups: usize, group: usize) -> Kernel {
    let len = groups * group;
    let mut k = KernelBuilder::new("centre", Grid::thread_per_item(ROWS));
    let x = k.param("x", DType::F32, Access::Read, ROWS * len);
    let mu = k.param("mu", DType::F32, Access::Read, ROWS * groups);
    let y = k.param("y", DType::F32, Access::Write, ROWS * len);
    let m = k.local_array("m", Ty::F32, groups);
    let (c, sq) = (k.local_array("c", Ty::F32, len), k.local_array("sq", Ty::F32, len));
    k.for_("g", i64(0), i64(groups as i64), |b, g| {
        b.store(&m, g.clone(), mu.at(item() * i64(groups as i64) + g));
    });
    k.for_("l", i64(0), i64(len as i64), |b, l| {
        let at = b.let_("at", item() * i64(len as i64) + l.clone());
        b.store(&c, l.clone(), x.at(at.clone()) - m.at(l.clone() / i64(group as i64)));
        let v = b.let_("v", c.at(l.clone()));
        b.store(&sq, l.clone(), v.clone() * v);
        b.store(&y, at, sq.at(l));
    });
    k.finish()
}

/// Over a loop long enough to run as several vectors a division by a power
/// of two keeps the loop from vectorizing (the statistic read by gather), so
/// the loop is strip-mined; over 16 elements (one vector) the division is
/// cheaper than the longer indices and the loop is left alone.
#[test]
fn long_loops_lose_even_a_power_of_two_division() {
    let split = prepared(group_centring(4, 256));
    split.validate().expect("the split kernel is valid");
    assert_eq!(shape(&split.body), (3, 0, 0), "{:#?}", split.body);
    let short = simplify_indices(group_centring(4, 4));
    assert_eq!(split_loops(short.clone()), short, "16 elements: one vector, left alone");
}

#[test]
fn split_kernels_compute_the_same_bits() {
    let cache = std::env::temp_dir().join(format!("widen-split-test-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let renamed = |mut k: Kernel, name: &str| {
        k.name = name.into();
        k
    };
    let kernels = vec![
        segmented(),
        renamed(prepared(segmented()), "segmented_split"),
        concatenation(),
        renamed(prepared(concatenation()), "concat_split"),
        weighted_sum(),
        renamed(prepared(weighted_sum()), "wsum_split"),
        group_centring(4, 256),
        renamed(prepared(group_centring(4, 256)), "centre_split"),
    ];
    let lib = compiler.compile_kernels(&kernels).expect("compiles");
    let data = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| (((i + seed) * 7919) % 1000) as f32 / 77.0 - 6.0).collect()
    };
    let run = |name: &str, inputs: &[Vec<f32>], out_len: usize| -> Vec<f32> {
        let mut out = vec![0.0f32; out_len];
        let mut args: Vec<*mut c_void> = inputs.iter().map(|v| v.as_ptr() as *mut c_void).collect();
        args.push(out.as_mut_ptr().cast());
        let entry = lib.entry(name).expect("entry");
        // SAFETY: buffers match the parameters' types and lengths, in order.
        unsafe { entry.call(&args, 0, ROWS as i64) };
        out
    };
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());

    let seg_in = [data(ROWS * ROW, 1), data(ROWS * 16, 2), data(SEG, 3)];
    let (plain, split) = (run("segmented", &seg_in, ROWS * ROW), run("segmented_split", &seg_in, ROWS * ROW));
    assert!(same(&plain, &split));
    assert!(plain.iter().any(|v| *v != 0.0));

    let cat_in = [data(ROWS * 64, 4), data(ROWS * 256, 5), data(ROWS * 64, 6)];
    let (plain, split) = (run("concat", &cat_in, ROWS * ROW), run("concat_split", &cat_in, ROWS * ROW));
    assert!(same(&plain, &split));
    // Column 5 of segment 2 of row 1 comes from b's row 1, segment 2, column 1.
    assert_eq!(split[ROW + 2 * SEG + 5].to_bits(), cat_in[1][256 + 2 * 16 + 1].to_bits());

    let sum_in = [data(ROWS * ROW, 7), data(SEG, 8)];
    let (plain, split) = (run("wsum", &sum_in, ROWS), run("wsum_split", &sum_in, ROWS));
    assert!(same(&plain, &split));

    let centre_in = [data(ROWS * 1024, 9), data(ROWS * 4, 10)];
    let (plain, split) =
        (run("centre", &centre_in, ROWS * 1024), run("centre_split", &centre_in, ROWS * 1024));
    assert!(same(&plain, &split));
    let _ = std::fs::remove_dir_all(cache);
}
