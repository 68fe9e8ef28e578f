//! Random HF-style Llama checkpoints for the CLI's `generate` and `demo` commands and the
//! project's tests (feature `internals`; not part of the user-facing API).

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use safetensors::Dtype;

use crate::{
    error::{Result, SlideSparseError},
    files::write_atomically,
    format::OwnedTensor,
};

/// Writes a random HF-style Llama checkpoint (f32 or bf16), for demos, tests and packing
/// speed measurements. Returns its size in bytes.
pub fn write_random_checkpoint(
    path: &Path,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    dtype: Dtype,
    seed: u64,
) -> Result<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tensors = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, rng: &mut StdRng| {
        let n: usize = shape.iter().product();
        let scale = 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt();
        let values = (0..n).map(|_| rng.random_range(-1.0f32..1.0) * scale);
        let data: Vec<u8> = match dtype {
            Dtype::BF16 => values
                .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            _ => values.flat_map(|v| v.to_le_bytes()).collect(),
        };
        tensors.push((
            name,
            OwnedTensor {
                dtype: if dtype == Dtype::BF16 {
                    Dtype::BF16
                } else {
                    Dtype::F32
                },
                shape,
                data,
            },
        ));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![1024, hidden],
        &mut rng,
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            add(
                format!("{p}.self_attn.{proj}.weight"),
                vec![hidden, hidden],
                &mut rng,
            );
        }
        add(format!("{p}.self_attn.q_proj.bias"), vec![hidden], &mut rng);
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![intermediate, hidden],
            &mut rng,
        );
        add(
            format!("{p}.mlp.up_proj.weight"),
            vec![intermediate, hidden],
            &mut rng,
        );
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![hidden, intermediate],
            &mut rng,
        );
        add(
            format!("{p}.input_layernorm.weight"),
            vec![hidden],
            &mut rng,
        );
    }
    add("model.norm.weight".into(), vec![hidden], &mut rng);
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), None)
        .map_err(|source| SlideSparseError::SafeTensors {
            path: path.display().to_string(),
            source,
        })?;
    write_atomically(path, &bytes)?;
    Ok(bytes.len() as u64)
}
