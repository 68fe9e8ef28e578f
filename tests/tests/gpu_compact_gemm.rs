//! GPU tests of our Hopper sparse GEMM on the compact rows (`cuda/compact_gemm.rs`) and the
//! decode GEMV on the same rows: at every size a layer built on them gives bit for bit what the
//! same layer built on cuSPARSELt gives (both accumulate the same INT8 codes exactly in INT32,
//! then run the same epilogue), for every pattern the GEMM serves and odd shapes, and matches
//! the host's W8A8 on fresh data.
//!
//! They need an NVIDIA Hopper GPU (sm_90) and cuSPARSELt: `#[ignore]`d, run on the GPU host
//! with `--ignored` (`scripts/gpu-run.sh tests`). On another GPU they say so and pass.
#![cfg(feature = "cuda")]

use burn::tensor::{DType, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    PackOptions, PackedLinear, Precision, SparsityPattern,
    cuda::{
        CudaPrepared, config::SparseGemmChoice, gemm::SparseGemm, nvrtc_module::DeviceInfo,
        prepare::compact_gemm_fits,
    },
    pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};
use rand::Rng;
use slidesparse_tests::{host_w8a8, random_f32, relative_l2 as rel_err, rng};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;

/// The layer built with `choice`, checked to run the GEMM asked for.
fn layer(packed: &PackedLinear, choice: SparseGemmChoice) -> CudaPrepared {
    let client = CudaRuntime::client(&Default::default());
    let layer = CudaPrepared::new_sparse_with(
        &client,
        0,
        packed.spec(),
        (&packed.weight, packed.bias.as_deref()),
        choice,
    )
    .unwrap();
    let compact = matches!(layer.gemm, SparseGemm::Compact(_));
    assert_eq!(
        compact,
        choice == SparseGemmChoice::Compact,
        "{}",
        packed.pattern
    );
    // A 6:8 layer decodes through the GEMV on its compact layout (rows or tiles).
    let six_eight = packed.pattern.block_len() == 8;
    assert_eq!(
        layer.gemv_reads(),
        six_eight.then_some(true),
        "{}",
        packed.pattern
    );
    layer
}

fn forward(layer: &CudaPrepared, x: &[f32], (m, k): (usize, usize)) -> Vec<f32> {
    let xg = Tensor::<Gpu, 2>::from_data(
        TensorData::new(x.to_vec(), [m, k]),
        (&Default::default(), DType::F32),
    );
    let y = layer.forward(&xg.into_primitive().tensor()).unwrap();
    Tensor::<Gpu, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(y))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

fn hopper() -> bool {
    let capability = DeviceInfo::of(0).unwrap().capability;
    if capability != (9, 0) {
        println!("compute capability {capability:?}: the compact GEMM runs on sm_90 only");
    }
    capability == (9, 0)
}

#[test]
#[ignore = "needs an NVIDIA Hopper GPU and cuSPARSELt"]
fn compact_gemm_is_bit_identical_to_cusparselt_for_every_pattern() {
    if !hopper() {
        return;
    }
    let mut rng = rng(301);
    let patterns = [
        SparsityPattern::P2_4,
        SparsityPattern::P4_6,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
        "10:12".parse().unwrap(),
        "12:14".parse().unwrap(),
        "14:16".parse().unwrap(),
    ];
    for pattern in patterns {
        // K not a multiple of the block, of 64 or of the stage's 128 K'; N not a multiple of
        // the 128-row tile; M inside one 256-token tile and across several.
        for (k, n) in [(1000, 200), (576, 96), (4096, 384)] {
            let with_bias = rng.random_bool(0.5);
            let w = random_f32(&mut rng, n * k);
            let b = random_f32(&mut rng, n);
            let options = PackOptions::new(pattern, Precision::Int8);
            let bias = with_bias.then_some(&b[..]);
            let (packed, _, _) = pack_linear("w", &w, n, k, bias, &options).unwrap();
            assert!(
                compact_gemm_fits(0, packed.spec()).unwrap(),
                "{pattern} k={k}"
            );
            let ours = layer(&packed, SparseGemmChoice::Compact);
            let lt = layer(&packed, SparseGemmChoice::CuSparseLt);
            let pruned = packed.unslide().unwrap();
            let zeros = vec![0.0; n];
            let host_bias = bias.unwrap_or(&zeros);
            for m in [1, 9, 16, 17, 256, 257, 1000] {
                let x = random_f32(&mut rng, m * k);
                // At up to 16 tokens a 6:8 layer runs the GEMV on both sides (ours on the
                // compact GEMM's rows, cuSPARSELt's layer on its tiles): exact sums, the same
                // epilogue, so bit for bit too. Past them ours runs the metadata kernel and
                // the GEMM on its words (256 and 257: one token tile and two).
                let (a, b) = (forward(&ours, &x, (m, k)), forward(&lt, &x, (m, k)));
                let first = a
                    .iter()
                    .zip(&b)
                    .position(|(p, q)| p.to_bits() != q.to_bits());
                assert!(
                    first.is_none(),
                    "{pattern} m={m} k={k} n={n}: element {first:?} differs: {:?} vs {:?}",
                    first.map(|i| a[i]),
                    first.map(|i| b[i])
                );
                let expected = host_w8a8(&x, &pruned, host_bias, (m, k, n), Precision::Int8);
                let err = rel_err(&a, &expected);
                assert!(err < 1e-3, "{pattern} m={m} k={k} n={n}: rel err {err:.2e}");
            }
            println!(
                "{pattern} k={k} n={n}: bit-identical to cuSPARSELt's layer, within 1e-3 of W8A8"
            );
        }
    }
}
