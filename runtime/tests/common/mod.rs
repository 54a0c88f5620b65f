//! The runtime tests' shared fixtures: `plan` (hand-built Plans' kernels, buffers and data),
//! `run` (a tiny spec, temporary run folders, quiet options, metrics readers), `spec` (a spec
//! from `specs/` shrunk to test size) and `tiny_model` (f64 reference models for gradient
//! checks). Each test file uses a subset.
#![allow(dead_code)]

pub mod plan;
pub mod run;
pub mod spec;
pub mod tiny_model;
