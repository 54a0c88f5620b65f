//! The kernel IR: a small structured AST with concrete sizes (docs/architecture.md §6).
//!
//! A [`Kernel`] is a list of typed buffer parameters, a 1-D launch [`Grid`] and
//! a body of [`Stmt`]s. The body describes the work of **one item** of the
//! grid (a token, a row or an element); the renderers in [`crate::render`]
//! wrap it in the dialect's iteration scheme (a `[start, end)` loop in C, one
//! thread or one block per item in CUDA). Sizes are compile-time constants
//! because a Plan is compiled for its shapes.
//!
//! Expressions are self-typed ([`Expr::ty`]) so the printer can pick literal
//! suffixes and math functions by type (`expf` for f32, `exp` for f64);
//! [`Kernel::validate`] checks the whole kernel (scopes, types, access modes,
//! grid-specific constructs) before anything is rendered.
//!
//! Kernels are usually written with [`KernelBuilder`]:
//!
//! ```
//! use codegen::kernel::{f32, item, Access, Grid, KernelBuilder};
//! use ir::DType;
//!
//! let mut k = KernelBuilder::new("scale", Grid::thread_per_item(1024));
//! let x = k.param("x", DType::F32, Access::Read, 1024);
//! let y = k.param("y", DType::F32, Access::Write, 1024);
//! let v = k.let_("v", x.at(item()) * f32(2.0));
//! k.store(&y, item(), v);
//! let kernel = k.finish();
//! assert!(kernel.validate().is_ok());
//! ```

mod builder;
mod counts;
mod expr;
mod loop_fusion;
mod simplify_indices;
mod split;
mod spread;
mod validate;

pub use builder::{Block, KernelBuilder};
pub use expr::{f32, f64, i32, i64, item, lane, select, BinOp, Buf, CmpOp, Expr, MathFn, Ty, UnOp};
pub use loop_fusion::fuse_loops;
pub use simplify_indices::simplify_indices;
pub use split::split_loops;
pub use spread::{spread_over_lanes, LANES as SPREAD_LANES};
pub use validate::KernelError;

pub(crate) use counts::stmt_work;

/// Floats in serialized Plans travel as their IEEE bit patterns: JSON has no
/// infinities or NaNs (masking constants are `-inf`), and a Plan read back must
/// be bit for bit the one compiled (`runtime::standalone::codec`).
#[cfg(feature = "serde")]
pub(crate) mod float_bits {
    /// An `f32` as its bit pattern.
    pub mod f32 {
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_u32(v.to_bits())
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
            u32::deserialize(d).map(f32::from_bits)
        }
    }

    /// An `f64` as its bit pattern.
    pub mod f64 {
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_u64(v.to_bits())
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
            u64::deserialize(d).map(f64::from_bits)
        }
    }
}

use std::collections::{HashMap, HashSet};

use ir::DType;

/// How a kernel uses a buffer parameter. Renderers mark read-only buffers
/// `const`; validation rejects loads from write-only and stores to read-only
/// buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Access {
    Read,
    Write,
    ReadWrite,
    /// Written, and read back only where the same item wrote it first: a
    /// fused kernel's value that a later op of the kernel also reads. Loads
    /// and stores are allowed as for `ReadWrite`, but the kernel moves only
    /// the writes to memory (its reads hit what it just wrote), which is what
    /// the cost counts ([`Access::reads_memory`]).
    WriteThenRead,
}

impl Access {
    /// Whether loads from the buffer are allowed.
    pub fn readable(self) -> bool {
        !matches!(self, Access::Write)
    }

    /// Whether stores to the buffer are allowed.
    pub fn writable(self) -> bool {
        !matches!(self, Access::Read)
    }

    /// Whether the kernel reads the buffer's contents from memory: values it
    /// did not write itself.
    pub fn reads_memory(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }
}

