//! `slidesparse-bench`: GPU benchmarks (feature `cuda`), run on the GPU host.
//!
//! `slidesparse-bench gemm`: our cached-plan cuSPARSELt GEMM at K' against cuBLASLt dense at
//! K, for the Llama-3-8B and Qwen2.5-7B block shapes (sum over qkv, o, gate_up, down), every
//! M, precision and pattern, timed with CUDA events per call (median of `--reps`), inputs
//! rotated beyond the 60 MB L2. Prints a markdown table of dense/sparse ratios and writes
//! JSON with `--json`.

use std::{collections::BTreeMap, time::Instant};

use burn::tensor::DType;
use burn_slidesparse::{
    Precision, SparsityPattern,
    cuda::{
        accumulator::Accumulator,
        cublaslt::{DenseShape, WORKSPACE},
        cusparselt::{self, GemmPointers, GemmShape, MatDescriptor},
        state::{DeviceState, device_state},
    },
    internals::format::f32_bytes,
};
use clap::Parser;
use cudarc::driver::{result as cu, sys};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rayon::prelude::*;

mod attention;
mod decode;
mod fusion;
mod host;
mod layer;
mod quant;

#[derive(Parser)]
struct Args {
    /// `gemm` (GEMM only, sparse vs dense), `layer` (whole layers and their stages),
    /// `quant` (the quant+lift kernel's layouts alone, each checked against the row-staged
    /// kernel's codes), `host` (the host cost of each piece of a decode forward) or `decode`
    /// (a whole block at decode sizes: wall time and device time with the host taken out) or
    /// `fusion` (whole layers on burn's fusion backend against the plain backend).
    mode: String,
    #[arg(long, default_value = "16,256,1024,4096,16384")]
    m: String,
    #[arg(long, default_value = "int8,fp8,bf16")]
    precisions: String,
    #[arg(long, default_value = "2:4,4:6,6:8,8:10")]
    patterns: String,
    #[arg(long, default_value = "llama3-8b,qwen2.5-7b")]
    models: String,
    #[arg(long, default_value_t = 50)]
    reps: usize,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Quant mode: row lengths K to time.
    #[arg(long, default_value = "3584,4096,14336,18944")]
    k: String,
    /// Quant mode: cube sizes of the grouped kernel to try (`default`: the launcher's choice).
    #[arg(long, default_value = "default")]
    units: String,
    /// Quant mode: rows per cube of the grouped kernel to try.
    #[arg(long, default_value = "1,2,4,8")]
    rows: String,
}

/// (name, [(N, K)] of qkv, o, gate_up, down).
fn model_shapes(name: &str) -> Vec<(usize, usize)> {
    match name {
        "llama3-8b" => vec![(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
        "qwen2.5-7b" => vec![(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
        other => panic!("unknown model {other}: llama3-8b or qwen2.5-7b"),
    }
}

/// A device buffer from `cuMemAlloc` (the benchmark owns its memory directly).
struct Buf(sys::CUdeviceptr);
impl Buf {
    fn new(bytes: usize) -> Self {
        Self(unsafe { cu::malloc_sync(bytes.max(256)) }.expect("cuMemAlloc"))
    }
    fn upload(bytes: &[u8]) -> Self {
        let b = Self::new(bytes.len());
        unsafe { cu::memcpy_htod_sync(b.0, bytes) }.expect("cuMemcpyHtoD");
        b
    }
}
impl Drop for Buf {
    fn drop(&mut self) {
        unsafe {
            let _ = cu::free_sync(self.0);
        }
    }
}

/// Random codes of a precision (no NaN codes), `count` elements, as bytes.
fn random_codes(count: usize, precision: Precision, seed: u64) -> Vec<u8> {
    let bytes = precision.element_bytes();
    let mut out = vec![0u8; count * bytes];
    out.par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9));
            match precision {
                Precision::Int8 => chunk
                    .iter_mut()
                    .for_each(|b| *b = rng.random_range(-100i8..=100) as u8),
                Precision::Fp8 => chunk.iter_mut().for_each(|b| {
                    *b = burn_slidesparse::internals::fp8::f32_to_e4m3(
                        rng.random_range(-4.0f32..4.0),
                    )
                }),
                _ => chunk.chunks_exact_mut(2).for_each(|c| {
                    let v = half::bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes();
                    c.copy_from_slice(&v)
                }),
            }
        });
    out
}

/// Zeroes 2 of every 4 elements along K' (rows of length `k`), at random lanes: a valid 2:4.
fn make_2_4(codes: &mut [u8], k: usize, elem: usize, seed: u64) {
    codes
        .par_chunks_mut(k * elem)
        .enumerate()
        .for_each(|(r, row)| {
            let mut rng = StdRng::seed_from_u64(seed + r as u64);
            for group in row.chunks_mut(4 * elem) {
                let keep_a = rng.random_range(0..4);
                let keep_b = (keep_a + rng.random_range(1..4)) % 4;
                for (lane, e) in group.chunks_mut(elem).enumerate() {
                    if lane != keep_a && lane != keep_b {
                        e.fill(0);
                    }
                }
            }
        });
}

