// Causal flash attention for burn-slidesparse, compiled at run time with NVRTC (sm_80+).
//
// Layout (row-major, 16-bit elements): Q [batch, tq, hq, D], K and V [batch, capacity, hkv, D]
// with the batch and row strides given in the parameters (a KV cache may be longer than the
// kv_len positions in use), O [batch, tq, hq, D] contiguous. Query i sits at position
// kv_len - tq + i and sees keys 0..=that position. Query head h reads KV head h / (hq / hkv):
// grouped-query attention without expanding K and V.
//
// Tensor cores through mma.sync.m16n8k16 (bf16 or f16 in, f32 accumulation), operands from
// shared memory with ldmatrix, tiles brought in with cp.async (double-buffered), softmax online
// in base 2 (scores pre-multiplied by log2(e) * scale), P kept in registers.

#include "common.cuh"

// Must match `Params` in attention.rs (repr(C)).
struct Params {
    u64 q, k, v, o;
    u64 partial;  // decode with several splits: f32 [splits][rows][D], rows = batch * tq * hq
    u64 lse;      // decode with several splits: f32 [splits][rows] (log2 domain)
    i64 q_batch, q_row, k_batch, k_row, v_batch, v_row;  // strides in elements
    int batch, tq, kv_len, hq, hkv;
    int splits, split_len;  // decode: number of key splits, keys per split (multiple of 64)
    float scale_log2;       // softmax scale * log2(e)
    // Decode inside a CUDA graph: when nonzero, the cache length is `*kv_len_at + kv_len`
    // (positions already in the cache, read on the device at every replay, plus this call's).
    u64 kv_len_at;
};

// The cache length of a decode call: fixed, or read from the device (graph replays).
__device__ __forceinline__ int kv_length(const Params& p) {
    return p.kv_len_at ? *(const int*)p.kv_len_at + p.kv_len : p.kv_len;
}

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared; `valid == false` writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// d += a * b for one 16x8x16 tile.
template <bool BF16>
__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Byte offset of 16-byte chunk `c` of row `r` in a tile of rows of D 16-bit values. The chunk
// index is XORed with the row's low 3 bits so that the 8 rows an ldmatrix phase reads (same
// logical chunk) fall in 8 different bank groups.
template <int D>
__device__ __forceinline__ u32 swz(int r, int c) {
    return (u32)(r * D * 2 + ((c ^ (r & 7)) << 4));
}

