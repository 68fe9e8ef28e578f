//! End-to-end throughput of the example Llama model on burn-cuda (feature `cuda`), with
//! random weights at a real model's shapes and a few blocks, for each kind of linear layer:
//! burn's bf16 `nn::Linear`, the dense quantized baseline (`QuantizedLinear`, same pipeline
//! as SlideSparse without the slide), and SlideSparse at each pattern. The embeddings stay
//! bf16 in every variant, and the LM head too unless `--head int8` (a dense INT8 head in
//! every quantized variant, the zero-block model included); activations are bf16.
//!
//! The model runs as an inference engine: burn-cuda with fusion (`--backend plain`: without;
//! `both`: each workload alternately on both), q/k/v and gate/up fused into one layer each
//! (`--separate`: not), each block one `decoder_block` operation where its linears are
//! SlideSparse or quantized (`--compare-apart` also times each step and linear as operations
//! of their own), the
//! attention kernels of `burn_slidesparse::causal_attention`, a KV cache written in place.
//!
//! Prefill: one sequence of T tokens, median of `--reps` forwards (fresh KV cache each).
//! Decode: batch B with `--context` tokens per sequence in the cache (prefilled once),
//! `--steps` single-token steps back to back with one device sync, median of `--reps`; the
//! host column is the time to queue one step, from runs that sync after every step. A model
//! with zero blocks (embedding + head only) is timed too, so the per-block cost can be read
//! off.
//!
//! ```text
//! cargo run --release -p slidesparse-examples --features cuda --example model_throughput -- \
//!     --model llama3-8b --layers 2
//! ```

use std::{collections::BTreeMap, time::Instant};

use burn::{
    module::{Module, ModuleVisitor, Param},
    tensor::{DType, Distribution, Int, Tensor, TensorData, backend::Backend, set_default_dtypes},
};
use burn_slidesparse::{
    Collective, DEFAULT_ALIGNMENT, PackOptions, PackedLinear, Precision, QuantizedLinear,
    QuantizedWeight, SimulatedRanks, SlideSparseBackend, SlideSparseLinear, SparsityPattern,
    VisitLinears, WeightCodes,
    cuda::{
        BurnRanks, CudaBackend, CudaDevice, CudaFusionBackend, NcclRanks, device_count,
        driver::profiler_range,
        memory::{MemoryReport, graph_report, memory_report, release_free_memory},
    },
    prepare_all, quantize_dense, sparsify,
};
use clap::Parser;
use half::bf16;
use slidesparse_examples::{
    llama::{KvCache, Llama, LlamaConfig},
    tensor_parallel::{MeetingRanks, RankCollective, TensorParallelCache, TensorParallelLlama},
};

/// burn-cuda with fusion (the default), bf16 activations.
type Gpu = CudaFusionBackend<bf16>;
/// burn-cuda without fusion (`--backend plain`).
type Plain = CudaBackend<bf16>;

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
    /// `fusion` (burn-cuda's default: `Fusion<CubeBackend>`), `plain` (`CubeBackend`) or
    /// `both` (random weights: each variant on both, timed alternately, fusion / plain).
    #[arg(long, default_value = "fusion")]
    backend: String,
    /// Tokens per sequence in the KV cache before the timed decode steps.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Keep q/k/v and gate/up as separate layers (default: fused, one GEMM each).
    #[arg(long)]
    separate: bool,
    /// Also time every variant with each block step and linear as operations of their own
    /// (`Llama::composed_steps` off), as the rows `VARIANT/apart`, in the same process, after
    /// the composed rows on the same model. Needs fused projections (not `--separate`).
    #[arg(long)]
    compare_apart: bool,
    /// First check a small model's logits on the GPU (both backends, fused and separate,
    /// cached decode) against the CPU reference.
    #[arg(long)]
    check: bool,
    /// `pack`: convert a random bf16 model's linears with the packer (prune, quantize, slide;
    /// every variant from the same bf16 model, which stays on the GPU). `random`: each variant
    /// is built on its own with random codes that satisfy the pattern (no packer: fast at
    /// full depth), and its GPU memory after preparation is reported.
    #[arg(long, default_value = "pack")]
    weights: String,
    /// After timing each decode batch, run one more step inside a profiler range
    /// (`cuProfilerStart` / `cuProfilerStop`): `ncu --profile-from-start off` then records
    /// the kernels of exactly one decode step (not of the zero-block model). Takes one
    /// variant and one decode batch, so that the profile holds one step.
    #[arg(long)]
    profile_decode: bool,
    /// The LM head of the quantized variants: `bf16` (as the embeddings) or `int8` (a dense
    /// INT8 layer, as the block linears of the dense INT8 baseline). Untied heads only.
    #[arg(long, default_value = "bf16")]
    head: String,
    /// Split every variant over this many GPUs (devices 0..R; random weights): the split
    /// model and the one-GPU model are timed alternately in this process, on `--backend`,
    /// after a check of their logits against each other.
    #[arg(long)]
    tensor_parallel: Option<usize>,
    /// With `--tensor-parallel`: the all-reduce, `nccl` (this crate's `NcclRanks`, plain
    /// backend only; the default there) or `burn` (burn's own, `BurnRanks`; the default on
    /// fusion).
    #[arg(long)]
    collective: Option<String>,
    /// With `--tensor-parallel`: every rank on GPU 0, combined by the simulated collective
    /// (tensor operations). Checks the split model on one GPU; its times are not those of
    /// tensor parallelism.
    #[arg(long)]
    tp_simulate: bool,
    /// With `--tensor-parallel`: one driving thread per rank (`with_rank_threads`), each
    /// rank's all-reduce called by its own thread (NCCL), or the ranks meeting at each
    /// (`--tp-simulate`); `--collective burn` has no per-rank form.
    #[arg(long)]
    rank_threads: bool,
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
            .with_max_seq_len(32_768)
            .with_rope_base(500_000.0),
    )
}

