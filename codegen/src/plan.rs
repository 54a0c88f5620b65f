//! The compiled Plan: kernels + launch list + buffer plan (docs/architecture.md §2, §7).
//!
//! A Plan is what a device executes for one training step (forward, backward
//! and, when included, the optimizer). It is produced by `codegen::compile`
//! from a differentiated graph and consumed by the runtime's devices; it holds
//! no data, only sizes and offsets, so the same Plan runs on the Cpu device and
//! (through the CUDA dialect of the same kernels) on the Cuda device.

use crate::kernel::Kernel;
use ir::DType;

/// Index into [`Plan::buffers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub usize);

/// What a buffer holds, and therefore how long it lives.
#[derive(Debug, Clone, PartialEq)]
pub enum BufferRole {
    /// A trainable parameter (persistent across steps), by its stable graph name.
    Param { name: String },
    /// The gradient of a parameter (persistent; written every step).
    Grad { name: String },
    /// Per-step data fed by the runtime (the `tokens` window), by its graph input name.
    Input { name: String },
    /// A named graph output read back by the runtime (`loss`, `logits`, ...).
    Output { name: String },
    /// A constant filled once at load time (the graph's `Constant` nodes).
    Constant { value: f64 },
    /// Optimizer state of a parameter (persistent), by its checkpoint name:
    /// AdamW's moments `opt.<param>.m` and `opt.<param>.v`
    /// ([`crate::optimizer`]).
    OptState { name: String },
    /// A transient value placed in the shared arena at `offset` elements
    /// (liveness-based reuse: two scratch buffers alive at once never overlap).
    Scratch { offset: usize },
}

/// One buffer of the Plan.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferDecl {
    pub id: BufferId,
    /// Length in elements.
    pub len: usize,
    pub dtype: DType,
    pub role: BufferRole,
    /// The graph node whose value this buffer holds (`%index` in dumps), if any.
    pub node: Option<usize>,
}

/// A dense (batched) matrix product handed to the device's GEMM (CPU: the runtime's
/// AVX-512 kernel or the `gemm` crate; GPU: cuBLAS). Row-major operands; `c[b] (=|+=) op(a[b]) @ op(b[b])` for each batch
/// index, where a zero batch stride broadcasts an operand.
/// The lowering builds the same product over its own buffer handles (`Gemm<emit::Arg>`)
/// before buffers are assigned.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemm<B = BufferId> {
    pub a: B,
    pub b: B,
    pub c: B,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    /// Elements between consecutive batch entries (0 = broadcast).
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    /// Elements from the start of the a, b and c buffers to batch entry 0: a
    /// product over a sub-block of a buffer (causal attention's key prefixes).
    pub offsets: [usize; 3],
    /// Accumulate into c instead of overwriting it.
    pub accumulate: bool,
}

impl<B> Gemm<B> {
    /// The same product over other buffer handles.
    pub fn map_buffers<C>(self, mut f: impl FnMut(B) -> C) -> Gemm<C> {
        Gemm {
            a: f(self.a),
            b: f(self.b),
            c: f(self.c),
            batch: self.batch,
            m: self.m,
            n: self.n,
            k: self.k,
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            stride_a: self.stride_a,
            stride_b: self.stride_b,
            stride_c: self.stride_c,
            offsets: self.offsets,
            accumulate: self.accumulate,
        }
    }
}

/// One entry of the launch list, executed in order on one stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Launch `kernels[kernel]` over its grid with `args` bound to its params in order.
    Kernel { kernel: usize, args: Vec<BufferId> },
    /// A library matrix product.
    Gemm(Gemm),
    /// Set a buffer to zero (accumulation targets).
    Zero { buffer: BufferId },
}

/// Consecutive steps `start..end` that may also run entry by entry: every
/// one is a kernel whose items split into `entries` equal runs (run `e`
/// being items `[e·n/entries, (e+1)·n/entries)`) or a GEMM of `entries`
/// batch entries of f32 operands, and entry `e` of each step reads, of what
/// the chain writes, only entry `e` of earlier steps. A device may run every
/// step for one entry before the next entry, on any thread: the result is
/// that of the steps in order. Causal attention is one (per (batch, head),
/// `crate::emit::attention`): its scores, probabilities and products of one
/// head fit a core's cache, where step by step they stream through memory
/// between the GEMMs and the row kernels. The arena keeps every buffer a
/// chain touches alive over the whole chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    pub start: usize,
    pub end: usize,
    pub entries: usize,
}

impl Chain {
    /// The chain's steps.
    pub fn steps(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }

    /// Why `step` (of a Plan with `kernels` and `buffers`) cannot be one of
    /// this chain's steps, if it cannot: a kernel whose items do not split
    /// evenly into the entries, a GEMM over another number of batch entries
    /// or of other than f32 operands, or a zeroing step, which no entry owns.
    pub fn misfit(&self, step: &Step, kernels: &[Kernel], buffers: &[BufferDecl]) -> Option<String> {
        match step {
            Step::Kernel { kernel, .. } => {
                let items = kernels.get(*kernel).map_or(0, |k| k.grid.items());
                (!items.is_multiple_of(self.entries))
                    .then(|| format!("its {items} items do not split into {} entries", self.entries))
            }
            Step::Gemm(g) => {
                let f32 =
                    [g.a, g.b, g.c].iter().all(|id| buffers.get(id.0).is_some_and(|d| d.dtype == DType::F32));
                (g.batch != self.entries || !f32).then(|| {
                    format!(
                        "a GEMM of {} batch entries; a chain's GEMMs have one f32 product per entry",
                        g.batch
                    )
                })
            }
            Step::Zero { .. } => Some("it zeroes a buffer, which no entry owns".into()),
        }
    }
}

/// A compiled training step.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub kernels: Vec<Kernel>,
    pub steps: Vec<Step>,
    /// Step ranges that may run entry by entry ([`Chain`]), in step order,
    /// disjoint.
    pub chains: Vec<Chain>,
    pub buffers: Vec<BufferDecl>,
    /// Size of the shared scratch arena, per dtype, in elements (f32 arena first).
    pub arena_len: usize,
    /// The first step of the optimizer update, when the Plan has one
    /// ([`crate::optimizer::append_adamw`]): the steps before it compute the
    /// loss and the gradients.
    pub update_start: Option<usize>,
}

impl Plan {
    /// The buffer holding a named role, e.g. the `loss` output or the `blocks.0.attn.wq` param.
    pub fn find(&self, role: &BufferRole) -> Option<BufferId> {
        self.buffers.iter().find(|b| &b.role == role).map(|b| b.id)
    }

    /// The steps that compute the loss and the gradients: every step but the
    /// optimizer update's.
    pub fn gradient_steps(&self) -> std::ops::Range<usize> {
        0..self.update_start.unwrap_or(self.steps.len())
    }
}
