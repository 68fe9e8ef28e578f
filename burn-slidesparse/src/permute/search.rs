//! The input-channel permutation search: a bounded channel-swap search in the manner of Pool
//! and Yu (NeurIPS 2021), on the pruning criterion in use.
//!
//! **Objective.** Every weight gets a score `s[n, k]` from the prune method: `|w|`
//! (magnitude), `|w| * ||X[:, k]||` (Wanda) or `|w| / sqrt([H^-1]_kk)` (SparseGPT: the
//! optimal brain surgeon's saliency `w^2 / [H^-1]_kk` is `s^2`). Pruning drops, in every row
//! and block of `2N` positions, the two weights of lowest score. The search minimizes the
//! pruned *energy* `sum s^2` over the dropped weights of all rows of all layers sharing the
//! input (so the same order serves q/k/v, or gate/up): for magnitude this is the squared
//! pruning error `||W - prune(W)||^2`, for Wanda the output error under uncorrelated
//! inputs, and for SparseGPT the sum of the single-weight brain-surgeon costs. The
//! objective depends on the order only through which channels share a block.
//!
//! **Search.** (1) The initial order is the better of the identity and a *striped* order:
//! channels sorted by their total energy and dealt to the blocks round-robin, so that every
//! block gets one channel of each importance tier (optimal when a weight's score is a row
//! factor times a channel factor, the Wanda case of a few outlier channels). (2) Rounds of
//! channel swaps: each round pairs every block with another at random, and for every pair
//! applies the best swap of one channel of each block while it lowers the pair's pruned
//! energy (each pair evaluated exactly over all rows, as Pool and Yu's channel swap does
//! globally). The pairs of a round are disjoint, so they run in parallel; the search is
//! deterministic given its seed. It stops after `rounds` rounds or once a round gains less
//! than `tolerance` of what is left.
//!
//! **Cost.** A pair evaluation is `O(L^2 * rows)` with `L = 2N` (the two smallest of each
//! block minus one channel are computed once per pair step, then each of the `L^2` swaps
//! costs two passes over the rows), a round `O(K * L * rows)`.

use rayon::prelude::*;

use super::{InputPermutation, PermutationSearch};
use crate::{
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
    prune::{PruneMethod, check_finite, obs_column_factors},
};

/// A position past `K` in the last, partial block: it holds no channel and scores zero, as
/// the pruners count padding as zeros.
const PAD: u32 = u32::MAX;

/// What [`search_permutation`] found.
#[derive(Clone, Debug)]
pub struct PermutationOutcome {
    /// The order found (the identity if nothing better was found).
    pub permutation: InputPermutation,
    /// Fraction of the total score energy `sum s^2` that pruning drops in the original order.
    pub pruned_before: f64,
    /// The same fraction in the order found.
    pub pruned_after: f64,
    /// Swap rounds run.
    pub rounds: usize,
}

/// Searches one order of the `cols` input channels for `layers` (each `(weight [rows,
/// cols] row-major, rows, prune method)`, all reading the same input), scored by each
/// layer's method (see the module's documentation). `name` is for messages.
///
/// Errors: a weight of the wrong size or with a non-finite value, calibration of the wrong
/// length, a SparseGPT Hessian that is not positive definite, and [`PruneMethod::None`]
/// (the weight is already pruned: there is nothing to choose; pass the order it was pruned
/// in).
pub fn search_permutation(
    name: &str,
    layers: &[(&[f32], usize, &PruneMethod)],
    cols: usize,
    pattern: SparsityPattern,
    search: &PermutationSearch,
) -> Result<PermutationOutcome> {
    let scores = Scores::new(name, layers, cols)?;
    let mut state = Search::new(&scores, pattern.block_len());
    let total = scores.total_energy();
    let fraction = |cost: f64| if total > 0.0 { cost / total } else { 0.0 };
    let pruned_before = fraction(state.cost());
    state.start_striped();
    let mut rng = SplitMix64(search.seed);
    let mut rounds = 0;
    while rounds < search.rounds && state.blocks.len() >= 2 {
        let left = state.cost();
        let gain = state.round(&mut rng);
        rounds += 1;
        if gain <= search.tolerance * left {
            break;
        }
    }
    Ok(PermutationOutcome {
        permutation: InputPermutation::new(state.order())?,
        pruned_before,
        pruned_after: fraction(state.cost()),
        rounds,
    })
}

