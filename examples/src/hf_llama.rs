//! Loading a Hugging Face Llama / Qwen2 checkpoint (`config.json`, `model.safetensors` or a
//! sharded `model.safetensors.index.json`, F32/F16/BF16) into [`Llama`] with dense layers.
//! Every tensor is checked for presence and shape; errors name the tensor and the file. The
//! shards are memory-mapped and read one tensor at a time, converted as the model is built.
//!
//! Hugging Face stores the Q and K projection rows of each head in the "rotate half" RoPE
//! layout (pairs `(i, i + d/2)`); the model here rotates adjacent pairs `(2i, 2i + 1)` like
//! GGUF, so those rows (and the Qwen2 q/k biases) are permuted on load.

use std::{
    cell::RefCell,
    collections::HashMap,
    path::{Path, PathBuf},
};

use burn::{
    module::Param,
    nn::{Embedding, RmsNorm},
    tensor::{Tensor, TensorData, backend::Backend},
};
use burn_slidesparse::{
    PackedFile, PackedLinear, SlideSparseError, WeightCodes, load_packed, read_f32,
};

use crate::{
    gguf_llama::linear_from_rows,
    llama::{Llama, LlamaConfig, tied_head},
    safetensors_io::{F32Tensor, write_f32_safetensors},
};

fn err(what: impl std::fmt::Display) -> SlideSparseError {
    SlideSparseError::Backend(what.to_string())
}

/// The model configuration from `config.json` (`model_type` `llama` or `qwen2`).
pub fn config_from_json(json: &str) -> Result<LlamaConfig, SlideSparseError> {
    let c: serde_json::Value =
        serde_json::from_str(json).map_err(|e| err(format!("config.json: {e}")))?;
    let int = |key: &str| {
        c[key]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| err(format!("config.json: {key:?} missing or not an integer")))
    };
    let model_type = c["model_type"].as_str().unwrap_or("?");
    let qkv_bias = match model_type {
        "llama" => false,
        "qwen2" => true,
        other => {
            return Err(err(format!(
                "config.json: model_type {other:?} is not supported (llama, qwen2)"
            )));
        }
    };
    let heads = int("num_attention_heads")?;
    Ok(LlamaConfig::new(
        int("vocab_size")?,
        int("hidden_size")?,
        int("intermediate_size")?,
        int("num_hidden_layers")?,
        heads,
        int("num_key_value_heads").unwrap_or(heads),
    )
    .with_rope_base(c["rope_theta"].as_f64().unwrap_or(10000.0) as f32)
    .with_rms_eps(c["rms_norm_eps"].as_f64().unwrap_or(1e-6))
    .with_tie_embeddings(c["tie_word_embeddings"].as_bool().unwrap_or(false))
    .with_qkv_bias(qkv_bias))
}

/// The safetensors files of a checkpoint folder: the shards named by
/// `model.safetensors.index.json`, else `model.safetensors`.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, SlideSparseError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| err(format!("{}: {e}", index.display())))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(format!("{}: {e}", index.display())))?;
        let mut files: Vec<String> = json["weight_map"]
            .as_object()
            .ok_or_else(|| err(format!("{}: no weight_map", index.display())))?
            .values()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        Ok(vec![single])
    } else {
        Err(err(format!(
            "{}: neither model.safetensors nor model.safetensors.index.json",
            dir.display()
        )))
    }
}

/// A memory-mapped safetensors shard.
struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// The checkpoint's tensors, read lazily: each shard is memory-mapped and only its header is
/// parsed up front; a tensor is converted to f32 when the loader asks for it, and its mapped
/// pages are released right after, so the peak memory is the model being built plus one
/// tensor, not the checkpoint file plus an f32 copy of all of it. Each tensor is handed out
/// once: the loader reads every tensor exactly once.
struct Tensors {
    shards: Vec<Shard>,
    /// Tensor name → index of the shard that holds it; removed when the tensor is taken.
    index: RefCell<HashMap<String, usize>>,
    dir: PathBuf,
}

