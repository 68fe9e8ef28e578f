// Per-token INT8 quantization of a row a CTA holds in registers, fused into the kernel that
// produces the row (RMSNorm, the SiLU-gated product): the INT8 GEMV of a decode step reads its
// codes, and the quantization costs neither a launch nor a read of the row.
//
// The spec's quantization, bit for bit as the quant+lift kernel computes it
// (`cubecl-kernels/src/rounding.rs`): scale = max(absmax, 1e-12) / 127 (f32 division); code =
// round-half-even of the correctly rounded quotient x / scale, clamped to +-127 (the clamp
// never binds: |x / s| <= 127 after rounding); a row holding NaN or +-Inf gets the scale NaN
// and zero codes, so the GEMV's output row is NaN.

#include "common.cuh"

__device__ __forceinline__ int int8_code(float x, float scale) {
    const int q = __float2int_rn(__fdiv_rn(x, scale));
    return max(-127, min(127, q));
}

// The row's values are Vec8 chunks j = threadIdx.x + c * THREADS < chunks of each thread;
// reduced over the CTA (`red`: THREADS / 32 floats, its barriers included), the scale written
// by thread 0 and every chunk's 8 codes by its thread.
template <bool BF16, int THREADS, int CHUNKS>
__device__ __forceinline__ void quantize_held(const Vec8 (&v)[CHUNKS], int chunks, signed char* codes,
                                              float* scale_out, float* red) {
    float amax = 0.f, nan = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        if (threadIdx.x + c * THREADS < chunks) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float a = lo16<BF16>(v[c].v[k]), b = hi16<BF16>(v[c].v[k]);
                if (a != a || b != b) nan = 1.f;
                amax = fmaxf(amax, fmaxf(fabsf(a), fabsf(b)));
            }
        }
    }
    amax = block_reduce<THREADS, true>(amax, red);
    nan = block_reduce<THREADS, true>(nan, red);
    const bool bad = nan > 0.f || isinf(amax);
    const float scale = bad ? __int_as_float(0x7fc00000) : __fdiv_rn(fmaxf(amax, 1e-12f), 127.f);
    if (threadIdx.x == 0) *scale_out = scale;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int j = threadIdx.x + c * THREADS;
        if (j < chunks) {
            u32 w[2] = {0u, 0u};
            if (!bad) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const u32 a = (u32)(int8_code(lo16<BF16>(v[c].v[k]), scale) & 0xff);
                    const u32 b = (u32)(int8_code(hi16<BF16>(v[c].v[k]), scale) & 0xff);
                    w[k >> 1] |= (a | (b << 8)) << (16 * (k & 1));
                }
            }
            ((uint2*)codes)[j] = make_uint2(w[0], w[1]);
        }
    }
}
