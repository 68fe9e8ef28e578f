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
    DecoderBlock, MaybeSparseLinear, PackedFile, RopeAttention, SlideSparseBackend, VisitLinears,
    add_rms_norm, concat_outputs, decoder_block, rms_norm, rope_attention, silu_mul,
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
            composed_steps: true,
        }
    }
}

/// The LM head that shares the embedding matrix (`[vocab, hidden]`, so the Linear's
/// `[in, out]` weight is its transpose).
pub fn tied_head<B: Backend>(embed: &Embedding<B>) -> MaybeSparseLinear<B> {
    // A contiguous copy of the transpose (a transposed view is re-copied by every NdArray
    // matmul).
    let weight = embed.weight.val();
    let (device, dtype) = (weight.device(), weight.dtype());
    let weight = Tensor::from_data(weight.transpose().into_data(), (&device, dtype));
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
    /// Run each block with fused projections, seen by no observer, as the library's
    /// `decoder_block`: one operation on burn-cuda where its linears are SlideSparse or
    /// quantized, the tensors bf16 or f16 and the head dim 64 or 128 (otherwise its steps
    /// and linears in turn, up to eight). `false` runs each step and each linear as an
    /// operation of its own (to measure the difference).
    #[module(skip)]
    pub composed_steps: bool,
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

/// Where one block writes its keys and values: its cache slot, grown to hold positions
/// `start..start + t` when it does not.
struct CacheSlot<'a, B: Backend> {
    slot: &'a mut Option<(Tensor<B, 4>, Tensor<B, 4>)>,
    start: usize,
    capacity: usize,
}

impl<'a, B: Backend> CacheSlot<'a, B> {
    /// An empty slot for a single pass over `t` positions from 0 (a block run alone).
    fn scratch(slot: &'a mut Option<(Tensor<B, 4>, Tensor<B, 4>)>, t: usize) -> Self {
        Self {
            slot,
            start: 0,
            capacity: t,
        }
    }

    /// The cache tensors `[batch, capacity, kv_heads, hd]`, with room for `t` more
    /// positions (a grown cache keeps the first `start` positions), in `like`'s dtype.
    fn reserve(
        &mut self,
        [batch, t, kv_heads, hd]: [usize; 4],
        like: &Tensor<B, 3>,
    ) -> (&mut Tensor<B, 4>, &mut Tensor<B, 4>) {
        let start = self.start;
        let fits = matches!(&*self.slot, Some((k, _)) if k.dims()[1] >= start + t);
        if !fits {
            let options = TensorCreationOptions::default()
                .with_device(like.device())
                .with_dtype(like.dtype());
            let grow = |old: Option<Tensor<B, 4>>| {
                let fresh = Tensor::zeros([batch, self.capacity, kv_heads, hd], options.clone());
                match old {
                    Some(old) if start > 0 => {
                        fresh.slice_assign([0..batch, 0..start], old.slice([0..batch, 0..start]))
                    }
                    _ => fresh,
                }
            };
            let (k, v) = self.slot.take().unzip();
            *self.slot = Some((grow(k), grow(v)));
        }
        let (k, v) = self.slot.as_mut().expect("reserved above");
        assert_eq!(k.dims()[0], batch, "KvCache: the batch size changed");
        (k, v)
    }
}

/// Sees the input of every block linear (by the names of [`VisitLinears`]) during a forward.
pub type Observer<'a, B> = &'a mut dyn FnMut(&str, &Tensor<B, 3>);

