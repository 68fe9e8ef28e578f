//! A decode step of a pre-norm decoder (Llama, Qwen2, Mistral) as one CUDA graph, replayed
//! on burn's stream: the host's cost of a step is one graph launch.
//!
//! Why: queuing a step's ~600 launches through burn costs the host more than the GPU spends
//! on them (4-6 ms against ~4.5 ms for the Llama-3-8B shape). A graph cannot hold cubecl's
//! launches (`docs/decisions/block-steps-as-operations.md`), so every kernel of the step is
//! ours, launched through the driver with parameter blocks fixed at capture:
//!
//! - per block: RMSNorm with the residual add and the quantization fused
//!   (`rms_norm.cu`), the qkv GEMV (`decode_gemv.cu`), RoPE + the cache write
//!   (`rope_cache.cu`), decode attention (+ its merge), the attention output's quantization
//!   (`act_quant.cu`), the o GEMV, the second norm, the gate/up GEMV, the SiLU-gated
//!   product's quantization, the down GEMV: 10 or 11 launches;
//! - around them: the embedding gather of the step's tokens first; the final norm, the head
//!   GEMV and the greedy argmax last (`decode_step.cu`).
//!
//! What changes between steps lives in device memory: the tokens (written by the argmax, or
//! by the host) and the cache position (advanced by the argmax, or set by the host), which
//! RoPE and the attention read on the device. The attention's split count depends on the
//! longest cache a graph serves: one graph per power-of-two bucket of cache lengths, captured
//! on first use. The GEMVs are launched with programmatic dependent launch (sm_90), so each
//! prefetches its weights into L2 while the kernel before it finishes.
//!
//! The same launches also run without a graph ([`Engine::run_direct`]): the tests compare
//! the two bit for bit.

use std::{collections::HashMap, ffi::c_void, sync::Arc};

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::server::Handle;
use cudarc::driver::{result as cu, sys};

use super::{
    attention::{Params as AttentionParams, graph_decode},
    block_steps::{NORM_THREADS, NormParams, RopeParams, norm_and_rope},
    decode_step::{
        ARGMAX_THREADS, ActQuantParams, ArgmaxParams, EMBED_THREADS, EmbedParams,
        QUANT_MAX_WIDTH, QUANT_THREADS, functions as step_functions,
    },
    driver::{create_stream, driver_err, synchronize},
    gemv::{FLAG_PREFETCH, Gemv, GemvParams, MAX_TOKENS},
    nvrtc_module::DeviceInfo,
    pipeline::GpuLayer,
    queued::{lanes, queue_task},
    runtime::{Client, Runtime, device_ptr, sync_burn_stream},
};
use crate::error::{Result, SlideSparseError};

type Tensor = CubeTensor<Runtime>;

/// A linear of the step: its GEMV and the epilogue's operands.
#[derive(Clone)]
pub struct StepLinear {
    gemv: Arc<Gemv>,
    scale: Handle,
    bias: Option<Handle>,
}

impl StepLinear {
    /// The step's view of a prepared GPU layer, which must have a GEMV (INT8 dense or 6:8
    /// with `SLIDESPARSE_DECODE_GEMV` on, 6:8 on cuSPARSELt's copy).
    pub fn of<G>(layer: &GpuLayer<G>, what: &str) -> Result<Self> {
        let gemv = layer.gemv.clone().ok_or_else(|| SlideSparseError::Unsupported {
            what: format!("{what} in a decode graph"),
            why: "it has no GEMV: the graph runs INT8 dense and INT8 6:8 layers without an \
                  input permutation (with SLIDESPARSE_DECODE_GEMV on and \
                  SLIDESPARSE_SPARSE_GEMM=cusparselt: the compact GEMM's layers serve decode \
                  through their GEMM)"
                .into(),
        })?;
        Ok(Self {
            gemv,
            scale: layer.scale.clone(),
            bias: layer.bias.clone(),
        })
    }

    fn n(&self) -> usize {
        self.gemv.n
    }

    fn k(&self) -> usize {
        self.gemv.k
    }
}

/// An RMSNorm: its weight and epsilon.
#[derive(Clone)]
pub struct StepNorm {
    pub gamma: Tensor,
    pub eps: f32,
}

