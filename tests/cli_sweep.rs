//! `widen sweep`, `widen report` and `widen plot` as a user runs them: a tiny sweep
//! end to end, equal-FLOP budgets, a failing point, an interrupted and a killed
//! sweep resumed, a changed sweep refused, and the CUDA device refused without a driver.

mod common;

use common::{stderr, widen};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A D = 32 GHC model; `residual.r` moves n with m = 2.
const SPEC: &str = r#"Model(
    name: "sweep-tiny",
    vocab: 256, d_model: 32, layers: 1, heads: 2,
    residual: Ghc(m: 2, n: 4),
    train: (seq_len: 16, batch: 2, steps: 3, eval_every: 2, eval_batches: 1,
            optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 0)),
)
"#;

/// `results.csv` as (header, rows as column -> value).
fn read_csv(path: &Path) -> (Vec<String>, Vec<BTreeMap<String, String>>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header: Vec<String> = lines.next().unwrap().split(',').map(String::from).collect();
    let rows = lines
        .map(|l| {
            let cells = split_csv(l);
            assert_eq!(cells.len(), header.len(), "row {l:?}");
            header.iter().cloned().zip(cells).collect()
        })
        .collect();
    (header, rows)
}

/// One CSV line's cells (quoted cells may hold commas).
fn split_csv(line: &str) -> Vec<String> {
    let (mut cells, mut cell, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => cells.push(std::mem::take(&mut cell)),
            _ => cell.push(c),
        }
    }
    cells.push(cell);
    cells
}

fn num(row: &BTreeMap<String, String>, col: &str) -> f64 {
    row[col].parse().unwrap_or_else(|_| panic!("{col} = {:?} is not a number", row[col]))
}

fn svg(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Non-black stroke colours of `polyline`s and how many each has.
fn series_strokes(doc: &roxmltree::Document) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for n in doc.descendants().filter(|n| n.has_tag_name("polyline")) {
        if let Some(c) = n.attribute("stroke").filter(|c| !c.eq_ignore_ascii_case("#000000")) {
            *out.entry(c.to_string()).or_default() += 1;
        }
    }
    out
}

fn texts(doc: &roxmltree::Document) -> Vec<String> {
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(|t| t.trim().into())
        .collect()
}

