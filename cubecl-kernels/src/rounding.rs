//! INT8 and FP8 rounding without a division per element, bit-identical to the spec's division.
//!
//! The spec quantizes `q = clamp(round_half_even(x / s), -127, 127)`. A true f32 division
//! costs a dozen instructions on the GPU; the kernels multiply by `r = fl(1 / s)` instead and
//! fall back to the division only where that could change the code:
//!
//! - `y = fl(x * r) = (x / s)(1 + e1)(1 + e2)` and `d = fl(x / s) = (x / s)(1 + e3)` with
//!   `|e_i| <= 2^-24`, so `|y - d| <= 3 * 2^-24 * |x / s|` (to first order). An INT8 row has
//!   `|x / s| <= 127 (1 + 2^-23)` (`s = fl(absmax / 127)`), so `|y - d| < 2.3e-5`.
//! - `round_half_even` is constant between half-integers, so `y` and `d` round alike unless a
//!   half-integer `h` lies between them, and then `|y - h| <= |y - d| < 2.3e-5`.
//! - The kernels round `y` by `t = y + 1.5 * 2^23` (an f32 addition at unit spacing rounds
//!   to an integer, half to even, and leaves it as two's complement in the low bits of `t`)
//!   and measure `e = y - (t - 1.5 * 2^23)`, both exact for `|y| < 2^22`. `|e| <= 1/2`, and
//!   `y` lies within `g` of a half-integer exactly when `|e| > 1/2 - g`; those take the
//!   division. With `g = 2^-15` every `y` next to a half-integer is caught. (NVRTC may fuse
//!   `x * r + 1.5 * 2^23` into one FMA, which rounds the exact product instead of `y`; the two
//!   differ only across a half-integer within an ulp of `y`, where `|e|` is near 1/2 and the
//!   division is taken either way.)
//!
//! No clamp is needed: `s = fl(absmax / 127)`, so `|x / s| <= 127 (1 + 2^-23)` and the
//! quotients round to at most 127. The guard fires for about 6e-5 of the elements (the width
//! of the band), so the division is rare.

/// Added to an f32 of magnitude below `2^22` it rounds the value to an integer (half to
/// even) held in the low bits of the sum: `1.5 * 2^23`.
pub const ROUNDING_MAGIC: f32 = 12_582_912.0;

/// The bits of [`ROUNDING_MAGIC`]: subtracted from the bits of a sum, the rounded integer.
pub const ROUNDING_MAGIC_BITS: u32 = 0x4B40_0000;

/// `|frac(|y|) - 1/2|` below which [`int8_code`] recomputes `x / s` by true division: 2^-15,
/// above the 2.3e-5 bound of the module docs.
pub const HALF_INTEGER_GUARD: f32 = 1.0 / 32768.0;

/// Bits of an f32 whose low byte is the INT8 code of `x / scale`, by the kernels' method;
/// `inv_scale` must be `1.0 / scale` rounded to f32. The GPU kernels run the same IEEE
/// operations.
pub fn int8_code_bits(x: f32, scale: f32, inv_scale: f32) -> u32 {
    let y = x * inv_scale;
    let t = y + ROUNDING_MAGIC;
    let d = y - (t - ROUNDING_MAGIC);
    if d.abs() > 0.5 - HALF_INTEGER_GUARD {
        (x / scale + ROUNDING_MAGIC).to_bits()
    } else {
        t.to_bits()
    }
}

/// The INT8 code (as an f32) of `x / scale` by the kernels' method ([`int8_code_bits`]).
pub fn int8_code(x: f32, scale: f32, inv_scale: f32) -> f32 {
    f32::from(int8_code_bits(x, scale, inv_scale) as u8 as i8)
}

