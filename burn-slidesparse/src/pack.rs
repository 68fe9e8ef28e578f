//! The offline packer: prune -> quantize -> slide -> verify, for one linear layer.

use std::borrow::Cow;

use cubecl_kernels::geometry::SlideGeometry;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
    permute::{ChannelPermutation, InputPermutation},
    prune::{self, KeptWeightGrid, PruneMethod},
    slide::{self, SlideElement, SlideFailure, UnslideError},
    weight_quant::{
        Codec, Precision, QuantizedWeight, WeightCodes, map_codes, quantize_weight,
        quantize_weight_with_scales, row_scale, with_codes,
    },
};

/// Default `K'` alignment: safe for every precision on cuSPARSELt.
pub const DEFAULT_ALIGNMENT: usize = 64;

/// How to pack a layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PackOptions {
    /// The `(2N-2):2N` pattern to prune to.
    pub pattern: SparsityPattern,
    /// Element type of the packed weight.
    pub precision: Precision,
    /// How to choose the kept weights.
    pub prune: PruneMethod,
    /// `K'` is rounded up to a multiple of this (power of two, >= 32 for 8-bit, >= 16 else).
    pub alignment: usize,
    /// How the input channels are ordered before pruning (default: as they are). A packed
    /// layer with a permutation computes the same function of its input in the original
    /// order: its lift reads the input through the permutation.
    #[serde(default)]
    pub permutation: ChannelPermutation,
}

impl PackOptions {
    /// Magnitude pruning at the default alignment.
    pub fn new(pattern: SparsityPattern, precision: Precision) -> Self {
        Self {
            pattern,
            precision,
            prune: PruneMethod::Magnitude,
            alignment: DEFAULT_ALIGNMENT,
            permutation: ChannelPermutation::Identity,
        }
    }

    /// Checks the alignment against the precision, and that a SparseGPT grid
    /// ([`KeptWeightGrid`]) is the packed precision's.
    pub fn validate(&self) -> Result<()> {
        check_alignment(self.alignment, self.precision)?;
        if let PruneMethod::SparseGpt(c) = &self.prune {
            let fits = match c.grid {
                KeptWeightGrid::Exact => true,
                KeptWeightGrid::Int8 => self.precision == Precision::Int8,
                KeptWeightGrid::Fp8 => self.precision == Precision::Fp8,
            };
            if !fits {
                return Err(SlideSparseError::Backend(format!(
                    "SparseGPT rounds the kept weights to the {:?} grid, but the layer is packed \
                     to {}: give SparseGptCalibration::grid the packed precision's grid, or Exact",
                    c.grid, self.precision
                )));
            }
        }
        Ok(())
    }
}

pub(crate) fn check_alignment(alignment: usize, precision: Precision) -> Result<()> {
    let min = precision.min_alignment();
    if alignment.is_power_of_two() && alignment >= min {
        Ok(())
    } else {
        Err(SlideSparseError::InvalidAlignment(alignment, min))
    }
}

/// Static description of a packed layer: everything but the tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LayerSpec {
    /// The `(2N-2):2N` pattern the weight was pruned to.
    pub pattern: SparsityPattern,
    /// Element type of `W'` (and of the quantized activations).
    pub precision: Precision,
    /// Input width `K`.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Alignment of `K'`.
    pub alignment: usize,
}

impl LayerSpec {
    /// Geometry of the layer.
    pub fn geometry(&self) -> cubecl_kernels::SlideGeometry {
        self.pattern.geometry(self.in_features, self.alignment)
    }

    /// `K'`.
    pub fn k_prime(&self) -> usize {
        self.geometry().k_prime()
    }
}

