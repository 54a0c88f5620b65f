//! Connection designs with a depth history (docs/math.md §12), written as attributes and
//! compared with the same designs in RON.
use widen::ir::spec::{parse_spec, DepthInit, DepthWeights, Entries, History, ResidualSpec};
use widen::VirtualWidth;

/// DenseFormer: one full-width stream whose state after every block is replaced by a
/// weighted average of the states so far, starting as the plain model.
#[derive(VirtualWidth)]
#[widen(d_model = 64, layers = 4, heads = 4)]
#[widen(residual = connection(streams = 1, history(entries = states, block = 2, weights = static(newest))))]
struct DenseFormer;

/// Dilated and periodic reads over every sublayer's state, equal weights at init.
#[derive(VirtualWidth)]
#[widen(d_model = 64, layers = 4, heads = 4)]
#[widen(residual = connection(
    streams = 1,
    history = (entries = states, block = 1, weights = static(mean), dilation = 2, period = 2),
))]
struct Dilated;

/// Block attention residuals: the history's defaults (outputs, two sublayers per entry,
/// attention weights).
#[derive(VirtualWidth)]
#[widen(d_model = 64, layers = 4, heads = 4)]
#[widen(residual = connection(streams = 1, history()))]
struct AttentionResiduals;

fn history(spec: widen::ir::spec::ModelSpec) -> Option<History> {
    match spec.residual {
        ResidualSpec::Connection(c) => c.history,
        other => panic!("a connection expected, got {other:?}"),
    }
}

pub fn main() {
    let dense = DenseFormer::spec();
    let ron = "Model(name: \"dense-former\", d_model: 64, layers: 4, heads: 4, \
               residual: Connection(streams: 1, history: (entries: States, block: 2, weights: Static(Newest))))";
    assert_eq!(dense, parse_spec(ron, "dense-former.ron").expect("the RON twin parses"));
    let expected = History {
        entries: Entries::States,
        block: 2,
        weights: DepthWeights::Static(DepthInit::Newest),
        ..History::default()
    };
    assert_eq!(history(dense), Some(expected));

    let dilated = history(Dilated::spec()).expect("a history");
    assert_eq!((dilated.block, dilated.dilation, dilated.period), (1, 2, 2));
    assert_eq!(dilated.weights, DepthWeights::Static(DepthInit::Mean));

    assert_eq!(history(AttentionResiduals::spec()), Some(History::default()));
}
