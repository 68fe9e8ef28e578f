//! Our Hopper sparse GEMM on the compact layout (`kernels/sparse_gemm_sm90.cu`, "The compact
//! kernels"): a `(2N-2):2N` INT8 layer's prefill GEMM reads the layer's one copy of its weight,
//! the compact rows (`compact/rows.rs`: kept codes and packed zero-pair ranks), instead of a
//! cuSPARSELt copy beside it. The kept codes are the 2:4 GEMM's compressed values as they are;
//! the 2:4 metadata is a function of the ranks through a per-rank table ([`window_metadata`]).
//! A forward runs two kernels: the metadata kernel fills a scratch array with the whole
//! weight's metadata words (once per weight tile, where building them inside the GEMM built
//! them once per output tile, on warps that nothing hides), then the warp-specialized GEMM runs
//! on that array and the kept codes as on a precomputed array. The scratch is the lane's
//! workspace, shared by every layer (the largest layer's: 2 KB per 128 rows x 128 `K'`, 22 MB
//! for Llama-3-8B's fused gate/up). Why: `docs/decisions/one-compact-copy.md`.
//!
//! Hopper only (`wgmma.mma_async.sp`, compiled for `sm_90a`), patterns 2:4 .. 14:16.
//!
//! It writes either `acc [m, n_pad] = X' . W'^T` in INT32, exact, for the pipeline's epilogue
//! (f32 layers, decode sizes), or, for 16-bit layers past decode sizes, the layer output
//! `Y [m, n] = acc * s_x * s_w + b` in bf16 / f16 itself (the epilogue in the GEMM's kernel,
//! staged through shared memory: no INT32 array written and read back, no epilogue kernel).
//! The activations `X' [m_pad, k_out]` are the lift's, as for cuSPARSELt.

use std::{ffi::c_void, sync::Arc};

use cudarc::driver::{result as cu, sys};

use super::{
    accumulator::AccType,
    buffers::HeldBuffer,
    driver::{Context, cuda_device, driver_err},
    nvrtc_module::{LoadedProgram, Program},
    runtime::{Client, PerDevice},
};
use crate::{
    compact::{CompactRows, window_metadata},
    error::{Result, SlideSparseError},
    pattern::SparsityPattern,
};

/// The GEMM's program: `sm_90a` only.
pub(super) const PROGRAM: Program = Program {
    name: "Hopper sparse GEMM",
    files: &["sparse_gemm_sm90.cu"],
    min_capability: (9, 0),
    arch_specific: true,
};

/// Threads of a CTA (`SPGEMM_WS_THREADS`): a producer and two consumer warpgroups.
const THREADS: u32 = 384;
/// Tokens per CTA tile (`Cfg<256, 128>::BN` of the kernels it launches) and weight rows per tile.
const TILE_TOKENS: usize = 256;
const TILE_ROWS: usize = 128;
/// `K'` per stage (`Cfg<256, 128>::BK`).
const TILE_K: usize = 128;
/// Weight-row tiles side by side in the raster order (`SpGemmWsParams::group`): a wave's share
/// of `X'` stays in L2 (docs/benchmarks.md, the raster-group table).
const RASTER_GROUP: i32 = 16;
/// Entries of the rank table (`SPGEMM_RANK_TABLE`): `C(16, 2)` rounded up.
const RANK_TABLE: usize = 128;
/// Bytes of metadata words per 128 rows x 128 `K'` (`Cfg<256, 128>::E_BYTES`).
const META_TILE_BYTES: usize = 2048;
/// Threads of a metadata-kernel CTA: one per row of a 128-row tile.
const META_THREADS: u32 = 128;

/// The longest block the kernel expands: 14:16 (7 windows of 4-bit metadata in a table word).
pub const MAX_BLOCK_LEN: usize = 16;

/// `CUtensorMap` as the kernel's parameter block holds it (`SpTensorMap`: 128 bytes, 64-byte
/// aligned; cudarc's own type for CUDA 13 is 128-byte aligned, so the encoder writes into
/// that and the bytes are copied here).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default)]
pub struct TensorMap([u64; 16]);

/// Must match `SpGemmWsParams` in `kernels/sparse_gemm_sm90.cu` (its size is checked by a
/// `static_assert` there and by [`PARAMS_SIZE`] here, the offset of `tr` here).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct SpGemmParams {
    pub ta: TensorMap,
    pub tb: TensorMap,
    pub e: u64,
    pub sx: u64,
    pub sw: u64,
    pub bias: u64,
    pub y: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub ldy: i32,
    pub k_tiles: i32,
    pub n_tiles: i32,
    pub group: i32,
    pub tr: TensorMap,
    pub win: i32,
    pub rbits: i32,
    pub table: [u32; RANK_TABLE],
}

