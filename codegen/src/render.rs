//! One C-family printer with two dialects (docs/architecture.md §6).
//!
//! All kernels of a Plan become one translation unit. The output is stable
//! (no hashes, no addresses, fixed four-space indentation, one statement per
//! line) so it can be snapshot-tested and diffed.
//!
//! - **C**: each kernel is `void widen_<name>(<buffers>, int64_t start, int64_t end)`
//!   whose body runs the items `[start, end)` the runtime hands one thread,
//!   plus a uniform-ABI wrapper `void widen_<name>_entry(void** args, int64_t start, int64_t end)`
//!   (see [`crate::cc`]). Block-per-item kernels are lowered by loop fission:
//!   the top-level body is cut at barriers and block reductions into serial
//!   loops over the lanes, lane-local values that live across a cut become
//!   per-lane arrays, and reductions replay the CUDA tree order exactly.
//!   Thread-per-item kernels with several phases of arithmetic prefetch the
//!   next item's rows between them (see `next_item_prefetches`).
//! - **CUDA**: `extern "C" __global__` kernels with one thread (thread-per-item)
//!   or one block (block-per-item) per item and a bounds guard. No CUDA headers
//!   are included; the two bf16 conversion functions are emitted instead.
//!
//! Float literals are printed with Rust's shortest round-trip `{:e}` form
//! (`1.5e-3f`), so every constant in the source is bit-exact; infinities and
//! NaNs go through `WIDEN_INF_*` / `WIDEN_NAN_*` macros. `rsqrt` is printed
//! as `1.0f / sqrtf(x)` in both dialects so C and CUDA results stay close.

use std::collections::HashSet;
use std::fmt::Write as _;

use ir::DType;

use crate::kernel::{
    Access, BinOp, Buf, CmpOp, Combine, Expr, Grid, Kernel, KernelError, KernelParam, MathFn, Stmt, Ty, UnOp,
    Unroll,
};

/// The output language of the printer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// C11 for the system C compiler (CPU device).
    C,
    /// CUDA C++ for NVRTC (GPU device).
    Cuda,
}

/// Renders all `kernels` into one C translation unit.
pub fn render_c(kernels: &[Kernel]) -> Result<String, KernelError> {
    render_module(kernels, Dialect::C)
}

/// Renders all `kernels` into one CUDA translation unit.
pub fn render_cuda(kernels: &[Kernel]) -> Result<String, KernelError> {
    render_module(kernels, Dialect::Cuda)
}

/// Validates every kernel and renders them into one translation unit.
pub fn render_module(kernels: &[Kernel], dialect: Dialect) -> Result<String, KernelError> {
    let mut names = HashSet::new();
    for k in kernels {
        k.validate()?;
        if !names.insert(k.name.as_str()) {
            return Err(KernelError::DuplicateKernel { name: k.name.clone() });
        }
    }
    let mut p = Printer {
        out: String::new(),
        indent: 0,
        dialect,
        promoted: HashSet::new(),
        rounds_bf16: false,
        uses_expf: false,
        uses_tanhf: false,
        uses_prefetch: false,
    };
    for k in kernels {
        p.out.push('\n');
        p.kernel(k);
    }
    // The prelude goes first but depends on what the kernels print (bf16 rounding).
    let body = std::mem::take(&mut p.out);
    p.prelude(kernels);
    p.out.push_str(&body);
    Ok(p.out)
}

/// Threads of a CUDA warp: a block of this many lanes reduces by shuffles.
const WARP: u32 = 32;

const C_PRELUDE: &str = "#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)
";

const CUDA_PRELUDE: &str = "#define WIDEN_INF_F32 __int_as_float(0x7f800000)
#define WIDEN_NAN_F32 __int_as_float(0x7fc00000)
#define WIDEN_INF_F64 __longlong_as_double(0x7ff0000000000000LL)
#define WIDEN_NAN_F64 __longlong_as_double(0x7ff8000000000000LL)
";

/// bf16 <-> f32 with round-to-nearest-even; NaNs stay (quiet) NaNs. `widen_round_bf16`
/// below is the in-register cast to bf16 of mixed precision (docs/math.md §6.12).
const C_BF16: &str = "
static inline float widen_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t widen_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((v.u >> 16) | 0x40u);
    }
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
";

/// The in-register cast to bf16 (`MathFn::RoundBf16`), emitted only where a kernel uses it.
const C_ROUND_BF16: &str = "
static inline float widen_round_bf16(float f) {
    return widen_bf16_to_f32(widen_f32_to_bf16(f));
}
";

