//! A position-keeping syntax tree of RON text.
//!
//! `ron` stops at the first problem and forgets where fields were written; the
//! unknown-name check in [`super::names`] needs every field name with its line and
//! column, so the spec text is first read into this small tree. It keeps only what
//! that check needs: the shape of the value (struct, tuple, list, map, identifier,
//! scalar) and field names with positions. Numbers are kept as raw text (so that a
//! bad integer can be quoted with its field's valid range); `ron` itself does the
//! typed parse afterwards.

/// A 1-based line and column (columns count characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pos {
    pub line: usize,
    pub col: usize,
}

/// One field of a struct-like value: `key: value`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Field {
    pub key: String,
    /// Where the key is written.
    pub pos: Pos,
    pub value: Node,
    /// Where the value starts.
    pub value_pos: Pos,
}

/// A RON value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    /// A bare identifier: `true`, `None`, `GroupNorm`, `inf`.
    Ident(String),
    /// A string or character literal.
    Scalar,
    /// A number, as written (`-4`, `2.5`, `1e99`, `0x10`, `-inf`).
    Number(String),
    /// `Name(k: v, ...)` or `(k: v, ...)`.
    Struct { name: Option<String>, fields: Vec<Field> },
    /// `Name(a, b)`, `(a, b)`, `Name()` or `()`.
    Tuple { name: Option<String>, items: Vec<Node> },
    /// `[a, b]`.
    List(Vec<Node>),
    /// `{k: v}`.
    Map(Vec<(Node, Node)>),
}

/// A syntax error, at the position where reading stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub pos: Pos,
    pub message: String,
}

/// Parses one RON value, allowing leading `#![enable(...)]` attributes and comments.
pub(crate) fn parse(text: &str) -> Result<Node, SyntaxError> {
    let mut p = Parser { chars: text.chars().collect(), at: 0, line: 1, col: 1 };
    p.skip_ws()?;
    while p.peek() == Some('#') {
        p.skip_attribute()?;
        p.skip_ws()?;
    }
    let node = p.value(0)?;
    p.skip_ws()?;
    if p.peek().is_some() {
        return Err(p.error("unexpected text after the value"));
    }
    Ok(node)
}

/// The path (`residual.n`) of the innermost field whose value starts at or before
/// `pos`: the field a typed-parse error at `pos` is about.
#[cfg(test)]
pub(crate) fn field_at(root: &Node, pos: Pos) -> Option<String> {
    value_at(root, pos).map(|(path, _)| path)
}

/// [`field_at`], with the field's value.
pub(crate) fn value_at(root: &Node, pos: Pos) -> Option<(String, &Node)> {
    fn visit<'a>(node: &'a Node, path: &str, pos: Pos, best: &mut Option<(Pos, String, &'a Node)>) {
        let children: Vec<(&'a Node, String, Option<Pos>)> = match node {
            Node::Struct { fields, .. } => fields
                .iter()
                .map(|f| {
                    let p = if path.is_empty() { f.key.clone() } else { format!("{path}.{}", f.key) };
                    (&f.value, p, Some(f.value_pos))
                })
                .collect(),
            Node::Tuple { items, .. } | Node::List(items) => {
                items.iter().map(|n| (n, path.to_string(), None)).collect()
            }
            Node::Map(entries) => entries.iter().map(|(_, v)| (v, path.to_string(), None)).collect(),
            Node::Ident(_) | Node::Scalar | Node::Number(_) => Vec::new(),
        };
        for (child, child_path, start) in children {
            if let Some(start) = start {
                let key = (start.line, start.col);
                if key > (pos.line, pos.col) {
                    continue;
                }
                if best.as_ref().is_none_or(|(b, _, _)| key >= (b.line, b.col)) {
                    *best = Some((start, child_path.clone(), child));
                }
            }
            visit(child, &child_path, pos, best);
        }
    }
    let mut best = None;
    visit(root, "", pos, &mut best);
    best.map(|(_, path, node)| (path, node))
}

/// Nesting deeper than this is refused rather than risking the stack.
const MAX_DEPTH: usize = 128;

