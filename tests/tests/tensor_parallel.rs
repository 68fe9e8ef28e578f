//! Tensor-parallel layers on the CPU reference backend, ranks simulated in one process:
//! the shards are valid layers holding exact slices of the packed weight, sharded equals
//! un-sharded (exactly where the arithmetic allows, within the activation quantization
//! bound where it does not), and splits that cannot work are typed errors.

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    Collective, PackOptions, PackedLinear, Parallelism, Precision, QuantizedLinear, SimulatedRanks,
    SlideSparseError, SlideSparseLinear, SparsityPattern, TensorParallelLinear,
    internals::reference::ACTIVATION_EPS, pack_linear, shard_packed, shard_quantized,
};
use rand::{Rng, rngs::StdRng};
use slidesparse_tests::{dense_linear, random_f32, random_small_ints, rng};

type B = NdArray;

const PATTERNS: [SparsityPattern; 4] = [
    SparsityPattern::P2_4,
    SparsityPattern::P4_6,
    SparsityPattern::P6_8,
    SparsityPattern::P8_10,
];
const RANKS: [usize; 2] = [2, 4];
const BOTH: [Parallelism; 2] = [Parallelism::Column, Parallelism::Row];

fn tensor2(values: Vec<f32>, shape: [usize; 2]) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn to_vec(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().unwrap()
}

/// A random shape every split of `ranks` accepts: `(m, k, out)` with `K` a multiple of
/// `ranks · 2N` and `out` a multiple of `ranks`.
fn splittable_shape(
    rng: &mut StdRng,
    pattern: SparsityPattern,
    ranks: usize,
) -> (usize, usize, usize) {
    (
        rng.random_range(1..=5),
        ranks * pattern.block_len() * rng.random_range(1..=4),
        ranks * rng.random_range(1..=6),
    )
}

/// Options with a random legal alignment (the shard's `K'` is rounded to it on its own).
fn options(rng: &mut StdRng, pattern: SparsityPattern, precision: Precision) -> PackOptions {
    let mut options = PackOptions::new(pattern, precision);
    options.alignment = if rng.random_bool(0.5) {
        precision.min_alignment()
    } else {
        64
    };
    options
}

/// Packs a random layer (weights from `values`, with a bias).
fn packed_layer(
    rng: &mut StdRng,
    (k, out): (usize, usize),
    options: &PackOptions,
    values: impl Fn(&mut StdRng, usize) -> Vec<f32>,
) -> PackedLinear {
    let w = values(rng, out * k);
    let b = values(rng, out);
    pack_linear("layer.weight", &w, out, k, Some(&b), options)
        .unwrap()
        .0
}

fn unsharded(layer: &PackedLinear, x: &[f32], m: usize) -> Vec<f32> {
    let single = SlideSparseLinear::<B>::from_packed(layer, &Default::default());
    to_vec(single.forward(tensor2(x.to_vec(), [m, layer.in_features])))
}

fn sharded(layer: &PackedLinear, parallelism: Parallelism, ranks: usize, x: &[f32]) -> Vec<f32> {
    let devices = vec![Default::default(); ranks];
    let tp = TensorParallelLinear::<B>::from_packed(layer, parallelism, &devices).unwrap();
    assert_eq!(tp.ranks(), ranks);
    let m = x.len() / layer.in_features;
    let y = tp
        .try_forward(
            tensor2(x.to_vec(), [m, layer.in_features]),
            &SimulatedRanks::new(ranks).unwrap(),
        )
        .unwrap();
    assert_eq!(y.dims(), [m, layer.out_features()]);
    to_vec(y)
}

