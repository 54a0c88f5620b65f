//! One C-family printer with two dialects (DESIGN.md §6).
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
    Access, BinOp, Buf, CmpOp, Expr, Grid, Kernel, KernelError, MathFn, Param, ReduceOp, Stmt, Ty, UnOp,
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
/// below is the in-register cast to bf16 of mixed precision (MATH.md §6.12).
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
/// `|r| <= ln(2) / 2`, and `2^n` applied as two exact powers of two so results
/// down to the subnormal range and up to overflow come out right. Within 1 ulp
/// of a correctly rounded `expf` for every normal result (checked against the
/// reference executor's exp over a sweep by `codegen/tests/cc_driver.rs`); NaN
/// stays NaN, `exp(+inf) = inf`, `exp(-inf) = 0`. The CUDA dialect keeps the
/// device library's `expf`.
const C_EXPF: &str = "
static inline float widen_pow2i(int32_t k) {
    union { int32_t i; float f; } v;
    v.i = (k + 127) << 23;
    return v.f;
}

static inline float widen_expf(float x) {
    const float c = x < -104.0f ? -104.0f : x > 89.0f ? 89.0f : x == x ? x : 0.0f;
    const float shifter = 12582912.0f;
    const float n = (c * 1.44269504088896341f + shifter) - shifter;
    const float r = (c - n * 6.93145751953125e-1f) - n * 1.42860682030941723212e-6f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t k = (int32_t)n;
    const int32_t half = k >> 1;
    const float e = p * widen_pow2i(half) * widen_pow2i(k - half);
    return x == x ? e : x;
}
";

/// f32 `tanh` for the C dialect, vectorizable like [`C_EXPF`] (tanh gates
/// the dynamic HC and GHC coefficients, MATH.md §2.3, §5.5): the Cephes odd
/// polynomial below |x| = 0.625, `1 - 2 / (exp(2|x|) + 1)` above it (which
/// reaches exactly 1 once the exponential overflows), the sign restored with
/// `copysignf` so -0 stays -0 and NaN stays NaN. Within 2 ulp of a correctly
/// rounded `tanhf` (`codegen/tests/cc_driver.rs`).
const C_TANHF: &str = "
static inline float widen_tanhf(float x) {
    const float a = fabsf(x);
    const float z = a * a;
    const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z
        + 1.33314422036e-1f) * z - 3.33332819422e-1f) * z * a + a;
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

    fn param_decl(&self, p: &Param) -> String {
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
            Grid::ThreadPerItem { .. } => self.stmts(&k.body),
            Grid::BlockPerItem { threads, .. } => self.c_fission(&k.body, threads),
        }
        self.close();
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
                for t in reduction_types(&k.body) {
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

    fn combine(&self, op: ReduceOp, t: Ty, a: &str, b: &str) -> String {
        match op {
            ReduceOp::Sum => format!("{a} + {b}"),
            ReduceOp::Max => format!("{}({a}, {b})", math_name(MathFn::Max, t)),
        }
    }

    /// Loop fission of a block-per-item body for C (DESIGN.md §6).
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
                if *unroll {
                    self.line(if self.cuda() { "#pragma unroll" } else { "#pragma GCC unroll 64" });
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