impl Tensors {
    fn open(dir: &Path) -> Result<Self, SlideSparseError> {
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in shard_paths(dir)? {
            let file =
                std::fs::File::open(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
            // SAFETY: the map is read-only and lives as long as `Tensors`; as with any
            // memory-mapped file, the checkpoint must not be truncated or rewritten while it
            // is being loaded (which would be a broken checkpoint anyway).
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| err(format!("{}: cannot map: {e}", path.display())))?;
            let names: Vec<String> = safetensors::SafeTensors::deserialize(&map)
                .map_err(|e| err(format!("{}: {e}", path.display())))?
                .names()
                .into_iter()
                .map(String::from)
                .collect();
            for name in names {
                if let Some(other) = index.insert(name.clone(), shards.len()) {
                    let other: &Shard = &shards[other];
                    return Err(err(format!(
                        "tensor {name} is in both {} and {}",
                        other.path.display(),
                        path.display()
                    )));
                }
            }
            shards.push(Shard { path, map });
        }
        Ok(Self {
            shards,
            index: RefCell::new(index),
            dir: dir.to_path_buf(),
        })
    }

    /// Takes the values of `name`, whose shape must be `shape`, converted to f32.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, SlideSparseError> {
        let shard = self.index.borrow_mut().remove(name).ok_or_else(|| {
            SlideSparseError::MissingTensor {
                name: name.to_string(),
                path: self.dir.display().to_string(),
            }
        })?;
        let shard = &self.shards[shard];
        let st = safetensors::SafeTensors::deserialize(&shard.map)
            .map_err(|e| err(format!("{}: {e}", shard.path.display())))?;
        let view = st
            .tensor(name)
            .map_err(|e| err(format!("{}: {name}: {e}", shard.path.display())))?;
        if view.shape() != shape {
            return Err(SlideSparseError::ShapeMismatch {
                what: format!("tensor {name}"),
                expected: format!("{shape:?}"),
                actual: format!("{:?}", view.shape()),
            });
        }
        let values = read_f32(name, &view)?;
        let data = view.data();
        let (offset, len) = (
            data.as_ptr() as usize - shard.map.as_ptr() as usize,
            data.len(),
        );
        drop(st);
        release_pages(&shard.map, offset, len);
        Ok(values)
    }
}

/// Drops the resident pages of a tensor that has been converted, so that the mapped file does
/// not add up in memory as the loader walks through it (the pages stay in the page cache).
#[cfg(unix)]
fn release_pages(map: &memmap2::Mmap, offset: usize, len: usize) {
    // SAFETY: the map is a read-only shared file mapping and no slice into this range is
    // alive (the tensor view was dropped): after MADV_DONTNEED a later access reads the
    // same bytes back from the file. A failure only means the pages stay resident.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
}

#[cfg(not(unix))]
fn release_pages(_map: &memmap2::Mmap, _offset: usize, _len: usize) {}

/// Reorders the rows of each head from the rotate-half layout to adjacent pairs:
/// adjacent row `2i + j` of a head is rotate-half row `j * d/2 + i`. `row_len` is 1 for a
/// bias vector.
pub fn rotate_half_to_adjacent(
    values: &[f32],
    heads: usize,
    head_dim: usize,
    row_len: usize,
) -> Vec<f32> {
    permute_head_rows(values, heads, head_dim, row_len, true)
}

/// The inverse of [`rotate_half_to_adjacent`] (for writing Hugging Face checkpoints).
pub fn adjacent_to_rotate_half(
    values: &[f32],
    heads: usize,
    head_dim: usize,
    row_len: usize,
) -> Vec<f32> {
    permute_head_rows(values, heads, head_dim, row_len, false)
}

fn permute_head_rows<T: Copy + Default>(
    values: &[T],
    heads: usize,
    head_dim: usize,
    row_len: usize,
    to_adjacent: bool,
) -> Vec<T> {
    let half = head_dim / 2;
    let mut out = vec![T::default(); values.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let adjacent = (h * head_dim + 2 * i + j) * row_len;
                let rotate_half = (h * head_dim + j * half + i) * row_len;
                let (dst, src) = if to_adjacent {
                    (adjacent, rotate_half)
                } else {
                    (rotate_half, adjacent)
                };
                out[dst..dst + row_len].copy_from_slice(&values[src..src + row_len]);
            }
        }
    }
    out
}

/// The packed file's name (tensor prefix) of a model layer of a Hugging Face checkpoint:
/// `layers.3.q_proj` -> `model.layers.3.self_attn.q_proj`, `layers.3.up_proj` ->
/// `model.layers.3.mlp.up_proj`.
pub fn hf_layer_name(model_name: &str) -> String {
    let Some(rest) = model_name.strip_prefix("layers.") else {
        return model_name.to_string();
    };
    let Some((block, proj)) = rest.split_once('.') else {
        return model_name.to_string();
    };
    let group = match proj {
        "q_proj" | "k_proj" | "v_proj" | "o_proj" => "self_attn",
        _ => "mlp",
    };
    format!("model.layers.{block}.{group}.{proj}")
}

