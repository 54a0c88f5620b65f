//! Devices that execute a compiled [`codegen::plan::Plan`] (DESIGN.md §7).
//!
//! - [`cpu`]: the Cpu device: buffers in host memory, kernels compiled by the
//!   system C compiler and run on a persistent thread pool, matrix products
//!   through the AVX-512 kernel of `sgemm.rs` or the `gemm` crate.
//! - [`executor`]: the [`crate::executor::StepExecutor`] over a Cpu device,
//!   which the training loop uses for `--device cpu`.
//! - [`plan_check`]: the load-time checks of a Plan both devices share.
//! - `update`: training steps whose optimizer update runs in the Plan, the
//!   protocol both executors share.

pub mod cpu;
pub mod cuda;
pub mod executor;
pub mod plan_check;
mod pool;
mod sgemm;
mod update;
