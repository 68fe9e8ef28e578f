//! The weight-streaming GEMV of small forwards (decode, up to [`MAX_TOKENS`] tokens):
//! `kernels/decode_gemv.cu`, INT8 codes of activations and weights, the sum exact in INT32 on
//! the tensor cores, the epilogue (`acc * s_x * s_w + b` in f32, one rounding to the output
//! type) fused in. It reads a dense layer's row-major codes (the copy cuBLASLt reads too), a
//! 6:8 layer's compact tiles (`compact.rs`, 0.83x the dense bytes, where cuSPARSELt's slid
//! 2:4 copy is 0.94x) beside cuSPARSELt's copy, or the compact rows our sparse GEMM reads
//! (`compact/rows.rs`: the same bytes row-major, the layer's one copy): one launch per forward
//! after the quantization, against the library path's GEMM and epilogue. Why this kernel and its configuration:
//! `docs/decisions/decode-gemv.md`.

use std::{collections::HashMap, sync::Arc};

use burn::tensor::DType;
use cudarc::driver::sys;

use super::{
    buffers::HeldBuffer,
    driver::driver_err,
    nvrtc_module::{LoadedProgram, Program},
    queued::Launch,
    runtime::{Client, PerDevice},
};
use crate::{
    compact::{CompactCodes, DecodeTiles},
    error::{Result, SlideSparseError},
};

/// The GEMV's program.
pub(super) const PROGRAM: Program = Program {
    name: "decode GEMV",
    files: &["decode_gemv.cu"],
    min_capability: (8, 0),
    arch_specific: false,
};

/// The most tokens a GEMV forward takes; larger forwards run the library GEMM.
pub const MAX_TOKENS: usize = 16;

/// Bytes of a 512-wide step's activations per token (`X_ROW`) and of one unit or dense step's
/// weights (`COMPACT_STEP_BYTES`, `DENSE_STEP_BYTES`).
const X_ROW: usize = 576;
const COMPACT_STEP: usize = 6144 + 640;
/// `ROWS_STEP_BYTES`: 16 rows of 432 code bytes and 48 rank bytes.
const ROWS_STEP: usize = 16 * 432 + 16 * 48;
const DENSE_STEP: usize = 8 * 1024;
/// `GEMV_FLAG_PREFETCH`: prefetch the first group's weights into L2 before waiting for the
/// kernel before (programmatic dependent launch).
pub const FLAG_PREFETCH: i32 = 1;

/// Must match `GemvParams` in `kernels/decode_gemv.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GemvParams {
    pub w: u64,
    pub idx: u64,
    pub x: u64,
    pub sx: u64,
    pub sw: u64,
    pub bias: u64,
    pub y: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub x_stride: i32,
    pub y_stride: i32,
    pub w_stride: i32,
    pub units: i32,
    pub tail: i32,
    pub flags: i32,
    pub idx_stride: i32,
}

/// A kernel's shape: token tiles, row tiles per group, warps, stages (as `GEMV_LIBRARY`
/// instantiates it).
#[derive(Clone, Copy, Debug)]
struct Shape {
    tiles: usize,
    rows: usize,
    warps: usize,
    stages: usize,
}

/// Up to 8 tokens: groups of one row tile, 8 warps; up to 16: two row tiles, 4 warps.
const SHAPES: [Shape; 2] = [
    Shape {
        tiles: 1,
        rows: 1,
        warps: 8,
        stages: 2,
    },
    Shape {
        tiles: 2,
        rows: 2,
        warps: 4,
        stages: 2,
    },
];

impl Shape {
    fn of(m: usize) -> Self {
        if m <= 8 { SHAPES[0] } else { SHAPES[1] }
    }

    /// Dynamic shared memory of a launch for `m` tokens (`GemvSmem::bytes`).
    fn smem(&self, layout: Layout, m: usize) -> usize {
        let weights = match layout {
            Layout::Dense => DENSE_STEP,
            Layout::Tiles => COMPACT_STEP,
            Layout::Rows => ROWS_STEP,
        };
        let ring = self.stages * (self.rows * weights + m * X_ROW);
        let partial = 2 * self.warps * self.rows * self.tiles * 8 * 16 * 4;
        self.warps * ring + partial
    }
}

/// The weight layouts the kernels read (`LAYOUT` in `decode_gemv.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Layout {
    /// Row-major INT8 codes.
    Dense,
    /// 6:8 compact tiles (`DecodeTiles`).
    Tiles,
    /// 6:8 compact rows (`CompactRows`).
    Rows,
}

