//! Whether a difference between two points is real: Student's t over seeds
//! (docs/sweeps.md#significance).
//!
//! At small scale seed noise is of the size of the effects a sweep looks for, so
//! every comparison comes with a 95% confidence interval and a two-sided p-value.
//!
//! - **Paired by seed** when both points have runs of the same seeds: a seed fixes the
//!   batches and their order (crate::point), so run i of one point and run i of the
//!   other see the same data, and the per-seed differences d_i remove the part of
//!   the noise the data order causes. t = mean(d) / (s_d / √n), n − 1 degrees of freedom.
//! - **Welch's test** when the seeds do not pair (fewer than two common seeds):
//!   t = (x̄ − ȳ) / √(s_x²/n_x + s_y²/n_y), with the Welch–Satterthwaite degrees of
//!   freedom.
//!
//! A difference is "point minus reference": negative means a lower (better) loss.
//! With zero spread (every difference equal) the interval is that one value and p
//! is 0, or 1 when the value is 0. Fewer than two values give no test.

use serde::{Deserialize, Serialize};
use statrs::distribution::{ContinuousCDF, StudentsT};

/// Which test produced a [`Difference`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Test {
    /// Paired t-test over `n` common seeds.
    Paired { n: usize },
    /// Welch's unequal-variance t-test over `n_a` and `n_b` runs.
    Welch { n_a: usize, n_b: usize },
}

impl Test {
    /// `paired over 3 seeds` / `Welch, 3 and 2 seeds`.
    pub fn describe(&self) -> String {
        match self {
            Test::Paired { n } => format!("paired over {n} seeds"),
            Test::Welch { n_a, n_b } => format!("Welch, {n_a} and {n_b} seeds"),
        }
    }

    /// `paired` or `welch`, for the CSV.
    pub fn name(&self) -> &'static str {
        match self {
            Test::Paired { .. } => "paired",
            Test::Welch { .. } => "welch",
        }
    }
}

/// A mean difference with its 95% confidence interval and two-sided p-value.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Difference {
    pub mean: f64,
    pub ci95_lo: f64,
    pub ci95_hi: f64,
    pub p_value: f64,
    pub test: Test,
}

/// The `q` quantile of Student's t with `df` degrees of freedom.
pub fn t_quantile(df: f64, q: f64) -> f64 {
    StudentsT::new(0.0, 1.0, df).map(|t| t.inverse_cdf(q)).unwrap_or(f64::NAN)
}

/// Two-sided p-value of `t` with `df` degrees of freedom.
fn two_sided_p(t: f64, df: f64) -> f64 {
    match StudentsT::new(0.0, 1.0, df) {
        Ok(dist) => (2.0 * dist.cdf(-t.abs())).clamp(0.0, 1.0),
        Err(_) => f64::NAN,
    }
}

fn mean_var(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var)
}

/// Mean, interval and p-value of an estimate with standard error `se` and `df`.
fn from_t(mean: f64, se: f64, df: f64, test: Test) -> Difference {
    if se == 0.0 {
        let p_value = if mean == 0.0 { 1.0 } else { 0.0 };
        return Difference { mean, ci95_lo: mean, ci95_hi: mean, p_value, test };
    }
    let half = t_quantile(df, 0.975) * se;
    Difference { mean, ci95_lo: mean - half, ci95_hi: mean + half, p_value: two_sided_p(mean / se, df), test }
}

