//! Fused per-token quantization + lift (and its no-lift twin for the dense baseline).
//!
//! Two kernels, same contract and same codes; in both one cube handles a token row at a
//! time, first reducing the row's absmax, then writing whole output vectors of the lifted
//! row (16 codes = four 2:4 windows in one 16-byte store for 8-bit codes):
//! - [`fn@quant_lift_grouped_kernel`] (rows of whole 16-byte vectors, every LLM shape): each unit
//!   holds groups of four pattern blocks in registers, quantizes each input once and lifts
//!   through a compile-time map; its [`GroupedLayout`] (cube size, rows per cube, next-row
//!   prefetch, shared-memory-staged stores) is chosen per launch;
//! - [`fn@quant_lift_kernel`] (any `K`): the row staged in shared memory where it fits, each
//!   output code gathered through the lift map's index arithmetic.
//!
//! Rows `M..M_pad` are written as zeros with scale 1 so that the GEMM can run on the padded
//! shape. The kernel was instruction-bound (Nsight Compute, `docs/decisions/quant-lift-kernel-layout.md`),
//! so the per-element arithmetic is lean and branch-free: the spec's quotient `x / s` from
//! the row's reciprocal by a multiplication and two FMAs (exact, `crate::rounding`), INT8
//! codes rounded by a magic-number addition, FP8 codes by an integer E4M3 encoder, and the
//! absmax by a compare and a select.
//!
//! Non-finite input (8-bit modes): a row holding NaN or ±Inf gets the scale NaN and all-zero
//! codes, so the epilogue turns its whole output row into NaN (never a silently finite row).
//! The float (BF16/F16) lift passes values through unchanged.

use cubecl::prelude::*;

use crate::{
    grouping::{group_input_len, group_output_len, group_source},
    rounding::{E4M3_REBIAS, FP8_MAX, FP8_MIN_NORMAL, ROUNDING_MAGIC, ROUNDING_MAGIC_BITS},
};

/// Units per cube (8 warps): one row of up to a few thousand windows per cube.
pub const QUANT_CUBE_DIM: u32 = 256;
/// Floor of the per-token absmax (defined in [`crate::rounding`], shared with the reference
/// path).
pub use crate::rounding::ACTIVATION_EPS;

/// Block-wide maxima of two f32 per unit (absmax and the non-finite flag), through plane
/// reductions and one shared-memory exchange in buffer `slot` (0 or 1). Also a barrier:
/// shared memory written before it is visible to every unit after it. A cube that reduces
/// row after row alternates the slot, so that no unit overwrites partial maxima another
/// unit has yet to read (it would have to pass the next reduction's barrier first).
#[cube]
fn cube_max_pair(a: f32, b: f32, slot: usize) -> Vector<f32, Const<2>> {
    let mut shared = SharedMemory::<f32>::new(128usize);
    let base = slot * 64;
    let plane_a = plane_max(a);
    let plane_b = plane_max(b);
    let planes = CUBE_DIM / PLANE_DIM;
    if UNIT_POS_PLANE == 0 {
        let plane = (UNIT_POS / PLANE_DIM) as usize;
        shared[base + plane] = plane_a;
        shared[base + 32 + plane] = plane_b;
    }
    sync_cube();
    let mut result = Vector::<f32, Const<2>>::empty();
    result[0] = 0.0f32;
    result[1] = 0.0f32;
    for i in 0..planes {
        result[0] = f32::max(result[0], shared[base + i as usize]);
        result[1] = f32::max(result[1], shared[base + 32 + i as usize]);
    }
    result
}

/// Absmax of the lanes of `v` (±Inf included, NaN ignored: `max` returns the other operand)
/// and 1 if any lane is NaN (else 0). Branch-free: a compare and a select per lane; an
/// infinite lane shows as an infinite absmax ([`non_finite`]).
#[cube]
fn vector_absmax_and_flag<F: Float, V: Size>(v: Vector<F, V>) -> Vector<f32, Const<2>> {
    let mut result = Vector::<f32, Const<2>>::empty();
    result[0] = 0.0f32;
    result[1] = 0.0f32;
    #[unroll]
    for l in 0..v.size() {
        let f = f32::cast_from(v[l]);
        result[0] = f32::max(result[0], f32::abs(f));
        result[1] = select(f.is_nan(), 1.0f32, result[1]);
    }
    result
}

