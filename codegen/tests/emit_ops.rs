//! Every op, forward and backward, lowered alone (one op per group) and inside
//! one all-covering group (which the compiler splits where ops cannot share an
//! item split), against the f32 reference executor. Tolerances are relative
//! (see `common::emit::rel_err`): 1e-5 for ops whose summation order matches
//! the reference exactly, looser where it differs (the reference's GEMM, the
//! online softmax of attention, the loss's block reduction).

mod common;

use codegen::compile::{one_op_per_group, Request, Target};
use codegen::kernel::{Stmt, Unroll};
use codegen::plan::BufferRole;
use common::emit::{check, input, one_group, param, Rng, Sources};
use ir::exec::Value;
use ir::graph::{BinaryOp, Graph, NodeId, Op, ReduceOp, UnaryOp};

type Ints = dyn Fn(NodeId, usize) -> Vec<i32>;

fn run_case(name: &str, tol: f32, noise: f32, ints: &Ints, build: impl Fn(&mut Graph) -> NodeId) {
    let mut g = Graph::new();
    let y = build(&mut g);
    g.set_output("y", y);
    let request = Request::new(&g, Vec::new());
    let mut rng = Rng::new(name.len() as u64 * 7919 + 13);
    let sources = Sources::random(&g, &mut rng, noise, ints);
    check(&g, &sources, &request, &one_op_per_group(&g), tol, &format!("{name} (one op per group)"));
    check(&g, &sources, &request, &one_group(&g), tol, &format!("{name} (one group)"));
}

fn case(name: &str, tol: f32, build: impl Fn(&mut Graph) -> NodeId) {
    run_case(name, tol, 1.0, &|_, n| vec![0; n], build);
}

fn add(g: &mut Graph, op: Op, inputs: &[NodeId]) -> NodeId {
    g.add(op, inputs).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn unary_ops() {
    use UnaryOp::*;
    for u in [Neg, Exp, Log, Tanh, Sigmoid, Silu, Sqrt, Rsqrt, Recip, Square] {
        case(&format!("unary {u:?}"), 1e-5, |g| {
            let x = param(g, "x", &[2, 3, 5]);
            // Positive operands for log, sqrt, rsqrt and recip.
            let pos = add(g, Op::Affine { mul: 0.5, add: 1.0 }, &[x]);
            let arg = if matches!(u, Log | Sqrt | Rsqrt | Recip) { pos } else { x };
            add(g, Op::Unary(u), &[arg])
        });
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    use BinaryOp::*;
    for op in [Add, Sub, Mul, Div, Max] {
        for (a, b) in
            [(&[2, 3, 4][..], &[2, 3, 4][..]), (&[2, 3, 4], &[4]), (&[2, 1, 4], &[3, 1]), (&[1], &[2, 3])]
        {
            case(&format!("binary {op:?} {a:?} {b:?}"), 1e-5, |g| {
                let x = param(g, "a", a);
                let y = param(g, "b", b);
                let y = if op == Div { add(g, Op::Affine { mul: 0.25, add: 2.0 }, &[y]) } else { y };
                add(g, Op::Binary(op), &[x, y])
            });
        }
    }
}

#[test]
fn reductions_over_every_axis() {
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
        for axis in 0..3 {
            for keepdim in [false, true] {
                case(&format!("reduce {op:?} axis {axis} keep {keepdim}"), 1e-5, |g| {
                    let x = param(g, "x", &[3, 4, 5]);
                    add(g, Op::Reduce { op, axis, keepdim }, &[x])
                });
            }
        }
    }
}

#[test]
fn views_materialized_and_folded() {
    let views: Vec<(&str, Op)> = vec![
        ("reshape", Op::Reshape { shape: vec![6, 4] }),
        ("permute", Op::Permute { perm: vec![2, 0, 1] }),
        ("broadcast", Op::Broadcast { shape: vec![2, 2, 3, 4] }),
        ("slice", Op::Slice { axis: 1, start: 1, end: 3 }),
    ];
    for (name, op) in views {
        // As an output (a copy) and folded into a consumer's index math.
        case(&format!("{name} copy"), 0.0, |g| {
            let x = param(g, "x", &[2, 3, 4]);
            add(g, op.clone(), &[x])
        });
        case(&format!("{name} folded"), 1e-5, |g| {
            let x = param(g, "x", &[2, 3, 4]);
            let e = add(g, Op::Unary(UnaryOp::Exp), &[x]);
            let v = add(g, op.clone(), &[e]);
            add(g, Op::Unary(UnaryOp::Tanh), &[v])
        });
    }
    case("concat", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 4]);
        let y = param(g, "y", &[2, 2, 4]);
        let e = add(g, Op::Unary(UnaryOp::Exp), &[x]);
        let c = add(g, Op::Concat { axis: 1 }, &[e, y, e]);
        add(g, Op::Affine { mul: 2.0, add: -1.0 }, &[c])
    });
    case("constant", 0.0, |g| {
        let x = param(g, "x", &[3, 4]);
        let c = g.add_source(Op::Constant { value: 0.75 }, ir::Shape::new([3, 4]), ir::DType::F32, None);
        add(g, Op::Binary(BinaryOp::Mul), &[x, c])
    });
}

#[test]
fn matmuls_as_gemm_and_loops() {
    let shapes: [(&[usize], &[usize], bool, bool); 6] = [
        (&[2, 3, 5], &[5, 4], false, false),
        (&[2, 3, 5], &[2, 5, 4], false, false),
        (&[2, 5, 3], &[2, 4, 5], true, true),
        (&[4, 5], &[2, 3, 4, 6], true, false),
        (&[2, 3, 1, 4], &[2, 3, 4, 5], false, false),
        (&[2, 1, 3, 4], &[1, 2, 4, 5], false, false),
    ];
    for (a, b, ta, tb) in shapes {
        case(&format!("matmul {a:?} {b:?} {ta} {tb}"), 1e-5, |g| {
            let x = param(g, "a", a);
            let y = param(g, "b", b);
            let m = add(g, Op::MatMul { trans_a: ta, trans_b: tb }, &[x, y]);
            add(g, Op::Unary(UnaryOp::Tanh), &[m])
        });
    }
}