/// f32 `exp` for the C dialect, written so the C compiler vectorizes loops
/// that call it (a libm call keeps a loop scalar, and softmax, SiLU, sigmoid
/// and Sinkhorn are exp-bound): `exp(x) = 2^n * exp(r)` with `n = round(x /
/// ln 2)` (round-to-nearest by the 1.5 * 2^23 shift), `r = x - n ln 2` in two
/// parts (Cody and Waite), the Cephes degree-7 polynomial for `exp(r)` on
/// `|r| <= ln(2) / 2` evaluated with fused multiply-adds where the target
/// has them (`WIDEN_FMA`: `fmaf`, one rounding a step, a quarter faster than
/// separate products and sums, which `-ffp-contract=off` keeps apart
/// elsewhere, and no less accurate; without hardware FMA, where `fmaf` would
/// be a library call per element, a product and a sum), and
/// `2^n` applied as two exact powers of two so results
/// down to the subnormal range and up to overflow come out right. Within 1 ulp
/// of a correctly rounded `expf` for every normal result (checked against the
/// reference executor's exp over a sweep by `codegen/tests/cc_driver.rs`); NaN
/// stays NaN, `exp(+inf) = inf`, `exp(-inf) = 0`. The CUDA dialect keeps the
/// device library's `expf`.
///
/// Always inlined (`WIDEN_INLINE`): as a plain `static inline`, GCC stops inlining
/// it once a file's growth limit is reached, and in a Plan with many exp loops (the
/// chunk kernels of the fused vocabulary loss) the later loops called it once per
/// element, unvectorized, at a quarter of the inlined rate.
const C_EXPF: &str = "
#if defined(__GNUC__) || defined(__clang__)
#define WIDEN_INLINE static inline __attribute__((always_inline))
#else
#define WIDEN_INLINE static inline
#endif

#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define WIDEN_FMA(a, b, c) fmaf(a, b, c)
#else
#define WIDEN_FMA(a, b, c) ((a) * (b) + (c))
#endif

WIDEN_INLINE float widen_pow2i(int32_t k) {
    union { int32_t i; float f; } v;
    v.i = (k + 127) << 23;
    return v.f;
}

WIDEN_INLINE float widen_expf(float x) {
    const float c = x < -104.0f ? -104.0f : x > 89.0f ? 89.0f : x == x ? x : 0.0f;
    const float shifter = 12582912.0f;
    const float n = (c * 1.44269504088896341f + shifter) - shifter;
    const float r = WIDEN_FMA(-n, 1.42860682030941723212e-6f, WIDEN_FMA(-n, 6.93145751953125e-1f, c));
    float p = 1.9875691500e-4f;
    p = WIDEN_FMA(p, r, 1.3981999507e-3f);
    p = WIDEN_FMA(p, r, 8.3334519073e-3f);
    p = WIDEN_FMA(p, r, 4.1665795894e-2f);
    p = WIDEN_FMA(p, r, 1.6666665459e-1f);
    p = WIDEN_FMA(p, r, 5.0000001201e-1f);
    p = WIDEN_FMA(p, r * r, r) + 1.0f;
    const int32_t k = (int32_t)n;
    const int32_t half = k >> 1;
    const float e = p * widen_pow2i(half) * widen_pow2i(k - half);
    return x == x ? e : x;
}
";

/// f32 `tanh` for the C dialect, vectorizable like [`C_EXPF`] (tanh gates
/// the dynamic HC and GHC coefficients, docs/math.md §2.3, §5.5): the Cephes odd
/// polynomial below |x| = 0.625 (in fused multiply-adds where the target has
/// them, as `exp`'s), `1 - 2 / (exp(2|x|) + 1)` above it (which
/// reaches exactly 1 once the exponential overflows), the sign restored with
/// `copysignf` so -0 stays -0 and NaN stays NaN. Within 2 ulp of a correctly
/// rounded `tanhf` (`codegen/tests/cc_driver.rs`).
const C_TANHF: &str = "
WIDEN_INLINE float widen_tanhf(float x) {
    const float a = fabsf(x);
    const float z = a * a;
    float q = WIDEN_FMA(-5.70498872745e-3f, z, 2.06390887954e-2f);
    q = WIDEN_FMA(q, z, -5.37397155531e-2f);
    q = WIDEN_FMA(q, z, 1.33314422036e-1f);
    q = WIDEN_FMA(q, z, -3.33332819422e-1f);
    const float small = WIDEN_FMA(q * z, a, a);
    const float big = 1.0f - 2.0f / (widen_expf(2.0f * a) + 1.0f);
    return copysignf(a < 0.625f ? small : big, x);
}
";

const CUDA_BF16: &str = "
static __device__ __forceinline__ float widen_bf16_to_f32(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}

static __device__ __forceinline__ unsigned short widen_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
";

const CUDA_ROUND_BF16: &str = "
static __device__ __forceinline__ float widen_round_bf16(float f) {
    return widen_bf16_to_f32(widen_f32_to_bf16(f));
}
";

/// Fetches the cache lines of bytes `[from, to)` of `row` into the cache
/// ahead of their use (see [`next_item_prefetches`]); nothing where the
/// compiler lacks the builtin. A hint: it never faults and changes no value.
const C_PREFETCH: &str = "
static inline void widen_prefetch(const void* row, int64_t from, int64_t to) {
#if defined(__GNUC__) || defined(__clang__)
    const char* p = (const char*)row;
    for (int64_t b = from; b < to; b += 64) {
        __builtin_prefetch(p + b, 0, 3);
    }
#else
    (void)row;
    (void)from;
    (void)to;
#endif
}
";

/// Bytes per cache line, the unit of a prefetch.
const LINE_BYTES: usize = 64;

/// Fewest top-level loops an item body needs before its next item's rows
/// are prefetched: the phases the prefetches are spread over. Kernels with
/// fewer, such as a norm or an elementwise epilogue, stream their rows with
/// little arithmetic in between, and the hardware prefetcher already keeps up
/// with them; a burst of software prefetches there only queues behind it.
const PREFETCH_MIN_PHASES: usize = 4;

