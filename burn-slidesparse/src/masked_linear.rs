//! Training with a fixed `(2N-2):2N` mask: `MaskedLinear`, a `burn::nn::Linear` whose pruned
//! weights stay exactly zero through every optimizer step.
//!
//! How the invariant holds: the forward uses `W ⊙ M` (M the 0/1 mask), so the gradient of
//! every pruned weight is exactly zero; the weights start pruned (zero), and an Adam/AdamW/SGD
//! step with a zero gradient leaves a zero weight at zero (first and second moments stay 0,
//! decoupled weight decay scales 0). Even an optimizer that moved them could not change the
//! function, because the forward masks again; [`MaskedLinear::apply_mask`] makes the stored
//! weights match the function before packing.
//!
//! Quantization-aware training: [`MaskedLinear::with_quantization`] makes the forward round
//! the masked weight per output channel and the input per token to an 8-bit precision's grid,
//! as the packed layer does, with gradients passed straight through the rounding; the
//! trained layer then computes what its packed INT8/FP8 layer computes, up to f32 summation
//! order.
//!
//! Conversions: [`MaskedLinear::from_linear`] prunes an `nn::Linear` (magnitude or
//! activation-aware, as the packer does), [`MaskedLinear::to_sparse`] packs the trained layer
//! into a [`SlideSparseLinear`] for inference (the pattern is checked, nothing is re-pruned).
//! [`MaskedLinear::from_linear_permuted`] prunes in an input-channel order: the weight stays
//! in the original order and its mask satisfies the pattern in the permuted one, which the
//! layer keeps for [`check`](MaskedLinear::check) and packing.

use burn::{
    module::{Module, Param, ParamId},
    nn::Linear,
    tensor::{Tensor, TensorData, backend::Backend},
};

use crate::{
    error::{Result, SlideSparseError},
    pack::PackOptions,
    pattern::SparsityPattern,
    permute::{ChannelPermutation, InputPermutation},
    prune::{PruneMethod, check_pattern, prune},
    reference::{quantize_codes, token_scales},
    sparse_linear::{SlideSparseLinear, to_vec_f32},
    weight_quant::Precision,
};

/// A dense linear layer trained under a fixed sparsity mask.
#[derive(Module, Debug)]
pub struct MaskedLinear<B: Backend> {
    /// The layer; its weight (`[in, out]`, burn's layout) is zero wherever the mask is.
    pub linear: Linear<B>,
    /// `1` where a weight may be nonzero, `0` where it was pruned (`[in, out]`); not trained.
    pub mask: Param<Tensor<B, 2>>,
    /// The 8-bit precision whose rounding the forward simulates (quantization-aware
    /// training), or `None` for the f32 function. Not stored in records.
    #[module(skip)]
    pub quantization: Option<Precision>,
    /// The input order the mask was chosen in (the pattern holds on the weight's columns in
    /// this order), or `None` for the original order. Not stored in records.
    #[module(skip)]
    pub input_permutation: Option<InputPermutation>,
}

impl<B: Backend> MaskedLinear<B> {
    /// Prunes `linear` to `pattern` with `method` and masks it.
    pub fn from_linear(
        linear: Linear<B>,
        pattern: SparsityPattern,
        method: &PruneMethod,
    ) -> Result<Self> {
        Self::from_linear_permuted(linear, pattern, method, None)
    }

    /// Prunes `linear` to `pattern` with `method` in the input order `permutation` (the
    /// method's calibration given in the original order, as for the packer) and masks it;
    /// the weight and mask stay in the original order.
    pub fn from_linear_permuted(
        linear: Linear<B>,
        pattern: SparsityPattern,
        method: &PruneMethod,
        permutation: Option<InputPermutation>,
    ) -> Result<Self> {
        let weight = linear.weight.val();
        let (device, dtype) = (weight.device(), weight.dtype());
        let [d_in, d_out] = weight.dims();
        // The pruner works on the PyTorch layout `[out, in]`, blocks along `in`.
        let w = to_vec_f32(weight.transpose().into_data(), "linear weight")?;
        let pruned = match &permutation {
            Some(p) => {
                p.check_len("linear.weight", d_in)?;
                let permuted = p.permute_columns(&w);
                let method = p.permute_method(method);
                let pruned = prune("linear.weight", &permuted, d_out, d_in, pattern, &method)?;
                p.unpermute_columns(&pruned)
            }
            None => prune("linear.weight", &w, d_out, d_in, pattern, method)?,
        };
        let mask: Vec<f32> = pruned
            .iter()
            .map(|v| if *v != 0.0 { 1.0 } else { 0.0 })
            .collect();
        let to_burn_layout = |values: Vec<f32>| {
            Tensor::<B, 2>::from_data(TensorData::new(values, [d_out, d_in]), (&device, dtype))
                .transpose()
        };
        let mask = to_burn_layout(mask);
        let weight = to_burn_layout(pruned);
        Ok(Self {
            linear: Linear {
                weight: trainable(linear.weight.id, weight),
                bias: linear.bias,
            },
            mask: Param::from_tensor(mask).set_require_grad(false),
            quantization: None,
            input_permutation: permutation.filter(|p| !p.is_identity()),
        })
    }

