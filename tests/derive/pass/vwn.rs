//! A Virtual Width Network (docs/math.md §5) with MoE, MTP and a full training block.
use widen::ir::spec::{FfnSpec, OptimizerSpec, ResidualSpec, ScheduleSpec};
use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(name = "tiny-vwn", vocab = 256, d_model = 256, layers = 4, heads = 4)]
#[widen(residual = ghc(m = 4, n = 16), mtp(depth = 1, lambda = 0.3))]
#[widen(ffn = moe(experts = 8, top_k = 2, shared = 1, hidden = 256))]
#[widen(train(seq_len = 128, batch = 8, steps = 500, optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 50), seed = 0))]
struct Tiny;

/// `r` is the convenience for n = r * m (docs/math.md §5.1).
#[derive(VirtualWidth)]
#[widen(d_model = 256, heads = 4, residual = ghc(m = 4, r = 4))]
struct WithR;

pub fn main() {
    let spec = Tiny::spec();
    assert_eq!(spec.name, "tiny-vwn");
    assert_eq!((spec.vocab, spec.d_model, spec.layers, spec.heads), (256, 256, 4, 4));
    let ResidualSpec::Ghc(ghc) = &spec.residual else { panic!("expected GHC, got {:?}", spec.residual) };
    assert_eq!((ghc.m, ghc.n), (4, 16));
    assert_eq!((spec.mtp.depth, spec.mtp.lambda), (1, 0.3));
    let FfnSpec::Moe(moe) = &spec.ffn else { panic!("expected MoE, got {:?}", spec.ffn) };
    assert_eq!((moe.experts, moe.top_k, moe.shared, moe.hidden), (8, 2, 1, 256));
    assert_eq!((spec.train.seq_len, spec.train.batch, spec.train.steps), (128, 8, 500));
    assert!(matches!(&spec.train.optimizer, OptimizerSpec::AdamW(a) if a.lr == 3e-3));
    assert!(matches!(&spec.train.schedule, ScheduleSpec::Cosine(c) if c.warmup == 50));
    assert_eq!(spec.validate(), Ok(()));

    let ResidualSpec::Ghc(with_r) = WithR::spec().residual else { panic!("expected GHC") };
    assert_eq!((with_r.m, with_r.n), (4, 16));
}
