//! Saving and loading models whose linear layers were swapped: a record only loads into a
//! model swapped the same way, and a mismatch is an error at load, not a panic later.

use burn::{
    backend::NdArray,
    module::Module,
    record::{BinFileRecorder, FullPrecisionSettings},
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    MaybeSparseLinear, PackOptions, Precision, SparsityPattern, load_file, quantize_dense, sparsify,
};
use slidesparse_tests::{TwoLayers, random_f32, rng};

type B = NdArray;

const DIMS: (usize, usize, usize) = (32, 24, 8);

fn recorder() -> BinFileRecorder<FullPrecisionSettings> {
    BinFileRecorder::new()
}

/// A freshly initialized model: burn draws new random weights on every call.
fn dense_model() -> TwoLayers<B> {
    let (d_in, d_hidden, d_out) = DIMS;
    let model = TwoLayers::new(d_in, d_hidden, d_out, &Default::default());
    // burn initializes parameters lazily, and a clone of a not yet initialized parameter
    // draws its own values: run the model once so that clones (and saved records) hold the
    // values its forward uses.
    forward(&model);
    model
}

/// `up` packed as INT8 6:8, `head` left dense (as a model keeps its LM head).
fn sparsified(mut model: TwoLayers<B>) -> TwoLayers<B> {
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    sparsify(&mut model, &options, |name| name == "up").unwrap();
    model
}

fn forward(model: &TwoLayers<B>) -> Vec<f32> {
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(random_f32(&mut rng(60), 5 * DIMS.0), [5, DIMS.0]),
        &Default::default(),
    );
    let y = model.head.forward(model.up.forward(x));
    y.into_data().convert::<f32>().into_vec().unwrap()
}

fn saved(model: &TwoLayers<B>, dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("model");
    model.clone().save_file(&path, &recorder()).unwrap();
    // BinFileRecorder appends its extension.
    path.with_extension("bin")
}

#[test]
fn a_sparsified_model_round_trips_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let model = sparsified(dense_model());
    let path = saved(&model, &dir);

    // Other random weights: every value the forward sees must come from the record.
    let fresh = sparsified(dense_model());
    assert_ne!(forward(&fresh), forward(&model));
    let loaded = load_file(fresh, &path, &recorder(), &Default::default()).unwrap();
    assert!(matches!(loaded.up, MaybeSparseLinear::Sparse(_)));
    assert!(matches!(loaded.head, MaybeSparseLinear::Dense(_)));
    let (expected, actual) = (forward(&model), forward(&loaded));
    assert_eq!(
        expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        actual.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn a_sparse_record_into_a_dense_model_is_an_error_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(&sparsified(dense_model()), &dir);

    let err = load_file(dense_model(), &path, &recorder(), &Default::default()).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("up=Dense"), "{message}");
    assert!(message.contains("the same way"), "{message}");
}

#[test]
fn a_sparse_record_into_a_quantized_model_is_an_error_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(&sparsified(dense_model()), &dir);

    let mut quantized = dense_model();
    quantize_dense(&mut quantized, Precision::Int8, |name| name == "up").unwrap();
    let err = load_file(quantized, &path, &recorder(), &Default::default()).unwrap_err();
    assert!(err.to_string().contains("up=Quantized"), "{err}");
}

#[test]
fn a_dense_record_round_trips_through_load_record() {
    let model = dense_model();
    let record = model.clone().into_record();
    let loaded = burn_slidesparse::load_record(dense_model(), record).unwrap();
    assert_eq!(forward(&loaded), forward(&model));
}

#[test]
fn a_missing_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing.bin");
    let err = load_file(dense_model(), &missing, &recorder(), &Default::default()).unwrap_err();
    assert!(err.to_string().contains("nothing.bin"), "{err}");
}
