//! Index math shared by the packer, the reference path and the GPU kernels.
//!
//! A `(2N-2):2N` pattern is covered by `N-1` overlapping 2:4 windows of stride 2 per block of
//! `L = 2N` weights. Lifting maps every output column `o` of the slid (`K'`-wide) row back to
//! the source column it copies; weights and activations use the same map, which is what makes
//! `W' . X'^T == W . X^T` exact.

/// Smallest and largest `N` of a `(2N-2):2N` pattern this crate supports.
pub const MIN_N: u32 = 2;
/// See [`MIN_N`].
pub const MAX_N: u32 = 16;

/// Size of one 2:4 window.
pub const WINDOW: usize = 4;
/// Distance between the starts of neighbouring windows.
pub const STRIDE: usize = 2;

/// Everything derived from (pattern, K, alignment). All sizes are in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlideGeometry {
    /// The pattern's `N`: blocks of `2N` with at most `2N-2` nonzeros.
    pub n: u32,
    /// Original input width.
    pub k: usize,
    /// Column alignment of the slid width `K'`.
    pub alignment: usize,
}

impl SlideGeometry {
    /// Geometry of a layer of input width `k`. `n` must lie in [`MIN_N`]..=[`MAX_N`] and
    /// `alignment` must be a power of two: both are checked by the pattern type upstream, and
    /// re-checked here in debug builds.
    pub fn new(n: u32, k: usize, alignment: usize) -> Self {
        debug_assert!((MIN_N..=MAX_N).contains(&n));
        debug_assert!(alignment.is_power_of_two());
        Self { n, k, alignment }
    }

    /// Block length `L = 2N`.
    pub fn block_len(&self) -> usize {
        2 * self.n as usize
    }

    /// Windows per block, `N - 1`.
    pub fn windows_per_block(&self) -> usize {
        self.n as usize - 1
    }

    /// Slid columns produced by one block, `4(N-1)`.
    pub fn slid_block_len(&self) -> usize {
        WINDOW * self.windows_per_block()
    }

    /// Number of blocks, counting the zero-padded last one.
    pub fn blocks(&self) -> usize {
        self.k.div_ceil(self.block_len())
    }

    /// `K_pad = ceil(K / L) * L`.
    pub fn k_pad(&self) -> usize {
        self.blocks() * self.block_len()
    }

    /// `K_slide = (K_pad / L) * 4(N-1)`.
    pub fn k_slide(&self) -> usize {
        self.blocks() * self.slid_block_len()
    }

    /// `K' = round_up(K_slide, alignment)`: the width of `W'` and `X'`.
    pub fn k_prime(&self) -> usize {
        self.k_slide().next_multiple_of(self.alignment)
    }

    /// The expansion factor `gamma = (2N-2)/N` as a float, for reports.
    pub fn gamma(&self) -> f64 {
        (2.0 * self.n as f64 - 2.0) / self.n as f64
    }

    /// Source column of slid column `o`, or `None` where `X'[o]` is padding (zero).
    pub fn source(&self, o: usize) -> Option<usize> {
        if o >= self.k_slide() {
            return None;
        }
        let src = lift_source_unbounded(o, self.n as usize);
        (src < self.k).then_some(src)
    }

    /// The whole lift map: `map[o] = source(o)`, with `k` standing for "zero" so that it can
    /// index a row extended by one zero column (what the reference path's gather does).
    pub fn lift_map_with_zero_column(&self) -> Vec<usize> {
        (0..self.k_prime())
            .map(|o| self.source(o).unwrap_or(self.k))
            .collect()
    }
}

/// `src(o) = g*L + 2w + l` with `g = o / 4(N-1)`, `r = o % 4(N-1)`, `w = r / 4`, `l = r % 4`,
/// ignoring the `K` and `K_slide` bounds (callers check those).
#[inline]
pub fn lift_source_unbounded(o: usize, n: usize) -> usize {
    let slid_block = WINDOW * (n - 1);
    let g = o / slid_block;
    let r = o % slid_block;
    let w = r / WINDOW;
    let l = r % WINDOW;
    g * 2 * n + STRIDE * w + l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn six_eight_one_block_matches_the_spec_example() {
        let g = SlideGeometry::new(4, 8, 64);
        let map: Vec<_> = (0..12).map(|o| g.source(o).unwrap()).collect();
        assert_eq!(map, [0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7]);
        assert_eq!(g.k_slide(), 12);
        assert_eq!(g.k_prime(), 64);
        assert_eq!(g.source(12), None);
    }

    #[test]
    fn sizes_follow_the_spec_formulas() {
        for n in MIN_N..=MAX_N {
            for k in [1usize, 7, 8, 576, 1000, 4096] {
                for a in [16usize, 32, 64, 128, 256] {
                    let g = SlideGeometry::new(n, k, a);
                    let l = 2 * n as usize;
                    assert_eq!(g.k_pad(), k.div_ceil(l) * l);
                    assert_eq!(g.k_slide(), g.k_pad() / l * 4 * (n as usize - 1));
                    assert_eq!(g.k_prime() % a, 0);
                    assert!(g.k_prime() >= g.k_slide() && g.k_prime() < g.k_slide() + a);
                }
            }
        }
    }

    #[test]
    fn two_four_lift_is_the_identity_up_to_k() {
        let g = SlideGeometry::new(2, 100, 32);
        for o in 0..g.k_prime() {
            assert_eq!(g.source(o), (o < 100).then_some(o));
        }
    }

    #[test]
    fn every_source_column_is_covered() {
        for n in MIN_N..=8 {
            let g = SlideGeometry::new(n, 37, 16);
            let mut seen = vec![false; g.k];
            for o in 0..g.k_prime() {
                if let Some(s) = g.source(o) {
                    seen[s] = true;
                }
            }
            assert!(seen.iter().all(|&s| s), "n = {n}");
        }
    }
}
