//! Training on token shards (docs/data.md): llm.c shards and nanoGPT's headerless
//! files read through `train.data = Tokens(..)`, both window orders resumable bit for
//! bit, the fixed validation budget, bits per byte, ids checked against `vocab`, and a
//! padded vocabulary (`vocab_pad_to`) on the reference and Cpu devices.

use dataset::shard::write_llmc;
use ir::spec::{DataOrder, DataSpec, ModelSpec, TokenData, TokenWidth, TokenizerSpec};
use runtime::checkpoint::Checkpoint;
use runtime::data::{BatchSampler, Corpus, DataError, SamplerState, ValidationPlan};
use runtime::device::Device;
use runtime::train::{train_spec, TrainError};
use std::path::{Path, PathBuf};

mod common;

use common::run::{metric_losses, opts};

/// Token ids with structure a model learns: a repeating pattern with a little noise,
/// below `vocab`.
fn tokens(n: usize, vocab: u32, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n as u32)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            if x.is_multiple_of(8) {
                x % vocab
            } else {
                (i * 7 + i / 5) % vocab
            }
        })
        .collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = common::run::temp_dir("tokens", tag);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Two training shards and one validation shard in `dir`, llm.c u16.
fn write_shards(dir: &Path, vocab: u32) -> TokenData {
    write_llmc(&dir.join("toy_train_000000.bin"), &tokens(3000, vocab, 1), TokenWidth::U16).unwrap();
    write_llmc(&dir.join("toy_train_000001.bin"), &tokens(2000, vocab, 2), TokenWidth::U16).unwrap();
    write_llmc(&dir.join("toy_val_000000.bin"), &tokens(1500, vocab, 3), TokenWidth::U16).unwrap();
    TokenData {
        train: dir.join("toy_train_*.bin").display().to_string(),
        val: Some(dir.join("toy_val_*.bin").display().to_string()),
        ..TokenData::default()
    }
}

fn token_spec(name: &str, data: TokenData, vocab: usize, steps: usize) -> ModelSpec {
    let mut spec = common::run::tiny_spec(name, steps, 2, 1);
    spec.vocab = vocab;
    spec.train.data = DataSpec::Tokens(data);
    spec
}

