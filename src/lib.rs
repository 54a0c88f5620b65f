//! widen: a compiler for transformer language models with expanded residual streams.
//!
//! This crate is the CLI and a facade over the pipeline crates (DESIGN.md §2):
//! [`ir`] (spec, graph, autodiff, cost model, reference executor), [`codegen`]
//! (kernels and renderers) and [`runtime`] (devices, optimizers, training).

pub use codegen;
pub use ir;
pub use runtime;
