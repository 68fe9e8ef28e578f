//! `SlideSparseBackend` for burn-cuda's `CubeBackend<CudaRuntime, ..>`: the real pipeline.
//!
//! Forward of `X [M, K]`:
//! 1. CubeCL quant+lift kernel on burn's stream: `X' [M_pad, K']` codes and `s_x [M_pad]`;
//! 2. cuSPARSELt sparse GEMM `acc [M_pad, N_pad] = X' . W'^T` with a cached plan;
//! 3. CubeCL `dequant_bias_kernel` on burn's stream: `Y [M, N]` in the layer's float dtype.
//!
//! (Kernel launches: `launch.rs`.) Stream ordering: cubecl-cuda 0.10 runs kernels on a
//! private per-thread stream that it does not expose; `ordering.rs` puts the GEMM on that
//! same stream (found through CUPTI, the default), or orders a stream of ours with host
//! synchronizations or device flags. Buffers come from cubecl's memory pool; their reuse is
//! ordered on burn's stream behind the GEMM.

use std::sync::{Arc, Mutex};

use burn::tensor::{Shape, Tensor, TensorPrimitive};
use burn_cubecl::{
    BoolElement, CubeBackend, FloatElement, IntElement, kernel::into_contiguous, tensor::CubeTensor,
};
use cubecl::{prelude::*, server::Handle};
use half::{bf16, f16};

use super::{
    accumulator::Accumulator,
    cusparselt::{self, GemmPointers, GemmShape, MatDescriptor},
    cusparselt_sys::Stream,
    dense::DenseLayerGpu,
    graphs::{GemmCall, GraphKey, Replay},
    launch::{launch_epilogue, launch_quant_lift},
    memory::ensure_fits,
    ordering::{SyncMode, run_ordered},
    scratch::{ForwardBuffer, ForwardScratch, HeldBuffer, fresh_scratch},
    state::{DeviceState, device_state},
};
use crate::{
    backend::{DenseTensors, LayerSpec, PackedTensors, SlideSparseBackend},
    error::{Result, SlideSparseError},
    format::f32_bytes,
    module::codes_from_values,
    quant::{Precision, QuantizedWeight},
};

pub(crate) type Runtime = cubecl::cuda::CudaRuntime;
type Client = ComputeClient<Runtime>;

/// A layer's weights on the GPU, compressed for cuSPARSELt.
#[derive(Clone)]
pub struct CudaPrepared {
    pub spec: LayerSpec,
    /// `N_out` padded to the structured-matrix multiple.
    pub n_pad: usize,
    compressed: HeldBuffer,
    scale: Handle,
    /// The weight scales padded with zeros to `n_pad`: cuSPARSELt's alpha vector (INT8).
    alpha: HeldBuffer,
    bias: Option<Handle>,
    state: Arc<Mutex<DeviceState>>,
}

impl std::fmt::Debug for CudaPrepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPrepared")
            .field("spec", &self.spec)
            .field("n_pad", &self.n_pad)
            .finish_non_exhaustive()
    }
}

/// Rows of the structured matrix must be a multiple of this (32 for 8-bit, 16 for 16-bit).
fn n_multiple(precision: Precision) -> usize {
    if precision.element_bytes() == 1 {
        32
    } else {
        16
    }
}

/// `M` padded for the dense operand (16 for 8-bit, 8 for 16-bit types).
pub fn m_pad(m: usize, precision: Precision) -> usize {
    let multiple = if precision.element_bytes() == 1 {
        16
    } else {
        8
    };
    m.max(1).next_multiple_of(multiple)
}

fn backend_err(what: impl std::fmt::Display) -> SlideSparseError {
    SlideSparseError::Backend(what.to_string())
}

pub(crate) fn ptr(client: &Client, handle: &Handle) -> Result<u64> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| backend_err(format!("cubecl get_resource: {e:?}")))?;
    Ok(resource.resource().ptr)
}

pub(crate) fn sync_burn_stream(client: &Client) -> Result<()> {
    cubecl::future::block_on(client.sync()).map_err(|e| backend_err(format!("cubecl sync: {e:?}")))
}

/// Little-endian bytes of `W'` padded to `n_pad` zero rows, in the GEMM input type.
fn weight_bytes(
    values: &[f32],
    rows: usize,
    n_pad: usize,
    k_prime: usize,
    precision: Precision,
) -> Vec<u8> {
    let mut codes: Vec<u8> = match precision {
        Precision::Int8 => values.iter().map(|&v| v as i8 as u8).collect(),
        Precision::Fp8 => values
            .iter()
            .map(|&v| crate::quant::canonical_fp8(crate::fp8::f32_to_e4m3(v)))
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
    };
    codes.resize(n_pad * k_prime * precision.element_bytes(), 0);
    debug_assert_eq!(values.len(), rows * k_prime);
    codes
}

