//! A spec as a tree that keeps everything serde says about it, for setting field paths.
//!
//! Setting `residual.n` on a spec needs a generic view of it: which fields a struct
//! has, which enum variant a field holds, and the values themselves, unchanged. JSON
//! is not that view: it has no NaN or infinity (they become `null`, and an optional
//! field holding one would read back as `None`), and it writes enum variants as
//! objects that only a naming convention tells from structs. [`Node`] is built by
//! serde's own `Serialize` of the spec ([`to_node`]), so variants are explicit and
//! every float keeps its exact value; [`Node::to_ron`] writes it back as RON that the
//! spec parser reads ([`ir::spec::parse_spec`]), so a point is read exactly as a spec
//! file with the same contents would be.
//!
//! [`leaf_shape`] answers "what is valid at this path" for messages, by driving the
//! spec's own `Deserialize` along the path (serde hands every struct's field names and
//! every enum's variant names to the deserializer), so it cannot drift from the types.

use std::cell::RefCell;
use std::fmt::{self, Write as _};

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
use serde::ser::{self, Serialize};

/// One value of a serialized spec.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Bool(bool),
    Int(i128),
    Float(f64),
    Char(char),
    Str(String),
    Bytes(Vec<u8>),
    None,
    Some(Box<Node>),
    Unit,
    UnitVariant(&'static str),
    NewtypeStruct(Box<Node>),
    NewtypeVariant(&'static str, Box<Node>),
    Seq(Vec<Node>),
    Tuple(Vec<Node>),
    TupleVariant(&'static str, Vec<Node>),
    Map(Vec<(Node, Node)>),
    Struct(Vec<(&'static str, Node)>),
    StructVariant(&'static str, Vec<(&'static str, Node)>),
}

/// The fields a path step can enter: `(variant passed through, fields)`.
pub type Fields<'a> = (Option<&'static str>, &'a [(&'static str, Node)]);

impl Node {
    /// The fields of a struct, of a variant's struct, or of what an option or newtype holds.
    pub fn fields(&self) -> Option<Fields<'_>> {
        match self {
            Node::Struct(fields) => Some((None, fields)),
            Node::StructVariant(tag, fields) => Some((Some(tag), fields)),
            Node::NewtypeVariant(tag, inner) => match &**inner {
                Node::Struct(fields) => Some((Some(tag), fields)),
                _ => None,
            },
            Node::Some(inner) | Node::NewtypeStruct(inner) => inner.fields(),
            _ => None,
        }
    }

    /// The field `name` of [`Node::fields`], mutably.
    pub fn field_mut(&mut self, name: &str) -> Option<&mut Node> {
        let fields = match self {
            Node::Struct(fields) | Node::StructVariant(_, fields) => fields,
            Node::NewtypeVariant(_, inner) => match &mut **inner {
                Node::Struct(fields) => fields,
                _ => return None,
            },
            Node::Some(inner) | Node::NewtypeStruct(inner) => return inner.field_mut(name),
            _ => return None,
        };
        fields.iter_mut().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The node at a dotted path, passing through variants as [`Node::fields`] does.
    pub fn at(&self, segs: &[&str]) -> Option<&Node> {
        let mut cur = self;
        for seg in segs {
            let (_, fields) = cur.fields()?;
            cur = fields.iter().find(|(n, _)| n == seg).map(|(_, v)| v)?;
        }
        Some(cur)
    }

    /// The node at a dotted path, mutably.
    pub fn at_mut(&mut self, segs: &[&str]) -> Option<&mut Node> {
        let mut cur = self;
        for seg in segs {
            cur = cur.field_mut(seg)?;
        }
        Some(cur)
    }

    /// The RON text of this value, as a spec file writes it (newtype variants of
    /// structs unwrapped, `Some` explicit); [`ir::spec::parse_spec`] reads it back to
    /// the value serialized.
    pub fn to_ron(&self) -> String {
        let mut out = String::new();
        self.write_ron(&mut out);
        out
    }

    fn write_ron(&self, out: &mut String) {
        match self {
            Node::Bool(b) => write!(out, "{b}").unwrap(),
            Node::Int(i) => write!(out, "{i}").unwrap(),
            Node::Float(f) => write_float(out, *f),
            Node::Char(c) => write!(out, "{c:?}").unwrap(),
            Node::Str(s) => write_raw_string(out, s),
            Node::Bytes(b) => {
                out.push('[');
                for (i, byte) in b.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write!(out, "{byte}").unwrap();
                }
                out.push(']');
            }
            Node::None => out.push_str("None"),
            Node::Some(inner) => {
                out.push_str("Some(");
                inner.write_ron(out);
                out.push(')');
            }
            Node::Unit => out.push_str("()"),
            Node::UnitVariant(tag) => out.push_str(tag),
            Node::NewtypeStruct(inner) => {
                out.push('(');
                inner.write_ron(out);
                out.push(')');
            }
            Node::NewtypeVariant(tag, inner) => {
                out.push_str(tag);
                match &**inner {
                    // `Ghc(m: 4)`, not `Ghc((m: 4))`: the spec reader unwraps variant newtypes.
                    Node::Struct(fields) => write_fields(out, fields),
                    other => {
                        out.push('(');
                        other.write_ron(out);
                        out.push(')');
                    }
                }
            }
            Node::Seq(items) => {
                out.push('[');
                write_list(out, items);
                out.push(']');
            }
            Node::Tuple(items) => {
                out.push('(');
                write_list(out, items);
                if items.len() == 1 {
                    out.push(',');
                }
                out.push(')');
            }
            Node::TupleVariant(tag, items) => {
                out.push_str(tag);
                out.push('(');
                write_list(out, items);
                out.push(')');
            }
            Node::Map(entries) => {
                out.push('{');
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    k.write_ron(out);
                    out.push_str(": ");
                    v.write_ron(out);
                }
                out.push('}');
            }
            Node::Struct(fields) => write_fields(out, fields),
            Node::StructVariant(tag, fields) => {
                out.push_str(tag);
                write_fields(out, fields);
            }
        }
    }
}

