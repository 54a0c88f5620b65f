//! The NVRTC driver (docs/architecture.md §6 and §9 item 5).
//!
//! NVRTC is loaded at run time (`libnvrtc.so.13`, then `libnvrtc.so`, found
//! through the dynamic loader, so `LD_LIBRARY_PATH` is honoured); there is no
//! link-time dependency, and a machine without it gets
//! [`NvrtcError::NotFound`]. NVRTC 13.0 matches the GPU machines' driver: a
//! newer one emits PTX that driver rejects.
//!
//! [`compile`] builds a CUDA module twice: to PTX for a virtual architecture
//! (`compute_XX`, what the runtime loads) and to a CUBIN for the real one
//! (`sm_XX`) with `--ptxas-options=-v`, whose report is parsed into
//! per-kernel [`KernelResources`] so tests can require zero spills.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use thiserror::Error;

/// Library names tried in order.
pub const LIBRARY_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so"];

/// Failures of loading NVRTC or compiling with it.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum NvrtcError {
    #[error("NVRTC is not available (tried {tried}; put the folder holding libnvrtc.so.13 on LD_LIBRARY_PATH): {reason}")]
    NotFound { tried: String, reason: String },
    #[error("NVRTC call {call} failed: {message} (code {code})")]
    Call { call: &'static str, code: i32, message: String },
    #[error("NVRTC failed to compile the module for {arch}:\n{log}")]
    Compile { arch: String, log: String },
    #[error("architecture `{arch}` is not of the form sm_<digits>")]
    Arch { arch: String },
    #[error("the CUDA source contains a NUL byte")]
    NulInSource,
    #[error(
        "the kernel cache {} cannot be written ({message}); set WIDEN_CACHE_DIR to a writable \
         folder with free space",
        dir.display()
    )]
    Cache { dir: PathBuf, message: String },
}

type Program = *mut c_void;
type Status = c_int;

/// The NVRTC entry points we use (signatures from `nvrtc.h`).
struct Api {
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    destroy_program: unsafe extern "C" fn(*mut Program) -> Status,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    /// Keeps the function pointers above valid.
    _lib: libloading::Library,
}

fn load() -> Result<Api, NvrtcError> {
    let mut reasons = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: loading NVRTC runs no initializers with preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib),
            Err(e) => reasons.push(e.to_string()),
        }
    }
    Err(NvrtcError::NotFound { tried: LIBRARY_NAMES.join(", "), reason: reasons.join("; ") })
}

fn bind(lib: libloading::Library) -> Result<Api, NvrtcError> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the field types above are the C signatures in nvrtc.h.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e: libloading::Error| {
                NvrtcError::NotFound { tried: $name.into(), reason: e.to_string() }
            })?
        };
    }
    Ok(Api {
        get_error_string: sym!("nvrtcGetErrorString"),
        version: sym!("nvrtcVersion"),
        create_program: sym!("nvrtcCreateProgram"),
        destroy_program: sym!("nvrtcDestroyProgram"),
        compile_program: sym!("nvrtcCompileProgram"),
        get_program_log_size: sym!("nvrtcGetProgramLogSize"),
        get_program_log: sym!("nvrtcGetProgramLog"),
        get_ptx_size: sym!("nvrtcGetPTXSize"),
        get_ptx: sym!("nvrtcGetPTX"),
        get_cubin_size: sym!("nvrtcGetCUBINSize"),
        get_cubin: sym!("nvrtcGetCUBIN"),
        _lib: lib,
    })
}

fn api() -> Result<&'static Api, NvrtcError> {
    static API: OnceLock<Result<Api, NvrtcError>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

impl Api {
    fn check(&self, call: &'static str, status: Status) -> Result<(), NvrtcError> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let message =
            unsafe { CStr::from_ptr((self.get_error_string)(status)) }.to_string_lossy().into_owned();
        Err(NvrtcError::Call { call, code: status, message })
    }

    /// Reads a size-then-bytes result (`nvrtcGetXSize` / `nvrtcGetX`).
    fn fetch(
        &self,
        prog: Program,
        names: (&'static str, &'static str),
        size: unsafe extern "C" fn(Program, *mut usize) -> Status,
        get: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    ) -> Result<Vec<u8>, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: `prog` is a live program; NVRTC writes `n` bytes into a buffer of `n` bytes.
        self.check(names.0, unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            self.check(names.1, unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
        }
        Ok(buf)
    }

