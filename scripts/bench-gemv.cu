// The decode GEMV kernels (burn-slidesparse/src/cuda/kernels/decode_gemv.cu, the library's
// instantiations) checked bit for bit against a CPU reference and timed against cuBLASLt's
// INT8 GEMM and a plain read of the same bytes, per layer shape of Llama-3-8B, Qwen2.5-7B and
// SmolLM2-135M and per token count. Built and run on the GPU host by
// `scripts/gpu-run.sh gemv` (nvcc there); the table it prints is docs/benchmarks.md's.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "decode_gemv.cu"  // -I burn-slidesparse/src/cuda/kernels
#define gemv_UNIT_CODE_BYTES 6144
#define gemv_UNIT_IDX_BYTES 640
#define gemv_TAIL_CODE_BYTES 768
#define gemv_TAIL_IDX_BYTES 128

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)
#define CKB(x)                                                                   \
    do {                                                                         \
        cublasStatus_t st_ = (x);                                                  \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                        \
            fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)st_); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static uint16_t bf16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// Rank of the pair (p < q) among the 28 pairs of 8 positions, lexicographic.
static int pair_rank(int p, int q) {
    int r = 0;
    for (int i = 0; i < p; ++i) r += 7 - i;
    return r + (q - p - 1);
}

// Tiles a 6:8 pruned row-major [n, k] INT8 matrix (k multiple of 64, n multiple of 16; every
// block of 8 with at least 2 zeros) into the compact layout of decode_gemv.cu.
static void build_compact(const std::vector<int8_t>& w, int n, int k, std::vector<uint8_t>& codes,
                          std::vector<uint32_t>& index, int& units, int& tail) {
    units = k / 512;
    tail = (k % 512) / 64;
    const size_t tile_codes = (size_t)units * gemv_UNIT_CODE_BYTES + (size_t)tail * gemv_TAIL_CODE_BYTES;
    const size_t tile_idx = (size_t)units * gemv_UNIT_IDX_BYTES + (size_t)tail * gemv_TAIL_IDX_BYTES;
    const int tiles = n / 16;
    codes.assign(tiles * tile_codes, 0);
    index.assign(tiles * tile_idx / 4, 0);
    // For block (row, k0) returns the kept codes (6) and rank.
    auto block = [&](int row, int k0, uint8_t kept[6]) {
        const int8_t* b = &w[(size_t)row * k + k0];
        int zeros[2], nz = 0, nk = 0;
        for (int i = 0; i < 8; ++i)
            if (b[i] == 0 && nz < 2) zeros[nz++] = i;
        for (int i = 0; i < 8; ++i)
            if (!((nz > 0 && i == zeros[0]) || (nz > 1 && i == zeros[1]))) kept[nk++] = (uint8_t)b[i];
        if (nz < 2) { fprintf(stderr, "block not 6:8\n"); exit(1); }
        return pair_rank(zeros[0], zeros[1]);
    };
    for (int tl = 0; tl < tiles; ++tl) {
        uint8_t* tc = &codes[tl * tile_codes];
        uint8_t* ti = (uint8_t*)&index[0] + tl * tile_idx;
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, t = lane & 3;
            for (int u = 0; u < units; ++u) {
                uint8_t* uc = tc + (size_t)u * gemv_UNIT_CODE_BYTES;
                uint32_t* ui = (uint32_t*)(ti + (size_t)u * gemv_UNIT_IDX_BYTES);
                uint32_t bits[5] = {0, 0, 0, 0, 0};
                for (int c = 0; c < 8; ++c)
                    for (int row = 0; row < 2; ++row)
                        for (int half = 0; half < 2; ++half) {
                            const int b = 4 * c + 2 * row + half;
                            uint8_t kept[6];
                            const int r = block(tl * 16 + g + 8 * row, u * 512 + c * 64 + 16 * t + 8 * half, kept);
                            // lo word b: register b/4 of lane at (b/4)*512 + lane*16 + (b%4)*4
                            memcpy(uc + (b / 4) * 512 + lane * 16 + (b % 4) * 4, kept, 4);
                            // hi half-word b: word b/2 -> register 8 + (b/2)/4
                            const int hw = b / 2;
                            memcpy(uc + (8 + hw / 4) * 512 + lane * 16 + (hw % 4) * 4 + (b % 2) * 2, kept + 4, 2);
                            const int bit = 5 * b;
                            bits[bit / 32] |= (uint32_t)r << (bit % 32);
                            if (bit % 32 > 27) bits[bit / 32 + 1] |= (uint32_t)r >> (32 - bit % 32);
                        }
                for (int r = 0; r < 4; ++r) ui[lane * 4 + r] = bits[r];
                ui[128 + lane] = bits[4];
            }
            for (int c = 0; c < tail; ++c) {
                uint8_t* cc = tc + (size_t)units * gemv_UNIT_CODE_BYTES + (size_t)c * gemv_TAIL_CODE_BYTES;
                uint32_t* ci = (uint32_t*)(ti + (size_t)units * gemv_UNIT_IDX_BYTES + (size_t)c * gemv_TAIL_IDX_BYTES);
                uint32_t bits = 0;
                for (int row = 0; row < 2; ++row)
                    for (int half = 0; half < 2; ++half) {
                        const int b = 2 * row + half;
                        uint8_t kept[6];
                        const int r = block(tl * 16 + g + 8 * row, units * 512 + c * 64 + 16 * t + 8 * half, kept);
                        memcpy(cc + lane * 16 + b * 4, kept, 4);
                        memcpy(cc + 512 + lane * 8 + b * 2, kept + 4, 2);
                        bits |= (uint32_t)r << (5 * b);
                    }
                ci[lane] = bits;
            }
        }
    }
}

