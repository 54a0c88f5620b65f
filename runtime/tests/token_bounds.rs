//! Token ids outside the vocabulary never reach a compiled kernel: every
//! entry point of every executor refuses the batch with
//! [`StepError::TokenOutOfRange`], naming the id, where it is and the
//! vocabulary, and leaves the parameters and the optimizer as they were.
//!
//! Without the check the Cpu device gathers embedding rows past the table and
//! scatter-adds the gradient past its buffer (heap corruption, a crash, or a
//! "successful" step on garbage). This file is its own test binary, so such a
//! crash fails these tests without taking others down.

use codegen::training::TrainingGraph;
use ir::spec::ModelSpec;
use runtime::device::cpu::{CpuDevice, CpuExecutor, CpuOptions};
use runtime::device::reference::ReferenceExecutor;
use runtime::init::init_params;
use runtime::optim::Optimizer;
use runtime::step::{check_tokens, StepError, StepExecutor, UpdateSettings};

/// Byte-level, as every corpus is, so the spec validates whatever it checks
/// about data; the ids tested lie outside it.
const VOCAB: usize = 256;
const BATCH: usize = 2;
const SEQ: usize = 8;

/// A small model, with one MTP module so its targets are checked too.
fn spec() -> ModelSpec {
    ModelSpec::from_ron_str(&format!(
        "Model(name: \"bounds\", vocab: {VOCAB}, d_model: 16, layers: 1, heads: 2, mtp: (depth: 1), \
         train: (batch: {BATCH}, seq_len: {SEQ}, steps: 100, data: Synthetic(Default)))"
    ))
    .expect("spec parses")
}

/// A valid batch: ids spread over the whole vocabulary.
fn valid_tokens() -> Vec<i32> {
    (0..BATCH * (SEQ + 1)).map(|i| ((i * 7) % VOCAB) as i32).collect()
}

/// `tokens` with `id` at row 1, position 3.
fn with_bad(id: i32) -> Vec<i32> {
    let mut t = valid_tokens();
    t[SEQ + 1 + 3] = id;
    t
}

fn assert_refused(result: Result<impl std::fmt::Debug, StepError>, id: i32, what: &str) {
    match result {
        Err(e @ StepError::TokenOutOfRange { .. }) => {
            let StepError::TokenOutOfRange { id: got, row, col, vocab } = e else { unreachable!() };
            assert_eq!((got, row, col, vocab), (id, 1, 3, VOCAB), "{what}");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("token id {id}")) && msg.contains(&format!("0..{VOCAB}")),
                "{what}: {msg}"
            );
        }
        other => panic!("{what}: id {id} was not refused: {other:?}"),
    }
}

/// Every entry point that takes tokens refuses an id at the vocabulary's
/// size, far above it and below zero; a refused training step changes no
/// parameter and no optimizer state, and the executor still runs a valid
/// batch afterwards with the loss of a fresh one.
fn refuses_out_of_range_ids(mut exec: Box<dyn StepExecutor>, fresh: Box<dyn StepExecutor>) {
    let spec = spec();
    let lowered = ir::lower::lower(&spec, BATCH, SEQ).expect("lower");
    let mut params = init_params(&lowered.graph, spec.train.seed).expect("init");
    let mut opt = Optimizer::new(&spec, &params);
    let settings = UpdateSettings { lr_mult: 1.0, clip: spec.train.clip };
    let device = exec.device();
    for id in [VOCAB as i32, VOCAB as i32 + 1000, i32::MAX, -1, i32::MIN] {
        let bad = with_bad(id);
        assert_refused(exec.loss(&params, &bad), id, &format!("{device} loss"));
        assert_refused(exec.loss_and_grads(&params, &bad), id, &format!("{device} loss_and_grads"));
        assert_refused(exec.logits(&params, &bad), id, &format!("{device} logits"));
        let before: Vec<Vec<f32>> = params.iter().map(|p| p.value.clone()).collect();
        assert_refused(
            exec.train_step(&mut params, &bad, &mut opt, settings),
            id,
            &format!("{device} train_step"),
        );
        assert!(params.iter().zip(&before).all(|(p, b)| &p.value == b), "{device}: parameters changed");
        assert_eq!(opt.steps_taken(), 0, "{device}: the optimizer stepped");
    }
    let tokens = valid_tokens();
    let loss = exec.loss(&params, &tokens).expect("a valid batch runs after refused ones");
    let mut fresh = fresh;
    let want = fresh.loss(&params, &tokens).expect("fresh executor");
    assert!(loss.is_finite() && loss.to_bits() == want.to_bits(), "{device}: loss {loss} vs fresh {want}");
}

fn lowered() -> ir::lower::Lowered {
    ir::lower::lower(&spec(), BATCH, SEQ).expect("lower")
}

#[test]
fn the_cpu_device_refuses_ids_outside_the_vocabulary() {
    let cpu = || CpuExecutor::from_lowered(lowered(), CpuOptions { threads: 2 });
    refuses_out_of_range_ids(Box::new(cpu()), Box::new(cpu()));
}

/// The standalone trainer's path: an executor over a loaded Plan only (which holds
/// no logits, docs/math.md §1.7), given the spec's vocabulary.
#[test]
fn an_executor_over_a_bare_plan_refuses_ids_outside_the_vocabulary_it_is_given() {
    let cpu = || {
        let plan = TrainingGraph::new(lowered()).and_then(|g| g.plan()).expect("plan");
        let compiler = codegen::cc::Compiler::from_env().expect("C compiler");
        let device = CpuDevice::with_options(plan, &compiler, CpuOptions { threads: 2 }).expect("load");
        CpuExecutor::new(device, [BATCH, SEQ + 1], VOCAB).expect("executor")
    };
    refuses_out_of_range_ids(Box::new(cpu()), Box::new(cpu()));
}

#[test]
fn the_reference_executor_refuses_ids_outside_the_vocabulary() {
    let reference = || ReferenceExecutor::from_lowered(lowered());
    refuses_out_of_range_ids(Box::new(reference()), Box::new(reference()));
}

#[test]
fn check_tokens_bounds_every_id_and_the_length() {
    let shape = [BATCH, SEQ + 1];
    assert!(check_tokens(&valid_tokens(), shape, VOCAB).is_ok());
    let all_top = vec![VOCAB as i32 - 1; BATCH * (SEQ + 1)];
    assert!(check_tokens(&all_top, shape, VOCAB).is_ok(), "vocab - 1 is the largest valid id");
    assert_refused(check_tokens(&with_bad(VOCAB as i32), shape, VOCAB), VOCAB as i32, "check_tokens");
    let short = &valid_tokens()[1..];
    assert!(matches!(
        check_tokens(short, shape, VOCAB),
        Err(StepError::TokenCount { got, expected }) if got == short.len() && expected == BATCH * (SEQ + 1)
    ));
}
