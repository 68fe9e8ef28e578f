// Hopper (sm_90a) 2:4 structured-sparse INT8 GEMM on `wgmma.mma_async.sp`. With
// SLIDESPARSE_SPARSE_GEMM=compact the library launches `spgemm_compact_metadata` and then
// `spgemm_ws_n256_k128_{i32,bf16,f16}` on its output and the compact kept codes
// (cuda/compact_gemm.rs; bf16 / f16 write the layer output, epilogue applied, for 16-bit layers);
// every kernel is built and checked by scripts/bench-spgemm.cu (`scripts/gpu-run.sh spgemm`). Must be compiled for sm_90a (`-gencode=arch=compute_90a,code=sm_90a`,
// NVRTC `sm_90a`); elsewhere the kernels trap.
//
// What it computes (the transposed product, as cuSPARSELt does, so that the sparse matrix is
// wgmma's A operand):
//   D[n, t] = sum_k W'[n, k] X'[t, k]      n < N_out (weight rows), t < M (tokens), k < K'
//   OUT = 0: y INT32 [M, ldy], y[t, n] = D[n, t]                     (exact)
//   OUT = 1: y bf16  [M, ldy], y[t, n] = bf16_rn(((f32)D * s_x[t]) * s_w[n] + bias[n])
//            (f32, one rounding per operation, no FMA: the order decode_gemv.cu uses)
//   OUT = 2: y f16, as OUT = 1 with f16_rn (spgemm_ws::run and run_compact only: their 16-bit
//            epilogue is store_tile_16; store_out and the persistent kernels write bf16)
// y is row-major [M, N_out], the layout burn and the cuSPARSELt path use.
//
// Tile configuration (the only one): CTA tile 128 weight rows x 128 tokens x 256 K' per stage;
// 256 threads = 2 warpgroups, warpgroup w owns weight rows [64 w, 64 w + 64) of the CTA tile and
// all 128 tokens: per stage 4 x `wgmma.mma_async.sp.sync.aligned.m64n128k64.s32.s8.s8`
// (64 INT32 accumulators per thread). Both warpgroups also load (no producer warp).
//
// Pipeline: plain `cp.async` (16-byte, zero-fill for token/K' tails) into a ring of STAGES = 4
// shared-memory stages, `cp.async.wait_group` + `fence.proxy.async` + `__syncthreads` per K' tile.
// Chosen over TMA for this first version: TMA needs a tensor map built with the driver API
// (cuTensorMapEncodeTiled through libcuda or cudaGetDriverEntryPoint) and mbarrier
// expect-tx bookkeeping, two more things that can fail silently without a GPU to try them on;
// cp.async lets us write the 128B-swizzled layout ourselves with one XOR. TMA + a producer
// warp + mbarriers is stage (c).
// Two variants of the loop (template INFLIGHT):
//   INFLIGHT = false: wgmma.wait_group 0 after each tile (tensor cores idle during the barrier);
//                     loads run STAGES - 1 tiles ahead.
//   INFLIGHT = true:  one wgmma group stays in flight across the barrier (wait_group 1), so loads
//                     run STAGES - 2 tiles ahead (the stage of tile kt - 1 may still be read).
//
// Shared memory of one stage (53248 bytes, every part 1024-byte aligned):
//   A  [128 rows][128 bytes]              compressed W' (2 kept values of each group of 4 K'),
//                                         128B-swizzled, K-major
//   B  [2 halves of K'][128 tokens][128 bytes]  X' tile, 128B-swizzled, K-major (each half is
//                                         one 128-byte swizzle row wide)
//   E  [2 warpgroups][128 threads][4 words]  metadata registers, already in thread order
// 128B swizzle (Swizzle<3,4,3> in CuTe): inside each 1024-byte atom of 8 rows x 128 bytes, the
// 16-byte chunk c of row r sits at chunk c ^ (r & 7); atoms must be 1024-byte aligned because the
// hardware applies the XOR on absolute address bits [4,7) ^= [7,10).
//
// Global layouts (the contract with the host packer, `pack24` in scripts/bench-spgemm.cu, which
// owns every reordering; pads N_out to 128 and K' to 256):
//   a: INT8 [n_pad][lda], lda = k_tiles * 128 (= K'_pad / 2). Row n, group j (K' [4j, 4j + 4)):
//      bytes 2j, 2j + 1 = the values at positions idx0 < idx1 of that group (a zero where the
//      group has fewer than 2 nonzeros). Padding rows/groups are zero.
//   e: u32 [n_pad / 64][k_tiles][128][4]: word ((nb * k_tiles + kb) * 128 + t) * 4 + s is the
//      metadata register of thread t (0..127) of the warpgroup that owns rows [64 nb, 64 nb + 64),
//      for the k-step s (0..3) of K' tile kb, i.e. K' [256 kb + 64 s, 256 kb + 64 s + 64).
//      Inside a word, nibble i (bits [4i, 4i + 4)) is the group of K'
//      [kbase + 4i, kbase + 4i + 4) of row `row`, as idx0 | idx1 << 2, idx0 < idx1, where for
//      warp w = t / 32, lane l = t % 32:
//          row   = 64 nb + 16 w + (l >> 2) + 8 * (l & 1)
//          kbase = 256 kb + 64 s + 32 * ((l >> 1) & 1)
//      Padding groups use idx (0, 1) = nibble 0x4 (0b0000 is an invalid metadata value).
//   x: INT8 [m][ldx], K'-contiguous, rows 16-byte aligned, K' (p.k) a multiple of 16; columns
//      >= K' and rows >= m are never read (zero-filled in shared memory).
//
// Sources of the layout facts (file paths in github.com/NVIDIA/cutlass at 7107b055, Aug 2026;
// PTX ISA sections as in the PTX ISA 8.x/9.x documentation):
//   [PTX-SP]   PTX ISA 9.7.15.6.1 "Sparse matrix storage" (wgmma): for integer types, m64nNk64,
//              2:4 along K, the two kept values stored, "two 2-bit indices in the metadata",
//              "All threads contribute the sparsity metadata and the sparsity selector must be
//              0"; nibbles 0b0000, 0b0101, 0b1010, 0b1111 are invalid (undefined behaviour).
//   [PTX-FRAG] PTX ISA 9.7.15.6.2 / 9.7.15.6.2.3: warp %warpid % 4 = w provides the metadata of
//              rows [16 w, 16 w + 16) of A; the metadata operand is one .b32 of 16 4-bit
//              vectors (Figures 180/181 give the bit map; they are images we could not read).
//   [PTX-ORD]  PTX ISA 9.7.14.6.1 (mma.sp::ordered_metadata, same 4-bit encoding): meaningful
//              values 0b0100, 0b1000, 0b1001, 0b1100, 0b1101, 0b1110, i.e. idx0 in bits [1:0],
//              idx1 in bits [3:2], idx0 < idx1. We always emit such values.
//   [CUTE-E]   include/cute/atom/mma_traits_sm90_gmma_sparse.hpp, ELayout_64x64 (the E layout of
//              every GMMA_64xNx64 S8/U8/E4M3 sparse atom): thread (2,2,8,4):(8,2048,1,16),
//              value (32):(64) over the column-major 64 x 64 (M x K) tile, i.e. lane bit 0 ->
//              row + 8, lane bit 1 -> K + 32, lane >> 2 -> row, warp -> row + 16, and the 32
//              values (32 consecutive K) of a thread are its one .b32 (ValTypeE =
//              sparse_elem<8, uint8_t>: 8 K per byte, so byte b covers K [8b, 8b + 8)).
//   [CUTE-ECFG] include/cutlass/gemm/collective/builders/sm90_sparse_config.inl,
//              TensorEAtom_8bit: E stored row-major (K contiguous) for 8-bit types, consistent
//              with a thread's 32 K of one row being one contiguous 32-bit word.
//   [CUTE-COMP] include/cutlass/transform/kernel/sm90_sparse_gemm_compressor.hpp: the kept value
//              number i of a chunk (in increasing position) gets its 2-bit position at bits
//              [2i, 2i + 2) of the chunk's 4-bit metadata (uint4_t chunks, packed low nibble
//              first, row-major per TensorEAtom_8bit); values stored in increasing position. (It
//              writes 0b0000 for an all-zero chunk, a value PTX calls invalid; we write 0b0100.)
//   [CUTE-SPA] mma_traits_sm90_gmma_sparse.hpp Layout_K_SW128_SpAtom and
//              include/cutlass/gemm/collective/builders/sm90_common.inl ss_smem_selector_sparse:
//              the sparse A tile in shared memory is the COMPRESSED matrix laid out exactly like a
//              dense K-major SW128 tile of K/2 elements (logical K / 2 = physical bytes).
//   [CUTE-DESC] include/cute/arch/mma_sm90_desc.hpp (GmmaDescriptor bit fields) and
//              include/cute/atom/mma_traits_sm90_gmma.hpp make_gmma_desc<Major::K>: start
//              address >> 4 in bits [0,14), LBO >> 4 in [16,30) (unused for swizzled K-major,
//              "assumed to be 1"), SBO >> 4 in [32,46) (stride between 8-row groups), base
//              offset in [49,52), layout type in [62,64) with SWIZZLE_128B = 1; "K-size 2 for
//              dense or 4 for sparse (in units of uint128_t)" (sparse B: 64 bytes per k64 step).
//              DescriptorIterator advances only the start address (K steps inside the atom).
//   [CUTE-OP]  include/cute/arch/mma_sm90_gmma_sparse.hpp GMMA_64x128x64_S32S8S8_SS_TN: the PTX
//              string "wgmma.mma_async.sp.sync.aligned.m64n128k64.s32.s8.s8 {d}, desc_a, desc_b,
//              e, spsel, p" (scale-d predicate only; no transpose or negate immediates for
//              integer types, both operands K-major).
//   [CUTE-C]   mma_traits_sm90_gmma.hpp CLayout_64xN: accumulator d[4j + v] of lane l of warp w
//              is row 16 w + (l >> 2) + 8 (v >> 1), column 8 j + 2 (l & 3) + (v & 1).

#include "common.cuh"

// Must match the harness (and a future repr(C) struct in Rust).
struct SpGemmParams {
    u64 a;        // compressed W' values, INT8 [n_pad][lda]
    u64 e;        // metadata words, u32 [n_pad / 64][k_tiles][128][4]
    u64 x;        // X', INT8 [m][ldx]
    u64 sx;       // f32 [m] (OUT = 1)
    u64 sw;       // f32 [n] (OUT = 1)
    u64 bias;     // f32 [n] or 0 (OUT = 1)
    u64 y;        // INT32 or bf16 [m][ldy]
    int m, n, k;  // tokens, weight rows (unpadded), K' (valid columns of X', multiple of 16)
    int lda, ldx, ldy;
    int k_tiles;  // K'_pad / 256
};

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPGEMM_HAS_WGMMA 1
#else
#define SPGEMM_HAS_WGMMA 0
#endif

// Dynamic shared memory of a kernel with S stages (+1024 to align the ring to 1024 bytes).
#define SPGEMM_STAGE_BYTES 53248
#define SPGEMM_SMEM_BYTES(S) ((S) * SPGEMM_STAGE_BYTES + 1024)
#define SPGEMM_THREADS 256
#define SPGEMM_TILE_N 128  // weight rows per CTA (grid.y = n_pad / 128)
#define SPGEMM_TILE_M 128  // tokens per CTA (grid.x = ceil(m / 128))

namespace spgemm {

constexpr int BM = 128;                   // weight rows per CTA (wgmma M: 2 x 64)
constexpr int BN = 128;                   // tokens per CTA (wgmma N)
constexpr int BK = 256;                   // K' per stage (4 wgmma k-steps of 64)
constexpr int A_BYTES = BM * BK / 2;      // 16384: 128 rows x 128 compressed bytes
constexpr int B_BYTES = BN * BK;          // 32768: 2 x [128 tokens][128 bytes]
constexpr int B_HALF = BN * 128;          // 16384: one 128-byte-wide K' half of B
constexpr int E_BYTES = 2 * 128 * 16;     // 4096: 2 warpgroups x 128 threads x 4 words
constexpr int STAGE = A_BYTES + B_BYTES + E_BYTES;
static_assert(STAGE == SPGEMM_STAGE_BYTES, "stage size");
static_assert(A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0 && STAGE % 1024 == 0, "1024-byte alignment of the swizzled parts");

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// src_size 0 writes 16 zero bytes (src must still be a valid address).
__device__ __forceinline__ void cp16_zfill(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void lds128(u32 addr, u32 (&v)[4]) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr) : "memory");
}