/// Converts the block linears of `model` (never the LM head) to `variant`.
fn convert<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
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

/// `--head int8`: the LM head of a quantized variant (and of the zero-block model that the
/// per-block figures subtract) becomes a dense INT8 layer; `bf16` keeps burn's bf16 head.
fn convert_head<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    args: &Args,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    match args.head.as_str() {
        "bf16" => Ok(()),
        "int8" if variant == "bf16" => Ok(()),
        "int8" if config(&args.model, 0)?.tie_embeddings => Err(format!(
            "--head int8: {} ties its LM head to the embedding matrix; an INT8 head would be \
             a second copy of it (more memory, not less)",
            args.model
        )
        .into()),
        "int8" => {
            drop(quantize_dense(model, Precision::Int8, |name| {
                name == "lm_head"
            })?);
            Ok(())
        }
        other => Err(format!("--head {other}: expected bf16 or int8").into()),
    }
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

/// `rows x cols` random codes of `precision`, filled on every core, nonzero in the first
/// `used` columns of each row only (the rest is a slid weight's alignment padding); with
/// `two_of_four`, only the first two of every four columns are nonzero (a valid slid weight).
fn random_codes(
    precision: Precision,
    (rows, cols, used): (usize, usize, usize),
    two_of_four: bool,
) -> WeightCodes {
    let mut bytes = vec![0u8; rows * cols];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows_per = rows.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (t, chunk) in bytes.chunks_mut(rows_per * cols).enumerate() {
            scope.spawn(move || {
                let mut noise = Noise(0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1));
                for (j, b) in chunk.iter_mut().enumerate() {
                    if (two_of_four && (j % cols) % 4 >= 2) || j % cols >= used {
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
fn convert_random<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
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
                codes: random_codes(precision, (n, k, k), false),
                scales: vec![1e-3; n],
            };
            QuantizedLinear::from_quantized_owned(weight, bias.as_deref(), &device).into()
        } else {
            let pattern: SparsityPattern = pattern.parse()?;
            let geometry = pattern.geometry(k, DEFAULT_ALIGNMENT);
            let (kp, used) = (
                geometry.k_prime(),
                geometry.blocks() * geometry.slid_block_len(),
            );
            let packed = PackedLinear {
                name: format!("{name}.weight"),
                pattern,
                in_features: k,
                alignment: DEFAULT_ALIGNMENT,
                weight: QuantizedWeight {
                    rows: n,
                    cols: kp,
                    codes: random_codes(precision, (n, kp, used), true),
                    scales: vec![1e-3; n],
                },
                bias,
                input_permutation: None,
            };
            SlideSparseLinear::from_packed_owned(packed, &device).into()
        };
        Ok(())
    })?;
    Ok(())
}

