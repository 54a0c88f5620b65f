//! Global-norm gradient clipping (docs/math.md §10: clip 1.0 by default).

use codegen::optimizer::{NORM_CHUNK, NORM_LANES};

/// The sums of squares of one gradient's chunks of [`NORM_CHUNK`] elements,
/// in f64, each in the order of the Plan's norm kernel
/// (`codegen::optimizer`): lane `l` adds the chunk's elements `l`, `l +`
/// [`NORM_LANES`], … and the lanes are combined by halves (lane `i` takes
/// lane `i + s` for `s` = lanes/2, …, 1). Squares of f32 values are exact in
/// f64, so host and Plan get the same bits.
fn chunk_sums(grad: &[f32]) -> Vec<f64> {
    let lanes = NORM_LANES as usize;
    grad.chunks(NORM_CHUNK)
        .map(|chunk| {
            let mut acc = vec![0.0f64; lanes];
            for row in chunk.chunks(lanes) {
                for (a, &g) in acc.iter_mut().zip(row) {
                    *a += f64::from(g) * f64::from(g);
                }
            }
            let mut half = lanes / 2;
            while half > 0 {
                for i in 0..half {
                    acc[i] += acc[i + half];
                }
                half /= 2;
            }
            acc[0]
        })
        .collect()
}

/// The L2 norm of all gradients together: every chunk sum (`chunk_sums`)
/// added in gradient and chunk order, as the Plan's update adds them.
///
/// Each gradient's chunk sums are independent, so with more than
/// [`super::PARALLEL_MIN_ELEMENTS`] elements they are spread over the
/// machine's threads; the sums are added in order either way, so the norm
/// does not depend on the thread count.
pub fn global_norm<G: AsRef<[f32]> + Sync>(grads: &[G]) -> f64 {
    let total: usize = grads.iter().map(|g| g.as_ref().len()).sum();
    let threads = if total < super::PARALLEL_MIN_ELEMENTS {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(grads.len())
    };
    let mut sums: Vec<Vec<f64>> = vec![Vec::new(); grads.len()];
    if threads <= 1 {
        sums.iter_mut().zip(grads).for_each(|(s, g)| *s = chunk_sums(g.as_ref()));
    } else {
        let lengths: Vec<usize> = grads.iter().map(|g| g.as_ref().len()).collect();
        let bins = super::balance(&lengths, threads);
        let partials: Vec<Vec<(usize, Vec<f64>)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = bins
                .iter()
                .map(|bin| {
                    scope.spawn(move || bin.iter().map(|&i| (i, chunk_sums(grads[i].as_ref()))).collect())
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a sum of squares does not panic")).collect()
        });
        partials.into_iter().flatten().for_each(|(i, s)| sums[i] = s);
    }
    sums.iter().flatten().fold(0.0, |sum, &s| sum + s).sqrt()
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
