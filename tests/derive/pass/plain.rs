//! No attributes: the RON defaults, named after the type.
use widen::ir::spec::ModelSpec;
use widen::VirtualWidth;

#[derive(VirtualWidth)]
struct PlainModel;

/// Generic marker types work too.
#[derive(VirtualWidth)]
#[widen(layers = 1)]
struct Generic<T>(std::marker::PhantomData<T>);

pub fn main() {
    assert_eq!(PlainModel::spec(), ModelSpec { name: "plain-model".into(), ..ModelSpec::default() });
    assert_eq!(Generic::<u8>::spec().layers, 1);
    let lowered = PlainModel::graph().expect("the default spec lowers");
    assert!(lowered.graph.node_count() > 0);
}
