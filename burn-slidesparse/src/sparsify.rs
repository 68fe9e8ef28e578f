//! Converting a model's layers in place: every [`MaybeSparseLinear`] a model lists through
//! [`VisitLinears`] that a filter accepts is packed ([`sparsify`], [`sparsify_with`]),
//! quantized without pruning ([`quantize_dense`]) or pruned and kept trainable under the
//! mask ([`mask_with`]); [`prepare_all`] builds the backend's prepared weights of every
//! packed or quantized layer up front.

use burn::tensor::backend::Backend;

use crate::{
    backend::SlideSparseBackend,
    error::{Result, SlideSparseError},
    maybe_sparse::{MaybeSparseLinear, VisitLinears},
    pack::PackOptions,
    pattern::SparsityPattern,
    prune::PruneMethod,
    weight_quant::Precision,
};

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
        match layer {
            MaybeSparseLinear::Sparse(sparse) => {
                sparse.prepared().map_err(context)?;
                prepared += 1;
            }
            MaybeSparseLinear::Quantized(quantized) => {
                quantized.prepared().map_err(context)?;
                prepared += 1;
            }
            MaybeSparseLinear::Dense(_) | MaybeSparseLinear::Masked(_) => {}
        }
        Ok(())
    })?;
    Ok(prepared)
}

/// Quantizes every dense linear layer of `model` for which `include(name)` holds, without
/// pruning ([`QuantizedLinear`](crate::QuantizedLinear), the baseline SlideSparse is measured against); returns the
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
/// to `pattern`, keeping it trainable under the mask ([`MaskedLinear`](crate::MaskedLinear)); returns the names
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
