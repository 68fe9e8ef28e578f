//! Fine-tune then pack: prune SmolLM2's block linears to a pattern, fine-tune them under the
//! mask (the pruned weights stay exactly zero), save the fine-tuned weights as a safetensors
//! checkpoint, pack it to the portable SlideSparse format, reload the packed layers as
//! `SlideSparseLinear` and report held-out perplexity at every stage.
//!
//! `cargo run --release -p slidesparse-examples --example finetune_then_pack -- --pattern 6:8
//!   --steps 100 [--lr 1e-4] [--seq 128] [--out target/finetune]`
//!
//! Text: Python's `pydoc_data/topics.py`; the first `--eval-tokens` tokens are held out for
//! evaluation, training reads the tokens after them (disjoint). Runs on the CPU (NdArray) by
//! default and on burn-cuda with `--features cuda` (`--device cuda`).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Instant,
};

use burn::{
    backend::{Autodiff, NdArray},
    module::{AutodiffModule, ParamId},
    optim::{AdamConfig, GradientsParams, Optimizer},
    tensor::{
        ElementConversion, Int, Tensor, TensorData,
        activation::log_softmax,
        backend::{AutodiffBackend, Backend},
    },
};
use burn_slidesparse::{
    LayerSelection, MaybeSparseLinear, PackOptions, PackedFile, Precision, PruneMethod,
    SlideSparseBackend, SparsityPattern, VisitLinears,
    gguf::GgufFile,
    internals::{
        format::{OwnedTensor, f32_bytes, serialize},
        write_atomically,
    },
    mask_with, pack_checkpoint,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use slidesparse_examples::{
    eval::{calibration_norms, perplexity},
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    llama::{KvCache, Llama},
    tokenizer::Tokenizer,
};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "6:8")]
    pattern: SparsityPattern,
    /// `wanda` (activation-aware, calibrated on `--calibration`) or `magnitude`.
    #[arg(long, default_value = "wanda")]
    prune: String,
    #[arg(long, default_value_t = 100)]
    steps: usize,
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Training and evaluation text (default: Python's `pydoc_data/topics.py`).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Held-out tokens at the start of `--text` (evaluation only).
    #[arg(long, default_value_t = 1024)]
    eval_tokens: usize,
    #[arg(long, default_value_t = 512)]
    window: usize,
    #[arg(long, default_value_t = 256)]
    stride: usize,
    #[arg(long, default_value = "/usr/share/common-licenses/Apache-2.0")]
    calibration: PathBuf,
    #[arg(long, default_value_t = 256)]
    calibration_tokens: usize,
    /// Precision of the packed model.
    #[arg(long, default_value = "int8")]
    precision: Precision,
    /// Where the checkpoint and the packed file go.
    #[arg(long, default_value = "target/finetune")]
    out: PathBuf,
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// `cpu` or (with `--features cuda`) `cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Control run: fine-tune the dense block linears with the same data and steps, no
    /// pruning and no packing (separates the gain from adapting to the text from the
    /// recovery of what pruning lost).
    #[arg(long)]
    dense_control: bool,
}

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args = Args::parse();
    match args.device.as_str() {
        "cpu" => run::<Autodiff<NdArray>>(&args, &Default::default()),
        #[cfg(feature = "cuda")]
        "cuda" => run::<Autodiff<burn_slidesparse::cuda::CudaBackend>>(&args, &Default::default()),
        other => Err(slidesparse_examples::unknown_device(other).into()),
    }
}

