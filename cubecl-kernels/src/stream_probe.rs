//! The probe kernel: a one-thread store that the CUDA path launches on cubecl's stream to
//! learn which CUDA stream that is.
//!
//! burn-slidesparse launches it once per cubecl stream with a grid no other launch uses and
//! reads the stream argument of that launch through CUPTI (its `cuda/cupti.rs`): that is how
//! its library GEMMs and its own kernels are queued on burn's stream without a patch of
//! cubecl. The kernel's store is incidental; the launch is what is watched.

use cubecl::prelude::*;

/// Stores `value` into `slot[0]`.
#[cube(launch_unchecked)]
pub fn probe_kernel(slot: &mut Array<Atomic<u32>>, value: u32) {
    if UNIT_POS == 0 {
        slot[0].store(value);
    }
}