// Loads a tile of 64 rows x D from `g` (row stride in elements) into shared memory at `dst`;
// rows from `rows_valid` on are zero-filled (never read from global memory).
template <int D, int THREADS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* g, i64 row_stride, int rows_valid) {
    constexpr int CPR = D / 8;
    constexpr int TOTAL = 64 * CPR;
#pragma unroll
    for (int it = 0; it < TOTAL / THREADS; ++it) {
        const int idx = it * THREADS + (int)threadIdx.x;
        const int r = idx / CPR, c = idx % CPR;
        const bool ok = r < rows_valid;
        const u16* src = ok ? g + (i64)r * row_stride + c * 8 : g;
        cp_async16(dst + swz<D>(r, c), src, ok);
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill: one CTA per (query tile, query head, batch), WARPS warps of 16 query rows each
// (BM = 16 * WARPS queries: 64 or 128; the larger tile halves the K/V traffic from L2).
// Shared memory: Q tile, then 2 stages of (K tile, V tile), 64 keys x D each.
template <bool BF16, int D, int WARPS>
__device__ __forceinline__ void prefill(const Params& p) {
    constexpr int BM = 16 * WARPS, BN = 64, TILE = 64 * D * 2, THREADS = 32 * WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sKV = sQ + (BM / 64) * TILE;  // stage s: K at sKV + s * 2 * TILE, V after it

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x, b = blockIdx.z;
    const int qt = gridDim.y - 1 - blockIdx.y;  // the longest (last) query tiles start first
    const int group = p.hq / p.hkv, kvh = h / group;
    const int start = p.kv_len - p.tq;
    const int q0 = qt * BM;

    const u16* qg = (const u16*)p.q + b * p.q_batch + (i64)q0 * p.q_row + h * D;
    const u16* kg = (const u16*)p.k + b * p.k_batch + kvh * D;
    const u16* vg = (const u16*)p.v + b * p.v_batch + kvh * D;
    // Keys any valid row of this tile sees: 0..key_end.
    const int key_end = start + min(q0 + BM, p.tq);
    const int n_tiles = (key_end + BN - 1) / BN;

#pragma unroll
    for (int part = 0; part < BM / 64; ++part) {
        const int rows = p.tq - q0 - part * 64;
        load_tile<D, THREADS>(sQ + part * TILE, qg + (i64)part * 64 * p.q_row, p.q_row, rows);
    }
    cp_commit();
    load_tile<D, THREADS>(sKV, kg, p.k_row, key_end);
    load_tile<D, THREADS>(sKV + TILE, vg, p.v_row, key_end);
    cp_commit();
    cp_wait<1>();
    __syncthreads();

    // Q as A fragments, kept in registers for the whole loop.
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int r = warp * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
        ldsm_x4(sQ + swz<D>(r, c), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
    }

    float o[D / 8][4];
#pragma unroll
    for (int d = 0; d < D / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int row = q0 + warp * 16 + (lane >> 2);  // rows `row` and `row + 8` of this thread
    const int pos0 = start + row, pos1 = pos0 + 8;
    const float sl2 = p.scale_log2;

    for (int t = 0; t < n_tiles; ++t) {
        const int stage = t & 1;
        if (t + 1 < n_tiles) {
            const int n1 = (t + 1) * BN;
            const u32 dst = sKV + (stage ^ 1) * 2 * TILE;
            load_tile<D, THREADS>(dst, kg + (i64)n1 * p.k_row, p.k_row, key_end - n1);
            load_tile<D, THREADS>(dst + TILE, vg + (i64)n1 * p.v_row, p.v_row, key_end - n1);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const u32 sK = sKV + stage * 2 * TILE, sV = sK + TILE;
        const int n0 = t * BN;

        // S = Q K^T (16 x 64 per warp).
        float s[BN / 8][4];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                u32 b0, b1, b2, b3;
                const int r = j * 8 + (lane & 7), c = kk * 2 + (lane >> 3);
                ldsm_x4(sK + swz<D>(r, c), b0, b1, b2, b3);
                mma<BF16>(s[j], qf[kk], b0, b1);
                mma<BF16>(s[j], qf[kk + 1], b2, b3);
            }
        }
        // Causal mask, only on tiles that reach past the tile's first query position.
        if (n0 + BN - 1 > start + q0) {
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int key = n0 + j * 8 + 2 * (lane & 3);
                if (key > pos0) s[j][0] = NEG_INF;
                if (key + 1 > pos0) s[j][1] = NEG_INF;
                if (key > pos1) s[j][2] = NEG_INF;
                if (key + 1 > pos1) s[j][3] = NEG_INF;
            }
        }
        // Online softmax: new running max, rescale of O and l, P = 2^(s * sl2 - m).
        float x0 = NEG_INF, x1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            x0 = fmaxf(x0, fmaxf(s[j][0], s[j][1]));
            x1 = fmaxf(x1, fmaxf(s[j][2], s[j][3]));
        }
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
        const float n_m0 = fmaxf(m0, x0 * sl2), n_m1 = fmaxf(m1, x1 * sl2);
        // A row with nothing visible yet keeps m = -inf; subtract 0 instead (no inf - inf).
        const float u0 = n_m0 == NEG_INF ? 0.f : n_m0, u1 = n_m1 == NEG_INF ? 0.f : n_m1;
        const float a0 = ex2(m0 - u0), a1 = ex2(m1 - u1);
        m0 = n_m0;
        m1 = n_m1;
        l0 *= a0;
        l1 *= a1;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
            o[d][0] *= a0;
            o[d][1] *= a0;
            o[d][2] *= a1;
            o[d][3] *= a1;
        }
        // The C fragments of key tiles 2kk and 2kk+1 are exactly the A fragment of k-step kk.
        u32 pf[BN / 16][4];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const float p0 = ex2(fmaf(s[j][0], sl2, -u0)), p1 = ex2(fmaf(s[j][1], sl2, -u0));
            const float p2 = ex2(fmaf(s[j][2], sl2, -u1)), p3 = ex2(fmaf(s[j][3], sl2, -u1));
            l0 += p0 + p1;
            l1 += p2 + p3;
            pf[j >> 1][(j & 1) * 2] = pack2<BF16>(p0, p1);
            pf[j >> 1][(j & 1) * 2 + 1] = pack2<BF16>(p2, p3);
        }
        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int jd = 0; jd < D / 8; jd += 2) {
                u32 b0, b1, b2, b3;
                const int r = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), c = jd + (lane >> 4);
                ldsm_x4_t(sV + swz<D>(r, c), b0, b1, b2, b3);
                mma<BF16>(o[jd], pf[kk], b0, b1);
                mma<BF16>(o[jd + 1], pf[kk], b2, b3);
            }
        }
        __syncthreads();  // everyone is done with this stage before it is refilled
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int col = 2 * (lane & 3);
    if (row < p.tq) {
        u16* og = (u16*)p.o + ((i64)(b * p.tq + row) * p.hq + h) * D + col;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) *(u32*)(og + d * 8) = pack2<BF16>(o[d][0] * i0, o[d][1] * i0);
    }
    if (row + 8 < p.tq) {
        u16* og = (u16*)p.o + ((i64)(b * p.tq + row + 8) * p.hq + h) * D + col;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) *(u32*)(og + d * 8) = pack2<BF16>(o[d][2] * i1, o[d][3] * i1);
    }
}

