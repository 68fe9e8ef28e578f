//! Precisions and the per-output-channel weight quantization of the packer.
//!
//! Symmetric, per row: INT8 `s = max|W[n,:]| / 127`, `q = clamp(rne(W / s), -127, 127)`;
//! FP8 E4M3 `s = max|W[n,:]| / 448`, `q = e4m3_rne_saturate(W / s)`. An all-zero row gets
//! `s = 1`. BF16/F16 round to the type (RNE); F32 is passed through. Float precisions carry a
//! scale of 1 so that every layer has the same epilogue.

use std::{fmt, str::FromStr};

use half::{bf16, f16};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{
    error::{Result, SlideSparseError},
    fp8,
    prune::check_finite,
};

/// Element type of the packed weight and of the lifted activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Precision {
    /// W8A8 INT8, INT32 accumulation.
    Int8,
    /// W8A8 FP8 E4M3, FP32 accumulation.
    Fp8,
    /// BF16 weights and activations, no quantization.
    Bf16,
    /// FP16 weights and activations, no quantization.
    F16,
    /// F32 (reference/CPU only: cuSPARSELt has no structured f32 kernels on Hopper).
    F32,
}

impl Precision {
    /// Every precision.
    pub const ALL: [Precision; 5] = [
        Precision::Int8,
        Precision::Fp8,
        Precision::Bf16,
        Precision::F16,
        Precision::F32,
    ];

    /// Whether weights and activations are quantized to 8 bits with scales.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Precision::Int8 | Precision::Fp8)
    }

    /// Largest quantized magnitude (`QMAX`), for 8-bit precisions.
    pub fn qmax(&self) -> Option<f32> {
        match self {
            Precision::Int8 => Some(127.0),
            Precision::Fp8 => Some(fp8::E4M3_MAX),
            _ => None,
        }
    }

    /// Bytes per packed element.
    pub fn element_bytes(&self) -> usize {
        match self {
            Precision::Int8 | Precision::Fp8 => 1,
            Precision::Bf16 | Precision::F16 => 2,
            Precision::F32 => 4,
        }
    }

    /// Smallest legal `K'` alignment: cuSPARSELt needs 32 for 8-bit and 16 for 16-bit types.
    pub fn min_alignment(&self) -> usize {
        match self.element_bytes() {
            1 => 32,
            _ => 16,
        }
    }

    /// Rounds a value the way this precision stores it, given the row scale.
    #[inline]
    pub fn quantize(&self, value: f32, scale: f32) -> f32 {
        match self {
            Precision::Int8 => round_ties_even(value / scale).clamp(-127.0, 127.0),
            Precision::Fp8 => fp8::round_to_e4m3(value / scale),
            Precision::Bf16 => bf16::from_f32(value).to_f32(),
            Precision::F16 => f16::from_f32(value).to_f32(),
            Precision::F32 => value,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Precision::Int8 => "int8",
            Precision::Fp8 => "fp8",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::F32 => "f32",
        })
    }
}

impl FromStr for Precision {
    type Err = SlideSparseError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "int8" | "i8" => Ok(Precision::Int8),
            "fp8" | "e4m3" | "fp8e4m3" | "fp8_e4m3" => Ok(Precision::Fp8),
            "bf16" => Ok(Precision::Bf16),
            "f16" | "fp16" => Ok(Precision::F16),
            "f32" | "fp32" => Ok(Precision::F32),
            _ => Err(SlideSparseError::InvalidPrecision(s.to_string())),
        }
    }
}

impl TryFrom<String> for Precision {
    type Error = SlideSparseError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<Precision> for String {
    fn from(p: Precision) -> String {
        p.to_string()
    }
}

/// Row-major weight codes in their storage type.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightCodes {
    /// INT8 values.
    I8(Vec<i8>),
    /// E4M3 bit patterns.
    Fp8(Vec<u8>),
    /// BF16 values.
    Bf16(Vec<bf16>),
    /// F16 values.
    F16(Vec<f16>),
    /// F32 values.
    F32(Vec<f32>),
}

