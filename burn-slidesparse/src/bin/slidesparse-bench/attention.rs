//! `slidesparse-bench attention`: our causal flash attention (prefill) and flash-decoding
//! kernels against burn's `module::attention` (K and V expanded to the query heads, which it
//! needs), same process, same bf16 inputs. Times are the median of 7 batches of `--reps`
//! calls back to back, one sync per batch (wall, as a model runs), and the median per call of
//! CUDA events on burn's stream (device). Also prints the largest difference between the two
//! outputs as a sanity check (the GPU tests are the real check).

use burn::tensor::{
    Distribution, ElementConversion, Tensor, module::attention, ops::AttentionModuleOptions,
};
use burn_slidesparse::{
    AttentionOptions, AttentionShape, causal_attention,
    cuda::attention::{set_decode_waves, set_prefill_rows},
};
use cubecl::{Runtime, cuda::CudaRuntime};

use super::{
    Args,
    layer::{Gpu, back_to_back_ms, device_median_ms},
};

/// (batch, queries, cached positions, compare with burn): prefill is queries == positions.
/// burn's op is timed where the issue has figures or the decode targets are (its autotune
/// costs seconds per new shape on the GPU host).
const CASES: [(usize, usize, usize, bool); 10] = [
    (1, 1024, 1024, true),
    (1, 4096, 4096, true),
    (1, 16384, 16384, false),
    (1, 1, 4096, true),
    (16, 1, 32768, true),
    (64, 1, 4096, true),
    (16, 1, 4096, false),
    (1, 1, 32768, false),
    (1, 1, 1024, false),
    (16, 1, 1024, false),
];
const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;

/// burn's op on [batch, heads, seq, d] with K and V repeated to the query heads.
fn burn_attention(
    q: &Tensor<Gpu, 4>,
    k: &Tensor<Gpu, 4>,
    v: &Tensor<Gpu, 4>,
    causal: bool,
) -> Tensor<Gpu, 4> {
    let expand = |t: &Tensor<Gpu, 4>| {
        let [b, s, h, d] = t.dims();
        t.clone()
            .swap_dims(1, 2)
            .unsqueeze_dim::<5>(2)
            .expand([b, h, HQ / h, s, d])
            .reshape([b, HQ, s, d])
    };
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: causal,
    };
    attention(
        q.clone().swap_dims(1, 2),
        expand(k),
        expand(v),
        None,
        None,
        options,
    )
}

fn inputs(batch: usize, tq: usize, kv: usize) -> [Tensor<Gpu, 4>; 3] {
    let device = Default::default();
    let dist = Distribution::Normal(0.0, 1.0);
    [
        Tensor::<Gpu, 4>::random([batch, tq, HQ, D], dist, &device),
        Tensor::<Gpu, 4>::random([batch, kv, HKV, D], dist, &device),
        Tensor::<Gpu, 4>::random([batch, kv, HKV, D], dist, &device),
    ]
}

fn ours(q: &Tensor<Gpu, 4>, k: &Tensor<Gpu, 4>, v: &Tensor<Gpu, 4>) -> Tensor<Gpu, 4> {
    causal_attention(q.clone(), k.clone(), v.clone(), AttentionOptions::default())
        .expect("attention")
}

pub fn attention_bench(args: &Args) {
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    println!(
        "Causal attention, {HQ} query / {HKV} KV heads, head dim {D}, bf16, ours; ms per call (wall: back to back, one sync per batch; device: CUDA events per call)"
    );
    println!(
        "| batch | queries | cached | query tile | wall ms | device ms | TFLOP/s (device) | KV read TB/s (device) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (batch, tq, kv, _) in CASES {
        let [q, k, v] = inputs(batch, tq, kv);
        let shape = AttentionShape::new(q.dims(), k.dims(), v.dims(), None).expect("shape");
        let reps = if tq >= 16384 {
            args.reps.min(10)
        } else {
            args.reps
        };
        // Prefill: both query tiles of the kernel; decode: the split aimed at 4 or 1 waves.
        let tiles: &[usize] = if tq > 16 { &[64, 128] } else { &[4, 1] };
        for &tile in tiles {
            if tq > 16 {
                set_prefill_rows(tile).expect("tile");
            } else {
                set_decode_waves(tile).expect("waves");
            }
            let wall = back_to_back_ms::<Gpu>(&device, reps, |_| {
                let _ = ours(&q, &k, &v);
            });
            let dev = device_median_ms(&client, 3, reps, |_| {
                let _ = ours(&q, &k, &v);
            });
            let tflops = shape.causal_flops() / (dev / 1e3) / 1e12;
            let tbs = shape.kv_bytes(2) / (dev / 1e3) / 1e12;
            let tile = if tq > 16 {
                tile.to_string()
            } else {
                format!("decode, {tile} wave(s)")
            };
            println!(
                "| {batch} | {tq} | {kv} | {tile} | {wall:.4} | {dev:.4} | {tflops:.0} | {tbs:.2} |"
            );
        }
    }
    set_prefill_rows(64).expect("tile");
    set_decode_waves(1).expect("waves");
    println!();
    println!(
        "burn 0.21 `module::attention` (K, V expanded to {HQ} heads; causal for prefill), same inputs, wall ms back to back"
    );
    println!(
        "| batch | queries | cached | burn wall ms | ours wall ms (64-query tile) | burn/ours | max abs diff (tile 128 / 64) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (batch, tq, kv, compare) in CASES {
        if !compare {
            continue;
        }
        let [q, k, v] = inputs(batch, tq, kv);
        let causal = tq > 1;
        let reference = burn_attention(&q, &k, &v, causal).swap_dims(1, 2);
        // The difference for each prefill query tile (the same kernel for decode).
        let diff = [128, 64]
            .iter()
            .map(|&tile| {
                set_prefill_rows(tile).expect("tile");
                let d: f32 = (ours(&q, &k, &v) - reference.clone())
                    .abs()
                    .max()
                    .into_scalar()
                    .elem();
                format!("{d:.4}")
            })
            .collect::<Vec<_>>()
            .join(" / ");
        let reps = args.reps.min(20);
        let burn_ms = back_to_back_ms::<Gpu>(&device, reps, |_| {
            let _ = burn_attention(&q, &k, &v, causal);
        });
        let ours_ms = back_to_back_ms::<Gpu>(&device, reps, |_| {
            let _ = ours(&q, &k, &v);
        });
        println!(
            "| {batch} | {tq} | {kv} | {burn_ms:.4} | {ours_ms:.4} | {:.1}x | {diff} |",
            burn_ms / ours_ms
        );
    }
}