/// The layers and cache of one block.
#[derive(Clone)]
pub struct StepBlock {
    pub attn_norm: StepNorm,
    pub qkv: StepLinear,
    pub o: StepLinear,
    pub mlp_norm: StepNorm,
    pub gate_up: StepLinear,
    pub down: StepLinear,
    /// `[batch, capacity, hkv, d]`, contiguous.
    pub keys: Tensor,
    pub values: Tensor,
}

/// What a step reads.
#[derive(Clone)]
pub struct StepModel {
    /// `[vocab, hidden]`.
    pub embedding: Tensor,
    pub blocks: Vec<StepBlock>,
    pub final_norm: StepNorm,
    /// An INT8 head: the step ends with the logits and the greedy argmax. Without one it ends
    /// with the final norm's output (`Engine::hidden`), and the caller sets the next tokens.
    pub head: Option<StepLinear>,
    /// burn's `RotaryEncoding` table `[max_len, d, 2]`.
    pub rope: Tensor,
    /// Query and key/value heads.
    pub heads: (usize, usize),
    /// Softmax scale (`None`: `1/sqrt(d)`).
    pub scale: Option<f32>,
    /// Sequences decoded together.
    pub batch: usize,
}

/// One launch of the step, its parameter block held as 8-byte words.
#[derive(Clone)]
struct StepLaunch {
    function: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    params: Vec<u64>,
    /// Launched with programmatic stream serialization (a GEMV behind a kernel that allows
    /// it, on sm_90).
    programmatic: bool,
}
// SAFETY: a function of a program loaded for the process, and plain data.
unsafe impl Send for StepLaunch {}

impl StepLaunch {
    fn new<P: Copy>(function: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, p: P) -> Self {
        let words = std::mem::size_of::<P>().div_ceil(8);
        let mut params = vec![0u64; words];
        // SAFETY: `params` holds at least `size_of::<P>()` bytes, 8-byte aligned; `P` is a
        // `repr(C)` block of plain integers and floats.
        unsafe { std::ptr::copy_nonoverlapping(&p as *const P as *const u8, params.as_mut_ptr() as *mut u8, std::mem::size_of::<P>()) };
        Self {
            function,
            grid,
            block,
            smem,
            params,
            programmatic: false,
        }
    }

    /// Enqueues the launch on `stream`.
    ///
    /// # Safety
    /// `stream` is a live stream (or one being captured) of the current context; the
    /// pointers in the parameter block are live device memory of the sizes the kernel uses.
    unsafe fn enqueue(&self, stream: sys::CUstream) -> Result<()> {
        let mut params = self.params.clone();
        let mut args = [params.as_mut_ptr() as *mut c_void];
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: zero is a valid value of every field of the union.
            value: unsafe { std::mem::zeroed() },
        };
        attribute.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: self.grid.0,
            gridDimY: self.grid.1,
            gridDimZ: self.grid.2,
            blockDimX: self.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.smem,
            hStream: stream,
            attrs: &mut attribute,
            numAttrs: self.programmatic as u32,
        };
        // SAFETY: the kernel takes one parameter block by value, `args[0]` points to it; the
        // caller's contract for the rest.
        unsafe { sys::cuLaunchKernelEx(&config, self.function, args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(driver_err("cuLaunchKernelEx (decode step)"))
    }
}

/// Device buffers of the step, held for the engine's life (their pointers are in the
/// launches).
struct Buffers {
    _held: Vec<Handle>,
    tokens: u64,
    position: u64,
    residual: u64,
    qkv: u64,
    q: u64,
    attention: u64,
    workspace: u64,
    o: u64,
    gate_up: u64,
    mlp: u64,
    codes: u64,
    scales: u64,
    hidden: u64,
    logits: u64,
}

/// The sizes of the step, checked once.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: usize,
    hidden: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    ffn: usize,
    vocab: usize,
    capacity: usize,
    /// Bytes per token row of the shared codes buffer.
    codes_stride: usize,
}

/// A captured step graph.
struct Graph(sys::CUgraphExec);
// SAFETY: a graph executable of the device's context; the driver API is thread-safe.
unsafe impl Send for Graph {}
// SAFETY: as above; it is only launched, never changed.
unsafe impl Sync for Graph {}

