//! GPU tests of the block steps of `block_ops` (RMSNorm with the residual add, the SiLU-gated
//! product, RoPE + cache write + attention) against their CPU reference (NdArray, f32) on
//! fresh random data and the same 16-bit-rounded inputs: bf16 and f16, plain `CubeBackend`
//! and `Fusion` over it, a prompt then decode steps written into one cache in place.
//!
//! Tolerance per element `|gpu - ref| <= tol * (1 + |ref|)`: tol = 2e-2 for bf16, 4e-3 for
//! f16 (one 16-bit rounding of the output, plus the attention's P rounding). Needs an NVIDIA
//! GPU of compute capability 8.0+ (`#[ignore]`d; run with `--ignored` on the GPU host).
#![cfg(feature = "cuda")]

use burn::{
    backend::NdArray,
    module::Param,
    nn::{RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig},
    tensor::{DType, Tensor, TensorData, backend::Backend},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{RopeAttention, add_rms_norm, rms_norm, rope_attention, silu_mul};
use cubecl::cuda::CudaRuntime;
use rand::Rng;
use slidesparse_tests::rng;

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type Fused = burn_fusion::Fusion<Gpu>;
type Cpu = NdArray;

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
}

fn tensor<B: Backend, const N: usize>(
    data: &[f32],
    shape: [usize; N],
    dtype: DType,
) -> Tensor<B, N> {
    Tensor::from_data(
        TensorData::new(data.to_vec(), shape),
        (&Default::default(), dtype),
    )
}

fn host<B: Backend, const N: usize>(t: Tensor<B, N>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// The same values on the CPU in f32 (the GPU tensor's 16-bit rounding included).
fn on_cpu<B: Backend, const N: usize>(t: &Tensor<B, N>) -> Tensor<Cpu, N> {
    tensor::<Cpu, N>(&host(t.clone()), t.dims(), DType::F32)
}

fn check(what: &str, dtype: DType, got: Vec<f32>, want: Vec<f32>) {
    let tol = if dtype == DType::BF16 { 2e-2 } else { 4e-3 };
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let excess = (g - w).abs() / (1.0 + w.abs());
        assert!(
            excess <= tol,
            "{what} {dtype:?}: element {i}: gpu {g} vs reference {w}"
        );
    }
}

fn norm<B: Backend>(gamma: &[f32], dtype: DType) -> RmsNorm<B> {
    let mut n = RmsNormConfig::new(gamma.len()).init::<B>(&Default::default());
    n.gamma = Param::from_tensor(tensor(gamma, [gamma.len()], dtype));
    n
}

fn norms_and_gate<B: Backend>(dtype: DType, seed: u64) {
    for (rows, width) in [(1, 4096), (3, 3584), (70, 576), (5, 1000)] {
        let shape = [1, rows, width];
        let n = rows * width;
        let x = tensor::<B, 3>(&values(seed, n), shape, dtype);
        let delta = tensor::<B, 3>(&values(seed + 1, n), shape, dtype);
        let gpu_norm = norm::<B>(&values(seed + 2, width), dtype);
        let cpu_norm = norm::<Cpu>(&host(gpu_norm.gamma.val()), DType::F32);
        let what = format!("rms_norm {rows}x{width}");
        let got = rms_norm(x.clone(), &gpu_norm).unwrap();
        assert_eq!(got.dtype(), dtype);
        check(&what, dtype, host(got), host(cpu_norm.forward(on_cpu(&x))));
        let want_sum = on_cpu(&x) + on_cpu(&delta);
        // Moved, not cloned: on fusion the operation then holds the inputs' last handles.
        let (sum, normed) = add_rms_norm(x, delta, &gpu_norm).unwrap();
        check(
            &format!("add_{what} (sum)"),
            dtype,
            host(sum.clone()),
            host(want_sum),
        );
        // The norm reads the 16-bit sum, as the model's residual stream holds it.
        check(
            &format!("add_{what}"),
            dtype,
            host(normed),
            host(cpu_norm.forward(on_cpu(&sum))),
        );
        let gate_up = tensor::<B, 3>(&values(seed + 3, 2 * n), [1, rows, 2 * width], dtype);
        let want = silu_mul(on_cpu(&gate_up)).unwrap();
        let got = silu_mul(gate_up).unwrap();
        check(
            &format!("silu_mul {rows}x{width}"),
            dtype,
            host(got),
            host(want),
        );
    }
}

