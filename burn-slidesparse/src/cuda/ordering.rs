//! Ordering a library GEMM (cuSPARSELt, cuBLASLt) with burn's kernels on cubecl's stream.
//!
//! cubecl-cuda 0.10 launches on a private stream per burn thread, from a device thread that
//! executes the launches queued by `ComputeClient` in order. Two designs keep the GEMM
//! between the quantization kernel and the epilogue (`docs/decisions/` says why these two):
//!
//! - [`SyncMode::Stream`] (default, no host synchronization): the GEMM is enqueued on
//!   **burn's own stream**. The stream handle is found once per burn thread by watching one
//!   probe launch through CUPTI (`cupti.rs`), and the GEMM call runs on cubecl's device
//!   thread after every launch queued before it (`device_thread.rs`), so the stream's FIFO
//!   order is exactly the program order: quantization, GEMM, epilogue. Buffers are freed and
//!   reused in the same stream order, so nothing can be overwritten while the GEMM reads it.
//!   If CUPTI is unavailable the lane falls back to `Host` and says why ([`Lane::ordering`]).
//! - [`SyncMode::Host`]: `client.sync()` before the GEMM on the lane's stream and
//!   `cuStreamSynchronize` after. Correct anywhere, ~0.1 ms per layer at decode.
//!
//! Each cubecl stream gets its own lane (our stream, workspace, kept buffers, graphs). cubecl
//! keys its streams by [`StreamId`]: the calling thread's by default, or the one a caller
//! set for a piece of work (burn's fusion backend runs each queued operation under the
//! `StreamId` of the thread that queued it, possibly on another thread). Lanes are keyed
//! the same way, so a forward run by fusion finds the lane, kept buffers and graphs of the
//! stream its kernels go to, whichever thread executes it.
//!
//! cubecl never reuses a `StreamId`: a thread that ends leaves its lane unused for good. So
//! the thread that creates a lane retires it when it ends ([`Lanes::retire`], through
//! `thread_exit`), and the next lane lookup on the device frees it: the kept
//! buffers through cubecl (in stream order), the graphs on cubecl's device thread after
//! every task queued before (queued replays hold them by pointer). A server that runs
//! forwards on short-lived threads (a pool that ends idle threads, `std::thread::scope`
//! per request) thus holds the lanes of its live threads only. The creator is the owner
//! except where fusion runs another thread's queued operations; there the lane is retired
//! with its creator, and its owner's next forward makes a new one.

use std::collections::{HashMap, hash_map::Entry};

use cubecl::{CubeCount, CubeDim, prelude::*, stream_id::StreamId};
use cubecl_kernels::stream_probe::probe_kernel;
use cudarc::driver::{result as cu, sys};

use super::{
    buffers::{ForwardBuffer, KeptBuffer, KeptScratch},
    config::SyncMode,
    cupti::{PROBE_GRID, stream_of_probe_launch},
    device_thread::{GraphLauncher, on_burn_stream},
    driver::{create_stream, synchronize},
    graphs::{GemmGraphs, Replay},
    runtime::{Client, Runtime, cubecl_err, sync_burn_stream},
    thread_exit::at_thread_exit,
};
use crate::error::Result;

/// Per-thread stream, workspace, kept buffers and graphs.
pub struct Lane {
    /// A stream of ours for the `Host` design.
    pub stream: sys::CUstream,
    workspace: KeptBuffer,
    /// The intermediate buffers of decode-sized forwards, kept across calls.
    pub scratch: KeptScratch,
    /// GEMM calls on kept buffers, replayed as CUDA graphs.
    pub graphs: GemmGraphs,
    /// Queues replays of captured graphs on cubecl's device thread without waiting.
    launcher: GraphLauncher,
    /// burn's stream on this thread (as an integer), or why it could not be found; probed on
    /// the first `Stream`-mode GEMM.
    burn_stream: Option<std::result::Result<usize, String>>,
    /// How this lane's GEMM calls ran, for reports.
    calls: CallCounts,
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

impl Drop for Lane {
    fn drop(&mut self) {
        // SAFETY: the lane's own stream, destroyed once; work still queued on it completes
        // first (CUDA defers the release).
        let _ = unsafe { cu::stream::destroy(self.stream) };
    }
}

impl Lane {
    fn new(device_index: usize) -> Result<Self> {
        Ok(Self {
            stream: create_stream()?,
            workspace: KeptBuffer::default(),
            scratch: KeptScratch::default(),
            graphs: GemmGraphs::default(),
            launcher: GraphLauncher::new(device_index),
            burn_stream: None,
            calls: CallCounts::default(),
        })
    }

    /// burn's stream on this thread, probed once.
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

    /// A workspace of at least `bytes`, kept and reused across calls. (A replaced buffer may
    /// still be in use by a queued GEMM: only burn's stream can reuse it after its handle
    /// drops, and both designs keep burn's stream behind the GEMM: same stream, or host
    /// sync.)
    pub fn workspace(&mut self, client: &Client, bytes: usize) -> Result<u64> {
        Ok(self.workspace.at_least(client, bytes)?.1)
    }
}

/// Retires the lane of a cubecl stream on a CUDA device: given by the per-device state
/// (which finds the device's [`Lanes`] behind its lock), called when the thread that created
/// the lane ends.
pub type RetireLane = fn(device_index: usize, stream: StreamId);

/// The lanes of one device, by cubecl stream.
pub struct Lanes {
    device_index: usize,
    lanes: HashMap<StreamId, Lane>,
    retire: RetireLane,
    /// Lanes of ended threads, freed at the next lookup.
    retired: Vec<Lane>,
    /// How many lanes were retired so far, and their GEMM calls (reports sum every call).
    retired_count: usize,
    retired_calls: CallCounts,
}

impl Lanes {
    /// The (still empty) lanes of CUDA device `device_index`; `retire` finds them again when
    /// a thread that created one ends.
    pub fn new(device_index: usize, retire: RetireLane) -> Self {
        Self {
            device_index,
            lanes: HashMap::new(),
            retire,
            retired: Vec::new(),
            retired_count: 0,
            retired_calls: CallCounts::default(),
        }
    }

