//! The example Llama split over tensor-parallel ranks (Megatron-style), one device each,
//! driven by one process: every rank holds every block's shards, and the two collectives
//! per block (after the attention's output projection and after the MLP's down projection)
//! sum the ranks' partial outputs.
//!
//! Per block and rank: `qkv` is column-parallel, split per component (the rank's query heads,
//! then its key and value heads), `o` row-parallel over the same heads; `gate_up` is
//! column-parallel per component, `down` row-parallel. Norms, embeddings and the rotary
//! table are replicated, so between the collectives each rank runs the library's composed
//! steps (`rms_norm_linear`, `rope_attention_linear`, `add_rms_norm_linear`,
//! `silu_mul_linear`) on its own device with no communication. The final norm and the LM
//! head run on rank 0. Token ids are uploaded to every rank ([`TensorParallelLlama::upload`]):
//! a device-to-device copy of them would be a host round trip in burn-cuda.
//! `docs/decisions/tensor-parallel.md` says what is exact.

use burn::{
    module::Module,
    nn::{Embedding, RmsNorm, RotaryEncoding},
    tensor::{Int, Tensor, TensorCreationOptions, TensorData, backend::Backend},
};
use burn_slidesparse::{
    Collective, MaybeSparseLinear, Parallelism, RopeAttention, SlideSparseBackend,
    SlideSparseError, add_rms_norm_linear, concat_outputs, rms_norm, rms_norm_linear,
    rope_attention_linear, shard_linear, silu_mul_linear,
};

use crate::llama::{Block, Llama, Projections};

mod threads;
pub use threads::{MeetingRanks, RankCollective, RankThreads};

type Result<T> = burn_slidesparse::Result<T>;

/// A rank's residual stream and the output still to be added to it (`None` before the
/// first block).
type Residual<B> = (Tensor<B, 3>, Option<Tensor<B, 3>>);

/// One rank's part of a decoder block.
#[derive(Debug)]
struct ShardBlock<B: Backend> {
    attn_norm: RmsNorm<B>,
    /// The rank's `[q | k | v]` heads in one layer.
    qkv: MaybeSparseLinear<B>,
    /// Row-parallel over the rank's query heads.
    o: MaybeSparseLinear<B>,
    mlp_norm: RmsNorm<B>,
    /// The rank's `[gate | up]` channels in one layer.
    gate_up: MaybeSparseLinear<B>,
    /// Row-parallel over the rank's intermediate channels.
    down: MaybeSparseLinear<B>,
}

/// Everything one rank holds.
#[derive(Debug)]
struct RankModel<B: Backend> {
    device: B::Device,
    embed: Embedding<B>,
    rope: RotaryEncoding<B>,
    blocks: Vec<ShardBlock<B>>,
}

/// A [`Llama`] split over tensor-parallel ranks ([`TensorParallelLlama::split`]).
#[derive(Debug)]
pub struct TensorParallelLlama<B: Backend> {
    ranks: Vec<RankModel<B>>,
    /// On rank 0.
    norm: RmsNorm<B>,
    /// On rank 0.
    lm_head: MaybeSparseLinear<B>,
    /// Query and key/value heads of each rank.
    heads: (usize, usize),
}

/// The keys and values of every rank's heads, per block: `[batch, capacity, kv_heads / R,
/// head_dim]` tensors on the rank's device, written in place.
#[derive(Debug)]
pub struct TensorParallelCache<B: Backend> {
    ranks: Vec<Vec<(Tensor<B, 4>, Tensor<B, 4>)>>,
    len: usize,
    batch: usize,
    capacity: usize,
}

