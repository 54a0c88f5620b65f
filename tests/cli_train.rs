//! `widen train` and `widen sample` as a user runs them.

mod common;

use common::{stderr, widen};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SPEC: &str = r#"Model(
    name: "cli-tiny",
    vocab: 256, d_model: 16, layers: 1, heads: 2,
    train: (seq_len: 16, batch: 2, steps: 4, eval_every: 2, eval_batches: 1, checkpoint_every: 2,
            optimizer: AdamW(lr: 1e-2), schedule: Constant(warmup: 1)),
)
"#;

#[test]
fn train_writes_the_run_folder_and_sample_continues_the_prompt() {
    let dir = common::workdir("train-train", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = dir.join("runs/cli-tiny");
    for f in ["metrics.jsonl", "ckpt-2.safetensors", "ckpt-4.safetensors", "final.safetensors"] {
        assert!(run.join(f).exists(), "missing {f}");
    }
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 4);
    assert!(stderr(&o).contains("step 4/4"), "{}", stderr(&o));

    // A second fresh run into the same folder is refused; --resume continues it.
    let o = widen(&dir, &["train", "spec.ron"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("metrics.jsonl"), "{}", stderr(&o));
    // Resuming the older checkpoint in its folder would replace ckpt-4 and the
    // final checkpoint: refused, naming them, unless --overwrite says so.
    let resume = ["train", "spec.ron", "--resume", "runs/cli-tiny/ckpt-2.safetensors", "--steps", "6"];
    let o = widen(&dir, &resume);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("ckpt-4.safetensors") && e.contains("final.safetensors") && e.contains("--overwrite"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(), lines, "nothing was replaced");
    let o = widen(&dir, &[&resume[..], &["--overwrite"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 6);

    let args =
        ["sample", "runs/cli-tiny/final.safetensors", "--prompt", "Hello", "--tokens", "10", "--seed", "3"];
    let a = widen(&dir, &args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(a.stdout.starts_with(b"Hello"));
    assert_eq!(a.stdout.len(), "Hello".len() + 10 + 1);
    assert_eq!(a.stdout, widen(&dir, &args).stdout, "same seed, same text");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn data_override_errors_name_the_file() {
    let dir = common::workdir("train-data", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--data", "absent.txt", "--out", "run"]);
    assert!(!o.status.success());
    // The whole chain, each fact once.
    assert_eq!(
        stderr(&o),
        "error: training spec.ron (run folder run): cannot read training text absent.txt: \
         No such file or directory (os error 2)\n"
    );
    let o = widen(&dir, &["train", "spec.ron", "--data", "absent.txt", "--steps", "0", "--out", "run"]);
    assert_eq!(
        stderr(&o),
        "error: initializing spec.ron (run folder run): cannot read training text absent.txt: \
         No such file or directory (os error 2)\n"
    );
    std::fs::write(dir.join("short.txt"), "too short").unwrap();
    let o = widen(&dir, &["train", "spec.ron", "--data", "short.txt", "--out", "run"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("short.txt") && e.contains("170"), "{e}");
    // A long enough file trains.
    let text: String = "the quick brown fox jumps over the lazy dog. ".repeat(20);
    std::fs::write(dir.join("ok.txt"), text).unwrap();
    let o = widen(&dir, &["train", "spec.ron", "--data", "ok.txt", "--out", "run", "--steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sampling_a_corrupt_checkpoint_names_it() {
    let dir = common::workdir("train-corrupt", Some(SPEC));
    std::fs::write(dir.join("bad.safetensors"), b"\x08\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let o = widen(&dir, &["sample", "bad.safetensors", "--prompt", "x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("bad.safetensors"), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

/// `(step, loss)` of each line of a run's metrics.
fn metrics(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// Starts `widen ARGS` in `dir` without waiting for it.
fn spawn(dir: &Path, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the run in `run` has written a metrics line.
fn wait_for_a_step(run: &Path, child: &mut Child) {
    let started = Instant::now();
    while metrics(run).is_empty() {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.stderr.take().map(std::io::read_to_string).unwrap().unwrap();
            panic!("the run ended before its first step ({status}): {out}");
        }
        assert!(started.elapsed() < Duration::from_secs(300), "no step after 300 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, name: &str) {
    let status = Command::new("kill").args([&format!("-{name}"), &child.id().to_string()]).status().unwrap();
    assert!(status.success());
}

/// A long run on the reference device (steps are fast, no C compiler involved).
const LONG: &[&str] = &["train", "spec.ron", "--device", "reference", "--steps", "100000", "--out", "run"];

#[test]
fn ctrl_c_saves_the_run_and_the_printed_command_continues_it() {
    let dir = common::workdir("train-sigint", Some(SPEC));
    let run = dir.join("run");
    let mut child = spawn(&dir, LONG);
    wait_for_a_step(&run, &mut child);
    signal(&child, "INT");
    let o = child.wait_with_output().unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{e}");
    let done = metrics(&run);
    let k = done.last().unwrap().0;
    assert_eq!(done.iter().map(|m| m.0).collect::<Vec<_>>(), (1..=k).collect::<Vec<u64>>());
    let ckpt = format!("run/ckpt-{k}.safetensors");
    assert!(dir.join(&ckpt).exists(), "{e}");
    let command = e.lines().find_map(|l| l.strip_prefix("continue with: ")).unwrap_or_else(|| panic!("{e}"));
    assert_eq!(
        command,
        format!("widen train spec.ron --steps 100000 --out run --resume {ckpt} --device reference")
    );

    // The printed command, with a shorter budget, finishes the run; its losses
    // are those of a run never interrupted.
    let mut words: Vec<String> = command.split(' ').skip(1).map(String::from).collect();
    let at = words.iter().position(|w| w == "--steps").unwrap() + 1;
    words[at] = (k + 3).to_string();
    let args: Vec<&str> = words.iter().map(String::as_str).collect();
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let steps = (k + 3).to_string();
    let fresh = ["train", "spec.ron", "--device", "reference", "--steps", &steps, "--out", "fresh"];
    let o = widen(&dir, &fresh);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&run), metrics(&dir.join("fresh")));
    assert_eq!(metrics(&run).len() as u64, k + 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_second_run_on_the_same_folder_is_refused_naming_the_first() {
    let dir = common::workdir("train-lock", Some(SPEC));
    let run = dir.join("run");
    let mut first = spawn(&dir, LONG);
    wait_for_a_step(&run, &mut first);
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--out", "run"]);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(
        e.contains("in use by another training run") && e.contains(&format!("pid {}", first.id())),
        "{e}"
    );
    // A resume into the folder is refused the same way.
    let resume =
        ["train", "spec.ron", "--device", "reference", "--out", "run", "--resume", "run/ckpt-2.safetensors"];
    let o = widen(&dir, &resume);
    assert!(stderr(&o).contains("in use by another training run"), "{}", stderr(&o));
    signal(&first, "TERM");
    let o = first.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    // Only the first run wrote the metrics: every step once, in order.
    let steps: Vec<u64> = metrics(&run).iter().map(|m| m.0).collect();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A save that fails (here: past a file size limit, as on a full disk) leaves no
/// partial file, keeps the last good checkpoint and names it.
#[test]
fn a_failed_save_keeps_and_names_the_last_good_checkpoint() {
    let dir = common::workdir("train-efbig", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--steps", "2", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let good = std::fs::read(dir.join("run/ckpt-2.safetensors")).unwrap();
    // `ulimit -f` counts 512- or 1024-byte blocks depending on the shell: a
    // quarter of the checkpoint's size in 1024-byte blocks is below it either way.
    let blocks = (good.len() / 4096).max(1);
    let script = format!("trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" \"$@\"");
    let o = Command::new("sh")
        .current_dir(&dir)
        .args(["-c", &script, env!("CARGO_BIN_EXE_widen")])
        .args(["train", "spec.ron", "--device", "reference", "--steps", "3", "--out", "run"])
        .args(["--resume", "run/ckpt-2.safetensors"])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("cannot save the checkpoint of step 3"), "{e}");
    assert!(e.contains("the last good checkpoint is run/ckpt-2.safetensors at step 2"), "{e}");
    assert!(
        e.contains("continue with: widen train spec.ron --steps 3 --out run --resume run/ckpt-2.safetensors"),
        "{e}"
    );
    let mut names: Vec<String> = std::fs::read_dir(dir.join("run"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["ckpt-2.safetensors", "final.safetensors", "metrics.jsonl"],
        "no .tmp and no run.lock left"
    );
    assert_eq!(std::fs::read(dir.join("run/ckpt-2.safetensors")).unwrap(), good);
    assert_eq!(metrics(&dir.join("run")).len(), 3);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The README's promise: a run can be extended with a longer --steps on resume,
/// even when its short first part had its warmup rescaled; the model itself
/// cannot change.
#[test]
fn a_run_extends_with_a_longer_step_budget_but_not_another_model() {
    let spec = SPEC.replace("steps: 4", "steps: 20").replace("warmup: 1", "warmup: 5");
    let dir = common::workdir("train-extend", Some(&spec));
    let first = ["train", "spec.ron", "--device", "reference", "--steps", "4", "--out", "run"];
    let o = widen(&dir, &first);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("warmup scaled to 1"), "{}", stderr(&o));
    let longer = ["train", "spec.ron", "--device", "reference", "--steps", "8", "--out", "run"];
    let o = widen(&dir, &[&longer[..], &["--resume", "run/final.safetensors"]].concat());
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("recomputed for 8 steps"), "{e}");
    let steps: Vec<u64> = metrics(&dir.join("run")).iter().map(|m| m.0).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());

    std::fs::write(dir.join("wide.ron"), spec.replace("d_model: 16", "d_model: 32")).unwrap();
    let o = widen(
        &dir,
        &[
            "train",
            "wide.ron",
            "--device",
            "reference",
            "--out",
            "wide",
            "--resume",
            "run/ckpt-4.safetensors",
        ],
    );
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(e.contains("differs at: d_model") && e.contains("ckpt-4.safetensors"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sample_refuses_a_diverged_checkpoint_and_an_absurd_token_count() {
    let dir = common::workdir("train-sample-bad", Some(SPEC));
    let o = widen(&dir, &["train", "spec.ron", "--device", "reference", "--steps", "2", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let path = dir.join("run/final.safetensors");
    let o = widen(&dir, &["sample", "run/final.safetensors", "--prompt", "x", "--tokens", "100000000000000"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("'100000000000000' for '--tokens") && e.contains("1..=1048576"), "{e}");

    // Poison one parameter the way a diverged step would.
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = header["embed"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    let o = widen(&dir, &["sample", "run/final.safetensors", "--prompt", "x", "--device", "reference"]);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(o.stdout.is_empty(), "no garbage on stdout");
    assert!(e.contains("final.safetensors") && e.contains("`embed`") && e.contains("non-finite"), "{e}");
    let resume =
        ["train", "spec.ron", "--device", "reference", "--out", "run", "--resume", "run/final.safetensors"];
    let o = widen(&dir, &resume);
    assert!(stderr(&o).contains("`embed`"), "{}", stderr(&o));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A spec that validates (under the fixed ceiling) but needs more memory than this
/// machine has is refused by `train`, `compile` and `build` before anything is
/// lowered or allocated, naming the field and the estimate.
#[test]
fn specs_larger_than_this_machine_are_refused_before_building() {
    if std::fs::read_to_string("/proc/meminfo").is_err() {
        eprintln!("skipped: /proc/meminfo is not readable, so the machine's memory is unknown");
        return;
    }
    let big = "Model(name: \"big\", d_model: 16384, heads: 128, layers: 64)\n";
    let dir = common::workdir("train-too-big", Some(big));
    for args in [
        &["train", "spec.ron", "--steps", "2"][..],
        &["compile", "spec.ron", "-o", "out"][..],
        &["build", "spec.ron", "-o", "trainer"][..],
    ] {
        let started = Instant::now();
        let o = widen(&dir, args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?}: {e}");
        assert!(e.contains("layers: training needs about") && e.contains("GiB of memory available"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30), "{args:?} refused without building");
    }
    assert!(!dir.join("runs/big").join("metrics.jsonl").exists());
    assert!(!dir.join("trainer").exists());
}

/// `--set` takes the sweep's field paths and RON values: the run trains (and its
/// checkpoint holds) the spec with them, says so first, and a mistyped path gets the
/// sweep's suggestion.
#[test]
fn train_set_trains_the_spec_with_the_values_and_suggests_a_path() {
    let dir = common::workdir("train-set", Some(SPEC));
    let args = [
        "train",
        "spec.ron",
        "--set",
        "train.optimizer.lr=3e-3",
        "--set",
        "d_model=32",
        "--device",
        "reference",
        "--out",
        "run",
    ];
    let o = widen(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.lines().next().unwrap().contains("--set train.optimizer.lr=3e-3, d_model=32"), "{e}");
    let meta = &common::safetensors_header(&dir.join("run/final.safetensors"))["__metadata__"];
    let spec: serde_json::Value = serde_json::from_str(meta["spec_json"].as_str().unwrap()).unwrap();
    assert_eq!(spec["d_model"], 32);
    assert_eq!(spec["train"]["optimizer"]["AdamW"]["lr"].as_f64().unwrap() as f32, 3e-3);
    let lr1 = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(lr1.lines().next().unwrap()).unwrap();
    assert!((first["lr"].as_f64().unwrap() - 3e-3).abs() < 1e-9, "{first}");

    // A path with the right last name elsewhere: the sweep's suggestion, nothing trained.
    let o = widen(&dir, &["train", "spec.ron", "--set", "train.lr=1e-3", "--out", "bad"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("`train.lr`") && e.contains("did you mean `train.optimizer.lr`"), "{e}");
    // A value of the wrong type names the path and what it takes, as in a sweep.
    let o = widen(&dir, &["train", "spec.ron", "--set", "layers=two", "--out", "bad"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("`layers` = two: expected a whole number"), "{}", stderr(&o));
    // The values are validated with the rest of the spec.
    let o = widen(&dir, &["train", "spec.ron", "--set", "d_model=33", "--out", "bad"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("d_model = 33"), "{}", stderr(&o));
    // One value per field: several are a sweep.
    let o = widen(&dir, &["train", "spec.ron", "--set", "d_model=32,64", "--out", "bad"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("2 values"), "{}", stderr(&o));
    assert!(!dir.join("bad").exists(), "refused before anything is written");

    // The command that continues a run repeats the values: a resume trains the same spec.
    let o = widen(&dir, &["train", "spec.ron", "--set", "d_model=32", "--steps", "0", "--out", "init"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    let command = e.split("continue with: ").nth(1).unwrap_or_else(|| panic!("{e}")).trim();
    assert!(command.starts_with("widen train spec.ron --set d_model=32 --out init --resume "), "{command}");
    let words: Vec<&str> = command.split_whitespace().skip(1).collect();
    let o = widen(&dir, &[&words[..], &["--device", "reference"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cold kernel cache is not a silent wait: the compile shows what it compiles and
/// how long it took, and the step lines say the time elapsed and left. Piped stderr
/// gets plain lines.
#[test]
fn train_shows_the_kernel_compile_and_an_eta() {
    let dir = common::workdir("train-compile-progress", Some(SPEC));
    let cache = dir.join("cache");
    let o = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(&dir)
        .env("WIDEN_CACHE_DIR", &cache)
        .args(["train", "spec.ron", "--device", "cpu", "--out", "run"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(!e.contains('\r') && !e.contains('\x1b'), "no control codes in a log: {e:?}");
    let eta = e.lines().find(|l| l.starts_with("step 4/4")).unwrap_or_else(|| panic!("{e}"));
    assert!(eta.contains("elapsed ") && eta.ends_with("ETA 0s"), "{eta}");
    assert!(e.lines().any(|l| l.contains("kernels for cpu") && l.contains("done in")), "{e}");
    // Cached now: nothing compiles, nothing is said about it.
    let o = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(&dir)
        .env("WIDEN_CACHE_DIR", &cache)
        .args(["train", "spec.ron", "--device", "cpu", "--out", "run2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("kernels for cpu"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}
