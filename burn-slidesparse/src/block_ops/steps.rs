//! The block steps on any backend: one operation each on burn-cuda (`cuda.rs`) where the
//! kernels cover the tensors, burn's own modules otherwise (the reference, and the tests'
//! oracle).

use burn::{
    nn::{RmsNorm, RotaryEncoding},
    tensor::{Tensor, activation::silu, backend::Backend},
};

#[cfg(feature = "cuda")]
use super::cuda as native;
use crate::{
    attention::{AttentionOptions, causal_attention},
    attention_shape::qkv_head_dim,
    error::{Result, SlideSparseError},
};

/// `norm(x)` (burn's `RmsNorm` over the last dimension), as one operation on burn-cuda.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    norm: &RmsNorm<B>,
) -> Result<Tensor<B, D>> {
    #[cfg(feature = "cuda")]
    let x = match native::rms_norm(x, None, norm, None) {
        Ok(out) => return out.map(|(_, normed)| normed),
        Err((x, _)) => x,
    };
    Ok(norm.forward(x))
}

/// `(x + delta, norm(x + delta))`: the residual add and the next RMSNorm of a pre-norm block,
/// as one operation on burn-cuda (the sum rounded to the dtype, as a model keeps its residual
/// stream, before the norm reads it).
pub fn add_rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    delta: Tensor<B, D>,
    norm: &RmsNorm<B>,
) -> Result<(Tensor<B, D>, Tensor<B, D>)> {
    #[cfg(feature = "cuda")]
    let (x, delta) = match native::rms_norm(x, Some(delta), norm, None) {
        Ok(out) => return out.map(|(sum, normed)| (sum.expect("the sum of an add"), normed)),
        Err((x, delta)) => (x, delta.expect("given")),
    };
    let sum = x + delta;
    Ok((sum.clone(), norm.forward(sum)))
}

/// `silu(gate) * up` for `gate_up [.., 2 f]` = `[gate | up]` (the output of a fused gate/up
/// projection): `[.., f]`, as one operation on burn-cuda.
pub fn silu_mul<B: Backend, const D: usize>(gate_up: Tensor<B, D>) -> Result<Tensor<B, D>> {
    let dims = gate_up.dims();
    let full = dims[D - 1];
    if !full.is_multiple_of(2) {
        return Err(SlideSparseError::shape(
            "SiLU-gated product input (an even last dimension: gate then up)",
            "an even width",
            full,
        ));
    }
    #[cfg(feature = "cuda")]
    let gate_up = match native::silu_mul(gate_up, None) {
        Ok(out) => return out,
        Err(gate_up) => gate_up,
    };
    let f = full / 2;
    let gate = gate_up.clone().narrow(D - 1, 0, f);
    let up = gate_up.narrow(D - 1, f, f);
    Ok(silu(gate) * up)
}

/// Where [`rope_attention`] reads its heads and writes its keys and values.
#[derive(Debug)]
pub struct RopeAttention<'a, B: Backend> {
    /// burn's rotary encoding (its `freq_complex` table, adjacent pairs), applied to q and k
    /// at positions `start..start + t` (its `start_offset` must be 0).
    pub rope: &'a RotaryEncoding<B>,
    /// The first position of this call's tokens: the cache holds `0..start` already.
    pub start: usize,
    /// Query heads and key/value heads (grouped-query attention when they differ).
    pub heads: (usize, usize),
    /// Softmax scale (`None`: `1/sqrt(head dim)`).
    pub scale: Option<f32>,
}