#if SPGEMM_HAS_WGMMA
// Makes this thread's completed generic-proxy writes to shared memory (the cp.async data) visible
// to the async proxy that wgmma reads through. UNVERIFIED: whether cp.async writes need it at all
// (CUTLASS's cp.async + GMMA mainloop, sm90_mma_multistage_gmma_ss_warpspecialized.hpp, has no
// such fence; HOPPER.md and the PTX memory model ask for it after ordinary stores). Kept: it is
// cheap and errs on the safe side.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pins a register's value at this point of the program (CUTLASS's warpgroup_fence_operand): the
// compiler may not move reads or writes of `r` across it.
__device__ __forceinline__ void fence_reg(int& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void fence_reg(u32& r) { asm volatile("" : "+r"(r)::"memory"); }
// Keeps a register's value alive up to this point with a real instruction (an empty asm is not
// seen by ptxas, which allocates registers from the PTX): folds `r` into `sink`, which the kernel
// stores under a condition that never holds.
__device__ __forceinline__ void keep_reg(u32& sink, u32 r) { asm volatile("xor.b32 %0, %0, %1;\n" : "+r"(sink) : "r"(r)); }

// Shared-memory matrix descriptor for a K-major operand in the 128B-swizzle layout [CUTE-DESC]:
// start address >> 4, LBO = 1 (unused for swizzled K-major), SBO = 1024 bytes (8 rows of 128
// bytes), base offset 0 (atoms 1024-aligned), layout type 1 = SWIZZLE_128B.
// A K-step inside the 128-byte swizzle row is taken by advancing the start address only (what
// CUTLASS's DescriptorIterator does). UNVERIFIED for the sparse A operand: advancing by 32 bytes
// (one k64 step of compressed s8) inside the swizzle row, as for a dense m64nNk32 s8 A.
__device__ __forceinline__ u64 desc_sw128(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// D[64 x 128] += A_sparse[64 x 64 (32 stored bytes per row)] * B[64 x 128], s8 x s8 -> s32,
// A and B from shared memory, `e` this thread's metadata register, sparsity selector 0 (the only
// legal value for 8-bit types [PTX-SP]); accumulate (scale-d = 1): the caller zeroes `d` first.
// Operand order and PTX string as [CUTE-OP].
__device__ __forceinline__ void wgmma_sp_m64n128k64(int (&d)[64], u64 desc_a, u64 desc_b, u32 e) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %67, 0;\n"
        "wgmma.mma_async.sp.sync.aligned.m64n128k64.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, %66, 0, p;\n"
        "}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
          "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
          "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
          "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
          "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(e), "r"(1));
}

// D[64 x 256] += A_sparse[64 x 64] * B[64 x 256], as wgmma_sp_m64n128k64 with N = 256 (128 accumulators).
__device__ __forceinline__ void wgmma_sp_m64n256k64(int (&d)[128], u64 desc_a, u64 desc_b, u32 e) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %131, 0;\n"
        "wgmma.mma_async.sp.sync.aligned.m64n256k64.s32.s8.s8 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, "
        "%72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, "
        "%88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, "
        "%104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, "
        "%120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, %130, 0, p;\n"
        "}\n"
        :
          "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
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
        : "l"(desc_a), "l"(desc_b), "r"(e), "r"(1));
}
#endif  // SPGEMM_HAS_WGMMA

// Issues this thread's copies of K' tile `kt` into the stage at shared address `st`:
// A 1024 chunks of 16 bytes (4 per thread), B 2048 (8 per thread), E 256 (1 per thread).
// Consecutive threads take consecutive 16-byte chunks of a row (coalesced).
__device__ __forceinline__ void load_tile(const SpGemmParams& p, u32 st, int kt, int m0, int n0, int tid) {
    const char* a = (const char*)p.a;
    const char* x = (const char*)p.x;
    const char* e = (const char*)p.e;
    // A: row r (0..127) of the CTA's weight rows, compressed bytes [128 kt, 128 kt + 128).
    // The host padded rows to n_pad and K' to k_tiles * 256, so every chunk is in bounds.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int c = tid + SPGEMM_THREADS * j, row = c >> 3, ch = c & 7;
        cp16(st + row * 128 + ((ch ^ (row & 7)) << 4), a + (size_t)(n0 + row) * p.lda + (size_t)kt * 128 + ch * 16);
    }
    // B: token row r, K' bytes [256 kt + 16 col, + 16): half col >> 3, chunk col & 7 of the row.
    const u32 sb = st + A_BYTES;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int c = tid + SPGEMM_THREADS * j, row = c >> 4, col = c & 15, ch = col & 7;
        const int tok = m0 + row, kk = kt * BK + col * 16;
        const bool ok = tok < p.m && kk < p.k;
        const char* src = ok ? x + (size_t)tok * p.ldx + kk : x;
        cp16_zfill(sb + (col >> 3) * B_HALF + row * 128 + ((ch ^ (row & 7)) << 4), src, ok);
    }
    // E: the 2 KB block of words of 64-row block 2 blockIdx.y + h for tile kt, copied as is.
    {
        const int h = tid >> 7, t = tid & 127;
        const size_t word = (((size_t)(2 * (n0 / BM) + h) * p.k_tiles + kt) * 128 + t) * 4;
        cp16(st + A_BYTES + B_BYTES + tid * 16, e + word * 4);
    }
}

template <int OUT>
__device__ __forceinline__ void store_out(const SpGemmParams& p, int tok, int n, int v) {
    static_assert(OUT == 0 || OUT == 1, "INT32 or bf16");
    const size_t at = (size_t)tok * p.ldy + n;
    if (OUT == 0) {
        ((int*)p.y)[at] = v;
    } else {
        float y = __fmul_rn(__fmul_rn((float)v, ((const float*)p.sx)[tok]), ((const float*)p.sw)[n]);
        if (p.bias) y = __fadd_rn(y, ((const float*)p.bias)[n]);
        u16 h;
        asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(y));
        ((u16*)p.y)[at] = h;
    }
}

#if SPGEMM_HAS_WGMMA
// One K' tile of the main loop: wait for tile kt's copies, refill the stage freed last, load this
// tile's metadata words into `e`, issue its 4 wgmmas, and wait for the previous tile's group
// (INFLIGHT) or this one (serial).
// `e_prev` holds the words the previous tile's wgmmas were issued with. wgmma reads its metadata
// register asynchronously, like the accumulators: the register must keep its value until the
// group is known complete (measured: copying the words to another variable and reusing the
// issued register for the next tile corrupts every multi-tile product, while the serial loop
// is exact). So the caller alternates two register sets by unrolling the loop by two, and each
// set is pinned after the wait that retires its group; no set is written before that.
template <int STAGES, bool INFLIGHT>
__device__ __forceinline__ void tile_step(const SpGemmParams& p, u32 base, int kt, int m0, int n0, int tid, int (&acc)[64],
                                          u32 (&e)[4], u32 (&e_prev)[4], u32& sink) {
    constexpr int P = INFLIGHT ? STAGES - 2 : STAGES - 1;
    const int wg = tid >> 7, t128 = tid & 127;
    // Groups committed so far: tiles 0 .. kt + P - 1; tile kt must be complete.
    cp_wait<P - 1>();
    fence_proxy_async();
    // All threads' copies of tile kt have landed, and every warpgroup has finished the wgmma
    // group of tile kt - 1 (serial) or kt - 2 (in flight), whose stage we refill now.
    __syncthreads();
    {
        const int nt = kt + P;
        if (nt < p.k_tiles) load_tile(p, base + (nt % STAGES) * STAGE, nt, m0, n0, tid);
        cp_commit();
    }
    const u32 st = base + (kt % STAGES) * STAGE;
    const u32 sa = st + wg * (64 * 128);  // this warpgroup's 64 rows
    const u32 sb = st + A_BYTES;
    lds128(st + A_BYTES + B_BYTES + wg * 2048 + t128 * 16, e);
#pragma unroll
    for (int i = 0; i < 64; ++i) fence_reg(acc[i]);
    wgmma_fence();  // orders the e loads (and the zeroed accumulators) before the wgmmas
#pragma unroll
    for (int s = 0; s < 4; ++s)
        wgmma_sp_m64n128k64(acc, desc_sw128(sa + s * 32), desc_sw128(sb + (s >> 1) * B_HALF + (s & 1) * 64), e[s]);
    wgmma_commit();
    if (INFLIGHT) {
        wgmma_wait<1>();  // the group of tile kt - 1 is done: its metadata registers are free
    } else {
        wgmma_wait<0>();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) keep_reg(sink, e_prev[i]);
#pragma unroll
    for (int i = 0; i < 64; ++i) fence_reg(acc[i]);
}
#endif

// One CTA: weight rows [128 blockIdx.y, + 128), tokens [128 blockIdx.x, + 128).
template <int STAGES, bool INFLIGHT, int OUT>
__device__ __forceinline__ void run(const SpGemmParams& p, unsigned char* smem) {
#if SPGEMM_HAS_WGMMA
    // Tiles in flight ahead of the one computed (see the header).
    constexpr int P = INFLIGHT ? STAGES - 2 : STAGES - 1;
    static_assert(P >= 1, "too few stages");
    const int tid = threadIdx.x, wg = tid >> 7;
    const int m0 = blockIdx.x * BN, n0 = blockIdx.y * BM;
    const u32 base = (smem_u32(smem) + 1023u) & ~1023u;
    const int kts = p.k_tiles;

    int acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0;
    // Two metadata register sets, even and odd tiles (see tile_step).
    u32 e0[4] = {0u, 0u, 0u, 0u}, e1[4] = {0u, 0u, 0u, 0u}, sink = 0u;

#pragma unroll
    for (int s = 0; s < P; ++s) {
        if (s < kts) load_tile(p, base + s * STAGE, s, m0, n0, tid);
        cp_commit();  // always (possibly empty), so that group i is tile i
    }

    for (int kt = 0; kt < kts; kt += 2) {
        tile_step<STAGES, INFLIGHT>(p, base, kt, m0, n0, tid, acc, e0, e1, sink);
        if (kt + 1 < kts) tile_step<STAGES, INFLIGHT>(p, base, kt + 1, m0, n0, tid, acc, e1, e0, sink);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) fence_reg(acc[i]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        keep_reg(sink, e0[i]);
        keep_reg(sink, e1[i]);
    }
    if (p.m < 0) ((u32*)p.y)[tid] = sink;  // never: makes the metadata registers' uses real
    cp_wait<0>();  // only empty groups can be left; drain them before exit

    // Epilogue straight from the accumulators [CUTE-C]: thread (warp w, lane l) holds rows
    // 16 w + (l >> 2) (+ 8) of its warpgroup's 64 and tokens 8 j + 2 (l & 3) (+ 1).
    // TODO(perf): stage through shared memory for coalesced 16-byte stores.
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    const int nrow = n0 + wg * 64 + warp * 16 + (lane >> 2);
    const int tcol = m0 + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int n = nrow + 8 * (v >> 1), tok = tcol + 8 * j + (v & 1);
            if (n < p.n && tok < p.m) store_out<OUT>(p, tok, n, acc[4 * j + v]);
        }
#else
    __trap();  // not built for sm_90a
#endif
}

}  // namespace spgemm

#define SPGEMM_KERNEL(NAME, STAGES, INFLIGHT, OUT)                                                 \
    extern "C" __global__ void __launch_bounds__(SPGEMM_THREADS, 1) NAME(const SpGemmParams p) { \
        extern __shared__ __align__(1024) unsigned char spgemm_smem[];                             \
        spgemm::run<STAGES, INFLIGHT, OUT>(p, spgemm_smem);                                        \
    }

// grid (ceil(m / 128), n_pad / 128), 256 threads, SPGEMM_SMEM_BYTES(4) bytes of dynamic shared
// memory (raise the limit with cudaFuncSetAttribute first).
SPGEMM_KERNEL(spgemm_sm90_i32, 4, true, 0)
SPGEMM_KERNEL(spgemm_sm90_i32_serial, 4, false, 0)
SPGEMM_KERNEL(spgemm_sm90_bf16, 4, true, 1)

