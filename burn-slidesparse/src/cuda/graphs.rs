//! Replaying a library GEMM call (cuSPARSELt, cuBLASLt) as a CUDA graph.
//!
//! At decode sizes a forward is bound by host work, and the library call is the largest
//! piece of it: ~15 us for `cusparseLtMatmul` and 10-20 us for `cublasLtMatmul` on the H200
//! host (`slidesparse-bench host`), against ~3 us to launch a captured graph. A graph bakes
//! in its pointers, so it is only used when every buffer the call touches has a pointer
//! that does not change between calls: the layer's weights and scales, and the thread's
//! kept buffers (`buffers.rs`). The key is the GEMM's shape plus all those pointers: a
//! graph found under a key does exactly what the call it was captured from would do.
//!
//! Capture runs on a stream of the lane's that is used for nothing else, in thread-local
//! mode, on cubecl's device thread inside `ComputeClient::exclusive` (nothing else runs
//! there meanwhile). If a capture fails (a library version that does something a capture
//! forbids), that call runs directly from then on and the reason is kept: a graph is an
//! optimization, never a requirement. Once captured, a graph's launch is normally queued on
//! cubecl's device thread without waiting for it (`queued/device_thread.rs`).

use std::collections::HashMap;

use cudarc::driver::{result as cu, sys};

use super::{
    buffers::ForwardBuffer, cublaslt::DenseShape, cusparselt::GemmShape, driver::driver_err,
};
use super::config::GraphMode;
use crate::error::Result;

/// The GEMM a graph was captured from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmCall {
    /// A cuSPARSELt call.
    Sparse(GemmShape),
    /// A cuBLASLt call.
    Dense(DenseShape),
    /// Our compact sparse GEMM (`compact_gemm.rs`).
    Compact(CompactShape),
}

/// The shape of a compact sparse GEMM call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CompactShape {
    /// Token rows.
    pub m_pad: usize,
    /// Output features.
    pub n: usize,
    /// `K'` the weight covers.
    pub k_slide: usize,
    /// Whether the call writes the finished output (another kernel, other operands).
    pub finished: bool,
}

/// A GEMM call with all its device pointers (weights, activations, output, scales,
/// workspace; unused ones 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// The call's shape.
    pub call: GemmCall,
    /// Weights, activations, output, alpha vector, workspace.
    pub pointers: [u64; 5],
}

impl GraphKey {
    /// The key of `call` if its activations and output are kept buffers (so every pointer
    /// is stable), else `None`: the call then runs directly.
    pub fn if_kept(
        call: GemmCall,
        weight: u64,
        (act, out): (&ForwardBuffer, &ForwardBuffer),
        alpha: u64,
        workspace: u64,
    ) -> Option<Self> {
        Some(Self {
            call,
            pointers: [weight, act.kept_ptr?, out.kept_ptr?, alpha, workspace],
        })
    }
}

/// How a GEMM call is replayed.
#[derive(Clone, Copy, Debug)]
pub struct Replay {
    /// The key of the call's graph, or `None` to run the call directly.
    pub key: Option<GraphKey>,
    /// Launch an already captured graph from cubecl's task queue without waiting for the
    /// device thread (`queued/device_thread.rs`), in the `Stream` ordering.
    pub queued: bool,
}

impl Replay {
    /// A call's replay under the device's graph mode: the key `key()` gives (`None` where
    /// its buffers are not kept) if graphs are on, else none.
    pub fn new(mode: GraphMode, key: impl FnOnce() -> Option<GraphKey>) -> Self {
        Self {
            key: if mode.replays() { key() } else { None },
            queued: mode.queued(),
        }
    }
}

/// Graphs kept per lane; beyond this many, all are dropped and recaptured on demand
/// (a model at decode needs layers x M buckets, a few hundred).
const MAX_GRAPHS: usize = 4096;

/// A lane's captured GEMM graphs.
#[derive(Default)]
pub struct GemmGraphs {
    /// The graph of each call seen, or `None` where its capture failed (run directly).
    execs: HashMap<GraphKey, Option<sys::CUgraphExec>>,
    capture_stream: Option<sys::CUstream>,
    /// Why the last failed capture failed, if one did.
    last_failure: Option<String>,
    /// How many times the table filled up and every graph was dropped.
    clears: usize,
    /// The nodes (kernels, memsets) of every graph in `execs`, summed: a graph's launch
    /// costs the device thread more the more nodes it has.
    nodes: usize,
}

// SAFETY: graph executables and the capture stream are driver handles, usable from any
// thread of the process; `&mut self` keeps the table to one thread at a time. A retired
// lane's graphs are dropped on cubecl's device thread (`queued/lanes.rs`).
unsafe impl Send for GemmGraphs {}

