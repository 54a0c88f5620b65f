//! The spec reference (`widen spec --reference`, `docs/spec.md`): every field the
//! parser accepts, its type, default and meaning, generated from the spec types
//! themselves so that the document cannot drift from the code.
//!
//! - **Fields and variants** come from the types' `Deserialize` impls: a probing
//!   deserializer is handed to [`ModelSpec::deserialize`] and records every
//!   `deserialize_struct` (a type's field names) and `deserialize_enum` (its variant
//!   names), as the unknown-name check does. One pass follows one variant of each
//!   enum, so the probe runs again for every variant of every enum it finds.
//! - **Defaults** come from the same walk with no fields given: `#[serde(default)]`
//!   fills every field of the chosen variants, and the result is read back through
//!   `Serialize`.
//! - **Meanings** are the doc comments of the fields and variants in this module's
//!   sources (`spec/mod.rs`, `spec/connection.rs`), read at compile time.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
use serde::Deserialize;

use super::ModelSpec;

/// The sources the doc comments are read from: the spec types and the connection language's.
const SOURCE: &str = concat!(include_str!("mod.rs"), include_str!("connection.rs"));

/// What a probe saw at one path.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Struct { name: &'static str, fields: Vec<&'static str> },
    Enum { name: &'static str, variants: Vec<&'static str> },
    Scalar(&'static str),
    Optional(Box<Seen>),
}

/// One probe's record: what each path holds, and the variant chosen at each enum.
#[derive(Default)]
struct Record {
    /// Everything seen at each path, in order: an enum, then the struct its variant holds.
    seen: BTreeMap<String, Vec<Seen>>,
    chosen: BTreeMap<String, &'static str>,
}

#[derive(Debug)]
struct ProbeError(String);

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProbeError {}

impl de::Error for ProbeError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        ProbeError(msg.to_string())
    }
}

/// The probing deserializer at one path.
#[derive(Clone, Copy)]
struct Probe<'a> {
    path: &'a str,
    /// Variant index to take at each enum path (0 where not given).
    choices: &'a BTreeMap<String, usize>,
    /// Give every struct field (to see them) or none (to get the defaults).
    fill: bool,
    record: &'a RefCell<Record>,
    /// Inside an `Option`: record the inner kind wrapped.
    optional: bool,
}

impl<'a> Probe<'a> {
    fn note(&self, seen: Seen) {
        let seen = if self.optional { Seen::Optional(Box::new(seen)) } else { seen };
        let mut record = self.record.borrow_mut();
        let at = record.seen.entry(self.path.to_string()).or_default();
        if !at.contains(&seen) {
            at.push(seen);
        }
    }

    fn scalar(&self, kind: &'static str) {
        self.note(Seen::Scalar(kind));
    }
}

