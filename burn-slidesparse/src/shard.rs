//! Tensor-parallel sharding of one layer (Megatron-style), on the host, at load time.
//!
//! - **Column-parallel** splits the output channels: rank `r` of `R` holds rows
//!   `[r·out/R, (r+1)·out/R)` of `W'` with their scales and bias. Every rank reads the whole
//!   input; the outputs are concatenated (or stay split for a row-parallel layer after).
//! - **Row-parallel** splits the input width `K` into `R` equal slices of whole pattern
//!   blocks: rank `r` holds the slid columns of its blocks and reads only its slice of the
//!   input; the partial outputs are summed. The bias is on rank 0 only, so the sum adds it
//!   once and every shard stays a complete layer whose epilogue adds its own bias.
//!
//! A row-parallel split of a slid weight is exact: the slide works block by block, so block
//! `g` of a row always lands in slid columns `[g·4(N-1), (g+1)·4(N-1))`, and a slice of
//! whole blocks of `W` is a slice of slid columns of `W'`, padded to the shard's own `K'`.
//! Each shard is the layer that packing its slice of the pruned weight would give, up to the
//! weight scales, which stay those of the whole row (the un-sharded layer's numbers).

use std::fmt;

use crate::{
    error::{Result, SlideSparseError},
    pack::PackedLinear,
    permute::InputPermutation,
    slide::SlideElement,
    weight_quant::{QuantizedWeight, WeightCodes, map_codes},
};

/// How a layer is split over tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Parallelism {
    /// Output channels split (`out / R` per rank): q/k/v and gate/up projections.
    Column,
    /// Input width split (`K / R` per rank, on whole pattern blocks), partial outputs
    /// summed: the o and down projections.
    Row,
}

impl fmt::Display for Parallelism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Parallelism::Column => "column-parallel",
            Parallelism::Row => "row-parallel",
        })
    }
}

/// One rank's part of a dense quantized layer ([`QuantizedLinear`](crate::QuantizedLinear)'s
/// weight and bias).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseShard {
    /// `[out/R, K]` (column-parallel) or `[out, K/R]` (row-parallel) codes and scales.
    pub weight: QuantizedWeight,
    /// The bias slice (column-parallel), or the whole bias on rank 0 only (row-parallel).
    pub bias: Option<Vec<f32>>,
}

/// Splits a packed layer over `ranks` ranks, rank 0 first. Each shard keeps the layer's
/// name, pattern and alignment and is a valid packed layer on its own.
///
/// Errors ([`SlideSparseError::InvalidSplit`]): no ranks; column-parallel with `out` not a
/// multiple of `ranks`; row-parallel with `K` not a multiple of `ranks · 2N`.
pub fn shard_packed(
    layer: &PackedLinear,
    parallelism: Parallelism,
    ranks: usize,
) -> Result<Vec<PackedLinear>> {
    let rows = layer.out_features();
    match parallelism {
        Parallelism::Column => {
            let per_rank = column_split(&layer.name, rows, ranks)?;
            Ok((0..ranks)
                .map(|r| PackedLinear {
                    weight: take_rows(&layer.weight, r * per_rank, per_rank),
                    bias: slice_bias(layer.bias.as_deref(), r * per_rank, per_rank),
                    ..layer.clone_without_weights()
                })
                .collect())
        }
        Parallelism::Row => {
            let block = layer.pattern.block_len();
            let k_shard = row_split(&layer.name, layer.in_features, ranks, block)?;
            let geometry = layer.pattern.geometry(k_shard, layer.alignment);
            // Whole blocks, so the shard's slid columns are one contiguous range of `W'`.
            let slid = geometry.k_slide();
            (0..ranks)
                .map(|r| {
                    Ok(PackedLinear {
                        in_features: k_shard,
                        weight: take_columns(&layer.weight, r * slid, slid, geometry.k_prime()),
                        bias: layer.bias.clone().filter(|_| r == 0),
                        input_permutation: local_permutation(layer, ranks, r, k_shard)?,
                        ..layer.clone_without_weights()
                    })
                })
                .collect()
        }
    }
}

/// Rank `rank`'s part of a row-parallel layer's input permutation, in the rank's own input
/// columns. A rank reads only its slice of `K`, so the permutation must keep every slice's
/// channels within the slice; one that moves a channel across ranks cannot be split.
fn local_permutation(
    layer: &PackedLinear,
    ranks: usize,
    rank: usize,
    k_shard: usize,
) -> Result<Option<InputPermutation>> {
    let Some(p) = &layer.input_permutation else {
        return Ok(None);
    };
    let start = rank * k_shard;
    let slice = &p.as_slice()[start..start + k_shard];
    let local: Option<Vec<u32>> = slice
        .iter()
        .map(|&c| (c as usize).checked_sub(start).filter(|&c| c < k_shard))
        .map(|c| c.map(|c| c as u32))
        .collect();
    let local = local.ok_or_else(|| SlideSparseError::InvalidSplit {
        layer: layer.name.clone(),
        ranks,
        detail: format!(
            "row-parallel: the input permutation moves channels across the ranks' slices of K              (rank {rank} reads channels {start}..{}): pack with a permutation within each              slice, or without one",
            start + k_shard
        ),
    })?;
    Ok(Some(InputPermutation::new(local)?).filter(|p| !p.is_identity()))
}