/// The squared scores of all rows of a group of layers, column-major: `column(k)` is channel
/// `k`'s score energy in every row, contiguous (what the search reads block by block).
struct Scores {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
    zeros: Vec<f32>,
}

impl Scores {
    fn new(name: &str, layers: &[(&[f32], usize, &PruneMethod)], cols: usize) -> Result<Self> {
        let rows: usize = layers.iter().map(|l| l.1).sum();
        let mut data = vec![0.0f32; rows * cols];
        let mut offset = 0;
        for &(weight, layer_rows, method) in layers {
            if Some(weight.len()) != layer_rows.checked_mul(cols) {
                return Err(SlideSparseError::shape(
                    format!("{name}: weight"),
                    [layer_rows, cols],
                    format!("{} elements", weight.len()),
                ));
            }
            check_finite(name, weight, cols)?;
            let factors = column_factors(name, method, cols)?;
            transpose_squared(weight, layer_rows, &factors, &mut data, (offset, rows));
            offset += layer_rows;
        }
        Ok(Self {
            rows,
            cols,
            data,
            zeros: vec![0.0; rows],
        })
    }

    /// Channel `c`'s energies over all rows (zeros for a padding position).
    fn column(&self, c: u32) -> &[f32] {
        if c == PAD {
            &self.zeros
        } else {
            &self.data[c as usize * self.rows..(c as usize + 1) * self.rows]
        }
    }

    fn channel_energy(&self, c: u32) -> f64 {
        self.column(c).iter().map(|&v| v as f64).sum()
    }

    fn total_energy(&self) -> f64 {
        self.data
            .par_chunks(self.rows.max(1))
            .map(|col| col.iter().map(|&v| v as f64).sum::<f64>())
            .sum()
    }
}

/// Per input channel, the factor `c_k` of the score `|w| * c_k` of `method`.
fn column_factors(name: &str, method: &PruneMethod, cols: usize) -> Result<Vec<f32>> {
    match method {
        PruneMethod::Magnitude => Ok(vec![1.0; cols]),
        PruneMethod::ActivationAware { input_norms } => {
            if input_norms.len() != cols {
                return Err(SlideSparseError::CalibrationMismatch {
                    tensor: name.to_string(),
                    expected: cols,
                    actual: input_norms.len(),
                });
            }
            Ok(input_norms.clone())
        }
        PruneMethod::SparseGpt(calibration) => Ok(obs_column_factors(name, calibration, cols)?
            .into_iter()
            .map(|f| f.sqrt() as f32)
            .collect()),
        PruneMethod::None => Err(SlideSparseError::Unsupported {
            what: format!("{name}: a permutation search"),
            why: "prune method none keeps a weight that is already pruned, so there is no \
                  order to choose: pass the order it was pruned in (ChannelPermutation::Given)"
                .into(),
        }),
    }
}

/// Writes `(w[r, k] * factors[k])^2` of a row-major `[rows, cols]` weight into column `k`,
/// rows `offset..offset + rows`, of the column-major `out` (columns of `stride` rows). Tiles
/// of 64 columns keep both the reads and the writes sequential.
fn transpose_squared(
    weight: &[f32],
    rows: usize,
    factors: &[f32],
    out: &mut [f32],
    (offset, stride): (usize, usize),
) {
    const TILE: usize = 64;
    let cols = factors.len();
    if cols == 0 || stride == 0 {
        return;
    }
    out.par_chunks_mut(TILE * stride)
        .enumerate()
        .for_each(|(t, tile)| {
            let first = t * TILE;
            let width = tile.len() / stride;
            for r in 0..rows {
                let src = &weight[r * cols + first..r * cols + first + width];
                for (i, &w) in src.iter().enumerate() {
                    let s = w * factors[first + i];
                    tile[i * stride + offset + r] = s * s;
                }
            }
        });
}

