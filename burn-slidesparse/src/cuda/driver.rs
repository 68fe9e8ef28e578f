//! The CUDA driver side: typed driver errors, finding a device, its primary context and
//! streams of our own.

use cudarc::driver::{result as cu, sys};

use crate::error::{Result, SlideSparseError};

/// Maps a driver error of the entry point `call` to [`SlideSparseError::Cuda`].
pub fn driver_err(call: &'static str) -> impl Fn(cu::DriverError) -> SlideSparseError {
    move |e| SlideSparseError::Cuda {
        call,
        code: format!("{:?}", e.0),
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn cuda_driver_present() -> bool {
    // SAFETY: only probes whether the driver library can be loaded.
    unsafe { sys::is_culib_present() }
}

/// Device `index`, or [`SlideSparseError::NoGpu`] saying why there is none: no driver library
/// (cudarc would panic on the first driver call), no device, or an index past the last one.
pub fn cuda_device(index: usize) -> Result<sys::CUdevice> {
    if !cuda_driver_present() {
        return Err(SlideSparseError::NoGpu(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    cu::init().map_err(|e| SlideSparseError::NoGpu(format!("cuInit failed: {e:?}")))?;
    let count = cu::device::get_count()
        .map_err(|e| SlideSparseError::NoGpu(format!("cuDeviceGetCount failed: {e:?}")))?;
    if index >= count.max(0) as usize {
        return Err(SlideSparseError::NoGpu(format!(
            "device {index} requested, {count} present"
        )));
    }
    cu::device::get(index as i32).map_err(driver_err("cuDeviceGet"))
}

/// A device's primary context (the one cubecl-cuda uses), retained for the process.
#[derive(Clone, Copy, Debug)]
pub struct Context(sys::CUcontext);

// SAFETY: a context handle may be made current on any thread; the driver API is thread-safe.
unsafe impl Send for Context {}

impl Context {
    /// Retains the primary context of `device` and makes it current on this thread.
    pub fn retain(device: sys::CUdevice) -> Result<Self> {
        // SAFETY: `device` is valid; the primary context is the one cubecl-cuda uses.
        let context = unsafe { cu::primary_ctx::retain(device) }
            .map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let this = Self(context);
        this.make_current()?;
        Ok(this)
    }

    /// Makes the context current on this thread (cheap; burn may call from any thread).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        unsafe { cu::ctx::set_current(self.0) }.map_err(driver_err("cuCtxSetCurrent"))
    }
}

/// A non-blocking stream of the current context.
pub fn create_stream() -> Result<sys::CUstream> {
    cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(driver_err("cuStreamCreate"))
}

/// Blocks until everything enqueued on `stream` is done.
///
/// # Safety
/// `stream` is a live stream of the current context.
pub unsafe fn synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { cu::stream::synchronize(stream) }.map_err(driver_err("cuStreamSynchronize"))
}