#[test]
fn row_ops() {
    case("softmax", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 7]);
        add(g, Op::Softmax, &[x])
    });
    case("rms_norm gain", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 8]);
        let w = param(g, "w", &[8]);
        add(g, Op::RmsNorm { eps: 1e-6 }, &[x, w])
    });
    case("rms_norm bare", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 8]);
        add(g, Op::RmsNorm { eps: 1e-6 }, &[x])
    });
    case("layer_norm affine", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 8]);
        let w = param(g, "w", &[8]);
        let b = param(g, "b", &[8]);
        add(g, Op::LayerNorm { eps: 1e-5 }, &[x, w, b])
    });
    case("layer_norm bare", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 8]);
        add(g, Op::LayerNorm { eps: 1e-5 }, &[x])
    });
    case("group_norm", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 12]);
        let w = param(g, "w", &[12]);
        let b = param(g, "b", &[12]);
        add(g, Op::GroupNorm { groups: 3, eps: 1e-5 }, &[x, w, b])
    });
    for centered in [0, 2, 5] {
        case(&format!("norm_project centered {centered}"), 1e-4, |g| {
            let x = param(g, "x", &[2, 3, 8]);
            let w = param(g, "w", &[8, 5]);
            add(g, Op::NormProject { eps: 1e-6, centered }, &[x, w])
        });
    }
}

#[test]
fn topk_gather_scatter() {
    // TopK output (i32) compared exactly; followed by a gather of the chosen rows.
    case("topk", 0.0, |g| {
        let s = param(g, "s", &[2, 3, 9]);
        add(g, Op::TopK { k: 4, fixed: 2 }, &[s])
    });
    case("topk gather", 1e-5, |g| {
        let s = param(g, "s", &[2, 3, 6]);
        let x = param(g, "x", &[2, 3, 6, 4]);
        let idx = add(g, Op::TopK { k: 3, fixed: 1 }, &[s]);
        let rows = add(g, Op::Gather { axis: 2 }, &[x, idx]);
        let e = add(g, Op::Unary(UnaryOp::Exp), &[rows]);
        add(g, Op::ScatterRows { axis: 2 }, &[x, idx, e])
    });
    let ids: &Ints = &|_, n| (0..n).map(|i| ((i * 5 + 3) % 7) as i32).collect();
    run_case("embedding gather", 1e-5, 1.0, ids, |g| {
        let table = param(g, "table", &[7, 4]);
        let idx = input(g, "ids", &[2, 3]);
        add(g, Op::Gather { axis: 0 }, &[table, idx])
    });
    run_case("scatter_add", 1e-5, 1.0, ids, |g| {
        let base = param(g, "base", &[7, 4]);
        let idx = input(g, "ids", &[2, 3]);
        let src = param(g, "src", &[2, 3, 4]);
        add(g, Op::ScatterAdd { axis: 0 }, &[base, idx, src])
    });
    // Repeated indices, and a scatter over a middle axis (p = 2 leading blocks, each
    // split into column blocks on the CPU): every output summed in the reference's
    // order, whatever the split.
    let repeats: &Ints = &|_, n| (0..n).map(|i| ((i * 3) % 4) as i32 % 3).collect();
    run_case("scatter_add repeated ids", 0.0, 1.0, repeats, |g| {
        let base = param(g, "base", &[5, 64]);
        let idx = input(g, "ids", &[4, 9]);
        let src = param(g, "src", &[4, 9, 64]);
        add(g, Op::ScatterAdd { axis: 0 }, &[base, idx, src])
    });
    run_case("scatter_add middle axis", 0.0, 1.0, repeats, |g| {
        let base = param(g, "base", &[2, 5, 8]);
        let idx = input(g, "ids", &[2, 6]);
        let src = param(g, "src", &[2, 6, 8]);
        add(g, Op::ScatterAdd { axis: 1 }, &[base, idx, src])
    });
    // Distinct indices per row for ScatterRows.
    let distinct: &Ints = &|_, n| (0..n).map(|i| ((i % 3) * 2 + (i / 3) % 2) as i32).collect();
    run_case("scatter_rows", 0.0, 1.0, distinct, |g| {
        let base = param(g, "base", &[2, 6, 4]);
        let idx = input(g, "ids", &[2, 3]);
        let src = param(g, "src", &[2, 3, 4]);
        add(g, Op::ScatterRows { axis: 1 }, &[base, idx, src])
    });
}

/// TopK's selection against the reference's sort on rows built to hit every rule of
/// the order (docs/math.md §6.2): equal scores (the lower index first), NaN (after
/// every number; NaNs by index), a row wider than any stream count (a MoE router's
/// 64 experts), and the ends k = fixed and k = n. Exact: the ids are integers.
#[test]
fn topk_orders_ties_and_nan_as_the_reference() {
    let n = 64;
    // Row 0 distinct, row 1 all equal, row 2 ties at the top and NaNs among them,
    // row 3 all NaN but two numbers.
    let mut values = Vec::with_capacity(4 * n);
    values.extend((0..n).map(|i| ((i * 37) % n) as f64 * 0.25 - 3.0));
    values.extend(std::iter::repeat_n(1.5, n));
    values.extend((0..n).map(|i| match i % 5 {
        0 => 2.0,
        1 => f64::NAN,
        2 => -1.0,
        _ => (i % 7) as f64 * 0.1,
    }));
    values.extend((0..n).map(|i| if i == 9 || i == 40 { -2.0 } else { f64::NAN }));
    for (k, fixed) in [(2, 0), (6, 0), (3, 1), (2, 2), (n, 0), (n, 3), (1, 0)] {
        run_case(&format!("topk {k} of {n}, {fixed} fixed"), 0.0, 0.0, &|_, len| vec![0; len], |g| {
            let info = ir::graph::ParamInfo {
                name: "s".into(),
                init: ir::graph::Init::Values(values.clone()),
                class: ir::graph::ParamClass::Hidden,
            };
            let s = g.add_source(Op::Param(info), ir::Shape::new([4, n]), ir::DType::F32, Some("s".into()));
            add(g, Op::TopK { k, fixed }, &[s])
        });
    }
}