/// Fewest FLOPs per byte moved (the kernel's parameters, read plus written)
/// for the next item's rows to be prefetched: below it an item's arithmetic
/// is too short to hide their loads behind, and the prefetches only add to a
/// stream the hardware already runs (xHC's write-back, 0.37 FLOP/byte, got
/// slower with them; every kernel from 0.6 FLOP/byte up got faster, and
/// between the two, at 0.41 to 0.48, they helped or changed nothing).
const PREFETCH_MIN_INTENSITY: f64 = 0.4;

/// A byte range of the next item's row of one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RowPrefetch {
    param: String,
    /// Elements per item: the next item's row starts at `(item + 1) * row`.
    row: usize,
    from: usize,
    to: usize,
}

/// The C dialect's prefetch schedule of a thread-per-item kernel: one group
/// of byte ranges after each top-level loop of the item body, together the
/// next item's row of every read parameter laid out item by item (length a
/// multiple of the item count, a row of at least a cache line), in the order
/// the body first loads them, split over the loops by their work (FLOPs,
/// loads and stores), so the lines go out at an even rate in time. Empty
/// where the body has fewer than [`PREFETCH_MIN_PHASES`] loops or the kernel
/// does less than [`PREFETCH_MIN_INTENSITY`] arithmetic per byte.
///
/// Why: a fused per-token kernel loads an item's rows, then computes on them
/// for about as long as the loads took, and the two do not overlap: the
/// hardware prefetcher follows a stream only while it is being read, and
/// out-of-order execution does not reach past an item's arithmetic. Measured
/// on VWN's largest gradient kernel (2 threads, operands in memory), the
/// time was the sum of the two; fetched a share per phase, the next item's
/// rows arrive while this item computes, in a harness and in training
/// steps. Fetching them all at the item's start changed nothing: the burst
/// waits on the cache's miss buffers as the demand loads did.
fn next_item_prefetches(k: &Kernel) -> Vec<Vec<RowPrefetch>> {
    let Grid::ThreadPerItem { n, .. } = k.grid else { return Vec::new() };
    let phases = k.body.iter().filter(|s| matches!(s, Stmt::For { .. })).count();
    let (read, written) = k.param_bytes();
    let intensity = k.flops().0 as f64 / (read + written).max(1) as f64;
    if n < 2 || phases < PREFETCH_MIN_PHASES || intensity < PREFETCH_MIN_INTENSITY {
        return Vec::new();
    }
    // Parameters in the order the body first loads them.
    let mut first_loads: Vec<String> = Vec::new();
    crate::kernel::each_expr(&k.body, &mut |e| {
        e.visit(&mut |x| {
            if let Expr::Load { src: Buf::Param { name, .. }, .. } = x {
                if !first_loads.contains(name) {
                    first_loads.push(name.clone());
                }
            }
        })
    });
    let rows: Vec<(&KernelParam, usize)> = first_loads
        .iter()
        .filter_map(|name| k.params.iter().find(|p| &p.name == name))
        .filter(|p| p.access.readable() && p.len % n == 0)
        .map(|p| (p, p.len / n))
        .filter(|(p, row)| row * p.dtype.size_bytes() >= LINE_BYTES)
        .collect();
    // (parameter, row length, first byte, end byte) of each line of the rows.
    let lines: Vec<(&KernelParam, usize, usize, usize)> = rows
        .iter()
        .flat_map(|&(p, row)| {
            let bytes = row * p.dtype.size_bytes();
            (0..bytes.div_ceil(LINE_BYTES))
                .map(move |l| (p, row, l * LINE_BYTES, bytes.min((l + 1) * LINE_BYTES)))
        })
        .collect();
    if lines.is_empty() {
        return Vec::new();
    }
    // After each loop, the lines its share of the item's work has paid for,
    // so the prefetches go out at an even rate in time.
    let work: Vec<u64> =
        k.body.iter().filter(|s| matches!(s, Stmt::For { .. })).map(crate::kernel::stmt_work).collect();
    let total = work.iter().sum::<u64>().max(1);
    let mut done = 0u64;
    let mut issued = 0;
    work.iter()
        .map(|&w| {
            done += w;
            let upto = (lines.len() as u128 * u128::from(done)).div_ceil(u128::from(total)) as usize;
            let chunk = &lines[issued..upto.min(lines.len())];
            issued = upto.min(lines.len());
            // Consecutive lines of one parameter become one range.
            let mut group: Vec<RowPrefetch> = Vec::new();
            for &(p, row, from, to) in chunk {
                match group.last_mut() {
                    Some(last) if last.param == p.name && last.to == from => last.to = to,
                    _ => group.push(RowPrefetch { param: p.name.clone(), row, from, to }),
                }
            }
            group
        })
        .collect()
}

/// C operator precedence (lower binds tighter); used to print minimal parentheses.
const ATOM: u8 = 0;
const UNARY: u8 = 2;

