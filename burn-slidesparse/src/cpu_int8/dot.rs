//! The INT8 products of the CPU path: a group of weight rows against every token's
//! activation codes, INT32 sums, exact in any order (every product is at most `127 * 127`,
//! and `K` is far below the `2^17` columns whose sum could leave INT32).
//!
//! The work is cut in tiles of up to [`ROWS`] weight rows by [`TOKENS`] tokens, whose sums
//! stay in registers over the whole row. Three implementations, the fastest the CPU has
//! chosen once per process ([`Isa::detect`]):
//! - AVX-VNNI: `vpdpbusd` multiplies 32 unsigned by 32 signed bytes and adds each group of
//!   four products into an INT32 lane. The activations are given as `|x|` (unsigned) and the
//!   weights get `x`'s sign (`vpsignb`), so `|x| * (w * sign x) = x * w` exactly;
//! - AVX2: the same signs, `vpmaddubsw` into INT16 pairs (at most `2 * 127 * 127 < 2^15`: no
//!   saturation) and `vpmaddwd` by ones into INT32;
//! - scalar, everywhere else and as the tests' reference.

/// Weight rows of one tile.
pub const ROWS: usize = 2;
/// Tokens of one tile.
pub const TOKENS: usize = 4;
/// Columns every row and token are padded to (zeros): one 256-bit register of codes.
pub const LANE: usize = 32;

/// The instruction set the products run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust.
    Scalar,
    /// x86-64 AVX2.
    Avx2,
    /// x86-64 AVX2 with AVX-VNNI.
    AvxVnni,
    /// x86-64 AVX-512 with VNNI, VBMI, VBMI2 (and BMI2): 6:8 forwards of up to
    /// `fused::TOKENS` tokens on the fused kernel (`fused.rs`), the rest as [`Isa::AvxVnni`].
    Avx512,
}

