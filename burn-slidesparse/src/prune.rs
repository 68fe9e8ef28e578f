//! Pruning dense `[out, in]` weights to a `(2N-2):2N` pattern, and checking that a weight
//! already satisfies one.

use std::{borrow::Cow, fmt, str::FromStr};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
};

mod allocate;
mod sparsegpt;

pub use allocate::{AllocationGroup, PatternCandidate, allocate_patterns};
pub(crate) use sparsegpt::obs_column_factors;
pub use sparsegpt::{KeptWeightGrid, SparseGptCalibration};

/// How to choose the weights that survive in each block.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub enum PruneMethod {
    /// Keep the `2N-2` largest `|w|` of every block; ties keep the lower index.
    #[default]
    Magnitude,
    /// Wanda-style: keep the `2N-2` best `|W[n,k]| * ||X[:,k]||_2` of every block, given the
    /// per-input-channel activation norms of calibration tokens.
    ActivationAware {
        /// `||X[:,k]||_2` for every input channel `k`.
        input_norms: Vec<f32>,
    },
    /// SparseGPT-style, with weight reconstruction: each aligned `2N` group of every row
    /// drops the two weights of smallest saliency `w^2 / [H^-1]_jj^2` (`H` = the damped
    /// `X^T X` of calibration inputs), going through the input columns left to right, and the
    /// kept weights to the right are updated to compensate (the optimal brain surgeon update).
    /// The kept weights change: the result minimizes `||X W^T - X Ŵ^T||` far better than
    /// choosing a mask alone. Needs the layer's calibration Gram matrix.
    SparseGpt(SparseGptCalibration),
    /// Do not prune: the weight must already satisfy the pattern (checked).
    None,
}

impl fmt::Display for PruneMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PruneMethod::Magnitude => "magnitude",
            PruneMethod::ActivationAware { .. } => "activation-aware",
            PruneMethod::SparseGpt(_) => "sparsegpt",
            PruneMethod::None => "none",
        })
    }
}

impl FromStr for PruneMethod {
    type Err = SlideSparseError;
    /// Parses `magnitude` or `none`; activation-aware (Wanda) and SparseGPT pruning need
    /// calibration data from a model's forward pass and are built in code.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "magnitude" => Ok(PruneMethod::Magnitude),
            "none" => Ok(PruneMethod::None),
            "wanda" | "activation-aware" | "sparsegpt" => Err(SlideSparseError::Backend(format!(
                "prune method {s:?} needs calibration activations from a forward pass of the \
                 model, which packing a checkpoint file does not run: select it through the API \
                 (PruneMethod::{}), or use magnitude or none",
                if s == "sparsegpt" {
                    "SparseGpt"
                } else {
                    "ActivationAware"
                }
            ))),
            _ => Err(SlideSparseError::Backend(format!(
                "invalid prune method {s:?}: expected magnitude or none (activation-aware and \
                 SparseGPT pruning need calibration data and are selected through the API)"
            ))),
        }
    }
}

/// Returns an error naming the first non-finite weight, if any.
pub fn check_finite(tensor: &str, values: &[f32], cols: usize) -> Result<()> {
    // In parallel, a row per task, each row scanned without early exit so that it
    // vectorizes: a single-threaded scan of an 8B model's weights is seconds, and a
    // per-element parallel search (`position_first`) was a third of the packer's time.
    let cols = cols.max(1);
    let row_is_finite = |row: &[f32]| row.iter().fold(true, |ok, v| ok & v.is_finite());
    let bad_row = values
        .par_chunks(cols)
        .position_first(|row| !row_is_finite(row));
    let first = bad_row.map(|r| {
        let row = &values[r * cols..(r * cols + cols).min(values.len())];
        r * cols + row.iter().position(|v| !v.is_finite()).unwrap_or(0)
    });
    match first {
        None => Ok(()),
        Some(i) => Err(SlideSparseError::NonFiniteWeight {
            tensor: tensor.to_string(),
            row: i / cols,
            column: i % cols,
            value: values[i],
        }),
    }
}

