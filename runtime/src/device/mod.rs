//! The devices that run a model's training step, and the factory that picks
//! one (docs/architecture.md §7).
//!
//! The devices, each depending only on the step contract ([`crate::step`]) and
//! the shared Plan modules below, never on each other or on this factory:
//!
//! - [`reference`]: the unfused graph on the reference interpreter, the oracle.
//! - [`cpu`]: the Cpu device: buffers in host memory, kernels compiled by the
//!   system C compiler and run on a persistent thread pool, matrix products
//!   through widen's AVX-512 kernel or the `gemm` crate; and its
//!   [`crate::step::StepExecutor`], which the training loop uses for `--device cpu`.
//! - [`cuda`]: the Cuda device on an NVIDIA GPU, and its executor.
//!
//! What both compiled devices share, below them:
//!
//! - [`plan_check`]: the load-time checks of a Plan.
//! - `plan_io`: a training Plan's interface buffers (tokens, loss, logits,
//!   parameters and gradients), resolved by role.
//! - `plan_update`: training steps whose optimizer update runs in the Plan.
//! - [`ceilings`]: the host's measured arithmetic and memory rates, which a
//!   Plan's roofline floor divides by.
//! - [`memory`]: the peak memory a run on a compiled device is expected to
//!   hold, counted from its Plan, and the peak it measured.
//!
//! This module itself is the factory above the devices: [`Device`] names
//! one, [`Device::executor`] builds its executor for a lowered model graph.

pub mod ceilings;
pub mod cpu;
pub mod cuda;
pub mod memory;
pub mod plan_check;
mod plan_io;
mod plan_update;
pub mod reference;

use crate::step::statistics::with_statistics;
use crate::step::{StepError, StepExecutor};
use cpu::{CpuExecutor, CpuOptions};
use cuda::CudaExecutor;
use ir::lower::Lowered;
use reference::ReferenceExecutor;

/// The devices a model can run on (docs/architecture.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The unfused graph on the reference interpreter (`ir::exec`), in f32.
    Reference,
    /// The fused Plan on the host: C kernels on all cores, GEMMs through `gemm`
    /// ([`cpu::CpuExecutor`]).
    Cpu,
    /// The fused Plan on GPU 0: CUDA kernels compiled by NVRTC, GEMMs through
    /// cuBLAS ([`cuda::CudaExecutor`]).
    Cuda,
}

impl Device {
    /// The name used on the command line and in metrics (`reference`, `cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            Device::Reference => "reference",
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// The executor for a lowered model graph on this device.
    ///
    /// The reference and Cpu executors are built without touching anything
    /// outside the process (the Cpu Plan is compiled on its first step). The
    /// Cuda executor compiles and loads its Plan here, so a machine without
    /// the CUDA driver gets [`cuda::CudaError::NoCudaDriver`]
    /// now, before any work (and never the panic `cudarc` raises when it
    /// cannot find `libcuda`). Executors are `Send`, so several can be
    /// built at once (Plan compilation dominates).
    pub fn executor(self, lowered: Lowered) -> Result<Box<dyn StepExecutor + Send>, StepError> {
        let statistics = lowered.statistics.clone();
        Ok(match self {
            Device::Reference => Box::new(ReferenceExecutor::from_lowered(lowered)),
            Device::Cpu => {
                with_statistics(CpuExecutor::from_lowered(lowered, CpuOptions::default()), statistics)
            }
            Device::Cuda => with_statistics(cuda_executor(lowered)?, statistics),
        })
    }
}

/// Differentiates, fuses and compiles `lowered` into a training Plan and
/// loads it on GPU 0 ([`CudaExecutor::from_lowered`]: the driver is checked
/// first, so a machine without one fails fast instead of compiling a Plan it
/// cannot run).
pub fn cuda_executor(lowered: Lowered) -> Result<CudaExecutor, StepError> {
    CudaExecutor::from_lowered(lowered, 0)
}
