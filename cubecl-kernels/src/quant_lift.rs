//! Fused per-token quantization + lift (and its no-lift twin for the dense baseline).
//!
//! One cube handles one token row: the units first reduce the row's absmax with 16-byte
//! loads, keeping the row in shared memory where it fits, then each unit writes whole
//! output vectors of the lifted row (16 codes = four 2:4 windows in one 16-byte store for
//! 8-bit codes). Rows `M..M_pad` are written as zeros with scale 1 so that the GEMM can run
//! on the padded shape.
//!
//! Non-finite input (8-bit modes): a row holding NaN or ±Inf gets the scale NaN and all-zero
//! codes, so the epilogue turns its whole output row into NaN (never a silently finite row).
//! The float (BF16/F16) lift passes values through unchanged.

use cubecl::prelude::*;

/// Units per cube (8 warps): one row of up to a few thousand windows per cube.
pub const QUANT_CUBE_DIM: u32 = 256;
/// Floor of the per-token absmax, as in the reference path.
pub const ACTIVATION_EPS: f32 = 1e-12;

/// Block-wide max of one f32 per unit, through plane reductions and shared memory.
#[cube]
fn cube_max(value: f32) -> f32 {
    let mut shared = SharedMemory::<f32>::new(32usize);
    let plane_value = plane_max(value);
    let planes = CUBE_DIM / PLANE_DIM;
    if UNIT_POS_PLANE == 0 {
        shared[(UNIT_POS / PLANE_DIM) as usize] = plane_value;
    }
    sync_cube();
    let mut result = 0.0f32;
    for i in 0..planes {
        result = f32::max(result, shared[i as usize]);
    }
    sync_cube();
    result
}

/// What the kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LiftMode {
    /// INT8 codes, round half to even, clamp to ±127.
    Int8,
    /// FP8 E4M3 codes, round to nearest even, saturating at ±448.
    Fp8,
    /// No quantization: the values cast to the output float type (BF16/F16 lift).
    Float,
}

/// Quantizes `x / scale` to the output type: INT8 (`rint`, clamp) or FP8 (clamped to ±448
/// first, which equals saturation), or a plain cast for float modes. A true division, not
/// a multiplication by the reciprocal, so that the codes match the reference path.
#[cube]
fn quantize<Q: Scalar>(x: f32, scale: f32, #[comptime] mode: LiftMode) -> Q {
    match comptime!(mode) {
        LiftMode::Int8 => Q::cast_from(i32::cast_from(f32::clamp(
            f32::round(x / scale),
            -127.0,
            127.0,
        ))),
        LiftMode::Fp8 => Q::cast_from(f32::clamp(x / scale, -448.0, 448.0)),
        LiftMode::Float => Q::cast_from(x),
    }
}

/// Shared memory a cube may stage a row in (bytes): the static limit of one block.
pub const STAGE_BYTES: usize = 48 * 1024;

