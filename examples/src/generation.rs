//! Token-by-token generation over a preallocated KV cache: the prompt's forward, then one
//! decode step per token, through the model's forward or, where it applies, the library's
//! whole decode step replayed as one CUDA graph (`burn_slidesparse::DecodeGraph`).

use std::fmt;

use burn::tensor::{Int, Tensor, TensorData};
use burn_slidesparse::{Result, SlideSparseBackend, SlideSparseError};

use crate::llama::{KvCache, Llama};

/// How a [`Generator`] runs its decode steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodePath {
    /// The model's forward on each token (`Llama::forward_last`).
    Forward,
    /// The model's forward, because the decode graph was asked for and does not apply to this
    /// model or backend (the reason).
    ForwardInstead(String),
    /// The whole step as one CUDA graph (`Llama::decode_graph`); `head` says whether the graph
    /// ends with the LM head (an INT8 head) or the head runs after it (a bf16 head, e.g. one
    /// tied to the embedding).
    Graph { head: bool },
}

impl DecodePath {
    /// A few words for a table.
    pub fn short(&self) -> &'static str {
        match self {
            Self::Forward | Self::ForwardInstead(_) => "forward",
            Self::Graph { .. } => "CUDA graph",
        }
    }
}

impl fmt::Display for DecodePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Forward => write!(f, "the model's forward per token"),
            Self::ForwardInstead(why) => {
                write!(f, "the model's forward per token (no decode graph: {why})")
            }
            Self::Graph { head: true } => {
                write!(f, "one CUDA graph per step, the INT8 LM head inside it")
            }
            Self::Graph { head: false } => write!(
                f,
                "one CUDA graph per step (blocks and final norm), then the LM head"
            ),
        }
    }
}

/// Generates over one sequence (batch 1): [`prefill`](Self::prefill) a prompt, then
/// [`step`](Self::step) one token at a time; each returns the next position's logits
/// `[1, vocab]`, to sample on the host. A generator can start over with another prefill: the
/// cache (and a decode graph built over it) is reused, not reallocated.
pub struct Generator<'m, B: SlideSparseBackend> {
    model: &'m Llama<B>,
    cache: KvCache<B>,
    /// Positions filled before the next step.
    position: usize,
    path: DecodePath,
    #[cfg(feature = "cuda")]
    graph: Option<burn_slidesparse::DecodeGraph<B>>,
}

impl<'m, B: SlideSparseBackend> Generator<'m, B> {
    /// A generator whose cache holds `capacity` positions (the prompt and every token to be
    /// decoded), decoding through the CUDA graph where `graph` asks for it and the model
    /// allows it (fused projections, INT8 SlideSparse or quantized linears, burn-cuda's plain
    /// backend, bf16/f16; see [`Llama::decode_graph`]), through the model's forward otherwise.
    pub fn new(model: &'m Llama<B>, capacity: usize, graph: bool) -> Self {
        let path = match graph {
            false => DecodePath::Forward,
            true if cfg!(feature = "cuda") => DecodePath::Graph { head: false },
            true => DecodePath::ForwardInstead("built without the cuda feature".into()),
        };
        Self {
            model,
            cache: KvCache::with_capacity(capacity),
            position: 0,
            path,
            #[cfg(feature = "cuda")]
            graph: None,
        }
    }

    /// How the decode steps run (decided by the first prefill where a graph was asked for).
    pub fn path(&self) -> &DecodePath {
        &self.path
    }

    fn tokens(&self, ids: &[u32]) -> Tensor<B, 2, Int> {
        Tensor::from_data(
            TensorData::new(
                ids.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [1, ids.len()],
            ),
            &self.model.embed.weight.device(),
        )
    }

    /// Starts over with `prompt`: the logits `[1, vocab]` of its last position.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Tensor<B, 2>> {
        if prompt.is_empty() {
            return Err(SlideSparseError::Unsupported {
                what: "generation".into(),
                why: "an empty prompt".into(),
            });
        }
        self.cache.truncate(0);
        let capacity = self.cache.capacity();
        let logits = self
            .model
            .forward_last(self.tokens(prompt), &mut self.cache);
        self.position = self.cache.len();
        #[cfg(feature = "cuda")]
        self.build_graph(capacity);
        #[cfg(not(feature = "cuda"))]
        let _ = capacity;
        Ok(logits)
    }

    /// After a prefill: the graph over this cache, built once and kept across prefills. The
    /// graph holds the cache's buffers, and a prefill writes into them in place (the graph
    /// only applies where the attention step has its kernel, which writes the cache in
    /// place), so the graph stays valid; a cache that grew has new buffers and gets a new
    /// graph.
    #[cfg(feature = "cuda")]
    fn build_graph(&mut self, capacity_before: usize) {
        if self.cache.capacity() != capacity_before {
            self.graph = None;
        }
        if !matches!(self.path, DecodePath::Graph { .. }) || self.graph.is_some() {
            return;
        }
        match self.model.decode_graph(&self.cache) {
            Ok(graph) => {
                self.path = DecodePath::Graph {
                    head: graph.has_head(),
                };
                self.graph = Some(graph);
            }
            Err(e) => self.path = DecodePath::ForwardInstead(e.to_string()),
        }
    }

    /// Decodes `token` (the one chosen after the last logits): the logits `[1, vocab]` of the
    /// position after it.
    pub fn step(&mut self, token: u32) -> Result<Tensor<B, 2>> {
        if self.position == 0 {
            return Err(SlideSparseError::Unsupported {
                what: "a decode step".into(),
                why: "no prompt yet (call prefill first)".into(),
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(graph) = self.graph.as_mut() {
            // The host sets each step's token and position: the sampler chooses the token, not
            // the graph's greedy argmax.
            graph.set(self.position, &[token])?;
            graph.step()?;
            self.position += 1;
            return match graph.has_head() {
                true => graph.logits(),
                false => Ok(self.model.lm_head.forward(graph.hidden()?)),
            };
        }
        let logits = self
            .model
            .forward_last(self.tokens(&[token]), &mut self.cache);
        self.position = self.cache.len();
        Ok(logits)
    }
}
