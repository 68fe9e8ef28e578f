//! Perplexity of SmolLM2 (dense and SlideSparse) over one or more text files, with sliding
//! windows and exact token counts (every token after the first is scored exactly once).
//!
//! `cargo run --release -p slidesparse-examples --example perplexity -- --text FILE[@START]
//!   [--text FILE2 ...] [--max-tokens N] [--window 512] [--stride 256] [--patterns 2:4,6:8]
//!   [--precisions f32,int8] [--prune magnitude,wanda,sparsegpt] [--calibration FILE[@START]
//!   ...] [--calibration-tokens 256] [--calibration-seq 512]`
//!
//! `FILE@START` skips the first `START` tokens of the file. Wanda and SparseGPT are calibrated
//! on `--calibration-tokens` tokens of each calibration text, cut into sequences of
//! `--calibration-seq`; the calibration tokens may come from an evaluation file only outside
//! its evaluated token range (checked).

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use burn::backend::NdArray;
use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SlideSparseBackend, SparseGptCalibration, SparsityPattern,
    gguf::GgufFile, sparsify_with,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use slidesparse_examples::{
    eval::{perplexity, sparsegpt_sequential, token_batch},
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    llama::Llama,
    tokenizer::Tokenizer,
};

type Error = Box<dyn std::error::Error>;

#[derive(Parser)]
struct Args {
    /// Evaluation text, `FILE` or `FILE@START` (skip the first START tokens); repeat the flag
    /// for several texts.
    #[arg(long, required = true)]
    text: Vec<String>,
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Tokens evaluated per text.
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
    /// `magnitude`, `wanda` (activation-aware) and/or `sparsegpt` (weight reconstruction,
    /// layer after layer); the last two are calibrated on `--calibration`.
    #[arg(long, default_value = "magnitude,wanda")]
    prune: String,
    /// Calibration text for `wanda` and `sparsegpt`, `FILE` or `FILE@START`; repeat the flag
    /// to calibrate on several texts (`--calibration-tokens` from each).
    #[arg(long, default_value = "/usr/share/common-licenses/Apache-2.0")]
    calibration: Vec<String>,
    /// Calibration tokens taken from each calibration text.
    #[arg(long, default_value_t = 256)]
    calibration_tokens: usize,
    /// Length of each calibration sequence (the calibration tokens form a batch of them).
    #[arg(long, default_value_t = 512)]
    calibration_seq: usize,
    /// SparseGPT: damping added to the Hessian's diagonal, relative to its mean.
    #[arg(long, default_value_t = SparseGptCalibration::DEFAULT_DAMPING)]
    damping: f64,
    /// SparseGPT: lazy-batch width in columns (rounded up to a multiple of the pattern's block).
    #[arg(long, default_value_t = SparseGptCalibration::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// `cpu` (NdArray, the reference path) or, with `--features cuda`, `cuda` (burn-cuda
    /// with fusion, f32 activations).
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// A token range of a text file.
struct Span {
    path: PathBuf,
    start: usize,
    ids: Vec<u32>,
}

impl Span {
    /// `FILE` or `FILE@START`, tokenized, `count` tokens from `START` (fewer at the end).
    fn load(spec: &str, count: usize, tok: &Tokenizer) -> Result<Self, Error> {
        let (path, start) = match spec.rsplit_once('@') {
            Some((p, s)) if s.parse::<usize>().is_ok() => (p, s.parse::<usize>()?),
            _ => (spec, 0),
        };
        let path = PathBuf::from(path);
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let ids = tok.encode(&text)?;
        if start >= ids.len() {
            return Err(format!("{spec}: the text has only {} tokens", ids.len()).into());
        }
        let ids = ids[start..(start + count).min(ids.len())].to_vec();
        Ok(Self { path, start, ids })
    }

    fn overlaps(&self, other: &Span) -> bool {
        same_file(&self.path, &other.path)
            && self.start < other.start + other.ids.len()
            && other.start < self.start + self.ids.len()
    }

