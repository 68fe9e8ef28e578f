//! Perplexity with sliding windows and exact token counts, shared by the `perplexity` and
//! `finetune_then_pack` examples, and the calibration of Wanda and SparseGPT pruning.

use burn::tensor::{Int, Tensor, TensorData, activation::log_softmax, backend::Backend};
use burn_slidesparse::{
    PackOptions, SlideSparseBackend, SlideSparseError, SparseGptCalibration, sparsify_with,
};
use indicatif::ProgressBar;

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

/// Text for Wanda's activation statistics: `path`, else the Apache-2.0 license text most Linux
/// systems ship, else a short built-in passage (any ordinary English works; it must not be
/// the text being evaluated).
pub fn calibration_text(path: Option<&std::path::Path>) -> Result<String, String> {
    const SYSTEM_TEXT: &str = "/usr/share/common-licenses/Apache-2.0";
    match path {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display())),
        None => {
            Ok(std::fs::read_to_string(SYSTEM_TEXT)
                .unwrap_or_else(|_| BUILT_IN_CALIBRATION.repeat(4)))
        }
    }
}

/// Fallback calibration text (written for this project).
const BUILT_IN_CALIBRATION: &str = "The harbour town woke slowly. Fishing boats came back \
before dawn, their crews sorting the catch while gulls argued over the scraps. In the market \
square the baker opened his shutters, and the smell of bread drifted down to the quay. \
Children ran to school along the sea wall, counting the ships at anchor and guessing where \
each had sailed from. An old teacher explained to them that every ship keeps a log: the \
weather, the course, the cargo, and the names of the people on board. Writing things down, \
she said, is how sailors remember what the sea would rather they forgot. ";

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

/// `ids` cut into consecutive sequences of `seq` tokens, `[batch, seq]` (a shorter text is
/// one sequence; a remainder shorter than `seq` is dropped).
pub fn token_batch<B: Backend>(ids: &[u32], seq: usize, device: &B::Device) -> Tensor<B, 2, Int> {
    let seq = seq.clamp(1, ids.len().max(1));
    let batch = ids.len() / seq;
    let ids: Vec<i64> = ids[..batch * seq].iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq]), device)
}

/// The linears of one block pruned together by [`sparsegpt_sequential`], in order: each
/// group is calibrated on its inputs after the groups before it were pruned.
pub const SEQUENTIAL_GROUPS: [&[&str]; 4] = [
    &["q_proj", "k_proj", "v_proj"],
    &["o_proj"],
    &["gate_proj", "up_proj"],
    &["down_proj"],
];

/// `X^T X` (f64, row-major `[k, k]`) of the rows of `x [batch, t, k]`, computed on the
/// backend (f32 products).
fn gram<B: Backend>(x: &Tensor<B, 3>) -> Vec<f64> {
    let [b, t, k] = x.dims();
    let x = x.clone().reshape([b * t, k]);
    let g = x.clone().transpose().matmul(x);
    g.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// SparseGPT, layer after layer: block by block, and inside a block group by group
/// ([`SEQUENTIAL_GROUPS`]), each linear is pruned and packed with `options(name, calibration)`
/// where the calibration holds `X^T X` of the layer's inputs on `tokens [batch, t]` *through
/// the model pruned so far* (earlier blocks and groups already sparse, and quantized if
/// `options` says so). The hidden states are carried from block to block, so the whole run
/// costs about five forward passes over the calibration tokens. Returns the names packed.
pub fn sparsegpt_sequential<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    tokens: Tensor<B, 2, Int>,
    options: impl Fn(&str, SparseGptCalibration) -> PackOptions,
    bar: &ProgressBar,
) -> burn_slidesparse::Result<Vec<String>> {
    let mut packed = Vec::new();
    let mut x = model.embed.forward(tokens);
    for i in 0..model.blocks.len() {
        for group in SEQUENTIAL_GROUPS {
            bar.set_message(format!("layers.{i}.{}", group.join("/")));
            let mut seen = None;
            // The block's output is not needed here, only the group's input.
            let _ = model.block_forward(i, x.clone(), &mut |name, input| {
                if name == group[0] {
                    seen = Some(gram(input));
                }
            });
            let gram = seen.ok_or_else(|| {
                SlideSparseError::Backend(format!("layers.{i}.{}: input not observed", group[0]))
            })?;
            let names: Vec<String> = group.iter().map(|n| format!("layers.{i}.{n}")).collect();
            packed.extend(sparsify_with(model, |name| {
                names
                    .iter()
                    .any(|n| n == name)
                    .then(|| options(name, SparseGptCalibration::new(gram.clone())))
            })?);
            bar.inc(1);
        }
        x = model.block_forward(i, x, &mut |_, _| {});
    }
    Ok(packed)
}
