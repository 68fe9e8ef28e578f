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
    // Type 16 (IQ2_XXS, a codebook quantization) is listed but not read.
    let unknown_bytes = one(("x", vec![4], 16, vec![0; 32]));
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

// ---- k-quants -------------------------------------------------------------------------
//
// Each block is packed here from its logical contents (super-scales, per-sub-block scales
// and minimums, one code per value) following ggml's block layouts, and the expected values
// come straight from those contents: `d * scale * code - dmin * min`.

/// A deterministic stream of small pseudo-random numbers (no dependency on the reader).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u32) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as u32
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// Q2_K: 16 (scale, min) nibble pairs, codes 0..=3; sub-block of value i is i / 16.
fn q2_k(d: f32, dmin: f32, scales: &[u8; 16], mins: &[u8; 16], codes: &[u8; 256]) -> Vec<u8> {
    let mut b = vec![0u8; 84];
    for s in 0..16 {
        b[s] = scales[s] | (mins[s] << 4);
    }
    for (i, &c) in codes.iter().enumerate() {
        // Half n of 128 values, run j of 32 in it, position l: bits 2j of byte 32n + l.
        let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
        b[16 + 32 * n + l] |= c << (2 * j);
    }
    b[80..82].copy_from_slice(&f16_bytes(d));
    b[82..84].copy_from_slice(&f16_bytes(dmin));
    b
}

/// Q3_K: 16 signed 6-bit scales (-32..=31), codes -4..=3.
fn q3_k(d: f32, scales: &[i8; 16], codes: &[i8; 256]) -> Vec<u8> {
    let mut b = vec![0u8; 110];
    for (i, &c) in codes.iter().enumerate() {
        let u = (c + 4) as u8; // 0..=7: low 2 bits in qs, the third in the mask
        let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
        b[32 + 32 * n + l] |= (u & 3) << (2 * j);
        if u & 4 != 0 {
            b[l] |= 1 << (i / 32);
        }
    }
    for (s, &scale) in scales.iter().enumerate() {
        let u = (scale as i32 + 32) as u8;
        if s < 8 {
            b[96 + s] |= u & 0x0F;
        } else {
            b[96 + s - 8] |= (u & 0x0F) << 4;
        }
        b[96 + 8 + s % 4] |= (u >> 4) << (2 * (s / 4));
    }
    b[108..110].copy_from_slice(&f16_bytes(d));
    b
}

/// The 12 bytes of eight 6-bit scales and minimums of Q4_K / Q5_K.
fn packed_scale_min(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for s in 0..8 {
        if s < 4 {
            p[s] |= scales[s];
            p[s + 4] |= mins[s];
        } else {
            p[s + 4] = (scales[s] & 0x0F) | ((mins[s] & 0x0F) << 4);
            p[s - 4] |= (scales[s] >> 4) << 6;
            p[s] |= (mins[s] >> 4) << 6;
        }
    }
    p
}

/// Q4_K (codes 0..=15) or, with `fifth_bits`, Q5_K (codes 0..=31); sub-block of value i is
/// i / 32.
fn q45_k(
    d: f32,
    dmin: f32,
    scales: &[u8; 8],
    mins: &[u8; 8],
    codes: &[u8; 256],
    five: bool,
) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(f16_bytes(d));
    b.extend(f16_bytes(dmin));
    b.extend(packed_scale_min(scales, mins));
    let mut high = [0u8; 32];
    let mut low = [0u8; 128];
    for (i, &c) in codes.iter().enumerate() {
        let (sub, l) = (i / 32, i % 32);
        // Each 64 values share 32 bytes: low nibbles first, then high nibbles.
        low[32 * (sub / 2) + l] |= (c & 0x0F) << (4 * (sub % 2));
        high[l] |= (c >> 4) << sub;
    }
    if five {
        b.extend(high);
    }
    b.extend(low);
    b
}

