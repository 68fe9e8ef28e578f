//! A compact row (kept codes and packed zero-pair ranks, `compact/rows.rs`) expanded back to
//! its dense codes, one block after the other: what the CPU path's dot products read.
//!
//! Per block of `2N` positions the two zero positions are a rank among `C(2N, 2)` pairs; a
//! table holds, per rank, the source of each position (kept code `i - [i > p] - [i > q]`, or
//! a zero). Three ways, the first this CPU has:
//! - 6:8 with AVX-512 VBMI2: eight blocks (64 positions, 48 kept codes, 40 rank bits) at a
//!   time: `pdep` spreads the eight ranks into bytes, `vpermb` turns each into its block's
//!   byte of kept positions, and `vpexpandb` places the 48 codes at the 64-bit mask's set bits;
//! - SSSE3: one `pshufb` of a block's kept codes by its rank's mask writes the block (blocks
//!   of up to 16 positions, 14:16);
//! - the scalar loop, for longer blocks and other CPUs, and the tests' reference.

use crate::compact::{pair_count, pair_of_rank, rank_bits};
use crate::pattern::SparsityPattern;

/// Marks a position that takes no kept code (`pshufb` writes a zero for a set high bit).
const ZERO: u8 = 0x80;

/// A pattern's expansion table: per rank, `2N` sources (padded to 16 for `pshufb`).
#[derive(Clone, Debug)]
pub struct ExpandTable {
    len: usize,
    kept: usize,
    bits: u32,
    masks: Vec<[u8; 16]>,
    /// Per rank, the byte whose set bits are the block's kept positions (blocks of 8, the
    /// eight-block expansion's `vpermb` table; zero past the ranks).
    kept_bits: [u8; 64],
}

impl ExpandTable {
    /// The table of `pattern`.
    pub fn new(pattern: SparsityPattern) -> Self {
        let len = pattern.block_len();
        let masks = (0..pair_count(len))
            .map(|rank| {
                let (p, q) = pair_of_rank(rank, len);
                let mut mask = [ZERO; 16];
                for (i, m) in mask.iter_mut().enumerate().take(len.min(16)) {
                    if i != p && i != q {
                        *m = (i - usize::from(i > p) - usize::from(i > q)) as u8;
                    }
                }
                mask
            })
            .collect();
        let mut kept_bits = [0u8; 64];
        if len == 8 {
            for (rank, entry) in kept_bits.iter_mut().enumerate().take(pair_count(len)) {
                let (p, q) = pair_of_rank(rank, len);
                *entry = (0..8)
                    .filter(|&i| i != p && i != q)
                    .fold(0, |m, i| m | 1 << i);
            }
        }
        Self {
            len,
            kept: len - 2,
            bits: rank_bits(pattern),
            masks,
            kept_bits,
        }
    }

    /// Per rank, the byte of a 6:8 block's kept positions; `None` for other patterns.
    pub fn kept_bits_68(&self) -> Option<&[u8; 64]> {
        (self.len == 8 && self.bits == 5).then_some(&self.kept_bits)
    }

    /// The rank of block `b` of a row's packed ranks (`ranks` readable 8 bytes past the byte
    /// holding the block's first bit).
    fn rank(&self, ranks: &[u8], b: usize) -> usize {
        let bit = b * self.bits as usize;
        let bytes: [u8; 8] = ranks[bit / 8..bit / 8 + 8].try_into().expect("8 bytes");
        ((u64::from_le_bytes(bytes) >> (bit % 8)) & ((1u64 << self.bits) - 1)) as usize
    }

    /// Expands `count` rows from `first` of `rows` into `out` (`count` rows of `kp` codes,
    /// `kp` at least the blocks' positions rounded up to 64, plus 16).
    pub fn expand_rows(
        &self,
        rows: &CompactRowsRef<'_>,
        first: usize,
        count: usize,
        kp: usize,
        out: &mut [i8],
    ) {
        assert!(
            out.len() >= count * kp && kp >= (rows.blocks * self.len).next_multiple_of(64) + 16
        );
        assert!((first + count) * rows.kept_stride <= rows.kept.len());
        #[cfg(target_arch = "x86_64")]
        if self.len == 8 && self.bits == 5 && vbmi2_available() {
            assert!(rows.kept_stride >= rows.blocks.div_ceil(8) * 48);
            assert!(rows.ranks.len() >= (first + count) * rows.rank_stride + 8);
            // SAFETY: the features were detected; every group's 48-byte masked load lies in its
            // row's kept codes (asserted), its 8-byte rank read in the ranks' padding at worst
            // (asserted), and its 64-byte store in the row's `kp` (asserted).
            unsafe { self.expand_rows_vbmi2(rows, first, count, kp, out) };
            return;
        }
        for (i, row) in out.chunks_mut(kp).take(count).enumerate() {
            let r = first + i;
            self.expand(
                &rows.kept[r * rows.kept_stride..],
                &rows.ranks[r * rows.rank_stride..],
                rows.blocks,
                row,
            );
        }
    }

