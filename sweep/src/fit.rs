//! Ordinary least squares for `y = a + b·x`, and the log-linear law of virtual width.
//!
//! VWN reports final loss falling linearly in log2 of the virtual width factor,
//! `L = a + b·log2(r)` (docs/math.md §5.10: b = −0.0069, R² = 0.9986 at 500B
//! tokens). A sweep over an axis fits the same form so its slope can be compared,
//! with the standard errors that say whether a small model's slope means anything.
//!
//! Standard errors are the textbook OLS ones with residual variance
//! s² = SSE / (n − 2): se(b) = s / √Sxx, se(a) = s·√(1/n + x̄²/Sxx). R² = 1 − SSE/SST;
//! when every y is equal (SST = 0) the flat line fits exactly and R² is 1. Inputs a
//! fit cannot use (fewer than 3 points, all x equal, a non-finite value, a
//! non-positive axis value for the log form) are errors, never NaN coefficients.

use serde::Serialize;

/// A fitted line `y = a + b·x` with its uncertainties.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LinearFit {
    /// Intercept.
    pub a: f64,
    /// Slope.
    pub b: f64,
    /// Standard error of `a`.
    pub se_a: f64,
    /// Standard error of `b`.
    pub se_b: f64,
    /// Coefficient of determination.
    pub r2: f64,
    /// Number of points fitted.
    pub n: usize,
}

/// Inputs a least-squares fit cannot use.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// x and y differ in length.
    #[error("x has {x} values but y has {y}; give one y per x")]
    Lengths { x: usize, y: usize },
    /// Fewer than 3 points leave no degree of freedom for the standard errors.
    #[error("{n} points: a line with standard errors needs at least 3")]
    TooFew { n: usize },
    /// A value is NaN or infinite.
    #[error("point {index} is not finite (x = {x}, y = {y})")]
    NonFinite { index: usize, x: f64, y: f64 },
    /// Every x is equal, so the slope is undetermined.
    #[error("every x equals {x}: the slope is undetermined; sweep at least two values")]
    ConstantX { x: f64 },
    /// The log form needs positive axis values.
    #[error("axis value {value} (point {index}) is not > 0, so log2 of it is undefined")]
    NonPositive { index: usize, value: f64 },
}

impl LinearFit {
    /// The line's value at `x`.
    pub fn predict(&self, x: f64) -> f64 {
        self.a + self.b * x
    }

    /// Half-width of the 95% confidence interval of the slope: t(0.975, n − 2)·se(b).
    pub fn slope_ci95(&self) -> f64 {
        crate::stats::t_quantile(self.n.saturating_sub(2).max(1) as f64, 0.975) * self.se_b
    }

    /// `L = a + b·log2(r)` with each coefficient's standard error, e.g.
    /// `L = 1.6212 (± 0.0010) − 0.0069 (± 0.0002)·log2(r)`.
    pub fn equation(&self, y: &str, x: &str) -> String {
        let sign = if self.b < 0.0 { '−' } else { '+' };
        format!(
            "{y} = {:.4} (± {:.4}) {sign} {:.4} (± {:.4})·{x}",
            self.a,
            self.se_a,
            self.b.abs(),
            self.se_b
        )
    }
}

