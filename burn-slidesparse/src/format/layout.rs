//! How a packed layer's weight is stored: the compact `(2N-2):2N` layout (written since
//! version 3) or the slid `W'` (versions 1 and 2, still read), and the conversion of either
//! into the slid codes a [`PackedLinear`] holds.

use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::{OwnedTensor, check_tensor_shape, dtype_of, read_codes, tensor};
use crate::{
    compact::CompactCodes,
    error::{Result, SlideSparseError},
    pack::PackedLinear,
    slide::SlideElement,
    weight_quant::{WeightCodes, map_codes},
};

use super::LayerMeta;

/// Suffix of a compact layer's kept codes (version 3).
pub const KEPT_SUFFIX: &str = ".slidesparse.kept";
/// Suffix of a compact layer's zero-pair ranks (version 3).
pub const ZERO_PAIRS_SUFFIX: &str = ".slidesparse.zero_pairs";

/// How a layer's weight codes are stored in a packed file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightLayout {
    /// `P.slidesparse.weight`, the slid `W' [out, K']` (versions 1 and 2; a layer entry
    /// without a `layout` field is this one).
    #[default]
    Slid,
    /// `P.slidesparse.kept` and `P.slidesparse.zero_pairs`: per block of `2N` weights its
    /// `2N-2` kept codes and the rank of its pair of zero positions (version 3, written by
    /// this crate): 0.83x the dense INT8 bytes at 6:8, where the slid form is 1.5x.
    Compact,
}

/// The compact tensors of a packed layer: its kept codes (`[out, blocks * (2N-2)]`, the
/// precision's dtype) and its packed ranks (`U8 [out, rank bytes per row]`).
pub(super) fn compact_tensors(
    layer: &PackedLinear,
    prefix: &str,
) -> Result<[(String, OwnedTensor); 2]> {
    let geometry = layer.geometry();
    let rows = layer.out_features();
    let packed_ranks: Vec<u8>;
    let kept = map_codes!(&layer.weight.codes, slid => {
        let compact =
            CompactCodes::from_slid(slid, rows, &geometry, layer.pattern, &layer.name)?;
        packed_ranks = compact.packed_ranks();
        compact.kept
    });
    let rank_bytes = CompactCodes::<i8>::rank_row_bytes(layer.pattern, layer.in_features);
    Ok([
        (
            format!("{prefix}{KEPT_SUFFIX}"),
            OwnedTensor {
                dtype: dtype_of(layer.precision()),
                shape: vec![rows, kept.len() / rows.max(1)],
                data: kept.to_le_bytes(),
            },
        ),
        (
            format!("{prefix}{ZERO_PAIRS_SUFFIX}"),
            OwnedTensor {
                dtype: Dtype::U8,
                shape: vec![rows, rank_bytes],
                data: packed_ranks,
            },
        ),
    ])
}

/// The slid codes of a compact layer read from `st`: both tensors checked (shapes, dtypes,
/// every rank, nothing past `K`), then un-compacted and slid as the packer slides.
pub(super) fn read_compact(
    path: &str,
    st: &SafeTensors<'_>,
    meta: &LayerMeta,
) -> Result<WeightCodes> {
    let (rows, k, len) = (
        meta.out_features,
        meta.in_features,
        meta.pattern.block_len(),
    );
    let kept_name = format!("{}{KEPT_SUFFIX}", meta.prefix);
    let kept_view = tensor(path, st, &kept_name)?;
    check_tensor_shape(&kept_name, &kept_view, &[rows, k.div_ceil(len) * (len - 2)])?;
    let kept = read_codes(&kept_name, &kept_view, meta.precision)?;

    let pairs_name = format!("{}{ZERO_PAIRS_SUFFIX}", meta.prefix);
    let pairs = tensor(path, st, &pairs_name)?;
    let rank_bytes = CompactCodes::<i8>::rank_row_bytes(meta.pattern, k);
    check_tensor_shape(&pairs_name, &pairs, &[rows, rank_bytes])?;
    if pairs.dtype() != Dtype::U8 {
        return Err(SlideSparseError::UnsupportedDtype {
            name: pairs_name,
            dtype: format!("{:?}", pairs.dtype()),
            context: "zero-pair ranks are U8 (packed bits)".into(),
        });
    }
    let geometry = meta.pattern.geometry(k, meta.alignment);
    Ok(map_codes!(kept, kept => {
        let compact = CompactCodes::from_parts(
            meta.pattern, rows, k, kept, pairs.data(), path, &kept_name,
        )?;
        slid(&compact, &geometry, path, &kept_name)?
    }))
}

/// The slid `[rows, K']` codes of a compact layout, as the packer's slide writes them.
fn slid<T: SlideElement>(
    compact: &CompactCodes<T>,
    geometry: &cubecl_kernels::SlideGeometry,
    path: &str,
    tensor: &str,
) -> Result<Vec<T>> {
    compact.to_slid(geometry).map_err(|(row, block, nonzeros)| {
        SlideSparseError::packed(
            path,
            format!("{tensor}: row {row}, block {block} ({nonzeros} nonzeros) does not slide"),
        )
    })
}
