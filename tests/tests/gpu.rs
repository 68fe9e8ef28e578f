//! GPU tests: the CUDA backend against the CPU reference on fresh random data.
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
    PackOptions, PackedLinear, Precision, SlideSparseLinear, SparsityPattern, pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};
use rand::Rng;
use slidesparse_tests::{check_quant_codes, host_w8a8, random_f32, relative_l2 as rel_err, rng};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type GpuBf16 = CubeBackend<CudaRuntime, half::bf16, i32, u8>;
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
    let xg = on_gpu::<Gpu, 2>(x.to_vec(), shape, DType::F32);
    let yc = cpu.forward(xc).into_data().into_vec::<f32>().unwrap();
    let yg = gpu
        .try_forward(xg)
        .unwrap()
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap();
    (yg, yc)
}

/// A GPU tensor of an explicit dtype. burn 0.21 keeps one default float dtype per device
/// (set by the first backend that touches it), so a test process that uses both the f32 and
/// the bf16 backend must name the dtype it means.
fn on_gpu<B: burn::tensor::backend::Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: DType,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, shape), (&Default::default(), dtype))
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
    let x3 = on_gpu::<Gpu, 3>(random_f32(&mut rng, 2 * 5 * k), [2, 5, k], DType::F32);
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

/// Maps an output column of the lifted row to its source column (None: zero padding).
type LiftSource = dyn Fn(usize) -> Option<usize>;

/// Runs both quant+lift kernels (the forward's choice and the row-staged one) on `x [m, k]`
/// (uploaded as `F`) and checks codes and scales bit for bit against the spec computed on the
/// host. `n == 0` is the dense baseline
/// (plain quantization), whose output width is `K` rounded up to 16.
fn check_quant_lift<F: burn_cubecl::FloatElement>(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    x: &[f32],
    (m, k): (usize, usize),
    pattern: Option<SparsityPattern>,
    precision: Precision,
) {
    use burn_slidesparse::cuda::launch::{QuantKernel, launch_quant_lift_with};
    let label = format!(
        "{} {precision} {} m={m} k={k}",
        pattern.map_or("dense".into(), |p| p.to_string()),
        core::any::type_name::<F>()
    );
    let (n, k_slide, k_out, source): (u32, usize, usize, Box<LiftSource>) = match pattern {
        Some(p) => {
            let g = p.geometry(k, 64);
            (
                g.n,
                g.k_slide(),
                g.k_prime(),
                Box::new(move |o| g.source(o)),
            )
        }
        None => (
            0,
            k,
            k.next_multiple_of(16),
            Box::new(move |o| (o < k).then_some(o)),
        ),
    };
    let m_pad = m.next_multiple_of(16);
    // The values the kernel sees: `x` rounded to `F`.
    let xf: Vec<F> = x.iter().map(|&v| F::from_elem(v)).collect();
    let x: Vec<f32> = xf.iter().map(|v| v.elem::<f32>()).collect();
    let xh = client.create_from_slice(F::as_bytes(&xf));
    // Besides the forward's choice (one row per cube, direct stores; 8-bit codes as packed
    // words): a grouped layout whose cubes take 3 rows each (not dividing
    // `m_pad`: the last cube stops early), load the next row ahead and always stage their
    // stores; it refuses rows it cannot take.
    let several_rows = QuantKernel::Grouped {
        units: None,
        rows_per_cube: 3,
        prefetch: true,
        staged_stores: true,
    };
    for kernel in [QuantKernel::Auto, QuantKernel::RowStaged, several_rows] {
        let codes = client.empty(m_pad * k_out);
        let scales = client.empty(m_pad * 4);
        let launched = launch_quant_lift_with(
            kernel,
            client,
            &xh,
            &codes,
            &scales,
            (m, m_pad, k, k_slide, k_out),
            n,
            precision,
            F::dtype(),
        );
        if matches!(kernel, QuantKernel::Grouped { .. }) && launched.is_err() {
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
            (m, m_pad, k, k_out),
            &*source,
            precision,
            &label,
        );
    }
}

/// The quant+lift kernels alone, bit for bit against the host reference of the spec: every
/// pattern, f32 and bf16 input, K of every divisibility (vector widths 8/4/2/1), the grouped
/// kernel with one to several groups per unit and cubes up to 1024 units (K up to 65536),
/// the row-staged kernel with rows staged in shared memory and read from global memory
/// twice, the plain quantization of the dense baseline, and INT8 and FP8 quotients on and
/// next to every rounding boundary (where a multiplication by `1 / s` alone would round the
/// other way; the kernels correct it with two FMAs).
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn quant_lift_kernel_is_bit_exact() {
    let client = CudaRuntime::client(&Default::default());
    let mut rng = rng(102);
    let patterns = SparsityPattern::all().take(8).map(Some).chain([None]);
    for pattern in patterns {
        for precision in [Precision::Int8, Precision::Fp8] {
            for k in [
                rng.random_range(1..700),
                8 * rng.random_range(1..90),
                13_000,
                18_944,
                65_536,
            ] {
                let m: usize = rng.random_range(1..40);
                let mut x = random_f32(&mut rng, m * k);
                x.iter_mut().for_each(|v| *v *= 10.0);
                check_quant_lift::<f32>(&client, &x, (m, k), pattern, precision);
                check_quant_lift::<half::bf16>(&client, &x, (m, k), pattern, precision);
            }
        }
        let k = 4096;
        let x = next_to_rounding_boundaries(&mut rng, k);
        check_quant_lift::<f32>(&client, &x, (x.len() / k, k), pattern, Precision::Int8);
        let x = next_to_fp8_midpoints(&mut rng, k);
        check_quant_lift::<f32>(&client, &x, (x.len() / k, k), pattern, Precision::Fp8);
    }
}

/// Rows whose quotients `x / s` lie on and next to E4M3 rounding midpoints (both signs, the
/// subnormal ones included), where rounding a multiplication by `1 / s` could differ from
/// the spec's division: each row holds its absmax and the 16 f32 values around each
/// midpoint times a random scale.
fn next_to_fp8_midpoints(rng: &mut impl rand::Rng, k: usize) -> Vec<f32> {
    use burn_slidesparse::internals::fp8::e4m3_to_f32;
    let mut magnitudes: Vec<f32> = (0u8..0x7F).map(e4m3_to_f32).collect();
    magnitudes.sort_by(f32::total_cmp);
    let midpoints: Vec<f32> = magnitudes.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    let mut x = Vec::new();
    for _ in 0..4 {
        let absmax: f32 = rng.random_range(0.01..100.0);
        let scale = absmax / 448.0;
        let mut row = vec![absmax];
        let mut i = 0usize;
        while row.len() < k {
            let sign = if (i / midpoints.len()).is_multiple_of(2) {
                1.0
            } else {
                -1.0
            };
            let center = sign * midpoints[i % midpoints.len()] * scale;
            let first = f32::from_bits(center.to_bits().saturating_sub(8));
            row.extend((0..16).map(|u| f32::from_bits(first.to_bits() + u)));
            i += 1;
        }
        row.truncate(k);
        x.extend(row);
    }
    x
}

