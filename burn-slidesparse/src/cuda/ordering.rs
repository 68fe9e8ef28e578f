//! Ordering a library GEMM (cuSPARSELt, cuBLASLt) with burn's kernels on cubecl's stream.
//!
//! cubecl-cuda 0.10 launches on a private stream per burn thread, from a device thread that
//! executes the launches queued by `ComputeClient` in order. Three designs keep the GEMM
//! between the quantization kernel and the epilogue:
//!
//! - [`SyncMode::Stream`] (default, no host synchronization): the GEMM is enqueued on
//!   **burn's own stream**. The stream handle is found once per burn thread by watching one
//!   probe launch through CUPTI (`cupti.rs`), and the GEMM call runs inside
//!   `ComputeClient::exclusive`, i.e. on cubecl's device thread after every launch queued
//!   before it, so the stream's FIFO order is exactly the program order: quantization, GEMM,
//!   epilogue. Buffers are freed and reused in the same stream order, so nothing can be
//!   overwritten while the GEMM reads it. If CUPTI is unavailable the lane falls back to
//!   `Host` and says why ([`Lane::ordering`]).
//! - [`SyncMode::Host`]: `client.sync()` before the GEMM on our stream and
//!   `cuStreamSynchronize` after. Correct anywhere, ~0.1 ms per layer at decode.
//! - [`SyncMode::Flags`] (opt-in, experimental): a CubeCL kernel stores an epoch into a flag
//!   after the quantization; an NVRTC spin kernel on our stream waits for it, the GEMM runs,
//!   a store kernel writes the epoch into a second flag, and a CubeCL kernel on burn's stream
//!   spins until it sees it. A wait that exceeds its spin budget records a timeout and turns
//!   the output into NaN (reported by [`Lanes::check_timeouts`]) instead of hanging. Not the
//!   default: the spinning kernel on burn's stream holds an SM slot while the GEMM runs, and
//!   GEMM kernels that need all their CTAs resident (persistent, stream-K) then cannot start
//!   until the spin gives up (multi-second stalls measured on Llama-sized layers).
//!
//! Each burn thread gets its own lane (stream, flags, epoch, workspace), because each burn
//! thread has its own cubecl stream and epochs must increase monotonically per stream.

use std::{
    collections::{HashMap, hash_map::Entry},
    thread::ThreadId,
};

use cubecl::{CubeCount, CubeDim, prelude::*, server::Handle};
use cubecl_kernels::stream_sync::{signal_kernel, wait_kernel};
use cudarc::driver::{result as cu, sys};

use super::{
    backend::{Runtime, ptr, sync_burn_stream},
    device_thread::{GraphLauncher, on_burn_stream},
    graphs::{GemmGraphs, Replay},
    scratch::{ForwardBuffer, KeptBuffer, KeptScratch},
    side_kernels::SideKernels,
    state::driver_err,
};
use crate::error::{Result, SlideSparseError};

type Client = ComputeClient<Runtime>;

/// How the GEMM is ordered with burn's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// The GEMM on burn's own stream (found through CUPTI), no synchronization (default).
    Stream,
    /// Device-side flags, no host synchronization. Experimental: correct (bit-identical to
    /// `Host` in the GPU tests) but the spin kernel on burn's stream can keep a persistent
    /// (all-SMs co-resident) GEMM kernel from being scheduled until the spin times out; the
    /// layer benchmark saw multi-second stalls on Llama-sized layers. Opt in with
    /// `SLIDESPARSE_SYNC=flags`.
    Flags,
    /// Host synchronizations before and after the GEMM (correct anywhere; the fallback).
    Host,
}

impl SyncMode {
    /// From `SLIDESPARSE_SYNC` (`stream`, `host` or `flags`), default `stream`.
    pub fn from_env() -> Self {
        match std::env::var("SLIDESPARSE_SYNC").as_deref() {
            Ok("flags") => SyncMode::Flags,
            Ok("host") => SyncMode::Host,
            _ => SyncMode::Stream,
        }
    }
}

/// Polls of the wait kernel before it declares a timeout (seconds on an H200).
pub(crate) const MAX_SPINS: u32 = 1 << 26;

