//! `SlideSparseBackend` for burn's fusion backend, `Fusion<B>`, over any inner backend `B`
//! that has one: `burn::backend::Cuda` (fusion over burn-cuda, burn's default CUDA backend)
//! runs the inner backend's real pipeline.
//!
//! Preparation runs once, eagerly, on the inner backend (from the codes on the host; the
//! bias goes through the host too). A forward is registered with fusion as a custom
//! operation (`OperationIr::Custom`): fusion executes it in stream order among the fused
//! kernels around it, under the `StreamId` of the thread that queued it (possibly on another
//! thread), and the inner backend's forward then runs on the inner tensors there. The CUDA
//! path keys its per-stream state (lanes, kept buffers, graphs) by that `StreamId`, so the
//! GEMM joins the same stream as the fused kernels, with no host synchronization.
//!
//! Errors: a wrong input width is found when the forward is queued and returned at once. An
//! error inside the execution cannot reach the caller from there: the output is filled with
//! NaN (never a stale or partial result) and the error is recorded against the operation's
//! cubecl stream (`crate::deferred`); the next call of this crate on that stream (the thread
//! that queued the forward) returns it as [`SlideSparseError::Deferred`].

use burn::tensor::{Shape, Tensor, TensorData, TensorPrimitive, backend::Backend};
use burn_fusion::{
    Fusion, FusionBackend,
    stream::{Operation, OperationStreams},
};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use crate::{
    backend::{DenseTensors, PackedTensors, SlideSparseBackend},
    deferred,
    error::{Result, SlideSparseError},
};

/// A layer prepared on the inner backend, with the widths a forward is checked against
/// when it is queued.
#[derive(Clone, Debug)]
pub struct FusionPrepared<P> {
    inner: P,
    in_features: usize,
    out_features: usize,
}

/// A fusion tensor as the same values on the inner backend (through the host: only for a
/// layer's bias at preparation, which runs once).
fn to_inner<B: FusionBackend, const D: usize>(t: Tensor<Fusion<B>, D>) -> Tensor<B, D> {
    let device = t.device();
    let data: TensorData = t.into_data();
    let dtype = data.dtype;
    Tensor::from_data(data, (&device, dtype))
}

/// The inner layer a queued operation runs.
#[derive(Debug)]
enum InnerLayer<B: SlideSparseBackend> {
    Sparse(B::Prepared),
    Dense(B::DensePrepared),
}

/// The custom operation: `out = forward(x)` on the inner backend.
#[derive(Debug)]
struct ForwardOp<B: SlideSparseBackend> {
    x: TensorIr,
    out: TensorIr,
    layer: InnerLayer<B>,
}

impl<B: FusionBackend + SlideSparseBackend> ForwardOp<B> {
    fn run(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        match &self.layer {
            InnerLayer::Sparse(p) => B::slidesparse_forward(x, p),
            InnerLayer::Dense(p) => B::dense_forward(x, p),
        }
    }
}

impl<B: FusionBackend + SlideSparseBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(&self, handles: &mut HandleContainer<B::Handle>) {
        let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(
            handles.get_float_tensor::<B>(&self.x),
        ));
        let device = x.device();
        let y = match deferred::executing(|| self.run(x)) {
            Ok(y) if y.dims() == [self.out.shape[0], self.out.shape[1]] => y,
            Ok(y) => {
                deferred::record_current(SlideSparseError::shape(
                    "fused SlideSparse forward output",
                    [self.out.shape[0], self.out.shape[1]],
                    y.dims(),
                ));
                nan_output(&self.out, &device)
            }
            Err(error) => {
                deferred::record_current(error);
                nan_output(&self.out, &device)
            }
        };
        handles.register_float_tensor::<B>(&self.out.id, y.into_primitive().tensor());
    }
}

/// The output of a failed execution: NaN everywhere, so nothing downstream is silently wrong.
fn nan_output<B: Backend>(out: &TensorIr, device: &B::Device) -> Tensor<B, 2> {
    Tensor::<B, 2>::full([out.shape[0], out.shape[1]], f32::NAN, device).cast(out.dtype)
}