    /// [`expand_rows`](Self::expand_rows) of 6:8 blocks eight at a time (module docs).
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI/VBMI2 and BMI2 are available; the bounds `expand_rows` asserts.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2")]
    unsafe fn expand_rows_vbmi2(
        &self,
        rows: &CompactRowsRef<'_>,
        first: usize,
        count: usize,
        kp: usize,
        out: &mut [i8],
    ) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's features and bounds (see `expand_rows`).
        unsafe {
            let table = _mm512_loadu_si512(self.kept_bits.as_ptr() as *const __m512i);
            for i in 0..count {
                let r = first + i;
                let kept = rows.kept.as_ptr().add(r * rows.kept_stride);
                let ranks = rows.ranks.as_ptr().add(r * rows.rank_stride);
                let dst = out.as_mut_ptr().add(i * kp);
                for g in 0..rows.blocks.div_ceil(8) {
                    let bits = (ranks.add(5 * g) as *const u64).read_unaligned() & ((1 << 40) - 1);
                    let idx = _pdep_u64(bits, 0x1F1F_1F1F_1F1F_1F1F);
                    let sel = _mm512_permutexvar_epi8(
                        _mm512_zextsi128_si512(_mm_cvtsi64_si128(idx as i64)),
                        table,
                    );
                    let mask =
                        _cvtu64_mask64(_mm_cvtsi128_si64(_mm512_castsi512_si128(sel)) as u64);
                    let codes =
                        _mm512_maskz_loadu_epi8(0xFFFF_FFFF_FFFF, kept.add(48 * g) as *const i8);
                    _mm512_storeu_si512(
                        dst.add(64 * g) as *mut __m512i,
                        _mm512_maskz_expand_epi8(mask, codes),
                    );
                }
            }
        }
    }

    /// Writes `blocks` blocks of a row into `out` (`blocks * 2N` codes; the rest of `out`
    /// untouched): `kept` the row's kept codes, readable 16 bytes past the last block's;
    /// `ranks` its packed ranks, readable 8 bytes past the last block's byte; `out` writable 16
    /// bytes past the last block.
    pub fn expand(&self, kept: &[u8], ranks: &[u8], blocks: usize, out: &mut [i8]) {
        #[cfg(target_arch = "x86_64")]
        if self.len <= 16 && is_x86_feature_detected!("ssse3") {
            assert!(kept.len() >= blocks * self.kept + 16 && out.len() >= blocks * self.len + 16);
            // SAFETY: SSSE3 was detected; the bounds asserted above cover every 16-byte load
            // and store of the loop (block `b` reads `kept[b * kept..][..16]` and writes
            // `out[b * len..][..16]`).
            unsafe { self.expand_ssse3(kept, ranks, blocks, out) };
            return;
        }
        self.expand_scalar(kept, ranks, blocks, out);
    }

    /// [`expand`](Self::expand) in plain Rust.
    pub fn expand_scalar(&self, kept: &[u8], ranks: &[u8], blocks: usize, out: &mut [i8]) {
        for b in 0..blocks {
            let rank = self.rank(ranks, b);
            let (p, q) = pair_of_rank(rank, self.len);
            let src = &kept[b * self.kept..][..self.kept];
            let dst = &mut out[b * self.len..][..self.len];
            let mut next = src.iter();
            for (i, d) in dst.iter_mut().enumerate() {
                *d = if i == p || i == q {
                    0
                } else {
                    *next.next().expect("2N-2 kept codes") as i8
                };
            }
        }
    }

    /// # Safety
    /// SSSE3 is available; `kept` is readable and `out` writable 16 bytes from every block's
    /// start (see [`expand`](Self::expand)).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "ssse3")]
    unsafe fn expand_ssse3(&self, kept: &[u8], ranks: &[u8], blocks: usize, out: &mut [i8]) {
        use std::arch::x86_64::*;
        for b in 0..blocks {
            let mask = &self.masks[self.rank(ranks, b)];
            // SAFETY: the caller's bounds; unaligned 16-byte loads and store.
            unsafe {
                let codes = _mm_loadu_si128(kept.as_ptr().add(b * self.kept) as *const __m128i);
                let m = _mm_loadu_si128(mask.as_ptr() as *const __m128i);
                let block = _mm_shuffle_epi8(codes, m);
                _mm_storeu_si128(out.as_mut_ptr().add(b * self.len) as *mut __m128i, block);
            }
        }
    }
}

