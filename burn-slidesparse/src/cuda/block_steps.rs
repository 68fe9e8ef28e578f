//! The steps of a transformer block between its linears, on cubecl-cuda tensors: RMSNorm
//! with the residual add (`kernels/rms_norm.cu`), the SiLU-gated product
//! (`kernels/silu_mul.cu`), and RoPE with the KV-cache write (`kernels/rope_cache.cu`)
//! followed by the attention. Each call checks the shapes, allocates its outputs from
//! cubecl's pool and submits one launch in burn's stream order (`queued::submit`; RoPE: its
//! launch, then the attention's). A launch that fails on cubecl's device thread NaN-fills the
//! outputs and is reported by the calling stream's next call (`crate::deferred`).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use burn::tensor::{DType, Shape};
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};
use cubecl::server::Handle;
use cudarc::driver::sys;

use super::{
    attention::causal_attention,
    nvrtc_module::{LoadedProgram, Program},
    queued::{Call, Launch, Lanes, lanes, submit},
    runtime::{PerDevice, Runtime},
};
use crate::{
    attention_shape::qkv_head_dim,
    deferred,
    error::{Result, SlideSparseError},
};

/// The block steps' program.
pub(super) const PROGRAM: Program = Program {
    name: "block step",
    files: &["rms_norm.cu", "silu_mul.cu", "rope_cache.cu"],
    min_capability: (8, 0),
    arch_specific: false,
};

/// The kernels of one dtype.
#[derive(Clone, Copy)]
struct Functions {
    rms_norm: sys::CUfunction,
    silu_mul: sys::CUfunction,
    rope_cache: sys::CUfunction,
}

/// The block steps' kernels of one device.
struct Kernels {
    /// By bf16.
    functions: HashMap<bool, Functions>,
    /// Streaming multiprocessors: the SiLU kernel's grid is capped at a few waves of them.
    sm_count: usize,
    /// The device's lanes, which order the launches.
    lanes: Arc<Mutex<Lanes>>,
}

// SAFETY: function handles of a program loaded for the process, immutable after loading;
// launches use them with the device's context current.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// The kernels of device `index`, compiled on first use.
fn kernels(index: usize) -> Result<Arc<Kernels>> {
    static KERNELS: PerDevice<Kernels> = PerDevice::new();
    KERNELS.get_or_try_init(index, || {
        let program = LoadedProgram::load(index, &PROGRAM)?;
        let mut functions = HashMap::new();
        for (bf16, name) in [(true, "bf16"), (false, "f16")] {
            let function = |kernel: &str| program.function(&format!("{kernel}_{name}"), 0);
            let of_dtype = Functions {
                rms_norm: function("rms_norm")?,
                silu_mul: function("silu_mul")?,
                rope_cache: function("rope_cache")?,
            };
            functions.insert(bf16, of_dtype);
        }
        Ok(Kernels {
            functions,
            sm_count: program.info.sm_count,
            lanes: lanes(index)?,
        })
    })
}

/// Compiles and loads the kernels of device `index` if they are not yet (a fused operation
/// does this before it is queued, so that its execution has nothing left to fail on but the
/// launches).
pub fn prepare(index: usize) -> Result<()> {
    kernels(index).map(|_| ())
}

/// Threads of an RMSNorm CTA (`NORM_THREADS` in `kernels/rms_norm.cu`).
pub(crate) const NORM_THREADS: u32 = 256;

/// The RMSNorm and RoPE kernels of device `index` for bf16 (or f16), for a decode step's
/// graph (`decode_graph.rs`), which launches them with its own parameter blocks.
pub(crate) fn norm_and_rope(index: usize, bf16: bool) -> Result<(sys::CUfunction, sys::CUfunction)> {
    let functions = kernels(index)?.functions[&bf16];
    Ok((functions.rms_norm, functions.rope_cache))
}

/// Must match `NormParams` in `kernels/rms_norm.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormParams {
    pub x: u64,
    pub delta: u64,
    pub gamma: u64,
    pub sum: u64,
    pub out: u64,
    pub rows: i32,
    pub width: i32,
    pub eps: f32,
    /// 0, or the normed rows' INT8 codes `[rows, codes_stride]` and their f32 scales (a decode
    /// step's quantization fused into the norm; the vector path only: width a multiple of 8
    /// up to 8192, 16-byte aligned rows).
    pub codes: u64,
    pub scales: u64,
    pub codes_stride: i32,
}

