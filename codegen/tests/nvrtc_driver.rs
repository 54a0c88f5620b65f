//! Every canonical kernel compiles under NVRTC to PTX and an sm_90 CUBIN with
//! no spills and no warnings (docs/architecture.md §9 item 5). NVRTC comes from the
//! `nvidia-cuda-nvrtc` wheel that `.ci/run` installs; in CI (CI=true) its
//! absence is a failure, elsewhere the NVRTC tests skip with a message.

mod common;

use codegen::nvrtc::{self, parse_ptxas_report, NvrtcError};
use codegen::render::render_cuda;

fn nvrtc_present(test: &str) -> bool {
    if nvrtc::is_available() {
        return true;
    }
    let reason = nvrtc::version().unwrap_err();
    assert!(std::env::var("CI").as_deref() != Ok("true"), "CI requires NVRTC: {reason}");
    eprintln!("skipping {test}: {reason}");
    false
}

#[test]
fn canonical_kernels_compile_for_sm90_without_spills_or_warnings() {
    if !nvrtc_present("canonical_kernels_compile_for_sm90_without_spills_or_warnings") {
        return;
    }
    let (major, _) = nvrtc::version().unwrap();
    assert_eq!(major, 13, "NVRTC 13 matches the GPU machines' driver");
    let kernels = common::kernels::all();
    let src = render_cuda(&kernels).unwrap();
    let out = nvrtc::compile(&src, "sm_90").unwrap_or_else(|e| panic!("{e}\n{src}"));
    assert!(out.warnings().is_empty(), "warnings:\n{}", out.log);
    assert!(out.ptx.contains(".target sm_90"), "PTX is for compute_90");
    assert_eq!(&out.cubin[..4], b"\x7fELF", "CUBIN is an ELF image");
    assert_eq!(out.resources.len(), kernels.len(), "one report per kernel:\n{}", out.log);
    for k in &kernels {
        assert!(out.ptx.contains(&format!(".entry {}(", k.symbol())), "{} in PTX", k.symbol());
        let r =
            out.resources_of(&k.symbol()).unwrap_or_else(|| panic!("{} in report:\n{}", k.symbol(), out.log));
        assert!(r.registers > 0, "{r:?}");
        assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "{r:?}");
        let threads = u64::from(k.grid.block_threads());
        let want_smem = if k.grid.is_block() { 4 * threads } else { 0 };
        assert_eq!(r.shared_bytes, want_smem, "{r:?}");
    }
}

#[test]
fn compile_errors_carry_the_nvrtc_log() {
    if !nvrtc_present("compile_errors_carry_the_nvrtc_log") {
        return;
    }
    let err =
        nvrtc::compile("extern \"C\" __global__ void k() { undeclared_name = 1; }", "sm_90").unwrap_err();
    let NvrtcError::Compile { log, .. } = &err else { panic!("expected a compile error, got {err}") };
    assert!(log.contains("undeclared_name"), "{log}");
    assert!(matches!(nvrtc::compile("", "compute_90"), Err(NvrtcError::Arch { .. })));
}

#[test]
fn ptxas_report_is_parsed_per_kernel() {
    // NVRTC 13 report format (the second kernel's lines are as NVRTC 13.0 prints them).
    let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'widen_a' for 'sm_90'
ptxas info    : Function properties for widen_a
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 512 bytes smem, 368 bytes cmem[0]
ptxas info    : Compile time = 17.455 ms
ptxas info    : Function properties for widen_device_fn
    64 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'widen_b' for 'sm_90'
ptxas info    : Function properties for widen_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 7 registers, used 0 barriers
";
    let r = parse_ptxas_report(log);
    assert_eq!(r.len(), 2);
    assert_eq!(
        (
            r[0].name.as_str(),
            r[0].registers,
            r[0].stack_bytes,
            r[0].spill_stores,
            r[0].spill_loads,
            r[0].shared_bytes
        ),
        ("widen_a", 40, 24, 8, 12, 512)
    );
    assert_eq!(
        (r[1].name.as_str(), r[1].registers, r[1].spill_stores, r[1].shared_bytes),
        ("widen_b", 7, 0, 0)
    );
}

#[test]
fn modules_are_compiled_once_and_cached_by_content() {
    if !nvrtc_present("modules_are_compiled_once_and_cached_by_content") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("widen-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = render_cuda(&common::kernels::all()).unwrap();
    let (cubin, cached) = nvrtc::compile_cached(&src, "sm_90", nvrtc::Output::Cubin, &dir).unwrap();
    assert!(!cached);
    assert_eq!(&cubin[..4], b"\x7fELF", "a CUBIN is an ELF image");
    let (again, cached) = nvrtc::compile_cached(&src, "sm_90", nvrtc::Output::Cubin, &dir).unwrap();
    assert!(cached, "the second load compiles nothing");
    assert_eq!(again, cubin);
    // PTX is its own entry, compiled only when asked for.
    let (ptx, cached) = nvrtc::compile_cached(&src, "sm_90", nvrtc::Output::Ptx, &dir).unwrap();
    assert!(!cached && String::from_utf8_lossy(&ptx).contains(".target sm_90"));
    // Another source is another key; a corrupted entry is rebuilt, not loaded.
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cubin"))
        .collect();
    assert_eq!(entries.len(), 1);
    std::fs::write(&entries[0], b"not a cubin").unwrap();
    let (rebuilt, cached) = nvrtc::compile_cached(&src, "sm_90", nvrtc::Output::Cubin, &dir).unwrap();
    assert!(!cached, "a file that fails its digest is compiled again");
    assert_eq!(rebuilt, cubin);
    // A cache folder that cannot be created is an error naming it.
    let blocked = dir.join("file");
    std::fs::write(&blocked, b"").unwrap();
    let err = nvrtc::compile_cached(&src, "sm_90", nvrtc::Output::Cubin, &blocked.join("sub")).unwrap_err();
    assert!(matches!(err, NvrtcError::Cache { .. }) && err.to_string().contains("WIDEN_CACHE_DIR"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
