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
    tensor::{Int, Tensor, TensorCreationOptions, activation, backend::Backend},
};
use burn_slidesparse::{
    AttentionOptions, MaybeSparseLinear, SlideSparseBackend, VisitLinears, causal_attention,
    concat_outputs,
};

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
                attn_in: Projections::Separate(vec![
                    linear(self.hidden, self.heads * hd, self.qkv_bias),
                    linear(self.hidden, self.kv_heads * hd, self.qkv_bias),
                    linear(self.hidden, self.kv_heads * hd, self.qkv_bias),
                ]),
                o: linear(self.heads * hd, self.hidden, false),
                mlp_norm: RmsNormConfig::new(self.hidden)
                    .with_epsilon(self.rms_eps)
                    .init(device),
                mlp_in: Projections::Separate(vec![
                    linear(self.hidden, self.intermediate, false),
                    linear(self.hidden, self.intermediate, false),
                ]),
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

/// Layers that read one input: separate (`q`, `k`, `v`; `gate`, `up`), as loaded and packed,
/// or fused into one layer whose output is theirs side by side ([`Llama::fuse_projections`]:
/// one GEMM, split after it). An enum module rather than `Option` fields: burn 0.21 loads
/// no record into an `Option` whose module has no float `Param` (a SlideSparse layer's codes
/// are not float parameters).
// One per block and kind; burn implements `Module` for no `Box`, so the larger variant stays
// inline.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Projections<B: Backend> {
    /// The layers, in order.
    Separate(Vec<MaybeSparseLinear<B>>),
    /// One layer, outputs concatenated in the same order.
    Fused(MaybeSparseLinear<B>),
}

impl<B: Backend> Projections<B> {
    /// The separate layers, or `None` once fused.
    pub fn separate(&self) -> Option<&[MaybeSparseLinear<B>]> {
        match self {
            Self::Separate(layers) => Some(layers),
            Self::Fused(_) => None,
        }
    }

    /// Replaces separate layer `index` (what the loaders do); panics once fused.
    pub fn set(&mut self, index: usize, layer: MaybeSparseLinear<B>) {
        match self {
            Self::Separate(layers) => layers[index] = layer,
            Self::Fused(_) => panic!("set a projection before fuse_projections"),
        }
    }

    /// Fuses separate layers into one (exact: `burn_slidesparse::concat_outputs`); fused
    /// ones stay as they are. On an error, nothing changes.
    pub fn fuse(&mut self) -> burn_slidesparse::Result<()> {
        if let Self::Separate(layers) = self {
            let refs: Vec<&MaybeSparseLinear<B>> = layers.iter().collect();
            *self = Self::Fused(concat_outputs(&refs)?);
        }
        Ok(())
    }

    /// (name, layer) pairs: `names` for separate layers, `fused_name` for the fused one.
    fn named_mut<'a>(
        &'a mut self,
        names: &[&'static str],
        fused_name: &'static str,
    ) -> Vec<(&'static str, &'a mut MaybeSparseLinear<B>)> {
        match self {
            Self::Separate(layers) => names.iter().copied().zip(layers.iter_mut()).collect(),
            Self::Fused(layer) => vec![(fused_name, layer)],
        }
    }
}

/// One decoder block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub attn_norm: RmsNorm<B>,
    /// `q`, `k`, `v`.
    pub attn_in: Projections<B>,
    pub o: MaybeSparseLinear<B>,
    pub mlp_norm: RmsNorm<B>,
    /// `gate`, `up`.
    pub mlp_in: Projections<B>,
    pub down: MaybeSparseLinear<B>,
}