/// 1 if the row's reduced `[absmax, NaN flag]` says it holds NaN or ±Inf, else 0.
#[cube]
fn non_finite(reduced: Vector<f32, Const<2>>) -> f32 {
    select(reduced[1] > 0.0 || reduced[0].is_inf(), 1.0f32, 0.0f32)
}

/// The row's scale from its reduced absmax and non-finite flag: `max(amax, eps) / qmax` for a
/// finite real row, NaN for a real 8-bit row holding NaN/Inf (`nan` comes from the host:
/// CubeCL 0.10 prints an `f32::NAN` literal as `NaN`, which NVRTC rejects), and 1 for padding
/// rows and float modes.
#[cube]
fn row_scale(amax: f32, bad: f32, real_row: bool, nan: f32, #[comptime] mode: LiftMode) -> f32 {
    let mut scale = 1.0f32;
    if comptime!(mode != LiftMode::Float) && real_row {
        let qmax = comptime!(match mode {
            LiftMode::Fp8 => 448.0f32,
            _ => 127.0f32,
        });
        if bad > 0.0 {
            scale = nan;
        } else {
            scale = f32::max(amax, ACTIVATION_EPS) / qmax;
        }
    }
    scale
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

/// `fl(x / scale)` from `inv_scale = fl(1 / scale)`: a multiplication and Markstein's
/// correction step, two FMAs, no branch. Same operations as the host mirror
/// [`crate::rounding::quotient`], where the argument and the tests are.
#[cube]
fn quotient(x: f32, scale: f32, inv_scale: f32) -> f32 {
    let first = x * inv_scale;
    let remainder = fma(-first, scale, x);
    fma(remainder, inv_scale, first)
}

/// Bits of an f32 whose low byte is the INT8 code of `x / scale`, bit-identical to the spec's
/// `clamp(round_half_even(x / s), ±127)`: the quotient rounded by adding `1.5 * 2^23` (the
/// f32 addition rounds to an integer, half to even, and leaves it in the low bits as two's
/// complement). No clamp: quotients of a row are within `127 (1 + 2^-23)` and round to at
/// most 127 (`crate::rounding`).
#[cube]
fn int8_code_bits(x: f32, scale: f32, inv_scale: f32) -> u32 {
    u32::reinterpret(quotient(x, scale, inv_scale) + ROUNDING_MAGIC)
}

/// The f32 quotient converted to FP8 for `x / scale`, clamped to ±448 (which equals
/// saturation). Same operations as the host mirror [`crate::rounding::fp8_quotient`].
#[cube]
fn fp8_quotient(x: f32, scale: f32, inv_scale: f32) -> f32 {
    f32::clamp(quotient(x, scale, inv_scale), -FP8_MAX, FP8_MAX)
}

/// E4M3 code (low byte) of `y`, `|y| <= 448`, rounded to nearest even: integer arithmetic on
/// the f32 bits. CubeCL 0.10 casts to FP8 through `__nv_cvt_float_to_fp8(.., __NV_NOSAT, ..)`,
/// which CUDA emulates in software (only the saturating form maps to the hardware `cvt`).
/// Same operations as the host mirror [`crate::rounding::e4m3_bits`].
#[cube]
fn e4m3_bits(y: f32) -> u32 {
    let a = f32::min(f32::abs(y), FP8_MAX);
    let bits = u32::reinterpret(a);
    // Normal: drop 20 significand bits with round-half-even, rebias the exponent (127 -> 7).
    let normal = ((bits + 0x7_FFFFu32 + ((bits >> 20) & 1u32)) >> 20) - E4M3_REBIAS;
    // Subnormal: quanta of 2^-9, rounded by the magic addition.
    let subnormal = u32::reinterpret(a * 512.0 + ROUNDING_MAGIC) - ROUNDING_MAGIC_BITS;
    let code = select(a < FP8_MIN_NORMAL, subnormal, normal);
    code | ((u32::reinterpret(y) >> 24) & 0x80u32)
}

/// Quantizes `x / scale` to the output type: the 8-bit code of [`code_bits`] (bit-identical
/// to the spec's division), or a plain cast for float modes.
#[cube]
fn quantize<Q: Scalar>(x: f32, scale: f32, inv_scale: f32, #[comptime] mode: LiftMode) -> Q {
    match comptime!(mode) {
        LiftMode::Float => Q::cast_from(x),
        _ => Q::reinterpret(u8::cast_from(code_bits(x, scale, inv_scale, mode))),
    }
}

/// The INT8 or FP8 code of `x / scale` in the low byte (higher bits undefined).
#[cube]
fn code_bits(x: f32, scale: f32, inv_scale: f32, #[comptime] mode: LiftMode) -> u32 {
    match comptime!(mode) {
        LiftMode::Fp8 => e4m3_bits(fp8_quotient(x, scale, inv_scale)),
        _ => int8_code_bits(x, scale, inv_scale),
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
/// `(2n-2):2n`. `k_slide` is `K` for the dense baseline. With `permuted`, the layer's input
/// permutation `perm [K]` (`perm[j]`: the input channel of position `j`) is folded into the
/// map: `X'[m, o] = X[m, perm[src(o)]]` (otherwise `perm` is not read). The host guarantees
/// `K % VI == 0`, `K' % VO == 0`, `VO % 4 == 0` and `staged >= K` when staged.
///
/// `_input_type` names `F`'s storage type: CubeCL 0.10 compiles `F: Float` as a dynamic type, and
/// only a `#[define]`d argument puts it into the kernel's cache key (without it, an f32 and a
/// bf16 launch with equal comptime arguments share one compiled kernel).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn quant_lift_kernel<F: Float, Q: Scalar, VI: Size, VO: Size>(
    x: &Array<Vector<F, VI>>,
    perm: &Array<u32>,
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
    #[comptime] permuted: bool,
    #[define(F)] _input_type: StorageType,
) {
    let vi = x.vector_size().comptime();
    let vo = out.vector_size().comptime();
    let row = CUBE_POS;
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
            let found = vector_absmax_and_flag(v);
            amax = f32::max(amax, found[0]);
            bad = f32::max(bad, found[1]);
            if comptime!(staged > 0) {
                #[unroll]
                for l in 0..vi {
                    stage[i * vi + l] = v[l];
                }
            }
            i += CUBE_DIM as usize;
        }
    }
    // Also the barrier that makes the staged row visible to every unit.
    let reduced = cube_max_pair(amax, bad, 0);
    // Rows that write real values: padding rows and (8-bit modes) rows holding NaN/Inf
    // write zeros. Float modes pass non-finite values through (IEEE semantics).
    let bad = non_finite(reduced);
    let row_ok = real_row && (bad == 0.0 || !quantized);
    let scale = row_scale(reduced[0], bad, real_row, nan, mode);
    let mut divisor = 1.0f32;
    if row_ok {
        divisor = scale;
    }
    let inv_divisor = 1.0f32 / divisor;
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
            let mut src = src0 + comptime!(l % 4);
            let valid = row_ok && o < k_slide as usize && src < k as usize;
            let mut value = 0.0f32;
            if valid {
                if comptime!(permuted) {
                    src = perm[src] as usize;
                }
                if comptime!(staged > 0) {
                    value = f32::cast_from(stage[src]);
                } else {
                    value = f32::cast_from(x[in_row + src][0]);
                }
            }
            codes[l] = quantize::<Q>(value, divisor, inv_divisor, mode);
        }
        out[out_base + j] = codes;
        j += CUBE_DIM as usize;
    }
}

