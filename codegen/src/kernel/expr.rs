//! Typed scalar expressions of the kernel IR, with operator overloading so
//! kernels read like the math they implement.

use std::ops::{Add, Div, Mul, Neg, Not, Rem, Sub};

use ir::DType;

/// Scalar types of expressions and variables. Index arithmetic is `I64`;
/// `Bf16` buffers load and store as `F32` (see [`crate::kernel::Param`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Ty {
    F32,
    F64,
    I32,
    I64,
    Bool,
}

impl Ty {
    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Ty::F32 | Ty::F64)
    }

    /// Whether this is an integer type.
    pub fn is_int(self) -> bool {
        matches!(self, Ty::I32 | Ty::I64)
    }

    /// The arithmetic type of values loaded from a buffer of `dtype`.
    pub fn of_storage(dtype: DType) -> Ty {
        match dtype {
            DType::F32 | DType::Bf16 => Ty::F32,
            DType::F64 => Ty::F64,
            DType::I32 => Ty::I32,
        }
    }

    /// Short lowercase name, used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::F64 => "f64",
            Ty::I32 => "i32",
            Ty::I64 => "i64",
            Ty::Bool => "bool",
        }
    }
}

impl std::fmt::Display for Ty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A buffer that can be indexed: a kernel parameter or a local array.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Buf {
    Param { name: String, dtype: DType },
    Local { name: String, ty: Ty },
}

impl Buf {
    /// The buffer's name in the generated code.
    pub fn name(&self) -> &str {
        match self {
            Buf::Param { name, .. } | Buf::Local { name, .. } => name,
        }
    }

    /// The type of loaded values and of values stored into it.
    pub fn elem_ty(&self) -> Ty {
        match self {
            Buf::Param { dtype, .. } => Ty::of_storage(*dtype),
            Buf::Local { ty, .. } => *ty,
        }
    }

    /// `self[index]` as an expression.
    pub fn at(&self, index: impl Into<Expr>) -> Expr {
        Expr::Load { src: self.clone(), index: Box::new(index.into()) }
    }
}

/// Unary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum UnOp {
    Neg,
    /// Logical not of a `Bool`.
    Not,
}

/// Binary arithmetic and logical operators; both operands have the same type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    /// Integer remainder.
    Rem,
    /// Logical and of two `Bool`s.
    And,
    /// Logical or of two `Bool`s.
    Or,
}

/// Comparisons; both operands have the same type, the result is `Bool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum CmpOp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl CmpOp {
    /// Whether `a op b` holds for two integers.
    pub fn holds(self, a: i64, b: i64) -> bool {
        match self {
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
        }
    }
}

/// Math functions of float arguments, printed per type (`expf` / `exp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum MathFn {
    Exp,
    Log,
    Tanh,
    Sqrt,
    /// `1 / sqrt(x)`, printed as a division in both dialects so C and CUDA
    /// results agree (CUDA's `rsqrtf` is not correctly rounded).
    Rsqrt,
    Abs,
    Sin,
    Cos,
    Pow,
    Max,
    Min,
    /// The nearest bf16 value of an `f32`, as an `f32` (round to nearest even, NaN stays
    /// NaN): a cast to bf16 computed in registers (docs/math.md §6.12), printed through the
    /// renderer's `widen_f32_to_bf16` / `widen_bf16_to_f32` pair so it matches a bf16
    /// store and `ir::dtype::round_bf16` bit for bit.
    RoundBf16,
}

impl MathFn {
    /// Number of arguments.
    pub fn arity(self) -> usize {
        match self {
            MathFn::Pow | MathFn::Max | MathFn::Min => 2,
            MathFn::Exp
            | MathFn::Log
            | MathFn::Tanh
            | MathFn::Sqrt
            | MathFn::Rsqrt
            | MathFn::Abs
            | MathFn::Sin
            | MathFn::Cos
            | MathFn::RoundBf16 => 1,
        }
    }
}