/// A model's decode step on one GPU, as graphs per cache-length bucket.
pub struct Engine {
    model: StepModel,
    client: Client,
    index: usize,
    bf16: bool,
    programmatic: bool,
    dims: Dims,
    buffers: Buffers,
    /// By the longest cache a graph serves.
    graphs: HashMap<usize, Arc<Graph>>,
    capture_stream: Option<sys::CUstream>,
    /// Cache positions in use before the next step (host mirror of the device's).
    position: usize,
}

// SAFETY: the capture stream is ours and used under `&mut self`; everything else is handles
// and plain data.
unsafe impl Send for Engine {}

/// The smallest bucket: graphs serve caches of up to 256, 512, ... positions.
const MIN_BUCKET: usize = 256;

fn dims_of(model: &StepModel) -> Result<Dims> {
    let unsupported = |why: String| SlideSparseError::Unsupported {
        what: "decode graph".into(),
        why,
    };
    let first = model
        .blocks
        .first()
        .ok_or_else(|| unsupported("a model without blocks".into()))?;
    let embedding = model.embedding.meta.shape();
    let (vocab_embed, hidden) = (embedding[0], embedding[1]);
    let cache = first.keys.meta.shape();
    let (batch, capacity, hkv, d) = (cache[0], cache[1], cache[2], cache[3]);
    let (hq, model_hkv) = model.heads;
    let ffn = first.down.k();
    let vocab = model.head.as_ref().map_or(vocab_embed, |h| h.n());
    if batch != model.batch || model_hkv != hkv || hq % hkv.max(1) != 0 {
        return Err(unsupported(format!(
            "caches [{batch}, {capacity}, {hkv}, {d}] for {} sequences and {hq}/{model_hkv} heads",
            model.batch
        )));
    }
    if !hidden.is_multiple_of(8) || hidden > 8192 || !ffn.is_multiple_of(8) || ffn > QUANT_MAX_WIDTH || !(hq * d).is_multiple_of(8) {
        return Err(unsupported(format!(
            "hidden {hidden}, FFN {ffn}, attention width {}: the fused quantizations take \
             multiples of 8 up to 8192 (norms) and {QUANT_MAX_WIDTH}",
            hq * d
        )));
    }
    let mut codes_stride = hidden.max(ffn).max(hq * d);
    for block in &model.blocks {
        let expect = [
            ("qkv", &block.qkv, hidden, (hq + 2 * hkv) * d),
            ("o", &block.o, hq * d, hidden),
            ("gate_up", &block.gate_up, hidden, 2 * ffn),
            ("down", &block.down, ffn, hidden),
        ];
        for (what, layer, k, n) in expect {
            if layer.k() != k || layer.n() != n {
                return Err(SlideSparseError::shape(
                    format!("decode graph {what} layer [in, out]"),
                    format!("[{k}, {n}]"),
                    format!("[{}, {}]", layer.k(), layer.n()),
                ));
            }
            codes_stride = codes_stride.max(layer.gemv.x_columns());
        }
        for cache in [&block.keys, &block.values] {
            if cache.meta.shape().as_slice() != [batch, capacity, hkv, d] || !cache.is_contiguous() {
                return Err(unsupported("caches of different shapes, or not contiguous".into()));
            }
        }
    }
    if let Some(head) = &model.head {
        if head.k() != hidden {
            return Err(SlideSparseError::shape("decode graph head input", hidden, head.k()));
        }
        codes_stride = codes_stride.max(head.gemv.x_columns());
    }
    let table = model.rope.meta.shape();
    if table[0] < capacity || table[1] != d {
        return Err(unsupported(format!(
            "a RoPE table of {} positions and width {} for caches of {capacity} and head dim {d}",
            table[0], table[1]
        )));
    }
    Ok(Dims {
        batch,
        hidden,
        hq,
        hkv,
        d,
        ffn,
        vocab,
        capacity,
        codes_stride: codes_stride.next_multiple_of(16),
    })
}