/// Rows whose quotients `x / s` lie on and next to half-integers, where rounding by a
/// multiplication with `1 / s` could differ from the spec's division: row 0 has `s = 1`
/// (absmax 127) and exact halves; the others a random absmax and the 64 f32 values around
/// each `(j + 1/2) s`.
fn next_to_rounding_boundaries(rng: &mut impl rand::Rng, k: usize) -> Vec<f32> {
    let mut x = vec![127.0f32];
    x.extend((0..k - 1).map(|i| (i % 254) as f32 - 126.5));
    for _ in 0..3 {
        let absmax: f32 = rng.random_range(0.01..100.0);
        let scale = absmax / 127.0;
        let mut row = vec![absmax];
        let mut j = -127i32;
        while row.len() < k {
            let center = (j as f32 + 0.5) * scale;
            let first = f32::from_bits(center.to_bits() - 32);
            row.extend((0..64).map(|u| f32::from_bits(first.to_bits() + u)));
            j = if j == 126 { -127 } else { j + 1 };
        }
        row.truncate(k);
        x.extend(row);
    }
    x
}

/// Puts the device back into its default ordering and replay settings when dropped, even if
/// a test panics, so that a test's settings cannot leak into the tests that run after it.
struct DefaultOrderingOnDrop;

impl Drop for DefaultOrderingOnDrop {
    fn drop(&mut self) {
        use burn_slidesparse::cuda::state::device_state;
        if let Ok(state) = device_state(0) {
            let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
            let _ = state.restore_default_settings();
        }
    }
}

/// Asserts that the current cubecl stream's work on device 0 is ordered on burn's own stream
/// (CUPTI found it), not by host synchronization around it.
fn assert_on_burns_stream(client: &burn_slidesparse::cuda::runtime::Client) {
    use burn_slidesparse::cuda::{SyncMode, queued::lanes};
    let (used, why) = lanes(0)
        .unwrap()
        .lock()
        .unwrap()
        .current()
        .ordering(client, SyncMode::Stream);
    assert_eq!(used, SyncMode::Stream, "fell back to host sync: {why:?}");
}

/// The default no-sync ordering (the GEMM on burn's own stream, found through CUPTI) against
/// host synchronization, on a chain of SlideSparse and dense layers queued back to back with
/// no synchronization at all: each forward reads the previous one's output, so a GEMM that
/// ran before its input was written, or an output reused too early, changes the result.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn stream_ordering_is_bit_identical_to_host_sync_on_a_chain_of_layers() {
    use burn_slidesparse::{
        cuda::{DenseLayerGpu, SyncMode, state::update_settings},
        internals::weight_quant::quantize_weight,
    };
    let _restore = DefaultOrderingOnDrop;
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let mut rng = rng(107);
    let (m, d, h) = (77, 1024, 2048);
    let up_w = random_f32(&mut rng, h * d);
    let down_w = random_f32(&mut rng, d * h);
    let pack = |w: &[f32], n, k, p| {
        pack_linear("w", w, n, k, None, &PackOptions::new(p, Precision::Int8))
            .unwrap()
            .0
    };
    let up =
        SlideSparseLinear::<Gpu>::from_packed(&pack(&up_w, h, d, SparsityPattern::P6_8), &device);
    let down =
        SlideSparseLinear::<Gpu>::from_packed(&pack(&down_w, d, h, SparsityPattern::P2_4), &device);
    let dense_up = DenseLayerGpu::new(
        &client,
        0,
        &quantize_weight(&up_w, h, d, Precision::Int8),
        None,
    )
    .unwrap();
    let x0 = random_f32(&mut rng, m * d);
    let run = |mode| {
        update_settings(0, |s| s.sync = mode).unwrap();
        let mut x = on_gpu::<Gpu, 2>(x0.clone(), [m, d], DType::F32);
        let mut outputs = Vec::new();
        for _ in 0..6 {
            // Keep values O(1) along the chain: weights are uniform in [-1, 1] (std 1/sqrt(3)),
            // so divide each layer's output by sqrt(fan-in / 3).
            let (gain_up, gain_down) = ((d as f32 / 3.0).sqrt(), (h as f32 / 3.0).sqrt());
            let y = up.forward(x.clone()).div_scalar(gain_up);
            let z =
                DenseLayerGpu::forward(&dense_up, &x.clone().into_primitive().tensor()).unwrap();
            let z = Tensor::<Gpu, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(z));
            let hidden = (y + z.div_scalar(gain_up)).div_scalar(2.0);
            x = down.forward(hidden).div_scalar(gain_down);
            outputs.push(x.clone());
        }
        outputs
            .into_iter()
            .map(|y| y.into_data().convert::<f32>().into_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let host = run(SyncMode::Host);
    let stream = run(SyncMode::Stream);
    assert_on_burns_stream(&client);
    for (i, (h, s)) in host.iter().zip(&stream).enumerate() {
        assert!(
            h.iter().all(|v| v.is_finite()),
            "step {i}: non-finite values"
        );
        assert!(h.iter().any(|v| *v != 0.0), "step {i}: all zero");
        assert_eq!(h, s, "step {i}: stream ordering differs from host sync");
    }
    println!("stream ordering: 6 chained steps (3 GEMMs each) bit-identical to host sync");
}

