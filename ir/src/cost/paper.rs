//! The papers' closed-form per-sublayer costs, as docs/math.md states them, shown next to
//! the graph's counts. They are dominant-term formulas with the conventions of each
//! paper (e.g. mHC's norm at 2 FLOPs per element, docs/math.md §4.7; the residual's and HC's
//! scale-and-add terms, §9.1), so they agree with the counted figures only up to the
//! terms they leave out or add; the counts are the authoritative numbers. Only GHC's
//! §5.9 table uses exactly the counted papers' convention.

use serde::Serialize;

use crate::spec::{AugSublayers, Flash, GenNorm, ModelSpec, OptimizerSpec, ResidualSpec, XhcSpec};

/// Closed-form figures for a spec's residual scheme. `None` where docs/math.md gives no
/// formula for the configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PaperFigures {
    /// The docs/math.md sections the formulas come from.
    pub source: String,
    /// Connection FLOPs per sublayer per token, in units of D, mean over attention and FFN.
    pub connection_flops_per_sublayer_d: Option<f64>,
    /// Residual-stream elements read per sublayer per token, in units of D (unfused).
    pub traffic_read: Option<f64>,
    /// Residual-stream elements written per sublayer per token, in units of D (unfused).
    pub traffic_write: Option<f64>,
    /// Connection parameters per block (two sublayers).
    pub connection_params_per_block: Option<f64>,
}

/// The closed forms of docs/math.md §1.5, §2.6, §3, §4.7, §5.9, §6.9 and §9.1 for `spec`.
pub fn paper_figures(spec: &ModelSpec) -> PaperFigures {
    let d = spec.d_model as f64;
    match &spec.residual {
        ResidualSpec::Residual => PaperFigures {
            source: "docs/math.md §1.5, §9.1".into(),
            connection_flops_per_sublayer_d: Some(1.0),
            traffic_read: Some(2.0),
            traffic_write: Some(1.0),
            connection_params_per_block: Some(0.0),
        },
        ResidualSpec::Hc(hc) => {
            let n = hc.n as f64;
            let small = (n * n + 2.0 * n) / d;
            let (flops, params) = if hc.dynamic {
                // |θ_norm|: gain and bias for LayerNorm (HC Alg. 2), a gain for RMSNorm.
                let norm = match hc.gen_norm {
                    GenNorm::LayerNorm => 2.0 * d,
                    GenNorm::RmsNorm => d,
                };
                (
                    2.0 * n * (n + 1.0) + 3.0 * n + 2.0 * n * (n + 2.0) + 4.0 * n,
                    norm + d * (n + 2.0) + n * (n + 2.0) + 2.0,
                )
            } else {
                (2.0 * n * (n + 1.0) + 3.0 * n, n * (n + 2.0))
            };
            PaperFigures {
                source: "docs/math.md §2.4, §2.6, §9.1".into(),
                connection_flops_per_sublayer_d: Some(flops),
                traffic_read: Some(5.0 * n + 1.0 + small),
                traffic_write: Some(3.0 * n + 1.0 + small),
                connection_params_per_block: Some(2.0 * params),
            }
        }
        ResidualSpec::Fc(fc) => {
            let m = fc.m as f64;
            let (flops, params) = if fc.dynamic {
                (
                    4.0 * m + 1.0 + 2.0 * (2.0 * m + 1.0),
                    d / m + (d / m) * (2.0 * m + 1.0) + m * (2.0 * m + 1.0) + 2.0,
                )
            } else {
                (4.0 * m + 1.0, m * (2.0 * m + 1.0))
            };
            PaperFigures {
                source: "docs/math.md §3, §9.1".into(),
                connection_flops_per_sublayer_d: Some(flops),
                traffic_read: None,
                traffic_write: None,
                connection_params_per_block: Some(2.0 * params),
            }
        }
        ResidualSpec::Mhc(mhc) => {
            let n = mhc.n as f64;
            let sinkhorn = (1.0 + 4.0 * mhc.sinkhorn_iters as f64) * n * n;
            let small = (n * n + 2.0 * n) / d;
            PaperFigures {
                source: "docs/math.md §4.7, §9.1".into(),
                connection_flops_per_sublayer_d: Some(
                    2.0 * n * (n * n + 2.0 * n) + 2.0 * n * n + 6.0 * n + sinkhorn / d,
                ),
                traffic_read: Some(5.0 * n + 1.0 + small),
                traffic_write: Some(3.0 * n + 1.0 + small),
                connection_params_per_block: Some(2.0 * (n * d * (n * n + 2.0 * n) + n * n + 2.0 * n + 3.0)),
            }
        }
        ResidualSpec::Ghc(ghc) => {
            let (m, n) = (ghc.m as f64, ghc.n as f64);
            let r = n / m;
            let (flops, params) = if ghc.dynamic {
                (
                    r * (4.0 + 2.0 * (2.0 * m + n) + 2.0 * (m + n)) + 2.0 * n,
                    (d / m) * (2.0 * m + n + 1.0) + 2.0 * n * (2.0 * m + n),
                )
            } else {
                (r * 2.0 * (m + n) + 2.0 * n, n * (2.0 * m + n))
            };
            PaperFigures {
                source: "docs/math.md §5.9, §9.1".into(),
                connection_flops_per_sublayer_d: Some(flops),
                traffic_read: None,
                traffic_write: None,
                connection_params_per_block: Some(2.0 * params),
            }
        }
        ResidualSpec::Xhc(x) => xhc_figures(spec, x),
        // A written design has no paper's closed form: its figures are the graph's counts.
        ResidualSpec::Connection(_) => PaperFigures {
            source: "docs/math.md §12 (no closed form: counted from the graph)".into(),
            connection_flops_per_sublayer_d: None,
            traffic_read: None,
            traffic_write: None,
            connection_params_per_block: None,
        },
    }
}