// The compact rows of the same matrix (burn-slidesparse/src/compact/rows.rs, `CompactRows`, the
// layout the compact sparse GEMM reads): per row its blocks' 6 kept codes in order, padded to
// whole 8-block groups (48 bytes per 64 k), and its blocks' 5-bit ranks packed little-endian,
// padded to 16 bytes.
static void build_rows(const std::vector<int8_t>& w, int n, int k, std::vector<uint8_t>& kept, int& kept_stride,
                       std::vector<uint8_t>& ranks, int& rank_stride) {
    const int blocks = k / 8, groups = (blocks + 7) / 8;
    kept_stride = groups * 48;
    rank_stride = (groups * 5 + 15) / 16 * 16;
    kept.assign((size_t)n * kept_stride, 0);
    ranks.assign((size_t)n * rank_stride, 0);
#pragma omp parallel for
    for (long row = 0; row < n; ++row)
        for (int b = 0; b < blocks; ++b) {
            const int8_t* v = &w[(size_t)row * k + 8 * b];
            int zeros[2], nz = 0, nk = 0;
            for (int i = 0; i < 8; ++i)
                if (v[i] == 0 && nz < 2) zeros[nz++] = i;
            uint8_t* kr = &kept[(size_t)row * kept_stride + 6 * b];
            for (int i = 0; i < 8; ++i)
                if (i != zeros[0] && i != zeros[1]) kr[nk++] = (uint8_t)v[i];
            const int r = pair_rank(zeros[0], zeros[1]);
            uint8_t* rr = &ranks[(size_t)row * rank_stride];
            for (int bit = 0; bit < 5; ++bit)
                if (r >> bit & 1) rr[(5 * b + bit) / 8] |= (uint8_t)(1u << ((5 * b + bit) % 8));
        }
}

struct Shape {
    const char* name;
    int n, k;
};

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

typedef void (*Kernel)(const GemvParams);

// The library's kernels: token tiles NT, row tiles per group R, warps W, stages S (as
// GEMV_LIBRARY instantiates them).
struct Config {
    const char* tag;
    int nt, r, w, s;
    Kernel dense, compact, rows;
    int (*dense_smem)(int), (*compact_smem)(int), (*rows_smem)(int);
};
static const Config configs[] = {
    {"t1", 1, 1, 8, 2, gemv_dense_bf16_t1, gemv_compact68_bf16_t1, gemv_rows68_bf16_t1, gemv::GemvSmem<0, 1, 1, 8, 2>::bytes,
     gemv::GemvSmem<1, 1, 1, 8, 2>::bytes, gemv::GemvSmem<2, 1, 1, 8, 2>::bytes},
    {"t2", 2, 2, 4, 2, gemv_dense_bf16_t2, gemv_compact68_bf16_t2, gemv_rows68_bf16_t2, gemv::GemvSmem<0, 2, 2, 4, 2>::bytes,
     gemv::GemvSmem<1, 2, 2, 4, 2>::bytes, gemv::GemvSmem<2, 2, 2, 4, 2>::bytes},
};