/// One buffer parameter. Buffers never alias (the memory planner guarantees
/// it), which is why the renderers mark them `restrict`.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct KernelParam {
    pub name: String,
    /// Storage type. `Bf16` is storage only: loads widen to f32 and stores
    /// round to nearest even (docs/math.md §6.12 keeps arithmetic in f32).
    pub dtype: DType,
    pub access: Access,
    /// Length in elements; the runtime allocates and checks it.
    pub len: usize,
}

impl KernelParam {
    /// The buffer handle used to load from and store to this parameter.
    pub fn buf(&self) -> Buf {
        Buf::Param { name: self.name.clone(), dtype: self.dtype }
    }
}

/// The 1-D launch grid over `n` items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Grid {
    /// Items are independent; each item is processed by one thread. In C each
    /// runtime thread runs the items of its `[start, end)` range; in CUDA one
    /// GPU thread per item, `block` threads per block, with a bounds guard.
    ThreadPerItem { n: usize, block: u32 },
    /// Each item is processed by a cooperating block of `threads` lanes that
    /// may use [`Stmt::Barrier`] and [`Stmt::BlockReduce`]. In CUDA one block
    /// per item; in C the body is split at barriers into serial loops over the
    /// lanes (loop fission, docs/architecture.md §6), so the same index math runs on CPU.
    BlockPerItem { n: usize, threads: u32 },
}

impl Grid {
    /// Default CUDA block size of thread-per-item kernels.
    pub const DEFAULT_BLOCK: u32 = 256;

    /// A thread-per-item grid with the default block size.
    pub fn thread_per_item(n: usize) -> Grid {
        Grid::ThreadPerItem { n, block: Self::DEFAULT_BLOCK }
    }

    /// A block-per-item grid with `threads` lanes per item (a power of two in
    /// 32..=1024, so the block reduction tree is exact).
    pub fn block_per_item(n: usize, threads: u32) -> Grid {
        Grid::BlockPerItem { n, threads }
    }

    /// Number of items.
    pub fn items(&self) -> usize {
        match *self {
            Grid::ThreadPerItem { n, .. } | Grid::BlockPerItem { n, .. } => n,
        }
    }

    /// CUDA threads per block.
    pub fn block_threads(&self) -> u32 {
        match *self {
            Grid::ThreadPerItem { block, .. } => block,
            Grid::BlockPerItem { threads, .. } => threads,
        }
    }

    /// CUDA blocks to launch: `ceil(n / block)` thread-per-item, `n` block-per-item.
    pub fn cuda_blocks(&self) -> usize {
        match *self {
            Grid::ThreadPerItem { n, block } => n.div_ceil(block as usize),
            Grid::BlockPerItem { n, .. } => n,
        }
    }

    /// Whether this is a block-per-item grid (lanes, barriers, block reductions).
    pub fn is_block(&self) -> bool {
        matches!(self, Grid::BlockPerItem { .. })
    }
}

/// A block-wide reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Combine {
    Sum,
    Max,
}

/// A statement of the body of one item.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Stmt {
    /// Immutable scalar: `const T var = expr;`.
    Let {
        var: String,
        ty: Ty,
        expr: Expr,
    },
    /// Mutable scalar: `T var = init;`, updated with [`Stmt::Assign`].
    Var {
        var: String,
        ty: Ty,
        init: Expr,
    },
    /// `var = value;` for a variable declared with [`Stmt::Var`].
    Assign {
        var: String,
        value: Expr,
    },
    /// Per-item scratch array with a compile-time length: `T var[len];`.
    LocalArray {
        var: String,
        ty: Ty,
        len: usize,
    },
    /// `target[index] = value;`
    Store {
        target: Buf,
        index: Expr,
        value: Expr,
    },
    /// `target[index] += value;`
    AccumStore {
        target: Buf,
        index: Expr,
        value: Expr,
    },
    /// `for (int64_t var = start; var < end; var += step)`; `unroll` is what
    /// the compiler is asked to do with it.
    For {
        var: String,
        start: Expr,
        end: Expr,
        step: i64,
        unroll: Unroll,
        body: Vec<Stmt>,
    },
    If {
        cond: Expr,
        then: Vec<Stmt>,
        else_: Vec<Stmt>,
    },
    Comment(String),
    /// Block-per-item only, top level only: every lane contributes `value`,
    /// every lane gets the reduction in the new immutable `var`.
    BlockReduce {
        var: String,
        op: Combine,
        value: Expr,
    },
    /// Block-per-item only, top level only: all lanes finish the statements
    /// before it before any lane starts the statements after it.
    Barrier,
}

