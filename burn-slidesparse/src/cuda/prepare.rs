//! Building the GPU layers, once per layer and device: the weight uploaded in the GEMM's
//! input type and padded as it needs, the scales and the bias; for a SlideSparse layer also
//! cuSPARSELt's check and compression of the 2:4 weight.

use std::sync::{Arc, Mutex};

use burn::tensor::{Tensor, backend::Backend};
use cubecl::server::Handle;
use half::{bf16, f16};

use super::{
    buffers::HeldBuffer,
    cusparselt::{self, MatDescriptor},
    gemm::{DenseGemm, SparseGemm},
    memory::ensure_fits,
    pipeline::{GpuLayer, QuantShape},
    runtime::{Client, cubecl_err, device_ptr, sync_burn_stream},
    state::{DeviceState, device_state},
};
use crate::{
    backend::LayerSpec,
    error::{Result, SlideSparseError},
    fp8::f32_to_e4m3,
    quant::{Precision, QuantizedWeight, canonical_fp8},
};

/// Rows of cuSPARSELt's structured matrix must be a multiple of this (32 for 8-bit types,
/// 16 for 16-bit).
fn sparse_n_multiple(precision: Precision) -> usize {
    if precision.element_bytes() == 1 {
        32
    } else {
        16
    }
}

/// The little-endian bytes of code values (INT8 integers, decoded E4M3 values, or floats)
/// in the GEMM's input type.
fn value_bytes(values: &[f32], precision: Precision) -> Vec<u8> {
    match precision {
        Precision::Int8 => values.iter().map(|&v| v as i8 as u8).collect(),
        Precision::Fp8 => values
            .iter()
            .map(|&v| canonical_fp8(f32_to_e4m3(v)))
            .collect(),
        Precision::Bf16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        Precision::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        Precision::F32 => values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
    }
}

/// A row-major `[rows, cols]` matrix of `elem`-byte elements padded with zeros to
/// `[rows_pad, cols_pad]`.
fn padded(
    bytes: &[u8],
    (rows, cols): (usize, usize),
    (rows_pad, cols_pad): (usize, usize),
    elem: usize,
) -> Vec<u8> {
    debug_assert_eq!(bytes.len(), rows * cols * elem);
    let mut out = vec![0u8; rows_pad * cols_pad * elem];
    for (src, dst) in bytes
        .chunks_exact(cols * elem)
        .zip(out.chunks_exact_mut(cols_pad * elem))
    {
        dst[..cols * elem].copy_from_slice(src);
    }
    out
}

/// Little-endian f32 bytes.
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A tensor's values on the host, as f32.
pub(crate) fn host_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| SlideSparseError::Backend(format!("reading weights: {e:?}")))
}

/// Refuses precisions without a GPU GEMM.
fn check_precision(what: &str, precision: Precision) -> Result<()> {
    if precision == Precision::F32 {
        return Err(SlideSparseError::Unsupported {
            what: what.into(),
            why: "precision f32 has no 8/16-bit GEMM here; pack with int8, fp8, bf16 or f16 \
                  (f32 layers run on the reference backends)"
                .into(),
        });
    }
    Ok(())
}

/// The parts every GPU layer has besides its GEMM: scales and bias on the device.
fn scale_and_bias(
    client: &Client,
    scales: &[f32],
    bias: Option<&[f32]>,
) -> (Handle, Option<Handle>) {
    (
        client.create_from_slice(&f32_bytes(scales)),
        bias.map(|b| client.create_from_slice(&f32_bytes(b))),
    )
}

impl GpuLayer<SparseGemm> {
    /// Uploads, checks (cuSPARSELt's PruneCheck) and compresses a packed weight given as
    /// code values `W' [out, K']`, with its per-channel scales and bias.
    pub fn new_sparse(
        client: &Client,
        device_index: usize,
        spec: LayerSpec,
        weight: &[f32],
        scales: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        let precision = spec.precision;
        check_precision("SlideSparseLinear", precision)?;
        let geometry = spec.geometry();
        let (n, k_prime) = (spec.out_features, geometry.k_prime());
        let n_pad = n.next_multiple_of(sparse_n_multiple(precision));
        let state = device_state(device_index)?;
        // The uncompressed upload plus about as much again for the compressed copy and its
        // buffer, all alive together.
        let weight_len = n_pad * k_prime * precision.element_bytes();
        ensure_fits(client, &state, 2 * weight_len, || {
            "SlideSparseLinear weights".into()
        })?;
        let bytes = padded(
            &value_bytes(weight, precision),
            (n, k_prime),
            (n_pad, k_prime),
            precision.element_bytes(),
        );
        let dense = client.create_from_slice(&bytes);
        let compressed = compress(client, &state, &dense, (k_prime, n_pad), precision)?;
        let mut alpha = scales.to_vec();
        alpha.resize(n_pad, 0.0);
        let (scale, bias) = scale_and_bias(client, scales, bias);
        Ok(Self {
            gemm: SparseGemm {
                compressed: HeldBuffer::new(client, compressed)?,
                alpha: HeldBuffer::new(client, client.create_from_slice(&f32_bytes(&alpha)))?,
                n_pad,
                k_prime,
                precision,
            },
            quant: QuantShape {
                k: spec.in_features,
                k_slide: geometry.k_slide(),
                k_out: k_prime,
                lift_n: geometry.n,
            },
            n,
            n_pad,
            precision,
            scale,
            bias,
            state,
        })
    }
}