/// A packed linear layer: slid, quantized `W' [out, K']`, per-channel scales and bias.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLinear {
    /// Name of the source weight tensor (e.g. `model.layers.0.mlp.down_proj.weight`).
    pub name: String,
    /// The `(2N-2):2N` pattern the weight satisfies.
    pub pattern: SparsityPattern,
    /// Input width `K` of the original layer.
    pub in_features: usize,
    /// Alignment of `K'` (a power of two).
    pub alignment: usize,
    /// `[out_features, K']` codes plus per-row scales.
    pub weight: QuantizedWeight,
    /// Bias `[out]`, if the layer has one.
    pub bias: Option<Vec<f32>>,
    /// The order of the input channels `W'` was pruned and slid in (format version 2):
    /// column `j` of the un-slid weight belongs to input channel `order[j]`, and the lift
    /// reads `X[:, order[src(o)]]`. `None`: the original order.
    pub input_permutation: Option<InputPermutation>,
}

impl PackedLinear {
    /// Pattern, precision and sizes: what a backend needs besides the tensors.
    pub fn spec(&self) -> LayerSpec {
        LayerSpec {
            pattern: self.pattern,
            precision: self.precision(),
            in_features: self.in_features,
            out_features: self.out_features(),
            alignment: self.alignment,
        }
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.weight.rows
    }

    /// Element type of `W'`.
    pub fn precision(&self) -> Precision {
        self.weight.codes.precision()
    }

    /// Geometry (`K'`, lift map).
    pub fn geometry(&self) -> SlideGeometry {
        self.pattern.geometry(self.in_features, self.alignment)
    }

    /// `K'`.
    pub fn k_prime(&self) -> usize {
        self.weight.cols
    }

    /// Bytes of `W'` plus scales and bias as stored.
    pub fn stored_bytes(&self) -> usize {
        self.weight.codes.len() * self.precision().element_bytes()
            + 4 * self.weight.scales.len()
            + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }

    /// The lift map of the layer's activations (`map[o]` = input column read by slid column
    /// `o`, `K` for a zero), the permutation folded in.
    pub fn lift_map_with_zero_column(&self) -> Vec<usize> {
        let map = self.geometry().lift_map_with_zero_column();
        match &self.input_permutation {
            Some(p) => p.compose_lift_map(&map),
            None => map,
        }
    }

    /// Un-slides `W'` back to the pruned, quantized `[out, K]` weight, in the original channel
    /// order (un-permuted). Fails if `W'` is not a valid slide (a nonzero in padding, or two
    /// nonzeros mapping to one column) or the permutation is not one of `K` channels.
    pub fn unslide(&self) -> Result<QuantizedWeight> {
        let geometry = self.geometry();
        let codes = map_codes!(&self.weight.codes, v => unslide_matrix(&self.name, v, self.weight.rows, &geometry)?);
        let codes = match &self.input_permutation {
            Some(p) => {
                p.check_len(&self.name, self.in_features)?;
                map_codes!(&codes, v => p.unpermute_columns(v))
            }
            None => codes,
        };
        Ok(QuantizedWeight {
            rows: self.weight.rows,
            cols: self.in_features,
            codes,
            scales: self.weight.scales.clone(),
        })
    }

    /// Structural checks: shapes, `K'` for the geometry, finite positive scales, every aligned
    /// 4-wide window of `W'` with at most 2 nonzeros, and an exact un-slide, whose result
    /// (the pruned, quantized `[out, K]` weight) it returns.
    pub fn validate(&self) -> Result<QuantizedWeight> {
        let geometry = self.geometry();
        let (rows, cols) = (self.weight.rows, self.weight.cols);
        if cols != geometry.k_prime() {
            return Err(SlideSparseError::shape(
                format!(
                    "{}: K' for K = {} at {}",
                    self.name, self.in_features, self.pattern
                ),
                geometry.k_prime(),
                cols,
            ));
        }
        if self.weight.codes.len() != rows * cols {
            return Err(SlideSparseError::shape(
                format!("{}: W'", self.name),
                [rows, cols],
                format!("{} elements", self.weight.codes.len()),
            ));
        }
        if self.weight.scales.len() != rows {
            return Err(SlideSparseError::shape(
                format!("{}: weight scales", self.name),
                [rows],
                [self.weight.scales.len()],
            ));
        }
        if let Some(i) = self
            .weight
            .scales
            .iter()
            .position(|s| !s.is_finite() || *s <= 0.0)
        {
            return Err(SlideSparseError::VerifyMismatch {
                tensor: self.name.clone(),
                row: i,
                column: 0,
                detail: format!("scale {} is not finite and positive", self.weight.scales[i]),
            });
        }
        if let Some(b) = &self.bias
            && b.len() != rows
        {
            return Err(SlideSparseError::shape(
                format!("{}: bias", self.name),
                [rows],
                [b.len()],
            ));
        }
        let violation =
            with_codes!(&self.weight.codes, v => slide::first_2_4_violation(v, rows, cols));
        if let Some((row, column, nonzeros)) = violation {
            return Err(SlideSparseError::WindowViolation {
                tensor: self.name.clone(),
                row,
                column,
                nonzeros,
            });
        }
        self.unslide()
    }

