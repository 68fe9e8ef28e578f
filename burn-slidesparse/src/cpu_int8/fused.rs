//! 6:8 layers at decode sizes on AVX-512 (VNNI, VBMI, VBMI2, BMI2): each compact row is read
//! once, 64 columns a step, expanded in the register that multiplies it (`vpexpandb` straight
//! from the kept codes, its mask from the ranks as `expand.rs` makes it) and multiplied with up
//! to [`TOKENS`] tokens there.
//!
//! Why: at a few tokens the expand-then-multiply path writes and re-reads every expanded row
//! for a handful of products each; here the expansion costs a few instructions per 64 columns
//! and the compact row's 53 bytes (codes and ranks) are all that is read for them. Dense rows
//! gain nothing from it (measured: their 256-bit tiles are as fast or faster at one token), so
//! they keep the tiles.
//!
//! Signs: `vpdpbusd` multiplies unsigned by signed bytes, so the tokens come biased, `x + 128`
//! (in `[1, 255]`), and each row's sums then hold `128 * sum(w)` besides, which the row's
//! code sum (computed once with the layer) removes: `sum (x + 128) w - 128 sum w = sum x w`.
//! Every partial sum is below `255 * 127 * K` in magnitude: exact in INT32 for `K <=`
//! [`MAX_K`].

/// Tokens a forward may have for this kernel: one pass of up to 16 accumulator registers
/// per row (of the 32), more passes for fewer tokens.
pub const TOKENS: usize = 16;

/// The largest `K` whose biased sums stay inside INT32 (`255 * 127 * K < 2^31`).
pub const MAX_K: usize = 65_536;

/// The 6:8 compact rows a pass reads (`compact/rows.rs`, with its slack) and the expansion
/// table's kept-position bytes.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub kept: &'a [u8],
    pub kept_stride: usize,
    pub ranks: &'a [u8],
    pub rank_stride: usize,
    pub kept_bits: &'a [u8; 64],
}

/// Whether this CPU has what the kernel needs.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("avx512vbmi2")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("bmi2")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `acc[i * m + t] = sum_k w[first + i, k] x[t, k]` for `count` rows from `first` and the `m`
/// tokens of `biased` (`[m, kp]`, `x + 128`, zero codes past `K` biased too), `row_sums` every
/// row's code sum. The rows' 64-wide groups lie within `kp` (`groups * 64 <= kp`);
/// [`available`] must be true and `K <= MAX_K`.
#[allow(clippy::too_many_arguments)]
pub fn rows_by_tokens(
    rows: Rows<'_>,
    (first, count): (usize, usize),
    groups: usize,
    biased: &[u8],
    (m, kp): (usize, usize),
    row_sums: &[i32],
    acc: &mut [i32],
) {
    assert!(available(), "the AVX-512 kernel on a CPU without it");
    assert!(groups * 64 <= kp && biased.len() == m * kp && acc.len() == count * m);
    assert!(row_sums.len() >= first + count);
    let Rows {
        kept,
        kept_stride,
        ranks,
        rank_stride,
        ..
    } = rows;
    assert!(kept_stride >= groups * 48 && (first + count) * kept_stride <= kept.len());
    assert!(rank_stride >= groups * 5 && ranks.len() >= (first + count) * rank_stride + 8);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the features were detected (asserted); every load the kernel makes lies in the
    // bounds asserted above (see `x86::rows_by_tokens`).
    unsafe {
        x86::rows_by_tokens(rows, (first, count), groups, biased, (m, kp), row_sums, acc)
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Rows;

    /// # Safety
    /// The features are available; the bounds `super::rows_by_tokens` asserts: a row's 48-byte
    /// expanding load lies in its kept codes, its 8-byte rank read in its ranks or the slack
    /// after the last row, a token's 64-byte load in its `kp` bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,avx512vnni,bmi2")]
    pub(super) unsafe fn rows_by_tokens(
        rows: Rows<'_>,
        (first, count): (usize, usize),
        groups: usize,
        biased: &[u8],
        (m, kp): (usize, usize),
        row_sums: &[i32],
        acc: &mut [i32],
    ) {
        for i in 0..count {
            let r = first + i;
            let mut t0 = 0;
            while t0 < m {
                // Passes of 16, 8, 4, 2 or 1 tokens: each one more expansion of the row.
                let t = [16, 8, 4, 2, 1]
                    .into_iter()
                    .find(|&t| t <= m - t0)
                    .unwrap_or(1);
                let x = biased[t0 * kp..].as_ptr();
                let out = &mut acc[i * m + t0..][..t];
                // SAFETY: tokens `t0 .. t0 + t` exist; the caller's bounds for row `r`.
                unsafe {
                    match t {
                        16 => row::<16>(rows, r, groups, x, kp, out),
                        8 => row::<8>(rows, r, groups, x, kp, out),
                        4 => row::<4>(rows, r, groups, x, kp, out),
                        2 => row::<2>(rows, r, groups, x, kp, out),
                        _ => row::<1>(rows, r, groups, x, kp, out),
                    }
                }
                for o in out.iter_mut() {
                    *o -= 128 * row_sums[r];
                }
                t0 += t;
            }
        }
    }

    /// The biased sums of row `r` with `T` tokens from `x` (rows of `kp`) into `out`.
    ///
    /// # Safety
    /// As [`rows_by_tokens`]: row `r` and `T` tokens from `x` within the asserted bounds.
    #[inline(always)]
    unsafe fn row<const T: usize>(
        rows: Rows<'_>,
        r: usize,
        groups: usize,
        x: *const u8,
        kp: usize,
        out: &mut [i32],
    ) {
        // SAFETY: the caller's bounds (see `rows_by_tokens`); the features are enabled in the
        // caller this is inlined into.
        unsafe {
            let mut sums = [_mm512_setzero_si512(); T];
            let table = _mm512_loadu_si512(rows.kept_bits.as_ptr() as *const __m512i);
            let kept = rows.kept.as_ptr().add(r * rows.kept_stride);
            let ranks = rows.ranks.as_ptr().add(r * rows.rank_stride);
            for g in 0..groups {
                // Eight 5-bit ranks -> eight bytes of kept positions -> one 64-bit mask.
                let bits = (ranks.add(5 * g) as *const u64).read_unaligned() & ((1 << 40) - 1);
                let idx = _pdep_u64(bits, 0x1F1F_1F1F_1F1F_1F1F);
                let sel = _mm512_permutexvar_epi8(
                    _mm512_zextsi128_si512(_mm_cvtsi64_si128(idx as i64)),
                    table,
                );
                let mask = _mm_cvtsi128_si64(_mm512_castsi512_si128(sel)) as u64;
                let w = _mm512_maskz_expandloadu_epi8(mask, kept.add(48 * g) as *const i8);
                for (t, sum) in sums.iter_mut().enumerate() {
                    let xv = _mm512_loadu_si512(x.add(t * kp + 64 * g) as *const __m512i);
                    *sum = _mm512_dpbusd_epi32(*sum, xv, w);
                }
            }
            for (o, sum) in out.iter_mut().zip(sums) {
                *o = _mm512_reduce_add_epi32(sum);
            }
        }
    }
}