    /// The lane of the current cubecl stream, created on first use (and retired when this
    /// thread ends).
    pub fn current(&mut self) -> Result<&mut Lane> {
        self.free_retired();
        let stream = StreamId::current();
        match self.lanes.entry(stream) {
            Entry::Occupied(lane) => Ok(lane.into_mut()),
            Entry::Vacant(slot) => {
                let lane = slot.insert(Lane::new(self.device_index)?);
                let (device, retire) = (self.device_index, self.retire);
                at_thread_exit(move || retire(device, stream));
                Ok(lane)
            }
        }
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

    /// Frees the retired lanes: buffers and streams here (cubecl and CUDA release them in
    /// stream order), graphs on cubecl's device thread behind every task queued so far.
    fn free_retired(&mut self) {
        for mut lane in self.retired.drain(..) {
            let graphs = std::mem::take(&mut lane.graphs);
            lane.launcher.drop_after_queued(graphs);
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

/// What a device's lanes hold of captured GEMM graphs, and how their GEMM calls ran: failed
/// captures (those calls run directly, through a host round trip, until the next table
/// clear retries them), a table that keeps filling up (recaptures), and calls that never
/// use graphs (graphs off, buffers not kept) show here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphReport {
    /// Lanes (cubecl streams that ran a forward) in use.
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
    /// Why some lane's GEMMs fall back to host synchronization (burn's stream not found),
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

/// Finds the stream cubecl launches on for this thread: one launch of a tiny kernel with the
/// probe grid, watched through CUPTI.
pub(crate) fn probe_burn_stream(client: &Client) -> Result<sys::CUstream> {
    let scratch = client.create_from_slice(&[0; 4]);
    stream_of_probe_launch(|| {
        let [x, y, z] = PROBE_GRID;
        // SAFETY: every cube stores 0 into element 0 of a 4-byte buffer.
        unsafe {
            probe_kernel::launch_unchecked::<Runtime>(
                client,
                CubeCount::Static(x, y, z),
                CubeDim::new_1d(1),
                ArrayArg::from_raw_parts(scratch.clone(), 1),
                0,
            );
        }
        // Launches are issued in order by cubecl's device thread: once a task queued after
        // the probe has run there, the probe's `cuLaunchKernel` has happened.
        client
            .exclusive(|| ())
            .map_err(|e| cubecl_err("exclusive (device thread)")(&e))
    })
}

/// Runs `enqueue(stream)` (a library call) after everything queued on burn's stream, and
/// makes burn's later work wait for it. With a graph key (every pointer of the call is
/// stable, see `graphs.rs`) the call is replayed from a CUDA graph captured once; in
/// `Stream` mode with `replay.queued`, a graph already captured is launched from cubecl's
/// queue without waiting (`device_thread.rs`), and `poison` (the forward's token scales, a
/// kept buffer of `poison.1` f32) is NaN-filled if that launch fails.
pub fn run_ordered(
    client: &Client,
    lane: &mut Lane,
    mode: SyncMode,
    poison: (&ForwardBuffer, usize),
    replay: Replay,
    enqueue: impl FnMut(sys::CUstream) -> Result<()>,
) -> Result<()> {
    lane.launcher.take_failure()?;
    let (mode, _fallback_reason) = lane.ordering(client, mode);
    let burn_stream = match mode {
        SyncMode::Stream => Some(lane.burn_stream(client).expect("checked by `ordering`")),
        SyncMode::Host => None,
    };
    if let (Some(burn_stream), true) = (burn_stream, replay.queued) {
        let captured = replay.key.and_then(|key| lane.graphs.captured_exec(&key));
        if let (Some(exec), Some(poison_ptr)) = (captured, poison.0.kept_ptr) {
            // SAFETY: a live graph, destroyed only after every task queued before the
            // destruction has run (`device_thread.rs`); the token scales are a kept buffer
            // of `poison.1` f32 values.
            unsafe {
                lane.launcher
                    .queue(exec, burn_stream, (poison_ptr, poison.1))
            };
            lane.calls.queued += 1;
            return Ok(());
        }
    }
    let graph = replay.key;
    let counter = match (burn_stream, graph) {
        (None, _) => &mut lane.calls.host_synced,
        (Some(_), Some(_)) => &mut lane.calls.blocking_keyed,
        (Some(_), None) => &mut lane.calls.blocking_unkeyed,
    };
    *counter += 1;
    let graphs = &mut lane.graphs;
    let call = move |stream: sys::CUstream| match graph {
        // SAFETY: the key holds every pointer of the call (the caller's contract); the
        // context is current on the calling thread (cubecl's device thread in `Stream`
        // mode, the caller's otherwise).
        Some(key) => unsafe { graphs.run(key, stream, enqueue) },
        None => {
            let mut enqueue = enqueue;
            enqueue(stream)
        }
    };
    match burn_stream {
        Some(burn_stream) => on_burn_stream(client, burn_stream, call),
        None => {
            sync_burn_stream(client)?;
            call(lane.stream)?;
            // SAFETY: the lane's stream is live.
            unsafe { synchronize(lane.stream) }
        }
    }
}
