#![doc = include_str!("../README.md")]

pub mod error;
pub mod format;
pub mod fp8;
pub mod pack;
pub mod pattern;
pub mod prune;
pub mod quant;
pub mod slide;

pub use error::{Result, SlideSparseError};
pub use pack::{PackOptions, PackedLinear, pack_linear};
pub use pattern::SparsityPattern;
pub use prune::PruneMethod;
pub use quant::Precision;
pub mod backend;
pub mod module;
pub mod reference;

pub use backend::{LayerSpec, SlideSparseBackend};
pub use module::{SlideSparseLinear, SlideSparseLinearConfig};
pub mod checkpoint;
pub mod demo;
pub mod masked;
pub mod quantized;
pub mod swap;

pub use masked::MaskedLinear;
pub use quantized::QuantizedLinear;
pub use swap::{
    MaybeSparseLinear, VisitLinears, load_file, load_record, mask_with, prepare_all,
    quantize_dense, sparsify, sparsify_with,
};
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gguf;
