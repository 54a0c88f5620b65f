//! Load-time checks of a [`Plan`] shared by every device (docs/architecture.md §7).
//!
//! Both devices store a Plan's buffers the same way: one allocation per
//! persistent buffer and one arena per element type, in which a scratch
//! buffer starts at its planned offset (in elements of its own type). So
//! whether a step binds its buffers soundly is a property of the Plan alone,
//! and is checked here once, before a device allocates or compiles anything:
//! a malformed Plan is an error at load time, never an out-of-bounds access
//! or a kernel racing on its own input later.

use codegen::kernel::{Access, Kernel};
use codegen::plan::{BufferId, BufferRole, Chain, Gemm, GroupedGemm, MoeRoute, Plan, Step};
use ir::DType;

/// Why a Plan cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PlanCheckError {
    #[error("plan buffer #{index} declares id {id}; buffer ids must equal their position")]
    BufferId { index: usize, id: usize },
    #[error("step {step} refers to buffer #{id}, but the plan has {count} buffers")]
    UnknownBuffer { step: usize, id: usize, count: usize },
    #[error("step {step} launches kernel {kernel}, but the plan has {count} kernels")]
    UnknownKernel { step: usize, kernel: usize, count: usize },
    #[error("step {step} binds {got} buffers to kernel `{kernel}`, which has {expected} parameters")]
    Arity { step: usize, kernel: String, got: usize, expected: usize },
    #[error(
        "step {step}: kernel `{kernel}` parameter `{param}` needs {want_len} x {want_dtype}, \
         buffer #{id} holds {len} x {dtype}"
    )]
    ParamMismatch {
        step: usize,
        kernel: String,
        param: String,
        id: usize,
        want_dtype: DType,
        want_len: usize,
        dtype: DType,
        len: usize,
    },
    #[error(
        "step {step}: buffer #{written} is written by `{kernel}` but overlaps its argument buffer #{other}"
    )]
    Aliased { step: usize, kernel: String, written: usize, other: usize },
    #[error("step {step}: GEMM {what}")]
    Gemm { step: usize, what: String },
    #[error("step {step}: MoE routing {what}")]
    Route { step: usize, what: String },
    #[error("step {step}: grouped GEMM {what}")]
    Grouped { step: usize, what: String },
    #[error("buffer #{id} ({role}): {dtype} constants are not supported")]
    ConstantDType { id: usize, role: String, dtype: DType },
    #[error("chain {index} (steps {start}..{end} over {entries} entries): {what}")]
    Chain { index: usize, start: usize, end: usize, entries: usize, what: String },
    #[error("{what} is too large to address (more than {MAX_BYTES} bytes)")]
    TooLarge { what: String },
}

/// The most bytes one allocation may span (Rust's `isize::MAX` rule), less
/// the slack a device adds to an arena to align it.
const MAX_BYTES: usize = isize::MAX as usize - 4096;

/// Checks that every buffer, every scratch placement (offset + length) and
/// each arena fits in an allocation, so the sizes and ends the devices and
/// the other checks compute cannot overflow: a wrapped end would size an
/// arena short and let a kernel run past it (see README, "What widen guarantees": a
/// malformed Plan is a load error, never memory corruption).
pub fn check_sizes(plan: &Plan) -> Result<(), PlanCheckError> {
    let fits = |elements: Option<usize>, dtype: DType| {
        elements.and_then(|n| n.checked_mul(dtype.size_bytes())).is_some_and(|b| b <= MAX_BYTES)
    };
    if !fits(Some(plan.arena_len), DType::F32) {
        return Err(PlanCheckError::TooLarge {
            what: format!("the f32 arena of {} elements", plan.arena_len),
        });
    }
    for d in &plan.buffers {
        let end = match d.role {
            BufferRole::Scratch { offset } => offset.checked_add(d.len),
            _ => Some(d.len),
        };
        if !fits(end, d.dtype) {
            return Err(PlanCheckError::TooLarge {
                what: format!("buffer #{} ({} x {}, {:?})", d.id.0, d.len, d.dtype, d.role),
            });
        }
    }
    Ok(())
}

