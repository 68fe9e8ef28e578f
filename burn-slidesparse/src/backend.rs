//! The backend extension for the SlideSparse linear op.
//!
//! A backend prepares a layer's weights once (the CUDA backend compresses them for
//! cuSPARSELt; burn's CPU backends keep an INT8 layer's codes for the integer kernel,
//! `cpu_int8`; the reference path decodes them to floats) and then runs the forward on
//! `[M, K]` activations. Every burn backend can use the [`reference`](crate::reference)
//! implementation (`impl_reference_backend!`): it is the oracle of the CPU kernel's and the
//! GPU's tests.

use std::{any::Any, fmt::Debug, sync::Arc};

use burn::tensor::{Tensor, backend::Backend};

use crate::{
    error::Result,
    pack::LayerSpec,
    weight_quant::{Precision, QuantizedWeight},
};

/// A packed layer's weights for a backend's preparation: the codes and scales on the host
/// (shared with the module, not copied), the bias on the device.
#[derive(Clone, Debug)]
pub struct PackedTensors<B: Backend> {
    /// Pattern, precision and sizes.
    pub spec: LayerSpec,
    /// `W' [out, K']` codes and per-output-channel scales (INT8 / FP8 in the compact layout,
    /// [`HostCodes`](crate::compact::HostCodes)).
    pub weight: crate::compact::HostCodes,
    /// Bias `[out]`, if the layer has one.
    pub bias: Option<Tensor<B, 1>>,
    /// The device to prepare on.
    pub device: B::Device,
    /// The order of the input channels `W'` was pruned in: the lift reads
    /// `X[:, order[src(o)]]` (see [`InputPermutation`](crate::InputPermutation)).
    pub input_permutation: Option<crate::permute::InputPermutation>,
}

/// A dense quantized layer's weights (the like-for-like baseline of SlideSparse: the same
/// per-token quantization, GEMM and epilogue, without the slide) for a backend's
/// preparation: codes and scales on the host, the bias on the device.
#[derive(Clone, Debug)]
pub struct DenseTensors<B: Backend> {
    /// `W [out, in]` codes (their precision is the layer's) and per-output-channel scales.
    pub weight: Arc<QuantizedWeight>,
    /// Bias `[out]`, if the layer has one.
    pub bias: Option<Tensor<B, 1>>,
    /// The device to prepare on.
    pub device: B::Device,
}

impl<B: Backend> DenseTensors<B> {
    /// Element type of `W` (and of the quantized activations).
    pub fn precision(&self) -> Precision {
        self.weight.codes.precision()
    }
}

/// A backend that can run SlideSparse linear layers (and their dense quantized baseline).
pub trait SlideSparseBackend: Backend {
    /// The weights in the form the backend's forward consumes, built once per layer and
    /// device and cached by the module.
    type Prepared: Clone + Debug + Send + Sync + 'static;

    /// Builds the prepared weights. May synchronize and allocate: it runs once.
    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared>;

    /// `Y [M, out] = dequant(quant(lift(X)) . W'^T) + b` for `X [M, K]`, or an error from the
    /// device (out of memory, a library failure).
    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>>;

    /// Prepared weights of the dense quantized baseline ([`QuantizedLinear`](crate::QuantizedLinear)).
    type DensePrepared: Clone + Debug + Send + Sync + 'static;

    /// Builds the dense baseline's prepared weights. May synchronize and allocate.
    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared>;

    /// `Y [M, out] = dequant(quant(X) . W^T) + b` for `X [M, K]`, or an error from the device.
    fn dense_forward(x: Tensor<Self, 2>, prepared: &Self::DensePrepared)
    -> Result<Tensor<Self, 2>>;

    /// The layer a native pipeline runs (the CUDA path's, on burn-cuda plain or under
    /// fusion), type-erased, so that a composed block step
    /// ([`add_rms_norm_linear`](crate::add_rms_norm_linear) and the like) can run the linear
    /// inside its own operation; `None` (the default) where the forward is something else.
    /// Not for other crates to implement: only this crate's own layer types are looked for.
    #[cfg(feature = "cuda")]
    #[doc(hidden)]
    fn native_layer(_prepared: &Self::Prepared) -> Option<&(dyn Any + Send + Sync)> {
        None
    }

    /// [`native_layer`](Self::native_layer) of the dense quantized baseline.
    #[cfg(feature = "cuda")]
    #[doc(hidden)]
    fn native_dense_layer(_prepared: &Self::DensePrepared) -> Option<&(dyn Any + Send + Sync)> {
        None
    }
}

/// What a prepared weight depends on: the codes (their id) and the device.
pub(crate) type PreparedKey = (u64, burn::tensor::backend::DeviceId);

type ErasedPrepared = Arc<dyn Any + Send + Sync>;

/// Type-erased slot the module keeps its prepared weights in (the module type cannot name
/// `B::Prepared` without requiring `SlideSparseBackend` everywhere it is used).
#[derive(Clone, Debug, Default)]
pub(crate) struct PreparedSlot {
    inner: Arc<std::sync::Mutex<Option<(PreparedKey, ErasedPrepared)>>>,
}

impl PreparedSlot {
    /// The prepared weights for `key`, building them with `init` on a miss.
    pub(crate) fn get_or_try_init<P: Clone + Send + Sync + 'static>(
        &self,
        key: PreparedKey,
        init: impl FnOnce() -> Result<P>,
    ) -> Result<P> {
        let mut slot = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, value)) = slot.as_ref()
            && *k == key
            && let Some(p) = value.downcast_ref::<P>()
        {
            return Ok(p.clone());
        }
        let prepared = init()?;
        *slot = Some((key, Arc::new(prepared.clone())));
        Ok(prepared)
    }
}

/// Implements [`SlideSparseBackend`] with the reference path for a backend type:
/// `impl_reference_backend!(for [] burn::backend::NdArray);`, with generic parameters in
/// the brackets: `impl_reference_backend!(for [F: FloatElement] MyBackend<F>);`
#[macro_export]
macro_rules! impl_reference_backend {
    (for [$($generics:tt)*] $backend:ty) => {
        impl<$($generics)*> $crate::SlideSparseBackend for $backend {
            type Prepared = $crate::ReferencePrepared<Self>;

            fn slidesparse_prepare(
                weights: $crate::PackedTensors<Self>,
            ) -> $crate::Result<Self::Prepared> {
                Ok($crate::__macro_support::prepare(weights))
            }

            fn slidesparse_forward(
                x: burn::tensor::Tensor<Self, 2>,
                prepared: &Self::Prepared,
            ) -> $crate::Result<burn::tensor::Tensor<Self, 2>> {
                Ok($crate::__macro_support::forward(x, prepared))
            }

            type DensePrepared = $crate::ReferencePrepared<Self>;

            fn dense_prepare(
                weights: $crate::DenseTensors<Self>,
            ) -> $crate::Result<Self::DensePrepared> {
                Ok($crate::__macro_support::prepare_dense(weights))
            }

            fn dense_forward(
                x: burn::tensor::Tensor<Self, 2>,
                prepared: &Self::DensePrepared,
            ) -> $crate::Result<burn::tensor::Tensor<Self, 2>> {
                Ok($crate::__macro_support::forward(x, prepared))
            }
        }
    };
}
