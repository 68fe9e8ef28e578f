// Weight-streaming GEMM for small M (decode and small batches, M <= 16), compiled at run time
// with NVRTC (sm_80+; sm_90 adds programmatic dependent launch and an L2 prefetch):
// Y[m, n] = (sum_k X[m, k] W[n, k]) * s_x[m] * s_w[n] + b[n], X and W INT8 codes, the sum exact
// in INT32 (mma.sync m16n8k32 s8), the epilogue in f32 with one rounding per product, written
// as bf16, f16 or f32.
//
// The weight is the MMA's A operand (16 output rows), so a tile of W is read once whatever
// the number of tokens; tokens are its N side, 8 per tile, up to NT tiles (M <= 8 NT). A CTA
// takes groups of R row tiles in turn (a persistent grid) and splits each group's K over its
// warps; the warps' INT32 partial sums meet in shared memory, where the epilogue runs.
//
// The MMA's K order is ours to choose as long as A and B agree: thread t of a quad holds the
// 16 consecutive k of [16t, 16t + 16) of each 64-wide chunk, so a thread reads 16 bytes of a
// weight row and 16 bytes of a token row per chunk.
//
// Three weight layouts (LAYOUT):
// - 0, dense: W row-major [n, w_stride] INT8 (the copy the library GEMM reads too);
// - 1, compact 6:8 tiles: per block of 8 weights its 6 kept codes and the rank of its pair of
//   zero positions (5 bits), tiled so that every load a warp issues is 512 contiguous bytes
//   (`compact.rs`, `DecodeTiles`, says where each byte goes);
// - 2, compact 6:8 rows: the same codes and ranks row-major, as the compact sparse GEMM reads
//   them (`compact/rows.rs`, `CompactRows`: kept [n, w_stride], ranks [n, idx_stride]), so that
//   a layer holds one copy for both. A step's rows are staged with 16-byte copies into rows
//   padded for conflict-free reads (ROWS_CODE_STRIDE, ROWS_RANK_STRIDE).

#include "common.cuh"

// Must match `GemvParams` in gemv.rs (repr(C)).
struct GemvParams {
    u64 w;         // dense: INT8 [n, w_stride]; compact: the tiled codes
    u64 idx;       // compact: the tiled index words (0 for dense)
    u64 x;         // INT8 [m, x_stride]
    u64 sx;        // f32 [m]
    u64 sw;        // f32 [n]
    u64 bias;      // f32 [n]; 0: none
    u64 y;         // [m, y_stride] of the output type
    int m, n, k;   // dense: k a multiple of 16; compact: k a multiple of 64
    int x_stride, y_stride, w_stride;
    int units;     // compact: full 512-wide units of a row tile, then
    int tail;      // 64-wide tail chunks
    int flags;     // GEMV_FLAG_*
    int idx_stride;  // compact rows: bytes per rank row (a multiple of 16)
};

