//! A Llama-architecture decoder in burn (RMSNorm, RoPE on adjacent pairs, grouped-query
//! attention, SwiGLU MLP, optional q/k/v bias, tied or untied LM head, KV cache) whose seven
//! linear layers per block are `MaybeSparseLinear`: dense `nn::Linear` or SlideSparse,
//! chosen per layer with `burn_slidesparse::sparsify`. Written to be copied.

use burn::{
    config::Config,
    module::{Module, Param},
    nn::{
        Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding,
        RotaryEncodingConfig,
    },
    tensor::{Bool, Int, Tensor, activation, backend::Backend},
};
use burn_slidesparse::{MaybeSparseLinear, SlideSparseBackend, VisitLinears};

/// Model hyper-parameters.
#[derive(Config, Debug)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    #[config(default = 10000.0)]
    pub rope_base: f32,
    #[config(default = 1e-5)]
    pub rms_eps: f64,
    #[config(default = 2048)]
    pub max_seq_len: usize,
    #[config(default = true)]
    pub tie_embeddings: bool,
    /// Qwen2-style bias on q, k and v.
    #[config(default = false)]
    pub qkv_bias: bool,
}

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// A model with random weights (burn's default initializers).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Llama<B> {
        let linear = |i, o, bias| -> MaybeSparseLinear<B> {
            LinearConfig::new(i, o).with_bias(bias).init(device).into()
        };
        let hd = self.head_dim();
        let blocks = (0..self.layers)
            .map(|_| Block {
                attn_norm: RmsNormConfig::new(self.hidden)
                    .with_epsilon(self.rms_eps)
                    .init(device),
                q: linear(self.hidden, self.heads * hd, self.qkv_bias),
                k: linear(self.hidden, self.kv_heads * hd, self.qkv_bias),
                v: linear(self.hidden, self.kv_heads * hd, self.qkv_bias),
                o: linear(self.heads * hd, self.hidden, false),
                mlp_norm: RmsNormConfig::new(self.hidden)
                    .with_epsilon(self.rms_eps)
                    .init(device),
                gate: linear(self.hidden, self.intermediate, false),
                up: linear(self.hidden, self.intermediate, false),
                down: linear(self.intermediate, self.hidden, false),
            })
            .collect();
        let embed = EmbeddingConfig::new(self.vocab_size, self.hidden).init(device);
        let lm_head = if self.tie_embeddings {
            tied_head(&embed)
        } else {
            linear(self.hidden, self.vocab_size, false)
        };
        Llama {
            embed,
            blocks,
            norm: RmsNormConfig::new(self.hidden)
                .with_epsilon(self.rms_eps)
                .init(device),
            lm_head,
            rope: RotaryEncodingConfig::new(self.max_seq_len, hd)
                .with_theta(self.rope_base)
                .init(device),
            heads: self.heads,
            kv_heads: self.kv_heads,
        }
    }
}

/// The LM head that shares the embedding matrix (`[vocab, hidden]`, so the Linear's
/// `[in, out]` weight is its transpose).
pub fn tied_head<B: Backend>(embed: &Embedding<B>) -> MaybeSparseLinear<B> {
    // A contiguous copy of the transpose (a transposed view is re-copied by every NdArray
    // matmul).
    let weight = embed.weight.val();
    let weight = Tensor::from_data(weight.clone().transpose().into_data(), &weight.device());
    Linear {
        weight: Param::from_tensor(weight),
        bias: None,
    }
    .into()
}

/// One decoder block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub attn_norm: RmsNorm<B>,
    pub q: MaybeSparseLinear<B>,
    pub k: MaybeSparseLinear<B>,
    pub v: MaybeSparseLinear<B>,
    pub o: MaybeSparseLinear<B>,
    pub mlp_norm: RmsNorm<B>,
    pub gate: MaybeSparseLinear<B>,
    pub up: MaybeSparseLinear<B>,
    pub down: MaybeSparseLinear<B>,
}

