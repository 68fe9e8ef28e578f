//! The GEMMs a forward can run, behind one trait: for the SlideSparse layer cuSPARSELt on
//! its compressed slid 2:4 weight at `K'`, or our Hopper kernel on the compact rows
//! (`compact_gemm.rs`, the layer's one copy); for the dense quantized baseline cuBLASLt on the
//! dense weight at `K`. All are ordered on burn's stream the same way
//! (`queued::run_ordered`) and replayed as CUDA graphs on kept buffers (`graphs.rs`).

use std::sync::Arc;

use burn::tensor::DType;
use cudarc::driver::sys;

use super::{
    accumulator::Accumulator,
    buffers::{ForwardBuffer, HeldBuffer},
    compact_gemm::{CompactGemm, CompactOutput},
    gemv::MAX_TOKENS,
    config::Settings,
    cublaslt::{DenseShape, WORKSPACE},
    cusparselt::{GemmPointers, GemmShape, sys::Stream},
    graphs::{CompactShape, GemmCall, GraphKey, Replay},
    queued::{Lanes, run_ordered},
    runtime::{Client, device_ptr, sync_burn_stream},
    state::DeviceState,
};
use crate::{error::Result, weight_quant::Precision};

/// The buffers one GEMM call reads and writes.
#[derive(Clone, Copy)]
pub struct GemmBuffers<'a> {
    /// The quantized (and lifted) activations `[m_pad, k_out]`.
    pub codes: &'a ForwardBuffer,
    /// The accumulator `[m_pad, n_pad]`, or the layer output `[rows, n]` where the GEMM's
    /// accumulator is [`finished`](Accumulator::finished).
    pub acc: &'a ForwardBuffer,
    /// The per-token scales `[m_pad]`, NaN-filled if a queued replay fails.
    pub token_scales: &'a ForwardBuffer,
    /// The forward's tokens (`m <= m_pad`): the rows of a finished output.
    pub rows: usize,
}

/// A layer's GEMM: its weights on the device and how to multiply activations by them.
pub trait LayerGemm: Clone + Send + Sync + 'static {
    /// The layer's name in errors.
    const LAYER: &'static str;

    /// What the GEMM writes for a forward of `m` tokens of a layer of `precision` whose output
    /// has dtype `out`.
    fn accumulator(&self, precision: Precision, out: DType, m: usize) -> Accumulator;

    /// Enqueues `acc = codes . W^T` for `m_pad` rows, or, where `accumulator` is
    /// [`finished`](Accumulator::finished), the layer output `Y [rows, n]` into `acc`, ordered
    /// between burn's kernels.
    fn run(
        &self,
        client: &Client,
        state: &mut DeviceState,
        m_pad: usize,
        accumulator: Accumulator,
        buffers: GemmBuffers<'_>,
    ) -> Result<()>;
}

