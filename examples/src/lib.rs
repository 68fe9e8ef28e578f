//! Shared code of the examples: a Llama-architecture model with swappable linear layers, its
//! GGUF and Hugging Face loaders, tokenizer, sampling, generation and evaluation, and (feature
//! `cuda`) the GPU setup of the examples.

pub mod eval;
pub mod fetch;
pub mod generation;
pub mod gguf_llama;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod hf_llama;
pub mod llama;
pub mod safetensors_io;
pub mod sampling;
pub mod tensor_parallel;
pub mod text_span;
pub mod tokenizer;
pub mod train;

/// The error for a `--device` value the examples do not know (which ones exist depends on
/// the `cuda` feature).
pub fn unknown_device(name: &str) -> String {
    format!(
        "unknown --device {name}: cpu{}",
        if cfg!(feature = "cuda") {
            " or cuda"
        } else {
            " (build with --features cuda for cuda)"
        }
    )
}
