//! `slidesparse`: pack, verify and inspect SlideSparse checkpoints (feature `cli`).

mod demo;

use std::{path::PathBuf, process::ExitCode};

use burn_slidesparse::{
    ChannelPermutation, DEFAULT_ALIGNMENT, LayerSelection, PackOptions, PackProgress, PackReport,
    PackedFile, PermutationSearch, Precision, PruneMethod, Result, SlideSparseError,
    SparsityPattern,
    internals::{format::VERSION_KEY, write_atomically, write_random_checkpoint},
    pack_checkpoint, pack_checkpoint_with_progress, verify_checkpoint,
};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "slidesparse",
    version,
    about = "Pack LLM checkpoints to SlideSparse (2N-2):2N form"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prune, quantize and slide every selected linear weight of a safetensors checkpoint.
    Pack {
        /// Pattern nonzeros:block, (2N-2):2N: 2:4, 4:6, 6:8, 8:10, ...
        #[arg(long, default_value = "6:8")]
        pattern: SparsityPattern,
        /// int8, fp8, bf16, f16 or f32.
        #[arg(long, default_value = "int8")]
        precision: Precision,
        /// magnitude, or none (the weights must already satisfy the pattern). Wanda and
        /// SparseGPT need calibration activations from a forward pass of the model, which
        /// this command does not run: use the library (`PruneMethod::ActivationAware`,
        /// `PruneMethod::SparseGpt`) or the perplexity example's pipeline.
        #[arg(long, default_value = "magnitude")]
        prune: PruneMethod,
        /// Regular expression selecting the tensors to pack (default: every `*.weight`
        /// matrix except embeddings, norms and the LM head).
        #[arg(long)]
        layers: Option<String>,
        /// K' alignment (power of two; >= 32 for 8-bit, >= 16 for 16-bit precisions).
        #[arg(long, default_value_t = DEFAULT_ALIGNMENT)]
        alignment: usize,
        /// Permute every layer's input channels before pruning, in an order searched on the
        /// pruning score (one order per group of layers reading the same input: q/k/v and
        /// gate/up of a block share one, so that they can be fused). Stored in the packed
        /// file; the packed layers compute the pruned weights' function in the original
        /// order. Layers whose checkpoint stores `P.slidesparse.input_permutation` use it.
        #[arg(long)]
        permute: bool,
        /// Permutation search: at most this many rounds of block-pair channel swaps.
        #[arg(long, default_value_t = PermutationSearch::DEFAULT_ROUNDS)]
        permute_rounds: usize,
        /// Permutation search: seed of the random pairing of blocks.
        #[arg(long, default_value_t = 0)]
        permute_seed: u64,
        /// Write a JSON report here.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Hide the progress bar.
        #[arg(long)]
        quiet: bool,
        input: PathBuf,
        output: PathBuf,
    },
    /// Check a packed file (exit code 0 only if every layer is valid).
    Verify {
        packed: PathBuf,
        /// Also check every layer against the original dense checkpoint.
        #[arg(long)]
        against: Option<PathBuf>,
    },
    /// Print the layers of a packed file (or the tensors of any safetensors file).
    Inspect { file: PathBuf },
    /// Write a random HF-style Llama checkpoint (for demos and speed measurements).
    Generate {
        output: PathBuf,
        #[arg(long, default_value_t = 1024)]
        hidden: usize,
        #[arg(long, default_value_t = 2816)]
        intermediate: usize,
        #[arg(long, default_value_t = 4)]
        layers: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Generate a checkpoint, pack it, verify it and compare a layer with dense: the
    /// quickstart in one command.
    Demo {
        /// Working directory (default: a new temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        #[arg(long, default_value = "6:8")]
        pattern: SparsityPattern,
        #[arg(long, default_value = "int8")]
        precision: Precision,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Pack {
            pattern,
            precision,
            prune,
            layers,
            alignment,
            permute,
            permute_rounds,
            permute_seed,
            report,
            quiet,
            input,
            output,
        } => {
            let permutation = if permute {
                ChannelPermutation::Search(PermutationSearch {
                    rounds: permute_rounds,
                    seed: permute_seed,
                    ..Default::default()
                })
            } else {
                ChannelPermutation::Identity
            };
            let options = PackOptions {
                pattern,
                precision,
                prune,
                alignment,
                permutation,
            };
            let selection = LayerSelection::new(layers.as_deref())?;
            let result = pack_with_bar(&input, &output, &selection, &options, !quiet)?;
            print_pack_summary(&result);
            if let Some(path) = report {
                let json = serde_json::to_vec_pretty(&result).expect("report serializes");
                write_atomically(&path, &json)?;
            }
            Ok(())
        }
        Command::Verify { packed, against } => {
            let report = verify_checkpoint(&packed, against.as_deref())?;
            println!(
                "ok: {} packed layers valid 2:4, {} checked against the original",
                report.layers, report.checked_against_original
            );
            Ok(())
        }
        Command::Inspect { file } => inspect(&file),
        Command::Generate {
            output,
            hidden,
            intermediate,
            layers,
            seed,
        } => {
            let bytes = write_random_checkpoint(
                &output,
                hidden,
                intermediate,
                layers,
                safetensors::Dtype::F32,
                seed,
            )?;
            println!("wrote {} ({:.1} MB)", output.display(), bytes as f64 / 1e6);
            Ok(())
        }
        Command::Demo {
            dir,
            pattern,
            precision,
        } => demo(dir, pattern, precision),
    }
}