/// `X [M, K]` -> `X' [M_pad, K']` codes + `s_x [M_pad]`, the fast path for rows of whole
/// 16-byte input vectors (`K % VI == 0`, `VI` = 16 bytes): same contract and same codes as
/// [`fn@quant_lift_kernel`], other layout of the work.
///
/// The row is cut into groups of four pattern blocks ([`group_input_len`] inputs ->
/// [`group_output_len`] outputs, both whole vectors; `crate::grouping`). Each unit of a cube
/// owns `groups_per_unit` groups of a row and keeps their input in registers:
/// 1. load the groups' input vectors (16-byte loads; vectors past `K` are zeros) and reduce
///    the absmax;
/// 2. quantize each input element once (not once per lifted copy), then assemble the output
///    vectors by a lift map that is a compile-time constant within a group: no index
///    arithmetic, no shared memory, 16-byte stores. 8-bit codes are packed four to a `u32`
///    word (`Q` is `u32` for the 8-bit modes; `out` holds words) and each output word, one
///    2:4 window, is a packed word or a funnel shift of two (`lift_packed_codes`).
///
/// A cube handles rows `CUBE_POS`, `CUBE_POS + CUBE_COUNT`, ... and loads the next row's
/// groups before it reduces, quantizes and stores the current one, so that its loads stay in
/// flight across the barrier and the stores (with one cube per row, each cube's load latency
/// is exposed once per row).
///
/// Output vectors past the last group's (the `K'` alignment tail) are written as zeros. The
/// host guarantees `K % VI == 0`, `K' % VO == 0` and `groups_per_unit * CUBE_DIM` groups
/// cover the row.
///
/// With `permuted > 0` the layer's input permutation `perm [K]` is folded into the lift
/// (`X'[m, o] = X[m, perm[src(o)]]`): each row is first staged in shared memory (`permuted`
/// elements, at least `K`) with the same 16-byte loads, then every unit gathers its groups'
/// inputs from there through `perm`; the rest is the same. The host guarantees no prefetch
/// and no staged stores then (`perm` is not read otherwise).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn quant_lift_grouped_kernel<F: Float, Q: Scalar, VI: Size, VO: Size>(
    x: &Array<Vector<F, VI>>,
    perm: &Array<u32>,
    out: &mut Array<Vector<Q, VO>>,
    scales: &mut Array<f32>,
    m: u32,
    m_pad: u32,
    k: u32,
    k_prime: u32,
    nan: f32,
    #[comptime] n: u32,
    #[comptime] mode: LiftMode,
    #[comptime] layout: GroupedLayout,
    #[comptime] permuted: usize,
    #[define(F)] _input_type: StorageType,
) {
    let vi = x.vector_size().comptime();
    let in_vectors = comptime!(group_input_len(n) / vi);
    let held_len = comptime!(layout.groups_per_unit * group_input_len(n) / vi);
    let row_in_vectors = (k as usize) / vi;
    let mut row = CUBE_POS;
    let mut held = Array::<Vector<F, VI>>::new(held_len);
    let mut ahead =
        Array::<Vector<F, VI>>::new(comptime!(if layout.prefetch { held_len } else { 1 }));
    if comptime!(layout.prefetch) {
        load_groups(
            x,
            &mut held,
            row,
            m,
            row_in_vectors,
            layout.groups_per_unit,
            in_vectors,
        );
    }
    let mut slot = 0usize;
    while row < m_pad as usize {
        let next = row + CUBE_COUNT;
        if comptime!(layout.prefetch) {
            load_groups(
                x,
                &mut ahead,
                next,
                m,
                row_in_vectors,
                layout.groups_per_unit,
                in_vectors,
            );
        } else if comptime!(permuted > 0) {
            gather_groups(
                x,
                perm,
                &mut held,
                row,
                m,
                k,
                row_in_vectors,
                layout.groups_per_unit,
                in_vectors,
                permuted,
            );
        } else {
            load_groups(
                x,
                &mut held,
                row,
                m,
                row_in_vectors,
                layout.groups_per_unit,
                in_vectors,
            );
        }
        quantize_lift_row(
            &held,
            out,
            scales,
            row,
            row < m as usize,
            k,
            k_prime,
            nan,
            slot,
            n,
            mode,
            layout,
        );
        if comptime!(layout.prefetch) {
            #[unroll]
            for i in 0..held_len {
                held[i] = ahead[i];
            }
        }
        row = next;
        slot = 1 - slot;
    }
}

