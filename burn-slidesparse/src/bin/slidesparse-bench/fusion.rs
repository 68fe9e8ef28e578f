//! `slidesparse-bench fusion`: whole layers on burn's fusion backend (`burn::backend::Cuda`
//! with burn's default features) against the plain `CubeBackend`, same process, same
//! weights and inputs: what the custom fusion operation costs.
//!
//! For each model, M and precision: one transformer block's four layers (6:8 SlideSparse and
//! the dense quantized baseline), back to back, ms per forward summed over the block, and
//! the fusion/plain ratio; and four identity custom operations at the same shapes, which is
//! what fusion's custom-operation path costs by itself.

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};
use burn_slidesparse::{
    PackOptions, QuantizedLinear, SlideSparseLinear, SparsityPattern,
    internals::{fusion::identity_custom_op, weight_quant::quantize_weight},
    pack_linear,
};

use super::{
    Args,
    layer::{Gpu, back_to_back_ms, random_weight},
    model_shapes, parse_list, sweep,
};

type Fused = burn_fusion::Fusion<Gpu>;

/// One layer on both backends.
struct Pair<L, F> {
    plain: L,
    fused: F,
    k: usize,
}

/// Block ms per forward of `forward` over `inputs` (rotated), back to back.
fn block_ms<B: Backend>(
    device: &B::Device,
    reps: usize,
    layers: usize,
    mut forward: impl FnMut(usize, usize),
) -> f64 {
    (0..layers)
        .map(|l| back_to_back_ms::<B>(device, reps, |i| forward(l, i)))
        .sum()
}

fn inputs<B: Backend>(m: usize, k: usize, device: &B::Device) -> Vec<Tensor<B, 2>> {
    (0..4)
        .map(|s| {
            let values = random_weight(m, k, 100 + s as u64);
            Tensor::from_data(TensorData::new(values, [m, k]), (device, DType::BF16))
        })
        .collect()
}

pub fn fusion_bench(args: &Args) {
    let device = Default::default();
    let (ms, precisions, _) = sweep(args);
    println!(
        "Whole layers on burn's fusion backend vs the plain CubeBackend (same process), summed over the block's 4 layers, ms per forward"
    );
    println!(
        "| model | precision | M | 6:8 plain | 6:8 fusion | 6:8 fusion/plain | dense plain | dense fusion | dense fusion/plain | 4 identity custom ops (fusion) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for model in parse_list(&args.models) {
        for &precision in &precisions {
            let mut sparse = Vec::new();
            let mut dense = Vec::new();
            for (l, &(n, k)) in model_shapes(&model).iter().enumerate() {
                let w = random_weight(n, k, l as u64 + 1);
                let options = PackOptions::new(SparsityPattern::P6_8, precision);
                let (packed, _, _) = pack_linear("w", &w, n, k, None, &options).expect("pack");
                sparse.push(Pair {
                    plain: SlideSparseLinear::<Gpu>::from_packed(&packed, &device),
                    fused: SlideSparseLinear::<Fused>::from_packed(&packed, &device),
                    k,
                });
                let qw = quantize_weight(&w, n, k, precision);
                dense.push(Pair {
                    plain: QuantizedLinear::<Gpu>::from_quantized(&qw, None, &device),
                    fused: QuantizedLinear::<Fused>::from_quantized(&qw, None, &device),
                    k,
                });
            }
            for &m in &ms {
                let xp: Vec<_> = sparse
                    .iter()
                    .map(|p| inputs::<Gpu>(m, p.k, &device))
                    .collect();
                let xf: Vec<_> = sparse
                    .iter()
                    .map(|p| inputs::<Fused>(m, p.k, &device))
                    .collect();
                let (reps, layers) = (args.reps, sparse.len());
                let sp = block_ms::<Gpu>(&device, reps, layers, |l, i| {
                    let _ = sparse[l].plain.forward(xp[l][i % 4].clone());
                });
                let sf = block_ms::<Fused>(&device, reps, layers, |l, i| {
                    let _ = sparse[l].fused.forward(xf[l][i % 4].clone());
                });
                let dp = block_ms::<Gpu>(&device, reps, layers, |l, i| {
                    let _ = dense[l].plain.forward(xp[l][i % 4].clone());
                });
                let df = block_ms::<Fused>(&device, reps, layers, |l, i| {
                    let _ = dense[l].fused.forward(xf[l][i % 4].clone());
                });
                // What fusion's custom-operation path costs alone, at the same shapes.
                let id = block_ms::<Fused>(&device, reps, layers, |l, i| {
                    let _ = identity_custom_op(xf[l][i % 4].clone());
                });
                println!(
                    "| {model} | {precision} | {m} | {sp:.3} | {sf:.3} | {:.3} | {dp:.3} | {df:.3} | {:.3} | {id:.3} |",
                    sf / sp,
                    df / dp
                );
                json.push(serde_json::json!({
                    "model": model, "precision": precision.to_string(), "m": m,
                    "sparse_plain_ms": sp, "sparse_fusion_ms": sf,
                    "dense_plain_ms": dp, "dense_fusion_ms": df, "identity_ops_ms": id,
                }));
            }
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&json).expect("json")).expect("write json");
    }
}
