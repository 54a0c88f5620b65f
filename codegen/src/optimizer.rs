//! AdamW inside the Plan (docs/architecture.md §2: the graph carries gradients *and* the
//! optimizer; §7: parameters, gradients and optimizer state are persistent
//! buffers that stay on the device across steps).
//!
//! [`append_adamw`] appends to a training Plan, after its backward pass:
//! 1. for each gradient, sums of squares over fixed chunks of it, in f64, one
//!    block per chunk;
//! 2. one kernel that adds the chunk sums in gradient order into the global
//!    norm, and from it and the loss derives the clip factor (docs/math.md §10:
//!    PyTorch's `clip_grad_norm_` rule with its 1e-6 guard) and whether the
//!    step applies (the runtime asked for it and the loss is finite);
//! 3. for each parameter, the AdamW update of the parameter and its two
//!    moments in place, operation for operation the arithmetic of the
//!    runtime's host AdamW (decoupled weight decay, bias corrections folded
//!    into the step size and the `v` scale), so the C dialect, compiled
//!    without contraction, gives the host's bits.
//!
//! Nothing else changes: the steps before [`Plan::update_start`] still compute
//! the loss and gradients, so a device runs them alone for validation and
//! gradient reads, and the whole list for a training step. What changes from
//! step to step (the schedule's learning rate, the bias corrections, whether
//! to apply) is read from input buffers the runtime writes before a step:
//! [`SETTINGS_INPUT`], laid out by [`Setting`], and one [`rates_input`] per
//! parameter. The moments are [`BufferRole::OptState`] buffers named as in
//! checkpoints, `opt.<param>.m` and `opt.<param>.v`.

use crate::emit::Target;
use crate::kernel::{
    f32, f64, i64, item, lane, select, Access, Combine, Grid, Kernel, KernelBuilder, KernelError, Ty, Unroll,
};
use crate::plan::{BufferDecl, BufferId, BufferRole, Plan, Step};
use ir::DType;
use std::collections::HashMap;

/// The input buffer of per-step settings shared by every parameter.
pub const SETTINGS_INPUT: &str = "optimizer";

/// The output buffer holding the global gradient norm (f64, before clipping).
pub const GRAD_NORM_OUTPUT: &str = "optimizer.grad_norm";

/// The input buffer of one parameter's per-step rates, laid out by [`Rate`].
pub fn rates_input(param: &str) -> String {
    format!("optimizer.{param}")
}

/// The checkpoint names of a parameter's first and second moments.
pub fn moment_names(param: &str) -> [String; 2] {
    [format!("opt.{param}.m"), format!("opt.{param}.v")]
}

/// Entries of [`SETTINGS_INPUT`] (f64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// Nonzero to apply the update this run (zero: compute the norm only).
    Apply,
    /// The global-norm limit; `+inf` turns clipping off.
    MaxNorm,
    Beta1,
    Beta2,
    Eps,
    /// `1 / sqrt(1 - beta2^t)` for the 1-based step `t`.
    InvSqrtBias2,
}

impl Setting {
    /// Every setting, in buffer order.
    pub const ALL: [Setting; 6] = [
        Setting::Apply,
        Setting::MaxNorm,
        Setting::Beta1,
        Setting::Beta2,
        Setting::Eps,
        Setting::InvSqrtBias2,
    ];

    /// Position in the buffer.
    pub fn index(self) -> usize {
        Setting::ALL.iter().position(|&s| s == self).expect("ALL lists every setting")
    }
}

/// Entries of a parameter's [`rates_input`] (f64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    /// `1 - lr · weight_decay`.
    Decay,
    /// `lr / (1 - beta1^t)`.
    Step,
}

impl Rate {
    /// Every rate, in buffer order.
    pub const ALL: [Rate; 2] = [Rate::Decay, Rate::Step];

    /// Position in the buffer.
    pub fn index(self) -> usize {
        Rate::ALL.iter().position(|&r| r == self).expect("ALL lists every rate")
    }
}

/// Elements of a gradient one block of the norm kernels sums: the chunks,
/// not the threads, fix the order of additions, so the norm is the same on
/// every device and thread count.
pub const NORM_CHUNK: usize = 1 << 14;

/// Lanes of each norm block.
pub const NORM_LANES: u32 = 256;