impl Layout {
    const ALL: [Self; 3] = [Self::Dense, Self::Tiles, Self::Rows];

    /// The kernels' name part.
    fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Tiles => "compact68",
            Self::Rows => "rows68",
        }
    }
}

/// The kernels of one device, by `(layout, output dtype, shape index)`.
struct Kernels {
    functions: HashMap<(Layout, OutType, usize), sys::CUfunction>,
    sm_count: usize,
}

// SAFETY: function handles of a program loaded for the process, immutable after loading;
// launches use them with the device's context current.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// The output types the kernels write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum OutType {
    F32,
    Bf16,
    F16,
}

impl OutType {
    fn of(dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(Self::F32),
            DType::BF16 => Ok(Self::Bf16),
            DType::F16 => Ok(Self::F16),
            other => Err(SlideSparseError::Unsupported {
                what: "decode GEMV output".into(),
                why: format!("{other:?} (f32, bf16 or f16)"),
            }),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }
}

fn kernels(index: usize) -> Result<Arc<Kernels>> {
    static KERNELS: PerDevice<Kernels> = PerDevice::new();
    KERNELS.get_or_try_init(index, || {
        let program = LoadedProgram::load(index, &PROGRAM)?;
        let mut functions = HashMap::new();
        for layout in Layout::ALL {
            for out in [OutType::F32, OutType::Bf16, OutType::F16] {
                for (i, shape) in SHAPES.iter().enumerate() {
                    let name = format!("gemv_{}_{}_t{}", layout.name(), out.name(), shape.tiles);
                    let smem = shape.smem(layout, 8 * shape.tiles);
                    functions.insert((layout, out, i), program.function(&name, smem)?);
                }
            }
        }
        Ok(Kernels {
            functions,
            sm_count: program.info.sm_count,
        })
    })
}

