//! The dense baseline layer with the identical pipeline: the same quantization kernel without
//! the lift, cuBLASLt dense GEMM at K, the same epilogue. Used to compare like with like.

use std::sync::{Arc, Mutex};

use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::{prelude::*, server::Handle};

use super::{
    accumulator::Accumulator,
    backend::{Runtime, forward_buffers, m_pad},
    cublaslt::{DenseShape, WORKSPACE},
    graphs::{GemmCall, GraphKey, Replay},
    launch::{launch_epilogue, launch_quant_lift},
    memory::ensure_fits,
    ordering::run_ordered,
    scratch::{ForwardBuffer, HeldBuffer},
    state::{DeviceState, device_state},
};
use crate::{
    error::{Result, SlideSparseError},
    format::f32_bytes,
    quant::{Precision, QuantizedWeight, WeightCodes},
};

/// A dense quantized layer on the GPU.
#[derive(Clone)]
pub struct DenseLayerGpu {
    pub n: usize,
    /// `n` rounded up to 16: cuBLASLt's 8-bit kernels need 16-element leading dimensions
    /// (the extra weight rows are zero; the epilogue reads the `n` real columns).
    pub n_pad: usize,
    pub k: usize,
    /// `K` rounded up to 16 (cuBLASLt's 8-bit alignment); the quant kernel zero-pads.
    pub k_pad: usize,
    pub precision: Precision,
    weight: HeldBuffer,
    scale: Handle,
    bias: Option<Handle>,
    state: Arc<Mutex<DeviceState>>,
}

impl std::fmt::Debug for DenseLayerGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseLayerGpu")
            .field("n", &self.n)
            .field("k", &self.k)
            .field("precision", &self.precision)
            .finish_non_exhaustive()
    }
}

impl DenseLayerGpu {
    /// Uploads a quantized `[n, k]` weight (codes + per-row scales).
    pub fn new(
        client: &ComputeClient<Runtime>,
        device_index: usize,
        weight: &QuantizedWeight,
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        let precision = weight.codes.precision();
        if precision == Precision::F32 {
            return Err(SlideSparseError::Backend(
                "the dense GPU baseline supports int8, fp8, bf16 and f16".into(),
            ));
        }
        let (n, k) = (weight.rows, weight.cols);
        let (n_pad, k_pad) = (n.next_multiple_of(16), k.next_multiple_of(16));
        let elem = precision.element_bytes();
        let state = device_state(device_index)?;
        ensure_fits(client, &state, n_pad * k_pad * elem, || {
            "QuantizedLinear weights".into()
        })?;
        let src = weight.codes.to_le_bytes();
        let mut bytes = vec![0u8; n_pad * k_pad * elem];
        for r in 0..n {
            bytes[r * k_pad * elem..(r * k_pad + k) * elem]
                .copy_from_slice(&src[r * k * elem..(r + 1) * k * elem]);
        }
        debug_assert!(!matches!(weight.codes, WeightCodes::F32(_)));
        Ok(Self {
            n,
            n_pad,
            k,
            k_pad,
            precision,
            weight: HeldBuffer::new(client, client.create_from_slice(&bytes))?,
            scale: client.create_from_slice(&f32_bytes(&weight.scales)),
            bias: bias.map(|b| client.create_from_slice(&f32_bytes(b))),
            state,
        })
    }

    /// `Y [m, n]` for `X [m, k]` (made contiguous first: burn-cuda may allocate 2-D
    /// tensors with padded, "pitched", rows), in `X`'s float dtype.
    pub fn forward(&self, x: &CubeTensor<Runtime>) -> Result<CubeTensor<Runtime>> {
        let x = &into_contiguous(x.clone());
        let (m, k) = (x.meta.shape()[0], x.meta.shape()[1]);
        if k != self.k {
            return Err(SlideSparseError::shape("dense layer input", self.k, k));
        }
        let client = x.client.clone();
        let m_pad = m_pad(m, self.precision);
        let dtype = x.dtype;
        let accumulator = Accumulator::dense(self.precision, dtype);
        let ([codes, token_scales, acc], out) = forward_buffers(
            &client,
            &self.state,
            (m, m_pad),
            (self.k_pad, self.precision),
            (self.n, self.n_pad, accumulator),
            dtype,
            "QuantizedLinear",
        )?;
        launch_quant_lift(
            &client,
            &x.handle,
            &codes.handle,
            &token_scales.handle,
            (m, m_pad, k, k, self.k_pad),
            0,
            self.precision,
            dtype,
        )?;
        self.run_gemm(&client, m_pad, accumulator, &codes, &acc, &token_scales)?;
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
            burn::tensor::Shape::new([m, self.n]),
            out,
            dtype,
        ))
    }

    /// `acc = X . W^T` through cuBLASLt, ordered on burn's stream like the sparse GEMM and
    /// replayed from a CUDA graph when `codes` and `acc` are kept buffers.
    fn run_gemm(
        &self,
        client: &ComputeClient<Runtime>,
        m_pad: usize,
        accumulator: Accumulator,
        codes: &ForwardBuffer,
        acc: &ForwardBuffer,
        poison: &ForwardBuffer,
    ) -> Result<()> {
        let shape = DenseShape {
            m_pad,
            n: self.n_pad,
            k: self.k_pad,
            precision: self.precision,
            accumulator,
        };
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.make_current()?;
        state.dense_gemm()?;
        let DeviceState {
            lanes,
            dense,
            sync_mode,
            side,
            use_graphs,
            queue_replays,
            ..
        } = &mut *state;
        let (lane, gemm, mode) = (
            lanes.current(client)?,
            dense.as_mut().expect("created above"),
            *sync_mode,
        );
        let p_ws = lane.workspace(client, WORKSPACE)?;
        let replay = Replay::new(*use_graphs, *queue_replays, || {
            let call = GemmCall::Dense(shape);
            GraphKey::if_kept(call, self.weight.ptr, (codes, acc), 0, p_ws)
        });
        run_ordered(
            client,
            lane,
            side,
            mode,
            (poison, m_pad),
            replay,
            |stream| {
                // Resolved here: on cubecl's device thread in `Stream` mode (no round trip).
                let (p_x, p_acc) = (codes.pointer(client)?, acc.pointer(client)?);
                // SAFETY: live allocations of the shape's sizes; burn's stream stays behind the GEMM.
                unsafe {
                    gemm.run(
                        shape,
                        self.weight.ptr,
                        p_x,
                        p_acc,
                        p_ws,
                        stream as *mut std::ffi::c_void,
                    )
                }
            },
        )
    }
}