struct Events {
    start: Vec<sys::CUevent>,
    end: Vec<sys::CUevent>,
}
impl Events {
    fn new(n: usize) -> Self {
        let mk = || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).expect("event");
        Self {
            start: (0..n).map(|_| mk()).collect(),
            end: (0..n).map(|_| mk()).collect(),
        }
    }
    /// Median milliseconds of `f(i)` over the events, after `warmup` untimed calls.
    fn median_ms(&self, stream: sys::CUstream, warmup: usize, mut f: impl FnMut(usize)) -> f64 {
        for i in 0..warmup {
            f(i);
        }
        for i in 0..self.start.len() {
            unsafe { cu::event::record(self.start[i], stream) }.unwrap();
            f(i);
            unsafe { cu::event::record(self.end[i], stream) }.unwrap();
        }
        unsafe { cu::stream::synchronize(stream) }.unwrap();
        let mut t: Vec<f64> = (0..self.start.len())
            .map(|i| unsafe { cu::event::elapsed(self.start[i], self.end[i]) }.unwrap() as f64)
            .collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }
}

/// A random valid 2:4 weight `[n, k_prime]` of `precision`, compressed for cuSPARSELt.
fn compressed_2_4_weight(st: &DeviceState, n: usize, k_prime: usize, precision: Precision) -> Buf {
    let mut codes = random_codes(n * k_prime, precision, 2);
    make_2_4(&mut codes, k_prime, precision.element_bytes(), 3);
    let w = Buf::upload(&codes);
    let desc = MatDescriptor::structured(&st.lt, k_prime, n, precision).unwrap();
    let sizes = cusparselt::compressed_sizes(&st.lt, &desc).unwrap();
    let (comp, buf) = (Buf::new(sizes.compressed), Buf::new(sizes.buffer));
    // SAFETY: buffers of the sizes cuSPARSELt asked for, alive until the sync below.
    unsafe { cusparselt::compress(&st.lt, &desc, w.0, comp.0, buf.0, st.stream as _).unwrap() };
    st.synchronize().unwrap();
    desc.destroy(&st.lt).unwrap();
    comp
}

/// Runs `MatmulSearch` on our stream for a shape whose bucket has no remembered algorithm.
fn search_if_needed(st: &mut DeviceState, shape: GemmShape, p: GemmPointers, workspace: u64) {
    if st.needs_search(&shape) {
        let (lt, stream) = (&st.lt as *const _, st.stream);
        let plan = st.plan(shape).unwrap();
        // SAFETY: `lt` outlives this call; plan and handle are distinct fields; the buffers
        // of `p` and the workspace are live.
        let id = unsafe { plan.search(&*lt, p, workspace, stream as _) }.unwrap();
        st.remember(&shape, id);
    }
}

/// Workspace for cuSPARSELt search and runs.
const SPARSE_WORKSPACE: usize = 256 << 20;

/// Number of activation buffers to rotate so that they exceed the L2 (60 MB) twice
/// (at least `min`, at most 8 buffers).
fn rotation(bytes: usize, min: usize) -> usize {
    120_000_000usize.div_ceil(bytes.max(1)).clamp(min, 8)
}

fn main() {
    let args = Args::parse();
    match args.mode.as_str() {
        "gemm" => gemm_bench(&args),
        "layer" => layer::layer_bench(&args),
        "quant" => quant::quant_bench(&args),
        "host" => host::host_bench(&args),
        "decode" => decode::decode_bench(&args),
        "fusion" => fusion::fusion_bench(&args),
        "attention" => attention::attention_bench(&args),
        other => panic!("unknown mode {other}: gemm, layer, quant, host, decode or fusion"),
    }
}

/// Markdown table cells `"{name} {suffix}"` for each name, joined by ` | `.
fn column_names(names: &[String], suffix: &str) -> String {
    names
        .iter()
        .map(|n| format!("{n} {suffix}"))
        .collect::<Vec<_>>()
        .join(" | ")
}

fn parse_list(s: &str) -> Vec<String> {
    s.split(',').map(str::trim).map(String::from).collect()
}

/// Parses a comma-separated list.
fn parse_all<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, T::Err> {
    parse_list(s).into_iter().map(|v| v.parse()).collect()
}

/// The M values, precisions and patterns a run sweeps over.
fn sweep(args: &Args) -> (Vec<usize>, Vec<Precision>, Vec<SparsityPattern>) {
    (
        parse_all(&args.m).expect("--m: comma-separated integers"),
        parse_all(&args.precisions).expect("--precisions: int8, fp8, bf16, f16"),
        parse_all(&args.patterns).expect("--patterns: 2:4, 4:6, 6:8, ..."),
    )
}

