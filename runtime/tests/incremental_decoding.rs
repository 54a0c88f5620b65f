//! The cached (incremental) decoder against the full-window forward on every scheme's
//! spec (docs/architecture.md §7, "Sampling"): its logits at every position, and the tokens
//! a seeded generation draws, including past the trained sequence length.

mod common;

use common::spec::{shrunk_spec, Shrink};
use ir::exec::incremental::Decoder;
use ir::exec::{Tensor, Value};
use ir::spec::{FfnSpec, ModelSpec, ResidualSpec};
use runtime::device::Device;
use runtime::params::ParamSet;
use runtime::rng::Rng;
use runtime::sample::{Decoding, Generator, SampleError, SampleOptions};
use std::collections::HashMap;
use std::num::NonZeroUsize;

/// Every spec in `specs/`: one per scheme (Flash variants, MoE, MTP and bf16 included).
const SPECS: [&str; 20] = [
    "tiny.ron",
    "residual.ron",
    "hc.ron",
    "fc.ron",
    "mhc.ron",
    "mhc-lite.ron",
    "wide-residual.ron",
    "attn-residuals.ron",
    "denseformer.ron",
    "kromhc.ron",
    "mhc-bf16.ron",
    "vwn-1.5x.ron",
    "vwn-r4.ron",
    "vwn-r8.ron",
    "xhc.ron",
    "xhc-flash.ron",
    "mtp.ron",
    "moe.ron",
    "vwn-moe.ron",
    "xhc-moe.ron",
];

const SEQ_LEN: usize = 8;

fn spec(file: &str) -> ModelSpec {
    shrunk_spec(file, &Shrink { ffn_hidden: 48, moe_hidden: 16, seq_len: SEQ_LEN, batch: 1 })
}

/// The spec's initial parameters, each moved by up to ±0.05: every zero-initialized
/// connection weight and temporal kernel then takes part, so every cached path is tested.
fn params(spec: &ModelSpec) -> ParamSet {
    let lowered = ir::lower::lower(spec, 1, spec.train.seq_len).unwrap();
    let mut params = runtime::init::init_params(&lowered.graph, 3).unwrap();
    for p in params.iter_mut() {
        let mut rng = Rng::stream(11, &p.name);
        p.value.iter_mut().for_each(|v| *v += (0.1 * (rng.next_f64() - 0.5)) as f32);
    }
    params
}

/// A window of token ids in `0..vocab`, none repeating a neighbour.
fn window(len: usize, vocab: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 37 + 11) % vocab) as i32).collect()
}

/// The full-window logits `[T, V]` and the decoder's, position by position, both in f64.
fn both_logits(spec: &ModelSpec, params: &ParamSet) -> (Vec<f64>, Vec<f64>) {
    let lowered = ir::lower::lower(spec, 1, spec.train.seq_len).unwrap();
    let tokens = window(spec.train.seq_len + 1, spec.vocab);
    let mut sources: HashMap<_, Value<f64>> = HashMap::new();
    for p in params.iter() {
        let values: Vec<f64> = p.value.iter().map(|&v| f64::from(v)).collect();
        sources.insert(p.node, Value::Float(Tensor::from_f64(p.shape.clone(), &values)));
    }
    let shape = ir::Shape::new([1, spec.train.seq_len + 1]);
    sources.insert(lowered.tokens, Value::Int(Tensor::new(shape, tokens.clone())));
    let mut out = ir::exec::run::<f64>(&lowered.graph, &sources, &[lowered.logits]).unwrap();
    let full = out.remove(&lowered.logits).unwrap().into_float().unwrap().data;

    let mut decoder = Decoder::<f64>::for_spec(spec).unwrap();
    let wanted: Vec<String> = decoder.params().iter().map(|(n, _)| n.to_string()).collect();
    for name in wanted {
        let p = params.get(&name).unwrap();
        let values: Vec<f64> = p.value.iter().map(|&v| f64::from(v)).collect();
        decoder.set_param(&name, Tensor::from_f64(p.shape.clone(), &values)).unwrap();
    }
    let mut cached = Vec::new();
    for &t in &tokens[..spec.train.seq_len] {
        cached.extend(decoder.step(t).unwrap());
    }
    (full, cached)
}