impl WeightCodes {
    /// The precision these codes are stored in.
    pub fn precision(&self) -> Precision {
        match self {
            WeightCodes::I8(_) => Precision::Int8,
            WeightCodes::Fp8(_) => Precision::Fp8,
            WeightCodes::Bf16(_) => Precision::Bf16,
            WeightCodes::F16(_) => Precision::F16,
            WeightCodes::F32(_) => Precision::F32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            WeightCodes::I8(v) => v.len(),
            WeightCodes::Fp8(v) => v.len(),
            WeightCodes::Bf16(v) => v.len(),
            WeightCodes::F16(v) => v.len(),
            WeightCodes::F32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Code values as f32 (before the scale): INT8 integers, decoded E4M3, or the float.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            WeightCodes::I8(v) => v.par_iter().map(|&q| q as f32).collect(),
            WeightCodes::Fp8(v) => {
                let table = fp8::e4m3_decode_table();
                v.par_iter().map(|&c| table[c as usize]).collect()
            }
            WeightCodes::Bf16(v) => v.par_iter().map(|x| x.to_f32()).collect(),
            WeightCodes::F16(v) => v.par_iter().map(|x| x.to_f32()).collect(),
            WeightCodes::F32(v) => v.clone(),
        }
    }

    /// Little-endian bytes, as stored in safetensors.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            WeightCodes::I8(v) => v.iter().map(|&q| q as u8).collect(),
            WeightCodes::Fp8(v) => v.clone(),
            WeightCodes::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            WeightCodes::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            WeightCodes::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Evaluates `$body` with `$v` bound to the typed slice inside a [`WeightCodes`].
macro_rules! with_codes {
    ($codes:expr, $v:ident => $body:expr) => {
        match $codes {
            $crate::weight_quant::WeightCodes::I8($v) => $body,
            $crate::weight_quant::WeightCodes::Fp8($v) => $body,
            $crate::weight_quant::WeightCodes::Bf16($v) => $body,
            $crate::weight_quant::WeightCodes::F16($v) => $body,
            $crate::weight_quant::WeightCodes::F32($v) => $body,
        }
    };
}
pub(crate) use with_codes;

/// Like [`with_codes!`], wrapping the `Vec` that `$body` yields back into the same variant.
macro_rules! map_codes {
    ($codes:expr, $v:ident => $body:expr) => {
        match $codes {
            $crate::weight_quant::WeightCodes::I8($v) => {
                $crate::weight_quant::WeightCodes::I8($body)
            }
            $crate::weight_quant::WeightCodes::Fp8($v) => {
                $crate::weight_quant::WeightCodes::Fp8($body)
            }
            $crate::weight_quant::WeightCodes::Bf16($v) => {
                $crate::weight_quant::WeightCodes::Bf16($body)
            }
            $crate::weight_quant::WeightCodes::F16($v) => {
                $crate::weight_quant::WeightCodes::F16($body)
            }
            $crate::weight_quant::WeightCodes::F32($v) => {
                $crate::weight_quant::WeightCodes::F32($body)
            }
        }
    };
}
pub(crate) use map_codes;

/// A quantized `[rows, cols]` weight with one scale per row.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedWeight {
    /// Output channels.
    pub rows: usize,
    /// Columns (`K` dense, `K'` slid).
    pub cols: usize,
    /// Row-major codes.
    pub codes: WeightCodes,
    /// Per-output-channel scales (1 for float precisions and for all-zero rows).
    pub scales: Vec<f32>,
}

impl QuantizedWeight {
    /// Quantizes a row-major `[rows, cols]` f32 weight per output channel, as the packer
    /// does (INT8: `s = max|row| / 127`, codes `round_half_even(w / s)`; FP8: `/ 448` and
    /// E4M3; the float precisions round to their type with scale 1): the weight of a dense
    /// quantized layer ([`QuantizedLinear::from_quantized`](crate::QuantizedLinear)).
    ///
    /// Errors: `values` not `rows * cols` long; a NaN or infinite value (named by its row and
    /// column).
    pub fn quantize(
        values: &[f32],
        rows: usize,
        cols: usize,
        precision: Precision,
    ) -> Result<Self> {
        if values.len() != rows * cols {
            return Err(SlideSparseError::shape(
                "weight to quantize (rows x cols values)",
                rows * cols,
                values.len(),
            ));
        }
        check_finite("weight", values, cols)?;
        Ok(quantize_weight(values, rows, cols, precision))
    }

    /// Dequantized values `code * scale`, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut values = self.codes.to_f32();
        values
            .par_chunks_mut(self.cols.max(1))
            .zip(&self.scales)
            .for_each(|(chunk, s)| chunk.iter_mut().for_each(|v| *v *= s));
        values
    }
}

