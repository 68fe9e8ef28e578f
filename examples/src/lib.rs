//! Shared code of the examples: a Llama-architecture model with swappable linear layers, its
//! GGUF and Hugging Face loaders, tokenizer, sampling and evaluation.

pub mod eval;
pub mod fetch;
pub mod gguf_llama;
pub mod hf_llama;
pub mod llama;
pub mod sampling;
pub mod tokenizer;
