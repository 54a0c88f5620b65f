//! `mpirun -n 2 widen train` (docs/distributed.md): two ranks at a global batch
//! train the model one process trains at that batch, a checkpoint of two ranks
//! resumes on one, a rank that dies or stops answering ends the run, and a
//! trainer of `widen build` trains across ranks like `widen train`.
//!
//! Run with `cargo test -p widen --features mpi --test cli_mpi`. Each test skips
//! with a printed reason where `mpirun` is missing; without the `mpi` feature
//! only the test of the refusal to run under a launcher is built.

mod common;

use common::stderr;
use std::path::Path;
use std::process::Command;

/// `specs/<file>` shrunk for a fast test: width 16, 16-token windows, global
/// batch 4, 5 steps with checkpoints every 2, evaluation at the end.
fn small_spec(file: &str) -> String {
    let text = std::fs::read_to_string(common::spec_file(file)).unwrap();
    let shrunk = text
        .replace("d_model: 64,", "d_model: 16,")
        .replace("seq_len: 64,", "seq_len: 16,")
        .replace("batch: 8,", "batch: 4, checkpoint_every: 2, eval_batches: 1,")
        .replace("steps: 300,", "steps: 5,")
        .replace("warmup: 30", "warmup: 2");
    assert_ne!(shrunk, text, "specs/{file} no longer has the fields this test shrinks");
    shrunk
}

