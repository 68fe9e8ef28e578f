//! Causal flash attention on the GPU: prefill (FlashAttention-2 style, tensor cores) and
//! decode (flash-decoding: the cache split over CTAs, then one merge), for bf16 and f16 with
//! f32 accumulation, grouped-query attention read natively, head dims 64 and 128.
//!
//! The kernels are CUDA C of this repository (`kernels/attention.cu`), compiled once per
//! device (`nvrtc_module.rs`). A call checks the shapes, allocates its output (and the decode
//! merge's workspace) from cubecl's pool and submits its launches in burn's stream order
//! (`queued::submit`): no host synchronization, no compilation per call. A launch that fails
//! on cubecl's device thread NaN-fills the output and is reported by the calling stream's
//! next call (`crate::deferred`).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering as AtomicOrdering},
    },
};

use burn::tensor::{DType, Shape};
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::server::Handle;
use cudarc::driver::sys;

use super::{
    nvrtc_module::{LoadedProgram, Program},
    queued::{Call, Launch, Lanes, lanes, submit},
    runtime::{PerDevice, Runtime},
};
use crate::{
    attention_shape::AttentionShape,
    deferred,
    error::{Result, SlideSparseError},
};

/// The attention kernels' program.
pub(super) const PROGRAM: Program = Program {
    name: "attention",
    files: &["attention.cu"],
    min_capability: (8, 0),
    arch_specific: false,
};

/// Query and key rows per tile of both kernels.
const TILE: usize = 64;
/// Threads per CTA of the prefill and decode kernels (4 warps).
const THREADS: u32 = 128;
/// Rows of one MMA tile: the decode kernel's rows (query heads of a group x queries).
const DECODE_ROWS: usize = 16;

/// The kernels' parameter block; must match `struct Params` in `kernels/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Params {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub partial: u64,
    pub lse: u64,
    pub q_batch: i64,
    pub q_row: i64,
    pub k_batch: i64,
    pub k_row: i64,
    pub v_batch: i64,
    pub v_row: i64,
    pub batch: i32,
    pub tq: i32,
    pub kv_len: i32,
    pub hq: i32,
    pub hkv: i32,
    pub splits: i32,
    pub split_len: i32,
    pub scale_log2: f32,
    /// 0, or where a graph-replayed decode reads the cache's positions before this call (its
    /// length is that plus `kv_len`).
    pub kv_len_at: u64,
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

/// The attention kernels of one device.
struct Kernels {
    /// By (bf16, head dim).
    variants: HashMap<(bool, usize), Variant>,
    /// Streaming multiprocessors: how many CTAs the decode split aims at.
    sm_count: usize,
    /// The device's lanes, which order the launches.
    lanes: Arc<Mutex<Lanes>>,
}

// SAFETY: function handles of a program loaded for the process, immutable after loading;
// launches use them with the device's context current.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// Shared memory of a prefill CTA of `rows` queries: the Q tile and two stages of (K, V)
/// tiles of 64 keys.
fn prefill_smem(rows: usize, d: usize) -> usize {
    (rows + 4 * TILE) * d * 2
}

/// Queries per prefill CTA: 64 (4 warps, two CTAs per SM) or 128 (8 warps, one CTA per SM,
/// half the K/V reads from L2).
static PREFILL_ROWS: AtomicUsize = AtomicUsize::new(64);

/// Chooses the prefill kernel's query tile, 64 or 128 rows (benchmarks compare them).
#[cfg(feature = "internals")]
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