/// Checks the Plan's chains ([`Chain`]): in step order, disjoint, within the
/// steps, with at least one entry, and made of steps that fit them
/// ([`Chain::misfit`]: kernels whose items split evenly into the entries,
/// f32 GEMMs over exactly the entries). (That
/// an entry reads only its own entries of the chain's outputs is the
/// lowering's promise; these are the parts a device's indexing relies on.)
pub fn check_chains(plan: &Plan) -> Result<(), PlanCheckError> {
    let mut after = 0;
    for (index, chain) in plan.chains.iter().enumerate() {
        let Chain { start, end, entries } = *chain;
        let err = |what: String| PlanCheckError::Chain { index, start, end, entries, what };
        if start < after || start >= end || end > plan.steps.len() {
            return Err(err(format!(
                "must be a non-empty range of the plan's {} steps, after the previous chain (ending at {after})",
                plan.steps.len()
            )));
        }
        if entries == 0 {
            return Err(err("needs at least one entry".into()));
        }
        for step in chain.steps() {
            if let Some(why) = chain.misfit(&plan.steps[step], &plan.kernels, &plan.buffers) {
                return Err(err(format!("step {step}: {why}")));
            }
        }
        after = end;
    }
    Ok(())
}

/// Checks that every buffer's id equals its position, which both devices
/// rely on to index their storage by id.
pub fn check_buffer_ids(plan: &Plan) -> Result<(), PlanCheckError> {
    match plan.buffers.iter().enumerate().find(|(index, d)| d.id.0 != *index) {
        Some((index, d)) => Err(PlanCheckError::BufferId { index, id: d.id.0 }),
        None => Ok(()),
    }
}

/// Checks every step against the buffers it binds: buffers and kernels
/// exist; a kernel gets one buffer per parameter, of the parameter's element
/// type and at least its length; a buffer a kernel writes overlaps none of
/// its other arguments; GEMM operands are f32 and long enough for every
/// batch entry, and the output overlaps neither input; a routing's buffers are
/// i32 of its sizes and its outputs overlap nothing else it binds; a grouped
/// GEMM's inputs are long enough for every row and weight, its counts i32 over
/// its groups, and its output overlaps nothing else it binds (group sizes are
/// data: each device checks them against the rows when it runs the step,
/// `GroupedGemm::products`). Runs [`check_sizes`] first, so no extent it
/// computes overflows.
pub fn check_steps(plan: &Plan) -> Result<(), PlanCheckError> {
    check_sizes(plan)?;
    let count = plan.buffers.len();
    for (step, s) in plan.steps.iter().enumerate() {
        let known = |id: &BufferId| {
            if id.0 < count {
                Ok(())
            } else {
                Err(PlanCheckError::UnknownBuffer { step, id: id.0, count })
            }
        };
        match s {
            Step::Kernel { kernel, args } => {
                let k = plan.kernels.get(*kernel).ok_or(PlanCheckError::UnknownKernel {
                    step,
                    kernel: *kernel,
                    count: plan.kernels.len(),
                })?;
                check_kernel_args(plan, step, k, args, known)?;
            }
            Step::Gemm(g) => {
                for id in [g.a, g.b, g.c] {
                    known(&id)?;
                }
                check_gemm(plan, step, g)?;
            }
            Step::Zero { buffer } => known(buffer)?,
            Step::MoeRoute(r) => {
                for id in [r.idx, r.rows, r.tokens, r.counts] {
                    known(&id)?;
                }
                check_route(plan, step, r)?;
            }
            Step::GroupedGemm(g) => {
                for id in [g.a, g.b, g.c, g.counts] {
                    known(&id)?;
                }
                check_grouped(plan, step, g)?;
            }
        }
    }
    Ok(())
}

