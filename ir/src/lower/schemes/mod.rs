//! One module per residual-stream scheme (docs/math.md §0.3 table).

mod fc;
mod ghc;
mod hc;
mod mhc;
mod residual;
mod xhc;

use super::Scheme;
use crate::spec::{ModelSpec, ResidualSpec};

/// The scheme object for a spec.
pub(crate) fn build(spec: &ModelSpec) -> Box<dyn Scheme> {
    match &spec.residual {
        ResidualSpec::Residual => Box::new(residual::PlainResidual::new(spec)),
        ResidualSpec::Hc(hc) => Box::new(hc::Hc::new(spec, hc)),
        ResidualSpec::Fc(fc) => Box::new(fc::Fc::new(spec, fc)),
        ResidualSpec::Ghc(ghc) => Box::new(ghc::Ghc::new(spec, ghc)),
        ResidualSpec::Mhc(mhc) => Box::new(mhc::Mhc::new(spec, mhc)),
        ResidualSpec::Xhc(xhc) => Box::new(xhc::Xhc::new(spec, xhc)),
    }
}
