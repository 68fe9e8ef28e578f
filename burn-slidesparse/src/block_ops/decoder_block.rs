//! A whole pre-norm decoder block with fused projections, its shapes checked before any
//! step runs.

use burn::{nn::RmsNorm, tensor::Tensor};

#[cfg(feature = "cuda")]
use super::cuda as native;
use super::{
    steps::{RopeAttention, check_rope_attention},
    with_linear::{
        add_rms_norm_linear, check_linear_input, rms_norm_linear, rope_attention_linear,
        silu_mul_linear,
    },
};
use crate::{
    backend::SlideSparseBackend,
    error::{Result, SlideSparseError},
    maybe_sparse::MaybeSparseLinear,
};

/// The layers of a pre-norm decoder block with fused projections (Llama, Qwen2, Mistral):
/// what [`decoder_block`] runs.
pub struct DecoderBlock<'a, B: SlideSparseBackend> {
    /// The norm before the attention.
    pub attn_norm: &'a RmsNorm<B>,
    /// `[q | k | v]` in one layer (heads q, then k, then v).
    pub qkv: &'a MaybeSparseLinear<B>,
    /// The attention's output projection.
    pub o: &'a MaybeSparseLinear<B>,
    /// The norm before the MLP.
    pub mlp_norm: &'a RmsNorm<B>,
    /// `[gate | up]` in one layer.
    pub gate_up: &'a MaybeSparseLinear<B>,
    /// The MLP's down projection.
    pub down: &'a MaybeSparseLinear<B>,
}

/// One pre-norm decoder block on the residual stream `x` plus `delta` (the previous block's
/// MLP output, added here; `None` for the first block): returns `(h, mlp)` with
/// `h = x + delta + o(attention(qkv(attn_norm(x + delta))))` and
/// `mlp = down(silu(gate) * up)` of `gate_up(mlp_norm(h))`, for the next block (or the
/// caller) to add. The attention step is [`rope_attention`]'s (the cache written in place at
/// `step.start..`).
///
/// Exactly [`add_rms_norm_linear`] (or [`rms_norm_linear`]), [`rope_attention_linear`],
/// [`add_rms_norm_linear`] and [`silu_mul_linear`] in turn, the same kernels in the same
/// order; on burn-cuda, where all four linears run the CUDA pipeline and the step kernels
/// apply (bf16 or f16, head dim 64 or 128, contiguous caches), they run as **one**
/// operation. The shapes of every step (input, residual, norms, linears, table and caches)
/// are checked first, on every backend: a misfit block is an error before the cache is
/// written.
///
/// Why: on burn's fusion backend (`burn::backend::Cuda`) every operation costs fusion's
/// server thread ~10 us at decode sizes, on the path of every kernel launch; one operation
/// per block instead of four takes ~96 of them off a 32-block model's step.
pub fn decoder_block<B: SlideSparseBackend>(
    (x, delta): (Tensor<B, 3>, Option<Tensor<B, 3>>),
    block: &DecoderBlock<'_, B>,
    keys: &mut Tensor<B, 4>,
    values: &mut Tensor<B, 4>,
    step: RopeAttention<'_, B>,
) -> Result<(Tensor<B, 3>, Tensor<B, 3>)> {
    let delta_dims = delta.as_ref().map(Tensor::dims);
    check_decoder_block((x.dims(), delta_dims), block, (keys, values), &step)?;
    #[cfg(feature = "cuda")]
    let (x, delta) = match native::decoder_block((x, delta), block, keys, values, &step)? {
        Ok(out) => return out,
        Err(inputs) => inputs,
    };
    let (x, qkv) = match delta {
        Some(delta) => add_rms_norm_linear(x, delta, block.attn_norm, block.qkv)?,
        None => (x.clone(), rms_norm_linear(x, block.attn_norm, block.qkv)?),
    };
    let attended = rope_attention_linear(qkv, keys, values, step, block.o)?;
    let (h, gate_up) = add_rms_norm_linear(x, attended, block.mlp_norm, block.gate_up)?;
    Ok((h, silu_mul_linear(gate_up, block.down)?))
}

/// The shape error that would stop one of a [`decoder_block`]'s steps, found before any of
/// them runs: on fusion a step's own check would only run inside the single operation, and
/// on any backend the attention step would already have written the cache.
fn check_decoder_block<B: SlideSparseBackend>(
    ([batch, t, hidden], delta): ([usize; 3], Option<[usize; 3]>),
    block: &DecoderBlock<'_, B>,
    (keys, values): (&Tensor<B, 4>, &Tensor<B, 4>),
    step: &RopeAttention<'_, B>,
) -> Result<()> {
    if let Some(delta) = delta
        && delta != [batch, t, hidden]
    {
        return Err(SlideSparseError::shape(
            "decoder block residual (the shape of x)",
            format!("{:?}", [batch, t, hidden]),
            format!("{delta:?}"),
        ));
    }
    if t == 0 {
        return Err(SlideSparseError::shape(
            "decoder block input tokens",
            "at least one",
            0,
        ));
    }
    for (what, norm) in [
        (
            "the attention norm's width (the hidden size)",
            block.attn_norm,
        ),
        ("the MLP norm's width (the hidden size)", block.mlp_norm),
    ] {
        let width = norm.gamma.lazy_shape().num_elements();
        if width != hidden {
            return Err(SlideSparseError::shape(what, hidden, width));
        }
    }
    check_linear_input(block.qkv, hidden)?;
    let d = check_rope_attention([batch, t, block.qkv.features().1], keys, values, step)?;
    check_linear_input(block.o, step.heads.0 * d)?;
    let o_out = block.o.features().1;
    if o_out != hidden {
        return Err(SlideSparseError::shape(
            "the o projection's output width (the hidden size)",
            hidden,
            o_out,
        ));
    }
    check_linear_input(block.gate_up, hidden)?;
    let gate_up = block.gate_up.features().1;
    if !gate_up.is_multiple_of(2) {
        return Err(SlideSparseError::shape(
            "gate_up output (an even width: gate then up)",
            "an even width",
            gate_up,
        ));
    }
    check_linear_input(block.down, gate_up / 2)?;
    Ok(())
}
