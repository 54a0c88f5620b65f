//! `codegen`: the kernel IR, the C / CUDA renderers and the compiler drivers
//! (docs/architecture.md §6).
//!
//! - [`kernel`]: a small structured AST with concrete sizes, and a builder.
//! - [`render`]: one C-family printer with a C and a CUDA dialect.
//! - [`cc`]: compiles a C module with the system compiler, caches and loads it.
//! - [`nvrtc`]: compiles a CUDA module with a dynamically loaded NVRTC and
//!   reports per-kernel resources from the ptxas report.

pub mod cc;
pub mod compile;
pub mod emit;
pub mod kernel;
pub mod nvrtc;
pub mod optimizer;
pub mod plan;
pub mod render;
