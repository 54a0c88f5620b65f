//! `widen check`: the built binary on every spec in `specs/`, and on broken specs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

mod common;

fn widen_check(spec: &Path, json: bool) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_widen"));
    cmd.arg("check").arg(spec);
    if json {
        cmd.arg("--json");
    }
    cmd.output().expect("the widen binary runs")
}

fn parse(out: &Output) -> Value {
    let text = String::from_utf8(out.stdout.clone()).expect("utf-8 stdout");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{text}"))
}

fn specs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("specs/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "ron"))
        .collect();
    files.sort();
    files
}

/// A spec file in the temp dir, removed when dropped.
struct TempSpec(PathBuf);

impl TempSpec {
    fn new(tag: &str, text: &str) -> TempSpec {
        let path = std::env::temp_dir().join(format!("widen-cli-check-{}-{tag}.ron", std::process::id()));
        std::fs::write(&path, text).expect("temp dir is writable");
        TempSpec(path)
    }
}

impl Drop for TempSpec {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn uint(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} is not an unsigned integer: {v}"))
}

fn float(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number: {v}"))
}

#[test]
fn every_spec_gives_a_complete_json_report() {
    let files = specs();
    assert!(!files.is_empty());
    for file in files {
        let out = widen_check(&file, true);
        assert!(out.status.success(), "{}: {}", file.display(), String::from_utf8_lossy(&out.stderr));
        let r = parse(&out);
        let ctx = file.display().to_string();
        assert_eq!(r["valid"], Value::Bool(true), "{ctx}");
        assert!(r["name"].is_string(), "{ctx}");

        let p = &r["params"];
        let buckets: u64 = ["embedding", "backbone", "connection", "mtp"].iter().map(|k| uint(p, k)).sum();
        assert_eq!(uint(p, "total"), buckets, "{ctx}: buckets add up");
        assert!(uint(p, "backbone") > 0, "{ctx}");
        // Only routed experts leave parameters idle for a token.
        let moe = std::fs::read_to_string(&file).unwrap().contains("Moe(");
        let (active, total) = (uint(p, "active"), uint(p, "total"));
        assert!(if moe { active < total } else { active == total }, "{ctx}: active {active} of {total}");
        let text = String::from_utf8_lossy(&widen_check(&file, false).stdout).into_owned();
        assert_eq!(text.contains("active per token"), moe, "{ctx}: the table's active row");

        let f = &r["flops_per_token"];
        assert!(uint(f, "forward") > 0, "{ctx}");
        assert_eq!(uint(f, "train"), 3 * uint(f, "forward"), "{ctx}");

        assert!(float(&r, "connection_flops_per_sublayer") >= 0.0, "{ctx}");
        let t = &r["traffic_per_sublayer"];
        // Every scheme moves at least the plain residual's 2D read and 1D write.
        assert!(float(t, "read") >= 2.0 - 1e-9 && float(t, "write") >= 1.0 - 1e-9, "{ctx}: {t}");
        assert!(uint(&r, "activation_bytes_per_token") > 0, "{ctx}");

        let o = &r["overhead_vs_residual"];
        for key in ["params", "flops", "traffic"] {
            assert!(o[key].is_f64(), "{ctx}: overhead {key}");
        }
        if r["scheme"] == "Residual" {
            assert_eq!(float(o, "params"), 0.0, "{ctx}");
            assert_eq!(float(t, "read"), 2.0, "{ctx}");
        } else {
            assert!(float(o, "traffic") > 0.0, "{ctx}: a wider state costs traffic");
        }
    }
}

