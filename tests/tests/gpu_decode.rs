//! GPU tests of decode on our kernels: the weight-streaming GEMV that forwards of up to 16
//! tokens of INT8 dense and 6:8 layers run, against the CPU reference on fresh random data;
//! and `DecodeGraph`, a whole decode step replayed as one CUDA graph, against the same
//! launches run one by one (bit for bit, across cache-length buckets) and against the
//! model's block operations (within bf16 tolerance).
//!
//! Needs an NVIDIA GPU of compute capability 8.0+ (`#[ignore]`d; run with `--ignored` on the
//! GPU host).
#![cfg(feature = "cuda")]

use burn::{
    backend::NdArray,
    module::Param,
    nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig},
    tensor::{DType, Tensor, TensorData, backend::Backend},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    DecodeGraph, DecodeModel, DecoderBlock, MaybeSparseLinear, PackOptions, Precision,
    QuantizedLinear, RopeAttention, SlideSparseBackend, SlideSparseLinear, SparsityPattern,
    add_rms_norm, decoder_block,
};
use cubecl::cuda::CudaRuntime;
use slidesparse_tests::{assert_same_bits, relative_l2, tensor_of, to_host, uniform_values};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type Gpu16 = CubeBackend<CudaRuntime, half::bf16, i32, u8>;
type Cpu = NdArray;

/// `values` as `dtype` holds them (bf16-rounded for bf16): what both sides of a comparison
/// start from.
fn rounded(values: Vec<f32>, dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => values
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect(),
        _ => values,
    }
}

/// A random `k -> n` linear with bias, packed 6:8 INT8 and quantized dense INT8, on `B`; its
/// weights are `dtype`'s rounding of `seed`'s values, whatever `B`'s own dtype (`as_if`).
fn linears_as<B: SlideSparseBackend>(
    (k, n): (usize, usize),
    (dtype, as_if): (DType, DType),
    seed: u64,
) -> Vec<(&'static str, MaybeSparseLinear<B>)> {
    let mut linear: Linear<B> = LinearConfig::new(k, n).init(&Default::default());
    let weight = rounded(uniform_values(seed, n * k), as_if);
    let bias = rounded(uniform_values(seed + 1, n), as_if);
    linear.weight = Param::from_tensor(tensor_of(&weight, [k, n], dtype));
    linear.bias = Some(Param::from_tensor(tensor_of(&bias, [n], dtype)));
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    vec![
        (
            "6:8 INT8",
            SlideSparseLinear::from_linear(&linear, &options)
                .unwrap()
                .into(),
        ),
        (
            "dense INT8",
            QuantizedLinear::from_linear(&linear, Precision::Int8)
                .unwrap()
                .into(),
        ),
    ]
}

/// [`linears_as`] in `dtype` itself.
fn linears<B: SlideSparseBackend>(
    (k, n): (usize, usize),
    dtype: DType,
    seed: u64,
) -> Vec<(&'static str, MaybeSparseLinear<B>)> {
    linears_as((k, n), (dtype, dtype), seed)
}

