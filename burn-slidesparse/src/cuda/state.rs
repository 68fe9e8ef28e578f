//! Per-device GPU state: the context, a stream of ours, the cuSPARSELt handle, the plan and
//! algorithm caches, the cuBLASLt baseline, the device's lanes and the settings forwards
//! run under. One per device, behind a mutex: cuSPARSELt calls on a handle are serialized
//! through it (a forward locks the state, then the lanes).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use cudarc::driver::sys;

use super::{
    algo_cache::AlgoCache,
    config::{Settings, config},
    cublaslt::CublasLt,
    cusparselt::{GemmShape, LtHandle, SparsePlan},
    driver::{self, Context, create_stream, cuda_device},
    queued::{Lanes, lanes},
    runtime::PerDevice,
};
use crate::error::Result;

/// Everything SlideSparse keeps per CUDA device.
pub struct DeviceState {
    /// The device's primary context (cubecl's).
    pub context: Context,
    /// A stream of ours for one-off work (weight compression, algorithm search,
    /// benchmarks); forwards use per-stream lanes (`queued`).
    pub stream: sys::CUstream,
    /// The cuSPARSELt handle.
    pub lt: LtHandle,
    /// The device's name, part of the algorithm cache's keys.
    pub gpu_name: String,
    plans: HashMap<GemmShape, SparsePlan>,
    algos: AlgoCache,
    /// cuBLASLt for the dense baseline, created on first use (`dense_gemm`).
    dense: Option<CublasLt>,
    /// The device's lanes: per cubecl stream, its streams, kept buffers and graphs.
    pub lanes: Arc<Mutex<Lanes>>,
    settings: Settings,
}

// SAFETY: the raw stream pointer is only used while holding the state's mutex, with the
// context made current on the calling thread first.
unsafe impl Send for DeviceState {}

impl DeviceState {
    fn new(index: usize) -> Result<Self> {
        let config = config()?;
        let device = cuda_device(index)?;
        let context = Context::retain(device)?;
        let gpu_name = cudarc::driver::result::device::get_name(device)
            .unwrap_or_else(|_| format!("cuda:{index}"));
        Ok(Self {
            context,
            stream: create_stream()?,
            lt: LtHandle::new(config)?,
            gpu_name,
            plans: HashMap::new(),
            algos: AlgoCache::open(config),
            dense: None,
            lanes: lanes(index)?,
            settings: config.settings,
        })
    }

    /// The settings forwards on this device run under (from the environment unless
    /// changed with [`set_settings`](Self::set_settings)).
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Changes the ordering and replay settings (tests and benchmarks compare them).
    #[cfg(feature = "internals")]
    pub fn set_settings(&mut self, settings: Settings) {
        self.settings = settings;
    }

    /// Puts the settings back to those of the environment.
    #[cfg(feature = "internals")]
    pub fn restore_default_settings(&mut self) -> Result<()> {
        self.settings = config()?.settings;
        Ok(())
    }

    /// Makes the device's context current on this thread (cheap; needed because burn may
    /// call from any thread).
    pub fn make_current(&self) -> Result<()> {
        self.context.make_current()
    }

    /// Blocks until everything enqueued on our stream is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: our stream is live for the life of the state.
        unsafe { driver::synchronize(self.stream) }
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
    pub fn dense_gemm(&mut self) -> Result<&mut CublasLt> {
        if self.dense.is_none() {
            self.dense = Some(CublasLt::new()?);
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

    /// The plans, the lanes and the cuBLASLt baseline at once (a GEMM call borrows all
    /// three).
    pub(crate) fn parts(
        &mut self,
    ) -> (
        &LtHandle,
        &mut HashMap<GemmShape, SparsePlan>,
        &Mutex<Lanes>,
        Option<&mut CublasLt>,
    ) {
        (&self.lt, &mut self.plans, &self.lanes, self.dense.as_mut())
    }
}

/// The state of device `index`, created on first use.
pub fn device_state(index: usize) -> Result<Arc<Mutex<DeviceState>>> {
    static STATES: PerDevice<Mutex<DeviceState>> = PerDevice::new();
    STATES.get_or_try_init(index, || DeviceState::new(index).map(Mutex::new))
}

#[cfg(feature = "internals")]
/// Changes the settings of device `index`'s forwards with `change` (tests and benchmarks
/// compare graph modes and orderings), e.g. `update_settings(0, |s| s.graphs = GraphMode::Off)`.
pub fn update_settings(index: usize, change: impl FnOnce(&mut Settings)) -> Result<()> {
    let state = device_state(index)?;
    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    let mut settings = state.settings();
    change(&mut settings);
    state.set_settings(settings);
    Ok(())
}
