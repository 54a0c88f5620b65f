//! Standalone trainers (`widen build SPEC -o PATH`, docs/architecture.md §1, §7): a spec
//! compiled into one executable that trains the model with no spec file and no
//! `widen` command at run time.
//!
//! At build time the spec is lowered, differentiated and compiled into the
//! Plans of one training step, exactly as `widen train --device cpu|cuda` does
//! when it starts ([`package::compile_plans`]). A small cargo package is then
//! generated ([`package::generate`]):
//!
//! - `src/plan.json` and `src/plan.cuda.json`: the Cpu and the GPU-sized Plan
//!   (kernel IR, launch list, buffer plan), see [`codec`];
//! - `src/main.rs`: code generated with `quote`: the spec (RON) and the Plan as
//!   constants, argument parsing (`--steps`, `--data`, `--out`, `--resume`,
//!   `--device cpu|reference|cuda`), and a call into [`crate::train::train`]
//!   with an executor over the embedded Plan;
//! - `Cargo.toml`, depending on this workspace's `ir`, `codegen` and `runtime`
//!   crates by path (the source folder this crate was compiled from), and the
//!   workspace's `Cargo.lock`, so dependencies resolve offline and at the
//!   versions `widen train` uses.
//!
//! [`build`] writes the package to `<cache>/build/<hash>` (`<cache>` is
//! [`codegen::cc::default_cache_dir`]: `$WIDEN_CACHE_DIR`, else
//! `~/.cache/widen`), runs `cargo build --release` (or `--profile dev`) on it with the shared
//! target folder `<cache>/build/target` (so the runtime and its dependencies
//! compile once for all specs), and copies the binary to the output path.
//!
//! The binary runs the same code path as `widen train`: it initializes the
//! parameters from the spec's seed, samples the same batches and runs the same
//! Plan on the same device, so its `metrics.jsonl` carries the same losses.
//! Kernels are C compiled by the system C compiler when the Plan is loaded on
//! the Cpu device (docs/architecture.md §6), so `--device cpu` needs `cc` (or `CC`) at run
//! time, as `widen train` does.

mod cargo;
pub mod codec;
mod package;

pub use cargo::{is_built_output, BUILT_MARKER};
pub use package::{compile_plans, generate, widen_root, Package};

use codegen::training::TrainingError;
use ir::spec::{ModelSpec, ScheduleSpec};
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Failures of [`build`].
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Lower(#[from] ir::lower::LowerError),
    #[error("compiling the training plan")]
    Plan(#[from] TrainingError),
    #[error(transparent)]
    Codec(#[from] codec::CodecError),
    #[error("the embedded plan does not read back as the compiled one")]
    PlanRoundTrip,
    #[error(
        "the widen sources this program was compiled from are gone ({path} is missing); \
         standalone binaries are built against them"
    )]
    SourceMissing { path: PathBuf },
    #[error("the widen source folder {path} is not valid UTF-8, which Cargo.toml cannot name")]
    SourcePath { path: PathBuf },
    #[error(
        "cannot run cargo (`{cargo}`); install Rust (https://rustup.rs) or set CARGO to the cargo program"
    )]
    CargoNotFound { cargo: String, source: std::io::Error },
    #[error("cargo build of {manifest} failed ({status}); the end of its output:\n{tail}")]
    CargoFailed { manifest: PathBuf, status: String, tail: String },
    #[error("cargo built {manifest} but reported no executable")]
    NoExecutable { manifest: PathBuf },
    #[error("cannot write {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot write the binary to {path}")]
    Output { path: PathBuf, source: std::io::Error },
    #[error(
        "{path} exists and is not a trainer `widen build` wrote; give another output path, \
         or pass --force to overwrite it"
    )]
    Overwrite { path: PathBuf },
}

/// How [`build`] runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildOptions {
    /// Cache root: packages go to `build/<hash>`, the shared target folder to
    /// `build/target` (unless `CARGO_TARGET_DIR` chooses another).
    pub cache_dir: PathBuf,
    /// The cargo program.
    pub cargo: OsString,
    /// Echo cargo's progress while building.
    pub verbose: bool,
    /// Without `verbose`, show a progress line on stderr while cargo builds
    /// (`crate::progress`): crates compiled, the one compiling, the time taken.
    pub progress: bool,
    /// Replace an existing output file even when no earlier `widen build`
    /// wrote it ([`cargo::check_output`]).
    pub force: bool,
    /// The cargo profile: `release` (the default) or `dev` (unoptimised: compiles in less
    /// than half the time, trains slower, computes the same results).
    pub profile: String,
}

impl BuildOptions {
    /// [`codegen::cc::default_cache_dir`] and `$CARGO` or `cargo`.
    pub fn from_env() -> BuildOptions {
        BuildOptions {
            cache_dir: codegen::cc::default_cache_dir(),
            cargo: cargo::default_cargo(),
            verbose: false,
            progress: false,
            force: false,
            profile: "release".into(),
        }
    }
}