fn write_list(out: &mut String, items: &[Node]) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        item.write_ron(out);
    }
}

fn write_fields(out: &mut String, fields: &[(&'static str, Node)]) {
    out.push('(');
    for (i, (name, value)) in fields.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(name);
        out.push_str(": ");
        value.write_ron(out);
    }
    out.push(')');
}

/// Shortest text that reads back to the same `f64`; RON spells the non-finite ones
/// `NaN`, `inf` and `-inf`.
fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "inf" } else { "-inf" });
    } else {
        // `{:?}` keeps a `.0` or an exponent, so the text stays a float.
        write!(out, "{f:?}").unwrap();
    }
}

/// A raw string, `r#"..."#` with enough `#`s, so no character needs an escape.
fn write_raw_string(out: &mut String, s: &str) {
    let mut hashes = 0;
    let mut run: Option<usize> = None;
    for c in s.chars() {
        run = match (c, run) {
            ('"', _) => Some(0),
            ('#', Some(n)) => Some(n + 1),
            _ => None,
        };
        if let Some(n) = run {
            hashes = hashes.max(n + 1);
        }
    }
    let h = "#".repeat(hashes);
    write!(out, "r{h}\"{s}\"{h}").unwrap();
}

/// Serializing to a [`Node`] cannot fail for plain data; the error exists for serde.
#[derive(Debug)]
pub struct TreeError(String);

impl fmt::Display for TreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TreeError {}

impl ser::Error for TreeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        TreeError(msg.to_string())
    }
}

impl de::Error for TreeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        TreeError(msg.to_string())
    }
}

/// The tree of any serializable value.
pub fn to_node<T: Serialize + ?Sized>(value: &T) -> Result<Node, TreeError> {
    value.serialize(ToNode)
}

struct ToNode;

/// Collects the items of a sequence, tuple or tuple variant.
pub struct SeqSer {
    kind: SeqKind,
    items: Vec<Node>,
}

enum SeqKind {
    Seq,
    Tuple,
    Variant(&'static str),
}

/// Collects a map's entries.
pub struct MapSer {
    entries: Vec<(Node, Node)>,
    key: Option<Node>,
}

/// Collects a struct's or a struct variant's fields.
pub struct StructSer {
    variant: Option<&'static str>,
    fields: Vec<(&'static str, Node)>,
}

impl ser::Serializer for ToNode {
    type Ok = Node;
    type Error = TreeError;
    type SerializeSeq = SeqSer;
    type SerializeTuple = SeqSer;
    type SerializeTupleStruct = SeqSer;
    type SerializeTupleVariant = SeqSer;
    type SerializeMap = MapSer;
    type SerializeStruct = StructSer;
    type SerializeStructVariant = StructSer;