/// `sizeof(SpGemmWsParams)` as the kernel file asserts it.
pub const PARAMS_SIZE: usize = 1088;
const _: () = assert!(std::mem::size_of::<SpGemmParams>() == PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(SpGemmParams, tr) == 384);

/// Must match `SpMetaParams` in `kernels/sparse_gemm_sm90.cu` (size asserted on both sides).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MetaParams {
    ranks: u64,
    e: u64,
    n: i32,
    rank_stride: i32,
    k_tiles: i32,
    n_tiles: i32,
    win: i32,
    rbits: i32,
    table: [u32; RANK_TABLE],
}
const _: () = assert!(std::mem::size_of::<MetaParams>() == 552);

/// A loaded kernel and its dynamic shared memory.
struct Function {
    function: sys::CUfunction,
    smem: u32,
}

/// The program's kernels on one device, and its context.
struct Kernel {
    /// The device's primary context: encoding the activations' tensor map needs it current,
    /// and a forward's GEMM may be queued from cubecl's device thread.
    context: Context,
    /// `spgemm_ws_n256_k128_{i32,bf16,f16}`: the GEMM, its metadata from an array, writing
    /// INT32 accumulators or the finished 16-bit output.
    gemm_i32: Function,
    gemm_bf16: Function,
    gemm_f16: Function,
    /// `spgemm_compact_metadata`: that array from the ranks.
    metadata: Function,
}

// SAFETY: function handles of a program loaded for the process and the handle of a context
// retained for the process, all immutable after loading; launches use them with that context
// current.
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

/// The kernel file's constant: the dynamic shared memory of the three `spgemm_ws_n256_k128_*`.
const SMEM_GLOBAL: &str = "spgemm_ws_n256_k128_smem";

/// What a forward's GEMM writes.
#[derive(Clone, Copy, Debug)]
pub enum CompactOutput {
    /// `acc [m, acc_stride]` INT32.
    Acc(u64),
    /// The layer output `y [m, n]` of 16-bit type `ty` (`Bf16` or `F16`), epilogue applied
    /// with the token scales `sx [m]` (f32) and the weight's own scales and bias.
    Finished { y: u64, ty: AccType, sx: u64 },
}

fn kernel(index: usize) -> Result<Arc<Kernel>> {
    static KERNELS: PerDevice<Kernel> = PerDevice::new();
    KERNELS.get_or_try_init(index, || {
        let program = LoadedProgram::load(index, &PROGRAM)?;
        // The kernels' shared memory is the kernel file's constant (stages that fit), read
        // back rather than computed twice.
        let load = |name: &str, smem_global: Option<&str>| -> Result<Function> {
            let smem = match smem_global {
                Some(global) => program.global_i32(global)? as u32,
                None => 0,
            };
            let function = program.function(name, smem as usize)?;
            Ok(Function { function, smem })
        };
        Ok(Kernel {
            context: Context::retain(cuda_device(index)?)?,
            gemm_i32: load("spgemm_ws_n256_k128_i32", Some(SMEM_GLOBAL))?,
            gemm_bf16: load("spgemm_ws_n256_k128_bf16", Some(SMEM_GLOBAL))?,
            gemm_f16: load("spgemm_ws_n256_k128_f16", Some(SMEM_GLOBAL))?,
            metadata: load("spgemm_compact_metadata", None)?,
        })
    })
}