impl GemmGraphs {
    /// Why the last capture that failed on this lane failed, if one did.
    pub fn last_failure(&self) -> Option<&str> {
        self.last_failure.as_deref()
    }

    /// The graph captured for `key`, if there is one.
    pub fn captured_exec(&self, key: &GraphKey) -> Option<sys::CUgraphExec> {
        self.execs.get(key).copied().flatten()
    }

    /// How many calls have a graph.
    pub fn captured(&self) -> usize {
        self.execs.values().filter(|e| e.is_some()).count()
    }

    /// How many calls run directly because their capture failed.
    pub fn failed(&self) -> usize {
        self.execs.values().filter(|e| e.is_none()).count()
    }

    /// How many times the table filled up (`MAX_GRAPHS`) and every graph was dropped.
    pub fn clears(&self) -> usize {
        self.clears
    }

    /// The nodes of every graph captured so far (since the last clear), summed.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Runs `enqueue` on `stream` through the graph of `key`, captured from `enqueue` on
    /// first use; runs it directly if that capture failed.
    ///
    /// # Safety
    /// `stream` is valid and the context is current; `key` holds every pointer `enqueue`
    /// passes to the library, and each stays valid while work using it is queued.
    pub unsafe fn run(
        &mut self,
        key: GraphKey,
        stream: sys::CUstream,
        mut enqueue: impl FnMut(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        let exec = match self.execs.get(&key) {
            Some(Some(exec)) => *exec,
            Some(None) => return enqueue(stream),
            // SAFETY: the caller's contract covers the capture's call as well.
            None => match unsafe { self.capture(&mut enqueue) } {
                Ok((exec, nodes)) => {
                    self.keep(key, Some(exec));
                    self.nodes += nodes;
                    exec
                }
                Err(why) => {
                    self.last_failure = Some(why.to_string());
                    self.keep(key, None);
                    return enqueue(stream);
                }
            },
        };
        // SAFETY: `exec` is a live graph of this context; the caller guarantees `stream`.
        unsafe { cu::graph::launch(exec, stream) }.map_err(driver_err("cuGraphLaunch"))
    }

    /// Captures one `enqueue` into an executable graph; also its node count (0 if the
    /// driver would not say).
    unsafe fn capture(
        &mut self,
        enqueue: &mut impl FnMut(sys::CUstream) -> Result<()>,
    ) -> Result<(sys::CUgraphExec, usize)> {
        let stream = match self.capture_stream {
            Some(s) => s,
            None => {
                let s = super::driver::create_stream()?;
                *self.capture_stream.insert(s)
            }
        };
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: our own idle stream.
        unsafe { cu::stream::begin_capture(stream, mode) }
            .map_err(driver_err("cuStreamBeginCapture"))?;
        let enqueued = enqueue(stream);
        // Always end the capture, so that the stream is usable whatever happened.
        // SAFETY: as above.
        let graph =
            unsafe { cu::stream::end_capture(stream) }.map_err(driver_err("cuStreamEndCapture"));
        enqueued?;
        let graph = graph?;
        let mut nodes = 0usize;
        // SAFETY: a live graph; a null node array asks for the count alone. The count only
        // feeds reports, so a failure here leaves it out rather than failing the capture.
        if unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) }
            .result()
            .is_err()
        {
            nodes = 0;
        }
        // SAFETY: `graph` was just captured; it is destroyed once instantiated.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(driver_err("cuGraphInstantiate"));
        // SAFETY: as above.
        unsafe { cu::graph::destroy(graph) }.map_err(driver_err("cuGraphDestroy"))?;
        Ok((exec?, nodes))
    }

    fn keep(&mut self, key: GraphKey, exec: Option<sys::CUgraphExec>) {
        if self.execs.len() >= MAX_GRAPHS {
            self.clear();
            self.clears += 1;
        }
        self.execs.insert(key, exec);
    }

    /// Destroys every graph. Graph launches already issued keep their resources (CUDA
    /// defers the release until they complete). Launches still in cubecl's task queue
    /// (`queued/device_thread.rs`) hold an exec by pointer, so this runs only where every task
    /// queued before it has run: on cubecl's device thread (a capture in `Stream` mode) or
    /// after a sync of burn's stream (`Host` mode).
    fn clear(&mut self) {
        self.nodes = 0;
        for exec in self.execs.drain().filter_map(|(_, exec)| exec) {
            // SAFETY: each exec is live and destroyed once.
            let _ = unsafe { cu::graph::exec_destroy(exec) };
        }
    }
}

impl Drop for GemmGraphs {
    fn drop(&mut self) {
        self.clear();
        if let Some(stream) = self.capture_stream.take() {
            // SAFETY: our stream, destroyed once.
            let _ = unsafe { cu::stream::destroy(stream) };
        }
    }
}