/// How [`fn@quant_lift_grouped_kernel`] lays out its work (compile-time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupedLayout {
    /// Units per cube (the launch's cube size).
    pub units: usize,
    /// Groups of four pattern blocks each unit holds per row.
    pub groups_per_unit: usize,
    /// Load the cube's next row into a second set of registers before quantizing the
    /// current one (for cubes that handle several rows).
    pub prefetch: bool,
    /// Store through shared memory, one warp's lifted vectors at a time, so that each store
    /// instruction writes 32 consecutive 16-byte vectors (whole sectors) instead of one
    /// vector per group at a group's stride.
    pub staged_stores: bool,
}

/// One row's groups of this unit into `held` (zeros past `K` and for rows `>= m`).
///
/// A unit whose groups all lie within a real row (all but the last units of a row) loads
/// without a bounds test: a per-vector test compiles to a select per 16-bit lane.
#[cube]
fn load_groups<F: Float, VI: Size>(
    x: &Array<Vector<F, VI>>,
    held: &mut Array<Vector<F, VI>>,
    row: usize,
    m: u32,
    row_in_vectors: usize,
    #[comptime] groups_per_unit: usize,
    #[comptime] in_vectors: usize,
) {
    let real_row = row < m as usize;
    let last_group = UNIT_POS as usize + (groups_per_unit - 1) * CUBE_DIM as usize;
    let base = row * row_in_vectors;
    if real_row && (last_group + 1) * in_vectors <= row_in_vectors {
        #[unroll]
        for g in 0..groups_per_unit {
            let group = UNIT_POS as usize + g * CUBE_DIM as usize;
            #[unroll]
            for v in 0..in_vectors {
                held[g * in_vectors + v] = x[base + group * in_vectors + v];
            }
        }
    } else {
        #[unroll]
        for g in 0..groups_per_unit {
            let group = UNIT_POS as usize + g * CUBE_DIM as usize;
            #[unroll]
            for v in 0..in_vectors {
                let index = group * in_vectors + v;
                let mut value = Vector::<F, VI>::new(F::new(0.0));
                if real_row && index < row_in_vectors {
                    value = x[base + index];
                }
                held[g * in_vectors + v] = value;
            }
        }
    }
}

