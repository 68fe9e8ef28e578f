//! Finding the CUDA stream that cubecl-cuda launches on, through CUPTI's callback API.
//!
//! cubecl-cuda 0.10 keeps its per-thread stream private. CUPTI (NVIDIA's profiling
//! interface, shipped with every CUDA toolkit) reports the arguments of driver calls to a
//! subscriber, including the `hStream` of `cuLaunchKernel`. We subscribe for the time of one
//! probe launch with a grid no real kernel of ours uses, read its stream, and unsubscribe: no
//! patch of cubecl, no cost on later launches. The library is loaded at run time; where it
//! is missing (or a profiler already holds CUPTI's single subscriber slot) discovery fails
//! with an error and the caller falls back to host synchronization.

use std::{
    ffi::{CStr, c_char, c_void},
    sync::{Mutex, OnceLock},
};

use cudarc::driver::sys;
use libloading::Library;

use crate::error::{Result, SlideSparseError};

/// The grid of the probe launch (cubes in x, y, z): odd enough that no other launch matches.
pub const PROBE_GRID: [u32; 3] = [5, 3, 7];

type CuptiResult = u32;
type Subscriber = *mut c_void;
type Callback = unsafe extern "C" fn(*mut c_void, u32, u32, *const c_void);

/// `CUPTI_CB_DOMAIN_DRIVER_API`.
const DOMAIN_DRIVER_API: u32 = 1;
/// `CUPTI_API_ENTER`.
const API_ENTER: u32 = 0;

/// `CUpti_CallbackData` (cupti_callbacks.h, CUDA 12 and 13); declared for its layout.
#[repr(C)]
#[allow(dead_code)]
struct CallbackData {
    site: u32,
    function_name: *const c_char,
    function_params: *const c_void,
    return_value: *mut c_void,
    symbol_name: *const c_char,
    context: *mut c_void,
    context_uid: u32,
    correlation_data: *mut u64,
    correlation_id: u32,
}

/// The leading fields of `cuLaunchKernel_params` (generated_cuda_meta.h).
#[repr(C)]
#[allow(dead_code)]
struct LaunchKernelParams {
    function: *mut c_void,
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: sys::CUstream,
}

struct Cupti {
    _lib: Library,
    subscribe: unsafe extern "C" fn(*mut Subscriber, Callback, *mut c_void) -> CuptiResult,
    enable_domain: unsafe extern "C" fn(u32, Subscriber, u32) -> CuptiResult,
    unsubscribe: unsafe extern "C" fn(Subscriber) -> CuptiResult,
    result_string: unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult,
}

/// Where libcupti is looked for: `SLIDESPARSE_CUPTI`, the loader path, the toolkit.
fn candidates() -> Vec<String> {
    let mut paths: Vec<String> = std::env::var("SLIDESPARSE_CUPTI").into_iter().collect();
    paths.extend(
        ["libcupti.so", "libcupti.so.13", "libcupti.so.12"]
            .iter()
            .map(|s| s.to_string()),
    );
    let cuda = std::env::var("CUDA_PATH").unwrap_or_else(|_| "/usr/local/cuda".into());
    for dir in ["lib64", "extras/CUPTI/lib64", "targets/x86_64-linux/lib"] {
        paths.push(format!("{cuda}/{dir}/libcupti.so"));
    }
    paths
}

impl Cupti {
    fn load() -> std::result::Result<Self, String> {
        let tried = candidates();
        for path in &tried {
            // SAFETY: loading a shared library runs its initializers; libcupti's are benign.
            let Ok(lib) = (unsafe { Library::new(path) }) else {
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
        Err(format!(
            "libcupti not found (tried {}); set SLIDESPARSE_CUPTI to its path",
            tried.join(", ")
        ))
    }

    fn check(&self, what: &str, status: CuptiResult) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: CUPTI writes a pointer to a static string.
        unsafe { (self.result_string)(status, &mut text) };
        let text = if text.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated static string from CUPTI.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        Err(SlideSparseError::Backend(format!(
            "CUPTI {what} failed with status {status}: {text}"
        )))
    }
}

fn cupti() -> Result<&'static Cupti> {
    static CUPTI: OnceLock<std::result::Result<Cupti, String>> = OnceLock::new();
    CUPTI
        .get_or_init(Cupti::load)
        .as_ref()
        .map_err(|e| SlideSparseError::Backend(e.clone()))
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
    if domain != DOMAIN_DRIVER_API || data.is_null() {
        return;
    }
    // SAFETY: for the driver domain CUPTI passes a `CUpti_CallbackData`.
    let data = unsafe { &*(data as *const CallbackData) };
    if data.site != API_ENTER || data.function_name.is_null() || data.function_params.is_null() {
        return;
    }
    // SAFETY: CUPTI's function names are NUL-terminated static strings.
    let name = unsafe { CStr::from_ptr(data.function_name) }.to_bytes();
    if name != b"cuLaunchKernel" && name != b"cuLaunchKernel_ptsz" {
        return;
    }
    // SAFETY: both launch entry points pass a `cuLaunchKernel_params`.
    let params = unsafe { &*(data.function_params as *const LaunchKernelParams) };
    if params.grid == PROBE_GRID
        && let Ok(mut seen) = SEEN_STREAM.lock()
    {
        *seen = Some(params.stream as usize);
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
        (cupti.enable_domain)(1, subscriber, DOMAIN_DRIVER_API)
    });
    let probed = enabled.and_then(|_| probe());
    // SAFETY: unsubscribing the subscriber created above, whatever happened in between.
    let unsubscribed = cupti.check("cuptiUnsubscribe", unsafe {
        (cupti.unsubscribe)(subscriber)
    });
    probed?;
    unsubscribed?;
    let seen = SEEN_STREAM.lock().unwrap_or_else(|e| e.into_inner()).take();
    seen.map(|s| s as sys::CUstream).ok_or_else(|| {
        SlideSparseError::Backend(
            "CUPTI saw no launch of the stream probe kernel (cubecl launched it another way?)"
                .into(),
        )
    })
}
