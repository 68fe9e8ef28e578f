//! The cubecl side of the CUDA path: the runtime, client and backend types, device pointers
//! of cubecl allocations, and the one blocking wait on burn's stream.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use cubecl::{prelude::*, server::Handle};

use crate::error::{Result, SlideSparseError};

/// cubecl's CUDA runtime, which burn-cuda's `CubeBackend` runs on.
pub type Runtime = cubecl::cuda::CudaRuntime;

/// A compute client of [`Runtime`]: burn's handle to one device.
pub type Client = ComputeClient<Runtime>;

/// cubecl-cuda's server, what a task queued on a device thread is given.
pub type Server = <Runtime as cubecl::Runtime>::Server;

/// A value per CUDA device, built on first use and shared for the life of the process.
pub struct PerDevice<T>(Mutex<Option<HashMap<usize, Arc<T>>>>);

impl<T> Default for PerDevice<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> PerDevice<T> {
    /// No device's value yet.
    pub const fn new() -> Self {
        Self(Mutex::new(None))
    }

    /// Device `index`'s value, built with `init` on first use (under the lock: one build per
    /// device).
    pub fn get_or_try_init(&self, index: usize, init: impl FnOnce() -> Result<T>) -> Result<Arc<T>> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let all = all.get_or_insert_with(HashMap::new);
        if let Some(value) = all.get(&index) {
            return Ok(value.clone());
        }
        let value = Arc::new(init()?);
        all.insert(index, value.clone());
        Ok(value)
    }

    /// Device `index`'s value if it was built (without building it).
    pub fn get(&self, index: usize) -> Option<Arc<T>> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.as_ref()?.get(&index).cloned()
    }
}

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
