//! The GGUF reader on tiny files written here: values, dequantization, and every kind of
//! malformed header (plus property-based mutations).

use burn_slidesparse::{
    SlideSparseError,
    gguf::{GgmlType, GgufFile, GgufValue},
};
use half::f16;
use proptest::prelude::*;

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A Q8_0 block: scale `d`, codes `q`.
fn q8_0(d: f32, q: &[i8; 32]) -> Vec<u8> {
    let mut b = f16::from_f32(d).to_le_bytes().to_vec();
    b.extend(q.iter().map(|&v| v as u8));
    b
}

/// A Q4_1 block: scale `d`, min `m`, 4-bit codes (element j low nibble, j+16 high nibble).
fn q4_1(d: f32, m: f32, q: &[u8; 32]) -> Vec<u8> {
    let mut b = f16::from_f32(d).to_le_bytes().to_vec();
    b.extend(f16::from_f32(m).to_le_bytes());
    b.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
    b
}

/// (name, ggml dims, ggml type id, data).
type Tensor = (&'static str, Vec<u64>, u32, Vec<u8>);

fn write_gguf(metadata: &[(&str, u32, Vec<u8>)], tensors: &[Tensor]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, type_id, value) in metadata {
        string(&mut out, key);
        out.extend(type_id.to_le_bytes());
        out.extend(value);
    }
    let mut offset = 0u64;
    for (name, dims, type_id, data) in tensors {
        string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(type_id.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (data.len() as u64).next_multiple_of(32);
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    for (_, _, _, data) in tensors {
        out.extend(data);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
    }
    out
}

fn sample() -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let q8: [i8; 32] = std::array::from_fn(|i| i as i8 - 16);
    let q4: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
    let q8_expected: Vec<f32> = q8.iter().map(|&q| 0.5 * q as f32).collect();
    let q4_expected: Vec<f32> = q4.iter().map(|&q| 0.25 * q as f32 - 1.0).collect();
    let f32_data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let mut name_value = Vec::new();
    string(&mut name_value, "tiny");
    let mut tokens = 8u32.to_le_bytes().to_vec(); // array of strings
    tokens.extend(2u64.to_le_bytes());
    string(&mut tokens, "a");
    string(&mut tokens, "b");
    let bytes = write_gguf(
        &[
            ("general.name", 8, name_value),
            ("llama.block_count", 4, 30u32.to_le_bytes().to_vec()),
            ("llama.rope.freq_base", 6, 100000f32.to_le_bytes().to_vec()),
            ("tokenizer.ggml.tokens", 9, tokens),
        ],
        &[
            ("norm.weight", vec![3, 2], 0, f32_data),
            ("blk.0.attn_q.weight", vec![32, 1], 8, q8_0(0.5, &q8)),
            ("blk.0.ffn_up.weight", vec![32, 1], 3, q4_1(0.25, -1.0, &q4)),
        ],
    );
    (bytes, q8_expected, q4_expected)
}

#[test]
fn reads_metadata_and_dequantizes_every_type() {
    let (bytes, q8, q4) = sample();
    let file = GgufFile::parse("tiny", &bytes).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.metadata["general.name"].as_str(), Some("tiny"));
    assert_eq!(file.metadata["llama.block_count"].as_u64(), Some(30));
    assert_eq!(
        file.metadata["llama.rope.freq_base"].as_f64(),
        Some(100000.0)
    );
    assert_eq!(
        file.metadata["tokenizer.ggml.tokens"],
        GgufValue::Array(vec![
            GgufValue::String("a".into()),
            GgufValue::String("b".into())
        ])
    );
    let (v, shape) = file.tensor_f32("norm.weight").unwrap();
    assert_eq!((v, shape), (vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![2, 3]));
    assert_eq!(file.tensor_f32("blk.0.attn_q.weight").unwrap().0, q8);
    assert_eq!(file.tensor_f32("blk.0.ffn_up.weight").unwrap().0, q4);
    assert_eq!(
        file.tensor("blk.0.ffn_up.weight").unwrap().ggml_type,
        GgmlType::Q4_1
    );
    assert!(matches!(
        file.tensor_f32("missing"),
        Err(SlideSparseError::MissingTensor { .. })
    ));
}

#[test]
fn every_truncation_and_bad_header_is_an_error() {
    let (bytes, _, _) = sample();
    let data_start = bytes.len() - 3 * 32; // three tensors, each padded to 32 bytes
    for cut in 0..data_start {
        assert!(GgufFile::parse("t", &bytes[..cut]).is_err(), "cut at {cut}");
    }
    let parse_err = |b: &[u8]| GgufFile::parse("t", b).unwrap_err().to_string();
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(parse_err(&bad).contains("magic"));
    let mut bad = bytes.clone();
    bad[4..8].copy_from_slice(&4u32.to_le_bytes());
    assert!(parse_err(&bad).contains("version 4"));
    // Huge tensor / metadata counts: refused before any allocation.
    for at in [8, 16] {
        let mut bad = bytes.clone();
        bad[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse_err(&bad).contains("exceeds"), "{}", parse_err(&bad));
    }
    // Unknown metadata value type, duplicate tensor, bad dims, data past the end, bad type.
    let one = |t: Tensor| write_gguf(&[], &[t]);
    assert!(parse_err(&write_gguf(&[("k", 99, vec![])], &[])).contains("value type 99"));
    let t = ("x", vec![2], 0, vec![0; 8]);
    assert!(parse_err(&write_gguf(&[], &[t.clone(), t.clone()])).contains("twice"));
    assert!(parse_err(&one(("x", vec![], 0, vec![]))).contains("dimensions"));
    assert!(parse_err(&one(("x", vec![1; 5], 0, vec![0; 4]))).contains("dimensions"));
    assert!(parse_err(&one(("x", vec![u64::MAX, 4], 0, vec![]))).contains("overflow"));
    assert!(parse_err(&one(("x", vec![1 << 20], 0, vec![0; 8]))).contains("past the end"));
    assert!(parse_err(&one(("x", vec![31], 8, vec![0; 34]))).contains("block size"));
    let unknown_bytes = one(("x", vec![4], 12, vec![0; 32]));
    let unknown = GgufFile::parse("t", &unknown_bytes).unwrap();
    assert!(matches!(
        unknown.tensor_f32("x"),
        Err(SlideSparseError::UnsupportedDtype { .. })
    ));
    let mut alignment = 7u32.to_le_bytes().to_vec();
    alignment.truncate(4);
    assert!(
        parse_err(&write_gguf(&[("general.alignment", 4, alignment)], &[])).contains("alignment")
    );
}

proptest! {
    /// Random byte edits and truncations: an error or a file whose tensors all read.
    #[test]
    fn survives_random_mutations(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let (mut bytes, _, _) = sample();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(file) = GgufFile::parse("fuzz", &bytes) {
            for t in &file.tensors {
                let _ = file.tensor_f32(&t.name);
            }
        }
    }

    #[test]
    fn survives_arbitrary_bytes(mut bytes in prop::collection::vec(any::<u8>(), 0..256), magic in any::<bool>()) {
        if magic && bytes.len() >= 8 {
            bytes[..4].copy_from_slice(b"GGUF");
            bytes[4..8].copy_from_slice(&3u32.to_le_bytes());
        }
        let _ = GgufFile::parse("fuzz", &bytes);
    }
}
