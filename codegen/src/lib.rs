//! `codegen`: the kernel IR, the C / CUDA renderers and the compiler drivers
//! (docs/architecture.md §6).
//!
//! - [`kernel`]: a small structured AST with concrete sizes, and a builder.
//! - [`render`]: one C-family printer with a C and a CUDA dialect.
//! - [`cc`]: compiles a C module with the system compiler, caches and loads it.
//! - [`cuda_emu`]: compiles the CUDA dialect as C++ with a header of CUDA
//!   built-ins and runs its kernels on the CPU (block threads as fibers).
//! - [`plan_report`]: `plan.txt`, each Plan step's cost and `kernels.tsv` (the input of a
//!   roofline).
//! - [`nvrtc`]: compiles a CUDA module with a dynamically loaded NVRTC and
//!   reports per-kernel resources from the ptxas report.
//! - [`training`]: the pipeline of one training step, from a lowered model graph
//!   to its Plan (autodiff, the passes before fusion, fusion, compilation).
//!
//! With the `serde` feature the Plan and the kernel IR are serializable (the
//! standalone trainers embed their Plans as JSON, docs/architecture.md §7).

pub mod cc;
pub mod compile;
pub mod cuda_emu;
pub mod emit;
pub mod kernel;
pub mod nvrtc;
pub mod optimizer;
pub mod plan;
pub mod plan_report;
pub mod render;
pub mod training;
