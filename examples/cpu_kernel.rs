//! The CPU path's layers side by side: dense f32 (burn's NdArray matmul), dense INT8 and 6:8
//! INT8 on the integer kernel (`CpuInt8Layer`), per layer shape and token count, with the
//! weight bytes each forward reads over its time against the machine's plain-read bandwidth.
//!
//! `cargo run --release -p slidesparse-examples --example cpu_kernel -- [--model smollm2]
//!   [--m 1,16,128] [--reps 30]`
//!
//! Medians of `--reps` forwards after two warm-ups, the variants of a row timed alternately in
//! one process; ratios against dense f32 and dense INT8 of the same row.
//!
//! First, the memory each layer holds once prepared: the heap bytes a `SlideSparseLinear` /
//! `QuantizedLinear` on NdArray keeps alive after its first forward (module and prepared
//! weight together, counted by this program's allocator), against the f32 weight's bytes.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicIsize, Ordering},
    time::{Duration, Instant},
};

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    CpuInt8Layer, Isa, PackOptions, Precision, QuantizedLinear, QuantizedWeight, SlideSparseLinear,
    SparsityPattern, pack_linear,
};
use clap::Parser;
use rand::{Rng, SeedableRng, rngs::StdRng};

type Error = Box<dyn std::error::Error>;

/// The system allocator, counting the bytes live on the heap.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call goes to the system allocator with the caller's own arguments; the
// counter is only added to.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: `ptr` came from this allocator with `layout`; the caller's new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap bytes that `build` leaves alive (in what it returns: everything else it made is
/// dropped by then), with the value.
fn resident<T>(build: impl FnOnce() -> Result<T, Error>) -> Result<(T, usize), Error> {
    let before = LIVE.load(Ordering::Relaxed);
    let value = build()?;
    Ok((
        value,
        (LIVE.load(Ordering::Relaxed) - before).max(0) as usize,
    ))
}

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
    memory_table(&shapes)?;
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
        let quantized = QuantizedWeight::quantize(&w, n, k, Precision::Int8)?;
        let dense = CpuInt8Layer::dense(quantized.into(), None)?;
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

/// Each layer's resident bytes once prepared (module docs), and the block's total.
fn memory_table(shapes: &[Shape]) -> Result<(), Error> {
    type B = NdArray;
    let device = Default::default();
    let mut rng = StdRng::seed_from_u64(11);
    println!(
        "| layer | N x K | f32 MiB | dense INT8 MiB | 6:8 INT8 MiB | INT8 / f32 | 6:8 / f32 |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let mut total = [0usize; 3];
    // Whatever a first forward sets up once per process (rayon's pool, burn's device state)
    // is set up before anything is counted.
    let warm_up = QuantizedWeight::quantize(&[0.5; 64 * 64], 64, 64, Precision::Int8)?;
    let x = Tensor::<B, 2>::from_data(TensorData::new(vec![0.5f32; 64], [1, 64]), &device);
    QuantizedLinear::<B>::from_quantized_owned(warm_up, None, &device).try_forward(x)?;
    for shape in shapes {
        let (n, k) = (shape.n, shape.k);
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x = Tensor::<B, 2>::from_data(TensorData::new(vec![0.5f32; k], [1, k]), &device);
        let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
        let (sparse, sparse_bytes) = resident(|| {
            let (packed, _, _) = pack_linear("w", &w, n, k, None, &options)?;
            let layer = SlideSparseLinear::<B>::from_packed_owned(packed, &device);
            layer.try_forward(x.clone())?;
            Ok(layer)
        })?;
        let (dense, dense_bytes) = resident(|| {
            let quantized = QuantizedWeight::quantize(&w, n, k, Precision::Int8)?;
            let layer = QuantizedLinear::<B>::from_quantized_owned(quantized, None, &device);
            layer.try_forward(x.clone())?;
            Ok(layer)
        })?;
        let f32_bytes = 4 * n * k;
        for (t, b) in total.iter_mut().zip([f32_bytes, dense_bytes, sparse_bytes]) {
            *t += b;
        }
        println!(
            "| {} | {n} x {k} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |",
            shape.name,
            mib(f32_bytes),
            mib(dense_bytes),
            mib(sparse_bytes),
            dense_bytes as f64 / f32_bytes as f64,
            sparse_bytes as f64 / f32_bytes as f64
        );
        drop((sparse, dense));
    }
    let [f32_bytes, dense_bytes, sparse_bytes] = total;
    println!(
        "| block | | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |\n",
        mib(f32_bytes),
        mib(dense_bytes),
        mib(sparse_bytes),
        dense_bytes as f64 / f32_bytes as f64,
        sparse_bytes as f64 / f32_bytes as f64
    );
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