/// xHC (docs/math.md §6.9). The attention sublayer has K_r = 1 unless it is augmented too.
fn xhc_figures(spec: &ModelSpec, x: &XhcSpec) -> PaperFigures {
    let (big_n, k) = (x.n as f64, x.k as f64);
    let r = x.conv_kernels.len();
    let sum_kappa: usize = x.conv_kernels.iter().sum();
    let gram_schmidt = x.gram_schmidt.unwrap_or(!matches!(spec.train.optimizer, OptimizerSpec::Muon(_)));
    let attn_aug = x.temporal_aug == AugSublayers::MlpAndAttention && r > 0;
    let mlp_aug = r > 0;
    // (flops, read, write, params) of one sublayer, in units of C.
    let sublayer = |aug: bool| {
        let k_r = if aug { (r + 1) as f64 } else { 1.0 };
        let aug_flops = if aug {
            2.0 * sum_kappa as f64 + if gram_schmidt { 2.0 * k_r * (k_r - 1.0) } else { 0.0 }
        } else {
            0.0
        };
        let flops = 4.0 * big_n * big_n
            + 2.0 * big_n
            + 2.0 * k * (k * k + k * k_r)
            + 2.0 * k * k
            + 2.0 * k * k_r
            + aug_flops;
        let read = 2.0 * big_n + 5.0 * k + k_r + if aug { 1.0 } else { 0.0 };
        let write = 4.0 * k + k_r;
        let params = 2.0 * big_n * big_n + k * k * k + k * k * k_r + if aug { sum_kappa as f64 } else { 0.0 };
        (flops, read, write, params)
    };
    let (fa, ra, wa, pa) = sublayer(attn_aug);
    let (fm, rm, wm, pm) = sublayer(mlp_aug);
    match x.flash {
        Flash::None => PaperFigures {
            source: "docs/math.md §6.9, §9.1".into(),
            connection_flops_per_sublayer_d: Some((fa + fm) / 2.0),
            traffic_read: Some((ra + rm) / 2.0),
            traffic_write: Some((wa + wm) / 2.0),
            connection_params_per_block: Some((pa + pm) * spec.d_model as f64),
        },
        // The paper reports the Flash variants' traffic at its defaults only.
        flash => {
            let defaults = x.n == 16 && x.k == 4 && r == 3 && x.temporal_aug == AugSublayers::Mlp;
            let (read, write) = match flash {
                Flash::Block => (36.0, 15.0),
                _ => (26.5, 13.5),
            };
            PaperFigures {
                source: "docs/math.md §6.9".into(),
                connection_flops_per_sublayer_d: None,
                traffic_read: defaults.then_some(read),
                traffic_write: defaults.then_some(write),
                connection_params_per_block: None,
            }
        }
    }
}
