//! The `#[widen(...)]` attribute grammar.
//!
//! It mirrors RON (docs/architecture.md §3) with Rust-attribute punctuation: `key = value`
//! instead of `key: value`, snake_case variant names instead of PascalCase, and
//! `key(a = 1, b = 2)` as a shorthand for a struct-valued field:
//!
//! ```text
//! args   := arg (',' arg)* ','?
//! arg    := IDENT '=' value          named value
//!         | IDENT '(' args ')'       named struct value, e.g. mtp(depth = 1)
//!         | IDENT                    a bare flag (`true`) or a positional variant name
//!         | value                    positional, e.g. the members of betas = (0.9, 0.95)
//! value  := INT | FLOAT | '-' (INT | FLOAT) | STRING | true | false
//!         | IDENT                    a unit variant (flash = block) or `none`; IDENT
//!                                    includes keywords, so `static(newest)` parses
//!         | IDENT '(' args ')'       a variant with data: ghc(m = 4, n = 16)
//!         | '(' args ')'             a struct or a tuple
//!         | '[' value (',' value)* ']'
//! ```

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{bracketed, parenthesized, Ident, LitBool, LitStr, Token};

/// A source range: the first and last token of a piece of attribute syntax.
///
/// `Span::join` is nightly-only, so an error covering `key = value` is built
/// from both ends with `syn::Error::new_spanned`, which keeps the range on stable.
#[derive(Clone, Copy)]
pub struct Range {
    pub start: Span,
    pub end: Span,
}

impl Range {
    pub fn new(start: Span, end: Span) -> Self {
        Range { start, end }
    }

    pub fn single(span: Span) -> Self {
        Range { start: span, end: span }
    }

    pub fn to(self, other: Range) -> Range {
        Range { start: self.start, end: other.end }
    }

    pub fn error(self, message: impl std::fmt::Display) -> syn::Error {
        syn::Error::new_spanned(self, message)
    }
}

impl ToTokens for Range {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        tokens.extend([
            proc_macro2::TokenTree::Ident(Ident::new("start", self.start)),
            proc_macro2::TokenTree::Ident(Ident::new("end", self.end)),
        ]);
    }
}

/// An integer or floating-point literal, possibly negated.
pub struct Number {
    pub negative: bool,
    pub lit: syn::Lit,
    pub range: Range,
}

impl Number {
    /// The literal as written, with its sign, for messages.
    pub fn text(&self) -> String {
        let digits = match &self.lit {
            syn::Lit::Int(i) => i.base10_digits().to_string(),
            syn::Lit::Float(f) => f.base10_digits().to_string(),
            _ => String::new(),
        };
        if self.negative {
            format!("-{digits}")
        } else {
            digits
        }
    }
}

/// One value on the right of `=`.
pub enum Value {
    Number(Number),
    Str(LitStr),
    Bool(LitBool),
    /// A unit variant name, or `none`.
    Ident(Ident),
    /// A bare key with no value: `true` for a boolean field.
    Flag(Ident),
    /// A variant with data: `ghc(m = 4, n = 16)`.
    Call {
        name: Ident,
        args: Vec<Arg>,
        range: Range,
    },
    /// `(a = 1, b = 2)` or `(0.9, 0.95)`.
    Group {
        args: Vec<Arg>,
        range: Range,
    },
    List {
        items: Vec<Value>,
        range: Range,
    },
}

impl Value {
    pub fn range(&self) -> Range {
        match self {
            Value::Number(n) => n.range,
            Value::Str(s) => Range::single(s.span()),
            Value::Bool(b) => Range::single(b.span),
            Value::Ident(i) | Value::Flag(i) => Range::single(i.span()),
            Value::Call { range, .. } | Value::Group { range, .. } | Value::List { range, .. } => *range,
        }
    }

    /// A short description of what was written, for "expected X, found Y" messages.
    pub fn describe(&self) -> String {
        match self {
            Value::Number(n) => format!("`{}`", n.text()),
            Value::Str(s) => format!("the string {:?}", s.value()),
            Value::Bool(b) => format!("`{}`", b.value),
            Value::Ident(i) => format!("`{i}`"),
            Value::Flag(i) => format!("a bare `{i}`"),
            Value::Call { name, .. } => format!("`{name}(..)`"),
            Value::Group { .. } => "a parenthesized group".into(),
            Value::List { .. } => "a list".into(),
        }
    }
}

/// One entry of an argument list: `key = value`, `key(args)`, a bare key, or a positional value.
pub struct Arg {
    pub key: Option<Ident>,
    pub value: Value,
}

impl Arg {
    /// The whole entry, key included.
    pub fn range(&self) -> Range {
        match &self.key {
            Some(k) => Range::single(k.span()).to(self.value.range()),
            None => self.value.range(),
        }
    }
}

/// A comma-separated argument list: the inside of `#[widen(...)]` or of any `(...)`.
pub struct Args(pub Vec<Arg>);

impl Parse for Args {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let list = Punctuated::<Arg, Token![,]>::parse_terminated(input)?;
        Ok(Args(list.into_iter().collect()))
    }
}

