//! The CUDA dialect run on the CPU (docs/architecture.md §6, "The CUDA
//! dialect on the CPU"), so every test run executes the kernels the GPU gets.
//!
//! A module is the CUDA translation unit of [`render_cuda`] compiled as C++
//! by the system C++ compiler (`CXX`, default `c++`) after the header
//! `cuda_emu.hpp`, which defines the CUDA built-ins the dialect uses
//! (`threadIdx`, `__syncthreads`, `__shfl_down_sync`, `__shared__`, ...) and
//! runs every CUDA thread of a block as a fiber, switching at barriers. Each
//! kernel `k` gets a host entry
//!
//! ```c
//! int widen_k_emu(void** args, int nargs, unsigned grid, unsigned block, int order);
//! ```
//!
//! that launches `grid` blocks of `block` threads with the kernel's pointer
//! arguments `args` (the Cuda device's launch: one pointer per parameter, in
//! order), running the lanes of each block first to last (`order` 0) or last
//! to first (1). Compiles, caching and errors are [`crate::cc`]'s.
//!
//! `WIDEN_CUDA_EMU_SANITIZE=thread` or `address` adds `-fsanitize=thread` or
//! `-fsanitize=address` (with `-g`) to the compile ([`SANITIZE_ENV`]). The
//! process must then load the sanitizer's runtime first: run the tests with
//! `LD_PRELOAD=$(c++ -print-file-name=libtsan.so)` (or `libasan.so`).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use thiserror::Error;

use crate::cc::{default_cache_dir, CcError, Compiler};
use crate::kernel::Kernel;
use crate::render::render_cuda;

/// The header that defines the CUDA built-ins on the CPU.
pub const HEADER: &str = include_str!("cuda_emu.hpp");

/// The environment variable that turns a sanitizer on: `thread` or `address`.
pub const SANITIZE_ENV: &str = "WIDEN_CUDA_EMU_SANITIZE";

/// The order the lanes of a block run in between barriers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneOrder {
    /// Lane 0 first.
    Forward,
    /// The last lane first.
    Reverse,
}

/// A sanitizer to compile the emulation with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sanitizer {
    /// `-fsanitize=thread`: the fibers of a block synchronise only at
    /// barriers, so a missing barrier is reported as a data race.
    Thread,
    /// `-fsanitize=address`: out-of-bounds accesses of the kernels.
    Address,
}

impl Sanitizer {
    /// The sanitizer [`SANITIZE_ENV`] asks for: `None` when unset or empty.
    pub fn from_env() -> Result<Option<Sanitizer>, EmuError> {
        Sanitizer::parse(std::env::var(SANITIZE_ENV).ok().as_deref())
    }

    /// Parses a value of [`SANITIZE_ENV`].
    pub fn parse(value: Option<&str>) -> Result<Option<Sanitizer>, EmuError> {
        match value.map(str::trim) {
            None | Some("") => Ok(None),
            Some("thread") => Ok(Some(Sanitizer::Thread)),
            Some("address") => Ok(Some(Sanitizer::Address)),
            Some(other) => Err(EmuError::Sanitizer { value: other.into() }),
        }
    }

    /// The compiler flags that turn it on.
    pub fn flags(self) -> &'static [&'static str] {
        match self {
            Sanitizer::Thread => &["-fsanitize=thread", "-g"],
            Sanitizer::Address => &["-fsanitize=address", "-fno-omit-frame-pointer", "-g"],
        }
    }
}

/// Failures of building or running an emulated module.
#[derive(Debug, Error)]
pub enum EmuError {
    #[error(transparent)]
    Cc(#[from] CcError),
    #[error("{SANITIZE_ENV}={value}: expected `thread` or `address`")]
    Sanitizer { value: String },
    #[error("kernel `{kernel}` is not part of the emulated module")]
    UnknownKernel { kernel: String },
    #[error("kernel `{kernel}`: {message}")]
    Launch { kernel: String, message: String },
}

/// The C++ source of a module: the header, `cuda_source` (the CUDA dialect of
/// `kernels`, possibly edited) and a host entry per kernel.
pub fn emulation_source(cuda_source: &str, kernels: &[Kernel]) -> String {
    let mut s = String::with_capacity(HEADER.len() + cuda_source.len() + 256 * kernels.len());
    s.push_str(HEADER);
    s.push_str("\n#line 1 \"widen.cu\"\n");
    s.push_str(cuda_source);
    s.push_str("\n/* Host entries of the emulation. */\n");
    for k in kernels {
        let _ = writeln!(
            s,
            "extern \"C\" int {}(void** args, int nargs, unsigned int grid, unsigned int block, int order) {{\n    \
             return ::widen_emu::launch_kernel({}, args, nargs, grid, block, order);\n}}",
            entry_symbol(k),
            k.symbol()
        );
    }
    s.push_str(
        "extern \"C\" const char* widen_emu_last_error(void) {\n    return ::widen_emu::last_error();\n}\n",
    );
    s
}

fn entry_symbol(k: &Kernel) -> String {
    format!("{}_emu", k.symbol())
}

/// The C++ compiler of emulated modules.
#[derive(Debug, Clone)]
pub struct Emulator {
    compiler: Compiler,
}

impl Emulator {
    /// `CXX` (default `c++`), the cache of [`default_cache_dir`] and the
    /// sanitizer of [`SANITIZE_ENV`].
    pub fn from_env() -> Result<Emulator, EmuError> {
        let cxx = std::env::var("CXX").ok().filter(|v| !v.trim().is_empty()).unwrap_or_else(|| "c++".into());
        Emulator::new(&cxx, default_cache_dir(), Sanitizer::from_env()?)
    }

