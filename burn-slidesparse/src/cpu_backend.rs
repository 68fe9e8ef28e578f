//! burn's CPU backends (NdArray; Flex with feature `flex`): INT8 layers on the integer kernel
//! (`cpu_int8`: the compact weight, INT32 sums, bit for bit the reference path's result), the
//! other precisions on the reference path.

use std::sync::Arc;

use burn::tensor::{Tensor, backend::Backend};

use crate::{
    backend::{DenseTensors, PackedTensors, SlideSparseBackend},
    cpu_int8::CpuInt8Layer,
    error::Result,
    weight_quant::Precision,
};

/// A layer prepared for one of burn's CPU backends: INT8 layers on the integer kernel
/// ([`CpuInt8Layer`](crate::cpu_int8::CpuInt8Layer): the compact weight, INT32 sums), the
/// others on the reference path.
#[derive(Clone, Debug)]
pub enum CpuPrepared<B: Backend> {
    /// An INT8 layer on the integer kernel.
    Int8(Arc<crate::cpu_int8::CpuInt8Layer>),
    /// Any other precision on the reference path.
    Reference(crate::reference::ReferencePrepared<B>),
}

/// The host copy of a bias on a CPU backend.
fn host_bias<B: Backend>(bias: Option<Tensor<B, 1>>) -> Result<Option<Vec<f32>>> {
    bias.map(|b| {
        b.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| {
                crate::error::SlideSparseError::Backend(format!("reading the bias: {e:?}"))
            })
    })
    .transpose()
}

/// `Y [m, n]` of an integer-kernel layer on a CPU backend, in `x`'s float type.
fn int8_forward<B: Backend>(
    x: Tensor<B, 2>,
    layer: &crate::cpu_int8::CpuInt8Layer,
) -> Result<Tensor<B, 2>> {
    let [m, k] = x.dims();
    if k != layer.in_features() {
        return Err(crate::error::SlideSparseError::shape(
            "input width",
            layer.in_features(),
            k,
        ));
    }
    let (device, dtype) = (x.device(), x.dtype());
    let values = x
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| crate::error::SlideSparseError::Backend(format!("reading X: {e:?}")))?;
    let y = layer.forward(&values, m);
    let data = burn::tensor::TensorData::new(y, [m, layer.out_features()]);
    Ok(Tensor::from_data(data, (&device, dtype)))
}

/// The CPU backends' preparation of a SlideSparse layer.
pub(crate) fn cpu_prepare<B: Backend>(weights: PackedTensors<B>) -> Result<CpuPrepared<B>> {
    if weights.spec.precision != Precision::Int8 {
        return Ok(CpuPrepared::Reference(crate::reference::prepare(weights)));
    }
    let bias = host_bias(weights.bias)?;
    let order = weights.input_permutation.as_ref();
    let layer = match weights.weight.compact() {
        // The module's compact rows, shared: the layer's one copy on the host.
        Some(compact) => CpuInt8Layer::compact(Arc::clone(compact), bias, order)?,
        None => CpuInt8Layer::sparse(weights.spec, &weights.weight.full(), bias, order)?,
    };
    Ok(CpuPrepared::Int8(Arc::new(layer)))
}

/// The CPU backends' preparation of a dense quantized layer.
pub(crate) fn cpu_prepare_dense<B: Backend>(weights: DenseTensors<B>) -> Result<CpuPrepared<B>> {
    if weights.precision() != Precision::Int8 {
        return Ok(CpuPrepared::Reference(crate::reference::prepare_dense(
            weights,
        )));
    }
    let bias = host_bias(weights.bias)?;
    let layer = CpuInt8Layer::dense(weights.weight, bias)?;
    Ok(CpuPrepared::Int8(Arc::new(layer)))
}

/// The CPU backends' forward.
pub(crate) fn cpu_forward<B: Backend>(
    x: Tensor<B, 2>,
    prepared: &CpuPrepared<B>,
) -> Result<Tensor<B, 2>> {
    match prepared {
        CpuPrepared::Int8(layer) => int8_forward(x, layer),
        CpuPrepared::Reference(r) => Ok(crate::reference::forward(x, r)),
    }
}

/// Implements [`SlideSparseBackend`] for one of burn's CPU backends: INT8 layers on the
/// integer kernel, the others on the reference path ([`CpuPrepared`]).
macro_rules! impl_cpu_backend {
    ($backend:ty) => {
        impl SlideSparseBackend for $backend {
            type Prepared = CpuPrepared<Self>;

            fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
                cpu_prepare(weights)
            }

            fn slidesparse_forward(
                x: Tensor<Self, 2>,
                prepared: &Self::Prepared,
            ) -> Result<Tensor<Self, 2>> {
                cpu_forward(x, prepared)
            }

            type DensePrepared = CpuPrepared<Self>;

            fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
                cpu_prepare_dense(weights)
            }

            fn dense_forward(
                x: Tensor<Self, 2>,
                prepared: &Self::DensePrepared,
            ) -> Result<Tensor<Self, 2>> {
                cpu_forward(x, prepared)
            }
        }
    };
}

impl_cpu_backend!(burn::backend::NdArray);
#[cfg(feature = "flex")]
impl_cpu_backend!(burn::backend::Flex);
