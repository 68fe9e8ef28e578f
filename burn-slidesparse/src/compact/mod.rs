//! The compact `(2N-2):2N` layout: per block of `2N` weights along `K`, its `2N-2` kept codes in
//! order and which two positions are zero, as the rank of that pair among the `C(2N, 2)` pairs
//! (lexicographic: `(0, 1)` is 0, `(0, 2)` is 1, ..., `(2N-2, 2N-1)` is the last).
//!
//! Why: a GPU kernel that multiplies each kept code with the activation at its own position
//! needs no lift and reads `(2N-2)/2N` of the dense codes plus `ceil(log2 C(2N, 2))` bits per
//! block; for 6:8 INT8 that is 6 bytes + 5 bits per 8 weights, 0.83x the dense bytes, where
//! the slid 2:4 form a 2:4 GEMM reads is 0.94x. It is exact: [`CompactCodes::to_pruned`] gives
//! back every code of the pruned matrix, and a block with more than two zeros keeps the extra
//! zeros among its kept codes.
//!
//! The same layout is the A operand of a 2:4 sparse GEMM over the slid `K'` (the lift's
//! activations): a block's kept codes in order are its `N-1` windows' 2:4 values two by two
//! (kept code `i` sits at block position `i`, `i + 1` or `i + 2`, so codes `2j` and `2j + 1` lie
//! in window `j`, positions `2j .. 2j + 3`), and each window's 2:4 metadata is a function of the
//! block's rank alone ([`window_metadata`], [`CompactCodes::slid_row`]). The Hopper sparse GEMM
//! reads the `kept` array as its values and expands the metadata from the ranks on the fly
//! (`sparse_gemm_sm90.cu`, "The compact kernels"): no second copy of the weight.
//!
//! [`CompactRows`] (`rows.rs`) is the layout as a GPU holds it for the Hopper sparse GEMM:
//! row-major kept codes and ranks. [`DecodeTiles`] lays a 6:8 INT8 matrix out for the decode
//! kernel (`gemv_compact68_*`).

use cubecl_kernels::geometry::SlideGeometry;
use rayon::prelude::*;

use crate::{
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
    slide::{SlideElement, slide_row, unslide_row},
};

mod rows;
mod weight;

pub use rows::{CodeByte, CompactRows};
pub use weight::{CompactWeight, HostCodes};

/// Pairs of `len` positions: `C(len, 2)`.
pub fn pair_count(len: usize) -> usize {
    len * (len - 1) / 2
}

/// Bits of one block's rank: `ceil(log2 C(2N, 2))` (2:4: 3, 4:6: 4, 6:8: 5, 8:10: 6,
/// 10:12 .. 14:16: 7).
pub fn rank_bits(pattern: SparsityPattern) -> u32 {
    let pairs = pair_count(pattern.block_len());
    usize::BITS - (pairs - 1).leading_zeros()
}

/// The rank of the pair `p < q` of `len` positions, lexicographic.
pub fn pair_rank(p: usize, q: usize, len: usize) -> usize {
    debug_assert!(p < q && q < len);
    // Pairs starting before p: (len - 1) + (len - 2) + ... + (len - p).
    p * (2 * len - p - 1) / 2 + (q - p - 1)
}

/// The pair `(p, q)` of rank `rank` among the pairs of `len` positions.
pub fn pair_of_rank(rank: usize, len: usize) -> (usize, usize) {
    debug_assert!(rank < pair_count(len));
    let (mut p, mut rest) = (0, rank);
    while rest >= len - 1 - p {
        rest -= len - 1 - p;
        p += 1;
    }
    (p, p + 1 + rest)
}

/// The 2:4 metadata of window `j` of a block whose zero pair has rank `rank` (`len = 2N`
/// positions): the positions inside the window (4 wide, starting at block position `2j`) of
/// kept codes `2j` and `2j + 1`, as `idx0 | idx1 << 2` with `idx0 < idx1` (the 4-bit encoding of
/// `mma.sp` and `wgmma.mma_async.sp`; every value is one of the six valid ones).
pub fn window_nibble(rank: usize, j: usize, len: usize) -> u8 {
    let (p, q) = pair_of_rank(rank, len);
    // Kept position i of the block: i, then +1 past p, +1 past q.
    let kept = |i: usize| {
        let mut at = i;
        for zero in [p, q] {
            if at >= zero {
                at += 1;
            }
        }
        at
    };
    let (lo, hi) = (kept(2 * j) - 2 * j, kept(2 * j + 1) - 2 * j);
    debug_assert!(lo < hi && hi < 4);
    (lo | hi << 2) as u8
}

/// For every zero-pair rank of `pattern`, its block's `N-1` window nibbles ([`window_nibble`]),
/// window `j` at bits `4j .. 4j + 4`: the table a sparse GEMM on the compact layout expands
/// each block's metadata with (`u64`: up to 15 windows, 30:32).
pub fn window_metadata(pattern: SparsityPattern) -> Vec<u64> {
    let len = pattern.block_len();
    (0..pair_count(len))
        .map(|rank| {
            (0..len / 2 - 1).fold(0u64, |word, j| {
                word | u64::from(window_nibble(rank, j, len)) << (4 * j)
            })
        })
        .collect()
}

