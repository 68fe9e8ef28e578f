//! Fusing layers that read the same input into one layer whose output is their outputs side
//! by side (`q`, `k`, `v` into `qkv`; `gate`, `up` into `gate_up`): one GEMM instead of
//! several, split after it.
//!
//! Exact for every kind: pruning, quantization scales and the slide are all per output row,
//! so the rows of a fused packed layer are the rows of the layers it was made of, and
//! packing the fused dense weight gives the same codes as fusing the packed layers.

use burn::{
    module::Param,
    nn::Linear,
    tensor::{Tensor, backend::Backend},
};

use crate::{
    codes::WeightCodesModule,
    error::{Result, SlideSparseError},
    maybe_sparse::MaybeSparseLinear,
    pack::PackedLinear,
    quantized_linear::QuantizedLinear,
    sparse_linear::{SlideSparseLinear, to_vec_f32},
    weight_quant::{QuantizedWeight, WeightCodes},
};

fn mismatch(detail: impl Into<String>) -> SlideSparseError {
    SlideSparseError::FuseMismatch {
        detail: detail.into(),
    }
}

/// One layer computing `[..., in] -> [..., out_0 + out_1 + ...]`, the outputs of `layers`
/// (all reading the same input width) in order. The layers must be of one kind
/// (dense, SlideSparse with one pattern, precision and alignment, or dense quantized with
/// one precision); a layer without a bias among layers with one gets a zero bias. Masked
/// (training) layers are not fused: fuse after packing.
pub fn concat_outputs<B: Backend>(
    layers: &[&MaybeSparseLinear<B>],
) -> Result<MaybeSparseLinear<B>> {
    let Some(first) = layers.first() else {
        return Err(mismatch("no layers to fuse"));
    };
    let kind = first.kind();
    if let Some(other) = layers.iter().find(|l| l.kind() != kind) {
        return Err(mismatch(format!(
            "layers of different kinds ({kind} and {})",
            other.kind()
        )));
    }
    match kind {
        "Dense" => concat_dense(layers.iter().filter_map(|l| l.dense()).collect()).map(Into::into),
        "Sparse" => {
            concat_sparse(layers.iter().filter_map(|l| l.sparse()).collect()).map(Into::into)
        }
        "Quantized" => {
            concat_quantized(layers.iter().filter_map(|l| l.quantized()).collect()).map(Into::into)
        }
        _ => Err(mismatch(format!(
            "{kind} layers are not fused (fuse after packing)"
        ))),
    }
}

/// The biases side by side, zeros for a layer without one; `None` if no layer has one.
fn concat_biases(biases: Vec<(Option<Vec<f32>>, usize)>) -> Option<Vec<f32>> {
    if biases.iter().all(|(b, _)| b.is_none()) {
        return None;
    }
    Some(
        biases
            .into_iter()
            .flat_map(|(b, rows)| b.unwrap_or_else(|| vec![0.0; rows]))
            .collect(),
    )
}

fn host_bias<B: Backend>(bias: &Option<Param<Tensor<B, 1>>>) -> Result<Option<Vec<f32>>> {
    bias.as_ref()
        .map(|b| to_vec_f32(b.val().into_data(), "bias"))
        .transpose()
}

fn check_width(widths: impl Iterator<Item = usize>) -> Result<usize> {
    let widths: Vec<usize> = widths.collect();
    match widths.iter().find(|&&w| w != widths[0]) {
        Some(w) => Err(mismatch(format!(
            "input widths differ ({} and {w})",
            widths[0]
        ))),
        None => Ok(widths[0]),
    }
}

fn concat_dense<B: Backend>(layers: Vec<&Linear<B>>) -> Result<Linear<B>> {
    let weights: Vec<Tensor<B, 2>> = layers.iter().map(|l| l.weight.val()).collect();
    check_width(weights.iter().map(|w| w.dims()[0]))?;
    let bias = if layers.iter().all(|l| l.bias.is_none()) {
        None
    } else {
        // Burn's bias is `[out]`; a missing one is zeros of the layer's width and dtype.
        let parts = layers
            .iter()
            .zip(&weights)
            .map(|(l, w)| match &l.bias {
                Some(b) => b.val(),
                None => Tensor::<B, 1>::zeros([w.dims()[1]], &w.device()).cast(w.dtype()),
            })
            .collect();
        Some(Param::from_tensor(Tensor::cat(parts, 0)))
    };
    Ok(Linear {
        weight: Param::from_tensor(Tensor::cat(weights, 1)),
        bias,
    })
}

