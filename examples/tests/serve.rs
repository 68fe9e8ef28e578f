//! Serving what was packed: a Hugging Face checkpoint packed by the library's packer (what
//! `slidesparse pack` runs) and loaded into the model reproduces packing in process exactly;
//! the fine-tune flow's packed file (model layer names) likewise; a sparsified model saved
//! and loaded whole through burn's recorders reproduces its logits exactly; files that do not
//! fit the model are errors that name the layer.

use burn::{
    backend::NdArray,
    module::Module,
    record::{FullPrecisionSettings, NamedMpkFileRecorder},
    tensor::{Int, Tensor, TensorData},
};
use burn_slidesparse::{
    LayerSelection, MaybeSparseLinear, PackOptions, Precision, SlideSparseError, SparsityPattern,
    VisitLinears, load_file, load_packed_file, pack_checkpoint, quantize_dense, save_layers,
    sparsify,
};
use slidesparse_examples::{
    hf_llama::{load_hf_llama, load_hf_packed},
    llama::{KvCache, Llama, LlamaConfig},
};

type B = NdArray;

fn tiny_config() -> LlamaConfig {
    LlamaConfig::new(64, 32, 48, 2, 4, 2)
        .with_max_seq_len(64)
        .with_qkv_bias(true)
        .with_tie_embeddings(false)
}

fn logits(model: &Llama<B>, ids: &[i64]) -> Vec<f32> {
    let tokens = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids.to_vec(), [1, ids.len()]),
        &Default::default(),
    );
    model
        .forward(tokens, &mut KvCache::default())
        .into_data()
        .into_vec()
        .unwrap()
}

const IDS: [i64; 7] = [3, 17, 42, 5, 63, 0, 9];

fn options() -> PackOptions {
    PackOptions::new(SparsityPattern::P6_8, Precision::Int8)
}

fn blocks_only(name: &str) -> bool {
    name != "lm_head"
}

/// A Hugging Face checkpoint folder of `model` (written by the `write_hf_checkpoint`
/// example's library code path: the same layout the HF loader reads).
fn write_hf(model: &Llama<B>, config: &LlamaConfig, dir: &std::path::Path) {
    slidesparse_examples::hf_llama::write_hf_checkpoint(model, config, dir).unwrap();
}