    /// [`validate`](Self::validate), then checks that un-sliding gives back `expected` (the
    /// pruned, quantized original) exactly, bit for bit up to the sign of zero.
    pub fn verify_against(&self, expected: &QuantizedWeight) -> Result<()> {
        let back = self.validate()?;
        if (back.rows, back.cols) != (expected.rows, expected.cols) {
            return Err(SlideSparseError::shape(
                format!("{}: original", self.name),
                [back.rows, back.cols],
                [expected.rows, expected.cols],
            ));
        }
        if let Some(row) =
            (0..back.rows).find(|&r| back.scales[r].to_bits() != expected.scales[r].to_bits())
        {
            return Err(SlideSparseError::VerifyMismatch {
                tensor: self.name.clone(),
                row,
                column: 0,
                detail: format!(
                    "scale {} != expected {}",
                    back.scales[row], expected.scales[row]
                ),
            });
        }
        if back.codes.precision() != expected.codes.precision() {
            return Err(SlideSparseError::VerifyMismatch {
                tensor: self.name.clone(),
                row: 0,
                column: 0,
                detail: format!(
                    "precision {} != expected {}",
                    back.codes.precision(),
                    expected.codes.precision()
                ),
            });
        }
        let mismatch = match (&back.codes, &expected.codes) {
            (WeightCodes::I8(a), WeightCodes::I8(b)) => first_mismatch(a, b),
            (WeightCodes::Fp8(a), WeightCodes::Fp8(b)) => first_mismatch(a, b),
            (WeightCodes::Bf16(a), WeightCodes::Bf16(b)) => first_mismatch(a, b),
            (WeightCodes::F16(a), WeightCodes::F16(b)) => first_mismatch(a, b),
            (WeightCodes::F32(a), WeightCodes::F32(b)) => first_mismatch(a, b),
            _ => unreachable!("precisions compared above"),
        };
        if let Some(i) = mismatch {
            let (a, b) = (back.codes.to_f32(), expected.codes.to_f32());
            return Err(SlideSparseError::VerifyMismatch {
                tensor: self.name.clone(),
                row: i / back.cols.max(1),
                column: i % back.cols.max(1),
                detail: format!("un-slid value {} != expected {}", a[i], b[i]),
            });
        }
        Ok(())
    }
}

/// First index where two code slices differ (zeros of either sign are equal).
fn first_mismatch<T: SlideElement>(a: &[T], b: &[T]) -> Option<usize> {
    (0..a.len())
        .into_par_iter()
        .find_first(|&i| !(a[i] == b[i] || (a[i].is_zero() && b[i].is_zero())))
}

fn unslide_matrix<T: SlideElement>(
    name: &str,
    slid: &[T],
    rows: usize,
    geometry: &SlideGeometry,
) -> Result<Vec<T>> {
    let (k, kp) = (geometry.k, geometry.k_prime());
    let mut out = vec![T::ZERO; rows * k];
    if k == 0 || kp == 0 {
        return Ok(out);
    }
    let first_error = out
        .par_chunks_mut(k)
        .zip(slid.par_chunks(kp))
        .enumerate()
        .filter_map(|(r, (dst, src))| slide::unslide_row(src, geometry, dst).err().map(|e| (r, e)))
        .min_by_key(|(r, _)| *r);
    match first_error {
        None => Ok(out),
        Some((row, e)) => Err(unslide_error(name, row, e)),
    }
}

