//! burn-cuda's tensors (plain or fused, a checked downcast from the backend's tensor type)
//! to the kernels of `cuda::block_steps` and the linears after them ([`NativeLinear`]). The
//! inputs the caller gives up are moved into the operation (on fusion a clone would cost one
//! more queued operation, the caller's drop); for every other backend, or what the kernels
//! do not cover, they come back as `Err` untouched and the caller runs the reference.

use burn::{
    nn::RmsNorm,
    tensor::{Shape, Tensor, backend::Backend},
};
use burn_cubecl::tensor::CubeTensor;

use super::{decoder_block::DecoderBlock, steps::RopeAttention};
use crate::{
    backend::SlideSparseBackend,
    cuda::{CudaPrepared, DenseLayerGpu, attention, block_steps as kernels, runtime::Runtime},
    error::Result,
    maybe_sparse::MaybeSparseLinear,
    native_ops::{NativeTensors, float, is_cuda, run, same_16_bit as sixteen_bit, wrap},
};

/// A linear layer's CUDA pipeline, for an operation that runs the linear right after its own
/// kernel: on fusion one custom operation instead of two (each costs the host ~10 us at
/// decode sizes), and no reshapes around the linear.
#[derive(Clone, Debug)]
pub enum NativeLinear {
    /// A SlideSparse layer (cuSPARSELt).
    Sparse(CudaPrepared),
    /// The dense quantized baseline (cuBLASLt).
    Dense(DenseLayerGpu),
}

impl NativeLinear {
    /// `[.., in] -> [.., out]` on a contiguous tensor (the layer reads it as `[m, in]` rows;
    /// both reshapes are metadata only).
    pub fn forward(&self, x: CubeTensor<Runtime>) -> Result<CubeTensor<Runtime>> {
        let x = burn_cubecl::kernel::into_contiguous(x);
        let mut dims = x.meta.shape().to_vec();
        let k = dims.pop().expect("a tensor of rank >= 1");
        let m = dims.iter().product::<usize>();
        let y = match self {
            Self::Sparse(layer) => layer.forward(&reshaped(x, vec![m, k])),
            Self::Dense(layer) => layer.forward(&reshaped(x, vec![m, k])),
        }?;
        dims.push(y.meta.shape()[1]);
        Ok(reshaped(y, dims))
    }
}

/// A contiguous tensor viewed with another shape of as many elements.
fn reshaped(t: CubeTensor<Runtime>, dims: Vec<usize>) -> CubeTensor<Runtime> {
    CubeTensor::new_contiguous(t.client, t.device, Shape::from(dims), t.handle, t.dtype)
}

/// `linear`'s CUDA pipeline, if it is SlideSparse or quantized on burn-cuda (plain or under
/// fusion); `None` for a dense or masked layer and on every other backend.
pub(crate) fn native_linear<B: SlideSparseBackend>(
    linear: &MaybeSparseLinear<B>,
) -> Result<Option<NativeLinear>> {
    Ok(match linear {
        MaybeSparseLinear::Sparse(layer) => B::native_layer(&layer.prepared()?)
            .and_then(|layer| layer.downcast_ref::<CudaPrepared>())
            .cloned()
            .map(NativeLinear::Sparse),
        MaybeSparseLinear::Quantized(layer) => B::native_dense_layer(&layer.prepared()?)
            .and_then(|layer| layer.downcast_ref::<DenseLayerGpu>())
            .cloned()
            .map(NativeLinear::Dense),
        MaybeSparseLinear::Dense(_) | MaybeSparseLinear::Masked(_) => None,
    })
}

/// A linear the operation runs on its result (its CUDA pipeline and output width).
pub struct LinearAfter {
    pub linear: NativeLinear,
    pub out_features: usize,
}

/// `linear` as the CUDA pipeline an operation can run after its own kernel, if it is one.
pub fn linear_after<B: SlideSparseBackend>(
    linear: &MaybeSparseLinear<B>,
) -> Result<Option<LinearAfter>> {
    if !is_cuda::<B>() {
        return Ok(None);
    }
    let out_features = linear.features().1;
    Ok(native_linear(linear)?.map(|linear| LinearAfter {
        linear,
        out_features,
    }))
}

/// Compiles the kernels the block steps use on device `index` if they are not yet (before a
/// fused operation is queued: its execution then has nothing left to fail on but launches).
fn prepare(index: usize) -> Result<()> {
    kernels::prepare(index)?;
    attention::prepare(index)
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
fn split(mut shape: Shape, then: Option<LinearAfter>) -> (Shape, Option<NativeLinear>) {
    let then = then.map(|then| {
        let last = shape.num_dims() - 1;
        shape[last] = then.out_features;
        then.linear
    });
    (shape, then)
}

/// `(x + delta if given, the norm)`.
type Normed<B, const D: usize> = (Option<Tensor<B, D>>, Tensor<B, D>);
/// The inputs of [`rms_norm`](super::rms_norm), given back.
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
        prepare,
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
        prepare,
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
pub fn decoder_block<B: SlideSparseBackend>(
    (x, delta): BlockInputs<B>,
    block: &DecoderBlock<'_, B>,
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
    let out_shape = Shape::new([batch, t, block.down.features().1]);
    let has_delta = delta.is_some();
    let mut inputs = vec![float(x), float(g1), float(table.clone())];
    inputs.extend([float(keys.clone()), float(values.clone()), float(g2)]);
    inputs.extend(delta.map(float));
    let (eps1, eps2) = (block.attn_norm.epsilon, block.mlp_norm.epsilon);
    let (start, heads, scale) = (step.start, step.heads, step.scale);
    let [qkv, o, gate_up, down]: [NativeLinear; 4] = linears.try_into().expect("four linears");
    let out = run::<B>(
        "slidesparse_decoder_block",
        prepare,
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
            let attended = kernels::rope_attention(qkv, table, keys, values, start, heads, scale)?;
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
    let (out_shape, then) = split(Shape::new([batch, t, hq * d]), then);
    let (start, heads, scale) = (step.start, step.heads, step.scale);
    let out = run::<B>(
        "slidesparse_rope_attention",
        prepare,
        inputs,
        vec![out_shape],
        dtype,
        move |mut t| {
            let values = t.pop().expect("four inputs");
            let keys = t.pop().expect("four inputs");
            let table = t.pop().expect("four inputs");
            let qkv = t.pop().expect("four inputs");
            let attended = kernels::rope_attention(qkv, table, keys, values, start, heads, scale)?;
            Ok(vec![after(&then, attended)?])
        },
    );
    Ok(ran::<B>(out).map(|mut outs| wrap(outs.pop().expect("one output"))))
}
