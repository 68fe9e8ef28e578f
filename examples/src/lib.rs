//! Shared code of the examples: a Llama-architecture model with swappable linear layers and
//! its GGUF loader.

pub mod eval;
pub mod fetch;
pub mod gguf_llama;
pub mod llama;
pub mod tokenizer;
