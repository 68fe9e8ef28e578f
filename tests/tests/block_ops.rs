//! The block steps of `block_ops` on the CPU (their reference path, the GPU kernels' oracle):
//! RoPE + cache write + attention against burn's own `RotaryEncoding::apply`, `slice_assign`
//! and the reference attention; a prompt in one call against the same prompt as a prefix
//! then decode steps; the typed errors, which leave the cache unchanged; and the composed
//! steps (a step and the linear after it) equal to the step then the linear.

use burn::{
    backend::NdArray,
    nn::{LinearConfig, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig},
    tensor::{Distribution, Tensor},
};
use burn_slidesparse::{
    AttentionOptions, DecoderBlock, MaybeSparseLinear, PackOptions, Precision, QuantizedLinear,
    RopeAttention, SlideSparseError, SlideSparseLinear, SparsityPattern, add_rms_norm,
    add_rms_norm_linear, causal_attention_reference, decoder_block, rms_norm, rms_norm_linear,
    rope_attention, rope_attention_linear, silu_mul, silu_mul_linear,
};

type Cpu = NdArray;

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 16;

fn rope() -> RotaryEncoding<Cpu> {
    RotaryEncodingConfig::new(64, D)
        .with_theta(500.0)
        .init(&Default::default())
}

fn random<const N: usize>(shape: [usize; N]) -> Tensor<Cpu, N> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

fn max_diff<const N: usize>(a: Tensor<Cpu, N>, b: Tensor<Cpu, N>) -> f32 {
    (a - b).abs().max().into_scalar()
}

fn step(rope: &RotaryEncoding<Cpu>, start: usize) -> RopeAttention<'_, Cpu> {
    RopeAttention {
        rope,
        start,
        heads: (HQ, HKV),
        scale: None,
    }
}

/// burn's modules, written out: q and k rotated by `RotaryEncoding::apply` (on `[batch,
/// heads, t, d]`, its layout), k and v assigned into the cache, the reference attention.
fn composed(
    qkv: Tensor<Cpu, 3>,
    cache: (Tensor<Cpu, 4>, Tensor<Cpu, 4>),
    rope: &RotaryEncoding<Cpu>,
    start: usize,
) -> (Tensor<Cpu, 3>, Tensor<Cpu, 4>, Tensor<Cpu, 4>) {
    let [b, t, _] = qkv.dims();
    let heads =
        |from: usize, n: usize| qkv.clone().narrow(2, from * D, n * D).reshape([b, t, n, D]);
    let rotate = |x: Tensor<Cpu, 4>| rope.apply(x.swap_dims(1, 2), start).swap_dims(1, 2);
    let (q, k, v) = (
        rotate(heads(0, HQ)),
        rotate(heads(HQ, HKV)),
        heads(HQ + HKV, HKV),
    );
    let keys = cache.0.slice_assign([0..b, start..start + t], k);
    let values = cache.1.slice_assign([0..b, start..start + t], v);
    let options = AttentionOptions {
        kv_len: Some(start + t),
        scale: None,
    };
    let out = causal_attention_reference(q, keys.clone(), values.clone(), options).unwrap();
    (out.reshape([b, t, HQ * D]), keys, values)
}

#[test]
fn rope_attention_is_burns_rotary_encoding_cache_write_and_attention() {
    let rope = rope();
    let (b, cap) = (2, 20);
    for (start, t) in [(0, 7), (5, 3), (9, 1)] {
        // A cache whose first `start` positions hold earlier keys, the rest zeros.
        let zeros = Tensor::<Cpu, 4>::zeros([b, cap, HKV, D], &Default::default());
        let filled = |z: Tensor<Cpu, 4>| match start {
            0 => z,
            _ => z.slice_assign([0..b, 0..start], random([b, start, HKV, D])),
        };
        let (mut keys, mut values) = (filled(zeros.clone()), filled(zeros));
        let qkv = random([b, t, (HQ + 2 * HKV) * D]);
        let (want, want_k, want_v) =
            composed(qkv.clone(), (keys.clone(), values.clone()), &rope, start);
        let got = rope_attention(qkv, &mut keys, &mut values, step(&rope, start)).unwrap();
        assert!(max_diff(got, want) < 1e-5, "output, start {start}");
        assert!(max_diff(keys, want_k) < 1e-5, "keys, start {start}");
        assert!(max_diff(values, want_v) == 0.0, "values, start {start}");
    }
}

