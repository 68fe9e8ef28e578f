// The kernels that open and close a decode step replayed as one CUDA graph: the embedding
// gather of the step's tokens, and the greedy argmax that writes the next step's tokens and
// advances the cache position on the device (so that the next replay needs nothing from the
// host).

#include "common.cuh"

// Must match `EmbedParams` in decode_step.rs (repr(C)).
struct EmbedParams {
    u64 tokens;  // u32 [rows]
    u64 table;   // [vocab, width], 16-bit
    u64 out;     // [rows, width]
    int rows, width, vocab;
};

// One CTA per row: the token's embedding row (NaN for a token past the vocabulary).
__device__ __forceinline__ void embed(const EmbedParams& p) {
    allow_dependents();
    const int row = blockIdx.x;
    const u32 token = ((const u32*)p.tokens)[row];
    u16* out = (u16*)p.out + (i64)row * p.width;
    const u16* src = (const u16*)p.table + (i64)token * p.width;
    for (int i = threadIdx.x; i < p.width; i += blockDim.x) out[i] = token < (u32)p.vocab ? src[i] : (u16)0x7fc0;
}

// Must match `ArgmaxParams` in decode_step.rs (repr(C)).
struct ArgmaxParams {
    u64 logits;   // [rows, vocab], 16-bit
    u64 tokens;   // u32 [rows]: the greedy next tokens
    u64 advance;  // i32: the cache position, += `by` once the step is done (0: none)
    int rows, vocab, by;
};

#define ARGMAX_THREADS 1024

// Whether (v, i) comes before (w, j): the larger value, NaN above everything (as
// torch.argmax), the lower index among equals.
__device__ __forceinline__ bool before(float v, int i, float w, int j) {
    const bool vn = v != v, wn = w != w;
    if (vn || wn) return vn && (!wn || i < j);
    return v > w || (v == w && i < j);
}

// One CTA per row: the index of the row's largest logit.
template <bool BF16>
__device__ __forceinline__ void argmax(const ArgmaxParams& p) {
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const int row = blockIdx.x;
    const u16* logits = (const u16*)p.logits + (i64)row * p.vocab;
    float best = -__int_as_float(0x7f800000);
    int at = p.vocab;
    for (int i = threadIdx.x; i < p.vocab; i += ARGMAX_THREADS) {
        const float v = from16<BF16>(logits[i]);
        if (before(v, i, best, at)) { best = v; at = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, best, o);
        const int j = __shfl_xor_sync(0xffffffffu, at, o);
        if (before(w, j, best, at)) { best = w; at = j; }
    }
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = best; si[threadIdx.x >> 5] = at; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w)
            if (before(sv[w], si[w], best, at)) { best = sv[w]; at = si[w]; }
        ((u32*)p.tokens)[row] = (u32)min(at, p.vocab - 1);
        if (p.advance && row == 0) *(int*)p.advance += p.by;
    }
}

extern "C" __global__ void embed_rows(EmbedParams p) { embed(p); }
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_bf16(ArgmaxParams p) { argmax<true>(p); }
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax_f16(ArgmaxParams p) { argmax<false>(p); }