/// A 2-D `u8` tensor map over `rows` rows of `row_bytes` bytes at `base` (`inner` of them
/// valid), boxes of `box_rows x box_bytes`; out-of-bounds reads are zeros.
fn tensor_map(
    base: u64,
    (inner, rows, row_bytes): (usize, usize, usize),
    (box_bytes, box_rows): (u32, u32),
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TensorMap> {
    let dims = [inner as u64, rows as u64];
    let strides = [row_bytes as u64];
    let boxes = [box_bytes, box_rows];
    let element_strides = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every array holds the rank's (2) entries the call reads; `map` is written by the
    // call before it is read; the address and strides are checked by the driver (alignment,
    // sizes), which returns an error rather than writing a bad map.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            2,
            base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    status.result().map_err(driver_err("cuTensorMapEncodeTiled"))?;
    // SAFETY: initialized by the successful call above.
    let map = unsafe { map.assume_init() };
    Ok(TensorMap(map.opaque))
}

/// The per-rank metadata table of `pattern` as the kernel takes it.
fn rank_table(pattern: SparsityPattern) -> Result<[u32; RANK_TABLE]> {
    let entries = window_metadata(pattern);
    let mut table = [0u32; RANK_TABLE];
    if entries.len() > RANK_TABLE || pattern.block_len() > MAX_BLOCK_LEN {
        return Err(unsupported(pattern));
    }
    for (slot, &word) in table.iter_mut().zip(&entries) {
        *slot = u32::try_from(word).map_err(|_| unsupported(pattern))?;
    }
    Ok(table)
}

fn unsupported(pattern: SparsityPattern) -> SlideSparseError {
    SlideSparseError::Unsupported {
        what: "the compact sparse GEMM".into(),
        why: format!("pattern {pattern} (it expands blocks of up to {MAX_BLOCK_LEN}: 2:4 .. 14:16)"),
    }
}

/// A layer's weight for the compact GEMM: the compact rows on the device and the parameter
/// block's fixed part (the weight's tensor maps, the pattern's table).
pub struct CompactGemm {
    kept: HeldBuffer,
    ranks: HeldBuffer,
    /// The layer's per-channel scales `[n]` and bias (f32), read by the finished output's
    /// epilogue.
    _epilogue: (HeldBuffer, Option<HeldBuffer>),
    /// The device it lives on.
    index: usize,
    /// Output features.
    pub n: usize,
    /// `K'` the weight covers: `blocks * 4 (N - 1)`.
    pub k_slide: usize,
    /// Bytes per token of the lifted codes it reads (the quantization's `k_out`).
    pub x_stride: usize,
    /// INT32 elements per token of the accumulator it writes (the layer's `n_pad`).
    pub acc_stride: usize,
    base: SpGemmParams,
    /// The metadata kernel's parameters but the output array.
    meta: MetaParams,
    /// Bytes per row of the kept codes.
    pub kept_stride: usize,
    /// Bytes per row of the packed ranks.
    pub rank_stride: usize,
}

impl CompactGemm {
    /// Uploads compact `rows` on device `index` and encodes the weight's tensor maps;
    /// its forwards read lifted codes of `x_stride` bytes per token and write accumulator rows
    /// of `acc_stride` INT32, or finished outputs with the layer's `scale` `[n]` and `bias`
    /// (f32, held here). Errors: a pattern past 14:16, a driver refusing a map.
    pub fn new(
        client: &Client,
        index: usize,
        rows: &CompactRows,
        (x_stride, acc_stride): (usize, usize),
        (scale, bias): (HeldBuffer, Option<HeldBuffer>),
    ) -> Result<Self> {
        let table = rank_table(rows.pattern)?;
        // Encoding the weight's tensor maps needs the context current; burn may prepare a
        // layer on any thread.
        kernel(index)?.context.make_current()?;
        let kept = HeldBuffer::new(client, client.create_from_slice(&rows.kept))?;
        let ranks = HeldBuffer::new(client, client.create_from_slice(&rows.ranks))?;
        let n = rows.rows;
        let ta = tensor_map(
            kept.ptr,
            (rows.kept_stride, n, rows.kept_stride),
            (64, TILE_ROWS as u32),
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        )?;
        let geometry = rows.pattern.geometry(rows.k, 1);
        let k_slide = geometry.k_slide();
        let int = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| SlideSparseError::Unsupported {
                what: format!("compact sparse GEMM {what}"),
                why: format!("{v} exceeds 2^31"),
            })
        };
        let base = SpGemmParams {
            ta,
            tb: TensorMap::default(),
            e: 0,
            sx: 0,
            sw: scale.ptr,
            bias: bias.as_ref().map_or(0, |b| b.ptr),
            y: 0,
            m: 0,
            n: int("rows", n)?,
            k: int("K'", k_slide)?,
            ldy: 0,
            k_tiles: int("K' tiles", k_slide.div_ceil(TILE_K))?,
            n_tiles: int("row tiles", n.div_ceil(TILE_ROWS))?,
            group: RASTER_GROUP,
            // The in-stage kernels' fields: the metadata kernel has them here.
            tr: TensorMap::default(),
            win: 0,
            rbits: 0,
            table: [0; RANK_TABLE],
        };
        let meta = MetaParams {
            ranks: ranks.ptr,
            e: 0,
            n: base.n,
            rank_stride: int("rank row bytes", rows.rank_stride)?,
            k_tiles: base.k_tiles,
            n_tiles: base.n_tiles,
            win: rows.pattern.block_len() as i32 / 2 - 1,
            rbits: crate::compact::rank_bits(rows.pattern) as i32,
            table,
        };
        Ok(Self {
            kept,
            ranks,
            _epilogue: (scale, bias),
            index,
            n,
            k_slide,
            x_stride,
            acc_stride,
            base,
            meta,
            kept_stride: rows.kept_stride,
            rank_stride: rows.rank_stride,
        })
    }

    /// The device pointers of the kept codes and the ranks.
    pub fn rows_ptrs(&self) -> (u64, u64) {
        (self.kept.ptr, self.ranks.ptr)
    }

    /// Bytes of scratch a forward needs for the metadata words.
    pub fn scratch_bytes(&self) -> usize {
        self.n.div_ceil(TILE_ROWS) * self.k_slide.div_ceil(TILE_K) * META_TILE_BYTES
    }

    /// Enqueues the product of `x`, the lifted codes of `m` tokens (`x_stride` bytes each), and
    /// the weight on `stream`, writing `out`; `scratch` [`scratch_bytes`](Self::scratch_bytes)
    /// bytes for the metadata words.
    ///
    /// # Safety
    /// `stream` is a live stream of the device's context, current on this thread; `x` is live
    /// device memory of `m` rows of `x_stride` bytes; `out`'s buffers are live device memory of
    /// `m` rows (`acc_stride` INT32, or `n` 16-bit values and `m` f32 token scales); `scratch`
    /// is live device memory of `scratch_bytes()` bytes that nothing else uses until the GEMM
    /// is done (stream order).
    pub unsafe fn enqueue(
        &self,
        stream: sys::CUstream,
        m: usize,
        (x, out): (u64, CompactOutput),
        scratch: u64,
    ) -> Result<()> {
        let kernel = kernel(self.index)?;
        kernel.context.make_current()?;
        let tb = tensor_map(
            x,
            (self.x_stride, m, self.x_stride),
            (128, TILE_TOKENS as u32),
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        )?;
        let (gemm, y, ldy, sx) = match out {
            CompactOutput::Acc(acc) => (&kernel.gemm_i32, acc, self.acc_stride, 0),
            CompactOutput::Finished { y, ty, sx } => {
                let gemm = match ty {
                    AccType::Bf16 => &kernel.gemm_bf16,
                    AccType::F16 => &kernel.gemm_f16,
                    AccType::I32 | AccType::F32 => {
                        return Err(SlideSparseError::Unsupported {
                            what: "the compact sparse GEMM's own epilogue".into(),
                            why: format!("{ty:?} outputs (it writes bf16 or f16)"),
                        });
                    }
                };
                (gemm, y, self.n, sx)
            }
        };
        let mut params = SpGemmParams {
            tb,
            m: m as i32,
            ldy: ldy as i32,
            y,
            sx,
            e: scratch,
            ..self.base
        };
        // SAFETY: as this function's: `scratch` holds `scratch_bytes()` bytes.
        unsafe { self.enqueue_metadata(&kernel.metadata, stream, scratch)? };
        let tiles = m.div_ceil(TILE_TOKENS) * self.n.div_ceil(TILE_ROWS);
        let mut args = [&mut params as *mut SpGemmParams as *mut c_void];
        // SAFETY: the kernel takes one parameter block by value, `SpGemmParams` (the layout
        // the kernel file asserts); the weight's maps, scales and bias cover buffers this
        // value holds, `e` the words the metadata kernel wrote before it on the stream; the
        // caller's contract covers `x`, `out` and the stream.
        unsafe {
            cu::launch_kernel(
                gemm.function,
                (tiles as u32, 1, 1),
                (THREADS, 1, 1),
                gemm.smem,
                stream,
                &mut args,
            )
        }
        .map_err(driver_err("cuLaunchKernel (compact sparse GEMM)"))
    }

    /// Enqueues the metadata kernel: the whole weight's metadata words into `scratch`.
    ///
    /// # Safety
    /// As [`enqueue`](Self::enqueue)'s, for `stream` and `scratch`.
    unsafe fn enqueue_metadata(
        &self,
        function: &Function,
        stream: sys::CUstream,
        scratch: u64,
    ) -> Result<()> {
        let mut meta = MetaParams {
            e: scratch,
            ..self.meta
        };
        let grid = (self.meta.k_tiles as u32, self.meta.n_tiles as u32, 1);
        let mut args = [&mut meta as *mut MetaParams as *mut c_void];
        // SAFETY: the kernel takes one parameter block by value, `SpMetaParams` (the layout
        // both sides assert); it reads the ranks this value holds and writes the
        // `scratch_bytes` the caller's contract covers.
        unsafe {
            cu::launch_kernel(
                function.function,
                grid,
                (META_THREADS, 1, 1),
                function.smem,
                stream,
                &mut args,
            )
        }
        .map_err(driver_err("cuLaunchKernel (compact GEMM metadata)"))
    }
}
