//! The example Llama split over tensor-parallel ranks, ranks simulated on the CPU: the same
//! logits as the whole model (bit for bit on one rank, up to f32 summation order on two and
//! four for float layers, within the activation-quantization difference for INT8), through
//! a prompt and cached decode steps; splits that cannot work are typed errors.

use burn::{
    backend::NdArray,
    module::Module,
    tensor::{Int, Tensor, TensorData},
};
use burn_slidesparse::{
    MaybeSparseLinear, PackOptions, Precision, QuantizedLinear, SimulatedRanks, SlideSparseError,
    SparsityPattern, VisitLinears, sparsify,
};
use slidesparse_examples::{
    llama::{KvCache, Llama, LlamaConfig},
    tensor_parallel::{MeetingRanks, RankCollective, TensorParallelLlama},
};

type B = NdArray;

/// 8 query and 4 key/value heads of 8 (grouped-query attention) with a q/k/v bias, hidden
/// 64, intermediate 64: splits over 1, 2 and 4 ranks for every pattern of blocks of 8 (`K`
/// multiples of `R · 8`).
fn config() -> LlamaConfig {
    LlamaConfig::new(64, 64, 64, 2, 8, 4)
        .with_max_seq_len(64)
        .with_tie_embeddings(false)
        .with_qkv_bias(true)
}

/// A prompt, then three decode steps.
const CALLS: [&[i64]; 4] = [&[3, 17, 9, 40, 22, 5], &[11], &[63], &[0]];

fn ids(tokens: &[i64]) -> TensorData {
    TensorData::new(tokens.to_vec(), [1, tokens.len()])
}

/// The whole model's logits of every call (projections fused, composed steps).
fn whole(model: &Llama<B>) -> Vec<Vec<f32>> {
    let mut model = model.clone();
    model.fuse_projections().unwrap();
    let mut cache = KvCache::default();
    CALLS
        .iter()
        .map(|call| {
            let tokens: Tensor<B, 2, Int> = Tensor::from_data(ids(call), &Default::default());
            model
                .forward(tokens, &mut cache)
                .into_data()
                .into_vec()
                .unwrap()
        })
        .collect()
}

fn split(model: &Llama<B>, ranks: usize) -> Vec<Vec<f32>> {
    let tp = TensorParallelLlama::split(model, &vec![Default::default(); ranks]).unwrap();
    assert_eq!(tp.ranks(), ranks);
    let collective = SimulatedRanks::new(ranks).unwrap();
    let mut cache = tp.cache(1, 16);
    let out = CALLS
        .iter()
        .map(|call| {
            let logits = tp
                .forward(tp.upload(&ids(call)), &mut cache, &collective)
                .unwrap();
            assert_eq!(logits.dims(), [1, call.len(), 64]);
            logits.into_data().into_vec().unwrap()
        })
        .collect();
    assert_eq!(cache.len(), CALLS.iter().map(|c| c.len()).sum::<usize>());
    out
}

/// The largest `|a - b| / (1 + |b|)` over every call's logits.
fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

/// A random model with its parameters materialized (burn initializes them lazily, and a
/// clone of a lazy parameter would draw its own values).
fn model(seed: u64) -> Llama<B> {
    <B as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
    let record = config().init::<B>(&Default::default()).into_record();
    config().init::<B>(&Default::default()).load_record(record)
}

#[test]
fn float_layers_split_give_the_whole_models_logits() {
    for (what, options) in [
        ("dense", None),
        (
            "6:8 F32",
            Some(PackOptions::new(SparsityPattern::P6_8, Precision::F32)),
        ),
        (
            "2:4 BF16",
            Some(PackOptions::new(SparsityPattern::P2_4, Precision::Bf16)),
        ),
    ] {
        let mut model = model(7);
        if let Some(options) = &options {
            sparsify(&mut model, options, |name| name != "lm_head").unwrap();
        }
        let reference = whole(&model);
        // One rank runs the very steps of the whole model: bit for bit.
        assert_eq!(split(&model, 1), reference, "{what}, one rank");
        for ranks in [2, 4] {
            let err = max_rel(&split(&model, ranks), &reference);
            assert!(err <= 1e-5, "{what}, {ranks} ranks: {err}");
        }
    }
}

