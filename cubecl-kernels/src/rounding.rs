//! INT8 and FP8 rounding without a division per element, bit-identical to the spec's division.
//!
//! The spec quantizes `q = clamp(round_half_even(x / s), -127, 127)` (INT8) or
//! `e4m3_rne(clamp(x / s, -448, 448))` (FP8), with `x / s` the f32 division. A true f32
//! division costs a dozen instructions and a branch on the GPU. The divisor is the same for a
//! whole row, so the kernels take its reciprocal `r = fl(1 / s)` once and get the correctly
//! rounded quotient from three operations per element (Markstein's correction step, the
//! classic "division by a divisor known in advance"):
//!
//! - `q0 = fl(x * r)`, within one ulp of `x / s` (`r` is within half an ulp of `1 / s`);
//! - `e = fma(-q0, s, x)`, the remainder `x - s q0`: representable for a quotient within one
//!   ulp, so the FMA (one rounding of the exact value) computes it exactly;
//! - `q = fma(e, r, q0)`, which equals `fl(x / s)` by Markstein's theorem (correction with a
//!   reciprocal within half an ulp and a first quotient within one ulp), as long as nothing
//!   underflows: here `s >= 1e-12 / 448` and every `x` whose code depends on the rounding has
//!   `|x / s| >= 2^-10`, so `e` stays far above the f32 normal range's floor.
//!
//! No branch, no guard band, and the same quotient the spec divides out; the tests below
//! check it against the division bit for bit on every significand of several binades and
//! next to every rounding boundary. INT8 then rounds `q` by adding `1.5 * 2^23` (an f32
//! addition at unit spacing rounds to an integer, half to even, and leaves it as two's
//! complement in the low bits of the sum); no clamp is needed, since `s = fl(absmax / 127)`
//! gives `|x / s| <= 127 (1 + 2^-23)`, which rounds to at most 127. FP8 clamps `q` to ±448
//! and encodes it with [`e4m3_bits`] (integer arithmetic on the f32 bits).

/// Added to an f32 of magnitude below `2^22` it rounds the value to an integer (half to
/// even) held in the low bits of the sum: `1.5 * 2^23`.
pub const ROUNDING_MAGIC: f32 = 12_582_912.0;

/// The bits of [`ROUNDING_MAGIC`]: subtracted from the bits of a sum, the rounded integer.
pub const ROUNDING_MAGIC_BITS: u32 = 0x4B40_0000;

/// `fl(x / scale)` from `inv_scale = fl(1 / scale)` by one multiplication and two FMAs (the
/// module docs say why it is exact). The GPU kernels run the same IEEE operations.
pub fn quotient(x: f32, scale: f32, inv_scale: f32) -> f32 {
    let first = x * inv_scale;
    let remainder = (-first).mul_add(scale, x);
    remainder.mul_add(inv_scale, first)
}

/// Bits of an f32 whose low byte is the INT8 code of `x / scale`, by the kernels' method;
/// `inv_scale` must be `1.0 / scale` rounded to f32.
pub fn int8_code_bits(x: f32, scale: f32, inv_scale: f32) -> u32 {
    (quotient(x, scale, inv_scale) + ROUNDING_MAGIC).to_bits()
}

/// The INT8 code (as an f32) of `x / scale` by the kernels' method ([`int8_code_bits`]).
pub fn int8_code(x: f32, scale: f32, inv_scale: f32) -> f32 {
    f32::from(int8_code_bits(x, scale, inv_scale) as u8 as i8)
}

/// Floor of a token's absmax before it is divided by `QMAX` into the token's scale: keeps the
/// scale of an all-zero token positive (its codes are zero either way). The kernels, the CPU
/// reference path and the tests all use this one value.
pub const ACTIVATION_EPS: f32 = 1e-12;

/// Smallest normal E4M3 magnitude, `2^-6`: below it the quantum is `2^-9`.
pub const FP8_MIN_NORMAL: f32 = 1.0 / 64.0;

/// Largest finite E4M3 magnitude.
pub const FP8_MAX: f32 = 448.0;

/// The f32 quotient the kernels convert to E4M3 for `x / scale`: `clamp(x / scale, -448,
/// 448)`, the division done by [`quotient`].
pub fn fp8_quotient(x: f32, scale: f32, inv_scale: f32) -> f32 {
    quotient(x, scale, inv_scale).clamp(-FP8_MAX, FP8_MAX)
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
    /// where the multiplication alone and the division can disagree: the correction step
    /// must fix them all.
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
        // The test reaches the cases the correction exists for.
        assert!(disagreements_caught > 0);
    }

    fn assert_quotient_is_the_division(x: f32, scale: f32, inv: f32) {
        assert_eq!(
            quotient(x, scale, inv).to_bits(),
            (x / scale).to_bits(),
            "x = {x:e}, scale = {scale:e}"
        );
    }

    /// [`quotient`] is the f32 division bit for bit on every significand of `x` in the
    /// binades where INT8 and FP8 codes are decided (quotients in `[2^-10, 512)`), for scales
    /// with the extreme significands (1.0 and all ones, where `fl(1 / s)` is least and most
    /// accurate) and random ones, across the exponent range the kernels see.
    #[test]
    fn quotient_is_the_division_on_every_significand() {
        let mut rng = Xorshift(0x2545_F491_4F6C_DD1D);
        let mut scales = vec![
            1.0f32,
            f32::from_bits(0x3FFF_FFFF),
            1e-12 / 448.0,
            1e-12 / 127.0,
        ];
        scales.extend((0..4).map(|_| random_scale(&mut rng).1));
        for scale in scales {
            let inv = 1.0 / scale;
            // Quotient binades 2^-10 (FP8's smallest midpoint) .. 2^8 (above 448).
            for binade in [-10i32, -7, 0, 6, 8] {
                let low = (scale * 2f32.powi(binade)).to_bits();
                for bits in (low & !0x7F_FFFF)..=(low | 0x7F_FFFF) {
                    assert_quotient_is_the_division(f32::from_bits(bits), scale, inv);
                }
            }
        }
    }

    /// [`quotient`] is the division for every significand of the scale, at the inputs next to
    /// half-integer quotients (INT8 rounding boundaries) and at random inputs of the row.
    #[test]
    fn quotient_is_the_division_for_every_scale_significand() {
        let mut rng = Xorshift(0x9E37_79B9_7F4A_7C15);
        for significand in 0..=0x7F_FFFFu32 {
            let scale = f32::from_bits(0x3C00_0000 | significand);
            let inv = 1.0 / scale;
            let j = (rng.next() % 127) as f32 + 0.5;
            let center = (j * scale).to_bits();
            let random = ((2.0 * rng.unit() - 1.0) * 127.0 * scale).to_bits();
            for bits in [center - 1, center, center + 1, random] {
                assert_quotient_is_the_division(f32::from_bits(bits), scale, inv);
            }
        }
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
