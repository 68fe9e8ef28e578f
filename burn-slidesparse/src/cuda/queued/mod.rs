//! Our work queued behind burn's kernels: everything this crate enqueues on the GPU in
//! burn's stream order, and the per-stream state it runs with.
//!
//! cubecl-cuda 0.10 runs burn's kernels on one CUDA stream per cubecl `StreamId` (by
//! default, per burn thread), issued in queue order by one device thread per GPU. Our work
//! joins that order the same way whatever it is: it is placed in the device thread's queue
//! (`device_thread.rs`), behind every launch queued before it, and enqueued there on burn's
//! stream of the queuing cubecl stream (found once through CUPTI). Three kinds use it:
//!
//! - the library GEMMs of a layer's forward ([`run_ordered`], `library_calls.rs`): a direct
//!   call or a graph capture the caller waits for, or the launch of a captured graph queued
//!   without waiting;
//! - this crate's own CUDA C kernels ([`submit`], `launches.rs`): attention and the block
//!   steps, each call a few launches with one parameter block;
//! - NCCL's collectives (`nccl_ranks.rs`), queued on each rank's device thread.
//!
//! Per device and cubecl stream there is one lane (`lanes.rs`, the one map of that state): burn's stream as probed, a stream of ours for the host-synchronized fallback, the
//! GEMM's workspace, kept buffers and captured graphs. Where CUPTI cannot find burn's stream
//! the work falls back to host ordering (burn's stream drained, the work run on the lane's
//! stream and waited for), and the lane says why.
//!
//! Work that runs after its call has returned cannot return an error: it NaN-fills its
//! outputs and records the error against the cubecl stream it was queued on
//! (`crate::deferred`); the next call on that stream reports it. [`queue_task`] is the one
//! way such work is queued. With the `internals` feature, `fail_next_queued_launch` makes
//! the next launch of the current stream fail, for the tests of that path.

mod device_thread;
mod lanes;
mod launches;
mod library_calls;
#[cfg(feature = "internals")]
mod report;

#[cfg(feature = "internals")]
pub use device_thread::fail_next_queued_launch;
#[cfg(feature = "internals")]
pub use device_thread::on_burn_stream;
pub use device_thread::queue_task;
pub use lanes::{Lanes, lanes};
pub use launches::{Call, Launch, submit};
pub use library_calls::run_ordered;
#[cfg(feature = "internals")]
pub use report::{CallCounts, GraphReport};
