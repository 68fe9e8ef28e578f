//! `slidesparse-bench host`: where the host time of a decode forward goes.
//!
//! At decode both pipelines are bound by host work (the whole-layer table: host enqueue
//! time = wall time). This mode times, for one layer of each model at small M, every piece
//! a forward is made of, each repeated back to back: the caller's time per call before the
//! final sync ("enqueue") and the wall time per call including it ("wall"), median of 7
//! batches of `--reps` calls. Nothing here is a GPU-time measurement: the kernels are tiny.

use std::time::Instant;

use burn::{
    nn::LinearConfig,
    tensor::{DType, Distribution, Tensor, backend::Backend},
};
use burn_slidesparse::{
    PackOptions, Precision, SlideSparseLinear, SparsityPattern,
    cuda::{
        DenseLayerGpu, GraphMode,
        accumulator::Accumulator,
        buffers::ForwardBuffer,
        cublaslt::{DenseShape, WORKSPACE},
        cusparselt::{self, GemmPointers, GemmShape},
        gemm::{GemmBuffers, LayerGemm},
        launch::{launch_epilogue, launch_quant_lift},
        pipeline::m_pad,
        state::{device_state, update_settings},
    },
    internals::weight_quant::quantize_weight,
    pack_linear,
};
use cubecl::{CubeCount, CubeDim, Runtime, cuda::CudaRuntime, prelude::*};
use cubecl_kernels::stream_probe::probe_kernel;

use super::{
    Args, Buf, SPARSE_WORKSPACE, compressed_2_4_weight, layer::Gpu, model_shapes, parse_list,
    random_codes, search_if_needed, sweep,
};

/// Median (enqueue, wall) microseconds per call of `f` run `reps` times back to back.
fn per_call_us(reps: usize, mut f: impl FnMut(usize), mut sync: impl FnMut()) -> (f64, f64) {
    for i in 0..reps.min(20) {
        f(i);
    }
    sync();
    let mut enqueue = Vec::new();
    let mut wall = Vec::new();
    for _ in 0..7 {
        let start = Instant::now();
        for i in 0..reps {
            f(i);
        }
        enqueue.push(start.elapsed().as_secs_f64() * 1e6 / reps as f64);
        sync();
        wall.push(start.elapsed().as_secs_f64() * 1e6 / reps as f64);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(enqueue), median(wall))
}

