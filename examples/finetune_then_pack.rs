//! Fine-tune then pack: prune SmolLM2's block linears to a pattern, fine-tune them under the
//! mask (the pruned weights stay exactly zero), distilling from the dense model, save the
//! fine-tuned weights as a safetensors checkpoint, pack it to the portable SlideSparse
//! format, reload the packed layers as `SlideSparseLinear` and report perplexity at every
//! stage on held-out text and on texts the calibration and training never saw.
//!
//! `cargo run --release -p slidesparse-examples --example finetune_then_pack -- --pattern 6:8
//!   --steps 100 [--objective kl|lm|kl-lm] [--lr 1e-4] [--seq 128] [--batch 1] [--qat]
//!   [--permute] [--eval-text FILE]... [--out target/finetune]`
//!
//! Text: Python's `pydoc_data/topics.py` (or the `--text` files); the first `--eval-tokens`
//! tokens of the first one are held out for evaluation, training reads random windows of the
//! rest (disjoint). Runs on the CPU (NdArray) by default and, built with `--features cuda`, on
//! burn's CUDA backend with fusion (`--device cuda`) or without (`--device cuda-plain`).

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
        backend::{AutodiffBackend, Backend},
    },
};
use burn_slidesparse::{
    InputPermutation, LayerSelection, MaskedLinear, MaybeSparseLinear, PERMUTATION_SUFFIX,
    PackOptions, PackedFile, PermutationSearch, Precision, PruneMethod, SlideSparseBackend,
    SparsityPattern, VisitLinears, gguf::GgufFile, pack_checkpoint,
};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng, rngs::StdRng};
use slidesparse_examples::{
    eval::{calibration_norms, group_permutations, perplexity},
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    llama::{KvCache, Llama},
    safetensors_io::{F32Tensor, write_f32_safetensors},
    tokenizer::Tokenizer,
    train::{Objective, kl_loss, learning_rate, lm_loss},
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
    /// What training minimizes: `kl` (distillation from the dense model's logits), `lm`
    /// (next-token cross entropy) or `kl-lm` (their sum).
    #[arg(long, value_enum, default_value_t = Objective::Kl)]
    objective: Objective,
    /// Peak learning rate (Adam).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// `linear`: warm-up over `--warmup` steps, then linear decay to zero; `constant`.
    #[arg(long, default_value = "linear")]
    schedule: String,
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Seed of the random choice of training windows.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Training text, repeatable (default: Python's `pydoc_data/topics.py`). The first
    /// `--eval-tokens` tokens of the first one are held out for evaluation.
    #[arg(long)]
    text: Vec<PathBuf>,
    /// Held-out tokens at the start of the first `--text` (evaluation only).
    #[arg(long, default_value_t = 1024)]
    eval_tokens: usize,
    /// Further evaluation texts, never trained or calibrated on (repeatable).
    #[arg(long)]
    eval_text: Vec<PathBuf>,
    /// Tokens read from the start of each `--eval-text` (0: the whole text).
    #[arg(long, default_value_t = 0)]
    eval_max_tokens: usize,
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
    /// Prune every group of block linears that read one input (q/k/v, o, gate/up, down) in
    /// an input-channel order searched on the pruning score; the fine-tuned layers keep it,
    /// the checkpoint stores it next to each weight and the packed layers fold it into their
    /// lift.
    #[arg(long)]
    permute: bool,
    /// Quantization-aware fine-tuning: the masked layers' forward rounds weights and
    /// activations as the packed `--precision` layer does (int8 or fp8; gradients pass
    /// straight through), so the fine-tuned f32 stage already computes the packed function.
    #[arg(long)]
    qat: bool,
    /// Where the checkpoint and the packed file go.
    #[arg(long, default_value = "target/finetune")]
    out: PathBuf,
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// `cpu` or (with `--features cuda`) `cuda` (burn's CUDA backend, with fusion) or
    /// `cuda-plain` (without fusion).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Control run: fine-tune the dense block linears with the same data, objective and
    /// steps, no pruning and no packing (separates the gain from adapting to the text from
    /// the recovery of what pruning lost). With `--objective kl` the dense model is its own
    /// teacher and does not change, so the control is refused there.
    #[arg(long)]
    dense_control: bool,
}

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args = Args::parse();
    match args.device.as_str() {
        "cpu" => run::<Autodiff<NdArray>>(&args, &Default::default()),
        #[cfg(feature = "cuda")]
        "cuda" => {
            run::<Autodiff<burn_slidesparse::cuda::CudaFusionBackend>>(&args, &Default::default())
        }
        #[cfg(feature = "cuda")]
        "cuda-plain" => {
            run::<Autodiff<burn_slidesparse::cuda::CudaBackend>>(&args, &Default::default())
        }
        other => Err(format!(
            "{}{}",
            slidesparse_examples::unknown_device(other),
            if cfg!(feature = "cuda") {
                ", cuda-plain"
            } else {
                ""
            }
        )
        .into()),
    }
}

