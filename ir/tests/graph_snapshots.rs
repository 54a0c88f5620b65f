//! Snapshot tests of canonical graph dumps (docs/architecture.md §4: stable node numbering, so
//! dumps of the same spec are identical and can be diffed). Set
//! `WIDEN_UPDATE_SNAPSHOTS=1` to rewrite the expected files after an intended change.

use ir::lower::lower;
use ir::spec::{GhcSpec, MhcSpec, ModelSpec, ResidualSpec};
use std::path::PathBuf;

fn snapshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots").join(name)
}

fn check_snapshot(name: &str, actual: &str) {
    let path = snapshot_path(name);
    if std::env::var_os("WIDEN_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, actual).expect("write snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("missing snapshot {} ({e}); run with WIDEN_UPDATE_SNAPSHOTS=1", path.display())
    });
    if expected != actual {
        let first_diff = expected
            .lines()
            .zip(actual.lines())
            .enumerate()
            .find(|(_, (e, a))| e != a)
            .map(|(i, (e, a))| format!("line {}:\n  expected: {e}\n  actual:   {a}", i + 1))
            .unwrap_or_else(|| "the dumps differ in length".to_string());
        panic!("graph dump {name} changed ({first_diff}); rerun with WIDEN_UPDATE_SNAPSHOTS=1 if intended");
    }
}

fn small(residual: ResidualSpec) -> ModelSpec {
    ModelSpec {
        name: "snapshot".into(),
        vocab: 16,
        d_model: 8,
        layers: 1,
        heads: 2,
        residual,
        ..ModelSpec::default()
    }
}

#[test]
fn residual_graph_dump_is_stable() {
    let low = lower(&small(ResidualSpec::Residual), 1, 4).unwrap();
    check_snapshot("residual.txt", &ir::graph::to_text(&low.graph));
    check_snapshot("residual.dot", &ir::graph::to_dot(&low.graph));
}

#[test]
fn vwn_graph_dump_is_stable() {
    let ghc = GhcSpec { m: 2, n: 4, ..GhcSpec::default() };
    let low = lower(&small(ResidualSpec::Ghc(ghc)), 1, 4).unwrap();
    check_snapshot("vwn.txt", &ir::graph::to_text(&low.graph));
}

#[test]
fn mhc_graph_dump_is_stable() {
    let mhc = MhcSpec { n: 2, sinkhorn_iters: 3, ..MhcSpec::default() };
    let low = lower(&small(ResidualSpec::Mhc(mhc)), 1, 4).unwrap();
    check_snapshot("mhc.txt", &ir::graph::to_text(&low.graph));
}

#[test]
fn lowering_twice_gives_identical_dumps() {
    let spec = small(ResidualSpec::Ghc(GhcSpec { m: 2, n: 4, ..GhcSpec::default() }));
    let a = ir::graph::to_text(&lower(&spec, 1, 4).unwrap().graph);
    let b = ir::graph::to_text(&lower(&spec, 1, 4).unwrap().graph);
    assert_eq!(a, b);
}