namespace gemv {

#define GEMV_ROWS 16
// Bytes of one compact unit (16 rows x 512 k): codes 32 lanes x (32 + 16 words), index
// 32 lanes x 5 words; one tail chunk (16 rows x 64 k): codes 32 x (4 + 2) words, index 32 x 1.
#define UNIT_CODE_BYTES 6144
#define UNIT_IDX_BYTES 640
#define TAIL_CODE_BYTES 768
#define TAIL_IDX_BYTES 128

__device__ __forceinline__ void mma_s8(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// The PRMT selectors that expand a 6:8 block: output byte i takes kept code
// i - [i > p] - [i > q], or byte 6 (zero) at the pruned positions p < q. Entry = rank of (p, q).
__device__ __forceinline__ void fill_expand_table(u32* table) {
    int id = threadIdx.x;
    if (id < 28) {
        int p = 0, rest = id;
        while (rest >= 7 - p) { rest -= 7 - p; ++p; }
        const int q = p + 1 + rest;
        u32 sel = 0;
        for (int i = 0; i < 8; ++i) {
            const u32 src = (i == p || i == q) ? 6u : (u32)(i - (i > p) - (i > q));
            sel |= src << (4 * i);
        }
        table[id] = sel;
    } else if (id < 32) {
        table[id] = 0x66666666u;  // unused ranks: all zeros
    }
}

// The 8 expanded codes (two words) of a block: `lo` its first four kept codes, `hi` the last
// two in the low half, `sel` its table entry.
__device__ __forceinline__ void expand(u32 lo, u32 hi, u32 sel, u32& e0, u32& e1) {
    e0 = prmt(lo, hi, sel);
    e1 = prmt(lo, hi, sel >> 16);
}

// Bits [5b, 5b + 5) of a little-endian bit array of 32-bit words. Called in fully unrolled
// loops, so `b` folds to a constant and the words stay in registers.
template <int WORDS>
__device__ __forceinline__ u32 rank_at(const u32 (&w)[WORDS], int b) {
    const int bit = 5 * b, word = bit / 32, shift = bit % 32;
    if (shift <= 27) return (w[word] >> shift) & 31u;
    return __funnelshift_r(w[word], w[word + 1], shift) & 31u;
}

// One 64-wide chunk: rows g (a) and g + 8 (b), 16 codes each as four words.
template <int NT>
__device__ __forceinline__ void mma_chunk(int (&acc)[NT][4], const u32 (&a)[4], const u32 (&b)[4],
                                          const u32 (&xv)[NT][4]) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        mma_s8(acc[j], a[0], b[0], a[1], b[1], xv[j][0], xv[j][1]);
        mma_s8(acc[j], a[2], b[2], a[3], b[3], xv[j][2], xv[j][3]);
    }
}


// ---------------------------------------------------------------------------------------------
// Staging: every thread copies the 16-byte pieces it will read itself (weights and activations)
// into its warp's ring of shared-memory stages with cp.async, STAGES - 1 steps ahead, so each
// warp keeps that many steps in flight without a barrier (a thread reads back only its own
// copies).

__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp16_zfill(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ uint4 lds128(const void* p) { return *(const uint4*)p; }

// Programmatic dependent launch (sm_90): a kernel may start while the one before it in the
// stream finishes; it prefetches its weights into L2 (they do not depend on that kernel), then
// waits for it before reading activations. Without the launch attribute both are no-ops.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    if (bytes) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A step covers 512 k (8 chunks of 64): a compact unit, or 8 dense chunks. Its activations
// are staged per token row of 512 bytes plus 64 of padding (rows g and g + 1 then fall on
// different banks).
#define STEP_K 512
#define X_ROW (STEP_K + 64)
#define DENSE_STEP_BYTES (8 * 1024)
#define COMPACT_STEP_BYTES (UNIT_CODE_BYTES + UNIT_IDX_BYTES)
// Compact rows: a step's 384 code bytes of a row, padded to 432 (108 words: the rows g = 0..7 a
// quad-row of threads reads start 12 banks apart, so a thread's three words of one chunk and
// its quad's make 32 distinct banks), then the 16 rows' ranks, 48 bytes a row (the step's 40
// rank bytes start 0 or 8 bytes into three aligned 16-byte pieces; 12 words apart: distinct
// banks for the 8 rows a warp reads at once).
#define ROWS_CODE_STRIDE 432
#define ROWS_RANK_STRIDE 48
#define ROWS_STEP_BYTES (GEMV_ROWS * ROWS_CODE_STRIDE + GEMV_ROWS * ROWS_RANK_STRIDE)
#define GEMV_FLAG_PREFETCH 1

// A stage: the step's weights of each of the CTA's R row tiles, then its activations, one
// row per token (the size depends on m: decode stages hold one token row, not eight).
template <int LAYOUT, int R>
struct GemvStage {
    static constexpr int WEIGHTS = LAYOUT == 1 ? COMPACT_STEP_BYTES : LAYOUT == 2 ? ROWS_STEP_BYTES : DENSE_STEP_BYTES;
    static __host__ __device__ __forceinline__ int bytes(int m) { return R * WEIGHTS + m * X_ROW; }
};

// The activation pieces of step `k0` this thread reads: token rows 8j + g < m, chunk c, piece t.
template <int NT>
__device__ __forceinline__ void stage_x(const GemvParams& p, u32 xs, int k0, int chunks) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int tok = 8 * j + g;
        if (tok < p.m) {
            const char* src = (const char*)p.x + (size_t)tok * p.x_stride + k0 + 16 * t;
#pragma unroll
            for (int c = 0; c < 8; ++c)
                if (c < chunks) cp16_zfill(xs + tok * X_ROW + c * 64 + 16 * t, src + c * 64, k0 + c * 64 + 16 * t < p.k);
        }
    }
}

