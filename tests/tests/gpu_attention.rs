//! GPU tests of the flash-attention kernels against the CPU reference
//! (`causal_attention_reference` on NdArray, f32) on fresh random data: random shapes,
//! lengths that are not multiples of the 64-row tile, GQA ratios 1/4/8, a cached prefix,
//! decode over a cache longer than `kv_len`, rows that see a single key, large-magnitude
//! scores; plain `CubeBackend` and `Fusion` over it.
//!
//! The reference runs on the same 16-bit-rounded inputs. Tolerance per element:
//! `|gpu - ref| <= tol * (1 + |ref|)`, tol = 2e-2 for bf16 and 4e-3 for f16 (P and the output
//! are rounded to the 16-bit type: 2^-8 and 2^-11 relative). Needs an NVIDIA GPU of compute
//! capability 8.0+ (`#[ignore]`d; run with `--ignored` on the GPU host).
#![cfg(feature = "cuda")]

use burn::{
    backend::NdArray,
    tensor::{DType, Tensor, TensorData},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    AttentionOptions, causal_attention, causal_attention_reference,
    cuda::attention::{set_decode_waves, set_prefill_rows},
};
use cubecl::cuda::CudaRuntime;
use rand::Rng;
use slidesparse_tests::rng;

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type Fused = burn_fusion::Fusion<Gpu>;
type Cpu = NdArray;

fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 2e-2,
        _ => 4e-3,
    }
}

/// One case: shapes, cached positions in use and the scale of q and k (score magnitude).
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    tq: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    capacity: usize,
    kv_len: usize,
    magnitude: f32,
    dtype: DType,
}

struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn normal_ish(r: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (r.random_range(-1.0f32..1.0) + r.random_range(-1.0f32..1.0)) * scale)
        .collect()
}

impl Case {
    fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.tq, self.hq, self.d]
    }
    fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.capacity, self.hkv, self.d]
    }
    fn options(&self) -> AttentionOptions {
        AttentionOptions {
            kv_len: Some(self.kv_len),
            scale: None,
        }
    }
    fn data(&self, seed: u64) -> Data {
        let mut r = rng(seed);
        let nq = self.q_shape().iter().product();
        let nk = self.kv_shape().iter().product();
        Data {
            q: normal_ish(&mut r, nq, self.magnitude),
            k: normal_ish(&mut r, nk, self.magnitude),
            v: normal_ish(&mut r, nk, 1.0),
        }
    }
}

fn to_device<B: burn::tensor::backend::Backend>(
    values: &[f32],
    shape: [usize; 4],
    dtype: DType,
) -> Tensor<B, 4> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), shape),
        (&Default::default(), dtype),
    )
}

fn host<B: burn::tensor::backend::Backend>(t: Tensor<B, 4>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// The GPU result on backend `B` and the CPU reference on the same rounded inputs.
fn run<B: burn::tensor::backend::Backend>(case: Case, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let data = case.data(seed);
    let q = to_device::<B>(&data.q, case.q_shape(), case.dtype);
    let k = to_device::<B>(&data.k, case.kv_shape(), case.dtype);
    let v = to_device::<B>(&data.v, case.kv_shape(), case.dtype);
    let rounded = |t: &Tensor<B, 4>| to_device::<Cpu>(&host(t.clone()), t.dims(), DType::F32);
    let (qc, kc, vc) = (rounded(&q), rounded(&k), rounded(&v));
    let gpu = causal_attention(q, k, v, case.options()).expect("GPU attention");
    assert_eq!(gpu.dtype(), case.dtype);
    let expected = causal_attention_reference(qc, kc, vc, case.options()).unwrap();
    (host(gpu), host(expected))
}

fn check(case: Case, seed: u64, (got, expected): (Vec<f32>, Vec<f32>)) {
    let tol = tolerance(case.dtype);
    assert_eq!(got.len(), expected.len());
    let mut worst = (0.0f32, 0usize);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let excess = (g - e).abs() / (1.0 + e.abs());
        assert!(!g.is_nan(), "{case:?} seed {seed}: NaN at {i}");
        if excess > worst.0 {
            worst = (excess, i);
        }
    }
    let (excess, i) = worst;
    assert!(
        excess <= tol,
        "{case:?} seed {seed}: element {i}: gpu {} vs reference {} (scaled error {excess} > {tol})",
        got[i],
        expected[i]
    );
}

