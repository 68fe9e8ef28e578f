//! GPU tests of the block steps of `block_ops` (RMSNorm with the residual add, the SiLU-gated
//! product, RoPE + cache write + attention) against their CPU reference (NdArray, f32) on
//! fresh random data and the same 16-bit-rounded inputs: bf16 and f16, plain `CubeBackend`
//! and `Fusion` over it, a prompt then decode steps written into one cache in place.
//!
//! The composed forms (`rms_norm_linear`, `add_rms_norm_linear`, `silu_mul_linear`,
//! `rope_attention_linear`: the step and the linear after it as one operation) must equal the
//! step then the linear **bit for bit**: the same kernels on the same data; so must
//! `decoder_block` (a whole block as one operation) equal those four in turn.
//!
//! Tolerance per element `|gpu - ref| <= tol * (1 + |ref|)`: tol = 2e-2 for bf16, 4e-3 for
//! f16 (one 16-bit rounding of the output, plus the attention's P rounding). Needs an NVIDIA
//! GPU of compute capability 8.0+ (`#[ignore]`d; run with `--ignored` on the GPU host).
#![cfg(feature = "cuda")]

use burn::{
    backend::NdArray,
    module::Param,
    nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig},
    tensor::{DType, Tensor, backend::Backend},
};
use burn_cubecl::CubeBackend;
use burn_slidesparse::{
    DecoderBlock, MaybeSparseLinear, PackOptions, Precision, QuantizedLinear, RopeAttention,
    SlideSparseBackend, SlideSparseLinear, SparsityPattern, add_rms_norm, add_rms_norm_linear,
    decoder_block, rms_norm, rms_norm_linear, rope_attention, rope_attention_linear, silu_mul,
    silu_mul_linear,
};
use cubecl::cuda::CudaRuntime;
use slidesparse_tests::{assert_same_bits, tensor_of, to_host, uniform_values};

type Gpu = CubeBackend<CudaRuntime, f32, i32, u8>;
type Fused = burn_fusion::Fusion<Gpu>;
/// The backends a model runs in bf16 (its layers' outputs in the backend's float type).
type Gpu16 = CubeBackend<CudaRuntime, half::bf16, i32, u8>;
type Fused16 = burn_fusion::Fusion<Gpu16>;
type Cpu = NdArray;

/// The same values on the CPU in f32 (the GPU tensor's 16-bit rounding included).
fn on_cpu<B: Backend, const N: usize>(t: &Tensor<B, N>) -> Tensor<Cpu, N> {
    tensor_of::<Cpu, N>(&to_host(t.clone()), t.dims(), DType::F32)
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
    n.gamma = Param::from_tensor(tensor_of(gamma, [gamma.len()], dtype));
    n
}

/// Rows of `width` values; `offset`: `x` is a view that starts `offset` elements into its
/// buffer. The norm kernel's vector path takes widths that are multiples of 8 up to 8192
/// with 16-byte aligned rows; 1001, 9216 and the offset view take its scalar path.
fn norms_and_gate<B: Backend>(dtype: DType, seed: u64) {
    let cases = [
        (1, 4096, 0),
        (3, 3584, 0),
        (70, 576, 0),
        (5, 1000, 0),
        (2, 1001, 0),
        (1, 9216, 0),
        (3, 3584, 1),
    ];
    for (rows, width, offset) in cases {
        let shape = [1, rows, width];
        let n = rows * width;
        let x = tensor_of::<B, 1>(&uniform_values(seed, offset + n), [offset + n], dtype)
            .narrow(0, offset, n)
            .reshape(shape);
        let delta = tensor_of::<B, 3>(&uniform_values(seed + 1, n), shape, dtype);
        let gpu_norm = norm::<B>(&uniform_values(seed + 2, width), dtype);
        let cpu_norm = norm::<Cpu>(&to_host(gpu_norm.gamma.val()), DType::F32);
        let what = format!("rms_norm {rows}x{width} offset {offset}");
        let got = rms_norm(x.clone(), &gpu_norm).unwrap();
        assert_eq!(got.dtype(), dtype);
        check(
            &what,
            dtype,
            to_host(got),
            to_host(cpu_norm.forward(on_cpu(&x))),
        );
        let want_sum = on_cpu(&x) + on_cpu(&delta);
        // Moved, not cloned: on fusion the operation then holds the inputs' last handles.
        let (sum, normed) = add_rms_norm(x, delta, &gpu_norm).unwrap();
        check(
            &format!("add_{what} (sum)"),
            dtype,
            to_host(sum.clone()),
            to_host(want_sum),
        );
        // The norm reads the 16-bit sum, as the model's residual stream holds it.
        check(
            &format!("add_{what}"),
            dtype,
            to_host(normed),
            to_host(cpu_norm.forward(on_cpu(&sum))),
        );
        let gate_up = tensor_of::<B, 3>(
            &uniform_values(seed + 3, 2 * n),
            [1, rows, 2 * width],
            dtype,
        );
        let want = silu_mul(on_cpu(&gate_up)).unwrap();
        let got = silu_mul(gate_up).unwrap();
        check(
            &format!("silu_mul {rows}x{width}"),
            dtype,
            to_host(got),
            to_host(want),
        );
    }
}