/// FP8 (E4M3) the same way. The spec's code is `e4m3_rne(clamp(x / s, -448, 448))`; the
/// kernels compute `y = clamp(fl(x * r), -448, 448)` and take the division only where `y`
/// may lie on the other side of an E4M3 rounding midpoint than the true quotient:
///
/// - as above, `|y - d| <= 3 * 2^-24 * |x / s|` to first order (`|x / s| <= 448 (1 + 2^-23)`).
/// - E4M3 rounds `|y|` to a multiple of its binade's quantum `2^(e - 3)` (`e = floor(log2
///   |y|)`, at least -6: below `2^-6` the subnormal quantum `2^-9`). Midpoints are odd
///   multiples of half a quantum; there is none within a quantum of a power of two, so `y`
///   and `d` straddle a midpoint only when both lie in the binade holding it.
/// - Normal binades (`|y| >= 2^-6`): `|y - d| < 3 * 2^-24 * 2^(e + 1) = 3 * 2^(e - 23)`, three
///   units in the last place of `y`'s f32 significand. A midpoint's significand has low 20
///   bits (those below E4M3's three) equal to `0x80000`; the kernels divide when `y`'s low 20
///   bits are within [`FP8_MIDPOINT_GUARD`] units of it.
/// - Subnormal binade (`|y| < 2^-6`): `t = 512 |y|` (exact) counts quanta, and `|y - d|` is
///   below `3 * 2^-30` = `3 * 2^-21` quanta; the INT8 test `|frac(t) - 1/2| < 2^-15` applies.
///
/// Values beyond ±448 clamp to 448 in both (448 itself is far from a midpoint).
pub const FP8_MIDPOINT_GUARD: u32 = 16;

/// Smallest normal E4M3 magnitude, `2^-6`: below it the quantum is `2^-9`.
pub const FP8_MIN_NORMAL: f32 = 1.0 / 64.0;

/// Largest finite E4M3 magnitude.
pub const FP8_MAX: f32 = 448.0;

/// Whether `a = |y|` (at most 448) lies within the guard of an E4M3 rounding midpoint.
pub fn near_fp8_midpoint(a: f32) -> bool {
    if a < FP8_MIN_NORMAL {
        let t = a * 512.0;
        (t - t.floor() - 0.5).abs() < HALF_INTEGER_GUARD
    } else {
        let low = (a.to_bits() & 0xF_FFFF) as i32;
        (low - 0x8_0000).unsigned_abs() <= FP8_MIDPOINT_GUARD
    }
}

/// The f32 quotient the kernels convert to E4M3 for `x / scale`: `clamp(x * inv_scale)`
/// away from rounding midpoints, `clamp(x / scale)` near them (`inv_scale = fl(1 / scale)`).
/// Its E4M3 rounding equals that of `clamp(x / scale, -448, 448)`.
pub fn fp8_quotient(x: f32, scale: f32, inv_scale: f32) -> f32 {
    let y = (x * inv_scale).clamp(-FP8_MAX, FP8_MAX);
    if near_fp8_midpoint(y.abs()) {
        (x / scale).clamp(-FP8_MAX, FP8_MAX)
    } else {
        y
    }
}

/// `(127 - 7) << 3`: moves an f32 exponent field (bias 127), shifted down by the 20 dropped
/// significand bits, to E4M3's (bias 7).
pub const E4M3_REBIAS: u32 = 120 << 3;

/// E4M3 code (in the low byte) of `y`, `|y| <= 448` after a clamp, rounded to nearest even,
/// by integer arithmetic on the f32 bits as the kernels do it: normal values drop 20
/// significand bits with round-half-even (a carry moves into the exponent, as it should) and
/// rebias the exponent; values below `2^-6` count quanta of `2^-9` through
/// [`ROUNDING_MAGIC`] (8 quanta is `2^-6`, code `0x08`, as it should be).
pub fn e4m3_bits(y: f32) -> u32 {
    let a = y.abs().min(FP8_MAX);
    let bits = a.to_bits();
    let normal = ((bits + 0x7_FFFF + ((bits >> 20) & 1)) >> 20).wrapping_sub(E4M3_REBIAS);
    let subnormal = (a * 512.0 + ROUNDING_MAGIC).to_bits() - ROUNDING_MAGIC_BITS;
    let code = if a < FP8_MIN_NORMAL {
        subnormal
    } else {
        normal
    };
    code | ((y.to_bits() >> 24) & 0x80)
}