#[test]
fn every_shard_is_a_valid_layer_holding_its_exact_slice_of_the_weight() {
    let mut rng = rng(240);
    for pattern in PATTERNS {
        for precision in [
            Precision::Int8,
            Precision::Fp8,
            Precision::Bf16,
            Precision::F32,
        ] {
            for ranks in RANKS {
                let (_, k, out) = splittable_shape(&mut rng, pattern, ranks);
                let options = options(&mut rng, pattern, precision);
                let layer = packed_layer(&mut rng, (k, out), &options, random_f32);
                // The pruned, quantized `[out, K]` weight the whole layer un-slides to.
                let whole = layer.validate().unwrap();
                let whole_codes = whole.codes.to_f32();
                let bias = layer.bias.clone().unwrap();
                let case = format!("{pattern} {precision} R={ranks} K={k} out={out}");

                let columns = shard_packed(&layer, Parallelism::Column, ranks).unwrap();
                assert_eq!(columns.len(), ranks, "{case}");
                let rows_per = out / ranks;
                for (r, shard) in columns.iter().enumerate() {
                    let back = shard.validate().unwrap_or_else(|e| panic!("{case}: {e}"));
                    assert_eq!((back.rows, back.cols), (rows_per, k), "{case}");
                    assert_eq!(shard.k_prime(), layer.k_prime(), "{case}");
                    let rows = r * rows_per..(r + 1) * rows_per;
                    assert_eq!(
                        back.codes.to_f32(),
                        whole_codes[rows.start * k..rows.end * k],
                        "{case} rank {r}"
                    );
                    assert_eq!(back.scales, whole.scales[rows.clone()], "{case}");
                    assert_eq!(shard.bias.as_deref(), Some(&bias[rows]), "{case}");
                }

                let slices = shard_packed(&layer, Parallelism::Row, ranks).unwrap();
                assert_eq!(slices.len(), ranks, "{case}");
                let k_shard = k / ranks;
                for (r, shard) in slices.iter().enumerate() {
                    assert_eq!(shard.in_features, k_shard, "{case}");
                    assert_eq!(
                        shard.k_prime(),
                        pattern.geometry(k_shard, options.alignment).k_prime(),
                        "{case}"
                    );
                    let back = shard.validate().unwrap_or_else(|e| panic!("{case}: {e}"));
                    assert_eq!((back.rows, back.cols), (out, k_shard), "{case}");
                    let expected: Vec<f32> = whole_codes
                        .chunks_exact(k)
                        .flat_map(|row| row[r * k_shard..(r + 1) * k_shard].to_vec())
                        .collect();
                    assert_eq!(back.codes.to_f32(), expected, "{case} rank {r}");
                    // The weight scales are per output row: every rank keeps the whole row's.
                    assert_eq!(back.scales, whole.scales, "{case}");
                    let expected_bias = (r == 0).then_some(bias.as_slice());
                    assert_eq!(shard.bias.as_deref(), expected_bias, "{case} rank {r}");
                }
            }
        }
    }
}