/// The error of a `W'` row that does not un-slide.
fn unslide_error(name: &str, row: usize, e: UnslideError) -> SlideSparseError {
    let (column, what) = match e {
        UnslideError::NonzeroInPadding { column } => (column, "a nonzero in a padding column"),
        UnslideError::Collision { column } => {
            (column, "a second nonzero for the same source column")
        }
    };
    SlideSparseError::VerifyMismatch {
        tensor: name.to_string(),
        row,
        column,
        detail: format!("W' is not a valid slide: {what}"),
    }
}

/// What packing one layer kept and cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PackStats {
    /// Name of the source weight tensor.
    pub name: String,
    /// `[out, K]` of the dense weight.
    pub shape: [usize; 2],
    /// `K'`, the slid width.
    pub k_prime: usize,
    /// Nonzeros of the dense weight.
    pub nonzeros_before: usize,
    /// Nonzeros after pruning.
    pub nonzeros_kept: usize,
    /// `||W - prune(W)|| / ||W||` (before quantization).
    pub pruning_error: f64,
    /// `||W - dequant(quant(prune(W)))|| / ||W||`.
    pub total_error: f64,
    /// Bytes of the dense weight in f32.
    pub dense_bytes_f32: usize,
    /// Bytes stored for the packed layer (`W'`, scales, bias).
    pub packed_bytes: usize,
}

/// Packs one dense `[out, in]` weight (row-major, PyTorch layout): prune -> quantize -> slide
/// -> verify. Returns the packed layer, the pruned-and-quantized dense weight (the reference
/// for later checks) and statistics.
///
/// The stages run fused, one row at a time (see [`pack_rows`]); the result is exactly that
/// of running them one after the other over the whole matrix ([`prune_and_quantize`], then
/// the slide), which the tests check. Refused: a layer without inputs (`in_features == 0`)
/// and a row whose 8-bit scale underflows to zero (every weight of the row subnormal).
pub fn pack_linear(
    name: &str,
    weight: &[f32],
    out_features: usize,
    in_features: usize,
    bias: Option<&[f32]>,
    options: &PackOptions,
) -> Result<(PackedLinear, QuantizedWeight, PackStats)> {
    options.validate()?;
    if let Some(b) = bias
        && b.len() != out_features
    {
        return Err(SlideSparseError::shape(
            format!("{name}: bias"),
            [out_features],
            [b.len()],
        ));
    }
    if in_features == 0 {
        // No input columns: nothing to prune or slide, and no row maximum to scale by.
        return Err(SlideSparseError::shape(
            format!("{name}: input width"),
            "at least 1",
            0,
        ));
    }
    let permutation = options.permutation.resolve(
        name,
        weight,
        (out_features, in_features),
        options.pattern,
        &options.prune,
    )?;
    // Pruned, quantized and slid in the permuted order.
    let (weight, method) = permuted(permutation.as_ref(), weight, &options.prune);
    let pruner = prune::row_pruner(
        name,
        &weight,
        out_features,
        in_features,
        options.pattern,
        &method,
    )?;
    let geometry = options.pattern.geometry(in_features, options.alignment);
    let job = RowJob {
        name,
        weight: &weight,
        rows: out_features,
        pattern: options.pattern,
        geometry: &geometry,
        pruner: &pruner,
    };
    let rows = match options.precision {
        Precision::Int8 => pack_rows::<i8>(&job),
        Precision::Fp8 => pack_rows::<u8>(&job),
        Precision::Bf16 => pack_rows::<half::bf16>(&job),
        Precision::F16 => pack_rows::<half::f16>(&job),
        Precision::F32 => pack_rows::<f32>(&job),
    }?;
    // The reference is in the original order: the scales are per row, so un-permuting the
    // codes gives exactly the quantization of the un-permuted pruned weight.
    let quantized = QuantizedWeight {
        rows: out_features,
        cols: in_features,
        codes: unpermuted(permutation.as_ref(), rows.codes),
        scales: rows.scales,
    };
    let packed = PackedLinear {
        name: name.to_string(),
        pattern: options.pattern,
        in_features,
        alignment: options.alignment,
        weight: QuantizedWeight {
            rows: out_features,
            cols: geometry.k_prime(),
            codes: rows.slid,
            scales: quantized.scales.clone(),
        },
        bias: bias.map(<[f32]>::to_vec),
        input_permutation: permutation,
    };
    let sums = rows.sums;
    let relative = |num: f64| {
        if sums.norm == 0.0 {
            0.0
        } else {
            (num / sums.norm).sqrt()
        }
    };
    let stats = PackStats {
        name: name.to_string(),
        shape: [out_features, in_features],
        k_prime: geometry.k_prime(),
        nonzeros_before: sums.nonzeros_before,
        nonzeros_kept: sums.nonzeros_kept,
        pruning_error: relative(sums.pruning_error),
        total_error: relative(sums.total_error),
        dense_bytes_f32: 4 * weight.len(),
        packed_bytes: packed.stored_bytes(),
    };
    Ok((packed, quantized, stats))
}

