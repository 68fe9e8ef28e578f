// What this crate's CUDA C kernels share (included by each program's files): the integer
// types, the 16-bit conversions (bf16 or f16 by a template flag, f32 arithmetic) and a
// block-wide reduction. Compiled with NVRTC by `nvrtc_module.rs`, which expands this file
// in place of the first `#include "common.cuh"` of a program.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef long long i64;

// Two floats as two 16-bit values in one register, `lo` at the lower address.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}
template <bool BF16>
__device__ __forceinline__ u16 to16(float x) {
    return (u16)(pack2<BF16>(x, 0.f) & 0xffffu);
}

// A 16-bit value as f32.
template <bool BF16>
__device__ __forceinline__ float from16(u16 x) {
    if (BF16) return __uint_as_float((u32)x << 16);
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
    return f;
}

// Block-wide max or sum over N threads (N / 32 warps); `red` holds N / 32 floats.
template <int N, bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float x = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, x) : v + x;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < N / 32; ++w) v = MAX ? fmaxf(v, red[w]) : v + red[w];
    __syncthreads();
    return v;
}

// Eight 16-bit values in one 16-byte load or store, as four pairs (low half first, as
// `pack2` packs them).
struct __align__(16) Vec8 {
    u32 v[4];
};

template <bool BF16>
__device__ __forceinline__ float lo16(u32 v) { return from16<BF16>((u16)(v & 0xffffu)); }
template <bool BF16>
__device__ __forceinline__ float hi16(u32 v) { return from16<BF16>((u16)(v >> 16)); }

// Programmatic dependent launch (sm_90): lets a kernel launched behind this one with the
// programmatic-serialization attribute start its prologue now (a GEMV prefetching its
// weights); it still waits for this kernel to finish before it reads what this one writes.
__device__ __forceinline__ void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