struct Printer {
    out: String,
    indent: usize,
    dialect: Dialect,
    /// C block-per-item kernels: lane-local names stored as per-lane arrays.
    promoted: HashSet<String>,
    /// Whether a printed expression rounds to bf16, so the prelude needs the conversions.
    rounds_bf16: bool,
    /// Whether a C kernel calls `widen_expf`, so the prelude defines it.
    uses_expf: bool,
    /// Whether a C kernel calls `widen_tanhf` (which calls `widen_expf`).
    uses_tanhf: bool,
    /// Whether a C kernel prefetches its next item's rows (`widen_prefetch`).
    uses_prefetch: bool,
}

impl Printer {
    fn line(&mut self, text: &str) {
        for _ in 0..self.indent {
            self.out.push_str("    ");
        }
        self.out.push_str(text);
        self.out.push('\n');
    }

    fn open(&mut self, text: &str) {
        self.line(text);
        self.indent += 1;
    }

    fn close(&mut self) {
        self.indent -= 1;
        self.line("}");
    }

    fn cuda(&self) -> bool {
        self.dialect == Dialect::Cuda
    }

    fn prelude(&mut self, kernels: &[Kernel]) {
        let dialect = if self.cuda() { "CUDA" } else { "C" };
        let _ = writeln!(
            self.out,
            "/* widen: {} kernel(s), {dialect} dialect. Generated; do not edit. */",
            kernels.len()
        );
        self.out.push_str(if self.cuda() { CUDA_PRELUDE } else { C_PRELUDE });
        if self.rounds_bf16 || kernels.iter().any(|k| k.params.iter().any(|p| p.dtype == DType::Bf16)) {
            self.out.push_str(if self.cuda() { CUDA_BF16 } else { C_BF16 });
        }
        if self.rounds_bf16 {
            self.out.push_str(if self.cuda() { CUDA_ROUND_BF16 } else { C_ROUND_BF16 });
        }
        if self.uses_expf || self.uses_tanhf {
            self.out.push_str(C_EXPF);
        }
        if self.uses_tanhf {
            self.out.push_str(C_TANHF);
        }
        if self.uses_prefetch {
            self.out.push_str(C_PREFETCH);
        }
    }

