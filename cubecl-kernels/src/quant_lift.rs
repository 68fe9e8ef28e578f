//! Fused per-token quantization + lift (and its no-lift twin for the dense baseline).
//!
//! One cube handles one token row: the units first reduce the row's absmax (reading `X`
//! once from global memory; the second pass hits L1/L2), then each unit writes whole 2:4
//! windows of the lifted row: four 8-bit codes in one 32-bit store. Rows `M..M_pad` are
//! written as zeros with scale 1 so that the GEMM can run on the padded shape.
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

/// `X [M, K]` (any float) -> `X' [M_pad, K']` codes (as 4-element vectors, one store per 2:4
/// window) + `s_x [M_pad]` (1 for float modes).
///
/// `nan` must be `f32::NAN` (passed at run time, see below). `n == 0` means no lift (dense baseline: `X'[m, o] = X[m, o]` for `o < K`); otherwise the
/// SlideSparse lift of pattern `(2n-2):2n`. `k_slide` is `K` for the dense baseline.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn quant_lift_kernel<F: Float, Q: Scalar>(
    x: &Array<F>,
    out: &mut Array<Vector<Q, Const<4>>>,
    scales: &mut Array<f32>,
    m: u32,
    k: u32,
    k_slide: u32,
    k_prime: u32,
    nan: f32,
    #[comptime] n: u32,
    #[comptime] mode: LiftMode,
) {
    let row = CUBE_POS;
    let qmax = comptime!(match mode {
        LiftMode::Fp8 => 448.0f32,
        _ => 127.0f32,
    });
    let quantized = comptime!(mode != LiftMode::Float);
    let windows = (k_prime / 4) as usize;
    let out_base = row * windows;
    let in_base = row * (k as usize);

    // Absmax and non-finite detection over the real row.
    let mut amax = 0.0f32;
    let mut bad = 0.0f32;
    if row < m as usize {
        let mut i = UNIT_POS as usize;
        while i < k as usize {
            let v = f32::cast_from(x[in_base + i]);
            if v.is_nan() || v.is_inf() {
                bad = 1.0;
            } else {
                amax = f32::max(amax, f32::abs(v));
            }
            i += CUBE_DIM as usize;
        }
    }
    let amax = cube_max(amax);
    let bad = cube_max(bad);
    let real_row = row < m as usize;
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

    let mut w = UNIT_POS as usize;
    while w < windows {
        let o = w * 4;
        // Source of the window's first lane: identity for the dense baseline, else
        // g * 2n + 2 * (window within the block).
        let src0 = if comptime!(n == 0) {
            o
        } else {
            let per_block = comptime!((n - 1) as usize);
            (w / per_block) * comptime!((2 * n) as usize) + 2 * (w % per_block)
        };
        let mut codes = Vector::<Q, Const<4>>::empty();
        #[unroll]
        for l in 0..4usize {
            let src = src0 + l;
            let valid = row_ok && o + l < k_slide as usize && src < k as usize;
            let mut value = 0.0f32;
            if valid {
                value = f32::cast_from(x[in_base + src]);
            }
            codes[l] = quantize::<Q>(value, divisor, mode);
        }
        out[out_base + w] = codes;
        w += CUBE_DIM as usize;
    }
}