/// Must match `GateParams` in `kernels/silu_mul.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GateParams {
    x: u64,
    out: u64,
    rows: i64,
    width: i32,
}

/// Must match `RopeParams` in `kernels/rope_cache.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RopeParams {
    pub qkv: u64,
    pub table: u64,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub batch: i32,
    pub t: i32,
    pub hq: i32,
    pub hkv: i32,
    pub d: i32,
    pub start: i32,
    pub capacity: i32,
    /// The table's strides in elements: it is read where it stands, however it is laid out
    /// (burn's `RotaryEncoding` builds a strided one, and a copy of all `max_len` rows per
    /// call cost more than the rest of the step).
    pub table_strides: [i64; 3],
    /// 0, or where a graph-replayed step reads `start` on the device.
    pub start_at: u64,
}

type Tensor = CubeTensor<Runtime>;

/// `Ok(bf16)` when every tensor is bf16 or every one f16.
fn sixteen_bit(what: &str, tensors: &[&Tensor]) -> Result<bool> {
    let dtypes: Vec<DType> = tensors.iter().map(|t| t.dtype).collect();
    match dtypes.as_slice() {
        [DType::BF16, rest @ ..] if rest.iter().all(|d| *d == DType::BF16) => Ok(true),
        [DType::F16, rest @ ..] if rest.iter().all(|d| *d == DType::F16) => Ok(false),
        _ => Err(SlideSparseError::Unsupported {
            what: what.into(),
            why: format!("needs all bf16 or all f16 tensors, got {dtypes:?}"),
        }),
    }
}

fn contiguous(t: Tensor) -> Tensor {
    if t.is_contiguous() { t } else { into_contiguous(t) }
}

fn too_large(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| SlideSparseError::Unsupported {
        what: what.into(),
        why: format!("{n} exceeds 2^31"),
    })
}

/// Handles of an RMSNorm call.
struct NormCall {
    x: Handle,
    delta: Option<Handle>,
    gamma: Handle,
    sum: Option<Handle>,
    out: Handle,
    len: usize,
}

impl Call for NormCall {
    type Params = NormParams;

    fn resolve(
        &self,
        p: &mut NormParams,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()> {
        p.x = ptr(&self.x)?;
        p.gamma = ptr(&self.gamma)?;
        p.out = ptr(&self.out)?;
        if let (Some(delta), Some(sum)) = (&self.delta, &self.sum) {
            p.delta = ptr(delta)?;
            p.sum = ptr(sum)?;
        }
        Ok(())
    }

    fn outputs(&self, p: &NormParams) -> Vec<(u64, usize)> {
        vec![(p.out, self.len), (p.sum, self.len)]
    }
}

/// RMSNorm over the last dimension of `x` (any rank), after adding `delta` (same shape) if
/// given: returns `(x + delta, norm(x + delta) * gamma)`, the sum rounded to the dtype first
/// (the residual stream the model keeps); without `delta`, `(None, norm(x) * gamma)`.
pub fn rms_norm(
    x: Tensor,
    delta: Option<Tensor>,
    gamma: Tensor,
    eps: f64,
) -> Result<(Option<Tensor>, Tensor)> {
    deferred::take_current()?;
    let mut inputs = vec![&x, &gamma];
    inputs.extend(delta.as_ref());
    let bf16 = sixteen_bit("fused RMSNorm", &inputs)?;
    let shape = x.meta.shape().clone();
    let width = *shape.as_slice().last().unwrap_or(&0);
    if width == 0 || gamma.meta.shape().num_elements() != width {
        return Err(SlideSparseError::shape(
            "RMSNorm gamma (the input's last dimension)",
            width,
            gamma.meta.shape().num_elements(),
        ));
    }
    if let Some(d) = &delta
        && d.meta.shape() != &shape
    {
        return Err(SlideSparseError::shape(
            "RMSNorm residual",
            format!("{shape:?}"),
            format!("{:?}", d.meta.shape()),
        ));
    }
    let len = shape.num_elements();
    let rows = too_large("fused RMSNorm rows", len / width)?;
    let width_i32 = too_large("fused RMSNorm width", width)?;
    let index = x.device.index;
    let kernels = kernels(index)?;
    let client = x.client.clone();
    let (x, gamma, delta) = (contiguous(x), contiguous(gamma), delta.map(contiguous));
    let out = client.empty(len * 2);
    let sum = delta.as_ref().map(|_| client.empty(len * 2));
    let launch = Launch {
        function: kernels.functions[&bf16].rms_norm,
        grid: (rows as u32, 1, 1),
        block: NORM_THREADS,
        smem: 0,
    };
    let params = NormParams {
        rows,
        width: width_i32,
        eps: eps as f32,
        ..Default::default()
    };
    let call = NormCall {
        x: x.handle.clone(),
        delta: delta.as_ref().map(|d| d.handle.clone()),
        gamma: gamma.handle.clone(),
        sum: sum.clone(),
        out: out.clone(),
        len,
    };
    submit(&kernels.lanes, &client, params, vec![launch], call)?;
    let wrap = |h| Tensor::new_contiguous(client.clone(), x.device.clone(), shape.clone(), h, x.dtype);
    Ok((sum.map(wrap), wrap(out)))
}

/// Handles of a gated-product call.
struct GateCall {
    x: Handle,
    out: Handle,
    len: usize,
}

impl Call for GateCall {
    type Params = GateParams;

