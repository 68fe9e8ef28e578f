//! Causal flash attention on the GPU: prefill (FlashAttention-2 style, tensor cores) and
//! decode (flash-decoding: the cache split over CTAs, then one merge), for bf16 and f16 with
//! f32 accumulation, grouped-query attention read natively, head dims 64 and 128.
//!
//! The kernels are CUDA C of this repository (`kernels.cu`), compiled with NVRTC once per
//! device for the device's own architecture and loaded as a module. A call checks the shapes,
//! allocates its output (and the decode merge's workspace) from cubecl's pool and queues the
//! launches on cubecl's device thread (`DeviceHandle::submit`), behind every kernel queued
//! before it, on burn's stream of the calling cubecl stream (found once through CUPTI,
//! `ordering.rs`): no host synchronization, no compilation per call. The pointers are resolved
//! on the device thread, where the queued task holds the tensors' handles until the launch
//! is enqueued; from then on cubecl reuses that memory only in the order of the same stream.
//!
//! A queued launch cannot return its error: it fills the output with NaN (never a stale
//! result) and keeps the error, which the next attention call returns. Without CUPTI the call
//! falls back to host ordering: sync burn's stream, launch on a stream of ours, sync it.

use std::{
    collections::HashMap,
    ffi::{CString, c_void},
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicUsize, Ordering as AtomicOrdering},
    },
};

use burn::tensor::{DType, Shape};
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::{
    cuda::CudaDevice, device::Device, device_handle::DeviceHandle, server::ComputeServer,
    server::Handle, stream_id::StreamId,
};
use cudarc::driver::{result as cu, sys};

use super::{
    driver::{Context, create_stream, cuda_device, driver_err, synchronize},
    ordering::probe_burn_stream,
    runtime::{Client, Runtime, device_ptr, sync_burn_stream},
    thread_exit::at_thread_exit,
};
use crate::{
    attention_shape::AttentionShape,
    error::{Result, SlideSparseError},
};

type Server = <Runtime as cubecl::Runtime>::Server;

mod block;

pub use block::{rms_norm, rope_attention, silu_mul};

/// The attention kernels, then the block's other steps (which use their helpers).
const SOURCE: &str = concat!(include_str!("kernels.cu"), include_str!("block.cu"));

/// Query and key rows per tile of both kernels.
const TILE: usize = 64;
/// Threads per CTA of the prefill and decode kernels (4 warps).
const THREADS: u32 = 128;
/// Rows of one MMA tile: the decode kernel's rows (query heads of a group x queries).
const DECODE_ROWS: usize = 16;

/// The kernels' parameter block; must match `struct Params` in `kernels.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Params {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    partial: u64,
    lse: u64,
    q_batch: i64,
    q_row: i64,
    k_batch: i64,
    k_row: i64,
    v_batch: i64,
    v_row: i64,
    batch: i32,
    tq: i32,
    kv_len: i32,
    hq: i32,
    hkv: i32,
    splits: i32,
    split_len: i32,
    scale_log2: f32,
}

/// The three kernels of one dtype and head dim.
#[derive(Clone, Copy)]
struct Variant {
    /// 64 queries per CTA (4 warps).
    prefill: sys::CUfunction,
    /// 128 queries per CTA (8 warps).
    prefill_wide: sys::CUfunction,
    decode: sys::CUfunction,
    reduce: sys::CUfunction,
}

/// The block's other kernels of one dtype (`block.cu`).
#[derive(Clone, Copy)]
struct BlockFunctions {
    rms_norm: sys::CUfunction,
    silu_mul: sys::CUfunction,
    rope_cache: sys::CUfunction,
}

/// The attention module of one device.
struct DeviceKernels {
    _module: sys::CUmodule,
    /// By (bf16, head dim).
    variants: HashMap<(bool, usize), Variant>,
    /// By bf16.
    block: HashMap<bool, BlockFunctions>,
    /// Streaming multiprocessors: how many CTAs the decode split aims at.
    sm_count: usize,
    context: Context,
    device: DeviceHandle<Server>,
}

// SAFETY: module and function handles are immutable after loading; the driver API is
// thread-safe; launches use them only with the device's context current.
unsafe impl Send for DeviceKernels {}
// SAFETY: as above, nothing is mutated after construction.
unsafe impl Sync for DeviceKernels {}