/// `bf16` from the dtype every 16-bit tensor of the step shares.
fn sixteen_bit(model: &StepModel) -> Result<bool> {
    let mut dtypes = vec![model.embedding.dtype, model.rope.dtype, model.final_norm.gamma.dtype];
    for b in &model.blocks {
        dtypes.extend([b.attn_norm.gamma.dtype, b.mlp_norm.gamma.dtype, b.keys.dtype, b.values.dtype]);
    }
    if dtypes.iter().all(|d| *d == DType::BF16) {
        Ok(true)
    } else if dtypes.iter().all(|d| *d == DType::F16) {
        Ok(false)
    } else {
        Err(SlideSparseError::Unsupported {
            what: "decode graph".into(),
            why: format!("needs all bf16 or all f16 tensors, got {dtypes:?}"),
        })
    }
}

impl Engine {
    /// The engine of `model`: sizes checked, buffers allocated, nothing captured yet.
    pub fn new(model: StepModel) -> Result<Self> {
        let dims = dims_of(&model)?;
        // Every linear of the step runs the decode GEMV: refuse a batch it cannot take here,
        // not at the first step.
        if dims.batch == 0 || dims.batch > MAX_TOKENS {
            return Err(SlideSparseError::Unsupported {
                what: "decode graph".into(),
                why: format!(
                    "a batch of {} sequences (its linears run the decode GEMV: 1 to {MAX_TOKENS} tokens)",
                    dims.batch
                ),
            });
        }
        let bf16 = sixteen_bit(&model)?;
        let client = model.embedding.client.clone();
        let index = model.embedding.device.index;
        let info = DeviceInfo::of(index)?;
        // One workspace serves every bucket's graph: the largest any bucket needs (the
        // split count is not monotonic in the cache length).
        let mut workspace = 0;
        let mut bucket = MIN_BUCKET.min(dims.capacity);
        loop {
            let heads = (dims.batch, dims.hq, dims.hkv, dims.d);
            workspace = workspace.max(graph_decode(index, bf16, heads, bucket, model.scale)?.2);
            if bucket == dims.capacity {
                break;
            }
            bucket = (2 * bucket).min(dims.capacity);
        }
        check_alignment(&model)?;
        let buffers = Buffers::new(&client, &dims, workspace)?;
        Ok(Self {
            model,
            client,
            index,
            bf16,
            programmatic: info.capability.0 >= 9,
            dims,
            buffers,
            graphs: HashMap::new(),
            capture_stream: None,
            position: 0,
        })
    }

    /// Cache positions in use before the next step.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Whether the step ends with a head and the greedy argmax.
    pub fn has_head(&self) -> bool {
        self.model.head.is_some()
    }

    /// Sets the cache position and the next step's tokens (one per sequence), queued on
    /// burn's stream.
    pub fn set(&mut self, position: usize, tokens: &[u32]) -> Result<()> {
        if tokens.len() != self.dims.batch {
            return Err(SlideSparseError::shape("decode graph tokens", self.dims.batch, tokens.len()));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.model.embedding.meta.shape()[0]) {
            return Err(SlideSparseError::shape(
                "decode graph token (below the vocabulary)",
                self.model.embedding.meta.shape()[0],
                *bad as usize,
            ));
        }
        self.check_room(position)?;
        let (tokens_at, position_at) = (self.buffers.tokens, self.buffers.position);
        let tokens: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let position_value = position as u32;
        self.on_burn_stream(move |stream| {
            // SAFETY: our token and position buffers, alive while the engine is; the host
            // bytes are copied before the call returns (pageable memory).
            unsafe {
                cu::memcpy_htod_async(tokens_at, &tokens, stream).map_err(driver_err("cuMemcpyHtoDAsync"))?;
                sys::cuMemsetD32Async(position_at, position_value, 1, stream)
                    .result()
                    .map_err(driver_err("cuMemsetD32Async"))
            }
        })?;
        self.position = position;
        Ok(())
    }

    /// Sets the cache position alone (the tokens stay: the argmax's, or the last ones set).
    pub fn set_position(&mut self, position: usize) -> Result<()> {
        self.check_room(position)?;
        let position_at = self.buffers.position;
        let value = position as u32;
        self.on_burn_stream(move |stream| {
            // SAFETY: our position buffer, alive while the engine is.
            unsafe { sys::cuMemsetD32Async(position_at, value, 1, stream) }
                .result()
                .map_err(driver_err("cuMemsetD32Async"))
        })?;
        self.position = position;
        Ok(())
    }

