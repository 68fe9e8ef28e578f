//! Swapping layers of a model, the packed file format and the CLI's checkpoint packer.

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    LayerSelection, PackOptions, PackedFile, Precision, SlideSparseError, SparsityPattern,
    internals::{format, write_random_checkpoint},
    pack_checkpoint, pack_linear, sparsify, verify_checkpoint,
};
use slidesparse_tests::{TwoLayers, random_f32, rng};

type B = NdArray;

#[test]
fn sparsify_swaps_the_included_layers_only() {
    let device = Default::default();
    let mut model = TwoLayers::<B>::new(16, 32, 8, &device);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::F32);
    let packed = sparsify(&mut model, &options, |name| name != "head").unwrap();
    assert_eq!(packed, ["up"]);
    assert!(model.up.is_sparse() && !model.head.is_sparse());
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(random_f32(&mut rng(20), 3 * 16), [3, 16]),
        &device,
    );
    assert_eq!(model.head.forward(model.up.forward(x)).dims(), [3, 8]);
}

#[test]
fn packed_layers_round_trip_through_the_file_format() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layers.safetensors");
    let mut rng = rng(21);
    let layers: Vec<_> = Precision::ALL
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let (n, k) = (5 + i, 30 + 7 * i);
            let w = random_f32(&mut rng, n * k);
            let b = random_f32(&mut rng, n);
            let mut packed = pack_linear(
                "x",
                &w,
                n,
                k,
                (i % 2 == 0).then_some(&b[..]),
                &PackOptions::new(SparsityPattern::P4_6, p),
            )
            .unwrap()
            .0;
            packed.name = format!("layer{i}.weight");
            packed
        })
        .collect();
    format::save_layers(&path, &layers).unwrap();
    let loaded = PackedFile::load(&path).unwrap();
    assert_eq!(loaded.layers, layers);
    // And straight into a module, by source name or prefix.
    let module = burn_slidesparse::SlideSparseLinear::<B>::from_packed_file(
        &path,
        "layer2",
        &Default::default(),
    )
    .unwrap();
    assert_eq!(module.to_packed("layer2.weight").unwrap(), layers[2]);
    let missing = burn_slidesparse::SlideSparseLinear::<B>::from_packed_file(
        &path,
        "nope",
        &Default::default(),
    );
    assert!(matches!(
        missing,
        Err(SlideSparseError::MissingTensor { .. })
    ));
}

/// Rewrites one packed file's header JSON (metadata) through `edit`.
fn with_edited_metadata(bytes: &[u8], edit: impl Fn(&mut serde_json::Value)) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    out
}

#[test]
fn broken_packed_files_are_clear_errors() {
    let mut rng = rng(22);
    let w = random_f32(&mut rng, 8 * 16);
    let (mut layer, _, _) = pack_linear(
        "a.weight",
        &w,
        8,
        16,
        None,
        &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
    )
    .unwrap();
    layer.name = "a.weight".into();
    // The slid layout of versions 1 and 2 (this test corrupts its `W'`); the compact one's
    // checks are in `compact_format.rs`.
    let (meta, tensors) = format::layer_tensors_in(&layer, format::WeightLayout::Slid).unwrap();
    let good = format::serialize(&tensors, format::file_metadata(&[meta])).unwrap();
    assert_eq!(
        PackedFile::from_bytes("good", &good).unwrap().layers,
        [layer.clone()]
    );
    let load = |bytes: &[u8]| {
        PackedFile::from_bytes("test", bytes)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };

    // Truncated anywhere: header or data.
    for cut in [0, 4, 8, 20, good.len() / 2, good.len() - 1] {
        let err = load(&good[..cut]);
        assert!(!err.is_empty(), "cut at {cut}");
    }
    // A version this build does not read.
    let unknown = (format::FORMAT_VERSION + 1).to_string();
    let future = with_edited_metadata(&good, |h| {
        h["__metadata__"][format::VERSION_KEY] = unknown.clone().into()
    });
    assert!(load(&future).contains("version"), "{}", load(&future));
    // Not a packed file.
    let plain = with_edited_metadata(&good, |h| {
        h.as_object_mut().unwrap().remove("__metadata__");
    });
    assert!(load(&plain).contains("not a SlideSparse packed file"));
    // Shape mismatch between metadata and tensor.
    let wrong = with_edited_metadata(&good, |h| {
        let layers = h["__metadata__"][format::LAYERS_KEY]
            .as_str()
            .unwrap()
            .replace("\"out_features\":8", "\"out_features\":9");
        h["__metadata__"][format::LAYERS_KEY] = layers.into();
    });
    assert!(load(&wrong).contains("shape mismatch"), "{}", load(&wrong));
    // A window with 3 nonzeros: set the zero lane of a full window.
    let offset = weight_offset(&good);
    let codes = layer.weight.codes.to_f32();
    let lane = (0..codes.len())
        .find(|&i| {
            codes[i] == 0.0
                && codes[i / 4 * 4..i / 4 * 4 + 4]
                    .iter()
                    .filter(|v| **v != 0.0)
                    .count()
                    == 2
        })
        .unwrap();
    let mut three = good.clone();
    three[offset + lane] = 5;
    let err = load(&three);
    assert!(err.contains("3 nonzeros"), "{err}");
}

/// Byte offset of the packed weight's data in a file with one layer `a`.
fn weight_offset(bytes: &[u8]) -> usize {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["a.slidesparse.weight"]["data_offsets"][0]
        .as_u64()
        .unwrap() as usize;
    8 + n + start
}

#[test]
fn checkpoint_pack_verify_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let dense = dir.path().join("dense.safetensors");
    let packed = dir.path().join("packed.safetensors");
    write_random_checkpoint(&dense, 64, 96, 2, safetensors::Dtype::BF16, 5).unwrap();
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Fp8);
    let report = pack_checkpoint(
        &dense,
        &packed,
        &LayerSelection::new(None).unwrap(),
        &options,
    )
    .unwrap();
    // 7 linear layers per block, embeddings and norms untouched.
    assert_eq!(report.layers.len(), 14);
    assert!(
        report
            .layers
            .iter()
            .all(|l| !l.name.contains("norm") && !l.name.contains("embed"))
    );
    let v = verify_checkpoint(&packed, Some(&dense)).unwrap();
    assert_eq!((v.layers, v.checked_against_original), (14, 14));
    // The q_proj bias travelled with its layer.
    let file = PackedFile::load(&packed).unwrap();
    assert!(
        file.layer("model.layers.0.self_attn.q_proj")
            .unwrap()
            .bias
            .is_some()
    );
    // Verifying against a different original fails.
    let other = dir.path().join("other.safetensors");
    write_random_checkpoint(&other, 64, 96, 2, safetensors::Dtype::BF16, 6).unwrap();
    assert!(matches!(
        verify_checkpoint(&packed, Some(&other)),
        Err(SlideSparseError::VerifyMismatch { .. })
    ));
    // Refuses to overwrite its input, and leaves it intact.
    let before = std::fs::read(&dense).unwrap();
    let err = pack_checkpoint(
        &dense,
        &dense,
        &LayerSelection::new(None).unwrap(),
        &options,
    );
    assert!(matches!(err, Err(SlideSparseError::OutputIsInput(_))));
    assert_eq!(std::fs::read(&dense).unwrap(), before);
    // A bad regex is an error, not a panic.
    assert!(LayerSelection::new(Some("(")).is_err());
}
