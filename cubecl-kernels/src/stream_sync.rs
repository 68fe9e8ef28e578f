//! A one-thread store kernel on the CubeCL stream.
//!
//! The CUDA path launches it once per burn thread with an odd grid, as the probe launch
//! whose stream CUPTI reports (burn-slidesparse's `cuda/cupti.rs`): that is how the GEMM
//! finds burn's stream without a patch of cubecl.

use cubecl::prelude::*;

/// Stores `epoch` into `flag[0]`.
#[cube(launch_unchecked)]
pub fn signal_kernel(flag: &mut Array<Atomic<u32>>, epoch: u32) {
    if UNIT_POS == 0 {
        flag[0].store(epoch);
    }
}