fn print_pack_summary(report: &PackReport) {
    println!(
        "{:<48} {:>14} {:>7} {:>8} {:>9} {:>9}",
        "layer", "shape", "K'", "kept %", "prune err", "total err"
    );
    for l in &report.layers {
        println!(
            "{:<48} {:>14} {:>7} {:>7.1}% {:>9.4} {:>9.4}",
            l.name,
            format!("{}x{}", l.shape[0], l.shape[1]),
            l.k_prime,
            100.0 * l.nonzeros_kept as f64 / (l.shape[0] * l.shape[1]).max(1) as f64,
            l.pruning_error,
            l.total_error
        );
    }
    println!(
        "packed {} layers, copied {} tensors: {:.1} MB -> {:.1} MB in {:.2} s ({:.0} MB/s)",
        report.layers.len(),
        report.copied_tensors,
        report.input_bytes as f64 / 1e6,
        report.output_bytes as f64 / 1e6,
        report.seconds,
        report.megabytes_per_second
    );
}

fn inspect(file: &std::path::Path) -> Result<()> {
    let bytes = std::fs::read(file).map_err(|e| SlideSparseError::io(file, e))?;
    let path = file.display().to_string();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|source| {
        SlideSparseError::SafeTensors {
            path: path.clone(),
            source,
        }
    })?;
    if let Some(version) = header.metadata().as_ref().and_then(|m| m.get(VERSION_KEY)) {
        let packed = PackedFile::from_bytes(&path, &bytes)?;
        println!("SlideSparse packed file, format version {version}");
        println!(
            "{:<48} {:>6} {:>6} {:>12} {:>7} {:>5} {:>7}",
            "layer", "pattern", "prec", "out x K", "K'", "bias", "permute"
        );
        for l in &packed.layers {
            println!(
                "{:<48} {:>6} {:>6} {:>12} {:>7} {:>5} {:>7}",
                l.name,
                l.pattern.to_string(),
                l.precision().to_string(),
                format!("{}x{}", l.out_features(), l.in_features),
                l.k_prime(),
                l.bias.is_some(),
                l.input_permutation.is_some()
            );
        }
    } else {
        println!("plain safetensors file (not packed)");
    }
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|source| SlideSparseError::SafeTensors { path, source })?;
    let mut names = st.names();
    names.sort();
    println!("{} tensors:", names.len());
    for name in names {
        let t = st.tensor(name).expect("listed");
        println!("  {name}: {:?} {:?}", t.dtype(), t.shape());
    }
    Ok(())
}

/// Packs with a progress bar on stderr (hidden with `visible == false`).
fn pack_with_bar(
    input: &std::path::Path,
    output: &std::path::Path,
    selection: &LayerSelection,
    options: &PackOptions,
    visible: bool,
) -> Result<PackReport> {
    if !visible {
        return pack_checkpoint(input, output, selection, options);
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} {msg}")
            .expect("valid template"),
    );
    let result =
        pack_checkpoint_with_progress(input, output, selection, options, |p: PackProgress<'_>| {
            bar.set_length(p.total_bytes);
            bar.set_position(p.done_bytes);
            bar.set_message(p.layer.to_string());
        });
    bar.finish_and_clear();
    result
}

fn demo(dir: Option<PathBuf>, pattern: SparsityPattern, precision: Precision) -> Result<()> {
    match dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir).map_err(|e| SlideSparseError::io(&dir, e))?;
            demo_in(&dir, pattern, precision)
        }
        None => {
            // A fresh directory under the system's temporary directory, removed afterwards
            // (the process id keeps concurrent runs apart).
            let dir = std::env::temp_dir().join(format!("slidesparse-demo-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| SlideSparseError::io(&dir, e))?;
            let result = demo_in(&dir, pattern, precision);
            // Best effort: a leftover temporary directory is not worth failing the demo over.
            let _ = std::fs::remove_dir_all(&dir);
            result
        }
    }
}

fn demo_in(dir: &std::path::Path, pattern: SparsityPattern, precision: Precision) -> Result<()> {
    let dense = dir.join("dense.safetensors");
    let packed = dir.join("packed.safetensors");
    println!(
        "1. generating a random 2-layer Llama-style checkpoint: {}",
        dense.display()
    );
    write_random_checkpoint(&dense, 512, 1536, 2, safetensors::Dtype::F32, 7)?;
    println!("2. packing it at {pattern} {precision}");
    let options = PackOptions::new(pattern, precision);
    let report = pack_with_bar(&dense, &packed, &LayerSelection::new(None)?, &options, true)?;
    print_pack_summary(&report);
    println!("3. verifying against the original");
    let v = verify_checkpoint(&packed, Some(&dense))?;
    println!(
        "   ok: {} layers valid 2:4, un-slide exactly to the pruned quantized weights",
        v.layers
    );
    println!("4. running one layer as SlideSparseLinear (CPU reference backend) against dense");
    demo::compare_layer_with_dense(&packed, &dense, "model.layers.0.mlp.down_proj.weight")
}
