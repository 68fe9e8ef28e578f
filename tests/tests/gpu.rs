//! GPU tests: the CUDA backend against the CPU reference on fresh random data.
//!
//! They need an NVIDIA GPU with cuSPARSELt, so they are `#[ignore]`d (and only built with
//! `--features cuda`); run them on the GPU host with `--ignored`.
#![cfg(feature = "cuda")]

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    PackOptions, PackedLinear, Precision, SlideSparseLinear, SparsityPattern, pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};
use rand::Rng;
use slidesparse_tests::{random_f32, rng};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type Cpu = NdArray;

const NEEDS_GPU: &str = "needs an NVIDIA GPU and cuSPARSELt";

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

fn run_both(packed: &PackedLinear, x: &[f32], shape: [usize; 2]) -> (Vec<f32>, Vec<f32>) {
    let cpu = SlideSparseLinear::<Cpu>::from_packed(packed, &Default::default());
    let gpu = SlideSparseLinear::<Gpu>::from_packed(packed, &Default::default());
    let xc = Tensor::<Cpu, 2>::from_data(TensorData::new(x.to_vec(), shape), &Default::default());
    let xg = Tensor::<Gpu, 2>::from_data(TensorData::new(x.to_vec(), shape), &Default::default());
    let yc = cpu.forward(xc).into_data().into_vec::<f32>().unwrap();
    let yg = gpu
        .try_forward(xg)
        .unwrap()
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    (yg, yc)
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn gpu_matches_the_reference_for_every_pattern_precision_and_odd_shape() {
    let _ = NEEDS_GPU;
    let mut rng = rng(100);
    let patterns = [
        SparsityPattern::P2_4,
        SparsityPattern::P4_6,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
        "14:16".parse().unwrap(),
    ];
    let mut report = Vec::new();
    for pattern in patterns {
        for precision in [
            Precision::Int8,
            Precision::Fp8,
            Precision::Bf16,
            Precision::F16,
        ] {
            for (m, k, n) in [(1, 100, 50), (17, 576, 96), (1000, 1000, 200)] {
                let with_bias = rng.random_bool(0.5);
                let w = random_f32(&mut rng, n * k);
                let b = random_f32(&mut rng, n);
                let (packed, _, _) = pack_linear(
                    "w",
                    &w,
                    n,
                    k,
                    with_bias.then_some(&b[..]),
                    &PackOptions::new(pattern, precision),
                )
                .unwrap();
                let x = random_f32(&mut rng, m * k);
                let (yg, yc) = run_both(&packed, &x, [m, k]);
                let err = rel_err(&yg, &yc);
                report.push(format!(
                    "{pattern} {precision} m={m} k={k} n={n} bias={with_bias}: {err:.2e}"
                ));
                assert!(err < tolerance(precision), "{}", report.last().unwrap());
            }
        }
    }
    println!("{}", report.join("\n"));
}

#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn gpu_rank3_large_m_and_nan_rows() {
    let mut rng = rng(101);
    let (k, n) = (512, 256);
    let w = random_f32(&mut rng, n * k);
    let (packed, _, _) = pack_linear(
        "w",
        &w,
        n,
        k,
        None,
        &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
    )
    .unwrap();
    // Large M.
    let m = 65536;
    let x = random_f32(&mut rng, m * k);
    let (yg, yc) = run_both(&packed, &x, [m, k]);
    let err = rel_err(&yg, &yc);
    println!("large M = {m}: rel err {err:.2e}");
    assert!(err < 1e-3);
    // Rank 3.
    let gpu = SlideSparseLinear::<Gpu>::from_packed(&packed, &Default::default());
    let x3 = Tensor::<Gpu, 3>::from_data(
        TensorData::new(random_f32(&mut rng, 2 * 5 * k), [2, 5, k]),
        &Default::default(),
    );
    assert_eq!(gpu.forward(x3).dims(), [2, 5, n]);
    // NaN / Inf rows become NaN rows; the others stay finite.
    let mut x = random_f32(&mut rng, 4 * k);
    x[k + 3] = f32::NAN;
    x[3 * k] = f32::NEG_INFINITY;
    let (yg, _) = run_both(&packed, &x, [4, k]);
    for (row, expect_nan) in [(0, false), (1, true), (2, false), (3, true)] {
        let r = &yg[row * n..(row + 1) * n];
        if expect_nan {
            assert!(r.iter().all(|v| v.is_nan()), "row {row}");
        } else {
            assert!(r.iter().all(|v| v.is_finite()), "row {row}");
        }
    }
}