/// One row's groups of this unit into `held` through the input permutation: the row staged
/// in shared memory (`staged >= K` elements) with whole-vector loads by every unit, then each
/// held element gathered from there, `held[p] = X[row, perm[p]]` (zeros past `K` and for
/// rows `>= m`).
///
/// Barriers: the one after staging makes the row visible to every unit; the next row's
/// staging overwrites it only after [`quantize_lift_row`]'s block reduction, which every
/// unit enters after its gathers.
#[cube]
#[allow(clippy::too_many_arguments)]
fn gather_groups<F: Float, VI: Size>(
    x: &Array<Vector<F, VI>>,
    perm: &Array<u32>,
    held: &mut Array<Vector<F, VI>>,
    row: usize,
    m: u32,
    k: u32,
    row_in_vectors: usize,
    #[comptime] groups_per_unit: usize,
    #[comptime] in_vectors: usize,
    #[comptime] staged: usize,
) {
    let vi = VI::value().comptime();
    let mut stage = SharedMemory::<F>::new(staged);
    let real_row = row < m as usize;
    if real_row {
        let base = row * row_in_vectors;
        let mut i = UNIT_POS as usize;
        while i < row_in_vectors {
            let v = x[base + i];
            #[unroll]
            for l in 0..vi {
                stage[i * vi + l] = v[l];
            }
            i += CUBE_DIM as usize;
        }
    }
    sync_cube();
    #[unroll]
    for g in 0..groups_per_unit {
        let group = UNIT_POS as usize + g * CUBE_DIM as usize;
        #[unroll]
        for v in 0..in_vectors {
            let first = (group * in_vectors + v) * vi;
            let mut value = Vector::<F, VI>::new(F::new(0.0));
            #[unroll]
            for l in 0..vi {
                let p = first + l;
                if real_row && p < k as usize {
                    value[l] = stage[perm[p] as usize];
                }
            }
            held[g * in_vectors + v] = value;
        }
    }
}