impl<B: Backend> Block<B> {
    /// The block's linear layers in forward order, by the names of [`VisitLinears`]
    /// (`q_proj`, `k_proj`, `v_proj` or `qkv_proj`; `gate_proj`, `up_proj` or `gate_up_proj`).
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut MaybeSparseLinear<B>)> {
        let mut layers = self
            .attn_in
            .named_mut(&["q_proj", "k_proj", "v_proj"], "qkv_proj");
        layers.push(("o_proj", &mut self.o));
        layers.extend(
            self.mlp_in
                .named_mut(&["gate_proj", "up_proj"], "gate_up_proj"),
        );
        layers.push(("down_proj", &mut self.down));
        layers
    }

    /// Fuses `q`, `k`, `v` into `qkv` and `gate`, `up` into `gate_up` (exact: see
    /// `burn_slidesparse::concat_outputs`); a block already fused is left as it is.
    pub fn fuse_projections(&mut self) -> burn_slidesparse::Result<()> {
        self.attn_in.fuse()?;
        self.mlp_in.fuse()
    }
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

/// Keys and values of the tokens seen so far, per block: `[batch, capacity, kv_heads,
/// head_dim]` tensors written in place (the attention reads the first `len` positions).
/// The capacity grows by doubling when a forward needs more (a copy of the cache); give it
/// up front with [`with_capacity`](Self::with_capacity) to never copy.
#[derive(Debug, Default)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
    len: usize,
    capacity: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache that holds `tokens` positions per sequence before it grows.
    pub fn with_capacity(tokens: usize) -> Self {
        Self {
            layers: Vec::new(),
            len: 0,
            capacity: tokens,
        }
    }

    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on (they are overwritten by the next forward).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Positions per sequence the cache holds before it grows.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Where one block writes its keys and values: its cache slot, or none (no cache: the
/// attention reads the new keys alone).
struct CacheSlot<'a, B: Backend> {
    slot: Option<&'a mut Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
    start: usize,
    capacity: usize,
}

impl<B: Backend> CacheSlot<'_, B> {
    /// Writes `k`, `v` `[batch, t, kv_heads, hd]` at positions `start..start + t` and
    /// returns the tensors the attention reads (the whole cache, or `k`, `v` themselves).
    fn write(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let Some(slot) = self.slot.as_mut() else {
            return (k, v);
        };
        let [batch, t, kv_heads, hd] = k.dims();
        let (start, end) = (self.start, self.start + t);
        let grow = |old: Option<Tensor<B, 4>>, like: &Tensor<B, 4>| {
            let options = TensorCreationOptions::default()
                .with_device(like.device())
                .with_dtype(like.dtype());
            let fresh = Tensor::zeros([batch, self.capacity, kv_heads, hd], options);
            match old {
                Some(old) if start > 0 => {
                    fresh.slice_assign([0..batch, 0..start], old.slice([0..batch, 0..start]))
                }
                _ => fresh,
            }
        };
        let (ck, cv) = match slot.take() {
            Some((ck, cv)) if ck.dims()[1] >= end => {
                assert_eq!(ck.dims()[0], batch, "KvCache: the batch size changed");
                (ck, cv)
            }
            old => {
                let (ok, ov) = old.unzip();
                (grow(ok, &k), grow(ov, &v))
            }
        };
        // The cache tensors are owned here alone, so slice_assign writes them in place.
        let ck = ck.slice_assign([0..batch, start..end], k);
        let cv = cv.slice_assign([0..batch, start..end], v);
        **slot = Some((ck.clone(), cv.clone()));
        (ck, cv)
    }
}