/// Runs a GEMM call (`enqueue`) on the current lane of `lanes` under the device's settings:
/// replayed from a graph keyed by `call` (the call's shape and its weight, alpha and
/// workspace pointers) when the activations and accumulator are kept buffers, ordered on
/// burn's stream, with the token scales of the `m_pad` rows as the NaN target of a failed
/// queued replay.
fn run_on_lane(
    client: &Client,
    lanes: &mut Lanes,
    settings: Settings,
    (buffers, m_pad): (GemmBuffers<'_>, usize),
    (call, weight, alpha, workspace): (GemmCall, u64, u64, u64),
    enqueue: impl FnMut(sys::CUstream) -> Result<()>,
) -> Result<()> {
    let replay = Replay::new(settings.graphs, || {
        let kept = (buffers.codes, buffers.acc);
        GraphKey::if_kept(call, weight, kept, alpha, workspace)
    });
    let poison = (buffers.token_scales, m_pad);
    run_ordered(client, lanes, settings.sync, poison, replay, enqueue)
}

/// A SlideSparse layer's GEMM and the one copy of its weight it reads.
#[derive(Clone)]
pub enum SparseGemm {
    /// cuSPARSELt on its compressed copy.
    Lt(LtWeight),
    /// Our Hopper kernel on the compact rows.
    Compact(Arc<CompactGemm>),
}

/// The compressed 2:4 weight `W' [n_pad, K']` for cuSPARSELt.
#[derive(Clone)]
pub struct LtWeight {
    /// cuSPARSELt's compressed copy of the weight.
    pub(crate) compressed: HeldBuffer,
    /// The weight scales padded with zeros to `n_pad`: cuSPARSELt's alpha vector (INT8).
    pub(crate) alpha: HeldBuffer,
    /// The weight's rows padded to the structured-matrix multiple.
    pub n_pad: usize,
    /// `K'`.
    pub k_prime: usize,
    /// The GEMM's input precision.
    pub precision: Precision,
}

/// Workspace offered to `MatmulSearch` (it tries every algorithm).
const SEARCH_WORKSPACE: usize = 256 << 20;

impl LtWeight {
    fn pointers(&self, client: &Client, buffers: GemmBuffers<'_>) -> Result<GemmPointers> {
        Ok(GemmPointers {
            weight: self.compressed.ptr,
            act: buffers.codes.pointer(client)?,
            out: buffers.acc.pointer(client)?,
            alpha: self.alpha.ptr,
        })
    }

    /// Runs `MatmulSearch` for a new M bucket (blocking, once) and remembers the winner.
    fn search_once(
        &self,
        client: &Client,
        state: &mut DeviceState,
        shape: GemmShape,
        pointers: GemmPointers,
    ) -> Result<()> {
        let workspace_bytes = state.plan(shape)?.workspace;
        let workspace = client.empty(SEARCH_WORKSPACE.max(workspace_bytes));
        let p_ws = device_ptr(client, &workspace)?;
        sync_burn_stream(client)?;
        let stream = state.stream as Stream;
        let (lt, plans, _, _) = state.parts();
        let plan = plans.get_mut(&shape).expect("built by the caller");
        // SAFETY: live cubecl allocations of this plan's shapes, held until the sync below.
        let id = unsafe { plan.search(lt, pointers, p_ws, stream)? };
        state.synchronize()?;
        state.remember(&shape, id);
        Ok(())
    }
}

impl LayerGemm for SparseGemm {
    const LAYER: &'static str = "SlideSparseLinear";

    fn accumulator(&self, precision: Precision, out: DType, m: usize) -> Accumulator {
        match self {
            Self::Lt(_) => Accumulator::sparse(precision, out),
            // 16-bit outputs past decode sizes with the epilogue in the GEMM's kernel; exact
            // INT32 for the pipeline's epilogue otherwise: f32 outputs, and forwards of up to
            // MAX_TOKENS tokens, whose accumulator is a kept buffer the call's CUDA graph
            // replays on (a finished output is the forward's fresh tensor: no graph).
            Self::Compact(_) => Accumulator::finished(out)
                .filter(|_| m > MAX_TOKENS)
                .unwrap_or_else(|| Accumulator::dense(Precision::Int8, out)),
        }
    }

    fn run(
        &self,
        client: &Client,
        state: &mut DeviceState,
        m_pad: usize,
        accumulator: Accumulator,
        buffers: GemmBuffers<'_>,
    ) -> Result<()> {
        match self {
            Self::Lt(weight) => weight.run(client, state, m_pad, accumulator, buffers),
            Self::Compact(gemm) => run_compact(gemm, client, state, (m_pad, accumulator), buffers),
        }
    }
}

/// `acc [m_pad, n_pad] = X' . W'^T` (INT32), or the finished output `[rows, n]`, by our
/// compact kernel, on the lane as the library calls run (replayed as a graph where the
/// buffers are kept: a finished output is the forward's fresh tensor, so those run directly).
fn run_compact(
    gemm: &CompactGemm,
    client: &Client,
    state: &mut DeviceState,
    (m_pad, accumulator): (usize, Accumulator),
    buffers: GemmBuffers<'_>,
) -> Result<()> {
    let settings = state.settings();
    let (_, _, lanes, _) = state.parts();
    let mut lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
    let shape = CompactShape {
        m_pad,
        n: gemm.n,
        k_slide: gemm.k_slide,
        finished: accumulator.finished,
    };
    // The metadata words go to the lane's workspace (stream-ordered with every other call of
    // the lane, so layers share it).
    let p_scratch = lanes.current().workspace(client, gemm.scratch_bytes())?;
    let call = (GemmCall::Compact(shape), gemm.rows_ptrs().0, 0, p_scratch);
    run_on_lane(client, &mut lanes, settings, (buffers, m_pad), call, |stream| {
        // Resolved here: on cubecl's device thread in `Stream` mode (no round trip).
        let (p_x, p_acc) = (
            buffers.codes.pointer(client)?,
            buffers.acc.pointer(client)?,
        );
        let (rows, out) = if accumulator.finished {
            let sx = buffers.token_scales.pointer(client)?;
            let ty = accumulator.ty;
            (buffers.rows, CompactOutput::Finished { y: p_acc, ty, sx })
        } else {
            (m_pad, CompactOutput::Acc(p_acc))
        };
        // SAFETY: `codes` holds `m_pad` rows of the lift's `k_out` bytes, `acc` `m_pad` rows
        // of `n_pad` INT32 or, finished, `rows` rows of `n` 16-bit values, `token_scales`
        // `m_pad` f32 (`GpuLayer::forward`), the workspace `scratch_bytes()`; burn's stream
        // stays behind the GEMM.
        unsafe { gemm.enqueue(stream, rows, (p_x, out), p_scratch) }
    })
}

impl LtWeight {
    /// Enqueues cuSPARSELt's `acc = codes . W'^T` (searching its algorithm for a new shape
    /// first).
    fn run(
        &self,
        client: &Client,
        state: &mut DeviceState,
        m_pad: usize,
        accumulator: Accumulator,
        buffers: GemmBuffers<'_>,
    ) -> Result<()> {
        let shape = GemmShape {
            m_pad,
            n_pad: self.n_pad,
            k_prime: self.k_prime,
            precision: self.precision,
            accumulator,
        };
        if state.plan(shape)?.needs_search {
            if state.needs_search(&shape) {
                let pointers = self.pointers(client, buffers)?;
                self.search_once(client, state, shape, pointers)?;
            }
            state.plan(shape)?.needs_search = false;
        }
        let settings = state.settings();
        let (lt, plans, lanes, _) = state.parts();
        let plan = &plans[&shape];
        let mut lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
        let p_ws = lanes.current().workspace(client, plan.workspace)?;
        let call = (GemmCall::Sparse(shape), self.compressed.ptr, self.alpha.ptr, p_ws);
        run_on_lane(client, &mut lanes, settings, (buffers, m_pad), call, |stream| {
            // Pointers of buffers that are not kept are resolved here: on cubecl's device
            // thread in `Stream` mode, where `get_resource` is a direct call.
            let p = self.pointers(client, buffers)?;
            // SAFETY: live cubecl allocations of this plan's shapes; `run_ordered` keeps
            // burn's stream (which owns their reuse) behind the GEMM.
            unsafe { plan.run(lt, p, p_ws, stream as Stream) }
        })
    }
}

/// The dense weight `W [n_pad, k_pad]` for cuBLASLt.
#[derive(Clone)]
pub struct DenseGemm {
    pub(crate) weight: HeldBuffer,
    /// `n` rounded up to 16: cuBLASLt's 8-bit kernels need 16-element leading dimensions
    /// (the extra weight rows are zero; the epilogue reads the `n` real columns).
    pub n_pad: usize,
    /// `K` rounded up to 16 (cuBLASLt's 8-bit alignment); the quant kernel zero-pads.
    pub k_pad: usize,
    /// The GEMM's input precision.
    pub precision: Precision,
}

impl LayerGemm for DenseGemm {
    const LAYER: &'static str = "QuantizedLinear";

    fn accumulator(&self, precision: Precision, out: DType, _m: usize) -> Accumulator {
        Accumulator::dense(precision, out)
    }

    fn run(
        &self,
        client: &Client,
        state: &mut DeviceState,
        m_pad: usize,
        accumulator: Accumulator,
        buffers: GemmBuffers<'_>,
    ) -> Result<()> {
        let shape = DenseShape {
            m_pad,
            n: self.n_pad,
            k: self.k_pad,
            precision: self.precision,
            accumulator,
        };
        state.dense_gemm()?;
        let settings = state.settings();
        let (_, _, lanes, dense) = state.parts();
        let gemm = dense.expect("created above");
        let mut lanes = lanes.lock().unwrap_or_else(|e| e.into_inner());
        let p_ws = lanes.current().workspace(client, WORKSPACE)?;
        let weight = self.weight.ptr;
        let call = (GemmCall::Dense(shape), weight, 0, p_ws);
        run_on_lane(client, &mut lanes, settings, (buffers, m_pad), call, |stream| {
            // Resolved here: on cubecl's device thread in `Stream` mode (no round trip).
            let (p_x, p_acc) = (
                buffers.codes.pointer(client)?,
                buffers.acc.pointer(client)?,
            );
            // SAFETY: live allocations of the shape's sizes; burn's stream stays behind the
            // GEMM.
            unsafe { gemm.run(shape, weight, p_x, p_acc, p_ws, stream as *mut std::ffi::c_void) }
        })
    }
}
