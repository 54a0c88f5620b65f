//! Running cargo on a generated package and installing its binary.

use super::BuildError;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

/// Lines of cargo's output shown when a build fails.
const TAIL_LINES: usize = 40;

/// `cargo --version`, proving the program runs.
pub fn version(cargo: &OsStr) -> Result<String, BuildError> {
    let shown = || cargo.to_string_lossy().into_owned();
    let out = Command::new(cargo)
        .arg("--version")
        .output()
        .map_err(|source| BuildError::CargoNotFound { cargo: shown(), source })?;
    if !out.status.success() {
        let message =
            format!("`{} --version` failed: {}", shown(), String::from_utf8_lossy(&out.stderr).trim());
        return Err(BuildError::CargoNotFound { cargo: shown(), source: std::io::Error::other(message) });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// What one cargo invocation did.
struct Run {
    success: bool,
    status: String,
    /// cargo's stderr (progress and rendered diagnostics), line by line.
    stderr: Vec<String>,
    /// The built executable, from cargo's JSON messages.
    executable: Option<PathBuf>,
}

/// How to run cargo.
pub struct Invocation<'a> {
    pub cargo: &'a OsStr,
    pub manifest: &'a Path,
    /// `--target-dir`, unless the environment already chooses one.
    pub target_dir: Option<&'a Path>,
    /// Echo cargo's progress to stderr while building.
    pub verbose: bool,
    /// Without `verbose`: show one progress line on stderr (crates built so far, the
    /// one compiling, the time taken), so a build of minutes is never silent.
    pub progress: bool,
    /// The cargo profile (`--profile`): `release`, or `dev` for a quick build.
    pub profile: &'a str,
}

/// Builds the package with the requested cargo profile, offline first (everything is usually
/// in the local registry cache already, and an offline build never waits on
/// the network), then online if the offline resolution was what failed.
/// Returns the executable and whether the online retry was needed.
pub fn build(inv: &Invocation) -> Result<(PathBuf, bool), BuildError> {
    let offline = run(inv, true)?;
    let (done, online) = if !offline.success && mentions_offline(&offline.stderr) {
        (run(inv, false)?, true)
    } else {
        (offline, false)
    };
    if !done.success {
        let start = done.stderr.len().saturating_sub(TAIL_LINES);
        return Err(BuildError::CargoFailed {
            manifest: inv.manifest.to_path_buf(),
            status: done.status,
            tail: done.stderr[start..].join("\n"),
        });
    }
    let exe =
        done.executable.ok_or_else(|| BuildError::NoExecutable { manifest: inv.manifest.to_path_buf() })?;
    Ok((exe, online))
}

/// Whether a failed offline build failed for want of the network (cargo says
/// "offline mode" or names `--offline` in those errors).
fn mentions_offline(stderr: &[String]) -> bool {
    stderr.iter().any(|l| l.contains("offline"))
}

fn run(inv: &Invocation, offline: bool) -> Result<Run, BuildError> {
    let mut cmd = Command::new(inv.cargo);
    cmd.arg("build").arg("--profile").arg(inv.profile).arg("--message-format=json-render-diagnostics");
    cmd.arg("--manifest-path").arg(inv.manifest);
    if offline {
        cmd.arg("--offline");
    }
    if let Some(dir) = inv.target_dir {
        cmd.arg("--target-dir").arg(dir);
    }
    let shown = || inv.cargo.to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| BuildError::CargoNotFound { cargo: shown(), source })?;
    let stderr = child.stderr.take().map(BufReader::new);
    let verbose = inv.verbose;
    let counts = Arc::new(Mutex::new(CargoProgress::default()));
    let stage = (inv.progress && !verbose).then(|| {
        let label =
            format!("cargo build --profile {}{}", inv.profile, if offline { " --offline" } else { "" });
        Arc::new(crate::progress::Stage::start(label))
    });
    let note = {
        let (counts, stage) = (Arc::clone(&counts), stage.clone());
        move |update: &dyn Fn(&mut CargoProgress) -> bool| {
            let Ok(mut c) = counts.lock() else { return };
            if update(&mut c) {
                if let Some(stage) = &stage {
                    stage.detail(c.detail());
                }
            }
        }
    };
    let note_err = note.clone();
    // stderr is drained on its own thread so neither pipe can fill up and
    // stall cargo while the other is read.
    let collector = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in stderr.into_iter().flat_map(|r| r.lines()).map_while(Result::ok) {
            note_err(&|c| c.stderr_line(&line));
            if verbose {
                let mut err = std::io::stderr().lock();
                // Echoing progress is best effort: a closed stderr must not fail the build.
                let _ = writeln!(err, "{line}");
            }
            lines.push(line);
        }
        lines
    });
    let mut executable = None;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            note(&|c| c.stdout_line(&line));
            if let Some(exe) = artifact_executable(&line) {
                executable = Some(exe);
            }
        }
    }
    let status = child.wait().map_err(|source| BuildError::CargoNotFound { cargo: shown(), source })?;
    let stderr = collector.join().unwrap_or_default();
    drop(stage);
    Ok(Run { success: status.success(), status: status.to_string(), stderr, executable })
}