/// One evaluation text: its label for the table and its tokens.
struct EvalText {
    label: String,
    ids: Vec<u32>,
}

/// The pipeline on autodiff backend `B` (evaluation runs on its inner backend).
fn run<B>(args: &Args, device: &B::Device) -> Result<(), Error>
where
    B: AutodiffBackend + SlideSparseBackend,
    B::InnerBackend: SlideSparseBackend,
{
    check_args(args)?;
    let path = smollm2_gguf(args.gguf.as_deref())?;
    let bytes = std::fs::read(&path)?;
    let file = GgufFile::parse(&path.display().to_string(), &bytes)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let (evals, train_ids) = read_texts(args, &tok)?;
    let ppl = |name: &str, model: &Llama<B::InnerBackend>| -> Vec<f64> {
        evals
            .iter()
            .map(|text| {
                let start = Instant::now();
                let (ppl, n) = perplexity(model, &text.ids, args.window, args.stride);
                println!(
                    "{name:<28} {:<28} ppl {ppl:>8.3}  ({n} tokens, {:.0} s)",
                    text.label,
                    start.elapsed().as_secs_f64()
                );
                ppl
            })
            .collect()
    };
    let mut table: Vec<(String, Vec<f64>)> = Vec::new();
    let mut model = load_llama::<B>(&file, max_len(args), device)?;
    let teacher = args.objective.needs_teacher().then(|| model.valid());
    table.push((
        "dense (before pruning)".into(),
        ppl("dense", &model.valid()),
    ));

    if args.dense_control {
        let (model, report) = finetune(args, model, teacher.as_ref(), &train_ids, device)?;
        table.push((
            "dense fine-tuned, f32".into(),
            ppl("dense fine-tuned", &model.valid()),
        ));
        println!("\ndense control, {report}");
        print_table(&evals, &table);
        return Ok(());
    }

    // Prune every block linear (not the LM head) and keep it trainable under the mask.
    let norms = if args.prune == "wanda" {
        let calib = std::fs::read_to_string(&args.calibration)
            .map_err(|e| format!("--calibration {}: {e}", args.calibration.display()))?;
        let calib = tok.encode(&calib)?;
        calibration_norms(&model.valid(), &calib, args.calibration_tokens)
    } else {
        HashMap::new()
    };
    let method = |name: &str| match norms.get(name) {
        Some(n) if args.prune == "wanda" => PruneMethod::ActivationAware {
            input_norms: n.clone(),
        },
        _ => PruneMethod::Magnitude,
    };
    let orders = if args.permute {
        let bar = ProgressBar::new(4 * model.blocks.len() as u64);
        let (orders, summary) = group_permutations(
            &mut model,
            args.pattern,
            method,
            &PermutationSearch::default(),
            &bar,
        )?;
        bar.finish_and_clear();
        println!("{}: {summary}", args.pattern);
        orders
    } else {
        HashMap::new()
    };
    let masked = mask_in_orders(&mut model, args.pattern, &method, &orders)?;
    println!(
        "pruned {} layers to {} ({}{})",
        masked,
        args.pattern,
        args.prune,
        if args.permute { ", permuted" } else { "" }
    );
    table.push((
        "pruned, f32 (one-shot)".into(),
        ppl("pruned", &model.valid()),
    ));
    let (_, one_shot) = save_and_pack(args, &model.valid(), "one-shot")?;
    let reloaded = reload_packed(&file, args, &one_shot)?;
    table.push((
        format!("pruned, packed {} (one-shot)", args.precision),
        ppl("pruned + packed", &reloaded),
    ));
    drop(reloaded);

    if args.qat {
        simulate_quantization(&mut model, args.precision)?;
    }
    let (model, train_report) = finetune(args, model, teacher.as_ref(), &train_ids, device)?;
    drop(teacher);
    let stage = if args.qat {
        format!("fine-tuned, simulated {} (masked, QAT)", args.precision)
    } else {
        "fine-tuned, f32 (masked)".into()
    };
    table.push((stage, ppl("fine-tuned", &model.valid())));

    let (checkpoint, packed) = save_and_pack(args, &model.valid(), "finetuned")?;
    let reloaded = reload_packed(&file, args, &packed)?;
    table.push((
        format!("fine-tuned, packed {}", args.precision),
        ppl("fine-tuned + packed", &reloaded),
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
    print_table(&evals, &table);
    Ok(())
}

/// Refuses arguments that would panic later or measure something else than asked.
fn check_args(args: &Args) -> Result<(), Error> {
    let fail = |msg: String| -> Result<(), Error> { Err(msg.into()) };
    if args.dense_control && args.objective == Objective::Kl {
        return fail(
            "--dense-control with --objective kl: the dense model distilled from itself has \
             zero loss and does not change; its perplexity is the dense row"
                .into(),
        );
    }
    if args.dense_control && args.qat {
        return fail(
            "--qat simulates the packed layers' quantization: not for --dense-control".into(),
        );
    }
    if args.steps == 0 || args.batch == 0 || args.seq == 0 {
        return fail("--steps, --batch and --seq must be at least 1".into());
    }
    if args.stride == 0 || args.stride > args.window {
        return fail(format!(
            "need 0 < --stride <= --window, got {} and {}",
            args.stride, args.window
        ));
    }
    match args.schedule.as_str() {
        "linear" if args.warmup >= args.steps => {
            return fail(format!(
                "--warmup {} must be below --steps {} (the rate decays after it)",
                args.warmup, args.steps
            ));
        }
        "linear" => {}
        "constant" if args.warmup > 0 => {
            return fail("--warmup applies to --schedule linear only".into());
        }
        "constant" => {}
        other => return fail(format!("unknown --schedule {other}: linear or constant")),
    }
    if !matches!(args.prune.as_str(), "wanda" | "magnitude") {
        return fail(format!(
            "unknown --prune {}: wanda or magnitude",
            args.prune
        ));
    }
    // The held-out head of the first text must reach neither training nor calibration.
    let key = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let texts: Vec<PathBuf> = args.text.iter().map(|p| key(p)).collect();
    for (i, t) in texts.iter().enumerate() {
        if texts[..i].contains(t) {
            return fail(format!("--text {} is given twice", t.display()));
        }
        if args.eval_text.iter().any(|e| key(e) == *t) {
            return fail(format!(
                "{} is both a --text and an --eval-text",
                t.display()
            ));
        }
    }
    if args.prune == "wanda" && texts.first() == Some(&key(&args.calibration)) {
        return fail(
            "--calibration is the first --text, whose head is held out: pass another text".into(),
        );
    }
    Ok(())
}

/// Prunes every block linear (not the LM head) with `method(name)` in its order (the original
/// one where `orders` has none) and keeps it trainable under the mask. Returns the count.
fn mask_in_orders<B: Backend>(
    model: &mut Llama<B>,
    pattern: SparsityPattern,
    method: &impl Fn(&str) -> PruneMethod,
    orders: &HashMap<String, InputPermutation>,
) -> Result<usize, Error> {
    let mut count = 0;
    model.visit_linears(&mut |name, layer| {
        if let Some(dense) = layer.dense().filter(|_| name != "lm_head") {
            let order = orders.get(name).cloned();
            let masked =
                MaskedLinear::from_linear_permuted(dense.clone(), pattern, &method(name), order)?;
            *layer = masked.into();
            count += 1;
        }
        Ok(())
    })?;
    Ok(count)
}

/// Makes every masked layer's forward simulate `precision`'s rounding (quantization-aware
/// fine-tuning), so that training sees the function the packed file computes.
fn simulate_quantization<B: Backend>(
    model: &mut Llama<B>,
    precision: Precision,
) -> Result<(), Error> {
    model.visit_linears(&mut |_, layer| {
        if let MaybeSparseLinear::Masked(m) = layer {
            let simulated = m.clone().with_quantization(precision)?;
            *m = simulated;
        }
        Ok(())
    })?;
    Ok(())
}

/// The evaluation texts (the held-out head of the first `--text`, then every `--eval-text`)
/// and the training tokens (the rest of the first `--text` and every further one).
fn read_texts(args: &Args, tok: &Tokenizer) -> Result<(Vec<EvalText>, Vec<u32>), Error> {
    let texts = if args.text.is_empty() {
        vec![python_topics().ok_or("Python's pydoc_data/topics.py not found: pass --text")?]
    } else {
        args.text.clone()
    };
    let read = |path: &Path| -> Result<Vec<u32>, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(tok.encode(&text)?)
    };
    let name = |path: &Path| {
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into(),
        )
    };
    let first = read(&texts[0])?;
    if args.eval_tokens < 2 {
        return Err("--eval-tokens must be at least 2 (one scored token)".into());
    }
    if first.len() < args.eval_tokens + args.batch * (args.seq + 1) {
        return Err(format!(
            "{} has {} tokens: too few for {} held-out tokens plus one training step",
            texts[0].display(),
            first.len(),
            args.eval_tokens
        )
        .into());
    }
    let (held_out, mut train) = (
        first[..args.eval_tokens].to_vec(),
        first[args.eval_tokens..].to_vec(),
    );
    for path in &texts[1..] {
        train.extend(read(path)?);
    }
    let mut evals = vec![EvalText {
        label: format!("{}@0 (held out)", name(&texts[0])),
        ids: held_out,
    }];
    for path in &args.eval_text {
        let mut ids = read(path)?;
        if args.eval_max_tokens > 0 {
            ids.truncate(args.eval_max_tokens);
        }
        if ids.len() < 2 {
            return Err(format!(
                "--eval-text {}: {} tokens, need 2 or more",
                path.display(),
                ids.len()
            )
            .into());
        }
        evals.push(EvalText {
            label: format!("{} (unseen)", name(path)),
            ids,
        });
    }
    println!(
        "training: {} tokens of {}; evaluation: {}",
        train.len(),
        texts.iter().map(|p| name(p)).collect::<Vec<_>>().join(", "),
        evals
            .iter()
            .map(|e| format!("{} ({} tokens)", e.label, e.ids.len()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok((evals, train))
}

/// A markdown table: one row per stage, one column per evaluation text, each perplexity
/// with its change against the first row (the dense model).
fn print_table(evals: &[EvalText], table: &[(String, Vec<f64>)]) {
    let labels: Vec<&str> = evals.iter().map(|e| e.label.as_str()).collect();
    println!("| stage | {} |", labels.join(" | "));
    println!("|---|{}", "---|".repeat(labels.len()));
    let dense = &table[0].1;
    for (row, (stage, ppls)) in table.iter().enumerate() {
        let cells: Vec<String> = ppls
            .iter()
            .zip(dense)
            .map(|(p, d)| match row {
                0 => format!("{p:.3}"),
                _ => format!("{p:.3} ({:+.1}%)", (p / d - 1.0) * 100.0),
            })
            .collect();
        println!("| {stage} | {} |", cells.join(" | "));
    }
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

/// The loss of one step on `tokens [batch, t + 1]`: the student's logits at the first `t`
/// positions against the next tokens and/or the teacher's logits.
fn step_loss<B>(
    objective: Objective,
    model: &Llama<B>,
    teacher: Option<&Llama<B::InnerBackend>>,
    tokens: Tensor<B, 2, Int>,
) -> Tensor<B, 1>
where
    B: AutodiffBackend + SlideSparseBackend,
    B::InnerBackend: SlideSparseBackend,
{
    let [batch, len] = tokens.dims();
    let input = tokens.clone().slice([0..batch, 0..len - 1]);
    let logits = model.forward(input.clone(), &mut KvCache::default());
    let kl = || {
        let teacher = teacher.expect("a distillation objective has a teacher");
        let target = teacher.forward(input.clone().inner(), &mut KvCache::default());
        kl_loss(logits.clone(), Tensor::from_inner(target))
    };
    let lm = || lm_loss(logits.clone(), tokens.clone().slice([0..batch, 1..len]));
    match objective {
        Objective::Lm => lm(),
        Objective::Kl => kl(),
        Objective::KlLm => kl() + lm(),
    }
}

/// Adam on the masked weights over `[batch, seq + 1]` windows of `train_ids` at random
/// offsets (seeded by `--seed`).
fn finetune<B>(
    args: &Args,
    mut model: Llama<B>,
    teacher: Option<&Llama<B::InnerBackend>>,
    train_ids: &[u32],
    device: &B::Device,
) -> Result<(Llama<B>, String), Error>
where
    B: AutodiffBackend + SlideSparseBackend,
    B::InnerBackend: SlideSparseBackend,
{
    let ids = trainable_ids(&mut model);
    let mut optim = AdamConfig::new().init::<B, Llama<B>>();
    let window = args.seq + 1;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("fine-tune {bar:30} {pos}/{len} {msg} [{elapsed}<{eta}]")
            .expect("valid template"),
    );
    let start = Instant::now();
    let (mut first_loss, mut last_loss) = (f32::NAN, f32::NAN);
    for step in 0..args.steps {
        let mut batch = Vec::with_capacity(args.batch * window);
        for _ in 0..args.batch {
            let offset = rng.random_range(0..=train_ids.len() - window);
            batch.extend(train_ids[offset..offset + window].iter().map(|&i| i as i64));
        }
        let tokens =
            Tensor::<B, 2, Int>::from_data(TensorData::new(batch, [args.batch, window]), device);
        let loss = step_loss(args.objective, &model, teacher, tokens);
        let value = loss.clone().into_scalar().elem::<f32>();
        if !value.is_finite() {
            return Err(format!("step {step}: loss is {value}; lower --lr").into());
        }
        let mut grads = loss.backward();
        let grads = GradientsParams::from_params(&mut grads, &model, &ids);
        let lr = match args.schedule.as_str() {
            "constant" => args.lr,
            _ => learning_rate(args.lr, step, args.steps, args.warmup),
        };
        model = optim.step(lr, model, grads);
        if step == 0 {
            first_loss = value;
        }
        last_loss = value;
        let tokens_per_s =
            ((step + 1) * args.batch * args.seq) as f64 / start.elapsed().as_secs_f64();
        let message = format!("loss {value:.4}, lr {lr:.2e}, {tokens_per_s:.0} tok/s");
        // Without a terminal the bar draws nothing: log every twentieth of the run instead.
        if bar.is_hidden() && (step + 1) % (args.steps / 20).max(1) == 0 {
            eprintln!("fine-tune step {}/{}: {message}", step + 1, args.steps);
        }
        bar.set_message(message);
        bar.inc(1);
    }
    bar.finish();
    let seconds = start.elapsed().as_secs_f64();
    Ok((
        model,
        format!(
            "{} objective, {} steps x {} tokens = {} tokens, Adam lr {} ({}, warm-up {}), loss {first_loss:.4} -> {last_loss:.4}, {seconds:.0} s",
            args.objective
                .to_possible_value()
                .expect("every objective has a name")
                .get_name(),
            args.steps,
            args.batch * args.seq,
            args.steps * args.batch * args.seq,
            args.lr,
            args.schedule,
            args.warmup,
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

/// Writes the (pruned or fine-tuned: `stage` names the files) block linears (masked weights, `[out, in]`) as an f32 safetensors
/// checkpoint, then packs it with the same packer as `slidesparse pack` (pattern checked,
/// not re-pruned). Returns both paths.
fn save_and_pack<B: Backend>(
    args: &Args,
    model: &Llama<B>,
    stage: &str,
) -> Result<(PathBuf, PathBuf), Error> {
    std::fs::create_dir_all(&args.out)?;
    let checkpoint = args
        .out
        .join(format!("smollm2-{}-{stage}.safetensors", args.pattern).replace(':', "_"));
    let packed = args.out.join(
        format!(
            "smollm2-{}-{stage}-{}.slidesparse.safetensors",
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
            tensors.push(F32Tensor::new(format!("{name}.weight"), shape, values));
            // The order the mask holds in, where the packer looks for it.
            if let Some(order) = &m.input_permutation {
                tensors.push(F32Tensor::u32(
                    format!("{name}{PERMUTATION_SUFFIX}"),
                    vec![order.len()],
                    order.as_slice(),
                ));
            }
        }
        Ok(())
    })?;
    write_f32_safetensors(&checkpoint, &tensors)?;
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
    let mut model = load_llama::<B>(file, max_len(args), &device)?;
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

/// The longest sequence the model sees: an evaluation window, a training sequence or the
/// calibration tokens (its RoPE table is built for this length).
fn max_len(args: &Args) -> usize {
    args.window.max(args.seq).max(args.calibration_tokens)
}