    fn serialize_bool(self, v: bool) -> Result<Node, TreeError> {
        Ok(Node::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_i16(self, v: i16) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_i32(self, v: i32) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_i64(self, v: i64) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_i128(self, v: i128) -> Result<Node, TreeError> {
        Ok(Node::Int(v))
    }
    fn serialize_u8(self, v: u8) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_u16(self, v: u16) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_u32(self, v: u32) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_u64(self, v: u64) -> Result<Node, TreeError> {
        Ok(Node::Int(v.into()))
    }
    fn serialize_u128(self, v: u128) -> Result<Node, TreeError> {
        i128::try_from(v).map(Node::Int).map_err(|_| TreeError(format!("{v} does not fit in i128")))
    }
    fn serialize_f32(self, v: f32) -> Result<Node, TreeError> {
        Ok(Node::Float(v.into()))
    }
    fn serialize_f64(self, v: f64) -> Result<Node, TreeError> {
        Ok(Node::Float(v))
    }
    fn serialize_char(self, v: char) -> Result<Node, TreeError> {
        Ok(Node::Char(v))
    }
    fn serialize_str(self, v: &str) -> Result<Node, TreeError> {
        Ok(Node::Str(v.to_string()))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Node, TreeError> {
        Ok(Node::Bytes(v.to_vec()))
    }
    fn serialize_none(self) -> Result<Node, TreeError> {
        Ok(Node::None)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Node, TreeError> {
        Ok(Node::Some(Box::new(value.serialize(ToNode)?)))
    }
    fn serialize_unit(self) -> Result<Node, TreeError> {
        Ok(Node::Unit)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Node, TreeError> {
        Ok(Node::Unit)
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<Node, TreeError> {
        Ok(Node::UnitVariant(variant))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Node, TreeError> {
        Ok(Node::NewtypeStruct(Box::new(value.serialize(ToNode)?)))
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<Node, TreeError> {
        Ok(Node::NewtypeVariant(variant, Box::new(value.serialize(ToNode)?)))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<SeqSer, TreeError> {
        Ok(SeqSer { kind: SeqKind::Seq, items: Vec::with_capacity(len.unwrap_or(0).min(64)) })
    }
    fn serialize_tuple(self, len: usize) -> Result<SeqSer, TreeError> {
        Ok(SeqSer { kind: SeqKind::Tuple, items: Vec::with_capacity(len.min(64)) })
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<SeqSer, TreeError> {
        self.serialize_tuple(len)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<SeqSer, TreeError> {
        Ok(SeqSer { kind: SeqKind::Variant(variant), items: Vec::with_capacity(len.min(64)) })
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<MapSer, TreeError> {
        Ok(MapSer { entries: Vec::new(), key: None })
    }
    fn serialize_struct(self, _: &'static str, len: usize) -> Result<StructSer, TreeError> {
        Ok(StructSer { variant: None, fields: Vec::with_capacity(len.min(64)) })
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<StructSer, TreeError> {
        Ok(StructSer { variant: Some(variant), fields: Vec::with_capacity(len.min(64)) })
    }
}

impl SeqSer {
    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), TreeError> {
        self.items.push(value.serialize(ToNode)?);
        Ok(())
    }

    fn done(self) -> Node {
        match self.kind {
            SeqKind::Seq => Node::Seq(self.items),
            SeqKind::Tuple => Node::Tuple(self.items),
            SeqKind::Variant(tag) => Node::TupleVariant(tag, self.items),
        }
    }
}

impl ser::SerializeSeq for SeqSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), TreeError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(self.done())
    }
}

impl ser::SerializeTuple for SeqSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), TreeError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(self.done())
    }
}

impl ser::SerializeTupleStruct for SeqSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), TreeError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(self.done())
    }
}

impl ser::SerializeTupleVariant for SeqSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), TreeError> {
        self.push(value)
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(self.done())
    }
}

impl ser::SerializeMap for MapSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), TreeError> {
        self.key = Some(key.serialize(ToNode)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), TreeError> {
        let key = self.key.take().ok_or_else(|| TreeError("a map value without a key".into()))?;
        self.entries.push((key, value.serialize(ToNode)?));
        Ok(())
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(Node::Map(self.entries))
    }
}

impl StructSer {
    fn done(self) -> Node {
        match self.variant {
            None => Node::Struct(self.fields),
            Some(tag) => Node::StructVariant(tag, self.fields),
        }
    }
}

impl ser::SerializeStruct for StructSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), TreeError> {
        self.fields.push((key, value.serialize(ToNode)?));
        Ok(())
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(self.done())
    }
}

impl ser::SerializeStructVariant for StructSer {
    type Ok = Node;
    type Error = TreeError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), TreeError> {
        self.fields.push((key, value.serialize(ToNode)?));
        Ok(())
    }
    fn end(self) -> Result<Node, TreeError> {
        Ok(self.done())
    }
}

