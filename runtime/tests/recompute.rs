//! Recompute schedules (`train.recompute`, docs/math.md §4.5 "Recompute schedule",
//! `ir::passes::recompute_blocks`): on the Cpu device the loss and every gradient
//! are the same bits with and without each schedule (the clones run the
//! originals' ops on the originals' operands), and the Plan's scratch arena,
//! where the stored activations live, is smaller with it.

use codegen::training::TrainingGraph;
use ir::spec::{ConstantSpec, ModelSpec, Recompute, ScheduleSpec};
use runtime::data::{BatchSampler, Corpus};
use runtime::device::cpu::{CpuExecutor, CpuOptions};
use runtime::device::memory::PlanMemory;
use runtime::device::Device;
use runtime::init::init_params;
use runtime::step::StepExecutor;

mod common;
use common::spec::{shrunk_spec, Shrink};

/// The spec at test size with three blocks (six sublayers), so that blocks of
/// one and of two sublayers both leave several blocks.
fn spec(file: &str, recompute: Recompute) -> ModelSpec {
    let sizes = Shrink { ffn_hidden: 48, moe_hidden: 16, seq_len: 8, batch: 2 };
    let mut spec = shrunk_spec(file, &sizes);
    spec.layers = 3;
    spec.train.schedule = ScheduleSpec::Constant(ConstantSpec { warmup: 0 });
    spec.train.recompute = recompute;
    spec
}

/// The loss and every gradient of one step on the Cpu device, and the bytes
/// of the training Plan's scratch arenas and the values the pass cloned.
fn step(spec: &ModelSpec) -> (f32, Vec<Vec<f32>>, u64, usize) {
    let (batch, seq) = (spec.train.batch, spec.train.seq_len);
    let lowered = ir::lower::lower(spec, batch, seq).expect("lower");
    let training = TrainingGraph::new(lowered.clone()).expect("training graph");
    let arena = PlanMemory::of(&training.plan().expect("plan"), Device::Cpu).arena_bytes;
    let params = init_params(&lowered.graph, spec.train.seed).expect("init");
    let mut cpu = CpuExecutor::from_lowered(lowered, CpuOptions { threads: 2 });
    let corpus =
        Corpus::load_data(&spec.train.data, spec.train.val_fraction, seq + 1, spec.vocab).expect("corpus");
    let tokens =
        BatchSampler::train(spec.train.seed, batch, seq + 1).next_batch(corpus.train()).expect("a batch");
    let (loss, grads) = cpu.loss_and_grads(&params, &tokens).expect("cpu step");
    (loss, grads, arena, training.passes.recompute.values)
}

fn bits(grads: &[Vec<f32>]) -> Vec<Vec<u32>> {
    grads.iter().map(|g| g.iter().map(|x| x.to_bits()).collect()).collect()
}

/// Same bits under every schedule; with `smaller`, a strictly smaller arena
/// under each but one block of every sublayer, else no larger.
fn check(file: &str, smaller: bool) {
    let (loss, grads, arena, none) = step(&spec(file, Recompute::None));
    assert_eq!(none, 0, "{file}: Recompute::None clones nothing");
    for recompute in [Recompute::Stream, Recompute::Block(2), Recompute::Block(3), Recompute::Block(6)] {
        let (l, g, a, values) = step(&spec(file, recompute));
        println!(
            "{file} {recompute:?}: arena {a} B (without recompute {arena} B), {values} values recomputed"
        );
        assert_eq!(l.to_bits(), loss.to_bits(), "{file} {recompute:?}: loss {l} vs {loss}");
        assert_eq!(g.len(), grads.len(), "{file} {recompute:?}: gradient count");
        for (i, (x, y)) in bits(&g).iter().zip(bits(&grads)).enumerate() {
            assert!(x == &y, "{file} {recompute:?}: gradient {i} differs");
        }
        // One block of every sublayer recomputes every state at once as the
        // backward starts: the same bits, not less memory (docs/math.md §4.5).
        if recompute == Recompute::Block(6) {
            continue;
        }
        if smaller {
            assert!(values > 0, "{file} {recompute:?}: nothing recomputed");
            assert!(a < arena, "{file} {recompute:?}: arena {a} B, not below {arena} B without recompute");
        } else {
            assert!(a <= arena, "{file} {recompute:?}: arena {a} B above {arena} B without recompute");
        }
    }
}

/// A plain residual has no stream intermediates; its F's pre-norm is still
/// recomputed from the stored state.
#[test]
fn residual_recomputes_the_pre_norm() {
    check("residual.ron", true);
}

#[test]
fn mhc_recomputes_the_stream_state() {
    check("mhc.ron", true);
}

#[test]
fn vwn_recomputes_the_stream_state() {
    check("vwn-r4.ron", true);
}

#[test]
fn xhc_recomputes_the_stream_state() {
    check("xhc.ron", true);
}

#[test]
fn hc_recomputes_the_stream_state() {
    check("hc.ron", true);
}

/// The depth history's reads are connection work like any other (docs/math.md §12.5): the
/// same bits under every schedule, and no more memory.
#[test]
fn depth_histories_recompute_their_reads() {
    check("attn-residuals.ron", false);
    check("denseformer.ron", false);
}
