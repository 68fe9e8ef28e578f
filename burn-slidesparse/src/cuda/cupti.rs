//! Finding the CUDA stream that cubecl-cuda launches on, through CUPTI's callback API.
//!
//! cubecl-cuda 0.10 keeps its per-thread stream private. CUPTI (NVIDIA's profiling
//! interface, shipped with every CUDA toolkit) reports the arguments of driver calls to a
//! subscriber, including the `hStream` of `cuLaunchKernel`. We subscribe for the time of one
//! probe launch with a grid no real kernel of ours uses, read its stream, and unsubscribe: no
//! patch of cubecl, no cost on later launches. The struct layouts are cudarc's generated
//! bindings; the library itself is loaded here (so `SLIDESPARSE_CUPTI` can point at it and a
//! missing one is an error, not cudarc's panic). Where it
//! is missing (or a profiler already holds CUPTI's single subscriber slot) discovery fails
//! with an error and the caller falls back to host synchronization.

use std::{
    ffi::{CStr, c_char, c_void},
    path::PathBuf,
    sync::{Mutex, OnceLock},
};

use cudarc::{
    cupti::sys::{
        CUpti_ApiCallbackSite, CUpti_CallbackData, CUpti_CallbackDomain, cuLaunchKernel_params,
    },
    driver::sys,
};
use libloading::Library;

use super::config::{Config, config};
use crate::error::{Result, SlideSparseError};

/// The grid of the probe launch (cubes in x, y, z): odd enough that no other launch matches.
pub const PROBE_GRID: [u32; 3] = [5, 3, 7];

/// `CUptiResult`, kept as an integer: CUPTI may return values newer than the bindings.
type CuptiResult = u32;
type Subscriber = *mut c_void;
/// `CUpti_CallbackFunc` with the domain as an integer, for the same reason.
type Callback = unsafe extern "C" fn(*mut c_void, u32, u32, *const c_void);

struct Cupti {
    _lib: Library,
    subscribe: unsafe extern "C" fn(*mut Subscriber, Callback, *mut c_void) -> CuptiResult,
    enable_domain: unsafe extern "C" fn(u32, Subscriber, u32) -> CuptiResult,
    unsubscribe: unsafe extern "C" fn(Subscriber) -> CuptiResult,
    result_string: unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult,
}

/// Where libcupti is looked for: `SLIDESPARSE_CUPTI`, the loader path, the toolkit.
fn candidates(config: &Config) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = config.cupti.iter().cloned().collect();
    paths.extend(["libcupti.so", "libcupti.so.13", "libcupti.so.12"].map(PathBuf::from));
    for dir in ["lib64", "extras/CUPTI/lib64", "targets/x86_64-linux/lib"] {
        paths.push(config.cuda_path.join(dir).join("libcupti.so"));
    }
    paths
}

impl Cupti {
    fn load(config: &Config) -> std::result::Result<Self, String> {
        let tried = candidates(config);
        for path in &tried {
            let path = path.display();
            // SAFETY: loading a shared library runs its initializers; libcupti's are benign.
            let Ok(lib) = (unsafe { Library::new(path.to_string()) }) else {
                continue;
            };
            // SAFETY: the symbol types match CUPTI's C declarations.
            let cupti = unsafe {
                Self {
                    subscribe: *lib
                        .get(b"cuptiSubscribe\0")
                        .map_err(|e| format!("{path}: {e}"))?,
                    enable_domain: *lib
                        .get(b"cuptiEnableDomain\0")
                        .map_err(|e| format!("{path}: {e}"))?,
                    unsubscribe: *lib
                        .get(b"cuptiUnsubscribe\0")
                        .map_err(|e| format!("{path}: {e}"))?,
                    result_string: *lib
                        .get(b"cuptiGetResultString\0")
                        .map_err(|e| format!("{path}: {e}"))?,
                    _lib: lib,
                }
            };
            return Ok(cupti);
        }
        let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
        Err(format!(
            "libcupti not found (tried {}); set SLIDESPARSE_CUPTI to its path",
            tried.join(", ")
        ))
    }

