//! `widen compile` and `widen bench` as a user runs them.

mod common;

use common::{spec_file as spec, stderr, widen};
use std::path::Path;

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn compile_writes_dumps_kernels_and_plan() {
    let dir = common::workdir("compile-compile", None);
    let o = widen(&dir, &["compile", &spec("mhc.ron"), "-o", "out", "--explain"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = dir.join("out");

    // The graph before fusion: canonical dump with the interface outputs, and DOT.
    let graph = read(&out, "graph.txt");
    assert!(graph.lines().any(|l| l.starts_with("output loss = %")), "graph.txt names the loss");
    assert!(graph.contains("sinkhorn"), "mHC's Sinkhorn projection is in the graph");
    assert!(read(&out, "graph.dot").starts_with("digraph widen {"));

    // Fusion: every explained group appears in fused.txt and fused.dot, and
    // --explain printed exactly fusion.txt.
    let fusion = read(&out, "fusion.txt");
    assert_eq!(String::from_utf8_lossy(&o.stdout), fusion);
    let (fused, dot) = (read(&out, "fused.txt"), read(&out, "fused.dot"));
    for line in fusion.lines() {
        let gid = line.split(' ').next().unwrap();
        assert!(fused.lines().any(|l| l.starts_with(&format!("{gid} "))), "{gid} missing from fused.txt");
        assert!(dot.contains(&format!("  {gid} [label=")), "{gid} missing from fused.dot");
    }
    assert!(fusion.contains("token-local"), "mHC has token-local groups");

    // Kernels: every kernel the plan launches is defined in both dialects.
    // kernels.c holds the Cpu Plan's kernels (plan.txt), kernels.cu the GPU Plan's
    // (plan.cuda.txt), which may split wide rows into more kernels.
    let (plan, c, cu) = (read(&out, "plan.txt"), read(&out, "kernels.c"), read(&out, "kernels.cu"));
    let launched_by = |plan: &str| -> Vec<String> {
        plan.lines()
            .filter_map(|l| {
                l.trim_start()
                    .split_once("  kernel ")
                    .map(|(_, rest)| rest.split(' ').next().unwrap().to_string())
            })
            .collect()
    };
    let (launched, launched_cuda) = (launched_by(&plan), launched_by(&read(&out, "plan.cuda.txt")));
    assert!(!launched.is_empty() && !launched_cuda.is_empty(), "both plans list kernel steps");
    for k in &launched {
        assert!(c.contains(&format!("void widen_{k}_entry(")), "kernels.c lacks {k}");
    }
    for k in &launched_cuda {
        assert!(cu.contains(&format!(" widen_{k}(")), "kernels.cu lacks {k}");
    }
    assert!(out.join("kernels.ptx").exists() || out.join("kernels.ptx.txt").exists());

    // The plan lists its arena and one cost row per step (plus the total).
    let header = plan.lines().next().unwrap();
    let steps: usize = header.split(" kernels, ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(header.contains("arena "), "{header}");
    let tsv = read(&out, "kernels.tsv");
    assert_eq!(tsv.lines().count(), steps + 2, "header, one row per step, total");
    let total: Vec<&str> = tsv.lines().last().unwrap().split('\t').collect();
    assert_eq!(total[0], "total");
    assert!(total[6].parse::<u64>().unwrap() > 0, "the step does arithmetic");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_writes_both_rows_as_json() {
    let dir = common::workdir("compile-bench", None);
    let args = [
        "bench",
        &spec("tiny.ron"),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "8",
        "--batch",
        "2",
        "--json",
        "bench.json",
    ];
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_str(&read(&dir, "bench.json")).unwrap();
    assert_eq!(doc["device"], "cpu");
    let rows = doc["rows"].as_array().unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert_eq!(rows.len(), 2, "the spec and its plain-residual baseline");
    assert_eq!((rows[0]["scheme"].as_str(), rows[0]["baseline"].as_bool()), (Some("Ghc"), Some(false)));
    assert_eq!((rows[1]["scheme"].as_str(), rows[1]["baseline"].as_bool()), (Some("Residual"), Some(true)));
    for r in rows {
        assert_eq!(r["d_model"], 32, "backbone override applied");
        assert_eq!(r["times_ms"].as_array().unwrap().len(), 2);
        assert!(r["ms_per_step"].as_f64().unwrap() > 0.0);
        assert!(r["final_loss"].as_f64().unwrap().is_finite());
    }
    // The baseline has fewer parameters than the widened stream.
    assert!(rows[0]["params"].as_u64() > rows[1]["params"].as_u64());
    // The roofline: measured host ceilings, each Plan's floor under them, and
    // the widened stream's least overhead: its floor's excess over the
    // baseline's, against the baseline's measured step.
    let ceilings = &doc["ceilings"];
    assert!(ceilings["flops_per_s"].as_f64().unwrap() > 1e8, "{ceilings}");
    assert!(ceilings["bytes_per_s"].as_f64().unwrap() > 1e8, "{ceilings}");
    let floor = |r: &serde_json::Value| r["roofline_ms"].as_f64().unwrap();
    assert!(floor(&rows[1]) > 0.0);
    // Two timed steps: the median is their mean.
    let base_times = rows[1]["times_ms"].as_array().unwrap();
    let base_ms = (base_times[0].as_f64().unwrap() + base_times[1].as_f64().unwrap()) / 2.0;
    let want = (floor(&rows[0]) - floor(&rows[1])) / base_ms * 100.0;
    let got = rows[0]["least_overhead_pct"].as_f64().unwrap();
    assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    assert!(
        rows[0]["gb_per_step"].as_f64() > rows[1]["gb_per_step"].as_f64(),
        "the wider stream moves more bytes"
    );
    assert!(table.contains("roofline"), "{table}");
    assert!(table.contains("baseline") && table.contains("Ghc"), "{table}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `widen compile -o DIR` replaces only what an earlier compile wrote: a
/// folder holding a file of an output's name that no compile wrote is refused
/// before anything is written (the file kept), unless `--force`; the spec is
/// never overwritten, even forced.
#[test]
fn compile_refuses_to_overwrite_files_it_did_not_write() {
    let dir = common::workdir("compile-overwrite", None);
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("plan.txt"), "my plan").unwrap();
    let o = widen(&dir, &["compile", &spec("tiny.ron"), "-o", "out"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("plan.txt") && e.contains("--force"), "{e}");
    assert_eq!(read(&out, "plan.txt"), "my plan");
    assert!(!out.join("graph.txt").exists(), "nothing was written");

    // The spec inside the output folder under an output's name: refused even with --force.
    let tiny = std::fs::read_to_string(spec("tiny.ron")).unwrap();
    let inside = dir.join("inside");
    std::fs::create_dir_all(&inside).unwrap();
    std::fs::write(inside.join("graph.txt"), &tiny).unwrap();
    let o = widen(&dir, &["compile", "inside/graph.txt", "-o", "inside", "--force"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("spec"), "{}", stderr(&o));
    assert_eq!(read(&inside, "graph.txt"), tiny);

    // Forced, it writes; then the folder is a compile's and recompiles unforced.
    let o = widen(&dir, &["compile", &spec("tiny.ron"), "-o", "out", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(read(&out, "plan.txt"), "my plan");
    let o = widen(&dir, &["compile", &spec("tiny.ron"), "-o", "out"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A file-size limit (`ulimit -f`) that a write crosses is an error naming
/// the file, not a silent death by SIGXFSZ.
#[cfg(unix)]
#[test]
fn a_file_size_limit_is_a_write_error() {
    use std::os::unix::process::ExitStatusExt;
    let dir = common::workdir("compile-fsize", None);
    // 16 blocks (8 or 16 KiB, by the shell's block size): graph.txt is larger.
    let o = std::process::Command::new("sh")
        .current_dir(&dir)
        .args(["-c", "ulimit -f 16 && exec \"$0\" \"$@\"", env!("CARGO_BIN_EXE_widen")])
        .args(["compile", &spec("tiny.ron"), "-o", "out"])
        .output()
        .unwrap();
    assert_eq!(o.status.signal(), None, "killed by a signal: {}", stderr(&o));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("cannot write") && e.contains("graph.txt") && e.contains("too large"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
