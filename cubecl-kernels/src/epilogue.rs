//! Dequantization + bias: `Y[m, n] = acc[m, n] * s_x[m] * s_w[n] + b[n]`.
//!
//! `acc` is the GEMM output `[M_pad, N_pad]` (row-major, INT32, FP32, BF16 or F16); only the
//! first `M` rows and `N` columns are read, and `Y` is written as `[M, N]`. When the GEMM
//! already applied the per-channel scale (cuSPARSELt's alpha vector), `channel_scaled`
//! skips `s_w`.

use cubecl::prelude::*;

/// Units per cube of the epilogue.
pub const EPILOGUE_CUBE_DIM: u32 = 256;

/// One unit per output vector of `V` elements (the host picks `V` dividing `N`, so a vector
/// never straddles two rows). `has_bias` selects whether `bias` is read. `_output_type` names `O`'s
/// storage type, which puts it into the kernel's cache key (see `quant_lift_kernel`).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn dequant_bias_kernel<A: Scalar, O: Float, V: Size>(
    acc: &Array<Vector<A, V>>,
    token_scales: &Array<f32>,
    channel_scales: &Array<Vector<f32, V>>,
    bias: &Array<Vector<f32, V>>,
    out: &mut Array<Vector<O, V>>,
    m: u32,
    n: u32,
    n_pad: u32,
    #[comptime] has_bias: bool,
    #[comptime] channel_scaled: bool,
    #[define(O)] _output_type: StorageType,
) {
    let v = out.vector_size().comptime();
    let pos = ABSOLUTE_POS;
    let row_vectors = (n as usize) / v;
    if pos >= (m as usize) * row_vectors {
        terminate!();
    }
    let row = pos / row_vectors;
    let col = pos % row_vectors;
    let a = acc[row * ((n_pad as usize) / v) + col];
    let s_x = token_scales[row];
    let mut y = Vector::<O, V>::empty();
    #[unroll]
    for l in 0..v {
        let mut value = f32::cast_from(a[l]) * s_x;
        if comptime!(!channel_scaled) {
            value *= channel_scales[col][l];
        }
        if comptime!(has_bias) {
            value += bias[col][l];
        }
        y[l] = O::cast_from(value);
    }
    out[pos] = y;
}
