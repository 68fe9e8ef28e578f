//! `slidesparse-bench decode`: a whole decoder block (qkv, o, gate_up, down run one after
//! the other, as a model runs them) at decode sizes, timed two ways in the same process:
//!
//! - **wall**: blocks back to back, one device sync per batch of `--reps` blocks (what a
//!   model sees: bound by the host's enqueue time at these sizes), for our layers both with
//!   the GEMM graphs' launches queued on cubecl's device thread (the default) and with
//!   each launch waiting for that thread (`blocking`, the design of session 7);
//! - **device**: the same blocks enqueued behind a closed [`StreamGate`], then released, so
//!   the GPU runs them back to back with no host gaps; CUDA events on burn's stream time
//!   them. This is the forward's cost once host work is out of the way (what one graph per
//!   decoder step would approach), and it shows what the sparse weights save on the device.
//!
//! Medians of 7 batches (wall) and of 15 gated batches of [`GATED_BLOCKS`] blocks (device).
//! A block's weights (>= 150 MB of 8-bit codes) exceed the 60 MB L2, so running the same
//! inputs again does not warm the weights; the inputs themselves are a few KB.

use std::{collections::BTreeMap, time::Instant};

use burn::{
    nn::{Linear, LinearConfig},
    tensor::{Distribution, Tensor, backend::Backend},
};
use burn_cubecl::tensor::CubeTensor;
use burn_slidesparse::{
    PackOptions, Precision, SlideSparseLinear, SparsityPattern,
    cuda::{
        DenseLayerGpu, GraphMode,
        gate::StreamGate,
        state::{device_state, update_settings},
    },
    internals::weight_quant::quantize_weight,
    pack_linear,
};
use cubecl::{Runtime, cuda::CudaRuntime};

use super::{
    Args, column_names,
    layer::{Gpu, random_weight},
    model_shapes, parse_list, sweep,
};

/// Blocks enqueued behind the gate per timed batch: few enough that the launch queue never
/// fills (a full queue would block the host with the gate closed), enough to average out
/// the gate's own start.
const GATED_BLOCKS: usize = 8;

/// One way of running a block: four layers, each with its own input.
type BlockForward<'a> = Box<dyn Fn() + 'a>;

/// Milliseconds per block.
#[derive(Clone, Copy, Default)]
struct BlockTimes {
    /// Wall time, default settings (graph launches queued).
    wall: f64,
    /// Wall time with blocking graph launches (the same as `wall` for burn's layers).
    wall_blocking: f64,
    /// Device time (behind the gate).
    device: f64,
}

