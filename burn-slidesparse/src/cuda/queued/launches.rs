//! Launches of this crate's own CUDA C kernels (`nvrtc_module.rs`) in burn's stream order.
//!
//! A call checks its shapes, allocates its outputs from cubecl's pool and hands its launches
//! to [`submit`] with a parameter block and the handles it reads and writes (a [`Call`]).
//! The launches are queued on cubecl's device thread, behind every kernel queued before
//! them, on burn's stream of the calling cubecl stream: no host synchronization. The
//! pointers are resolved on the device thread, where the queued task holds the handles
//! until the launches are enqueued; from then on cubecl reuses that memory only in the
//! order of the same stream. Where burn's stream is unknown (no CUPTI) the launches run
//! host-ordered: burn's stream drained, the launches on the lane's stream, waited for.

use std::{ffi::c_void, sync::Mutex};

use cubecl::{server::ComputeServer, server::Handle, stream_id::StreamId};
use cudarc::driver::{result as cu, sys};

use super::{
    super::{
        driver::{Context, driver_err, synchronize},
        runtime::{Client, device_ptr, sync_burn_stream},
    },
    device_thread::{injected_failure, queue_task},
    lanes::{Lanes, OwnedStream},
};
use crate::error::{Result, SlideSparseError};

/// One kernel launch of a call.
#[derive(Clone, Copy)]
pub struct Launch {
    /// The kernel (a function of a loaded program).
    pub function: sys::CUfunction,
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block (one dimension).
    pub block: u32,
    /// Dynamic shared memory bytes.
    pub smem: u32,
}
// SAFETY: a function handle of a module that lives for the process.
unsafe impl Send for Launch {}

/// What a queued call reads and writes: it holds the handles until the launches are
/// enqueued, puts their pointers into the kernels' parameter block, and names the outputs
/// that are NaN-filled when a launch fails.
pub trait Call: Send + 'static {
    /// The parameter block the kernels take by value (`repr(C)`, as in the `.cu` files).
    type Params: Copy + Send + 'static;

    /// Sets the parameters' pointers from `ptr`.
    fn resolve(
        &self,
        params: &mut Self::Params,
        ptr: &mut dyn FnMut(&Handle) -> Result<u64>,
    ) -> Result<()>;

    /// `(pointer, 16-bit elements)` of each output resolved in `params` (NaN-filled when a
    /// launch fails).
    fn outputs(&self, params: &Self::Params) -> Vec<(u64, usize)>;
}

/// Enqueues `launches` with `params` on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; the pointers in `params` are live
/// device memory of the sizes the launches' kernels read and write.
unsafe fn enqueue<P: Copy>(stream: sys::CUstream, params: &P, launches: &[Launch]) -> Result<()> {
    for l in launches {
        let mut p = *params;
        let mut args = [&mut p as *mut P as *mut c_void];
        // SAFETY: the kernels take one parameter block by value; the caller's contract for
        // the rest.
        unsafe {
            cu::launch_kernel(l.function, l.grid, (l.block, 1, 1), l.smem, stream, &mut args)
        }
        .map_err(driver_err("cuLaunchKernel (our kernels)"))?;
    }
    Ok(())
}

/// Runs `call`'s launches in burn's stream order on the device of `lanes`: queued on cubecl's
/// device thread when burn's stream of the current cubecl stream is known, host-ordered
/// otherwise (module docs).
pub fn submit<C: Call>(
    lanes: &Mutex<Lanes>,
    client: &Client,
    params: C::Params,
    launches: Vec<Launch>,
    call: C,
) -> Result<()> {
    let mut lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
    let context = lanes.context();
    let lane = lanes.current();
    match lane.burn_stream(client) {
        Ok(stream) => {
            let stream = stream as usize;
            queue(&lanes, stream, params, launches, call);
            Ok(())
        }
        Err(_) => {
            let stream = lane.host_stream(&context)?;
            drop(lanes);
            run_host_ordered(client, &context, &stream, params, &launches, call)
        }
    }
}

/// Queues the launches on cubecl's device thread, behind every kernel queued so far, on
/// burn's stream; a failure NaN-fills the outputs and is the stream's next call's error.
fn queue<C: Call>(
    lanes: &Lanes,
    stream: usize,
    params: C::Params,
    launches: Vec<Launch>,
    call: C,
) {
    let stream_id = StreamId::current();
    let injected = injected_failure();
    queue_task(lanes.device_thread(), move |server| {
        let mut params = params;
        let resolved = call.resolve(&mut params, &mut |h| {
            server
                .get_resource(h.clone().binding(), stream_id)
                .map(|r| r.resource().ptr)
                .map_err(|e| SlideSparseError::Cubecl {
                    what: "get_resource (our kernels)",
                    detail: format!("{e:?}"),
                })
        });
        let stream = stream as sys::CUstream;
        let launched = resolved.and_then(|()| match injected {
            Some(code) => Err(SlideSparseError::Cuda {
                call: "cuLaunchKernel (our kernels)",
                code,
            }),
            // SAFETY: burn's stream of this cubecl stream, on the device thread where the
            // context is current; the pointers were just resolved from the handles this task
            // holds.
            None => unsafe { enqueue(stream, &params, &launches) },
        });
        if launched.is_err() {
            for (ptr, len) in call.outputs(&params) {
                if ptr != 0 {
                    // SAFETY: an output of `len` 16-bit elements resolved above; a failure
                    // here leaves the error recorded anyway.
                    let _ = unsafe { sys::cuMemsetD16Async(ptr, 0x7FFF, len, stream) };
                }
            }
        }
        drop(call);
        launched
    });
}

/// The host-ordered fallback: burn's stream drained, the launches on our `stream`, waited
/// for.
fn run_host_ordered<C: Call>(
    client: &Client,
    context: &Context,
    stream: &OwnedStream,
    params: C::Params,
    launches: &[Launch],
    call: C,
) -> Result<()> {
    let mut params = params;
    call.resolve(&mut params, &mut |h| device_ptr(client, h))?;
    sync_burn_stream(client)?;
    context.make_current()?;
    // SAFETY: the lane's stream of ours, created in this context and alive while borrowed
    // here; pointers resolved from live handles that `call` holds until the stream is
    // synchronized.
    unsafe {
        enqueue(stream.raw(), &params, launches)?;
        synchronize(stream.raw())
    }
}
