//! End-to-end throughput of the example Llama model on burn-cuda (feature `cuda`), with
//! random weights at a real model's shapes and a few blocks, for each kind of linear layer:
//! burn's bf16 `nn::Linear`, the dense quantized baseline (`QuantizedLinear`, same pipeline
//! as SlideSparse without the slide), and SlideSparse at each pattern. The LM head and
//! embeddings stay bf16 in every variant; activations are bf16.
//!
//! Prefill: one sequence of T tokens, median of `--reps` forwards (fresh KV cache each).
//! Decode: batch B after a context of max(1024 / B, 64) tokens, `--steps` single-token steps back to back with
//! one device sync, median of `--reps`. A model with zero blocks (embedding + head only) is
//! timed too, so the per-block cost and a projection to the full depth can be read off.
//!
//! ```text
//! cargo run --release -p slidesparse-examples --features cuda --example model_throughput -- \
//!     --model llama3-8b --layers 2
//! ```

use std::{collections::BTreeMap, time::Instant};

use burn::{
    module::{Module, ModuleVisitor, Param},
    tensor::{Distribution, Int, Tensor, backend::Backend},
};
use burn_slidesparse::{
    DEFAULT_ALIGNMENT, PackOptions, PackedLinear, Precision, QuantizedLinear, QuantizedWeight,
    SlideSparseLinear, SparsityPattern, VisitLinears, WeightCodes,
    cuda::{
        CudaBackend,
        memory::{MemoryReport, memory_report, release_free_memory},
    },
    prepare_all, quantize_dense, sparsify,
};
use clap::Parser;
use half::bf16;
use slidesparse_examples::llama::{KvCache, Llama, LlamaConfig};

type Gpu = CudaBackend<bf16>;

#[derive(Parser)]
struct Args {
    /// `llama3-8b` or `qwen2.5-7b`.
    #[arg(long, default_value = "llama3-8b")]
    model: String,
    /// Decoder blocks to build (the full models have 32 and 28).
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value = "1024,4096")]
    prefill: String,
    #[arg(long, default_value = "1,16,64")]
    decode_batch: String,
    /// Decode steps per timed run.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Variants: `bf16`, `dense-int8`, `dense-fp8`, or `PATTERN-PRECISION` (e.g. `6:8-int8`).
    #[arg(
        long,
        default_value = "bf16,dense-int8,2:4-int8,4:6-int8,6:8-int8,8:10-int8,dense-fp8,6:8-fp8"
    )]
    variants: String,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// `pack`: convert a random bf16 model's linears with the packer (prune, quantize, slide;
    /// every variant from the same bf16 model, which stays on the GPU). `random`: each variant
    /// is built on its own with random codes that satisfy the pattern (no packer: fast at
    /// full depth), and its GPU memory after preparation is reported.
    #[arg(long, default_value = "pack")]
    weights: String,
}

/// The shapes of a named model with `layers` blocks.
fn config(name: &str, layers: usize) -> Result<LlamaConfig, String> {
    let (vocab, hidden, intermediate, heads, kv_heads, tie, bias) = match name {
        "llama3-8b" => (128_256, 4096, 14_336, 32, 8, false, false),
        "qwen2.5-7b" => (152_064, 3584, 18_944, 28, 4, false, true),
        other => return Err(format!("unknown model {other}: llama3-8b or qwen2.5-7b")),
    };
    Ok(
        LlamaConfig::new(vocab, hidden, intermediate, layers, heads, kv_heads)
            .with_tie_embeddings(tie)
            .with_qkv_bias(bias)
            .with_max_seq_len(8192)
            .with_rope_base(500_000.0),
    )
}

/// Converts the block linears of `model` (never the LM head) to `variant`.
fn convert(model: &mut Llama<Gpu>, variant: &str) -> Result<(), Box<dyn std::error::Error>> {
    let blocks_only = |name: &str| name != "lm_head";
    match variant {
        "bf16" => {}
        "dense-int8" => drop(quantize_dense(model, Precision::Int8, blocks_only)?),
        "dense-fp8" => drop(quantize_dense(model, Precision::Fp8, blocks_only)?),
        sparse => {
            let (pattern, precision) = sparse
                .split_once('-')
                .ok_or_else(|| format!("variant {sparse}: expected PATTERN-PRECISION"))?;
            let options = PackOptions::new(pattern.parse::<SparsityPattern>()?, precision.parse()?);
            sparsify(model, &options, blocks_only)?;
        }
    }
    Ok(())
}