/// The largest difference at each position, relative to that position's largest logit.
fn position_errors(full: &[f64], cached: &[f64], row: usize) -> Vec<f64> {
    full.chunks(row)
        .zip(cached.chunks(row))
        .map(|(f, c)| {
            let scale = f.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            f.iter().zip(c).fold(0.0f64, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .collect()
}

/// In f64 the decoder equals the full window at every position to 1e-9 relative (the
/// two differ only in how the products are blocked); bf16 rounds a few operands the other
/// way where the two f64 values straddle a bf16 rounding boundary, so there the bound is
/// 2e-2 (a few bf16 ulps).
#[test]
fn cached_logits_equal_the_full_window_at_every_position_on_every_scheme() {
    for file in SPECS {
        let spec = spec(file);
        let (full, cached) = both_logits(&spec, &params(&spec));
        assert_eq!(full.len(), cached.len(), "{file}");
        let errors = position_errors(&full, &cached, spec.model_vocab());
        let bound = if file.contains("bf16") { 2e-2 } else { 1e-9 };
        assert!(errors.iter().all(|&e| e <= bound), "{file}: relative errors per position {errors:?}");
        // Not a trivially equal pair: the logits vary with the context.
        assert_ne!(full[..spec.vocab], full[full.len() - spec.model_vocab()..], "{file}");
    }
}

/// A prefill of the first positions in one whole-window pass, then one position at a
/// time: the logits of the prefill's last position and of every later one equal the
/// full window's.
#[test]
fn a_prefill_then_steps_equal_the_full_window_on_every_scheme() {
    for file in SPECS {
        let spec = spec(file);
        let bound = if file.contains("bf16") { 2e-2 } else { 1e-9 };
        let errors = prefill_errors(&spec);
        assert!(errors.iter().all(|&e| e <= bound), "{file}: {errors:?}");
    }
}

/// The relative errors of a prefill of the first 5 positions and steps after it
/// against the full window, from the prefill's last position on.
fn prefill_errors(spec: &ModelSpec) -> Vec<f64> {
    let params = params(spec);
    let (full, _) = both_logits(spec, &params);
    let mut decoder = Decoder::<f64>::for_spec(spec).unwrap();
    let wanted: Vec<String> = decoder.params().iter().map(|(n, _)| n.to_string()).collect();
    for name in wanted {
        let p = params.get(&name).unwrap();
        let values: Vec<f64> = p.value.iter().map(|&v| f64::from(v)).collect();
        decoder.set_param(&name, Tensor::from_f64(p.shape.clone(), &values)).unwrap();
    }
    let tokens = window(SEQ_LEN + 1, spec.vocab);
    let row = spec.model_vocab();
    let at = 5;
    let mut cached = decoder.prefill(&tokens[..at]).unwrap();
    assert_eq!(decoder.position(), at);
    for &t in &tokens[at..SEQ_LEN] {
        cached.extend(decoder.step(t).unwrap());
    }
    let errors = position_errors(&full[(at - 1) * row..], &cached, row);
    assert_eq!(errors.len(), SEQ_LEN - at + 1);
    errors
}

/// Kernels shorter than the window: the temporal cache keeps only the κ − 1 rows the
/// longest kernel reads, and still agrees with the full window at every position.
#[test]
fn short_temporal_kernels_agree_past_their_reach() {
    for file in ["xhc.ron", "xhc-flash.ron"] {
        let mut spec = spec(file);
        let ResidualSpec::Xhc(x) = &mut spec.residual else { panic!("{file} is xHC") };
        x.conv_kernels = vec![2, 3];
        let (full, cached) = both_logits(&spec, &params(&spec));
        let errors = position_errors(&full, &cached, spec.model_vocab());
        assert!(errors.iter().all(|&e| e <= 1e-9), "{file}: {errors:?}");
        let errors = prefill_errors(&spec);
        assert!(errors.iter().all(|&e| e <= 1e-9), "{file} after a prefill: {errors:?}");
    }
}

/// With a capacity limit the full window routes all positions jointly and may drop an
/// assignment a later position makes (docs/math.md §1.6); the decoder routes one
/// position, where the capacity never binds. Where the capacity does not bind they
/// agree; where it does, the first position (never crowded out) still agrees.
#[test]
fn moe_capacity_binds_only_in_the_full_window() {
    let with_capacity = |factor: f64| {
        let mut spec = spec("moe.ron");
        let FfnSpec::Moe(m) = &mut spec.ffn else { panic!("moe.ron has an MoE FFN") };
        m.capacity_factor = Some(factor);
        spec
    };
    let loose = with_capacity(16.0);
    let (full, cached) = both_logits(&loose, &params(&loose));
    assert!(position_errors(&full, &cached, loose.model_vocab()).iter().all(|&e| e <= 1e-9));

    let tight = with_capacity(0.25);
    let (full, cached) = both_logits(&tight, &params(&tight));
    let errors = position_errors(&full, &cached, tight.model_vocab());
    assert!(errors[0] <= 1e-9, "{errors:?}");
    assert!(errors.iter().any(|&e| e > 1e-3), "the capacity drops something in the window: {errors:?}");
}

fn options(
    tokens: usize,
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    seed: u64,
) -> SampleOptions {
    SampleOptions { tokens, temperature, top_k: top_k.and_then(NonZeroUsize::new), top_p, seed }
}

fn generate(
    spec: &ModelSpec,
    params: &ParamSet,
    decoding: Decoding,
    prompt: &[u32],
    o: &SampleOptions,
) -> Vec<u32> {
    let mut generator = Generator::new(spec, params.clone(), decoding).unwrap();
    generator.generate(prompt, o).unwrap().ids
}

/// Cached and uncached generation draw the same tokens for the same seed, past the
/// trained sequence length too (the window slides, the cache is rebuilt).
#[test]
fn cached_and_uncached_generation_agree_on_every_scheme_past_seq_len() {
    let tokens = 2 * SEQ_LEN + 5;
    for file in SPECS {
        let spec = spec(file);
        let params = params(&spec);
        let prompt = [3, 200, 17];
        for (o, what) in [
            (options(tokens, 1.0, None, None, 5), "temperature 1"),
            (options(tokens, 0.0, None, None, 0), "greedy"),
            (options(tokens, 0.7, Some(20), Some(0.9), 9), "top-k 20, top-p 0.9"),
        ] {
            let cached = generate(&spec, &params, Decoding::Cached, &prompt, &o);
            let full = generate(&spec, &params, Decoding::Full(Device::Reference), &prompt, &o);
            assert_eq!(cached.len(), tokens);
            assert_eq!(cached, full, "{file}, {what}");
        }
    }
}

/// A prompt longer than the window: only its last `seq_len` tokens count, on both paths.
#[test]
fn a_prompt_longer_than_seq_len_is_cut_to_its_last_window() {
    let spec = spec("xhc.ron");
    let params = params(&spec);
    let long: Vec<u32> = (0..3 * SEQ_LEN as u32).map(|i| (i * 29 + 5) % 256).collect();
    let o = options(6, 1.0, None, None, 4);
    let cached = generate(&spec, &params, Decoding::Cached, &long, &o);
    assert_eq!(cached, generate(&spec, &params, Decoding::Full(Device::Reference), &long, &o));
    let tail = &long[long.len() - SEQ_LEN..];
    assert_eq!(cached, generate(&spec, &params, Decoding::Cached, tail, &o));
}

#[test]
fn top_k_one_and_a_tiny_top_p_are_greedy_and_a_seed_reproduces() {
    let spec = spec("tiny.ron");
    let params = params(&spec);
    let prompt = [72, 105];
    let greedy = generate(&spec, &params, Decoding::Cached, &prompt, &options(12, 0.0, None, None, 1));
    assert_eq!(greedy, generate(&spec, &params, Decoding::Cached, &prompt, &options(12, 0.0, None, None, 2)));
    for (o, what) in [
        (options(12, 1.0, Some(1), None, 3), "top-k 1"),
        (options(12, 1.5, None, Some(1e-9), 4), "top-p 1e-9"),
    ] {
        assert_eq!(greedy, generate(&spec, &params, Decoding::Cached, &prompt, &o), "{what}");
    }
    let o = options(12, 1.0, None, None, 7);
    let a = generate(&spec, &params, Decoding::Cached, &prompt, &o);
    assert_eq!(a, generate(&spec, &params, Decoding::Cached, &prompt, &o));
    // Near-uniform logits: another seed draws other tokens.
    assert_ne!(a, generate(&spec, &params, Decoding::Cached, &prompt, &options(12, 1.0, None, None, 8)));
}

/// `vocab_pad_to` pads the logits rows; a padded row is never drawn, even at a
/// temperature that makes every row about equally likely.
#[test]
fn padded_vocabulary_rows_are_never_drawn() {
    let mut spec = spec("residual.ron");
    spec.vocab = 100;
    spec.vocab_pad_to = Some(64);
    assert_eq!(spec.model_vocab(), 128);
    let params = params(&spec);
    let o = options(300, 1e6, None, None, 2);
    for decoding in [Decoding::Cached, Decoding::Full(Device::Reference)] {
        let ids = generate(&spec, &params, decoding, &[1, 2], &o);
        assert!(ids.iter().all(|&id| id < 100), "{decoding:?}: {ids:?}");
        assert!(ids.iter().any(|&id| id >= 64), "{decoding:?}: ids past the first 64 are drawn");
    }
}

#[test]
fn bad_knobs_and_prompts_are_refused_naming_the_value() {
    let spec = spec("residual.ron");
    let mut generator = Generator::new(&spec, params(&spec), Decoding::Cached).unwrap();
    let mut refuse = |prompt: &[u32], o: SampleOptions| generator.generate(prompt, &o).unwrap_err();
    let e = refuse(&[1], options(1, 1.0, None, Some(0.0), 0));
    assert!(matches!(e, SampleError::TopP(p) if p == 0.0), "{e}");
    let e = refuse(&[1], options(1, 1.0, None, Some(1.01), 0));
    assert_eq!(e.to_string(), "top_p 1.01 must be in (0, 1]");
    let e = refuse(&[1], options(1, 1.0, Some(257), None, 0));
    assert_eq!(e.to_string(), "top_k = 257 is more than the model's 256 tokens; it must be in 1..=256");
    let e = refuse(&[1], options(1, f64::INFINITY, None, None, 0));
    assert!(matches!(e, SampleError::Temperature(_)), "{e}");
    let e = refuse(&[], options(1, 1.0, None, None, 0));
    assert!(matches!(e, SampleError::EmptyPrompt), "{e}");
    let e = refuse(&[5, 256], options(1, 1.0, None, None, 0));
    assert_eq!(e.to_string(), "prompt token 256 at index 1 is outside the model's vocabulary 0..256");
}