impl Isa {
    /// The best this CPU supports, detected once.
    pub fn detect() -> Self {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            [Isa::Avx512, Isa::AvxVnni, Isa::Avx2]
                .into_iter()
                .find(|isa| isa.available())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// Whether this CPU can run `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::AvxVnni.available() && super::fused::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// Activation codes of `m` tokens as the kernels read them: `|x|` and `x`, `[m, kp]` each.
#[derive(Clone, Copy)]
pub struct Tokens<'a> {
    /// `|x|` (at most 127).
    pub abs: &'a [u8],
    /// `x`.
    pub signed: &'a [i8],
    /// Tokens.
    pub m: usize,
}

/// `acc[r * m + t] = sum_k w[r * kp + k] x[t * kp + k]` for the `w.len() / kp` rows of `w`
/// (`kp` a multiple of [`LANE`]). `isa` must be [`Isa::available`].
pub fn rows_by_tokens(isa: Isa, w: &[i8], kp: usize, x: Tokens<'_>, acc: &mut [i32]) {
    let rows = w.len() / kp.max(1);
    assert!(
        kp.is_multiple_of(LANE) && w.len() == rows * kp,
        "rows of kp codes"
    );
    assert!(
        x.abs.len() == x.m * kp && x.signed.len() == x.m * kp,
        "tokens of kp codes"
    );
    assert!(acc.len() == rows * x.m, "one sum per row and token");
    assert!(isa.available(), "{isa:?} on this CPU");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were detected (asserted above); the lengths asserted above are
        // the ones the kernel reads and writes.
        Isa::AvxVnni | Isa::Avx512 => unsafe { x86::rows_by_tokens_vnni(w, kp, x, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::rows_by_tokens_avx2(w, kp, x, acc) },
        _ => rows_by_tokens_scalar(w, kp, x, acc),
    }
}

/// [`rows_by_tokens`] in plain Rust.
fn rows_by_tokens_scalar(w: &[i8], kp: usize, x: Tokens<'_>, acc: &mut [i32]) {
    for (r, row) in w.chunks_exact(kp.max(1)).enumerate() {
        for (t, token) in x.signed.chunks_exact(kp.max(1)).enumerate() {
            acc[r * x.m + t] = row
                .iter()
                .zip(token)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{LANE, ROWS, TOKENS, Tokens};

    /// The sum of an INT32 vector's 8 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256i) -> i32 {
        // SAFETY: AVX2 is enabled in every caller (this is inlined into their bodies).
        unsafe {
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
            _mm_cvtsi128_si32(s)
        }
    }

    /// Generates, for one product step `|acc, abs, signed_w| { .. }` (the products of 32
    /// columns of `|x|` and `x`-signed weights added into `acc`), a kernel over a group of rows
    /// and its tiles of `R <= ROWS` rows by `T <= TOKENS` tokens, all inlined into the
    /// `target_feature` function so that they run with its features.
    macro_rules! kernel {
        ($name:ident, $features:literal, |$acc:ident, $abs:ident, $sw:ident| $step:block) => {
            /// # Safety
            /// The CPU has the enabled features; `w` is rows of `kp` codes, `x` `m` tokens of
            /// `kp`, `acc` `rows * m`, `kp` a multiple of 32 (see `rows_by_tokens`).
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(w: &[i8], kp: usize, x: Tokens<'_>, acc: &mut [i32]) {
                /// One tile: rows `r0 .. r0 + R`, tokens `t0 .. t0 + T`.
                #[inline(always)]
                unsafe fn tile<const R: usize, const T: usize>(
                    w: &[i8],
                    kp: usize,
                    x: Tokens<'_>,
                    (r0, t0): (usize, usize),
                    acc: &mut [i32],
                ) {
                    // SAFETY: the caller's bounds: rows `r0 + R` and tokens `t0 + T` exist,
                    // every load below reads 32 bytes at `k < kp` of one of them.
                    unsafe {
                        let mut sums = [[_mm256_setzero_si256(); T]; R];
                        let wp = w.as_ptr().add(r0 * kp);
                        let (ap, sp) =
                            (x.abs.as_ptr().add(t0 * kp), x.signed.as_ptr().add(t0 * kp));
                        for k in (0..kp).step_by(LANE) {
                            let mut wv = [_mm256_setzero_si256(); R];
                            for (r, v) in wv.iter_mut().enumerate() {
                                *v = _mm256_loadu_si256(wp.add(r * kp + k) as *const __m256i);
                            }
                            for t in 0..T {
                                let $abs = _mm256_loadu_si256(ap.add(t * kp + k) as *const __m256i);
                                let sign = _mm256_loadu_si256(sp.add(t * kp + k) as *const __m256i);
                                for r in 0..R {
                                    let ($acc, $sw) = (sums[r][t], _mm256_sign_epi8(wv[r], sign));
                                    sums[r][t] = $step;
                                }
                            }
                        }
                        for r in 0..R {
                            for t in 0..T {
                                acc[(r0 + r) * x.m + t0 + t] = hsum(sums[r][t]);
                            }
                        }
                    }
                }
                let rows = w.len() / kp.max(1);
                let mut r0 = 0;
                while r0 < rows {
                    let r = (rows - r0).min(ROWS);
                    let mut t0 = 0;
                    while t0 < x.m {
                        let t = (x.m - t0).min(TOKENS);
                        // SAFETY: `r0 + r <= rows`, `t0 + t <= m`: the tile's rows and tokens
                        // exist (the caller's contract covers their lengths).
                        unsafe {
                            match (r, t) {
                                (2, 4) => tile::<2, 4>(w, kp, x, (r0, t0), acc),
                                (2, 3) => tile::<2, 3>(w, kp, x, (r0, t0), acc),
                                (2, 2) => tile::<2, 2>(w, kp, x, (r0, t0), acc),
                                (2, 1) => tile::<2, 1>(w, kp, x, (r0, t0), acc),
                                (1, 4) => tile::<1, 4>(w, kp, x, (r0, t0), acc),
                                (1, 3) => tile::<1, 3>(w, kp, x, (r0, t0), acc),
                                (1, 2) => tile::<1, 2>(w, kp, x, (r0, t0), acc),
                                _ => tile::<1, 1>(w, kp, x, (r0, t0), acc),
                            }
                        }
                        t0 += t;
                    }
                    r0 += r;
                }
            }
        };
    }

    const _: () = assert!(ROWS == 2 && TOKENS == 4, "the tile shapes matched below");

    kernel!(rows_by_tokens_avx2, "avx2", |acc, abs, signed_w| {
        let pairs = _mm256_maddubs_epi16(abs, signed_w);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    });

    kernel!(rows_by_tokens_vnni, "avx2,avxvnni", |acc, abs, signed_w| {
        _mm256_dpbusd_avx_epi32(acc, abs, signed_w)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::XorShift32;

    fn codes(rng: &mut XorShift32, len: usize, extreme: bool) -> Vec<i8> {
        (0..len)
            .map(|_| (rng.next_u32() % 255) as i32 - 127)
            .map(|v| {
                if extreme {
                    if v < 0 { -127 } else { 127 }
                } else {
                    v as i8
                }
            })
            .collect()
    }

    /// Every instruction set this CPU has gives the exact sums (against i64) for every row
    /// and token count around the tile shapes, the extreme codes (+-127 everywhere: the INT16
    /// pairs' worst case) included.
    #[test]
    fn every_isa_sums_exactly() {
        let mut rng = XorShift32(5);
        for kp in [32, 64, 576, 4096] {
            for extreme in [false, true] {
                for (rows, m) in [(1, 1), (2, 4), (3, 5), (5, 9), (7, 2)] {
                    let w = codes(&mut rng, rows * kp, extreme);
                    let signed = codes(&mut rng, m * kp, extreme);
                    let abs: Vec<u8> = signed.iter().map(|v| v.unsigned_abs()).collect();
                    let x = Tokens {
                        abs: &abs,
                        signed: &signed,
                        m,
                    };
                    let exact: Vec<i64> = (0..rows * m)
                        .map(|i| {
                            let (r, t) = (i / m, i % m);
                            (0..kp)
                                .map(|k| i64::from(w[r * kp + k]) * i64::from(signed[t * kp + k]))
                                .sum()
                        })
                        .collect();
                    for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni] {
                        if !isa.available() {
                            continue;
                        }
                        let mut acc = vec![0; rows * m];
                        rows_by_tokens(isa, &w, kp, x, &mut acc);
                        let got: Vec<i64> = acc.iter().map(|&v| i64::from(v)).collect();
                        assert_eq!(got, exact, "{isa:?} kp={kp} {rows}x{m} extreme={extreme}");
                    }
                }
            }
        }
    }
}
