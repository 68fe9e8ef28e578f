//! Building the GPU layers, once per layer and device: the weight uploaded in the GEMM's
//! input type and padded as it needs, the scales and the bias; for a SlideSparse layer either
//! cuSPARSELt's check and compression of the 2:4 weight, or the compact rows of our Hopper
//! GEMM (`SLIDESPARSE_SPARSE_GEMM=compact`).

use std::{
    borrow::Cow,
    sync::{Arc, Mutex},
};

use burn::tensor::{Tensor, backend::Backend};
use cubecl::server::Handle;

use super::{
    buffers::HeldBuffer,
    compact_gemm::{self, CompactGemm},
    config::{SparseGemmChoice, config},
    cusparselt::{self, MatDescriptor},
    driver::DeviceBuffer,
    gemm::{DenseGemm, LtWeight, SparseGemm},
    gemv::Gemv,
    memory::ensure_fits,
    nvrtc_module::DeviceInfo,
    pipeline::{GpuLayer, QuantShape, gemv_enabled},
    runtime::{Client, device_ptr, sync_burn_stream},
    state::{DeviceState, device_state},
};
use crate::{
    compact::{CompactCodes, CompactRows, CompactWeight, HostCodes},
    error::{Result, SlideSparseError},
    pack::LayerSpec,
    permute::InputPermutation,
    weight_quant::{Precision, QuantizedWeight, WeightCodes},
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

/// Refuses codes that do not have the layer's precision and `[out, K']` shape.
fn check_codes(spec: LayerSpec, weight: &QuantizedWeight) -> Result<()> {
    let expected = (spec.out_features, spec.k_prime());
    if weight.codes.precision() != spec.precision
        || (weight.rows, weight.cols) != expected
        || weight.codes.len() != expected.0 * expected.1
        || weight.scales.len() != expected.0
    {
        return Err(SlideSparseError::Unsupported {
            what: "SlideSparseLinear weight".into(),
            why: format!(
                "codes are {} [{}, {}] with {} scales, the layer is {} [{}, {}]",
                weight.codes.precision(),
                weight.rows,
                weight.cols,
                weight.scales.len(),
                spec.precision,
                expected.0,
                expected.1
            ),
        });
    }
    Ok(())
}

/// Refuses a SlideSparse layer's host weight that is not of the layer's precision, shape,
/// pattern and alignment.
fn check_held(spec: LayerSpec, weight: &HostCodes) -> Result<()> {
    match weight {
        HostCodes::Codes(codes) => check_codes(spec, codes),
        HostCodes::Compact(compact) => check_compact(spec, compact),
    }
}

/// [`check_held`] for compact rows.
fn check_compact(spec: LayerSpec, weight: &CompactWeight) -> Result<()> {
    let rows = &weight.rows;
    if weight.precision != spec.precision
        || (rows.pattern, rows.rows, rows.k) != (spec.pattern, spec.out_features, spec.in_features)
        || weight.alignment != spec.alignment
        || weight.scales.len() != spec.out_features
    {
        return Err(SlideSparseError::Unsupported {
            what: "SlideSparseLinear weight".into(),
            why: format!(
                "compact codes are {} {} [{}, {}] aligned to {} with {} scales, the layer is {} {} \
                 [{}, {}] aligned to {}",
                weight.precision,
                rows.pattern,
                rows.rows,
                rows.k,
                weight.alignment,
                weight.scales.len(),
                spec.precision,
                spec.pattern,
                spec.out_features,
                spec.in_features,
                spec.alignment
            ),
        });
    }
    Ok(())
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
    /// Builds a SlideSparse layer from its packed weight as the module holds it (the slid
    /// `W' [out, K']` or its compact rows, with the per-channel scales) and its bias, with the
    /// GEMM `SLIDESPARSE_SPARSE_GEMM` chooses ([`new_sparse_with`](Self::new_sparse_with)).
    pub fn new_sparse(
        client: &Client,
        device_index: usize,
        spec: LayerSpec,
        weight: &HostCodes,
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        let choice = config()?.sparse_gemm;
        Self::new_sparse_with(client, device_index, spec, (weight, bias), choice)
    }

    /// [`new_sparse`](Self::new_sparse) with the GEMM chosen here. With
    /// [`SparseGemmChoice::Compact`] the layer holds one copy of its weight: our compact GEMM's
    /// rows where the layer allows it ([`compact_gemm_fits`]), which a 6:8 layer's GEMV reads
    /// too, else cuSPARSELt's compressed copy, serving every size. With
    /// [`SparseGemmChoice::CuSparseLt`], cuSPARSELt's copy, and beside it the GEMV's compact
    /// rows for a 6:8 INT8 layer. Compact rows the module holds are uploaded as they are; slid
    /// codes are compacted here. cuSPARSELt's copy is checked by its PruneCheck; the
    /// uncompressed upload is freed before this returns.
    pub fn new_sparse_with(
        client: &Client,
        device_index: usize,
        spec: LayerSpec,
        (weight, bias): (&HostCodes, Option<&[f32]>),
        choice: SparseGemmChoice,
    ) -> Result<Self> {
        let precision = spec.precision;
        check_precision("SlideSparseLinear", precision)?;
        check_held(spec, weight)?;
        let scales = weight.scales();
        let geometry = spec.geometry();
        let (n, k_prime) = (spec.out_features, geometry.k_prime());
        let n_pad = n.next_multiple_of(sparse_n_multiple(precision));
        let state = device_state(device_index)?;
        let quant = QuantShape {
            k: spec.in_features,
            k_slide: geometry.k_slide(),
            k_out: k_prime,
            lift_n: geometry.n,
        };
        let (scale, bias) = scale_and_bias(client, scales, bias);
        let compact = choice == SparseGemmChoice::Compact && compact_gemm_fits(device_index, spec)?;
        // The compact GEMM's epilogue reads the layer's scales and bias.
        let epilogue = compact
            .then(|| -> Result<_> {
                Ok((
                    HeldBuffer::new(client, scale.clone())?,
                    bias.clone().map(|b| HeldBuffer::new(client, b)).transpose()?,
                ))
            })
            .transpose()?;
        let layer = |gemm, gemv| Self {
            gemm,
            quant,
            n,
            n_pad,
            precision,
            scale,
            bias,
            gemv,
            permutation: None,
            state: Arc::clone(&state),
        };
        if let Some(epilogue) = epilogue {
            let rows = compact_rows(spec, weight)?;
            let rows_bytes = CompactRows::read_bytes(spec.pattern, n, spec.in_features);
            ensure_fits(client, &state, 2 * rows_bytes, || {
                "SlideSparseLinear compact rows".into()
            })?;
            let strides = (k_prime, n_pad);
            let gemm = CompactGemm::new(client, device_index, &rows, strides, epilogue)?;
            let gemm = Arc::new(gemm);
            // A 6:8 layer's GEMV reads the same rows: one copy serves every size.
            let gemv = (spec.pattern.block_len() == 8 && gemv_enabled()?).then(|| {
                let strides = (gemm.kept_stride, gemm.rank_stride);
                Arc::new(Gemv::rows(gemm.rows_ptrs(), strides, n, spec.in_features))
            });
            return Ok(layer(SparseGemm::Compact(gemm), gemv));
        }
        // The uncompressed upload plus about as much again for the compressed copy and its
        // buffer, all alive together.
        let weight_len = n_pad * k_prime * precision.element_bytes();
        ensure_fits(client, &state, 2 * weight_len, || {
            "SlideSparseLinear weights".into()
        })?;
        let bytes = padded(
            &weight.full().codes.to_le_bytes(),
            (n, k_prime),
            (n_pad, k_prime),
            precision.element_bytes(),
        );
        let compressed = compress(client, &state, &bytes, (k_prime, n_pad), precision)?;
        // One copy: where the compact GEMM was chosen but cannot run (another GPU, pattern or
        // precision), cuSPARSELt's copy serves every size, without the GEMV's rows.
        let gemv = match choice {
            SparseGemmChoice::Compact => None,
            SparseGemmChoice::CuSparseLt => sparse_gemv(client, spec, weight)?,
        };
        let mut alpha = scales.to_vec();
        alpha.resize(n_pad, 0.0);
        let gemm = SparseGemm::Lt(LtWeight {
            compressed: HeldBuffer::new(client, compressed)?,
            alpha: HeldBuffer::new(client, client.create_from_slice(&f32_bytes(&alpha)))?,
            n_pad,
            k_prime,
            precision,
        });
        Ok(layer(gemm, gemv))
    }
}

/// Whether our compact GEMM can run a SlideSparse layer of `spec` on device `index`: a Hopper
/// GPU (sm_90), an INT8 pattern up to 14:16, `K'` a multiple of 16 bytes (the tensor maps' row
/// stride).
pub fn compact_gemm_fits(index: usize, spec: LayerSpec) -> Result<bool> {
    Ok(spec.precision == Precision::Int8
        && spec.pattern.block_len() <= compact_gemm::MAX_BLOCK_LEN
        && spec.k_prime().is_multiple_of(16)
        && DeviceInfo::of(index)?.capability == (9, 0))
}

/// An INT8 layer's compact form: the rows the module holds, read as they are, or compacted
/// from its slid codes.
fn compact_rows(spec: LayerSpec, weight: &HostCodes) -> Result<Cow<'_, CompactRows>> {
    Ok(match weight {
        HostCodes::Compact(compact) => Cow::Borrowed(&compact.rows),
        HostCodes::Codes(codes) => Cow::Owned(CompactRows::new(&compact_codes(spec, codes)?)),
    })
}