/// Replaces the block linears of a model loaded with [`load_hf_llama`] from `dir` by the
/// layers of `packed` (`slidesparse pack` of that checkpoint); returns the layers replaced.
/// The q/k rows are reordered as the loader reorders the dense ones (rows are independent in
/// a packed layer: codes, scale and bias move together, exactly).
pub fn load_hf_packed<B: Backend>(
    model: &mut Llama<B>,
    dir: &Path,
    packed: &Path,
) -> Result<Vec<String>, SlideSparseError> {
    let json = std::fs::read_to_string(dir.join("config.json"))
        .map_err(|e| err(format!("{}: {e}", dir.join("config.json").display())))?;
    let config = config_from_json(&json)?;
    let mut file = PackedFile::load(packed)?;
    for layer in &mut file.layers {
        let heads = if layer.name.ends_with("self_attn.q_proj.weight") {
            config.heads
        } else if layer.name.ends_with("self_attn.k_proj.weight") {
            config.kv_heads
        } else {
            continue;
        };
        to_adjacent_rows(layer, heads, config.head_dim());
    }
    load_packed(model, file, &packed.display().to_string(), hf_layer_name)
}

/// [`rotate_half_to_adjacent`] on the rows of a packed layer.
fn to_adjacent_rows(layer: &mut PackedLinear, heads: usize, head_dim: usize) {
    let w = &mut layer.weight;
    let cols = w.cols;
    w.codes = match &w.codes {
        WeightCodes::I8(v) => WeightCodes::I8(permute_head_rows(v, heads, head_dim, cols, true)),
        WeightCodes::Fp8(v) => WeightCodes::Fp8(permute_head_rows(v, heads, head_dim, cols, true)),
        WeightCodes::Bf16(v) => {
            WeightCodes::Bf16(permute_head_rows(v, heads, head_dim, cols, true))
        }
        WeightCodes::F16(v) => WeightCodes::F16(permute_head_rows(v, heads, head_dim, cols, true)),
        WeightCodes::F32(v) => WeightCodes::F32(permute_head_rows(v, heads, head_dim, cols, true)),
    };
    w.scales = permute_head_rows(&w.scales, heads, head_dim, 1, true);
    if let Some(b) = &layer.bias {
        layer.bias = Some(permute_head_rows(b, heads, head_dim, 1, true));
    }
}

