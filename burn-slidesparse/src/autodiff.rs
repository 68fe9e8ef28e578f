//! `SlideSparseBackend` for `Autodiff<B>` over any backend `B` that has one.
//!
//! Where a gradient is needed (the input requires one), the forward is the reference path
//! on the autodiff backend itself, whose tensor operations carry the gradient to the
//! input. Where none is needed (inference under autodiff, e.g. after `Module::no_grad` or
//! on a detached input), the forward runs on the inner backend: on `Autodiff<Cuda>` that is
//! the real pipeline (quant+lift kernel, cuSPARSELt, epilogue), not the gather-based
//! reference. The inner backend's preparation is built on the first such forward.

use std::sync::{Arc, Mutex};

use burn::{
    backend::Autodiff,
    tensor::{Tensor, backend::AutodiffBackend},
};

use crate::{
    backend::{DenseTensors, PackedTensors, SlideSparseBackend},
    error::Result,
    reference::{self, ReferencePrepared},
};

/// A layer prepared for `Autodiff<B>`: the reference path's weights for forwards that need
/// a gradient and the inner backend's for those that do not, each built on its first use (a
/// model used only for inference never holds the reference copy).
#[derive(Clone, Debug)]
pub struct AutodiffPrepared<A: AutodiffBackend, W, P> {
    /// The layer's weights on the autodiff backend (host codes, bias tensor).
    source: W,
    reference: Arc<Mutex<Option<ReferencePrepared<A>>>>,
    inner: Arc<Mutex<Option<P>>>,
}

/// The value in `slot`, built with `build` on first use.
fn once<T: Clone>(slot: &Mutex<Option<T>>, build: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(value) = slot.as_ref() {
        return Ok(value.clone());
    }
    let value = build()?;
    *slot = Some(value.clone());
    Ok(value)
}

impl<A: AutodiffBackend, W: Clone, P: Clone> AutodiffPrepared<A, W, P> {
    fn new(source: W) -> Self {
        Self {
            source,
            reference: Arc::default(),
            inner: Arc::default(),
        }
    }

    /// The inner backend's preparation, built from the source weights on first use.
    fn inner<I>(
        &self,
        to_inner: impl FnOnce(&W) -> I,
        prepare: impl FnOnce(I) -> Result<P>,
    ) -> Result<P> {
        once(&self.inner, || prepare(to_inner(&self.source)))
    }

    /// The reference path's weights on the autodiff backend, built on first use.
    fn reference(&self, prepare: impl FnOnce(W) -> ReferencePrepared<A>) -> ReferencePrepared<A> {
        once(&self.reference, || Ok(prepare(self.source.clone())))
            .expect("building the reference weights cannot fail")
    }
}

/// Whether `x` is in the autodiff graph: a leaf that requires a gradient, or computed from
/// one (`Tensor::is_require_grad` is true for the leaves only).
fn is_tracked<B: SlideSparseBackend>(x: &Tensor<Autodiff<B>, 2>) -> bool {
    !x.clone()
        .into_primitive()
        .tensor()
        .node
        .requirement
        .is_none()
}

fn inner_packed<B: SlideSparseBackend>(w: &PackedTensors<Autodiff<B>>) -> PackedTensors<B> {
    PackedTensors {
        spec: w.spec,
        weight: w.weight.clone(),
        bias: w.bias.clone().map(Tensor::inner),
        device: w.device.clone(),
        input_permutation: w.input_permutation.clone(),
    }
}

fn inner_dense<B: SlideSparseBackend>(w: &DenseTensors<Autodiff<B>>) -> DenseTensors<B> {
    DenseTensors {
        weight: w.weight.clone(),
        bias: w.bias.clone().map(Tensor::inner),
        device: w.device.clone(),
    }
}

impl<B: SlideSparseBackend> SlideSparseBackend for Autodiff<B> {
    type Prepared = AutodiffPrepared<Self, PackedTensors<Self>, B::Prepared>;

    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
        Ok(AutodiffPrepared::new(weights))
    }

    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>> {
        if is_tracked(&x) {
            return Ok(reference::forward(
                x,
                &prepared.reference(reference::prepare),
            ));
        }
        let inner = prepared.inner(inner_packed, B::slidesparse_prepare)?;
        Ok(Tensor::from_inner(B::slidesparse_forward(
            x.inner(),
            &inner,
        )?))
    }

    type DensePrepared = AutodiffPrepared<Self, DenseTensors<Self>, B::DensePrepared>;

    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
        Ok(AutodiffPrepared::new(weights))
    }

    fn dense_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::DensePrepared,
    ) -> Result<Tensor<Self, 2>> {
        if is_tracked(&x) {
            return Ok(reference::forward(
                x,
                &prepared.reference(reference::prepare_dense),
            ));
        }
        let inner = prepared.inner(inner_dense, B::dense_prepare)?;
        Ok(Tensor::from_inner(B::dense_forward(x.inner(), &inner)?))
    }
}
