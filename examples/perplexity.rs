//! Perplexity of SmolLM2 (dense and SlideSparse) over one or more text files, with sliding
//! windows and exact token counts (every token after the first is scored exactly once).
//!
//! `cargo run --release -p slidesparse-examples --example perplexity -- --text FILE[@START]
//!   [--text FILE2 ...] [--max-tokens N] [--window 512] [--stride 256] [--patterns 2:4,6:8]
//!   [--precisions f32,int8] [--prune magnitude,wanda,sparsegpt] [--calibration FILE[@START]
//!   ...] [--calibration-tokens 256] [--calibration-seq 512] [--permutations none,search]`
//!
//! `FILE@START` skips the first `START` tokens of the file. Wanda and SparseGPT are calibrated
//! on `--calibration-tokens` tokens of each calibration text, cut into sequences of
//! `--calibration-seq`; the calibration tokens may come from an evaluation file only outside
//! its evaluated token range (checked). `--permutations search` prunes every group of linears
//! that share an input (q/k/v, o, gate/up, down of each block) in an input-channel order
//! searched on the pruning criterion, folded into the packed layers' lift.

use std::{path::PathBuf, time::Instant};

use burn::backend::NdArray;
use std::collections::HashMap;

use burn_slidesparse::{
    ChannelPermutation, InputPermutation, KeptWeightGrid, PackOptions, PermutationSearch,
    Precision, PruneMethod, SlideSparseBackend, SparseGptCalibration, SparsityPattern,
    gguf::GgufFile, quantize_dense, sparsify_with,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use slidesparse_examples::{
    eval::{
        PermutationSummary, SequentialPermutation, group_permutations, perplexity,
        sparsegpt_sequential, token_batch,
    },
    fetch::smollm2_gguf,
    gguf_llama::load_llama,
    llama::Llama,
    text_span::{TextSpan, calibration_ids},
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
    /// SparseGPT: `packed` rounds each kept weight to the INT8 / FP8 grid it is packed to during
    /// the sweep and compensates the rounding like a dropped weight (joint sparsification and
    /// quantization); `exact` leaves the kept weights real and lets the packer quantize them.
    #[arg(long, default_value = "exact")]
    sparsegpt_grid: String,
    /// `cpu` (NdArray, the reference path) or, with `--features cuda`, `cuda` (burn-cuda
    /// with fusion, f32 activations).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Input-channel orders to evaluate: `none` (the original order) and/or `search` (one
    /// order per group of linears sharing an input, searched on the pruning criterion).
    #[arg(long, default_value = "none")]
    permutations: String,
    /// Permutation search: at most this many rounds of block-pair channel swaps.
    #[arg(long, default_value_t = PermutationSearch::DEFAULT_ROUNDS)]
    permute_rounds: usize,
    /// Permutation search: seed of the random pairing of blocks.
    #[arg(long, default_value_t = 0)]
    permute_seed: u64,
    /// What SparseGPT's permutation search scores: `obs` (its saliency `w^2 / [H^-1]_kk`) or
    /// `wanda` (`|w| * ||X[:, k]||` on the same calibration inputs).
    #[arg(long, default_value = "obs")]
    sparsegpt_permutation_score: String,
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
        .map(|spec| TextSpan::load(spec, args.max_tokens, &tok))
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
    if !["obs", "wanda"].contains(&args.sparsegpt_permutation_score.as_str()) {
        return Err(format!(
            "unknown --sparsegpt-permutation-score {}: obs or wanda",
            args.sparsegpt_permutation_score
        )
        .into());
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
    texts: &[TextSpan],
    methods: &[&str],
) -> Result<(), Error> {
    let dense = load_llama::<B>(file, args.window.max(2048), &Default::default())?;
    let device = dense.embed.weight.device();
    let calibrated = methods.iter().any(|m| *m != "magnitude");
    let calib = if calibrated {
        let ids = calibration_ids(
            &args.calibration,
            args.calibration_tokens,
            args.calibration_seq,
            texts,
            tok,
        )?;
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
    // The dense model quantized alone: what the precision costs before any pruning.
    for precision in args.precisions.split(',') {
        let precision: Precision = precision.trim().parse()?;
        if matches!(precision, Precision::Int8 | Precision::Fp8) {
            let mut model = dense.clone();
            quantize_dense(&mut model, precision, |name| name != "lm_head")?;
            report(format!("dense {precision}"), &model);
        }
    }
    let norms = match &calib {
        Some(batch) if methods.contains(&"wanda") => dense.input_norms(batch.clone()),
        _ => Default::default(),
    };
    let permutations: Vec<bool> = args
        .permutations
        .split(',')
        .map(|p| match p.trim() {
            "none" => Ok(false),
            "search" => Ok(true),
            other => Err(format!("unknown --permutations {other}: none or search")),
        })
        .collect::<Result<_, _>>()?;
    for &method in methods {
        for pattern in args.patterns.split(',') {
            let pattern: SparsityPattern = pattern.trim().parse()?;
            // Magnitude and Wanda orders depend on the dense weights only: searched once.
            let orders = match (method, permutations.contains(&true)) {
                ("magnitude" | "wanda", true) => {
                    Some(search_orders(args, &dense, pattern, |name| {
                        row_method(method, &norms, name)
                    })?)
                }
                _ => None,
            };
            for precision in args.precisions.split(',') {
                let precision: Precision = precision.trim().parse()?;
                for &permute in &permutations {
                    let job = PruneJob {
                        method,
                        pattern,
                        precision,
                        permute,
                    };
                    let start = Instant::now();
                    let model = prune_model(args, &dense, &job, &calib, &norms, orders.as_ref())?;
                    println!(
                        "{}: pruned and packed in {:.0} s",
                        job.name(),
                        start.elapsed().as_secs_f64()
                    );
                    report(job.name(), &model);
                }
            }
        }
    }

    println!(
        "\n| model | {} |\n|---|{}",
        texts
            .iter()
            .map(TextSpan::name)
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(texts.len())
    );
    for (name, ppls) in &rows {
        let cells: Vec<String> = ppls.iter().map(|p| format!("{p:.3}")).collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    Ok(())
}

/// One pruned model of the sweep.
struct PruneJob<'a> {
    method: &'a str,
    pattern: SparsityPattern,
    precision: Precision,
    permute: bool,
}

impl PruneJob<'_> {
    fn name(&self) -> String {
        let perm = if self.permute { " +perm" } else { "" };
        format!("{} {} {}{perm}", self.pattern, self.precision, self.method)
    }

    fn options(&self, prune: PruneMethod, permutation: ChannelPermutation) -> PackOptions {
        PackOptions {
            pattern: self.pattern,
            precision: self.precision,
            prune,
            alignment: 64,
            permutation,
        }
    }
}

/// The prune method of a row-local method (`magnitude`, `wanda`) for layer `name`.
fn row_method(method: &str, norms: &HashMap<String, Vec<f32>>, name: &str) -> PruneMethod {
    match (method, norms.get(name)) {
        ("wanda", Some(n)) => PruneMethod::ActivationAware {
            input_norms: n.clone(),
        },
        _ => PruneMethod::Magnitude,
    }
}

fn bar(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{pos}}/{{len}} {{msg}} [{{elapsed}}<{{eta}}]"
        ))
        .expect("valid template"),
    );
    bar
}