    fn resolve(
        &self,
        p: &mut GateParams,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()> {
        p.x = ptr(&self.x)?;
        p.out = ptr(&self.out)?;
        Ok(())
    }

    fn outputs(&self, p: &GateParams) -> Vec<(u64, usize)> {
        vec![(p.out, self.len)]
    }
}

/// `silu(gate) * up` of `x [.., 2 * f] = [gate | up]`: `[.., f]`.
pub fn silu_mul(x: Tensor) -> Result<Tensor> {
    deferred::take_current()?;
    let bf16 = sixteen_bit("fused SiLU-gated product", &[&x])?;
    let mut shape = x.meta.shape().clone();
    let last = shape.num_dims() - 1;
    let full = shape[last];
    if full == 0 || !full.is_multiple_of(2) {
        return Err(SlideSparseError::shape(
            "SiLU-gated product input (an even last dimension: gate then up)",
            "an even width",
            full,
        ));
    }
    let width = full / 2;
    shape[last] = width;
    let len = shape.num_elements();
    let index = x.device.index;
    let kernels = kernels(index)?;
    let client = x.client.clone();
    let x = contiguous(x);
    let out = client.empty(len * 2);
    let threads = 256;
    let blocks = len.div_ceil(threads).clamp(1, 8 * kernels.sm_count);
    let launch = Launch {
        function: kernels.functions[&bf16].silu_mul,
        grid: (blocks as u32, 1, 1),
        block: threads as u32,
        smem: 0,
    };
    let params = GateParams {
        rows: (len / width) as i64,
        width: too_large("SiLU-gated product width", width)?,
        ..Default::default()
    };
    let call = GateCall {
        x: x.handle.clone(),
        out: out.clone(),
        len,
    };
    submit(&kernels.lanes, &client, params, vec![launch], call)?;
    Ok(Tensor::new_contiguous(client, x.device.clone(), shape, out, x.dtype))
}

/// Handles of a RoPE + cache-write call.
struct RopeCall {
    qkv: Handle,
    table: Handle,
    q: Handle,
    k: Handle,
    v: Handle,
    q_len: usize,
}

impl Call for RopeCall {
    type Params = RopeParams;

