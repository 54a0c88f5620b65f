//! The memory a training run holds at its peak: expected from the compiled
//! Plan, and measured (docs/performance.md, "Memory").
//!
//! The closed-form estimate of `ir::cost::training_memory` refuses a spec too
//! large for the machine before anything is built; once a spec is known to
//! fit, its Plan is cheap to build (lowering and planning, no kernels
//! compiled), and what the devices allocate is read off it exactly. This
//! module adds what the process holds beside the Plan, each term the
//! allocation it stands for:
//!
//! - the Plan's persistent buffers (parameters, gradients, optimizer moments,
//!   inputs, outputs, constants) and its scratch arenas, one
//!   per element type, laid out as [`super::cpu`] and [`super::cuda`] do;
//! - the trainer's own f32 copy of the parameters (`crate::params::ParamSet`);
//! - the host optimizer's state (`crate::optim::Optimizer`): allocated zeroed
//!   for every parameter, it becomes resident only where it is written: by the
//!   host update (Muon, or any step the Plan's AdamW does not take) every step,
//!   and by the moments read back from the Plan before each checkpoint;
//! - what a run copies for a moment: a checkpoint encodes one tensor at a time
//!   (`crate::checkpoint`);
//! - the training data held in memory (text and the synthetic corpus; token
//!   shards are memory-mapped, their pages resident as windows are read);
//! - the process itself: code, libraries, the loaded kernel module, thread
//!   stacks and per-thread GEMM packing buffers ([`PROCESS_BASE_BYTES`],
//!   [`PROCESS_BYTES_PER_THREAD`], measured on Linux).
//!
//! The measured side is the resident-set high-water mark of the process on the
//! host ([`host_peak_bytes`]) and the Cuda device's own allocation high-water
//! mark on the GPU ([`super::cuda::allocated_peak_bytes`]).

use super::Device;
use codegen::compile::Target;
use codegen::plan::{BufferRole, Plan};
use codegen::training::{TrainingError, TrainingGraph};
use ir::graph::{Graph, Op};
use ir::lower::LowerError;
use ir::spec::{DataSpec, ModelSpec, OptimizerSpec};
use ir::DType;
use serde::Serialize;

/// Resident bytes of the process beside everything counted from the Plan and
/// the spec: code, libraries, the kernel module, allocator and runtime state.
/// Measured on Linux x86-64 as `VmHWM` less the counted parts of small runs.
pub const PROCESS_BASE_BYTES: u64 = 16 << 20;

/// Resident bytes per worker thread of the Cpu device: its stack as touched and
/// the packed GEMM blocks (`MC x KC` of `a`, `KC x NC` of `b`: about 1.1 MiB of
/// f32, `cpu::sgemm`), with the `gemm` crate's own buffers.
pub const PROCESS_BYTES_PER_THREAD: u64 = 2 << 20;

/// Why no Plan-based estimate could be made.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    #[error("the reference device runs the unfused graph, not a Plan")]
    NoPlan,
    #[error(transparent)]
    Lower(#[from] LowerError),
    #[error(transparent)]
    Training(#[from] TrainingError),
}

/// What the process does besides training steps: it decides which host copies
/// become resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// `widen train`: validation, and a checkpoint at least at the end.
    Train,
    /// `widen bench`: training steps only.
    Steps,
}

/// Which memory a part is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Memory {
    Host,
    Gpu,
}

/// One term of an estimate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryPart {
    /// What it is, as printed (`Plan arena`, `host parameters`, ...).
    pub name: &'static str,
    pub memory: Memory,
    pub bytes: u64,
}

/// The expected peak of one run, by part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeakEstimate {
    /// The device the Plan is laid out for (`cpu` or `cuda`).
    pub device: &'static str,
    /// The peak on the device's own memory: the host's for `cpu`, the GPU's for `cuda`.
    pub bytes: u64,
    /// The peak on the host (equal to `bytes` for `cpu`).
    pub host_bytes: u64,
    pub parts: Vec<MemoryPart>,
}

impl PeakEstimate {
    fn of(device: Device, parts: Vec<MemoryPart>) -> PeakEstimate {
        let sum = |memory: Memory| parts.iter().filter(|p| p.memory == memory).map(|p| p.bytes).sum::<u64>();
        let host_bytes = sum(Memory::Host);
        let bytes = if device == Device::Cuda { sum(Memory::Gpu) } else { host_bytes };
        PeakEstimate { device: device.name(), bytes, host_bytes, parts }
    }