    fn check_room(&self, position: usize) -> Result<()> {
        if position >= self.dims.capacity {
            return Err(SlideSparseError::shape(
                "decode graph cache position (below the cache's capacity)",
                self.dims.capacity,
                position,
            ));
        }
        Ok(())
    }

    /// The bucket (longest cache) of a step at `position`.
    fn bucket(&self, position: usize) -> usize {
        (position + 1).next_power_of_two().max(MIN_BUCKET).min(self.dims.capacity)
    }

    /// One step, queued on burn's stream: the step's graph of the current bucket (captured on
    /// first use) replayed. With a head, the next step's tokens and position follow on the
    /// device; without one, call [`set`](Self::set) before the next step.
    pub fn step(&mut self) -> Result<()> {
        self.check_room(self.position)?;
        let bucket = self.bucket(self.position);
        let graph = match self.graphs.get(&bucket) {
            Some(g) => g.clone(),
            None => {
                let launches = self.launches(bucket)?;
                let graph = Arc::new(self.capture(&launches)?);
                self.graphs.insert(bucket, graph.clone());
                graph
            }
        };
        self.on_burn_stream(move |stream| {
            // SAFETY: a live executable of this context (the engine holds it; `graph` is
            // moved into the task), every pointer in it held by the engine.
            unsafe { sys::cuGraphLaunch(graph.0, stream) }
                .result()
                .map_err(driver_err("cuGraphLaunch (decode step)"))
        })?;
        self.position += 1;
        Ok(())
    }

    /// The same step's launches run one by one on burn's stream, without a graph (the tests'
    /// comparison, and what a graph replays).
    pub fn run_direct(&mut self) -> Result<()> {
        self.check_room(self.position)?;
        let launches = self.launches(self.bucket(self.position))?;
        self.on_burn_stream(move |stream| {
            for launch in &launches {
                // SAFETY: burn's stream, on the device thread where the context is current;
                // the engine holds every pointer the launches use.
                unsafe { launch.enqueue(stream)? };
            }
            Ok(())
        })?;
        self.position += 1;
        Ok(())
    }