impl<B: SlideSparseBackend> Llama<B> {
    /// Logits `[batch, t, vocab]` for `tokens [batch, t]` following the cached ones.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        let hidden = self.hidden_states(tokens, cache, None);
        self.lm_head
            .forward(rms_norm(hidden, &self.norm).unwrap_or_else(|e| panic!("norm: {e}")))
    }

    /// Logits `[batch, vocab]` of the last position only: what generation needs, without
    /// the LM head's cost on every prompt token.
    pub fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        let hidden = self.hidden_states(tokens, cache, None);
        let [batch, t, width] = hidden.dims();
        let last = hidden
            .slice([0..batch, t - 1..t, 0..width])
            .reshape([batch, width]);
        // A 2-D input: the head is one plain matmul (a `[batch, 1, width]` input took a
        // batched path 10x slower on burn-cuda at batch 64).
        self.lm_head
            .forward(rms_norm(last, &self.norm).unwrap_or_else(|e| panic!("norm: {e}")))
    }

    /// [`forward`](Self::forward), showing `observer` the input of every block linear.
    pub fn forward_observed(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        observer: Observer<'_, B>,
    ) -> Tensor<B, 3> {
        let hidden = self.hidden_states(tokens, cache, Some(observer));
        self.lm_head
            .forward(rms_norm(hidden, &self.norm).unwrap_or_else(|e| panic!("norm: {e}")))
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
        let mut local = None;
        let mut cache = CacheSlot::scratch(&mut local, x.dims()[1]);
        let (h, delta) = self.blocks[index].forward(
            (x, None),
            &mut cache,
            (self.attention_of(), false),
            Some(observer),
        );
        h + delta
    }

    /// Starts block `index` on hidden states `x [batch, t, hidden]` (positions `0..t`, no
    /// cache) one group of linears at a time ([`BlockWalk`]): the walk's first input is the
    /// q/k/v projections' (the attention norm of `x`).
    pub fn walk_block(&self, index: usize, x: Tensor<B, 3>) -> BlockWalk<B> {
        let input = step("norm", rms_norm(x.clone(), &self.blocks[index].attn_norm));
        BlockWalk {
            index,
            residual: x,
            input,
            group: 0,
        }
    }

    /// Moves `walk` to its next group's input through the current group's linears *as they
    /// are now* (changed since the walk reached them, e.g. pruned): q/k/v -> the attention
    /// output (o's input) -> the MLP norm (gate's and up's input) -> the SiLU-gated product
    /// (down's input) -> the block's output (`walk.input()` after the fourth step, the next
    /// block's input). The four steps cost one block forward and compute the same values as
    /// [`block_forward`](Self::block_forward) on the model of each step's time.
    pub fn walk_step(&self, walk: &mut BlockWalk<B>) {
        let block = &self.blocks[walk.index];
        let input = walk.input.clone();
        walk.input = match walk.group {
            0 => {
                let mut local = None;
                let mut cache = CacheSlot::scratch(&mut local, input.dims()[1]);
                let qkv = block.qkv(input, &mut |_, _| {});
                block.rope_attention(qkv, &mut cache, self.attention_of())
            }
            1 => {
                let attended = block.o.forward(input);
                let (h, m) = step(
                    "norm",
                    add_rms_norm(walk.residual.clone(), attended, &block.mlp_norm),
                );
                walk.residual = h;
                m
            }
            2 => block.gated_product(input),
            3 => walk.residual.clone() + block.down.forward(input),
            _ => panic!("walk_step: block {} is already walked through", walk.index),
        };
        walk.group += 1;
    }

    fn attention_of(&self) -> BlockAttention<'_, B> {
        BlockAttention {
            rope: &self.rope,
            heads: (self.heads, self.kv_heads),
        }
    }

    /// Fuses every block's projections ([`Block::fuse_projections`]): fewer, larger GEMMs
    /// for inference. Do it after packing or loading a packed file (their layers are named
    /// `q_proj`, ...); the fused model lists `qkv_proj` and `gate_up_proj` instead.
    pub fn fuse_projections(&mut self) -> burn_slidesparse::Result<()> {
        self.blocks.iter_mut().try_for_each(Block::fuse_projections)
    }

    /// The last block's output `[batch, t, hidden]` (before the final norm). Without an
    /// observer, blocks with fused projections run their composed operations.
    fn hidden_states(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
        mut observer: Option<Observer<'_, B>>,
    ) -> Tensor<B, 3> {
        let start = cache.len;
        let t = tokens.dims()[1];
        if cache.layers.len() < self.blocks.len() {
            cache.layers.resize_with(self.blocks.len(), || None);
        }
        if start + t > cache.capacity {
            cache.capacity = (start + t).max(2 * cache.capacity);
        }
        // Each block's last output is added by the next block's first norm (one operation).
        let mut stream = (self.embed.forward(tokens), None);
        let capacity = cache.capacity;
        let observing = observer.is_some();
        for (i, (block, slot)) in self.blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            let mut seen = |layer: &str, input: &Tensor<B, 3>| {
                if let Some(observer) = observer.as_mut() {
                    observer(&format!("layers.{i}.{layer}"), input)
                }
            };
            let mut slot = CacheSlot {
                slot,
                start,
                capacity,
            };
            let seen: Option<Observer<'_, B>> = if observing { Some(&mut seen) } else { None };
            let (x, delta) = block.forward(
                stream,
                &mut slot,
                (self.attention_of(), self.composed_steps),
                seen,
            );
            stream = (x, Some(delta));
        }
        cache.len = start + t;
        match stream {
            (x, Some(delta)) => x + delta,
            (x, None) => x,
        }
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

