//! Training under a fixed sparsity mask (`MaskedLinear`): the pruned weights stay exactly zero
//! through optimizer steps, and packing the fine-tuned layer reproduces the masked layer.

use burn::{
    backend::{Autodiff, NdArray},
    module::AutodiffModule,
    nn::LinearConfig,
    optim::{AdamConfig, AdamWConfig, GradientsParams, Optimizer},
    tensor::{Tensor, TensorData, backend::Backend},
};
use burn_slidesparse::{
    MaskedLinear, PackOptions, Precision, PruneMethod, SlideSparseError, SparsityPattern,
    mask_with, sparsify,
};
use slidesparse_tests::{TwoLayers, random_f32, rng};

type Cpu = NdArray;
type Train = Autodiff<NdArray>;

fn input<B: Backend>(values: Vec<f32>, shape: [usize; 2]) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

/// Stored weights `[in, out]` read as `[out, in]` rows.
fn rows_of(layer: &MaskedLinear<impl Backend>) -> Vec<f32> {
    values(layer.linear.weight.val().transpose())
}

/// A random `nn::Linear` masked to `pattern` (magnitude pruning).
fn masked_layer<B: Backend>(
    d_in: usize,
    d_out: usize,
    pattern: SparsityPattern,
) -> MaskedLinear<B> {
    let linear = LinearConfig::new(d_in, d_out).init::<B>(&Default::default());
    MaskedLinear::from_linear(linear, pattern, &PruneMethod::Magnitude).unwrap()
}

/// Trains `layer` for `steps` Adam (or AdamW with weight decay) steps on random regression
/// data and returns it.
fn train(mut layer: MaskedLinear<Train>, steps: usize, adamw: bool) -> MaskedLinear<Train> {
    let mut rng = rng(7);
    let [d_in, d_out] = layer.linear.weight.dims();
    let mut adam = AdamConfig::new().init::<Train, MaskedLinear<Train>>();
    let mut adamw_opt = AdamWConfig::new()
        .with_weight_decay(0.1)
        .init::<Train, MaskedLinear<Train>>();
    for _ in 0..steps {
        let x = input::<Train>(random_f32(&mut rng, 8 * d_in), [8, d_in]);
        let target = input::<Train>(random_f32(&mut rng, 8 * d_out), [8, d_out]);
        let loss = (layer.forward(x) - target).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        layer = if adamw {
            adamw_opt.step(1e-2, layer, grads)
        } else {
            adam.step(1e-2, layer, grads)
        };
    }
    layer
}

/// How many nonzero weights of `before` changed in `after`.
fn kept_weights_moved(before: &[f32], after: &[f32]) -> usize {
    before
        .iter()
        .zip(after)
        .filter(|(b, a)| **b != 0.0 && b != a)
        .count()
}

#[test]
fn pruned_weights_stay_exactly_zero_through_optimizer_steps() {
    for pattern in [SparsityPattern::P2_4, SparsityPattern::P6_8] {
        for adamw in [false, true] {
            let layer = masked_layer::<Train>(48, 24, pattern);
            let before = rows_of(&layer);
            layer.check(pattern).unwrap();
            let trained = train(layer, 20, adamw);
            let after = rows_of(&trained);
            // The kept weights moved (the test would pass vacuously otherwise) ...
            let moved = kept_weights_moved(&before, &after);
            assert!(moved > before.len() / 4, "{pattern}: only {moved} moved");
            // ... and every pruned weight is still exactly zero, so the pattern holds.
            for (i, (b, a)) in before.iter().zip(&after).enumerate() {
                if *b == 0.0 {
                    assert_eq!(a.to_bits(), 0.0f32.to_bits(), "{pattern} weight {i}");
                }
            }
            trained.check(pattern).unwrap();
        }
    }
}

#[test]
fn the_mask_follows_the_pattern_and_the_mask_is_not_trained() {
    let pattern = SparsityPattern::P6_8;
    let layer = masked_layer::<Train>(64, 16, pattern);
    let mask_before = values(layer.mask.val());
    let trained = train(layer, 5, false);
    assert_eq!(values(trained.mask.val()), mask_before);
    // 6 of every 8 weights per row kept.
    let kept = mask_before.iter().filter(|v| **v == 1.0).count();
    assert_eq!(kept, 64 * 16 * 6 / 8);
}

#[test]
fn an_optimizer_that_ignores_zero_gradients_is_undone_by_apply_mask() {
    // Simulate such an optimizer by writing nonzeros into pruned positions.
    let pattern = SparsityPattern::P4_6;
    let layer = masked_layer::<Cpu>(36, 8, pattern);
    let polluted = MaskedLinear {
        linear: burn::nn::Linear {
            weight: layer.linear.weight.clone().map(|w| w + 0.5),
            bias: layer.linear.bias.clone(),
        },
        mask: layer.mask.clone(),
        quantization: None,
        input_permutation: None,
    };
    assert!(polluted.check(pattern).is_err());
    // The function already ignores them; apply_mask makes the stored weights agree.
    let x = input::<Cpu>(random_f32(&mut rng(3), 4 * 36), [4, 36]);
    let before = values(polluted.forward(x.clone()));
    let fixed = polluted.apply_mask();
    fixed.check(pattern).unwrap();
    assert_eq!(values(fixed.forward(x)), before);
}