/// One attention step of a block on the output of a fused qkv projection: RoPE on the q and k
/// heads of `qkv [batch, t, (hq + 2 hkv) d]` (heads q, then k, then v, each `d` wide), k and v
/// written into `keys` and `values` (`[batch, capacity, hkv, d]`) at positions
/// `start..start + t`, then causal attention of q over positions `0..start + t` of the
/// cache: `[batch, t, hq d]`.
///
/// The cache is written **in place** on burn-cuda (every clone of `keys` / `values` sees the
/// new positions; keep none), with `slice_assign` elsewhere. On burn-cuda with bf16/f16
/// tensors, head dim 64 or 128 and contiguous caches this is one operation (RoPE and the
/// cache write in one kernel, then the flash-attention kernels); otherwise burn's operations
/// and [`causal_attention`].
pub fn rope_attention<B: Backend>(
    qkv: Tensor<B, 3>,
    keys: &mut Tensor<B, 4>,
    values: &mut Tensor<B, 4>,
    step: RopeAttention<'_, B>,
) -> Result<Tensor<B, 3>> {
    let d = check_rope_attention(qkv.dims(), keys, values, &step)?;
    #[cfg(feature = "cuda")]
    let qkv = match native::rope_attention(qkv, keys, values, &step, None) {
        Ok(out) => return out,
        Err(qkv) => qkv,
    };
    let [batch, t, _] = qkv.dims();
    let (hq, hkv) = step.heads;
    let end = step.start + t;
    let q = qkv.clone().narrow(2, 0, hq * d).reshape([batch, t, hq, d]);
    let k = qkv
        .clone()
        .narrow(2, hq * d, hkv * d)
        .reshape([batch, t, hkv, d]);
    let v = qkv
        .narrow(2, (hq + hkv) * d, hkv * d)
        .reshape([batch, t, hkv, d]);
    let table = step.rope.freq_complex.clone().narrow(0, step.start, t);
    let (q, k) = (rotate(q, &table), rotate(k, &table));
    let ranges = [0..batch, step.start..end, 0..hkv, 0..d];
    keys.inplace(|c| c.slice_assign(ranges.clone(), k));
    values.inplace(|c| c.slice_assign(ranges, v));
    let options = AttentionOptions {
        kv_len: Some(end),
        scale: step.scale,
    };
    Ok(causal_attention(q, keys.clone(), values.clone(), options)?.reshape([batch, t, hq * d]))
}

/// The head dim `d` of a [`rope_attention`] call on `qkv [batch, t, width]`, or the shape
/// error of its table and caches.
pub(super) fn check_rope_attention<B: Backend>(
    [batch, t, width]: [usize; 3],
    keys: &Tensor<B, 4>,
    values: &Tensor<B, 4>,
    step: &RopeAttention<'_, B>,
) -> Result<usize> {
    let (hq, hkv) = step.heads;
    let d = qkv_head_dim(width, (hq, hkv))?;
    let [max_len, table_d, _] = step.rope.freq_complex.dims();
    let end = step.start + t;
    let [cb, capacity, ch, cd] = keys.dims();
    if table_d != d
        || end > max_len
        || [cb, ch, cd] != [batch, hkv, d]
        || values.dims() != keys.dims()
        || end > capacity
    {
        return Err(SlideSparseError::shape(
            "RoPE table [max_len >= start + t, d, 2] and caches [batch, capacity >= start + t, hkv, d]",
            format!("table [>= {end}, {d}, 2], caches [{batch}, >= {end}, {hkv}, {d}]"),
            format!(
                "table {:?}, caches {:?} / {:?}",
                step.rope.freq_complex.dims(),
                keys.dims(),
                values.dims()
            ),
        ));
    }
    Ok(d)
}

/// burn's `RotaryEncoding::apply` of `x [batch, t, heads, d]` with `table [t, d, (cos, sin)]`
/// (the same products and sums, without its per-pair matmul): `out[2i] = a cos - b sin`,
/// `out[2i+1] = a sin + b cos` for the pair `(a, b) = (x[2i], x[2i+1])`.
fn rotate<B: Backend>(x: Tensor<B, 4>, table: &Tensor<B, 3>) -> Tensor<B, 4> {
    let [b, t, h, d] = x.dims();
    let cos = table.clone().narrow(2, 0, 1).reshape([1, t, 1, d]);
    let sin = table.clone().narrow(2, 1, 1).reshape([1, t, 1, d]);
    // (a, b) -> (-b, a): the pair swapped with the sign of the rotation folded in.
    let pairs = x.clone().reshape([b, t, h, d / 2, 2]);
    let first = pairs.clone().narrow(4, 0, 1);
    let second = pairs.narrow(4, 1, 1);
    let turned = Tensor::cat(vec![second.neg(), first], 4).reshape([b, t, h, d]);
    x * cos + turned * sin
}