/// Failures appending the update.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error("the Plan has no `loss` output to guard the update with")]
    NoLoss,
    #[error("the Plan already has an optimizer update")]
    Twice,
    #[error("parameter `{name}` is {dtype}; the Plan's AdamW updates f32 parameters")]
    NotF32 { name: String, dtype: DType },
    #[error("optimizer kernel: {0}")]
    Kernel(#[from] KernelError),
}

/// Appends the AdamW update of every parameter of `plan` (see the module
/// docs), with the norm kernels in `target`'s form (`sum_of_squares`).
pub fn append_adamw(plan: &mut Plan, target: Target) -> Result<(), UpdateError> {
    if plan.update_start.is_some() {
        return Err(UpdateError::Twice);
    }
    let loss = plan.find(&BufferRole::Output { name: "loss".into() }).ok_or(UpdateError::NoLoss)?;
    let params: Vec<(String, BufferId)> = plan
        .buffers
        .iter()
        .filter_map(|b| match &b.role {
            BufferRole::Param { name } => Some((name.clone(), b.id)),
            _ => None,
        })
        .collect();
    let mut b = Appender::new(plan);
    let start = b.plan.steps.len();
    let settings =
        b.buffer(Setting::ALL.len(), DType::F64, BufferRole::Input { name: SETTINGS_INPUT.into() });
    let grad_norm = b.buffer(1, DType::F64, BufferRole::Output { name: GRAD_NORM_OUTPUT.into() });
    let control = b.scratch(CONTROL_LEN, DType::F32);

    let mut updates = Vec::with_capacity(params.len());
    let mut partials = Vec::with_capacity(params.len());
    for (name, param) in params {
        let decl = &b.plan.buffers[param.0];
        let (len, dtype) = (decl.len, decl.dtype);
        if dtype != DType::F32 {
            return Err(UpdateError::NotF32 { name, dtype });
        }
        // A parameter the loss does not reach updates with a zero gradient,
        // as on the host.
        let grad = match b.plan.find(&BufferRole::Grad { name: name.clone() }) {
            Some(g) => g,
            None => b.buffer(len, DType::F32, BufferRole::Constant { value: 0.0 }),
        };
        let chunks = len.div_ceil(NORM_CHUNK);
        let partial = b.scratch(chunks, DType::F64);
        b.launch(sum_of_squares(len, target)?, vec![grad, partial]);
        partials.push((partial, chunks));
        let [m, v] = moment_names(&name).map(|n| b.buffer(len, DType::F32, BufferRole::OptState { name: n }));
        let rates = b.buffer(Rate::ALL.len(), DType::F64, BufferRole::Input { name: rates_input(&name) });
        updates.push((len, vec![param, grad, m, v, settings, rates, control]));
    }
    let chunk_counts: Vec<usize> = partials.iter().map(|p| p.1).collect();
    let mut args: Vec<BufferId> = partials.iter().map(|p| p.0).collect();
    args.extend([loss, settings, grad_norm, control]);
    b.launch(clip_and_guard(&chunk_counts)?, args);
    for (len, args) in updates {
        b.launch(adamw(len)?, args);
    }
    plan.update_start = Some(start);
    Ok(())
}

/// Entries of the update's control buffer: the clip factor, and 1 where the
/// step applies (else 0).
const CONTROL_LEN: usize = 2;

/// Appends buffers and launches to a Plan, sharing kernels of one structure.
struct Appender<'a> {
    plan: &'a mut Plan,
    by_structure: HashMap<String, usize>,
    /// Next free scratch offset per element type: past everything the Plan
    /// placed, so the update's scratch overlaps nothing.
    free: HashMap<DType, usize>,
}

