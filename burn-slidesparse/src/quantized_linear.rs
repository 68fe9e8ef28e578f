//! `QuantizedLinear`: the dense baseline of SlideSparse as a burn module. The same
//! per-token activation quantization, per-channel weight scales, accumulator and epilogue as
//! [`SlideSparseLinear`](crate::SlideSparseLinear), with the dense weight (no pruning, no
//! slide) and a dense GEMM (cuBLASLt on burn-cuda). Benchmarks compare the two like with like.

use std::sync::Arc;

use burn::{
    module::{Module, Param},
    nn::Linear,
    tensor::{Tensor, backend::Backend},
};

use crate::{
    backend::{DenseTensors, PreparedSlot, SlideSparseBackend},
    codes::WeightCodesModule,
    error::Result,
    sparse_linear::{LinearOnHost, float_param, on_rows, prepared_key, to_vec_f32},
    weight_quant::{Precision, QuantizedWeight, quantize_weight},
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
///
/// Like [`SlideSparseLinear`](crate::SlideSparseLinear), the codes stay on the host and the
/// device holds the backend's prepared copy (on CUDA, the one padded code matrix cuBLASLt
/// reads) and the bias.
#[derive(Module, Debug)]
pub struct QuantizedLinear<B: Backend> {
    /// `W [out, in]` codes and per-output-channel scales, on the host.
    pub weight: WeightCodesModule<B>,
    /// Bias `[out]`, if the layer has one.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// Precision and sizes (not persisted in the record).
    pub spec: DenseSpec,
    prepared: PreparedSlot,
}

impl<B: Backend> QuantizedLinear<B> {
    /// A quantized `[out, in]` weight on `device` (the codes are copied; only the bias is
    /// uploaded here, the weight is prepared on the first forward).
    pub fn from_quantized(
        weight: &QuantizedWeight,
        bias: Option<&[f32]>,
        device: &B::Device,
    ) -> Self {
        Self::from_quantized_owned(weight.clone(), bias, device)
    }

    /// [`from_quantized`](Self::from_quantized) taking the weight, its codes moved.
    pub fn from_quantized_owned(
        weight: QuantizedWeight,
        bias: Option<&[f32]>,
        device: &B::Device,
    ) -> Self {
        let spec = DenseSpec {
            precision: weight.codes.precision(),
            in_features: weight.cols,
            out_features: weight.rows,
        };
        Self {
            bias: bias.map(|b| float_param(b.to_vec(), &[spec.out_features], device)),
            weight: WeightCodesModule::new(weight, device),
            spec,
            prepared: PreparedSlot::default(),
        }
    }

    /// Quantizes a `burn::nn::Linear` (weight layout `[in, out]`) without pruning.
    pub fn from_linear(linear: &Linear<B>, precision: Precision) -> Result<Self> {
        let host = LinearOnHost::read(linear)?;
        let quantized =
            quantize_weight(&host.weight, host.out_features, host.in_features, precision);
        Ok(Self::from_quantized_owned(
            quantized,
            host.bias.as_deref(),
            &host.device,
        ))
    }

    /// The layer's weight (codes from the host) and bias (read from the device, which
    /// synchronizes): what [`from_quantized`](Self::from_quantized) takes.
    pub fn to_quantized(&self) -> Result<(QuantizedWeight, Option<Vec<f32>>)> {
        let bias = match &self.bias {
            Some(b) => Some(to_vec_f32(b.val().into_data(), "bias")?),
            None => None,
        };
        Ok((Arc::unwrap_or_clone(self.weight.weight()), bias))
    }

    fn dense_tensors(&self) -> DenseTensors<B> {
        DenseTensors {
            weight: self.weight.weight(),
            bias: self.bias.as_ref().map(|b| b.val()),
            device: self.weight.device().clone(),
        }
    }
}

impl<B: SlideSparseBackend> QuantizedLinear<B> {
    /// The backend's prepared weights, built once per device and parameter set.
    pub fn prepared(&self) -> Result<B::DensePrepared> {
        self.prepared
            .get_or_try_init(prepared_key(&self.weight), || {
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