/// The decoder.
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    pub embed: Embedding<B>,
    pub blocks: Vec<Block<B>>,
    pub norm: RmsNorm<B>,
    pub lm_head: MaybeSparseLinear<B>,
    pub rope: RotaryEncoding<B>,
    pub heads: usize,
    pub kv_heads: usize,
}

/// Keys and values of the tokens seen so far, per block: `[batch, kv_heads, t, head_dim]`.
#[derive(Debug, Default)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
}

impl<B: Backend> KvCache<B> {
    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map_or(0, |(k, _)| k.dims()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Sees the input of every block linear (by the names of [`VisitLinears`]) during a forward.
pub type Observer<'a, B> = &'a mut dyn FnMut(&str, &Tensor<B, 3>);

impl<B: SlideSparseBackend> Llama<B> {
    /// Logits `[batch, t, vocab]` for `tokens [batch, t]` following the cached ones.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        self.forward_observed(tokens, cache, &mut |_, _| {})
    }

    /// Logits `[batch, vocab]` of the last position only: what generation needs, without
    /// the LM head's cost on every prompt token.
    pub fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        let hidden = self.hidden_states(tokens, cache, &mut |_, _| {});
        let [batch, t, width] = hidden.dims();
        let last = hidden
            .slice([0..batch, t - 1..t, 0..width])
            .reshape([batch, width]);
        // A 2-D input: the head is one plain matmul (a `[batch, 1, width]` input took a
        // batched path 10x slower on burn-cuda at batch 64).
        self.lm_head.forward(self.norm.forward(last))
    }

    /// [`forward`](Self::forward), showing `observer` the input of every block linear.
    pub fn forward_observed(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let hidden = self.hidden_states(tokens, cache, observer);
        self.lm_head.forward(self.norm.forward(hidden))
    }

    /// Block `index` alone on hidden states `x [batch, t, hidden]` at positions `0..t`, no
    /// cache, showing `observer` the input of each of its linears (named `q_proj`, ...,
    /// `down_proj`): what layer-by-layer calibration needs.
    pub fn block_forward(
        &self,
        index: usize,
        x: Tensor<B, 3>,
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        self.blocks[index].forward(
            x,
            &mut None,
            &self.rope,
            0,
            (self.heads, self.kv_heads),
            observer,
        )
    }

    /// The last block's output `[batch, t, hidden]` (before the final norm).
    fn hidden_states(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let start = cache.len();
        if cache.layers.len() < self.blocks.len() {
            cache.layers.resize_with(self.blocks.len(), || None);
        }
        let mut x = self.embed.forward(tokens);
        for (i, (block, slot)) in self.blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            let mut seen =
                |layer: &str, input: &Tensor<B, 3>| observer(&format!("layers.{i}.{layer}"), input);
            x = block.forward(
                x,
                slot,
                &self.rope,
                start,
                (self.heads, self.kv_heads),
                &mut seen,
            );
        }
        x
    }

    /// Per block linear, the L2 norm of each input channel over the calibration tokens:
    /// the activation statistics of Wanda-style pruning.
    pub fn input_norms(
        &self,
        tokens: Tensor<B, 2, Int>,
    ) -> std::collections::HashMap<String, Vec<f32>> {
        let mut sums: std::collections::HashMap<String, Tensor<B, 1>> = Default::default();
        self.forward_observed(tokens, &mut KvCache::default(), &mut |name, x| {
            let [b, t, k] = x.dims();
            let sq = x
                .clone()
                .powf_scalar(2.0)
                .reshape([b * t, k])
                .sum_dim(0)
                .reshape([k]);
            let entry = sums
                .entry(name.to_string())
                .or_insert_with(|| sq.zeros_like());
            *entry = entry.clone() + sq;
        });
        sums.into_iter()
            .map(|(name, s)| {
                (
                    name,
                    s.sqrt()
                        .into_data()
                        .convert::<f32>()
                        .into_vec()
                        .expect("f32"),
                )
            })
            .collect()
    }
}

