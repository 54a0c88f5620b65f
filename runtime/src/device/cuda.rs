//! The Cuda device: executes a [`Plan`] on an NVIDIA GPU through `cudarc`
//! (docs/architecture.md §6, §7).
//!
//! Loading a Plan
//! - checks that the CUDA driver library can be loaded *before* `cudarc`
//!   touches it (`cudarc` panics when it cannot find `libcuda`); without one,
//!   [`CudaDevice::new`] returns [`CudaError::NoCudaDriver`];
//! - renders all kernels as one CUDA translation unit
//!   ([`codegen::render::render_cuda`]), compiles it with our NVRTC driver
//!   ([`codegen::nvrtc::compile_cached`]) for the device's own architecture
//!   (`sm_90` on an H100/H200) and loads the CUBIN, falling back to the PTX
//!   (JIT-compiled by the driver) if the CUBIN is rejected;
//! - allocates every buffer once: one allocation per persistent buffer
//!   (parameters, gradients, inputs, outputs, constants filled with their
//!   value) and one arena per element type for the scratch buffers, placed at
//!   the offsets the memory planner chose (in elements of the buffer's own
//!   type, as on the Cpu device). Everything stays resident across steps;
//! - checks every step against the buffers it binds
//!   ([`super::plan_check`], shared with the Cpu device), so a
//!   malformed Plan is an error at load time, never an out-of-bounds access on
//!   the GPU, and precomputes every launch.
//!
//! [`CudaDevice::run`] then issues the launch list in order on the device's own
//! (non-blocking) stream, which its cuBLAS handle is bound to:
//! kernels with the launch configuration of their [`Grid`]
//! ([`launch_config`]), GEMM steps as cuBLAS `sgemm` strided-batched calls
//! ([`column_major_gemm`]), zero steps as `cuMemsetD8Async`.
//!
//! The sparse MoE steps (docs/math.md §1.6) are the exception to "queue and
//! return": a routing step copies the chosen experts to the host (waiting for
//! the stream: the layer's one synchronisation), routes them with the
//! reference's own function ([`ir::exec::moe::route_into`]), uploads the rows,
//! tokens and counts, and keeps the counts on the host; each grouped GEMM after
//! it reads those host counts (downloading them only when its routing ran in an
//! earlier call) and issues one cuBLAS call per non-empty expert group plus the
//! zeroing of what no group writes ([`codegen::plan::GroupedGemm::products`]).
//!
//! Launches are asynchronous, so a kernel's fault surfaces at some later call
//! that waits. With `WIDEN_CUDA_SYNC=1` ([`SYNC_ENV`]) the device waits after
//! every operation instead, and the first fault is reported with the kernel
//! and the Plan step that raised it ([`CudaError::Fault`]); the module is
//! compiled with `-lineinfo`, so `compute-sanitizer` names the source line.
//!
//! # Row-major GEMMs on column-major cuBLAS
//!
//! A row-major `[r, c]` matrix is, byte for byte, its column-major transpose
//! `[c, r]` with leading dimension `c`. So the Plan's row-major
//! `C = op(A) · op(B)` is computed as the column-major `Cᵀ = op(B)ᵀ · op(A)ᵀ`:
//! the operands swap places, each keeps its own transpose flag, and
//! `(m, n)` swap. A zero batch stride broadcasts an operand (cuBLAS accepts
//! it for A and B); a zero stride of C with several batch entries would make
//! the batch entries race on one output, so it is issued as one call per
//! entry, in order, exactly the Plan's sequential semantics.
//!
//! # Precision
//!
//! An f32 Plan is f32 end to end. cuBLAS runs `sgemm` in its default math mode
//! (true fp32, no TF32) so parity against the reference executor stays at
//! fp32 rounding level.
//!
//! # bf16 plans (docs/math.md §6.12)
//!
//! A spec with `precision: Bf16` lowers to a graph whose residual state and
//! projection operands pass through `Cast` to bf16: those buffers hold 2 bytes
//! per element, kernels widen bf16 loads to f32 and round stores to nearest
//! even, and a GEMM of two bf16 inputs runs as `cublasGemmStridedBatchedEx`
//! with f32 accumulation (`CUBLAS_COMPUTE_32F`) and an f32 output
//! ([`CudaDevice`]'s `gemm_bf16`); the Plan widens a bf16 operand that meets an
//! f32 one beforehand, so a GEMM never mixes input types. Norm statistics,
//! routing and mapping coefficients, Sinkhorn, the loss, parameter gradients and
//! optimizer state stay f32. Parameters stay f32 and the casts of weights are
//! graph ops, so there are no bf16 shadow copies. Parity tolerances widen to
//! bf16 level (`runtime::parity::Tolerances::BF16`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[cfg(feature = "mpi")]
pub mod nccl;

use codegen::kernel::{Grid, Kernel, KernelError};
use codegen::nvrtc::{self, NvrtcError};
use codegen::plan::{BufferDecl, BufferId, BufferRole, Gemm, GroupedGemm, MoeRoute, Plan, Step};
use codegen::render::render_cuda;
use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    result as drv, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use ir::DType;

use super::plan_check::{self, PlanCheckError};
use super::plan_io::{first_loss, Interface};
use super::plan_update::{Held, PlanBuffers, PlanUpdate};
use crate::optim::Optimizer;
use crate::params::{ParamSet, ParamVersion};
use crate::step::host::train_step_on_host;
use crate::step::statistics::ReadsOutputs;
use crate::step::{check_tokens, token_shape_of, StepError, StepExecutor, StepStats, UpdateSettings};
use codegen::compile::Target;
use codegen::training::{forward_plan_for, TrainingGraph};
use ir::lower::Lowered;

/// The driver library that [`CudaError::NoCudaDriver`] names.
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// The cuBLAS library matching the CUDA 13 driver.
pub const CUBLAS_LIBRARY: &str = "libcublas.so.13";

/// The environment variable that makes the device synchronise after every
/// operation of the launch list (any value but empty and `0`).
pub const SYNC_ENV: &str = "WIDEN_CUDA_SYNC";

/// Whether a value of [`SYNC_ENV`] asks for a synchronisation after every operation.
pub fn sync_requested(value: Option<&str>) -> bool {
    value.map(str::trim).is_some_and(|v| !v.is_empty() && v != "0")
}

/// What a [`CudaError::Fault`] names: the operation and its step.
pub fn fault_context(operation: &str, step: usize) -> String {
    format!("{operation} at Plan step {step} (synchronised after every operation, {SYNC_ENV}=1)")
}

/// Largest `gridDim.x` of a 1-D launch.
const MAX_GRID_X: usize = i32::MAX as usize;

/// Largest threads per block on every CUDA GPU since compute capability 2.0.
const MAX_BLOCK_THREADS: u32 = 1024;

