//! The Cpu device: executes a [`Plan`] in host memory (docs/architecture.md §6, §7).
//!
//! Loading a Plan
//! - allocates one vector per persistent buffer (parameters, gradients,
//!   inputs, outputs and constants, the latter filled with their value) and
//!   one arena per element type for the scratch buffers, placed at the
//!   offsets the memory planner chose;
//! - compiles all kernels as one C module with the system compiler (cached by
//!   content hash, see [`codegen::cc`]) and resolves their entry points;
//! - checks every step against the buffers it binds (see *Safety* below and
//!   [`super::plan_check`], shared with the Cuda device), so
//!   a malformed Plan is an error at load time, never memory corruption later.
//!
//! [`CpuDevice::run`] then executes the launch list in order: kernel steps
//! split their grid's items into contiguous ranges run on a persistent thread
//! pool, GEMM steps go through the AVX-512 kernel of `sgemm.rs` or the `gemm`
//! crate, zero steps clear a buffer. The sparse MoE steps (docs/math.md §1.6)
//! route on the calling thread with the reference's own function
//! ([`ir::exec::moe::route_into`]) and run a grouped GEMM as one product per
//! expert on the same GEMM path.
//!
//! # Safety
//!
//! Kernels are called through raw pointers (the `void** args` ABI of
//! [`codegen::cc`]). The invariants that make those calls sound are:
//! 1. every pointer addresses a live allocation of the parameter's element type
//!    holding at least the parameter's `len` elements: checked at load time
//!    (dtype and length of every bound buffer, arena extents), and storage is
//!    never resized after loading;
//! 2. a buffer a kernel writes does not overlap any other argument of the same
//!    launch: checked at load time (identical persistent buffers or
//!    intersecting arena ranges are rejected);
//! 3. items are independent: the item ranges handed to different threads write
//!    disjoint elements. This is the contract of the kernel IR's grids (an
//!    item owns its outputs; reductions over items are two-phase, docs/architecture.md §5)
//!    that the code generator upholds; it cannot be checked here.

mod executor;
mod paired_gemm;
mod pool;
mod sgemm;

pub use executor::CpuExecutor;

use super::plan_check::{self, PlanCheckError};
use crate::step::StepError;
use codegen::cc::{CcError, Compiler, Entry};
use codegen::kernel::{Expr, Grid, Kernel, Stmt};
use codegen::plan::{BufferDecl, BufferId, BufferRole, Chain, Gemm, GroupedGemm, MoeRoute, Plan, Step};
use ir::DType;
use pool::Pool;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Errors loading or running a Plan on the Cpu device.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error(transparent)]
    Cc(#[from] CcError),
    #[error(transparent)]
    Plan(#[from] PlanCheckError),
    #[error("steps {start}..{end} are not within the plan's {count} steps")]
    StepRange { start: usize, end: usize, count: usize },
    #[error("buffer #{id} does not exist: the plan has {count} buffers")]
    NoSuchBuffer { id: usize, count: usize },
    #[error("buffer #{id} holds {dtype}, not {want}")]
    WrongDType { id: usize, dtype: DType, want: DType },
    #[error("buffer #{id} holds {len} elements, got {got}")]
    WrongLength { id: usize, len: usize, got: usize },
    #[error(
        "buffer #{id} cannot be viewed beside the others: only persistent buffers, each named once, can"
    )]
    SharedView { id: usize },
    /// A routing or grouped step refused its data (an expert index out of range,
    /// group sizes past the rows): checked before any access, never a read out of bounds.
    #[error("step {step}: {what}")]
    Step { step: usize, what: String },
}

/// The loop sees a Cpu failure as a device error (the step contract names no device).
impl From<CpuError> for StepError {
    fn from(e: CpuError) -> StepError {
        StepError::Device(Box::new(e))
    }
}

/// How the device runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    /// Threads per kernel launch and per GEMM (at least 1).
    pub threads: usize,
}

impl Default for CpuOptions {
    /// All available cores, shared out evenly among the ranks an MPI launcher
    /// started on this machine (docs/distributed.md), so that N ranks on one
    /// machine do not run N times as many threads as it has cores.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        CpuOptions { threads: (cores / crate::dist::local_ranks()).max(1) }
    }
}

/// Host storage of one element type. `Bf16` is kept as raw bits (the
/// kernels convert on load and store, docs/math.md §6.12).
#[derive(Debug, Clone, PartialEq)]
enum HostVec {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bf16(Vec<u16>),
    I32(Vec<i32>),
}

impl HostVec {
    fn zeros(dtype: DType, len: usize) -> HostVec {
        match dtype {
            DType::F32 => HostVec::F32(vec![0.0; len]),
            DType::F64 => HostVec::F64(vec![0.0; len]),
            DType::Bf16 => HostVec::Bf16(vec![0; len]),
            DType::I32 => HostVec::I32(vec![0; len]),
        }
    }

    /// Writes one element of every 4 KiB page, so the operating system maps
    /// all of the vector now. A zeroed vector is allocated as untouched pages
    /// that are mapped on their first write; without this, the first run of
    /// a Plan pays a page fault for each page of its arena, its gradients and
    /// its optimizer state (a weight gradient's GEMM ran markedly slower on
    /// its first run), and a profile that includes that run charges
    /// the faults to whichever step writes a page first.
    fn map_pages(&mut self) {
        const PAGE: usize = 4096;
        let bytes = match self {
            HostVec::F32(v) => std::mem::size_of_val(v.as_slice()),
            HostVec::F64(v) => std::mem::size_of_val(v.as_slice()),
            HostVec::Bf16(v) => std::mem::size_of_val(v.as_slice()),
            HostVec::I32(v) => std::mem::size_of_val(v.as_slice()),
        };
        let base = self.base().cast::<u8>();
        for at in (0..bytes).step_by(PAGE) {
            // SAFETY: `at < bytes`, inside the vector's allocation; the byte is
            // zero (the vector is fresh) and stays zero. A volatile write, as
            // the compiler may drop a plain store of zero into zeroed memory.
            unsafe { std::ptr::write_volatile(base.add(at), 0) };
        }
    }

    fn base(&mut self) -> *mut c_void {
        match self {
            HostVec::F32(v) => v.as_mut_ptr().cast(),
            HostVec::F64(v) => v.as_mut_ptr().cast(),
            HostVec::Bf16(v) => v.as_mut_ptr().cast(),
            HostVec::I32(v) => v.as_mut_ptr().cast(),
        }
    }
}

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::Bf16, DType::I32];

fn dtype_slot(dtype: DType) -> usize {
    DTYPES.iter().position(|&d| d == dtype).expect("DTYPES lists every dtype")
}

/// Where a buffer's elements live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// `owned[index]`, the whole vector.
    Owned(usize),
    /// `arenas[dtype_slot][offset..offset + len]`.
    Arena { slot: usize, offset: usize },
}

/// Work below which a launch stays on one thread: waking the pool costs a
/// few microseconds, about this many simple statements.
const MIN_WORK_PER_THREAD: u64 = 8192;

/// Multiply-adds below which a GEMM runs single-threaded.
const MIN_GEMM_PARALLEL: usize = 1 << 16;

