//! Unknown field and variant names in a spec, all reported at once.
//!
//! serde's `deny_unknown_fields` stops at the first unknown name and does not say
//! where it was written. Here the spec's own `Deserialize` impls are driven over the
//! position-keeping tree from [`super::ron_tree`]: every `deserialize_struct` call
//! hands over the type's field names and every `deserialize_enum` its variant
//! names, so the schema is the types themselves and cannot drift from them. The
//! walk feeds placeholder scalars (the typed parse by `ron` reads the real values
//! afterwards), and records unknown names without stopping: an unknown field is
//! skipped, an unknown variant is replaced by a placeholder (its contents have no
//! schema to check against).

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
use serde::Deserialize;

use super::ron_tree::{Field, Node, Pos};
use super::{edit_distance, ModelSpec};

/// An unknown field or variant name, with where it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// The unknown field's path (`residual.nn`), or for an unknown variant the path
    /// of the field holding it (`residual`).
    pub path: String,
    /// 1-based line of the name.
    pub line: usize,
    /// 1-based column of the name.
    pub col: usize,
    /// What is wrong, a suggestion when one valid name is close, and the valid names.
    pub message: String,
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.col, self.message)
    }
}

/// Every unknown field and variant name in a parsed spec tree, in text order.
pub(crate) fn unknown_names(root: &Node) -> Vec<UnknownName> {
    let sink = RefCell::new(Vec::new());
    let walker = Walker {
        node: Some(root),
        path: String::new(),
        label: None,
        newtype: false,
        pos: Pos { line: 1, col: 1 },
        sink: &sink,
    };
    // An `Err` means the walk was cut short by a value the typed parse will reject
    // anyway (a duplicate field, say); the names found so far stand.
    let _ = ModelSpec::deserialize(walker);
    let mut names = sink.into_inner();
    names.sort_by_key(|n| (n.line, n.col));
    names
}

/// Names other projects and papers use for a variant widen calls differently:
/// (the other name, widen's variant, why). Virtual Width Networks are built from
/// generalized hyper-connections, which widen names `Ghc` (docs/math.md §5).
const ALIASES: &[(&str, &str, &str)] = &[
    ("vwn", "Ghc", "Virtual Width Networks are `Ghc` in widen, docs/math.md §5"),
    ("dghc", "Ghc", "dynamic GHC is `Ghc` in widen, docs/math.md §5"),
];

/// widen's variant for a name another source uses (`Vwn` -> `Ghc`), with why,
/// when that variant is among `variants`.
fn alias<'k>(given: &str, variants: &[&'k str]) -> Option<(&'k str, &'static str)> {
    let g = given.to_lowercase();
    let (_, to, why) = ALIASES.iter().find(|(from, _, _)| *from == g)?;
    variants.iter().find(|v| *v == to).map(|v| (*v, *why))
}

/// Every field path the spec accepts (`train.optimizer.lr`), through every variant
/// of every scheme and choice, with the variant that holds it (`Xhc` for
/// `residual.k`; `None` for a field of no variant): the spec reference's rows
/// ([`super::reference::sections`]), read once.
fn known_paths() -> &'static [(String, Option<String>)] {
    static PATHS: std::sync::OnceLock<Vec<(String, Option<String>)>> = std::sync::OnceLock::new();
    PATHS.get_or_init(|| {
        let mut paths: Vec<(String, Option<String>)> = super::reference::sections()
            .into_iter()
            .flat_map(|s| {
                let variant = s.variants.last().map(|(_, v)| v.clone());
                s.fields.into_iter().map(move |f| (f.path, variant.clone()))
            })
            .collect();
        paths.sort();
        paths.dedup();
        paths
    })
}

/// Every field path the spec accepts, sorted, each once.
pub fn field_paths() -> Vec<&'static str> {
    let mut paths: Vec<&'static str> = known_paths().iter().map(|(p, _)| p.as_str()).collect();
    paths.dedup();
    paths
}

