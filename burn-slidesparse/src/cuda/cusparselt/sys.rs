//! Hand-written cuSPARSELt bindings (0.8 / 0.10 C ABI), loaded at run time with `libloading`
//! so that nothing links against the library at build time (CI has no CUDA libraries).
//!
//! Only the calls SlideSparse needs are bound. Enum values follow `cusparseLt.h` and
//! `library_types.h`; `docs/cusparselt.md` lists what the bindings rely on.

#![allow(non_camel_case_types, non_snake_case)]

use std::{
    ffi::{c_char, c_int, c_void},
    path::PathBuf,
};

use libloading::Library;

use crate::{
    cuda::config::Config,
    error::{Result, SlideSparseError},
};

/// `cusparseStatus_t`.
pub type Status = c_int;
/// `cudaStream_t`.
pub type Stream = *mut c_void;

/// The opaque cuSPARSELt structs: `struct { alignas(16) uint8_t data[512]; }` in 0.8-0.10.
/// We allocate twice the size to stay safe with future versions.
#[repr(C, align(16))]
pub struct Opaque(pub [u8; 1024]);

impl Opaque {
    /// A zeroed, boxed opaque struct (boxed so it never moves after init).
    pub fn boxed() -> Box<Self> {
        Box::new(Opaque([0; 1024]))
    }
}

/// `cudaDataType` values.
pub mod data_type {
    pub const R_32F: i32 = 0;
    pub const R_16F: i32 = 2;
    pub const R_8I: i32 = 3;
    pub const R_32I: i32 = 10;
    pub const R_16BF: i32 = 14;
    pub const R_8F_E4M3: i32 = 28;
}

/// `cusparseComputeType`.
pub mod compute {
    pub const C32I: i32 = 0;
    pub const C32F: i32 = 2;
}

pub const ORDER_COL: i32 = 1;
pub const OP_NON_TRANSPOSE: i32 = 0;
pub const OP_TRANSPOSE: i32 = 1;
pub const SPARSITY_50_PERCENT: i32 = 0;
pub const ALG_DEFAULT: i32 = 0;
pub const ALG_CONFIG_ID: i32 = 0;
/// `CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING` (an `int`, 1 = on): alpha becomes a device
/// vector with one entry per row of D.
pub const MATMUL_ALPHA_VECTOR_SCALING: i32 = 5;

type H = *const Opaque;
type M = *mut Opaque;

library_bindings! {
    CusparseLt {
        cusparseLtInit: fn(M) -> Status;
        cusparseLtDestroy: fn(H) -> Status;
        cusparseLtGetVersion: fn(H, *mut c_int) -> Status;
        cusparseLtGetErrorString: fn(Status) -> *const c_char;
        cusparseLtDenseDescriptorInit: fn(H, M, i64, i64, i64, u32, i32, i32) -> Status;
        cusparseLtStructuredDescriptorInit: fn(H, M, i64, i64, i64, u32, i32, i32, i32) -> Status;
        cusparseLtMatDescriptorDestroy: fn(H) -> Status;
        cusparseLtMatmulDescriptorInit: fn(H, M, i32, i32, H, H, H, H, i32) -> Status;
        cusparseLtMatmulDescSetAttribute: fn(H, M, i32, *const c_void, usize) -> Status;
        cusparseLtMatmulAlgSelectionInit: fn(H, M, H, i32) -> Status;
        cusparseLtMatmulAlgSelectionDestroy: fn(H) -> Status;
        cusparseLtMatmulAlgSetAttribute: fn(H, M, i32, *const c_void, usize) -> Status;
        cusparseLtMatmulAlgGetAttribute: fn(H, H, i32, *mut c_void, usize) -> Status;
        cusparseLtMatmulPlanInit: fn(H, M, H, H) -> Status;
        cusparseLtMatmulPlanDestroy: fn(H) -> Status;
        cusparseLtMatmulGetWorkspace: fn(H, H, *mut usize) -> Status;
        cusparseLtMatmul: fn(H, H, *const c_void, *const c_void, *const c_void, *const c_void, *const c_void, *mut c_void, *mut c_void, *mut Stream, i32) -> Status;
        cusparseLtMatmulSearch: fn(H, M, *const c_void, *const c_void, *const c_void, *const c_void, *const c_void, *mut c_void, *mut c_void, *mut Stream, i32) -> Status;
        cusparseLtSpMMAPruneCheck2: fn(H, H, c_int, i32, *const c_void, *mut c_int, Stream) -> Status;
        cusparseLtSpMMACompressedSize2: fn(H, H, *mut usize, *mut usize) -> Status;
        cusparseLtSpMMACompress2: fn(H, H, c_int, i32, *const c_void, *mut c_void, *mut c_void, Stream) -> Status;
    }
}

/// File name of the library on Linux.
const LIBRARY_NAME: &str = "libcusparseLt.so.0";

/// Places to look for the library, in order: `SLIDESPARSE_CUSPARSELT` (a file), the loader
/// path (bare name), then the pip wheels' folders under every Python environment we know of.
pub fn candidate_paths(config: &Config) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = config.cusparselt.iter().cloned().collect();
    paths.push(PathBuf::from(LIBRARY_NAME));
    paths.extend(config.pip_library_paths(&["cusparselt/lib", "cu13/lib"], LIBRARY_NAME));
    paths
}

impl CusparseLt {
    /// Loads the first library that opens and exports every entry point.
    pub fn load(config: &Config) -> Result<Self> {
        let tried = match Self::open_first(candidate_paths(config), None) {
            Ok(loaded) => return Ok(loaded),
            Err(tried) => tried,
        };
        Err(SlideSparseError::LibraryUnavailable {
            library: "cuSPARSELt",
            detail: format!(
                "libcusparseLt.so.0 (>= 0.8) did not load. Install it (pip install \
                 nvidia-cusparselt-cu13, or NVIDIA's package) and/or set SLIDESPARSE_CUSPARSELT \
                 to the library file. Tried: {}",
                if tried.is_empty() {
                    "nothing that exists".to_string()
                } else {
                    tried.join("; ")
                }
            ),
        })
    }
}