fn random_tokens<B: Backend>(
    batch: usize,
    t: usize,
    vocab: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    Tensor::<B, 2>::random(
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

/// Ms of one prefill of `tokens` (a fresh KV cache, synced).
fn prefill_once<B: SlideSparseBackend>(model: &Llama<B>, tokens: &Tensor<B, 2, Int>) -> f64 {
    let device = Default::default();
    let start = Instant::now();
    let mut cache = KvCache::with_capacity(tokens.dims()[1]);
    let _ = model.forward_last(tokens.clone(), &mut cache);
    B::sync(&device).unwrap();
    drop(cache);
    start.elapsed().as_secs_f64() * 1e3
}

/// Median ms of a prefill of `t` tokens.
fn prefill_ms<B: SlideSparseBackend>(model: &Llama<B>, t: usize, vocab: usize, reps: usize) -> f64 {
    let tokens = random_tokens::<B>(1, t, vocab, &Default::default());
    prefill_once(model, &tokens);
    median((0..reps).map(|_| prefill_once(model, &tokens)).collect())
}

/// A decode workload on one model: batch `b` with `context` tokens per sequence in the cache
/// (prefilled once), and the tokens of `steps` single-token steps.
struct Decoder<'m, B: SlideSparseBackend> {
    model: &'m Llama<B>,
    cache: KvCache<B>,
    tokens: Vec<Tensor<B, 2, Int>>,
    context: usize,
}

impl<'m, B: SlideSparseBackend> Decoder<'m, B> {
    fn new(model: &'m Llama<B>, (b, context): (usize, usize), steps: usize, vocab: usize) -> Self {
        let device = Default::default();
        let tokens = (0..steps)
            .map(|_| random_tokens::<B>(b, 1, vocab, &device))
            .collect();
        let mut cache = KvCache::with_capacity(context + steps);
        // The context in chunks of <= 16384 tokens (the prefill shapes timed above).
        let chunk = (16_384 / b).max(1);
        let mut done = 0;
        while done < context {
            let t = chunk.min(context - done);
            let _ = model.forward_last(random_tokens::<B>(b, t, vocab, &device), &mut cache);
            done += t;
        }
        B::sync(&device).unwrap();
        Self {
            model,
            cache,
            tokens,
            context,
        }
    }

    /// Ms per step of one run of the steps back to back from the context (one device sync at
    /// the end); with `host`, the ms to queue a step, from a run that syncs after every step.
    fn run(&mut self, host: bool) -> f64 {
        let device = Default::default();
        self.cache.truncate(self.context);
        let start = Instant::now();
        let mut queued = 0.0;
        for tokens in &self.tokens {
            let t0 = Instant::now();
            let _ = self.model.forward_last(tokens.clone(), &mut self.cache);
            queued += t0.elapsed().as_secs_f64();
            if host {
                B::sync(&device).unwrap();
            }
        }
        B::sync(&device).unwrap();
        let total = start.elapsed().as_secs_f64();
        1e3 / self.tokens.len() as f64 * if host { queued } else { total }
    }

    /// One more step inside a profiler range.
    fn profile(&mut self) {
        self.cache.truncate(self.context);
        profiler_range(0, || {
            let _ = self
                .model
                .forward_last(self.tokens[0].clone(), &mut self.cache);
            B::sync(&Default::default()).unwrap();
        })
        .expect("profiler range");
    }
}

/// Median ms per decode step at batch `b` with `context` tokens per sequence in the cache
/// (each run decodes `steps` tokens back to back and rewinds the cache to the context), and
/// the host's ms per step (the time to queue a step when the device is idle). With
/// `profile`, one more step runs inside a profiler range.
fn decode_ms<B: SlideSparseBackend>(
    model: &Llama<B>,
    (b, context): (usize, usize),
    (steps, profile): (usize, bool),
    vocab: usize,
    reps: usize,
) -> (f64, f64) {
    let mut decoder = Decoder::new(model, (b, context), steps, vocab);
    decoder.run(false);
    let device_ms = median((0..reps).map(|_| decoder.run(false)).collect());
    let host_ms = median((0..reps.min(3)).map(|_| decoder.run(true)).collect());
    if profile {
        decoder.profile();
    }
    (device_ms, host_ms)
}

fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.compare_apart && args.separate {
        return Err(
            "--compare-apart times composed steps, which need fused projections: \
                    drop --separate"
                .into(),
        );
    }
    if args.profile_decode {
        let one = |n: usize| n == 1;
        if !one(args.variants.split(',').count())
            || !one(list(&args.decode_batch).len())
            || args.compare_apart
            || args.steps == 0
            || args.backend == "both"
        {
            return Err(
                "--profile-decode profiles one decode step: give one --variants, one \
                        --decode-batch, --steps >= 1, one --backend and no --compare-apart"
                    .into(),
            );
        }
    }
    // Every GPU computes in bf16, said before any tensor exists: burn keeps one default
    // dtype per device for all of its CUDA backends and fixes it at the first tensor created
    // with it, whichever backend's float type that has.
    for index in 0..device_count()? {
        let device = CudaDevice { index };
        set_default_dtypes::<Plain>(&device, DType::BF16, DType::I32)
            .map_err(|e| format!("GPU {index}'s default dtypes: {e:?}"))?;
    }
    if args.check {
        check_against_the_cpu::<Gpu>()?;
        check_against_the_cpu::<Plain>()?;
    }
    if let Some(ranks) = args.tensor_parallel {
        return run_tensor_parallel(&args, ranks);
    }
    if args.collective.is_some() || args.tp_simulate || args.rank_threads {
        return Err(
            "--collective, --tp-simulate and --rank-threads go with --tensor-parallel".into(),
        );
    }
    match args.backend.as_str() {
        "fusion" => run::<Gpu>(&args),
        "plain" => run::<Plain>(&args),
        "both" if args.weights == "random" => run_both(&args),
        "both" => Err("--backend both needs --weights random".into()),
        other => Err(format!("--backend {other}: fusion, plain or both").into()),
    }
}