/// What a loop asks of the compiler's unrolling (a pragma before the loop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Unroll {
    /// No request: the compiler decides.
    #[default]
    Auto,
    /// Unroll completely (small stream/segment axes, docs/architecture.md §5).
    Full,
    /// Keep it a loop: a loop over one vector's lanes, which the compiler
    /// then vectorizes as the innermost loop. Unrolled into the enclosing
    /// loop's body, GCC vectorized the enclosing loop instead, reading each
    /// lane with a permute ([`crate::emit`]'s folds of many rows at once).
    Never,
}

/// One kernel: the unit the renderers print and the runtime launches.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Kernel {
    /// Identifier; the rendered function is `widen_<name>`.
    pub name: String,
    pub params: Vec<KernelParam>,
    pub grid: Grid,
    pub body: Vec<Stmt>,
}

impl Kernel {
    /// Total length (elements) of the per-item local arrays the body declares.
    pub fn local_elements(&self) -> usize {
        fn walk(stmts: &[Stmt]) -> usize {
            stmts
                .iter()
                .map(|s| match s {
                    Stmt::LocalArray { len, .. } => *len,
                    Stmt::For { body, .. } => walk(body),
                    Stmt::If { then, else_, .. } => walk(then) + walk(else_),
                    _ => 0,
                })
                .sum()
        }
        walk(&self.body)
    }

    /// The name of the generated function.
    pub fn symbol(&self) -> String {
        format!("widen_{}", self.name)
    }

    /// The name of the generated uniform-ABI wrapper (see [`crate::cc`]).
    pub fn entry_symbol(&self) -> String {
        format!("widen_{}_entry", self.name)
    }

    /// Checks names, scopes, types, access modes and grid-specific constructs.
    pub fn validate(&self) -> Result<(), KernelError> {
        validate::validate(self)
    }

    /// What the kernel computes, independent of its name, of the names of its
    /// parameters and variables, and of comments: two kernels with equal keys
    /// do the same work on buffers bound by position, so a Plan keeps one of
    /// them (each layer of a deep model lowers to kernels that differ only in
    /// the graph node ids their parameters and variables are named after).
    pub fn structure_key(&self) -> String {
        // Every name in order of declaration gets a fresh positional one; the
        // renaming is injective, so it keeps the computation.
        let mut names: HashMap<String, String> = HashMap::new();
        for p in &self.params {
            let fresh = format!("#{}", names.len());
            names.entry(p.name.clone()).or_insert(fresh);
        }
        declared_names(&self.body, &mut names);
        let params: Vec<KernelParam> =
            self.params.iter().map(|p| KernelParam { name: names[&p.name].clone(), ..p.clone() }).collect();
        let body = renamed(&self.body, &names);
        format!("{:?}|{params:?}|{body:?}", self.grid)
    }
}

/// Adds every name `stmts` declare, in order, to `names` with a fresh positional name.
fn declared_names(stmts: &[Stmt], names: &mut HashMap<String, String>) {
    for s in stmts {
        if let Stmt::Let { var, .. }
        | Stmt::Var { var, .. }
        | Stmt::LocalArray { var, .. }
        | Stmt::BlockReduce { var, .. }
        | Stmt::For { var, .. } = s
        {
            let fresh = format!("#{}", names.len());
            names.entry(var.clone()).or_insert(fresh);
        }
        match s {
            Stmt::For { body, .. } => declared_names(body, names),
            Stmt::If { then, else_, .. } => {
                declared_names(then, names);
                declared_names(else_, names);
            }
            _ => {}
        }
    }
}

