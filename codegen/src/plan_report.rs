//! Reports of a [`Plan`], for readers and for the benchmarks: `plan.txt` (the buffers and the
//! launch list), each step's cost ([`StepCost`]: bytes read and written, FLOPs) and
//! `kernels.tsv`, the table of those costs. A roofline divides the step costs by a host's
//! ceilings (`runtime::device::ceilings`); `widen compile` writes the files and `widen bench`
//! reads the costs, both through these functions.
//!
//! Bytes follow the fusion contract (every kernel reads each input buffer once and writes each
//! output once: docs/architecture.md §5), so they are the buffer sizes of its parameters. FLOPs
//! count float arithmetic and math calls of the kernel IR per item, times loop trip counts and
//! items; loops whose bounds are not compile-time literals count once and mark the row as a
//! lower bound ([`StepCost::exact`]).

use crate::kernel::{Access, Grid, Kernel};
use crate::plan::{BufferDecl, BufferId, BufferRole, GroupedForm, Plan, Step};
use std::fmt::Write as _;

fn role_text(d: &BufferDecl) -> String {
    match &d.role {
        BufferRole::Param { name } => format!("param {name}"),
        BufferRole::Grad { name } => format!("grad {name}"),
        BufferRole::Input { name } => format!("input {name}"),
        BufferRole::Output { name } => format!("output {name}"),
        BufferRole::Constant { value } => format!("constant {value}"),
        BufferRole::OptState { name } => format!("optimizer state {name}"),
        BufferRole::Scratch { offset } => format!("scratch @{offset}"),
    }
}

/// `b<id>` plus, for a buffer that holds a graph value, its node number.
fn buffer_name(d: &BufferDecl) -> String {
    match d.node {
        Some(n) => format!("b{}(%{n})", d.id.0),
        None => format!("b{}", d.id.0),
    }
}

/// `plan.txt`: the buffers (role, type, length), then the launch list, its
/// chains marked (`codegen::plan::Chain`).
pub fn plan_text(plan: &Plan) -> String {
    let mut out = String::new();
    let persistent: usize =
        plan.buffers.iter().filter(|b| !matches!(b.role, BufferRole::Scratch { .. })).map(buffer_bytes).sum();
    let _ = writeln!(
        out,
        "{} kernels, {} steps, {} buffers; persistent {} bytes, arena {} elements ({} bytes as f32)\n",
        plan.kernels.len(),
        plan.steps.len(),
        plan.buffers.len(),
        persistent,
        plan.arena_len,
        plan.arena_len * 4
    );
    out.push_str("buffers:\n");
    for d in &plan.buffers {
        let _ = writeln!(out, "  {:<14} {}[{}]  {}", buffer_name(d), d.dtype, d.len, role_text(d));
    }
    out.push_str("\nsteps:\n");
    let name = |id: BufferId| plan.buffers.get(id.0).map_or(format!("b{}?", id.0), buffer_name);
    for (i, step) in plan.steps.iter().enumerate() {
        let line = match step {
            Step::Kernel { kernel, args } => {
                let k = &plan.kernels[*kernel];
                let args: Vec<String> = k
                    .params
                    .iter()
                    .zip(args)
                    .map(|(p, a)| {
                        let mode = match p.access {
                            Access::Read => "",
                            Access::Write => "out ",
                            Access::ReadWrite => "inout ",
                            Access::WriteThenRead => "out+reread ",
                        };
                        format!("{}={mode}{}", p.name, name(*a))
                    })
                    .collect();
                format!("kernel {} {} ({})", k.name, grid_text(&k.grid), args.join(", "))
            }
            Step::Gemm(g) => format!(
                "gemm {}{} = {}{} @ {}{}  batch={} m={} n={} k={} strides=({}, {}, {})",
                name(g.c),
                if g.accumulate { " +" } else { "" },
                name(g.a),
                transposed(g.trans_a),
                name(g.b),
                transposed(g.trans_b),
                g.batch,
                g.m,
                g.n,
                g.k,
                g.stride_a,
                g.stride_b,
                g.stride_c
            ),
            Step::Zero { buffer } => format!("zero {}", name(*buffer)),
            Step::MoeRoute(r) => format!(
                "moe_route rows={} tokens={} counts={} = route({})  assignments={} k={} experts={} capacity={}",
                name(r.rows),
                name(r.tokens),
                name(r.counts),
                name(r.idx),
                r.assignments,
                r.k,
                r.experts,
                r.capacity.map_or("none".into(), |c| c.to_string())
            ),
            // Per group e (the rows `e` of `counts`): the forward product, or the
            // weight gradient summed over the group's rows.
            Step::GroupedGemm(g) => {
                let (a, b, c) = (name(g.a), name(g.b), name(g.c));
                let product = match (g.form, g.trans_b) {
                    (GroupedForm::Rows, t) => format!("grouped_gemm {c}[e] = {a}[e] @ {b}[e]{}", transposed(t)),
                    (GroupedForm::WeightGrad, false) => format!("grouped_gemm_grad {c}[e] = {a}[e]^T @ {b}[e]"),
                    (GroupedForm::WeightGrad, true) => format!("grouped_gemm_grad {c}[e] = {b}[e]^T @ {a}[e]"),
                };
                format!("{product}  by counts {}  groups={} m={} n={} k={}", name(g.counts), g.groups, g.m, g.n, g.k)
            }
        };
        // A chain's steps are marked: the Cpu device runs them entry by entry.
        let mark = match plan.chains.iter().find(|c| c.steps().contains(&i)) {
            Some(c) if c.start == i => format!("  [chain of {} entries to step {}]", c.entries, c.end - 1),
            Some(_) => "  [chain]".into(),
            None => String::new(),
        };
        let _ = writeln!(out, "  {i:>4}  {line}{mark}");
    }
    out
}

