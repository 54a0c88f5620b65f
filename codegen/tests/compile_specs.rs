//! Whole models through `compile`: the specs in `specs/` shrunk to tiny sizes
//! (d_model 16, one layer, seq 8, batch 2), differentiated and simplified, then
//! compiled for the one-op partition and for `ir::passes::fuse`'s partition.
//! The loss, the logits and every parameter gradient from the Plan must match
//! the f32 reference executor. The same kernels in the CUDA dialect must
//! compile under NVRTC for sm_90 with no spills and no warnings.

mod common;

use codegen::compile::{compile, fused_partition, one_op_per_group, Request, Target};
use codegen::plan::{BufferId, BufferRole, Step};
use codegen::render::render_cuda;
use common::emit::{check, spec_training_graph, Rng, Sources};
use ir::graph::Graph;

const SPECS: [&str; 9] = [
    "residual",
    "mhc",
    "vwn-r4",
    "xhc",
    "mhc-lite",
    "wide-residual",
    "attn-residuals",
    "denseformer",
    "kromhc",
];

/// The spec at test size, lowered, with loss gradients for every parameter.
fn tiny_model(name: &str) -> (Graph, Request, usize) {
    model_of_width(name, 16)
}

/// The spec with `d_model`, one layer, seq 8, batch 2.
fn model_of_width(name: &str, d_model: usize) -> (Graph, Request, usize) {
    spec_training_graph(name, 2, 8, |spec| {
        spec.d_model = d_model;
        spec.layers = 1;
    })
}

#[test]
fn specs_match_the_reference_one_op_per_group() {
    for name in SPECS {
        let (graph, request, vocab) = tiny_model(name);
        let src = token_sources(&graph, vocab);
        let plan = check(&graph, &src, &request, &one_op_per_group(&graph), 2e-4, &format!("{name} one op"));
        assert!(plan.steps.len() > 20, "{name}: a whole model is many steps");
    }
}

#[test]
fn specs_match_the_reference_fused() {
    for name in SPECS {
        let (graph, request, vocab) = tiny_model(name);
        let src = token_sources(&graph, vocab);
        let partition = fused_partition(&graph, &request).unwrap_or_else(|e| panic!("{name}: {e}"));
        let fused = check(&graph, &src, &request, &partition, 2e-4, &format!("{name} fused"));
        let unfused = compile(&graph, &one_op_per_group(&graph), &request).expect("compiles");
        assert!(
            fused.kernels.len() < unfused.kernels.len(),
            "{name}: fusion gives fewer kernels ({} vs {})",
            fused.kernels.len(),
            unfused.kernels.len()
        );
    }
}

/// xHC at d_model 64 has a 16·64 = 1024-float state per token: the Cpu target
/// keeps its LayerNorm and gradient in one kernel per group, the Cuda target
/// (512 floats of per-thread scratch) splits them. Both must match the reference.
#[test]
fn per_target_scratch_limits_split_wide_rows_and_match_the_reference() {
    let (graph, request, vocab) = model_of_width("xhc", 64);
    let src = token_sources(&graph, vocab);
    let partition = fused_partition(&graph, &request).expect("fuses");
    let mut kernels = Vec::new();
    for target in [Target::Cpu, Target::Cuda] {
        let request = request.clone().for_target(target);
        let plan = check(&graph, &src, &request, &partition, 2e-4, &format!("xhc d64 {target:?}"));
        kernels.push(plan.kernels.len());
    }
    assert!(kernels[0] < kernels[1], "the Cuda target splits more: {kernels:?} kernels (Cpu, Cuda)");
}

/// Every attention of a two-layer model, forward and backward, reads one
/// RoPE table: the Plan computes it once and keeps it for all of them, and the
/// model still matches the reference.
#[test]
fn rope_table_is_computed_once_per_plan() {
    let (graph, request, vocab) = spec_training_graph("residual", 2, 8, |spec| {
        spec.d_model = 16;
        spec.layers = 2;
    });
    let src = token_sources(&graph, vocab);
    let partition = fused_partition(&graph, &request).expect("fuses");
    let plan = check(&graph, &src, &request, &partition, 2e-4, "residual two layers");
    let launches = |suffix: &str| {
        plan.steps
            .iter()
            .filter(
                |s| matches!(s, Step::Kernel { kernel, .. } if plan.kernels[*kernel].name.ends_with(suffix)),
            )
            .count()
    };
    assert_eq!(launches("_rope"), 1, "{:?}", plan.kernels.iter().map(|k| &k.name).collect::<Vec<_>>());
    assert_eq!(launches("_prep"), 4, "two layers' attention forward and backward");
}

