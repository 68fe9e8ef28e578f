//! The reference causal attention (`causal_attention_reference`, the GPU kernels' oracle)
//! against a naive per-row loop, on the CPU: grouped-query heads, a cached prefix, the
//! cache's capacity past `kv_len`, large-magnitude scores; and the shape errors.

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    AttentionOptions, SlideSparseError, causal_attention, causal_attention_reference,
};
use slidesparse_tests::{random_f32, rng};

type Cpu = NdArray;

/// Naive causal attention, one query row at a time, in f64: q [b, t, hq, d], k/v
/// [b, cap, hkv, d], positions `kv_len - t ..`.
fn naive(
    (q, k, v): (&[f32], &[f32], &[f32]),
    [b, t, hq, d]: [usize; 4],
    (cap, hkv, kv_len): (usize, usize, usize),
    scale: f64,
) -> Vec<f32> {
    let mut out = vec![0f32; b * t * hq * d];
    let group = hq / hkv;
    for bi in 0..b {
        for i in 0..t {
            let pos = kv_len - t + i;
            for h in 0..hq {
                let kh = h / group;
                let qrow = &q[((bi * t + i) * hq + h) * d..][..d];
                let at = |j: usize| ((bi * cap + j) * hkv + kh) * d;
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let krow = &k[at(j)..][..d];
                        scale
                            * qrow
                                .iter()
                                .zip(krow)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                for (j, w) in weights.iter().enumerate() {
                    let vrow = &v[at(j)..][..d];
                    let o = &mut out[((bi * t + i) * hq + h) * d..][..d];
                    for (o, x) in o.iter_mut().zip(vrow) {
                        *o += (w / sum * *x as f64) as f32;
                    }
                }
            }
        }
    }
    out
}

fn tensor(values: Vec<f32>, shape: [usize; 4]) -> Tensor<Cpu, 4> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// Runs both on one case and returns the largest absolute difference.
fn max_diff(
    [b, t, hq, d]: [usize; 4],
    (cap, hkv, kv_len): (usize, usize, usize),
    magnitude: f32,
    seed: u64,
) -> f32 {
    let mut r = rng(seed);
    let q: Vec<f32> = random_f32(&mut r, b * t * hq * d)
        .iter()
        .map(|x| x * magnitude)
        .collect();
    let k: Vec<f32> = random_f32(&mut r, b * cap * hkv * d)
        .iter()
        .map(|x| x * magnitude)
        .collect();
    let v = random_f32(&mut r, b * cap * hkv * d);
    let expected = naive(
        (&q, &k, &v),
        [b, t, hq, d],
        (cap, hkv, kv_len),
        1.0 / (d as f64).sqrt(),
    );
    let options = AttentionOptions {
        kv_len: Some(kv_len),
        scale: None,
    };
    let got = causal_attention_reference(
        tensor(q, [b, t, hq, d]),
        tensor(k, [b, cap, hkv, d]),
        tensor(v, [b, cap, hkv, d]),
        options,
    )
    .unwrap()
    .into_data()
    .into_vec::<f32>()
    .unwrap();
    assert_eq!(got.len(), expected.len());
    got.iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

#[test]
fn reference_matches_the_naive_loop_for_prefill_with_gqa_ratios_1_4_8() {
    for (seed, (hq, hkv)) in [(4, 4), (8, 2), (8, 1)].into_iter().enumerate() {
        let t = 37;
        let diff = max_diff([2, t, hq, 16], (t, hkv, t), 1.0, seed as u64);
        assert!(diff < 1e-5, "hq {hq} hkv {hkv}: {diff}");
    }
}

#[test]
fn reference_matches_the_naive_loop_with_a_cached_prefix_and_spare_capacity() {
    // 5 new queries after 40 cached positions, in a cache of 64.
    let diff = max_diff([2, 5, 8, 8], (64, 2, 45), 1.0, 11);
    assert!(diff < 1e-5, "{diff}");
    // Decode: one query at the end of a cache of 100 (capacity 128).
    let diff = max_diff([3, 1, 4, 8], (128, 1, 100), 1.0, 12);
    assert!(diff < 1e-5, "{diff}");
}

#[test]
fn reference_is_stable_on_large_magnitude_scores() {
    // Scores in the thousands: a softmax without the max subtracted overflows.
    let diff = max_diff([1, 20, 4, 16], (20, 2, 20), 30.0, 13);
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn the_first_query_of_a_prompt_sees_only_the_first_key() {
    // Every score of row 0 but one is masked: the output is v[0] exactly.
    let mut r = rng(14);
    let (t, d) = (9, 8);
    let q = tensor(random_f32(&mut r, t * 2 * d), [1, t, 2, d]);
    let v_values = random_f32(&mut r, t * d);
    let k = tensor(random_f32(&mut r, t * d), [1, t, 1, d]);
    let v = tensor(v_values.clone(), [1, t, 1, d]);
    let out = causal_attention(q, k, v, AttentionOptions::default())
        .unwrap()
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    for h in 0..2 {
        for (a, b) in out[h * d..][..d].iter().zip(&v_values[..d]) {
            assert!((a - b).abs() < 1e-6, "head {h}: {a} vs {b}");
        }
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let z = |s: [usize; 4]| Tensor::<Cpu, 4>::zeros(s, &Default::default());
    let cases = [
        // heads not a multiple
        (z([1, 4, 6, 8]), z([1, 4, 4, 8]), z([1, 4, 4, 8]), None),
        // head dim mismatch
        (z([1, 4, 4, 8]), z([1, 4, 4, 16]), z([1, 4, 4, 16]), None),
        // v differs from k
        (z([1, 4, 4, 8]), z([1, 4, 4, 8]), z([1, 5, 4, 8]), None),
        // more queries than positions
        (z([1, 6, 4, 8]), z([1, 4, 4, 8]), z([1, 4, 4, 8]), None),
        // kv_len past the capacity
        (z([1, 4, 4, 8]), z([1, 4, 4, 8]), z([1, 4, 4, 8]), Some(5)),
        // batch mismatch
        (z([2, 4, 4, 8]), z([1, 4, 4, 8]), z([1, 4, 4, 8]), None),
    ];
    for (q, k, v, kv_len) in cases {
        let options = AttentionOptions {
            kv_len,
            scale: None,
        };
        match causal_attention(q, k, v, options) {
            Err(SlideSparseError::ShapeMismatch { .. }) => {}
            other => panic!("expected a shape error, got {:?}", other.map(|t| t.dims())),
        }
    }
}
