//! Per-device GPU state: the cuSPARSELt handle, our CUDA stream, the plan cache, the
//! workspace and the algorithm cache. One per device, behind a mutex: cuSPARSELt calls on
//! a handle are serialized through it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, OnceLock},
};

use cudarc::driver::{result as cu, sys};

use super::{
    algo_cache::AlgoCache,
    cublaslt::DenseGemm,
    cusparselt::{GemmShape, LtHandle, SparsePlan},
    ordering::{Lanes, SyncMode},
    side_kernels::SideKernels,
};
use crate::error::{Result, SlideSparseError};

/// Everything SlideSparse keeps per CUDA device.
pub struct DeviceState {
    pub lt: LtHandle,
    /// A stream of ours for one-off work (weight compression, benchmarks); forwards use
    /// per-thread lanes (`ordering.rs`).
    pub stream: sys::CUstream,
    pub context: sys::CUcontext,
    pub gpu_name: String,
    pub plans: HashMap<GemmShape, SparsePlan>,
    pub algos: AlgoCache,
    /// cuBLASLt for the dense baseline, created on first use (`dense_gemm`).
    pub dense: Option<DenseGemm>,
    /// Per-thread streams and flags of the GEMM ordering.
    pub lanes: Lanes,
    pub sync_mode: SyncMode,
    /// Whether GEMM calls on kept buffers are replayed as CUDA graphs (`graphs.rs`); on by
    /// default, off with `SLIDESPARSE_GRAPHS=off`.
    pub use_graphs: bool,
    /// Whether the launches of captured graphs are queued on cubecl's device thread without
    /// waiting (`device_thread.rs`); on by default, off with `SLIDESPARSE_GRAPHS=blocking`.
    pub queue_replays: bool,
    /// Wait/signal kernels for our streams.
    pub side: SideKernels,
}

// SAFETY: the raw stream/context pointers are only used while holding the state's mutex,
// with the context made current on the calling thread first.
unsafe impl Send for DeviceState {}

/// (`use_graphs`, `queue_replays`) from `SLIDESPARSE_GRAPHS`: `off`, `blocking`, or
/// anything else (the default: graphs whose launches are queued).
fn graphs_from_env() -> (bool, bool) {
    match std::env::var("SLIDESPARSE_GRAPHS").as_deref() {
        Ok("off") => (false, false),
        Ok("blocking") => (true, false),
        _ => (true, true),
    }
}

/// Maps a CUDA driver error of the call `what` to a backend error.
pub(super) fn driver_err(what: &str) -> impl Fn(cu::DriverError) -> SlideSparseError + '_ {
    move |e| SlideSparseError::Backend(format!("CUDA driver: {what}: {e:?}"))
}

impl DeviceState {
    fn new(index: usize) -> Result<Self> {
        let device = cuda_device(index)?;
        // SAFETY: `device` is valid; the primary context is the one cubecl-cuda uses.
        let context = unsafe { cu::primary_ctx::retain(device) }
            .map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `context` was just retained.
        unsafe { cu::ctx::set_current(context) }.map_err(driver_err("cuCtxSetCurrent"))?;
        let gpu_name = cu::device::get_name(device).unwrap_or_else(|_| format!("cuda:{index}"));
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(driver_err("cuStreamCreate"))?;
        let lt = LtHandle::new()?;
        let (use_graphs, queue_replays) = graphs_from_env();
        Ok(Self {
            lt,
            stream,
            context,
            gpu_name,
            plans: HashMap::new(),
            algos: AlgoCache::open(),
            dense: None,
            lanes: Lanes::new(index),
            sync_mode: SyncMode::from_env(),
            use_graphs,
            queue_replays,
            side: SideKernels::new()?,
        })
    }

    /// Puts the ordering and replay settings back to their defaults (those of the
    /// environment), after a test or benchmark changed them.
    pub fn restore_default_settings(&mut self) {
        self.sync_mode = SyncMode::from_env();
        (self.use_graphs, self.queue_replays) = graphs_from_env();
    }

    /// Makes the device's context current on this thread (cheap; needed because burn may
    /// call from any thread).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        unsafe { cu::ctx::set_current(self.context) }.map_err(driver_err("cuCtxSetCurrent"))
    }

    /// Blocks until everything enqueued on our stream is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: our stream is valid.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(driver_err("cuStreamSynchronize"))
    }

    /// The cached plan of a shape, built on first use with the remembered algorithm (if any).
    pub fn plan(&mut self, shape: GemmShape) -> Result<&mut SparsePlan> {
        if !self.plans.contains_key(&shape) {
            let key = AlgoCache::key(&self.gpu_name, self.lt.version, &shape);
            let plan = SparsePlan::new(&self.lt, shape, self.algos.get(&key))?;
            self.plans.insert(shape, plan);
        }
        Ok(self.plans.get_mut(&shape).expect("inserted above"))
    }

    /// The dense-baseline GEMM of this device.
    pub fn dense_gemm(&mut self) -> Result<&mut DenseGemm> {
        if self.dense.is_none() {
            self.dense = Some(DenseGemm::new()?);
        }
        Ok(self.dense.as_mut().expect("set above"))
    }

    /// Whether a search result is wanted for this shape's bucket. Only layer-sized GEMMs
    /// are searched: on tiny shapes (N or K' below 1024) `MatmulSearch` of cuSPARSELt 0.8.0
    /// was seen to fail with an internal error that left the context unusable (illegal
    /// instruction), and the default algorithm is fine there.
    pub fn needs_search(&self, shape: &GemmShape) -> bool {
        self.algos.search_enabled
            && shape.n_pad >= 1024
            && shape.k_prime >= 1024
            && self
                .algos
                .get(&AlgoCache::key(&self.gpu_name, self.lt.version, shape))
                .is_none()
    }

    /// Remembers a search result for this shape's bucket.
    pub fn remember(&mut self, shape: &GemmShape, config_id: i32) {
        let key = AlgoCache::key(&self.gpu_name, self.lt.version, shape);
        self.algos.insert(key, config_id);
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn cuda_driver_present() -> bool {
    // SAFETY: only probes whether the driver library can be loaded.
    unsafe { sys::is_culib_present() }
}

/// Device `index`, or [`SlideSparseError::NoGpu`] saying why there is none: no driver library
/// (cudarc would panic on the first driver call), no device, or an index past the last one.
fn cuda_device(index: usize) -> Result<sys::CUdevice> {
    if !cuda_driver_present() {
        return Err(SlideSparseError::NoGpu(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    cu::init().map_err(|e| SlideSparseError::NoGpu(format!("cuInit failed: {e:?}")))?;
    let count = cu::device::get_count()
        .map_err(|e| SlideSparseError::NoGpu(format!("cuDeviceGetCount failed: {e:?}")))?;
    if index >= count.max(0) as usize {
        return Err(SlideSparseError::NoGpu(format!(
            "device {index} requested, {count} present"
        )));
    }
    cu::device::get(index as i32).map_err(driver_err("cuDeviceGet"))
}

type States = Mutex<HashMap<usize, Arc<Mutex<DeviceState>>>>;

/// The state of device `index`, created on first use.
pub fn device_state(index: usize) -> Result<Arc<Mutex<DeviceState>>> {
    static STATES: OnceLock<States> = OnceLock::new();
    let mut states = STATES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(s) = states.get(&index) {
        return Ok(s.clone());
    }
    let state = Arc::new(Mutex::new(DeviceState::new(index)?));
    states.insert(index, state.clone());
    Ok(state)
}