/// CTAs of `function` with `threads` threads and `smem` bytes that fit on one SM.
fn occupancy(function: sys::CUfunction, threads: usize, smem: usize) -> Result<usize> {
    let mut blocks = 0i32;
    // SAFETY: `function` is a loaded kernel; the driver writes one int.
    unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &mut blocks,
            function,
            threads as i32,
            smem,
        )
    }
    .result()
    .map_err(driver_err("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
    Ok(blocks.max(1) as usize)
}

/// A layer's weight as the GEMV reads it.
pub enum GemvWeight {
    /// Row-major `[n, stride]` INT8 codes held by the layer's dense GEMM.
    Dense {
        /// The codes' device pointer (the layer holds the buffer).
        ptr: u64,
        /// Row stride in bytes (`K` padded to 16).
        stride: usize,
    },
    /// 6:8 compact tiles, held here.
    Compact {
        codes: HeldBuffer,
        index: HeldBuffer,
        units: usize,
        tail: usize,
    },
    /// 6:8 compact rows held by the layer's compact GEMM.
    Rows {
        /// The kept codes' and the ranks' device pointers.
        kept: u64,
        ranks: u64,
        /// Their row strides in bytes.
        kept_stride: usize,
        rank_stride: usize,
    },
}

/// A layer's GEMV: its weight and sizes.
pub struct Gemv {
    weight: GemvWeight,
    /// Bytes of the weight one forward reads.
    bytes: usize,
    /// Output features.
    pub n: usize,
    /// Input features `K`.
    pub k: usize,
}

impl Gemv {
    /// The GEMV of a dense layer whose GEMM holds `ptr`, `[n, stride]` INT8 codes. `K` must be a
    /// multiple of 16 (the quantization pads it with zero codes).
    pub fn dense(ptr: u64, n: usize, k: usize, stride: usize) -> Self {
        Self {
            weight: GemvWeight::Dense { ptr, stride },
            bytes: n * stride,
            n,
            k,
        }
    }

    /// The GEMV of a 6:8 INT8 layer: its compact tiles uploaded.
    pub fn compact(client: &Client, codes: &CompactCodes<i8>) -> Result<Self> {
        let tiles = DecodeTiles::new(codes)?;
        let index: Vec<u8> = tiles.index.iter().flat_map(|w| w.to_le_bytes()).collect();
        let bytes = tiles.bytes();
        debug_assert_eq!(tiles.tiles(), tiles.rows.div_ceil(16));
        Ok(Self {
            bytes,
            weight: GemvWeight::Compact {
                codes: HeldBuffer::new(client, client.create_from_slice(&tiles.codes))?,
                index: HeldBuffer::new(client, client.create_from_slice(&index))?,
                units: tiles.units,
                tail: tiles.tail,
            },
            n: tiles.rows,
            k: tiles.k,
        })
    }

    /// The GEMV of a 6:8 INT8 layer whose compact GEMM holds its compact rows (`CompactRows`
    /// of `n` rows of `k` input features: kept codes at `kept`, ranks at `ranks`, with their
    /// row strides), read in place: the layer's one copy.
    pub fn rows(
        (kept, ranks): (u64, u64),
        (kept_stride, rank_stride): (usize, usize),
        n: usize,
        k: usize,
    ) -> Self {
        Self {
            weight: GemvWeight::Rows {
                kept,
                ranks,
                kept_stride,
                rank_stride,
            },
            bytes: n * (kept_stride + rank_stride),
            n,
            k,
        }
    }

    fn layout(&self) -> Layout {
        match self.weight {
            GemvWeight::Dense { .. } => Layout::Dense,
            GemvWeight::Compact { .. } => Layout::Tiles,
            GemvWeight::Rows { .. } => Layout::Rows,
        }
    }

    /// Whether it reads a compact 6:8 layout (tiles or rows).
    pub fn is_compact(&self) -> bool {
        self.layout() != Layout::Dense
    }

    /// Bytes of its weight the GEMV reads per forward.
    pub fn weight_bytes(&self) -> usize {
        self.bytes
    }

    /// Columns of the activation codes it reads per token: `K`, or `K` padded to 64 (compact
    /// tiles hold whole 64-wide chunks; the padding's codes are never multiplied by a nonzero
    /// weight but must be readable).
    pub fn x_columns(&self) -> usize {
        if self.is_compact() {
            self.k.next_multiple_of(64)
        } else {
            self.k
        }
    }

    /// The launch and parameter block of a forward of `m <= MAX_TOKENS` tokens on device
    /// `index`, with every pointer but the weight's left for the caller: `x` (codes,
    /// `x_stride` bytes per token), `sx` (token scales), `sw`, `bias`, `y` (`y_stride`
    /// elements per token).
    pub fn launch(
        &self,
        index: usize,
        m: usize,
        out: DType,
        flags: i32,
    ) -> Result<(Launch, GemvParams)> {
        if m == 0 || m > MAX_TOKENS {
            return Err(SlideSparseError::Unsupported {
                what: "decode GEMV".into(),
                why: format!("{m} tokens (1 to {MAX_TOKENS})"),
            });
        }
        let kernels = kernels(index)?;
        let layout = self.layout();
        let shape_index = if m <= 8 { 0 } else { 1 };
        let shape = Shape::of(m);
        let function = kernels.functions[&(layout, OutType::of(out)?, shape_index)];
        let smem = shape.smem(layout, m);
        let threads = 32 * shape.warps;
        let groups = self.n.div_ceil(16).div_ceil(shape.rows);
        let per_sm = occupancy(function, threads, smem)?;
        let grid = groups.min(per_sm * kernels.sm_count).max(1);
        let int = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| SlideSparseError::Unsupported {
                what: format!("decode GEMV {what}"),
                why: format!("{v} exceeds 2^31"),
            })
        };
        let mut params = GemvParams {
            m: m as i32,
            n: int("rows", self.n)?,
            ..Default::default()
        };
        match &self.weight {
            GemvWeight::Dense { ptr, stride } => {
                params.w = *ptr;
                params.k = int("K", self.k)?;
                params.w_stride = int("row stride", *stride)?;
            }
            GemvWeight::Compact {
                codes,
                index,
                units,
                tail,
            } => {
                params.w = codes.ptr;
                params.idx = index.ptr;
                params.k = int("K", self.k.next_multiple_of(64))?;
                params.units = *units as i32;
                params.tail = *tail as i32;
            }
            GemvWeight::Rows {
                kept,
                ranks,
                kept_stride,
                rank_stride,
            } => {
                params.w = *kept;
                params.idx = *ranks;
                params.k = int("K", self.k.next_multiple_of(64))?;
                params.w_stride = int("kept row stride", *kept_stride)?;
                params.idx_stride = int("rank row stride", *rank_stride)?;
            }
        }
        params.flags = flags;
        let launch = Launch {
            function,
            grid: (grid as u32, 1, 1),
            block: threads as u32,
            smem: smem as u32,
        };
        Ok((launch, params))
    }
}