#[cfg(feature = "cuda")]
impl<B: SlideSparseBackend> Llama<B> {
    /// The model's decode step over `cache` as one CUDA graph (`burn_slidesparse::DecodeGraph`):
    /// fused projections, INT8 SlideSparse or quantized linears, burn-cuda's plain backend.
    /// The head runs inside the graph (with the greedy argmax) when it is an INT8 layer;
    /// otherwise the graph ends with the final norm's output and the caller applies the head.
    /// Positions `0..cache.len()` are the prompt's; the graph's first step follows them. Build
    /// it after the prefill (the cache must not grow while the graph lives).
    pub fn decode_graph(
        &self,
        cache: &KvCache<B>,
    ) -> burn_slidesparse::Result<burn_slidesparse::DecodeGraph<B>> {
        let unsupported = |why: &str| burn_slidesparse::SlideSparseError::Unsupported {
            what: "decode graph of the example model".into(),
            why: why.into(),
        };
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let (Projections::Fused(qkv), Projections::Fused(gate_up)) =
                (&block.attn_in, &block.mlp_in)
            else {
                return Err(unsupported("separate projections (call fuse_projections)"));
            };
            blocks.push(DecoderBlock {
                attn_norm: &block.attn_norm,
                qkv,
                o: &block.o,
                mlp_norm: &block.mlp_norm,
                gate_up,
                down: &block.down,
            });
        }
        let caches = cache
            .layers
            .iter()
            .map(|slot| slot.as_ref().map(|(k, v)| (k, v)))
            .collect::<Option<Vec<_>>>()
            .filter(|c| c.len() == self.blocks.len())
            .ok_or_else(|| unsupported("an empty cache (run the prompt first)"))?;
        let head = matches!(
            self.lm_head,
            MaybeSparseLinear::Sparse(_) | MaybeSparseLinear::Quantized(_)
        )
        .then_some(&self.lm_head);
        let embedding = self.embed.weight.val();
        let mut graph = burn_slidesparse::DecodeGraph::new(burn_slidesparse::DecodeModel {
            embedding: &embedding,
            blocks,
            caches,
            final_norm: &self.norm,
            head,
            rope: &self.rope,
            heads: (self.heads, self.kv_heads),
            scale: None,
        })?;
        graph.set_position(cache.len())?;
        Ok(graph)
    }
}

/// A block run one group of linears at a time ([`Llama::walk_block`], [`Llama::walk_step`]):
/// the residual stream and the input of the group reached.
pub struct BlockWalk<B: Backend> {
    index: usize,
    /// The block's input, then (after the o group) the stream with the attention added.
    residual: Tensor<B, 3>,
    input: Tensor<B, 3>,
    /// Groups walked through: 0 q/k/v, 1 o, 2 gate/up, 3 down, 4 done.
    group: usize,
}

impl<B: Backend> BlockWalk<B> {
    /// The input of the group reached (after the last group: the block's output).
    pub fn input(&self) -> &Tensor<B, 3> {
        &self.input
    }

    /// The block's output, once every group was walked through.
    pub fn into_output(self) -> Tensor<B, 3> {
        assert_eq!(
            self.group, 4,
            "BlockWalk::into_output before the down group's step"
        );
        self.input
    }
}

/// What a block's attention needs of the model: the rotary table and the head counts.
#[derive(Clone, Copy)]
struct BlockAttention<'a, B: Backend> {
    rope: &'a RotaryEncoding<B>,
    /// Query heads, key/value heads.
    heads: (usize, usize),
}

/// A library call of the block's hot path; its errors are programming errors of the model
/// (shapes) or a device failure, reported with the step's name.
fn step<T>(name: &str, result: burn_slidesparse::Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("{name}: {e}"))
}

impl<B: SlideSparseBackend> Block<B> {
    /// The block on the residual stream `x` plus the previous block's output `delta` (added
    /// in the first norm's operation): `(x + delta + attention, mlp output)`, the second for
    /// the next block (or the caller) to add.
    fn forward(
        &self,
        (x, delta): (Tensor<B, 3>, Option<Tensor<B, 3>>),
        cache: &mut CacheSlot<'_, B>,
        (attention, composed): (BlockAttention<'_, B>, bool),
        observer: Option<Observer<'_, B>>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let mut unobserved = |_: &str, _: &Tensor<B, 3>| {};
        let observer: Observer<'_, B> = match (observer, &self.attn_in, &self.mlp_in) {
            (None, Projections::Fused(qkv), Projections::Fused(gate_up)) if composed => {
                return self.forward_composed((x, delta), cache, attention, (qkv, gate_up));
            }
            (Some(observer), ..) => observer,
            (None, ..) => &mut unobserved,
        };
        let (x, a) = match delta {
            Some(delta) => step("norm", add_rms_norm(x, delta, &self.attn_norm)),
            None => (x.clone(), step("norm", rms_norm(x, &self.attn_norm))),
        };
        let qkv = self.qkv(a, observer);
        let out = self.rope_attention(qkv, cache, attention);
        observer("o_proj", &out);
        let attended = self.o.forward(out);
        let (h, m) = step("norm", add_rms_norm(x, attended, &self.mlp_norm));
        match &self.mlp_in {
            Projections::Fused(_) => observer("gate_up_proj", &m),
            Projections::Separate(_) => {
                observer("gate_proj", &m);
                observer("up_proj", &m);
            }
        }
        let inner = self.gated_product(m);
        observer("down_proj", &inner);
        (h, self.down.forward(inner))
    }