    /// `cxx` is a command line (program and arguments).
    pub fn new(cxx: &str, cache_dir: PathBuf, sanitizer: Option<Sanitizer>) -> Result<Emulator, EmuError> {
        let extra = sanitizer.map_or(&[][..], Sanitizer::flags);
        Ok(Emulator { compiler: Compiler::cxx(cxx, cache_dir, extra)? })
    }

    /// The flags every compile passes.
    pub fn flags(&self) -> &[String] {
        self.compiler.flags()
    }

    /// Renders `kernels` in the CUDA dialect and compiles them.
    pub fn compile_kernels(&self, kernels: &[Kernel]) -> Result<EmuModule, EmuError> {
        let source = render_cuda(kernels).map_err(CcError::from)?;
        self.compile_cuda(&source, kernels)
    }

    /// Compiles `cuda_source`, which must define the kernels `kernels` with
    /// the CUDA dialect's signatures (e.g. [`render_cuda`]'s output, edited).
    pub fn compile_cuda(&self, cuda_source: &str, kernels: &[Kernel]) -> Result<EmuModule, EmuError> {
        let lib = self.compiler.compile_source(&emulation_source(cuda_source, kernels))?;
        // SAFETY: `emulation_source` defines this function with this signature.
        let (last_error, _) = unsafe { lib.symbol::<LastErrorFn>("widen_emu_last_error") }?;
        let mut entries = Vec::with_capacity(kernels.len());
        for k in kernels {
            // SAFETY: `emulation_source` defines every entry with the `EmuFn` signature.
            let (f, lib) = unsafe { lib.symbol::<EmuFn>(&entry_symbol(k)) }?;
            entries.push(EmuKernel { name: k.name.clone(), arity: k.params.len(), f, last_error, _lib: lib });
        }
        Ok(EmuModule { entries })
    }
}

type EmuFn = unsafe extern "C" fn(*const *mut c_void, c_int, c_uint, c_uint, c_int) -> c_int;
type LastErrorFn = unsafe extern "C" fn() -> *const c_char;

/// The kernels of a compiled emulation module.
#[derive(Debug)]
pub struct EmuModule {
    entries: Vec<EmuKernel>,
}

impl EmuModule {
    /// Kernel `name`'s host entry.
    pub fn kernel(&self, name: &str) -> Result<&EmuKernel, EmuError> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| EmuError::UnknownKernel { kernel: name.into() })
    }
}

/// The host entry of one emulated kernel; it keeps its library loaded.
#[derive(Debug, Clone)]
pub struct EmuKernel {
    name: String,
    arity: usize,
    f: EmuFn,
    last_error: LastErrorFn,
    _lib: Arc<libloading::Library>,
}

impl EmuKernel {
    /// Runs `grid` blocks of `block` threads on the calling thread, lanes in
    /// `order`; an error names a divergent barrier, a partial shuffle mask or
    /// a launch CUDA would reject.
    ///
    /// # Safety
    /// `args` must hold one pointer per kernel parameter, in order, each to a
    /// live buffer of the parameter's element type and length, and written
    /// buffers must not alias other arguments (the Cuda device's launch).
    pub unsafe fn launch(
        &self,
        args: &[*mut c_void],
        grid: u32,
        block: u32,
        order: LaneOrder,
    ) -> Result<(), EmuError> {
        if args.len() != self.arity {
            let message = format!("{} arguments for {} parameters", args.len(), self.arity);
            return Err(EmuError::Launch { kernel: self.name.clone(), message });
        }
        let order = match order {
            LaneOrder::Forward => 0,
            LaneOrder::Reverse => 1,
        };
        // SAFETY: the entry checks the argument count again; the caller
        // guarantees the buffers.
        let status = unsafe { (self.f)(args.as_ptr(), args.len() as c_int, grid, block, order) };
        if status == 0 {
            return Ok(());
        }
        // SAFETY: the message is a NUL-terminated thread-local buffer of the
        // library, valid until the next launch on this thread.
        let message = unsafe { CStr::from_ptr((self.last_error)()) }.to_string_lossy().into_owned();
        Err(EmuError::Launch { kernel: self.name.clone(), message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sanitizer_variable_takes_thread_or_address() {
        assert_eq!(Sanitizer::parse(None).unwrap(), None);
        assert_eq!(Sanitizer::parse(Some(" ")).unwrap(), None);
        assert_eq!(Sanitizer::parse(Some("thread")).unwrap(), Some(Sanitizer::Thread));
        assert_eq!(Sanitizer::parse(Some("address")).unwrap(), Some(Sanitizer::Address));
        let e = Sanitizer::parse(Some("memory")).unwrap_err().to_string();
        assert!(e.contains(SANITIZE_ENV) && e.contains("memory"), "{e}");
        assert!(Sanitizer::Thread.flags().contains(&"-fsanitize=thread"));
    }
}