fn check_kernel_args(
    plan: &Plan,
    step: usize,
    k: &Kernel,
    args: &[BufferId],
    known: impl Fn(&BufferId) -> Result<(), PlanCheckError>,
) -> Result<(), PlanCheckError> {
    if args.len() != k.params.len() {
        return Err(PlanCheckError::Arity {
            step,
            kernel: k.name.clone(),
            got: args.len(),
            expected: k.params.len(),
        });
    }
    for (p, id) in k.params.iter().zip(args) {
        known(id)?;
        let d = &plan.buffers[id.0];
        if d.dtype != p.dtype || d.len < p.len {
            return Err(PlanCheckError::ParamMismatch {
                step,
                kernel: k.name.clone(),
                param: p.name.clone(),
                id: id.0,
                want_dtype: p.dtype,
                want_len: p.len,
                dtype: d.dtype,
                len: d.len,
            });
        }
    }
    for (i, (p, w)) in k.params.iter().zip(args).enumerate() {
        if p.access == Access::Read {
            continue;
        }
        for (j, o) in args.iter().enumerate() {
            if i != j && overlaps(extent(plan, *w), extent(plan, *o)) {
                return Err(PlanCheckError::Aliased {
                    step,
                    kernel: k.name.clone(),
                    written: w.0,
                    other: o.0,
                });
            }
        }
    }
    Ok(())
}

fn check_gemm(plan: &Plan, step: usize, g: &Gemm) -> Result<(), PlanCheckError> {
    let err = |what: String| PlanCheckError::Gemm { step, what };
    let product = |x: usize, y: usize, what: &str| {
        x.checked_mul(y).ok_or_else(|| err(format!("operand {what}: {x} x {y} elements overflow")))
    };
    for (name, id, stride, size, offset) in [
        ("a", g.a, g.stride_a, product(g.m, g.k, "a")?, g.offsets[0]),
        ("b", g.b, g.stride_b, product(g.k, g.n, "b")?, g.offsets[1]),
        ("c", g.c, g.stride_c, product(g.m, g.n, "c")?, g.offsets[2]),
    ] {
        let d = &plan.buffers[id.0];
        // Inputs may be bf16 (mixed precision, docs/math.md §6.12); the product is f32.
        let input_bf16 = name != "c" && d.dtype == DType::Bf16;
        if d.dtype != DType::F32 && !input_bf16 {
            return Err(err(format!(
                "operand {name} (buffer #{}) is {}, only f32 (or bf16 inputs) is supported",
                id.0, d.dtype
            )));
        }
        // Checked: a product whose extent overflows reaches past any buffer.
        let need = if g.batch == 0 {
            Some(0)
        } else {
            size.checked_add(offset).and_then(|n| n.checked_add((g.batch - 1).checked_mul(stride)?))
        };
        let Some(need) = need else {
            return Err(err(format!(
                "operand {name} (buffer #{}): {} batches of {size} with stride {stride} from offset \
                 {offset} overflow",
                id.0, g.batch
            )));
        };
        if d.len < need {
            return Err(err(format!(
                "operand {name} (buffer #{}) holds {} elements, {} batches of {size} with stride {stride} \
                 from offset {offset} need {need}",
                id.0, d.len, g.batch
            )));
        }
    }
    let (da, db) = (plan.buffers[g.a.0].dtype, plan.buffers[g.b.0].dtype);
    if da != db {
        return Err(err(format!("operands a ({da}) and b ({db}) differ in element type")));
    }
    for (name, id) in [("a", g.a), ("b", g.b)] {
        if overlaps(extent(plan, g.c), extent(plan, id)) {
            return Err(err(format!(
                "output c (buffer #{}) overlaps operand {name} (buffer #{})",
                g.c.0, id.0
            )));
        }
    }
    Ok(())
}