/// `--backend both` (random weights): each variant built on fusion and on the plain backend
/// side by side, every workload timed **alternately** on the two (one run each, `--reps`
/// times, after a warm-up run of each), so that the host's drift during the process falls
/// on both alike; the table gives the medians and fusion / plain.
fn run_both(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.compare_apart || args.json.is_some() {
        return Err(
            "--backend both times the composed model into its table only: drop \
             --compare-apart and --json"
                .into(),
        );
    }
    let config = config(&args.model, args.layers)?;
    let vocab = config.vocab_size;
    let mut rows = Vec::new();
    for variant in args.variants.split(',').map(str::trim) {
        let fused = build_random::<Gpu>(args, &config, variant, true)?;
        let plain = build_random::<Plain>(args, &config, variant, true)?;
        for t in list(&args.prefill) {
            let device = Default::default();
            let tokens = (
                random_tokens::<Gpu>(1, t, vocab, &device),
                random_tokens::<Plain>(1, t, vocab, &device),
            );
            let (f, p) = alternate(
                args.reps,
                || prefill_once(&fused, &tokens.0),
                || prefill_once(&plain, &tokens.1),
            );
            rows.push((variant.to_string(), format!("prefill {t}"), f, p));
        }
        for b in list(&args.decode_batch) {
            let mut f = Decoder::new(&fused, (b, args.context), args.steps, vocab);
            let mut p = Decoder::new(&plain, (b, args.context), args.steps, vocab);
            let (f, p) = alternate(args.reps, || f.run(false), || p.run(false));
            rows.push((variant.to_string(), format!("decode {b}"), f, p));
        }
        eprintln!(
            "after {variant}: GEMM graphs so far: {}",
            graph_report(&Default::default())?
        );
    }
    println!(
        "\n{} with {} blocks, bf16 activations, fusion and plain backends alternately in one process: median ms (whole model)",
        args.model, args.layers
    );
    println!("| variant | workload | fusion ms | plain ms | fusion / plain |");
    println!("|---|---|---|---|---|");
    for (variant, what, f, p) in rows {
        println!("| {variant} | {what} | {f:.3} | {p:.3} | {:.3} |", f / p);
    }
    Ok(())
}

/// `--tensor-parallel R`: every variant built once with separate projections, split over
/// `R` ranks, then fused and prepared as the one-GPU model; the split model's logits
/// checked against the one-GPU model's, then every workload timed alternately on the two.
fn run_tensor_parallel(args: &Args, ranks: usize) -> Result<(), Box<dyn std::error::Error>> {
    if args.weights != "random" || args.json.is_some() {
        return Err("--tensor-parallel needs --weights random, and no --json".into());
    }
    if args.compare_apart || args.profile_decode || args.separate {
        return Err("--tensor-parallel: drop --compare-apart, --profile-decode, --separate".into());
    }
    if ranks == 0 {
        return Err("--tensor-parallel: at least one rank".into());
    }
    let present = device_count()?;
    if !args.tp_simulate && ranks > present {
        return Err(format!(
            "--tensor-parallel {ranks}: {present} GPU(s) present (--tp-simulate puts every \
             rank on GPU 0)"
        )
        .into());
    }
    let indices: Vec<usize> = if args.tp_simulate {
        vec![0; ranks]
    } else {
        (0..ranks).collect()
    };
    let fusion = match args.backend.as_str() {
        "fusion" => true,
        "plain" => false,
        other => {
            return Err(format!("--tensor-parallel: --backend {other}: fusion or plain").into());
        }
    };
    let collective = match (args.collective.as_deref(), fusion) {
        (Some(_), _) if args.tp_simulate => {
            return Err("--tp-simulate combines the ranks itself: drop --collective".into());
        }
        (Some("nccl"), true) => {
            return Err(
                "--collective nccl: NcclRanks serves the plain backend (--backend \
                        plain); on fusion, --collective burn"
                    .into(),
            );
        }
        (Some(c @ ("nccl" | "burn")), _) => c,
        (Some(other), _) => return Err(format!("--collective {other}: nccl or burn").into()),
        (None, true) => "burn",
        (None, false) => "nccl",
    };
    if args.rank_threads && collective == "burn" && !args.tp_simulate {
        return Err(
            "--rank-threads: BurnRanks has no per-rank call; use --collective nccl (plain) \
                    or --tp-simulate"
                .into(),
        );
    }
    let threads = if args.rank_threads {
        ", one thread per rank"
    } else {
        ""
    };
    let how = if args.tp_simulate {
        format!("{ranks} simulated ranks on GPU 0 (not tensor parallelism){threads}")
    } else {
        format!("{ranks} GPU(s), all-reduce: {collective}{threads}")
    };
    let rows = match (args.tp_simulate, fusion, collective) {
        (true, true, _) => simulated::<Gpu>(args, &indices)?,
        (true, false, _) => simulated::<Plain>(args, &indices)?,
        (false, false, "nccl") => {
            let nccl = NcclRanks::new(&indices)?;
            let threads = args
                .rank_threads
                .then_some(&nccl as &dyn RankCollective<Plain>);
            run_split::<Plain>(args, &indices, &nccl, threads)?
        }
        (false, false, _) => run_split::<Plain>(args, &indices, &BurnRanks::new(&indices)?, None)?,
        (false, true, _) => run_split::<Gpu>(args, &indices, &BurnRanks::new(&indices)?, None)?,
    };
    println!(
        "\n{} with {} blocks, bf16 activations, {} backend; one GPU and {how} alternately \
         in one process: median ms (whole model)",
        args.model, args.layers, args.backend
    );
    println!(
        "| variant | workload | 1 GPU ms | {ranks} ranks ms | speedup | tok/s 1 GPU | tok/s \
         {ranks} ranks | host ms/step 1 GPU | host ms/step {ranks} ranks |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (variant, what, tokens, one, split, host) in rows {
        let rate = |ms: f64| tokens as f64 / ms * 1e3;
        let (host_one, host_split) = host.map_or(("".into(), "".into()), |(a, b)| {
            (format!("{a:.3}"), format!("{b:.3}"))
        });
        println!(
            "| {variant} | {what} | {one:.3} | {split:.3} | {:.2}x | {:.0} | {:.0} | {host_one} \
             | {host_split} |",
            one / split,
            rate(one),
            rate(split)
        );
    }
    Ok(())
}

