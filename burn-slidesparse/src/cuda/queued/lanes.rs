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
    burn_stream: Option<std::result::Result<usize, String>>,
    /// A stream of ours for host-ordered work, created on first use.
    host_stream: Option<Arc<OwnedStream>>,
    workspace: KeptBuffer,
    /// The intermediate buffers of decode-sized forwards, kept across calls.
    pub scratch: KeptScratch,
    /// GEMM calls on kept buffers, replayed as CUDA graphs.
    pub graphs: GemmGraphs,
    /// How this lane's GEMM calls ran, for reports.
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

/// How a lane's GEMM calls ran: the ways differ by an order of magnitude in host time at
/// decode (a queued replay costs the caller ~3 us, a blocking call ~15-25 us), so a model
/// that is slower than its layers predict shows which way its calls took here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Replays of a captured graph queued on cubecl's device thread without waiting.
    pub queued: usize,
    /// Calls the caller waited for on cubecl's device thread, with a graph key (a replay
    /// while graphs are blocking, or the call that captures a graph).
    pub blocking_keyed: usize,
    /// Calls the caller waited for without a graph key (graphs off, or buffers not kept:
    /// a prompt-sized forward).
    pub blocking_unkeyed: usize,
    /// Calls ordered by host synchronization (`SyncMode::Host`).
    pub host_synced: usize,
}

impl std::ops::AddAssign for CallCounts {
    fn add_assign(&mut self, other: Self) {
        self.queued += other.queued;
        self.blocking_keyed += other.blocking_keyed;
        self.blocking_unkeyed += other.blocking_unkeyed;
        self.host_synced += other.host_synced;
    }
}

/// The lanes of one device, by cubecl stream, with what every lane's work needs of the
/// device: its context and cubecl's device thread.
pub struct Lanes {
    device_index: usize,
    context: Context,
    device_thread: DeviceHandle<Server>,
    lanes: HashMap<StreamId, Lane>,
    /// Lanes of ended threads, freed at the next lookup.
    retired: Vec<Lane>,
    /// How many lanes were retired so far, and their GEMM calls (reports sum every call).
    retired_count: usize,
    retired_calls: CallCounts,
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
            retired_count: 0,
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
            self.retired_count += 1;
            self.retired_calls += lane.calls;
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

    /// The GEMM graphs of every lane, summed (for reports).
    pub fn graph_report(&self) -> GraphReport {
        let mut report = GraphReport {
            lanes: self.lanes.len(),
            retired: self.retired_count,
            calls: self.retired_calls,
            ..GraphReport::default()
        };
        for lane in self.lanes.values() {
            let graphs = &lane.graphs;
            report.calls += lane.calls;
            report.captured += graphs.captured();
            report.failed += graphs.failed();
            report.clears += graphs.clears();
            report.nodes += graphs.nodes();
            if let Some(why) = graphs.last_failure() {
                report.last_failure = Some(why.to_string());
            }
            if let Some(Err(why)) = &lane.burn_stream {
                report.host_reason = Some(why.clone());
            }
        }
        report
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

/// What a device's lanes hold of captured GEMM graphs, and how their GEMM calls ran: failed
/// captures (those calls run directly, through a host round trip, until the next table
/// clear retries them), a table that keeps filling up (recaptures), and calls that never
/// use graphs (graphs off, buffers not kept) show here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphReport {
    /// Lanes (cubecl streams that ran work of ours on the device) in use.
    pub lanes: usize,
    /// Lanes retired with the threads that made them (their calls are in `calls`).
    pub retired: usize,
    /// Calls with a captured graph.
    pub captured: usize,
    /// The nodes of those graphs, summed.
    pub nodes: usize,
    /// Calls whose capture failed (run directly).
    pub failed: usize,
    /// Times a lane's table filled up and dropped every graph.
    pub clears: usize,
    /// Why a capture failed on some lane, if one did.
    pub last_failure: Option<String>,
    /// How the GEMM calls of every lane ran, summed.
    pub calls: CallCounts,
    /// Why some lane's work falls back to host synchronization (burn's stream not found),
    /// if one does.
    pub host_reason: Option<String>,
}

impl std::fmt::Display for GraphReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} lanes ({} more retired with their threads), {} graphs captured ({} nodes), {} \
             captures failed, {} table clears; GEMM calls: {} queued, {} blocking with a graph \
             key, {} blocking without, {} host-synchronized",
            self.lanes,
            self.retired,
            self.captured,
            self.nodes,
            self.failed,
            self.clears,
            self.calls.queued,
            self.calls.blocking_keyed,
            self.calls.blocking_unkeyed,
            self.calls.host_synced
        )?;
        if let Some(why) = &self.last_failure {
            write!(f, " (last failure: {why})")?;
        }
        if let Some(why) = &self.host_reason {
            write!(f, " (host-synchronized because {why})")?;
        }
        Ok(())
    }
}