/// A matrix of codes `[rows, k]` in the compact layout (`k` padded with zeros to whole blocks).
#[derive(Clone, Debug, PartialEq)]
pub struct CompactCodes<T> {
    /// The pattern every block satisfies.
    pub pattern: SparsityPattern,
    /// Rows (output features).
    pub rows: usize,
    /// Columns of the pruned matrix (input features `K`).
    pub k: usize,
    /// `[rows, blocks, 2N-2]`: the kept codes of each block, in order.
    pub kept: Vec<T>,
    /// `[rows, blocks]`: the rank of each block's pair of zero positions.
    pub ranks: Vec<u16>,
}

impl<T: SlideElement> CompactCodes<T> {
    /// Blocks per row, `ceil(k / 2N)`.
    pub fn blocks(&self) -> usize {
        self.k.div_ceil(self.pattern.block_len())
    }

    /// The compact form of a pruned row-major `[rows, k]` matrix. Each block's zero pair is its
    /// first two zeros; a block with fewer than two is a [`SlideSparseError::PatternViolation`]
    /// naming its row and columns.
    pub fn from_pruned(
        codes: &[T],
        rows: usize,
        k: usize,
        pattern: SparsityPattern,
        tensor: &str,
    ) -> Result<Self> {
        if codes.len() != rows * k {
            return Err(SlideSparseError::shape(
                "pruned codes [rows, k]",
                rows * k,
                codes.len(),
            ));
        }
        let len = pattern.block_len();
        let blocks = k.div_ceil(len);
        let kept_len = len - 2;
        let mut kept = vec![T::ZERO; rows * blocks * kept_len];
        let mut ranks = vec![0u16; rows * blocks];
        let failures: Vec<(usize, usize)> = kept
            .par_chunks_mut(blocks * kept_len)
            .zip(ranks.par_chunks_mut(blocks))
            .enumerate()
            .filter_map(|(row, (kept, ranks))| {
                let row_codes = &codes[row * k..(row + 1) * k];
                (0..blocks).find_map(|b| {
                    let start = b * len;
                    let block = |i: usize| row_codes.get(start + i).copied().unwrap_or(T::ZERO);
                    let block_kept = &mut kept[b * kept_len..(b + 1) * kept_len];
                    match compact_block(block, len, block_kept) {
                        Some(rank) => {
                            ranks[b] = rank as u16;
                            None
                        }
                        None => Some((row, b)),
                    }
                })
            })
            .collect();
        if let Some(&(row, block)) = failures.first() {
            return Err(SlideSparseError::PatternViolation {
                tensor: tensor.to_string(),
                pattern: pattern.to_string(),
                row,
                block,
                start: block * len,
                end: ((block + 1) * len).min(k),
                nonzeros: (0..len)
                    .filter(|&i| {
                        codes
                            .get(row * k + block * len + i)
                            .is_some_and(|v| block * len + i < k && !v.is_zero())
                    })
                    .count(),
                allowed: pattern.nonzeros(),
            });
        }
        Ok(Self {
            pattern,
            rows,
            k,
            kept,
            ranks,
        })
    }

    /// The compact form of slid codes `[rows, K']` (un-slid first: exact for any output of the
    /// slide).
    pub fn from_slid(
        slid: &[T],
        rows: usize,
        geometry: &SlideGeometry,
        pattern: SparsityPattern,
        tensor: &str,
    ) -> Result<Self> {
        let k_prime = geometry.k_prime();
        if slid.len() != rows * k_prime {
            return Err(SlideSparseError::shape(
                "slid codes [rows, K']",
                rows * k_prime,
                slid.len(),
            ));
        }
        let mut pruned = vec![T::ZERO; rows * geometry.k];
        pruned
            .par_chunks_mut(geometry.k.max(1))
            .zip(slid.par_chunks(k_prime.max(1)))
            .try_for_each(|(out, row)| unslide_row(row, geometry, out))
            .map_err(|e| SlideSparseError::InvalidPackedFile {
                path: tensor.into(),
                detail: format!("the slid codes do not un-slide: {e:?}"),
            })?;
        Self::from_pruned(&pruned, rows, geometry.k, pattern, tensor)
    }

    /// The pruned row-major `[rows, k]` matrix, exactly.
    pub fn to_pruned(&self) -> Vec<T> {
        let len = self.pattern.block_len();
        let (blocks, kept_len, k) = (self.blocks(), len - 2, self.k);
        let mut out = vec![T::ZERO; self.rows * k];
        out.par_chunks_mut(k.max(1))
            .enumerate()
            .for_each(|(row, out)| {
                for b in 0..blocks {
                    let (p, q) = pair_of_rank(self.ranks[row * blocks + b] as usize, len);
                    let kept = &self.kept[(row * blocks + b) * kept_len..][..kept_len];
                    let mut next = kept.iter();
                    for i in 0..len {
                        let value = if i == p || i == q {
                            T::ZERO
                        } else {
                            *next.next().expect("2N-2 kept codes")
                        };
                        if let Some(slot) = out.get_mut(b * len + i) {
                            *slot = value;
                        }
                    }
                }
            });
        out
    }

    /// The slid `[rows, K']` codes, as the packer's greedy slide writes them from the pruned
    /// matrix (`geometry` must be `pattern.geometry(k, _)`). `Err((row, block, nonzeros))` for
    /// a block that does not slide: none does (each has two zeros), checked all the same.
    pub fn to_slid(
        &self,
        geometry: &SlideGeometry,
    ) -> std::result::Result<Vec<T>, (usize, usize, usize)> {
        let (k, k_prime) = (geometry.k, geometry.k_prime());
        let pruned = self.to_pruned();
        let mut out = vec![T::ZERO; self.rows * k_prime];
        if k_prime == 0 {
            return Ok(out);
        }
        out.par_chunks_mut(k_prime)
            .zip(pruned.par_chunks(k.max(1)))
            .enumerate()
            .try_for_each(|(row, (out, codes))| {
                slide_row(codes, geometry, out).map_err(|(block, nonzeros)| (row, block, nonzeros))
            })?;
        Ok(out)
    }

