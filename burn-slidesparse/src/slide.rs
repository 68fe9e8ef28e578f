//! The greedy slide of the spec: `(2N-2):2N` rows to 2:4 rows of width `K'`, its inverse
//! and the 2:4 verification.

use cubecl_kernels::geometry::{SlideGeometry, WINDOW};
use half::{bf16, f16};
use rayon::prelude::*;

/// A storage element the slide can move: it only needs a zero and a zero test.
pub trait SlideElement: Copy + Send + Sync + PartialEq + std::fmt::Debug {
    /// `+0` of the type.
    const ZERO: Self;
    /// Whether the element is zero (either sign).
    fn is_zero(self) -> bool;
}

impl SlideElement for i8 {
    const ZERO: Self = 0;
    fn is_zero(self) -> bool {
        self == 0
    }
}

/// `u8` holds FP8 E4M3 bit patterns: `0x00` and `0x80` (`-0`) are zero.
impl SlideElement for u8 {
    const ZERO: Self = 0;
    fn is_zero(self) -> bool {
        self & 0x7F == 0
    }
}

impl SlideElement for bf16 {
    const ZERO: Self = bf16::ZERO;
    fn is_zero(self) -> bool {
        self.to_bits() & 0x7FFF == 0
    }
}

impl SlideElement for f16 {
    const ZERO: Self = f16::ZERO;
    fn is_zero(self) -> bool {
        self.to_bits() & 0x7FFF == 0
    }
}

impl SlideElement for f32 {
    const ZERO: Self = 0.0;
    fn is_zero(self) -> bool {
        self == 0.0
    }
}

/// A block whose nonzeros do not fit the windows (more than `2N-2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SlideFailure {
    /// Row of the block.
    pub row: usize,
    /// Block index within the row.
    pub block: usize,
    /// Nonzeros the block holds.
    pub nonzeros: usize,
}

/// Slides one row of width `K` into `out` of width `K'` (which must start zeroed or will be
/// overwritten entirely). Returns the first block that does not fit.
pub fn slide_row<T: SlideElement>(
    row: &[T],
    geometry: &SlideGeometry,
    out: &mut [T],
) -> Result<(), (usize, usize)> {
    debug_assert_eq!(row.len(), geometry.k);
    debug_assert_eq!(out.len(), geometry.k_prime());
    let block_len = geometry.block_len();
    let windows = geometry.windows_per_block();
    out.fill(T::ZERO);
    let mut taken = [false; 2 * cubecl_kernels::geometry::MAX_N as usize];
    for b in 0..geometry.blocks() {
        let start = b * block_len;
        let real = (geometry.k - start).min(block_len);
        let block = |p: usize| if p < real { row[start + p] } else { T::ZERO };
        taken[..block_len].fill(false);
        let dst = &mut out[b * geometry.slid_block_len()..(b + 1) * geometry.slid_block_len()];
        for w in 0..windows {
            let mut count = 0;
            for l in 0..WINDOW {
                let p = 2 * w + l;
                let v = block(p);
                if !v.is_zero() && !taken[p] && count < 2 {
                    dst[WINDOW * w + l] = v;
                    taken[p] = true;
                    count += 1;
                }
            }
        }
        let left = (0..real)
            .filter(|&p| !block(p).is_zero() && !taken[p])
            .count();
        if left > 0 {
            let nonzeros = (0..real).filter(|&p| !block(p).is_zero()).count();
            return Err((b, nonzeros));
        }
    }
    Ok(())
}

/// Slides a row-major `[rows, K]` matrix to `[rows, K']`, in parallel over rows. On failure
/// returns the first (lowest row, then block) offending block. The packer slides row by row
/// inside its fused pass; this whole-matrix form is the staged reference its tests use.
#[cfg_attr(not(feature = "internals"), allow(dead_code))]
pub fn slide_matrix<T: SlideElement>(
    values: &[T],
    rows: usize,
    geometry: &SlideGeometry,
) -> Result<Vec<T>, SlideFailure> {
    let (k, kp) = (geometry.k, geometry.k_prime());
    assert_eq!(values.len(), rows * k, "slide_matrix: shape");
    let mut out = vec![T::ZERO; rows * kp];
    if kp == 0 {
        return Ok(out);
    }
    let first_failure = out
        .par_chunks_mut(kp)
        .enumerate()
        .filter_map(|(r, dst)| {
            slide_row(&values[r * k..(r + 1) * k], geometry, dst)
                .err()
                .map(|(block, nonzeros)| SlideFailure {
                    row: r,
                    block,
                    nonzeros,
                })
        })
        .min();
    match first_failure {
        None => Ok(out),
        Some(f) => Err(f),
    }
}

/// Where un-sliding a row went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum UnslideError {
    /// A nonzero sits in a padding column (`src(o)` is none).
    NonzeroInPadding {
        /// The slid column.
        column: usize,
    },
    /// Two slid columns put a nonzero into the same source column.
    Collision {
        /// The source column hit twice.
        column: usize,
    },
}

