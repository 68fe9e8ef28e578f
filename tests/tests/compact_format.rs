//! The packed file's compact weight layout (format version 3): every packed layer is written
//! as its kept codes and zero-pair ranks and read back to exactly the same layer, for every
//! pattern, precision, width and permutation; files of versions 1 and 2 (slid weights) still
//! load and are rewritten compact; the compact tensors hold the bytes the layout promises;
//! broken compact tensors are errors that name the file and the tensor.

use burn_slidesparse::{
    ChannelPermutation, InputPermutation, PackOptions, PackedFile, PackedLinear, Precision,
    SparsityPattern,
    internals::format::{self, KEPT_SUFFIX, WeightLayout, ZERO_PAIRS_SUFFIX},
    pack_linear, rank_bits,
};
use rand::{Rng, rngs::StdRng, seq::SliceRandom};
use slidesparse_tests::{random_f32, rng};

const PRECISIONS: [Precision; 5] = [
    Precision::Int8,
    Precision::Fp8,
    Precision::Bf16,
    Precision::F16,
    Precision::F32,
];

/// A layer of `rows x k` random weights packed to `pattern` and `precision`, with a bias and
/// a random input permutation on a coin flip each.
fn random_layer(
    r: &mut StdRng,
    name: &str,
    pattern: SparsityPattern,
    precision: Precision,
    rows: usize,
    k: usize,
) -> PackedLinear {
    let w = random_f32(r, rows * k);
    let bias = random_f32(r, rows);
    let permutation = if r.random_bool(0.5) {
        let mut order: Vec<u32> = (0..k as u32).collect();
        order.shuffle(r);
        ChannelPermutation::Given(InputPermutation::new(order).unwrap())
    } else {
        ChannelPermutation::Identity
    };
    let options = PackOptions {
        permutation,
        ..PackOptions::new(pattern, precision)
    };
    let with_bias = r.random_bool(0.5).then_some(&bias[..]);
    let mut layer = pack_linear(name, &w, rows, k, with_bias, &options)
        .unwrap()
        .0;
    layer.name = name.to_string();
    layer
}

/// Bytes and shape of one tensor of a serialized file.
fn tensor_info(bytes: &[u8], name: &str) -> (Vec<usize>, usize) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let entry = &header[name];
    let shape = entry["shape"]
        .as_array()
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let offsets = entry["data_offsets"].as_array().unwrap();
    let len = offsets[1].as_u64().unwrap() - offsets[0].as_u64().unwrap();
    (shape, len as usize)
}