    fn resolve(
        &self,
        p: &mut RopeParams,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()> {
        p.qkv = ptr(&self.qkv)?;
        p.table = ptr(&self.table)?;
        p.q = ptr(&self.q)?;
        p.k = ptr(&self.k)?;
        p.v = ptr(&self.v)?;
        Ok(())
    }

    fn outputs(&self, p: &RopeParams) -> Vec<(u64, usize)> {
        vec![(p.q, self.q_len)]
    }
}

/// The strides of the RoPE table `[max_len, d, 2]` (rank checked by `rope_shape`) in
/// elements, for the kernel to read it where it stands.
fn table_strides(table: &Tensor) -> [i64; 3] {
    let s = table.meta.strides();
    [s[0] as i64, s[1] as i64, s[2] as i64]
}

/// The sizes of a RoPE + cache + attention call: `(batch, t, head dim, capacity)`, checked.
fn rope_shape(
    qkv: &Tensor,
    table: &Tensor,
    cache: [&Tensor; 2],
    start: usize,
    (hq, hkv): (usize, usize),
) -> Result<[usize; 4]> {
    let dims = |t: &Tensor, rank: usize, what: &str| -> Result<Vec<usize>> {
        let s = t.meta.shape();
        if s.num_dims() != rank {
            return Err(SlideSparseError::shape(what, rank, s.num_dims()));
        }
        Ok(s.as_slice().to_vec())
    };
    let q = dims(qkv, 3, "qkv rank")?;
    let [batch, t, width] = [q[0], q[1], q[2]];
    let d = qkv_head_dim(width, (hq, hkv))?;
    let k = dims(cache[0], 4, "key cache rank")?;
    let capacity = k[1];
    for (c, name) in cache.iter().zip(["key cache", "value cache"]) {
        if c.meta.shape().as_slice() != [batch, capacity, hkv, d] || !c.is_contiguous() {
            return Err(SlideSparseError::shape(
                "KV cache (contiguous [batch, capacity, kv heads, head dim])",
                format!("[{batch}, {capacity}, {hkv}, {d}] ({name})"),
                format!("{:?}", c.meta.shape()),
            ));
        }
    }
    let table_dims = dims(table, 3, "RoPE table rank")?;
    let end = start + t;
    if table_dims[1..] != [d, 2] || end > table_dims[0] || end > capacity || t == 0 {
        return Err(SlideSparseError::shape(
            "positions (start + t within the cache and the RoPE table [max_len, d, 2])",
            format!("{end} <= {capacity}, table [>= {end}, {d}, 2]"),
            format!("table {table_dims:?}"),
        ));
    }
    Ok([batch, t, d, capacity])
}

/// RoPE on the q and k heads of `qkv [batch, t, (hq + 2 hkv) d]` (burn's
/// `RotaryEncoding::apply` at positions `start..start + t`, `table` its `freq_complex`),
/// k and v written into the caches `[batch, capacity, hkv, d]` **in place** at those
/// positions, then causal attention of the rotated q over the cache's first `start + t`
/// positions: `[batch, t, hq * d]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_attention(
    qkv: Tensor,
    table: Tensor,
    keys: Tensor,
    values: Tensor,
    start: usize,
    heads: (usize, usize),
    scale: Option<f32>,
) -> Result<Tensor> {
    deferred::take_current()?;
    let bf16 = sixteen_bit("fused RoPE + cache write", &[&qkv, &table, &keys, &values])?;
    let [batch, t, d, capacity] = rope_shape(&qkv, &table, [&keys, &values], start, heads)?;
    let (hq, hkv) = heads;
    let index = qkv.device.index;
    let kernels = kernels(index)?;
    let client = qkv.client.clone();
    let qkv = contiguous(qkv);
    let table_strides = table_strides(&table);
    let q_len = batch * t * hq * d;
    let q = client.empty(q_len * 2);
    let launch = Launch {
        function: kernels.functions[&bf16].rope_cache,
        grid: (
            too_large("fused RoPE tokens", batch * t)? as u32,
            (hq + 2 * hkv) as u32,
            1,
        ),
        block: (d / 2) as u32,
        smem: 0,
    };
    let params = RopeParams {
        batch: batch as i32,
        t: t as i32,
        hq: hq as i32,
        hkv: hkv as i32,
        d: d as i32,
        start: too_large("cache positions", start)?,
        capacity: too_large("cache positions", capacity)?,
        table_strides,
        ..Default::default()
    };
    let call = RopeCall {
        qkv: qkv.handle.clone(),
        table: table.handle.clone(),
        q: q.clone(),
        k: keys.handle.clone(),
        v: values.handle.clone(),
        q_len,
    };
    submit(&kernels.lanes, &client, params, vec![launch], call)?;
    let device = qkv.device.clone();
    let q = Tensor::new_contiguous(client.clone(), device.clone(), Shape::new([batch, t, hq, d]), q, qkv.dtype);
    let out = causal_attention(q, keys, values, Some(start + t), scale)?;
    Ok(Tensor::new_contiguous(
        client,
        device,
        Shape::new([batch, t, hq * d]),
        out.handle,
        out.dtype,
    ))
}
