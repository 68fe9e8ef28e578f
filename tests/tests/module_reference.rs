//! `SlideSparseLinear` on the CPU reference backend against `X . prune(W)^T + b`.

use burn::{
    backend::NdArray,
    module::Module,
    nn::LinearConfig,
    record::{BinBytesRecorder, FullPrecisionSettings, Recorder},
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    PackOptions, Precision, SlideSparseLinear, SlideSparseLinearConfig, SparsityPattern,
    pack_linear,
};
use rand::Rng;
use slidesparse_tests::{dense_linear, random_f32, random_small_ints, relative_error, rng};

type B = NdArray;

/// Relative-error budget of one precision (8-bit: per-token activation quantization error
/// on top of the weight quantization the reference already includes).
fn tolerance(precision: Precision) -> f64 {
    match precision {
        Precision::Int8 => 2e-2,
        Precision::Fp8 => 6e-2,
        Precision::Bf16 => 1e-2,
        Precision::F16 => 2e-3,
        Precision::F32 => 1e-5,
    }
}

fn tensor2(values: Vec<f32>, shape: [usize; 2]) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn to_vec(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().unwrap()
}

#[test]
fn every_pattern_and_precision_matches_the_pruned_dense_layer() {
    let mut rng = rng(10);
    for pattern in [
        SparsityPattern::P2_4,
        SparsityPattern::P4_6,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
        "14:16".parse().unwrap(),
    ] {
        for precision in Precision::ALL {
            for with_bias in [false, true] {
                let (m, k, n) = (
                    rng.random_range(1..20),
                    rng.random_range(8..100),
                    rng.random_range(1..50),
                );
                let w = random_f32(&mut rng, n * k);
                let b = with_bias.then(|| random_f32(&mut rng, n));
                let x = random_f32(&mut rng, m * k);
                let (packed, pruned_q, _) = pack_linear(
                    "w",
                    &w,
                    n,
                    k,
                    b.as_deref(),
                    &PackOptions::new(pattern, precision),
                )
                .unwrap();
                let layer = SlideSparseLinear::<B>::from_packed(&packed, &Default::default());
                let y = to_vec(layer.forward(tensor2(x.clone(), [m, k])));
                // The oracle: the pruned, quantized weight, dequantized, times X, in f64.
                let expected = dense_linear(&x, &pruned_q.dequantize(), b.as_deref(), m, k, n);
                let err = relative_error(&y, &expected);
                assert!(
                    err < tolerance(precision),
                    "{pattern} {precision} bias={with_bias} m={m} k={k} n={n}: rel err {err}"
                );
            }
        }
    }
}

#[test]
fn f32_is_exact_on_integer_valued_data() {
    let mut rng = rng(11);
    for pattern in SparsityPattern::all().take(6) {
        let (m, k, n) = (9, 61, 13);
        let w = random_small_ints(&mut rng, n * k, 7);
        let b = random_small_ints(&mut rng, n, 7);
        let x = random_small_ints(&mut rng, m * k, 7);
        let (packed, pruned, _) = pack_linear(
            "w",
            &w,
            n,
            k,
            Some(&b),
            &PackOptions::new(pattern, Precision::F32),
        )
        .unwrap();
        let layer = SlideSparseLinear::<B>::from_packed(&packed, &Default::default());
        let y = to_vec(layer.forward(tensor2(x.clone(), [m, k])));
        let expected = dense_linear(&x, &pruned.codes.to_f32(), Some(&b), m, k, n);
        for (a, e) in y.iter().zip(&expected) {
            assert_eq!(*a as f64, *e, "{pattern}");
        }
    }
}

#[test]
fn rank_three_input_keeps_leading_dimensions() {
    let mut rng = rng(12);
    let (k, n) = (24, 10);
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
    let layer = SlideSparseLinear::<B>::from_packed(&packed, &Default::default());
    let x = random_f32(&mut rng, 2 * 3 * k);
    let x3 = Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [2, 3, k]), &Default::default());
    let y3 = layer.forward(x3);
    assert_eq!(y3.dims(), [2, 3, n]);
    let y2 = layer.forward(tensor2(x, [6, k]));
    assert_eq!(y3.reshape([6, n]).into_data(), y2.into_data());
}

