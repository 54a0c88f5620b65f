//! A model defined in Rust with `#[derive(VirtualWidth)]` (docs/architecture.md §1): a small
//! Virtual Width Network (docs/math.md §5, m = 4 segments, n = 16 slots, so r = 4)
//! with one MTP module (docs/math.md §7). The attributes are checked at compile time
//! by the same validation as a RON spec; this program prints the spec as RON,
//! lowers it and trains it for a few steps on the Cpu device (`Tiny::train`).
//!
//! Run with `cargo run --release --example derive_tiny`.

use widen::{Device, Train, VirtualWidth};

#[derive(VirtualWidth)]
#[widen(name = "derive-tiny", vocab = 256, d_model = 64, layers = 2, heads = 4)]
#[widen(residual = ghc(m = 4, r = 4), mtp(depth = 1, lambda = 0.3))]
#[widen(train(seq_len = 32, batch = 4, steps = 5, eval_every = 5, eval_batches = 1,
              optimizer = adamw(lr = 3e-3), schedule = cosine(warmup = 1), seed = 0))]
struct Tiny;

fn main() -> anyhow::Result<()> {
    let spec = Tiny::spec();
    println!("{}", spec.to_ron());

    let lowered = Tiny::graph()?;
    println!(
        "graph: {} nodes, {} parameter tensors",
        lowered.graph.node_count(),
        lowered.graph.params().len()
    );

    let out_dir = std::env::temp_dir().join(format!("widen-derive-tiny-{}", std::process::id()));
    let report = Tiny::train(Device::Cpu, &out_dir)?;
    for (step, loss) in report.losses.iter().enumerate() {
        println!("step {:>2}: loss {loss:.4}", step + 1);
    }
    println!("metrics and checkpoint in {}", out_dir.display());
    Ok(())
}