fn rope<B: Backend>(table: &[f32], max_len: usize, d: usize, dtype: DType) -> RotaryEncoding<B> {
    let mut r = RotaryEncodingConfig::new(max_len, d).init::<B>(&Default::default());
    r.freq_complex = tensor_of(table, [max_len, d, 2], dtype);
    r
}

/// The same table as a strided view: stored `[max_len, (cos, sin), d]`, seen through
/// `swap_dims` as `[max_len, d, 2]` (the kernel reads tables where they stand).
fn strided_rope<B: Backend>(
    table: &[f32],
    max_len: usize,
    d: usize,
    dtype: DType,
) -> RotaryEncoding<B> {
    let mut stored = vec![0.0; table.len()];
    for p in 0..max_len {
        for j in 0..d {
            for c in 0..2 {
                stored[(p * 2 + c) * d + j] = table[(p * d + j) * 2 + c];
            }
        }
    }
    let mut r = RotaryEncodingConfig::new(max_len, d).init::<B>(&Default::default());
    r.freq_complex = tensor_of::<B, 3>(&stored, [max_len, 2, d], dtype).swap_dims(1, 2);
    r
}

/// A prompt of `prompt` tokens then `steps` single-token steps (and one of 3), into one cache
/// on the GPU and one on the CPU; outputs and the caches compared at every step.
/// With `strided`, the GPU's RoPE table is a strided view ([`strided_rope`]).
fn rope_attention_steps<B: Backend>(
    dtype: DType,
    (hq, hkv, d): (usize, usize, usize),
    (seed, strided): (u64, bool),
) {
    let (batch, prompt, cap, max_len) = (2, 70, 96, 128);
    let cpu_rope = RotaryEncodingConfig::new(max_len, d).init::<Cpu>(&Default::default());
    let table = to_host(cpu_rope.freq_complex.clone());
    let gpu_rope = if strided {
        strided_rope::<B>(&table, max_len, d, dtype)
    } else {
        rope::<B>(&table, max_len, d, dtype)
    };
    let cpu_rope = rope::<Cpu>(
        &to_host(gpu_rope.freq_complex.clone()),
        max_len,
        d,
        DType::F32,
    );
    let zeros = vec![0.0; batch * cap * hkv * d];
    let cache_shape = [batch, cap, hkv, d];
    let (mut gk, mut gv) = (
        tensor_of::<B, 4>(&zeros, cache_shape, dtype),
        tensor_of::<B, 4>(&zeros, cache_shape, dtype),
    );
    let (mut ck, mut cv) = (
        tensor_of::<Cpu, 4>(&zeros, cache_shape, DType::F32),
        tensor_of::<Cpu, 4>(&zeros, cache_shape, DType::F32),
    );
    let width = (hq + 2 * hkv) * d;
    let mut start = 0;
    for (i, t) in [prompt, 1, 1, 3, 1].into_iter().enumerate() {
        let qkv = tensor_of::<B, 3>(
            &uniform_values(seed + i as u64, batch * t * width),
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
        let what = format!("rope_attention {hq}/{hkv}x{d} start {start} t {t} strided {strided}");
        check(&what, dtype, to_host(got), to_host(want));
        start += t;
        check(
            &format!("{what} keys"),
            dtype,
            to_host(gk.clone()),
            to_host(ck.clone()),
        );
        check(
            &format!("{what} values"),
            dtype,
            to_host(gv.clone()),
            to_host(cv.clone()),
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
        let seed = |base: u64| base + i as u64;
        rope_attention_steps::<Gpu>(dtype, (32, 8, 128), (seed(200), false));
        rope_attention_steps::<Fused>(dtype, (8, 8, 64), (seed(300), false));
        rope_attention_steps::<Fused>(dtype, (28, 4, 128), (seed(400), false));
        rope_attention_steps::<Gpu>(dtype, (32, 8, 128), (seed(500), true));
        rope_attention_steps::<Fused>(dtype, (28, 4, 128), (seed(600), true));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn f32_tensors_take_the_reference_path() {
    let x = tensor_of::<Fused, 3>(&uniform_values(7, 2 * 64), [1, 2, 64], DType::F32);
    let n = norm::<Fused>(&uniform_values(8, 64), DType::F32);
    check(
        "rms_norm f32",
        DType::F16,
        to_host(rms_norm(x.clone(), &n).unwrap()),
        to_host(n.forward(x)),
    );
}

/// A random `in -> out` layer with bias as SlideSparse 6:8 INT8 and as the dense INT8
/// baseline, on `B` with `dtype` parameters.
fn linears<B: SlideSparseBackend>(
    (k, n): (usize, usize),
    dtype: DType,
    seed: u64,
) -> Vec<(&'static str, MaybeSparseLinear<B>)> {
    let mut linear: Linear<B> = LinearConfig::new(k, n).init(&Default::default());
    linear.weight = Param::from_tensor(tensor_of(&uniform_values(seed, n * k), [k, n], dtype));
    linear.bias = Some(Param::from_tensor(tensor_of(
        &uniform_values(seed + 1, n),
        [n],
        dtype,
    )));
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    vec![
        (
            "6:8 INT8",
            SlideSparseLinear::from_linear(&linear, &options)
                .unwrap()
                .into(),
        ),
        (
            "dense INT8",
            QuantizedLinear::from_linear(&linear, Precision::Int8)
                .unwrap()
                .into(),
        ),
    ]
}

/// Each composed step against the step then the linear, for a SlideSparse and a quantized
/// linear, at decode and prefill row counts.
fn composed_norms_and_gate<B: SlideSparseBackend>(dtype: DType, seed: u64) {
    let (width, out) = (512, 768);
    for (kind, linear) in linears::<B>((width, out), dtype, seed) {
        for rows in [1, 5, 64] {
            let what = format!("{kind}, {rows} rows");
            let shape = [1, rows, width];
            let x = tensor_of::<B, 3>(&uniform_values(seed + 2, rows * width), shape, dtype);
            let delta = tensor_of::<B, 3>(&uniform_values(seed + 3, rows * width), shape, dtype);
            let n = norm::<B>(&uniform_values(seed + 4, width), dtype);
            let want = linear.forward(rms_norm(x.clone(), &n).unwrap());
            let got = rms_norm_linear(x.clone(), &n, &linear).unwrap();
            assert_same_bits(&format!("rms_norm_linear {what}"), got, want);

            let (want_sum, normed) = add_rms_norm(x.clone(), delta.clone(), &n).unwrap();
            let want = linear.forward(normed);
            let (sum, got) = add_rms_norm_linear(x, delta, &n, &linear).unwrap();
            assert_same_bits(&format!("add_rms_norm_linear {what} (sum)"), sum, want_sum);
            assert_same_bits(&format!("add_rms_norm_linear {what}"), got, want);

            let gate_up = tensor_of::<B, 3>(
                &uniform_values(seed + 5, 2 * rows * width),
                [1, rows, 2 * width],
                dtype,
            );
            let want = linear.forward(silu_mul(gate_up.clone()).unwrap());
            let got = silu_mul_linear(gate_up, &linear).unwrap();
            assert_same_bits(&format!("silu_mul_linear {what}"), got, want);
        }
    }
}

/// `rope_attention_linear` against `rope_attention` then the linear: a prompt and decode
/// steps, each into its own cache; outputs and caches equal bit for bit.
fn composed_rope_attention<B: SlideSparseBackend>(dtype: DType, seed: u64) {
    let (hq, hkv, d) = (8, 2, 64);
    let (batch, cap, max_len) = (2, 48, 64);
    let table = RotaryEncodingConfig::new(max_len, d).init::<Cpu>(&Default::default());
    let r = rope::<B>(&to_host(table.freq_complex), max_len, d, dtype);
    let width = (hq + 2 * hkv) * d;
    for (kind, linear) in linears::<B>((hq * d, 256), dtype, seed) {
        let zeros = vec![0.0; batch * cap * hkv * d];
        let cache = || tensor_of::<B, 4>(&zeros, [batch, cap, hkv, d], dtype);
        let (mut k1, mut v1, mut k2, mut v2) = (cache(), cache(), cache(), cache());
        let mut start = 0;
        for (i, t) in [30, 1, 1, 3].into_iter().enumerate() {
            let qkv = tensor_of::<B, 3>(
                &uniform_values(seed + 10 + i as u64, batch * t * width),
                [batch, t, width],
                dtype,
            );
            let step = || RopeAttention {
                rope: &r,
                start,
                heads: (hq, hkv),
                scale: None,
            };
            let want =
                linear.forward(rope_attention(qkv.clone(), &mut k1, &mut v1, step()).unwrap());
            let got = rope_attention_linear(qkv, &mut k2, &mut v2, step(), &linear).unwrap();
            let what = format!("rope_attention_linear {kind}, start {start}, t {t}");
            assert_same_bits(&what, got, want);
            assert_same_bits(&format!("{what} keys"), k2.clone(), k1.clone());
            assert_same_bits(&format!("{what} values"), v2.clone(), v1.clone());
            start += t;
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn composed_steps_equal_the_step_then_the_linear() {
    composed_norms_and_gate::<Gpu16>(DType::BF16, 500);
    composed_norms_and_gate::<Fused16>(DType::BF16, 600);
    composed_rope_attention::<Gpu16>(DType::BF16, 700);
    composed_rope_attention::<Fused16>(DType::BF16, 800);
}

/// `decoder_block` (one operation) against its four composed steps in turn, for SlideSparse
/// and quantized linears: a prompt then decode steps into caches of their own, the first
/// without a residual delta; outputs and caches equal bit for bit.
fn decoder_block_steps<B: SlideSparseBackend>(dtype: DType, seed: u64) {
    let (hq, hkv, d, hidden, f) = (8, 2, 64, 512, 256);
    let (batch, cap, max_len) = (2, 48, 64);
    let table = RotaryEncodingConfig::new(max_len, d).init::<Cpu>(&Default::default());
    let r = rope::<B>(&to_host(table.freq_complex), max_len, d, dtype);
    let qkv_layers = linears::<B>((hidden, (hq + 2 * hkv) * d), dtype, seed);
    let o_layers = linears::<B>((hq * d, hidden), dtype, seed + 1);
    let gate_up_layers = linears::<B>((hidden, 2 * f), dtype, seed + 2);
    let down_layers = linears::<B>((f, hidden), dtype, seed + 3);
    let layers = qkv_layers
        .iter()
        .zip(&o_layers)
        .zip(&gate_up_layers)
        .zip(&down_layers);
    for ((((kind, qkv), (_, o)), (_, gate_up)), (_, down)) in layers {
        let attn_norm = norm::<B>(&uniform_values(seed + 4, hidden), dtype);
        let mlp_norm = norm::<B>(&uniform_values(seed + 5, hidden), dtype);
        let block = DecoderBlock {
            attn_norm: &attn_norm,
            qkv,
            o,
            mlp_norm: &mlp_norm,
            gate_up,
            down,
        };
        let zeros = vec![0.0; batch * cap * hkv * d];
        let cache = || tensor_of::<B, 4>(&zeros, [batch, cap, hkv, d], dtype);
        let (mut k1, mut v1, mut k2, mut v2) = (cache(), cache(), cache(), cache());
        let mut start = 0;
        for (i, t) in [30, 1, 1, 3].into_iter().enumerate() {
            let seed = seed + 10 + 2 * i as u64;
            let x = tensor_of::<B, 3>(
                &uniform_values(seed, batch * t * hidden),
                [batch, t, hidden],
                dtype,
            );
            let delta = (i > 0).then(|| {
                tensor_of::<B, 3>(
                    &uniform_values(seed + 1, batch * t * hidden),
                    [batch, t, hidden],
                    dtype,
                )
            });
            let step = || RopeAttention {
                rope: &r,
                start,
                heads: (hq, hkv),
                scale: None,
            };
            let (x1, qkv_out) = match delta.clone() {
                Some(delta) => add_rms_norm_linear(x.clone(), delta, &attn_norm, qkv).unwrap(),
                None => (
                    x.clone(),
                    rms_norm_linear(x.clone(), &attn_norm, qkv).unwrap(),
                ),
            };
            let attended = rope_attention_linear(qkv_out, &mut k1, &mut v1, step(), o).unwrap();
            let (want_h, gu) = add_rms_norm_linear(x1, attended, &mlp_norm, gate_up).unwrap();
            let want_mlp = silu_mul_linear(gu, down).unwrap();
            let (h, mlp) = decoder_block((x, delta), &block, &mut k2, &mut v2, step()).unwrap();
            let what = format!("decoder_block {kind}, start {start}, t {t}");
            assert_same_bits(&format!("{what} (h)"), h, want_h);
            assert_same_bits(&format!("{what} (mlp)"), mlp, want_mlp);
            assert_same_bits(&format!("{what} keys"), k2.clone(), k1.clone());
            assert_same_bits(&format!("{what} values"), v2.clone(), v1.clone());
            start += t;
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (compute capability 8.0+)"]
fn a_decoder_block_equals_its_composed_steps() {
    decoder_block_steps::<Gpu16>(DType::BF16, 900);
    decoder_block_steps::<Fused16>(DType::BF16, 1000);
}