/// What [`build`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    /// The installed binary (the requested output path).
    pub output: PathBuf,
    /// The generated package.
    pub package_dir: PathBuf,
    /// The package's binary in cargo's target folder.
    pub executable: PathBuf,
    /// Kernels and launch steps of the embedded Plan.
    pub kernels: usize,
    pub steps: usize,
    /// `cargo --version`.
    pub cargo_version: String,
    /// Whether the offline build failed and the online retry built it.
    pub online: bool,
    pub elapsed: Duration,
}

/// Compiles `spec` into a standalone trainer at `output` (see the module docs).
pub fn build(spec: &ModelSpec, output: &Path, opts: &BuildOptions) -> Result<Built, BuildError> {
    let started = Instant::now();
    cargo::check_output(output, opts.force)?;
    let cargo_version = cargo::version(&opts.cargo)?;
    let package = generate(spec)?;
    let build_dir = opts.cache_dir.join("build");
    let package_dir = build_dir.join(&package.hash);
    write_package(&package, &package_dir)?;
    let target = build_dir.join("target");
    let manifest = package_dir.join("Cargo.toml");
    let invocation = cargo::Invocation {
        cargo: &opts.cargo,
        manifest: &manifest,
        target_dir: (!cargo::env_target_dir()).then_some(target.as_path()),
        verbose: opts.verbose,
        progress: opts.progress,
        profile: &opts.profile,
    };
    let (executable, online) = cargo::build(&invocation)?;
    cargo::install(&executable, output)?;
    Ok(Built {
        output: output.to_path_buf(),
        package_dir,
        executable,
        kernels: package.kernels,
        steps: package.steps,
        cargo_version,
        online,
        elapsed: started.elapsed(),
    })
}

/// The file in a package folder listing the SHA-256 of every file written
/// there: written last, so its presence means the folder was complete.
const STAMP: &str = ".widen-package.sha256";

/// Writes the package unless its folder already holds it whole. The folder
/// is named by the hash of its contents; every file is written under a
/// temporary name and renamed into place, and [`STAMP`] last, listing each
/// file's digest. A folder whose files all match its stamp is left untouched
/// (keeping their timestamps, and cargo's rebuild check, unchanged); one with
/// a missing, truncated or altered file, or no stamp (a write cut short), is
/// written again, so a damaged build cache repairs itself instead of failing
/// every build (see README, "What widen guarantees"). Two builds of one spec at once
/// write identical files atomically, so neither sees the other's partial one.
fn write_package(package: &Package, dir: &Path) -> Result<(), BuildError> {
    if package_intact(dir) {
        return Ok(());
    }
    let mut stamp = String::new();
    for (rel, text) in &package.files {
        let path = dir.join(rel);
        if rel == Path::new(LOCK) {
            // Cargo owns the lock file once it exists (its first build rewrites it for
            // the package): written only when missing, and stamped as present, not by
            // digest, so the next build finds the package whole and compiles nothing.
            if !path.is_file() {
                write_atomic(&path, text.as_bytes())?;
            }
            stamp.push_str(&format!("{ANY}  {}\n", rel.display()));
            continue;
        }
        let text = if rel.extension().is_some_and(|e| e == "rs") { rustfmt(text) } else { text.clone() };
        write_atomic(&path, text.as_bytes())?;
        stamp.push_str(&format!("{}  {}\n", sha256_hex(text.as_bytes()), rel.display()));
    }
    write_atomic(&dir.join(STAMP), stamp.as_bytes())
}

/// The package's lock file, seeded from the workspace's and then cargo's.
const LOCK: &str = "Cargo.lock";

/// A stamp digest that asks only that the file exists.
const ANY: &str = "-";