#[test]
fn sinkhorn_and_its_gradient() {
    case("sinkhorn", 1e-5, |g| {
        let x = param(g, "x", &[2, 3, 4, 4]);
        add(g, Op::Sinkhorn { iters: 5, eps: 1e-6 }, &[x])
    });
    case("sinkhorn_grad", 1e-4, |g| {
        let x = param(g, "x", &[2, 3, 4, 4]);
        let d = param(g, "d", &[2, 3, 4, 4]);
        add(g, Op::SinkhornGrad { iters: 5, eps: 1e-6 }, &[x, d])
    });
}

/// On the C target Sinkhorn and its gradient run in blocks of 16 matrices,
/// vectorized across them (`emit::lower_sinkhorn_lanes`); the Cuda target
/// keeps one matrix per item (its C dialect runs here). 37 matrices leave a
/// partial last block (the lanes' offsets an array, clamped); 32 fill two
/// blocks (the forward's offsets an expression of the item and lane, the
/// gradient's still an array). Both match the
/// reference, and each other bit for bit: the lanes form is the same
/// arithmetic per matrix.
#[test]
fn sinkhorn_lanes_match_one_matrix_per_item_bitwise() {
    for (side, mats) in [(3, 37), (4, 37), (4, 32)] {
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[mats, side, side]);
        let d = param(&mut g, "d", &[mats, side, side]);
        let fwd = add(&mut g, Op::Sinkhorn { iters: 7, eps: 1e-6 }, &[x]);
        let grad = add(&mut g, Op::SinkhornGrad { iters: 7, eps: 1e-6 }, &[x, d]);
        g.set_output("y", fwd);
        g.set_output("dx", grad);
        let sources = Sources::random(&g, &mut Rng::new(side as u64), 2.0, &|_, n| vec![0; n]);
        let mut results = Vec::new();
        for target in [Target::Cpu, Target::Cuda] {
            let request = Request::new(&g, Vec::new()).for_target(target);
            let plan =
                check(&g, &sources, &request, &one_group(&g), 1e-4, &format!("sinkhorn {side} {target:?}"));
            let blocks: Vec<_> =
                plan.kernels.iter().filter(|k| k.grid.items() == mats.div_ceil(16)).collect();
            assert_eq!(
                blocks.len(),
                if target == Target::Cpu { 2 } else { 0 },
                "{target:?}: blocks of 16 matrices"
            );
            for k in blocks {
                let offsets_array =
                    k.body.iter().any(|s| matches!(s, Stmt::LocalArray { var, .. } if var.starts_with("mb")));
                let affine = mats.is_multiple_of(16) && !k.name.contains("grad");
                assert_eq!(
                    offsets_array, !affine,
                    "{} over {mats} matrices: lane offsets in an array",
                    k.name
                );
            }
            let outs = common::emit::run_plan(&g, &plan, &sources);
            let named = |name: &str| {
                let buf = plan.find(&BufferRole::Output { name: name.into() }).expect("output buffer");
                outs[buf.0].as_f32().to_vec()
            };
            results.push((named("y"), named("dx")));
        }
        assert_eq!(
            results[0], results[1],
            "side {side}, {mats} matrices: lanes and per-item forms agree bitwise"
        );
    }
}

/// Whether any loop of `stmts` is kept a loop ([`Unroll::Never`]): the lane
/// loops of rows folded together.
fn has_kept_loop(stmts: &[Stmt]) -> bool {
    stmts.iter().any(|s| match s {
        Stmt::For { unroll, body, .. } => *unroll == Unroll::Never || has_kept_loop(body),
        Stmt::If { then, else_, .. } => has_kept_loop(then) || has_kept_loop(else_),
        _ => false,
    })
}

/// Per-token statistics of many short rows, as VWN's connection takes them
/// (per-segment means over C/m and `[m, 4] x [4, n]` dot products, docs/math.md
/// §5.3): on the C target an item folds all its rows at once, on the GPU one
/// row at a time, its sums split across the lanes of a block (another fixed
/// order). Both match the reference, for 16 lanes (64-wide rows) and 8
/// (32-wide); the maxima, which do not depend on the order, agree bitwise,
/// with a NaN, which the maximum propagates. Rows of 256 (16 lane steps) stay
/// one row at a time on both.
#[test]
fn rows_folded_together_match_one_row_at_a_time_bitwise() {
    for len in [64, 32, 256] {
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[6, 16, len]);
        let w = param(&mut g, "w", &[6, 4, len]);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
            let r = add(&mut g, Op::Reduce { op, axis: 2, keepdim: true }, &[x]);
            let r = add(&mut g, Op::Broadcast { shape: vec![6, 16, len] }, &[r]);
            let scaled = add(&mut g, Op::Binary(BinaryOp::Mul), &[x, r]);
            g.set_output(&format!("{op:?}"), scaled);
            if op == ReduceOp::Sum {
                // A softmax over the whole token: items own all 16 rows.
                let flat = add(&mut g, Op::Reshape { shape: vec![6, 16 * len] }, &[scaled]);
                let token = add(&mut g, Op::Softmax, &[flat]);
                g.set_output("token", token);
            }
        }
        let dots = add(&mut g, Op::MatMul { trans_a: false, trans_b: true }, &[x, w]);
        g.set_output("dots", dots);
        let mut sources = Sources::random(&g, &mut Rng::new(len as u64), 1.0, &|_, n| vec![0; n]);
        let Some(Value::Float(xs)) = sources.values.get_mut(&x) else { panic!("x is a float source") };
        xs.data[3 * 16 * len + 5 * len + 7] = f32::NAN;
        let outputs = ["Sum", "Max", "Mean", "dots", "token"];
        let mut results = Vec::new();
        for target in [Target::Cpu, Target::Cuda] {
            let request = Request::new(&g, Vec::new()).for_target(target);
            let plan = check(&g, &sources, &request, &one_group(&g), 1e-4, &format!("rows {len} {target:?}"));
            let kept = plan.kernels.iter().any(|k| has_kept_loop(&k.body));
            let together = target == Target::Cpu && len <= 64;
            assert_eq!(kept, together, "{target:?}, rows of {len}: rows folded together");
            let outs = common::emit::run_plan(&g, &plan, &sources);
            let bits: Vec<Vec<u32>> = outputs
                .iter()
                .map(|name| {
                    let buf = plan.find(&BufferRole::Output { name: (*name).into() }).expect("output buffer");
                    outs[buf.0].as_f32().iter().map(|v| v.to_bits()).collect()
                })
                .collect();
            results.push(bits);
        }
        assert_eq!(results[0][1], results[1][1], "Max, rows of {len}: C and GPU forms agree bitwise");
        let nan_rows = results[0][1].iter().filter(|&&b| f32::from_bits(b).is_nan()).count();
        assert_eq!(nan_rows, len, "the NaN's row of the max is NaN, and only it");
    }
}