#[test]
fn int8_layers_split_stay_within_the_quantization_difference() {
    let mut sparse = model(8);
    let mut dense = sparse.clone();
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    sparsify(&mut sparse, &options, |name| name != "lm_head").unwrap();
    dense
        .visit_linears(&mut |name, layer| {
            if name != "lm_head" {
                let linear = layer.dense().unwrap().clone();
                *layer = QuantizedLinear::from_linear(&linear, Precision::Int8)?.into();
            }
            Ok(())
        })
        .unwrap();
    for (what, model) in [("6:8 INT8", &sparse), ("dense INT8", &dense)] {
        let reference = whole(model);
        assert_eq!(split(model, 1), reference, "{what}, one rank");
        // Row-parallel ranks quantize their slice of each token with its own scale
        // (docs/decisions/tensor-parallel.md): close, not equal.
        let scale = reference
            .iter()
            .flatten()
            .fold(0.0f32, |m, v| m.max(v.abs()));
        let two = split(model, 2);
        let worst = two
            .iter()
            .flatten()
            .zip(reference.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            worst <= 0.05 * scale,
            "{what}: {worst} against logits up to {scale}"
        );
        assert_ne!(two, reference, "{what}: the slices' own scales should show");
    }
}

fn expect_invalid(result: burn_slidesparse::Result<TensorParallelLlama<B>>, words: &[&str]) {
    match result {
        Err(SlideSparseError::InvalidSplit { detail, layer, .. }) => {
            let text = format!("{layer}: {detail}");
            for word in words {
                assert!(text.contains(word), "{text:?} lacks {word:?}");
            }
        }
        other => panic!("expected InvalidSplit, got {other:?}"),
    }
}

#[test]
fn splits_that_cannot_work_are_typed_errors() {
    let model = model(9);
    let three = vec![Default::default(); 3];
    expect_invalid(TensorParallelLlama::split(&model, &three), &["heads"]);
    let eight = vec![Default::default(); 8];
    expect_invalid(TensorParallelLlama::split(&model, &eight), &["heads"]);
    expect_invalid(TensorParallelLlama::split(&model, &[]), &["at least one"]);
    let mut fused = model.clone();
    fused.fuse_projections().unwrap();
    let two = vec![Default::default(); 2];
    expect_invalid(TensorParallelLlama::split(&fused, &two), &["fused"]);
    // A masked (training) layer is not split at all.
    let mut masked = model.clone();
    masked.blocks[0]
        .down
        .mask(SparsityPattern::P6_8, &Default::default())
        .unwrap();
    assert!(matches!(
        masked.blocks[0].down,
        MaybeSparseLinear::Masked(_)
    ));
    expect_invalid(
        TensorParallelLlama::split(&masked, &two),
        &["down_proj", "masked"],
    );

    let tp = TensorParallelLlama::split(&model, &two).unwrap();
    let mut cache = tp.cache(1, 4);
    let collective = SimulatedRanks::new(2).unwrap();
    let long = tp.forward(tp.upload(&ids(&[1, 2, 3, 4, 5])), &mut cache, &collective);
    assert!(
        matches!(long, Err(SlideSparseError::ShapeMismatch { .. })),
        "{long:?}"
    );
    assert_eq!(cache.len(), 0, "a refused call leaves the cache as it was");
    let wrong = tp.forward(
        tp.upload(&ids(&[1])),
        &mut cache,
        &SimulatedRanks::new(1).unwrap(),
    );
    assert!(
        matches!(wrong, Err(SlideSparseError::ShapeMismatch { .. })),
        "{wrong:?}"
    );
}