#[test]
fn a_tiny_sweep_writes_every_run_row_and_plot() {
    let dir = common::workdir("sweep-e2e", Some(SPEC));
    let args = ["sweep", "spec.ron", "--set", "residual.r=1,2,4", "--seeds", "2", "--device", "reference"];
    let o = widen(&dir, &[&args[..], &["--out", "sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("6 runs trained, 0 reused, 0 failed"), "{out}");
    let e = stderr(&o);
    for needle in [
        "point 1/3 residual.r-1 seed 0 (run 1/6)",
        "point 3/3 residual.r-4 seed 1 (run 6/6)",
        "ETA",
        "elapsed",
    ] {
        assert!(e.contains(needle), "progress lacks {needle:?}: {e}");
    }

    let sw = dir.join("sw");
    let points = ["residual.r-1", "residual.r-2", "residual.r-4"];
    for p in points {
        for s in [0, 1] {
            for f in ["metrics.jsonl", "final.safetensors", "outcome.json"] {
                assert!(sw.join(p).join(format!("seed-{s}")).join(f).exists(), "{p}/seed-{s}/{f} missing");
            }
        }
    }
    let (header, rows) = read_csv(&sw.join("results.csv"));
    let mut want = vec!["residual.r".to_string()];
    want.extend(sweep::results::COLUMNS.iter().map(|c| c.to_string()));
    assert_eq!(header, want);
    assert_eq!(rows.len(), 3);
    let tokens_per_step = 2.0 * 16.0;
    for (row, (p, r)) in rows.iter().zip(points.iter().zip(["1", "2", "4"])) {
        assert_eq!((row["point"].as_str(), row["residual.r"].as_str()), (*p, r));
        assert_eq!(
            (row["status"].as_str(), row["reason"].as_str(), row["seeds"].as_str()),
            ("ok", "", "0;1")
        );
        assert_eq!(num(row, "seeds_finished"), 2.0);
        assert_eq!(num(row, "tokens_trained"), 3.0 * tokens_per_step);
        let val = num(row, "val_loss_mean");
        assert!(val > 3.0 && val < 7.0, "an early byte model's loss is near ln 256: {val}");
        assert!((num(row, "val_bits_per_byte") - val / std::f64::consts::LN_2).abs() < 1e-9);
        assert!(num(row, "val_loss_std") >= 0.0 && num(row, "train_loss_std") >= 0.0);
        assert!(num(row, "params_total") > num(row, "params_non_embedding"));
        assert!(num(row, "flops_per_token_train") == 3.0 * num(row, "flops_per_token_forward"));
        assert!(
            num(row, "ms_per_step_mean") > 0.0 && num(row, "tokens_per_s") > 0.0 && num(row, "wall_s") > 0.0
        );
        assert_eq!(
            (row["overhead_ms_per_step"].as_str(), row["baseline"].as_str()),
            ("", ""),
            "no --baseline"
        );
    }
    // Wider streams cost more: parameters, FLOPs and connection bytes grow with r.
    for col in ["params_total", "flops_per_token_train", "connection_bytes_per_sublayer"] {
        assert!(num(&rows[0], col) < num(&rows[1], col) && num(&rows[1], col) < num(&rows[2], col), "{col}");
    }

    // Plots: XML, one series per point.
    let plots = sw.join("plots");
    let loss = svg(&plots.join("loss.svg"));
    let doc = roxmltree::Document::parse(&loss).expect("loss.svg is XML");
    let strokes = series_strokes(&doc);
    assert_eq!(strokes.len(), 3, "one colour per point: {strokes:?}");
    assert!(strokes.values().all(|&n| n == 2), "a training and a validation line per point: {strokes:?}");
    for (name, marks) in [("law.svg", 3), ("frontier.svg", 3), ("frontier-time.svg", 3)] {
        let text = svg(&plots.join(name));
        let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{name} is not XML: {e}"));
        let circles = doc.descendants().filter(|n| n.has_tag_name("circle")).count();
        assert_eq!(circles, marks, "{name}: one marker per point");
        let t = texts(&doc);
        assert!(points.iter().all(|p| t.iter().any(|x| x.contains(p))), "{name} legend: {t:?}");
    }
    let speed = svg(&plots.join("speed.svg"));
    let t = texts(&roxmltree::Document::parse(&speed).expect("speed.svg is XML"));
    for (i, p) in points.iter().enumerate() {
        // Without --baseline there is no overhead to draw: one legend, in the time panel.
        assert_eq!(t.iter().filter(|x| **x == format!("#{} {p}", i + 1)).count(), 1, "speed legend: {t:?}");
    }
    let out_text = String::from_utf8_lossy(&o.stdout);
    assert!(out_text.contains("law over residual.r: L = "), "{out_text}");

    // `widen report` rebuilds the same results from the folder.
    let before = std::fs::read_to_string(sw.join("results.json")).unwrap();
    std::fs::remove_file(sw.join("results.csv")).unwrap();
    std::fs::remove_dir_all(&plots).unwrap();
    let o = widen(&dir, &["report", "sw"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(sw.join("results.json")).unwrap(), before);
    assert!(sw.join("results.csv").exists() && plots.join("law.svg").exists());
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("residual.r-4"), "{out}");
    assert!(
        out.contains("6 runs: 6 finished, 0 failed, 0 without a result yet"),
        "a report trains nothing: {out}"
    );

    // `widen plot` draws one run.
    let o = widen(&dir, &["plot", "sw/residual.r-2/seed-1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let one = svg(&sw.join("residual.r-2/seed-1/loss.svg"));
    let doc = roxmltree::Document::parse(&one).expect("XML");
    assert_eq!(series_strokes(&doc).len(), 1);

    // The same command again trains nothing.
    let o = widen(&dir, &[&args[..], &["--out", "sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 runs trained, 6 reused"));
    // Another budget into the same folder is another sweep: refused, naming the point and field.
    let o = widen(&dir, &[&args[..], &["--out", "sw", "--budget", "steps=5"]].concat());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("residual.r-1") && e.contains("train.steps") && e.contains("another --out"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn equal_flop_budgets_train_each_point_to_the_budget_within_a_step() {
    let dir = common::workdir("sweep-flops", Some(SPEC));
    std::fs::write(
        dir.join("sweep.ron"),
        r#"// a sweep file: zip two axes, with the plain-residual baseline
        Sweep(base: "spec.ron", axes: {"residual.r": [1, 4], "d_model": [32, 64]}, combine: Zip,
              seeds: [5], budget: Flops(4e8), baseline: true)"#,
    )
    .unwrap();
    let o = widen(&dir, &["check", "sweep.ron"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is a sweep file") && stderr(&o).contains("--dry-run"), "{}", stderr(&o));
    // --dry-run shows the plan and trains nothing.
    let o = widen(&dir, &["sweep", "sweep.ron", "--dry-run", "--out", "sw"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let plan = String::from_utf8_lossy(&o.stdout);
    assert!(plan.contains("4 points, 4 runs") && plan.contains("baseline_d_model-64"), "{plan}");
    assert!(!dir.join("sw").exists());
    let o = widen(&dir, &["sweep", "sweep.ron", "--device", "reference", "--out", "sw"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (header, rows) = read_csv(&dir.join("sw/results.csv"));
    assert_eq!(&header[..3], ["residual.r", "d_model", "point"]);
    let names: Vec<&str> = rows.iter().map(|r| r["point"].as_str()).collect();
    assert_eq!(
        names,
        ["residual.r-1_d_model-32", "residual.r-4_d_model-64", "baseline_d_model-32", "baseline_d_model-64"]
    );
    let mut steps = Vec::new();
    for row in &rows {
        let per_token = num(row, "flops_per_token_train");
        let tokens = num(row, "tokens_trained");
        let one_step = 32.0 * per_token;
        assert!(
            (tokens * per_token - 4e8).abs() <= one_step,
            "{}: {tokens} tokens x {per_token}",
            row["point"]
        );
        assert_eq!(row["seeds"], "5");
        steps.push(tokens / 32.0);
    }
    // Costlier points get fewer steps; every point has its twin and an overhead.
    assert!(steps[1] < steps[0], "{steps:?}");
    assert_eq!(rows[0]["baseline"], "baseline_d_model-32");
    assert_eq!(rows[1]["baseline"], "baseline_d_model-64");
    assert!(num(&rows[1], "overhead_train_flops") > 0.0);
    assert_eq!(num(&rows[2], "overhead_train_flops"), 0.0);
    let speed = svg(&dir.join("sw/plots/speed.svg"));
    let t = texts(&roxmltree::Document::parse(&speed).expect("speed.svg is XML"));
    for (i, p) in names.iter().enumerate() {
        assert_eq!(t.iter().filter(|x| **x == format!("#{} {p}", i + 1)).count(), 2, "both panels: {t:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failing_point_is_recorded_and_the_others_finish() {
    let dir = common::workdir("sweep-fail", Some(SPEC));
    let args = [
        "sweep",
        "spec.ron",
        "--set",
        "train.optimizer.lr=1e-2,1e300",
        "--device",
        "reference",
        "--out",
        "sw",
    ];
    let o = widen(&dir, &args);
    assert_eq!(o.status.code(), Some(1), "a failed point makes the exit status 1: {}", stderr(&o));
    assert!(stderr(&o).contains("FAILED"), "{}", stderr(&o));
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    assert_eq!(rows[0]["status"], "ok");
    assert!(num(&rows[0], "val_loss_mean").is_finite());
    assert_eq!(rows[1]["status"], "failed");
    assert!(rows[1]["reason"].starts_with("seed 0: "), "{}", rows[1]["reason"]);
    assert!(rows[1]["reason"].contains("step"), "the reason names the step: {}", rows[1]["reason"]);
    assert_eq!(rows[1]["val_loss_mean"], "");
    // A rerun keeps the failure (it is a result) unless asked to retry it.
    let o = widen(&dir, &args);
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 runs trained, 2 reused, 1 failed"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn invalid_points_are_refused_or_skipped_naming_the_field() {
    let dir = common::workdir("sweep-invalid", Some(SPEC));
    let set = ["sweep", "spec.ron", "--set", "d_model=32,33", "--device", "reference", "--out", "sw"];
    let o = widen(&dir, &set);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("d_model-33") && e.contains("d_model") && e.contains("Skip"), "{e}");
    assert!(!dir.join("sw").exists(), "a refused sweep trains nothing");
    let o = widen(&dir, &[&set[..], &["--skip-invalid"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("skipped (invalid) d_model-33: invalid spec: d_model = 33"), "{out}");
    assert!(out.contains("1 runs trained"), "{out}");
    // A path the spec does not have names the fields that exist there.
    let o = widen(&dir, &["sweep", "spec.ron", "--set", "residual.q=1,2", "--out", "sw2"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("`residual.q`") && stderr(&o).contains("its fields are"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sweep_runs_on_the_cpu_device() {
    let dir = common::workdir("sweep-cpu", Some(SPEC));
    let o =
        widen(&dir, &["sweep", "spec.ron", "--set", "residual.r=1,2", "--budget", "steps=2", "--out", "sw"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["status"] == "ok" && num(r, "val_loss_mean").is_finite()));
    let metrics = std::fs::read_to_string(dir.join("sw/residual.r-2/seed-0/metrics.jsonl")).unwrap();
    assert!(metrics.lines().all(|l| l.contains(r#""device":"cpu""#)), "{metrics}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Waits until `path` exists; false after `limit`.
fn wait_for(path: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while !path.exists() {
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

#[test]
fn an_interrupted_or_killed_sweep_resumes_without_redoing_finished_runs() {
    let spec = SPEC.replace("steps: 3,", "steps: 3, checkpoint_every: 20,");
    let dir = common::workdir("sweep-resume", Some(&spec));
    let args = [
        "sweep",
        "spec.ron",
        "--set",
        "residual.r=1,2",
        "--seeds",
        "2",
        "--budget",
        "steps=120",
        "--device",
        "reference",
        "--out",
        "sw",
    ];
    let start = |dir: &Path| {
        Command::new(env!("CARGO_BIN_EXE_widen"))
            .current_dir(dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let sw = dir.join("sw");
    let first = sw.join("residual.r-1/seed-0");

    // Ctrl-C once the second run has a checkpoint: it is saved, exit 130.
    let child = start(&dir);
    assert!(wait_for(&sw.join("residual.r-1/seed-1/ckpt-20.safetensors"), Duration::from_secs(60)));
    let finished = std::fs::read_to_string(first.join("outcome.json")).unwrap();
    let metrics = std::fs::read_to_string(first.join("metrics.jsonl")).unwrap();
    Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(stderr(&o).contains("run the same command again"), "{}", stderr(&o));
    assert!(!sw.join("residual.r-1/seed-1/outcome.json").exists());

    // Rerun, then SIGKILL while a later run trains: no message, no cleanup.
    let child = start(&dir);
    assert!(wait_for(&sw.join("residual.r-2/seed-0/ckpt-20.safetensors"), Duration::from_secs(60)));
    Command::new("kill").args(["-KILL", &child.id().to_string()]).status().unwrap();
    let _ = child.wait_with_output().unwrap();

    // The last rerun finishes the rest; the first run was never trained again.
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let trained: usize =
        out.split(" runs trained").next().unwrap().rsplit('\n').next().unwrap().trim().parse().unwrap();
    assert!(trained <= 2, "at most the killed run and the one after it train again: {out}");
    assert_eq!(std::fs::read_to_string(first.join("outcome.json")).unwrap(), finished);
    assert_eq!(std::fs::read_to_string(first.join("metrics.jsonl")).unwrap(), metrics);
    // The interrupted run continued from its checkpoint: one metrics line per step.
    for run in ["residual.r-1/seed-1", "residual.r-2/seed-0", "residual.r-2/seed-1"] {
        let lines = std::fs::read_to_string(sw.join(run).join("metrics.jsonl")).unwrap();
        let steps: Vec<u64> = lines
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, (1..=120).collect::<Vec<u64>>(), "{run}");
    }
    let (_, rows) = read_csv(&sw.join("results.csv"));
    assert!(rows.iter().all(|r| r["status"] == "ok" && r["seeds_finished"] == "2"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cuda_sweeps_are_refused_cleanly_without_a_driver() {
    if widen::runtime::device::cuda::driver_available() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let dir = common::workdir("sweep-cuda", Some(SPEC));
    let o = widen(&dir, &["sweep", "spec.ron", "--set", "residual.r=1,2", "--device", "cuda", "--out", "sw"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no CUDA driver"), "{}", stderr(&o));
    assert!(!dir.join("sw/residual.r-1").exists(), "nothing ran");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The sweep file behind docs/sweeps.md stays a valid sweep of the points it documents.
#[test]
fn the_documented_sweep_file_expands_to_its_points() {
    let dir = common::workdir("sweep-docs", None);
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/sweeps/ghc-r.ron");
    let o = widen(&dir, &["sweep", file.to_str().unwrap(), "--dry-run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for p in ["residual.r-1 ", "residual.r-1.5", "residual.r-2", "residual.r-4", "baseline"] {
        assert!(out.contains(p), "{p} missing: {out}");
    }
    assert!(out.contains("5 points, 15 runs"), "{out}");
    let csv =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/sweeps/ghc-r/results.csv"))
            .unwrap();
    assert_eq!(csv.lines().count(), 6, "the committed results hold the five points");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The design comparison behind docs/sweeps.md ("Designs in the connection language"):
/// its points are, in order, the `residual` of the spec files it names, and the committed
/// results hold every point.
#[test]
fn the_documented_design_sweep_compares_the_shipped_spec_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sweep = sweep::Sweep::load(&root.join("docs/sweeps/designs.ron")).unwrap_or_else(|e| panic!("{e}"));
    let expansion = sweep::expand(&sweep).unwrap_or_else(|e| panic!("{e}"));
    let files = ["residual", "mhc", "mhc-lite", "kromhc", "wide-residual", "attn-residuals", "denseformer"];
    assert_eq!(expansion.points.len(), files.len());
    for (point, file) in expansion.points.iter().zip(files) {
        let spec = widen::ir::spec::load_spec(&root.join(format!("specs/{file}.ron"))).unwrap();
        assert_eq!(
            point.spec.residual, spec.residual,
            "point {} is not specs/{file}.ron's residual",
            point.name
        );
        assert_eq!(point.runs.len(), 3, "{file}: three seeds");
    }
    let csv = std::fs::read_to_string(root.join("docs/sweeps/designs/results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + files.len(), "the committed results hold every point");
}

/// Reads `results.json` as JSON, or panics naming what a reader found.
fn results_json(sw: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(sw.join("results.json")).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("results.json is not whole: {e}: {text:?}"))
}

#[test]
fn reports_during_a_sweep_neither_stop_it_nor_see_half_a_file() {
    let dir = common::workdir("sweep-concurrent", Some(SPEC));
    let args = [
        "sweep",
        "spec.ron",
        "--set",
        "residual.r=1,2,4",
        "--seeds",
        "2",
        "--device",
        "reference",
        "--out",
        "sw",
    ];
    let mut sweep = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(&dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sw = dir.join("sw");
    assert!(wait_for(&sw.join("plan.json"), Duration::from_secs(60)), "the sweep wrote its plan");
    let done = std::sync::atomic::AtomicBool::new(false);
    let header_len = 1 + sweep::results::COLUMNS.len();
    let reports = std::thread::scope(|s| {
        let reporters: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut ok = 0;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        let o = widen(&dir, &["report", "sw"]);
                        assert!(o.status.success(), "a report during the sweep failed: {}", stderr(&o));
                        let (header, rows) = read_csv(&sw.join("results.csv"));
                        assert_eq!(header.len(), header_len, "a reader saw a partial results.csv");
                        assert_eq!(rows.len(), 3);
                        let json = results_json(&sw);
                        assert_eq!(json["points"].as_array().map(Vec::len), Some(3));
                        ok += 1;
                    }
                    ok
                })
            })
            .collect();
        let status = sweep.wait().unwrap();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut err = String::new();
        std::io::Read::read_to_string(sweep.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(status.success(), "the sweep died beside the reports: {err}");
        reporters.into_iter().map(|r| r.join().unwrap()).sum::<usize>()
    });
    assert!(reports >= 2, "the reports ran during the sweep ({reports})");
    let (_, rows) = read_csv(&sw.join("results.csv"));
    assert!(rows.iter().all(|r| r["status"] == "ok" && r["seeds_finished"] == "2"), "{rows:?}");
    let left: Vec<String> = std::fs::read_dir(&sw)
        .unwrap()
        .chain(std::fs::read_dir(sw.join("plots")).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporaries left behind: {left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rerun_with_fewer_points_or_seeds_keeps_every_finished_run() {
    let dir = common::workdir("sweep-rerun", Some(SPEC));
    let sweep = |set: &str, seeds: &str| {
        widen(
            &dir,
            &["sweep", "spec.ron", "--set", set, "--seeds", seeds, "--device", "reference", "--out", "sw"],
        )
    };
    let o = sweep("residual.r=1,2", "2");
    assert!(o.status.success(), "{}", stderr(&o));
    let o = sweep("residual.r=4", "1");
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("1 runs trained, 0 reused"), "{out}");
    assert!(out.contains("kept 4 run(s) of earlier sweeps") && out.contains("residual.r-1/seed-1"), "{out}");
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    let got: Vec<(&str, &str)> =
        rows.iter().map(|r| (r["point"].as_str(), r["seeds_finished"].as_str())).collect();
    assert_eq!(got, [("residual.r-4", "1"), ("residual.r-1", "2"), ("residual.r-2", "2")]);
    assert!(rows.iter().all(|r| r["status"] == "ok"), "{rows:?}");
    // The law still sees all three points.
    assert!(String::from_utf8_lossy(&o.stdout).contains("n = 3"), "{out}");
    // Fewer seeds of a point keep its other seeds.
    let o = sweep("residual.r=1", "1");
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    let r1 = rows.iter().find(|r| r["point"] == "residual.r-1").unwrap();
    assert_eq!((r1["seeds"].as_str(), r1["seeds_finished"].as_str()), ("0;1", "2"));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sw/plan.json")).unwrap()).unwrap();
    assert_eq!(plan["points"].as_array().unwrap().len(), 3, "plan.json keeps every point with results");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sweep_data_is_identified_by_content() {
    let dir = common::workdir("sweep-data", Some(SPEC));
    let text = "It was the best of times, it was the worst of times. ".repeat(40);
    std::fs::write(dir.join("corpus.txt"), &text).unwrap();
    let args =
        ["sweep", "../spec.ron", "--set", "residual.r=1,2", "--data", "corpus.txt", "--device", "reference"];
    let first = dir.join("a");
    std::fs::create_dir_all(&first).unwrap();
    std::fs::copy(dir.join("corpus.txt"), first.join("corpus.txt")).unwrap();
    let o = widen(&first, &[&args[..], &["--out", "../sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    // The same bytes under the same name in another folder: the same sweep, nothing retrained.
    let second = dir.join("b");
    std::fs::create_dir_all(&second).unwrap();
    std::fs::write(second.join("corpus.txt"), &text).unwrap();
    let o = widen(&second, &[&args[..], &["--out", "../sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 runs trained, 2 reused"));
    // Other bytes under the same name: refused before anything trains, naming both.
    std::fs::write(second.join("corpus.txt"), text.replace("best", "bust")).unwrap();
    let o = widen(&second, &[&args[..], &["--set", "d_model=32", "--out", "../sw"]].concat());
    assert!(!o.status.success());
    let o = widen(&second, &[&args[..], &["--out", "../sw"]].concat());
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("point `residual.r-1`") && e.contains("was trained on corpus.txt") && e.contains("sha256"),
        "{e}"
    );
    // A dry run reads the data it would train on.
    let o =
        widen(&second, &["sweep", "../spec.ron", "--set", "residual.r=1", "--data", "nope.txt", "--dry-run"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("nope.txt"), "{}", stderr(&o));
    let o = widen(
        &second,
        &["sweep", "../spec.ron", "--set", "residual.r=1", "--data", "corpus.txt", "--dry-run"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout)
        .contains(&format!("data corpus.txt ({} bytes, sha256 ", text.len())));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_data_file_changed_during_a_sweep_stops_it() {
    let spec = SPEC.replace("steps: 3,", "steps: 3, checkpoint_every: 20,");
    let dir = common::workdir("sweep-data-change", Some(&spec));
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    std::fs::write(dir.join("corpus.txt"), &text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(&dir)
        .args([
            "sweep",
            "spec.ron",
            "--set",
            "residual.r=1,2",
            "--budget",
            "steps=150",
            "--data",
            "corpus.txt",
        ])
        .args(["--device", "reference", "--out", "sw"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(wait_for(&dir.join("sw/residual.r-1/seed-0/ckpt-20.safetensors"), Duration::from_secs(60)));
    std::fs::write(dir.join("corpus.txt"), text.to_uppercase()).unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("point `residual.r-2`") && err.contains("but its data is now"), "{err}");
    assert!(!dir.join("sw/residual.r-2/seed-0/metrics.jsonl").exists(), "nothing trained on the other text");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_folder_that_is_not_a_sweep_is_never_written() {
    let dir = common::workdir("sweep-foreign", Some(SPEC));
    std::fs::create_dir_all(dir.join("mine/plots")).unwrap();
    std::fs::write(dir.join("mine/results.csv"), "my,own\n1,2\n").unwrap();
    let o = widen(
        &dir,
        &["sweep", "spec.ron", "--set", "residual.r=1", "--device", "reference", "--out", "mine"],
    );
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("mine is not empty and holds no plan.json") && e.contains("results.csv"), "{e}");
    assert_eq!(std::fs::read_to_string(dir.join("mine/results.csv")).unwrap(), "my,own\n1,2\n");
    assert!(!dir.join("mine/plan.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_plan_files_are_errors_naming_the_file_and_field() {
    let dir = common::workdir("sweep-damaged", Some(SPEC));
    let o = widen(
        &dir,
        &[
            "sweep",
            "spec.ron",
            "--set",
            "residual.r=1,2",
            "--set",
            "d_model=32",
            "--device",
            "reference",
            "--out",
            "sw",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let path = dir.join("sw/plan.json");
    let good: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let report = |plan: &serde_json::Value| {
        std::fs::write(&path, serde_json::to_string(plan).unwrap()).unwrap();
        widen(&dir, &["report", "sw"])
    };
    // A point with fewer values than axes (it does not set one): reported, no panic.
    let mut fewer = good.clone();
    fewer["points"][1]["values"].as_array_mut().unwrap().pop();
    let o = report(&fewer);
    assert!(o.status.success(), "{}", stderr(&o));
    type Damage = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: [(&str, Damage, &str); 4] = [
        (
            "points[0].values",
            Box::new(|p| p["points"][0]["values"][0][0] = "residual.q".into()),
            "not one of the axes",
        ),
        (
            "points[1].runs[0].dir",
            Box::new(|p| p["points"][1]["runs"][0]["dir"] = "../../etc".into()),
            "should be",
        ),
        ("points[0].name", Box::new(|p| p["points"][0]["name"] = "../x".into()), "not a folder name"),
        (
            "points[0].baseline",
            Box::new(|p| p["points"][0]["baseline"] = "nope".into()),
            "not a point of the plan",
        ),
    ];
    for (field, damage, says) in cases {
        let mut bad = good.clone();
        damage(&mut bad);
        let o = report(&bad);
        assert_eq!(o.status.code(), Some(1), "{field}");
        let e = stderr(&o);
        assert!(e.contains("plan.json: ") && e.contains(field) && e.contains(says), "{field}: {e}");
        assert!(!e.contains("panicked"), "{e}");
    }
    std::fs::write(&path, "{\"axes\": [").unwrap();
    let e = stderr(&widen(&dir, &["report", "sw"]));
    assert!(e.contains("plan.json: line 1 column") && e.contains("damaged"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plot_and_report_read_a_million_metrics_lines() {
    let dir = common::workdir("sweep-long", None);
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let mut text = String::with_capacity(90 << 20);
    for step in 1..=1_000_000u64 {
        let loss = 5.0 - step as f64 * 1e-6;
        let val = if step % 1000 == 0 { format!(",\"val_loss\":{loss}") } else { String::new() };
        text.push_str(&format!(
            "{{\"step\":{step},\"tokens\":{},\"loss\":{loss}{val},\"tokens_per_s\":1000.0}}\n",
            step * 32
        ));
    }
    std::fs::write(run.join("metrics.jsonl"), text).unwrap();
    let started = Instant::now();
    let o = widen(&dir, &["plot", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A quadratic pass over a million lines takes many minutes; a linear one, seconds.
    assert!(started.elapsed() < Duration::from_secs(120), "{:?}", started.elapsed());
    let svg = std::fs::metadata(run.join("loss.svg")).unwrap().len();
    assert!(svg < 1 << 20, "the drawing is thinned: {svg} bytes");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_summary_states_each_difference_with_its_interval_and_p_value() {
    let dir = common::workdir("sweep-significance", Some(SPEC));
    let o = widen(
        &dir,
        &[
            "sweep",
            "spec.ron",
            "--set",
            "residual.r=1,4",
            "--seeds",
            "3",
            "--device",
            "reference",
            "--out",
            "sw",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    assert_eq!((rows[0]["compared_to"].as_str(), rows[1]["compared_to"].as_str()), ("", "residual.r-1"));
    // The test's own paired t-test from the per-seed losses in the CSV: three seeds give
    // two degrees of freedom, where t's CDF is 1/2 + t / (2·sqrt(2 + t²)) and
    // t(0.975, 2) = 4.302652729749462.
    let seeds = |row: &BTreeMap<String, String>| -> Vec<(u64, f64)> {
        row["val_loss_seeds"]
            .split(';')
            .map(|c| {
                let (s, l) = c.split_once(':').unwrap();
                (s.parse().unwrap(), l.parse().unwrap())
            })
            .collect()
    };
    let (a, b) = (seeds(&rows[1]), seeds(&rows[0]));
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2]);
    let d: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x.1 - y.1).collect();
    let mean = d.iter().sum::<f64>() / 3.0;
    let sd = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
    let t = mean / (sd / 3f64.sqrt());
    let p = 1.0 - t.abs() / (2.0 + t * t).sqrt();
    let half = 4.302652729749462 * sd / 3f64.sqrt();
    let close = |col: &str, want: f64| {
        let got = num(&rows[1], col);
        assert!((got - want).abs() <= 1e-9 * want.abs().max(1e-12), "{col}: {got} against {want}");
    };
    close("delta_val_loss", mean);
    close("delta_p_value", p);
    close("delta_ci95_lo", mean - half);
    close("delta_ci95_hi", mean + half);
    assert_eq!(rows[1]["delta_test"], "paired");
    let line = out
        .lines()
        .find(|l| l.starts_with("residual.r-4 ") && l.contains("95% CI"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains(&format!("± {half:.4} nats/token")) && line.contains("paired over 3 seeds"),
        "{line}"
    );
    assert!(line.contains(&format!("p = {p:.2e}")), "{line}");
    let word = if mean + half < 0.0 {
        "beats"
    } else if mean - half > 0.0 {
        "is worse than"
    } else {
        "do not differ"
    };
    assert!(line.contains(word), "{line}");
    // `widen report --against` compares with another point, and refuses an unknown one.
    let o = widen(&dir, &["report", "sw", "--against", "residual.r-4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    assert_eq!(rows[0]["compared_to"], "residual.r-4");
    assert!((num(&rows[0], "delta_val_loss") + mean).abs() < 1e-12);
    let o = widen(&dir, &["report", "sw", "--against", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--against nope: no point") && stderr(&o).contains("residual.r-1"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A step's (loss, val_loss).
type StepLosses = (Option<f64>, Option<f64>);

/// Each run's losses per step, from its metrics.jsonl, by run folder.
fn run_losses(sw: &Path) -> BTreeMap<String, Vec<StepLosses>> {
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sw.join("plan.json")).unwrap()).unwrap();
    let mut out = BTreeMap::new();
    for p in plan["points"].as_array().unwrap() {
        for r in p["runs"].as_array().unwrap() {
            let dir = r["dir"].as_str().unwrap().to_string();
            let text = std::fs::read_to_string(sw.join(&dir).join("metrics.jsonl")).unwrap();
            let lines = text
                .lines()
                .map(|l| {
                    let v: serde_json::Value = serde_json::from_str(l).unwrap();
                    (v["loss"].as_f64(), v["val_loss"].as_f64())
                })
                .collect();
            out.insert(dir, lines);
        }
    }
    out
}

/// Each point's validation-loss columns, as written.
fn val_columns(sw: &Path) -> Vec<(String, String, String, String)> {
    let (_, rows) = read_csv(&sw.join("results.csv"));
    rows.iter()
        .map(|r| {
            (
                r["point"].clone(),
                r["val_loss_mean"].clone(),
                r["val_loss_std"].clone(),
                r["val_loss_seeds"].clone(),
            )
        })
        .collect()
}

/// The 2-point x 2-seed sweep of the tests below, on the reference device.
const SMALL: [&str; 8] =
    ["sweep", "spec.ron", "--set", "residual.r=1,2", "--seeds", "2", "--device", "reference"];

#[test]
fn every_run_and_the_results_record_their_provenance() {
    let dir = common::workdir("sweep-provenance", Some(SPEC));
    let o = widen(
        &dir,
        &["sweep", "spec.ron", "--set", "residual.r=1,2", "--device", "reference", "--out", "sw"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let sw = dir.join("sw");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sw.join("plan.json")).unwrap()).unwrap();
    let data = &plan["data"]["residual.r-1"];
    assert_eq!(data["sha256"].as_str().unwrap().len(), 64, "{plan}");
    let git = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let outcome: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sw.join("residual.r-1/seed-0/outcome.json")).unwrap())
            .unwrap();
    let p = &outcome["provenance"];
    assert!(outcome["Finished"]["val_loss"].is_f64(), "{outcome}");
    assert_eq!(p["widen_version"], env!("CARGO_PKG_VERSION"), "{outcome}");
    // The test is built from the same checkout as the binary (when it is one).
    let commit = p["git_commit"].as_str().unwrap();
    match &git {
        Some(head) => assert_eq!(commit, head, "{outcome}"),
        None => assert_eq!(commit, "unknown"),
    }
    assert_eq!(p["device"], "reference");
    assert!(!p["host"].as_str().unwrap().is_empty());
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(p["cores"].as_u64(), Some(cores));
    assert_eq!(p["threads"].as_u64(), Some(cores), "one sweep process has every core");
    assert_eq!(&p["data"], data, "the run's data is the plan's");

    let results = results_json(&sw);
    for point in results["points"].as_array().unwrap() {
        assert_eq!(point["provenance"][0]["seed"], 0, "{point}");
        assert_eq!(point["provenance"][0]["git_commit"], commit);
        assert_eq!(point["data"]["sha256"], data["sha256"]);
    }
    let (_, rows) = read_csv(&sw.join("results.csv"));
    for row in &rows {
        assert_eq!(row["widen_version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(row["git_commit"], commit);
        assert_eq!((row["device"].as_str(), row["threads"].clone()), ("reference", cores.to_string()));
        assert_eq!(row["host"], p["host"].as_str().unwrap());
        assert_eq!(row["data_sha256"], data["sha256"].as_str().unwrap());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn jobs_train_runs_at_once_with_the_results_of_one_job_bit_for_bit() {
    let dir = common::workdir("sweep-jobs", Some(SPEC));
    let one = widen(&dir, &[&SMALL[..], &["--out", "one"]].concat());
    assert!(one.status.success(), "{}", stderr(&one));
    let two = widen(&dir, &[&SMALL[..], &["--out", "two", "--jobs", "2"]].concat());
    assert!(two.status.success(), "{}", stderr(&two));
    assert!(String::from_utf8_lossy(&two.stdout).contains("4 runs trained, 0 reused, 0 failed"));
    let e = stderr(&two);
    assert_eq!(e.matches(": done, val loss").count(), 4, "one line per finished run: {e}");
    let (a, b) = (run_losses(&dir.join("one")), run_losses(&dir.join("two")));
    assert_eq!(a.len(), 4);
    assert!(a.values().all(|l| l.len() == 3 && l.iter().any(|(_, v)| v.is_some())), "{a:?}");
    assert_eq!(a, b, "every step's loss and val_loss equal");
    assert_eq!(val_columns(&dir.join("one")), val_columns(&dir.join("two")));
    // Each process had its share of the cores.
    let cores = std::thread::available_parallelism().unwrap().get();
    let (_, rows) = read_csv(&dir.join("two/results.csv"));
    assert!(rows.iter().all(|r| r["threads"] == (cores / 2).max(1).to_string()), "{rows:?}");
    // A rerun with jobs finds everything done.
    let again = widen(&dir, &[&SMALL[..], &["--out", "two", "--jobs", "2"]].concat());
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 runs trained, 4 reused"),
        "{}",
        stderr(&again)
    );
    let zero = widen(&dir, &[&SMALL[..], &["--out", "zero", "--jobs", "0"]].concat());
    assert!(!zero.status.success() && stderr(&zero).contains("--jobs 0"), "{}", stderr(&zero));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs the job script as array task `k` (its #SBATCH lines are comments to bash).
fn array_task(dir: &Path, script: &Path, k: usize) -> std::process::Child {
    Command::new("bash")
        .arg(script)
        .env("SLURM_ARRAY_TASK_ID", k.to_string())
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn an_emitted_slurm_array_trains_every_run_out_of_order_and_at_once() {
    let dir = common::workdir("sweep-slurm", Some(SPEC));
    let emit = [
        "--out",
        "cluster",
        "--emit",
        "slurm",
        "--max-parallel",
        "3",
        "--slurm-gpus",
        "1",
        "--slurm-time",
        "00:20:00",
        "--slurm-option=--account=lab",
    ];
    let o = widen(&dir, &[&SMALL[..], &emit[..]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let cl = dir.join("cluster");
    let script_path = cl.join("sweep.sbatch");
    let script = std::fs::read_to_string(&script_path).unwrap();
    for line in
        ["#SBATCH --array=0-3%3", "#SBATCH --gpus=1", "#SBATCH --time=00:20:00", "#SBATCH --account=lab"]
    {
        assert!(script.lines().any(|l| l == line), "{line} missing:\n{script}");
    }
    assert!(script.contains("--run-index \"$SLURM_ARRAY_TASK_ID\" --device reference"), "{script}");
    assert!(cl.join("plan.json").exists());
    let plan = std::fs::read_to_string(cl.join("plan.json")).unwrap();
    assert_eq!(plan.matches("seed-").count(), 4, "{plan}");
    assert!(!cl.join("residual.r-1/seed-0/outcome.json").exists(), "emit trains nothing");

    // The last run first, then two at once, then the rest.
    let out = array_task(&dir, &script_path, 3).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("residual.r-2 seed 1"), "{out:?}");
    let (a, b) = (array_task(&dir, &script_path, 1), array_task(&dir, &script_path, 2));
    for out in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()] {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    // A task whose run another process is training says so, and records nothing.
    let run = cl.join("residual.r-1/seed-0");
    std::fs::create_dir_all(&run).unwrap();
    let held = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(run.join("run.lock"))
        .unwrap();
    held.try_lock().unwrap();
    let out = array_task(&dir, &script_path, 0).wait_with_output().unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("is training in another process") && e.contains("residual.r-1/seed-0"), "{e}");
    assert!(!run.join("outcome.json").exists());
    drop(held);
    let out = array_task(&dir, &script_path, 0).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = array_task(&dir, &script_path, 4).wait_with_output().unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--run-index 4") && e.contains("0..=3"), "{e}");

    let o = widen(&dir, &["report", "cluster"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, rows) = read_csv(&cl.join("results.csv"));
    assert!(rows.iter().all(|r| r["status"] == "ok" && r["seeds_finished"] == "2"), "{rows:?}");
    let o = widen(&dir, &[&SMALL[..], &["--out", "seq"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(val_columns(&cl), val_columns(&dir.join("seq")));
    assert_eq!(run_losses(&cl), run_losses(&dir.join("seq")));

    let o = widen(&dir, &[&SMALL[..], &["--out", "x", "--slurm-gpus", "1"]].concat());
    assert!(!o.status.success() && stderr(&o).contains("add --emit slurm"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_time_budget_fixes_each_points_steps_from_a_recorded_calibration() {
    let dir = common::workdir("sweep-time", Some(SPEC));
    let args = [
        "sweep",
        "spec.ron",
        "--set",
        "d_model=32,128",
        "--budget",
        "time=0.3",
        "--device",
        "reference",
        "--out",
        "sw",
    ];
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.matches("calibrated d_model-").count(), 2, "{e}");
    let sw = dir.join("sw");
    let read_plan = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(sw.join("plan.json")).unwrap()).unwrap()
    };
    let plan = read_plan();
    let (_, rows) = read_csv(&sw.join("results.csv"));
    let mut per_step = Vec::new();
    for (point, row) in plan["points"].as_array().unwrap().iter().zip(&rows) {
        let cal = &point["budget"]["calibration"];
        let s = cal["seconds_per_step"].as_f64().unwrap();
        let steps = point["budget"]["steps"].as_u64().unwrap();
        assert_eq!(cal["steps_timed"], 3, "{cal}");
        assert_eq!(steps, ((0.3 / s).floor() as u64).max(1), "{cal}");
        assert_eq!(cal["steps"].as_u64(), Some(steps));
        assert_eq!(point["runs"][0]["spec"]["train"]["steps"].as_u64(), Some(steps));
        let run = format!("{}/seed-0/metrics.jsonl", point["name"].as_str().unwrap());
        let lines = std::fs::read_to_string(sw.join(run)).unwrap();
        assert_eq!(lines.lines().count() as u64, steps, "the run trains the calibrated steps");
        assert_eq!(num(row, "steps") as u64, steps);
        assert_eq!(num(row, "calibrated_s_per_step"), s);
        per_step.push((s, steps));
    }
    assert!(
        per_step[1].0 > per_step[0].0 && per_step[1].1 <= per_step[0].1,
        "D = 128 is slower: {per_step:?}"
    );
    assert!(!sw.join(".calibration").exists(), "the scratch runs are removed");

    // A rerun reads the calibration instead of timing again: same steps, nothing trained.
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("calibrated"), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 runs trained, 2 reused"));
    assert_eq!(read_plan()["points"], plan["points"]);

    // Steps too few for the spec's warmup scale it, as `widen train --steps` does.
    std::fs::write(
        dir.join("warm.ron"),
        SPEC.replace("warmup: 0", "warmup: 1000000").replace("steps: 3", "steps: 2000000"),
    )
    .unwrap();
    let o =
        widen(&dir, &["sweep", "warm.ron", "--budget", "time=0.05", "--device", "reference", "--out", "w"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("warmup of 1000000; warmup scaled to"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn until_adds_seeds_to_undecided_comparisons_up_to_the_cap_saying_why() {
    let dir = common::workdir("sweep-until", Some(SPEC));
    let args = [
        "sweep",
        "spec.ron",
        "--set",
        "residual.r=1,2",
        "--seeds",
        "auto",
        "--until",
        "p<0.01",
        "--max-seeds",
        "4",
        "--device",
        "reference",
        "--out",
        "sw",
    ];
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let sw = dir.join("sw");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sw.join("plan.json")).unwrap()).unwrap();
    let added = plan["added_seeds"].as_array().unwrap();
    assert!(!added.is_empty(), "two seeds decide nothing at p < 0.01 here: {plan}");
    let seeds_of = |name: &str| -> Vec<u64> {
        let p = plan["points"].as_array().unwrap().iter().find(|p| p["name"] == name).unwrap();
        p["runs"].as_array().unwrap().iter().map(|r| r["seed"].as_u64().unwrap()).collect()
    };
    for a in added {
        let (point, seed, reason) =
            (a["point"].as_str().unwrap(), a["seed"].as_u64().unwrap(), a["reason"].as_str().unwrap());
        assert!(seed >= 2, "the planned seeds are 0 and 1: {a}");
        assert!(seeds_of(point).contains(&seed), "{a}");
        assert!(reason.contains("undecided") || reason.contains("pairs seed"), "{a}");
        if reason.starts_with('`') {
            assert!(reason.contains("p = ") && reason.contains("includes 0"), "{a}");
            assert!(seeds_of("residual.r-1").contains(&seed), "the reference gets the same seed: {a}");
        }
    }
    let results = results_json(&sw);
    let r2 = results["points"].as_array().unwrap().iter().find(|p| p["point"] == "residual.r-2").unwrap();
    assert_eq!(r2["compared_to"], "residual.r-1");
    let d = &r2["delta_val_loss"];
    let decided = d["p_value"].as_f64().unwrap() <= 0.01
        || d["ci95_lo"].as_f64().unwrap() > 0.0
        || d["ci95_hi"].as_f64().unwrap() < 0.0;
    let n = r2["seeds"].as_array().unwrap().len();
    assert!(decided || n == 4, "undecided with {n} seeds, below the cap: {r2}");
    assert!(n <= 4, "never past the cap: {plan}");
    assert!(stderr(&o).contains("adding seed 2 to residual.r-2: "), "{}", stderr(&o));
    // The same command again adds nothing: what is undecided is at the cap.
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("adding seed"), "{}", stderr(&o));
    // Bad flags name themselves.
    let o = widen(&dir, &[&SMALL[..], &["--out", "x", "--until", "q<1"]].concat());
    assert!(!o.status.success() && stderr(&o).contains("--until q<1: expected p<P"), "{}", stderr(&o));
    let o = widen(&dir, &["sweep", "spec.ron", "--seeds", "auto", "--out", "x"]);
    assert!(!o.status.success() && stderr(&o).contains("give --until"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_law_over_an_axis_through_zero_is_linear_and_says_so() {
    let dir = common::workdir("sweep-linear-law", Some(SPEC));
    let o = widen(
        &dir,
        &["sweep", "spec.ron", "--set", "mtp.depth=0,1,2", "--device", "reference", "--out", "sw"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = out.lines().find(|l| l.starts_with("law over mtp.depth")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("·mtp.depth") && !line.contains("log2("), "{line}");
    assert!(line.contains("n = 3") && line.contains("per unit of mtp.depth"), "no point is left out: {line}");
    let law = svg(&dir.join("sw/plots/law.svg"));
    assert!(law.contains("validation loss against mtp.depth"), "the title names the linear form");
    // MTP points train on an objective with MTP terms: the loss plot says so.
    assert!(svg(&dir.join("sw/plots/loss.svg")).contains("with MTP terms"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--budget steps=5` below the spec's warmup scales the warmup as `widen train
/// --steps 5` does, said in one note for every point; the points train.
#[test]
fn a_budget_shorter_than_the_warmup_scales_it_once_for_every_point() {
    let spec = SPEC
        .replace("schedule: Constant(warmup: 0)", "schedule: Cosine(warmup: 20)")
        .replace("steps: 3", "steps: 100");
    let dir = common::workdir("sweep-warmup", Some(&spec));
    let o = widen(
        &dir,
        &[
            "sweep",
            "spec.ron",
            "--set",
            "d_model=32,64",
            "--budget",
            "steps=5",
            "--device",
            "reference",
            "--out",
            "sw",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.matches("warmup scaled").count(), 1, "{e}");
    assert!(e.contains("warmup of 20; warmup scaled to 1") && e.contains("in 2 of 2 points"), "{e}");
    let metrics = std::fs::read_to_string(dir.join("sw/d_model-64/seed-0/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 5);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A path with a known last name elsewhere gets that path suggested, and an error
/// every point shares is said once; a `Vwn` value points at `Ghc`.
#[test]
fn a_misplaced_path_is_suggested_once_and_vwn_points_at_ghc() {
    let dir = common::workdir("sweep-suggest", Some(SPEC));
    let o = widen(&dir, &["sweep", "spec.ron", "--set", "train.lr=1e-3,2e-3,3e-3", "--dry-run"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("did you mean `train.optimizer.lr`"), "{e}");
    assert_eq!(e.matches("has no field `lr`").count(), 1, "{e}");
    assert!(e.contains("3 points (`train.lr-1e-3`, `train.lr-2e-3`, `train.lr-3e-3`)"), "{e}");
    let o = widen(&dir, &["sweep", "spec.ron", "--set", "residual=Vwn(m: 2, n: 4)", "--dry-run"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("unknown variant `Vwn` for residual; did you mean `Ghc`?"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Under a time budget the calibrated steps follow the same rule: a warmup longer
/// than them is scaled, said once, and the points train.
#[test]
fn a_time_budget_shorter_than_the_warmup_scales_it_too() {
    let spec = SPEC
        .replace("schedule: Constant(warmup: 0)", "schedule: Cosine(warmup: 1000)")
        .replace("steps: 3", "steps: 100000");
    let dir = common::workdir("sweep-time-warmup", Some(&spec));
    let args =
        ["sweep", "spec.ron", "--set", "d_model=32,64", "--budget", "time=0.05", "--device", "reference"];
    let o = widen(&dir, &[&args[..], &["--out", "sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.matches("warmup scaled").count(), 1, "{e}");
    assert!(e.contains("in 2 of 2 points"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sweep over a field of a design written in the connection language (docs/connections.md):
/// mHC-lite's number of streams, with its baseline, on the reference executor, to the
/// results, the fit over the axis and the plots.
#[test]
fn a_sweep_over_a_connection_language_field_fits_and_plots() {
    let spec = SPEC.replace(
        "residual: Ghc(m: 2, n: 4),",
        "residual: Connection(streams: 2, generator: Flat(gain: true), \
         read: (init: Home(on: 1.0, off: -1.0), constraint: Sigmoid(scale: 1.0, offset: 0.0)), \
         carry: (init: First(on: 0.0, off: -8.0), constraint: Permutations), \
         write: (init: Home(on: 1.0, off: -1.0), constraint: Sigmoid(scale: 2.0, offset: 0.0))),",
    );
    let dir = common::workdir("sweep-connection", Some(&spec));
    let args =
        ["sweep", "spec.ron", "--set", "residual.streams=2,3,4", "--baseline", "--device", "reference"];
    let o = widen(&dir, &[&args[..], &["--out", "sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("law over residual.streams"), "{out}");
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    let streams: Vec<&str> = rows.iter().map(|r| r["residual.streams"].as_str()).collect();
    assert_eq!(streams, ["2", "3", "4", ""], "three points and the baseline");
    assert!(rows.iter().all(|r| r["status"] == "ok" && num(r, "val_loss_mean").is_finite()));
    // More streams, more connection parameters: the cost model counts the written design.
    let params: Vec<f64> = rows[..3].iter().map(|r| num(r, "params_total")).collect();
    assert!(params[0] < params[1] && params[1] < params[2], "{params:?}");
    for plot in ["loss.svg", "law.svg", "frontier.svg"] {
        let doc = svg(&dir.join("sw/plots").join(plot));
        assert!(doc.contains("<svg"), "{plot}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sweep over a depth-history field (docs/math.md §12.5): block attention residuals at
/// one entry per 1, 2 and 4 sublayers, with the plain residual as the baseline. Fewer
/// entries, fewer reads over fewer entries: the cost model counts the written design.
#[test]
fn a_sweep_over_a_depth_history_field_fits_and_plots() {
    let spec = SPEC.replace("layers: 1", "layers: 2").replace(
        "residual: Ghc(m: 2, n: 4),",
        "residual: Connection(streams: 1, history: History(entries: Outputs, weights: Attention)),",
    );
    let dir = common::workdir("sweep-history", Some(&spec));
    let args =
        ["sweep", "spec.ron", "--set", "residual.history.block=1,2,4", "--baseline", "--device", "reference"];
    let o = widen(&dir, &[&args[..], &["--out", "sw"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("law over residual.history.block"), "{out}");
    let (_, rows) = read_csv(&dir.join("sw/results.csv"));
    let blocks: Vec<&str> = rows.iter().map(|r| r["residual.history.block"].as_str()).collect();
    assert_eq!(blocks, ["1", "2", "4", ""], "three points and the baseline");
    assert!(rows.iter().all(|r| r["status"] == "ok" && num(r, "val_loss_mean").is_finite()));
    let flops: Vec<f64> = rows[..3].iter().map(|r| num(r, "flops_per_token_forward")).collect();
    assert!(flops[0] > flops[1] && flops[1] > flops[2], "{flops:?}");
    for plot in ["loss.svg", "law.svg", "frontier.svg"] {
        let doc = svg(&dir.join("sw/plots").join(plot));
        assert!(doc.contains("<svg"), "{plot}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
