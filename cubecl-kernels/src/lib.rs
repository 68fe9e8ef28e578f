//! CubeCL kernels of SlideSparse, generic over the CubeCL runtime, plus the index math they
//! share with the CPU packer and reference path.
//!
//! - [`geometry`]: pattern geometry (`K_pad`, `K_slide`, `K'`) and the lift index map `src(o)`.
//! - `quant_lift` (feature `cuda`): fused per-token quantization + lift, the plain per-token
//!   quantization of the dense baseline, and the pure lift for 16-bit types.
//! - `epilogue` (feature `cuda`): dequantization + bias.
//!
//! This crate has no burn dependency: burn integration lives in `burn-slidesparse`.

pub mod geometry;

pub use geometry::{SlideGeometry, lift_source_unbounded};
