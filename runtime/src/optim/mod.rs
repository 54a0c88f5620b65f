//! Optimizers: AdamW with parameter groups, Muon for hidden matrices, muP LR
//! scaling, gradient clipping and LR schedules (docs/architecture.md §7, docs/math.md §8, §10).
//!
//! Routing (docs/math.md §8.2 DECISION): with `OptimizerSpec::Muon`, parameters whose
//! class is `muon_eligible()` and whose rank is >= 2 get Muon; everything else
//! gets AdamW with the spec's `adamw` settings. Weight decay applies only where
//! `ParamClass::weight_decay()` says so.
//!
//! Parameters whose class is not `optimized()` (the MoE router bias, docs/math.md §1.6)
//! get AdamW at a zero learning rate and no weight decay, which leaves them unchanged.
//!
//! muP (docs/math.md §8.1): with `Parametrization::MuP`, AdamW's LR for `Hidden`
//! parameters is divided by the width multiplier w = d_model / base_width, and
//! their weight decay multiplied by w, so lr·wd stays width-invariant (the
//! DECISION there). Muon's LR is not rescaled: its shape scale already adapts
//! the update to the matrix dimensions.

pub mod adamw;
pub mod clip;
pub mod muon;
pub mod schedule;

use crate::params::ParamSet;
use adamw::{adamw_update, AdamWStep};
use ir::graph::ParamClass;
use ir::spec::{AdamWSpec, ModelSpec, MuonSpec, OptimizerSpec, Parametrization};
use muon::{muon_update, MuonStep};

/// How one parameter is updated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// AdamW with LR = peak · schedule · `lr_scale` and this effective weight decay.
    AdamW { lr_scale: f64, weight_decay: f64 },
    /// Muon (docs/math.md §8.2) with the spec's Muon settings.
    Muon,
}

/// Optimizer state of one parameter, with its update rule.
#[derive(Debug, Clone, PartialEq)]
enum ParamState {
    AdamW {
        lr_scale: f64,
        weight_decay: f64,
        m: Vec<f32>,
        v: Vec<f32>,
    },
    /// `hyper.lr` is the peak Muon LR; the schedule multiplies it per step.
    Muon {
        hyper: MuonStep,
        momentum: Vec<f32>,
    },
}

/// Fewest parameter elements for which [`Optimizer::step`] uses several
/// threads: below it (the test and tutorial models) starting threads costs
/// more than the update.
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 20;

/// The optimizer for a whole [`ParamSet`].
///
/// A device that runs the update in its Plan (`codegen::optimizer`) keeps
/// the moments there between steps: [`Optimizer::stepped_on_device`] counts
/// such a step and marks the moments held here stale until the device
/// returns them ([`Optimizer::moments_returned`]; the training loop does
/// before checkpoints through `StepExecutor::sync_optimizer`).
#[derive(Debug)]
pub struct Optimizer {
    adamw: AdamWSpec,
    names: Vec<String>,
    dims: Vec<Vec<usize>>,
    state: Vec<ParamState>,
    steps: u64,
    /// Tells this optimizer's state apart from any other's (clones get their own).
    identity: u64,
    /// Whether a device holds newer moments than `state`.
    moments_on_device: bool,
}

impl Clone for Optimizer {
    fn clone(&self) -> Optimizer {
        Optimizer {
            adamw: self.adamw.clone(),
            names: self.names.clone(),
            dims: self.dims.clone(),
            state: self.state.clone(),
            steps: self.steps,
            identity: crate::params::fresh_identity(),
            moments_on_device: self.moments_on_device,
        }
    }
}

/// Optimizers are equal when their settings, state and step counts are.
impl PartialEq for Optimizer {
    fn eq(&self, other: &Optimizer) -> bool {
        (&self.adamw, &self.names, &self.dims, &self.state, self.steps, self.moments_on_device)
            == (&other.adamw, &other.names, &other.dims, &other.state, other.steps, other.moments_on_device)
    }
}

/// Per-step values of the Plan's AdamW update (`codegen::optimizer`).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanUpdateValues {
    /// The shared settings, in `codegen::optimizer::Setting::ALL` order.
    pub settings: Vec<f64>,
    /// Each parameter's rates (in [`ParamSet`] order), in `Rate::ALL` order.
    pub rates: Vec<Vec<f64>>,
}