/// The row's scale from the groups the units hold (one block reduction), then its codes
/// ([`lift_groups`]) and the `K'` alignment tail as zeros; padding rows and (8-bit modes)
/// rows holding NaN/Inf are all zeros. The branch is uniform over the cube (one row), so
/// real rows quantize without a per-element test.
#[cube]
#[allow(clippy::too_many_arguments)]
fn quantize_lift_row<F: Float, Q: Scalar, VI: Size, VO: Size>(
    held: &Array<Vector<F, VI>>,
    out: &mut Array<Vector<Q, VO>>,
    scales: &mut Array<f32>,
    row: usize,
    real_row: bool,
    k: u32,
    k_prime: u32,
    nan: f32,
    slot: usize,
    #[comptime] n: u32,
    #[comptime] mode: LiftMode,
    #[comptime] layout: GroupedLayout,
) {
    let vi = VI::value().comptime();
    let vo = out.vector_size().comptime();
    let quantized = comptime!(mode != LiftMode::Float);
    let row_out_vectors = (k_prime as usize) / comptime!(vo * codes_per_element(mode));

    let mut amax = 0.0f32;
    let mut bad = 0.0f32;
    #[unroll]
    for i in 0..comptime!(layout.groups_per_unit * group_input_len(n) / vi) {
        let found = vector_absmax_and_flag(held[i]);
        amax = f32::max(amax, found[0]);
        bad = f32::max(bad, found[1]);
    }
    let reduced = cube_max_pair(amax, bad, slot);
    let bad = non_finite(reduced);
    let row_ok = real_row && (bad == 0.0 || !quantized);
    let scale = row_scale(reduced[0], bad, real_row, nan, mode);
    if UNIT_POS == 0 {
        scales[row] = scale;
    }

    let mut zeros_from = 0usize;
    if row_ok {
        lift_groups(held, out, row, k, row_out_vectors, scale, n, mode, layout);
        zeros_from = (k as usize).div_ceil(comptime!(group_input_len(n)))
            * comptime!(group_output_len(n) / (vo * codes_per_element(mode)));
    }
    let mut j = zeros_from + UNIT_POS as usize;
    while j < row_out_vectors {
        out[row * row_out_vectors + j] = Vector::<Q, VO>::new(Q::cast_from(0.0f32));
        j += CUBE_DIM as usize;
    }
}

/// The codes of a real row's groups this unit holds, each group's lifted output vectors built
/// by [`lift_packed_codes`] (8-bit modes: packed words) or [`lift_values`] (float lift) and
/// stored directly or (staged stores) through shared memory one warp's outputs at a time.
#[cube]
#[allow(clippy::too_many_arguments)]
fn lift_groups<F: Float, Q: Scalar, VI: Size, VO: Size>(
    held: &Array<Vector<F, VI>>,
    out: &mut Array<Vector<Q, VO>>,
    row: usize,
    k: u32,
    row_out_vectors: usize,
    scale: f32,
    #[comptime] n: u32,
    #[comptime] mode: LiftMode,
    #[comptime] layout: GroupedLayout,
) {
    let vi = VI::value().comptime();
    let vo = out.vector_size().comptime();
    let in_len = comptime!(group_input_len(n));
    let in_vectors = comptime!(group_input_len(n) / vi);
    let out_vectors = comptime!(group_output_len(n) / (vo * codes_per_element(mode)));
    let groups = (k as usize).div_ceil(in_len);
    let inv_scale = 1.0f32 / scale;

    let mut stage = SharedMemory::<Vector<Q, VO>>::new(comptime!(if layout.staged_stores {
        layout.units * out_vectors
    } else {
        1
    }));
    #[unroll]
    for g in 0..layout.groups_per_unit {
        let group = UNIT_POS as usize + g * CUBE_DIM as usize;
        if comptime!(layout.staged_stores) {
            // The warp's previous reads of the stage are done before it is overwritten.
            sync_plane();
        }
        if group < groups {
            let first = g * in_vectors;
            let mut lifted = Array::<Vector<Q, VO>>::new(out_vectors);
            if comptime!(mode == LiftMode::Float) {
                lift_values(held, &mut lifted, first, n);
            } else {
                lift_packed_codes(held, &mut lifted, first, scale, inv_scale, n, mode);
            }
            #[unroll]
            for ov in 0..out_vectors {
                if comptime!(layout.staged_stores) {
                    stage[UNIT_POS as usize * out_vectors + ov] = lifted[ov];
                } else {
                    let j = group * out_vectors + ov;
                    if j < row_out_vectors {
                        out[row * row_out_vectors + j] = lifted[ov];
                    }
                }
            }
        }
        if comptime!(layout.staged_stores) {
            // The warp's groups are consecutive, and so are their outputs: lane `l` stores
            // the warp's output vectors `l`, `l + 32`, ...
            sync_plane();
            let first_unit = (UNIT_POS / PLANE_DIM * PLANE_DIM) as usize;
            let first_out = (first_unit + g * CUBE_DIM as usize) * out_vectors;
            let end = usize::min(groups * out_vectors, row_out_vectors);
            #[unroll]
            for i in 0..out_vectors {
                let local = UNIT_POS_PLANE as usize + i * PLANE_DIM as usize;
                let j = first_out + local;
                if j < end {
                    out[row * row_out_vectors + j] = stage[first_unit * out_vectors + local];
                }
            }
        }
    }
}

