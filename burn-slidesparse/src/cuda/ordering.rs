//! Ordering a library GEMM on our CUDA stream with burn's kernels on cubecl's stream.
//!
//! cubecl-cuda 0.10 launches on a private per-thread stream. Two designs keep the GEMM
//! between the quantization kernel and the epilogue (both on that stream):
//!
//! - [`SyncMode::Flags`] (opt-in, no host synchronization): a CubeCL kernel stores an epoch
//!   into a flag after the quantization; a spin kernel on our stream waits for it, the GEMM
//!   runs, and a store kernel writes the epoch into a second flag (both side kernels are
//!   NVRTC-compiled, `side_kernels.rs`: the driver's `cuStreamWaitValue32` rejects cubecl's
//!   stream-ordered memory); a CubeCL kernel on burn's stream spins until it sees that
//!   flag, so the epilogue runs after the GEMM. Buffers freed after the forward
//!   are reused only by work queued behind that wait kernel, so they outlive the GEMM. A
//!   wait that exceeds its spin budget records a timeout and turns the output into NaN
//!   (reported by [`check_timeouts`]) instead of hanging.
//! - [`SyncMode::Host`] (default): `client.sync()` before the GEMM and
//!   `cuStreamSynchronize` after.
//!
//! Why `Flags` is not the default: a spinning kernel on burn's stream holds an SM slot while
//! the GEMM runs; GEMM kernels that need all their CTAs resident at once (persistent,
//! stream-K) then cannot start until the spin gives up. Measured on the H200: stalls of
//! seconds per hundred forwards on Llama-sized layers. A safe no-sync design needs burn's
//! stream itself (to record an event on it), which cubecl-cuda 0.10 does not expose.
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
    side_kernels::SideKernels,
};
use crate::error::{Result, SlideSparseError};

type Client = ComputeClient<Runtime>;

/// How the GEMM stream is ordered with burn's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// Device-side flags, no host synchronization. Experimental: correct (bit-identical to
    /// `Host` in the GPU tests) but the spin kernel on burn's stream can keep a persistent
    /// (all-SMs co-resident) GEMM kernel from being scheduled until the spin times out; the
    /// layer benchmark saw multi-second stalls on Llama-sized layers. Opt in with
    /// `SLIDESPARSE_SYNC=flags`.
    Flags,
    /// Host synchronizations before and after the GEMM (default).
    Host,
}

impl SyncMode {
    /// From `SLIDESPARSE_SYNC` (`host` or `flags`), default `host`.
    pub fn from_env() -> Self {
        match std::env::var("SLIDESPARSE_SYNC").as_deref() {
            Ok("flags") => SyncMode::Flags,
            _ => SyncMode::Host,
        }
    }
}

/// Polls of the wait kernel before it declares a timeout (seconds on an H200).
const MAX_SPINS: u32 = 1 << 26;

/// Per-thread stream, flags and reusable workspace.
pub struct Lane {
    pub stream: sys::CUstream,
    ready: Handle,
    ready_ptr: u64,
    done: Handle,
    done_ptr: u64,
    timed_out: Handle,
    timed_out_ptr: u64,
    epoch: u32,
    workspace: Option<(Handle, u64, usize)>,
}

fn driver(what: &'static str) -> impl Fn(cu::DriverError) -> SlideSparseError {
    move |e| SlideSparseError::Backend(format!("CUDA driver: {what}: {e:?}"))
}