/// Every pattern x every precision, widths that end inside a block and on one, with and
/// without bias and permutation: written compact, read back equal (codes, scales, bias,
/// permutation, geometry), and the compact tensors of the sizes the layout promises.
#[test]
fn every_layer_round_trips_through_the_compact_layout() {
    let mut r = rng(3300);
    let mut layers = Vec::new();
    for pattern in SparsityPattern::all() {
        for precision in PRECISIONS {
            for k in [pattern.block_len(), 72, 130, 576] {
                let rows = r.random_range(1..12);
                let name = format!("{pattern}.{precision}.{k}.weight").replace(':', "_");
                layers.push(random_layer(&mut r, &name, pattern, precision, rows, k));
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("compact.safetensors");
    format::save_layers(&path, &layers).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let back = PackedFile::load(&path).unwrap();
    assert_eq!(back.layers, layers);

    for layer in &layers {
        let prefix = format::prefix_of(&layer.name);
        let (len, k) = (layer.pattern.block_len(), layer.in_features);
        let blocks = k.div_ceil(len);
        let element = layer.precision().element_bytes();
        let (shape, kept) = tensor_info(&bytes, &format!("{prefix}{KEPT_SUFFIX}"));
        assert_eq!(shape, [layer.out_features(), blocks * (len - 2)]);
        assert_eq!(kept, layer.out_features() * blocks * (len - 2) * element);
        let (shape, ranks) = tensor_info(&bytes, &format!("{prefix}{ZERO_PAIRS_SUFFIX}"));
        let row_bytes = (blocks * rank_bits(layer.pattern) as usize).div_ceil(8);
        assert_eq!(shape, [layer.out_features(), row_bytes]);
        assert_eq!(ranks, layer.out_features() * row_bytes);
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let text = std::str::from_utf8(&bytes[8..8 + header]).unwrap();
        assert!(!text.contains(&format!("\"{prefix}{}\"", format::WEIGHT_SUFFIX)));
    }
}

/// A 6:8 INT8 layer's compact tensors are 6 bytes and 5 bits per 8 weights: at most 0.83x the
/// dense codes (the slid `W'` of version 2 is 1.5x).
#[test]
fn a_6_8_int8_layer_stores_under_0_83x_the_dense_bytes() {
    let (rows, k) = (64, 4096);
    let layer = random_layer(
        &mut rng(3301),
        "w.weight",
        SparsityPattern::P6_8,
        Precision::Int8,
        rows,
        k,
    );
    let (_, tensors) = format::layer_tensors(&layer).unwrap();
    let weight_bytes: usize = tensors
        .iter()
        .filter(|(n, _)| n.ends_with(KEPT_SUFFIX) || n.ends_with(ZERO_PAIRS_SUFFIX))
        .map(|(_, t)| t.data.len())
        .sum();
    let ratio = weight_bytes as f64 / (rows * k) as f64;
    assert!((0.828..=0.829).contains(&ratio), "{ratio}");
    let (_, slid) = format::layer_tensors_in(&layer, WeightLayout::Slid).unwrap();
    let slid_bytes = slid
        .iter()
        .find(|(n, _)| n.ends_with(format::WEIGHT_SUFFIX))
        .unwrap()
        .1
        .data
        .len();
    assert_eq!(slid_bytes, rows * k * 3 / 2);
}

/// A version-2 file (slid weights, a permutation) loads as the same layers and is rewritten
/// as version 3, compact; a version-2 file may not claim the compact layout.
#[test]
fn version_2_files_load_and_are_converted() {
    let mut r = rng(3302);
    let layers: Vec<_> = (0..3)
        .map(|i| {
            random_layer(
                &mut r,
                &format!("l{i}.weight"),
                SparsityPattern::P6_8,
                Precision::Int8,
                8,
                96,
            )
        })
        .collect();
    let mut metas = Vec::new();
    let mut tensors = Vec::new();
    for layer in &layers {
        let (meta, t) = format::layer_tensors_in(layer, WeightLayout::Slid).unwrap();
        metas.push(meta);
        tensors.extend(t);
    }
    let mut metadata = format::file_metadata(&metas);
    metadata.insert(format::VERSION_KEY.into(), "2".into());
    let v2 = format::serialize(&tensors, metadata).unwrap();
    let loaded = PackedFile::from_bytes("v2", &v2).unwrap();
    assert_eq!(loaded.layers, layers);
    let v3 = loaded.to_bytes().unwrap();
    assert!(v3.len() < v2.len());
    assert_eq!(PackedFile::from_bytes("v3", &v3).unwrap().layers, layers);

    let (meta, tensors) = format::layer_tensors(&layers[0]).unwrap();
    let mut metadata = format::file_metadata(&[meta]);
    metadata.insert(format::VERSION_KEY.into(), "2".into());
    let bytes = format::serialize(&tensors, metadata).unwrap();
    let err = PackedFile::from_bytes("f", &bytes).unwrap_err().to_string();
    assert!(
        err.contains("stored compact") && err.contains("version 2"),
        "{err}"
    );
}

/// A packed file's tensors by name, as `format::layer_tensors` gives them.
type NamedTensors = Vec<(String, format::OwnedTensor)>;

/// Broken compact tensors: each an error naming the file and the tensor, never a panic.
#[test]
fn broken_compact_tensors_are_clear_errors() {
    let layer = random_layer(
        &mut rng(3303),
        "a.weight",
        SparsityPattern::P6_8,
        Precision::Int8,
        4,
        20,
    );
    let (meta, tensors) = format::layer_tensors(&layer).unwrap();
    let load = |edit: &dyn Fn(&mut NamedTensors)| {
        let mut tensors = tensors.clone();
        edit(&mut tensors);
        let bytes = format::serialize(&tensors, format::file_metadata(std::slice::from_ref(&meta)))
            .unwrap();
        PackedFile::from_bytes("file.safetensors", &bytes)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let edit = |suffix: &'static str, f: &'static dyn Fn(&mut format::OwnedTensor)| {
        move |t: &mut NamedTensors| {
            f(&mut t.iter_mut().find(|(n, _)| n.ends_with(suffix)).unwrap().1)
        }
    };
    let pairs = format!("a{ZERO_PAIRS_SUFFIX}");
    let kept = format!("a{KEPT_SUFFIX}");

    // A rank past C(8, 2) = 28 (K = 20: 3 blocks, 15 bits in 2 bytes per row).
    let err = load(&edit(ZERO_PAIRS_SUFFIX, &|t| t.data[0] |= 0x1f));
    assert!(
        err.contains("file.safetensors") && err.contains(&kept) && err.contains("rank 31"),
        "{err}"
    );
    // A bit after the last rank of a row.
    let err = load(&edit(ZERO_PAIRS_SUFFIX, &|t| t.data[1] |= 0x80));
    assert!(err.contains("nonzero bits after"), "{err}");
    // Wrong dtype and shape of the ranks, wrong dtype of the codes, a missing tensor.
    let err = load(&edit(ZERO_PAIRS_SUFFIX, &|t| {
        t.dtype = safetensors::Dtype::I8
    }));
    assert!(err.contains(&pairs) && err.contains("U8"), "{err}");
    let err = load(&edit(ZERO_PAIRS_SUFFIX, &|t| {
        t.shape = vec![2, 4];
    }));
    assert!(err.contains(&pairs) && err.contains("shape"), "{err}");
    let err = load(&edit(KEPT_SUFFIX, &|t| t.dtype = safetensors::Dtype::U8));
    assert!(
        err.contains(&kept) && err.contains("unsupported dtype"),
        "{err}"
    );
    let err = load(&|t: &mut Vec<(String, format::OwnedTensor)>| {
        t.retain(|(n, _)| !n.ends_with(KEPT_SUFFIX))
    });
    assert!(err.contains(&kept), "{err}");
}
