//! GPU tests of layers packed with an input-channel permutation: the quant+lift kernels with
//! the permutation folded into their map, bit for bit against the host spec, and whole
//! permuted layers (plain burn-cuda, the fusion backend, bf16 activations, fused q/k/v)
//! against the CPU reference on fresh random data.
//!
//! They need an NVIDIA GPU with cuSPARSELt, so they are `#[ignore]`d (and only built with
//! `--features cuda`); run them on the GPU host with `--ignored`.
#![cfg(feature = "cuda")]

use burn::{
    backend::NdArray,
    tensor::{DType, Tensor, TensorData},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    ChannelPermutation, InputPermutation, MaybeSparseLinear, PackOptions, PackedLinear,
    PermutationSearch, Precision, PruneMethod, SlideSparseLinear, SparsityPattern, concat_outputs,
    cuda::launch::{QuantKernel, launch_quant_lift_permuted},
    pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};
use rand::{Rng, seq::SliceRandom};
use slidesparse_tests::{check_quant_codes, host_w8a8, random_f32, relative_l2 as rel_err, rng};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type GpuBf16 = CubeBackend<CudaRuntime, half::bf16, i32, u8>;
type Fused = burn_fusion::Fusion<Gpu>;
type Cpu = NdArray;

/// A uniformly random order of `k` channels.
fn random_order(rng: &mut impl Rng, k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..k as u32).collect();
    order.shuffle(rng);
    order
}

/// Runs the quant+lift launcher's kernels with `order` folded into the map on `x [m, k]`
/// (uploaded as `F`), and checks codes and scales bit for bit against the spec on the host:
/// `X'[r, o] = X[r, order[src(o)]]`. An explicit grouped layout that cannot take the row
/// (too long for the stage) is skipped; one that loads ahead must be refused.
fn check_permuted_quant_lift<F: burn_cubecl::FloatElement>(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    x: &[f32],
    (m, k): (usize, usize),
    pattern: SparsityPattern,
    precision: Precision,
    order: &[u32],
) {
    let label = format!(
        "{pattern} {precision} {} m={m} k={k}",
        core::any::type_name::<F>()
    );
    let g = pattern.geometry(k, 64);
    let source = |o: usize| g.source(o).map(|s| order[s] as usize);
    let m_pad = m.next_multiple_of(16);
    let xf: Vec<F> = x.iter().map(|&v| F::from_elem(v)).collect();
    let x: Vec<f32> = xf.iter().map(|v| v.elem::<f32>()).collect();
    let xh = client.create_from_slice(F::as_bytes(&xf));
    let bytes: Vec<u8> = order.iter().flat_map(|v| v.to_le_bytes()).collect();
    let perm = client.create_from_slice(&bytes);
    let grouped = |prefetch| QuantKernel::Grouped {
        units: None,
        rows_per_cube: if prefetch { 3 } else { 1 },
        prefetch,
        staged_stores: false,
    };
    for kernel in [
        QuantKernel::Auto,
        QuantKernel::RowStaged,
        grouped(false),
        grouped(true),
    ] {
        let codes = client.empty(m_pad * g.k_prime());
        let scales = client.empty(m_pad * 4);
        let launched = launch_quant_lift_permuted(
            kernel,
            client,
            &xh,
            Some(&perm),
            &codes,
            &scales,
            (m, m_pad, k, g.k_slide(), g.k_prime()),
            g.n,
            precision,
            F::dtype(),
        );
        if kernel == grouped(true) {
            assert!(
                launched.is_err(),
                "{label}: a prefetching layout takes no permutation"
            );
            continue;
        }
        if kernel == grouped(false) && launched.is_err() {
            continue;
        }
        launched.unwrap();
        let got = client.read_one(codes).unwrap().to_vec();
        let got_scales: Vec<f32> = client
            .read_one(scales)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let label = format!("{label} {kernel:?}");
        check_quant_codes(
            &x,
            &got,
            &got_scales,
            (m, m_pad, k, g.k_prime()),
            &source,
            precision,
            &label,
        );
    }
}

