//! Loads a Hugging Face Llama / Qwen2 checkpoint folder exactly as `generate --hf DIR` does
//! (CPU backend, dense f32) and reports the time it took, the parameter count and the peak
//! resident memory, for measuring the loader at model scale (`docs/loading.md`).
//!
//! `cargo run --release -p slidesparse-examples --example load_hf -- DIR`

use std::{path::PathBuf, time::Instant};

use burn::{backend::NdArray, module::Module};
use clap::Parser;
use slidesparse_examples::hf_llama::load_hf_llama;

#[derive(Parser)]
struct Args {
    /// The checkpoint folder (config.json, model.safetensors or its index).
    dir: PathBuf,
}

/// Peak resident set size of this process in MiB, from `/proc/self/status` (Linux only).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let start = Instant::now();
    let model = load_hf_llama::<NdArray>(&args.dir, 2048, &Default::default())?;
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "loaded {} parameters in {seconds:.1} s; peak RSS {}",
        model.num_params(),
        peak_rss_mib().map_or("unknown".to_string(), |m| format!("{m:.0} MiB")),
    );
    Ok(())
}