/// What a field's type accepts, as the spec's `Deserialize` asks for it.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    Bool,
    /// An integer type, with its range.
    Int {
        min: i128,
        max: i128,
    },
    Float,
    Char,
    Str,
    Unit,
    /// `None` or the inner shape (specs write `Some` implicitly).
    Option(Box<Shape>),
    /// A list of the inner shape.
    Seq(Box<Shape>),
    /// A tuple of `len` items; the inner shape is the first item's.
    Tuple(usize, Box<Shape>),
    Map,
    Struct(&'static [&'static str]),
    Enum(&'static [&'static str]),
    /// The type asked for anything (it has no fixed shape).
    Any,
}

/// The shape of the field at `segs`, found by driving `T`'s `Deserialize` along the
/// path. At an enum on the way, the variant is the first of `hints` that the enum
/// has (the variants named in the value being set), else the one `tree` holds there.
pub fn leaf_shape<'de, T: de::Deserialize<'de>>(
    segs: &[&str],
    tree: Option<&Node>,
    hints: &[&str],
) -> Option<Shape> {
    let found = RefCell::new(Vec::new());
    let probe = Probe { segs, node: tree, hints, found: &found };
    // The probe always ends the walk with an error once it has recorded the leaf.
    let _ = T::deserialize(probe);
    let shapes = found.into_inner();
    // Built inside out: the last recorded shape is the innermost.
    let mut iter = shapes.into_iter().rev();
    let mut shape = match iter.next()? {
        Partial::Done(s) => s,
        _ => Shape::Any,
    };
    for outer in iter {
        shape = match outer {
            Partial::Done(s) => s,
            Partial::Option => Shape::Option(Box::new(shape)),
            Partial::Seq => Shape::Seq(Box::new(shape)),
            Partial::Tuple(n) => Shape::Tuple(n, Box::new(shape)),
        };
    }
    Some(shape)
}

/// One recorded step of the leaf's shape: a wrapper whose inner shape follows, or the end.
enum Partial {
    Option,
    Seq,
    Tuple(usize),
    Done(Shape),
}

struct Probe<'a, 'p> {
    /// Path segments still to follow; empty at the leaf.
    segs: &'a [&'a str],
    /// The value the base holds here, when known.
    node: Option<&'a Node>,
    hints: &'a [&'a str],
    found: &'p RefCell<Vec<Partial>>,
}

impl<'a, 'p> Probe<'a, 'p> {
    fn stop<T>(&self) -> Result<T, TreeError> {
        Err(TreeError("probe done".into()))
    }

    fn leaf<T>(&self, shape: Shape) -> Result<T, TreeError> {
        if self.segs.is_empty() {
            self.found.borrow_mut().push(Partial::Done(shape));
        }
        self.stop()
    }

    fn child(&self, name: &str) -> Option<&'a Node> {
        let (_, fields) = self.node?.fields()?;
        fields.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The variant to pass through at an enum on the path.
    fn variant(&self, variants: &'static [&'static str]) -> Option<&'static str> {
        if let Some(hint) = self.hints.iter().find_map(|h| variants.iter().find(|v| *v == h)) {
            return Some(hint);
        }
        let tag = match self.node? {
            Node::UnitVariant(t)
            | Node::NewtypeVariant(t, _)
            | Node::TupleVariant(t, _)
            | Node::StructVariant(t, _) => *t,
            _ => return None,
        };
        variants.iter().find(|v| **v == tag).copied()
    }

    fn inner_node(&self) -> Option<&'a Node> {
        match self.node? {
            Node::Some(inner) | Node::NewtypeStruct(inner) | Node::NewtypeVariant(_, inner) => Some(inner),
            _ => None,
        }
    }
}

macro_rules! leaf_methods {
    ($($method:ident => $shape:expr;)*) => {
        $(fn $method<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, TreeError> {
            self.leaf($shape)
        })*
    };
}

fn int<T: Into<i128>>(min: T, max: T) -> Shape {
    Shape::Int { min: min.into(), max: max.into() }
}

impl<'de, 'a, 'p> de::Deserializer<'de> for Probe<'a, 'p> {
    type Error = TreeError;