    fn ty(&self, t: Ty) -> &'static str {
        match (t, self.dialect) {
            (Ty::F32, _) => "float",
            (Ty::F64, _) => "double",
            (Ty::I32, Dialect::C) => "int32_t",
            (Ty::I32, Dialect::Cuda) => "int",
            (Ty::I64, Dialect::C) => "int64_t",
            (Ty::I64, Dialect::Cuda) => "long long",
            (Ty::Bool, Dialect::C) => "_Bool",
            (Ty::Bool, Dialect::Cuda) => "bool",
        }
    }

    fn storage(&self, d: DType) -> &'static str {
        match (d, self.dialect) {
            (DType::Bf16, Dialect::C) => "uint16_t",
            (DType::Bf16, Dialect::Cuda) => "unsigned short",
            (d, _) => self.ty(Ty::of_storage(d)),
        }
    }

    fn param_decl(&self, p: &KernelParam) -> String {
        let konst = if p.access == Access::Read { "const " } else { "" };
        let restrict = if self.cuda() { "__restrict__" } else { "restrict" };
        format!("{konst}{}* {restrict} {}", self.storage(p.dtype), p.name)
    }

    fn kernel(&mut self, k: &Kernel) {
        let grid = match k.grid {
            Grid::ThreadPerItem { n, block } => {
                format!("{n} items, one thread per item (CUDA block {block})")
            }
            Grid::BlockPerItem { n, threads } => format!("{n} items, one block of {threads} lanes per item"),
        };
        self.line(&format!("/* {}: {grid} */", k.name));
        let mut params: Vec<String> = k.params.iter().map(|p| self.param_decl(p)).collect();
        if self.cuda() {
            self.cuda_kernel(k, &params.join(", "));
        } else {
            params.push("int64_t start".into());
            params.push("int64_t end".into());
            self.c_kernel(k, &params.join(", "));
            self.out.push('\n');
            self.c_entry(k);
        }
    }

    fn c_kernel(&mut self, k: &Kernel, params: &str) {
        self.open(&format!("void {}({params}) {{", k.symbol()));
        self.open("for (int64_t item = start; item < end; ++item) {");
        match k.grid {
            Grid::ThreadPerItem { .. } => {
                let mut schedule = next_item_prefetches(k).into_iter();
                for s in &k.body {
                    self.stmt(s);
                    if matches!(s, Stmt::For { .. }) {
                        self.prefetch_group(&schedule.next().unwrap_or_default());
                    }
                }
            }
            Grid::BlockPerItem { threads, .. } => self.c_fission(&k.body, threads),
        }
        self.close();
        self.close();
    }

    /// One phase boundary's share of the next item's rows (see
    /// [`next_item_prefetches`]), guarded so the last item of a range reads
    /// nothing past it.
    fn prefetch_group(&mut self, group: &[RowPrefetch]) {
        if group.is_empty() {
            return;
        }
        self.uses_prefetch = true;
        self.open("if (item + 1 < end) {");
        for r in group {
            self.line(&format!(
                "widen_prefetch({} + (item + 1) * {}, {}, {});",
                r.param, r.row, r.from, r.to
            ));
        }
        self.close();
    }

    fn c_entry(&mut self, k: &Kernel) {
        self.open(&format!("void {}(void** args, int64_t start, int64_t end) {{", k.entry_symbol()));
        let args: Vec<String> = k
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let konst = if p.access == Access::Read { "const " } else { "" };
                format!("({konst}{}*)args[{i}]", self.storage(p.dtype))
            })
            .chain(["start".to_string(), "end".to_string()])
            .collect();
        self.line(&format!("{}({});", k.symbol(), args.join(", ")));
        self.close();
    }

    fn cuda_kernel(&mut self, k: &Kernel, params: &str) {
        let threads = k.grid.block_threads();
        self.open(&format!(
            "extern \"C\" __global__ void __launch_bounds__({threads}) {}({params}) {{",
            k.symbol()
        ));
        match k.grid {
            Grid::ThreadPerItem { n, .. } => {
                self.line("const long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x;");
                self.line(&format!("if (item >= {n}) return;"));
            }
            Grid::BlockPerItem { n, .. } => {
                for t in reduction_types(&k.body).into_iter().filter(|_| threads > WARP) {
                    self.line(&format!("__shared__ {} widen_red_{}[{threads}];", self.ty(t), t.name()));
                }
                self.line("const long long item = blockIdx.x;");
                self.line("const long long lane = threadIdx.x;");
                self.line(&format!("if (item >= {n}) return;"));
            }
        }
        for s in &k.body {
            match s {
                Stmt::Barrier => self.line("__syncthreads();"),
                Stmt::BlockReduce { var, op, value } if threads == WARP => {
                    // The same tree as the shared-memory one below (lane `l`
                    // adds lane `l + s`'s value, `s` halving), by shuffles; the
                    // warp barrier orders the lanes' memory accesses as a block
                    // reduction's barriers do.
                    let t = value.ty();
                    let (ty, v) = (self.ty(t), self.expr(value).0);
                    let w = format!("{var}_warp");
                    self.line("__syncwarp();");
                    self.line(&format!("{ty} {w} = {v};"));
                    self.open(&format!("for (int widen_s = {}; widen_s > 0; widen_s >>= 1) {{", WARP / 2));
                    let other = format!("__shfl_down_sync(0xffffffffu, {w}, widen_s)");
                    let combined = self.combine(*op, t, &w, &other);
                    self.line(&format!("{w} = {combined};"));
                    self.close();
                    self.line(&format!("const {ty} {var} = __shfl_sync(0xffffffffu, {w}, 0);"));
                }
                Stmt::BlockReduce { var, op, value } => {
                    let t = value.ty();
                    let red = format!("widen_red_{}", t.name());
                    let v = self.expr(value).0;
                    self.line(&format!("{red}[lane] = {v};"));
                    self.line("__syncthreads();");
                    self.open(&format!("for (int widen_s = {}; widen_s > 0; widen_s >>= 1) {{", threads / 2));
                    self.open("if (lane < widen_s) {");
                    let combined =
                        self.combine(*op, t, &format!("{red}[lane]"), &format!("{red}[lane + widen_s]"));
                    self.line(&format!("{red}[lane] = {combined};"));
                    self.close();
                    self.line("__syncthreads();");
                    self.close();
                    self.line(&format!("const {} {var} = {red}[0];", self.ty(t)));
                    self.line("__syncthreads();");
                }
                s => self.stmt(s),
            }
        }
        self.close();
    }

    fn combine(&self, op: Combine, t: Ty, a: &str, b: &str) -> String {
        match op {
            Combine::Sum => format!("{a} + {b}"),
            Combine::Max => format!("{}({a}, {b})", math_name(MathFn::Max, t)),
        }
    }

    /// Loop fission of a block-per-item body for C (docs/architecture.md §6).
    fn c_fission(&mut self, body: &[Stmt], threads: u32) {
        let mut segments: Vec<(&[Stmt], Option<&Stmt>)> = Vec::new();
        let mut begin = 0;
        for (i, s) in body.iter().enumerate() {
            if matches!(s, Stmt::Barrier | Stmt::BlockReduce { .. }) {
                segments.push((&body[begin..i], Some(s)));
                begin = i + 1;
            }
        }
        segments.push((&body[begin..], None));

        // Lane-local declarations referenced after the cut that ends their segment.
        let mut promoted = Vec::new();
        for (i, (seg, _)) in segments.iter().enumerate() {
            let mut later = HashSet::new();
            for (rest, cut) in &segments[i + 1..] {
                crate::kernel::collect_refs(rest, &mut later);
                if let Some(Stmt::BlockReduce { value, .. }) = cut {
                    crate::kernel::expr_refs(value, &mut later);
                }
            }
            for s in *seg {
                match s {
                    Stmt::Let { var, ty, .. } | Stmt::Var { var, ty, .. } if later.contains(var) => {
                        promoted.push(format!("{} {var}[{threads}];", self.ty(*ty)));
                        self.promoted.insert(var.clone());
                    }
                    Stmt::LocalArray { var, ty, len } if later.contains(var) => {
                        promoted.push(format!("{} {var}[{threads}][{len}];", self.ty(*ty)));
                        self.promoted.insert(var.clone());
                    }
                    _ => {}
                }
            }
        }
        for t in reduction_types(body) {
            promoted.push(format!("{} widen_red_{}[{threads}];", self.ty(t), t.name()));
        }
        for decl in &promoted {
            self.line(decl);
        }

        for (seg, cut) in segments {
            let reduced = match cut {
                Some(Stmt::BlockReduce { value, .. }) => Some(value),
                _ => None,
            };
            if !seg.is_empty() || reduced.is_some() {
                self.open(&format!("for (int64_t lane = 0; lane < {threads}; ++lane) {{"));
                self.stmts(seg);
                if let Some(value) = reduced {
                    let v = self.expr(value).0;
                    self.line(&format!("widen_red_{}[lane] = {v};", value.ty().name()));
                }
                self.close();
            }
            match cut {
                Some(Stmt::Barrier) => self.line("/* barrier */"),
                Some(Stmt::BlockReduce { var, op, value }) => {
                    let t = value.ty();
                    let red = format!("widen_red_{}", t.name());
                    self.open(&format!(
                        "for (int64_t widen_s = {}; widen_s > 0; widen_s >>= 1) {{",
                        threads / 2
                    ));
                    self.open("for (int64_t lane = 0; lane < widen_s; ++lane) {");
                    let combined =
                        self.combine(*op, t, &format!("{red}[lane]"), &format!("{red}[lane + widen_s]"));
                    self.line(&format!("{red}[lane] = {combined};"));
                    self.close();
                    self.close();
                    self.line(&format!("const {} {var} = {red}[0];", self.ty(t)));
                }
                _ => {}
            }
        }
        self.promoted.clear();
    }

    fn stmts(&mut self, stmts: &[Stmt]) {
        for s in stmts {
            self.stmt(s);
        }
    }

    fn place(&self, var: &str) -> String {
        if self.promoted.contains(var) {
            format!("{var}[lane]")
        } else {
            var.to_string()
        }
    }

    fn element(&mut self, buf: &Buf, index: &Expr) -> String {
        let i = self.expr(index).0;
        format!("{}[{i}]", self.place(buf.name()))
    }

    fn stmt(&mut self, s: &Stmt) {
        match s {
            Stmt::Let { var, ty, expr } | Stmt::Var { var, ty, init: expr } => {
                let e = self.expr(expr).0;
                if self.promoted.contains(var) {
                    self.line(&format!("{var}[lane] = {e};"));
                } else {
                    let konst = if matches!(s, Stmt::Let { .. }) { "const " } else { "" };
                    self.line(&format!("{konst}{} {var} = {e};", self.ty(*ty)));
                }
            }
            Stmt::Assign { var, value } => {
                let e = self.expr(value).0;
                self.line(&format!("{} = {e};", self.place(var)));
            }
            Stmt::LocalArray { var, ty, len } => {
                if !self.promoted.contains(var) {
                    self.line(&format!("{} {var}[{len}];", self.ty(*ty)));
                }
            }
            Stmt::Store { target, index, value } => {
                let dst = self.element(target, index);
                let v = self.expr(value).0;
                if is_bf16(target) {
                    self.line(&format!("{dst} = widen_f32_to_bf16({v});"));
                } else {
                    self.line(&format!("{dst} = {v};"));
                }
            }
            Stmt::AccumStore { target, index, value } => {
                let dst = self.element(target, index);
                if is_bf16(target) {
                    let v = self.wrap(value, 4);
                    self.line(&format!("{dst} = widen_f32_to_bf16(widen_bf16_to_f32({dst}) + {v});"));
                } else {
                    let v = self.expr(value).0;
                    self.line(&format!("{dst} += {v};"));
                }
            }
            Stmt::For { var, start, end, step, unroll, body } => {
                match (unroll, self.cuda()) {
                    (Unroll::Auto, _) => {}
                    (Unroll::Full, true) => self.line("#pragma unroll"),
                    (Unroll::Full, false) => self.line("#pragma GCC unroll 64"),
                    (Unroll::Never, true) => self.line("#pragma unroll 1"),
                    (Unroll::Never, false) => self.line("#pragma GCC unroll 1"),
                }
                let (s, e) = (self.expr(start).0, self.wrap(end, 6));
                let inc = if *step == 1 { format!("++{var}") } else { format!("{var} += {step}") };
                self.open(&format!("for ({} {var} = {s}; {var} < {e}; {inc}) {{", self.ty(Ty::I64)));
                self.stmts(body);
                self.close();
            }
            Stmt::If { cond, then, else_ } => {
                let c = self.expr(cond).0;
                self.open(&format!("if ({c}) {{"));
                self.stmts(then);
                if !else_.is_empty() {
                    self.indent -= 1;
                    self.open("} else {");
                    self.stmts(else_);
                }
                self.close();
            }
            Stmt::Comment(text) => {
                let text = text.replace("*/", "* /").replace(['\n', '\r'], " ");
                self.line(&format!("/* {text} */"));
            }
            // Only reachable at the top level of block kernels, handled by
            // `cuda_kernel` and `c_fission`; validation guarantees it.
            Stmt::BlockReduce { .. } | Stmt::Barrier => {}
        }
    }

    /// `e` printed so it can appear as an operand of an operator of
    /// precedence `prec` (parenthesized when it binds less tightly).
    fn wrap(&mut self, e: &Expr, prec: u8) -> String {
        let (s, p) = self.expr(e);
        if p >= prec {
            format!("({s})")
        } else {
            s
        }
    }

    /// Prints an expression and returns it with its C precedence.
    fn expr(&mut self, e: &Expr) -> (String, u8) {
        match e {
            Expr::F32(v) => float_lit(f64::from(*v), format!("{v:e}f"), "F32"),
            Expr::F64(v) => float_lit(*v, format!("{v:e}"), "F64"),
            Expr::I32(v) if *v == i32::MIN => ("(-2147483647 - 1)".into(), ATOM),
            Expr::I64(v) if *v == i64::MIN => ("(-9223372036854775807LL - 1)".into(), ATOM),
            Expr::I32(v) => (v.to_string(), if *v < 0 { UNARY } else { ATOM }),
            Expr::I64(v) => {
                let s = if i32::try_from(*v).is_ok() { v.to_string() } else { format!("{v}LL") };
                (s, if *v < 0 { UNARY } else { ATOM })
            }
            Expr::Bool(b) => ((if *b { "1" } else { "0" }).into(), ATOM),
            Expr::Var { name, .. } => (self.place(name), ATOM),
            Expr::Item => ("item".into(), ATOM),
            Expr::Lane => ("lane".into(), ATOM),
            Expr::Load { src, index } => {
                let el = self.element(src, index);
                if is_bf16(src) {
                    (format!("widen_bf16_to_f32({el})"), ATOM)
                } else {
                    (el, ATOM)
                }
            }
            Expr::Unary { op, arg } => {
                let a = self.wrap(arg, UNARY);
                let sym = if *op == UnOp::Neg { "-" } else { "!" };
                (format!("{sym}{a}"), UNARY)
            }
            Expr::Binary { op, lhs, rhs } => {
                let (sym, prec) = match op {
                    BinOp::Mul => ("*", 3),
                    BinOp::Div => ("/", 3),
                    BinOp::Rem => ("%", 3),
                    BinOp::Add => ("+", 4),
                    BinOp::Sub => ("-", 4),
                    BinOp::And => ("&&", 11),
                    BinOp::Or => ("||", 12),
                };
                // Two int literals would be computed in `int`: force 64 bits.
                let l = match (&**lhs, &**rhs) {
                    (Expr::I64(a), Expr::I64(_)) if *a != i64::MIN => format!("{a}LL"),
                    _ => self.wrap(lhs, prec + 1),
                };
                let r = self.wrap(rhs, prec);
                (format!("{l} {sym} {r}"), prec)
            }
            Expr::Cmp { op, lhs, rhs } => {
                let (sym, prec) = match op {
                    CmpOp::Lt => ("<", 6),
                    CmpOp::Le => ("<=", 6),
                    CmpOp::Gt => (">", 6),
                    CmpOp::Ge => (">=", 6),
                    CmpOp::Eq => ("==", 7),
                    CmpOp::Ne => ("!=", 7),
                };
                let (l, r) = (self.wrap(lhs, prec + 1), self.wrap(rhs, prec));
                (format!("{l} {sym} {r}"), prec)
            }
            Expr::Select { cond, then, else_ } => {
                let c = self.wrap(cond, 13);
                let t = self.wrap(then, 13);
                let f = self.wrap(else_, 14);
                (format!("{c} ? {t} : {f}"), 13)
            }
            Expr::Cast { ty, arg } => {
                let a = self.wrap(arg, UNARY + 1);
                (format!("({}){a}", self.ty(*ty)), UNARY)
            }
            Expr::Call { f, args } => {
                let t = e.ty();
                let a: Vec<String> = args.iter().map(|a| self.expr(a).0).collect();
                self.rounds_bf16 |= *f == MathFn::RoundBf16;
                if *f == MathFn::Exp && t == Ty::F32 && !self.cuda() {
                    self.uses_expf = true;
                    return (format!("widen_expf({})", a[0]), ATOM);
                }
                if *f == MathFn::Tanh && t == Ty::F32 && !self.cuda() {
                    self.uses_tanhf = true;
                    return (format!("widen_tanhf({})", a[0]), ATOM);
                }
                if *f == MathFn::Rsqrt {
                    let one = if t == Ty::F32 { "1.0f" } else { "1.0" };
                    return (format!("{one} / {}({})", math_name(MathFn::Sqrt, t), a[0]), 3);
                }
                (format!("{}({})", math_name(*f, t), a.join(", ")), ATOM)
            }
        }
    }
}