    /// The next step's tokens (synchronizes burn's stream).
    pub fn tokens(&self) -> Result<Vec<u32>> {
        let bytes = self.read(self.buffers.tokens, 4 * self.dims.batch)?;
        Ok(bytes.chunks(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }

    /// A copy of the last step's final-norm output `[batch, hidden]` (queued, no sync).
    pub fn hidden(&self) -> Result<Tensor> {
        self.copy_out(self.buffers.hidden, [self.dims.batch, self.dims.hidden])
    }

    /// A copy of the last step's logits `[batch, vocab]` (with a head; queued, no sync).
    pub fn logits(&self) -> Result<Tensor> {
        if self.model.head.is_none() {
            return Err(SlideSparseError::Unsupported {
                what: "decode graph logits".into(),
                why: "the graph has no head; take `hidden` and apply the head".into(),
            });
        }
        self.copy_out(self.buffers.logits, [self.dims.batch, self.dims.vocab])
    }

    /// Graphs captured so far (one per cache-length bucket used).
    pub fn graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Kernel launches of one step.
    pub fn launches_per_step(&self) -> Result<usize> {
        Ok(self.launches(MIN_BUCKET.min(self.dims.capacity))?.len())
    }

    fn copy_out(&self, from: u64, shape: [usize; 2]) -> Result<Tensor> {
        let dtype = if self.bf16 { DType::BF16 } else { DType::F16 };
        let bytes = shape[0] * shape[1] * 2;
        let out = self.client.empty(bytes);
        let to = device_ptr(&self.client, &out)?;
        self.on_burn_stream(move |stream| {
            // SAFETY: both buffers are live allocations of at least `bytes`.
            unsafe { cu::memcpy_dtod_async(to, from, bytes, stream) }.map_err(driver_err("cuMemcpyDtoDAsync"))
        })?;
        Ok(CubeTensor::new_contiguous(
            self.client.clone(),
            self.model.embedding.device.clone(),
            burn::tensor::Shape::new(shape),
            out,
            dtype,
        ))
    }

    fn read(&self, from: u64, bytes: usize) -> Result<Vec<u8>> {
        sync_burn_stream(&self.client)?;
        lanes(self.index)?.lock().unwrap_or_else(|e| e.into_inner()).context().make_current()?;
        let mut out = vec![0u8; bytes];
        // SAFETY: a live buffer of at least `bytes`; burn's stream is drained above.
        unsafe { cu::memcpy_dtoh_sync(&mut out, from) }.map_err(driver_err("cuMemcpyDtoH"))?;
        Ok(out)
    }

    /// Runs `enqueue(stream)` in burn's stream order of the current cubecl stream: queued on
    /// the device thread (no wait) where burn's stream is known, else host-ordered.
    fn on_burn_stream(&self, enqueue: impl FnOnce(sys::CUstream) -> Result<()> + Send + 'static) -> Result<()> {
        let lanes = lanes(self.index)?;
        let mut lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
        let context = lanes.context();
        let (lane, device_thread) = lanes.current_and_device_thread();
        match lane.burn_stream(&self.client) {
            Ok(stream) => {
                let stream = stream as usize;
                queue_task(device_thread, move |_server| enqueue(stream as sys::CUstream));
                Ok(())
            }
            Err(_) => {
                let stream = lane.host_stream(&context)?;
                drop(lanes);
                sync_burn_stream(&self.client)?;
                context.make_current()?;
                enqueue(stream.raw())?;
                // SAFETY: the lane's stream, alive (held by `stream`).
                unsafe { synchronize(stream.raw()) }
            }
        }
    }

    /// Captures `launches` into an executable graph on a stream of ours.
    fn capture(&mut self, launches: &[StepLaunch]) -> Result<Graph> {
        let lanes = lanes(self.index)?;
        lanes.lock().unwrap_or_else(|e| e.into_inner()).context().make_current()?;
        let stream = match self.capture_stream {
            Some(s) => s,
            None => *self.capture_stream.insert(create_stream()?),
        };
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: our own idle stream.
        unsafe { cu::stream::begin_capture(stream, mode) }.map_err(driver_err("cuStreamBeginCapture"))?;
        // SAFETY: captured, not run; the pointers stay held by the engine for the graph's life.
        let enqueued = launches.iter().try_for_each(|l| unsafe { l.enqueue(stream) });
        // Always end the capture, so that the stream is usable whatever happened.
        // SAFETY: as above.
        let graph = unsafe { cu::stream::end_capture(stream) }.map_err(driver_err("cuStreamEndCapture"));
        enqueued?;
        let graph = graph?;
        // SAFETY: `graph` was just captured; it is destroyed once instantiated.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(driver_err("cuGraphInstantiate"));
        // SAFETY: as above.
        unsafe { cu::graph::destroy(graph) }.map_err(driver_err("cuGraphDestroy"))?;
        Ok(Graph(exec?))
    }

    /// Every launch of a step whose cache holds up to `bucket` positions.
    fn launches(&self, bucket: usize) -> Result<Vec<StepLaunch>> {
        let (m, d, b) = (&self.model, self.dims, &self.buffers);
        let (norm, rope) = norm_and_rope(self.index, self.bf16)?;
        let step = step_functions(self.index, self.bf16)?;
        let dtype = if self.bf16 { DType::BF16 } else { DType::F16 };
        let rows = d.batch as i32;
        let mut out = Vec::with_capacity(12 * m.blocks.len() + 4);
        out.push(StepLaunch::new(
            step.embed,
            (d.batch as u32, 1, 1),
            EMBED_THREADS,
            0,
            EmbedParams {
                tokens: b.tokens,
                table: ptr(&self.client, &m.embedding.handle)?,
                out: b.residual,
                rows,
                width: d.hidden as i32,
                vocab: m.embedding.meta.shape()[0] as i32,
            },
        ));
        let norm_launch = |gamma: &StepNorm, delta: u64, out_at: u64| -> Result<StepLaunch> {
            Ok(StepLaunch::new(
                norm,
                (d.batch as u32, 1, 1),
                NORM_THREADS,
                0,
                NormParams {
                    x: b.residual,
                    delta,
                    gamma: ptr(&self.client, &gamma.gamma.handle)?,
                    sum: if delta != 0 { b.residual } else { 0 },
                    out: out_at,
                    rows,
                    width: d.hidden as i32,
                    eps: gamma.eps,
                    codes: b.codes,
                    scales: b.scales,
                    codes_stride: d.codes_stride as i32,
                },
            ))
        };
        // One CTA per row quantizing `width` values of `x` (plain, or the SiLU-gated product).
        let quant_launch = |function, x: u64, width: usize| {
            let params = ActQuantParams {
                x,
                out: 0,
                codes: b.codes,
                scales: b.scales,
                rows,
                width: width as i32,
                codes_stride: d.codes_stride as i32,
            };
            StepLaunch::new(function, (d.batch as u32, 1, 1), QUANT_THREADS, 0, params)
        };
        let gemv_launch = |layer: &StepLinear, y: u64| -> Result<StepLaunch> {
            let prefetch = layer.gemv.weight_bytes() <= 32 << 20 && self.programmatic;
            let flags = if prefetch { FLAG_PREFETCH } else { 0 };
            let (launch, params) = layer.gemv.launch(self.index, d.batch, dtype, flags)?;
            let params = GemvParams {
                x: b.codes,
                sx: b.scales,
                sw: ptr(&self.client, &layer.scale)?,
                bias: layer.bias.as_ref().map(|h| ptr(&self.client, h)).transpose()?.unwrap_or(0),
                y,
                x_stride: d.codes_stride as i32,
                y_stride: layer.n() as i32,
                ..params
            };
            let mut l = StepLaunch::new(launch.function, launch.grid, launch.block, launch.smem, params);
            l.programmatic = self.programmatic;
            Ok(l)
        };
        let (attention, attention_params, _) = graph_decode(self.index, self.bf16, (d.batch, d.hq, d.hkv, d.d), bucket, m.scale)?;
        let table_strides = {
            let s = m.rope.meta.strides();
            [s[0] as i64, s[1] as i64, s[2] as i64]
        };
        let rope_table = ptr(&self.client, &m.rope.handle)?;
        let rows_q = d.batch * d.hq;
        for (i, block) in m.blocks.iter().enumerate() {
            let (keys, values) = (ptr(&self.client, &block.keys.handle)?, ptr(&self.client, &block.values.handle)?);
            // The residual stream plus the previous block's MLP output (the first block's norm
            // reads the embedding as it is).
            out.push(norm_launch(&block.attn_norm, if i == 0 { 0 } else { b.mlp }, 0)?);
            out.push(gemv_launch(&block.qkv, b.qkv)?);
            out.push(StepLaunch::new(
                rope,
                (d.batch as u32, (d.hq + 2 * d.hkv) as u32, 1),
                (d.d / 2) as u32,
                0,
                RopeParams {
                    qkv: b.qkv,
                    table: rope_table,
                    q: b.q,
                    k: keys,
                    v: values,
                    batch: rows,
                    t: 1,
                    hq: d.hq as i32,
                    hkv: d.hkv as i32,
                    d: d.d as i32,
                    start: 0,
                    capacity: d.capacity as i32,
                    table_strides,
                    start_at: b.position,
                },
            ));
            let cache_batch = (d.capacity * d.hkv * d.d) as i64;
            let params = AttentionParams {
                q: b.q,
                k: keys,
                v: values,
                o: b.attention,
                partial: b.workspace,
                lse: b.workspace + (attention_params.splits as usize * rows_q * d.d * 4) as u64,
                q_batch: (d.hq * d.d) as i64,
                q_row: (d.hq * d.d) as i64,
                k_batch: cache_batch,
                k_row: (d.hkv * d.d) as i64,
                v_batch: cache_batch,
                v_row: (d.hkv * d.d) as i64,
                kv_len_at: b.position,
                ..attention_params
            };
            for l in &attention {
                out.push(StepLaunch::new(l.function, l.grid, l.block, l.smem, params));
            }
            out.push(quant_launch(step.quant_rows, b.attention, d.hq * d.d));
            out.push(gemv_launch(&block.o, b.o)?);
            out.push(norm_launch(&block.mlp_norm, b.o, 0)?);
            out.push(gemv_launch(&block.gate_up, b.gate_up)?);
            out.push(quant_launch(step.silu_mul_quant, b.gate_up, d.ffn));
            out.push(gemv_launch(&block.down, b.mlp)?);
        }
        out.push(norm_launch(&m.final_norm, b.mlp, b.hidden)?);
        if let Some(head) = &m.head {
            out.push(gemv_launch(head, b.logits)?);
            out.push(StepLaunch::new(
                step.argmax,
                (d.batch as u32, 1, 1),
                ARGMAX_THREADS,
                0,
                ArgmaxParams {
                    logits: b.logits,
                    tokens: b.tokens,
                    advance: b.position,
                    rows,
                    vocab: d.vocab as i32,
                    by: 1,
                },
            ));
        }
        Ok(out)
    }
}

/// The 16-bit tensors the fused norms and the embedding read with 16-byte loads must start on
/// 16 bytes (the norm kernel's quantizing path has no scalar fallback).
fn check_alignment(model: &StepModel) -> Result<()> {
    let client = &model.embedding.client;
    let mut tensors = vec![("embedding", &model.embedding), ("final norm", &model.final_norm.gamma)];
    for b in &model.blocks {
        tensors.extend([("attention norm", &b.attn_norm.gamma), ("MLP norm", &b.mlp_norm.gamma)]);
    }
    for (what, t) in tensors {
        let at = device_ptr(client, &t.handle)?;
        if at % 16 != 0 || !t.is_contiguous() {
            return Err(SlideSparseError::Unsupported {
                what: format!("decode graph {what}"),
                why: "not a contiguous tensor starting on 16 bytes (make it contiguous)".into(),
            });
        }
    }
    Ok(())
}

/// The device pointer of a handle the engine holds (stable while it is held).
fn ptr(client: &Client, handle: &Handle) -> Result<u64> {
    device_ptr(client, handle)
}

impl Buffers {
    fn new(client: &Client, d: &Dims, workspace: usize) -> Result<Self> {
        let mut held = Vec::new();
        let mut alloc = |bytes: usize, zeroed: bool| -> Result<u64> {
            let bytes = bytes.max(16).next_multiple_of(16);
            let handle = if zeroed { client.create_from_slice(&vec![0u8; bytes]) } else { client.empty(bytes) };
            let p = device_ptr(client, &handle)?;
            if p % 16 != 0 {
                return Err(SlideSparseError::Unsupported {
                    what: "decode graph buffer".into(),
                    why: format!("cubecl returned a buffer at {p:#x}, not on 16 bytes"),
                });
            }
            held.push(handle);
            Ok(p)
        };
        let rows = d.batch;
        Ok(Self {
            tokens: alloc(4 * rows, true)?,
            position: alloc(4, true)?,
            residual: alloc(2 * rows * d.hidden, false)?,
            qkv: alloc(2 * rows * (d.hq + 2 * d.hkv) * d.d, false)?,
            q: alloc(2 * rows * d.hq * d.d, false)?,
            attention: alloc(2 * rows * d.hq * d.d, false)?,
            workspace: alloc(workspace, false)?,
            o: alloc(2 * rows * d.hidden, false)?,
            gate_up: alloc(2 * rows * 2 * d.ffn, false)?,
            mlp: alloc(2 * rows * d.hidden, false)?,
            // Zeroed once: the GEMVs of compact layers read up to K padded to 64, past what a
            // norm or quantization writes (their weights there are zero).
            codes: alloc(rows * d.codes_stride, true)?,
            scales: alloc(4 * rows, false)?,
            hidden: alloc(2 * rows * d.hidden, false)?,
            logits: alloc(2 * rows * d.vocab, false)?,
            _held: held,
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The graphs may still be queued for replay: destroy them behind everything queued.
        let graphs: Vec<Arc<Graph>> = self.graphs.drain().map(|(_, g)| g).collect();
        let stream = self.capture_stream.take().map(|s| s as usize);
        if graphs.is_empty() && stream.is_none() {
            return;
        }
        let task = move |_stream: sys::CUstream| {
            for graph in graphs {
                if let Ok(graph) = Arc::try_unwrap(graph) {
                    // SAFETY: no replay of it is queued behind this task.
                    let _ = unsafe { sys::cuGraphExecDestroy(graph.0) };
                }
            }
            if let Some(s) = stream {
                // SAFETY: our capture stream, idle.
                let _ = unsafe { sys::cuStreamDestroy_v2(s as sys::CUstream) };
            }
            Ok(())
        };
        let _ = self.on_burn_stream(task);
    }
}