/// The field paths a mistyped `path` most likely meant: the known paths
/// ([`field_paths`]) whose last name is the given path's (`train.lr` ->
/// `train.optimizer.lr`), else whose last name is close to it ([`suggest`]); those
/// sharing more leading names with `path` first, at most three. Never `path` itself.
pub fn similar_paths(path: &str) -> Vec<&'static str> {
    let all = field_paths();
    let leaf_of = |p: &str| p.rsplit('.').next().unwrap_or(p).to_lowercase();
    let leaf = leaf_of(path);
    let others = || all.iter().copied().filter(|p| *p != path);
    let mut found: Vec<&'static str> = others().filter(|p| leaf_of(p) == leaf).collect();
    if found.is_empty() {
        let mut leaves: Vec<String> = others().map(leaf_of).filter(|l| *l != leaf).collect();
        leaves.sort();
        leaves.dedup();
        let refs: Vec<&str> = leaves.iter().map(String::as_str).collect();
        if let Some(close) = suggest(&leaf, &refs) {
            found = others().filter(|p| leaf_of(p) == close).collect();
        }
    }
    let given: Vec<&str> = path.split('.').collect();
    let shared = |p: &str| p.split('.').zip(&given).take_while(|(a, b)| a == *b).count();
    found.sort_by_key(|p| (std::cmp::Reverse(shared(p)), p.split('.').count(), *p));
    found.truncate(3);
    found
}

/// What a path that does not exist where it was written most likely meant: the
/// variants that have it, when it is a field of other variants (`residual.k` is
/// `Xhc`'s), else [`similar_paths`] (`did you mean `train.optimizer.lr`?`); empty
/// when nothing is close.
pub fn path_hint(path: &str) -> String {
    let mut variants: Vec<&str> =
        known_paths().iter().filter(|(p, _)| p == path).filter_map(|(_, v)| v.as_deref()).collect();
    variants.dedup();
    if !variants.is_empty() {
        let quoted: Vec<String> = variants.iter().map(|v| format!("`{v}`")).collect();
        return format!("`{path}` is a field of {}, not of the variant written there", quoted.join(", "));
    }
    let found = similar_paths(path);
    match found.as_slice() {
        [] => String::new(),
        [one] => format!("did you mean `{one}`?"),
        more => {
            let quoted: Vec<String> = more.iter().map(|p| format!("`{p}`")).collect();
            format!("did you mean {}?", quoted.join(" or "))
        }
    }
}

/// The closest valid name to `given`, when exactly one is close.
///
/// Close means a case-insensitive edit distance of at most 1 for names of up to two
/// characters and at most max(2, len/3) otherwise (`nn` -> `n`, `lrr` -> `lr`,
/// `n_heads` -> `heads`); failing that, a valid name that appears as a whole
/// `_`-separated part of the given one or vice versa (`vocab_size` -> `vocab`).
pub(crate) fn suggest<'k>(given: &str, valid: &[&'k str]) -> Option<&'k str> {
    let g = given.to_lowercase();
    let limit = if g.chars().count() <= 2 { 1 } else { (g.chars().count() / 3).max(2) };
    let by_distance: Vec<(usize, &'k str)> = valid
        .iter()
        .map(|v| (edit_distance(&g, &v.to_lowercase()), *v))
        .filter(|(d, _)| *d <= limit)
        .collect();
    if let Some(best) = unique_min(&by_distance) {
        return Some(best);
    }
    let parts: Vec<(usize, &'k str)> = valid
        .iter()
        .filter(|v| {
            let v = v.to_lowercase();
            v.len() >= 3 && (contains_parts(&g, &v) || contains_parts(&v, &g))
        })
        // Longer shared parts are more specific: rank by negated length.
        .map(|v| (usize::MAX - v.len(), *v))
        .collect();
    unique_min(&parts)
}

/// The name with the smallest score, when no other name shares it.
fn unique_min<'k>(scored: &[(usize, &'k str)]) -> Option<&'k str> {
    let best = scored.iter().map(|(d, _)| *d).min()?;
    let mut at_best = scored.iter().filter(|(d, _)| *d == best);
    let first = at_best.next()?;
    at_best.next().is_none().then_some(first.1)
}

/// Whether `inner`'s `_`-separated parts occur as a contiguous run of `outer`'s.
fn contains_parts(outer: &str, inner: &str) -> bool {
    let outer: Vec<&str> = outer.split('_').collect();
    let inner: Vec<&str> = inner.split('_').collect();
    inner.len() < outer.len() && outer.windows(inner.len()).any(|w| w == inner.as_slice())
}