/// `X [M, K]` (any float) -> `X' [M_pad, K']` codes + `s_x [M_pad]` (1 for float modes).
///
/// Layout of the work: one cube per token row, two passes.
/// 1. Every unit reads whole input vectors (`VI` elements, 16 bytes where `K` allows) and
///    reduces the absmax; with `staged > 0` it also keeps the row in shared memory, so the
///    row is read from global memory exactly once.
/// 2. Every unit writes whole output vectors (`VO` codes, 16 bytes for 8-bit codes), each
///    code gathered through the lift map from the staged row (or, unstaged, from global
///    memory, where `VI` must be 1).
///
/// `nan` must be `f32::NAN` (passed at run time, see below). `n == 0` means no lift (dense
/// baseline: `X'[m, o] = X[m, o]` for `o < K`); otherwise the SlideSparse lift of pattern
/// `(2n-2):2n`. `k_slide` is `K` for the dense baseline. The host guarantees
/// `K % VI == 0`, `K' % VO == 0`, `VO % 4 == 0` and `staged >= K` when staged.
///
/// `_input_type` names `F`'s storage type: CubeCL 0.10 compiles `F: Float` as a dynamic type, and
/// only a `#[define]`d argument puts it into the kernel's cache key (without it, an f32 and a
/// bf16 launch with equal comptime arguments share one compiled kernel).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn quant_lift_kernel<F: Float, Q: Scalar, VI: Size, VO: Size>(
    x: &Array<Vector<F, VI>>,
    out: &mut Array<Vector<Q, VO>>,
    scales: &mut Array<f32>,
    m: u32,
    k: u32,
    k_slide: u32,
    k_prime: u32,
    nan: f32,
    #[comptime] n: u32,
    #[comptime] mode: LiftMode,
    #[comptime] staged: usize,
    #[define(F)] _input_type: StorageType,
) {
    let vi = x.vector_size().comptime();
    let vo = out.vector_size().comptime();
    let row = CUBE_POS;
    let qmax = comptime!(match mode {
        LiftMode::Fp8 => 448.0f32,
        _ => 127.0f32,
    });
    let quantized = comptime!(mode != LiftMode::Float);
    let real_row = row < m as usize;
    let k_vectors = (k as usize) / vi;
    let in_base = row * k_vectors;
    let mut stage = SharedMemory::<F>::new(comptime!(usize::max(staged, 1)));

    // Pass 1: absmax and non-finite detection over the real row (and staging).
    let mut amax = 0.0f32;
    let mut bad = 0.0f32;
    if real_row {
        let mut i = UNIT_POS as usize;
        while i < k_vectors {
            let v = x[in_base + i];
            #[unroll]
            for l in 0..vi {
                let f = f32::cast_from(v[l]);
                if f.is_nan() || f.is_inf() {
                    bad = 1.0;
                } else {
                    amax = f32::max(amax, f32::abs(f));
                }
                if comptime!(staged > 0) {
                    stage[i * vi + l] = v[l];
                }
            }
            i += CUBE_DIM as usize;
        }
    }
    // Also the barrier that makes the staged row visible to every unit.
    let amax = cube_max(amax);
    let bad = cube_max(bad);
    // Rows that write real values: padding rows and (8-bit modes) rows holding NaN/Inf
    // write zeros. Float modes pass non-finite values through (IEEE semantics).
    let row_ok = real_row && (bad == 0.0 || !quantized);
    let mut scale = 1.0f32;
    if row_ok && quantized {
        scale = f32::max(amax, ACTIVATION_EPS) / qmax;
    }
    if real_row && bad > 0.0 && quantized {
        // From the host: CubeCL 0.10 prints an `f32::NAN` literal as `NaN`, which NVRTC rejects.
        scale = nan;
    }
    let mut divisor = 1.0f32;
    if row_ok {
        divisor = scale;
    }
    if UNIT_POS == 0 {
        scales[row] = scale;
    }

    // Pass 2: whole output vectors; `VO / 4` windows each.
    let out_vectors = (k_prime as usize) / vo;
    let out_base = row * out_vectors;
    let in_row = row * (k as usize);
    let mut j = UNIT_POS as usize;
    while j < out_vectors {
        let mut codes = Vector::<Q, VO>::empty();
        #[unroll]
        for l in 0..vo {
            let o = j * vo + l;
            let w = o / 4;
            // Source of the window's first lane: identity for the dense baseline, else
            // g * 2n + 2 * (window within the block).
            let src0 = if comptime!(n == 0) {
                w * 4
            } else {
                let per_block = comptime!((n - 1) as usize);
                (w / per_block) * comptime!((2 * n) as usize) + 2 * (w % per_block)
            };
            let src = src0 + comptime!(l % 4);
            let valid = row_ok && o < k_slide as usize && src < k as usize;
            let mut value = 0.0f32;
            if valid {
                if comptime!(staged > 0) {
                    value = f32::cast_from(stage[src]);
                } else {
                    value = f32::cast_from(x[in_row + src][0]);
                }
            }
            codes[l] = quantize::<Q>(value, divisor, mode);
        }
        out[out_base + j] = codes;
        j += CUBE_DIM as usize;
    }
}