/// On the GPU, token reductions of parameter gradients run one block per
/// output, the embedding gradient one thread per column and attention's
/// softmax one block per score row (the C dialect of the same kernels runs
/// here). At 256 tokens of width 64 all three forms are chosen, and the Plan
/// still matches the reference.
#[test]
fn gpu_reductions_scatters_and_softmax_match_the_reference() {
    for name in ["residual", "mhc"] {
        let (graph, request, vocab) = spec_training_graph(name, 2, 128, |spec| {
            spec.d_model = 64;
            spec.layers = 1;
        });
        let request = request.for_target(Target::Cuda);
        let src = token_sources(&graph, vocab);
        let partition = fused_partition(&graph, &request).expect("fuses");
        let plan = check(&graph, &src, &request, &partition, 2e-4, &format!("{name} cuda target"));
        let block_sums =
            plan.kernels.iter().filter(|k| k.grid.is_block() && k.name.ends_with("_sum")).count();
        assert!(block_sums > 0, "{name}: token sums as block reductions");
        let softmaxes: Vec<_> = plan
            .kernels
            .iter()
            .filter(|k| k.name.contains("_causal_attention") && k.name.ends_with("_softmax"))
            .collect();
        // 4 query blocks of 32 rows at T = 128 (codegen::emit::query_block_rows).
        assert_eq!(softmaxes.len(), 2 * 4, "{name}: forward and backward softmax per query block");
        assert!(softmaxes.iter().all(|k| k.grid.is_block()), "{name}: one block per score row");
        let scatters: Vec<_> = plan.kernels.iter().filter(|k| k.name.ends_with("_scatter_add")).collect();
        assert!(
            scatters.iter().any(|k| k.grid.items() == 64 && k.params.iter().any(|p| p.len == 256 * 64)),
            "{name}: the embedding gradient ([256, 64]) one thread per column: {:?}",
            scatters.iter().map(|k| (&k.name, k.grid)).collect::<Vec<_>>()
        );
    }
}

/// Layers lower to kernels that differ only in the names of their buffers and
/// variables: the Plan keeps one kernel per structure, so a deeper model has
/// more launches but no more kernels, and still matches the reference.
#[test]
fn layers_share_their_kernels() {
    let mut counts = Vec::new();
    for layers in [2, 3] {
        let (graph, request, vocab) = spec_training_graph("mhc", 2, 8, |spec| {
            spec.d_model = 16;
            spec.layers = layers;
        });
        let src = token_sources(&graph, vocab);
        let partition = fused_partition(&graph, &request).expect("fuses");
        let plan = check(&graph, &src, &request, &partition, 2e-4, &format!("mhc {layers} layers"));
        let launches = plan.steps.iter().filter(|s| matches!(s, Step::Kernel { .. })).count();
        counts.push((plan.kernels.len(), launches));
    }
    let [(kernels2, launches2), (kernels3, launches3)] = counts[..] else { unreachable!() };
    assert_eq!(kernels2, kernels3, "kernels of 2 and 3 layers");
    assert!(launches3 > launches2 && kernels3 < launches3 / 2, "{counts:?} (kernels, launches)");
}

/// Random token windows: a fresh generator per draw position keeps the values
/// deterministic without shared mutable state.
fn token_sources(graph: &Graph, vocab: usize) -> Sources {
    let mut rng = Rng::new(17);
    Sources::random(graph, &mut rng, 0.05, &|id, n| {
        let mut r = Rng::new(id.index() as u64 + 101);
        (0..n).map(|_| r.below(vocab) as i32).collect()
    })
}