template <int NT>
__device__ __forceinline__ void read_x(const GemvParams& p, const char* xs, int c, u32 (&xv)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        if (8 * j + g < p.m) {
            const uint4 v = lds128(xs + (8 * j + g) * X_ROW + c * 64 + 16 * t);
            xv[j][0] = v.x; xv[j][1] = v.y; xv[j][2] = v.z; xv[j][3] = v.w;
        } else {
            xv[j][0] = xv[j][1] = xv[j][2] = xv[j][3] = 0u;
        }
    }
}

// Dense weights of one step for row tile `tile`: [chunk][row g, row g + 8][lane][16 bytes].
__device__ __forceinline__ void stage_dense(const GemvParams& p, u32 dst, int tile, int k0, int chunks) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = tile * GEMV_ROWS;
    const bool ra = n0 + g < p.n, rb = n0 + g + 8 < p.n;
    const char* wa = (const char*)p.w + (size_t)(ra ? n0 + g : 0) * p.w_stride + 16 * t;
    const char* wb = (const char*)p.w + (size_t)(rb ? n0 + g + 8 : 0) * p.w_stride + 16 * t;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        if (c < chunks) {
            const int k = k0 + c * 64;
            const bool in = k + 16 * t < p.k;
            cp16_zfill(dst + c * 1024 + lane * 16, wa + (in ? k : 0), in && ra);
            cp16_zfill(dst + c * 1024 + 512 + lane * 16, wb + (in ? k : 0), in && rb);
        }
    }
}

__device__ __forceinline__ size_t compact_tile_codes(const GemvParams& p) {
    return (size_t)p.units * UNIT_CODE_BYTES + (size_t)p.tail * TAIL_CODE_BYTES;
}
__device__ __forceinline__ size_t compact_tile_index(const GemvParams& p) {
    return (size_t)p.units * UNIT_IDX_BYTES + (size_t)p.tail * TAIL_IDX_BYTES;
}

// Compact weights of one step (unit `u` if `u < units`, else tail chunk `u - units`) of row
// tile `tile`, laid out in the stage as in global memory.
__device__ __forceinline__ void stage_compact(const GemvParams& p, u32 dst, int tile, int u) {
    const int lane = threadIdx.x & 31;
    const char* codes = (const char*)p.w + tile * compact_tile_codes(p);
    const char* index = (const char*)p.idx + tile * compact_tile_index(p);
    if (u < p.units) {
        const char* uc = codes + (size_t)u * UNIT_CODE_BYTES;
        const char* ui = index + (size_t)u * UNIT_IDX_BYTES;
#pragma unroll
        for (int r = 0; r < 12; ++r) cp16(dst + r * 512 + lane * 16, uc + r * 512 + lane * 16);
        cp16(dst + UNIT_CODE_BYTES + lane * 16, ui + lane * 16);
        cp4(dst + UNIT_CODE_BYTES + 512 + lane * 4, ui + 512 + lane * 4);
    } else {
        const int c = u - p.units;
        const char* tc = codes + (size_t)p.units * UNIT_CODE_BYTES + (size_t)c * TAIL_CODE_BYTES;
        const char* ti = index + (size_t)p.units * UNIT_IDX_BYTES + (size_t)c * TAIL_IDX_BYTES;
        cp16(dst + lane * 16, tc + lane * 16);
        cp8(dst + 512 + lane * 8, tc + 512 + lane * 8);
        cp4(dst + TAIL_CODE_BYTES + lane * 4, ti + lane * 4);
    }
}