fn gemm_bench(args: &Args) {
    let (ms, precisions, patterns) = sweep(args);
    let state = device_state(0).expect("GPU state");
    let mut st = state.lock().unwrap();
    st.make_current().unwrap();
    let stream = st.stream;
    let events = Events::new(args.reps);
    let workspace = Buf::new(SPARSE_WORKSPACE.max(WORKSPACE));
    println!(
        "GPU: {}, cuSPARSELt {}",
        st.gpu_name,
        cusparselt::result::version_string(st.lt.version)
    );
    // results[(model, precision, M)] = (dense ms, [sparse ms per pattern])
    let mut results: BTreeMap<(String, String, usize), (f64, Vec<f64>)> = BTreeMap::new();
    let started = Instant::now();
    for model in parse_list(&args.models) {
        for &(n, k) in &model_shapes(&model) {
            for &precision in &precisions {
                let elem = precision.element_bytes();
                // The GEMMs of an f32 layer (exact INT32 / FP32 accumulators).
                let (sparse_acc, dense_acc) = (
                    Accumulator::sparse(precision, DType::F32),
                    Accumulator::dense(precision, DType::F32),
                );
                let out_bytes = sparse_acc.bytes().max(dense_acc.bytes());
                // Alpha vector of the INT8 sparse GEMM (weight scales; ones here).
                let alpha = Buf::upload(&f32_bytes(&vec![1.0; n]));
                let dense_w = Buf::upload(&random_codes(n * k, precision, 1));
                // Sparse weights per pattern, compressed once.
                let mut sparse_w = Vec::new();
                for &pattern in &patterns {
                    let kp = pattern.geometry(k, 64).k_prime();
                    sparse_w.push((kp, compressed_2_4_weight(&st, n, kp, precision)));
                }
                for &m in &ms {
                    let m_pad = m.next_multiple_of(16);
                    let kmax = sparse_w.iter().map(|(kp, _)| *kp).max().unwrap_or(k).max(k);
                    let x_bytes = m_pad * kmax * elem;
                    let rot = rotation(x_bytes, 1);
                    let xs: Vec<Buf> = (0..rot)
                        .map(|i| Buf::upload(&random_codes(m_pad * kmax, precision, 10 + i as u64)))
                        .collect();
                    let out = Buf::new(m_pad * n * out_bytes);
                    let dshape = DenseShape {
                        m_pad,
                        n,
                        k,
                        precision,
                        accumulator: dense_acc,
                    };
                    let dense_ms = {
                        let dense = st.dense_gemm().unwrap();
                        events.median_ms(stream, 5, |i| unsafe {
                            dense
                                .run(
                                    dshape,
                                    dense_w.0,
                                    xs[i % rot].0,
                                    out.0,
                                    workspace.0,
                                    stream as _,
                                )
                                .unwrap()
                        })
                    };
                    let mut sparse_ms = Vec::new();
                    for (kp, comp) in &sparse_w {
                        let shape = GemmShape {
                            m_pad,
                            n_pad: n,
                            k_prime: *kp,
                            precision,
                            accumulator: sparse_acc,
                        };
                        let p = GemmPointers {
                            weight: comp.0,
                            act: xs[0].0,
                            out: out.0,
                            alpha: alpha.0,
                        };
                        search_if_needed(&mut st, shape, p, workspace.0);
                        let lt = &st.lt as *const _;
                        let plan = st.plan(shape).unwrap();
                        assert!(
                            plan.workspace <= SPARSE_WORKSPACE,
                            "workspace {} too large",
                            plan.workspace
                        );
                        sparse_ms.push(events.median_ms(stream, 5, |i| unsafe {
                            plan.run(
                                &*lt,
                                GemmPointers {
                                    weight: comp.0,
                                    act: xs[i % rot].0,
                                    out: out.0,
                                    alpha: alpha.0,
                                },
                                workspace.0,
                                stream as _,
                            )
                            .unwrap()
                        }));
                    }
                    let e = results
                        .entry((model.clone(), precision.to_string(), m))
                        .or_insert((0.0, vec![0.0; patterns.len()]));
                    e.0 += dense_ms;
                    e.1.iter_mut().zip(&sparse_ms).for_each(|(a, b)| *a += b);
                    eprintln!(
                        "[{:>5.0}s] {model} {n}x{k} {precision} M={m}: dense {dense_ms:.4} ms, sparse {:?}",
                        started.elapsed().as_secs_f64(),
                        sparse_ms
                            .iter()
                            .map(|v| format!("{v:.4}"))
                            .collect::<Vec<_>>()
                    );
                }
            }
        }
    }
    let header: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
    println!(
        "\n| model | precision | M | dense ms | {} |",
        header.join(" | ")
    );
    println!("|---|---|---|---|{}", "---|".repeat(patterns.len()));
    let mut json = Vec::new();
    for ((model, precision, m), (dense, sparse)) in &results {
        let ratios: Vec<String> = sparse.iter().map(|s| format!("{:.2}", dense / s)).collect();
        println!(
            "| {model} | {precision} | {m} | {dense:.3} | {} |",
            ratios.join(" | ")
        );
        json.push(serde_json::json!({
            "model": model, "precision": precision, "m": m, "dense_ms": dense,
            "sparse_ms": header.iter().cloned().zip(sparse.iter().cloned()).collect::<BTreeMap<_, _>>(),
        }));
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    }
}
