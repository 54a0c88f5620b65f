//! The ir tests' shared fixtures, one submodule per area: `exec` (a seeded generator, graphs
//! that remember their bound sources, tolerant compares) and `passes` (specs shrunk to test
//! size, their training graphs, the reference values a pass must keep), `moe` (MoE models'
//! parameters bound by name). Each test file uses a subset.
#![allow(dead_code)]

pub mod exec;
pub mod moe;
pub mod passes;