// Expands block i (0..3: row i / 2, half i % 2) of a chunk into the MMA operands a (row g) and
// b (row g + 8): words 0, 1 of the chunk's first MMA, 2, 3 of its second.
__device__ __forceinline__ void place(int i, u32 e0, u32 e1, u32 (&a)[4], u32 (&b)[4]) {
    const int row = i >> 1, half = i & 1;
    if (row == 0) { a[2 * half] = e0; a[2 * half + 1] = e1; }
    else { b[2 * half] = e0; b[2 * half + 1] = e1; }
}

// The MMA operands of chunk c of a compact unit in the stage (one row tile): block 4c + i of
// a thread holds the codes of row g + 8 (i / 2), k = 64 c + 16 t + 8 (i % 2).
__device__ __forceinline__ void compact_chunk(const char* stage, const u32 (&ix)[5], int c, const u32* table,
                                              u32 (&a)[4], u32 (&b)[4]) {
    const int lane = threadIdx.x & 31;
    const uint4 lo = lds128(stage + c * 512 + lane * 16);
    const uint4 hv = lds128(stage + (8 + c / 2) * 512 + lane * 16);
    const u32 los[4] = {lo.x, lo.y, lo.z, lo.w};
    const u32 his[2] = {(c & 1) ? hv.z : hv.x, (c & 1) ? hv.w : hv.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 h = (i & 1) ? (his[i >> 1] >> 16) : (his[i >> 1] & 0xffffu);
        u32 e0, e1;
        expand(los[i], h, table[rank_at(ix, 4 * c + i)], e0, e1);
        place(i, e0, e1, a, b);
    }
}

// Compact rows of step `s` (k [512 s, 512 s + 512): 384 code bytes and 40 rank bytes per row)
// of row tile `tile`: codes as 16 rows of ROWS_CODE_STRIDE, then ranks as 16 rows of
// ROWS_RANK_STRIDE, in few instructions: lanes 0..23 copy one 16-byte column of the code bytes
// down the 16 rows (a warp's copy of a row is 384 contiguous bytes), lanes 24..31 two rows'
// ranks each as the three 16-byte pieces from the step's first rank byte rounded down to 16
// (rows_blocks skips the 0 or 8 bytes before it: `bit0`). Rows past n and bytes past a row's
// end are zero: rank 0 and zero codes expand to zero weights.
__device__ __forceinline__ void stage_rows(const GemvParams& p, u32 dst, int tile, int s) {
    const int lane = threadIdx.x & 31;
    const int n0 = tile * GEMV_ROWS;
    const int rows = min(GEMV_ROWS, p.n - n0);
    if (lane < 24) {
        const size_t col = (size_t)s * 384 + 16 * lane;
        const bool col_ok = col + 16 <= (size_t)p.w_stride;
        const char* src = (const char*)p.w + (size_t)n0 * p.w_stride + (col_ok ? col : 0);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
            cp16_zfill(dst + r * ROWS_CODE_STRIDE + 16 * lane, src + (size_t)(r < rows ? r : 0) * p.w_stride,
                       col_ok && r < rows);
    } else {
        const int pair = lane - 24;
        const size_t first = ((size_t)s * 40) & ~(size_t)15;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 2 * pair + h;
            const bool row_ok = row < rows;
            const char* src = (const char*)p.idx + (size_t)(row_ok ? n0 + row : 0) * p.idx_stride;
#pragma unroll
            for (int q = 0; q < 3; ++q) {
                // A piece past the row's end holds no rank of the row (the stride is whole pieces).
                const bool ok = row_ok && first + 16 * q + 16 <= (size_t)p.idx_stride;
                cp16_zfill(dst + GEMV_ROWS * ROWS_CODE_STRIDE + row * ROWS_RANK_STRIDE + 16 * q,
                           src + (ok ? first + 16 * q : 0), ok);
            }
        }
    }
}

// The accumulators: two chains per (row tile, token tile) so that consecutive chunks' MMAs
// do not wait on each other; summed at the end of a group.
template <int R, int NT>
struct Acc {
    int v[2][R][NT][4];
};