#[test]
fn invalid_spec_reports_every_error_path_and_fails() {
    let spec = TempSpec::new(
        "invalid",
        "Model(name: \"bad\", d_model: 64, heads: 4, residual: Xhc(n: 4, k: 5), train: (seq_len: 1))\n",
    );
    let out = widen_check(&spec.0, true);
    assert!(!out.status.success());
    let r = parse(&out);
    assert_eq!(r["valid"], Value::Bool(false));
    let paths: Vec<&str> =
        r["errors"].as_array().expect("errors list").iter().map(|e| e["path"].as_str().unwrap()).collect();
    assert!(paths.contains(&"residual.k"), "{paths:?}");
    assert!(paths.contains(&"train.seq_len"), "{paths:?}");
    for e in r["errors"].as_array().unwrap() {
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    }

    // Without --json: one `error: path: message` line per problem, on stderr.
    let out = widen_check(&spec.0, false);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.lines().any(|l| l.starts_with("error: residual.k: ")), "{stderr}");
    assert!(stderr.lines().any(|l| l.starts_with("error: train.seq_len: ")), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn unreadable_and_malformed_files_are_clear_errors() {
    let missing = std::env::temp_dir().join(format!("widen-cli-check-{}-missing.ron", std::process::id()));
    let syntax = TempSpec::new("syntax", "Model(name: \"x\", d_model: 64,, )\n");
    for (path, what) in [(missing.as_path(), "missing"), (syntax.0.as_path(), "syntax")] {
        let out = widen_check(path, true);
        assert!(!out.status.success(), "{what}");
        let r = parse(&out);
        assert_eq!(r["valid"], Value::Bool(false), "{what}");
        let errors = r["errors"].as_array().expect("errors list");
        assert_eq!(errors.len(), 1, "{what}: {r}");
        assert_eq!(errors[0]["path"], "", "{what}");

        let out = widen_check(path, false);
        assert!(!out.status.success(), "{what}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: "), "{what}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"), "{what}: {stderr}");
    }
    // A missing file's message names the file and gives the system's reason
    // once, in `check` and in the commands that load a spec through the
    // library error's cause chain.
    let reason = std::fs::read_to_string(&missing).expect_err("missing").to_string();
    let compile = Command::new(env!("CARGO_BIN_EXE_widen"))
        .arg("compile")
        .arg(&missing)
        .arg("-o")
        .arg(std::env::temp_dir().join(format!("widen-cli-check-{}-out", std::process::id())))
        .output()
        .expect("the widen binary runs");
    for (what, out) in [("check", widen_check(&missing, false)), ("compile", compile)] {
        let said = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        assert!(said.contains(&missing.display().to_string()), "{what}: {said}");
        assert_eq!(said.matches(&reason).count(), 1, "{what}: {said}");
    }
    // The syntax error carries its position.
    let r = parse(&widen_check(&syntax.0, true));
    assert_eq!(r["errors"][0]["line"], 1);
    assert!(r["errors"][0]["col"].as_u64().is_some_and(|c| c > 1));
}

#[test]
fn table_shows_the_figures_of_the_json_report() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join("residual.ron");
    let out = widen_check(&file, false);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let r = parse(&widen_check(&file, true));
    let total = uint(&r["params"], "total");
    // Thousands separators, as the table prints counts.
    let digits = total.to_string();
    let head = digits.len() % 3;
    let mut parts: Vec<&str> = if head > 0 { vec![&digits[..head]] } else { Vec::new() };
    parts.extend(digits.as_bytes()[head..].chunks(3).map(|c| std::str::from_utf8(c).unwrap()));
    let grouped = parts.join(",");
    assert!(text.contains(&grouped), "total {grouped} missing:\n{text}");
    let read = text.lines().find(|l| l.trim_start().starts_with("traffic read ")).expect("traffic row");
    assert!(read.split_whitespace().any(|w| w == "2.00"), "{read}");
}

