//! `widen compile SPEC -o DIR [--explain] [--batch B] [--seq-len T]`: everything the compiler produces
//! for one training step of a spec, as files to read and diff (docs/architecture.md §1,
//! §4–§6):
//!
//! | file          | contents                                                         |
//! |---------------|------------------------------------------------------------------|
//! | `graph.txt`   | the differentiated, simplified graph (canonical text dump)       |
//! | `graph.dot`   | the same graph as Graphviz DOT                                    |
//! | `fused.txt`   | the fusion groups in execution order, each with its nodes        |
//! | `fused.dot`   | the group graph: one box per kernel, edges are materialized values |
//! | `fusion.txt`  | why each group is what it is (`ir::passes::fuse` explain)         |
//! | `kernels.c`   | all kernels as one C translation unit (Cpu device)                |
//! | `kernels.cu`  | the same kernels in the CUDA dialect                              |
//! | `kernels.ptx` | PTX from NVRTC for sm_90, when NVRTC can be loaded (otherwise `kernels.ptx.txt` says why) |
//! | `plan.txt`    | the launch list with buffer names and sizes, and the arena size   |
//! | `kernels.tsv` | per step: bytes read and written, FLOPs, arithmetic intensity     |
//!
//! The folder also gets `.widen-compile`, which marks it as a compile's output:
//! files of these names in a folder without it are the user's, and compiling
//! there is refused unless `--force` is given.
//!
//! `plan.txt` and `kernels.tsv` come from `codegen::plan_report`, which says how bytes and
//! FLOPs are counted.

use anyhow::Context;
use codegen::plan_report::{kernels_tsv, plan_text};
use codegen::training::TrainingGraph;
use ir::graph::Graph;
use ir::passes::{FusedGraph, GroupKind};
use ir::spec::load_spec;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

/// The canonical node number (`%i` in dumps) of every node: its position in
/// the deterministic topological order, as `ir::graph::dump` numbers them.
fn numbering(graph: &Graph) -> HashMap<ir::graph::NodeId, usize> {
    graph.topo_order().into_iter().enumerate().map(|(i, id)| (id, i)).collect()
}

fn kind_name(kind: GroupKind) -> &'static str {
    match kind {
        GroupKind::Source => "source",
        GroupKind::Heavy(_) => "heavy",
        GroupKind::TokenLocal => "token-local",
        GroupKind::TokenReduction => "token-reduction",
    }
}

/// `fused.txt`: every group in execution order with its cost, inputs,
/// outputs and member nodes (the lines of `graph.txt`).
pub fn fused_text(graph: &Graph, fused: &FusedGraph) -> String {
    let index = numbering(graph);
    let text = ir::graph::to_text(graph);
    let lines: HashMap<usize, &str> = text
        .lines()
        .filter_map(|l| {
            let n = l.strip_prefix('%')?.split(' ').next()?.parse().ok()?;
            Some((n, l))
        })
        .collect();
    let refs = |ids: &[ir::graph::NodeId]| {
        ids.iter().map(|i| format!("%{}", index[i])).collect::<Vec<_>>().join(", ")
    };
    let mut out = String::new();
    for &gid in &fused.order {
        let g = fused.group(gid);
        let _ = writeln!(
            out,
            "{gid} {} tokens={} nodes={} flops={:.0} read={}B written={}B",
            kind_name(g.kind),
            g.tokens,
            g.nodes.len(),
            g.cost.flops + 0.0,
            g.cost.bytes_read,
            g.cost.bytes_written
        );
        let _ = writeln!(out, "  in:  {}", refs(&g.inputs));
        let _ = writeln!(out, "  out: {}", refs(&g.outputs));
        for id in &g.nodes {
            let _ = writeln!(out, "    {}", lines.get(&index[id]).copied().unwrap_or("?"));
        }
        out.push('\n');
    }
    out
}