// One compact unit of every row tile (weights of tile r at stage + r * weights).
template <int R, int NT>
__device__ __forceinline__ void compact_unit(const char* stage, int weights, const char* xs, const GemvParams& p,
                                             const u32* table, Acc<R, NT>& acc) {
    const int lane = threadIdx.x & 31;
    u32 ix[R][5];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const char* w = stage + r * weights;
        const uint4 v = lds128(w + UNIT_CODE_BYTES + lane * 16);
        ix[r][0] = v.x; ix[r][1] = v.y; ix[r][2] = v.z; ix[r][3] = v.w;
        ix[r][4] = *(const u32*)(w + UNIT_CODE_BYTES + 512 + lane * 4);
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        u32 xv[NT][4];
        read_x<NT>(p, xs, c, xv);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            u32 a[4], b[4];
            compact_chunk(stage + r * weights, ix[r], c, table, a, b);
            mma_chunk<NT>(acc.v[c & 1][r], a, b, xv);
        }
    }
}

template <int R, int NT>
__device__ __forceinline__ void compact_tail(const char* stage, int weights, const char* xs, const GemvParams& p,
                                             const u32* table, Acc<R, NT>& acc) {
    const int lane = threadIdx.x & 31;
    u32 xv[NT][4];
    read_x<NT>(p, xs, 0, xv);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const char* w = stage + r * weights;
        const uint4 l = lds128(w + lane * 16);
        const uint2 h = *(const uint2*)(w + 512 + lane * 8);
        const u32 ix = *(const u32*)(w + TAIL_CODE_BYTES + lane * 4);
        const u32 lo[4] = {l.x, l.y, l.z, l.w};
        const u32 hi[2] = {h.x, h.y};
        u32 a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 hw = (i & 1) ? (hi[i >> 1] >> 16) : (hi[i >> 1] & 0xffffu);
            u32 e0, e1;
            expand(lo[i], hw, table[(ix >> (5 * i)) & 31u], e0, e1);
            place(i, e0, e1, a, b);
        }
        mma_chunk<NT>(acc.v[0][r], a, b, xv);
    }
}

// The two blocks of row `row` (0..15) a thread of quad position t holds in chunk c of a staged
// step (blocks 8 c + 2 t and 8 c + 2 t + 1: k [64 c + 16 t, 64 c + 16 t + 16)), expanded:
// e[0], e[1] the first block's eight codes, e[2], e[3] the second's. Its 12 code bytes are
// three words (the quad's and the 8 rows' together 32 distinct banks, ROWS_CODE_STRIDE), its
// 10 rank bits one funnel shift of two words; the step's ranks start `bit0` bits into the
// staged rank row (stage_rows).
__device__ __forceinline__ void rows_blocks(const char* stage, int row, int c, int t, const u32* table, u32 (&e)[4],
                                            int bit0) {
    const char* codes = stage + row * ROWS_CODE_STRIDE + 48 * c + 12 * t;
    const u32 w0 = *(const u32*)codes, w1 = *(const u32*)(codes + 4), w2 = *(const u32*)(codes + 8);
    const u32* ranks = (const u32*)(stage + GEMV_ROWS * ROWS_CODE_STRIDE + row * ROWS_RANK_STRIDE);
    const int bit = bit0 + 40 * c + 10 * t, word = bit >> 5;
    // Word 12 of row 15 lies past the ranks (in the stage's activations): its bits are shifted out.
    const u32 r = __funnelshift_r(ranks[word], ranks[word + 1], (u32)(bit & 31));
    expand(w0, w1 & 0xffffu, table[r & 31u], e[0], e[1]);
    expand(__funnelshift_r(w1, w2, 16), w2 >> 16, table[(r >> 5) & 31u], e[2], e[3]);
}

// One staged step of compact rows, `chunks` of its 8 chunks, for every row tile. (The loop is
// dense_step's; kept apart so that the dense kernels' code stays as measured.)
template <int R, int NT>
__device__ __forceinline__ void rows_step(const char* stage, int weights, const char* xs, const GemvParams& p, int chunks,
                                          const u32* table, int bit0, Acc<R, NT>& acc) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        if (c < chunks) {
            u32 xv[NT][4];
            read_x<NT>(p, xs, c, xv);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                u32 a[4], b[4];
                rows_blocks(stage + r * weights, g, c, t, table, a, bit0);
                rows_blocks(stage + r * weights, g + 8, c, t, table, b, bit0);
                mma_chunk<NT>(acc.v[c & 1][r], a, b, xv);
            }
        }
    }
}

