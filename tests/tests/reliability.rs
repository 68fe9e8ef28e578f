//! Reliability: every malformed input is an error, never a panic, a hang or a silent wrong
//! result. Property-based (proptest) fuzzing of the pattern parser and the file readers;
//! raise the budget with `PROPTEST_CASES=100000 cargo test --release -p slidesparse-tests
//! --test reliability`. Hand-made corruptions of every header field are checked one by one.

use burn_slidesparse::{
    LayerSelection, PackOptions, Precision, SlideSparseError, SparsityPattern,
    internals::format::{self, PackedFile},
    internals::write_random_checkpoint,
    pack_checkpoint, pack_linear,
};
use proptest::prelude::*;
use slidesparse_tests::{random_f32, rng};

/// A valid packed file with an INT8 (bias, slid layout), an FP8 and a BF16 layer (compact).
fn valid_packed_file() -> Vec<u8> {
    let mut rng = rng(300);
    let layers: Vec<_> = [
        (Precision::Int8, true),
        (Precision::Fp8, false),
        (Precision::Bf16, false),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(p, bias))| {
        let (n, k) = (8 + i, 24 + 5 * i);
        let w = random_f32(&mut rng, n * k);
        let b = random_f32(&mut rng, n);
        let mut layer = pack_linear(
            "x",
            &w,
            n,
            k,
            bias.then_some(&b[..]),
            &PackOptions::new(SparsityPattern::P6_8, p),
        )
        .unwrap()
        .0;
        layer.name = format!("l{i}.weight");
        layer
    })
    .collect();
    let mut metas = Vec::new();
    let mut tensors = Vec::new();
    // The first layer in the slid layout (versions 1 and 2 store it so; the header tests
    // corrupt its `W'`), the others compact: the fuzzing reaches both readers.
    for (i, l) in layers.iter().enumerate() {
        let layout = if i == 0 {
            format::WeightLayout::Slid
        } else {
            format::WeightLayout::Compact
        };
        let (m, t) = format::layer_tensors_in(l, layout).unwrap();
        metas.push(m);
        tensors.extend(t);
    }
    format::serialize(&tensors, format::file_metadata(&metas)).unwrap()
}

/// Splits a safetensors file into (header JSON, data).
fn split(bytes: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        bytes[8 + n..].to_vec(),
    )
}

fn join_text(header: &str, data: &[u8]) -> Vec<u8> {
    let mut text = header.as_bytes().to_vec();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    out
}

fn join(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    join_text(&serde_json::to_string(header).unwrap(), data)
}

fn load_err(bytes: &[u8]) -> String {
    match PackedFile::from_bytes("fuzz", bytes) {
        Ok(_) => panic!("corrupted file was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_header_corruption_is_a_clear_error() {
    let good = valid_packed_file();
    PackedFile::from_bytes("good", &good).unwrap();
    let (header, data) = split(&good);
    let w0 = "l0.slidesparse.weight";

    // Header length past the end of the file.
    let mut past = good.clone();
    past[..8].copy_from_slice(&(good.len() as u64 * 2).to_le_bytes());
    assert!(load_err(&past).contains("fuzz"));
    // Absurd header length (no allocation from it).
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    load_err(&huge);
    // Shape whose element count overflows.
    let mut h = header.clone();
    h[w0]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40]);
    load_err(&join(&h, &data));
    // Offsets out of range.
    let mut h = header.clone();
    h[w0]["data_offsets"] = serde_json::json!([0, data.len() * 4]);
    load_err(&join(&h, &data));
    // Unsupported dtype for the precision.
    let mut h = header.clone();
    h[w0]["dtype"] = "F64".into();
    load_err(&join(&h, &data));
    let mut h = header.clone();
    h[w0]["dtype"] = "U8".into(); // the INT8 layer stored as bytes: rejected, not reinterpreted
    assert!(load_err(&join(&h, &data)).contains("unsupported dtype"));
    // Duplicate tensor names (textually duplicated JSON key).
    let text = serde_json::to_string(&header).unwrap();
    let entry = format!("\"{w0}\":{}", serde_json::to_string(&header[w0]).unwrap());
    let duplicated = text.replacen(&entry, &format!("{entry},{entry}"), 1);
    assert_ne!(duplicated, text);
    assert!(load_err(&join_text(&duplicated, &data)).contains("listed twice"));
    // A layer listed twice in the metadata.
    let mut h = header.clone();
    let layers: Vec<serde_json::Value> =
        serde_json::from_str(h["__metadata__"][format::LAYERS_KEY].as_str().unwrap()).unwrap();
    let twice = serde_json::to_string(&[layers[0].clone(), layers[0].clone()]).unwrap();
    h["__metadata__"][format::LAYERS_KEY] = twice.into();
    assert!(load_err(&join(&h, &data)).contains("twice"));
    // Metadata with an invalid pattern, precision, K' or alignment.
    for (field, value) in [
        ("pattern", serde_json::json!("2:8")),
        ("precision", serde_json::json!("int4")),
        ("k_prime", serde_json::json!(7)),
        ("alignment", serde_json::json!(48)),
        ("in_features", serde_json::json!(usize::MAX)),
    ] {
        let mut h = header.clone();
        let mut layers = layers.clone();
        layers[0][field] = value;
        h["__metadata__"][format::LAYERS_KEY] = serde_json::to_string(&layers).unwrap().into();
        load_err(&join(&h, &data));
    }
    // A missing tensor.
    let mut h = header.clone();
    h.as_object_mut().unwrap().remove("l0.bias");
    load_err(&join(&h, &data));
}

