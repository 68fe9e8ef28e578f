//! The example model: dense-vs-sparse logits agreement, KV cache consistency, and the GGUF
//! and Hugging Face loaders on tiny files written here (the tokenizer: `tokenizer.rs`).

use burn::{
    backend::NdArray,
    tensor::{Int, Tensor, TensorData},
};
use burn_slidesparse::{
    PackOptions, Precision, SparsityPattern, VisitLinears, gguf::GgufFile, sparsify,
};
use slidesparse_examples::{
    generation::{DecodePath, Generator},
    gguf_llama::load_llama,
    llama::{KvCache, Llama, LlamaConfig},
};

type B = NdArray;

fn tiny_config() -> LlamaConfig {
    LlamaConfig::new(64, 32, 48, 2, 4, 2).with_max_seq_len(64)
}

fn tokens(ids: &[i64]) -> Tensor<B, 2, Int> {
    Tensor::from_data(
        TensorData::new(ids.to_vec(), [1, ids.len()]),
        &Default::default(),
    )
}

/// The largest `|a[i] - b[i]|`.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

fn logits(model: &Llama<B>, ids: &[i64]) -> Vec<f32> {
    model
        .forward(tokens(ids), &mut KvCache::default())
        .into_data()
        .into_vec()
        .unwrap()
}

/// Prunes every block linear of a dense model in place (so the dense model is exactly what
/// the packer will keep).
fn prune_dense_in_place(model: &mut Llama<B>, pattern: SparsityPattern) {
    model
        .visit_linears(&mut |name, layer| {
            if name == "lm_head" {
                return Ok(());
            }
            let dense = layer.dense().unwrap().clone();
            let w = dense.weight.val();
            let [i, o] = w.dims();
            let wt: Vec<f32> = w.clone().transpose().into_data().into_vec().unwrap();
            let pruned = burn_slidesparse::prune(name, &wt, o, i, pattern, &Default::default())?;
            let t = Tensor::<B, 2>::from_data(TensorData::new(pruned, [o, i]), &Default::default())
                .transpose();
            *layer = burn::nn::Linear {
                weight: burn::module::Param::from_tensor(t),
                bias: dense.bias.clone(),
            }
            .into();
            Ok(())
        })
        .unwrap();
}

#[test]
fn sparse_model_matches_the_pruned_dense_model() {
    let device = Default::default();
    for pattern in [SparsityPattern::P6_8, SparsityPattern::P2_4] {
        let mut dense = tiny_config().init::<B>(&device);
        prune_dense_in_place(&mut dense, pattern);
        let mut sparse = dense.clone();
        let packed = sparsify(
            &mut sparse,
            &PackOptions::new(pattern, Precision::F32),
            |n| n != "lm_head",
        )
        .unwrap();
        assert_eq!(packed.len(), 14);
        let ids = [3, 17, 42, 5, 9];
        let (a, b) = (logits(&dense, &ids), logits(&sparse, &ids));
        let err = max_abs_diff(&a, &b);
        assert!(err < 1e-4, "{pattern}: max |diff| {err}");
        // INT8 stays close (quantization error only).
        let mut q = dense.clone();
        sparsify(&mut q, &PackOptions::new(pattern, Precision::Int8), |n| {
            n != "lm_head"
        })
        .unwrap();
        let c = logits(&q, &ids);
        let rel = (a.iter().zip(&c).map(|(x, y)| (x - y).powi(2)).sum::<f32>()
            / a.iter().map(|x| x * x).sum::<f32>())
        .sqrt();
        assert!(rel < 0.05, "{pattern} int8: rel {rel}");
    }
}

#[test]
fn kv_cache_gives_the_same_logits_as_a_full_pass() {
    let model = tiny_config().init::<B>(&Default::default());
    let ids = [1i64, 2, 3, 4, 5, 6];
    let full = model.forward(tokens(&ids), &mut KvCache::default());
    let mut cache = KvCache::default();
    model.forward(tokens(&ids[..4]), &mut cache);
    let step = model.forward(tokens(&ids[4..5]), &mut cache);
    let last = model.forward(tokens(&ids[5..]), &mut cache);
    let full: Vec<f32> = full.into_data().into_vec().unwrap();
    let v = 64;
    for (pos, got) in [(4, step), (5, last)] {
        let got: Vec<f32> = got.into_data().into_vec().unwrap();
        let want = &full[pos * v..(pos + 1) * v];
        let err = max_abs_diff(&got, want);
        assert!(err < 1e-4, "position {pos}: {err}");
    }
}

