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

/// Cube size (units) and groups per unit for rows of `k` elements of `elem_bytes`, or `None`
/// where the row is not whole 16-byte vectors or would need more registers than
/// [`MAX_HELD_VECTORS`] in a cube of 1024 units (then the row-staged kernel runs).
///
/// Cubes are as small as the row allows (one group per unit up to 256 units), so that short
/// rows still fill the GPU with many small cubes; longer rows give each unit several groups.
pub fn grouped_layout(k: usize, n: u32, elem_bytes: usize) -> Option<(u32, usize)> {
    let vector = 16 / elem_bytes;
    let in_len = group_input_len(n);
    if !k.is_multiple_of(vector) || !in_len.is_multiple_of(vector) {
        return None;
    }
    let in_vectors = in_len / vector;
    let groups = k.div_ceil(in_len);
    let mut units = groups.next_power_of_two().clamp(32, 256);
    if groups.div_ceil(units) * in_vectors > MAX_HELD_VECTORS {
        units = (groups * in_vectors)
            .div_ceil(MAX_HELD_VECTORS)
            .next_power_of_two()
            .min(1024);
    }
    let per_unit = groups.div_ceil(units);
    (per_unit * in_vectors <= MAX_HELD_VECTORS).then_some((units as u32, per_unit))
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
                    assert!(units.is_power_of_two() && (32..=1024).contains(&units));
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
        assert_eq!(
            grouped_layout(4098, 4, 2),
            None,
            "not whole 16-byte vectors"
        );
    }
}
