//! Device buffers a burn thread keeps across forwards: the GEMM workspace, and at decode
//! sizes the intermediate buffers of a forward (activation codes, token scales, GEMM
//! accumulator).
//!
//! Why keep them: at decode a forward is bound by host work (~70 us per layer on the H200
//! host), and each allocation from cubecl's pool is a task on its device thread; a kept
//! buffer also has a pointer that does not change, which is what lets the GEMM call be
//! replayed as a CUDA graph (`graphs.rs`). Why it is safe: every layer of a thread runs its
//! forwards on that thread's stream (cubecl's, or the lane's with a synchronization behind
//! it), so one forward's kernels finish using a buffer before the next forward's kernels
//! overwrite it, whichever layer that is. The output is never kept: it is the caller's tensor.

use cubecl::server::Handle;

use super::runtime::{Client, device_ptr as ptr};
use crate::error::Result;

/// Forwards whose three intermediate buffers together need more than this allocate them per
/// call instead: there the allocation is nothing next to the work, and keeping buffers of
/// a long prompt (an accumulator of hundreds of MB) would hold that memory for good.
/// 16 MiB covers M <= 64 for every layer of Llama-3-8B and Qwen2.5-7B.
pub const KEEP_UP_TO_BYTES: usize = 16 << 20;

/// A cubecl allocation held for its device pointer, resolved once (an allocation does not
/// move while its handle lives): a layer's weights, read by every GEMM call.
#[derive(Clone)]
pub struct HeldBuffer {
    _handle: Handle,
    /// The device pointer.
    pub ptr: u64,
}

impl HeldBuffer {
    /// Holds `handle` and resolves its pointer.
    pub fn new(client: &Client, handle: Handle) -> Result<Self> {
        let ptr = ptr(client, &handle)?;
        Ok(Self {
            _handle: handle,
            ptr,
        })
    }
}

/// A device buffer kept and reused across calls, grown on demand.
#[derive(Default)]
pub struct KeptBuffer {
    kept: Option<(Handle, u64, usize)>,
}

impl KeptBuffer {
    /// The buffer (handle and device pointer) of at least `bytes`; a larger one replaces the
    /// old one, whose memory cubecl frees in stream order (behind the work that used it).
    pub fn at_least(&mut self, client: &Client, bytes: usize) -> Result<(Handle, u64)> {
        match &self.kept {
            Some((handle, p, size)) if *size >= bytes => Ok((handle.clone(), *p)),
            _ => {
                let size = bytes.max(256);
                let handle = client.empty(size);
                let p = ptr(client, &handle)?;
                self.kept = Some((handle.clone(), p, size));
                Ok((handle, p))
            }
        }
    }
}

/// A device buffer for one forward: one of the thread's kept buffers (with its pointer,
/// which stays the same until the buffer grows) or a fresh allocation.
#[derive(Clone)]
pub struct ForwardBuffer {
    /// The allocation.
    pub handle: Handle,
    /// The device pointer when the buffer is kept (so stable across calls), else `None`
    /// (resolved where the GEMM is enqueued).
    pub kept_ptr: Option<u64>,
}

impl ForwardBuffer {
    /// The device pointer: the kept one, or resolved through cubecl.
    pub fn pointer(&self, client: &Client) -> Result<u64> {
        match self.kept_ptr {
            Some(p) => Ok(p),
            None => ptr(client, &self.handle),
        }
    }
}

/// The intermediate buffers of one forward: `[codes, token scales, accumulator]`.
pub type ForwardScratch = [ForwardBuffer; 3];

/// Freshly allocated intermediate buffers of `sizes` bytes (no stable pointers).
pub fn fresh_scratch(client: &Client, sizes: [usize; 3]) -> ForwardScratch {
    sizes.map(|bytes| ForwardBuffer {
        handle: client.empty(bytes),
        kept_ptr: None,
    })
}

/// The thread's kept intermediate buffers.
#[derive(Default)]
pub struct KeptScratch {
    buffers: [KeptBuffer; 3],
}

impl KeptScratch {
    /// Buffers of `sizes` bytes (`[codes, token scales, accumulator]`): the kept ones when
    /// they sum to at most [`KEEP_UP_TO_BYTES`], else fresh allocations.
    pub fn for_forward(&mut self, client: &Client, sizes: [usize; 3]) -> Result<ForwardScratch> {
        if sizes.iter().sum::<usize>() > KEEP_UP_TO_BYTES {
            return Ok(fresh_scratch(client, sizes));
        }
        let keep = |kept: &mut KeptBuffer, bytes| -> Result<ForwardBuffer> {
            let (handle, p) = kept.at_least(client, bytes)?;
            Ok(ForwardBuffer {
                handle,
                kept_ptr: Some(p),
            })
        };
        let [codes, scales, acc] = &mut self.buffers;
        Ok([
            keep(codes, sizes[0])?,
            keep(scales, sizes[1])?,
            keep(acc, sizes[2])?,
        ])
    }
}
