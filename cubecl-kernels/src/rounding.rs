//! INT8 rounding without a division per element, bit-identical to the spec's division.
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
//! - `frac(|y|) = |y| - floor(|y|)` and `frac - 0.5` are exact in f32 (Sterbenz), so the test
//!   `|frac(|y|) - 0.5| < 2^-15` catches every such `y`; those take the division.
//!
//! Values beyond the INT8 range both clamp to ±127. The guard fires for about 6e-5 of the
//! elements (the width of the band), so the division is rare.

/// `|frac(|y|) - 1/2|` below which [`int8_code`] recomputes `x / s` by true division: 2^-15,
/// above the 2.3e-5 bound of the module docs.
pub const HALF_INTEGER_GUARD: f32 = 1.0 / 32768.0;

/// The INT8 code (as an f32) of `x / scale` by the kernels' method; `inv_scale` must be
/// `1.0 / scale` rounded to f32. The GPU kernels run the same IEEE operations.
pub fn int8_code(x: f32, scale: f32, inv_scale: f32) -> f32 {
    let mut y = x * inv_scale;
    let a = y.abs();
    if (a - a.floor() - 0.5).abs() < HALF_INTEGER_GUARD {
        y = x / scale;
    }
    y.round_ties_even().clamp(-127.0, 127.0)
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
                    int8_code(x, scale, inv).to_bits(),
                    by_division(x, scale).to_bits(),
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
            for j in -128i32..128 {
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
                        int8_code(x, scale, inv).to_bits(),
                        exact.to_bits(),
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
