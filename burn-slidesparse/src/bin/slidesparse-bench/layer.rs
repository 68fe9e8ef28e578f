//! `slidesparse-bench layer`: whole layers, in one process, for each shape, M and precision:
//! SlideSparse at every pattern, the dense layer with the identical pipeline (cuBLASLt), and
//! burn's own bf16 `nn::Linear`; plus the stages alone (quant+lift, plain quant, epilogue)
//! with their achieved bandwidth against a measured device copy.
//!
//! A layer is timed back to back, as a model runs it: `--reps` forwards, one device sync,
//! wall time per forward; median of 7 such batches after warm-up, inputs rotated beyond the
//! 60 MB L2. (Timing each call with its own sync quantizes short times to the host's sync
//! polling: medians of unrelated variants landed on the same ~0.4 ms.) The stages alone and
//! the copy are timed on the device (CUDA events through cubecl's profiler). At decode sizes
//! (M <= 64, INT8) each ordering design is also timed with a sync per call.
//!
//! With `--json`, every layer's times are written after each layer (`"complete": false`
//! until the run ends), so that a run cut short (the GPU host's time limit) keeps them.

use std::{collections::BTreeMap, time::Instant};

use burn::{
    nn::LinearConfig,
    tensor::{DType, Distribution, Tensor, backend::Backend},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    PackOptions, Precision, SlideSparseLinear, SparsityPattern,
    cuda::{
        DenseLayerGpu, SyncMode,
        accumulator::Accumulator,
        launch::{QuantKernel, launch_epilogue, launch_quant_lift_with},
        pipeline::m_pad,
        state::{device_state, update_settings},
    },
    internals::weight_quant::quantize_weight,
    pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};
use half::bf16;
use rand::{Rng, SeedableRng, rngs::StdRng};
use rayon::prelude::*;

use super::{Args, column_names, model_shapes, parse_list, rotation, sweep};

/// Activations in bf16, as in LLM inference (and in the anchor's sparse GEMM outputs).
pub(crate) type Gpu = CubeBackend<CudaRuntime, bf16, i32, u8>;
/// Bytes of one activation element.
pub(crate) const ACT_BYTES: usize = 2;
/// One SlideSparse layer per pattern.
type SparseVariants = Vec<(SparsityPattern, SlideSparseLinear<Gpu>)>;

pub(crate) fn random_weight(n: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut w = vec![0f32; n * k];
    w.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut rng = StdRng::seed_from_u64(seed * 7919 + i as u64);
        c.iter_mut()
            .for_each(|v| *v = rng.random_range(-1.0f32..1.0));
    });
    w
}

