//! `SlideSparseBackend` for burn-cuda's `CubeBackend<CudaRuntime, ..>`: the tensors of a
//! packed layer become a [`GpuLayer`] once, and every forward runs its pipeline
//! (`pipeline.rs`).

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};

use super::{
    gemm::{DenseGemm, SparseGemm},
    pipeline::GpuLayer,
    prepare::host_f32,
    runtime::Runtime,
};
use crate::{
    backend::{DenseTensors, PackedTensors, SlideSparseBackend},
    error::Result,
};

/// A SlideSparse layer prepared on the GPU (cuSPARSELt's compressed weight).
pub type CudaPrepared = GpuLayer<SparseGemm>;

/// A dense quantized baseline layer prepared on the GPU (cuBLASLt).
pub type DenseLayerGpu = GpuLayer<DenseGemm>;

/// The tensor's device index and client.
fn placement<F: FloatElement, I: IntElement, BT: BoolElement>(
    t: &Tensor<CubeBackend<Runtime, F, I, BT>, 2>,
) -> (usize, super::runtime::Client) {
    let primitive = t.clone().into_primitive().tensor();
    (primitive.device.index, primitive.client)
}

fn optional_f32<B: burn::tensor::backend::Backend>(
    t: Option<Tensor<B, 1>>,
) -> Result<Option<Vec<f32>>> {
    t.map(host_f32).transpose()
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> SlideSparseBackend
    for CubeBackend<Runtime, F, I, BT>
{
    type Prepared = CudaPrepared;

    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
        let (index, client) = placement(&weights.weight);
        let bias = optional_f32(weights.bias)?;
        GpuLayer::new_sparse(
            &client,
            index,
            weights.spec,
            &host_f32(weights.weight)?,
            &host_f32(weights.scale)?,
            bias.as_deref(),
        )
    }

    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>> {
        let y = prepared.forward(&x.into_primitive().tensor())?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
    }

    type DensePrepared = DenseLayerGpu;

    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
        let (index, client) = placement(&weights.weight);
        let [n, k] = weights.weight.dims();
        let bias = optional_f32(weights.bias)?;
        GpuLayer::from_values(
            &client,
            index,
            weights.precision,
            (&host_f32(weights.weight)?, n, k),
            &host_f32(weights.scale)?,
            bias.as_deref(),
        )
    }

    fn dense_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::DensePrepared,
    ) -> Result<Tensor<Self, 2>> {
        let y = prepared.forward(&x.into_primitive().tensor())?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
    }
}
