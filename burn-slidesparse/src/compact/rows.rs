//! The compact layout as a GPU holds it: row-major kept codes and row-major packed ranks, what
//! the Hopper sparse GEMM's compact kernels (`sparse_gemm_sm90.cu`) read.
//!
//! Why row-major: the GEMM loads `[128 rows, 64 bytes]` boxes of the kept codes with the tensor
//! memory accelerator, and its A operand's compressed values are exactly a row's kept codes in
//! order; the rank boxes follow the same rows.
//!
//! Rows are padded with zero blocks to whole groups of 8 blocks (64 `k` for 6:8, a whole number
//! of 16 code bytes for every pattern), so a kernel reading whole 64-wide chunks of a 6:8 row
//! never reads past it; the rank rows then to a multiple of 16 bytes (the tensor maps' stride
//! alignment).

use super::{CompactCodes, rank_bits};
use crate::{pattern::SparsityPattern, slide::SlideElement};

/// A code type stored as one byte on the device: INT8 codes, FP8 E4M3 bit patterns.
pub trait CodeByte: SlideElement {
    /// The code's byte.
    fn byte(self) -> u8;
    /// The code of a byte.
    fn from_byte(byte: u8) -> Self;
}

impl CodeByte for i8 {
    fn byte(self) -> u8 {
        self as u8
    }
    fn from_byte(byte: u8) -> Self {
        byte as i8
    }
}

impl CodeByte for u8 {
    fn byte(self) -> u8 {
        self
    }
    fn from_byte(byte: u8) -> Self {
        byte
    }
}

/// Blocks a row is padded to a multiple of.
pub const ROW_BLOCKS: usize = 8;

/// Zero bytes after the last row's kept codes: the CPU kernel loads a block's codes as one
/// 16-byte vector, past the row's end at its last block.
pub const KEPT_SLACK: usize = 16;

/// Zero bytes after the last row's ranks: the CPU kernel reads a block's rank as part of an
/// 8-byte word.
pub const RANK_SLACK: usize = 8;

/// A compact matrix as the device holds it: `[rows, kept_stride]` code bytes and `[rows,
/// rank_stride]` rank bytes (module docs), each array followed by its slack ([`KEPT_SLACK`],
/// [`RANK_SLACK`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompactRows {
    /// The pattern every block satisfies.
    pub pattern: SparsityPattern,
    /// Rows (output features).
    pub rows: usize,
    /// Columns of the pruned matrix (input features `K`).
    pub k: usize,
    /// Each row's blocks' kept codes in order, then zeros to `kept_stride`.
    pub kept: Vec<u8>,
    /// Bytes per row of `kept`: `ceil(blocks / 8) * 8 * (2N - 2)`.
    pub kept_stride: usize,
    /// Each row's ranks packed at [`rank_bits`] each as [`CompactCodes::packed_ranks`] packs
    /// them, then zeros to `rank_stride`.
    pub ranks: Vec<u8>,
    /// Bytes per row of `ranks`: `ceil(blocks / 8) * rank_bits` rounded up to 16.
    pub rank_stride: usize,
}

impl CompactRows {
    /// The device layout of `compact`.
    pub fn new<T: CodeByte>(compact: &CompactCodes<T>) -> Self {
        let (pattern, rows, k) = (compact.pattern, compact.rows, compact.k);
        let blocks = compact.blocks();
        let kept_len = pattern.block_len() - 2;
        let (kept_stride, rank_stride) = Self::strides(pattern, k);
        let mut kept = vec![0u8; rows * kept_stride + KEPT_SLACK];
        let used = blocks * kept_len;
        for (out, row) in kept
            .chunks_mut(kept_stride.max(1))
            .zip(compact.kept.chunks(used.max(1)))
        {
            for (o, &v) in out.iter_mut().zip(row) {
                *o = v.byte();
            }
        }
        let packed = compact.packed_ranks();
        let rank_bytes = CompactCodes::<T>::rank_row_bytes(pattern, k);
        let mut ranks = vec![0u8; rows * rank_stride + RANK_SLACK];
        for (out, row) in ranks
            .chunks_mut(rank_stride.max(1))
            .zip(packed.chunks(rank_bytes.max(1)))
        {
            out[..row.len()].copy_from_slice(row);
        }
        Self {
            pattern,
            rows,
            k,
            kept,
            kept_stride,
            ranks,
            rank_stride,
        }
    }

