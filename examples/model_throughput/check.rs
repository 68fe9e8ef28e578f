//! `--check`: a small model's logits on the GPU against the CPU reference.

use burn::{
    module::Module,
    tensor::{Int, Tensor},
};
use burn_slidesparse::SlideSparseBackend;
use slidesparse_examples::llama::{KvCache, Llama, LlamaConfig};

use crate::variants::{Materialize, convert};

/// Logits of a small model of Llama-3's head size (2 blocks, GQA 4:1, head dim 128) on `B`
/// in bf16 against the same weights on the CPU reference in f32: a whole-prompt forward,
/// the same prompt as a prefill plus cached decode steps (the cache written in place), with
/// fused and separate projections, dense and 6:8 INT8. Errors if any relative L2 error is
/// above bf16's and INT8's tolerance.
pub(crate) fn check_against_the_cpu<B: SlideSparseBackend>()
-> Result<(), Box<dyn std::error::Error>> {
    use burn::{
        backend::NdArray,
        record::{BinBytesRecorder, FullPrecisionSettings, Recorder},
    };
    let config = LlamaConfig::new(512, 1024, 2048, 2, 8, 2)
        .with_max_seq_len(256)
        .with_tie_embeddings(false);
    let cpu_device = Default::default();
    let cpu = config.init::<NdArray>(&cpu_device);
    cpu.visit(&mut Materialize);
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(cpu.clone().into_record(), ())?;
    let device = Default::default();
    let gpu = config
        .init::<B>(&device)
        .load_record(recorder.load(bytes, &device)?);
    let ids: Vec<i64> = (0..40).map(|i| (i * 37 + 11) % 512).collect();
    for variant in ["bf16", "6:8-int8"] {
        let (mut reference, mut engine) = (cpu.clone(), gpu.clone());
        if variant != "bf16" {
            convert(&mut reference, variant)?;
            convert(&mut engine, variant)?;
        }
        let want = last_logits(&reference, &ids, &[ids.len()]);
        for fused in [false, true] {
            let mut engine = engine.clone();
            if fused {
                engine.fuse_projections()?;
            }
            for chunks in [vec![ids.len()], vec![32, 1, 1, 6]] {
                let got = last_logits(&engine, &ids, &chunks);
                let err = relative_l2(&want, &got);
                let tolerance = if variant == "bf16" { 0.02 } else { 0.05 };
                eprintln!(
                    "check {}: {variant}, fused {fused}, chunks {chunks:?}: relative L2 error {err:.2e} (tolerance {tolerance})",
                    if std::any::type_name::<B>().contains("Fusion") {
                        "fusion"
                    } else {
                        "plain"
                    }
                );
                if err.is_nan() || err > tolerance {
                    return Err(format!(
                        "check failed: {variant}, fused {fused}, chunks {chunks:?}: {err}"
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// The last position's logits of `ids` fed in `chunks` through one KV cache, as f32.
pub(crate) fn last_logits<B: SlideSparseBackend>(
    model: &Llama<B>,
    ids: &[i64],
    chunks: &[usize],
) -> Vec<f32> {
    let device = model.embed.weight.device();
    let mut cache = KvCache::default();
    let mut at = 0;
    let mut last = None;
    for &n in chunks {
        let tokens = Tensor::<B, 2, Int>::from_data(
            burn::tensor::TensorData::new(ids[at..at + n].to_vec(), [1, n]),
            &device,
        );
        last = Some(model.forward_last(tokens, &mut cache));
        at += n;
    }
    last.expect("one chunk at least")
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 logits")
}

pub(crate) fn relative_l2(want: &[f32], got: &[f32]) -> f32 {
    let diff: f32 = want.iter().zip(got).map(|(a, b)| (a - b).powi(2)).sum();
    let norm: f32 = want.iter().map(|a| a * a).sum();
    (diff / norm).sqrt()
}