impl<B: SlideSparseBackend> Block<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        cache: &mut Option<(Tensor<B, 4>, Tensor<B, 4>)>,
        rope: &RotaryEncoding<B>,
        start: usize,
        heads: (usize, usize),
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let a = self.attn_norm.forward(x.clone());
        for name in ["q_proj", "k_proj", "v_proj"] {
            observer(name, &a);
        }
        let h = x + self.attention(a, cache, rope, start, heads, observer);
        let m = self.mlp_norm.forward(h.clone());
        observer("gate_proj", &m);
        observer("up_proj", &m);
        let inner = activation::silu(self.gate.forward(m.clone())) * self.up.forward(m);
        observer("down_proj", &inner);
        h + self.down.forward(inner)
    }

    fn attention(
        &self,
        x: Tensor<B, 3>,
        cache: &mut Option<(Tensor<B, 4>, Tensor<B, 4>)>,
        rope: &RotaryEncoding<B>,
        start: usize,
        (heads, kv_heads): (usize, usize),
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let [batch, t, _] = x.dims();
        let split = |y: Tensor<B, 3>, n: usize| {
            let hd = y.dims()[2] / n;
            y.reshape([batch, t, n, hd]).swap_dims(1, 2) // [b, n, t, hd]
        };
        let q = rope.apply(split(self.q.forward(x.clone()), heads), start);
        let k = rope.apply(split(self.k.forward(x.clone()), kv_heads), start);
        let v = split(self.v.forward(x), kv_heads);
        let (k, v) = match cache.take() {
            Some((ck, cv)) => (Tensor::cat(vec![ck, k], 2), Tensor::cat(vec![cv, v], 2)),
            None => (k, v),
        };
        *cache = Some((k.clone(), v.clone()));
        let total = k.dims()[2];
        let hd = q.dims()[3];
        let rep = heads / kv_heads;
        let expand = |y: Tensor<B, 4>| {
            y.unsqueeze_dim::<5>(2)
                .expand([batch, kv_heads, rep, total, hd])
                .reshape([batch, heads, total, hd])
        };
        let (k, v) = (expand(k), expand(v));
        let scores = q.matmul(k.transpose()) / (hd as f64).sqrt();
        let mask =
            causal_mask::<B>(t, total, start, &scores.device()).expand([batch, heads, t, total]);
        let scores = scores.mask_fill(mask, f32::NEG_INFINITY);
        let out = activation::softmax(scores, 3).matmul(v); // [b, h, t, hd]
        let out = out.swap_dims(1, 2).reshape([batch, t, heads * hd]);
        observer("o_proj", &out);
        self.o.forward(out)
    }
}

/// `true` where query `i` (absolute position `start + i`) must not see key `j`.
fn causal_mask<B: Backend>(
    t: usize,
    total: usize,
    start: usize,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let rows = Tensor::<B, 1, Int>::arange(start as i64..(start + t) as i64, device)
        .reshape([t, 1])
        .expand([t, total]);
    let cols = Tensor::<B, 1, Int>::arange(0..total as i64, device)
        .reshape([1, total])
        .expand([t, total]);
    cols.greater(rows).unsqueeze::<4>()
}

impl<B: Backend> VisitLinears<B> for Llama<B> {
    fn visit_linears(
        &mut self,
        f: &mut dyn FnMut(&str, &mut MaybeSparseLinear<B>) -> burn_slidesparse::Result<()>,
    ) -> burn_slidesparse::Result<()> {
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (name, layer) in [
                ("q_proj", &mut b.q),
                ("k_proj", &mut b.k),
                ("v_proj", &mut b.v),
                ("o_proj", &mut b.o),
                ("gate_proj", &mut b.gate),
                ("up_proj", &mut b.up),
                ("down_proj", &mut b.down),
            ] {
                f(&format!("layers.{i}.{name}"), layer)?;
            }
        }
        f("lm_head", &mut self.lm_head)
    }
}