    fn name(&self) -> String {
        let file = self.path.file_name().map_or_else(
            || self.path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        format!("{file}@{}", self.start)
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn main() -> Result<(), Error> {
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
    let texts = args
        .text
        .iter()
        .map(|spec| Span::load(spec, args.max_tokens, &tok))
        .collect::<Result<Vec<_>, _>>()?;
    for t in &texts {
        println!(
            "eval: {} tokens of {} from token {}, window {}, stride {}",
            t.ids.len(),
            t.path.display(),
            t.start,
            args.window,
            args.stride
        );
    }
    let methods: Vec<&str> = args.prune.split(',').map(str::trim).collect();
    if let Some(m) = methods
        .iter()
        .find(|m| !["magnitude", "wanda", "sparsegpt"].contains(m))
    {
        return Err(format!("unknown --prune {m}: magnitude, wanda or sparsegpt").into());
    }
    match args.device.as_str() {
        "cpu" => evaluate::<NdArray>(&args, &file, &tok, &texts, &methods),
        #[cfg(feature = "cuda")]
        "cuda" => evaluate::<burn_slidesparse::cuda::CudaFusionBackend>(
            &args, &file, &tok, &texts, &methods,
        ),
        other => Err(slidesparse_examples::unknown_device(other).into()),
    }
}

/// The dense model and every (method, pattern, precision) on `texts`, on backend `B`.
fn evaluate<B: SlideSparseBackend>(
    args: &Args,
    file: &GgufFile,
    tok: &Tokenizer,
    texts: &[Span],
    methods: &[&str],
) -> Result<(), Error> {
    let dense = load_llama::<B>(file, args.window.max(2048), &Default::default())?;
    let device = dense.embed.weight.device();
    let calibrated = methods.iter().any(|m| *m != "magnitude");
    let calib = if calibrated {
        let mut ids = Vec::new();
        for spec in &args.calibration {
            let calib = Span::load(spec, args.calibration_tokens, tok)?;
            if let Some(t) = texts.iter().find(|t| t.overlaps(&calib)) {
                return Err(format!(
                    "the calibration tokens {} overlap the evaluated tokens {}",
                    calib.name(),
                    t.name()
                )
                .into());
            }
            // Whole sequences of each text (one shorter sequence if the only one).
            let seq = args.calibration_seq.min(calib.ids.len());
            if args.calibration.len() > 1 && seq < args.calibration_seq {
                return Err(format!(
                    "calibration text {} has {} tokens, fewer than --calibration-seq {}",
                    calib.name(),
                    calib.ids.len(),
                    args.calibration_seq
                )
                .into());
            }
            let used = calib.ids.len() / seq * seq;
            println!(
                "calibration: {used} tokens of {} from token {}",
                calib.path.display(),
                calib.start
            );
            ids.extend_from_slice(&calib.ids[..used]);
        }
        let batch = token_batch::<B>(&ids, args.calibration_seq, &device);
        let [n, seq] = batch.dims();
        println!("calibration batch: {n} x {seq} tokens");
        Some(batch)
    } else {
        None
    };

    let mut rows: Vec<(String, Vec<f64>)> = Vec::new();
    let mut report = |name: String, model: &Llama<B>| {
        let mut ppls = Vec::new();
        for t in texts {
            let start = Instant::now();
            let (ppl, n) = perplexity(model, &t.ids, args.window, args.stride);
            println!(
                "{name:<24} {:<20} ppl {ppl:>9.3}  ({n} tokens, {:.0} s)",
                t.name(),
                start.elapsed().as_secs_f64()
            );
            ppls.push(ppl);
        }
        rows.push((name, ppls));
    };
    report("dense f32".into(), &dense);
    let norms = match &calib {
        Some(batch) if methods.contains(&"wanda") => dense.input_norms(batch.clone()),
        _ => Default::default(),
    };
    for &method in methods {
        for pattern in args.patterns.split(',') {
            for precision in args.precisions.split(',') {
                let (pattern, precision): (SparsityPattern, Precision) =
                    (pattern.trim().parse()?, precision.trim().parse()?);
                let options = |prune| PackOptions {
                    pattern,
                    precision,
                    prune,
                    alignment: 64,
                    permutation: Default::default(),
                };
                let mut model = dense.clone();
                let start = Instant::now();
                match method {
                    "sparsegpt" => {
                        let tokens = calib.clone().expect("calibrated");
                        let bar = ProgressBar::new(4 * model.blocks.len() as u64);
                        bar.set_style(
                            ProgressStyle::with_template(
                                "sparsegpt {bar:30} {pos}/{len} {msg} [{elapsed}<{eta}]",
                            )
                            .expect("valid template"),
                        );
                        sparsegpt_sequential(
                            &mut model,
                            tokens,
                            |_, calibration| {
                                options(PruneMethod::SparseGpt(SparseGptCalibration {
                                    damping: args.damping,
                                    block_size: args.block_size,
                                    ..calibration
                                }))
                            },
                            &bar,
                        )?;
                        bar.finish_and_clear();
                    }
                    _ => {
                        sparsify_with(&mut model, |name| {
                            let prune = match method {
                                "wanda" => PruneMethod::ActivationAware {
                                    input_norms: norms.get(name)?.clone(),
                                },
                                _ => PruneMethod::Magnitude,
                            };
                            (name != "lm_head").then(|| options(prune))
                        })?;
                    }
                }
                println!(
                    "{pattern} {precision} {method}: pruned and packed in {:.0} s",
                    start.elapsed().as_secs_f64()
                );
                report(format!("{pattern} {precision} {method}"), &model);
            }
        }
    }

    println!(
        "\n| model | {} |\n|---|{}",
        texts.iter().map(Span::name).collect::<Vec<_>>().join(" | "),
        "---|".repeat(texts.len())
    );
    for (name, ppls) in &rows {
        let cells: Vec<String> = ppls.iter().map(|p| format!("{p:.3}")).collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    Ok(())
}
