//! The system C compiler driver (docs/architecture.md §6, CPU device).
//!
//! All kernels of a Plan are one C translation unit, compiled once with
//! `cc -O3 -fPIC -shared -ffp-contract=off -fno-math-errno -fno-trapping-math -std=c11
//! -march=native` (`CC` overrides the compiler; `-march=native` only where the
//! compiler accepts it; never `-ffast-math`, and no FMA contraction, so results
//! stay close to the reference executor) into a shared object that is
//! cached under [`default_cache_dir`] by a SHA-256 of (source, compiler
//! `--version`, flags, host CPU), written atomically (compile to a temporary
//! name, then rename) and loaded with `libloading`. Beside each shared object
//! a `.sha256` file holds its digest; a cached object is used only when it
//! still has that digest and loads, and is otherwise rebuilt (a corrupt cache
//! entry never fails a run: see README, "What widen guarantees"). Concurrent
//! compiles of one key each write their own temporary files and rename them
//! into place, so a reader sees a whole object or none, and a digest that
//! does not match the object beside it only costs a rebuild. Kernels are compiled on the
//! machine that runs them, so `-march=native` lets the compiler use its vector
//! units (AVX-512 where present) without changing IEEE results; the host CPU in
//! the key keeps a cache folder shared between different machines from handing
//! one a build for the other's instruction set.
//!
//! # The entry ABI
//!
//! Every kernel `k` gets a generated wrapper
//!
//! ```c
//! void widen_k_entry(void** args, int64_t start, int64_t end);
//! ```
//!
//! where `args[i]` points to the buffer of the kernel's `i`-th parameter (in
//! declaration order, with the parameter's element type and at least `len`
//! elements) and the call processes the items `[start, end)` of the grid.
//! One function-pointer type ([`EntryFn`]) thus calls any kernel; the runtime
//! splits `[0, n)` across its threads.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::kernel::{Kernel, KernelError};
use crate::render::render_c;

/// Flags passed to the compiler before the source file.
/// `-O3` rather than `-O2`: GCC's `-O2` vectorizes only loops
/// whose trip count needs no epilogue, which leaves the item loops of
/// elementwise kernels (SiLU, sigmoid, softmax) scalar; `-O3` changes no
/// arithmetic. `-fno-math-errno`: the kernels never read `errno`, and without the flag
/// every `sqrtf` carries an error branch that keeps its loop scalar; results
/// are unchanged (IEEE square roots either way). `-fno-trapping-math`: the
/// kernels never read the floating-point exception flags, and without the flag
/// GCC may not evaluate a comparison that the source evaluates only on one
/// side of a `?:` (it could raise "invalid" on a NaN), so on hosts without
/// AVX-512's masked compares it cannot turn the exponential's range clamp into
/// a select, and every kernel with an `exp` (SiLU, sigmoid, the softmaxes)
/// stays scalar. The flag changes no value: each operation is still the IEEE
/// operation the source names, in its order.
pub const FLAGS: &[&str] =
    &["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11"];

/// Flags of the C++ compiles of [`crate::cuda_emu`] (the CUDA dialect run on
/// the CPU): the arithmetic flags of [`FLAGS`] (no FMA contraction, no
/// `-ffast-math`), so a kernel's float operations are the ones its source
/// names in both dialects; `-O1`, since these modules are compiled for tests,
/// where compile time dominates, and the level changes no value.
pub const CXX_FLAGS: &[&str] =
    &["-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c++20"];

/// The source language of a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    /// C11 with [`FLAGS`] (the Cpu device's kernels).
    C,
    /// C++20 with [`CXX_FLAGS`] (the CUDA emulation).
    Cxx,
}

impl Language {
    fn extension(self) -> &'static str {
        match self {
            Language::C => "c",
            Language::Cxx => "cpp",
        }
    }
}

/// Added to [`FLAGS`] when the compiler accepts it (some compilers reject it on
/// some targets): code for the vector units of the machine that runs it.
pub const NATIVE_FLAG: &str = "-march=native";

/// What `-march=native` compiles for: the CPU model and feature flags of the
/// first processor in `/proc/cpuinfo`, or the target architecture where that
/// file does not exist.
fn host_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let wanted = ["model name", "flags", "Features", "CPU implementer", "CPU part"];
    let lines: Vec<&str> = info
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| wanted.iter().any(|w| l.starts_with(w)))
        .collect();
    format!("{} {}", std::env::consts::ARCH, lines.join("\n"))
}

/// What a compile that runs the compiler (a cache miss) tells the
/// [`observe_compiles`] observer before it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileNotice {
    /// The number of kernels in the module, when it is compiled from kernels.
    pub kernels: Option<usize>,
    /// The compiler's command line (`cc`, or what `CC` names).
    pub compiler: String,
}