/// [`run_split`] over the simulated collective, met by the ranks' threads with
/// `--rank-threads`.
fn simulated<B: SlideSparseBackend<Device = CudaDevice>>(
    args: &Args,
    indices: &[usize],
) -> Result<Vec<SplitRow>, Box<dyn std::error::Error>> {
    let simulated = SimulatedRanks::new(indices.len())?;
    let meeting = MeetingRanks::new(&simulated);
    let threads = args
        .rank_threads
        .then_some(&meeting as &dyn RankCollective<B>);
    run_split::<B>(args, indices, &simulated, threads)
}

/// Every variant built on `B` (GPU 0), split over the CUDA devices `indices` and combined by
/// `collective` (or by `threads`, one driving thread per rank), then fused and prepared as
/// the one-GPU model, and timed against it.
fn run_split<B: SlideSparseBackend<Device = CudaDevice>>(
    args: &Args,
    indices: &[usize],
    collective: &impl Collective<B>,
    threads: Option<&dyn RankCollective<B>>,
) -> Result<Vec<SplitRow>, Box<dyn std::error::Error>> {
    let devices: Vec<CudaDevice> = indices.iter().map(|&index| CudaDevice { index }).collect();
    let config = config(&args.model, args.layers)?;
    let mut rows = Vec::new();
    for variant in args.variants.split(',').map(str::trim) {
        let started = Instant::now();
        let mut single = build_random::<B>(args, &config, variant, false)?;
        let split = TensorParallelLlama::split(&single, &devices)?;
        single.fuse_projections()?;
        prepare_all(&mut single)?;
        eprintln!(
            "{variant}: built and split over {} (the split prepared on first use), the \
             one-GPU model prepared, in {:.1} s",
            devices.len(),
            started.elapsed().as_secs_f64()
        );
        let timed = match threads {
            None => time_split(args, variant, (&single, &split), &devices, &mut |t, c| {
                split.forward_last(t, c, collective)
            }),
            Some(threads) => split.with_rank_threads(threads, |threads| {
                time_split(args, variant, (&single, &split), &devices, &mut |t, c| {
                    threads.forward_last(t, c)
                })
            }),
        };
        rows.extend(timed?);
    }
    Ok(rows)
}

/// `(variant, workload, tokens per call, 1-GPU ms, split ms, host ms to queue a step on
/// 1 GPU and split)`; the host times for decode only.
type SplitRow = (String, String, usize, f64, f64, Option<(f64, f64)>);

/// One variant's rows `(variant, workload, tokens, 1-GPU ms, split ms)`: first the logits
/// of a 16-token prompt on both, then every workload alternately. The logits differ where
/// row-parallel INT8/FP8 ranks quantize their slices with their own scales (4% relative L2
/// at 4 blocks of random weights on 2 ranks, growing with depth; 0 on one rank), so only a
/// difference past 30% is an error: a wrongly split model is off by ~100%.
fn time_split<B: SlideSparseBackend<Device = CudaDevice>>(
    args: &Args,
    variant: &str,
    (single, split): (&Llama<B>, &TensorParallelLlama<B>),
    devices: &[CudaDevice],
    forward: &mut SplitForward<'_, B>,
) -> Result<Vec<SplitRow>, Box<dyn std::error::Error>> {
    let vocab = single.embed.weight.dims()[0];
    let sync = || -> Result<(), Box<dyn std::error::Error>> {
        for device in devices {
            B::sync(device)?;
        }
        Ok(())
    };
    let prompt = host_tokens(1, 16, vocab, 1);
    let want = single.forward_last(
        Tensor::from_data(prompt.clone(), &devices[0]),
        &mut KvCache::default(),
    );
    let got = forward(split.upload(&prompt), &mut split.cache(1, 16))?;
    let read = |t: Tensor<B, 2>| t.into_data().convert::<f32>().into_vec::<f32>();
    let error = relative_l2(&read(want)?, &read(got)?);
    eprintln!(
        "{variant}: split over {} ranks: logits relative L2 {error:.2e}",
        devices.len()
    );
    if error.is_nan() || error > 0.3 {
        return Err(
            format!("{variant}: the split model's logits are off: relative L2 {error}").into(),
        );
    }
    let mut rows = Vec::new();
    for t in list(&args.prefill) {
        let tokens = host_tokens(1, t, vocab, 2);
        let on_device = Tensor::from_data(tokens.clone(), &devices[0]);
        let on_ranks = split.upload(&tokens);
        let (one, many) = alternate(
            args.reps,
            || prefill_once(single, &on_device),
            || {
                let start = Instant::now();
                let mut cache = split.cache(1, t);
                let _ = forward(on_ranks.clone(), &mut cache).expect("split prefill");
                sync().expect("sync");
                drop(cache);
                start.elapsed().as_secs_f64() * 1e3
            },
        );
        rows.push((
            variant.to_string(),
            format!("prefill {t}"),
            t,
            one,
            many,
            None,
        ));
    }
    for b in list(&args.decode_batch) {
        let mut one = Decoder::new(single, (b, args.context), args.steps, vocab);
        let mut many = SplitDecoder::new(split, forward, (b, args.context), args.steps, vocab)?;
        sync()?;
        let (one_ms, many_ms) = alternate(
            args.reps,
            || one.run(false),
            || many.run(forward, &sync, false),
        );
        // The time to queue a step with the devices idle: where it is longer than a
        // step's GPU time, it bounds the step.
        let host = alternate(
            args.reps.min(3),
            || one.run(true),
            || many.run(forward, &sync, true),
        );
        rows.push((
            variant.to_string(),
            format!("decode {b}"),
            b,
            one_ms,
            many_ms,
            Some(host),
        ));
    }
    // How the GEMMs ran on each GPU (a host-synchronized fallback shows here).
    for device in devices {
        let report =
            graph_report(device).map_or_else(|e| format!("unavailable: {e}"), |r| r.to_string());
        eprintln!(
            "{variant}: GPU {}: GEMM graphs and calls so far: {report}",
            device.index
        );
    }
    Ok(rows)
}