fn child(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

macro_rules! scalars {
    ($($method:ident => $kind:literal, $visit:ident($value:expr);)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
            self.scalar($kind);
            visitor.$visit($value)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = ProbeError;

    scalars! {
        deserialize_bool => "bool", visit_bool(false);
        deserialize_u8 => "integer", visit_u64(1);
        deserialize_u16 => "integer", visit_u64(1);
        deserialize_u32 => "integer", visit_u64(1);
        deserialize_u64 => "integer", visit_u64(1);
        deserialize_i8 => "integer", visit_i64(1);
        deserialize_i16 => "integer", visit_i64(1);
        deserialize_i32 => "integer", visit_i64(1);
        deserialize_i64 => "integer", visit_i64(1);
        deserialize_f32 => "number", visit_f64(1.0);
        deserialize_f64 => "number", visit_f64(1.0);
        deserialize_char => "character", visit_char('x');
        deserialize_str => "string", visit_str("x");
        deserialize_string => "string", visit_str("x");
        deserialize_bytes => "bytes", visit_bytes(b"x");
        deserialize_byte_buf => "bytes", visit_bytes(b"x");
        deserialize_identifier => "identifier", visit_str("x");
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.scalar("()");
        visitor.visit_unit()
    }

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, ProbeError> {
        Err(ProbeError(format!("`{}` has no fixed type; the reference cannot describe it", self.path)))
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        visitor.visit_unit()
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        let leads = self.choices.keys().any(|k| k == self.path || k.starts_with(&format!("{}.", self.path)));
        if self.fill || leads {
            visitor.visit_some(Probe { optional: true, ..self })
        } else {
            visitor.visit_none()
        }
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.scalar("list");
        visitor.visit_seq(Elements { probe: self, left: 0 })
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, ProbeError> {
        self.note(Seen::Scalar(match len {
            2 => "pair of numbers",
            _ => "tuple",
        }));
        visitor.visit_seq(Elements { probe: Probe { optional: false, ..self }, left: len })
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_tuple(len, visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.scalar("map");
        visitor.visit_map(Fields { probe: self, fields: Vec::new(), next: 0 })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        self.note(Seen::Struct { name, fields: fields.to_vec() });
        // Without `fill`, only the fields that lead to a chosen variant are given, so
        // that `#[serde(default)]` fills the rest.
        let leads = |f: &&str| {
            let at = child(self.path, f);
            self.choices.keys().any(|k| *k == at || k.starts_with(&format!("{at}.")))
        };
        let given: Vec<&'static str> = fields.iter().copied().filter(|f| self.fill || leads(f)).collect();
        visitor.visit_map(Fields { probe: Probe { optional: false, ..self }, fields: given, next: 0 })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        self.note(Seen::Enum { name, variants: variants.to_vec() });
        let i = self.choices.get(self.path).copied().unwrap_or(0).min(variants.len().saturating_sub(1));
        let variant =
            variants.get(i).copied().ok_or_else(|| ProbeError(format!("enum {name} has no variants")))?;
        self.record.borrow_mut().chosen.insert(self.path.to_string(), variant);
        visitor.visit_enum(Variant { probe: Probe { optional: false, ..self }, variant })
    }
}

/// The elements of a list or tuple.
struct Elements<'a> {
    probe: Probe<'a>,
    left: usize,
}

impl<'de> de::SeqAccess<'de> for Elements<'_> {
    type Error = ProbeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, ProbeError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        // Elements of a tuple are not described one by one: record nothing for them.
        let scratch = RefCell::new(Record::default());
        let probe = Probe { record: &scratch, optional: false, ..self.probe };
        seed.deserialize(probe).map(Some)
    }
}

/// A struct's fields, as a map.
struct Fields<'a> {
    probe: Probe<'a>,
    fields: Vec<&'static str>,
    next: usize,
}

impl<'de> de::MapAccess<'de> for Fields<'_> {
    type Error = ProbeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, ProbeError> {
        match self.fields.get(self.next) {
            Some(field) => seed.deserialize((*field).into_deserializer()).map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, ProbeError> {
        let path = child(self.probe.path, self.fields[self.next]);
        self.next += 1;
        seed.deserialize(Probe { path: &path, ..self.probe })
    }
}

/// The variant the probe takes at an enum.
struct Variant<'a> {
    probe: Probe<'a>,
    variant: &'static str,
}

impl<'de, 'a> de::EnumAccess<'de> for Variant<'a> {
    type Error = ProbeError;
    type Variant = Probe<'a>;

    fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Probe<'a>), ProbeError> {
        let value = seed.deserialize(self.variant.into_deserializer())?;
        Ok((value, self.probe))
    }
}