/// Shared memory of a prefill CTA of `rows` queries: the Q tile and two stages of (K, V)
/// tiles of 64 keys.
fn prefill_smem(rows: usize, d: usize) -> usize {
    (rows + 4 * TILE) * d * 2
}

/// Queries per prefill CTA: 64 (4 warps, two CTAs per SM) or 128 (8 warps, one CTA per SM,
/// half the K/V reads from L2).
static PREFILL_ROWS: AtomicUsize = AtomicUsize::new(64);

/// Chooses the prefill kernel's query tile, 64 or 128 rows (benchmarks compare them).
pub fn set_prefill_rows(rows: usize) -> Result<()> {
    if !matches!(rows, 64 | 128) {
        return Err(SlideSparseError::Unsupported {
            what: "flash attention prefill tile".into(),
            why: format!("{rows} query rows (64 or 128)"),
        });
    }
    PREFILL_ROWS.store(rows, AtomicOrdering::Relaxed);
    Ok(())
}

/// Shared memory of a decode CTA: 16 Q rows and three stages of (K, V) tiles (reused for
/// the merge of the warps).
fn decode_smem(d: usize) -> usize {
    DECODE_ROWS * d * 2 + 6 * TILE * d * 2
}

/// At most this many decode splits (the merge keeps one weight per split in shared memory).
const MAX_SPLITS: usize = 4096;

/// NVRTC's name for a compute capability (PTX of the closest older known target otherwise).
fn arch(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (9.., _) => "compute_90",
        _ => "compute_80",
    }
}

