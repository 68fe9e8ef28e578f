// The SiLU-gated product of a fused gate/up projection's output, `silu(gate) * up`: one
// launch where burn queues `narrow`, `silu` and a product. 16-bit elements (bf16 or f16),
// f32 arithmetic, one rounding per output.

#include "common.cuh"

// Must match `GateParams` in block_steps.rs (repr(C)).
struct GateParams {
    u64 x, out;  // x [rows, 2 * width] = [gate | up], out [rows, width]
    i64 rows;
    int width;
};

// out = silu(gate) * up, grid-stride over the outputs.
template <bool BF16>
__device__ __forceinline__ void silu_mul(const GateParams& p) {
    const i64 n = p.rows * p.width;
    const u16* x = (const u16*)p.x;
    u16* out = (u16*)p.out;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / p.width;
        const i64 c = i - r * p.width;
        const float g = from16<BF16>(x[r * 2 * p.width + c]);
        const float u = from16<BF16>(x[r * 2 * p.width + p.width + c]);
        out[i] = to16<BF16>(g / (1.f + __expf(-g)) * u);
    }
}

extern "C" __global__ void silu_mul_bf16(GateParams p) { silu_mul<true>(p); }
extern "C" __global__ void silu_mul_f16(GateParams p) { silu_mul<false>(p); }
