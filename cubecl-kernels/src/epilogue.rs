//! Dequantization + bias: `Y[m, n] = acc[m, n] * s_x[m] * s_w[n] + b[n]`.
//!
//! `acc` is the GEMM output `[M_pad, N_pad]` (row-major, INT32 or FP32/BF16); only the first
//! `M` rows and `N` columns are read, and `Y` is written as `[M, N]`.

use cubecl::prelude::*;

/// Units per cube of the epilogue.
pub const EPILOGUE_CUBE_DIM: u32 = 256;

/// One unit per output element. `has_bias` selects whether `bias` is read.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn dequant_bias_kernel<A: Scalar, O: Float>(
    acc: &Array<A>,
    token_scales: &Array<f32>,
    channel_scales: &Array<f32>,
    bias: &Array<f32>,
    out: &mut Array<O>,
    m: u32,
    n: u32,
    n_pad: u32,
    #[comptime] has_bias: bool,
) {
    let pos = ABSOLUTE_POS;
    let n = n as usize;
    if pos >= (m as usize) * n {
        terminate!();
    }
    let row = pos / n;
    let col = pos % n;
    let a = f32::cast_from(acc[row * (n_pad as usize) + col]);
    let mut y = a * token_scales[row] * channel_scales[col];
    if comptime!(has_bias) {
        y += bias[col];
    }
    out[pos] = O::cast_from(y);
}