/// The weight and prune method in the order `permutation` gives (borrowed without one).
fn permuted<'a>(
    permutation: Option<&InputPermutation>,
    weight: &'a [f32],
    method: &'a PruneMethod,
) -> (Cow<'a, [f32]>, Cow<'a, PruneMethod>) {
    match permutation {
        Some(p) => (
            Cow::Owned(p.permute_columns(weight)),
            Cow::Owned(p.permute_method(method)),
        ),
        None => (Cow::Borrowed(weight), Cow::Borrowed(method)),
    }
}

/// `[rows, K]` codes in the permuted order back in the original order.
fn unpermuted(permutation: Option<&InputPermutation>, codes: WeightCodes) -> WeightCodes {
    match permutation {
        Some(p) => map_codes!(&codes, v => p.unpermute_columns(v)),
        None => codes,
    }
}

/// What [`pack_rows`] works on: one layer's dense weight and how to prune and slide it.
struct RowJob<'a> {
    name: &'a str,
    weight: &'a [f32],
    rows: usize,
    pattern: SparsityPattern,
    geometry: &'a SlideGeometry,
    pruner: &'a prune::RowPruner<'a>,
}

/// The outputs of [`pack_rows`].
struct PackedRows {
    /// Pruned, quantized `[rows, K]` codes: the reference the slide must un-slide to.
    codes: WeightCodes,
    /// Slid `[rows, K']` codes.
    slid: WeightCodes,
    scales: Vec<f32>,
    sums: RowSums,
}

/// Per-row counts and squared norms for [`PackStats`], summed over rows.
#[derive(Clone, Copy, Default)]
struct RowSums {
    nonzeros_before: usize,
    nonzeros_kept: usize,
    /// `sum (W - prune(W))^2`.
    pruning_error: f64,
    /// `sum (W - dequant(quant(prune(W))))^2`.
    total_error: f64,
    /// `sum W^2`.
    norm: f64,
}

impl RowSums {
    fn add(self, o: Self) -> Self {
        Self {
            nonzeros_before: self.nonzeros_before + o.nonzeros_before,
            nonzeros_kept: self.nonzeros_kept + o.nonzeros_kept,
            pruning_error: self.pruning_error + o.pruning_error,
            total_error: self.total_error + o.total_error,
            norm: self.norm + o.norm,
        }
    }
}

/// Why a row failed the pass; the lowest failing row is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum RowFailure {
    /// The row's scale (bits) is not finite and positive.
    Scale(u32),
    /// More nonzeros in a block than the windows hold: `(block, nonzeros)`.
    Slide(usize, usize),
    /// An aligned 4-wide window of `W'` with more than two nonzeros: `(column, nonzeros)`.
    Window(usize, usize),
    /// `W'` does not un-slide.
    Unslide(UnslideError),
    /// The un-slid row differs from the quantized row at this column.
    Mismatch(usize),
}