/// The order being improved, as blocks of `L` channels (`PAD` past `K`).
struct Search<'a> {
    scores: &'a Scores,
    block_len: usize,
    blocks: Vec<Vec<u32>>,
    /// The pruned energy of every block.
    costs: Vec<f64>,
}

impl<'a> Search<'a> {
    /// The identity order.
    fn new(scores: &'a Scores, block_len: usize) -> Self {
        let cols = scores.cols;
        let blocks: Vec<Vec<u32>> = (0..cols.div_ceil(block_len))
            .map(|b| {
                (b * block_len..(b + 1) * block_len)
                    .map(|p| if p < cols { p as u32 } else { PAD })
                    .collect()
            })
            .collect();
        let mut search = Self {
            scores,
            block_len,
            blocks,
            costs: Vec::new(),
        };
        search.recost();
        search
    }

    fn recost(&mut self) {
        let mut scratch = Scratch::new(self.block_len, self.scores.rows);
        self.costs = self
            .blocks
            .iter()
            .map(|b| block_cost(self.scores, b, &mut scratch))
            .collect();
    }

    fn cost(&self) -> f64 {
        self.costs.iter().sum()
    }

    /// Replaces the order by the striped one if that prunes less.
    fn start_striped(&mut self) {
        let mut channels: Vec<u32> = self.blocks.iter().flatten().copied().collect();
        channels.retain(|&c| c != PAD);
        let energy: Vec<f64> = channels
            .par_iter()
            .map(|&c| self.scores.channel_energy(c))
            .collect();
        // Most important first; ties keep the lower channel first (deterministic).
        let mut ranked: Vec<usize> = (0..channels.len()).collect();
        ranked.sort_by(|&a, &b| energy[b].total_cmp(&energy[a]).then(a.cmp(&b)));
        let mut striped = self.blocks.clone();
        let mut next = ranked.iter().map(|&i| channels[i]);
        // Deal slot by slot over all blocks: slot `s` of every block, then slot `s + 1`;
        // padding positions keep their place.
        for s in 0..self.block_len {
            for block in striped.iter_mut() {
                if block[s] != PAD {
                    block[s] = next.next().expect("one channel per real position");
                }
            }
        }
        let (old_blocks, old_costs) = (std::mem::replace(&mut self.blocks, striped), self.cost());
        self.recost();
        if self.cost() >= old_costs {
            self.blocks = old_blocks;
            self.recost();
        }
    }

    /// One round: random disjoint pairs of blocks, each improved by swaps. Returns the gain.
    fn round(&mut self, rng: &mut SplitMix64) -> f64 {
        let mut order: Vec<usize> = (0..self.blocks.len()).collect();
        rng.shuffle(&mut order);
        let pairs: Vec<(usize, usize)> = order.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        let (scores, blocks, l) = (self.scores, &self.blocks, self.block_len);
        let improved: Vec<Option<PairResult>> = pairs
            .par_iter()
            .map_init(
                || Scratch::new(l, scores.rows),
                |scratch, &(a, b)| improve_pair(scores, &blocks[a], &blocks[b], scratch),
            )
            .collect();
        let mut gain = 0.0;
        for (&(a, b), result) in pairs.iter().zip(improved) {
            if let Some(r) = result {
                gain += self.costs[a] + self.costs[b] - r.costs.0 - r.costs.1;
                (self.blocks[a], self.blocks[b]) = r.blocks;
                (self.costs[a], self.costs[b]) = r.costs;
            }
        }
        gain
    }

    /// The order found: position `j` reads channel `order[j]`.
    fn order(&self) -> Vec<u32> {
        self.blocks
            .iter()
            .flatten()
            .copied()
            .filter(|&c| c != PAD)
            .collect()
    }
}

/// Per-row buffers of one pair evaluation: for every position `i` of a block, the two
/// smallest energies of the block without `i` (`low`, `second`: `L * rows` each), for both
/// blocks, and the running two smallest of a block's suffix.
struct Scratch {
    rows: usize,
    low: [Vec<f32>; 2],
    second: [Vec<f32>; 2],
    suffix: (Vec<f32>, Vec<f32>),
}

