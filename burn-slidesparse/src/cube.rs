//! `SlideSparseBackend` for every cubecl backend, `CubeBackend<R, F, I, BT>` (burn-cuda,
//! burn-wgpu, burn-rocm, burn-cpu), in one implementation.
//!
//! The runtime `R` decides the path at run time from its type: CUDA (with the crate feature
//! `cuda`) runs the real pipeline (`crate::cuda`), every other runtime the reference path.
//! One generic implementation instead of one per backend: a user of any cubecl backend, or
//! of `Fusion` over one (`fusion.rs`), gets SlideSparse layers without naming their backend
//! anywhere, and this crate needs no dependency on backends it does not accelerate.

use burn::tensor::Tensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::{
    backend::{DenseTensors, PackedTensors, SlideSparseBackend},
    error::Result,
    reference::{self, ReferencePrepared},
};

/// The CUDA path's prepared layers, or `Infallible` where it is not built.
#[cfg(feature = "cuda")]
mod native {
    pub type Sparse = crate::cuda::CudaPrepared;
    pub type Dense = crate::cuda::DenseLayerGpu;
}
#[cfg(not(feature = "cuda"))]
mod native {
    pub type Sparse = std::convert::Infallible;
    pub type Dense = std::convert::Infallible;
}

/// A layer prepared on a cubecl backend: the CUDA pipeline's, or the reference path's.
#[derive(Clone, Debug)]
pub enum CubePrepared<B: burn::tensor::backend::Backend, N> {
    /// The reference path (runtimes without a native pipeline).
    Reference(ReferencePrepared<B>),
    /// The native pipeline (CUDA).
    Native(N),
}

#[cfg(feature = "cuda")]
mod dispatch {
    //! Moving cubecl tensors between `CubeBackend<R, ..>` and the CUDA path, decided by the
    //! runtime's type: a checked downcast, never a transmute.

    use std::any::Any;

    use burn::tensor::Tensor;
    use burn_cubecl::{
        BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
    };
    use cubecl::cuda::CudaDevice;

    use crate::{
        backend::{DenseTensors, PackedTensors},
        cuda::{
            CudaPrepared, DenseLayerGpu,
            prepare::host_f32,
            runtime::{Client, Runtime},
        },
        error::Result,
    };

    /// `value` as a `T` if it is one.
    pub fn cast<A: 'static, T: 'static>(value: A) -> Option<T> {
        (Box::new(value) as Box<dyn Any>)
            .downcast::<T>()
            .ok()
            .map(|b| *b)
    }

    /// The CUDA tensor of a cubecl tensor of runtime `R`, if `R` is CUDA.
    pub fn to_cuda<R: CubeRuntime>(t: CubeTensor<R>) -> Option<CubeTensor<Runtime>> {
        cast(t)
    }

    /// A CUDA tensor back as a tensor of runtime `R` (which is CUDA).
    pub fn from_cuda<R: CubeRuntime>(t: CubeTensor<Runtime>) -> CubeTensor<R> {
        cast(t).expect("R was checked to be the CUDA runtime")
    }

    /// The CUDA client and device index of a device of runtime `R`, if `R` is CUDA.
    fn cuda_client<R: CubeRuntime>(device: &R::Device) -> Option<(Client, usize)> {
        let device: CudaDevice = cast(device.clone())?;
        Some((<Runtime as cubecl::Runtime>::client(&device), device.index))
    }

    /// The bias on the host (a few KB, read once per layer).
    fn host_bias<B: burn::tensor::backend::Backend>(
        bias: &Option<Tensor<B, 1>>,
    ) -> Result<Option<Vec<f32>>> {
        bias.clone().map(host_f32).transpose()
    }