/// The slices one parameter's update touches.
#[derive(Debug)]
pub struct UpdateTarget<'a> {
    /// The parameter's values, updated in place.
    pub value: &'a mut [f32],
    /// Its gradient, wherever the device left it.
    pub grad: &'a [f32],
    /// A second copy of the values to write in the same pass: the Cpu
    /// device's own parameter buffer, so the next step need not upload it.
    pub mirror: Option<&'a mut [f32]>,
}

/// Indices of `lengths` split into `bins` groups of similar total length:
/// largest first, each onto the least loaded group. Work spread this way
/// still does each item's arithmetic in one piece, so results do not depend
/// on the number of groups.
pub(crate) fn balance(lengths: &[usize], bins: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut groups: Vec<(usize, Vec<usize>)> = (0..bins.max(1)).map(|_| (0, Vec::new())).collect();
    for i in order {
        let group = groups.iter_mut().min_by_key(|(load, _)| *load).expect("at least one group");
        group.0 += lengths[i];
        group.1.push(i);
    }
    groups.into_iter().map(|(_, items)| items).collect()
}

/// The muP width multiplier w = d_model / base_width, or 1 under standard parametrization.
pub fn width_multiplier(spec: &ModelSpec) -> f64 {
    match &spec.parametrization {
        Parametrization::Standard => 1.0,
        Parametrization::MuP(m) => spec.d_model as f64 / m.base_width.max(1) as f64,
    }
}

impl Optimizer {
    /// Groups `params` by class and optimizer choice, with zeroed state.
    pub fn new(spec: &ModelSpec, params: &ParamSet) -> Optimizer {
        let (adamw, muon) = match &spec.train.optimizer {
            OptimizerSpec::AdamW(a) => (a.clone(), None),
            OptimizerSpec::Muon(m) => (m.adamw.clone(), Some(m.clone())),
        };
        let mup = matches!(spec.parametrization, Parametrization::MuP(_));
        let w = width_multiplier(spec);
        let muon_hyper = muon.map(|m: MuonSpec| MuonStep {
            lr: m.lr,
            momentum: m.momentum,
            nesterov: m.nesterov,
            ns_steps: m.ns_steps,
            scale: m.scale,
            weight_decay: m.weight_decay,
        });
        let mut state = Vec::with_capacity(params.len());
        for p in params.iter() {
            let n = p.value.len();
            if !p.class.optimized() {
                // The MoE router bias (docs/math.md §1.6) is the trainer's to move: AdamW at
                // a zero rate and no weight decay leaves it bit for bit (decay 1, step 0),
                // and keeps every parameter on the AdamW update a Plan runs.
                state.push(ParamState::AdamW {
                    lr_scale: 0.0,
                    weight_decay: 0.0,
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                });
                continue;
            }
            match muon_hyper {
                Some(hyper) if p.class.muon_eligible() && p.shape.rank() >= 2 => {
                    state.push(ParamState::Muon { hyper, momentum: vec![0.0; n] });
                    continue;
                }
                _ => {}
            }
            let wd = if p.class.weight_decay() { adamw.weight_decay } else { 0.0 };
            let (lr_scale, weight_decay) =
                if mup && p.class == ParamClass::Hidden { (1.0 / w, wd * w) } else { (1.0, wd) };
            state.push(ParamState::AdamW { lr_scale, weight_decay, m: vec![0.0; n], v: vec![0.0; n] });
        }
        Optimizer {
            adamw,
            names: params.iter().map(|p| p.name.clone()).collect(),
            dims: params.iter().map(|p| p.shape.dims().to_vec()).collect(),
            state,
            steps: 0,
            identity: crate::params::fresh_identity(),
            moments_on_device: false,
        }
    }

    /// The update rule of each parameter, in [`ParamSet`] order.
    pub fn rules(&self) -> Vec<Rule> {
        self.state
            .iter()
            .map(|st| match st {
                ParamState::AdamW { lr_scale, weight_decay, .. } => {
                    Rule::AdamW { lr_scale: *lr_scale, weight_decay: *weight_decay }
                }
                ParamState::Muon { .. } => Rule::Muon,
            })
            .collect()
    }

