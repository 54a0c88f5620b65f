//! Devices, executor, optimizers, data and the training loop (docs/architecture.md §7).
//!
//! - [`init`]: parameter initialization from the graph's `Init` rules.
//! - [`optim`]: AdamW, Muon, muP LR scaling, clipping, schedules (docs/math.md §8).
//! - [`data`]: byte-level corpora, train/validation split, batch sampling.
//! - [`checkpoint`]: safetensors checkpoints with resume state.
//! - [`coord`]: the muP coordinate check (activation size per layer across widths).
//! - [`device`]: devices that execute a compiled Plan (the Cpu device).
//! - [`dist`]: data-parallel training across processes (the gradient all-reduce; MPI with the `mpi` feature).
//! - [`executor`]: the device boundary ([`executor::StepExecutor`]) and the reference executor.
//! - [`parity`]: a compiled device against the reference executor.
//! - [`process`]: what every widen program sets up at startup (file-size limits as write errors).
//! - [`train`]: the training loop; [`sample`]: text generation; [`eval`]: a
//!   checkpoint's validation loss and a dump of its logits and gradients.
//! - [`standalone`]: `widen build`, a spec compiled into a standalone trainer binary.
//! - [`moe`]: MoE expert loads and load balancing in the training loop; [`step_outputs`]:
//!   the per-step statistics the compiled devices read back for it.

pub mod checkpoint;
pub mod coord;
pub mod data;
pub mod device;
pub mod dist;
pub mod eval;
pub mod executor;
pub mod init;
pub mod moe;
pub mod optim;
pub mod params;
pub mod parity;
pub mod process;
pub mod rng;
pub mod sample;
pub mod standalone;
pub mod step_outputs;
pub mod train;
