//! The sweep folder on disk: its file names, its two locks, atomic writes, run
//! outcomes, and `plan.json` read back with every field checked.
//!
//! ```text
//! DIR/
//!   sweep.lock            held while a sweep trains in DIR (a second sweep is refused)
//!   results.lock          held while results and plots are rewritten (by the sweep
//!                         after each run, or by `widen report`): writers take turns
//!   plan.json             every point and run this folder holds: the union of what
//!                         every sweep into DIR asked for (crate::runner)
//!   <point>/seed-<s>/     a run folder (metrics.jsonl, checkpoints, final.safetensors)
//!                         and outcome.json once the run has ended
//!   results.csv, results.json, plots/
//! ```
//!
//! **Readers never see half a file.** Every file here is written to a temporary name
//! unique to the writing process and call, synced, and renamed into place, so any
//! number of readers (and `widen report`s) may run during a sweep: each sees a whole
//! file from one rewrite or the one before.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::budget::Budget;
use crate::point::Point;
use crate::results::RunOutcome;

/// The expanded sweep in the folder.
pub const PLAN_FILE: &str = "plan.json";
/// A run's ending: finished with its metrics, or failed with the reason.
pub const OUTCOME_FILE: &str = "outcome.json";
/// Time a stopped run had already trained, added to its wall time when it finishes.
pub(crate) const ELAPSED_FILE: &str = "elapsed.json";
/// The lock a training sweep holds for as long as it runs.
pub const LOCK_FILE: &str = "sweep.lock";
/// The lock every rewrite of the results and plots holds.
pub const RESULTS_LOCK: &str = "results.lock";
/// The results table, as CSV and as JSON.
pub const RESULTS_CSV: &str = "results.csv";
pub const RESULTS_JSON: &str = "results.json";
/// The plots' folder.
pub const PLOTS_DIR: &str = "plots";
/// Scratch runs timing a time budget's points (removed after each).
pub const CALIBRATION_DIR: &str = ".calibration";

/// Errors of the sweep folder; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error("cannot write {path}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot read {path}")]
    Read { path: PathBuf, source: std::io::Error },
    /// `plan.json` is not JSON of a plan, or breaks a rule of one.
    #[error(
        "{path}: {field}: {message}; the folder is damaged: restore the file, or sweep into another --out"
    )]
    BadPlan { path: PathBuf, field: String, message: String },
    #[error("sweep folder {dir} is in use by another sweep; wait for it to finish, stop it, or choose another --out")]
    Locked { dir: PathBuf },
    /// A folder with files that no sweep wrote.
    #[error(
        "{dir} is not empty and holds no {PLAN_FILE}, so it is not a sweep folder ({entries}); \
         a sweep would write results.csv and plots/ there: choose another --out, or empty it"
    )]
    NotASweep { dir: PathBuf, entries: String },
}

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> FolderError + '_ {
    move |source| FolderError::Write { path: path.to_path_buf(), source }
}

/// Writes `bytes` to `path` through a temporary file beside it, named for this
/// process and call (so concurrent writers of one file never share a temporary),
/// synced and renamed into place. A failed write removes its temporary.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FolderError> {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(source) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(FolderError::Write { path: tmp, source });
    }
    std::fs::rename(&tmp, path).map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        FolderError::Write { path: path.to_path_buf(), source }
    })
}

/// Takes the training lock of `dir`, or says another sweep holds it. Released when
/// the returned file closes (also when the process dies).
pub fn lock_sweep(dir: &Path) -> Result<File, FolderError> {
    let path = dir.join(LOCK_FILE);
    let file = open_lock(&path)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(FolderError::Locked { dir: dir.to_path_buf() }),
        Err(std::fs::TryLockError::Error(source)) => Err(FolderError::Write { path, source }),
    }
}

/// Waits for and takes the results lock of `dir`: rewrites of the results and plots
/// take turns (a rewrite is short, so waiting is right).
pub fn lock_results(dir: &Path) -> Result<File, FolderError> {
    let path = dir.join(RESULTS_LOCK);
    let file = open_lock(&path)?;
    file.lock().map_err(write_err(&path))?;
    Ok(file)
}

fn open_lock(path: &Path) -> Result<File, FolderError> {
    std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path).map_err(write_err(path))
}

