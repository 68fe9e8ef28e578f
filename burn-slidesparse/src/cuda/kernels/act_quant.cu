// Per-token INT8 quantization of a decode step's activations that no norm produces: the
// attention's output (before the o projection) and the SiLU-gated product of the fused
// gate/up projection's output (before the down projection), one CTA per row, the row held in
// registers (`quantize.cuh`). The product is `silu_mul.cu`'s, rounded to 16 bits the same way.

#include "quantize.cuh"

#define QUANT_THREADS 512
// 8-value chunks of a row each thread keeps: rows up to 8 * QUANT_CHUNKS * QUANT_THREADS.
#define QUANT_CHUNKS 8

// Must match `ActQuantParams` in decode_step.rs (repr(C)).
struct ActQuantParams {
    u64 x;              // [rows, width] (copy) or [rows, 2 width] = [gate | up] (SiLU-gated)
    u64 out;            // the activation [rows, width] (0: not written)
    u64 codes, scales;  // INT8 [rows, codes_stride], f32 [rows]
    int rows, width, codes_stride;
};

// One CTA per row: the activation (x itself, or silu(gate) * up rounded to 16 bits as
// `silu_mul` rounds it) quantized. Width a multiple of 8 up to 8 * QUANT_CHUNKS *
// QUANT_THREADS, 16-byte aligned rows (the host checks).
template <bool BF16, bool SILU>
__device__ __forceinline__ void act_quant(const ActQuantParams& p) {
    __shared__ float red[QUANT_THREADS / 32];
    allow_dependents();
    const i64 row = blockIdx.x;
    const int chunks = p.width / 8;
    const u16* x = (const u16*)p.x + row * (SILU ? 2 : 1) * p.width;
    Vec8 v[QUANT_CHUNKS];
#pragma unroll
    for (int c = 0; c < QUANT_CHUNKS; ++c) {
        const int j = threadIdx.x + c * QUANT_THREADS;
        if (j < chunks) {
            if (SILU) {
                const Vec8 gate = ((const Vec8*)x)[j], up = ((const Vec8*)(x + p.width))[j];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float g0 = lo16<BF16>(gate.v[k]), g1 = hi16<BF16>(gate.v[k]);
                    v[c].v[k] = pack2<BF16>(g0 / (1.f + __expf(-g0)) * lo16<BF16>(up.v[k]),
                                            g1 / (1.f + __expf(-g1)) * hi16<BF16>(up.v[k]));
                }
            } else {
                v[c] = ((const Vec8*)x)[j];
            }
            if (p.out) ((Vec8*)((u16*)p.out + row * p.width))[j] = v[c];
        }
    }
    quantize_held<BF16, QUANT_THREADS, QUANT_CHUNKS>(v, chunks, (signed char*)p.codes + row * p.codes_stride,
                                                     (float*)p.scales + row, red);
}

#define INSTANTIATE_ACT_QUANT(NAME, BF16)                                                              \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS) quant_rows_##NAME(ActQuantParams p) {    \
        act_quant<BF16, false>(p);                                                                      \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS) silu_mul_quant_##NAME(ActQuantParams p) { \
        act_quant<BF16, true>(p);                                                                       \
    }

INSTANTIATE_ACT_QUANT(bf16, true)
INSTANTIATE_ACT_QUANT(f16, false)
