//! Global-norm gradient clipping (MATH.md §10: clip 1.0 by default).

/// The L2 norm of all gradients together, accumulated in f64.
pub fn global_norm(grads: &[Vec<f32>]) -> f64 {
    grads.iter().flatten().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>().sqrt()
}

/// Scales every gradient by `max_norm / norm` when the global norm exceeds
/// `max_norm` (the PyTorch `clip_grad_norm_` rule, with its 1e-6 guard).
/// Returns the norm before clipping.
pub fn clip_global_norm(grads: &mut [Vec<f32>], max_norm: f64) -> f64 {
    let norm = global_norm(grads);
    if norm > max_norm {
        let scale = (max_norm / (norm + 1e-6)) as f32;
        grads.iter_mut().flatten().for_each(|g| *g *= scale);
    }
    norm
}