/// What a cargo build has got to, from its JSON messages on stdout (a
/// `compiler-artifact` per crate built or found up to date) and its status lines on
/// stderr (`Compiling gemm v0.17.1`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct CargoProgress {
    /// Crates compiled by this build, and crates that were already up to date.
    built: usize,
    fresh: usize,
    /// The crate cargo started compiling last.
    compiling: Option<String>,
}

impl CargoProgress {
    /// Reads one stdout line; whether anything changed.
    fn stdout_line(&mut self, line: &str) -> bool {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { return false };
        if msg.get("reason").and_then(|r| r.as_str()) != Some("compiler-artifact") {
            return false;
        }
        match msg.get("fresh").and_then(|f| f.as_bool()) {
            Some(true) => self.fresh += 1,
            _ => self.built += 1,
        }
        true
    }

    /// Reads one stderr line; whether anything changed.
    fn stderr_line(&mut self, line: &str) -> bool {
        let Some(rest) = line.trim_start().strip_prefix("Compiling ") else { return false };
        let name = rest.split_whitespace().next().unwrap_or(rest).to_string();
        self.compiling = Some(name);
        true
    }

    /// `12 crates compiled, 3 up to date; compiling gemm`.
    fn detail(&self) -> String {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let mut text = format!("{} crate{} compiled", self.built, plural(self.built));
        if self.fresh > 0 {
            text.push_str(&format!(", {} up to date", self.fresh));
        }
        if let Some(c) = &self.compiling {
            text.push_str(&format!("; compiling {c}"));
        }
        text
    }
}

/// The executable of a `compiler-artifact` message for a binary target.
fn artifact_executable(line: &str) -> Option<PathBuf> {
    let msg: serde_json::Value = serde_json::from_str(line).ok()?;
    if msg.get("reason")?.as_str()? != "compiler-artifact" {
        return None;
    }
    let is_bin = msg.get("target")?.get("kind")?.as_array()?.iter().any(|k| k.as_str() == Some("bin"));
    is_bin.then(|| msg.get("executable")?.as_str().map(PathBuf::from)).flatten()
}

/// The cargo to run: `$CARGO` (set by cargo for the processes it starts), else
/// `cargo` on the `PATH`.
pub fn default_cargo() -> OsString {
    std::env::var_os("CARGO").filter(|v| !v.is_empty()).unwrap_or_else(|| "cargo".into())
}

/// Whether the environment already picks cargo's target folder, in which case
/// the build uses that one instead of the cache's.
pub fn env_target_dir() -> bool {
    ["CARGO_TARGET_DIR", "CARGO_BUILD_TARGET_DIR"]
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
}

/// A sibling of `output` to copy into before renaming over it, so a failed or
/// interrupted copy never leaves a truncated binary at `output`.
fn staging(output: &Path) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    output.with_file_name(format!(".{name}.widen-build-{}", std::process::id()))
}

/// Bytes every standalone trainer holds: its `--help` text says "built by
/// `widen build`" (`super::package`'s generated `main`), stored verbatim in the
/// binary. Finding them in an existing file is how [`check_output`] knows the
/// file is an earlier `widen build` output that may be replaced.
pub const BUILT_MARKER: &[u8] = b"; built by `widen build`.";

/// Whether `path` is a file an earlier `widen build` wrote: it holds
/// [`BUILT_MARKER`]. Read in chunks (the path may name a large data file);
/// anything unreadable is not.
pub fn is_built_output(path: &Path) -> bool {
    use std::io::Read;
    let Ok(mut file) = std::fs::File::open(path) else { return false };
    let keep = BUILT_MARKER.len() - 1;
    let mut window: Vec<u8> = Vec::with_capacity(keep + (1 << 20));
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = match file.read(&mut chunk) {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        window.extend_from_slice(&chunk[..n]);
        if window.windows(BUILT_MARKER.len()).any(|w| w == BUILT_MARKER) {
            return true;
        }
        // Keep the tail a marker split across two chunks starts in.
        let cut = window.len().saturating_sub(keep);
        window.drain(..cut);
    }
}

/// Checks before building that `output` can be written: not a folder, its
/// folder exists (created if missing) and accepts a new file, and it is not
/// an existing file that an earlier `widen build` did not write, unless
/// `force` (see README, "What widen guarantees": a build never overwrites a user's
/// file, the spec included, unasked).
pub fn check_output(output: &Path, force: bool) -> Result<(), BuildError> {
    let err = |source| BuildError::Output { path: output.to_path_buf(), source };
    if output.is_dir() {
        return Err(err(std::io::Error::other("it is a folder; give the path of the binary to write")));
    }
    if output.file_name().is_none() {
        return Err(err(std::io::Error::other("it names no file")));
    }
    if !force && output.symlink_metadata().is_ok() && !is_built_output(output) {
        return Err(BuildError::Overwrite { path: output.to_path_buf() });
    }
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        if let Some(file) = parent.ancestors().find(|a| a.is_file()) {
            let what = format!("{} is a file, not a folder", file.display());
            return Err(err(std::io::Error::other(what)));
        }
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    let probe = staging(output);
    std::fs::File::create(&probe).map_err(err)?;
    std::fs::remove_file(&probe).map_err(err)
}

