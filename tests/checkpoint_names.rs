//! The tensor names widen writes into checkpoints against the two places that
//! describe them outside the code: the PyTorch loader's name table
//! (`python/widen_torch.py`, `TENSOR_NAMES`) and docs/checkpoints.md. A name
//! changed on either side fails here.

use std::collections::BTreeSet;
use std::path::Path;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The parameter names (checkpoint keys) of the model `specs/<file>` describes.
fn written_names(file: &str) -> (ir::spec::ModelSpec, BTreeSet<String>) {
    let spec = ir::spec::load_spec(&repo("specs").join(file)).unwrap();
    let lowered = ir::lower::lower(&spec, 1, spec.train.seq_len).unwrap();
    let params = runtime::params::ParamSet::zeros(&lowered.graph).unwrap();
    let names = params.iter().map(|p| p.name.clone()).collect();
    (spec, names)
}

/// The loader's `TENSOR_NAMES`: the JSON literal between its BEGIN and END lines.
fn loader_table() -> serde_json::Value {
    let source = std::fs::read_to_string(repo("python/widen_torch.py")).unwrap();
    let start =
        source.find("# BEGIN TENSOR_NAMES\n").expect("python/widen_torch.py has a BEGIN TENSOR_NAMES line");
    let end = source.find("# END TENSOR_NAMES").expect("python/widen_torch.py has an END TENSOR_NAMES line");
    let literal = source[start..end].split_once('\n').unwrap().1.trim();
    let json = literal.strip_prefix("TENSOR_NAMES = ").expect("the block assigns TENSOR_NAMES");
    serde_json::from_str(json).unwrap_or_else(|e| panic!("TENSOR_NAMES is not JSON: {e}"))
}

/// Every name of a table group, `{i}` over the blocks and `{j}` over the xHC
/// convolutions; `skip` leaves out roles.
fn expand(group: &serde_json::Value, spec: &ir::spec::ModelSpec, skip: &[&str]) -> BTreeSet<String> {
    let convs = match &spec.residual {
        ir::spec::ResidualSpec::Xhc(x) => x.conv_kernels.len(),
        _ => 0,
    };
    let mut out = BTreeSet::new();
    for (role, template) in group.as_object().unwrap() {
        if skip.contains(&role.as_str()) {
            continue;
        }
        let template = template.as_str().unwrap();
        let blocks = if template.contains("{i}") { spec.layers } else { 1 };
        for i in 0..blocks {
            let name = template.replace("{i}", &i.to_string());
            if name.contains("{j}") {
                out.extend((0..convs).map(|j| name.replace("{j}", &j.to_string())));
            } else {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn the_pytorch_loader_reads_the_names_widen_writes() {
    let table = loader_table();
    // (spec, table group, backbone roles the scheme does not have): GHC's embedding is
    // `embed_wide` (embed_mode Full in specs/vwn-r4.ron).
    let cases = [
        ("residual.ron", "residual", &[][..]),
        ("mhc.ron", "mhc", &[][..]),
        ("vwn-r4.ron", "ghc", &["embed"][..]),
        ("xhc.ron", "xhc", &[][..]),
    ];
    for (file, scheme, skip) in cases {
        let (spec, written) = written_names(file);
        let mut read = expand(&table["backbone"], &spec, skip);
        read.extend(expand(&table[scheme], &spec, &[]));
        let unread: Vec<&String> = written.difference(&read).collect();
        let absent: Vec<&String> = read.difference(&written).collect();
        assert!(
            unread.is_empty() && absent.is_empty(),
            "specs/{file}: widen writes {unread:?} that TENSOR_NAMES[{scheme:?}] lacks, and the loader \
             reads {absent:?} that widen does not write"
        );
    }
}

/// `blocks.3.ffn.conn.conv1` -> `blocks.{i}.{s}.conn.conv{j}`, `blocks.0.attn.wq` ->
/// `blocks.{i}.attn.wq`, `mtp.1.mix` -> `mtp.{k}.mix`.
fn template(name: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut previous = "";
    for part in name.split('.') {
        let numeric = part.chars().all(|c| c.is_ascii_digit());
        parts.push(match (previous, numeric) {
            ("blocks", true) => "{i}".into(),
            ("mtp", true) => "{k}".into(),
            _ if part.starts_with("conv") && part[4..].chars().all(|c| c.is_ascii_digit()) => {
                "conv{j}".into()
            }
            _ => part.to_string(),
        });
        previous = part;
    }
    // A connection tensor exists on both sublayer kinds (or, for xHC convolutions and a
    // history of states, as the doc says): `blocks.{i}.{s}.conn.phi`, `blocks.{i}.{s}.history.query`.
    for at in 0..parts.len().saturating_sub(1) {
        if (parts[at] == "attn" || parts[at] == "ffn")
            && (parts[at + 1] == "conn" || parts[at + 1] == "history")
        {
            parts[at] = "{s}".into();
        }
    }
    parts.join(".")
}

#[test]
fn docs_checkpoints_names_every_tensor_of_every_spec() {
    let doc = std::fs::read_to_string(repo("docs/checkpoints.md")).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(repo("specs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ron"))
        .collect();
    files.sort();
    for file in files {
        let (_, written) = written_names(&file);
        let missing: BTreeSet<String> =
            written.iter().map(|n| template(n)).filter(|t| !doc.contains(&format!("`{t}`"))).collect();
        assert!(
            missing.is_empty(),
            "docs/checkpoints.md does not name {missing:?} (written for specs/{file})"
        );
    }
}