impl Scratch {
    fn new(block_len: usize, rows: usize) -> Self {
        let buffer = || vec![0.0f32; block_len * rows];
        Self {
            rows,
            low: [buffer(), buffer()],
            second: [buffer(), buffer()],
            suffix: (vec![0.0; rows], vec![0.0; rows]),
        }
    }

    /// Fills side `side`'s buffers for `block`: the two smallest of the positions before `i`
    /// (a forward pass), merged with those of the positions after `i` (a backward pass), so
    /// about `3L` passes over the rows instead of `L (L - 1)`.
    fn exclude_each(&mut self, scores: &Scores, block: &[u32], side: usize) {
        let rows = self.rows;
        let (low, second) = (&mut self.low[side], &mut self.second[side]);
        low[..rows].fill(f32::INFINITY);
        second[..rows].fill(f32::INFINITY);
        for i in 1..block.len() {
            let (done, next) = low.split_at_mut(i * rows);
            next[..rows].copy_from_slice(&done[(i - 1) * rows..]);
            let (done2, next2) = second.split_at_mut(i * rows);
            next2[..rows].copy_from_slice(&done2[(i - 1) * rows..]);
            push_two_smallest(
                &mut next[..rows],
                &mut next2[..rows],
                scores.column(block[i - 1]),
            );
        }
        let (suffix_low, suffix_second) = (&mut self.suffix.0, &mut self.suffix.1);
        suffix_low.fill(f32::INFINITY);
        suffix_second.fill(f32::INFINITY);
        for i in (0..block.len()).rev() {
            let range = i * rows..(i + 1) * rows;
            merge_two_smallest(
                &mut low[range.clone()],
                &mut second[range],
                suffix_low,
                suffix_second,
            );
            push_two_smallest(suffix_low, suffix_second, scores.column(block[i]));
        }
    }

    /// The pruned energy of side `side`'s block with position `i` holding channel `c`.
    fn cost_with(&self, scores: &Scores, side: usize, i: usize, c: u32) -> f64 {
        let range = i * self.rows..(i + 1) * self.rows;
        dropped_sum(
            &self.low[side][range.clone()],
            &self.second[side][range],
            scores.column(c),
        )
    }
}

/// Folds `values` into the running two smallest per row (`low <= second`). Branch-free
/// selects, so that it vectorizes; energies are finite and non-negative.
#[inline]
fn push_two_smallest(low: &mut [f32], second: &mut [f32], values: &[f32]) {
    for ((l, s), &v) in low.iter_mut().zip(second.iter_mut()).zip(values) {
        let high = if *l > v { *l } else { v };
        *s = if *s < high { *s } else { high };
        *l = if *l < v { *l } else { v };
    }
}

/// Merges two per-row pairs of smallest values into the first: the two smallest of the four.
#[inline]
fn merge_two_smallest(
    low: &mut [f32],
    second: &mut [f32],
    other_low: &[f32],
    other_second: &[f32],
) {
    for (((l, s), &ol), &os) in low
        .iter_mut()
        .zip(second.iter_mut())
        .zip(other_low)
        .zip(other_second)
    {
        let high = if *l > ol { *l } else { ol };
        let seconds = if *s < os { *s } else { os };
        *s = if high < seconds { high } else { seconds };
        *l = if *l < ol { *l } else { ol };
    }
}

/// `sum over rows` of the two smallest of `{low, second, v}` (the block's dropped energy once
/// `v` joins the other positions).
fn dropped_sum(low: &[f32], second: &[f32], values: &[f32]) -> f64 {
    // f32 partial sums over short runs (vectorized), f64 across them.
    const RUN: usize = 256;
    let mut total = 0.0f64;
    for ((l, s), v) in low
        .chunks(RUN)
        .zip(second.chunks(RUN))
        .zip(values.chunks(RUN))
    {
        let mut run = 0.0f32;
        for ((&l, &s), &v) in l.iter().zip(s).zip(v) {
            let first = if l < v { l } else { v };
            let high = if l > v { l } else { v };
            run += first + if s < high { s } else { high };
        }
        total += run as f64;
    }
    total
}

