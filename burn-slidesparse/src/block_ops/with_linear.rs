//! Each block step and the linear that reads its output, as one operation where the
//! linear runs the CUDA pipeline (SlideSparse or quantized on burn-cuda) and the step has its
//! kernel; the step then the linear otherwise.

use burn::{nn::RmsNorm, tensor::Tensor};

#[cfg(feature = "cuda")]
use super::cuda as native;
use super::steps::{
    RopeAttention, add_rms_norm, check_rope_attention, rms_norm, rope_attention, silu_mul,
};
use crate::{
    backend::SlideSparseBackend,
    error::{Result, SlideSparseError},
    maybe_sparse::MaybeSparseLinear,
};

/// `linear(rms_norm(x))`: a norm and the linear that reads it, as **one** operation where
/// `linear` runs the CUDA pipeline (SlideSparse or quantized on burn-cuda) and the norm has
/// its kernel (bf16 or f16 tensors, `gamma` of the same dtype); otherwise [`rms_norm`] then
/// the linear. A SlideSparse or quantized linear whose input width is not the norm's is a
/// shape error before anything runs.
///
/// Why: on burn's fusion backend every operation costs the host ~10 us at decode sizes; the
/// composed forms of this module take a block from eight operations to four.
pub fn rms_norm_linear<B: SlideSparseBackend, const D: usize>(
    x: Tensor<B, D>,
    norm: &RmsNorm<B>,
    linear: &MaybeSparseLinear<B>,
) -> Result<Tensor<B, D>> {
    check_linear_input(linear, x.dims()[D - 1])?;
    #[cfg(feature = "cuda")]
    let x = match native::linear_after(linear)? {
        Some(after) => match native::rms_norm(x, None, norm, Some(after)) {
            Ok(out) => return out.map(|(_, y)| y),
            Err((x, _)) => x,
        },
        None => x,
    };
    linear.try_forward(rms_norm(x, norm)?)
}

/// `(x + delta, linear(norm(x + delta)))`: [`add_rms_norm`] and the linear that reads the
/// norm, as one operation where the linear runs the CUDA pipeline and the norm has its
/// kernel (see [`rms_norm_linear`]).
pub fn add_rms_norm_linear<B: SlideSparseBackend, const D: usize>(
    x: Tensor<B, D>,
    delta: Tensor<B, D>,
    norm: &RmsNorm<B>,
    linear: &MaybeSparseLinear<B>,
) -> Result<(Tensor<B, D>, Tensor<B, D>)> {
    check_linear_input(linear, x.dims()[D - 1])?;
    #[cfg(feature = "cuda")]
    let (x, delta) = match native::linear_after(linear)? {
        Some(after) => match native::rms_norm(x, Some(delta), norm, Some(after)) {
            Ok(out) => return out.map(|(sum, y)| (sum.expect("the sum of an add"), y)),
            Err((x, delta)) => (x, delta.expect("given")),
        },
        None => (x, delta),
    };
    let (sum, normed) = add_rms_norm(x, delta, norm)?;
    Ok((sum, linear.try_forward(normed)?))
}

/// `linear(silu(gate) * up)`: [`silu_mul`] and the down projection after it, as one
/// operation where the linear runs the CUDA pipeline and the tensors are bf16 or f16 (see
/// [`rms_norm_linear`]).
pub fn silu_mul_linear<B: SlideSparseBackend, const D: usize>(
    gate_up: Tensor<B, D>,
    linear: &MaybeSparseLinear<B>,
) -> Result<Tensor<B, D>> {
    let full = gate_up.dims()[D - 1];
    if full.is_multiple_of(2) {
        check_linear_input(linear, full / 2)?;
    }
    #[cfg(feature = "cuda")]
    let gate_up = match native::linear_after(linear)? {
        Some(after) if full.is_multiple_of(2) => match native::silu_mul(gate_up, Some(after)) {
            Ok(out) => return out,
            Err(gate_up) => gate_up,
        },
        _ => gate_up,
    };
    // An odd width is `silu_mul`'s shape error.
    linear.try_forward(silu_mul(gate_up)?)
}

/// `linear(rope_attention(..))`: [`rope_attention`] and the output projection after it, as
/// one operation where the linear runs the CUDA pipeline and the attention step has its
/// kernels (bf16 or f16, head dim 64 or 128; see [`rms_norm_linear`]). Shape errors leave
/// the cache unchanged, a SlideSparse or quantized linear's input width included.
pub fn rope_attention_linear<B: SlideSparseBackend>(
    qkv: Tensor<B, 3>,
    keys: &mut Tensor<B, 4>,
    values: &mut Tensor<B, 4>,
    step: RopeAttention<'_, B>,
    linear: &MaybeSparseLinear<B>,
) -> Result<Tensor<B, 3>> {
    let d = check_rope_attention(qkv.dims(), keys, values, &step)?;
    check_linear_input(linear, step.heads.0 * d)?;
    #[cfg(feature = "cuda")]
    let qkv = match native::linear_after(linear)? {
        Some(after) => match native::rope_attention(qkv, keys, values, &step, Some(after)) {
            Ok(out) => return out,
            Err(qkv) => qkv,
        },
        None => qkv,
    };
    linear.try_forward(rope_attention(qkv, keys, values, step)?)
}

/// The shape error of a SlideSparse or quantized linear that cannot read a step's output of
/// `width` values per row, checked before queuing: on fusion the layer's own check would
/// only run inside the fused execution. A dense or masked layer is burn's `Linear`, which
/// checks (and panics) itself, and whose lazily initialized weight may not have its final
/// shape yet.
pub(super) fn check_linear_input<B: SlideSparseBackend>(
    linear: &MaybeSparseLinear<B>,
    width: usize,
) -> Result<()> {
    if linear.sparse().is_none() && linear.quantized().is_none() {
        return Ok(());
    }
    let (in_features, _) = linear.features();
    if in_features != width {
        return Err(SlideSparseError::shape(
            "the input width of the linear after a block step",
            in_features,
            width,
        ));
    }
    Ok(())
}
