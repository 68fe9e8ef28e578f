//! Per-layer patterns under a density budget: each group of linears (the layers that share an
//! input, such as q/k/v or gate/up, take one pattern together) gets one of its candidate
//! patterns, or stays dense, so that the whole model keeps at most a given fraction of its
//! weights and the summed sensitivity (a measured error of each candidate, lower is better)
//! is as small as this method finds.
//!
//! Why it is possible here: every `(2N-2):2N` pattern runs on the same 2:4 kernels, so a model
//! may mix them freely; a sensitive group can keep 14 of 16 while a tolerant one keeps 2 of 4.
//!
//! The method: a multiple-choice knapsack solved greedily on each group's lower convex hull
//! (of error against kept weights). Every group starts at its sparsest candidate; then, while
//! the budget allows, the group whose next hull step buys the largest error reduction per kept
//! weight takes it (a step that does not fit is passed over, later smaller ones may). The
//! result keeps to the budget and is within one step's error of the optimum of the relaxed
//! problem (so of the true one); steps off a group's hull are never taken, since a hull step
//! always reduces more error per weight.

use crate::{
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
};

/// One choice for a group: a pattern (`None`: dense) and its measured sensitivity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PatternCandidate {
    /// The pattern, or `None` for the dense layer.
    pub pattern: Option<SparsityPattern>,
    /// The error the group shows with it (any non-negative measure summed over groups, e.g.
    /// the reconstruction error of its outputs on calibration data).
    pub error: f64,
}

impl PatternCandidate {
    /// Fraction of the weights the candidate keeps: `(2N-2)/2N`, 1 for dense.
    pub fn kept_fraction(&self) -> f64 {
        self.pattern
            .map_or(1.0, |p| p.nonzeros() as f64 / p.block_len() as f64)
    }
}

/// A group of linears that takes one pattern, its weight count and its candidates.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocationGroup {
    /// The group's name (for errors and reports).
    pub name: String,
    /// Weights of the group's linears together.
    pub weights: usize,
    /// The candidates, in any order.
    pub candidates: Vec<PatternCandidate>,
}

/// The chosen candidate of every group (an index into its `candidates`) for a model that keeps
/// at most `kept_density` of its weights (0 < `kept_density` <= 1; 0.75 is uniform 6:8's).
///
/// Errors ([`SlideSparseError::InvalidAllocation`]): a density outside (0, 1]; a group without
/// candidates, or with a negative or non-finite error; a budget below what every group's
/// sparsest candidate keeps.
pub fn allocate_patterns(groups: &[AllocationGroup], kept_density: f64) -> Result<Vec<usize>> {
    let invalid = |detail: String| SlideSparseError::InvalidAllocation(detail);
    if !(kept_density > 0.0 && kept_density <= 1.0) {
        return Err(invalid(format!(
            "kept density {kept_density}: it must lie in (0, 1]"
        )));
    }
    let hulls = groups.iter().map(hull).collect::<Result<Vec<_>>>()?;
    let total: f64 = groups.iter().map(|g| g.weights as f64).sum();
    let budget = kept_density * total;
    let kept =
        |g: usize, c: usize| groups[g].weights as f64 * groups[g].candidates[c].kept_fraction();
    let mut at = vec![0usize; groups.len()];
    let mut used: f64 = (0..groups.len()).map(|g| kept(g, hulls[g][0])).sum();
    if used > budget * (1.0 + 1e-12) {
        return Err(invalid(format!(
            "kept density {kept_density}: the sparsest candidates keep {:.4} of the weights",
            used / total
        )));
    }
    loop {
        // The best next hull step that fits: the most error removed per kept weight added.
        let mut best: Option<(usize, f64)> = None;
        for (g, hull) in hulls.iter().enumerate() {
            let Some(&next) = hull.get(at[g] + 1) else {
                continue;
            };
            let now = hull[at[g]];
            let extra = kept(g, next) - kept(g, now);
            if used + extra > budget * (1.0 + 1e-12) {
                continue;
            }
            let gain = groups[g].candidates[now].error - groups[g].candidates[next].error;
            let rate = gain / extra.max(f64::MIN_POSITIVE);
            if best.is_none_or(|(_, r)| rate > r) {
                best = Some((g, rate));
            }
        }
        let Some((g, _)) = best else {
            break;
        };
        used += kept(g, hulls[g][at[g] + 1]) - kept(g, hulls[g][at[g]]);
        at[g] += 1;
    }
    Ok(at.iter().enumerate().map(|(g, &i)| hulls[g][i]).collect())
}

