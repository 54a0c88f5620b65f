//! Lowering: every scheme produces a well-formed graph with the documented interface.

use ir::lower::lower;
use ir::spec::ModelSpec;

fn tiny() -> ModelSpec {
    ModelSpec { d_model: 16, layers: 2, heads: 2, vocab: 32, ..ModelSpec::default() }
}

#[test]
fn plain_residual_graph_has_interface_and_checks() {
    let spec = tiny();
    let low = lower(&spec, 2, 8).unwrap();
    low.graph.check().unwrap();
    assert_eq!(low.graph.node(low.tokens).shape.dims(), &[2, 9]);
    assert_eq!(low.graph.node(low.logits).shape.dims(), &[2, 8, 32]);
    assert!(low.graph.node(low.loss).shape.dims().is_empty());
    let text = ir::graph::to_text(&low.graph);
    assert!(text.contains("\"blocks.1.ffn.w2\""), "{text}");
}
