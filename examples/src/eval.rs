//! Perplexity with sliding windows and exact token counts, shared by the `perplexity` and
//! `finetune_then_pack` examples, and the calibration of Wanda and SparseGPT pruning.

use std::collections::HashMap;

use burn::tensor::{Int, Tensor, TensorData, activation::log_softmax, backend::Backend};
use burn_slidesparse::{
    ChannelPermutation, InputPermutation, PackOptions, PermutationSearch, PruneMethod,
    SlideSparseBackend, SlideSparseError, SparseGptCalibration, SparsityPattern, VisitLinears,
    search_permutation, sparsify_with,
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

/// How [`sparsegpt_sequential`] permutes each group's inputs.
pub struct SequentialPermutation<'a> {
    /// The search's settings.
    pub search: &'a PermutationSearch,
    /// Score with Wanda's `|w| * ||X[:, k]||` on the group's calibration inputs instead of
    /// SparseGPT's saliency `w^2 / [H^-1]_kk`.
    pub wanda_score: bool,
    /// Collects what the searches found.
    pub summary: &'a mut PermutationSummary,
}

/// `||X[:, k]||` from a Gram matrix `X^T X`: the square roots of its diagonal.
fn gram_norms(gram: &[f64]) -> Vec<f32> {
    let k = (gram.len() as f64).sqrt().round() as usize;
    (0..k)
        .map(|i| gram[i * k + i].max(0.0).sqrt() as f32)
        .collect()
}

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

/// The dense `[out, in]` (row-major) weights and output widths of the named linears of
/// `model`, in the order of `names` (an error if one is missing or no longer dense).
pub fn dense_weights<B: Backend>(
    model: &mut Llama<B>,
    names: &[String],
) -> burn_slidesparse::Result<Vec<(Vec<f32>, usize)>> {
    let mut found: HashMap<String, (Vec<f32>, usize)> = HashMap::new();
    model.visit_linears(&mut |name, layer| {
        if let Some(dense) = layer.dense().filter(|_| names.iter().any(|n| n == name)) {
            let weight = dense.weight.val();
            let [_, out] = weight.dims();
            let values = weight
                .transpose()
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e:?}")))?;
            found.insert(name.to_string(), (values, out));
        }
        Ok(())
    })?;
    names
        .iter()
        .map(|n| {
            found.remove(n).ok_or_else(|| {
                SlideSparseError::Backend(format!("{n}: no dense linear of that name"))
            })
        })
        .collect()
}

/// What the permutation searches of a model found, summed over its groups.
#[derive(Clone, Debug, Default)]
pub struct PermutationSummary {
    /// Groups searched.
    pub groups: usize,
    /// Mean over groups of the pruned fraction of the score energy, original order.
    pub pruned_before: f64,
    /// The same in the orders found.
    pub pruned_after: f64,
    /// Seconds spent searching.
    pub seconds: f64,
}

impl PermutationSummary {
    fn add(&mut self, outcome: &burn_slidesparse::PermutationOutcome, seconds: f64) {
        let n = self.groups as f64;
        self.pruned_before = (self.pruned_before * n + outcome.pruned_before) / (n + 1.0);
        self.pruned_after = (self.pruned_after * n + outcome.pruned_after) / (n + 1.0);
        self.groups += 1;
        self.seconds += seconds;
    }
}

impl std::fmt::Display for PermutationSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} groups permuted in {:.1} s, pruned score energy {:.2}% -> {:.2}% (mean)",
            self.groups,
            self.seconds,
            100.0 * self.pruned_before,
            100.0 * self.pruned_after
        )
    }
}

/// One input order for the group `names` (linears reading the same input), searched on
/// their dense weights in `model`, each scored with `method(name)`.
pub fn group_permutation<B: Backend>(
    model: &mut Llama<B>,
    names: &[String],
    pattern: SparsityPattern,
    method: &impl Fn(&str) -> PruneMethod,
    search: &PermutationSearch,
    summary: &mut PermutationSummary,
) -> burn_slidesparse::Result<InputPermutation> {
    let weights = dense_weights(model, names)?;
    let methods: Vec<PruneMethod> = names.iter().map(|n| method(n)).collect();
    let cols = weights[0].0.len() / weights[0].1.max(1);
    let layers: Vec<(&[f32], usize, &PruneMethod)> = weights
        .iter()
        .zip(&methods)
        .map(|((w, rows), m)| (w.as_slice(), *rows, m))
        .collect();
    let start = std::time::Instant::now();
    let outcome = search_permutation(&names.join("/"), &layers, cols, pattern, search)?;
    summary.add(&outcome, start.elapsed().as_secs_f64());
    Ok(outcome.permutation)
}

