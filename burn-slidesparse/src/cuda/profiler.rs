//! Profiler ranges for benchmarks (feature `internals`): what an external profiler started
//! with `--profile-from-start off` records.

use cudarc::driver::sys;

use super::driver::{Context, cuda_device, driver_err};
use crate::error::Result;

/// Runs `f` as the range that an external profiler started with `--profile-from-start off`
/// records (Nsight Compute, Nsight Systems): `cuProfilerStart` before it and
/// `cuProfilerStop` after it, on device `index`'s primary context. Without a profiler
/// attached both calls do nothing. `f` should end with a device sync so that its kernels
/// run inside the range.
pub fn profiler_range<T>(index: usize, f: impl FnOnce() -> T) -> Result<T> {
    let context = Context::retain(cuda_device(index)?)?;
    // SAFETY: a current context (`retain` makes it so); no arguments.
    unsafe { sys::cuProfilerStart() }
        .result()
        .map_err(driver_err("cuProfilerStart"))?;
    let out = f();
    context.make_current()?;
    // SAFETY: as above.
    unsafe { sys::cuProfilerStop() }
        .result()
        .map_err(driver_err("cuProfilerStop"))?;
    Ok(out)
}