/// Every token count the GEMV takes (1..=16, both of its kernels) on shapes with ragged rows,
/// K in whole units, units and a tail, and a tail alone; f32 and bf16 outputs; against the
/// reference backend on the same packed layer.
fn gemv_layers<B: SlideSparseBackend>(dtype: DType, tol: f64, seed: u64) {
    for (i, &(k, n)) in [(576, 96), (1024, 130), (1600, 256), (4096, 64)]
        .iter()
        .enumerate()
    {
        let gpu = linears::<B>((k, n), dtype, seed + 10 * i as u64);
        // The reference from the same (16-bit-rounded) weights and bias.
        let cpu = linears_as::<Cpu>((k, n), (DType::F32, dtype), seed + 10 * i as u64);
        for ((kind, g), (_, c)) in gpu.iter().zip(&cpu) {
            for m in [1, 2, 7, 8, 9, 15, 16] {
                let x = uniform_values(seed + 1000 + m as u64, m * k);
                let got = to_host(g.try_forward(tensor_of::<B, 2>(&x, [m, k], dtype)).unwrap());
                // The reference reads the same 16-bit-rounded input.
                let x16 = to_host(tensor_of::<B, 2>(&x, [m, k], dtype));
                let want = to_host(
                    c.try_forward(tensor_of::<Cpu, 2>(&x16, [m, k], DType::F32))
                        .unwrap(),
                );
                let err = relative_l2(&got, &want);
                assert!(
                    err <= tol,
                    "{kind} {n}x{k}, {m} tokens, {dtype:?}: relative error {err:.2e}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn gemv_forwards_match_the_reference_at_every_small_token_count() {
    // f32: exact INT32 sums and an f32 epilogue on both sides (the reference's f32 matmul of
    // codes rounds only past 2^24).
    gemv_layers::<Gpu>(DType::F32, 1e-5, 1);
    // bf16: one rounding of the output.
    gemv_layers::<Gpu16>(DType::BF16, 1e-2, 2);
}

/// A small Llama-shaped model with INT8 linears (6:8 or dense) and an INT8 head, bf16.
struct Model<B: SlideSparseBackend> {
    embedding: Tensor<B, 2>,
    norms: Vec<(RmsNorm<B>, RmsNorm<B>)>,
    layers: Vec<[MaybeSparseLinear<B>; 4]>,
    final_norm: RmsNorm<B>,
    head: MaybeSparseLinear<B>,
    rope: RotaryEncoding<B>,
}

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;
const HIDDEN: usize = 512;
const FFN: usize = 768;
const VOCAB: usize = 1000;
const BLOCKS: usize = 2;

fn norm<B: Backend>(seed: u64) -> RmsNorm<B> {
    let mut n = RmsNormConfig::new(HIDDEN).init::<B>(&Default::default());
    let gamma: Vec<f32> = uniform_values(seed, HIDDEN)
        .iter()
        .map(|v| 1.0 + 0.2 * v)
        .collect();
    n.gamma = Param::from_tensor(tensor_of(&gamma, [HIDDEN], DType::BF16));
    n
}

fn model<B: SlideSparseBackend>(kind: usize, capacity: usize, seed: u64) -> Model<B> {
    let pick =
        |(k, n): (usize, usize), s: u64| linears::<B>((k, n), DType::BF16, s).swap_remove(kind).1;
    let layers = (0..BLOCKS as u64)
        .map(|b| {
            let s = seed + 100 * b;
            [
                pick((HIDDEN, (HQ + 2 * HKV) * D), s),
                pick((HQ * D, HIDDEN), s + 10),
                pick((HIDDEN, 2 * FFN), s + 20),
                pick((FFN, HIDDEN), s + 30),
            ]
        })
        .collect();
    let mut rope = RotaryEncodingConfig::new(capacity, D).init::<B>(&Default::default());
    rope.freq_complex = rope.freq_complex.cast(DType::BF16);
    Model {
        embedding: tensor_of(
            &uniform_values(seed + 7, VOCAB * HIDDEN),
            [VOCAB, HIDDEN],
            DType::BF16,
        ),
        norms: (0..BLOCKS as u64)
            .map(|b| (norm(seed + 50 + b), norm(seed + 60 + b)))
            .collect(),
        layers,
        final_norm: norm(seed + 70),
        head: linears::<B>((HIDDEN, VOCAB), DType::BF16, seed + 80)
            .swap_remove(1)
            .1,
        rope,
    }
}

impl<B: SlideSparseBackend> Model<B> {
    fn blocks(&self) -> Vec<DecoderBlock<'_, B>> {
        self.norms
            .iter()
            .zip(&self.layers)
            .map(|((a, m), [qkv, o, gate_up, down])| DecoderBlock {
                attn_norm: a,
                qkv,
                o,
                mlp_norm: m,
                gate_up,
                down,
            })
            .collect()
    }

    fn graph<'a>(&'a self, caches: &'a [(Tensor<B, 4>, Tensor<B, 4>)]) -> DecodeGraph<B> {
        DecodeGraph::new(DecodeModel {
            embedding: &self.embedding,
            blocks: self.blocks(),
            caches: caches.iter().map(|(k, v)| (k, v)).collect(),
            final_norm: &self.final_norm,
            head: Some(&self.head),
            rope: &self.rope,
            heads: (HQ, HKV),
            scale: None,
        })
        .unwrap()
    }
}

/// Caches of `batch` sequences holding random keys and values at every position (a prompt's
/// worth of history at any start position).
fn caches<B: Backend>(
    batch: usize,
    capacity: usize,
    seed: u64,
) -> Vec<(Tensor<B, 4>, Tensor<B, 4>)> {
    let n = batch * capacity * HKV * D;
    (0..BLOCKS as u64)
        .map(|b| {
            let shape = [batch, capacity, HKV, D];
            (
                tensor_of(&uniform_values(seed + 2 * b, n), shape, DType::BF16),
                tensor_of(&uniform_values(seed + 2 * b + 1, n), shape, DType::BF16),
            )
        })
        .collect()
}

/// Steps replayed as graphs equal the same launches run one by one: tokens at every step,
/// then the logits and every cache, bit for bit; the steps cross from the 256-position
/// bucket into the 512 one (a second graph), with 1 and 3 sequences.
#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn decode_graph_replays_equal_the_launches_run_one_by_one() {
    let capacity = 600;
    for (kind, name) in [(0, "6:8 INT8"), (1, "dense INT8")] {
        let m = model::<Gpu16>(kind, capacity, 10 + kind as u64);
        for batch in [1, 3] {
            let (a, b) = (
                caches::<Gpu16>(batch, capacity, 500),
                caches::<Gpu16>(batch, capacity, 500),
            );
            let (mut graph, mut direct) = (m.graph(&a), m.graph(&b));
            let start: Vec<u32> = (0..batch as u32).map(|i| 17 + 100 * i).collect();
            graph.set(250, &start).unwrap();
            direct.set(250, &start).unwrap();
            for step in 0..10 {
                graph.step().unwrap();
                direct.step_without_graph().unwrap();
                assert_eq!(
                    graph.tokens().unwrap(),
                    direct.tokens().unwrap(),
                    "{name} batch {batch} step {step}"
                );
            }
            assert_eq!(graph.graphs(), 2, "one graph per bucket");
            assert_same_bits(
                &format!("{name} batch {batch} logits"),
                graph.logits().unwrap(),
                direct.logits().unwrap(),
            );
            for (i, ((ka, va), (kb, vb))) in a.iter().zip(&b).enumerate() {
                assert_same_bits(&format!("{name} block {i} keys"), ka.clone(), kb.clone());
                assert_same_bits(&format!("{name} block {i} values"), va.clone(), vb.clone());
            }
            println!(
                "{name}, batch {batch}: 10 steps from position 250, graph == launches ({} launches a step)",
                graph.launches_per_step().unwrap()
            );
        }
    }
}

/// One graph step against the model's own decode step (`decoder_block` per block, the final
/// norm, the head) from the same caches: the same kernels but for the attention's split and
/// where the quantization runs, so within bf16 tolerance, and the same greedy token.
#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn decode_graph_matches_the_block_operations() {
    let capacity = 300;
    for (kind, name) in [(0, "6:8 INT8"), (1, "dense INT8")] {
        let m = model::<Gpu16>(kind, capacity, 40 + kind as u64);
        let batch = 2;
        let (a, mut b) = (
            caches::<Gpu16>(batch, capacity, 900),
            caches::<Gpu16>(batch, capacity, 900),
        );
        let tokens = [5u32, 700];
        let start = 123;
        let mut graph = m.graph(&a);
        graph.set(start, &tokens).unwrap();
        graph.step().unwrap();
        let got = to_host(graph.logits().unwrap());
        // The block operations on the same tokens.
        let ids = Tensor::<Gpu16, 1, burn::tensor::Int>::from_data(
            TensorData::new(
                tokens.iter().map(|&t| t as i64).collect::<Vec<_>>(),
                [batch],
            ),
            &Default::default(),
        );
        let mut x = m
            .embedding
            .clone()
            .select(0, ids)
            .reshape([batch, 1, HIDDEN]);
        let mut delta = None;
        for (block, (k, v)) in m.blocks().iter().zip(b.iter_mut()) {
            let step = RopeAttention {
                rope: &m.rope,
                start,
                heads: (HQ, HKV),
                scale: None,
            };
            let (h, mlp) = decoder_block((x, delta), block, k, v, step).unwrap();
            x = h;
            delta = Some(mlp);
        }
        let (_, normed) = add_rms_norm(x, delta.unwrap(), &m.final_norm).unwrap();
        let want = to_host(m.head.try_forward(normed.reshape([batch, HIDDEN])).unwrap());
        let err = relative_l2(&got, &want);
        assert!(
            err < 2e-2,
            "{name}: graph logits vs block operations, relative error {err:.2e}"
        );
        // The greedy token, where the reference's top two logits are further apart than the
        // two paths' largest difference (else either is right).
        let largest = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f32, f32::max);
        let tokens = graph.tokens().unwrap();
        for (row, (logits, token)) in want.chunks(VOCAB).zip(tokens).enumerate() {
            let mut order: Vec<usize> = (0..VOCAB).collect();
            order.sort_by(|&i, &j| logits[j].total_cmp(&logits[i]));
            if logits[order[0]] - logits[order[1]] > 2.0 * largest {
                assert_eq!(
                    token as usize, order[0],
                    "{name}: greedy token of sequence {row}"
                );
            }
        }
        println!("{name}: graph step vs block operations, logits relative error {err:.2e}");
    }
}
