//! Settings of the whole process that every widen program (the `widen`
//! command and the standalone trainers of `widen build`) makes first thing
//! in `main`.

/// Makes a write past the file-size limit (`ulimit -f`, `RLIMIT_FSIZE`) an
/// ordinary write error instead of a silent death.
///
/// By default the kernel kills a process that writes past the limit with
/// `SIGXFSZ`, which prints nothing and leaves a half-written run behind.
/// With the signal handled (the handler only records it), the write returns
/// `EFBIG` ("File too large") and the error paths that already report failed
/// writes name the file (see README, "What widen guarantees": a fault of the
/// environment is reported, never a silent exit). The disposition is a
/// handler rather than `SIG_IGN` so that programs this process starts (the C
/// compiler, cargo) get the default back when they exec.
pub fn report_file_size_limit_as_error() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        signal_hook::flag::register(signal_hook::consts::SIGXFSZ, Arc::new(AtomicBool::new(false)))?;
    }
    Ok(())
}
