//! The code cites the docs by section: `docs/math.md §5.3`, `docs/architecture.md §7`
//! (also as links, `docs/math.md#s5.3`, and in lists, `docs/math.md §4.3, §4.5` or
//! `§5.1-§5.6`). Every cited section must have its anchor (`<a id="s5.3"></a>`) in
//! the doc, and no source file may point at the math or design notes by any other
//! path. The test reads only this repository.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The cited docs, relative to the repository root.
const DOCS: [&str; 2] = ["docs/math.md", "docs/architecture.md"];

/// File kinds that carry citations.
const EXTENSIONS: [&str; 6] = ["rs", "md", "toml", "ron", "py", "sh"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` with one of `EXTENSIONS`, skipping build output, git
/// metadata and the docs themselves.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir).expect("read a source folder").flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            let skip = name == "target" || (name.starts_with('.') && name != ".ci");
            let is_docs = dir == root() && name == "docs";
            if !skip && !is_docs {
                sources(&path, out);
            }
        } else if kind.is_file() {
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if EXTENSIONS.contains(&ext) || (dir.file_name().is_some_and(|d| d == ".ci") && name == "run") {
                out.push(path);
            }
        }
    }
}

/// The section anchors (`<a id="s5.3"></a>` gives "5.3") of a doc.
fn anchors(doc: &str) -> BTreeSet<String> {
    let text = fs::read_to_string(root().join(doc)).unwrap_or_else(|e| panic!("read {doc}: {e}"));
    text.split("<a id=\"s")
        .skip(1)
        .filter_map(|rest| rest.split_once("\"></a>"))
        .map(|(id, _)| id.to_string())
        .collect()
}

/// A section number at the start of `s` ("5.3", "9.2.1"), without a trailing dot.
fn section_number(s: &str) -> Option<&str> {
    let len = s.char_indices().find(|&(_, c)| !(c.is_ascii_digit() || c == '.')).map_or(s.len(), |(i, _)| i);
    let number = s[..len].trim_end_matches('.');
    (!number.is_empty() && number.starts_with(|c: char| c.is_ascii_digit())).then_some(number)
}

/// The section numbers cited right after a mention of a doc: `§4.3, §4.5`, `§5.1-§5.6`,
/// `§2 and §3`, `#s5.3`, across a line break inside a comment (`//!` or `///`).
fn cited_sections(after: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = after;
    if let Some(link) = rest.strip_prefix("#s") {
        if let Some(n) = section_number(link) {
            found.push(n.to_string());
        }
        return found;
    }
    loop {
        let trimmed = rest.trim_start_matches(|c: char| {
            c.is_whitespace() || matches!(c, ',' | ';' | '/' | '!' | '*' | '#' | '-' | '–' | '(' | '&')
        });
        let trimmed = ["and ", "or "].iter().find_map(|w| trimmed.strip_prefix(w)).unwrap_or(trimmed);
        let Some(marked) = trimmed.strip_prefix('§') else { break };
        let marked = marked.trim_start_matches('§').trim_start();
        let Some(n) = section_number(marked) else { break };
        found.push(n.to_string());
        rest = &marked[n.len()..];
    }
    found
}

#[test]
fn every_cited_section_has_an_anchor_and_no_file_points_elsewhere() {
    let root = root();
    let anchors: Vec<(&str, BTreeSet<String>)> = DOCS.iter().map(|&d| (d, anchors(d))).collect();
    for (doc, set) in &anchors {
        assert!(set.len() > 10, "{doc} has only {} section anchors", set.len());
    }
    // Written in two halves so that this file does not match itself.
    let outside = [concat!("MATH", ".md"), concat!("DESIGN", ".md")];

    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(files.len() > 100, "found only {} source files under {}", files.len(), root.display());

    let mut problems = Vec::new();
    let mut citations = 0;
    for file in &files {
        let Ok(text) = fs::read_to_string(file) else { continue };
        let rel = file.strip_prefix(&root).unwrap_or(file).display().to_string();
        let line_of = |at: usize| text[..at].matches('\n').count() + 1;
        for (doc, set) in &anchors {
            for (at, _) in text.match_indices(doc) {
                for section in cited_sections(&text[at + doc.len()..]) {
                    citations += 1;
                    if !set.contains(&section) {
                        problems.push(format!(
                            "{rel}:{}: cites {doc} §{section}, which has no anchor",
                            line_of(at)
                        ));
                    }
                }
            }
        }
        for name in outside {
            for (at, _) in text.match_indices(name) {
                if !text[..at].ends_with("docs/") {
                    problems
                        .push(format!("{rel}:{}: mentions {name}; cite the docs/ file instead", line_of(at)));
                }
            }
        }
    }
    assert!(citations > 300, "found only {citations} section citations");
    assert!(problems.is_empty(), "{} bad doc citations:\n{}", problems.len(), problems.join("\n"));
}

#[test]
fn citation_lists_are_read_whole() {
    assert_eq!(cited_sections(" §4.3, §4.5)."), ["4.3", "4.5"]);
    assert_eq!(cited_sections(" §5.1-§5.6"), ["5.1", "5.6"]);
    assert_eq!(cited_sections("\n//! §6.2 and §6.3."), ["6.2", "6.3"]);
    assert_eq!(cited_sections("#s9.2.1)"), ["9.2.1"]);
    assert_eq!(cited_sections(" §0.3. Next"), ["0.3"]);
    assert!(cited_sections(" notes bf16").is_empty());
}