template <int R, int NT>
__device__ __forceinline__ void dense_step(const char* stage, int weights, const char* xs, const GemvParams& p,
                                           int chunks, Acc<R, NT>& acc) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        if (c < chunks) {
            u32 xv[NT][4];
            read_x<NT>(p, xs, c, xv);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const char* w = stage + r * weights;
                const uint4 va = lds128(w + c * 1024 + lane * 16), vb = lds128(w + c * 1024 + 512 + lane * 16);
                const u32 a[4] = {va.x, va.y, va.z, va.w}, b[4] = {vb.x, vb.y, vb.z, vb.w};
                mma_chunk<NT>(acc.v[c & 1][r], a, b, xv);
            }
        }
    }
}

// The warps' partial sums (INT32, exact) meet in shared memory; thread i writes output
// (token i / 16R, row i % 16R) of the CTA's 16R rows.
template <int NT, int R, int WARPS, int OUT>
__device__ __forceinline__ void reduce_and_store(const GemvParams& p, int group, Acc<R, NT>& acc, int* partial) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int ROWS = R * GEMV_ROWS, TOKENS = NT * 8;
    int* mine = partial + warp * TOKENS * ROWS;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int tok = j * 8 + 2 * t, row = r * GEMV_ROWS + g;
            mine[tok * ROWS + row] = acc.v[0][r][j][0] + acc.v[1][r][j][0];
            mine[(tok + 1) * ROWS + row] = acc.v[0][r][j][1] + acc.v[1][r][j][1];
            mine[tok * ROWS + row + 8] = acc.v[0][r][j][2] + acc.v[1][r][j][2];
            mine[(tok + 1) * ROWS + row + 8] = acc.v[0][r][j][3] + acc.v[1][r][j][3];
#pragma unroll
            for (int e = 0; e < 4; ++e) acc.v[0][r][j][e] = acc.v[1][r][j][e] = 0;
        }
    __syncthreads();
    const int n0 = group * ROWS;
    for (int i = threadIdx.x; i < p.m * ROWS; i += WARPS * 32) {
        const int row = i % ROWS, tok = i / ROWS, n = n0 + row;
        if (n >= p.n) continue;
        int sum = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += partial[w * TOKENS * ROWS + i];
        const float sx = ((const float*)p.sx)[tok];
        const float sw = ((const float*)p.sw)[n];
        float y = __fmul_rn(__fmul_rn((float)sum, sx), sw);
        if (p.bias) y = __fadd_rn(y, ((const float*)p.bias)[n]);
        const size_t at = (size_t)tok * p.y_stride + n;
        if (OUT == 0) {
            ((float*)p.y)[at] = y;
        } else {
            u16 h;
            if (OUT == 1) asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(y));
            else asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }\n" : "=h"(h) : "f"(y));
            ((u16*)p.y)[at] = h;
        }
    }
}

// Shared memory of one kernel: the warps' stage rings, then the partial sums.
template <int LAYOUT, int NT, int R, int WARPS, int STAGES>
struct GemvSmem {
    static __host__ __device__ __forceinline__ int ring(int m) { return STAGES * GemvStage<LAYOUT, R>::bytes(m); }
    // Two buffers: a tile's partial sums are written while the previous tile's may still be read.
    static constexpr int PARTIAL = 2 * WARPS * R * NT * 8 * GEMV_ROWS * 4;
    static __host__ __device__ __forceinline__ int bytes(int m) { return WARPS * ring(m) + PARTIAL; }
};

