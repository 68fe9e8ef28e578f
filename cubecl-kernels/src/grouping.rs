//! How the grouped quant+lift kernel cuts a row: groups of four pattern blocks, whose lifted
//! outputs are whole 16-code vectors, and how many groups each unit of a cube holds. Pure
//! Rust (no CubeCL), so the host launcher and the CPU tests share it with the kernel.

use crate::geometry::lift_source_unbounded;

/// Input elements of one group: four pattern blocks (`8n`), or 16 for the dense baseline
/// (`n == 0`).
pub fn group_input_len(n: u32) -> usize {
    if n == 0 { 16 } else { 8 * n as usize }
}

/// Output codes of one group: four blocks' `4(n-1)` windows each, or 16 for `n == 0`.
/// Always a multiple of 16, so groups start on 16-code output vectors.
pub fn group_output_len(n: u32) -> usize {
    if n == 0 { 16 } else { 16 * (n as usize - 1) }
}

/// Column of the group's input that the group's output column `o` copies: the lift map
/// restricted to one group (groups start on block boundaries), the identity for `n == 0`.
pub fn group_source(o: usize, n: u32) -> usize {
    if n == 0 {
        o
    } else {
        lift_source_unbounded(o, n as usize)
    }
}

/// Input vectors a unit of the grouped kernel may hold in registers (16 bytes each).
pub const MAX_HELD_VECTORS: usize = 16;

/// Most units a cube of the grouped kernel's default layout has: larger cubes of this
/// register-heavy kernel fit once per SM (measured on the H200: K = 14336 without lift in
/// cubes of 896 units 0.47 ms, of 512 units two groups each 0.31 ms; K = 18944 with the 6:8
/// lift in cubes of 608 units 0.67 ms, of 256 units three groups each 0.53 ms).
pub const MAX_UNITS: usize = 512;

/// Cube size of the dense baseline's quantization (`n == 0`) where its row fills it and fits
/// the register budget. Its groups are only 16 elements, so the general rule's "as few
/// groups per unit as possible" leaves each unit too little work: measured on the H200
/// (bf16 rows, M = 16384, `slidesparse-bench quant --patterns dense --units ...`, every
/// layout byte-checked against the row-staged kernel), INT8 K = 3584 / 4096 / 14336 in
/// cubes of 128 units 0.066 / 0.073 / 0.181 ms against 0.085 / 0.088 / 0.245 ms (224, 256
/// and 448 units), FP8 0.098 / 0.099 / 0.281 against 0.112 / 0.120 / 0.376 ms. K = 18944
/// needs more registers than 128 units hold and keeps the general rule (0.285 ms, the
/// fastest measured).
pub const DENSE_UNITS: u32 = 128;

/// Cube size (units) and groups per unit for rows of `k` elements of `elem_bytes`, or `None`
/// where the row is not whole 16-byte vectors or would need more registers than
/// [`MAX_HELD_VECTORS`] per unit in a cube of [`MAX_UNITS`] (then the row-staged kernel runs).
///
/// The dense baseline's long rows take [`DENSE_UNITS`]. Otherwise, as few groups per unit as
/// cubes of at most [`MAX_UNITS`] allow, in a cube of whole warps just large enough:
/// measured on the H200 (`slidesparse-bench quant`), a unit handles its groups one after
/// the other, so fewer groups per unit are faster as long as the cubes still fit several
/// times per SM (for the lifted rows, whose groups are 24-40 elements).
pub fn grouped_layout(k: usize, n: u32, elem_bytes: usize) -> Option<(u32, usize)> {
    if n == 0
        && k >= DENSE_UNITS as usize * group_input_len(0)
        && let Some(per_unit) = grouped_layout_with_units(k, 0, elem_bytes, DENSE_UNITS)
    {
        return Some((DENSE_UNITS, per_unit));
    }
    let vector = 16 / elem_bytes;
    let in_len = group_input_len(n);
    if !k.is_multiple_of(vector) || !in_len.is_multiple_of(vector) {
        return None;
    }
    let groups = k.div_ceil(in_len);
    let per_unit = groups.div_ceil(MAX_UNITS);
    let units = groups.div_ceil(per_unit).next_multiple_of(32);
    (per_unit * in_len / vector <= MAX_HELD_VECTORS).then_some((units as u32, per_unit))
}

