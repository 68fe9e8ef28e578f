//! What a GEMM writes for the epilogue: the accumulator type, and whether the per-channel
//! weight scale is already applied.
//!
//! The rule: the accumulator is as precise as the layer's output and no more. f32 layers
//! get exact INT32 (INT8 inputs) or FP32 (FP8) accumulators; 16-bit layers get 16-bit
//! accumulators in their own type, which halves the GEMM's writes and the epilogue's reads.
//! For INT8 inputs with a 16-bit output, cuSPARSELt applies the weight scales itself (its
//! alpha vector, which exists for INT8 only) before rounding, so the rounding to 16 bits
//! happens on the scaled value. cuBLASLt has no INT8 -> 16-bit GEMM: the dense INT8
//! baseline always writes INT32.
//!
//! A GEMM with the epilogue in its own kernel (our Hopper sparse GEMM, 16-bit outputs) writes
//! the layer's output itself: the accumulator is then [`finished`](Accumulator::finished), and no
//! epilogue kernel runs.

use burn::tensor::DType;

use crate::weight_quant::Precision;

/// Element type of a GEMM output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccType {
    I32,
    F32,
    Bf16,
    F16,
}

impl AccType {
    pub fn bytes(self) -> usize {
        match self {
            Self::I32 | Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    /// The 16-bit type of a layer output, if it is one.
    fn half_of(out: DType) -> Option<Self> {
        match out {
            DType::BF16 => Some(Self::Bf16),
            DType::F16 => Some(Self::F16),
            _ => None,
        }
    }
}

/// A GEMM output type plus whether it already holds `acc * s_w`, or the finished output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Accumulator {
    pub ty: AccType,
    pub channel_scaled: bool,
    /// The GEMM writes the layer output `Y [m, n] = acc * s_x * s_w + b` itself (rows of `n`,
    /// not `n_pad`): no epilogue kernel runs.
    pub finished: bool,
}

impl Accumulator {
    const fn plain(ty: AccType) -> Self {
        Self {
            ty,
            channel_scaled: false,
            finished: false,
        }
    }

    /// The layer output of dtype `out` written by a GEMM that applies the epilogue itself,
    /// where `out` is a 16-bit type; `None` for f32 outputs.
    pub fn finished(out: DType) -> Option<Self> {
        AccType::half_of(out).map(|ty| Self {
            ty,
            channel_scaled: true,
            finished: true,
        })
    }

    /// What the cuSPARSELt GEMM of a `precision` layer with float output `out` writes.
    pub fn sparse(precision: Precision, out: DType) -> Self {
        match (precision, AccType::half_of(out)) {
            (Precision::Int8, Some(half)) => Self {
                ty: half,
                channel_scaled: true,
                finished: false,
            },
            (Precision::Fp8, Some(half)) => Self::plain(half),
            _ => Self::dense(precision, out),
        }
    }

    /// What the cuBLASLt GEMM of the dense baseline writes.
    pub fn dense(precision: Precision, out: DType) -> Self {
        match (precision, AccType::half_of(out)) {
            (Precision::Int8, _) => Self::plain(AccType::I32),
            (Precision::Fp8, Some(half)) => Self::plain(half),
            (Precision::Fp8 | Precision::F32, None) => Self::plain(AccType::F32),
            (Precision::Bf16, _) => Self::plain(AccType::Bf16),
            (Precision::F16, _) => Self::plain(AccType::F16),
            (Precision::F32, Some(_)) => Self::plain(AccType::F32),
        }
    }

    pub fn bytes(self) -> usize {
        self.ty.bytes()
    }

    /// The classic accumulator of an f32 layer (INT32 / FP32 / the 16-bit input type).
    pub fn is_full_precision(self, precision: Precision) -> bool {
        self == Self::dense(precision, DType::F32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_layers_keep_exact_accumulators_and_16_bit_layers_halve_them() {
        let int8_f32 = Accumulator::sparse(Precision::Int8, DType::F32);
        assert_eq!(int8_f32, Accumulator::plain(AccType::I32));
        let int8_bf16 = Accumulator::sparse(Precision::Int8, DType::BF16);
        assert_eq!(int8_bf16.ty, AccType::Bf16);
        assert!(int8_bf16.channel_scaled);
        // cuBLASLt has no INT8 -> 16-bit: the dense baseline keeps INT32.
        assert_eq!(
            Accumulator::dense(Precision::Int8, DType::BF16).ty,
            AccType::I32
        );
        assert!(!int8_bf16.finished);
        let fp8_f16 = Accumulator::sparse(Precision::Fp8, DType::F16);
        assert_eq!(fp8_f16, Accumulator::plain(AccType::F16));
        assert_eq!(Accumulator::dense(Precision::Fp8, DType::F16), fp8_f16);
        assert_eq!(
            Accumulator::sparse(Precision::Bf16, DType::F32).ty,
            AccType::Bf16
        );
    }

    #[test]
    fn finished_outputs_are_16_bit_only() {
        let bf16 = Accumulator::finished(DType::BF16).unwrap();
        assert_eq!((bf16.ty, bf16.finished), (AccType::Bf16, true));
        assert_eq!(Accumulator::finished(DType::F16).unwrap().ty, AccType::F16);
        assert_eq!(Accumulator::finished(DType::F32), None);
    }
}