#[test]
fn compiled_plans_are_deterministic() {
    let (graph, request, _) = tiny_model("xhc");
    let partition = fused_partition(&graph, &request).expect("fuses");
    let a = compile(&graph, &partition, &request).expect("compiles");
    let b = compile(&graph, &partition, &request).expect("compiles");
    assert_eq!(a, b);
    for k in &a.kernels {
        assert!(
            k.name.starts_with('g') && k.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{}",
            k.name
        );
    }
    // Scratch buffers start on 16-element (64-byte f32) boundaries, so an
    // arena with a cache-line-aligned base aligns every buffer.
    for d in &a.buffers {
        if let BufferRole::Scratch { offset } = d.role {
            assert_eq!(offset % 16, 0, "buffer {} at {offset}", d.id.0);
        }
    }
}

#[test]
fn cuda_dialect_compiles_under_nvrtc_without_spills() {
    if !codegen::nvrtc::is_available() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "NVRTC is required when CI=true");
        eprintln!("skipped: NVRTC is not loadable (put its lib folder on LD_LIBRARY_PATH)");
        return;
    }
    for name in SPECS {
        let (graph, request, _) = tiny_model(name);
        for (label, partition) in [
            ("one op", one_op_per_group(&graph)),
            ("fused", fused_partition(&graph, &request).expect("fuses")),
        ] {
            // With the optimizer update, as the runtime compiles training Plans.
            let request = request.clone().for_target(Target::Cuda).with_update();
            let plan = compile(&graph, &partition, &request).expect("compiles");
            assert!(
                plan.update_start.is_some_and(|s| s < plan.steps.len()),
                "{name}: the update is appended"
            );
            let src = render_cuda(&plan.kernels).expect("renders");
            let out =
                codegen::nvrtc::compile(&src, "sm_90").unwrap_or_else(|e| panic!("{name} {label}: {e}"));
            assert!(out.warnings().is_empty(), "{name} {label}: warnings {:?}", out.warnings());
            for k in &plan.kernels {
                let r = out
                    .resources_of(&k.symbol())
                    .unwrap_or_else(|| panic!("{name}: no report for {}", k.name));
                assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "{name} {label}: {} spills", k.name);
            }
        }
    }
}

/// The GPU training Plan of a sparse MoE spec (routing, capacity, a shared
/// expert): its kernels (the gathers and scatters around the grouped GEMMs
/// included) compile under NVRTC for sm_90 with no spills and no warnings.
#[test]
fn sparse_moe_cuda_dialect_compiles_under_nvrtc_without_spills() {
    if !codegen::nvrtc::is_available() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "NVRTC is required when CI=true");
        eprintln!("skipped: NVRTC is not loadable (put its lib folder on LD_LIBRARY_PATH)");
        return;
    }
    let (gate, shared, capacity) = SPARSE_CASES[3];
    let (graph, request, _) = sparse_moe(gate, shared, capacity);
    let request = request.for_target(Target::Cuda).with_update();
    let partition = fused_partition(&graph, &request).expect("fuses");
    let plan = compile(&graph, &partition, &request).expect("compiles");
    assert!(plan.steps.iter().any(|s| matches!(s, Step::GroupedGemm(_))));
    let src = render_cuda(&plan.kernels).expect("renders");
    let out = codegen::nvrtc::compile(&src, "sm_90").unwrap_or_else(|e| panic!("sparse moe: {e}"));
    assert!(out.warnings().is_empty(), "sparse moe: warnings {:?}", out.warnings());
    for k in &plan.kernels {
        let r = out.resources_of(&k.symbol()).unwrap_or_else(|| panic!("no report for {}", k.name));
        assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "sparse moe: {} spills", k.name);
    }
}

/// Whether `e` loads from the buffer `name`.
fn loads_from(e: &codegen::kernel::Expr, name: &str) -> bool {
    use codegen::kernel::Expr;
    match e {
        Expr::Load { src, index } => src.name() == name || loads_from(index, name),
        Expr::Unary { arg, .. } | Expr::Cast { arg, .. } => loads_from(arg, name),
        Expr::Binary { lhs, rhs, .. } | Expr::Cmp { lhs, rhs, .. } => {
            loads_from(lhs, name) || loads_from(rhs, name)
        }
        Expr::Select { cond, then, else_ } => [cond, then, else_].iter().any(|x| loads_from(x, name)),
        Expr::Call { args, .. } => args.iter().any(|x| loads_from(x, name)),
        _ => false,
    }
}