struct Parser {
    chars: Vec<char>,
    at: usize,
    line: usize,
    col: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn peek_at(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.at + ahead).copied()
    }

    fn pos(&self) -> Pos {
        Pos { line: self.line, col: self.col }
    }

    fn error(&self, message: &str) -> SyntaxError {
        SyntaxError { pos: self.pos(), message: message.to_string() }
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.at += 1;
        if c == '\n' {
            self.line += 1;
            self.col = 1;
        } else {
            self.col += 1;
        }
        Some(c)
    }

    fn expect(&mut self, c: char) -> Result<(), SyntaxError> {
        if self.peek() == Some(c) {
            self.bump();
            Ok(())
        } else {
            Err(self.error(&format!("expected `{c}`")))
        }
    }

    /// Skips whitespace, `// line` comments and nested `/* block */` comments.
    fn skip_ws(&mut self) -> Result<(), SyntaxError> {
        loop {
            match (self.peek(), self.peek_at(1)) {
                (Some(c), _) if c.is_whitespace() => {
                    self.bump();
                }
                (Some('/'), Some('/')) => {
                    while !matches!(self.peek(), None | Some('\n')) {
                        self.bump();
                    }
                }
                (Some('/'), Some('*')) => {
                    let start = self.pos();
                    let mut depth = 0usize;
                    loop {
                        match (self.peek(), self.peek_at(1)) {
                            (Some('/'), Some('*')) => {
                                depth += 1;
                                self.bump();
                                self.bump();
                            }
                            (Some('*'), Some('/')) => {
                                depth -= 1;
                                self.bump();
                                self.bump();
                                if depth == 0 {
                                    break;
                                }
                            }
                            (Some(_), _) => {
                                self.bump();
                            }
                            (None, _) => {
                                return Err(SyntaxError {
                                    pos: start,
                                    message: "unclosed block comment".into(),
                                })
                            }
                        }
                    }
                }
                _ => return Ok(()),
            }
        }
    }

    /// Skips `#![...]` (extension attributes; `ron` reads them itself).
    fn skip_attribute(&mut self) -> Result<(), SyntaxError> {
        self.expect('#')?;
        self.expect('!')?;
        self.skip_ws()?;
        self.expect('[')?;
        let mut depth = 1usize;
        while depth > 0 {
            match self.bump() {
                Some('[') => depth += 1,
                Some(']') => depth -= 1,
                Some(_) => {}
                None => return Err(self.error("unclosed attribute `#![...]`")),
            }
        }
        Ok(())
    }

    fn value(&mut self, depth: usize) -> Result<Node, SyntaxError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        self.skip_ws()?;
        match self.peek() {
            Some('[') => self.list(depth),
            Some('{') => self.map(depth),
            Some('(') => self.parens(None, depth),
            Some('"') => self.string(),
            Some('\'') => self.char_literal(),
            Some('r') if matches!(self.peek_at(1), Some('"' | '#')) && !self.is_raw_ident() => {
                self.raw_string()
            }
            Some('b') if self.peek_at(1) == Some('"') => {
                self.bump();
                self.string()
            }
            Some(c) if c.is_ascii_digit() || c == '+' || c == '-' || c == '.' => self.number(),
            Some(c) if is_ident_start(c) => {
                let name = self.ident()?;
                self.skip_ws()?;
                if self.peek() == Some('(') {
                    self.parens(Some(name), depth)
                } else {
                    Ok(Node::Ident(name))
                }
            }
            Some(c) => Err(self.error(&format!("unexpected character `{c}`"))),
            None => Err(self.error("unexpected end of input, expected a value")),
        }
    }

    /// `r#ident` (a raw identifier) rather than `r#"..."#` (a raw string).
    fn is_raw_ident(&self) -> bool {
        self.peek_at(1) == Some('#') && self.peek_at(2).is_some_and(is_ident_start)
    }

    fn ident(&mut self) -> Result<String, SyntaxError> {
        if self.peek() == Some('r') && self.is_raw_ident() {
            self.bump();
            self.bump();
        }
        let mut s = String::new();
        while let Some(c) = self.peek().filter(|&c| is_ident_continue(c)) {
            s.push(c);
            self.bump();
        }
        if s.is_empty() {
            Err(self.error("expected an identifier"))
        } else {
            Ok(s)
        }
    }

    /// After an identifier at the current position, is the next token a `:`?
    fn ident_then_colon(&self) -> bool {
        let mut i = self.at;
        if self.chars.get(i) == Some(&'r') && self.chars.get(i + 1) == Some(&'#') {
            i += 2;
        }
        if !self.chars.get(i).copied().is_some_and(is_ident_start) {
            return false;
        }
        while self.chars.get(i).copied().is_some_and(is_ident_continue) {
            i += 1;
        }
        while self.chars.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        // A comment between a field name and its colon is not recognized; such a
        // file fails here and `ron` alone reads it (see `parse_spec`).
        self.chars.get(i) == Some(&':')
    }

    /// The body of `( ... )`: named fields or positional items.
    fn parens(&mut self, name: Option<String>, depth: usize) -> Result<Node, SyntaxError> {
        self.expect('(')?;
        self.skip_ws()?;
        if self.ident_then_colon() {
            let mut fields = Vec::new();
            loop {
                self.skip_ws()?;
                if self.peek() == Some(')') {
                    break;
                }
                let pos = self.pos();
                let key = self.ident()?;
                self.skip_ws()?;
                self.expect(':')?;
                self.skip_ws()?;
                let value_pos = self.pos();
                let value = self.value(depth + 1)?;
                fields.push(Field { key, pos, value, value_pos });
                if !self.comma_or_close(')')? {
                    break;
                }
            }
            self.expect(')')?;
            Ok(Node::Struct { name, fields })
        } else {
            let items = self.items(')', depth)?;
            Ok(Node::Tuple { name, items })
        }
    }

    fn list(&mut self, depth: usize) -> Result<Node, SyntaxError> {
        self.expect('[')?;
        Ok(Node::List(self.items(']', depth)?))
    }

    /// Comma-separated values up to and including `close`.
    fn items(&mut self, close: char, depth: usize) -> Result<Vec<Node>, SyntaxError> {
        let mut items = Vec::new();
        loop {
            self.skip_ws()?;
            if self.peek() == Some(close) {
                break;
            }
            items.push(self.value(depth + 1)?);
            if !self.comma_or_close(close)? {
                break;
            }
        }
        self.expect(close)?;
        Ok(items)
    }

    fn map(&mut self, depth: usize) -> Result<Node, SyntaxError> {
        self.expect('{')?;
        let mut entries = Vec::new();
        loop {
            self.skip_ws()?;
            if self.peek() == Some('}') {
                break;
            }
            let key = self.value(depth + 1)?;
            self.skip_ws()?;
            self.expect(':')?;
            let value = self.value(depth + 1)?;
            entries.push((key, value));
            if !self.comma_or_close('}')? {
                break;
            }
        }
        self.expect('}')?;
        Ok(Node::Map(entries))
    }

    /// Consumes a `,` (true: more may follow) or stops before `close` (false).
    fn comma_or_close(&mut self, close: char) -> Result<bool, SyntaxError> {
        self.skip_ws()?;
        match self.peek() {
            Some(',') => {
                self.bump();
                Ok(true)
            }
            Some(c) if c == close => Ok(false),
            _ => Err(self.error(&format!("expected `,` or `{close}`"))),
        }
    }

    fn string(&mut self) -> Result<Node, SyntaxError> {
        let start = self.pos();
        self.expect('"')?;
        loop {
            match self.bump() {
                Some('"') => return Ok(Node::Scalar),
                Some('\\') => {
                    self.bump();
                }
                Some(_) => {}
                None => return Err(SyntaxError { pos: start, message: "unclosed string".into() }),
            }
        }
    }

    fn raw_string(&mut self) -> Result<Node, SyntaxError> {
        let start = self.pos();
        self.expect('r')?;
        let mut hashes = 0usize;
        while self.peek() == Some('#') {
            hashes += 1;
            self.bump();
        }
        self.expect('"')?;
        loop {
            match self.bump() {
                Some('"') => {
                    let closing = (0..hashes).all(|i| self.peek_at(i) == Some('#'));
                    if closing {
                        for _ in 0..hashes {
                            self.bump();
                        }
                        return Ok(Node::Scalar);
                    }
                }
                Some(_) => {}
                None => return Err(SyntaxError { pos: start, message: "unclosed raw string".into() }),
            }
        }
    }

    fn char_literal(&mut self) -> Result<Node, SyntaxError> {
        let start = self.pos();
        self.expect('\'')?;
        loop {
            match self.bump() {
                Some('\'') => return Ok(Node::Scalar),
                Some('\\') => {
                    self.bump();
                }
                Some('\n') | None => {
                    return Err(SyntaxError { pos: start, message: "unclosed character literal".into() })
                }
                Some(_) => {}
            }
        }
    }

    /// A number as written: sign, digits, `_`, `.`, radix prefixes, exponent,
    /// and the signed identifiers `-inf` / `+NaN`. `ron` checks the digits.
    fn number(&mut self) -> Result<Node, SyntaxError> {
        let start = self.at;
        if matches!(self.peek(), Some('+' | '-')) {
            self.bump();
        }
        let mut len = 0usize;
        let mut prev = ' ';
        while let Some(c) = self.peek() {
            let exponent_sign = (c == '+' || c == '-') && matches!(prev, 'e' | 'E');
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' || exponent_sign {
                prev = c;
                len += 1;
                self.bump();
            } else {
                break;
            }
        }
        if len == 0 {
            Err(self.error("expected a number"))
        } else {
            Ok(Node::Number(self.chars[start..self.at].iter().collect()))
        }
    }
}

