//! What every fuzz target checks, shared with the regression test that replays the kept
//! corpus in CI (`tests/tests/fuzz_corpus.rs` includes this file). Each function must not
//! panic on any input; it panics only when a reader accepts something it must not.

use burn_slidesparse::{
    LayerSelection, PackOptions, PackedFile, Precision, SparsityPattern, gguf::GgufFile,
    pack_checkpoint,
};

/// The pattern parser accepts exactly `(2N-2):2N` for N in 2..=16.
pub fn pattern(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(p) = text.parse::<SparsityPattern>() {
        let shown = p.to_string();
        let (nz, block) = shown.split_once(':').expect("n:m");
        let (nz, block): (u32, u32) = (nz.parse().unwrap(), block.parse().unwrap());
        assert!(
            nz + 2 == block && block % 2 == 0 && (4..=32).contains(&block),
            "{text:?} -> {shown}"
        );
    }
}

/// The packed reader returns an error or layers that pass full validation.
pub fn packed(data: &[u8]) {
    if let Ok(file) = PackedFile::from_bytes("fuzz", data) {
        for layer in &file.layers {
            layer
                .validate()
                .expect("an accepted packed layer validates");
        }
    }
}

/// The checkpoint packer (the CLI's reader) returns an error or a packed file that loads.
pub fn checkpoint(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in.safetensors");
    let output = dir.path().join("out.safetensors");
    std::fs::write(&input, data).expect("write input");
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    let selection = LayerSelection::new(None).expect("no filter");
    if pack_checkpoint(&input, &output, &selection, &options).is_ok() {
        PackedFile::load(&output).expect("what the packer wrote loads");
    }
}

/// The GGUF reader returns an error, or a file whose every tensor dequantizes (to exactly
/// its element count, for every block type including the k-quants) or errors.
pub fn gguf(data: &[u8]) {
    if let Ok(file) = GgufFile::parse("fuzz", data) {
        for info in &file.tensors {
            if let Ok((values, shape)) = file.tensor_f32(&info.name) {
                assert_eq!(values.len(), info.elements(), "{}", info.name);
                assert_eq!(
                    shape.iter().product::<usize>(),
                    values.len(),
                    "{}",
                    info.name
                );
            }
        }
    }
}
