//! The CPU path's layers side by side: dense f32 (burn's NdArray matmul), dense INT8 and 6:8
//! INT8 on the integer kernel (`CpuInt8Layer`), per layer shape and token count, with the
//! weight bytes each forward reads over its time against the machine's plain-read bandwidth.
//!
//! `cargo run --release -p slidesparse-examples --example cpu_kernel -- [--model smollm2]
//!   [--m 1,16,128] [--reps 30]`
//!
//! Medians of `--reps` forwards after two warm-ups, the variants of a row timed alternately in
//! one process; ratios against dense f32 and dense INT8 of the same row.

use std::time::{Duration, Instant};

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    CpuInt8Layer, Isa, PackOptions, Precision, QuantizedWeight, SparsityPattern, pack_linear,
};
use clap::Parser;
use rand::{Rng, SeedableRng, rngs::StdRng};

type Error = Box<dyn std::error::Error>;

#[derive(Parser, Debug)]
struct Args {
    /// Layer shapes: `smollm2` (SmolLM2-135M: hidden 576, intermediate 1536, 3 KV heads) or
    /// `llama3-8b` (one block of Llama-3-8B).
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Token counts.
    #[arg(long, value_delimiter = ',', default_value = "1,16,128")]
    m: Vec<usize>,
    /// Timed forwards per variant.
    #[arg(long, default_value_t = 30)]
    reps: usize,
}

/// A layer shape: name, output and input features.
struct Shape {
    name: &'static str,
    n: usize,
    k: usize,
}

fn shapes(model: &str) -> Result<Vec<Shape>, Error> {
    let s = |name, n, k| Shape { name, n, k };
    match model {
        "smollm2" => Ok(vec![
            s("q/k/v", 960, 576),
            s("o", 576, 576),
            s("gate/up", 3072, 576),
            s("down", 576, 1536),
        ]),
        "llama3-8b" => Ok(vec![
            s("q/k/v", 6144, 4096),
            s("o", 4096, 4096),
            s("gate/up", 28672, 4096),
            s("down", 4096, 14336),
        ]),
        other => Err(format!("--model {other}: smollm2 or llama3-8b").into()),
    }
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let shapes = shapes(&args.model)?;
    let read = plain_read_gbs();
    println!(
        "CPU: {} threads, {:?} dot products; plain read {read:.1} GB/s ({} MiB buffer)\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        Isa::detect(),
        READ_BYTES >> 20
    );
    println!(
        "| layer | N x K | M | f32 ms | dense INT8 ms | 6:8 INT8 ms | 6:8 / f32 | 6:8 / INT8 | \
         6:8 GB/s | 6:8 of read |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rng = StdRng::seed_from_u64(7);
    for shape in &shapes {
        let (n, k) = (shape.n, shape.k);
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
        let (packed, _, _) = pack_linear("w", &w, n, k, None, &options)?;
        let sparse = CpuInt8Layer::sparse(packed.spec(), &packed.weight, None, None)?;
        let dense =
            CpuInt8Layer::dense(&QuantizedWeight::quantize(&w, n, k, Precision::Int8)?, None)?;
        let wt: Tensor<NdArray, 2> =
            Tensor::from_data(TensorData::new(w.clone(), [n, k]), &Default::default());
        let wt = wt.transpose();
        for &m in &args.m {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let xt: Tensor<NdArray, 2> =
                Tensor::from_data(TensorData::new(x.clone(), [m, k]), &Default::default());
            let mut times = [Vec::new(), Vec::new(), Vec::new()];
            for rep in 0..args.reps + 2 {
                let t = [
                    time(|| {
                        let _ = xt.clone().matmul(wt.clone()).into_data();
                    }),
                    time(|| {
                        let _ = dense.forward(&x, m);
                    }),
                    time(|| {
                        let _ = sparse.forward(&x, m);
                    }),
                ];
                if rep >= 2 {
                    for (all, t) in times.iter_mut().zip(t) {
                        all.push(t);
                    }
                }
            }
            let [f32_ms, int8_ms, sparse_ms] = times.map(median_ms);
            let bytes = sparse.weight_bytes() as f64;
            let gbs = bytes / (sparse_ms * 1e-3) / 1e9;
            println!(
                "| {} | {n} x {k} | {m} | {f32_ms:.3} | {int8_ms:.3} | {sparse_ms:.3} | {:.2} | \
                 {:.2} | {gbs:.1} | {:.0}% |",
                shape.name,
                f32_ms / sparse_ms,
                int8_ms / sparse_ms,
                100.0 * gbs / read
            );
        }
    }
    Ok(())
}

fn time(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

fn median_ms(mut t: Vec<Duration>) -> f64 {
    t.sort();
    t[t.len() / 2].as_secs_f64() * 1e3
}

/// Bytes of the plain-read buffer: far past the caches.
const READ_BYTES: usize = 512 << 20;

/// The machine's read bandwidth in GB/s: the median of 5 sums of a 512 MiB buffer of u64,
/// one share per thread.
fn plain_read_gbs() -> f64 {
    let buffer: Vec<u64> = (0..READ_BYTES / 8).map(|i| i as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = buffer.len().div_ceil(threads);
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for part in buffer.chunks(share) {
                scope.spawn(move || {
                    std::hint::black_box(part.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
                });
            }
        });
        times.push(start.elapsed());
    }
    READ_BYTES as f64 / (median_ms(times) * 1e-3) / 1e9
}