/// A cheap deterministic generator (xorshift64*) for random codes.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// `rows x cols` random codes of `precision`, filled on every core; with `two_of_four`, only
/// the first two of every four columns are nonzero (a valid 2:4 slid weight).
fn random_codes(precision: Precision, rows: usize, cols: usize, two_of_four: bool) -> WeightCodes {
    let mut bytes = vec![0u8; rows * cols];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows_per = rows.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (t, chunk) in bytes.chunks_mut(rows_per * cols).enumerate() {
            scope.spawn(move || {
                let mut noise = Noise(0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1));
                for (j, b) in chunk.iter_mut().enumerate() {
                    if two_of_four && (j % cols) % 4 >= 2 {
                        continue;
                    }
                    let r = noise.next() >> 32;
                    *b = match precision {
                        // INT8 in [-127, 127].
                        Precision::Int8 => ((r % 255) as i32 - 127) as i8 as u8,
                        // E4M3 with exponent field <= 14: always finite.
                        _ => (r as u8) & 0xF7,
                    };
                }
            });
        }
    });
    match precision {
        Precision::Int8 => WeightCodes::I8(bytes.into_iter().map(|b| b as i8).collect()),
        _ => WeightCodes::Fp8(bytes),
    }
}

/// Replaces the block linears of `model` (never the LM head) by random layers of `variant`
/// that satisfy its pattern, without the packer.
fn convert_random(model: &mut Llama<Gpu>, variant: &str) -> Result<(), Box<dyn std::error::Error>> {
    if variant == "bf16" {
        return Ok(());
    }
    let (pattern, precision) = variant.split_once('-').ok_or_else(|| {
        format!("variant {variant}: expected dense-PRECISION or PATTERN-PRECISION")
    })?;
    let precision: Precision = precision.parse()?;
    if !precision.is_quantized() {
        return Err(format!("variant {variant}: random codes are INT8 or FP8").into());
    }
    let device = Default::default();
    model.visit_linears(&mut |name, layer| {
        if name == "lm_head" {
            return Ok(());
        }
        let (k, n) = layer.features();
        let bias = layer.has_bias().then(|| vec![0.01f32; n]);
        *layer = if pattern == "dense" {
            let weight = QuantizedWeight {
                rows: n,
                cols: k,
                codes: random_codes(precision, n, k, false),
                scales: vec![1e-3; n],
            };
            QuantizedLinear::from_quantized_owned(weight, bias.as_deref(), &device).into()
        } else {
            let pattern: SparsityPattern = pattern.parse()?;
            let kp = pattern.geometry(k, DEFAULT_ALIGNMENT).k_prime();
            let packed = PackedLinear {
                name: format!("{name}.weight"),
                pattern,
                in_features: k,
                alignment: DEFAULT_ALIGNMENT,
                weight: QuantizedWeight {
                    rows: n,
                    cols: kp,
                    codes: random_codes(precision, n, kp, true),
                    scales: vec![1e-3; n],
                },
                bias,
            };
            SlideSparseLinear::from_packed_owned(packed, &device).into()
        };
        Ok(())
    })?;
    Ok(())
}