/// Decode-sized forwards keep their intermediate buffers per thread and replay the GEMM
/// from a CUDA graph (`cuda/buffers.rs`, `cuda/graphs.rs`). SlideSparse layers of three
/// patterns, shapes and precisions and a dense layer, interleaved back to back at M that
/// grow, shrink and repeat (capture, then replay; the kept buffers shared by all layers and
/// grown on the way), on fresh random inputs: bit-identical to direct library calls, and
/// within tolerance of the CPU reference.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn decode_graph_replay_is_bit_identical_to_direct_calls() {
    use burn_slidesparse::{
        cuda::{DenseLayerGpu, GraphMode, Settings, SyncMode, queued::lanes, state::device_state},
        internals::weight_quant::quantize_weight,
    };
    let _restore = DefaultOrderingOnDrop;
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let mut rng = rng(110);
    let specs = [
        (SparsityPattern::P6_8, Precision::Int8, 1024, 3000),
        (SparsityPattern::P2_4, Precision::Fp8, 512, 2048),
        (SparsityPattern::P4_6, Precision::Int8, 2048, 640),
    ];
    let packed: Vec<PackedLinear> = specs
        .iter()
        .map(|&(pattern, precision, k, n)| {
            let (w, b) = (random_f32(&mut rng, n * k), random_f32(&mut rng, n));
            let options = PackOptions::new(pattern, precision);
            pack_linear("w", &w, n, k, Some(&b), &options).unwrap().0
        })
        .collect();
    let gpu: Vec<_> = packed
        .iter()
        .map(|p| SlideSparseLinear::<Gpu>::from_packed(p, &device))
        .collect();
    let (dk, dn) = (1024, 1536);
    let (dw, db) = (random_f32(&mut rng, dn * dk), random_f32(&mut rng, dn));
    let dense_w = quantize_weight(&dw, dn, dk, Precision::Int8);
    let dense = DenseLayerGpu::new(&client, 0, &dense_w, Some(&db)).unwrap();
    // Each step: M, then one fresh input per layer (sparse layers, then the dense one).
    let ms = [1, 5, 16, 33, 64, 1, 64, 16];
    let widths: Vec<usize> = specs.iter().map(|s| s.2).chain([dk]).collect();
    let inputs: Vec<Vec<Vec<f32>>> = ms
        .iter()
        .flat_map(|&m| [m, m])
        .map(|m| {
            widths
                .iter()
                .map(|&k| random_f32(&mut rng, m * k))
                .collect()
        })
        .collect();
    let steps: Vec<usize> = ms.iter().flat_map(|&m| [m, m]).collect();
    let run = |graphs: bool, queued: bool| {
        {
            let state = device_state(0).unwrap();
            let graphs = match (graphs, queued) {
                (false, _) => GraphMode::Off,
                (true, false) => GraphMode::Blocking,
                (true, true) => GraphMode::Queued,
            };
            let sync = SyncMode::Stream;
            state
                .lock()
                .unwrap()
                .set_settings(Settings { sync, graphs });
        }
        // Everything queued back to back; read at the end.
        let mut outputs = Vec::new();
        for (&m, xs) in steps.iter().zip(&inputs) {
            for (layer, x) in gpu.iter().zip(xs) {
                let k = x.len() / m;
                outputs.push(layer.forward(on_gpu::<Gpu, 2>(x.clone(), [m, k], DType::F32)));
            }
            let x = on_gpu::<Gpu, 2>(xs[3].clone(), [m, dk], DType::F32);
            let y = dense.forward(&x.into_primitive().tensor()).unwrap();
            outputs.push(Tensor::from_primitive(
                burn::tensor::TensorPrimitive::Float(y),
            ));
        }
        outputs
            .into_iter()
            .map(|y| y.into_data().convert::<f32>().into_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let direct = run(false, false);
    // Captures (and blocking replays), then replays queued on cubecl's device thread.
    let blocking = run(true, false);
    let replayed = run(true, true);
    let lanes = lanes(0).unwrap();
    let mut lanes = lanes.lock().unwrap();
    let graphs = &lanes.current().graphs;
    assert_eq!(graphs.last_failure(), None, "a GEMM capture failed");
    let captured = graphs.captured();
    drop(lanes);
    // At least one graph per layer and M bucket (M padded to 16: 16, 48, 64) in which the
    // layer runs the library GEMM; more only where the kept buffers grew between uses (the
    // direct run above already grew them). With the decode GEMV on, the INT8 6:8 and dense
    // INT8 layers run forwards of up to 16 tokens on it, not on a GEMM graph.
    let gemv = burn_slidesparse::cuda::config::config()
        .unwrap()
        .decode_gemv;
    let expected = if gemv { 2 * 3 + 2 * 2 } else { 4 * 3 };
    assert!(
        captured >= expected,
        "only {captured} GEMM calls were captured, {expected} expected"
    );
    let cpu: Vec<_> = packed
        .iter()
        .map(|p| SlideSparseLinear::<Cpu>::from_packed(p, &Default::default()))
        .collect();
    let mut worst = 0f64;
    for (step, (&m, xs)) in steps.iter().zip(&inputs).enumerate() {
        for (i, x) in xs.iter().enumerate() {
            let at = step * 4 + i;
            assert_eq!(direct[at], blocking[at], "step {step} (M = {m}) layer {i}");
            assert_eq!(
                direct[at], replayed[at],
                "step {step} (M = {m}) layer {i} (queued)"
            );
            let k = x.len() / m;
            let expected = if i < 3 {
                let xc = Tensor::<Cpu, 2>::from_data(
                    TensorData::new(x.clone(), [m, k]),
                    &Default::default(),
                );
                cpu[i].forward(xc).into_data().into_vec::<f32>().unwrap()
            } else {
                host_w8a8(x, &dense_w, &db, (m, dk, dn), Precision::Int8)
            };
            let err = rel_err(&replayed[at], &expected);
            worst = worst.max(err);
            assert!(
                err < 1e-3,
                "step {step} (M = {m}) layer {i}: rel err {err:.2e}"
            );
        }
    }
    println!(
        "graph replay: {} forwards, blocking and queued, bit-identical to direct calls, {captured} graphs, worst rel err vs reference {worst:.2e}",
        direct.len()
    );
}

/// A thread's lane (its kept buffers and GEMM graphs) is retired when the thread ends and
/// freed at the next forward on the device, while the thread's queued forwards may still be
/// waiting on cubecl's device thread: those forwards still give the reference's output.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn lanes_of_ended_threads_are_retired_and_their_queued_forwards_still_run() {
    use burn_slidesparse::cuda::memory::graph_report;
    const THREADS: usize = 6;
    let device = Default::default();
    let mut rng = rng(140);
    let (k, n) = (1024, 1536);
    let (w, b) = (random_f32(&mut rng, n * k), random_f32(&mut rng, n));
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let packed = pack_linear("w", &w, n, k, Some(&b), &options).unwrap().0;
    let gpu = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
    let cpu = SlideSparseLinear::<Cpu>::from_packed(&packed, &Default::default());
    let run = move |layer: &SlideSparseLinear<Gpu>, x: &[f32], m: usize| {
        layer.forward(on_gpu::<Gpu, 2>(x.to_vec(), [m, k], DType::F32))
    };
    // This thread's lane exists before the count.
    let x0 = random_f32(&mut rng, k);
    let first = run(&gpu, &x0, 1).into_data();
    let before = graph_report(&device).unwrap();
    // Decode-sized forwards (kept buffers, replayed graphs), queued and not read: each
    // thread ends with its work possibly still in cubecl's queue.
    let ms = [1, 16, 3, 1, 16];
    let inputs: Vec<Vec<Vec<f32>>> = (0..THREADS)
        .map(|_| ms.iter().map(|&m| random_f32(&mut rng, m * k)).collect())
        .collect();
    let outputs: Vec<Vec<Tensor<Gpu, 2>>> = inputs
        .iter()
        .map(|xs| {
            let (layer, xs) = (gpu.clone(), xs.clone());
            std::thread::spawn(move || xs.iter().zip(ms).map(|(x, m)| run(&layer, x, m)).collect())
                .join()
                .unwrap()
        })
        .collect();
    let after = graph_report(&device).unwrap();
    assert!(
        after.lanes <= before.lanes,
        "lanes in use grew from {} to {} over {THREADS} ended threads",
        before.lanes,
        after.lanes
    );
    assert!(
        after.retired >= before.retired + THREADS,
        "{} lanes retired, {} before, over {THREADS} ended threads",
        after.retired,
        before.retired
    );
    assert!(
        after.calls.queued >= before.calls.queued,
        "the retired lanes' calls left the report"
    );
    // This forward frees the retired lanes (their graphs behind the queued replays).
    let x1 = random_f32(&mut rng, 16 * k);
    let last = run(&gpu, &x1, 16);
    let reference = |x: &[f32], m: usize| {
        let x =
            Tensor::<Cpu, 2>::from_data(TensorData::new(x.to_vec(), [m, k]), &Default::default());
        cpu.forward(x).into_data().into_vec::<f32>().unwrap()
    };
    let mut worst = 0f64;
    let mut check = |y: Tensor<Gpu, 2>, x: &[f32], m: usize, what: &str| {
        let y = y.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        let err = rel_err(&y, &reference(x, m));
        worst = worst.max(err);
        assert!(
            err < tolerance(Precision::Int8),
            "{what}: rel err {err:.2e}"
        );
    };
    check(
        Tensor::from_data(first, (&device, DType::F32)),
        &x0,
        1,
        "first forward",
    );
    for (t, (ys, xs)) in outputs.into_iter().zip(&inputs).enumerate() {
        for ((y, x), m) in ys.into_iter().zip(xs).zip(ms) {
            check(y, x, m, &format!("thread {t}, M = {m}"));
        }
    }
    check(last, &x1, 16, "the forward that freed the retired lanes");
    println!(
        "{THREADS} ended threads: lanes in use {} -> {}, retired {} -> {}, worst rel err {worst:.2e}",
        before.lanes, after.lanes, before.retired, after.retired
    );
}

