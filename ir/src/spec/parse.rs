//! Reading and writing spec files (docs/architecture.md §3).
//!
//! Loading goes: read the file, read the RON into a position-keeping tree
//! ([`super::ron_tree`]), report every unknown field and variant name at once
//! ([`super::names`]), parse the typed [`ModelSpec`] with `ron`, then validate
//! ([`ModelSpec::validate`]). Each stage's errors say where: a path, a line and a
//! column, or a field path.
//!
//! Two RON extensions are on by default so specs read naturally:
//! `unwrap_variant_newtypes` (`residual: Ghc(m: 4, n: 16)` rather than
//! `Ghc((m: 4, n: 16))`) and `implicit_some` (`kv_heads: 2` rather than
//! `kv_heads: Some(2)`; `None` still means "use the default").

use std::fmt;
use std::path::Path;

use ron::extensions::Extensions;

use super::limits::integer_limit;
use super::names::{unknown_names, UnknownName};
use super::{ron_tree, FieldError, ModelSpec};

/// Errors loading a spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecLoadError {
    /// The file could not be read.
    #[error("cannot read spec file {path}")]
    Io { path: String, source: std::io::Error },
    /// The text is not RON, or a value has the wrong type.
    #[error("{path}:{line}:{col}: {message}")]
    Syntax { path: String, line: usize, col: usize, message: String },
    /// Field or variant names the spec types do not have (all of them).
    #[error("{path}: {}", List(names))]
    UnknownNames { path: String, names: Vec<UnknownName> },
    /// The spec parsed but breaks validation rules (all of them).
    #[error("{path}: invalid spec: {}", List(errors))]
    Invalid { path: String, errors: Vec<FieldError> },
}

/// Formats one problem inline, or several as an indented list.
struct List<'a, T>(&'a [T]);

impl<T: fmt::Display> fmt::Display for List<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} problems", many.len())?;
                for item in many {
                    write!(f, "\n  - {item}")?;
                }
                Ok(())
            }
        }
    }
}

/// The `ron` options every spec is read and written with.
fn ron_options() -> ron::Options {
    ron::Options::default()
        .with_default_extension(Extensions::UNWRAP_VARIANT_NEWTYPES)
        .with_default_extension(Extensions::IMPLICIT_SOME)
}

/// Reads, parses and validates a spec file.
pub fn load_spec(path: &Path) -> Result<ModelSpec, SpecLoadError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| SpecLoadError::Io { path: shown.clone(), source })?;
    let spec = parse_spec(&text, &shown)?;
    spec.validate().map_err(|errors| SpecLoadError::Invalid { path: shown, errors })?;
    Ok(spec)
}

/// Parses RON text into a spec, reporting unknown names; does not validate.
///
/// `path` only labels errors.
pub fn parse_spec(text: &str, path: &str) -> Result<ModelSpec, SpecLoadError> {
    // Editors on Windows save UTF-8 with a byte-order mark; it is not RON, and `ron`
    // would report "Expected opening `(`" at the first character (README, "What widen guarantees").
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // The tree reader covers the RON that specs use; on anything it cannot read,
    // `ron`'s own error (below) is the one to show.
    let tree = ron_tree::parse(text).ok();
    if let Some(tree) = &tree {
        let names = unknown_names(tree);
        if !names.is_empty() {
            return Err(SpecLoadError::UnknownNames { path: path.to_string(), names });
        }
    }
    ron_options().from_str(text).map_err(|e: ron::error::SpannedError| {
        let (line, col) = (e.position.line, e.position.col);
        // `ron` says what it expected but not for which field; the tree knows.
        let field = tree.as_ref().and_then(|t| ron_tree::value_at(t, ron_tree::Pos { line, col }));
        let message = match field {
            Some((field, value)) => match bad_integer(&field, value) {
                Some(message) => message,
                None => format!("in `{field}`: {}", e.code),
            },
            None => e.code.to_string(),
        };
        SpecLoadError::Syntax { path: path.to_string(), line, col, message }
    })
}

/// For an integer field holding a number that is not a whole number in range
/// (`-4`, `2.5`, `1e99`, a 30-digit literal), the message naming the field and its
/// valid range ([`super::limits`]); `ron` alone says "Expected integer" or
/// "Expected comma" without either (README, "What widen guarantees").
fn bad_integer(field: &str, value: &ron_tree::Node) -> Option<String> {
    let limit = integer_limit(field)?;
    let written = match value {
        ron_tree::Node::Number(raw) => Some(raw),
        // A list of integers (`conv_kernels`): its first bad item.
        ron_tree::Node::List(items) => items.iter().find_map(|item| match item {
            ron_tree::Node::Number(raw) if !is_unsigned(raw) => Some(raw),
            _ => None,
        }),
        _ => None,
    }?;
    if is_unsigned(written) {
        return None;
    }
    Some(format!("in `{field}`: {written} is not valid; `{field}` must be {}", limit.describe()))
}

/// Whether `raw` is an unsigned integer literal that fits in 64 bits, as `ron` reads them.
fn is_unsigned(raw: &str) -> bool {
    let digits: String = raw.chars().filter(|&c| c != '_').collect();
    let digits = digits.strip_prefix('+').unwrap_or(&digits);
    let (radix, body) = match digits.get(..2) {
        Some("0x") => (16, &digits[2..]),
        Some("0o") => (8, &digits[2..]),
        Some("0b") => (2, &digits[2..]),
        _ => (10, digits),
    };
    !body.is_empty() && u64::from_str_radix(body, radix).is_ok()
}

impl ModelSpec {
    /// Parses and validates RON text (as [`load_spec`] does for a file).
    pub fn from_ron_str(text: &str) -> Result<ModelSpec, SpecLoadError> {
        const LABEL: &str = "<spec>";
        let spec = parse_spec(text, LABEL)?;
        spec.validate().map_err(|errors| SpecLoadError::Invalid { path: LABEL.to_string(), errors })?;
        Ok(spec)
    }

    /// Pretty RON that [`parse_spec`] reads back to an equal spec (checkpoint headers).
    pub fn to_ron(&self) -> String {
        let pretty = ron::ser::PrettyConfig::new().struct_names(false);
        // Serializing plain data to a String cannot fail: every field is a number,
        // string, bool, tuple, list, option or enum.
        ron_options().to_string_pretty(self, pretty).expect("spec serializes to RON")
    }
}