/// Errors creating the device, loading a Plan on it or running it.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no CUDA driver: {DRIVER_LIBRARY} (libcuda) could not be loaded. Install the NVIDIA driver, \
         put the folder holding {DRIVER_LIBRARY} on LD_LIBRARY_PATH, or use --device cpu"
    )]
    NoCudaDriver,
    #[error(
        "cuBLAS is not available: {CUBLAS_LIBRARY} could not be loaded. Put the folder holding it \
         on LD_LIBRARY_PATH (the CUDA toolkit's lib64, or the pip package nvidia-cublas's lib folder)"
    )]
    NoCublas,
    #[error("CUDA driver call failed while {what}: {source}")]
    Driver { what: String, source: DriverError },
    #[error("cuBLAS call failed while {what}: {source}")]
    Cublas { what: String, source: CublasError },
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("the driver rejected the compiled module: as CUBIN ({cubin}), then as PTX ({ptx})")]
    ModuleLoad { cubin: DriverError, ptx: DriverError },
    #[error(transparent)]
    Plan(#[from] PlanCheckError),
    #[error("kernel `{kernel}`: {what}")]
    Launch { kernel: String, what: String },
    #[error("{context} failed: {source}")]
    Fault { context: String, source: DriverError },
    #[error("GEMM: {what}")]
    Gemm { what: String },
    /// A routing or grouped step refused its data (an expert index out of range,
    /// group sizes past the rows): checked before any call, never an access out of bounds.
    #[error("sparse MoE step: {what}")]
    Moe { what: String },
    #[error("buffer #{id} does not exist: the plan has {count} buffers")]
    NoSuchBuffer { id: usize, count: usize },
    #[error("steps {start}..{end} are not within the plan's {count} steps")]
    StepRange { start: usize, end: usize, count: usize },
    #[error("buffer #{id} holds {dtype}, not {want}")]
    WrongDType { id: usize, dtype: DType, want: DType },
    #[error("buffer #{id} holds {len} elements, got {got}")]
    WrongLength { id: usize, len: usize, got: usize },
}

fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> CudaError {
    let what = what.into();
    move |source| CudaError::Driver { what, source }
}

fn cublas(what: impl Into<String>) -> impl FnOnce(CublasError) -> CudaError {
    let what = what.into();
    move |source| CudaError::Cublas { what, source }
}

/// Whether the CUDA driver library can be loaded on this machine. `cudarc`
/// panics on its first driver call when it cannot; every path into it goes
/// through this check first.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library; runs no CUDA code.
    unsafe { sys::is_culib_present() }
}

/// Whether cuBLAS can be loaded (same reason as [`driver_available`]).
pub fn cublas_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// The launch configuration of a kernel's grid, or `None` for an empty grid
/// (CUDA rejects zero blocks; there is nothing to do).
///
/// - `ThreadPerItem { n, block }`: `ceil(n / block)` blocks of `block`
///   threads; the kernel guards `item < n`.
/// - `BlockPerItem { n, threads }`: `n` blocks of `threads` lanes; the block
///   reduction scratch is static `__shared__` memory declared by the kernel,
///   so no dynamic shared memory is requested.
pub fn launch_config(grid: &Grid) -> Result<Option<LaunchConfig>, String> {
    let threads = grid.block_threads();
    if threads == 0 || threads > MAX_BLOCK_THREADS {
        return Err(format!("{threads} threads per block; CUDA allows 1..={MAX_BLOCK_THREADS}"));
    }
    let blocks = grid.cuda_blocks();
    if blocks == 0 {
        return Ok(None);
    }
    if blocks > MAX_GRID_X {
        return Err(format!("{blocks} blocks exceed the grid limit of {MAX_GRID_X}"));
    }
    Ok(Some(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }))
}

/// One column-major cuBLAS `sgemm` strided-batched call (alpha = 1).
///
/// `a`/`b`/`c` name Plan buffers, each starting at element `*_offset`.
/// `trans_*` are cuBLAS's `op` flags (`true` = `CUBLAS_OP_T`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlasGemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub a: BufferId,
    pub a_offset: usize,
    pub lda: i32,
    pub stride_a: i64,
    pub b: BufferId,
    pub b_offset: usize,
    pub ldb: i32,
    pub stride_b: i64,
    pub c: BufferId,
    pub c_offset: usize,
    pub ldc: i32,
    pub stride_c: i64,
    pub batch: i32,
    /// 0 overwrites `c`, 1 accumulates into it.
    pub beta: f32,
}

/// The cuBLAS calls computing a row-major Plan [`Gemm`] (see the module
/// docs): operands swapped, `(m, n)` swapped, leading dimensions the row
/// lengths of the operands as stored. Empty products (`m`, `n` or `batch`
/// zero) need no call; `k = 0` is a call that scales `c` by beta.
pub fn column_major_gemm(g: &Gemm) -> Result<Vec<BlasGemm>, String> {
    if g.m == 0 || g.n == 0 || g.batch == 0 {
        return Ok(Vec::new());
    }
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| format!("{what} = {v} exceeds cuBLAS's 32-bit limit"))
    };
    let long = |what: &str, v: usize| i64::try_from(v).map_err(|_| format!("{what} = {v} is too large"));
    // Row-major op(B) [k, n] is column-major op(B)ᵀ [n, k]: B stored [k, n]
    // (row length n) needs no transpose; B stored [n, k] (row length k) does.
    let (lda, ldb) = (if g.trans_b { g.k } else { g.n }, if g.trans_a { g.m } else { g.k });
    let call = |batch: usize, i: usize, strides: (usize, usize, usize)| -> Result<BlasGemm, String> {
        Ok(BlasGemm {
            trans_a: g.trans_b,
            trans_b: g.trans_a,
            m: int("n", g.n)?,
            n: int("m", g.m)?,
            k: int("k", g.k)?,
            a: g.b,
            a_offset: g.offsets[1] + i * g.stride_b,
            lda: int("leading dimension of b", lda.max(1))?,
            stride_a: long("stride_b", strides.1)?,
            b: g.a,
            b_offset: g.offsets[0] + i * g.stride_a,
            ldb: int("leading dimension of a", ldb.max(1))?,
            stride_b: long("stride_a", strides.0)?,
            c: g.c,
            c_offset: g.offsets[2] + i * g.stride_c,
            ldc: int("n", g.n)?,
            stride_c: long("stride_c", strides.2)?,
            batch: int("batch", batch)?,
            beta: if g.accumulate { 1.0 } else { 0.0 },
        })
    };
    if g.stride_c == 0 && g.batch > 1 {
        (0..g.batch).map(|i| call(1, i, (0, 0, 0))).collect()
    } else {
        Ok(vec![call(g.batch, 0, (g.stride_a, g.stride_b, g.stride_c))?])
    }
}

/// Where a buffer lives: its own allocation, or an element offset into the
/// arena of its element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Own,
    Arena { offset: usize },
}

/// The device memory layout of a Plan: a placement per buffer and the length
/// (in elements) of the arena of each element type, indexed like [`DTYPES`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub placements: Vec<Placement>,
    pub arena_len: [usize; 4],
}

/// Element types with an arena, in arena order.
pub const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::Bf16, DType::I32];

/// The arena index of an element type.
fn dtype_slot(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::Bf16 => 2,
        DType::I32 => 3,
    }
}

impl Layout {
    /// Lays out `plan`: persistent roles get their own allocation; scratch
    /// buffers share their type's arena, which covers the Plan's
    /// `arena_len` (f32) and every `offset + len`.
    pub fn of(plan: &Plan) -> Result<Layout, CudaError> {
        let mut arena_len = [0usize; 4];
        arena_len[0] = plan.arena_len;
        plan_check::check_buffer_ids(plan)?;
        // Before any `offset + len` below: no placement's end overflows.
        plan_check::check_sizes(plan)?;
        let mut placements = Vec::with_capacity(plan.buffers.len());
        for d in &plan.buffers {
            placements.push(match d.role {
                BufferRole::Scratch { offset } => {
                    let slot = dtype_slot(d.dtype);
                    arena_len[slot] = arena_len[slot].max(offset + d.len);
                    Placement::Arena { offset }
                }
                _ => Placement::Own,
            });
        }
        Ok(Layout { placements, arena_len })
    }
}