/// `stmts` without comments, every name (variable or buffer) replaced by its
/// entry in `names`.
pub(crate) fn renamed(stmts: &[Stmt], names: &HashMap<String, String>) -> Vec<Stmt> {
    let name = |n: &String| names.get(n).cloned().unwrap_or_else(|| n.clone());
    let buf = |b: &Buf| match b {
        Buf::Param { name: n, dtype } => Buf::Param { name: name(n), dtype: *dtype },
        Buf::Local { name: n, ty } => Buf::Local { name: name(n), ty: *ty },
    };
    fn expr(e: &Expr, names: &HashMap<String, String>) -> Expr {
        let name = |n: &String| names.get(n).cloned().unwrap_or_else(|| n.clone());
        e.rewrite(&|x| match x {
            Expr::Var { name: n, ty } => Some(Expr::Var { name: name(n), ty: *ty }),
            Expr::Load { src, index } => {
                let src = match src {
                    Buf::Param { name: n, dtype } => Buf::Param { name: name(n), dtype: *dtype },
                    Buf::Local { name: n, ty } => Buf::Local { name: name(n), ty: *ty },
                };
                Some(Expr::Load { src, index: Box::new(expr(index, names)) })
            }
            _ => None,
        })
    }
    let e = |x: &Expr| expr(x, names);
    stmts
        .iter()
        .filter(|s| !matches!(s, Stmt::Comment(_)))
        .map(|s| match s {
            Stmt::Let { var, ty, expr } => Stmt::Let { var: name(var), ty: *ty, expr: e(expr) },
            Stmt::Var { var, ty, init } => Stmt::Var { var: name(var), ty: *ty, init: e(init) },
            Stmt::Assign { var, value } => Stmt::Assign { var: name(var), value: e(value) },
            Stmt::LocalArray { var, ty, len } => Stmt::LocalArray { var: name(var), ty: *ty, len: *len },
            Stmt::Store { target, index, value } => {
                Stmt::Store { target: buf(target), index: e(index), value: e(value) }
            }
            Stmt::AccumStore { target, index, value } => {
                Stmt::AccumStore { target: buf(target), index: e(index), value: e(value) }
            }
            Stmt::For { var, start, end, step, unroll, body } => Stmt::For {
                var: name(var),
                start: e(start),
                end: e(end),
                step: *step,
                unroll: *unroll,
                body: renamed(body, names),
            },
            Stmt::If { cond, then, else_ } => {
                Stmt::If { cond: e(cond), then: renamed(then, names), else_: renamed(else_, names) }
            }
            Stmt::BlockReduce { var, op, value } => {
                Stmt::BlockReduce { var: name(var), op: *op, value: e(value) }
            }
            Stmt::Comment(_) | Stmt::Barrier => s.clone(),
        })
        .collect()
}

/// Every name `stmts` declare, at any depth.
pub(crate) fn collect_declared(stmts: &[Stmt], out: &mut HashSet<String>) {
    for s in stmts {
        match s {
            Stmt::Let { var, .. }
            | Stmt::Var { var, .. }
            | Stmt::LocalArray { var, .. }
            | Stmt::BlockReduce { var, .. } => {
                out.insert(var.clone());
            }
            Stmt::For { var, body, .. } => {
                out.insert(var.clone());
                collect_declared(body, out);
            }
            Stmt::If { then, else_, .. } => {
                collect_declared(then, out);
                collect_declared(else_, out);
            }
            _ => {}
        }
    }
}

