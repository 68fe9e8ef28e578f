//! SparseGPT-style one-shot pruning to a `(2N-2):2N` pattern with weight reconstruction.
//!
//! For a linear layer `y = W x` with calibration inputs `X [n, K]`, the layer-wise objective
//! `||X W^T - X Ŵ^T||^2` has the Hessian `H = 2 X^T X` (the same for every output row).
//! Going through the input columns left to right, each aligned group of `2N` columns of
//! every row drops the two weights with the smallest saliency `w^2 / [H^-1]_jj^2`, and the
//! error of each dropped weight is propagated onto the columns to its right (the optimal
//! brain surgeon update restricted to the not-yet-processed columns). The sequential
//! elimination uses the upper Cholesky factor `U` of `H^-1` (`H^-1 = U^T U`): row `j` of `U`,
//! divided by `U_jj`, is the update direction when column `j` is removed. Columns are handled
//! in lazy batches: the updates inside a batch are applied at once, the updates of the
//! columns right of it once per batch.
//!
//! The scale of `H` does not matter (the saliency ranking and the updates are invariant to a
//! positive factor, and the damping is relative to the mean diagonal), so callers pass the
//! Gram matrix `X^T X` summed over any number of tokens.
//!
//! With a [`KeptWeightGrid`] other than `Exact`, each kept weight is also rounded, when its
//! column is reached, to the 8-bit grid the packer will quantize its row to, and its rounding
//! error is propagated like a dropped weight's (SparseGPT's joint sparsification and
//! quantization, the GPTQ rule): the columns to its right compensate the quantization too.
//!
//! All linear algebra is in f64; the rows are independent given `U` and run in parallel.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{
    error::{Result, SlideSparseError},
    fp8,
    pattern::SparsityPattern,
};

/// Rows handled together by one task: the rows of a chunk share every read of `U`.
const ROWS_PER_TASK: usize = 16;

/// Calibration and settings of SparseGPT pruning for one layer
/// ([`PruneMethod::SparseGpt`](crate::PruneMethod::SparseGpt)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SparseGptCalibration {
    /// Row-major `[K, K]` Gram matrix `X^T X` of the layer's calibration inputs `X [n, K]`
    /// (any positive multiple of the Hessian `2 X^T X`: the result does not depend on it).
    pub gram: Vec<f64>,
    /// Added to the diagonal of `H`, relative to its mean ([`Self::DEFAULT_DAMPING`]: 1%).
    pub damping: f64,
    /// Lazy-batch width in columns, rounded up to a multiple of `2N`
    /// ([`Self::DEFAULT_BLOCK_SIZE`]: 128). The result does not depend on it up to rounding.
    pub block_size: usize,
    /// Whether the kept weights are rounded to the packer's 8-bit grid during the sweep
    /// ([`KeptWeightGrid::Exact`] by default: they are quantized afterwards, by the packer).
    #[serde(default)]
    pub grid: KeptWeightGrid,
}

/// The values SparseGPT leaves a kept weight at (see the module comment).
///
/// The grid of a row is the packer's per-row 8-bit quantization with the scale of the *dense*
/// row (`s = max|w| / QMAX`; 1 for an all-zero row), fixed before the sweep (an update that
/// pushes a weight past the grid's end is clamped there). The packer quantizes such a row with
/// that same `s` (not with the pruned row's own maximum, which may be smaller), so the grid
/// points are exactly its codes; the packed precision must be the grid's (checked by
/// [`PackOptions::validate`](crate::PackOptions::validate)). [`prune`](crate::prune) returns
/// the values alone: quantized again by [`QuantizedWeight::quantize`](crate::QuantizedWeight),
/// a row whose maximum shrank gets its own finer scale.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeptWeightGrid {
    /// Kept weights take any value.
    #[default]
    Exact,
    /// INT8: `clamp(round_half_even(w / s), -127, 127) * s`.
    Int8,
    /// FP8 E4M3: `e4m3_round_saturate(w / s) * s`, `s = max|w| / 448`.
    Fp8,
}

impl KeptWeightGrid {
    /// The largest code magnitude, `None` for [`Exact`](Self::Exact).
    fn qmax(self) -> Option<f32> {
        match self {
            KeptWeightGrid::Exact => None,
            KeptWeightGrid::Int8 => Some(127.0),
            KeptWeightGrid::Fp8 => Some(fp8::E4M3_MAX),
        }
    }

