//! SlideSparse layers under `Autodiff<B>`: a forward whose input is in the autodiff graph
//! runs the differentiable reference path and gives the input a gradient; one that needs no
//! gradient runs the inner backend's own forward, bit-identical to the plain backend.

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{PackOptions, Precision, SlideSparseLinear, SparsityPattern, pack_linear};
use slidesparse_tests::{random_f32, rng};

type Ad = Autodiff<NdArray>;

fn layers(precision: Precision) -> (SlideSparseLinear<Ad>, SlideSparseLinear<NdArray>) {
    let mut rng = rng(61);
    let (k, n) = (64, 24);
    let w = random_f32(&mut rng, n * k);
    let b = random_f32(&mut rng, n);
    let options = PackOptions::new(SparsityPattern::P6_8, precision);
    let (packed, _, _) = pack_linear("w", &w, n, k, Some(&b), &options).unwrap();
    let device = Default::default();
    (
        SlideSparseLinear::from_packed(&packed, &device),
        SlideSparseLinear::from_packed(&packed, &device),
    )
}

fn input<B: burn::tensor::backend::Backend>(m: usize, seed: u64) -> Tensor<B, 2> {
    let values = random_f32(&mut rng(seed), m * 64);
    Tensor::from_data(TensorData::new(values, [m, 64]), &Default::default())
}

fn values<B: burn::tensor::backend::Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

#[test]
fn an_input_in_the_graph_gets_a_gradient_through_the_layer() {
    for precision in [Precision::F32, Precision::Int8, Precision::Fp8] {
        let (layer, plain) = layers(precision);
        let x = input::<Ad>(5, 62).require_grad();
        // An intermediate tensor (not a leaf) is in the graph too.
        let y = layer.forward(x.clone().mul_scalar(1.0));
        let expected = values(plain.forward(input::<NdArray>(5, 62)));
        let got = values(y.clone());
        let close = got
            .iter()
            .zip(&expected)
            .all(|(a, b)| (a - b).abs() <= 1e-4 * (1.0 + b.abs()));
        assert!(close, "{precision}: the reference path differs");
        let grads = y.sum().backward();
        let gx = x.grad(&grads).expect("the input has a gradient");
        assert_eq!(gx.dims(), [5, 64]);
        let gx = gx.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        assert!(
            gx.iter().all(|v| v.is_finite()),
            "{precision}: non-finite gradient"
        );
        assert!(
            gx.iter().any(|v| *v != 0.0),
            "{precision}: all-zero gradient"
        );
    }
}

#[test]
fn a_forward_without_gradient_is_the_inner_backends_forward() {
    for precision in [Precision::F32, Precision::Int8, Precision::Fp8] {
        let (layer, plain) = layers(precision);
        let y = values(layer.forward(input::<Ad>(7, 63)));
        let expected = values(plain.forward(input::<NdArray>(7, 63)));
        assert_eq!(y, expected, "{precision}");
    }
}
