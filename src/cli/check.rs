//! `widen check SPEC [--json] [--device D]`: validate a spec and print its cost report
//! (docs/architecture.md §8; the figures and their conventions are documented in `ir::cost`)
//! and the peak memory a training run of it is expected to hold on the device, counted
//! from the Plan it would run (`runtime::device::memory`, docs/performance.md, "Memory").
//!
//! Exit status 0 for a valid spec, 1 when the file cannot be read, is not RON, or
//! breaks validation rules. With `--json`, stdout is exactly one JSON object in both
//! cases: the report with `"valid": true`, or `{"valid": false, "errors": [...]}` with
//! one `{path, message}` per problem (`path` is the spec field, or `""` when the
//! problem is the file or its syntax, which also carry `line` and `col`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::train::DeviceArg;
use ir::cost::{cost_report, gib, recompute_activations, training_memory, CostReport, TrainingMemory};
use ir::lower::LowerError;
use ir::passes::fused_connection_traffic;
use ir::spec::{host_memory_bytes, ModelSpec, Recompute, SpecLoadError};
use runtime::device::memory::{self, Memory, PeakEstimate, Workload};
use runtime::device::Device;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// Path to the RON spec.
    pub spec: PathBuf,
    /// Print one machine-readable JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Set a spec field before checking, as `widen train --set` does (repeatable).
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub sets: Vec<String>,
    /// The device whose training memory is reported: its Plan's buffers and what
    /// the device holds beside them (the reference interpreter has no Plan: the
    /// closed-form estimate alone).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
}

/// One problem that makes the spec unusable.
struct Problem {
    /// Spec field path, or "" for the file itself.
    path: String,
    message: String,
    /// 1-based position in the file, when known.
    at: Option<(usize, usize)>,
}

/// Why the spec's data file would not be found by `widen train` run from here, if
/// it would not: a valid spec may name data that is elsewhere when it trains, so
/// this is a warning, not an error. Paths are relative to the working folder;
/// when the file is beside the spec instead, that is said.
fn data_warning(spec_path: &std::path::Path, data: &ir::spec::DataSpec) -> Option<String> {
    let path = match data {
        ir::spec::DataSpec::Text(path) => path,
        ir::spec::DataSpec::Tokens(tokens) => return token_data_warning(tokens),
        ir::spec::DataSpec::Synthetic(_) => return None,
    };
    let meta = std::fs::metadata(path);
    if meta.as_ref().is_ok_and(|m| m.is_file()) {
        return None;
    }
    let here = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| ".".into());
    let what = match meta {
        Ok(_) => "is not a regular file",
        Err(_) => "does not exist",
    };
    let mut text = format!(
        "train.data: Text(\"{path}\") {what} from the working folder {here}; `widen train` here would \
         fail (data paths are relative to the folder widen runs in, not the spec's folder)"
    );
    let beside = spec_path.parent().map(|d| d.join(path));
    if let Some(beside) = beside.filter(|b| b.is_file() && !std::path::Path::new(path).is_absolute()) {
        text.push_str(&format!(
            "; a file {} is beside the spec: run from there or give that path",
            beside.display()
        ));
    }
    Some(text)
}

