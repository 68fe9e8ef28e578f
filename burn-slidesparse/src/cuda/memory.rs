//! Refusing allocations that cannot fit, before cubecl is asked for them.
//!
//! cubecl-cuda 0.10 allocates on its device thread and unwraps the result there: a request
//! past the GPU's memory panics inside cubecl instead of returning an error to us. So the
//! large requests of a layer (its weights at preparation, its activation buffers at large
//! M) are checked first against what is free: the driver's free memory plus what cubecl's
//! pool holds but does not use. A request that fails that check is a typed
//! [`SlideSparseError::OutOfMemory`]; one that passes it can still fail on fragmentation,
//! which remains cubecl's panic.

use std::sync::Mutex;

use cudarc::driver::result as cu;

#[cfg(feature = "internals")]
use super::queued::{GraphReport, lanes};
use super::{
    driver::driver_err,
    runtime::{Client, cubecl_err},
    state::DeviceState,
};
use crate::error::{Result, SlideSparseError};

/// Requests below this size are not checked: checking costs a driver call and a round trip
/// to cubecl's device thread (~10 us), nothing next to the work such a request feeds.
pub const CHECK_FROM_BYTES: usize = 64 << 20;

/// Errors with [`SlideSparseError::OutOfMemory`] if `bytes` more cannot fit on the device
/// (see the module docs); requests under [`CHECK_FROM_BYTES`] pass unchecked. `what` names
/// the request for the error (built only then: no allocation on the hot path).
pub fn ensure_fits(
    client: &Client,
    state: &Mutex<DeviceState>,
    bytes: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    if bytes < CHECK_FROM_BYTES {
        return Ok(());
    }
    let available = available_bytes(client, state)?;
    if bytes as u64 > available {
        return Err(SlideSparseError::OutOfMemory {
            what: what(),
            needed: bytes as u64,
            available,
        });
    }
    Ok(())
}

/// The driver's free and total bytes, and cubecl's pool usage, of one device.
fn driver_and_pool(
    client: &Client,
    state: &Mutex<DeviceState>,
) -> Result<(usize, usize, cubecl::MemoryUsage)> {
    let (free, total) = {
        let state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.make_current()?;
        cu::mem_get_info().map_err(driver_err("cuMemGetInfo"))?
    };
    let pool = client
        .memory_usage()
        .map_err(|e| cubecl_err("memory_usage")(&e))?;
    Ok((free, total, pool))
}

/// Free device memory plus the bytes cubecl's pool has reserved but does not use, capped at
/// the device's total less the pool's bytes in use (cubecl's reserved count was seen to
/// exceed what the driver reports as used, which alone overstated the sum).
pub fn available_bytes(client: &Client, state: &Mutex<DeviceState>) -> Result<u64> {
    let (driver_free, total, pool) = driver_and_pool(client, state)?;
    let pool_free = pool
        .bytes_reserved
        .saturating_sub(pool.bytes_in_use + pool.bytes_padding);
    let in_use = pool.bytes_in_use + pool.bytes_padding;
    Ok((driver_free as u64 + pool_free).min((total as u64).saturating_sub(in_use)))
}

/// Device memory as the allocator and the driver see it, for reports.
#[cfg(feature = "internals")]
#[derive(Clone, Copy, Debug)]
pub struct MemoryReport {
    /// Bytes of live cubecl allocations (padding included).
    pub allocator_in_use: u64,
    /// Bytes cubecl's pools hold from the driver, used or not.
    pub allocator_reserved: u64,
    /// The driver's used bytes (total less free): every allocation of the process (cubecl's
    /// pools, the libraries' workspaces, the CUDA context) and of other processes.
    pub driver_used: u64,
    /// The device's memory.
    pub total: u64,
}

#[cfg(feature = "internals")]
/// The GEMM graphs `device`'s lanes hold now and how their GEMM calls ran, over every
/// layer run so far (see [`GraphReport`]). On fusion, sync first: a queued forward has not
/// captured its graph yet.
pub fn graph_report(device: &cubecl::cuda::CudaDevice) -> Result<GraphReport> {
    let lanes = lanes(device.index)?;
    let lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
    Ok(lanes.graph_report())
}

#[cfg(feature = "internals")]
/// What `device` holds now, after everything queued on burn's stream of this thread has run
/// (it synchronizes: for reports only).
pub fn memory_report(device: &cubecl::cuda::CudaDevice) -> Result<MemoryReport> {
    let client = <super::runtime::Runtime as cubecl::Runtime>::client(device);
    super::runtime::sync_burn_stream(&client)?;
    let state = super::state::device_state(device.index)?;
    let (free, total, pool) = driver_and_pool(&client, &state)?;
    Ok(MemoryReport {
        allocator_in_use: pool.bytes_in_use + pool.bytes_padding,
        allocator_reserved: pool.bytes_reserved,
        driver_used: (total - free) as u64,
        total: total as u64,
    })
}

#[cfg(feature = "internals")]
/// Asks cubecl to return the pool pages nothing uses to the driver (for reports between
/// models; cubecl does this lazily on its own).
pub fn release_free_memory(device: &cubecl::cuda::CudaDevice) {
    <super::runtime::Runtime as cubecl::Runtime>::client(device).memory_cleanup();
}
