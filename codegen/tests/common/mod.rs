//! The codegen tests' shared fixtures: `kernels` (canonical hand-built kernels, each with the
//! plain Rust computation it must match) and `emit` (graphs and spec training graphs lowered
//! and run against the reference executor). Each test file uses a subset.
#![allow(dead_code)]

pub mod emit;
pub mod kernels;