/// Refuses a folder that holds files but no `plan.json`: it is someone's folder,
/// not a sweep's, and a sweep would replace its `results.csv` and `plots/`. An
/// empty folder, or one holding only the locks, is fine.
pub fn check_sweep_folder(dir: &Path) -> Result<(), FolderError> {
    if dir.join(PLAN_FILE).exists() {
        return Ok(());
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(FolderError::Read { path: dir.to_path_buf(), source }),
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != LOCK_FILE && n != RESULTS_LOCK && n != CALIBRATION_DIR)
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    let shown = names.len().min(4);
    let mut entries = names[..shown].join(", ");
    if names.len() > shown {
        entries.push_str(&format!(" and {} more", names.len() - shown));
    }
    Err(FolderError::NotASweep { dir: dir.to_path_buf(), entries })
}

/// The data a point trains on, identified by content: the path is how a run finds
/// it, the length and SHA-256 are what make two sweeps comparable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataRecord {
    /// The path given (or `synthetic:<kind>`).
    pub source: String,
    pub bytes: u64,
    /// SHA-256 of the bytes, 64 lowercase hex digits.
    pub sha256: String,
}

impl DataRecord {
    /// `path (N bytes, sha256 0123456789ab…)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} bytes, sha256 {}…)",
            self.source,
            self.bytes,
            &self.sha256[..self.sha256.len().min(12)]
        )
    }
}

impl From<runtime::data::DataIdentity> for DataRecord {
    fn from(d: runtime::data::DataIdentity) -> DataRecord {
        DataRecord { source: d.source, bytes: d.bytes, sha256: d.sha256 }
    }
}

/// `plan.json`: every point and run the folder holds (see crate::runner for how a
/// rerun adds to it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFile {
    /// Axis paths: the latest sweep's in its order, then earlier sweeps' others.
    pub axes: Vec<String>,
    pub budget: Budget,
    /// Every seed any point holds a run of.
    pub seeds: Vec<u64>,
    pub points: Vec<Point>,
    /// Points the validator rejected (skipped): name and reason.
    pub invalid: Vec<(String, String)>,
    /// Each point's data, by point name (empty in folders of older widen versions).
    #[serde(default)]
    pub data: BTreeMap<String, DataRecord>,
    /// The point every other is compared with (`--against`); `None`: each point's
    /// plain-residual twin, else the first point (crate::results::fill_significance).
    #[serde(default)]
    pub against: Option<String>,
    /// Seeds added after the planned ones because a comparison was still undecided
    /// (`--until`), each with why.
    #[serde(default)]
    pub added_seeds: Vec<AddedSeed>,
}

/// A seed `--until` added to a point, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AddedSeed {
    pub point: String,
    pub seed: u64,
    /// The comparison that was undecided (or the point that needed the seed to pair).
    pub reason: String,
}

impl PlanFile {
    /// Reads `DIR/plan.json` and checks every rule a plan keeps (see [`PlanFile::check`]).
    pub fn read(dir: &Path) -> Result<PlanFile, FolderError> {
        let path = dir.join(PLAN_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|source| FolderError::Read { path: path.clone(), source })?;
        let file: PlanFile = serde_json::from_str(&text).map_err(|e| FolderError::BadPlan {
            path: path.clone(),
            field: format!("line {} column {}", e.line(), e.column()),
            message: e.to_string(),
        })?;
        file.check().map_err(|(field, message)| FolderError::BadPlan { path, field, message })?;
        Ok(file)
    }

    /// Every run of the plan, point by point in plan order, each point's runs in
    /// seed order: run `K` of `--run-index K` is the K-th (from 0).
    pub fn runs(&self) -> impl Iterator<Item = (&Point, &crate::point::Run)> {
        self.points.iter().flat_map(|p| p.runs.iter().map(move |r| (p, r)))
    }

    /// Writes `DIR/plan.json`.
    pub fn write(&self, dir: &Path) -> Result<(), FolderError> {
        let text = serde_json::to_string_pretty(self).expect("a plan serializes");
        write_atomic(&dir.join(PLAN_FILE), text.as_bytes())
    }

