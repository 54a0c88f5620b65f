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
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BufferId(pub usize);

/// What a buffer holds, and therefore how long it lives.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
    Constant {
        #[cfg_attr(feature = "serde", serde(with = "crate::kernel::float_bits::f64"))]
        value: f64,
    },
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
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
    /// One product (batch 1) of `(m, n, k)` over sub-blocks of the buffers at `offsets`:
    /// a grouped product's group, a chunk of the fused vocabulary loss.
    #[allow(clippy::too_many_arguments)]
    pub fn single(
        a: B,
        b: B,
        c: B,
        (m, n, k): (usize, usize, usize),
        trans_a: bool,
        trans_b: bool,
        offsets: [usize; 3],
        accumulate: bool,
    ) -> Gemm<B> {
        Gemm {
            a,
            b,
            c,
            batch: 1,
            m,
            n,
            k,
            trans_a,
            trans_b,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            offsets,
            accumulate,
        }
    }

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

/// The routing of sparse mixture-of-experts dispatch (docs/math.md §1.6): from the
/// experts chosen for every token (`idx`, i32, `assignments` = tokens · `k` of them,
/// token-major) the three index tensors of `ir`'s `MoeRoute`, all in one pass: `rows`
/// (i32 `[assignments]`, the expert-sorted row of each assignment), `tokens` (i32
/// `[assignments]`, the token each row reads) and `counts` (i32 `[experts]`, the rows
/// each expert keeps, at most `capacity`).
///
/// It is a sequential counting pass over a few thousand integers whose result
/// sizes every grouped product after it, so a device runs it on the host with the
/// reference's own function (`ir::exec::moe::route_into`): the Cpu device in
/// place; the Cuda device copies `idx` to the host (the one synchronisation of the
/// layer), routes, uploads the three results and keeps `counts` on the host for
/// the grouped GEMMs that follow ([`GroupedGemm`]), which need the group sizes to
/// issue one library call per expert.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct MoeRoute<B = BufferId> {
    pub idx: B,
    pub rows: B,
    pub tokens: B,
    pub counts: B,
    /// Assignments (tokens · k): the length of `idx`, `rows` and `tokens`.
    pub assignments: usize,
    /// Experts chosen per token.
    pub k: usize,
    /// Experts: the length of `counts`.
    pub experts: usize,
    /// Rows kept per expert; `None`: dropless.
    pub capacity: Option<usize>,
}

impl<B> MoeRoute<B> {
    /// The same routing over other buffer handles.
    pub fn map_buffers<C>(self, mut f: impl FnMut(B) -> C) -> MoeRoute<C> {
        MoeRoute {
            idx: f(self.idx),
            rows: f(self.rows),
            tokens: f(self.tokens),
            counts: f(self.counts),
            assignments: self.assignments,
            k: self.k,
            experts: self.experts,
            capacity: self.capacity,
        }
    }
}

/// Which product a [`GroupedGemm`] computes (docs/math.md §1.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum GroupedForm {
    /// `ir`'s `GroupedMatMul`: a [m, k] rows, b [groups, k, n] weights (`[groups, n,
    /// k]` with `trans_b`), c [m, n]; `c[r] = a[r] · op(b[e])` for every row r of group
    /// e, rows past the groups zero.
    Rows,
    /// `ir`'s `GroupedMatMulGrad`: a [m, k] rows, b [m, n] output gradients, c
    /// [groups, k, n] (`[groups, n, k]` with `trans_b`); `c[e] = Σ_{r∈e} a[r]ᵀ b[r]`
    /// (transposed with `trans_b`), zero for an empty group.
    WeightGrad,
}

/// A grouped matrix product over contiguous row groups whose sizes are data: the i32
/// `counts` (`[groups]`) a [`MoeRoute`] wrote, group e being rows `Σ_{i<e} counts[i]` on.
/// A device runs it as one library GEMM per non-empty group ([`GroupedGemm::products`])
/// and zeroes what none of them writes (rows past the groups, the weight gradient
/// of an empty group); the inputs `a` and `b`
/// share one element type (f32, or bf16 under mixed precision) and `c` is f32, as for
/// [`Gemm`].
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GroupedGemm<B = BufferId> {
    pub form: GroupedForm,
    pub a: B,
    pub b: B,
    pub c: B,
    pub counts: B,
    /// Groups (experts): the length of `counts`.
    pub groups: usize,
    /// Rows of `a` (the routed assignments).
    pub m: usize,
    /// Most rows the groups can cover: `m` when routing is dropless, `min(m, experts ·
    /// capacity)` under a capacity (`ir::cost::grouped_rows`, docs/math.md §1.6). The
    /// products' work is counted over these rows, as the cost model counts it, and
    /// counts that sum past it are refused.
    pub routed: usize,
    /// Width of `a`'s rows (the forward product's contraction).
    pub k: usize,
    /// Width of the forward product's output rows.
    pub n: usize,
    pub trans_b: bool,
}