/// A row shard packs on its own: packing the shard's slice of the pruned weight gives the
/// same slid codes (F32 and BF16 have no per-row scale that the slice would change).
#[test]
fn a_row_shard_is_what_packing_its_slice_of_the_pruned_weight_gives() {
    let mut rng = rng(241);
    for pattern in PATTERNS {
        for precision in [Precision::F32, Precision::Bf16] {
            for ranks in RANKS {
                let (_, k, out) = splittable_shape(&mut rng, pattern, ranks);
                let options = options(&mut rng, pattern, precision);
                let layer = packed_layer(&mut rng, (k, out), &options, random_f32);
                let pruned = layer.validate().unwrap().dequantize();
                let k_shard = k / ranks;
                for (r, shard) in shard_packed(&layer, Parallelism::Row, ranks)
                    .unwrap()
                    .iter()
                    .enumerate()
                {
                    let slice: Vec<f32> = pruned
                        .chunks_exact(k)
                        .flat_map(|row| row[r * k_shard..(r + 1) * k_shard].to_vec())
                        .collect();
                    let bias = shard.bias.as_deref();
                    let (repacked, _, _) =
                        pack_linear(&layer.name, &slice, out, k_shard, bias, &options).unwrap();
                    assert_eq!(
                        repacked, *shard,
                        "{pattern} {precision} R={ranks} K={k} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn f32_sharded_equals_unsharded_exactly_on_integer_data() {
    let mut rng = rng(242);
    for pattern in PATTERNS {
        for ranks in RANKS {
            for parallelism in BOTH {
                let (m, k, out) = splittable_shape(&mut rng, pattern, ranks);
                let options = options(&mut rng, pattern, Precision::F32);
                let ints = |rng: &mut StdRng, n| random_small_ints(rng, n, 7);
                let layer = packed_layer(&mut rng, (k, out), &options, ints);
                let x = random_small_ints(&mut rng, m * k, 7);
                let y = sharded(&layer, parallelism, ranks, &x);
                let case = format!("{pattern} {parallelism} R={ranks} m={m} K={k} out={out}");
                assert_eq!(y, unsharded(&layer, &x, m), "{case}");
                // And both are the pruned layer's exact result.
                let w = layer.validate().unwrap().dequantize();
                let exact = dense_linear(&x, &w, layer.bias.as_deref(), m, k, out);
                for (a, e) in y.iter().zip(&exact) {
                    assert_eq!(*a as f64, *e, "{case}");
                }
            }
        }
    }
}

/// Column-parallel ranks see the whole token, so its per-token scale and codes are the
/// un-sharded layer's: INT8 (integer accumulation) is bit-exact on any data.
#[test]
fn column_parallel_int8_is_bit_exact_on_any_data() {
    let mut rng = rng(243);
    for pattern in PATTERNS {
        for ranks in RANKS {
            let (m, k, out) = splittable_shape(&mut rng, pattern, ranks);
            let options = options(&mut rng, pattern, Precision::Int8);
            let layer = packed_layer(&mut rng, (k, out), &options, random_f32);
            let x = random_f32(&mut rng, m * k);
            assert_eq!(
                sharded(&layer, Parallelism::Column, ranks, &x),
                unsharded(&layer, &x, m),
                "{pattern} R={ranks} m={m} K={k} out={out}"
            );
        }
    }
}

/// FP8 and the 16-bit precisions quantize the same way column-parallel, but their products
/// are not integers, so the only freedom left is the matmul's f32 summation order.
#[test]
fn column_parallel_fp8_and_16_bit_match_up_to_f32_summation() {
    let mut rng = rng(244);
    for pattern in PATTERNS {
        for precision in [Precision::Fp8, Precision::Bf16, Precision::F16] {
            for ranks in RANKS {
                let (m, k, out) = splittable_shape(&mut rng, pattern, ranks);
                let options = options(&mut rng, pattern, precision);
                let layer = packed_layer(&mut rng, (k, out), &options, random_f32);
                let x = random_f32(&mut rng, m * k);
                let y = sharded(&layer, Parallelism::Column, ranks, &x);
                let expected = unsharded(&layer, &x, m);
                for (a, e) in y.iter().zip(&expected) {
                    assert!(
                        (a - e).abs() <= 1e-5 * (1.0 + e.abs()),
                        "{pattern} {precision} R={ranks}: {a} vs {e}"
                    );
                }
            }
        }
    }
}

/// Without activation quantization a row split only splits the sum: exact on integer data.
#[test]
fn row_parallel_16_bit_is_exact_on_integer_data() {
    let mut rng = rng(245);
    for pattern in PATTERNS {
        for precision in [Precision::Bf16, Precision::F16] {
            for ranks in RANKS {
                let (m, k, out) = splittable_shape(&mut rng, pattern, ranks);
                let options = options(&mut rng, pattern, precision);
                let ints = |rng: &mut StdRng, n| random_small_ints(rng, n, 7);
                let layer = packed_layer(&mut rng, (k, out), &options, ints);
                let x = random_small_ints(&mut rng, m * k, 7);
                assert_eq!(
                    sharded(&layer, Parallelism::Row, ranks, &x),
                    unsharded(&layer, &x, m),
                    "{pattern} {precision} R={ranks} m={m} K={k} out={out}"
                );
            }
        }
    }
}

/// Largest error of quantizing `x` with scale `s`, per element (the kernels' rounding:
/// INT8 half a step; E4M3 a 16th of the value, or half the subnormal step).
fn quantization_error(precision: Precision, x: f32, s: f32) -> f64 {
    match precision {
        Precision::Int8 => s as f64 / 2.0,
        Precision::Fp8 => (x.abs() as f64 / 16.0).max(s as f64 * 2f64.powi(-10)),
        _ => unreachable!(),
    }
}

fn token_scale(values: &[f32], precision: Precision) -> f32 {
    values
        .iter()
        .fold(0f32, |a, v| a.max(v.abs()))
        .max(ACTIVATION_EPS)
        / precision.qmax().unwrap()
}

/// Row-parallel INT8/FP8: each rank quantizes its slice of a token with the slice's own
/// scale, so the result is not the un-sharded one; both are within their quantization error
/// of the exact product with the quantized weight, which bounds their difference.
#[test]
fn row_parallel_int8_and_fp8_stay_within_the_activation_quantization_bound() {
    let mut rng = rng(246);
    for precision in [Precision::Int8, Precision::Fp8] {
        let mut differing = 0;
        for pattern in PATTERNS {
            for ranks in RANKS {
                let (m, k, out) = splittable_shape(&mut rng, pattern, ranks);
                let options = options(&mut rng, pattern, precision);
                let layer = packed_layer(&mut rng, (k, out), &options, random_f32);
                // Tokens whose magnitude varies along K, as real activations' outliers do.
                let x: Vec<f32> = random_f32(&mut rng, m * k)
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| v * (1 + (i % k) / 7) as f32)
                    .collect();
                let y = sharded(&layer, Parallelism::Row, ranks, &x);
                let expected = unsharded(&layer, &x, m);
                differing += y.iter().zip(&expected).filter(|(a, e)| a != e).count();
                let w = layer.validate().unwrap().dequantize();
                let b = layer.bias.as_deref().unwrap();
                let k_shard = k / ranks;
                for i in 0..m {
                    let row = &x[i * k..(i + 1) * k];
                    let whole = token_scale(row, precision);
                    let local: Vec<f32> = row
                        .chunks_exact(k_shard)
                        .map(|slice| token_scale(slice, precision))
                        .collect();
                    for j in 0..out {
                        let (mut bound, mut size) = (0.0f64, b[j].abs() as f64);
                        for t in 0..k {
                            let wt = w[j * k + t].abs() as f64;
                            bound += wt
                                * (quantization_error(precision, row[t], whole)
                                    + quantization_error(precision, row[t], local[t / k_shard]));
                            size += wt * row[t].abs() as f64;
                        }
                        // f32 summation on top of the quantization error.
                        bound += 1e-4 * size + 1e-6;
                        let (a, e) = (y[i * out + j] as f64, expected[i * out + j] as f64);
                        assert!(
                            (a - e).abs() <= bound,
                            "{pattern} {precision} R={ranks} token {i} channel {j}: \
                             {a} vs {e}, bound {bound}"
                        );
                    }
                }
            }
        }
        // The local scales are really used: the sharded result is not the un-sharded one.
        assert!(
            differing > 0,
            "{precision}: row-parallel matched bit for bit"
        );
    }
}

/// When every rank's slice of a token holds the token's absmax, the local per-token scales
/// are the un-sharded ones and row-parallel INT8 is exact again (scales of 1 keep the f32
/// epilogue exact): the scale is the only difference.
#[test]
fn row_parallel_int8_is_exact_when_every_slice_holds_the_token_absmax() {
    let mut rng = rng(247);
    for pattern in PATTERNS {
        for ranks in RANKS {
            let (m, k, out) = splittable_shape(&mut rng, pattern, ranks);
            let k_shard = k / ranks;
            let options = options(&mut rng, pattern, Precision::Int8);
            // Weights in [-127, 127] with one 127 per row: weight scale 1, codes = weights.
            let weights = |rng: &mut StdRng, n: usize| {
                let mut w = random_small_ints(rng, n, 127);
                w.iter_mut().step_by(k).for_each(|v| *v = 127.0);
                w
            };
            let layer = packed_layer(&mut rng, (k, out), &options, weights);
            assert!(layer.weight.scales.iter().all(|&s| s == 1.0));
            let mut x = random_small_ints(&mut rng, m * k, 127);
            for i in 0..m {
                for r in 0..ranks {
                    x[i * k + r * k_shard + rng.random_range(0..k_shard)] = -127.0;
                }
            }
            assert_eq!(
                sharded(&layer, Parallelism::Row, ranks, &x),
                unsharded(&layer, &x, m),
                "{pattern} R={ranks} m={m} K={k} out={out}"
            );
        }
    }
}

#[test]
fn the_dense_baseline_shards_like_the_packed_layer() {
    let mut rng = rng(248);
    let device = Default::default();
    for ranks in RANKS {
        for parallelism in BOTH {
            let (m, k, out) = (3, ranks * rng.random_range(1..=9), ranks * 5);
            let w = random_small_ints(&mut rng, out * k, 7);
            let b = random_small_ints(&mut rng, out, 7);
            let x = random_small_ints(&mut rng, m * k, 7);
            let weight = burn_slidesparse::internals::weight_quant::quantize_weight(
                &w,
                out,
                k,
                Precision::F32,
            );
            let single = QuantizedLinear::<B>::from_quantized(&weight, Some(&b), &device);
            let expected = to_vec(single.forward(tensor2(x.clone(), [m, k])));
            let devices = vec![device; ranks];
            let tp = TensorParallelLinear::<B>::from_quantized(
                "dense",
                &weight,
                Some(&b),
                parallelism,
                &devices,
            )
            .unwrap();
            let y = tp
                .try_forward(tensor2(x, [m, k]), &SimulatedRanks::new(ranks).unwrap())
                .unwrap();
            assert_eq!(to_vec(y), expected, "{parallelism} R={ranks} K={k}");
            // Row shards split K evenly with the bias on rank 0 only.
            let shards = shard_quantized("dense", &weight, Some(&b), parallelism, ranks).unwrap();
            for (r, shard) in shards.iter().enumerate() {
                let has_bias = parallelism == Parallelism::Column || r == 0;
                assert_eq!(shard.bias.is_some(), has_bias, "{parallelism} rank {r}");
            }
        }
    }
}

#[test]
fn rank_three_inputs_keep_their_leading_dimensions() {
    let mut rng = rng(249);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::F32);
    let ints = |rng: &mut StdRng, n| random_small_ints(rng, n, 5);
    let layer = packed_layer(&mut rng, (32, 6), &options, ints);
    let x = random_small_ints(&mut rng, 2 * 3 * 32, 5);
    let expected = unsharded(&layer, &x, 6);
    for parallelism in BOTH {
        let tp = TensorParallelLinear::<B>::from_packed(
            &layer,
            parallelism,
            &[Default::default(), Default::default()],
        )
        .unwrap();
        let x3 =
            Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [2, 3, 32]), &Default::default());
        let y3 = tp
            .try_forward(x3, &SimulatedRanks::new(2).unwrap())
            .unwrap();
        assert_eq!(y3.dims(), [2, 3, 6]);
        assert_eq!(to_vec(y3.reshape([6, 6])), expected, "{parallelism}");
    }
}

fn expect_invalid_split(err: SlideSparseError, ranks: usize, words: &[&str]) {
    match &err {
        SlideSparseError::InvalidSplit { ranks: r, .. } => assert_eq!(*r, ranks, "{err}"),
        other => panic!("expected InvalidSplit, got {other:?}"),
    }
    let text = err.to_string();
    for word in words {
        assert!(text.contains(word), "{text:?} lacks {word:?}");
    }
}

#[test]
fn splits_that_cannot_work_are_typed_errors() {
    let mut rng = rng(250);
    for pattern in PATTERNS {
        let block = pattern.block_len();
        let options = PackOptions::new(pattern, Precision::Int8);
        // K a multiple of 2N, and of 2·2N, but not of 4·2N: 2 ranks split it, 4 do not.
        let k = 2 * block * 3;
        let layer = packed_layer(&mut rng, (k, 4), &options, random_f32);
        assert_eq!(shard_packed(&layer, Parallelism::Row, 2).unwrap().len(), 2);
        let err = shard_packed(&layer, Parallelism::Row, 4).unwrap_err();
        let unit = (4 * block).to_string();
        expect_invalid_split(err, 4, &["row-parallel", &format!("K = {k}"), &unit]);
        // K not a multiple of 2N at all (a padded last block) splits over no ranks.
        let ragged = packed_layer(&mut rng, (2 * block + 2, 4), &options, random_f32);
        for ranks in [2, 3] {
            let err = shard_packed(&ragged, Parallelism::Row, ranks).unwrap_err();
            expect_invalid_split(err, ranks, &["whole pattern blocks"]);
        }
        // out = 4 is not a multiple of 3; no ranks at all is an error for both kinds.
        let err = shard_packed(&layer, Parallelism::Column, 3).unwrap_err();
        expect_invalid_split(err, 3, &["column-parallel", "out = 4"]);
        for parallelism in BOTH {
            let err = shard_packed(&layer, parallelism, 0).unwrap_err();
            expect_invalid_split(err, 0, &["at least one rank"]);
        }
        // TensorParallelLinear reports the same errors.
        let devices = vec![Default::default(); 4];
        let err =
            TensorParallelLinear::<B>::from_packed(&layer, Parallelism::Row, &devices).unwrap_err();
        expect_invalid_split(err, 4, &["row-parallel"]);
    }
    // The dense baseline: K must divide evenly, out likewise; a bias of the wrong length
    // is a shape error.
    let weight = burn_slidesparse::internals::weight_quant::quantize_weight(
        &random_f32(&mut rng, 6 * 10),
        6,
        10,
        Precision::Int8,
    );
    let err = shard_quantized("dense", &weight, None, Parallelism::Row, 4).unwrap_err();
    expect_invalid_split(err, 4, &["K = 10", "multiple of 4 ranks"]);
    let err = shard_quantized("dense", &weight, None, Parallelism::Column, 4).unwrap_err();
    expect_invalid_split(err, 4, &["out = 6"]);
    let err =
        shard_quantized("dense", &weight, Some(&[0.0; 5]), Parallelism::Column, 2).unwrap_err();
    assert!(
        matches!(err, SlideSparseError::ShapeMismatch { .. }),
        "{err}"
    );
    assert!(SimulatedRanks::new(0).is_err());
}

#[test]
fn collectives_check_their_ranks() {
    let mut rng = rng(251);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::F32);
    let layer = packed_layer(&mut rng, (16, 4), &options, random_f32);
    let tp = TensorParallelLinear::<B>::from_packed(
        &layer,
        Parallelism::Row,
        &[Default::default(), Default::default()],
    )
    .unwrap();
    let x = tensor2(random_f32(&mut rng, 16), [1, 16]);
    let err = tp
        .try_forward(x.clone(), &SimulatedRanks::new(4).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, SlideSparseError::ShapeMismatch { .. }),
        "{err}"
    );
    // A wrong input width is a shape error, not a panic.
    let err = tp
        .try_forward(
            tensor2(vec![0.0; 8], [1, 8]),
            &SimulatedRanks::new(2).unwrap(),
        )
        .unwrap_err();
    assert!(
        matches!(err, SlideSparseError::ShapeMismatch { .. }),
        "{err}"
    );
    // The simulated collectives: one tensor per rank, sums in rank order, gathers by column.
    let ranks = SimulatedRanks::new(2).unwrap();
    let a = tensor2(vec![1.0, 2.0], [1, 2]);
    let b = tensor2(vec![10.0, 20.0], [1, 2]);
    let sums = ranks.all_reduce_sum(vec![a.clone(), b.clone()]).unwrap();
    assert_eq!(sums.len(), 2);
    for s in sums {
        assert_eq!(to_vec(s), [11.0, 22.0]);
    }
    let gathered = ranks.all_gather(vec![a.clone(), b]).unwrap();
    assert_eq!(to_vec(gathered[1].clone()), [1.0, 2.0, 10.0, 20.0]);
    assert!(Collective::<B>::all_reduce_sum(&ranks, vec![a]).is_err());
    let wide = tensor2(vec![0.0; 3], [1, 3]);
    let narrow = tensor2(vec![0.0; 2], [1, 2]);
    assert!(ranks.all_reduce_sum(vec![wide, narrow]).is_err());
}
