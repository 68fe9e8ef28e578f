//! Perplexity of SmolLM2 (dense and SlideSparse) over a text file, with sliding windows and
//! exact token counts (every token after the first is scored exactly once).
//!
//! `cargo run --release -p slidesparse-examples --example perplexity -- --text FILE [--max-tokens N]
//!   [--window 512] [--stride 256] [--patterns 2:4,6:8] [--precisions f32,int8] [--prune magnitude,wanda]`

use std::{path::PathBuf, time::Instant};

use burn::backend::NdArray;
use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SparsityPattern, gguf::GgufFile, sparsify_with,
};
use clap::Parser;
use slidesparse_examples::{
    eval::{calibration_norms, perplexity},
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    llama::Llama,
    tokenizer::Tokenizer,
};

type B = NdArray;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    text: PathBuf,
    #[arg(long)]
    gguf: Option<PathBuf>,
    #[arg(long, default_value_t = 2048)]
    max_tokens: usize,
    #[arg(long, default_value_t = 512)]
    window: usize,
    #[arg(long, default_value_t = 256)]
    stride: usize,
    #[arg(long, default_value = "2:4,4:6,6:8,8:10")]
    patterns: String,
    #[arg(long, default_value = "f32,int8")]
    precisions: String,
    /// `magnitude` and/or `wanda` (activation-aware, calibrated on `--calibration`).
    #[arg(long, default_value = "magnitude,wanda")]
    prune: String,
    /// Calibration text for `wanda` (must differ from `--text`).
    #[arg(long, default_value = "/usr/share/common-licenses/Apache-2.0")]
    calibration: PathBuf,
    #[arg(long, default_value_t = 256)]
    calibration_tokens: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let path = smollm2_gguf(args.gguf.as_deref())?;
    let bytes = std::fs::read(&path).map_err(|e| {
        format!(
            "{}: {e} (run the generate example once, or pass --gguf)",
            path.display()
        )
    })?;
    let file = GgufFile::parse(&path.display().to_string(), &bytes)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let text = std::fs::read_to_string(&args.text)?;
    let mut ids = tok.encode(&text)?;
    ids.truncate(args.max_tokens);
    println!(
        "{} tokens of {}, window {}, stride {}",
        ids.len(),
        args.text.display(),
        args.window,
        args.stride
    );
    let dense = load_llama::<B>(&file, args.window.max(2048), &Default::default())?;
    let report = |name: &str, model: &Llama<B>| {
        let t = Instant::now();
        let (ppl, n) = perplexity(model, &ids, args.window, args.stride);
        println!(
            "{name:<24} ppl {ppl:>9.3}  ({n} tokens, {:.0} s)",
            t.elapsed().as_secs_f64()
        );
    };
    report("dense f32", &dense);
    let norms = if args.prune.contains("wanda") {
        let text = std::fs::read_to_string(&args.calibration)?;
        let calib = tok.encode(&text)?;
        println!(
            "calibrated on {} tokens of {}",
            calib.len().min(args.calibration_tokens),
            args.calibration.display()
        );
        calibration_norms(&dense, &calib, args.calibration_tokens)
    } else {
        Default::default()
    };
    for method in args.prune.split(',').map(str::trim) {
        for pattern in args.patterns.split(',') {
            for precision in args.precisions.split(',') {
                let (pattern, precision): (SparsityPattern, Precision) =
                    (pattern.trim().parse()?, precision.trim().parse()?);
                let mut model = dense.clone();
                sparsify_with(&mut model, |name| {
                    let prune = match method {
                        "wanda" => PruneMethod::ActivationAware {
                            input_norms: norms.get(name)?.clone(),
                        },
                        _ => PruneMethod::Magnitude,
                    };
                    (name != "lm_head").then_some(PackOptions {
                        pattern,
                        precision,
                        prune,
                        alignment: 64,
                    })
                })?;
                report(&format!("{pattern} {precision} {method}"), &model);
            }
        }
    }
    Ok(())
}