/// A launch queued on cubecl's device thread that fails reaches only the cubecl stream that
/// queued it. Two threads, each with its own model (a SlideSparse layer at decode size, whose
/// GEMM replays are queued, and the attention kernels), run side by side; one thread's next
/// queued launch is made to fail (`fail_next_queued_launch`, the `internals` test hook). That
/// thread's output is NaN and its next call returns `Deferred` with the launch's error, once;
/// the other thread's calls, made while the failure is pending, all succeed with the same
/// bits as before it. Then the same for a kernel launch of the attention.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn a_queued_failure_reaches_only_the_stream_that_queued_it() {
    use std::sync::{Arc, Barrier};

    use burn_slidesparse::{
        AttentionOptions, SlideSparseError, causal_attention,
        cuda::{GraphMode, SyncMode, queued::fail_next_queued_launch, state::update_settings},
    };
    let _restore = DefaultOrderingOnDrop;
    update_settings(0, |s| {
        s.sync = SyncMode::Stream;
        s.graphs = GraphMode::Queued;
    })
    .unwrap();
    let mut rng = rng(150);
    let (k, n) = (1024, 1536);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let models: Vec<(PackedLinear, Vec<f32>)> = (0..2)
        .map(|_| {
            let (w, b) = (random_f32(&mut rng, n * k), random_f32(&mut rng, n));
            let packed = pack_linear("w", &w, n, k, Some(&b), &options).unwrap().0;
            (packed, random_f32(&mut rng, k))
        })
        .collect();
    // Attention of one decode query (8 heads over 2 KV heads, head dim 64) over 40 cached
    // positions, bf16.
    let (hq, hkv, d, kv) = (8, 2, 64, 40);
    let attention_inputs: Vec<[Vec<f32>; 3]> = (0..2)
        .map(|_| {
            [
                random_f32(&mut rng, hq * d),
                random_f32(&mut rng, kv * hkv * d),
                random_f32(&mut rng, kv * hkv * d),
            ]
        })
        .collect();
    let barrier = Arc::new(Barrier::new(2));
    let threads: Vec<_> = models
        .into_iter()
        .zip(attention_inputs)
        .enumerate()
        .map(|(t, ((packed, x), [q, kc, vc]))| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let fails = t == 0;
                let device = Default::default();
                let layer = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
                let forward = || {
                    let y = layer.try_forward(on_gpu::<Gpu, 2>(x.clone(), [1, k], DType::F32));
                    y.map(|y| y.into_data().convert::<f32>().into_vec::<f32>().unwrap())
                };
                let attend = || {
                    let q = on_gpu::<Gpu, 4>(q.clone(), [1, 1, hq, d], DType::BF16);
                    let kc = on_gpu::<Gpu, 4>(kc.clone(), [1, kv, hkv, d], DType::BF16);
                    let vc = on_gpu::<Gpu, 4>(vc.clone(), [1, kv, hkv, d], DType::BF16);
                    causal_attention(q, kc, vc, AttentionOptions::default())
                        .map(|o| o.into_data().convert::<f32>().into_vec::<f32>().unwrap())
                };
                let deferred = |result: Result<Vec<f32>, SlideSparseError>, what: &str| match result
                {
                    Err(SlideSparseError::Deferred(inner)) => inner.to_string(),
                    other => panic!("thread {t}, {what}: expected Deferred, got {other:?}"),
                };
                // Graphs captured, replays queued from here on; the attention compiled.
                let layer_bits = forward().unwrap();
                assert_eq!(forward().unwrap(), layer_bits, "thread {t}: replay");
                let attention_bits = attend().unwrap();
                let client = CudaRuntime::client(&device);
                assert_on_burns_stream(&client);
                for (what, run, bits) in [
                    ("layer", &forward as &dyn Fn() -> _, &layer_bits),
                    ("attention", &attend, &attention_bits),
                ] {
                    if fails {
                        fail_next_queued_launch();
                        let out = run().expect("the failure is reported by the next call");
                        assert!(out.iter().all(|v| v.is_nan()), "{what}: output not NaN");
                    }
                    // The failure is recorded (the read above waited for the launch).
                    barrier.wait();
                    if !fails {
                        for i in 0..4 {
                            let out = run().unwrap_or_else(|e| {
                                panic!("{what} call {i} of the other thread failed: {e}")
                            });
                            assert_eq!(&out, bits, "{what} call {i} of the other thread");
                        }
                    }
                    barrier.wait();
                    if fails {
                        let error = deferred(run(), what);
                        assert!(error.contains("failure injected"), "{what}: {error}");
                        assert_eq!(&run().unwrap(), bits, "{what}: reported more than once");
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

/// Reads a GPU tensor primitive back as f32.
fn read_f32<B: burn::tensor::backend::Backend>(y: burn::tensor::ops::FloatTensor<B>) -> Vec<f32> {
    Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(y))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

/// The dense baseline (same quantization kernel without lift, cuBLASLt, same epilogue)
/// against a host computation of the same W8A8 arithmetic, with f32 and bf16 activations
/// (INT32 / FP32 accumulators, and INT32 / BF16 ones).
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn dense_baseline_matches_host_w8a8() {
    use burn::tensor::ElementConversion;
    use burn_slidesparse::{cuda::DenseLayerGpu, internals::weight_quant::quantize_weight};
    let client = CudaRuntime::client(&Default::default());
    let mut rng = rng(104);
    for precision in [Precision::Int8, Precision::Fp8] {
        let (m, k, n) = (37, 1000, 320);
        let w = random_f32(&mut rng, n * k);
        let b = random_f32(&mut rng, n);
        let qw = quantize_weight(&w, n, k, precision);
        let layer = DenseLayerGpu::new(&client, 0, &qw, Some(&b)).unwrap();
        let x = random_f32(&mut rng, m * k);
        let xg = on_gpu::<Gpu, 2>(x.clone(), [m, k], DType::F32);
        let y = read_f32::<Gpu>(layer.forward(&xg.into_primitive().tensor()).unwrap());
        let expected = host_w8a8(&x, &qw, &b, (m, k, n), precision);
        let err = rel_err(&y, &expected);
        println!("dense {precision} f32: rel err {err:.2e}");
        let bad_rows: Vec<(usize, f64)> = (0..m)
            .map(|i| {
                let r = i * n..(i + 1) * n;
                (i, rel_err(&y[r.clone()], &expected[r]))
            })
            .filter(|(_, e)| *e > tolerance(precision))
            .collect();
        if !bad_rows.is_empty() {
            println!("rows off: {bad_rows:?}");
            let (i, _) = bad_rows[0];
            println!(
                "row {i}: got {:?} expected {:?}",
                &y[i * n..i * n + 6],
                &expected[i * n..i * n + 6]
            );
        }
        assert!(
            err < tolerance(precision),
            "{precision}: {err}; got {:?}, expected {:?}",
            &y[..4],
            &expected[..4]
        );

        let xb: Vec<f32> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).elem::<f32>())
            .collect();
        let xg = on_gpu::<GpuBf16, 2>(xb.clone(), [m, k], DType::BF16);
        let y = read_f32::<GpuBf16>(layer.forward(&xg.into_primitive().tensor()).unwrap());
        let err = rel_err(&y, &host_w8a8(&xb, &qw, &b, (m, k, n), precision));
        println!("dense {precision} bf16: rel err {err:.2e}");
        assert!(err < BF16_TOLERANCE, "{precision} bf16: {err}");
    }
}

/// Relative error allowed for layers with bf16 activations and outputs (16-bit
/// accumulators, see `cuda/accumulator.rs`): a few bf16 roundings of 2^-9.
const BF16_TOLERANCE: f64 = 1e-2;

/// SlideSparse layers on a bf16 burn-cuda backend (BF16 accumulators; INT8 scaled by
/// cuSPARSELt's alpha vector) against the f32 CPU reference on the same bf16 inputs.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn bf16_layers_match_the_reference() {
    let mut rng = rng(105);
    let mut report = Vec::new();
    for pattern in [
        SparsityPattern::P2_4,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
    ] {
        for precision in [Precision::Int8, Precision::Fp8] {
            for (m, k, n) in [(1, 100, 50), (17, 576, 96), (300, 4096, 256)] {
                let w = random_f32(&mut rng, n * k);
                let b = random_f32(&mut rng, n);
                let (packed, _, _) = pack_linear(
                    "w",
                    &w,
                    n,
                    k,
                    Some(&b[..]),
                    &PackOptions::new(pattern, precision),
                )
                .unwrap();
                let x: Vec<f32> = random_f32(&mut rng, m * k)
                    .into_iter()
                    .map(|v| half::bf16::from_f32(v).to_f32())
                    .collect();
                let cpu = SlideSparseLinear::<Cpu>::from_packed(&packed, &Default::default());
                let gpu = SlideSparseLinear::<GpuBf16>::from_packed(&packed, &Default::default());
                let yc = cpu
                    .forward(Tensor::<Cpu, 2>::from_data(
                        TensorData::new(x.clone(), [m, k]),
                        &Default::default(),
                    ))
                    .into_data()
                    .into_vec::<f32>()
                    .unwrap();
                let yg = gpu
                    .try_forward(on_gpu::<GpuBf16, 2>(x, [m, k], DType::BF16))
                    .unwrap();
                // bf16 through and through (an f32 device default would give f32 here).
                assert_eq!(yg.dtype(), DType::BF16);
                let yg = yg.into_data().convert::<f32>().into_vec::<f32>().unwrap();
                let err = rel_err(&yg, &yc);
                report.push(format!(
                    "bf16 {pattern} {precision} m={m} k={k} n={n}: {err:.2e}"
                ));
                assert!(err < BF16_TOLERANCE, "{}", report.last().unwrap());
            }
        }
    }
    println!("{}", report.join("\n"));
}