/// In program order, whether the first access of `stmts` to `name` is a
/// store (`Some(true)`), a load (`Some(false)`), or there is none.
fn first_access_is_store(stmts: &[codegen::kernel::Stmt], name: &str) -> Option<bool> {
    use codegen::kernel::Stmt;
    for s in stmts {
        let found = match s {
            Stmt::Let { expr, .. } | Stmt::Var { init: expr, .. } | Stmt::Assign { value: expr, .. } => {
                loads_from(expr, name).then_some(false)
            }
            Stmt::Store { target, index, value } | Stmt::AccumStore { target, index, value } => {
                if loads_from(index, name) || loads_from(value, name) {
                    Some(false)
                } else {
                    (target.name() == name).then_some(true)
                }
            }
            Stmt::For { start, end, body, .. } => {
                if loads_from(start, name) || loads_from(end, name) {
                    Some(false)
                } else {
                    first_access_is_store(body, name)
                }
            }
            Stmt::If { cond, then, else_ } => {
                if loads_from(cond, name) {
                    Some(false)
                } else {
                    match (first_access_is_store(then, name), first_access_is_store(else_, name)) {
                        (Some(false), _) | (_, Some(false)) => Some(false),
                        (Some(true), Some(true)) => Some(true),
                        (Some(true), None) | (None, Some(true)) => Some(false),
                        (None, None) => None,
                    }
                }
            }
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// A fused kernel's value that a later op of the same kernel reads back is
/// written by the item before the item reads it, and the cost counts it as
/// written only: those reads hit what the kernel just wrote.
#[test]
fn values_read_back_within_a_kernel_are_written_first_and_cost_no_reads() {
    use codegen::kernel::Access;
    let mut seen = 0;
    for name in SPECS {
        let (graph, request, _) = tiny_model(name);
        let partition = fused_partition(&graph, &request).expect("fuses");
        let plan = compile(&graph, &partition, &request).expect("compiles");
        for k in &plan.kernels {
            let mut read_bytes = 0;
            for p in &k.params {
                if p.access == Access::WriteThenRead {
                    seen += 1;
                    assert_eq!(
                        first_access_is_store(&k.body, &p.name),
                        Some(true),
                        "{name}: {} reads {} before writing it",
                        k.name,
                        p.name
                    );
                }
                if p.access.reads_memory() {
                    read_bytes += p.len * p.dtype.size_bytes();
                }
            }
            assert_eq!(k.param_bytes().0, read_bytes, "{name}: {}", k.name);
        }
    }
    assert!(seen > 0, "no fused kernel reads back a value it writes");
}

/// On the GPU, fused kernels over long rows get a warp per item where their
/// shape fits (`spread_over_lanes`). At the test width (64) and the GPU
/// bench's (768), every kernel of a GPU training Plan left
/// one thread per item was refused for its shape, never for a spread form
/// that failed validation (which the compiler would hide by keeping the
/// kernel as it was), and every spec has spread kernels.
#[test]
fn gpu_kernels_left_one_thread_per_item_were_refused_for_their_shape() {
    use codegen::kernel::{spread_over_lanes, Grid, SPREAD_LANES};
    for (name, width) in SPECS.into_iter().flat_map(|name| [(name, 64), (name, 768)]) {
        let (graph, request, _) = model_of_width(name, width);
        // Without the update, whose kernels have GPU forms of their own.
        let request = request.for_target(Target::Cuda);
        let partition = fused_partition(&graph, &request).expect("fuses");
        let plan = compile(&graph, &partition, &request).expect("compiles");
        let spread = plan
            .kernels
            .iter()
            .filter(|k| matches!(k.grid, Grid::BlockPerItem { threads: SPREAD_LANES, .. }))
            .count();
        assert!(spread > 0, "{name} at {width}: some kernels spread over lanes");
        for k in plan.kernels.iter().filter(|k| !k.grid.is_block()) {
            match spread_over_lanes(k) {
                Ok(None) => {}
                Ok(Some(_)) => panic!("{name} at {width}: {} fits but was not spread", k.name),
                Err(e) => panic!("{name} at {width}: {} spread into an invalid kernel: {e}", k.name),
            }
        }
    }
}

/// Each causal attention, forward and backward, gives the CPU Plan one chain
/// (`codegen::plan::Chain`) from its copy in to its last head-major product:
/// kernels and GEMMs over one entry per (batch, head), no two of the buffers
/// it touches sharing arena space (an entry's later step must not overwrite
/// what another entry's earlier step still reads). The GPU runs steps whole.
#[test]
fn attention_chains_span_the_head_major_steps_in_disjoint_buffers() {
    for name in SPECS {
        let (graph, request, _) = tiny_model(name);
        let partition = fused_partition(&graph, &request).unwrap_or_else(|e| panic!("{name}: {e}"));
        let plan = compile(&graph, &partition, &request).expect("compiles");
        assert_eq!(plan.chains.len(), 2, "{name}: one attention forward and one backward");
        for chain in &plan.chains {
            let steps = &plan.steps[chain.steps()];
            let kernel = |s: &Step| match s {
                Step::Kernel { kernel, .. } => Some(plan.kernels[*kernel].name.clone()),
                _ => None,
            };
            assert!(
                kernel(&steps[0]).is_some_and(|k| k.ends_with("_prep")),
                "{name}: starts with the copy in"
            );
            assert!(matches!(steps.last(), Some(Step::Gemm(_))), "{name}: ends with a product");
            assert!(steps.iter().filter_map(kernel).any(|k| k.ends_with("_softmax")), "{name}");
            let mut touched: Vec<BufferId> = steps
                .iter()
                .flat_map(|s| match s {
                    Step::Kernel { args, .. } => args.clone(),
                    Step::Gemm(g) => {
                        assert_eq!(g.batch, chain.entries, "{name}: one batch entry per chain entry");
                        vec![g.a, g.b, g.c]
                    }
                    Step::Zero { .. } | Step::MoeRoute(_) | Step::GroupedGemm(_) => {
                        panic!("{name}: no zeroing, routing or grouped product in a chain")
                    }
                })
                .collect();
            touched.sort();
            touched.dedup();
            let span = |id: &BufferId| match plan.buffers[id.0].role {
                BufferRole::Scratch { offset } => Some((offset, offset + plan.buffers[id.0].len)),
                _ => None,
            };
            let spans: Vec<(usize, usize)> = touched.iter().filter_map(span).collect();
            for (i, a) in spans.iter().enumerate() {
                for b in &spans[i + 1..] {
                    assert!(
                        a.1 <= b.0 || b.1 <= a.0,
                        "{name}: arena spans {a:?} and {b:?} overlap in a chain"
                    );
                }
            }
        }
        let cuda = compile(&graph, &partition, &request.clone().for_target(Target::Cuda)).expect("compiles");
        assert!(cuda.chains.is_empty(), "{name}: no chains on the GPU");
    }
}

/// A sparse MoE spec (docs/math.md §1.6) at test size: `moe.ron`'s model with the
/// given gate, shared experts and capacity factor, dispatch Sparse.
fn sparse_moe(
    gate: ir::spec::MoeGate,
    shared: usize,
    capacity_factor: Option<f64>,
) -> (Graph, Request, usize) {
    spec_training_graph("moe", 2, 8, |spec| {
        spec.d_model = 16;
        spec.layers = 1;
        spec.ffn = ir::spec::FfnSpec::Moe(ir::spec::MoeSpec {
            experts: 4,
            top_k: 2,
            shared,
            hidden: 8,
            gate,
            dispatch: ir::spec::MoeDispatch::Sparse,
            capacity_factor,
            balance: ir::spec::MoeBalance::None,
            renormalize: false,
        });
    })
}

/// The sparse MoE cases: softmax and sigmoid gates, with and without a shared
/// expert, dropless and with a capacity (0.5 of the even share: 4 rows per expert
/// for 16 tokens' 32 assignments, so some are dropped whatever the router).
const SPARSE_CASES: [(ir::spec::MoeGate, usize, Option<f64>); 4] = [
    (ir::spec::MoeGate::Softmax, 1, None),
    (ir::spec::MoeGate::Sigmoid, 0, None),
    (ir::spec::MoeGate::Softmax, 0, Some(0.5)),
    (ir::spec::MoeGate::Sigmoid, 1, Some(0.5)),
];

/// Sparse dispatch compiles to routing and grouped GEMM steps (one routing per
/// layer: its three outputs in one step) and the Plan's loss, logits and every
/// parameter gradient match the reference, one op per group and fused, with
/// kernels sized for either target.
#[test]
fn sparse_moe_plans_route_once_and_match_the_reference() {
    for (case, (gate, shared, capacity)) in SPARSE_CASES.into_iter().enumerate() {
        let what = format!("sparse moe {gate:?} shared {shared} capacity {capacity:?}");
        let (graph, request, vocab) = sparse_moe(gate, shared, capacity);
        let src = token_sources(&graph, vocab);
        let fused = fused_partition(&graph, &request).expect("fuses");
        // Fused for both targets; one op per group (the same steps, more kernels) once.
        let one_op = one_op_per_group(&graph);
        let runs = [("fused", &fused, Target::Cpu), ("fused", &fused, Target::Cuda)];
        let extra = (case == 0).then_some(("one op", &one_op, Target::Cpu));
        for (label, partition, target) in runs.into_iter().chain(extra) {
            let request = request.clone().for_target(target);
            let plan = check(&graph, &src, &request, partition, 2e-4, &format!("{what} {label} {target:?}"));
            let count = |f: fn(&Step) -> bool| plan.steps.iter().filter(|s| f(s)).count();
            assert_eq!(count(|s| matches!(s, Step::MoeRoute(_))), 1, "{what} {label}: one routing");
            // Forward W1, W3, W2; backward per weight its input gradient and its
            // weight gradient.
            assert_eq!(count(|s| matches!(s, Step::GroupedGemm(_))), 9, "{what} {label}");
        }
    }
}

/// The FLOPs a sparse MoE Plan reports for its grouped products (`kernels.tsv`, and
/// `widen bench`'s executed FLOPs) are the cost model's (`ir::cost::op_cost`) for the
/// graph nodes they run, forward and backward: 2·K·N per routed row, N·k rows when
/// dropless, at most experts · capacity with a capacity (docs/math.md §1.6, Cost), not
/// the experts × tokens of dense dispatch.
#[test]
fn grouped_products_report_the_flops_the_cost_model_counts() {
    use ir::graph::Op;
    // 16 tokens × top 2 = 32 rows dropless; a capacity factor of 0.5 keeps 4 rows for
    // each of the 4 experts, 16 rows.
    for (capacity, rows) in [(None, 32.0), (Some(0.5), 16.0)] {
        let (graph, request, _) = sparse_moe(ir::spec::MoeGate::Softmax, 1, capacity);
        let fused = fused_partition(&graph, &request).expect("fuses");
        let plan = compile(&graph, &fused, &request).expect("compiles");
        let reported: u64 = codegen::plan_report::step_costs(&plan)
            .iter()
            .filter(|c| c.kind == "grouped_gemm")
            .map(|c| c.flops)
            .sum();
        let counted: f64 = graph
            .node_ids()
            .into_iter()
            .filter(|&id| {
                matches!(graph.node(id).op, Op::GroupedMatMul { .. } | Op::GroupedMatMulGrad { .. })
            })
            .map(|id| ir::cost::op_cost(&graph, id).flops)
            .sum();
        // Closed form: three forward products of 2·rows·16·8 and, per weight, its input
        // gradient and its weight gradient (the same contraction).
        let closed = 9.0 * 2.0 * rows * 16.0 * 8.0;
        assert_eq!(counted, closed, "the cost model's count, capacity {capacity:?}");
        assert_eq!(
            reported as f64, counted,
            "the Plan reports what the cost model counts, capacity {capacity:?}"
        );
    }
}