/// Copies the built binary to `output` (atomically replacing it).
pub fn install(binary: &Path, output: &Path) -> Result<(), BuildError> {
    let err = |source| BuildError::Output { path: output.to_path_buf(), source };
    let tmp = staging(output);
    let copied = std::fs::copy(binary, &tmp).and_then(|_| std::fs::rename(&tmp, output));
    if copied.is_err() {
        // Nothing useful is left in a partial copy.
        let _ = std::fs::remove_file(&tmp);
    }
    copied.map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn artifact_messages_name_the_binary_only() {
        let bin = r#"{"reason":"compiler-artifact","target":{"kind":["bin"]},"executable":"/t/release/m"}"#;
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"]},"executable":null}"#;
        let done = r#"{"reason":"build-finished","success":true}"#;
        assert_eq!(artifact_executable(bin), Some(PathBuf::from("/t/release/m")));
        assert_eq!(artifact_executable(lib), None);
        assert_eq!(artifact_executable(done), None);
        assert_eq!(artifact_executable("not json"), None);
    }

    /// `widen build`'s progress line counts the crates from cargo's own messages.
    #[test]
    fn cargo_progress_counts_crates_and_names_the_one_compiling() {
        let mut p = CargoProgress::default();
        assert!(p.stderr_line("   Compiling gemm v0.17.1"));
        assert!(p.stdout_line(r#"{"reason":"compiler-artifact","fresh":true,"target":{"kind":["lib"]}}"#));
        assert!(p.stdout_line(r#"{"reason":"compiler-artifact","fresh":false,"target":{"kind":["lib"]}}"#));
        assert!(p.stdout_line(r#"{"reason":"compiler-artifact","fresh":false,"target":{"kind":["lib"]}}"#));
        assert!(!p.stdout_line(r#"{"reason":"build-script-executed"}"#));
        assert!(!p.stdout_line("not json"));
        assert!(!p.stderr_line("warning: unused variable"));
        assert_eq!(p.detail(), "2 crates compiled, 1 up to date; compiling gemm");
        assert_eq!(CargoProgress::default().detail(), "0 crates compiled");
    }

    #[test]
    fn offline_failures_are_recognized() {
        let lines = |s: &[&str]| s.iter().map(|l| l.to_string()).collect::<Vec<_>>();
        assert!(mentions_offline(&lines(&[
            "error: no matching package named `anyhow` found",
            "As a reminder, you're using offline mode (--offline) which can sometimes cause surprising resolution failures",
        ])));
        assert!(!mentions_offline(&lines(&["error[E0425]: cannot find value `x` in this scope"])));
    }

    #[test]
    fn an_output_inside_a_file_is_refused_before_building() {
        let dir = std::env::temp_dir().join(format!("widen-build-output-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(check_output(&file.join("bin"), false), Err(BuildError::Output { .. })));
        assert!(matches!(check_output(&dir, false), Err(BuildError::Output { .. })));
        check_output(&dir.join("sub/bin"), false).unwrap();
        assert!(dir.join("sub").is_dir() && !dir.join("sub/bin").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// An existing file is replaced only when an earlier `widen build` wrote
    /// it, or with `force`; the refusal names the file and `--force`.
    #[test]
    fn only_earlier_build_outputs_are_overwritten_unforced() {
        let dir = std::env::temp_dir().join(format!("widen-build-overwrite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mine = dir.join("notes.txt");
        std::fs::write(&mine, "my notes").unwrap();
        let err = check_output(&mine, false).unwrap_err();
        assert!(matches!(&err, BuildError::Overwrite { path } if *path == mine), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("notes.txt") && msg.contains("--force"), "{msg}");
        assert_eq!(std::fs::read_to_string(&mine).unwrap(), "my notes");
        check_output(&mine, true).unwrap();

        let built = dir.join("trainer");
        let mut bytes = b"\x7fELF....".to_vec();
        bytes.extend_from_slice(BUILT_MARKER);
        bytes.extend_from_slice(b"....");
        std::fs::write(&built, bytes).unwrap();
        check_output(&built, false).unwrap();
        // The marker across the boundary of two read chunks is still found.
        let mut split = vec![0u8; (1 << 20) - 5];
        split.extend_from_slice(BUILT_MARKER);
        std::fs::write(&built, split).unwrap();
        assert!(is_built_output(&built));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