/// Every call's last-position logits, each rank driven by its own thread
/// (`with_rank_threads`), the ranks meeting at each all-reduce.
fn split_threaded(model: &Llama<B>, ranks: usize) -> Vec<Vec<f32>> {
    let tp = TensorParallelLlama::split(model, &vec![Default::default(); ranks]).unwrap();
    let simulated = SimulatedRanks::new(ranks).unwrap();
    let meeting = MeetingRanks::new(&simulated);
    let mut cache = tp.cache(1, 16);
    tp.with_rank_threads(&meeting, |threads| {
        CALLS
            .iter()
            .map(|call| {
                let logits = threads
                    .forward_last(tp.upload(&ids(call)), &mut cache)
                    .unwrap();
                logits.into_data().into_vec().unwrap()
            })
            .collect()
    })
}

/// The same, one thread driving every rank (`forward_last`).
fn split_last(model: &Llama<B>, ranks: usize) -> Vec<Vec<f32>> {
    let tp = TensorParallelLlama::split(model, &vec![Default::default(); ranks]).unwrap();
    let collective = SimulatedRanks::new(ranks).unwrap();
    let mut cache = tp.cache(1, 16);
    CALLS
        .iter()
        .map(|call| {
            let logits = tp
                .forward_last(tp.upload(&ids(call)), &mut cache, &collective)
                .unwrap();
            logits.into_data().into_vec().unwrap()
        })
        .collect()
}

#[test]
fn rank_threads_give_the_single_threads_logits_bit_for_bit() {
    for (what, options) in [
        (
            "6:8 F32",
            PackOptions::new(SparsityPattern::P6_8, Precision::F32),
        ),
        (
            "6:8 INT8",
            PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
        ),
    ] {
        let mut model = model(10);
        sparsify(&mut model, &options, |name| name != "lm_head").unwrap();
        for ranks in [1, 2, 4] {
            assert_eq!(
                split_threaded(&model, ranks),
                split_last(&model, ranks),
                "{what}, {ranks} ranks"
            );
        }
    }
}

#[test]
fn a_rank_that_aborts_fails_its_peers_instead_of_leaving_them_waiting() {
    let simulated = SimulatedRanks::new(2).unwrap();
    let meeting: MeetingRanks<'_, B, _> = MeetingRanks::new(&simulated);
    let part = || Tensor::<B, 2>::ones([1, 4], &Default::default());
    std::thread::scope(|s| {
        let waiting = s.spawn(|| meeting.all_reduce_sum_rank(1, part()));
        meeting.abort("rank 0 failed");
        let got = waiting.join().unwrap();
        assert!(
            matches!(&got, Err(SlideSparseError::Backend(why)) if why.contains("failed")),
            "{got:?}"
        );
    });
    let later = meeting.all_reduce_sum_rank(0, part());
    assert!(later.is_err(), "{later:?}");
}

#[test]
fn rank_threads_refuse_a_call_past_the_cache_and_keep_it() {
    let model = model(11);
    let tp = TensorParallelLlama::split(&model, &[Default::default(); 2]).unwrap();
    let simulated = SimulatedRanks::new(2).unwrap();
    let meeting = MeetingRanks::new(&simulated);
    let mut cache = tp.cache(1, 4);
    tp.with_rank_threads(&meeting, |threads| {
        let long = threads.forward_last(tp.upload(&ids(&[1, 2, 3, 4, 5])), &mut cache);
        assert!(
            matches!(long, Err(SlideSparseError::ShapeMismatch { .. })),
            "{long:?}"
        );
        assert_eq!(cache.len(), 0);
        // The threads still serve the next call, with the cache they were handed back.
        threads
            .forward_last(tp.upload(&ids(&[1, 2])), &mut cache)
            .unwrap();
        assert_eq!(cache.len(), 2);
    });
}
