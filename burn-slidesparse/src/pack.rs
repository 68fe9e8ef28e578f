//! The offline packer: prune -> quantize -> slide -> verify, for one linear layer.

use cubecl_kernels::geometry::SlideGeometry;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{
    backend::LayerSpec,
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
    prune::{self, PruneMethod},
    quant::{Precision, QuantizedWeight, WeightCodes, map_codes, quantize_weight, with_codes},
    slide::{self, SlideElement, SlideFailure, UnslideError},
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
}

impl PackOptions {
    /// Magnitude pruning at the default alignment.
    pub fn new(pattern: SparsityPattern, precision: Precision) -> Self {
        Self {
            pattern,
            precision,
            prune: PruneMethod::Magnitude,
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Checks the alignment against the precision.
    pub fn validate(&self) -> Result<()> {
        check_alignment(self.alignment, self.precision)
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

    /// Un-slides `W'` back to the pruned, quantized `[out, K]` weight. Fails if `W'` is not a
    /// valid slide (a nonzero in padding, or two nonzeros mapping to one column).
    pub fn unslide(&self) -> Result<QuantizedWeight> {
        let geometry = self.geometry();
        let codes = map_codes!(&self.weight.codes, v => unslide_matrix(&self.name, v, self.weight.rows, &geometry)?);
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
        Some((row, e)) => {
            let (column, what) = match e {
                UnslideError::NonzeroInPadding { column } => {
                    (column, "a nonzero in a padding column")
                }
                UnslideError::Collision { column } => {
                    (column, "a second nonzero for the same source column")
                }
            };
            Err(SlideSparseError::VerifyMismatch {
                tensor: name.to_string(),
                row,
                column,
                detail: format!("W' is not a valid slide: {what}"),
            })
        }
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
    let (pruned, quantized) =
        prune_then_quantize(name, weight, out_features, in_features, options)?;
    let geometry = options.pattern.geometry(in_features, options.alignment);
    let slid = map_codes!(&quantized.codes, v => slide::slide_matrix(v, out_features, &geometry)
        .map_err(|f| slide_failure(name, options.pattern, in_features, f))?);
    let packed = PackedLinear {
        name: name.to_string(),
        pattern: options.pattern,
        in_features,
        alignment: options.alignment,
        weight: QuantizedWeight {
            rows: out_features,
            cols: geometry.k_prime(),
            codes: slid,
            scales: quantized.scales.clone(),
        },
        bias: bias.map(<[f32]>::to_vec),
    };
    packed.verify_against(&quantized)?;
    let stats = PackStats {
        name: name.to_string(),
        shape: [out_features, in_features],
        k_prime: geometry.k_prime(),
        // Counted in parallel: single-threaded passes over the weight were what kept
        // packing from scaling with cores.
        nonzeros_before: weight.par_iter().filter(|v| **v != 0.0).count(),
        nonzeros_kept: quantized
            .codes
            .to_f32()
            .par_iter()
            .filter(|v| **v != 0.0)
            .count(),
        pruning_error: prune::relative_error(weight, &pruned),
        total_error: prune::relative_error(weight, &quantized.dequantize()),
        dense_bytes_f32: 4 * weight.len(),
        packed_bytes: packed.stored_bytes(),
    };
    Ok((packed, quantized, stats))
}

/// Prunes and quantizes exactly as [`pack_linear`] does, without sliding: the reference a
/// packed layer must un-slide to.
pub fn prune_and_quantize(
    name: &str,
    weight: &[f32],
    out_features: usize,
    in_features: usize,
    options: &PackOptions,
) -> Result<QuantizedWeight> {
    prune_then_quantize(name, weight, out_features, in_features, options).map(|(_, q)| q)
}

/// The first two packer stages; the pruned f32 weight is kept for the statistics.
fn prune_then_quantize(
    name: &str,
    weight: &[f32],
    out_features: usize,
    in_features: usize,
    options: &PackOptions,
) -> Result<(Vec<f32>, QuantizedWeight)> {
    let pruned = prune::prune(
        name,
        weight,
        out_features,
        in_features,
        options.pattern,
        &options.prune,
    )?;
    let quantized = quantize_weight(&pruned, out_features, in_features, options.precision);
    Ok((pruned, quantized))
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
