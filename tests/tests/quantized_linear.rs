//! `QuantizedLinear`, the dense baseline as a module, on the CPU reference backend.

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    Precision, QuantizedLinear, SlideSparseError, internals::weight_quant::quantize_weight,
    quantize_dense,
};
use slidesparse_tests::{TwoLayers, host_w8a8, random_f32, rng};

type B = NdArray;

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn quantized_linear_is_the_w8a8_pipeline_without_the_slide() {
    let device = Default::default();
    let mut rng = rng(301);
    for precision in [Precision::Int8, Precision::Fp8] {
        for (m, k, n) in [(1, 7, 3), (13, 70, 24), (40, 129, 65)] {
            let w = random_f32(&mut rng, n * k);
            let b = random_f32(&mut rng, n);
            let x = random_f32(&mut rng, m * k);
            let qw = quantize_weight(&w, n, k, precision);
            let layer = QuantizedLinear::<B>::from_quantized(&qw, Some(&b), &device);
            let y = layer
                .forward(Tensor::<B, 2>::from_data(
                    TensorData::new(x.clone(), [m, k]),
                    &device,
                ))
                .into_data()
                .into_vec::<f32>()
                .unwrap();
            let expected = host_w8a8(&x, &qw, &b, (m, k, n), precision);
            let diff = max_rel_diff(&y, &expected);
            assert!(diff < 1e-5, "{precision} {m}x{k}x{n}: {diff}");
        }
    }
}

#[test]
fn quantize_dense_swaps_every_included_layer_and_stays_close_to_dense() {
    let device = Default::default();
    let mut model = TwoLayers::<B>::new(64, 96, 32, &device);
    let x = Tensor::<B, 3>::from_data(
        TensorData::new(random_f32(&mut rng(302), 2 * 5 * 64), [2, 5, 64]),
        &device,
    );
    let dense = model
        .head
        .forward(model.up.forward(x.clone()))
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    let names = quantize_dense(&mut model, Precision::Int8, |_| true).unwrap();
    assert_eq!(names, ["up", "head"]);
    assert!(model.up.quantized().is_some() && model.head.quantized().is_some());
    let quantized = model
        .head
        .forward(model.up.forward(x))
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    let diff = max_rel_diff(&quantized, &dense);
    assert!(diff > 0.0, "INT8 quantization changed nothing");
    assert!(diff < 3e-2, "INT8 W8A8 drifted {diff} from dense");
}

#[test]
fn quantized_linear_rejects_a_wrong_input_width() {
    let device = Default::default();
    let qw = quantize_weight(&random_f32(&mut rng(303), 8 * 16), 8, 16, Precision::Int8);
    let layer = QuantizedLinear::<B>::from_quantized(&qw, None, &device);
    let err = layer
        .try_forward(Tensor::<B, 2>::zeros([3, 15], &device))
        .unwrap_err();
    assert!(
        matches!(err, SlideSparseError::ShapeMismatch { .. }),
        "{err}"
    );
}

#[test]
fn prepare_all_prepares_sparse_and_quantized_layers_and_nothing_else() {
    use burn_slidesparse::{PackOptions, SparsityPattern, prepare_all, sparsify};
    let device = Default::default();
    let mut model = TwoLayers::<B>::new(64, 96, 32, &device);
    assert_eq!(
        prepare_all(&mut model).unwrap(),
        0,
        "dense layers have nothing to prepare"
    );
    sparsify(
        &mut model,
        &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
        |name| name == "up",
    )
    .unwrap();
    quantize_dense(&mut model, Precision::Fp8, |name| name == "head").unwrap();
    assert_eq!(prepare_all(&mut model).unwrap(), 2);
    // Prepared once: preparing again reuses the cached weights and still succeeds.
    assert_eq!(prepare_all(&mut model).unwrap(), 2);
}