// =================================================================================================
// Stage (c): the warp-specialized kernel (`spgemm_ws_*`).
//
// Same product, same A values layout, same epilogue as above; what changes is how tiles reach
// shared memory and who waits for whom:
//   - 384 threads = 3 warpgroups. Warpgroup 0 is the producer: one thread issues TMA loads (A and
//     X' through tensor maps, which also apply the swizzle and zero-fill the token / K' tails) and
//     one bulk copy of the stage's metadata words, all completing on the stage's `full` mbarrier
//     (expect-tx of the stage's bytes). Its registers go to the consumers (setmaxnreg).
//   - Warpgroups 1 and 2 are the consumers (weight rows [0, 64) and [64, 128) of the CTA tile):
//     wait on `full`, issue the stage's wgmmas, keep one group in flight, and release the stage
//     before on its `empty` mbarrier (one arrival per consumer warp, 8 in all) once that
//     earlier group has retired. No block-wide barrier in the main loop.
//   - Tile configurations (template BN, BK): CTA tile 128 weight rows x BN tokens, BK K' per
//     stage. BK = 128 stores A 64 bytes per row (SWIZZLE_64B), BK = 256 128 bytes (SWIZZLE_128B);
//     X' is always [BN tokens][128 bytes] SWIZZLE_128B per 128 K' (BK / 128 such halves).
//     BN = 256 uses m64n256k64 (128 accumulators per consumer thread).
//
// Global layouts it needs from the host (scripts/bench-spgemm.cu `pack_e_ws`, tensor maps there):
//   ta: tensor map over the compressed A, u8 [n_pad][lda] (as `a` above, lda = K'_pad / 2,
//       K'_pad a multiple of 256), box {BK / 2, 128}, swizzle 64B (BK = 128) or 128B (BK = 256).
//   tb: tensor map over X', u8 dims {K', m}, row stride ldx, box {128, BN}, swizzle 128B,
//       out-of-bounds elements zero.
//   e:  u32 [n_pad / 128][K'_pad / BK][2 consumers][128 threads][BK / 64 k-steps], the words of
//       the metadata map of the kernel above (row = 64 (2 nb + c) + 16 w + (l >> 2) + 8 (l & 1),
//       kbase = BK kb + 64 s + 32 ((l >> 1) & 1)); one stage's words are one contiguous block.
//
// The persistent kernels (same parameters, layouts, tensor maps and raster order; CL = 1):
//   - `spgemm_ws_n256_k128_{i32,bf16}_persistent` ("cooperative", run_persistent): the n256 k128
//     tile above, grid = min(tiles, SMs) CTAs (the host passes the SM count through the grid
//     size; the kernel only uses gridDim), CTA b computing the tiles b, b + gridDim.x, ... of
//     tile_at's raster order (so the grid's i-th round covers what the non-persistent kernel's
//     i-th wave of CTAs did). The ring runs on across tiles: K' tile number i of the CTA,
//     counted over all its tiles, is in stage i % STAGES with full/empty parity
//     (i / STAGES) & 1, a position (RingPos) that producer and consumers advance in the same
//     order and never reset at a tile boundary. The producer thread goes straight on to the
//     next tile's K' tiles; the consumers, after the tile's last wgmma.wait_group 0, release
//     its last stage and then store the tile from their accumulators (the epilogue reads no
//     shared memory), so while they store, the producer fills up to all STAGES stages of the
//     next tile, and its first wgmmas find them loaded: the ring is never drained and refilled
//     at a tile boundary, only the tensor cores idle during the stores.
//   - `spgemm_ws_n128_k128_i32_pingpong` (run_pingpong): as persistent, but the two consumer
//     warpgroups alternate tiles: warpgroup c computes the CTA's tiles c, c + 2, ... of its walk,
//     each a whole 128 weight rows x 128 tokens tile (both 64-row halves of A: per K' tile
//     2 x 2 m64n128k64, 2 x 64 accumulators and 2 x 2 metadata words per set per thread). The
//     producer loads the CTA's tiles one after the other into the ring as above; each stage is
//     read by one warpgroup (empty barriers count its 4 warps). A warpgroup starts a tile's
//     mainloop only after the other has issued its mainloop of the previous tile (two order
//     mbarriers, one arrival per warp), which keeps every full-barrier wait within one phase of
//     the barrier (see run_pingpong) and makes the turns: one warpgroup's wgmmas run while the
//     other stores its tile. n128: 2 x 128 accumulators for a 128 x 256 tile per warpgroup do
//     not fit the 232 registers; a 64-row tile would double the X' bytes per operation.
//   Both: 168 registers at launch, setmaxnreg 40 / 232 as above, no spills, no C7515.

// A CUtensorMap (the driver's opaque 128-byte, 64-byte-aligned descriptor), built on the host by
// cuTensorMapEncodeTiled; declared here because NVRTC has no cuda.h.
struct __align__(64) SpTensorMap {
    u64 opaque[16];
};

// Entries of SpGemmWsParams::table: C(16, 2) = 120 zero pairs of the longest block (14:16), rounded up.
#define SPGEMM_RANK_TABLE 128

// Must match the harness. Passed as a __grid_constant__ parameter so that the tensor maps' addresses
// are the parameter space's (what TMA instructions require of a map that is not in global memory).
struct __align__(64) SpGemmWsParams {
    SpTensorMap ta, tb;
    u64 e, sx, sw, bias, y;
    int m, n, k;    // tokens, weight rows (unpadded), K' (valid columns of X')
    int ldy;
    int k_tiles;    // K'_pad / BK
    int n_tiles;    // n_pad / 128
    int group;      // weight-row tiles per raster group (>= 1), see spgemm_ws::tile_of
    // The compact kernels (`spgemm_ws_*_compact`, see "The compact kernels" below) only:
    SpTensorMap tr;  // the packed zero-pair ranks, u8 [n][rank row bytes], box {32, 128}
    int win;         // 2:4 windows per block, N - 1
    int rbits;       // bits per rank, ceil(log2 C(2N, 2))
    u32 table[SPGEMM_RANK_TABLE];  // per rank: the 4-bit metadata of window j at bits [4 j, 4 j + 4)
};

// The host's mirror of SpGemmWsParams (cuda/compact_gemm.rs `SpGemmParams`) checks the same size
// and the offset of `tr` (384: the 324 bytes before it rounded up to its 64-byte alignment).
static_assert(sizeof(SpGemmWsParams) == 1088, "SpGemmWsParams layout");
#define SPGEMM_WS_THREADS 384
// The most dynamic shared memory a block may have on sm_90 (227 KB).
// The metadata kernel's parameters (`spgemm_compact_metadata`; must match
// cuda/compact_gemm.rs `MetaParams`).
struct SpMetaParams {
    u64 ranks;        // u8 [n][rank_stride]: the compact rows' packed ranks (rows 16-byte aligned)
    u64 e;            // out: the ws kernels' metadata for BK = 128, [n_tiles][k_tiles][2048 bytes]
    int n;            // weight rows
    int rank_stride;  // bytes per rank row, a multiple of 16
    int k_tiles;      // ceil(K' / 128)
    int n_tiles;      // ceil(n / 128)
    int win, rbits;   // as SpGemmWsParams
    u32 table[SPGEMM_RANK_TABLE];
};
static_assert(sizeof(SpMetaParams) == 552, "SpMetaParams layout");

#define SPGEMM_WS_SMEM_LIMIT 232448