    /// The scale of each row of a row-major `[rows, cols]` weight, as the packer computes it
    /// (`row_scale`); empty for [`Exact`](Self::Exact).
    fn row_scales(self, values: &[f32], cols: usize) -> Vec<f32> {
        let Some(qmax) = self.qmax() else {
            return Vec::new();
        };
        values
            .chunks(cols.max(1))
            .map(|row| {
                let absmax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                if absmax == 0.0 { 1.0 } else { absmax / qmax }
            })
            .collect()
    }

    /// `w` on the grid of scale `s`; `None` for [`Exact`](Self::Exact).
    fn round(self, w: f64, s: f64) -> Option<f64> {
        match self {
            KeptWeightGrid::Exact => None,
            KeptWeightGrid::Int8 => Some((w / s).round_ties_even().clamp(-127.0, 127.0) * s),
            KeptWeightGrid::Fp8 => Some(fp8::round_to_e4m3((w / s) as f32) as f64 * s),
        }
    }
}

impl SparseGptCalibration {
    /// SparseGPT's default relative damping: 1% of the mean diagonal of `H` is added to it.
    pub const DEFAULT_DAMPING: f64 = 0.01;
    /// SparseGPT's default lazy-batch width in columns (rounded up to a multiple of `2N`).
    pub const DEFAULT_BLOCK_SIZE: usize = 128;

    /// The default damping and block size for a Gram matrix `X^T X` (`[K, K]`, row-major).
    pub fn new(gram: Vec<f64>) -> Self {
        Self {
            gram,
            damping: Self::DEFAULT_DAMPING,
            block_size: Self::DEFAULT_BLOCK_SIZE,
            grid: KeptWeightGrid::Exact,
        }
    }

    /// The Gram matrix `X^T X` of row-major calibration inputs `x [tokens, k]`, accumulated
    /// in f64 (`O(tokens * k^2)`: for large calibration sets, accumulate the products on a
    /// backend and pass them to [`new`](Self::new)).
    pub fn from_inputs(x: &[f32], tokens: usize, k: usize) -> Result<Self> {
        if Some(x.len()) != tokens.checked_mul(k) {
            return Err(SlideSparseError::shape(
                "SparseGPT calibration inputs",
                [tokens, k],
                format!("{} elements", x.len()),
            ));
        }
        let mut gram = vec![0.0f64; k * k];
        gram.par_chunks_mut(k.max(1))
            .enumerate()
            .for_each(|(i, row)| {
                for t in 0..tokens {
                    let xt = &x[t * k..(t + 1) * k];
                    let xi = xt[i] as f64;
                    if xi != 0.0 {
                        for (g, &xj) in row.iter_mut().zip(xt) {
                            *g += xi * xj as f64;
                        }
                    }
                }
            });
        Ok(Self::new(gram))
    }
}

/// What SparseGPT returns for one layer.
pub(crate) struct SparseGptOutput {
    /// The pruned (and, on a grid, rounded) row-major weight.
    pub values: Vec<f32>,
    /// The grid's scale of every row (empty for [`KeptWeightGrid::Exact`]): the scale the
    /// packer must quantize the row with for the grid points to be its codes.
    pub scales: Vec<f32>,
}

/// Prunes a row-major `[rows, cols]` weight to `pattern` with SparseGPT. `values` are
/// assumed finite and of the right length (checked by the caller).
pub(crate) fn prune_sparsegpt(
    tensor: &str,
    values: &[f32],
    rows: usize,
    cols: usize,
    pattern: SparsityPattern,
    calibration: &SparseGptCalibration,
) -> Result<SparseGptOutput> {
    check_calibration(tensor, calibration, cols)?;
    let grid = calibration.grid;
    let scales = grid.row_scales(values, cols);
    if rows == 0 || cols == 0 {
        return Ok(SparseGptOutput {
            values: values.to_vec(),
            scales,
        });
    }
    let (gram, damping, block_size) = (
        &calibration.gram,
        calibration.damping,
        calibration.block_size,
    );
    let u = inverse_hessian_factor(tensor, gram, cols, damping)?;
    let group = pattern.block_len();
    let block = block_size.max(1).div_ceil(group) * group;
    let keep = pattern.nonzeros();

    let sweep = Sweep {
        cols,
        u: &u,
        group,
        keep,
        block,
        grid,
    };
    let mut out = values.to_vec();
    out.par_chunks_mut(ROWS_PER_TASK * cols)
        .enumerate()
        .for_each(|(i, chunk)| {
            let first = i * ROWS_PER_TASK;
            let rows = chunk.len() / cols;
            let scales = scales.get(first..first + rows).unwrap_or(&[]);
            prune_rows(chunk, &sweep, scales);
        });
    if let Some(i) = out.iter().position(|v| !v.is_finite()) {
        return Err(SlideSparseError::NonFiniteWeight {
            tensor: format!("{tensor} (after the SparseGPT update)"),
            row: i / cols,
            column: i % cols,
            value: out[i],
        });
    }
    Ok(SparseGptOutput {
        values: out,
        scales,
    })
}

