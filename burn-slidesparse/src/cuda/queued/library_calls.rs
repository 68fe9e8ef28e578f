//! A library call (a GEMM of cuSPARSELt or cuBLASLt) ordered with burn's kernels on cubecl's
//! stream.
//!
//! Two designs keep the GEMM between the quantization kernel and the epilogue
//! (`docs/decisions/` says why these two):
//!
//! - [`SyncMode::Stream`] (default, no host synchronization): the GEMM is enqueued on
//!   **burn's own stream**. The stream handle is found once per lane by watching one probe
//!   launch through CUPTI (`cupti.rs`), and the GEMM call runs on cubecl's device thread
//!   after every launch queued before it (`device_thread.rs`), so the stream's FIFO order is
//!   exactly the program order: quantization, GEMM, epilogue. Buffers are freed and reused
//!   in the same stream order, so nothing can be overwritten while the GEMM reads it. If
//!   CUPTI is unavailable the lane falls back to `Host` and says why ([`Lane::ordering`]).
//! - [`SyncMode::Host`]: `client.sync()` before the GEMM on the lane's stream and
//!   `cuStreamSynchronize` after. Correct anywhere, ~0.1 ms per layer at decode.
//!
//! A call whose pointers are all stable (kept buffers, `graphs.rs`) is captured once as a
//! CUDA graph and replayed; in `Stream` mode a captured graph's launch is queued on the
//! device thread without waiting.

use std::sync::Arc;

use cubecl::{CubeCount, CubeDim, prelude::*};
use cubecl_kernels::stream_probe::probe_kernel;
use cudarc::driver::sys;

use super::{
    super::{
        buffers::ForwardBuffer,
        config::SyncMode,
        cupti::{PROBE_GRID, stream_of_probe_launch},
        driver::synchronize,
        graphs::Replay,
        runtime::{Client, Runtime, cubecl_err, sync_burn_stream},
    },
    device_thread::{on_burn_stream, queue_graph_launch},
    lanes::{Lanes, OwnedStream},
};
use crate::error::Result;

/// Finds the stream cubecl launches on for the current cubecl stream: one launch of a tiny
/// kernel with the probe grid, watched through CUPTI.
pub fn probe_burn_stream(client: &Client) -> Result<sys::CUstream> {
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
/// makes burn's later work wait for it, on the current cubecl stream's lane of `lanes`. With
/// a graph key (every pointer of the call is stable, see `graphs.rs`) the call is replayed
/// from a CUDA graph captured once; in `Stream` mode with `replay.queued`, a graph already
/// captured is launched from cubecl's queue without waiting (`device_thread.rs`), and
/// `poison` (the forward's token scales, a kept buffer of `poison.1` f32) is NaN-filled if
/// that launch fails.
pub fn run_ordered(
    client: &Client,
    lanes: &mut Lanes,
    mode: SyncMode,
    poison: (&ForwardBuffer, usize),
    replay: Replay,
    enqueue: impl FnMut(sys::CUstream) -> Result<()>,
) -> Result<()> {
    let context = lanes.context();
    let (lane, device_thread) = lanes.current_and_device_thread();
    let (mode, _fallback_reason) = lane.ordering(client, mode);
    let burn_stream = match mode {
        SyncMode::Stream => Some(lane.burn_stream(client).expect("checked by `ordering`")),
        SyncMode::Host => None,
    };
    if let (Some(burn_stream), true) = (burn_stream, replay.queued) {
        let captured = replay.key.and_then(|key| lane.graphs.captured_exec(&key));
        if let (Some(exec), Some(poison_ptr)) = (captured, poison.0.kept_ptr) {
            let poison = (poison_ptr, poison.1);
            // SAFETY: a live graph, destroyed only after every task queued before the
            // destruction has run (`device_thread.rs`); the token scales are a kept buffer
            // of `poison.1` f32 values.
            unsafe { queue_graph_launch(device_thread, exec, burn_stream, poison) };
            #[cfg(feature = "internals")]
            {
                lane.calls.queued += 1;
            }
            return Ok(());
        }
    }
    let graph = replay.key;
    #[cfg(feature = "internals")]
    {
        let counter = match (burn_stream, graph) {
            (None, _) => &mut lane.calls.host_synced,
            (Some(_), Some(_)) => &mut lane.calls.blocking_keyed,
            (Some(_), None) => &mut lane.calls.blocking_unkeyed,
        };
        *counter += 1;
    }
    let target = match burn_stream {
        Some(stream) => Target::Burn(stream),
        None => Target::Host(lane.host_stream(&context)?),
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
    match target {
        Target::Burn(burn_stream) => on_burn_stream(client, burn_stream, call),
        Target::Host(stream) => {
            sync_burn_stream(client)?;
            context.make_current()?;
            call(stream.raw())?;
            // SAFETY: the lane's stream, alive while `stream` holds it.
            unsafe { synchronize(stream.raw()) }
        }
    }
}

/// Where a library call is enqueued.
enum Target {
    /// burn's stream, from cubecl's device thread.
    Burn(sys::CUstream),
    /// The lane's stream of ours, between host synchronizations.
    Host(Arc<OwnedStream>),
}