/// A per-token stream mix plus a broadcast row (mHC's write, docs/math.md §4.1):
/// on the C target one item owns a whole 64-wide row (per-element items left
/// divisions by the row widths in the index math), on the GPU one element.
#[test]
fn c_items_own_whole_rows() {
    let mut g = Graph::new();
    let h = param(&mut g, "h", &[8, 4, 4]);
    let x = param(&mut g, "x", &[8, 4, 64]);
    let y = param(&mut g, "y", &[8, 1, 64]);
    let mix = add(&mut g, Op::MatMul { trans_a: false, trans_b: false }, &[h, x]);
    let y = add(&mut g, Op::Broadcast { shape: vec![8, 4, 64] }, &[y]);
    let out = add(&mut g, Op::Binary(BinaryOp::Add), &[mix, y]);
    g.set_output("out", out);
    let sources = Sources::random(&g, &mut Rng::new(5), 1.0, &|_, n| vec![0; n]);
    for (target, items) in [(Target::Cpu, 32), (Target::Cuda, 8 * 4 * 64)] {
        let request = Request::new(&g, Vec::new()).for_target(target);
        let plan = check(&g, &sources, &request, &one_group(&g), 1e-5, &format!("stream write {target:?}"));
        let [k] = &plan.kernels[..] else { panic!("one kernel, got {}", plan.kernels.len()) };
        assert_eq!(k.grid.items(), items, "{target:?}");
    }
}

/// A row statistic over a long elementwise chain: before loop fusion each of
/// `a`, `b` and `c` declares a 12000-element row per item, 36000 elements in
/// all, over the C target's 32768; after it only `c` (read again once the
/// mean is known) keeps its array, so the C target measures the optimized
/// body and keeps the chain in one kernel of one row per item.
#[test]
fn c_kernels_are_split_by_the_scratch_that_survives_fusion() {
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[4, 12000]);
    let a = add(&mut g, Op::Binary(BinaryOp::Mul), &[x, x]);
    let b = add(&mut g, Op::Binary(BinaryOp::Add), &[a, x]);
    let c = add(&mut g, Op::Binary(BinaryOp::Mul), &[b, b]);
    let m = add(&mut g, Op::Reduce { op: ReduceOp::Mean, axis: 1, keepdim: true }, &[c]);
    let m = add(&mut g, Op::Broadcast { shape: vec![4, 12000] }, &[m]);
    let out = add(&mut g, Op::Binary(BinaryOp::Sub), &[c, m]);
    g.set_output("out", out);
    assert!(3 * 12000 > Target::Cpu.local_limit(), "the unfused bound must be over the limit");
    let sources = Sources::random(&g, &mut Rng::new(9), 1.0, &|_, n| vec![0; n]);
    let request = Request::new(&g, Vec::new()).for_target(Target::Cpu);
    let plan = check(&g, &sources, &request, &one_group(&g), 1e-4, "long chain under a row mean");
    let [k] = &plan.kernels[..] else { panic!("one kernel, got {}", plan.kernels.len()) };
    assert_eq!(k.grid.items(), 4);
    assert_eq!(k.local_elements(), 12000 + 1, "only the squared row and its mean stay arrays");
}