/// Builds the model from a Hugging Face checkpoint folder.
pub fn load_hf_llama<B: Backend>(
    dir: &Path,
    max_seq_len: usize,
    device: &B::Device,
) -> Result<Llama<B>, SlideSparseError> {
    let config_path = dir.join("config.json");
    let json = std::fs::read_to_string(&config_path)
        .map_err(|e| err(format!("{}: {e}", config_path.display())))?;
    let config = config_from_json(&json)?.with_max_seq_len(max_seq_len);
    let t = Tensors::open(dir)?;
    let (h, ff, hd) = (config.hidden, config.intermediate, config.head_dim());
    let (q_out, kv_out) = (config.heads * hd, config.kv_heads * hd);
    let mut model = config.init::<B>(device);
    let tensor1 =
        |v: Vec<f32>, n: usize| Tensor::<B, 1>::from_data(TensorData::new(v, [n]), device);
    let norm = |base: RmsNorm<B>, name: &str| -> Result<RmsNorm<B>, SlideSparseError> {
        let mut base = base;
        base.gamma = Param::from_tensor(tensor1(t.get(name, &[h])?, h));
        Ok(base)
    };
    model.embed = Embedding {
        weight: Param::from_tensor(Tensor::from_data(
            TensorData::new(
                t.get("model.embed_tokens.weight", &[config.vocab_size, h])?,
                [config.vocab_size, h],
            ),
            device,
        )),
    };
    for (i, block) in model.blocks.iter_mut().enumerate() {
        let name = |s: &str| format!("model.layers.{i}.{s}");
        let dense = |s: &str, out: usize, inp: usize| -> Result<Vec<f32>, SlideSparseError> {
            t.get(&name(&format!("{s}.weight")), &[out, inp])
        };
        let bias =
            |s: &str, out: usize, heads: usize| -> Result<Option<Vec<f32>>, SlideSparseError> {
                if !config.qkv_bias {
                    return Ok(None);
                }
                let b = t.get(&name(&format!("{s}.bias")), &[out])?;
                Ok(Some(if heads > 0 {
                    rotate_half_to_adjacent(&b, heads, hd, 1)
                } else {
                    b
                }))
            };
        let q = rotate_half_to_adjacent(&dense("self_attn.q_proj", q_out, h)?, config.heads, hd, h);
        let k = rotate_half_to_adjacent(
            &dense("self_attn.k_proj", kv_out, h)?,
            config.kv_heads,
            hd,
            h,
        );
        block.attn_in.set(
            0,
            linear_from_rows(
                &q,
                q_out,
                h,
                bias("self_attn.q_proj", q_out, config.heads)?,
                device,
            )
            .into(),
        );
        block.attn_in.set(
            1,
            linear_from_rows(
                &k,
                kv_out,
                h,
                bias("self_attn.k_proj", kv_out, config.kv_heads)?,
                device,
            )
            .into(),
        );
        block.attn_in.set(
            2,
            linear_from_rows(
                &dense("self_attn.v_proj", kv_out, h)?,
                kv_out,
                h,
                bias("self_attn.v_proj", kv_out, 0)?,
                device,
            )
            .into(),
        );
        block.o = linear_from_rows(
            &dense("self_attn.o_proj", h, q_out)?,
            h,
            q_out,
            None,
            device,
        )
        .into();
        let gate = linear_from_rows(&dense("mlp.gate_proj", ff, h)?, ff, h, None, device);
        block.mlp_in.set(0, gate.into());
        let up = linear_from_rows(&dense("mlp.up_proj", ff, h)?, ff, h, None, device);
        block.mlp_in.set(1, up.into());
        block.down = linear_from_rows(&dense("mlp.down_proj", h, ff)?, h, ff, None, device).into();
        block.attn_norm = norm(block.attn_norm.clone(), &name("input_layernorm.weight"))?;
        block.mlp_norm = norm(
            block.mlp_norm.clone(),
            &name("post_attention_layernorm.weight"),
        )?;
    }
    model.norm = norm(model.norm.clone(), "model.norm.weight")?;
    model.lm_head = if config.tie_embeddings {
        tied_head(&model.embed)
    } else {
        let w = t.get("lm_head.weight", &[config.vocab_size, h])?;
        linear_from_rows(&w, config.vocab_size, h, None, device).into()
    };
    Ok(model)
}

/// `[out, in]` rows of a dense layer of the model (burn stores `[in, out]`).
/// Separate projection `index`, or an error once [`Llama::fuse_projections`] merged them.
fn separate<B: Backend>(
    layers: &crate::llama::Projections<B>,
    index: usize,
) -> Result<&burn_slidesparse::MaybeSparseLinear<B>, SlideSparseError> {
    layers.separate().map(|l| &l[index]).ok_or_else(|| {
        SlideSparseError::Backend(
            "the model's projections are fused: write the checkpoint before fuse_projections"
                .into(),
        )
    })
}

fn rows_of<B: Backend>(
    layer: &burn_slidesparse::MaybeSparseLinear<B>,
    name: &str,
) -> Result<(Vec<f32>, Vec<usize>), SlideSparseError> {
    let w = layer
        .dense()
        .ok_or_else(|| err(format!("{name}: only dense layers can be written")))?
        .weight
        .val()
        .transpose();
    let shape = w.dims().to_vec();
    Ok((
        w.into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| err(format!("{name}: {e:?}")))?,
        shape,
    ))
}

