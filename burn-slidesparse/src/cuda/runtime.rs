//! The cubecl side of the CUDA path: the runtime and client types, device pointers of
//! cubecl allocations, and the one blocking wait on burn's stream.

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
