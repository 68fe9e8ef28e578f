// The peak rate of one wgmma instruction form on this GPU, from shared memory, with no loads:
// dense `wgmma.mma_async` m64nNk32 s8 against sparse `wgmma.mma_async.sp` m64nNk64 s8, N = 128
// and 256. Every SM runs one CTA of 1-3 warpgroups that issue groups of 4 wgmmas on the same
// shared-memory operands (a real GEMM's stage) and keep one group in flight, as a GEMM's main loop
// does. This is the ceiling a GEMM built on that instruction can reach: if the sparse form does not
// reach 2x the dense one here, no schedule of loads will. Built and run by
// `scripts/gpu-run.sh spgemm` (nvcc -gencode=arch=compute_90a,code=sm_90a).
// Ops are counted as a dense GEMM of the same logical shape: 2 x 64 x N x K per wgmma (K = 32
// dense, 64 sparse), so "sparse / dense" is the speedup the instruction gives at equal K.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sparse_gemm_sm90.cu"  // -I burn-slidesparse/src/cuda/kernels: desc_sw128, the sparse n128 and n256 wrappers


#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t ck_err_ = (x);                                                              \
        if (ck_err_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(ck_err_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

#if SPGEMM_HAS_WGMMA
using spgemm::desc_sw128;

__device__ __forceinline__ void dense_n128(int (&d)[64], u64 da, u64 db, u32) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "%64, %65, 1;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                   "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
                   "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
                   "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
                   "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
                   "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
                   "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
                   "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
                 : "l"(da), "l"(db));
}

__device__ __forceinline__ void dense_n256(int (&d)[128], u64 da, u64 db, u32) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
                 "%128, %129, 1;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                   "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
                   "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
                   "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
                   "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
                   "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
                   "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
                   "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]),
                   "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]),
                   "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]),
                   "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]),
                   "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]),
                   "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]),
                   "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]),
                   "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]),
                   "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
                 : "l"(da), "l"(db));
}

// The GEMM's own instruction wrappers.
__device__ __forceinline__ void sparse_n128(int (&d)[64], u64 da, u64 db, u32 meta) {
    spgemm::wgmma_sp_m64n128k64(d, da, db, meta);
}

__device__ __forceinline__ void sparse_n256(int (&d)[128], u64 da, u64 db, u32 meta) {
    spgemm::wgmma_sp_m64n256k64(d, da, db, meta);
}

template <int N, bool SPARSE>
struct Wgmma;
template <>
struct Wgmma<128, false> {
    static constexpr int ACC = 64, K = 32;
    static __device__ __forceinline__ void mma(int (&d)[64], u64 a, u64 b, u32 e) { dense_n128(d, a, b, e); }
};
template <>
struct Wgmma<256, false> {
    static constexpr int ACC = 128, K = 32;
    static __device__ __forceinline__ void mma(int (&d)[128], u64 a, u64 b, u32 e) { dense_n256(d, a, b, e); }
};
template <>
struct Wgmma<128, true> {
    static constexpr int ACC = 64, K = 64;
    static __device__ __forceinline__ void mma(int (&d)[64], u64 a, u64 b, u32 e) { sparse_n128(d, a, b, e); }
};
template <>
struct Wgmma<256, true> {
    static constexpr int ACC = 128, K = 64;
    static __device__ __forceinline__ void mma(int (&d)[128], u64 a, u64 b, u32 e) { sparse_n256(d, a, b, e); }
};

#endif  // SPGEMM_HAS_WGMMA

// Shared memory: A 64 rows x 128 B per warpgroup (the k-steps walk 32 B, as the GEMM), B N rows x
// 128 B; zeros, metadata 0x44444444 (positions 0, 1 of every group: a legal value).
template <int N, bool SPARSE>
__global__ void __launch_bounds__(N == 256 ? 256 : 384, 1) peak(int* out, int iters) {
#if SPGEMM_HAS_WGMMA
    using W = Wgmma<N, SPARSE>;
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    const int wg = threadIdx.x >> 7;
    for (int i = threadIdx.x; i < (4 * 8192 + N * 128) / 4; i += blockDim.x) ((u32*)(smem + (base - (u32)__cvta_generic_to_shared(smem))))[i] = 0;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const u32 sa = base + wg * 8192, sb = base + 4 * 8192;
    int d[W::ACC];
#pragma unroll
    for (int i = 0; i < W::ACC; ++i) d[i] = 0;
    const u32 meta = 0x44444444u;
    for (int it = 0; it < iters; ++it) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < 4; ++s) W::mma(d, desc_sw128(sa + s * (SPARSE ? 32 : 32)), desc_sw128(sb + s * (SPARSE ? 64 : 32)), meta);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    int sum = 0;
#pragma unroll
    for (int i = 0; i < W::ACC; ++i) sum += d[i];
    if (sum == 12345) out[threadIdx.x] = sum;  // never (the operands are zero): keeps the loop
#else
    __trap();  // not built for sm_90a
#endif
}

template <int N, bool SPARSE>
static double tops(int warpgroups, int sms) {
    constexpr int kLogical = SPARSE ? 64 : 32;  // logical K of one wgmma
    const int smem = 4 * 8192 + N * 128 + 1024;
    auto k = peak<N, SPARSE>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int* out;
    CK(cudaMalloc(&out, 4096));
    const int iters = 20000;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    k<<<sms, 128 * warpgroups, smem>>>(out, 100);
    CK(cudaGetLastError());
    std::vector<float> ms;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(a));
        k<<<sms, 128 * warpgroups, smem>>>(out, iters);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float t;
        CK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaFree(out));
    const double ops = 2.0 * 64 * N * kLogical * 4.0 * iters * warpgroups * sms;
    return ops / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("\nwgmma peak from shared memory, %s, %d SMs: TOPS counted as a dense GEMM of the same shape\n\n", prop.name, sms);
    printf("| warpgroups per SM | dense n128 | sparse n128 | sparse / dense | dense n256 | sparse n256 | sparse / dense |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int wgs = 1; wgs <= 3; ++wgs) {
        const double d128 = tops<128, false>(wgs, sms), s128 = tops<128, true>(wgs, sms);
        // n256 holds 128 accumulators per thread: at most 2 warpgroups fit the register file.
        if (wgs <= 2) {
            const double d256 = tops<256, false>(wgs, sms), s256 = tops<256, true>(wgs, sms);
            printf("| %d | %.0f | %.0f | %.2f | %.0f | %.0f | %.2f |\n", wgs, d128, s128, s128 / d128, d256, s256, s256 / d256);
        } else {
            printf("| %d | %.0f | %.0f | %.2f | - | - | - |\n", wgs, d128, s128, s128 / d128);
        }
        fflush(stdout);
    }
    return 0;
}
