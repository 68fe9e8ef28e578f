#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

// The public API is the re-exports below (plus `cuda` and `gguf` behind their features); the
// modules themselves are crate-private so that what a user sees is what we mean to keep
// stable. The project's own tests, CLI and benchmarks reach further in through `internals`.

mod attention;
mod attention_shape;
mod autodiff;
mod backend;
mod block_ops;
mod checkpoint;
mod codes;
mod collective;
mod compact;
mod concat;
mod cpu_backend;
mod cpu_int8;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cuda")]
mod decode_graph;
// Every path that queues work uses it: burn's fusion backend, and the CUDA path (which
// enables `fusion`); its unit tests run in every build.
#[cfg(any(test, feature = "fusion"))]
mod deferred;
mod error;
mod files;
mod format;
mod fp8;
#[cfg(feature = "fusion")]
mod fusion;
mod load;
mod masked_linear;
mod maybe_sparse;
#[cfg(feature = "cuda")]
mod native_ops;
mod pack;
mod pattern;
mod permute;
mod prune;
mod quantized_linear;
mod reference;
mod shard;
mod slide;
mod sparse_linear;
mod sparsify;
#[cfg(feature = "internals")]
mod synthetic;
mod tensor_parallel;
#[cfg(test)]
mod test_rng;
mod weight_quant;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "gguf")]
pub mod gguf;

pub use attention::{AttentionOptions, causal_attention, causal_attention_reference};
pub use attention_shape::AttentionShape;
pub use autodiff::AutodiffPrepared;
pub use backend::{DenseTensors, PackedTensors, SlideSparseBackend};
pub use block_ops::{
    DecoderBlock, RopeAttention, add_rms_norm, add_rms_norm_linear, decoder_block, rms_norm,
    rms_norm_linear, rope_attention, rope_attention_linear, silu_mul, silu_mul_linear,
};
pub use checkpoint::{
    DEFAULT_EXCLUDE, DEFAULT_LAYER_FILTER, LayerSelection, PackProgress, PackReport, VerifyReport,
    pack_checkpoint, pack_checkpoint_with_progress, verify_checkpoint,
};
pub use codes::{WeightCodesModule, WeightCodesRecord};
pub use collective::{Collective, SimulatedRanks};
pub use compact::{
    CodeByte, CompactCodes, CompactRows, CompactWeight, DecodeTiles, HostCodes, pair_of_rank,
    pair_rank, rank_bits, window_metadata, window_nibble,
};
pub use concat::concat_outputs;
pub use cpu_backend::CpuPrepared;
pub use cpu_int8::{CpuInt8Layer, Isa};
#[cfg(feature = "cubecl")]
pub use cube::CubePrepared;
#[cfg(feature = "cuda")]
pub use decode_graph::{DecodeGraph, DecodeModel};
pub use error::{Result, SlideSparseError};
pub use format::{
    FORMAT_VERSION, KEPT_SUFFIX, LayerMeta, PERMUTATION_SUFFIX, PackedFile, WeightLayout,
    ZERO_PAIRS_SUFFIX, read_f32, save_layers,
};
#[cfg(feature = "fusion")]
pub use fusion::FusionPrepared;
pub use load::{load_file, load_packed, load_packed_file, load_record};
pub use masked_linear::MaskedLinear;
pub use maybe_sparse::{MaybeSparseLinear, VisitLinears};
pub use pack::{DEFAULT_ALIGNMENT, LayerSpec, PackOptions, PackStats, PackedLinear, pack_linear};
pub use pattern::SparsityPattern;
pub use permute::{
    ChannelPermutation, InputPermutation, PermutationOutcome, PermutationSearch, search_permutation,
};
pub use prune::{
    AllocationGroup, KeptWeightGrid, PatternCandidate, PruneMethod, SparseGptCalibration,
    allocate_patterns, check_pattern, prune,
};
pub use quantized_linear::QuantizedLinear;
pub use reference::ReferencePrepared;
pub use shard::{DenseShard, Parallelism, input_range, shard_packed, shard_quantized};
pub use sparse_linear::{SlideSparseLinear, SlideSparseLinearConfig};
pub use sparsify::{mask_with, prepare_all, quantize_dense, sparsify, sparsify_with};
pub use tensor_parallel::{TensorParallelLinear, shard_linear};
pub use weight_quant::{Precision, QuantizedWeight, WeightCodes};

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
    pub mod weight_quant {
        pub use crate::weight_quant::*;
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
    pub mod sparse_linear {
        pub use crate::sparse_linear::*;
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