/// RoPE on adjacent pairs for positions `start..start + t`, as `cos [1, t, 1, hd]` and
/// `sin [1, t, 1, hd]` with the pair's sign folded in (`-sin` on even, `+sin` on odd
/// indices), from burn's `RotaryEncoding` table `[max_len, hd, (cos, sin)]`: then
/// `rope(x) = x * cos + swap_pairs(x) * sin` for `x [batch, t, heads, hd]`, the same values
/// as `RotaryEncoding::apply` without its per-pair matmul.
struct RopeTables<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> RopeTables<B> {
    fn new(rope: &RotaryEncoding<B>, start: usize, t: usize) -> Self {
        let [max_len, hd, _] = rope.freq_complex.dims();
        assert!(
            start + t <= max_len,
            "positions up to {} exceed the model's max_seq_len {max_len}",
            start + t
        );
        let table = rope
            .freq_complex
            .clone()
            .slice([start..start + t, 0..hd, 0..2]);
        let cos = table
            .clone()
            .slice([0..t, 0..hd, 0..1])
            .reshape([1, t, 1, hd]);
        let sign = Tensor::<B, 1>::from_floats([-1.0, 1.0], &table.device())
            .cast(table.dtype())
            .repeat_dim(0, hd / 2)
            .reshape([1, 1, 1, hd]);
        let sin = table.slice([0..t, 0..hd, 1..2]).reshape([1, t, 1, hd]) * sign;
        Self { cos, sin }
    }

    fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, t, h, hd] = x.dims();
        let swapped = x
            .clone()
            .reshape([b, t, h, hd / 2, 2])
            .flip([4])
            .reshape([b, t, h, hd]);
        x * self.cos.clone() + swapped * self.sin.clone()
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
        let t = x.dims()[1];
        let mut cache = CacheSlot {
            slot: None,
            start: 0,
            capacity: t,
        };
        let rope = RopeTables::new(&self.rope, 0, t);
        self.blocks[index].forward(x, &mut cache, &rope, (self.heads, self.kv_heads), observer)
    }

    /// Fuses every block's projections ([`Block::fuse_projections`]): fewer, larger GEMMs
    /// for inference. Do it after packing or loading a packed file (their layers are named
    /// `q_proj`, ...); the fused model lists `qkv_proj` and `gate_up_proj` instead.
    pub fn fuse_projections(&mut self) -> burn_slidesparse::Result<()> {
        self.blocks.iter_mut().try_for_each(Block::fuse_projections)
    }

    /// The last block's output `[batch, t, hidden]` (before the final norm).
    fn hidden_states(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let start = cache.len;
        let t = tokens.dims()[1];
        if cache.layers.len() < self.blocks.len() {
            cache.layers.resize_with(self.blocks.len(), || None);
        }
        if start + t > cache.capacity {
            cache.capacity = (start + t).max(2 * cache.capacity);
        }
        let rope = RopeTables::new(&self.rope, start, t);
        let mut x = self.embed.forward(tokens);
        let capacity = cache.capacity;
        for (i, (block, slot)) in self.blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            let mut seen =
                |layer: &str, input: &Tensor<B, 3>| observer(&format!("layers.{i}.{layer}"), input);
            let mut slot = CacheSlot {
                slot: Some(slot),
                start,
                capacity,
            };
            x = block.forward(x, &mut slot, &rope, (self.heads, self.kv_heads), &mut seen);
        }
        cache.len = start + t;
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

/// `[.., width]` into pieces of `widths` along the last dimension (views, no copy).
fn split_last<B: Backend>(y: Tensor<B, 3>, widths: &[usize]) -> Vec<Tensor<B, 3>> {
    let [b, t, _] = y.dims();
    let mut at = 0;
    widths
        .iter()
        .map(|&w| {
            at += w;
            y.clone().slice([0..b, 0..t, at - w..at])
        })
        .collect()
}

