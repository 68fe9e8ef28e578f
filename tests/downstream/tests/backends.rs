//! The same SlideSparse model on every burn backend, against NdArray's reference path.
//! CPU backends run in CI; GPU backends are `#[ignore]`d there and run on a GPU host
//! (`cargo test --release -- --ignored`).

use burn::backend::{Autodiff, Cuda, Flex, NdArray, Wgpu};
use burn_slidesparse::{Precision, SlideSparseBackend};
use slidesparse_downstream::run;

fn check<B: SlideSparseBackend>(tolerance: f32) {
    for precision in [Precision::Int8, Precision::Fp8, Precision::Bf16] {
        let expected = run::<NdArray>(precision, &Default::default());
        let got = run::<B>(precision, &Default::default());
        assert_eq!(got.len(), expected.len());
        let (num, den) = got
            .iter()
            .zip(&expected)
            .fold((0.0f64, 0.0f64), |(n, d), (a, b)| {
                (n + ((a - b) as f64).powi(2), d + (*b as f64).powi(2))
            });
        let err = (num / den.max(1e-30)).sqrt();
        assert!(
            err < tolerance as f64,
            "{precision}: relative error {err:.2e}"
        );
    }
}

#[test]
fn ndarray_and_autodiff_ndarray() {
    check::<Autodiff<NdArray>>(1e-6);
}

#[test]
fn flex_and_autodiff_flex() {
    check::<Flex>(1e-5);
    check::<Autodiff<Flex>>(1e-5);
}

#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn cuda_with_fusion_and_its_autodiff() {
    check::<Cuda>(2e-2);
    check::<Autodiff<Cuda>>(2e-2);
}

#[test]
#[ignore = "needs a GPU with a wgpu adapter"]
fn wgpu_with_fusion_and_its_autodiff() {
    check::<Wgpu>(1e-4);
    check::<Autodiff<Wgpu>>(1e-4);
}
