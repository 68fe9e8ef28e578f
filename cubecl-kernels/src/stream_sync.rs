//! Two tiny kernels that order work on a foreign CUDA stream after (and before) the kernels
//! of the CubeCL stream without any host synchronization.
//!
//! `signal_kernel` runs on the CubeCL stream and stores an epoch into a flag that the other
//! stream waits on (`cuStreamWaitValue32`). `wait_kernel` runs on the CubeCL stream and
//! spins until the other stream has written the epoch into a second flag
//! (`cuStreamWriteValue32`); after `max_spins` polls it gives up, records the epoch in
//! `timed_out` and fills `poison` with NaN, so a lost flag becomes a visible error, never
//! a hang.

use cubecl::prelude::*;

/// Stores `epoch` into `flag[0]`.
#[cube(launch_unchecked)]
pub fn signal_kernel(flag: &mut Array<Atomic<u32>>, epoch: u32) {
    if UNIT_POS == 0 {
        flag[0].store(epoch);
    }
}

/// Spins until `flag[0] >= epoch` (or `max_spins` polls).
#[cube(launch_unchecked)]
pub fn wait_kernel(
    flag: &mut Array<Atomic<u32>>,
    timed_out: &mut Array<u32>,
    poison: &mut Array<f32>,
    epoch: u32,
    max_spins: u32,
    poison_len: u32,
    nan: f32,
) {
    if UNIT_POS == 0 {
        let mut spins = 0u32;
        loop {
            if flag[0].load() >= epoch {
                break;
            }
            spins += 1;
            if spins >= max_spins {
                timed_out[0] = epoch;
                for i in 0..poison_len {
                    poison[i as usize] = nan;
                }
                break;
            }
        }
    }
}