/// Checks that `dense` (a `[n_pad, k']` 2:4 weight) is valid 2:4 and compresses it for
/// cuSPARSELt; blocking (it runs once per layer).
fn compress(
    client: &Client,
    state: &Mutex<DeviceState>,
    dense: &Handle,
    (k_prime, n_pad): (usize, usize),
    precision: Precision,
) -> Result<Handle> {
    let state = state.lock().unwrap_or_else(|e| e.into_inner());
    state.make_current()?;
    let desc = MatDescriptor::structured(&state.lt, k_prime, n_pad, precision)?;
    let sizes = cusparselt::compressed_sizes(&state.lt, &desc)?;
    let compressed = client.empty(sizes.compressed.max(16));
    let buffer = client.empty(sizes.buffer.max(16));
    // Zeroed: cuSPARSELt sets it to nonzero on a violation.
    let valid = client.create_from_slice(&[0; 4]);
    let (p_dense, p_comp, p_buf, p_valid) = (
        device_ptr(client, dense)?,
        device_ptr(client, &compressed)?,
        device_ptr(client, &buffer)?,
        device_ptr(client, &valid)?,
    );
    sync_burn_stream(client)?; // uploads done before our stream reads them
    // SAFETY: the pointers are live cubecl allocations of the sizes cuSPARSELt asked for; the
    // handles are held until after the synchronization below.
    unsafe {
        cusparselt::prune_check(&state.lt, &desc, p_dense, p_valid, state.stream as _)?;
        cusparselt::compress(&state.lt, &desc, p_dense, p_comp, p_buf, state.stream as _)?;
    }
    state.synchronize()?;
    desc.destroy(&state.lt)?;
    let flag = client
        .read_one(valid)
        .map_err(|e| cubecl_err("read_one (PruneCheck result)")(&e))?;
    if flag[..4] != [0, 0, 0, 0] {
        return Err(SlideSparseError::PruneCheckRejected {
            tensor: "SlideSparseLinear weight".into(),
        });
    }
    drop(buffer);
    Ok(compressed)
}

impl GpuLayer<DenseGemm> {
    /// Uploads a quantized `[n, k]` weight (codes + per-row scales) and its bias: the
    /// dense baseline with the same pipeline.
    pub fn new(
        client: &Client,
        device_index: usize,
        weight: &QuantizedWeight,
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        Self::from_code_bytes(
            client,
            device_index,
            weight.codes.precision(),
            (&weight.codes.to_le_bytes(), weight.rows, weight.cols),
            &weight.scales,
            bias,
        )
    }

    /// The dense baseline from code values `W [n, k]` (INT8 integers, decoded E4M3 values,
    /// or floats).
    pub fn from_values(
        client: &Client,
        device_index: usize,
        precision: Precision,
        (values, n, k): (&[f32], usize, usize),
        scales: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        let bytes = value_bytes(values, precision);
        Self::from_code_bytes(client, device_index, precision, (&bytes, n, k), scales, bias)
    }

    fn from_code_bytes(
        client: &Client,
        device_index: usize,
        precision: Precision,
        (bytes, n, k): (&[u8], usize, usize),
        scales: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        check_precision("QuantizedLinear", precision)?;
        let (n_pad, k_pad) = (n.next_multiple_of(16), k.next_multiple_of(16));
        let elem = precision.element_bytes();
        let state = device_state(device_index)?;
        ensure_fits(client, &state, n_pad * k_pad * elem, || {
            "QuantizedLinear weights".into()
        })?;
        let bytes = padded(bytes, (n, k), (n_pad, k_pad), elem);
        let (scale, bias) = scale_and_bias(client, scales, bias);
        Ok(Self {
            gemm: DenseGemm {
                weight: HeldBuffer::new(client, client.create_from_slice(&bytes))?,
                n_pad,
                k_pad,
                precision,
            },
            quant: QuantShape {
                k,
                k_slide: k,
                k_out: k_pad,
                lift_n: 0,
            },
            n,
            n_pad,
            precision,
            scale,
            bias,
            state: Arc::clone(&state),
        })
    }
}
