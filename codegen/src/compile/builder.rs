//! `PlanBuilder`: the Plan under construction. It pushes kernels (optimized, and
//! shared between launches of one structure so that a deep model's layers share
//! them), lowerings (fresh temporaries, tables computed once per Plan, chains),
//! GEMMs with operands of one element type, and copies (docs/architecture.md §6, §7).

use std::collections::HashMap;

use ir::graph::{Graph, NodeId};
use ir::DType;

use super::Target;
use crate::emit::{self, Arg, Launch};
use crate::kernel::{item, Access, Kernel, KernelBuilder};
use crate::plan::{BufferDecl, BufferId, BufferRole, Chain, Gemm, GroupedGemm, Step};

/// A kernel as the renderers print it: indices simplified, loops over the
/// same range fused (a value consumed in the loop that produces it becomes a
/// scalar and its local array goes), long loops split.
pub(super) fn optimized(kernel: Kernel) -> Kernel {
    crate::kernel::split_loops(crate::kernel::fuse_loops(crate::kernel::simplify_indices(kernel)))
}

/// An optimized kernel in the form its target runs best: on the GPU a
/// thread-per-item kernel over long rows gets a warp per item
/// ([`crate::kernel::spread_over_lanes`]), so that a warp's loads are
/// consecutive elements of one row, not one element of each of 32 rows.
fn for_target(kernel: Kernel, target: Target) -> Kernel {
    match target {
        Target::Cpu => kernel,
        // An error would be a defect of the pass (`compile_specs` checks that
        // none occurs); the kernel as it was computes the same values.
        Target::Cuda => match crate::kernel::spread_over_lanes(&kernel) {
            Ok(Some(spread)) => spread,
            Ok(None) | Err(_) => kernel,
        },
    }
}

/// The temporary a launch computes from nothing (its only parameter, written),
/// if no other step of the lowering writes that temporary.
fn table_output(launch: &Launch, steps: &[emit::Work]) -> Option<usize> {
    let ([param], [Arg::Temp(t)]) = (launch.kernel.params.as_slice(), launch.args.as_slice()) else {
        return None;
    };
    if param.access != Access::Write {
        return None;
    }
    let writes_t = |work: &emit::Work| match work {
        emit::Work::Launch(l) => {
            l.args.iter().zip(&l.kernel.params).any(|(a, p)| *a == Arg::Temp(*t) && p.access.writable())
        }
        emit::Work::Gemm(g) => g.c == Arg::Temp(*t),
        emit::Work::Route(r) => [r.rows, r.tokens, r.counts].contains(&Arg::Temp(*t)),
        emit::Work::Grouped(g) => g.c == Arg::Temp(*t),
    };
    (steps.iter().filter(|w| writes_t(w)).count() == 1).then_some(*t)
}

#[derive(Default)]
pub(super) struct PlanBuilder {
    /// Where the kernels run: GPU kernels are spread over lanes where they fit.
    pub(super) target: Target,
    pub(super) buffers: Vec<BufferDecl>,
    pub(super) node_buf: HashMap<NodeId, BufferId>,
    pub(super) kernels: Vec<Kernel>,
    pub(super) steps: Vec<Step>,
    pub(super) arena_len: usize,
    /// Tables computed so far (see [`PlanBuilder::push_lowering`]): the
    /// launch's kernel, unnamed, and the buffer holding its output.
    tables: Vec<(Kernel, BufferId)>,
    /// The index in `kernels` of each kernel structure pushed so far.
    kernel_by_structure: HashMap<String, usize>,
    /// The lowerings' chains ([`Chain`]) among the steps pushed so far.
    pub(super) chains: Vec<Chain>,
}

impl PlanBuilder {
    /// An empty Plan whose kernels are sized for `target`.
    pub(super) fn new(target: Target) -> PlanBuilder {
        PlanBuilder { target, ..PlanBuilder::default() }
    }

    pub(super) fn buffer(
        &mut self,
        len: usize,
        dtype: DType,
        role: BufferRole,
        node: Option<usize>,
    ) -> BufferId {
        let id = BufferId(self.buffers.len());
        self.buffers.push(BufferDecl { id, len: len.max(1), dtype, role, node });
        id
    }

    /// `g<ordinal>_<label>`: unique, and a valid C identifier.
    pub(super) fn kernel_name(&self, label: &str) -> String {
        format!("g{:03}_{label}", self.kernels.len())
    }

    /// Appends a launch of `kernel`, reusing an earlier kernel of the same
    /// structure ([`Kernel::structure_key`]): a deep model's layers then share
    /// their kernels, which keeps the C and CUDA translation units (and the
    /// compilers' time) the size of one layer's.
    pub(super) fn push_kernel(&mut self, kernel: Kernel, args: Vec<BufferId>) {
        let key = kernel.structure_key();
        let index = match self.kernel_by_structure.get(&key) {
            Some(&index) => index,
            None => {
                self.kernels.push(for_target(optimized(kernel), self.target));
                self.kernel_by_structure.insert(key, self.kernels.len() - 1);
                self.kernels.len() - 1
            }
        };
        self.steps.push(Step::Kernel { kernel: index, args });
    }

