//! Quickstart: replace a burn `nn::Linear` by a 6:8 INT8 `SlideSparseLinear`, compare the
//! outputs with the dense layer, and save/load the packed layer through burn's recorder.
//!
//! `cargo run --release -p slidesparse-examples --example quickstart`

use burn::{
    backend::NdArray,
    module::Module,
    nn::LinearConfig,
    record::{BinFileRecorder, FullPrecisionSettings},
    tensor::{Distribution, Tensor},
};
use burn_slidesparse::{
    PackOptions, Precision, SlideSparseLinear, SlideSparseLinearConfig, SparsityPattern,
};

type B = NdArray;

fn relative_error(a: Tensor<B, 2>, b: Tensor<B, 2>) -> f32 {
    let diff = (a - b.clone()).powf_scalar(2.0).sum().sqrt();
    (diff / b.powf_scalar(2.0).sum().sqrt()).into_scalar()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Default::default();
    let (d_in, d_out, tokens) = (1024, 512, 64);
    let dense = LinearConfig::new(d_in, d_out).init::<B>(&device);
    let x = Tensor::<B, 2>::random([tokens, d_in], Distribution::Normal(0.0, 1.0), &device);
    let y_dense = dense.forward(x.clone());

    println!("pattern  precision  K'    rel. error vs dense");
    for pattern in [
        SparsityPattern::P2_4,
        SparsityPattern::P6_8,
        SparsityPattern::P8_10,
    ] {
        for precision in [Precision::F32, Precision::Int8, Precision::Fp8] {
            let sparse =
                SlideSparseLinear::from_linear(&dense, &PackOptions::new(pattern, precision))?;
            let err = relative_error(sparse.forward(x.clone()), y_dense.clone());
            println!(
                "{pattern:<8} {precision:<10} {:<5} {err:.4}",
                sparse.spec.k_prime()
            );
        }
    }

    // Save the packed 6:8 INT8 layer with burn's recorder and load it into a fresh module.
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let sparse = SlideSparseLinear::from_linear(&dense, &options)?;
    let dir = std::env::temp_dir().join("slidesparse-quickstart");
    std::fs::create_dir_all(&dir)?;
    let recorder = BinFileRecorder::<FullPrecisionSettings>::new();
    sparse.clone().save_file(dir.join("layer"), &recorder)?;
    let loaded = SlideSparseLinearConfig::new(d_in, d_out, SparsityPattern::P6_8, Precision::Int8)
        .init::<B>(&device)
        .load_file(dir.join("layer"), &recorder, &device)?;
    let same = loaded
        .forward(x.clone())
        .equal(sparse.forward(x))
        .all()
        .into_scalar();
    println!("record round trip reproduces the outputs exactly: {same}");
    assert!(same);
    Ok(())
}