#[test]
fn specs_larger_than_this_machine_are_refused_before_lowering() {
    // ~3 TiB to train (64 blocks at D = 16384): under the fixed ceiling, so it
    // validates, but more than this machine holds; lowering it would allocate GBs of
    // parameter inits first.
    let big = TempSpec::new("too-big", "Model(name: \"big\", d_model: 16384, heads: 128, layers: 64)\n");
    let host = std::fs::read_to_string("/proc/meminfo").ok();
    let Some(host) = host else { return };
    assert!(!host.is_empty());
    let started = std::time::Instant::now();
    let out = widen_check(&big.0, true);
    assert!(!out.status.success());
    let r = parse(&out);
    let e = &r["errors"][0];
    assert_eq!(e["path"], "layers", "{r}");
    let message = e["message"].as_str().unwrap();
    assert!(message.contains("GiB of memory available") && message.contains("block weights"), "{message}");
    assert!(started.elapsed().as_secs() < 30, "refused without building the graph");

    let out = widen_check(&big.0, false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: layers: training needs about"), "{stderr}");
}

#[test]
fn report_includes_the_training_memory_estimate() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join("tiny.ron");
    let r = parse(&widen_check(&file, true));
    let m = &r["training_memory"];
    assert!(float(m, "total_bytes") > 0.0 && float(m, "params") > 0.0, "{r}");
    let params = uint(&r["params"], "total") as f64;
    assert!((float(m, "params") / params - 1.0).abs() < 0.1, "{m} vs {params}");
    let out = widen_check(&file, false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("training  about") && text.contains("GiB per step"), "{text}");
}

#[test]
fn report_gives_the_activations_under_each_recompute_choice() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join("mhc.ron");
    let r = parse(&widen_check(&file, true));
    let choices = r["recompute_activations"].as_array().expect("recompute_activations");
    let names: Vec<&str> = choices.iter().map(|c| c["recompute"].as_str().expect("a name")).collect();
    // mhc.ron: n = 4, 2 layers, L = 4 sublayers: L_r* = round(√(16/6)) = 2.
    assert_eq!(names, ["None", "Stream", "Block(2)"], "{r}");
    let bytes: Vec<f64> = choices.iter().map(|c| float(c, "activation_bytes")).collect();
    assert!(bytes[1] < bytes[0] && bytes[2] < bytes[0], "{bytes:?}");
    let out = widen_check(&file, false);
    let text = String::from_utf8_lossy(&out.stdout);
    let line =
        text.lines().find(|l| l.trim_start().starts_with("recompute activations")).expect("recompute line");
    assert!(line.contains("None") && line.contains("(this spec)") && line.contains("Block(2)"), "{line}");
}

#[test]
fn the_issues_bad_inputs_are_clear_errors() {
    for (tag, text, path, parts) in [
        ("vocab", "Model(vocab: 100)", "vocab", &["vocab = 100", ">= 256", "byte-level"][..]),
        ("name", "Model(name: \"../../x\")", "name", &["A-Z a-z 0-9 . _ -"][..]),
        (
            "sinkhorn",
            "Model(residual: Mhc(sinkhorn_iters: 1000000000))",
            "residual.sinkhorn_iters",
            &["<= 1000"][..],
        ),
        ("mtp", "Model(mtp: (depth: 8), train: (seq_len: 8))", "mtp.depth", &["< train.seq_len"][..]),
        ("ghc", "Model(residual: Ghc(m: 4, n: 18446744073709551615))", "residual.n", &["<= 1024"][..]),
    ] {
        let file = TempSpec::new(tag, text);
        let out = widen_check(&file.0, true);
        assert!(!out.status.success(), "{tag}");
        let r = parse(&out);
        let errors = r["errors"].as_array().unwrap();
        let e = errors.iter().find(|e| e["path"] == path).unwrap_or_else(|| panic!("{tag}: {r}"));
        for part in parts {
            assert!(e["message"].as_str().unwrap().contains(part), "{tag}: {e}");
        }
    }
    // A BOM is accepted; a negative size names the field and its range.
    let bom = TempSpec::new("bom", "\u{feff}Model(name: \"bom\")");
    assert!(widen_check(&bom.0, true).status.success());
    let negative = TempSpec::new("negative", "Model(train: (batch: -4))");
    let r = parse(&widen_check(&negative.0, true));
    let message = r["errors"][0]["message"].as_str().unwrap();
    assert!(message.contains("in `train.batch`: -4 is not valid") && message.contains("1..=1048576"), "{r}");
}