fn host_f32<B: burn::tensor::backend::Backend, const D: usize>(
    t: Tensor<B, D>,
) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| backend_err(format!("reading weights: {e:?}")))
}

/// Uploads, checks (PruneCheck) and compresses a packed weight. Runs once per layer.
fn prepare_weights<F: FloatElement, I: IntElement, BT: BoolElement>(
    weights: PackedTensors<CubeBackend<Runtime, F, I, BT>>,
) -> Result<CudaPrepared> {
    let spec = weights.spec;
    if spec.precision == Precision::F32 {
        return Err(backend_err(
            "precision f32 has no structured (2:4) GEMM in cuSPARSELt on this GPU; pack with int8, fp8, bf16 or f16 \
             (f32 layers run on the reference backends)",
        ));
    }
    let primitive = weights.weight.clone().into_primitive().tensor();
    let (client, index) = (primitive.client.clone(), primitive.device.index);
    let k_prime = spec.k_prime();
    let n_pad = spec
        .out_features
        .next_multiple_of(n_multiple(spec.precision));
    let state = device_state(index)?;
    // The uncompressed upload plus about as much again for the compressed copy and its
    // buffer, all alive together.
    let weight_bytes_len = n_pad * k_prime * spec.precision.element_bytes();
    ensure_fits(&client, &state, 2 * weight_bytes_len, || {
        "SlideSparseLinear weights".into()
    })?;
    let values = host_f32(weights.weight)?;
    let dense = client.create_from_slice(&weight_bytes(
        &values,
        spec.out_features,
        n_pad,
        k_prime,
        spec.precision,
    ));
    let mut scales = host_f32(weights.scale)?;
    let scale = client.create_from_slice(&f32_bytes(&scales));
    scales.resize(n_pad, 0.0);
    let alpha = client.create_from_slice(&f32_bytes(&scales));
    let bias = match weights.bias {
        Some(b) => Some(client.create_from_slice(&f32_bytes(&host_f32(b)?))),
        None => None,
    };

    let guard = state.lock().unwrap_or_else(|e| e.into_inner());
    guard.make_current()?;
    let desc = MatDescriptor::structured(&guard.lt, k_prime, n_pad, spec.precision)?;
    let sizes = cusparselt::compressed_sizes(&guard.lt, &desc)?;
    let compressed = client.empty(sizes.compressed.max(16));
    let buffer = client.empty(sizes.buffer.max(16));
    // Zeroed: cuSPARSELt sets it to nonzero on a violation.
    let valid = client.create_from_slice(&[0; 4]);
    let (p_dense, p_comp, p_buf, p_valid) = (
        ptr(&client, &dense)?,
        ptr(&client, &compressed)?,
        ptr(&client, &buffer)?,
        ptr(&client, &valid)?,
    );
    sync_burn_stream(&client)?; // uploads done before our stream reads them
    // SAFETY: the pointers are live cubecl allocations of the sizes cuSPARSELt asked for; the
    // handles are held until after the synchronization below.
    unsafe {
        cusparselt::prune_check(&guard.lt, &desc, p_dense, p_valid, guard.stream as _)?;
        cusparselt::compress(&guard.lt, &desc, p_dense, p_comp, p_buf, guard.stream as _)?;
    }
    guard.synchronize()?;
    desc.destroy(&guard.lt)?;
    let flag = client
        .read_one(valid)
        .map_err(|e| backend_err(format!("reading PruneCheck result: {e:?}")))?;
    if flag[..4] != [0, 0, 0, 0] {
        return Err(SlideSparseError::WindowViolation {
            tensor: "SlideSparseLinear weight (cuSPARSELt PruneCheck)".into(),
            row: 0,
            column: 0,
            nonzeros: 3,
        });
    }
    drop((dense, buffer, guard));
    Ok(CudaPrepared {
        spec,
        n_pad,
        compressed: HeldBuffer::new(&client, compressed)?,
        scale,
        alpha: HeldBuffer::new(&client, alpha)?,
        bias,
        state,
    })
}