fn rope<B: Backend>(table: &[f32], max_len: usize, d: usize, dtype: DType) -> RotaryEncoding<B> {
    let mut r = RotaryEncodingConfig::new(max_len, d).init::<B>(&Default::default());
    r.freq_complex = tensor(table, [max_len, d, 2], dtype);
    r
}

/// A prompt of `prompt` tokens then `steps` single-token steps (and one of 3), into one cache
/// on the GPU and one on the CPU; outputs and the caches compared at every step.
fn rope_attention_steps<B: Backend>(dtype: DType, (hq, hkv, d): (usize, usize, usize), seed: u64) {
    let (batch, prompt, cap, max_len) = (2, 70, 96, 128);
    let cpu_rope = RotaryEncodingConfig::new(max_len, d).init::<Cpu>(&Default::default());
    let gpu_rope = rope::<B>(&host(cpu_rope.freq_complex.clone()), max_len, d, dtype);
    let cpu_rope = rope::<Cpu>(&host(gpu_rope.freq_complex.clone()), max_len, d, DType::F32);
    let zeros = vec![0.0; batch * cap * hkv * d];
    let cache_shape = [batch, cap, hkv, d];
    let (mut gk, mut gv) = (
        tensor::<B, 4>(&zeros, cache_shape, dtype),
        tensor::<B, 4>(&zeros, cache_shape, dtype),
    );
    let (mut ck, mut cv) = (
        tensor::<Cpu, 4>(&zeros, cache_shape, DType::F32),
        tensor::<Cpu, 4>(&zeros, cache_shape, DType::F32),
    );
    let width = (hq + 2 * hkv) * d;
    let mut start = 0;
    for (i, t) in [prompt, 1, 1, 3, 1].into_iter().enumerate() {
        let qkv = tensor::<B, 3>(
            &values(seed + i as u64, batch * t * width),
            [batch, t, width],
            dtype,
        );
        let heads = (hq, hkv);
        let gpu_step = RopeAttention {
            rope: &gpu_rope,
            start,
            heads,
            scale: None,
        };
        let cpu_step = RopeAttention {
            rope: &cpu_rope,
            start,
            heads,
            scale: None,
        };
        let want = rope_attention(on_cpu(&qkv), &mut ck, &mut cv, cpu_step).unwrap();
        let got = rope_attention(qkv, &mut gk, &mut gv, gpu_step).unwrap();
        let what = format!("rope_attention {hq}/{hkv}x{d} start {start} t {t}");
        check(&what, dtype, host(got), host(want));
        start += t;
        check(
            &format!("{what} keys"),
            dtype,
            host(gk.clone()),
            host(ck.clone()),
        );
        check(
            &format!("{what} values"),
            dtype,
            host(gv.clone()),
            host(cv.clone()),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn norms_and_gated_product_match_the_reference() {
    for (i, dtype) in [DType::BF16, DType::F16].into_iter().enumerate() {
        norms_and_gate::<Gpu>(dtype, 10 * i as u64);
        norms_and_gate::<Fused>(dtype, 100 + 10 * i as u64);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn rope_cache_write_and_attention_match_the_reference() {
    for (i, dtype) in [DType::BF16, DType::F16].into_iter().enumerate() {
        rope_attention_steps::<Gpu>(dtype, (32, 8, 128), 200 + i as u64);
        rope_attention_steps::<Fused>(dtype, (8, 8, 64), 300 + i as u64);
        rope_attention_steps::<Fused>(dtype, (28, 4, 128), 400 + i as u64);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn f32_tensors_take_the_reference_path() {
    let x = tensor::<Fused, 3>(&values(7, 2 * 64), [1, 2, 64], DType::F32);
    let n = norm::<Fused>(&values(8, 64), DType::F32);
    check(
        "rms_norm f32",
        DType::F16,
        host(rms_norm(x.clone(), &n).unwrap()),
        host(n.forward(x)),
    );
}