/// One device allocation, freed on drop.
#[derive(Debug)]
struct Allocation {
    ptr: sys::CUdeviceptr,
    /// Its size, counted in [`ALLOCATED`] while it lives.
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl Allocation {
    /// `bytes` of zeroed device memory (at least one byte: `cuMemAlloc`
    /// rejects zero).
    fn zeroed(ctx: &Arc<CudaContext>, stream: &CudaStream, bytes: usize) -> Result<Allocation, CudaError> {
        let bytes = bytes.max(1);
        // SAFETY: the context is current (bound by the caller); plain device
        // memory, no managed memory (device README).
        let ptr = unsafe { drv::malloc_sync(bytes) }.map_err(driver(format!("allocating {bytes} bytes")))?;
        let a = Allocation { ptr, bytes, ctx: ctx.clone() };
        let now = ALLOCATED.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        ALLOCATED_PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: `ptr` addresses `bytes` bytes just allocated.
        unsafe { drv::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }.map_err(driver("zeroing"))?;
        Ok(a)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // The device synchronizes its stream before dropping allocations, so
        // no queued work still uses this memory.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by `malloc_sync` and freed once.
        self.ctx.record_err(unsafe { drv::free_sync(self.ptr) });
        ALLOCATED.fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

/// Bytes the Cuda devices of this process hold now, and the most they held at
/// once: every [`Allocation`] (a Plan's buffers and arenas). The CUDA context and
/// cuBLAS's workspace are the driver's and cuBLAS's own, not counted.
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_PEAK: AtomicU64 = AtomicU64::new(0);

/// The most GPU memory the Cuda devices of this process had allocated at once,
/// in bytes (0 before any device is loaded): the measured counterpart of a Plan's
/// buffers and arenas (`super::memory`).
pub fn allocated_peak_bytes() -> u64 {
    ALLOCATED_PEAK.load(Ordering::Relaxed)
}

/// A precomputed step of the launch list.
#[derive(Debug)]
enum Op {
    Launch {
        kernel: usize,
        cfg: LaunchConfig,
        args: Vec<sys::CUdeviceptr>,
    },
    Blas(BlasCall),
    Zero {
        ptr: sys::CUdeviceptr,
        bytes: usize,
    },
    /// Sparse MoE routing on the host (see the module docs).
    Route(MoeRoute),
    /// A grouped GEMM whose cuBLAS calls are sized when it is issued, from the
    /// host copy of its counts; `bf16_inputs` as for [`BlasCall`].
    Grouped {
        gemm: GroupedGemm,
        bf16_inputs: bool,
    },
}

/// A [`BlasGemm`] with its buffers resolved to device pointers.
#[derive(Debug, Clone, Copy)]
struct BlasCall {
    g: BlasGemm,
    a: sys::CUdeviceptr,
    b: sys::CUdeviceptr,
    c: sys::CUdeviceptr,
    /// Both inputs are bf16 (the Plan never mixes input types in one GEMM, and `c` is f32).
    bf16_inputs: bool,
}

/// The time of one step of the launch list, and the traffic and work it
/// must at least do (for bandwidth and FLOP-rate reports).
#[derive(Debug, Clone, PartialEq)]
pub struct StepTiming {
    /// Position in the launch list.
    pub step: usize,
    /// `kernel:<name>`, `gemm`, `zero`, `moe_route` or `grouped_gemm`.
    pub label: String,
    /// Median over the repetitions, in milliseconds.
    pub ms: f64,
    /// Fewest bytes the step must move: each kernel argument read once if
    /// the kernel reads it and written once if it writes it; GEMM operands
    /// read once and the output written once (read too when accumulating).
    pub bytes: u64,
    /// Floating-point operations (GEMMs only: 2·m·n·k per batch entry; a
    /// grouped GEMM's over all its rows, the bound with a capacity).
    pub flops: u64,
}

/// A loaded Plan with its device buffers and compiled kernels.
pub struct CudaDevice {
    plan: Plan,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: Vec<CudaFunction>,
    /// The device operations of each Plan step (none for an empty grid,
    /// several for a GEMM split per batch entry).
    ops: Vec<Vec<Op>>,
    /// Base pointer of every buffer.
    ptrs: Vec<sys::CUdeviceptr>,
    /// Keeps the memory behind `ptrs` alive; dropped after a synchronize.
    _memory: Vec<Allocation>,
    /// `sm_XY` of the device.
    arch: String,
    /// Synchronise after every operation ([`SYNC_ENV`]).
    sync: bool,
    /// The group sizes each routing step of the current call wrote, by counts
    /// buffer: the grouped GEMMs after it size their cuBLAS calls from these
    /// without waiting for the device again. Cleared at the start of every call
    /// ([`CudaDevice::run_range`]), since a later routing may change them.
    host_counts: std::sync::Mutex<std::collections::HashMap<BufferId, Vec<i32>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("arch", &self.arch)
            .field("kernels", &self.functions.len())
            .field("steps", &self.ops.len())
            .finish_non_exhaustive()
    }
}

/// The context of GPU `ordinal`, after checking that the driver can be loaded.
fn context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    if !driver_available() {
        return Err(CudaError::NoCudaDriver);
    }
    let ctx = CudaContext::new(ordinal).map_err(driver(format!("opening GPU {ordinal}")))?;
    // Raw pointers, each used on the one stream of the device that owns it: cudarc's
    // per-slice event tracking (for slices shared between streams) has nothing to order.
    // SAFETY: no cudarc slices exist on this context; a device's work is on its stream.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// The `sm_XY` architecture of a context's device.
fn arch_of(ctx: &CudaContext) -> Result<String, CudaError> {
    let (major, minor) = ctx.compute_capability().map_err(driver("reading the compute capability"))?;
    Ok(format!("sm_{major}{minor}"))
}

/// Name and compute architecture of GPU 0, checking the driver first.
pub fn probe() -> Result<(String, String), CudaError> {
    let ctx = context(0)?;
    let name = ctx.name().map_err(driver("reading the device name"))?;
    Ok((name, arch_of(&ctx)?))
}

impl CudaDevice {
    /// Loads `plan` on GPU 0 (see the module docs). Returns the Plan's first
    /// inconsistency, else [`CudaError::NoCudaDriver`] on a machine without
    /// the CUDA driver.
    pub fn new(plan: Plan) -> Result<CudaDevice, CudaError> {
        CudaDevice::on(plan, 0)
    }

    /// Loads `plan` on GPU `ordinal`.
    pub fn on(plan: Plan, ordinal: usize) -> Result<CudaDevice, CudaError> {
        // The Plan is checked first, so a malformed one is reported the same
        // way on every machine.
        let layout = Layout::of(&plan)?;
        plan_check::check_steps(&plan)?;
        let ctx = context(ordinal)?;
        if !cublas_available() {
            return Err(CudaError::NoCublas);
        }
        let arch = arch_of(&ctx)?;
        let functions = compile(&ctx, &plan.kernels, &arch)?;
        // The device's own non-blocking stream, with the cuBLAS handle bound to it: on
        // the legacy default stream two devices in one process would wait on each other.
        let stream = ctx.new_stream().map_err(driver("creating the device's stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(cublas("creating the cuBLAS handle"))?;
        let (ptrs, allocations) = allocate(&ctx, &stream, &plan, &layout)?;
        let ops = prepare(&plan, &ptrs)?;
        stream.synchronize().map_err(driver("filling constants"))?;
        let sync = sync_requested(std::env::var(SYNC_ENV).ok().as_deref());
        Ok(CudaDevice {
            plan,
            ctx,
            stream,
            blas,
            functions,
            ops,
            ptrs,
            _memory: allocations,
            arch,
            sync,
            host_counts: Default::default(),
        })
    }

    /// The loaded Plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The device's architecture (`sm_90` on an H100/H200).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The buffer holding `role`, if the Plan has one.
    pub fn find(&self, role: &BufferRole) -> Option<BufferId> {
        self.plan.find(role)
    }

    fn decl(&self, id: BufferId) -> Result<&BufferDecl, CudaError> {
        let count = self.plan.buffers.len();
        self.plan.buffers.get(id.0).ok_or(CudaError::NoSuchBuffer { id: id.0, count })
    }

    fn checked(&self, id: BufferId, want: DType, got: usize) -> Result<sys::CUdeviceptr, CudaError> {
        let d = self.decl(id)?;
        if d.dtype != want {
            return Err(CudaError::WrongDType { id: id.0, dtype: d.dtype, want });
        }
        if d.len != got {
            return Err(CudaError::WrongLength { id: id.0, len: d.len, got });
        }
        Ok(self.ptrs[id.0])
    }

    fn write<T>(&mut self, id: BufferId, want: DType, data: &[T]) -> Result<(), CudaError> {
        let ptr = self.checked(id, want, data.len())?;
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // SAFETY: `ptr` addresses `data.len()` elements of `want` (checked);
        // a copy from pageable host memory has read `data` when it returns.
        unsafe { drv::memcpy_htod_async(ptr, data, self.stream.cu_stream()) }
            .map_err(driver(format!("uploading buffer #{}", id.0)))
    }

    fn read<T: Copy + Default>(&self, id: BufferId, want: DType) -> Result<Vec<T>, CudaError> {
        let len = self.decl(id)?.len;
        let ptr = self.checked(id, want, len)?;
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        let mut out = vec![T::default(); len];
        // SAFETY: `ptr` addresses `len` elements of `want`; the stream is
        // synchronized before `out` is used.
        unsafe { drv::memcpy_dtoh_async(&mut out, ptr, self.stream.cu_stream()) }
            .map_err(driver(format!("downloading buffer #{}", id.0)))?;
        self.stream.synchronize().map_err(driver(format!("downloading buffer #{}", id.0)))?;
        Ok(out)
    }

    /// Overwrites an f32 buffer; `data` must have the buffer's length.
    pub fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<(), CudaError> {
        self.write(id, DType::F32, data)
    }

    /// Overwrites an i32 buffer (token ids); `data` must have the buffer's length.
    pub fn write_i32(&mut self, id: BufferId, data: &[i32]) -> Result<(), CudaError> {
        self.write(id, DType::I32, data)
    }

    /// The contents of an f32 buffer after all queued work.
    pub fn read_f32(&self, id: BufferId) -> Result<Vec<f32>, CudaError> {
        self.read(id, DType::F32)
    }

    /// Overwrites an f64 buffer; `data` must have the buffer's length.
    pub fn write_f64(&mut self, id: BufferId, data: &[f64]) -> Result<(), CudaError> {
        self.write(id, DType::F64, data)
    }

    /// The contents of an f64 buffer after all queued work.
    pub fn read_f64(&self, id: BufferId) -> Result<Vec<f64>, CudaError> {
        self.read(id, DType::F64)
    }

    /// Issues every step of the Plan once, in order, on the device's stream.
    /// Returns when the work is queued; reads synchronize.
    pub fn run(&mut self) -> Result<(), CudaError> {
        self.run_range(0..self.ops.len())
    }

    /// Issues steps `range` of the Plan, in order (the steps before the
    /// optimizer update alone: `Plan::gradient_steps`).
    pub fn run_range(&mut self, range: std::ops::Range<usize>) -> Result<(), CudaError> {
        if range.start > range.end || range.end > self.ops.len() {
            return Err(CudaError::StepRange { start: range.start, end: range.end, count: self.ops.len() });
        }
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        self.counts_on_host().clear();
        for i in range {
            self.issue(i)?;
        }
        Ok(())
    }

    /// The group sizes kept on the host ([`CudaDevice`]'s `host_counts`).
    fn counts_on_host(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<BufferId, Vec<i32>>> {
        self.host_counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("synchronizing"))
    }

    /// Issues the operations of Plan step `i`.
    fn issue(&self, i: usize) -> Result<(), CudaError> {
        for op in &self.ops[i] {
            self.issue_op(op)?;
            if self.sync {
                self.stream.synchronize().map_err(|source| CudaError::Fault {
                    context: fault_context(&self.op_name(op), i),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// How a fault names an operation: the kernel's symbol, or the kind of step.
    fn op_name(&self, op: &Op) -> String {
        match op {
            Op::Launch { kernel, .. } => format!("kernel `{}`", self.plan.kernels[*kernel].symbol()),
            Op::Blas(_) => "the cuBLAS GEMM".into(),
            Op::Zero { .. } => "zeroing a buffer".into(),
            Op::Route(_) => "the MoE routing".into(),
            Op::Grouped { .. } => "the grouped cuBLAS GEMM".into(),
        }
    }

    fn issue_op(&self, op: &Op) -> Result<(), CudaError> {
        match op {
            Op::Launch { kernel, cfg, args } => {
                let f = &self.functions[*kernel];
                let mut b = self.stream.launch_builder(f);
                for a in args {
                    b.arg(a);
                }
                // SAFETY: `plan_check::check_steps` matched every argument's element type
                // and length to the kernel's parameter, and the kernel's
                // parameters are exactly these pointers (render_cuda).
                unsafe { b.launch(*cfg) }
                    .map_err(driver(format!("launching {}", self.plan.kernels[*kernel].symbol())))?;
            }
            Op::Blas(call) => self.sgemm(call)?,
            Op::Zero { ptr, bytes } => {
                // SAFETY: `ptr` addresses `bytes` bytes of one buffer.
                unsafe { drv::memset_d8_async(*ptr, 0, *bytes, self.stream.cu_stream()) }
                    .map_err(driver("zeroing a buffer"))?;
            }
            Op::Route(r) => self.route(r)?,
            Op::Grouped { gemm, bf16_inputs } => self.grouped(gemm, *bf16_inputs)?,
        }
        Ok(())
    }

    /// `len` i32 values of buffer `id`, after the work queued so far.
    fn download_i32(&self, id: BufferId, len: usize) -> Result<Vec<i32>, CudaError> {
        let mut out = vec![0i32; len];
        // SAFETY: `check_steps` verified that the buffer holds at least `len` i32 values;
        // the stream is synchronized before `out` is read.
        unsafe { drv::memcpy_dtoh_async(&mut out, self.ptrs[id.0], self.stream.cu_stream()) }
            .map_err(driver(format!("downloading buffer #{}", id.0)))?;
        self.stream.synchronize().map_err(driver(format!("downloading buffer #{}", id.0)))?;
        Ok(out)
    }

    /// Sparse MoE routing (docs/math.md §1.6) on the host: the chosen experts
    /// downloaded (the one wait of the layer), routed with the reference's
    /// function, the three results uploaded and the counts kept on the host.
    fn route(&self, r: &MoeRoute) -> Result<(), CudaError> {
        let idx = self.download_i32(r.idx, r.assignments)?;
        let (mut rows, mut tokens) = (vec![0i32; r.assignments], vec![0i32; r.assignments]);
        let mut counts = vec![0i32; r.experts];
        ir::exec::moe::route_into(&idx, r.k, r.experts, r.capacity, &mut rows, &mut tokens, &mut counts)
            .map_err(|what| CudaError::Moe { what })?;
        for (id, data) in [(r.rows, &rows), (r.tokens, &tokens), (r.counts, &counts)] {
            // SAFETY: `check_steps` verified the buffer holds at least `data.len()` i32
            // values; a copy from pageable host memory has read `data` when it returns.
            unsafe { drv::memcpy_htod_async(self.ptrs[id.0], data.as_slice(), self.stream.cu_stream()) }
                .map_err(driver(format!("uploading the routing into buffer #{}", id.0)))?;
        }
        self.counts_on_host().insert(r.counts, counts);
        Ok(())
    }

    /// A grouped GEMM (docs/math.md §1.6): the zeroing of what no group writes and
    /// one cuBLAS call per non-empty group, sized by the host copy of the counts.
    fn grouped(&self, g: &GroupedGemm, bf16_inputs: bool) -> Result<(), CudaError> {
        let cached = self.counts_on_host().get(&g.counts).cloned();
        let counts = match cached {
            Some(c) => c,
            None => {
                let c = self.download_i32(g.counts, g.groups)?;
                self.counts_on_host().insert(g.counts, c.clone());
                c
            }
        };
        let (products, zeroed) = g.products(&counts).map_err(|what| CudaError::Moe { what })?;
        let c = self.ptrs[g.c.0];
        for r in zeroed {
            // SAFETY: the range lies inside c's f32 extent (`GroupedGemm::products`,
            // extents checked by `check_steps`).
            unsafe {
                drv::memset_d8_async(c + (r.start * 4) as u64, 0, r.len() * 4, self.stream.cu_stream())
            }
            .map_err(driver("zeroing a grouped GEMM's uncovered rows"))?;
        }
        for p in &products {
            for call in column_major_gemm(p).map_err(|what| CudaError::Gemm { what })? {
                let [a, b, c] = [call.a, call.b, call.c].map(|id| self.ptrs[id.0]);
                // Each product lies inside the step's extents, as `check_steps` verified them.
                self.sgemm(&BlasCall { g: call, a, b, c, bf16_inputs })?;
            }
        }
        Ok(())
    }

    fn sgemm(&self, call: &BlasCall) -> Result<(), CudaError> {
        if call.bf16_inputs {
            return self.gemm_bf16(call);
        }
        let g = &call.g;
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, g.beta);
        let f32_at = |base: sys::CUdeviceptr, offset: usize| (base + (offset * 4) as u64) as *mut f32;
        // SAFETY: `plan_check::check_steps` verified every operand holds all batch entries
        // at these strides; the handle runs on the device's stream.
        unsafe {
            cudarc::cublas::result::sgemm_strided_batched(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                g.m,
                g.n,
                g.k,
                &alpha,
                f32_at(call.a, g.a_offset),
                g.lda,
                g.stride_a,
                f32_at(call.b, g.b_offset),
                g.ldb,
                g.stride_b,
                &beta,
                f32_at(call.c, g.c_offset),
                g.ldc,
                g.stride_c,
                g.batch,
            )
        }
        .map_err(cublas("sgemm_strided_batched"))
    }

    /// A GEMM of bf16 inputs (docs/math.md §6.12): `cublasGemmStridedBatchedEx` with
    /// `CUDA_R_16BF` A and B, an f32 C and f32 accumulation (`CUBLAS_COMPUTE_32F`), the
    /// same column-major mapping as the f32 path.
    fn gemm_bf16(&self, call: &BlasCall) -> Result<(), CudaError> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        let g = &call.g;
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, g.beta);
        let at = |base: sys::CUdeviceptr, offset: usize, bytes: usize| base + (offset * bytes) as u64;
        let bf16 = cudaDataType::CUDA_R_16BF;
        // SAFETY: `plan_check::check_steps` verified every operand holds all batch entries
        // at these strides, A and B as bf16 and C as f32; the handle runs on the device's
        // stream, and alpha/beta are f32 as CUBLAS_COMPUTE_32F requires.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                g.m,
                g.n,
                g.k,
                (&alpha as *const f32).cast(),
                at(call.a, g.a_offset, 2) as *const std::ffi::c_void,
                bf16,
                g.lda,
                g.stride_a,
                at(call.b, g.b_offset, 2) as *const std::ffi::c_void,
                bf16,
                g.ldb,
                g.stride_b,
                (&beta as *const f32).cast(),
                at(call.c, g.c_offset, 4) as *mut std::ffi::c_void,
                cudaDataType::CUDA_R_32F,
                g.ldc,
                g.stride_c,
                g.batch,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cublas("gemm_strided_batched_ex (bf16)"))
    }

    /// Times every step of the launch list: `reps` runs of the whole list
    /// with an event pair around each step, the median per step. Run
    /// [`CudaDevice::run`] once first so module load and cuBLAS heuristics
    /// stay out of the numbers.
    pub fn profile(&mut self, reps: usize) -> Result<Vec<StepTiming>, CudaError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let new_event = || self.ctx.new_event(flags).map_err(driver("creating an event"));
        let events: Vec<(CudaEvent, CudaEvent)> = (0..self.ops.len())
            .map(|_| Ok((new_event()?, new_event()?)))
            .collect::<Result<_, CudaError>>()?;
        let mut samples = vec![Vec::with_capacity(reps); self.ops.len()];
        for _ in 0..reps.max(1) {
            for (i, (start, end)) in events.iter().enumerate() {
                start.record(&self.stream).map_err(driver("recording an event"))?;
                self.issue(i)?;
                end.record(&self.stream).map_err(driver("recording an event"))?;
            }
            for (i, (start, end)) in events.iter().enumerate() {
                samples[i].push(f64::from(start.elapsed_ms(end).map_err(driver("reading an event"))?));
            }
        }
        Ok(samples
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let (label, bytes, flops) = step_cost(&self.plan, i);
                StepTiming { step: i, label, ms: median(s), bytes, flops }
            })
            .collect())
    }

    /// Milliseconds per run of the whole launch list: the median of `reps`
    /// timed runs after `warmup` untimed ones.
    pub fn time_runs(&mut self, warmup: usize, reps: usize) -> Result<f64, CudaError> {
        for _ in 0..warmup {
            self.run()?;
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(driver("creating an event"))?;
        let end = self.ctx.new_event(flags).map_err(driver("creating an event"))?;
        let mut samples = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            start.record(&self.stream).map_err(driver("recording an event"))?;
            self.run()?;
            end.record(&self.stream).map_err(driver("recording an event"))?;
            samples.push(f64::from(start.elapsed_ms(&end).map_err(driver("reading an event"))?));
        }
        Ok(median(samples))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Queued work may still use the allocations dropped after this.
        self.ctx.record_err(self.stream.synchronize());
    }
}

fn median(mut s: Vec<f64>) -> f64 {
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Label, fewest bytes and FLOPs of step `i` (see [`StepTiming`]).
fn step_cost(plan: &Plan, i: usize) -> (String, u64, u64) {
    let size = |id: BufferId| plan.buffers[id.0].dtype.size_bytes() as u64;
    match &plan.steps[i] {
        Step::Kernel { kernel, args } => {
            let k = &plan.kernels[*kernel];
            let bytes = k
                .params
                .iter()
                .zip(args)
                .map(|(p, id)| {
                    let passes = u64::from(p.access.reads_memory()) + u64::from(p.access.writable());
                    passes * p.len as u64 * size(*id)
                })
                .sum();
            (format!("kernel:{}", k.name), bytes, 0)
        }
        Step::Gemm(g) => {
            let (m, n, k, b) = (g.m as u64, g.n as u64, g.k as u64, g.batch as u64);
            let batches = |stride: usize| if stride == 0 { 1 } else { b };
            let c_passes = if g.accumulate { 2 } else { 1 };
            let elems = m * k * batches(g.stride_a) + k * n * batches(g.stride_b) + c_passes * m * n * b;
            ("gemm".into(), 4 * elems, 2 * m * n * k * b)
        }
        Step::Zero { buffer } => {
            let d = &plan.buffers[buffer.0];
            ("zero".into(), (d.len * d.dtype.size_bytes()) as u64, 0)
        }
        // The host pass moves the indices down and the three results up.
        Step::MoeRoute(r) => ("moe_route".into(), 4 * (3 * r.assignments + r.experts) as u64, 0),
        // Every row routed (the dropless count, a bound with a capacity).
        Step::GroupedGemm(g) => {
            let [a, b, c] = g.extents().unwrap_or([0; 3]);
            let elem = |id: BufferId| size(id) as usize;
            let bytes = a * elem(g.a) + b * elem(g.b) + 4 * c;
            ("grouped_gemm".into(), bytes as u64, 2 * (g.m * g.n * g.k) as u64)
        }
    }
}

/// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes
/// written), the memory ceiling fused kernels are judged against
/// (docs/architecture.md §10): the median of `reps` copies of `bytes`.
pub fn copy_bandwidth(bytes: usize, reps: usize) -> Result<f64, CudaError> {
    let ctx = context(0)?;
    let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
    let src = Allocation::zeroed(&ctx, &stream, bytes)?;
    // Non-zero contents, so no shortcut for zeroed memory flatters the rate.
    // SAFETY: `src` holds `bytes` bytes; the pattern fills bytes / 4 words.
    unsafe { sys::cuMemsetD32Async(src.ptr, 0x3f9d_70a4, bytes / 4, stream.cu_stream()) }
        .result()
        .map_err(driver("filling the copy source"))?;
    let dst = Allocation::zeroed(&ctx, &stream, bytes)?;
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = ctx.new_event(flags).map_err(driver("creating an event"))?;
    let end = ctx.new_event(flags).map_err(driver("creating an event"))?;
    let copy = || {
        // SAFETY: both allocations hold `bytes` bytes.
        unsafe { drv::memcpy_dtod_async(dst.ptr, src.ptr, bytes, stream.cu_stream()) }
            .map_err(driver("copying device to device"))
    };
    copy()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        start.record(&stream).map_err(driver("recording an event"))?;
        copy()?;
        end.record(&stream).map_err(driver("recording an event"))?;
        samples.push(f64::from(start.elapsed_ms(&end).map_err(driver("reading an event"))?));
    }
    stream.synchronize().map_err(driver("synchronizing"))?;
    Ok(2.0 * bytes as f64 / (median(samples) * 1e-3))
}

/// Renders, compiles and loads all kernels; returns their functions in Plan order.
fn compile(ctx: &Arc<CudaContext>, kernels: &[Kernel], arch: &str) -> Result<Vec<CudaFunction>, CudaError> {
    if kernels.is_empty() {
        return Ok(Vec::new());
    }
    let source = render_cuda(kernels)?;
    // The CUBIN for this GPU's architecture, compiled once per Plan and cached like
    // the C kernels; PTX (JIT-compiled by the driver) only when the CUBIN is refused.
    let cache = codegen::cc::default_cache_dir();
    let (cubin, _) = nvrtc::compile_cached(&source, arch, nvrtc::Output::Cubin, &cache)?;
    let module = match ctx.load_module(Ptx::from_binary(cubin)) {
        Ok(m) => m,
        Err(cubin) => {
            let (ptx, _) = nvrtc::compile_cached(&source, arch, nvrtc::Output::Ptx, &cache)?;
            ctx.load_module(Ptx::from_src(String::from_utf8_lossy(&ptx).into_owned()))
                .map_err(|ptx| CudaError::ModuleLoad { cubin, ptx })?
        }
    };
    kernels
        .iter()
        .map(|k| module.load_function(&k.symbol()).map_err(driver(format!("loading {}", k.symbol()))))
        .collect()
}

/// Allocates every buffer (constants filled) and returns the base pointer of each.
fn allocate(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    plan: &Plan,
    layout: &Layout,
) -> Result<(Vec<sys::CUdeviceptr>, Vec<Allocation>), CudaError> {
    let mut allocations = Vec::new();
    let mut arenas = [0; 4];
    for (slot, (&dtype, &len)) in DTYPES.iter().zip(&layout.arena_len).enumerate() {
        if len > 0 {
            let a = Allocation::zeroed(ctx, stream, len * dtype.size_bytes())?;
            arenas[slot] = a.ptr;
            allocations.push(a);
        }
    }
    let mut ptrs = Vec::with_capacity(plan.buffers.len());
    for (d, placement) in plan.buffers.iter().zip(&layout.placements) {
        let size = d.dtype.size_bytes();
        ptrs.push(match *placement {
            Placement::Arena { offset } => arenas[dtype_slot(d.dtype)] + (offset * size) as u64,
            Placement::Own => {
                let a = Allocation::zeroed(ctx, stream, d.len * size)?;
                if let BufferRole::Constant { value } = d.role {
                    fill(stream, d, a.ptr, value)?;
                }
                let ptr = a.ptr;
                allocations.push(a);
                ptr
            }
        });
    }
    Ok((ptrs, allocations))
}

/// Fills a constant buffer with `value` in its storage type.
fn fill(stream: &CudaStream, d: &BufferDecl, ptr: sys::CUdeviceptr, value: f64) -> Result<(), CudaError> {
    let s = stream.cu_stream();
    let what = || format!("filling constant buffer #{}", d.id.0);
    // SAFETY (all arms): `ptr` addresses `d.len` elements of `d.dtype`.
    match d.dtype {
        DType::F32 => unsafe { sys::cuMemsetD32Async(ptr, (value as f32).to_bits(), d.len, s) }.result(),
        DType::I32 if value.fract() == 0.0 && value.abs() <= f64::from(i32::MAX) => {
            unsafe { sys::cuMemsetD32Async(ptr, value as i32 as u32, d.len, s) }.result()
        }
        DType::F64 => {
            let host = vec![value; d.len];
            unsafe { drv::memcpy_htod_async(ptr, &host, s) }
        }
        dtype => {
            return Err(
                PlanCheckError::ConstantDType { id: d.id.0, role: format!("{:?}", d.role), dtype }.into()
            );
        }
    }
    .map_err(driver(what()))
}

/// Precomputes the device operations of every step with resolved pointers.
fn prepare(plan: &Plan, ptrs: &[sys::CUdeviceptr]) -> Result<Vec<Vec<Op>>, CudaError> {
    let mut all = Vec::with_capacity(plan.steps.len());
    for step in &plan.steps {
        let mut ops = Vec::new();
        match step {
            Step::Kernel { kernel, args } => {
                let k = &plan.kernels[*kernel];
                let cfg = launch_config(&k.grid)
                    .map_err(|what| CudaError::Launch { kernel: k.name.clone(), what })?;
                if let Some(cfg) = cfg {
                    ops.push(Op::Launch {
                        kernel: *kernel,
                        cfg,
                        args: args.iter().map(|id| ptrs[id.0]).collect(),
                    });
                }
            }
            Step::Gemm(g) => {
                for c in column_major_gemm(g).map_err(|what| CudaError::Gemm { what })? {
                    let bf16_inputs = plan.buffers[c.a.0].dtype == DType::Bf16;
                    ops.push(Op::Blas(BlasCall {
                        g: c,
                        a: ptrs[c.a.0],
                        b: ptrs[c.b.0],
                        c: ptrs[c.c.0],
                        bf16_inputs,
                    }));
                }
            }
            Step::Zero { buffer } => {
                let d = &plan.buffers[buffer.0];
                ops.push(Op::Zero { ptr: ptrs[buffer.0], bytes: d.len * d.dtype.size_bytes() });
            }
            Step::MoeRoute(r) => ops.push(Op::Route(r.clone())),
            Step::GroupedGemm(g) => {
                let bf16_inputs = plan.buffers[g.a.0].dtype == DType::Bf16;
                ops.push(Op::Grouped { gemm: g.clone(), bf16_inputs });
            }
        }
        all.push(ops);
    }
    Ok(all)
}

/// The [`StepExecutor`] over a [`CudaDevice`], with the interface of the
/// Cpu device's executor ([`super::cpu::CpuExecutor`]): a `tokens`
/// input, a `loss` output, an optional `logits` output and a gradient buffer
/// per parameter. Parameters are uploaded only when the set handed in is not
/// the one the device holds; with AdamW the Plan runs the update, so
/// parameters and moments stay on the GPU and a step moves only the new
/// parameters back (`super::plan_update`, the protocol the Cpu executor shares).
#[derive(Debug)]
pub struct CudaExecutor {
    /// This rank's NCCL communicator in a data-parallel run; declared before
    /// the device so that it is released while the device's context lives.
    #[cfg(feature = "mpi")]
    nccl: Option<nccl::NcclComm>,
    device: CudaDevice,
    io: Interface,
    update: Option<PlanUpdate>,
    token_shape: [usize; 2],
    /// Token ids must lie in `0..vocab` ([`check_tokens`], before every upload).
    vocab: usize,
    /// The version of the parameter set the device's parameter buffers hold.
    resident: Option<ParamVersion>,
    /// Whose moments the Plan's optimizer state buffers hold.
    held: Held,
    /// The forward Plan with the logits whole, which the training Plan does not
    /// keep (docs/math.md §1.7): compiled and loaded on the first
    /// [`StepExecutor::logits`] of an executor built from a lowered graph.
    forward: CudaForward,
}

/// The logits' forward Plan of a [`CudaExecutor`].
#[derive(Debug)]
enum CudaForward {
    /// Built over a loaded Plan: its own `logits` output, if any, is all there is.
    Unavailable,
    /// The lowered graph and the GPU it is to run on.
    Pending(Box<Lowered>, usize),
    /// Loaded, with the parameter version its buffers hold.
    Ready(Box<CudaDevice>, Box<Interface>, Option<ParamVersion>),
}

impl CudaExecutor {
    /// Differentiates, fuses and compiles `lowered` into a training Plan
    /// sized for the GPU ([`TrainingGraph`]) and loads it on GPU `ordinal`.
    /// The driver is checked first, so a machine without one fails fast
    /// ([`CudaError::NoCudaDriver`]) instead of compiling a Plan it cannot run.
    pub fn from_lowered(lowered: Lowered, ordinal: usize) -> Result<CudaExecutor, StepError> {
        if !driver_available() {
            return Err(CudaError::NoCudaDriver.into());
        }
        let token_shape = token_shape_of(&lowered.graph, lowered.tokens);
        let vocab = lowered.graph.node(lowered.logits).shape.dims().last().copied().unwrap_or(0);
        let forward = CudaForward::Pending(Box::new(lowered.clone()), ordinal);
        let plan = TrainingGraph::new(lowered)?.plan_for(Target::Cuda)?;
        let mut exec = CudaExecutor::new(CudaDevice::on(plan, ordinal)?, token_shape, vocab)?;
        exec.forward = forward;
        Ok(exec)
    }

    /// An executor over a loaded Plan whose `tokens` input has shape
    /// `token_shape` (`[batch, seq_len + 1]`) and holds ids in `0..vocab`.
    pub fn new(device: CudaDevice, token_shape: [usize; 2], vocab: usize) -> Result<CudaExecutor, StepError> {
        let io = Interface::of(device.plan())?;
        let update = PlanUpdate::of(device.plan());
        Ok(CudaExecutor {
            #[cfg(feature = "mpi")]
            nccl: None,
            device,
            io,
            update,
            token_shape,
            vocab,
            resident: None,
            held: None,
            forward: CudaForward::Unavailable,
        })
    }

    /// The underlying device (profiling, direct buffer access). The caller
    /// may write any buffer, so the next run uploads the parameters and
    /// moments again.
    /// The device, to read buffers: reading changes nothing the executor vouches for.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut CudaDevice {
        self.resident = None;
        self.held = None;
        &mut self.device
    }

    /// Uploads the parameters (unless the device holds this version of them)
    /// and the tokens, then queues the Plan's gradient steps, or every step
    /// with `update`.
    fn run(&mut self, params: &ParamSet, tokens: &[i32], update: bool) -> Result<(), StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        let upload = self.resident != Some(params.version());
        self.resident = None;
        if upload {
            for (name, buffer, _) in &self.io.params {
                let p = params.get(name).ok_or_else(|| StepError::UnknownParam { name: name.clone() })?;
                self.device.write_f32(*buffer, &p.value)?;
            }
        }
        self.device.write_i32(self.io.tokens, tokens)?;
        let steps =
            if update { 0..self.device.plan().steps.len() } else { self.device.plan().gradient_steps() };
        self.device.run_range(steps)?;
        self.resident = Some(params.version());
        Ok(())
    }