fn search_settings(args: &Args) -> PermutationSearch {
    PermutationSearch {
        rounds: args.permute_rounds,
        seed: args.permute_seed,
        ..Default::default()
    }
}

/// One order per group of block linears sharing an input, on the dense model.
fn search_orders<B: SlideSparseBackend>(
    args: &Args,
    dense: &Llama<B>,
    pattern: SparsityPattern,
    method: impl Fn(&str) -> PruneMethod,
) -> Result<HashMap<String, InputPermutation>, Error> {
    let mut model = dense.clone();
    let bar = bar(4 * model.blocks.len(), "permutations");
    let (orders, summary) =
        group_permutations(&mut model, pattern, method, &search_settings(args), &bar)?;
    bar.finish_and_clear();
    println!("{pattern}: {summary}");
    Ok(orders)
}

/// The dense model pruned and packed as `job` says (magnitude and Wanda with the
/// precomputed `orders` when permuted; SparseGPT searches its orders group by group).
fn prune_model<B: SlideSparseBackend>(
    args: &Args,
    dense: &Llama<B>,
    job: &PruneJob<'_>,
    calib: &Option<burn::tensor::Tensor<B, 2, burn::tensor::Int>>,
    norms: &HashMap<String, Vec<f32>>,
    orders: Option<&HashMap<String, InputPermutation>>,
) -> Result<Llama<B>, Error> {
    let mut model = dense.clone();
    if job.method == "sparsegpt" {
        let tokens = calib.clone().expect("calibrated");
        let bar = bar(4 * model.blocks.len(), "sparsegpt");
        let search = search_settings(args);
        let mut summary = PermutationSummary::default();
        let permute = job.permute.then(|| SequentialPermutation {
            search: &search,
            wanda_score: args.sparsegpt_permutation_score == "wanda",
            summary: &mut summary,
        });
        let grid = match (args.sparsegpt_grid.as_str(), job.precision) {
            ("exact", _) => KeptWeightGrid::Exact,
            ("packed", Precision::Int8) => KeptWeightGrid::Int8,
            ("packed", Precision::Fp8) => KeptWeightGrid::Fp8,
            ("packed", _) => KeptWeightGrid::Exact,
            (other, _) => {
                return Err(format!("--sparsegpt-grid {other:?}: expected exact or packed").into());
            }
        };
        let options = |_: &str, calibration| {
            job.options(
                PruneMethod::SparseGpt(SparseGptCalibration {
                    damping: args.damping,
                    block_size: args.block_size,
                    grid,
                    ..calibration
                }),
                ChannelPermutation::Identity,
            )
        };
        sparsegpt_sequential(&mut model, tokens, options, permute, &bar)?;
        bar.finish_and_clear();
        if job.permute {
            println!("{}: {summary}", job.name());
        }
        return Ok(model);
    }
    sparsify_with(&mut model, |name| {
        let permutation = match orders.filter(|_| job.permute) {
            Some(o) => ChannelPermutation::Given(o.get(name)?.clone()),
            None => ChannelPermutation::Identity,
        };
        (name != "lm_head").then(|| job.options(row_method(job.method, norms, name), permutation))
    })?;
    Ok(model)
}
