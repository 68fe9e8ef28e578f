//! FP8 E4M3 ("fn" variant, as on NVIDIA GPUs): 1 sign, 4 exponent (bias 7), 3 mantissa bits,
//! no infinities, NaN = `S.1111.111`, largest finite 448.
//!
//! Encoding rounds to nearest, ties to even, and saturates finite overflow (and ±Inf) to ±448,
//! like CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`. NaN encodes to `0x7F`
//! (with its sign bit).

/// Largest finite E4M3 value (defined once, next to the kernels' encoder).
pub use cubecl_kernels::rounding::FP8_MAX as E4M3_MAX;
/// Canonical positive NaN code.
pub const E4M3_NAN: u8 = 0x7F;
const MIN_NORMAL_EXP: i32 = -6;
const MANTISSA_BITS: i32 = 3;
const EXP_BIAS: i32 = 7;

/// Decodes one E4M3 code to f32 (exact: every E4M3 value is an f32).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0x0F) as i32;
    let mant = (code & 0x07) as f32;
    if exp == 0x0F && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        mant * 2f32.powi(MIN_NORMAL_EXP - MANTISSA_BITS)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - EXP_BIAS)
    };
    sign * magnitude
}

/// Encodes an f32 to E4M3: round to nearest even, saturating to ±448.
///
/// The encoding is the kernels' own ([`cubecl_kernels::rounding::e4m3_bits`], the host mirror
/// of their integer encoder), so host-packed weights and GPU-quantized activations cannot
/// drift apart; only NaN, which the kernels never see after their clamp, is handled here.
/// The tests check it against the format's definition.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        let sign = if x.is_sign_negative() { 0x80 } else { 0x00 };
        return sign | E4M3_NAN;
    }
    // The low byte is the code (`e4m3_bits` saturates ±Inf and overflow to ±448).
    cubecl_kernels::rounding::e4m3_bits(x) as u8
}

/// Rounds an f32 to the nearest E4M3 value (encode then decode).
pub fn round_to_e4m3(x: f32) -> f32 {
    e4m3_to_f32(f32_to_e4m3(x))
}