    /// The compact codes these rows hold (the inverse of [`new`](Self::new)).
    pub fn to_codes<T: CodeByte>(&self) -> CompactCodes<T> {
        let (pattern, rows, k) = (self.pattern, self.rows, self.k);
        let (len, bits) = (pattern.block_len(), rank_bits(pattern) as usize);
        let blocks = k.div_ceil(len);
        let used = blocks * (len - 2);
        let mut kept = Vec::with_capacity(rows * used);
        let mut ranks = Vec::with_capacity(rows * blocks);
        for r in 0..rows {
            let row = &self.kept[r * self.kept_stride..][..used];
            kept.extend(row.iter().map(|&b| T::from_byte(b)));
            let stored = &self.ranks[r * self.rank_stride..][..self.rank_stride];
            ranks.extend((0..blocks).map(|b| {
                (0..bits).fold(0u16, |rank, bit| {
                    let at = b * bits + bit;
                    rank | u16::from(stored[at / 8] >> (at % 8) & 1) << bit
                })
            }));
        }
        CompactCodes {
            pattern,
            rows,
            k,
            kept,
            ranks,
        }
    }

    /// `(kept_stride, rank_stride)` of a `pattern` matrix of `k` columns.
    pub fn strides(pattern: SparsityPattern, k: usize) -> (usize, usize) {
        let groups = k.div_ceil(pattern.block_len()).div_ceil(ROW_BLOCKS);
        let kept = groups * ROW_BLOCKS * (pattern.block_len() - 2);
        let ranks = (groups * rank_bits(pattern) as usize).next_multiple_of(16);
        (kept, ranks)
    }

    /// Bytes of the kept codes and ranks a kernel reads (without the rows' padding): the
    /// layout's share of a forward's weight traffic.
    pub fn bytes(&self) -> usize {
        Self::read_bytes(self.pattern, self.rows, self.k)
    }

    /// [`bytes`](Self::bytes) of a `[rows, k]` matrix of `pattern`.
    pub fn read_bytes(pattern: SparsityPattern, rows: usize, k: usize) -> usize {
        let blocks = k.div_ceil(pattern.block_len());
        let ranks = CompactCodes::<u8>::rank_row_bytes(pattern, k);
        rows * (blocks * (pattern.block_len() - 2) + ranks)
    }

    /// Bytes the device holds: both arrays with their padding and slack.
    pub fn device_bytes(&self) -> usize {
        self.kept.len() + self.ranks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{compact::tests::random_pruned, test_rng::XorShift32};

    /// Every pattern: the strides, the padding (zeros), and the kept codes and ranks of every
    /// row where the GEMM's tensor maps expect them.
    #[test]
    fn rows_hold_the_compact_parts_with_zero_padding() {
        let mut rng = XorShift32(43);
        for pattern in SparsityPattern::all() {
            for &(n, k) in &[(3, 70), (2, 1000), (5, 4096)] {
                let w = random_pruned(&mut rng, n, k, pattern, true);
                let compact = CompactCodes::from_pruned(&w, n, k, pattern, "w").unwrap();
                let rows = CompactRows::new(&compact);
                assert_eq!(rows.kept_stride % 16, 0, "{pattern}");
                assert_eq!(rows.rank_stride % 16, 0, "{pattern}");
                let used = compact.blocks() * (pattern.block_len() - 2);
                let rank_bytes = CompactCodes::<i8>::rank_row_bytes(pattern, k);
                let packed = compact.packed_ranks();
                for r in 0..n {
                    let kept = &rows.kept[r * rows.kept_stride..][..rows.kept_stride];
                    let expected: Vec<u8> = compact.kept[r * used..][..used]
                        .iter()
                        .map(|&v| v as u8)
                        .collect();
                    assert_eq!(&kept[..used], &expected[..], "{pattern} {n}x{k}");
                    assert!(kept[used..].iter().all(|&b| b == 0));
                    let ranks = &rows.ranks[r * rows.rank_stride..][..rows.rank_stride];
                    assert_eq!(
                        &ranks[..rank_bytes],
                        &packed[r * rank_bytes..][..rank_bytes]
                    );
                    assert!(ranks[rank_bytes..].iter().all(|&b| b == 0));
                }
                assert_eq!(rows.bytes(), n * (used + rank_bytes), "{pattern} {n}x{k}");
                assert_eq!(rows.kept.len(), n * rows.kept_stride + KEPT_SLACK);
                assert_eq!(rows.ranks.len(), n * rows.rank_stride + RANK_SLACK);
                assert_eq!(rows.to_codes::<i8>(), compact, "{pattern} {n}x{k}");
            }
        }
    }
}