namespace spgemm_ws {

template <int BN_, int BK_>
struct Cfg {
    static constexpr int BN = BN_, BK = BK_;
    static constexpr int A_BYTES = 128 * BK / 2;
    static constexpr int B_HALF = BN * 128;
    static constexpr int B_BYTES = (BK / 128) * B_HALF;
    static constexpr int KSTEPS = BK / 64;
    static constexpr int E_BYTES = 2 * 128 * KSTEPS * 4;
    static constexpr int STAGE = A_BYTES + B_BYTES + E_BYTES;
    // As many stages as fit beside the 1024-byte alignment slack and the barriers, at most 8.
    static constexpr int FIT = (SPGEMM_WS_SMEM_LIMIT - 1024 - 256) / STAGE;
    static constexpr int STAGES = FIT < 8 ? FIT : 8;
    static constexpr int SMEM = STAGES * STAGE + 1024 + 256;
    static constexpr int ACC = BN / 2;  // 64 rows x BN tokens over 128 threads
    static_assert(BK == 128 || BK == 256, "BK");
    static_assert(BN == 128 || BN == 256, "BN");
    static_assert(STAGE % 1024 == 0 && A_BYTES % 1024 == 0 && B_HALF % 1024 == 0, "1024-byte alignment of the swizzled parts");
    static_assert(STAGES >= 3, "too few stages");
};

#if SPGEMM_HAS_WGMMA
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives once and adds `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed (a fresh barrier counts its phase
// "before 0", of parity 1, as completed).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// A 2-D TMA box of `map` at element coordinates (c0 inner, c1 outer) into shared `dst`, completing
// on `bar`.
__device__ __forceinline__ void tma_2d(u32 dst, const SpTensorMap* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
        "l"(map), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
// `bytes` (a multiple of 16) contiguous bytes from global `src` to shared `dst`, completing on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src),
                 "r"(bytes), "r"(bar)
                 : "memory");
}

// The TMA box of tma_2d, written into the shared memory of every CTA of the cluster in `mask` at
// the same offset `dst`, each completing its bytes on its own barrier at offset `bar`.
__device__ __forceinline__ void tma_2d_multicast(u32 dst, const SpTensorMap* map, u32 bar, int c0, int c1, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%4, %5}], "
        "[%2], %3;\n" ::"r"(dst),
        "l"(map), "r"(bar), "h"(mask), "r"(c0), "r"(c1)
        : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Arrives once on the barrier at shared offset `bar` of CTA `rank` of the cluster (this one or a peer).
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 rank) {
    asm volatile(
        "{\n"
        ".reg .b32 ra;\n"
        "mapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [ra];\n"
        "}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}
// Every thread of every CTA of the cluster (not per warp: the producer warpgroup arrives diverged).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

// Descriptor of a K-major SWIZZLE_64B operand (rows of 64 bytes, 8-row groups 512 bytes apart):
// layout type 2 in bits [62, 64) [CUTE-DESC].
__device__ __forceinline__ u64 desc_sw64(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(512 >> 4) << 32) | ((u64)2 << 62);
}
template <int BK>
__device__ __forceinline__ u64 desc_a(u32 saddr) {
    return BK == 128 ? desc_sw64(saddr) : spgemm::desc_sw128(saddr);
}

__device__ __forceinline__ void wgmma_sp(int (&d)[64], u64 da, u64 db, u32 e) { spgemm::wgmma_sp_m64n128k64(d, da, db, e); }
__device__ __forceinline__ void wgmma_sp(int (&d)[128], u64 da, u64 db, u32 e) { spgemm::wgmma_sp_m64n256k64(d, da, db, e); }

// The tile of this CTA (1-D grid of m_tiles x n_tiles CTAs): token offset m0 and weight-row tile nt.
// CTAs run in blockIdx order, so the order decides what one wave of ~132 CTAs reads. Token tiles
// fastest (a 2-D grid's order) makes a wave read every token tile of X' for one or two weight tiles:
// once X' outgrows L2 (M = 16384, K' = 6144: 100 MB) every wave streams it from HBM again. Instead
// `group` weight tiles run side by side (weight tile fastest), then the next token tiles: a wave
// covers group x (132 / group) tiles, whose A and X' parts stay in L2 across the wave.
//
// With clusters of CL CTAs (CL = 2: the X' tile multicast, see produce), the tile counts and the
// group are rounded up to multiples of CL, so the CL CTAs of a cluster (consecutive blockIdx) get
// the same token tile and CL consecutive weight tiles. A weight tile past n_tiles (odd n_tiles) is a
// phantom: it loads zeros for A (out of bounds of the A map), helps its peer with X', stores nothing.
// tile_at maps any tile index `idx` of that order (the persistent kernels walk several per CTA).
template <int BN, int CL>
__device__ __forceinline__ void tile_at(const SpGemmWsParams& p, int idx, int& m0, int& nt) {
    const int m_tiles = (p.m + BN - 1) / BN, nt_all = (p.n_tiles + CL - 1) / CL * CL;
    const int g = (p.group + CL - 1) / CL * CL, span = g * m_tiles;
    const int first = idx / span * g, r = idx % span;
    const int rows = min(g, nt_all - first);
    nt = first + r % rows;
    m0 = r / rows * BN;
}
template <int BN, int CL>
__device__ __forceinline__ void tile_of(const SpGemmWsParams& p, int& m0, int& nt) {
    tile_at<BN, CL>(p, (int)blockIdx.x, m0, nt);
}

template <class C>
__device__ __forceinline__ u32 full_bar(u32 bars, int s) { return bars + 8 * s; }
template <class C>
__device__ __forceinline__ u32 empty_bar(u32 bars, int s) { return bars + 8 * (C::STAGES + s); }

// The producer thread: stage after stage, waits for the consumers to free it, then loads A, the
// X' halves and the metadata words of K' tile kt into it.
// With CL = 2 the two CTAs of a cluster share the token tile: each loads BN / 2 of its tokens and
// multicasts them into both CTAs (half the X' reads from L2 per CTA), so a stage is free only
// once the consumers of both CTAs have released it (the empty barriers count both).
template <class C, int CL>
__device__ __forceinline__ void produce(const SpGemmWsParams& p, u32 base, u32 bars) {
    int m0, nt;
    tile_of<C::BN, CL>(p, m0, nt);
    const int n0 = nt * 128;
    // A phantom tile reads the last real tile's words (any valid memory: its rows are not stored).
    const char* e = (const char*)p.e + (size_t)min(nt, p.n_tiles - 1) * p.k_tiles * C::E_BYTES;
    const int rank = CL > 1 ? (int)cluster_rank() : 0;
    for (int kt = 0; kt < p.k_tiles; ++kt) {
        const int s = kt % C::STAGES;
        mbar_wait(empty_bar<C>(bars, s), ((kt / C::STAGES) & 1) ^ 1);
        const u32 st = base + s * C::STAGE, full = full_bar<C>(bars, s);
        // Every byte of the stage lands here, the peer's X' half included.
        mbar_expect_tx(full, C::STAGE);
        tma_2d(st, &p.ta, full, kt * (C::BK / 2), n0);
#pragma unroll
        for (int h = 0; h < C::BK / 128; ++h) {
            const u32 dst = st + C::A_BYTES + h * C::B_HALF;
            if constexpr (CL == 1) {
                tma_2d(dst, &p.tb, full, kt * C::BK + 128 * h, m0);
            } else {
                tma_2d_multicast(dst + rank * (C::B_HALF / CL), &p.tb, full, kt * C::BK + 128 * h, m0 + rank * (C::BN / CL),
                                 (unsigned short)((1u << CL) - 1));
            }
        }
        bulk_copy(st + C::A_BYTES + C::B_BYTES, e + (size_t)kt * C::E_BYTES, C::E_BYTES, full);
    }
    if constexpr (CL > 1) {
        // The peer's consumers arrive on this CTA's empty barriers up to their last tile: acquire
        // every stage once more (each completes only when both CTAs' consumers released it), so this
        // CTA outlives those arrivals. A cluster barrier here instead would park this thread's 31
        // warp-mates in barrier.cluster.wait beside the producer loop.
        for (int kt = p.k_tiles; kt < p.k_tiles + C::STAGES; ++kt)
            mbar_wait(empty_bar<C>(bars, kt % C::STAGES), ((kt / C::STAGES) & 1) ^ 1);
    }
}

// A consumer warp frees the stage of K' tile kt (its wgmma group has completed).
template <class C, int CL>
__device__ __forceinline__ void release(u32 bars, int kt, int t128) {
    if ((t128 & 31) != 0) return;
    const u32 bar = empty_bar<C>(bars, kt % C::STAGES);
    if constexpr (CL == 1) {
        mbar_arrive(bar);
    } else {
        // The stage of both CTAs is free for this warp: both producers write into this CTA's copy.
#pragma unroll
        for (int r = 0; r < CL; ++r) mbar_arrive_cluster(bar, (u32)r);
    }
}

// One K' tile of a consumer warpgroup `cw` (see spgemm::tile_step for why the metadata words
// alternate between two register sets `e` / `e_prev`).
template <class C, int CL>
__device__ __forceinline__ void consume(u32 base, u32 bars, int kt, int cw, int t128, int (&acc)[C::ACC], u32 (&e)[C::KSTEPS],
                                        u32 (&e_prev)[C::KSTEPS], u32& sink) {
    const int s = kt % C::STAGES;
    mbar_wait(full_bar<C>(bars, s), (kt / C::STAGES) & 1);
    const u32 st = base + s * C::STAGE;
    const u32 sa = st + cw * 64 * (C::BK / 2), sb = st + C::A_BYTES;
    const u32 se = st + C::A_BYTES + C::B_BYTES + (cw * 128 + t128) * C::KSTEPS * 4;
    if constexpr (C::KSTEPS == 2) {
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(e[0]), "=r"(e[1]) : "r"(se) : "memory");
    } else {
        u32 v[4];
        spgemm::lds128(se, v);
#pragma unroll
        for (int i = 0; i < C::KSTEPS; ++i) e[i] = v[i];
    }
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) spgemm::fence_reg(acc[i]);
    spgemm::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < C::KSTEPS; ++ks)
        wgmma_sp(acc, desc_a<C::BK>(sa + ks * 32), spgemm::desc_sw128(sb + (ks >> 1) * C::B_HALF + (ks & 1) * 64), e[ks]);
    spgemm::wgmma_commit();
    spgemm::wgmma_wait<1>();  // tile kt - 1's group is done: its stage and metadata registers are free
#pragma unroll
    for (int i = 0; i < C::KSTEPS; ++i) spgemm::keep_reg(sink, e_prev[i]);
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) spgemm::fence_reg(acc[i]);
    if (kt > 0) release<C, CL>(bars, kt - 1, t128);
}

// The 16-bit epilogue (OUT = 1 bf16, OUT = 2 f16) of a non-persistent CTA: the consumers' tile
// y[m0 .. m0 + BN, n0 .. n0 + 128] written through shared memory, so that global stores are
// whole 16-byte pieces of output rows instead of one 2-byte value per accumulator (a thread's
// accumulators are 2 weight rows x 2 * BN / 8 tokens: consecutive values of a y row live in
// consecutive lanes). Called once every wgmma of the CTA has retired and the ring holds nothing
// in flight (every stage the producer loaded was waited for), so the ring is free:
//   [0, BN * 256)             the tile, [BN tokens][128 rows] 16-bit, row-major; the 16-byte
//                             piece c (rows 8c .. 8c + 7) of token t at piece c ^ (t & 7)
//                             (8 tokens of one piece column fall on 8 bank groups)
//   [BN * 256, + BN * 4)      the tile's token scales
// Each value is bf16_rn / f16_rn(((f32)acc * s_x[t]) * s_w[n] + bias[n]) (f32, one rounding per
// operation, no FMA), as store_out and decode_gemv.cu. `stmatrix ... .trans` (PTX ISA, "stmatrix")
// stores 8 x 8 16-bit fragments transposed: lane l holds row l / 4, columns 2 (l % 4) and + 1 of
// each, which is the accumulator layout [CUTE-C] of 8 weight rows x 8 tokens, so each token
// lands as a 16-byte row of 8 weight rows.
template <class C, int OUT>
__device__ __forceinline__ void store_tile_16(const SpGemmWsParams& p, u32 base, int m0, int nt, int cw, int t128,
                                              const int (&acc)[C::ACC]) {
    static_assert(OUT == 1 || OUT == 2, "16-bit outputs only");
    constexpr int BN = C::BN;
    static_assert(BN <= 256 && BN * 256 + BN * 4 <= C::STAGES * C::STAGE, "the staged tile fits the ring");
    const int warp = t128 >> 5, lane = t128 & 31, ct = cw * 128 + t128;
    const int nrow = nt * 128 + cw * 64 + warp * 16 + (lane >> 2);
    // Loaded before the barrier, which hides their latency.
    const float* sw = (const float*)p.sw;
    const float* bias = (const float*)p.bias;
    const bool has_bias = p.bias != 0;
    float w[2], b[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = min(nrow + 8 * h, p.n - 1);
        w[h] = sw[n];
        b[h] = has_bias ? bias[n] : 0.f;
    }
    // One token scale per consumer thread (BN <= 256).
    const float sx = (ct < BN && m0 + ct < p.m) ? ((const float*)p.sx)[m0 + ct] : 0.f;
    const u32 ssx = base + BN * 256;
    // Both consumer warpgroups are done with the ring (the other one's last wgmmas may still
    // have been reading it).
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    if (ct < BN) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(ssx + 4 * ct), "f"(sx) : "memory");
    asm volatile("bar.sync 1, 256;\n" ::: "memory");

    // Lane l addresses row l % 8 of matrix l / 8 of each stmatrix.x4: matrices (j, rows 0-7),
    // (j, rows 8-15), (j + 1, rows 0-7), (j + 1, rows 8-15) of the warp's 16 rows.
    const int q = lane >> 3, i8 = lane & 7;
    const int piece = cw * 8 + warp * 2 + (q & 1);
    const u32 row_addr = base + (u32)(8 * (q >> 1) + i8) * 256 + (u32)((piece ^ i8) << 4);
    auto y16 = [&](int a, float s, int h) {
        float y = __fmul_rn(__fmul_rn((float)a, s), w[h]);
        return has_bias ? __fadd_rn(y, b[h]) : y;
    };
#pragma unroll
    for (int j = 0; j < BN / 8; j += 2) {
        u32 r[4];
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            const int t = 8 * (j + jj) + 2 * (lane & 3);
            float s0, s1;
            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(s0), "=f"(s1) : "r"(ssx + 4 * t) : "memory");
            const int* a = &acc[4 * (j + jj)];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                r[2 * jj + h] = pack2<OUT == 1>(y16(a[2 * h], s0, h), y16(a[2 * h + 1], s1, h));
        }
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr + j * 8 * 256),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                     : "memory");
    }
    // The warpgroup's 64 rows (pieces 8 cw .. 8 cw + 7) of every token, written by its 4 warps.
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
    const int pc = cw * 8 + (t128 & 7), col = nt * 128 + pc * 8;
    // 16-byte stores need the row stride and base 16-byte aligned; else (or at the last rows)
    // one value at a time.
    const bool vec = (p.ldy & 7) == 0 && (p.y & 15) == 0 && col + 8 <= p.n;
#pragma unroll 4
    for (int t = t128 >> 3; t < BN; t += 16) {
        if (m0 + t >= p.m) break;
        u32 v[4];
        spgemm::lds128(base + (u32)t * 256 + (u32)((pc ^ (t & 7)) << 4), v);
        u16* y = (u16*)p.y + (size_t)(m0 + t) * p.ldy + col;
        if (vec) {
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(y), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                         : "memory");
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (col + e < p.n) y[e] = (u16)(v[e >> 1] >> (16 * (e & 1)));
        }
    }
}
#endif  // SPGEMM_HAS_WGMMA

// The consumer warpgroups of `run` and `run_compact`: every K' tile of this CTA's tile, then the
// epilogue from the accumulators.
template <class C, int OUT, int CL>
__device__ __forceinline__ void consumer_main(const SpGemmWsParams& p, u32 base, u32 bars, int tid, int wg) {
#if SPGEMM_HAS_WGMMA
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = wg - 1, t128 = tid & 127;
    int acc[C::ACC];
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) acc[i] = 0;
    u32 e0[C::KSTEPS], e1[C::KSTEPS], sink = 0u;
#pragma unroll
    for (int i = 0; i < C::KSTEPS; ++i) e0[i] = e1[i] = 0u;
    const int kts = p.k_tiles;
    for (int kt = 0; kt < kts; kt += 2) {
        consume<C, CL>(base, bars, kt, cw, t128, acc, e0, e1, sink);
        if (kt + 1 < kts) consume<C, CL>(base, bars, kt + 1, cw, t128, acc, e1, e0, sink);
    }
    spgemm::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) spgemm::fence_reg(acc[i]);
#pragma unroll
    for (int i = 0; i < C::KSTEPS; ++i) {
        spgemm::keep_reg(sink, e0[i]);
        spgemm::keep_reg(sink, e1[i]);
    }
    if (p.m < 0) ((u32*)p.y)[tid] = sink;  // never: makes the metadata registers' uses real

    int m0, nt;
    tile_of<C::BN, CL>(p, m0, nt);
    if constexpr (OUT != 0) {
        // A cluster's peer may still be multicasting into this CTA's ring: 16-bit outputs are
        // staged there, so they are for CTAs of their own.
        static_assert(CL == 1, "16-bit outputs without a cluster");
        store_tile_16<C, OUT>(p, base, m0, nt, cw, t128, acc);
    } else {
        // INT32 from the accumulators, as spgemm::run's [CUTE-C].
        const int warp = (tid >> 5) & 3, lane = tid & 31;
        const int nrow = nt * 128 + cw * 64 + warp * 16 + (lane >> 2);
        const int tcol = m0 + 2 * (lane & 3);
        int* y = (int*)p.y;
#pragma unroll
        for (int j = 0; j < C::BN / 8; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int n = nrow + 8 * (v >> 1), tok = tcol + 8 * j + (v & 1);
                if (n < p.n && tok < p.m) y[(size_t)tok * p.ldy + n] = acc[4 * j + v];
            }
    }
    // The last stage too: a cluster's producers wait for every stage's release before exiting.
    // (Released here, after the stores: released right after the last wgmma wait, ptxas serializes
    // the main loop's wgmma, C7515.)
    if constexpr (CL > 1) release<C, CL>(bars, kts - 1, t128);
#endif
}

template <int BN, int BK, int OUT, int CL>
__device__ __forceinline__ void run(const SpGemmWsParams& p, unsigned char* smem) {
#if SPGEMM_HAS_WGMMA
    using C = Cfg<BN, BK>;
    const int tid = threadIdx.x, wg = tid >> 7;
    const u32 base = (spgemm::smem_u32(smem) + 1023u) & ~1023u;
    const u32 bars = base + C::STAGES * C::STAGE;
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) {
            mbar_init(full_bar<C>(bars, s), 1);   // the producer's expect-tx arrival
            mbar_init(empty_bar<C>(bars, s), 8 * CL);  // one arrival per consumer warp of each CTA
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // With a cluster, the peer's barriers must be initialized before anything lands on them.
    if constexpr (CL == 1) {
        __syncthreads();
    } else {
        cluster_sync();
    }

    if (wg == 0) {
        // The producer needs few registers; give them to the consumers (every warp of the
        // warpgroup must execute setmaxnreg).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) produce<C, CL>(p, base, bars);
        return;
    }
    consumer_main<C, OUT, CL>(p, base, bars, tid, wg);
#else
    __trap();  // not built for sm_90a
#endif
}

// -------------------------------------------------------------------------------------------------
// The persistent kernels (`spgemm_ws_*_persistent`): the n256 k128 tile of `run` (CL = 1), but
// grid = min(tiles, SMs) CTAs that each walk the tiles blockIdx.x, blockIdx.x + gridDim.x, ...
// of tile_at's raster order. The ring is never drained at a tile boundary: the producer goes
// straight on to the next tile's K' tiles while the consumers finish this one (see the header).

#if SPGEMM_HAS_WGMMA
// A stage index and the parity of its current use, continued across output tiles: the K' tile
// number i of this CTA (counted over all its tiles) is in stage i % STAGES, use i / STAGES.
template <class C>
struct RingPos {
    int s = 0;
    u32 ph = 0;  // (i / STAGES) & 1
    __device__ __forceinline__ void advance() {
        if (++s == C::STAGES) {
            s = 0;
            ph ^= 1u;
        }
    }
};

// The persistent producer thread: every K' tile of every tile of this CTA, in order, into the
// ring position after the previous one (never reset per tile).
template <class C>
__device__ __forceinline__ void produce_persistent(const SpGemmWsParams& p, u32 base, u32 bars, int tiles) {
    RingPos<C> r;
    for (int tile = (int)blockIdx.x; tile < tiles; tile += (int)gridDim.x) {
        int m0, nt;
        tile_at<C::BN, 1>(p, tile, m0, nt);
        const int n0 = nt * 128;
        const char* e = (const char*)p.e + (size_t)nt * p.k_tiles * C::E_BYTES;
        for (int kt = 0; kt < p.k_tiles; ++kt, r.advance()) {
            // SAFETY (stage reuse): the empty phase of the previous use of stage r.s completes only
            // once every consumer warp that reads it has released it (all 8; pingpong: the 4 of the
            // warpgroup whose tile it holds), and a consumer warp releases a stage only
            // after wgmma.wait_group has retired the group that read it (its metadata words were
            // read into registers before that group was issued). The previous use may belong to
            // the previous output tile: its last stage is released after that tile's wait_group 0.
            mbar_wait(empty_bar<C>(bars, r.s), r.ph ^ 1u);
            const u32 st = base + r.s * C::STAGE, full = full_bar<C>(bars, r.s);
            mbar_expect_tx(full, C::STAGE);
            tma_2d(st, &p.ta, full, kt * (C::BK / 2), n0);
#pragma unroll
            for (int h = 0; h < C::BK / 128; ++h) tma_2d(st + C::A_BYTES + h * C::B_HALF, &p.tb, full, kt * C::BK + 128 * h, m0);
            bulk_copy(st + C::A_BYTES + C::B_BYTES, e + (size_t)kt * C::E_BYTES, C::E_BYTES, full);
        }
    }
}

// One K' tile of a persistent consumer warpgroup: consume's body at ring position `r` (the caller
// advances it), releasing the stage `prev` of this output tile's previous K' tile (-1: none).
template <class C>
__device__ __forceinline__ void consume_at(u32 base, u32 bars, const RingPos<C>& r, int prev, int cw, int t128,
                                           int (&acc)[C::ACC], u32 (&e)[C::KSTEPS], u32 (&e_prev)[C::KSTEPS], u32& sink) {
    mbar_wait(full_bar<C>(bars, r.s), r.ph);
    const u32 st = base + r.s * C::STAGE;
    const u32 sa = st + cw * 64 * (C::BK / 2), sb = st + C::A_BYTES;
    const u32 se = st + C::A_BYTES + C::B_BYTES + (cw * 128 + t128) * C::KSTEPS * 4;
    if constexpr (C::KSTEPS == 2) {
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(e[0]), "=r"(e[1]) : "r"(se) : "memory");
    } else {
        u32 v[4];
        spgemm::lds128(se, v);
#pragma unroll
        for (int i = 0; i < C::KSTEPS; ++i) e[i] = v[i];
    }
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) spgemm::fence_reg(acc[i]);
    spgemm::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < C::KSTEPS; ++ks)
        wgmma_sp(acc, desc_a<C::BK>(sa + ks * 32), spgemm::desc_sw128(sb + (ks >> 1) * C::B_HALF + (ks & 1) * 64), e[ks]);
    spgemm::wgmma_commit();
    spgemm::wgmma_wait<1>();  // the previous K' tile's group is done: its stage and metadata registers are free
#pragma unroll
    for (int i = 0; i < C::KSTEPS; ++i) spgemm::keep_reg(sink, e_prev[i]);
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) spgemm::fence_reg(acc[i]);
    if (prev >= 0) release<C, 1>(bars, prev, t128);
}

// The epilogue of one output tile straight from the accumulators, as run's [CUTE-C].
template <int BN, int OUT>
__device__ __forceinline__ void store_tile(const SpGemmWsParams& p, int m0, int nt, int cw, int tid, const int (&acc)[BN / 2]) {
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    const int nrow = nt * 128 + cw * 64 + warp * 16 + (lane >> 2);
    const int tcol = m0 + 2 * (lane & 3);
    SpGemmParams q{};
    q.sx = p.sx;
    q.sw = p.sw;
    q.bias = p.bias;
    q.y = p.y;
    q.ldy = p.ldy;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int n = nrow + 8 * (v >> 1), tok = tcol + 8 * j + (v & 1);
            if (n < p.n && tok < p.m) spgemm::store_out<OUT>(q, tok, n, acc[4 * j + v]);
        }
}
#endif  // SPGEMM_HAS_WGMMA

template <int BN, int BK, int OUT>
__device__ __forceinline__ void run_persistent(const SpGemmWsParams& p, unsigned char* smem) {
#if SPGEMM_HAS_WGMMA
    using C = Cfg<BN, BK>;
    const int tid = threadIdx.x, wg = tid >> 7;
    const u32 base = (spgemm::smem_u32(smem) + 1023u) & ~1023u;
    const u32 bars = base + C::STAGES * C::STAGE;
    const int tiles = (p.m + BN - 1) / BN * p.n_tiles;
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) {
            mbar_init(full_bar<C>(bars, s), 1);
            mbar_init(empty_bar<C>(bars, s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) produce_persistent<C>(p, base, bars, tiles);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = wg - 1, t128 = tid & 127;
    int acc[C::ACC];
    u32 e0[C::KSTEPS], e1[C::KSTEPS], sink = 0u;
#pragma unroll
    for (int i = 0; i < C::KSTEPS; ++i) e0[i] = e1[i] = 0u;
    const int kts = p.k_tiles;
    RingPos<C> r;  // the same sequence of positions as the producer's
    for (int tile = (int)blockIdx.x; tile < tiles; tile += (int)gridDim.x) {
        // The previous tile's accumulators were stored and all its groups retired (wait_group 0).
#pragma unroll
        for (int i = 0; i < C::ACC; ++i) acc[i] = 0;
        int prev = -1;
        for (int kt = 0; kt < kts; kt += 2) {
            consume_at<C>(base, bars, r, prev, cw, t128, acc, e0, e1, sink);
            prev = r.s;
            r.advance();
            if (kt + 1 < kts) {
                consume_at<C>(base, bars, r, prev, cw, t128, acc, e1, e0, sink);
                prev = r.s;
                r.advance();
            }
        }
        spgemm::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < C::ACC; ++i) spgemm::fence_reg(acc[i]);
#pragma unroll
        for (int i = 0; i < C::KSTEPS; ++i) {
            spgemm::keep_reg(sink, e0[i]);
            spgemm::keep_reg(sink, e1[i]);
        }
        // SAFETY (epilogue overlap): the last K' tile's stage is released before the stores, so
        // the producer may already be writing the next tile's first K' tiles into every stage of
        // the ring while this epilogue runs. That is safe because the epilogue reads nothing from
        // shared memory: only the accumulators (registers, complete after wait_group 0) and the
        // global scales; and the next tile's wgmmas cannot overwrite `acc` before the stores
        // read them (program order within each thread; the zeroing above comes after them).
        release<C, 1>(bars, prev, t128);
        int m0, nt;
        tile_at<BN, 1>(p, tile, m0, nt);
        store_tile<BN, OUT>(p, m0, nt, cw, tid, acc);
    }
    if (p.m < 0) ((u32*)p.y)[tid] = sink;  // never: makes the metadata registers' uses real
#else
    __trap();  // not built for sm_90a
#endif
}

// -------------------------------------------------------------------------------------------------
// The pingpong kernel (`spgemm_ws_n128_k128_i32_pingpong`): persistent as above, but the two
// consumer warpgroups take turns: warpgroup c computes the CTA's tiles number c, c + 2, c + 4, ...
// of its walk, each a whole 128 weight rows x 128 tokens tile (both 64-row halves: 2 x 64
// accumulators per thread), so one warpgroup's wgmmas run while the other stores its tile.

#if SPGEMM_HAS_WGMMA
template <class C>
__device__ __forceinline__ u32 order_bar(u32 bars, int c) { return bars + 8 * (2 * C::STAGES + c); }

// One K' tile of a pingpong consumer warpgroup: both halves' wgmmas on the stage at `r`, the
// metadata words of both halves in e[2][KSTEPS] (two sets alternating, as in consume).
template <class C>
__device__ __forceinline__ void consume_pp(u32 base, u32 bars, const RingPos<C>& r, int prev, int t128, int (&acc0)[C::ACC],
                                           int (&acc1)[C::ACC], u32 (&e)[2][C::KSTEPS], u32 (&e_prev)[2][C::KSTEPS], u32& sink) {
    static_assert(C::KSTEPS == 2 && C::BN == 128, "pingpong: n128 k128 only");
    mbar_wait(full_bar<C>(bars, r.s), r.ph);
    const u32 st = base + r.s * C::STAGE, sb = st + C::A_BYTES;
    const u32 se = st + C::A_BYTES + C::B_BYTES + t128 * C::KSTEPS * 4;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(e[0][0]), "=r"(e[0][1]) : "r"(se) : "memory");
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(e[1][0]), "=r"(e[1][1]) : "r"(se + 128 * C::KSTEPS * 4) : "memory");
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) {
        spgemm::fence_reg(acc0[i]);
        spgemm::fence_reg(acc1[i]);
    }
    spgemm::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < C::KSTEPS; ++ks) {
        const u64 db = spgemm::desc_sw128(sb + ks * 64);
        wgmma_sp(acc0, desc_a<C::BK>(st + ks * 32), db, e[0][ks]);
        wgmma_sp(acc1, desc_a<C::BK>(st + 64 * (C::BK / 2) + ks * 32), db, e[1][ks]);
    }
    spgemm::wgmma_commit();
    spgemm::wgmma_wait<1>();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < C::KSTEPS; ++i) spgemm::keep_reg(sink, e_prev[h][i]);
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) {
        spgemm::fence_reg(acc0[i]);
        spgemm::fence_reg(acc1[i]);
    }
    if (prev >= 0) release<C, 1>(bars, prev, t128);
}
#endif  // SPGEMM_HAS_WGMMA

template <int OUT>
__device__ __forceinline__ void run_pingpong(const SpGemmWsParams& p, unsigned char* smem) {
#if SPGEMM_HAS_WGMMA
    using C = Cfg<128, 128>;
    const int tid = threadIdx.x, wg = tid >> 7;
    const u32 base = (spgemm::smem_u32(smem) + 1023u) & ~1023u;
    const u32 bars = base + C::STAGES * C::STAGE;
    static_assert(8 * (2 * C::STAGES + 2) <= 256, "barriers fit the 256 bytes after the ring");
    const int tiles = (p.m + C::BN - 1) / C::BN * p.n_tiles;
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) {
            mbar_init(full_bar<C>(bars, s), 1);
            mbar_init(empty_bar<C>(bars, s), 4);  // each stage is read by ONE warpgroup: its 4 warps
        }
        mbar_init(order_bar<C>(bars, 0), 4);  // warpgroup c's 4 warps: "my mainloop of a tile is issued"
        mbar_init(order_bar<C>(bars, 1), 4);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        // The ring holds the CTA's tiles one after the other, whichever warpgroup computes them.
        if (tid == 0) produce_persistent<C>(p, base, bars, tiles);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int c = wg - 1, t128 = tid & 127, kts = p.k_tiles;
    int acc0[C::ACC], acc1[C::ACC];
    u32 e0[2][C::KSTEPS], e1[2][C::KSTEPS], sink = 0u;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < C::KSTEPS; ++i) e0[h][i] = e1[h][i] = 0u;
    // j: this tile's number in the CTA's walk (tile = blockIdx.x + j gridDim.x); warpgroup c takes
    // j = c, c + 2, ...
    for (int j = c, tile = (int)blockIdx.x + c * (int)gridDim.x; tile < tiles; j += 2, tile += 2 * (int)gridDim.x) {
        // SAFETY (turns): before its mainloop of tile j the warpgroup waits until the other one has
        // issued (so passed every full-barrier wait of) its mainloop of tile j - 1; that other one
        // did the same for j - 2, so every ring position before this tile's first, j * kts, has
        // completed its full phase. Hence when this warpgroup waits on position i (stage
        // i % STAGES, parity (i / STAGES) & 1), the same stage's previous use i - STAGES has
        // completed: it never waits two phases ahead (where the parity test would pass on the
        // wrong phase). Without the turn, warpgroup 1 would wait on position kts at once, while
        // the stage's phase kts / STAGES - 2 (of the same parity) is still pending.
        // The order barrier itself: phase q of order_bar(1 - c) is the other warpgroup's tile
        // number 2 q + 1 - c; this warpgroup observed its phase q - 1 before its previous tile, so
        // it never waits two phases ahead either.
        if (j > 0) mbar_wait(order_bar<C>(bars, 1 - c), (u32)(((j - 1) >> 1) & 1));
#pragma unroll
        for (int i = 0; i < C::ACC; ++i) acc0[i] = acc1[i] = 0;
        RingPos<C> r;
        {
            const int first = j * kts;  // ring position of this tile's first K' tile
            r.s = first % C::STAGES;
            r.ph = (u32)((first / C::STAGES) & 1);
        }
        int prev = -1;
        for (int kt = 0; kt < kts; kt += 2) {
            consume_pp<C>(base, bars, r, prev, t128, acc0, acc1, e0, e1, sink);
            prev = r.s;
            r.advance();
            if (kt + 1 < kts) {
                consume_pp<C>(base, bars, r, prev, t128, acc0, acc1, e1, e0, sink);
                prev = r.s;
                r.advance();
            }
        }
        // The other warpgroup's turn: every wgmma of this tile is issued (this warp's full waits
        // are behind it). One arrival per warp.
        if ((t128 & 31) == 0) mbar_arrive(order_bar<C>(bars, c));
        spgemm::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < C::ACC; ++i) {
            spgemm::fence_reg(acc0[i]);
            spgemm::fence_reg(acc1[i]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < C::KSTEPS; ++i) {
                spgemm::keep_reg(sink, e0[h][i]);
                spgemm::keep_reg(sink, e1[h][i]);
            }
        // SAFETY: as run_persistent's epilogue (it reads no shared memory, so the stage released
        // here may be refilled at once, here with the other warpgroup's next K' tiles).
        release<C, 1>(bars, prev, t128);
        int m0, nt;
        tile_at<C::BN, 1>(p, tile, m0, nt);
        store_tile<C::BN, OUT>(p, m0, nt, 0, tid, acc0);
        store_tile<C::BN, OUT>(p, m0, nt, 1, tid, acc1);
    }
    if (p.m < 0) ((u32*)p.y)[tid] = sink;  // never: makes the metadata registers' uses real
#else
    __trap();  // not built for sm_90a
#endif
}

// -------------------------------------------------------------------------------------------------
// The compact kernels (`spgemm_ws_n256_k128_{i32,bf16}_compact`, `spgemm_ws_n256_k128_i32_compact_ring`;
// bench-spgemm only: the library runs the metadata kernel below and `run`'s kernel instead):
// `run`'s n256 k128 tile (CL = 1)
// on the compact (2N-2):2N layout (compact.rs), the one copy of the weight, with no metadata array:
//   - A values: the compact `kept` array, u8 [n][kept row bytes] (rows 16-byte aligned). A block's
//     2N - 2 kept codes in K order ARE its N - 1 windows' 2:4 values two by two (kept code i of a
//     block sits at block position >= i and <= i + 2, so codes 2j, 2j + 1 fit window j, positions
//     2j .. 2j + 3), so row n of `kept` is row n of the compressed W' and `ta` maps it as before.
//   - Metadata: built per stage from the ranks. The producer thread also loads, per k-tile, for
//     the tile's 128 rows, 32 bytes of packed ranks (rank_bits each, compact.rs `packed_ranks`)
//     from the byte of the rank of b0 = the block of the k-tile's first window, rounded down to
//     16 (a TMA box starting off a 16-byte boundary faults with an illegal instruction); 32 bytes
//     hold up to 15 bytes of offset and the ranks of the k-tile's 32 windows for every pattern
//     2:4 .. 14:16 (at most 33 ranks of 3 bits, 2:4). `_compact`: a stage's ranks are loaded
//     with it, once the stage is free (a `rank_full` barrier per stage). `_compact_ring`: the
//     ranks have a ring of their own (8 slots, `rank_full` / `rank_empty` barriers), loaded 7
//     k-tiles ahead, so they are there when a stage frees. Warps 1-3 of the producer warpgroup (96 threads,
//     otherwise idle) wait for the stage's release and its ranks, turn each row's ranks into its
//     32 windows' nibbles through `table` (in shared memory: a rank's N - 1 window nibbles, the
//     host's table of compact.rs `window_metadata`) while the stage's A and X' load, store them
//     as the consumers' metadata words (the map of `e` above), release the ring slot and arrive
//     on the stage's `full` barrier (1 + 96 arrivals: the TMA thread's expect-tx and each
//     worker's). The consumers are `run`'s, unchanged.
//   Rows past n and windows past K' read ranks 0 (TMA zero fill): pair (0, 1), valid nibbles,
//   whose values are zero (A zero filled) or meet zero activations (X' zero filled).
//   Stage: A 8 KB, X' 32 KB, metadata words 2 KB, and the ranks' 4 KB without the ring; 4 stages
//   (the ring: 8 x 4 KB).

// Timing probes of the bench alone (wrong results): 1 skips the expansion, 2 the rank loads too.
#ifndef SPGEMM_COMPACT_PROBE
#define SPGEMM_COMPACT_PROBE 0
#endif

template <int BN_, bool RING_>
struct CfgCompact {
    static constexpr int BN = BN_, BK = 128;
    static constexpr bool RING = RING_;
    static constexpr int A_BYTES = 128 * BK / 2;
    static constexpr int B_HALF = BN * 128;
    static constexpr int B_BYTES = B_HALF;
    static constexpr int KSTEPS = BK / 64;
    static constexpr int E_BYTES = 2 * 128 * KSTEPS * 4;
    static constexpr int R_ROW = 32;  // rank bytes per row per k-tile (one TMA box row)
    static constexpr int R_BYTES = 128 * R_ROW;
    // Without the ring a stage holds its k-tile's ranks at R_OFF; with it they have RING_SLOTS
    // slots of their own after the stages, loaded RING_SLOTS - 1 k-tiles ahead.
    static constexpr int R_OFF = A_BYTES + B_BYTES + E_BYTES;
    static constexpr int RING_SLOTS = 8;
    static constexpr int STAGE = A_BYTES + B_BYTES + E_BYTES + (RING ? 0 : R_BYTES);
    static constexpr int RING_BYTES = RING ? RING_SLOTS * R_BYTES : 0;
    static constexpr int TABLE_BYTES = 4 * SPGEMM_RANK_TABLE;
    static constexpr int FIT = (SPGEMM_WS_SMEM_LIMIT - 1024 - 256 - TABLE_BYTES - RING_BYTES) / STAGE;
    static constexpr int STAGES = FIT < 8 ? FIT : 8;
    static constexpr int RSLOTS = RING ? RING_SLOTS : STAGES;  // rank slots (a barrier pair each)
    static constexpr int SMEM = STAGES * STAGE + RING_BYTES + 1024 + 256 + TABLE_BYTES;
    static constexpr int ACC = BN / 2;
    static constexpr int WORKERS = 96;  // warps 1-3 of the producer warpgroup
    static_assert(STAGE % 1024 == 0 && A_BYTES % 1024 == 0 && B_HALF % 1024 == 0, "1024-byte alignment of the swizzled parts");
    static_assert(R_OFF % 128 == 0 && R_BYTES % 128 == 0, "TMA destinations are 128-byte aligned");
    static_assert(STAGES >= 3 && 8 * (2 * STAGES + 2 * RSLOTS) <= 256, "stages, rank slots and their barriers");
};

#if SPGEMM_HAS_WGMMA
// Rank slot r's barriers: `rank_full` (the TMA's expect-tx arrival and its bytes), `rank_empty`
// (the ring only: every worker's arrival once it expanded the slot).
template <class C>
__device__ __forceinline__ u32 rank_full_bar(u32 bars, int r) { return bars + 8 * (2 * C::STAGES + r); }
template <class C>
__device__ __forceinline__ u32 rank_empty_bar(u32 bars, int r) { return bars + 8 * (2 * C::STAGES + C::RSLOTS + r); }
// Where k-tile kt's ranks land: its slot of the ring, or its stage.
template <class C>
__device__ __forceinline__ u32 rank_slot(u32 base, u32 ring, int kt) {
    if constexpr (C::RING) return ring + (u32)((kt % C::RSLOTS) * C::R_BYTES);
    return base + (u32)((kt % C::STAGES) * C::STAGE + C::R_OFF);
}

__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void sts32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory"); }

// The block of stage kt's first window (window 32 kt of the row).
__device__ __forceinline__ int first_block(const SpGemmWsParams& p, int kt) { return kt * 32 / p.win; }
// The byte of a packed rank row where stage kt's rank box starts: the byte of its first block's
// rank rounded down to 16 (a TMA box starting off a 16-byte boundary faults).
__device__ __forceinline__ int rank_byte(const SpGemmWsParams& p, int kt) { return first_block(p, kt) * p.rbits / 8 & ~15; }

// Loads k-tile kt's rank bytes into its slot (with the ring: once the workers released the
// slot's previous k-tile; without it the stage's release covers them).
template <class C>
__device__ __forceinline__ void load_ranks(const SpGemmWsParams& p, u32 base, u32 ring, u32 bars, int kt, int n0) {
    const int r = kt % C::RSLOTS;
    if constexpr (C::RING) mbar_wait(rank_empty_bar<C>(bars, r), ((kt / C::RSLOTS) & 1) ^ 1);
    const u32 full = rank_full_bar<C>(bars, r);
#if SPGEMM_COMPACT_PROBE == 2
    mbar_arrive(full);
#else
    mbar_expect_tx(full, C::R_BYTES);
    tma_2d(rank_slot<C>(base, ring, kt), &p.tr, full, rank_byte(p, kt), n0);
#endif
}

// The compact producer thread: A (kept codes) and the X' tile of each stage, and each k-tile's
// ranks: with the stage (first: the workers' expansion is on the path to `full`), or with the
// ring RING_SLOTS - 1 k-tiles ahead, so that a stage's ranks are there when the stage frees and
// the expansion overlaps the stage's own loads.
template <class C>
__device__ __forceinline__ void produce_compact(const SpGemmWsParams& p, u32 base, u32 ring, u32 bars) {
    int m0, nt;
    tile_of<C::BN, 1>(p, m0, nt);
    const int n0 = nt * 128;
    constexpr int AHEAD = C::RING ? C::RSLOTS - 1 : 0;
    for (int kt = 0; kt < AHEAD && kt < p.k_tiles; ++kt) load_ranks<C>(p, base, ring, bars, kt, n0);
    for (int kt = 0; kt < p.k_tiles; ++kt) {
        const int s = kt % C::STAGES;
        mbar_wait(empty_bar<C>(bars, s), ((kt / C::STAGES) & 1) ^ 1);
        if constexpr (!C::RING) load_ranks<C>(p, base, ring, bars, kt, n0);
        const u32 st = base + s * C::STAGE, full = full_bar<C>(bars, s);
        mbar_expect_tx(full, C::A_BYTES + C::B_BYTES);
        tma_2d(st, &p.ta, full, kt * (C::BK / 2), n0);
        tma_2d(st + C::A_BYTES, &p.tb, full, kt * C::BK, m0);
        // Ring slot (kt + AHEAD) % RSLOTS held k-tile kt - 1, expanded before stage kt - 1 filled.
        if constexpr (C::RING)
            if (kt + AHEAD < p.k_tiles) load_ranks<C>(p, base, ring, bars, kt + AHEAD, n0);
    }
}

// The byte offset of row r's (0..127) metadata word k (0..3: windows [8 k, 8 k + 8) of a k-tile)
// in the map of `e` for BK = 128 (KSTEPS = 2): k-step k >> 1 of lane 4 (r & 7) + (r & 15) / 8 +
// 2 (k & 1) of warp (r & 63) / 16 of consumer r / 64.
__device__ __forceinline__ u32 word_offset(int r, int k) {
    constexpr int KSTEPS = 2;
    const int cw = r >> 6, w = (r >> 4) & 3, rr = r & 15;
    return (u32)(((cw * 128 + 32 * w + 4 * (rr & 7) + (rr >> 3)) * KSTEPS + 2 * (k & 1) * KSTEPS + (k >> 1)) * 4);
}
template <class C>
__device__ __forceinline__ u32 word_addr(u32 words, int r, int k) {
    static_assert(C::KSTEPS == 2, "word_offset is the map of BK = 128");
    return words + word_offset(r, k);
}

// One row's metadata words for a k-tile (K' 128, 32 windows), for the pattern whose blocks hold
// WIN windows (WIN + 1 = N of (2N-2):2N) and whose ranks are RBITS wide: its 32 windows'
// nibbles from the row's 32 rank bytes `raw` (the k-tile's first rank at bit `bit0`, that
// block's window `j0` the k-tile's first), through `table` (shared memory, a rank's WIN nibbles
// per entry). Word k holds windows [8 k, 8 k + 8). A worker warp of the compact kernels is the
// only warp of its SM sub-partition outside the consumers, so its instructions issue one by
// one: everything is unrolled on the pattern's constants, the ranks come out of registers at
// fixed bit offsets, the table lookups are independent (they go out together), and each block's
// WIN nibbles land at a fixed place of a nibble stream that one shift by j0 windows aligns.
template <int WIN, int RBITS>
__device__ __forceinline__ void row_words(const u32 (&raw)[8], u32 table, int j0, int bit0, u32 (&out)[4]) {
    constexpr int WINDOWS = 32;                                  // a k-tile's: BK = 128 K' / 4
    constexpr int NB = (WIN - 1 + WINDOWS + WIN - 1) / WIN;      // blocks reaching into the k-tile, at most
    constexpr int NW = (NB * 4 * WIN + 31) / 32 + 1;             // words of the nibble stream (one spare)
    constexpr u32 MASK = (1u << RBITS) - 1u;
    static_assert(NB * RBITS <= 256 - 127, "the k-tile's ranks within the 32 bytes past bit0 (< 128)");
    u32 bits[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) bits[i] = raw[i];
    for (int w = bit0 >> 5; w > 0; --w) {  // whole words first (bit0 < 128: at most three)
#pragma unroll
        for (int i = 0; i < 7; ++i) bits[i] = bits[i + 1];
        bits[7] = 0;
    }
#pragma unroll
    for (int i = 0; i < 7; ++i) bits[i] = __funnelshift_r(bits[i], bits[i + 1], (u32)(bit0 & 31));
    bits[7] >>= (u32)(bit0 & 31);
    u32 stream[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) stream[i] = 0;
    // Eight lookups go out before their results are used (the loads are in order, their waits
    // are not): a chunk costs one round trip to shared memory.
#pragma unroll
    for (int c = 0; c < NB; c += 8) {
        u32 nib[8];
#pragma unroll
        for (int i = c; i < c + 8 && i < NB; ++i) {  // past the k-tile's blocks: ranks < 128, entries of the table
            const int b = i * RBITS, q = b >> 5, o = b & 31;
            const u32 rank = (o + RBITS <= 32 || q == 7 ? bits[q] >> o : __funnelshift_r(bits[q], bits[q + 1 < 8 ? q + 1 : 7], o)) & MASK;
            nib[i - c] = lds32(table + 4 * rank);
        }
#pragma unroll
        for (int i = c; i < c + 8 && i < NB; ++i) {
            const int n = i * 4 * WIN, nq = n >> 5, no = n & 31;
            stream[nq] |= nib[i - c] << no;
            if (no + 4 * WIN > 32) stream[nq + 1] |= nib[i - c] >> (32 - no);
        }
    }
    const u32 sh = 4u * (u32)j0;  // < 28
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = __funnelshift_r(stream[k], stream[k + 1], sh);
}

// row_words for the pattern of `win` windows per block (warp-uniform; the host sets
// rbits = compact.rs rank_bits(pattern)): one of seven unrolled instances.
__device__ __forceinline__ void row_words_of(int win, const u32 (&raw)[8], u32 table, int j0, int bit0, u32 (&out)[4]) {
    switch (win) {
        case 1: row_words<1, 3>(raw, table, j0, bit0, out); break;
        case 2: row_words<2, 4>(raw, table, j0, bit0, out); break;
        case 3: row_words<3, 5>(raw, table, j0, bit0, out); break;
        case 4: row_words<4, 6>(raw, table, j0, bit0, out); break;
        case 5: row_words<5, 7>(raw, table, j0, bit0, out); break;
        case 6: row_words<6, 7>(raw, table, j0, bit0, out); break;
        default: row_words<7, 7>(raw, table, j0, bit0, out); break;
    }
}

// A metadata worker (0..95): rows worker and worker + 96 of every stage of this CTA, in order.
template <class C>
__device__ __forceinline__ void expand_metadata(const SpGemmWsParams& p, u32 base, u32 ring, u32 bars, u32 table, int worker) {
    for (int kt = 0; kt < p.k_tiles; ++kt) {
        const int s = kt % C::STAGES;
        const int b0 = first_block(p, kt), j0 = kt * (C::BK / 4) - b0 * p.win;
        const int bit0 = b0 * p.rbits - 8 * rank_byte(p, kt);
        // SAFETY (stage reuse): the stage's metadata words are free to overwrite once the
        // consumers released its previous use. Without the ring the ranks are loaded after that
        // release, so their arrival says it; with it the workers wait on the release themselves
        // (the producer waits on the same phase). The workers arrive on `full` once per use, so
        // that phase cannot pass before they do.
        if constexpr (C::RING) mbar_wait(empty_bar<C>(bars, s), ((kt / C::STAGES) & 1) ^ 1);
        mbar_wait(rank_full_bar<C>(bars, kt % C::RSLOTS), (kt / C::RSLOTS) & 1);
        const u32 words = base + s * C::STAGE + C::A_BYTES + C::B_BYTES, slot = rank_slot<C>(base, ring, kt);
#if SPGEMM_COMPACT_PROBE == 0
        for (int row = worker; row < 128; row += C::WORKERS) {
            const u32 ranks = slot + row * C::R_ROW;
            u32 raw[8], lo[4], hi[4], out[4];
            spgemm::lds128(ranks, lo);
            spgemm::lds128(ranks + 16, hi);
#pragma unroll
            for (int i = 0; i < 4; ++i) raw[i] = lo[i], raw[i + 4] = hi[i];
            row_words_of(p.win, raw, table, j0, bit0, out);
#pragma unroll
            for (int k = 0; k < 4; ++k) sts32(word_addr<C>(words, row, k), out[k]);
        }
#endif
        // The ring slot was read (its loads' values were used) ...
        if constexpr (C::RING) mbar_arrive(rank_empty_bar<C>(bars, kt % C::RSLOTS));
        // ... and this thread's words are visible to the consumers that acquire `full`.
        mbar_arrive(full_bar<C>(bars, s));
    }
}
#endif  // SPGEMM_HAS_WGMMA

template <int BN, int OUT, bool RING>
__device__ __forceinline__ void run_compact(const SpGemmWsParams& p, unsigned char* smem) {
#if SPGEMM_HAS_WGMMA
    using C = CfgCompact<BN, RING>;
    const int tid = threadIdx.x, wg = tid >> 7;
    const u32 base = (spgemm::smem_u32(smem) + 1023u) & ~1023u;
    const u32 ring = base + C::STAGES * C::STAGE, bars = ring + C::RING_BYTES, table = bars + 256;
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) {
            mbar_init(full_bar<C>(bars, s), 1 + C::WORKERS);  // the expect-tx arrival and every worker's
            mbar_init(empty_bar<C>(bars, s), 8);
        }
        for (int r = 0; r < C::RSLOTS; ++r) {
            mbar_init(rank_full_bar<C>(bars, r), 1);
            if (C::RING) mbar_init(rank_empty_bar<C>(bars, r), C::WORKERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    for (int i = tid; i < SPGEMM_RANK_TABLE; i += SPGEMM_WS_THREADS) sts32(table + 4 * i, p.table[i]);
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            produce_compact<C>(p, base, ring, bars);
        } else if (tid >= 32) {
            expand_metadata<C>(p, base, ring, bars, table, tid - 32);
        }
        return;
    }
    consumer_main<C, OUT, 1>(p, base, bars, tid, wg);
#else
    __trap();  // not built for sm_90a
#endif
}

// The metadata kernel (`spgemm_compact_metadata`): the whole weight's metadata array `e` of the
// ws kernels (BK = 128: u32 [n_tiles][k_tiles][128 rows x 4 words], word_offset's map) from
// the compact rows' ranks, so that `spgemm_ws_n256_k128_i32` reads the one copy (A = the kept
// codes) with `e` a scratch array that one launch before it fills. A CTA of 128 threads
// expands one k-tile of one 128-row tile, a thread one row (row_words, as the compact kernels'
// workers); rows past n and rank bytes past a row's end read as rank 0, as the compact kernels'
// zero-filled boxes do. Once per weight tile instead of once per output tile: at M = 4096 a
// weight tile serves 16 token tiles.
__device__ __forceinline__ void compact_metadata(const SpMetaParams& p) {
#if SPGEMM_HAS_WGMMA
    __shared__ u32 table_s[SPGEMM_RANK_TABLE];
    for (int i = threadIdx.x; i < SPGEMM_RANK_TABLE; i += blockDim.x) table_s[i] = p.table[i];
    __syncthreads();
    const int kt = blockIdx.x, nt = blockIdx.y, r = threadIdx.x, row = nt * 128 + r;
    const int b0 = kt * 32 / p.win, j0 = kt * 32 - b0 * p.win;
    const int byte0 = b0 * p.rbits / 8 & ~15, bit0 = b0 * p.rbits - 8 * byte0;
    u32 raw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (row < p.n) {
        // Rows are 16-byte aligned and byte0 a multiple of 16: each half is in the row or past it.
        const uint4* src = (const uint4*)((const unsigned char*)p.ranks + (size_t)row * p.rank_stride + byte0);
        if (byte0 + 16 <= p.rank_stride) {
            const uint4 v = src[0];
            raw[0] = v.x, raw[1] = v.y, raw[2] = v.z, raw[3] = v.w;
        }
        if (byte0 + 32 <= p.rank_stride) {
            const uint4 v = src[1];
            raw[4] = v.x, raw[5] = v.y, raw[6] = v.z, raw[7] = v.w;
        }
    }
    u32 out[4];
    row_words_of(p.win, raw, spgemm::smem_u32(table_s), j0, bit0, out);
    unsigned char* e = (unsigned char*)p.e + ((size_t)nt * p.k_tiles + kt) * Cfg<256, 128>::E_BYTES;
#pragma unroll
    for (int k = 0; k < 4; ++k) *(u32*)(e + word_offset(r, k)) = out[k];
#else
    __trap();  // not built for sm_90a
#endif
}

}  // namespace spgemm_ws

// grid ceil(m / BN) * n_tiles (1-D; with CL = 2, n_tiles rounded up to even), SPGEMM_WS_THREADS
// threads, spgemm_ws::Cfg<BN, BK>::SMEM bytes of dynamic shared memory; CL > 1: launched with a
// cluster dimension of (CL, 1, 1) (a launch attribute: NVRTC's other targets know no cluster
// attribute on the kernel), and the X' tensor map's box is {128, BN / CL}.
#define SPGEMM_WS_KERNEL(NAME, BN, BK, OUT, CL)                                                              \
    extern "C" __global__ void __launch_bounds__(SPGEMM_WS_THREADS, 1) NAME(const __grid_constant__ SpGemmWsParams p) { \
        extern __shared__ __align__(1024) unsigned char spgemm_smem[];                                       \
        spgemm_ws::run<BN, BK, OUT, CL>(p, spgemm_smem);                                                     \
    }

SPGEMM_WS_KERNEL(spgemm_ws_n128_k128_i32, 128, 128, 0, 1)
SPGEMM_WS_KERNEL(spgemm_ws_n128_k256_i32, 128, 256, 0, 1)
SPGEMM_WS_KERNEL(spgemm_ws_n256_k128_i32, 256, 128, 0, 1)
SPGEMM_WS_KERNEL(spgemm_ws_n256_k128_bf16, 256, 128, 1, 1)
SPGEMM_WS_KERNEL(spgemm_ws_n256_k128_f16, 256, 128, 2, 1)
SPGEMM_WS_KERNEL(spgemm_ws_n256_k128_i32_mc2, 256, 128, 0, 2)

// grid min(ceil(m / BN) * n_tiles, SMs) (1-D, no cluster), SPGEMM_WS_THREADS threads,
// spgemm_ws::Cfg<BN, BK>::SMEM bytes of dynamic shared memory; same parameters as above.
#define SPGEMM_WS_PERSISTENT_KERNEL(NAME, BN, BK, OUT)                                                       \
    extern "C" __global__ void __launch_bounds__(SPGEMM_WS_THREADS, 1) NAME(const __grid_constant__ SpGemmWsParams p) { \
        extern __shared__ __align__(1024) unsigned char spgemm_smem[];                                       \
        spgemm_ws::run_persistent<BN, BK, OUT>(p, spgemm_smem);                                              \
    }

SPGEMM_WS_PERSISTENT_KERNEL(spgemm_ws_n256_k128_i32_persistent, 256, 128, 0)
SPGEMM_WS_PERSISTENT_KERNEL(spgemm_ws_n256_k128_bf16_persistent, 256, 128, 1)

// grid min(ceil(m / 128) * n_tiles, SMs) (1-D, no cluster), SPGEMM_WS_THREADS threads,
// spgemm_ws::Cfg<128, 128>::SMEM bytes of dynamic shared memory; the X' map's box {128, 128}.
extern "C" __global__ void __launch_bounds__(SPGEMM_WS_THREADS, 1)
    spgemm_ws_n128_k128_i32_pingpong(const __grid_constant__ SpGemmWsParams p) {
    extern __shared__ __align__(1024) unsigned char spgemm_smem[];
    spgemm_ws::run_pingpong<0>(p, spgemm_smem);
}

// grid ceil(m / BN) * n_tiles (1-D, no cluster), SPGEMM_WS_THREADS threads,
// spgemm_ws::CfgCompact<BN, RING>::SMEM bytes of dynamic shared memory; `ta` over the compact kept codes
// (box {64, 128}, SWIZZLE_64B), `tr` over the packed ranks (box {32, 128}, no swizzle), `win`,
// `rbits` and `table` set; `e` unused.
#define SPGEMM_WS_COMPACT_KERNEL(NAME, BN, OUT, RING)                                                        \
    extern "C" __global__ void __launch_bounds__(SPGEMM_WS_THREADS, 1) NAME(const __grid_constant__ SpGemmWsParams p) { \
        extern __shared__ __align__(1024) unsigned char spgemm_smem[];                                       \
        spgemm_ws::run_compact<BN, OUT, RING>(p, spgemm_smem);                                               \
    }

SPGEMM_WS_COMPACT_KERNEL(spgemm_ws_n256_k128_i32_compact, 256, 0, false)
SPGEMM_WS_COMPACT_KERNEL(spgemm_ws_n256_k128_bf16_compact, 256, 1, false)
// The ranks in a ring of their own (bench-spgemm only, spgemm_ws::CfgCompact<256, true>::SMEM).
SPGEMM_WS_COMPACT_KERNEL(spgemm_ws_n256_k128_i32_compact_ring, 256, 0, true)
// The dynamic shared memory of the kernels the library launches (spgemm_ws_n256_k128_{i32,bf16,f16}), for
// the host (cuModuleGetGlobal). The braced linkage block keeps this a definition under nvcc too
// (`extern "C" __constant__ int x = ..;` is an undefined reference in nvcc's host registration
// code).
extern "C" {
__constant__ int spgemm_ws_n256_k128_smem = spgemm_ws::Cfg<256, 128>::SMEM;
}

// grid (k_tiles, n_tiles), 128 threads, no dynamic shared memory: fills `e` for
// spgemm_ws_n256_k128_{i32,bf16,f16} over the compact kept codes (the library's compact path for
// forwards past one token tile, cuda/compact_gemm.rs).
extern "C" __global__ void __launch_bounds__(128) spgemm_compact_metadata(const __grid_constant__ SpMetaParams p) {
    spgemm_ws::compact_metadata(p);
}

// -------------------------------------------------------------------------------------------------
// Status
//
// Exact on the H200 (scripts/bench-spgemm.cu, `gpu-run.sh spgemm`): every small case and every
// Llama-3-8B 6:8 layer shape at M = 1024 and 4096, INT32 bit for bit against cuBLASLt (itself
// checked against the CPU) and the bf16 epilogue bit for bit against its CPU rounding order. So
// the layout facts above hold: the metadata thread map and nibble order, the sparse-A SW128
// descriptor with its +32 / +64 byte k-step advance, the operand form.
// wgmma reads the metadata register asynchronously: with one copy of the words reused for the
// next tile while a group was in flight, every product over more than two K' tiles was wrong
// (exact under compute-sanitizer, which serializes); hence the two register sets of tile_step.
// Speed (INT32 out, 128 x 128 tiles): 0.85-1.17x cuBLASLt's dense INT8 GEMM at the same K'
// (1110-1390 TOPS counted as 2 M N K'), i.e. 0.62-0.96x dense at K for 6:8: not yet a win.
// Performance is not tuned: no TMA, no producer warp, no setmaxnreg, 1 CTA per SM, a barrier per
// K' tile, a direct (uncoalesced) epilogue, n128 tiles, no persistent/rasterized schedule.
//
// The warp-specialized kernels (`spgemm_ws_*`, "Stage (c)" above), 168 registers at launch
// (setmaxnreg 40 / 232), no spills; NVRTC compiles them for every target (sm_80 .. sm_120,
// sm_90a). Exact on the H100 (docs/runs/2026-12-06-h100.md): every small case and every Llama
// 6:8 shape at M = 1024 / 4096 / 16384, the cluster kernel `spgemm_ws_n256_k128_i32_mc2`
// included (clusters of two CTAs on neighbouring weight tiles, each loading half of the shared X'
// tile and multicasting it: X' is 32 of a stage's 41 KB, so the L2 reads per CTA drop by 39%).
// With the raster order of tile_of (group 16), best of n256 k128 and mc2: 1430-2226 TOPS,
// 1.17-1.74x cuBLASLt dense at K', 0.80-1.39x dense at K. Nsight Compute (H200) finds them bound by
// neither compute nor memory at group 16 (SM 60-75%, L2 61-75%). Left: the
// epilogue overlapped with the next tile (persistent CTAs), FP8.
// The persistent kernels (`spgemm_ws_n256_k128_{i32,bf16}_persistent`,
// `spgemm_ws_n128_k128_i32_pingpong`, see "The persistent kernels" above): exact on every
// bench-spgemm case (H100, 2026-12-07; grid min(tiles, SMs), and a one-CTA grid that walks every
// tile). Not faster: persistent 0.91-1.03x the ws n256 k128 kernel's time at M 1024 / 4096
// (qkv, o, gate_up, down), 0.96-1.26x at 16384; pingpong 1.22-1.74x.
// The compact kernels (`spgemm_ws_n256_k128_{i32,bf16}_compact`, "The compact kernels" above):
// 168 registers, no spills (nvcc 13.0 sm_90a); exact on every bench-spgemm case (H100, 2:4 small
// cases, 6:8 slid68 and the Llama shapes at M 1024 .. 16384). Slower than the ws n256 k128 kernel
// on the precomputed metadata (H100, M = 4096: 1.60x qkv, 1.61x o, 1.69x gate_up, 2.13x down):
// the stage waits for its ranks and their expansion. The timing probes (-DSPGEMM_COMPACT_PROBE,
// wrong results) split gate_up / down: 1494 / 764 us, without the expansion 1024 / 500, without
// the rank loads too 775 / 346. `_compact_ring` (the ranks 7 k-tiles ahead in a ring of their
// own): exact, 13-17% faster on gate_up / down, 2-3% slower on qkv / o (H200).
// The metadata kernel + ws n256 k128 (`ws n256 k128 compact jit` in bench-spgemm, the library's
// path): exact on every case (H100, 2026-12-07); at M = 4096 1.02-1.05x the ws kernel on a
// precomputed array (qkv 186.7 / 182.3 us, o 127.5 / 123.4, gate_up 880.8 / 859.1, down 380.5 /
// 363.8), at M = 256 faster than the in-stage compact kernel on every shape (qkv 34.2 / 51.2,
// o 31.6 / 50.7, gate_up 95.9 / 102.0, down 85.2 / 159.4): a weight tile's words are built once,
// by a grid that fills the GPU, instead of once per output tile on warps nothing hides.
// The 16-bit epilogue staged through shared memory (store_tile_16, `ws n256 k128 bf16` and
// `compact jit bf16 / f16` in bench-spgemm): exact on every case, the N = 100 6:8 case (per-value
// stores) included; at M = 4096 0.91-1.01x the INT32 kernel's time (H100, 2026-12-07: compact jit
// qkv 168.2 / 182.5 us, o 114.9 / 125.5, gate_up 767.0 / 805.5, down 347.0 / 349.9), where one
// 2-byte store per accumulator took 1.12-1.40x (docs/results/spgemm-epilogue-h100-2026-12-07.md).
