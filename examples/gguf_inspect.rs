//! Lists a GGUF file's metadata and tensors, and dequantizes one tensor.
//!
//! `cargo run --release -p slidesparse-examples --example gguf_inspect -- FILE.gguf [TENSOR]`

use burn_slidesparse::gguf::{GgufFile, GgufValue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: gguf_inspect FILE.gguf [TENSOR]")?;
    let bytes = std::fs::read(&path)?;
    let file = GgufFile::parse(&path, &bytes)?;
    println!(
        "GGUF v{}: {} metadata keys, {} tensors",
        file.version,
        file.metadata.len(),
        file.tensors.len()
    );
    let mut keys: Vec<_> = file.metadata.keys().collect();
    keys.sort();
    for key in keys {
        match &file.metadata[key] {
            GgufValue::Array(items) => println!("  {key}: array of {}", items.len()),
            GgufValue::String(s) if s.len() > 60 => println!("  {key}: {:?}...", &s[..60]),
            value => println!("  {key}: {value:?}"),
        }
    }
    for t in file.tensors.iter().take(12) {
        println!("  {} {:?} {:?}", t.name, t.shape(), t.ggml_type);
    }
    if let Some(name) = args.next() {
        let (values, shape) = file.tensor_f32(&name)?;
        let mean = values.iter().map(|v| *v as f64).sum::<f64>() / values.len() as f64;
        let rms =
            (values.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / values.len() as f64).sqrt();
        println!(
            "{name} {shape:?}: mean {mean:.5}, rms {rms:.5}, first {:?}",
            &values[..8.min(values.len())]
        );
    }
    Ok(())
}
