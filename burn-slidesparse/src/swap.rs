//! Swapping a model's `nn::Linear` layers for `SlideSparseLinear` (or for a trainable
//! [`MaskedLinear`] first, to fine-tune under the sparsity pattern).
//!
//! Rust models have fixed field types, so a model that wants to choose per layer holds
//! [`MaybeSparseLinear`] fields and lists them through [`VisitLinears`]; [`sparsify`] then
//! packs every listed layer that the filter accepts (e.g. everything but the LM head).

use burn::{
    module::Module,
    nn::Linear,
    tensor::{Tensor, backend::Backend},
};

use crate::{
    backend::SlideSparseBackend,
    error::{Result, SlideSparseError},
    masked::MaskedLinear,
    module::SlideSparseLinear,
    pack::PackOptions,
    pattern::SparsityPattern,
    prune::PruneMethod,
    quant::Precision,
    quantized::QuantizedLinear,
};

/// A linear layer that is dense (`burn::nn::Linear`), dense under a training mask
/// ([`MaskedLinear`]), SlideSparse, or the dense quantized baseline ([`QuantizedLinear`]).
/// Exactly one field is set.
#[derive(Module, Debug)]
pub struct MaybeSparseLinear<B: Backend> {
    dense: Option<Linear<B>>,
    sparse: Option<SlideSparseLinear<B>>,
    masked: Option<MaskedLinear<B>>,
    quantized: Option<QuantizedLinear<B>>,
}

impl<B: Backend> MaybeSparseLinear<B> {
    fn empty() -> Self {
        Self {
            dense: None,
            sparse: None,
            masked: None,
            quantized: None,
        }
    }
}

impl<B: Backend> From<Linear<B>> for MaybeSparseLinear<B> {
    fn from(linear: Linear<B>) -> Self {
        Self {
            dense: Some(linear),
            ..Self::empty()
        }
    }
}

impl<B: Backend> From<SlideSparseLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: SlideSparseLinear<B>) -> Self {
        Self {
            sparse: Some(layer),
            ..Self::empty()
        }
    }
}

impl<B: Backend> From<MaskedLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: MaskedLinear<B>) -> Self {
        Self {
            masked: Some(layer),
            ..Self::empty()
        }
    }
}

impl<B: Backend> From<QuantizedLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: QuantizedLinear<B>) -> Self {
        Self {
            quantized: Some(layer),
            ..Self::empty()
        }
    }
}

impl<B: Backend> MaybeSparseLinear<B> {
    /// Whether the layer is SlideSparse.
    pub fn is_sparse(&self) -> bool {
        self.sparse.is_some()
    }

    /// The dense layer, if it is dense.
    pub fn dense(&self) -> Option<&Linear<B>> {
        self.dense.as_ref()
    }

    /// The sparse layer, if it is sparse.
    pub fn sparse(&self) -> Option<&SlideSparseLinear<B>> {
        self.sparse.as_ref()
    }

    /// The masked (trainable sparse) layer, if it is one.
    pub fn masked(&self) -> Option<&MaskedLinear<B>> {
        self.masked.as_ref()
    }

    /// The dense quantized baseline layer, if it is one.
    pub fn quantized(&self) -> Option<&QuantizedLinear<B>> {
        self.quantized.as_ref()
    }

    /// Quantizes a dense layer in place without pruning (the like-for-like baseline of
    /// SlideSparse); other kinds are left as they are.
    pub fn quantize(&mut self, precision: Precision) -> Result<()> {
        if let Some(dense) = &self.dense {
            *self = QuantizedLinear::from_linear(dense, precision)?.into();
        }
        Ok(())
    }

    /// Packs a dense layer (pruning it with `options`) or a masked layer (checking its
    /// pattern instead of pruning) in place; a sparse layer is left as it is.
    pub fn sparsify(&mut self, options: &PackOptions) -> Result<()> {
        if let Some(dense) = &self.dense {
            *self = SlideSparseLinear::from_linear(dense, options)?.into();
        } else if let Some(masked) = &self.masked {
            *self = masked.to_sparse(options)?.into();
        }
        Ok(())
    }

    /// Prunes a dense layer to `pattern` with `method` and keeps it trainable under the mask
    /// (masked and sparse layers are left as they are).
    pub fn mask(&mut self, pattern: SparsityPattern, method: &PruneMethod) -> Result<()> {
        if let Some(dense) = self.dense.take() {
            match MaskedLinear::from_linear(dense.clone(), pattern, method) {
                Ok(masked) => *self = masked.into(),
                Err(e) => {
                    self.dense = Some(dense);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

impl<B: SlideSparseBackend> MaybeSparseLinear<B> {
    /// `[..., in] -> [..., out]` through whichever layer this is.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        if let Some(dense) = &self.dense {
            dense.forward(input)
        } else if let Some(sparse) = &self.sparse {
            sparse.forward(input)
        } else if let Some(masked) = &self.masked {
            masked.forward(input)
        } else if let Some(quantized) = &self.quantized {
            quantized.forward(input)
        } else {
            unreachable!("MaybeSparseLinear holds one layer")
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

/// Packs every linear layer of `model` for which `include(name)` holds; returns the names
/// packed. Errors name the layer that failed.
pub fn sparsify<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    options: &PackOptions,
    include: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    sparsify_with(model, |name| include(name).then(|| options.clone()))
}

/// Like [`sparsify`], with options chosen per layer (`None` keeps the layer dense), e.g.
/// activation-aware pruning with each layer's calibration norms.
pub fn sparsify_with<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    options_for: impl Fn(&str) -> Option<PackOptions>,
) -> Result<Vec<String>> {
    let mut packed = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if let Some(options) = options_for(name).filter(|_| !layer.is_sparse()) {
            layer
                .sparsify(&options)
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e}")))?;
            packed.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(packed)
}

/// Builds every SlideSparse and dense-quantized layer's prepared weights now (on the CUDA
/// backend: compression and upload), so the first forward does not pay for it; returns how
/// many layers were prepared.
pub fn prepare_all<B: SlideSparseBackend, M: VisitLinears<B>>(model: &mut M) -> Result<usize> {
    let mut prepared = 0;
    model.visit_linears(&mut |name, layer| {
        let context = |e: SlideSparseError| SlideSparseError::Backend(format!("{name}: {e}"));
        if let Some(sparse) = layer.sparse() {
            sparse.prepared().map_err(context)?;
            prepared += 1;
        } else if let Some(quantized) = layer.quantized() {
            quantized.prepared().map_err(context)?;
            prepared += 1;
        }
        Ok(())
    })?;
    Ok(prepared)
}

/// Quantizes every dense linear layer of `model` for which `include(name)` holds, without
/// pruning ([`QuantizedLinear`], the baseline SlideSparse is measured against); returns the
/// names quantized.
pub fn quantize_dense<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    precision: Precision,
    include: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let mut quantized = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if include(name) && layer.dense().is_some() {
            layer
                .quantize(precision)
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e}")))?;
            quantized.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(quantized)
}

/// Prunes every dense linear layer of `model` for which `method_for(name)` gives a method
/// to `pattern`, keeping it trainable under the mask ([`MaskedLinear`]); returns the names
/// masked. Pack the fine-tuned model afterwards with [`sparsify`].
pub fn mask_with<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    pattern: SparsityPattern,
    method_for: impl Fn(&str) -> Option<PruneMethod>,
) -> Result<Vec<String>> {
    let mut masked = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if let Some(method) = method_for(name).filter(|_| layer.dense().is_some()) {
            layer
                .mask(pattern, &method)
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e}")))?;
            masked.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(masked)
}
