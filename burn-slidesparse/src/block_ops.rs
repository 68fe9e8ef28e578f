//! The steps of a transformer block around its linears, each one operation where burn's own
//! modules queue a chain of them: RMSNorm (optionally after the residual add), the SiLU-gated
//! product of a fused gate/up projection, and RoPE + KV-cache write + causal attention.
//!
//! Why: at decode sizes a model's step is bound by the host's cost of queuing operations, not
//! by the GPU (burn-fusion costs ~10 us per operation; a Llama block queues ~50 with burn's
//! `RmsNorm`, `RotaryEncoding`, `slice_assign` and `silu`, and ~10 with these).
//!
//! On burn-cuda (`CubeBackend<CudaRuntime, ..>` and `Fusion` over it, chosen at run time from
//! the tensors' type, as [`causal_attention`] does) bf16 and f16 tensors run this crate's
//! kernels (`cuda/attention/block.cu`) in f32 with one rounding per output; everything else
//! runs the reference: burn's own modules (`RmsNorm::forward`, `silu`, `RotaryEncoding`'s
//! table, `slice_assign`), which is also the tests' oracle.

use burn::{
    nn::{RmsNorm, RotaryEncoding},
    tensor::{Tensor, activation::silu, backend::Backend},
};

use crate::{
    attention::{AttentionOptions, causal_attention, qkv_head_dim},
    backend::SlideSparseBackend,
    error::{Result, SlideSparseError},
    maybe_sparse::MaybeSparseLinear,
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
fn check_rope_attention<B: Backend>(
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

/// The shape error of a SlideSparse or quantized linear that cannot read a step's output of
/// `width` values per row, checked before queuing: on fusion the layer's own check would
/// only run inside the fused execution. A dense or masked layer is burn's `Linear`, which
/// checks (and panics) itself, and whose lazily initialized weight may not have its final
/// shape yet.
fn check_linear_input<B: SlideSparseBackend>(
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

#[cfg(feature = "cuda")]
mod native {
    //! burn-cuda's tensors (plain or fused, a checked downcast from the backend's tensor
    //! type) to the kernels of `cuda::attention`. The inputs the caller gives up are moved
    //! into the operation (on fusion a clone would cost one more queued operation, the
    //! caller's drop); for every other backend, or what the kernels do not cover, they come
    //! back as `Err` untouched and the caller runs the reference.

    use burn::{
        nn::RmsNorm,
        tensor::{Tensor, backend::Backend},
    };

    use burn_cubecl::tensor::CubeTensor;

    use super::RopeAttention;
    use crate::{
        cuda::{attention as kernels, runtime::Runtime},
        error::Result,
        native_ops::{
            NativeLinear, NativeTensors, float, is_cuda, run, same_16_bit as sixteen_bit, wrap,
        },
    };

    /// A linear the operation runs on its result (its CUDA pipeline and output width).
    pub struct LinearAfter {
        pub linear: NativeLinear,
        pub out_features: usize,
    }

    /// `linear` as the CUDA pipeline an operation can run after its own kernel, if it is one.
    pub fn linear_after<B: crate::SlideSparseBackend>(
        linear: &crate::MaybeSparseLinear<B>,
    ) -> Result<Option<LinearAfter>> {
        if !is_cuda::<B>() {
            return Ok(None);
        }
        let out_features = linear.features().1;
        Ok(linear.native()?.map(|linear| LinearAfter {
            linear,
            out_features,
        }))
    }

    /// The step's result through `then`'s linear, if any.
    fn after(then: &Option<NativeLinear>, t: CubeTensor<Runtime>) -> Result<CubeTensor<Runtime>> {
        match then {
            Some(linear) => linear.forward(t),
            None => Ok(t),
        }
    }

    /// The operation's output shape (`shape` of its own kernel, widened to `then`'s output
    /// width if any) and the linear its execution runs.
    fn split(
        mut shape: burn::tensor::Shape,
        then: Option<LinearAfter>,
    ) -> (burn::tensor::Shape, Option<NativeLinear>) {
        let then = then.map(|then| {
            let last = shape.num_dims() - 1;
            shape[last] = then.out_features;
            then.linear
        });
        (shape, then)
    }

    /// `(x + delta if given, the norm)`.
    type Normed<B, const D: usize> = (Option<Tensor<B, D>>, Tensor<B, D>);
    /// The inputs of [`rms_norm`], given back.
    type NormInputs<B, const D: usize> = (Tensor<B, D>, Option<Tensor<B, D>>);

    /// The operation's outputs; `run` has no `None` for burn-cuda's tensors.
    fn ran<B: Backend>(
        out: Option<Result<Vec<B::FloatTensorPrimitive>>>,
    ) -> Result<Vec<B::FloatTensorPrimitive>> {
        out.expect("checked: burn-cuda's tensors")
    }

    pub fn rms_norm<B: Backend, const D: usize>(
        x: Tensor<B, D>,
        delta: Option<Tensor<B, D>>,
        norm: &RmsNorm<B>,
        then: Option<LinearAfter>,
    ) -> std::result::Result<Result<Normed<B, D>>, NormInputs<B, D>> {
        let gamma = norm.gamma.val();
        let mut dtypes = vec![x.dtype(), gamma.dtype()];
        dtypes.extend(delta.as_ref().map(|d| d.dtype()));
        if !is_cuda::<B>() || !sixteen_bit(&dtypes) {
            return Err((x, delta));
        }
        let (shape, dtype) = (x.shape(), x.dtype());
        let (out_shape, then) = split(shape.clone(), then);
        let mut outputs = vec![out_shape];
        outputs.extend(delta.is_some().then_some(shape));
        let mut inputs = vec![float(x), float(gamma)];
        inputs.extend(delta.map(float));
        let eps = norm.epsilon;
        let out = run::<B>(
            "slidesparse_rms_norm",
            inputs,
            outputs,
            dtype,
            move |mut t: NativeTensors| {
                let delta = (t.len() == 3).then(|| t.pop().expect("three inputs"));
                let gamma = t.pop().expect("gamma");
                let x = t.pop().expect("x");
                let (sum, normed) = kernels::rms_norm(x, delta, gamma, eps)?;
                Ok([Some(after(&then, normed)?), sum]
                    .into_iter()
                    .flatten()
                    .collect())
            },
        );
        Ok(ran::<B>(out).map(|mut outs| {
            let sum = (outs.len() == 2).then(|| wrap(outs.pop().expect("two outputs")));
            (sum, wrap(outs.pop().expect("one output")))
        }))
    }

    pub fn silu_mul<B: Backend, const D: usize>(
        x: Tensor<B, D>,
        then: Option<LinearAfter>,
    ) -> std::result::Result<Result<Tensor<B, D>>, Tensor<B, D>> {
        if !is_cuda::<B>() || !sixteen_bit(&[x.dtype()]) {
            return Err(x);
        }
        let (mut shape, dtype) = (x.shape(), x.dtype());
        shape[D - 1] /= 2;
        let (shape, then) = split(shape, then);
        let out = run::<B>(
            "slidesparse_silu_mul",
            vec![float(x)],
            vec![shape],
            dtype,
            move |mut t| {
                let product = kernels::silu_mul(t.pop().expect("one input"))?;
                Ok(vec![after(&then, product)?])
            },
        );
        Ok(ran::<B>(out).map(|mut outs| wrap(outs.pop().expect("one output"))))
    }

    /// The inputs of [`decoder_block`](super::decoder_block), given back.
    type BlockInputs<B> = (Tensor<B, 3>, Option<Tensor<B, 3>>);
    /// `(h, mlp)` of a decoder block.
    type BlockOutputs<B> = (Tensor<B, 3>, Tensor<B, 3>);

    /// The whole block as one operation where its four linears run the CUDA pipeline and the
    /// step kernels apply (its shapes checked by the caller).
    #[allow(clippy::type_complexity)]
    pub fn decoder_block<B: crate::SlideSparseBackend>(
        (x, delta): BlockInputs<B>,
        block: &super::DecoderBlock<'_, B>,
        keys: &Tensor<B, 4>,
        values: &Tensor<B, 4>,
        step: &RopeAttention<'_, B>,
    ) -> Result<std::result::Result<Result<BlockOutputs<B>>, BlockInputs<B>>> {
        let layers = [block.qkv, block.o, block.gate_up, block.down];
        let mut linears = Vec::with_capacity(4);
        for layer in layers {
            match linear_after(layer)? {
                Some(after) => linears.push(after.linear),
                None => return Ok(Err((x, delta))),
            }
        }
        let (g1, g2) = (block.attn_norm.gamma.val(), block.mlp_norm.gamma.val());
        let table = &step.rope.freq_complex;
        let mut dtypes = vec![x.dtype(), g1.dtype(), g2.dtype(), table.dtype()];
        dtypes.extend([keys.dtype(), values.dtype()]);
        dtypes.extend(delta.as_ref().map(|d| d.dtype()));
        let d = keys.dims()[3];
        if !sixteen_bit(&dtypes) || !matches!(d, 64 | 128) {
            return Ok(Err((x, delta)));
        }
        let [batch, t, _] = x.dims();
        let (shape, dtype) = (x.shape(), x.dtype());
        let out_shape = burn::tensor::Shape::new([batch, t, block.down.features().1]);
        let has_delta = delta.is_some();
        let mut inputs = vec![float(x), float(g1), float(table.clone())];
        inputs.extend([float(keys.clone()), float(values.clone()), float(g2)]);
        inputs.extend(delta.map(float));
        let (eps1, eps2) = (block.attn_norm.epsilon, block.mlp_norm.epsilon);
        let (start, heads, scale) = (step.start, step.heads, step.scale);
        let [qkv, o, gate_up, down]: [NativeLinear; 4] = linears.try_into().expect("four linears");
        let out = run::<B>(
            "slidesparse_decoder_block",
            inputs,
            vec![shape, out_shape],
            dtype,
            move |mut t: NativeTensors| {
                let delta = has_delta.then(|| t.pop().expect("seven inputs"));
                let g2 = t.pop().expect("six inputs");
                let values = t.pop().expect("six inputs");
                let keys = t.pop().expect("six inputs");
                let table = t.pop().expect("six inputs");
                let g1 = t.pop().expect("six inputs");
                let x = t.pop().expect("six inputs");
                // Without a delta the norm reads `x`, which stays the residual.
                let (sum, normed) = kernels::rms_norm(x.clone(), delta, g1, eps1)?;
                let residual = sum.unwrap_or(x);
                let qkv = qkv.forward(normed)?;
                let attended =
                    kernels::rope_attention(qkv, table, keys, values, start, heads, scale)?;
                let attended = o.forward(attended)?;
                let (h, normed) = kernels::rms_norm(residual, Some(attended), g2, eps2)?;
                let product = kernels::silu_mul(gate_up.forward(normed)?)?;
                Ok(vec![h.expect("the sum of an add"), down.forward(product)?])
            },
        );
        Ok(Ok(ran::<B>(out).map(|mut outs| {
            let mlp = wrap(outs.pop().expect("two outputs"));
            (wrap(outs.pop().expect("two outputs")), mlp)
        })))
    }

    /// `qkv` is moved in; the table and the caches are read through clones (the model keeps
    /// them).
    pub fn rope_attention<B: Backend>(
        qkv: Tensor<B, 3>,
        keys: &Tensor<B, 4>,
        values: &Tensor<B, 4>,
        step: &RopeAttention<'_, B>,
        then: Option<LinearAfter>,
    ) -> std::result::Result<Result<Tensor<B, 3>>, Tensor<B, 3>> {
        let table = &step.rope.freq_complex;
        let dtypes = [qkv.dtype(), table.dtype(), keys.dtype(), values.dtype()];
        let [batch, t, _] = qkv.dims();
        let (hq, _) = step.heads;
        let d = keys.dims()[3];
        if !is_cuda::<B>() || !sixteen_bit(&dtypes) || !matches!(d, 64 | 128) {
            return Err(qkv);
        }
        let dtype = qkv.dtype();
        let inputs = vec![
            float(qkv),
            float(table.clone()),
            float(keys.clone()),
            float(values.clone()),
        ];
        let (out_shape, then) = split(burn::tensor::Shape::new([batch, t, hq * d]), then);
        let (start, heads, scale) = (step.start, step.heads, step.scale);
        let out = run::<B>(
            "slidesparse_rope_attention",
            inputs,
            vec![out_shape],
            dtype,
            move |mut t| {
                let values = t.pop().expect("four inputs");
                let keys = t.pop().expect("four inputs");
                let table = t.pop().expect("four inputs");
                let qkv = t.pop().expect("four inputs");
                let attended =
                    kernels::rope_attention(qkv, table, keys, values, start, heads, scale)?;
                Ok(vec![after(&then, attended)?])
            },
        );
        Ok(ran::<B>(out).map(|mut outs| wrap(outs.pop().expect("one output"))))
    }
}
