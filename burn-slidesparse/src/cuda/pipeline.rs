//! The one forward pipeline of both GPU layers: quantization (with the lift for a
//! SlideSparse layer) -> library GEMM -> epilogue, all on burn's stream.
//!
//! Forward of `X [M, K]`:
//! 1. CubeCL quant(+lift) kernel: codes `[M_pad, K_out]` (`K'` lifted, or `K` padded for the
//!    dense baseline) and per-token scales `s_x [M_pad]`;
//! 2. the layer's [`LayerGemm`]: `acc [M_pad, N_pad] = codes . W^T`;
//! 3. CubeCL epilogue: `Y [M, N] = acc * s_x * s_w + b` in `X`'s float dtype; none where the
//!    GEMM applies it in its own kernel and writes `Y` itself (our compact Hopper GEMM, 16-bit
//!    outputs: the accumulator is `finished`).
//!
//! A forward of up to 16 tokens of a layer with a GEMV (`gemv.rs`: INT8 dense or 6:8) runs
//! the quantization (no lift) and the GEMV, whose epilogue is fused: two launches instead of
//! three, and a kernel that streams the weight at the memory's pace.
//!
//! Buffers come from cubecl's memory pool (decode-sized intermediates are kept per thread,
//! `buffers.rs`); their reuse is ordered on burn's stream behind the GEMM.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Shape};
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::server::Handle;

