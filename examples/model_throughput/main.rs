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
//!
//! Here: the runs of each `--backend` and `--weights` mode. `args.rs`: the flags and the
//! named models; `variants.rs`: building each variant; `timing.rs`: the timed workloads;
//! `split.rs`: `--tensor-parallel`; `check.rs`: `--check`; `report.rs`: the tables.

mod args;
mod check;
mod report;
mod split;
mod timing;
mod variants;

use std::{collections::BTreeMap, time::Instant};

use burn::{
    module::Module,
    tensor::{DType, set_default_dtypes},
};
use burn_slidesparse::{
    SlideSparseBackend,
    cuda::{
        CudaBackend, CudaDevice, CudaFusionBackend, device_count,
        memory::{graph_report, memory_report, release_free_memory},
    },
};
use clap::Parser;
use half::bf16;
use slidesparse_examples::llama::LlamaConfig;

use crate::{
    args::{Args, apart, config, list, rows},
    check::check_against_the_cpu,
    report::{mib, print_memory, print_table},
    split::run_tensor_parallel,
    timing::{Decoder, alternate, measure, prefill_once, random_tokens},
    variants::{Materialize, build_random, convert, convert_head},
};

/// burn-cuda with fusion (the default), bf16 activations.
pub(crate) type Gpu = CudaFusionBackend<bf16>;
/// burn-cuda without fusion (`--backend plain`).
pub(crate) type Plain = CudaBackend<bf16>;

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
pub(crate) fn run_both(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
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

pub(crate) fn run<B: SlideSparseBackend>(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
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

/// `--weights random`: each variant built, prepared and measured on its own (memory after
/// preparation, then the workloads), one after the other in this process.
pub(crate) fn run_random<B: SlideSparseBackend>(
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