#[test]
fn a_prompt_at_once_equals_a_prefix_then_decode_steps() {
    let rope = rope();
    let (b, t, cap) = (2, 9, 16);
    let qkv = random([b, t, (HQ + 2 * HKV) * D]);
    let cache = || Tensor::<Cpu, 4>::zeros([b, cap, HKV, D], &Default::default());
    let (mut k1, mut v1) = (cache(), cache());
    let whole = rope_attention(qkv.clone(), &mut k1, &mut v1, step(&rope, 0)).unwrap();
    let (mut k2, mut v2) = (cache(), cache());
    let mut parts = vec![
        rope_attention(
            qkv.clone().narrow(1, 0, 5),
            &mut k2,
            &mut v2,
            step(&rope, 0),
        )
        .unwrap(),
    ];
    for pos in 5..t {
        let one = qkv.clone().narrow(1, pos, 1);
        parts.push(rope_attention(one, &mut k2, &mut v2, step(&rope, pos)).unwrap());
    }
    assert!(max_diff(whole, Tensor::cat(parts, 1)) < 1e-5);
    assert!(max_diff(k1, k2) == 0.0 && max_diff(v1, v2) == 0.0);
}

#[test]
fn misfit_calls_are_refused_and_leave_the_cache_unchanged() {
    let rope = rope();
    let b = 1;
    let zeros = || Tensor::<Cpu, 4>::zeros([b, 8, HKV, D], &Default::default());
    let (mut keys, mut values) = (zeros(), zeros());
    let width = (HQ + 2 * HKV) * D;
    let cases: [(Tensor<Cpu, 3>, usize); 3] = [
        (random([b, 2, width + D]), 0), // a head too many
        (random([b, 4, width]), 6),     // past the cache's capacity
        (random([b, 1, width]), 64),    // past the RoPE table
    ];
    for (qkv, start) in cases {
        let err = rope_attention(qkv, &mut keys, &mut values, step(&rope, start)).unwrap_err();
        assert!(
            matches!(err, SlideSparseError::ShapeMismatch { .. }),
            "{err}"
        );
    }
    assert_eq!(max_diff(keys, zeros()), 0.0);
    assert_eq!(max_diff(values, zeros()), 0.0);
}

#[test]
fn gated_product_and_norm_follow_burns_modules() {
    let x = random([3, 5, 8]);
    let got = silu_mul(x.clone()).unwrap();
    let want =
        burn::tensor::activation::silu(x.clone().narrow(2, 0, 4)) * x.clone().narrow(2, 4, 4);
    assert_eq!(max_diff(got, want), 0.0);
    let err = silu_mul(random([2, 7])).unwrap_err();
    assert!(
        matches!(err, SlideSparseError::ShapeMismatch { .. }),
        "{err}"
    );
    let norm = RmsNormConfig::new(8).init::<Cpu>(&Default::default());
    let delta = random([3, 5, 8]);
    let (sum, normed) = add_rms_norm(x.clone(), delta.clone(), &norm).unwrap();
    assert_eq!(max_diff(sum, x.clone() + delta.clone()), 0.0);
    assert_eq!(max_diff(normed, norm.forward(x + delta)), 0.0);
}

/// A dense, a SlideSparse 6:8 INT8 and a quantized INT8 `k -> n` layer from one random linear.
fn linears(k: usize, n: usize) -> Vec<MaybeSparseLinear<Cpu>> {
    let linear = LinearConfig::new(k, n).init::<Cpu>(&Default::default());
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    vec![
        SlideSparseLinear::from_linear(&linear, &options)
            .unwrap()
            .into(),
        QuantizedLinear::from_linear(&linear, Precision::Int8)
            .unwrap()
            .into(),
        linear.into(),
    ]
}