/// Median wall milliseconds of `f(i)` followed by a device sync.
fn median_ms<B: Backend>(
    device: &burn::tensor::Device<B>,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut(usize),
) -> f64 {
    for i in 0..warmup {
        f(i);
    }
    B::sync(device).unwrap();
    let mut t: Vec<f64> = (0..reps)
        .map(|i| {
            let start = Instant::now();
            f(i);
            B::sync(device).unwrap();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Median device milliseconds of the kernels `f(i)` launches, timed by cubecl's profiler
/// (CUDA events on burn's stream around each call): no launch or synchronization overhead,
/// which matters for the stages alone (tens of microseconds).
pub(crate) fn device_median_ms(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    warmup: usize,
    reps: usize,
    f: impl Fn(usize) + Sync,
) -> f64 {
    for i in 0..warmup {
        f(i);
    }
    let mut t: Vec<f64> = (0..reps)
        .map(|i| {
            let f = &f;
            let (_, duration) = client.profile(move || f(i), "stage").unwrap();
            cubecl::future::block_on(duration.resolve())
                .duration()
                .as_secs_f64()
                * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Device-to-device copy bandwidth (bytes read + written per second), through burn, timed
/// on the device like the stages.
pub(crate) fn copy_bandwidth(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    device: &burn::tensor::Device<Gpu>,
) -> f64 {
    let n = 512 << 20; // 1 GiB of bf16
    let x = Tensor::<Gpu, 1>::random([n], Distribution::Default, device);
    let ms = device_median_ms(client, 3, 20, |_| {
        let _ = x.clone().add_scalar(1.0);
    });
    2.0 * (ACT_BYTES * n) as f64 / (ms / 1e3)
}

pub fn layer_bench(args: &Args) {
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let (ms, precisions, patterns) = sweep(args);
    let copy_bw = copy_bandwidth(&client, &device);
    println!(
        "measured copy bandwidth (x + 1.0 over 1 GiB, read + write): {:.0} GB/s",
        copy_bw / 1e9
    );
    let started = Instant::now();
    // (model, precision, M) -> variant -> summed ms
    let mut totals: BTreeMap<(String, String, usize), BTreeMap<String, f64>> = BTreeMap::new();
    let mut stages = Vec::new();
    let mut decode = Vec::new();
    // Every layer's times as measured, written out after each layer (`"complete": false`
    // until the end), so that a run cut short keeps what it measured.
    let mut per_layer = Vec::new();
    for model in parse_list(&args.models) {
        for (li, &(n, k)) in model_shapes(&model).iter().enumerate() {
            let w = random_weight(n, k, li as u64 + 1);
            let bf16_linear = LinearConfig::new(k, n)
                .with_bias(false)
                .init::<Gpu>(&device);
            let mut layers: Vec<(Precision, DenseLayerGpu, SparseVariants)> = Vec::new();
            for &precision in &precisions {
                let dense =
                    DenseLayerGpu::new(&client, 0, &quantize_weight(&w, n, k, precision), None)
                        .unwrap();
                let sparse = patterns
                    .iter()
                    .map(|&p| {
                        let (packed, _, _) =
                            pack_linear("w", &w, n, k, None, &PackOptions::new(p, precision))
                                .unwrap();
                        let layer = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
                        layer.prepared().unwrap();
                        (p, layer)
                    })
                    .collect();
                layers.push((precision, dense, sparse));
            }
            for &m in &ms {
                let rot = rotation(m * k * ACT_BYTES, 2);
                let xs: Vec<Tensor<Gpu, 2>> = (0..rot)
                    .map(|_| Tensor::random([m, k], Distribution::Uniform(-1.0, 1.0), &device))
                    .collect();
                let bf16_ms = back_to_back_ms::<Gpu>(&device, args.reps, |i| {
                    let _ = bf16_linear.forward(xs[i % rot].clone());
                });
                for (precision, dense, sparse) in &layers {
                    let key = (model.clone(), precision.to_string(), m);
                    let entry = totals.entry(key).or_default();
                    *entry.entry("burn bf16".into()).or_default() += bf16_ms;
                    let prims: Vec<_> = xs
                        .iter()
                        .map(|x| x.clone().into_primitive().tensor())
                        .collect();
                    let dense_ms = back_to_back_ms::<Gpu>(&device, args.reps, |i| {
                        let _ = dense.forward(&prims[i % rot]).unwrap();
                    });
                    *entry.entry("dense".into()).or_default() += dense_ms;
                    let mut layer_ms = serde_json::json!({"burn bf16": bf16_ms, "dense": dense_ms});
                    let mut line = format!(
                        "{model} {n}x{k} {precision} M={m}: bf16 {bf16_ms:.4} dense {dense_ms:.4}"
                    );
                    for (pattern, layer) in sparse {
                        let t = back_to_back_ms::<Gpu>(&device, args.reps, |i| {
                            let _ = layer.forward(xs[i % rot].clone());
                        });
                        *entry.entry(pattern.to_string()).or_default() += t;
                        line += &format!(" {pattern} {t:.4}");
                        layer_ms[pattern.to_string()] = t.into();
                        if *pattern == SparsityPattern::P6_8 {
                            stages.push(stage_times(
                                &client, &prims, *precision, *pattern, n, k, m, args.reps, copy_bw,
                                &model,
                            ));
                        }
                    }
                    if m <= 64 && *precision == Precision::Int8 {
                        decode.extend(ordering_cost(
                            &device,
                            dense,
                            sparse,
                            &xs,
                            &prims,
                            args.reps,
                            &model,
                            (n, k, m),
                        ));
                    }
                    eprintln!("[{:>5.0}s] {line}", started.elapsed().as_secs_f64());
                    per_layer.push(serde_json::json!({
                        "model": model, "shape": [n, k], "precision": precision.to_string(),
                        "m": m, "ms": layer_ms,
                    }));
                }
            }
            if let Some(path) = &args.json {
                let json = results_json(copy_bw, &per_layer, &stages, &decode, false);
                std::fs::write(path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
            }
        }
    }
    print_tables(&totals, &patterns, &stages);
    print_ordering(&decode);
    if let Some(path) = &args.json {
        let mut json = results_json(copy_bw, &per_layer, &stages, &decode, true);
        json["layers"] = totals.iter().map(|((model, p, m), v)| serde_json::json!({"model": model, "precision": p, "m": m, "ms": v})).collect();
        std::fs::write(path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    }
}

/// The run's measurements as JSON: every layer's times (`per_layer`), the stages alone and
/// the decode ordering designs; `complete` is false while the run is still going (the sums
/// per block, `layers`, are only added at the end).
fn results_json(
    copy_bw: f64,
    per_layer: &[serde_json::Value],
    stages: &[serde_json::Value],
    decode: &[serde_json::Value],
    complete: bool,
) -> serde_json::Value {
    serde_json::json!({
        "complete": complete,
        "copy_bandwidth_gbs": copy_bw / 1e9,
        "per_layer": per_layer,
        "stages": stages,
        "decode_sync_designs": decode,
    })
}

/// Median per-forward wall milliseconds of `f` run back to back, `reps` calls per batch with
/// one device sync per batch (how a model decodes: layer after layer, no sync between them).
pub(crate) fn back_to_back_ms<B: Backend>(
    device: &burn::tensor::Device<B>,
    reps: usize,
    mut f: impl FnMut(usize),
) -> f64 {
    for i in 0..5 {
        f(i);
    }
    B::sync(device).unwrap();
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let start = Instant::now();
            for i in 0..reps {
                f(i);
            }
            B::sync(device).unwrap();
            start.elapsed().as_secs_f64() * 1e3 / reps as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Decode-time cost of each ordering design (dense and 6:8 layers): per forward with a sync
/// after each, per forward back to back, and the host time to enqueue one forward.
#[allow(clippy::too_many_arguments)]
fn ordering_cost(
    device: &burn::tensor::Device<Gpu>,
    dense: &DenseLayerGpu,
    sparse: &[(SparsityPattern, SlideSparseLinear<Gpu>)],
    xs: &[Tensor<Gpu, 2>],
    prims: &[burn_cubecl::tensor::CubeTensor<CudaRuntime>],
    reps: usize,
    model: &str,
    (n, k, m): (usize, usize, usize),
) -> Vec<serde_json::Value> {
    let rot = xs.len();
    let layer = &sparse
        .iter()
        .find(|(p, _)| *p == SparsityPattern::P6_8)
        .expect("6:8 benchmarked")
        .1;
    let state = device_state(0).unwrap();
    let rows = [SyncMode::Stream, SyncMode::Host]
        .into_iter()
        .map(|mode| {
            update_settings(0, |s| s.sync = mode).expect("GPU state");
            let dense_fwd = |i: usize| {
                let _ = dense.forward(&prims[i % rot]).unwrap();
            };
            let sparse_fwd = |i: usize| {
                let _ = layer.forward(xs[i % rot].clone());
            };
            let dense_synced = median_ms::<Gpu>(device, 5, reps, dense_fwd);
            let sparse_synced = median_ms::<Gpu>(device, 5, reps, sparse_fwd);
            let dense_b2b = back_to_back_ms::<Gpu>(device, reps, dense_fwd);
            let sparse_b2b = back_to_back_ms::<Gpu>(device, reps, sparse_fwd);
            let start = Instant::now();
            for i in 0..reps {
                sparse_fwd(i);
            }
            let enqueue = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
            Gpu::sync(device).unwrap();
            serde_json::json!({
                "model": model, "shape": [n, k], "m": m, "mode": format!("{mode:?}"),
                "dense_synced_ms": dense_synced, "sparse_synced_ms": sparse_synced,
                "dense_back_to_back_ms": dense_b2b, "sparse_back_to_back_ms": sparse_b2b,
                "sparse_enqueue_ms": enqueue,
            })
        })
        .collect();
    state
        .lock()
        .unwrap()
        .restore_default_settings()
        .expect("configuration");
    rows
}

/// Times the memory-bound stages of one layer alone.
#[allow(clippy::too_many_arguments)]
fn stage_times(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    xs: &[burn_cubecl::tensor::CubeTensor<CudaRuntime>],
    precision: Precision,
    pattern: SparsityPattern,
    n: usize,
    k: usize,
    m: usize,
    reps: usize,
    copy_bw: f64,
    model: &str,
) -> serde_json::Value {
    let g = pattern.geometry(k, 64);
    let mp = m_pad(m, precision);
    let rot = xs.len();
    let codes = client.empty(mp * g.k_prime());
    let scales = client.empty(mp * 4);
    let quant_ms = |kernel, n_lift, (k_slide, k_out): (usize, usize)| {
        device_median_ms(client, 3, reps, |i| {
            launch_quant_lift_with(
                kernel,
                client,
                &xs[i % rot].handle,
                &codes,
                &scales,
                (m, mp, k, k_slide, k_out),
                n_lift,
                precision,
                DType::BF16,
            )
            .unwrap();
        })
    };
    let lifted = (g.k_slide(), g.k_prime());
    let plain = (k, k.next_multiple_of(16));
    let lift_ms = quant_ms(QuantKernel::Auto, g.n, lifted);
    let lift_row_staged_ms = quant_ms(QuantKernel::RowStaged, g.n, lifted);
    let plain_ms = quant_ms(QuantKernel::Auto, 0, plain);
    let plain_row_staged_ms = quant_ms(QuantKernel::RowStaged, 0, plain);
    let n_pad = n.next_multiple_of(32);
    let accumulator = Accumulator::sparse(precision, DType::BF16);
    let acc = client.empty(mp * n_pad * accumulator.bytes());
    let sw = client.empty(n * 4);
    let out = client.empty(m * n * ACT_BYTES);
    let epi_ms = device_median_ms(client, 3, reps, |_| {
        launch_epilogue(
            client,
            &acc,
            &scales,
            &sw,
            None,
            &out,
            (m, mp, n, n_pad),
            accumulator,
            DType::BF16,
        )
        .unwrap();
    });
    let lift_bytes = (m * k * ACT_BYTES + mp * g.k_prime() + mp * 4) as f64;
    let plain_bytes = (m * k * ACT_BYTES + mp * k.next_multiple_of(16) + mp * 4) as f64;
    let epi_bytes = (m * n * (accumulator.bytes() + ACT_BYTES) + m * 4 + n * 4) as f64;
    serde_json::json!({
        "model": model, "shape": [n, k], "m": m, "precision": precision.to_string(), "pattern": pattern.to_string(),
        "quant_lift_ms": lift_ms, "quant_lift_gbs": lift_bytes / (lift_ms / 1e3) / 1e9,
        "quant_lift_row_staged_ms": lift_row_staged_ms,
        "quant_lift_row_staged_gbs": lift_bytes / (lift_row_staged_ms / 1e3) / 1e9,
        "plain_quant_ms": plain_ms, "plain_quant_gbs": plain_bytes / (plain_ms / 1e3) / 1e9,
        "plain_quant_row_staged_ms": plain_row_staged_ms,
        "epilogue_ms": epi_ms, "epilogue_gbs": epi_bytes / (epi_ms / 1e3) / 1e9,
        "copy_gbs": copy_bw / 1e9,
    })
}

/// The ordering-design table, summed over each model's layers per (M, mode).
fn print_ordering(rows: &[serde_json::Value]) {
    let mut sums: BTreeMap<(String, u64, String), [f64; 5]> = BTreeMap::new();
    for r in rows {
        let key = (
            r["model"].as_str().unwrap().to_string(),
            r["m"].as_u64().unwrap(),
            r["mode"].as_str().unwrap().to_string(),
        );
        let fields = [
            "dense_synced_ms",
            "sparse_synced_ms",
            "dense_back_to_back_ms",
            "sparse_back_to_back_ms",
            "sparse_enqueue_ms",
        ];
        let sum = sums.entry(key).or_default();
        for (acc, f) in sum.iter_mut().zip(fields) {
            *acc += r[f].as_f64().unwrap();
        }
    }
    println!(
        "\nOrdering designs at decode (INT8, summed over the block's 4 layers): ms per forward with a device sync after each, back to back (one sync per batch), and host ms to enqueue"
    );
    println!(
        "| model | M | design | dense synced | 6:8 synced | dense back-to-back | 6:8 back-to-back | 6:8 x (back-to-back) | 6:8 enqueue (host) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for ((model, m, mode), v) in &sums {
        println!(
            "| {model} | {m} | {mode} | {:.4} | {:.4} | {:.4} | {:.4} | {:.2} | {:.4} |",
            v[0],
            v[1],
            v[2],
            v[3],
            v[2] / v[3],
            v[4]
        );
    }
}

fn print_tables(
    totals: &BTreeMap<(String, String, usize), BTreeMap<String, f64>>,
    patterns: &[SparsityPattern],
    stages: &[serde_json::Value],
) {
    let names: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
    println!(
        "\nWhole layers, back to back, summed over the block's 4 layers: ms per forward, and speedup of each SlideSparse pattern vs the dense layer (same pipeline)"
    );
    println!(
        "| model | precision | M | burn bf16 ms | dense ms | {} | {} |",
        column_names(&names, "ms"),
        column_names(&names, "x")
    );
    println!("|---|---|---|---|---|{}", "---|".repeat(2 * names.len()));
    for ((model, p, m), v) in totals {
        let dense = v["dense"];
        let ms: Vec<String> = names.iter().map(|n| format!("{:.3}", v[n])).collect();
        let x: Vec<String> = names
            .iter()
            .map(|n| format!("{:.2}", dense / v[n]))
            .collect();
        println!(
            "| {model} | {p} | {m} | {:.3} | {dense:.3} | {} | {} |",
            v["burn bf16"],
            ms.join(" | "),
            x.join(" | ")
        );
    }
    println!(
        "\nStages alone (6:8): ms and achieved GB/s (bytes read + written); quant kernels: the forward's (grouped) and the row-staged one"
    );
    println!(
        "| model | shape | precision | M | quant+lift ms | GB/s | row-staged ms | GB/s | plain quant ms | GB/s | row-staged ms | epilogue ms | GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in stages {
        println!(
            "| {} | {}x{} | {} | {} | {:.4} | {:.0} | {:.4} | {:.0} | {:.4} | {:.0} | {:.4} | {:.4} | {:.0} |",
            s["model"].as_str().unwrap(),
            s["shape"][0],
            s["shape"][1],
            s["precision"].as_str().unwrap(),
            s["m"],
            s["quant_lift_ms"].as_f64().unwrap(),
            s["quant_lift_gbs"].as_f64().unwrap(),
            s["quant_lift_row_staged_ms"].as_f64().unwrap(),
            s["quant_lift_row_staged_gbs"].as_f64().unwrap(),
            s["plain_quant_ms"].as_f64().unwrap(),
            s["plain_quant_gbs"].as_f64().unwrap(),
            s["plain_quant_row_staged_ms"].as_f64().unwrap(),
            s["epilogue_ms"].as_f64().unwrap(),
            s["epilogue_gbs"].as_f64().unwrap()
        );
    }
}