impl<B> GroupedGemm<B> {
    /// The same product over other buffer handles.
    pub fn map_buffers<C>(self, mut f: impl FnMut(B) -> C) -> GroupedGemm<C> {
        GroupedGemm {
            form: self.form,
            a: f(self.a),
            b: f(self.b),
            c: f(self.c),
            counts: f(self.counts),
            groups: self.groups,
            m: self.m,
            routed: self.routed,
            k: self.k,
            n: self.n,
            trans_b: self.trans_b,
        }
    }

    /// Elements of `a`, `b` and `c` the product spans (`None` on overflow).
    pub fn extents(&self) -> Option<[usize; 3]> {
        let rows = self.m.checked_mul(self.k)?;
        let out = self.m.checked_mul(self.n)?;
        let weights = self.groups.checked_mul(self.k)?.checked_mul(self.n)?;
        Some(match self.form {
            GroupedForm::Rows => [rows, weights, out],
            GroupedForm::WeightGrad => [rows, out, weights],
        })
    }
}

/// The per-group products of a [`GroupedGemm`] and the element ranges of its
/// output that none of them writes ([`GroupedGemm::products`]).
pub type GroupProducts<B> = (Vec<Gemm<B>>, Vec<std::ops::Range<usize>>);

impl<B: Copy> GroupedGemm<B> {
    /// The dense products of the non-empty groups for the group sizes `counts`, each a
    /// [`Gemm`] over sub-blocks of the buffers (`Gemm::offsets`), and the element
    /// ranges of `c` that no product writes, which a device zeroes. An error where
    /// the counts do not fit the rows (`ir::exec::moe::group_ranges`), so a device never
    /// reads past a buffer whatever the data.
    pub fn products(&self, counts: &[i32]) -> Result<GroupProducts<B>, String> {
        if counts.len() != self.groups {
            return Err(format!("{} counts for {} groups", counts.len(), self.groups));
        }
        let groups = ir::exec::moe::group_ranges(counts, self.m)?;
        let covered = groups.last().map_or(0, |r| r.end);
        if covered > self.routed {
            return Err(format!("groups cover {covered} rows, the routing keeps at most {}", self.routed));
        }
        let (k, n) = (self.k, self.n);
        let mut gemms = Vec::new();
        let mut zeroed = Vec::new();
        for (e, rows) in groups.iter().enumerate() {
            let (start, count) = (rows.start, rows.len());
            let block = e * k * n;
            if count == 0 {
                if self.form == GroupedForm::WeightGrad {
                    zeroed.push(block..block + k * n);
                }
                continue;
            }
            let plain = |a, b, c, mnk, trans_a, trans_b, offsets| {
                Gemm::single(a, b, c, mnk, trans_a, trans_b, offsets, false)
            };
            gemms.push(match (self.form, self.trans_b) {
                // y_e [count, n] = x_e [count, k] · w_e ([k, n], or [n, k] transposed).
                (GroupedForm::Rows, t) => {
                    plain(self.a, self.b, self.c, (count, n, k), false, t, [start * k, block, start * n])
                }
                // dw_e [k, n] = x_eᵀ · dy_e.
                (GroupedForm::WeightGrad, false) => {
                    plain(self.a, self.b, self.c, (k, n, count), true, false, [start * k, start * n, block])
                }
                // dw_e [n, k] = dy_eᵀ · x_e.
                (GroupedForm::WeightGrad, true) => {
                    plain(self.b, self.a, self.c, (n, k, count), true, false, [start * n, start * k, block])
                }
            });
        }
        if self.form == GroupedForm::Rows {
            let covered = groups.last().map_or(0, |r| r.end);
            zeroed.push(covered * n..self.m * n);
        }
        zeroed.retain(|r| !r.is_empty());
        Ok((gemms, zeroed))
    }
}

/// One entry of the launch list, executed in order on one stream.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Step {
    /// Launch `kernels[kernel]` over its grid with `args` bound to its params in order.
    Kernel { kernel: usize, args: Vec<BufferId> },
    /// A library matrix product.
    Gemm(Gemm),
    /// Set a buffer to zero (accumulation targets).
    Zero { buffer: BufferId },
    /// Sparse MoE routing, on the host ([`MoeRoute`]).
    MoeRoute(MoeRoute),
    /// A library matrix product per expert row group ([`GroupedGemm`]).
    GroupedGemm(GroupedGemm),
}

impl Step {
    /// Every buffer the step binds (kernel arguments in parameter order).
    pub fn buffers(&self) -> Vec<BufferId> {
        match self {
            Step::Kernel { args, .. } => args.clone(),
            Step::Gemm(g) => vec![g.a, g.b, g.c],
            Step::Zero { buffer } => vec![*buffer],
            Step::MoeRoute(r) => vec![r.idx, r.rows, r.tokens, r.counts],
            Step::GroupedGemm(g) => vec![g.a, g.b, g.c, g.counts],
        }
    }
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
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
    /// or of other than f32 operands, or a zeroing, routing or grouped step,
    /// which no entry owns.
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
            Step::MoeRoute(_) => Some("it routes every token at once, which no entry owns".into()),
            Step::GroupedGemm(_) => Some("its groups are sized by data, not by the entries".into()),
        }
    }
}

/// A compiled training step.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