impl<'de> de::VariantAccess<'de> for Probe<'_> {
    type Error = ProbeError;

    fn unit_variant(self) -> Result<(), ProbeError> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, ProbeError> {
        seed.deserialize(self)
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, ProbeError> {
        de::Deserializer::deserialize_tuple(self, len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        de::Deserializer::deserialize_struct(self, "", fields, visitor)
    }
}

/// One probe run: what it saw and, with `fill` off, the spec of defaults it built.
fn probe(choices: &BTreeMap<String, usize>, fill: bool) -> (Record, Option<ModelSpec>) {
    let record = RefCell::new(Record::default());
    let spec =
        ModelSpec::deserialize(Probe { path: "", choices, fill, record: &record, optional: false }).ok();
    (record.into_inner(), spec)
}

/// A documented section: a struct reached at `path` through the variants `via`.
#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    /// Field path of the struct (`""` for the model, `residual` for a scheme's knobs).
    pub path: String,
    /// The RON that selects it: `Model(...)`, `residual: Ghc(...)`.
    pub ron: String,
    /// The variants chosen on the way to it: (enum path, variant), outermost first.
    pub variants: Vec<(String, String)>,
    /// The struct's type name in the code.
    pub type_name: String,
    pub doc: String,
    pub fields: Vec<FieldRow>,
}

/// One field of a section.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldRow {
    /// The field path a sweep axis sets (`residual.m`).
    pub path: String,
    pub name: String,
    /// `integer`, `number`, `bool`, `string`, `optional integer`, or the variants of an enum.
    pub kind: String,
    /// The default as RON-like text, or `none` for an optional field left out.
    pub default: String,
    pub doc: String,
}

/// Every section of the spec, with every field, in the order the model lists them.
pub fn sections() -> Vec<Section> {
    // Every combination that reaches a new enum path: start with the first variant
    // everywhere, then take each other variant of each enum found.
    let runs = explore();
    let docs = Docs::parse(SOURCE);
    let mut out: Vec<Section> = Vec::new();
    for (choices, record) in &runs {
        let (_, defaults) = probe(choices, false);
        let defaults = defaults.and_then(|s| serde_json::to_value(s).ok()).unwrap_or_default();
        for (path, seen) in record.seen.iter().flat_map(|(p, all)| all.iter().map(move |s| (p, s))) {
            let Some(Seen::Struct { name, fields }) = unwrap_optional(seen) else { continue };
            let ron = section_ron(path, &record.chosen);
            if out.iter().any(|s| s.ron == ron) {
                continue;
            }
            // A struct variant has no type name of its own: its fields are documented
            // under the variant's (see `Docs::parse`).
            let name: &str = match *name {
                "" => record.chosen.iter().find(|(p, _)| *p == path).map_or("", |(_, v)| v.as_ref()),
                other => other,
            };
            // An optional struct left out by default (`residual.history`) has no defaults in
            // the spec of defaults: its fields' are those of the struct written empty.
            let written = match json_at(&defaults, path, &record.chosen) {
                Some(serde_json::Value::Null) => written_empty(path, &record.chosen),
                _ => None,
            };
            let defaults_here = written.as_ref().unwrap_or(&defaults);
            let rows = fields
                .iter()
                .map(|f| {
                    let fpath = child(path, f);
                    let seen = record.seen.get(&fpath).and_then(|all| all.first());
                    let kind = seen.map(describe).unwrap_or_else(|| "?".into());
                    let default = match (
                        seen.and_then(unwrap_optional),
                        json_at(defaults_here, &fpath, &record.chosen),
                    ) {
                        // The walk with no fields given failed: the field has no default.
                        (_, None) => "required".into(),
                        (_, Some(serde_json::Value::Null)) => "none".into(),
                        (Some(Seen::Struct { .. }), Some(_)) => "(...)".into(),
                        (Some(Seen::Enum { .. }), Some(serde_json::Value::String(v))) => v.clone(),
                        (_, Some(v)) => show(v),
                    };
                    FieldRow {
                        path: fpath.clone(),
                        name: f.to_string(),
                        kind,
                        default,
                        doc: docs.field(name, f).unwrap_or_default(),
                    }
                })
                .collect();
            let variants = record
                .chosen
                .iter()
                .filter(|(p, _)| p.is_empty() || **p == *path || path.starts_with(&format!("{p}.")))
                .map(|(p, v)| (p.clone(), v.to_string()))
                .collect();
            out.push(Section {
                path: path.clone(),
                ron,
                variants,
                type_name: name.to_string(),
                doc: docs.item(name).unwrap_or_default(),
                fields: rows,
            });
        }
    }
    // The model first, then by path, each enum's variants in declaration order.
    let order = |s: &Section| {
        let variant_rank = runs
            .iter()
            .find_map(|(_, r)| {
                match r.seen.get(&s.path).and_then(|all| all.first()).and_then(unwrap_enum_parent) {
                    Some(variants) => variants.iter().position(|v| s.ron.ends_with(&format!("{v}(...)"))),
                    None => None,
                }
            })
            .unwrap_or(0);
        (s.path.split('.').count() * usize::from(!s.path.is_empty()), s.path.clone(), variant_rank)
    };
    out.sort_by_key(order);
    out
}

