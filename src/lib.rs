//! widen: a compiler for transformer language models with expanded residual streams.
//!
//! This crate is the CLI and a facade over the pipeline crates (docs/architecture.md §2):
//! [`ir`] (spec, graph, autodiff, cost model, reference executor), [`codegen`]
//! (kernels and renderers) and [`runtime`] (devices, optimizers, training).
//!
//! A model can be a RON file or a Rust type (docs/architecture.md §1). The derive checks
//! the spec with the same `ModelSpec::validate` as the RON path, at compile time,
//! and reports each problem at the attribute key that caused it:
//!
//! ```
//! use widen::VirtualWidth;
//!
//! #[derive(VirtualWidth)]
//! #[widen(vocab = 256, d_model = 64, layers = 2, heads = 4)]
//! #[widen(residual = ghc(m = 4, r = 2), mtp(depth = 1))]
//! struct Tiny;
//!
//! let spec = Tiny::spec();
//! assert_eq!(spec.name, "tiny");
//! assert!(matches!(spec.residual, widen::ir::spec::ResidualSpec::Ghc(ref g) if g.n == 8));
//! ```
//!
//! Attribute keys are the RON field names and variants are snake_case; the full
//! grammar and the conveniences beyond RON are documented in the `widen-macros`
//! crate.

pub use codegen;
pub use ir;
pub use runtime;
pub use sweep;

/// A configuration sweep: build one from a file ([`Sweep::load`]), from the CLI
/// shorthand ([`Sweep::from_cli`]) or from a derived model ([`SweepModel::sweep`]),
/// then [`Sweep::run`] it.
pub use sweep::{Sweep, SweepOptions, SweepReport};

/// The trait: `T::spec()` and `T::graph()`.
pub use ir::spec::VirtualWidth;
/// The derive, in the macro namespace under the trait's name (as serde does).
pub use macros::VirtualWidth;

pub use runtime::device::Device;

/// Training from Rust in one line, for every [`VirtualWidth`] type:
/// `Tiny::train(Device::Cpu, "runs/tiny")?` compiles the model for the device, trains
/// it with the spec's `train` section and saves metrics and checkpoints in the folder
/// (the same pipeline and files as `widen train`, docs/architecture.md §1).
pub trait Train: VirtualWidth {
    /// Trains with progress lines on stderr; returns the losses and the checkpoint path.
    /// Ctrl-C (or SIGTERM) during the run saves a checkpoint and returns
    /// [`runtime::train::TrainError::Interrupted`] naming it.
    fn train(
        device: Device,
        out_dir: impl Into<std::path::PathBuf>,
    ) -> Result<runtime::train::TrainReport, runtime::train::TrainError> {
        let spec = Self::spec();
        let every = (spec.train.steps / 20).max(1);
        let opts = runtime::train::TrainOptions {
            out_dir: out_dir.into(),
            resume: None,
            progress: runtime::train::Progress::Auto { every },
            catch_signals: true,
            overwrite: false,
            on_step: None,
            group: None,
        };
        runtime::train::train_spec(&spec, device, &opts)
    }
}

impl<T: VirtualWidth> Train for T {}

/// Sweeps from Rust, for every [`VirtualWidth`] type: the model is the base spec,
/// and the arguments are those of `widen sweep`'s shorthand (`--set`, `--seeds`,
/// `--budget`). The sweep runs with [`Sweep::run`] into a folder of runs, results and
/// plots, exactly as `widen sweep` writes it.
///
/// ```
/// use widen::{Device, SweepModel, SweepOptions, VirtualWidth};
///
/// #[derive(VirtualWidth)]
/// #[widen(vocab = 256, d_model = 32, layers = 1, heads = 2, residual = ghc(m = 2, r = 2))]
/// #[widen(train(seq_len = 16, batch = 2, eval_every = 2, eval_batches = 1, schedule = constant(warmup = 0)))]
/// struct Tiny;
///
/// let dir = std::env::temp_dir().join(format!("widen-doc-sweep-{}", std::process::id()));
/// let mut sweep = Tiny::sweep(&["residual.r=1,2"], "2", "steps=2").unwrap();
/// sweep.baseline = true;
/// let report = sweep.run(&SweepOptions { device: Device::Reference, ..SweepOptions::new(&dir) }).unwrap();
/// // Two points and their plain-residual twin, two seeds each.
/// assert_eq!(report.results.len(), 3);
/// assert!(report.results.iter().all(|r| r.seeds_finished == 2 && r.val_loss.mean.is_some()));
/// assert!(dir.join("results.csv").exists() && dir.join("plots/loss.svg").exists());
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
pub trait SweepModel: VirtualWidth {
    /// A sweep over this model: `sets` are axes (`"residual.n=4,8,16"`), `seeds` a
    /// count or a list (`"3"`, `"1,7"`), `budget` `tokens=N`, `flops=F` or `steps=N`.
    /// Errors name the argument that is wrong.
    fn sweep(sets: &[&str], seeds: &str, budget: &str) -> Result<Sweep, sweep::SweepError> {
        let spec = Self::spec();
        let source = format!("#[derive(VirtualWidth)] {}", std::any::type_name::<Self>());
        Sweep::from_cli(spec, &source, sets, seeds, budget)
    }
}

impl<T: VirtualWidth> SweepModel for T {}