#[test]
fn packing_a_fine_tuned_layer_gives_the_masked_layers_outputs() {
    let pattern = SparsityPattern::P6_8;
    let trained = train(masked_layer::<Train>(96, 40, pattern), 10, false).valid();
    let x = input::<Cpu>(random_f32(&mut rng(11), 5 * 96), [5, 96]);
    let expected = values(trained.forward(x.clone()));
    for (precision, tolerance) in [(Precision::F32, 1e-6), (Precision::Int8, 2e-2)] {
        let packed = trained
            .to_sparse(&PackOptions::new(pattern, precision))
            .unwrap();
        let got = values(packed.forward(x.clone()));
        let num: f32 = got
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).powi(2))
            .sum();
        let den: f32 = expected.iter().map(|b| b * b).sum();
        let err = (num / den).sqrt();
        assert!(err < tolerance, "{precision}: rel err {err}");
    }
}

fn relative_error(got: &[f32], expected: &[f32]) -> f32 {
    let num: f32 = got.iter().zip(expected).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f32 = expected.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

#[test]
fn the_quantization_aware_forward_computes_what_the_packed_layer_computes() {
    let mut seed = 20;
    for precision in [Precision::Int8, Precision::Fp8] {
        for pattern in [
            SparsityPattern::P2_4,
            SparsityPattern::P6_8,
            SparsityPattern::P8_10,
        ] {
            seed += 1;
            let trained = train(masked_layer::<Train>(120, 24, pattern), 3, false).valid();
            let qat = trained.clone().with_quantization(precision).unwrap();
            // A 3-d input: the per-token scales are taken over the last dimension.
            let x = Tensor::<Cpu, 3>::from_data(
                TensorData::new(random_f32(&mut rng(seed), 2 * 3 * 120), [2, 3, 120]),
                &Default::default(),
            );
            let packed = qat
                .to_sparse(&PackOptions::new(pattern, precision))
                .unwrap();
            let expected = values(packed.forward(x.clone()));
            let got = values(qat.forward(x.clone()));
            let err = relative_error(&got, &expected);
            assert!(err < 1e-5, "{pattern} {precision}: rel err {err}");
            // The rounding is simulated, not skipped: the f32 function differs.
            let exact = values(trained.forward(x));
            let gap = relative_error(&exact, &expected);
            assert!(
                gap > 20.0 * err.max(1e-7),
                "{pattern} {precision}: gap {gap}"
            );
        }
    }
}

#[test]
fn quantization_aware_training_passes_gradients_through_and_keeps_the_mask() {
    let pattern = SparsityPattern::P6_8;
    let layer = masked_layer::<Train>(48, 16, pattern)
        .with_quantization(Precision::Int8)
        .unwrap();
    let before = rows_of(&layer);
    let trained = train(layer, 20, false);
    let after = rows_of(&trained);
    let moved = kept_weights_moved(&before, &after);
    assert!(moved > before.len() / 4, "only {moved} kept weights moved");
    trained.check(pattern).unwrap();
    assert_eq!(trained.quantization, Some(Precision::Int8));
}

#[test]
fn only_8_bit_precisions_are_simulated() {
    for precision in [Precision::Bf16, Precision::F16, Precision::F32] {
        let err = masked_layer::<Cpu>(16, 4, SparsityPattern::P6_8)
            .with_quantization(precision)
            .unwrap_err();
        assert!(matches!(err, SlideSparseError::Unsupported { .. }), "{err}");
    }
}

#[test]
fn packing_with_another_pattern_is_a_clear_error_not_a_silent_prune() {
    let trained = masked_layer::<Cpu>(48, 8, SparsityPattern::P6_8);
    // 6:8 blocks may hold 3 nonzeros in a 2:4 window; packing as 2:4 must refuse.
    let err = trained
        .to_sparse(&PackOptions::new(SparsityPattern::P2_4, Precision::Int8))
        .unwrap_err();
    assert!(
        matches!(err, SlideSparseError::PatternViolation { .. }),
        "{err}"
    );
}

#[test]
fn mask_with_then_sparsify_turns_a_model_masked_then_packed() {
    let device = Default::default();
    let mut model = TwoLayers::<Cpu>::new(32, 16, 4, &device);
    let masked = mask_with(&mut model, SparsityPattern::P6_8, |name| {
        (name != "head").then_some(PruneMethod::Magnitude)
    })
    .unwrap();
    assert_eq!(masked, ["up"]);
    assert!(model.up.masked().is_some() && model.head.dense().is_some());
    let x = input::<Cpu>(random_f32(&mut rng(5), 3 * 32), [3, 32]);
    let masked_out = values(model.up.forward(x.clone()));
    let packed = sparsify(
        &mut model,
        &PackOptions::new(SparsityPattern::P6_8, Precision::F32),
        |name| name == "up",
    )
    .unwrap();
    assert_eq!(packed, ["up"]);
    assert!(model.up.is_sparse());
    let packed_out = values(model.up.forward(x));
    for (a, b) in packed_out.iter().zip(&masked_out) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
    }
}