// ---------------------------------------------------------------------------------------------
// Decode (flash-decoding): one CTA per (key split, KV head, batch). Its 16 MMA rows are the
// (query head of the group, query) pairs that share the KV head, group * tq <= 16; the CTA
// streams its split's keys in 64-key tiles (three stages) and each warp takes 16 keys of
// every tile. At the end the 4 warps' (max, sum, O) are merged in shared memory; with one
// split the CTA writes O, otherwise a normalized partial O and its log-sum-exp for `reduce`.
template <bool BF16, int D>
__device__ __forceinline__ void decode(const Params& p) {
    constexpr int BN = 64, TILE = 64 * D * 2, THREADS = 128;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sQ = smem_u32(smem);       // 16 rows x D
    const u32 sKV = sQ + 16 * D * 2;     // 3 stages of (K, V)

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int group = p.hq / p.hkv, rows = group * p.tq;
    const int kv_len = kv_length(p);
    // Splits past the cache (a graph's split count covers its longest cache) see no key: no
    // tile, log-sum-exp -inf, weight 0 in `reduce`.
    const int s0 = split * p.split_len, s1 = min(kv_len, s0 + p.split_len);
    const int n_tiles = (s1 - s0 + BN - 1) / BN;
    const u16* kg = (const u16*)p.k + b * p.k_batch + (i64)s0 * p.k_row + kvh * D;
    const u16* vg = (const u16*)p.v + b * p.v_batch + (i64)s0 * p.v_row + kvh * D;

    // Q rows: r = j * tq + t is query t of head kvh * group + j.
    {
        constexpr int CPR = D / 8;
        for (int idx = threadIdx.x; idx < 16 * CPR; idx += THREADS) {
            const int r = idx / CPR, c = idx % CPR;
            const bool ok = r < rows;
            const int j = ok ? r / p.tq : 0, t = ok ? r % p.tq : 0;
            const u16* src = (const u16*)p.q + b * p.q_batch + t * p.q_row + (kvh * group + j) * D + c * 8;
            cp_async16(sQ + swz<D>(r, c), src, ok);
        }
    }
    cp_commit();
    // Three stages: tiles t + 1 and t + 2 are in flight while tile t is used.
    load_tile<D, THREADS>(sKV, kg, p.k_row, s1 - s0);
    load_tile<D, THREADS>(sKV + TILE, vg, p.v_row, s1 - s0);
    cp_commit();
    if (n_tiles > 1) {
        load_tile<D, THREADS>(sKV + 2 * TILE, kg + (i64)BN * p.k_row, p.k_row, s1 - s0 - BN);
        load_tile<D, THREADS>(sKV + 3 * TILE, vg + (i64)BN * p.v_row, p.v_row, s1 - s0 - BN);
    }
    cp_commit();
    cp_wait<2>();
    __syncthreads();
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int r = lane & 15, c = kk * 2 + (lane >> 4);
        ldsm_x4(sQ + swz<D>(r, c), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
    }

    float o[D / 8][4];
#pragma unroll
    for (int d = 0; d < D / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    const int g = lane >> 2;
    // Positions of this thread's rows g and g + 8 (rows past `rows` are padding).
    const int pos0 = kv_len - p.tq + (g % p.tq), pos1 = kv_len - p.tq + ((g + 8) % p.tq);
    const float sl2 = p.scale_log2;

    for (int t = 0; t < n_tiles; ++t) {
        cp_wait<1>();     // tile t has landed (only the newest group, tile t + 1, may be pending)
        __syncthreads();  // ... for every thread, and everyone is done with tile t - 1
        if (t + 2 < n_tiles) {  // into the stage of tile t - 1
            const int n2 = (t + 2) * BN;
            const u32 dst = sKV + ((t + 2) % 3) * 2 * TILE;
            load_tile<D, THREADS>(dst, kg + (i64)n2 * p.k_row, p.k_row, s1 - s0 - n2);
            load_tile<D, THREADS>(dst + TILE, vg + (i64)n2 * p.v_row, p.v_row, s1 - s0 - n2);
        }
        cp_commit();
        const u32 sK = sKV + (t % 3) * 2 * TILE, sV = sK + TILE;
        const int n0 = s0 + t * BN + warp * 16;  // this warp's first key

        float s[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                u32 b0, b1, b2, b3;
                const int r = warp * 16 + j * 8 + (lane & 7), c = kk * 2 + (lane >> 3);
                ldsm_x4(sK + swz<D>(r, c), b0, b1, b2, b3);
                mma<BF16>(s[j], qf[kk], b0, b1);
                mma<BF16>(s[j], qf[kk + 1], b2, b3);
            }
        }
        if (n0 + 15 >= s1 || n0 + 15 > kv_len - p.tq) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int key = n0 + j * 8 + 2 * (lane & 3);
                if (key >= s1 || key > pos0) s[j][0] = NEG_INF;
                if (key + 1 >= s1 || key + 1 > pos0) s[j][1] = NEG_INF;
                if (key >= s1 || key > pos1) s[j][2] = NEG_INF;
                if (key + 1 >= s1 || key + 1 > pos1) s[j][3] = NEG_INF;
            }
        }
        float x0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        float x1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
        const float n_m0 = fmaxf(m0, x0 * sl2), n_m1 = fmaxf(m1, x1 * sl2);
        const float u0 = n_m0 == NEG_INF ? 0.f : n_m0, u1 = n_m1 == NEG_INF ? 0.f : n_m1;
        const float a0 = ex2(m0 - u0), a1 = ex2(m1 - u1);
        m0 = n_m0;
        m1 = n_m1;
        l0 *= a0;
        l1 *= a1;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
            o[d][0] *= a0;
            o[d][1] *= a0;
            o[d][2] *= a1;
            o[d][3] *= a1;
        }
        u32 pf[4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float p0 = ex2(fmaf(s[j][0], sl2, -u0)), p1 = ex2(fmaf(s[j][1], sl2, -u0));
            const float p2 = ex2(fmaf(s[j][2], sl2, -u1)), p3 = ex2(fmaf(s[j][3], sl2, -u1));
            l0 += p0 + p1;
            l1 += p2 + p3;
            pf[j * 2] = pack2<BF16>(p0, p1);
            pf[j * 2 + 1] = pack2<BF16>(p2, p3);
        }