/// A `Cast` fuses like the other elementwise ops: one that reads a value its own
/// kernel computes (here `exp(x)`, rounded to bf16 and widened back) stays in that
/// kernel, and the kernel's registers round as a bf16 store would (docs/math.md §6.12).
#[test]
fn a_cast_of_a_value_of_its_own_kernel_stays_in_that_kernel() {
    for target in [Target::Cpu, Target::Cuda] {
        let mut g = Graph::new();
        let x = param(&mut g, "x", &[8, 64]);
        let e = add(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
        let h = add(&mut g, Op::Cast { to: ir::DType::Bf16 }, &[e]);
        let w = add(&mut g, Op::Cast { to: ir::DType::F32 }, &[h]);
        let out = add(&mut g, Op::Binary(BinaryOp::Mul), &[w, x]);
        g.set_output("out", out);
        let sources = Sources::random(&g, &mut Rng::new(5), 1.0, &|_, n| vec![0; n]);
        let request = Request::new(&g, Vec::new()).for_target(target);
        let plan = check(&g, &sources, &request, &one_group(&g), 1e-6, &format!("cast chain {target:?}"));
        assert_eq!(plan.kernels.len(), 1, "{target:?}: the casts fuse with their producer and consumer");
    }
}

#[test]
fn attention_and_its_gradients() {
    for rope in [None, Some(10000.0)] {
        for (h, hkv) in [(2, 2), (4, 2)] {
            let label = format!("rope {rope:?} heads {h}/{hkv}");
            let qkv = move |g: &mut Graph| {
                let q = param(g, "q", &[2, 5, h, 4]);
                let k = param(g, "k", &[2, 5, hkv, 4]);
                let v = param(g, "v", &[2, 5, hkv, 4]);
                (q, k, v)
            };
            case(&format!("attention {label}"), 1e-5, |g| {
                let (q, k, v) = qkv(g);
                add(g, Op::CausalAttention { scale: 0.5, rope_base: rope }, &[q, k, v])
            });
            for wrt in 0..3 {
                case(&format!("attention grad {wrt} {label}"), 1e-4, |g| {
                    let (q, k, v) = qkv(g);
                    let d = param(g, "d", &[2, 5, h, 4]);
                    add(g, Op::CausalAttentionGrad { scale: 0.5, rope_base: rope, wrt }, &[q, k, v, d])
                });
            }
        }
    }
}

/// A NaN key turns exactly the rows that attend to it into NaN, as in the
/// reference executor (the C softmax's row maximum ignores NaN: the key's
/// exponential and the row's sum carry it instead).
#[test]
fn attention_propagates_a_nan_key_to_the_rows_that_see_it() {
    let mut g = Graph::new();
    let q = param(&mut g, "q", &[1, 6, 2, 4]);
    let k = param(&mut g, "k", &[1, 6, 2, 4]);
    let v = param(&mut g, "v", &[1, 6, 2, 4]);
    let y = add(&mut g, Op::CausalAttention { scale: 0.5, rope_base: None }, &[q, k, v]);
    g.set_output("y", y);
    let request = Request::new(&g, Vec::new()).for_target(Target::Cpu);
    let mut sources = Sources::random(&g, &mut Rng::new(5), 1.0, &|_, n| vec![0; n]);
    // Key of token 3, head 1.
    let Some(ir::exec::Value::Float(keys)) = sources.values.get_mut(&k) else { panic!("k is a float param") };
    keys.data[(3 * 2 + 1) * 4] = f32::NAN;
    let want = ir::exec::run::<f32>(&g, &sources.values, &[y]).expect("reference");
    let ir::exec::Value::Float(want) = &want[&y] else { panic!("float output") };
    for partition in [one_op_per_group(&g), one_group(&g)] {
        let plan = codegen::compile::compile(&g, &partition, &request).expect("compiles");
        let outs = common::emit::run_plan(&g, &plan, &sources);
        let out = plan.find(&BufferRole::Output { name: "y".into() }).expect("output buffer");
        let codegen::compile::HostData::F32(got) = &outs[out.0] else { panic!("f32 output") };
        for (i, (x, w)) in got.iter().zip(&want.data).enumerate() {
            let (t, head) = (i / 8, i / 4 % 2);
            assert_eq!(x.is_nan(), w.is_nan(), "element {i} (token {t}, head {head}): {x} vs {w}");
            assert_eq!(x.is_nan(), t >= 3 && head == 1, "element {i} (token {t}, head {head})");
        }
    }
}

/// A softmax row with a NaN is NaN, other rows are untouched, and a NaN logit
/// makes the mean cross-entropy NaN, as in the reference executor (the
/// kernels' shift maximum skips NaN: the exponentials and sums carry it).
#[test]
fn softmax_and_cross_entropy_propagate_nan_as_the_reference() {
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[3, 40]);
    let t = input(&mut g, "t", &[3]);
    let p = add(&mut g, Op::Softmax, &[x]);
    let loss = add(&mut g, Op::SoftmaxCrossEntropy, &[x, t]);
    g.set_output("p", p);
    g.set_output("loss", loss);
    let request = Request::new(&g, Vec::new()).for_target(Target::Cpu);
    let mut sources = Sources::random(&g, &mut Rng::new(9), 1.0, &|_, n| vec![1; n]);
    let Some(ir::exec::Value::Float(xs)) = sources.values.get_mut(&x) else { panic!("x is a float param") };
    xs.data[40 + 7] = f32::NAN;
    let want = ir::exec::run::<f32>(&g, &sources.values, &[p, loss]).expect("reference");
    for partition in [one_op_per_group(&g), one_group(&g)] {
        let plan = codegen::compile::compile(&g, &partition, &request).expect("compiles");
        let outs = common::emit::run_plan(&g, &plan, &sources);
        for (name, id) in [("p", p), ("loss", loss)] {
            let buf = plan.find(&BufferRole::Output { name: name.into() }).expect("output buffer");
            let codegen::compile::HostData::F32(got) = &outs[buf.0] else { panic!("f32 output") };
            let ir::exec::Value::Float(want) = &want[&id] else { panic!("float output") };
            for (i, (a, w)) in got.iter().zip(&want.data).enumerate() {
                assert_eq!(a.is_nan(), w.is_nan(), "{name}[{i}]: {a} vs {w}");
                assert!(a.is_nan() || (a - w).abs() <= 1e-5 * w.abs().max(1e-3), "{name}[{i}]: {a} vs {w}");
            }
        }
        let buf = plan.find(&BufferRole::Output { name: "p".into() }).expect("p");
        let codegen::compile::HostData::F32(got) = &outs[buf.0] else { panic!("f32 output") };
        assert!(got[40..80].iter().all(|v| v.is_nan()) && !got[..40].iter().any(|v| v.is_nan()));
    }
}