    /// The parts in `memory`, as `1.23 GiB name` joined by commas (parts under
    /// 0.005 GiB are left out).
    pub fn parts_text(&self, memory: Memory) -> String {
        let shown: Vec<String> = self
            .parts
            .iter()
            .filter(|p| p.memory == memory && gib(p.bytes) >= 0.005)
            .map(|p| format!("{:.2} GiB {}", gib(p.bytes), p.name))
            .collect();
        shown.join(", ")
    }
}

/// Bytes the devices allocate for a Plan: its persistent buffers, and its
/// scratch arenas (one per element type, each covering `arena_len` for f32
/// and every scratch buffer's `offset + len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanMemory {
    pub persistent_bytes: u64,
    pub arena_bytes: u64,
}

impl PlanMemory {
    /// As `device` allocates `plan` (the Cpu device aligns each of its four
    /// arenas to a cache line, 64 elements more each).
    pub fn of(plan: &Plan, device: Device) -> PlanMemory {
        const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::Bf16, DType::I32];
        let slot = |dt: DType| DTYPES.iter().position(|&d| d == dt).unwrap_or(0);
        let mut arena_len = [0u64; 4];
        arena_len[0] = plan.arena_len as u64;
        let mut persistent_bytes = 0u64;
        for d in &plan.buffers {
            let len = d.len as u64;
            match d.role {
                BufferRole::Scratch { offset } => {
                    let s = slot(d.dtype);
                    arena_len[s] = arena_len[s].max(offset as u64 + len);
                }
                _ => persistent_bytes += len * d.dtype.size_bytes() as u64,
            }
        }
        let pad = if device == Device::Cpu { 64 } else { 0 };
        let arena_bytes = DTYPES
            .iter()
            .zip(arena_len)
            .filter(|(_, len)| pad > 0 || *len > 0)
            .map(|(dt, len)| (len + pad) * dt.size_bytes() as u64)
            .sum();
        PlanMemory { persistent_bytes, arena_bytes }
    }
}

/// GiB, for messages.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// The expected peak of a run of `spec` at its own `train.batch` and
/// `train.seq_len` on `device` (`cpu` or `cuda`): lowers the spec, builds its
/// training Plan for the device and counts it ([`expected_peak`]). Call it only
/// for a spec within this machine's limits (`ModelSpec::check_fits`): lowering
/// allocates the graph, though no parameter values.
pub fn expected_training_peak(
    spec: &ModelSpec,
    device: Device,
    workload: Workload,
) -> Result<PeakEstimate, EstimateError> {
    let target = match device {
        Device::Cpu => Target::Cpu,
        Device::Cuda => Target::Cuda,
        Device::Reference => return Err(EstimateError::NoPlan),
    };
    let lowered = ir::lower::lower(spec, spec.train.batch, spec.train.seq_len)?;
    let graph = lowered.graph.clone();
    let plan = TrainingGraph::new(lowered)?.plan_for(target)?;
    Ok(expected_peak(spec, &graph, &plan, device, workload, threads()))
}

/// The Cpu device's threads per launch (`cpu::CpuOptions::default`).
fn threads() -> usize {
    super::cpu::CpuOptions::default().threads
}

/// The expected peak of a run of `spec`, whose lowered model graph is `graph`,
/// with `plan` loaded on `device` (see the module doc for each part). `threads`
/// is the Cpu device's worker count.
pub fn expected_peak(
    spec: &ModelSpec,
    graph: &Graph,
    plan: &Plan,
    device: Device,
    workload: Workload,
    threads: usize,
) -> PeakEstimate {
    let on_plan = if device == Device::Cuda { Memory::Gpu } else { Memory::Host };
    let layout = PlanMemory::of(plan, device);
    let mut parts = vec![
        MemoryPart { name: "Plan persistent buffers", memory: on_plan, bytes: layout.persistent_bytes },
        MemoryPart { name: "Plan arena", memory: on_plan, bytes: layout.arena_bytes },
    ];

    // The host's parameters and optimizer state, as `Optimizer::new` lays it out.
    let muon = matches!(spec.train.optimizer, OptimizerSpec::Muon(_));
    let (mut values, mut state, mut largest) = (0u64, 0u64, 0u64);
    for id in graph.params() {
        let node = graph.node(id);
        let Op::Param(info) = &node.op else { continue };
        let n = node.shape.numel() as u64;
        values += 4 * n;
        largest = largest.max(4 * n);
        let on_muon = muon && info.class.optimized() && info.class.muon_eligible() && node.shape.rank() >= 2;
        state += if on_muon { 4 * n } else { 8 * n };
    }
    parts.push(MemoryPart { name: "host parameters", memory: Memory::Host, bytes: values });
    // The host updates every step unless the Plan's AdamW takes it.
    let host_update = muon || plan.update_start.is_none();
    if host_update || workload == Workload::Train {
        parts.push(MemoryPart { name: "host optimizer state", memory: Memory::Host, bytes: state });
    }
    if workload == Workload::Train {
        // The checkpoint encodes one tensor at a time. (Validation reads the
        // `loss_main` output, never the logits, which the training Plan does not
        // hold: docs/math.md §1.7.)
        parts.push(MemoryPart { name: "checkpoint tensor", memory: Memory::Host, bytes: largest });
    }
    let data = match &spec.train.data {
        DataSpec::Synthetic(_) => crate::data::SYNTHETIC_BYTES as u64,
        DataSpec::Text(path) => std::fs::metadata(path).map_or(0, |m| m.len()),
        DataSpec::Tokens(_) => 0,
    };
    parts.push(MemoryPart { name: "data", memory: Memory::Host, bytes: data });
    let threads = if device == Device::Cpu { threads.max(1) as u64 } else { 1 };
    parts.push(MemoryPart {
        name: "process",
        memory: Memory::Host,
        bytes: PROCESS_BASE_BYTES + PROCESS_BYTES_PER_THREAD * threads,
    });
    PeakEstimate::of(device, parts)
}