/// Output elements per code: 8-bit codes travel as `u32` words of four (`Q = u32`), float
/// lifts as one value per element.
fn codes_per_element(mode: LiftMode) -> usize {
    match mode {
        LiftMode::Float => 1,
        _ => 4,
    }
}

/// One group's lifted 8-bit codes as `u32` words (`Q = u32`): each input quantized once and
/// packed four codes to a word; every output word is one 2:4 window, which starts on an even
/// code of the group, so it is one packed word or (starting mid-word) the upper half of one
/// and the lower half of the next: a funnel shift, no per-byte assembly.
#[cube]
#[allow(clippy::too_many_arguments)]
fn lift_packed_codes<F: Float, Q: Scalar, VI: Size, VO: Size>(
    held: &Array<Vector<F, VI>>,
    lifted: &mut Array<Vector<Q, VO>>,
    first: usize,
    scale: f32,
    inv_scale: f32,
    #[comptime] n: u32,
    #[comptime] mode: LiftMode,
) {
    let vi = VI::value().comptime();
    let vo = VO::value().comptime();
    let words_in = comptime!(group_input_len(n) / 4);
    let mut words = Array::<u32>::new(words_in);
    #[unroll]
    for w in 0..words_in {
        let mut word = 0u32;
        #[unroll]
        for b in 0..4usize {
            let e = comptime!(w * 4 + b);
            let value = f32::cast_from(held[first + comptime!(e / vi)][comptime!(e % vi)]);
            let code = code_bits(value, scale, inv_scale, mode) & 0xFFu32;
            word |= code << comptime!(8 * b as u32);
        }
        words[w] = word;
    }
    #[unroll]
    for ov in 0..comptime!(group_output_len(n) / (4 * vo)) {
        let mut vector = Vector::<Q, VO>::empty();
        #[unroll]
        for l in 0..vo {
            let src = comptime!(group_source(4 * (ov * vo + l), n));
            let mut word = words[comptime!(src / 4)];
            if comptime!(src % 4 != 0) {
                word = (word >> 16u32) | (words[comptime!(src / 4 + 1)] << 16u32);
            }
            vector[l] = Q::reinterpret(word);
        }
        lifted[ov] = vector;
    }
}

/// One group's lifted values for the float modes (BF16/F16 lift, no quantization): the
/// output vectors gathered by the group's compile-time lift map.
#[cube]
fn lift_values<F: Float, Q: Scalar, VI: Size, VO: Size>(
    held: &Array<Vector<F, VI>>,
    lifted: &mut Array<Vector<Q, VO>>,
    first: usize,
    #[comptime] n: u32,
) {
    let vi = VI::value().comptime();
    let vo = VO::value().comptime();
    #[unroll]
    for ov in 0..comptime!(group_output_len(n) / vo) {
        let mut vector = Vector::<Q, VO>::empty();
        #[unroll]
        for l in 0..vo {
            let src = comptime!(group_source(ov * vo + l, n));
            vector[l] = Q::cast_from(held[first + comptime!(src / vi)][comptime!(src % vi)]);
        }
        lifted[ov] = vector;
    }
}