impl<B: Backend> TensorParallelCache<B> {
    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// A split the model's shapes do not allow.
fn invalid(ranks: usize, detail: String) -> SlideSparseError {
    SlideSparseError::InvalidSplit {
        layer: "TensorParallelLlama".into(),
        ranks,
        detail,
    }
}

/// Splits separate layers column-parallel and fuses each rank's parts (`[q | k | v]` or
/// `[gate | up]` of the rank's heads or channels).
fn column_fused<B: Backend>(
    layers: &[MaybeSparseLinear<B>],
    names: &[String],
    devices: &[B::Device],
) -> Result<Vec<MaybeSparseLinear<B>>> {
    let shards = layers
        .iter()
        .zip(names)
        .map(|(layer, name)| shard_linear(layer, name, Parallelism::Column, devices))
        .collect::<Result<Vec<_>>>()?;
    (0..devices.len())
        .map(|rank| concat_outputs(&shards.iter().map(|s| &s[rank]).collect::<Vec<_>>()))
        .collect()
}

impl<B: SlideSparseBackend> TensorParallelLlama<B> {
    /// Splits `model` over `devices` (one rank each, rank 0 first). The model's projections
    /// must be separate (split before [`Llama::fuse_projections`]: a fused `qkv` is not a
    /// contiguous split by heads); each rank's are fused again here.
    ///
    /// Errors ([`SlideSparseError::InvalidSplit`]): no devices; head counts or
    /// `intermediate` not splittable over the ranks (see `shard_linear`; the row-parallel
    /// layers need their `K` in whole pattern blocks per rank); fused projections.
    pub fn split(model: &Llama<B>, devices: &[B::Device]) -> Result<Self> {
        let ranks = devices.len();
        if ranks == 0 {
            return Err(invalid(0, "at least one device is needed".into()));
        }
        let (heads, kv_heads) = (model.heads, model.kv_heads);
        if heads % ranks != 0 || kv_heads % ranks != 0 {
            return Err(invalid(
                ranks,
                format!("{heads} query and {kv_heads} key/value heads do not split evenly"),
            ));
        }
        let mut shards: Vec<Vec<ShardBlock<B>>> = (0..ranks).map(|_| Vec::new()).collect();
        for (i, block) in model.blocks.iter().enumerate() {
            for (rank, shard) in Self::split_block(i, block, devices)?
                .into_iter()
                .enumerate()
            {
                shards[rank].push(shard);
            }
        }
        let ranks = devices
            .iter()
            .zip(shards)
            .map(|(device, blocks)| RankModel {
                device: device.clone(),
                embed: model.embed.clone().to_device(device),
                rope: model.rope.clone().to_device(device),
                blocks,
            })
            .collect();
        Ok(Self {
            ranks,
            norm: model.norm.clone().to_device(&devices[0]),
            lm_head: model.lm_head.clone().to_device(&devices[0]),
            heads: (heads / devices.len(), kv_heads / devices.len()),
        })
    }