pub fn decode_bench(args: &Args) {
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let (ms, precisions, patterns) = sweep(args);
    let mut gate = StreamGate::new(0).expect("stream gate");
    let started = Instant::now();
    // (model, precision, M) -> variant -> times
    let mut results: BTreeMap<(String, String, usize), BTreeMap<String, BlockTimes>> =
        BTreeMap::new();
    for model in parse_list(&args.models) {
        let shapes = model_shapes(&model);
        let weights: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| random_weight(n, k, i as u64 + 1))
            .collect();
        let bf16: Vec<Linear<Gpu>> = shapes
            .iter()
            .map(|&(n, k)| LinearConfig::new(k, n).with_bias(false).init(&device))
            .collect();
        let layers = build_layers(&client, &device, &shapes, &weights, &precisions, &patterns);
        for &m in &ms {
            let xs: Vec<Tensor<Gpu, 2>> = shapes
                .iter()
                .map(|&(_, k)| Tensor::random([m, k], Distribution::Uniform(-1.0, 1.0), &device))
                .collect();
            let prims: Vec<CubeTensor<CudaRuntime>> = xs
                .iter()
                .map(|x| x.clone().into_primitive().tensor())
                .collect();
            // `ours`: a block of our layers (timed with blocking and with queued launches).
            let mut time = |ours: bool, forward: BlockForward| {
                time_block(&client, &device, &mut gate, (args.reps, ours), forward)
            };
            let bf16_times = time(
                false,
                Box::new(|| {
                    for (layer, x) in bf16.iter().zip(&xs) {
                        let _ = layer.forward(x.clone());
                    }
                }),
            );
            for (precision, dense, sparse) in &layers {
                let row = results
                    .entry((model.clone(), precision.to_string(), m))
                    .or_default();
                row.insert("burn bf16".into(), bf16_times);
                let dense_times = time(
                    true,
                    Box::new(|| {
                        for (layer, x) in dense.iter().zip(&prims) {
                            let _ = layer.forward(x).expect("dense forward");
                        }
                    }),
                );
                row.insert("dense".into(), dense_times);
                let mut line = format!(
                    "{model} {precision} M={m}: dense {:.4}/{:.4}",
                    dense_times.wall, dense_times.device
                );
                for (pattern, block) in sparse {
                    let times = time(
                        true,
                        Box::new(|| {
                            for (layer, x) in block.iter().zip(&xs) {
                                let _ = layer.forward(x.clone());
                            }
                        }),
                    );
                    line += &format!(" {pattern} {:.4}/{:.4}", times.wall, times.device);
                    row.insert(pattern.to_string(), times);
                }
                eprintln!(
                    "[{:>5.0}s] {line} (wall/device ms)",
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    print_table(&results, &patterns);
    print_queued_table(&results);
    if let Some(path) = &args.json {
        let rows: Vec<_> = results
            .iter()
            .map(|((model, precision, m), variants)| {
                let times: serde_json::Map<String, serde_json::Value> = variants
                    .iter()
                    .map(|(name, t)| {
                        (
                            name.clone(),
                            serde_json::json!({"wall_ms": t.wall, "wall_blocking_ms": t.wall_blocking, "device_ms": t.device}),
                        )
                    })
                    .collect();
                serde_json::json!({"model": model, "precision": precision, "m": m, "block": times})
            })
            .collect();
        let json =
            serde_json::json!({"gated_blocks": GATED_BLOCKS, "reps": args.reps, "rows": rows});
        std::fs::write(path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    }
}

/// Per precision: the block's dense layers and, per pattern, its SlideSparse layers.
type Layers = Vec<(
    Precision,
    Vec<DenseLayerGpu>,
    Vec<(SparsityPattern, Vec<SlideSparseLinear<Gpu>>)>,
)>;

fn build_layers(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    device: &burn::tensor::Device<Gpu>,
    shapes: &[(usize, usize)],
    weights: &[Vec<f32>],
    precisions: &[Precision],
    patterns: &[SparsityPattern],
) -> Layers {
    precisions
        .iter()
        .map(|&precision| {
            let dense = shapes
                .iter()
                .zip(weights)
                .map(|(&(n, k), w)| {
                    DenseLayerGpu::new(client, 0, &quantize_weight(w, n, k, precision), None)
                        .expect("dense layer")
                })
                .collect();
            let sparse = patterns
                .iter()
                .map(|&pattern| {
                    let block = shapes
                        .iter()
                        .zip(weights)
                        .map(|(&(n, k), w)| {
                            let options = PackOptions::new(pattern, precision);
                            let (packed, _, _) =
                                pack_linear("w", w, n, k, None, &options).expect("pack");
                            let layer = SlideSparseLinear::<Gpu>::from_packed(&packed, device);
                            layer.prepared().expect("prepare");
                            layer
                        })
                        .collect();
                    (pattern, block)
                })
                .collect();
            (precision, dense, sparse)
        })
        .collect()
}

/// Wall and device time per block of `forward` (see the module docs).
/// `ours`: the block is made of our layers (whose graph launches can be queued or blocking).
fn time_block(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    device: &burn::tensor::Device<Gpu>,
    gate: &mut StreamGate,
    (reps, ours): (usize, bool),
    forward: BlockForward,
) -> BlockTimes {
    // Warm-up: algorithm searches, graph captures and burn's autotune happen here, never
    // behind a closed gate (they synchronize).
    for _ in 0..5 {
        forward();
    }
    Gpu::sync(device).unwrap();
    let wall_ms = || {
        median((0..7).map(|_| {
            let start = Instant::now();
            for _ in 0..reps {
                forward();
            }
            Gpu::sync(device).unwrap();
            start.elapsed().as_secs_f64() * 1e3 / reps as f64
        }))
    };
    let wall = wall_ms();
    let wall_blocking = if ours {
        update_settings(0, |s| s.graphs = GraphMode::Blocking).expect("GPU state");
        let blocking = wall_ms();
        let state = device_state(0).expect("GPU state");
        state
            .lock()
            .unwrap()
            .restore_default_settings()
            .expect("configuration");
        blocking
    } else {
        wall
    };
    let device_ms = median((0..15).map(|_| {
        gate.close(client).expect("close the gate");
        for _ in 0..GATED_BLOCKS {
            forward();
        }
        gate.open_and_time(client).expect("gated batch") / GATED_BLOCKS as f64
    }));
    BlockTimes {
        wall,
        wall_blocking,
        device: device_ms,
    }
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Wall ms per block with blocking and with queued graph launches, for dense and 6:8.
fn print_queued_table(results: &BTreeMap<(String, String, usize), BTreeMap<String, BlockTimes>>) {
    println!(
        "\nDecode wall time per block (ms), GEMM graph launches blocking (waiting for cubecl's device thread) vs queued on it; x = dense / 6:8"
    );
    println!(
        "| model | precision | M | dense blocking | dense queued | 6:8 blocking | 6:8 queued | 6:8 device | 6:8 x blocking | 6:8 x queued |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for ((model, precision, m), v) in results {
        let (Some(dense), Some(sparse)) = (v.get("dense"), v.get("6:8")) else {
            continue;
        };
        println!(
            "| {model} | {precision} | {m} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
            dense.wall_blocking,
            dense.wall,
            sparse.wall_blocking,
            sparse.wall,
            sparse.device,
            dense.wall_blocking / sparse.wall_blocking,
            dense.wall / sparse.wall
        );
    }
}

fn print_table(
    results: &BTreeMap<(String, String, usize), BTreeMap<String, BlockTimes>>,
    patterns: &[SparsityPattern],
) {
    let names: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
    println!(
        "\nDecode, one block (4 layers in sequence): ms per block, wall (back to back, default settings) and device (queued behind a gate, no host gaps); x = dense / SlideSparse"
    );
    println!(
        "| model | precision | M | burn bf16 wall / device | dense wall / device | {} | {} |",
        column_names(&names, "device x"),
        column_names(&names, "wall x")
    );
    println!("|---|---|---|---|---|{}", "---|".repeat(2 * names.len()));
    for ((model, precision, m), v) in results {
        let dense = v["dense"];
        let device_x: Vec<String> = names
            .iter()
            .map(|n| format!("{:.2}", dense.device / v[n].device))
            .collect();
        let wall_x: Vec<String> = names
            .iter()
            .map(|n| format!("{:.2}", dense.wall / v[n].wall))
            .collect();
        let bf16 = v["burn bf16"];
        println!(
            "| {model} | {precision} | {m} | {:.3} / {:.3} | {:.3} / {:.3} | {} | {} |",
            bf16.wall,
            bf16.device,
            dense.wall,
            dense.device,
            device_x.join(" | "),
            wall_x.join(" | ")
        );
    }
}