/// An INT8 layer's compact codes, from its slid codes.
fn compact_codes(spec: LayerSpec, weight: &QuantizedWeight) -> Result<CompactCodes<i8>> {
    let WeightCodes::I8(codes) = &weight.codes else {
        return Err(SlideSparseError::Unsupported {
            what: "compact SlideSparseLinear weight".into(),
            why: format!("{} codes (INT8 only)", weight.codes.precision()),
        });
    };
    CompactCodes::from_slid(
        codes,
        spec.out_features,
        &spec.geometry(),
        spec.pattern,
        "SlideSparseLinear weight",
    )
}

/// The GEMV of a 6:8 INT8 layer (its own tiles of the compact codes), where it is on; `None`
/// for other patterns and precisions (the library GEMM at every size).
fn sparse_gemv(client: &Client, spec: LayerSpec, weight: &HostCodes) -> Result<Option<Arc<Gemv>>> {
    if weight.precision() != Precision::Int8 || spec.pattern.block_len() != 8 || !gemv_enabled()? {
        return Ok(None);
    }
    let compact = match weight {
        HostCodes::Compact(compact) => compact.rows.to_codes::<i8>(),
        HostCodes::Codes(codes) => compact_codes(spec, codes)?,
    };
    Ok(Some(Arc::new(Gemv::compact(client, &compact)?)))
}

