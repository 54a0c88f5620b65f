//! Validation (placeholder until the spec work lands).

/// One validation problem: the field path and a message naming the bad value and what is valid.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}