/// Ends the walk of one branch.
#[derive(Debug)]
struct Stop(String);

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Stop(msg.to_string())
    }
}

/// Drives one type's `Deserialize` over one tree node.
struct Walker<'a> {
    /// The value, or `None` where the spec leaves it out (defaults apply).
    node: Option<&'a Node>,
    /// The value's field path: empty at the top, then `residual`, `train.optimizer`.
    path: String,
    /// The enum variant holding this value (`Ghc`), named in messages.
    label: Option<&'static str>,
    /// This is a newtype variant's content: `Ghc(m: 4)` holds the struct's fields
    /// directly (RON's `unwrap_variant_newtypes`) and `Text("a")` wraps its value.
    newtype: bool,
    /// Where the value is written.
    pos: Pos,
    sink: &'a RefCell<Vec<UnknownName>>,
}

impl<'a> Walker<'a> {
    /// The node that holds the value itself, looking through a newtype variant's parentheses.
    fn content(&self) -> Option<&'a Node> {
        match self.node {
            Some(Node::Tuple { items, .. }) if self.newtype => match items.as_slice() {
                [inner] => Some(inner),
                _ => None,
            },
            node => node,
        }
    }

    fn child(&self, node: Option<&'a Node>, path: String, pos: Pos) -> Walker<'a> {
        Walker { node, path, label: None, newtype: false, pos, sink: self.sink }
    }

    fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn report(&self, path: String, pos: Pos, message: String) {
        self.sink.borrow_mut().push(UnknownName { path, line: pos.line, col: pos.col, message });
    }

    fn report_variant(&self, enum_name: &str, given: &str, variants: &[&str]) {
        let hint = match (suggest(given, variants), alias(given, variants)) {
            (Some(s), _) => format!("; did you mean `{s}`?"),
            (None, Some((s, why))) => format!("; did you mean `{s}`? ({why})"),
            (None, None) => String::new(),
        };
        let place = if self.path.is_empty() { enum_name } else { self.path.as_str() };
        let message = format!(
            "unknown variant `{given}` for {place}{hint}{}valid variants: {}",
            if hint.is_empty() { "; " } else { " " },
            variants.join(", ")
        );
        self.report(self.path.clone(), self.pos, message);
    }

    fn items(&self, len: Option<usize>) -> Items<'a> {
        let items: &'a [Node] = match self.content() {
            Some(Node::Tuple { items, .. } | Node::List(items)) => items,
            _ => &[],
        };
        let len = len.unwrap_or(items.len());
        let walkers: Vec<Walker<'a>> =
            (0..len).map(|i| self.child(items.get(i), format!("{}[{i}]", self.path), self.pos)).collect();
        Items { walkers: walkers.into_iter() }
    }
}

macro_rules! placeholder {
    ($($method:ident => $visit:ident($($value:expr)?)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
            visitor.$visit($($value)?)
        })*
    };
}

impl<'de, 'a> de::Deserializer<'de> for Walker<'a> {
    type Error = Stop;

