//! CubeCL kernels of SlideSparse, generic over the CubeCL runtime, plus the index math they
//! share with the CPU packer and reference path.
//!
//! - [`geometry`]: pattern geometry (`K_pad`, `K_slide`, `K'`) and the lift index map `src(o)`.
//! - [`grouping`]: how the grouped quant+lift kernel cuts a row (groups, units, registers).
//! - [`rounding`]: INT8 and FP8 rounding by a multiplication and the integer E4M3 encoder,
//!   bit-identical to the spec's division (host mirrors of the kernels' arithmetic).
//! - `quant_lift` (feature `cubecl`): fused per-token quantization + lift, and the plain
//!   per-token quantization of the dense baseline (the same kernel without the lift).
//! - `epilogue` (feature `cubecl`): dequantization + bias.
//! - `stream_probe` (feature `cubecl`): the probe kernel whose launch, watched through
//!   CUPTI, tells burn-slidesparse which CUDA stream cubecl launches on.
//!
//! This crate has no burn dependency: burn integration lives in `burn-slidesparse`.

#[cfg(feature = "cubecl")]
pub mod epilogue;
pub mod geometry;
pub mod grouping;
#[cfg(feature = "cubecl")]
pub mod quant_lift;
pub mod rounding;
#[cfg(feature = "cubecl")]
pub mod stream_probe;

pub use geometry::{SlideGeometry, lift_source_unbounded};