/// A finite literal as printed, or the dialect's macro for inf/nan (`kind` is `F32`/`F64`).
fn float_lit(v: f64, finite: String, kind: &str) -> (String, u8) {
    let s = if v.is_nan() {
        format!("WIDEN_NAN_{kind}")
    } else if v.is_infinite() {
        let sign = if v < 0.0 { "-" } else { "" };
        format!("{sign}WIDEN_INF_{kind}")
    } else {
        finite
    };
    let prec = if s.starts_with('-') { UNARY } else { ATOM };
    (s, prec)
}

fn math_name(f: MathFn, t: Ty) -> String {
    let base = match f {
        MathFn::Exp => "exp",
        MathFn::Log => "log",
        MathFn::Tanh => "tanh",
        MathFn::Sqrt | MathFn::Rsqrt => "sqrt",
        MathFn::Abs => "fabs",
        MathFn::Sin => "sin",
        MathFn::Cos => "cos",
        MathFn::Pow => "pow",
        MathFn::Max => "fmax",
        MathFn::Min => "fmin",
        // f32 only, defined with the bf16 conversions (no per-type suffix).
        MathFn::RoundBf16 => return "widen_round_bf16".to_string(),
    };
    if t == Ty::F32 {
        format!("{base}f")
    } else {
        base.to_string()
    }
}