/// The quant+lift kernels with a random input permutation in their map, bit for bit against
/// the host spec: every pattern up to 16:18, INT8 and FP8, f32 and bf16 input, K of every
/// divisibility, LLM widths (576, 1536, 4096, 14336) and rows too long for the grouped
/// kernel's stage (the row-staged kernel then gathers from global memory).
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn permuted_quant_lift_kernel_is_bit_exact() {
    let client = CudaRuntime::client(&Default::default());
    let mut rng = rng(4401);
    for pattern in SparsityPattern::all().take(8) {
        for precision in [Precision::Int8, Precision::Fp8] {
            for k in [
                rng.random_range(1..700),
                8 * rng.random_range(1..90),
                576,
                1536,
                4096,
                14_336,
                30_000,
            ] {
                let m: usize = rng.random_range(1..40);
                let mut x = random_f32(&mut rng, m * k);
                x.iter_mut().for_each(|v| *v *= 10.0);
                let order = random_order(&mut rng, k);
                check_permuted_quant_lift::<f32>(&client, &x, (m, k), pattern, precision, &order);
                check_permuted_quant_lift::<half::bf16>(
                    &client,
                    &x,
                    (m, k),
                    pattern,
                    precision,
                    &order,
                );
            }
        }
    }
}

/// Relative error allowed between the GPU and the reference (same codes; different
/// accumulation order, and 16-bit activations rounded on the GPU only).
fn tolerance(p: Precision) -> f64 {
    match p {
        Precision::Int8 | Precision::Fp8 => 1e-3,
        Precision::Bf16 => 1.5e-2,
        Precision::F16 => 3e-3,
        Precision::F32 => 1e-5,
    }
}