#[test]
fn non_finite_or_zero_scales_are_rejected() {
    let good = valid_packed_file();
    let (header, data) = split(&good);
    let start = header["l0.slidesparse.weight_scale"]["data_offsets"][0]
        .as_u64()
        .unwrap() as usize;
    for bad in [f32::NAN, f32::INFINITY, 0.0, -1.0] {
        let mut d = data.clone();
        d[start..start + 4].copy_from_slice(&bad.to_le_bytes());
        assert!(load_err(&join(&header, &d)).contains("scale"), "{bad}");
    }
}

#[test]
fn corrupted_checkpoints_fail_packing_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let dense = dir.path().join("dense.safetensors");
    write_random_checkpoint(&dense, 32, 64, 1, safetensors::Dtype::F32, 1).unwrap();
    let bytes = std::fs::read(&dense).unwrap();
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    for cut in [0, 7, 8, 100, bytes.len() / 3, bytes.len() - 1] {
        let path = dir.path().join(format!("cut{cut}.safetensors"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let out = dir.path().join("out.safetensors");
        let result = pack_checkpoint(&path, &out, &LayerSelection::new(None).unwrap(), &options);
        assert!(result.is_err(), "cut at {cut}");
        assert!(!out.exists(), "no output may be left behind");
    }
    // A weight with NaN is refused with its position.
    let (header, mut data) = split(&bytes);
    let start = header["model.layers.0.mlp.down_proj.weight"]["data_offsets"][0]
        .as_u64()
        .unwrap() as usize;
    data[start + 12..start + 16].copy_from_slice(&f32::NAN.to_le_bytes());
    let path = dir.path().join("nan.safetensors");
    std::fs::write(&path, join(&header, &data)).unwrap();
    let err = pack_checkpoint(
        &path,
        &dir.path().join("o.safetensors"),
        &LayerSelection::new(None).unwrap(),
        &options,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            SlideSparseError::NonFiniteWeight {
                row: 0,
                column: 3,
                ..
            }
        ),
        "{err}"
    );
}

proptest! {
    /// The pattern parser accepts exactly (2N-2):2N for N in 2..=16 and never panics.
    #[test]
    fn pattern_parser_accepts_exactly_the_slidesparse_patterns(s in "\\PC{0,12}|[0-9 ]{1,3}:[0-9 ]{1,3}") {
        match s.parse::<SparsityPattern>() {
            Ok(p) => {
                let (nz, block) = s.trim().split_once(':').unwrap();
                let (nz, block): (u32, u32) = (nz.trim().parse().unwrap(), block.trim().parse().unwrap());
                prop_assert_eq!(nz + 2, block);
                prop_assert!(block % 2 == 0 && (4..=32).contains(&block));
                prop_assert_eq!(p.to_string(), format!("{nz}:{block}"));
            }
            Err(e) => prop_assert!(e.to_string().contains("(2N-2):2N")),
        }
    }

    /// Random mutations of a valid packed file: an error or a fully valid file, never a panic.
    #[test]
    fn packed_reader_survives_random_mutations(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = valid_packed_file();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(file) = PackedFile::from_bytes("fuzz", &bytes) {
            for layer in &file.layers {
                prop_assert!(layer.validate().is_ok());
            }
        }
    }

    /// Arbitrary bytes: the packed reader and the CLI's checkpoint reader return errors.
    #[test]
    fn readers_survive_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(PackedFile::from_bytes("fuzz", &bytes).is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
        let _ = pack_checkpoint(&path, &dir.path().join("out.safetensors"), &LayerSelection::new(None).unwrap(), &options);
    }
}