/// The paired t-test of `a[i] − b[i]`; `None` with fewer than two pairs or a
/// non-finite value.
pub fn paired(a: &[f64], b: &[f64]) -> Option<Difference> {
    if a.len() != b.len() || a.len() < 2 || a.iter().chain(b).any(|x| !x.is_finite()) {
        return None;
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let n = d.len();
    let (mean, var) = mean_var(&d);
    Some(from_t(mean, (var / n as f64).sqrt(), (n - 1) as f64, Test::Paired { n }))
}

/// Welch's t-test of mean(a) − mean(b); `None` with fewer than two values on a side
/// or a non-finite value.
pub fn welch(a: &[f64], b: &[f64]) -> Option<Difference> {
    if a.len() < 2 || b.len() < 2 || a.iter().chain(b).any(|x| !x.is_finite()) {
        return None;
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let ((ma, va), (mb, vb)) = (mean_var(a), mean_var(b));
    let (qa, qb) = (va / na, vb / nb);
    let se = (qa + qb).sqrt();
    let df = if se == 0.0 { 1.0 } else { (qa + qb).powi(2) / (qa * qa / (na - 1.0) + qb * qb / (nb - 1.0)) };
    Some(from_t(ma - mb, se, df, Test::Welch { n_a: a.len(), n_b: b.len() }))
}

/// Compares two points' per-seed values `(seed, value)`: paired over the common
/// seeds when there are at least two, else Welch over all of each.
pub fn compare(point: &[(u64, f64)], reference: &[(u64, f64)]) -> Option<Difference> {
    let common: Vec<(f64, f64)> = point
        .iter()
        .filter_map(|(s, x)| reference.iter().find(|(t, _)| t == s).map(|(_, y)| (*x, *y)))
        .collect();
    if common.len() >= 2 {
        let (a, b): (Vec<f64>, Vec<f64>) = common.into_iter().unzip();
        return paired(&a, &b);
    }
    let values = |v: &[(u64, f64)]| v.iter().map(|(_, x)| *x).collect::<Vec<f64>>();
    welch(&values(point), &values(reference))
}

/// Half-width of the 95% confidence interval of the mean of `xs` (Student's t);
/// `None` with fewer than two values.
pub fn mean_ci95(xs: &[f64]) -> Option<f64> {
    if xs.len() < 2 || xs.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let (_, var) = mean_var(xs);
    Some(t_quantile((xs.len() - 1) as f64, 0.975) * (var / xs.len() as f64).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-300)
    }

    // Reference values: scipy.stats 1.x, `ttest_rel(a, b)`, `ttest_ind(x, y,
    // equal_var=False)` and their `confidence_interval(0.95)`, `t.ppf`.
    #[test]
    fn paired_and_welch_match_textbook_values() {
        let a = [4.1012, 4.0987, 4.1105, 4.0931, 4.1050];
        let b = [4.1203, 4.1150, 4.1298, 4.1102, 4.1219];
        let d = paired(&a, &b).unwrap();
        assert_eq!(d.test, Test::Paired { n: 5 });
        assert!(close(d.p_value, 8.389212895750905e-06, 1e-6), "{d:?}");
        assert!(
            close(d.ci95_lo, -0.019437041742835334, 1e-9) && close(d.ci95_hi, -0.016042958257164754, 1e-9)
        );

        let x = [3.91, 3.95, 3.89, 3.97];
        let y = [4.02, 3.99, 4.08];
        let w = welch(&x, &y).unwrap();
        assert_eq!(w.test, Test::Welch { n_a: 4, n_b: 3 });
        assert!(close(w.p_value, 0.038613976169602535, 1e-6), "{w:?}");
        assert!(close(w.ci95_lo, -0.1912759493066517, 1e-6) && close(w.ci95_hi, -0.008724050693348487, 1e-5));

        assert!(close(t_quantile(2.0, 0.975), 4.302652729749462, 1e-9));
        assert!(close(t_quantile(7.3, 0.975), 2.345066736547703, 1e-9));
    }

    #[test]
    fn common_seeds_pair_and_others_fall_back_to_welch() {
        let p = [(0, 1.0), (1, 1.2), (2, 1.1)];
        let r = [(0, 1.1), (1, 1.25), (2, 1.3), (9, 7.0)];
        assert_eq!(compare(&p, &r).unwrap().test, Test::Paired { n: 3 });
        let q = [(5, 1.0), (6, 1.2)];
        assert_eq!(compare(&q, &r).unwrap().test, Test::Welch { n_a: 2, n_b: 4 });
        assert!(compare(&[(0, 1.0)], &[(0, 2.0)]).is_none(), "one seed gives no test");
    }

    #[test]
    fn zero_spread_is_exact() {
        let d = paired(&[1.5, 2.5], &[1.0, 2.0]).unwrap();
        assert_eq!((d.mean, d.ci95_lo, d.ci95_hi, d.p_value), (0.5, 0.5, 0.5, 0.0));
        let same = paired(&[1.0, 2.0], &[1.0, 2.0]).unwrap();
        assert_eq!(same.p_value, 1.0);
    }

    /// A small normal generator for the calibration test (Box–Muller over xorshift).
    struct Normal(u64);
    impl Normal {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn next(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
    }

    /// Fractions of p-values below 0.05 and 0.5, and of intervals holding 0.
    fn calibration(reps: usize, mut case: impl FnMut() -> Difference) -> (f64, f64, f64) {
        let (mut below_05, mut below_50, mut covered) = (0, 0, 0);
        for _ in 0..reps {
            let d = case();
            below_05 += usize::from(d.p_value < 0.05);
            below_50 += usize::from(d.p_value < 0.5);
            covered += usize::from(d.ci95_lo <= 0.0 && 0.0 <= d.ci95_hi);
        }
        let f = |k: usize| k as f64 / reps as f64;
        (f(below_05), f(below_50), f(covered))
    }

    #[test]
    fn p_values_are_uniform_on_null_data() {
        // 4000 repetitions: a fraction's sampling sd is 0.0034 at 5% and 0.0079 at 50%.
        let mut g = Normal(0x9E37_79B9_7F4A_7C15);
        let paired_case = calibration(4000, || {
            // Equal means and a large per-seed offset shared by both points, as the
            // data order gives: pairing removes it.
            let shared: Vec<f64> = (0..4).map(|_| 0.5 * g.next()).collect();
            let a: Vec<f64> = shared.iter().map(|s| 3.0 + s + 0.01 * g.next()).collect();
            let b: Vec<f64> = shared.iter().map(|s| 3.0 + s + 0.01 * g.next()).collect();
            paired(&a, &b).unwrap()
        });
        let mut g = Normal(0x2545_F491_4F6C_DD1D);
        let welch_case = calibration(4000, || {
            // Equal means, unequal spreads and sizes.
            let a: Vec<f64> = (0..4).map(|_| 3.0 + 0.01 * g.next()).collect();
            let b: Vec<f64> = (0..6).map(|_| 3.0 + 0.03 * g.next()).collect();
            welch(&a, &b).unwrap()
        });
        for (name, (f05, f50, cover)) in [("paired", paired_case), ("welch", welch_case)] {
            assert!((f05 - 0.05).abs() < 0.013, "{name}: {f05} of p-values below 0.05");
            assert!((f50 - 0.5).abs() < 0.03, "{name}: {f50} of p-values below 0.5");
            assert!((cover - 0.95).abs() < 0.013, "{name}: the interval holds 0 in {cover}");
        }
    }
}
