//! `#[derive(VirtualWidth)]`: compile-pass cases (tests/derive/pass/, compiled into this test
//! crate), compile-fail cases (tests/derive/fail/, checked by trybuild against their `.stderr`),
//! and the derive-versus-RON equivalence of docs/architecture.md §2: a derive and a RON file
//! saying the same things give equal specs and identical graphs.

use std::path::Path;

use widen::ir::graph::to_text;
use widen::ir::lower::lower;
use widen::ir::spec::{load_spec, ModelSpec};
use widen::VirtualWidth;

/// The compile-fail cases only: trybuild then type-checks (`cargo check`) rather than builds
/// its copy of the dependencies. The pass cases are modules of this crate, run below.
#[test]
fn derive_compile_errors() {
    trybuild::TestCases::new().compile_fail("tests/derive/fail/*.rs");
}

#[path = "derive/pass/connection.rs"]
mod pass_connection;
#[path = "derive/pass/history.rs"]
mod pass_history;
#[path = "derive/pass/plain.rs"]
mod pass_plain;
#[path = "derive/pass/vwn.rs"]
mod pass_vwn;
#[path = "derive/pass/xhc.rs"]
mod pass_xhc;

#[test]
fn derive_defaults_and_generics() {
    pass_plain::main();
}

#[test]
fn derive_connection_designs_equal_their_ron_files() {
    pass_connection::main();
}

#[test]
fn derive_connection_with_a_depth_history() {
    pass_history::main();
}

#[test]
fn derive_vwn_with_moe_mtp_and_training() {
    pass_vwn::main();
}

#[test]
fn derive_xhc_with_every_knob() {
    pass_xhc::main();
}

/// The twin of `specs/vwn-r4.ron`, field for field.
#[derive(VirtualWidth)]
#[widen(name = "vwn-r4", vocab = 256, d_model = 64, layers = 2, heads = 4)]
#[widen(residual = ghc(m = 4, n = 16, dynamic = true, embed_mode = full, reduce_init = block_identity))]
#[widen(train(seq_len = 64, batch = 8, steps = 300, optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 30)))]
struct VwnR4;

/// The twin of `specs/xhc.ron`, field for field.
#[derive(VirtualWidth)]
#[widen(name = "xhc", vocab = 256, d_model = 64, layers = 2, heads = 4)]
#[widen(residual = xhc(n = 16, k = 4, fixed = 2, conv_kernels = [4, 8, 12], router = sigmoid,
                       sinkhorn_iters = 20, flash = none))]
#[widen(train(seq_len = 64, batch = 8, steps = 300, optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 30)))]
struct Xhc;

fn ron_spec(name: &str) -> ModelSpec {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join(name);
    load_spec(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn assert_twins<T: VirtualWidth>(file: &str) {
    let ron = ron_spec(file);
    assert_eq!(T::spec(), ron, "{file}");
    let derived = T::graph().expect("the derived spec lowers");
    let loaded = lower(&ron, ron.train.batch, ron.train.seq_len).expect("the RON spec lowers");
    assert_eq!(to_text(&derived.graph), to_text(&loaded.graph), "{file}");
}

#[test]
fn vwn_r4_derive_equals_ron() {
    assert_twins::<VwnR4>("vwn-r4.ron");
}

#[test]
fn xhc_derive_equals_ron() {
    assert_twins::<Xhc>("xhc.ron");
}

/// Guards the twins against passing vacuously: one changed value breaks equality.
#[test]
fn twins_differ_when_one_value_differs() {
    #[derive(VirtualWidth)]
    #[widen(name = "vwn-r4", vocab = 256, d_model = 64, layers = 2, heads = 4)]
    #[widen(residual = ghc(m = 4, r = 2))]
    #[widen(train(seq_len = 64, batch = 8, steps = 300, optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 30)))]
    struct VwnR2;
    assert_ne!(VwnR2::spec(), ron_spec("vwn-r4.ron"));
}