#[test]
fn a_data_file_that_train_would_not_find_is_a_warning() {
    let dir = common::workdir("check-data", None);
    std::fs::create_dir_all(dir.join("specs")).unwrap();
    std::fs::write(dir.join("specs/corpus.txt"), "some text ".repeat(100)).unwrap();
    std::fs::write(dir.join("specs/s.ron"), "Model(name: \"s\", train: (data: Text(\"corpus.txt\")))")
        .unwrap();
    let o = common::widen(&dir, &["check", "specs/s.ron"]);
    assert!(o.status.success(), "a warning, not an error: {}", common::stderr(&o));
    let e = common::stderr(&o);
    assert!(
        e.contains("warning: train.data: Text(\"corpus.txt\") does not exist from the working folder"),
        "{e}"
    );
    assert!(e.contains("specs/corpus.txt is beside the spec"), "{e}");
    // Found from the working folder: no warning.
    let o = common::widen(&dir.join("specs"), &["check", "s.ron"]);
    assert!(o.status.success() && !common::stderr(&o).contains("warning"), "{}", common::stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Names other papers use, and fields written in the wrong place, get widen's name:
/// `Vwn` is `Ghc` (docs/math.md §5), `train.lr` is `train.optimizer.lr`.
#[test]
fn vwn_points_at_ghc_and_a_misplaced_field_at_its_path() {
    let spec = TempSpec::new(
        "aliases",
        "Model(name: \"v\", d_model: 64, heads: 4, residual: Vwn(m: 2, n: 4), train: (lr: 1e-3))\n",
    );
    let out = widen_check(&spec.0, false);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("unknown variant `Vwn` for residual; did you mean `Ghc`?"), "{e}");
    assert!(e.contains("unknown field `lr` in train; did you mean `train.optimizer.lr`"), "{e}");
}

/// `widen check --set` checks the spec with the values, as `widen train --set` trains it.
#[test]
fn check_set_checks_the_spec_with_the_values() {
    let spec = TempSpec::new("set", "Model(name: \"s\", d_model: 64, heads: 4)\n");
    let base = parse(&widen_check(&spec.0, true));
    let wider = Command::new(env!("CARGO_BIN_EXE_widen"))
        .args(["check", "--json", "--set", "d_model=128"])
        .arg(&spec.0)
        .output()
        .unwrap();
    assert!(wider.status.success(), "{}", String::from_utf8_lossy(&wider.stderr));
    let wider = parse(&wider);
    assert!(uint(&wider["params"], "total") > uint(&base["params"], "total"), "{wider}");
    let bad = Command::new(env!("CARGO_BIN_EXE_widen"))
        .args(["check", "--json", "--set", "residual=Vwn(m: 2, n: 4)"])
        .arg(&spec.0)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let r = parse(&bad);
    assert_eq!(r["valid"], Value::Bool(false));
    let err = &r["errors"][0];
    assert_eq!(err["path"], "residual", "{r}");
    assert!(err["message"].as_str().unwrap().contains("did you mean `Ghc`"), "{r}");
}

#[test]
fn token_shards_train_could_not_open_are_a_warning() {
    let dir = common::workdir("check-tokens", None);
    std::fs::write(
        dir.join("s.ron"),
        "Model(name: \"s\", train: (data: Tokens(train: \"tok/x_train_*.bin\")))",
    )
    .unwrap();
    let o = common::widen(&dir, &["check", "s.ron"]);
    assert!(o.status.success(), "a warning, not an error: {}", common::stderr(&o));
    let e = common::stderr(&o);
    assert!(e.contains("warning: train.data.train: ") && e.contains("tok/x_train_*.bin"), "{e}");
    // A shard without a header is named, with what to state.
    std::fs::create_dir_all(dir.join("tok")).unwrap();
    std::fs::write(dir.join("tok/x_train_0.bin"), [1u8, 0, 2, 0]).unwrap();
    let e = common::stderr(&common::widen(&dir, &["check", "s.ron"]));
    assert!(e.contains("x_train_0.bin") && e.contains("dtype"), "{e}");
    std::fs::write(
        dir.join("s.ron"),
        "Model(name: \"s\", train: (data: Tokens(train: \"tok/x_train_*.bin\", dtype: U16)))",
    )
    .unwrap();
    let e = common::stderr(&common::widen(&dir, &["check", "s.ron"]));
    assert!(!e.contains("warning: train.data"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
