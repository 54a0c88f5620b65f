//! `docs/spec.md` is the output of `widen spec --reference`, which is generated from
//! the spec types' own `Deserialize` impls and doc comments: the document lists
//! exactly the fields the parser accepts, and this test keeps the file current.

use std::path::Path;

#[test]
fn docs_spec_md_is_the_generated_reference() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/spec.md");
    let written = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let generated = widen::ir::spec::reference::markdown();
    if written != generated {
        let line = written.lines().zip(generated.lines()).position(|(a, b)| a != b).unwrap_or(0) + 1;
        panic!(
            "docs/spec.md differs from the spec types from line {line}; regenerate it with \
             `cargo run -- spec --reference > docs/spec.md`"
        );
    }
}

#[test]
fn every_documented_field_is_accepted_by_the_parser_and_no_other() {
    for section in widen::ir::spec::reference::sections() {
        // A name the section does not list is an unknown field there (so the probe
        // text really reaches the section's struct)...
        let text = spec_setting(&section, "not_a_field");
        let err = widen::ir::spec::parse_spec(&text, "probe.ron").expect_err(&text).to_string();
        assert!(err.contains("unknown field `not_a_field`"), "{}: {err}\n{text}", section.ron);
        // ...and every listed field is known: set to a value of the wrong type, it is
        // reported, but never as unknown.
        for field in &section.fields {
            let text = spec_setting(&section, &field.name);
            if let Err(err) = widen::ir::spec::parse_spec(&text, "probe.ron") {
                let message = err.to_string();
                assert!(!message.contains("unknown field"), "{}: {message}\n{text}", field.path);
            }
        }
    }
}

/// A spec that writes `field: ()` inside the struct a section describes, through the
/// variants that lead to it.
fn spec_setting(section: &widen::ir::spec::reference::Section, field: &str) -> String {
    let variant =
        |path: &str| section.variants.iter().find(|(p, _)| p == path).map(|(_, v)| v.as_str()).unwrap_or("");
    let mut text = format!("{}({field}: ())", variant(&section.path));
    if section.path.is_empty() {
        return format!("Model{}", text.trim_start_matches(variant("")));
    }
    let steps: Vec<&str> = section.path.split('.').collect();
    for i in (0..steps.len()).rev() {
        let parent = steps[..i].join(".");
        let wrapper = if parent.is_empty() { "Model" } else { variant(&parent) };
        text = format!("{wrapper}({}: {text})", steps[i]);
    }
    text
}
