//! Perplexity with sliding windows and exact token counts, shared by the `perplexity` and
//! `finetune_then_pack` examples.

use burn::tensor::{Int, Tensor, TensorData, activation::log_softmax};
use burn_slidesparse::SlideSparseBackend;

use crate::llama::{KvCache, Llama};

/// (negative log-likelihood sum, scored tokens) of `ids` over windows of `window` tokens
/// moved by `stride`: every token after the first is scored exactly once, with up to
/// `window - stride` tokens of context from the previous window.
pub fn nll<B: SlideSparseBackend>(
    model: &Llama<B>,
    ids: &[u32],
    window: usize,
    stride: usize,
) -> (f64, usize) {
    assert!(stride > 0 && stride <= window, "need 0 < stride <= window");
    let device = model.embed.weight.device();
    let (mut total, mut count, mut scored_until) = (0.0f64, 0usize, 1usize);
    let mut start = 0;
    loop {
        let end = (start + window).min(ids.len());
        let chunk: Vec<i64> = ids[start..end].iter().map(|&i| i as i64).collect();
        let n = chunk.len();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(chunk.clone(), [1, n]), &device);
        let logp = log_softmax(model.forward(input, &mut KvCache::default()), 2);
        let logp: Vec<f32> = logp.into_data().convert::<f32>().into_vec().unwrap();
        let vocab = logp.len() / n;
        // Score target positions not scored by an earlier window.
        for pos in scored_until.max(start + 1)..end {
            let local = pos - start;
            total -= logp[(local - 1) * vocab + chunk[local] as usize] as f64;
            count += 1;
        }
        scored_until = end;
        if end == ids.len() {
            return (total, count);
        }
        start += stride;
    }
}

/// Perplexity `exp(nll / tokens)` and the number of scored tokens.
pub fn perplexity<B: SlideSparseBackend>(
    model: &Llama<B>,
    ids: &[u32],
    window: usize,
    stride: usize,
) -> (f64, usize) {
    let (nll, n) = nll(model, ids, window, stride);
    ((nll / n.max(1) as f64).exp(), n)
}

/// Wanda calibration: the per-input-channel activation norms of every block linear over the
/// first `tokens` tokens of `ids` (a text different from the evaluation text).
pub fn calibration_norms<B: SlideSparseBackend>(
    model: &Llama<B>,
    ids: &[u32],
    tokens: usize,
) -> std::collections::HashMap<String, Vec<f32>> {
    let ids: Vec<i64> = ids.iter().take(tokens).map(|&i| i as i64).collect();
    let n = ids.len();
    let input =
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), &model.embed.weight.device());
    model.input_norms(input)
}