/// The FP8 code of `x / scale` by the kernels' method.
pub fn fp8_code(x: f32, scale: f32, inv_scale: f32) -> u8 {
    e4m3_bits(fp8_quotient(x, scale, inv_scale)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's code: true division, round half to even, clamp.
    fn by_division(x: f32, scale: f32) -> f32 {
        (x / scale).round_ties_even().clamp(-127.0, 127.0)
    }

    /// Small deterministic generator (xorshift64*), so the test needs no dependency.
    struct Xorshift(u64);

    impl Xorshift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Scales as the kernels compute them: `max(absmax, 1e-12) / 127` for absmax over many
    /// binades, including the floor.
    fn random_scale(rng: &mut Xorshift) -> (f32, f32) {
        let exponent = (rng.next() % 80) as i32 - 50;
        let absmax = (1.0 + rng.unit()) * 2f32.powi(exponent);
        let absmax = absmax.max(1e-12);
        (absmax, absmax / 127.0)
    }

    #[test]
    fn equals_the_division_on_random_values_of_a_row() {
        let mut rng = Xorshift(0x9E37_79B9_7F4A_7C15);
        for _ in 0..2_000 {
            let (absmax, scale) = random_scale(&mut rng);
            let inv = 1.0 / scale;
            for _ in 0..2_000 {
                let x = (2.0 * rng.unit() - 1.0) * absmax;
                assert_eq!(
                    // Equal codes (-0.0 == 0.0: both are INT8 zero).
                    int8_code(x, scale, inv),
                    by_division(x, scale),
                    "x = {x:e}, scale = {scale:e}"
                );
            }
            assert_eq!(int8_code(absmax, scale, inv), by_division(absmax, scale));
            assert_eq!(int8_code(-absmax, scale, inv), by_division(-absmax, scale));
        }
    }

    /// Every value within a few hundred ulps of each half-integer quotient `(j + 1/2) s`,
    /// where the multiplication and the division can disagree: the guard must catch them all.
    #[test]
    fn equals_the_division_next_to_every_rounding_boundary() {
        let mut rng = Xorshift(0xD1B5_4A32_D192_ED03);
        let mut disagreements_caught = 0usize;
        for _ in 0..300 {
            let (_, scale) = random_scale(&mut rng);
            let inv = 1.0 / scale;
            // Half-integer quotients a row can hold (|x / s| <= 127 (1 + 2^-23), module docs).
            for j in -127i32..127 {
                let center = (j as f32 + 0.5) * scale;
                let mut x = center;
                for _ in 0..200 {
                    x = f32::from_bits(x.to_bits() - 1);
                }
                for _ in 0..400 {
                    let naive = (x * inv).round_ties_even().clamp(-127.0, 127.0);
                    let exact = by_division(x, scale);
                    disagreements_caught += usize::from(naive != exact);
                    assert_eq!(
                        int8_code(x, scale, inv),
                        exact,
                        "x = {x:e}, scale = {scale:e}"
                    );
                    x = f32::from_bits(x.to_bits() + 1);
                }
            }
        }
        // The test reaches the cases the guard exists for.
        assert!(disagreements_caught > 0);
    }

    #[test]
    fn signed_zero_and_exact_halves() {
        for (x, scale) in [
            (2.5f32, 1.0f32),
            (-2.5, 1.0),
            (3.5, 1.0),
            (-0.0, 1.0),
            (0.5, 1.0),
        ] {
            assert_eq!(int8_code(x, scale, 1.0 / scale), by_division(x, scale));
        }
    }
}
