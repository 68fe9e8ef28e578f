//! [`MaybeSparseLinear`]: a model's swappable linear layer, an enum module of the layer
//! kinds (dense `nn::Linear`, [`MaskedLinear`], [`SlideSparseLinear`], [`QuantizedLinear`]),
//! and [`VisitLinears`], how a model lists those layers by name.
//!
//! Rust models have fixed field types, so a model that wants to choose per layer holds
//! [`MaybeSparseLinear`] fields and lists them through [`VisitLinears`]; the conversions of
//! `sparsify.rs` ([`sparsify`](crate::sparsify) packs every listed layer a filter accepts,
//! e.g. everything but the LM head) and the loaders of `load.rs` then work on any such model.

use burn::{
    module::Module,
    nn::Linear,
    tensor::{Tensor, backend::Backend},
};

use crate::{
    backend::SlideSparseBackend, error::Result, masked_linear::MaskedLinear, pack::PackOptions,
    pattern::SparsityPattern, prune::PruneMethod, quantized_linear::QuantizedLinear,
    sparse_linear::SlideSparseLinear, weight_quant::Precision,
};

/// A linear layer that is dense (`burn::nn::Linear`), dense under a training mask
/// ([`MaskedLinear`]), SlideSparse, or the dense quantized baseline ([`QuantizedLinear`]).
///
/// Its record is an enum too: a record saved from a sparsified model only loads into a model
/// sparsified the same way. burn's derived `load_record` panics on a variant mismatch, so
/// load through [`load_record`](crate::load_record) or [`load_file`](crate::load_file), which turn
/// that into an error.
#[derive(Module, Debug)]
pub enum MaybeSparseLinear<B: Backend> {
    /// A dense `burn::nn::Linear`, as the model was built.
    Dense(Linear<B>),
    /// Dense, trainable under a (2N-2):2N mask.
    Masked(MaskedLinear<B>),
    /// Packed SlideSparse.
    Sparse(SlideSparseLinear<B>),
    /// Quantized without pruning (the baseline SlideSparse is measured against).
    Quantized(QuantizedLinear<B>),
}

impl<B: Backend> From<Linear<B>> for MaybeSparseLinear<B> {
    fn from(linear: Linear<B>) -> Self {
        Self::Dense(linear)
    }
}

impl<B: Backend> From<SlideSparseLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: SlideSparseLinear<B>) -> Self {
        Self::Sparse(layer)
    }
}

impl<B: Backend> From<MaskedLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: MaskedLinear<B>) -> Self {
        Self::Masked(layer)
    }
}

impl<B: Backend> From<QuantizedLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: QuantizedLinear<B>) -> Self {
        Self::Quantized(layer)
    }
}

impl<B: Backend> MaybeSparseLinear<B> {
    /// Whether the layer is SlideSparse.
    pub fn is_sparse(&self) -> bool {
        matches!(self, Self::Sparse(_))
    }

    /// The dense layer, if it is dense.
    pub fn dense(&self) -> Option<&Linear<B>> {
        match self {
            Self::Dense(layer) => Some(layer),
            _ => None,
        }
    }

    /// The sparse layer, if it is sparse.
    pub fn sparse(&self) -> Option<&SlideSparseLinear<B>> {
        match self {
            Self::Sparse(layer) => Some(layer),
            _ => None,
        }
    }

    /// The masked (trainable sparse) layer, if it is one.
    pub fn masked(&self) -> Option<&MaskedLinear<B>> {
        match self {
            Self::Masked(layer) => Some(layer),
            _ => None,
        }
    }

    /// The dense quantized baseline layer, if it is one.
    pub fn quantized(&self) -> Option<&QuantizedLinear<B>> {
        match self {
            Self::Quantized(layer) => Some(layer),
            _ => None,
        }
    }