/// The epilogue kernel alone against the host: every accumulator type (INT32, FP32, BF16,
/// channel-scaled BF16), f32 and bf16 outputs, row lengths of every vector width, with and
/// without bias.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn epilogue_kernel_matches_host() {
    use burn::tensor::ElementConversion;
    use burn_slidesparse::cuda::{
        accumulator::{AccType, Accumulator},
        launch::launch_epilogue,
    };
    use half::bf16;
    let client = CudaRuntime::client(&Default::default());
    let mut rng = rng(106);
    let accumulators = [
        (AccType::I32, false),
        (AccType::F32, false),
        (AccType::Bf16, false),
        (AccType::Bf16, true),
    ];
    for (ty, channel_scaled) in accumulators {
        for n in [1usize, 6, 50, 320, 333] {
            for with_bias in [false, true] {
                let (m, m_pad, n_pad) = (5usize, 16usize, n.next_multiple_of(32));
                let acc_f32: Vec<f32> = (0..m_pad * n_pad)
                    .map(|_| rng.random_range(-1000i32..1000) as f32)
                    .map(|v| {
                        if ty == AccType::Bf16 {
                            bf16::from_f32(v).to_f32()
                        } else {
                            v
                        }
                    })
                    .collect();
                let acc_bytes: Vec<u8> = match ty {
                    AccType::I32 => acc_f32
                        .iter()
                        .flat_map(|&v| (v as i32).to_le_bytes())
                        .collect(),
                    AccType::F32 => acc_f32.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    _ => acc_f32
                        .iter()
                        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                        .collect(),
                };
                let sx = random_f32(&mut rng, m_pad);
                let sw = random_f32(&mut rng, n);
                let b = random_f32(&mut rng, n);
                let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
                let (acc_h, sx_h, sw_h, b_h) = (
                    client.create_from_slice(&acc_bytes),
                    client.create_from_slice(&f32b(&sx)),
                    client.create_from_slice(&f32b(&sw)),
                    client.create_from_slice(&f32b(&b)),
                );
                let accumulator = Accumulator {
                    ty,
                    channel_scaled,
                    finished: false,
                };
                let expected: Vec<f32> = (0..m * n)
                    .map(|i| {
                        let (r, c) = (i / n, i % n);
                        let mut y = acc_f32[r * n_pad + c] * sx[r];
                        if !channel_scaled {
                            y *= sw[c];
                        }
                        if with_bias {
                            y += b[c];
                        }
                        y
                    })
                    .collect();
                let label = format!("{ty:?} scaled={channel_scaled} n={n} bias={with_bias}");
                for (dtype, tolerance) in [
                    (burn::tensor::DType::F32, 1e-6),
                    (burn::tensor::DType::BF16, 5e-3),
                ] {
                    let out = client.empty(m * n * dtype.size());
                    launch_epilogue(
                        &client,
                        &acc_h,
                        &sx_h,
                        &sw_h,
                        with_bias.then_some(&b_h),
                        &out,
                        (m, m_pad, n, n_pad),
                        accumulator,
                        dtype,
                    )
                    .unwrap();
                    let bytes = client.read_one(out).unwrap();
                    let got: Vec<f32> = if dtype == burn::tensor::DType::F32 {
                        bytes
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                            .collect()
                    } else {
                        bytes
                            .chunks_exact(2)
                            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).elem::<f32>())
                            .collect()
                    };
                    let err = rel_err(&got, &expected);
                    assert!(
                        err < tolerance,
                        "{label} {dtype:?} out: rel err {err:.2e}, got {:?} expected {:?}",
                        &got[..got.len().min(6)],
                        &expected[..expected.len().min(6)]
                    );
                }
            }
        }
    }
}