/// Rows of `weights` (one column count) one after the other.
fn concat_rows(weights: Vec<&QuantizedWeight>) -> Result<QuantizedWeight> {
    let cols = check_width(weights.iter().map(|w| w.cols))?;
    let precision = weights[0].codes.precision();
    if let Some(w) = weights.iter().find(|w| w.codes.precision() != precision) {
        return Err(mismatch(format!(
            "precisions differ ({precision:?} and {:?})",
            w.codes.precision()
        )));
    }
    macro_rules! join {
        ($variant:ident) => {
            WeightCodes::$variant(
                weights
                    .iter()
                    .flat_map(|w| match &w.codes {
                        WeightCodes::$variant(c) => c.iter().copied(),
                        _ => unreachable!("precisions checked above"),
                    })
                    .collect(),
            )
        };
    }
    let codes = match &weights[0].codes {
        WeightCodes::I8(_) => join!(I8),
        WeightCodes::Fp8(_) => join!(Fp8),
        WeightCodes::Bf16(_) => join!(Bf16),
        WeightCodes::F16(_) => join!(F16),
        WeightCodes::F32(_) => join!(F32),
    };
    Ok(QuantizedWeight {
        rows: weights.iter().map(|w| w.rows).sum(),
        cols,
        codes,
        scales: weights
            .iter()
            .flat_map(|w| w.scales.iter().copied())
            .collect(),
    })
}

fn concat_sparse<B: Backend>(layers: Vec<&SlideSparseLinear<B>>) -> Result<SlideSparseLinear<B>> {
    let spec = layers[0].spec;
    if let Some(l) = layers.iter().find(|l| {
        (
            l.spec.pattern,
            l.spec.precision,
            l.spec.in_features,
            l.spec.alignment,
        ) != (
            spec.pattern,
            spec.precision,
            spec.in_features,
            spec.alignment,
        )
    }) {
        return Err(mismatch(format!(
            "SlideSparse layers differ in pattern, precision, input width or alignment ({:?} and {:?})",
            spec, l.spec
        )));
    }
    // One input, one order: the fused layer's lift reads it through a single permutation.
    let permutation = layers[0].weight.input_permutation();
    if layers
        .iter()
        .any(|l| l.weight.input_permutation() != permutation)
    {
        return Err(mismatch(
            "SlideSparse layers read their input in different orders (input permutations);              layers to be fused must be packed with one shared permutation (search it over the              group: search_permutation)",
        ));
    }
    let biases = layers
        .iter()
        .map(|l| Ok((host_bias(&l.bias)?, l.spec.out_features)))
        .collect::<Result<Vec<_>>>()?;
    let packed = PackedLinear {
        name: "fused".into(),
        pattern: spec.pattern,
        in_features: spec.in_features,
        alignment: spec.alignment,
        weight: concat_weights(layers.iter().map(|l| &l.weight))?,
        bias: concat_biases(biases),
        input_permutation: permutation.cloned(),
    };
    packed.validate()?;
    Ok(SlideSparseLinear::from_packed_owned(
        packed,
        layers[0].weight.device(),
    ))
}

/// The layers' codes (in their full form) stacked row after row.
fn concat_weights<'a, B: Backend>(
    weights: impl Iterator<Item = &'a WeightCodesModule<B>>,
) -> Result<QuantizedWeight> {
    let full: Vec<_> = weights.map(WeightCodesModule::weight).collect();
    concat_rows(full.iter().map(AsRef::as_ref).collect())
}

fn concat_quantized<B: Backend>(layers: Vec<&QuantizedLinear<B>>) -> Result<QuantizedLinear<B>> {
    let biases = layers
        .iter()
        .map(|l| Ok((host_bias(&l.bias)?, l.spec.out_features)))
        .collect::<Result<Vec<_>>>()?;
    let weight = concat_weights(layers.iter().map(|l| &l.weight))?;
    Ok(QuantizedLinear::from_quantized_owned(
        weight,
        concat_biases(biases).as_deref(),
        layers[0].weight.device(),
    ))
}