/// The `(step, loss, val_loss)` of every line of a run's metrics, with its world size.
fn metrics(run: &Path) -> Vec<(u64, f64, Option<f64>, u64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["val_loss"].as_f64(),
                v["world_size"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use super::*;
    use std::process::Output;
    use std::time::{Duration, Instant};

    /// Whether `mpirun` runs here; prints why a test skips when it does not.
    fn mpirun_present(test: &str) -> bool {
        let ok = Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
        if !ok {
            eprintln!("skipping {test}: `mpirun` (Open MPI) is not on PATH");
        }
        ok
    }

    /// `mpirun -n RANKS widen ARGS` in `dir`, with extra environment `env`.
    fn mpirun(dir: &Path, ranks: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
        mpirun_program(dir, Path::new(env!("CARGO_BIN_EXE_widen")), ranks, args, env)
    }

    /// `mpirun -n RANKS PROGRAM ARGS` in `dir`, with extra environment `env`.
    fn mpirun_program(
        dir: &Path,
        program: &Path,
        ranks: usize,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Output {
        let mut cmd = Command::new("mpirun");
        cmd.current_dir(dir)
            .args(["--allow-run-as-root", "--oversubscribe", "-n", &ranks.to_string()])
            .arg(program)
            .args(args)
            .envs(env.iter().copied());
        cmd.output().unwrap()
    }

    /// Losses of two runs agree to this relative tolerance: the ranks sum their
    /// gradients in another order than one process's backward pass does (f32),
    /// so the runs drift apart by rounding, step by step.
    const LOSS_RTOL: f64 = 2e-5;

    /// Parameters agree to this absolute tolerance after 5 steps. AdamW divides
    /// each gradient by the root of its second moment, so an element whose
    /// gradient is rounding noise in both runs may move by up to the learning
    /// rate (3e-3 here) per step in different directions; such elements are few.
    /// Held: the 99.9th percentile of the differences under 1e-4, the largest under
    /// 2 * lr * steps.
    fn assert_params_close(a: &Path, b: &Path, what: &str) {
        let header = common::safetensors_header(a);
        let names: Vec<String> = header
            .as_object()
            .unwrap()
            .keys()
            .filter(|n| *n != "__metadata__" && !n.starts_with("opt.") && header[*n]["dtype"] == "F32")
            .cloned()
            .collect();
        assert!(!names.is_empty());
        let mut diffs = Vec::new();
        for name in &names {
            let (x, y) = (common::safetensors_f32(a, name), common::safetensors_f32(b, name));
            assert_eq!(x.len(), y.len(), "{what}: {name}");
            diffs.extend(x.iter().zip(&y).map(|(p, q)| (p - q).abs()));
        }
        diffs.sort_by(f32::total_cmp);
        let p999 = diffs[diffs.len() * 999 / 1000];
        let max = *diffs.last().unwrap();
        assert!(p999 < 1e-4 && max < 2.0 * 3e-3 * 5.0, "{what}: parameters differ: p99.9 {p999}, max {max}");
    }

    fn assert_losses_close(one: &Path, two: &Path, what: &str) {
        let (a, b) = (metrics(one), metrics(two));
        assert_eq!(a.len(), 5, "{what}: {a:?}");
        assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
        for ((sa, la, va, wa), (sb, lb, vb, wb)) in a.iter().zip(&b) {
            assert_eq!((sa, wa, wb), (sb, &1, &2), "{what}");
            assert!((la - lb).abs() <= LOSS_RTOL * la.abs(), "{what}: step {sa}: loss {la} vs {lb}");
            assert_eq!(va.is_some(), vb.is_some(), "{what}: step {sa}");
            if let (Some(va), Some(vb)) = (va, vb) {
                assert!((va - vb).abs() <= LOSS_RTOL * va.abs(), "{what}: step {sa}: val_loss {va} vs {vb}");
            }
        }
    }

    /// One process at global batch 4 against two ranks of 2 rows each.
    fn two_ranks_train_like_one(file: &str, device: &str) {
        let test = format!("two_ranks_train_like_one({file}, {device})");
        if !mpirun_present(&test) {
            return;
        }
        let dir = common::workdir(
            &format!("mpi-{}-{device}", file.trim_end_matches(".ron")),
            Some(&small_spec(file)),
        );
        let one = common::widen(&dir, &["train", "spec.ron", "--device", device, "--out", "one"]);
        assert!(one.status.success(), "{test}: one process: {}", stderr(&one));
        let two = mpirun(&dir, 2, &["train", "spec.ron", "--device", device, "--out", "two"], &[]);
        assert!(two.status.success(), "{test}: two ranks: {}", stderr(&two));
        let first = stderr(&two).lines().next().unwrap_or_default().to_string();
        assert!(
            first.contains("world_size 2") && first.contains("2 per rank"),
            "{test}: first line {first:?}"
        );
        assert_losses_close(&dir.join("one"), &dir.join("two"), &test);
        assert_params_close(&dir.join("one/final.safetensors"), &dir.join("two/final.safetensors"), &test);
    }

    #[test]
    fn two_ranks_train_tiny_like_one_process_on_reference() {
        two_ranks_train_like_one("tiny.ron", "reference");
    }

    #[test]
    fn two_ranks_train_tiny_like_one_process_on_cpu() {
        two_ranks_train_like_one("tiny.ron", "cpu");
    }

    #[test]
    fn two_ranks_train_mhc_like_one_process_on_reference() {
        two_ranks_train_like_one("mhc.ron", "reference");
    }

    #[test]
    fn two_ranks_train_mhc_like_one_process_on_cpu() {
        two_ranks_train_like_one("mhc.ron", "cpu");
    }

    /// A checkpoint of two ranks continues on one with the batches an
    /// uninterrupted run draws: its later losses match the two ranks' own.
    #[test]
    fn a_checkpoint_of_two_ranks_resumes_on_one() {
        let test = "a_checkpoint_of_two_ranks_resumes_on_one";
        if !mpirun_present(test) {
            return;
        }
        let dir = common::workdir("mpi-resume", Some(&small_spec("tiny.ron")));
        let two = mpirun(&dir, 2, &["train", "spec.ron", "--device", "reference", "--out", "two"], &[]);
        assert!(two.status.success(), "{}", stderr(&two));
        let args = [
            "train",
            "spec.ron",
            "--device",
            "reference",
            "--out",
            "one",
            "--resume",
            "two/ckpt-2.safetensors",
        ];
        let one = common::widen(&dir, &args);
        assert!(one.status.success(), "{}", stderr(&one));
        let (a, b) = (metrics(&dir.join("two")), metrics(&dir.join("one")));
        assert_eq!(b.len(), 5, "the new folder holds the whole run's record: {b:?}");
        for ((sa, la, _, wa), (sb, lb, _, wb)) in a.iter().zip(&b) {
            assert_eq!(sa, sb);
            assert_eq!(*wa, 2);
            assert_eq!(*wb, if *sb <= 2 { 2 } else { 1 }, "step {sb}");
            assert!((la - lb).abs() <= LOSS_RTOL * la.abs(), "step {sa}: loss {la} vs {lb}");
        }
        assert_params_close(&dir.join("two/final.safetensors"), &dir.join("one/final.safetensors"), test);
    }

    /// A rank that exits in the middle of the run ends it with an error within
    /// a few seconds; the checkpoint before it stays whole.
    #[test]
    fn a_rank_that_dies_ends_the_run() {
        let test = "a_rank_that_dies_ends_the_run";
        if !mpirun_present(test) {
            return;
        }
        let dir = common::workdir("mpi-dies", Some(&small_spec("tiny.ron")));
        let started = Instant::now();
        let args = ["train", "spec.ron", "--device", "reference", "--out", "run"];
        let o = mpirun(&dir, 2, &args, &[("WIDEN_MPI_TEST_FAULT", "1:3:exit")]);
        let took = started.elapsed();
        assert!(!o.status.success(), "{}", stderr(&o));
        assert!(took < Duration::from_secs(60), "the run took {took:?} to end");
        assert!(stderr(&o).contains("ends this rank at step 3"), "{}", stderr(&o));
        let run = dir.join("run");
        assert!(!run.join("final.safetensors").exists());
        // The checkpoint of step 2 is whole: a resume on one process finishes the run.
        let o = common::widen(
            &dir,
            &[
                "train",
                "spec.ron",
                "--device",
                "reference",
                "--out",
                "rest",
                "--resume",
                "run/ckpt-2.safetensors",
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
    }

    /// A rank that stops answering ends the run once the others have waited
    /// `WIDEN_MPI_TIMEOUT_S` in an all-reduce.
    #[test]
    fn a_rank_that_hangs_ends_the_run_within_the_timeout() {
        let test = "a_rank_that_hangs_ends_the_run_within_the_timeout";
        if !mpirun_present(test) {
            return;
        }
        let dir = common::workdir("mpi-hangs", Some(&small_spec("tiny.ron")));
        let started = Instant::now();
        let args = ["train", "spec.ron", "--device", "reference", "--out", "run"];
        let env = [("WIDEN_MPI_TEST_FAULT", "1:3:hang"), ("WIDEN_MPI_TIMEOUT_S", "2")];
        let o = mpirun(&dir, 2, &args, &env);
        let took = started.elapsed();
        assert!(!o.status.success(), "{}", stderr(&o));
        assert!(took < Duration::from_secs(60), "the run took {took:?} to end");
        assert!(stderr(&o).contains("no answer from the other ranks"), "{}", stderr(&o));
        assert!(dir.join("run/ckpt-2.safetensors").exists());
    }

    /// A trainer of `widen build` from a widen built with MPI trains across the
    /// launcher's ranks as `widen train` does: the same losses, bit for bit (each rank
    /// compiles its Plans for its shard, as `widen train`'s ranks do). Built with
    /// `--profile dev` into the workspace's target folder, like `cli_build`.
    #[test]
    fn slow_a_built_trainer_trains_across_ranks_like_widen_train() {
        let test = "slow_a_built_trainer_trains_across_ranks_like_widen_train";
        if !mpirun_present(test) {
            return;
        }
        let dir = common::workdir("mpi-build", Some(&small_spec("tiny.ron")));
        let target =
            Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("target/tmp is inside the target folder");
        let o = Command::new(env!("CARGO_BIN_EXE_widen"))
            .current_dir(&dir)
            .env("CARGO_TARGET_DIR", target)
            .env("WIDEN_CACHE_DIR", dir.join("cache"))
            .args(["build", "--profile", "dev", "spec.ron", "-o", "trainer"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let args = ["--device", "reference", "--out", "built"];
        let built = mpirun_program(&dir, &dir.join("trainer"), 2, &args, &[("WIDEN_CACHE_DIR", "cache")]);
        assert!(built.status.success(), "{}", stderr(&built));
        let two = mpirun(&dir, 2, &["train", "spec.ron", "--device", "reference", "--out", "two"], &[]);
        assert!(two.status.success(), "{}", stderr(&two));
        let (built, two) = (metrics(&dir.join("built")), metrics(&dir.join("two")));
        assert_eq!(built.len(), 5, "{built:?}");
        assert!(built.iter().all(|m| m.3 == 2), "world_size 2 in every record: {built:?}");
        assert_eq!(built, two, "the built trainer's ranks train what widen train's do");
    }

    /// One rank under `mpirun` is a single process: the same losses, bit for bit.
    #[test]
    fn one_rank_trains_bit_for_bit_like_one_process() {
        let test = "one_rank_trains_bit_for_bit_like_one_process";
        if !mpirun_present(test) {
            return;
        }
        let dir = common::workdir("mpi-one", Some(&small_spec("tiny.ron")));
        let plain = common::widen(&dir, &["train", "spec.ron", "--device", "reference", "--out", "plain"]);
        assert!(plain.status.success(), "{}", stderr(&plain));
        let one = mpirun(&dir, 1, &["train", "spec.ron", "--device", "reference", "--out", "one"], &[]);
        assert!(one.status.success(), "{}", stderr(&one));
        let (a, b) = (metrics(&dir.join("plain")), metrics(&dir.join("one")));
        assert_eq!(a.len(), 5);
        assert_eq!(a, b, "losses, validation losses and world sizes");
    }

    /// `--device cuda` across ranks takes the NCCL path. Without a CUDA
    /// driver every rank stops with the single-process message, and with
    /// the driver but no libnccl with one naming libnccl: no panic, no hang,
    /// nothing written.
    #[test]
    fn cuda_across_ranks_fails_cleanly_without_a_driver_or_nccl() {
        let test = "cuda_across_ranks_fails_cleanly_without_a_driver_or_nccl";
        if !mpirun_present(test) {
            return;
        }
        let expected = if !runtime::device::cuda::driver_available() {
            "no CUDA driver"
        } else if !runtime::device::cuda::nccl::nccl_available() {
            "libnccl.so.2 could not be loaded"
        } else {
            eprintln!(
                "skipping {test}: the CUDA driver and libnccl load here (scripts/gpu_check.sh checks NCCL)"
            );
            return;
        };
        let dir = common::workdir("mpi-cuda", Some(&small_spec("tiny.ron")));
        let started = Instant::now();
        let o = mpirun(&dir, 2, &["train", "spec.ron", "--device", "cuda", "--out", "run"], &[]);
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains(expected) && e.contains("error (rank "), "{e}");
        assert!(!e.contains("panicked"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(120), "the ranks stop at once");
        assert!(!dir.join("run").exists(), "nothing is written");
    }

    #[test]
    fn a_global_batch_that_does_not_divide_is_refused() {
        let test = "a_global_batch_that_does_not_divide_is_refused";
        if !mpirun_present(test) {
            return;
        }
        let spec = small_spec("tiny.ron").replace("batch: 4,", "batch: 5,");
        let dir = common::workdir("mpi-batch", Some(&spec));
        let o = mpirun(&dir, 2, &["train", "spec.ron", "--device", "reference", "--out", "run"], &[]);
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains("train.batch = 5") && e.contains("2 ranks"), "{e}");
    }
}

/// A build without MPI refuses to run as one of several launched processes,
/// which would train independent copies, and says how to enable MPI.
#[cfg(not(feature = "mpi"))]
#[test]
fn a_build_without_mpi_refuses_a_launcher_of_several_processes() {
    let dir = common::workdir("mpi-off", Some(&small_spec("tiny.ron")));
    let o = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(&dir)
        .args(["train", "spec.ron", "--device", "reference"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("cargo build --release --features mpi") && e.contains("independent copies"), "{e}");
    assert!(!dir.join("runs").exists(), "nothing is trained");
    let help = common::widen(&dir, &["train", "--help"]);
    assert!(String::from_utf8_lossy(&help.stdout).contains("--features mpi"));
    // One launched process is an ordinary run.
    let o = Command::new(env!("CARGO_BIN_EXE_widen"))
        .current_dir(&dir)
        .args(["train", "spec.ron", "--device", "reference", "--steps", "1"])
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let run = dir.join("runs/tiny");
    assert_eq!(metrics(&run).iter().map(|m| m.3).collect::<Vec<_>>(), vec![1]);
}