/// A loaded Plan with its buffers and compiled kernels.
#[derive(Debug)]
pub struct CpuDevice {
    plan: Plan,
    entries: Vec<Entry>,
    /// Threads each kernel step is split over (by estimated work).
    parts: Vec<usize>,
    locs: Vec<Loc>,
    owned: Vec<HostVec>,
    arenas: Vec<HostVec>,
    pool: Pool,
    /// Wall time per step while profiling is on (see [`CpuDevice::set_profiling`]).
    profile: Option<StepTimes>,
    /// Print the profile to stderr when the device is dropped (`WIDEN_PROFILE`).
    print_profile: PrintProfile,
}

/// Whether and how much of the profile is printed when the device is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrintProfile {
    No,
    /// `WIDEN_PROFILE=1` (any value but `0` and `all`): the slowest labels.
    Slowest,
    /// `WIDEN_PROFILE=all`: every label.
    All,
    /// `WIDEN_PROFILE=kernels`: every kernel on its own row
    /// ([`ProfileRows::Kernel`]).
    Kernels,
    /// `WIDEN_PROFILE=steps`: every step on its own row, in launch order
    /// ([`ProfileRows::Step`]).
    Steps,
}

impl PrintProfile {
    fn from_env() -> PrintProfile {
        match std::env::var_os("WIDEN_PROFILE") {
            Some(v) if v == "all" => PrintProfile::All,
            Some(v) if v == "kernels" => PrintProfile::Kernels,
            Some(v) if v == "steps" => PrintProfile::Steps,
            Some(v) if !v.is_empty() && v != "0" => PrintProfile::Slowest,
            _ => PrintProfile::No,
        }
    }
}

/// Accumulated wall time of every step of the launch list.
#[derive(Debug, Clone)]
struct StepTimes {
    time: Vec<Duration>,
    calls: Vec<u64>,
    runs: u64,
}

/// What one row of a [`Profile`] adds up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileRows {
    /// Steps with the same label: a kernel's name without its `g<ordinal>_`
    /// prefix (the same op at every layer), `gemm MxNxK`, `zero`.
    Label,
    /// Each kernel by its full name, so that the launches of one kernel add
    /// up apart from the other kernels of the same op (which of a
    /// scheme's fused connection kernels is slow); GEMMs and zeroing as in
    /// [`ProfileRows::Label`].
    Kernel,
    /// Each step of the launch list apart, in launch order, labelled with its
    /// index and its [`ProfileRows::Kernel`] label: the same GEMM shape at
    /// different places of the Plan (whose operands may come from cache or
    /// from memory) and one layer's kernel against another's.
    Step,
}

/// Where the time of the profiled runs went, one row per step label
/// (see [`ProfileRows`]), slowest first ([`ProfileRows::Step`]: in launch order).
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Complete runs of the launch list ([`CpuDevice::run`]) while profiling.
    pub runs: u64,
    pub rows: Vec<ProfileRow>,
}

/// The steps sharing one label.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileRow {
    pub label: String,
    /// Step executions (all runs together).
    pub calls: u64,
    pub seconds: f64,
}

impl Profile {
    /// Total profiled time.
    pub fn seconds(&self) -> f64 {
        self.rows.iter().map(|r| r.seconds).sum()
    }
}

impl std::fmt::Display for Profile {
    /// The slowest 30 labels (all of them with `{:#}`) with their share,
    /// milliseconds per run and calls per run.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let total = self.seconds();
        let runs = self.runs.max(1) as f64;
        writeln!(f, "cpu profile: {:.2} ms per run over {} runs", total * 1e3 / runs, self.runs)?;
        writeln!(f, "{:>6} {:>10} {:>7}  step", "share", "ms/run", "n/run")?;
        let shown = if f.alternate() { self.rows.len() } else { 30 };
        for r in self.rows.iter().take(shown) {
            let share = if total > 0.0 { 100.0 * r.seconds / total } else { 0.0 };
            let per = r.calls as f64 / runs;
            writeln!(f, "{share:>5.1}% {:>10.3} {per:>7.1}  {}", r.seconds * 1e3 / runs, r.label)?;
        }
        Ok(())
    }
}

/// The profile label of a step (see [`ProfileRows`]).
fn step_label(plan: &Plan, step: &Step, rows: ProfileRows) -> String {
    match step {
        Step::Kernel { kernel, .. } => {
            let name = &plan.kernels[*kernel].name;
            if rows == ProfileRows::Kernel {
                return name.clone();
            }
            match name.split_once('_') {
                Some((ord, rest)) if ord.starts_with('g') && ord[1..].bytes().all(|c| c.is_ascii_digit()) => {
                    rest.to_string()
                }
                _ => name.clone(),
            }
        }
        Step::Gemm(g) => {
            let batch = if g.batch > 1 { format!("{}x ", g.batch) } else { String::new() };
            format!("gemm {batch}{}x{}x{}", g.m, g.n, g.k)
        }
        Step::Zero { .. } => "zero".into(),
        Step::MoeRoute(r) => format!("moe route {}x{} over {}", r.assignments / r.k.max(1), r.k, r.experts),
        Step::GroupedGemm(g) => format!("grouped gemm {}: {}x{}x{}", g.groups, g.m, g.n, g.k),
    }
}

impl CpuDevice {
    /// Loads `plan` with the compiler named by `CC` and all available cores.
    pub fn new(plan: Plan) -> Result<CpuDevice, CpuError> {
        CpuDevice::with_options(plan, &Compiler::from_env()?, CpuOptions::default())
    }

