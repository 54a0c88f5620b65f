//! Whole-kernel checks run before rendering, so a malformed kernel is a typed
//! error here instead of a C or NVRTC compile error later.

use std::collections::HashMap;

use thiserror::Error;

use super::{BinOp, Buf, Expr, Grid, Kernel, MathFn, Stmt, Ty, UnOp};

/// Why a kernel (or a module of kernels) cannot be rendered.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KernelError {
    #[error("kernel `{kernel}`: `{name}` is not a valid name: {reason}")]
    InvalidName { kernel: String, name: String, reason: &'static str },
    #[error("kernel `{kernel}`: `{name}` is declared twice in the same or an enclosing scope")]
    Duplicate { kernel: String, name: String },
    #[error("kernel `{kernel}`: `{name}` is used but not declared")]
    Undeclared { kernel: String, name: String },
    #[error("kernel `{kernel}`: {at}: expected {expected}, got {got}")]
    Type { kernel: String, at: String, expected: String, got: Ty },
    #[error("kernel `{kernel}`: `{name}` {what}")]
    Access { kernel: String, name: String, what: &'static str },
    #[error("kernel `{kernel}`: {what} is only allowed in block-per-item kernels")]
    BlockOnly { kernel: String, what: &'static str },
    #[error("kernel `{kernel}`: {what} must be a top-level statement of the body")]
    NotTopLevel { kernel: String, what: &'static str },
    #[error("kernel `{kernel}`: invalid grid: {reason}")]
    Grid { kernel: String, reason: String },
    #[error("kernel `{kernel}`: loop `{var}` has step {step}; the step must be positive")]
    Step { kernel: String, var: String, step: i64 },
    #[error("kernel `{kernel}`: {f:?} takes {expected} argument(s), got {got}")]
    Arity { kernel: String, f: MathFn, expected: usize, got: usize },
    #[error("kernel `{kernel}`: local array `{name}` has length 0")]
    EmptyArray { kernel: String, name: String },
    #[error("two kernels of one module are named `{name}`")]
    DuplicateKernel { name: String },
}

/// Names the renderers use themselves, plus C and CUDA keywords likely to
/// come out of a naming scheme.
const RESERVED: &[&str] = &[
    "item",
    "lane",
    "start",
    "end",
    "args",
    "auto",
    "break",
    "case",
    "char",
    "const",
    "continue",
    "default",
    "do",
    "double",
    "else",
    "enum",
    "extern",
    "float",
    "for",
    "goto",
    "if",
    "inline",
    "int",
    "long",
    "register",
    "restrict",
    "return",
    "short",
    "signed",
    "sizeof",
    "static",
    "struct",
    "switch",
    "typedef",
    "union",
    "unsigned",
    "void",
    "volatile",
    "while",
    "bool",
    "true",
    "false",
    "class",
    "new",
    "delete",
    "this",
    "template",
    "namespace",
];

fn check_name(kernel: &str, name: &str) -> Result<(), KernelError> {
    let err = |reason| Err(KernelError::InvalidName { kernel: kernel.into(), name: name.into(), reason });
    let mut chars = name.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return err("it must start with an ASCII letter or `_`"),
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return err("it must contain only ASCII letters, digits and `_`");
    }
    if name.starts_with("widen_") || name.starts_with("__") {
        return err("the prefixes `widen_` and `__` are reserved for generated code");
    }
    if RESERVED.contains(&name) {
        return err("it is a keyword or a name used by the generated code");
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Sym {
    Scalar { ty: Ty, mutable: bool },
    Array { ty: Ty },
}

struct Checker<'k> {
    k: &'k Kernel,
    scopes: Vec<HashMap<String, Sym>>,
}

impl Checker<'_> {
    fn name(&self) -> String {
        self.k.name.clone()
    }

    fn lookup(&self, name: &str) -> Option<Sym> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    fn declare(&mut self, name: &str, sym: Sym) -> Result<(), KernelError> {
        check_name(&self.k.name, name)?;
        if self.lookup(name).is_some() || self.k.params.iter().any(|p| p.name == name) {
            return Err(KernelError::Duplicate { kernel: self.name(), name: name.into() });
        }
        self.scopes.last_mut().expect("a scope is always open").insert(name.into(), sym);
        Ok(())
    }

    fn type_err(&self, at: &str, expected: impl Into<String>, got: Ty) -> KernelError {
        KernelError::Type { kernel: self.name(), at: at.into(), expected: expected.into(), got }
    }

    fn expect(&self, e: &Expr, ty: Ty, at: &str) -> Result<(), KernelError> {
        let got = self.expr(e)?;
        if got != ty {
            return Err(self.type_err(at, ty.name(), got));
        }
        Ok(())
    }

    /// Checks that `buf` names a declared parameter or array of the stated type.
    fn buf(&self, buf: &Buf, load: bool) -> Result<(), KernelError> {
        match buf {
            Buf::Param { name, dtype } => {
                let p = self
                    .k
                    .params
                    .iter()
                    .find(|p| &p.name == name)
                    .ok_or_else(|| KernelError::Undeclared { kernel: self.name(), name: name.clone() })?;
                if p.dtype != *dtype {
                    let at = format!("buffer `{name}`");
                    return Err(self.type_err(&at, p.dtype.name(), Ty::of_storage(*dtype)));
                }
                let (ok, what) = if load {
                    (p.access.readable(), "is write-only but is loaded from")
                } else {
                    (p.access.writable(), "is read-only but is stored to")
                };
                if !ok {
                    return Err(KernelError::Access { kernel: self.name(), name: name.clone(), what });
                }
                Ok(())
            }
            Buf::Local { name, ty } => match self.lookup(name) {
                Some(Sym::Array { ty: declared }) if declared == *ty => Ok(()),
                Some(Sym::Array { ty: declared }) => {
                    Err(self.type_err(&format!("local array `{name}`"), declared.name(), *ty))
                }
                _ => Err(KernelError::Undeclared { kernel: self.name(), name: name.clone() }),
            },
        }
    }

    fn expr(&self, e: &Expr) -> Result<Ty, KernelError> {
        Ok(match e {
            Expr::F32(_) | Expr::F64(_) | Expr::I32(_) | Expr::I64(_) | Expr::Bool(_) | Expr::Item => e.ty(),
            Expr::Lane => {
                if !self.k.grid.is_block() {
                    return Err(KernelError::BlockOnly { kernel: self.name(), what: "`lane`" });
                }
                Ty::I64
            }
            Expr::Var { name, ty } => match self.lookup(name) {
                Some(Sym::Scalar { ty: declared, .. }) if declared == *ty => *ty,
                Some(Sym::Scalar { ty: declared, .. }) => {
                    return Err(self.type_err(&format!("variable `{name}`"), declared.name(), *ty))
                }
                _ => return Err(KernelError::Undeclared { kernel: self.name(), name: name.clone() }),
            },
            Expr::Load { src, index } => {
                self.buf(src, true)?;
                self.expect(index, Ty::I64, &format!("index into `{}`", src.name()))?;
                src.elem_ty()
            }
            Expr::Unary { op, arg } => {
                let t = self.expr(arg)?;
                match op {
                    UnOp::Neg if t == Ty::Bool => return Err(self.type_err("negation", "a number", t)),
                    UnOp::Not if t != Ty::Bool => return Err(self.type_err("logical not", "bool", t)),
                    _ => t,
                }
            }
            Expr::Binary { op, lhs, rhs } => {
                let t = self.expr(lhs)?;
                self.expect(rhs, t, &format!("right operand of {op:?}"))?;
                let ok = match op {
                    BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div => t != Ty::Bool,
                    BinOp::Rem => t.is_int(),
                    BinOp::And | BinOp::Or => t == Ty::Bool,
                };
                if !ok {
                    return Err(self.type_err(
                        &format!("operands of {op:?}"),
                        "a type the operator accepts",
                        t,
                    ));
                }
                t
            }
            Expr::Cmp { op, lhs, rhs } => {
                let t = self.expr(lhs)?;
                self.expect(rhs, t, &format!("right operand of {op:?}"))?;
                Ty::Bool
            }
            Expr::Select { cond, then, else_ } => {
                self.expect(cond, Ty::Bool, "select condition")?;
                let t = self.expr(then)?;
                self.expect(else_, t, "select else-branch")?;
                t
            }
            Expr::Cast { ty, arg } => {
                self.expr(arg)?;
                *ty
            }
            Expr::Call { f, args } => {
                if args.len() != f.arity() {
                    let (expected, got) = (f.arity(), args.len());
                    return Err(KernelError::Arity { kernel: self.name(), f: *f, expected, got });
                }
                let t = self.expr(&args[0])?;
                if !t.is_float() {
                    return Err(self.type_err(&format!("argument of {f:?}"), "f32 or f64", t));
                }
                for a in &args[1..] {
                    self.expect(a, t, &format!("argument of {f:?}"))?;
                }
                t
            }
        })
    }

    fn block(&mut self, stmts: &[Stmt], top: bool) -> Result<(), KernelError> {
        self.scopes.push(HashMap::new());
        for s in stmts {
            self.stmt(s, top)?;
        }
        self.scopes.pop();
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt, top: bool) -> Result<(), KernelError> {
        match s {
            Stmt::Let { var, ty, expr } => {
                self.expect(expr, *ty, &format!("let `{var}`"))?;
                self.declare(var, Sym::Scalar { ty: *ty, mutable: false })
            }
            Stmt::Var { var, ty, init } => {
                self.expect(init, *ty, &format!("var `{var}`"))?;
                self.declare(var, Sym::Scalar { ty: *ty, mutable: true })
            }
            Stmt::Assign { var, value } => match self.lookup(var) {
                Some(Sym::Scalar { ty, mutable: true }) => {
                    self.expect(value, ty, &format!("assignment to `{var}`"))
                }
                Some(_) => Err(KernelError::Access {
                    kernel: self.name(),
                    name: var.clone(),
                    what: "is not a mutable variable but is assigned to",
                }),
                None => {
                    check_name(&self.k.name, var)?;
                    Err(KernelError::Undeclared { kernel: self.name(), name: var.clone() })
                }
            },
            Stmt::LocalArray { var, ty, len } => {
                if *len == 0 {
                    return Err(KernelError::EmptyArray { kernel: self.name(), name: var.clone() });
                }
                self.declare(var, Sym::Array { ty: *ty })
            }
            Stmt::Store { target, index, value } | Stmt::AccumStore { target, index, value } => {
                self.buf(target, false)?;
                if matches!(s, Stmt::AccumStore { .. }) {
                    self.buf(target, true)?;
                }
                self.expect(index, Ty::I64, &format!("index into `{}`", target.name()))?;
                self.expect(value, target.elem_ty(), &format!("value stored to `{}`", target.name()))
            }
            Stmt::For { var, start, end, step, body, .. } => {
                self.expect(start, Ty::I64, &format!("start of loop `{var}`"))?;
                self.expect(end, Ty::I64, &format!("end of loop `{var}`"))?;
                if *step <= 0 {
                    return Err(KernelError::Step { kernel: self.name(), var: var.clone(), step: *step });
                }
                self.scopes.push(HashMap::new());
                self.declare(var, Sym::Scalar { ty: Ty::I64, mutable: false })?;
                let r = self.block(body, false);
                self.scopes.pop();
                r
            }
            Stmt::If { cond, then, else_ } => {
                self.expect(cond, Ty::Bool, "if condition")?;
                self.block(then, false)?;
                self.block(else_, false)
            }
            Stmt::Comment(_) => Ok(()),
            Stmt::BlockReduce { var, value, .. } => {
                self.block_level("a block reduction", top)?;
                let ty = self.expr(value)?;
                if !ty.is_float() {
                    return Err(self.type_err(&format!("block reduction `{var}`"), "f32 or f64", ty));
                }
                self.declare(var, Sym::Scalar { ty, mutable: false })
            }
            Stmt::Barrier => self.block_level("a barrier", top),
        }
    }

    fn block_level(&self, what: &'static str, top: bool) -> Result<(), KernelError> {
        if !self.k.grid.is_block() {
            return Err(KernelError::BlockOnly { kernel: self.name(), what });
        }
        if !top {
            return Err(KernelError::NotTopLevel { kernel: self.name(), what });
        }
        Ok(())
    }
}

pub(super) fn validate(k: &Kernel) -> Result<(), KernelError> {
    check_name(&k.name, &k.name)?;
    let grid_err = |reason: String| Err(KernelError::Grid { kernel: k.name.clone(), reason });
    match k.grid {
        Grid::ThreadPerItem { block, .. } if block == 0 || block > 1024 || block % 32 != 0 => {
            return grid_err(format!("block size {block} must be a multiple of 32 in 32..=1024"));
        }
        Grid::BlockPerItem { threads, .. }
            if !(32..=1024).contains(&threads) || !threads.is_power_of_two() =>
        {
            return grid_err(format!("{threads} threads per item must be a power of two in 32..=1024"));
        }
        _ => {}
    }
    if i64::try_from(k.grid.items()).is_err() {
        return grid_err(format!("{} items do not fit in int64_t", k.grid.items()));
    }
    for (i, p) in k.params.iter().enumerate() {
        check_name(&k.name, &p.name)?;
        if k.params[..i].iter().any(|q| q.name == p.name) {
            return Err(KernelError::Duplicate { kernel: k.name.clone(), name: p.name.clone() });
        }
    }
    let mut c = Checker { k, scopes: Vec::new() };
    c.block(&k.body, true)
}