/// Queues `layer`'s forward of `x` (`[m, in_features]`) with an `[m, out_features]` output.
fn queue<B: FusionBackend + SlideSparseBackend>(
    x: Tensor<Fusion<B>, 2>,
    (in_features, out_features): (usize, usize),
    layer: InnerLayer<B>,
) -> Result<Tensor<Fusion<B>, 2>> {
    deferred::take_current()?;
    let [m, k] = x.dims();
    if k != in_features {
        return Err(SlideSparseError::shape(
            "SlideSparse layer input width",
            in_features,
            k,
        ));
    }
    let x = x.into_primitive().tensor();
    let streams = OperationStreams::with_inputs([&x]);
    let client = x.client.clone();
    let x = x.into_ir();
    let out = TensorIr::uninit(
        client.create_empty_handle(),
        Shape::new([m, out_features]),
        x.dtype,
    );
    let ir = CustomOpIr::new(
        "slidesparse_forward",
        std::slice::from_ref(&x),
        std::slice::from_ref(&out),
    );
    let y = client
        .register(
            streams,
            OperationIr::Custom(ir),
            ForwardOp { x, out, layer },
        )
        .output();
    Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
}

/// A custom operation that does nothing but pass its input through (`out = x`, sharing the
/// buffer): what registering and executing any custom operation costs fusion, for the
/// benchmark that compares it with a forward's extra cost on fusion.
#[cfg(feature = "internals")]
#[derive(Debug)]
struct IdentityOp<B> {
    x: TensorIr,
    out: TensorIr,
    backend: std::marker::PhantomData<fn() -> B>,
}

#[cfg(feature = "internals")]
impl<B: FusionBackend> Operation<B::FusionRuntime> for IdentityOp<B> {
    fn execute(&self, handles: &mut HandleContainer<B::Handle>) {
        let x = handles.get_float_tensor::<B>(&self.x);
        handles.register_float_tensor::<B>(&self.out.id, x);
    }
}

/// Queues an identity custom operation on `x` (see `IdentityOp`). Not an API: benchmarks.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub fn identity_custom_op<B: FusionBackend>(x: Tensor<Fusion<B>, 2>) -> Tensor<Fusion<B>, 2> {
    let x = x.into_primitive().tensor();
    let streams = OperationStreams::with_inputs([&x]);
    let client = x.client.clone();
    let (shape, dtype) = (x.shape.clone(), x.dtype);
    let x = x.into_ir();
    let out = TensorIr::uninit(client.create_empty_handle(), shape, dtype);
    let ir = CustomOpIr::new(
        "slidesparse_identity",
        std::slice::from_ref(&x),
        std::slice::from_ref(&out),
    );
    let y = client
        .register(
            streams,
            OperationIr::Custom(ir),
            IdentityOp::<B> {
                x,
                out,
                backend: std::marker::PhantomData,
            },
        )
        .output();
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

impl<B: FusionBackend + SlideSparseBackend> SlideSparseBackend for Fusion<B> {
    type Prepared = FusionPrepared<B::Prepared>;

    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
        let spec = weights.spec;
        let inner = B::slidesparse_prepare(PackedTensors {
            spec,
            weight: weights.weight,
            bias: weights.bias.map(to_inner),
            device: weights.device,
            input_permutation: weights.input_permutation,
        })?;
        Ok(FusionPrepared {
            inner,
            in_features: spec.in_features,
            out_features: spec.out_features,
        })
    }

    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>> {
        let widths = (prepared.in_features, prepared.out_features);
        queue(x, widths, InnerLayer::Sparse(prepared.inner.clone()))
    }

    type DensePrepared = FusionPrepared<B::DensePrepared>;

    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
        let (out_features, in_features) = (weights.weight.rows, weights.weight.cols);
        let inner = B::dense_prepare(DenseTensors {
            weight: weights.weight,
            bias: weights.bias.map(to_inner),
            device: weights.device,
        })?;
        Ok(FusionPrepared {
            inner,
            in_features,
            out_features,
        })
    }

    fn dense_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::DensePrepared,
    ) -> Result<Tensor<Self, 2>> {
        let widths = (prepared.in_features, prepared.out_features);
        queue(x, widths, InnerLayer::Dense(prepared.inner.clone()))
    }

    #[cfg(feature = "cuda")]
    fn native_layer(prepared: &Self::Prepared) -> Option<&(dyn std::any::Any + Send + Sync)> {
        B::native_layer(&prepared.inner)
    }

    #[cfg(feature = "cuda")]
    fn native_dense_layer(
        prepared: &Self::DensePrepared,
    ) -> Option<&(dyn std::any::Any + Send + Sync)> {
        B::native_dense_layer(&prepared.inner)
    }
}
