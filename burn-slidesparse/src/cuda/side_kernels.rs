//! Two tiny CUDA kernels for streams that CubeCL does not launch on, compiled once with
//! NVRTC: a spin wait on a device flag and a flag store. The stream gate (`gate.rs`) closes
//! burn's stream with the spin and opens it with the store from a stream of ours.
//!
//! They are kernels because the driver's stream memory operations (`cuStreamWaitValue32`)
//! reject cubecl's memory (it comes from the stream-ordered allocator:
//! `CUDA_ERROR_INVALID_VALUE`, seen on the H200 host).

use std::ffi::{CString, c_void};

use cudarc::driver::{result as cu, sys};

use crate::error::{Result, SlideSparseError};

const SOURCE: &str = r#"
extern "C" __global__ void slidesparse_wait(const volatile unsigned int* flag, unsigned int epoch,
                                            unsigned int* timed_out, unsigned int max_spins) {
    unsigned int spins = 0;
    while (*flag < epoch) {
        if (++spins >= max_spins) { *timed_out = epoch; return; }
        __nanosleep(64);
    }
    __threadfence();
}
extern "C" __global__ void slidesparse_signal(volatile unsigned int* flag, unsigned int epoch) {
    __threadfence_system();
    *flag = epoch;
}
"#;

/// The compiled kernels.
pub struct SideKernels {
    _module: sys::CUmodule,
    wait: sys::CUfunction,
    signal: sys::CUfunction,
}

// SAFETY: module and function handles are immutable after loading and used under the device
// state's mutex.
unsafe impl Send for SideKernels {}

fn err(call: &'static str, e: impl std::fmt::Debug) -> SlideSparseError {
    SlideSparseError::Cuda {
        call,
        code: format!("{e:?}"),
    }
}

impl SideKernels {
    /// Compiles and loads the kernels in the current context.
    pub fn new() -> Result<Self> {
        // NVRTC's default architecture (sm_75 in CUDA 13) is enough (`__nanosleep` needs
        // sm_70); the driver JIT-compiles the PTX for the GPU at hand.
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| err("NVRTC", e))?;
        let image = CString::new(ptx.to_src()).map_err(|e| err("PTX", e))?;
        // SAFETY: `image` is a NUL-terminated PTX string; the context is current.
        unsafe {
            let module = cu::module::load_data(image.as_ptr() as *const c_void)
                .map_err(|e| err("cuModuleLoadData", e))?;
            let get =
                |name: &str| cu::module::get_function(module, CString::new(name).expect("no NUL"));
            Ok(Self {
                wait: get("slidesparse_wait").map_err(|e| err("cuModuleGetFunction", e))?,
                signal: get("slidesparse_signal").map_err(|e| err("cuModuleGetFunction", e))?,
                _module: module,
            })
        }
    }

    /// Enqueues on `stream` a wait until `*flag >= epoch` (or `max_spins` polls, recording
    /// `epoch` in `*timed_out`).
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context; `flag` and `timed_out` live
    /// device pointers to `u32`s.
    pub unsafe fn wait(
        &self,
        stream: sys::CUstream,
        flag: u64,
        epoch: u32,
        timed_out: u64,
        max_spins: u32,
    ) -> Result<()> {
        let (mut flag, mut epoch, mut timed_out, mut max_spins) =
            (flag, epoch, timed_out, max_spins);
        let mut params = [
            &mut flag as *mut u64 as *mut c_void,
            &mut epoch as *mut u32 as *mut c_void,
            &mut timed_out as *mut u64 as *mut c_void,
            &mut max_spins as *mut u32 as *mut c_void,
        ];
        // SAFETY: the parameters match the kernel signature; pointers are live device memory.
        unsafe { cu::launch_kernel(self.wait, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }
            .map_err(|e| err("cuLaunchKernel(wait)", e))
    }

    /// Enqueues on `stream` the store `*flag = epoch` (after all prior work of `stream`).
    ///
    /// # Safety
    /// As for [`wait`](Self::wait).
    pub unsafe fn signal(&self, stream: sys::CUstream, flag: u64, epoch: u32) -> Result<()> {
        let (mut flag, mut epoch) = (flag, epoch);
        let mut params = [
            &mut flag as *mut u64 as *mut c_void,
            &mut epoch as *mut u32 as *mut c_void,
        ];
        // SAFETY: as above.
        unsafe { cu::launch_kernel(self.signal, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }
            .map_err(|e| err("cuLaunchKernel(signal)", e))
    }
}
