//! The steps of a transformer block around its linears, each one operation where burn's own
//! modules queue a chain of them: RMSNorm (optionally after the residual add), the SiLU-gated
//! product of a fused gate/up projection, and RoPE + KV-cache write + causal attention.
//!
//! Why: at decode sizes a model's step is bound by the host's cost of queuing operations, not
//! by the GPU (burn-fusion costs ~10 us per operation; a Llama block queues ~50 with burn's
//! `RmsNorm`, `RotaryEncoding`, `slice_assign` and `silu`, and ~10 with these).
//!
//! On burn-cuda (`CubeBackend<CudaRuntime, ..>` and `Fusion` over it, chosen at run time from
//! the tensors' type, as [`causal_attention`](crate::causal_attention) does) bf16 and f16
//! tensors run this crate's kernels (`cuda/kernels/`) in f32 with one rounding per output;
//! everything else runs the reference: burn's own modules (`RmsNorm::forward`, `silu`,
//! `RotaryEncoding`'s table, `slice_assign`), which is also the tests' oracle.
//!
//! - `steps.rs`: the steps and their reference path;
//! - `with_linear.rs`: each step and the linear that reads its output, as one operation;
//! - `decoder_block.rs`: a whole pre-norm block ([`decoder_block`]);
//! - `cuda.rs` (feature `cuda`): burn-cuda's tensors to this crate's kernels.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod decoder_block;
mod steps;
mod with_linear;

pub use decoder_block::{DecoderBlock, decoder_block};
pub use steps::{RopeAttention, add_rms_norm, rms_norm, rope_attention, silu_mul};
pub use with_linear::{
    add_rms_norm_linear, rms_norm_linear, rope_attention_linear, silu_mul_linear,
};