    /// Compiles `src` with `options`; returns (log, output) where output is
    /// the PTX or the CUBIN.
    fn build(
        &self,
        src: &CStr,
        options: &[&str],
        cubin: bool,
        arch: &str,
    ) -> Result<(String, Vec<u8>), NvrtcError> {
        let opts: Vec<CString> =
            options.iter().map(|o| CString::new(*o).expect("options are NUL-free literals")).collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        let name = c"widen.cu";
        // SAFETY: all pointers are valid NUL-terminated strings for the call.
        self.check("nvrtcCreateProgram", unsafe {
            (self.create_program)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        struct Guard<'a>(&'a Api, Program);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                // SAFETY: the program was created above and is destroyed once.
                unsafe { (self.0.destroy_program)(&mut self.1) };
            }
        }
        let guard = Guard(self, prog);
        // SAFETY: `opt_ptrs` holds `opts.len()` valid strings that outlive the call.
        let status = unsafe { (self.compile_program)(guard.1, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let log = self.fetch(
            guard.1,
            ("nvrtcGetProgramLogSize", "nvrtcGetProgramLog"),
            self.get_program_log_size,
            self.get_program_log,
        )?;
        let log = String::from_utf8_lossy(&log).trim_end_matches('\0').trim_end().to_string();
        if status == 6 {
            return Err(NvrtcError::Compile { arch: arch.into(), log });
        }
        self.check("nvrtcCompileProgram", status)?;
        let out = if cubin {
            self.fetch(guard.1, ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"), self.get_cubin_size, self.get_cubin)?
        } else {
            let mut ptx =
                self.fetch(guard.1, ("nvrtcGetPTXSize", "nvrtcGetPTX"), self.get_ptx_size, self.get_ptx)?;
            while ptx.last() == Some(&0) {
                ptx.pop();
            }
            ptx
        };
        Ok((log, out))
    }
}

/// Whether NVRTC can be loaded on this machine.
pub fn is_available() -> bool {
    api().is_ok()
}

/// NVRTC's `(major, minor)` version.
pub fn version() -> Result<(i32, i32), NvrtcError> {
    let api = api()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    api.check("nvrtcVersion", unsafe { (api.version)(&mut major, &mut minor) })?;
    Ok((major, minor))
}

/// Registers, spills, stack and shared memory of one kernel, from ptxas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The (unmangled, `extern "C"`) kernel name.
    pub name: String,
    pub registers: u32,
    pub spill_stores: u64,
    pub spill_loads: u64,
    pub stack_bytes: u64,
    /// Static shared memory (`smem`).
    pub shared_bytes: u64,
}

/// The result of [`compile`].
#[derive(Debug, Clone)]
pub struct Compiled {
    /// PTX for the virtual architecture (`compute_XX`).
    pub ptx: String,
    /// Machine code for the real architecture (`sm_XX`).
    pub cubin: Vec<u8>,
    /// Both compile logs (front end and ptxas report).
    pub log: String,
    /// One entry per kernel in the ptxas report.
    pub resources: Vec<KernelResources>,
}

impl Compiled {
    /// Log lines that are warnings (generated code is expected to have none).
    pub fn warnings(&self) -> Vec<&str> {
        self.log.lines().filter(|l| l.to_ascii_lowercase().contains("warning")).collect()
    }

    /// The resources of kernel `name` (the `widen_<name>` symbol).
    pub fn resources_of(&self, symbol: &str) -> Option<&KernelResources> {
        self.resources.iter().find(|r| r.name == symbol)
    }
}

/// Compiles a CUDA module for `arch` (e.g. `"sm_90"`): PTX for
/// `compute_90` and a CUBIN for `sm_90` with the ptxas resource report.
pub fn compile(source: &str, arch: &str) -> Result<Compiled, NvrtcError> {
    let digits =
        arch.strip_prefix("sm_").filter(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_alphanumeric()));
    let Some(digits) = digits else {
        return Err(NvrtcError::Arch { arch: arch.into() });
    };
    let api = api()?;
    let src = CString::new(source).map_err(|_| NvrtcError::NulInSource)?;
    let virt = format!("--gpu-architecture=compute_{digits}");
    let real = format!("--gpu-architecture={arch}");
    let (ptx_log, ptx) = api.build(&src, &options(&virt, false), false, arch)?;
    let (cubin_log, cubin) = api.build(&src, &options(&real, true), true, arch)?;
    let log = [ptx_log, cubin_log].into_iter().filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n");
    let resources = parse_ptxas_report(&log);
    Ok(Compiled { ptx: String::from_utf8_lossy(&ptx).into_owned(), cubin, log, resources })
}

/// What [`compile_cached`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Machine code for the real architecture (`sm_XX`): what a device loads first.
    Cubin,
    /// PTX for the virtual architecture (`compute_XX`): compiled only when the driver
    /// refuses the CUBIN (a GPU of another architecture than the one asked for).
    Ptx,
}