// A group is R row tiles of 16 rows (rows [16 R group, 16 R (group + 1))). The grid is
// persistent: CTA b takes groups b, b + gridDim.x, ..., and its warps split each group's K:
// warp w takes steps [w S / WARPS, (w + 1) S / WARPS) of the S 512-wide steps (compact: full
// units, then its share of the 64-wide tail chunks round robin). A warp's copies run
// STAGES - 1 steps ahead across group boundaries, so the next group's weights are in flight
// while the CTA reduces and stores the last one.
template <int LAYOUT, int NT, int R, int WARPS, int STAGES, int OUT>
__device__ __forceinline__ void gemv(const GemvParams& p, char* smem) {
    using Smem = GemvSmem<LAYOUT, NT, R, WARPS, STAGES>;
    using Stage = GemvStage<LAYOUT, R>;
    constexpr bool COMPACT = LAYOUT == 1, ROWS = LAYOUT == 2;
    const int stage_bytes = Stage::bytes(p.m);
    __shared__ u32 table[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = (p.n + GEMV_ROWS - 1) / GEMV_ROWS;
    const int groups = (tiles + R - 1) / R;
    char* ring = smem + warp * Smem::ring(p.m);
    int* partials = (int*)(smem + WARPS * Smem::ring(p.m));
    constexpr int PARTIAL_INTS = WARPS * R * NT * 8 * GEMV_ROWS;
    // The warp's steps of every group.
    int s0, steps, tails = 0;
    if (COMPACT) {
        s0 = warp * p.units / WARPS;
        steps = (warp + 1) * p.units / WARPS - s0;
        tails = p.tail > warp ? (p.tail - warp + WARPS - 1) / WARPS : 0;
    } else {
        const int all = (p.k + STEP_K - 1) / STEP_K;
        s0 = warp * all / WARPS;
        steps = (warp + 1) * all / WARPS - s0;
    }
    const int total = steps + tails;
    const int my_groups = blockIdx.x < groups ? (groups - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    if ((p.flags & GEMV_FLAG_PREFETCH) && my_groups > 0) {
        // The first group's weights, one bulk L2 prefetch per contiguous run.
        for (int r = 0; r < R; ++r) {
            const int tile = blockIdx.x * R + r;
            if (tile >= tiles) break;
            if (COMPACT) {
                if (lane == 0) {
                    prefetch_l2((const char*)p.w + tile * compact_tile_codes(p) + (size_t)s0 * UNIT_CODE_BYTES, steps * UNIT_CODE_BYTES);
                    prefetch_l2((const char*)p.idx + tile * compact_tile_index(p) + (size_t)s0 * UNIT_IDX_BYTES, steps * UNIT_IDX_BYTES);
                }
            } else if (ROWS) {
                if (lane < GEMV_ROWS && tile * GEMV_ROWS + lane < p.n) {
                    const size_t row = (size_t)(tile * GEMV_ROWS + lane);
                    const int b0 = min(p.w_stride, s0 * 384), b1 = min(p.w_stride, (s0 + steps) * 384);
                    if (b1 > b0) prefetch_l2((const char*)p.w + row * p.w_stride + b0, (u32)(b1 - b0));
                }
            } else if (lane < GEMV_ROWS && tile * GEMV_ROWS + lane < p.n) {
                const int k0 = s0 * STEP_K, k1 = min(p.k, (s0 + steps) * STEP_K);
                if (k1 > k0) prefetch_l2((const char*)p.w + (size_t)(tile * GEMV_ROWS + lane) * p.w_stride + k0, (u32)(k1 - k0));
            }
        }
    }
    if (COMPACT || ROWS) fill_expand_table(table);
    wait_for_inputs();
    let_next_start();
    if (COMPACT || ROWS) __syncthreads();
    Acc<R, NT> acc;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NT; ++j) acc.v[h][r][j][0] = acc.v[h][r][j][1] = acc.v[h][r][j][2] = acc.v[h][r][j][3] = 0;
    auto step_k = [&](int s) {
        if (!COMPACT || s < steps) return (s0 + s) * STEP_K;
        return p.units * STEP_K + (warp + (s - steps) * WARPS) * 64;
    };
    auto step_chunks = [&](int s) {
        if (COMPACT) return s < steps ? 8 : 1;
        return min(8, (p.k - (s0 + s) * STEP_K + 63) / 64);
    };
    const int all_steps = my_groups * total;
    auto issue = [&](int q) {
        if (q < all_steps) {
            const int i = q / total, s = q - i * total;
            const int group = blockIdx.x + i * gridDim.x;
            char* stage = ring + (q % STAGES) * stage_bytes;
            const u32 dst = smem_addr(stage);
            const int k0 = step_k(s), chunks = step_chunks(s);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int tile = group * R + r;
                if (tile < tiles) {
                    if (COMPACT) stage_compact(p, dst + r * Stage::WEIGHTS, tile, s < steps ? s0 + s : p.units + warp + (s - steps) * WARPS);
                    else if (ROWS) stage_rows(p, dst + r * Stage::WEIGHTS, tile, s0 + s);
                    else stage_dense(p, dst + r * Stage::WEIGHTS, tile, k0, chunks);
                }
            }
            stage_x<NT>(p, dst + R * Stage::WEIGHTS, k0, chunks);
        }
        cp_commit();
    };
#pragma unroll
    for (int q = 0; q < STAGES - 1; ++q) issue(q);
    // Every warp runs the same number of iterations (`total` may be 0 for some warps: they
    // still meet the others at each group's barrier).
    const int iterations = my_groups * max(total, 1);
    for (int it = 0, q = 0; it < iterations; ++it) {
        const int per = max(total, 1);
        const int i = it / per, s = it - i * per;
        if (s < total) {
            issue(q + STAGES - 1);
            cp_wait<STAGES - 1>();
            const char* stage = ring + (q % STAGES) * stage_bytes;
            const char* xs = stage + R * Stage::WEIGHTS;
            if (COMPACT) {
                if (s < steps) compact_unit<R, NT>(stage, Stage::WEIGHTS, xs, p, table, acc);
                else compact_tail<R, NT>(stage, Stage::WEIGHTS, xs, p, table, acc);
            } else if (ROWS) {
                // A lane reads row pieces other lanes of the warp copied: their cp.async
                // writes are ordered before its reads by the warp barrier, not by its own wait.
                __syncwarp();
                // Step s0 + s's 40 rank bytes start 8 bytes into its first piece when s0 + s is odd.
                rows_step<R, NT>(stage, Stage::WEIGHTS, xs, p, step_chunks(s), table, ((s0 + s) & 1) * 64, acc);
            } else {
                dense_step<R, NT>(stage, Stage::WEIGHTS, xs, p, step_chunks(s), acc);
            }
            ++q;
        }
        if (s == per - 1)
            reduce_and_store<NT, R, WARPS, OUT>(p, blockIdx.x + i * gridDim.x, acc, partials + (i & 1) * PARTIAL_INTS);
    }
    cp_wait<0>();
}

}  // namespace gemv

