//! Work placed on cubecl's device thread, the thread that issues every CubeCL launch.
//!
//! cubecl-cuda 0.10 queues each launch as a task for one thread per device, which issues
//! the tasks in queue order (in batches of 32, or when a caller flushes) on the stream of
//! the burn thread that queued them. A library call placed in that queue is therefore
//! ordered on burn's stream exactly where it stands in the program. Two ways in:
//!
//! - `on_burn_stream` blocks (`ComputeClient::exclusive` flushes the queue and waits for
//!   the task): the closure may borrow the caller's state and return its error. Direct
//!   library calls and graph captures go this way.
//! - [`GraphLauncher::queue`] queues the `cuGraphLaunch` of a graph captured earlier like a
//!   kernel launch, without waiting (`DeviceHandle::submit`). The burn thread and the device
//!   thread then overlap, as they do for burn's own kernels; at decode sizes this removes
//!   the one round trip per forward between them. A failure cannot reach the caller from
//!   there: the task fills the forward's token scales with NaN (so its output is NaN, never
//!   a stale result) and records the error, which this lane's next GEMM call returns.
//!
//! A queued task holds a graph's executable by pointer. Graphs are destroyed only on the
//! device thread (a capture that evicts them runs there, after every task queued before
//! it) or after a sync of burn's stream (which runs after them too), see `graphs.rs`.

use std::sync::{Arc, Mutex};

use cubecl::{Runtime as _, cuda::CudaDevice};
use cubecl::{device::Device, device_handle::DeviceHandle};
use cudarc::driver::sys;

use super::runtime::{Client, Runtime, cubecl_err};
use crate::error::{Result, SlideSparseError};

type Server = <Runtime as cubecl::Runtime>::Server;

/// A closure sent to cubecl's device thread. It borrows the caller's plan and pointers;
/// `ComputeClient::exclusive` blocks the caller until it has run, so the borrows outlive it
/// and nothing else touches them meanwhile.
struct OnDeviceThread<F>(F);
// SAFETY: see above: the closure runs while its owner is blocked waiting for it.
unsafe impl<F> Send for OnDeviceThread<F> {}
impl<F: FnOnce(sys::CUstream) -> Result<()>> OnDeviceThread<F> {
    fn run(self, stream: usize) -> Result<()> {
        (self.0)(stream as sys::CUstream)
    }
}

/// Runs `enqueue(burn_stream)` on cubecl's device thread, after every launch queued before
/// it, and returns when it has run: work it enqueues on `burn_stream` (this thread's burn
/// stream) is ordered exactly where the call stands in the program.
pub(crate) fn on_burn_stream(
    client: &Client,
    burn_stream: sys::CUstream,
    enqueue: impl FnOnce(sys::CUstream) -> Result<()>,
) -> Result<()> {
    let stream = burn_stream as usize;
    let job = OnDeviceThread(enqueue);
    client
        .exclusive(move || job.run(stream))
        .map_err(|e| cubecl_err("exclusive (device thread)")(&e))?
}

/// The raw handles a queued graph launch needs.
#[derive(Clone, Copy)]
struct QueuedLaunch {
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
    /// Token scales (f32) to fill with NaN if the launch fails.
    poison: sys::CUdeviceptr,
    poison_len: usize,
}
// SAFETY: plain driver handles and a device pointer; the driver API is thread-safe, and
// the module docs say why each stays valid until the task has run.
unsafe impl Send for QueuedLaunch {}

/// A quiet NaN as f32 bits.
const NAN_BITS: u32 = 0x7FC0_0000;

/// Queues graph launches on cubecl's device thread for one lane (burn thread).
pub struct GraphLauncher {
    device: DeviceHandle<Server>,
    /// The error of a queued launch that failed, until the lane's next GEMM call reports it.
    failure: Arc<Mutex<Option<String>>>,
}

impl GraphLauncher {
    /// The launcher of CUDA device `index`, whose cubecl client must exist (it does once a
    /// forward runs: the forward's tensors come from it).
    pub fn new(index: usize) -> Self {
        let device = CudaDevice { index };
        // Make sure the device's runner is cubecl-cuda's own before attaching to it.
        let _client = Runtime::client(&device);
        Self {
            device: DeviceHandle::new(device.to_id()),
            failure: Arc::default(),
        }
    }

    /// The error of an earlier queued launch of this lane, if one failed (reported once).
    pub fn take_failure(&self) -> Result<()> {
        match self
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            None => Ok(()),
            Some(code) => Err(SlideSparseError::QueuedReplayFailed { code }),
        }
    }

    /// Drops `garbage` on cubecl's device thread behind every task queued so far: a retired
    /// lane's graphs, which its queued replays hold by pointer (module docs).
    pub fn drop_after_queued<T: Send + 'static>(&self, garbage: T) {
        self.device.submit(move |_server: &mut Server| drop(garbage));
    }

    /// Queues `cuGraphLaunch(exec, burn_stream)` behind the launches queued so far.
    ///
    /// # Safety
    /// `exec` is a live graph of the device's context that stays alive until the task has
    /// run (module docs); `burn_stream` is this thread's burn stream; `poison` points to at
    /// least `poison_len` f32 values that the forward's epilogue reads.
    pub unsafe fn queue(
        &self,
        exec: sys::CUgraphExec,
        burn_stream: sys::CUstream,
        (poison, poison_len): (u64, usize),
    ) {
        let launch = QueuedLaunch {
            exec,
            stream: burn_stream,
            poison,
            poison_len,
        };
        let failure = self.failure.clone();
        self.device.submit(move |_server: &mut Server| {
            let launch = launch;
            // SAFETY: the caller's contract; the device thread has the context current.
            let launched = unsafe { sys::cuGraphLaunch(launch.exec, launch.stream) };
            if launched != sys::CUresult::CUDA_SUCCESS {
                // SAFETY: as above; a failure here leaves the error recorded below.
                let _ = unsafe {
                    sys::cuMemsetD32Async(launch.poison, NAN_BITS, launch.poison_len, launch.stream)
                };
                *failure.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(format!("cuGraphLaunch: {launched:?}"));
            }
        });
    }
}
