//! Devices that execute a compiled [`codegen::plan::Plan`] (docs/architecture.md §7).
//!
//! - [`cpu`]: the Cpu device: buffers in host memory, kernels compiled by the
//!   system C compiler and run on a persistent thread pool, matrix products
//!   through the AVX-512 kernel of `sgemm.rs` or the `gemm` crate.
//! - [`executor`]: the [`crate::executor::StepExecutor`] over a Cpu device,
//!   which the training loop uses for `--device cpu`.
//! - [`ceilings`]: the host's measured arithmetic and memory rates, which a
//!   Plan's roofline floor divides by.
//! - [`plan_check`]: the load-time checks of a Plan both devices share.
//! - `update`: training steps whose optimizer update runs in the Plan, the
//!   protocol both executors share.

pub mod ceilings;
pub mod cpu;
pub mod cpu_executor;
pub mod cuda;
mod paired_gemm;
pub mod plan_check;
mod pool;
mod sgemm;
mod update;