/// `1 / [H^-1]_jj` for every input column `j` (`H` the damped Hessian): the optimal brain
/// surgeon's cost of removing a unit weight of column `j` while every other weight of the row
/// compensates, so that `w^2 / [H^-1]_jj` is a weight's saliency independent of the column
/// order (the permutation search scores with it; SparseGPT's own sweep uses the saliency of
/// the columns not yet processed, which depends on the order). `H^-1 = U^T U`, so
/// `[H^-1]_jj` is the squared norm of column `j` of `U`.
pub(crate) fn obs_column_factors(
    tensor: &str,
    calibration: &SparseGptCalibration,
    cols: usize,
) -> Result<Vec<f64>> {
    check_calibration(tensor, calibration, cols)?;
    let u = inverse_hessian_factor(tensor, &calibration.gram, cols, calibration.damping)?;
    let mut diag = vec![0.0f64; cols];
    for row in u.chunks(cols.max(1)) {
        for (d, v) in diag.iter_mut().zip(row) {
            *d += v * v;
        }
    }
    Ok(diag.into_iter().map(|d| 1.0 / d).collect())
}

/// Checks the calibration's Gram matrix (size, finite entries) and damping.
fn check_calibration(tensor: &str, calibration: &SparseGptCalibration, cols: usize) -> Result<()> {
    let (gram, damping) = (&calibration.gram, calibration.damping);
    if Some(gram.len()) != cols.checked_mul(cols) {
        return Err(SlideSparseError::shape(
            format!("{tensor}: SparseGPT Hessian (X^T X)"),
            [cols, cols],
            format!("{} elements", gram.len()),
        ));
    }
    if !damping.is_finite() || damping < 0.0 {
        return Err(SlideSparseError::Backend(format!(
            "{tensor}: SparseGPT damping {damping} must be finite and >= 0"
        )));
    }
    if let Some(i) = gram.iter().position(|v| !v.is_finite()) {
        return Err(SlideSparseError::Backend(format!(
            "{tensor}: SparseGPT Hessian entry ({}, {}) is {} (must be finite)",
            i / cols,
            i % cols,
            gram[i]
        )));
    }
    Ok(())
}

/// The upper Cholesky factor `U` of `(H + λ·mean(diag H)·I)^-1` (`H^-1 = U^T U`), row-major.
///
/// With `P` the reversal permutation, factor `P H P = L L^T` (lower `L`); then
/// `H^-1 = (P L^-T P)(P L^-1 P)`, and `U = P L^-1 P` is upper triangular: one Cholesky and
/// one triangular inverse, no explicit inverse of `H`.
pub(crate) fn inverse_hessian_factor(
    tensor: &str,
    gram: &[f64],
    k: usize,
    damping: f64,
) -> Result<Vec<f64>> {
    let mean_diag = (0..k).map(|i| gram[i * k + i]).sum::<f64>() / k as f64;
    let add = damping * mean_diag;
    // A = P (H + add I) P, symmetrized from both triangles.
    let mut a = vec![0.0f64; k * k];
    a.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
        let hi = k - 1 - i;
        for (j, v) in row.iter_mut().enumerate().take(i + 1) {
            let hj = k - 1 - j;
            *v = 0.5 * (gram[hi * k + hj] + gram[hj * k + hi]);
        }
        row[i] += add;
    });
    cholesky_lower(&mut a, k).map_err(|(column, pivot)| SlideSparseError::NotPositiveDefinite {
        tensor: tensor.to_string(),
        // Column of H (undo the reversal).
        column: k - 1 - column,
        pivot,
        damping,
    })?;
    let linv = lower_inverse(&a, k);
    // U[i][j] = L^-1[k-1-i][k-1-j], upper triangular.
    let mut u = vec![0.0f64; k * k];
    u.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
        let li = k - 1 - i;
        for (j, v) in row.iter_mut().enumerate().skip(i) {
            *v = linv[li * k + (k - 1 - j)];
        }
    });
    Ok(u)
}