/// One input order per group of linears sharing an input ([`SEQUENTIAL_GROUPS`] of every
/// block: q/k/v, o, gate/up, down), searched on the dense weights with `method(name)`'s
/// scores (magnitude, Wanda). Returns the order of every block linear by name.
pub fn group_permutations<B: Backend>(
    model: &mut Llama<B>,
    pattern: SparsityPattern,
    method: impl Fn(&str) -> PruneMethod,
    search: &PermutationSearch,
    bar: &ProgressBar,
) -> burn_slidesparse::Result<(HashMap<String, InputPermutation>, PermutationSummary)> {
    let mut orders = HashMap::new();
    let mut summary = PermutationSummary::default();
    for i in 0..model.blocks.len() {
        for group in SEQUENTIAL_GROUPS {
            let names: Vec<String> = group.iter().map(|n| format!("layers.{i}.{n}")).collect();
            bar.set_message(names.join("/"));
            let order = group_permutation(model, &names, pattern, &method, search, &mut summary)?;
            for n in names {
                orders.insert(n, order.clone());
            }
            bar.inc(1);
        }
    }
    Ok((orders, summary))
}

/// SparseGPT, layer after layer: block by block, and inside a block group by group
/// ([`SEQUENTIAL_GROUPS`]), each linear is pruned and packed with `options(name, calibration)`
/// where the calibration holds `X^T X` of the layer's inputs on `tokens [batch, t]` *through
/// the model pruned so far* (earlier blocks and groups already sparse, and quantized if
/// `options` says so). Each block is walked group by group ([`Llama::walk_step`]), so the
/// whole run costs one forward pass over the calibration tokens. Returns the names packed.
///
/// With `permute`, every group's input order is searched first, on its dense weights scored
/// with the group's own options' prune method (SparseGPT's saliency on the same calibration)
/// or, with [`SequentialPermutation::wanda_score`], Wanda's score on the same inputs, and
/// the group is pruned in that order.
pub fn sparsegpt_sequential<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    tokens: Tensor<B, 2, Int>,
    options: impl Fn(&str, SparseGptCalibration) -> PackOptions,
    mut permute: Option<SequentialPermutation<'_>>,
    bar: &ProgressBar,
) -> burn_slidesparse::Result<Vec<String>> {
    let mut packed = Vec::new();
    let mut x = model.embed.forward(tokens);
    for i in 0..model.blocks.len() {
        // One block forward per block: each group's input is computed once, through the
        // groups before it as they were just pruned.
        let mut walk = model.walk_block(i, x);
        for (g, group) in SEQUENTIAL_GROUPS.into_iter().enumerate() {
            if g > 0 {
                model.walk_step(&mut walk);
            }
            bar.set_message(format!("layers.{i}.{}", group.join("/")));
            let gram = gram(walk.input());
            let names: Vec<String> = group.iter().map(|n| format!("layers.{i}.{n}")).collect();
            let order = match permute.as_mut() {
                Some(p) => {
                    let calibrated =
                        |name: &str| options(name, SparseGptCalibration::new(gram.clone()));
                    let pattern = calibrated(&names[0]).pattern;
                    let norms = p.wanda_score.then(|| gram_norms(&gram));
                    let method = |name: &str| match &norms {
                        Some(n) => PruneMethod::ActivationAware {
                            input_norms: n.clone(),
                        },
                        None => calibrated(name).prune,
                    };
                    let order =
                        group_permutation(model, &names, pattern, &method, p.search, p.summary)?;
                    ChannelPermutation::Given(order)
                }
                None => ChannelPermutation::Identity,
            };
            let done = sparsify_with(model, |name| {
                names.iter().any(|n| n == name).then(|| PackOptions {
                    permutation: order.clone(),
                    ..options(name, SparseGptCalibration::new(gram.clone()))
                })
            })?;
            if let Some(missing) = names.iter().find(|n| !done.contains(n)) {
                return Err(SlideSparseError::Backend(format!(
                    "{missing}: no dense linear of that name (sequential SparseGPT needs the \
                     separate projections q/k/v and gate/up, dense)"
                )));
            }
            packed.extend(done);
            bar.inc(1);
        }
        model.walk_step(&mut walk);
        x = walk.into_output();
    }
    Ok(packed)
}
