//! `--tensor-parallel`: every variant split over ranks and timed against the one-GPU model.

use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use burn_slidesparse::{
    Collective, SimulatedRanks, SlideSparseBackend,
    cuda::{BurnRanks, CudaDevice, NcclRanks, device_count, memory::graph_report},
    prepare_all,
};
use slidesparse_examples::{
    llama::{KvCache, Llama},
    tensor_parallel::{MeetingRanks, RankCollective, TensorParallelCache, TensorParallelLlama},
};

use crate::{
    Gpu, Plain,
    args::{Args, config, list},
    check::relative_l2,
    timing::{Decoder, alternate, prefill_once},
    variants::{Noise, build_random},
};

/// `--tensor-parallel R`: every variant built once with separate projections, split over
/// `R` ranks, then fused and prepared as the one-GPU model; the split model's logits
/// checked against the one-GPU model's, then every workload timed alternately on the two.
pub(crate) fn run_tensor_parallel(
    args: &Args,
    ranks: usize,
) -> Result<(), Box<dyn std::error::Error>> {
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
pub(crate) fn simulated<B: SlideSparseBackend<Device = CudaDevice>>(
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
pub(crate) fn run_split<B: SlideSparseBackend<Device = CudaDevice>>(
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
pub(crate) type SplitRow = (String, String, usize, f64, f64, Option<(f64, f64)>);

/// One variant's rows `(variant, workload, tokens, 1-GPU ms, split ms)`: first the logits
/// of a 16-token prompt on both, then every workload alternately. The logits differ where
/// row-parallel INT8/FP8 ranks quantize their slices with their own scales (4% relative L2
/// at 4 blocks of random weights on 2 ranks, growing with depth; 0 on one rank), so only a
/// difference past 30% is an error: a wrongly split model is off by ~100%.
pub(crate) fn time_split<B: SlideSparseBackend<Device = CudaDevice>>(
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
pub(crate) fn host_tokens(batch: usize, t: usize, vocab: usize, seed: u64) -> TensorData {
    let mut noise = Noise(0x9E37_79B9_7F4A_7C15 ^ seed);
    let ids: Vec<i64> = (0..batch * t)
        .map(|_| (noise.next() % vocab as u64) as i64)
        .collect();
    TensorData::new(ids, [batch, t])
}

/// A split model's forward (last-position logits): on one thread over a [`Collective`], or
/// by the ranks' threads.
pub(crate) type SplitForward<'f, B> = dyn FnMut(
        Vec<Tensor<B, 2, Int>>,
        &mut TensorParallelCache<B>,
    ) -> burn_slidesparse::Result<Tensor<B, 2>>
    + 'f;

/// [`Decoder`] for the split model.
pub(crate) struct SplitDecoder<B: SlideSparseBackend> {
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
