//! The CUDA path on a machine without a (usable) GPU: a typed error that says what to do,
//! never a panic. Runs in CI (no driver there) and on the GPU host (asking for a device
//! index past the last one), so it is not `#[ignore]`d.
#![cfg(feature = "cuda")]

use burn_slidesparse::{
    SlideSparseError,
    cuda::state::{cuda_driver_present, device_state},
};

#[test]
fn a_missing_gpu_is_a_typed_error_not_a_panic() {
    let driver_present = cuda_driver_present();
    let index = if driver_present { 4096 } else { 0 };
    let err = match device_state(index) {
        Ok(_) => panic!("device {index} should not be usable here"),
        Err(e) => e,
    };
    assert!(matches!(err, SlideSparseError::NoGpu(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("reference backend"), "{text}");
    if !driver_present {
        assert!(text.contains("libcuda"), "{text}");
    }
}