/// In-place Cholesky `A = L L^T` of the lower triangle of a row-major `[k, k]` matrix (the
/// strict upper triangle is ignored and left as is). On failure returns the column and the
/// pivot that was not finite and positive.
fn cholesky_lower(a: &mut [f64], k: usize) -> std::result::Result<(), (usize, f64)> {
    for i in 0..k {
        let (done, rest) = a.split_at_mut(i * k);
        let row = &mut rest[..k];
        for j in 0..i {
            let lj = &done[j * k..j * k + j];
            let s = row[j] - dot(&row[..j], lj);
            row[j] = s / done[j * k + j];
        }
        let pivot = row[i] - dot(&row[..i], &row[..i]);
        if !(pivot.is_finite() && pivot > 0.0) {
            return Err((i, pivot));
        }
        row[i] = pivot.sqrt();
    }
    Ok(())
}

/// The inverse of a lower-triangular `[k, k]` row-major `L` (only its lower triangle is
/// read), by forward substitution of each unit vector, the columns in parallel.
fn lower_inverse(l: &[f64], k: usize) -> Vec<f64> {
    // Column c of L^-1 is zero above row c.
    let columns: Vec<Vec<f64>> = (0..k)
        .into_par_iter()
        .map(|c| {
            let mut x = vec![0.0f64; k];
            x[c] = 1.0 / l[c * k + c];
            for i in c + 1..k {
                let s = dot(&l[i * k + c..i * k + i], &x[c..i]);
                x[i] = -s / l[i * k + i];
            }
            x
        })
        .collect();
    let mut inv = vec![0.0f64; k * k];
    inv.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
        for (c, v) in row.iter_mut().enumerate().take(i + 1) {
            *v = columns[c][i];
        }
    });
    inv
}

/// A dot product with four independent accumulators (so that it vectorizes).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        acc[0] += x[0] * y[0];
        acc[1] += x[1] * y[1];
        acc[2] += x[2] * y[2];
        acc[3] += x[3] * y[3];
    }
    acc[0] + acc[1] + acc[2] + acc[3] + tail
}

/// `y -= alpha * x`.
fn axpy(y: &mut [f64], alpha: f64, x: &[f64]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y -= alpha * x;
    }
}

/// What every chunk of rows of one layer shares.
struct Sweep<'a> {
    cols: usize,
    /// The upper Cholesky factor of `H^-1`, row-major `[cols, cols]`.
    u: &'a [f64],
    /// The pattern's block length `2N` and the weights it keeps, `2N-2`.
    group: usize,
    keep: usize,
    /// Lazy-batch width (a multiple of `group`).
    block: usize,
    grid: KeptWeightGrid,
}

/// SparseGPT on a chunk of whole rows (row-major, `cols` wide), in place; `scales` holds the
/// grid scale of each row of the chunk (empty for [`KeptWeightGrid::Exact`]).
fn prune_rows(chunk: &mut [f32], sweep: &Sweep<'_>, scales: &[f32]) {
    let Sweep {
        cols,
        u,
        group,
        keep,
        block,
        grid,
    } = *sweep;
    let rows = chunk.len() / cols;
    let mut w: Vec<f64> = chunk.iter().map(|&v| v as f64).collect();
    let mut pruned = vec![false; rows * cols];
    // err[r * block + i]: the scaled error of column i1 + i of row r (0 where kept).
    let mut err = vec![0.0f64; rows * block];
    for i1 in (0..cols).step_by(block) {
        let i2 = (i1 + block).min(cols);
        err.iter_mut().for_each(|e| *e = 0.0);
        for c in i1..i2 {
            if (c - i1) % group == 0 {
                // A new aligned group [c, c + group): choose its mask on the current weights.
                let end = (c + group).min(cols);
                let drop = (end - c).saturating_sub(keep);
                for r in 0..rows {
                    let row = &w[r * cols..(r + 1) * cols];
                    for j in worst_two(c, end, |j| {
                        let d = u[j * cols + j];
                        row[j] * row[j] / (d * d)
                    })
                    .into_iter()
                    .take(drop)
                    {
                        pruned[r * cols + j] = true;
                    }
                }
            }
            let d = u[c * cols + c];
            let urow = &u[c * cols + c + 1..c * cols + i2];
            for r in 0..rows {
                let row = &mut w[r * cols..(r + 1) * cols];
                // Dropped: to 0. Kept: to its grid point, or left as is without a grid.
                let target = if pruned[r * cols + c] {
                    0.0
                } else {
                    match grid.round(row[c], scales.get(r).map_or(1.0, |&s| s as f64)) {
                        Some(q) => q,
                        None => continue,
                    }
                };
                let e = (row[c] - target) / d;
                row[c] = target;
                err[r * block + (c - i1)] = e;
                // Within the batch: update the columns right of c at once.
                axpy(&mut row[c + 1..i2], e, urow);
            }
        }
        if i2 < cols {
            // Lazy batch update of every column right of the batch: W[:, i2..] -= Err U[i1..i2, i2..].
            for c in i1..i2 {
                let urow = &u[c * cols + i2..(c + 1) * cols];
                for r in 0..rows {
                    let e = err[r * block + (c - i1)];
                    if e != 0.0 {
                        axpy(&mut w[r * cols + i2..(r + 1) * cols], e, urow);
                    }
                }
            }
        }
    }
    for ((out, &v), &p) in chunk.iter_mut().zip(&w).zip(&pruned) {
        // Pruned: exactly +0.0. Kept: the updated weight (a signed zero becomes +0.0).
        *out = if p { 0.0 } else { v as f32 };
        if *out == 0.0 {
            *out = 0.0;
        }
    }
}