/// The resident-set high-water mark of this process in bytes (`VmHWM` of
/// `/proc/self/status`), or `None` where the system does not report it.
pub fn host_peak_bytes() -> Option<u64> {
    parse_vm_hwm(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// `VmHWM:   123456 kB` -> bytes.
fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut words = line["VmHWM:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

/// The peak a run measured so far, where the platform reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MeasuredPeak {
    /// The process's resident-set high-water mark ([`host_peak_bytes`]).
    pub host_bytes: Option<u64>,
    /// On `cuda`: the most the Cuda device had allocated at once
    /// ([`super::cuda::allocated_peak_bytes`]): the Plan's buffers, without the
    /// CUDA context or cuBLAS's workspace, which the driver and cuBLAS allocate.
    pub gpu_bytes: Option<u64>,
}

impl MeasuredPeak {
    /// The peak of this process so far, on `device`'s memories.
    pub fn now(device: Device) -> MeasuredPeak {
        let gpu_bytes = (device == Device::Cuda).then(super::cuda::allocated_peak_bytes);
        MeasuredPeak { host_bytes: host_peak_bytes(), gpu_bytes }
    }

    /// The peak on the memory an estimate for `device` names first: the host's
    /// for `cpu`, the GPU's for `cuda`.
    pub fn device_bytes(&self, device: Device) -> Option<u64> {
        if device == Device::Cuda {
            self.gpu_bytes
        } else {
            self.host_bytes
        }
    }

    /// `3.21 GiB resident (VmHWM)`, with the GPU's figure first on `cuda`.
    pub fn text(&self) -> String {
        let host = match self.host_bytes {
            Some(b) => format!("{:.2} GiB resident on the host (VmHWM)", gib(b)),
            None => "host resident peak unavailable (no /proc/self/status on this system)".into(),
        };
        match self.gpu_bytes {
            Some(g) => format!("{:.2} GiB allocated on the GPU at most (Plan buffers), {host}", gib(g)),
            None => host,
        }
    }
}

/// How far above the machine's memory the closed-form estimate may lie before a spec is
/// refused without consulting its Plan. The closed form overcounts activations (every
/// stored op output of the unfused graph: 22 GiB at GPT-2-small mHC, whose Plan needs
/// 11.6 GiB), and lowering a spec within this factor of the machine is cheap (the graph,
/// no parameter values); beyond it, refusing on the closed form alone is safe.
pub const CLOSED_FORM_SLACK: f64 = 4.0;

/// Whether training `spec` on `device` fits in `available` bytes of host memory, checked
/// before anything is allocated for it. The closed form
/// ([`ModelSpec::check_fits`]) passes most specs at once; one it puts above the machine,
/// but within [`CLOSED_FORM_SLACK`] of it, is judged by its Plan's expected peak
/// ([`expected_training_peak`]; the host's share on the Cuda device). The error names the
/// field of the largest share, as the closed form's does.
pub fn check_fits(spec: &ModelSpec, available: u64, device: Device) -> Result<(), ir::spec::FieldError> {
    let Err(closed) = spec.check_fits(available) else { return Ok(()) };
    let estimate = ir::cost::training_memory(spec).total_bytes;
    if device == Device::Reference || estimate > CLOSED_FORM_SLACK * available as f64 {
        return Err(closed);
    }
    match expected_training_peak(spec, device, Workload::Train) {
        Ok(peak) if peak.host_bytes <= available => Ok(()),
        Ok(peak) => Err(ir::spec::FieldError {
            path: closed.path.clone(),
            message: format!(
                "training needs about {:.1} GiB on the host (its {} Plan: {}), above the {:.1} GiB of memory \
                 available (reduce `{}`)",
                gib(peak.host_bytes),
                peak.device,
                peak.parts_text(Memory::Host),
                gib(available),
                closed.path
            ),
        }),
        // A spec that does not lower has its own error where it is built.
        Err(_) => Err(closed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use codegen::plan::{BufferDecl, BufferId};

    /// Between the Plan's peak and the closed form, the Plan decides; below the Plan's
    /// peak the error names the field and the Plan; past the slack the closed form
    /// refuses without lowering.
    #[test]
    fn the_plan_judges_a_spec_the_closed_form_alone_would_refuse() {
        let mut spec = ModelSpec { vocab: 4096, d_model: 64, layers: 2, heads: 2, ..ModelSpec::default() };
        spec.train.batch = 16;
        spec.train.seq_len = 256;
        let closed = ir::cost::training_memory(&spec).total_bytes;
        let plan = expected_training_peak(&spec, Device::Cpu, Workload::Train).expect("plan").host_bytes;
        assert!((plan as f64) < closed, "the closed form bounds the Plan: {plan} vs {closed}");
        let between = ((plan as f64 + closed) / 2.0) as u64;
        assert!(spec.check_fits(between).is_err(), "the closed form alone refuses");
        assert!(check_fits(&spec, between, Device::Cpu).is_ok(), "the Plan fits");
        let e = check_fits(&spec, plan - 1, Device::Cpu).expect_err("the Plan does not fit");
        assert!(
            e.message.starts_with("training needs about") && e.message.contains("cpu Plan"),
            "{}",
            e.message
        );
        assert_eq!(e.path, spec.check_fits(plan - 1).expect_err("closed form").path);
        let far = (closed / (2.0 * CLOSED_FORM_SLACK)) as u64;
        let e = check_fits(&spec, far, Device::Cpu).expect_err("far too large");
        assert!(!e.message.contains("Plan"), "refused on the closed form alone: {}", e.message);
        assert!(check_fits(&spec, between, Device::Reference).is_err(), "the reference runs no Plan");
    }

    #[test]
    fn reads_vm_hwm_in_kilobytes() {
        let status = "Name:\twiden\nVmPeak:\t  900 kB\nVmHWM:\t   26552 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(26552 * 1024));
        assert_eq!(parse_vm_hwm("VmRSS:\t 100 kB\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\t 100 MB\n"), None);
    }

    #[test]
    fn this_process_has_a_resident_peak_on_linux() {
        if cfg!(target_os = "linux") {
            let peak = host_peak_bytes().expect("VmHWM on Linux");
            assert!(peak > 1 << 20, "{peak}");
        }
    }

    fn decl(id: usize, dtype: DType, len: usize, role: BufferRole) -> BufferDecl {
        BufferDecl { id: BufferId(id), node: None, dtype, len, role }
    }

    /// Persistent buffers at their own sizes; each arena covers the furthest
    /// scratch buffer of its type, and `arena_len` for f32.
    #[test]
    fn plan_memory_is_the_devices_layout() {
        let plan = Plan {
            kernels: vec![],
            steps: vec![],
            chains: vec![],
            buffers: vec![
                decl(0, DType::F32, 100, BufferRole::Param { name: "w".into() }),
                decl(1, DType::I32, 10, BufferRole::Input { name: "tokens".into() }),
                decl(2, DType::F32, 50, BufferRole::Scratch { offset: 200 }),
                decl(3, DType::F64, 8, BufferRole::Scratch { offset: 4 }),
            ],
            arena_len: 300,
            update_start: None,
        };
        let cuda = PlanMemory::of(&plan, Device::Cuda);
        assert_eq!(cuda.persistent_bytes, 400 + 40);
        assert_eq!(cuda.arena_bytes, 300 * 4 + 12 * 8);
        let cpu = PlanMemory::of(&plan, Device::Cpu);
        assert_eq!(cpu.persistent_bytes, 440);
        assert_eq!(cpu.arena_bytes, (300 + 64) * 4 + (12 + 64) * 8 + 64 * 2 + 64 * 4);
    }
}