#define GEMV_KERNEL(NAME, LAYOUT, NT, R, WARPS, STAGES, OUT)                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(const GemvParams p) { \
        extern __shared__ __align__(128) unsigned char gemv_smem[];                    \
        gemv::gemv<LAYOUT, NT, R, WARPS, STAGES, OUT>(p, (char*)gemv_smem);                              \
    }

// The kernels the library launches: per token tile count, the configuration measured fastest
// on the H200 (docs/decisions/decode-gemv.md): groups of one 16-row tile, 8 warps and two
// stages for up to 8 tokens; two tiles, 4 warps, two stages for up to 16.
#define GEMV_LIBRARY(NAME, OUT)                                \
    GEMV_KERNEL(gemv_dense_##NAME##_t1, 0, 1, 1, 8, 2, OUT)     \
    GEMV_KERNEL(gemv_dense_##NAME##_t2, 0, 2, 2, 4, 2, OUT)     \
    GEMV_KERNEL(gemv_compact68_##NAME##_t1, 1, 1, 1, 8, 2, OUT) \
    GEMV_KERNEL(gemv_compact68_##NAME##_t2, 1, 2, 2, 4, 2, OUT) \
    GEMV_KERNEL(gemv_rows68_##NAME##_t1, 2, 1, 1, 8, 2, OUT)    \
    GEMV_KERNEL(gemv_rows68_##NAME##_t2, 2, 2, 2, 4, 2, OUT)
GEMV_LIBRARY(f32, 0)
GEMV_LIBRARY(bf16, 1)
GEMV_LIBRARY(f16, 2)