/// Prunes, quantizes, slides and verifies every row in one parallel pass over rows, each row
/// in cache. Run as whole-matrix stages, the packer wrote and re-read four full-size copies
/// (pruned f32, codes, slid, un-slid) plus two f32 copies for the statistics, and page
/// faults and memory traffic capped it at ~0.5 GB/s on 16 cores; here it writes only its
/// two outputs.
fn pack_rows<T: Codec>(job: &RowJob<'_>) -> Result<PackedRows> {
    let (rows, k, kp) = (job.rows, job.geometry.k, job.geometry.k_prime());
    let qmax = T::PRECISION.qmax();
    let mut codes = vec![T::ZERO; rows * k];
    let mut slid = vec![T::ZERO; rows * kp];
    let mut scales = vec![1.0f32; rows];
    // Each worker keeps two row-sized scratch buffers: the pruned f32 row and the un-slid row.
    let scratch = || (vec![0.0f32; k], vec![T::ZERO; k]);
    let (sums, failure) = codes
        .par_chunks_mut(k)
        .zip(slid.par_chunks_mut(kp))
        .zip(scales.par_iter_mut())
        .enumerate()
        .map_init(scratch, |(pruned, back), (r, ((q, s), scale))| {
            let src = &job.weight[r * k..(r + 1) * k];
            job.pruner.prune_row(r, src, pruned, job.pattern);
            // A SparseGPT grid fixed the row's scale: its grid points are the codes.
            *scale = job
                .pruner
                .row_scale(r)
                .unwrap_or_else(|| qmax.map_or(1.0, |m| row_scale(pruned, m)));
            if !(scale.is_finite() && *scale > 0.0) {
                // A row whose largest weight is subnormal: `max / qmax` underflows to 0.
                let failure = Some((r, RowFailure::Scale(scale.to_bits())));
                return (RowSums::default(), failure);
            }
            q.iter_mut()
                .zip(pruned.iter())
                .for_each(|(c, &v)| *c = T::encode(v, *scale));
            let failure = slide_and_check(q, s, back, job.geometry).err();
            (row_sums(src, pruned, q, *scale), failure.map(|f| (r, f)))
        })
        .reduce(
            || (RowSums::default(), None),
            |(a, fa), (b, fb)| {
                (
                    a.add(b),
                    match (fa, fb) {
                        (Some(x), Some(y)) => Some(x.min(y)),
                        (x, y) => x.or(y),
                    },
                )
            },
        );
    if let Some((row, f)) = failure {
        return Err(row_failure(job, row, f));
    }
    Ok(PackedRows {
        codes: T::into_codes(codes),
        slid: T::into_codes(slid),
        scales,
        sums,
    })
}

/// Slides quantized row `q` into `s`, then checks `s` as [`PackedLinear::validate`] and
/// [`PackedLinear::verify_against`] check a whole layer: every aligned 4-wide window holds at
/// most two nonzeros, and un-sliding gives back `q` exactly (zeros of either sign equal).
fn slide_and_check<T: Codec>(
    q: &[T],
    s: &mut [T],
    back: &mut [T],
    geometry: &SlideGeometry,
) -> std::result::Result<(), RowFailure> {
    slide::slide_row(q, geometry, s).map_err(|(block, nnz)| RowFailure::Slide(block, nnz))?;
    if let Some((column, nnz)) = slide::row_2_4_violation(s) {
        return Err(RowFailure::Window(column, nnz));
    }
    slide::unslide_row(s, geometry, back).map_err(RowFailure::Unslide)?;
    match back
        .iter()
        .zip(q)
        .position(|(a, b)| !(a == b || (a.is_zero() && b.is_zero())))
    {
        Some(column) => Err(RowFailure::Mismatch(column)),
        None => Ok(()),
    }
}