/// The pruned energy of one block.
fn block_cost(scores: &Scores, block: &[u32], scratch: &mut Scratch) -> f64 {
    let rows = scores.rows;
    let (low, second) = (&mut scratch.low[0][..rows], &mut scratch.second[0][..rows]);
    low.fill(f32::INFINITY);
    second.fill(f32::INFINITY);
    for &c in &block[1..] {
        push_two_smallest(low, second, scores.column(c));
    }
    dropped_sum(low, second, scores.column(block[0]))
}

/// A pair's improved blocks and their costs.
struct PairResult {
    blocks: (Vec<u32>, Vec<u32>),
    costs: (f64, f64),
}

/// Swaps one channel of `a` with one of `b` while the best such swap lowers the pair's
/// pruned energy (by more than a relative 1e-7, so that rounding cannot make it cycle).
/// `None` if no swap helps.
fn improve_pair(
    scores: &Scores,
    a: &[u32],
    b: &[u32],
    scratch: &mut Scratch,
) -> Option<PairResult> {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    let l = a.len();
    let mut result = None;
    for _ in 0..l * l {
        scratch.exclude_each(scores, &a, 0);
        scratch.exclude_each(scores, &b, 1);
        let current = (
            scratch.cost_with(scores, 0, 0, a[0]),
            scratch.cost_with(scores, 1, 0, b[0]),
        );
        let mut best: Option<(f64, usize, usize, (f64, f64))> = None;
        for i in (0..l).filter(|&i| a[i] != PAD) {
            for j in (0..l).filter(|&j| b[j] != PAD) {
                let costs = (
                    scratch.cost_with(scores, 0, i, b[j]),
                    scratch.cost_with(scores, 1, j, a[i]),
                );
                let total = costs.0 + costs.1;
                if best.is_none_or(|(t, ..)| total < t) {
                    best = Some((total, i, j, costs));
                }
            }
        }
        let threshold = (current.0 + current.1) * (1.0 - 1e-7);
        match best {
            Some((total, i, j, costs)) if total < threshold => {
                std::mem::swap(&mut a[i], &mut b[j]);
                result = Some(costs);
            }
            _ => break,
        }
    }
    result.map(|costs| PairResult {
        blocks: (a, b),
        costs,
    })
}

