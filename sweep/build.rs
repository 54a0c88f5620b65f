//! Records the git commit widen is built from, for the provenance every sweep run
//! writes (docs/sweeps.md, "Provenance"). Outside a checkout, or without git, the
//! commit is `unknown`: the build never fails for want of git.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let out = Command::new("git").args(args).current_dir(dir).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    let commit = git(&["rev-parse", "HEAD"])
        .filter(|c| c.len() == 40 && c.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=WIDEN_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=build.rs");
    // Build again when HEAD moves: HEAD itself, the branch it names, and packed refs
    // (only paths that exist: a missing one would make every build rerun this).
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
    }
    watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    // The branch heads' folder too (cargo scans a folder for any change): a branch ref
    // that was packed when this ran becomes a loose file at the next commit.
    watched.push(git(&["rev-parse", "--git-path", "refs/heads"]));
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    for path in watched.into_iter().flatten() {
        let full = Path::new(&root).join(&path);
        if full.exists() {
            println!("cargo:rerun-if-changed={}", full.display());
        }
    }
}