/// Every variable and buffer name `stmts` mention (reads, writes, loop bounds).
pub(crate) fn collect_refs(stmts: &[Stmt], out: &mut HashSet<String>) {
    for s in stmts {
        match s {
            Stmt::Let { expr, .. } | Stmt::Var { init: expr, .. } => expr_refs(expr, out),
            Stmt::Assign { var, value } => {
                out.insert(var.clone());
                expr_refs(value, out);
            }
            Stmt::Store { target, index, value } | Stmt::AccumStore { target, index, value } => {
                out.insert(target.name().to_string());
                expr_refs(index, out);
                expr_refs(value, out);
            }
            Stmt::For { start, end, body, .. } => {
                expr_refs(start, out);
                expr_refs(end, out);
                collect_refs(body, out);
            }
            Stmt::If { cond, then, else_ } => {
                expr_refs(cond, out);
                collect_refs(then, out);
                collect_refs(else_, out);
            }
            Stmt::BlockReduce { value, .. } => expr_refs(value, out),
            Stmt::LocalArray { .. } | Stmt::Comment(_) | Stmt::Barrier => {}
        }
    }
}

/// Every expression of `stmts` (loop bounds, conditions, indices, values).
pub(crate) fn each_expr(stmts: &[Stmt], f: &mut impl FnMut(&Expr)) {
    for s in stmts {
        match s {
            Stmt::Let { expr, .. } | Stmt::Var { init: expr, .. } | Stmt::Assign { value: expr, .. } => {
                f(expr)
            }
            Stmt::BlockReduce { value, .. } => f(value),
            Stmt::Store { index, value, .. } | Stmt::AccumStore { index, value, .. } => {
                f(index);
                f(value);
            }
            Stmt::For { start, end, body, .. } => {
                f(start);
                f(end);
                each_expr(body, f);
            }
            Stmt::If { cond, then, else_ } => {
                f(cond);
                each_expr(then, f);
                each_expr(else_, f);
            }
            Stmt::LocalArray { .. } | Stmt::Comment(_) | Stmt::Barrier => {}
        }
    }
}

/// `stmts` with [`Expr::rewrite`] applied to every expression.
pub(crate) fn rewrite_stmts(stmts: &[Stmt], f: &impl Fn(&Expr) -> Option<Expr>) -> Vec<Stmt> {
    stmts
        .iter()
        .map(|s| match s {
            Stmt::Let { var, ty, expr } => Stmt::Let { var: var.clone(), ty: *ty, expr: expr.rewrite(f) },
            Stmt::Var { var, ty, init } => Stmt::Var { var: var.clone(), ty: *ty, init: init.rewrite(f) },
            Stmt::Assign { var, value } => Stmt::Assign { var: var.clone(), value: value.rewrite(f) },
            Stmt::Store { target, index, value } => {
                Stmt::Store { target: target.clone(), index: index.rewrite(f), value: value.rewrite(f) }
            }
            Stmt::AccumStore { target, index, value } => {
                Stmt::AccumStore { target: target.clone(), index: index.rewrite(f), value: value.rewrite(f) }
            }
            Stmt::For { var, start, end, step, unroll, body } => Stmt::For {
                var: var.clone(),
                start: start.rewrite(f),
                end: end.rewrite(f),
                step: *step,
                unroll: *unroll,
                body: rewrite_stmts(body, f),
            },
            Stmt::If { cond, then, else_ } => Stmt::If {
                cond: cond.rewrite(f),
                then: rewrite_stmts(then, f),
                else_: rewrite_stmts(else_, f),
            },
            Stmt::BlockReduce { var, op, value } => {
                Stmt::BlockReduce { var: var.clone(), op: *op, value: value.rewrite(f) }
            }
            s @ (Stmt::LocalArray { .. } | Stmt::Comment(_) | Stmt::Barrier) => s.clone(),
        })
        .collect()
}

/// Every variable and buffer name `e` reads.
pub(crate) fn expr_refs(e: &Expr, out: &mut HashSet<String>) {
    e.visit(&mut |x| match x {
        Expr::Var { name, .. } => {
            out.insert(name.clone());
        }
        Expr::Load { src, .. } => {
            out.insert(src.name().to_string());
        }
        _ => {}
    });
}
