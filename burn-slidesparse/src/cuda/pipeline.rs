//! The one forward pipeline of both GPU layers: quantization (with the lift for a
//! SlideSparse layer) -> library GEMM -> epilogue, all on burn's stream.
//!
//! Forward of `X [M, K]`:
//! 1. CubeCL quant(+lift) kernel: codes `[M_pad, K_out]` (`K'` lifted, or `K` padded for the
//!    dense baseline) and per-token scales `s_x [M_pad]`;
//! 2. the layer's [`LayerGemm`]: `acc [M_pad, N_pad] = codes . W^T`;
//! 3. CubeCL epilogue: `Y [M, N] = acc * s_x * s_w + b` in `X`'s float dtype.
//!
//! Buffers come from cubecl's memory pool (decode-sized intermediates are kept per thread,
//! `buffers.rs`); their reuse is ordered on burn's stream behind the GEMM.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Shape};
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::server::Handle;

use super::{
    accumulator::Accumulator,
    buffers::ForwardScratch,
    gemm::{GemmBuffers, LayerGemm},
    launch::{QuantKernel, launch_epilogue, launch_quant_lift_permuted},
    memory::ensure_fits,
    runtime::{Client, Runtime},
    state::DeviceState,
};
use crate::{
    error::{Result, SlideSparseError},
    quant::Precision,
};

/// `M` padded for the GEMM's dense operand (16 rows for 8-bit types, 8 for 16-bit).
pub fn m_pad(m: usize, precision: Precision) -> usize {
    let multiple = if precision.element_bytes() == 1 {
        16
    } else {
        8
    };
    m.max(1).next_multiple_of(multiple)
}

/// How a layer's quantization kernel reads and writes a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantShape {
    /// Input width `K`.
    pub k: usize,
    /// `K` padded to whole pattern blocks (`K` for the dense baseline).
    pub k_slide: usize,
    /// Codes per row: `K'` (lifted) or `K` padded for cuBLASLt.
    pub k_out: usize,
    /// The pattern's `N` of the lift, 0 for no lift (the dense baseline).
    pub lift_n: u32,
}

/// A linear layer on the GPU: its GEMM's weights plus what the quantization and the
/// epilogue need. `G` is [`SparseGemm`](super::gemm::SparseGemm) for a SlideSparse layer,
/// [`DenseGemm`](super::gemm::DenseGemm) for the dense baseline.
#[derive(Clone)]
pub struct GpuLayer<G> {
    /// The GEMM and its weights.
    pub gemm: G,
    pub(crate) quant: QuantShape,
    /// Output width `N`.
    pub n: usize,
    /// `N` padded as the GEMM needs (the accumulator's row length).
    pub n_pad: usize,
    /// The precision of codes and weights.
    pub precision: Precision,
    /// Per-output-channel weight scales `[N]` (f32).
    pub(crate) scale: Handle,
    /// The bias `[N]` (f32), if any.
    pub(crate) bias: Option<Handle>,
    /// The input permutation `[K]` (u32) folded into the lift, if the layer has one.
    pub(crate) permutation: Option<Handle>,
    pub(crate) state: Arc<Mutex<DeviceState>>,
}

impl<G> std::fmt::Debug for GpuLayer<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuLayer")
            .field("quant", &self.quant)
            .field("n", &self.n)
            .field("precision", &self.precision)
            .finish_non_exhaustive()
    }
}

impl<G: LayerGemm> GpuLayer<G> {
    /// `Y [m, n]` for `X [m, k]` (made contiguous first: burn-cuda may allocate 2-D tensors
    /// with padded, "pitched", rows), in `X`'s float dtype.
    ///
    /// The float type is the tensor's own dtype, not the backend's: burn 0.21 keeps a
    /// per-device default dtype, so a tensor of an f32 backend can be bf16 once a bf16
    /// backend has used the same device.
    pub fn forward(&self, x: &CubeTensor<Runtime>) -> Result<CubeTensor<Runtime>> {
        let x = into_contiguous(x.clone());
        let (m, k) = (x.meta.shape()[0], x.meta.shape()[1]);
        let q = self.quant;
        if k != q.k {
            return Err(SlideSparseError::shape(
                format!("{} input width", G::LAYER),
                q.k,
                k,
            ));
        }
        let client = x.client.clone();
        let (precision, dtype) = (self.precision, x.dtype);
        let m_pad = m_pad(m, precision);
        let accumulator = G::accumulator(precision, dtype);
        let ([codes, token_scales, acc], out) =
            self.forward_buffers(&client, (m, m_pad), accumulator, dtype)?;
        launch_quant_lift_permuted(
            QuantKernel::Auto,
            &client,
            &x.handle,
            self.permutation.as_ref(),
            &codes.handle,
            &token_scales.handle,
            (m, m_pad, k, q.k_slide, q.k_out),
            q.lift_n,
            precision,
            dtype,
        )?;
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.make_current()?;
            let buffers = GemmBuffers {
                codes: &codes,
                acc: &acc,
                token_scales: &token_scales,
            };
            self.gemm
                .run(&client, &mut state, m_pad, accumulator, buffers)?;
        }
        launch_epilogue(
            &client,
            &acc.handle,
            &token_scales.handle,
            &self.scale,
            self.bias.as_ref(),
            &out,
            (m, m_pad, self.n, self.n_pad),
            accumulator,
            dtype,
        )?;
        Ok(CubeTensor::new_contiguous(
            client,
            x.device.clone(),
            Shape::new([m, self.n]),
            out,
            dtype,
        ))
    }

    /// The buffers of one forward of `m` tokens (`m_pad` rows): the intermediate ones
    /// (`[codes, token scales, accumulator]`, kept by this thread's lane at decode sizes)
    /// and a fresh `[m, n]` output of `dtype`, once their total is known to fit.
    pub fn forward_buffers(
        &self,
        client: &Client,
        (m, m_pad): (usize, usize),
        accumulator: Accumulator,
        dtype: DType,
    ) -> Result<(ForwardScratch, Handle)> {
        let scratch_sizes = [
            m_pad * self.quant.k_out * self.precision.element_bytes(),
            m_pad * 4,
            m_pad * self.n_pad * accumulator.bytes(),
        ];
        let out_bytes = m * self.n * dtype.size();
        ensure_fits(
            client,
            &self.state,
            scratch_sizes.iter().sum::<usize>() + out_bytes,
            || format!("{} forward of {m} tokens", G::LAYER),
        )?;
        let scratch = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.make_current()?;
            state.lanes.current()?.scratch.for_forward(client, scratch_sizes)?
        };
        Ok((scratch, client.empty(out_bytes)))
    }
}
