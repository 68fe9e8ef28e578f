#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

// The public API is the re-exports below (plus `cuda` and `gguf` behind their features); the
// modules themselves are crate-private so that what a user sees is what we mean to keep
// stable. The project's own tests, CLI and benchmarks reach further in through `internals`.

mod attention;
mod autodiff;
mod backend;
mod block_ops;
mod checkpoint;
mod codes;
#[cfg(feature = "cubecl")]
mod cube;
mod error;
mod files;
mod format;
mod fp8;
mod fuse;
#[cfg(feature = "fusion")]
mod fusion;
mod masked;
mod module;
#[cfg(feature = "cuda")]
mod native_ops;
mod pack;
mod pattern;
mod permute;
mod prune;
mod quant;
mod quantized;
mod reference;
mod shard;
mod slide;
mod swap;
#[cfg(feature = "internals")]
mod synthetic;
mod tensor_parallel;
#[cfg(test)]
mod test_rng;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "gguf")]
pub mod gguf;

pub use attention::{
    AttentionOptions, AttentionShape, causal_attention, causal_attention_reference,
};
pub use autodiff::AutodiffPrepared;
pub use backend::{DenseTensors, LayerSpec, PackedTensors, SlideSparseBackend};
pub use block_ops::{
    DecoderBlock, RopeAttention, add_rms_norm, add_rms_norm_linear, decoder_block, rms_norm,
    rms_norm_linear, rope_attention, rope_attention_linear, silu_mul, silu_mul_linear,
};
pub use checkpoint::{
    DEFAULT_EXCLUDE, DEFAULT_LAYER_FILTER, LayerSelection, PackProgress, PackReport, VerifyReport,
    pack_checkpoint, pack_checkpoint_with_progress, verify_checkpoint,
};
pub use codes::{WeightCodesModule, WeightCodesRecord};
#[cfg(feature = "cubecl")]
pub use cube::CubePrepared;
pub use error::{Result, SlideSparseError};
pub use format::{FORMAT_VERSION, LayerMeta, PackedFile, save_layers};
pub use fuse::concat_outputs;
#[cfg(feature = "fusion")]
pub use fusion::FusionPrepared;
pub use masked::MaskedLinear;
pub use module::{SlideSparseLinear, SlideSparseLinearConfig};
pub use pack::{DEFAULT_ALIGNMENT, PackOptions, PackStats, PackedLinear, pack_linear};
pub use pattern::SparsityPattern;
pub use permute::{
    ChannelPermutation, InputPermutation, PermutationOutcome, PermutationSearch, search_permutation,
};
pub use prune::{PruneMethod, SparseGptCalibration, check_pattern, prune};
pub use quant::{Precision, QuantizedWeight, WeightCodes};
pub use quantized::QuantizedLinear;
pub use reference::ReferencePrepared;
pub use shard::{DenseShard, Parallelism, input_range, shard_packed, shard_quantized};
pub use swap::{
    MaybeSparseLinear, VisitLinears, load_file, load_packed, load_packed_file, load_record,
    mask_with, prepare_all, quantize_dense, sparsify, sparsify_with,
};
pub use tensor_parallel::{Collective, SimulatedRanks, TensorParallelLinear, shard_linear};

/// What `impl_reference_backend!` expands to; not an API.
#[doc(hidden)]
pub mod __macro_support {
    pub use crate::reference::{forward, prepare, prepare_dense};
}

/// The crate's internals for the project's own tests, CLI and benchmarks (feature
/// `internals`). Not a stable API: anything here may change in any release.
#[doc(hidden)]
#[cfg(feature = "internals")]
pub mod internals {
    pub use crate::{files::write_atomically, synthetic::write_random_checkpoint};

    /// Packed file layout: tensor names, metadata keys, byte helpers.
    pub mod format {
        pub use crate::format::*;
    }
    /// FP8 E4M3 encoding and decoding on the host.
    pub mod fp8 {
        pub use crate::fp8::*;
    }
    /// Packing: pruning, quantization and sliding of one layer.
    pub mod pack {
        pub use crate::pack::*;
    }
    /// Sparsity patterns.
    pub mod pattern {
        pub use crate::pattern::*;
    }
    /// Input-channel permutations and their search.
    pub mod permute {
        pub use crate::permute::*;
    }
    /// Pruning to a pattern.
    pub mod prune {
        pub use crate::prune::*;
    }
    /// Precisions, weight codes and weight quantization.
    pub mod quant {
        pub use crate::quant::*;
    }
    /// The CPU reference forward (any burn backend).
    pub mod reference {
        pub use crate::reference::*;
    }
    /// The slide transformation of one row or matrix.
    pub mod slide {
        pub use crate::slide::*;
    }
    /// Checkpoint packing and verification.
    pub mod checkpoint {
        pub use crate::checkpoint::*;
    }
    /// The `SlideSparseLinear` module and its helpers.
    pub mod module {
        pub use crate::module::*;
    }
    /// The backend trait and the prepared-weight tensors.
    pub mod backend {
        pub use crate::backend::*;
    }
    /// The fusion backend's custom operations (the identity one, for benchmarks).
    #[cfg(feature = "fusion")]
    pub mod fusion {
        pub use crate::fusion::identity_custom_op;
    }
}
