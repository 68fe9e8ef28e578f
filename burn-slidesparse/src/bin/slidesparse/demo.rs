//! The layer comparison the `slidesparse demo` command prints.

use std::path::Path;

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData},
};
use rand::{Rng, SeedableRng, rngs::StdRng};

use burn_slidesparse::{
    PackedFile, Result, SlideSparseError, SlideSparseLinear, internals::format,
};

/// Loads layer `name` from a packed file, runs it on random tokens with the reference
/// backend, and prints its relative error against the dense original and the pruned
/// original.
pub fn compare_layer_with_dense(packed: &Path, dense: &Path, name: &str) -> Result<()> {
    let file = PackedFile::load(packed)?;
    let layer = file
        .layer(name)
        .ok_or_else(|| SlideSparseError::MissingTensor {
            name: name.to_string(),
            path: packed.display().to_string(),
        })?;
    let bytes = std::fs::read(dense).map_err(|e| SlideSparseError::io(dense, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|source| {
        SlideSparseError::SafeTensors {
            path: dense.display().to_string(),
            source,
        }
    })?;
    let view = st
        .tensor(name)
        .map_err(|_| SlideSparseError::MissingTensor {
            name: name.into(),
            path: dense.display().to_string(),
        })?;
    let w = format::read_f32(name, &view)?;
    let (n, k) = (layer.out_features(), layer.in_features);
    let m = 64;
    let mut rng = StdRng::seed_from_u64(3);
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let device = Default::default();
    let module = SlideSparseLinear::<NdArray>::from_packed(layer, &device);
    let input = Tensor::<NdArray, 2>::from_data(TensorData::new(x.clone(), [m, k]), &device);
    let y: Vec<f32> = module
        .forward(input)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32");
    let unslid = layer.unslide()?.dequantize();
    let err = |weights: &[f32]| {
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for i in 0..m {
            for j in 0..n {
                let r: f64 = (0..k)
                    .map(|t| x[i * k + t] as f64 * weights[j * k + t] as f64)
                    .sum();
                num += (y[i * n + j] as f64 - r).powi(2);
                den += r * r;
            }
        }
        (num / den).sqrt()
    };
    println!(
        "   {name} [{n}x{k}], {} {}: K' = {}, 64 tokens",
        layer.pattern,
        layer.precision(),
        layer.k_prime()
    );
    println!(
        "   relative error vs the pruned+quantized weight: {:.2e} (activation quantization only)",
        err(&unslid)
    );
    println!(
        "   relative error vs the dense original:          {:.2e} (pruning + quantization)",
        err(&w)
    );
    Ok(())
}