pub fn host_bench(args: &Args) {
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let (ms, _, _) = sweep(args);
    let precision = Precision::Int8;
    let pattern = SparsityPattern::P6_8;
    let sync = || Gpu::sync(&device).unwrap();
    let reps = args.reps;
    println!("| model | shape | M | piece | enqueue us/call | wall us/call |");
    println!("|---|---|---|---|---|---|");
    for model in parse_list(&args.models) {
        let (n, k) = model_shapes(&model)[0];
        let w = super::layer::random_weight(n, k, 1);
        let dense = DenseLayerGpu::new(&client, 0, &quantize_weight(&w, n, k, precision), None)
            .expect("dense layer");
        let (packed, _, _) =
            pack_linear("w", &w, n, k, None, &PackOptions::new(pattern, precision)).expect("pack");
        let sparse = SlideSparseLinear::<Gpu>::from_packed(&packed, &device);
        let prepared = sparse.prepared().expect("prepare");
        let prepared = prepared.native().expect("a CUDA layer");
        let bf16_linear = LinearConfig::new(k, n)
            .with_bias(false)
            .init::<Gpu>(&device);
        let g = pattern.geometry(k, 64);
        for &m in &ms {
            let mp = m_pad(m, precision);
            let x = Tensor::<Gpu, 2>::random([m, k], Distribution::Uniform(-1.0, 1.0), &device);
            let prim = x.clone().into_primitive().tensor();
            // What the layer's GEMM writes (cuSPARSELt: bf16 with the weight scales; the compact
            // GEMM past decode sizes: the finished output, no epilogue kernel).
            let accumulator = prepared.gemm.accumulator(precision, DType::BF16, m);
            let codes = client.empty(mp * g.k_prime());
            let scales = client.empty(mp * 4);
            let acc = client.empty(mp * prepared.n_pad * accumulator.bytes());
            let out = client.empty(m * n * 2);
            let sw = client.empty(n * 4);
            let flag = client.empty(4);
            let mut rows: Vec<(&str, (f64, f64))> = Vec::new();
            rows.push((
                "cubecl: 4 x empty",
                per_call_us(
                    reps,
                    |_| {
                        let _ = [16usize, 64, 128, 256].map(|b| client.empty(b * m.max(1)));
                    },
                    sync,
                ),
            ));
            rows.push((
                "cubecl: exclusive(no-op)",
                per_call_us(reps, |_| client.exclusive(|| ()).unwrap(), sync),
            ));
            rows.push((
                "cubecl: 1-thread kernel launch",
                per_call_us(
                    reps,
                    |i| unsafe {
                        probe_kernel::launch_unchecked::<CudaRuntime>(
                            &client,
                            CubeCount::Static(1, 1, 1),
                            CubeDim::new_1d(1),
                            ArrayArg::from_raw_parts(flag.clone(), 1),
                            i as u32,
                        );
                    },
                    sync,
                ),
            ));
            rows.push((
                "burn: x + 1 (one elementwise op)",
                per_call_us(
                    reps,
                    |_| {
                        let _ = x.clone().add_scalar(1.0);
                    },
                    sync,
                ),
            ));
            rows.push((
                "quant+lift launch",
                per_call_us(
                    reps,
                    |_| {
                        launch_quant_lift(
                            &client,
                            &prim.handle,
                            &codes,
                            &scales,
                            (m, mp, k, g.k_slide(), g.k_prime()),
                            g.n,
                            precision,
                            DType::BF16,
                        )
                        .unwrap()
                    },
                    sync,
                ),
            ));
            if !accumulator.finished {
                rows.push((
                    "epilogue launch",
                    per_call_us(
                        reps,
                        |_| {
                            launch_epilogue(
                                &client,
                                &acc,
                                &scales,
                                &sw,
                                None,
                                &out,
                                (m, mp, n, prepared.n_pad),
                                accumulator,
                                DType::BF16,
                            )
                            .unwrap()
                        },
                        sync,
                    ),
                ));
            }
            let buffer = |handle: &cubecl::server::Handle, kept: bool| ForwardBuffer {
                handle: handle.clone(),
                kept_ptr: kept.then(|| {
                    client
                        .get_resource(handle.clone())
                        .expect("pointer")
                        .resource()
                        .ptr
                }),
            };
            let state = device_state(0).expect("GPU state");
            for (piece, kept, queued) in [
                ("sparse GEMM, pointers per call (direct call)", false, false),
                (
                    "sparse GEMM, kept buffers (CUDA graph, blocking)",
                    true,
                    false,
                ),
                ("sparse GEMM, kept buffers (CUDA graph, queued)", true, true),
            ] {
                let mode = if queued {
                    GraphMode::Queued
                } else {
                    GraphMode::Blocking
                };
                update_settings(0, |s| s.graphs = mode).expect("GPU state");
                let (codes, acc) = (buffer(&codes, kept), buffer(&acc, kept));
                let scales = buffer(&scales, kept);
                rows.push((
                    piece,
                    per_call_us(
                        reps,
                        |_| {
                            let mut state = state.lock().unwrap();
                            state.make_current().unwrap();
                            let buffers = GemmBuffers {
                                codes: &codes,
                                acc: &acc,
                                token_scales: &scales,
                                rows: m,
                            };
                            let gemm = &prepared.gemm;
                            gemm.run(&client, &mut state, mp, accumulator, buffers)
                                .unwrap()
                        },
                        sync,
                    ),
                ));
            }
            let lt_accumulator = Accumulator::sparse(precision, DType::BF16);
            let (lib_sparse, lib_dense) =
                library_calls(reps, n, g.k_prime(), k, mp, lt_accumulator);
            rows.push(("cusparseLtMatmul alone (caller thread)", lib_sparse));
            rows.push(("cublasLtMatmul alone (caller thread)", lib_dense));
            for (graphs, queued, sparse_piece, dense_piece) in [
                (
                    false,
                    false,
                    "SlideSparse forward 6:8, graphs off",
                    "dense forward, graphs off",
                ),
                (
                    true,
                    false,
                    "SlideSparse forward 6:8, graphs blocking",
                    "dense forward, graphs blocking",
                ),
                (true, true, "SlideSparse forward 6:8", "dense forward"),
            ] {
                let mode = match (graphs, queued) {
                    (false, _) => GraphMode::Off,
                    (true, false) => GraphMode::Blocking,
                    (true, true) => GraphMode::Queued,
                };
                update_settings(0, |s| s.graphs = mode).expect("GPU state");
                rows.push((
                    sparse_piece,
                    per_call_us(
                        reps,
                        |_| {
                            let _ = sparse.forward(x.clone());
                        },
                        sync,
                    ),
                ));
                rows.push((
                    dense_piece,
                    per_call_us(
                        reps,
                        |_| {
                            let _ = dense.forward(&prim).unwrap();
                        },
                        sync,
                    ),
                ));
            }
            rows.push((
                "burn bf16 nn::Linear",
                per_call_us(
                    reps,
                    |_| {
                        let _ = bf16_linear.forward(x.clone());
                    },
                    sync,
                ),
            ));
            for (piece, (enqueue, wall)) in rows {
                println!("| {model} | {n}x{k} | {m} | {piece} | {enqueue:.1} | {wall:.1} |");
            }
        }
    }
}

