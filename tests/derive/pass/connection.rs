//! The two shipped connection-language designs (docs/connections.md) written as attributes:
//! each derive equals its RON file, field for field.
use std::path::Path;

use widen::ir::spec::{load_spec, CoefInit, CollapseRule, Constraint, Form, ModelSpec, ResidualSpec};
use widen::VirtualWidth;

/// The twin of `specs/wide-residual.ron`.
#[derive(VirtualWidth)]
#[widen(name = "wide-residual", vocab = 256, d_model = 64, layers = 2, heads = 4)]
#[widen(residual = connection(
    streams = 4,
    create = replicate,
    collapse = readout(init = logit(0.25), constraint = sigmoid(scale = 1.0, offset = 0.0)),
    generator = none,
    read(init = logit(0.25), constraint = sigmoid(scale = 1.0, offset = 0.0)),
    carry(init = logit(0.99), constraint = sigmoid(scale = 0.1, offset = 0.9), form = per_slot),
    write(init = linspace(-0.01, 0.01), constraint = sigmoid(scale = 2.0, offset = 0.0)),
))]
#[widen(train(seq_len = 64, batch = 8, steps = 300, optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 30)))]
struct WideResidual;

/// The twin of `specs/mhc-lite.ron`.
#[derive(VirtualWidth)]
#[widen(name = "mhc-lite", vocab = 256, d_model = 64, layers = 2, heads = 4)]
#[widen(residual = connection(
    streams = 4,
    create = replicate,
    collapse = sum,
    generator = flat(gain = true, proj_init = zero, gate_init = 0.01),
    read(init = home(on = 1.0, off = -1.0), constraint = sigmoid(scale = 1.0, offset = 0.0)),
    carry(init = first(on = 0.0, off = -8.0), constraint = permutations),
    write(init = home(on = 1.0, off = -1.0), constraint = sigmoid(scale = 2.0, offset = 0.0)),
))]
#[widen(train(seq_len = 64, batch = 8, steps = 300, optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 30)))]
struct MhcLite;

fn ron_spec(name: &str) -> ModelSpec {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join(name);
    load_spec(&path).unwrap_or_else(|e| panic!("{e}"))
}

pub fn main() {
    assert_eq!(WideResidual::spec(), ron_spec("wide-residual.ron"));
    assert_eq!(MhcLite::spec(), ron_spec("mhc-lite.ron"));

    // The equalities above are not vacuous: the derived values are the written ones.
    let ResidualSpec::Connection(wide) = WideResidual::spec().residual else {
        panic!("a connection expected")
    };
    assert_eq!(wide.write.init, CoefInit::Linspace(-0.01, 0.01));
    assert_eq!(wide.carry.form, Form::PerSlot);
    assert_eq!(wide.carry.constraint, Constraint::Sigmoid { scale: 0.1, offset: 0.9 });
    assert!(matches!(&wide.collapse, CollapseRule::Readout(c) if c.init == CoefInit::Logit(0.25)));
    let ResidualSpec::Connection(lite) = MhcLite::spec().residual else { panic!("a connection expected") };
    assert_eq!(lite.carry.constraint, Constraint::Permutations);
    assert_ne!(lite, wide);
}
