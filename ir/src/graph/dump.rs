//! Canonical text and DOT dumps. Nodes are numbered by their position in the
//! deterministic topological order, so dumps of the same spec are identical and
//! can be diffed and snapshot-tested (docs/architecture.md §4).

use super::{Graph, Init, NodeId, Op, Region};
use std::collections::HashMap;
use std::fmt::Write;

fn numbering(g: &Graph) -> (Vec<NodeId>, HashMap<NodeId, usize>) {
    let order = g.topo_order();
    let index = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    (order, index)
}

fn attrs(op: &Op) -> String {
    match op {
        Op::Input { name } => format!("\"{name}\""),
        Op::Param(p) => {
            let init = match &p.init {
                Init::Values(v) => format!("values[{}]", v.len()),
                other => format!("{other:?}"),
            };
            format!("\"{}\" init={} class={:?}", p.name, init, p.class)
        }
        Op::Constant { value } => format!("{value}"),
        Op::Affine { mul, add } => format!("mul={mul} add={add}"),
        Op::Cast { to } => format!("to={to}"),
        Op::Reduce { axis, keepdim, .. } => format!("axis={axis}{}", if *keepdim { " keepdim" } else { "" }),
        Op::MatMul { trans_a, trans_b } => {
            let mut s = String::new();
            if *trans_a {
                s.push_str("trans_a");
            }
            if *trans_b {
                if !s.is_empty() {
                    s.push(' ');
                }
                s.push_str("trans_b");
            }
            s
        }
        Op::Reshape { shape } | Op::Broadcast { shape } => format!("{shape:?}"),
        Op::Permute { perm } => format!("{perm:?}"),
        Op::Slice { axis, start, end } => format!("axis={axis} {start}..{end}"),
        Op::Concat { axis } | Op::Gather { axis } | Op::ScatterAdd { axis } | Op::ScatterRows { axis } => {
            format!("axis={axis}")
        }
        Op::TopK { k, fixed } => format!("k={k} fixed={fixed}"),
        Op::RmsNorm { eps } | Op::LayerNorm { eps } => format!("eps={eps:e}"),
        Op::GroupNorm { groups, eps } => format!("groups={groups} eps={eps:e}"),
        Op::NormProject { eps, centered } => format!("eps={eps:e} centered={centered}"),
        Op::CausalAttention { scale, rope_base } => match rope_base {
            Some(b) => format!("scale={scale} rope={b}"),
            None => format!("scale={scale}"),
        },
        Op::LinearCrossEntropy { trans_b, scale, chunk } => {
            format!("trans_b={trans_b} scale={scale} chunk={chunk}")
        }
        Op::LinearCrossEntropyGrad { trans_b, scale, chunk, wrt } => {
            format!("trans_b={trans_b} scale={scale} chunk={chunk} wrt={wrt}")
        }
        Op::Sinkhorn { iters, eps } => format!("iters={iters} eps={eps:e}"),
        Op::TemporalAugment { gram_schmidt, eps_rel } => {
            format!("gram_schmidt={gram_schmidt} eps_rel={eps_rel:e}")
        }
        Op::CausalAttentionGrad { scale, rope_base, wrt } => match rope_base {
            Some(b) => format!("scale={scale} rope={b} wrt={wrt}"),
            None => format!("scale={scale} wrt={wrt}"),
        },
        Op::SinkhornGrad { iters, eps } => format!("iters={iters} eps={eps:e}"),
        Op::TemporalAugmentGrad { gram_schmidt, eps_rel, wrt } => {
            format!("gram_schmidt={gram_schmidt} eps_rel={eps_rel:e} wrt={wrt}")
        }
        Op::MoeRoute { experts, capacity, .. } => match capacity {
            Some(c) => format!("experts={experts} capacity={c}"),
            None => format!("experts={experts}"),
        },
        Op::GroupedMatMul { trans_b } | Op::GroupedMatMulGrad { trans_b } => {
            if *trans_b {
                "trans_b".into()
            } else {
                String::new()
            }
        }
        Op::Unary(_) | Op::Binary(_) | Op::Softmax | Op::SoftmaxCrossEntropy => String::new(),
    }
}

fn role_text(g: &Graph, id: NodeId) -> String {
    let role = g.node(id).role;
    let mut s = format!("{:?}", role.region).to_lowercase();
    if let Some(l) = role.sublayer {
        write!(s, " s{l}").expect("write to string");
    }
    if let Some(k) = role.mtp {
        write!(s, " mtp{k}").expect("write to string");
    }
    s
}

/// One line per node: `%i = op(%a, %b) {attrs} : dtype[shape]  # label (region sublayer)`.
pub fn to_text(g: &Graph) -> String {
    let (order, index) = numbering(g);
    let mut out = String::new();
    for &id in &order {
        let node = g.node(id);
        let args: Vec<String> = g.inputs(id).iter().map(|i| format!("%{}", index[i])).collect();
        let a = attrs(&node.op);
        write!(out, "%{} = {}({})", index[&id], node.op.name(), args.join(", ")).expect("write");
        if !a.is_empty() {
            write!(out, " {{{a}}}").expect("write");
        }
        write!(out, " : {}{}", node.dtype, node.shape).expect("write");
        write!(out, "  # ").expect("write");
        if let Some(label) = &node.label {
            write!(out, "{label} ").expect("write");
        }
        writeln!(out, "({})", role_text(g, id)).expect("write");
    }
    for (name, id) in g.outputs() {
        writeln!(out, "output {name} = %{}", index[id]).expect("write");
    }
    out
}

/// Graphviz DOT, with nodes colored by region.
pub fn to_dot(g: &Graph) -> String {
    let (order, index) = numbering(g);
    let mut out = String::from(
        "digraph widen {\n  rankdir=TB;\n  node [shape=box, style=filled, fontname=\"monospace\"];\n",
    );
    for &id in &order {
        let node = g.node(id);
        let color = match node.role.region {
            Region::Embedding => "lightyellow",
            Region::Connection => "lightblue",
            Region::Backbone => "white",
            Region::Collapse => "lightpink",
            Region::Head => "lightgreen",
            Region::Loss => "orange",
            Region::Backward => "lightgrey",
        };
        let label = node.label.as_deref().unwrap_or("");
        writeln!(
            out,
            "  n{} [label=\"%{} {}\\n{}{}\\n{}\", fillcolor={}];",
            index[&id],
            index[&id],
            node.op.name(),
            node.dtype,
            node.shape,
            label.replace('"', "'"),
            color
        )
        .expect("write");
    }
    for &id in &order {
        for (slot, input) in g.inputs(id).iter().enumerate() {
            writeln!(out, "  n{} -> n{} [label=\"{}\"];", index[input], index[&id], slot).expect("write");
        }
    }
    out.push_str("}\n");
    out
}
