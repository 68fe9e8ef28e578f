//! NCCL, the collective library tensor-parallel layers reduce their partial outputs with,
//! loaded at run time with `libloading` like cuSPARSELt, so that no GPU and one GPU need no
//! NCCL and nothing links against it at build time.
//!
//! Only the library and its entry points are here: finding it (`SLIDESPARSE_NCCL`, the
//! loader path, the pip folders), binding the calls the collectives on burn's stream need
//! (`nccl_ranks.rs`), and typed errors naming what was searched or what failed. cudarc's
//! `nccl` feature is not used: its loader searches bare library names only (not
//! `libnccl.so.2`, the one file NVIDIA's pip wheel ships) and panics when none loads.

#![allow(non_camel_case_types, non_snake_case)]

use std::{
    ffi::{CStr, c_char, c_int, c_void},
    path::{Path, PathBuf},
};

use libloading::Library;

use crate::{
    cuda::config::Config,
    error::{Result, SlideSparseError},
};

/// `ncclResult_t` (0 is success).
pub type NcclResult = c_int;
/// `ncclComm_t`.
pub type Comm = *mut c_void;
/// `cudaStream_t`.
pub type Stream = *mut c_void;

/// `ncclDataType_t` values the layers reduce in.
pub mod data_type {
    pub const FLOAT16: i32 = 6;
    pub const FLOAT32: i32 = 7;
    pub const BFLOAT16: i32 = 9;
}

/// `ncclRedOp_t` values the layers reduce with.
pub mod op {
    pub const SUM: i32 = 0;
}

library_bindings! {
    Nccl {
        ncclGetVersion: fn(*mut c_int) -> NcclResult;
        ncclGetErrorString: fn(NcclResult) -> *const c_char;
        ncclCommInitAll: fn(*mut Comm, c_int, *const c_int) -> NcclResult;
        ncclCommDestroy: fn(Comm) -> NcclResult;
        ncclCommAbort: fn(Comm) -> NcclResult;
        ncclAllReduce: fn(*const c_void, *mut c_void, usize, i32, i32, Comm, Stream) -> NcclResult;
        ncclAllGather: fn(*const c_void, *mut c_void, usize, i32, Comm, Stream) -> NcclResult;
    }
}

/// File name of the library on Linux (its soname; pip's wheel ships only this file).
pub const LIBRARY_NAME: &str = "libnccl.so.2";

/// The pip wheels' folders under `nvidia/` that hold the library.
const PIP_FOLDERS: [&str; 2] = ["nccl/lib", "cu13/lib"];

/// Places to look for the library, in order: `SLIDESPARSE_NCCL` (a file), the loader path
/// (bare name), then the pip wheels' folders under every Python environment we know of.
pub fn candidate_paths(config: &Config) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = config.nccl.iter().cloned().collect();
    paths.push(PathBuf::from(LIBRARY_NAME));
    paths.extend(config.pip_library_paths(&PIP_FOLDERS, LIBRARY_NAME));
    paths
}

impl Nccl {
    /// Loads the first library that opens and exports every entry point, or
    /// [`SlideSparseError::LibraryUnavailable`] naming every place searched.
    pub fn load(config: &Config) -> Result<Self> {
        let named = config.nccl.as_deref().map(|f| (f, "SLIDESPARSE_NCCL"));
        let tried = match Self::open_first(candidate_paths(config), named) {
            Ok(loaded) => return Ok(loaded),
            Err(tried) => tried,
        };
        Err(SlideSparseError::LibraryUnavailable {
            library: "NCCL",
            detail: format!(
                "{LIBRARY_NAME} (>= 2.18) did not load; tensor parallelism over GPUs needs it \
                 (one GPU does not). Install it (pip install nvidia-nccl-cu13, or NVIDIA's \
                 package) and/or set SLIDESPARSE_NCCL to the library file. Tried: {}. \
                 Searched the pip folders nvidia/{{{}}} under: {}",
                tried.join("; "),
                PIP_FOLDERS.join(","),
                config
                    .python_environments()
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }

    /// NCCL's version as `major * 10000 + minor * 100 + patch` (2.21.5 is 22105); a
    /// library whose version query fails is unusable.
    pub fn version(&self) -> Result<i32> {
        let mut version: c_int = 0;
        // SAFETY: `ncclGetVersion` writes one int through a valid pointer; it needs no GPU.
        let status = unsafe { (self.ncclGetVersion)(&mut version) };
        if status != 0 {
            return Err(SlideSparseError::LibraryUnavailable {
                library: "NCCL",
                detail: format!(
                    "{}: ncclGetVersion failed with status {status}: {}",
                    self.path.display(),
                    self.error_string(status)
                ),
            });
        }
        Ok(version)
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `Ok` for status 0, else [`SlideSparseError::Nccl`] naming `call`.
    pub fn check(&self, call: &'static str, status: NcclResult) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        Err(SlideSparseError::Nccl {
            call,
            status,
            message: self.error_string(status),
        })
    }

    /// NCCL's description of a status.
    pub fn error_string(&self, status: NcclResult) -> String {
        // SAFETY: `ncclGetErrorString` returns a static NUL-terminated string for any
        // status value (checked for null all the same).
        unsafe {
            let text = (self.ncclGetErrorString)(status);
            if text.is_null() {
                String::new()
            } else {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            }
        }
    }
}
