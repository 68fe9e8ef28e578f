//! The cubecl side of the CUDA path: the runtime, client and backend types, device pointers
//! of cubecl allocations, and the one blocking wait on burn's stream.

use cubecl::{prelude::*, server::Handle};

use crate::error::{Result, SlideSparseError};

/// cubecl's CUDA runtime, which burn-cuda's `CubeBackend` runs on.
pub type Runtime = cubecl::cuda::CudaRuntime;

/// A compute client of [`Runtime`]: burn's handle to one device.
pub type Client = ComputeClient<Runtime>;

/// A cubecl failure as a typed error.
pub(crate) fn cubecl_err(what: &'static str) -> impl Fn(&dyn std::fmt::Debug) -> SlideSparseError {
    move |e| SlideSparseError::Cubecl {
        what,
        detail: format!("{e:?}"),
    }
}

/// The device pointer of a cubecl allocation. It does not move while the handle lives.
pub fn device_ptr(client: &Client, handle: &Handle) -> Result<u64> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| cubecl_err("get_resource")(&e))?;
    Ok(resource.resource().ptr)
}

/// Blocks until everything queued on burn's stream of this thread has run. Only for
/// one-off work (weight preparation, algorithm search), never in a forward.
pub fn sync_burn_stream(client: &Client) -> Result<()> {
    cubecl::future::block_on(client.sync()).map_err(|e| cubecl_err("sync")(&e))
}

/// burn-cuda's backend on which the SlideSparse CUDA path runs (`F` is the float type of
/// activations and outputs; bf16 gives 16-bit GEMM accumulators).
pub type CudaBackend<F = f32> = burn_cubecl::CubeBackend<Runtime, F, i32, u8>;

/// [`CudaBackend`] under burn's fusion (what `burn::backend::Cuda` is with burn's default
/// features): element-wise operations fused into fewer kernels, SlideSparse layers and the
/// attention kernels as custom fusion operations.
pub type CudaFusionBackend<F = f32> = burn_fusion::Fusion<CudaBackend<F>>;