    placeholder! {
        deserialize_any => visit_unit(),
        deserialize_bool => visit_bool(false),
        deserialize_i8 => visit_i64(0),
        deserialize_i16 => visit_i64(0),
        deserialize_i32 => visit_i64(0),
        deserialize_i64 => visit_i64(0),
        deserialize_u8 => visit_u64(0),
        deserialize_u16 => visit_u64(0),
        deserialize_u32 => visit_u64(0),
        deserialize_u64 => visit_u64(0),
        deserialize_f32 => visit_f64(0.0),
        deserialize_f64 => visit_f64(0.0),
        deserialize_char => visit_char('a'),
        deserialize_str => visit_str(""),
        deserialize_string => visit_str(""),
        deserialize_identifier => visit_str(""),
        deserialize_bytes => visit_bytes(&[]),
        deserialize_byte_buf => visit_bytes(&[]),
        deserialize_unit => visit_unit(),
        deserialize_ignored_any => visit_unit(),
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Stop> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Stop> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
        match self.content() {
            None => visitor.visit_none(),
            Some(Node::Ident(name)) if name == "None" => visitor.visit_none(),
            Some(Node::Tuple { name: Some(name), items }) if name == "Some" && items.len() == 1 => {
                let inner = self.child(items.first(), self.path.clone(), self.pos);
                visitor.visit_some(inner)
            }
            // `implicit_some`: a bare value is `Some(value)`.
            content => visitor.visit_some(Walker { node: content, newtype: false, ..self }),
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
        visitor.visit_seq(self.items(None))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Stop> {
        visitor.visit_seq(self.items(Some(len)))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Stop> {
        visitor.visit_seq(self.items(Some(len)))
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
        let entries: &'a [(Node, Node)] = match self.content() {
            Some(Node::Map(entries)) => entries,
            _ => &[],
        };
        let walkers: Vec<(Walker<'a>, Walker<'a>)> = entries
            .iter()
            .enumerate()
            .map(|(i, (k, v))| {
                let path = format!("{}[{i}]", self.path);
                (self.child(Some(k), path.clone(), self.pos), self.child(Some(v), path, self.pos))
            })
            .collect();
        visitor.visit_map(Entries { entries: walkers.into_iter(), value: None })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Stop> {
        let given: &'a [Field] = match self.content() {
            Some(Node::Struct { fields, .. }) => fields,
            _ => &[],
        };
        let place = match (self.path.as_str(), self.label) {
            ("", _) => name.to_string(),
            (path, Some(label)) => format!("{path} ({label})"),
            (path, None) => path.to_string(),
        };
        let mut known = Vec::with_capacity(given.len());
        for field in given {
            if fields.contains(&field.key.as_str()) {
                known.push(field);
                continue;
            }
            let hint = match suggest(&field.key, fields) {
                Some(s) => format!("; did you mean `{s}`?"),
                None => match path_hint(&self.field_path(&field.key)) {
                    h if h.is_empty() => h,
                    h => format!("; {h}"),
                },
            };
            let message = format!(
                "unknown field `{}` in {place}{hint}{}valid fields: {}",
                field.key,
                if hint.is_empty() { "; " } else { " " },
                fields.join(", ")
            );
            self.report(self.field_path(&field.key), field.pos, message);
        }
        let walkers: Vec<(&'a str, Walker<'a>)> = known
            .into_iter()
            .map(|f| (f.key.as_str(), self.child(Some(&f.value), self.field_path(&f.key), f.value_pos)))
            .collect();
        visitor.visit_map(Fields { fields: walkers.into_iter(), value: None })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Stop> {
        let content = self.content();
        let given = match content {
            Some(Node::Ident(v)) => Some(v),
            Some(Node::Struct { name: Some(v), .. } | Node::Tuple { name: Some(v), .. }) => Some(v),
            _ => None,
        };
        let known = given.and_then(|g| variants.iter().find(|v| **v == g.as_str()));
        let (variant, body) = match (given, known) {
            (Some(_), Some(&variant)) => match content {
                Some(Node::Ident(_)) => (variant, None),
                body => (variant, body),
            },
            (given, _) => {
                if let Some(given) = given {
                    self.report_variant(name, given, variants);
                }
                // Walk on with a placeholder (the first variant, all defaults) so that
                // names after this one are still checked; a value that is not a variant
                // at all is left to the typed parse to report.
                let Some(&first) = variants.first() else {
                    return Err(Stop(format!("{name} has no variants")));
                };
                (first, None)
            }
        };
        let inner = Walker { node: body, label: Some(variant), newtype: false, ..self };
        visitor.visit_enum(Variant { name: variant, inner })
    }
}

/// Positional items of a tuple or list, padded with defaults up to a tuple's length.
struct Items<'a> {
    walkers: std::vec::IntoIter<Walker<'a>>,
}

impl<'de, 'a> de::SeqAccess<'de> for Items<'a> {
    type Error = Stop;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Stop> {
        self.walkers.next().map(|w| seed.deserialize(w)).transpose()
    }
}

/// The known fields of a struct, keyed by name.
struct Fields<'a> {
    fields: std::vec::IntoIter<(&'a str, Walker<'a>)>,
    value: Option<Walker<'a>>,
}

impl<'de, 'a> de::MapAccess<'de> for Fields<'a> {
    type Error = Stop;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Stop> {
        match self.fields.next() {
            Some((key, walker)) => {
                self.value = Some(walker);
                seed.deserialize(key.into_deserializer()).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Stop> {
        let walker = self.value.take().ok_or_else(|| Stop("value before key".into()))?;
        seed.deserialize(walker)
    }
}

/// Entries of a RON map.
struct Entries<'a> {
    entries: std::vec::IntoIter<(Walker<'a>, Walker<'a>)>,
    value: Option<Walker<'a>>,
}

impl<'de, 'a> de::MapAccess<'de> for Entries<'a> {
    type Error = Stop;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Stop> {
        match self.entries.next() {
            Some((key, value)) => {
                self.value = Some(value);
                seed.deserialize(key).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Stop> {
        let walker = self.value.take().ok_or_else(|| Stop("value before key".into()))?;
        seed.deserialize(walker)
    }
}

/// A known variant and the walker over its contents.
struct Variant<'a> {
    name: &'static str,
    inner: Walker<'a>,
}

impl<'de, 'a> de::EnumAccess<'de> for Variant<'a> {
    type Error = Stop;
    type Variant = Walker<'a>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Walker<'a>), Stop> {
        let name: de::value::StrDeserializer<'_, Stop> = self.name.into_deserializer();
        Ok((seed.deserialize(name)?, self.inner))
    }
}

impl<'de, 'a> de::VariantAccess<'de> for Walker<'a> {
    type Error = Stop;

    fn unit_variant(self) -> Result<(), Stop> {
        Ok(())
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, Stop> {
        seed.deserialize(Walker { newtype: true, ..self })
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Stop> {
        de::Deserializer::deserialize_tuple(self, len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Stop> {
        de::Deserializer::deserialize_struct(self, "", fields, visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("lrr", "lr"), 1);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn suggestions_need_one_close_name() {
        assert_eq!(suggest("nn", &["m", "n", "dynamic"]), Some("n"));
        assert_eq!(suggest("lrr", &["lr", "betas", "eps"]), Some("lr"));
        assert_eq!(suggest("vocab_size", &["vocab", "d_model"]), Some("vocab"));
        assert_eq!(suggest("n_kv_heads", &["heads", "kv_heads"]), Some("kv_heads"));
        assert_eq!(suggest("ghx", &["Hc", "Ghc", "Xhc"]), Some("Ghc"));
        // `k` is one edit from both `m` and `n`: no single suggestion.
        assert_eq!(suggest("k", &["m", "n"]), None);
        assert_eq!(suggest("zzzzzz", &["vocab", "layers"]), None);
    }

    #[test]
    fn a_path_with_a_known_last_name_suggests_the_paths_that_have_it() {
        assert!(field_paths().contains(&"train.optimizer.lr"), "{:?}", field_paths());
        let found = similar_paths("train.lr");
        assert_eq!(found.first(), Some(&"train.optimizer.lr"), "{found:?}");
        assert!(found.iter().all(|p| p.ends_with(".lr")), "{found:?}");
        assert!(
            path_hint("train.lr").starts_with("did you mean `train.optimizer.lr`"),
            "{}",
            path_hint("train.lr")
        );
        // A field of another variant says whose it is.
        assert!(path_hint("residual.k").contains("`Xhc`"), "{}", path_hint("residual.k"));
        // A close last name: `warmpu` -> the schedules' `warmup`.
        assert!(similar_paths("train.warmpu").iter().all(|p| p.ends_with(".warmup")));
        assert!(!similar_paths("train.warmpu").is_empty());
        assert_eq!(path_hint("zzzzzz.qqqqqq"), "");
    }

    #[test]
    fn other_names_of_a_variant_point_at_widens() {
        let variants = ["Residual", "Hc", "Fc", "Mhc", "Ghc", "Xhc"];
        assert_eq!(alias("Vwn", &variants).map(|(v, _)| v), Some("Ghc"));
        assert_eq!(alias("VWN", &variants).map(|(v, _)| v), Some("Ghc"));
        assert_eq!(alias("Vwn", &["Residual"]), None, "only a variant the enum has");
    }
}