impl GpuLayer<SparseGemm> {
    /// The layer reading its input through `permutation` (uploaded as `u32 [K]`), folded into
    /// the quant+lift kernel's map; `None` keeps the original order.
    pub fn with_input_permutation(
        self,
        client: &Client,
        permutation: Option<&InputPermutation>,
    ) -> Result<Self> {
        let Some(p) = permutation else {
            return Ok(self);
        };
        p.check_len("SlideSparseLinear", self.quant.k)?;
        let bytes: Vec<u8> = p.as_slice().iter().flat_map(|v| v.to_le_bytes()).collect();
        // The GEMV reads the activations in the layer's original order: a permuted layer
        // runs the library GEMM, whose lift gathers through the permutation, at every size.
        Ok(Self {
            permutation: Some(client.create_from_slice(&bytes)),
            gemv: None,
            ..self
        })
    }
}

/// Checks that `dense` (the bytes of a `[n_pad, k']` 2:4 weight) is valid 2:4 and
/// compresses it for cuSPARSELt; blocking (it runs once per layer). The uncompressed copy and
/// cuSPARSELt's buffer are driver allocations of their own, freed before this returns: from
/// cubecl's pool they would stay reserved there (1.5x the dense weight per 6:8 layer).
fn compress(
    client: &Client,
    state: &Mutex<DeviceState>,
    dense: &[u8],
    (k_prime, n_pad): (usize, usize),
    precision: Precision,
) -> Result<Handle> {
    let state = state.lock().unwrap_or_else(|e| e.into_inner());
    state.make_current()?;
    let desc = MatDescriptor::structured(&state.lt, k_prime, n_pad, precision)?;
    let sizes = cusparselt::compressed_sizes(&state.lt, &desc)?;
    let compressed = client.empty(sizes.compressed.max(16));
    let p_comp = device_ptr(client, &compressed)?;
    sync_burn_stream(client)?; // the allocation is ready before our stream writes it
    let dense = DeviceBuffer::upload(dense)?;
    let buffer = DeviceBuffer::zeroed(sizes.buffer)?;
    // Zeroed: cuSPARSELt sets it to nonzero on a violation.
    let valid = DeviceBuffer::zeroed(4)?;
    // SAFETY: the pointers are live allocations of the sizes cuSPARSELt asked for (the
    // uncompressed weight is `n_pad * k'` elements); they are held until after the
    // synchronization below.
    unsafe {
        cusparselt::prune_check(&state.lt, &desc, dense.ptr(), valid.ptr(), state.stream as _)?;
        cusparselt::compress(
            &state.lt,
            &desc,
            dense.ptr(),
            p_comp,
            buffer.ptr(),
            state.stream as _,
        )?;
    }
    state.synchronize()?;
    desc.destroy(&state.lt)?;
    if valid.read::<4>()? != [0, 0, 0, 0] {
        return Err(SlideSparseError::PruneCheckRejected {
            tensor: "SlideSparseLinear weight".into(),
        });
    }
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
        let weight = HeldBuffer::new(client, client.create_from_slice(&bytes))?;
        // The GEMV reads the GEMM's own copy: rows of `k_pad` codes, zeros past `k`.
        let gemv = (precision == Precision::Int8 && gemv_enabled()?)
            .then(|| Arc::new(Gemv::dense(weight.ptr, n, k_pad, k_pad)));
        Ok(Self {
            gemm: DenseGemm {
                weight,
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
            gemv,
            permutation: None,
            state: Arc::clone(&state),
        })
    }
}