/// Why `widen train` here could not open the spec's token shards (headers included), if
/// it could not; opening maps the files and reads their headers, no tokens.
fn token_data_warning(tokens: &ir::spec::TokenData) -> Option<String> {
    let mut patterns = vec![("train.data.train", &tokens.train)];
    patterns.extend(tokens.val.as_ref().map(|v| ("train.data.val", v)));
    for (field, pattern) in patterns {
        if let Err(e) = dataset::shard::ShardSet::open(pattern, tokens.dtype) {
            return Some(format!(
                "{field}: {e}; `widen train` here would fail (data paths are relative to the folder \
                 widen runs in, not the spec's folder)"
            ));
        }
    }
    None
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if std::fs::read_to_string(&args.spec).is_ok_and(|text| sweep::file::is_sweep_file(&text)) {
        let message = format!(
            "{} is a sweep file, not a spec; `widen sweep {} --dry-run` validates every point of it",
            args.spec.display(),
            args.spec.display()
        );
        return Ok(fail(&args, &[Problem { path: String::new(), message, at: None }]));
    }
    let spec = match super::train::load_spec_with_sets(&args.spec, &args.sets) {
        Ok(spec) => spec,
        Err(err) => return Ok(fail(&args, &load_problems(err))),
    };
    if let Some(warning) = data_warning(&args.spec, &spec.train.data) {
        eprintln!("warning: {warning}");
    }
    // Validation refuses only what no machine holds; before lowering (which allocates
    // parameter inits) the estimate must also fit this machine (README, "What widen guarantees"). Where the
    // memory cannot be read the estimate is still printed.
    // The closed form first; where it alone would refuse, the Plan's expected peak
    // decides (`runtime::device::memory::check_fits`).
    let fits = host_memory_bytes().map(|bytes| memory::check_fits(&spec, bytes, Device::from(args.device)));
    if let Some(Err(e)) = fits {
        return Ok(fail(&args, &[Problem { path: e.path, message: e.message, at: None }]));
    }
    let memory = training_memory(&spec);
    let report = match cost_report(&spec) {
        Ok(report) => report,
        Err(LowerError::Invalid(errors)) => {
            let problems: Vec<Problem> =
                errors.into_iter().map(|e| Problem { path: e.path, message: e.message, at: None }).collect();
            return Ok(fail(&args, &problems));
        }
        Err(err) => {
            let problem =
                Problem { path: String::new(), message: format!("cannot lower the spec: {err}"), at: None };
            return Ok(fail(&args, &[problem]));
        }
    };
    // The spec fits (refused above otherwise): the Plan the device would run is cheap
    // to build, and its buffers are what it allocates.
    let device = Device::from(args.device);
    let peak = match memory::expected_training_peak(&spec, device, Workload::Train) {
        Ok(peak) => Some(peak),
        Err(memory::EstimateError::NoPlan) => None,
        Err(e) => {
            eprintln!("warning: no Plan-based memory estimate ({e}); the closed-form estimate is shown");
            None
        }
    };
    if let (Some(peak), Some(available), Device::Cpu) = (&peak, host_memory_bytes(), device) {
        if peak.bytes > available {
            eprintln!(
                "warning: training is expected to need {:.2} GiB at its peak, more than this machine's {:.2} GiB",
                memory::gib(peak.bytes),
                memory::gib(available)
            );
        }
    }
    // Fused-kernel traffic next to the unfused count (docs/architecture.md §8): the same batch-1
    // graph, partitioned by the fusion pass.
    let fused = FusedTraffic {
        this: fused_connection_traffic(&spec)?,
        residual: fused_connection_traffic(&spec.with_plain_residual())?,
    };
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        if let Value::Object(map) = &mut value {
            map.insert("valid".into(), Value::Bool(true));
            map.insert(
                "fused_traffic_per_sublayer".into(),
                json!({ "read": fused.this.0, "write": fused.this.1 }),
            );
            map.insert("training_memory".into(), serde_json::to_value(memory)?);
            map.insert("expected_peak".into(), serde_json::to_value(&peak)?);
            let choices: Vec<Value> = recompute_activations(&spec)
                .into_iter()
                .map(|(r, bytes)| json!({ "recompute": recompute_name(r), "activation_bytes": bytes }))
                .collect();
            map.insert("recompute_activations".into(), Value::Array(choices));
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        let memory_lines = format!("{}\n{}", memory_line(&memory, peak.as_ref()), recompute_line(&spec));
        print!("{}", table(&args.spec, &report, &fused, &memory_lines));
    }
    Ok(ExitCode::SUCCESS)
}

/// Flattens a load error into problems: every validation error and every unknown name.
fn load_problems(err: SpecLoadError) -> Vec<Problem> {
    match err {
        SpecLoadError::Io { ref source, .. } => {
            vec![Problem { path: String::new(), message: format!("{err}: {source}"), at: None }]
        }
        SpecLoadError::Syntax { path, line, col, message } => {
            vec![Problem {
                path: String::new(),
                message: format!("{path}:{line}:{col}: {message}"),
                at: Some((line, col)),
            }]
        }
        SpecLoadError::UnknownNames { names, .. } => names
            .into_iter()
            .map(|n| Problem { path: n.path, message: n.message, at: Some((n.line, n.col)) })
            .collect(),
        SpecLoadError::Invalid { errors, .. } => {
            errors.into_iter().map(|e| Problem { path: e.path, message: e.message, at: None }).collect()
        }
    }
}