    fn check(&self, call: &'static str, status: CuptiResult) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: CUPTI writes a pointer to a static string.
        unsafe { (self.result_string)(status, &mut text) };
        let message = if text.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated static string from CUPTI.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        Err(SlideSparseError::Cupti {
            call,
            status,
            message,
        })
    }
}

fn cupti() -> Result<&'static Cupti> {
    static CUPTI: OnceLock<std::result::Result<Cupti, String>> = OnceLock::new();
    let config = config()?;
    CUPTI
        .get_or_init(|| Cupti::load(config))
        .as_ref()
        .map_err(|detail| SlideSparseError::LibraryUnavailable {
            library: "CUPTI",
            detail: detail.clone(),
        })
}

/// The stream of the last probe launch seen by the callback (as an integer: `Send`).
static SEEN_STREAM: Mutex<Option<usize>> = Mutex::new(None);

/// Called by CUPTI on every driver API entry and exit while subscribed (on whichever thread
/// makes the call). Must not panic: it runs inside the CUDA driver.
unsafe extern "C" fn on_driver_call(
    _user: *mut c_void,
    domain: u32,
    _callback_id: u32,
    data: *const c_void,
) {
    if domain != CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API as u32 || data.is_null() {
        return;
    }
    // SAFETY: for the driver domain CUPTI passes a `CUpti_CallbackData`.
    let data = unsafe { &*(data as *const CUpti_CallbackData) };
    if data.callbackSite != CUpti_ApiCallbackSite::CUPTI_API_ENTER
        || data.functionName.is_null()
        || data.functionParams.is_null()
    {
        return;
    }
    // SAFETY: CUPTI's function names are NUL-terminated static strings.
    let name = unsafe { CStr::from_ptr(data.functionName) }.to_bytes();
    if name != b"cuLaunchKernel" && name != b"cuLaunchKernel_ptsz" {
        return;
    }
    // SAFETY: both launch entry points pass a `cuLaunchKernel_params` (the `_ptsz` struct
    // has the same layout).
    let params = unsafe { &*(data.functionParams as *const cuLaunchKernel_params) };
    let grid = [params.gridDimX, params.gridDimY, params.gridDimZ];
    if grid == PROBE_GRID
        && let Ok(mut seen) = SEEN_STREAM.lock()
    {
        *seen = Some(params.hStream as usize);
    }
}

/// Runs `probe`, which must make cubecl launch one kernel with grid [`PROBE_GRID`] and return
/// once that launch has been issued, and returns the stream the launch went to.
pub fn stream_of_probe_launch(probe: impl FnOnce() -> Result<()>) -> Result<sys::CUstream> {
    // One probe at a time: the callback matches launches by grid only.
    static PROBING: Mutex<()> = Mutex::new(());
    let _probing = PROBING.lock().unwrap_or_else(|e| e.into_inner());
    let cupti = cupti()?;
    *SEEN_STREAM.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let mut subscriber: Subscriber = std::ptr::null_mut();
    // SAFETY: valid out pointer and callback; the callback ignores the null user data.
    let status =
        unsafe { (cupti.subscribe)(&mut subscriber, on_driver_call, std::ptr::null_mut()) };
    cupti.check("cuptiSubscribe (is a profiler attached?)", status)?;
    // SAFETY: `subscriber` was just created.
    let enabled = cupti.check("cuptiEnableDomain", unsafe {
        (cupti.enable_domain)(1, subscriber, CUpti_CallbackDomain::CUPTI_CB_DOMAIN_DRIVER_API as u32)
    });
    let probed = enabled.and_then(|_| probe());
    // SAFETY: unsubscribing the subscriber created above, whatever happened in between.
    let unsubscribed = cupti.check("cuptiUnsubscribe", unsafe {
        (cupti.unsubscribe)(subscriber)
    });
    probed?;
    unsubscribed?;
    let seen = SEEN_STREAM.lock().unwrap_or_else(|e| e.into_inner()).take();
    seen.map(|s| s as sys::CUstream)
        .ok_or_else(|| SlideSparseError::Unsupported {
            what: "finding burn's stream through CUPTI".into(),
            why: "CUPTI saw no launch of the probe kernel (cubecl launched it another way?)".into(),
        })
}
