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
/// a gradient, and the inner backend's, built on first use, for those that do not.
#[derive(Clone, Debug)]
pub struct AutodiffPrepared<A: AutodiffBackend, W, P> {
    reference: ReferencePrepared<A>,
    /// The inner backend's tensors of the layer (the module's own buffers, not copies).
    source: W,
    inner: Arc<Mutex<Option<P>>>,
}

impl<A: AutodiffBackend, W: Clone, P: Clone> AutodiffPrepared<A, W, P> {
    /// The inner backend's preparation, built with `prepare` on first use.
    fn inner(&self, prepare: impl FnOnce(W) -> Result<P>) -> Result<P> {
        let mut slot = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = slot.as_ref() {
            return Ok(p.clone());
        }
        let p = prepare(self.source.clone())?;
        *slot = Some(p.clone());
        Ok(p)
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
        weight: w.weight.clone().inner(),
        scale: w.scale.clone().inner(),
        bias: w.bias.clone().map(Tensor::inner),
    }
}

fn inner_dense<B: SlideSparseBackend>(w: &DenseTensors<Autodiff<B>>) -> DenseTensors<B> {
    DenseTensors {
        precision: w.precision,
        weight: w.weight.clone().inner(),
        scale: w.scale.clone().inner(),
        bias: w.bias.clone().map(Tensor::inner),
    }
}

impl<B: SlideSparseBackend> SlideSparseBackend for Autodiff<B> {
    type Prepared = AutodiffPrepared<Self, PackedTensors<B>, B::Prepared>;

    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
        Ok(AutodiffPrepared {
            source: inner_packed(&weights),
            reference: reference::prepare(weights),
            inner: Arc::default(),
        })
    }

    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>> {
        if is_tracked(&x) {
            return Ok(reference::forward(x, &prepared.reference));
        }
        let inner = prepared.inner(B::slidesparse_prepare)?;
        Ok(Tensor::from_inner(B::slidesparse_forward(
            x.inner(),
            &inner,
        )?))
    }

    type DensePrepared = AutodiffPrepared<Self, DenseTensors<B>, B::DensePrepared>;

    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
        Ok(AutodiffPrepared {
            source: inner_dense(&weights),
            reference: reference::prepare_dense(weights),
            inner: Arc::default(),
        })
    }

    fn dense_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::DensePrepared,
    ) -> Result<Tensor<Self, 2>> {
        if is_tracked(&x) {
            return Ok(reference::forward(x, &prepared.reference));
        }
        let inner = prepared.inner(B::dense_prepare)?;
        Ok(Tensor::from_inner(B::dense_forward(x.inner(), &inner)?))
    }
}