/// Prunes a row-major `[rows, cols]` weight with `method`; returns the pruned copy.
/// `PruneMethod::None` only checks the pattern.
pub fn prune(
    tensor: &str,
    values: &[f32],
    rows: usize,
    cols: usize,
    pattern: SparsityPattern,
    method: &PruneMethod,
) -> Result<Vec<f32>> {
    match row_pruner(tensor, values, rows, cols, pattern, method)? {
        RowPruner::Scored { input_norms } => Ok(match input_norms {
            None => prune_by_score(values, cols, pattern, |_, w| w.abs()),
            Some(norms) => prune_by_score(values, cols, pattern, |k, w| w.abs() * norms[k]),
        }),
        RowPruner::Matrix(pruned) => Ok(pruned.into_owned()),
        RowPruner::Gridded { values, .. } => Ok(values),
    }
}

/// Where each pruned row comes from: the packer's fused row pass prunes row-local methods
/// row by row, next to quantizing and sliding the row, instead of writing a pruned matrix.
pub(crate) enum RowPruner<'a> {
    /// Scored row by row: `|w|` (magnitude), times the input norms if given (activation-aware).
    Scored {
        /// `||X[:,k]||_2` per input channel, for activation-aware pruning.
        input_norms: Option<&'a [f32]>,
    },
    /// The whole pruned matrix, computed up front (SparseGPT's column sweep couples a row's
    /// columns through the Hessian; `None` is the input itself, checked).
    Matrix(Cow<'a, [f32]>),
    /// As `Matrix`, with every row on an 8-bit grid of its own scale (SparseGPT with a
    /// [`KeptWeightGrid`]): the row must be quantized with that scale.
    Gridded {
        /// The pruned, rounded matrix.
        values: Vec<f32>,
        /// The scale of each row.
        scales: Vec<f32>,
    },
}

impl RowPruner<'_> {
    /// Writes pruned row `r` (dense `src`) into `dst`.
    pub(crate) fn prune_row(
        &self,
        r: usize,
        src: &[f32],
        dst: &mut [f32],
        pattern: SparsityPattern,
    ) {
        match self {
            RowPruner::Scored { input_norms: None } => {
                prune_row_by_score(src, dst, pattern, |_, w| w.abs())
            }
            RowPruner::Scored {
                input_norms: Some(norms),
            } => prune_row_by_score(src, dst, pattern, |k, w| w.abs() * norms[k]),
            RowPruner::Matrix(m) => dst.copy_from_slice(&m[r * src.len()..(r + 1) * src.len()]),
            RowPruner::Gridded { values, .. } => {
                dst.copy_from_slice(&values[r * src.len()..(r + 1) * src.len()])
            }
        }
    }

    /// The scale row `r` must be quantized with, where the pruner fixed one.
    pub(crate) fn row_scale(&self, r: usize) -> Option<f32> {
        match self {
            RowPruner::Gridded { scales, .. } => Some(scales[r]),
            _ => None,
        }
    }

    /// Every row's fixed scale, where the pruner fixed them.
    pub(crate) fn scales(&self) -> Option<&[f32]> {
        match self {
            RowPruner::Gridded { scales, .. } => Some(scales),
            _ => None,
        }
    }
}