    /// The CUDA pipeline's layer, if `R` is CUDA.
    pub fn prepare_sparse<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
        weights: &PackedTensors<CubeBackend<R, F, I, BT>>,
    ) -> Option<Result<CudaPrepared>> {
        let (client, index) = cuda_client::<R>(&weights.device)?;
        Some(host_bias(&weights.bias).and_then(|bias| {
            CudaPrepared::new_sparse(
                &client,
                index,
                weights.spec,
                &weights.weight,
                bias.as_deref(),
            )?
            .with_input_permutation(&client, weights.input_permutation.as_ref())
        }))
    }

    /// The CUDA dense baseline's layer, if `R` is CUDA.
    pub fn prepare_dense<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
        weights: &DenseTensors<CubeBackend<R, F, I, BT>>,
    ) -> Option<Result<DenseLayerGpu>> {
        let (client, index) = cuda_client::<R>(&weights.device)?;
        Some(
            host_bias(&weights.bias).and_then(|bias| {
                DenseLayerGpu::new(&client, index, &weights.weight, bias.as_deref())
            }),
        )
    }
}

impl<B: burn::tensor::backend::Backend, N> CubePrepared<B, N> {
    /// The native pipeline's layer, where the runtime has one.
    pub fn native(&self) -> Option<&N> {
        match self {
            CubePrepared::Native(layer) => Some(layer),
            CubePrepared::Reference(_) => None,
        }
    }
}

#[cfg(feature = "cuda")]
type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// Runs a native layer's forward on a CUDA tensor of runtime `R`.
#[cfg(feature = "cuda")]
fn native_forward<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement, G>(
    x: Tensor<Cube<R, F, I, BT>, 2>,
    layer: &crate::cuda::pipeline::GpuLayer<G>,
) -> Result<Tensor<Cube<R, F, I, BT>, 2>>
where
    G: crate::cuda::gemm::LayerGemm,
{
    let x = dispatch::to_cuda(x.into_primitive().tensor())
        .expect("a native layer is only prepared on the CUDA runtime");
    let y = layer.forward(&x)?;
    Ok(Tensor::from_primitive(
        burn::tensor::TensorPrimitive::Float(dispatch::from_cuda(y)),
    ))
}

#[cfg(not(feature = "cuda"))]
fn native_forward<B: burn::tensor::backend::Backend>(
    _x: Tensor<B, 2>,
    layer: &std::convert::Infallible,
) -> Result<Tensor<B, 2>> {
    match *layer {}
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> SlideSparseBackend
    for CubeBackend<R, F, I, BT>
{
    type Prepared = CubePrepared<Self, native::Sparse>;

    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
        #[cfg(feature = "cuda")]
        if let Some(layer) = dispatch::prepare_sparse(&weights) {
            return Ok(CubePrepared::Native(layer?));
        }
        Ok(CubePrepared::Reference(reference::prepare(weights)))
    }

    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>> {
        match prepared {
            CubePrepared::Reference(p) => Ok(reference::forward(x, p)),
            CubePrepared::Native(layer) => native_forward(x, layer),
        }
    }

    #[cfg(feature = "cuda")]
    fn native_layer(prepared: &Self::Prepared) -> Option<&(dyn std::any::Any + Send + Sync)> {
        prepared.native().map(|layer| layer as _)
    }

    #[cfg(feature = "cuda")]
    fn native_dense_layer(
        prepared: &Self::DensePrepared,
    ) -> Option<&(dyn std::any::Any + Send + Sync)> {
        prepared.native().map(|layer| layer as _)
    }

    type DensePrepared = CubePrepared<Self, native::Dense>;

    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
        #[cfg(feature = "cuda")]
        if let Some(layer) = dispatch::prepare_dense(&weights) {
            return Ok(CubePrepared::Native(layer?));
        }
        Ok(CubePrepared::Reference(reference::prepare_dense(weights)))
    }

    fn dense_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::DensePrepared,
    ) -> Result<Tensor<Self, 2>> {
        match prepared {
            CubePrepared::Reference(p) => Ok(reference::forward(x, p)),
            CubePrepared::Native(layer) => native_forward(x, layer),
        }
    }
}