    fn read_loss(&self) -> Result<f32, StepError> {
        first_loss(&self.device.read_f32(self.io.loss)?)
    }
}

impl StepExecutor for CudaExecutor {
    fn device(&self) -> &'static str {
        "cuda"
    }

    fn token_shape(&self) -> [usize; 2] {
        self.token_shape
    }

    fn loss_and_grads(
        &mut self,
        params: &ParamSet,
        tokens: &[i32],
    ) -> Result<(f32, Vec<Vec<f32>>), StepError> {
        self.run(params, tokens, false)?;
        let grads = self.io.grads(params, |g| Ok(self.device.read_f32(g)?))?;
        Ok((self.read_loss()?, grads))
    }

    fn loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f32, StepError> {
        self.run(params, tokens, false)?;
        self.read_loss()
    }

    fn logits(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<Vec<f32>, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        if let CudaForward::Pending(lowered, ordinal) = &self.forward {
            let plan = forward_plan_for((**lowered).clone(), Target::Cuda)?;
            let device = CudaDevice::on(plan, *ordinal)?;
            let io = Interface::of(device.plan())?;
            self.forward = CudaForward::Ready(Box::new(device), Box::new(io), None);
        }
        let CudaForward::Ready(device, io, resident) = &mut self.forward else {
            let logits = self.io.logits.ok_or(StepError::MissingOutput { what: "logits" })?;
            self.run(params, tokens, false)?;
            return Ok(self.device.read_f32(logits)?);
        };
        if *resident != Some(params.version()) {
            for (name, buffer, _) in &io.params {
                let p = params.get(name).ok_or_else(|| StepError::UnknownParam { name: name.clone() })?;
                device.write_f32(*buffer, &p.value)?;
            }
            *resident = Some(params.version());
        }
        device.write_i32(io.tokens, tokens)?;
        let steps = 0..device.plan().steps.len();
        device.run_range(steps)?;
        let logits = io.logits.ok_or(StepError::MissingOutput { what: "logits" })?;
        Ok(device.read_f32(logits)?)
    }

    fn main_loss(&mut self, params: &ParamSet, tokens: &[i32]) -> Result<f64, StepError> {
        self.run(params, tokens, false)?;
        let id = self.device.find(&BufferRole::Output { name: "loss_main".into() });
        let id = id.ok_or(StepError::MissingOutput { what: "loss_main" })?;
        Ok(f64::from(first_loss(&self.device.read_f32(id)?)?))
    }

    /// With AdamW on every parameter the Plan runs the update; otherwise
    /// (Muon) the host does, from downloaded gradients.
    fn train_step(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
    ) -> Result<StepStats, StepError> {
        // Before the update's state is touched: a refused batch changes nothing.
        check_tokens(tokens, self.token_shape, self.vocab)?;
        if !self.update.as_ref().is_some_and(|u| u.takes(params, optimizer)) {
            return train_step_on_host(self, params, tokens, optimizer, settings);
        }
        let update = self.update.take().ok_or(StepError::MissingOutput { what: "optimizer update" })?;
        let result = self.train_step_in_plan(&update, params, tokens, optimizer, settings, None);
        self.update = Some(update);
        result
    }

    /// With AdamW on every parameter, the Plan's update after NCCL has
    /// averaged the loss and the gradients in the Plan's buffers, on the GPU
    /// ([`nccl::NcclComm::average`]); otherwise (Muon) the host's, from
    /// gradients downloaded and averaged over MPI.
    #[cfg(feature = "mpi")]
    fn train_step_averaged(
        &mut self,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
        group: &crate::dist::Group,
    ) -> Result<StepStats, StepError> {
        check_tokens(tokens, self.token_shape, self.vocab)?;
        if !self.update.as_ref().is_some_and(|u| u.takes(params, optimizer)) {
            return crate::step::host::train_step_on_host_averaged(
                self, params, tokens, optimizer, settings, group,
            );
        }
        let comm = self.nccl.take().ok_or(crate::dist::DistError::NcclNotJoined)?;
        let mut buffers: Vec<BufferId> = self.io.params.iter().filter_map(|(_, _, g)| *g).collect();
        buffers.push(self.io.loss);
        let average = |device: &mut CudaDevice| -> Result<(), StepError> {
            let started = std::time::Instant::now();
            // The all-reduces run on the stream: their time is measured to
            // their end, for the metrics' share of time in collectives. A
            // stuck peer would block that end forever; the world's watchdog
            // bounds it as it bounds MPI's own collectives.
            group.waiting_on_peers(|| -> Result<(), StepError> {
                comm.average(device, &buffers)?;
                Ok(device.synchronize()?)
            })?;
            group.add_reduce_time(started.elapsed());
            Ok(())
        };
        let update = self.update.take().ok_or(StepError::MissingOutput { what: "optimizer update" })?;
        let result = self.train_step_in_plan(&update, params, tokens, optimizer, settings, Some(&average));
        self.update = Some(update);
        self.nccl = Some(comm);
        result
    }

    fn sync_optimizer(&mut self, optimizer: &mut Optimizer) -> Result<(), StepError> {
        if !optimizer.moments_on_device() {
            return Ok(());
        }
        let held = self.held;
        let update = self.update.as_ref().ok_or(StepError::MomentsOnDevice)?;
        update.sync_moments(&mut self.device, optimizer, &held)
    }
}