#[test]
fn cross_entropy() {
    let targets: &Ints = &|_, n| (0..n).map(|i| ((i * 3 + 1) % 6) as i32).collect();
    let build = |g: &mut Graph| {
        let x = param(g, "logits", &[2, 300, 6]);
        let t = input(g, "targets", &[2, 300]);
        add(g, Op::SoftmaxCrossEntropy, &[x, t])
    };
    run_case("softmax_cross_entropy", 1e-5, 1.0, targets, build);
    // Two phases: blocks of rows (600 rows in 16 uneven slices) that the
    // threads share, then the mean of their partials.
    let mut g = Graph::new();
    let y = build(&mut g);
    g.set_output("y", y);
    let plan = codegen::compile::compile(&g, &one_op_per_group(&g), &Request::new(&g, Vec::new()))
        .expect("compiles");
    let grids: Vec<_> = plan.kernels.iter().map(|k| k.grid).collect();
    assert_eq!(grids.len(), 2, "{grids:?}");
    assert!(grids[0].is_block() && grids[0].items() == 16, "{grids:?}");
    assert_eq!(grids[1].items(), 1);
}

/// The fused output projection and loss and both its gradients (docs/math.md §1.7)
/// against the reference, w in both layouts, chunks that do and do not divide the
/// 20 rows, at a byte vocabulary and at GPT-2's; the unfused pair (GEMM, then the
/// loss over the whole logits) is in the same graph, so both match the same values.
#[test]
fn linear_cross_entropy_and_its_gradients() {
    for (trans_b, chunk, v, d) in
        [(false, 7, 6, 5), (true, 5, 13, 5), (false, 20, 256, 5), (true, 6, 50304, 3)]
    {
        let label = format!("trans_b {trans_b} chunk {chunk} V {v}");
        let targets: &Ints = &move |_, n| (0..n).map(|i| ((i * 7919 + 3) % v) as i32).collect();
        let operands = move |g: &mut Graph| {
            let x = param(g, "x", &[2, 10, d]);
            let w = if trans_b { param(g, "w", &[v, d]) } else { param(g, "w", &[d, v]) };
            let t = input(g, "t", &[2, 10]);
            (x, w, t)
        };
        let op = Op::LinearCrossEntropy { trans_b, scale: 0.8, chunk };
        run_case(&format!("linear_cross_entropy {label}"), 1e-5, 1.0, targets, |g| {
            let (x, w, t) = operands(g);
            let logits = add(g, Op::MatMul { trans_a: false, trans_b }, &[x, w]);
            let scaled = add(g, Op::Affine { mul: 0.8, add: 0.0 }, &[logits]);
            let unfused = add(g, Op::SoftmaxCrossEntropy, &[scaled, t]);
            g.set_output("unfused", unfused);
            add(g, op.clone(), &[x, w, t])
        });
        for wrt in 0..2 {
            run_case(&format!("linear_cross_entropy grad {wrt} {label}"), 1e-4, 1.0, targets, |g| {
                let (x, w, t) = operands(g);
                let dy = param(g, "dy", &[]);
                let Op::LinearCrossEntropy { trans_b, scale, chunk } = op else { unreachable!() };
                add(g, Op::LinearCrossEntropyGrad { trans_b, scale, chunk, wrt }, &[x, w, t, dy])
            });
        }
    }
}

/// Both gradients of one fused loss recompute each chunk's logits once: per chunk one
/// logits GEMM, one row kernel, dx's rows and dw's share, and no buffer of the Plan
/// holds more than one chunk of logits.
#[test]
fn vocab_loss_gradients_share_one_lowering_and_one_chunk_of_logits() {
    let (rows, d, v, chunk): (usize, usize, usize, usize) = (2 * 10, 5, 300, 6);
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[2, 10, d]);
    let w = param(&mut g, "w", &[d, v]);
    let t = input(&mut g, "t", &[2, 10]);
    let dy = param(&mut g, "dy", &[]);
    for (wrt, name) in ["dx", "dw"].iter().enumerate() {
        let op = Op::LinearCrossEntropyGrad { trans_b: false, scale: 1.0, chunk, wrt };
        let grad = add(&mut g, op, &[x, w, t, dy]);
        g.set_output(name, grad);
    }
    let chunks = rows.div_ceil(chunk);
    for plan in both_partitions(&g, 1e-4, "vocab loss grads") {
        let gemms = gemms(&plan);
        assert_eq!(gemms.len(), 3 * chunks, "logits, dx and dw per chunk: {gemms:?}");
        assert_eq!(plan.kernels.len(), chunks, "one row kernel per chunk");
        let largest = plan.buffers.iter().map(|b| b.len).max().unwrap_or(0);
        assert_eq!(largest, chunk * v, "one chunk of logits is the largest buffer");
    }
}

#[test]
fn temporal_augment_and_its_gradients() {
    for gs in [false, true] {
        let build = |g: &mut Graph| {
            let out = param(g, "out", &[2, 6, 5]);
            let w1 = param(g, "w1", &[2, 5]);
            let w2 = param(g, "w2", &[4, 5]);
            (out, w1, w2)
        };
        case(&format!("temporal_augment gs {gs}"), 1e-5, |g| {
            let (o, w1, w2) = build(g);
            add(g, Op::TemporalAugment { gram_schmidt: gs, eps_rel: 1e-3 }, &[o, w1, w2])
        });
        for wrt in 0..3 {
            case(&format!("temporal_augment_grad {wrt} gs {gs}"), 1e-4, |g| {
                let (o, w1, w2) = build(g);
                let dy = param(g, "dy", &[2, 6, 2, 5]);
                add(g, Op::TemporalAugmentGrad { gram_schmidt: gs, eps_rel: 1e-3, wrt }, &[o, w1, w2, dy])
            });
        }
    }
}