/// Every enum the spec uses, with its variants' doc comments.
pub fn enums() -> Vec<(String, Vec<(String, String)>)> {
    let docs = Docs::parse(SOURCE);
    let mut names: BTreeMap<&'static str, Vec<&'static str>> = BTreeMap::new();
    for (_, record) in explore() {
        for seen in record.seen.values().flatten() {
            if let Some(Seen::Enum { name, variants }) = unwrap_optional(seen) {
                names.insert(name, variants.clone());
            }
        }
    }
    names
        .into_iter()
        .map(|(name, variants)| {
            let rows =
                variants.iter().map(|v| (v.to_string(), docs.field(name, v).unwrap_or_default())).collect();
            (name.to_string(), rows)
        })
        .collect()
}

/// Probe runs that together reach every variant of every enum: the first variant
/// everywhere, then, for each enum path when first reached, each of its other
/// variants (with the choices that reached it). Enums are explored one at a time, not
/// in combination: every struct is reached once, whatever the other enums hold.
fn explore() -> Vec<(BTreeMap<String, usize>, Record)> {
    let mut todo: Vec<BTreeMap<String, usize>> = vec![BTreeMap::new()];
    let mut reached: BTreeSet<String> = BTreeSet::new();
    let mut runs = Vec::new();
    while let Some(choices) = todo.pop() {
        let (record, _) = probe(&choices, true);
        for (path, all) in &record.seen {
            for seen in all {
                let Some(Seen::Enum { variants, .. }) = unwrap_optional(seen) else { continue };
                if !reached.insert(path.clone()) {
                    continue;
                }
                for i in 1..variants.len() {
                    let mut next = choices.clone();
                    next.insert(path.clone(), i);
                    todo.push(next);
                }
            }
        }
        runs.push((choices, record));
    }
    runs
}

fn unwrap_optional(seen: &Seen) -> Option<&Seen> {
    match seen {
        Seen::Optional(inner) => Some(inner),
        other => Some(other),
    }
}

fn unwrap_enum_parent(seen: &Seen) -> Option<&Vec<&'static str>> {
    match unwrap_optional(seen)? {
        Seen::Enum { variants, .. } => Some(variants),
        _ => None,
    }
}

/// `Model(...)`, or `path: Variant(...)` when an enum at `path` holds the struct, or
/// `path: (...)` for a plain struct field.
/// The defaults' JSON of a spec that writes the struct at `path` as `()`, through the
/// variants chosen on the way to it (`Model(residual: Connection(history: ()))`).
fn written_empty(path: &str, chosen: &BTreeMap<String, &'static str>) -> Option<serde_json::Value> {
    let steps: Vec<&str> = path.split('.').collect();
    let mut text = "()".to_string();
    for i in (0..steps.len()).rev() {
        let parent = steps[..i].join(".");
        let wrapper = if parent.is_empty() { "Model" } else { chosen.get(&parent).copied().unwrap_or("") };
        text = format!("{wrapper}({}: {text})", steps[i]);
    }
    let spec = super::parse_spec(&text, "reference.ron").ok()?;
    serde_json::to_value(spec).ok()
}