    /// Loads `plan`, compiling its kernels with `compiler`.
    pub fn with_options(plan: Plan, compiler: &Compiler, opts: CpuOptions) -> Result<CpuDevice, CpuError> {
        plan_check::check_buffer_ids(&plan)?;
        plan_check::check_steps(&plan)?;
        plan_check::check_chains(&plan)?;
        let Storage { locs, owned, arenas } = allocate(&plan)?;
        let threads = opts.threads.max(1);
        let parts = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Kernel { kernel, .. } => split(&plan.kernels[*kernel], threads),
                Step::Gemm(_) | Step::Zero { .. } | Step::MoeRoute(_) | Step::GroupedGemm(_) => 1,
            })
            .collect();
        let library = compiler.compile_kernels(&plan.kernels)?;
        let entries = plan.kernels.iter().map(|k| library.entry(&k.name)).collect::<Result<Vec<_>, _>>()?;
        let print_profile = PrintProfile::from_env();
        let mut device = CpuDevice {
            plan,
            entries,
            parts,
            locs,
            owned,
            arenas,
            pool: Pool::new(threads),
            profile: None,
            print_profile,
        };
        device.set_profiling(print_profile != PrintProfile::No);
        Ok(device)
    }

    /// Turns per-step timing on (clearing what was recorded) or off. With the
    /// environment variable `WIDEN_PROFILE=1` it is on from loading, and the
    /// profile's slowest steps are printed to stderr when the device is dropped
    /// (every label with `WIDEN_PROFILE=all`, every kernel on its own row with
    /// `WIDEN_PROFILE=kernels`, every step in launch order with
    /// `WIDEN_PROFILE=steps`).
    pub fn set_profiling(&mut self, on: bool) {
        let n = self.plan.steps.len();
        self.profile = on.then(|| StepTimes { time: vec![Duration::ZERO; n], calls: vec![0; n], runs: 0 });
    }

    /// The time recorded since profiling was turned on, by step label, slowest
    /// first; `None` when profiling is off.
    pub fn profile(&self) -> Option<Profile> {
        self.profile_by(ProfileRows::Label)
    }

    /// [`CpuDevice::profile`] with rows of `rows`.
    pub fn profile_by(&self, rows_of: ProfileRows) -> Option<Profile> {
        let times = self.profile.as_ref()?;
        let mut rows: Vec<ProfileRow> = Vec::new();
        let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (i, step) in self.plan.steps.iter().enumerate() {
            let label = match rows_of {
                ProfileRows::Step => format!("{i:>4} {}", step_label(&self.plan, step, ProfileRows::Kernel)),
                _ => step_label(&self.plan, step, rows_of),
            };
            let row = *at.entry(label.clone()).or_insert_with(|| {
                rows.push(ProfileRow { label, calls: 0, seconds: 0.0 });
                rows.len() - 1
            });
            rows[row].calls += times.calls[i];
            rows[row].seconds += times.time[i].as_secs_f64();
        }
        if rows_of != ProfileRows::Step {
            rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        }
        Some(Profile { runs: times.runs, rows })
    }

    /// The loaded Plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Threads used per launch.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// How many threads step `step` is split over (1 for GEMM and zero
    /// steps, whose parallelism is the GEMM library's).
    pub fn step_threads(&self, step: usize) -> Option<usize> {
        self.parts.get(step).copied()
    }

    /// The buffer holding `role`, if the Plan has one.
    pub fn find(&self, role: &BufferRole) -> Option<BufferId> {
        self.plan.find(role)
    }

    fn decl(&self, id: BufferId) -> Result<&BufferDecl, CpuError> {
        let count = self.plan.buffers.len();
        self.plan.buffers.get(id.0).ok_or(CpuError::NoSuchBuffer { id: id.0, count })
    }

    /// The storage and element range of a buffer.
    fn storage(&self, id: BufferId) -> Result<(&HostVec, std::ops::Range<usize>), CpuError> {
        let len = self.decl(id)?.len;
        Ok(match self.locs[id.0] {
            Loc::Owned(i) => (&self.owned[i], 0..len),
            Loc::Arena { slot, offset } => (&self.arenas[slot], offset..offset + len),
        })
    }

    fn storage_mut(&mut self, id: BufferId) -> Result<(&mut HostVec, std::ops::Range<usize>), CpuError> {
        let len = self.decl(id)?.len;
        Ok(match self.locs[id.0] {
            Loc::Owned(i) => (&mut self.owned[i], 0..len),
            Loc::Arena { slot, offset } => (&mut self.arenas[slot], offset..offset + len),
        })
    }

    /// The current contents of an f32 buffer (a scratch buffer shows whatever
    /// the arena holds at its offset now).
    pub fn read_f32(&self, id: BufferId) -> Result<&[f32], CpuError> {
        let dtype = self.decl(id)?.dtype;
        match self.storage(id)? {
            (HostVec::F32(v), r) => Ok(&v[r]),
            _ => Err(CpuError::WrongDType { id: id.0, dtype, want: DType::F32 }),
        }
    }

    /// Mutable views of the persistent f32 buffers `write` beside shared
    /// views of `read`, all at once: each persistent buffer is a vector of its
    /// own, so they cannot overlap. The optimizer reads gradients where the
    /// Plan left them and writes parameters in place through these.
    #[allow(clippy::type_complexity)]
    pub fn persistent_views(
        &mut self,
        write: &[BufferId],
        read: &[BufferId],
    ) -> Result<(Vec<&mut [f32]>, Vec<&[f32]>), CpuError> {
        let mut lens = Vec::with_capacity(write.len() + read.len());
        let mut owned_index = Vec::with_capacity(write.len() + read.len());
        for &id in write.iter().chain(read) {
            let decl = self.decl(id)?;
            if decl.dtype != DType::F32 {
                return Err(CpuError::WrongDType { id: id.0, dtype: decl.dtype, want: DType::F32 });
            }
            match self.locs[id.0] {
                Loc::Owned(i) if !owned_index.contains(&i) => owned_index.push(i),
                _ => return Err(CpuError::SharedView { id: id.0 }),
            }
            lens.push(decl.len);
        }
        let mut vectors: Vec<Option<&mut HostVec>> = self.owned.iter_mut().map(Some).collect();
        let mut views = owned_index.iter().zip(&lens).map(|(&i, &len)| match vectors[i].take() {
            Some(HostVec::F32(v)) => &mut v[..len],
            _ => unreachable!("each owned f32 vector is taken once, as checked above"),
        });
        let writes = views.by_ref().take(write.len()).collect();
        let reads = views.map(|v| &*v).collect();
        Ok((writes, reads))
    }

    /// Overwrites an f32 buffer; `data` must have the buffer's length.
    pub fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<(), CpuError> {
        let dtype = self.decl(id)?.dtype;
        match self.storage_mut(id)? {
            (HostVec::F32(v), r) => copy_into(id, &mut v[r], data),
            _ => Err(CpuError::WrongDType { id: id.0, dtype, want: DType::F32 }),
        }
    }

    /// The current contents of an f64 buffer.
    pub fn read_f64(&self, id: BufferId) -> Result<&[f64], CpuError> {
        let dtype = self.decl(id)?.dtype;
        match self.storage(id)? {
            (HostVec::F64(v), r) => Ok(&v[r]),
            _ => Err(CpuError::WrongDType { id: id.0, dtype, want: DType::F64 }),
        }
    }

    /// Overwrites an f64 buffer; `data` must have the buffer's length.
    pub fn write_f64(&mut self, id: BufferId, data: &[f64]) -> Result<(), CpuError> {
        let dtype = self.decl(id)?.dtype;
        match self.storage_mut(id)? {
            (HostVec::F64(v), r) => copy_into(id, &mut v[r], data),
            _ => Err(CpuError::WrongDType { id: id.0, dtype, want: DType::F64 }),
        }
    }

    /// Overwrites an i32 buffer (token ids); `data` must have the buffer's length.
    pub fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<(), CpuError> {
        let dtype = self.decl(id)?.dtype;
        match self.storage_mut(id)? {
            (HostVec::I32(v), r) => copy_into(id, &mut v[r], data),
            _ => Err(CpuError::WrongDType { id: id.0, dtype, want: DType::I32 }),
        }
    }

    /// The current contents of an i32 buffer (token ids, MoE routing).
    pub fn read_i32(&self, id: BufferId) -> Result<&[i32], CpuError> {
        let dtype = self.decl(id)?.dtype;
        match self.storage(id)? {
            (HostVec::I32(v), r) => Ok(&v[r]),
            _ => Err(CpuError::WrongDType { id: id.0, dtype, want: DType::I32 }),
        }
    }

    /// The base pointer of every buffer. Valid until storage is dropped: no
    /// vector is resized after loading.
    fn pointers(&mut self) -> Vec<*mut c_void> {
        let owned: Vec<*mut c_void> = self.owned.iter_mut().map(HostVec::base).collect();
        let arenas: Vec<*mut c_void> = self.arenas.iter_mut().map(HostVec::base).collect();
        self.plan
            .buffers
            .iter()
            .zip(&self.locs)
            .map(|(d, loc)| match *loc {
                Loc::Owned(i) => owned[i],
                // In bounds: `allocate` sized each arena to cover every offset + len.
                Loc::Arena { slot, offset } => arenas[slot].wrapping_byte_add(offset * d.dtype.size_bytes()),
            })
            .collect()
    }

    /// Executes every step of the Plan once, in order.
    pub fn run(&mut self) -> Result<(), CpuError> {
        self.run_range(0..self.plan.steps.len())
    }

    /// Executes the steps `range` of the launch list, in order (profiling one
    /// step at a time; running a prefix to inspect intermediate buffers).
    pub fn run_range(&mut self, range: std::ops::Range<usize>) -> Result<(), CpuError> {
        let count = self.plan.steps.len();
        if range.start > range.end || range.end > count {
            return Err(CpuError::StepRange { start: range.start, end: range.end, count });
        }
        let ptrs = self.pointers();
        let mut args: Vec<*mut c_void> = Vec::new();
        if let Some(p) = &mut self.profile {
            p.runs += u64::from(range.start == 0 && range.end == count);
        }
        let mut index = range.start;
        while index < range.end {
            let chain = self.plan.chains.iter().find(|c| c.start == index && c.end <= range.end).copied();
            if let Some(chain) = chain.filter(|c| c.entries >= self.pool.threads()) {
                let started = self.profile.is_some().then(Instant::now);
                let lead = self.run_chain(chain, &ptrs, started.is_some());
                if let (Some(p), Some(t)) = (&mut self.profile, started) {
                    // The chain's wall time, shared out over its steps as the
                    // first thread's entries spent it.
                    let (wall, led) =
                        (t.elapsed(), lead.iter().sum::<Duration>().max(Duration::from_nanos(1)));
                    for (i, spent) in chain.steps().zip(lead) {
                        p.time[i] += wall.mul_f64(spent.as_secs_f64() / led.as_secs_f64());
                        p.calls[i] += 1;
                    }
                }
                index = chain.end;
                continue;
            }
            let started = self.profile.is_some().then(Instant::now);
            match &self.plan.steps[index] {
                Step::Kernel { kernel, args: ids } => {
                    args.clear();
                    args.extend(ids.iter().map(|id| ptrs[id.0]));
                    let n = self.plan.kernels[*kernel].grid.items() as i64;
                    // SAFETY: `check_steps` verified invariants 1 and 2 of the
                    // module docs for this step; invariant 3 is the Plan's.
                    unsafe {
                        self.pool.run(self.entries[*kernel].as_fn(), args.as_ptr(), n, self.parts[index])
                    };
                }
                Step::Gemm(g) => {
                    let dtype = |id: BufferId| self.plan.buffers[id.0].dtype;
                    // SAFETY: `check_steps` verified the extents and dtypes of
                    // all three operands and that `c` overlaps neither input;
                    // bf16 inputs are widened into f32 copies of the same extent.
                    unsafe {
                        let a = widened_operand(ptrs[g.a.0], dtype(g.a), g.batch, g.stride_a, g.m * g.k);
                        let b = widened_operand(ptrs[g.b.0], dtype(g.b), g.batch, g.stride_b, g.k * g.n);
                        let pa = a.as_ref().map_or(ptrs[g.a.0].cast_const(), |v| v.as_ptr().cast());
                        let pb = b.as_ref().map_or(ptrs[g.b.0].cast_const(), |v| v.as_ptr().cast());
                        run_gemm(g, pa.cast(), pb.cast(), ptrs[g.c.0].cast(), &self.pool)
                    };
                }
                Step::Zero { buffer } => {
                    let d = &self.plan.buffers[buffer.0];
                    // SAFETY: the pointer addresses `d.len` elements of `d.dtype`
                    // (invariant 1), and all-zero bits are zero in every dtype.
                    unsafe {
                        std::ptr::write_bytes(ptrs[buffer.0].cast::<u8>(), 0, d.len * d.dtype.size_bytes())
                    };
                }
                Step::MoeRoute(r) => {
                    // SAFETY: `check_steps` verified four i32 buffers of the step's lengths
                    // whose outputs overlap nothing else the step binds.
                    unsafe { run_route(r, &ptrs) }.map_err(|what| CpuError::Step { step: index, what })?;
                }
                Step::GroupedGemm(g) => {
                    let dtypes = [g.a, g.b].map(|id| self.plan.buffers[id.0].dtype);
                    // SAFETY: `check_steps` verified the extents and dtypes of the operands
                    // and that `c` overlaps none of them; `run_grouped` checks the counts.
                    unsafe { run_grouped(g, &ptrs, dtypes, &self.pool) }
                        .map_err(|what| CpuError::Step { step: index, what })?;
                }
            }
            if let (Some(p), Some(t)) = (&mut self.profile, started) {
                p.time[index] += t.elapsed();
                p.calls[index] += 1;
            }
            index += 1;
        }
        Ok(())
    }

    /// Runs `chain` entry by entry ([`Chain`]): each thread takes a
    /// contiguous run of entries and runs every step of the chain on one
    /// entry before the next, so one (batch, head) of attention stays in its
    /// core's cache from the copy in to the last product. Each step computes
    /// an entry exactly as the step run whole does (a kernel's items, one
    /// GEMM call per batch entry), so the results are the same bits. Returns
    /// the time the first thread spent in each step when `timed`.
    fn run_chain(&self, chain: Chain, ptrs: &[*mut c_void], timed: bool) -> Vec<Duration> {
        let steps = &self.plan.steps[chain.steps()];
        // Addresses as integers so the threads can share them.
        let addr: Vec<usize> = ptrs.iter().map(|p| *p as usize).collect();
        let args: Vec<Vec<usize>> = steps
            .iter()
            .map(|s| match s {
                Step::Kernel { args, .. } => args.iter().map(|id| addr[id.0]).collect(),
                Step::Gemm(_) | Step::Zero { .. } | Step::MoeRoute(_) | Step::GroupedGemm(_) => Vec::new(),
            })
            .collect();
        // Each GEMM's tiles, chosen on the whole product as `run_gemm` does.
        let isas: Vec<Option<sgemm::Isa>> = steps
            .iter()
            .map(|s| match s {
                Step::Gemm(g) => {
                    let ((rows, cols), _) = operand_strides(g);
                    tiled_isa(g, sgemm::Operand { ptr: std::ptr::null(), rows, cols })
                }
                Step::Kernel { .. } | Step::Zero { .. } | Step::MoeRoute(_) | Step::GroupedGemm(_) => None,
            })
            .collect();
        let lead: Vec<AtomicU64> = steps.iter().map(|_| AtomicU64::new(0)).collect();
        let parts = self.pool.threads().min(chain.entries);
        let work = |p: usize| {
            let (lo, hi) = pool::part_range(chain.entries as i64, parts, p);
            for entry in lo as usize..hi as usize {
                for (i, step) in steps.iter().enumerate() {
                    let started = (timed && p == 0).then(Instant::now);
                    match step {
                        Step::Kernel { kernel, .. } => {
                            let per = (self.plan.kernels[*kernel].grid.items() / chain.entries) as i64;
                            let (start, end) = (entry as i64 * per, (entry as i64 + 1) * per);
                            // SAFETY: as for the whole step (`check_steps`), over
                            // this entry's items only (`check_chains`); entries of
                            // other threads write other items.
                            unsafe { (self.entries[*kernel].as_fn())(args[i].as_ptr().cast(), start, end) };
                        }
                        Step::Gemm(g) => {
                            let [a, b, c] = [g.a, g.b, g.c].map(|id| addr[id.0]);
                            // SAFETY: `check_steps` verified the operands' extents
                            // and `check_chains` that they are f32 over
                            // `chain.entries` batch entries; `c` overlaps neither.
                            unsafe {
                                batch_entry_product(g, isas[i], (a, b, c), entry, 0..g.m, 0..g.n, false)
                            };
                        }
                        Step::Zero { .. } | Step::MoeRoute(_) | Step::GroupedGemm(_) => {
                            unreachable!("check_chains admits no zeroing, routing or grouped step in a chain")
                        }
                    }
                    if let Some(t) = started {
                        lead[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                }
            }
        };
        self.pool.run_parts(parts, &work);
        lead.into_iter().map(|t| Duration::from_nanos(t.into_inner())).collect()
    }
}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        // Rows and whether all of them are printed (else the slowest).
        let (rows_of, every_row) = match self.print_profile {
            PrintProfile::No => return,
            PrintProfile::Slowest => (ProfileRows::Label, false),
            PrintProfile::All => (ProfileRows::Label, true),
            PrintProfile::Kernels => (ProfileRows::Kernel, true),
            PrintProfile::Steps => (ProfileRows::Step, true),
        };
        if let Some(p) = self.profile_by(rows_of) {
            if every_row {
                eprint!("{p:#}");
            } else {
                eprint!("{p}");
            }
        }
    }
}