/// Called before each compiler run; what it returns is held until the run ends
/// (a progress display that clears itself when dropped).
pub type CompileObserver = dyn Fn(&CompileNotice) -> Box<dyn std::any::Any> + Send + Sync;

static OBSERVER: OnceLock<Box<CompileObserver>> = OnceLock::new();

/// Installs the process's compile observer (the first call wins): a command
/// that trains shows the wait for the C compiler with it, since a cold kernel
/// cache can take tens of seconds on a large Plan (`runtime::progress`). A
/// cached build calls nothing.
pub fn observe_compiles(f: impl Fn(&CompileNotice) -> Box<dyn std::any::Any> + Send + Sync + 'static) {
    let _ = OBSERVER.set(Box::new(f));
}

/// The uniform entry point of every compiled kernel (see the module docs).
pub type EntryFn = unsafe extern "C" fn(args: *const *mut c_void, start: i64, end: i64);

/// Failures of compiling or loading a C module.
#[derive(Debug, Error)]
pub enum CcError {
    #[error("the compiler `{compiler}` could not be run (set CC, or CXX for the CUDA emulation, to a working compiler): {source}")]
    CompilerNotFound { compiler: String, source: std::io::Error },
    #[error("the compiler `{compiler}` failed on {}:\n{stderr}", file.display())]
    Compile { compiler: String, file: PathBuf, stderr: String },
    #[error("cannot load {}: {source}", file.display())]
    Load { file: PathBuf, source: libloading::Error },
    #[error("symbol `{symbol}` is missing from {}: {source}", file.display())]
    Symbol { file: PathBuf, symbol: String, source: libloading::Error },
    #[error("kernel `{kernel}` is not part of {}", file.display())]
    UnknownKernel { kernel: String, file: PathBuf },
    #[error(
        "the kernel cache {} cannot be written ({source}); set WIDEN_CACHE_DIR to a writable \
         folder with free space (or make this one writable)",
        dir.display()
    )]
    Cache { dir: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// An error writing into the cache folder `dir`: it names the folder and
/// `WIDEN_CACHE_DIR`, never the temporary file that failed.
fn cache_err(dir: &Path) -> impl FnOnce(std::io::Error) -> CcError + '_ {
    move |source| CcError::Cache { dir: dir.to_path_buf(), source }
}

/// The hex SHA-256 of `bytes`.
pub(crate) fn digest(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The file beside a cached shared object holding its digest.
pub(crate) fn digest_path(so: &Path) -> PathBuf {
    let mut name = so.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}

/// Whether the cached object `so` is the one its compile wrote: its digest
/// file exists and matches its bytes. Any read failure counts as a mismatch.
pub(crate) fn verified(so: &Path) -> bool {
    match (std::fs::read(so), std::fs::read_to_string(digest_path(so))) {
        (Ok(bytes), Ok(want)) => digest(&bytes) == want.trim(),
        _ => false,
    }
}

/// Where compiled modules are cached: `$WIDEN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/widen`, else `~/.cache/widen`, else a folder in the
/// system temporary directory.
pub fn default_cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("WIDEN_CACHE_DIR") {
        dir
    } else if let Some(xdg) = var("XDG_CACHE_HOME") {
        xdg.join("widen")
    } else if let Some(home) = var("HOME") {
        home.join(".cache").join("widen")
    } else {
        std::env::temp_dir().join("widen-cache")
    }
}

/// A resolved C compiler plus the cache it writes to.
#[derive(Debug, Clone)]
pub struct Compiler {
    /// Program and leading arguments (`CC` may be e.g. `ccache gcc`).
    command: Vec<String>,
    version: String,
    /// [`FLAGS`], plus [`NATIVE_FLAG`] when the compiler accepts it.
    flags: Vec<String>,
    /// [`host_cpu`], read once: part of the cache key.
    host_cpu: String,
    cache_dir: PathBuf,
    language: Language,
}

impl Compiler {
    /// The compiler named by `CC` (default `cc`) with [`default_cache_dir`].
    pub fn from_env() -> Result<Compiler, CcError> {
        let cc = std::env::var("CC").ok().filter(|v| !v.trim().is_empty()).unwrap_or_else(|| "cc".into());
        Compiler::new(&cc, default_cache_dir())
    }

    /// `cc` is a command line (program and arguments, split on whitespace);
    /// runs `cc --version` once, since its output is part of the cache key.
    pub fn new(cc: &str, cache_dir: PathBuf) -> Result<Compiler, CcError> {
        Compiler::for_language(cc, cache_dir, Language::C, &[])
    }