/// Q6_K: 16 signed 8-bit scales, codes -32..=31.
fn q6_k(d: f32, scales: &[i8; 16], codes: &[i8; 256]) -> Vec<u8> {
    let mut b = vec![0u8; 210];
    for (i, &c) in codes.iter().enumerate() {
        let u = (c + 32) as u8;
        let (n, q, l) = (i / 128, (i % 128) / 32, i % 32);
        b[64 * n + 32 * (q % 2) + l] |= (u & 0x0F) << (4 * (q / 2));
        b[128 + 32 * n + l] |= (u >> 4) << (2 * q);
    }
    for (s, &v) in scales.iter().enumerate() {
        b[192 + s] = v as u8;
    }
    b[208..210].copy_from_slice(&f16_bytes(d));
    b
}

/// Q8_K: an f32 scale, 256 signed codes, then 16 sums the reader ignores.
fn q8_k(d: f32, codes: &[i8; 256]) -> Vec<u8> {
    let mut b = d.to_le_bytes().to_vec();
    b.extend(codes.iter().map(|&c| c as u8));
    b.extend([0xAB; 32]);
    b
}

/// Random blocks of one k-quant type and their expected values, for `blocks` blocks.
fn k_quant_blocks(type_id: u32, blocks: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut r = Lcg(seed);
    let (mut bytes, mut values) = (Vec::new(), Vec::new());
    for _ in 0..blocks {
        // Powers of two keep every product exact in f32.
        let d = [0.5f32, 0.25, 0.125, 2.0][r.below(4) as usize];
        let dmin = [0.25f32, 1.0, 0.0625][r.below(3) as usize];
        match type_id {
            10 => {
                let sc: [u8; 16] = std::array::from_fn(|_| r.below(16) as u8);
                let mn: [u8; 16] = std::array::from_fn(|_| r.below(16) as u8);
                let c: [u8; 256] = std::array::from_fn(|_| r.below(4) as u8);
                bytes.extend(q2_k(d, dmin, &sc, &mn, &c));
                values.extend(
                    (0..256)
                        .map(|i| d * sc[i / 16] as f32 * c[i] as f32 - dmin * mn[i / 16] as f32),
                );
            }
            11 => {
                let sc: [i8; 16] = std::array::from_fn(|_| r.below(64) as i8 - 32);
                let c: [i8; 256] = std::array::from_fn(|_| r.below(8) as i8 - 4);
                bytes.extend(q3_k(d, &sc, &c));
                values.extend((0..256).map(|i| d * sc[i / 16] as f32 * c[i] as f32));
            }
            12 | 13 => {
                let five = type_id == 13;
                let sc: [u8; 8] = std::array::from_fn(|_| r.below(64) as u8);
                let mn: [u8; 8] = std::array::from_fn(|_| r.below(64) as u8);
                let c: [u8; 256] =
                    std::array::from_fn(|_| r.below(if five { 32 } else { 16 }) as u8);
                bytes.extend(q45_k(d, dmin, &sc, &mn, &c, five));
                values.extend(
                    (0..256)
                        .map(|i| d * sc[i / 32] as f32 * c[i] as f32 - dmin * mn[i / 32] as f32),
                );
            }
            14 => {
                let sc: [i8; 16] = std::array::from_fn(|_| r.below(256) as u8 as i8);
                let c: [i8; 256] = std::array::from_fn(|_| r.below(64) as i8 - 32);
                bytes.extend(q6_k(d, &sc, &c));
                values.extend((0..256).map(|i| d * sc[i / 16] as f32 * c[i] as f32));
            }
            15 => {
                let c: [i8; 256] = std::array::from_fn(|_| r.below(256) as u8 as i8);
                bytes.extend(q8_k(d, &c));
                values.extend(c.iter().map(|&q| d * q as f32));
            }
            other => panic!("not a k-quant: {other}"),
        }
    }
    (bytes, values)
}

const K_QUANTS: [(u32, GgmlType, usize); 6] = [
    (10, GgmlType::Q2K, 84),
    (11, GgmlType::Q3K, 110),
    (12, GgmlType::Q4K, 144),
    (13, GgmlType::Q5K, 176),
    (14, GgmlType::Q6K, 210),
    (15, GgmlType::Q8K, 292),
];