    /// Row `row` as the 2:4 row of width `geometry.k_prime()` that a sparse GEMM on this layout
    /// multiplies with the lifted activations: window `j` of block `b` holds the block's kept
    /// codes `2j` and `2j + 1` at the positions of [`window_nibble`] (`geometry` must be
    /// `pattern.geometry(k, _)`). Equal to the greedy slide's row where every kept code is
    /// nonzero; where some are zero the slide may move later codes into earlier windows, and
    /// both rows un-slide to the same pruned row.
    pub fn slid_row(&self, row: usize, geometry: &SlideGeometry) -> Vec<T> {
        let len = self.pattern.block_len();
        let (windows, kept_len) = (len / 2 - 1, len - 2);
        let mut out = vec![T::ZERO; geometry.k_prime()];
        for b in 0..self.blocks() {
            let rank = self.ranks[row * self.blocks() + b] as usize;
            let kept = &self.kept[(row * self.blocks() + b) * kept_len..][..kept_len];
            for j in 0..windows {
                let nibble = window_nibble(rank, j, len) as usize;
                let window = &mut out[4 * (b * windows + j)..][..4];
                window[nibble & 3] = kept[2 * j];
                window[nibble >> 2] = kept[2 * j + 1];
            }
        }
        out
    }

    /// Bytes of one row's ranks packed at [`rank_bits`] each ([`packed_ranks`](Self::packed_ranks)):
    /// `ceil(blocks * bits / 8)`.
    pub fn rank_row_bytes(pattern: SparsityPattern, k: usize) -> usize {
        (k.div_ceil(pattern.block_len()) * rank_bits(pattern) as usize).div_ceil(8)
    }

    /// The ranks packed at [`rank_bits`] each, row by row (`[rows, rank_row_bytes]`): block
    /// `b` of a row at bits `b * bits ..` of the row's bytes read as one little-endian number;
    /// the bits after the last block are zero. What the packed file stores.
    pub fn packed_ranks(&self) -> Vec<u8> {
        let (blocks, bits) = (self.blocks(), rank_bits(self.pattern) as usize);
        let row_bytes = Self::rank_row_bytes(self.pattern, self.k);
        let mut out = vec![0u8; self.rows * row_bytes];
        if row_bytes == 0 {
            return out;
        }
        out.par_chunks_mut(row_bytes)
            .zip(self.ranks.par_chunks(blocks))
            .for_each(|(out, ranks)| {
                for (b, &rank) in ranks.iter().enumerate() {
                    for bit in 0..bits {
                        let at = b * bits + bit;
                        out[at / 8] |= (((rank as usize) >> bit & 1) as u8) << (at % 8);
                    }
                }
            });
        out
    }

    /// The layout from its stored parts: `kept` (`[rows, blocks, 2N-2]`) and ranks packed as
    /// [`packed_ranks`](Self::packed_ranks) writes them. Checked, each failure an
    /// [`SlideSparseError::InvalidPackedFile`] for `path` naming `tensor`, its row and block:
    /// the sizes; every rank below `C(2N, 2)`; the bits after a row's last block zero; and, where
    /// `k` ends inside a block, no nonzero code at a position past `k` (it would be dropped).
    pub fn from_parts(
        pattern: SparsityPattern,
        rows: usize,
        k: usize,
        kept: Vec<T>,
        packed_ranks: &[u8],
        path: &str,
        tensor: &str,
    ) -> Result<Self> {
        let (len, blocks) = (pattern.block_len(), k.div_ceil(pattern.block_len()));
        let (bits, row_bytes) = (
            rank_bits(pattern) as usize,
            Self::rank_row_bytes(pattern, k),
        );
        let bad = |detail: String| SlideSparseError::packed(path, format!("{tensor}: {detail}"));
        if kept.len() != rows * blocks * (len - 2) || packed_ranks.len() != rows * row_bytes {
            return Err(bad(format!(
                "{} kept codes and {} rank bytes for {rows} rows of {blocks} blocks (expected {} \
                 and {})",
                kept.len(),
                packed_ranks.len(),
                rows * blocks * (len - 2),
                rows * row_bytes
            )));
        }
        let read = |row: &[u8], b: usize| {
            (0..bits).fold(0usize, |rank, bit| {
                let at = b * bits + bit;
                rank | ((row[at / 8] >> (at % 8) & 1) as usize) << bit
            })
        };
        let mut ranks = vec![0u16; rows * blocks];
        for row in 0..rows {
            let stored = &packed_ranks[row * row_bytes..(row + 1) * row_bytes];
            for b in 0..blocks {
                let rank = read(stored, b);
                if rank >= pair_count(len) {
                    return Err(bad(format!(
                        "row {row}, block {b}: zero-pair rank {rank} is not below C({len}, 2) = {}",
                        pair_count(len)
                    )));
                }
                ranks[row * blocks + b] = rank as u16;
            }
            let used = blocks * bits;
            if (used..row_bytes * 8).any(|at| stored[at / 8] >> (at % 8) & 1 == 1) {
                return Err(bad(format!(
                    "row {row}: nonzero bits after the last block's rank"
                )));
            }
        }
        let layout = Self {
            pattern,
            rows,
            k,
            kept,
            ranks,
        };
        if let Some((row, column)) = layout.first_code_past_k() {
            return Err(bad(format!(
                "row {row}: a nonzero code at column {column}, past K = {k}"
            )));
        }
        Ok(layout)
    }