use super::{
    accumulator::Accumulator,
    buffers::{ForwardBuffer, ForwardScratch},
    config::config,
    gemm::{GemmBuffers, LayerGemm},
    gemv::{Gemv, GemvParams, MAX_TOKENS},
    launch::{QuantKernel, launch_epilogue, launch_quant_lift, launch_quant_lift_permuted},
    memory::ensure_fits,
    queued::{Call, lanes, submit},
    runtime::{Client, Runtime},
    state::DeviceState,
};
use crate::{
    deferred,
    error::{Result, SlideSparseError},
    weight_quant::Precision,
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
    /// Our GEMV for forwards of up to 16 tokens (INT8 layers with `SLIDESPARSE_DECODE_GEMV`
    /// on).
    pub(crate) gemv: Option<Arc<Gemv>>,
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

impl<G> GpuLayer<G> {
    /// `None` where forwards of up to [`MAX_TOKENS`](super::gemv::MAX_TOKENS) tokens run the
    /// GEMM, else whether the GEMV they run reads a compact 6:8 layout (tiles or rows).
    pub fn gemv_reads(&self) -> Option<bool> {
        self.gemv.as_ref().map(|g| g.is_compact())
    }
}

impl<G: LayerGemm> GpuLayer<G> {
    /// `Y [m, n]` for `X [m, k]` (made contiguous first: burn-cuda may allocate 2-D tensors
    /// with padded, "pitched", rows), in `X`'s float dtype.
    ///
    /// The float type is the tensor's own dtype, not the backend's: burn 0.21 keeps a
    /// per-device default dtype, so a tensor of an f32 backend can be bf16 once a bf16
    /// backend has used the same device.
    ///
    /// Errors: first, the failure of work queued earlier on this cubecl stream that has not
    /// been reported (`SlideSparseError::Deferred`, see `crate::deferred`); then the
    /// forward's own.
    pub fn forward(&self, x: &CubeTensor<Runtime>) -> Result<CubeTensor<Runtime>> {
        deferred::take_current()?;
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
        if let Some(gemv) = self.gemv.as_ref().filter(|_| m <= MAX_TOKENS) {
            return self.forward_gemv(gemv, &x, m);
        }
        let client = x.client.clone();
        let (precision, dtype) = (self.precision, x.dtype);
        let m_pad = m_pad(m, precision);
        let accumulator = self.gemm.accumulator(precision, dtype, m);
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
                rows: m,
            };
            self.gemm
                .run(&client, &mut state, m_pad, accumulator, buffers)?;
        }
        if !accumulator.finished {
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
        }
        Ok(CubeTensor::new_contiguous(
            client,
            x.device.clone(),
            Shape::new([m, self.n]),
            out,
            dtype,
        ))
    }

    /// `Y [m, n]` through the GEMV: the token codes (no lift: the GEMV reads each kept weight
    /// with the activation at its own position), then the GEMV with its epilogue.
    fn forward_gemv(
        &self,
        gemv: &Gemv,
        x: &CubeTensor<Runtime>,
        m: usize,
    ) -> Result<CubeTensor<Runtime>> {
        let client = x.client.clone();
        let (precision, dtype) = (self.precision, x.dtype);
        let m_pad = m_pad(m, precision);
        let columns = gemv.x_columns();
        let scratch_sizes = [m_pad * columns, m_pad * 4, 16];
        let out_bytes = m * self.n * dtype.size();
        let ([codes, token_scales, _], out) =
            self.scratch(&client, m, scratch_sizes, out_bytes, "GEMV")?;
        let k = self.quant.k;
        launch_quant_lift(
            &client,
            &x.handle,
            &codes.handle,
            &token_scales.handle,
            (m, m_pad, k, k, columns),
            0,
            precision,
            dtype,
        )?;
        let index = x.device.index;
        let (launch, params) = gemv.launch(index, m, dtype, 0)?;
        let params = GemvParams {
            x_stride: columns as i32,
            y_stride: self.n as i32,
            ..params
        };
        let call = GemvCall {
            x: codes.handle.clone(),
            sx: token_scales.handle.clone(),
            sw: self.scale.clone(),
            bias: self.bias.clone(),
            y: out.clone(),
            out_halves: out_bytes / 2,
        };
        submit(&*lanes(index)?, &client, params, vec![launch], call)?;
        Ok(CubeTensor::new_contiguous(
            client,
            x.device.clone(),
            Shape::new([m, self.n]),
            out,
            dtype,
        ))
    }

    /// The buffers of one forward of `m` tokens (`m_pad` rows): the intermediate ones
    /// (`[codes, token scales, accumulator]`, kept by this thread's lane at decode sizes; the
    /// accumulator is the output itself where it is [`finished`](Accumulator::finished)) and
    /// a fresh `[m, n]` output of `dtype`, once their total is known to fit.
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
            if accumulator.finished {
                0
            } else {
                m_pad * self.n_pad * accumulator.bytes()
            },
        ];
        let out_bytes = m * self.n * dtype.size();
        let ([codes, scales, acc], out) =
            self.scratch(client, m, scratch_sizes, out_bytes, "forward")?;
        let acc = if accumulator.finished {
            ForwardBuffer {
                handle: out.clone(),
                kept_ptr: None,
            }
        } else {
            acc
        };
        Ok(([codes, scales, acc], out))
    }

    /// This thread's lane's scratch of `sizes` and a fresh output of `out_bytes`, once their
    /// total is known to fit.
    fn scratch(
        &self,
        client: &Client,
        m: usize,
        sizes: [usize; 3],
        out_bytes: usize,
        what: &str,
    ) -> Result<(ForwardScratch, Handle)> {
        ensure_fits(
            client,
            &self.state,
            sizes.iter().sum::<usize>() + out_bytes,
            || format!("{} {what} of {m} tokens", G::LAYER),
        )?;
        let scratch = {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.make_current()?;
            let mut lanes = state.lanes.lock().unwrap_or_else(|e| e.into_inner());
            lanes.current().scratch.for_forward(client, sizes)?
        };
        Ok((scratch, client.empty(out_bytes)))
    }
}

/// The handles a GEMV forward reads and writes (the weight's pointers are in the parameter
/// block: the layer holds them).
struct GemvCall {
    x: Handle,
    sx: Handle,
    sw: Handle,
    bias: Option<Handle>,
    y: Handle,
    /// The output's size in 16-bit halves (NaN-filled if the launch fails).
    out_halves: usize,
}

impl Call for GemvCall {
    type Params = GemvParams;

    fn resolve(
        &self,
        p: &mut GemvParams,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()> {
        p.x = ptr(&self.x)?;
        p.sx = ptr(&self.sx)?;
        p.sw = ptr(&self.sw)?;
        p.y = ptr(&self.y)?;
        if let Some(bias) = &self.bias {
            p.bias = ptr(bias)?;
        }
        Ok(())
    }

    fn outputs(&self, p: &GemvParams) -> Vec<(u64, usize)> {
        vec![(p.y, self.out_halves)]
    }
}

/// Whether new layers get a GEMV: `SLIDESPARSE_DECODE_GEMV` (on unless set off).
pub(crate) fn gemv_enabled() -> Result<bool> {
    Ok(config()?.decode_gemv)
}