/// The kernels of device `index`, compiled on first use.
fn kernels(index: usize) -> Result<Arc<Kernels>> {
    static KERNELS: PerDevice<Kernels> = PerDevice::new();
    KERNELS.get_or_try_init(index, || {
        let program = LoadedProgram::load(index, &PROGRAM)?;
        let mut variants = HashMap::new();
        for (bf16, name) in [(true, "bf16"), (false, "f16")] {
            for d in [64, 128] {
                let function = |kernel: &str, smem| program.function(&format!("{kernel}_{name}_{d}"), smem);
                let variant = Variant {
                    prefill: function("attn_prefill", prefill_smem(64, d))?,
                    prefill_wide: function("attn_prefill128", prefill_smem(128, d))?,
                    decode: function("attn_decode", decode_smem(d))?,
                    reduce: function("attn_reduce", 0)?,
                };
                variants.insert((bf16, d), variant);
            }
        }
        Ok(Kernels {
            variants,
            sm_count: program.info.sm_count,
            lanes: lanes(index)?,
        })
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

/// Compiles and loads the kernels of device `index` if they are not yet (a fused operation
/// does this before it is queued, so that its execution has nothing left to fail on but the
/// launches).
pub fn prepare(index: usize) -> Result<()> {
    kernels(index).map(|_| ())
}

/// Waves of decode CTAs (two resident per SM) the split aims at: more waves balance the tail
/// of long caches, fewer give each CTA more tiles to pipeline against its fixed cost. One
/// wave measured as fast or faster in every decode case of the benchmark (b1 x 4096: 29
/// against 34 us; b1 x 32768: 2.27 against 1.74 TB/s; b16 x 32768 within 1%).
static DECODE_WAVES: AtomicUsize = AtomicUsize::new(1);

/// Chooses how many waves of CTAs the decode split aims at, 1 to 8 (benchmarks compare them).
#[cfg(feature = "internals")]
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

/// The launches of a decode step's attention inside a CUDA graph (`decode_graph.rs`):
/// one query per sequence over a cache of up to `longest` positions whose length is read on
/// the device (`Params::kv_len_at`), the split sized for `longest` (shorter caches leave the
/// last splits empty). Returns the launches, the parameter block without its pointers, and the
/// bytes of the merge's workspace. `bf16` or f16, head dim 64 or 128.
pub(crate) fn graph_decode(
    index: usize,
    bf16: bool,
    (batch, hq, hkv, d): (usize, usize, usize, usize),
    longest: usize,
    scale: Option<f32>,
) -> Result<(Vec<Launch>, Params, usize)> {
    let shape = AttentionShape {
        batch,
        tq: 1,
        kv_len: longest,
        hq,
        hkv,
        d,
    };
    if !is_decode(&shape) || !matches!(d, 64 | 128) {
        return Err(SlideSparseError::Unsupported {
            what: "decode attention in a graph".into(),
            why: format!("{} query heads per KV head, head dim {d}", hq / hkv.max(1)),
        });
    }
    let kernels = kernels(index)?;
    let variant = kernels.variants[&(bf16, d)];
    let (splits, split_len) = decode_split(&shape, kernels.sm_count);
    let rows = batch * hq;
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    let params = Params {
        batch: batch as i32,
        tq: 1,
        kv_len: 1,
        hq: hq as i32,
        hkv: hkv as i32,
        splits: splits as i32,
        split_len: split_len as i32,
        scale_log2: scale * std::f32::consts::LOG2_E,
        ..Default::default()
    };
    let mut launches = vec![Launch {
        function: variant.decode,
        grid: (splits as u32, hkv as u32, batch as u32),
        block: THREADS,
        smem: decode_smem(d) as u32,
    }];
    if splits > 1 {
        launches.push(Launch {
            function: variant.reduce,
            grid: (rows as u32, 1, 1),
            block: d as u32,
            smem: (splits * 4) as u32,
        });
    }
    Ok((launches, params, splits * rows * (d + 1) * 4))
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
    deferred::take_current()?;
    let dims = |t: &CubeTensor<Runtime>| -> Result<[usize; 4]> {
        let s = t.meta.shape();
        s.as_slice()
            .try_into()
            .map_err(|_| SlideSparseError::shape("attention tensor rank", 4, s.num_dims()))
    };
    let shape = AttentionShape::new(dims(&q)?, dims(&k)?, dims(&v)?, kv_len)?;
    let bf16 = check_supported(&shape, [q.dtype, k.dtype, v.dtype])?;
    let index = q.device.index;
    let kernels = kernels(index)?;
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
    submit(&kernels.lanes, &client, params, launches, buffers)?;
    Ok(CubeTensor::new_contiguous(
        client,
        q.device.clone(),
        out_shape,
        out,
        q.dtype,
    ))
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
