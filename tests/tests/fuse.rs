//! Fusing layers that read one input (`concat_outputs`, what a model does for q/k/v and
//! gate/up): the fused layer's output is the separate layers' outputs side by side, for every
//! kind of layer, pattern and precision; layers that cannot be one are typed errors.

use burn::{
    backend::NdArray,
    module::Param,
    nn::Linear,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    MaybeSparseLinear, PackOptions, Precision, QuantizedLinear, SlideSparseError,
    SlideSparseLinear, SparsityPattern, concat_outputs,
};
use rand::{Rng, rngs::StdRng};
use slidesparse_tests::{random_small_ints, rng};

type B = NdArray;

/// A dense `[k] -> [n]` layer of small integer weights (sums stay exact in f32).
fn linear(r: &mut StdRng, k: usize, n: usize, bias: bool) -> Linear<B> {
    let device = Default::default();
    let weight = Tensor::from_data(
        TensorData::new(random_small_ints(r, k * n, 3), [k, n]),
        &device,
    );
    Linear {
        weight: Param::from_tensor(weight),
        bias: bias.then(|| {
            Param::from_tensor(Tensor::from_data(
                TensorData::new(random_small_ints(r, n, 5), [n]),
                &device,
            ))
        }),
    }
}

fn forward(layer: &MaybeSparseLinear<B>, x: &Tensor<B, 2>) -> Tensor<B, 2> {
    layer.forward(x.clone())
}

/// Max |a - b| over two tensors of one shape.
fn max_diff(a: Tensor<B, 2>, b: Tensor<B, 2>) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).abs().max().into_scalar()
}

/// Three random layers of one input width (the second without a bias), `kind` applied to
/// each; the fused layer against the separate outputs concatenated.
fn check(r: &mut StdRng, k: usize, kind: &dyn Fn(&Linear<B>) -> MaybeSparseLinear<B>, exact: bool) {
    let widths = [
        r.random_range(1..40),
        r.random_range(1..40),
        r.random_range(1..40),
    ];
    let layers: Vec<MaybeSparseLinear<B>> = widths
        .iter()
        .enumerate()
        .map(|(i, &n)| kind(&linear(r, k, n, i != 1)))
        .collect();
    let refs: Vec<&MaybeSparseLinear<B>> = layers.iter().collect();
    let fused = concat_outputs(&refs).unwrap();
    let m = r.random_range(1..6);
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(random_small_ints(r, m * k, 4), [m, k]),
        &Default::default(),
    );
    let separate = Tensor::cat(layers.iter().map(|l| forward(l, &x)).collect(), 1);
    let got = forward(&fused, &x);
    let diff = max_diff(got, separate.clone());
    let scale = separate.abs().max().into_scalar().max(1.0);
    let what = format!("{} k {k} widths {widths:?}", fused.kind());
    if exact {
        assert_eq!(diff, 0.0, "{what}");
    } else {
        assert!(diff <= 1e-5 * scale, "{what}: max |diff| {diff}");
    }
}

#[test]
fn fused_layers_give_the_separate_outputs_side_by_side() {
    let mut r = rng(900);
    for _ in 0..3 {
        let k = 24 * r.random_range(1..5);
        check(&mut r, k, &|l| l.clone().into(), true);
        for precision in [Precision::Int8, Precision::Fp8, Precision::Bf16] {
            let dense = |l: &Linear<B>| QuantizedLinear::from_linear(l, precision).unwrap().into();
            check(&mut r, k, &dense, precision == Precision::Bf16);
        }
        for pattern in ["2:4", "4:6", "6:8", "8:10"] {
            let pattern: SparsityPattern = pattern.parse().unwrap();
            for precision in [Precision::F32, Precision::Int8] {
                let options = PackOptions::new(pattern, precision);
                let sparse =
                    |l: &Linear<B>| SlideSparseLinear::from_linear(l, &options).unwrap().into();
                check(&mut r, k, &sparse, precision == Precision::F32);
            }
        }
    }
}

#[test]
fn layers_that_cannot_be_one_are_typed_errors() {
    let mut r = rng(901);
    let a = linear(&mut r, 48, 8, false);
    let b = linear(&mut r, 48, 8, true);
    let narrow = linear(&mut r, 24, 8, false);
    let sparse = |l: &Linear<B>, p: &str, precision| -> MaybeSparseLinear<B> {
        SlideSparseLinear::from_linear(l, &PackOptions::new(p.parse().unwrap(), precision))
            .unwrap()
            .into()
    };
    let fuse = |layers: &[&MaybeSparseLinear<B>]| match concat_outputs(layers) {
        Err(SlideSparseError::FuseMismatch { detail }) => detail,
        other => panic!("expected FuseMismatch, got {other:?}"),
    };
    let (da, dn): (MaybeSparseLinear<B>, MaybeSparseLinear<B>) = (a.clone().into(), narrow.into());
    assert!(fuse(&[]).contains("no layers"));
    assert!(fuse(&[&da, &dn]).contains("input widths differ"));
    let s68 = sparse(&a, "6:8", Precision::Int8);
    assert!(fuse(&[&da, &s68]).contains("different kinds"));
    let s24 = sparse(&b, "2:4", Precision::Int8);
    assert!(fuse(&[&s68, &s24]).contains("pattern"));
    let s68_fp8 = sparse(&b, "6:8", Precision::Fp8);
    assert!(fuse(&[&s68, &s68_fp8]).contains("precision"));
    let q8: MaybeSparseLinear<B> = QuantizedLinear::from_linear(&a, Precision::Int8)
        .unwrap()
        .into();
    let q_fp8: MaybeSparseLinear<B> = QuantizedLinear::from_linear(&b, Precision::Fp8)
        .unwrap()
        .into();
    assert!(fuse(&[&q8, &q_fp8]).contains("precisions differ"));
}