impl CudaExecutor {
    /// A training step with the Plan's own update (`super::plan_update`). With
    /// `average` (a data-parallel step, docs/distributed.md) the Plan runs in
    /// two parts, its gradient steps and then its update steps, and `average`
    /// replaces the loss and the gradients in the Plan's buffers by their
    /// means across the ranks in between; the update reads the `loss` buffer
    /// to skip a non-finite step, so every rank decides alike.
    fn train_step_in_plan(
        &mut self,
        update: &PlanUpdate,
        params: &mut ParamSet,
        tokens: &[i32],
        optimizer: &mut Optimizer,
        settings: UpdateSettings,
        average: Option<&AverageInBuffers>,
    ) -> Result<StepStats, StepError> {
        let mut held = self.held.take();
        update.hold_moments(&mut self.device, optimizer, &mut held)?;
        update.write_values(&mut self.device, optimizer, settings)?;
        match average {
            None => self.run(params, tokens, true)?,
            Some(average) => {
                self.run(params, tokens, false)?;
                average(&mut self.device)?;
                let steps = self.device.plan().gradient_steps().end..self.device.plan().steps.len();
                self.device.run_range(steps)?;
            }
        }
        let loss = self.read_loss()?;
        let stats = update.finish(&mut self.device, loss, params, optimizer, &mut held)?;
        self.held = held;
        self.resident = Some(params.version());
        Ok(stats)
    }
}