/// Checks the weight and the method's calibration data and says how rows get pruned
/// (whole-matrix methods run here).
pub(crate) fn row_pruner<'a>(
    tensor: &str,
    values: &'a [f32],
    rows: usize,
    cols: usize,
    pattern: SparsityPattern,
    method: &'a PruneMethod,
) -> Result<RowPruner<'a>> {
    check_shape(tensor, values, rows, cols)?;
    check_finite(tensor, values, cols)?;
    match method {
        PruneMethod::None => {
            check_pattern(tensor, values, rows, cols, pattern)?;
            Ok(RowPruner::Matrix(Cow::Borrowed(values)))
        }
        PruneMethod::Magnitude => Ok(RowPruner::Scored { input_norms: None }),
        PruneMethod::ActivationAware { input_norms } => {
            if input_norms.len() != cols {
                return Err(SlideSparseError::CalibrationMismatch {
                    tensor: tensor.to_string(),
                    expected: cols,
                    actual: input_norms.len(),
                });
            }
            if let Some(k) = input_norms.iter().position(|v| !v.is_finite() || *v < 0.0) {
                return Err(SlideSparseError::Backend(format!(
                    "{tensor}: activation norm of input channel {k} is {} (must be finite and >= 0)",
                    input_norms[k]
                )));
            }
            Ok(RowPruner::Scored {
                input_norms: Some(input_norms),
            })
        }
        PruneMethod::SparseGpt(calibration) => {
            let out = sparsegpt::prune_sparsegpt(tensor, values, rows, cols, pattern, calibration)?;
            // The pattern is the contract whatever the arithmetic did: checked, not assumed.
            check_pattern(tensor, &out.values, rows, cols, pattern)?;
            Ok(if out.scales.is_empty() {
                RowPruner::Matrix(Cow::Owned(out.values))
            } else {
                RowPruner::Gridded {
                    values: out.values,
                    scales: out.scales,
                }
            })
        }
    }
}

fn check_shape(tensor: &str, values: &[f32], rows: usize, cols: usize) -> Result<()> {
    if Some(values.len()) != rows.checked_mul(cols) {
        return Err(SlideSparseError::shape(
            tensor,
            [rows, cols],
            format!("{} elements", values.len()),
        ));
    }
    Ok(())
}

/// Keeps, in every block of every row, the `2N-2` columns with the best score (ties: lower
/// column). A final partial block (K not a multiple of 2N) counts its padding as zeros, so
/// it keeps `min(real columns, 2N-2)`.
///
/// A block of `2N` keeps `2N-2`, so at most two columns are dropped per block: the two worst
/// scores (ties: the higher column goes), found in one pass instead of a sort.
fn prune_by_score(
    values: &[f32],
    cols: usize,
    pattern: SparsityPattern,
    score: impl Fn(usize, f32) -> f32 + Sync,
) -> Vec<f32> {
    if cols == 0 {
        return values.to_vec();
    }
    // Copied row by row inside the parallel loop (a zeroed allocation is lazily mapped), not
    // with one single-threaded `to_vec` first.
    let mut out = vec![0.0f32; values.len()];
    out.par_chunks_mut(cols)
        .zip(values.par_chunks(cols))
        .for_each(|(row, src)| prune_row_by_score(src, row, pattern, &score));
    out
}

/// One row of [`prune_by_score`]: copies `src` into `row` and zeroes, in every block, the (at
/// most two) columns of worst score. The packer's fused row pass calls it directly.
#[inline]
pub(crate) fn prune_row_by_score(
    src: &[f32],
    row: &mut [f32],
    pattern: SparsityPattern,
    score: impl Fn(usize, f32) -> f32,
) {
    let (block, keep, cols) = (pattern.block_len(), pattern.nonzeros(), src.len());
    row.copy_from_slice(src);
    // Each score is computed once, into a block-sized array (comparing against the current
    // worst by recomputing its score tripled the scoring work).
    let mut scores = [0.0f32; 2 * cubecl_kernels::geometry::MAX_N as usize];
    for start in (0..cols).step_by(block) {
        let values = &mut row[start..(start + block).min(cols)];
        let drop = values.len().saturating_sub(keep);
        if drop == 0 {
            continue;
        }
        for (i, v) in values.iter().enumerate() {
            scores[i] = score(start + i, *v);
        }
        // The two columns to drop, worst first: a lower score is worse, and among equal
        // scores the higher column is worse (so `<=`: a later column displaces an equal
        // one). Scores are finite or +inf, so +inf as an empty slot's score yields to any.
        // Written as selects, not branches: branching on the data mispredicted on most
        // blocks of real weights.
        let (mut w0, mut w1) = (0usize, 0usize);
        let (mut s0, mut s1) = (f32::INFINITY, f32::INFINITY);
        for (i, &s) in scores[..values.len()].iter().enumerate() {
            let (first, second) = (s <= s0, s <= s1);
            (w1, s1) = if first {
                (w0, s0)
            } else if second {
                (i, s)
            } else {
                (w1, s1)
            };
            (w0, s0) = if first { (i, s) } else { (w0, s0) };
        }
        values[w0] = 0.0;
        if drop == 2 {
            values[w1] = 0.0;
        }
    }
    // -0.0 is zero; store +0.0 so that later stages never see a signed zero.
    row.iter_mut().filter(|v| **v == 0.0).for_each(|v| *v = 0.0);
}