/// Identifiers are read with any Unicode letters, although RON's are ASCII: a field
/// name like `vöcab` is then reported whole by the unknown-name check, with its
/// suggestion, instead of `ron` stopping at `v` (README, "What widen guarantees").
fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_continue(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field<'a>(node: &'a Node, key: &str) -> &'a Field {
        match node {
            Node::Struct { fields, .. } => fields.iter().find(|f| f.key == key).expect("field present"),
            other => panic!("not a struct: {other:?}"),
        }
    }

    #[test]
    fn reads_fields_with_positions_through_comments() {
        let text = "#![enable(implicit_some)]\n// a comment\nModel(\n  /* block /* nested */ */ vocab: 256,\n  residual: Ghc(m: 4, n: 16),\n  betas: (0.9, -1e-3),\n  name: r#\"x\"#,\n)";
        let root = parse(text).unwrap();
        let vocab = field(&root, "vocab");
        assert_eq!(vocab.pos, Pos { line: 4, col: 28 });
        let residual = field(&root, "residual");
        assert_eq!(residual.pos, Pos { line: 5, col: 3 });
        assert_eq!(field(&residual.value, "n").pos, Pos { line: 5, col: 23 });
        assert!(matches!(&field(&root, "betas").value, Node::Tuple { items, .. } if items.len() == 2));
        assert!(matches!(&root, Node::Struct { name: Some(n), .. } if n == "Model"));
    }

    #[test]
    fn tuples_lists_and_unit_forms() {
        let root = parse("(a: Some(None), b: [1, 2,], c: (), d: {\"k\": 1})").unwrap();
        assert!(matches!(&field(&root, "a").value,
            Node::Tuple { name: Some(n), items } if n == "Some" && items == &[Node::Ident("None".into())]));
        assert!(matches!(&field(&root, "b").value, Node::List(items) if items.len() == 2));
        assert!(matches!(&field(&root, "c").value, Node::Tuple { name: None, items } if items.is_empty()));
        assert!(matches!(&field(&root, "d").value, Node::Map(entries) if entries.len() == 1));
    }

    #[test]
    fn finds_the_field_at_a_position() {
        let root = parse("(\n  a: 1,\n  b: X(c: [1, 2], d: 3),\n)").unwrap();
        assert_eq!(field_at(&root, Pos { line: 2, col: 6 }).as_deref(), Some("a"));
        assert_eq!(field_at(&root, Pos { line: 3, col: 21 }).as_deref(), Some("b.c"));
        assert_eq!(field_at(&root, Pos { line: 3, col: 28 }).as_deref(), Some("b.d"));
        assert_eq!(field_at(&root, Pos { line: 1, col: 1 }), None);
    }

    #[test]
    fn errors_carry_positions() {
        let err = parse("(\n  a: 1\n  b: 2)").unwrap_err();
        assert_eq!(err.pos, Pos { line: 3, col: 3 });
        let err = parse("(a: \"open)").unwrap_err();
        assert_eq!(err.pos, Pos { line: 1, col: 5 });
        assert!(parse("(a: 1) trailing").is_err());
    }
}