#[test]
fn generator_steps_give_the_full_pass_logits_and_start_over() {
    let model = tiny_config().init::<B>(&Default::default());
    let ids = [1u32, 2, 3, 4, 5, 6];
    let full = logits(&model, &ids.map(i64::from));
    let v = 64;
    let close = |got: Tensor<B, 2>, pos: usize| {
        let got: Vec<f32> = got.into_data().into_vec().unwrap();
        let err = max_abs_diff(&got, &full[pos * v..(pos + 1) * v]);
        assert!(err < 1e-4, "position {pos}: {err}");
    };
    // A graph asked for where none applies (the CPU backend): the forward, with the reason.
    for graph in [false, true] {
        let mut generator = Generator::new(&model, ids.len(), graph);
        assert!(generator.step(1).is_err(), "a step before any prompt");
        // Twice: a second prefill starts over on the same cache.
        for _ in 0..2 {
            close(generator.prefill(&ids[..4]).unwrap(), 3);
            close(generator.step(ids[4]).unwrap(), 4);
            close(generator.step(ids[5]).unwrap(), 5);
        }
        match (graph, generator.path()) {
            (false, DecodePath::Forward) | (true, DecodePath::ForwardInstead(_)) => {}
            (_, path) => panic!("graph {graph}: {path:?}"),
        }
    }
}