    /// The rules of a plan, as (field, what is wrong): point names are unique folder
    /// names, each value's path is an axis and set once, each run lives in
    /// `<point>/seed-<seed>` (so no run reaches outside the folder) with a seed of
    /// its own, and baselines name points of the plan.
    pub fn check(&self) -> Result<(), (String, String)> {
        let axes: HashSet<&str> = self.axes.iter().map(String::as_str).collect();
        if axes.len() != self.axes.len() {
            return Err(("axes".into(), "an axis is listed twice".into()));
        }
        let mut names = HashSet::new();
        for (i, p) in self.points.iter().enumerate() {
            let at = |f: &str| format!("points[{i}]{f}");
            if !safe_name(&p.name) {
                return Err((at(".name"), format!("`{}` is not a folder name of a point", p.name)));
            }
            if !names.insert(p.name.as_str()) {
                return Err((at(".name"), format!("two points are named `{}`", p.name)));
            }
            let mut set = HashSet::new();
            for (path, _) in &p.values {
                if !axes.contains(path.as_str()) {
                    return Err((at(".values"), format!("`{path}` is not one of the axes {:?}", self.axes)));
                }
                if !set.insert(path.as_str()) {
                    return Err((at(".values"), format!("`{path}` is set twice")));
                }
            }
            let mut seeds = HashSet::new();
            for (j, r) in p.runs.iter().enumerate() {
                let want = PathBuf::from(&p.name).join(format!("seed-{}", r.seed));
                if r.dir != want {
                    return Err((
                        at(&format!(".runs[{j}].dir")),
                        format!("`{}` should be `{}`", r.dir.display(), want.display()),
                    ));
                }
                if !seeds.insert(r.seed) {
                    return Err((
                        at(&format!(".runs[{j}].seed")),
                        format!("seed {} is listed twice", r.seed),
                    ));
                }
            }
        }
        for (i, p) in self.points.iter().enumerate() {
            if let Some(b) = &p.baseline {
                if !names.contains(b.as_str()) {
                    return Err((
                        format!("points[{i}].baseline"),
                        format!("`{b}` is not a point of the plan"),
                    ));
                }
            }
        }
        if let Some(a) = &self.against {
            if !names.contains(a.as_str()) {
                let mut all: Vec<&str> = names.iter().copied().collect();
                all.sort_unstable();
                return Err((
                    "against".into(),
                    format!("`{a}` is not a point of the plan; its points are {}", all.join(", ")),
                ));
            }
        }
        for name in self.data.keys() {
            if !names.contains(name.as_str()) {
                return Err(("data".into(), format!("`{name}` is not a point of the plan")));
            }
        }
        Ok(())
    }
}

/// A point's name is one path component of the characters point names use.
fn safe_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None))
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._+-~".contains(c))
}

/// How a run's `outcome.json` reads.
#[derive(Debug, Clone, PartialEq)]
pub enum OutcomeFile {
    /// No outcome yet: the run has not ended.
    Missing,
    Read(RunOutcome),
    /// The file exists but does not read as an outcome: the reason.
    Damaged(String),
}

impl OutcomeFile {
    /// The outcome, if one reads.
    pub fn outcome(self) -> Option<RunOutcome> {
        match self {
            OutcomeFile::Read(o) => Some(o),
            OutcomeFile::Missing | OutcomeFile::Damaged(_) => None,
        }
    }
}

/// Where and by what a run was trained: what makes a result traceable
/// (docs/sweeps.md, "Provenance"). Recorded in every run's `outcome.json` and
/// gathered per point into the results.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// widen's version (the crate version it was built as).
    pub widen_version: String,
    /// The git commit widen was built from, or `unknown` (built outside a checkout,
    /// or without git).
    pub git_commit: String,
    /// The device the run trained on (`reference`, `cpu`, `cuda`).
    pub device: String,
    /// The machine's host name, or `unknown`.
    pub host: String,
    /// Cores this process may use (`std::thread::available_parallelism`).
    pub cores: usize,
    /// Threads the Cpu device runs each kernel on: the cores shared out among the
    /// processes training on this machine at once (`--jobs`).
    pub threads: usize,
    /// The data the run trained on, by content.
    pub data: Option<DataRecord>,
}

/// The git commit of this build (see `sweep/build.rs`).
pub const GIT_COMMIT: &str = env!("WIDEN_GIT_COMMIT");

impl Provenance {
    /// This process, training on `device` from `data`.
    pub fn here(device: runtime::device::Device, data: Option<DataRecord>) -> Provenance {
        Provenance {
            widen_version: env!("CARGO_PKG_VERSION").to_string(),
            git_commit: GIT_COMMIT.to_string(),
            device: device.name().to_string(),
            host: host_name(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            threads: runtime::device::cpu::CpuOptions::default().threads,
            data,
        }
    }
}

/// The kernel's host name (Linux), else `$HOSTNAME`, else `unknown`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// `outcome.json`: how the run ended and, since provenance was recorded, what
/// trained it (older outcomes read with none).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomeRecord {
    #[serde(flatten)]
    pub outcome: RunOutcome,
    #[serde(default)]
    pub provenance: Option<Provenance>,
}

/// Reads a run's `outcome.json`.
pub fn read_outcome(run_dir: &Path) -> OutcomeFile {
    match read_record(run_dir) {
        Ok(Some(r)) => OutcomeFile::Read(r.outcome),
        Ok(None) => OutcomeFile::Missing,
        Err(why) => OutcomeFile::Damaged(why),
    }
}

