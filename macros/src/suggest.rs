//! "Did you mean" suggestions for misspelled keys and variant names.

use ir::spec::edit_distance;

/// The closest candidate, if it is close enough to be a plausible typo:
/// within a third of the word's length (at least 1), so `d_modle` suggests
/// `d_model` but `foo` suggests nothing.
pub fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// `unknown key `x`; did you mean `y`?` or, with no close match, the valid set.
pub fn unknown(what: &str, word: &str, candidates: &[&str]) -> String {
    match closest(word, candidates) {
        Some(c) => format!("unknown {what} `{word}`; did you mean `{c}`?"),
        None => format!("unknown {what} `{word}`; expected one of {}", list(candidates)),
    }
}

/// "`a`, `b`, `c`".
pub fn list(items: &[&str]) -> String {
    items.iter().map(|i| format!("`{i}`")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_counts_edits() {
        assert_eq!(edit_distance("d_modle", "d_model"), 1);
        assert_eq!(edit_distance("dpeth", "depth"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("heads", "heads"), 0);
        assert_eq!(edit_distance("kv_head", "kv_heads"), 1);
    }

    #[test]
    fn suggests_only_plausible_typos() {
        let keys = ["d_model", "heads", "kv_heads", "layers"];
        assert_eq!(closest("d_modle", &keys), Some("d_model"));
        assert_eq!(closest("layer", &keys), Some("layers"));
        assert_eq!(closest("foo", &keys), None);
        assert!(unknown("key", "foo", &keys).contains("expected one of `d_model`"));
    }
}