impl Parse for Arg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let is_ident = input.peek(Ident::peek_any) && !input.peek(LitBool);
        if is_ident && input.peek2(Token![=]) {
            let key = Ident::parse_any(input)?;
            input.parse::<Token![=]>()?;
            let value = input.parse()?;
            return Ok(Arg { key: Some(key), value });
        }
        if is_ident && input.peek2(syn::token::Paren) {
            let key = Ident::parse_any(input)?;
            let (args, range) = parse_group(input)?;
            return Ok(Arg { key: Some(key), value: Value::Group { args, range } });
        }
        if is_ident && (input.peek2(Token![,]) || is_last_token(input)) {
            let key = Ident::parse_any(input)?;
            return Ok(Arg { key: Some(key.clone()), value: Value::Flag(key) });
        }
        Ok(Arg { key: None, value: input.parse()? })
    }
}

/// True when the stream holds exactly one token tree.
fn is_last_token(input: ParseStream) -> bool {
    let fork = input.fork();
    fork.parse::<proc_macro2::TokenTree>().is_ok() && fork.is_empty()
}

fn parse_group(input: ParseStream) -> syn::Result<(Vec<Arg>, Range)> {
    let content;
    let paren = parenthesized!(content in input);
    let Args(args) = content.parse()?;
    Ok((args, Range::new(paren.span.open(), paren.span.close())))
}

impl Parse for Value {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let lookahead = input.lookahead1();
        if input.peek(Token![-]) {
            let minus: Token![-] = input.parse()?;
            let lit: syn::Lit = input.parse()?;
            return match lit {
                syn::Lit::Int(_) | syn::Lit::Float(_) => {
                    let range = Range::new(minus.span, lit.span());
                    Ok(Value::Number(Number { negative: true, lit, range }))
                }
                other => Err(syn::Error::new(other.span(), "expected a number after `-`")),
            };
        }
        if lookahead.peek(LitBool) {
            return Ok(Value::Bool(input.parse()?));
        }
        if lookahead.peek(syn::Lit) {
            let lit: syn::Lit = input.parse()?;
            return match lit {
                syn::Lit::Int(_) | syn::Lit::Float(_) => {
                    let range = Range::single(lit.span());
                    Ok(Value::Number(Number { negative: false, lit, range }))
                }
                syn::Lit::Str(s) => Ok(Value::Str(s)),
                other => Err(syn::Error::new(other.span(), "expected a number, a string, `true` or `false`")),
            };
        }
        // Keywords are names too: the depth history's `weights = static(newest)`.
        if lookahead.peek(Ident) || input.peek(Ident::peek_any) {
            let name = Ident::parse_any(input)?;
            if input.peek(syn::token::Paren) {
                let (args, group) = parse_group(input)?;
                let range = Range::single(name.span()).to(group);
                return Ok(Value::Call { name, args, range });
            }
            return Ok(Value::Ident(name));
        }
        if lookahead.peek(syn::token::Paren) {
            let (args, range) = parse_group(input)?;
            return Ok(Value::Group { args, range });
        }
        if lookahead.peek(syn::token::Bracket) {
            let content;
            let bracket = bracketed!(content in input);
            let items = Punctuated::<Value, Token![,]>::parse_terminated(&content)?;
            let range = Range::new(bracket.span.open(), bracket.span.close());
            return Ok(Value::List { items: items.into_iter().collect(), range });
        }
        Err(lookahead.error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tokens: TokenStream) -> Vec<Arg> {
        syn::parse2::<Args>(tokens).expect("test input parses").0
    }

    #[test]
    fn named_struct_shorthand_flag_and_positional_forms() {
        let args = parse(quote::quote!(
            d_model = 256,
            mtp(depth = 1),
            tie_embeddings,
            residual = ghc(m = 4),
            betas = (0.9, 0.95)
        ));
        assert_eq!(args.len(), 5);
        assert!(matches!(&args[0].value, Value::Number(n) if n.text() == "256"));
        assert!(matches!(&args[1].value, Value::Group { args, .. } if args.len() == 1));
        assert!(matches!(&args[2].value, Value::Flag(i) if i == "tie_embeddings"));
        assert!(matches!(&args[3].value, Value::Call { name, .. } if name == "ghc"));
        match &args[4].value {
            Value::Group { args, .. } => {
                assert!(args.iter().all(|a| a.key.is_none()));
                assert_eq!(args.len(), 2);
            }
            _ => panic!("betas should parse as a group"),
        }
    }

    #[test]
    fn negative_numbers_lists_and_enum_idents() {
        let args = parse(quote::quote!(scale_init = -0.5, conv_kernels = [4, 8, 12], flash = block));
        assert!(matches!(&args[0].value, Value::Number(n) if n.text() == "-0.5"));
        assert!(matches!(&args[1].value, Value::List { items, .. } if items.len() == 3));
        assert!(matches!(&args[2].value, Value::Ident(i) if i == "block"));
    }

    #[test]
    fn keywords_are_names() {
        let args = parse(quote::quote!(weights = static(newest), r#type = self, crate));
        assert!(
            matches!(&args[0].value, Value::Call { name, args, .. } if name == "static" && args.len() == 1)
        );
        assert!(matches!(&args[1].value, Value::Ident(i) if i == "self"));
        assert!(matches!(&args[2].value, Value::Flag(i) if i == "crate"));
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        assert!(syn::parse2::<Args>(quote::quote!(d_model = )).is_err());
        assert!(syn::parse2::<Args>(quote::quote!(d_model = -"x")).is_err());
    }
}