#[test]
fn k_quants_dequantize_from_their_block_layouts() {
    // One file mixing every k-quant with F32 and Q8_0, as a Q4_K_M / Q5_K_M file mixes types:
    // each tensor 2 rows of 512 values (4 super-blocks).
    let names = ["q2k", "q3k", "q4k", "q5k", "q6k", "q8k"];
    let mut expected = Vec::new();
    let mut tensors: Vec<Tensor> = Vec::new();
    for ((type_id, _, block_bytes), name) in K_QUANTS.iter().zip(names) {
        let (bytes, values) = k_quant_blocks(*type_id, 4, *type_id as u64);
        assert_eq!(bytes.len(), 4 * block_bytes);
        tensors.push((name, vec![512, 2], *type_id, bytes));
        expected.push(values);
    }
    let q8: [i8; 32] = std::array::from_fn(|i| i as i8);
    tensors.push(("q8_0", vec![32], 8, q8_0(1.0, &q8)));
    let bytes = write_gguf(&[], &tensors);
    let file = GgufFile::parse("kq", &bytes).unwrap();
    for (((_, ty, _), name), want) in K_QUANTS.iter().zip(names).zip(&expected) {
        assert_eq!(file.tensor(name).unwrap().ggml_type, *ty);
        let (got, shape) = file.tensor_f32(name).unwrap();
        assert_eq!(shape, vec![2, 512], "{name}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{i}]: {g} != {w}"
            );
        }
        assert_eq!(got.len(), want.len());
    }
    assert_eq!(file.tensor_f32("q8_0").unwrap().0[31], 31.0);
}

/// Single-byte checks written from the layouts directly (not through the packers above).
#[test]
fn k_quant_spot_values() {
    let one = |type_id: u32, block: Vec<u8>| {
        let bytes = write_gguf(&[], &[("t", vec![256], type_id, block)]);
        GgufFile::parse("spot", &bytes)
            .unwrap()
            .tensor_f32("t")
            .unwrap()
            .0
    };
    // Q4_K: d = 1, sub-block 0 scale 3 (byte 4), first code byte 0x5F: value 0 is code 15,
    // value 32 is code 5 but sub-block 1 has scale 0.
    let mut b = vec![0u8; 144];
    b[0..2].copy_from_slice(&f16_bytes(1.0));
    b[4] = 3;
    b[16] = 0x5F;
    let v = one(12, b);
    assert_eq!((v[0], v[32]), (45.0, 0.0));
    assert!(v[1..].iter().all(|&x| x == 0.0));
    // Q6_K: all-zero codes are -32 after the offset; scale 2 everywhere, d = 0.5 → -32.
    let mut b = vec![0u8; 210];
    b[192..208].fill(2);
    b[208..210].copy_from_slice(&f16_bytes(0.5));
    assert!(one(14, b).iter().all(|&x| x == -32.0));
    // Q3_K: no high bits set subtracts 4 from every code; all scale bits zero is -32: with
    // d = 1 every value is (-32) * (0 - 4) = 128, except value 0 whose mask bit is set.
    let mut b = vec![0u8; 110];
    b[0] = 1;
    b[108..110].copy_from_slice(&f16_bytes(1.0));
    let v = one(11, b);
    assert_eq!(v[0], 0.0);
    assert!(v[1..].iter().all(|&x| x == 128.0));
    // Q2_K: the minimum alone: sub-block 15 (values 240..256) min nibble 1, dmin = 0.5.
    let mut b = vec![0u8; 84];
    b[15] = 0x10;
    b[82..84].copy_from_slice(&f16_bytes(0.5));
    let v = one(10, b);
    assert!(v[..240].iter().all(|&x| x == 0.0) && v[240..].iter().all(|&x| x == -0.5));
}

#[test]
fn k_quant_rows_must_be_whole_super_blocks_and_fit_the_file() {
    let parse_err = |t: Tensor| {
        let bytes = write_gguf(&[], &[t]);
        GgufFile::parse("t", &bytes).unwrap_err().to_string()
    };
    for (type_id, _, block_bytes) in K_QUANTS {
        // 128 values: not a multiple of the 256-value super-block.
        assert!(parse_err(("x", vec![128], type_id, vec![0; block_bytes])).contains("block size"));
        // Four super-blocks declared, one present.
        let err = parse_err(("x", vec![256, 4], type_id, vec![0; block_bytes]));
        assert!(err.contains("past the end"), "type {type_id}: {err}");
    }
}