/// `fused.dot`: one box per group; an edge per materialized value from the
/// group that writes it to each group that reads it.
pub fn fused_dot(graph: &Graph, fused: &FusedGraph) -> String {
    let index = numbering(graph);
    let mut out = String::from(
        "digraph fused {\n  rankdir=TB;\n  node [shape=box, style=filled, fontname=\"monospace\"];\n",
    );
    for &gid in &fused.order {
        let g = fused.group(gid);
        let color = match g.kind {
            GroupKind::Source => "lightyellow",
            GroupKind::Heavy(_) => "lightpink",
            GroupKind::TokenLocal => "lightblue",
            GroupKind::TokenReduction => "lightgrey",
        };
        let _ = writeln!(
            out,
            "  {gid} [label=\"{gid} {}\\n{} nodes, {} items\\n{} B in, {} B out\", fillcolor={color}];",
            kind_name(g.kind),
            g.nodes.len(),
            g.tokens,
            g.cost.bytes_read,
            g.cost.bytes_written
        );
    }
    for &gid in &fused.order {
        for input in &fused.group(gid).inputs {
            if let Some(from) = fused.group_of(*input) {
                let _ = writeln!(out, "  {from} -> {gid} [label=\"%{}\"];", index[input]);
            }
        }
    }
    out.push_str("}\n");
    out
}

#[derive(clap::Args)]
pub struct Args {
    /// Path to the RON spec.
    pub spec: PathBuf,
    /// Output folder (created if missing).
    #[arg(short, long)]
    pub out: PathBuf,
    /// Print the fusion decisions (one line per group) to stdout.
    #[arg(long)]
    pub explain: bool,
    /// Compile for this batch size instead of `train.batch`.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Compile for this sequence length instead of `train.seq_len`.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Overwrite files of these names in the output folder even when an
    /// earlier `widen compile` did not write them.
    #[arg(long)]
    pub force: bool,
}

/// Every file `widen compile` writes into its output folder.
const OUTPUTS: &[&str] = &[
    "graph.txt",
    "graph.dot",
    "fused.txt",
    "fused.dot",
    "fusion.txt",
    "kernels.c",
    "kernels.cu",
    "kernels.ptx",
    "kernels.ptx.txt",
    "plan.txt",
    "plan.cuda.txt",
    "kernels.tsv",
    MARKER,
];

/// Written first into the output folder: it marks the folder as one
/// `widen compile` wrote, whose files a later compile may replace.
const MARKER: &str = ".widen-compile";

/// Refuses an output folder where compiling would replace files an earlier
/// `widen compile` did not write (see README, "What widen guarantees": no command
/// overwrites a user's files unasked): the folder may be missing, hold none
/// of [`OUTPUTS`], or hold the [`MARKER`] of an earlier compile; `--force`
/// overrides. The spec itself is never overwritten.
fn check_out_dir(out: &std::path::Path, spec: &std::path::Path, force: bool) -> anyhow::Result<()> {
    if out.exists() && !out.is_dir() {
        anyhow::bail!("the output folder {} is a file; give a folder (-o DIR)", out.display());
    }
    let spec = std::fs::canonicalize(spec).ok();
    let existing: Vec<&str> = OUTPUTS.iter().copied().filter(|name| out.join(name).exists()).collect();
    if let Some(name) =
        existing.iter().find(|name| spec.is_some() && std::fs::canonicalize(out.join(name)).ok() == spec)
    {
        anyhow::bail!(
            "compiling into {} would overwrite the spec {name} with an output of the same name; \
             choose another output folder",
            out.display()
        );
    }
    if force || existing.is_empty() || out.join(MARKER).is_file() {
        return Ok(());
    }
    anyhow::bail!(
        "{} already holds {} that widen compile did not write; choose an empty or new output folder, \
         or pass --force to overwrite them",
        out.display(),
        existing.join(", ")
    )
}