impl Lane {
    fn new(client: &Client) -> Result<Self> {
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(driver("cuStreamCreate"))?;
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
            stream,
            ready,
            ready_ptr,
            done,
            done_ptr,
            timed_out,
            timed_out_ptr,
            epoch: 0,
            workspace: None,
        })
    }

    /// A workspace of at least `bytes`, kept and reused across calls.
    pub fn workspace(&mut self, client: &Client, bytes: usize) -> Result<u64> {
        match &self.workspace {
            Some((_, p, size)) if *size >= bytes => Ok(*p),
            _ => {
                let handle = client.empty(bytes.max(256));
                let p = ptr(client, &handle)?;
                // The old buffer may still be in use by a queued GEMM: only burn's stream
                // (ordered behind the wait kernels) can reuse it after this handle drops.
                self.workspace = Some((handle, p, bytes.max(256)));
                Ok(p)
            }
        }
    }

    fn next_epoch(&mut self, client: &Client) -> Result<u32> {
        if self.epoch >= u32::MAX - 1 {
            // Wrap: drain both streams, then start over from fresh zeroed flags.
            sync_burn_stream(client)?;
            // SAFETY: our stream is valid.
            unsafe { cu::stream::synchronize(self.stream) }
                .map_err(driver("cuStreamSynchronize"))?;
            *self = Lane {
                stream: self.stream,
                workspace: self.workspace.take(),
                ..Lane::new(client)?
            };
        }
        self.epoch += 1;
        Ok(self.epoch)
    }
}

/// The lanes of one device, by burn thread.
#[derive(Default)]
pub struct Lanes {
    lanes: HashMap<ThreadId, Lane>,
}

impl Lanes {
    /// This thread's lane, created on first use.
    pub fn current(&mut self, client: &Client) -> Result<&mut Lane> {
        match self.lanes.entry(std::thread::current().id()) {
            Entry::Occupied(lane) => Ok(lane.into_mut()),
            Entry::Vacant(slot) => Ok(slot.insert(Lane::new(client)?)),
        }
    }

    /// Errors if any wait kernel timed out (reads device flags: synchronizes).
    pub fn check_timeouts(&self, client: &Client) -> Result<()> {
        for lane in self.lanes.values() {
            let bytes = client
                .read_one(lane.timed_out.clone())
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

/// Runs `enqueue(stream)` (a library call on our stream) after everything queued on burn's
/// stream, and makes burn's later work wait for it. `poison` (e.g. the token scales) is
/// filled with NaN if the completion flag never arrives.
pub fn run_ordered(
    client: &Client,
    lane: &mut Lane,
    side: &SideKernels,
    mode: SyncMode,
    poison: (&Handle, usize),
    enqueue: impl FnOnce(sys::CUstream) -> Result<()>,
) -> Result<()> {
    match mode {
        SyncMode::Host => {
            sync_burn_stream(client)?;
            enqueue(lane.stream)?;
            // SAFETY: our stream is valid.
            unsafe { cu::stream::synchronize(lane.stream) }.map_err(driver("cuStreamSynchronize"))
        }
        SyncMode::Flags => {
            let epoch = lane.next_epoch(client)?;
            let one = CubeCount::Static(1, 1, 1);
            // SAFETY: each flag handle holds one u32; the kernels touch only element 0 (and
            // `poison_len` elements of `poison`, which has at least that many).
            unsafe {
                signal_kernel::launch_unchecked::<Runtime>(
                    client,
                    one.clone(),
                    CubeDim::new_1d(1),
                    ArrayArg::from_raw_parts(lane.ready.clone(), 1),
                    epoch,
                );
            }
            // No flush needed: cubecl submits burn's stream in order, so the signal kernel
            // is submitted before the wait kernel that depends on our stream.
            // SAFETY: the flag pointers are live cubecl allocations held by the lane.
            unsafe {
                side.wait(
                    lane.stream,
                    lane.ready_ptr,
                    epoch,
                    lane.timed_out_ptr,
                    MAX_SPINS,
                )?
            };
            enqueue(lane.stream)?;
            // SAFETY: as above.
            unsafe { side.signal(lane.stream, lane.done_ptr, epoch)? };
            // SAFETY: as above.
            unsafe {
                wait_kernel::launch_unchecked::<Runtime>(
                    client,
                    one,
                    CubeDim::new_1d(1),
                    ArrayArg::from_raw_parts(lane.done.clone(), 1),
                    ArrayArg::from_raw_parts(lane.timed_out.clone(), 1),
                    ArrayArg::from_raw_parts(poison.0.clone(), poison.1),
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
