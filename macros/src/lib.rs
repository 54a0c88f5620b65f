//! `#[derive(VirtualWidth)]`: a model spec written as Rust attributes (docs/architecture.md §1, §3).
//!
//! ```text
//! #[derive(VirtualWidth)]
//! #[widen(name = "tiny-vwn", vocab = 256, d_model = 256, layers = 4, heads = 4)]
//! #[widen(residual = ghc(m = 4, r = 4), mtp(depth = 1, lambda = 0.3))]
//! #[widen(train(seq_len = 128, steps = 500, optimizer = adamw(lr = 3e-3)))]
//! struct Tiny;
//! ```
//!
//! The attributes say what a RON spec says: keys are the RON field names, and
//! variants are written snake_case (`residual = xhc(flash = two_block)`); see
//! the `syntax` module for the grammar. Conveniences beyond RON: `ghc(r = ..)` for
//! n = r * m (docs/math.md §5.1), a bare boolean key means `true`, `none` clears an
//! optional field (`clip = none`), and `name` defaults to the type's name in
//! kebab case. Keys go on the type only; `#[widen]` on fields is rejected.
//!
//! A connection-language design (docs/connections.md, "In the derive") is written the same
//! way. Struct variants name every member, as RON requires (`sigmoid(scale = 2.0, offset
//! = 0.0)`); tuple variants take their values in order (`linspace(-0.01, 0.01)`,
//! `values([1.0, 0.0])`, `wide(full)`); keywords are names too (`weights = static(newest)`):
//!
//! ```text
//! #[widen(residual = connection(
//!     streams = 4,
//!     collapse = readout(init = logit(0.25), constraint = sigmoid(scale = 1.0, offset = 0.0)),
//!     read(init = logit(0.25), constraint = sigmoid(scale = 1.0, offset = 0.0)),
//!     carry(init = logit(0.99), constraint = sigmoid(scale = 0.1, offset = 0.9), form = per_slot),
//!     write(init = linspace(-0.01, 0.01), constraint = sigmoid(scale = 2.0, offset = 0.0)),
//! ))]
//! ```
//!
//! At expansion time the macro builds an `ir::spec::ModelSpec` and runs the same
//! `ModelSpec::validate` as the RON path. Every problem (malformed attribute,
//! unknown key with a "did you mean", wrong value type, failed validation rule)
//! becomes a `compile_error!` at the key that caused it, all at once; a
//! validation error on a field the user did not write points at the nearest
//! enclosing key, else at the first `#[widen]` attribute. On error the macro
//! still emits an impl (returning the default spec) so that the rest of the
//! crate type-checks and editors keep working.
//!
//! The generated `spec()` re-parses RON text embedded at expansion time rather
//! than spelling out a constructor expression: the spec's own serde impls write
//! every field, so the macro does not have to mirror each type's layout, and the
//! run-time path is the very parser the RON files go through. The text is parsed
//! back and compared with the validated spec during expansion, so the `expect`
//! in the generated code cannot fire.

mod assemble;
mod suggest;
mod syntax;

use proc_macro2::TokenStream;
use quote::quote;
use syn::{parse_macro_input, DeriveInput};

use assemble::Cx;
use ir::spec::{FieldError, ModelSpec};
use syntax::{Args, Range};

/// Derives `widen::VirtualWidth` from `#[widen(...)]` attributes; see the crate docs.
#[proc_macro_derive(VirtualWidth, attributes(widen))]
pub fn derive_virtual_width(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input).into()
}

fn expand(input: &DeriveInput) -> TokenStream {
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let body = match model_spec(input).and_then(|spec| embed(&spec, input)) {
        Ok(text) => quote! {
            // Validated and re-parsed during expansion (see the widen-macros docs).
            ::widen::ir::spec::parse_spec(#text, ::core::concat!("#[derive(VirtualWidth)] ", ::core::stringify!(#ident)))
                .expect("the derived spec was validated and re-parsed at compile time")
        },
        Err(error) => {
            let errors = error.to_compile_error();
            return quote! {
                #errors
                impl #impl_generics ::widen::VirtualWidth for #ident #ty_generics #where_clause {
                    fn spec() -> ::widen::ir::spec::ModelSpec {
                        ::core::default::Default::default()
                    }
                }
            };
        }
    };
    quote! {
        impl #impl_generics ::widen::VirtualWidth for #ident #ty_generics #where_clause {
            fn spec() -> ::widen::ir::spec::ModelSpec {
                #body
            }
        }
    }
}

/// The validated spec, or every problem found, combined.
fn model_spec(input: &DeriveInput) -> syn::Result<ModelSpec> {
    let mut cx = Cx::default();
    let mut args = Vec::new();
    let mut fallback = None;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("widen")) {
        let range = Range::new(attr.pound_token.span, attr.bracket_token.span.close());
        fallback.get_or_insert(range);
        match attr.parse_args::<Args>() {
            Ok(Args(a)) => args.extend(a),
            Err(e) => cx.error(e),
        }
    }
    for attr in field_attrs(input).filter(|a| a.path().is_ident("widen")) {
        cx.error(syn::Error::new_spanned(attr, "`#[widen]` goes on the type, not on its fields"));
    }
    let mut spec = ModelSpec { name: kebab_case(&input.ident.to_string()), ..Default::default() };
    assemble::apply(&mut spec, &args, "", &mut cx, &[]);
    // A spec built from mistyped attributes would raise follow-on validation errors
    // about values the user never wrote, so validation waits for clean attributes.
    if !cx.has_errors() {
        let fallback = fallback.unwrap_or_else(|| Range::single(input.ident.span()));
        for error in spec.validate().err().unwrap_or_default() {
            let range = cx.locate(&error.path).unwrap_or(fallback);
            cx.error(range.error(describe(&error)));
        }
    }
    match cx.into_error() {
        Some(error) => Err(error),
        None => Ok(spec),
    }
}