#[test]
fn an_hf_checkpoint_packed_then_loaded_matches_packing_in_process() {
    let device = Default::default();
    let config = tiny_config();
    let dir = tempfile::tempdir().unwrap();
    write_hf(&config.init::<B>(&device), &config, dir.path());

    // Pack the checkpoint on disk, as `slidesparse pack` does, and serve the file.
    let packed = dir.path().join("model.slidesparse.safetensors");
    let report = pack_checkpoint(
        &dir.path().join("model.safetensors"),
        &packed,
        &LayerSelection::new(None).unwrap(),
        &options(),
    )
    .unwrap();
    assert_eq!(report.layers.len(), 7 * config.layers);
    let mut served = load_hf_llama::<B>(dir.path(), 64, &device).unwrap();
    let loaded = load_hf_packed(&mut served, dir.path(), &packed).unwrap();
    assert_eq!(loaded.len(), 7 * config.layers);

    // The same model packed in process with the same options.
    let mut in_process = load_hf_llama::<B>(dir.path(), 64, &device).unwrap();
    sparsify(&mut in_process, &options(), blocks_only).unwrap();

    assert_eq!(logits(&served, &IDS), logits(&in_process, &IDS));
    let mut kinds = Vec::new();
    served
        .visit_linears(&mut |name, layer| {
            kinds.push((name.to_string(), layer.kind()));
            Ok(())
        })
        .unwrap();
    assert!(
        kinds
            .iter()
            .all(|(n, k)| (n == "lm_head") == (*k == "Dense"))
    );

    // A file holding layers the model does not have is refused, naming them, and the model
    // is left as it was.
    let shallow = LlamaConfig {
        layers: 1,
        ..config.clone()
    };
    let mut small = shallow.init::<B>(&device);
    let before = logits(&small, &IDS);
    let err = load_hf_packed(&mut small, dir.path(), &packed).unwrap_err();
    assert!(
        matches!(err, SlideSparseError::PackedMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("model.layers.1."), "{err}");
    assert_eq!(logits(&small, &IDS), before);
}

#[test]
fn a_packed_file_with_model_names_serves_and_a_misfit_is_named() {
    let device = Default::default();
    let config = tiny_config();
    let dense = config.init::<B>(&device);
    // burn initializes parameters lazily, and clones of an uninitialized module initialize
    // on their own: run the model once so that the clones below share its weights.
    let _ = logits(&dense, &IDS);
    let mut sparse = dense.clone();
    sparsify(&mut sparse, &options(), blocks_only).unwrap();
    // What the fine-tune flow writes: the packed layers under the model's own names.
    let mut layers = Vec::new();
    sparse
        .visit_linears(&mut |name, layer| {
            if let Some(s) = layer.sparse() {
                layers.push(s.to_packed(&format!("{name}.weight"))?);
            }
            Ok(())
        })
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("packed.safetensors");
    save_layers(&path, &layers).unwrap();

    let mut served = dense.clone();
    let loaded = load_packed_file(&mut served, &path, |n| n.to_string()).unwrap();
    assert_eq!(loaded.len(), 7 * config.layers);
    assert_eq!(logits(&served, &IDS), logits(&sparse, &IDS));

    // A model whose layers are of other sizes: the error names the layer and both sizes.
    let wider = LlamaConfig::new(64, 32, 40, 2, 4, 2)
        .with_max_seq_len(64)
        .with_qkv_bias(true)
        .with_tie_embeddings(false);
    let mut other = wider.init::<B>(&device);
    let err = load_packed_file(&mut other, &path, |n| n.to_string()).unwrap_err();
    assert!(
        matches!(err, SlideSparseError::PackedMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("gate_proj"), "{err}");
}

#[test]
fn a_sparsified_model_saved_and_loaded_whole_reproduces_its_logits() {
    let device = Default::default();
    let config = tiny_config();
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let dir = tempfile::tempdir().unwrap();
    for precision in [Precision::Int8, Precision::Fp8, Precision::Bf16] {
        let mut model = config.init::<B>(&device);
        let options = PackOptions::new(SparsityPattern::P6_8, precision);
        sparsify(&mut model, &options, |n| n.starts_with("layers.0.")).unwrap();
        // The dense baseline in the other block, so both kinds of codes round-trip.
        quantize_dense(&mut model, precision, |n| n.starts_with("layers.1.")).unwrap();
        let path = dir.path().join(format!("model-{precision}"));
        // Materialized before the clone that is saved (see above: lazy initialization).
        let expected = logits(&model, &IDS);
        model.clone().save_file(&path, &recorder).unwrap();

        // A fresh model (other random weights) swapped the same way, then loaded.
        let mut fresh = config.init::<B>(&device);
        sparsify(&mut fresh, &options, |n| n.starts_with("layers.0.")).unwrap();
        quantize_dense(&mut fresh, precision, |n| n.starts_with("layers.1.")).unwrap();
        let fresh = load_file(fresh, path.with_extension("mpk"), &recorder, &device).unwrap();
        assert_eq!(logits(&fresh, &IDS), expected, "{precision}");

        // The codes are stored in their own width: the file is smaller than f32 codes.
        let bytes = std::fs::metadata(path.with_extension("mpk")).unwrap().len();
        let mut code_elems = 0usize;
        let mut model = model;
        model
            .visit_linears(&mut |_, layer| {
                code_elems += match layer {
                    MaybeSparseLinear::Sparse(s) => s.weight.weight().codes.len(),
                    MaybeSparseLinear::Quantized(q) => q.weight.weight().codes.len(),
                    _ => 0,
                };
                Ok(())
            })
            .unwrap();
        let f32_codes = 4 * code_elems as u64;
        assert!(
            bytes < f32_codes,
            "{precision}: record {bytes} bytes, f32 codes alone would be {f32_codes}"
        );
    }
}