impl<'a> Appender<'a> {
    fn new(plan: &'a mut Plan) -> Appender<'a> {
        let by_structure = plan.kernels.iter().enumerate().map(|(i, k)| (k.structure_key(), i)).collect();
        let mut free: HashMap<DType, usize> = HashMap::new();
        free.insert(DType::F32, plan.arena_len);
        for d in &plan.buffers {
            if let BufferRole::Scratch { offset } = d.role {
                let end = free.entry(d.dtype).or_default();
                *end = (*end).max(offset + d.len);
            }
        }
        Appender { plan, by_structure, free }
    }

    fn buffer(&mut self, len: usize, dtype: DType, role: BufferRole) -> BufferId {
        let id = BufferId(self.plan.buffers.len());
        self.plan.buffers.push(BufferDecl { id, len, dtype, role, node: None });
        id
    }

    /// A scratch buffer at the next free, 16-element aligned offset (the
    /// alignment the memory planner keeps).
    fn scratch(&mut self, len: usize, dtype: DType) -> BufferId {
        let end = self.free.entry(dtype).or_default();
        let offset = end.next_multiple_of(16);
        *end = offset + len;
        if dtype == DType::F32 {
            self.plan.arena_len = self.plan.arena_len.max(offset + len);
        }
        self.buffer(len, dtype, BufferRole::Scratch { offset })
    }

    fn launch(&mut self, kernel: Kernel, args: Vec<BufferId>) {
        let key = kernel.structure_key();
        let index = match self.by_structure.get(&key) {
            Some(&i) => i,
            None => {
                let name = format!("g{:03}_{}", self.plan.kernels.len(), kernel.name);
                self.plan.kernels.push(Kernel { name, ..kernel });
                self.by_structure.insert(key, self.plan.kernels.len() - 1);
                self.plan.kernels.len() - 1
            }
        };
        self.plan.steps.push(Step::Kernel { kernel: index, args });
    }
}

/// Sums of squares of a gradient of `len` elements over chunks of
/// [`NORM_CHUNK`], in f64: lane `l` of a chunk adds its elements `l`,
/// `l +` [`NORM_LANES`], … in order, and the lanes are combined by halves
/// (lane `i` takes lane `i + s` for `s` = lanes/2, …, 1). Both forms keep
/// exactly this order, so the sums are the same bits on every target:
/// - CUDA: one block per chunk, one thread per lane (adjacent lanes read
///   adjacent elements), the block reduction's tree;
/// - C: one item per chunk, the lanes an array the item fills a row of
///   [`NORM_LANES`] elements at a time (a vector loop; the block form's C
///   rendering walks each lane's strided elements in turn).
fn sum_of_squares(len: usize, target: Target) -> Result<Kernel, KernelError> {
    let chunks = len.div_ceil(NORM_CHUNK);
    let lanes = NORM_LANES as usize;
    let grid = match target {
        Target::Cuda => Grid::block_per_item(chunks, NORM_LANES),
        Target::Cpu => Grid::thread_per_item(chunks),
    };
    let mut k = KernelBuilder::new("sum_of_squares", grid);
    let grad = k.param("grad", DType::F32, Access::Read, len);
    let partial = k.param("partial", DType::F64, Access::Write, chunks);
    let first = k.let_("first", item() * i64(NORM_CHUNK as i64));
    let chunk_end = first.clone() + i64(NORM_CHUNK as i64);
    let end = k.let_("last", select(chunk_end.clone().lt(i64(len as i64)), chunk_end, i64(len as i64)));
    if target == Target::Cuda {
        let part = k.var("part", f64(0.0));
        let sum = part.clone();
        k.for_step("j", first + lane(), end, i64::from(NORM_LANES), Unroll::Auto, |b, j| {
            let x = b.let_("x", grad.at(j).cast(Ty::F64));
            b.assign(&sum, sum.clone() + x.clone() * x);
        });
        let total = k.block_reduce("total", Combine::Sum, part);
        k.if_(lane().eq_(i64(0)), |b| b.store(&partial, item(), total));
    } else {
        let acc = k.local_array("acc", Ty::F64, lanes);
        let zero = acc.clone();
        k.for_("l0", i64(0), i64(lanes as i64), |b, l| b.store(&zero, l, f64(0.0)));
        let rows = acc.clone();
        k.for_step("row", first, end.clone(), lanes as i64, Unroll::Auto, |b, row| {
            // A chunk's last row may be short (a gradient's ragged end).
            let width = b.let_(
                "width",
                select(
                    (row.clone() + i64(lanes as i64)).lt(end.clone()),
                    i64(lanes as i64),
                    end - row.clone(),
                ),
            );
            b.for_("l1", i64(0), width, |b, l| {
                let x = b.let_("x", grad.at(row + l.clone()).cast(Ty::F64));
                b.store(&rows, l.clone(), rows.at(l) + x.clone() * x);
            });
        });
        let mut half = lanes / 2;
        while half > 0 {
            let halves = acc.clone();
            k.for_(&format!("h{half}"), i64(0), i64(half as i64), |b, i| {
                b.store(&halves, i.clone(), halves.at(i.clone()) + halves.at(i + i64(half as i64)));
            });
            half /= 2;
        }
        k.store(&partial, item(), acc.at(i64(0)));
    }
    let kernel = k.finish();
    kernel.validate()?;
    Ok(kernel)
}

/// The global norm from every gradient's chunk sums (added in gradient and
/// chunk order), the clip factor, and whether the step applies.
fn clip_and_guard(chunk_counts: &[usize]) -> Result<Kernel, KernelError> {
    let mut k = KernelBuilder::new("clip_and_guard", Grid::thread_per_item(1));
    let partials: Vec<_> = chunk_counts
        .iter()
        .enumerate()
        .map(|(i, &n)| (k.param(&format!("partial{i}"), DType::F64, Access::Read, n), n))
        .collect();
    let loss = k.param("loss", DType::F32, Access::Read, 1);
    let settings = k.param("settings", DType::F64, Access::Read, Setting::ALL.len());
    let grad_norm = k.param("grad_norm", DType::F64, Access::Write, 1);
    let control = k.param("control", DType::F32, Access::Write, CONTROL_LEN);
    let sum = k.var("sum", f64(0.0));
    for (i, (partial, n)) in partials.into_iter().enumerate() {
        let acc = sum.clone();
        k.for_(&format!("c{i}"), i64(0), i64(n as i64), |b, c| b.assign(&acc, acc.clone() + partial.at(c)));
    }
    let norm = k.let_("norm", sum.sqrt());
    k.store(&grad_norm, i64(0), norm.clone());
    let max = k.let_("max_norm", settings.at(i64(Setting::MaxNorm.index() as i64)));
    let clipped = (max.clone() / (norm.clone() + f64(1e-6))).cast(Ty::F32);
    k.store(&control, i64(0), select(norm.gt(max), clipped, f32(1.0)));
    let l = k.let_("l", loss.at(i64(0)));
    // `l - l` is 0 for every finite value and NaN for infinities and NaN.
    let finite = (l.clone() - l).eq_(f32(0.0));
    let asked = settings.at(i64(Setting::Apply.index() as i64)).ne_(f64(0.0));
    k.store(&control, i64(1), select(asked.and(finite), f32(1.0), f32(0.0)));
    let kernel = k.finish();
    kernel.validate()?;
    Ok(kernel)
}

/// One parameter's AdamW update over its `len` elements, in place; a no-op
/// unless the control buffer says the step applies. The expression order is
/// the host's (`runtime::optim::adamw`), so the results agree bit for bit
/// where neither side contracts multiply-adds.
fn adamw(len: usize) -> Result<Kernel, KernelError> {
    let mut k = KernelBuilder::new("adamw", Grid::thread_per_item(len));
    let p = k.param("param", DType::F32, Access::ReadWrite, len);
    let g = k.param("grad", DType::F32, Access::Read, len);
    let m = k.param("m", DType::F32, Access::ReadWrite, len);
    let v = k.param("v", DType::F32, Access::ReadWrite, len);
    let settings = k.param("settings", DType::F64, Access::Read, Setting::ALL.len());
    let rates = k.param("rates", DType::F64, Access::Read, Rate::ALL.len());
    let control = k.param("control", DType::F32, Access::Read, CONTROL_LEN);
    // Settings and rates are f64, rounded to f32 where the host rounds them.
    let setting = |s: Setting| settings.at(i64(s.index() as i64)).cast(Ty::F32);
    let rate = |r: Rate| rates.at(i64(r.index() as i64)).cast(Ty::F32);
    let applies = control.at(i64(1)).ne_(f32(0.0));
    let scale = control.at(i64(0));
    k.if_(applies, |b| {
        let (b1, b2) = (b.let_("b1", setting(Setting::Beta1)), b.let_("b2", setting(Setting::Beta2)));
        let grad = b.let_("g", g.at(item()) * scale);
        let m1 = b.let_("m1", b1.clone() * m.at(item()) + (f32(1.0) - b1) * grad.clone());
        let v1 = b.let_("v1", b2.clone() * v.at(item()) + (f32(1.0) - b2) * grad.clone() * grad);
        b.store(&m, item(), m1.clone());
        b.store(&v, item(), v1.clone());
        let denom = v1.sqrt() * setting(Setting::InvSqrtBias2) + setting(Setting::Eps);
        b.store(&p, item(), p.at(item()) * rate(Rate::Decay) - rate(Rate::Step) * m1 / denom);
    });
    let kernel = k.finish();
    kernel.validate()?;
    Ok(kernel)
}