fn check_plain(case: Case, seed: u64) {
    check(case, seed, run::<Gpu>(case, seed));
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn prefill_matches_the_reference_on_random_shapes() {
    let mut r = rng(1);
    for i in 0..24u64 {
        let (hq, hkv) = [(4, 4), (8, 2), (16, 2), (8, 1)][i as usize % 4];
        let d = [64, 128][(i / 4) as usize % 2];
        let dtype = [DType::BF16, DType::F16][(i / 8) as usize % 2];
        let tq = r.random_range(17..300);
        // Every third case has a cached prefix (queries after `prefix` positions).
        let prefix = if i % 3 == 0 {
            r.random_range(1..200)
        } else {
            0
        };
        let kv_len = tq + prefix;
        let capacity = kv_len + if i % 2 == 0 { 0 } else { r.random_range(1..70) };
        let case = Case {
            batch: 1 + (i as usize % 3),
            tq,
            hq,
            hkv,
            d,
            capacity,
            kv_len,
            magnitude: 1.0,
            dtype,
        };
        check_plain(case, 100 + i);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn prefill_with_both_query_tiles_matches_the_reference() {
    // The 64- and 128-query CTAs (the process-wide choice is restored after).
    let mut r = rng(6);
    for rows in [128, 64] {
        set_prefill_rows(rows).unwrap();
        for i in 0..6u64 {
            let (hq, hkv) = [(8, 8), (8, 2), (16, 2)][i as usize % 3];
            let tq = r.random_range(20..400);
            let prefix = if i % 2 == 0 {
                r.random_range(1..150)
            } else {
                0
            };
            let case = Case {
                batch: 2,
                tq,
                hq,
                hkv,
                d: [64, 128][i as usize % 2],
                capacity: tq + prefix,
                kv_len: tq + prefix,
                magnitude: 1.0,
                dtype: [DType::BF16, DType::F16][(i / 2) as usize % 2],
            };
            check_plain(case, 600 + i + rows as u64);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn decode_matches_the_reference_over_long_caches() {
    let mut r = rng(2);
    for i in 0..20u64 {
        let (hq, hkv) = [(4, 4), (8, 2), (16, 2), (32, 4)][i as usize % 4];
        let d = [128, 64][(i / 4) as usize % 2];
        let dtype = [DType::BF16, DType::F16][(i / 8) as usize % 2];
        // 1 query, or a few (speculative decoding), as long as a group's rows fit 16.
        let tq = if i % 5 == 4 { 16 / (hq / hkv) } else { 1 };
        let kv_len = r.random_range(tq..9000);
        let capacity = kv_len + r.random_range(0..300);
        let case = Case {
            batch: [1, 3, 16][i as usize % 3],
            tq,
            hq,
            hkv,
            d,
            capacity,
            kv_len,
            magnitude: 1.0,
            dtype,
        };
        // Every split the waves give (each a different split count and length).
        for waves in [1, 4, 8] {
            set_decode_waves(waves).unwrap();
            check_plain(case, 200 + i);
        }
        set_decode_waves(1).unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn large_magnitude_scores_stay_finite_and_exact() {
    // q, k ~ 16x: scores in the hundreds (overflow without the running max).
    for (i, (tq, kv_len)) in [(130, 130), (1, 3000), (70, 200)].into_iter().enumerate() {
        for dtype in [DType::BF16, DType::F16] {
            let case = Case {
                batch: 2,
                tq,
                hq: 8,
                hkv: 2,
                d: 128,
                capacity: kv_len,
                kv_len,
                magnitude: 16.0,
                dtype,
            };
            check_plain(case, 300 + i as u64);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn a_row_that_sees_one_key_returns_that_value() {
    // Prefill from position 0: query 0 sees key 0 only, every other score of its row masked.
    let case = Case {
        batch: 1,
        tq: 100,
        hq: 8,
        hkv: 1,
        d: 64,
        capacity: 100,
        kv_len: 100,
        magnitude: 1.0,
        dtype: DType::BF16,
    };
    let data = case.data(400);
    let (got, _) = run::<Gpu>(case, 400);
    let v0 = host(to_device::<Gpu>(&data.v[..64], [1, 1, 1, 64], DType::BF16));
    for h in 0..8 {
        assert_eq!(&got[h * 64..][..64], &v0[..], "head {h}");
    }
    check(case, 400, run::<Gpu>(case, 400));
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn fused_backend_matches_the_reference() {
    for (i, (tq, kv_len)) in [(200, 260), (1, 5000)].into_iter().enumerate() {
        let case = Case {
            batch: 2,
            tq,
            hq: 32,
            hkv: 8,
            d: 128,
            capacity: kv_len,
            kv_len,
            magnitude: 1.0,
            dtype: DType::BF16,
        };
        check(case, 500 + i as u64, run::<Fused>(case, 500 + i as u64));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn inputs_the_kernels_do_not_cover_take_the_reference_path() {
    let mut r = rng(77);
    for (shape, dtype) in [([1, 6, 4, 64], DType::F32), ([2, 5, 4, 96], DType::BF16)] {
        let t = |r: &mut rand::rngs::StdRng| {
            to_device::<Gpu>(&normal_ish(r, shape.iter().product(), 1.0), shape, dtype)
        };
        let (q, k, v) = (t(&mut r), t(&mut r), t(&mut r));
        let options = AttentionOptions::default();
        let got = causal_attention(q.clone(), k.clone(), v.clone(), options)
            .unwrap_or_else(|e| panic!("{dtype:?} {shape:?}: {e}"));
        let want = burn_slidesparse::causal_attention_reference(q, k, v, options).unwrap();
        assert_eq!(host(got), host(want), "{dtype:?} {shape:?}");
    }
}