fn check_route(plan: &Plan, step: usize, r: &MoeRoute) -> Result<(), PlanCheckError> {
    let err = |what: String| PlanCheckError::Route { step, what };
    if r.k == 0 || r.experts == 0 || r.capacity == Some(0) || !r.assignments.is_multiple_of(r.k) {
        return Err(err(format!(
            "of {} assignments, {} per token, over {} experts with capacity {:?}: needs k, experts and \
             a capacity of at least 1 and whole tokens",
            r.assignments, r.k, r.experts, r.capacity
        )));
    }
    let bound = [
        ("indices", r.idx, r.assignments),
        ("rows", r.rows, r.assignments),
        ("tokens", r.tokens, r.assignments),
        ("counts", r.counts, r.experts),
    ];
    for (name, id, len) in bound {
        let d = &plan.buffers[id.0];
        if d.dtype != DType::I32 || d.len < len {
            return Err(err(format!(
                "{name} (buffer #{}) holds {} x {}, needs {len} x i32",
                id.0, d.len, d.dtype
            )));
        }
    }
    for (i, (name, out, _)) in bound.iter().enumerate().skip(1) {
        for (j, (other, id, _)) in bound.iter().enumerate() {
            if i != j && overlaps(extent(plan, *out), extent(plan, *id)) {
                return Err(err(format!(
                    "output {name} (buffer #{}) overlaps {other} (buffer #{})",
                    out.0, id.0
                )));
            }
        }
    }
    Ok(())
}

fn check_grouped(plan: &Plan, step: usize, g: &GroupedGemm) -> Result<(), PlanCheckError> {
    let err = |what: String| PlanCheckError::Grouped { step, what };
    let Some([a, b, c]) = g.extents() else {
        return Err(err(format!("of {} groups of {} x {} x {} overflows", g.groups, g.m, g.n, g.k)));
    };
    if g.routed > g.m {
        return Err(err(format!("keeps {} rows of the {} routed", g.routed, g.m)));
    }
    let bound = [("a", g.a, a), ("b", g.b, b), ("c", g.c, c), ("counts", g.counts, g.groups)];
    for (name, id, len) in bound {
        let d = &plan.buffers[id.0];
        let dtype_ok = match name {
            "counts" => d.dtype == DType::I32,
            // Inputs may be bf16 (mixed precision, docs/math.md §6.12); the product is f32.
            "a" | "b" => matches!(d.dtype, DType::F32 | DType::Bf16),
            _ => d.dtype == DType::F32,
        };
        if !dtype_ok {
            let want = match name {
                "counts" => "i32",
                "c" => "f32",
                _ => "f32 or bf16",
            };
            return Err(err(format!("operand {name} (buffer #{}) is {}, needs {want}", id.0, d.dtype)));
        }
        if d.len < len {
            return Err(err(format!(
                "operand {name} (buffer #{}) holds {} elements, needs {len}",
                id.0, d.len
            )));
        }
    }
    let (da, db) = (plan.buffers[g.a.0].dtype, plan.buffers[g.b.0].dtype);
    if da != db {
        return Err(err(format!("operands a ({da}) and b ({db}) differ in element type")));
    }
    for (name, id) in [("a", g.a), ("b", g.b), ("counts", g.counts)] {
        if overlaps(extent(plan, g.c), extent(plan, id)) {
            return Err(err(format!(
                "output c (buffer #{}) overlaps operand {name} (buffer #{})",
                g.c.0, id.0
            )));
        }
    }
    Ok(())
}

/// The storage a buffer lives in: its own allocation, or the arena of its
/// element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Storage {
    Own(usize),
    Arena(DType),
}

/// The element range a buffer occupies in its storage: (storage, start, end).
fn extent(plan: &Plan, id: BufferId) -> (Storage, usize, usize) {
    let d = &plan.buffers[id.0];
    match d.role {
        BufferRole::Scratch { offset } => (Storage::Arena(d.dtype), offset, offset + d.len),
        _ => (Storage::Own(id.0), 0, d.len),
    }
}

/// Whether two non-empty ranges of the same storage intersect.
fn overlaps(a: (Storage, usize, usize), b: (Storage, usize, usize)) -> bool {
    a.0 == b.0 && a.1 < b.2 && b.1 < a.2 && a.1 < a.2 && b.1 < b.2
}