/// The candidates of `group` on its lower convex hull of error against kept fraction, from the
/// sparsest up (a candidate dominated by a sparser one with no more error is dropped).
fn hull(group: &AllocationGroup) -> Result<Vec<usize>> {
    let invalid = |detail: String| SlideSparseError::InvalidAllocation(detail);
    if group.candidates.is_empty() {
        return Err(invalid(format!(
            "group {}: no candidate patterns",
            group.name
        )));
    }
    if let Some(c) = group
        .candidates
        .iter()
        .find(|c| !(c.error >= 0.0 && c.error.is_finite()))
    {
        return Err(invalid(format!(
            "group {}: candidate {:?} has error {} (it must be finite and >= 0)",
            group.name, c.pattern, c.error
        )));
    }
    let mut order: Vec<usize> = (0..group.candidates.len()).collect();
    let point = |i: usize| {
        let c = &group.candidates[i];
        (c.kept_fraction(), c.error)
    };
    // Sparsest first; at equal density the smaller error first.
    order.sort_by(|&a, &b| point(a).partial_cmp(&point(b)).expect("finite"));
    let mut hull: Vec<usize> = Vec::new();
    for i in order {
        let (x, y) = point(i);
        if let Some(&last) = hull.last() {
            let (lx, ly) = point(last);
            // Denser without less error: never worth its weights.
            if y >= ly || x <= lx {
                continue;
            }
        }
        // Drop points above the segment from the one before them to this one.
        while hull.len() >= 2 {
            let (ax, ay) = point(hull[hull.len() - 2]);
            let (bx, by) = point(hull[hull.len() - 1]);
            if (by - ay) * (x - ax) >= (y - ay) * (bx - ax) {
                hull.pop();
            } else {
                break;
            }
        }
        hull.push(i);
    }
    Ok(hull)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::XorShift32;

    fn patterns() -> Vec<Option<SparsityPattern>> {
        let mut all: Vec<_> = SparsityPattern::all().take(6).map(Some).collect();
        all.push(None);
        all
    }

    /// Random groups: sizes of 1..=8 units, errors falling as density rises (with noise, so
    /// some candidates fall off the hull).
    fn random_groups(rng: &mut XorShift32, count: usize) -> Vec<AllocationGroup> {
        (0..count)
            .map(|g| {
                let scale = 1.0 + (rng.next_u32() % 100) as f64;
                let mut candidates = Vec::new();
                for pattern in patterns() {
                    if rng.next_u32().is_multiple_of(4) {
                        continue;
                    }
                    let c = PatternCandidate {
                        pattern,
                        error: 0.0,
                    };
                    let noise = (rng.next_u32() % 50) as f64 / 100.0;
                    candidates.push(PatternCandidate {
                        error: scale * (1.0 - c.kept_fraction()) * (1.0 + noise),
                        ..c
                    });
                }
                let candidates = if candidates.is_empty() {
                    vec![PatternCandidate {
                        pattern: None,
                        error: 0.0,
                    }]
                } else {
                    candidates
                };
                AllocationGroup {
                    name: format!("g{g}"),
                    weights: 1000 * (1 + rng.next_u32() as usize % 8),
                    candidates,
                }
            })
            .collect()
    }

    fn kept(groups: &[AllocationGroup], choice: &[usize]) -> f64 {
        groups
            .iter()
            .zip(choice)
            .map(|(g, &c)| g.weights as f64 * g.candidates[c].kept_fraction())
            .sum()
    }

    fn error(groups: &[AllocationGroup], choice: &[usize]) -> f64 {
        groups
            .iter()
            .zip(choice)
            .map(|(g, &c)| g.candidates[c].error)
            .sum()
    }

    /// The best allocation within `budget` kept weights, by trying them all.
    fn brute_force(groups: &[AllocationGroup], budget: f64) -> Option<f64> {
        let mut best: Option<f64> = None;
        let mut choice = vec![0usize; groups.len()];
        loop {
            if kept(groups, &choice) <= budget * (1.0 + 1e-12) {
                let e = error(groups, &choice);
                best = Some(best.map_or(e, |b: f64| b.min(e)));
            }
            let mut g = 0;
            loop {
                if g == groups.len() {
                    return best;
                }
                choice[g] += 1;
                if choice[g] < groups[g].candidates.len() {
                    break;
                }
                choice[g] = 0;
                g += 1;
            }
        }
    }

    /// Random instances at densities from the sparsest to dense: the budget holds, and the
    /// error is within the largest single step's error of the exhaustive optimum.
    #[test]
    fn allocations_keep_the_budget_and_come_close_to_the_optimum() {
        let mut rng = XorShift32(91);
        for case in 0..300 {
            let groups = random_groups(&mut rng, 1 + case % 5);
            let total: f64 = groups.iter().map(|g| g.weights as f64).sum();
            let density = 0.5 + (rng.next_u32() % 51) as f64 / 100.0;
            let Ok(choice) = allocate_patterns(&groups, density) else {
                // Only when even the sparsest candidates do not fit.
                let sparsest: f64 = groups
                    .iter()
                    .map(|g| {
                        let f = g.candidates.iter().map(|c| c.kept_fraction());
                        g.weights as f64 * f.fold(1.0, f64::min)
                    })
                    .sum();
                assert!(sparsest > density * total, "case {case}");
                continue;
            };
            assert!(
                kept(&groups, &choice) <= density * total * (1.0 + 1e-9),
                "case {case}"
            );
            let optimum = brute_force(&groups, density * total).expect("a fitting allocation");
            let step: f64 = groups
                .iter()
                .map(|g| g.candidates.iter().map(|c| c.error).fold(0.0, f64::max))
                .fold(0.0, f64::max);
            let found = error(&groups, &choice);
            assert!(found >= optimum - 1e-9, "case {case}: below the optimum");
            assert!(
                found <= optimum + step + 1e-9,
                "case {case}: {found} vs {optimum}"
            );
        }
    }

    /// Identical groups whose errors make 6:8 the best trade at 75%: uniform 6:8.
    #[test]
    fn identical_groups_at_three_quarters_take_six_of_eight() {
        let candidates: Vec<_> = patterns()
            .into_iter()
            .map(|pattern| {
                let c = PatternCandidate {
                    pattern,
                    error: 0.0,
                };
                let sparsity = 1.0 - c.kept_fraction();
                PatternCandidate {
                    error: sparsity * sparsity,
                    ..c
                }
            })
            .collect();
        let groups: Vec<_> = (0..4)
            .map(|g| AllocationGroup {
                name: format!("g{g}"),
                weights: 4096,
                candidates: candidates.clone(),
            })
            .collect();
        let choice = allocate_patterns(&groups, 0.75).unwrap();
        for (g, &c) in groups.iter().zip(&choice) {
            assert_eq!(g.candidates[c].pattern, Some(SparsityPattern::P6_8));
        }
    }

    /// Bad densities, empty groups, bad errors and budgets below the sparsest are errors.
    #[test]
    fn invalid_inputs_are_errors() {
        let group = |candidates| AllocationGroup {
            name: "g".into(),
            weights: 8,
            candidates,
        };
        let six_of_eight = PatternCandidate {
            pattern: Some(SparsityPattern::P6_8),
            error: 1.0,
        };
        for density in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(allocate_patterns(&[group(vec![six_of_eight])], density).is_err());
        }
        assert!(allocate_patterns(&[group(vec![])], 0.75).is_err());
        let nan = PatternCandidate {
            error: f64::NAN,
            ..six_of_eight
        };
        assert!(allocate_patterns(&[group(vec![nan])], 0.75).is_err());
        assert!(allocate_patterns(&[group(vec![six_of_eight])], 0.7).is_err());
        assert_eq!(
            allocate_patterns(&[group(vec![six_of_eight])], 0.75).unwrap(),
            [0]
        );
    }
}
