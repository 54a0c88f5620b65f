//! The loss-vs-compute frontier: the points no cheaper point beats.
//!
//! A wider residual stream costs FLOPs; it is worth it only if no other point reaches
//! the same loss for less. A point is **dominated** when another point costs no more
//! and loses no more, and is strictly better in at least one of the two. The frontier
//! is the set of points that are not dominated. Points with a non-finite cost or loss
//! (a failed run) are never on it and dominate nothing. Points with equal cost and
//! equal loss do not dominate each other, so both stay.

/// Indices of the non-dominated points of `(cost, loss)` pairs, by increasing cost
/// (ties by loss, then index).
pub fn frontier(points: &[(f64, f64)]) -> Vec<usize> {
    let usable = |&(c, l): &(f64, f64)| c.is_finite() && l.is_finite();
    let dominates = |(cj, lj): (f64, f64), (ci, li): (f64, f64)| cj <= ci && lj <= li && (cj < ci || lj < li);
    let mut on: Vec<usize> = (0..points.len())
        .filter(|&i| usable(&points[i]) && !points.iter().any(|&pj| usable(&pj) && dominates(pj, points[i])))
        .collect();
    on.sort_by(|&i, &j| {
        let (a, b) = (points[i], points[j]);
        a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)).then(i.cmp(&j))
    });
    on
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dominated_points_are_left_out() {
        // (cost, loss)
        let pts = [
            (1.0, 3.0), // 0: cheapest: on
            (2.0, 2.5), // 1: on
            (2.0, 2.8), // 2: same cost as 1, worse loss: dominated
            (3.0, 2.5), // 3: same loss as 1, costlier: dominated
            (4.0, 2.0), // 4: on
            (5.0, 2.1), // 5: dominated by 4
        ];
        assert_eq!(frontier(&pts), [0, 1, 4]);
    }

    #[test]
    fn ties_stay_and_failed_points_do_not_count() {
        let pts = [(2.0, 1.0), (1.0, f64::NAN), (2.0, 1.0), (f64::INFINITY, 0.1), (3.0, 0.5)];
        assert_eq!(frontier(&pts), [0, 2, 4]);
        assert!(frontier(&[]).is_empty());
    }

    #[test]
    fn the_frontier_is_sorted_by_cost() {
        let pts = [(5.0, 1.0), (1.0, 3.0), (3.0, 2.0)];
        assert_eq!(frontier(&pts), [1, 2, 0]);
    }
}