    /// The first `(row, column)` whose kept code sits at a column `>= k` (in the last block,
    /// where `k` is not a multiple of `2N`) and is not zero.
    fn first_code_past_k(&self) -> Option<(usize, usize)> {
        let (len, blocks) = (self.pattern.block_len(), self.blocks());
        if self.k.is_multiple_of(len) {
            return None;
        }
        let b = blocks - 1;
        (0..self.rows).find_map(|row| {
            let (p, q) = pair_of_rank(self.ranks[row * blocks + b] as usize, len);
            let kept = &self.kept[(row * blocks + b) * (len - 2)..][..len - 2];
            let columns = (0..len).filter(|&i| i != p && i != q).map(|i| b * len + i);
            columns
                .zip(kept)
                .find(|&(column, code)| column >= self.k && !code.is_zero())
                .map(|(column, _)| (row, column))
        })
    }

    /// Bytes of the layout with ranks packed to [`rank_bits`] each: what a kernel reads.
    pub fn packed_bytes(&self) -> usize {
        let element = std::mem::size_of::<T>();
        let rank_bits = rank_bits(self.pattern) as usize;
        self.kept.len() * element + (self.ranks.len() * rank_bits).div_ceil(8)
    }
}

/// The kept codes (into `kept`) and zero-pair rank of one block read through `block(i)`, or
/// `None` if it holds fewer than two zeros.
fn compact_block<T: SlideElement>(
    block: impl Fn(usize) -> T,
    len: usize,
    kept: &mut [T],
) -> Option<usize> {
    let mut zeros = (0..len).filter(|&i| block(i).is_zero());
    let (p, q) = (zeros.next()?, zeros.next()?);
    let mut out = kept.iter_mut();
    for i in (0..len).filter(|&i| i != p && i != q) {
        // A zero kept among the codes is written as +0 (as the slide writes -0).
        let v = block(i);
        *out.next().expect("2N-2 slots") = if v.is_zero() { T::ZERO } else { v };
    }
    Some(pair_rank(p, q, len))
}

/// Rows of one decode tile (the MMA's M side).
pub const TILE_ROWS: usize = 16;
/// `k` of one full unit of a tile: 8 chunks of 64.
pub const UNIT_K: usize = 512;
/// `k` of one tail chunk.
pub const CHUNK_K: usize = 64;
/// Bytes of a full unit's codes and index (`UNIT_CODE_BYTES`, `UNIT_IDX_BYTES` in the kernel).
pub const UNIT_CODE_BYTES: usize = 6144;
/// See [`UNIT_CODE_BYTES`].
pub const UNIT_INDEX_BYTES: usize = 640;
/// Bytes of a tail chunk's codes and index.
pub const TAIL_CODE_BYTES: usize = 768;
/// See [`TAIL_CODE_BYTES`].
pub const TAIL_INDEX_BYTES: usize = 128;

/// A 6:8 INT8 matrix tiled for the decode kernel (`decode_gemv.cu`): rows in tiles of 16 (the
/// last padded with zero rows), `k` padded to a multiple of 64 with zero blocks, each tile's
/// `k` in full units of 512 then tail chunks of 64.
///
/// In a unit, thread `lane` (`g = lane / 4`, `t = lane % 4`) owns 32 blocks: block
/// `b = 4 c + 2 r + h` holds row `16 tile + g + 8 r`, columns `512 u + 64 c + 16 t + 8 h ..+8`
/// (chunk `c < 8`, row half `r`, half `h`). The unit's codes are 12 registers of 16 bytes per
/// lane, register-major (`reg * 512 + lane * 16`): registers 0..8 hold the first four kept
/// codes of block `b` as word `b`, registers 8..12 the last two as half-word `b`; its index is
/// five 32-bit words per lane, the ranks of its 32 blocks at bits `5 b`, stored as words 0..4
/// at `lane * 16` and word 4 at `512 + lane * 4`. A tail chunk holds the 4 blocks of chunk 0
/// (`b = 2 r + h`): four code words at `lane * 16`, two half-word pairs at `512 + lane * 8`,
/// and one index word (ranks at bits `5 b`) at `lane * 4` of its index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeTiles {
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub k: usize,
    /// Full units of each tile.
    pub units: usize,
    /// Tail chunks of each tile.
    pub tail: usize,
    /// Every tile's codes, tile after tile.
    pub codes: Vec<u8>,
    /// Every tile's index words, tile after tile.
    pub index: Vec<u32>,
}