/// Fits `y = a + b·x` by ordinary least squares.
pub fn linear(x: &[f64], y: &[f64]) -> Result<LinearFit, FitError> {
    if x.len() != y.len() {
        return Err(FitError::Lengths { x: x.len(), y: y.len() });
    }
    let n = x.len();
    if let Some(index) = (0..n).find(|&i| !(x[i].is_finite() && y[i].is_finite())) {
        return Err(FitError::NonFinite { index, x: x[index], y: y[index] });
    }
    if n < 3 {
        return Err(FitError::TooFew { n });
    }
    let nf = n as f64;
    let mx = x.iter().sum::<f64>() / nf;
    let my = y.iter().sum::<f64>() / nf;
    let sxx: f64 = x.iter().map(|&xi| (xi - mx) * (xi - mx)).sum();
    let sxy: f64 = x.iter().zip(y).map(|(&xi, &yi)| (xi - mx) * (yi - my)).sum();
    let syy: f64 = y.iter().map(|&yi| (yi - my) * (yi - my)).sum();
    // Relative to the x scale, so an axis like 1e-3.. still counts as spread.
    let scale = x.iter().fold(0.0f64, |m, &xi| m.max(xi.abs())).max(f64::MIN_POSITIVE);
    if sxx <= (scale * 1e-12) * (scale * 1e-12) * nf {
        return Err(FitError::ConstantX { x: x[0] });
    }
    let b = sxy / sxx;
    let a = my - b * mx;
    let sse: f64 = x.iter().zip(y).map(|(&xi, &yi)| (yi - a - b * xi).powi(2)).sum::<f64>().max(0.0);
    let s2 = sse / (nf - 2.0);
    let r2 = if syy > 0.0 { (1.0 - sse / syy).clamp(0.0, 1.0) } else { 1.0 };
    Ok(LinearFit { a, b, se_a: (s2 * (1.0 / nf + mx * mx / sxx)).sqrt(), se_b: (s2 / sxx).sqrt(), r2, n })
}

