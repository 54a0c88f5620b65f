//! Devices, executor, optimizers, data and the training loop.