static void set_smem_limits() {
    for (const Config& c : configs) {
        CK(cudaFuncSetAttribute(c.dense, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448 - 1024));
        CK(cudaFuncSetAttribute(c.compact, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448 - 1024));
        CK(cudaFuncSetAttribute(c.rows, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448 - 1024));
    }
}

static int tiles_for(int m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

static void launch(Kernel k, dim3 grid, dim3 block, int smem, cudaStream_t s, const GemvParams& p, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k, p));
}

__global__ void read_ceiling(const uint4* src, size_t n, unsigned* out) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}

// Times `launch(i)` for rotating copies i inside one CUDA graph of `per_graph` launches.
template <class F>
static float time_graph(cudaStream_t s, int copies, F launch) {
    const int per_graph = std::max(copies, 40);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < per_graph; ++i) launch(i % copies);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(exec, s));
    std::vector<float> times;
    for (int r = 0; r < 15; ++r) {
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(exec, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        times.push_back(ms * 1000.f / per_graph);
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return median(times);
}

int main(int argc, char** argv) {
    std::vector<Shape> shapes = {
        {"llama qkv", 6144, 4096}, {"llama o", 4096, 4096}, {"llama gate_up", 28672, 4096},
        {"llama down", 4096, 14336}, {"qwen qkv", 4608, 3584}, {"qwen o", 3584, 3584},
        {"qwen gate_up", 37888, 3584}, {"qwen down", 3584, 18944}, {"smollm qkv", 960, 576},
        {"smollm down", 576, 1536},
    };
    std::vector<int> ms = {1, 8, 16};
    // For a profiler: GEMV_SHAPES (a substring of the shape names), GEMV_MS (token counts,
    // comma-separated), GEMV_CHECK_ONLY (each kernel's checked launch, no timing).
    const char* only_shape = getenv("GEMV_SHAPES");
    if (const char* list = getenv("GEMV_MS")) {
        ms.clear();
        for (const char* c = list; *c; ++c)
            if (c == list || c[-1] == ',') ms.push_back(atoi(c));
    }
    const bool check_only = getenv("GEMV_CHECK_ONLY") != nullptr;
    set_smem_limits();
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasLtHandle_t lt;
    CKB(cublasLtCreate(&lt));
    void* workspace;
    const size_t ws_bytes = 32 << 20;
    CK(cudaMalloc(&workspace, ws_bytes));

    // Ceilings: a device copy and a read-only stream of 2 GiB.
    {
        const size_t bytes = 1ull << 30;
        void *src, *dst;
        CK(cudaMalloc(&src, bytes));
        CK(cudaMalloc(&dst, bytes));
        CK(cudaMemset(src, 1, bytes));
        float us = time_graph(s, 1, [&](int) { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); });
        printf("device copy 1 GiB (copy engine): %.1f us, %.2f TB/s (read + write)\n", us, 2.0 * bytes / us / 1e6);
        unsigned* sink;
        CK(cudaMalloc(&sink, 4));
        for (int blocks : {132 * 4, 132 * 8, 132 * 16}) {
            float r = time_graph(s, 1, [&](int) { read_ceiling<<<blocks, 512, 0, s>>>((const uint4*)src, bytes / 16, sink); });
            printf("read-only stream 1 GiB, %d CTAs x 512: %.1f us, %.2f TB/s\n", blocks, r, bytes / r / 1e6);
        }
        CK(cudaFree(src));
        CK(cudaFree(dst));
    }

    std::mt19937_64 rng(1234);
    printf("\n| shape | N x K | M | best dense GEMV us | TB/s | best compact 6:8 us | TB/s | 6:8 / dense | cuBLASLt INT8 us | cuBLASLt / dense | check | per config: dense/compact/rows us | best rows 6:8 us | rows / tiles time |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape& sh : shapes) {
        if (only_shape && !strstr(sh.name, only_shape)) continue;
        const int n = sh.n, k = sh.k;
        // A 6:8-pruned INT8 matrix (codes in [-127, 127], two zeros per block at random).
        std::vector<int8_t> w((size_t)n * k);
        std::vector<int8_t> wd((size_t)n * k);  // dense baseline: no zeros forced
#pragma omp parallel
        {
            std::mt19937_64 r(1234 + omp_get_thread_num());
#pragma omp for
            for (long row = 0; row < n; ++row) {
                for (int b = 0; b < k / 8; ++b) {
                    int p = r() % 8, q = r() % 7;
                    if (q >= p) ++q;
                    for (int i = 0; i < 8; ++i) {
                        int v = (int)(r() % 255) - 127;
                        w[(size_t)row * k + b * 8 + i] = (i == p || i == q) ? 0 : (int8_t)v;
                        wd[(size_t)row * k + b * 8 + i] = (int8_t)((int)(r() % 255) - 127);
                    }
                }
            }
        }
        std::vector<uint8_t> codes;
        std::vector<uint32_t> index;
        int units, tail;
        build_compact(w, n, k, codes, index, units, tail);
        std::vector<uint8_t> kept, ranks;
        int kept_stride, rank_stride;
        build_rows(w, n, k, kept, kept_stride, ranks, rank_stride);
        std::vector<float> sw(n), bias(n);
        for (int i = 0; i < n; ++i) {
            sw[i] = 1e-3f * (1 + (rng() % 1000) / 1000.f);
            bias[i] = ((int)(rng() % 2001) - 1000) / 1000.f;
        }
        const int mmax = 64;
        std::vector<int8_t> x((size_t)mmax * k);
        std::vector<float> sx(mmax);
        for (auto& v : x) v = (int8_t)((int)(rng() % 255) - 127);
        for (auto& v : sx) v = 1e-2f * (1 + (rng() % 1000) / 1000.f);

        const size_t dense_bytes = (size_t)n * k, compact_bytes = codes.size() + index.size() * 4;
        const int copies = (int)std::max<size_t>(2, (size_t)(400u << 20) / compact_bytes + 1);
        std::vector<int8_t*> d_wd(copies), d_w(copies);
        std::vector<uint8_t*> d_codes(copies);
        std::vector<uint32_t*> d_index(copies);
        std::vector<uint8_t*> d_kept(copies), d_ranks(copies);
        for (int c = 0; c < copies; ++c) {
            CK(cudaMalloc(&d_kept[c], kept.size()));
            CK(cudaMemcpy(d_kept[c], kept.data(), kept.size(), cudaMemcpyHostToDevice));
            CK(cudaMalloc(&d_ranks[c], ranks.size()));
            CK(cudaMemcpy(d_ranks[c], ranks.data(), ranks.size(), cudaMemcpyHostToDevice));
            CK(cudaMalloc(&d_wd[c], dense_bytes));
            CK(cudaMemcpy(d_wd[c], wd.data(), dense_bytes, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&d_codes[c], codes.size()));
            CK(cudaMemcpy(d_codes[c], codes.data(), codes.size(), cudaMemcpyHostToDevice));
            CK(cudaMalloc(&d_index[c], index.size() * 4));
            CK(cudaMemcpy(d_index[c], index.data(), index.size() * 4, cudaMemcpyHostToDevice));
        }
        int8_t* d_wpruned;  // the pruned matrix dense, for the dense kernel's check
        CK(cudaMalloc(&d_wpruned, dense_bytes));
        CK(cudaMemcpy(d_wpruned, w.data(), dense_bytes, cudaMemcpyHostToDevice));
        int8_t* d_x;
        float *d_sx, *d_sw, *d_bias;
        uint16_t* d_y;
        int32_t* d_acc;
        CK(cudaMalloc(&d_x, x.size()));
        CK(cudaMemcpy(d_x, x.data(), x.size(), cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d_sx, mmax * 4));
        CK(cudaMemcpy(d_sx, sx.data(), mmax * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d_sw, n * 4));
        CK(cudaMemcpy(d_sw, sw.data(), n * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d_bias, n * 4));
        CK(cudaMemcpy(d_bias, bias.data(), n * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d_y, (size_t)mmax * n * 2));
        CK(cudaMalloc(&d_acc, (size_t)mmax * n * 4));

        // What a plain read of the dense and compact bytes takes, back to back like the kernels.
        unsigned* sink;
        CK(cudaMalloc(&sink, 4));
        const float read_dense = time_graph(s, copies, [&](int c) { read_ceiling<<<132 * 8, 512, 0, s>>>((const uint4*)d_wd[c], dense_bytes / 16, sink); });
        const float read_compact = time_graph(s, copies, [&](int c) { read_ceiling<<<132 * 8, 512, 0, s>>>((const uint4*)d_codes[c], codes.size() / 16, sink); });
        printf("| %s | %d x %d | read only | %.2f | %.2f | %.2f | %.2f | | | | | |\n", sh.name, n, k, read_dense, dense_bytes / read_dense / 1e6, read_compact, codes.size() / read_compact / 1e6);
        for (int m : ms) {
            // CPU reference of the pruned matrix.
            std::vector<uint16_t> ref((size_t)m * n);
#pragma omp parallel for
            for (long row = 0; row < n; ++row)
                for (int tok = 0; tok < m; ++tok) {
                    int acc = 0;
                    for (int kk = 0; kk < k; ++kk) acc += (int)w[(size_t)row * k + kk] * (int)x[(size_t)tok * k + kk];
                    float y = ((float)acc * sx[tok]) * sw[row] + bias[row];
                    ref[(size_t)tok * n + row] = bf16_rn(y);
                }
            GemvParams p{};
            p.x = (u64)d_x;
            p.sx = (u64)d_sx;
            p.sw = (u64)d_sw;
            p.bias = (u64)d_bias;
            p.y = (u64)d_y;
            p.m = m;
            p.n = n;
            p.k = k;
            p.x_stride = k;
            p.y_stride = n;
            p.w_stride = k;
            p.units = units;
            p.tail = tail;
            const int nt = tiles_for(m);
            // Every config of this token tile count: check both kernels exactly, then time them
            // with plain launches and with programmatic dependent launch + L2 prefetch.
            std::string cells;
            float best_dense = 1e9, best_compact = 1e9, best_rows = 1e9;
            int bad = 0;
            for (const Config& cf : configs) {
                if (cf.nt != nt || cf.dense_smem(m) > 232448 - 1024 || cf.compact_smem(m) > 232448 - 1024 ||
                    cf.rows_smem(m) > 232448 - 1024)
                    continue;
                const int groups = (n / 16 + cf.r - 1) / cf.r;
                int occ_d = 0, occ_c = 0;
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_d, cf.dense, cf.w * 32, cf.dense_smem(m)));
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_c, cf.compact, cf.w * 32, cf.compact_smem(m)));
                const int occ = std::max(1, std::min(occ_d, occ_c));
                const dim3 grid(std::min(groups, occ * sms)), block(cf.w * 32);
                // Layouts 0 dense, 1 compact tiles, 2 compact rows.
                for (int compact = 0; compact < 3; ++compact) {
                    GemvParams q = p;
                    q.w = compact == 2 ? (u64)d_kept[0] : compact ? (u64)d_codes[0] : (u64)d_wpruned;
                    q.idx = compact == 2 ? (u64)d_ranks[0] : compact ? (u64)d_index[0] : 0;
                    if (compact == 2) q.w_stride = kept_stride, q.idx_stride = rank_stride;
                    const Kernel kern = compact == 2 ? cf.rows : compact ? cf.compact : cf.dense;
                    const int smem = compact == 2 ? cf.rows_smem(m) : compact ? cf.compact_smem(m) : cf.dense_smem(m);
                    CK(cudaMemset(d_y, 0xff, (size_t)m * n * 2));
                    launch(kern, grid, block, smem, s, q, false);
                    CK(cudaGetLastError());
                    CK(cudaStreamSynchronize(s));
                    std::vector<uint16_t> got((size_t)m * n);
                    CK(cudaMemcpy(got.data(), d_y, got.size() * 2, cudaMemcpyDeviceToHost));
                    for (size_t i = 0; i < got.size(); ++i)
                        if (got[i] != ref[i]) {
                            if (bad < 3)
                                fprintf(stderr, "%s m=%d cfg %s %s mismatch at %zu: %04x vs %04x\n", sh.name, m, cf.tag,
                                        compact == 2 ? "rows" : compact ? "compact" : "dense", i, got[i], ref[i]);
                            ++bad;
                        }
                }
                for (int pdl = 0; pdl < (check_only ? 0 : 2); ++pdl) {
                    float td = time_graph(s, copies, [&](int c) {
                        GemvParams q = p;
                        q.w = (u64)d_wd[c];
                        q.flags = pdl ? GEMV_FLAG_PREFETCH : 0;
                        launch(cf.dense, grid, block, cf.dense_smem(m), s, q, pdl);
                    });
                    float tc = time_graph(s, copies, [&](int c) {
                        GemvParams q = p;
                        q.w = (u64)d_codes[c];
                        q.idx = (u64)d_index[c];
                        q.flags = pdl ? GEMV_FLAG_PREFETCH : 0;
                        launch(cf.compact, grid, block, cf.compact_smem(m), s, q, pdl);
                    });
                    float tr = time_graph(s, copies, [&](int c) {
                        GemvParams q = p;
                        q.w = (u64)d_kept[c];
                        q.idx = (u64)d_ranks[c];
                        q.w_stride = kept_stride;
                        q.idx_stride = rank_stride;
                        q.flags = pdl ? GEMV_FLAG_PREFETCH : 0;
                        launch(cf.rows, grid, block, cf.rows_smem(m), s, q, pdl);
                    });
                    best_dense = std::min(best_dense, td);
                    best_compact = std::min(best_compact, tc);
                    best_rows = std::min(best_rows, tr);
                    char buf[128];
                    snprintf(buf, sizeof buf, " %s%s %.1f/%.1f/%.1f |", cf.tag, pdl ? "+pdl" : "", td, tc, tr);
                    cells += buf;
                }
            }
            const float t_dense = best_dense, t_compact = best_compact;
            // cuBLASLt INT8 -> INT32, M padded to 16 as the library path does.
            const int mp = (m + 15) / 16 * 16;
            cublasLtMatmulDesc_t desc;
            CKB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32I, CUDA_R_32I));
            cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
            CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
            cublasLtMatrixLayout_t la, lb, lc;
            CKB(cublasLtMatrixLayoutCreate(&la, CUDA_R_8I, k, n, k));
            CKB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8I, k, mp, k));
            CKB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32I, n, mp, n));
            cublasLtMatmulPreference_t pref;
            CKB(cublasLtMatmulPreferenceCreate(&pref));
            CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
            cublasLtMatmulHeuristicResult_t heur;
            int found = 0;
            CKB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heur, &found));
            int32_t alpha = 1, beta = 0;
            float t_lt = time_graph(s, copies, [&](int c) {
                CKB(cublasLtMatmul(lt, desc, &alpha, d_wd[c], la, d_x, lb, &beta, d_acc, lc, d_acc, lc, &heur.algo, workspace, ws_bytes, s));
            });
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatmulDescDestroy(desc);
            printf("| %s | %d x %d | %d | %.2f | %.2f | %.2f | %.2f | %.3f | %.2f | %.2f | %s |%s", sh.name, n, k, m, t_dense,
                   dense_bytes / t_dense / 1e6, t_compact, compact_bytes / t_compact / 1e6, t_dense / t_compact, t_lt,
                   t_lt / t_dense, bad ? "MISMATCH" : "exact", cells.c_str());
            printf(" %.2f | %.3f |\n", best_rows, best_rows / t_compact);
            fflush(stdout);
        }
        for (int c = 0; c < copies; ++c) {
            cudaFree(d_wd[c]);
            cudaFree(d_codes[c]);
            cudaFree(d_index[c]);
            cudaFree(d_kept[c]);
            cudaFree(d_ranks[c]);
        }
        cudaFree(d_wpruned);
        cudaFree(d_x);
        cudaFree(d_sx);
        cudaFree(d_sw);
        cudaFree(d_bias);
        cudaFree(d_y);
        cudaFree(d_acc);
    }
    return 0;
}