/// A matrix of compact rows as [`CompactRows`](crate::compact::CompactRows) lays them out,
/// the arrays padded: `kept` readable 16 bytes and `ranks` 8 bytes past the last row.
#[derive(Clone, Copy, Debug)]
pub struct CompactRowsRef<'a> {
    /// Kept codes, rows of `kept_stride`.
    pub kept: &'a [u8],
    /// Bytes per row of `kept`.
    pub kept_stride: usize,
    /// Packed ranks, rows of `rank_stride`.
    pub ranks: &'a [u8],
    /// Bytes per row of `ranks`.
    pub rank_stride: usize,
    /// Blocks per row.
    pub blocks: usize,
}

/// Whether this CPU has what the eight-block 6:8 expansion needs.
#[cfg(target_arch = "x86_64")]
fn vbmi2_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vbmi")
            && is_x86_feature_detected!("avx512vbmi2")
            && is_x86_feature_detected!("bmi2")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        compact::{CompactCodes, CompactRows, tests::random_pruned},
        test_rng::XorShift32,
    };

    /// Every pattern, random rows (extra zeros among the kept codes, `K` inside a block): the
    /// expansion, with and without SSSE3, is the pruned row.
    #[test]
    fn rows_expand_to_the_pruned_rows() {
        let mut rng = XorShift32(61);
        for pattern in SparsityPattern::all() {
            for &(n, k) in &[(3, 70), (2, 576), (1, 4096)] {
                let w = random_pruned(&mut rng, n, k, pattern, true);
                let compact = CompactCodes::from_pruned(&w, n, k, pattern, "w").unwrap();
                let rows = CompactRows::new(&compact);
                let table = ExpandTable::new(pattern);
                let blocks = compact.blocks();
                let (mut kept, mut ranks) = (rows.kept.clone(), rows.ranks.clone());
                kept.extend([0; 16]);
                ranks.extend([0; 8]);
                for r in 0..n {
                    let mut out = vec![0x55i8; blocks * pattern.block_len() + 16];
                    let (kr, rr) = (
                        &kept[r * rows.kept_stride..],
                        &ranks[r * rows.rank_stride..],
                    );
                    table.expand(kr, rr, blocks, &mut out);
                    assert_eq!(
                        &out[..k],
                        &w[r * k..(r + 1) * k],
                        "{pattern} {n}x{k} row {r}"
                    );
                    assert!(out[k..blocks * pattern.block_len()].iter().all(|&v| v == 0));
                    let mut scalar = vec![0x55i8; out.len()];
                    table.expand_scalar(kr, rr, blocks, &mut scalar);
                    assert_eq!(&scalar[..k], &out[..k]);
                }
                // Whole matrices (the eight-block path where the CPU has it), every row.
                let kp = (blocks * pattern.block_len()).next_multiple_of(64) + 32;
                let view = CompactRowsRef {
                    kept: &kept,
                    kept_stride: rows.kept_stride,
                    ranks: &ranks,
                    rank_stride: rows.rank_stride,
                    blocks,
                };
                let mut all = vec![0x55i8; n * kp];
                table.expand_rows(&view, 0, n, kp, &mut all);
                for r in 0..n {
                    assert_eq!(
                        &all[r * kp..][..k],
                        &w[r * k..(r + 1) * k],
                        "{pattern} rows, row {r}"
                    );
                    let end = blocks * pattern.block_len();
                    assert!(all[r * kp + k..r * kp + end].iter().all(|&v| v == 0));
                }
            }
        }
    }
}