/// The dense baseline as a module (`QuantizedLinear`, cuBLASLt on the GPU) against the same
/// module on the CPU reference, fresh random data, f32 and bf16 activations.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn quantized_linear_module_matches_the_reference() {
    use burn_slidesparse::{QuantizedLinear, internals::weight_quant::quantize_weight};
    let mut rng = rng(109);
    for precision in [Precision::Int8, Precision::Fp8, Precision::Bf16] {
        for (m, k, n) in [(1, 100, 50), (300, 1000, 200)] {
            let w = random_f32(&mut rng, n * k);
            let b = random_f32(&mut rng, n);
            let x = random_f32(&mut rng, m * k);
            let qw = quantize_weight(&w, n, k, precision);
            let cpu = QuantizedLinear::<Cpu>::from_quantized(&qw, Some(&b), &Default::default());
            let expected = cpu
                .forward(Tensor::<Cpu, 2>::from_data(
                    TensorData::new(x.clone(), [m, k]),
                    &Default::default(),
                ))
                .into_data()
                .into_vec::<f32>()
                .unwrap();
            let f32_layer =
                QuantizedLinear::<Gpu>::from_quantized(&qw, Some(&b), &Default::default());
            let y = f32_layer
                .forward(on_gpu::<Gpu, 2>(x.clone(), [m, k], DType::F32))
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .unwrap();
            let err = rel_err(&y, &expected);
            println!("quantized module {precision} f32 m={m} k={k} n={n}: {err:.2e}");
            assert!(err <= tolerance(precision), "{precision} f32: {err}");
            let bf16_layer =
                QuantizedLinear::<GpuBf16>::from_quantized(&qw, Some(&b), &Default::default());
            let y = bf16_layer.forward(on_gpu::<GpuBf16, 2>(x.clone(), [m, k], DType::BF16));
            assert_eq!(y.dtype(), DType::BF16);
            let y = y.into_data().convert::<f32>().into_vec::<f32>().unwrap();
            let err = rel_err(&y, &expected);
            println!("quantized module {precision} bf16 m={m} k={k} n={n}: {err:.2e}");
            assert!(err <= 2e-2, "{precision} bf16: {err}");
        }
    }
}

/// `M * K'` past 2^31 elements (the kernels switch to 64-bit addressing): a 6:8 INT8 layer
/// on 400k tokens of GPU-generated random input, checked against the CPU reference on rows
/// at both ends (tokens are independent: per-token scales, one output row per input row).
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn forward_past_two_to_the_31_elements_matches_the_reference_on_sampled_rows() {
    use burn::tensor::Distribution;
    let mut rng = rng(108);
    let (m, k, n) = (400_000, 4096, 256);
    let w = random_f32(&mut rng, n * k);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let (packed, _, _) = pack_linear("w", &w, n, k, None, &options).unwrap();
    assert!(m * packed.pattern.geometry(k, packed.alignment).k_prime() > 1 << 31);
    let device = Default::default();
    let gpu = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
    let x = Tensor::<Gpu, 2>::random(
        [m, k],
        Distribution::Uniform(-1.0, 1.0),
        (&device, DType::F32),
    );
    let y = gpu.try_forward(x.clone()).unwrap();
    let cpu = SlideSparseLinear::<Cpu>::from_packed(&packed, &Default::default());
    for rows in [0..64, m - 64..m] {
        let xs = x.clone().slice([rows.clone(), 0..k]);
        let xs = xs.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        let yc = cpu
            .forward(Tensor::<Cpu, 2>::from_data(
                TensorData::new(xs, [64, k]),
                &Default::default(),
            ))
            .into_data()
            .into_vec::<f32>()
            .unwrap();
        let yg = y.clone().slice([rows.clone(), 0..n]);
        let yg = yg.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        let err = rel_err(&yg, &yc);
        println!("M = {m}, rows {rows:?}: rel err {err:.2e}");
        assert!(err < tolerance(Precision::F32), "rows {rows:?}: {err:e}");
    }
}

/// A forward whose buffers cannot fit on the GPU is refused with `OutOfMemory` (cubecl would
/// panic on its device thread), for the SlideSparse and the dense layer, and the device keeps
/// working afterwards.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn forward_past_gpu_memory_is_a_typed_error_and_the_device_keeps_working() {
    use burn_slidesparse::{
        QuantizedLinear, SlideSparseError,
        cuda::{memory::available_bytes, state::device_state},
        internals::weight_quant::quantize_weight,
    };
    let mut rng = rng(109);
    let (k, n) = (4096, 16384);
    let w = random_f32(&mut rng, n * k);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let (packed, _, _) = pack_linear("w", &w, n, k, None, &options).unwrap();
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let sparse = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
    sparse.prepared().unwrap();
    let dense = QuantizedLinear::<Gpu>::from_quantized(
        &quantize_weight(&w, n, k, Precision::Int8),
        None,
        &device,
    );
    dense.prepared().unwrap();
    // An input of ~15% of the free memory whose forward buffers (codes, accumulators and
    // output: ~9x the input here) need far more than the rest.
    let available = available_bytes(&client, &device_state(0).unwrap()).unwrap();
    let m = (available as usize / 7) / (4 * k);
    let x = Tensor::<Gpu, 2>::zeros([m, k], (&device, DType::F32));
    for (name, result) in [
        ("sparse", sparse.try_forward(x.clone()).map(|_| ())),
        ("dense", dense.try_forward(x.clone()).map(|_| ())),
    ] {
        match result {
            Err(SlideSparseError::OutOfMemory {
                needed, available, ..
            }) => {
                println!("{name}: M = {m} refused: needs {needed} B, {available} B free");
                assert!(needed > available);
            }
            other => panic!("{name}: expected OutOfMemory for M = {m}, got {other:?}"),
        }
    }
    drop(x);
    // The device still works: a small forward against the reference.
    let x = random_f32(&mut rng, 7 * k);
    let (yg, yc) = run_both(&packed, &x, [7, k]);
    assert!(rel_err(&yg, &yc) < tolerance(Precision::F32));
}

