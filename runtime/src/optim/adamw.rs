//! AdamW with decoupled weight decay (Loshchilov & Hutter; the PyTorch `AdamW` rule):
//!
//! ```text
//! p ← p·(1 − lr·wd)
//! m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²
//! p ← p − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + eps)
//! ```
//! `t` is the 1-based step count. Weight decay is 0 for groups without decay
//! (gains, biases, embeddings, static connection parameters: docs/math.md §1.2).

/// Hyper-parameters of one AdamW update, already scaled by schedule and muP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based step count for bias correction.
    pub t: u64,
    /// Multiplies each gradient element as it is read (the clipping factor; 1 without clipping).
    pub grad_scale: f32,
}

/// The per-step constants of an update, rounded as the update uses them:
/// `decay` = 1 − lr·wd, `step` = lr / (1 − β1^t), `inv_sqrt_bc2` =
/// 1 / sqrt(1 − β2^t), computed in f64 and rounded to f32 once. The host
/// update and the Plan's (`codegen::optimizer`, which receives the f64
/// values and rounds them the same way) share this.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Folded {
    pub decay: f64,
    pub step: f64,
    pub inv_sqrt_bc2: f64,
}

impl AdamWStep {
    /// The constants of this step (see [`Folded`]).
    pub fn folded(&self) -> Folded {
        let t = self.t.max(1) as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        Folded {
            decay: 1.0 - self.lr * self.weight_decay,
            step: self.lr / bc1,
            inv_sqrt_bc2: 1.0 / bc2.sqrt(),
        }
    }
}

/// Applies one AdamW update to `param` in place, updating the moments `m`,
/// `v`; with a `mirror`, the new values are written there too, in the same pass.
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: &AdamWStep,
    mirror: Option<&mut [f32]>,
) {
    let folded = h.folded();
    let (decay, step, inv_sqrt_bc2) = (folded.decay as f32, folded.step as f32, folded.inv_sqrt_bc2 as f32);
    let (b1, b2) = (h.beta1 as f32, h.beta2 as f32);
    let (eps, scale) = (h.eps as f32, h.grad_scale);
    let next = |p: f32, g: f32, m: &mut f32, v: &mut f32| {
        let g = g * scale;
        *m = b1 * *m + (1.0 - b1) * g;
        *v = b2 * *v + (1.0 - b2) * g * g;
        p * decay - step * *m / (v.sqrt() * inv_sqrt_bc2 + eps)
    };
    let elements = param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut());
    match mirror {
        Some(mirror) => {
            for ((((p, &g), m), v), copy) in elements.zip(mirror.iter_mut()) {
                *p = next(*p, g, m, v);
                *copy = *p;
            }
        }
        None => elements.for_each(|(((p, &g), m), v)| *p = next(*p, g, m, v)),
    }
}