/// Whether `dir` holds a complete package: a [`STAMP`] whose every listed
/// file exists with the listed digest.
fn package_intact(dir: &Path) -> bool {
    let Ok(stamp) = std::fs::read_to_string(dir.join(STAMP)) else { return false };
    let mut lines = stamp.lines().peekable();
    lines.peek().is_some()
        && lines.all(|line| {
            line.split_once("  ").is_some_and(|(digest, rel)| match digest {
                ANY => dir.join(rel).is_file(),
                _ => std::fs::read(dir.join(rel)).is_ok_and(|bytes| sha256_hex(&bytes) == digest),
            })
        })
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` to a unique sibling of `path` and renames it over `path`.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), BuildError> {
    let io = |source| BuildError::Io { path: path.to_path_buf(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io)
}

/// `rustfmt`-formatted source for people reading the generated package;
/// the unformatted source (one line from `quote`) compiles the same, so it is
/// kept when `rustfmt` is not installed or fails.
fn rustfmt(source: &str) -> String {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let child = Command::new("rustfmt")
        .args(["--edition", "2021", "--emit", "stdout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else { return source.to_string() };
    let fed = child.stdin.take().is_some_and(|mut stdin| stdin.write_all(source.as_bytes()).is_ok());
    match child.wait_with_output() {
        Ok(out) if fed && out.status.success() && !out.stdout.is_empty() => {
            String::from_utf8(out.stdout).unwrap_or_else(|_| source.to_string())
        }
        _ => source.to_string(),
    }
}

/// How [`set_steps`] changed the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmupRescale {
    pub steps: usize,
    pub planned: usize,
    pub from: usize,
    pub to: usize,
}

impl fmt::Display for WarmupRescale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let WarmupRescale { steps, planned, from, to } = *self;
        write!(
            f,
            "--steps {steps} is shorter than the spec's warmup of {from}; warmup scaled to {to} \
             ({from} of the planned {planned} steps)"
        )
    }
}

/// Sets the run to `steps` optimizer steps. A warmup that would not end before
/// the last step keeps its fraction of the planned run instead (so a short
/// trial run of a spec still validates), with the rule `widen train --steps`
/// applies, so a standalone run and a `widen train` run of the same length
/// follow the same learning-rate schedule (docs/math.md §8).
pub fn set_steps(spec: &mut ModelSpec, steps: usize) -> Option<WarmupRescale> {
    let planned = spec.train.steps;
    spec.train.steps = steps;
    let warmup = match &mut spec.train.schedule {
        ScheduleSpec::Constant(c) => &mut c.warmup,
        ScheduleSpec::Cosine(c) => &mut c.warmup,
        ScheduleSpec::Wsd(w) => &mut w.warmup,
    };
    if *warmup < steps {
        return None;
    }
    let from = *warmup;
    // In u128: `from * steps` overflows usize for a large spec warmup and --steps.
    let scaled = from as u128 * steps as u128 / planned.max(1) as u128;
    *warmup = usize::try_from(scaled).unwrap_or(usize::MAX).min(steps.saturating_sub(1));
    Some(WarmupRescale { steps, planned, from, to: *warmup })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A package folder with a damaged or missing file, or without its stamp
    /// (a write cut short), is written again; a whole one is left untouched.
    #[test]
    fn a_damaged_package_folder_is_rewritten() {
        let dir = std::env::temp_dir().join(format!("widen-package-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let package = Package {
            files: vec![
                (PathBuf::from("Cargo.toml"), "[package]\nname = \"x\"\n".into()),
                (PathBuf::from("src/plan.json"), "{\"kernels\": []}".into()),
                (PathBuf::from(LOCK), "# the workspace's lock\n".into()),
            ],
            name: "x".into(),
            hash: "h".into(),
            kernels: 0,
            steps: 0,
        };
        write_package(&package, &dir).unwrap();
        assert!(package_intact(&dir));
        let plan = dir.join("src/plan.json");
        let stamp_time = std::fs::metadata(dir.join(STAMP)).and_then(|m| m.modified()).unwrap();
        write_package(&package, &dir).unwrap();
        let again = std::fs::metadata(dir.join(STAMP)).and_then(|m| m.modified()).unwrap();
        assert_eq!(stamp_time, again, "a whole package is not rewritten");
        // Cargo rewrites the lock file on the first build: the package is still whole,
        // and the lock is cargo's from then on.
        std::fs::write(dir.join(LOCK), "# rewritten by cargo\n").unwrap();
        assert!(package_intact(&dir), "a lock file cargo rewrote keeps the package whole");
        write_package(&package, &dir).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join(LOCK)).unwrap(), "# rewritten by cargo\n");
        let unchanged = std::fs::metadata(dir.join(STAMP)).and_then(|m| m.modified()).unwrap();
        assert_eq!(stamp_time, unchanged, "nothing is rewritten after cargo's lock update");
        for damage in ["truncate", "remove", "unstamp"] {
            match damage {
                "truncate" => std::fs::write(&plan, "{\"ker").unwrap(),
                "remove" => std::fs::remove_file(&plan).unwrap(),
                _ => std::fs::remove_file(dir.join(STAMP)).unwrap(),
            }
            assert!(!package_intact(&dir), "{damage}");
            write_package(&package, &dir).unwrap();
            assert_eq!(std::fs::read_to_string(&plan).unwrap(), "{\"kernels\": []}", "{damage}");
            assert!(package_intact(&dir), "{damage}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn short_runs_keep_the_warmup_fraction() {
        let mut spec = ModelSpec::from_ron_str(
            "Model(name: \"w\", vocab: 256, d_model: 16, layers: 1, heads: 2, \
             train: (steps: 300, schedule: Cosine(warmup: 30)))",
        )
        .unwrap();
        let mut long = spec.clone();
        assert_eq!(set_steps(&mut long, 100), None, "warmup 30 < 100 steps stays");
        assert_eq!(long.train.steps, 100);
        let w = set_steps(&mut spec, 20).unwrap();
        assert_eq!(w, WarmupRescale { steps: 20, planned: 300, from: 30, to: 2 });
        assert_eq!(spec.train.steps, 20);
        assert!(matches!(spec.train.schedule, ScheduleSpec::Cosine(ref c) if c.warmup == 2));
        assert!(spec.validate().is_ok(), "the rescaled spec validates");
        let mut one = long.clone();
        let w = set_steps(&mut one, 1).unwrap();
        assert_eq!(w.to, 0, "a one-step run has no warmup");
    }
}