/// The pipeline on autodiff backend `B` (evaluation runs on its inner backend).
fn run<B>(args: &Args, device: &B::Device) -> Result<(), Error>
where
    B: AutodiffBackend + SlideSparseBackend,
    B::InnerBackend: SlideSparseBackend,
{
    let path = smollm2_gguf(args.gguf.as_deref())?;
    let bytes = std::fs::read(&path)?;
    let file = GgufFile::parse(&path.display().to_string(), &bytes)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let text_path = match &args.text {
        Some(p) => p.clone(),
        None => python_topics().ok_or("Python's pydoc_data/topics.py not found: pass --text")?,
    };
    let text = std::fs::read_to_string(&text_path)
        .map_err(|e| format!("{}: {e} (pass --text)", text_path.display()))?;
    let ids = tok.encode(&text)?;
    if ids.len() < args.eval_tokens + args.seq + 1 {
        return Err(format!(
            "{} has {} tokens: too few for {} held-out tokens plus one training sequence",
            text_path.display(),
            ids.len(),
            args.eval_tokens
        )
        .into());
    }
    let (eval_ids, train_ids) = ids.split_at(args.eval_tokens);
    println!(
        "{}: {} tokens held out for evaluation, {} for training",
        text_path.display(),
        eval_ids.len(),
        train_ids.len()
    );
    let ppl = |name: &str, model: &Llama<B::InnerBackend>| {
        let start = Instant::now();
        let (ppl, n) = perplexity(model, eval_ids, args.window, args.stride);
        println!(
            "{name:<34} ppl {ppl:>8.3}  ({n} tokens, {:.0} s)",
            start.elapsed().as_secs_f64()
        );
        ppl
    };
    let mut table = Vec::new();
    let mut model = load_llama::<B>(&file, args.window.max(args.seq), device)?;
    table.push((
        "dense (before pruning)".into(),
        ppl("dense", &model.valid()),
    ));

    if args.dense_control {
        let (model, report) = finetune(args, model, train_ids, device)?;
        let tuned = ppl("dense fine-tuned", &model.valid());
        println!("\ndense control, {report}\n| stage | ppl |\n|---|---|");
        println!("| dense (before fine-tuning) | {:.3} |", table[0].1);
        println!("| dense fine-tuned, f32 | {tuned:.3} |");
        return Ok(());
    }

    // Prune every block linear (not the LM head) and keep it trainable under the mask.
    let norms = if args.prune == "wanda" {
        let calib = tok.encode(&std::fs::read_to_string(&args.calibration)?)?;
        calibration_norms(&model.valid(), &calib, args.calibration_tokens)
    } else {
        HashMap::new()
    };
    let masked = mask_with(&mut model, args.pattern, |name| {
        (name != "lm_head").then(|| match norms.get(name) {
            Some(n) if args.prune == "wanda" => PruneMethod::ActivationAware {
                input_norms: n.clone(),
            },
            _ => PruneMethod::Magnitude,
        })
    })?;
    println!(
        "pruned {} layers to {} ({})",
        masked.len(),
        args.pattern,
        args.prune
    );
    table.push((
        "pruned, f32 (one-shot)".into(),
        ppl("pruned", &model.valid()),
    ));

    let (model, train_report) = finetune(args, model, train_ids, device)?;
    table.push((
        "fine-tuned, f32 (masked)".into(),
        ppl("fine-tuned", &model.valid()),
    ));

    let (checkpoint, packed) = save_and_pack(args, &model.valid())?;
    let reloaded = reload_packed(&file, args, &packed)?;
    table.push((
        format!("fine-tuned, packed {}", args.precision),
        ppl("packed + reloaded", &reloaded),
    ));

    println!(
        "\n{} {} ({}), {}; checkpoint {}, packed {}",
        args.pattern,
        args.prune,
        args.precision,
        train_report,
        checkpoint.display(),
        packed.display()
    );
    println!("| stage | ppl |\n|---|---|");
    for (stage, ppl) in table {
        println!("| {stage} | {ppl:.3} |");
    }
    Ok(())
}

/// The parameters the optimizer may change: the weights (and biases) of the block linears,
/// masked or, in the dense control run, dense. The embedding, norms and LM head stay as
/// loaded.
fn trainable_ids<B: Backend>(model: &mut Llama<B>) -> Vec<ParamId> {
    let mut ids = Vec::new();
    model
        .visit_linears(&mut |name, layer| {
            let linear = match layer {
                MaybeSparseLinear::Masked(m) => &m.linear,
                MaybeSparseLinear::Dense(d) if name != "lm_head" => d,
                _ => return Ok(()),
            };
            ids.push(linear.weight.id);
            if let Some(b) = &linear.bias {
                ids.push(b.id);
            }
            Ok(())
        })
        .expect("the visitor never fails");
    ids
}

/// Next-token cross entropy of `tokens [batch, t + 1]`.
fn loss<B: SlideSparseBackend>(model: &Llama<B>, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [batch, len] = tokens.dims();
    let t = len - 1;
    let input = tokens.clone().slice([0..batch, 0..t]);
    let target = tokens.slice([0..batch, 1..len]).reshape([batch * t, 1]);
    let logits = model.forward(input, &mut KvCache::default());
    let vocab = logits.dims()[2];
    let logp = log_softmax(logits.reshape([batch * t, vocab]), 1);
    logp.gather(1, target).mean().neg()
}