/// The causal convolutions of the temporal augmentation and their input
/// gradient sum each channel's taps in strips held in variables where a row
/// is whole strips (64 channels at C = 128, 16 at C = 32), in a local row
/// otherwise (C = 20): all add the same taps in the same order from 0 as the
/// reference's f32 loop (docs/math.md §6.5), so without Gram–Schmidt the outputs
/// are its bits. Kernels of 12 taps over 14 tokens cover the truncated taps
/// at the start of each sequence.
#[test]
fn temporal_convolutions_give_the_reference_bits_in_strips_and_rows() {
    for c in [128, 32, 20] {
        let mut g = Graph::new();
        let out = param(&mut g, "out", &[2, 14, c]);
        let w1 = param(&mut g, "w1", &[4, c]);
        let w2 = param(&mut g, "w2", &[12, c]);
        let dy = param(&mut g, "dy", &[2, 14, 2, c]);
        let y = add(&mut g, Op::TemporalAugment { gram_schmidt: false, eps_rel: 1e-3 }, &[out, w1, w2]);
        g.set_output("y", y);
        let op = Op::TemporalAugmentGrad { gram_schmidt: false, eps_rel: 1e-3, wrt: 0 };
        let dout = add(&mut g, op, &[out, w1, w2, dy]);
        g.set_output("dout", dout);
        let sources = Sources::random(&g, &mut Rng::new(c as u64), 1.0, &|_, n| vec![0; n]);
        let request = Request::new(&g, Vec::new());
        let plan =
            check(&g, &sources, &request, &one_op_per_group(&g), 1e-5, &format!("convolutions, C = {c}"));
        let outs = common::emit::run_plan(&g, &plan, &sources);
        let want = ir::exec::run::<f32>(&g, &sources.values, &[y, dout]).expect("reference");
        for (name, id) in [("y", y), ("dout", dout)] {
            let buf = plan.find(&BufferRole::Output { name: name.into() }).expect("output buffer");
            let Value::Float(t) = &want[&id] else { panic!("{name} is a float") };
            let same = outs[buf.0].as_f32().iter().zip(&t.data).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "C = {c}: {name} differs from the reference's bits");
        }
    }
}

#[test]
fn fused_rms_norm_mul_add_chain_is_one_kernel() {
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[2, 3, 8]);
    let w = param(&mut g, "w", &[8]);
    let gate = param(&mut g, "gate", &[2, 3, 8]);
    let n = add(&mut g, Op::RmsNorm { eps: 1e-6 }, &[x, w]);
    let m = add(&mut g, Op::Binary(BinaryOp::Mul), &[n, gate]);
    let y = add(&mut g, Op::Binary(BinaryOp::Add), &[m, x]);
    g.set_output("y", y);
    let request = Request::new(&g, Vec::new());
    let sources = Sources::random(&g, &mut Rng::new(3), 1.0, &|_, n| vec![0; n]);
    let plan = check(&g, &sources, &request, &vec![vec![n, m, y]], 1e-5, "rms_norm chain");
    assert_eq!(plan.kernels.len(), 1, "one kernel for the chain");
    let k = &plan.kernels[0];
    assert_eq!(k.name, "g000_rms_norm_mul_add");
    assert_eq!(k.grid.items(), 6, "one item per token");
    assert_eq!(k.params.len(), 4, "x, w, gate in; y out: intermediates stay local");
}

/// Compiles `g` for both partitions, checks it against the reference, and
/// returns the two Plans.
fn both_partitions(g: &Graph, tol: f32, what: &str) -> [codegen::plan::Plan; 2] {
    let request = Request::new(g, Vec::new());
    let sources = Sources::random(g, &mut Rng::new(what.len() as u64), 1.0, &|_, n| vec![0; n]);
    [
        check(g, &sources, &request, &one_op_per_group(g), tol, &format!("{what} (one op per group)")),
        check(g, &sources, &request, &one_group(g), tol, &format!("{what} (one group)")),
    ]
}

fn gemms(plan: &codegen::plan::Plan) -> Vec<&codegen::plan::Gemm> {
    plan.steps
        .iter()
        .filter_map(|s| match s {
            codegen::plan::Step::Gemm(g) => Some(g),
            _ => None,
        })
        .collect()
}

fn kernels_ending(plan: &codegen::plan::Plan, suffix: &str) -> usize {
    plan.kernels.iter().filter(|k| k.name.ends_with(suffix)).count()
}

#[test]
fn weight_gradient_is_one_gemm_over_every_token() {
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[2, 3, 5, 4]);
    let dy = param(&mut g, "dy", &[2, 3, 5, 6]);
    let mm = add(&mut g, Op::MatMul { trans_a: true, trans_b: false }, &[x, dy]);
    let s1 = add(&mut g, Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[mm]);
    let s2 = add(&mut g, Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[s1]);
    g.set_output("dw", s2);
    for plan in both_partitions(&g, 1e-5, "weight gradient") {
        assert!(plan.kernels.is_empty(), "no emitted loops: {:?}", plan.kernels.iter().map(|k| &k.name));
        let [gemm] = gemms(&plan)[..] else { panic!("one GEMM, got {:?}", plan.steps) };
        assert_eq!((gemm.batch, gemm.m, gemm.n, gemm.k, gemm.trans_a), (1, 4, 6, 30, true));
    }
}

#[test]
fn attention_gradients_share_one_lowering() {
    for rope in [None, Some(10000.0)] {
        let mut g = Graph::new();
        let q = param(&mut g, "q", &[2, 24, 4, 4]);
        let k = param(&mut g, "k", &[2, 24, 2, 4]);
        let v = param(&mut g, "v", &[2, 24, 2, 4]);
        let d = param(&mut g, "d", &[2, 24, 4, 4]);
        for (wrt, name) in ["dq", "dk", "dv"].iter().enumerate() {
            let op = Op::CausalAttentionGrad { scale: 0.5, rope_base: rope, wrt };
            let grad = add(&mut g, op, &[q, k, v, d]);
            g.set_output(name, grad);
        }
        for plan in both_partitions(&g, 1e-4, &format!("attention grads rope {rope:?}")) {
            // 4 query blocks of 6 rows at T = 24 (codegen::emit::query_block_rows).
            assert_eq!(kernels_ending(&plan, "_softmax"), 4, "the softmax statistics once per query block");
            assert_eq!(kernels_ending(&plan, "_prep"), 1);
            // S, dP, dQ, dK, dV, each one GEMM per query block over its key prefix
            // (6, 12, 18, 24 keys), together 5/8 of the full 24×24 products' multiply-adds.
            let gemms = gemms(&plan);
            assert_eq!(gemms.len(), 5 * 4, "S, dP, dQ, dK, dV per block");
            let macs: usize = gemms.iter().map(|g| g.batch * g.m * g.n * g.k).sum();
            assert_eq!(macs, 5 * 8 * 24 * 24 * 4 * 5 / 8, "only the key prefix of each query block");
        }
    }
}