fn transposed(t: bool) -> &'static str {
    if t {
        "^T"
    } else {
        ""
    }
}

fn buffer_bytes(d: &BufferDecl) -> usize {
    d.len * d.dtype.size_bytes()
}

fn grid_text(grid: &Grid) -> String {
    match *grid {
        Grid::ThreadPerItem { n, .. } => format!("[{n} items]"),
        Grid::BlockPerItem { n, threads } => format!("[{n} items x {threads} lanes]"),
    }
}

/// What one Plan step costs, counted before it runs: one row of `kernels.tsv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepCost {
    /// Index in [`Plan::steps`].
    pub step: usize,
    /// `kernel`, `gemm`, `zero`, `route` or `grouped_gemm`.
    pub kind: &'static str,
    /// The kernel's name, the GEMM's `MxNxK` (a grouped GEMM's over all its rows,
    /// `groups:MxNxK`), the zeroed buffer, or the routing's `assignments/experts`.
    pub name: String,
    /// Grid items (kernels), the batch (GEMMs), the groups (grouped GEMMs), 1 (zero,
    /// routing).
    pub items: usize,
    /// Bytes read and written.
    pub read: usize,
    pub written: usize,
    pub flops: u64,
    /// False where a loop bound is not a compile-time literal: `flops` is then a lower bound.
    pub exact: bool,
}

impl StepCost {
    /// Bytes moved: read plus written.
    pub fn bytes(&self) -> u64 {
        (self.read + self.written) as u64
    }
}

fn kernel_cost(k: &Kernel) -> (usize, usize, u64, bool) {
    let (read, written) = k.param_bytes();
    let (flops, exact) = k.flops();
    (read, written, flops, exact)
}

/// Every step's [`StepCost`], in launch order.
pub fn step_costs(plan: &Plan) -> Vec<StepCost> {
    let size = |id: BufferId| plan.buffers.get(id.0).map_or(0, buffer_bytes);
    plan.steps
        .iter()
        .enumerate()
        .map(|(step, s)| match s {
            Step::Kernel { kernel, .. } => {
                let k = &plan.kernels[*kernel];
                let (read, written, flops, exact) = kernel_cost(k);
                StepCost {
                    step,
                    kind: "kernel",
                    name: k.name.clone(),
                    items: k.grid.items(),
                    read,
                    written,
                    flops,
                    exact,
                }
            }
            Step::Gemm(g) => {
                let per = |n: usize| n * 4 * g.batch;
                let c = per(g.m * g.n);
                let read = per(g.m * g.k).min(size(g.a)) + per(g.k * g.n).min(size(g.b));
                StepCost {
                    step,
                    kind: "gemm",
                    name: format!("{}x{}x{}", g.m, g.n, g.k),
                    items: g.batch,
                    read: read + if g.accumulate { c } else { 0 },
                    written: c,
                    flops: (2 * g.batch * g.m * g.n * g.k) as u64,
                    exact: true,
                }
            }
            Step::Zero { buffer } => StepCost {
                step,
                kind: "zero",
                name: plan.buffers.get(buffer.0).map_or_else(String::new, buffer_name),
                items: 1,
                read: 0,
                written: size(*buffer),
                flops: 0,
                exact: true,
            },
            Step::MoeRoute(r) => StepCost {
                step,
                kind: "route",
                name: format!("{}/{}", r.assignments, r.experts),
                items: 1,
                read: 4 * r.assignments,
                written: 4 * (2 * r.assignments + r.experts),
                flops: 0,
                exact: true,
            },
            // The rows the routing can keep: every row when dropless, at most experts ·
            // capacity with a capacity, as the cost model counts them (docs/math.md §1.6,
            // Cost). Every expert's weights are read once.
            Step::GroupedGemm(g) => {
                let elem = |id: BufferId| plan.buffers.get(id.0).map_or(4, |d| d.dtype.size_bytes());
                let [a, b, c] = g.extents().unwrap_or([0; 3]);
                StepCost {
                    step,
                    kind: "grouped_gemm",
                    name: format!("{}:{}x{}x{}", g.groups, g.m, g.n, g.k),
                    items: g.groups,
                    read: a * elem(g.a) + b * elem(g.b) + 4 * g.groups,
                    written: c * 4,
                    flops: (2 * g.routed * g.n * g.k) as u64,
                    exact: true,
                }
            }
        })
        .collect()
}

/// `kernels.tsv`: one row per step, then a total row.
pub fn kernels_tsv(plan: &Plan) -> String {
    let rows = step_costs(plan);
    let mut out =
        String::from("step\tkind\tname\titems\tbytes_read\tbytes_written\tflops\tflops_per_byte\texact\n");
    let intensity = |f: u64, r: usize, w: usize| f as f64 / (r + w).max(1) as f64;
    for r in &rows {
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{:.3}\t{}",
            r.step,
            r.kind,
            r.name,
            r.items,
            r.read,
            r.written,
            r.flops,
            intensity(r.flops, r.read, r.written),
            r.exact
        );
    }
    let (read, written) = (rows.iter().map(|r| r.read).sum(), rows.iter().map(|r| r.written).sum());
    let flops = rows.iter().map(|r| r.flops).fold(0u64, u64::saturating_add);
    let exact = rows.iter().all(|r| r.exact);
    let _ = writeln!(
        out,
        "total\t-\t-\t-\t{read}\t{written}\t{flops}\t{:.3}\t{exact}",
        intensity(flops, read, written)
    );
    out
}
