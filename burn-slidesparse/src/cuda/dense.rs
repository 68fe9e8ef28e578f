//! The dense baseline layer with the identical pipeline: the same quantization kernel without
//! the lift, cuBLASLt dense GEMM at K, the same epilogue. Used to compare like with like.

use std::sync::{Arc, Mutex};

use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::{prelude::*, server::Handle};

use super::{
    accumulator::Accumulator,
    backend::{Runtime, m_pad, ptr},
    cublaslt::{DenseShape, WORKSPACE},
    launch::{launch_epilogue, launch_quant_lift},
    memory::ensure_fits,
    ordering::run_ordered,
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
    weight: Handle,
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
            weight: client.create_from_slice(&bytes),
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
        let sizes = [
            m_pad * self.k_pad * self.precision.element_bytes(),
            m_pad * 4,
            m_pad * self.n_pad * accumulator.bytes(),
            m * self.n * dtype.size(),
        ];
        ensure_fits(&client, &self.state, sizes.iter().sum(), || {
            format!("QuantizedLinear forward of {m} tokens")
        })?;
        let [codes, token_scales, acc, out] = sizes.map(|bytes| client.empty(bytes));
        launch_quant_lift(
            &client,
            &x.handle,
            &codes,
            &token_scales,
            (m, m_pad, k, k, self.k_pad),
            0,
            self.precision,
            dtype,
        )?;
        {
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
                ..
            } = &mut *state;
            let (lane, gemm, mode) = (
                lanes.current(&client)?,
                dense.as_mut().expect("created above"),
                *sync_mode,
            );
            let p_ws = lane.workspace(&client, WORKSPACE)?;
            run_ordered(
                &client,
                lane,
                side,
                mode,
                (&token_scales, m_pad),
                |stream| {
                    // Resolved here: on cubecl's device thread in `Stream` mode (no round trip).
                    let (p_w, p_x, p_acc) = (
                        ptr(&client, &self.weight)?,
                        ptr(&client, &codes)?,
                        ptr(&client, &acc)?,
                    );
                    // SAFETY: live allocations of the shape's sizes; burn's stream stays behind the GEMM.
                    unsafe {
                        gemm.run(
                            shape,
                            p_w,
                            p_x,
                            p_acc,
                            p_ws,
                            stream as *mut std::ffi::c_void,
                        )
                    }
                },
            )?;
        }
        launch_epilogue(
            &client,
            &acc,
            &token_scales,
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
}