/// Reads a run's `outcome.json` with its provenance: `None` when there is none yet,
/// the reason when it does not read.
pub fn read_record(run_dir: &Path) -> Result<Option<OutcomeRecord>, String> {
    let path = run_dir.join(OUTCOME_FILE);
    match std::fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("{} does not read as an outcome: {e}", path.display())),
    }
}

/// Writes a run's `outcome.json` (with what trained it) and drops its elapsed-time note.
pub fn write_outcome(
    run_dir: &Path,
    outcome: &RunOutcome,
    provenance: &Provenance,
) -> Result<(), FolderError> {
    let record = OutcomeRecord { outcome: outcome.clone(), provenance: Some(provenance.clone()) };
    let text = serde_json::to_string_pretty(&record).expect("an outcome serializes");
    write_atomic(&run_dir.join(OUTCOME_FILE), text.as_bytes())?;
    let elapsed = run_dir.join(ELAPSED_FILE);
    match std::fs::remove_file(&elapsed) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(write_err(&elapsed)(e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("widen-folder-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn concurrent_atomic_writes_of_one_file_never_collide_or_show_half_a_file() {
        let dir = tmp("atomic");
        let path = dir.join("results.csv");
        let texts: Vec<String> = (0..4).map(|i| format!("{i}").repeat(50_000 + i)).collect();
        std::thread::scope(|s| {
            for t in &texts {
                let path = &path;
                s.spawn(move || {
                    for _ in 0..50 {
                        write_atomic(path, t.as_bytes()).expect("no writer loses its temporary");
                    }
                });
            }
            s.spawn(|| {
                for _ in 0..200 {
                    if let Ok(seen) = std::fs::read_to_string(&path) {
                        assert!(texts.contains(&seen), "a reader saw a partial file of {} bytes", seen.len());
                    }
                }
            });
        });
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from("results.csv")], "no temporary is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_folder_with_foreign_files_is_not_a_sweep_folder() {
        let dir = tmp("foreign");
        check_sweep_folder(&dir.join("missing")).expect("a new folder is fine");
        check_sweep_folder(&dir).expect("an empty folder is fine");
        std::fs::write(dir.join(LOCK_FILE), "").unwrap();
        check_sweep_folder(&dir).expect("a folder holding only the lock is one a sweep made");
        std::fs::write(dir.join("results.csv"), "mine").unwrap();
        std::fs::create_dir(dir.join("plots")).unwrap();
        let err = check_sweep_folder(&dir).unwrap_err().to_string();
        assert!(err.contains("holds no plan.json") && err.contains("plots, results.csv"), "{err}");
        std::fs::write(dir.join(PLAN_FILE), "{}").unwrap();
        check_sweep_folder(&dir).expect("a sweep folder is one");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn damaged_outcomes_are_told_from_missing_ones() {
        let dir = tmp("outcome");
        assert_eq!(read_outcome(&dir), OutcomeFile::Missing);
        std::fs::write(dir.join(OUTCOME_FILE), "{\"Finished\": ").unwrap();
        assert!(matches!(read_outcome(&dir), OutcomeFile::Damaged(m) if m.contains("outcome.json")));
        let here = Provenance::here(runtime::device::Device::Reference, None);
        write_outcome(&dir, &RunOutcome::Failed("x".into()), &here).unwrap();
        let record = read_record(&dir).unwrap().unwrap();
        assert_eq!(record.provenance.as_ref(), Some(&here));
        assert_eq!(here.widen_version, env!("CARGO_PKG_VERSION"));
        assert!(here.git_commit == "unknown" || here.git_commit.len() == 40, "{}", here.git_commit);
        assert!(here.cores >= 1 && here.threads >= 1 && !here.host.is_empty());
        // An outcome written before provenance was recorded still reads.
        std::fs::write(dir.join(OUTCOME_FILE), r#"{"Failed": "y"}"#).unwrap();
        assert_eq!(read_record(&dir).unwrap().unwrap().provenance, None);
        assert_eq!(read_outcome(&dir), OutcomeFile::Read(RunOutcome::Failed("y".into())));
        write_outcome(&dir, &RunOutcome::Failed("x".into()), &here).unwrap();
        assert_eq!(read_outcome(&dir), OutcomeFile::Read(RunOutcome::Failed("x".into())));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn point_names_stay_inside_the_folder() {
        for ok in ["residual.r-1", "baseline_d_model-32", "x~0123abcd"] {
            assert!(safe_name(ok), "{ok}");
        }
        for bad in ["..", ".", "", "a/b", "/etc", "a b", "../x"] {
            assert!(!safe_name(bad), "{bad}");
        }
    }
}