    /// The layer with a forward that simulates `precision`'s quantization (8-bit only: the
    /// 16-bit precisions round without scales and are not simulated).
    pub fn with_quantization(self, precision: Precision) -> Result<Self> {
        if !precision.is_quantized() {
            return Err(SlideSparseError::Unsupported {
                what: format!("quantization-aware training with {precision}"),
                why: "only the 8-bit precisions (int8, fp8) are simulated".into(),
            });
        }
        Ok(Self {
            quantization: Some(precision),
            ..self
        })
    }

    /// The weight the layer computes with, `W ⊙ M`.
    pub fn effective_weight(&self) -> Tensor<B, 2> {
        self.linear.weight.val() * self.mask.val()
    }

    /// `[..., in] -> [..., out]` with the masked weight (rounded as the packed layer rounds
    /// it when [`Self::quantization`] is set).
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let bias = self.linear.bias.as_ref().map(|b| b.val());
        let weight = self.effective_weight();
        let Some(precision) = self.quantization else {
            return burn::tensor::module::linear(input, weight, bias);
        };
        let qmax = precision
            .qmax()
            .expect("with_quantization admits 8-bit precisions");
        let dims = input.dims();
        let k = dims[D - 1];
        let rows = input.reshape([dims[..D - 1].iter().product::<usize>(), k]);
        let x = straight_through(rows, |x| {
            let s_x = token_scales(x.clone(), qmax);
            quantize_codes(x / s_x.clone(), precision) * s_x
        });
        let w = straight_through(weight, |w| {
            // The packer's per-output-channel scale: max |w| / qmax, 1 for an all-zero row.
            let absmax = w.clone().abs().max_dim(0);
            let s_w = absmax.clone().mask_fill(absmax.equal_elem(0.0), qmax) / qmax;
            quantize_codes(w / s_w.clone(), precision) * s_w
        });
        let mut out_dims = dims;
        out_dims[D - 1] = w.dims()[1];
        burn::tensor::module::linear(x, w, bias).reshape(out_dims)
    }

    /// Writes `W ⊙ M` into the weight parameter (same parameter id), so that stored weights
    /// equal the function even after an optimizer that does not respect zero gradients.
    pub fn apply_mask(self) -> Self {
        let masked = self.effective_weight().detach();
        Self {
            linear: Linear {
                weight: trainable(self.linear.weight.id, masked),
                bias: self.linear.bias,
            },
            mask: self.mask,
            quantization: self.quantization,
            input_permutation: self.input_permutation,
        }
    }

    /// Errors unless the stored weight satisfies `pattern` (in the layer's input order) and
    /// is zero wherever the mask is.
    pub fn check(&self, pattern: SparsityPattern) -> Result<()> {
        let weight = self.linear.weight.val();
        let [d_in, d_out] = weight.dims();
        let w = to_vec_f32(weight.clone().transpose().into_data(), "weight")?;
        let w = match &self.input_permutation {
            Some(p) => {
                p.check_len("masked weight", d_in)?;
                p.permute_columns(&w)
            }
            None => w,
        };
        check_pattern("masked weight", &w, d_out, d_in, pattern)?;
        let outside = to_vec_f32(
            (weight * (self.mask.val().neg() + 1.0))
                .abs()
                .sum()
                .into_data(),
            "masked-out weights",
        )?;
        if outside[0] != 0.0 {
            return Err(SlideSparseError::Backend(format!(
                "masked weight: pruned positions hold nonzero values (sum |w| = {})",
                outside[0]
            )));
        }
        Ok(())
    }

    /// Packs the trained layer for inference with `options` (its pattern must be the mask's;
    /// pruning is replaced by a check, and the layer's input order replaces the options',
    /// so the packed layer computes the masked function up to quantization).
    pub fn to_sparse(&self, options: &PackOptions) -> Result<SlideSparseLinear<B>> {
        let linear = Linear {
            weight: Param::from_tensor(self.effective_weight()),
            bias: self.linear.bias.clone(),
        };
        let options = PackOptions {
            prune: PruneMethod::None,
            permutation: self
                .input_permutation
                .clone()
                .map_or(ChannelPermutation::Identity, ChannelPermutation::Given),
            ..options.clone()
        };
        SlideSparseLinear::from_linear(&linear, &options)
    }
}

/// `rounded(x)` in the forward, the identity in the backward (the straight-through estimator:
/// rounding has a zero gradient almost everywhere, which would stop training).
fn straight_through<B: Backend>(
    x: Tensor<B, 2>,
    rounded: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let constant = x.clone().detach();
    let offset = (rounded(constant.clone()) - constant).detach();
    x + offset
}

/// A parameter with the given id whose tensor requires gradients (a tensor built from data
/// does not, and `Param::map` keeps that: the optimizer would then never update it).
fn trainable<B: Backend>(id: ParamId, value: Tensor<B, 2>) -> Param<Tensor<B, 2>> {
    Param::initialized(id, value.require_grad())
}
