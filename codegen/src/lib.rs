//! Kernel IR and renderers (C, CUDA).