/// Checks that every block of every row has at most `2N-2` nonzeros; the error names the
/// first offending (row, block).
pub fn check_pattern(
    tensor: &str,
    values: &[f32],
    rows: usize,
    cols: usize,
    pattern: SparsityPattern,
) -> Result<()> {
    check_shape(tensor, values, rows, cols)?;
    let block = pattern.block_len();
    let allowed = pattern.nonzeros();
    let first = (0..rows)
        .into_par_iter()
        .filter_map(|r| {
            let row = &values[r * cols..(r + 1) * cols];
            row.chunks(block).enumerate().find_map(|(b, chunk)| {
                let nnz = chunk.iter().filter(|v| **v != 0.0).count();
                (nnz > allowed).then_some((r, b, nnz))
            })
        })
        .min();
    match first {
        None => Ok(()),
        Some((row, b, nonzeros)) => Err(SlideSparseError::PatternViolation {
            tensor: tensor.to_string(),
            pattern: pattern.to_string(),
            row,
            block: b,
            start: b * block,
            end: ((b + 1) * block).min(cols),
            nonzeros,
            allowed,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magnitude_keeps_the_largest_and_breaks_ties_low() {
        let w = [1.0, -5.0, 3.0, 3.0, 0.5, 2.0, -3.0, 4.0];
        let p = prune(
            "w",
            &w,
            1,
            8,
            SparsityPattern::P6_8,
            &PruneMethod::Magnitude,
        )
        .unwrap();
        // Smallest |w|: 0.5 and 1.0 go.
        assert_eq!(p, [0.0, -5.0, 3.0, 3.0, 0.0, 2.0, -3.0, 4.0]);
        // Ties: three 3s and 2:4 keeps two; the lower indices win.
        let w = [3.0, 3.0, 3.0, 1.0];
        let p = prune(
            "w",
            &w,
            1,
            4,
            SparsityPattern::P2_4,
            &PruneMethod::Magnitude,
        )
        .unwrap();
        assert_eq!(p, [3.0, 3.0, 0.0, 0.0]);
    }

    /// The rule by its definition: sort each block's columns by (score ascending, column
    /// descending) and zero the first `len - keep`.
    fn prune_by_sorting(
        values: &[f32],
        cols: usize,
        pattern: SparsityPattern,
        norms: &[f32],
    ) -> Vec<f32> {
        let mut out = values.to_vec();
        for row in out.chunks_mut(cols) {
            for start in (0..cols).step_by(pattern.block_len()) {
                let end = (start + pattern.block_len()).min(cols);
                let mut order: Vec<usize> = (start..end).collect();
                let score = |k: usize| row[k].abs() * norms[k];
                order.sort_by(|&a, &b| score(a).total_cmp(&score(b)).then(b.cmp(&a)));
                let drop = (end - start).saturating_sub(pattern.nonzeros());
                for &k in &order[..drop] {
                    row[k] = 0.0;
                }
            }
            row.iter_mut().filter(|v| **v == 0.0).for_each(|v| *v = 0.0);
        }
        out
    }

    /// Random rows with many ties (small integers) and random widths: the one-pass selection
    /// of the two worst columns drops exactly what sorting drops, for every pattern.
    #[test]
    fn scored_pruning_equals_sorting_each_block() {
        let mut rng = crate::test_rng::XorShift32(0x1234_5678);
        let mut next = move || rng.next_u32();
        for case in 0..3000 {
            let pattern = SparsityPattern::from_n(2 + next() % 15).unwrap();
            let (rows, cols) = (1 + (next() % 4) as usize, 1 + (next() % 60) as usize);
            let values: Vec<f32> = (0..rows * cols)
                .map(|_| (next() % 7) as f32 - 3.0)
                .collect();
            let ones = vec![1.0f32; cols];
            let norms: Vec<f32> = (0..cols).map(|_| (next() % 4) as f32 * 0.5).collect();
            let magnitude =
                prune("w", &values, rows, cols, pattern, &PruneMethod::Magnitude).unwrap();
            assert_eq!(
                magnitude,
                prune_by_sorting(&values, cols, pattern, &ones),
                "case {case}"
            );
            let method = PruneMethod::ActivationAware {
                input_norms: norms.clone(),
            };
            let aware = prune("w", &values, rows, cols, pattern, &method).unwrap();
            assert_eq!(
                aware,
                prune_by_sorting(&values, cols, pattern, &norms),
                "case {case}"
            );
        }
    }

    #[test]
    fn activation_aware_uses_the_norms() {
        let w = [1.0, 1.0, 1.0, 1.0];
        let norms = vec![0.1, 5.0, 0.2, 3.0];
        let method = PruneMethod::ActivationAware { input_norms: norms };
        let p = prune("w", &w, 1, 4, SparsityPattern::P2_4, &method).unwrap();
        assert_eq!(p, [0.0, 1.0, 0.0, 1.0]);
        let bad = PruneMethod::ActivationAware {
            input_norms: vec![1.0; 3],
        };
        assert!(prune("w", &w, 1, 4, SparsityPattern::P2_4, &bad).is_err());
    }

    #[test]
    fn partial_last_block_counts_padding_as_zero() {
        // K = 11 with 6:8: the last block has 3 real columns, which all fit.
        let w: Vec<f32> = (1..=11).map(|v| v as f32).collect();
        let p = prune(
            "w",
            &w,
            1,
            11,
            SparsityPattern::P6_8,
            &PruneMethod::Magnitude,
        )
        .unwrap();
        assert_eq!(&p[8..], &[9.0, 10.0, 11.0]);
        assert_eq!(p[..8].iter().filter(|v| **v != 0.0).count(), 6);
    }

    #[test]
    fn check_reports_the_first_offending_block() {
        let mut w = vec![0.0; 2 * 16];
        w[16 + 8..16 + 15].iter_mut().for_each(|v| *v = 1.0); // row 1, block 1: 7 nonzeros
        let err = check_pattern("layer.w", &w, 2, 16, SparsityPattern::P6_8).unwrap_err();
        match err {
            SlideSparseError::PatternViolation {
                row,
                block,
                nonzeros,
                ..
            } => assert_eq!((row, block, nonzeros), (1, 1, 7)),
            e => panic!("{e}"),
        }
    }

    #[test]
    fn non_finite_weights_are_refused() {
        let w = [1.0, f32::NAN, 0.0, 0.0];
        let err = prune(
            "w",
            &w,
            1,
            4,
            SparsityPattern::P2_4,
            &PruneMethod::Magnitude,
        );
        assert!(matches!(
            err,
            Err(SlideSparseError::NonFiniteWeight { column: 1, .. })
        ));
    }
}