/// The full forward on the GPU; `x` must be contiguous `[m, k]`.
///
/// The float type is the tensor's own dtype, not the backend's `F`: burn 0.21 keeps a
/// per-device default dtype, so a tensor of an f32 backend can be bf16 once a bf16 backend
/// has used the same device.
fn forward_impl(x: CubeTensor<Runtime>, prepared: &CudaPrepared) -> Result<CubeTensor<Runtime>> {
    let spec = &prepared.spec;
    let geometry = spec.geometry();
    let (m, k) = (x.meta.shape()[0], x.meta.shape()[1]);
    let (k_prime, n, n_pad) = (geometry.k_prime(), spec.out_features, prepared.n_pad);
    let precision = spec.precision;
    let m_pad = m_pad(m, precision);
    let client = x.client.clone();
    let dtype = x.dtype;
    let accumulator = Accumulator::sparse(precision, dtype);
    let ([codes, token_scales, acc], out) = forward_buffers(
        &client,
        &prepared.state,
        (m, m_pad),
        (k_prime, precision),
        (n, n_pad, accumulator),
        dtype,
        "SlideSparseLinear",
    )?;
    launch_quant_lift(
        &client,
        &x.handle,
        &codes.handle,
        &token_scales.handle,
        (m, m_pad, k, geometry.k_slide(), k_prime),
        geometry.n,
        precision,
        dtype,
    )?;
    run_sparse_gemm(
        &client,
        prepared,
        &codes,
        &acc,
        (m_pad, accumulator),
        (&token_scales, m_pad),
    )?;
    launch_epilogue(
        &client,
        &acc.handle,
        &token_scales.handle,
        &prepared.scale,
        prepared.bias.as_ref(),
        &out,
        (m, m_pad, n, n_pad),
        accumulator,
        dtype,
    )?;
    Ok(CubeTensor::new_contiguous(
        client,
        x.device.clone(),
        Shape::new([m, n]),
        out,
        dtype,
    ))
}

/// The buffers of one forward of `m` tokens (`m_pad` rows) quantized to `k_out` codes and
/// multiplied into an `n_pad`-wide accumulator: the intermediate ones (`forward_scratch`)
/// and a fresh `[m, n]` output of `dtype`, once their total is known to fit
/// (`ensure_fits`; `layer` names the layer in the error).
pub fn forward_buffers(
    client: &Client,
    state: &Mutex<DeviceState>,
    (m, m_pad): (usize, usize),
    (k_out, precision): (usize, Precision),
    (n, n_pad, accumulator): (usize, usize, Accumulator),
    dtype: burn::tensor::DType,
    layer: &'static str,
) -> Result<(ForwardScratch, Handle)> {
    let scratch_sizes = [
        m_pad * k_out * precision.element_bytes(),
        m_pad * 4,
        m_pad * n_pad * accumulator.bytes(),
    ];
    let out_bytes = m * n * dtype.size();
    ensure_fits(
        client,
        state,
        scratch_sizes.iter().sum::<usize>() + out_bytes,
        || format!("{layer} forward of {m} tokens"),
    )?;
    let scratch = forward_scratch(client, state, scratch_sizes)?;
    Ok((scratch, client.empty(out_bytes)))
}

/// The intermediate buffers `[codes, token scales, accumulator]` of one forward on this
/// thread: kept across calls at decode sizes (see `scratch.rs`), except under the opt-in
/// `Flags` ordering, where a timed-out wait lets burn's stream run ahead of a late GEMM, so
/// the next forward could overwrite what that GEMM still reads: fresh buffers there.
fn forward_scratch(
    client: &Client,
    state: &Mutex<DeviceState>,
    sizes: [usize; 3],
) -> Result<ForwardScratch> {
    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    if state.sync_mode == SyncMode::Flags {
        return Ok(fresh_scratch(client, sizes));
    }
    state.make_current()?;
    state
        .lanes
        .current(client)?
        .scratch
        .for_forward(client, sizes)
}

