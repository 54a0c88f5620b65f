//! The layer rule of the crate's module doc, checked on its sources: every
//! module's `crate::` and `super::` paths name only modules of its own layer's
//! lower part or of lower layers, and no device names another
//! (docs/architecture.md §7).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path prefixes and their layers, most specific first (the crate's module doc).
const LAYERS: &[(&str, u8)] = &[
    ("device::plan_check", 3),
    ("device::plan_io", 3),
    ("device::plan_update", 3),
    ("device::ceilings", 3),
    ("device::reference", 4),
    ("device::cpu", 4),
    ("device::cuda", 4),
    ("device", 5),
    ("step", 2),
    ("rng", 1),
    ("params", 1),
    ("process", 1),
    ("optim", 1),
    ("dist", 1),
    ("data", 1),
    ("init", 1),
    ("checkpoint", 1),
    ("moe", 6),
    ("train", 6),
    ("eval", 6),
    ("sample", 6),
    ("coord", 6),
    ("parity", 6),
    ("standalone", 6),
    ("layers", 6),
];

/// The device layer: its modules must not import each other.
const DEVICES: u8 = 4;

/// The layer of a module and the prefix that gave it; the crate root is 0.
fn layer(module: &[String]) -> (u8, String) {
    let path = module.join("::");
    LAYERS
        .iter()
        .find(|(prefix, _)| path == *prefix || path.starts_with(&format!("{prefix}::")))
        .map_or((0, String::new()), |&(prefix, l)| (l, prefix.to_string()))
}

/// Every module of the crate (by path) and its source.
fn modules(dir: &Path, at: &[String], out: &mut BTreeMap<Vec<String>, String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).expect("read a source folder").flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            let mut inner = at.to_vec();
            inner.push(name);
            modules(&path, &inner, out);
        } else if let Some(stem) = name.strip_suffix(".rs") {
            let mut module = at.to_vec();
            if stem != "mod" && stem != "lib" {
                module.push(stem.to_string());
            }
            out.insert(module, std::fs::read_to_string(&path).expect("read a source file"));
        }
    }
}

/// The paths after each `crate::` or `super::` of `code` (comments removed),
/// as absolute segment lists from `module`; a `{..}` group gives one path per item.
fn paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(['c', 's']) {
        let before = rest[..i].chars().next_back();
        let here = &rest[i..];
        rest = &rest[i + 1..];
        if before.is_some_and(is_ident) || before == Some(':') {
            continue;
        }
        let (mut base, mut tail) = if let Some(t) = here.strip_prefix("crate::") {
            (Vec::new(), t)
        } else if here.starts_with("super::") {
            let mut base = module.to_vec();
            let mut t = here;
            while let Some(after) = t.strip_prefix("super::") {
                base.pop();
                t = after;
            }
            (base, t)
        } else {
            continue;
        };
        loop {
            if let Some(group) = tail.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let item: Vec<String> = item
                        .trim()
                        .split("::")
                        .map(str::trim)
                        .take_while(|s| !s.is_empty() && s.chars().all(is_ident))
                        .map(String::from)
                        .collect();
                    out.push(base.iter().cloned().chain(item).collect());
                }
                break;
            }
            let len = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
            if len == 0 {
                out.push(base);
                break;
            }
            base.push(tail[..len].to_string());
            match tail[len..].strip_prefix("::") {
                Some(next) => tail = next,
                None => {
                    out.push(base);
                    break;
                }
            }
        }
    }
    out
}

/// The longest prefix of `path` that is a module.
fn resolve(path: &[String], known: &BTreeMap<Vec<String>, String>) -> Option<Vec<String>> {
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| known.contains_key(p))
}

#[test]
fn no_module_imports_a_higher_layer_and_no_device_another() {
    let mut known = BTreeMap::new();
    modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[], &mut known);
    assert!(known.len() > 30, "found only {} modules", known.len());
    let mut broken = Vec::new();
    for (module, source) in &known {
        let code: String =
            source.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
        // Inside an inline `mod tests { .. }`, `super` is the file's own module.
        let mut in_tests = module.clone();
        in_tests.push("tests".into());
        let (main, tests) = code.split_at(code.find("mod tests {").unwrap_or(code.len()));
        let imports: BTreeSet<Vec<String>> = paths(main, module)
            .into_iter()
            .chain(paths(tests, &in_tests))
            .filter_map(|p| resolve(&p, &known))
            .filter(|p| !p.starts_with(module))
            .collect();
        let (own, own_prefix) = layer(module);
        for import in imports {
            let (theirs, their_prefix) = layer(&import);
            if theirs > own || (own == DEVICES && theirs == DEVICES && own_prefix != their_prefix) {
                broken.push(format!(
                    "{} (layer {own}) imports {} (layer {theirs})",
                    module.join("::"),
                    import.join("::")
                ));
            }
        }
    }
    assert!(broken.is_empty(), "layer order broken:\n{}", broken.join("\n"));
}

#[test]
fn the_check_sees_an_upward_import() {
    let mut known = BTreeMap::new();
    for m in ["step", "device", "device::cpu"] {
        known.insert(m.split("::").map(String::from).collect::<Vec<_>>(), String::new());
    }
    let step = vec!["step".to_string()];
    let found: Vec<_> =
        paths("use crate::device::cpu::{CpuError, CpuExecutor};\nlet d = super::device::Device::Cpu;", &step)
            .into_iter()
            .filter_map(|p| resolve(&p, &known))
            .collect();
    assert_eq!(found, [vec!["device", "cpu"], vec!["device", "cpu"], vec!["device"]]);
    assert!(layer(&found[0]).0 > layer(&step).0);
}
