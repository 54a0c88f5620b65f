//! A builder that keeps hand-written and generated kernels concise. It does
//! no checking of its own: [`Kernel::validate`](super::Kernel::validate) does.

use std::ops::{Deref, DerefMut};

use ir::DType;

use super::{Access, Buf, Combine, Expr, Grid, Kernel, KernelParam, Stmt, Ty, Unroll};

/// A list of statements under construction (a kernel body, a loop body or an
/// `if` branch).
#[derive(Debug, Default)]
pub struct Block {
    stmts: Vec<Stmt>,
}

impl Block {
    /// An empty block.
    pub fn new() -> Block {
        Block::default()
    }

    /// The statements built so far.
    pub fn into_stmts(self) -> Vec<Stmt> {
        self.stmts
    }

    /// Appends any statement.
    pub fn push(&mut self, s: Stmt) {
        self.stmts.push(s);
    }

    fn nested(f: impl FnOnce(&mut Block)) -> Vec<Stmt> {
        let mut b = Block::new();
        f(&mut b);
        b.stmts
    }

    /// `const T name = expr;` with `T` the expression's type; returns the variable.
    pub fn let_(&mut self, name: &str, expr: impl Into<Expr>) -> Expr {
        let expr = expr.into();
        let ty = expr.ty();
        self.stmts.push(Stmt::Let { var: name.into(), ty, expr });
        Expr::Var { name: name.into(), ty }
    }

    /// `T name = init;` (mutable); returns the variable for [`Block::assign`].
    pub fn var(&mut self, name: &str, init: impl Into<Expr>) -> Expr {
        let init = init.into();
        let ty = init.ty();
        self.stmts.push(Stmt::Var { var: name.into(), ty, init });
        Expr::Var { name: name.into(), ty }
    }

    /// `var = value;`. `var` must be a variable returned by [`Block::var`];
    /// anything else is reported by validation.
    pub fn assign(&mut self, var: &Expr, value: impl Into<Expr>) {
        let name = match var {
            Expr::Var { name, .. } => name.clone(),
            other => format!("{other:?}"),
        };
        self.stmts.push(Stmt::Assign { var: name, value: value.into() });
    }

    /// `T name[len];` per-item scratch.
    pub fn local_array(&mut self, name: &str, ty: Ty, len: usize) -> Buf {
        self.stmts.push(Stmt::LocalArray { var: name.into(), ty, len });
        Buf::Local { name: name.into(), ty }
    }

    /// `target[index] = value;`
    pub fn store(&mut self, target: &Buf, index: impl Into<Expr>, value: impl Into<Expr>) {
        self.stmts.push(Stmt::Store { target: target.clone(), index: index.into(), value: value.into() });
    }

    /// `target[index] += value;`
    pub fn accum(&mut self, target: &Buf, index: impl Into<Expr>, value: impl Into<Expr>) {
        self.stmts.push(Stmt::AccumStore {
            target: target.clone(),
            index: index.into(),
            value: value.into(),
        });
    }

    /// A serial loop `for (int64_t name = start; name < end; ++name)`.
    pub fn for_(
        &mut self,
        name: &str,
        start: impl Into<Expr>,
        end: impl Into<Expr>,
        f: impl FnOnce(&mut Block, Expr),
    ) {
        self.for_step(name, start, end, 1, Unroll::Auto, f);
    }

    /// Like [`Block::for_`], asking the compiler to unroll the loop.
    pub fn for_unrolled(
        &mut self,
        name: &str,
        start: impl Into<Expr>,
        end: impl Into<Expr>,
        f: impl FnOnce(&mut Block, Expr),
    ) {
        self.for_step(name, start, end, 1, Unroll::Full, f);
    }

    /// Like [`Block::for_`] over one vector's lanes, kept a loop
    /// ([`Unroll::Never`]).
    pub fn for_vector(
        &mut self,
        name: &str,
        start: impl Into<Expr>,
        end: impl Into<Expr>,
        f: impl FnOnce(&mut Block, Expr),
    ) {
        self.for_step(name, start, end, 1, Unroll::Never, f);
    }

    /// The general loop: `step` must be positive.
    pub fn for_step(
        &mut self,
        name: &str,
        start: impl Into<Expr>,
        end: impl Into<Expr>,
        step: i64,
        unroll: Unroll,
        f: impl FnOnce(&mut Block, Expr),
    ) {
        let var = Expr::Var { name: name.into(), ty: Ty::I64 };
        let body = Block::nested(|b| f(b, var));
        self.stmts.push(Stmt::For {
            var: name.into(),
            start: start.into(),
            end: end.into(),
            step,
            unroll,
            body,
        });
    }

    /// `if (cond) { then }`.
    pub fn if_(&mut self, cond: impl Into<Expr>, then: impl FnOnce(&mut Block)) {
        self.if_else(cond, then, |_| {});
    }

    /// `if (cond) { then } else { else_ }`.
    pub fn if_else(
        &mut self,
        cond: impl Into<Expr>,
        then: impl FnOnce(&mut Block),
        else_: impl FnOnce(&mut Block),
    ) {
        let then = Block::nested(then);
        let else_ = Block::nested(else_);
        self.stmts.push(Stmt::If { cond: cond.into(), then, else_ });
    }

    /// `/* text */`.
    pub fn comment(&mut self, text: &str) {
        self.stmts.push(Stmt::Comment(text.into()));
    }

    /// A block-wide reduction (block-per-item kernels, top level); returns
    /// the result, the same on every lane.
    pub fn block_reduce(&mut self, name: &str, op: Combine, value: impl Into<Expr>) -> Expr {
        let value = value.into();
        let ty = value.ty();
        self.stmts.push(Stmt::BlockReduce { var: name.into(), op, value });
        Expr::Var { name: name.into(), ty }
    }

    /// A block-wide barrier (block-per-item kernels, top level).
    pub fn barrier(&mut self) {
        self.stmts.push(Stmt::Barrier);
    }
}

/// Builds a [`Kernel`]: declare parameters, then write the body through the
/// [`Block`] methods this derefs to.
#[derive(Debug)]
pub struct KernelBuilder {
    name: String,
    grid: Grid,
    params: Vec<KernelParam>,
    body: Block,
}

impl KernelBuilder {
    /// A kernel named `name` (rendered as `widen_<name>`) over `grid`.
    pub fn new(name: &str, grid: Grid) -> KernelBuilder {
        KernelBuilder { name: name.into(), grid, params: Vec::new(), body: Block::new() }
    }

    /// Declares the next buffer parameter and returns its handle.
    pub fn param(&mut self, name: &str, dtype: DType, access: Access, len: usize) -> Buf {
        let p = KernelParam { name: name.into(), dtype, access, len };
        let buf = p.buf();
        self.params.push(p);
        buf
    }

    /// The finished kernel (not yet validated).
    pub fn finish(self) -> Kernel {
        Kernel { name: self.name, params: self.params, grid: self.grid, body: self.body.stmts }
    }
}

impl Deref for KernelBuilder {
    type Target = Block;
    fn deref(&self) -> &Block {
        &self.body
    }
}

impl DerefMut for KernelBuilder {
    fn deref_mut(&mut self) -> &mut Block {
        &mut self.body
    }
}
