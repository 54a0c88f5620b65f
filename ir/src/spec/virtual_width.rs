//! The trait behind `#[derive(VirtualWidth)]` (docs/architecture.md §1).

use super::ModelSpec;
use crate::lower::{lower, LowerError, Lowered};

/// A Rust type that names a model: the derive-macro counterpart of a RON spec file.
///
/// `#[derive(VirtualWidth)]` (re-exported by the `widen` facade under the same
/// name) implements it from `#[widen(...)]` attributes after running
/// [`ModelSpec::validate`] at compile time, so `spec()` always returns a spec
/// that passes the same checks as one loaded from RON, and everything after it
/// is the RON path's pipeline (docs/architecture.md §2).
pub trait VirtualWidth {
    /// The model's spec, already validated.
    fn spec() -> ModelSpec;

    /// The forward training graph for one step of the spec's own `train.batch` x
    /// `train.seq_len` (docs/math.md §0.3 lowering).
    fn graph() -> Result<Lowered, LowerError> {
        let spec = Self::spec();
        lower(&spec, spec.train.batch, spec.train.seq_len)
    }
}