/// `[batch, t]` token ids on the host (every rank uploads its copy).
fn host_tokens(batch: usize, t: usize, vocab: usize, seed: u64) -> TensorData {
    let mut noise = Noise(0x9E37_79B9_7F4A_7C15 ^ seed);
    let ids: Vec<i64> = (0..batch * t)
        .map(|_| (noise.next() % vocab as u64) as i64)
        .collect();
    TensorData::new(ids, [batch, t])
}

/// A split model's forward (last-position logits): on one thread over a [`Collective`], or
/// by the ranks' threads.
type SplitForward<'f, B> = dyn FnMut(
        Vec<Tensor<B, 2, Int>>,
        &mut TensorParallelCache<B>,
    ) -> burn_slidesparse::Result<Tensor<B, 2>>
    + 'f;

/// [`Decoder`] for the split model.
struct SplitDecoder<B: SlideSparseBackend> {
    cache: TensorParallelCache<B>,
    /// Each step's ids, uploaded to every rank before the timed runs (as `Decoder`'s).
    tokens: Vec<Vec<Tensor<B, 2, Int>>>,
    context: usize,
}

impl<B: SlideSparseBackend> SplitDecoder<B> {
    fn new(
        model: &TensorParallelLlama<B>,
        forward: &mut SplitForward<'_, B>,
        (b, context): (usize, usize),
        steps: usize,
        vocab: usize,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let tokens = (0..steps)
            .map(|i| model.upload(&host_tokens(b, 1, vocab, 100 + i as u64)))
            .collect();
        let mut cache = model.cache(b, context + steps);
        let chunk = (16_384 / b).max(1);
        let mut done = 0;
        while done < context {
            let t = chunk.min(context - done);
            let ids = model.upload(&host_tokens(b, t, vocab, 3));
            forward(ids, &mut cache)?;
            done += t;
        }
        Ok(Self {
            cache,
            tokens,
            context,
        })
    }

    /// Ms per step of the steps back to back from the context (every device synced at the
    /// end); with `host`, the ms to queue a step, from a run that syncs after every step
    /// (as [`Decoder::run`]).
    fn run(
        &mut self,
        forward: &mut SplitForward<'_, B>,
        sync: &impl Fn() -> Result<(), Box<dyn std::error::Error>>,
        host: bool,
    ) -> f64 {
        self.cache.truncate(self.context);
        let start = Instant::now();
        let mut queued = 0.0;
        for tokens in &self.tokens {
            let t0 = Instant::now();
            let _ = forward(tokens.clone(), &mut self.cache).expect("split decode step");
            queued += t0.elapsed().as_secs_f64();
            if host {
                sync().expect("sync");
            }
        }
        sync().expect("sync");
        let total = start.elapsed().as_secs_f64();
        1e3 / self.tokens.len() as f64 * if host { queued } else { total }
    }
}

/// Medians of `reps` runs of `a` and of `b` taken in turn (`a`, `b`, `a`, ...), after one
/// warm-up run of each.
fn alternate(reps: usize, mut a: impl FnMut() -> f64, mut b: impl FnMut() -> f64) -> (f64, f64) {
    a();
    b();
    let (mut xa, mut xb) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        xa.push(a());
        xb.push(b());
    }
    (median(xa), median(xb))
}

