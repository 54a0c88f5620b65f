//! Devices, the step contract, optimizers, data and the training loop
//! (docs/architecture.md §7).
//!
//! # Layers
//!
//! The modules form layers; a module imports only from its own layer's lower
//! modules and from the layers below it, never from a layer above, so there is
//! no circle (docs/architecture.md §7, "Layers"; `layers.rs` checks it on these sources):
//!
//! 1. **Foundations**, which know nothing of devices or steps: [`rng`],
//!    [`params`] (the model's parameter tensors), [`process`], [`optim`] (AdamW,
//!    Muon, muP LR scaling, clipping, schedules; docs/math.md §8), [`dist`]
//!    (data-parallel groups and the gradient all-reduce; MPI with the `mpi`
//!    feature), [`data`] (byte-level corpora, the train/validation split, batch
//!    sampling), [`init`] (parameter initialization from the graph's `Init`
//!    rules) and [`checkpoint`] (safetensors checkpoints with resume state).
//! 2. **The step contract**, [`step`]: [`step::StepExecutor`] and its errors and
//!    statistics, the update on the host ([`step::host`]) and the per-step
//!    statistics a compiled device reads back ([`step::statistics`]). It names
//!    no device: a device's failure reaches it as [`step::StepError::Device`].
//! 3. **What the compiled devices share**: `device::plan_check` (the load-time
//!    checks of a Plan), `device::plan_io` (its interface buffers),
//!    `device::plan_update` (the optimizer update in the Plan) and
//!    `device::ceilings` (the host's measured rates).
//! 4. **The devices**, each in its own module and none importing another:
//!    [`device::reference`], [`device::cpu`], [`device::cuda`].
//! 5. **The factory**, [`device`] itself: [`device::Device`] and
//!    [`device::Device::executor`].
//! 6. **What runs a model**: [`moe`] (expert loads and load balancing),
//!    [`train`] (the training loop), [`eval`] (a checkpoint's validation loss and
//!    a dump of its logits and gradients), [`sample`] (text generation),
//!    [`coord`] (the muP coordinate check), [`parity`] (a compiled device
//!    against the reference) and [`standalone`] (`widen build`: a spec compiled
//!    into a standalone trainer binary).
//!
//! Below all of them are `ir` and `codegen`: the training step's compiler
//! pipeline is `codegen::training`, which the devices, `widen compile` and
//! `widen build` call alike; `codegen` never imports this crate.

pub mod checkpoint;
pub mod coord;
pub mod data;
pub mod device;
pub mod dist;
pub mod eval;
pub mod init;
#[cfg(test)]
mod layers;
pub mod moe;
pub mod optim;
pub mod params;
pub mod parity;
pub mod process;
pub mod progress;
pub mod rng;
pub mod sample;
pub mod standalone;
pub mod step;
pub mod train;