impl DecodeTiles {
    /// Row tiles.
    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// Bytes the kernel reads for the weight: codes and index.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.index.len()
    }

    /// The tiled layout of a 6:8 INT8 compact matrix (other patterns and precisions are
    /// [`SlideSparseError::Unsupported`]: the decode kernel reads 6:8 INT8 only).
    pub fn new(compact: &CompactCodes<i8>) -> Result<Self> {
        if compact.pattern.block_len() != 8 {
            return Err(SlideSparseError::Unsupported {
                what: "the compact decode kernel".into(),
                why: format!(
                    "pattern {} (it reads 6:8 INT8; other patterns run the library GEMM)",
                    compact.pattern
                ),
            });
        }
        let k64 = compact.k.div_ceil(CHUNK_K) * CHUNK_K;
        let (units, tail) = (k64 / UNIT_K, (k64 % UNIT_K) / CHUNK_K);
        let tile_codes = units * UNIT_CODE_BYTES + tail * TAIL_CODE_BYTES;
        let tile_index = (units * UNIT_INDEX_BYTES + tail * TAIL_INDEX_BYTES) / 4;
        let tiles = compact.rows.div_ceil(TILE_ROWS);
        let mut codes = vec![0u8; tiles * tile_codes];
        let mut index = vec![0u32; tiles * tile_index];
        codes
            .par_chunks_mut(tile_codes.max(1))
            .zip(index.par_chunks_mut(tile_index.max(1)))
            .enumerate()
            .for_each(|(tile, (codes, index))| {
                let source = BlockSource { compact, tile };
                for u in 0..units {
                    fill_unit(
                        &source,
                        u,
                        &mut codes[u * UNIT_CODE_BYTES..][..UNIT_CODE_BYTES],
                        &mut index[u * UNIT_INDEX_BYTES / 4..][..UNIT_INDEX_BYTES / 4],
                    );
                }
                for c in 0..tail {
                    fill_tail(
                        &source,
                        units * UNIT_K + c * CHUNK_K,
                        &mut codes[units * UNIT_CODE_BYTES + c * TAIL_CODE_BYTES..]
                            [..TAIL_CODE_BYTES],
                        &mut index[(units * UNIT_INDEX_BYTES + c * TAIL_INDEX_BYTES) / 4..]
                            [..TAIL_INDEX_BYTES / 4],
                    );
                }
            });
        Ok(Self {
            rows: compact.rows,
            k: compact.k,
            units,
            tail,
            codes,
            index,
        })
    }
}

/// The 6:8 blocks of one row tile, zero past the matrix.
struct BlockSource<'a> {
    compact: &'a CompactCodes<i8>,
    tile: usize,
}

impl BlockSource<'_> {
    /// `(kept codes as bytes, rank)` of the block of tile row `row` starting at column `col`.
    fn block(&self, row: usize, col: usize) -> ([u8; 6], u32) {
        let c = self.compact;
        let (row, b) = (self.tile * TILE_ROWS + row, col / 8);
        if row >= c.rows || b >= c.blocks() {
            // A zero block: zeros at (0, 1), rank 0.
            return ([0; 6], 0);
        }
        let at = row * c.blocks() + b;
        let mut kept = [0u8; 6];
        for (out, &v) in kept.iter_mut().zip(&c.kept[at * 6..at * 6 + 6]) {
            *out = v as u8;
        }
        (kept, c.ranks[at] as u32)
    }
}

fn fill_unit(source: &BlockSource<'_>, u: usize, codes: &mut [u8], index: &mut [u32]) {
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let mut bits = [0u32; 5];
        for c in 0..8 {
            for r in 0..2 {
                for h in 0..2 {
                    let b = 4 * c + 2 * r + h;
                    let col = u * UNIT_K + c * CHUNK_K + 16 * t + 8 * h;
                    let (kept, rank) = source.block(g + 8 * r, col);
                    let lo = (b / 4) * 512 + lane * 16 + (b % 4) * 4;
                    codes[lo..lo + 4].copy_from_slice(&kept[..4]);
                    let half = b / 2;
                    let hi = (8 + half / 4) * 512 + lane * 16 + (half % 4) * 4 + (b % 2) * 2;
                    codes[hi..hi + 2].copy_from_slice(&kept[4..]);
                    let bit = 5 * b;
                    bits[bit / 32] |= rank << (bit % 32);
                    if bit % 32 > 27 {
                        bits[bit / 32 + 1] |= rank >> (32 - bit % 32);
                    }
                }
            }
        }
        index[lane * 4..lane * 4 + 4].copy_from_slice(&bits[..4]);
        index[128 + lane] = bits[4];
    }
}