#[test]
fn from_linear_uses_burns_in_out_layout() {
    let device = Default::default();
    let linear = LinearConfig::new(32, 12).with_bias(true).init::<B>(&device);
    let layer = SlideSparseLinear::from_linear_with(
        &linear,
        SparsityPattern::P6_8,
        Precision::F32,
        burn_slidesparse::PruneMethod::Magnitude,
    )
    .unwrap();
    // burn's weight is [in, out]; transpose to [out, in] and prune the same way.
    let w_in_out = linear.weight.val().into_data().into_vec::<f32>().unwrap();
    let w: Vec<f32> = (0..12)
        .flat_map(|o| (0..32).map(move |i| (o, i)))
        .map(|(o, i)| w_in_out[i * 12 + o])
        .collect();
    let b = linear
        .bias
        .as_ref()
        .unwrap()
        .val()
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    let pruned =
        burn_slidesparse::prune("w", &w, 12, 32, SparsityPattern::P6_8, &Default::default())
            .unwrap();
    let mut rng = rng(13);
    let x = random_f32(&mut rng, 4 * 32);
    let y = to_vec(layer.forward(tensor2(x.clone(), [4, 32])));
    let expected = dense_linear(&x, &pruned, Some(&b), 4, 32, 12);
    assert!(relative_error(&y, &expected) < 1e-6);
    // And the dense layer itself, through burn, agrees when the weight is already sparse.
    let err = relative_error(
        &to_vec(linear.forward(tensor2(x.clone(), [4, 32]))),
        &dense_linear(&x, &w, Some(&b), 4, 32, 12),
    );
    assert!(err < 1e-6);
}

#[test]
fn record_round_trip_keeps_the_packed_form() {
    let mut rng = rng(14);
    let device = Default::default();
    for precision in Precision::ALL {
        let (k, n) = (40, 16);
        let w = random_f32(&mut rng, n * k);
        let b = random_f32(&mut rng, n);
        let (packed, _, _) = pack_linear(
            "w",
            &w,
            n,
            k,
            Some(&b),
            &PackOptions::new(SparsityPattern::P4_6, precision),
        )
        .unwrap();
        let layer = SlideSparseLinear::<B>::from_packed(&packed, &device);
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let bytes = recorder.record(layer.clone().into_record(), ()).unwrap();
        let config = SlideSparseLinearConfig::new(k, n, SparsityPattern::P4_6, precision);
        let fresh = config.init::<B>(&device);
        let x = tensor2(random_f32(&mut rng, 3 * k), [3, k]);
        // The zero-initialized layer is valid and computes the bias, 0.
        assert!(fresh.forward(x.clone()).abs().max().into_scalar() == 0.0);
        let loaded = fresh.load_record(recorder.load(bytes, &device).unwrap());
        assert_eq!(loaded.to_packed("w").unwrap(), packed, "{precision}");
        assert_eq!(
            loaded.forward(x.clone()).into_data(),
            layer.forward(x).into_data()
        );
    }
}

#[test]
fn nan_token_gives_a_nan_row_and_leaves_other_rows_alone() {
    let mut rng = rng(15);
    let (k, n) = (16, 8);
    let w = random_f32(&mut rng, n * k);
    for precision in [Precision::Int8, Precision::Fp8] {
        let (packed, _, _) = pack_linear(
            "w",
            &w,
            n,
            k,
            None,
            &PackOptions::new(SparsityPattern::P6_8, precision),
        )
        .unwrap();
        let layer = SlideSparseLinear::<B>::from_packed(&packed, &Default::default());
        let mut x = random_f32(&mut rng, 3 * k);
        x[k + 5] = f32::NAN;
        x[2 * k + 1] = f32::INFINITY;
        let y = to_vec(layer.forward(tensor2(x, [3, k])));
        assert!(y[..n].iter().all(|v| v.is_finite()));
        assert!(y[n..].iter().all(|v| v.is_nan()), "{precision}: {y:?}");
    }
}

#[test]
fn wrong_input_width_is_an_error() {
    let layer = SlideSparseLinearConfig::new(16, 4, SparsityPattern::P6_8, Precision::Int8)
        .init::<B>(&Default::default());
    let err = layer
        .try_forward(tensor2(vec![0.0; 15], [1, 15]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("16") && err.contains("15"), "{err}");
}