/// The device flags of the `Flags` design (zeroed when made).
struct Flags {
    ready: Handle,
    ready_ptr: u64,
    done: Handle,
    done_ptr: u64,
    timed_out: Handle,
    timed_out_ptr: u64,
}

impl Flags {
    fn new(client: &Client) -> Result<Self> {
        let ready = client.create_from_slice(&[0; 4]);
        let done = client.create_from_slice(&[0; 4]);
        let timed_out = client.create_from_slice(&[0; 4]);
        let (ready_ptr, done_ptr, timed_out_ptr) = (
            ptr(client, &ready)?,
            ptr(client, &done)?,
            ptr(client, &timed_out)?,
        );
        // The flags must hold their zeros before our stream ever waits on them.
        sync_burn_stream(client)?;
        Ok(Self {
            ready,
            ready_ptr,
            done,
            done_ptr,
            timed_out,
            timed_out_ptr,
        })
    }
}

/// Per-thread stream, flags and reusable workspace.
pub struct Lane {
    pub stream: sys::CUstream,
    flags: Flags,
    epoch: u32,
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
}

impl Lane {
    fn new(client: &Client, device_index: usize) -> Result<Self> {
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(driver_err("cuStreamCreate"))?;
        Ok(Self {
            stream,
            flags: Flags::new(client)?,
            epoch: 0,
            workspace: KeptBuffer::default(),
            scratch: KeptScratch::default(),
            graphs: GemmGraphs::default(),
            launcher: GraphLauncher::new(device_index),
            burn_stream: None,
        })
    }

    /// burn's stream on this thread, probed once.
    pub(crate) fn burn_stream(
        &mut self,
        client: &Client,
    ) -> std::result::Result<sys::CUstream, &str> {
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
    /// drops, and every design keeps burn's stream behind the GEMM: same stream, wait
    /// kernel, or host sync.)
    pub fn workspace(&mut self, client: &Client, bytes: usize) -> Result<u64> {
        Ok(self.workspace.at_least(client, bytes)?.1)
    }

    fn next_epoch(&mut self, client: &Client) -> Result<u32> {
        if self.epoch >= u32::MAX - 1 {
            // Wrap: drain both streams, then start over from fresh zeroed flags.
            sync_burn_stream(client)?;
            // SAFETY: our stream is valid.
            unsafe { cu::stream::synchronize(self.stream) }
                .map_err(driver_err("cuStreamSynchronize"))?;
            self.flags = Flags::new(client)?;
            self.epoch = 0;
        }
        self.epoch += 1;
        Ok(self.epoch)
    }
}

/// The lanes of one device, by burn thread.
pub struct Lanes {
    device_index: usize,
    lanes: HashMap<ThreadId, Lane>,
}

impl Lanes {
    /// The (still empty) lanes of CUDA device `device_index`.
    pub fn new(device_index: usize) -> Self {
        Self {
            device_index,
            lanes: HashMap::new(),
        }
    }

    /// This thread's lane, created on first use.
    pub fn current(&mut self, client: &Client) -> Result<&mut Lane> {
        match self.lanes.entry(std::thread::current().id()) {
            Entry::Occupied(lane) => Ok(lane.into_mut()),
            Entry::Vacant(slot) => Ok(slot.insert(Lane::new(client, self.device_index)?)),
        }
    }

