//! One module per residual-stream scheme (MATH.md §0.3 table).

mod residual;

use super::Scheme;
use crate::spec::{ModelSpec, ResidualSpec};

/// The scheme object for a spec.
pub(crate) fn build(spec: &ModelSpec) -> Box<dyn Scheme> {
    match &spec.residual {
        ResidualSpec::Residual => Box::new(residual::PlainResidual::new(spec)),
        other => todo!("scheme {}", other.kind_name()),
    }
}