/// SplitMix64 (Steele, Lea and Flood): the search's seeded, dependency-free generator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher-Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{prune::prune, test_rng::XorShift32};

    fn random_weight(rng: &mut XorShift32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| (rng.next_u32() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// Energy pruned when pruning `weight` with `method` in `order`, by the pruner itself.
    fn pruned_energy(
        weight: &[f32],
        rows: usize,
        cols: usize,
        pattern: SparsityPattern,
        norms: &[f32],
        order: &InputPermutation,
    ) -> f64 {
        let w = order.permute_columns(weight);
        let n = order.permute_vector(norms);
        let method = PruneMethod::ActivationAware {
            input_norms: n.clone(),
        };
        let pruned = prune("t", &w, rows, cols, pattern, &method).unwrap();
        w.iter()
            .zip(&pruned)
            .enumerate()
            .filter(|(_, (_, p))| **p == 0.0)
            .map(|(i, (v, _))| ((v * n[i % cols]) as f64).powi(2))
            .sum()
    }

    /// The search's cost model is the pruner's: for any order, the energy the search says is
    /// pruned is what the Wanda pruner drops (including a partial last block).
    #[test]
    fn reported_fractions_match_the_pruner() {
        let mut rng = XorShift32(0x9E37_79B9);
        for (n, rows, cols) in [(4u32, 7usize, 40usize), (2, 5, 21), (5, 3, 37), (3, 4, 12)] {
            let pattern = SparsityPattern::from_n(n).unwrap();
            let weight = random_weight(&mut rng, rows * cols);
            let norms: Vec<f32> = (0..cols).map(|k| 0.1 + (k % 7) as f32).collect();
            let method = PruneMethod::ActivationAware {
                input_norms: norms.clone(),
            };
            let found = search_permutation(
                "t",
                &[(&weight, rows, &method)],
                cols,
                pattern,
                &PermutationSearch::default(),
            )
            .unwrap();
            let total: f64 = weight
                .iter()
                .enumerate()
                .map(|(i, v)| ((v * norms[i % cols]) as f64).powi(2))
                .sum();
            let identity = InputPermutation::identity(cols);
            for (order, fraction) in [
                (&identity, found.pruned_before),
                (&found.permutation, found.pruned_after),
            ] {
                let actual = pruned_energy(&weight, rows, cols, pattern, &norms, order) / total;
                assert!(
                    (actual - fraction).abs() < 1e-5,
                    "{pattern} {rows}x{cols}: {actual} vs {fraction}"
                );
            }
            assert!(found.pruned_after <= found.pruned_before);
        }
    }

    /// Channels whose importance is a channel factor (the rank-one case): the striped start
    /// alone puts the least important channels two to a block, the optimum.
    #[test]
    fn rank_one_scores_reach_the_optimum() {
        let (rows, cols, pattern) = (6, 32, SparsityPattern::P6_8);
        let norms: Vec<f32> = (0..cols).map(|k| 1.0 + ((k * 13) % cols) as f32).collect();
        let weight = vec![1.0f32; rows * cols];
        let method = PruneMethod::ActivationAware {
            input_norms: norms.clone(),
        };
        let found = search_permutation(
            "t",
            &[(&weight, rows, &method)],
            cols,
            pattern,
            &PermutationSearch::default(),
        )
        .unwrap();
        let mut energies: Vec<f64> = norms.iter().map(|&v| (v as f64).powi(2)).collect();
        energies.sort_by(f64::total_cmp);
        let optimum = energies[..8].iter().sum::<f64>() / energies.iter().sum::<f64>();
        assert!((found.pruned_after - optimum).abs() < 1e-6);
    }

    /// A group's order is scored on every layer of the group, and is deterministic.
    #[test]
    fn groups_are_scored_together_and_deterministically() {
        let mut rng = XorShift32(0x1234_5677);
        let (cols, pattern) = (48, SparsityPattern::P6_8);
        let (q, k) = (
            random_weight(&mut rng, 5 * cols),
            random_weight(&mut rng, 3 * cols),
        );
        let m = PruneMethod::Magnitude;
        let search = |layers: &[(&[f32], usize, &PruneMethod)]| {
            search_permutation("g", layers, cols, pattern, &PermutationSearch::default()).unwrap()
        };
        let group = search(&[(&q, 5, &m), (&k, 3, &m)]);
        let again = search(&[(&q, 5, &m), (&k, 3, &m)]);
        assert_eq!(group.permutation, again.permutation);
        let stacked: Vec<f32> = q.iter().chain(&k).copied().collect();
        let one = search(&[(&stacked, 8, &m)]);
        assert_eq!(group.permutation, one.permutation);
        assert!(group.pruned_after < group.pruned_before);
    }

    /// The prefix/suffix exclusion equals its definition: the two smallest of the block's
    /// other positions, per row (padding positions included).
    #[test]
    fn excluding_each_position_matches_its_definition() {
        let mut rng = XorShift32(0x0BAD_CAFE);
        let (rows, cols) = (9, 21);
        let weight = random_weight(&mut rng, rows * cols);
        let scores = Scores::new("t", &[(&weight, rows, &PruneMethod::Magnitude)], cols).unwrap();
        let mut scratch = Scratch::new(8, rows);
        for block in [
            vec![3u32, 7, 1, 0, 20, 11, 5, 9],
            vec![16, 17, 18, 19, 20, PAD, PAD, PAD],
        ] {
            scratch.exclude_each(&scores, &block, 1);
            for i in 0..block.len() {
                for r in 0..rows {
                    let mut others: Vec<f32> = (0..block.len())
                        .filter(|&j| j != i)
                        .map(|j| scores.column(block[j])[r])
                        .collect();
                    others.sort_by(f32::total_cmp);
                    assert_eq!(scratch.low[1][i * rows + r], others[0], "{i} {r}");
                    assert_eq!(scratch.second[1][i * rows + r], others[1], "{i} {r}");
                }
            }
        }
    }

    #[test]
    fn prune_method_none_is_refused() {
        let err = search_permutation(
            "layer",
            &[(&[1.0; 8], 1, &PruneMethod::None)],
            8,
            SparsityPattern::P6_8,
            &PermutationSearch::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("layer") && err.contains("Given"), "{err}");
    }
}