    leaf_methods! {
        deserialize_any => Shape::Any;
        deserialize_bool => Shape::Bool;
        deserialize_i8 => int(i8::MIN, i8::MAX);
        deserialize_i16 => int(i16::MIN, i16::MAX);
        deserialize_i32 => int(i32::MIN, i32::MAX);
        deserialize_i64 => int(i64::MIN, i64::MAX);
        deserialize_u8 => int(u8::MIN, u8::MAX);
        deserialize_u16 => int(u16::MIN, u16::MAX);
        deserialize_u32 => int(u32::MIN, u32::MAX);
        deserialize_u64 => int(u64::MIN, u64::MAX);
        deserialize_f32 => Shape::Float;
        deserialize_f64 => Shape::Float;
        deserialize_char => Shape::Char;
        deserialize_str => Shape::Str;
        deserialize_string => Shape::Str;
        deserialize_bytes => Shape::Seq(Box::new(int(u8::MIN, u8::MAX)));
        deserialize_byte_buf => Shape::Seq(Box::new(int(u8::MIN, u8::MAX)));
        deserialize_unit => Shape::Unit;
        deserialize_map => Shape::Map;
        deserialize_identifier => Shape::Str;
        deserialize_ignored_any => Shape::Any;
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, _: V) -> Result<V::Value, TreeError> {
        self.leaf(Shape::Unit)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TreeError> {
        if self.segs.is_empty() {
            self.found.borrow_mut().push(Partial::Option);
        }
        let node = self.inner_node();
        visitor.visit_some(Probe { node, ..self })
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, TreeError> {
        let node = self.inner_node();
        visitor.visit_newtype_struct(Probe { node, ..self })
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TreeError> {
        if !self.segs.is_empty() {
            return self.stop();
        }
        self.found.borrow_mut().push(Partial::Seq);
        visitor.visit_seq(OneItem(Some(Probe { node: None, ..self })))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, TreeError> {
        if !self.segs.is_empty() {
            return self.stop();
        }
        self.found.borrow_mut().push(Partial::Tuple(len));
        visitor.visit_seq(OneItem(Some(Probe { node: None, ..self })))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, TreeError> {
        self.deserialize_tuple(len, visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TreeError> {
        let Some((seg, rest)) = self.segs.split_first() else {
            return self.leaf(Shape::Struct(fields));
        };
        if !fields.contains(seg) {
            return self.stop();
        }
        let node = self.child(seg);
        visitor.visit_map(OneField { key: Some(seg), value: Some(Probe { segs: rest, node, ..self }) })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TreeError> {
        if self.segs.is_empty() {
            return self.leaf(Shape::Enum(variants));
        }
        let Some(tag) = self.variant(variants) else { return self.stop() };
        // A variant the base holds passes its payload on; a hinted one has none known.
        let node = match self.node {
            Some(Node::NewtypeVariant(t, inner)) if *t == tag => Some(&**inner),
            Some(n @ Node::StructVariant(t, _)) if *t == tag => Some(n),
            _ => None,
        };
        visitor.visit_enum(OneVariant { tag, probe: Probe { node, ..self } })
    }
}

struct OneItem<'a, 'p>(Option<Probe<'a, 'p>>);

impl<'de, 'a, 'p> de::SeqAccess<'de> for OneItem<'a, 'p> {
    type Error = TreeError;
    fn next_element_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, TreeError> {
        match self.0.take() {
            Some(probe) => seed.deserialize(probe).map(Some),
            None => Err(TreeError("probe done".into())),
        }
    }
}

struct OneField<'a, 'p> {
    key: Option<&'a str>,
    value: Option<Probe<'a, 'p>>,
}

impl<'de, 'a, 'p> de::MapAccess<'de> for OneField<'a, 'p> {
    type Error = TreeError;
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, TreeError> {
        match self.key.take() {
            Some(key) => seed.deserialize(key.into_deserializer()).map(Some),
            None => Err(TreeError("probe done".into())),
        }
    }
    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, TreeError> {
        match self.value.take() {
            Some(probe) => seed.deserialize(probe),
            None => Err(TreeError("probe done".into())),
        }
    }
}

struct OneVariant<'a, 'p> {
    tag: &'static str,
    probe: Probe<'a, 'p>,
}

impl<'de, 'a, 'p> de::EnumAccess<'de> for OneVariant<'a, 'p> {
    type Error = TreeError;
    type Variant = Probe<'a, 'p>;
    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Probe<'a, 'p>), TreeError> {
        let tag: de::value::StrDeserializer<TreeError> = self.tag.into_deserializer();
        Ok((seed.deserialize(tag)?, self.probe))
    }
}

impl<'de, 'a, 'p> de::VariantAccess<'de> for Probe<'a, 'p> {
    type Error = TreeError;
    fn unit_variant(self) -> Result<(), TreeError> {
        self.stop()
    }
    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, TreeError> {
        seed.deserialize(self)
    }
    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, _visitor: V) -> Result<V::Value, TreeError> {
        self.stop()
    }
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TreeError> {
        de::Deserializer::deserialize_struct(self, "", fields, visitor)
    }
}