/// Decode table of all 256 codes, for gathers in the reference path.
pub fn e4m3_decode_table() -> [f32; 256] {
    std::array::from_fn(|c| e4m3_to_f32(c as u8))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3 encoding by the format's definition (independent of the integer encoder above):
    /// pick the binade's quantum, round the scaled value half to even, saturate.
    fn by_definition(x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0x00 };
        if x.is_nan() {
            return sign | E4M3_NAN;
        }
        let a = x.abs();
        if a >= E4M3_MAX {
            return sign | 0x7E;
        }
        // Exponent of `a` (floor(log2 a)), read from the bits: exact, unlike log2().
        let exp = if a == 0.0 {
            MIN_NORMAL_EXP
        } else {
            ((a.to_bits() >> 23) as i32 - 127).max(MIN_NORMAL_EXP)
        };
        // Quantum of the binade holding `a` (the subnormal quantum below 2^-6). Scaling by a
        // power of two is exact, so one f32 rounding gives the correctly rounded significand.
        let quantum = 2f32.powi(exp - MANTISSA_BITS);
        let q = (a / quantum).round_ties_even() as u32; // 0..=16
        let (exp, q) = if q == 16 { (exp + 1, 8) } else { (exp, q) };
        let code = if q < 8 {
            q // subnormal (exp == -6 and no hidden bit)
        } else {
            (((exp + EXP_BIAS) as u32) << 3) | (q - 8)
        };
        sign | code as u8
    }

    /// Independent value table: the 127 positive finite E4M3 values in increasing order,
    /// built from the format definition (subnormals m/8 * 2^-6, normals (1+m/8) * 2^(e-7)).
    fn positive_values() -> Vec<f32> {
        let mut v: Vec<f32> = (0..8).map(|m| m as f32 / 8.0 / 64.0).collect();
        for e in 1..=15 {
            for m in 0..8 {
                if e == 15 && m == 7 {
                    continue;
                }
                v.push((1.0 + m as f32 / 8.0) * (2.0f32).powi(e - 7));
            }
        }
        v
    }

    #[test]
    fn known_codes() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn decode_matches_the_value_table_and_encode_inverts_it() {
        let table = positive_values();
        for (code, &v) in table.iter().enumerate() {
            assert_eq!(e4m3_to_f32(code as u8), v, "code {code:#x}");
            assert_eq!(e4m3_to_f32(code as u8 | 0x80), -v);
            assert_eq!(f32_to_e4m3(v), code as u8);
            if v != 0.0 {
                assert_eq!(f32_to_e4m3(-v), code as u8 | 0x80);
            }
        }
    }

    #[test]
    fn rounds_to_nearest_ties_to_even_between_every_pair() {
        let table = positive_values();
        for code in 0..table.len() - 1 {
            let (lo, hi) = (table[code], table[code + 1]);
            let mid = (lo + hi) / 2.0; // exact in f32
            let even = if code % 2 == 0 { code } else { code + 1 };
            assert_eq!(f32_to_e4m3(mid) as usize, even, "tie between {lo} and {hi}");
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_e4m3(below) as usize, code);
            assert_eq!(f32_to_e4m3(above) as usize, code + 1);
        }
    }

    #[test]
    fn saturates_and_keeps_nan() {
        for x in [448.0f32, 449.0, 464.0, 500.0, 1e30, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(x), 0x7E, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xFE);
        }
        assert_eq!(f32_to_e4m3(f32::NAN), E4M3_NAN);
        assert_eq!(f32_to_e4m3(-f32::NAN), 0x80 | E4M3_NAN);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // Below half the smallest subnormal rounds to zero; exactly half ties to even (zero).
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3(2f32.powi(-10) * 1.01), 0x01);
    }

    /// The kernels' FP8 codes (`cubecl_kernels::rounding::fp8_code`: the quotient from `1 / s`
    /// by a multiplication and Markstein's correction step, then their integer E4M3 encoder)
    /// equal the spec's division encoded by the format's definition.
    mod kernel_quotient {
        use super::*;
        use cubecl_kernels::rounding::{e4m3_bits, fp8_code};

        /// The kernels' integer encoder (which [`f32_to_e4m3`] is) against the format's
        /// definition on every 61st f32 in [-448, 448] and on every E4M3 value and midpoint
        /// with its neighbours.
        #[test]
        fn integer_encoder_matches_the_definition() {
            let mut checked = 0usize;
            let mut check = |v: f32| {
                for y in [v, -v] {
                    assert_eq!(e4m3_bits(y) as u8, by_definition(y), "y = {y:e}");
                    assert_eq!(f32_to_e4m3(y), by_definition(y), "y = {y:e}");
                }
                checked += 1;
            };
            for bits in (0..=E4M3_MAX.to_bits()).step_by(61) {
                check(f32::from_bits(bits));
            }
            let values = positive_values();
            for w in values.windows(2) {
                for v in [w[0], (w[0] + w[1]) / 2.0] {
                    for u in v.to_bits().saturating_sub(3)..=v.to_bits() + 3 {
                        check(f32::from_bits(u).min(E4M3_MAX));
                    }
                }
            }
            assert!(checked > 17_000_000);
        }

        fn by_division(x: f32, scale: f32) -> u8 {
            by_definition((x / scale).clamp(-E4M3_MAX, E4M3_MAX))
        }

        /// Deterministic `(absmax, scale)` pairs over many binades, as the kernels compute
        /// them (`max(absmax, 1e-12) / 448`).
        fn scales() -> impl Iterator<Item = (f32, f32)> {
            (0..600u32).map(|i| {
                let absmax = (1.0 + (i as f32 * 0.618_034).fract()) * 2f32.powi(i as i32 % 80 - 50);
                let absmax = absmax.max(1e-12);
                (absmax, absmax / E4M3_MAX)
            })
        }

        #[test]
        fn equals_the_division_on_values_of_a_row() {
            use rand::{Rng, SeedableRng, rngs::StdRng};
            let mut rng = StdRng::seed_from_u64(7);
            for (absmax, scale) in scales() {
                let inv = 1.0 / scale;
                for _ in 0..3_000 {
                    // Uniform and log-uniform magnitudes: the subnormal codes need the latter.
                    let x = if rng.random_bool(0.5) {
                        rng.random_range(-absmax..=absmax)
                    } else {
                        absmax * 2f32.powi(-rng.random_range(0..20)) * rng.random_range(-1.0..1.0)
                    };
                    assert_eq!(
                        fp8_code(x, scale, inv),
                        by_division(x, scale),
                        "x = {x:e}, scale = {scale:e}"
                    );
                }
                assert_eq!(fp8_code(absmax, scale, inv), 0x7E);
            }
        }

        /// Every value within 100 ulps of each midpoint quotient `h * s` (all 252 midpoints
        /// between finite E4M3 magnitudes, both signs), where the multiplication alone can
        /// round the other way: the correction step must fix them all.
        #[test]
        fn equals_the_division_next_to_every_midpoint() {
            let values = positive_values();
            let midpoints: Vec<f32> = values.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            let mut caught = 0usize;
            for (_, scale) in scales().step_by(7) {
                let inv = 1.0 / scale;
                for &h in &midpoints {
                    for sign in [1.0f32, -1.0] {
                        let center = sign * h * scale;
                        let mut x = f32::from_bits(center.to_bits().saturating_sub(100));
                        for _ in 0..200 {
                            let naive = by_definition((x * inv).clamp(-E4M3_MAX, E4M3_MAX));
                            let exact = by_division(x, scale);
                            caught += usize::from(naive != exact);
                            assert_eq!(
                                fp8_code(x, scale, inv),
                                exact,
                                "x = {x:e}, scale = {scale:e}, midpoint {h}"
                            );
                            x = f32::from_bits(x.to_bits() + 1);
                        }
                    }
                }
            }
            // The test reaches the cases the correction exists for.
            assert!(caught > 0);
        }
    }
}