    /// A C++ compiler (`cxx`, a command line as for [`Compiler::new`]) with
    /// [`CXX_FLAGS`] followed by `extra` flags, e.g. a sanitizer's.
    pub fn cxx(cxx: &str, cache_dir: PathBuf, extra: &[&str]) -> Result<Compiler, CcError> {
        Compiler::for_language(cxx, cache_dir, Language::Cxx, extra)
    }

    fn for_language(
        cc: &str,
        cache_dir: PathBuf,
        language: Language,
        extra: &[&str],
    ) -> Result<Compiler, CcError> {
        let command: Vec<String> = cc.split_whitespace().map(String::from).collect();
        let Some((program, args)) = command.split_first() else {
            let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty compiler command");
            return Err(CcError::CompilerNotFound { compiler: cc.into(), source });
        };
        let out = Command::new(program)
            .args(args)
            .arg("--version")
            .output()
            .map_err(|source| CcError::CompilerNotFound { compiler: cc.into(), source })?;
        if !out.status.success() {
            let msg = format!("`{cc} --version` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
            let source = std::io::Error::other(msg);
            return Err(CcError::CompilerNotFound { compiler: cc.into(), source });
        }
        let version = String::from_utf8_lossy(&out.stdout).into_owned();
        let flags = match language {
            Language::C => {
                let native = Command::new(program)
                    .args(args)
                    .args([NATIVE_FLAG, "-fsyntax-only", "-x", "c", "-"])
                    .stdin(std::process::Stdio::null())
                    .output()
                    .is_ok_and(|o| o.status.success());
                FLAGS
                    .iter()
                    .copied()
                    .chain(native.then_some(NATIVE_FLAG))
                    .chain(extra.iter().copied())
                    .collect()
            }
            Language::Cxx => CXX_FLAGS.iter().chain(extra).copied().collect::<Vec<_>>(),
        };
        let flags = flags.into_iter().map(String::from).collect();
        Ok(Compiler { command, version, flags, host_cpu: host_cpu(), cache_dir, language })
    }

    /// The flags every compile passes before the source file.
    pub fn flags(&self) -> &[String] {
        &self.flags
    }

    /// The `--version` output that keys the cache.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The folder holding cached sources and shared objects.
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    fn key(&self, source: &str) -> String {
        let mut h = Sha256::new();
        let mut part = |s: &str| {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        };
        part("widen-cc/1");
        part(self.language.extension());
        self.command.iter().for_each(|c| part(c));
        part(&self.version);
        self.flags.iter().for_each(|f| part(f));
        part(&self.host_cpu);
        part(source);
        h.finalize()[..16].iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    /// Renders `kernels` as one C module and compiles it (or loads the cached build).
    pub fn compile_kernels(&self, kernels: &[Kernel]) -> Result<Library, CcError> {
        let source = render_c(kernels)?;
        let mut lib = self.compile_observed(&source, Some(kernels.len()))?;
        lib.kernels = Some(kernels.iter().map(|k| (k.name.clone(), k.params.len())).collect());
        Ok(lib)
    }

    /// Compiles C source into a shared object in the cache (or reuses the
    /// cached one with the same key) and loads it.
    ///
    /// A cached object is reused only when it matches its digest and loads;
    /// a corrupt, truncated or unloadable one is rebuilt in its place.
    pub fn compile_source(&self, source: &str) -> Result<Library, CcError> {
        self.compile_observed(source, None)
    }

    fn compile_observed(&self, source: &str, kernels: Option<usize>) -> Result<Library, CcError> {
        let key = self.key(source);
        let so = self.cache_dir.join(format!("widen-{key}.so"));
        if so.is_file() && verified(&so) {
            // SAFETY: the library is our own generated C (its digest is the
            // one our compile recorded): it has no initializers with side effects.
            if let Ok(lib) = unsafe { libloading::Library::new(&so) } {
                return Ok(Library { lib: Arc::new(lib), path: so, cached: true, kernels: None });
            }
        }
        let notice = CompileNotice { kernels, compiler: self.command.join(" ") };
        let shown = OBSERVER.get().map(|observe| observe(&notice));
        let built = self.build(&key, source, &so);
        drop(shown);
        built?;
        // SAFETY: as above; the object was just compiled from `source`.
        let lib = unsafe { libloading::Library::new(&so) }
            .map_err(|source| CcError::Load { file: so.clone(), source })?;
        Ok(Library { lib: Arc::new(lib), path: so, cached: false, kernels: None })
    }

    /// Compiles `source` into `so`: the source, the object and its digest are
    /// each written under a temporary name and renamed into place, the
    /// digest before the object, so no reader ever sees a partial file.
    fn build(&self, key: &str, source: &str, so: &Path) -> Result<(), CcError> {
        let dir = &self.cache_dir;
        std::fs::create_dir_all(dir).map_err(cache_err(dir))?;
        let c = dir.join(format!("widen-{key}.{}", self.language.extension()));
        write_atomic(&c, source.as_bytes()).map_err(cache_err(dir))?;
        let tmp = temp_name(so);
        let (program, args) = self.command.split_first().expect("Compiler::new rejects empty commands");
        let out = Command::new(program)
            .args(args)
            .args(&self.flags)
            .arg("-o")
            .arg(&tmp)
            .arg(&c)
            .arg("-lm")
            .output()
            .map_err(|source| CcError::CompilerNotFound { compiler: self.command.join(" "), source })?;
        let built = std::fs::read(&tmp);
        let (true, Ok(bytes)) = (out.status.success(), built) else {
            let _ = std::fs::remove_file(&tmp);
            let mut stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            if out.status.success() {
                stderr = format!("the compiler reported success but wrote no object\n{stderr}");
            }
            return Err(CcError::Compile { compiler: self.command.join(" "), file: c, stderr });
        };
        let placed = write_atomic(&digest_path(so), digest(&bytes).as_bytes())
            .and_then(|()| std::fs::rename(&tmp, so));
        if placed.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        placed.map_err(cache_err(dir))
    }
}

/// A unique sibling name for atomic writes: the process id, the time and a
/// per-process counter, so neither two processes nor two threads of one
/// process compiling the same key ever share a temporary file.
fn temp_name(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.{}.{nanos}.{n}.tmp", std::process::id()))
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temp_name(path);
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A loaded C module.
#[derive(Debug)]
pub struct Library {
    lib: Arc<libloading::Library>,
    path: PathBuf,
    cached: bool,
    /// Kernel names and parameter counts, when compiled from kernels.
    kernels: Option<Vec<(String, usize)>>,
}

impl Library {
    /// The shared object's path in the cache.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the shared object came from the cache (no compiler run).
    pub fn from_cache(&self) -> bool {
        self.cached
    }

    /// The function `symbol` with the type `F`, and the library that keeps it valid.
    ///
    /// # Safety
    /// `F` must be the function pointer type of `symbol`'s definition.
    pub(crate) unsafe fn symbol<F: Copy>(
        &self,
        symbol: &str,
    ) -> Result<(F, Arc<libloading::Library>), CcError> {
        // SAFETY: the caller guarantees the type.
        let f = unsafe { self.lib.get::<F>(symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|source| CcError::Symbol { file: self.path.clone(), symbol: symbol.into(), source })?;
        Ok((f, Arc::clone(&self.lib)))
    }

    /// The entry point of kernel `name` (`widen_<name>_entry`).
    pub fn entry(&self, name: &str) -> Result<Entry, CcError> {
        let arity = match &self.kernels {
            Some(ks) => match ks.iter().find(|(k, _)| k == name) {
                Some((_, n)) => Some(*n),
                None => return Err(CcError::UnknownKernel { kernel: name.into(), file: self.path.clone() }),
            },
            None => None,
        };
        let symbol = format!("widen_{name}_entry");
        // SAFETY: every `widen_*_entry` the renderer emits has the `EntryFn` signature.
        let f = unsafe { self.lib.get::<EntryFn>(symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|source| CcError::Symbol { file: self.path.clone(), symbol, source })?;
        Ok(Entry { f, arity, _lib: Arc::clone(&self.lib) })
    }
}

/// A kernel's entry point; it keeps its library loaded, so it can be stored
/// and shared across threads independently of the [`Library`].
#[derive(Debug, Clone)]
pub struct Entry {
    f: EntryFn,
    arity: Option<usize>,
    _lib: Arc<libloading::Library>,
}

impl Entry {
    /// The raw function pointer (valid while this `Entry` lives).
    pub fn as_fn(&self) -> EntryFn {
        self.f
    }

    /// The kernel's parameter count, when known.
    pub fn arity(&self) -> Option<usize> {
        self.arity
    }

    /// Runs the items `[start, end)`.
    ///
    /// # Safety
    /// `args` must hold one pointer per kernel parameter, in order, each to a
    /// live buffer of the parameter's element type and length; buffers written
    /// by the kernel must not alias any other argument, and concurrent calls
    /// must use disjoint item ranges that write disjoint elements;
    /// `0 <= start <= end <= n`.
    pub unsafe fn call(&self, args: &[*mut c_void], start: i64, end: i64) {
        debug_assert!(
            !matches!(self.arity, Some(n) if n != args.len()),
            "argument count differs from the kernel's"
        );
        (self.f)(args.as_ptr(), start, end)
    }
}
