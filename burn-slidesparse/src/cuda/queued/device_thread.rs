//! Work placed on cubecl's device thread, the thread that issues every CubeCL launch.
//!
//! cubecl-cuda 0.10 queues each launch as a task for one thread per device, which issues
//! the tasks in queue order (in batches of 32, or when a caller flushes) on the stream of
//! the cubecl stream that queued them. Work of ours placed in that queue is therefore
//! ordered on burn's stream exactly where it stands in the program. Two ways in:
//!
//! - [`on_burn_stream`] blocks (`ComputeClient::exclusive` flushes the queue and waits for
//!   the task): the closure may borrow the caller's state and return its error. Direct
//!   library calls and graph captures go this way.
//! - [`queue_task`] queues a task without waiting (`DeviceHandle::submit`), like a kernel
//!   launch: the burn thread and the device thread then overlap, as they do for burn's own
//!   kernels (at decode sizes this removes a round trip per call between them). Graph
//!   replays, our kernels' launches and NCCL calls go this way. A failure cannot reach the
//!   caller from there: the task fills its outputs with NaN (never a stale result) and its
//!   error is recorded against the cubecl stream that queued it (`crate::deferred`).
//!
//! A queued replay holds a graph's executable by pointer. Graphs are destroyed only on the
//! device thread (a capture that evicts them runs there, after every task queued before
//! it; a retired lane's graphs are dropped by a task queued behind its replays) or after a
//! sync of burn's stream (which runs after them too), see `graphs.rs`.

use cubecl::{device_handle::DeviceHandle, stream_id::StreamId};
use cudarc::driver::sys;

use super::super::runtime::{Client, Server, cubecl_err};
use crate::{
    deferred,
    error::{Result, SlideSparseError},
};

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
/// it, and returns when it has run: work it enqueues on `burn_stream` (this cubecl stream's
/// burn stream) is ordered exactly where the call stands in the program.
pub fn on_burn_stream(
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

/// Queues `task` on `device_thread` behind every task queued so far, without waiting. Its
/// error (after it has NaN-filled its outputs) is recorded against the current cubecl
/// stream, whose next call reports it.
pub fn queue_task(
    device_thread: &DeviceHandle<Server>,
    task: impl FnOnce(&mut Server) -> Result<()> + Send + 'static,
) {
    let stream = StreamId::current();
    device_thread.submit(move |server: &mut Server| {
        if let Err(error) = task(server) {
            deferred::record(stream, error);
        }
    });
}

/// A quiet NaN as f32 bits.
const NAN_BITS: u32 = 0x7FC0_0000;

/// The raw handles a queued graph launch needs.
#[derive(Clone, Copy)]
struct GraphLaunch {
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
    /// Token scales (f32) to fill with NaN if the launch fails.
    poison: sys::CUdeviceptr,
    poison_len: usize,
}
// SAFETY: plain driver handles and a device pointer; the driver API is thread-safe, and
// the module docs say why each stays valid until the task has run.
unsafe impl Send for GraphLaunch {}

/// Queues `cuGraphLaunch(exec, burn_stream)` on `device_thread` behind the tasks queued so
/// far; if it fails, the forward's token scales are NaN-filled (so its output is NaN) and
/// [`SlideSparseError::QueuedReplayFailed`] is recorded for the current cubecl stream.
///
/// # Safety
/// `exec` is a live graph of the device's context that stays alive until the task has run
/// (module docs); `burn_stream` is the current cubecl stream's burn stream; `poison` points
/// to at least `poison_len` f32 values that the forward's epilogue reads.
pub unsafe fn queue_graph_launch(
    device_thread: &DeviceHandle<Server>,
    exec: sys::CUgraphExec,
    burn_stream: sys::CUstream,
    (poison, poison_len): (u64, usize),
) {
    let launch = GraphLaunch {
        exec,
        stream: burn_stream,
        poison,
        poison_len,
    };
    let injected = injected_failure();
    queue_task(device_thread, move |_server| {
        let launch = launch;
        let launched = match injected {
            Some(code) => code,
            // SAFETY: the caller's contract; the device thread has the context current.
            None => match unsafe { sys::cuGraphLaunch(launch.exec, launch.stream) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                failed => format!("cuGraphLaunch: {failed:?}"),
            },
        };
        // SAFETY: as above; a failure here leaves the error recorded anyway.
        let _ = unsafe {
            sys::cuMemsetD32Async(launch.poison, NAN_BITS, launch.poison_len, launch.stream)
        };
        Err(SlideSparseError::QueuedReplayFailed { code: launched })
    });
}

/// The failure a test asked the next queued launch of the current cubecl stream to have
/// ([`fail_next_queued_launch`]), taken; `None` without the `internals` feature.
pub(super) fn injected_failure() -> Option<String> {
    #[cfg(feature = "internals")]
    {
        if !ANY_INJECTED.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let stream = StreamId::current();
        let mut injected = INJECTED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = injected.iter().position(|s| *s == stream) {
            injected.swap_remove(at);
            return Some(format!("failure injected for {stream}"));
        }
        None
    }
    #[cfg(not(feature = "internals"))]
    None
}

/// The cubecl streams whose next queued launch fails ([`fail_next_queued_launch`]).
#[cfg(feature = "internals")]
static INJECTED: std::sync::Mutex<Vec<StreamId>> = std::sync::Mutex::new(Vec::new());

/// Whether a failure was ever injected: the benchmarks (built with `internals`) skip the
/// lock on every launch.
#[cfg(feature = "internals")]
static ANY_INJECTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the next launch queued on the device thread for the current cubecl stream (a GEMM
/// graph replay or one of this crate's kernels) fail as if the driver had refused it: its
/// outputs are NaN-filled and the stream's next call reports the failure. For tests of
/// how a queued failure reaches its caller.
#[cfg(feature = "internals")]
pub fn fail_next_queued_launch() {
    ANY_INJECTED.store(true, std::sync::atomic::Ordering::Relaxed);
    INJECTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(StreamId::current());
}