fn fill_tail(source: &BlockSource<'_>, k0: usize, codes: &mut [u8], index: &mut [u32]) {
    for (lane, word) in index.iter_mut().enumerate().take(32) {
        let (g, t) = (lane / 4, lane % 4);
        let mut bits = 0u32;
        for r in 0..2 {
            for h in 0..2 {
                let b = 2 * r + h;
                let (kept, rank) = source.block(g + 8 * r, k0 + 16 * t + 8 * h);
                let lo = lane * 16 + b * 4;
                codes[lo..lo + 4].copy_from_slice(&kept[..4]);
                let hi = 512 + lane * 8 + b * 2;
                codes[hi..hi + 2].copy_from_slice(&kept[4..]);
                bits |= rank << (5 * b);
            }
        }
        *word = bits;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_rng::XorShift32;

    /// A uniform draw below `n`.
    fn below(rng: &mut XorShift32, n: usize) -> usize {
        rng.next_u32() as usize % n
    }

    #[test]
    fn ranks_enumerate_every_pair_once_in_order() {
        for pattern in SparsityPattern::all() {
            let len = pattern.block_len();
            let mut expected = 0;
            for p in 0..len {
                for q in p + 1..len {
                    assert_eq!(pair_rank(p, q, len), expected);
                    assert_eq!(pair_of_rank(expected, len), (p, q));
                    expected += 1;
                }
            }
            assert_eq!(expected, pair_count(len));
            assert!(pair_count(len) <= 1 << rank_bits(pattern));
            assert!(pair_count(len) > 1 << (rank_bits(pattern) - 1));
        }
    }

    /// Every block of every pattern up to 14:16 with at least two zeros (all 2^2N zero masks,
    /// the nonzeros distinct) round-trips, and every block with fewer is refused.
    #[test]
    fn every_block_mask_round_trips_or_is_refused() {
        for pattern in SparsityPattern::all().filter(|p| p.block_len() <= 16) {
            let len = pattern.block_len();
            for mask in 0u32..1 << len {
                let block: Vec<i8> = (0..len)
                    .map(|i| if mask >> i & 1 == 1 { i as i8 + 1 } else { 0 })
                    .collect();
                let result = CompactCodes::from_pruned(&block, 1, len, pattern, "w");
                if mask.count_ones() as usize > len - 2 {
                    assert!(result.is_err(), "{pattern} mask {mask:b}");
                } else {
                    assert_eq!(
                        result.unwrap().to_pruned(),
                        block,
                        "{pattern} mask {mask:b}"
                    );
                }
            }
        }
    }

    /// A random pruned matrix of `rows x k` with every block at exactly `2N-2` nonzeros
    /// (`extra_zeros`: some kept codes zero too), INT8 codes in [-127, 127].
    pub(crate) fn random_pruned(
        rng: &mut XorShift32,
        rows: usize,
        k: usize,
        pattern: SparsityPattern,
        extra_zeros: bool,
    ) -> Vec<i8> {
        let len = pattern.block_len();
        let mut w = vec![0i8; rows * k];
        for row in w.chunks_mut(k) {
            for block in row.chunks_mut(len) {
                let n = block.len();
                let (p, mut q) = (below(rng, n), below(rng, n));
                if q == p {
                    q = (p + 1) % n;
                }
                for (i, v) in block.iter_mut().enumerate() {
                    let code = below(rng, 255) as i32 - 127;
                    let zero = i == p || i == q || (extra_zeros && below(rng, 5) == 0);
                    *v = if zero { 0 } else { code as i8 };
                }
            }
        }
        w
    }

    #[test]
    fn random_matrices_round_trip_through_the_compact_and_slid_forms() {
        let mut rng = XorShift32(7);
        for pattern in SparsityPattern::all() {
            for &(rows, k) in &[(3, 64), (5, 70), (2, 576), (17, 1000)] {
                for extra in [false, true] {
                    let w = random_pruned(&mut rng, rows, k, pattern, extra);
                    let compact = CompactCodes::from_pruned(&w, rows, k, pattern, "w").unwrap();
                    assert_eq!(compact.to_pruned(), w, "{pattern} {rows}x{k}");
                    let geometry = pattern.geometry(k, 64);
                    let mut slid = vec![0i8; rows * geometry.k_prime()];
                    for (out, row) in slid.chunks_mut(geometry.k_prime()).zip(w.chunks(k)) {
                        crate::slide::slide_row(row, &geometry, out).unwrap();
                    }
                    let from_slid =
                        CompactCodes::from_slid(&slid, rows, &geometry, pattern, "w").unwrap();
                    assert_eq!(from_slid.to_pruned(), w);
                }
            }
        }
    }

    /// The stored parts (kept codes, packed ranks) read back to the same layout for every
    /// pattern and for rows whose rank bits do and do not end on a byte.
    #[test]
    fn packed_ranks_round_trip() {
        let mut rng = XorShift32(19);
        for pattern in SparsityPattern::all() {
            for &(rows, k) in &[(1, 8), (3, 70), (4, 576), (2, 1000)] {
                let w = random_pruned(&mut rng, rows, k, pattern, true);
                let compact = CompactCodes::from_pruned(&w, rows, k, pattern, "w").unwrap();
                let packed = compact.packed_ranks();
                assert_eq!(
                    packed.len(),
                    rows * CompactCodes::<i8>::rank_row_bytes(pattern, k)
                );
                let back = CompactCodes::from_parts(
                    pattern,
                    rows,
                    k,
                    compact.kept.clone(),
                    &packed,
                    "f",
                    "t",
                )
                .unwrap();
                assert_eq!(back, compact, "{pattern} {rows}x{k}");
            }
        }
    }

    /// Every way the stored parts can be wrong is an error naming the tensor, row and block.
    #[test]
    fn broken_parts_are_refused() {
        let pattern = SparsityPattern::P6_8;
        let mut rng = XorShift32(23);
        // K = 20: three blocks, the last holding 4 real columns; 15 rank bits per row.
        let (rows, k) = (2, 20);
        let w = random_pruned(&mut rng, rows, k, pattern, false);
        let compact = CompactCodes::from_pruned(&w, rows, k, pattern, "w").unwrap();
        let packed = compact.packed_ranks();
        let parts = |kept: Vec<i8>, packed: &[u8]| {
            CompactCodes::from_parts(pattern, rows, k, kept, packed, "f", "t")
                .unwrap_err()
                .to_string()
        };
        let err = parts(compact.kept[1..].to_vec(), &packed);
        assert!(err.contains("kept codes"), "{err}");
        // Rank 31 (all five bits set) in row 1, block 2: no such pair of 8 positions.
        let mut high = packed.clone();
        for bit in 10..15 {
            high[2 + bit / 8] |= 1 << (bit % 8);
        }
        let err = parts(compact.kept.clone(), &high);
        assert!(
            err.contains("row 1, block 2") && err.contains("rank 31"),
            "{err}"
        );
        // The 16th bit of a row: after the last rank.
        let mut trailing = packed.clone();
        trailing[1] |= 0x80;
        let err = parts(compact.kept.clone(), &trailing);
        assert!(err.contains("row 0: nonzero bits after"), "{err}");
        // Zero pair (0, 1) in the last block keeps columns 18.. 23: a code at column 20+.
        let mut past = compact.clone();
        past.ranks[2] = 0;
        past.kept[2 * 6..3 * 6].copy_from_slice(&[1, 2, 0, 3, 0, 0]);
        let err = parts(past.kept.clone(), &past.packed_ranks());
        assert!(
            err.contains("row 0: a nonzero code at column 21, past K = 20"),
            "{err}"
        );
    }

    /// Every window nibble of every rank of every pattern is one of the six valid 2:4 metadata
    /// values, and the table packs them in window order.
    #[test]
    fn window_metadata_holds_valid_nibbles_in_window_order() {
        const VALID: [u8; 6] = [0x4, 0x8, 0x9, 0xC, 0xD, 0xE];
        for pattern in SparsityPattern::all() {
            let len = pattern.block_len();
            let table = window_metadata(pattern);
            assert_eq!(table.len(), pair_count(len));
            for (rank, &word) in table.iter().enumerate() {
                for j in 0..len / 2 - 1 {
                    let nibble = window_nibble(rank, j, len);
                    assert!(VALID.contains(&nibble), "{pattern} rank {rank} window {j}");
                    assert_eq!((word >> (4 * j)) & 0xF, u64::from(nibble));
                }
                assert_eq!(word >> (4 * (len / 2 - 1)), 0, "{pattern} rank {rank}");
            }
        }
    }

    /// Every rank of every pattern: a block holding distinct nonzero codes at its kept positions
    /// expands ([`CompactCodes::slid_row`], the metadata from the rank alone) to exactly the
    /// greedy slide's 2:4 row, so the compact `kept` array is the slid row's compressed values.
    #[test]
    fn the_rank_table_gives_the_greedy_slide_of_every_block() {
        for pattern in SparsityPattern::all() {
            let len = pattern.block_len();
            let geometry = pattern.geometry(len, 4);
            for rank in 0..pair_count(len) {
                let (p, q) = pair_of_rank(rank, len);
                let block: Vec<i8> = (0..len)
                    .map(|i| if i == p || i == q { 0 } else { i as i8 + 1 })
                    .collect();
                let compact = CompactCodes::from_pruned(&block, 1, len, pattern, "w").unwrap();
                let mut slid = vec![0i8; geometry.k_prime()];
                crate::slide::slide_row(&block, &geometry, &mut slid).unwrap();
                assert_eq!(
                    compact.slid_row(0, &geometry),
                    slid,
                    "{pattern} rank {rank}"
                );
                // The 2:4 values of the slid row, window by window, are the kept codes.
                let values: Vec<i8> = slid.iter().copied().filter(|&v| v != 0).collect();
                assert_eq!(values, compact.kept, "{pattern} rank {rank}");
            }
        }
    }

    /// Random matrices of every pattern (kept codes zero now and then, `k` ending inside a
    /// block): the expanded rows are 2:4, un-slide to the pruned rows, and give the pruned
    /// product exactly with the lifted activations.
    #[test]
    fn expanded_rows_unslide_and_multiply_exactly() {
        let mut rng = XorShift32(29);
        for pattern in SparsityPattern::all() {
            for &(rows, k) in &[(3, 64), (4, 70), (2, 1000)] {
                let w = random_pruned(&mut rng, rows, k, pattern, true);
                let compact = CompactCodes::from_pruned(&w, rows, k, pattern, "w").unwrap();
                let geometry = pattern.geometry(k, 16);
                let x: Vec<i32> = (0..k).map(|_| below(&mut rng, 255) as i32 - 127).collect();
                let lift = geometry.lift_map_with_zero_column();
                for row in 0..rows {
                    let slid = compact.slid_row(row, &geometry);
                    assert_eq!(
                        crate::slide::first_2_4_violation(&slid, 1, slid.len()),
                        None,
                        "{pattern} {rows}x{k} row {row}"
                    );
                    let mut back = vec![0i8; k];
                    crate::slide::unslide_row(&slid, &geometry, &mut back).unwrap();
                    assert_eq!(back, w[row * k..(row + 1) * k], "{pattern} row {row}");
                    let lifted: i32 = slid
                        .iter()
                        .zip(&lift)
                        .map(|(&v, &src)| i32::from(v) * x.get(src).copied().unwrap_or(0))
                        .sum();
                    let dense: i32 = w[row * k..(row + 1) * k]
                        .iter()
                        .zip(&x)
                        .map(|(&v, &xv)| i32::from(v) * xv)
                        .sum();
                    assert_eq!(lifted, dense, "{pattern} {rows}x{k} row {row}");
                }
            }
        }
    }

    #[test]
    fn six_of_eight_int8_takes_0_83_of_the_dense_bytes() {
        let pattern: SparsityPattern = "6:8".parse().unwrap();
        let w = random_pruned(&mut XorShift32(1), 64, 4096, pattern, false);
        let compact = CompactCodes::from_pruned(&w, 64, 4096, pattern, "w").unwrap();
        let ratio = compact.packed_bytes() as f64 / (64.0 * 4096.0);
        assert!((ratio - 53.0 / 64.0).abs() < 1e-9, "{ratio}");
        assert_eq!(CompactRows::new(&compact).bytes(), compact.packed_bytes());
        let tiles = DecodeTiles::new(&compact).unwrap();
        assert_eq!(tiles.bytes(), compact.packed_bytes());
    }

    /// What the decode kernel computes for one block from the tiles: the PRMT table of
    /// `fill_expand_table` applied to the block's code words.
    fn kernel_expand(lo: u32, hi: u32, rank: u32) -> [u8; 8] {
        let (p, q) = pair_of_rank(rank as usize, 8);
        let src = [lo.to_le_bytes(), hi.to_le_bytes()].concat();
        let mut out = [0u8; 8];
        for (i, o) in out.iter_mut().enumerate() {
            let s = if i == p || i == q {
                6
            } else {
                i - (i > p) as usize - (i > q) as usize
            };
            *o = src[s];
        }
        out
    }

    fn word(bytes: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
    }

    /// Reads the tiles back exactly as the kernel does (unit and tail addressing, the 5-bit
    /// ranks across word boundaries, the half-words) and compares with the pruned matrix.
    fn read_back(tiles: &DecodeTiles) -> Vec<i8> {
        let mut out = vec![0i8; tiles.rows * tiles.k];
        let tile_codes = tiles.units * UNIT_CODE_BYTES + tiles.tail * TAIL_CODE_BYTES;
        let tile_index = (tiles.units * UNIT_INDEX_BYTES + tiles.tail * TAIL_INDEX_BYTES) / 4;
        let mut put = |row: usize, col: usize, e: [u8; 8]| {
            for (i, v) in e.iter().enumerate() {
                if row < tiles.rows && col + i < tiles.k {
                    out[row * tiles.k + col + i] = *v as i8;
                }
            }
        };
        for tile in 0..tiles.tiles() {
            let codes = &tiles.codes[tile * tile_codes..][..tile_codes];
            let index = &tiles.index[tile * tile_index..][..tile_index];
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for u in 0..tiles.units {
                    let uc = &codes[u * UNIT_CODE_BYTES..];
                    let ui = &index[u * UNIT_INDEX_BYTES / 4..];
                    let mut ix = [0u32; 5];
                    ix[..4].copy_from_slice(&ui[lane * 4..lane * 4 + 4]);
                    ix[4] = ui[128 + lane];
                    for b in 0..32 {
                        let (c, r, h) = (b / 4, (b / 2) % 2, b % 2);
                        let lo = word(uc, (b / 4) * 512 + lane * 16 + (b % 4) * 4);
                        let half = b / 2;
                        let hw = word(uc, (8 + half / 4) * 512 + lane * 16 + (half % 4) * 4);
                        let hi = if b % 2 == 1 { hw >> 16 } else { hw & 0xffff };
                        let (bit, w) = (5 * b, 5 * b / 32);
                        let rank = if bit % 32 <= 27 {
                            (ix[w] >> (bit % 32)) & 31
                        } else {
                            (((ix[w] as u64) | ((ix[w + 1] as u64) << 32)) >> (bit % 32)) as u32
                                & 31
                        };
                        let col = u * UNIT_K + c * CHUNK_K + 16 * t + 8 * h;
                        put(tile * 16 + g + 8 * r, col, kernel_expand(lo, hi, rank));
                    }
                }
                for ch in 0..tiles.tail {
                    let tc = &codes[tiles.units * UNIT_CODE_BYTES + ch * TAIL_CODE_BYTES..];
                    let ti = &index[(tiles.units * UNIT_INDEX_BYTES + ch * TAIL_INDEX_BYTES) / 4..];
                    for b in 0..4 {
                        let (r, h) = (b / 2, b % 2);
                        let lo = word(tc, lane * 16 + b * 4);
                        let hw = word(tc, 512 + lane * 8 + (b / 2) * 4);
                        let hi = if b % 2 == 1 { hw >> 16 } else { hw & 0xffff };
                        let rank = (ti[lane] >> (5 * b)) & 31;
                        let col = tiles.units * UNIT_K + ch * CHUNK_K + 16 * t + 8 * h;
                        put(tile * 16 + g + 8 * r, col, kernel_expand(lo, hi, rank));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn decode_tiles_read_back_as_the_kernel_reads_them() {
        let pattern: SparsityPattern = "6:8".parse().unwrap();
        let mut rng = XorShift32(3);
        // Full units only, units and tail, tail only, ragged rows and k.
        for &(rows, k) in &[(32, 1024), (48, 1600), (20, 576), (7, 200), (16, 4096)] {
            let w = random_pruned(&mut rng, rows, k, pattern, true);
            let compact = CompactCodes::from_pruned(&w, rows, k, pattern, "w").unwrap();
            let tiles = DecodeTiles::new(&compact).unwrap();
            assert_eq!(read_back(&tiles), w, "{rows}x{k}");
        }
    }

    #[test]
    fn other_patterns_are_not_tiled() {
        let pattern: SparsityPattern = "2:4".parse().unwrap();
        let w = random_pruned(&mut XorShift32(2), 16, 64, pattern, false);
        let compact = CompactCodes::from_pruned(&w, 16, 64, pattern, "w").unwrap();
        assert!(matches!(
            DecodeTiles::new(&compact),
            Err(SlideSparseError::Unsupported { .. })
        ));
    }
}
