//! Muon: momentum, then an approximate orthogonalization of the update by a
//! quintic Newton–Schulz iteration (docs/math.md §8.2, after KellerJordan/Muon).
//!
//! **Orientation.** docs/math.md writes W ∈ R^{out×in} (PyTorch's `Linear`). widen
//! stores matrices `[in, out]` because the graph computes `x @ W`, so a stored
//! matrix is the transpose of the one in docs/math.md. Newton–Schulz commutes with
//! transposition (NS(Xᵀ) = NS(X)ᵀ), so the iteration is run on the stored
//! matrix directly, transposed internally whenever it has more rows than
//! columns so that the Gram matrix X·Xᵀ is the smaller one (the "if out > in:
//! transpose" line of §8.2), and transposed back afterwards. The shape scale
//! uses out = columns and in = rows of the stored matrix.
//!
//! Parameters of rank > 2 (stacked experts `[E, in, out]`) are treated as a
//! batch of matrices over their last two axes. The reference runtime computes
//! in f32 (docs/math.md notes bf16 on GPUs).

use ir::spec::MuonScale;

/// Newton–Schulz coefficients (a, b, c) of docs/math.md §8.2.
pub const NS_COEFFS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);

/// Hyper-parameters of one Muon update, already scaled by the schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonStep {
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub ns_steps: usize,
    pub scale: MuonScale,
    pub weight_decay: f64,
}

/// `steps` Newton–Schulz iterations on `g` (`[rows, cols]`, row-major) after
/// Frobenius normalization: X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ.
/// Returns a matrix of the same shape and orientation.
pub fn newton_schulz(g: &[f32], rows: usize, cols: usize, steps: usize) -> Vec<f32> {
    debug_assert_eq!(g.len(), rows * cols);
    let transposed = rows > cols;
    let (r, c) = if transposed { (cols, rows) } else { (rows, cols) };
    let mut x = if transposed { transpose(g, rows, cols) } else { g.to_vec() };
    let norm = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
    let inv = (1.0 / (norm + 1e-7)) as f32;
    x.iter_mut().for_each(|v| *v *= inv);

    let (a, b, cc) = NS_COEFFS;
    let mut next = vec![0.0f32; r * c];
    for _ in 0..steps {
        let gram = row_gram(&x, r, c);
        let gram2 = row_gram(&gram, r, r); // A·A = A·Aᵀ since A is symmetric
        let poly: Vec<f32> = gram.iter().zip(&gram2).map(|(&a1, &a2)| b * a1 + cc * a2).collect();
        // next = a·X + poly·X
        for i in 0..r {
            let out = &mut next[i * c..(i + 1) * c];
            out.iter_mut().zip(&x[i * c..(i + 1) * c]).for_each(|(o, &xv)| *o = a * xv);
            for k in 0..r {
                let w = poly[i * r + k];
                out.iter_mut().zip(&x[k * c..(k + 1) * c]).for_each(|(o, &xv)| *o += w * xv);
            }
        }
        std::mem::swap(&mut x, &mut next);
    }
    if transposed {
        transpose(&x, r, c)
    } else {
        x
    }
}

/// X·Xᵀ for X `[r, c]`: dot products of rows.
fn row_gram(x: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; r * r];
    for i in 0..r {
        let xi = &x[i * c..(i + 1) * c];
        for j in i..r {
            let xj = &x[j * c..(j + 1) * c];
            let d: f32 = xi.iter().zip(xj).map(|(&p, &q)| p * q).sum();
            out[i * r + j] = d;
            out[j * r + i] = d;
        }
    }
    out
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = x[i * cols + j];
        }
    }
    out
}

/// The update scale for a stored `[in, out]` matrix (docs/math.md §8.2).
pub fn shape_scale(scale: MuonScale, fan_in: usize, fan_out: usize) -> f64 {
    match scale {
        MuonScale::Original => (fan_out as f64 / fan_in as f64).max(1.0).sqrt(),
        MuonScale::MatchRmsAdamW => 0.2 * (fan_in.max(fan_out) as f64).sqrt(),
    }
}

/// One Muon step on a parameter of shape `dims` (rank >= 2), updating the
/// momentum buffer:
///
/// ```text
/// M ← β·M + (1−β)·G;  U ← (1−β)·G + β·M (Nesterov) or M
/// O = NS(U)·scale;    W ← W·(1 − lr·wd) − lr·O
/// ```
pub fn muon_update(param: &mut [f32], grad: &[f32], momentum: &mut [f32], dims: &[usize], h: &MuonStep) {
    let beta = h.momentum as f32;
    for (m, &g) in momentum.iter_mut().zip(grad) {
        *m = beta * *m + (1.0 - beta) * g;
    }
    let update: Vec<f32> = if h.nesterov {
        grad.iter().zip(momentum.iter()).map(|(&g, &m)| (1.0 - beta) * g + beta * m).collect()
    } else {
        momentum.to_vec()
    };
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let scale = shape_scale(h.scale, rows, cols);
    let lr_scaled = (h.lr * scale) as f32;
    let decay = (1.0 - h.lr * h.weight_decay) as f32;
    let size = rows * cols;
    for (w, u) in param.chunks_mut(size).zip(update.chunks(size)) {
        let o = newton_schulz(u, rows, cols, h.ns_steps);
        w.iter_mut().zip(&o).for_each(|(w, &o)| *w = *w * decay - lr_scaled * o);
    }
}