/// One NVRTC output for `arch`, from the cache in `cache_dir` (the C kernels' cache,
/// `cc::default_cache_dir`) when it holds it, else compiled and stored there.
/// Returns the bytes and whether they came from the cache.
///
/// The key is the SHA-256 of the NVRTC version, the options and the source, so a
/// Plan is compiled once per machine and NVRTC version; a file is used only when it
/// matches the digest its compile recorded, and is rebuilt in place otherwise. A
/// cache folder that cannot be written is an error naming it (the module would
/// otherwise be recompiled on every load without a word).
pub fn compile_cached(
    source: &str,
    arch: &str,
    output: Output,
    cache_dir: &Path,
) -> Result<(Vec<u8>, bool), NvrtcError> {
    use sha2::{Digest, Sha256};
    let digits =
        arch.strip_prefix("sm_").filter(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_alphanumeric()));
    let Some(digits) = digits else {
        return Err(NvrtcError::Arch { arch: arch.into() });
    };
    let api = api()?;
    let (major, minor) = version()?;
    let flag = match output {
        Output::Cubin => format!("--gpu-architecture={arch}"),
        Output::Ptx => format!("--gpu-architecture=compute_{digits}"),
    };
    let opts = options(&flag, false);
    let mut h = Sha256::new();
    for part in ["widen-nvrtc/1".to_string(), format!("{major}.{minor}"), opts.join(" "), source.to_string()]
    {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let key: String = h.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect();
    let ext = match output {
        Output::Cubin => "cubin",
        Output::Ptx => "ptx",
    };
    let file = cache_dir.join(format!("widen-{key}.{ext}"));
    if file.is_file() && crate::cc::verified(&file) {
        if let Ok(bytes) = std::fs::read(&file) {
            return Ok((bytes, true));
        }
    }
    let src = CString::new(source).map_err(|_| NvrtcError::NulInSource)?;
    let (_, bytes) = api.build(&src, &opts, output == Output::Cubin, arch)?;
    let cache =
        |e: std::io::Error| NvrtcError::Cache { dir: cache_dir.to_path_buf(), message: e.to_string() };
    std::fs::create_dir_all(cache_dir).map_err(cache)?;
    crate::cc::write_atomic(&crate::cc::digest_path(&file), crate::cc::digest(&bytes).as_bytes())
        .map_err(cache)?;
    crate::cc::write_atomic(&file, &bytes).map_err(cache)?;
    Ok((bytes, false))
}

/// The NVRTC options of a compile for `architecture` (a `--gpu-architecture=`
/// flag), to a CUBIN with the ptxas report when `cubin`.
///
/// `--prec-div=false`: fp32 division as the hardware's approximate reciprocal-multiply
/// (at most 2 ulp) instead of the IEEE round-to-nearest subroutine. That subroutine is
/// a call, and in large fused kernels (Sinkhorn, norms) ptxas saves registers around it
/// and reports the saves as spills; 2 ulp is far inside the fp32 parity tolerances the
/// devices are held to (runtime::parity). Square roots stay IEEE.
///
/// `-lineinfo`: source line tables in the module (no change to the code), so a
/// fault reported by `compute-sanitizer` or a profiler names the line of the
/// generated CUDA source.
pub fn options(architecture: &str, cubin: bool) -> Vec<&str> {
    let mut o = vec![architecture, "--prec-div=false", "-lineinfo"];
    if cubin {
        o.push("--ptxas-options=-v");
    }
    o
}

/// The number before `unit` in `text` (`"12 bytes spill stores"` → 12).
fn number_before(text: &str, unit: &str) -> Option<u64> {
    let head = &text[..text.find(unit)?];
    head.trim_end().rsplit(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Parses the `ptxas -v` report into per-kernel resources. The report has,
/// per kernel, lines like:
///
/// ```text
/// ptxas info    : Compiling entry function 'widen_k' for 'sm_90'
/// ptxas info    : Function properties for widen_k
///     16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
/// ptxas info    : Used 24 registers, used 1 barriers, 1024 bytes smem, 368 bytes cmem[0]
/// ```
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    // "Function properties" blocks also appear for non-inlined device
    // functions: stack and spill lines go to the function they name.
    let mut props_of = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(KernelResources { name: name.into(), ..KernelResources::default() });
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props_of = rest.trim().to_string();
        } else if line.contains("bytes stack frame") {
            if let Some(r) = out.iter_mut().rev().find(|r| r.name == props_of) {
                r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                r.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            }
        } else if line.contains("Used ") && line.contains("registers") {
            if let Some(r) = out.last_mut() {
                r.registers =
                    number_before(line, "registers").and_then(|n| u32::try_from(n).ok()).unwrap_or(0);
                r.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_compiles_carry_line_info_and_only_the_cubin_asks_for_the_report() {
        let ptx = options("--gpu-architecture=compute_90", false);
        assert_eq!(ptx, ["--gpu-architecture=compute_90", "--prec-div=false", "-lineinfo"]);
        let cubin = options("--gpu-architecture=sm_90", true);
        assert!(cubin.contains(&"-lineinfo") && cubin.contains(&"--prec-div=false"), "{cubin:?}");
        assert_eq!(cubin.last(), Some(&"--ptxas-options=-v"));
    }
}