/// What a data-parallel step runs between the Plan's gradient and update
/// steps: replaces the loss and the gradients in the device's buffers by their
/// means across the ranks.
type AverageInBuffers<'a> = dyn Fn(&mut CudaDevice) -> Result<(), StepError> + 'a;

impl PlanBuffers for CudaDevice {
    fn write_f32(&mut self, id: BufferId, data: &[f32]) -> Result<(), StepError> {
        Ok(CudaDevice::write_f32(self, id, data)?)
    }

    fn write_f64(&mut self, id: BufferId, data: &[f64]) -> Result<(), StepError> {
        Ok(CudaDevice::write_f64(self, id, data)?)
    }

    fn read_f32_into(&mut self, id: BufferId, out: &mut [f32]) -> Result<(), StepError> {
        let len = self.decl(id)?.len;
        if len != out.len() {
            return Err(CudaError::WrongLength { id: id.0, len, got: out.len() }.into());
        }
        let ptr = self.checked(id, DType::F32, len)?;
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // SAFETY: `ptr` addresses `len` f32 elements (checked); the stream is
        // synchronized before `out` is used.
        unsafe { drv::memcpy_dtoh_async(out, ptr, self.stream.cu_stream()) }
            .map_err(driver(format!("downloading buffer #{}", id.0)))?;
        self.stream.synchronize().map_err(driver(format!("downloading buffer #{}", id.0)))?;
        Ok(())
    }

