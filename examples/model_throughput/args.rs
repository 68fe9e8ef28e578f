//! The command line: the flags, the named models' shapes, the table's rows.

use clap::Parser;
use slidesparse_examples::llama::LlamaConfig;

#[derive(Parser)]
pub(crate) struct Args {
    /// `llama3-8b`, `qwen2.5-7b` or `smollm2-135m`.
    #[arg(long, default_value = "llama3-8b")]
    pub(crate) model: String,
    /// Decoder blocks to build (the full models have 32 and 28).
    #[arg(long, default_value_t = 2)]
    pub(crate) layers: usize,
    #[arg(long, default_value = "1024,4096")]
    pub(crate) prefill: String,
    #[arg(long, default_value = "1,16,64")]
    pub(crate) decode_batch: String,
    /// Decode steps per timed run.
    #[arg(long, default_value_t = 16)]
    pub(crate) steps: usize,
    #[arg(long, default_value_t = 7)]
    pub(crate) reps: usize,
    /// Variants: `bf16`, `dense-int8`, `dense-fp8`, or `PATTERN-PRECISION` (e.g. `6:8-int8`).
    #[arg(
        long,
        default_value = "bf16,dense-int8,2:4-int8,4:6-int8,6:8-int8,8:10-int8,dense-fp8,6:8-fp8"
    )]
    pub(crate) variants: String,
    #[arg(long)]
    pub(crate) json: Option<std::path::PathBuf>,
    /// `fusion` (burn-cuda's default: `Fusion<CubeBackend>`), `plain` (`CubeBackend`) or
    /// `both` (random weights: each variant on both, timed alternately, fusion / plain).
    #[arg(long, default_value = "fusion")]
    pub(crate) backend: String,
    /// Tokens per sequence in the KV cache before the timed decode steps.
    #[arg(long, default_value_t = 1024)]
    pub(crate) context: usize,
    /// Keep q/k/v and gate/up as separate layers (default: fused, one GEMM each).
    #[arg(long)]
    pub(crate) separate: bool,
    /// Also time every variant with each block step and linear as operations of their own
    /// (`Llama::composed_steps` off), as the rows `VARIANT/apart`, in the same process, after
    /// the composed rows on the same model. Needs fused projections (not `--separate`).
    #[arg(long)]
    pub(crate) compare_apart: bool,
    /// First check a small model's logits on the GPU (both backends, fused and separate,
    /// cached decode) against the CPU reference.
    #[arg(long)]
    pub(crate) check: bool,
    /// `pack`: convert a random bf16 model's linears with the packer (prune, quantize, slide;
    /// every variant from the same bf16 model, which stays on the GPU). `random`: each variant
    /// is built on its own with random codes that satisfy the pattern (no packer: fast at
    /// full depth), and its GPU memory after preparation is reported.
    #[arg(long, default_value = "pack")]
    pub(crate) weights: String,
    /// After timing each decode batch, run one more step inside a profiler range
    /// (`cuProfilerStart` / `cuProfilerStop`): `ncu --profile-from-start off` then records
    /// the kernels of exactly one decode step (not of the zero-block model). Takes one
    /// variant and one decode batch, so that the profile holds one step.
    #[arg(long)]
    pub(crate) profile_decode: bool,
    /// The LM head of the quantized variants: `int8` (a dense INT8 layer, as the block linears
    /// of the dense INT8 baseline; untied heads only), `bf16` (as the embeddings), or `auto`:
    /// `int8` where the head is untied, `bf16` where it is the embedding matrix (an INT8 head
    /// would be a second copy of it). The bf16 variant keeps its bf16 head.
    #[arg(long, default_value = "auto")]
    pub(crate) head: String,
    /// Split every variant over this many GPUs (devices 0..R; random weights): the split
    /// model and the one-GPU model are timed alternately in this process, on `--backend`,
    /// after a check of their logits against each other.
    #[arg(long)]
    pub(crate) tensor_parallel: Option<usize>,
    /// With `--tensor-parallel`: the all-reduce, `nccl` (this crate's `NcclRanks`, plain
    /// backend only; the default there) or `burn` (burn's own, `BurnRanks`; the default on
    /// fusion).
    #[arg(long)]
    pub(crate) collective: Option<String>,
    /// With `--tensor-parallel`: every rank on GPU 0, combined by the simulated collective
    /// (tensor operations). Checks the split model on one GPU; its times are not those of
    /// tensor parallelism.
    #[arg(long)]
    pub(crate) tp_simulate: bool,
    /// With `--tensor-parallel`: one driving thread per rank (`with_rank_threads`), each
    /// rank's all-reduce called by its own thread (NCCL), or the ranks meeting at each
    /// (`--tp-simulate`); `--collective burn` has no per-rank form.
    #[arg(long)]
    pub(crate) rank_threads: bool,
    /// Also time each decode batch with the model's whole step replayed as one CUDA graph
    /// (`Llama::decode_graph`: plain backend, INT8 linears), as the rows `VARIANT/graph`, in
    /// the same process right after the operations' step.
    #[arg(long)]
    pub(crate) decode_graph: bool,
}

/// The shapes of a named model with `layers` blocks.
pub(crate) fn config(name: &str, layers: usize) -> Result<LlamaConfig, String> {
    let (vocab, hidden, intermediate, heads, kv_heads, tie, bias) = match name {
        "llama3-8b" => (128_256, 4096, 14_336, 32, 8, false, false),
        "qwen2.5-7b" => (152_064, 3584, 18_944, 28, 4, false, true),
        // SmolLM2-135M (the generate example's model), its head tied to the embedding.
        "smollm2-135m" => (49_152, 576, 1536, 9, 3, true, false),
        other => {
            return Err(format!(
                "unknown model {other}: llama3-8b, qwen2.5-7b or smollm2-135m"
            ));
        }
    };
    Ok(
        LlamaConfig::new(vocab, hidden, intermediate, layers, heads, kv_heads)
            .with_tie_embeddings(tie)
            .with_qkv_bias(bias)
            .with_max_seq_len(32_768)
            .with_rope_base(500_000.0),
    )
}

pub(crate) fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

/// The table's rows: each variant, followed by its `/apart` row under `--compare-apart` and
/// its `/graph` row under `--decode-graph`.
pub(crate) fn rows(args: &Args, variants: &[String]) -> Vec<String> {
    variants
        .iter()
        .flat_map(|v| {
            [
                Some(v.clone()),
                args.compare_apart.then(|| apart(v)),
                args.decode_graph.then(|| format!("{v}/graph")),
            ]
        })
        .flatten()
        .collect()
}

/// The row name of `variant` with its block steps and linears as separate operations.
pub(crate) fn apart(variant: &str) -> String {
    format!("{variant}/apart")
}