/// The gate's spin kernel gives up after its spin budget on a flag that never arrives: it
/// records the epoch and returns, so a lost signal is an error, never a hang.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn spin_waits_time_out_instead_of_hanging() {
    use burn_slidesparse::cuda::{side_kernels::SideKernels, state::device_state};
    let client = CudaRuntime::client(&Default::default());
    let flag = client.create_from_slice(&[0; 4]);
    let timed_out = client.create_from_slice(&[0; 4]);
    let device_ptr =
        |h: &cubecl::server::Handle| client.get_resource(h.clone()).unwrap().resource().ptr;
    let (flag_ptr, timed_out_ptr) = (device_ptr(&flag), device_ptr(&timed_out));
    let state = device_state(0).unwrap();
    let state = state.lock().unwrap();
    state.make_current().unwrap();
    let side = SideKernels::new(0).unwrap();
    // SAFETY: live 4-byte cubecl allocations (`get_resource` returns after the uploads); our
    // stream belongs to this context.
    unsafe {
        side.wait(state.stream, flag_ptr, 9, timed_out_ptr, 10_000)
            .unwrap();
    }
    state.synchronize().unwrap();
    drop(state);
    let record = client.read_one(timed_out).unwrap();
    assert_eq!(u32::from_le_bytes(record[..4].try_into().unwrap()), 9);
}

/// Forwards enqueued behind a closed stream gate (the decode benchmark's device timing) run
/// once it opens and give the same bits as forwards run without it; a host sync behind a
/// closed gate is an error once the spin gives up, never a hang, and the device keeps
/// working after it.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn gated_forwards_are_bit_identical_and_a_sync_behind_the_gate_is_an_error() {
    use burn::tensor::backend::Backend;
    use burn_slidesparse::cuda::gate::StreamGate;
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let mut rng = rng(120);
    let (n, k) = (3000, 2048);
    let (w, b) = (random_f32(&mut rng, n * k), random_f32(&mut rng, n));
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let packed = pack_linear("w", &w, n, k, Some(&b), &options).unwrap().0;
    let layer = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
    let xs: Vec<Tensor<Gpu, 2>> = [1, 16, 64, 7, 16, 1]
        .iter()
        .map(|&m| on_gpu::<Gpu, 2>(random_f32(&mut rng, m * k), [m, k], DType::F32))
        .collect();
    let read = |y: Tensor<Gpu, 2>| y.into_data().convert::<f32>().into_vec::<f32>().unwrap();
    let ungated: Vec<Vec<f32>> = xs.iter().map(|x| read(layer.forward(x.clone()))).collect();

    let mut gate = StreamGate::new(0).unwrap();
    for round in 0..3 {
        gate.close(&client).unwrap();
        let ys: Vec<_> = xs.iter().map(|x| layer.forward(x.clone())).collect();
        let ms = gate.open_and_time(&client).unwrap();
        assert!(
            ms > 0.0 && ms.is_finite(),
            "round {round}: device time {ms} ms"
        );
        for (i, (y, expected)) in ys.into_iter().zip(&ungated).enumerate() {
            assert_eq!(&read(y), expected, "round {round}, forward {i}");
        }
    }

    let mut short = StreamGate::with_spin_budget(0, 100_000).unwrap();
    short.close(&client).unwrap();
    let y = layer.forward(xs[1].clone());
    Gpu::sync(&device).unwrap();
    let err = short.open_and_time(&client).unwrap_err().to_string();
    assert!(err.contains("spin gave up"), "{err}");
    assert_eq!(
        &read(y),
        &ungated[1],
        "the forward behind the gate still ran"
    );
    assert_eq!(&read(layer.forward(xs[0].clone())), &ungated[0]);
}

/// burn's fusion backend over burn-cuda: what `burn::backend::Cuda` is with burn's default
/// features.
type Fused = burn_fusion::Fusion<Gpu>;

/// `layer(2 x) * 0.5` on the fusion backend: fused element-wise kernels on both sides of the
/// custom operation.
fn fused_forward(layer: &SlideSparseLinear<Fused>, x: &[f32], shape: [usize; 2]) -> Vec<f32> {
    let x = on_gpu::<Fused, 2>(x.to_vec(), shape, DType::F32).mul_scalar(2.0);
    layer
        .try_forward(x)
        .unwrap()
        .mul_scalar(0.5)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

/// The fusion backend runs the real pipeline (a custom operation among fused kernels) and
/// matches the CPU reference for every pattern and precision; a wrong input width is an
/// error when the forward is queued.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn fusion_backend_matches_the_reference_for_every_pattern_and_precision() {
    use burn_slidesparse::{
        QuantizedLinear, SlideSparseError, internals::weight_quant::quantize_weight,
    };
    let mut rng = rng(111);
    let device = Default::default();
    let mut report = Vec::new();
    for pattern in [
        SparsityPattern::P2_4,
        SparsityPattern::P4_6,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
    ] {
        for precision in [
            Precision::Int8,
            Precision::Fp8,
            Precision::Bf16,
            Precision::F16,
        ] {
            for (m, k, n) in [(1, 100, 50), (17, 576, 96), (300, 1000, 200)] {
                let w = random_f32(&mut rng, n * k);
                let b = random_f32(&mut rng, n);
                let options = PackOptions::new(pattern, precision);
                let (packed, _, _) = pack_linear("w", &w, n, k, Some(&b), &options).unwrap();
                let x = random_f32(&mut rng, m * k);
                let cpu = SlideSparseLinear::<Cpu>::from_packed(&packed, &Default::default());
                let xc = Tensor::<Cpu, 2>::from_data(
                    TensorData::new(x.clone(), [m, k]),
                    &Default::default(),
                );
                // The same element-wise steps as `fused_forward`, on the reference.
                let yc = cpu
                    .forward(xc.mul_scalar(2.0))
                    .mul_scalar(0.5)
                    .into_data()
                    .into_vec::<f32>()
                    .unwrap();
                let fused = SlideSparseLinear::<Fused>::from_packed(&packed, &device);
                let yf = fused_forward(&fused, &x, [m, k]);
                let err = rel_err(&yf, &yc);
                report.push(format!(
                    "fusion {pattern} {precision} m={m} k={k} n={n}: {err:.2e}"
                ));
                assert!(err < tolerance(precision), "{}", report.last().unwrap());
            }
        }
    }
    // The dense baseline as a module on the fusion backend, against the host W8A8.
    let (m, k, n) = (37, 1000, 320);
    let w = random_f32(&mut rng, n * k);
    let b = random_f32(&mut rng, n);
    let qw = quantize_weight(&w, n, k, Precision::Int8);
    let layer = QuantizedLinear::<Fused>::from_quantized(&qw, Some(&b), &device);
    let x = random_f32(&mut rng, m * k);
    let y = layer
        .try_forward(on_gpu::<Fused, 2>(x.clone(), [m, k], DType::F32))
        .unwrap()
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap();
    let expected = host_w8a8(&x, &qw, &b, (m, k, n), Precision::Int8);
    let err = rel_err(&y, &expected);
    report.push(format!("fusion dense int8: {err:.2e}"));
    assert!(
        err < tolerance(Precision::Int8),
        "{}",
        report.last().unwrap()
    );
    // A wrong width is refused when queued, not inside the fused execution.
    let wrong = on_gpu::<Fused, 2>(random_f32(&mut rng, 3 * (k + 1)), [3, k + 1], DType::F32);
    match layer.try_forward(wrong) {
        Err(SlideSparseError::ShapeMismatch { .. }) => {}
        other => panic!("expected a shape error, got {:?}", other.map(|t| t.dims())),
    }
    println!("{}", report.join("\n"));
}