/// A typed scalar expression.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Expr {
    F32(#[cfg_attr(feature = "serde", serde(with = "super::float_bits::f32"))] f32),
    F64(#[cfg_attr(feature = "serde", serde(with = "super::float_bits::f64"))] f64),
    I32(i32),
    I64(i64),
    Bool(bool),
    /// A variable declared by `Let`, `Var`, `For` or `BlockReduce`.
    Var {
        name: String,
        ty: Ty,
    },
    /// The grid index of the current item (`I64`).
    Item,
    /// The lane within the block of a block-per-item kernel (`I64`).
    Lane,
    Load {
        src: Buf,
        index: Box<Expr>,
    },
    Unary {
        op: UnOp,
        arg: Box<Expr>,
    },
    Binary {
        op: BinOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    Cmp {
        op: CmpOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    Select {
        cond: Box<Expr>,
        then: Box<Expr>,
        else_: Box<Expr>,
    },
    Cast {
        ty: Ty,
        arg: Box<Expr>,
    },
    Call {
        f: MathFn,
        args: Vec<Expr>,
    },
}

/// An `f32` literal.
pub fn f32(v: f32) -> Expr {
    Expr::F32(v)
}

/// An `f64` literal.
pub fn f64(v: f64) -> Expr {
    Expr::F64(v)
}

/// An `i32` literal.
pub fn i32(v: i32) -> Expr {
    Expr::I32(v)
}

/// An `i64` literal (index arithmetic).
pub fn i64(v: i64) -> Expr {
    Expr::I64(v)
}

/// The grid index of the current item.
pub fn item() -> Expr {
    Expr::Item
}

/// The lane of a block-per-item kernel.
pub fn lane() -> Expr {
    Expr::Lane
}

/// `cond ? then : else_`.
pub fn select(cond: impl Into<Expr>, then: impl Into<Expr>, else_: impl Into<Expr>) -> Expr {
    Expr::Select { cond: Box::new(cond.into()), then: Box::new(then.into()), else_: Box::new(else_.into()) }
}

impl Expr {
    /// Calls `f` on this expression and every sub-expression, parents first
    /// (load indices included).
    pub(crate) fn visit(&self, f: &mut impl FnMut(&Expr)) {
        f(self);
        match self {
            Expr::Load { index, .. } => index.visit(f),
            Expr::Unary { arg, .. } | Expr::Cast { arg, .. } => arg.visit(f),
            Expr::Binary { lhs, rhs, .. } | Expr::Cmp { lhs, rhs, .. } => {
                lhs.visit(f);
                rhs.visit(f);
            }
            Expr::Select { cond, then, else_ } => {
                cond.visit(f);
                then.visit(f);
                else_.visit(f);
            }
            Expr::Call { args, .. } => args.iter().for_each(|a| a.visit(f)),
            _ => {}
        }
    }

    /// This expression with every sub-expression `x` for which `f(x)` is
    /// `Some` replaced by it, outermost first (a replaced sub-expression is
    /// not searched further).
    pub(crate) fn rewrite(&self, f: &impl Fn(&Expr) -> Option<Expr>) -> Expr {
        if let Some(r) = f(self) {
            return r;
        }
        let b = |x: &Expr| Box::new(x.rewrite(f));
        match self {
            Expr::Load { src, index } => Expr::Load { src: src.clone(), index: b(index) },
            Expr::Unary { op, arg } => Expr::Unary { op: *op, arg: b(arg) },
            Expr::Cast { ty, arg } => Expr::Cast { ty: *ty, arg: b(arg) },
            Expr::Binary { op, lhs, rhs } => Expr::Binary { op: *op, lhs: b(lhs), rhs: b(rhs) },
            Expr::Cmp { op, lhs, rhs } => Expr::Cmp { op: *op, lhs: b(lhs), rhs: b(rhs) },
            Expr::Select { cond, then, else_ } => {
                Expr::Select { cond: b(cond), then: b(then), else_: b(else_) }
            }
            Expr::Call { f: func, args } => {
                Expr::Call { f: *func, args: args.iter().map(|a| a.rewrite(f)).collect() }
            }
            other => other.clone(),
        }
    }

    /// An integer literal's value (loop bounds, strides), else `None`.
    pub(crate) fn int_literal(&self) -> Option<i64> {
        match self {
            Expr::I64(v) => Some(*v),
            Expr::I32(v) => Some(i64::from(*v)),
            _ => None,
        }
    }

    /// The expression's type. For ill-typed expressions (caught by
    /// [`crate::kernel::Kernel::validate`]) this is the type of the first operand.
    pub fn ty(&self) -> Ty {
        match self {
            Expr::F32(_) => Ty::F32,
            Expr::F64(_) => Ty::F64,
            Expr::I32(_) => Ty::I32,
            Expr::I64(_) | Expr::Item | Expr::Lane => Ty::I64,
            Expr::Bool(_) | Expr::Cmp { .. } => Ty::Bool,
            Expr::Var { ty, .. } | Expr::Cast { ty, .. } => *ty,
            Expr::Load { src, .. } => src.elem_ty(),
            Expr::Unary { arg, .. } => arg.ty(),
            Expr::Binary { lhs, .. } => lhs.ty(),
            Expr::Select { then, .. } => then.ty(),
            Expr::Call { args, .. } => args.first().map_or(Ty::F32, Expr::ty),
        }
    }

    fn call(f: MathFn, args: Vec<Expr>) -> Expr {
        Expr::Call { f, args }
    }

    fn cmp(self, op: CmpOp, rhs: impl Into<Expr>) -> Expr {
        Expr::Cmp { op, lhs: Box::new(self), rhs: Box::new(rhs.into()) }
    }

    pub fn exp(self) -> Expr {
        Expr::call(MathFn::Exp, vec![self])
    }
    pub fn log(self) -> Expr {
        Expr::call(MathFn::Log, vec![self])
    }
    pub fn tanh(self) -> Expr {
        Expr::call(MathFn::Tanh, vec![self])
    }
    pub fn sqrt(self) -> Expr {
        Expr::call(MathFn::Sqrt, vec![self])
    }
    pub fn rsqrt(self) -> Expr {
        Expr::call(MathFn::Rsqrt, vec![self])
    }
    pub fn abs(self) -> Expr {
        Expr::call(MathFn::Abs, vec![self])
    }
    pub fn sin(self) -> Expr {
        Expr::call(MathFn::Sin, vec![self])
    }
    pub fn cos(self) -> Expr {
        Expr::call(MathFn::Cos, vec![self])
    }
    pub fn pow(self, e: impl Into<Expr>) -> Expr {
        Expr::call(MathFn::Pow, vec![self, e.into()])
    }
    /// `fmax`: the non-NaN operand if one is NaN.
    pub fn max(self, o: impl Into<Expr>) -> Expr {
        Expr::call(MathFn::Max, vec![self, o.into()])
    }
    /// `fmin`: the non-NaN operand if one is NaN.
    pub fn min(self, o: impl Into<Expr>) -> Expr {
        Expr::call(MathFn::Min, vec![self, o.into()])
    }
    /// The nearest bf16 value, kept as `f32` ([`MathFn::RoundBf16`]).
    pub fn round_bf16(self) -> Expr {
        Expr::call(MathFn::RoundBf16, vec![self])
    }
    pub fn lt(self, o: impl Into<Expr>) -> Expr {
        self.cmp(CmpOp::Lt, o)
    }
    pub fn le(self, o: impl Into<Expr>) -> Expr {
        self.cmp(CmpOp::Le, o)
    }
    pub fn gt(self, o: impl Into<Expr>) -> Expr {
        self.cmp(CmpOp::Gt, o)
    }
    pub fn ge(self, o: impl Into<Expr>) -> Expr {
        self.cmp(CmpOp::Ge, o)
    }
    pub fn eq_(self, o: impl Into<Expr>) -> Expr {
        self.cmp(CmpOp::Eq, o)
    }
    pub fn ne_(self, o: impl Into<Expr>) -> Expr {
        self.cmp(CmpOp::Ne, o)
    }
    /// Logical and of two `Bool`s.
    pub fn and(self, o: impl Into<Expr>) -> Expr {
        Expr::Binary { op: BinOp::And, lhs: Box::new(self), rhs: Box::new(o.into()) }
    }
    /// Logical or of two `Bool`s.
    pub fn or(self, o: impl Into<Expr>) -> Expr {
        Expr::Binary { op: BinOp::Or, lhs: Box::new(self), rhs: Box::new(o.into()) }
    }
    /// Numeric conversion (C cast semantics).
    pub fn cast(self, ty: Ty) -> Expr {
        Expr::Cast { ty, arg: Box::new(self) }
    }
}

impl From<f32> for Expr {
    fn from(v: f32) -> Expr {
        Expr::F32(v)
    }
}
impl From<f64> for Expr {
    fn from(v: f64) -> Expr {
        Expr::F64(v)
    }
}
impl From<i32> for Expr {
    fn from(v: i32) -> Expr {
        Expr::I32(v)
    }
}
impl From<i64> for Expr {
    fn from(v: i64) -> Expr {
        Expr::I64(v)
    }
}
impl From<bool> for Expr {
    fn from(v: bool) -> Expr {
        Expr::Bool(v)
    }
}
impl From<&Expr> for Expr {
    fn from(e: &Expr) -> Expr {
        e.clone()
    }
}

macro_rules! binop {
    ($trait:ident, $method:ident, $op:expr) => {
        impl<T: Into<Expr>> $trait<T> for Expr {
            type Output = Expr;
            fn $method(self, rhs: T) -> Expr {
                Expr::Binary { op: $op, lhs: Box::new(self), rhs: Box::new(rhs.into()) }
            }
        }
        impl<T: Into<Expr>> $trait<T> for &Expr {
            type Output = Expr;
            fn $method(self, rhs: T) -> Expr {
                self.clone().$method(rhs)
            }
        }
    };
}

binop!(Add, add, BinOp::Add);
binop!(Sub, sub, BinOp::Sub);
binop!(Mul, mul, BinOp::Mul);
binop!(Div, div, BinOp::Div);
binop!(Rem, rem, BinOp::Rem);

impl Neg for Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        Expr::Unary { op: UnOp::Neg, arg: Box::new(self) }
    }
}

impl Neg for &Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        -self.clone()
    }
}

/// Logical not of a `Bool`.
impl Not for Expr {
    type Output = Expr;
    fn not(self) -> Expr {
        Expr::Unary { op: UnOp::Not, arg: Box::new(self) }
    }
}
