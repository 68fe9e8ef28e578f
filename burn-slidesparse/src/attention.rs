//! Causal attention with grouped-query heads and a KV-cache prefix, on burn tensors.
//!
//! Layout: `q [batch, tq, hq, d]`, `k` and `v` `[batch, capacity, hkv, d]` (what an LLM's
//! projections give after a reshape, and a KV cache of `capacity` positions of which the
//! first `kv_len` are in use), output `[batch, tq, hq, d]`. Query `i` sits at position
//! `kv_len - tq + i` and attends to keys `0..=` that position; query head `h` reads key/value
//! head `h / (hq / hkv)`. Prefill is `tq == kv_len` (or a prefix cached before it), decode is
//! `tq` of 1 or a few.
//!
//! [`causal_attention`] runs the CUDA kernels (`cuda/attention.rs`, feature `cuda`) for burn-cuda's
//! `CubeBackend` and for `Fusion` over it (a custom fusion operation, in stream order), and
//! [`causal_attention_reference`] everywhere else: the materialized computation (matmul,
//! mask, softmax, matmul in f32), which is also the tests' oracle.

use burn::tensor::{DType, Int, Tensor, activation::softmax, backend::Backend};

use crate::{attention_shape::AttentionShape, error::Result};

/// What a causal attention call attends over.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Cache positions in use (`None`: the whole key length).
    pub kv_len: Option<usize>,
    /// Softmax scale (`None`: `1/sqrt(d)`).
    pub scale: Option<f32>,
}

fn shape_of<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    options: AttentionOptions,
) -> Result<AttentionShape> {
    AttentionShape::new(q.dims(), k.dims(), v.dims(), options.kv_len)
}

/// Causal attention (module docs: layout, positions, grouped-query heads): the CUDA kernels
/// on burn-cuda (plain or fused) for what they cover (q, k, v all bf16 or all f16, head dim
/// 64 or 128), the reference computation for everything else (f32 tensors, other head dims,
/// every other backend), so a model runs on any backend and dtype.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Result<Tensor<B, 4>> {
    #[cfg(feature = "cuda")]
    if let Some(out) = native::try_cuda(&q, &k, &v, options) {
        return out;
    }
    causal_attention_reference(q, k, v, options)
}

/// The materialized causal attention for any backend: `softmax(mask(q k^T * scale)) v` in f32,
/// K and V heads repeated for grouped-query attention, the result in `q`'s dtype.
pub fn causal_attention_reference<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    options: AttentionOptions,
) -> Result<Tensor<B, 4>> {
    let s = shape_of(&q, &k, &v, options)?;
    let dtype = q.dtype();
    let device = q.device();
    let scale = options.scale.unwrap_or(1.0 / (s.d as f32).sqrt());
    let group = s.group();
    // [batch, capacity, hkv, d] -> [batch, hq, kv_len, d], head h from kv head h / group.
    let heads = |t: Tensor<B, 4>| {
        t.slice([0..s.batch, 0..s.kv_len, 0..s.hkv, 0..s.d])
            .cast(DType::F32)
            .swap_dims(1, 2)
            .unsqueeze_dim::<5>(2)
            .expand([s.batch, s.hkv, group, s.kv_len, s.d])
            .reshape([s.batch, s.hq, s.kv_len, s.d])
    };
    let q = q.cast(DType::F32).swap_dims(1, 2); // [batch, hq, tq, d]
    let scores = q.matmul(heads(k).swap_dims(2, 3)) * scale; // [batch, hq, tq, kv_len]
    let start = (s.kv_len - s.tq) as i64;
    let rows = Tensor::<B, 1, Int>::arange(start..start + s.tq as i64, &device)
        .reshape([s.tq, 1])
        .expand([s.tq, s.kv_len]);
    let cols = Tensor::<B, 1, Int>::arange(0..s.kv_len as i64, &device)
        .reshape([1, s.kv_len])
        .expand([s.tq, s.kv_len]);
    let mask = cols
        .greater(rows)
        .reshape([1, 1, s.tq, s.kv_len])
        .expand([s.batch, s.hq, s.tq, s.kv_len]);
    let p = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
    Ok(p.matmul(heads(v)).swap_dims(1, 2).cast(dtype))
}

#[cfg(feature = "cuda")]
mod native {
    //! The CUDA kernels for burn-cuda's tensors (plain or fused: `native_ops`).

    use burn::tensor::{Shape, Tensor, backend::Backend};

    use super::{AttentionOptions, shape_of};
    use crate::{
        cuda::attention,
        error::Result,
        native_ops::{float, run, same_16_bit, wrap},
    };

    /// The kernels' result if `B`'s tensors are CUDA's (plain or fused) and the kernels have a
    /// variant for these dtypes and head dim, `None` otherwise (the reference path runs).
    pub fn try_cuda<B: Backend>(
        q: &Tensor<B, 4>,
        k: &Tensor<B, 4>,
        v: &Tensor<B, 4>,
        options: AttentionOptions,
    ) -> Option<Result<Tensor<B, 4>>> {
        if !same_16_bit(&[q.dtype(), k.dtype(), v.dtype()]) || !matches!(q.dims()[3], 64 | 128) {
            return None;
        }
        // Checked here, so that a fused execution has nothing left to fail on but the launch.
        let s = match shape_of(q, k, v, options) {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        if let Err(e) = attention::check_supported(&s, [q.dtype(), k.dtype(), v.dtype()]) {
            return Some(Err(e));
        }
        let out = Shape::new([s.batch, s.tq, s.hq, s.d]);
        let (kv_len, scale) = (options.kv_len, options.scale);
        let outs = run::<B>(
            "slidesparse_causal_attention",
            attention::prepare,
            vec![float(q.clone()), float(k.clone()), float(v.clone())],
            vec![out],
            q.dtype(),
            move |mut t| {
                let (v, k, q) = (t.pop(), t.pop(), t.pop());
                let (q, k, v) = (q.expect("q"), k.expect("k"), v.expect("v"));
                Ok(vec![attention::causal_attention(q, k, v, kv_len, scale)?])
            },
        )?;
        Some(outs.map(|mut o| wrap(o.pop().expect("one output"))))
    }
}