#[test]
fn composed_steps_are_the_step_then_the_linear() {
    let (rows, width, out) = (5, 64, 48);
    let norm = RmsNormConfig::new(width).init::<Cpu>(&Default::default());
    let rope = rope();
    for linear in linears(width, out) {
        let kind = linear.kind();
        let (x, delta) = (random([1, rows, width]), random([1, rows, width]));
        let want = linear.forward(rms_norm(x.clone(), &norm).unwrap());
        let got = rms_norm_linear(x.clone(), &norm, &linear).unwrap();
        assert_eq!(max_diff(got, want), 0.0, "rms_norm_linear {kind}");

        let (sum, normed) = add_rms_norm(x.clone(), delta.clone(), &norm).unwrap();
        let (got_sum, got) = add_rms_norm_linear(x, delta, &norm, &linear).unwrap();
        assert_eq!(
            max_diff(got_sum, sum),
            0.0,
            "add_rms_norm_linear {kind} (sum)"
        );
        assert_eq!(
            max_diff(got, linear.forward(normed)),
            0.0,
            "add_rms_norm_linear {kind}"
        );

        let gate_up = random([1, rows, 2 * width]);
        let want = linear.forward(silu_mul(gate_up.clone()).unwrap());
        let got = silu_mul_linear(gate_up, &linear).unwrap();
        assert_eq!(max_diff(got, want), 0.0, "silu_mul_linear {kind}");
    }
    // The attention's output width is HQ * D: a layer that reads it.
    for linear in linears(HQ * D, out) {
        let cache = || Tensor::<Cpu, 4>::zeros([2, 12, HKV, D], &Default::default());
        let (mut k1, mut v1, mut k2, mut v2) = (cache(), cache(), cache(), cache());
        let qkv = random([2, 6, (HQ + 2 * HKV) * D]);
        let attended = rope_attention(qkv.clone(), &mut k1, &mut v1, step(&rope, 3)).unwrap();
        let got = rope_attention_linear(qkv, &mut k2, &mut v2, step(&rope, 3), &linear).unwrap();
        assert_eq!(
            max_diff(got, linear.forward(attended)),
            0.0,
            "{}",
            linear.kind()
        );
        assert_eq!(max_diff(k1, k2), 0.0);
        assert_eq!(max_diff(v1, v2), 0.0);
    }
}

#[test]
fn a_composed_step_with_a_misfit_linear_is_an_error_that_leaves_the_cache_unchanged() {
    let norm = RmsNormConfig::new(64).init::<Cpu>(&Default::default());
    let rope = rope();
    let shape_error = |err: SlideSparseError| {
        assert!(
            matches!(err, SlideSparseError::ShapeMismatch { .. }),
            "{err}"
        )
    };
    // Sparse and quantized layers of input width 32: no step here outputs 32 wide. (A dense
    // layer is burn's `Linear`, which panics on a bad width, as it does alone.)
    for linear in linears(32, 16).into_iter().take(2) {
        shape_error(rms_norm_linear(random([1, 3, 64]), &norm, &linear).unwrap_err());
        let (x, delta) = (random([1, 3, 64]), random([1, 3, 64]));
        shape_error(add_rms_norm_linear(x, delta, &norm, &linear).unwrap_err());
        shape_error(silu_mul_linear(random([1, 3, 128]), &linear).unwrap_err());
        let zeros = || Tensor::<Cpu, 4>::zeros([1, 8, HKV, D], &Default::default());
        let (mut keys, mut values) = (zeros(), zeros());
        let qkv = random([1, 2, (HQ + 2 * HKV) * D]);
        let err = rope_attention_linear(qkv, &mut keys, &mut values, step(&rope, 0), &linear)
            .unwrap_err();
        shape_error(err);
        assert_eq!(max_diff(keys, zeros()), 0.0, "{}", linear.kind());
        assert_eq!(max_diff(values, zeros()), 0.0, "{}", linear.kind());
    }
}