    /// Pushes a lowering's steps with fresh scratch buffers for its
    /// temporaries, except that a table (a launch that reads nothing and
    /// writes only a temporary no other step of the lowering writes, such as
    /// attention's RoPE angles, docs/math.md §1.3) is computed once per Plan: a
    /// later identical launch reuses the first one's buffer, whose life then
    /// spans every user. Each layer's attention forward and backward would
    /// otherwise recompute the same table in f64.
    pub(super) fn push_lowering(&mut self, lowering: emit::Lowering) {
        let emit::Lowering { steps, temps: temp_decls, chain } = lowering;
        let tables: Vec<Option<(usize, Kernel)>> = steps
            .iter()
            .map(|work| {
                let emit::Work::Launch(launch) = work else { return None };
                let t = table_output(launch, &steps)?;
                Some((t, Kernel { name: String::new(), ..launch.kernel.clone() }))
            })
            .collect();
        let mut reused: Vec<Option<BufferId>> = vec![None; temp_decls.len()];
        for (t, key) in tables.iter().flatten() {
            if let Some((_, buf)) = self.tables.iter().find(|(k, _)| k == key) {
                reused[*t] = Some(*buf);
            }
        }
        let temps: Vec<BufferId> = temp_decls
            .iter()
            .zip(&reused)
            .map(|(&(len, dtype), r)| {
                r.unwrap_or_else(|| self.buffer(len, dtype, BufferRole::Scratch { offset: 0 }, None))
            })
            .collect();
        // The Plan step each work starts at (a reused table adds none).
        let mut starts = Vec::with_capacity(steps.len() + 1);
        for (work, table) in steps.into_iter().zip(tables) {
            starts.push(self.steps.len());
            if let Some((t, key)) = table {
                if reused[t].is_some() {
                    continue;
                }
                self.tables.push((key, temps[t]));
            }
            self.push_work(work, &temps);
        }
        starts.push(self.steps.len());
        if let Some(c) = chain {
            let chain = Chain { start: starts[c.works.start], end: starts[c.works.end], entries: c.entries };
            // One step per work (no widening copy came in between), each
            // addressing whole entries.
            if chain.end - chain.start == c.works.len() && self.splits_into_entries(chain) {
                self.chains.push(chain);
            }
        }
    }

    /// Whether every step of `chain` fits it ([`Chain::misfit`]).
    fn splits_into_entries(&self, chain: Chain) -> bool {
        chain.entries > 0
            && self.steps[chain.steps()]
                .iter()
                .all(|s| chain.misfit(s, &self.kernels, &self.buffers).is_none())
    }

    fn push_work(&mut self, work: emit::Work, temps: &[BufferId]) {
        let buf = |a: Arg| match a {
            Arg::Node(id) => self.node_buf[&id],
            Arg::Temp(i) => temps[i],
        };
        match work {
            emit::Work::Launch(launch) => self.push_launch(launch, temps),
            emit::Work::Gemm(g) => {
                let g = g.map_buffers(buf);
                let (a, b) = self.gemm_operands(g.a, g.b);
                let gemm = Gemm { a, b, ..g };
                self.steps.push(Step::Gemm(gemm));
            }
            emit::Work::Route(r) => self.steps.push(Step::MoeRoute(r.map_buffers(buf))),
            emit::Work::Grouped(g) => {
                let g = g.map_buffers(buf);
                let (a, b) = self.gemm_operands(g.a, g.b);
                self.steps.push(Step::GroupedGemm(GroupedGemm { a, b, ..g }));
            }
        }
    }

    pub(super) fn push_launch(&mut self, launch: Launch, temps: &[BufferId]) {
        let args = launch
            .args
            .iter()
            .map(|a| match a {
                Arg::Node(id) => self.node_buf[id],
                Arg::Temp(i) => temps[*i],
            })
            .collect();
        self.push_kernel(launch.kernel, args);
    }

    /// GEMM operands of one element type: a GEMM runs on two f32 or two bf16 inputs
    /// (cuBLAS GemmEx takes one input type), so when a bf16 operand meets an f32 one
    /// (the backward of a bf16 projection, docs/math.md §6.12) the bf16 one is widened, exactly,
    /// into an f32 scratch copy first.
    pub(super) fn gemm_operands(&mut self, a: BufferId, b: BufferId) -> (BufferId, BufferId) {
        let (da, db) = (self.buffers[a.0].dtype, self.buffers[b.0].dtype);
        match (da, db) {
            (DType::Bf16, DType::F32) => (self.push_widen(a), b),
            (DType::F32, DType::Bf16) => (a, self.push_widen(b)),
            _ => (a, b),
        }
    }

    /// An f32 scratch copy of bf16 buffer `src` (the kernel's load widens each value).
    fn push_widen(&mut self, src: BufferId) -> BufferId {
        let len = self.buffers[src.0].len;
        let dst = self.buffer(len, DType::F32, BufferRole::Scratch { offset: 0 }, None);
        let name = self.kernel_name("widen");
        let mut k = KernelBuilder::new(&name, emit::grid(len));
        let from = k.param("src", DType::Bf16, Access::Read, len);
        let out = k.param("dst", DType::F32, Access::Write, len);
        k.store(&out, item(), from.at(item()));
        self.push_kernel(k.finish(), vec![src, dst]);
        dst
    }

    /// A copy of node `id`'s buffer into `dst` (a value with two roles).
    pub(super) fn push_copy(&mut self, graph: &Graph, id: NodeId, dst: BufferId) {
        let node = graph.node(id);
        let len = node.shape.numel().max(1);
        let name = self.kernel_name("copy");
        let mut k = KernelBuilder::new(&name, emit::grid(len));
        let src = k.param("src", node.dtype, Access::Read, len);
        let out = k.param("dst", node.dtype, Access::Write, len);
        k.store(&out, item(), src.at(item()));
        let src_buf = self.node_buf[&id];
        self.push_kernel(k.finish(), vec![src_buf, dst]);
    }
}