fn is_bf16(b: &Buf) -> bool {
    matches!(b, Buf::Param { dtype: DType::Bf16, .. })
}

/// The value types of the block reductions of a body, in a fixed order.
fn reduction_types(body: &[Stmt]) -> Vec<Ty> {
    let used: HashSet<Ty> = body
        .iter()
        .filter_map(|s| if let Stmt::BlockReduce { value, .. } = s { Some(value.ty()) } else { None })
        .collect();
    [Ty::F32, Ty::F64].into_iter().filter(|t| used.contains(t)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{f32, item, KernelBuilder};

    /// A per-token kernel like the fused connection kernels: `loops` phases,
    /// each reading a 256-float row of `x` and writing a 256-float row; with
    /// `madds > 0`, from the second phase on, also a 24-float row of `w` and a
    /// shared 64-float gain, and `madds` multiply-adds per element (none: a
    /// copy).
    fn per_token(loops: usize, madds: usize) -> Kernel {
        let n = 8;
        let mut k = KernelBuilder::new("phases", Grid::thread_per_item(n));
        let gain = k.param("gain", DType::F32, Access::Read, 64);
        let x = k.param("x", DType::F32, Access::Read, n * 256);
        let w = k.param("w", DType::F32, Access::Read, n * 24);
        let y = k.param("y", DType::F32, Access::Write, n * 256);
        for phase in 0..loops {
            let (x, w, y, gain) = (x.clone(), w.clone(), y.clone(), gain.clone());
            k.for_(&format!("e{phase}"), 0i64, 256i64, |b, e| {
                let mut v = x.at(item() * 256i64 + e.clone());
                if phase > 0 && madds > 0 {
                    v = v * w.at(item() * 24i64 + 3i64) + gain.at(5i64);
                }
                for _ in 0..madds {
                    v = v * f32(0.5) + f32(0.25);
                }
                b.store(&y, item() * 256i64 + e, v);
            });
        }
        k.finish()
    }

    #[test]
    fn the_next_items_rows_are_fetched_once_in_first_load_order_over_the_phases() {
        let k = per_token(5, 4);
        let groups = next_item_prefetches(&k);
        assert_eq!(groups.len(), 5, "one group a phase");
        // x's 1 KiB row is 16 lines, w's 96 bytes 2 (the second one clipped to
        // the row); the gain is shared by all items and is not a row.
        let lines: Vec<(String, usize, usize)> = groups
            .iter()
            .flatten()
            .flat_map(|r| (r.from..r.to).step_by(LINE_BYTES).map(move |b| (r.param.clone(), r.row, b)))
            .collect();
        let want: Vec<(String, usize, usize)> = (0..16)
            .map(|l| ("x".to_string(), 256, l * LINE_BYTES))
            .chain((0..2).map(|l| ("w".to_string(), 24, l * LINE_BYTES)))
            .collect();
        assert_eq!(lines, want);
        assert_eq!(groups.iter().flatten().last().map(|r| r.to), Some(96), "w's last line ends at its row");
        // 18 lines by the phases' work: the first phase loads, multiplies and
        // stores 10 times an element, the others 14 (w, the gain and a
        // multiply-add more), so after each phase ceil(18 * done / 66) lines
        // are out: 3, 7, 11, 15, 18.
        let per: Vec<usize> =
            groups.iter().map(|g| g.iter().map(|r| (r.to - r.from).div_ceil(LINE_BYTES)).sum()).collect();
        assert_eq!(per, [3, 4, 4, 4, 3]);
    }

    #[test]
    fn short_or_light_kernels_and_block_kernels_prefetch_nothing() {
        assert!(next_item_prefetches(&per_token(PREFETCH_MIN_PHASES - 1, 4)).is_empty(), "too few phases");
        assert!(next_item_prefetches(&per_token(5, 0)).is_empty(), "no arithmetic to hide loads behind");
        let mut block = per_token(5, 4);
        block.grid = Grid::block_per_item(8, 32);
        assert!(next_item_prefetches(&block).is_empty(), "block-per-item");
    }

    #[test]
    fn prefetches_print_in_c_only_guarded_by_the_items_range() {
        let k = per_token(5, 4);
        let c = render_c(std::slice::from_ref(&k)).unwrap();
        assert!(c.contains("static inline void widen_prefetch("), "{c}");
        assert_eq!(c.matches("if (item + 1 < end) {").count(), 5, "{c}");
        assert!(c.contains("widen_prefetch(x + (item + 1) * 256, 0, 192);"), "{c}");
        assert!(c.contains("widen_prefetch(w + (item + 1) * 24, 0, 96);"), "{c}");
        let cuda = render_cuda(&[k]).unwrap();
        assert!(!cuda.contains("prefetch"), "{cuda}");
        let plain = render_c(&[per_token(2, 4)]).unwrap();
        assert!(!plain.contains("prefetch"), "no helper without a prefetching kernel");
    }
}
