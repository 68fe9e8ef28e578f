// RoPE on the q and k heads of a fused qkv projection's output, with k and v written into
// the KV cache in place: one launch where burn queues its `RotaryEncoding` and two
// `slice_assign`s. 16-bit elements (bf16 or f16), f32 arithmetic, one rounding per output.

#include "common.cuh"

// Must match `RopeParams` in block_steps.rs (repr(C)).
struct RopeParams {
    u64 qkv;    // [batch * t, (hq + 2 * hkv) * d]: q heads, k heads, v heads
    u64 table;  // burn's RotaryEncoding table [max_len, d, (cos, sin)], 16-bit, strided
    u64 q;      // out: [batch, t, hq, d]
    u64 k, v;   // caches [batch, capacity, hkv, d], written at positions start..start + t
    int batch, t, hq, hkv, d, start, capacity;
    i64 table_strides[3];  // in elements: position, element j < d (read at j = 2i), cos/sin
    u64 start_at;          // nonzero: the first position is read here on the device (graphs)
};

// One CTA per (token, head), one thread per pair (2i, 2i + 1): q and k heads rotated
// (out[2i] = a cos - b sin, out[2i+1] = a sin + b cos, burn's `RotaryEncoding::apply`), q
// heads written to `q`, k and v heads into the caches at the token's position.
template <bool BF16>
__device__ __forceinline__ void rope_cache(const RopeParams& p) {
    const int row = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    const int start = p.start_at ? *(const int*)p.start_at : p.start;
    const int b = row / p.t, pos = start + (row - b * p.t);
    const int heads = p.hq + 2 * p.hkv;
    const u32 pair = ((const u32*)((const u16*)p.qkv + ((i64)row * heads + h) * p.d))[i];
    u32 value = pair;
    if (h < p.hq + p.hkv) {
        const u16* cs = (const u16*)p.table + (i64)pos * p.table_strides[0] + (i64)(2 * i) * p.table_strides[1];
        const float c = from16<BF16>(cs[0]), s = from16<BF16>(cs[p.table_strides[2]]);
        const float a = from16<BF16>((u16)(pair & 0xffffu)), bb = from16<BF16>((u16)(pair >> 16));
        value = pack2<BF16>(a * c - bb * s, a * s + bb * c);
    }
    u16* dst;
    if (h < p.hq) {
        dst = (u16*)p.q + ((i64)row * p.hq + h) * p.d;
    } else {
        const bool is_k = h < p.hq + p.hkv;
        const int kvh = is_k ? h - p.hq : h - p.hq - p.hkv;
        dst = (u16*)(is_k ? p.k : p.v) + (((i64)b * p.capacity + pos) * p.hkv + kvh) * p.d;
    }
    ((u32*)dst)[i] = value;
}

extern "C" __global__ void rope_cache_bf16(RopeParams p) { rope_cache<true>(p); }
extern "C" __global__ void rope_cache_f16(RopeParams p) { rope_cache<false>(p); }