/// The two columns of `start..end` with the lowest score, worst first (among equal scores
/// the higher column is worse), as the magnitude and Wanda pruners break ties.
fn worst_two(start: usize, end: usize, score: impl Fn(usize) -> f64) -> Vec<usize> {
    let mut worst: [Option<(usize, f64)>; 2] = [None, None];
    for j in start..end {
        let s = score(j);
        let worse = |w: Option<(usize, f64)>| w.is_none_or(|(_, ws)| s <= ws);
        if worse(worst[0]) {
            worst = [Some((j, s)), worst[0]];
        } else if worse(worst[1]) {
            worst[1] = Some((j, s));
        }
    }
    worst.into_iter().flatten().map(|(j, _)| j).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    fn gram_of(x: &[f64], n: usize, k: usize) -> Vec<f64> {
        let mut g = vec![0.0; k * k];
        for t in 0..n {
            for i in 0..k {
                for j in 0..k {
                    g[i * k + j] += x[t * k + i] * x[t * k + j];
                }
            }
        }
        g
    }

    #[test]
    fn factor_is_the_upper_cholesky_of_the_damped_inverse() {
        let (n, k) = (40, 13);
        let mut seed = 7;
        let x: Vec<f64> = (0..n * k).map(|_| lcg(&mut seed)).collect();
        let g = gram_of(&x, n, k);
        let damping = 0.01;
        let u = inverse_hessian_factor("t", &g, k, damping).unwrap();
        let mean = (0..k).map(|i| g[i * k + i]).sum::<f64>() / k as f64;
        // (U^T U) (H + λ I) = I, and U is upper triangular with a positive diagonal.
        for i in 0..k {
            assert!(u[i * k + i] > 0.0);
            for j in 0..i {
                assert_eq!(u[i * k + j], 0.0);
            }
        }
        for i in 0..k {
            for j in 0..k {
                let mut s = 0.0;
                for m in 0..k {
                    let hinv_im: f64 = (0..k).map(|p| u[p * k + i] * u[p * k + m]).sum();
                    let h_mj = g[m * k + j] + if m == j { damping * mean } else { 0.0 };
                    s += hinv_im * h_mj;
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((s - want).abs() < 1e-9, "({i},{j}): {s}");
            }
        }
    }

    #[test]
    fn singular_hessian_is_a_typed_error() {
        let k = 4;
        let zero = vec![0.0; k * k];
        let err = inverse_hessian_factor("layer", &zero, k, 0.01).unwrap_err();
        assert!(
            matches!(err, SlideSparseError::NotPositiveDefinite { ref tensor, .. } if tensor == "layer"),
            "{err}"
        );
        // Negative definite: no damping makes it positive.
        let mut neg = vec![0.0; k * k];
        (0..k).for_each(|i| neg[i * k + i] = -1.0);
        assert!(matches!(
            inverse_hessian_factor("layer", &neg, k, 0.01),
            Err(SlideSparseError::NotPositiveDefinite { .. })
        ));
    }

    #[test]
    fn worst_two_breaks_ties_like_the_other_pruners() {
        assert_eq!(worst_two(0, 4, |j| [3.0, 1.0, 1.0, 2.0][j]), [2, 1]);
        assert_eq!(worst_two(4, 7, |j| [0.0, 0.0, 0.0][j - 4]), [6, 5]);
        assert_eq!(worst_two(0, 1, |_| 1.0), [0]);
    }
}
