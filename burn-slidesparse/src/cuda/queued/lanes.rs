//! The lanes: per device and cubecl stream, the state our queued work runs with.
//!
//! cubecl keys its streams by [`StreamId`]: the calling thread's by default, or the one a
//! caller set for a piece of work (burn's fusion backend runs each queued operation under
//! the `StreamId` of the thread that queued it, possibly on another thread). Lanes are keyed
//! the same way, so a forward or kernel that fusion runs finds the lane, kept buffers and
//! graphs of the stream its kernels go to, whichever thread executes it.
//!
//! cubecl never reuses a `StreamId`: a thread that ends leaves its lane unused for good. So
//! the thread that creates a lane retires it when it ends ([`Lanes::retire`], through
//! `thread_exit`), and the next lane lookup on the device frees it: the kept buffers
//! through cubecl (in stream order), the graphs on cubecl's device thread after every task
//! queued before (queued replays hold them by pointer), the lane's own stream once its last
//! holder lets go. A server that runs forwards on short-lived threads (a pool that ends idle
//! threads, `std::thread::scope` per request) thus holds the lanes of its live threads only.
//! The creator is the owner except where fusion runs another thread's queued operations;
//! there the lane is retired with its creator, and its owner's next call makes a new one.

use std::{
    collections::{HashMap, hash_map::Entry},
    sync::{Arc, Mutex},
};

use cubecl::{
    Runtime as _, cuda::CudaDevice, device::Device, device_handle::DeviceHandle,
    stream_id::StreamId,
};
use cudarc::driver::{result as cu, sys};

#[cfg(feature = "internals")]
use super::report::CallCounts;
use super::{
    super::{
        buffers::{KeptBuffer, KeptScratch},
        config::SyncMode,
        driver::{Context, create_stream, cuda_device},
        graphs::GemmGraphs,
        runtime::{Client, PerDevice, Runtime, Server},
        thread_exit::at_thread_exit,
    },
    library_calls::probe_burn_stream,
};
use crate::error::Result;

/// A stream of ours, destroyed when its last holder drops it (a host-ordered launch may
/// hold it past its lane's retirement).
pub struct OwnedStream(sys::CUstream);

// SAFETY: a stream handle may be used from any thread with its context current; the driver
// API is thread-safe.
unsafe impl Send for OwnedStream {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    /// The raw stream.
    pub fn raw(&self) -> sys::CUstream {
        self.0
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: our stream, destroyed once; work still queued on it completes first (CUDA
        // defers the release).
        let _ = unsafe { cu::stream::destroy(self.0) };
    }
}

/// One cubecl stream's state on one device.
pub struct Lane {
    /// burn's stream (as an integer), or why it could not be found; probed on first use.
    pub(super) burn_stream: Option<std::result::Result<usize, String>>,
    /// A stream of ours for host-ordered work, created on first use.
    host_stream: Option<Arc<OwnedStream>>,
    workspace: KeptBuffer,
    /// The intermediate buffers of decode-sized forwards, kept across calls.
    pub scratch: KeptScratch,
    /// GEMM calls on kept buffers, replayed as CUDA graphs.
    pub graphs: GemmGraphs,
    /// How this lane's GEMM calls ran, for reports.
    #[cfg(feature = "internals")]
    pub(super) calls: CallCounts,
}

impl Lane {
    fn new() -> Self {
        Self {
            burn_stream: None,
            host_stream: None,
            workspace: KeptBuffer::default(),
            scratch: KeptScratch::default(),
            graphs: GemmGraphs::default(),
            #[cfg(feature = "internals")]
            calls: CallCounts::default(),
        }
    }

    /// burn's stream of this lane's cubecl stream, probed once, or why it is unknown.
    pub fn burn_stream(&mut self, client: &Client) -> std::result::Result<sys::CUstream, &str> {
        let found = self.burn_stream.get_or_insert_with(|| {
            probe_burn_stream(client)
                .map(|s| s as usize)
                .map_err(|e| e.to_string())
        });
        match found {
            Ok(stream) => Ok(*stream as sys::CUstream),
            Err(why) => Err(why),
        }
    }

    /// The design this lane's GEMMs use under `mode`: `mode` itself, or `Host` with the
    /// reason when `Stream` was asked for but burn's stream could not be found.
    pub fn ordering(&mut self, client: &Client, mode: SyncMode) -> (SyncMode, Option<String>) {
        if mode != SyncMode::Stream {
            return (mode, None);
        }
        match self.burn_stream(client) {
            Ok(_) => (mode, None),
            Err(why) => (SyncMode::Host, Some(why.to_string())),
        }
    }

