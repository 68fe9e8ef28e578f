//! The CUDA path (feature `cuda`): cuSPARSELt bindings, per-device state and the
//! `SlideSparseBackend` implementation for burn-cuda's `CubeBackend`.

pub mod accumulator;
pub mod algo_cache;
pub mod backend;
pub mod cublaslt;
pub mod cupti;
pub mod cusparselt;
pub mod cusparselt_sys;
pub mod dense;
pub mod device_thread;
pub mod gate;
pub mod graphs;
pub mod launch;
pub mod memory;
pub mod ordering;
pub mod scratch;
pub mod side_kernels;
pub mod state;

pub use backend::CudaPrepared;

/// burn-cuda's backend on which the SlideSparse CUDA path runs (`F` is the float type of
/// activations and outputs; bf16 gives 16-bit GEMM accumulators, see `accumulator`).
pub type CudaBackend<F = f32> = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, i32, u8>;