/// Fits the law `loss = a + b·log2(axis)` (docs/math.md §5).
pub fn log2_law(axis: &[f64], loss: &[f64]) -> Result<LinearFit, FitError> {
    if let Some(index) = axis.iter().position(|&v| v.is_nan() || v <= 0.0) {
        return Err(FitError::NonPositive { index, value: axis[index] });
    }
    let x: Vec<f64> = axis.iter().map(|v| v.log2()).collect();
    linear(&x, loss)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64 and Box–Muller: seeded Gaussian noise without a dependency.
    struct Noise(u64);

    impl Noise {
        fn uniform(&mut self) -> f64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }

        fn gaussian(&mut self) -> f64 {
            let (u1, u2) = (self.uniform(), self.uniform());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        }
    }

    #[test]
    fn exact_recovery_without_noise() {
        let axis = [1.0, 1.5, 2.0, 4.0, 8.0];
        let loss: Vec<f64> = axis.iter().map(|r: &f64| 1.6212 - 0.0069 * r.log2()).collect();
        let f = log2_law(&axis, &loss).unwrap();
        assert!((f.a - 1.6212).abs() < 1e-12 && (f.b + 0.0069).abs() < 1e-12, "{f:?}");
        assert!(f.se_a < 1e-12 && f.se_b < 1e-12, "{f:?}");
        assert!((f.r2 - 1.0).abs() < 1e-12);
        assert_eq!(f.n, 5);
        assert!((f.predict(3.0) - (1.6212 - 0.0069 * 3.0)).abs() < 1e-12);
    }

    #[test]
    fn noisy_slope_within_three_stated_standard_errors() {
        let (a, b, sigma) = (2.5, -0.04, 0.01);
        let fit_seed = |seed: u64| {
            let mut noise = Noise(seed);
            let axis: Vec<f64> = (0..24).map(|i| [1.0, 2.0, 4.0, 8.0, 16.0, 32.0][i % 6]).collect();
            let loss: Vec<f64> = axis.iter().map(|r| a + b * r.log2() + sigma * noise.gaussian()).collect();
            log2_law(&axis, &loss).unwrap()
        };
        let f = fit_seed(0);
        assert!((f.b - b).abs() <= 3.0 * f.se_b, "b = {} ± {} vs {b}", f.b, f.se_b);
        assert!((f.a - a).abs() <= 3.0 * f.se_a, "a = {} ± {} vs {a}", f.a, f.se_a);
        assert!(f.r2 > 0.9 && f.r2 < 1.0, "{f:?}");
        // Over many seeds the stated error is calibrated: about 68% of fits lie within
        // one standard error and nearly all within three (t with 22 degrees of freedom).
        let fits: Vec<LinearFit> = (0..400).map(fit_seed).collect();
        let within = |k: f64| fits.iter().filter(|f| (f.b - b).abs() <= k * f.se_b).count();
        assert!((230..=315).contains(&within(1.0)), "{} of 400 within 1 SE", within(1.0));
        assert!(within(3.0) >= 390, "{} of 400 within 3 SE", within(3.0));
    }

    #[test]
    fn standard_errors_match_a_hand_computed_case() {
        // x = 0, 1, 2; y = 0, 2, 1: b = 0.5, a = 0.5, SSE = 1.5, s² = 1.5, Sxx = 2.
        let f = linear(&[0.0, 1.0, 2.0], &[0.0, 2.0, 1.0]).unwrap();
        assert!((f.b - 0.5).abs() < 1e-12 && (f.a - 0.5).abs() < 1e-12);
        assert!((f.se_b - (1.5f64 / 2.0).sqrt()).abs() < 1e-12);
        assert!((f.se_a - (1.5f64 * (1.0 / 3.0 + 1.0 / 2.0)).sqrt()).abs() < 1e-12);
        assert!((f.r2 - 0.25).abs() < 1e-12, "SST = 2, SSE = 1.5");
    }

    #[test]
    fn degenerate_inputs_are_errors_not_nan() {
        assert_eq!(linear(&[1.0, 2.0], &[1.0, 2.0]), Err(FitError::TooFew { n: 2 }));
        assert_eq!(linear(&[3.0; 4], &[1.0, 2.0, 3.0, 4.0]), Err(FitError::ConstantX { x: 3.0 }));
        assert!(matches!(
            linear(&[1.0, 2.0, 3.0], &[1.0, f64::NAN, 3.0]),
            Err(FitError::NonFinite { index: 1, .. })
        ));
        assert!(matches!(
            linear(&[1.0, f64::INFINITY, 3.0], &[1.0, 2.0, 3.0]),
            Err(FitError::NonFinite { .. })
        ));
        assert_eq!(linear(&[1.0, 2.0, 3.0], &[1.0]), Err(FitError::Lengths { x: 3, y: 1 }));
        assert_eq!(
            log2_law(&[1.0, 0.0, 2.0], &[1.0, 2.0, 3.0]),
            Err(FitError::NonPositive { index: 1, value: 0.0 })
        );
        assert!(matches!(log2_law(&[1.0, f64::NAN, 2.0], &[1.0; 3]), Err(FitError::NonPositive { .. })));
        // Equal y is a flat line, not a degenerate fit.
        let f = linear(&[1.0, 2.0, 3.0], &[5.0; 3]).unwrap();
        assert_eq!((f.b, f.r2), (0.0, 1.0));
        // A small but real spread in x is not "constant".
        assert!(linear(&[1e-4, 2e-4, 3e-4], &[1.0, 2.0, 3.0]).is_ok());
    }

    #[test]
    fn equation_reads_as_the_law() {
        let f = LinearFit { a: 1.6212, b: -0.0069, se_a: 0.001, se_b: 0.0002, r2: 0.99, n: 3 };
        assert_eq!(f.equation("L", "log2(r)"), "L = 1.6212 (± 0.0010) − 0.0069 (± 0.0002)·log2(r)");
    }

    // scipy.stats.linregress(log2 x, y): slope −0.021, stderr 0.001914854215512644;
    // t.ppf(0.975, 3) · stderr = 0.0060939207233151466.
    #[test]
    fn slope_interval_matches_textbook_values() {
        let x: Vec<f64> = [1.0f64, 2.0, 4.0, 8.0, 16.0].iter().map(|v| v.log2()).collect();
        let fit = linear(&x, &[4.20, 4.18, 4.15, 4.13, 4.12]).unwrap();
        assert!((fit.b + 0.021).abs() < 1e-12 && (fit.se_b - 0.001914854215512644).abs() < 1e-12);
        assert!((fit.slope_ci95() - 0.0060939207233151466).abs() < 1e-10, "{}", fit.slope_ci95());
    }
}