impl<B: SlideSparseBackend> Block<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        cache: &mut CacheSlot<'_, B>,
        rope: &RopeTables<B>,
        heads: (usize, usize),
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let a = self.attn_norm.forward(x.clone());
        let h = x + self.attention(a, cache, rope, heads, observer);
        let m = self.mlp_norm.forward(h.clone());
        let (gate, up) = match &self.mlp_in {
            Projections::Fused(gate_up) => {
                observer("gate_up_proj", &m);
                let y = gate_up.forward(m);
                let ff = y.dims()[2] / 2;
                let [gate, up] = split_last(y, &[ff, ff]).try_into().expect("two pieces");
                (gate, up)
            }
            Projections::Separate(layers) => {
                observer("gate_proj", &m);
                observer("up_proj", &m);
                (layers[0].forward(m.clone()), layers[1].forward(m))
            }
        };
        let inner = activation::silu(gate) * up;
        observer("down_proj", &inner);
        h + self.down.forward(inner)
    }

    /// `[q | k]` and `v` of `x`, from the fused layer (two views of its output) or the three
    /// layers.
    fn qk_v(
        &self,
        x: Tensor<B, 3>,
        (qk_width, v_width): (usize, usize),
        observer: Observer<'_, B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        match &self.attn_in {
            Projections::Fused(qkv) => {
                observer("qkv_proj", &x);
                let [qk, v] = split_last(qkv.forward(x), &[qk_width, v_width])
                    .try_into()
                    .expect("two pieces");
                (qk, v)
            }
            Projections::Separate(layers) => {
                for name in ["q_proj", "k_proj", "v_proj"] {
                    observer(name, &x);
                }
                let [q, k, v] = [0, 1, 2].map(|i| layers[i].forward(x.clone()));
                (Tensor::cat(vec![q, k], 2), v)
            }
        }
    }

    fn attention(
        &self,
        x: Tensor<B, 3>,
        cache: &mut CacheSlot<'_, B>,
        rope: &RopeTables<B>,
        (heads, kv_heads): (usize, usize),
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let [batch, t, _] = x.dims();
        let hd = rope.cos.dims()[3];
        let (qk, v) = self.qk_v(x, ((heads + kv_heads) * hd, kv_heads * hd), observer);
        // `[batch, t, heads, hd]`: the layout the attention kernels and the cache use. q and k
        // get RoPE in one pass (fewer operations per block: decode is bound by their host
        // cost).
        let qk = rope.apply(qk.reshape([batch, t, heads + kv_heads, hd]));
        let q = qk.clone().slice([0..batch, 0..t, 0..heads, 0..hd]);
        let k = qk.slice([0..batch, 0..t, heads..heads + kv_heads, 0..hd]);
        let v = v.reshape([batch, t, kv_heads, hd]);
        let kv_len = cache.start + t;
        let (k, v) = cache.write(k, v);
        let options = AttentionOptions {
            kv_len: Some(kv_len),
            scale: None,
        };
        let out = causal_attention(q, k, v, options)
            .unwrap_or_else(|e| panic!("attention: {e}"))
            .reshape([batch, t, heads * hd]);
        observer("o_proj", &out);
        self.o.forward(out)
    }
}

impl<B: Backend> VisitLinears<B> for Llama<B> {
    fn visit_linears(
        &mut self,
        f: &mut dyn FnMut(&str, &mut MaybeSparseLinear<B>) -> burn_slidesparse::Result<()>,
    ) -> burn_slidesparse::Result<()> {
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (name, layer) in b.linears_mut() {
                f(&format!("layers.{i}.{name}"), layer)?;
            }
        }
        f("lm_head", &mut self.lm_head)
    }
}

#[cfg(test)]
mod tests {
    use burn::{backend::NdArray, nn::RotaryEncodingConfig, tensor::Distribution};

    use super::*;

    /// The table-based RoPE on `[batch, t, heads, hd]` equals burn's `RotaryEncoding::apply`
    /// on `[batch, heads, t, hd]`, at an offset.
    #[test]
    fn rope_tables_match_burns_rotary_encoding() {
        let device = Default::default();
        let rope = RotaryEncodingConfig::new(32, 16)
            .with_theta(500.0)
            .init::<NdArray>(&device);
        let x =
            Tensor::<NdArray, 4>::random([2, 5, 3, 16], Distribution::Normal(0.0, 1.0), &device);
        for start in [0, 7] {
            let ours = RopeTables::new(&rope, start, 5).apply(x.clone());
            let burns = rope.apply(x.clone().swap_dims(1, 2), start).swap_dims(1, 2);
            let err = (ours - burns).abs().max().into_scalar();
            assert!(err < 1e-5, "start {start}: max |diff| {err}");
        }
    }
}