fn random_tokens(
    batch: usize,
    t: usize,
    vocab: usize,
    device: &burn::tensor::Device<Gpu>,
) -> Tensor<Gpu, 2, Int> {
    Tensor::<Gpu, 2>::random(
        [batch, t],
        Distribution::Uniform(0.0, vocab as f64 - 1.0),
        device,
    )
    .int()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of a prefill of `t` tokens.
fn prefill_ms(model: &Llama<Gpu>, t: usize, vocab: usize, reps: usize) -> f64 {
    let device = Default::default();
    let tokens = random_tokens(1, t, vocab, &device);
    let run = || {
        let mut cache = KvCache::default();
        let _ = model.forward_last(tokens.clone(), &mut cache);
        Gpu::sync(&device).unwrap();
    };
    run();
    median(
        (0..reps)
            .map(|_| {
                let start = Instant::now();
                run();
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// Median ms per decode step at batch `b`, after a context of `max(1024 / b, 64)` tokens
/// (so the context prefill reuses the GEMM shapes of the prefill runs).
fn decode_ms(model: &Llama<Gpu>, b: usize, steps: usize, vocab: usize, reps: usize) -> f64 {
    let device = Default::default();
    let context = random_tokens(b, (1024 / b).max(64), vocab, &device);
    let step_tokens: Vec<_> = (0..steps)
        .map(|_| random_tokens(b, 1, vocab, &device))
        .collect();
    let run = || {
        let mut cache = KvCache::default();
        let _ = model.forward_last(context.clone(), &mut cache);
        Gpu::sync(&device).unwrap();
        let start = Instant::now();
        for tokens in &step_tokens {
            let _ = model.forward_last(tokens.clone(), &mut cache);
        }
        Gpu::sync(&device).unwrap();
        start.elapsed().as_secs_f64() * 1e3 / steps as f64
    };
    run();
    median((0..reps).map(|_| run()).collect())
}

fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let device = Default::default();
    let config = config(&args.model, args.layers)?;
    let vocab = config.vocab_size;
    // (variant, "prefill T" | "decode B") -> ms; "head-only" is the zero-block model.
    let mut results: BTreeMap<(String, String), f64> = BTreeMap::new();
    let mut measure = |name: &str, model: &Llama<Gpu>| {
        for &t in &list(&args.prefill) {
            let ms = prefill_ms(model, t, vocab, args.reps);
            eprintln!(
                "{name}: prefill {t}: {ms:.3} ms ({:.0} tok/s)",
                t as f64 / ms * 1e3
            );
            results.insert((name.into(), format!("prefill {t}")), ms);
        }
        for &b in &list(&args.decode_batch) {
            let ms = decode_ms(model, b, args.steps, vocab, args.reps);
            eprintln!(
                "{name}: decode batch {b}: {ms:.3} ms/step ({:.0} tok/s)",
                b as f64 / ms * 1e3
            );
            results.insert((name.into(), format!("decode {b}")), ms);
        }
    };
    if args.weights == "random" {
        return run_random(&args, &config);
    }
    let head_only = LlamaConfig {
        layers: 0,
        ..config.clone()
    }
    .init::<Gpu>(&device);
    measure("head-only", &head_only);
    drop(head_only);
    let base = config.init::<Gpu>(&device);
    let variants: Vec<String> = args
        .variants
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    for variant in &variants {
        let started = Instant::now();
        let mut model = base.clone();
        convert(&mut model, variant)?;
        eprintln!(
            "{variant}: converted in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        measure(variant, &model);
    }
    print_table(&args, &results, &variants);
    if let Some(path) = &args.json {
        let rows: Vec<_> = results
            .iter()
            .map(|((v, what), ms)| serde_json::json!({"variant": v, "what": what, "ms": ms}))
            .collect();
        let json = serde_json::json!({"model": args.model, "layers": args.layers, "results": rows});
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)?;
    }
    Ok(())
}

/// `--weights random`: each variant built, prepared and measured on its own (memory after
/// preparation, then the workloads), one after the other in this process.
fn run_random(args: &Args, config: &LlamaConfig) -> Result<(), Box<dyn std::error::Error>> {
    let device = Default::default();
    let vocab = config.vocab_size;
    let mut results: BTreeMap<(String, String), f64> = BTreeMap::new();
    let mut memory = Vec::new();
    let mut variants = vec!["head-only".to_string()];
    variants.extend(args.variants.split(',').map(|s| s.trim().to_string()));
    for variant in &variants {
        let started = Instant::now();
        let mut model = if variant == "head-only" {
            LlamaConfig {
                layers: 0,
                ..config.clone()
            }
            .init::<Gpu>(&device)
        } else {
            let mut model = config.init::<Gpu>(&device);
            convert_random(&mut model, variant)?;
            model
        };
        // burn initializes parameters lazily, on first use: materialize them all (the bf16
        // linears, embeddings and head) so that the report counts the whole model.
        model.visit(&mut Materialize);
        prepare_all(&mut model)?;
        let report = memory_report(&device)?;
        eprintln!(
            "{variant}: built and prepared in {:.1} s; allocator in use {:.0} MiB, reserved {:.0} MiB, driver used {:.0} MiB",
            started.elapsed().as_secs_f64(),
            mib(report.allocator_in_use),
            mib(report.allocator_reserved),
            mib(report.driver_used)
        );
        memory.push((variant.clone(), report));
        for &t in &list(&args.prefill) {
            let ms = prefill_ms(&model, t, vocab, args.reps);
            eprintln!("{variant}: prefill {t}: {ms:.3} ms");
            results.insert((variant.clone(), format!("prefill {t}")), ms);
        }
        for &b in &list(&args.decode_batch) {
            let ms = decode_ms(&model, b, args.steps, vocab, args.reps);
            eprintln!("{variant}: decode batch {b}: {ms:.3} ms/step");
            results.insert((variant.clone(), format!("decode {b}")), ms);
        }
        drop(model);
        // Give the freed pages back so that the next variant's driver figure is its own.
        release_free_memory(&device);
    }
    print_memory(args, &memory);
    print_table(args, &results, &variants[1..]);
    Ok(())
}

/// Reads every float parameter once, which initializes the lazily initialized ones.
struct Materialize;

impl ModuleVisitor<Gpu> for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Gpu, D>>) {
        let _ = param.val();
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// GPU memory after preparation per variant, with ratios to dense INT8 and bf16.
fn print_memory(args: &Args, memory: &[(String, MemoryReport)]) {
    let in_use = |name: &str| {
        memory
            .iter()
            .find(|(v, _)| v == name)
            .map(|(_, r)| r.allocator_in_use as f64)
    };
    println!(
        "\n{} with {} blocks, GPU memory after preparation (allocator: live cubecl allocations; driver: the process's device memory in use)",
        args.model, args.layers
    );
    println!(
        "| variant | allocator in use (MiB) | x dense-int8 | x bf16 | allocator reserved (MiB) | driver used (MiB) |"
    );
    println!("|---|---|---|---|---|---|");
    for (variant, r) in memory {
        let ratio = |base: Option<f64>| {
            base.map_or("-".to_string(), |b| {
                format!("{:.3}", r.allocator_in_use as f64 / b)
            })
        };
        println!(
            "| {variant} | {:.0} | {} | {} | {:.0} | {:.0} |",
            mib(r.allocator_in_use),
            ratio(in_use("dense-int8")),
            ratio(in_use("bf16")),
            mib(r.allocator_reserved),
            mib(r.driver_used)
        );
    }
}

/// Tokens/s per variant and workload, the speedup over the dense INT8 baseline, and the
/// per-block speedup (zero-block model subtracted).
fn print_table(args: &Args, results: &BTreeMap<(String, String), f64>, variants: &[String]) {
    let workloads: Vec<String> = list(&args.prefill)
        .iter()
        .map(|t| format!("prefill {t}"))
        .chain(
            list(&args.decode_batch)
                .iter()
                .map(|b| format!("decode {b}")),
        )
        .collect();
    println!(
        "\n{} with {} blocks, bf16 activations: ms (whole model), x = dense-int8 ms / variant ms, per-block x = the same with the zero-block model's time subtracted",
        args.model, args.layers
    );
    println!("| variant | workload | ms | tok/s | x vs dense-int8 | per-block x |");
    println!("|---|---|---|---|---|---|");
    for variant in variants {
        for w in &workloads {
            let (Some(ms), Some(dense), Some(head)) = (
                results.get(&(variant.clone(), w.clone())),
                results.get(&("dense-int8".to_string(), w.clone())),
                results.get(&("head-only".to_string(), w.clone())),
            ) else {
                continue;
            };
            let tokens: usize = w
                .split(' ')
                .nth(1)
                .and_then(|n| n.parse().ok())
                .unwrap_or(1);
            println!(
                "| {variant} | {w} | {ms:.3} | {:.0} | {:.3} | {:.3} |",
                tokens as f64 / ms * 1e3,
                dense / ms,
                (dense - head) / (ms - head)
            );
        }
    }
}