fn section_ron(path: &str, chosen: &BTreeMap<String, &'static str>) -> String {
    if path.is_empty() {
        return "Model(...)".into();
    }
    match chosen.get(path) {
        Some(variant) => format!("{path}: {variant}(...)"),
        None => format!("{path}: (...)"),
    }
}

fn describe(seen: &Seen) -> String {
    match seen {
        Seen::Scalar(kind) => kind.to_string(),
        Seen::Optional(inner) => format!("optional {}", describe(inner)),
        Seen::Struct { .. } => "(...), see below".into(),
        Seen::Enum { variants, .. } => variants.join(" \\| "),
    }
}

/// The value at a field path of the defaults' JSON, passing through the externally
/// tagged variant objects serde writes for enums.
fn json_at<'v>(
    value: &'v serde_json::Value,
    path: &str,
    chosen: &BTreeMap<String, &'static str>,
) -> Option<&'v serde_json::Value> {
    let mut at = value;
    let mut walked = String::new();
    for step in path.split('.') {
        if let Some(variant) = chosen.get(&walked) {
            if let Some(inner) = at.get(*variant) {
                at = inner;
            }
        }
        at = at.get(step)?;
        walked = child(&walked, step);
    }
    Some(at)
}

/// A default as a spec would write it: numbers and strings as they are, a variant
/// by its name (`Ghc(...)` when it holds fields), `none` for an absent option.
fn show(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Null => "none".into(),
        serde_json::Value::String(s) => format!("\"{s}\""),
        serde_json::Value::Object(map) if map.len() == 1 => {
            let (k, v) = map.iter().next().expect("one entry");
            match v {
                serde_json::Value::Object(_) => format!("{k}(...)"),
                other => format!("{k}({})", show(other)),
            }
        }
        serde_json::Value::Array(items) => {
            format!("({})", items.iter().map(show).collect::<Vec<_>>().join(", "))
        }
        other => other.to_string(),
    }
}

/// Doc comments of the types, fields and variants in the spec module's source.
struct Docs {
    /// (type, member) -> doc; member "" is the type's own doc.
    map: BTreeMap<(String, String), String>,
}

impl Docs {
    fn parse(source: &str) -> Docs {
        let mut map = BTreeMap::new();
        let mut pending: Vec<String> = Vec::new();
        let mut current: Option<String> = None;
        // A struct variant (`HuggingFace { path: .., sha256: .. }`): its fields are
        // documented under the variant's name.
        let mut variant: Option<String> = None;
        let mut depth = 0usize;
        for line in source.lines() {
            let t = line.trim();
            if let Some(doc) = t.strip_prefix("///") {
                pending.push(doc.trim().to_string());
                continue;
            }
            if t.starts_with("#[") {
                continue;
            }
            let item = t.strip_prefix("pub struct ").or_else(|| t.strip_prefix("pub enum "));
            if depth == 0 {
                if let Some(rest) = item {
                    let name: String =
                        rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    map.insert((name.clone(), String::new()), pending.join(" "));
                    current = t.ends_with('{').then_some(name);
                }
            } else if depth == 1 {
                if let Some(type_name) = &current {
                    let member = t.strip_prefix("pub ").unwrap_or(t);
                    let name: String =
                        member.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    if !name.is_empty() && !pending.is_empty() {
                        map.insert((type_name.clone(), name.clone()), pending.join(" "));
                    }
                    variant = (t.ends_with('{') && !name.is_empty()).then_some(name);
                }
            } else if depth == 2 {
                if let Some(variant_name) = &variant {
                    let name: String = t.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    if !name.is_empty() && !pending.is_empty() {
                        map.insert((variant_name.clone(), name), pending.join(" "));
                    }
                }
            }
            pending.clear();
            depth += t.matches('{').count();
            depth = depth.saturating_sub(t.matches('}').count());
            if depth == 0 {
                current = None;
            }
            if depth <= 1 && !t.ends_with('{') {
                variant = None;
            }
        }
        Docs { map }
    }