/// Per-row symmetric scale: `max|row| / qmax`, or 1 for an all-zero row.
pub fn row_scale(row: &[f32], qmax: f32) -> f32 {
    let absmax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if absmax == 0.0 { 1.0 } else { absmax / qmax }
}

/// Quantizes a row-major `[rows, cols]` f32 weight per output channel. Weights must be finite
/// (the packer checks this first).
pub fn quantize_weight(
    values: &[f32],
    rows: usize,
    cols: usize,
    precision: Precision,
) -> QuantizedWeight {
    assert_eq!(values.len(), rows * cols, "quantize_weight: shape");
    let scales: Vec<f32> = match precision.qmax() {
        Some(qmax) => values
            .par_chunks(cols.max(1))
            .map(|row| row_scale(row, qmax))
            .collect(),
        None => vec![1.0; rows],
    };
    quantize_weight_with_scales(values, rows, cols, precision, scales)
}

/// [`quantize_weight`] with the row scales given (a SparseGPT grid fixed them), not taken
/// from each row's maximum.
pub(crate) fn quantize_weight_with_scales(
    values: &[f32],
    rows: usize,
    cols: usize,
    precision: Precision,
    scales: Vec<f32>,
) -> QuantizedWeight {
    assert_eq!(
        scales.len(),
        rows,
        "quantize_weight_with_scales: one scale per row"
    );
    let codes = match precision {
        Precision::Int8 => WeightCodes::I8(map_rows(values, cols, &scales, i8::encode)),
        Precision::Fp8 => WeightCodes::Fp8(map_rows(values, cols, &scales, u8::encode)),
        Precision::Bf16 => WeightCodes::Bf16(map_rows(values, cols, &scales, bf16::encode)),
        Precision::F16 => WeightCodes::F16(map_rows(values, cols, &scales, f16::encode)),
        Precision::F32 => WeightCodes::F32(values.to_vec()),
    };
    QuantizedWeight {
        rows,
        cols,
        codes,
        scales,
    }
}

/// Applies `f(value, row scale)` to every element, in parallel over rows.
fn map_rows<T: Send + Default + Clone>(
    values: &[f32],
    cols: usize,
    scales: &[f32],
    f: impl Fn(f32, f32) -> T + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); values.len()];
    if cols == 0 {
        return out;
    }
    out.par_chunks_mut(cols)
        .zip(values.par_chunks(cols))
        .zip(scales)
        .for_each(|((dst, src), &s)| dst.iter_mut().zip(src).for_each(|(d, &v)| *d = f(v, s)));
    out
}

/// `x.round_ties_even()`, bit for bit (the sign of zero included), without the call to
/// `rintf` that the baseline x86-64 target makes of it (no SSE4.1 `roundss`): that call was
/// the packer's largest single cost. Adding and subtracting `2^23` rounds `|x| < 2^23` to an
/// integer in the default round-to-nearest-even mode (the sum lies in `[2^23, 2^24)`, whose
/// spacing is 1); larger magnitudes are integers already. No branch calls the library: LLVM
/// evaluates both sides of such a branch and selects, which kept the call for every element.
#[inline]
pub(crate) fn round_ties_even(x: f32) -> f32 {
    const TWO_23: f32 = 8_388_608.0;
    let a = x.abs();
    let rounded = if a < TWO_23 { (a + TWO_23) - TWO_23 } else { a };
    rounded.copysign(x)
}

/// One precision's element encoding: a value and its row's scale to a code, and a code back
/// to its value before the scale. Each storage type belongs to exactly one precision, so the
/// type names the encoding: the staged quantizer and the packer's fused row pass share it.
pub(crate) trait Codec: crate::slide::SlideElement + Default {
    /// The precision stored in this type.
    const PRECISION: Precision;
    /// Encodes `value` at `scale` (1 for the float precisions).
    fn encode(value: f32, scale: f32) -> Self;
    /// The code's value before the scale.
    fn decode(self) -> f32;
    /// Wraps a row-major code vector.
    fn into_codes(codes: Vec<Self>) -> WeightCodes;
}

impl Codec for i8 {
    const PRECISION: Precision = Precision::Int8;
    fn encode(value: f32, scale: f32) -> Self {
        Precision::Int8.quantize(value, scale) as i8
    }
    fn decode(self) -> f32 {
        self as f32
    }
    fn into_codes(codes: Vec<Self>) -> WeightCodes {
        WeightCodes::I8(codes)
    }
}