/// A field error's message, prefixed with its path unless the message already names it,
/// in full or by its tail (`create: Split needs ...` for `residual.create`).
fn describe(error: &FieldError) -> String {
    let path = error.path.as_str();
    let names_tail = path.match_indices('.').any(|(i, _)| {
        let tail = &path[i + 1..];
        error.message.strip_prefix(tail).is_some_and(|rest| rest.starts_with([':', ' ', '.']))
    });
    if path.is_empty() || error.message.contains(path) || names_tail {
        error.message.clone()
    } else {
        format!("{}: {}", error.path, error.message)
    }
}

/// RON text for `spec` ([`ModelSpec::to_ron`]), checked to parse back to an equal
/// spec through the RON path.
fn embed(spec: &ModelSpec, input: &DeriveInput) -> syn::Result<String> {
    let text = spec.to_ron();
    let problem = match ir::spec::parse_spec(&text, "derive") {
        Ok(back) if back == *spec => return Ok(text),
        Ok(_) => "the RON text parses to a different spec".to_string(),
        Err(e) => e.to_string(),
    };
    Err(syn::Error::new(input.ident.span(), format!("widen: cannot embed the derived spec: {problem}")))
}

fn field_attrs(input: &DeriveInput) -> impl Iterator<Item = &syn::Attribute> {
    let fields: Vec<&syn::Field> = match &input.data {
        syn::Data::Struct(s) => s.fields.iter().collect(),
        syn::Data::Enum(e) => e.variants.iter().flat_map(|v| v.fields.iter()).collect(),
        syn::Data::Union(u) => u.fields.named.iter().collect(),
    };
    fields.into_iter().flat_map(|f| f.attrs.iter())
}

/// `TinyVwn` -> `tiny-vwn`: the default model name (used for reports and output folders).
fn kebab_case(name: &str) -> String {
    let mut out = String::new();
    let mut prev_lower = false;
    for c in name.chars() {
        if c.is_ascii_uppercase() && prev_lower {
            out.push('-');
        }
        prev_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
        out.push(if c == '_' { '-' } else { c.to_ascii_lowercase() });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(input: TokenStream) -> Vec<String> {
        let input: DeriveInput = syn::parse2(input).expect("test input parses");
        match model_spec(&input) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn default_name_is_the_kebab_case_type_name() {
        assert_eq!(kebab_case("TinyVwn"), "tiny-vwn");
        assert_eq!(kebab_case("Vwn4x"), "vwn4x");
        assert_eq!(kebab_case("XHC"), "xhc");
        let input: DeriveInput = syn::parse_quote!(
            struct PlainModel;
        );
        assert_eq!(model_spec(&input).expect("defaults are valid").name, "plain-model");
    }

    #[test]
    fn embedded_text_round_trips_through_the_ron_parser() {
        let input: DeriveInput = syn::parse_quote! {
            #[widen(name = "x", d_model = 128, residual = ghc(m = 4, r = 2, tau = 0.7))]
            #[widen(train(optimizer = adamw(lr = 3e-3, betas = (0.9, 0.95)), clip = none))]
            struct X;
        };
        let spec = model_spec(&input).expect("valid");
        let text = embed(&spec, &input).expect("embeds");
        assert_eq!(ir::spec::parse_spec(&text, "t").expect("parses"), spec);
    }

    #[test]
    fn messages_name_their_field_once() {
        let error = |path: &str, message: &str| FieldError { path: path.into(), message: message.into() };
        assert_eq!(describe(&error("residual.create", "create: Split needs ...")), "create: Split needs ...");
        assert_eq!(
            describe(&error("residual.read.form", "read.form must be Matrix")),
            "read.form must be Matrix"
        );
        assert_eq!(
            describe(&error("residual.k", "residual.k = 5 is too many")),
            "residual.k = 5 is too many"
        );
        assert_eq!(describe(&error("residual.n", "must be >= 1")), "residual.n: must be >= 1");
        assert_eq!(describe(&error("residual.creates", "create: x")), "residual.creates: create: x");
    }

    #[test]
    fn field_attributes_and_malformed_attributes_are_reported_together() {
        let found = errors(quote! {
            #[widen(d_model = )]
            #[widen(layrs = 2)]
            struct X { #[widen(d_model)] width: usize }
        });
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found[0].starts_with("unexpected end of input"), "{found:?}");
        assert_eq!(found[1], "`#[widen]` goes on the type, not on its fields");
        assert_eq!(found[2], "unknown key `layrs`; did you mean `layers`?");
    }
}