    fn item(&self, type_name: &str) -> Option<String> {
        self.map.get(&(source_name(type_name), String::new())).cloned()
    }

    fn field(&self, type_name: &str, field: &str) -> Option<String> {
        self.map.get(&(source_name(type_name), field.to_string())).cloned()
    }
}

/// The Rust name of a type serde knows by another (`Model` is `ModelSpec`).
fn source_name(serde_name: &str) -> String {
    match serde_name {
        "Model" => "ModelSpec".into(),
        other => other.to_string(),
    }
}

/// The reference as Markdown (`docs/spec.md`).
pub fn markdown() -> String {
    let mut md = String::new();
    md.push_str(
        "# Spec reference\n\n\
         Generated from the spec types by `widen spec --reference`; a test keeps this file \
         equal to that output, so it lists exactly the fields the parser accepts.\n\n\
         A spec is a RON `Model(...)`. Every field may be left out: it then takes the \
         default below. A field that holds a scheme or a choice takes one of its variants, \
         written `Variant` or `Variant(field: value, ...)`. Ranges are given in brackets \
         in each meaning; `widen check` reports every violation with its field path. \
         The **path** column is what a sweep axis sets (`widen sweep --set PATH=...`).\n",
    );
    for s in sections() {
        let title = if s.path.is_empty() { "Model(...)".to_string() } else { s.ron.clone() };
        md.push_str(&format!("\n## `{title}`\n\n"));
        if !s.doc.is_empty() {
            md.push_str(&format!("{} (`{}`)\n\n", s.doc, s.type_name));
        }
        md.push_str("| path | type | default | meaning |\n|---|---|---|---|\n");
        for f in &s.fields {
            md.push_str(&format!(
                "| `{}` | {} | `{}` | {} |\n",
                f.path,
                f.kind,
                f.default,
                f.doc.replace('|', "\\|")
            ));
        }
    }
    md.push_str("\n## Choices\n\nThe variants of every choice field, with what each means.\n");
    for (name, variants) in enums() {
        md.push_str(&format!("\n### `{name}`\n\n"));
        for (v, doc) in variants {
            if doc.is_empty() {
                md.push_str(&format!("- `{v}`\n"));
            } else {
                md.push_str(&format!("- `{v}`: {doc}\n"));
            }
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_and_its_fields_are_listed() {
        let sections = sections();
        let rons: Vec<&str> = sections.iter().map(|s| s.ron.as_str()).collect();
        for want in
            ["Model(...)", "residual: Ghc(...)", "residual: Xhc(...)", "ffn: Moe(...)", "train: (...)"]
        {
            assert!(rons.contains(&want), "{want} missing from {rons:?}");
        }
        let ghc = sections.iter().find(|s| s.ron == "residual: Ghc(...)").unwrap();
        let m = ghc.fields.iter().find(|f| f.name == "m").unwrap();
        assert_eq!((m.path.as_str(), m.kind.as_str(), m.default.as_str()), ("residual.m", "integer", "4"));
        assert!(m.doc.contains("Fraction rate m"), "{}", m.doc);
        let model = &sections[0];
        assert_eq!(model.ron, "Model(...)");
        let vocab = model.fields.iter().find(|f| f.name == "vocab").unwrap();
        assert_eq!(vocab.default, "256");
        let kv = model.fields.iter().find(|f| f.name == "kv_heads").unwrap();
        assert_eq!((kv.kind.as_str(), kv.default.as_str()), ("optional integer", "none"));
    }

    #[test]
    fn every_field_and_variant_has_a_meaning() {
        let missing: Vec<String> = sections()
            .iter()
            .flat_map(|s| {
                s.fields.iter().filter(|f| f.doc.is_empty()).map(|f| format!("{} ({})", f.path, s.ron))
            })
            .collect();
        assert!(missing.is_empty(), "fields without a doc comment in spec/mod.rs: {missing:?}");
    }
}