/// The GPU architecture PTX is generated for (docs/architecture.md §6: sm_90).
const ARCH: &str = "sm_90";

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let spec = load_spec(&args.spec)?;
    check_out_dir(&args.out, &args.spec, args.force)?;
    let batch = args.batch.unwrap_or(spec.train.batch);
    let seq_len = args.seq_len.unwrap_or(spec.train.seq_len);
    let mut sized = spec.clone();
    (sized.train.batch, sized.train.seq_len) = (batch, seq_len);
    super::fits_this_machine(&sized)?;
    let lowered = ir::lower::lower(&spec, batch, seq_len)?;
    let training = TrainingGraph::new(lowered).context("differentiating the model graph")?;
    let graph = &training.graph;
    let roots: Vec<_> = training
        .request
        .outputs
        .iter()
        .map(|o| o.1)
        .chain(training.request.grads.iter().map(|g| g.1))
        .collect();
    let fused = ir::passes::fuse(graph, &roots).context("fusion")?;
    let plan = training.plan().context("compiling the plan")?;

    let out = &args.out;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let write = |name: &str, text: &str| {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    };
    // The marker first: a compile that stops part way leaves a folder the
    // next compile may still write into.
    write(MARKER, "written by widen compile; a later widen compile may replace the files of this folder\n")?;
    write("graph.txt", &ir::graph::to_text(graph))?;
    write("graph.dot", &ir::graph::to_dot(graph))?;
    write("fused.txt", &fused_text(graph, &fused))?;
    write("fused.dot", &fused_dot(graph, &fused))?;
    write("fusion.txt", &fused.explain())?;
    write("kernels.c", &codegen::render::render_c(&plan.kernels)?)?;
    // The GPU's Plan differs only in how wide rows split into kernels
    // (`codegen::compile::Target::local_limit`): plan.cuda.txt lists it, plan.txt and kernels.tsv
    // describe the Cpu one.
    let cuda_plan = training.plan_for(codegen::compile::Target::Cuda).context("compiling the GPU plan")?;
    let cuda = codegen::render::render_cuda(&cuda_plan.kernels)?;
    write("kernels.cu", &cuda)?;
    let ptx_note = if codegen::nvrtc::is_available() {
        let compiled = codegen::nvrtc::compile(&cuda, ARCH).context("NVRTC")?;
        write("kernels.ptx", &compiled.ptx)?;
        // The Cuda device's CUBIN of this Plan, into the kernel cache: a Cuda device
        // on an sm_90 GPU that shares the cache (WIDEN_CACHE_DIR) compiles nothing.
        let cache = codegen::cc::default_cache_dir();
        codegen::nvrtc::compile_cached(&cuda, ARCH, codegen::nvrtc::Output::Cubin, &cache)
            .context("NVRTC")?;
        format!("kernels.ptx ({ARCH})")
    } else {
        let note = "NVRTC could not be loaded, so no PTX was generated. Put the NVRTC library \
                    (pip package nvidia-cuda-nvrtc) on LD_LIBRARY_PATH and run again.\n";
        write("kernels.ptx.txt", note)?;
        "kernels.ptx.txt (NVRTC unavailable: no PTX)".into()
    };
    write("plan.txt", &plan_text(&plan))?;
    write("plan.cuda.txt", &plan_text(&cuda_plan))?;
    write("kernels.tsv", &kernels_tsv(&plan))?;

    if args.explain {
        print!("{}", fused.explain());
    }
    let groups = fused.groups.iter().filter(|g| g.kind != GroupKind::Source).count();
    eprintln!(
        "{}: {} nodes ({} product(s) over a broadcast state and {} sum(s) of its gradient taken at its own width, \
         {} vocabulary loss(es) fused with their projection in row chunks, \
         {} norm projection(s) split into statistic, GEMM and scaling, \
         {} token sum(s) summed within each token first, {} value(s) recomputed where read, \
         {} bytes less written and read), {} fusion groups, \
         {} kernels, {} steps; wrote graph.{{txt,dot}}, fused.{{txt,dot}}, fusion.txt, kernels.{{c,cu}}, \
         {ptx_note}, plan.txt, plan.cuda.txt, kernels.tsv to {}",
        spec.name,
        graph.node_count(),
        training.passes.broadcast_products.products,
        training.passes.broadcast_products.sums,
        training.passes.vocab_losses,
        training.passes.norm_projections,
        training.passes.token_sums,
        training.passes.remat.values,
        training.passes.remat.bytes_saved,
        groups,
        plan.kernels.len(),
        plan.steps.len(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