fn read<B: burn::tensor::backend::Backend>(y: Tensor<B, 2>) -> Vec<f32> {
    y.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// `packed`'s output on `x [m, k]` on the CPU reference, plain burn-cuda, the fusion backend
/// and (16-bit and 8-bit precisions) burn-cuda with bf16 activations, in that order.
fn outputs(packed: &PackedLinear, x: &[f32], shape: [usize; 2]) -> Vec<(&'static str, Vec<f32>)> {
    let data = || TensorData::new(x.to_vec(), shape);
    let cpu = SlideSparseLinear::<Cpu>::from_packed(packed, &Default::default());
    let gpu = SlideSparseLinear::<Gpu>::from_packed(packed, &Default::default());
    let fused = SlideSparseLinear::<Fused>::from_packed(packed, &Default::default());
    let bf16 = SlideSparseLinear::<GpuBf16>::from_packed(packed, &Default::default());
    let device: burn::tensor::Device<Gpu> = Default::default();
    let on = |dtype| (&device, dtype);
    vec![
        (
            "cpu",
            read(cpu.forward(Tensor::<Cpu, 2>::from_data(data(), &Default::default()))),
        ),
        (
            "cuda",
            read(
                gpu.try_forward(Tensor::<Gpu, 2>::from_data(data(), on(DType::F32)))
                    .unwrap(),
            ),
        ),
        (
            "fusion",
            read(
                fused
                    .try_forward(Tensor::<Fused, 2>::from_data(data(), on(DType::F32)))
                    .unwrap(),
            ),
        ),
        (
            "cuda bf16",
            read(
                bf16.try_forward(Tensor::<GpuBf16, 2>::from_data(data(), on(DType::BF16)))
                    .unwrap(),
            ),
        ),
    ]
}

/// Permuted layers (a searched order and a random one) on every GPU path against the CPU
/// reference, for every pattern, precision and odd shape; INT8 layers also against the
/// host W8A8 of the pruned weight in the original order (the function the permutation must
/// keep).
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn permuted_layers_match_the_reference_on_every_gpu_path() {
    let mut rng = rng(4402);
    let mut report = Vec::new();
    for pattern in [
        SparsityPattern::P2_4,
        SparsityPattern::P4_6,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
        "14:16".parse().unwrap(),
    ] {
        for precision in [
            Precision::Int8,
            Precision::Fp8,
            Precision::Bf16,
            Precision::F16,
        ] {
            for (i, (m, k, n)) in [
                (1, 100, 50),
                (17, 576, 96),
                (300, 1536, 200),
                (64, 4096, 128),
            ]
            .into_iter()
            .enumerate()
            {
                let permutation = if i % 2 == 0 {
                    ChannelPermutation::Search(PermutationSearch::default())
                } else {
                    ChannelPermutation::Given(
                        InputPermutation::new(random_order(&mut rng, k)).unwrap(),
                    )
                };
                let options = PackOptions {
                    permutation,
                    ..PackOptions::new(pattern, precision)
                };
                let w = random_f32(&mut rng, n * k);
                let b = random_f32(&mut rng, n);
                let (packed, reference, _) =
                    pack_linear("w", &w, n, k, Some(&b), &options).unwrap();
                assert!(packed.input_permutation.is_some());
                // bf16-representable inputs: the bf16 path quantizes the same values as the
                // f32 reference (FP8's 3 mantissa bits flip codes on a bf16 rounding).
                let x: Vec<f32> = random_f32(&mut rng, m * k)
                    .into_iter()
                    .map(|v| half::bf16::from_f32(v).to_f32())
                    .collect();
                let ys = outputs(&packed, &x, [m, k]);
                let cpu = &ys[0].1;
                for (path, y) in &ys[1..] {
                    let err = rel_err(y, cpu);
                    let tol = if *path == "cuda bf16" {
                        tolerance(Precision::Bf16)
                    } else {
                        tolerance(precision)
                    };
                    report.push(format!(
                        "{pattern} {precision} {path} m={m} k={k} n={n}: {err:.2e}"
                    ));
                    assert!(err < tol, "{}", report.last().unwrap());
                }
                if precision == Precision::Int8 {
                    let host = host_w8a8(&x, &reference, &b, (m, k, n), precision);
                    let err = rel_err(&ys[1].1, &host);
                    assert!(
                        err < tolerance(precision),
                        "{pattern} m={m} k={k}: vs original order {err:.2e}"
                    );
                }
            }
        }
    }
    println!("{}", report.join("\n"));
}

/// q/k/v packed with one searched order, fused into one layer on the GPU: its output is the
/// three layers' outputs side by side (the same codes and scales, one lift through the
/// shared permutation), and matches the CPU reference.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn fused_permuted_projections_match_the_separate_layers() {
    let mut rng = rng(4403);
    let (m, k, outs) = (33, 576, [576usize, 192, 192]);
    let weights: Vec<Vec<f32>> = outs.iter().map(|&n| random_f32(&mut rng, n * k)).collect();
    let method = PruneMethod::Magnitude;
    let layers: Vec<(&[f32], usize, &PruneMethod)> = weights
        .iter()
        .zip(outs)
        .map(|(w, n)| (w.as_slice(), n, &method))
        .collect();
    let order = burn_slidesparse::search_permutation(
        "qkv",
        &layers,
        k,
        SparsityPattern::P6_8,
        &PermutationSearch::default(),
    )
    .unwrap()
    .permutation;
    let options = PackOptions {
        permutation: ChannelPermutation::Given(order),
        ..PackOptions::new(SparsityPattern::P6_8, Precision::Int8)
    };
    let packed: Vec<PackedLinear> = weights
        .iter()
        .zip(outs)
        .map(|(w, n)| pack_linear("w", w, n, k, None, &options).unwrap().0)
        .collect();
    let device = Default::default();
    let separate: Vec<MaybeSparseLinear<Gpu>> = packed
        .iter()
        .map(|p| SlideSparseLinear::<Gpu>::from_packed(p, &device).into())
        .collect();
    let fused = concat_outputs(&separate.iter().collect::<Vec<_>>()).unwrap();
    let x = random_f32(&mut rng, m * k);
    let input =
        || Tensor::<Gpu, 2>::from_data(TensorData::new(x.clone(), [m, k]), (&device, DType::F32));
    let together = read(fused.try_forward(input()).unwrap());
    let parts: Vec<Vec<f32>> = separate
        .iter()
        .map(|l| read(l.try_forward(input()).unwrap()))
        .collect();
    let total: usize = outs.iter().sum();
    for r in 0..m {
        let mut offset = 0;
        for (part, &n) in parts.iter().zip(&outs) {
            assert_eq!(
                &together[r * total + offset..r * total + offset + n],
                &part[r * n..(r + 1) * n],
                "row {r}"
            );
            offset += n;
        }
    }
    let cpu: Vec<Vec<f32>> = packed
        .iter()
        .map(|p| {
            let layer = SlideSparseLinear::<Cpu>::from_packed(p, &Default::default());
            read(layer.forward(Tensor::<Cpu, 2>::from_data(
                TensorData::new(x.clone(), [m, k]),
                &Default::default(),
            )))
        })
        .collect();
    for (gpu, cpu) in parts.iter().zip(&cpu) {
        assert!(rel_err(gpu, cpu) < tolerance(Precision::Int8));
    }
}