    /// Block `i`'s shards, rank 0 first.
    fn split_block(
        i: usize,
        block: &Block<B>,
        devices: &[B::Device],
    ) -> Result<Vec<ShardBlock<B>>> {
        let separate = |p: &Projections<B>, what: &str| {
            p.separate().map(<[_]>::to_vec).ok_or_else(|| {
                invalid(
                    devices.len(),
                    format!("block {i}: {what} is fused; split the model before fuse_projections"),
                )
            })
        };
        let name = |layer: &str| format!("layers.{i}.{layer}");
        let names = |layers: &[&str]| layers.iter().map(|l| name(l)).collect::<Vec<_>>();
        let qkv = column_fused(
            &separate(&block.attn_in, "q/k/v")?,
            &names(&["q_proj", "k_proj", "v_proj"]),
            devices,
        )?;
        let gate_up = column_fused(
            &separate(&block.mlp_in, "gate/up")?,
            &names(&["gate_proj", "up_proj"]),
            devices,
        )?;
        let o = shard_linear(&block.o, &name("o_proj"), Parallelism::Row, devices)?;
        let down = shard_linear(&block.down, &name("down_proj"), Parallelism::Row, devices)?;
        Ok(devices
            .iter()
            .zip(qkv.into_iter().zip(o).zip(gate_up.into_iter().zip(down)))
            .map(|(device, ((qkv, o), (gate_up, down)))| ShardBlock {
                attn_norm: block.attn_norm.clone().to_device(device),
                qkv,
                o,
                mlp_norm: block.mlp_norm.clone().to_device(device),
                gate_up,
                down,
            })
            .collect())
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// An empty cache for `batch` sequences of up to `capacity` tokens, in the embeddings'
    /// dtype, allocated on every rank now (a forward past the capacity is an error).
    pub fn cache(&self, batch: usize, capacity: usize) -> TensorParallelCache<B> {
        let (_, kv_heads) = self.heads;
        let ranks = self
            .ranks
            .iter()
            .map(|rank| {
                let weight = rank.embed.weight.val();
                let options = TensorCreationOptions::default()
                    .with_device(rank.device.clone())
                    .with_dtype(weight.dtype());
                let hd = rank
                    .blocks
                    .first()
                    .map_or(0, |b| b.qkv.features().1 / (self.heads.0 + 2 * kv_heads));
                let zeros = || Tensor::zeros([batch, capacity, kv_heads, hd], options.clone());
                rank.blocks.iter().map(|_| (zeros(), zeros())).collect()
            })
            .collect();
        TensorParallelCache {
            ranks,
            len: 0,
            batch,
            capacity,
        }
    }

    /// `[batch, t]` token ids uploaded to every rank's device (what the forwards take).
    pub fn upload(&self, ids: &TensorData) -> Vec<Tensor<B, 2, Int>> {
        self.ranks
            .iter()
            .map(|rank| Tensor::from_data(ids.clone(), &rank.device))
            .collect()
    }

    /// Logits `[batch, t, vocab]` (on rank 0) for `tokens` (each rank's copy of the
    /// `[batch, t]` ids: [`upload`](Self::upload)) following the cached ones.
    pub fn forward(
        &self,
        tokens: Vec<Tensor<B, 2, Int>>,
        cache: &mut TensorParallelCache<B>,
        collective: &impl Collective<B>,
    ) -> Result<Tensor<B, 3>> {
        let hidden = self.hidden_states(tokens, cache, collective)?;
        self.lm_head.try_forward(rms_norm(hidden, &self.norm)?)
    }

    /// Logits `[batch, vocab]` of the last position only (what generation needs).
    pub fn forward_last(
        &self,
        tokens: Vec<Tensor<B, 2, Int>>,
        cache: &mut TensorParallelCache<B>,
        collective: &impl Collective<B>,
    ) -> Result<Tensor<B, 2>> {
        let hidden = self.hidden_states(tokens, cache, collective)?;
        self.last_logits(hidden)
    }

    /// Checks a forward's token tensors, collective and cache against the ranks; returns
    /// the count of new tokens.
    fn check_call(
        &self,
        tokens: &[Tensor<B, 2, Int>],
        collective_ranks: usize,
        cache: &TensorParallelCache<B>,
    ) -> Result<usize> {
        let ranks = self.ranks();
        for (what, got) in [
            ("token tensors", tokens.len()),
            ("the collective's ranks", collective_ranks),
            ("the cache's ranks", cache.ranks.len()),
        ] {
            if got != ranks {
                return Err(SlideSparseError::shape(
                    format!("TensorParallelLlama: {what}"),
                    ranks,
                    got,
                ));
            }
        }
        let [batch, t] = tokens[0].dims();
        if t == 0 || batch != cache.batch || cache.len + t > cache.capacity {
            return Err(SlideSparseError::shape(
                "TensorParallelLlama: [batch, cached + new tokens] within the cache",
                [cache.batch, cache.capacity],
                [batch, cache.len + t],
            ));
        }
        Ok(t)
    }

    /// Logits `[batch, vocab]` of the last position of rank 0's residual stream `[batch, t,
    /// hidden]`.
    fn last_logits(&self, hidden: Tensor<B, 3>) -> Result<Tensor<B, 2>> {
        let [batch, t, width] = hidden.dims();
        let last = hidden
            .slice([0..batch, t - 1..t, 0..width])
            .reshape([batch, width]);
        self.lm_head.try_forward(rms_norm(last, &self.norm)?)
    }

    /// Rank 0's residual stream after the last block `[batch, t, hidden]`.
    fn hidden_states(
        &self,
        tokens: Vec<Tensor<B, 2, Int>>,
        cache: &mut TensorParallelCache<B>,
        collective: &impl Collective<B>,
    ) -> Result<Tensor<B, 3>> {
        let t = self.check_call(&tokens, collective.ranks(), cache)?;
        let start = cache.len;
        let mut streams: Vec<Residual<B>> = self
            .ranks
            .iter()
            .zip(tokens)
            .map(|(rank, ids)| (rank.embed.forward(ids), None))
            .collect();
        for b in 0..self.ranks[0].blocks.len() {
            streams = self.block(b, streams, cache, start, collective)?;
        }
        cache.len = start + t;
        match streams.swap_remove(0) {
            (x, Some(delta)) => Ok(x + delta),
            (x, None) => Ok(x),
        }
    }

    /// Block `b` on every rank's `(x, delta)`: the attention half, a sum over the ranks,
    /// the MLP half, a sum again; returns each rank's `(h, mlp)` for the next block.
    fn block(
        &self,
        b: usize,
        streams: Vec<Residual<B>>,
        cache: &mut TensorParallelCache<B>,
        start: usize,
        collective: &impl Collective<B>,
    ) -> Result<Vec<Residual<B>>> {
        let mut residuals = Vec::with_capacity(self.ranks());
        let mut partials = Vec::with_capacity(self.ranks());
        for ((rank, stream), slots) in self.ranks.iter().zip(streams).zip(&mut cache.ranks) {
            let (x, partial) = rank.attention_half(b, stream, &mut slots[b], start, self.heads)?;
            partials.push(partial);
            residuals.push(x);
        }
        let attended = sum_over_ranks(partials, collective)?;
        let mut next = Vec::with_capacity(self.ranks());
        let mut partials = Vec::with_capacity(self.ranks());
        for ((rank, x), delta) in self.ranks.iter().zip(residuals).zip(attended) {
            let (h, partial) = rank.mlp_half(b, x, delta)?;
            partials.push(partial);
            next.push(h);
        }
        let mlp = sum_over_ranks(partials, collective)?;
        Ok(next
            .into_iter()
            .zip(mlp)
            .map(|(h, m)| (h, Some(m)))
            .collect())
    }
}

impl<B: SlideSparseBackend> RankModel<B> {
    /// The attention half of block `b` on this rank's `(x, delta)`: the residual stream
    /// `x + delta` and this rank's partial output of `o` (to be summed over the ranks).
    fn attention_half(
        &self,
        b: usize,
        (x, delta): Residual<B>,
        (keys, values): &mut (Tensor<B, 4>, Tensor<B, 4>),
        start: usize,
        heads: (usize, usize),
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>)> {
        let shard = &self.blocks[b];
        let (x, qkv) = match delta {
            Some(delta) => add_rms_norm_linear(x, delta, &shard.attn_norm, &shard.qkv)?,
            None => (x.clone(), rms_norm_linear(x, &shard.attn_norm, &shard.qkv)?),
        };
        let step = RopeAttention {
            rope: &self.rope,
            start,
            heads,
            scale: None,
        };
        let partial = rope_attention_linear(qkv, keys, values, step, &shard.o)?;
        Ok((x, partial))
    }

    /// The MLP half of block `b`: the residual stream `x + attended` and this rank's
    /// partial output of `down`.
    fn mlp_half(
        &self,
        b: usize,
        x: Tensor<B, 3>,
        attended: Tensor<B, 3>,
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>)> {
        let shard = &self.blocks[b];
        let (h, gate_up) = add_rms_norm_linear(x, attended, &shard.mlp_norm, &shard.gate_up)?;
        Ok((h, silu_mul_linear(gate_up, &shard.down)?))
    }
}

/// Every rank's `[batch, t, hidden]` partial output summed over the ranks, on every rank.
fn sum_over_ranks<B: Backend>(
    partials: Vec<Tensor<B, 3>>,
    collective: &impl Collective<B>,
) -> Result<Vec<Tensor<B, 3>>> {
    let [batch, t, width] = partials[0].dims();
    let flat = partials
        .into_iter()
        .map(|p| p.reshape([batch * t, width]))
        .collect();
    Ok(collective
        .all_reduce_sum(flat)?
        .into_iter()
        .map(|s| s.reshape([batch, t, width]))
        .collect())
}
