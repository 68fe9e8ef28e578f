//! Two tiny CUDA kernels for the benchmarks' stream gate (`gate.rs`; `kernels/stream_gate.cu`,
//! compiled with NVRTC once per gate): a spin wait on a device flag and a flag store. The gate
//! closes burn's stream with the spin and opens it with the store from a stream of ours.
//!
//! They are kernels because the driver's stream memory operations (`cuStreamWaitValue32`)
//! reject cubecl's memory (it comes from the stream-ordered allocator:
//! `CUDA_ERROR_INVALID_VALUE`, seen on the H200 host).

use std::ffi::c_void;

use cudarc::driver::{result as cu, sys};

use super::nvrtc_module::{LoadedProgram, Program};
use crate::error::{Result, SlideSparseError};

/// The gate's kernels (`__nanosleep` needs sm_70).
pub(super) const PROGRAM: Program = Program {
    name: "stream gate",
    files: &["stream_gate.cu"],
    min_capability: (7, 0),
    arch_specific: false,
};

/// The compiled kernels.
pub struct SideKernels {
    _program: LoadedProgram,
    wait: sys::CUfunction,
    signal: sys::CUfunction,
}

// SAFETY: function handles of a loaded module, immutable after loading and used under the
// device state's mutex.
unsafe impl Send for SideKernels {}

fn err(call: &'static str, e: impl std::fmt::Debug) -> SlideSparseError {
    SlideSparseError::Cuda {
        call,
        code: format!("{e:?}"),
    }
}

impl SideKernels {
    /// Compiles and loads the kernels for device `index` (its context made current on this
    /// thread).
    pub fn new(index: usize) -> Result<Self> {
        let program = LoadedProgram::load(index, &PROGRAM)?;
        Ok(Self {
            wait: program.function("slidesparse_wait", 0)?,
            signal: program.function("slidesparse_signal", 0)?,
            _program: program,
        })
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