/// Reports the problems (JSON on stdout, or one `error:` line each on stderr).
fn fail(args: &Args, problems: &[Problem]) -> ExitCode {
    if args.json {
        let errors: Vec<Value> = problems
            .iter()
            .map(|p| {
                let mut e = json!({ "path": p.path, "message": p.message });
                if let (Some((line, col)), Value::Object(map)) = (p.at, &mut e) {
                    map.insert("line".into(), json!(line));
                    map.insert("col".into(), json!(col));
                }
                e
            })
            .collect();
        let out = json!({ "valid": false, "spec": args.spec.display().to_string(), "errors": errors });
        println!("{out}");
    } else {
        for p in problems {
            let at = match p.at {
                Some((line, col)) if !p.path.is_empty() => format!(" ({}:{line}:{col})", args.spec.display()),
                _ => String::new(),
            };
            if p.path.is_empty() {
                eprintln!("error: {}", p.message);
            } else {
                eprintln!("error: {}: {}{at}", p.path, p.message);
            }
        }
    }
    ExitCode::FAILURE
}

/// The human-readable report.
/// Fused connection traffic per sublayer, (read, write) in units of D, for the spec
/// and for its plain-residual baseline.
struct FusedTraffic {
    this: (f64, f64),
    residual: (f64, f64),
}

/// The `training` line: the Plan-based peak with its parts where there is
/// one, else the closed-form estimate's.
fn memory_line(closed: &TrainingMemory, peak: Option<&PeakEstimate>) -> String {
    let closed_form = format!(
        "{:.2} GiB weights, gradients and moments, {:.2} GiB activations",
        gib(closed.param_bytes),
        gib(closed.activation_bytes)
    );
    let Some(peak) = peak else {
        return format!(
            "  training  about {:.2} GiB per step: {closed_form} (closed-form estimate)",
            gib(closed.total_bytes)
        );
    };
    let plan = format!("{} Plan", peak.device);
    match peak.device {
        "cuda" => format!(
            "  training  about {:.2} GiB per step on the GPU: {}; on the host {:.2} GiB: {} ({plan}; \
             closed-form estimate {:.2} GiB)",
            memory::gib(peak.bytes),
            peak.parts_text(Memory::Gpu),
            memory::gib(peak.host_bytes),
            peak.parts_text(Memory::Host),
            gib(closed.total_bytes)
        ),
        _ => format!(
            "  training  about {:.2} GiB per step: {} ({plan}; closed-form estimate {:.2} GiB)",
            memory::gib(peak.bytes),
            peak.parts_text(Memory::Host),
            gib(closed.total_bytes)
        ),
    }
}

/// Bytes as GiB, or MiB below one GiB (small specs differ in the MiB).
fn size(bytes: f64) -> String {
    if gib(bytes) >= 1.0 {
        format!("{:.2} GiB", gib(bytes))
    } else {
        format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
    }
}

/// `train.recompute` as the spec writes it.
fn recompute_name(r: Recompute) -> String {
    match r {
        Recompute::None => "None".into(),
        Recompute::Stream => "Stream".into(),
        Recompute::Block(l) => format!("Block({l})"),
    }
}

/// The `recompute` line: the closed form's activations under each recompute
/// choice (docs/math.md §4.5), the spec's own marked.
fn recompute_line(spec: &ModelSpec) -> String {
    let choices: Vec<String> = recompute_activations(spec)
        .into_iter()
        .map(|(r, bytes)| {
            let this = if r == spec.train.recompute { " (this spec)" } else { "" };
            format!("{} {}{this}", recompute_name(r), size(bytes))
        })
        .collect();
    format!("  recompute activations by train.recompute: {} (closed-form estimate)", choices.join(", "))
}