/// Adam on the masked weights over consecutive `[batch, seq + 1]` windows of `train_ids`.
fn finetune<B>(
    args: &Args,
    mut model: Llama<B>,
    train_ids: &[u32],
    device: &B::Device,
) -> Result<(Llama<B>, String), Error>
where
    B: AutodiffBackend + SlideSparseBackend,
{
    let ids = trainable_ids(&mut model);
    let mut optim = AdamConfig::new().init::<B, Llama<B>>();
    let per_step = args.batch * (args.seq + 1);
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("fine-tune {bar:30} {pos}/{len} {msg} [{elapsed}<{eta}]")
            .expect("valid template"),
    );
    let start = Instant::now();
    let (mut first_loss, mut last_loss) = (f32::NAN, f32::NAN);
    for step in 0..args.steps {
        // Wrap around the training text (an epoch is `train_ids.len() / per_step` steps).
        let offset = (step * per_step) % (train_ids.len() - per_step).max(1);
        let window: Vec<i64> = train_ids[offset..offset + per_step]
            .iter()
            .map(|&i| i as i64)
            .collect();
        let tokens = Tensor::<B, 2, Int>::from_data(
            TensorData::new(window, [args.batch, args.seq + 1]),
            device,
        );
        let loss = loss(&model, tokens);
        let value = loss.clone().into_scalar().elem::<f32>();
        if !value.is_finite() {
            return Err(format!("step {step}: loss is {value}; lower --lr").into());
        }
        let mut grads = loss.backward();
        let grads = GradientsParams::from_params(&mut grads, &model, &ids);
        model = optim.step(args.lr, model, grads);
        if step == 0 {
            first_loss = value;
        }
        last_loss = value;
        let tokens_per_s =
            ((step + 1) * args.batch * args.seq) as f64 / start.elapsed().as_secs_f64();
        bar.set_message(format!("loss {value:.3}, {tokens_per_s:.0} tok/s"));
        bar.inc(1);
    }
    bar.finish();
    let seconds = start.elapsed().as_secs_f64();
    Ok((
        model,
        format!(
            "{} steps x {} tokens = {} tokens, Adam lr {}, loss {first_loss:.3} -> {last_loss:.3}, {seconds:.0} s",
            args.steps,
            args.batch * args.seq,
            args.steps * args.batch * args.seq,
            args.lr
        ),
    ))
}

/// `topics.py` of the newest Python under `/usr/lib`.
fn python_topics() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("pydoc_data/topics.py"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

/// Writes the fine-tuned block linears (masked weights, `[out, in]`) as an f32 safetensors
/// checkpoint, then packs it with the same packer as `slidesparse pack` (pattern checked,
/// not re-pruned). Returns both paths.
fn save_and_pack<B: Backend>(args: &Args, model: &Llama<B>) -> Result<(PathBuf, PathBuf), Error> {
    std::fs::create_dir_all(&args.out)?;
    let checkpoint = args
        .out
        .join(format!("smollm2-{}-finetuned.safetensors", args.pattern).replace(':', "_"));
    let packed = args.out.join(
        format!(
            "smollm2-{}-{}.slidesparse.safetensors",
            args.pattern, args.precision
        )
        .replace(':', "_"),
    );
    let mut tensors = Vec::new();
    let mut model = model.clone();
    model.visit_linears(&mut |name, layer| {
        if let Some(m) = layer.masked() {
            m.check(args.pattern)?;
            let w = m.effective_weight().transpose();
            let shape = w.dims().to_vec();
            let values: Vec<f32> = w.into_data().convert::<f32>().into_vec().unwrap();
            tensors.push((
                format!("{name}.weight"),
                OwnedTensor {
                    dtype: safetensors::Dtype::F32,
                    shape,
                    data: f32_bytes(&values),
                },
            ));
        }
        Ok(())
    })?;
    write_atomically(&checkpoint, &serialize(&tensors, HashMap::new())?)?;
    let options = PackOptions {
        prune: PruneMethod::None,
        ..PackOptions::new(args.pattern, args.precision)
    };
    pack_checkpoint(&checkpoint, &packed, &LayerSelection::new(None)?, &options)?;
    Ok((checkpoint, packed))
}

/// A fresh model from the GGUF with every block linear replaced by its packed layer.
fn reload_packed<B: SlideSparseBackend>(
    file: &GgufFile,
    args: &Args,
    packed: &Path,
) -> Result<Llama<B>, Error> {
    let device = Default::default();
    let mut model = load_llama::<B>(file, args.window.max(args.seq), &device)?;
    let packed_file = PackedFile::load(packed)?;
    model.visit_linears(&mut |name, layer| {
        if let Some(p) = packed_file.layer(name) {
            *layer = MaybeSparseLinear::from(burn_slidesparse::SlideSparseLinear::from_packed(
                p, &device,
            ));
        }
        Ok(())
    })?;
    Ok(model)
}