/// Splits a dense quantized `[out, K]` weight and its bias over `ranks` ranks, rank 0 first
/// (the dense baseline of the same model, split as its packed layers are). Row-parallel
/// needs `K` to be a multiple of `ranks` only: a dense weight has no blocks.
pub fn shard_quantized(
    name: &str,
    weight: &QuantizedWeight,
    bias: Option<&[f32]>,
    parallelism: Parallelism,
    ranks: usize,
) -> Result<Vec<DenseShard>> {
    if let Some(b) = bias
        && b.len() != weight.rows
    {
        return Err(SlideSparseError::shape(
            format!("{name}: bias"),
            [weight.rows],
            [b.len()],
        ));
    }
    match parallelism {
        Parallelism::Column => {
            let per_rank = column_split(name, weight.rows, ranks)?;
            Ok((0..ranks)
                .map(|r| DenseShard {
                    weight: take_rows(weight, r * per_rank, per_rank),
                    bias: slice_bias(bias, r * per_rank, per_rank),
                })
                .collect())
        }
        Parallelism::Row => {
            let k_shard = row_split(name, weight.cols, ranks, 1)?;
            Ok((0..ranks)
                .map(|r| DenseShard {
                    weight: take_columns(weight, r * k_shard, k_shard, k_shard),
                    bias: bias.filter(|_| r == 0).map(<[f32]>::to_vec),
                })
                .collect())
        }
    }
}

/// The input columns rank `rank` reads: everything (column-parallel) or its slice of `K`
/// (row-parallel, `K / ranks` wide). Assumes a split that [`shard_packed`] accepted.
pub fn input_range(
    parallelism: Parallelism,
    in_features: usize,
    ranks: usize,
    rank: usize,
) -> std::ops::Range<usize> {
    match parallelism {
        Parallelism::Column => 0..in_features,
        Parallelism::Row => {
            let k = in_features / ranks;
            rank * k..(rank + 1) * k
        }
    }
}

fn no_ranks(name: &str) -> SlideSparseError {
    SlideSparseError::InvalidSplit {
        layer: name.to_string(),
        ranks: 0,
        detail: "at least one rank is needed".into(),
    }
}

/// Output channels per rank.
fn column_split(name: &str, rows: usize, ranks: usize) -> Result<usize> {
    if ranks == 0 {
        return Err(no_ranks(name));
    }
    if !rows.is_multiple_of(ranks) {
        return Err(SlideSparseError::InvalidSplit {
            layer: name.to_string(),
            ranks,
            detail: format!(
                "column-parallel: out = {rows} output channels are not a multiple of {ranks}"
            ),
        });
    }
    Ok(rows / ranks)
}

/// Input columns per rank: `K / ranks`, which must be a multiple of `block` (`2N` for a
/// packed layer, so that no pattern block straddles two ranks; 1 for a dense one).
fn row_split(name: &str, k: usize, ranks: usize, block: usize) -> Result<usize> {
    if ranks == 0 {
        return Err(no_ranks(name));
    }
    let unit = ranks * block;
    if k == 0 || !k.is_multiple_of(unit) {
        let needed = if block == 1 {
            format!("{ranks} ranks")
        } else {
            format!(
                "ranks x 2N = {ranks} x {block} = {unit} (each rank must hold whole pattern \
                 blocks)"
            )
        };
        return Err(SlideSparseError::InvalidSplit {
            layer: name.to_string(),
            ranks,
            detail: format!("row-parallel: K = {k} is not a positive multiple of {needed}"),
        });
    }
    Ok(k / ranks)
}

fn slice_bias(bias: Option<&[f32]>, start: usize, len: usize) -> Option<Vec<f32>> {
    bias.map(|b| b[start..start + len].to_vec())
}

/// Rows `[start, start + len)` of a row-major weight with their scales.
fn take_rows(weight: &QuantizedWeight, start: usize, len: usize) -> QuantizedWeight {
    let cols = weight.cols;
    QuantizedWeight {
        rows: len,
        cols,
        codes: map_codes!(&weight.codes, v => v[start * cols..(start + len) * cols].to_vec()),
        scales: weight.scales[start..start + len].to_vec(),
    }
}

/// Columns `[start, start + len)` of every row, zero-padded to `width` columns; the scales
/// are per row and stay whole.
fn take_columns(
    weight: &QuantizedWeight,
    start: usize,
    len: usize,
    width: usize,
) -> QuantizedWeight {
    QuantizedWeight {
        rows: weight.rows,
        cols: width,
        codes: map_codes!(&weight.codes, v => column_slice(v, weight.cols, start, len, width)),
        scales: weight.scales.clone(),
    }
}

fn column_slice<T: SlideElement>(
    values: &[T],
    cols: usize,
    start: usize,
    len: usize,
    width: usize,
) -> Vec<T> {
    let mut out = vec![T::ZERO; values.len() / cols.max(1) * width];
    if cols == 0 || width == 0 {
        return out;
    }
    for (dst, src) in out.chunks_exact_mut(width).zip(values.chunks_exact(cols)) {
        dst[..len].copy_from_slice(&src[start..start + len]);
    }
    out
}

impl PackedLinear {
    /// A copy of the layer's metadata with empty weights, for building shards.
    fn clone_without_weights(&self) -> PackedLinear {
        PackedLinear {
            name: self.name.clone(),
            pattern: self.pattern,
            in_features: self.in_features,
            alignment: self.alignment,
            weight: QuantizedWeight {
                rows: 0,
                cols: 0,
                codes: WeightCodes::F32(Vec::new()),
                scales: Vec::new(),
            },
            bias: None,
            input_permutation: self.input_permutation.clone(),
        }
    }
}