impl Codec for u8 {
    const PRECISION: Precision = Precision::Fp8;
    fn encode(value: f32, scale: f32) -> Self {
        canonical_fp8(fp8::f32_to_e4m3(value / scale))
    }
    fn decode(self) -> f32 {
        fp8::e4m3_to_f32(self)
    }
    fn into_codes(codes: Vec<Self>) -> WeightCodes {
        WeightCodes::Fp8(codes)
    }
}

impl Codec for bf16 {
    const PRECISION: Precision = Precision::Bf16;
    fn encode(value: f32, _scale: f32) -> Self {
        bf16::from_f32(value)
    }
    fn decode(self) -> f32 {
        self.to_f32()
    }
    fn into_codes(codes: Vec<Self>) -> WeightCodes {
        WeightCodes::Bf16(codes)
    }
}

impl Codec for f16 {
    const PRECISION: Precision = Precision::F16;
    fn encode(value: f32, _scale: f32) -> Self {
        f16::from_f32(value)
    }
    fn decode(self) -> f32 {
        self.to_f32()
    }
    fn into_codes(codes: Vec<Self>) -> WeightCodes {
        WeightCodes::F16(codes)
    }
}

impl Codec for f32 {
    const PRECISION: Precision = Precision::F32;
    fn encode(value: f32, _scale: f32) -> Self {
        value
    }
    fn decode(self) -> f32 {
        self
    }
    fn into_codes(codes: Vec<Self>) -> WeightCodes {
        WeightCodes::F32(codes)
    }
}

/// `-0` (0x80) becomes `+0`: a negative zero has been seen to break 2:4 compressors.
pub(crate) fn canonical_fp8(code: u8) -> u8 {
    if code == 0x80 { 0 } else { code }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_ties_even_matches_the_library_bit_for_bit() {
        let check = |x: f32| {
            assert_eq!(
                round_ties_even(x).to_bits(),
                x.round_ties_even().to_bits(),
                "{x:e}"
            )
        };
        // Every quarter in +-4096 (halves, the ties), and both signs of zero.
        (-16384..=16384).for_each(|q| check(q as f32 / 4.0));
        check(-0.0);
        // Around 2^22 (halves stop) and 2^23 (fractions stop).
        for base in [4_194_304.0f32, 8_388_608.0, 8_388_609.0] {
            let mut x = base;
            for _ in 0..64 {
                for v in [x, -x] {
                    check(v);
                }
                x = f32::from_bits(x.to_bits() - 1);
            }
        }
        // Bit patterns spread over every exponent: a xorshift walk over the finite range.
        let mut rng = crate::test_rng::XorShift32(0x9E37_79B9);
        for _ in 0..2_000_000 {
            let x = f32::from_bits(rng.next_u32());
            if x.is_finite() {
                check(x);
            }
        }
    }

    #[test]
    fn int8_rounds_half_to_even_and_clamps() {
        // Row max 127 gives scale 1, so the codes are the rounded values themselves.
        let w = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 3.49];
        let q = quantize_weight(&w, 1, 8, Precision::Int8);
        assert_eq!(q.scales, vec![1.0]);
        assert_eq!(q.codes, WeightCodes::I8(vec![127, 0, 2, 2, 0, -2, -127, 3]));
    }

    #[test]
    fn zero_rows_get_scale_one() {
        let q = quantize_weight(&[0.0; 8], 2, 4, Precision::Fp8);
        assert_eq!(q.scales, vec![1.0, 1.0]);
        assert_eq!(q.codes, WeightCodes::Fp8(vec![0; 8]));
    }

    #[test]
    fn fp8_row_max_maps_to_448() {
        let q = quantize_weight(&[0.0, -3.0, 1.0, 2.0], 1, 4, Precision::Fp8);
        assert_eq!(q.scales[0], 3.0 / 448.0);
        let WeightCodes::Fp8(codes) = &q.codes else {
            panic!()
        };
        assert_eq!(fp8::e4m3_to_f32(codes[1]), -448.0);
        let deq = q.dequantize();
        for (a, b) in deq.iter().zip([0.0, -3.0, 1.0, 2.0]) {
            assert!((a - b).abs() <= 0.07 * b.abs() + 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn precision_names_round_trip() {
        for p in Precision::ALL {
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
        }
        assert!("int4".parse::<Precision>().is_err());
    }
}
