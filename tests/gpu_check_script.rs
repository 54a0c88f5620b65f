//! `scripts/gpu_check.sh` on a machine without the prepared binaries (as in CI):
//! the smoke stage stops early, exits non-zero and says why in `summary.json`,
//! so a broken script is found here rather than in a GPU session's 15 minutes.

use std::path::Path;
use std::process::Command;

#[test]
fn the_smoke_stage_stops_early_and_reports_what_is_missing() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if root.join("gpu-bin").exists() {
        eprintln!("skipped: gpu-bin/ exists here, so the script would run the prepared binaries");
        return;
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = Command::new("bash")
        .arg(root.join("scripts/gpu_check.sh"))
        .arg("smoke")
        .env("OUT", &out)
        .output()
        .expect("bash runs");
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let log = std::fs::read_to_string(out.join("gpu_check.log")).unwrap();
    assert!(log.contains("stopping before the full stage"), "{log}");
    let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    assert_eq!(summary["stage"], "stopped");
    assert_eq!(summary["device"]["status"], "missing");
    assert_eq!(summary["parity"]["status"], "not run (stopped)");
    let bad =
        Command::new("bash").arg(root.join("scripts/gpu_check.sh")).arg("nonsense").env("OUT", &out).output();
    assert_eq!(bad.unwrap().status.code(), Some(2), "an unknown stage is a usage error");
    std::fs::remove_dir_all(&out).unwrap();
}
