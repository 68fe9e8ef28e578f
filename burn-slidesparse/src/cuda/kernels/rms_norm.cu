// RMSNorm over a row, after the residual add when one is given: one launch where burn's
// `RmsNorm` (and the add before it) queues several, which is what bounds decode on the host.
// 16-bit elements (bf16 or f16), f32 arithmetic, one rounding per output. At decode it also
// quantizes the normed row for the INT8 GEMV that reads it (`quantize.cuh`), which saves the
// quantization's own launch and its read of the row.

#include "quantize.cuh"

// Must match `NormParams` in block_steps.rs (repr(C)).
struct NormParams {
    u64 x, delta, gamma;  // x, delta [rows, width] (delta 0: none), gamma [width]
    u64 sum, out;         // sum = x + delta [rows, width] (written when delta is given), out
                          // (0: not written, codes only)
    int rows, width;
    float eps;
    u64 codes, scales;    // 0, or the normed rows' INT8 codes [rows, codes_stride] and f32
    int codes_stride;     // per-row scales (vector path only: the host checks it applies)
};

#define NORM_THREADS 256
// 8-element (16-byte) chunks of a row each thread keeps in registers on the vector path:
// rows up to 8 * NORM_CHUNKS * NORM_THREADS = 8192 values (Llama's 4096, Qwen's 3584).
#define NORM_CHUNKS 4

// a + b per element, rounded to 16 bits (the residual stream the model keeps).
template <bool BF16>
__device__ __forceinline__ Vec8 add8(Vec8 a, Vec8 b) {
    Vec8 r;
#pragma unroll
    for (int k = 0; k < 4; ++k)
        r.v[k] = pack2<BF16>(lo16<BF16>(a.v[k]) + lo16<BF16>(b.v[k]), hi16<BF16>(a.v[k]) + hi16<BF16>(b.v[k]));
    return r;
}

template <bool BF16>
__device__ __forceinline__ float sum_squares8(Vec8 a) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float lo = lo16<BF16>(a.v[k]), hi = hi16<BF16>(a.v[k]);
        s += lo * lo + hi * hi;
    }
    return s;
}

// h * r * gamma per element, one rounding each.
template <bool BF16>
__device__ __forceinline__ Vec8 scale8(Vec8 h, Vec8 gamma, float r) {
    Vec8 out;
#pragma unroll
    for (int k = 0; k < 4; ++k)
        out.v[k] = pack2<BF16>(lo16<BF16>(h.v[k]) * r * lo16<BF16>(gamma.v[k]),
                               hi16<BF16>(h.v[k]) * r * hi16<BF16>(gamma.v[k]));
    return out;
}

// One CTA per row: h = x + delta (rounded to 16 bits: the residual stream the model keeps),
// out = h * rsqrt(mean(h^2) + eps) * gamma.
//
// Vector path (width a multiple of 8 up to 8192, 16-byte aligned rows): each thread loads
// whole 16-byte chunks of x, delta and gamma up front and keeps h and gamma in registers
// across the reduction, so the row costs one round trip to memory before the reduction and
// none after it. A decode step runs this on one row per norm, where those round trips and
// the reduction's barriers are the kernel's time. Other rows take the scalar path.
template <bool BF16>
__device__ __forceinline__ void rms_norm(const NormParams& p) {
    __shared__ float red[NORM_THREADS / 32];
    allow_dependents();
    const i64 row = blockIdx.x;
    const u16* x = (const u16*)p.x + row * p.width;
    const u16* delta = p.delta ? (const u16*)p.delta + row * p.width : nullptr;
    u16* sum = p.delta ? (u16*)p.sum + row * p.width : nullptr;
    const u16* gamma = (const u16*)p.gamma;
    u16* out = (u16*)p.out + row * p.width;
    const u64 addresses = (u64)x | (u64)delta | (u64)sum | (u64)gamma | (u64)out;
    if (p.width % 8 == 0 && p.width <= 8 * NORM_CHUNKS * NORM_THREADS && (addresses & 15) == 0) {
        const int chunks = p.width / 8;
        Vec8 h[NORM_CHUNKS], g[NORM_CHUNKS];
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; ++c) {
            const int j = threadIdx.x + c * NORM_THREADS;
            if (j < chunks) {
                g[c] = ((const Vec8*)gamma)[j];
                Vec8 v = ((const Vec8*)x)[j];
                if (delta) {
                    v = add8<BF16>(v, ((const Vec8*)delta)[j]);
                    ((Vec8*)sum)[j] = v;
                }
                h[c] = v;
                ss += sum_squares8<BF16>(v);
            }
        }
        ss = block_reduce<NORM_THREADS, false>(ss, red);
        const float r = rsqrtf(ss / (float)p.width + p.eps);
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; ++c) {
            const int j = threadIdx.x + c * NORM_THREADS;
            if (j < chunks) {
                h[c] = scale8<BF16>(h[c], g[c], r);
                if (p.out) ((Vec8*)out)[j] = h[c];
            }
        }
        if (p.codes)
            quantize_held<BF16, NORM_THREADS, NORM_CHUNKS>(h, chunks, (signed char*)p.codes + row * p.codes_stride,
                                                           (float*)p.scales + row, red);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < p.width; i += NORM_THREADS) {
        float v = from16<BF16>(x[i]);
        if (delta) {
            const u16 h = to16<BF16>(v + from16<BF16>(delta[i]));
            sum[i] = h;
            v = from16<BF16>(h);
        }
        ss += v * v;
    }
    ss = block_reduce<NORM_THREADS, false>(ss, red);
    const float r = rsqrtf(ss / (float)p.width + p.eps);
    const u16* h = delta ? sum : x;  // this thread's own elements (written above)
    for (int i = threadIdx.x; i < p.width; i += NORM_THREADS)
        out[i] = to16<BF16>(from16<BF16>(h[i]) * r * from16<BF16>(gamma[i]));
}

#define INSTANTIATE_RMS_NORM(NAME, BF16)                                                     \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS) rms_norm_##NAME(NormParams p) { \
        rms_norm<BF16>(p);                                                                   \
    }

INSTANTIATE_RMS_NORM(bf16, true)
INSTANTIATE_RMS_NORM(f16, false)