/// `decoder_block` is the pre-norm block written out with the plain steps and each layer's
/// own forward: `h = x + delta + o(attention(qkv(norm(x + delta))))`,
/// `mlp = down(silu(gate) * up)` of `gate_up(mlp_norm(h))`, for every kind of linear, with and
/// without a delta; a delta of another shape is a shape error before the cache is touched.
#[test]
fn a_decoder_block_is_the_pre_norm_block() {
    let (hidden, f) = (32, 24);
    let rope = rope();
    let device = Default::default();
    let attn_norm = RmsNormConfig::new(hidden).init::<Cpu>(&device);
    let mlp_norm = RmsNormConfig::new(hidden).init::<Cpu>(&device);
    let layers = linears(hidden, (HQ + 2 * HKV) * D)
        .into_iter()
        .zip(linears(HQ * D, hidden))
        .zip(linears(hidden, 2 * f))
        .zip(linears(f, hidden));
    for (((qkv, o), gate_up), down) in layers {
        let kind = qkv.kind();
        let block = DecoderBlock {
            attn_norm: &attn_norm,
            qkv: &qkv,
            o: &o,
            mlp_norm: &mlp_norm,
            gate_up: &gate_up,
            down: &down,
        };
        let cache = || Tensor::<Cpu, 4>::zeros([2, 12, HKV, D], &device);
        for delta in [None, Some(random([2, 5, hidden]))] {
            let x = random([2, 5, hidden]);
            let residual = match &delta {
                Some(delta) => x.clone() + delta.clone(),
                None => x.clone(),
            };
            let (mut k1, mut v1) = (cache(), cache());
            let qkv_out = qkv.forward(attn_norm.forward(residual.clone()));
            let attended = rope_attention(qkv_out, &mut k1, &mut v1, step(&rope, 3)).unwrap();
            let want_h = residual + o.forward(attended);
            let gated = silu_mul(gate_up.forward(mlp_norm.forward(want_h.clone()))).unwrap();
            let want_mlp = down.forward(gated);

            let (mut k2, mut v2) = (cache(), cache());
            let (h, mlp) =
                decoder_block((x, delta), &block, &mut k2, &mut v2, step(&rope, 3)).unwrap();
            assert!(max_diff(h, want_h) < 1e-5, "{kind} (h)");
            assert!(max_diff(mlp, want_mlp) < 1e-5, "{kind} (mlp)");
            assert_eq!(max_diff(k1, k2), 0.0, "{kind} keys");
            assert_eq!(max_diff(v1, v2), 0.0, "{kind} values");
        }
        let (mut keys, mut values) = (cache(), cache());
        let misfit = (random([2, 5, hidden]), Some(random([2, 4, hidden])));
        let err =
            decoder_block(misfit, &block, &mut keys, &mut values, step(&rope, 3)).unwrap_err();
        assert!(
            matches!(err, SlideSparseError::ShapeMismatch { .. }),
            "{err}"
        );
        // A norm after the attention that does not fit: refused before the cache is written.
        let wide_norm = RmsNormConfig::new(hidden + 8).init::<Cpu>(&device);
        let misfit_block = DecoderBlock {
            mlp_norm: &wide_norm,
            ..block
        };
        let x = (random([2, 5, hidden]), None);
        let err = decoder_block(x, &misfit_block, &mut keys, &mut values, step(&rope, 3));
        let err = err.unwrap_err();
        assert!(
            matches!(err, SlideSparseError::ShapeMismatch { .. }),
            "{err}"
        );
        assert_eq!(max_diff(keys, cache()), 0.0, "{kind}: cache untouched");
        assert_eq!(max_diff(values, cache()), 0.0, "{kind}: cache untouched");
    }
}
