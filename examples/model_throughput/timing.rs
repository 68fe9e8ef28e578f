//! Timing one model: prefill and decode workloads, medians, two models timed alternately.

use std::{collections::BTreeMap, time::Instant};

use burn::tensor::{Distribution, Int, Tensor, backend::Backend};
use burn_slidesparse::{
    DecodeGraph, SlideSparseBackend,
    cuda::{memory::graph_report, profiler::profiler_range},
};
use slidesparse_examples::llama::{KvCache, Llama};

use crate::args::{Args, list};

pub(crate) fn random_tokens<B: Backend>(
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

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Ms of one prefill of `tokens` (a fresh KV cache, synced).
pub(crate) fn prefill_once<B: SlideSparseBackend>(
    model: &Llama<B>,
    tokens: &Tensor<B, 2, Int>,
) -> f64 {
    let device = Default::default();
    let start = Instant::now();
    let mut cache = KvCache::with_capacity(tokens.dims()[1]);
    let _ = model.forward_last(tokens.clone(), &mut cache);
    B::sync(&device).unwrap();
    drop(cache);
    start.elapsed().as_secs_f64() * 1e3
}

/// Median ms of a prefill of `t` tokens.
pub(crate) fn prefill_ms<B: SlideSparseBackend>(
    model: &Llama<B>,
    t: usize,
    vocab: usize,
    reps: usize,
) -> f64 {
    let tokens = random_tokens::<B>(1, t, vocab, &Default::default());
    prefill_once(model, &tokens);
    median((0..reps).map(|_| prefill_once(model, &tokens)).collect())
}

/// A decode workload on one model: batch `b` with `context` tokens per sequence in the cache
/// (prefilled once), and the tokens of `steps` single-token steps.
pub(crate) struct Decoder<'m, B: SlideSparseBackend> {
    model: &'m Llama<B>,
    cache: KvCache<B>,
    tokens: Vec<Tensor<B, 2, Int>>,
    context: usize,
}

impl<'m, B: SlideSparseBackend> Decoder<'m, B> {
    pub(crate) fn new(
        model: &'m Llama<B>,
        (b, context): (usize, usize),
        steps: usize,
        vocab: usize,
    ) -> Self {
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
    pub(crate) fn run(&mut self, host: bool) -> f64 {
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

impl<B: SlideSparseBackend> Decoder<'_, B> {
    /// [`run`](Self::run) with the model's decode step replayed as one CUDA graph
    /// (`Llama::decode_graph`, built once over the prefilled cache): with an INT8 head the
    /// steps chain on the device (each step's argmax is the next one's token); with a bf16
    /// head each step sets its token and the head runs on the graph's output, as the
    /// operations' step computes its logits.
    fn run_graph(&mut self, graph: &mut DecodeGraph<B>, host: bool) -> f64 {
        let device = Default::default();
        let start = Instant::now();
        let mut queued = 0.0;
        let chained = graph.has_head();
        for (s, tokens) in self.tokens.iter().enumerate() {
            let t0 = Instant::now();
            if s == 0 || !chained {
                graph
                    .set(self.context + s, &host_tokens(tokens))
                    .expect("set the step's tokens");
            }
            graph.step().expect("decode graph step");
            if !chained {
                let hidden = graph.hidden().expect("the step's output");
                let _ = self.model.lm_head.forward(hidden);
            }
            queued += t0.elapsed().as_secs_f64();
            if host {
                B::sync(&device).unwrap();
            }
        }
        B::sync(&device).unwrap();
        let total = start.elapsed().as_secs_f64();
        1e3 / self.tokens.len() as f64 * if host { queued } else { total }
    }
}

/// A `[b, 1]` token tensor's ids on the host (read once, before timing).
fn host_tokens<B: Backend>(tokens: &Tensor<B, 2, Int>) -> Vec<u32> {
    tokens
        .to_data()
        .convert::<i64>()
        .into_vec::<i64>()
        .expect("int tokens")
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

/// [`decode_ms`] with the decode step as one CUDA graph: `None` where the model's step has
/// no graph (the reason printed).
pub(crate) fn decode_graph_ms<B: SlideSparseBackend>(
    model: &Llama<B>,
    (b, context): (usize, usize),
    steps: usize,
    vocab: usize,
    reps: usize,
) -> Option<(f64, f64, usize)> {
    let mut decoder = Decoder::new(model, (b, context), steps, vocab);
    let mut graph = match model.decode_graph(&decoder.cache) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("decode graph: not for this model or batch: {e}");
            return None;
        }
    };
    let launches = graph.launches_per_step().unwrap_or(0);
    decoder.run_graph(&mut graph, false);
    let device_ms = median(
        (0..reps)
            .map(|_| decoder.run_graph(&mut graph, false))
            .collect(),
    );
    let host_ms = median(
        (0..reps.min(3))
            .map(|_| decoder.run_graph(&mut graph, true))
            .collect(),
    );
    Some((device_ms, host_ms, launches))
}

/// Median ms per decode step at batch `b` with `context` tokens per sequence in the cache
/// (each run decodes `steps` tokens back to back and rewinds the cache to the context), and
/// the host's ms per step (the time to queue a step when the device is idle). With
/// `profile`, one more step runs inside a profiler range.
pub(crate) fn decode_ms<B: SlideSparseBackend>(
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

/// Medians of `reps` runs of `a` and of `b` taken in turn (`a`, `b`, `a`, ...), after one
/// warm-up run of each.
pub(crate) fn alternate(
    reps: usize,
    mut a: impl FnMut() -> f64,
    mut b: impl FnMut() -> f64,
) -> (f64, f64) {
    a();
    b();
    let (mut xa, mut xb) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        xa.push(a());
        xb.push(b());
    }
    (median(xa), median(xb))
}

/// Every workload of `args` on `model`, into `results` under `name`.
pub(crate) fn measure<B: SlideSparseBackend>(
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
        if args.decode_graph
            && let Some((ms, host, launches)) =
                decode_graph_ms(model, (b, args.context), args.steps, vocab, args.reps)
        {
            eprintln!(
                "{name}/graph: decode batch {b}: {ms:.3} ms/step ({:.0} tok/s), host {host:.3} ms/step, {launches} launches a step",
                b as f64 / ms * 1e3
            );
            let graph = format!("{name}/graph");
            results.insert((graph.clone(), format!("decode {b}")), ms);
            results.insert((graph, format!("host {b}")), host);
        }
    }
}