#pragma unroll
        for (int jd = 0; jd < D / 8; jd += 2) {
            u32 b0, b1, b2, b3;
            const int r = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), c = jd + (lane >> 4);
            ldsm_x4_t(sV + swz<D>(r, c), b0, b1, b2, b3);
            mma<BF16>(o[jd], pf, b0, b1);
            mma<BF16>(o[jd + 1], pf, b2, b3);
        }
    }
    cp_wait<0>();
    __syncthreads();

    // Merge the 4 warps in the K/V stages, free now: each warp writes its weighted rows
    // (only the `rows` in use) to a region of its own, then every output sums four values.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float* sm_m = (float*)(smem + 16 * D * 2);  // [4][16]
    float* sm_l = sm_m + 64;                    // [4][16]
    float* sm_o = sm_l + 64;                    // [4][16][D]
    if ((lane & 3) == 0) {
        sm_m[warp * 16 + g] = m0;
        sm_m[warp * 16 + g + 8] = m1;
        sm_l[warp * 16 + g] = l0;
        sm_l[warp * 16 + g + 8] = l1;
    }
    __syncthreads();
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        mx0 = fmaxf(mx0, sm_m[w * 16 + g]);
        mx1 = fmaxf(mx1, sm_m[w * 16 + g + 8]);
    }
    const float w0 = m0 == NEG_INF ? 0.f : ex2(m0 - mx0), w1 = m1 == NEG_INF ? 0.f : ex2(m1 - mx1);
    const int col = 2 * (lane & 3);
    float* mine = sm_o + warp * 16 * D;
    if (g < rows) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
            mine[g * D + d * 8 + col] = o[d][0] * w0;
            mine[g * D + d * 8 + col + 1] = o[d][1] * w0;
        }
    }
    if (g + 8 < rows) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
            mine[(g + 8) * D + d * 8 + col] = o[d][2] * w1;
            mine[(g + 8) * D + d * 8 + col + 1] = o[d][3] * w1;
        }
    }
    __syncthreads();
    const int n_rows = p.batch * p.tq * p.hq;
    for (int i = threadIdx.x; i < rows * D; i += THREADS) {
        const int r = i / D, d = i % D;
        float mx = NEG_INF, l = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sm_m[w * 16 + r]);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float mw = sm_m[w * 16 + r];
            if (mw != NEG_INF) l += sm_l[w * 16 + r] * ex2(mw - mx);
        }
        const float sum = sm_o[r * D + d] + sm_o[(16 + r) * D + d] + sm_o[(32 + r) * D + d] +
                          sm_o[(48 + r) * D + d];
        const float val = l > 0.f ? sum / l : 0.f;
        const int j = r / p.tq, t = r % p.tq;
        const i64 orow = (i64)(b * p.tq + t) * p.hq + kvh * group + j;
        if (p.splits == 1) {
            ((u16*)p.o)[orow * D + d] = to16<BF16>(val);
        } else {
            ((float*)p.partial)[((i64)split * n_rows + orow) * D + d] = val;
            if (d == 0) ((float*)p.lse)[(i64)split * n_rows + orow] = l > 0.f ? mx + __log2f(l) : NEG_INF;
        }
    }
}

