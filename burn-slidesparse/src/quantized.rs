//! `QuantizedLinear`: the dense baseline of SlideSparse as a burn module. The same
//! per-token activation quantization, per-channel weight scales, accumulator and epilogue as
//! [`SlideSparseLinear`](crate::SlideSparseLinear), with the dense weight (no pruning, no
//! slide) and a dense GEMM (cuBLASLt on burn-cuda). Benchmarks compare the two like with like.

use burn::{
    module::{Module, Param},
    nn::Linear,
    tensor::{Tensor, backend::Backend},
};

use crate::{
    backend::{DenseTensors, PreparedSlot, SlideSparseBackend},
    error::Result,
    module::{LinearOnHost, f32_param, float_param, on_rows, prepared_key},
    quant::{Precision, QuantizedWeight, quantize_weight},
};

/// Sizes and precision of a [`QuantizedLinear`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct DenseSpec {
    pub precision: Precision,
    pub in_features: usize,
    pub out_features: usize,
}

/// A dense linear layer `[..., in] -> [..., out]` with a quantized weight (INT8 or FP8
/// codes with per-channel scales; BF16/F16 rounded values) and, for 8-bit precisions,
/// per-token quantized activations.
#[derive(Module, Debug)]
pub struct QuantizedLinear<B: Backend> {
    /// `W [out, in]` code values.
    pub weight: Param<Tensor<B, 2>>,
    /// Per-output-channel scales `[out]`, in f32 on every backend.
    pub weight_scale: Param<Tensor<B, 1>>,
    /// Bias `[out]`, if the layer has one.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// Precision and sizes (not persisted in the record).
    pub spec: DenseSpec,
    prepared: PreparedSlot,
}

impl<B: Backend> QuantizedLinear<B> {
    /// Uploads a quantized `[out, in]` weight.
    pub fn from_quantized(
        weight: &QuantizedWeight,
        bias: Option<&[f32]>,
        device: &B::Device,
    ) -> Self {
        let shape = [weight.rows, weight.cols];
        Self {
            weight: float_param(weight.codes.to_f32(), &shape, device),
            weight_scale: f32_param(weight.scales.clone(), &[shape[0]], device),
            bias: bias.map(|b| float_param(b.to_vec(), &[shape[0]], device)),
            spec: DenseSpec {
                precision: weight.codes.precision(),
                in_features: weight.cols,
                out_features: weight.rows,
            },
            prepared: PreparedSlot::default(),
        }
    }

    /// Quantizes a `burn::nn::Linear` (weight layout `[in, out]`) without pruning.
    pub fn from_linear(linear: &Linear<B>, precision: Precision) -> Result<Self> {
        let host = LinearOnHost::read(linear)?;
        let quantized =
            quantize_weight(&host.weight, host.out_features, host.in_features, precision);
        Ok(Self::from_quantized(
            &quantized,
            host.bias.as_deref(),
            &host.device,
        ))
    }

    fn dense_tensors(&self) -> DenseTensors<B> {
        DenseTensors {
            precision: self.spec.precision,
            weight: self.weight.val(),
            scale: self.weight_scale.val(),
            bias: self.bias.as_ref().map(|b| b.val()),
        }
    }
}

impl<B: SlideSparseBackend> QuantizedLinear<B> {
    /// The backend's prepared weights, built once per device and parameter set.
    pub fn prepared(&self) -> Result<B::DensePrepared> {
        self.prepared
            .get_or_try_init(prepared_key(&self.weight, &self.weight_scale), || {
                B::dense_prepare(self.dense_tensors())
            })
    }

    /// Applies the layer to `[..., in]`, or an error (wrong input width, preparation failure).
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> Result<Tensor<B, D>> {
        on_rows(
            input,
            (self.spec.in_features, self.spec.out_features),
            "QuantizedLinear input (last dimension)",
            |x| B::dense_forward(x, &self.prepared()?),
        )
    }

    /// [`try_forward`](Self::try_forward), panicking on its error like `nn::Linear` does.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.try_forward(input)
            .unwrap_or_else(|e| panic!("QuantizedLinear::forward: {e}"))
    }
}