/// Host cost of the two library GEMM calls alone, on our own stream from this thread:
/// (cuSPARSELt at K', cuBLASLt at K), each (enqueue, wall) us per call.
fn library_calls(
    reps: usize,
    n: usize,
    k_prime: usize,
    k: usize,
    m_pad: usize,
    accumulator: Accumulator,
) -> ((f64, f64), (f64, f64)) {
    let precision = Precision::Int8;
    let state = device_state(0).expect("GPU state");
    let mut st = state.lock().unwrap();
    st.make_current().unwrap();
    let stream = st.stream;
    let sync = || unsafe { cudarc::driver::result::stream::synchronize(stream) }.unwrap();
    let workspace = Buf::new(SPARSE_WORKSPACE.max(WORKSPACE));
    let alpha = Buf::upload(&burn_slidesparse::internals::format::f32_bytes(&vec![
        1.0;
        n
    ]));
    let x = Buf::upload(&random_codes(m_pad * k_prime.max(k), precision, 5));
    let out = Buf::new(m_pad * n * 4);
    let comp = compressed_2_4_weight(&st, n, k_prime, precision);
    let shape = GemmShape {
        m_pad,
        n_pad: n,
        k_prime,
        precision,
        accumulator,
    };
    let p = GemmPointers {
        weight: comp.0,
        act: x.0,
        out: out.0,
        alpha: alpha.0,
    };
    search_if_needed(&mut st, shape, p, workspace.0);
    let lt = &st.lt as *const _;
    let plan = st.plan(shape).unwrap() as *const cusparselt::SparsePlan;
    // SAFETY: live buffers of the plan's sizes; the plan and handle outlive the calls.
    let sparse = per_call_us(
        reps,
        |_| unsafe { (*plan).run(&*lt, p, workspace.0, stream as _).unwrap() },
        sync,
    );
    let dense_w = Buf::upload(&random_codes(n * k, precision, 1));
    let dshape = DenseShape {
        m_pad,
        n,
        k,
        precision,
        accumulator: Accumulator::dense(precision, DType::BF16),
    };
    let gemm = st.dense_gemm().unwrap();
    // SAFETY: as above.
    let dense = per_call_us(
        reps,
        |_| unsafe {
            gemm.run(dshape, dense_w.0, x.0, out.0, workspace.0, stream as _)
                .unwrap()
        },
        sync,
    );
    (sparse, dense)
}
