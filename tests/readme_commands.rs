//! The README's commands run as written and in the order printed: the quick ones
//! (`check`, `train --steps 0`, `compile`, and `sweep` as a dry run) are taken from
//! its Commands block, with the optional `[...]` parts left out, and run in a scratch
//! folder that sees the repository's `specs/`, after a short run of the README's
//! first line. A renamed command, flag or spec file fails here.

mod common;

use common::{stderr, widen};
use std::path::Path;

/// The `widen ...` lines of the README's Commands block, without comments and
/// optional parts, as argument lists.
fn readme_commands() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let block = readme.split("## Commands").nth(1).expect("the README has a Commands section");
    let block = block.split("```").nth(1).expect("a code block under Commands");
    block
        .lines()
        .filter_map(|l| l.trim().strip_prefix("widen "))
        .map(|l| {
            let l = l.split(" # ").next().unwrap_or(l);
            words(&drop_optional(l))
        })
        .collect()
}

/// `a [b [c]] d` -> `a d`.
fn drop_optional(line: &str) -> String {
    let mut depth = 0usize;
    line.chars()
        .filter(|&c| {
            match c {
                '[' => depth += 1,
                ']' => {
                    depth = depth.saturating_sub(1);
                    return false;
                }
                _ => {}
            }
            depth == 0
        })
        .collect()
}

/// Shell words: spaces split, double quotes group.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut quoted) = (Vec::new(), String::new(), false);
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
            }
            _ => word.push(c),
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

#[test]
fn the_quick_readme_commands_run_as_written() {
    let commands = readme_commands();
    let dir = common::workdir("readme", None);
    std::os::unix::fs::symlink(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs"), dir.join("specs"))
        .unwrap();
    // The commands run in the order printed, after the README's first line: the
    // default run folder already holds a run (two steps of it stand in for the
    // whole training here).
    let first = widen(&dir, &["train", "specs/tiny.ron", "--steps", "2", "--device", "reference"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let mut ran = Vec::new();
    for args in &commands {
        let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
        match args[0] {
            "check" | "compile" => {}
            "train" if args.contains(&"--steps") => {}
            "sweep" => args.push("--dry-run"),
            _ => continue,
        }
        let o = widen(&dir, &args);
        assert!(o.status.success(), "README command `widen {}` failed:\n{}", args.join(" "), stderr(&o));
        ran.push(args[0].to_string());
    }
    for want in ["check", "train", "compile", "sweep"] {
        assert!(
            ran.iter().any(|r| r == want),
            "the README's Commands block has no quick `{want}` line: {commands:?}"
        );
    }
    assert!(
        dir.join("runs/tiny-init/init.safetensors").exists(),
        "train --steps 0 writes the initial checkpoint"
    );
    assert!(dir.join("out/mhc/kernels.c").exists(), "compile writes the kernels");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn optional_parts_and_quotes_are_read_as_a_shell_user_reads_them() {
    assert_eq!(drop_optional("train a.ron [--data F] [--resume C [--overwrite]] --x"), "train a.ron   --x");
    assert_eq!(
        words(r#"sample c --prompt "The " --tokens 2"#),
        ["sample", "c", "--prompt", "The ", "--tokens", "2"]
    );
}