    fn read_f64(&mut self, id: BufferId) -> Result<Vec<f64>, StepError> {
        Ok(CudaDevice::read_f64(self, id)?)
    }
}

/// The loop sees a Cuda failure as a device error (the step contract names no device).
impl From<CudaError> for StepError {
    fn from(e: CudaError) -> StepError {
        StepError::Device(Box::new(e))
    }
}

impl ReadsOutputs for CudaExecutor {
    fn read_output(&self, name: &str) -> Result<Vec<f32>, StepError> {
        let id = self
            .device
            .find(&BufferRole::Output { name: name.into() })
            .ok_or(StepError::MissingOutput { what: "step statistic" })?;
        Ok(self.device.read_f32(id)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_is_asked_for_by_any_value_but_empty_and_zero() {
        assert!(!sync_requested(None));
        assert!(!sync_requested(Some("")));
        assert!(!sync_requested(Some("0")));
        assert!(sync_requested(Some("1")));
        assert!(sync_requested(Some(" yes ")));
    }

    #[test]
    fn a_fault_names_the_kernel_and_its_step() {
        let c = fault_context("kernel `widen_g004_rmsnorm`", 17);
        assert_eq!(
            c,
            "kernel `widen_g004_rmsnorm` at Plan step 17 (synchronised after every operation, WIDEN_CUDA_SYNC=1)"
        );
    }
}