/// `acc = X' . W'^T` through cuSPARSELt on this thread's lane, ordered between burn's
/// kernels (see `ordering.rs`); replayed from a CUDA graph when `codes` and `acc` are kept
/// buffers (see `graphs.rs`); `poison` is NaN-filled if the GEMM never signals.
pub fn run_sparse_gemm(
    client: &Client,
    prepared: &CudaPrepared,
    codes: &ForwardBuffer,
    acc: &ForwardBuffer,
    (m_pad, accumulator): (usize, Accumulator),
    poison: (&ForwardBuffer, usize),
) -> Result<()> {
    let shape = GemmShape {
        m_pad,
        n_pad: prepared.n_pad,
        k_prime: prepared.spec.k_prime(),
        precision: prepared.spec.precision,
        accumulator,
    };
    let mut state = prepared.state.lock().unwrap_or_else(|e| e.into_inner());
    state.make_current()?;
    // Pointers of buffers that are not kept are resolved where the GEMM is enqueued: on
    // cubecl's device thread in `Stream` mode, where `get_resource` is a direct call
    // instead of a round trip to it.
    let pointers = |client: &Client| -> Result<GemmPointers> {
        Ok(GemmPointers {
            weight: prepared.compressed.ptr,
            act: codes.pointer(client)?,
            out: acc.pointer(client)?,
            alpha: prepared.alpha.ptr,
        })
    };
    if state.plan(shape)?.needs_search {
        if state.needs_search(&shape) {
            search_once(client, &mut state, shape, pointers(client)?)?;
        }
        state.plan(shape)?.needs_search = false;
    }
    let DeviceState {
        lt,
        plans,
        lanes,
        sync_mode,
        side,
        use_graphs,
        queue_replays,
        ..
    } = &mut *state;
    let plan = plans.get(&shape).expect("built above");
    let lane = lanes.current(client)?;
    let p_ws = lane.workspace(client, plan.workspace)?;
    let replay = Replay::new(*use_graphs, *queue_replays, || {
        let call = GemmCall::Sparse(shape);
        let (weight, alpha) = (prepared.compressed.ptr, prepared.alpha.ptr);
        GraphKey::if_kept(call, weight, (codes, acc), alpha, p_ws)
    });
    run_ordered(client, lane, side, *sync_mode, poison, replay, |stream| {
        let p = pointers(client)?;
        // SAFETY: live cubecl allocations of this plan's shapes; `run_ordered` keeps burn's
        // stream (which owns their reuse) behind the GEMM.
        unsafe { plan.run(lt, p, p_ws, stream as Stream) }
    })
}

/// Runs `MatmulSearch` for a new M bucket (blocking, once) and remembers the winner.
fn search_once(
    client: &Client,
    state: &mut DeviceState,
    shape: GemmShape,
    p: GemmPointers,
) -> Result<()> {
    let workspace_bytes = state.plan(shape)?.workspace;
    let workspace = client.empty(SEARCH_WORKSPACE.max(workspace_bytes));
    let p_ws = ptr(client, &workspace)?;
    sync_burn_stream(client)?;
    let stream = state.stream as Stream;
    let DeviceState { lt, plans, .. } = &mut *state;
    let plan = plans.get_mut(&shape).expect("built above");
    // SAFETY: live cubecl allocations of this plan's shapes, held until the sync below.
    let id = unsafe { plan.search(lt, p, p_ws, stream)? };
    state.synchronize()?;
    state.remember(&shape, id);
    Ok(())
}

/// Workspace offered to `MatmulSearch` (it tries every algorithm).
const SEARCH_WORKSPACE: usize = 256 << 20;

impl<F: FloatElement, I: IntElement, BT: BoolElement> SlideSparseBackend
    for CubeBackend<Runtime, F, I, BT>
{
    type Prepared = CudaPrepared;

    fn slidesparse_prepare(weights: PackedTensors<Self>) -> Result<Self::Prepared> {
        prepare_weights(weights)
    }

    fn slidesparse_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::Prepared,
    ) -> Result<Tensor<Self, 2>> {
        let x = into_contiguous(x.into_primitive().tensor());
        let y = forward_impl(x, prepared)?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
    }

    type DensePrepared = DenseLayerGpu;

    fn dense_prepare(weights: DenseTensors<Self>) -> Result<Self::DensePrepared> {
        let primitive = weights.weight.clone().into_primitive().tensor();
        let (client, index) = (primitive.client.clone(), primitive.device.index);
        let [rows, cols] = weights.weight.dims();
        let quantized = QuantizedWeight {
            rows,
            cols,
            codes: codes_from_values(host_f32(weights.weight)?, weights.precision),
            scales: host_f32(weights.scale)?,
        };
        let bias = match weights.bias {
            Some(b) => Some(host_f32(b)?),
            None => None,
        };
        DenseLayerGpu::new(&client, index, &quantized, bias.as_deref())
    }

    fn dense_forward(
        x: Tensor<Self, 2>,
        prepared: &Self::DensePrepared,
    ) -> Result<Tensor<Self, 2>> {
        let y = prepared.forward(&x.into_primitive().tensor())?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
    }
}
