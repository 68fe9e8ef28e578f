//! Writes a random Hugging Face Llama checkpoint folder (`config.json`, safetensors shards
//! and their index, and a byte-level `tokenizer.json` when the vocabulary has >= 256 tokens)
//! of any shape, tensor by tensor, so that loading, packing and serving can be run at model
//! scale without downloading weights. The values are uniform noise: the folder is for timing,
//! memory and flow checks; what `generate` prints from it is noise too.
//!
//! `cargo run --release -p slidesparse-examples --example write_hf_checkpoint -- DIR
//! --hidden 2048 --intermediate 5632 --layers 22 --heads 32 --kv-heads 4 --vocab 32000`

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::PathBuf,
};

use clap::Parser;
use rand::{Rng, SeedableRng, rngs::StdRng};
use slidesparse_examples::tokenizer::byte_level_tokenizer_json;

#[derive(Parser)]
struct Args {
    /// Output folder (created).
    dir: PathBuf,
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    #[arg(long, default_value_t = 5632)]
    intermediate: usize,
    #[arg(long, default_value_t = 22)]
    layers: usize,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// `bf16` (as most checkpoints are published) or `f32`.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Largest shard in MB (a tensor is never split; a tensor larger than this gets a shard
    /// of its own). 0 writes a single `model.safetensors` without an index.
    #[arg(long, default_value_t = 0)]
    shard_mb: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let (dtype, elem) = match args.dtype.as_str() {
        "bf16" => ("BF16", 2),
        "f32" => ("F32", 4),
        other => return Err(format!("unknown --dtype {other}: bf16 or f32").into()),
    };
    if args.heads == 0 || args.hidden % args.heads != 0 || args.heads % args.kv_heads.max(1) != 0 {
        return Err("--hidden must be a multiple of --heads, and --heads of --kv-heads".into());
    }
    let (h, ff) = (args.hidden, args.intermediate);
    let kv = args.kv_heads * (h / args.heads);
    let mut tensors: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![args.vocab, h])];
    for l in 0..args.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        tensors.extend([
            (p("self_attn.q_proj.weight"), vec![h, h]),
            (p("self_attn.k_proj.weight"), vec![kv, h]),
            (p("self_attn.v_proj.weight"), vec![kv, h]),
            (p("self_attn.o_proj.weight"), vec![h, h]),
            (p("mlp.gate_proj.weight"), vec![ff, h]),
            (p("mlp.up_proj.weight"), vec![ff, h]),
            (p("mlp.down_proj.weight"), vec![h, ff]),
            (p("input_layernorm.weight"), vec![h]),
            (p("post_attention_layernorm.weight"), vec![h]),
        ]);
    }
    tensors.push(("model.norm.weight".into(), vec![h]));
    tensors.push(("lm_head.weight".into(), vec![args.vocab, h]));

    // Group the tensors into shards of at most `shard_mb` (one shard when 0).
    let limit = if args.shard_mb == 0 {
        usize::MAX
    } else {
        args.shard_mb << 20
    };
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut size = 0;
    for t in tensors {
        let bytes = t.1.iter().product::<usize>() * elem;
        if size > 0 && size + bytes > limit {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        shards.last_mut().expect("one shard").push(t);
    }
    std::fs::create_dir_all(&args.dir)?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut weight_map = serde_json::Map::new();
    let n = shards.len();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let file_name = if args.shard_mb == 0 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        // The header first (offsets follow from the shapes), then each tensor's data as it
        // is drawn: nothing larger than one tensor is ever held in memory.
        let mut header = serde_json::Map::new();
        let mut offset = 0usize;
        for (name, shape) in shard {
            let len = shape.iter().product::<usize>() * elem;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
            );
            offset += len;
            weight_map.insert(name.clone(), file_name.clone().into());
        }
        let mut text = serde_json::Value::Object(header).to_string();
        while !text.len().is_multiple_of(8) {
            text.push(' ');
        }
        let mut out = BufWriter::with_capacity(1 << 22, File::create(args.dir.join(&file_name))?);
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(text.as_bytes())?;
        for (name, shape) in shard {
            let count: usize = shape.iter().product();
            // Norm weights near 1, matrices scaled like a trained model's (1/sqrt(fan_in)).
            let (center, scale) = if shape.len() == 1 {
                (1.0, 0.1)
            } else {
                (0.0, 1.0 / (shape[1] as f32).sqrt())
            };
            let mut buf = Vec::with_capacity(count * elem);
            for _ in 0..count {
                let v = center + scale * rng.random_range(-1.0f32..1.0);
                if elem == 2 {
                    buf.extend(half::bf16::from_f32(v).to_le_bytes());
                } else {
                    buf.extend(v.to_le_bytes());
                }
            }
            out.write_all(&buf)?;
            let _ = name;
        }
        out.flush()?;
        total += 8 + text.len() as u64 + offset as u64;
    }
    if args.shard_mb != 0 {
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            args.dir.join("model.safetensors.index.json"),
            index.to_string(),
        )?;
    }
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": args.vocab, "hidden_size": h,
        "intermediate_size": ff, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    });
    std::fs::write(args.dir.join("config.json"), config.to_string())?;
    // A byte-level vocabulary (token b is byte b) so that `generate --hf` runs on the folder;
    // the text it generates is noise, like the weights.
    if args.vocab >= 256 {
        std::fs::write(
            args.dir.join("tokenizer.json"),
            byte_level_tokenizer_json(args.vocab),
        )?;
    }
    println!(
        "wrote {} ({n} file(s), {:.2} GB)",
        args.dir.display(),
        total as f64 / 1e9
    );
    Ok(())
}
