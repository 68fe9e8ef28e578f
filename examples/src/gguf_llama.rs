//! Loading a Llama-architecture GGUF (e.g. SmolLM2-135M) into [`Llama`]
//! with dense layers; every tensor is checked for presence and shape.

use burn::{
    module::Param,
    nn::{Embedding, Linear, RmsNorm},
    tensor::{Tensor, TensorData, backend::Backend},
};
use burn_slidesparse::{SlideSparseError, gguf::GgufFile};

use crate::llama::{Llama, LlamaConfig, tied_head};

fn meta_u64(file: &GgufFile, key: &str) -> Result<usize, SlideSparseError> {
    file.metadata
        .get(key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| {
            SlideSparseError::Backend(format!("GGUF metadata {key:?} missing or not an integer"))
        })
}

fn meta_f64(file: &GgufFile, key: &str) -> Result<f64, SlideSparseError> {
    file.metadata
        .get(key)
        .and_then(|v| v.as_f64())
        .ok_or_else(|| {
            SlideSparseError::Backend(format!("GGUF metadata {key:?} missing or not a number"))
        })
}

/// The model configuration from the GGUF metadata (architecture `llama`).
pub fn config_from_gguf(file: &GgufFile) -> Result<LlamaConfig, SlideSparseError> {
    let arch = file
        .metadata
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("?");
    if arch != "llama" {
        return Err(SlideSparseError::Backend(format!(
            "GGUF architecture {arch:?} is not supported (llama)"
        )));
    }
    let vocab = file.tensor("token_embd.weight")?.shape()[0];
    Ok(LlamaConfig::new(
        vocab,
        meta_u64(file, "llama.embedding_length")?,
        meta_u64(file, "llama.feed_forward_length")?,
        meta_u64(file, "llama.block_count")?,
        meta_u64(file, "llama.attention.head_count")?,
        meta_u64(file, "llama.attention.head_count_kv")?,
    )
    .with_rope_base(meta_f64(file, "llama.rope.freq_base").unwrap_or(10000.0) as f32)
    .with_rms_eps(meta_f64(file, "llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5))
    .with_tie_embeddings(file.tensor("output.weight").is_err()))
}

fn tensor<B: Backend, const D: usize>(
    file: &GgufFile,
    name: &str,
    shape: [usize; D],
    device: &B::Device,
) -> Result<Tensor<B, D>, SlideSparseError> {
    let (values, actual) = file.tensor_f32(name)?;
    if actual != shape {
        return Err(SlideSparseError::ShapeMismatch {
            what: format!("GGUF tensor {name}"),
            expected: format!("{shape:?}"),
            actual: format!("{actual:?}"),
        });
    }
    Ok(Tensor::from_data(TensorData::new(values, shape), device))
}

/// A dense `[out, in]` GGUF weight as a burn `Linear` (`[in, out]`).
fn linear<B: Backend>(
    file: &GgufFile,
    name: &str,
    out: usize,
    inp: usize,
    device: &B::Device,
) -> Result<Linear<B>, SlideSparseError> {
    let (values, shape) = file.tensor_f32(name)?;
    if shape != [out, inp] {
        return Err(SlideSparseError::ShapeMismatch {
            what: format!("GGUF tensor {name}"),
            expected: format!("{:?}", [out, inp]),
            actual: format!("{shape:?}"),
        });
    }
    Ok(linear_from_rows(&values, out, inp, None, device))
}

/// A burn `Linear` (`[in, out]`) from a row-major `[out, in]` weight (PyTorch / GGUF layout)
/// and an optional bias. Transposed on the host, once, into a contiguous tensor.
pub(crate) fn linear_from_rows<B: Backend>(
    values: &[f32],
    out: usize,
    inp: usize,
    bias: Option<Vec<f32>>,
    device: &B::Device,
) -> Linear<B> {
    let mut transposed = vec![0f32; values.len()];
    for (o, row) in values.chunks_exact(inp).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            transposed[i * out + o] = v;
        }
    }
    let w = Tensor::<B, 2>::from_data(TensorData::new(transposed, [inp, out]), device);
    Linear {
        weight: Param::from_tensor(w),
        bias: bias
            .map(|b| Param::from_tensor(Tensor::from_data(TensorData::new(b, [out]), device))),
    }
}

fn norm<B: Backend>(
    mut base: RmsNorm<B>,
    file: &GgufFile,
    name: &str,
    dim: usize,
    device: &B::Device,
) -> Result<RmsNorm<B>, SlideSparseError> {
    base.gamma = Param::from_tensor(tensor::<B, 1>(file, name, [dim], device)?);
    Ok(base)
}

/// Builds the model from a GGUF file. Q and K rows stay in GGUF's interleaved RoPE layout,
/// which is the adjacent-pairs layout burn's `RotaryEncoding` uses.
pub fn load_llama<B: Backend>(
    file: &GgufFile,
    max_seq_len: usize,
    device: &B::Device,
) -> Result<Llama<B>, SlideSparseError> {
    let config = config_from_gguf(file)?.with_max_seq_len(max_seq_len);
    let mut model = config.init::<B>(device);
    let (h, ff, hd) = (config.hidden, config.intermediate, config.head_dim());
    model.embed = Embedding {
        weight: Param::from_tensor(tensor::<B, 2>(
            file,
            "token_embd.weight",
            [config.vocab_size, h],
            device,
        )?),
    };
    for (i, block) in model.blocks.iter_mut().enumerate() {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        block.attn_norm = norm(block.attn_norm.clone(), file, &name("attn_norm"), h, device)?;
        block.mlp_norm = norm(block.mlp_norm.clone(), file, &name("ffn_norm"), h, device)?;
        block.attn_in.set(
            0,
            linear(file, &name("attn_q"), config.heads * hd, h, device)?.into(),
        );
        block.attn_in.set(
            1,
            linear(file, &name("attn_k"), config.kv_heads * hd, h, device)?.into(),
        );
        block.attn_in.set(
            2,
            linear(file, &name("attn_v"), config.kv_heads * hd, h, device)?.into(),
        );
        block.o = linear(file, &name("attn_output"), h, config.heads * hd, device)?.into();
        block
            .mlp_in
            .set(0, linear(file, &name("ffn_gate"), ff, h, device)?.into());
        block
            .mlp_in
            .set(1, linear(file, &name("ffn_up"), ff, h, device)?.into());
        block.down = linear(file, &name("ffn_down"), h, ff, device)?.into();
    }
    model.norm = norm(model.norm.clone(), file, "output_norm.weight", h, device)?;
    model.lm_head = if config.tie_embeddings {
        tied_head(&model.embed)
    } else {
        linear(file, "output.weight", config.vocab_size, h, device)?.into()
    };
    Ok(model)
}