// Merges the splits of decode: one CTA of D threads per output row. The split weights are
// computed once per row into shared memory ([splits] floats, dynamic), then each thread sums
// its column over the splits with independent loads.
template <bool BF16, int D>
__device__ __forceinline__ void reduce(const Params& p) {
    extern __shared__ float weights[];
    __shared__ float red[D / 32];
    const int n_rows = p.batch * p.tq * p.hq;
    const int orow = blockIdx.x, d = threadIdx.x;
    const float* lse = (const float*)p.lse + orow;  // split s at s * n_rows
    const float* part = (const float*)p.partial + (i64)orow * D + d;
    float mx = NEG_INF;
    for (int s = d; s < p.splits; s += D) mx = fmaxf(mx, lse[(i64)s * n_rows]);
    mx = block_reduce<D, true>(mx, red);
    float wsum = 0.f;
    for (int s = d; s < p.splits; s += D) {
        const float x = lse[(i64)s * n_rows];
        const float w = x == NEG_INF ? 0.f : ex2(x - mx);  // a split where the row sees no key
        weights[s] = w;
        wsum += w;
    }
    wsum = block_reduce<D, false>(wsum, red);  // its barriers also publish `weights`
    float acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < p.splits; ++s) acc += weights[s] * part[(i64)s * n_rows * D];
    ((u16*)p.o)[(i64)orow * D + d] = to16<BF16>(wsum > 0.f ? acc / wsum : 0.f);
}

#define INSTANTIATE(NAME, DT, BF16, D)                                                    \
    extern "C" __global__ void __launch_bounds__(128, 2) attn_prefill_##NAME##_##D(Params p) { \
        prefill<BF16, D, 4>(p);                                                           \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill128_##NAME##_##D(Params p) { \
        prefill<BF16, D, 8>(p);                                                           \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 2) attn_decode_##NAME##_##D(Params p) {  \
        decode<BF16, D>(p);                                                               \
    }                                                                                     \
    extern "C" __global__ void __launch_bounds__(D) attn_reduce_##NAME##_##D(Params p) {       \
        reduce<BF16, D>(p);                                                               \
    }

INSTANTIATE(bf16, u16, true, 64)
INSTANTIATE(bf16, u16, true, 128)
INSTANTIATE(f16, u16, false, 64)
INSTANTIATE(f16, u16, false, 128)