/// Inverse of the slide: scatters every nonzero of `slid` (width `K'`) back to its source
/// column. Exact inverse of [`slide_row`] on its outputs.
pub fn unslide_row<T: SlideElement>(
    slid: &[T],
    geometry: &SlideGeometry,
    out: &mut [T],
) -> Result<(), UnslideError> {
    out.fill(T::ZERO);
    // Walked block by block, so that `src(o)` is additions instead of a division per column
    // (`SlideGeometry::source`): the packer un-slides every row it packs.
    let (slid_block, block_len) = (geometry.slid_block_len(), geometry.block_len());
    let k_slide = geometry.k_slide().min(slid.len());
    for (g, block) in slid[..k_slide].chunks(slid_block).enumerate() {
        for (r, &v) in block.iter().enumerate() {
            if v.is_zero() {
                continue;
            }
            let o = g * slid_block + r;
            let src = g * block_len + 2 * (r / WINDOW) + r % WINDOW;
            if src >= geometry.k {
                return Err(UnslideError::NonzeroInPadding { column: o });
            }
            // Only nonzeros are written, so a nonzero already there is a second one for
            // `src` (no per-row `written` array).
            if !out[src].is_zero() {
                return Err(UnslideError::Collision { column: o });
            }
            out[src] = v;
        }
    }
    if let Some(o) = slid[k_slide..].iter().position(|v| !v.is_zero()) {
        return Err(UnslideError::NonzeroInPadding {
            column: k_slide + o,
        });
    }
    Ok(())
}

/// First aligned 4-wide window of a row-major `[rows, cols]` matrix holding more than two
/// nonzeros: `(row, first column, nonzeros)`.
pub fn first_2_4_violation<T: SlideElement>(
    values: &[T],
    rows: usize,
    cols: usize,
) -> Option<(usize, usize, usize)> {
    if cols == 0 {
        return None;
    }
    assert_eq!(values.len(), rows * cols);
    values
        .par_chunks(cols)
        .enumerate()
        .filter_map(|(r, row)| row_2_4_violation(row).map(|(c, nnz)| (r, c, nnz)))
        .min()
}

/// First aligned 4-wide window of one row holding more than two nonzeros: `(first column,
/// nonzeros)`.
pub fn row_2_4_violation<T: SlideElement>(row: &[T]) -> Option<(usize, usize)> {
    row.chunks(WINDOW).enumerate().find_map(|(w, win)| {
        let nnz = win.iter().filter(|v| !v.is_zero()).count();
        (nnz > 2).then_some((w * WINDOW, nnz))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_example_six_eight() {
        let g = SlideGeometry::new(4, 8, 32);
        let row = [1.0f32, 0.0, 2.0, 3.0, 0.0, 4.0, 5.0, 6.0];
        let mut out = vec![0.0; g.k_prime()];
        slide_row(&row, &g, &mut out).unwrap();
        // window 0 (cols 0..4): 1, 2 taken; 3 left for window 1 (cols 2..6) with 4;
        // window 2 (cols 4..8): 5, 6.
        assert_eq!(
            &out[..12],
            &[1.0, 0.0, 2.0, 0.0, 0.0, 3.0, 0.0, 4.0, 0.0, 0.0, 5.0, 6.0]
        );
        assert!(out[12..].iter().all(|v| *v == 0.0));
        let mut back = vec![0.0; 8];
        unslide_row(&out, &g, &mut back).unwrap();
        assert_eq!(back, row);
    }

    /// The un-slide by its definition: `source(o)` per column and a `written` flag per source.
    fn unslide_by_definition(
        slid: &[i8],
        g: &SlideGeometry,
        out: &mut [i8],
    ) -> Result<(), UnslideError> {
        out.fill(0);
        let mut written = vec![false; g.k];
        for (o, &v) in slid.iter().enumerate() {
            if v == 0 {
                continue;
            }
            let src = g
                .source(o)
                .ok_or(UnslideError::NonzeroInPadding { column: o })?;
            if written[src] {
                return Err(UnslideError::Collision { column: o });
            }
            written[src] = true;
            out[src] = v;
        }
        Ok(())
    }

    /// Random slid rows, valid or not (nonzeros anywhere, padding and collisions included):
    /// the block-wise un-slide agrees with the definition on the result and on the error.
    #[test]
    fn unslide_agrees_with_its_definition_on_any_row() {
        let mut rng = crate::test_rng::XorShift32(0x2545_F491);
        let mut next = move || rng.next_u32();
        for case in 0..4000 {
            let n = 2 + next() % 7;
            let k = 1 + (next() % 70) as usize;
            let g = SlideGeometry::new(n, k, 16);
            let density = next() % 100;
            let slid: Vec<i8> = (0..g.k_prime())
                .map(|_| {
                    if next() % 100 < density {
                        1 + (next() % 9) as i8
                    } else {
                        0
                    }
                })
                .collect();
            let (mut a, mut b) = (vec![7i8; k], vec![7i8; k]);
            let (ra, rb) = (
                unslide_row(&slid, &g, &mut a),
                unslide_by_definition(&slid, &g, &mut b),
            );
            assert_eq!(ra, rb, "case {case}: n={n} k={k}");
            if ra.is_ok() {
                assert_eq!(a, b, "case {case}");
            }
        }
    }

    #[test]
    fn too_many_nonzeros_is_reported() {
        let g = SlideGeometry::new(3, 12, 32);
        let row = [1i8, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1];
        let err = slide_matrix(&row, 1, &g).unwrap_err();
        assert_eq!(
            err,
            SlideFailure {
                row: 0,
                block: 1,
                nonzeros: 6
            }
        );
    }

    #[test]
    fn negative_zero_is_written_as_positive_zero() {
        let g = SlideGeometry::new(2, 4, 16);
        let out = slide_matrix(&[-0.0f32, 1.0, -0.0, 2.0], 1, &g).unwrap();
        assert!(out.iter().all(|v| v.to_bits() != (-0.0f32).to_bits()));
        let out = slide_matrix(&[0x80u8, 0x38, 0x80, 0x38], 1, &g).unwrap();
        assert_eq!(&out[..4], &[0, 0x38, 0, 0x38]);
    }
}