impl DeviceKernels {
    fn new(index: usize) -> Result<Self> {
        let dev = cuda_device(index)?;
        let context = Context::retain(dev)?;
        let attr = |a| {
            // SAFETY: `dev` comes from `cuda_device`.
            unsafe { cu::device::get_attribute(dev, a) }.map_err(driver_err("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute::*;
        let (major, minor) = (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        if major < 8 {
            return Err(SlideSparseError::Unsupported {
                what: "flash attention".into(),
                why: format!(
                    "needs bf16/f16 tensor cores (compute capability 8.0+), the GPU has {major}.{minor}; use `causal_attention_reference`"
                ),
            });
        }
        let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        let options = cudarc::nvrtc::CompileOptions {
            arch: Some(arch(major, minor)),
            options: vec!["-std=c++17".into()],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(|e| {
            SlideSparseError::Cuda {
                call: "NVRTC (attention kernels)",
                code: format!("{e:?}"),
            }
        })?;
        let image = CString::new(ptx.to_src()).map_err(|e| SlideSparseError::Cuda {
            call: "PTX (attention kernels)",
            code: format!("{e:?}"),
        })?;
        // SAFETY: `image` is a NUL-terminated PTX string; the context is current (`retain`).
        let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(driver_err("cuModuleLoadData"))?;
        let function = |name: String, smem: usize| -> Result<sys::CUfunction> {
            let name = CString::new(name).expect("kernel names have no NUL");
            // SAFETY: `module` was loaded above in the current context.
            let f = unsafe { cu::module::get_function(module, name) }
                .map_err(driver_err("cuModuleGetFunction"))?;
            if smem > 48 * 1024 {
                // SAFETY: `f` is a function of the loaded module; the size is what it launches
                // with.
                unsafe {
                    cu::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                }
                .map_err(driver_err("cuFuncSetAttribute"))?;
            }
            Ok(f)
        };
        let mut variants = HashMap::new();
        for (bf16, name) in [(true, "bf16"), (false, "f16")] {
            for d in [64, 128] {
                let variant = Variant {
                    prefill: function(format!("attn_prefill_{name}_{d}"), prefill_smem(64, d))?,
                    prefill_wide: function(
                        format!("attn_prefill128_{name}_{d}"),
                        prefill_smem(128, d),
                    )?,
                    decode: function(format!("attn_decode_{name}_{d}"), decode_smem(d))?,
                    reduce: function(format!("attn_reduce_{name}_{d}"), 0)?,
                };
                variants.insert((bf16, d), variant);
            }
        }
        let mut block = HashMap::new();
        for (bf16, name) in [(true, "bf16"), (false, "f16")] {
            let functions = BlockFunctions {
                rms_norm: function(format!("rms_norm_{name}"), 0)?,
                silu_mul: function(format!("silu_mul_{name}"), 0)?,
                rope_cache: function(format!("rope_cache_{name}"), 0)?,
            };
            block.insert(bf16, functions);
        }
        // Attach to the device's runner only once it is cubecl-cuda's own (the caller's
        // tensors come from it).
        let device = CudaDevice { index };
        Ok(Self {
            _module: module,
            variants,
            block,
            sm_count,
            context,
            device: DeviceHandle::new(device.to_id()),
        })
    }
}

/// The kernels of device `index`, compiled on first use.
fn device_kernels(index: usize) -> Result<Arc<DeviceKernels>> {
    static KERNELS: OnceLock<Mutex<HashMap<usize, Arc<DeviceKernels>>>> = OnceLock::new();
    let mut all = KERNELS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(k) = all.get(&index) {
        return Ok(k.clone());
    }
    let kernels = Arc::new(DeviceKernels::new(index)?);
    all.insert(index, kernels.clone());
    Ok(kernels)
}

/// How launches are ordered with burn's kernels on one cubecl stream.
#[derive(Clone, Debug)]
enum Ordering {
    /// On burn's own stream, from cubecl's device thread.
    Stream(usize),
    /// Host synchronization around a stream of ours (CUPTI unavailable: the reason).
    Host(usize, String),
}

type Orderings = Mutex<HashMap<(usize, StreamId), Ordering>>;

/// The ordering of each device and cubecl stream that ran attention.
static ORDERINGS: OnceLock<Orderings> = OnceLock::new();

/// The ordering of the current cubecl stream of device `index`, probed once (and dropped
/// when this thread ends: cubecl never reuses its stream).
fn ordering(client: &Client, index: usize) -> Result<Ordering> {
    let key = (index, StreamId::current());
    let mut all = ORDERINGS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(o) = all.get(&key) {
        return Ok(o.clone());
    }
    let found = match probe_burn_stream(client) {
        Ok(stream) => Ordering::Stream(stream as usize),
        Err(why) => {
            // The stream is the device context's; this thread (a fusion executor, say) may
            // not have that context current yet.
            device_kernels(index)?.context.make_current()?;
            Ordering::Host(create_stream()? as usize, why.to_string())
        }
    };
    all.insert(key, found.clone());
    at_thread_exit(move || forget_ordering(key));
    Ok(found)
}

/// Drops an ended thread's ordering. The stream of a host ordering (CUPTI unavailable) is
/// kept: where fusion made the entry on another thread than the stream's owner, the owner
/// may be running launches on it outside the lock.
fn forget_ordering(key: (usize, StreamId)) {
    if let Some(orderings) = ORDERINGS.get() {
        orderings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
    }
}

/// The error of a queued launch that failed, until the next call reports it.
static FAILURE: Mutex<Option<SlideSparseError>> = Mutex::new(None);

fn take_failure() -> Result<()> {
    match FAILURE.lock().unwrap_or_else(|e| e.into_inner()).take() {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// Which ordering a call on this thread's cubecl stream would use, and why if it is the host
/// fallback (for benchmarks and tests).
pub fn ordering_of(client: &Client, index: usize) -> Result<Option<String>> {
    Ok(match ordering(client, index)? {
        Ordering::Stream(_) => None,
        Ordering::Host(_, why) => Some(why),
    })
}

/// Whether the decode kernel runs a call (a group's queries fit its one MMA tile of rows).
pub fn is_decode(shape: &AttentionShape) -> bool {
    shape.group() * shape.tq <= DECODE_ROWS
}

/// Whether the kernels run a call of this shape with these dtypes of q, k, v: `Ok(bf16)`, or
/// why not.
pub fn check_supported(shape: &AttentionShape, dtypes: [DType; 3]) -> Result<bool> {
    let bf16 = match dtypes {
        [DType::BF16, DType::BF16, DType::BF16] => true,
        [DType::F16, DType::F16, DType::F16] => false,
        [q, k, v] => {
            return Err(SlideSparseError::Unsupported {
                what: "flash attention".into(),
                why: format!(
                    "q, k, v must all be bf16 or all f16 (got {q:?}, {k:?}, {v:?}); \
                     use `causal_attention_reference` for other types"
                ),
            });
        }
    };
    if !matches!(shape.d, 64 | 128) {
        return Err(SlideSparseError::Unsupported {
            what: "flash attention".into(),
            why: format!(
                "head dim {} (the kernels have 64 and 128); use `causal_attention_reference`",
                shape.d
            ),
        });
    }
    let max = i32::MAX as usize;
    if shape.batch * shape.tq * shape.hq > max || shape.kv_len > max {
        return Err(SlideSparseError::Unsupported {
            what: "flash attention".into(),
            why: "more than 2^31 rows or cache positions".into(),
        });
    }
    Ok(bf16)
}

/// Compiles and loads the kernels of device `index` if they are not yet.
pub fn prepare_device(index: usize) -> Result<()> {
    device_kernels(index).map(|_| ())
}

/// Waves of decode CTAs (two resident per SM) the split aims at: more waves balance the tail
/// of long caches, fewer give each CTA more tiles to pipeline against its fixed cost. One
/// wave measured as fast or faster in every decode case of the benchmark (b1 x 4096: 29
/// against 34 us; b1 x 32768: 2.27 against 1.74 TB/s; b16 x 32768 within 1%).
static DECODE_WAVES: AtomicUsize = AtomicUsize::new(1);

/// Chooses how many waves of CTAs the decode split aims at, 1 to 8 (benchmarks compare them).
pub fn set_decode_waves(waves: usize) -> Result<()> {
    if !(1..=8).contains(&waves) {
        return Err(SlideSparseError::Unsupported {
            what: "flash attention decode split".into(),
            why: format!("{waves} waves (1 to 8)"),
        });
    }
    DECODE_WAVES.store(waves, AtomicOrdering::Relaxed);
    Ok(())
}

/// How the decode kernel splits the cache: `(splits, keys per split)`, aiming at
/// `DECODE_WAVES` waves of its two resident CTAs per SM over the batch and KV heads, each
/// split whole 64-key tiles.
fn decode_split(shape: &AttentionShape, sm_count: usize) -> (usize, usize) {
    let tiles = shape.kv_len.div_ceil(TILE);
    let pairs = shape.batch * shape.hkv;
    let waves = DECODE_WAVES.load(AtomicOrdering::Relaxed);
    let wanted = (waves * 2 * sm_count)
        .div_ceil(pairs)
        .clamp(1, tiles.min(MAX_SPLITS));
    let tiles_per_split = tiles.div_ceil(wanted);
    let splits = tiles.div_ceil(tiles_per_split);
    (splits, tiles_per_split * TILE)
}

/// A tensor as `(handle, batch stride, row stride)` in elements, rows of `heads * d`
/// contiguous values (copied to a contiguous tensor first if they are not).
fn rows_of(t: CubeTensor<Runtime>) -> (CubeTensor<Runtime>, i64, i64) {
    let shape = t.meta.shape().clone();
    let strides = t.meta.strides().clone();
    let (heads, d) = (shape[2], shape[3]);
    let rows_dense = (d == 1 || strides[3] == 1) && (heads == 1 || strides[2] == d);
    let t = if rows_dense { t } else { into_contiguous(t) };
    let strides = t.meta.strides().clone();
    let (batch_stride, row_stride) = (strides[0], strides[1]);
    let row_stride = if shape[1] == 1 { heads * d } else { row_stride };
    let batch_stride = if shape[0] == 1 { 0 } else { batch_stride };
    (t, batch_stride as i64, row_stride as i64)
}

/// Causal attention of `q [batch, tq, hq, d]` over `k`, `v` `[batch, capacity, hkv, d]`
/// (positions `0..kv_len` in use, `None`: all), query `i` at position `kv_len - tq + i`;
/// returns `[batch, tq, hq, d]` in `q`'s dtype. bf16 or f16, d = 64 or 128. `scale` defaults
/// to `1/sqrt(d)`.
pub fn causal_attention(
    q: CubeTensor<Runtime>,
    k: CubeTensor<Runtime>,
    v: CubeTensor<Runtime>,
    kv_len: Option<usize>,
    scale: Option<f32>,
) -> Result<CubeTensor<Runtime>> {
    take_failure()?;
    let dims = |t: &CubeTensor<Runtime>| -> Result<[usize; 4]> {
        let s = t.meta.shape();
        s.as_slice()
            .try_into()
            .map_err(|_| SlideSparseError::shape("attention tensor rank", 4, s.num_dims()))
    };
    let shape = AttentionShape::new(dims(&q)?, dims(&k)?, dims(&v)?, kv_len)?;
    let bf16 = check_supported(&shape, [q.dtype, k.dtype, v.dtype])?;
    let index = q.device.index;
    let kernels = device_kernels(index)?;
    let variant = kernels.variants[&(bf16, shape.d)];
    let client = q.client.clone();
    let (q, q_batch, q_row) = rows_of(q);
    let (k, k_batch, k_row) = rows_of(k);
    let (v, v_batch, v_row) = rows_of(v);
    let out_shape = Shape::new([shape.batch, shape.tq, shape.hq, shape.d]);
    let rows = shape.batch * shape.tq * shape.hq;
    let out = client.empty(rows * shape.d * 2);
    let scale = scale.unwrap_or(1.0 / (shape.d as f32).sqrt());
    let mut params = Params {
        q_batch,
        q_row,
        k_batch,
        k_row,
        v_batch,
        v_row,
        batch: shape.batch as i32,
        tq: shape.tq as i32,
        kv_len: shape.kv_len as i32,
        hq: shape.hq as i32,
        hkv: shape.hkv as i32,
        splits: 1,
        split_len: 0,
        scale_log2: scale * std::f32::consts::LOG2_E,
        ..Default::default()
    };
    let mut launches = Vec::with_capacity(2);
    let mut workspace = None;
    if is_decode(&shape) {
        let (splits, split_len) = decode_split(&shape, kernels.sm_count);
        params.splits = splits as i32;
        params.split_len = split_len as i32;
        let grid = (splits as u32, shape.hkv as u32, shape.batch as u32);
        launches.push(Launch {
            function: variant.decode,
            grid,
            block: THREADS,
            smem: decode_smem(shape.d) as u32,
        });
        if splits > 1 {
            workspace = Some(client.empty(splits * rows * (shape.d + 1) * 4));
            launches.push(Launch {
                function: variant.reduce,
                grid: (rows as u32, 1, 1),
                block: shape.d as u32,
                smem: (splits * 4) as u32,
            });
        }
    } else {
        let rows = PREFILL_ROWS.load(AtomicOrdering::Relaxed);
        let (function, warps) = match rows {
            128 => (variant.prefill_wide, 8),
            _ => (variant.prefill, 4),
        };
        launches.push(Launch {
            function,
            grid: (
                shape.hq as u32,
                shape.tq.div_ceil(rows) as u32,
                shape.batch as u32,
            ),
            block: 32 * warps,
            smem: prefill_smem(rows, shape.d) as u32,
        });
    }
    let buffers = Buffers {
        q: q.handle.clone(),
        k: k.handle.clone(),
        v: v.handle.clone(),
        o: out.clone(),
        workspace,
        partial_bytes: (params.splits as usize * rows * shape.d * 4) as u64,
        out_len: rows * shape.d,
    };
    submit(&client, &kernels, index, params, launches, buffers)?;
    Ok(CubeTensor::new_contiguous(
        client,
        q.device.clone(),
        out_shape,
        out,
        q.dtype,
    ))
}

/// One kernel launch of a call.
#[derive(Clone, Copy)]
struct Launch {
    function: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
}
// SAFETY: a function handle of a module that lives for the process.
unsafe impl Send for Launch {}

/// What a queued call reads and writes: it holds the handles until the launches are
/// enqueued, puts their pointers into the kernels' parameter block, and NaN-fills its
/// outputs when a launch fails.
trait Call: Send + 'static {
    /// The parameter block the kernels take by value (`repr(C)`, as in the `.cu` files).
    type Params: Copy + Send + 'static;

    /// Sets the parameters' pointers from `ptr`.
    fn resolve(
        &self,
        params: &mut Self::Params,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()>;

    /// `(pointer, 16-bit elements)` of each output resolved in `params` (NaN-filled when a
    /// launch fails).
    fn outputs(&self, params: &Self::Params) -> Vec<(u64, usize)>;
}

/// The handles an attention call reads and writes, held until its launches are enqueued.
struct Buffers {
    q: Handle,
    k: Handle,
    v: Handle,
    o: Handle,
    workspace: Option<Handle>,
    /// Bytes of the workspace's partial outputs (the log-sum-exps follow them).
    partial_bytes: u64,
    /// 16-bit elements of the output (NaN-filled if a launch fails).
    out_len: usize,
}

impl Call for Buffers {
    type Params = Params;

    fn resolve(
        &self,
        params: &mut Params,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()> {
        params.q = ptr(&self.q)?;
        params.k = ptr(&self.k)?;
        params.v = ptr(&self.v)?;
        params.o = ptr(&self.o)?;
        if let Some(w) = &self.workspace {
            params.partial = ptr(w)?;
            params.lse = params.partial + self.partial_bytes;
        }
        Ok(())
    }

    fn outputs(&self, params: &Params) -> Vec<(u64, usize)> {
        vec![(params.o, self.out_len)]
    }
}

/// Enqueues `launches` with `params` on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; the pointers in `params` are live
/// device memory of the sizes the launches' kernels read and write.
unsafe fn enqueue<P: Copy>(stream: sys::CUstream, params: &P, launches: &[Launch]) -> Result<()> {
    for l in launches {
        let mut p = *params;
        let mut args = [&mut p as *mut P as *mut c_void];
        // SAFETY: the kernels take one parameter block by value; the caller's contract for
        // the rest.
        unsafe {
            cu::launch_kernel(l.function, l.grid, (l.block, 1, 1), l.smem, stream, &mut args)
        }
        .map_err(driver_err("cuLaunchKernel (attention module)"))?;
    }
    Ok(())
}

/// Runs `call`'s launches in burn's stream order: queued on cubecl's device thread (CUPTI
/// found burn's stream), or host-ordered.
fn submit<C: Call>(
    client: &Client,
    kernels: &DeviceKernels,
    index: usize,
    params: C::Params,
    launches: Vec<Launch>,
    call: C,
) -> Result<()> {
    match ordering(client, index)? {
        Ordering::Stream(stream) => {
            queue(kernels, stream, params, launches, call);
            Ok(())
        }
        Ordering::Host(stream, _) => {
            run_host_ordered(client, kernels, stream, params, &launches, call)
        }
    }
}

/// Queues the launches on cubecl's device thread, behind every kernel queued so far, on
/// burn's stream; a failure NaN-fills the outputs and is kept for the next call.
fn queue<C: Call>(
    kernels: &DeviceKernels,
    stream: usize,
    params: C::Params,
    launches: Vec<Launch>,
    call: C,
) {
    let stream_id = StreamId::current();
    kernels.device.submit(move |server: &mut Server| {
        let mut params = params;
        let resolved = call.resolve(&mut params, &mut |h| {
            server
                .get_resource(h.clone().binding(), stream_id)
                .map(|r| r.resource().ptr)
                .map_err(|e| SlideSparseError::Cubecl {
                    what: "get_resource (attention module)",
                    detail: format!("{e:?}"),
                })
        });
        let stream = stream as sys::CUstream;
        // SAFETY: burn's stream of this cubecl stream, on the device thread where the context
        // is current; the pointers were just resolved from the handles this task holds.
        let launched = resolved.and_then(|()| unsafe { enqueue(stream, &params, &launches) });
        if let Err(error) = launched {
            for (ptr, len) in call.outputs(&params) {
                if ptr != 0 {
                    // SAFETY: an output of `len` 16-bit elements resolved above; a failure
                    // here leaves the error recorded below.
                    let _ = unsafe { sys::cuMemsetD16Async(ptr, 0x7FFF, len, stream) };
                }
            }
            FAILURE
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(error);
        }
        drop(call);
    });
}

/// The host-ordered fallback: burn's stream drained, the launches on our stream, waited for.
fn run_host_ordered<C: Call>(
    client: &Client,
    kernels: &DeviceKernels,
    stream: usize,
    params: C::Params,
    launches: &[Launch],
    call: C,
) -> Result<()> {
    let mut params = params;
    call.resolve(&mut params, &mut |h| device_ptr(client, h))?;
    sync_burn_stream(client)?;
    kernels.context.make_current()?;
    let stream = stream as sys::CUstream;
    // SAFETY: our stream, created in this context; pointers resolved from live handles that
    // `call` holds until the stream is synchronized.
    unsafe {
        enqueue(stream, &params, launches)?;
        synchronize(stream)
    }
}