#[test]
fn temporal_augment_gradients_share_one_sweep() {
    let mut g = Graph::new();
    let out = param(&mut g, "out", &[2, 6, 5]);
    let w1 = param(&mut g, "w1", &[2, 5]);
    let w2 = param(&mut g, "w2", &[4, 5]);
    let dy = param(&mut g, "dy", &[2, 6, 2, 5]);
    for (wrt, name) in ["dout", "dw1", "dw2"].iter().enumerate() {
        let op = Op::TemporalAugmentGrad { gram_schmidt: true, eps_rel: 1e-3, wrt };
        let grad = add(&mut g, op, &[out, w1, w2, dy]);
        g.set_output(name, grad);
    }
    for plan in both_partitions(&g, 1e-4, "temporal augment grads") {
        assert_eq!(kernels_ending(&plan, "_sweep"), 1, "one Gram–Schmidt reverse sweep per token");
        assert_eq!(
            kernels_ending(&plan, "_dout") + kernels_ending(&plan, "_dw1") + kernels_ending(&plan, "_dw2"),
            3
        );
    }
}

#[test]
fn norm_project_is_a_gemm_and_a_row_kernel() {
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[2, 3, 12]);
    let w = param(&mut g, "w", &[12, 5]);
    let y = add(&mut g, Op::NormProject { eps: 1e-6, centered: 2 }, &[x, w]);
    g.set_output("y", y);
    for plan in both_partitions(&g, 1e-4, "norm_project gemm") {
        let [gemm] = gemms(&plan)[..] else { panic!("one GEMM, got {:?}", plan.steps) };
        assert_eq!((gemm.m, gemm.n, gemm.k), (6, 5, 12));
        assert_eq!(kernels_ending(&plan, "_rows"), 1);
    }
}

#[test]
fn weight_gradient_through_a_token_merging_reshape_is_one_gemm() {
    // Σ over tokens of per-token aᵀ·b, summed as a `[tokens, m·n]` view.
    let mut g = Graph::new();
    let x = param(&mut g, "x", &[2, 3, 5, 4]);
    let dy = param(&mut g, "dy", &[2, 3, 5, 6]);
    let mm = add(&mut g, Op::MatMul { trans_a: true, trans_b: false }, &[x, dy]);
    let flat = add(&mut g, Op::Reshape { shape: vec![6, 24] }, &[mm]);
    let s = add(&mut g, Op::Reduce { op: ReduceOp::Sum, axis: 0, keepdim: false }, &[flat]);
    g.set_output("dw", s);
    for plan in both_partitions(&g, 1e-5, "reshaped weight gradient") {
        assert!(plan.kernels.is_empty(), "no emitted loops: {:?}", plan.kernels.iter().map(|k| &k.name));
        let [gemm] = gemms(&plan)[..] else { panic!("one GEMM, got {:?}", plan.steps) };
        assert_eq!((gemm.batch, gemm.m, gemm.n, gemm.k, gemm.trans_a), (1, 4, 6, 30, true));
    }
}

#[test]
fn lone_reductions_are_blocked_and_exact() {
    // (input dims, axis, items of the blocked kernel): token reductions over
    // 16-column blocks, over blocks widened to 64 columns on the C target, and
    // to 32 where 64 would leave fewer than four items; a row reduction over
    // blocks of 8 rows.
    let cases: [(&[usize], usize, usize); 4] =
        [(&[64, 48], 0, 3), (&[64, 512], 0, 8), (&[40, 128], 0, 4), (&[16, 32], 1, 2)];
    for (dims, axis, items) in cases {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let mut g = Graph::new();
            let x = param(&mut g, "x", dims);
            let y = add(&mut g, Op::Reduce { op, axis, keepdim: false }, &[x]);
            g.set_output("y", y);
            // Same summation order as the reference: no rounding difference at all.
            for plan in both_partitions(&g, 0.0, &format!("blocked {op:?} {dims:?} axis {axis}")) {
                let [k] = &plan.kernels[..] else { panic!("one kernel, got {}", plan.kernels.len()) };
                assert_eq!(k.grid.items(), items, "{op:?} {dims:?} axis {axis}");
            }
        }
    }
}

#[test]
fn per_token_matmul_rows_match_the_reference() {
    // Small per-token products fused with a row op (emitted loops, not GEMMs):
    // a softmax over the product's rows gives items of whole rows, one over
    // each flattened `[m·n]` batch entry items of whole entries (op(b) staged
    // transposed for `trans_b`).
    for tb in [false, true] {
        for whole_entries in [false, true] {
            case(&format!("per-token matmul trans_b {tb} whole entries {whole_entries}"), 1e-5, |g| {
                let x = param(g, "a", &[6, 4, 5]);
                let y = param(g, "b", if tb { &[6, 3, 5] } else { &[6, 5, 3] });
                let m = add(g, Op::MatMul { trans_a: false, trans_b: tb }, &[x, y]);
                let rows = if whole_entries { add(g, Op::Reshape { shape: vec![6, 12] }, &[m]) } else { m };
                add(g, Op::Softmax, &[rows])
            });
        }
    }
}