fn table(path: &Path, r: &CostReport, fused: &FusedTraffic, memory_line: &str) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(format!("{}: {} is valid", path.display(), r.name));
    line(format!("  scheme    {}", r.scheme));
    line(format!(
        "  backbone  D = {}, L = {}, V = {}; counted on the graph at batch 1, T = {}",
        r.d_model, r.layers, r.vocab, r.seq_len
    ));
    line(memory_line.to_string());
    line(String::new());

    let p = &r.params;
    let share = |x: u64| if p.total == 0 { 0.0 } else { 100.0 * x as f64 / p.total as f64 };
    line(format!("{:<30}{:>16}{:>9}", "parameters", "count", "share"));
    for (name, x) in
        [("embedding", p.embedding), ("backbone", p.backbone), ("connection", p.connection), ("mtp", p.mtp)]
    {
        line(format!("  {name:<28}{:>16}{:>8.2}%", grouped(x), share(x)));
    }
    line(format!(
        "  {:<28}{:>16}{:>9}   residual {} ({})",
        "total",
        grouped(p.total),
        "",
        grouped(r.baseline.params),
        percent(r.overhead_vs_residual.params)
    ));
    if p.active != p.total {
        // Routed experts: a token runs top_k of them (docs/math.md §1.6).
        line(format!("  {:<28}{:>16}{:>8.2}%", "active per token", grouped(p.active), share(p.active)));
    }
    line(String::new());

    let o = &r.overhead_vs_residual;
    let b = &r.baseline;
    line(format!("{:<30}{:>16}{:>16}{:>12}", "per token", "this", "residual", "overhead"));
    line(format!(
        "  {:<28}{:>16}{:>16}{:>12}",
        "forward FLOPs",
        si(r.flops_per_token.forward as f64),
        si(b.flops_forward as f64),
        percent(o.flops)
    ));
    line(format!(
        "  {:<28}{:>16}{:>16}{:>12}",
        "train FLOPs (3 x forward)",
        si(r.flops_per_token.train as f64),
        si(3.0 * b.flops_forward as f64),
        percent(o.flops)
    ));
    line(format!(
        "  {:<28}{:>16}{:>16}{:>12}",
        "activation bytes (f32)",
        grouped(r.activation_bytes_per_token),
        grouped(b.activation_bytes_per_token),
        percent(o.activation)
    ));
    line(String::new());

    let d = r.d_model as f64;
    let t = &r.traffic_per_sublayer;
    let paper = |x: Option<f64>| x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
    line(format!(
        "{:<30}{:>16}{:>16}{:>12}{:>10}",
        "per sublayer, units of D", "this", "residual", "overhead", "paper"
    ));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "connection FLOPs (papers')",
        r.connection_flops_per_sublayer_d,
        b.connection_flops / d,
        "",
        paper(r.paper.connection_flops_per_sublayer_d)
    ));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "connection FLOPs (all ops)",
        r.connection_flops_per_sublayer_all_ops / d,
        b.connection_flops_all_ops / d,
        "",
        ""
    ));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "traffic read",
        t.read,
        b.traffic_read,
        "",
        paper(r.paper.traffic_read)
    ));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "traffic write",
        t.write,
        b.traffic_write,
        "",
        paper(r.paper.traffic_write)
    ));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "traffic read + write",
        t.total,
        b.traffic_read + b.traffic_write,
        percent(o.traffic),
        ""
    ));
    line(format!("  {:<28}{:>16}", "traffic bytes", grouped(t.bytes.round() as u64)));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "fused traffic read", fused.this.0, fused.residual.0, "", ""
    ));
    line(format!(
        "  {:<28}{:>16.2}{:>16.2}{:>12}{:>10}",
        "fused traffic write", fused.this.1, fused.residual.1, "", ""
    ));
    line(format!(
        "  {:<28}{:>16}{:>16}{:>12}{:>10}",
        "connection params / block",
        grouped(r.connection_params_per_block.round() as u64),
        grouped(b.connection_params_per_block.round() as u64),
        "",
        r.paper.connection_params_per_block.map(|v| grouped(v.round() as u64)).unwrap_or_else(|| "-".into())
    ));
    line(String::new());
    line(format!(
        "papers' = contractions at 2 FLOPs per MAC and norms at 4 per element (docs/math.md §5.9); \
         paper = closed form of {}",
        r.paper.source
    ));
    out
}

/// 1234567 -> "1,234,567".
fn grouped(x: u64) -> String {
    let digits = x.to_string();
    let mut groups = Vec::new();
    let mut end = digits.len();
    while end > 3 {
        groups.push(&digits[end - 3..end]);
        end -= 3;
    }
    groups.push(&digits[..end]);
    groups.reverse();
    groups.join(",")
}

/// 12_345_678 -> "12.35 M".
fn si(x: f64) -> String {
    let units = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (scale, unit) in units {
        if x >= scale {
            return format!("{:.2} {unit}", x / scale);
        }
    }
    format!("{x:.0}")
}

/// 0.1234 -> "+12.34%".
fn percent(ratio: f64) -> String {
    format!("{:+.2}%", 100.0 * ratio)
}
