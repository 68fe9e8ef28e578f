//! A model's decode step replayed as one CUDA graph ([`DecodeGraph`]): every kernel of the
//! step is this crate's, launched once at capture; a step costs the host one graph launch,
//! where queuing it through burn costs more than the GPU spends on it.
//!
//! It takes a pre-norm decoder with fused projections (Llama, Qwen2, Mistral: the layers of
//! [`DecoderBlock`]) whose linears are INT8 SlideSparse 6:8 or INT8 quantized layers (they
//! run the weight-streaming GEMV), bf16 or f16 activations, head dim 64 or 128, on burn-cuda's
//! plain backend ([`cuda::CudaBackend`](crate::cuda::CudaBackend)); with fusion, run
//! [`decoder_block`](crate::decoder_block) per block instead. Prefill stays the model's own
//! forward: it fills the caches the graph then reads and extends in place.
//!
//! The cache position and the tokens of a step live on the GPU. With an INT8 head the step
//! ends with the greedy argmax, which writes the next step's tokens and advances the position
//! there, so steps follow each other without the host ([`DecodeGraph::tokens`] reads them
//! back); without a head the step ends with the final norm's output
//! ([`DecodeGraph::hidden`]), and the caller applies its head and [`DecodeGraph::set`]s the
//! next tokens.

use std::marker::PhantomData;

use burn::{
    nn::{RmsNorm, RotaryEncoding},
    tensor::{Tensor, backend::Backend},
};
use burn_cubecl::{kernel::into_contiguous, tensor::CubeTensor};

use crate::{
    backend::SlideSparseBackend,
    block_ops::{
        DecoderBlock,
        cuda::{NativeLinear, native_linear},
    },
    cuda::{
        decode_graph::{Engine, StepBlock, StepLinear, StepModel, StepNorm},
        runtime::Runtime,
    },
    error::{Result, SlideSparseError},
    maybe_sparse::MaybeSparseLinear,
    native_ops::{from_plain_cuda, plain_cuda},
};

/// What a [`DecodeGraph`] reads: the model's layers and its caches.
pub struct DecodeModel<'a, B: SlideSparseBackend> {
    /// The token embedding `[vocab, hidden]`.
    pub embedding: &'a Tensor<B, 2>,
    /// The blocks, in order.
    pub blocks: Vec<DecoderBlock<'a, B>>,
    /// Each block's key and value cache `[batch, capacity, hkv, d]`, contiguous. The graph
    /// writes them in place at the position it holds; the model must not replace or grow
    /// them while the graph lives (build a new graph after it does).
    pub caches: Vec<(&'a Tensor<B, 4>, &'a Tensor<B, 4>)>,
    /// The norm after the last block.
    pub final_norm: &'a RmsNorm<B>,
    /// An INT8 head (SlideSparse or quantized) run inside the graph, or `None` (the step ends
    /// with the final norm's output).
    pub head: Option<&'a MaybeSparseLinear<B>>,
    /// burn's rotary encoding (adjacent pairs), covering every cache position.
    pub rope: &'a RotaryEncoding<B>,
    /// Query heads and key/value heads.
    pub heads: (usize, usize),
    /// Softmax scale (`None`: `1/sqrt(head dim)`).
    pub scale: Option<f32>,
}

/// A model's decode step as one CUDA graph per cache-length bucket (module docs).
pub struct DecodeGraph<B: Backend> {
    engine: Engine,
    _backend: PhantomData<B>,
}

fn not_plain_cuda(what: &str) -> SlideSparseError {
    SlideSparseError::Unsupported {
        what: format!("decode graph ({what})"),
        why: "it runs on burn-cuda's plain backend (`cuda::CudaBackend`); with fusion or \
              another backend run `decoder_block` per block"
            .into(),
    }
}

fn linear<B: SlideSparseBackend>(layer: &MaybeSparseLinear<B>, what: &str) -> Result<StepLinear> {
    match native_linear(layer)? {
        Some(NativeLinear::Sparse(gpu)) => StepLinear::of(&gpu, what),
        Some(NativeLinear::Dense(gpu)) => StepLinear::of(&gpu, what),
        None => Err(SlideSparseError::Unsupported {
            what: format!("{what} in a decode graph"),
            why: "a dense or masked layer (the graph runs INT8 SlideSparse and quantized layers)"
                .into(),
        }),
    }
}

/// `t` as a contiguous plain burn-cuda tensor: burn-cuda may give a 2-D tensor padded
/// ("pitched") rows, and the graph's kernels read rows back to back (a copy then, once).
fn contiguous<B: Backend, const D: usize>(
    t: &Tensor<B, D>,
    what: &str,
) -> Result<CubeTensor<Runtime>> {
    plain_cuda(t)
        .map(into_contiguous)
        .ok_or_else(|| not_plain_cuda(what))
}