/// The quant+lift kernel alone, bit for bit against the host reference of the spec.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn quant_lift_kernel_is_bit_exact() {
    use burn_slidesparse::{cuda::backend::launch_quant_lift, fp8, reference::ACTIVATION_EPS};
    let client = CudaRuntime::client(&Default::default());
    let mut rng = rng(102);
    for pattern in SparsityPattern::all().take(8) {
        for precision in [Precision::Int8, Precision::Fp8] {
            let (m, k): (usize, usize) = (rng.random_range(1..40), rng.random_range(1..700));
            let g = pattern.geometry(k, 64);
            let m_pad = m.next_multiple_of(16);
            let mut x = random_f32(&mut rng, m * k);
            x.iter_mut().for_each(|v| *v *= 10.0);
            let xh = client
                .create_from_slice(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
            let codes = client.empty(m_pad * g.k_prime());
            let scales = client.empty(m_pad * 4);
            launch_quant_lift::<f32>(
                &client,
                &xh,
                &codes,
                &scales,
                (m, m_pad, k, g.k_slide(), g.k_prime()),
                g.n,
                precision,
            )
            .unwrap();
            let got = client.read_one(codes).unwrap().to_vec();
            let got_scales: Vec<f32> = client
                .read_one(scales)
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let qmax = precision.qmax().unwrap();
            for row in 0..m_pad {
                let xr = if row < m {
                    &x[row * k..(row + 1) * k]
                } else {
                    &[][..]
                };
                let absmax = xr.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let s = if row < m {
                    absmax.max(ACTIVATION_EPS) / qmax
                } else {
                    1.0
                };
                assert_eq!(
                    got_scales[row].to_bits(),
                    s.to_bits(),
                    "{pattern} {precision} row {row}"
                );
                for o in 0..g.k_prime() {
                    let v = g.source(o).filter(|_| row < m).map_or(0.0, |src| xr[src]);
                    let expected = match precision {
                        Precision::Int8 => {
                            (v / s).round_ties_even().clamp(-127.0, 127.0) as i8 as u8
                        }
                        _ => fp8::f32_to_e4m3((v / s).clamp(-448.0, 448.0)),
                    };
                    let got = got[row * g.k_prime() + o];
                    // +0 and -0 are the same code value.
                    let same = got == expected
                        || (precision == Precision::Fp8 && (got | expected) & 0x7F == 0);
                    assert!(
                        same,
                        "{pattern} {precision} row {row} col {o}: got {got:#x}, expected {expected:#x}"
                    );
                }
            }
        }
    }
}

/// The no-sync (flags) ordering and the host-sync ordering compute the same bits, over many
/// back-to-back forwards (a race would show as a moving error).
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn flag_ordering_matches_host_ordering_bit_for_bit() {
    use burn_slidesparse::cuda::{ordering::SyncMode, state::device_state};
    let mut rng = rng(103);
    let (m, k, n) = (333, 2048, 1024);
    let w = random_f32(&mut rng, n * k);
    let (packed, _, _) = pack_linear(
        "w",
        &w,
        n,
        k,
        None,
        &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
    )
    .unwrap();
    let layer = SlideSparseLinear::<Gpu>::from_packed(&packed, &Default::default());
    let xs: Vec<Tensor<Gpu, 2>> = (0..8)
        .map(|_| {
            Tensor::from_data(
                TensorData::new(random_f32(&mut rng, m * k), [m, k]),
                &Default::default(),
            )
        })
        .collect();
    let run = |mode| {
        device_state(0).unwrap().lock().unwrap().sync_mode = mode;
        // Queue everything first, read back at the end: no host sync between forwards.
        let ys: Vec<_> = (0..32).map(|i| layer.forward(xs[i % 8].clone())).collect();
        ys.into_iter()
            .map(|y| y.into_data().into_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let host = run(SyncMode::Host);
    let flags = run(SyncMode::Flags);
    assert_eq!(host, flags);
    // Repeated inputs give identical outputs (i and i + 8).
    for i in 0..24 {
        assert_eq!(flags[i], flags[i + 8]);
    }
}

/// The dense baseline (same quantization kernel without lift, cuBLASLt, same epilogue)
/// against a host computation of the same W8A8 arithmetic.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn dense_baseline_matches_host_w8a8() {
    use burn_slidesparse::{
        cuda::dense::DenseLayerGpu, quant::quantize_weight, reference::ACTIVATION_EPS,
    };
    let client = CudaRuntime::client(&Default::default());
    let mut rng = rng(104);
    for precision in [Precision::Int8, Precision::Fp8] {
        let (m, k, n) = (37, 1000, 320);
        let w = random_f32(&mut rng, n * k);
        let b = random_f32(&mut rng, n);
        let qw = quantize_weight(&w, n, k, precision);
        let layer = DenseLayerGpu::new(&client, 0, &qw, Some(&b)).unwrap();
        let x = random_f32(&mut rng, m * k);
        let xg =
            Tensor::<Gpu, 2>::from_data(TensorData::new(x.clone(), [m, k]), &Default::default());
        let y = layer.forward::<f32>(&xg.into_primitive().tensor()).unwrap();
        let y = Tensor::<Gpu, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(y))
            .into_data()
            .into_vec::<f32>()
            .unwrap();
        let wq = qw.codes.to_f32();
        let qmax = precision.qmax().unwrap();
        let mut expected = vec![0f32; m * n];
        for i in 0..m {
            let row = &x[i * k..(i + 1) * k];
            let s = row
                .iter()
                .fold(0f32, |a, v| a.max(v.abs()))
                .max(ACTIVATION_EPS)
                / qmax;
            let q: Vec<f32> = row.iter().map(|&v| precision.quantize(v, s)).collect();
            for j in 0..n {
                let acc: f64 = (0..k).map(|t| q[t] as f64 * wq[j * k + t] as f64).sum();
                expected[i * n + j] = (acc as f32) * s * qw.scales[j] + b[j];
            }
        }
        let err = rel_err(&y, &expected);
        println!("dense {precision}: rel err {err:.2e}");
        assert!(err < tolerance(precision), "{precision}: {err}");
    }
}
