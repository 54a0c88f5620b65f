//! RON parsing with positions (placeholder until the spec work lands).
use super::{FieldError, ModelSpec};

/// Errors loading a spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecLoadError {
    #[error("cannot read spec file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}:{line}:{col}: {message}")]
    Syntax { path: String, line: usize, col: usize, message: String },
    #[error("{path}: invalid spec ({} problem(s))", errors.len())]
    Invalid { path: String, errors: Vec<FieldError> },
}

/// Parses RON text into a spec (no validation).
pub fn parse_spec(text: &str, path: &str) -> Result<ModelSpec, SpecLoadError> {
    let opts = ron::Options::default().with_default_extension(ron::extensions::Extensions::UNWRAP_VARIANT_NEWTYPES);
    opts.from_str(text).map_err(|e: ron::error::SpannedError| SpecLoadError::Syntax {
        path: path.to_string(),
        line: e.position.line,
        col: e.position.col,
        message: e.code.to_string(),
    })
}