    /// Optimizer steps taken so far (AdamW's bias correction uses this + 1).
    pub fn steps_taken(&self) -> u64 {
        self.steps
    }

    /// Restores the step count (checkpoint resume).
    pub fn set_steps_taken(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// The parameter names, in [`ParamSet`] order.
    pub fn names(&self) -> Vec<&str> {
        self.names.iter().map(String::as_str).collect()
    }

    /// Whether every parameter follows AdamW (the update a Plan can run).
    pub fn adamw_only(&self) -> bool {
        self.state.iter().all(|st| matches!(st, ParamState::AdamW { .. }))
    }

    /// What tells this optimizer apart from every other, clones included.
    pub fn identity(&self) -> u64 {
        self.identity
    }

    /// The values the Plan's update needs for the next step at `lr_mult`
    /// times the peak rates, clipping the global norm at `clip`; `None` when a
    /// parameter follows Muon, which the Plan does not run. The host's
    /// constants ([`AdamWStep::folded`]) before their rounding to f32.
    pub fn plan_update_values(&self, lr_mult: f64, clip: Option<f64>) -> Option<PlanUpdateValues> {
        use codegen::optimizer::{Rate, Setting};
        let t = self.steps + 1;
        let mut rates = Vec::with_capacity(self.state.len());
        let mut inv_sqrt_bc2 = 1.0;
        for st in &self.state {
            let ParamState::AdamW { lr_scale, weight_decay, .. } = st else { return None };
            let h = AdamWStep {
                lr: self.adamw.lr * lr_mult * lr_scale,
                beta1: self.adamw.betas.0,
                beta2: self.adamw.betas.1,
                eps: self.adamw.eps,
                weight_decay: *weight_decay,
                t,
                grad_scale: 1.0,
            };
            let folded = h.folded();
            inv_sqrt_bc2 = folded.inv_sqrt_bc2;
            rates.push(
                Rate::ALL
                    .iter()
                    .map(|r| match r {
                        Rate::Decay => folded.decay,
                        Rate::Step => folded.step,
                    })
                    .collect(),
            );
        }
        let settings = Setting::ALL
            .iter()
            .map(|s| match s {
                Setting::Apply => 1.0,
                Setting::MaxNorm => clip.unwrap_or(f64::INFINITY),
                Setting::Beta1 => self.adamw.betas.0,
                Setting::Beta2 => self.adamw.betas.1,
                Setting::Eps => self.adamw.eps,
                Setting::InvSqrtBias2 => inv_sqrt_bc2,
            })
            .collect();
        Some(PlanUpdateValues { settings, rates })
    }

    /// Counts one update a device applied to the parameters and to the
    /// moments it holds; the moments here are stale until
    /// [`Optimizer::moments_returned`].
    pub fn stepped_on_device(&mut self) {
        self.steps += 1;
        self.moments_on_device = true;
    }

    /// Whether a device holds newer moments than this optimizer.
    pub fn moments_on_device(&self) -> bool {
        self.moments_on_device
    }

    /// Marks the moments current here again, after a device wrote its own
    /// into [`Optimizer::state_tensors_mut`].
    pub fn moments_returned(&mut self) {
        self.moments_on_device = false;
    }

    /// One update of every parameter with `grads` (same order as `params`) at
    /// `lr_mult` times the peak learning rates.
    pub fn step<G: AsRef<[f32]>>(&mut self, params: &mut ParamSet, grads: &[G], lr_mult: f64) {
        let targets = params
            .iter_mut()
            .zip(grads)
            .map(|(p, g)| UpdateTarget { value: &mut p.value, grad: g.as_ref(), mirror: None })
            .collect();
        self.apply(targets, lr_mult, 1.0);
    }

    /// One update of every parameter (`targets` in [`ParamSet`] order) at
    /// `lr_mult` times the peak learning rates, each gradient element
    /// multiplied by `grad_scale` as it is read: the clipping factor
    /// ([`clip::clip_scale`]), the same f32 product that scaling the
    /// gradients first would store.
    ///
    /// Parameters update independently, so with more than
    /// [`PARALLEL_MIN_ELEMENTS`] elements they are spread over the machine's
    /// threads (largest first onto the least loaded); each parameter's update is
    /// the same arithmetic on any thread, so results do not depend on the
    /// thread count.
    pub fn apply(&mut self, targets: Vec<UpdateTarget<'_>>, lr_mult: f64, grad_scale: f32) {
        self.steps += 1;
        let (adamw, steps) = (&self.adamw, self.steps);
        let update = |target: UpdateTarget<'_>, state: &mut ParamState, dims: &[usize]| match state {
            ParamState::AdamW { lr_scale, weight_decay, m, v } => {
                let h = AdamWStep {
                    lr: adamw.lr * lr_mult * *lr_scale,
                    beta1: adamw.betas.0,
                    beta2: adamw.betas.1,
                    eps: adamw.eps,
                    weight_decay: *weight_decay,
                    t: steps,
                    grad_scale,
                };
                adamw_update(target.value, target.grad, m, v, &h, target.mirror);
            }
            ParamState::Muon { hyper, momentum } => {
                let h = MuonStep { lr: hyper.lr * lr_mult, ..*hyper };
                let scaled: Vec<f32>;
                let grad = if grad_scale == 1.0 {
                    target.grad
                } else {
                    scaled = target.grad.iter().map(|&g| g * grad_scale).collect();
                    &scaled
                };
                muon_update(target.value, grad, momentum, dims, &h);
                if let Some(mirror) = target.mirror {
                    mirror.copy_from_slice(target.value);
                }
            }
        };
        let jobs: Vec<_> = targets.into_iter().zip(self.state.iter_mut()).zip(&self.dims).collect();
        let total: usize = jobs.iter().map(|((t, _), _)| t.grad.len()).sum();
        let threads = if total < PARALLEL_MIN_ELEMENTS {
            1
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len())
        };
        if threads <= 1 {
            for ((target, state), dims) in jobs {
                update(target, state, dims);
            }
            return;
        }
        let lengths: Vec<usize> = jobs.iter().map(|((t, _), _)| t.grad.len()).collect();
        let mut jobs: Vec<Option<_>> = jobs.into_iter().map(Some).collect();
        let bins: Vec<Vec<_>> = balance(&lengths, threads)
            .into_iter()
            .map(|bin| bin.into_iter().filter_map(|i| jobs[i].take()).collect())
            .collect();
        let update = &update;
        std::thread::scope(|scope| {
            for bin in bins {
                scope.spawn(move || {
                    for ((target, state), dims) in bin {
                        update(target, state, dims);
                    }
                });
            }
        });
    }

    /// State tensors with their checkpoint names (`opt.<param>.m`, `opt.<param>.v`,
    /// `opt.<param>.momentum`) and shapes.
    pub fn state_tensors(&self) -> Vec<(String, &[usize], &[f32])> {
        let mut out = Vec::new();
        for ((name, dims), st) in self.names.iter().zip(&self.dims).zip(&self.state) {
            match st {
                ParamState::AdamW { m, v, .. } => {
                    out.push((format!("opt.{name}.m"), dims.as_slice(), m.as_slice()));
                    out.push((format!("opt.{name}.v"), dims.as_slice(), v.as_slice()));
                }
                ParamState::Muon { momentum, .. } => {
                    out.push((format!("opt.{name}.momentum"), dims.as_slice(), momentum.as_slice()));
                }
            }
        }
        out
    }

    /// Mutable state tensors under the names of [`Optimizer::state_tensors`].
    pub fn state_tensors_mut(&mut self) -> Vec<(String, &[usize], &mut Vec<f32>)> {
        let mut out = Vec::new();
        for ((name, dims), st) in self.names.iter().zip(&self.dims).zip(&mut self.state) {
            match st {
                ParamState::AdamW { m, v, .. } => {
                    out.push((format!("opt.{name}.m"), dims.as_slice(), m));
                    out.push((format!("opt.{name}.v"), dims.as_slice(), v));
                }
                ParamState::Muon { momentum, .. } => {
                    out.push((format!("opt.{name}.momentum"), dims.as_slice(), momentum));
                }
            }
        }
        out
    }
}
