//! GPU tests of our Hopper sparse GEMM on the compact rows (`cuda/compact_gemm.rs`) and the
//! decode GEMV on the same rows: at every size an f32 layer built on them gives bit for bit what
//! the same layer built on cuSPARSELt gives (both accumulate the same INT8 codes exactly in
//! INT32, then run the same epilogue), for every pattern the GEMM serves and odd shapes, and
//! matches the host's W8A8 on fresh data; a bf16 / f16 layer's GEMM applies the epilogue
//! itself, and its outputs are the f32 path's rounded once and the GEMV's bit for bit.
//!
//! They need an NVIDIA Hopper GPU (sm_90) and cuSPARSELt: `#[ignore]`d, run on the GPU host
//! with `--ignored` (`scripts/gpu-run.sh tests`). On another GPU they say so and pass.
#![cfg(feature = "cuda")]

use burn::tensor::{DType, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    HostCodes, PackOptions, PackedLinear, Precision, SparsityPattern,
    cuda::{
        CudaPrepared,
        config::SparseGemmChoice,
        gemm::{LayerGemm, SparseGemm},
        nvrtc_module::DeviceInfo,
        prepare::compact_gemm_fits,
    },
    pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};
use rand::{Rng, rngs::StdRng};
use slidesparse_tests::{host_w8a8, random_f32, relative_l2 as rel_err, rng};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;

/// The layer built with `choice`, checked to run the GEMM asked for. The compact GEMM's layer
/// is built from the compact rows a module holds (uploaded as they are), cuSPARSELt's from the
/// slid codes (compacted for the GEMV): both ways a weight reaches the GPU.
fn layer(packed: &PackedLinear, choice: SparseGemmChoice) -> CudaPrepared {
    let client = CudaRuntime::client(&Default::default());
    let spec = packed.spec();
    let held = match choice {
        SparseGemmChoice::Compact => {
            let held = HostCodes::sparse(
                packed.weight.clone(),
                spec.pattern,
                spec.in_features,
                spec.alignment,
            );
            assert!(held.compact().is_some(), "{}", packed.pattern);
            held
        }
        SparseGemmChoice::CuSparseLt => HostCodes::Codes(packed.weight.clone().into()),
    };
    let layer =
        CudaPrepared::new_sparse_with(&client, 0, spec, (&held, packed.bias.as_deref()), choice)
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
    forward_as(layer, x, (m, k), DType::F32)
}

/// The layer's output for `x` as a `dtype` tensor, read back as f32.
fn forward_as(layer: &CudaPrepared, x: &[f32], (m, k): (usize, usize), dtype: DType) -> Vec<f32> {
    let xg = Tensor::<Gpu, 2>::from_data(
        TensorData::new(x.to_vec(), [m, k]),
        (&Default::default(), dtype),
    );
    let y = layer.forward(&xg.into_primitive().tensor()).unwrap();
    Tensor::<Gpu, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(y))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

/// A random INT8 `pattern` layer `[n, k]` packed as the examples pack, with a bias half of the
/// time, and the bias the host reference adds (zeros without one).
fn random_layer(
    rng: &mut StdRng,
    pattern: SparsityPattern,
    (k, n): (usize, usize),
) -> (PackedLinear, Vec<f32>) {
    let with_bias = rng.random_bool(0.5);
    let w = random_f32(rng, n * k);
    let b = random_f32(rng, n);
    let options = PackOptions::new(pattern, Precision::Int8);
    let bias = with_bias.then_some(&b[..]);
    let (packed, _, _) = pack_linear("w", &w, n, k, bias, &options).unwrap();
    let host_bias = if with_bias { b } else { vec![0.0; n] };
    (packed, host_bias)
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
            let (packed, host_bias) = random_layer(&mut rng, pattern, (k, n));
            assert!(
                compact_gemm_fits(0, packed.spec()).unwrap(),
                "{pattern} k={k}"
            );
            let ours = layer(&packed, SparseGemmChoice::Compact);
            let lt = layer(&packed, SparseGemmChoice::CuSparseLt);
            let pruned = packed.unslide().unwrap();
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
                let expected = host_w8a8(&x, &pruned, &host_bias, (m, k, n), Precision::Int8);
                let err = rel_err(&a, &expected);
                assert!(err < 1e-3, "{pattern} m={m} k={k} n={n}: rel err {err:.2e}");
            }
            println!(
                "{pattern} k={k} n={n}: bit-identical to cuSPARSELt's layer, within 1e-3 of W8A8"
            );
        }
    }
}

