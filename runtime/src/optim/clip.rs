//! Global-norm gradient clipping (MATH.md §10: clip 1.0 by default).

/// Partial sums kept side by side while squaring one gradient: independent
/// f64 additions the compiler can put in vector lanes, where one running sum
/// would wait on each addition in turn.
const NORM_LANES: usize = 8;

/// The sum of squares of one gradient, in f64 over [`NORM_LANES`] partial
/// sums (the order of additions depends only on the length).
fn sum_of_squares(grad: &[f32]) -> f64 {
    let mut lanes = [0.0f64; NORM_LANES];
    let mut chunks = grad.chunks_exact(NORM_LANES);
    for chunk in &mut chunks {
        for (lane, &g) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(g) * f64::from(g);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&g| f64::from(g) * f64::from(g)).sum();
    lanes.iter().sum::<f64>() + tail
}

/// The L2 norm of all gradients together, accumulated in f64.
///
/// Each gradient's sum of squares is independent, so with more than
/// [`super::PARALLEL_MIN_ELEMENTS`] elements they are spread over the
/// machine's threads; the sums are added in gradient order either way, so
/// the norm does not depend on the thread count.
pub fn global_norm<G: AsRef<[f32]> + Sync>(grads: &[G]) -> f64 {
    let total: usize = grads.iter().map(|g| g.as_ref().len()).sum();
    let threads = if total < super::PARALLEL_MIN_ELEMENTS {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(grads.len())
    };
    let mut sums = vec![0.0f64; grads.len()];
    if threads <= 1 {
        sums.iter_mut().zip(grads).for_each(|(s, g)| *s = sum_of_squares(g.as_ref()));
    } else {
        let lengths: Vec<usize> = grads.iter().map(|g| g.as_ref().len()).collect();
        let bins = super::balance(&lengths, threads);
        let partials: Vec<Vec<(usize, f64)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = bins
                .iter()
                .map(|bin| {
                    scope.spawn(move || bin.iter().map(|&i| (i, sum_of_squares(grads[i].as_ref()))).collect())
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a sum of squares does not panic")).collect()
        });
        partials.into_iter().flatten().for_each(|(i, s)| sums[i] = s);
    }
    sums.iter().sum::<f64>().sqrt()
}

/// The factor that brings a gradient of global norm `norm` down to
/// `max_norm` (the PyTorch `clip_grad_norm_` rule, with its 1e-6 guard), or
/// exactly 1 when it is already within.
pub fn clip_scale(norm: f64, max_norm: Option<f64>) -> f32 {
    match max_norm {
        Some(max) if norm > max => (max / (norm + 1e-6)) as f32,
        _ => 1.0,
    }
}

/// Scales every gradient by [`clip_scale`] when the global norm exceeds
/// `max_norm`. Returns the norm before clipping.
pub fn clip_global_norm(grads: &mut [Vec<f32>], max_norm: f64) -> f64 {
    let norm = global_norm(grads);
    let scale = clip_scale(norm, Some(max_norm));
    if scale != 1.0 {
        grads.iter_mut().flatten().for_each(|g| *g *= scale);
    }
    norm
}