/// Writes `model` (dense layers) as a Hugging Face checkpoint folder (`config.json` + f32
/// `model.safetensors`, Q/K rows and biases in the rotate-half layout): `model_type` `qwen2`
/// when the config has q/k/v biases, `llama` when not, so that [`load_hf_llama`] reads back
/// the same model. The head is always written (`tie_word_embeddings` false): a tied model
/// reads back with an untied copy of the same values.
pub fn write_hf_checkpoint<B: Backend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    dir: &Path,
) -> Result<(), SlideSparseError> {
    let hd = config.head_dim();
    let mut tensors = Vec::new();
    let mut add = |name: String, values: Vec<f32>, shape: Vec<usize>| {
        tensors.push(F32Tensor::new(name, shape, values));
    };
    let vec1 = |t: Tensor<B, 1>| -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap_or_default()
    };
    add(
        "model.embed_tokens.weight".into(),
        model
            .embed
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| err(format!("embedding: {e:?}")))?,
        vec![config.vocab_size, config.hidden],
    );
    for (i, b) in model.blocks.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        for (name, layer, heads) in [
            ("self_attn.q_proj", separate(&b.attn_in, 0)?, config.heads),
            (
                "self_attn.k_proj",
                separate(&b.attn_in, 1)?,
                config.kv_heads,
            ),
            ("self_attn.v_proj", separate(&b.attn_in, 2)?, 0),
            ("self_attn.o_proj", &b.o, 0),
            ("mlp.gate_proj", separate(&b.mlp_in, 0)?, 0),
            ("mlp.up_proj", separate(&b.mlp_in, 1)?, 0),
            ("mlp.down_proj", &b.down, 0),
        ] {
            let (w, shape) = rows_of(layer, name)?;
            let w = if heads > 0 {
                adjacent_to_rotate_half(&w, heads, hd, shape[1])
            } else {
                w
            };
            add(p(&format!("{name}.weight")), w, shape.clone());
            if let Some(bias) = layer.dense().and_then(|d| d.bias.as_ref()) {
                let v = vec1(bias.val());
                let v = if heads > 0 {
                    adjacent_to_rotate_half(&v, heads, hd, 1)
                } else {
                    v
                };
                add(p(&format!("{name}.bias")), v, vec![shape[0]]);
            }
        }
        add(
            p("input_layernorm.weight"),
            vec1(b.attn_norm.gamma.val()),
            vec![config.hidden],
        );
        add(
            p("post_attention_layernorm.weight"),
            vec1(b.mlp_norm.gamma.val()),
            vec![config.hidden],
        );
    }
    add(
        "model.norm.weight".into(),
        vec1(model.norm.gamma.val()),
        vec![config.hidden],
    );
    let (head, shape) = rows_of(&model.lm_head, "lm_head")?;
    add("lm_head.weight".into(), head, shape);
    let io = |path: PathBuf| move |e| SlideSparseError::io(&path, e);
    write_f32_safetensors(&dir.join("model.safetensors"), &tensors)?;
    let config_json = serde_json::json!({
        "model_type": if config.qkv_bias { "qwen2" } else { "llama" },
        "vocab_size": config.vocab_size, "hidden_size": config.hidden,
        "intermediate_size": config.intermediate, "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads, "num_key_value_heads": config.kv_heads,
        "rope_theta": config.rope_base, "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": false,
    });
    let json = dir.join("config.json");
    std::fs::write(&json, config_json.to_string()).map_err(io(json.clone()))
}

#[cfg(test)]
mod tests {
    use super::rotate_half_to_adjacent;

    /// Hugging Face RoPE ("rotate half"): pair `(i, i + d/2)` rotated by angle `p * f_i`.
    fn rope_rotate_half(x: &[f32], p: f32) -> Vec<f32> {
        let half = x.len() / 2;
        let mut y = x.to_vec();
        for i in 0..half {
            let a = p * 10000f32.powf(-2.0 * i as f32 / x.len() as f32);
            y[i] = x[i] * a.cos() - x[i + half] * a.sin();
            y[i + half] = x[i + half] * a.cos() + x[i] * a.sin();
        }
        y
    }

    /// RoPE on adjacent pairs `(2i, 2i + 1)` (GGUF, burn's `RotaryEncoding`).
    fn rope_adjacent(x: &[f32], p: f32) -> Vec<f32> {
        let mut y = x.to_vec();
        for i in 0..x.len() / 2 {
            let a = p * 10000f32.powf(-2.0 * i as f32 / x.len() as f32);
            y[2 * i] = x[2 * i] * a.cos() - x[2 * i + 1] * a.sin();
            y[2 * i + 1] = x[2 * i + 1] * a.cos() + x[2 * i] * a.sin();
        }
        y
    }

    #[test]
    fn the_row_permutation_turns_hf_rope_into_adjacent_pair_rope() {
        // q = W x for one head: permuting W's rows permutes q the same way; RoPE then must
        // commute with the permutation for the attention scores to be unchanged.
        let d = 8;
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).sin()).collect();
        for p in [0.0, 1.0, 5.0, 37.0] {
            let hf = rotate_half_to_adjacent(&rope_rotate_half(&q, p), 1, d, 1);
            let ours = rope_adjacent(&rotate_half_to_adjacent(&q, 1, d, 1), p);
            for (a, b) in hf.iter().zip(&ours) {
                assert!((a - b).abs() < 1e-6, "position {p}: {hf:?} vs {ours:?}");
            }
        }
    }
}