fn norm<B: SlideSparseBackend>(norm: &RmsNorm<B>, what: &str) -> Result<StepNorm> {
    Ok(StepNorm {
        gamma: contiguous(&norm.gamma.val(), what)?,
        eps: norm.epsilon as f32,
    })
}

impl<B: SlideSparseBackend> DecodeGraph<B> {
    /// The graph of `model`'s decode step (nothing is captured until the first step). Errors
    /// name what the graph does not run: another backend, a layer without a GEMV, caches of
    /// other shapes, dtypes other than bf16/f16.
    pub fn new(model: DecodeModel<'_, B>) -> Result<Self> {
        if model.blocks.len() != model.caches.len() {
            return Err(SlideSparseError::shape(
                "decode graph caches (one pair per block)",
                model.blocks.len(),
                model.caches.len(),
            ));
        }
        let cuda = |t: Option<_>, what: &str| t.ok_or_else(|| not_plain_cuda(what));
        let mut blocks = Vec::with_capacity(model.blocks.len());
        for (block, (keys, values)) in model.blocks.iter().zip(&model.caches) {
            blocks.push(StepBlock {
                attn_norm: norm(block.attn_norm, "attention norm")?,
                qkv: linear(block.qkv, "qkv projection")?,
                o: linear(block.o, "o projection")?,
                mlp_norm: norm(block.mlp_norm, "MLP norm")?,
                gate_up: linear(block.gate_up, "gate/up projection")?,
                down: linear(block.down, "down projection")?,
                keys: cuda(plain_cuda(*keys), "key cache")?,
                values: cuda(plain_cuda(*values), "value cache")?,
            });
        }
        let batch = model.caches.first().map_or(0, |(k, _)| k.dims()[0]);
        let step = StepModel {
            embedding: contiguous(model.embedding, "embedding")?,
            blocks,
            final_norm: norm(model.final_norm, "final norm")?,
            head: model.head.map(|h| linear(h, "head")).transpose()?,
            rope: cuda(plain_cuda(&model.rope.freq_complex), "RoPE table")?,
            heads: model.heads,
            scale: model.scale,
            batch,
        };
        Ok(Self {
            engine: Engine::new(step)?,
            _backend: PhantomData,
        })
    }

    /// Sets the cache position (positions `0..position` are filled) and the next step's
    /// tokens, one per sequence.
    pub fn set(&mut self, position: usize, tokens: &[u32]) -> Result<()> {
        self.engine.set(position, tokens)
    }

    /// Sets the cache position alone (positions `0..position` are filled); the next step reads
    /// the tokens the last step's argmax wrote, or the ones last set.
    pub fn set_position(&mut self, position: usize) -> Result<()> {
        self.engine.set_position(position)
    }

    /// One decode step, queued on burn's stream (no synchronization): the graph of the cache's
    /// bucket replayed (captured on first use).
    pub fn step(&mut self) -> Result<()> {
        self.engine.step()
    }

    /// The same step without a graph: its launches one by one (what the graph replays; the
    /// tests compare the two).
    pub fn step_without_graph(&mut self) -> Result<()> {
        self.engine.run_direct()
    }

    /// Whether the step ends with the head and the greedy argmax (the next step's tokens
    /// then follow on the device).
    pub fn has_head(&self) -> bool {
        self.engine.has_head()
    }

    /// Cache positions filled before the next step.
    pub fn position(&self) -> usize {
        self.engine.position()
    }

    /// The next step's tokens, one per sequence (synchronizes burn's stream).
    pub fn tokens(&self) -> Result<Vec<u32>> {
        self.engine.tokens()
    }

    /// The last step's final-norm output `[batch, hidden]` (a copy).
    pub fn hidden(&self) -> Result<Tensor<B, 2>> {
        from_plain_cuda(self.engine.hidden()?).ok_or_else(|| not_plain_cuda("output"))
    }

    /// The last step's logits `[batch, vocab]` (a copy; a graph with a head).
    pub fn logits(&self) -> Result<Tensor<B, 2>> {
        from_plain_cuda(self.engine.logits()?).ok_or_else(|| not_plain_cuda("output"))
    }

    /// Kernel launches one step replays.
    pub fn launches_per_step(&self) -> Result<usize> {
        self.engine.launches_per_step()
    }

    /// Graphs captured so far (one per cache-length bucket used).
    pub fn graphs(&self) -> usize {
        self.engine.graphs()
    }
}