    /// The variant's name, as burn's module tree and records spell it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Dense(_) => "Dense",
            Self::Masked(_) => "Masked",
            Self::Sparse(_) => "Sparse",
            Self::Quantized(_) => "Quantized",
        }
    }

    /// `(in_features, out_features)` of the layer, whichever kind it is (without
    /// initializing a lazily initialized dense weight).
    pub fn features(&self) -> (usize, usize) {
        let linear = |l: &Linear<B>| {
            let shape = l.weight.lazy_shape();
            (shape[0], shape[1])
        };
        match self {
            Self::Dense(layer) => linear(layer),
            Self::Masked(layer) => linear(&layer.linear),
            Self::Sparse(layer) => (layer.spec.in_features, layer.spec.out_features),
            Self::Quantized(layer) => (layer.spec.in_features, layer.spec.out_features),
        }
    }

    /// Whether the layer has a bias.
    pub fn has_bias(&self) -> bool {
        match self {
            Self::Dense(layer) => layer.bias.is_some(),
            Self::Masked(layer) => layer.linear.bias.is_some(),
            Self::Sparse(layer) => layer.bias.is_some(),
            Self::Quantized(layer) => layer.bias.is_some(),
        }
    }

    /// The device the layer lives on (without initializing a lazy dense weight).
    pub fn device(&self) -> B::Device {
        match self {
            Self::Dense(layer) => layer.weight.lazy_device(),
            Self::Masked(layer) => layer.linear.weight.lazy_device(),
            Self::Sparse(layer) => layer.weight.device().clone(),
            Self::Quantized(layer) => layer.weight.device().clone(),
        }
    }

    /// Quantizes a dense layer in place without pruning (the like-for-like baseline of
    /// SlideSparse); other kinds are left as they are.
    pub fn quantize(&mut self, precision: Precision) -> Result<()> {
        if let Self::Dense(dense) = self {
            *self = QuantizedLinear::from_linear(dense, precision)?.into();
        }
        Ok(())
    }

    /// Packs a dense layer (pruning it with `options`) or a masked layer (checking its
    /// pattern instead of pruning) in place; a sparse layer is left as it is.
    pub fn sparsify(&mut self, options: &PackOptions) -> Result<()> {
        match self {
            Self::Dense(dense) => *self = SlideSparseLinear::from_linear(dense, options)?.into(),
            Self::Masked(masked) => *self = masked.to_sparse(options)?.into(),
            Self::Sparse(_) | Self::Quantized(_) => {}
        }
        Ok(())
    }

    /// Prunes a dense layer to `pattern` with `method` and keeps it trainable under the mask
    /// (other kinds are left as they are). On error the layer stays dense.
    pub fn mask(&mut self, pattern: SparsityPattern, method: &PruneMethod) -> Result<()> {
        if let Self::Dense(dense) = self {
            // `from_linear` consumes its layer; the clone shares the tensors, and keeping the
            // original in place means an error leaves the model as it was.
            *self = MaskedLinear::from_linear(dense.clone(), pattern, method)?.into();
        }
        Ok(())
    }
}

impl<B: SlideSparseBackend> MaybeSparseLinear<B> {
    /// `[..., in] -> [..., out]` through whichever layer this is, or the error of a
    /// SlideSparse or quantized layer (a dense one panics on a bad shape, as burn's does).
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> Result<Tensor<B, D>> {
        match self {
            Self::Dense(layer) => Ok(layer.forward(input)),
            Self::Masked(layer) => Ok(layer.forward(input)),
            Self::Sparse(layer) => layer.try_forward(input),
            Self::Quantized(layer) => layer.try_forward(input),
        }
    }

    /// `[..., in] -> [..., out]` through whichever layer this is.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Self::Dense(layer) => layer.forward(input),
            Self::Masked(layer) => layer.forward(input),
            Self::Sparse(layer) => layer.forward(input),
            Self::Quantized(layer) => layer.forward(input),
        }
    }
}

/// A model that can list its swappable linear layers by name.
pub trait VisitLinears<B: Backend> {
    /// Calls `f` with the name and layer of every swappable linear layer.
    fn visit_linears(
        &mut self,
        f: &mut dyn FnMut(&str, &mut MaybeSparseLinear<B>) -> Result<()>,
    ) -> Result<()>;
}