fn copy_into<T: Copy>(id: BufferId, dst: &mut [T], src: &[T]) -> Result<(), CpuError> {
    if dst.len() != src.len() {
        return Err(CpuError::WrongLength { id: id.0, len: dst.len(), got: src.len() });
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Storage for every buffer: owned vectors for persistent roles (constants
/// filled), arenas sized to cover every scratch placement.
fn allocate(plan: &Plan) -> Result<Storage, CpuError> {
    let mut arena_len = [0usize; DTYPES.len()];
    arena_len[dtype_slot(DType::F32)] = plan.arena_len;
    let mut locs = Vec::with_capacity(plan.buffers.len());
    let mut owned = Vec::new();
    for d in &plan.buffers {
        match &d.role {
            BufferRole::Scratch { offset } => {
                let slot = dtype_slot(d.dtype);
                arena_len[slot] = arena_len[slot].max(offset + d.len);
                locs.push(Loc::Arena { slot, offset: *offset });
            }
            role => {
                let mut v = match role {
                    BufferRole::Constant { value } => constant(d, *value)?,
                    _ => HostVec::zeros(d.dtype, d.len),
                };
                v.map_pages();
                locs.push(Loc::Owned(owned.len()));
                owned.push(v);
            }
        }
    }
    // Each arena starts at a cache line: the planner places buffers at
    // multiples of 16 elements, so a line-aligned base makes every buffer's
    // vectors line-aligned too (what non-temporal stores need); the allocator
    // only promises 16 bytes.
    let mut arenas: Vec<HostVec> =
        DTYPES.iter().zip(arena_len).map(|(&dt, len)| HostVec::zeros(dt, len + CACHE_LINE)).collect();
    arenas.iter_mut().for_each(HostVec::map_pages);
    let shift: Vec<usize> = arenas
        .iter_mut()
        .zip(DTYPES)
        .map(|(v, dt)| v.base().cast::<u8>().align_offset(CACHE_LINE) / dt.size_bytes())
        .collect();
    for loc in &mut locs {
        if let Loc::Arena { slot, offset } = loc {
            *offset += shift[*slot];
        }
    }
    Ok(Storage { locs, owned, arenas })
}

/// Bytes per cache line.
const CACHE_LINE: usize = 64;

/// Where every buffer lives, and the storage itself.
struct Storage {
    locs: Vec<Loc>,
    owned: Vec<HostVec>,
    arenas: Vec<HostVec>,
}

/// A constant buffer filled with `value` in its storage type.
fn constant(d: &BufferDecl, value: f64) -> Result<HostVec, CpuError> {
    Ok(match d.dtype {
        DType::F32 => HostVec::F32(vec![value as f32; d.len]),
        DType::F64 => HostVec::F64(vec![value; d.len]),
        DType::I32 if value.fract() == 0.0 && value.abs() <= f64::from(i32::MAX) => {
            HostVec::I32(vec![value as i32; d.len])
        }
        dtype => {
            return Err(
                PlanCheckError::ConstantDType { id: d.id.0, role: format!("{:?}", d.role), dtype }.into()
            )
        }
    })
}

/// Threads to split a kernel over: enough that each gets about
/// [`MIN_WORK_PER_THREAD`] estimated work, at most one per item.
fn split(k: &Kernel, threads: usize) -> usize {
    let n = k.grid.items();
    let lanes = match k.grid {
        Grid::ThreadPerItem { .. } => 1,
        Grid::BlockPerItem { threads, .. } => u64::from(threads),
    };
    let work = (n as u64).saturating_mul(lanes.saturating_mul(body_cost(&k.body)));
    let by_work = usize::try_from(work / MIN_WORK_PER_THREAD).unwrap_or(usize::MAX).max(1);
    by_work.min(threads).min(n.max(1))
}

/// A rough count of statements one item executes: loops multiply their body
/// by the trip count when the bounds are literals (a guess of 16 otherwise).
fn body_cost(stmts: &[Stmt]) -> u64 {
    stmts
        .iter()
        .map(|s| match s {
            Stmt::For { start, end, step, body, .. } => {
                let trips = match (literal(start), literal(end)) {
                    (Some(a), Some(b)) => ((b - a).max(0) as u64).div_ceil((*step).max(1) as u64),
                    _ => 16,
                };
                trips.saturating_mul(1 + body_cost(body))
            }
            Stmt::If { then, else_, .. } => 1 + body_cost(then).max(body_cost(else_)),
            _ => 1,
        })
        .fold(0u64, u64::saturating_add)
}

fn literal(e: &Expr) -> Option<i64> {
    match e {
        Expr::I64(v) => Some(*v),
        Expr::I32(v) => Some(i64::from(*v)),
        _ => None,
    }
}

/// An f32 copy of a bf16 GEMM input (docs/math.md §6.12: bf16 operands, f32
/// accumulation), covering `batch` entries of `size` elements `stride` apart;
/// `None` for an f32 input, which the GEMM reads in place. Widening is exact,
/// so the product equals an f32 GEMM of the rounded values.
///
/// # Safety
/// `ptr` addresses the buffer's elements of `dtype`, at least
/// `(batch - 1) * stride + size` of them (`check_gemm`).
unsafe fn widened_operand(
    ptr: *mut c_void,
    dtype: DType,
    batch: usize,
    stride: usize,
    size: usize,
) -> Option<Vec<f32>> {
    if dtype != DType::Bf16 {
        return None;
    }
    let len = if batch == 0 { 0 } else { (batch - 1) * stride + size };
    // SAFETY: the caller guarantees `len` bf16 elements at `ptr`.
    let bits = unsafe { std::slice::from_raw_parts(ptr.cast::<u16>().cast_const(), len) };
    Some(bits.iter().map(|&h| f32::from_bits(u32::from(h) << 16)).collect())
}

/// Sparse MoE routing (docs/math.md §1.6) in place: the reference's own counting pass
/// over the step's buffers, on the calling thread (a few thousand integers, and every
/// grouped product after it waits on the counts).
///
/// # Safety
/// The step's four buffers are i32 of its lengths and its outputs overlap nothing else
/// it binds (`check_steps`).
unsafe fn run_route(r: &MoeRoute, ptrs: &[*mut c_void]) -> Result<(), String> {
    // SAFETY: the caller's contract: distinct i32 buffers of these lengths.
    let (idx, rows, tokens, counts) = unsafe {
        let out = |id: BufferId, len| std::slice::from_raw_parts_mut(ptrs[id.0].cast::<i32>(), len);
        let idx = std::slice::from_raw_parts(ptrs[r.idx.0].cast::<i32>().cast_const(), r.assignments);
        (idx, out(r.rows, r.assignments), out(r.tokens, r.assignments), out(r.counts, r.experts))
    };
    ir::exec::moe::route_into(idx, r.k, r.experts, r.capacity, rows, tokens, counts)
}

/// A grouped GEMM (docs/math.md §1.6): the group sizes read from its counts, then
/// one f32 product per non-empty group ([`GroupedGemm::products`]) on the device's
/// GEMM path, after zeroing what no group writes (rows of dropped assignments, the
/// weight gradient of an expert no token chose). bf16 inputs are widened into f32
/// copies first, as for [`Step::Gemm`]. With at least as many groups as threads,
/// each thread takes a run of whole groups of about equal work; otherwise each
/// product is split over the threads as [`run_gemm`] splits one. Either way an
/// element's bits are those of the whole product, whatever the thread count.
///
/// # Safety
/// The operands hold the step's extents in `dtypes` (a, b) and f32 (c), the counts
/// `groups` i32, and `c` overlaps none of them (`check_steps`).
unsafe fn run_grouped(
    g: &GroupedGemm,
    ptrs: &[*mut c_void],
    dtypes: [DType; 2],
    pool: &Pool,
) -> Result<(), String> {
    // SAFETY: `groups` i32 counts (the caller's contract).
    let counts = unsafe { std::slice::from_raw_parts(ptrs[g.counts.0].cast::<i32>().cast_const(), g.groups) };
    let (products, zeroed) = g.products(counts)?;
    let [len_a, len_b, _] = g.extents().ok_or("the product's extents overflow")?;
    // SAFETY: the inputs hold their extents (the caller's contract).
    let (wa, wb) = unsafe {
        (
            widened_operand(ptrs[g.a.0], dtypes[0], 1, 0, len_a),
            widened_operand(ptrs[g.b.0], dtypes[1], 1, 0, len_b),
        )
    };
    let pa = wa.as_ref().map_or(ptrs[g.a.0].cast_const(), |v| v.as_ptr().cast()).cast::<f32>();
    let pb = wb.as_ref().map_or(ptrs[g.b.0].cast_const(), |v| v.as_ptr().cast()).cast::<f32>();
    let pc = ptrs[g.c.0].cast::<f32>();
    for r in zeroed {
        // SAFETY: the range lies inside c's extent (`GroupedGemm::products`).
        unsafe { std::ptr::write_bytes(pc.add(r.start), 0, r.len()) };
    }
    // A product's operands are the step's a and b, in either order (the transposed
    // weight gradient multiplies b's rows by a's).
    let input = |id: BufferId| if id == g.a { pa } else { pb };
    // Whole groups per thread when there are at least as many groups as threads:
    // each group's product then stays in its core's cache, where bands of every
    // small product would wait on the pool once per group. A product `run_gemm`
    // would split along its contraction keeps that path, so the bits never depend
    // on the thread count (bands and whole products give the same bits).
    let splits_k = |p: &Gemm| p.m * p.n <= SPLIT_K_MAX_OUTPUT && p.k >= SPLIT_K_MIN;
    let threads = pool.threads();
    if threads < 2 || products.len() < threads || products.iter().any(splits_k) {
        for p in &products {
            // SAFETY: each product lies inside the step's extents (`GroupedGemm::products`).
            unsafe { run_gemm(p, input(p.a), input(p.b), pc, pool) };
        }
        return Ok(());
    }
    // Addresses as integers so the parts can share them across threads.
    let (a, b, c) = (pa as usize, pb as usize, pc as usize);
    let addr = |id: BufferId| if id == g.a { a } else { b };
    // Contiguous runs of groups of about equal work: a group goes to the part its
    // work's midpoint falls in.
    let total = products.iter().map(|p| p.m * p.n * p.k).sum::<usize>().max(1);
    let mut before = 0usize;
    let part_of: Vec<usize> = products
        .iter()
        .map(|p| {
            let w = p.m * p.n * p.k;
            let mid = before + w / 2;
            before += w;
            (mid.saturating_mul(threads) / total).min(threads - 1)
        })
        .collect();
    let bounds: Vec<usize> =
        (0..=threads).map(|t| part_of.iter().position(|&q| q >= t).unwrap_or(products.len())).collect();
    let part = |t: usize| {
        for p in &products[bounds[t]..bounds[t + 1]] {
            // The tiles `run_gemm` picks for the whole product.
            let ((rows, cols), _) = operand_strides(p);
            let isa = tiled_isa(p, sgemm::Operand { ptr: std::ptr::null(), rows, cols });
            // SAFETY: as above; groups write disjoint blocks of c.
            unsafe { batch_entry_product(p, isa, (addr(p.a), addr(p.b), c), 0, 0..p.m, 0..p.n, false) };
        }
    };
    let parts = threads;
    pool.run_parts(parts, &part);
    Ok(())
}

/// `c[b] (=|+=) op(a[b]) @ op(b[b])` for every batch entry (row-major operands),
/// split over the pool's threads: whole batch entries when there are enough of
/// them, else bands of rows (or of columns, when they are more numerous) of
/// every entry, or, for a small output over a long contraction (a weight
/// gradient summed over every token and slot), fixed chunks of the
/// contraction. Each part runs a single-threaded product on its own band
/// ([`sgemm`] where the host has AVX-512, or AVX2 for a row-major `a`
/// ([`sgemm::Isa::takes`]), [`paired_gemm`] for 17 to 24 output columns with
/// AVX-512, else the `gemm` crate), which
/// scales where a library's own threading does not on small matrices.
///
/// # Safety
/// `a`, `b` and `c` point to f32 data long enough for every batch entry
/// (`check_gemm` verified the buffers), and `c` overlaps neither input.
unsafe fn run_gemm(g: &Gemm, a: *const f32, b: *const f32, c: *mut f32, pool: &Pool) {
    let ((a_rs, a_cs), (b_rs, b_cs)) = operand_strides(g);
    if g.batch == 1 && g.m * g.n <= SPLIT_K_MAX_OUTPUT && g.k >= SPLIT_K_MIN {
        // SAFETY: forwarded contract.
        unsafe { run_gemm_split_k(g, a, b, c, (a_rs, a_cs), (b_rs, b_cs), pool) };
        return;
    }
    let stream = streams_output(g);
    let a_layout = sgemm::Operand { ptr: a, rows: a_rs, cols: a_cs };
    let isa = tiled_isa(g, a_layout);
    // The gemm crate's products (no tile of ours) split the longer side.
    let tile = isa.map_or((1, 1), |isa| isa.tile(g.n, a_layout));
    // Addresses as integers so the parts can share them across threads.
    let (a, b, c) = (a as usize, b as usize, c as usize);
    let work = g.batch.saturating_mul(g.m).saturating_mul(g.n).saturating_mul(g.k);
    let threads = if work >= MIN_GEMM_PARALLEL { pool.threads() } else { 1 };
    let by_batch = g.batch >= threads;
    let by_rows = splits_rows(g.m, g.n, threads, tile);
    let count = if by_batch {
        g.batch
    } else if by_rows {
        g.m
    } else {
        g.n
    };
    let parts = threads.min(count.max(1));
    let part = |p: usize| {
        let (lo, hi) = pool::part_range(count as i64, parts, p);
        let (lo, hi) = (lo as usize, hi as usize);
        let (batches, rows, cols) = if by_batch {
            (lo..hi, 0..g.m, 0..g.n)
        } else if by_rows {
            (0..g.batch, lo..hi, 0..g.n)
        } else {
            (0..g.batch, 0..g.m, lo..hi)
        };
        if rows.is_empty() || cols.is_empty() {
            return;
        }
        for i in batches {
            // SAFETY: the band lies inside batch entry i of each operand (see the
            // function's contract); bands of different parts write disjoint rows
            // or columns of c.
            unsafe { batch_entry_product(g, isa, (a, b, c), i, rows.clone(), cols.clone(), stream) };
        }
    };
    pool.run_parts(parts, &part);
}

/// The row and column strides of op(a) `[m, k]` and op(b) `[k, n]` in a
/// batch entry of `g` (row-major operands, transposed as `g` says).
fn operand_strides(g: &Gemm) -> ((usize, usize), (usize, usize)) {
    let a = if g.trans_a { (1, g.m) } else { (g.k, 1) };
    let b = if g.trans_b { (1, g.k) } else { (g.n, 1) };
    (a, b)
}

/// The band `rows x cols` of batch entry `entry` of `g`'s product, on one
/// thread with `isa`'s tiles (the `gemm` crate if `None`), from the f32
/// operands at addresses `(a, b, c)`; streamed stores when `stream`.
///
/// # Safety
/// As for [`run_gemm`]; the band lies inside the product.
unsafe fn batch_entry_product(
    g: &Gemm,
    isa: Option<sgemm::Isa>,
    (a, b, c): (usize, usize, usize),
    entry: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    stream: bool,
) {
    let ((a_rs, a_cs), (b_rs, b_cs)) = operand_strides(g);
    let f32s = std::mem::size_of::<f32>();
    let [oa, ob, oc] = g.offsets;
    let pa = (a + (oa + entry * g.stride_a + rows.start * a_rs) * f32s) as *const f32;
    let pb = (b + (ob + entry * g.stride_b + cols.start * b_cs) * f32s) as *const f32;
    let pc = (c + (oc + entry * g.stride_c + rows.start * g.n + cols.start) * f32s) as *mut f32;
    let out = sgemm::Output { ptr: pc, ldc: g.n, stream };
    // SAFETY: forwarded contract.
    unsafe {
        product(isa, rows.len(), cols.len(), g.k, (pa, a_rs, a_cs), (pb, b_rs, b_cs), out, g.accumulate)
    };
}

/// Whether [`run_gemm`] gives each thread a band of rows of `c` (else a band
/// of columns): the longer side, unless the other split's largest band
/// computes at least [`SPLIT_PADDING_GAIN`] fewer padded elements. The
/// micro-kernel computes whole tiles of `tile_rows x tile_cols` (14 x 32
/// with AVX-512): a 256 x 256 weight gradient split by rows gives each of
/// two threads 128 rows, 10 row tiles (140 rows computed), where 128
/// columns are 4 whole column tiles over 19 row tiles (266 rows): 5 % less
/// arithmetic.
fn splits_rows(m: usize, n: usize, threads: usize, (tile_rows, tile_cols): (usize, usize)) -> bool {
    let parts = threads.max(1);
    let padded = |len: usize, tile: usize| len.div_ceil(parts).div_ceil(tile) * tile;
    let by_rows = (padded(m, tile_rows) * n.div_ceil(tile_cols) * tile_cols) as f64;
    let by_cols = (m.div_ceil(tile_rows) * tile_rows * padded(n, tile_cols)) as f64;
    if m >= n {
        by_cols > by_rows * (1.0 - SPLIT_PADDING_GAIN)
    } else {
        by_rows <= by_cols * (1.0 - SPLIT_PADDING_GAIN)
    }
}

/// Padding a split must save before [`splits_rows`] leaves the longer side:
/// below it the bands' memory access, tuned for the usual split, weighs more.
const SPLIT_PADDING_GAIN: f64 = 0.03;

/// Outputs of at least this many bytes are written with non-temporal stores
/// (see [`sgemm::Output::stream`]): the size of this class of machine's
/// last-level cache (32 MiB on the 2-core hosts the benchmarks run on), past
/// which the next step reads the output back from memory anyway. Below it,
/// streaming would push into memory what the next step finds in cache.
const STREAM_MIN_BYTES: usize = 32 << 20;

/// Whether [`run_gemm`] writes `g`'s output with non-temporal stores: written
/// once (no accumulation, one contraction block) and at least [`STREAM_MIN_BYTES`].
fn streams_output(g: &Gemm) -> bool {
    !g.accumulate
        && sgemm::single_pass(g.k)
        && g.batch * g.m * g.n * std::mem::size_of::<f32>() >= STREAM_MIN_BYTES
}

/// Outputs of at most this many elements over a contraction of at least
/// [`SPLIT_K_MIN`] split the contraction instead of the rows: a row band of
/// a `64 x 24` weight gradient would read every row of the 32768-row operand
/// in part, where a contraction chunk streams a contiguous half of it.
const SPLIT_K_MAX_OUTPUT: usize = 64 * 64;
/// Shortest contraction split into chunks (see [`SPLIT_K_MAX_OUTPUT`]).
const SPLIT_K_MIN: usize = 8192;
/// Contraction chunks: a fixed count, not the thread count, so the result
/// (the chunks' partial products added in order) does not depend on threads.
const SPLIT_K_CHUNKS: usize = 2;

/// [`run_gemm`] for one product with a small output and a long contraction:
/// [`SPLIT_K_CHUNKS`] partial products over contiguous chunks of the
/// contraction, spread over the threads, then `c (=|+=) p_0 + p_1 + …` in order.
///
/// # Safety
/// As for [`run_gemm`], with `g.batch == 1`.
unsafe fn run_gemm_split_k(
    g: &Gemm,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    (a_rs, a_cs): (usize, usize),
    (b_rs, b_cs): (usize, usize),
    pool: &Pool,
) {
    let (m, n) = (g.m, g.n);
    let isa = tiled_isa(g, sgemm::Operand { ptr: a, rows: a_rs, cols: a_cs });
    let mut partials = vec![0.0f32; SPLIT_K_CHUNKS * m * n];
    let [oa, ob, oc] = g.offsets;
    let f32s = std::mem::size_of::<f32>();
    // Addresses as integers so the parts can share them across threads.
    let (a, b, out) = (a as usize + oa * f32s, b as usize + ob * f32s, partials.as_mut_ptr() as usize);
    let parts = pool.threads().min(SPLIT_K_CHUNKS);
    let part = |t: usize| {
        for chunk in (t..SPLIT_K_CHUNKS).step_by(parts) {
            let (lo, hi) = pool::part_range(g.k as i64, SPLIT_K_CHUNKS, chunk);
            let (lo, hi) = (lo as usize, hi as usize);
            let pa = (a + lo * a_cs * f32s) as *const f32;
            let pb = (b + lo * b_rs * f32s) as *const f32;
            let pc = (out + chunk * m * n * f32s) as *mut f32;
            // SAFETY: contraction steps lo..hi of both operands (the caller's
            // contract); chunk `chunk` of the partials is this part's alone.
            let c = sgemm::Output { ptr: pc, ldc: n, stream: false };
            unsafe { product(isa, m, n, hi - lo, (pa, a_rs, a_cs), (pb, b_rs, b_cs), c, false) };
        }
    };
    pool.run_parts(parts, &part);
    // SAFETY: c holds m x n elements from offset oc (the caller's contract).
    let c = unsafe { std::slice::from_raw_parts_mut(c.add(oc), m * n) };
    for (i, v) in c.iter_mut().enumerate() {
        let mut sum = if g.accumulate { *v } else { 0.0 };
        for chunk in partials.chunks_exact(m * n) {
            sum += chunk[i];
        }
        *v = sum;
    }
}

/// The instruction set whose tiles run `g`'s parts ([`sgemm::Isa::takes`],
/// decided on the whole product's rows and columns so that every part, a
/// band of them, runs the same kernel), or `None` for the `gemm` crate.
fn tiled_isa(g: &Gemm, a: sgemm::Operand) -> Option<sgemm::Isa> {
    sgemm::Isa::host().filter(|isa| isa.takes(g.m, g.n, a, g.batch))
}

/// One single-threaded product `c (=|+=) op(a) @ op(b)` on `isa`'s tiles (the
/// `gemm` crate if `None`), `m x n` over `k` steps, with element `(i, p)` of
/// op(a) at `a + i·a_rs + p·a_cs`, `(p, j)` of op(b) at `b + p·b_rs + j·b_cs`
/// and row `i` of c at `c + i·ldc`.
///
/// # Safety
/// The operands address those elements; `c` overlaps neither.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    isa: Option<sgemm::Isa>,
    m: usize,
    n: usize,
    k: usize,
    (pa, a_rs, a_cs): (*const f32, usize, usize),
    (pb, b_rs, b_cs): (*const f32, usize, usize),
    c: sgemm::Output,
    accumulate: bool,
) {
    let (pc, ldc) = (c.ptr, c.ldc);
    // SAFETY: forwarded contract.
    unsafe {
        if k == 0 {
            if !accumulate {
                for r in 0..m {
                    std::ptr::write_bytes(pc.add(r * ldc), 0, n);
                }
            }
            return;
        }
        let a = sgemm::Operand { ptr: pa, rows: a_rs, cols: a_cs };
        let b = sgemm::Operand { ptr: pb, rows: b_rs, cols: b_cs };
        if let Some(isa) = isa {
            if paired_gemm::suits(n) && paired_gemm::available() {
                paired_gemm::paired_gemm(m, n, k, a, b, c, accumulate);
            } else {
                sgemm::sgemm_on(isa, m, n, k, a, b, c, accumulate);
            }
            return;
        }
        gemm::gemm(
            m,
            n,
            k,
            pc,
            1,
            ldc as isize,
            accumulate,
            pa,
            a_cs as isize,
            a_rs as isize,
            pb,
            b_cs as isize,
            b_rs as isize,
            if accumulate { 1.0f32 } else { 0.0 },
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{splits_rows, Profile, ProfileRow};

    #[test]
    fn the_printed_profile_keeps_the_slowest_thirty_unless_all_are_asked_for() {
        let rows = (0..40)
            .map(|i| ProfileRow { label: format!("step{i:02}"), calls: 2, seconds: (40 - i) as f64 * 1e-3 })
            .collect();
        let p = Profile { runs: 2, rows };
        let (short, long) = (p.to_string(), format!("{p:#}"));
        assert!(short.contains("step29") && !short.contains("step30"), "{short}");
        assert!(long.contains("step39"), "{long}");
        assert_eq!(long.lines().count(), 42, "the total, the header and every row");
        // 40 ms over 2 runs: the first row is 20 ms per run, one call per run.
        assert!(short.lines().nth(2).unwrap().contains("20.000     1.0  step00"), "{short}");
    }

    #[test]
    fn gemm_bands_follow_the_longer_side_unless_the_other_pads_less() {
        const AVX512: (usize, usize) = (14, 32);
        // 128 rows a thread pad to 140; 128 columns are whole tiles.
        assert!(!splits_rows(256, 256, 2, AVX512), "the 256 x 256 weight gradient splits its columns");
        // With AVX2's 6 x 16 tile 128 rows pad only to 132 (3 %, not more than
        // the 258 rows the column split pads to): the longer side stays.
        assert!(splits_rows(256, 256, 2, (6, 16)));
        // The backbone's products keep the longer side (the other split saves
        // under 3 %: 2048 rows pad by 10, 1024 a thread by 12).
        assert!(splits_rows(2048, 256, 2, AVX512));
        assert!(splits_rows(2048, 768, 2, AVX512));
        assert!(!splits_rows(256, 768, 2, AVX512));
        assert!(splits_rows(768, 256, 2, AVX512));
        // One thread: the longer side.
        assert!(splits_rows(300, 200, 1, AVX512) && !splits_rows(200, 300, 1, AVX512));
    }
}
