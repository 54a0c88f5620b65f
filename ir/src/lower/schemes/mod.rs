//! The residual-stream schemes (docs/math.md §0.3 table): the plain residual, xHC, and the
//! connection language, through which HC, FC, mHC and GHC lower as spellings
//! (docs/connections.md), with its depth history (docs/math.md §12.5) in `history`.

mod connection;
mod history;
mod residual;
mod xhc;

use super::Scheme;
use crate::spec::{ModelSpec, ResidualSpec};

/// The scheme object for a spec.
pub(crate) fn build(spec: &ModelSpec) -> Box<dyn Scheme> {
    match &spec.residual {
        ResidualSpec::Residual => Box::new(residual::PlainResidual::new(spec)),
        ResidualSpec::Xhc(xhc) => Box::new(xhc::Xhc::new(spec, xhc)),
        ResidualSpec::Hc(_)
        | ResidualSpec::Fc(_)
        | ResidualSpec::Mhc(_)
        | ResidualSpec::Ghc(_)
        | ResidualSpec::Connection(_) => {
            let design = spec.residual.connection().expect("every stream design but xHC is a connection");
            if design.history.is_some() {
                Box::new(history::DepthHistory::new(spec, design))
            } else {
                Box::new(connection::Connection::new(spec, design))
            }
        }
    }
}
