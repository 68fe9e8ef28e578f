//! Replays the kept cargo-fuzz corpus (`fuzz/corpus/<target>/`, inputs the fuzzer found
//! interesting, including any crash it once found) through the same checks as the fuzz
//! targets, so that CI (stable Rust, no libFuzzer) guards every one of them.

#[path = "../../fuzz/src/checks.rs"]
mod checks;

use std::path::Path;

/// Runs `check` on every file of `fuzz/corpus/<target>`; returns how many there were.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let result = std::panic::catch_unwind(|| check(&bytes));
        assert!(result.is_ok(), "{target}: {} panicked", path.display());
        count += 1;
    }
    count
}

#[test]
fn kept_fuzz_corpus_replays_without_panics() {
    for (target, check) in [
        ("pattern", checks::pattern as fn(&[u8])),
        ("packed", checks::packed),
        ("checkpoint", checks::checkpoint),
        ("gguf", checks::gguf),
    ] {
        let n = replay(target, check);
        assert!(n > 0, "fuzz/corpus/{target} is empty");
        println!("{target}: {n} inputs replayed");
    }
}