    /// The lane's stream of ours (created in `context` on first use), for host-ordered work.
    pub fn host_stream(&mut self, context: &Context) -> Result<Arc<OwnedStream>> {
        if let Some(stream) = &self.host_stream {
            return Ok(stream.clone());
        }
        context.make_current()?;
        let stream = Arc::new(OwnedStream(create_stream()?));
        self.host_stream = Some(stream.clone());
        Ok(stream)
    }

    /// A GEMM workspace of at least `bytes`, kept and reused across calls. (A replaced
    /// buffer may still be in use by a queued GEMM: only burn's stream can reuse it after
    /// its handle drops, and both designs keep burn's stream behind the GEMM: same stream,
    /// or host sync.)
    pub fn workspace(&mut self, client: &Client, bytes: usize) -> Result<u64> {
        Ok(self.workspace.at_least(client, bytes)?.1)
    }
}

/// The lanes of one device, by cubecl stream, with what every lane's work needs of the
/// device: its context and cubecl's device thread.
pub struct Lanes {
    device_index: usize,
    context: Context,
    device_thread: DeviceHandle<Server>,
    pub(super) lanes: HashMap<StreamId, Lane>,
    /// Lanes of ended threads, freed at the next lookup.
    retired: Vec<Lane>,
    /// How many lanes were retired so far, and their GEMM calls (reports sum every call).
    #[cfg(feature = "internals")]
    pub(super) retired_count: usize,
    #[cfg(feature = "internals")]
    pub(super) retired_calls: CallCounts,
}

impl Lanes {
    fn new(device_index: usize) -> Result<Self> {
        let context = Context::retain(cuda_device(device_index)?)?;
        let device = CudaDevice {
            index: device_index,
        };
        // The client first: it makes sure the device's runner is cubecl-cuda's own before
        // the handle attaches to it.
        let _client = Runtime::client(&device);
        Ok(Self {
            device_index,
            context,
            device_thread: DeviceHandle::new(device.to_id()),
            lanes: HashMap::new(),
            retired: Vec::new(),
            #[cfg(feature = "internals")]
            retired_count: 0,
            #[cfg(feature = "internals")]
            retired_calls: CallCounts::default(),
        })
    }

    /// The device's primary context.
    pub fn context(&self) -> Context {
        self.context
    }

    /// cubecl's device thread of this device (its task queue).
    pub fn device_thread(&self) -> &DeviceHandle<Server> {
        &self.device_thread
    }

    /// The lane of the current cubecl stream, created on first use (and retired when this
    /// thread ends).
    pub fn current(&mut self) -> &mut Lane {
        self.current_and_device_thread().0
    }

    /// [`current`](Self::current), and the device thread its queued work goes to.
    pub fn current_and_device_thread(&mut self) -> (&mut Lane, &DeviceHandle<Server>) {
        self.free_retired();
        let stream = StreamId::current();
        let lane = match self.lanes.entry(stream) {
            Entry::Occupied(lane) => lane.into_mut(),
            Entry::Vacant(slot) => {
                let device = self.device_index;
                at_thread_exit(move || retire_lane(device, stream));
                slot.insert(Lane::new())
            }
        };
        (lane, &self.device_thread)
    }

    /// Takes `stream`'s lane out of use: its thread ended. Only moves it (this runs in a
    /// thread-local destructor); the next [`current`](Self::current) frees it.
    pub fn retire(&mut self, stream: StreamId) {
        if let Some(lane) = self.lanes.remove(&stream) {
            #[cfg(feature = "internals")]
            {
                self.retired_count += 1;
                self.retired_calls += lane.calls;
            }
            self.retired.push(lane);
        }
    }

    /// Frees the retired lanes: buffers here (cubecl releases them in stream order), streams
    /// with their last holder (CUDA releases them once their work is done), graphs on
    /// cubecl's device thread behind every task queued so far.
    fn free_retired(&mut self) {
        for mut lane in self.retired.drain(..) {
            let graphs = std::mem::take(&mut lane.graphs);
            self.device_thread
                .submit(move |_server: &mut Server| drop(graphs));
        }
    }
}

/// Every device's lanes.
static LANES: PerDevice<Mutex<Lanes>> = PerDevice::new();

/// The lanes of CUDA device `index`, created on first use (its cubecl client must exist:
/// it does once a tensor lives on the device).
pub fn lanes(index: usize) -> Result<Arc<Mutex<Lanes>>> {
    LANES.get_or_try_init(index, || Lanes::new(index).map(Mutex::new))
}

/// Retires `stream`'s lane on device `index` (its thread ended; [`Lanes::retire`]). Runs in
/// a thread-local destructor: it only takes the two locks and moves the lane.
fn retire_lane(index: usize, stream: StreamId) {
    if let Some(lanes) = LANES.get(index) {
        lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retire(stream);
    }
}