    /// [`forward`](Self::forward) of a block with fused projections, seen by no observer:
    /// `burn_slidesparse::decoder_block`, one operation per block on burn-cuda where the
    /// linears are SlideSparse or quantized (decode is bound by the host's cost per
    /// operation).
    fn forward_composed(
        &self,
        (x, delta): (Tensor<B, 3>, Option<Tensor<B, 3>>),
        cache: &mut CacheSlot<'_, B>,
        attention: BlockAttention<'_, B>,
        (qkv, gate_up): (&MaybeSparseLinear<B>, &MaybeSparseLinear<B>),
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let [batch, t, _] = x.dims();
        let (heads, kv_heads) = attention.heads;
        let hd = qkv.features().1 / (heads + 2 * kv_heads);
        let start = cache.start;
        let (keys, values) = cache.reserve([batch, t, kv_heads, hd], &x);
        let options = RopeAttention {
            rope: attention.rope,
            start,
            heads: attention.heads,
            scale: None,
        };
        let block = DecoderBlock {
            attn_norm: &self.attn_norm,
            qkv,
            o: &self.o,
            mlp_norm: &self.mlp_norm,
            gate_up,
            down: &self.down,
        };
        step(
            "decoder block",
            decoder_block((x, delta), &block, keys, values, options),
        )
    }

    /// `silu(gate(m)) * up(m)`: the down projection's input, from the fused layer or the two.
    fn gated_product(&self, m: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.mlp_in {
            Projections::Fused(gate_up) => step("SiLU-gated product", silu_mul(gate_up.forward(m))),
            Projections::Separate(layers) => {
                activation::silu(layers[0].forward(m.clone())) * layers[1].forward(m)
            }
        }
    }

    /// `[q | k | v]` of `x`: the fused layer's output, or the three layers' side by side.
    fn qkv(&self, x: Tensor<B, 3>, observer: Observer<'_, B>) -> Tensor<B, 3> {
        match &self.attn_in {
            Projections::Fused(qkv) => {
                observer("qkv_proj", &x);
                qkv.forward(x)
            }
            Projections::Separate(layers) => {
                for name in ["q_proj", "k_proj", "v_proj"] {
                    observer(name, &x);
                }
                Tensor::cat(layers.iter().map(|l| l.forward(x.clone())).collect(), 2)
            }
        }
    }

    /// The cache slots of this call's `t` tokens and the attention step's options.
    fn attention_step<'c>(
        &self,
        batch: usize,
        t: usize,
        cache: &'c mut CacheSlot<'_, B>,
        attention: BlockAttention<'c, B>,
        qkv: &Tensor<B, 3>,
    ) -> (
        &'c mut Tensor<B, 4>,
        &'c mut Tensor<B, 4>,
        RopeAttention<'c, B>,
    ) {
        let (heads, kv_heads) = attention.heads;
        let hd = qkv.dims()[2] / (heads + 2 * kv_heads);
        let start = cache.start;
        let (keys, values) = cache.reserve([batch, t, kv_heads, hd], qkv);
        let options = RopeAttention {
            rope: attention.rope,
            start,
            heads: attention.heads,
            scale: None,
        };
        (keys, values, options)
    }

    /// RoPE on q and k, the cache write and the attention: one operation on burn-cuda
    /// (decode is bound by the host's cost per operation).
    fn rope_attention(
        &self,
        qkv: Tensor<B, 3>,
        cache: &mut CacheSlot<'_, B>,
        attention: BlockAttention<'_, B>,
    ) -> Tensor<B, 3> {
        let [batch, t, _] = qkv.dims();
        let (keys, values, options) = self.attention_step(batch, t, cache, attention, &qkv);
        step("attention", rope_attention(qkv, keys, values, options))
    }
}

impl<B: Backend> Llama<B> {
    /// The model's SlideSparse layers in their portable packed form, each named by the
    /// model's layer name (`layers.0.qkv_proj`, ...): what `burn_slidesparse::load_packed`
    /// (with the names as they are) puts into the same model built on another backend, e.g.
    /// packed on the CPU reference, whose calibration does not depend on the device, and run
    /// on a GPU. Other layers are left out.
    pub fn packed_layers(&mut self) -> burn_slidesparse::Result<PackedFile> {
        let mut layers = Vec::new();
        self.visit_linears(&mut |name, layer| {
            if let Some(sparse) = layer.sparse() {
                layers.push(sparse.to_packed(name)?);
            }
            Ok(())
        })?;
        Ok(PackedFile { layers })
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