/// One row's share of the statistics: dense `src`, pruned `pruned`, codes `q` at `scale`.
fn row_sums<T: Codec>(src: &[f32], pruned: &[f32], q: &[T], scale: f32) -> RowSums {
    let mut sums = RowSums::default();
    for ((&w, &p), &c) in src.iter().zip(pruned).zip(q) {
        let (w64, deq) = (w as f64, (c.decode() * scale) as f64);
        sums.nonzeros_before += usize::from(w != 0.0);
        sums.nonzeros_kept += usize::from(!c.is_zero());
        sums.pruning_error += (w64 - p as f64).powi(2);
        sums.total_error += (w64 - deq).powi(2);
        sums.norm += w64 * w64;
    }
    sums
}

/// The error a failed row reports, worded as the whole-layer checks word it.
fn row_failure(job: &RowJob<'_>, row: usize, f: RowFailure) -> SlideSparseError {
    let name = job.name.to_string();
    match f {
        RowFailure::Scale(bits) => SlideSparseError::VerifyMismatch {
            tensor: name,
            row,
            column: 0,
            detail: format!("scale {} is not finite and positive", f32::from_bits(bits)),
        },
        RowFailure::Slide(block, nonzeros) => slide_failure(
            job.name,
            job.pattern,
            job.geometry.k,
            SlideFailure {
                row,
                block,
                nonzeros,
            },
        ),
        RowFailure::Window(column, nonzeros) => SlideSparseError::WindowViolation {
            tensor: name,
            row,
            column,
            nonzeros,
        },
        RowFailure::Unslide(e) => unslide_error(job.name, row, e),
        RowFailure::Mismatch(column) => SlideSparseError::VerifyMismatch {
            tensor: name,
            row,
            column,
            detail: "un-slid value differs from the quantized weight".to_string(),
        },
    }
}

/// Prunes and quantizes exactly as [`pack_linear`] does, without sliding: the reference a
/// packed layer must un-slide to, in the original channel order (pruned in the permuted
/// order when `options` has a permutation, then un-permuted).
pub fn prune_and_quantize(
    name: &str,
    weight: &[f32],
    out_features: usize,
    in_features: usize,
    options: &PackOptions,
) -> Result<QuantizedWeight> {
    let permutation = options.permutation.resolve(
        name,
        weight,
        (out_features, in_features),
        options.pattern,
        &options.prune,
    )?;
    options.validate()?;
    let (permuted_weight, method) = permuted(permutation.as_ref(), weight, &options.prune);
    let pruner = prune::row_pruner(
        name,
        &permuted_weight,
        out_features,
        in_features,
        options.pattern,
        &method,
    )?;
    // Row by row as pack_rows prunes, so that the two agree by construction.
    let mut pruned = vec![0.0f32; permuted_weight.len()];
    pruned
        .par_chunks_mut(in_features.max(1))
        .zip(permuted_weight.par_chunks(in_features.max(1)))
        .enumerate()
        .for_each(|(r, (dst, src))| pruner.prune_row(r, src, dst, options.pattern));
    let pruned = match &permutation {
        Some(p) => p.unpermute_columns(&pruned),
        None => pruned,
    };
    // Row scales are per row: a permutation of the columns leaves them as they are.
    Ok(match pruner.scales() {
        Some(scales) => quantize_weight_with_scales(
            &pruned,
            out_features,
            in_features,
            options.precision,
            scales.to_vec(),
        ),
        None => quantize_weight(&pruned, out_features, in_features, options.precision),
    })
}

fn slide_failure(
    name: &str,
    pattern: SparsityPattern,
    k: usize,
    f: SlideFailure,
) -> SlideSparseError {
    let start = f.block * pattern.block_len();
    SlideSparseError::PatternViolation {
        tensor: name.to_string(),
        pattern: pattern.to_string(),
        row: f.row,
        block: f.block,
        start,
        end: (start + pattern.block_len()).min(k),
        nonzeros: f.nonzeros,
        allowed: pattern.nonzeros(),
    }
}