/// `v` rounded to nearest even in `dtype` (bf16 or f16), as f32.
fn round_to(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => unreachable!("16-bit types only"),
    }
}

#[test]
#[ignore = "needs an NVIDIA Hopper GPU"]
fn compact_gemm_applies_the_epilogue_itself_for_16_bit_outputs() {
    if !hopper() {
        return;
    }
    // A bf16 / f16 forward of the compact layer runs the GEMM with its own epilogue (scales,
    // bias, rounding in the kernel, no INT32 array); an f32 forward of the same values runs
    // the INT32 GEMM and the pipeline's epilogue kernel. The quantization sees the same f32
    // values either way, so both sum the same exact INT32 products: each 16-bit output must be
    // the f32 output rounded once, except where the two epilogues' f32 arithmetic (the f32
    // one may fuse the multiply-add) straddles a rounding boundary of the 16-bit type. A 6:8
    // layer's GEMV computes its epilogue in the same order as the GEMM's, so there the first
    // 16 tokens of a 17-token forward (the GEMM) are bit for bit a 16-token forward (the GEMV).
    let mut rng = rng(302);
    for pattern in [
        SparsityPattern::P6_8,
        SparsityPattern::P2_4,
        "14:16".parse().unwrap(),
    ] {
        // n = 100: rows not a whole number of 16-byte pieces (the kernel's per-value stores);
        // 384: three row tiles of whole pieces.
        for (k, n) in [(1000, 100), (4096, 384)] {
            // Without a bias the kernel adds nothing (a -0 stays -0).
            let (packed, b) = random_layer(&mut rng, pattern, (k, n));
            let with_bias = packed.bias.is_some();
            let ours = layer(&packed, SparseGemmChoice::Compact);
            for dtype in [DType::BF16, DType::F16] {
                // 17: past the GEMV; 256 and 300: one token tile and a partial second.
                for m in [17, 256, 300] {
                    let x: Vec<f32> = random_f32(&mut rng, m * k)
                        .into_iter()
                        .map(|v| round_to(v, dtype))
                        .collect();
                    assert!(
                        ours.gemm.accumulator(Precision::Int8, dtype, m).finished,
                        "{pattern} {dtype:?} m={m}: the GEMM writes the output itself"
                    );
                    let exact = forward(&ours, &x, (m, k));
                    let got = forward_as(&ours, &x, (m, k), dtype);
                    if m == 17 && ours.gemv_reads().is_some() {
                        let gemv = forward_as(&ours, &x[..16 * k], (16, k), dtype);
                        let first = gemv
                            .iter()
                            .zip(&got)
                            .position(|(p, q)| p.to_bits() != q.to_bits());
                        assert!(
                            first.is_none(),
                            "{pattern} {dtype:?} k={k} n={n}: GEMV and GEMM differ at {first:?}"
                        );
                    }
                    let mut near_ties = 0;
                    for (i, (&g, &e)) in got.iter().zip(&exact).enumerate() {
                        if g.to_bits() == round_to(e, dtype).to_bits() {
                            continue;
                        }
                        // Each epilogue rounds the product `acc * s_x * s_w` and the sum with
                        // the bias at most once more than the other: a few f32 ulps of the
                        // larger of the two.
                        let slack = 4.0 * f32::EPSILON * (e.abs() + b[i % n].abs());
                        let (lo, hi) = (round_to(e - slack, dtype), round_to(e + slack, dtype));
                        assert!(
                            g == lo || g == hi,
                            "{pattern} {dtype:?} m={m} k={k} n={n}: element {i}: {g} against \
                             {e} (f32 path)"
                        );
                        near_ties += 1;
                    }
                    assert!(
                        near_ties * 1000 <= got.len(),
                        "{pattern} {dtype:?} m={m}: {near_ties} of {} differ",
                        got.len()
                    );
                }
            }
            println!(
                "{pattern} k={k} n={n} bias={with_bias}: bf16 and f16 outputs the f32 path's, \
                 rounded once"
            );
        }
    }
}