/// Groups per unit for rows of `k` elements in cubes of `units` units (a power of two from 32
/// to 1024), or `None` where the row is not whole 16-byte vectors or needs more than
/// [`MAX_HELD_VECTORS`] per unit: a layout other than [`grouped_layout`]'s, for benchmarks.
pub fn grouped_layout_with_units(k: usize, n: u32, elem_bytes: usize, units: u32) -> Option<usize> {
    let vector = 16 / elem_bytes;
    let in_len = group_input_len(n);
    if !units.is_power_of_two()
        || !(32..=MAX_UNITS as u32).contains(&units)
        || !k.is_multiple_of(vector)
        || !in_len.is_multiple_of(vector)
    {
        return None;
    }
    let per_unit = k.div_ceil(in_len).div_ceil(units as usize);
    (per_unit * in_len / vector <= MAX_HELD_VECTORS).then_some(per_unit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{MAX_N, MIN_N};

    /// Group `g`'s output `o` is the row's output `g * out + o`, and its source is the row's
    /// source: the kernel's per-group compile-time map equals the spec's lift map.
    #[test]
    fn group_map_is_the_lift_map_shifted_by_whole_groups() {
        for n in MIN_N..=MAX_N {
            let (input, output) = (group_input_len(n), group_output_len(n));
            assert_eq!(output % 16, 0);
            for g in 0..6 {
                for o in 0..output {
                    assert_eq!(
                        g * input + group_source(o, n),
                        lift_source_unbounded(g * output + o, n as usize),
                        "n = {n}, group {g}, output {o}"
                    );
                }
            }
        }
        assert!((0..16).all(|o| group_source(o, 0) == o));
    }

    #[test]
    fn layouts_cover_the_row_within_the_register_budget() {
        for n in [0].into_iter().chain(MIN_N..=MAX_N) {
            for elem_bytes in [2usize, 4] {
                for k in (8..=70_000).step_by(8).chain([131_072, 200_000]) {
                    let Some((units, per_unit)) = grouped_layout(k, n, elem_bytes) else {
                        continue;
                    };
                    let in_vectors = group_input_len(n) * elem_bytes / 16;
                    assert!(units.is_multiple_of(32) && (32..=MAX_UNITS as u32).contains(&units));
                    assert!(
                        units as usize * per_unit * group_input_len(n) >= k,
                        "k = {k}"
                    );
                    assert!(per_unit * in_vectors <= MAX_HELD_VECTORS);
                }
            }
        }
        // The shapes of the benchmark models take the grouped kernel, f32 and bf16 rows.
        for k in [3584, 4096, 14_336, 18_944] {
            for n in [0, 2, 3, 4, 5] {
                assert!(grouped_layout(k, n, 2).is_some(), "bf16 k = {k}, n = {n}");
            }
        }
        assert_eq!(grouped_layout_with_units(4096, 4, 2, 128), Some(1));
        assert_eq!(grouped_layout_with_units(14_336, 4, 2, 128), Some(4));
        assert_eq!(
            grouped_layout_with_units(14_336, 4, 2, 64),
            None,
            "32 vectors per unit"
        );
        assert_eq!(
            grouped_layout_with_units(4096, 4, 2, 96),
            None,
            "not a power of two"
        );
        // One group per unit, whole warps: 6:8 bf16 rows have K / 32 groups.
        assert_eq!(grouped_layout(4096, 4, 2), Some((128, 1)));
        assert_eq!(grouped_layout(14_336, 4, 2), Some((448, 1)));
        assert_eq!(grouped_layout(18_944, 4, 2), Some((320, 2)));
        // The dense baseline: 128 units where the row fills them and fits.
        assert_eq!(grouped_layout(3584, 0, 2), Some((128, 2)));
        assert_eq!(grouped_layout(4096, 0, 2), Some((128, 2)));
        assert_eq!(grouped_layout(14_336, 0, 2), Some((128, 7)));
        assert_eq!(
            grouped_layout(18_944, 0, 2),
            Some((416, 3)),
            "20 vectors in 128"
        );
        assert_eq!(
            grouped_layout(1024, 0, 2),
            Some((64, 1)),
            "short rows: general rule"
        );
        assert_eq!(
            grouped_layout(4098, 4, 2),
            None,
            "not whole 16-byte vectors"
        );
    }
}