/// Logits of a small model of Llama-3's head size (2 blocks, GQA 4:1, head dim 128) on `B`
/// in bf16 against the same weights on the CPU reference in f32: a whole-prompt forward,
/// the same prompt as a prefill plus cached decode steps (the cache written in place), with
/// fused and separate projections, dense and 6:8 INT8. Errors if any relative L2 error is
/// above bf16's and INT8's tolerance.
fn check_against_the_cpu<B: SlideSparseBackend>() -> Result<(), Box<dyn std::error::Error>> {
    use burn::{
        backend::NdArray,
        record::{BinBytesRecorder, FullPrecisionSettings, Recorder},
    };
    let config = LlamaConfig::new(512, 1024, 2048, 2, 8, 2)
        .with_max_seq_len(256)
        .with_tie_embeddings(false);
    let cpu_device = Default::default();
    let cpu = config.init::<NdArray>(&cpu_device);
    cpu.visit(&mut Materialize);
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(cpu.clone().into_record(), ())?;
    let device = Default::default();
    let gpu = config
        .init::<B>(&device)
        .load_record(recorder.load(bytes, &device)?);
    let ids: Vec<i64> = (0..40).map(|i| (i * 37 + 11) % 512).collect();
    for variant in ["bf16", "6:8-int8"] {
        let (mut reference, mut engine) = (cpu.clone(), gpu.clone());
        if variant != "bf16" {
            convert(&mut reference, variant)?;
            convert(&mut engine, variant)?;
        }
        let want = last_logits(&reference, &ids, &[ids.len()]);
        for fused in [false, true] {
            let mut engine = engine.clone();
            if fused {
                engine.fuse_projections()?;
            }
            for chunks in [vec![ids.len()], vec![32, 1, 1, 6]] {
                let got = last_logits(&engine, &ids, &chunks);
                let err = relative_l2(&want, &got);
                let tolerance = if variant == "bf16" { 0.02 } else { 0.05 };
                eprintln!(
                    "check {}: {variant}, fused {fused}, chunks {chunks:?}: relative L2 error {err:.2e} (tolerance {tolerance})",
                    if std::any::type_name::<B>().contains("Fusion") {
                        "fusion"
                    } else {
                        "plain"
                    }
                );
                if err.is_nan() || err > tolerance {
                    return Err(format!(
                        "check failed: {variant}, fused {fused}, chunks {chunks:?}: {err}"
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// The last position's logits of `ids` fed in `chunks` through one KV cache, as f32.
fn last_logits<B: SlideSparseBackend>(model: &Llama<B>, ids: &[i64], chunks: &[usize]) -> Vec<f32> {
    let device = model.embed.weight.device();
    let mut cache = KvCache::default();
    let mut at = 0;
    let mut last = None;
    for &n in chunks {
        let tokens = Tensor::<B, 2, Int>::from_data(
            burn::tensor::TensorData::new(ids[at..at + n].to_vec(), [1, n]),
            &device,
        );
        last = Some(model.forward_last(tokens, &mut cache));
        at += n;
    }
    last.expect("one chunk at least")
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 logits")
}

fn relative_l2(want: &[f32], got: &[f32]) -> f32 {
    let diff: f32 = want.iter().zip(got).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f32 = want.iter().map(|a| a * a).sum();
    (diff / norm).sqrt()
}

/// Every workload of `args` on `model`, into `results` under `name`.
fn measure<B: SlideSparseBackend>(
    args: &Args,
    vocab: usize,
    name: &str,
    model: &Llama<B>,
    results: &mut BTreeMap<(String, String), f64>,
) {
    for &t in &list(&args.prefill) {
        let ms = prefill_ms(model, t, vocab, args.reps);
        eprintln!(
            "{name}: prefill {t}: {ms:.3} ms ({:.0} tok/s)",
            t as f64 / ms * 1e3
        );
        results.insert((name.into(), format!("prefill {t}")), ms);
    }
    for &b in &list(&args.decode_batch) {
        // The zero-block model's step is not profiled: each profile holds one variant's step.
        let steps = (args.steps, args.profile_decode && name != "head-only");
        let (ms, host) = decode_ms(model, (b, args.context), steps, vocab, args.reps);
        eprintln!(
            "{name}: decode batch {b}: {ms:.3} ms/step ({:.0} tok/s), host {host:.3} ms/step",
            b as f64 / ms * 1e3
        );
        // How the layers' GEMM calls ran (counts over every layer and workload so far).
        let report = graph_report(&Default::default())
            .map_or_else(|e| format!("unavailable: {e}"), |r| r.to_string());
        eprintln!("{name}: decode batch {b}: GEMM graphs and calls so far: {report}");
        results.insert((name.into(), format!("decode {b}")), ms);
        results.insert((name.into(), format!("host {b}")), host);
    }
}

fn run<B: SlideSparseBackend>(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let device = Default::default();
    let config = config(&args.model, args.layers)?;
    let vocab = config.vocab_size;
    // (variant, "prefill T" | "decode B" | "host B") -> ms; "head-only" is the zero-block model.
    let mut results: BTreeMap<(String, String), f64> = BTreeMap::new();
    if args.weights == "random" {
        return run_random::<B>(args, &config);
    }
    let mut head_only = LlamaConfig {
        layers: 0,
        ..config.clone()
    }
    .init::<B>(&device);
    convert_head(&mut head_only, args, "head-only")?;
    measure(args, vocab, "head-only", &head_only, &mut results);
    drop(head_only);
    let base = config.init::<B>(&device);
    base.visit(&mut Materialize);
    let variants: Vec<String> = args
        .variants
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    for variant in &variants {
        let started = Instant::now();
        let mut model = base.clone();
        convert(&mut model, variant)?;
        convert_head(&mut model, args, variant)?;
        if !args.separate {
            model.fuse_projections()?;
        }
        eprintln!(
            "{variant}: converted in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        measure(args, vocab, variant, &model, &mut results);
        if args.compare_apart {
            model.composed_steps = false;
            measure(args, vocab, &apart(variant), &model, &mut results);
        }
    }
    print_table(args, &results, &rows(args, &variants));
    if let Some(path) = &args.json {
        let rows: Vec<_> = results
            .iter()
            .map(|((v, what), ms)| serde_json::json!({"variant": v, "what": what, "ms": ms}))
            .collect();
        let json = serde_json::json!({"model": args.model, "layers": args.layers, "backend": args.backend, "results": rows});
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)?;
    }
    Ok(())
}

/// `variant` (or the zero-block model, `head-only`) with random codes, prepared, every
/// parameter materialized and what is queued run.
fn build_random<B: SlideSparseBackend>(
    args: &Args,
    config: &LlamaConfig,
    variant: &str,
    fuse: bool,
) -> Result<Llama<B>, Box<dyn std::error::Error>> {
    let device = Default::default();
    let mut model = if variant == "head-only" {
        LlamaConfig {
            layers: 0,
            ..config.clone()
        }
        .init::<B>(&device)
    } else {
        let mut model = config.init::<B>(&device);
        convert_random(&mut model, variant)?;
        model
    };
    convert_head(&mut model, args, variant)?;
    // burn initializes parameters lazily, on first use: materialize them all (the bf16
    // linears, embeddings and head) so that the report counts the whole model.
    model.visit(&mut Materialize);
    if fuse {
        model.fuse_projections()?;
        prepare_all(&mut model)?;
    }
    // Fusion creates tensors lazily: run what is queued before reading the allocator.
    B::sync(&device)?;
    Ok(model)
}

/// `--weights random`: each variant built, prepared and measured on its own (memory after
/// preparation, then the workloads), one after the other in this process.
fn run_random<B: SlideSparseBackend>(
    args: &Args,
    config: &LlamaConfig,
) -> Result<(), Box<dyn std::error::Error>> {
    let vocab = config.vocab_size;
    let mut results: BTreeMap<(String, String), f64> = BTreeMap::new();
    let mut memory = Vec::new();
    let mut variants = vec!["head-only".to_string()];
    variants.extend(args.variants.split(',').map(|s| s.trim().to_string()));
    for variant in &variants {
        let started = Instant::now();
        let mut model = build_random::<B>(args, config, variant, !args.separate)?;
        let report = memory_report(&Default::default())?;
        eprintln!(
            "{variant}: built and prepared in {:.1} s; allocator in use {:.0} MiB, reserved {:.0} MiB, driver used {:.0} MiB",
            started.elapsed().as_secs_f64(),
            mib(report.allocator_in_use),
            mib(report.allocator_reserved),
            mib(report.driver_used)
        );
        memory.push((variant.clone(), report));
        measure(args, vocab, variant, &model, &mut results);
        if args.compare_apart && variant != "head-only" {
            model.composed_steps = false;
            measure(args, vocab, &apart(variant), &model, &mut results);
        }
        // Whether the layers' GEMMs replayed graphs (a failed capture runs directly).
        eprintln!(
            "after {variant}: GEMM graphs so far: {}",
            graph_report(&Default::default())?
        );
        drop(model);
        // Give the freed pages back so that the next variant's driver figure is its own.
        release_free_memory(&Default::default());
    }
    print_memory(args, &memory);
    print_table(args, &results, &rows(args, &variants[1..]));
    Ok(())
}

/// The table's rows: each variant, followed by its `/apart` row under `--compare-apart`.
fn rows(args: &Args, variants: &[String]) -> Vec<String> {
    variants
        .iter()
        .flat_map(|v| [Some(v.clone()), args.compare_apart.then(|| apart(v))])
        .flatten()
        .collect()
}

/// The row name of `variant` with its block steps and linears as separate operations.
fn apart(variant: &str) -> String {
    format!("{variant}/apart")
}

/// Reads every float parameter once, which initializes the lazily initialized ones.
struct Materialize;

impl<B: Backend> ModuleVisitor<B> for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
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
        "\n{} with {} blocks, LM head {}, GPU memory after preparation (allocator: live cubecl allocations; driver: the process's device memory in use)",
        args.model, args.layers, args.head
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
        "\n{} with {} blocks, {} backend, bf16 activations: ms (whole model), x = dense-int8 ms / variant ms, per-block x = the same with the zero-block model's time subtracted",
        args.model, args.layers, args.backend
    );
    println!("| variant | workload | ms | tok/s | x vs dense-int8 | per-block x | host ms/step |");
    println!("|---|---|---|---|---|---|---|");
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
            let host = results
                .get(&(variant.clone(), w.replace("decode", "host")))
                .map_or("-".to_string(), |h| format!("{h:.3}"));
            println!(
                "| {variant} | {w} | {ms:.3} | {:.0} | {:.3} | {:.3} | {host} |",
                tokens as f64 / ms * 1e3,
                dense / ms,
                (dense - head) / (ms - head)
            );
        }
    }
}