    /// Errors if any wait kernel timed out (reads device flags: synchronizes).
    pub fn check_timeouts(&self, client: &Client) -> Result<()> {
        for lane in self.lanes.values() {
            let bytes = client
                .read_one(lane.flags.timed_out.clone())
                .map_err(|e| SlideSparseError::Backend(format!("reading timeout flag: {e:?}")))?;
            let epoch = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
            if epoch != 0 {
                return Err(SlideSparseError::Backend(format!(
                    "a SlideSparse GEMM did not signal completion in time (epoch {epoch}); its outputs were set to NaN"
                )));
            }
        }
        Ok(())
    }
}

/// Finds the stream cubecl launches on for this thread: one launch of a tiny kernel with the
/// probe grid, watched through CUPTI.
fn probe_burn_stream(client: &Client) -> Result<sys::CUstream> {
    let scratch = client.create_from_slice(&[0; 4]);
    super::cupti::stream_of_probe_launch(|| {
        let [x, y, z] = super::cupti::PROBE_GRID;
        // SAFETY: every cube stores 0 into element 0 of a 4-byte buffer.
        unsafe {
            signal_kernel::launch_unchecked::<Runtime>(
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
            .map_err(|e| SlideSparseError::Backend(format!("cubecl device thread: {e:?}")))
    })
}

/// Runs `enqueue(stream)` (a library call) after everything queued on burn's stream, and
/// makes burn's later work wait for it. `poison` (the forward's token scales) is filled with
/// NaN if a `Flags`-mode completion flag never arrives or a queued replay fails. With a
/// graph key (every pointer of the call is stable, see `graphs.rs`) the call is replayed
/// from a CUDA graph captured once; in `Stream` mode with `replay.queued`, a graph already
/// captured is launched from cubecl's queue without waiting (`device_thread.rs`).
pub fn run_ordered(
    client: &Client,
    lane: &mut Lane,
    side: &SideKernels,
    mode: SyncMode,
    poison: (&ForwardBuffer, usize),
    replay: Replay,
    enqueue: impl FnMut(sys::CUstream) -> Result<()>,
) -> Result<()> {
    lane.launcher.take_failure()?;
    let (mode, _fallback_reason) = lane.ordering(client, mode);
    if mode == SyncMode::Stream && replay.queued {
        let burn_stream = lane.burn_stream(client).expect("checked by `ordering`");
        let captured = replay.key.and_then(|key| lane.graphs.captured_exec(&key));
        if let (Some(exec), Some(poison_ptr)) = (captured, poison.0.kept_ptr) {
            // SAFETY: a live graph, destroyed only after every task queued before the
            // destruction has run (`device_thread.rs`); the token scales are a kept buffer
            // of `poison.1` f32 values.
            unsafe {
                lane.launcher
                    .queue(exec, burn_stream, (poison_ptr, poison.1))
            };
            return Ok(());
        }
    }
    let graph = replay.key;
    // Per-mode lane state, taken before `call` borrows the lane's graphs.
    let (burn_stream, epoch) = match mode {
        SyncMode::Stream => (lane.burn_stream(client).ok(), 0),
        SyncMode::Flags => (None, lane.next_epoch(client)?),
        SyncMode::Host => (None, 0),
    };
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
    match mode {
        SyncMode::Stream => {
            on_burn_stream(client, burn_stream.expect("checked by `ordering`"), call)
        }
        SyncMode::Host => {
            sync_burn_stream(client)?;
            call(lane.stream)?;
            // SAFETY: our stream is valid.
            unsafe { cu::stream::synchronize(lane.stream) }
                .map_err(driver_err("cuStreamSynchronize"))
        }
        SyncMode::Flags => {
            let one = CubeCount::Static(1, 1, 1);
            // SAFETY: each flag handle holds one u32; the kernels touch only element 0 (and
            // `poison_len` elements of `poison`, which has at least that many).
            unsafe {
                signal_kernel::launch_unchecked::<Runtime>(
                    client,
                    one.clone(),
                    CubeDim::new_1d(1),
                    ArrayArg::from_raw_parts(lane.flags.ready.clone(), 1),
                    epoch,
                );
            }
            // No flush needed: cubecl submits burn's stream in order, so the signal kernel
            // is submitted before the wait kernel that depends on our stream.
            // SAFETY: the flag pointers are live cubecl allocations held by the lane.
            unsafe {
                side.wait(
                    lane.stream,
                    lane.flags.ready_ptr,
                    epoch,
                    lane.flags.timed_out_ptr,
                    MAX_SPINS,
                )?
            };
            call(lane.stream)?;
            // SAFETY: as above.
            unsafe { side.signal(lane.stream, lane.flags.done_ptr, epoch)? };
            // SAFETY: as above.
            unsafe {
                wait_kernel::launch_unchecked::<Runtime>(
                    client,
                    one,
                    CubeDim::new_1d(1),
                    ArrayArg::from_raw_parts(lane.flags.done.clone(), 1),
                    ArrayArg::from_raw_parts(lane.flags.timed_out.clone(), 1),
                    ArrayArg::from_raw_parts(poison.0.handle.clone(), poison.1),
                    epoch,
                    MAX_SPINS,
                    poison.1 as u32,
                    f32::NAN,
                );
            }
            Ok(())
        }
    }
}