#[test]
fn packed_layers_carry_a_packed_model_into_another_copy() {
    let dense = tiny_config().init::<B>(&Default::default());
    let mut packed = dense.clone();
    sparsify(
        &mut packed,
        &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
        |n| n != "lm_head",
    )
    .unwrap();
    packed.fuse_projections().unwrap();
    let mut copy = dense;
    copy.fuse_projections().unwrap();
    let layers = packed.packed_layers().unwrap();
    assert_eq!(layers.layers.len(), 8, "qkv, o, gate_up, down per block");
    let loaded =
        burn_slidesparse::load_packed(&mut copy, layers, "packed", |n| n.to_string()).unwrap();
    assert_eq!(loaded.len(), 8);
    let ids = [3i64, 17, 42, 5, 9];
    assert_eq!(logits(&copy, &ids), logits(&packed, &ids));
}

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A tiny Llama GGUF with F32 tensors taken from a random model, plus a 5-token vocabulary.
fn tiny_gguf(model: &Llama<B>, config: &LlamaConfig) -> Vec<u8> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, t: Tensor<B, 2>| {
        let dims = t.dims().to_vec();
        tensors.push((name, dims, t.into_data().into_vec().unwrap()));
    };
    add("token_embd.weight".into(), model.embed.weight.val());
    let norm = |t: Tensor<B, 1>| t.unsqueeze::<2>();
    add("output_norm.weight".into(), norm(model.norm.gamma.val()));
    for (i, b) in model.blocks.iter().enumerate() {
        let w = |l: &burn_slidesparse::MaybeSparseLinear<B>| {
            l.dense().unwrap().weight.val().transpose()
        };
        add(
            format!("blk.{i}.attn_norm.weight"),
            norm(b.attn_norm.gamma.val()),
        );
        add(
            format!("blk.{i}.ffn_norm.weight"),
            norm(b.mlp_norm.gamma.val()),
        );
        for (n, l) in [
            ("attn_q", &b.attn_in.separate().unwrap()[0]),
            ("attn_k", &b.attn_in.separate().unwrap()[1]),
            ("attn_v", &b.attn_in.separate().unwrap()[2]),
            ("attn_output", &b.o),
            ("ffn_gate", &b.mlp_in.separate().unwrap()[0]),
            ("ffn_up", &b.mlp_in.separate().unwrap()[1]),
            ("ffn_down", &b.down),
        ] {
            add(format!("blk.{i}.{n}.weight"), w(l));
        }
    }
    let mut kv: Vec<(String, u32, Vec<u8>)> = Vec::new();
    let mut s = Vec::new();
    gguf_string(&mut s, "llama");
    kv.push(("general.architecture".into(), 8, s));
    for (k, v) in [
        ("llama.embedding_length", config.hidden),
        ("llama.feed_forward_length", config.intermediate),
        ("llama.block_count", config.layers),
        ("llama.attention.head_count", config.heads),
        ("llama.attention.head_count_kv", config.kv_heads),
    ] {
        kv.push((k.into(), 4, (v as u32).to_le_bytes().to_vec()));
    }
    kv.push((
        "llama.rope.freq_base".into(),
        6,
        config.rope_base.to_le_bytes().to_vec(),
    ));
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (k, t, v) in &kv {
        gguf_string(&mut out, k);
        out.extend(t.to_le_bytes());
        out.extend(v);
    }
    let mut offset = 0u64;
    for (name, dims, values) in &tensors {
        // 1-row norms are stored 1-D, as in real files.
        let ggml_dims: Vec<u64> = if dims[0] == 1 {
            vec![dims[1] as u64]
        } else {
            vec![dims[1] as u64, dims[0] as u64]
        };
        gguf_string(&mut out, name);
        out.extend((ggml_dims.len() as u32).to_le_bytes());
        ggml_dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(0u32.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (values.len() as u64 * 4).next_multiple_of(32);
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    for (_, _, values) in &tensors {
        values.iter().for_each(|v| out.extend(v.to_le_bytes()));
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
    }
    out
}

#[test]
fn gguf_loader_reproduces_the_model_and_reports_missing_tensors() {
    let config = tiny_config();
    let model = config.init::<B>(&Default::default());
    let bytes = tiny_gguf(&model, &config);
    let file = GgufFile::parse("tiny", &bytes).unwrap();
    let loaded = load_llama::<B>(&file, 64, &Default::default()).unwrap();
    let ids = [7, 8, 9];
    // The random model's head is its tied embedding, as the loader builds it.
    let (a, b) = (logits(&model, &ids), logits(&loaded, &ids));
    let err = max_abs_diff(&a, &b);
    assert!(err < 1e-5, "{err}");
    // A file without one block tensor is an error naming it.
    let mut renamed = bytes.clone();
    let pos = renamed
        .windows(19)
        .position(|w| w == b"blk.1.ffn_up.weight")
        .unwrap();
    renamed[pos + 10..pos + 12].copy_from_slice(b"XX");
    let file = GgufFile::parse("tiny", &renamed).unwrap();
    let err = load_llama::<B>(&file, 64, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.1.ffn_up.weight"), "{err}");
}

#[test]
fn calibration_norms_drive_activation_aware_packing() {
    let config = tiny_config();
    let model = config.init::<B>(&Default::default());
    let norms = model.input_norms(tokens(&[1, 5, 9, 13, 17, 21]));
    assert_eq!(norms.len(), 14);
    for (name, n) in &norms {
        let expected = if name.ends_with("down_proj") {
            config.intermediate
        } else {
            config.hidden
        };
        assert_eq!(n.len(), expected, "{name}");
        assert!(n.iter().all(|v| v.is_finite() && *v >= 0.0), "{name}");
    }
    let mut sparse = model.clone();
    let packed = burn_slidesparse::sparsify_with(&mut sparse, |name| {
        Some(PackOptions {
            pattern: SparsityPattern::P6_8,
            precision: Precision::F32,
            prune: burn_slidesparse::PruneMethod::ActivationAware {
                input_norms: norms.get(name)?.clone(),
            },
            alignment: 64,
            permutation: Default::default(),
        })
    })
    .unwrap();
    assert_eq!(
        packed.len(),
        14,
        "the LM head has no calibration entry and stays dense"
    );
    assert_eq!(logits(&sparse, &[2, 4]).len(), 2 * 64);
}

/// `[out, in]` rows of a dense layer of the model (burn stores `[in, out]`).
fn rows_of(layer: &burn_slidesparse::MaybeSparseLinear<B>) -> (Vec<f32>, Vec<usize>) {
    let w = layer.dense().unwrap().weight.val().transpose();
    let shape = w.dims().to_vec();
    (w.into_data().into_vec().unwrap(), shape)
}

fn write_hf_checkpoint(model: &Llama<B>, config: &LlamaConfig, dir: &std::path::Path) {
    slidesparse_examples::hf_llama::write_hf_checkpoint(model, config, dir).unwrap();
}

#[test]
fn hf_checkpoint_of_a_llama_without_biases_reads_back_the_same_model() {
    use slidesparse_examples::hf_llama::load_hf_llama;
    let device = Default::default();
    for tie in [true, false] {
        let config = tiny_config().with_tie_embeddings(tie);
        let model = config.init::<B>(&device);
        let dir = tempfile::tempdir().unwrap();
        write_hf_checkpoint(&model, &config, dir.path());
        let json = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
        assert!(json.contains(r#""model_type":"llama""#), "{json}");
        let mut loaded = load_hf_llama::<B>(dir.path(), 64, &device).unwrap();
        for (name, layer) in loaded.blocks[0].linears_mut() {
            let bias = &layer.dense().unwrap().bias;
            assert!(bias.is_none(), "tied {tie}: {name} read back with a bias");
        }
        let ids = [3i64, 17, 42, 5, 63, 0, 9];
        let (a, b) = (logits(&model, &ids), logits(&loaded, &ids));
        let max = max_abs_diff(&a, &b);
        assert!(max < 1e-5, "tied {tie}: max logit difference {max}");
    }
}

#[test]
fn hf_loader_reproduces_a_qwen2_style_model_and_reports_bad_files() {
    use slidesparse_examples::hf_llama::load_hf_llama;
    let device = Default::default();
    // Qwen2-style: q/k/v bias, untied head; random norms so that they are checked too.
    let config = tiny_config()
        .with_qkv_bias(true)
        .with_tie_embeddings(false)
        .with_rope_base(10000.0)
        .with_rms_eps(1e-6);
    let mut model = config.init::<B>(&device);
    for block in &mut model.blocks {
        block.attn_norm.gamma = block
            .attn_norm
            .gamma
            .clone()
            .map(|g| g.random_like(burn::tensor::Distribution::Uniform(0.5, 1.5)));
    }
    let dir = tempfile::tempdir().unwrap();
    write_hf_checkpoint(&model, &config, dir.path());
    let loaded = load_hf_llama::<B>(dir.path(), 64, &device).unwrap();
    let ids = [3i64, 17, 42, 5, 63, 0, 9];
    let (a, b) = (logits(&model, &ids), logits(&loaded, &ids));
    let max = max_abs_diff(&a, &b);
    assert!(max < 1e-5, "max logit difference {max}");

    // A missing tensor and a wrong shape are named.
    let st = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = parsed
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "model.layers.1.mlp.up_proj.weight")
        .collect();
    std::fs::write(&st, safetensors::serialize(kept, None).unwrap()).unwrap();
    let err = load_hf_llama::<B>(dir.path(), 64, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "gpt_neox"}"#,
    )
    .unwrap();
    let err = load_hf_llama::<B>(dir.path(), 64, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("gpt_neox"), "{err}");
}

/// Random blocks of a k-quant type (ggml id, bytes per 256 values, offsets of its f16
/// super-scales) with the super-scales set to small values, as a quantizer would.
fn random_k_blocks(kind: (u32, usize, &[usize]), values: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let (_, block_bytes, scales) = kind;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut bytes: Vec<u8> = (0..values / 256 * block_bytes)
        .map(|_| rng.random())
        .collect();
    for block in bytes.chunks_mut(block_bytes) {
        for &at in scales {
            let d = half::f16::from_f32(rng.random_range(0.0005f32..0.002));
            block[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    bytes
}

/// A model file mixing tensor types the way `Q4_K_M` / `Q5_K_M` files do (different k-quants
/// per tensor, norms in F32) loads, and every linear holds exactly the reader's values.
#[test]
fn gguf_loader_reads_a_model_mixing_k_quant_types() {
    const Q2K: (u32, usize, &[usize]) = (10, 84, &[80, 82]);
    const Q3K: (u32, usize, &[usize]) = (11, 110, &[108]);
    const Q4K: (u32, usize, &[usize]) = (12, 144, &[0, 2]);
    const Q5K: (u32, usize, &[usize]) = (13, 176, &[0, 2]);
    const Q6K: (u32, usize, &[usize]) = (14, 210, &[208]);
    // k-quants need rows of whole 256-value super-blocks.
    let config = LlamaConfig::new(64, 256, 256, 1, 4, 2).with_max_seq_len(16);
    let (h, ff, kv) = (256u64, 256u64, 128u64);
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = Vec::new();
    let ones: Vec<u8> = (0..h).flat_map(|_| 1f32.to_le_bytes()).collect();
    for (i, (name, kind, rows, cols)) in [
        ("token_embd.weight", Q4K, 64, h),
        ("output.weight", Q6K, 64, h),
        ("blk.0.attn_q.weight", Q4K, h, h),
        ("blk.0.attn_k.weight", Q2K, kv, h),
        ("blk.0.attn_v.weight", Q6K, kv, h),
        ("blk.0.attn_output.weight", Q4K, h, h),
        ("blk.0.ffn_gate.weight", Q5K, ff, h),
        ("blk.0.ffn_up.weight", Q3K, ff, h),
        ("blk.0.ffn_down.weight", Q6K, h, ff),
    ]
    .into_iter()
    .enumerate()
    {
        let data = random_k_blocks(kind, (rows * cols) as usize, i as u64);
        tensors.push((name.into(), vec![cols, rows], kind.0, data));
    }
    for name in [
        "output_norm.weight",
        "blk.0.attn_norm.weight",
        "blk.0.ffn_norm.weight",
    ] {
        tensors.push((name.into(), vec![h], 0, ones.clone()));
    }
    let mut kv_meta: Vec<(String, u32, Vec<u8>)> = Vec::new();
    let mut s = Vec::new();
    gguf_string(&mut s, "llama");
    kv_meta.push(("general.architecture".into(), 8, s));
    for (k, v) in [
        ("llama.embedding_length", config.hidden),
        ("llama.feed_forward_length", config.intermediate),
        ("llama.block_count", config.layers),
        ("llama.attention.head_count", config.heads),
        ("llama.attention.head_count_kv", config.kv_heads),
    ] {
        kv_meta.push((k.into(), 4, (v as u32).to_le_bytes().to_vec()));
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv_meta.len() as u64).to_le_bytes());
    for (k, t, v) in &kv_meta {
        gguf_string(&mut out, k);
        out.extend(t.to_le_bytes());
        out.extend(v);
    }
    let mut offset = 0u64;
    for (name, dims, type_id, data) in &tensors {
        gguf_string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(type_id.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (data.len() as u64).next_multiple_of(32);
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    for (_, _, _, data) in &tensors {
        out.extend(data);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
    }
    let file = GgufFile::parse("q4_k_m-like", &out).unwrap();
    let model = load_llama::<B>(&file, 16, &Default::default()).unwrap();
    let block = &model.blocks[0];
    for (name, layer) in [
        ("blk.0.attn_q.weight", &block.attn_in.separate().unwrap()[0]),
        ("blk.0.attn_k.weight", &block.attn_in.separate().unwrap()[1]),
        ("blk.0.attn_v.weight", &block.attn_in.separate().unwrap()[2]),
        ("blk.0.attn_output.weight", &block.o),
        (
            "blk.0.ffn_gate.weight",
            &block.mlp_in.separate().unwrap()[0],
        ),
        ("blk.0.ffn_up.weight", &block.mlp_in.separate().unwrap()[1]),
        ("blk.0.ffn_down.weight", &block.down),
        ("output.weight", &model.lm_head),
    ] {
        let (expected, shape) = file.tensor_f32(name).unwrap();
        let (got, got_shape) = rows_of(layer);
        assert_eq!(got_shape, shape, "{name}");
        assert_eq!(got, expected, "{name}");
        assert!(expected.iter().any(|&v| v != 0.0), "{name}: all zero");
    }
    let embed: Vec<f32> = model.embed.weight.val().into_data().into_vec().unwrap();
    assert_eq!(embed, file.tensor_f32("token_embd.weight").unwrap().0);
    assert!(logits(&model, &[1, 2, 3]).iter().all(|v| v.is_finite()));
}

/// Splits the single `model.safetensors` of `dir` into two shards plus the index, putting
/// the tensors named in `in_both` into both shards.
fn shard_checkpoint(dir: &std::path::Path, in_both: &[&str]) {
    let single = dir.join("model.safetensors");
    let bytes = std::fs::read(&single).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = parsed.names().into_iter().map(String::from).collect();
    names.sort();
    let (mut shards, mut weight_map) = ([Vec::new(), Vec::new()], serde_json::Map::new());
    for (i, name) in names.iter().enumerate() {
        let view = parsed.tensor(name).unwrap();
        let shard = i % 2;
        shards[shard].push((name.clone(), view.clone()));
        if in_both.contains(&name.as_str()) {
            shards[1 - shard].push((name.clone(), view));
        }
        weight_map.insert(
            name.clone(),
            format!("model-0000{}-of-00002.safetensors", shard + 1).into(),
        );
    }
    for (i, tensors) in shards.iter().enumerate() {
        let path = dir.join(format!("model-0000{}-of-00002.safetensors", i + 1));
        std::fs::write(path, safetensors::serialize(tensors.clone(), None).unwrap()).unwrap();
    }
    let index = serde_json::json!({"weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::remove_file(single).unwrap();
}

#[test]
fn hf_loader_reads_sharded_checkpoints_lazily_and_refuses_a_tensor_in_two_shards() {
    use slidesparse_examples::hf_llama::load_hf_llama;
    let device = Default::default();
    let config = tiny_config().with_qkv_bias(true).with_tie_embeddings(false);
    let model = config.init::<B>(&device);
    let ids = [3i64, 17, 42, 5];
    for duplicate in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_hf_checkpoint(&model, &config, dir.path());
        let in_both: &[&str] = if duplicate {
            &["model.layers.0.mlp.up_proj.weight"]
        } else {
            &[]
        };
        shard_checkpoint(dir.path(), in_both);
        let result = load_hf_llama::<B>(dir.path(), 64, &device);
        if duplicate {
            let err = result.err().unwrap().to_string();
            assert!(
                err.contains("model.layers.0.mlp.up_proj.weight") && err.contains("both"),
                "{err}"
            );
        } else {
            let loaded = result.unwrap();
            let (a, b) = (logits(&model, &ids), logits(&loaded, &ids));
            assert_eq!(a.len(), b.len());
            let max = max_abs_diff(&a, &b);
            assert!(max < 1e-5, "max logit difference {max}");
        }
    }
}

/// Fusing q/k/v and gate/up gives the logits of the separate layers (dense f32, SlideSparse
/// f32 and INT8, dense INT8), lists the fused names, and refuses layers of mixed kinds.
#[test]
fn fused_projections_give_the_logits_of_separate_ones() {
    let device = Default::default();
    let ids = [3, 17, 42, 5, 9];
    let mut dense = tiny_config().with_qkv_bias(true).init::<B>(&device);
    prune_dense_in_place(&mut dense, SparsityPattern::P6_8);
    // burn initializes parameters lazily, each clone on its own: materialize them first.
    logits(&dense, &ids);
    let blocks_only = |n: &str| n != "lm_head";
    let variants: Vec<(&str, Llama<B>)> = vec![
        ("dense", dense.clone()),
        ("6:8 f32", {
            let mut m = dense.clone();
            sparsify(
                &mut m,
                &PackOptions::new(SparsityPattern::P6_8, Precision::F32),
                blocks_only,
            )
            .unwrap();
            m
        }),
        ("6:8 int8", {
            let mut m = dense.clone();
            sparsify(
                &mut m,
                &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
                blocks_only,
            )
            .unwrap();
            m
        }),
        ("dense int8", {
            let mut m = dense.clone();
            burn_slidesparse::quantize_dense(&mut m, Precision::Int8, blocks_only).unwrap();
            m
        }),
    ];
    for (what, separate) in variants {
        let mut fused = separate.clone();
        fused.fuse_projections().unwrap();
        let (a, b) = (logits(&separate, &ids), logits(&fused, &ids));
        let err = max_abs_diff(&a, &b);
        assert!(err < 1e-4, "{what}: max |diff| {err}");
        let mut names = Vec::new();
        fused
            .visit_linears(&mut |name, _| {
                names.push(name.to_string());
                Ok(())
            })
            .unwrap();
        assert_eq!(
            &names[..4],
            [
                "layers.0.qkv_proj",
                "layers.0.o_proj",
                "layers.0.gate_up_proj",
                "layers.0.down_proj"
            ],
            "{what}"
        );
    }
    // One sparse and two dense projections cannot be one layer: an error, the model unchanged.
    let mut mixed = dense.clone();
    let block = &mut mixed.blocks[0];
    let q = burn_slidesparse::SlideSparseLinear::from_linear(
        block.attn_in.separate().unwrap()[0].dense().unwrap(),
        &PackOptions::new(SparsityPattern::P6_8, Precision::F32),
    )
    .unwrap();
    block.attn_in.set(0, q.into());
    let err = block.fuse_projections().unwrap_err();
    assert!(err.to_string().contains("different kinds"), "{err}");
    assert!(block.attn_in.separate().is_some_and(|l| l.len() == 3));
}

/// A cache given its capacity up front and one that grows (copying) give the same logits.
#[test]
fn kv_cache_capacity_given_or_grown_gives_the_same_logits() {
    let model = tiny_config().init::<B>(&Default::default());
    let ids = [1i64, 2, 3, 4, 5, 6, 7];
    let run = |mut cache: KvCache<B>| {
        let mut out = Vec::new();
        for chunk in [&ids[..3], &ids[3..4], &ids[4..6], &ids[6..]] {
            let l: Vec<f32> = model
                .forward(tokens(chunk), &mut cache)
                .into_data()
                .into_vec()
                .unwrap();
            out.extend(l);
        }
        (out, cache.capacity())
    };
    let (grown, cap_grown) = run(KvCache::default());
    let (given, cap_given) = run(KvCache::with_capacity(16));
    assert_eq!((cap_grown, cap_given), (12, 16));
    assert_eq!(grown, given);
}

/// The input and output of every step of a block walk are the block forward's on the model as
/// it is at that step (bit for bit), while each group is pruned before the next step: what
/// sequential SparseGPT relies on to compute each group's calibration once.
#[test]
fn block_walk_gives_each_group_its_input_on_the_model_as_it_is() {
    use burn::tensor::Distribution;
    let device = Default::default();
    let mut model = tiny_config().init::<B>(&device);
    let groups: [&[&str]; 4] = [
        &["q_proj", "k_proj", "v_proj"],
        &["o_proj"],
        &["gate_proj", "up_proj"],
        &["down_proj"],
    ];
    let observed = |model: &Llama<B>, block: usize, x: &Tensor<B, 3>, name: &str| {
        let mut seen = None;
        let out = model.block_forward(block, x.clone(), &mut |n, input| {
            if n == name {
                seen = Some(input.clone().into_data());
            }
        });
        (seen.expect("observed"), out.into_data())
    };
    let mut x = Tensor::<B, 3>::random([2, 5, 32], Distribution::Normal(0.0, 1.0), &device);
    for block in 0..2 {
        let dense = model.clone();
        let mut walk = model.walk_block(block, x.clone());
        for (g, names) in groups.iter().enumerate() {
            if g > 0 {
                model.walk_step(&mut walk);
            }
            let (now, _) = observed(&model, block, &x, names[0]);
            walk.input().to_data().assert_eq(&now, true);
            if g > 0 {
                // The groups before were pruned: the dense model's input differs.
                let (before, _) = observed(&dense, block, &x, names[0]);
                assert_ne!(walk.input().to_data(), before, "block {block} group {g}");
            }
            let packed = sparsify(
                &mut model,
                &PackOptions::new(SparsityPattern::P6_8, Precision::Int8),
                |n| names.iter().any(|m| n == format!("layers.{block}.{m}")),
            )
            .unwrap();
            assert_eq!(packed.len(), names.len());
        }
        model.walk_step(&mut walk);
        let (_, out) = observed(&model, block, &x, "q_proj");
        let output = walk.into_output();
        output.to_data().assert_eq(&out, true);
        x = output;
    }
}