#[test]
fn token_shards_train_and_the_checkpoint_records_their_identity() {
    let dir = temp_dir("train");
    let data = write_shards(&dir, 300);
    let spec = token_spec("tokens-train", data, 300, 8);
    spec.validate().unwrap();
    let report = train_spec(&spec, Device::Reference, &opts(&dir.join("run"), None)).unwrap();
    assert_eq!(report.losses.len(), 8);
    assert!(report.losses.iter().all(|l| l.is_finite()));
    assert!(report.losses[7] < report.losses[0], "the pattern is learnable: {:?}", report.losses);
    let ckpt = Checkpoint::read(&report.final_checkpoint).unwrap();
    let corpus = Corpus::load(&spec).unwrap();
    assert_eq!(ckpt.data.as_ref(), Some(&corpus.identity()));
    // The shards' bytes: 3 headers of 1024 bytes and 6500 u16 tokens.
    assert_eq!(corpus.identity().bytes, 3 * 1024 + 2 * 6500);
    // No tokenizer is named and no manifest is beside the shards: none recorded.
    assert_eq!(ckpt.tokenizer, None);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_id_at_or_above_vocab_is_refused_naming_the_file_and_offset() {
    let dir = temp_dir("vocab");
    let mut ids = tokens(2000, 250, 4);
    ids[1234] = 260;
    write_llmc(&dir.join("bad.bin"), &ids, TokenWidth::U16).unwrap();
    let data = TokenData { train: dir.join("bad.bin").display().to_string(), ..TokenData::default() };
    let spec = token_spec("tokens-vocab", data, 256, 400);
    let err = train_spec(&spec, Device::Reference, &opts(&dir.join("run"), None)).unwrap_err();
    let TrainError::Data(data) = &err else { panic!("{err}") };
    let DataError::Shards(e) = data.as_ref() else { panic!("{err}") };
    let msg = e.to_string();
    assert!(msg.contains("bad.bin") && msg.contains("1234") && msg.contains("260"), "{msg}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn nanogpt_headerless_files_need_their_dtype_stated() {
    let dir = temp_dir("raw");
    let ids = tokens(4000, 300, 5);
    let raw: Vec<u8> = ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
    std::fs::write(dir.join("train.bin"), raw).unwrap();
    let mut data = TokenData { train: dir.join("train.bin").display().to_string(), ..TokenData::default() };
    let spec = token_spec("tokens-raw", data.clone(), 300, 2);
    let err = Corpus::load(&spec).unwrap_err().to_string();
    assert!(err.contains("train.bin") && err.contains("dtype"), "{err}");
    data.dtype = Some(TokenWidth::U16);
    let spec = token_spec("tokens-raw", data, 300, 2);
    let corpus = Corpus::load(&spec).unwrap();
    // One file, split by val_fraction (0.1): the last 400 tokens are validation.
    assert_eq!((corpus.train().len(), corpus.validation().len()), (3600, 400));
    let mut first = vec![0; 17];
    corpus.validation().read(0, &mut first).unwrap();
    assert_eq!(first, ids[3600..3617].iter().map(|&t| t as i32).collect::<Vec<_>>());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn sequential_order_reads_consecutive_windows_once_per_pass() {
    let dir = temp_dir("seq");
    let data = write_shards(&dir, 300);
    let mut spec = token_spec("tokens-seq", data, 300, 2);
    spec.train.order = DataOrder::Sequential;
    let corpus = Corpus::load(&spec).unwrap();
    let window = spec.train.seq_len + 1;
    let mut sampler = BatchSampler::for_run(&spec.train, 2, window);
    let mut all = vec![0i32; 5000];
    corpus.train().read(0, &mut all).unwrap();
    // Window i starts at i * seq_len: inputs and targets tile the stream, across the
    // boundary between the two shards (at 3000) too.
    for i in 0..(5000 - 1) / spec.train.seq_len / 2 {
        let batch = sampler.next_batch(corpus.train()).unwrap();
        for (r, row) in batch.chunks(window).enumerate() {
            let start = (2 * i + r) * spec.train.seq_len;
            assert_eq!(row, &all[start..start + window], "batch {i} row {r}");
        }
    }
    // The next window would pass the end: the pass starts again at token 0.
    let batch = sampler.next_batch(corpus.train()).unwrap();
    assert_eq!(&batch[..window], &all[..window]);
    assert_eq!(sampler.state(), SamplerState::Sequential { position: 2 * spec.train.seq_len as u64 });
    std::fs::remove_dir_all(dir).unwrap();
}

/// A resumed run continues with the batches the uninterrupted run saw, in both orders.
#[test]
fn resumed_token_runs_match_the_uninterrupted_run_in_both_orders() {
    for order in [DataOrder::Random, DataOrder::Sequential] {
        let dir = temp_dir(&format!("resume-{order:?}"));
        let data = write_shards(&dir, 300);
        let mut spec = token_spec("tokens-resume", data, 300, 6);
        spec.train.order = order;
        spec.train.checkpoint_every = 3;
        let whole = train_spec(&spec, Device::Reference, &opts(&dir.join("full"), None)).unwrap();
        let ckpt = dir.join("full/ckpt-3.safetensors");
        assert_eq!(Checkpoint::read(&ckpt).unwrap().state.sampler.order(), order);
        let rest =
            train_spec(&spec, Device::Reference, &opts(&dir.join("rest"), Some(ckpt.clone()))).unwrap();
        assert_eq!(rest.losses, whole.losses[3..].to_vec(), "{order:?}");
        let (a, b) = (
            Checkpoint::read(&whole.final_checkpoint).unwrap(),
            Checkpoint::read(&rest.final_checkpoint).unwrap(),
        );
        assert_eq!(a.state, b.state, "{order:?}");
        // The other order cannot continue this checkpoint's sampler.
        let mut other = spec.clone();
        other.train.order = match order {
            DataOrder::Random => DataOrder::Sequential,
            DataOrder::Sequential => DataOrder::Random,
        };
        let err = train_spec(&other, Device::Reference, &opts(&dir.join("other"), Some(ckpt))).unwrap_err();
        assert!(err.to_string().contains("train.order"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn fixed_validation_scores_the_budget_in_order_and_eval_reproduces_it() {
    let dir = temp_dir("val");
    let data = write_shards(&dir, 300);
    let mut spec = token_spec("tokens-val", data, 300, 4);
    // 2 windows x 16 tokens per batch: 1000 tokens are 31 whole batches (992 targets).
    spec.train.val_tokens = Some(1000);
    let report = train_spec(&spec, Device::Reference, &opts(&dir.join("run"), None)).unwrap();
    let corpus = Corpus::load(&spec).unwrap();
    let plan = ValidationPlan::of(&spec.train);
    assert_eq!(plan.batches(2, 17, corpus.validation(), "v").unwrap(), 31);
    let logged = report.val_loss.unwrap();
    let eval =
        runtime::eval::evaluate(&report.final_checkpoint, Device::Reference, &Default::default()).unwrap();
    assert_eq!(eval.validation.targets, 992);
    assert_eq!(eval.val_loss() as f32, logged, "eval scores what the run logged");
    // The budget is refused up front when the split cannot hold it, naming what would fit.
    spec.train.val_tokens = Some(1600);
    let err = train_spec(&spec, Device::Reference, &opts(&dir.join("run2"), None)).unwrap_err().to_string();
    assert!(
        err.contains("val_tokens = 1600") && err.contains("holds 1500") && err.contains("at most 1472"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bits_per_byte_follow_the_tokenizer() {
    let dir = temp_dir("bpb");
    let mut data = write_shards(&dir, 256);
    data.tokenizer = Some(TokenizerSpec::Bytes);
    let spec = token_spec("tokens-bpb", data, 256, 2);
    let report = train_spec(&spec, Device::Reference, &opts(&dir.join("run"), None)).unwrap();
    let lines = std::fs::read_to_string(report.metrics).unwrap();
    let last: serde_json::Value = serde_json::from_str(lines.lines().last().unwrap()).unwrap();
    // Byte tokens: one byte per token, so bits per byte is the loss in bits.
    let (loss, bpb) = (last["val_loss"].as_f64().unwrap(), last["val_bpb"].as_f64().unwrap());
    assert!((bpb - loss / std::f64::consts::LN_2).abs() < 1e-6, "{bpb} vs {loss}");
    assert_eq!(Checkpoint::read(&report.final_checkpoint).unwrap().tokenizer, Some(TokenizerSpec::Bytes));
    assert_eq!(metric_losses(&dir.join("run/metrics.jsonl")).len(), 2);
    std::fs::remove_dir_all(dir).unwrap();
}

/// GPT-2's 50257 padded to 50304: the padded rows exist in every shape and train on
/// the reference and Cpu devices alike, and ids are still held to 50257.
#[test]
fn a_padded_gpt2_vocabulary_trains_on_reference_and_cpu() {
    let dir = temp_dir("pad");
    let data = write_shards(&dir, 50257);
    let mut spec = token_spec("tokens-pad", data, 50257, 2);
    spec.vocab_pad_to = Some(64);
    spec.validate().unwrap();
    assert_eq!(spec.model_vocab(), 50304);
    let lowered = ir::lower::lower(&spec, 2, 16).unwrap();
    let embed = lowered.graph.param_by_name("embed").expect("an embedding");
    assert_eq!(lowered.graph.node(embed).shape.dims()[0], 50304);
    let cost = ir::cost::cost_report(&spec).unwrap();
    assert_eq!(cost.vocab, 50304);
    assert_eq!(cost.params.embedding % 50304, 0, "the cost model counts the padded rows");
    let reference = train_spec(&spec, Device::Reference, &opts(&dir.join("ref"), None)).unwrap();
    let cpu = train_spec(&spec, Device::Cpu, &opts(&dir.join("cpu"), None)).unwrap();
    for (a, b) in reference.losses.iter().zip(&cpu.losses) {
        assert!((a - b).abs() <= 1e-3 * a.abs(), "reference {a} vs cpu {b}");
    }
    // ln(50304) at init: the loss is over the padded softmax.
    assert!((reference.losses[0] - (50304f32).ln()).abs() < 0.5, "{:?}", reference.losses);
    std::fs::remove_dir_all(dir).unwrap();
}

/// 128k-class vocabularies (Llama 3's 128256, u32 shards) pass validation, the cost model
/// and the memory estimate with the padded row count.
#[test]
fn a_128k_vocabulary_passes_validation_cost_and_memory() {
    let data = TokenData {
        train: "shards/train_*.bin".into(),
        dtype: Some(TokenWidth::U32),
        ..TokenData::default()
    };
    let mut spec = token_spec("tokens-128k", data, 128_256, 2);
    spec.vocab_pad_to = Some(128);
    spec.validate().unwrap();
    assert_eq!(spec.model_vocab(), 128_256);
    spec.vocab = 128_000 + 1;
    assert_eq!(spec.model_vocab(), 128_128);
    let cost = ir::cost::cost_report(&spec).unwrap();
    assert_eq!(cost.vocab, 128_128);
    let memory = ir::cost::training_memory(&spec);
    // E is V x D (the head is tied or not, D = 16 here): at least the padded rows.
    assert!(memory.embedding_params >= (128_128 * 16) as f64, "{}", memory.embedding_params);
}
