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

/// How many CUDA devices the driver sees, or [`SlideSparseError::NoGpu`] where there is no
/// driver.
pub fn device_count() -> Result<usize> {
    if !cuda_driver_present() {
        return Err(SlideSparseError::NoGpu(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    cu::init().map_err(|e| SlideSparseError::NoGpu(format!("cuInit failed: {e:?}")))?;
    let count = cu::device::get_count()
        .map_err(|e| SlideSparseError::NoGpu(format!("cuDeviceGetCount failed: {e:?}")))?;
    Ok(count.max(0) as usize)
}

/// Device `index`, or [`SlideSparseError::NoGpu`] saying why there is none: no driver library
/// (cudarc would panic on the first driver call), no device, or an index past the last one.
pub fn cuda_device(index: usize) -> Result<sys::CUdevice> {
    let count = device_count()?;
    if index >= count {
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

/// A device allocation of our own, outside cubecl's pool, freed on drop: for one-off
/// temporaries (a layer's uncompressed weight while cuSPARSELt compresses it), whose pages
/// would otherwise stay reserved in cubecl's pool after they are freed. The device's context
/// must be current on this thread for its whole life.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// `len` bytes (at least 1), zeroed.
    pub fn zeroed(len: usize) -> Result<Self> {
        let len = len.max(1);
        // SAFETY: a plain allocation in the current context; the pointer is owned by the
        // returned value and freed once, in `drop`.
        let ptr = unsafe { cu::malloc_sync(len) }.map_err(driver_err("cuMemAlloc"))?;
        let buffer = Self { ptr, len };
        // SAFETY: `ptr` is a live allocation of `len` bytes.
        unsafe { cu::memset_d8_sync(buffer.ptr, 0, len) }.map_err(driver_err("cuMemsetD8"))?;
        Ok(buffer)
    }

    /// A copy of `bytes` on the device.
    pub fn upload(bytes: &[u8]) -> Result<Self> {
        let len = bytes.len().max(1);
        // SAFETY: as in `zeroed`.
        let ptr = unsafe { cu::malloc_sync(len) }.map_err(driver_err("cuMemAlloc"))?;
        let buffer = Self { ptr, len };
        // SAFETY: `ptr` holds `len >= bytes.len()` bytes; the copy is synchronous, so `bytes`
        // is not read after it returns.
        unsafe { cu::memcpy_htod_sync(buffer.ptr, bytes) }.map_err(driver_err("cuMemcpyHtoD"))?;
        Ok(buffer)
    }

    /// The device pointer.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The first `N` bytes, read back (synchronous).
    pub fn read<const N: usize>(&self) -> Result<[u8; N]> {
        assert!(N <= self.len, "reading past a device buffer");
        let mut out = [0u8; N];
        // SAFETY: `ptr` holds at least `N` bytes; the copy is synchronous.
        unsafe { cu::memcpy_dtoh_sync(&mut out, self.ptr) }.map_err(driver_err("cuMemcpyDtoH"))?;
        Ok(out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated by `cuMemAlloc` and is freed exactly once; work using it
        // was synchronized by its user before the drop (cuMemFree also waits for the device).
        let _ = unsafe { cu::free_sync(self.ptr) };
    }
}
