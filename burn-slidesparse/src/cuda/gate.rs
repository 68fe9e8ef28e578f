//! A gate on burn's stream, for measuring how long queued work takes on the device alone.
//!
//! At decode sizes the host enqueues a forward more slowly than the GPU runs it, so the wall
//! time of forwards run back to back measures the host. To see the device's share (what the
//! same forwards cost once the host work is out of the way, e.g. replayed as one graph per
//! decoder step), a benchmark closes the gate (a spin kernel on burn's stream that waits for
//! a flag), enqueues the work, and opens the gate from another stream: the GPU then runs the
//! whole queue back to back, and CUDA events recorded on burn's stream right after the spin
//! and after the work time it.
//!
//! The spin gives up after a few seconds (`MAX_SPINS` polls): if the enqueued work needed
//! the device to make progress (a host synchronization, a full launch queue), the gate
//! reports an error instead of hanging.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys};

use super::{
    driver::driver_err,
    queued::{Lanes, on_burn_stream},
    runtime::Client,
    side_kernels::SideKernels,
    state::{DeviceState, device_state},
};
use crate::error::{Result, SlideSparseError};

/// Polls of the spin kernel before it gives up (seconds on an H200).
pub const MAX_SPINS: u32 = 1 << 26;

fn gate_err(why: impl Into<String>) -> SlideSparseError {
    SlideSparseError::Unsupported {
        what: "stream gate".into(),
        why: why.into(),
    }
}

/// The gate of this thread's burn stream on one device (see the module docs).
pub struct StreamGate {
    state: Arc<Mutex<DeviceState>>,
    side: SideKernels,
    /// The flag the spin kernel waits on; the epoch of the last opening.
    flag: sys::CUdeviceptr,
    /// Where a spin that gave up records its epoch (0 while none has).
    timed_out: sys::CUdeviceptr,
    epoch: u32,
    /// Polls before the spin gives up.
    max_spins: u32,
    start: sys::CUevent,
    end: sys::CUevent,
}

impl StreamGate {
    /// A gate for device `index` (opened: nothing waits on it yet) whose spin gives up
    /// after a few seconds.
    pub fn new(index: usize) -> Result<Self> {
        Self::with_spin_budget(index, MAX_SPINS)
    }

    /// A gate whose spin gives up after `max_spins` polls (~0.1-1 us each).
    pub fn with_spin_budget(index: usize, max_spins: u32) -> Result<Self> {
        let state = device_state(index)?;
        state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .make_current()?;
        let side = SideKernels::new(index)?;
        // SAFETY: the device's context is current; both allocations are 4 bytes, zeroed
        // synchronously before any kernel can read them.
        let (flag, timed_out) = unsafe {
            let flag = cu::malloc_sync(4).map_err(driver_err("cuMemAlloc"))?;
            let timed_out = cu::malloc_sync(4).map_err(driver_err("cuMemAlloc"))?;
            cu::memset_d8_sync(flag, 0, 4).map_err(driver_err("cuMemsetD8"))?;
            cu::memset_d8_sync(timed_out, 0, 4).map_err(driver_err("cuMemsetD8"))?;
            (flag, timed_out)
        };
        let event = || {
            cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(driver_err("cuEventCreate"))
        };
        Ok(Self {
            state,
            side,
            flag,
            timed_out,
            epoch: 0,
            max_spins,
            start: event()?,
            end: event()?,
        })
    }

    /// Closes the gate: burn's stream of this thread runs nothing enqueued from now on until
    /// [`open_and_time`](Self::open_and_time).
    pub fn close(&mut self, client: &Client) -> Result<()> {
        self.epoch = self
            .epoch
            .checked_add(1)
            .ok_or_else(|| gate_err("epochs exhausted"))?;
        let (flag, timed_out, epoch, start) = (self.flag, self.timed_out, self.epoch, self.start);
        let (max_spins, side) = (self.max_spins, &self.side);
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.make_current()?;
        let stream = burn_stream(&state.lanes, client)?;
        on_burn_stream(client, stream, |stream| {
            // SAFETY: `stream` is burn's live stream; the flags are live 4-byte allocations.
            unsafe {
                side.wait(stream, flag, epoch, timed_out, max_spins)?;
                cu::event::record(start, stream).map_err(driver_err("cuEventRecord"))
            }
        })
    }

    /// Opens the gate after everything enqueued since [`close`](Self::close), waits for that
    /// work to finish and returns its device time in milliseconds (from the opening to the
    /// end of the last piece of work).
    pub fn open_and_time(&mut self, client: &Client) -> Result<f64> {
        let end = self.end;
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.make_current()?;
        let burn = burn_stream(&state.lanes, client)?;
        let stream = &state.stream;
        let side = &self.side;
        on_burn_stream(client, burn, |burn| {
            // SAFETY: `burn` is burn's live stream.
            unsafe { cu::event::record(end, burn) }.map_err(driver_err("cuEventRecord"))
        })?;
        // SAFETY: our stream is live; the flag is a live 4-byte allocation; the events were
        // created by `new` and recorded on one stream.
        let ms = unsafe {
            side.signal(*stream, self.flag, self.epoch)?;
            cu::event::synchronize(end).map_err(driver_err("cuEventSynchronize"))?;
            cu::event::elapsed(self.start, end).map_err(driver_err("cuEventElapsedTime"))?
        };
        let mut timed_out = [0u8; 4];
        // SAFETY: `timed_out` is a live 4-byte allocation; every kernel writing it is done.
        unsafe { cu::memcpy_dtoh_sync(&mut timed_out, self.timed_out) }
            .map_err(driver_err("cuMemcpyDtoH"))?;
        match u32::from_le_bytes(timed_out) {
            0 => Ok(ms as f64),
            epoch => Err(gate_err(format!(
                "the spin gave up before the gate opened (epoch {epoch}): the work enqueued \
                 behind it waited for the device"
            ))),
        }
    }
}

/// burn's stream of the current cubecl stream, or why it is unknown (the gate needs it).
fn burn_stream(lanes: &Mutex<Lanes>, client: &Client) -> Result<sys::CUstream> {
    let mut lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
    lanes
        .current()
        .burn_stream(client)
        .map_err(|why| gate_err(format!("burn's stream not found: {why}")))
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once; a failure leaks at worst.
        unsafe {
            let _ = cu::event::destroy(self.start);
            let _ = cu::event::destroy(self.end);
            let _ = cu::free_sync(self.flag);
            let _ = cu::free_sync(self.timed_out);
        }
    }
}
