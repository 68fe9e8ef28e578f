//! The CUDA path (feature `cuda`): cuSPARSELt bindings, per-device state and the
//! `SlideSparseBackend` implementation for burn-cuda's `CubeBackend`.

pub mod algo_cache;
pub mod backend;
pub mod cublaslt;
pub mod cusparselt;
pub mod cusparselt_sys;
pub mod dense;
pub mod ordering;
pub mod side_kernels;
pub mod state;

pub use backend::CudaPrepared;