/// On the fusion backend, a chain of layers queued with no synchronization (each reading the
/// previous output through fused element-wise kernels) gives the same bits as with host
/// synchronization around every GEMM, and the GEMMs ran on burn's stream.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn fusion_ordering_without_host_sync_is_bit_identical_to_host_sync() {
    use burn_slidesparse::{
        QuantizedLinear,
        cuda::{SyncMode, state::update_settings},
        internals::weight_quant::quantize_weight,
    };
    let _restore = DefaultOrderingOnDrop;
    let device = Default::default();
    let mut rng = rng(112);
    let (m, d, h) = (77, 1024, 2048);
    let up_w = random_f32(&mut rng, h * d);
    let down_w = random_f32(&mut rng, d * h);
    let pack = |w: &[f32], n, k, p| {
        pack_linear("w", w, n, k, None, &PackOptions::new(p, Precision::Int8))
            .unwrap()
            .0
    };
    let up =
        SlideSparseLinear::<Fused>::from_packed(&pack(&up_w, h, d, SparsityPattern::P6_8), &device);
    let down = SlideSparseLinear::<Fused>::from_packed(
        &pack(&down_w, d, h, SparsityPattern::P2_4),
        &device,
    );
    let dense_up = QuantizedLinear::<Fused>::from_quantized(
        &quantize_weight(&up_w, h, d, Precision::Int8),
        None,
        &device,
    );
    let x0 = random_f32(&mut rng, m * d);
    let run = |mode| {
        update_settings(0, |s| s.sync = mode).unwrap();
        let mut x = on_gpu::<Fused, 2>(x0.clone(), [m, d], DType::F32);
        let mut outputs = Vec::new();
        for _ in 0..6 {
            let (gain_up, gain_down) = ((d as f32 / 3.0).sqrt(), (h as f32 / 3.0).sqrt());
            let y = up.forward(x.clone()).div_scalar(gain_up);
            let z = dense_up.forward(x.clone()).div_scalar(gain_up);
            let hidden = (y + z).div_scalar(2.0);
            x = down.forward(hidden).div_scalar(gain_down);
            outputs.push(x.clone());
        }
        outputs
            .into_iter()
            .map(|y| y.into_data().convert::<f32>().into_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let host = run(SyncMode::Host);
    let stream = run(SyncMode::Stream);
    let client = CudaRuntime::client(&device);
    assert_on_burns_stream(&client);
    for (i, (h, s)) in host.iter().zip(&stream).enumerate() {
        assert!(
            h.iter().all(|v| v.is_finite()),
            "step {i}: non-finite values"
        );
        assert!(h.iter().any(|v| *v != 0.0), "step {i}: all zero");
        assert_eq!(
            h, s,
            "step {i}: fusion stream ordering differs from host sync"
        );
    }
    println!("fusion ordering: 6 chained steps (3 GEMMs each) bit-identical to host sync");
}

/// Decode-sized forwards on the fusion backend replay their GEMMs from CUDA graphs (queued
/// launches) with the same bits as direct library calls.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn fusion_decode_graph_replay_is_bit_identical_to_direct_calls() {
    use burn_slidesparse::cuda::{GraphMode, SyncMode, queued::lanes, state::update_settings};
    let _restore = DefaultOrderingOnDrop;
    let device = Default::default();
    let mut rng = rng(113);
    let (k, n) = (2048, 1536);
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
    let layer = SlideSparseLinear::<Fused>::from_packed(&packed, &device);
    let ms = [1, 5, 16, 33, 64, 1, 64, 16];
    let inputs: Vec<Vec<f32>> = ms.iter().map(|&m| random_f32(&mut rng, m * k)).collect();
    let run = |graphs| {
        update_settings(0, |s| {
            s.sync = SyncMode::Stream;
            s.graphs = graphs;
        })
        .unwrap();
        let ys: Vec<_> = ms
            .iter()
            .zip(&inputs)
            .flat_map(|(&m, x)| {
                (0..2).map(move |_| on_gpu::<Fused, 2>(x.clone(), [m, k], DType::F32))
            })
            .map(|x| layer.forward(x).add_scalar(0.0))
            .collect();
        ys.into_iter()
            .map(|y| y.into_data().convert::<f32>().into_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let direct = run(GraphMode::Off);
    let queued = run(GraphMode::Queued);
    assert_eq!(direct, queued, "replayed forwards differ from direct calls");
    let lanes = lanes(0).unwrap();
    let mut lanes = lanes.lock().unwrap();
    let graphs = &lanes.current().graphs;
    assert_eq!(graphs.last_failure(), None, "a GEMM capture failed");
    let captured = graphs.captured();
    drop(lanes);
    // One graph per M bucket (16, 48, 64) the layer runs on the library GEMM: with the
    // decode GEMV on, forwards of up to 16 tokens run the GEMV instead.
    let gemv = burn_slidesparse::cuda::config::config()
        .unwrap()
        .decode_gemv;
    let expected = if gemv { 2 } else { 3 };
    assert!(
        captured >= expected,
        "only {captured} graphs captured on the fusion backend's lane, {expected} expected"
    );
    println!(
        "fusion decode: {} forwards bit-identical with queued graph replays, {captured} graphs",
        direct.len()
    );
}

/// Under autodiff, a forward that needs no gradient runs the native pipeline (bit-identical
/// to the plain backend), and one whose input needs a gradient runs the differentiable
/// reference path and gives the input a gradient.
#[test]
#[ignore = "needs an NVIDIA GPU and cuSPARSELt"]
fn autodiff_runs_the_native_pipeline_where_no_gradient_is_needed() {
    type Ad = burn::backend::Autodiff<Fused>;
    let device = Default::default();
    let mut rng = rng(114);
    let (m, k, n) = (40, 1024, 512);
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
    let x = random_f32(&mut rng, m * k);
    let plain = SlideSparseLinear::<Fused>::from_packed(&packed, &device);
    let expected = plain
        .forward(on_gpu::<Fused, 2>(x.clone(), [m, k], DType::F32))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap();
    let layer = SlideSparseLinear::<Ad>::from_packed(&packed, &device);
    let no_grad = layer
        .forward(on_gpu::<Ad, 2>(x.clone(), [m, k], DType::F32))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap();
    assert_eq!(
        no_grad, expected,
        "inference under autodiff is not the native pipeline"
    );
    let xg = on_gpu::<Ad, 2>(x.clone(), [m, k], DType::F32).require_grad();
    let y = layer.forward(xg.clone());
    let yv = y
        .clone()
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap();
    assert!(rel_err(&yv, &expected) < tolerance(Precision::Int8));
    let grads = y.sum().backward();
    let gx = xg.grad(&grads).expect("the input has a gradient");
    assert_eq!(gx.dims(), [m, k]);
    println!(
        "autodiff: no-grad forward bit-identical to the native pipeline; grad path {:.2e}",
        rel_err(&yv, &expected)
    );
}
